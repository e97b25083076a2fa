"""Bad-input sweep: schemathesis (`st run --checks all`) generates requests from each service's own OpenAPI schema
— its boundary values (coverage), random valid and invalid bodies, paths and query strings (fuzzing), and
submit → read → cancel sequences (stateful) — against the four APIs served by uvicorn in service mode (real Redis
and SeaweedFS; no worker, so accepted jobs stay queued; no API key here — tests/test_api.py covers keys on all four).

Every check passes: no 5xx; a schema-violating request gets a 4xx and a schema-valid one is accepted, so the schema
states every rule submit applies (one of prompts/synthesize/mix, `then`'s stages in order, the pattern of every
field that names a file, object or URL — eyas.confine); every answer has the status, content type, headers and body
the schema documents; an undocumented method gets 405 and OPTIONS the path's methods, in Allow.
"""
from __future__ import annotations

import dataclasses
import json
import subprocess
import sys
from collections import Counter
from pathlib import Path

from orchestration.registry import STAGE_ORDER

EXAMPLES = 30  # per operation, phase and mode; ~800-1,300 requests per API, ~10-25 s each
SCHEMATHESIS = Path(sys.executable).parent / "schemathesis"


def _statuses(report: Path) -> Counter:
    statuses: Counter = Counter()
    for line in report.read_text().splitlines():
        event = json.loads(line).get("ScenarioFinished")
        for interaction in (event or {}).get("recorder", {}).get("interactions", {}).values():
            if interaction.get("response"):
                statuses[interaction["response"]["status_code"]] += 1
    return statuses


def test_no_failures_of_any_check_on_the_four_apis(service_settings, api_process, tmp_path):
    # no input roots: the service default (inputs come from the bucket), so the schema's patterns are exact
    service = dataclasses.replace(service_settings, env={**service_settings.env, "EYAS_INPUT_ROOTS": ""})
    apis = {stage: api_process(stage, service) for stage in STAGE_ORDER}
    # the four sweeps side by side: each is a client and a server taking turns, so two cores run them ~2x as fast
    sweeps = {}
    for stage, api in apis.items():
        (tmp_path / stage).mkdir()  # its own working directory (schemathesis keeps its example database there)
        sweeps[stage] = subprocess.Popen(
            [str(SCHEMATHESIS), "run", f"{api.url}/openapi.json", "--checks", "all",
             "--phases", "examples,coverage,fuzzing,stateful", "--max-examples", str(EXAMPLES), "--seed", "1",
             "--continue-on-failure", "--no-color", "--report", "ndjson", "--report-ndjson-path",
             str(tmp_path / f"{stage}.ndjson")],
            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=tmp_path / stage)
    try:
        for stage, sweep in sweeps.items():
            stdout, stderr = sweep.communicate(timeout=600)
            statuses = _statuses(tmp_path / f"{stage}.ndjson")
            print(f"\n{stage}: {sum(statuses.values())} requests, by status {dict(sorted(statuses.items()))}")
            assert sweep.returncode == 0, stdout[-8000:] + stderr[-2000:]
            assert sum(statuses.values()) >= 300 and max(statuses) < 500
            assert statuses[202] > 0 and statuses[422] > 0  # schema-valid jobs were taken, invalid ones refused
    finally:
        for sweep in sweeps.values():  # a sweep still running when another failed
            if sweep.poll() is None:
                sweep.kill()
                sweep.wait()
