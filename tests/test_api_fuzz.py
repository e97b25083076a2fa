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
    for stage, api in apis.items():
        report = tmp_path / f"{stage}.ndjson"
        run = subprocess.run(
            [str(SCHEMATHESIS), "run", f"{api.url}/openapi.json", "--checks", "all",
             "--phases", "examples,coverage,fuzzing,stateful", "--max-examples", str(EXAMPLES), "--seed", "1",
             "--continue-on-failure", "--no-color", "--report", "ndjson", "--report-ndjson-path", str(report)],
            capture_output=True, text=True, timeout=600, cwd=tmp_path)
        statuses = _statuses(report)
        print(f"\n{stage}: {sum(statuses.values())} requests, by status {dict(sorted(statuses.items()))}")
        assert run.returncode == 0, run.stdout[-8000:] + run.stderr[-2000:]
        assert sum(statuses.values()) >= 300 and max(statuses) < 500
        assert statuses[202] > 0 and statuses[422] > 0  # schema-valid jobs were taken, invalid ones refused
