"""`eyas run` — the README's main command — end to end on the embedded default, shrunk to a smoke size: prompts
synthesized from the bundled target, generate → extract → train → evaluate, and a summary that says where the
report and the drafter exports are. Run with `--method auto`: EAGLE-3, P-EAGLE and DFlash train on the same
features, each is evaluated, and the last report compares them and names the one predicted fastest."""
from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path
from urllib.parse import unquote, urlparse


def test_eyas_run_ends_with_a_report_and_exports(tmp_path):
    proc = subprocess.run(
        [sys.executable, "-m", "orchestration.cli", "run", "--workdir", str(tmp_path / "w"), "--num-prompts", "4",
         "--max-tokens", "24", "--batch", "4", "--train-steps", "3", "--eval-prompts", "2", "--method", "auto",
         "--live", "off",
         # a short evaluation: 16 new tokens, one prompt of the second held-out set
         "--set", "evaluate.max_new_tokens=16", "--set", "evaluate.second_num_prompts=1"],
        capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    out = proc.stdout
    assert (re.search(r"^measured: decode \d+ tok/s", out, re.M)
            and re.search(r"^plan for 10 min: \d+ prompts", out, re.M))
    # the rest re-planned at every stage boundary from how fast the stages went
    for stage in ("generate", "extract"):
        assert re.search(rf"^re-plan after {stage} \(\d+ s, 4 conversations; .*\): .*train \d+ s", out, re.M), out
    for stage, jobs in (("generate", 1), ("extract", 1), ("train", 3), ("evaluate", 3)):  # planned, re-planned, taken
        assert len(re.findall(rf"^  {stage}\s+succeeded\s+\d+s\s+(\d+s|—)\s+\d+s\s+file://", out, re.M)) == jobs, out
    tau = float(re.search(r"acceptance length τ = ([0-9.]+)", out)[1])
    assert tau >= 1.0
    paths = {name: Path(unquote(urlparse(uri).path)) for name, uri in re.findall(r"^  (\w+): (file://\S+)$", out, re.M)}
    report = json.loads(paths["report_json"].read_text())
    assert report["acceptance_length"] == tau and report["prompts"]["source"] == "bundled:mt_bench"
    # τ is the replay's over both prompts; eyas run decodes one of them for real, counted as the replay counts
    assert report["acceptance"]["prompts"] == 2 and len(report["acceptance"]["per_prompt"]) == 2
    # two of MT-bench's 80, spread over the file: the first and the 41st, not the first two writing prompts
    assert set(report["acceptance"]["per_category"]) == {"writing", "coding"}
    assert report["in_process"]["prompts"] == 1 and report["in_process"]["replay_matches"] is True
    assert (paths["eagle"] / "config.json").is_file() and (paths["speculators"] / "config.json").is_file()
    assert str(tmp_path / "w") in str(paths["report_json"])  # --workdir holds everything
    # every drafter exported, and the last report (DFlash's) compares them under the same step times
    assert all(f"drafter exports, {m}" in out for m in ("eagle3", "peagle", "dflash"))
    assert report["method"] == "dflash" and report["k"] == 3  # DFlash drafts its block: ttt_steps 3, block 4
    methods = report["serving"]["methods"]
    assert [m["method"] for m in methods["methods"]] == ["dflash", "eagle3", "peagle"]
    pick = methods["choice"][0]
    assert pick["concurrency"] == 1 and re.search(rf"^at concurrency 1: serve {pick['method']} ", out, re.M), out
    assert "synthesized 4 prompts" in proc.stderr  # the default trains on prompts synthesized from the target
