"""The series as a picture: the served τ of each interval over time, the threshold it is judged against, and the
promotion line's promotions and rollbacks marked where they happened. The watch writes it beside the series
(watch/NAME/acceptance.png) at every reading; the API serves it (GET /v1/watch/NAME/plot.png).

Each artist carries a gid ("tau", "threshold", "baseline", "promotion", "rollback"), so what is drawn can be read
back from the figure.
"""
from __future__ import annotations

import io
from datetime import UTC, datetime
from typing import Any

from matplotlib.figure import Figure

from orchestration.watch.status import Level, Point


def _when(at: float) -> datetime:
    return datetime.fromtimestamp(at, UTC)


def _tau(tau: float | None) -> str:
    return "" if tau is None else f" (τ {tau:.2f})"


def figure(name: str, points: list[Point], level: Level, history: list[dict[str, Any]]) -> Figure:
    """τ per interval (intervals without drafts, and the engine's totals at a first reading, are no point of it),
    the level's threshold and baseline, and each promotion (a refresh that promoted: its candidate's τ) and rollback
    of `history` (the promotion line's records) as a vertical line."""
    fig = Figure(figsize=(8, 3.5))
    ax = fig.add_subplot()
    served = [p for p in points if p.tau is not None and not p.since_start]
    ax.plot([_when(p.at) for p in served], [p.tau for p in served], marker=".", label="served τ", gid="tau")
    if level.floor is not None:
        ax.axhline(level.floor, color="tab:red", linestyle="--", label=f"threshold τ {level.floor:.2f}",
                   gid="threshold")
    if level.baseline is not None:
        ax.axhline(level.baseline, color="tab:green", linestyle=":", label=f"at promotion τ {level.baseline:.2f}",
                   gid="baseline")
    for record in history:
        if record.get("kind") == "refresh" and record.get("promoted"):
            ax.axvline(_when(record["at"]), color="tab:green", gid="promotion",
                       label=f"promoted{_tau(record['candidate']['tau'])}")
        elif record.get("kind") == "rollback":  # to a drafter whose τ may be unknown (never scored on this target)
            ax.axvline(_when(record["at"]), color="tab:orange", linestyle="-.", gid="rollback",
                       label=f"rolled back{_tau(record['tau'])}")
    if not served:
        ax.text(0.5, 0.5, "no interval with drafts yet", transform=ax.transAxes, ha="center", va="center")
    ax.set_title(f"{name}: served acceptance")
    ax.set_ylabel("τ (tokens per target pass)")
    ax.set_xlabel("time (UTC)")
    ax.grid(alpha=0.3)
    ax.legend(loc="best", fontsize="small")
    fig.autofmt_xdate()
    return fig


def png(fig: Figure) -> bytes:
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=100, bbox_inches="tight")
    return buf.getvalue()
