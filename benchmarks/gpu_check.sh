#!/usr/bin/env bash
# One command on a machine with one NVIDIA GPU (<= 8 minutes on an H200): a fresh venv with the CUDA jax wheel and
# this project installed from its own pyproject.toml (extra `gpu`), the GPU kernel tests, then the check itself
# (benchmarks/gpu_check.py), whose last line is one JSON object. Run from anywhere:
#
#   bash benchmarks/gpu_check.sh                      # PyPI reachable
#   WHEELHOUSE=/data/wheels bash benchmarks/gpu_check.sh   # offline: a directory of wheels (pip download -d ...)
#   GPU_CHECK_VENV=/tmp/v bash benchmarks/gpu_check.sh --pretrain_workdir runs/p   # trained MTP heads
#
# Extra arguments go to gpu_check.py. Progress goes to stderr; stdout ends with the JSON line.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
VENV="${GPU_CHECK_VENV:-${TMPDIR:-/tmp}/composer_jax_gpu_check_venv}"
PYTHON="${PYTHON:-python3}"
PIP_ARGS=(-q)
if [[ -n "${WHEELHOUSE:-}" ]]; then PIP_ARGS+=(--no-index --find-links "$WHEELHOUSE"); fi

start=$(date +%s)
echo "[gpu_check] venv $VENV" >&2
rm -rf "$VENV"
"$PYTHON" -m venv "$VENV"
"$VENV/bin/pip" install "${PIP_ARGS[@]}" --upgrade pip >&2
"$VENV/bin/pip" install "${PIP_ARGS[@]}" -e "$ROOT[gpu]" >&2
echo "[gpu_check] installed in $(( $(date +%s) - start )) s" >&2
"$VENV/bin/python" -c 'import jax; assert jax.default_backend() == "gpu", jax.devices(); print(jax.devices())' >&2

cd "$ROOT"
# The Pallas kernels compiled for the GPU and checked against their references (tests marked gpu).
"$VENV/bin/python" -m pytest -q -m gpu tests/test_kernels_grouped_matmul.py >&2
"$VENV/bin/python" benchmarks/gpu_check.py "$@"
# The scale plan's Kimi K2 pretraining step compiled by the GPU compiler for 64 and 256 GPUs on a mocked topology
# (one real GPU; memory_analysis and collectives beside the CPU plan's). Progress and table on stderr.
PYTHONPATH=. "$VENV/bin/python" benchmarks/scale_plan.py --platform gpu --stages pretrain_32k --devices 64,256 \
    --out "${TMPDIR:-/tmp}/scale_plan_gpu.json" >&2 || echo "[gpu_check] scale plan GPU compile failed" >&2
echo "[gpu_check] total $(( $(date +%s) - start )) s" >&2
