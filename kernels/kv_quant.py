"""KV-cache quantisation: store K and V in fewer bytes so decode reads less memory.

What you learn here:
  * decode is memory-bound, so a cache stored in 1 byte per value (int8 or fp8) instead of
    2 (bf16) halves the bytes each decode step must read;
  * int8 needs a scale per row (one per token per kv head): value ~= int8 * scale, with
    scale = absmax(row) / 127, so every row uses the full int8 range;
  * fp8 e4m3 carries its own exponent, so one per-tensor scale is enough (as vLLM does):
    value ~= fp8.to(f32) * scale; e4m3 saturates at +-448, so we clamp before the cast;
  * a row-wise Triton kernel: one program quantises BLOCK_R rows of length D.

Shapes: x is [..., D], e.g. [B, Hkv, T, D]; int8 scales are x.shape[:-1] (one per row).
"""
import torch

try:
    import triton
    import triton.language as tl
except ImportError:  # macOS, Windows: no Triton wheels; the torch reference below still runs
    triton = tl = None

from ._runtime import check_dtype_supported, check_runnable

# The kernels' own names for cache dtypes. labkit's table is labkit.dtypes (TORCH_DTYPES); kernels/
# cannot import it (labkit imports kernels, and the kernels must stay usable on their own), so the
# five names are repeated here and tests/test_kernels_kv_quant.py checks the two tables agree.
KV_CACHE_DTYPES = {
    "bf16": torch.bfloat16,
    "fp16": torch.float16,
    "fp32": torch.float32,
    "fp8": torch.float8_e4m3fn,
    "int8": torch.int8,
}
BLOCK_R = 16  # rows per program
FP8_MAX = 448.0  # largest finite float8_e4m3fn value
INT8_MAX = 127.0  # symmetric range [-127, 127]; -128 unused so that -q is always representable

# Pseudocode, one program per BLOCK_R rows of the [R, D] view of x:
#   rows  = x[r0 : r0 + BLOCK_R, :]                       # [BLOCK_R, D], loaded as fp32
#   int8: scale = max|rows| / 127 per row                 # [BLOCK_R]
#         q     = clamp(floor(rows * (127 / max|rows|) + 0.5), -127, 127)
#   fp8:  q     = fp8(clamp(rows * (1 / scale), -448, 448))   # scale: one number for the tensor
#   store q (and the int8 scales)


if triton is not None:  # the kernel exists where Triton does; `quantize_kv_reference` everywhere
    @triton.jit
    def int8_codes(x, absmax):
        """x (fp32, any shape) as int8 codes, held in fp32, for rows of absmax (broadcastable to
        x): floor(x * 127 / absmax + 0.5) in [-127, 127]. Also used by kernels/rope_store.py."""
        # An all-zero row gets scale 0 and quantises to 0 (instead of dividing by zero).
        nonzero = absmax > 0
        inv = tl.where(nonzero, 127.0 / tl.where(nonzero, absmax, 1.0), 0.0)  # 127 = INT8_MAX
        # Round to nearest, ties up: floor(y + 0.5). The reference uses the same formula, so the
        # two agree bit for bit (torch.round would round ties to even).
        q = tl.floor(x * inv + 0.5)
        return tl.minimum(tl.maximum(q, -127.0), 127.0)

    @triton.jit
    def fp8_codes(x, inv_scale):
        """x (fp32) times 1/scale, saturated to e4m3's +-448 (it has no inf), as fp8 e4m3; a NaN
        stays NaN, as in the reference (min/max leave NaNs out by default: it was stored -448)."""
        y = x * inv_scale
        y = tl.maximum(y, -448.0, propagate_nan=tl.PropagateNan.ALL)
        return tl.minimum(y, 448.0, propagate_nan=tl.PropagateNan.ALL).to(tl.float8e4nv)  # FP8_MAX

    @triton.jit
    def absmax_of(x, axis: tl.constexpr):
        """max |x| along `axis`, NaN where a row holds a NaN, as torch's amax: tl.max leaves NaNs
        out, and a NaN key was stored as a finite code with a finite scale, hiding the fault.
        Also used by kernels/rope_store.py."""
        absmax = tl.max(tl.abs(x), axis=axis)
        has_nan = tl.max((x != x).to(tl.int32), axis=axis) > 0
        return tl.where(has_nan, float("nan"), absmax)

    @triton.jit(do_not_specialize=["R"])  # one compiled variant for every row count
    def _quantize_kv_kernel(
        x_ptr,  # [R, D] input rows (fp16/bf16/fp32), row stride stride_xr, unit column stride
        q_ptr,  # [R, D] output (int8 or float8_e4m3fn), contiguous
        scale_ptr,  # int8: [R] fp32 per-row scales (written); fp8: unused
        inv_scale_ptr,  # fp8: 0-dim fp32 holding 1/scale (computed on host); int8: unused
        R,  # number of rows = x.numel() // D
        D,  # row length (head dim)
        stride_xr,  # elements between consecutive rows of x
        IS_INT8: tl.constexpr,  # True: per-row int8; False: per-tensor fp8 e4m3
        BLOCK_R: tl.constexpr,  # rows per program
        BLOCK_D: tl.constexpr,  # next power of two >= D (tl.arange needs a power of two)
    ):
        pid = tl.program_id(0)
        # int64 rows: offs_r * D reaches B * Hkv * T * D, past 2**31 for a long batched cache.
        offs_r = pid.to(tl.int64) * BLOCK_R + tl.arange(0, BLOCK_R)  # [BLOCK_R]
        offs_d = tl.arange(0, BLOCK_D)  # [BLOCK_D]
        mask = (offs_r[:, None] < R) & (offs_d[None, :] < D)  # [BLOCK_R, BLOCK_D]
        x = tl.load(x_ptr + offs_r[:, None] * stride_xr + offs_d[None, :], mask=mask, other=0.0)
        x = x.to(tl.float32)
        if IS_INT8:
            absmax = absmax_of(x, 1)  # [BLOCK_R]
            q = int8_codes(x, absmax[:, None])
            tl.store(q_ptr + offs_r[:, None] * D + offs_d[None, :], q.to(tl.int8), mask=mask)
            tl.store(scale_ptr + offs_r, absmax / 127.0, mask=offs_r < R)
        else:
            y = fp8_codes(x, tl.load(inv_scale_ptr))
            tl.store(q_ptr + offs_r[:, None] * D + offs_d[None, :], y, mask=mask)


def _resolve_dtype(cache_dtype) -> torch.dtype:
    if isinstance(cache_dtype, str):
        if cache_dtype not in KV_CACHE_DTYPES:
            raise ValueError(f"quantize_kv: cache_dtype {cache_dtype!r} unknown; expected one of "
                             f"{sorted(KV_CACHE_DTYPES)}")
        return KV_CACHE_DTYPES[cache_dtype]
    if cache_dtype not in KV_CACHE_DTYPES.values():
        raise ValueError(f"quantize_kv: cache_dtype {cache_dtype} not supported; expected one of "
                         f"{sorted(KV_CACHE_DTYPES)} or the matching torch dtype")
    return cache_dtype


def _fp8_scale(x: torch.Tensor, scale) -> torch.Tensor:
    if scale is None:
        return torch.tensor(1.0, dtype=torch.float32, device=x.device)
    if not isinstance(scale, torch.Tensor) or scale.dim() != 0 or scale.dtype != torch.float32:
        got = f"{scale.dtype} shape {tuple(scale.shape)}" if isinstance(scale, torch.Tensor) else type(scale)
        raise ValueError(f"quantize_kv: fp8 scale must be a 0-dim float32 tensor; got {got}")
    if scale.device != x.device:
        raise ValueError(f"quantize_kv: scale on {scale.device} but x on {x.device}")
    return scale


def quantize_kv(x: torch.Tensor, cache_dtype, scale=None, use_triton=None):
    """Quantise x [..., D] for a KV cache of `cache_dtype` (a torch dtype or a KV_CACHE_DTYPES key).

    Returns (q, scale): int8 -> q int8 [..., D] and fp32 scales x.shape[:-1];
    fp8 -> q float8_e4m3fn [..., D] and the 0-dim fp32 per-tensor scale (default 1.0);
    bf16/fp16/fp32 -> plain cast and None. `use_triton=None` runs the kernel on CUDA and the torch
    reference on CPU; True forces the kernel (on CPU it needs TRITON_INTERPRET=1).
    """
    dtype = _resolve_dtype(cache_dtype)
    if not isinstance(x, torch.Tensor) or x.dim() < 1 or x.shape[-1] == 0:
        raise ValueError(f"quantize_kv: x must be a tensor [..., D] with D >= 1; got "
                         f"{tuple(x.shape) if isinstance(x, torch.Tensor) else type(x)}")
    if x.dtype not in (torch.float16, torch.bfloat16, torch.float32):
        raise ValueError(f"quantize_kv: x dtype {x.dtype} not supported; expected bf16, fp16 or fp32")
    if dtype not in (torch.int8, torch.float8_e4m3fn):
        if scale is not None:
            raise ValueError(f"quantize_kv: scale must be None for cache dtype {dtype}; got a tensor")
        return x.to(dtype), None
    if dtype == torch.int8 and scale is not None:
        raise ValueError("quantize_kv: int8 scales are computed per row; scale must be None")
    use_triton = x.is_cuda if use_triton is None else use_triton
    if not use_triton:
        return quantize_kv_reference(x, dtype, scale)
    check_runnable(x, "quantize_kv")
    D = x.shape[-1]
    x2 = x.reshape(-1, D)  # [R, D]; copies only if x cannot be viewed that way
    if x2.stride(1) != 1:
        x2 = x2.contiguous()
    R = x2.shape[0]
    q = torch.empty(x.shape, dtype=dtype, device=x.device)
    check_dtype_supported(q, "quantize_kv")  # an fp8 cache before sm_89: refused here
    is_int8 = dtype == torch.int8
    if is_int8:
        scale = torch.empty(x.shape[:-1], dtype=torch.float32, device=x.device)
        inv_scale = scale  # unused by the int8 branch; any pointer will do
    else:
        scale = _fp8_scale(x, scale)
        inv_scale = scale.reciprocal()  # same fp32 op as the reference, so results match exactly
    grid = (triton.cdiv(R, BLOCK_R),)
    if R > 0:
        _quantize_kv_kernel[grid](x2, q, scale, inv_scale, R, D, x2.stride(0), IS_INT8=is_int8,
                                  BLOCK_R=BLOCK_R, BLOCK_D=triton.next_power_of_2(D))
    return q, scale


def quantize_kv_reference(x: torch.Tensor, cache_dtype, scale=None):
    """Pure-torch quantisation with exactly the kernel's formulas (see the pseudocode above)."""
    dtype = _resolve_dtype(cache_dtype)
    if dtype not in (torch.int8, torch.float8_e4m3fn):
        return x.to(dtype), None
    xf = x.float()
    if dtype == torch.int8:
        absmax = xf.abs().amax(dim=-1)  # [...]: one scale per row
        # A true division, as in the kernel: `127.0 / t` in torch is computed as t.reciprocal() * 127,
        # which rounds differently and would move some ties by one code.
        inv = torch.where(absmax > 0, torch.full_like(absmax, INT8_MAX) / absmax, 0.0)
        q = torch.floor(xf * inv[..., None] + 0.5).clamp(-INT8_MAX, INT8_MAX)
        return q.to(torch.int8), absmax / INT8_MAX
    scale = _fp8_scale(x, scale)
    y = (xf * scale.reciprocal()).clamp(-FP8_MAX, FP8_MAX)
    return y.to(torch.float8_e4m3fn), scale


def dequantize_kv(q: torch.Tensor, scale) -> torch.Tensor:
    """Back to fp32: int8 * per-row scale, fp8 * per-tensor scale, float caches just upcast."""
    if q.dtype == torch.int8:
        return q.float() * scale[..., None]
    if q.dtype == torch.float8_e4m3fn:
        return q.float() * scale
    return q.float()
