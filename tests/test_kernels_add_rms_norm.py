"""kernels.add_rms_norm (a residual add and the RMSNorm after it, one kernel) against its
reference and against the two torch ops it replaces (labkit.layer_math.rms_norm)."""
import pytest
import torch

from labkit.backend import TRITON_MISSING, triton_installed

if not triton_installed():  # macOS, Windows: no wheels; every kernel module imports triton
    pytest.skip(f"skipped: {TRITON_MISSING}", allow_module_level=True)

from kernel_util import DEVICE, FLOAT_TOL, gpu_only, needs_cuda_or_interpreter  # noqa: E402
from kernels.add_rms_norm import add_rms_norm, add_rms_norm_reference  # noqa: E402
from labkit.layer_math import rms_norm  # noqa: E402

pytestmark = needs_cuda_or_interpreter


def make_case(R, N, dtype, seed=0):
    g = torch.Generator().manual_seed(seed)
    x, delta = ((torch.randn(R, N, generator=g) * 3).to(DEVICE, dtype) for _ in range(2))
    weight = (1 + 0.2 * torch.randn(N, generator=g)).to(DEVICE, dtype)
    return x, delta, weight


def check(got, want, dtype, what):
    for name, a, b in zip(("sum", "normed"), got, want):
        assert a.shape == b.shape and a.dtype == b.dtype, f"{what}, {name}: {a.shape} {a.dtype}"
        err = (a.float() - b.float()).abs()
        torch.testing.assert_close(a.float(), b.float(), **FLOAT_TOL[dtype], msg=lambda _: (
            f"{what}, {name}: max abs err {err.max().item():.3e}, mean {err.mean().item():.3e}"))


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("R,N", [(3, 256), (5, 96)])  # 96: a row not a power of two
@pytest.mark.parametrize("with_delta", [True, False])
def test_kernel_matches_reference_and_the_torch_ops(dtype, R, N, with_delta):
    x, delta, weight = make_case(R, N, dtype, seed=N)
    delta = delta if with_delta else None
    before = x.clone()
    got = add_rms_norm(x, delta, weight, 1e-5)
    check(got, add_rms_norm_reference(x, delta, weight, 1e-5), dtype, f"{dtype}, {R}x{N}")
    total = x if delta is None else x + delta  # the two torch ops the model ran before
    check(got, (total, rms_norm(total, weight, 1e-5)), dtype, f"{dtype}, {R}x{N} vs layer_math")
    assert torch.equal(x, before), "x must not be modified"


def test_strided_rows_are_read_where_they_are():
    """Prefill's last position, x[:, -1] of [B, P, d]: a row stride of P * d."""
    x, _, weight = make_case(8, 64, torch.float32)
    rows = x.view(2, 4, 64)[:, -1]  # [2, 64], row stride 256
    check(add_rms_norm(rows, None, weight, 1e-6), add_rms_norm_reference(rows, None, weight, 1e-6),
          torch.float32, "strided rows")


@gpu_only("the interpreter's bf16 arithmetic is wrong in triton 3.9 (triton issue #11584)")
def test_bf16_on_a_gpu():
    x, delta, weight = make_case(16, 4096, torch.bfloat16)
    check(add_rms_norm(x, delta, weight, 1e-5), add_rms_norm_reference(x, delta, weight, 1e-5),
          torch.bfloat16, "bf16, the 8B's hidden size")


@pytest.mark.parametrize("change,match", [
    (lambda x, d, w: (x[None], d, w), r"x must be \[R, N\]"),
    (lambda x, d, w: (x, d[:, :-1], w), "delta must match x"),
    (lambda x, d, w: (x, d, w[:-1]), r"weight must be \[64\]"),
])
def test_bad_arguments_are_refused_in_one_line(change, match):
    with pytest.raises(ValueError, match=match):
        add_rms_norm(*change(*make_case(2, 64, torch.float32)), 1e-5)
