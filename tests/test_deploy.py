"""docker-compose.yml is complete and consistent (no Docker engine runs here, so it is validated as data)."""
from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from eyas.stages import STAGE_ORDER

REPO = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def compose() -> dict:
    return yaml.safe_load((REPO / "docker-compose.yml").read_text())


def _gpu(svc: dict) -> bool:
    devices = svc.get("deploy", {}).get("resources", {}).get("reservations", {}).get("devices", [])
    return any("gpu" in d.get("capabilities", []) for d in devices)


def test_every_stage_has_an_api_and_a_worker_on_its_queue(compose):
    services = compose["services"]
    names = {"generate": "generator", "extract": "extractor", "train": "trainer", "evaluate": "evaluator"}
    for stage in STAGE_ORDER:
        api, worker = services[f"{names[stage]}-api"], services[f"{names[stage]}-worker"]
        assert api["command"][:3] == ["api", "--stage", stage]
        assert worker["command"][:3] == ["worker", "--stage", stage]
        for svc in (api, worker):
            env = svc["environment"]
            assert env["EYAS_MODE"] == "service"
            assert env["EYAS_REDIS_URL"].startswith("redis://redis:")
            assert env["EYAS_S3_ENDPOINT"].startswith("minio:")
            assert 30 <= int(env["EYAS_VISIBILITY_TIMEOUT_S"]) <= 600  # a dead worker's task returns in minutes
            assert "healthcheck" in svc and svc.get("restart") == "unless-stopped"
            assert any(v.startswith("eyas-work:") for v in svc["volumes"])
        assert "container_name" not in worker  # scalable with --scale


def test_gpu_workers_reserve_gpus_and_are_placed_on_gpu_nodes(compose):
    services = compose["services"]
    for name in ("extractor-worker", "trainer-worker", "evaluator-worker", "vllm"):
        assert _gpu(services[name]), name
        assert "node.labels.eyas.gpu == true" in services[name]["deploy"]["placement"]["constraints"]
    assert not _gpu(services["generator-worker"]) and not _gpu(services["generator-api"])
    assert int(services["generator-worker"]["environment"]["EYAS_WORKER_MAX_IN_FLIGHT"]) >= 1


def test_infrastructure(compose):
    services = compose["services"]
    assert {"redis", "minio", "minio-init", "vllm", "flower"} <= set(services)
    assert "mb --ignore-existing local/eyas" in services["minio-init"]["command"][0]
    for name in ("redis", "minio", "vllm"):
        assert "healthcheck" in services[name]
    assert services["generator-worker"]["depends_on"]["minio-init"]["condition"] == "service_completed_successfully"
    assert {"redis-data", "minio-data", "eyas-work"} <= set(compose["volumes"])
    for dockerfile in ("deploy/Dockerfile", "deploy/Dockerfile.cuda"):
        text = (REPO / dockerfile).read_text()
        assert "torch==2.13.0" in text and 'ENTRYPOINT ["eyas"]' in text and "USER eyas" in text
