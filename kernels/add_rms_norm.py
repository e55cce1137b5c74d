"""The residual add and the next RMSNorm in one pass: x += delta; normed = x / rms(x) * weight.

What you learn here:
  * a decode step of a Llama is ~100 small operations per token; on a GPU each costs a launch and
    a trip through memory however few bytes it touches, so at batch 1 the elementwise work can
    take a tenth of the step (in the 8B's step on an H200, the norms 0.38 ms and the residual
    adds 0.09 ms of 5.7 ms of kernels: data/recordings/gpu-tune-h200-20261204-1751.json);
  * every residual add in a pre-norm decoder is followed by a norm of its result (the MLP's
    norm, the next layer's attention norm, the final norm), so one kernel can do both: it reads
    x and delta once, writes the new x and the normed row, and the launch between them is gone;
  * the rounding stays the unfused one: the sum is rounded to x's dtype (as torch's add), and
    the norm is computed in fp32 from that rounded sum and cast once, after the weight.

Shapes: x, delta [R, N] (R rows: B for decode, B * P for prefill; N = hidden size);
weight [N]; returns (x + delta, normed), both [R, N] in x's dtype.
"""
import torch

try:
    import triton
    import triton.language as tl
except ImportError:  # macOS, Windows: no Triton wheels; the torch reference below still runs
    triton = tl = None

from ._runtime import check_runnable

# The widest row one program holds in registers: the 70B's hidden size (16 warps, 16 values a thread
# for the row and as many for the weight; at 16,384 fp32 values ptxas spilled on sm_89). A wider row
# (the 405B, which no single GPU holds) runs as torch's two ops in TritonOps.
MAX_N = 8192

# Pseudocode, one program per row r:
#   x = x[r] (+ delta[r], rounded to x's dtype and stored)      # [N]
#   normed[r] = (fp32(x) * rsqrt(mean(fp32(x) ** 2) + eps) * fp32(weight)) as x's dtype


if triton is not None:  # the kernel exists where Triton does; `add_rms_norm_reference` everywhere
    @triton.jit(do_not_specialize=["R"])
    def _add_rms_norm_kernel(
        x_ptr,  # [R, N] residual stream, row stride stride_x, unit column stride
        delta_ptr,  # [R, N] what the layer adds (HAS_DELTA), row stride stride_d
        weight_ptr,  # [N] the norm's gain
        sum_ptr,  # [R, N] out: x + delta (HAS_DELTA), contiguous
        out_ptr,  # [R, N] out: the normed rows, contiguous
        R,  # rows (unused in the body: the grid has one program per row; kept for the launch's key)
        N,  # hidden size
        stride_x, stride_d,  # row strides of x and delta, in elements
        eps,  # the norm's epsilon
        HAS_DELTA: tl.constexpr,  # False: only the norm (the embedding's first norm)
        BLOCK_N: tl.constexpr,  # next power of two >= N: one row per program, in registers
    ):
        row = tl.program_id(0).to(tl.int64)  # int64: row * N passes 2**31 for a long batched prefill
        cols = tl.arange(0, BLOCK_N)
        mask = cols < N
        x = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=0.0)
        if HAS_DELTA:
            d = tl.load(delta_ptr + row * stride_d + cols, mask=mask, other=0.0)
            x = (x.to(tl.float32) + d.to(tl.float32)).to(x.dtype)  # rounded as torch's add rounds
            tl.store(sum_ptr + row * N + cols, x, mask=mask)
        xf = x.to(tl.float32)
        rstd = tl.rsqrt(tl.sum(xf * xf, axis=0) / N + eps)  # masked columns are 0: they add nothing
        w = tl.load(weight_ptr + cols, mask=mask, other=0.0).to(tl.float32)
        tl.store(out_ptr + row * N + cols, (xf * rstd * w).to(x.dtype), mask=mask)


def num_warps_for(N: int) -> int:
    """Warps for one row of N elements: about 8-16 elements a thread (the Triton tutorials'
    layer norm uses the same rule), so a 4,096-wide row gets 8 warps."""
    return max(1, min(16, triton.next_power_of_2(N) // 512))


def _check(x, delta, weight):
    if x.dim() != 2 or x.stride(1) != 1:
        raise ValueError(f"add_rms_norm: x must be [R, N] with unit column stride; got shape {tuple(x.shape)}")
    if delta is not None and (delta.shape != x.shape or delta.dtype != x.dtype or delta.stride(1) != 1):
        raise ValueError(f"add_rms_norm: delta must match x ({tuple(x.shape)}, {x.dtype}, unit column "
                         f"stride); got {tuple(delta.shape)}, {delta.dtype}")
    if x.shape[1] > MAX_N:
        raise ValueError(f"add_rms_norm: rows of {x.shape[1]} values are wider than the kernel's {MAX_N}")
    if weight.shape != (x.shape[1],) or weight.dtype != x.dtype:
        raise ValueError(f"add_rms_norm: weight must be [{x.shape[1]}] in {x.dtype}; "
                         f"got {tuple(weight.shape)} in {weight.dtype}")


def add_rms_norm(x: torch.Tensor, delta, weight: torch.Tensor, eps: float):
    """(x + delta, rms_norm(x + delta) * weight) for x, delta [R, N] and weight [N]; with delta
    None, (x, rms_norm(x) * weight). x is not modified: the sum is a new tensor."""
    _check(x, delta, weight)
    check_runnable(x, "add_rms_norm")
    R, N = x.shape
    out = torch.empty((R, N), dtype=x.dtype, device=x.device)
    total = torch.empty_like(out) if delta is not None else x
    if R:
        _add_rms_norm_kernel[(R,)](
            x, delta if delta is not None else x, weight, total, out, R, N, x.stride(0),
            delta.stride(0) if delta is not None else 0, eps, HAS_DELTA=delta is not None,
            BLOCK_N=triton.next_power_of_2(N), num_warps=num_warps_for(N))
    return total, out


def add_rms_norm_reference(x: torch.Tensor, delta, weight: torch.Tensor, eps: float):
    """The kernel's arithmetic in torch: the sum in x's dtype, the norm in fp32, cast once."""
    total = x if delta is None else x + delta
    xf = total.float()
    normed = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps) * weight.float()
    return total, normed.to(x.dtype)
