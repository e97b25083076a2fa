"""What the stages' job specs share with the modules that do the work, in a module that imports no torch: a spec
(and so `eyas --help`, which builds every stage's flags from its spec) loads without torch or transformers."""
from __future__ import annotations

from typing import Literal

BUNDLED = "bundled:smollm2-135m-instruct"  # the bundled target's name (eyas.target resolves it)
DTypeName = Literal["auto", "float32", "bfloat16"]  # a compute dtype as a spec names it (eyas.device)
DEFAULT_CACHE_GB = 64.0  # a features reader's local cache (eyas.streaming)
EAGLE_DIR, SPECULATORS_DIR = "eagle", "speculators"  # an EAGLE-3 export's two formats (eyas.exports)
NORM_FLAGS = ("norm_before_fc", "fc_norm", "norm_output")  # EAGLE 3.1's optional norms, as config.json names them


def check_norm_flags(norm_before_fc: bool, fc_norm: bool) -> None:
    """The two fc norms exclude each other (speculators refuses both too)."""
    if norm_before_fc and fc_norm:
        raise ValueError("norm_before_fc and fc_norm are alternatives: one norm over all aux layers, or one each")
