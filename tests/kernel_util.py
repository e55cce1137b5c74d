"""What the kernel tests share: the device, whether the kernels can run, the tolerances and the
`gpu_only` mark. TRITON_INTERPRET is set by conftest.py (no NVIDIA driver: Triton's interpreter),
before any test module imports triton; where the kernels run is `labkit.backend.triton_mode`'s
answer, as for the lessons and the GPU check. Tolerances come from kernels/tolerances.py, the
table the GPU check's correctness section reads too."""
from __future__ import annotations

import pytest
import torch

from kernels import tolerances
from labkit import backend
from labkit.dtypes import dtype_name

MODE = backend.triton_mode()  # "compiled" | "interpreter" | "none"
CUDA = MODE == "compiled"  # the kernels run compiled on a GPU (not in the interpreter)
DEVICE = backend.kernel_device() or "cpu"

# For a module's `pytestmark`: without CUDA the kernels run only in the interpreter.
needs_cuda_or_interpreter = pytest.mark.skipif(
    MODE == "none", reason="no CUDA and TRITON_INTERPRET was not set before triton import")


def tol(atol_rtol: tuple[float, float]) -> dict:
    """kernels.tolerances' (atol, rtol) as keyword arguments of torch.testing.assert_close."""
    atol, rtol = atol_rtol
    return dict(atol=atol, rtol=rtol)


# Matmul, flash attention and decode attention over float caches, by torch dtype (see
# kernels/tolerances.py for why each number fits).
FLOAT_TOL = {dtype: tol(tolerances.float_tolerance(dtype_name(dtype)))
             for dtype in (torch.float32, torch.float16, torch.bfloat16)}


def gpu_only(reason):
    """Mark a test `gpu` and skip it unless the kernels run compiled on CUDA; `reason` says why
    the interpreter can't run it."""
    def mark(fn):
        return pytest.mark.gpu(pytest.mark.skipif(not CUDA, reason=f"needs CUDA: {reason}")(fn))
    return mark
