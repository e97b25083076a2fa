"""The train job's spec and the CPU preset `eyas run` uses (no torch here: `eyas --help` builds its flags from the
spec; services.trainer.inputs fills in the machine's defaults and opens the features)."""
from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import ConfigDict, Field, model_validator

from eyas.confine import names
from eyas.defaults import BUNDLED, DEFAULT_CACHE_GB, NORM_FLAGS, DTypeName, check_norm_flags
from eyas.methods import DEFAULT_METHOD, METHODS, get_method
from eyas.stage import UNIX_TIME_MAX, StageSpec

DEFAULT_DRAFT_VOCAB = 8192  # Vd, why this size: services.trainer.vocab

# Settings for a CPU run on the bundled target (`eyas run` merges them into its trainer spec); the measurements
# behind each value: bench/README.md § Trainer CPU preset.
CPU_PRESET: dict[str, Any] = {"ttt_steps": 3, "draft_vocab_size": 4096, "lr": 3e-3, "batch_tokens": 512,
                              "warmup": 10, "epochs": 3.0}


# The schema's statement of the rules the validator applies (the API's schema states every rule submit applies),
# from the methods' facts: not both fc norms (check_norm_flags); no EAGLE 3.1 norm with a method that takes none;
# more than one draft layer only for a method that allows several (a missing method is DEFAULT_METHOD).
_NO_NORMS = [m.name for m in METHODS.values() if not m.takes_norms]
_LAYERED = [m.name for m in METHODS.values() if m.several_layers]
assert not get_method(DEFAULT_METHOD).several_layers  # the draft_layers rule reads a missing method as one layer
_RULES = {"allOf": [
    {"not": {"required": ["norm_before_fc", "fc_norm"],
             "properties": {"norm_before_fc": {"const": True}, "fc_norm": {"const": True}}}},
    *({"not": {"required": ["method", flag], "properties": {"method": {"enum": _NO_NORMS}, flag: {"const": True}}}}
      for flag in NORM_FLAGS if _NO_NORMS),
    {"not": {"required": ["draft_layers"], "properties": {"method": {"not": {"enum": _LAYERED}},
                                                          "draft_layers": {"type": "integer", "minimum": 2}}}},
]}
MethodName = Literal[tuple(METHODS)]  # the registered methods' names


class Spec(StageSpec):
    model_config = ConfigDict(json_schema_extra=_RULES)

    method: MethodName = Field(
        DEFAULT_METHOD, description="; ".join(f"{m.name}: {m.summary}" for m in METHODS.values())
        + "; all train on the same features")
    draft_layers: int | None = Field(None, ge=1, le=32, description="the decoder layers of a method that allows "
                                     "several (" + ", ".join(f"{m.name}: default {m.layers}" for m in METHODS.values()
                                                             if m.several_layers) + "); the others have one")
    aux_layers: list[Annotated[int, Field(ge=-1, le=1023)]] | None = Field(
        None, min_length=1, max_length=64, description="the target layers the drafter reads (out(i), ascending, "
        "as the extract spec names them); default: the features'. Features that captured other layers are refused, "
        "by name")
    features: names("artifact") = Field(
        description="features artifact URI (s3://bucket/features/ID) or local directory")
    target: names("target", exact=(BUNDLED,)) | None = Field(
        None, description="target model (HF directory under an input root, or the bundled name); default: the one "
        "the features record")
    draft_vocab_size: int = Field(DEFAULT_DRAFT_VOCAB, ge=16, le=1_048_576,
                                  description="Vd, the drafter's vocabulary size")
    ttt_steps: int = Field(7, ge=1, le=16, description="training-time-test steps (drafted tokens trained)")
    steps: int | None = Field(None, ge=1, le=100_000_000,
                              description="optimizer steps; default: `epochs` over the train split")
    epochs: float = Field(1.0, gt=0, le=1000, description="passes over the train split (fractions allowed), when "
                          "steps is not given")
    finish_by: float | None = Field(None, ge=0, le=UNIX_TIME_MAX, description="a deadline, Unix seconds: the steps (of "
                                    "`steps` or `epochs`, at most) that fit before it, the learning-rate schedule "
                                    "sized to them and re-sized as the step time drifts; then the last validation and "
                                    "the exports")
    norm_before_fc: bool = Field(False, description="EAGLE 3.1: one RMSNorm over the concatenated aux states before fc "
                                 "(vLLM and speculators load it; SGLang does not)")
    fc_norm: bool = Field(False, description="EAGLE 3.1: one RMSNorm per aux layer before fc (not with norm_before_fc)")
    norm_output: bool = Field(False, description="EAGLE 3.1: feed the post-norm state to the next draft step")
    lr: float = Field(1e-4, gt=0, le=1, description="peak learning rate (AdamW)")
    warmup: int = Field(50, ge=0, le=100_000_000, description="linear warmup steps, then cosine decay to 0")
    batch_tokens: int = Field(4096, ge=16, le=16_777_216, description="padded tokens per optimizer step "
                              "(all processes)")
    pack: bool = Field(True, description="pack several samples into a row (each attends to itself only), so a "
                       "batch carries almost no padding; a method that cannot (DFlash), and DDP (processes > 1), "
                       "train a sample per row")
    val_every: int = Field(10, ge=2, le=1_000_000, description="every Nth sample (i mod N = 0) is validation, "
                           "the rest train")
    cache_gb: float = Field(DEFAULT_CACHE_GB, gt=0, le=1_000_000, description="local disk for the features, read as a "
                            "stream: each epoch visits the shards in windows of half this, shuffled (one window in "
                            "artifact order when they all fit, fetched once); validation keeps up to a quarter in "
                            "memory")
    val_interval: int = Field(100, ge=0, le=100_000_000, description="validate every N steps (0: only at the end)")
    checkpoint_every: int = Field(200, ge=1, le=100_000_000, description="checkpoint every N steps (and at the end)")
    seed: int = Field(0, ge=0, le=2**32 - 1, description="seeds the drafter's initialisation and the order of "
                      "shards and samples")
    dtype: DTypeName = Field("auto", description="compute dtype (bf16: autocast) and the exports' dtype; auto: "
                             "EYAS_DTYPE (bf16 on a GPU, fp32 on the CPU)")
    resume: names("artifact", exact=("auto", "never")) = Field(
        "auto", description="'auto' (continue this job's own checkpoint if any), "
                        "'never', or the URI of an unfinished trainer job's artifact to continue")
    init_from: names("artifact") | None = Field(
        None, description="warm start: a drafter artifact URI (or local directory) whose weights the job starts from, "
        "with a fresh optimizer and schedule; it must read the features' layout and be of the job's method and "
        "draft_vocab_size (else refused before training); default: a fresh initialisation")
    processes: int | None = Field(None, ge=1, le=64, description="DDP processes under torchrun (NCCL on GPUs); "
                                  "default: one per visible GPU, 1 on a CPU")
    activation_checkpointing: bool = Field(
        False, description="recompute each TTT step's draft-vocabulary logits in the backward pass instead of keeping "
        "them (ttt_steps × supervised tokens × Vd × 8 bytes less: for a large draft vocabulary)")
    verifier: str | None = Field(
        None, min_length=1, max_length=256, pattern=r"^[^\x00-\x1f\x7f]+$",
        description="written into the speculators export as speculators_config.verifier.name_or_path: the target "
        "where the export will be loaded (a hub id, or a path there), which the speculators library opens (config "
        "and weights); default: the target's hub id where known (the bundled target's, or an owner/name "
        "_name_or_path in its config.json), else none")

    @property
    def packed(self) -> bool:
        """Whether its batches pack samples into rows: asked for (`pack`), its method can, and one process trains
        (processes share a batch by rows, and a packed batch often has fewer rows than there are processes)."""
        return self.pack and get_method(self.method).packs and (self.processes or 1) == 1

    @model_validator(mode="after")
    def _one_fc_norm(self) -> Spec:
        check_norm_flags(self.norm_before_fc, self.fc_norm)
        method = get_method(self.method)
        if not method.takes_norms and any(getattr(self, k) for k in NORM_FLAGS):
            raise ValueError(f"method={self.method}: EAGLE 3.1's norms ({', '.join(NORM_FLAGS)}) are EAGLE-3's, "
                             f"not {method.title}'s")
        if not method.several_layers and self.draft_layers not in (None, 1):
            raise ValueError(f"draft_layers={self.draft_layers}: method={self.method} has one decoder layer "
                             f"(draft_layers is {', '.join(_LAYERED)}'s)")
        return self

