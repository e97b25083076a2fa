"""What a train job opens before it trains: its spec with the machine's defaults filled in, and the features it
names, checked against the target here."""
from __future__ import annotations

import json
import threading

import torch

from eyas.device import placement
from eyas.features import FeatureReader
from eyas.layout import Layout, LayoutMismatch, check_layout
from eyas.settings import Settings
from eyas.store import open_artifact
from eyas.target import config_hash, load_tokenizer, resolve_target, tokenizer_hash
from services.trainer.spec import Spec


def resolve(spec: Spec, settings: Settings) -> Spec:
    """The spec with the defaults that depend on the machine filled in: the dtype ("auto": EYAS_DTYPE, else bf16 on
    a GPU), the processes (one per visible GPU)."""
    place = placement(settings, spec.dtype)
    gpus = torch.cuda.device_count() if place.device.type == "cuda" else 1
    return spec.model_copy(update={"dtype": place.dtype_name, "processes": spec.processes or gpus})


def open_features(spec: Spec, settings: Settings, stop: threading.Event | None = None) -> tuple[FeatureReader, Layout]:
    """The features reader and its layout, after checking that the target here is the one they were extracted
    from (config and tokenizer/chat-template hashes, sizes). `stop` set: stop waiting for shards not yet
    extracted (the job was cancelled)."""
    reader = FeatureReader(open_artifact(spec.features, settings), stall_s=settings.stream_stall_s, stop=stop)
    layout = reader.layout
    target = spec.target or layout.target
    cfg = json.loads((resolve_target(target) / "config.json").read_text())
    here = Layout(target=target, target_config_hash=config_hash(resolve_target(target)),
                  tokenizer_hash=tokenizer_hash(load_tokenizer(target)), num_layers=cfg["num_hidden_layers"],
                  hidden_size=cfg["hidden_size"], vocab_size=cfg["vocab_size"], aux_layers=layout.aux_layers,
                  dtype=layout.dtype)
    check_layout(here, layout, what=f"features {spec.features} for target {target!r}")
    if spec.aux_layers is not None and tuple(spec.aux_layers) != layout.aux_layers:
        raise LayoutMismatch(f"aux_layers: the spec asks for out{tuple(spec.aux_layers)}, features {spec.features} "
                             f"captured out{layout.aux_layers}: extract with aux_layers {list(spec.aux_layers)}")
    return reader, layout
