"""`eyas` — the command line. Every stage command's flags are generated from that stage's job spec, so the CLI,
the HTTP API and `then` pipelines accept exactly the same fields.

  eyas run                      the whole pipeline on the embedded default (bundled target and prompts)
  eyas generate|extract|train|evaluate [flags] [--out DIR]   one stage, embedded
  eyas api --stage S            serve a stage's job API;   eyas worker --stage S   run a stage's Celery worker
  eyas proxy --upstream URL     a pass-through in front of an endpoint that records a sample of its traffic
  eyas traffic import FILE      store a JSONL of chat requests as recorded traffic
  eyas watch --endpoint URL --drafter URI   the served drafter's acceptance over time; is it still current
  eyas refresh --drafter URI    fine-tune on recent traffic, promote only when better; eyas refresh --rollback
  eyas loop --endpoint URL --drafter URI   the watch every interval, and a refresh when the drafter falls behind
"""
from __future__ import annotations

import argparse
import logging
import sys
from pathlib import Path

from orchestration.spec_flags import add_spec_arguments, spec_from_args

STAGE_COMMANDS = {"generate": "generate", "extract": "extract", "train": "train", "evaluate": "evaluate",
                  "diagnose": "diagnose"}


def _configure_logging(verbose: bool) -> None:
    logging.basicConfig(level=logging.DEBUG if verbose else logging.INFO,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s", datefmt="%H:%M:%S")
    for noisy in ("httpx", "urllib3", "transformers", "celery.redirected"):
        logging.getLogger(noisy).setLevel(logging.WARNING)


def _run_stage(stage: str, args: argparse.Namespace) -> int:
    from orchestration.embedded import EmbeddedRunner, command_line_settings
    from orchestration.execution import SpecError

    spec = spec_from_args(args, skip={"command", "out", "workdir", "verbose"})
    settings = command_line_settings(stage, spec, args.workdir)
    try:
        jobs = EmbeddedRunner(settings).run_job(stage, spec, output_dir=args.out)
    except SpecError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    for job in jobs:
        print(f"{job.stage}: {job.state} → {job.artifacts.get('output')}")
    return 0 if all(j.state == "succeeded" for j in jobs) else 1


def build_parser() -> argparse.ArgumentParser:
    """Every command's flags, from the stages' specs alone: no stage, torch or transformers is imported here (a
    command imports its stage when it runs)."""
    from orchestration.loop.command import add_loop_command
    from orchestration.proxy.command import add_proxy_commands
    from orchestration.refresh.command import add_refresh_command
    from orchestration.registry import stage_doc, stage_spec
    from orchestration.run_command import add_run_arguments
    from orchestration.watch.command import add_watch_command

    parser = argparse.ArgumentParser(prog="eyas", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True)
    add_run_arguments(sub.add_parser("run", help="generate → extract → train → evaluate, embedded",
                                     description="Run the whole pipeline on one machine and write a report."))
    for stage in STAGE_COMMANDS:
        doc = stage_doc(stage).strip()
        first = doc.split("\n\n")[0].split(". ")[0].replace("\n", " ").rstrip(".") if doc else stage
        p = sub.add_parser(stage, help=first, description=doc,
                           formatter_class=argparse.RawDescriptionHelpFormatter)
        add_spec_arguments(p, stage_spec(stage))
        p.add_argument("--out", type=Path, help="write the artifact into this directory (default: the workdir store)")
        p.add_argument("--workdir", type=Path, help="embedded store and job records (default: ./eyas-work)")
        p.add_argument("-v", "--verbose", action="store_true", help="log debug messages too")
    for name, what in (("api", "serve a stage's job API (HTTP)"), ("worker", "run a stage's Celery worker")):
        p = sub.add_parser(name, help=what)
        p.add_argument("--stage", required=True, choices=list(STAGE_COMMANDS), help="the stage it serves")
        if name == "api":
            p.add_argument("--host", default="127.0.0.1", help="address to listen on (default: %(default)s)")
            p.add_argument("--port", type=int, default=8000, help="port to listen on (default: %(default)s)")
        else:
            p.add_argument("--concurrency", type=int, default=1,
                           help="pool processes, each running one job at a time (default: %(default)s)")
    add_proxy_commands(sub)
    add_watch_command(sub)
    add_refresh_command(sub)
    add_loop_command(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    _configure_logging(getattr(args, "verbose", False))
    if args.command == "run":
        from orchestration.run_command import run_pipeline

        return run_pipeline(args)
    if args.command in STAGE_COMMANDS:
        return _run_stage(args.command, args)
    if args.command in ("proxy", "traffic"):
        from orchestration.proxy.command import run_proxy_command

        return run_proxy_command(args)
    if args.command == "watch":
        from orchestration.watch.command import run_watch_command

        return run_watch_command(args)
    if args.command == "refresh":
        from orchestration.refresh.command import run_refresh_command

        return run_refresh_command(args)
    if args.command == "loop":
        from orchestration.loop.command import run_loop_command

        return run_loop_command(args)
    if args.command == "api":
        from orchestration.api.app import serve_api

        serve_api(args.stage, args.host, args.port)
        return 0
    from orchestration.tasks import run_worker

    run_worker(args.stage, concurrency=args.concurrency)
    return 0


if __name__ == "__main__":
    sys.exit(main())
