"""`eyas watch` (orchestration.watch): points and statuses from recorded spec-decode counters, the target checks, the
stored series, and the command against a fake endpoint whose /metrics, /v1/models and /tokenize the test sets (no
vLLM: the counters' names and shape are vLLM's, as services.evaluator.live parses them)."""
from __future__ import annotations

import contextlib
import json
import threading
from datetime import UTC, datetime
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest

from eyas.layout import Layout
from eyas.manifest import DrafterFacts, Manifest
from eyas.render import render_prompt
from eyas.store import LocalStore
from eyas.target import bundled_target_dir, config_hash, load_tokenizer, tokenizer_hash
from orchestration.cli import main
from orchestration.watch.identity import PROBES, Reference, Served, build_reference, target_checks
from orchestration.watch.series import Series
from orchestration.watch.settings import WatchSettings
from orchestration.watch.status import (
    BELOW,
    CHANGED,
    CURRENT,
    NO_TRAFFIC,
    NOT_CHECKED,
    SAME,
    STALE,
    Check,
    Level,
    Point,
    judge,
    point_between,
)
from orchestration.watch.watch import promotion_level
from services.evaluator.live import parse_counters
from services.generator.endpoint_check import PROBE

K = 3


def metrics(drafts: int, per_pos: list[int], engines: int = 1) -> str:
    """A /metrics page with vLLM's spec-decode counters, the totals split over `engines` engines."""
    lines = []
    for name, value in (("num_drafts", drafts), ("num_draft_tokens", drafts * K), ("num_accepted_tokens",
                                                                                   sum(per_pos))):
        lines += [f"# TYPE vllm:spec_decode_{name}_total counter"]
        lines += [f'vllm:spec_decode_{name}_total{{engine="{e}",model_name="m"}} {value / engines}'
                  for e in range(engines)]
    lines += ["# TYPE vllm:spec_decode_num_accepted_tokens_per_pos_total counter"]
    lines += [f'vllm:spec_decode_num_accepted_tokens_per_pos_total{{engine="{e}",model_name="m",position="{i}"}} '
              f'{v / engines}' for i, v in enumerate(per_pos) for e in range(engines)]
    return "\n".join(lines) + "\n"


def point(at: float, drafts: int, per_pos: list[int], since_start: bool = False) -> Point:
    return Point(at=at, interval_s=None if since_start else 60.0, drafts=drafts, draft_tokens=drafts * K,
                 accepted=sum(per_pos), accepted_per_pos=per_pos, since_start=since_start)


LEVEL = Level(2.0, "the served τ of report eva-1", min_ratio=0.9, k=K)  # floor 1.8
GOOD = [600, 300, 100]  # per 1000 drafts: τ 2.0
FALLEN = [300, 100, 0]  # per 1000 drafts: τ 1.4
UNCHANGED = [Check("model", SAME, "serves m"), Check("rendering", SAME, "as trained"),
             Check("config", NOT_CHECKED, "its root is no directory here")]


def test_a_point_is_the_counters_delta_over_its_interval():
    before = parse_counters(metrics(1000, [600, 300, 100], engines=2))
    now = parse_counters(metrics(1500, [900, 420, 130], engines=2))
    p = point_between(before, 100.0, now, 160.0)
    assert (p.interval_s, p.drafts, p.draft_tokens, p.accepted, p.accepted_per_pos) == (60.0, 500, 1500, 450,
                                                                                       [300, 120, 30])
    assert p.tau == pytest.approx(1.9) and p.per_position == pytest.approx([0.6, 0.24, 0.06])
    assert not p.since_start and not p.restarted
    first = point_between(None, None, now, 160.0)  # no earlier reading: the engine's totals
    assert first.since_start and first.interval_s is None and first.drafts == 1500
    after_restart = point_between(now, 160.0, parse_counters(metrics(200, [100, 50, 0])), 220.0)
    assert after_restart.restarted and (after_restart.drafts, after_restart.accepted) == (200, 150)
    assert point_between(now, 160.0, now, 220.0).tau is None  # no drafts: no τ, not τ 1


def test_a_fall_below_the_threshold_is_detected():
    good = [point(60.0 * i, 1000, GOOD) for i in range(5)]
    status = judge(good, LEVEL, UNCHANGED, window=3, min_drafts=100, at=300.0)
    assert status.state == CURRENT and status.tau == pytest.approx(2.0) and status.drafts == 3000
    assert status.per_position == pytest.approx([0.6, 0.3, 0.1]) and status.floor == pytest.approx(1.8)
    assert status.sentence.startswith("current: τ 2.00 over the last 3 intervals (3000 drafts), 1.00 of the 2.00")
    assert "not checked: config (its root is no directory here)" in status.sentence
    fallen = good + [point(300.0 + 60 * i, 1000, FALLEN) for i in range(3)]
    status = judge(fallen, LEVEL, UNCHANGED, window=3, min_drafts=100, at=480.0)
    assert status.state == BELOW and status.tau == pytest.approx(1.4)
    assert "τ 1.40 over the last 3 intervals" in status.sentence and "0.70 of the 2.00" in status.sentence
    # an absolute floor replaces the ratio: the same good series is below τ 2.5
    assert judge(good, Level(None, "none", min_tau=2.5), UNCHANGED, 3, 100, 300.0).state == BELOW
    # the baseline measured at another K is said to be so
    assert "not like for like" in judge(good, Level(2.0, "r", k=5), UNCHANGED, 3, 100, 300.0).sentence


def test_intervals_without_drafts_are_not_a_fall():
    good = [point(60.0 * i, 1000, GOOD) for i in range(3)]
    quiet = judge([*good, point(180.0, 0, [0, 0, 0])], LEVEL, UNCHANGED, 3, 100, 180.0)
    assert quiet.state == NO_TRAFFIC and "no drafts in the last interval" in quiet.sentence
    # quiet intervals inside the window add no drafts and lower no τ
    back = judge([*good, point(180.0, 0, [0, 0, 0]), point(240.0, 0, [0, 0, 0]), point(300.0, 1000, GOOD)],
                 LEVEL, UNCHANGED, 3, 100, 300.0)
    assert back.state == CURRENT and back.tau == pytest.approx(2.0) and back.drafts == 1000
    few = judge([point(0.0, 40, [30, 0, 0])], LEVEL, UNCHANGED, 3, 100, 0.0)
    assert few.state == NO_TRAFFIC and "40 drafts over the last interval, fewer than the 100" in few.sentence
    assert judge([], LEVEL, UNCHANGED, 3, 100, 0.0).state == NO_TRAFFIC
    # the engine's totals at the first reading (weeks of good traffic) do not hide a fall in the intervals after
    weeks = point(0.0, 1_000_000, [600_000, 300_000, 100_000], since_start=True)
    assert judge([weeks, point(60.0, 1000, FALLEN)], LEVEL, UNCHANGED, 3, 100, 60.0).state == BELOW
    alone = judge([weeks], LEVEL, UNCHANGED, 3, 100, 0.0)
    assert alone.state == CURRENT and "τ 2.00 since the engine started" in alone.sentence
    # an engine that drafts nothing at all publishes no per-position counters: said, not taken for a quiet hour
    plain = point_between(None, None, parse_counters("# TYPE vllm:num_requests_running gauge\n"), 0.0)
    assert "publishes no spec-decode counters" in judge([plain], LEVEL, UNCHANGED, 3, 100, 0.0).sentence


def _served(tokens: list[int] | None, models=("m",), config: str | None = None) -> Served:
    return Served(models=list(models), roots=["/models/m"], tokens=tokens, config_hash=config,
                  config_note="read from /models/m" if config else "its root (/models/m) is no directory here")


def test_a_changed_chat_template_or_model_name_is_a_stale_target():
    good = [point(0.0, 1000, GOOD)]
    ref = Reference(config_hash="cfg1", tokens=[1, 2, 3, 4], tokens_source="the drafter's tokenizer (hash t1)")
    first_run = target_checks(ref, _served([1, 2, 3, 4]), {})
    assert [c.state for c in first_run] == [NOT_CHECKED, SAME, NOT_CHECKED]  # nothing listed earlier; no config
    assert judge(good, LEVEL, first_run, 3, 100, 0.0).state == CURRENT
    seen = {"models": ["m"], "probe_tokens": [1, 2, 3, 4]}
    template = target_checks(ref, _served([1, 2, 9, 4]), seen)
    assert [c.state for c in template] == [SAME, CHANGED, NOT_CHECKED]
    status = judge(good, LEVEL, template, 3, 100, 0.0)  # good acceptance does not hide it
    assert status.state == STALE and "first different at token 2" in status.sentence
    assert "τ 2.00 over the last interval" in status.sentence  # with what it measured
    renamed = judge(good, LEVEL, target_checks(ref, _served([1, 2, 3, 4], models=["m2"]), seen), 3, 100, 0.0)
    assert renamed.state == STALE and "serves m2, where it served m when the watch began" in renamed.sentence
    named = Reference("cfg1", [1, 2, 3, 4], "drafter", model="m")
    assert target_checks(named, _served([1, 2, 3, 4], models=["m2"]), {})[0].state == CHANGED
    assert target_checks(named, _served([1, 2, 3, 4], models=["m"]), {})[0].state == SAME
    # no copy of the drafter's tokenizer here: the rendering is compared with the endpoint's first one
    unknown = Reference("cfg1", None, "no tokenizer here hashes to the drafter's t1")
    later = target_checks(unknown, _served([1, 2, 3, 5]), seen)[1]
    assert later.state == CHANGED and "its own rendering when the watch began" in later.detail
    assert target_checks(unknown, _served([1, 2, 3, 4]), {})[1].state == NOT_CHECKED
    assert target_checks(ref, _served(None), seen)[1].detail == "the endpoint has no /tokenize"
    assert [c.state for c in target_checks(ref, _served([1, 2, 3, 4], config="cfg2"), seen)] == [SAME, SAME, CHANGED]


def test_the_series_is_stored_and_read_back(tmp_path):
    store = LocalStore(tmp_path)
    midnight = datetime(2025, 3, 1, tzinfo=UTC).timestamp()
    points = [point(midnight - 120 + 60 * i, 100 * i, [50 * i, 10 * i, 0]) for i in range(5)]
    series = Series(store, "d1")
    for p in points[:3]:
        series.append(p)
    again = Series(store, "d1")  # a later process (the next --once) goes on with the same day
    for p in points[3:]:
        again.append(p)
    assert sorted(store.list("watch/d1/points")) == ["watch/d1/points/20250228.jsonl",
                                                     "watch/d1/points/20250301.jsonl"]
    read = Series(store, "d1").points()
    assert [p.to_dict() for p in read] == [p.to_dict() for p in points]
    assert [p.at for p in Series(store, "d1").points(last=2)] == [points[3].at, points[4].at]
    # since a time: the days before it are not read, the points before it in its day not returned
    assert [p.at for p in Series(store, "d1").points(since=midnight)] == [p.at for p in points[2:]]
    assert [p.at for p in Series(store, "d1").points(since=midnight - 60)] == [p.at for p in points[1:]]
    assert Series(store, "other").points() == [] and Series(store, "d1").status() is None
    status = judge(points, LEVEL, UNCHANGED, 3, 100, points[-1].at)
    series.put_status(status)
    series.put_state({"endpoint": "http://e"})
    assert Series(store, "d1").status() == json.loads(json.dumps(status.to_dict()))
    assert Series(store, "d1").state() == {"endpoint": "http://e"}


def _manifest(artifact: Path, manifest: Manifest) -> str:
    artifact.mkdir(parents=True, exist_ok=True)
    (artifact / "manifest.json").write_text(manifest.model_dump_json())
    return artifact.as_uri()


def _report(store: Path, name: str, drafter_uri: str, created: float, **metrics) -> None:
    _manifest(store / "reports" / name, Manifest(kind="report", id=name, created_at=created,
                                                 inputs=[drafter_uri], metrics={"k": K, **metrics}))


def test_the_promotion_level_is_the_newest_report_on_the_drafter(tmp_path):
    from eyas.store import open_artifact

    store = tmp_path / "store"
    uri = _manifest(store / "drafters" / "tra-1", Manifest(kind="drafter", id="tra-1"))
    _report(store, "eva-old", uri, 1.0, acceptance_length=1.5, live_acceptance_length=1.6)
    _report(store, "eva-new", uri, 2.0, acceptance_length=2.2, live_acceptance_length=2.1)
    _report(store, "eva-else", (store / "drafters" / "tra-2").as_uri(), 3.0, acceptance_length=3.0)
    ws = WatchSettings(endpoint="http://e", drafter=str(store / "drafters" / "tra-1"))
    drafter = open_artifact(ws.drafter)
    level = promotion_level(ws, drafter, None)
    assert (level.baseline, level.source, level.k) == (2.1, "the served τ of report eva-new", K)
    assert level.floor == pytest.approx(0.9 * 2.1)
    _report(store, "eva-newest", uri, 4.0, acceptance_length=1.9)  # no live A/B: its in-process τ
    assert promotion_level(ws, drafter, None).source == "the in-process τ of report eva-newest"
    given = ws.model_copy(update={"baseline": 3.0, "min_tau": 2.0})
    assert (promotion_level(given, drafter, None).baseline, promotion_level(given, drafter, None).floor) == (3.0, 2.0)


class FakeEndpoint(BaseHTTPRequestHandler):
    """/metrics, /v1/models and /tokenize, each answering what the test put in `state`."""
    state: dict = {}

    def _send(self, body: bytes, kind: str) -> None:
        self.send_response(200)
        self.send_header("content-type", kind)
        self.send_header("content-length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def do_GET(self):
        if self.path == "/metrics":
            self._send(self.state["metrics"].encode(), "text/plain")
        else:
            self._send(json.dumps({"data": self.state["models"]}).encode(), "application/json")

    def do_POST(self):  # /tokenize: the probe with its system turn, or without one (`bare`)
        body = json.loads(self.rfile.read(int(self.headers["content-length"])))
        system = any(m["role"] == "system" for m in body["messages"])
        self._send(json.dumps({"tokens": self.state["tokens" if system else "bare"]}).encode(), "application/json")

    def log_message(self, *args):
        pass


@contextlib.contextmanager
def fake_endpoint(state: dict):
    FakeEndpoint.state = state
    server = ThreadingHTTPServer(("127.0.0.1", 0), FakeEndpoint)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}"
    finally:
        server.shutdown()
        server.server_close()


def _drafter(store: Path, target: Path, tokenizer) -> str:
    layout = Layout(target=str(target), target_config_hash=config_hash(target),
                    tokenizer_hash=tokenizer_hash(tokenizer), num_layers=30, hidden_size=576, vocab_size=49152,
                    aux_layers=(1, 14, 26))
    facts = DrafterFacts(target=str(target), ttt_steps=K, val_every=10, draft_vocab_size=8192)
    return _manifest(store / "drafters" / "tra-w", Manifest(kind="drafter", id="tra-w", layout=layout.to_dict(),
                                                            drafter=facts))


def test_watch_once_against_a_fake_endpoint(tmp_path, capsys):
    target = bundled_target_dir()
    tokenizer = load_tokenizer(str(target))
    store = tmp_path / "store"
    uri = _drafter(store, target, tokenizer)
    _report(store, "eva-w", uri, 1.0, acceptance_length=2.1, live_acceptance_length=2.0)  # floor 1.8
    rendered = render_prompt(tokenizer, PROBE)
    state = {"metrics": metrics(1000, GOOD), "models": [{"id": "smol", "root": str(target)}], "tokens": rendered,
             "bare": render_prompt(tokenizer, PROBES[1])}
    work = tmp_path / "work"
    with fake_endpoint(state) as url:
        def once(drafter: Path = store / "drafters" / "tra-w") -> tuple[int, str]:
            code = main(["watch", "--endpoint", url, "--drafter", str(drafter), "--once", "--workdir", str(work)])
            out = capsys.readouterr()
            return code, out.out + out.err

        code, out = once()  # the first reading: the engine's totals
        assert code == 0 and "current: τ 2.00 since the engine started (1000 drafts)" in out
        assert "served τ of report eva-w" in out and "the target is unchanged in rendering, config" in out
        state["metrics"] = metrics(1500, [700, 330, 110])  # 500 drafts since, 140 accepted: τ 1.28
        code, out = once()
        assert code == 1 and "below threshold: τ 1.28 over the last interval (500 drafts)" in out
        code, out = once()  # the counters did not move
        assert code == 3 and "no traffic: no drafts in the last interval" in out
        state.update(metrics=metrics(2500, [1300, 630, 210]), models=[{"id": "other", "root": str(target)}],
                     tokens=[*rendered[:5], rendered[5] + 1, *rendered[6:]])
        code, out = once()
        assert code == 1 and out.count("stale target") == 1 and "first different at token 5" in out
        assert f"serves other ({target}), where it served smol ({target})" in out
        bare = tmp_path / "bare" / "drafters" / "tra-b"  # no report beside it, no --baseline
        _manifest(bare, Manifest.model_validate_json((store / "drafters" / "tra-w" / "manifest.json").read_text()))
        code, out = once(bare)
        assert code == 2 and "give --baseline" in out
    code, out = once()  # the endpoint is gone
    assert code == 4 and "endpoint unreachable: its counters could not be read (ConnectError" in out
    series = Series(LocalStore(work / "store"), "tra-w")
    assert [(p.drafts, p.since_start) for p in series.points()] == [(1000, True), (500, False), (0, False),
                                                                    (1000, False)]
    assert series.status()["state"] == STALE


def test_a_changed_default_system_prompt_is_a_changed_rendering():
    """A template's default system prompt renders only where a request has no system turn: the probe with its own
    system turn renders the changed template exactly as the old one, the probe without it does not, and the
    rendering check reads both (bench/README.md § The loop: a watch that read only the first missed this change)."""
    target = bundled_target_dir()
    tokenizer = load_tokenizer(str(target))
    layout = Layout(target=str(target), target_config_hash=config_hash(target),
                    tokenizer_hash=tokenizer_hash(tokenizer), num_layers=30, hidden_size=576, vocab_size=49152,
                    aux_layers=(1, 14, 26))
    ref = build_reference(layout, {}, [str(target)])
    changed = load_tokenizer(str(target))
    changed.chat_template = changed.chat_template.replace("named SmolLM, trained by Hugging Face", "who is terse")
    assert changed.chat_template != tokenizer.chat_template
    assert render_prompt(changed, PROBES[0]) == render_prompt(tokenizer, PROBES[0])  # the first probe sees nothing
    served = [t for probe in PROBES for t in render_prompt(changed, probe)]
    check = target_checks(ref, _served(served), {})[1]
    assert check.name == "rendering" and check.state == CHANGED, check
    assert target_checks(ref, _served(ref.tokens), {})[1].state == SAME
