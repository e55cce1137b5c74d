"""Dtype names, the one place they become torch dtypes.

The lab speaks of dtypes by name everywhere a person sees them (sliders, the CLI, recordings):
"fp32", "bf16", "fp16" for computing, and those plus "fp8" (e4m3) and "int8" for a KV cache.
Every module that needs the torch dtype behind a name asks `torch_dtype` here, so a name the lab
does not know is refused once, with the list of names it does.
"""
from __future__ import annotations

import torch

from .errors import LabError

TORCH_DTYPES: dict[str, torch.dtype] = {
    "fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16,
    "fp8": torch.float8_e4m3fn,  # e4m3: the KV-cache format of the chapter and of the lab's kernels
    "int8": torch.int8,
}
COMPUTE_DTYPES = ("fp32", "bf16", "fp16")  # what matmuls compute in
CACHE_DTYPES = tuple(TORCH_DTYPES)  # what a KV cache may store


def torch_dtype(name: str, allowed: tuple[str, ...] = CACHE_DTYPES) -> torch.dtype:
    """The torch dtype called `name`; LabError, listing `allowed`, for any other name."""
    if name not in allowed:
        raise LabError(f"unknown dtype {name!r}; known: {', '.join(allowed)}")
    return TORCH_DTYPES[name]


def dtype_name(dtype: torch.dtype) -> str:
    """The lab's name for a torch dtype (the inverse of `torch_dtype`)."""
    for name, value in TORCH_DTYPES.items():
        if value == dtype:
            return name
    raise LabError(f"the lab has no name for {dtype}; known: {', '.join(TORCH_DTYPES)}")


def with_article(name: str) -> str:
    """A dtype's name after its article as it is read aloud, letter by letter: "an fp32", "an
    int8", "a bf16" (a name starting with a letter whose name starts with a vowel sound takes "an")."""
    return f"{'an' if name[:1].lower() in 'aefhilmnorsx' else 'a'} {name}"
