"""Evaluator stage: drafter (+ target, + optional live vLLM endpoints) → report.

  1. wiring     the drafter's exports, as vLLM and SGLang load them, feed it the tensors it was trained on (else the
                job fails naming the export, the engine, both layer lists and the kind of mismatch)
  2. accuracy   teacher-forced accuracy per TTT step (eyas.ttt.ttt_forward) on the validation split of
                the drafter's own features (or on all samples of `features` when given)
  3. acceptance the real target's plain greedy output on (held-out MT-bench) prompts (batched), then one
                teacher-forced pass per prompt replayed as K-chains (services.evaluator.chains): τ and per-position
                acceptance in vLLM's definitions for every K ≤ 7, at the cost of a forward per prompt instead of
                one per round; against what teacher-forced accuracy predicts per position; and τ on a second
                held-out set (ShareGPT first turns), so a gain that fits one benchmark only shows
  4. decoding   real greedy chain speculative decoding in-process on the first `decode_prompts` prompts: its
                output must equal the plain greedy output, and its counts the replay's (`in_process`)
  5. live       with `endpoint` / `spec_endpoint`: the same prompts on vLLM without / with the drafter
  6. serving    predicted tokens/s and speed-up per (concurrency, K) from step times measured on the serving engine,
                the best K and where speculation stops paying (services.evaluator.serving); checked live on vLLM
                at the spec's live_concurrencies when both endpoints are given or it can start the missing ones
                (launch.serving_command: the operator's command, else the vLLM environment's server)
Writes reports/{id}/: report.json (a services.evaluator.model.Report), report.html, PNGs, manifest (kind "report").
The job's spec is services.evaluator.spec.Spec.
"""
from __future__ import annotations

import contextlib
import json
import logging
import tempfile
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import unquote, urlparse

import torch

from eyas.batching import collate, eval_plan
from eyas.deadline import Deadline, Pace
from eyas.device import Placement, placement
from eyas.drafter import Drafter
from eyas.exports import HISTORY
from eyas.features import FeatureReader, is_validation
from eyas.layout import Layout
from eyas.manifest import ArtifactWriter, DrafterFacts, Manifest, fetch_verified, read_manifest
from eyas.methods import DEFAULT_METHOD, EXPORT_DIRS, DraftingMethod, load_drafter, method_of
from eyas.objective import objective
from eyas.settings import Settings
from eyas.stage import StageContext, StageResult
from eyas.store import open_artifact
from eyas.streaming import FeatureStream
from eyas.target import Target, load_target, resolve_target
from services.evaluator import alternatives, costmodel, launch, serving, steptime
from services.evaluator import report as reports
from services.evaluator.chains import chain_acceptance, drafted_ks, replay, run_lengths
from services.evaluator.heldout import TrainedOnEvalPrompts, check_held_out
from services.evaluator.live import live_ab
from services.evaluator.model import (
    AcceptanceGap,
    PromptAcceptance,
    Report,
    SecondSetScored,
    SecondSetSkipped,
)
from services.evaluator.spec import Spec
from services.evaluator.specdec import Check, PromptIds, eval_prompts, greedy, measure_acceptance, stop_ids
from services.evaluator.wiring import check_wiring

log = logging.getLogger(__name__)
INPUT_FIELD = "drafter"
# the stage's JSON artifacts (StageResult.artifacts names) and their models: the evaluate service's API schema
# documents them (orchestration.api.openapi)
ARTIFACT_MODELS = {"report_json": Report}


@dataclass
class Subject:
    """What is evaluated: the drafter's fetched exports and facts, and the target it drafts for."""
    uri: str  # the drafter artifact's
    local: Path  # its exports and training history, fetched into the run's temporary directory
    manifest: Manifest
    layout: Layout
    facts: DrafterFacts
    place: Placement
    target: Target
    history: dict | None  # the training history (the loss and accuracy plots), when the drafter has one

    @property
    def method(self) -> DraftingMethod:
        """The drafter's drafting method (its manifest's)."""
        return method_of(self.manifest)

    @property
    def trained_on(self) -> str | None:
        """The drafter's training features."""
        return self.manifest.inputs[0] if self.manifest.inputs else None


@dataclass
class Accuracy:
    per_step: list[float]  # teacher-forced accuracy per TTT step; [] without features
    samples: int
    features_uri: str | None
    steps: int  # TTT steps measured


@dataclass
class Replayed:
    """Prompts, the target's plain greedy outputs, per prompt the run lengths of K_max-chains over them, and their
    replay: K → chain acceptance for every K ≤ K_max."""
    prompts: list[PromptIds]
    outputs: list[list[int]]
    runs: list[list[int]]
    per_k: dict[int, dict]


DEADLINE_BATCH = 16  # prompts per greedy batch under a deadline (the unit it stops at)


@dataclass(frozen=True)
class Cutoff:
    """Score prompts while the next batch, and `after_prompts` prompts' worth and `after_s` seconds of the steps
    after it, fit before `deadline`; never fewer than `floor` prompts."""
    deadline: Deadline
    floor: int
    after_prompts: int = 0
    after_s: float = 0.0

    def another(self, done: int, batch: int, prompt_s: float) -> bool:
        return done < self.floor or self.deadline.fits((batch + self.after_prompts) * prompt_s + self.after_s)


def spread_order(n: int) -> list[int]:
    """0..n-1 in the order 0, n/2, n/4, 3n/4, … (each index's place in the range, bit-reversed): every prefix is
    spread over the range, so prompts spread over a file's categories stay spread whatever prefix a deadline
    leaves."""
    bits = max(1, (n - 1).bit_length())
    return sorted(range(n), key=lambda i: int(f"{(i << bits) // n:0{bits}b}"[::-1], 2))


def _replayed(target, drafter: Drafter, layout: Layout, prompts: list[PromptIds], max_new_tokens: int,
              k: int, check: Check, cutoff: Cutoff | None = None) -> Replayed:
    """The target's plain greedy outputs, per prompt the run lengths of K_max-chains over them (one teacher-forced
    pass each; services.evaluator.chains), and their replay for every K ≤ K_max (K_max covers `k`). `check()` runs
    between decoding steps and between prompts. With a `cutoff`, the prompts go in batches of DEADLINE_BATCH, in
    the order of spread_order, while the cutoff lets another batch in."""
    batch = len(prompts) if cutoff is None else DEADLINE_BATCH
    if cutoff is not None:
        prompts = [prompts[i] for i in spread_order(len(prompts))]
    k_max = max(serving.K_MAX, k)
    outputs: list[list[int]] = []
    runs = []
    pace = Pace()
    pace.mark()
    for i in range(0, len(prompts), max(1, batch)):
        chunk = prompts[i:i + batch]
        if cutoff is not None and pace.known and not cutoff.another(i, len(chunk), pace.seconds()):
            log.info("scored %d of %d prompts before the deadline", i, len(prompts))
            prompts = prompts[:i]
            break
        outs = greedy(target, [p.ids for p in chunk], max_new_tokens, stop_ids(target), check=check)
        for p, out in zip(chunk, outs, strict=True):
            check()
            runs.append(run_lengths(target, drafter, layout.aux_layers, p.ids, out, k_max))
        outputs += outs
        pace.mark(len(chunk))
    return Replayed(prompts, outputs, runs, replay(runs, drafted_ks(drafter, k_max)))


def _per_prompt(replayed: Replayed, k: int) -> list[PromptAcceptance]:
    """Each prompt's own replayed drafts and accepted per position (τ's spread over prompts)."""
    rows = []
    for p, out, run in zip(replayed.prompts, replayed.outputs, replayed.runs, strict=True):
        c = chain_acceptance([run], k)
        rows.append(PromptAcceptance(id=p.id, category=p.category, tokens=len(out), drafts=c["drafts"],
                                     accepted_per_pos=c["accepted_per_pos"]))
    return rows


def _per_category(replayed: Replayed, k: int) -> dict[str, float | None]:
    """τ over each category's prompts (MT-bench's writing, math, coding, …), where the prompt file has them."""
    groups: dict[str, list[list[int]]] = {}
    for p, run in zip(replayed.prompts, replayed.runs, strict=True):
        if p.category:
            groups.setdefault(p.category, []).append(run)
    return {cat: chain_acceptance(rs, k)["acceptance_length"] for cat, rs in groups.items()}


def _gap(accuracy: list[float], measured: list[float | None], k: int) -> AcceptanceGap | None:
    """Measured per-position acceptance against what teacher-forced accuracy predicts: where drafts collapse."""
    if not accuracy:
        return None
    expected = reports.expected_per_position(accuracy, k)
    return AcceptanceGap(expected=expected, measured=measured, ratio=[
        round(m / e, 3) if m is not None and e else None for m, e in zip(measured, expected, strict=True)])


@torch.no_grad()
def teacher_forced_accuracy(drafter: Drafter, lm_head: torch.Tensor, stream: FeatureStream, val_every: int | None,
                            steps: int, batch_tokens: int, check: Check = lambda: None) -> tuple[list[float], int]:
    """Per-TTT-step accuracy over the samples (validation split when val_every is set), read a window of shards
    at a time through the stream's bounded cache; returns (acc, samples). `check()` runs before each batch."""
    correct, count, seen = torch.zeros(steps), torch.zeros(steps), 0
    for window in stream.scan_windows():
        samples = [s for i, s in window if val_every is None or is_validation(i, val_every)]
        for idx in eval_plan([s.input_ids.numel() for s in samples], batch_tokens):
            check()  # DFlash's anchors: fixed per batch, so that a drafter is scored on the same ones each time
            res = objective(drafter, collate([samples[i] for i in idx]), lm_head, steps,
                            generator=torch.Generator().manual_seed(idx[0]))
            correct += res.correct.cpu()
            count += res.count.cpu()
        seen += len(samples)
    stream.close()
    if not seen:
        return [], 0
    return (correct / count.clamp(min=1)).tolist(), seen


def _fetch_drafter(uri: str, dest: Path, settings: Settings) -> Manifest:
    art = open_artifact(uri, settings)
    manifest = read_manifest(art, kind="drafter")
    for name in manifest.files:
        if name.split("/", 1)[0] in EXPORT_DIRS or name == HISTORY:
            (dest / name).parent.mkdir(parents=True, exist_ok=True)
            fetch_verified(art, manifest, name, dest / name)
    served = method_of(manifest).served_dir
    if not (dest / served / "config.json").is_file():
        raise ValueError(f"drafter {uri} has no {served}/ export (config.json + model.safetensors)")
    return manifest


def _local_or_uri(uri: str) -> str:
    """Where a server reads an export from: the path of a file:// URI, else the URI (copy it near the server)."""
    return unquote(urlparse(uri).path) if uri.startswith("file://") else uri


def _open(spec: Spec, ctx: StageContext, local: Path) -> Subject:
    """The drafter's exports and training history fetched into `local`, its layout and training facts, and the
    target loaded."""
    uri = open_artifact(spec.drafter, ctx.settings).uri
    manifest = _fetch_drafter(spec.drafter, local, ctx.settings)
    if not manifest.layout or manifest.drafter is None:
        raise ValueError(f"drafter {spec.drafter}: its manifest lacks the layout or the training facts")
    layout, facts = Layout.from_dict(manifest.layout), manifest.drafter
    place = placement(ctx.settings, spec.dtype)
    target = load_target(spec.target, place)
    history = json.loads((local / HISTORY).read_text()) if (local / HISTORY).is_file() else None
    return Subject(uri=uri, local=local, manifest=manifest, layout=layout, facts=facts, place=place, target=target,
                   history=history)


def _drafted_k(spec: Spec, subject: Subject) -> Spec:
    """A drafter that drafts a fixed block (DFlash) drafts its block's tokens (its training's ttt_steps), whatever K
    the spec asks."""
    method = subject.method
    if method.fixed_block and spec.k != subject.facts.ttt_steps:
        log.info("a %s drafter drafts its block: K = %d (the spec asked %d)", method.title, subject.facts.ttt_steps,
                 spec.k)
        return spec.model_copy(update={"k": subject.facts.ttt_steps})
    return spec


def _wiring(spec: Spec, subject: Subject) -> dict:
    """Step 1: the drafter's exports, as each engine the job names loads them, feed it the tensors it was trained
    on (else WiringMismatch); engines its training facts rule out are listed with the reason instead."""
    unsupported = subject.facts.unsupported_engines
    wiring = check_wiring(subject.layout, subject.local, subject.target,
                          tuple(e for e in spec.engines if e not in unsupported))
    wiring["unsupported"] = {e: why for e, why in unsupported.items() if e in spec.engines}
    if (wiring.get("precision") or {}).get("warning"):
        log.warning("precision: %s", wiring["precision"]["warning"])
    return wiring


def _load_drafter(subject: Subject) -> Drafter:
    """The drafter on the target's input device (where its embedding is), in the target's dtype, as vLLM serves
    it (DFlash with the target's lm_head too)."""
    model = subject.target.model
    drafter, _ = load_drafter(subject.local / subject.method.served_dir,
                              model.get_input_embeddings().weight.detach(), subject.place.dtype,
                              lm_head_weight=model.get_output_embeddings().weight.detach())
    return drafter


def _held_out(spec: Spec, ctx: StageContext, subject: Subject) -> None:
    """The prompts scored must not be ones the drafter was trained on (else TrainedOnEvalPrompts)."""
    checked = check_held_out(spec.prompts, spec.num_prompts, subject.trained_on, ctx.settings)
    ctx.metrics.update(held_out_prompts_checked=checked)


def _accuracy(spec: Spec, ctx: StageContext, subject: Subject, drafter: Drafter) -> Accuracy:
    """Step 2: teacher-forced accuracy per TTT step on the validation split of the drafter's own features, or on
    every sample of `features` when given."""
    features_uri = spec.features or subject.trained_on
    steps = max(spec.k, subject.facts.ttt_steps)
    per_step, samples = [], 0
    if features_uri:
        reader = FeatureReader(open_artifact(features_uri, ctx.settings), expected=subject.layout)
        stream = FeatureStream(reader, int(spec.cache_gb * (1 << 30)))
        val_every = None if spec.features else subject.facts.val_every
        if stream.releases:  # deleted as the trainer consumed them (eyas.handoff, recompute)
            log.warning("features %s were not kept (extracted again each epoch): no teacher-forced accuracy; the "
                        "drafter's manifest has its validation accuracy", features_uri)
            features_uri = None
        else:
            per_step, samples = teacher_forced_accuracy(
                drafter, subject.target.model.get_output_embeddings().weight.detach(), stream, val_every, steps,
                spec.batch_tokens, ctx.check)
    ctx.metrics.update(per_position_accuracy=per_step)
    return Accuracy(per_step, samples, features_uri, steps)


def _acceptance(spec: Spec, ctx: StageContext, subject: Subject, drafter: Drafter) -> Replayed:
    """Step 3: the target's greedy output on the prompts, replayed as K-chains for every K ≤ K_max."""
    prompts = eval_prompts(subject.target.tokenizer, spec.prompts, spec.num_prompts,
                           subject.facts.chat_template_kwargs, ctx.settings)
    cutoff = None
    if spec.finish_by is not None:  # after it: the decoded prompts (a replay and a decoding each), the second set
        after = 2 * (spec.decode_prompts or 0) + (spec.second_num_prompts if spec.second_prompts else 0)
        cutoff = Cutoff(Deadline(spec.finish_by), spec.min_prompts, after, steptime.STEP_TIMES_S)
    replayed = _replayed(subject.target, drafter, subject.layout, prompts, spec.max_new_tokens, spec.k, ctx.check,
                         cutoff)
    return replayed


def _decoding(spec: Spec, ctx: StageContext, subject: Subject, drafter: Drafter, replayed: Replayed) -> dict:
    """Step 4: real speculative decoding of the first `decode_prompts` prompts; its output must equal the plain
    greedy output and its counts the replay's (a warning names either difference)."""
    prompts = replayed.prompts
    n_decode = min(spec.decode_prompts or len(prompts), len(prompts))
    decoded = measure_acceptance(subject.target, drafter, subject.layout.aux_layers, prompts[:n_decode], spec.k,
                                 spec.max_new_tokens, references=replayed.outputs[:n_decode],
                                 progress=lambda done, total: ctx.progress(done, total, "prompts decoded"),
                                 check=ctx.check)
    counted = chain_acceptance(replayed.runs[:n_decode], spec.k)
    decoded["replay_matches"] = (counted["drafts"], counted["accepted_per_pos"]) == (
        decoded["drafts"], decoded["accepted_per_pos"])
    if decoded["greedy_mismatches"]:
        log.warning("speculative output differs from plain greedy for %s", decoded["greedy_mismatches"])
    if not decoded["replay_matches"]:
        log.warning("decoding counted %s drafts / %s accepted, the replay %s / %s", decoded["drafts"],
                    decoded["accepted_per_pos"], counted["drafts"], counted["accepted_per_pos"])
    for tie in decoded["near_ties"]:
        log.info("near tie (%s dtype) at %s", subject.place.dtype_name, tie)
    return decoded


def _live(spec: Spec, ctx: StageContext, replayed: Replayed) -> dict | None:
    """Step 5: with `endpoint` / `spec_endpoint`, the same prompts on vLLM without / with the drafter."""
    if not (spec.endpoint or spec.spec_endpoint):
        return None
    key = ctx.settings.endpoint_api_key  # from the settings: a spec never carries one (eyas.confine)
    live = live_ab(replayed.prompts, spec.max_new_tokens, spec.endpoint, spec.spec_endpoint, spec.concurrency,
                   api_key=key.get_secret_value() if key else None)
    for name in ("baseline", "speculative"):
        if name in live:  # token ids are compared here, not stored
            live[name]["matches_in_process_greedy"] = live[name].pop("outputs") == replayed.outputs
    return live


def _second_set(spec: Spec, ctx: StageContext, subject: Subject,
                drafter: Drafter) -> SecondSetScored | SecondSetSkipped | None:
    """Step 3 on the second held-out prompt set: its τ (a default the user did not pick, so a trained-on set is
    skipped with the reason, not an error)."""
    if spec.second_prompts is None:
        return None
    settings = ctx.settings
    try:
        check_held_out(spec.second_prompts, spec.second_num_prompts, subject.trained_on, settings)
    except TrainedOnEvalPrompts as e:
        return SecondSetSkipped(source=spec.second_prompts, skipped=str(e))
    prompts = eval_prompts(subject.target.tokenizer, spec.second_prompts, spec.second_num_prompts,
                           subject.facts.chat_template_kwargs, settings)
    scored = _replayed(subject.target, drafter, subject.layout, prompts, spec.max_new_tokens, spec.k,
                       ctx.check).per_k[spec.k]
    return SecondSetScored(source=spec.second_prompts, count=len(prompts),
                           acceptance_length=scored["acceptance_length"],
                           per_position_acceptance=scored["per_position_acceptance"])


def _compared(uri: str, ctx: StageContext) -> dict:
    """What compare_methods needs of an earlier evaluation report."""
    report = json.loads(open_artifact(uri, ctx.settings).get_bytes("report.json"))
    serving_ = report["serving"]
    return {"method": report.get("method", DEFAULT_METHOD), "drafter": report["drafter"],
            "tau_per_k": serving_["tau_per_k"], "drafter_s": [tuple(p) for p in serving_["drafter_s"]]}


def _serving(spec: Spec, ctx: StageContext, subject: Subject, drafter: Drafter, replayed: Replayed) -> dict:
    """Step 6: predict serving speed per (concurrency, K) and check it live when vLLM is at hand: the job's
    endpoints, or servers started with launch.serving_command (the speculative one at the
    recommended K)."""
    prompts, per_k = replayed.prompts, replayed.per_k
    method = subject.method
    served = method.served_dir
    model = _local_or_uri(f"{subject.uri}/{served}")
    key = ctx.settings.endpoint_api_key
    api_key = key.get_secret_value() if key else None
    command = launch.serving_command(ctx.settings)
    live_error = None

    def start(config: dict | None = None) -> str | None:
        """A vLLM server this check starts; None, with the reason kept for the report, when it does not serve:
        the check is a finding, not a reason to lose the evaluation."""
        nonlocal live_error
        try:
            return servers.enter_context(launch.vllm(command, resolve_target(spec.target), config, check=ctx.check))
        except launch.NotServing as e:
            live_error = str(e).split("\n", 1)[0][-600:]
            log.warning("live check: %s", live_error)
            return None

    with contextlib.ExitStack() as servers:
        endpoint = spec.endpoint or (start() if command else None)
        times, bounds, measured = serving.measure_steps(subject.target, drafter, method, prompts[0].ids, endpoint,
                                                        api_key, ctx.settings.cache_dir, ctx.check)
        out = {**measured, **serving.predict(times, bounds, per_k, len(prompts), model, method, spec.k)}
        if spec.compare_with:
            out["methods"] = serving.compare_methods(times.target, [
                {"method": method.name, "drafter": subject.uri, "tau_per_k": out["tau_per_k"],
                 "drafter_s": times.drafter},
                *(_compared(uri, ctx) for uri in spec.compare_with)])
        spec_endpoint, spec_k = spec.spec_endpoint, None
        if command and not spec_endpoint:
            spec_k = out["best"][0]["k"] or spec.k
            config = method.speculative_config(str(subject.local / served), spec_k)
            spec_endpoint = start(config) if endpoint else None
        if endpoint and spec_endpoint:
            _check_live(out, spec, endpoint, spec_endpoint, spec_k, replayed, times, api_key, ctx.check,
                        lambda t: serving.predict(t, (t, t), per_k, len(prompts), model, method, spec.k))
    if command and out.get("live_check"):
        # after the drafter's servers stopped: one vLLM at a time on the host
        baseline = {r["concurrency"]: r["baseline_tok_s"] for r in out["live_check"]}
        out["alternatives"] = alternatives.measure_free(
            prompts[:serving.LIVE_PROMPTS], _live_tokens(spec), baseline,
            lambda config: launch.vllm(command, resolve_target(spec.target), config, check=ctx.check),
            api_key, ctx.check, has_module=lambda module: launch.has_module(command, module))
        out["served"] = alternatives.choose(out["live_check"], out["alternatives"])
        out["predicted_decision"], out["decision"] = out["decision"], alternatives.served_decision(out["served"][0])
    if live_error:
        out["live_error"] = live_error
    return out


def _check_live(out: dict, spec: Spec, endpoint: str, spec_endpoint: str, spec_k: int | None,
                replayed: Replayed, times: costmodel.StepTimes, api_key: str | None, check: Check,
                predict: Callable[[costmodel.StepTimes], dict]) -> None:
    """Into `out`: the servers checked against (and the K the speculative one was started at, None: the job's), the
    drafter's cost measured in the engine now that it serves (serving.engine_steps) with the prediction made again
    from the engine's times alone (the in-process draft times stay beside), and the live A/B at the spec's
    concurrencies against that prediction."""
    out["live_endpoints"] = {"endpoint": endpoint, "spec_endpoint": spec_endpoint, "spec_k": spec_k,
                             "started": [name for name, given in (("plain", spec.endpoint),
                                                                  ("spec", spec.spec_endpoint)) if not given]}
    check()
    prompts = replayed.prompts
    times, engine = serving.engine_steps(spec_endpoint, prompts[0].ids, times, api_key)
    in_process, source = out["drafter_s"], out["source"]
    out.update(predict(times), drafter_s=times.drafter, drafter_s_in_process=in_process,
               spec_step_s=engine["spec_step_s"], spec_tokens_per_step=engine["tokens_per_step"],
               spec_step_tau=engine["tau"], source={**source, "drafter": engine["source"]},
               step_noise={**out["step_noise"], "drafter": None})
    out["live_check"] = serving.live_check(prompts[:serving.LIVE_PROMPTS], _live_tokens(spec), endpoint,
                                           spec_endpoint, times, replayed.per_k, api_key, check,
                                           tuple(spec.live_concurrencies))


def _live_tokens(spec: Spec) -> int:
    """Tokens per answer in the live runs: the evaluation's, at most serving.LIVE_MAX_TOKENS."""
    return min(spec.max_new_tokens, serving.LIVE_MAX_TOKENS)


def _report(spec: Spec, subject: Subject, wiring: dict, accuracy: Accuracy, replayed: Replayed, decoded: dict,
            live: dict | None, second: SecondSetScored | SecondSetSkipped | None, served: dict) -> Report:
    """The steps' results as one Report (report.json)."""
    scored = replayed.per_k[spec.k]
    acc = accuracy.per_step
    return Report(
        answer=reports.answer(served, len(replayed.prompts)),
        target=spec.target,
        layout=subject.layout.to_dict(),
        method=subject.method.name,
        k=spec.k,
        per_position_accuracy=acc,
        acceptance_length=scored["acceptance_length"],
        per_position_acceptance=scored["per_position_acceptance"],
        acceptance={"drafts": scored["drafts"], "accepted_per_pos": scored["accepted_per_pos"],
                    "prompts": len(replayed.prompts), "max_new_tokens": spec.max_new_tokens,
                    "method": "the target's greedy output, one teacher-forced pass per prompt replayed as K-chains",
                    "per_category": _per_category(replayed, spec.k),
                    "per_prompt": _per_prompt(replayed, spec.k)},
        exports={name: f"{subject.uri}/{name}" for name in EXPORT_DIRS
                 if f"{name}/config.json" in subject.manifest.files},
        # what the server must render prompts with for the drafter to see what it was trained on
        serve_with={"chat_template_kwargs": subject.facts.chat_template_kwargs},
        expected_acceptance_length=reports.expected_acceptance_length(acc, spec.k) if acc else None,
        acceptance_gap=_gap(acc, scored["per_position_acceptance"], spec.k),
        second_set=second,
        drafter=subject.uri,
        features={"uri": accuracy.features_uri, "split": "all" if spec.features else "validation",
                  "samples": accuracy.samples, "ttt_steps": accuracy.steps},
        prompts={"source": spec.prompts, "count": len(replayed.prompts), "turn": "first user turn"},
        wiring=wiring,
        in_process={key: v for key, v in decoded.items() if key != "per_prompt"},
        per_prompt=decoded["per_prompt"],
        training=subject.manifest.metrics,
        compute={"device": str(subject.target.input_device), "dtype": subject.place.dtype_name},
        live=live,
        serving=served,
    )


def _metrics(report: Report) -> dict:
    """The job's metrics: the report's headline numbers."""
    metrics = {"acceptance_length": report.acceptance_length, "k": report.k, "prompts": report.acceptance.prompts,
               "per_position_acceptance": report.per_position_acceptance,
               "per_position_accuracy": report.per_position_accuracy,
               "matches_greedy": report.in_process.matches_greedy,
               "replay_matches_decoding": report.in_process.replay_matches,
               "serving_decision": report.serving.decision}
    if isinstance(report.second_set, SecondSetScored):
        metrics["second_set_acceptance_length"] = report.second_set.acceptance_length
    if report.live is not None:
        spec = report.live.speculative
        if spec is not None:
            metrics.update(live_tok_s=spec.tok_s, live_acceptance_length=spec.acceptance_length,
                           live_per_position_acceptance=spec.per_position_acceptance)
        if report.live.speedup is not None:
            metrics["live_speedup"] = report.live.speedup
    return metrics


def _write(spec: Spec, ctx: StageContext, report: Report, history: dict | None) -> StageResult:
    """reports/{id}/: report.json, report.html, the PNGs and the manifest (kind "report")."""
    writer = ArtifactWriter(ctx.output)
    for name, data in reports.build(report, history).items():
        writer.put_bytes(name, data)
    metrics = _metrics(report)
    features_uri = report.features.uri
    writer.commit(Manifest(kind="report", id=ctx.job_id, job_spec=spec.model_dump(mode="json"),
                           inputs=[report.drafter] + ([features_uri] if features_uri else []),
                           counts={"prompts": report.acceptance.prompts, "drafts": report.acceptance.drafts,
                                   "accepted": sum(report.acceptance.accepted_per_pos),
                                   "decoded_prompts": report.in_process.prompts,
                                   "accuracy_samples": report.features.samples},
                           layout=report.layout, metrics=metrics))
    out = ctx.output.uri
    return StageResult(output_uri=out, metrics=metrics,
                       artifacts={"report_json": f"{out}/report.json", "report_html": f"{out}/report.html"})


def run(spec: Spec, ctx: StageContext) -> StageResult:
    """The steps of the module docstring, in order, then the report."""
    torch.manual_seed(0)
    with tempfile.TemporaryDirectory(prefix="eyas-eval-") as tmp:
        subject = _open(spec, ctx, Path(tmp))
        spec = _drafted_k(spec, subject)
        wiring = _wiring(spec, subject)
        drafter = _load_drafter(subject)
        _held_out(spec, ctx, subject)
        accuracy = _accuracy(spec, ctx, subject, drafter)
        replayed = _acceptance(spec, ctx, subject, drafter)
        decoded = _decoding(spec, ctx, subject, drafter, replayed)
        ctx.check()
        live = _live(spec, ctx, replayed)
        second = _second_set(spec, ctx, subject, drafter)
        ctx.check()
        served = _serving(spec, ctx, subject, drafter, replayed)
        ctx.check()
    report = _report(spec, subject, wiring, accuracy, replayed, decoded, live, second, served)
    return _write(spec, ctx, report, subject.history)
