"""`eyas watch`: is the served drafter still current? Every --interval-s it reads the engine's spec-decode counters
(/metrics) and the target's identity (/v1/models, /tokenize), keeps the point in the store under watch/NAME/, and
prints one line: current, below threshold, stale target or no traffic, with the numbers and the checks it could not
make. --once checks once (against the last stored reading) and exits with the status. Flags come from WatchSettings;
nothing heavier than pydantic is imported until the command runs."""
from __future__ import annotations

import argparse
import sys
import time
from collections.abc import Callable
from datetime import datetime

from orchestration.watch.settings import WatchSettings

EXIT = {"current": 0, "below threshold": 1, "stale target": 1, "no traffic": 3}
UNREACHABLE = 4  # the endpoint's counters could not be read


def add_watch_command(sub) -> None:
    from orchestration.spec_flags import add_settings_command

    add_settings_command(sub, "watch", "the served drafter's acceptance over time, and whether it is still current",
                         __doc__, WatchSettings, "the series goes to")


def reading_line(read: Callable[[], tuple[str, str]]) -> tuple[str, int]:
    """One stamped line and the exit code for a reading: `read()` gives (sentence, state). An endpoint whose counters
    cannot be read is a line too; a WatchError (nothing to judge against) is the caller's."""
    import httpx

    from orchestration.watch.watch import WatchError

    stamp = datetime.now().strftime("%Y-%m-%d %H:%M:%S")
    try:
        sentence, state = read()
    except WatchError:
        raise
    except (httpx.HTTPError, ValueError) as e:  # ValueError: a /metrics page that is no Prometheus text
        return f"{stamp} endpoint unreachable: its counters could not be read ({type(e).__name__}: {e})", UNREACHABLE
    return f"{stamp} {sentence}", EXIT[state]


def _check_line(watch) -> tuple[str, int]:
    def read() -> tuple[str, str]:
        status = watch.check()
        return status.sentence, status.state

    return reading_line(read)


def run_watch_command(args: argparse.Namespace) -> int:
    from orchestration.proxy.command import service_settings
    from orchestration.proxy.recorder import traffic_store
    from orchestration.spec_flags import spec_from_args
    from orchestration.watch.watch import WatchError, open_watch

    ws = WatchSettings(**spec_from_args(args, skip={"command", "workdir", "verbose"}))
    settings = service_settings(args.workdir)
    try:  # the series lives beside the recorded traffic that a refresh would train on
        watch = open_watch(ws, settings, traffic_store(settings))
    except WatchError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    try:
        while True:
            started = time.monotonic()
            line, code = _check_line(watch)
            print(line, flush=True)
            if ws.once:
                return code
            time.sleep(max(0.0, ws.interval_s - (time.monotonic() - started)))
    except KeyboardInterrupt:  # the way a watch that runs until stopped is stopped
        return 0
