"""eyas.confine, the one check of what a job may name, as pure logic (tests/test_hostile.py sends the same kinds of
values to the four APIs): roots, buckets and endpoints from the settings; the pattern the schema carries is the
check; no existence oracle; the head of a prompt file, not all of it, at submit; the command line's own files."""
from __future__ import annotations

import json
from pathlib import Path

import jsonschema_rs
import pytest

from eyas.confine import Names, Policy, Refused, check_spec, redact
from eyas.prompts import BUNDLED_NAMES, PromptFileError, check_prompt_head, load_prompts
from eyas.settings import Settings
from orchestration.embedded import command_line_settings
from orchestration.execution import SpecError, validate_spec
from services.generator.spec import Spec as GenerateSpec

PROMPTS = Names("prompts", exact=BUNDLED_NAMES)
ARTIFACT = Names("artifact")
ENDPOINT = Names("endpoint")
RECORD = json.dumps({"messages": [{"role": "user", "content": "hi"}]}) + "\n"


@pytest.fixture
def tree(tmp_path: Path) -> tuple[Path, Path]:
    root, outside = tmp_path / "root", tmp_path / "outside"
    root.mkdir()
    outside.mkdir()
    (root / "p.jsonl").write_text(RECORD)
    (outside / "secret.jsonl").write_text(RECORD)
    (root / "link.jsonl").symlink_to(outside / "secret.jsonl")
    (root / "up").symlink_to(outside, target_is_directory=True)
    return root, outside


def _service(root: Path | None = None, **kw) -> Policy:
    return Policy.of(Settings(mode="service", s3_bucket="eyas", input_roots=[root] if root else [], **kw))


def _rule(policy: Policy, value: str, marker: Names = PROMPTS) -> str | None:
    try:
        policy.check("f", value, marker)
    except Refused as e:
        return e.rule
    return None


def test_local_paths_only_under_a_root_after_dotdot_and_symlinks(tree):
    root, outside = tree
    policy = _service(root)
    assert _rule(policy, str(root / "p.jsonl")) is None
    for value in (str(outside / "secret.jsonl"), str(root / "link.jsonl"), str(root / "up" / "secret.jsonl"),
                  "/etc/passwd", "/proc/self/mem"):
        assert "input root" in _rule(policy, value), value
    assert "'..'" in _rule(policy, f"{root}/../outside/secret.jsonl")
    assert "absolute" in _rule(policy, "pending/../../etc/passwd")
    # the same refusal whether or not the file exists
    assert _rule(policy, str(outside / "secret.jsonl")) == _rule(policy, str(outside / "nope.jsonl"))
    # inside the root a missing file may say so
    assert "does not exist" in _rule(policy, str(root / "nope.jsonl"))
    # the service default has no roots at all
    assert "input root" in _rule(_service(), str(root / "p.jsonl"))


def test_buckets_and_object_keys(tree):
    policy = _service(allowed_buckets="shared,more")
    assert _rule(policy, "s3://eyas/inputs/p.jsonl") is None and _rule(policy, "s3://more/x") is None
    assert "bucket 'other' is not allowed" in _rule(policy, "s3://other/x")
    assert "credentials" in _rule(policy, "s3://KEY:SECRET@eyas/x")
    for bad_key in ("s3://eyas/../x", "s3://eyas/a//b", "s3://eyas", "s3://eyas/"):
        assert "object key" in _rule(policy, bad_key), bad_key
    assert "not taken here" in _rule(policy, "s3://eyas/x", Names("prompts", s3=False, exact=BUNDLED_NAMES))


def test_endpoints_from_the_allow_list_only():
    service = _service()  # default: the compose vLLM service
    assert _rule(service, "http://vllm:8000", ENDPOINT) is None
    assert _rule(service, "http://vllm:8000/v1/", ENDPOINT) is None
    assert "not an allowed endpoint" in _rule(service, "http://127.0.0.1:6379", ENDPOINT)
    loopback = _service(allowed_endpoints="http://127.0.0.1:*")
    assert _rule(loopback, "http://127.0.0.1:8123", ENDPOINT) is None
    assert "not an allowed endpoint" in _rule(loopback, "http://169.254.169.254/", ENDPOINT)
    anywhere = Policy.of(Settings(mode="embedded"))  # embedded default: any http(s) URL …
    assert _rule(anywhere, "https://api.example.com/v1", ENDPOINT) is None
    # … never with credentials, a query, control characters or another scheme
    assert "credentials" in _rule(anywhere, "http://user:pass@host:8000", ENDPOINT)
    assert "query or fragment" in _rule(anywhere, "http://host:8000/v1?key=s", ENDPOINT)
    assert "control characters" in _rule(anywhere, "http://host:8000\r\nX-Injected: 1", ENDPOINT)
    assert "http:// or https://" in _rule(anywhere, "file:///etc/passwd", ENDPOINT)
    with pytest.raises(ValueError, match="EYAS_ALLOWED_ENDPOINTS"):
        Policy.of(Settings(mode="service", allowed_endpoints="vllm:8000"))


@pytest.mark.parametrize("marker", [PROMPTS, ARTIFACT, ENDPOINT, Names("target", exact=("bundled:t",))])
def test_the_schema_pattern_is_the_check(tree, marker):
    """Python and JSON-schema (ECMA-262) readings of the pattern agree with the check, also on a final newline
    (Python's `$` would match before it)."""
    root, _ = tree
    policy = _service(root, allowed_endpoints="http://vllm:8000,http://127.0.0.1:*")
    schema = jsonschema_rs.validator_for({"type": "string", "pattern": policy.pattern(marker)})
    values = ["bundled:mt_bench", "bundled:t", "s3://eyas/a/b", "s3://eyas/a/b\n", "s3://other/a",
              str(root / "p.jsonl"), f"{root}/p.jsonl\n", f"{root}/../x", "http://vllm:8000", "http://vllm:8000\n", "http://127.0.0.1:1",
              "http://127.0.0.1:65536", f"file://{root}/d", "synth", ""]
    for value in values:
        assert schema.is_valid(value) == (_rule(policy, value, marker) is None), value


def test_a_prompt_file_is_judged_by_its_head(tmp_path):
    big = tmp_path / "big.jsonl"
    big.write_text(RECORD * 400_000 + "{broken\n")  # 20 MB, broken at the very end
    check_prompt_head(big)  # reads 16 kB: a break past the head is the job's to find (no timing: bench/, not tests)
    with pytest.raises(PromptFileError, match="line 400001 is not JSON"):
        load_prompts(big)
    early = tmp_path / "early.jsonl"
    early.write_text(RECORD + "{broken\n" + RECORD * 1000)
    with pytest.raises(PromptFileError, match="line 2 is not JSON"):
        check_prompt_head(early)
    listed = tmp_path / "listed.json"  # a JSON list whose first record fits in the head
    listed.write_text(json.dumps([{"conversations": [{"from": "human", "value": "x" * 100}]}] * 2000))
    check_prompt_head(listed)
    listed.write_text("[" + json.dumps({"no": "messages"}) + "," + json.dumps(["x" * 100] * 2000) + "]")
    with pytest.raises(PromptFileError, match="no 'messages'"):
        check_prompt_head(listed)


def test_redaction_and_the_spec_walk(tree):
    root, outside = tree
    assert redact("http://user:pass@host:8000/v1?key=x#y") == "http://host:8000/v1"
    spec = GenerateSpec.model_validate({"mix": [{"prompts": "synth"}, {"prompts": str(outside / "secret.jsonl")}],
                                        "limit": 4})
    with pytest.raises(Refused) as e:
        check_spec(spec, Settings(mode="service", input_roots=[root]))
    assert e.value.field == "mix.1.prompts"


def test_then_entries_are_checked_and_cannot_set_their_input(tree):
    root, outside = tree
    settings = Settings(mode="service", input_roots=[root], s3_bucket="eyas")
    good = {"prompts": str(root / "p.jsonl"), "endpoint": "http://vllm:8000"}  # (service mode: no in-process target)
    with pytest.raises(SpecError) as e:
        validate_spec("generate", {**good, "then": [{"stage": "extract", "data": "/etc"}]}, settings)
    assert e.value.field == "then[0].data" and "set by the pipeline" in e.value.message
    with pytest.raises(SpecError) as e:
        validate_spec("generate", {**good, "then": ["extract", {"stage": "train", "target": str(outside)}]},
                      settings)
    assert e.value.field == "then[1].target" and "input root" in e.value.message
    with pytest.raises(SpecError) as e:
        validate_spec("generate", {**good, "then": ["extract", {"stage": "train", "lr": float("nan")}]}, settings)
    assert e.value.field == "then[1].lr" and "finite" in e.value.message
    # a list of names (evaluate's compare_with): every item is confined, by its index
    then = ["extract", "train", {"stage": "evaluate", "compare_with": ["s3://eyas/reports/a", str(outside)]}]
    with pytest.raises(SpecError) as e:
        validate_spec("generate", {**good, "then": then}, settings)
    assert e.value.field == "then[2].compare_with.1" and "input root" in e.value.message
    spec = validate_spec("generate", {**good, "limit": 2.0, "then": ["extract", {"stage": "train", "steps": 3.0}]},
                         settings)  # JSON's 2.0 is the integer 2
    assert spec.limit == 2 and isinstance(spec.limit, int)
    for wrong in (True, "2", 2.5):
        with pytest.raises(SpecError, match="integer"):
            validate_spec("generate", {**good, "limit": wrong}, settings)


def test_the_command_line_may_read_what_its_user_names(tree, tmp_path, monkeypatch):
    root, outside = tree
    monkeypatch.chdir(outside)
    spec = {"prompts": "secret.jsonl", "held_out": "bundled:mt_bench", "endpoint": "http://127.0.0.1:8000",
            "then": ["extract", {"stage": "train", "resume": "auto", "target": str(root)}]}
    settings = command_line_settings("generate", spec, tmp_path / "work")
    assert spec["prompts"] == str(outside / "secret.jsonl")  # made absolute
    validate_spec("generate", spec, settings)  # the named file, and the workdir, are roots
    assert {str(outside / "secret.jsonl"), str(root)} <= {str(r) for r in settings.input_roots}
    assert "input root" in _rule(Policy.of(settings), str(outside / "other.jsonl"))
