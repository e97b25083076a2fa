"""The layout contract — the ONE place that says which target tensors a drafter is trained on and served with.

Internally layers are physical boundaries out(i): the residual stream after 0-indexed decoder layer i, before the
final norm (= Hugging Face `hidden_states[i+1]`). The default aux layers are out(1), out(L//2-1), out(L-4),
concatenated in ascending order; that equals vLLM's and SGLang's default capture ids in(2), in(L//2), in(L-3).
Engines number layers differently (docs/eagle3.md §3):
  vLLM   ids from the draft config mean "input to layer k":  k = i + 1  (no offset applied by vLLM)
  SGLang ids from the draft config mean "output of layer k": k = i      (SGLang adds 1 itself)
The training label is the target's final post-norm hidden state; the target's lm_head turns it into logits.
A hybrid target (linear-attention layers between full-attention ones: Qwen3-Next, Qwen3.5) reads full-attention
layers' outputs instead (`aux_layers_for`, docs/eagle3.md §3.6); the layout records which rule chose its layers.
Layer -1 (EMBED) is the embedding output in(0) (= HF `hidden_states[0]`, vLLM id 0): no default uses it, but a
drafter trained elsewhere on it can be described and checked.
Every features and drafter manifest records a Layout; every reader checks it with `check_layout`, and
`check_serving` says what each engine would actually concatenate for a draft config and why it differs.
"""
from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any

LAYOUT_VERSION = 1

# Tensor names inside a feature shard (safetensors). T = tokens in the shard, S = samples.
INPUT_IDS = "input_ids"  # [T] int32
LOSS_MASK = "loss_mask"  # [T] uint8, 1 = token the drafter learns (assistant reasoning + answer + end of turn)
AUX_HIDDEN = "aux_hidden"  # [T, n_aux·H] Layout.dtype, cat([out(i) for i in aux_layers]) ascending
FINAL_HIDDEN = "final_hidden"  # [T, H] Layout.dtype, target's final norm output (label source)
OFFSETS = "offsets"  # [S+1] int64, sample s spans tokens offsets[s]:offsets[s+1]
FEATURE_TENSORS = (INPUT_IDS, LOSS_MASK, AUX_HIDDEN, FINAL_HIDDEN, OFFSETS)

# How a shard stores the hidden states (Layout.dtype). FP8: float8 e4m3 with a float32 scale per token and per
# state (each aux layer's H columns, and the final state); a value is q · scale, scale = amax(|state row|) / 448
# (e4m3's largest finite value), 0 for an all-zero row. Readers dequantize (eyas.features) and never see fp8.
BF16, FP8 = "bfloat16", "float8_e4m3fn"
FEATURE_DTYPES = (BF16, FP8)
FP8_MAX = 448.0
AUX_SCALE = "aux_hidden_scale"  # [T, n_aux] float32, FP8 only: aux_hidden[t, j·H:(j+1)·H] = q · scale[t, j]
FINAL_SCALE = "final_hidden_scale"  # [T, 1] float32, FP8 only: final_hidden[t] = q · scale[t, 0]
SCALES = {AUX_HIDDEN: AUX_SCALE, FINAL_HIDDEN: FINAL_SCALE}


EMBED = -1  # the embedding output, in(0)


class LayoutMismatch(ValueError):
    """Raised with a reason that names the field and both values."""


def default_aux_layers(num_layers: int) -> tuple[int, ...]:
    """Physical out(i) ids of the engines' shared default: out(1), out(L//2-1), out(L-4)."""
    return (1, num_layers // 2 - 1, num_layers - 4)


# How a layout's aux layers were chosen (Layout.aux_rule)
ENGINE_DEFAULT = "engine_default"  # default_aux_layers: what vLLM and SGLang capture with no ids in the config
HYBRID_FULL_ATTENTION = "hybrid_full_attention"  # hybrid_aux_layers
REQUESTED = "requested"  # the extract spec's aux_layers


def hybrid_aux_layers(layer_types: list[str]) -> tuple[int, ...] | None:
    """For a hybrid target (config.layer_types mixes "linear_attention" and "full_attention"): out(1) as in the
    default, and for the default's middle and high positions the outputs of the full-attention layers nearest
    them (ties: the shallower), distinct, out(1) and the last layer (its output is the label's input) excluded.
    None when the target is not hybrid or has fewer than two such layers. Why: docs/eagle3.md §3.6."""
    if "linear_attention" not in layer_types:
        return None
    low, *rest = default_aux_layers(len(layer_types))
    full = [i for i, kind in enumerate(layer_types[:-1]) if kind == "full_attention" and i != low]
    if len(full) < len(rest):
        return None
    chosen: list[int] = []
    for p in rest:
        chosen.append(min((i for i in full if i not in chosen), key=lambda i: (abs(i - p), i)))
    return (low, *sorted(chosen))


def aux_layers_for(num_layers: int, layer_types: list[str] | None,
                   requested: list[int] | None = None) -> tuple[tuple[int, ...], str]:
    """The aux layers of a target with `num_layers` layers (`layer_types`: its config's, if any), and the rule that
    chose them: `requested` if given, else the hybrid rule where it applies, else the engines' default."""
    if requested:
        return tuple(sorted(requested)), REQUESTED
    hybrid = hybrid_aux_layers(layer_types or [])
    if hybrid is not None:
        return hybrid, HYBRID_FULL_ATTENTION
    return default_aux_layers(num_layers), ENGINE_DEFAULT


@dataclass(frozen=True)
class Layout:
    target: str  # target model id (path or bundled name)
    target_config_hash: str
    tokenizer_hash: str  # tokenizer vocab + chat template
    num_layers: int
    hidden_size: int
    vocab_size: int
    aux_layers: tuple[int, ...]  # physical out(i), ascending
    # how shards store the hidden states (FEATURE_DTYPES): not what they mean, so check_layout does not compare it
    # (a drafter trained on fp8 features is evaluated on bf16 ones); eyas.features checks every shard against it
    dtype: str = BF16
    convention: str = "out"  # aux_layers are out(i): residual stream after layer i
    concat_order: str = "ascending"
    label: str = "final_norm"  # FINAL_HIDDEN is post-norm; apply lm_head only
    # which rule chose aux_layers (ENGINE_DEFAULT, HYBRID_FULL_ATTENTION, REQUESTED): a record of why, not part of
    # what the tensors mean (aux_layers is), so neither check_layout nor equality compares it
    aux_rule: str = field(default=ENGINE_DEFAULT, compare=False)
    # the arithmetic the target ran when the states were captured (eyas.target.precision: dtype and quantization;
    # "" where not recorded): the same network at another precision feeds a drafter other states, which the wiring
    # check warns of but does not refuse, so neither check_layout nor equality compares it
    precision: str = field(default="", compare=False)
    layout_version: int = LAYOUT_VERSION
    extra: dict[str, Any] = field(default_factory=dict, compare=False)

    def __post_init__(self):
        aux = tuple(int(i) for i in self.aux_layers)
        object.__setattr__(self, "aux_layers", aux)
        if list(aux) != sorted(set(aux)):
            raise LayoutMismatch(f"aux_layers must be distinct and ascending, got {list(aux)}")
        if aux and (aux[0] < EMBED or aux[-1] >= self.num_layers):
            raise LayoutMismatch(f"aux_layers {list(aux)} outside embed (-1), out(0)..out({self.num_layers - 1})")

    @property
    def is_default(self) -> bool:
        return self.aux_layers == default_aux_layers(self.num_layers)

    @property
    def vllm_ids(self) -> list[int]:
        """What to write as vLLM `eagle_aux_hidden_state_layer_ids` (input-to-layer-k numbering)."""
        return [i + 1 for i in self.aux_layers]

    @property
    def sglang_ids(self) -> list[int]:
        """What to write as SGLang `eagle_config.eagle_aux_hidden_state_layer_ids` (output-of numbering)."""
        return list(self.aux_layers)

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["aux_layers"] = list(self.aux_layers)
        d.pop("extra")
        return d

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> Layout:
        known = {k: v for k, v in d.items() if k in cls.__dataclass_fields__ and k != "extra"}
        return cls(**known)


# Fields that must agree for a drafter trained on one layout to be valid for another.
_CHECKED = ("layout_version", "target_config_hash", "tokenizer_hash", "num_layers", "hidden_size", "vocab_size",
            "aux_layers", "convention", "concat_order", "label")


def check_layout(expected: Layout, actual: Layout, what: str = "features") -> None:
    """Refuse `actual` unless it matches `expected` in every field that changes what the tensors mean."""
    for name in _CHECKED:
        want, got = getattr(expected, name), getattr(actual, name)
        if want != got:
            raise LayoutMismatch(f"{what} layout differs in {name}: expected {want!r}, got {got!r}")


def vllm_view(draft_config: dict[str, Any]) -> dict[str, Any]:
    """The config vLLM builds from a draft's config.json. A speculators-format config (speculators_model_type) is
    flattened as vLLM's converter does: transformer_layer_config plus the EAGLE-3 fields, with norm_before_residual
    defaulting to TRUE when absent and the aux ids copied only when non-empty."""
    if "speculators_model_type" not in draft_config:
        return draft_config
    flat = dict(draft_config.get("transformer_layer_config") or {})
    flat["draft_vocab_size"] = draft_config.get("draft_vocab_size")
    if draft_config.get("target_hidden_size") is not None:
        flat["target_hidden_size"] = draft_config["target_hidden_size"]
    flat["norm_before_residual"] = draft_config.get("norm_before_residual", True)
    if draft_config.get("eagle_aux_hidden_state_layer_ids"):
        flat["eagle_aux_hidden_state_layer_ids"] = draft_config["eagle_aux_hidden_state_layer_ids"]
    return flat


def vllm_capture_layers(draft_config: dict[str, Any], num_layers: int) -> list[int]:
    """Physical out(i) layers vLLM concatenates for this draft config (ids are in(k) = out(k-1); id 0 = embedding,
    returned as EMBED = -1).

    Mirrors vLLM's `_get_eagle3_aux_layers_from_config`: non-empty top-level ids, else `eagle_config`'s, else a
    DFlash config's `dflash_config.target_layer_ids` (out(t) numbering: vLLM adds 1), else the per-architecture
    default (2, L//2, L-3). The target appends a state when its loop index is in the id set, so vLLM concatenates
    in ascending layer order, once per layer, and never captures an id above L.
    """
    cfg = vllm_view(draft_config)
    dflash = [int(t) + 1 for t in (cfg.get("dflash_config") or {}).get("target_layer_ids") or []]
    ids = cfg.get("eagle_aux_hidden_state_layer_ids") or (cfg.get("eagle_config") or {}).get(
        "eagle_aux_hidden_state_layer_ids") or dflash or [2, num_layers // 2, num_layers - 3]
    return sorted({int(k) - 1 for k in ids if 0 <= int(k) <= num_layers})


def sglang_capture_layers(draft_config: dict[str, Any], num_layers: int) -> list[int]:
    """Physical out(i) layers SGLang concatenates: ids from `eagle_config` mean out(id) (it captures in(id+1));
    with no ids it captures in(2), in(L//2), in(L-3). Newer SGLang (PR #25454) adds the +1 only when ids[0] == 1."""
    ids = (draft_config.get("eagle_config") or {}).get("eagle_aux_hidden_state_layer_ids")
    if ids is None:
        return [1, num_layers // 2 - 1, num_layers - 4]
    ids = [int(k) for k in ids]
    if ids[0] != 1:
        raise LayoutMismatch(
            f"SGLang aux ids {ids} do not start at 1: SGLang versions disagree on their offset (PR #25454); "
            "pin the SGLang version before serving this drafter there"
        )
    return sorted(ids)


def describe(layers: list[int]) -> list[str]:
    return ["embed" if i == EMBED else f"out({i})" for i in layers]


def mismatch_kind(trained: list[int], served: list[int]) -> str:
    """Name how a served concatenation differs from the trained one."""
    if (EMBED in served) != (EMBED in trained):
        return "embedding included" if EMBED in served else "embedding not served"
    if len(served) != len(trained):
        return "wrong number of layers"
    if sorted(served) == sorted(trained):
        return "wrong order"
    shift = {s - t for s, t in zip(served, trained, strict=True)}
    if shift in ({1}, {-1}):
        return "off-by-one (one layer deeper)" if shift == {1} else "off-by-one (one layer shallower)"
    return "wrong layers"


def check_serving(layout: Layout, draft_config: dict[str, Any], engine: str) -> list[int]:
    """Refuse a draft config that would make `engine` feed the drafter other tensors than it was trained on."""
    capture = {"vllm": vllm_capture_layers, "sglang": sglang_capture_layers}[engine]
    served = capture(draft_config, layout.num_layers)
    trained = list(layout.aux_layers) if layout.concat_order == "ascending" else list(reversed(layout.aux_layers))
    if served != trained:
        raise LayoutMismatch(
            f"{mismatch_kind(trained, served)}: {engine} would concatenate {describe(served)} but the drafter "
            f"was trained on {describe(trained)}"
        )
    return served
