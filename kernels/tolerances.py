"""How far each kernel may land from its torch reference: one table, with the reason for each
number, read by the kernel tests (tests/kernel_util.py) and by the GPU check's correctness
section (labkit.gpu_check), so the two cannot disagree about what "correct" means.

Every entry is (atol, rtol): a check passes where |out - ref| <= atol + rtol * |ref|. Dtypes are
the lab's names ("fp32", "bf16", "fp16", "fp8", "int8"). Pure Python: no torch, no triton.
"""
from __future__ import annotations

# Matmul, flash attention and decode attention over a float cache. Kernel and reference both
# accumulate in fp32 and round once to the output dtype (the attention kernels also round the
# probabilities to the input dtype before p @ v, as every flash kernel does), so they differ by
# accumulation order plus an ulp or so of the dtype: ~1e-7 relative for fp32, 2^-11 for fp16,
# 2^-8 for bf16. Outputs are O(1) (the checks scale their inputs so), so atol and rtol are alike.
FLOAT = {"fp32": (1e-4, 1e-4), "fp16": (2e-3, 2e-3), "bf16": (1.6e-2, 1.6e-2)}

# Decode attention over an int8 or fp8 cache, kernel and reference reading the SAME quantised
# cache, so this bounds arithmetic only: the kernel rounds the probabilities, times int8's
# per-token V scales, to q's dtype before p @ V, where the reference stays in fp32. fp16 (no
# bf16-like exponent range) feels that rounding; bf16's own FLOAT entry is already wider.
QUANTISED_CACHE = {"int8": (5e-3, 5e-3), "fp8": (5e-3, 5e-3)}

# The int8 quantiser's codes: kernel and reference compute the same fp32 formula, so in the
# interpreter they agree exactly; compiled, Triton's fp32 division is not IEEE-exact in the last
# bit, which can move a tie by one code.
INT8_CODES_COMPILED = (1.0, 0.0)
INT8_CODES_INTERPRETED = (0.0, 0.0)
# The fp8 (e4m3) quantiser's codes: at most one e4m3 step, 2^-3 of the value (3 mantissa bits),
# 2^-9 among the subnormals. Kernel and reference multiply by the same fp32 reciprocal and round
# to nearest, so they agree exactly on an H100; the step allows for a GPU whose conversion
# rounds a tie the other way. (The interpreter miscasts fp32 -> fp8 inside a kernel: not checked.)
FP8_CODES = (2 ** -9, 2 ** -3)
# int8's per-row scales: absmax / 127 in fp32 on both sides, so one fp32 rounding apart at most.
INT8_SCALES = (0.0, 1e-6)


def float_tolerance(dtype: str) -> tuple[float, float]:
    """(atol, rtol) for matmul, flash attention, and decode attention over a float cache."""
    return FLOAT[dtype]


def decode_attention_tolerance(q_dtype: str, cache_dtype: str) -> tuple[float, float]:
    """(atol, rtol) for decode attention with q in `q_dtype` over a `cache_dtype` cache: the
    float entry of q's dtype, widened to QUANTISED_CACHE for an int8/fp8 cache unless q is fp32
    (then the kernel keeps p @ V in fp32 and rounds nothing extra)."""
    if cache_dtype not in QUANTISED_CACHE or q_dtype == "fp32":
        return FLOAT[q_dtype]
    return max(FLOAT[q_dtype], QUANTISED_CACHE[cache_dtype])


def kv_quant_code_tolerance(cache_dtype: str, compiled: bool) -> tuple[float, float]:
    """(atol, rtol) between the quantiser kernel's codes and its reference's, compared as floats."""
    if cache_dtype == "int8":
        return INT8_CODES_COMPILED if compiled else INT8_CODES_INTERPRETED
    if cache_dtype == "fp8":
        return FP8_CODES
    raise ValueError(f"no quantised codes for cache dtype {cache_dtype!r}; expected int8 or fp8")
