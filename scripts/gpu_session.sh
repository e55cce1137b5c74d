#!/usr/bin/env bash
# What a lent GPU runs, in one call: at most 530 s of steps, 580 s with each step's grace after its
# timeout and the start-ups (under the device tool's 600 s a call; about 9 minutes when every step
# uses its budget, so a 15-minute loan with a start of minutes leaves no room for a second call:
# run it once, with time to spare), writing its logs and recordings into OUT (what the device tool
# brings back), each step under its own timeout so that a hang costs only its step:
#
#   LABKIT_GIT_COMMIT=<sha, written out from your checkout> bash scripts/gpu_session.sh "$OUT"
#
#   0. session-STAMP.log: nvidia-smi's GPU, driver and memory, torch's and triton's versions, and
#      each step's exit line; the run stops here, in one line, where torch sees no CUDA GPU
#   1. pytest: the model's, the CUDA graphs' and the GPU breakdown's GPU tests (<= 80 s), then every
#      kernel test compiled on the GPU, the new kernels first, each test named as it ends (<= 120 s):
#      what Triton's interpreter cannot check here (bf16, in-kernel fp8 casts, the CUDA graphs)
#   2. python -m labkit.gpu_check --only calibration,correctness,kernels: the roof every figure is
#      judged by (its recording comes back), every kernel against torch at real sizes, the kernels'
#      timings  <= 130 s
#   3. python -m labkit.gpu_check --only prefill_sweep,decode_sweep: the 8B's prefill sweep from 512
#      tokens up (the short prompts replayed as a CUDA graph), then its decode sweep, as the budget
#      allows  <= 110 s. Apart from step 2, so the kernels' timings cannot take the sweeps' time
#   4. scripts/gpu_tune.py --parts step,attention,prefill: the 8B's decode step fused and unfused,
#      its profile by kernel, decode attention's tiles with and without SCALE_V, and its prefill at
#      512 and 2,048 tokens eager and replayed, with the host's profile of the eager one  <= 90 s
#      (stopped by its timeout, the tuner still writes what it measured). Last: the lessons read
#      the check's recordings, the tuner's only cite it
#
# A step past its timeout gets SIGTERM, then SIGKILL 5 s later (a process stuck in CUDA ignores the
# first); the tuner 15 s later, as it frees its models and writes its recording after a SIGTERM. The machine's copy of the repository carries a stale .git, so the commit is given, never
# asked of git there (data/recordings/logs/README.md). Needs torch, triton and numpy; pytest if it
# is there. DRY=1: steps 2-4 as their dry runs (toy sizes, Triton's interpreter) and no pytest, to
# check the script itself on a machine without a GPU.
set -u
out=${1:?usage: LABKIT_GIT_COMMIT=<sha> bash scripts/gpu_session.sh OUT}
: "${LABKIT_GIT_COMMIT:?set LABKIT_GIT_COMMIT to the commit, written out from your checkout}"
export LABKIT_GIT_COMMIT PYTHONUNBUFFERED=1 LABKIT_CACHE_DIR=${LABKIT_CACHE_DIR:-/tmp/labkit-cache}
py=${PYTHON:-python3}
stamp=$(date -u +%Y%m%d-%H%M)
mkdir -p "$out"
step() {  # [grace=S] step NAME SECONDS COMMAND...: run it under its timeout, its output added to OUT/NAME-STAMP.log
    local name=$1 limit=$2 kill_after=${grace:-5}
    shift 2
    echo "[gpu_session] $name (at most $limit s): $*" | tee -a "$out/$name-$stamp.log" "$session"
    timeout -k "$kill_after" "$limit" "$@" >> "$out/$name-$stamp.log" 2>&1
    echo "[gpu_session] $name: exit $? ($(tail -n 1 "$out/$name-$stamp.log" | cut -c1-300))" | tee -a "$session"
}
session="$out/session-$stamp.log"
{
    echo "[gpu_session] commit $LABKIT_GIT_COMMIT, $(date -u +%Y-%m-%dT%H:%M:%SZ)"
    nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader 2>/dev/null || echo "[gpu_session] no nvidia-smi"
    timeout -k 5 60 "$py" -c "import torch, triton; print('[gpu_session] torch', torch.__version__, 'CUDA', torch.version.cuda, '| triton', triton.__version__, '| CUDA GPU:', torch.cuda.is_available())" 2>&1
} | tee -a "$session"
dry=()
if [ "${DRY:-0}" = 1 ]; then
    dry=(--dry-run)
elif ! grep -q "CUDA GPU: True" "$session"; then  # torch's answer above: loaded once
    echo "[gpu_session] stopped: torch sees no CUDA GPU here, or torch or triton did not load (above; DRY=1 checks the script without a GPU)" | tee -a "$session"
    exit 3
fi
if [ "${DRY:-0}" != 1 ] && "$py" -c "import pytest" 2>/dev/null; then
    # the model's, the graphs' and the breakdown's tests that need a GPU (short, so first; the newest
    # first: 12 of the model's and graphs' took 35 s at 400adbb); then every kernel test,
    # compiled on the GPU (81 of them took 81 s there at 2dacd5b; flash's autotune adds to it).
    # -v: each test is named as it ends, so a step stopped by its timeout still says which failed
    step pytest-gpu 80 "$py" -m pytest -v --tb=short -m gpu -p no:cacheprovider tests/test_graphed_prefill.py \
        tests/test_breakdown.py tests/test_model.py tests/test_graphed_decode.py
    step pytest-gpu 120 "$py" -m pytest -v --tb=short -p no:cacheprovider tests/test_kernels_add_rms_norm.py \
        tests/test_kernels_rope_store.py tests/test_kernels_swiglu.py tests/test_kernels_decode_attention.py \
        tests/test_kernels_kv_quant.py \
        tests/test_kernels_matmul.py tests/test_kernels_flash_attention.py
else
    echo "[gpu_session] pytest-gpu: skipped (DRY=1, or no pytest here)" | tee -a "$session"
fi
step gpu-check 130 "$py" -m labkit.gpu_check --out "$out" --only calibration,correctness,kernels --budget-s 115 "${dry[@]}"
step gpu-check 110 "$py" -m labkit.gpu_check --out "$out" --only prefill_sweep,decode_sweep --budget-s 95 "${dry[@]}"
grace=15 step gpu-tune 90 "$py" scripts/gpu_tune.py --out "$out" --budget-s 75 --parts step,attention,prefill "${dry[@]}"
