"""The compose stack, up on this machine and proven through its APIs (`make deploy-test`; deploy/README.md).

Run by deploy/test.sh once the images are built: it starts docker-compose.yml with the CPU override
(deploy/compose.cpu.yml) and checks, through the APIs with the API key, what a user and an operator rely on:
the pipeline end to end on the compose file's vLLM-CPU, generator workers scaled to 3 sharing one job, a worker
killed mid-job, `down`/`up` with the volumes kept, Redis restarted and S3 down under running jobs, and a worker
killed for memory. Every check prints its wall time; the stack is taken down at the end (volumes too with --clean).
"""
from __future__ import annotations

import argparse
import json
import os
import secrets
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import httpx
from minio import Minio

REPO = Path(__file__).resolve().parents[1]
STACK = REPO / "deploy" / ".stack"  # the env file and the logs of this run (ignored by git)
PROJECT = os.environ.get("EYAS_DEPLOY_PROJECT", "eyas-deploy-test")  # compose's project name
APIS = {"generate": 18001, "extract": 18002, "train": 18003, "evaluate": 18004, "diagnose": 18005}
S3 = "127.0.0.1:19000"
TARGET = "/models/smollm2-135m-instruct"  # the bundled target, converted into ./models by deploy/test.sh
ENDPOINT = "http://vllm:18000"  # the compose file's vLLM service as every container sees it
CUDA_REPORT = STACK / "cuda-resolve.json"
MANY = 160  # the scale check's job: a worker is killed after 40, so the other two share the rest

RESULTS: list[tuple[str, float, str]] = []
ONLY: list[str] = []  # --only: the checks to run (all when empty)


def compose(*args: str, check: bool = True, capture: bool = True, extra_files: tuple[str, ...] = ()) -> str:
    """`docker compose` on the stack; its output is returned (and shown when it fails), not printed."""
    files = ["-f", "docker-compose.yml", "-f", "deploy/compose.cpu.yml"]
    for f in extra_files:
        files += ["-f", f]
    cmd = ["docker", "compose", "-p", PROJECT, *files, "--env-file", str(STACK / "env"), *args]
    done = subprocess.run(cmd, cwd=REPO, check=False, text=True,
                          stdout=subprocess.PIPE if capture else None, stderr=subprocess.STDOUT if capture else None)
    if check and done.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)} exited {done.returncode}\n{(done.stdout or '')[-3000:]}")
    return done.stdout or ""


def step(name: str) -> Callable[[Callable[[], str]], Callable[[], str]]:
    """Run the check now, timing it; a failure stops the run with the stack's logs saved."""
    def run(check: Callable[[], str]) -> Callable[[], str]:
        if ONLY and not any(name.startswith(word) for word in ONLY):
            return check
        print(f"--- {name}", flush=True)
        t0 = time.monotonic()
        try:
            what = check()
        except Exception:
            save_logs()
            RESULTS.append((name, time.monotonic() - t0, "FAILED"))
            summary()
            raise
        RESULTS.append((name, time.monotonic() - t0, what))
        print(f"    ok ({time.monotonic() - t0:.0f} s): {what}", flush=True)
        return check
    return run


def save_logs() -> None:
    log = STACK / "compose.log"
    log.write_text(compose("logs", "--no-color", "--timestamps", check=False, capture=True))
    print(f"the stack's logs: {log}", file=sys.stderr)


def summary() -> None:
    print("\ndeploy checks:")
    for name, seconds, what in RESULTS:
        print(f"  {seconds:6.0f} s  {name}: {what}")
    failed = sum(what == "FAILED" for _, _, what in RESULTS)
    print(f"deploy: {len(RESULTS) - failed} checks passed, {failed} failed")


class Api:
    def __init__(self, stage: str, key: str):
        self.stage = stage
        self.client = httpx.Client(base_url=f"http://127.0.0.1:{APIS[stage]}", timeout=30,
                                   headers={"Authorization": f"Bearer {key}"})

    def submit(self, spec: dict) -> str:
        r = self.client.post("/v1/jobs", json=spec)
        assert r.status_code == 202, (self.stage, r.status_code, r.text)
        return r.json()["id"]

    def job(self, job_id: str) -> dict:
        for _ in range(60):  # an API restarting with the stack answers again within seconds
            try:
                r = self.client.get(f"/v1/jobs/{job_id}")
                r.raise_for_status()
                return r.json()
            except httpx.TransportError:
                time.sleep(1)
        raise TimeoutError(f"{self.stage} API does not answer")

    def wait(self, job_id: str, timeout: float = 900, until: Callable[[dict], bool] | None = None) -> dict:
        until = until or (lambda j: j["state"] not in ("queued", "running"))
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            job = self.job(job_id)
            if until(job):
                return job
            time.sleep(2)
        raise TimeoutError(f"{self.stage} job {job_id} still {job['state']} after {timeout:.0f} s: {job}")


def containers(service: str) -> list[str]:
    return compose("ps", "-q", service, capture=True).split()


def start_cuda_resolve() -> subprocess.Popen:
    """The gpu check's resolution of the CUDA image's wheels, started first: it talks to PyPI for ~100 s, so it runs
    beside the stack's checks and is read last. Without this machine's pip settings (find-links and constraints that
    pick the local CPU wheel), but with its CA bundle."""
    CUDA_REPORT.unlink(missing_ok=True)
    env = {k: v for k, v in os.environ.items() if not k.startswith("PIP_") or k == "PIP_CERT"}
    env["PIP_CONFIG_FILE"] = os.devnull
    return subprocess.Popen(["python3.11", "-m", "pip", "install", "--dry-run", "--ignore-installed", "--quiet",
                             "--report", str(CUDA_REPORT), "torch==2.13.0", "vllm==0.32.0"],
                            env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--clean", action="store_true", help="also remove the stack's volumes at the end")
    parser.add_argument("--keep", action="store_true", help="leave the stack running at the end (to look at it)")
    parser.add_argument("--reuse", action="store_true",
                        help="check the stack a --keep run left running (its deploy/.stack/env), not a fresh one")
    parser.add_argument("--only", nargs="*", default=None, metavar="WORD",
                        help="run only the checks whose name starts with one of these words (config, up, pipeline, …)")
    args = parser.parse_args()
    STACK.mkdir(parents=True, exist_ok=True)
    if not args.reuse:
        key, user, secret = secrets.token_urlsafe(24), "eyas-" + secrets.token_hex(4), secrets.token_urlsafe(24)
        (STACK / "env").write_text(f"EYAS_API_KEY={key}\nMINIO_ROOT_USER={user}\nMINIO_ROOT_PASSWORD={secret}\n"
                                   f"FLOWER_BASIC_AUTH=eyas:{secrets.token_urlsafe(12)}\n")
        os.chmod(STACK / "env", 0o600)
    env = dict(line.split("=", 1) for line in (STACK / "env").read_text().splitlines() if "=" in line)
    key, s3_user, s3_secret = env["EYAS_API_KEY"], env["MINIO_ROOT_USER"], env["MINIO_ROOT_PASSWORD"]
    ONLY.extend(args.only or [])
    apis = {stage: Api(stage, key) for stage in APIS}
    s3 = Minio(S3, access_key=s3_user, secret_key=s3_secret, secure=False)
    if not args.reuse:  # a fresh stack, whatever came before
        compose("down", "--volumes", "--remove-orphans", check=False, capture=True)
    cuda_resolve = start_cuda_resolve()
    try:
        run_checks(apis, s3, key, s3_secret, cuda_resolve)
    finally:
        cuda_resolve.kill()
        if not args.keep:
            save_logs()
            compose("down", "--remove-orphans", *(["--volumes"] if args.clean else []), check=False, capture=True)
    summary()
    return 0


def run_checks(apis: dict[str, Api], s3: Minio, key: str, s3_secret: str,
               cuda_resolve: subprocess.Popen) -> None:
    state: dict = {}

    def chain() -> list[dict]:  # the pipeline's four jobs (from the API when --only skipped the pipeline check)
        if "chain" not in state:
            stages = ("generate", "extract", "train", "evaluate")
            listed = {stage: apis[stage].client.get("/v1/jobs", params={"state": "succeeded"}).json()
                      for stage in stages}
            state["chain"] = [next(j for j in listed[stage] if j["stage"] == stage) for stage in stages]
        return state["chain"]

    @step("config: the default file with every profile, and the CPU override, are valid")
    def _() -> str:
        for profile in ("capture", "multinode", "spec", "flower"):
            compose("--profile", profile, "config", "-q")
        subprocess.run(["docker", "compose", "-f", "docker-compose.yml", "--env-file", str(STACK / "env"),
                        "--profile", "capture", "--profile", "multinode", "config", "-q"], cwd=REPO, check=True)
        return "docker-compose.yml (profiles capture, multinode) and + deploy/compose.cpu.yml"

    @step("up: every service healthy")
    def _() -> str:
        compose("up", "-d", "--no-build", "--wait", "--wait-timeout", "600")
        ps = [json.loads(line) for line in compose("ps", "--format", "json", capture=True).splitlines() if line]
        running = sorted(p["Service"] for p in ps)
        unhealthy = [p["Service"] for p in ps if p.get("Health") not in ("healthy", "")]
        assert not unhealthy, unhealthy
        return f"{len(running)} services: {', '.join(running)}"

    @step("security: the APIs want the key; the images run as non-root users")
    def _() -> str:
        r = httpx.get(f"http://127.0.0.1:{APIS['generate']}/v1/jobs", timeout=10)
        assert r.status_code == 401, r.status_code
        users = {svc: compose("exec", "-T", svc, "id", "-un", capture=True).strip()
                 for svc in ("generator-api", "trainer-worker", "vllm")}
        assert "root" not in users.values(), users
        # no secret in any image's layers, no compiler and no pip cache in them
        secretish = ("KEY=", "SECRET", "PASSWORD", "TOKEN=")
        for image in ("eyas:cpu", "eyas-vllm:cpu"):
            history = subprocess.run(["docker", "history", "--no-trunc", "--format", "{{.CreatedBy}}", image],
                                     capture_output=True, text=True, check=True).stdout
            assert not any(word in history.upper() for word in secretish), (image, history)
            found = subprocess.run(["docker", "run", "--rm", "--network", "none", "--entrypoint", "sh", image, "-c",
                                    "command -v gcc cc g++; ls -d ~/.cache/pip /root/.cache/pip 2>/dev/null; true"],
                                   capture_output=True, text=True, check=True).stdout.split()
            assert not found, (image, found)
        return f"401 without the key; users {users}; no secret in the images' history, no compiler or pip cache"

    s3.put_object("eyas", "inputs/prompts.jsonl", *_prompts(24))
    s3.put_object("eyas", "inputs/many.jsonl", *_prompts(MANY))

    @step("pipeline: generate → extract → train → evaluate through the APIs, on the compose file's vLLM")
    def _() -> str:
        spec = {"prompts": "s3://eyas/inputs/prompts.jsonl", "endpoint": ENDPOINT, "model": "target",
                "target": TARGET, "concurrency": 8, "sampling": {"max_tokens": 64},
                # small on purpose: this proves the wiring between containers, not the drafter's quality
                "then": [{"stage": "extract", "target": TARGET, "batch_tokens": 1024},
                         {"stage": "train", "steps": 12, "ttt_steps": 2, "draft_vocab_size": 512, "batch_tokens": 512,
                          "warmup": 2, "lr": 3e-3, "val_every": 6},
                         {"stage": "evaluate", "target": TARGET, "num_prompts": 2, "max_new_tokens": 24,
                          "second_prompts": None}]}
        job_id, chain = apis["generate"].submit(spec), []
        for stage in ("generate", "extract", "train", "evaluate"):
            job = apis[stage].wait(job_id)
            assert job["state"] == "succeeded", job
            chain.append(job)
            job_id = job.get("next_job")
        state["chain"] = chain
        report_uri, drafter_uri = chain[-1]["artifacts"]["output"], chain[2]["artifacts"]["output"]
        report = json.loads(_get(s3, report_uri, "report.json"))
        exports = [o.object_name for o in s3.list_objects("eyas", prefix=_key(drafter_uri, ""), recursive=True)]
        assert any(n.endswith("eagle/config.json") for n in exports) and any(n.endswith("eagle/model.safetensors")
                                                                               for n in exports), exports
        assert chain[0]["metrics"]["completed"] == 24 and chain[0]["metrics"]["failed"] == 0, chain[0]["metrics"]
        return (f"24 conversations, τ {report['acceptance_length']:.2f} (K {report['k']}); report and eagle/ export "
                f"read from the bucket ({len(exports)} drafter objects)")

    @step("scale: 3 generator workers share one large job; one is killed mid-job")
    def _() -> str:
        compose("up", "-d", "--no-build", "--wait", "--scale", "generator-worker=3", "generator-worker")
        workers = containers("generator-worker")
        assert len(workers) == 3, workers
        spec = {"prompts": "s3://eyas/inputs/many.jsonl", "endpoint": ENDPOINT, "model": "target", "target": TARGET,
                "concurrency": 24, "sampling": {"max_tokens": 24}, "checkpoint_every": 4, "max_workers": 3}
        job_id = apis["generate"].submit(spec)
        apis["generate"].wait(job_id, 600, until=lambda j: j["progress"]["done"] >= 40 or j["state"] != "running")
        busy = [c for c in workers if "] received" in _logs(c)]  # a task of the job (the stack is fresh)
        victim = busy[0] if busy else workers[0]
        subprocess.run(["docker", "kill", victim], check=True, capture_output=True)
        job = apis["generate"].wait(job_id, 900)
        assert job["state"] == "succeeded", job
        assert job["metrics"]["completed"] == MANY and job["metrics"]["failed"] == 0, job["metrics"]
        ids = _dataset_ids(s3, job["artifacts"]["output"])
        assert len(ids) == MANY == len(set(ids)), (len(ids), len(set(ids)))
        worked = [c for c in workers if "] received" in _logs(c)]
        compose("up", "-d", "--no-build", "--wait", "--scale", "generator-worker=1", "generator-worker")
        assert len(worked) >= 2, worked
        return (f"{len(worked)} of 3 workers took a share; killed {victim[:12]} mid-job; {MANY} conversations, "
                f"{MANY} distinct, none failed")

    @step("down/up: records and artifacts survive; a job submitted before the restart finishes after it")
    def _() -> str:
        features = chain()[1]["artifacts"]["output"]
        job_id = apis["train"].submit({"features": features, "steps": 60, "ttt_steps": 2, "draft_vocab_size": 512,
                                       "batch_tokens": 512, "warmup": 2})
        before = apis["train"].wait(job_id, 300, until=lambda j: j["state"] == "running" and j["progress"]["done"] > 0)
        compose("down")
        assert before["progress"]["done"] < 60, before
        compose("up", "-d", "--no-build", "--wait", "--wait-timeout", "600")
        for job in chain():
            again = apis[job["stage"]].job(job["id"])
            assert again["state"] == "succeeded" and again["artifacts"] == job["artifacts"], again
        assert _get(s3, chain()[-1]["artifacts"]["output"], "report.json")
        job = apis["train"].wait(job_id, 900)
        assert job["state"] == "succeeded", job
        return f"4 job records and their artifacts kept; train job {job_id[:8]} finished after the restart " \
               f"(attempts {job.get('attempts')})"

    @step("faults: Redis restarted and S3 down for 10 s under running jobs")
    def _() -> str:
        features = chain()[1]["artifacts"]["output"]
        spec = {"features": features, "steps": 60, "ttt_steps": 2, "draft_vocab_size": 512, "batch_tokens": 512,
                "warmup": 2}
        job_id = apis["train"].submit(spec)
        apis["train"].wait(job_id, 300, until=lambda j: j["state"] == "running")
        compose("restart", "redis")
        time.sleep(5)
        compose("stop", "minio")
        time.sleep(10)
        compose("start", "minio")
        job = apis["train"].wait(job_id, 900)
        assert job["state"] == "succeeded", job
        drafter = job["artifacts"]["output"]
        assert _get(s3, drafter, "manifest.json")
        return f"train job succeeded through both (attempts {job.get('attempts')}), its drafter committed"

    @step("faults: a worker killed for memory (a 1 GiB limit on the trainer)")
    def _() -> str:
        limit = STACK / "oom.yml"
        # two runs, not the default three: each is a kill and a 30-s wait for the task to come back
        limit.write_text("services:\n  trainer-worker:\n    mem_limit: 1g\n    memswap_limit: 1g\n"
                         "    environment:\n      EYAS_MAX_JOB_RUNS: \"2\"\n")
        compose("up", "-d", "--no-build", "--wait", "trainer-worker", extra_files=(str(limit),))
        features = chain()[1]["artifacts"]["output"]
        # a draft vocabulary as large as the target's and long batches: more than 1 GiB in the worker
        spec = {"features": features, "steps": 50, "draft_vocab_size": 49152, "batch_tokens": 16384, "warmup": 3}
        job_id = apis["train"].submit(spec)
        job = apis["train"].wait(job_id, 900)
        inspect = json.loads(subprocess.run(["docker", "inspect", containers("trainer-worker")[0]],
                                            capture_output=True, text=True, check=True).stdout)[0]
        compose("up", "-d", "--no-build", "--wait", "trainer-worker")  # the limit lifted
        assert job["state"] == "failed" and "memory" in (job.get("error") or "").lower(), job
        return f"job failed saying: {job['error'][:160]!r}; container OOMKilled={inspect['State'].get('OOMKilled')}"

    @step("logs: no secret in any container's log")
    def _() -> str:
        logs = compose("logs", "--no-color", capture=True)
        assert key not in logs and s3_secret not in logs
        return f"{len(logs) // 1024} KiB of logs, neither the API key nor the S3 secret in them"

    @step("gpu: the CUDA image's wheels resolve (pip --dry-run from PyPI: nothing downloaded or installed)")
    def _() -> str:
        # PyPI's torch 2.13.0 for Linux is the CUDA build; the image's cu128 variant comes from PyTorch's index
        _, err = cuda_resolve.communicate(timeout=600)
        assert cuda_resolve.returncode == 0, err[-3000:]
        wheels = {i["metadata"]["name"]: i["metadata"]["version"]
                  for i in json.loads(CUDA_REPORT.read_text())["install"]}
        cuda = sorted(n for n in wheels if n.startswith("nvidia-"))
        assert "+cpu" not in wheels["torch"] and cuda, wheels
        return f"torch {wheels['torch']}, vllm {wheels['vllm']} and {len(cuda)} nvidia-* wheels"


def _prompts(n: int) -> tuple:
    import io

    topics = ["a haiku about", "three facts about", "a short story about", "how to explain", "a recipe with",
              "a limerick about", "the history of", "a packing list for"]
    things = ["the sea", "autumn", "a lighthouse", "bread", "rivers", "owls", "trains", "glaciers", "tea", "chess",
              "volcanoes", "bees"]
    lines = [json.dumps({"id": f"p{i}", "messages": [{"role": "user",
                                                      "content": f"Write {topics[i % len(topics)]} "
                                                                 f"{things[(i // 8) % len(things)]}"
                                                                 f" (variant {i})."}]}) for i in range(n)]
    data = ("\n".join(lines) + "\n").encode()
    return io.BytesIO(data), len(data)


def _key(uri: str, name: str) -> str:
    return uri.removeprefix("s3://eyas/").rstrip("/") + "/" + name


def _get(s3: Minio, uri: str, name: str) -> bytes:
    r = s3.get_object("eyas", _key(uri, name))
    try:
        return r.read()
    finally:
        r.close()
        r.release_conn()


def _dataset_ids(s3: Minio, uri: str) -> list[str]:
    ids = []
    for obj in s3.list_objects("eyas", prefix=_key(uri, ""), recursive=True):
        if obj.object_name.rsplit("/", 1)[-1].startswith("conversations-"):
            r = s3.get_object("eyas", obj.object_name)
            ids += [json.loads(line)["id"] for line in r.read().decode().splitlines() if line]
            r.close()
    return ids


def _logs(container: str) -> str:
    done = subprocess.run(["docker", "logs", container], capture_output=True, text=True, check=False)
    return done.stdout + done.stderr


if __name__ == "__main__":
    sys.exit(main())
