"""Where the kernels in this package can run, checked the same way by every wrapper.

A Triton kernel runs compiled on CUDA tensors, or in Triton's interpreter (on any tensor) when
TRITON_INTERPRET=1 was set before triton was imported: `triton.jit` reads the variable when a
kernel is defined, which is when this package is imported, so it is read once here, then.

On a GPU, a dtype also needs the generation that has it: bf16 tensor cores came with Ampere
(compute capability 8.0), fp8 e4m3 with Ada (8.9). A wrapper refuses a dtype the GPU lacks with
one line naming what to use instead, before the compiler would fail on it.

kernels/ does not import labkit (labkit imports kernels), so this small check is the kernels'
own; labkit's choice of device and interpreter is `labkit.backend.triton_mode`.
"""
import os

import torch

# Read when the kernel modules import this one, just before their @triton.jit definitions.
INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"

# The oldest compute capability whose tensor cores (bf16) or conversions (fp8 e4m3) Triton uses:
# bf16 mma from sm_80 (A100), fp8 e4m3 from sm_89 (L4, RTX 4090). fp16, fp32 and int8 run on all.
MIN_CAPABILITY = {torch.bfloat16: (8, 0), torch.float8_e4m3fn: (8, 9)}
INSTEAD = {torch.bfloat16: "fp16", torch.float8_e4m3fn: "an int8 cache"}
# Programs per SM the kernels aim for where there is no GPU to ask (the interpreter): small, so
# the tests still exercise several splits.
INTERPRETER_SMS = 4


def check_runnable(tensor: torch.Tensor, name: str) -> None:
    """Raise ValueError, naming the wrapper `name`, unless the kernel can run on `tensor`'s device
    in its dtype."""
    if not tensor.is_cuda and not INTERPRETED:
        raise ValueError(f"{name}: tensors are on {tensor.device}; the Triton kernel needs CUDA tensors "
                         "or TRITON_INTERPRET=1 set before triton is imported")
    check_dtype_supported(tensor, name)


def check_dtype_supported(tensor: torch.Tensor, name: str) -> None:
    """ValueError if `tensor` is on a GPU too old for its dtype (bf16 before sm_80, fp8 before sm_89)."""
    need = MIN_CAPABILITY.get(tensor.dtype)
    if need is None or not tensor.is_cuda:
        return
    have = torch.cuda.get_device_capability(tensor.device)
    if tuple(have) < need:
        raise ValueError(f"{name}: {tensor.dtype} needs a GPU of compute capability {need[0]}.{need[1]} or "
                         f"newer; {torch.cuda.get_device_name(tensor.device)} is {have[0]}.{have[1]}: "
                         f"use {INSTEAD[tensor.dtype]}")


def sm_count(device) -> int:
    """Streaming multiprocessors of a CUDA device; INTERPRETER_SMS elsewhere."""
    device = torch.device(device)
    if device.type != "cuda":
        return INTERPRETER_SMS
    return torch.cuda.get_device_properties(device).multi_processor_count


def capability(device) -> tuple | None:
    """(major, minor) compute capability of a CUDA device; None elsewhere (the interpreter)."""
    device = torch.device(device)
    return tuple(torch.cuda.get_device_capability(device)) if device.type == "cuda" else None


def shared_bytes_per_block(device) -> int | None:
    """The most shared memory one program may use on a CUDA device (the opt-in limit), else None."""
    device = torch.device(device)
    if device.type != "cuda":
        return None
    props = torch.cuda.get_device_properties(device)
    return getattr(props, "shared_memory_per_block_optin", None) or getattr(props, "shared_memory_per_block", None)
