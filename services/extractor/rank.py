"""One extractor process of several under torchrun: the job's plan, computed here as in every process, and every
WORLD_SIZE-th of its shards from RANK on, extracted on this rank's GPU (LOCAL_RANK) into the job's artifact.

    torchrun --nproc_per_node 8 -m services.extractor.rank --spec SPEC.json --output URI

Its progress and the files it wrote go to stdout for the parent (services.extractor.core), which commits the
manifest once every rank is done.
"""
from __future__ import annotations

import argparse
import json
import logging
import os
import sys

from eyas.capture import Captured
from eyas.device import placement
from eyas.handoff import read_plan
from eyas.manifest import ArtifactWriter
from eyas.ranks import emit
from eyas.settings import get_settings
from eyas.store import open_artifact
from eyas.target import load_target
from services.extractor.core import FILES_TAG, PROGRESS_TAG, prepare, shard_work
from services.extractor.shards import hooked, write_shards
from services.extractor.spec import Spec


def main(argv: list[str]) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--spec", required=True, help="extractor spec as JSON (its dtype resolved)")
    p.add_argument("--output", required=True, help="the features artifact URI")
    args = p.parse_args(argv)
    logging.basicConfig(level=logging.INFO)
    spec = Spec.model_validate_json(args.spec)
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    settings = get_settings()  # this process (a torchrun rank) reads the worker's environment
    job = prepare(spec, settings)
    target = load_target(spec.target, placement(settings, spec.dtype))
    output = open_artifact(args.output, settings)
    writer = ArtifactWriter(output)
    stream = read_plan(output) if spec.stream else None  # the parent announced it
    items, uploaded = shard_work(stream, job.plan, output, rank, world, settings, lambda: False)
    write_shards(hooked(target, job.layout), Captured(job.layout.target, job.layout.aux_layers), job.plan.shards,
                 items, writer, lambda tokens: emit(f"{PROGRESS_TAG}{tokens}"), uploaded, job.layout.dtype)
    emit(FILES_TAG + json.dumps({name: e.model_dump() for name, e in writer.files.items()}))


if __name__ == "__main__":
    main(sys.argv[1:])
