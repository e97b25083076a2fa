"""`eyas run` — the README's main command — end to end on the embedded default, shrunk to a smoke size: prompts
synthesized from the bundled target, generate → extract → train → evaluate, and a summary (`run.json` in the workdir,
what the terminal shows as data) that says where the report and the drafter exports are. Run with `--method auto`:
EAGLE-3, P-EAGLE and DFlash train on the same features, each is evaluated, and the last report compares them and names
the one predicted fastest."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from urllib.parse import unquote, urlparse

from eyas.manifest import read_manifest
from eyas.store import open_artifact


def local(uri: str) -> Path:
    return Path(unquote(urlparse(uri).path))


def test_eyas_run_ends_with_a_report_and_exports(tmp_path):
    workdir = tmp_path / "w"
    proc = subprocess.run(
        [sys.executable, "-m", "orchestration.cli", "run", "--workdir", str(workdir), "--num-prompts", "4",
         "--max-tokens", "24", "--batch", "4", "--train-steps", "3", "--eval-prompts", "2", "--method", "auto",
         "--live", "off",
         # a short evaluation: 16 new tokens, one prompt of the second held-out set
         "--set", "evaluate.max_new_tokens=16", "--set", "evaluate.second_num_prompts=1"],
        capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    run = json.loads((workdir / "run.json").read_text())
    assert run["finished"] and run["rates"]["decode_tok_s"] > 0 and run["plan"]["num_prompts"] >= 1
    # the rest re-planned at every stage boundary from how fast the stages went
    assert [r["after"] for r in run["replans"]][:2] == ["generate", "extract"]
    assert all(r["conversations"] == 4 and r["seconds"]["train"] > 0 for r in run["replans"][:2])
    jobs = [j["stage"] for j in run["jobs"]]
    assert jobs.count("generate") == jobs.count("extract") == 1 and jobs.count("train") == jobs.count("evaluate") == 3
    assert all(j["state"] == "succeeded" and j["took_s"] > 0 and j["output"].startswith("file://") for j in run["jobs"])
    # the default trains on prompts synthesized from the target
    dataset = read_manifest(open_artifact(run["jobs"][0]["output"]), kind="dataset")
    assert dataset.counts["conversations"] == 4 and dataset.counts["source:synth"] == 4

    report_files = run["report"]["artifacts"]
    report = json.loads(local(report_files["report_json"]).read_text())
    tau = run["report"]["metrics"]["acceptance_length"]
    assert tau >= 1.0 and report["acceptance_length"] == tau and report["prompts"]["source"] == "bundled:mt_bench"
    # τ is the replay's over both prompts; eyas run decodes one of them for real, counted as the replay counts
    assert report["acceptance"]["prompts"] == 2 and len(report["acceptance"]["per_prompt"]) == 2
    # two of MT-bench's 80, spread over the file: the first and the 41st, not the first two writing prompts
    assert set(report["acceptance"]["per_category"]) == {"writing", "coding"}
    assert report["in_process"]["prompts"] == 1 and report["in_process"]["replay_matches"] is True
    # every drafter exported, under --workdir
    assert set(run["exports"]) == {"eagle3", "peagle", "dflash"}
    eagle = run["exports"]["eagle3"]
    assert (local(eagle["eagle"]) / "config.json").is_file() and (local(eagle["speculators"]) / "config.json").is_file()
    assert str(workdir) in str(local(report_files["report_json"]))
    # the last report (DFlash's) compares them under the same step times, and the run names the pick
    assert report["method"] == "dflash" and report["k"] == 3  # DFlash drafts its block: ttt_steps 3, block 4
    methods = run["method_choice"]
    assert methods == report["serving"]["methods"]
    assert [m["method"] for m in methods["methods"]] == ["dflash", "eagle3", "peagle"]
    pick = methods["choice"][0]
    assert pick["concurrency"] == 1 and f"at concurrency 1: serve {pick['method']} " in proc.stdout
