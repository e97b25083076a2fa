"""The evaluation report's data model: `Report` is what report.json holds (`Report.model_dump(mode="json")`), the
contract other tools read. services.evaluator.report renders it (report.json, report.html, PNGs); the evaluate
service's OpenAPI schema carries its JSON schema (the job's `report_json` artifact).

A key documented as "absent" when something was not run is left out of report.json, not written as null.
"""
from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from eyas.methods import DEFAULT_METHOD, METHODS


def _absent_if_none(value: Any) -> bool:
    return value is None


def _schema_without_null(schema: dict[str, Any]) -> None:
    schema.pop("default", None)
    options = [option for option in schema.pop("anyOf", []) if option != {"type": "null"}]
    if len(options) == 1:
        schema.update(options[0])
    else:
        schema["anyOf"] = options


def _absent(description: str | None = None) -> Any:
    """A field left out of the JSON when None (absent, not null), and so documented: not required, never null."""
    return Field(None, exclude_if=_absent_if_none, description=description, json_schema_extra=_schema_without_null)


class _Model(BaseModel):
    # forbid: a key the evaluator writes but the model does not name fails loudly rather than vanish from the JSON;
    # a number where a string is due (a prompt file's numeric category) becomes its text; inf and NaN stay numbers
    # in the JSON form (json.dumps writes them)
    model_config = ConfigDict(extra="forbid", coerce_numbers_to_str=True, ser_json_inf_nan="constants")


class PromptAcceptance(_Model):
    """One prompt's replayed K-chains (τ's spread over prompts)."""
    id: str
    category: str | None = Field(description="the prompt file's category (MT-bench's), if any")
    tokens: int = Field(description="tokens of the target's greedy output")
    drafts: int
    accepted_per_pos: list[int]


class Acceptance(_Model):
    """τ's counts over the target's greedy outputs, and how they were measured."""
    drafts: int = Field(description="verify rounds (each proposes K tokens)")
    accepted_per_pos: list[int]
    prompts: int
    max_new_tokens: int
    method: str
    per_category: dict[str, float | None] = Field(description="τ over each category's prompts")
    per_prompt: list[PromptAcceptance]


class ServeWith(_Model):
    chat_template_kwargs: dict[str, Any] = Field(
        description="what the server must render prompts with for the drafter to see what it was trained on")


class AcceptanceGap(_Model):
    """Measured per-position acceptance against what teacher-forced accuracy predicts (Π of the accuracies)."""
    expected: list[float]
    measured: list[float | None]
    ratio: list[float | None] = Field(description="measured / expected, rounded to 3 places")


class SecondSetScored(_Model):
    """τ on the second held-out prompt set."""
    source: str
    count: int
    acceptance_length: float | None
    per_position_acceptance: list[float]


class SecondSetSkipped(_Model):
    """The second held-out set, skipped: the drafter was trained on it."""
    source: str
    skipped: str = Field(description="why")


class AccuracySamples(_Model):
    """The features teacher-forced accuracy was measured on."""
    uri: str | None
    split: Literal["all", "validation"]
    samples: int
    ttt_steps: int


class PromptSet(_Model):
    source: str
    count: int
    turn: str


class Precision(_Model):
    """The arithmetic the drafter's states were captured at against this target's (dtype and quantization)."""
    trained: str | None = Field(description="the captured states' precision (null: not recorded)")
    target: str = Field(description="what the target evaluated here computes at")
    warning: str | None = Field(None, description="set when the two differ: acceptance may not carry over")


class Wiring(_Model):
    """What each engine concatenates and feeds the drafter (services.evaluator.wiring)."""
    trained: list[str] = Field(description="the layers trained on, as out(i) / embed")
    served: dict[str, list[str]] = Field(description="engine:export → the layers that engine serves")
    ok: bool
    unsupported: dict[str, str] = Field(description="engine → why it cannot serve this drafter")
    precision: Precision | None = None


class TokenLogit(_Model):
    token: int | None = Field(description="null: that output had ended")
    logit: float | None


class Divergence(_Model):
    """Where speculative and greedy output first differ, with the target's logits for both tokens there."""
    position: int
    speculative: TokenLogit
    greedy: TokenLogit
    near_tie: bool


class NearTie(_Model):
    """A divergence within bf16's precision (recorded, not a mismatch)."""
    id: str
    position: int
    speculative: TokenLogit
    greedy: TokenLogit
    near_tie: bool


class InProcess(_Model):
    """Real speculative decoding of the first decode_prompts prompts: equality with greedy, and counts."""
    k: int
    prompts: int
    max_new_tokens: int
    drafts: int
    accepted: int
    accepted_per_pos: list[int]
    acceptance_length: float | None
    per_position_acceptance: list[float | None]
    tokens: int
    target_forwards: int
    matches_greedy: bool
    greedy_mismatches: list[str] = Field(description="prompts whose output differs beyond a near tie")
    near_ties: list[NearTie]
    speculative_tok_s: float | None = Field(description="in-process, one stream (not serving)")
    replay_matches: bool = Field(description="decoding counted the replay's drafts and acceptances")


class DecodedPrompt(_Model):
    """One prompt decoded speculatively in-process."""
    id: str
    prompt_tokens: int
    tokens: int
    drafts: int
    accepted: int
    accepted_per_pos: list[int]
    matches_greedy: bool
    first_difference: int | None
    output: list[int]
    divergence: Divergence | None


class Compute(_Model):
    """The device the target and drafter ran on, and their dtype."""
    device: str
    dtype: str


class _Completions(_Model):
    """Greedy completions of the prompts on one vLLM endpoint."""
    url: str
    model: str
    tokens: int
    seconds: float
    tok_s: float
    concurrency: int


class LiveRun(_Completions):
    """Greedy completions of the prompts on one vLLM endpoint."""
    matches_in_process_greedy: bool


class LiveSpeculativeRun(_Completions):
    """The run on the speculative endpoint, with its spec-decode counters over exactly this run (/metrics)."""
    drafts: int
    draft_tokens: int
    accepted: int
    accepted_per_pos: list[int]
    acceptance_length: float | None
    per_position_acceptance: list[float | None]
    matches_in_process_greedy: bool


class LiveAB(_Model):
    """The same prompts on vLLM without (baseline) and with (speculative) the drafter; each absent when its
    endpoint was not given, speedup and outputs_equal absent unless both ran."""
    prompts: int
    max_tokens: int
    concurrency: int
    baseline: LiveRun | None = _absent()
    speculative: LiveSpeculativeRun | None = _absent()
    speedup: float | None = _absent()
    outputs_equal: bool | None = _absent()


class StepSource(_Model):
    target: str = Field(description="where the target's step times come from")
    drafter: str = Field(description="where the drafter's step times come from")


class SpeculativePoint(_Model):
    """Predicted speculative decoding at one (concurrency, K); tau, tok_s, speedup and speedup_range null where no
    draft was measured at this K."""
    k: int
    tau: float | None
    tok_s: float | None
    step_s: float
    speedup: float | None
    speedup_range: list[float] | None = Field(description="[low, high]: the speed-up within the step times' noise "
                                              "(and, in-process, an engine's cheaper verify)")


class ServingRow(_Model):
    """Predictions at one concurrency."""
    concurrency: int
    plain_tok_s: float
    plain_step_s: float
    speculative: list[SpeculativePoint]


class BestK(_Model):
    """The best measured K at one concurrency; k, speedup and speedup_range null where no K was measured."""
    concurrency: int
    k: int | None
    speedup: float | None
    speedup_range: list[float] | None = Field(description="[low, high] within the step times' noise")
    pays: bool | None = Field(description="the whole interval above 1 (true), none of it (false); null: cannot tell "
                              "(it straddles 1) or no K measured")


class TauNeeded(_Model):
    """The τ the best K at concurrency 1 (no K measured: the cheapest) would need to break even there."""
    k: int
    tau: float


class LiveEndpoints(_Model):
    endpoint: str
    spec_endpoint: str
    spec_k: int | None = Field(None, description="the K the evaluator started the speculative server at (the one "
                               "recommended before the drafter's cost was measured in the engine); null: the job's")
    started: list[str] = Field(description="those the evaluator started and stopped (plain, spec)")


class LiveCheck(_Model):
    """The A/B at one concurrency against the prediction for the K the speculative server runs."""
    concurrency: int
    k: int | None = Field(description="the K the server ran (its counters); null: it drafted nothing")
    predicted_speedup: float | None = Field(description="null: no τ measured in-process at that K")
    measured_speedup: float = Field(description="while every stream decodes")
    relative_error: float | None
    off: bool = Field(description="the prediction misses the measurement by more than costmodel.OFF_BY (15 %)")
    decode_tok_s: list[float] = Field(description="plain, speculative")
    measured_end_to_end_speedup: float
    baseline_tok_s: float
    speculative_tok_s: float
    tau_in_process: float | None
    tau_vllm: float | None
    accepted_per_output_token: float | None = Field(description="the drafter's accepted tokens / output tokens")
    outputs_equal: bool


class FreeRun(_Model):
    """A model-free method the engine serves (services.evaluator.alternatives) at one concurrency, or one row
    saying why its server did not start."""
    method: str = Field(description="ngram (prompt lookup) or suffix")
    served: bool
    concurrency: int | None = Field(description="null: not served")
    config: dict[str, Any] = Field(description="its --speculative-config")
    tok_s: float | None
    speedup: float | None = Field(description="end-to-end tokens/s over the plain server's in the live check")
    tau: float | None
    accepted_per_output_token: float | None
    why: str | None = Field(description="why it was not served (the engine's root cause); null when served")


class ServedChoice(_Model):
    """The fastest measured at one concurrency: plain decoding, this drafter or a free method."""
    concurrency: int
    fastest: str = Field(description="plain, drafter, ngram or suffix")
    speedup: float
    speedups: dict[str, float] = Field(description="every candidate's measured end-to-end speed-up")
    drafter_tau: float | None = Field(description="the drafter's τ on vLLM")


class MethodBest(_Model):
    """One drafter's predictions beside the others (compare_with)."""
    method: str
    drafter: str = Field(description="the drafter artifact's URI")
    best: list[BestK] = Field(description="its best K per concurrency")


class MethodChoice(_Model):
    """The drafter predicted fastest at one concurrency; all null where no drafter's τ was measured."""
    concurrency: int
    method: str | None
    drafter: str | None
    k: int | None
    speedup: float | None


class Methods(_Model):
    """The drafters compared under this engine's target step times, and the one predicted fastest per concurrency."""
    methods: list[MethodBest]
    choice: list[MethodChoice]


class Evidence(_Model):
    """What τ rests on."""
    prompts: int
    drafts_per_k: dict[str, int]


class StepNoise(_Model):
    """Each in-process point's noise: how far its second fastest reading lies above the fastest, relative."""
    target: list[tuple[int, float]] | None = Field(description="null: the target's times come from a vLLM endpoint")
    drafter: list[tuple[int, float]] | None = Field(
        description="null: the drafter's times come from the speculative server (the live check)")


class Serving(_Model):
    """Will this drafter speed up serving (services.evaluator.serving): measured step times, predicted tok/s and
    speed-up per concurrency and K, the best K, and the live check when vLLM was at hand."""
    source: StepSource
    target_s: list[tuple[int, float]] = Field(description="(tokens in one target forward, seconds)")
    drafter_s: list[tuple[int, float]] = Field(description="(batch, seconds of one draft step)")
    drafter_s_in_process: list[tuple[int, float]] | None = _absent(
        "the in-process draft step times, when drafter_s was measured in the engine; absent otherwise")
    spec_step_s: list[tuple[int, float]] | None = _absent(
        "(batch, seconds of one speculative engine step) on the live check's speculative server; absent without it")
    spec_tokens_per_step: float | None = _absent("tokens a speculative engine step emitted, on average, while "
                                                 "spec_step_s was timed (streamed chunks: one a step)")
    spec_step_tau: float | None = _absent("τ the server's counters gave over the same runs: the tokens a step emits, "
                                          "which spec_tokens_per_step must match for a chunk to be a step")
    step_noise: StepNoise
    tau_per_k: dict[str, float | None] = Field(description="K → τ(K); null: no draft measured at that K")
    evidence: Evidence
    table: list[ServingRow]
    best: list[BestK] = Field(description="the best K per concurrency")
    break_even_concurrency: int | None = Field(
        description="speculation loses above this concurrency; null: it pays up to the largest one predicted, or "
                    "no K was measured")
    tau_needed: TauNeeded
    engine: bool = Field(True, description="the target's step times are the serving engine's; false: in-process, "
                         "where each speed-up's range reaches up to a verify that costs one plain step")
    speculative_config: str = Field(description="the exact --speculative-config value")
    decision: str = Field(description="the recommendation in one line")
    per_position_acceptance_per_k: dict[str, list[float]]
    methods: Methods | None = _absent("this drafter beside the reports of compare_with; absent without them")
    live_endpoints: LiveEndpoints | None = _absent("the servers the live check ran against; absent without them")
    live_check: list[LiveCheck] | None = _absent("measured vs predicted speed-up; absent without vLLM")
    alternatives: list[FreeRun] | None = _absent("the engine's model-free methods measured on the same prompts; "
                                                 "absent unless the evaluator starts vLLM itself")
    served: list[ServedChoice] | None = _absent("the fastest measured per live concurrency; absent "
                                                "without alternatives")
    predicted_decision: str | None = _absent("the prediction's sentence, when `decision` is the measured one")
    live_error: str | None = _absent("why a vLLM server the live check started did not serve; absent when all did")


class Answer(_Model):
    """The report's opening: serve the drafter or not, how, what it gains, and what to do next."""
    decision: str = Field(description="serving.decision: the recommendation in one sentence")
    serve: bool | None = Field(description="null: cannot tell (the speed-up's interval straddles 1, or no drafts "
                               "were measured)")
    speculative_config: str = Field(description="the exact vLLM --speculative-config value")
    gains: str = Field(description="the predicted speed-up per concurrency, in words")
    breaks_even: str = Field(description="where speculation stops paying, in words")
    next: str = Field(description="what to do next")


class Report(_Model):
    """An evaluation report (report.json). The evaluator writes every field, `live` only when it was given an
    endpoint; report.REQUIRED names the core any report has (what services.evaluator.report.build checks in a
    report's JSON form)."""
    answer: Answer = Field(description="the answer first: serve it or not, how, what it gains, what next")
    target: str
    layout: dict[str, Any] = Field(description="the drafter's layout (eyas.layout.Layout.to_dict())")
    method: str = Field(DEFAULT_METHOD, description="the drafter's drafting method: " + "; ".join(
        f"{m.name}: {m.summary}" for m in METHODS.values()))
    k: int = Field(description="draft tokens per target forward")
    per_position_accuracy: list[float] = Field(description="teacher-forced accuracy per TTT step; [] without features")
    acceptance_length: float | None = Field(
        description="τ, replayed over the target's greedy output (incl. the bonus token)")
    per_position_acceptance: list[float] = Field(description="vLLM's definition: accepted at position i / drafts")
    acceptance: Acceptance
    exports: dict[str, str] = Field(description="export name → URI")
    serve_with: ServeWith
    expected_acceptance_length: float | None = Field(description="τ expected from the accuracies; null without them")
    acceptance_gap: AcceptanceGap | None = Field(description="null without accuracies")
    second_set: SecondSetScored | SecondSetSkipped | None = Field(
        description="τ on a second held-out prompt set; null: none was asked for")
    drafter: str = Field(description="the drafter artifact's URI")
    features: AccuracySamples
    prompts: PromptSet
    wiring: Wiring
    in_process: InProcess
    per_prompt: list[DecodedPrompt]
    training: dict[str, Any] = Field(description="the drafter's training metrics (its manifest's)")
    compute: Compute
    live: LiveAB | None = _absent("live A/B on vLLM; absent without endpoint / spec_endpoint")
    serving: Serving
