"""The loop's routes, read-only, on the evaluate stage's service (the served τ is what that stage measures; the
routes read the store the services share, which a watch, a refresh and `eyas loop` write):

  GET /v1/watch/{name}            the watch's latest status: its state and sentence, the numbers it judged, the
                                  target checks, the latest point, and the last refresh the loop of the line began
  GET /v1/watch/{name}/series     the points over time (?since=UNIX_TIME, ?limit=N: the latest N)
  GET /v1/watch/{name}/plot.png   the series as a picture: τ over time, the threshold, the promotions (image/png)
  GET /v1/promotions/{name}       the promotion line: its current drafter (and the ones before it), every record

Routes are thin: each reads through orchestration.watch.series.Series, orchestration.refresh.promotion.Promotions
or orchestration.loop.state.loop_state. An unknown name is a 404 that names it.
"""
# No `from __future__ import annotations`: FastAPI reads the path and query parameters from the annotations.
from typing import Annotated, Any, Literal

from fastapi import APIRouter, HTTPException, Path, Query, Response
from pydantic import BaseModel, ConfigDict, Field

from eyas.store import ObjectStore
from orchestration.api.deps import v1_dependencies
from orchestration.api.routes import error_responses
from orchestration.api.schemas import Problems, problem
from orchestration.loop.state import loop_state
from orchestration.refresh.promotion import Promotions
from orchestration.settings import ServiceSettings
from orchestration.watch.series import Series

NAME = r"^[A-Za-z0-9_-][A-Za-z0-9_.-]{0,127}$"  # a name, never a path step (`.`, `..`)
Name = Annotated[str, Path(pattern=NAME, description="the watch series' name (`eyas loop`: the promotion line's)")]
LineName = Annotated[str, Path(pattern=NAME, description="the promotion line's name")]


class CheckView(BaseModel):
    """One comparison of the served target with the one the drafter was trained for."""
    name: Literal["model", "rendering", "config"]
    state: Literal["same", "changed", "not checked"]
    detail: str


class PointView(BaseModel):
    """One interval of the series: the deltas of the engine's spec-decode counters over it."""
    at: float = Field(description="unix time of the reading that closes the interval")
    interval_s: float | None = Field(description="its length; null for the engine's totals at a first reading")
    drafts: int
    draft_tokens: int
    accepted: int
    accepted_per_pos: list[int]
    since_start: bool = Field(description="no earlier reading: the engine's totals since it started")
    restarted: bool = Field(description="the counters went back: the engine restarted within the interval")
    tau: float | None = Field(description="1 + accepted / drafts; null without drafts")
    per_position: list[float | None]


class LastRefresh(BaseModel):
    """The last refresh the loop of this line began (`eyas loop`)."""
    drafter: str = Field(description="the drafter it refreshed from")
    began: float
    ended: float | None = None
    outcome: Literal["promoted", "not promoted", "failed"] | None = Field(None, description="null while it runs")
    why: str | None = None
    record: str | None = Field(None, description="the promotion record's key in the store")


class WatchView(BaseModel):
    name: str
    state: Literal["current", "below threshold", "stale target", "no traffic"]
    sentence: str = Field(description="the status in words, with its numbers and the checks not made")
    at: float = Field(description="unix time of the reading")
    tau: float | None = Field(description="τ over the judged window's intervals together")
    drafts: int
    intervals: int
    per_position: list[float]
    baseline: float | None = Field(description="the τ measured at promotion")
    floor: float | None = Field(description="the threshold: below it, the drafter is below threshold")
    checks: list[CheckView]
    latest: PointView | None = Field(description="the newest point of the series")
    last_refresh: LastRefresh | None = Field(description="the last refresh the loop of this line began, if any")
    links: dict[str, str]


class Drafter(BaseModel):
    drafter: str = Field(description="the drafter's artifact URI")
    tau: float | None = Field(description="its τ when it was promoted (on that refresh's held-out prompts)")
    k: int | None
    record: str | None = Field(description="key of the record that promoted it; null for the line's first drafter")


class Current(Drafter):
    previous: list[Drafter] = Field(description="the drafters current before it, newest last (a rollback restores "
                                                "the last)")


class Record(BaseModel):
    """A refresh's record (both τ, the data, the jobs, whether it promoted and why) or a rollback's (from, to)."""
    model_config = ConfigDict(extra="allow")
    kind: Literal["refresh", "rollback"]
    at: float


class PromotionsView(BaseModel):
    name: str
    current: Current | None = Field(description="the drafter served now; null before the first promotion")
    history: list[Record] = Field(description="every refresh and rollback, oldest first")


def loop_routes(store: ObjectStore, settings: ServiceSettings) -> APIRouter:
    router = APIRouter(prefix="/v1", dependencies=v1_dependencies(settings))
    errors = error_responses(settings)
    missing = {404: {"model": Problems, "description": "no watch series of that name"}}

    def series(name: str) -> tuple[Series, dict[str, Any]]:
        found = Series(store, name)
        status = found.status()
        if status is None:
            raise HTTPException(404, [problem("name", name, f"no watch series named {name}")])
        return found, status

    @router.get("/watch/{name}", response_model=WatchView, responses={**errors, **missing})
    def watch_status(name: Name) -> WatchView:
        found, status = series(name)
        latest = found.points(last=1)
        return WatchView(name=name, **status, latest=latest[0].to_dict() if latest else None,
                         last_refresh=loop_state(store, name),
                         links={"series": f"/v1/watch/{name}/series", "plot": f"/v1/watch/{name}/plot.png",
                                "promotions": f"/v1/promotions/{name}"})

    @router.get("/watch/{name}/series", response_model=list[PointView], responses={**errors, **missing})
    def watch_series(name: Name,
                     since: Annotated[float | None, Query(ge=0, le=1e10, description="only points at or after this "
                                                                                         "unix time")] = None,
                     limit: Annotated[int, Query(ge=1, le=100_000, description="at most this many, the latest")] = 1000,
                     ) -> list[PointView]:
        found, _ = series(name)
        return [PointView(**p.to_dict()) for p in found.points(last=limit, since=since)]

    @router.get("/watch/{name}/plot.png", response_class=Response,
                responses={200: {"content": {"image/png": {}}, "description": "τ over time, the threshold and the "
                                 "promotions (orchestration.watch.plot)"}, **errors, **missing})
    def watch_plot(name: Name) -> Response:
        png = series(name)[0].plot()
        if png is None:
            raise HTTPException(404, [problem("name", name, f"watch series {name} has no picture yet")])
        return Response(png, media_type="image/png")

    @router.get("/promotions/{name}", response_model=PromotionsView,
                responses={**errors, 404: {"model": Problems, "description": "no promotion line of that name"}})
    def promotions(name: LineName) -> PromotionsView:
        line = Promotions(store, name)
        current, history = line.current(), line.history()
        if current is None and not history:
            raise HTTPException(404, [problem("name", name, f"no promotion line named {name}")])
        return PromotionsView(name=name, current=current, history=history)

    return router
