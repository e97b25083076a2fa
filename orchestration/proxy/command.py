"""`eyas proxy` (serve the pass-through) and `eyas traffic import FILE` (store chat requests recorded elsewhere).
Flags come from ProxySettings, as the stage commands' come from their specs; neither httpx nor uvicorn is imported
until the command runs."""
from __future__ import annotations

import argparse
from pathlib import Path

from orchestration.proxy.settings import ProxySettings


def add_proxy_commands(sub) -> None:
    from orchestration.spec_flags import add_settings_command

    add_settings_command(sub, "proxy", "an OpenAI-compatible pass-through that records a sample of served prompts",
                         __doc__, ProxySettings, "the windows go to")
    t = sub.add_parser("traffic", help="recorded traffic").add_subparsers(dest="traffic_command", required=True)
    i = t.add_parser("import", help="store a JSONL of chat requests (bodies or OpenAI batch lines) as one window, "
                                    "redacted like recorded traffic")
    i.add_argument("file", type=Path, help="one chat request a line")
    i.add_argument("--workdir", type=Path, help="embedded store the window goes to (default: ./eyas-work)")


def service_settings(workdir: Path | None):
    """The deployment's settings, with the workdir the command was given (`eyas watch` reads them the same way)."""
    from orchestration.settings import ServiceSettings, get_service_settings

    return ServiceSettings(workdir=workdir) if workdir else get_service_settings()


def run_proxy_command(args: argparse.Namespace) -> int:
    from orchestration.spec_flags import spec_from_args

    if args.command == "proxy":
        from orchestration.proxy.app import serve_proxy

        proxy = ProxySettings(**spec_from_args(args, skip={"command", "workdir", "verbose"}))
        serve_proxy(proxy, service_settings(args.workdir))
        return 0
    from orchestration.proxy.recorder import Recorder, import_requests, traffic_store

    settings = service_settings(args.workdir)
    recorder = Recorder(traffic_store(settings), ProxySettings())
    with open(args.file, encoding="utf-8") as f:
        key, kept, skipped = import_requests(recorder, f, args.file.name)
    print(f"imported {kept} requests ({skipped} skipped: not a chat request with a user turn)"
          + (f" → {traffic_store(settings).uri(key)}" if key else ""))
    return 0 if key else 1
