"""`eyas loop`: the loop as a service. Every --interval-s it reads the watch of the promotion line's served drafter
(the line's current one, or --drafter before its first promotion) and prints one line: the watch's status and what
it did about a refresh. When the watch says below threshold or stale target, it refreshes the line (as `eyas refresh
--name NAME` does: its jobs run embedded, in this process, beside the passes that go on watching), no sooner than
--min-refresh-hours after the last refresh. The series, its picture, the promotions and the loop's state go to the
store the proxy records traffic into (the workdir's, or the service's bucket); the evaluate service's API serves them
(/v1/watch/NAME, /v1/promotions/NAME). Flags come from LoopSettings."""
from __future__ import annotations

import argparse
import sys
import tempfile
import time
from datetime import datetime
from pathlib import Path

from orchestration.loop.settings import LoopSettings

# touched after every pass, whatever it found: the container's healthcheck reads its age (docker-compose.yml)
HEARTBEAT = Path(tempfile.gettempdir()) / "eyas-loop.alive"


def add_loop_command(sub) -> None:
    from orchestration.spec_flags import add_settings_command

    add_settings_command(sub, "loop", "watch the served drafter every interval, refresh it when it falls behind",
                         __doc__, LoopSettings, "(the traffic, the series, the jobs and the promotions)")


def _pass_line(loop) -> tuple[str, int]:
    from orchestration.loop.loop import loop_once
    from orchestration.watch.command import reading_line
    from orchestration.watch.watch import WatchError

    def read() -> tuple[str, str]:
        turn = loop_once(loop)
        return f"{turn.status.sentence} → {turn.refresh}", turn.status.state

    try:
        return reading_line(read)
    except WatchError as e:
        return f"{datetime.now():%Y-%m-%d %H:%M:%S} error: {e}", 2


def _loop(ls: LoopSettings, settings):
    from orchestration.embedded import EmbeddedRunner
    from orchestration.loop.loop import Loop
    from orchestration.proxy.recorder import traffic_store
    from orchestration.refresh.command import named_roots
    from orchestration.refresh.refresh import refresh
    from orchestration.watch.watch import open_watch

    store = traffic_store(settings)

    def refresh_from(drafter: str) -> dict:
        rs = ls.refresh_settings(drafter)
        # the jobs run embedded in this process, whatever the store (as `eyas refresh`'s): their artifacts in the
        # workdir, the traffic read and the promotion recorded in `store`
        runner = EmbeddedRunner(named_roots(rs, settings).model_copy(update={"mode": "embedded"}))
        return refresh(rs, runner, store)

    return Loop(store, ls.name, open_watch=lambda drafter: open_watch(ls.watch_settings(drafter), settings, store),
                refresh=refresh_from, min_refresh_s=ls.min_refresh_hours * 3600, drafter=ls.drafter,
                background=not ls.once)


def run_loop_command(args: argparse.Namespace) -> int:
    from pydantic import ValidationError

    from orchestration.proxy.command import service_settings
    from orchestration.spec_flags import spec_from_args

    try:
        ls = LoopSettings(**spec_from_args(args, skip={"command", "workdir", "verbose"}))
        ls.refresh_settings(ls.drafter)  # their values checked before the first pass
        ls.watch_settings(ls.drafter or "")
    except ValidationError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    loop = _loop(ls, service_settings(args.workdir))
    try:
        while True:
            started = time.monotonic()
            line, code = _pass_line(loop)
            print(line, flush=True)
            HEARTBEAT.touch()
            if ls.once:
                return code
            time.sleep(max(0.0, ls.interval_s - (time.monotonic() - started)))
    except KeyboardInterrupt:  # the way a loop that runs until stopped is stopped
        return 0
