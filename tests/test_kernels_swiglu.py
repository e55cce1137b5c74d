"""kernels.swiglu (the MLP's gate, silu(gate) * up, one kernel) against its reference, the two
torch ops it replaces (labkit.layer_math.swiglu)."""
import pytest
import torch

from labkit.backend import TRITON_MISSING, triton_installed

if not triton_installed():  # macOS, Windows: no wheels; every kernel module imports triton
    pytest.skip(f"skipped: {TRITON_MISSING}", allow_module_level=True)

from kernel_util import DEVICE, FLOAT_TOL, gpu_only, needs_cuda_or_interpreter  # noqa: E402
from kernels.swiglu import BLOCK_F, swiglu, swiglu_reference  # noqa: E402
from labkit.layer_math import swiglu as torch_swiglu  # noqa: E402

pytestmark = needs_cuda_or_interpreter


def make_case(R, F, dtype, seed=0, pad=0):
    """gate_up [R, 2 F] of values from about -8 to 8 (silu's bend and both tails), in rows `pad`
    values longer than 2 F (a strided view, as a bigger product's slice would be)."""
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(R, 2 * F + pad, generator=g) * 3).to(DEVICE, dtype)[:, :2 * F]


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("R,F", [(3, 256), (5, 96), (2, BLOCK_F + 40)])  # 96: not a power of two; past one block
@pytest.mark.parametrize("pad", [0, 8])
def test_kernel_matches_reference_and_the_torch_ops(dtype, R, F, pad):
    gate_up = make_case(R, F, dtype, seed=F + pad, pad=pad)
    before = gate_up.clone()
    got = swiglu(gate_up)
    assert got.shape == (R, F) and got.dtype == dtype
    torch.testing.assert_close(got.float(), swiglu_reference(gate_up).float(), **FLOAT_TOL[dtype])
    gate, up = gate_up.chunk(2, dim=-1)
    torch.testing.assert_close(got.float(), torch_swiglu(gate.clone(), up).float(), **FLOAT_TOL[dtype])
    assert torch.equal(gate_up, before), "the kernel wrote into its input"


@gpu_only("the interpreter's bf16 arithmetic is wrong in triton 3.9 (triton issue #11584)")
def test_bf16_on_a_gpu():
    gate_up = make_case(64, 14336, torch.bfloat16)
    torch.testing.assert_close(swiglu(gate_up).float(), swiglu_reference(gate_up).float(), **FLOAT_TOL[torch.bfloat16])


def test_no_rows_is_no_launch_and_bad_shapes_are_refused_in_one_line():
    assert swiglu(make_case(0, 64, torch.float32)).shape == (0, 64)
    with pytest.raises(ValueError, match=r"gate_up must be \[R, 2 F\] with unit column stride; got shape \(3, 7\)"):
        swiglu(torch.zeros(3, 7, device=DEVICE))
    with pytest.raises(ValueError, match="unit column stride"):
        swiglu(make_case(4, 8, torch.float32).t())
