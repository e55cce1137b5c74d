"""What the kernel tests share: the device, the interpreter check, the float tolerances and the
`gpu_only` mark. TRITON_INTERPRET is set by conftest.py (no NVIDIA driver: Triton's interpreter),
before any test module imports triton."""
from __future__ import annotations

import os

import pytest
import torch

CUDA = torch.cuda.is_available()
DEVICE = "cuda" if CUDA else "cpu"

# For a module's `pytestmark`: without CUDA the kernels run only in the interpreter.
needs_cuda_or_interpreter = pytest.mark.skipif(
    not CUDA and os.environ.get("TRITON_INTERPRET") != "1",
    reason="no CUDA and TRITON_INTERPRET was not set before triton import")

# Kernel and reference both accumulate in fp32 and round once (or, in the attention kernels,
# also round the probabilities to the input dtype before p @ v), so they differ by accumulation
# order plus an ulp or so of the dtype: ~1e-7 relative for fp32, 2**-11 for fp16, 2**-8 for bf16.
# Outputs are O(1), so atol and rtol are alike. Each module says why these fit its kernel.
FLOAT_TOL = {
    torch.float32: dict(atol=1e-4, rtol=1e-4),
    torch.float16: dict(atol=2e-3, rtol=2e-3),
    torch.bfloat16: dict(atol=1.6e-2, rtol=1.6e-2),
}


def gpu_only(reason):
    """Mark a test `gpu` and skip it without CUDA; `reason` says why the interpreter can't run it."""
    def mark(fn):
        return pytest.mark.gpu(pytest.mark.skipif(not CUDA, reason=f"needs CUDA: {reason}")(fn))
    return mark
