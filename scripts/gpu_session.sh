#!/usr/bin/env bash
# What a lent GPU runs, in one call of at most 560 s (typically about 5 minutes), writing at most 8
# files into OUT (what the device tool brings back), each step under its own timeout so that a hang
# costs only its step:
#
#   LABKIT_GIT_COMMIT=<sha, written out from your checkout> bash scripts/gpu_session.sh "$OUT"
#
#   1. pytest: the model's, the CUDA graphs' and the GPU breakdown's GPU tests (<= 90 s), then every kernel test compiled
#      on the GPU, the new kernels first (<= 150 s): what Triton's interpreter cannot check here
#      (bf16, in-kernel fp8 casts, the CUDA graphs); both into one log
#   2. scripts/gpu_tune.py --parts step,attention,prefill: the 8B's decode step fused and unfused,
#      its profile by kernel, decode attention's tiles with and without SCALE_V, and its prefill at
#      512 and 2,048 tokens eager and replayed, with the host's profile of the eager one  <= 160 s
#      (stopped by its timeout, the tuner still writes what it measured)
#   3. python -m labkit.gpu_check --only correctness,kernels,decode_sweep,prefill_sweep: every kernel
#      against torch at real sizes, the kernels' timings, the 8B's decode sweep, then its prefill
#      sweep from 512 tokens up (the short prompts replayed as a CUDA graph) as the budget allows  <= 160 s
#
# The machine's copy of the repository carries a stale .git, so the commit is given, never asked of
# git there (data/recordings/logs/README.md). Needs torch, triton and numpy; pytest if it is there.
# DRY=1: steps 2 and 3 as their dry runs (toy sizes, Triton's interpreter) and no pytest, to check
# the script itself on a machine without a GPU.
set -u
out=${1:?usage: LABKIT_GIT_COMMIT=<sha> bash scripts/gpu_session.sh OUT}
: "${LABKIT_GIT_COMMIT:?set LABKIT_GIT_COMMIT to the commit, written out from your checkout}"
export LABKIT_GIT_COMMIT PYTHONUNBUFFERED=1 LABKIT_CACHE_DIR=${LABKIT_CACHE_DIR:-/tmp/labkit-cache}
py=${PYTHON:-python3}
stamp=$(date -u +%Y%m%d-%H%M)
mkdir -p "$out"
step() {  # step NAME SECONDS COMMAND...: run it under its timeout, its output added to OUT/NAME-STAMP.log
    local name=$1 limit=$2
    shift 2
    echo "[gpu_session] $name (at most $limit s): $*" | tee -a "$out/$name-$stamp.log"
    timeout "$limit" "$@" >> "$out/$name-$stamp.log" 2>&1
    echo "[gpu_session] $name: exit $? ($(tail -n 1 "$out/$name-$stamp.log" | cut -c1-300))"
}
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader 2>/dev/null || echo "[gpu_session] no nvidia-smi"
dry=()
[ "${DRY:-0}" = 1 ] && dry=(--dry-run)
if [ "${DRY:-0}" != 1 ] && "$py" -c "import pytest" 2>/dev/null; then
    # the model's, the graphs' and the breakdown's tests that need a GPU (short, so first; the newest
    # first: 12 of the model's and graphs' took 35 s at 400adbb); then every kernel test,
    # compiled on the GPU (81 of them took 81 s there at 2dacd5b; flash's autotune adds to it)
    step pytest-gpu 90 "$py" -m pytest -q -m gpu -p no:cacheprovider tests/test_graphed_prefill.py \
        tests/test_breakdown.py tests/test_model.py tests/test_graphed_decode.py
    step pytest-gpu 150 "$py" -m pytest -q -p no:cacheprovider tests/test_kernels_add_rms_norm.py \
        tests/test_kernels_rope_store.py tests/test_kernels_swiglu.py tests/test_kernels_decode_attention.py \
        tests/test_kernels_kv_quant.py \
        tests/test_kernels_matmul.py tests/test_kernels_flash_attention.py
else
    echo "[gpu_session] pytest-gpu: skipped (DRY=1, or no pytest here)"
fi
step gpu-tune 160 "$py" scripts/gpu_tune.py --out "$out" --budget-s 135 --parts step,attention,prefill "${dry[@]}"
step gpu-check 160 "$py" -m labkit.gpu_check --out "$out" --only correctness,kernels,decode_sweep,prefill_sweep --budget-s 135 "${dry[@]}"
