"""Where the kernels in this package can run, checked the same way by every wrapper.

A Triton kernel runs compiled on CUDA tensors, or in Triton's interpreter (on any tensor) when
TRITON_INTERPRET=1 was set before triton was imported: `triton.jit` reads the variable when a
kernel is defined, which is when this package is imported, so it is read once here, then.

kernels/ does not import labkit (labkit imports kernels), so this small check is the kernels'
own; labkit's choice of device and interpreter is `labkit.backend.triton_mode`.
"""
import os

import torch

# Read when the kernel modules import this one, just before their @triton.jit definitions.
INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"


def check_runnable(tensor: torch.Tensor, name: str) -> None:
    """Raise ValueError, naming the wrapper `name`, unless the kernel can run on `tensor`'s device."""
    if not tensor.is_cuda and not INTERPRETED:
        raise ValueError(f"{name}: tensors are on {tensor.device}; the Triton kernel needs CUDA tensors "
                         "or TRITON_INTERPRET=1 set before triton is imported")
