"""Trainer stage on real features: the bundled target run by the real extractor over a few real conversations
(questions about Python standard-library modules, answered with the modules' own documentation)."""
from __future__ import annotations

import importlib
import json
import re
import shutil
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from eyas.batching import collate, collate_rows, eval_plan
from eyas.drafter import NORM_FLAGS, Drafter, TTTCache
from eyas.exports import eagle_config, export_drafter, speculators_config, unsupported_engines
from eyas.features import FeatureReader, is_validation
from eyas.layout import Layout, LayoutMismatch
from eyas.manifest import ArtifactWriter, DatasetFacts, Manifest, read_manifest, sha256_file
from eyas.methods import get_method, load_drafter
from eyas.methods.eagle3 import drafter_config
from eyas.settings import Settings
from eyas.stage import StageContext
from eyas.store import Artifact, open_artifact
from eyas.target import BUNDLED, BUNDLED_HUB_ID, load_target_head, load_tokenizer, tokenizer_hash
from eyas.ttt import label_rows, target_top, ttt_forward
from orchestration.embedded import EmbeddedRunner
from services.trainer import core
from services.trainer.data import epoch_plan
from services.trainer.spec import Spec
from services.trainer.vocab import select_vocab, token_counts

EAGLE3 = get_method("eagle3")
# The bundled target's default layout (drafter_config reads only how many aux layers it has).
BUNDLED_LAYOUT = Layout(target=BUNDLED, target_config_hash="c", tokenizer_hash="t", num_layers=30, hidden_size=576,
                        vocab_size=49152, aux_layers=(1, 14, 26))

MODULES = ["json", "csv", "argparse", "collections", "itertools", "functools", "pathlib", "shutil", "tempfile",
           "subprocess", "threading", "queue", "heapq", "bisect", "statistics", "fractions", "decimal", "random",
           "string", "textwrap", "difflib", "datetime", "calendar", "hashlib", "hmac", "secrets", "base64",
           "struct", "codecs", "pickle", "copy", "pprint", "enum", "dataclasses", "contextlib", "abc", "typing",
           "weakref", "inspect", "logging", "sqlite3", "zipfile", "tarfile", "socket", "asyncio", "email"]
VAL_EVERY = 5
SMALL = {"ttt_steps": 2, "draft_vocab_size": 256, "batch_tokens": 256, "lr": 1e-3, "warmup": 2, "val_every": 10}


def conversations() -> list[dict]:
    recs = []
    for name in MODULES:
        doc = (importlib.import_module(name).__doc__ or "").strip()
        if len(doc) >= 80:
            recs.append({"id": name, "messages": [
                {"role": "user", "content": f"What is the Python module {name} for?"},
                {"role": "assistant", "content": doc[:400]}]})
    return recs


@pytest.fixture(scope="module")
def emb(tmp_path_factory) -> EmbeddedRunner:
    # the tests' own temporary directories hold the files they name
    return EmbeddedRunner(Settings(workdir=tmp_path_factory.mktemp("trainer"),
                                   input_roots=[tmp_path_factory.getbasetemp()]))


@pytest.fixture(scope="module")
def features(emb) -> str:
    data = Artifact(emb.store, "datasets/docs")
    w = ArtifactWriter(data)
    w.put_bytes("conversations-00000.jsonl", "".join(json.dumps(r) + "\n" for r in conversations()).encode())
    w.commit(Manifest(kind="dataset", id="docs",
                      dataset=DatasetFacts(target=BUNDLED, tokenizer_hash=tokenizer_hash(load_tokenizer(BUNDLED)))))
    job = emb.run_job("extract", {"data": data.uri})[-1]
    assert job.state == "succeeded", job.error
    return job.artifacts["output"]


@pytest.fixture(scope="module")
def trained(emb, features):
    spec = {"features": features, "ttt_steps": 2, "draft_vocab_size": 512, "batch_tokens": 256, "steps": 40,
            "lr": 3e-3, "warmup": 5, "val_interval": 20, "val_every": VAL_EVERY, "checkpoint_every": 10}
    job = emb.run_job("train", spec)[-1]
    assert job.state == "succeeded", job.error
    return job


class Crash(RuntimeError):
    pass


class Ctx(StageContext):
    """A stage context whose worker dies at a given step (fault injection); progress is otherwise not stored."""

    crash_at: int | None = None

    def progress(self, done: int, *_) -> None:
        if done == self.crash_at:
            raise Crash(f"worker died at step {done}")


def context(emb: EmbeddedRunner, name: str, crash_at: int | None = None) -> Ctx:
    ctx = Ctx(job_id=name, settings=emb.settings, store=emb.store,
              output=Artifact(emb.store, f"drafters/{name}"))
    ctx.crash_at = crash_at
    return ctx


def history(ctx: StageContext) -> dict:
    return json.loads(ctx.output.get_bytes("history.json"))


# ---------------------------------------------------------------- draft vocabulary


def test_vocab_is_top_frequency_with_id_ties_and_low_id_padding():
    counts = torch.zeros(20, dtype=torch.int64)
    counts[[7, 3, 12, 5]] = torch.tensor([5, 9, 5, 1])
    assert select_vocab(counts, 3).tolist() == [3, 7, 12]  # 3 (9), then 7 and 12 tie at 5: lower id first
    assert select_vocab(counts, 6).tolist() == [0, 1, 3, 5, 7, 12]  # 4 seen ids, padded with the lowest unused
    assert select_vocab(counts, 21).tolist() == list(range(20))  # Vd = min(requested, V): the whole vocabulary
    with pytest.raises(ValueError, match="draft_vocab_size"):
        select_vocab(counts, 0)


def test_vocab_counts_supervised_train_tokens_only(features):
    samples = list(FeatureReader(open_artifact(features)).samples())
    train = [s for i, s in enumerate(samples) if not is_validation(i, VAL_EVERY)]
    counts = token_counts(train, 49152)
    want = torch.zeros(49152, dtype=torch.int64)
    for s in train:
        for tok, m in zip(s.input_ids.tolist(), s.loss_mask.tolist(), strict=True):
            want[tok] += m
    assert torch.equal(counts, want)
    assert int(counts.sum()) == sum(int(s.loss_mask.sum()) for s in train)


# ---------------------------------------------------------------- TTT


def reference_ttt(drafter: Drafter, sample, head: torch.Tensor, steps: int, decay: float):
    """Spec §4 written out position by position as serving drafts: for each index t, a fresh cache, step 0 over
    the context 0..t, then one token per step (teacher-forced x_{t+1+k}, position t+k, the previous pre-norm
    state), against the target's distribution at t+1+k restricted to the draft vocabulary."""
    ids, mask, T = sample.input_ids, sample.loss_mask, sample.input_ids.numel()
    used = torch.arange(drafter.cfg.draft_vocab_size) + drafter.d2t
    y = sample.final_hidden.float()
    full_top = (y @ head.T).argmax(-1)
    p = torch.softmax(y @ head[used].T, -1)
    ce, correct, count = torch.zeros(steps), torch.zeros(steps), torch.zeros(steps)
    for t in range(T - 1):
        cache = TTTCache()
        h = drafter.project(sample.aux_hidden[None, : t + 1].float())
        for k in range(steps):
            s = t + 1 + k
            if s >= T:
                break
            if k == 0:
                h = drafter.step(ids[None, 1: t + 2], h, torch.arange(t + 1)[None], cache)[:, -1:]
            else:
                h = drafter.step(ids[None, s: s + 1], h, torch.tensor([[t + k]]), cache)
            if mask[t + k] and drafter.t2d[full_top[s]]:
                logq = torch.log_softmax(drafter.logits(h)[0, 0], -1)
                ce[k] += -(p[s] * logq).sum()
                correct[k] += float(logq.argmax() == p[s].argmax())
                count[k] += 1
    objective = sum(decay ** k * ce[k] for k in range(steps))
    return objective, ce, correct, count


@torch.no_grad()
def test_ttt_forward_is_the_serving_recursion(features):
    """ttt_forward's batched, teacher-forced TTT equals drafting each position the way an engine does."""
    sample = next(iter(FeatureReader(open_artifact(features)).samples()))
    sample.input_ids, sample.loss_mask = sample.input_ids[:24], sample.loss_mask[:24].clone()
    sample.aux_hidden, sample.final_hidden = sample.aux_hidden[:24], sample.final_hidden[:24]
    sample.loss_mask[:] = 1
    sample.loss_mask[3] = 0
    embed, head = load_target_head(BUNDLED)
    torch.manual_seed(0)
    drafter = Drafter(drafter_config(BUNDLED, 2048, BUNDLED_LAYOUT))
    drafter.embed_tokens.weight.copy_(embed)
    counts = torch.bincount(sample.input_ids, minlength=49152)
    drafter.set_vocab(select_vocab(counts, 2048))
    steps = 3
    got = ttt_forward(drafter, collate([sample]), head, steps, decay=0.8)
    objective, ce, correct, count = reference_ttt(drafter, sample, head, steps, 0.8)
    assert got.count.tolist() == count.tolist() and count[0] > 15
    assert got.correct.tolist() == correct.tolist()
    torch.testing.assert_close(got.ce_sum, ce, rtol=1e-4, atol=1e-3)
    torch.testing.assert_close(got.objective, objective, rtol=1e-4, atol=1e-3)
    # Padding a sample into a longer batch changes nothing; a precomputed target top-1 changes nothing.
    other = FeatureReader(open_artifact(features)).samples()
    longer = [s for s in other if s.input_ids.numel() > 24][0]
    top = target_top(sample.final_hidden, head, label_rows(sample.loss_mask))
    padded = collate([sample, longer], [top, target_top(longer.final_hidden, head)])
    both = ttt_forward(drafter, padded, head, steps, decay=0.8)
    alone = ttt_forward(drafter, collate([longer]), head, steps, decay=0.8)
    torch.testing.assert_close(both.ce_sum, got.ce_sum + alone.ce_sum, rtol=1e-4, atol=1e-3)
    assert both.count.tolist() == (got.count + alone.count).tolist()


@pytest.mark.parametrize("parallel", [False, True])  # EAGLE-3's chain, P-EAGLE's mask slots
def test_a_packed_row_trains_each_sample_as_if_it_were_alone(features, parallel):
    """Samples packed into one row give each sample the loss terms, accuracy counts and gradient it gets alone:
    attention, positions and the TTT steps' shifted labels stay inside each sample."""
    reader = FeatureReader(open_artifact(features))
    a, b, c = sorted(reader.samples(), key=lambda s: s.input_ids.numel())[:3]
    embed, head = load_target_head(BUNDLED)
    torch.manual_seed(0)
    drafter = Drafter(drafter_config(BUNDLED, 2048, BUNDLED_LAYOUT, parallel=parallel))
    drafter.embed_tokens.weight.copy_(embed)
    drafter.set_vocab(select_vocab(sum(torch.bincount(s.input_ids, minlength=49152) for s in (a, b, c)), 2048))

    def run(batch):
        drafter.zero_grad()
        r = ttt_forward(drafter, batch, head, 3, decay=0.8)
        r.objective.backward()
        return r, drafter.fc.weight.grad.clone()

    def masked(s, keep: bool):  # the sample, its loss mask zeroed unless kept
        return type(s)(s.input_ids, s.loss_mask * int(keep), s.aux_hidden, s.final_hidden)

    alone = [run(collate([s])) for s in (a, b, c)]
    packed = collate_rows([[c, a, b]])
    assert packed.segments is not None and packed.lengths.tolist() == [sum(s.input_ids.numel() for s in (a, b, c))]
    for s, (want, want_grad) in zip((a, b, c), alone, strict=True):  # each alone in the packed row c, a, b
        got, grad = run(collate_rows([[masked(t, t is s) for t in (c, a, b)]]))  # its neighbours supervise nothing
        assert got.count.tolist() == want.count.tolist() and want.count[0] > 0
        assert got.correct.tolist() == want.correct.tolist()
        torch.testing.assert_close(got.ce_sum, want.ce_sum, rtol=1e-4, atol=1e-4)
        torch.testing.assert_close(grad, want_grad, rtol=1e-4, atol=1e-5 * float(want_grad.abs().max()))
    # all three packed, and packed with a padded second row: the sums of the three alone
    for rows in ([[c, a, b]], [[c, a], [b]]):
        got, grad = run(collate_rows(rows))
        assert got.count.tolist() == sum(r.count for r, _ in alone).tolist()
        assert got.correct.tolist() == sum(r.correct for r, _ in alone).tolist()
        torch.testing.assert_close(got.ce_sum, sum(r.ce_sum for r, _ in alone), rtol=1e-4, atol=1e-4)
        torch.testing.assert_close(grad, sum(g for _, g in alone), rtol=1e-4, atol=1e-5 * float(grad.abs().max()))


def test_packed_plan_visits_every_sample_once_within_budget_with_less_padding():
    g = torch.Generator().manual_seed(0)
    lengths = torch.randint(20, 400, (300,), generator=g).tolist()
    padded, packed = (epoch_plan(lengths, 1024, seed=0, epoch=0, pack=pack) for pack in (False, True))
    for plan in (padded, packed):
        assert sorted(i for batch in plan for row in batch for i in row) == list(range(300))

    def cells(batch):  # tokens the batch's tensors hold: rows × the fullest row
        return len(batch) * max(sum(lengths[i] for i in row) for row in batch)

    assert all(len(row) == 1 for batch in padded for row in batch)
    assert all(cells(batch) <= 1024 for batch in packed)
    assert any(len(row) > 1 for batch in packed for row in batch)
    pad = [1 - sum(lengths) / sum(cells(batch) for batch in plan) for plan in (padded, packed)]
    assert pad[1] < pad[0] / 2, pad


# ---------------------------------------------------------------- training


def most_frequent_token_baseline(features: str) -> float:
    """Step-0 accuracy of always proposing the train split's most frequent target top-1 token."""
    _, head = load_target_head(BUNDLED)
    tops = {True: [], False: []}
    for i, s in enumerate(FeatureReader(open_artifact(features)).samples()):
        top = target_top(s.final_hidden, head)
        tops[is_validation(i, VAL_EVERY)].append(top[1:][s.loss_mask[:-1].bool()])
    best = torch.cat(tops[False]).bincount().argmax()
    val = torch.cat(tops[True])
    return float((val == best).float().mean())


def test_short_run_learns(trained, features):
    art = open_artifact(trained.artifacts["output"])
    manifest = read_manifest(art, kind="drafter")
    h = json.loads(art.get_bytes("history.json"))
    assert [e["step"] for e in h["val"]] == [0, 20, 40]
    assert [e["step"] for e in h["train"]] == list(range(1, 41))
    assert (set(h["train"][0]) == {"step", "loss", "acc", "lr", "tokens_per_s", "epoch", "samples"}
            and len(h["train"][0]["acc"]) == 2)
    first, last = h["val"][0], h["val"][-1]
    assert last["loss"] < 0.75 * first["loss"]
    # ~3k supervised tokens of human-written text: the drafter tops out near 25 % here (more, and the target's
    # own text, give far more); always proposing the most frequent token gets ~11 %.
    baseline = most_frequent_token_baseline(features)
    assert last["acc"][0] > max(1.8 * baseline, 0.18), (last["acc"], baseline)
    assert last["acc"][1] > baseline
    # the artifact: manifest contract, exports, history, no leftover checkpoints
    assert manifest.layout == FeatureReader(open_artifact(features)).manifest.layout
    assert manifest.inputs == [features]
    assert manifest.drafter.val_every == VAL_EVERY and manifest.drafter.ttt_steps == 2
    assert manifest.drafter.unsupported_engines == {}  # the default layout serves on both engines
    assert manifest.metrics["val_acc"] == last["acc"]
    assert set(manifest.files) == {"eagle/config.json", "eagle/model.safetensors", "speculators/config.json",
                                   "speculators/model.safetensors", "history.json"}
    assert not [n for n in art.names() if n.startswith("checkpoints/")]
    assert trained.metrics["val_acc"] == last["acc"] and trained.progress.done == 40


EAGLE_SHAPES = {  # SmolLM2-135M target: H = 576, 9 heads, 3 kv heads, head_dim 64, I = 1536, V = 49152
    "fc.weight": [576, 1728],
    "midlayer.input_layernorm.weight": [576], "midlayer.hidden_norm.weight": [576],
    "midlayer.self_attn.q_proj.weight": [576, 1152], "midlayer.self_attn.k_proj.weight": [192, 1152],
    "midlayer.self_attn.v_proj.weight": [192, 1152], "midlayer.self_attn.o_proj.weight": [576, 576],
    "midlayer.post_attention_layernorm.weight": [576],
    "midlayer.mlp.gate_proj.weight": [1536, 576], "midlayer.mlp.up_proj.weight": [1536, 576],
    "midlayer.mlp.down_proj.weight": [576, 1536],
    "norm.weight": [576], "lm_head.weight": [512, 576], "d2t": [512], "t2d": [49152],
}


def read_tensors(path: Path) -> dict[str, torch.Tensor]:
    with safe_open(str(path), "pt") as f:
        return {k: f.get_tensor(k) for k in f.keys()}  # noqa: SIM118


def test_exports_have_the_engine_layouts(trained, features, tmp_path):
    art = open_artifact(trained.artifacts["output"])
    for name in read_manifest(art).files:
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        art.get_file(name, tmp_path / name)
    eagle = read_tensors(tmp_path / "eagle/model.safetensors")
    assert {k: list(v.shape) for k, v in eagle.items()} == EAGLE_SHAPES
    assert eagle["d2t"].dtype == torch.int64 and eagle["t2d"].dtype == torch.bool
    assert all(v.dtype == torch.float32 for k, v in eagle.items() if k not in ("d2t", "t2d"))
    used = torch.arange(512) + eagle["d2t"]
    assert torch.equal(used, torch.nonzero(eagle["t2d"]).flatten())  # ascending target ids, i + d2t[i]
    cfg = json.loads((tmp_path / "eagle/config.json").read_text())
    assert cfg["architectures"] == ["LlamaForCausalLMEagle3"] and cfg["model_type"] == "llama"
    assert (cfg["num_hidden_layers"], cfg["hidden_size"], cfg["vocab_size"], cfg["draft_vocab_size"]) == (
        1, 576, 49152, 512)
    assert cfg["tie_word_embeddings"] is False and cfg["norm_before_residual"] is False
    assert cfg["hidden_act"] == "silu" and cfg["rope_theta"] == 100000.0
    assert "eagle_aux_hidden_state_layer_ids" not in cfg and "eagle_config" not in cfg  # default layers: omitted
    assert "target_hidden_size" not in cfg  # H == H_t

    spec_t = read_tensors(tmp_path / "speculators/model.safetensors")
    renamed = {k.replace("midlayer.", "layers.0."): v for k, v in eagle.items()}
    assert spec_t.keys() == renamed.keys() | {"embed_tokens.weight"}
    assert all(torch.equal(spec_t[k], renamed[k]) for k in renamed)
    scfg = json.loads((tmp_path / "speculators/config.json").read_text())
    assert scfg["speculators_model_type"] == "eagle3" and scfg["norm_before_residual"] is False
    assert scfg["draft_vocab_size"] == 512 and scfg["target_hidden_size"] == 576
    layer = scfg["transformer_layer_config"]
    assert layer["model_type"] == "llama" and layer["num_hidden_layers"] == 1 and layer["vocab_size"] == 49152
    sc = scfg["speculators_config"]
    assert sc["algorithm"] == "eagle3" and sc["default_proposal_method"] == "greedy"
    assert sc["proposal_methods"][0]["proposal_type"] == "greedy"
    assert sc["proposal_methods"][0]["speculative_tokens"] == 2
    assert sc["verifier"] == {"name_or_path": BUNDLED_HUB_ID, "architectures": ["LlamaForCausalLM"]}  # no machine path
    assert scfg["eagle_aux_hidden_state_layer_ids"] == [2, 15, 27]  # default layers, vLLM numbering, written
    assert torch.equal(spec_t["embed_tokens.weight"], load_target_head(BUNDLED)[0])  # the target's

    # THE loader reads eagle/ back into the same drafter: its validation accuracy is the manifest's.
    embed, head = load_target_head(BUNDLED)
    drafter, _ = load_drafter(tmp_path / "eagle", embed)
    samples = list(FeatureReader(open_artifact(features)).samples())
    val = [s for i, s in enumerate(samples) if is_validation(i, VAL_EVERY)]
    correct, count = torch.zeros(2), torch.zeros(2)
    with torch.no_grad():
        for idx in eval_plan([s.input_ids.numel() for s in val], 512):
            r = ttt_forward(drafter, collate([val[i] for i in idx]), head, 2)
            correct, count = correct + r.correct, count + r.count
    acc = (correct / count).tolist()
    assert acc == pytest.approx(read_manifest(art).metrics["val_acc"], abs=1e-6)


def test_the_speculators_export_names_the_verifier_the_spec_gives(emb, features):
    ctx = context(emb, "trn-verifier")
    core.run(core.Spec(features=features, steps=1, val_interval=0, verifier="/srv/models/smollm2", **SMALL), ctx)
    cfg = json.loads(ctx.output.get_bytes("speculators/config.json"))
    assert cfg["speculators_config"]["verifier"]["name_or_path"] == "/srv/models/smollm2"


def test_export_refuses_layouts_an_engine_would_capture_differently(tmp_path):
    drafter = Drafter(drafter_config(BUNDLED, 64, BUNDLED_LAYOUT))
    drafter.set_vocab(torch.arange(64))
    dcfg, weights = drafter.cfg, drafter.state_dict()
    base = dict(target=BUNDLED, target_config_hash="c", tokenizer_hash="t", num_layers=30, hidden_size=576,
                vocab_size=49152)
    verifier = {"name_or_path": "x", "architectures": []}
    # Non-default layers not starting at out(1): SGLang versions disagree on the offset → vLLM only, and the
    # export says why SGLang is not supported.
    written, unsupported = export_drafter(dcfg, weights, Layout(aux_layers=(2, 14, 25), **base), tmp_path / "a",
                                          "float32", verifier, 3, EAGLE3)
    assert len(written) == 4 and set(unsupported) == {"sglang"} and "PR #25454" in unsupported["sglang"]
    # Non-default layers starting at out(1): per-engine ids are written, and both engines capture them.
    layout = Layout(aux_layers=(1, 14, 25), **base)
    _, unsupported = export_drafter(dcfg, weights, layout, tmp_path, "float32", verifier, 3, EAGLE3)
    assert unsupported == {}
    cfg = json.loads((tmp_path / "eagle/config.json").read_text())
    assert cfg["eagle_aux_hidden_state_layer_ids"] == [2, 15, 26]
    assert cfg["eagle_config"]["eagle_aux_hidden_state_layer_ids"] == [1, 14, 25]
    # A config written for the default layers does not serve features of other layers (and vice versa).
    default_cfg = eagle_config(dcfg, Layout(aux_layers=(1, 14, 26), **base), "float32")
    with pytest.raises(LayoutMismatch, match="vllm would concatenate"):
        unsupported_engines(layout, default_cfg, speculators_config(cfg, layout, verifier, 3, EAGLE3), EAGLE3)
    with pytest.raises(LayoutMismatch, match="vllm would concatenate"):
        unsupported_engines(layout, cfg, speculators_config(default_cfg, Layout(aux_layers=(1, 14, 26), **base),
                                                            verifier, 3, EAGLE3), EAGLE3)
    # A drafter whose fc takes another number of aux layers than the layout names is refused before writing.
    with pytest.raises(LayoutMismatch, match="concatenates 3 aux layers, the layout 2"):
        export_drafter(dcfg, weights, Layout(aux_layers=(1, 14), **base), tmp_path / "b", "float32", verifier, 3,
                       EAGLE3)
    assert not (tmp_path / "b").exists()


@pytest.mark.parametrize("norms", [{"fc_norm": True, "norm_output": True}, {"norm_before_fc": True}])
def test_eagle31_norms_export_and_load_as_trained(norms, tmp_path):
    """EAGLE 3.1's norms: the configs carry the flags vLLM and speculators read, SGLang is listed as unable to serve
    them, and THE loader reads either export back into a drafter with the same draft steps."""
    torch.manual_seed(0)
    drafter = Drafter(drafter_config(BUNDLED, 64, BUNDLED_LAYOUT, **norms))
    drafter.set_vocab(torch.arange(64))
    with torch.no_grad():  # norms that are not the identity, so that dropping one would show
        for name, p in drafter.named_parameters():
            if "norm" in name:
                p.uniform_(0.5, 1.5)
    weights = {**drafter.state_dict(), "embed_tokens.weight": torch.randn(49152, 576)}
    drafter.embed_tokens.weight.data.copy_(weights["embed_tokens.weight"])
    layout = Layout(target=BUNDLED, target_config_hash="c", tokenizer_hash="t", num_layers=30, hidden_size=576,
                    vocab_size=49152, aux_layers=(1, 14, 26))
    _, unsupported = export_drafter(drafter.cfg, weights, layout, tmp_path, "float32", {"name_or_path": None}, 3,
                                    EAGLE3)
    assert set(unsupported) == {"sglang"} and "EAGLE 3.1" in unsupported["sglang"]
    for sub in ("eagle", "speculators"):
        cfg = json.loads((tmp_path / sub / "config.json").read_text())
        assert {k: cfg.get(k, False) for k in NORM_FLAGS} == {
            "norm_before_fc": False, "fc_norm": False, "norm_output": False, **norms}
        assert set(norms) <= {k for k in cfg if cfg[k] is True}  # top level, where the engines read them
    aux, ids = torch.randn(1, 9, 3 * 576) * 20, torch.randint(0, 49152, (1, 9))
    want = _draft_logits(drafter, aux, ids)
    for sub in ("eagle", "speculators"):
        loaded, _ = load_drafter(tmp_path / sub, weights["embed_tokens.weight"])
        assert all(getattr(loaded.cfg, k) == v for k, v in norms.items())
        assert all(torch.allclose(a, b, atol=1e-5) for a, b in zip(_draft_logits(loaded, aux, ids), want, strict=True))
    with pytest.raises(ValueError, match="alternatives"):
        Spec(features="file:///x", norm_before_fc=True, fc_norm=True)


def _draft_logits(drafter: Drafter, aux: torch.Tensor, ids: torch.Tensor) -> list[torch.Tensor]:
    with torch.no_grad():
        hidden, cache, pos = drafter.project(aux), TTTCache(), torch.arange(ids.shape[1])[None]
        out = []
        for k in range(2):
            hidden = drafter.step(ids, hidden, pos + k, cache)
            out.append(drafter.logits(hidden))
    return out


def test_features_of_another_target_are_refused(emb, features, tmp_path):
    src = Path(open_artifact(features).store.root)
    shutil.copytree(src, tmp_path / "f")
    m = json.loads((tmp_path / "f/manifest.json").read_text())
    m["layout"]["tokenizer_hash"] = "0123456789abcdef"
    (tmp_path / "f/manifest.json").write_text(json.dumps(m))
    spec = core.Spec(features=str(tmp_path / "f"), steps=1, **SMALL)
    with pytest.raises(LayoutMismatch, match="tokenizer_hash"):
        core.run(spec, context(emb, "trn-foreign"))


def test_features_of_other_target_layers_are_refused_by_name(emb, features):
    """A spec that names the layers its drafter reads (aux_layers, e.g. DFlash's spread) refuses features that
    captured others, saying which and how to extract them."""
    spec = core.Spec(features=features, steps=1, method="dflash", aux_layers=[1, 14, 27], **SMALL)
    with pytest.raises(LayoutMismatch, match=r"aux_layers: the spec asks for out\(1, 14, 27\).*captured "
                                             r"out\(1, 14, 26\): extract with aux_layers \[1, 14, 27\]"):
        core.run(spec, context(emb, "trn-layers"))


def _tampered_copy(features: str, dest: Path, tamper, rehash: bool) -> str:
    """A copy of a features artifact whose first shard went through `tamper(path)`; with rehash the manifest is
    made to agree with the new bytes (a buggy writer), without it the manifest still has the original hash."""
    shutil.copytree(Path(open_artifact(features).store.root), dest)
    m = json.loads((dest / "manifest.json").read_text())
    shard = sorted(n for n in m["files"] if n.startswith("shard-"))[0]
    tamper(dest / shard)
    if rehash:
        m["files"][shard] = {"sha256": sha256_file(dest / shard), "bytes": (dest / shard).stat().st_size}
        (dest / "manifest.json").write_text(json.dumps(m))
    return str(dest)


def _poison(path: Path) -> None:
    t = load_file(str(path))
    t["aux_hidden"][7, 3] = float("nan")  # token 7: the first sample's
    save_file(t, str(path))


@pytest.mark.parametrize("case, tamper, rehash, reason", [
    ("nan", _poison, True, r"non-finite values \(NaN/inf\) in aux_hidden of sample 0 .*token 7"),
    ("truncated", lambda p: p.write_bytes(p.read_bytes()[: p.stat().st_size // 2]), False,
     "sha256 differs from the manifest"),
])
def test_bad_features_fail_the_job_by_name_and_commit_nothing(emb, features, tmp_path, case, tamper, rehash, reason):
    bad = _tampered_copy(features, tmp_path / case, tamper, rehash)
    with pytest.raises(Exception, match=reason):
        emb.run_job("train", {"features": bad, "steps": 2, **SMALL})
    [job] = [j for j in emb.jobs.list(stage="train", state="failed") if j.spec["features"] == bad]
    assert re.search(reason, job.error), job.error  # the job record says why
    out = open_artifact(f"{emb.settings.store_root}/drafters/{job.id}")
    assert not out.exists("manifest.json")  # no drafter a later stage could pick up


@pytest.mark.parametrize("method, exports", [("eagle3", ("eagle/model.safetensors", "speculators/model.safetensors")),
                                             ("dflash", ("dflash/model.safetensors",))])
def test_interrupted_run_resumes_with_the_same_next_losses(emb, features, method, exports):
    """For DFlash too: its random anchors are drawn from (seed, step, rank), so a resumed run draws the ones the
    uninterrupted run drew."""
    spec = core.Spec(features=features, steps=4, checkpoint_every=2, val_interval=2, method=method, **SMALL)
    straight = context(emb, f"trn-straight-{method}")
    core.run(spec, straight)

    crashed = context(emb, f"trn-crashed-{method}", crash_at=3)
    with pytest.raises(Crash):
        core.run(spec, crashed)
    latest = json.loads(crashed.output.get_bytes("checkpoints/latest.json"))
    assert latest["step"] == 2  # the crash at step 3 lost step 3
    # Another spec must not continue this checkpoint.
    changed = spec.model_copy(update={"lr": 5e-4, "resume": crashed.output.uri})
    with pytest.raises(ValueError, match="lr"):
        core.run(changed, context(emb, f"trn-changed-{method}"))

    crashed.crash_at = None
    core.run(spec, crashed)  # the redelivered task: resume="auto" continues from its own checkpoint
    a, b = history(straight), history(crashed)
    assert [e["loss"] for e in a["train"]] == [e["loss"] for e in b["train"]]
    assert [e["acc"] for e in a["train"]] == [e["acc"] for e in b["train"]]
    assert a["val"] == b["val"] and [e["step"] for e in a["val"]] == [0, 2, 4]
    for name in exports:
        assert straight.output.get_bytes(name) == crashed.output.get_bytes(name)


def test_ddp_two_processes_match_one(emb, features):
    # the batches DDP trains: a sample per row (one process packs them unless told not to)
    spec = core.Spec(features=features, steps=2, val_interval=0, pack=False, **{**SMALL, "batch_tokens": 512})
    one, two = context(emb, "trn-one"), context(emb, "trn-two")
    core.run(spec, one)
    core.run(spec.model_copy(update={"processes": 2}), two)
    a, b = history(one), history(two)
    assert [e["step"] for e in b["train"]] == [1, 2] and two.metrics["step"] == 2
    assert [e["loss"] for e in b["train"]] == pytest.approx([e["loss"] for e in a["train"]], rel=1e-4)
    assert [e["loss"] for e in b["val"]] == pytest.approx([e["loss"] for e in a["val"]], rel=1e-4)
    wa = read_tensors_bytes(one.output.get_bytes("eagle/model.safetensors"))
    wb = read_tensors_bytes(two.output.get_bytes("eagle/model.safetensors"))
    for k in wa:
        torch.testing.assert_close(wb[k], wa[k], rtol=1e-3, atol=1e-5)


def read_tensors_bytes(data: bytes) -> dict[str, torch.Tensor]:
    from safetensors.torch import load

    return load(data)


def test_peagle_drafts_k_tokens_in_one_causal_forward_and_exports_what_vllm_reads(tmp_path):
    """P-EAGLE: the TTT structure with the mask token and state fed after step 0 (what training, the replay and the
    in-process decoding run) computes what the engine's single causal forward over [context, K−1 mask slots]
    computes; the export carries mask_token_id and mask_hidden where vLLM and the speculators library read them,
    SGLang is listed as unable to serve it, and the loader reads either export back."""
    torch.manual_seed(0)
    drafter = Drafter(drafter_config(BUNDLED, 64, BUNDLED_LAYOUT, parallel=True))
    drafter.set_vocab(torch.arange(64))
    embed = torch.randn(49152, 576)
    drafter.embed_tokens.weight.data.copy_(embed)
    with torch.no_grad():
        drafter.mask_hidden.normal_(0, 20)
    assert drafter.cfg.mask_token_id == 49151
    n, K = 9, 4
    aux, ids = torch.randn(1, n, 3 * 576) * 20, torch.randint(0, 49152, (1, n))
    with torch.no_grad():
        cache, pos = TTTCache(), torch.arange(n)[None]
        hidden = drafter.step(ids, drafter.project(aux), pos, cache)
        chained = [drafter.logits(hidden)[:, -1]]
        tok, hidden = ids[:, -1:], hidden[:, -1:]
        for j in range(1, K):
            hidden = drafter.step(*drafter.feed(tok, hidden), pos[:, -1:] + j, cache)
            chained.append(drafter.logits(hidden)[:, -1])
        slots = torch.full((1, K - 1), drafter.cfg.mask_token_id)
        states = torch.cat([drafter.project(aux), drafter.project(drafter.mask_hidden).expand(1, K - 1, -1)], 1)
        once = drafter.step(torch.cat([ids, slots], 1), states, torch.arange(n + K - 1)[None], TTTCache())
        torch.testing.assert_close(drafter.logits(once)[0, n - 1:], torch.cat(chained), rtol=1e-4, atol=1e-4)
        # what a step after the first takes does not depend on what was drafted before it
        fed = drafter.feed(tok + 1, hidden * 2)
        assert torch.equal(fed[0], drafter.feed(tok, hidden)[0]) and torch.equal(fed[1], drafter.feed(tok, hidden)[1])

    weights = {**drafter.state_dict(), "embed_tokens.weight": embed}
    _, unsupported = export_drafter(drafter.cfg, weights, BUNDLED_LAYOUT, tmp_path, "float32",
                                    {"name_or_path": None}, 3, get_method("peagle"))
    assert set(unsupported) == {"sglang"} and "P-EAGLE" in unsupported["sglang"]
    eagle_cfg = json.loads((tmp_path / "eagle" / "config.json").read_text())
    spec_cfg = json.loads((tmp_path / "speculators" / "config.json").read_text())
    assert eagle_cfg["architectures"] == ["LlamaForCausalLMEagle3"] and eagle_cfg["mask_token_id"] == 49151
    assert spec_cfg["speculators_model_type"] == "peagle" and spec_cfg["mask_token_id"] == 49151
    assert "mask_token_id" not in spec_cfg["transformer_layer_config"]
    assert load_file(str(tmp_path / "eagle" / "model.safetensors"))["mask_hidden"].shape == (3 * 576,)
    assert load_file(str(tmp_path / "speculators" / "model.safetensors"))["mask_hidden"].shape == (1, 1, 3 * 576)
    for sub in ("eagle", "speculators"):
        loaded, _ = load_drafter(tmp_path / sub, embed)
        assert loaded.cfg.mask_token_id == 49151 and torch.equal(loaded.mask_hidden, drafter.mask_hidden)
        assert all(torch.allclose(a, b, atol=1e-5)
                   for a, b in zip(_draft_logits(loaded, aux, ids), _draft_logits(drafter, aux, ids), strict=True))
