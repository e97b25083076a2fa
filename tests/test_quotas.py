"""The operator's quotas (orchestration.quotas): a job over a cap is refused at submit, naming the field (in a `then`
entry too) and the cap's variable, by the API as a 422; in-process generation is off in service mode unless the
operator allows it; a run past the wall-time cap stops and fails, saying so, where a cancel still cancels."""
from __future__ import annotations

import sys
import time
import types
from collections.abc import Iterator
from pathlib import Path

import pytest
from fastapi.testclient import TestClient

from eyas.stage import StageContext, StageResult, StageSpec
from orchestration import registry
from orchestration.api.app import create_app
from orchestration.embedded import EmbeddedRunner
from orchestration.execution import SpecError, validate_spec
from orchestration.jobs import request_cancel
from orchestration.quotas import OverQuota, check_quotas
from orchestration.settings import ServiceSettings
from services.evaluator.spec import Spec as EvaluateSpec
from services.extractor.spec import Spec as ExtractSpec
from services.generator.spec import Spec as GenerateSpec
from services.trainer.spec import Spec as TrainSpec

ENDPOINT = "http://vllm:8000"
SPECS = {"generate": GenerateSpec, "extract": ExtractSpec, "train": TrainSpec, "evaluate": EvaluateSpec}


def refused(stage: str, spec: dict, **settings) -> OverQuota:
    with pytest.raises(OverQuota) as e:
        check_quotas(stage, SPECS[stage].model_validate(spec), ServiceSettings(**settings))
    return e.value


def taken(stage: str, spec: dict, **settings) -> None:
    check_quotas(stage, SPECS[stage].model_validate(spec), ServiceSettings(**settings))


def test_no_cap_is_set_by_default():
    settings = ServiceSettings()
    assert [settings.max_job_prompts, settings.max_job_tokens, settings.max_job_epochs, settings.max_job_steps,
            settings.max_job_minutes, settings.allow_in_process_generation] == [None] * 6
    taken("generate", {"prompts": "bundled:sharegpt", "synthesize": 1_000_000})
    taken("train", {"features": "s3://eyas/features/x", "epochs": 1000, "steps": 100_000_000})


def test_in_process_generation_is_off_in_service_mode_unless_allowed(monkeypatch: pytest.MonkeyPatch):
    spec = {"prompts": "bundled:sharegpt"}
    e = refused("generate", spec, mode="service")
    assert (e.field, e.value) == ("endpoint", None)
    assert "in-process generation" in e.message and "EYAS_ALLOW_IN_PROCESS_GENERATION is unset" in e.message
    taken("generate", {**spec, "endpoint": ENDPOINT}, mode="service")
    taken("generate", spec, mode="service", allow_in_process_generation=True)
    taken("generate", spec, mode="embedded")
    e = refused("generate", spec, mode="embedded", allow_in_process_generation=False)
    assert e.field == "endpoint" and "EYAS_ALLOW_IN_PROCESS_GENERATION=false" in e.message
    monkeypatch.setenv("EYAS_ALLOW_IN_PROCESS_GENERATION", "false")  # the operator sets it in the environment
    assert ServiceSettings().allow_in_process_generation is False


def test_prompts_cap():
    cap = {"max_job_prompts": 10}
    e = refused("generate", {"prompts": "bundled:sharegpt", "limit": 11}, **cap)
    assert (e.field, e.value) == ("limit", 11) and e.message == "exceeds the operator's cap EYAS_MAX_JOB_PROMPTS=10"
    assert refused("generate", {"synthesize": 11}, **cap).field == "synthesize"
    e = refused("generate", {"prompts": "bundled:sharegpt", "limit": 6, "synthesize": 5}, **cap)
    assert e.field == "synthesize" and "limit 6 + synthesize 5 = 11 prompts exceeds" in e.message
    # a prompt file's length is unknown at submit: the cap needs its limit
    e = refused("generate", {"prompts": "bundled:sharegpt"}, **cap)
    assert ((e.field, e.value) == ("limit", None) and "give limit" in e.message
            and "EYAS_MAX_JOB_PROMPTS=10" in e.message)
    taken("generate", {"prompts": "bundled:sharegpt", "limit": 5, "synthesize": 5}, **cap)
    taken("generate", {"mix": [{"prompts": "synth"}, {"prompts": "bundled:sharegpt"}], "limit": 10}, **cap)
    assert refused("generate", {"mix": [{"prompts": "synth"}], "limit": 11}, **cap).field == "limit"
    # evaluate: both prompt sets count
    e = refused("evaluate", {"drafter": "s3://eyas/drafters/x", "num_prompts": 8}, max_job_prompts=12)
    assert e.field == "second_num_prompts" and "num_prompts 8 + second_num_prompts 5 = 13 prompts" in e.message
    taken("evaluate", {"drafter": "s3://eyas/drafters/x", "num_prompts": 12, "second_prompts": None},
          max_job_prompts=12)
    assert refused("evaluate", {"drafter": "s3://eyas/drafters/x", "num_prompts": 13}, max_job_prompts=12).field == \
        "num_prompts"


def test_tokens_cap():
    cap = {"max_job_tokens": 2000}
    file = {"prompts": "bundled:sharegpt", "limit": 10, "max_turns": 2, "sampling": {"max_tokens": 100}}
    taken("generate", file, **cap)  # 10 prompts × 2 turns × 100 = 2000
    e = refused("generate", {**file, "sampling": {"max_tokens": 101}}, **cap)
    assert (e.field, e.value) == ("sampling.max_tokens", 101)
    assert e.message == "20 answers (prompts × turns) × max_tokens 101 = 2020 tokens exceeds the operator's cap " \
                        "EYAS_MAX_JOB_TOKENS=2000"
    # a conversation's turns are unknown at submit: the cap needs max_turns (and a file's prompts, limit)
    e = refused("generate", {**file, "max_turns": None}, **cap)
    assert (e.field, e.value) == ("max_turns", None) and "give max_turns" in e.message
    assert refused("generate", {**file, "limit": None}, **cap).field == "limit"
    assert refused("generate", {**file, "max_turns": 3}, **cap).field == "sampling.max_tokens"  # 3000 tokens
    # synthesized prompts have synth_turns turns (at most max_turns): 4 × 2 × 250 = 2000
    synth = {"synthesize": 4, "synth_turns": 3, "max_turns": 2, "sampling": {"max_tokens": 250}}
    taken("generate", synth, **cap)
    assert refused("generate", {**synth, "max_turns": None}, **cap).field == "sampling.max_tokens"  # 4 × 3 × 250
    # a mix: limit prompts at the most turns of any source (max_turns caps synthesized ones too): 10 × 2 × 100
    mix = {"mix": [{"prompts": "synth"}, {"prompts": "bundled:sharegpt"}], "limit": 10, "max_turns": 2,
           "synth_turns": 3, "sampling": {"max_tokens": 100}}
    taken("generate", mix, **cap)
    assert refused("generate", {**mix, "sampling": {"max_tokens": 101}}, **cap).field == "sampling.max_tokens"
    assert refused("generate", {**mix, "max_turns": None}, **cap).field == "max_turns"  # it has a prompt file
    taken("generate", {**mix, "mix": [{"prompts": "synth"}], "max_turns": None, "sampling": {"max_tokens": 66}},
          **cap)  # synthesized only: 10 × 3 × 66 = 1980
    # a single answer over the cap is named by itself
    assert refused("generate", {**file, "sampling": {"max_tokens": 2001}}, **cap).message == \
        "exceeds the operator's cap EYAS_MAX_JOB_TOKENS=2000"
    # evaluate: (20 + 5 prompts) × 128 new tokens = 3200
    e = refused("evaluate", {"drafter": "s3://eyas/drafters/x"}, max_job_tokens=3000)
    assert e.field == "max_new_tokens" and "25 prompts × max_new_tokens 128 = 3200 tokens" in e.message
    taken("evaluate", {"drafter": "s3://eyas/drafters/x", "max_new_tokens": 120}, max_job_tokens=3000)


def test_epochs_and_steps_caps():
    features = {"features": "s3://eyas/features/x"}
    e = refused("train", {**features, "epochs": 4}, max_job_epochs=3)
    assert (e.field, e.value) == ("epochs", 4) and e.message == "exceeds the operator's cap EYAS_MAX_JOB_EPOCHS=3"
    assert "EYAS_MAX_JOB_EPOCHS=2.5" in refused("train", {**features, "epochs": 3}, max_job_epochs=2.5).message
    taken("train", {**features, "epochs": 2.5}, max_job_epochs=2.5)
    e = refused("train", {**features, "steps": 501}, max_job_steps=500)
    assert (e.field, e.value) == ("steps", 501) and "EYAS_MAX_JOB_STEPS=500" in e.message
    taken("train", {**features, "steps": 500}, max_job_steps=500)
    taken("train", features, max_job_steps=500)  # no steps: it runs its epochs (EYAS_MAX_JOB_EPOCHS caps those)
    # a recomputing extraction extracts every epoch again
    stream = {"data": "s3://eyas/datasets/x", "stream": {"policy": "recompute", "epochs": 4}}
    e = refused("extract", stream, max_job_epochs=3)
    assert (e.field, e.value) == ("stream.epochs", 4)
    taken("extract", {"data": "s3://eyas/datasets/x"}, max_job_epochs=3)


def test_then_entries_are_held_to_the_caps_too(tmp_path: Path):
    settings = ServiceSettings(workdir=tmp_path / "w", max_job_epochs=3, max_job_prompts=10)
    data = {"data": "s3://eyas/datasets/x"}
    with pytest.raises(SpecError) as e:
        validate_spec("extract", {**data, "then": [{"stage": "train", "epochs": 5}]}, settings)
    assert (e.value.field, e.value.value) == ("then[0].epochs", 5)
    assert "EYAS_MAX_JOB_EPOCHS=3" in e.value.message
    # a bare name runs its stage's defaults, which are held to the caps as well: evaluate's 20 + 5 prompts
    with pytest.raises(SpecError) as e:
        validate_spec("extract", {**data, "then": ["train", "evaluate"]}, settings)
    assert e.value.field == "then[1].num_prompts" and "EYAS_MAX_JOB_PROMPTS=10" in e.value.message
    spec = validate_spec("extract", {**data, "then": ["train", {"stage": "evaluate", "num_prompts": 5,
                                                                "second_num_prompts": 5}]}, settings)
    assert spec.then[1]["num_prompts"] == 5
    # the job itself first, in service mode without an endpoint
    with pytest.raises(SpecError) as e:
        validate_spec("generate", {"prompts": "bundled:sharegpt", "limit": 5},
                      settings.model_copy(update={"mode": "service"}))
    assert e.value.field == "endpoint"


def test_the_api_refuses_a_job_over_a_cap_with_a_422_naming_it(tmp_path: Path):
    settings = ServiceSettings(mode="embedded", workdir=tmp_path / "work", max_job_epochs=3, max_job_prompts=10)
    with TestClient(create_app("train", settings)) as client:
        r = client.post("/v1/jobs", json={"features": "s3://eyas/features/x", "epochs": 5})
        assert r.status_code == 422, r.text
        assert r.json()["detail"] == [{"field": "epochs", "value": 5,
                                       "message": "exceeds the operator's cap EYAS_MAX_JOB_EPOCHS=3"}]
        r = client.post("/v1/jobs", json={"features": "s3://eyas/features/x",
                                          "then": [{"stage": "evaluate", "num_prompts": 11}]})
        assert r.status_code == 422 and r.json()["detail"][0]["field"] == "then[0].num_prompts"
        assert client.get("/v1/jobs").json() == []  # nothing was written for them
        # the schema states the caps a field keeps to by itself
        components = client.get("/openapi.json").json()["components"]["schemas"]
        assert components["Spec"]["properties"]["epochs"]["maximum"] == 3
        assert components["EvaluateStep"]["properties"]["num_prompts"]["maximum"] == 10
    off = ServiceSettings(mode="embedded", workdir=tmp_path / "work2", allow_in_process_generation=False)
    with TestClient(create_app("generate", off)) as client:
        r = client.post("/v1/jobs", json={"prompts": "bundled:sharegpt"})
        assert r.status_code == 422 and r.json()["detail"][0]["field"] == "endpoint"
        spec = client.get("/openapi.json").json()["components"]["schemas"]["Spec"]
        assert "endpoint" in spec["required"] and spec["properties"]["endpoint"]["type"] == "string"


# --- the wall-time cap, on a fake train stage (put in the registry as tests/test_handoff_orchestration.py does)

WAIT_S = 10.0  # a fake stage gives up after this long, so a cap that never stops it fails the test, not hangs it


class FakeSpec(StageSpec):
    data: str = ""
    how: str = "progress"  # progress: report in a loop; check: only look at ctx.check(); cancel: cancel itself


@pytest.fixture
def runner(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> Iterator[EmbeddedRunner]:
    runner = EmbeddedRunner(ServiceSettings(workdir=tmp_path / "w", max_job_minutes=0.005))  # 0.3 s

    def run(spec: FakeSpec, ctx: StageContext) -> StageResult:
        t0 = time.monotonic()
        if spec.how == "cancel":
            request_cancel(runner.jobs, ctx.job_id)
        while time.monotonic() - t0 < WAIT_S:
            ctx.metrics["steps"] = ctx.metrics.get("steps", 0) + 1
            if spec.how == "check":
                ctx.check()  # no progress report: the cap reaches the stage through ctx.stop alone
            else:
                ctx.progress(1, 10**9, "steps", force=True)
            time.sleep(0.01)
        raise TimeoutError("the wall-time cap did not stop the stage")

    mod = types.ModuleType("fake_capped_train")
    mod.Spec, mod.INPUT_FIELD, mod.run = FakeSpec, "data", run
    monkeypatch.setitem(sys.modules, mod.__name__, mod)
    monkeypatch.setitem(registry._MODULES, "train", mod.__name__)
    registry.step_model.cache_clear()
    yield runner
    registry.step_model.cache_clear()


@pytest.mark.parametrize("how", ["progress", "check"])
def test_a_run_past_the_wall_time_cap_fails_saying_so(runner: EmbeddedRunner, how: str):
    t0 = time.monotonic()
    [job] = runner.run_job("train", {"how": how})
    assert time.monotonic() - t0 < 5
    assert job.state == "failed" and not job.cancel_requested
    assert job.error == "stopped at the operator's wall-time cap EYAS_MAX_JOB_MINUTES=0.005 (minutes of one run)"
    assert job.metrics["steps"] > 0  # what it did is kept


def test_a_cancel_under_the_cap_is_still_a_cancel(runner: EmbeddedRunner):
    [job] = runner.run_job("train", {"how": "cancel"})
    assert job.state == "cancelled" and job.error == f"job {job.id} was cancelled"
