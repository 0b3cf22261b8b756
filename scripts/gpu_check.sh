#!/usr/bin/env bash
# GPU check for a CUDA machine: the GPU tests, then the decode benchmark on a random-weight
# model with Llama-3-8B's shape at 32K context against DynamicCache(offloading=True) at equal
# device memory. Budget: under 8 minutes on an H200 (install excluded when .venv is ready).
#
#   scripts/gpu_check.sh            # results in $OUT when set, else ./out
#
# The venv: an existing .venv whose torch sees CUDA is used as is. Otherwise, when the
# system python already has a CUDA torch, .venv is created on top of it
# (--system-site-packages, so that torch is not replaced) and kvtier installed into it.
# Otherwise `make .venv/.kvtier-installed` builds it as the Makefile does (that pip-installs
# TORCH_SPEC; on Linux the PyPI wheel of torch is a CUDA build).
set -euo pipefail

cd "$(dirname "$0")/.."
OUT_DIR="${OUT:-$PWD/out}"
mkdir -p "$OUT_DIR"
PY="${PYTHON:-python3}"
VENV=.venv
LOG="$OUT_DIR/gpu_check.log"
: >"$LOG"

say() { echo "gpu_check: $*" | tee -a "$LOG"; }

cuda_ok() { "$1" -c 'import sys, torch; sys.exit(0 if torch.cuda.is_available() else 1)' 2>/dev/null; }

start=$(date +%s)
if [ -x "$VENV/bin/python" ] && cuda_ok "$VENV/bin/python"; then
    say "using $VENV (torch with CUDA)"
    if ! "$VENV/bin/python" -c 'import kvtier' 2>/dev/null; then
        "$VENV/bin/pip" install -q --disable-pip-version-check -e ".[dev]" | tee -a "$LOG"
    fi
elif cuda_ok "$PY"; then
    say "creating $VENV on the system torch ($("$PY" -c 'import torch; print(torch.__version__)'))"
    "$PY" -m venv --system-site-packages "$VENV"
    "$VENV/bin/pip" install -q --disable-pip-version-check -e ".[dev]" | tee -a "$LOG"
else
    say "no CUDA torch found; building $VENV with make"
    make "$VENV/.kvtier-installed" PYTHON="$PY" | tee -a "$LOG"
fi
if ! cuda_ok "$VENV/bin/python"; then
    say "error: torch in $VENV does not see a CUDA device; install a CUDA build of torch"
    exit 2
fi
"$VENV/bin/python" - <<'EOF' | tee -a "$LOG"
import torch
print(f"torch {torch.__version__}, CUDA {torch.version.cuda}, {torch.cuda.get_device_name(0)}")
EOF
say "set-up took $(($(date +%s) - start)) s"

status=0
start=$(date +%s)
say "pytest -m gpu"
if ! timeout 180 "$VENV/bin/pytest" -m gpu -q 2>&1 | tee -a "$LOG" "$OUT_DIR/pytest_gpu.log"; then
    say "error: GPU tests failed (see $OUT_DIR/pytest_gpu.log)"
    status=1
fi
say "pytest took $(($(date +%s) - start)) s"

# The decode benchmark: one round (repeats 1) to stay within the time budget.
start=$(date +%s)
say "decode benchmark, random llama3-8b shape, bf16, 32K context"
if ! timeout 360 "$VENV/bin/kvtier" bench decode \
    --random-shape llama3-8b --dtype bfloat16 --context 32768 --new-tokens 8 --repeats 1 \
    --device cuda --json "$OUT_DIR/decode_gpu_llama3-8b_32k.json" 2>&1 \
    | tee -a "$LOG" "$OUT_DIR/decode_gpu.log"; then
    say "error: decode benchmark failed or timed out (see $OUT_DIR/decode_gpu.log)"
    status=1
fi
say "decode benchmark took $(($(date +%s) - start)) s"
exit "$status"
