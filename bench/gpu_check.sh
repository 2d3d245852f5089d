#!/usr/bin/env bash
# The one-GPU device check (docs/usage.md, "GPUs"): from a clean checkout, on a machine with an
# NVIDIA GPU and a CUDA build of PyTorch, it proves nonstop's NCCL and CUDA paths in one run of a
# few minutes (`nonstop bench gpu`: a crash, a frozen peer, a device-side assert and out of memory,
# each bitwise against a fault-free run; GPU snapshot and restore bandwidth) and prints one JSON
# line last. The machine's torch is used as it is; nonstop's other needs are installed beside it.
#
#   bash bench/gpu_check.sh                 # needs from PyPI
#   WHEELS=dir bash bench/gpu_check.sh      # offline: needs from a folder of wheels
#   bash bench/gpu_check.sh --cases crash,state --out runs/   # `nonstop bench gpu` flags
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PY:-python3}
if ! "$PY" -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)" 2>/dev/null; then
    echo "gpu_check: $PY has no PyTorch that sees a CUDA GPU" >&2
    exit 2
fi
SITE=$(mktemp -d)
trap 'rm -rf "$SITE"' EXIT
if [ -n "${WHEELS:-}" ]; then
    "$PY" -m pip install -q --no-index --no-deps --no-compile --target "$SITE" "$WHEELS"/*.whl
else
    # only what is missing, and never torch: a plain `pip install nonstop` could replace the
    # machine's CUDA build of torch
    missing=()
    for pair in pydantic:pydantic yaml:pyyaml rich:rich xxhash:xxhash orjson:orjson; do
        "$PY" -c "import ${pair%%:*}" 2>/dev/null || missing+=("${pair##*:}")
    done
    if [ ${#missing[@]} -gt 0 ]; then
        "$PY" -m pip install -q --target "$SITE" "${missing[@]}"
    fi
fi
export PYTHONPATH="$SITE:$PWD/src${PYTHONPATH:+:$PYTHONPATH}"
export PYTHONUNBUFFERED=1
exec "$PY" -m nonstop bench gpu "$@"
