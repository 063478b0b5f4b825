#!/usr/bin/env bash
# Installs the lean CPU SGLang into the given Python environment (default: the project venv).
#   bash rollout/engines/install_sglang_cpu.sh [.venv/bin/python]
# --no-deps: sglang's own metadata pins CUDA torch 2.14 and GPU-only kernels; this list is what the CPU path needs.
set -euo pipefail
PY=${1:-.venv/bin/python}
HERE=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
"$PY" -m pip install -q --no-deps -r "$HERE/sglang-cpu-requirements.txt"
"$PY" -c "import sglang, sglang_router; print('sglang', sglang.__version__, 'ready (CPU, lean)')"
