"""SwiGLU's gate in one pass: silu(gate) * up, read from the fused gate/up product's output.

What you learn here:
  * the MLP's gate and up projections are one product (`w_gate_up`), whose output holds each
    row's gate half then its up half; torch then runs silu (read the gate half, write a new
    tensor) and a multiply (read that and the up half, write): two launches and two extra trips
    through memory for every row, in every layer, in decode and in prefill;
  * one program per (row, block of columns) reads both halves once and writes the product:
    one launch a layer fewer, and for a prefill of the 8B at P = 2,048 (ffn 14,336, bf16) two
    passes of 59 MB a layer fewer;
  * the rounding stays the unfused one: silu in fp32 rounded to the activations' dtype (as torch's
    silu), then the product in fp32 rounded again (as torch's multiply).

Shapes: gate_up [R, 2 F] (R rows: B for decode, B * P for prefill; F = the MLP's width), row
stride any, unit column stride; returns [R, F] in its dtype.
"""
import torch
import torch.nn.functional as F

try:
    import triton
    import triton.language as tl
except ImportError:  # macOS, Windows: no Triton wheels; the torch reference below still runs
    triton = tl = None

from ._runtime import check_runnable

# Columns a program handles: 8 warps x 32 threads x 4 values (one 16-byte load of fp32, or 8 bytes
# of 16-bit values, a thread).
BLOCK_F = 1024

# Pseudocode, one program per (row r, columns c .. c + BLOCK_F - 1):
#   g, u = gate_up[r, c:], gate_up[r, F + c:]                  # fp32
#   s = (g * sigmoid(g)) as the dtype                            # torch's silu
#   out[r, c:] = (fp32(s) * u) as the dtype                      # torch's multiply


if triton is not None:  # the kernel exists where Triton does; `swiglu_reference` everywhere
    @triton.jit(do_not_specialize=["R"])
    def _swiglu_kernel(
        gate_up_ptr,  # [R, 2 F], row stride stride_gu, unit column stride
        out_ptr,  # [R, F] out, contiguous
        R,  # rows (the grid's first axis; kept for the launch's key)
        F,  # the MLP's width
        stride_gu,  # gate_up's row stride, in elements
        BLOCK: tl.constexpr,
    ):
        row = tl.program_id(0).to(tl.int64)  # int64: row * F passes 2**31 for a long batched prefill
        cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
        mask = cols < F
        src = gate_up_ptr + row * stride_gu
        g = tl.load(src + cols, mask=mask, other=0.0)
        u = tl.load(src + F + cols, mask=mask, other=0.0)
        gf = g.to(tl.float32)
        s = (gf / (1.0 + tl.exp(-gf))).to(g.dtype)  # silu, rounded as torch's silu rounds
        tl.store(out_ptr + row * F + cols, (s.to(tl.float32) * u.to(tl.float32)).to(g.dtype), mask=mask)


def _check(gate_up):
    if gate_up.dim() != 2 or gate_up.shape[1] % 2 or gate_up.stride(1) != 1:
        raise ValueError(f"swiglu: gate_up must be [R, 2 F] with unit column stride; got shape "
                         f"{tuple(gate_up.shape)}")


def swiglu(gate_up: torch.Tensor) -> torch.Tensor:
    """silu(gate) * up for gate_up [R, 2 F] holding each row's gate half, then its up half -> [R, F]."""
    _check(gate_up)
    check_runnable(gate_up, "swiglu")
    R, width = gate_up.shape
    out = torch.empty((R, width // 2), dtype=gate_up.dtype, device=gate_up.device)
    if R and width:
        _swiglu_kernel[(R, triton.cdiv(width // 2, BLOCK_F))](
            gate_up, out, R, width // 2, gate_up.stride(0), BLOCK=BLOCK_F, num_warps=8)
    return out


def swiglu_reference(gate_up: torch.Tensor) -> torch.Tensor:
    """The two torch ops the kernel replaces (labkit.layer_math.swiglu's): silu, then the product."""
    _check(gate_up)
    gate, up = gate_up.chunk(2, dim=-1)
    return F.silu(gate) * up
