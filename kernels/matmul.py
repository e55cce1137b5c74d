"""Tiled matrix multiply for prefill linear layers: c[M, N] = a[M, K] @ b[K, N].

What you learn here:
  * prefill multiplies many tokens (M = B * P rows) by each weight, so a linear layer is a big
    matmul whose speed is set by FLOP/s, not by memory bandwidth (decode is the opposite);
  * tiling: each program computes one BLOCK_M x BLOCK_N tile of c, walking K in BLOCK_K steps and
    accumulating in fp32 registers, so every loaded element of a and b is reused many times;
  * grouped ("swizzled") program order: programs that run at the same time share rows of a and
    columns of b, so those tiles are still in L2 when the next program needs them;
  * strides: b may be a transposed view of a weight stored [N, K] (as nn.Linear stores it);
    the kernel only follows strides, so no copy is needed.
"""
import torch
import triton
import triton.language as tl

from ._runtime import check_runnable

# Pseudocode, one program per output tile (pid_m, pid_n):
#   acc = zeros(BLOCK_M, BLOCK_N) in fp32
#   for k0 in range(0, K, BLOCK_K):
#       acc += a[rows, k0:k0+BLOCK_K] @ b[k0:k0+BLOCK_K, cols]   # masked past K
#   c[rows, cols] = acc.to(c.dtype)                               # masked past M and N


def _configs():
    """Autotune candidates on CUDA (H100-sized tiles); one small fixed tile in the interpreter."""
    if not torch.cuda.is_available():
        return [triton.Config({"BLOCK_M": 32, "BLOCK_N": 32, "BLOCK_K": 32, "GROUP_M": 4},
                              num_warps=4, num_stages=1)]
    tiles = [  # (BLOCK_M, BLOCK_N, BLOCK_K, num_stages, num_warps); too big for fp32 -> skipped
        (128, 256, 64, 3, 8), (256, 128, 64, 3, 8), (128, 128, 64, 4, 8),
        (128, 128, 64, 3, 4), (128, 128, 32, 4, 4), (128, 64, 64, 4, 4), (64, 128, 64, 4, 4),
    ]
    return [triton.Config({"BLOCK_M": bm, "BLOCK_N": bn, "BLOCK_K": bk, "GROUP_M": 8},
                          num_stages=s, num_warps=w) for bm, bn, bk, s, w in tiles]


@triton.autotune(configs=_configs(), key=["M", "N", "K"])  # dtypes are part of the key too
@triton.jit
def _matmul_kernel(
    a_ptr,  # [M, K] left operand (fp16/bf16/fp32), any strides
    b_ptr,  # [K, N] right operand, same dtype as a, any strides (e.g. weight.T)
    c_ptr,  # [M, N] output, dtype of a, contiguous
    M, N, K,  # problem sizes
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

    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)  # [BLOCK_M] rows of a and c
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)  # [BLOCK_N] columns of b and c
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


_DTYPES = (torch.float16, torch.bfloat16, torch.float32)


def matmul(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """c = a @ b for a [M, K], b [K, N] (fp16/bf16/fp32, same dtype and device); c has a's dtype.

    Accumulates in fp32. fp32 inputs use exact ("ieee") fp32 products, not TF32.
    """
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
    M, K = a.shape
    N = b.shape[1]
    c = torch.empty((M, N), dtype=a.dtype, device=a.device)
    if M == 0 or N == 0:
        return c

    def grid(meta):  # one program per output tile, in a 1-D grid the kernel swizzles
        return (triton.cdiv(M, meta["BLOCK_M"]) * triton.cdiv(N, meta["BLOCK_N"]),)

    _matmul_kernel[grid](
        a, b, c, M, N, K,
        a.stride(0), a.stride(1), b.stride(0), b.stride(1), c.stride(0), c.stride(1),
        INPUT_PRECISION="ieee" if a.dtype == torch.float32 else "tf32",
    )
    return c


def matmul_reference(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """The same product in plain torch: fp32 accumulation, result cast to a's dtype."""
    return (a.float() @ b.float()).to(a.dtype)
