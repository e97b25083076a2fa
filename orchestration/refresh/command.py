"""`eyas refresh`: fine-tune the current drafter on the recent recorded traffic (generate → extract → train, warm
start), score it and the current drafter on the same held-out recent prompts, and promote it only when it is
better by the diagnosis's significance rule; `--rollback` restores the drafter current before the last promotion.
Prints the promotion record (JSON) and where it is stored. Flags come from RefreshSettings."""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from orchestration.refresh.settings import RefreshSettings


def add_refresh_command(sub) -> None:
    from orchestration.spec_flags import add_settings_command

    add_settings_command(sub, "refresh", "fine-tune the drafter on recent traffic; promote it only when better "
                         "(or --rollback)", __doc__, RefreshSettings, "(the traffic, the jobs and the promotions)")


def named_roots(rs: RefreshSettings, settings):
    """The local drafter and target directories the user named, absolute, as input roots (the user named them, so
    the jobs may read them; as orchestration.embedded.command_line_settings does for a stage's command)."""
    named = []
    for field in ("drafter", "target"):
        value = getattr(rs, field)
        if value and Path(value).exists():
            named.append(Path(value).resolve())
            setattr(rs, field, str(named[-1]))
    return settings.model_copy(update={"input_roots": [*settings.input_roots, *named]})


def run_refresh_command(args: argparse.Namespace) -> int:
    from orchestration.embedded import EmbeddedRunner
    from orchestration.proxy.command import service_settings
    from orchestration.proxy.recorder import traffic_store
    from orchestration.refresh.promotion import Promotions, RollbackError
    from orchestration.refresh.refresh import RefreshError, refresh
    from orchestration.spec_flags import spec_from_args

    rs = RefreshSettings(**spec_from_args(args, skip={"command", "workdir", "verbose"}))
    settings = named_roots(rs, service_settings(args.workdir))
    store = traffic_store(settings)
    try:
        if rs.rollback:
            record = Promotions(store, rs.name).rollback()
            print(f"rolled back: {record['from']} → {record['to']} (τ {record['tau']})")
            return 0
        if settings.mode != "embedded":
            print("error: eyas refresh runs its jobs embedded (EYAS_MODE=embedded)", file=sys.stderr)
            return 2
        record = refresh(rs, EmbeddedRunner(settings), store)
    except (RefreshError, RollbackError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(json.dumps(record, indent=1))
    print(f"{'promoted' if record['promoted'] else 'not promoted'}: {record['why']} → {store.uri(record['key'])}")
    return 0
