"""The docs stay true to the tree: the README's Layout names every module of eyas/, each stage and orchestration/, and
every path it names exists; the README's and docs/' links reach their files; every `bench/README.md § Name` a
comment points at is a section of bench/README.md. Pure and fast: it reads files only."""
from __future__ import annotations

import re
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
README = REPO / "README.md"
BENCH_README = REPO / "bench" / "README.md"
STAGES = ("generator", "extractor", "trainer", "evaluator")


def layout() -> dict[str, set[str]]:
    """The README's Layout block: each top-level path → the names listed under it.

    A line that starts in column 0 opens a path (`eyas/`, `docs/eagle3.md`); an indented line lists names of that
    path (`a.py b.py`, or a package `api/`) up to the first run of two spaces, its description after. A line of
    description alone (indented further, no name) continues the one before."""
    text = README.read_text()
    section = text.split("\n## Layout\n", 1)[1]
    block = section.split("```\n", 2)[1]
    entries: dict[str, set[str]] = {}
    current = None
    for line in block.splitlines():
        if not line.strip():
            continue
        if not line.startswith(" "):
            current = line.split()[0]
            entries[current] = set()
            continue
        head = line.strip().split("  ", 1)[0]
        names = head.split()
        if current is None or not all(re.fullmatch(r"[\w.]+\.py|\w+/", n) for n in names):
            continue  # a description's continuation
        entries[current].update(names)
    return entries


def modules(folder: Path) -> set[str]:
    """The modules and packages directly in `folder`: `x.py` and `pkg/` (without __init__.py)."""
    found = {p.name for p in folder.glob("*.py") if p.name != "__init__.py"}
    found |= {p.name + "/" for p in folder.iterdir() if p.is_dir() and (p / "__init__.py").exists()}
    return found


@pytest.mark.parametrize("folder", ["eyas", "orchestration", *(f"services/{s}" for s in STAGES)])
def test_layout_names_every_module(folder):
    listed = layout()
    assert f"{folder}/" in listed, f"README Layout has no entry for {folder}/"
    missing = modules(REPO / folder) - listed[f"{folder}/"]
    assert not missing, f"README Layout does not name {sorted(missing)} under {folder}/"


def test_layout_names_every_stage():
    stages = {p.name for p in (REPO / "services").iterdir() if (p / "__init__.py").exists()}
    assert stages == set(STAGES)
    assert {f"services/{s}/" for s in STAGES} <= set(layout())


def test_every_path_the_layout_names_exists():
    for path, names in layout().items():
        assert (REPO / path).exists(), f"README Layout names {path}, which does not exist"
        for name in names:
            assert (REPO / path / name).exists(), f"README Layout names {path}{name}, which does not exist"


def _links(doc: Path) -> list[str]:
    return [m for m in re.findall(r"\]\(([^)\s]+)\)", doc.read_text()) if not re.match(r"\w+://", m)]


@pytest.mark.parametrize("doc", ["README.md", "docs/operations.md", "bench/README.md", "deploy/README.md"])
def test_relative_links_reach_their_files(doc):
    for link in _links(REPO / doc):
        target = link.split("#", 1)[0]
        if target:
            assert ((REPO / doc).parent / target).exists(), f"{doc} links to {link}, which does not exist"


def _anchor(heading: str) -> str:
    """GitHub's anchor for a heading: lower case, punctuation but hyphens and underscores dropped, spaces → '-'."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def test_links_into_markdown_sections_reach_a_heading():
    for doc in ("README.md", "docs/operations.md"):
        for link in _links(REPO / doc):
            if "#" not in link or not link.split("#", 1)[0].endswith(".md"):
                continue
            path, anchor = link.split("#", 1)
            headings = re.findall(r"^#+ (.+)$", ((REPO / doc).parent / path).read_text(), re.M)
            assert anchor in {_anchor(h) for h in headings}, f"{doc}: no heading for {link}"


def _bench_sections() -> set[str]:
    """bench/README.md's section names: each heading without its trailing "(`script.py`)"."""
    headings = re.findall(r"^#+ (.+)$", BENCH_README.read_text(), re.M)
    return {re.sub(r"\s*\(.*\)\s*$", "", h).strip() for h in headings}


def test_pointers_into_bench_readme_name_a_section():
    sections = _bench_sections()
    sources = [*REPO.glob("eyas/**/*.py"), *REPO.glob("services/**/*.py"), *REPO.glob("orchestration/**/*.py"),
               *REPO.glob("bench/*.py"), README, BENCH_README, *REPO.glob("docs/*.md")]
    pointers = 0
    for source in sources:
        for line in source.read_text().splitlines():
            for rest in re.findall(r"bench/README\.md § (.+)", line):
                pointers += 1
                assert any(rest.startswith(s) for s in sections), \
                    f"{source.relative_to(REPO)} points at bench/README.md § {rest!r}: no such section"
    assert pointers >= 10  # the code's measured constants point there


def test_no_run_results_in_code_comments():
    """Comments keep the reason and point at bench/README.md; dates and commits of runs live there."""
    pattern = re.compile(r"#.*(20\d\d-\d\d-\d\d|commit [0-9a-f]{7})")
    for source in [*REPO.glob("eyas/**/*.py"), *REPO.glob("services/**/*.py"), *REPO.glob("orchestration/**/*.py")]:
        for number, line in enumerate(source.read_text().splitlines(), 1):
            assert not pattern.search(line), f"{source.relative_to(REPO)}:{number}: a run's date or commit: {line}"
