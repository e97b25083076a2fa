"""Run one stage in this process on a given output directory, as a worker would, so a test can kill -9 it and
run it again on the same output:

    python -m tests.stage_process STAGE SPEC_JSON OUTPUT_DIR WORKDIR INPUT_ROOT
"""
from __future__ import annotations

import json
import logging
import sys
from pathlib import Path

from eyas.settings import Settings
from eyas.stage import StageContext
from eyas.store import Artifact, LocalStore
from orchestration.registry import get_stage


def main(stage: str, spec: str, output: str, workdir: str, input_root: str) -> None:
    logging.basicConfig(level=logging.INFO)
    settings = Settings(workdir=Path(workdir), input_roots=[Path(input_root)], stream_stall_s=300)
    parsed = get_stage(stage).spec_cls.model_validate(json.loads(spec))
    ctx = StageContext(job_id=Path(output).name, settings=settings, store=LocalStore(settings.store_root),
                       output=Artifact(LocalStore(Path(output))))
    get_stage(stage).run(parsed, ctx)


if __name__ == "__main__":
    main(*sys.argv[1:])
