"""kernels.kv_quant: the Triton kernel against the torch reference, and the reference's contract."""
import pytest
import torch

from labkit.backend import TRITON_MISSING, triton_installed

if not triton_installed():  # macOS, Windows: no wheels; every kernel module imports triton
    pytest.skip(f"skipped: {TRITON_MISSING}", allow_module_level=True)

from kernel_util import CUDA, DEVICE, gpu_only, needs_cuda_or_interpreter, tol  # noqa: E402
from kernels import _runtime  # noqa: E402
from kernels.kv_quant import (KV_CACHE_DTYPES, dequantize_kv, quantize_kv,  # noqa: E402
                              quantize_kv_reference)
from kernels.tolerances import INT8_SCALES, kv_quant_code_tolerance  # noqa: E402
from labkit.dtypes import TORCH_DTYPES  # noqa: E402

pytestmark = needs_cuda_or_interpreter
# Codes compared as floats, at kernels/tolerances.py's tolerance: int8 exact in the interpreter,
# one code apart compiled (Triton's fp32 division can move a tie); fp8 one e4m3 step at most.
INT8_CODE_TOL = tol(kv_quant_code_tolerance("int8", compiled=CUDA))
FP8_CODE_TOL = tol(kv_quant_code_tolerance("fp8", compiled=CUDA))


def randn(*shape, dtype=torch.float32, seed=0, device=DEVICE):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(*shape, generator=g).to(device=device, dtype=dtype)


def check_int8_kernel(x):
    q, scale = quantize_kv(x, torch.int8, use_triton=True)
    q_ref, scale_ref = quantize_kv_reference(x, torch.int8)
    assert q.dtype == torch.int8 and q.shape == x.shape and scale.shape == x.shape[:-1]
    code_err = (q.int() - q_ref.int()).abs()
    torch.testing.assert_close(q.float(), q_ref.float(), **INT8_CODE_TOL, msg=lambda _: (
        f"int8 codes: max abs err {code_err.max().item()}, mean {code_err.float().mean().item():.3e}"))
    scale_err = (scale - scale_ref).abs()
    torch.testing.assert_close(scale, scale_ref, **tol(INT8_SCALES), msg=lambda _: (
        f"int8 scales: max abs err {scale_err.max().item():.3e}, mean {scale_err.mean().item():.3e}"))


@pytest.mark.parametrize("dtype", [torch.float16, torch.float32])
@pytest.mark.parametrize("shape", [(2, 3, 37, 64), (5, 80)])  # 80: D not a power of two
def test_int8_kernel_matches_reference(shape, dtype):
    x = randn(*shape, dtype=dtype, seed=1) * 3
    x[(0,) * (len(shape) - 1)] = 0  # an all-zero row must give scale 0, not a division by zero
    check_int8_kernel(x)


def test_int8_reference_error_is_at_most_half_a_step():
    x = randn(2, 4, 33, 64, seed=2)
    q, scale = quantize_kv_reference(x, "int8")
    assert q.abs().amax(dim=-1).eq(127).all(), "each row should use the full int8 range"
    err = (dequantize_kv(q, scale) - x).abs()
    assert (err <= scale[..., None] / 2 + 1e-6).all(), f"max err {err.max().item():.3e}"


def test_fp8_reference_clamps_and_scales():
    x = randn(2, 4, 33, 64, seed=3)
    x[0, 0, 0, :2] = torch.tensor([1e4, -1e4])  # beyond the e4m3 range after scaling
    scale = torch.tensor(0.5, device=DEVICE)
    q, s = quantize_kv_reference(x, "fp8", scale)
    assert q.dtype == torch.float8_e4m3fn and s is scale
    assert q[0, 0, 0, :2].float().tolist() == [448.0, -448.0], "values must saturate at +-448"
    back = dequantize_kv(q, s)[1]
    rel = ((back - x[1]).abs() / x[1].abs().clamp_min(2 ** -6)).max().item()
    assert rel <= 2 ** -4, f"e4m3 keeps 3 mantissa bits: max rel err {rel:.3e}"
    _, s_default = quantize_kv_reference(x, "fp8")
    assert s_default.item() == 1.0 and s_default.dim() == 0


@pytest.mark.parametrize("name", ["bf16", "fp16", "fp32"])
def test_float_caches_are_plain_casts(name):
    x = randn(2, 3, 5, 64, seed=4)
    q, scale = quantize_kv(x, name)
    assert scale is None and torch.equal(q, x.to(KV_CACHE_DTYPES[name]))


def test_cache_dtype_names():
    assert KV_CACHE_DTYPES == {"bf16": torch.bfloat16, "fp16": torch.float16,
                               "fp32": torch.float32, "fp8": torch.float8_e4m3fn, "int8": torch.int8}


def test_cache_dtype_names_agree_with_labkit():
    """kernels/ keeps its own table (it cannot import labkit); it must say what labkit.dtypes says."""
    assert KV_CACHE_DTYPES == TORCH_DTYPES


def test_a_cpu_tensor_without_the_interpreter_is_refused(monkeypatch):
    monkeypatch.setattr(_runtime, "INTERPRETED", False)
    with pytest.raises(ValueError, match=r"quantize_kv: tensors are on cpu; the Triton kernel needs CUDA "
                                         r"tensors or TRITON_INTERPRET=1"):
        quantize_kv(torch.ones(2, 64), "int8", use_triton=True)


@gpu_only("the interpreter's in-kernel fp32 -> fp8 e4m3 cast is wrong for a few % of values")
def test_fp8_kernel_matches_reference():
    x = randn(2, 3, 37, 64, seed=5) * 40
    scale = torch.tensor(0.25, device=DEVICE)
    q, _ = quantize_kv(x, "fp8", scale, use_triton=True)
    q_ref, _ = quantize_kv_reference(x, "fp8", scale)
    err = (q.float() - q_ref.float()).abs()
    torch.testing.assert_close(q.float(), q_ref.float(), **FP8_CODE_TOL, msg=lambda _: (
        f"fp8 codes: max abs err {err.max().item():.3e}, mean {err.mean().item():.3e}"))


@gpu_only("the interpreter's bf16 arithmetic is wrong in triton 3.9 (triton issue #11584)")
def test_int8_kernel_bf16_input():
    check_int8_kernel(randn(2, 3, 37, 64, dtype=torch.bfloat16, seed=6))


@pytest.mark.parametrize("args,match", [
    (("int4",), "cache_dtype 'int4' unknown"),
    ((torch.float64,), "cache_dtype torch.float64 not supported"),
    (("int8", torch.tensor(1.0)), "int8 scales are computed per row"),
    (("fp8", torch.ones(3)), "fp8 scale must be a 0-dim float32 tensor"),
    (("bf16", torch.tensor(1.0)), "scale must be None"),
])
def test_bad_arguments_raise(args, match):
    x = randn(2, 64, device="cpu")
    with pytest.raises(ValueError, match=match):
        quantize_kv(x, *args)


def test_bad_input_dtype_raises():
    with pytest.raises(ValueError, match="x dtype torch.float64 not supported"):
        quantize_kv(torch.ones(2, 64, dtype=torch.float64), "int8")


@pytest.mark.parametrize("dtype", [torch.float16, torch.float32])
def test_a_nan_poisons_its_rows_scale_as_in_the_reference(dtype):
    """tl.max leaves NaNs out: a row holding a NaN got a finite scale and finite codes, so an
    overflow upstream vanished into the cache instead of showing as NaN when it is read back."""
    x = randn(6, 80, dtype=dtype, seed=5) * 3
    x[2, 7] = float("nan")
    q, scale = quantize_kv(x, torch.int8, use_triton=True)
    q_ref, scale_ref = quantize_kv_reference(x, torch.int8)
    assert torch.isnan(scale[2]) and torch.isnan(scale_ref[2])
    assert torch.isnan(dequantize_kv(q, scale)[2]).all()  # read back, the whole row says so
    rest = [0, 1, 3, 4, 5]
    torch.testing.assert_close(q[rest].float(), q_ref[rest].float(), **INT8_CODE_TOL)
    torch.testing.assert_close(scale[rest], scale_ref[rest], **tol(INT8_SCALES))


@gpu_only("the interpreter's in-kernel fp32 -> fp8 e4m3 cast is wrong for a few % of values")
def test_a_nan_stays_nan_in_an_fp8_cache():
    """The saturation to +-448 left NaNs out: a NaN key was stored as -448, a large finite value."""
    x = randn(4, 128, dtype=torch.bfloat16, seed=6)
    x[1, 9] = float("nan")
    q, scale = quantize_kv(x, torch.float8_e4m3fn, torch.tensor(0.5, device=DEVICE), use_triton=True)
    q_ref, _ = quantize_kv_reference(x, torch.float8_e4m3fn, torch.tensor(0.5, device=DEVICE))
    assert torch.isnan(q[1, 9].float()) and torch.isnan(q_ref[1, 9].float())
    assert not torch.isnan(q.float()[torch.arange(4) != 1]).any()
