"""The watch itself: each check reads the engine's spec-decode counters (services.evaluator.live) and the target's
identity (orchestration.watch.identity), appends the interval's point to the stored series, judges the status
(orchestration.watch.status) and stores it, with the series' picture (orchestration.watch.plot). What it is judged
against — the τ measured at promotion and the drafter's record of its target — is read once, when the watch opens.
"""
from __future__ import annotations

import re
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from eyas.layout import Layout
from eyas.manifest import Manifest, read_manifest
from eyas.store import Artifact, ObjectStore, open_artifact
from orchestration.refresh.promotion import Promotions, promoted
from orchestration.watch.identity import Reference, Served, build_reference, read_served, target_checks
from orchestration.watch.series import Series, counters_from_dict, counters_to_dict
from orchestration.watch.settings import WatchSettings
from orchestration.watch.status import Level, Point, Status, judge, point_between
from services.evaluator.live import SpecCounters, read_counters

DAY_S = 86_400.0


class WatchError(ValueError):
    """The watch cannot start: what it would judge against is missing."""


@dataclass
class Watch:
    endpoint: str  # the base URL: its state is only compared with readings of the same endpoint
    series: Series
    level: Level
    reference: Reference
    read_counters: Callable[[], SpecCounters]
    read_served: Callable[[], Served]
    window: int = 5
    min_drafts: int = 100
    plot_days: float = 7.0
    clock: Callable[[], float] = time.time

    def __post_init__(self):
        self.state: dict[str, Any] = self.series.state()
        self.points: list[Point] = self.series.points(last=self.window)
        self.shown: list[Point] = self.series.points(since=self.clock() - self.plot_days * DAY_S)  # in the picture
        if self.state.get("endpoint") != self.endpoint:  # another endpoint's readings say nothing of this one
            self.state, self.points = {"endpoint": self.endpoint}, []

    def check(self) -> Status:
        """One reading: the point since the last reading (stored), the target checks, the status (stored)."""
        at = self.clock()
        counters, served = self.read_counters(), self.read_served()
        before = self.state.get("reading")
        point = point_between(counters_from_dict(before["counters"]) if before else None,
                              before["at"] if before else None, counters, at)
        self.series.append(point)
        self.points = [*self.points, point][-self.window:]
        first = self.state.get("first_seen") or {}
        status = judge(self.points, self.level, target_checks(self.reference, served, first), self.window,
                       self.min_drafts, at)
        # what the endpoint showed first is kept for good: later readings are compared with it, across restarts
        self.state["first_seen"] = {k: first.get(k) or v for k, v in served.first_seen().items()}
        self.state["reading"] = {"at": at, "counters": counters_to_dict(counters)}
        self.series.put_state(self.state)
        self.series.put_status(status)
        from orchestration.watch.plot import figure, png  # (matplotlib: imported by a watch that draws only)

        self.shown = [p for p in [*self.shown, point] if p.at >= at - self.plot_days * DAY_S]
        history = Promotions(self.series.store, self.series.name).history()
        self.series.put_plot(png(figure(self.series.name, self.shown, self.level, history)))
        return status


def newest_report(drafter: Artifact, settings) -> Manifest | None:
    """The newest evaluator report on this drafter in the store beside it (reports/ next to drafters/), if any."""
    beside = re.fullmatch(r"(.+)/drafters/[^/]+", drafter.uri)
    if beside is None:
        return None
    reports = open_artifact(f"{beside.group(1)}/reports", settings)
    found = []
    for name in reports.names():
        if name.count("/") == 1 and name.endswith("/manifest.json"):
            manifest = Manifest.model_validate_json(reports.get_bytes(name))
            if manifest.kind == "report" and manifest.inputs[:1] == [drafter.uri]:
                found.append(manifest)
    return max(found, key=lambda m: m.created_at) if found else None


def promotion_level(ws: WatchSettings, drafter: Artifact, settings, store: ObjectStore | None = None) -> Level:
    """The τ the drafter's acceptance is judged against: --baseline, else the τ recorded when `eyas refresh`
    promoted it (its promotion line's current.json in `store`), else the served τ (vLLM's counters in the live
    A/B), else the in-process τ, of --report or of the newest report on the drafter."""
    common: dict[str, Any] = {"min_ratio": ws.min_ratio, "min_tau": ws.min_tau}
    if ws.baseline is not None:
        return Level(ws.baseline, "given", **common)
    current = promoted(store, drafter.uri) if store is not None and not ws.report else None
    if current is not None:
        return Level(current["tau"], f"the τ at its promotion ({current['record']})", k=current.get("k"), **common)
    report = read_manifest(open_artifact(ws.report, settings), "report") if ws.report \
        else newest_report(drafter, settings)
    if report is None:
        return Level(None, "no report on this drafter found", **common)
    served = report.metrics.get("live_acceptance_length")
    tau, how = (served, "served") if served is not None else (report.metrics.get("acceptance_length"), "in-process")
    return Level(tau, f"the {how} τ of report {report.id}", k=report.metrics.get("k"), **common)


def open_watch(ws: WatchSettings, settings, store: ObjectStore) -> Watch:
    """A watch of `ws.endpoint` serving `ws.drafter`, its series in `store`; WatchError when there is nothing to
    judge acceptance against (no baseline found and no absolute floor)."""
    drafter = open_artifact(ws.drafter, settings)
    manifest = read_manifest(drafter, "drafter")
    if not manifest.layout:
        raise WatchError(f"drafter {ws.drafter}: its manifest records no layout, so its target is not known")
    layout = Layout.from_dict(manifest.layout)
    level = promotion_level(ws, drafter, settings, store)
    if level.floor is None:
        raise WatchError(f"drafter {ws.drafter}: {level.source}, so there is no level to judge its acceptance "
                         f"against: give --baseline (the τ measured at promotion), --report or --min-tau")
    kwargs = manifest.drafter.chat_template_kwargs if manifest.drafter else {}
    key = settings.endpoint_api_key.get_secret_value() if settings.endpoint_api_key else None
    base = ws.endpoint.rstrip("/").removesuffix("/v1")
    served = read_served(base, kwargs, key)
    candidates = [c for c in (ws.target, layout.target, *served.roots) if c]
    return Watch(endpoint=base, series=Series(store, ws.name or manifest.id), level=level,
                 reference=build_reference(layout, kwargs, candidates, ws.served_model),
                 # one reading each time: under live traffic the counters never stop moving (read_counters' settle)
                 read_counters=lambda: read_counters(base, timeout_s=0, api_key=key),
                 read_served=lambda: read_served(base, kwargs, key), window=ws.window, min_drafts=ws.min_drafts,
                 plot_days=ws.plot_days)
