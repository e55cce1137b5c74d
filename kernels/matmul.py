"""Tiled matrix multiply for the linear layers: c[M, N] = a[M, K] @ b[K, N].

What you learn here:
  * prefill multiplies many tokens (M = B * P rows) by each weight, so a linear layer is a big
    matmul whose speed is set by FLOP/s, not by memory bandwidth (decode is the opposite);
  * tiling: each program computes one BLOCK_M x BLOCK_N tile of c, walking K in BLOCK_K steps and
    accumulating in fp32 registers, so every loaded element of a and b is reused many times;
  * grouped ("swizzled") program order: programs that run at the same time share rows of a and
    columns of b, so those tiles are still in L2 when the next program needs them;
  * strides: b may be a transposed view of a weight stored [N, K] (as nn.Linear stores it);
    the kernel only follows strides, so no copy is needed;
  * decode-shaped products (M = B <= 64 rows): one row of tiles gives only N / BLOCK_N programs
    (64 for N = 4096), fewer than an H100's 132 SMs, and each must stream its share of the
    weight alone. Split-K cuts K into SPLIT_K slices too, so the grid fills every SM; each slice
    writes an fp32 partial and a second small kernel adds them up (no atomics: the same inputs
    give the same bits, which the CUDA-graph decode path's check relies on).
"""
import torch
import triton
import triton.language as tl

from ._runtime import INTERPRETED, capability, check_runnable, shared_bytes_per_block, sm_count

# Pseudocode, one program per output tile (pid_m, pid_n) [and K slice pid_k on the split path]:
#   acc = zeros(BLOCK_M, BLOCK_N) in fp32
#   for k0 in range(k_start, k_end, BLOCK_K):
#       acc += a[rows, k0:k0+BLOCK_K] @ b[k0:k0+BLOCK_K, cols]   # masked past K
#   c[rows, cols] = acc.to(c.dtype)        # split path: partial[pid_k, rows, cols] = acc, then
#                                          # c = sum over pid_k of partial, in a second kernel
# Offsets into a, b and c are int64: M x N passes 2**31 from B * P = 149,797 tokens for N = 14,336.

# Autotune candidates on CUDA, (BLOCK_M, BLOCK_N, BLOCK_K, num_stages, num_warps), per element size.
# 16-bit tiles are H100-sized; make gpu-compile checks that every one the lab keeps compiles for
# sm_75/80/89/90 within the shared memory of the GPUs there, without register spills.
TILES_16BIT = ((128, 256, 64, 3, 8), (256, 128, 64, 3, 8), (128, 128, 64, 4, 8), (128, 128, 64, 3, 4),
               (128, 128, 32, 4, 4), (128, 64, 64, 4, 4), (64, 128, 64, 4, 4))
# Ampere and Ada (sm_80, sm_89): the tiles above that triton 3.6 spilled 8-20 bytes on are left out.
TILES_16BIT_AMPERE = ((128, 128, 64, 4, 8), (128, 128, 32, 4, 4), (64, 128, 64, 4, 4))
# Turing (sm_75) has no asynchronous copies: pipeline stages live in registers, and the tiles
# above spill there (up to 13 KB at 128 x 128); these do not.
TILES_16BIT_SM75 = ((64, 64, 16, 2, 4), (32, 64, 32, 2, 4), (64, 32, 32, 2, 4))
# Exact ("ieee") fp32 products run on FMA units, not tensor cores, and hold both operand tiles in
# registers: tiles this size keep under 255 registers per thread (larger ones spill).
TILES_FP32 = ((64, 64, 32, 3, 4), (64, 128, 16, 3, 8), (128, 64, 16, 3, 8))
INTERPRETER_TILE = (32, 32, 32, 1, 4)  # one small fixed tile in the interpreter: quick tests
GROUP_M = 8

# The decode-shaped (split-K) path, M <= SPLIT_K_MAX_M: BLOCK_M rows is M rounded up to 16, 32
# or 64 (tl.dot's smallest is 16); one tile per element size, no autotuning.
# The 16-bit tile and the programs per SM were timed on an H200 (scripts/gpu_tune.py), twice:
#  * data/recordings/gpu-tune-h200-20261204-1541.json, when the kernel still loaded b two bytes at
#    a time: 128-key steps at 4 programs per SM took 0.44 of the time of (64, 64, 3, 4) at 1 per SM;
#  * data/recordings/gpu-tune-h200-20261204-1742.json, with 16-byte copies in a pipeline (EVEN_K):
#    at 1 program per SM the same tile streams the 8B's weights at 2.0-4.4 TB/s at M = 1 and 16,
#    0.84-1.05 of torch's GEMV on the same shapes (2.1-4.2), is within 1 % of the fastest tile there and
#    the fastest of those timed at M = 64 (0.84 of its time at 4 per SM): fewer K slices, fewer sums.
SPLIT_K_MAX_M = 64
# The fp32 tile is untimed: with loads unmasked along K (EVEN_K), (64, 16, 3, 4) spilled 16 bytes
# on sm_80 at M = 64 under triton 3.9, and at 8 warps 12 bytes on sm_90a under 3.6 (make
# gpu-compile); of the tiles that spill nowhere under either, this one has the most bytes in flight.
SPLIT_K_TILE = {2: (64, 128, 3, 4), 4: (64, 32, 2, 8)}  # element bytes -> (BLOCK_N, BLOCK_K, stages, warps)
SPLIT_K_TILE_SM75 = (32, 32, 2, 4)  # 16-bit on Turing (see TILES_16BIT_SM75)
# 16-bit on Ampere and Ada, untimed there: the tile above spilled 44-52 bytes on them before EVEN_K
# (now only its masked path does, for a K that is not a multiple of 128).
SPLIT_K_TILE_AMPERE = (64, 64, 3, 4)
INTERPRETER_SPLIT_K_TILE = (32, 32, 1, 4)
# Programs the split aims for, per SM on a GPU: column tiles x K slices. With the loads pipelined,
# one per SM keeps HBM busy (the second recording above); 1 in the interpreter too, whose stand-in
# SM count is already small.
SPLIT_K_PROGRAMS_PER_SM = 1
REDUCE_BLOCK = 1024  # elements of c per program of the split-K sum

# Autotune keys: M rounded up to a power of two between these, so a new prompt length or batch
# reuses the tuning of its bucket instead of tuning again (the best tile changes little within 2x).
M_BUCKET_MIN, M_BUCKET_MAX = 128, 8192


def m_bucket(M: int) -> int:
    """The autotune bucket of M: the next power of two, clamped to [M_BUCKET_MIN, M_BUCKET_MAX]."""
    return min(M_BUCKET_MAX, max(M_BUCKET_MIN, triton.next_power_of_2(max(1, M))))


def shared_bytes_estimate(block_m: int, block_n: int, block_k: int, stages: int, elem_bytes: int) -> int:
    """Shared memory a pipelined tile asks for: `stages` buffers of an a tile and a b tile."""
    return stages * (block_m * block_k + block_k * block_n) * elem_bytes


def tiles_for(elem_bytes: int, shared_limit: int | None = None, capability: tuple | None = None) -> list[tuple]:
    """The autotune tiles for inputs of `elem_bytes` (2: fp16/bf16, 4: fp32) on a GPU of
    `capability` that fit `shared_limit` bytes per block (None: all). A shape no tile fits is
    refused by the wrapper."""
    cc = tuple(capability) if capability is not None else (9, 0)
    tiles = (TILES_FP32 if elem_bytes == 4 else TILES_16BIT_SM75 if cc < (8, 0)
             else TILES_16BIT_AMPERE if cc < (9, 0) else TILES_16BIT)
    return [t for t in tiles if shared_limit is None
            or shared_bytes_estimate(t[0], t[1], t[2], t[3], elem_bytes) <= shared_limit]


def _configs():
    """All CUDA tiles (the prune below keeps the ones for the dtype and GPU); one in the interpreter."""
    tiles = [INTERPRETER_TILE] if INTERPRETED else sorted(set(TILES_16BIT + TILES_16BIT_SM75 + TILES_FP32))
    return [triton.Config({"BLOCK_M": bm, "BLOCK_N": bn, "BLOCK_K": bk, "GROUP_M": GROUP_M},
                          num_stages=s, num_warps=w) for bm, bn, bk, s, w in tiles]


def _prune(configs, named_args, **kwargs):
    """The autotune candidates for this call: its element size's tiles that fit the GPU."""
    a = named_args["a_ptr"]
    keep = set(tiles_for(a.element_size(), shared_bytes_per_block(a.device), capability(a.device)))
    return [c for c in configs if (c.kwargs["BLOCK_M"], c.kwargs["BLOCK_N"], c.kwargs["BLOCK_K"],
                                   c.num_stages, c.num_warps) in keep]


@triton.autotune(configs=_configs(), key=["M_BUCKET", "N", "K"],  # dtypes are part of the key too
                 prune_configs_by={"early_config_prune": _prune})
@triton.jit(do_not_specialize=["M", "M_BUCKET"])  # one compiled variant for every M
def _matmul_kernel(
    a_ptr,  # [M, K] left operand (fp16/bf16/fp32), any strides
    b_ptr,  # [K, N] right operand, same dtype as a, any strides (e.g. weight.T)
    c_ptr,  # [M, N] output, dtype of a, contiguous
    M, N, K,  # problem sizes
    M_BUCKET,  # m_bucket(M): the autotune key in place of M; unused by the kernel
    stride_am, stride_ak,  # element strides of a
    stride_bk, stride_bn,  # element strides of b
    stride_cm, stride_cn,  # element strides of c
    INPUT_PRECISION: tl.constexpr,  # "ieee" for exact fp32; ignored for fp16/bf16
    BLOCK_M: tl.constexpr,  # rows of c per program
    BLOCK_N: tl.constexpr,  # columns of c per program
    BLOCK_K: tl.constexpr,  # depth of one step along K
    GROUP_M: tl.constexpr,  # tile-rows per group in the swizzled order
):
    # Swizzle: walk the tiles in groups of GROUP_M tile-rows, column by column inside a group.
    # Programs launched together then touch GROUP_M row-blocks of a and few column-blocks of b.
    pid = tl.program_id(0)
    num_pid_m = tl.cdiv(M, BLOCK_M)
    num_pid_n = tl.cdiv(N, BLOCK_N)
    num_pid_in_group = GROUP_M * num_pid_n
    first_pid_m = (pid // num_pid_in_group) * GROUP_M
    group_size_m = min(num_pid_m - first_pid_m, GROUP_M)  # the last group may be short
    pid_m = first_pid_m + (pid % num_pid_in_group) % group_size_m
    pid_n = (pid % num_pid_in_group) // group_size_m

    # int64 rows and columns: offs_m * stride_cm reaches M * N, past 2**31 for long prompts.
    offs_m = pid_m.to(tl.int64) * BLOCK_M + tl.arange(0, BLOCK_M)  # [BLOCK_M] rows of a and c
    offs_n = pid_n.to(tl.int64) * BLOCK_N + tl.arange(0, BLOCK_N)  # [BLOCK_N] columns of b and c
    offs_k = tl.arange(0, BLOCK_K)  # [BLOCK_K]
    a_ptrs = a_ptr + offs_m[:, None] * stride_am + offs_k[None, :] * stride_ak  # [BLOCK_M, BLOCK_K]
    b_ptrs = b_ptr + offs_k[:, None] * stride_bk + offs_n[None, :] * stride_bn  # [BLOCK_K, BLOCK_N]

    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)  # fp32 accumulator whatever the inputs
    for k0 in range(0, K, BLOCK_K):
        k_mask = (k0 + offs_k) < K  # the last step may run past K: load zeros there
        a = tl.load(a_ptrs, mask=(offs_m[:, None] < M) & k_mask[None, :], other=0.0)
        b = tl.load(b_ptrs, mask=k_mask[:, None] & (offs_n[None, :] < N), other=0.0)
        acc = tl.dot(a, b, acc, input_precision=INPUT_PRECISION)
        a_ptrs += BLOCK_K * stride_ak
        b_ptrs += BLOCK_K * stride_bk

    c_ptrs = c_ptr + offs_m[:, None] * stride_cm + offs_n[None, :] * stride_cn
    c_mask = (offs_m[:, None] < M) & (offs_n[None, :] < N)
    tl.store(c_ptrs, acc.to(c_ptr.dtype.element_ty), mask=c_mask)


@triton.jit(do_not_specialize=["M", "K_PER_SPLIT"])  # one compiled variant for every batch
def _matmul_split_k_kernel(
    a_ptr,  # [M, K] left operand, any strides
    b_ptr,  # [K, N] right operand, same dtype, any strides
    c_ptr,  # [M, N] output (SPLIT_K == 1), contiguous
    partial_ptr,  # [SPLIT_K, M, N] fp32 partial sums (SPLIT_K > 1), contiguous
    M, N, K,  # problem sizes, M <= BLOCK_M
    K_PER_SPLIT,  # keys of K per slice, a multiple of BLOCK_K
    stride_am, stride_ak,  # element strides of a
    stride_bk, stride_bn,  # element strides of b
    INPUT_PRECISION: tl.constexpr,  # "ieee" for exact fp32
    PARTIAL: tl.constexpr,  # False: one slice, store c; True: store this slice's fp32 partial
    BLOCK_M: tl.constexpr,  # M rounded up to 16, 32 or 64: all rows in one tile
    BLOCK_N: tl.constexpr,  # columns of c per program
    BLOCK_K: tl.constexpr,  # depth of one step along K
    EVEN_K: tl.constexpr,  # K % BLOCK_K == 0: every step is whole, no mask along K
):
    pid_n = tl.program_id(0)  # column tile
    pid_k = tl.program_id(1)  # K slice
    offs_m = tl.arange(0, BLOCK_M).to(tl.int64)  # [BLOCK_M]
    offs_n = pid_n.to(tl.int64) * BLOCK_N + tl.arange(0, BLOCK_N)  # [BLOCK_N]
    offs_k = tl.arange(0, BLOCK_K)  # [BLOCK_K]
    # K_PER_SPLIT is a multiple of BLOCK_K (split_k_plan), but it is not specialised (one variant
    # for every shape), so Triton cannot see it: said here, the loads along K (b's contiguous
    # dimension: b is a weight's transpose) are 16-byte aligned, and with EVEN_K unmasked along K,
    # so they become 16-byte asynchronous copies in a pipeline. Without both, an sm_90 build
    # loaded b two bytes at a time (ld.global.b16) and streamed the weights at 1.3-2.7 TB/s.
    k_start = tl.multiple_of(pid_k * K_PER_SPLIT, BLOCK_K)
    k_end = tl.minimum(k_start + K_PER_SPLIT, K)
    a_ptrs = a_ptr + offs_m[:, None] * stride_am + (k_start + offs_k)[None, :] * stride_ak
    b_ptrs = b_ptr + (k_start + offs_k)[:, None] * stride_bk + offs_n[None, :] * stride_bn

    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(k_start, k_end, BLOCK_K):
        if EVEN_K:
            a = tl.load(a_ptrs, mask=offs_m[:, None] < M, other=0.0)
            b = tl.load(b_ptrs, mask=offs_n[None, :] < N, other=0.0)
        else:
            k_mask = (k0 + offs_k) < k_end
            a = tl.load(a_ptrs, mask=(offs_m[:, None] < M) & k_mask[None, :], other=0.0)
            b = tl.load(b_ptrs, mask=k_mask[:, None] & (offs_n[None, :] < N), other=0.0)
        acc = tl.dot(a, b, acc, input_precision=INPUT_PRECISION)
        a_ptrs += BLOCK_K * stride_ak
        b_ptrs += BLOCK_K * stride_bk

    mask = (offs_m[:, None] < M) & (offs_n[None, :] < N)
    if not PARTIAL:
        tl.store(c_ptr + offs_m[:, None] * N + offs_n[None, :], acc.to(c_ptr.dtype.element_ty), mask=mask)
    else:
        out = partial_ptr + (pid_k * M + offs_m)[:, None] * N + offs_n[None, :]
        tl.store(out, acc, mask=mask)


@triton.jit(do_not_specialize=["MN", "SPLIT_K"])
def _split_k_sum_kernel(
    partial_ptr,  # [SPLIT_K, M * N] fp32 partial sums, contiguous
    c_ptr,  # [M * N] output, contiguous
    MN,  # M * N
    SPLIT_K,  # slices to add, in order (the same bits on every run)
    BLOCK: tl.constexpr,  # elements of c per program
):
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)  # [BLOCK]
    mask = offs < MN
    acc = tl.zeros((BLOCK,), dtype=tl.float32)
    ptrs = partial_ptr + offs  # slice 0; each step moves a 64-bit pointer on by M * N
    for _ in range(SPLIT_K):
        acc += tl.load(ptrs, mask=mask, other=0.0)
        ptrs += MN
    tl.store(c_ptr + offs, acc.to(c_ptr.dtype.element_ty), mask=mask)


def split_k_plan(M: int, N: int, K: int, elem_bytes: int, sms: int, interpreted: bool = INTERPRETED,
                 capability: tuple | None = None, tile: tuple | None = None,
                 programs_per_sm: int | None = None) -> dict:
    """How a decode-shaped product (M <= SPLIT_K_MAX_M) is cut: tile sizes, K slices, programs.

    SPLIT_K is the fewest slices for which column tiles x slices >= programs_per_sm x sms, limited
    by the number of BLOCK_K steps; K_PER_SPLIT = floor(steps / wanted) steps, so the slices that
    result are never fewer than wanted. `tile` (BLOCK_N, BLOCK_K, stages, warps) replaces the
    table's: scripts/gpu_tune.py times candidates through it."""
    if tile is not None:
        block_n, block_k, stages, warps = tile
    elif interpreted:
        block_n, block_k, stages, warps = INTERPRETER_SPLIT_K_TILE
    elif elem_bytes == 2 and capability is not None and tuple(capability) < (8, 0):
        block_n, block_k, stages, warps = SPLIT_K_TILE_SM75
    elif elem_bytes == 2 and capability is not None and tuple(capability) < (9, 0):
        block_n, block_k, stages, warps = SPLIT_K_TILE_AMPERE
    else:
        block_n, block_k, stages, warps = SPLIT_K_TILE[elem_bytes]
    block_m = max(16, triton.next_power_of_2(M))
    tiles = triton.cdiv(N, block_n)
    steps = max(1, triton.cdiv(K, block_k))
    per_sm = programs_per_sm or (1 if interpreted else SPLIT_K_PROGRAMS_PER_SM)
    wanted = max(1, min(triton.cdiv(per_sm * sms, tiles), steps))
    per_split = max(1, steps // wanted) * block_k
    split_k = max(1, triton.cdiv(K, per_split))
    return {"BLOCK_M": block_m, "BLOCK_N": block_n, "BLOCK_K": block_k, "num_stages": stages,
            "num_warps": warps, "SPLIT_K": split_k, "K_PER_SPLIT": per_split, "programs": tiles * split_k}


_DTYPES = (torch.float16, torch.bfloat16, torch.float32)


def _check_inputs(a, b):
    for name, t in (("a", a), ("b", b)):
        if not isinstance(t, torch.Tensor) or t.dim() != 2:
            got = f"shape {tuple(t.shape)}" if isinstance(t, torch.Tensor) else type(t).__name__
            raise ValueError(f"matmul: {name} must be a 2-D tensor; got {got}")
        if t.dtype not in _DTYPES:
            raise ValueError(f"matmul: {name} dtype {t.dtype} not supported; expected one of "
                             "bf16, fp16, fp32")
    if a.shape[1] != b.shape[0]:
        raise ValueError(f"matmul: inner dims differ: a is {tuple(a.shape)} (K={a.shape[1]}) but "
                         f"b is {tuple(b.shape)} (K={b.shape[0]}); expected a [M, K], b [K, N]")
    if a.dtype != b.dtype:
        raise ValueError(f"matmul: a dtype {a.dtype} and b dtype {b.dtype} differ; expected equal")
    if a.device != b.device:
        raise ValueError(f"matmul: a on {a.device} and b on {b.device}; expected the same device")
    check_runnable(a, "matmul")


def matmul(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """c = a @ b for a [M, K], b [K, N] (fp16/bf16/fp32, same dtype and device); c has a's dtype.

    Accumulates in fp32. fp32 inputs use exact ("ieee") fp32 products, not TF32. M <= 64 (decode)
    takes the split-K path; larger M the autotuned tiles that fit this GPU's shared memory.
    """
    _check_inputs(a, b)
    M, K = a.shape
    N = b.shape[1]
    c = torch.empty((M, N), dtype=a.dtype, device=a.device)
    if M == 0 or N == 0:
        return c
    precision = "ieee" if a.dtype == torch.float32 else "tf32"
    if M <= SPLIT_K_MAX_M:
        return _split_k_matmul(a, b, c, precision)
    if not INTERPRETED and not tiles_for(a.element_size(), shared_bytes_per_block(a.device), capability(a.device)):
        raise ValueError(f"matmul: no tile for {a.dtype} fits this GPU's "
                         f"{shared_bytes_per_block(a.device):,} bytes of shared memory per block")

    def grid(meta):  # one program per output tile, in a 1-D grid the kernel swizzles
        return (triton.cdiv(M, meta["BLOCK_M"]) * triton.cdiv(N, meta["BLOCK_N"]),)

    _matmul_kernel[grid](
        a, b, c, M, N, K, m_bucket(M),
        a.stride(0), a.stride(1), b.stride(0), b.stride(1), c.stride(0), c.stride(1),
        INPUT_PRECISION=precision,
    )
    return c


def _split_k_matmul(a, b, c, precision):
    M, K = a.shape
    N = b.shape[1]
    plan = split_k_plan(M, N, K, a.element_size(), sm_count(a.device), capability=capability(a.device))
    split_k = plan["SPLIT_K"]
    partial = c if split_k == 1 else torch.empty((split_k, M, N), dtype=torch.float32, device=a.device)
    _matmul_split_k_kernel[(triton.cdiv(N, plan["BLOCK_N"]), split_k)](
        a, b, c, partial, M, N, K, plan["K_PER_SPLIT"],
        a.stride(0), a.stride(1), b.stride(0), b.stride(1),
        INPUT_PRECISION=precision, PARTIAL=split_k > 1, BLOCK_M=plan["BLOCK_M"], BLOCK_N=plan["BLOCK_N"],
        BLOCK_K=plan["BLOCK_K"], EVEN_K=K % plan["BLOCK_K"] == 0, num_stages=plan["num_stages"],
        num_warps=plan["num_warps"],
    )
    if split_k > 1:
        _split_k_sum_kernel[(triton.cdiv(M * N, REDUCE_BLOCK),)](
            partial, c, M * N, split_k, BLOCK=REDUCE_BLOCK)
    return c


def matmul_reference(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """The same product in plain torch: fp32 accumulation, result cast to a's dtype."""
    return (a.float() @ b.float()).to(a.dtype)
