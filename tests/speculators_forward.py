"""Run by the vLLM environment's Python (where the speculators library is installed, scripts/install-vllm.sh): load an
Eyas speculators/ export with the library's own `from_pretrained`, run its TTT forward on given features, and save
the logits of every step.

    python -P tests/speculators_forward.py EXPORT_DIR VERIFIER INPUTS.safetensors OUT.safetensors STEPS

The export names no path of the training machine as its verifier: the target's hub id where one is known, else
none. VERIFIER is where the target is here (a directory), as anyone loading an export that names none would say;
`-` loads the verifier the export names, first with the library's plain `Eagle3DraftModel.from_pretrained(EXPORT_DIR)`
(which must give the same weights), then as below.

INPUTS holds `aux` [1, T, n_aux·H] (the target's aux states g_t) and `input_ids` [1, T] (x_{t+1}, the token beside
g_t: the speculators data convention). OUT holds `logits_k` [1, T, Vd] per step k (captured at lm_head) and the
library's view of the config (`aux_ids`, the layer ids it resolved).
"""
from __future__ import annotations

import os
import sys

import torch
from safetensors.torch import load_file, save_file
from speculators.models.eagle3 import Eagle3DraftModel, Eagle3SpeculatorConfig


def main(export: str, verifier: str, inputs: str, out: str, steps: int) -> None:
    config = Eagle3SpeculatorConfig.from_pretrained(export)
    named = config.speculators_config.verifier.name_or_path
    assert named is None or not os.path.isabs(named), f"the export names a machine path: {named}"
    if verifier == "-":
        plain = Eagle3DraftModel.from_pretrained(export)  # its attention (flex) runs no forward on a CPU here
    else:
        config.speculators_config.verifier.name_or_path = verifier
    config.transformer_layer_config._attn_implementation = "eager"  # noqa: SLF001 (flex attention wants a GPU)
    model = Eagle3DraftModel.from_pretrained(export, config=config).eval()
    if verifier == "-":
        ours, theirs = model.state_dict(), plain.state_dict()
        assert ours.keys() == theirs.keys() and all(torch.equal(ours[k], theirs[k]) for k in ours)
        assert plain.config.eagle_aux_hidden_state_layer_ids == model.config.eagle_aux_hidden_state_layer_ids
    x = load_file(inputs)
    logits: list[torch.Tensor] = []
    model.lm_head.register_forward_hook(lambda _m, _i, o: logits.append(o.detach().clone()))
    with torch.no_grad():
        model(hidden_states=x["aux"], input_ids=x["input_ids"], document_ids=torch.zeros_like(x["input_ids"]),
              ttt_steps=steps)
    save_file({**{f"logits_{k}": t.contiguous() for k, t in enumerate(logits)},
               "aux_ids": torch.tensor(model.config.eagle_aux_hidden_state_layer_ids)}, out)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2], sys.argv[3], sys.argv[4], int(sys.argv[5]))
