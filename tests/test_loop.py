"""The loop as a service (orchestration.loop): each pass is the real watch against the fake endpoint of
tests/test_watch.py (its /metrics, /v1/models and /tokenize set by the test), and a refresh when the watch says
below threshold or stale target. The refresh is a stand-in that records promotion records as `eyas refresh` does:
a real one (tests/test_refresh.py) trains for minutes. Also the series' picture, the loop's read-only API routes and
the `eyas loop` command."""
from __future__ import annotations

import io
import json
import threading
import time
from datetime import UTC, datetime
from pathlib import Path

import matplotlib.dates as mdates
import matplotlib.image
import pytest
from fastapi.testclient import TestClient
from pydantic import SecretStr

from eyas.manifest import Manifest
from eyas.store import LocalStore, open_artifact
from eyas.target import bundled_target_dir, load_tokenizer
from orchestration.api.app import create_app
from orchestration.cli import main
from orchestration.loop.command import HEARTBEAT
from orchestration.loop.loop import Loop, loop_once
from orchestration.loop.state import loop_state
from orchestration.refresh.promotion import Promotions
from orchestration.refresh.refresh import RefreshError
from orchestration.settings import ServiceSettings
from orchestration.watch.plot import figure, png
from orchestration.watch.series import Series
from orchestration.watch.settings import WatchSettings
from orchestration.watch.status import BELOW, CURRENT, NO_TRAFFIC, STALE, judge
from orchestration.watch.watch import open_watch
from tests.test_watch import GOOD, LEVEL, UNCHANGED, _drafter, _manifest, _report, fake_endpoint, metrics, point

PNG = b"\x89PNG\r\n\x1a\n"
HOUR = 3600.0


class Counters:
    """The engine's totals, moved on by each interval's drafts and accepted tokens per position."""

    def __init__(self, state: dict):
        self.state, self.drafts, self.per_pos = state, 0, [0, 0, 0]

    def serve(self, drafts: int, per_pos: list[int]) -> None:
        self.drafts += drafts
        self.per_pos = [a + b for a, b in zip(self.per_pos, per_pos, strict=True)]
        self.state["metrics"] = metrics(self.drafts, self.per_pos)


FALLEN = [100, 30, 10]  # per 500 drafts: τ 1.28, under the floor 1.8 (0.9 × the report's served τ 2.0)


@pytest.fixture(scope="module")
def rendered() -> tuple[Path, dict[str, list[int]]]:
    """The bundled target and the probes as its tokenizer renders them (what the fake endpoint answers /tokenize,
    with the probe's system turn and without)."""
    from eyas.render import render_prompt
    from orchestration.watch.identity import PROBES

    target = bundled_target_dir()
    tokenizer = load_tokenizer(str(target))
    return target, {"tokens": render_prompt(tokenizer, PROBES[0]), "bare": render_prompt(tokenizer, PROBES[1])}


class Line:
    """A promotion line served by the fake endpoint: the drafter served first (a report beside it gives the level),
    the loop's store, and a stand-in refresh that records what `refresh` records, promoting `promote_to` if set."""

    def __init__(self, tmp_path: Path, url: str, target: Path):
        self.artifacts = tmp_path / "artifacts"
        self.first = _drafter(self.artifacts, target, load_tokenizer(str(target)))
        _report(self.artifacts, "eva-w", self.first, 1.0, acceptance_length=2.1, live_acceptance_length=2.0)
        self.store = LocalStore(tmp_path / "work" / "store")
        self.settings = ServiceSettings(workdir=tmp_path / "work")
        self.now = time.time()
        self.calls: list[str] = []
        self.promote_to: str | None = None
        self.fail = False
        self.url = url

    def drafter(self, name: str) -> str:
        """Another drafter of the same layout (a refresh's candidate)."""
        manifest = Manifest.model_validate_json((self.artifacts / "drafters" / "tra-w" / "manifest.json").read_text())
        return open_artifact(_manifest(self.artifacts / "drafters" / name,
                                       manifest.model_copy(update={"id": name}))).uri

    def refresh(self, drafter: str) -> dict:
        self.calls.append(drafter)
        if self.fail:
            raise RefreshError("12 distinct recent prompts: too few to hold some out and train on the rest")
        promote = self.promote_to is not None
        record = {"kind": "refresh", "at": self.now, "promoted": promote, "k": 3,
                  "why": "τ 1.500 beats 1.280" if promote else "not more than the significance margin",
                  "current": {"drafter": drafter, "tau": 1.28},
                  "candidate": {"drafter": self.promote_to or "file:///not-promoted", "tau": 1.5}}
        record["key"] = Promotions(self.store, "line").record(record)
        return record

    def loop(self, **kw) -> Loop:
        return Loop(self.store, "line", min_refresh_s=HOUR, drafter=self.first, clock=lambda: self.now,
                    refresh=self.refresh, **kw,
                    open_watch=lambda d: open_watch(WatchSettings(endpoint=self.url, drafter=d, name="line"),
                                                    self.settings, self.store))


@pytest.fixture
def served(rendered):
    """(the fake endpoint's state, its URL, the served target's listing)"""
    target, renderings = rendered
    state = {"models": [{"id": "smol", "root": str(target)}], **renderings}
    with fake_endpoint(state) as url:
        yield state, url


def test_the_loop_refreshes_when_below_threshold_and_not_again_within_the_minimum_interval(tmp_path, served,
                                                                                             rendered):
    state, url = served
    line, engine = Line(tmp_path, url, rendered[0]), Counters(state)
    loop = line.loop()
    engine.serve(1000, GOOD)
    turn = loop_once(loop)  # the engine's totals: τ 2.0
    assert turn.status.state == CURRENT and turn.refresh == "no refresh: the drafter is current"
    assert line.calls == [] and loop_state(line.store, "line") is None
    engine.serve(500, FALLEN)
    turn = loop_once(loop)
    assert turn.status.state == BELOW and line.calls == [line.first]
    assert turn.refresh.startswith("refreshed: not promoted")
    assert loop_state(line.store, "line")["outcome"] == "not promoted"
    line.now += HOUR - 60
    engine.serve(500, FALLEN)
    turn = loop_once(loop)  # still below, but the last refresh was 59 minutes ago
    assert turn.status.state == BELOW and len(line.calls) == 1
    assert "within the minimum interval of 1.0 h" in turn.refresh
    line.now += 120
    line.promote_to = line.drafter("tra-2")
    engine.serve(500, FALLEN)
    turn = loop_once(loop)
    assert turn.status.state == BELOW and line.calls == [line.first, line.first]
    assert turn.refresh.startswith("refreshed: promoted")
    # the next pass watches the promoted drafter, judged against the τ at its promotion (1.5: floor 1.35), over
    # the window's intervals (τ 1.83)
    engine.serve(5000, [3000, 1500, 500])
    turn = loop_once(loop)
    assert turn.drafter == line.promote_to and turn.status.baseline == 1.5 and turn.status.state == CURRENT
    assert len(line.calls) == 2
    # the series goes on under the line's name, with its picture
    assert [p.drafts for p in Series(line.store, "line").points()] == [1000, 500, 500, 500, 5000]
    assert Series(line.store, "line").plot().startswith(PNG)


def test_a_stale_target_refreshes_a_failed_refresh_waits_too_and_no_traffic_never_refreshes(tmp_path, served,
                                                                                            rendered):
    state, url = served
    line, engine = Line(tmp_path, url, rendered[0]), Counters(state)
    loop = line.loop()
    engine.serve(1000, GOOD)
    assert loop_once(loop).status.state == CURRENT
    line.now += 10 * HOUR
    loop_once(loop)  # counters unchanged: no traffic
    assert line.calls == []
    state["models"] = [{"id": "other", "root": state["models"][0]["root"]}]  # another model served
    engine.serve(1000, GOOD)
    line.fail = True
    turn = loop_once(loop)
    assert turn.status.state == STALE and line.calls == [line.first]  # good acceptance does not hide it
    assert turn.refresh == ("refreshed: failed (RefreshError: 12 distinct recent prompts: too few to hold some out "
                            "and train on the rest)")
    line.now += 60
    engine.serve(1000, GOOD)
    turn = loop_once(loop)  # a failed refresh also began: the next one waits
    assert turn.status.state == STALE and len(line.calls) == 1 and "within the minimum interval" in turn.refresh
    line.now += 2 * HOUR
    turn = loop_once(loop)  # no drafts since: nothing to judge acceptance by, but the target is still another
    assert turn.status.state == STALE and len(line.calls) == 2
    state["models"] = [{"id": "smol", "root": state["models"][0]["root"]}]
    line.now += 2 * HOUR
    turn = loop_once(loop)
    assert turn.status.state == NO_TRAFFIC and len(line.calls) == 2
    assert turn.refresh == "no refresh: acceptance cannot be judged"


def test_a_refresh_in_the_background_is_not_begun_twice(tmp_path, served, rendered):
    state, url = served
    line, engine = Line(tmp_path, url, rendered[0]), Counters(state)
    release = threading.Event()
    slow = line.refresh

    def waiting(drafter: str) -> dict:
        assert release.wait(30)
        return slow(drafter)

    line.refresh = waiting
    loop = line.loop(background=True)
    engine.serve(1000, [2 * a for a in FALLEN])
    turn = loop_once(loop)
    assert turn.status.state == BELOW and turn.refresh == "refresh begun (it runs beside the watch)"
    line.now += 2 * HOUR  # past the minimum interval: still, one refresh at a time
    engine.serve(500, FALLEN)
    assert loop_once(loop).refresh == "no refresh: a refresh is running"
    assert loop_state(line.store, "line").keys() == {"drafter", "began"}
    release.set()
    loop.refreshing.join(30)
    assert line.calls == [line.first] and loop_state(line.store, "line")["outcome"] == "not promoted"


def test_the_series_picture_shows_the_points_the_threshold_and_the_promotions(tmp_path):
    t0 = datetime(2025, 3, 1, tzinfo=UTC).timestamp()
    points = [point(t0, 100_000, [60_000, 30_000, 10_000], since_start=True)]  # totals: not an interval's τ
    points += [point(t0 + 60 * i, 1000, [600 - 100 * i, 300, 100]) for i in range(1, 5)]
    points.insert(3, point(t0 + 150, 0, [0, 0, 0]))  # a quiet interval: no τ
    history = [{"kind": "refresh", "at": t0 + 130, "promoted": True, "candidate": {"tau": 2.1}},
               {"kind": "refresh", "at": t0 + 170, "promoted": False, "candidate": {"tau": 1.2}},
               {"kind": "rollback", "at": t0 + 230, "tau": None}]  # to a drafter never scored
    fig = figure("line", points, LEVEL, history)
    [ax] = fig.axes
    drawn = {line.get_gid(): line for line in ax.lines if line.get_gid() != "promotion"}

    def at(seconds: float) -> float:
        return mdates.date2num(datetime.fromtimestamp(t0 + seconds, UTC))

    tau = drawn["tau"]
    assert list(tau.get_ydata()) == pytest.approx([1.9, 1.8, 1.7, 1.6])
    assert list(mdates.date2num(tau.get_xdata())) == pytest.approx([at(60), at(120), at(180), at(240)])
    assert drawn["threshold"].get_ydata()[0] == pytest.approx(1.8) and drawn["baseline"].get_ydata()[0] == 2.0
    promotions = [line for line in ax.lines if line.get_gid() == "promotion"]  # the promoting refresh only
    assert [mdates.date2num(line.get_xdata()[0]) for line in promotions] == pytest.approx([at(130)])
    assert mdates.date2num(drawn["rollback"].get_xdata()[0]) == pytest.approx(at(230))
    image = png(fig)
    assert image.startswith(PNG)
    pixels = matplotlib.image.imread(io.BytesIO(image), format="png")
    assert pixels.shape[0] > 200 and pixels.shape[1] > 500 and pixels.std() > 0  # drawn, not blank


def test_the_api_shows_the_watch_the_series_its_picture_and_the_promotions(tmp_path):
    settings = ServiceSettings(workdir=tmp_path / "work", api_key=SecretStr("k"))
    store = LocalStore(settings.store_root)
    series = Series(store, "line")
    t0 = time.time() - 600
    points = [point(t0 + 60 * i, 1000, GOOD) for i in range(5)]
    for p in points:
        series.append(p)
    series.put_status(judge(points, LEVEL, UNCHANGED, 3, 100, points[-1].at))
    series.put_plot(png(figure("line", points, LEVEL, [])))
    line = Promotions(store, "line")
    line.record({"kind": "refresh", "at": t0, "promoted": True, "why": "better", "k": 3,
                 "current": {"drafter": "file:///d/a", "tau": 1.9}, "candidate": {"drafter": "file:///d/b",
                                                                                   "tau": 2.0}})
    line.rollback()
    key = {"Authorization": "Bearer k"}
    with TestClient(create_app("evaluate", settings)) as client:
        watch = client.get("/v1/watch/line", headers=key)
        assert watch.status_code == 200, watch.text
        body = watch.json()
        assert body["state"] == CURRENT and body["sentence"].startswith("current: τ 2.00 over the last 3 intervals")
        assert body["latest"]["at"] == points[-1].at and body["latest"]["tau"] == pytest.approx(2.0)
        assert body["floor"] == pytest.approx(1.8) and [c["state"] for c in body["checks"]] == ["same", "same",
                                                                                                "not checked"]
        assert body["last_refresh"] is None
        assert client.get(body["links"]["plot"], headers=key).content.startswith(PNG)
        assert client.get(body["links"]["plot"], headers=key).headers["content-type"] == "image/png"
        got = client.get(body["links"]["series"], headers=key).json()
        assert [p["at"] for p in got] == [p.at for p in points]
        assert [p["at"] for p in client.get("/v1/watch/line/series", params={"since": points[2].at, "limit": 2},
                                            headers=key).json()] == [points[3].at, points[4].at]
        promotions = client.get(body["links"]["promotions"], headers=key).json()
        assert promotions["current"]["drafter"] == "file:///d/a" and promotions["current"]["previous"] == []
        assert [r["kind"] for r in promotions["history"]] == ["refresh", "rollback"]
        assert promotions["history"][0]["candidate"]["tau"] == 2.0  # the whole record

        for path in ("/v1/watch/nope", "/v1/watch/nope/series", "/v1/watch/nope/plot.png", "/v1/promotions/nope"):
            missing = client.get(path, headers=key)
            assert missing.status_code == 404 and missing.json()["detail"][0]["value"] == "nope", path
            assert "nope" in missing.json()["detail"][0]["message"]
            assert client.get(path.replace("nope", "line")).status_code == 401  # no key, whether the name is known
            assert client.get(path.replace("nope", "line"), headers={"Authorization": "Bearer x"}).status_code == 403
        assert client.get("/v1/promotions/.hidden", headers=key).status_code == 422  # a name, never a path step
        schema = client.get("/openapi.json", headers=key).json()
    with TestClient(create_app("generate", settings)) as client:  # the evaluate service's only
        assert client.get("/v1/watch/line", headers=key).status_code == 404
    ok = {path: schema["paths"][path]["get"]["responses"]["200"]["content"] for path in (
        "/v1/watch/{name}", "/v1/watch/{name}/series", "/v1/watch/{name}/plot.png", "/v1/promotions/{name}")}
    assert ok["/v1/watch/{name}"]["application/json"]["schema"]["$ref"].endswith("/WatchView")
    assert ok["/v1/watch/{name}/series"]["application/json"]["schema"]["items"]["$ref"].endswith("/PointView")
    assert "image/png" in ok["/v1/watch/{name}/plot.png"]
    assert ok["/v1/promotions/{name}"]["application/json"]["schema"]["$ref"].endswith("/PromotionsView")


def test_the_loop_command_runs_a_pass(tmp_path, served, rendered, capsys):
    state, url = served
    line = Line(tmp_path, url, rendered[0])
    Counters(state).serve(1000, GOOD)
    before = time.time()
    work = str(tmp_path / "work")
    code = main(["loop", "--endpoint", url, "--drafter", str(line.artifacts / "drafters" / "tra-w"), "--once",
                 "--name", "line", "--workdir", work])
    out = capsys.readouterr().out
    assert code == 0 and "current: τ 2.00 since the engine started" in out
    assert out.rstrip().endswith("→ no refresh: the drafter is current")
    assert HEARTBEAT.stat().st_mtime >= before - 1
    assert json.loads((tmp_path / "work" / "store" / "watch" / "line" / "status.json").read_text())["state"] == \
        CURRENT
    assert main(["loop", "--endpoint", url, "--once", "--name", "empty", "--workdir", work]) == 2
    assert "promotion line 'empty' has no current drafter yet: give --drafter" in capsys.readouterr().out
    assert main(["loop", "--endpoint", url, "--once", "--watch", '{"windw": 3}', "--workdir", work]) == 2
    assert "windw: not watch settings the loop leaves to you" in capsys.readouterr().err
