"""The GPU's own time in one step, by kind of work, from torch's profiler: the breakdown's parts on CUDA.

    seconds, kernels = seconds_by_category(lambda: model.decode_step(tokens), steps=3)
    seconds    # {"products": 2.1e-3, "attention": 4.0e-4, "other": 3.0e-4}: GPU seconds a step
    kernels    # [{"name", "category", "time_s", "calls_per_step"}, ...] a step, the longest first

Why a profiler and not the CPU's timer (`clock`): on CUDA a host bracket around a call times its
launch, not the GPU's work, and the decode step is one replayed CUDA graph with nothing between
its kernels to bracket. The profiler (CUPTI) records each kernel's start and end on the GPU, inside
a replayed graph too (the H200 profile of the 8B's graphed step listed its 129 split-K products,
`data/recordings/gpu-tune-h200-20261204-1751.json`), so the step runs exactly as it always does.

Each kernel falls into a category by its name (`category_of`): the lab's Triton kernels by their
function names, torch's and cuBLAS's by the words their names carry. What no rule names counts
as "other" (norms, RoPE, SiLU, residual adds, cache writes, copies), as the CPU's clock counts it.
"""
from __future__ import annotations

import torch

# (category, name fragments), first match wins: attention before products, since an attention
# kernel's name can carry a GEMM library's words (cutlass's fused attention).
KERNEL_RULES = (
    ("attention", ("_flash_attention_kernel", "_decode_split_kernel", "_decode_combine_kernel",  # kernels/
                   "flash_fwd", "fmha", "attention", "softmax")),  # torch's SDPA and plain attention
    ("products", ("_matmul_kernel", "_matmul_split_k_kernel", "_split_k_sum_kernel",  # kernels/matmul.py
                  "gemm", "gemv", "cutlass", "xmma", "nvjet", "cublas")),  # cuBLAS's products (torch ops)
)


def category_of(kernel_name: str) -> str:
    """"products", "attention" or "other" for a GPU kernel's name (`KERNEL_RULES`)."""
    name = kernel_name.lower()
    for category, fragments in KERNEL_RULES:
        if any(f.lower() in name for f in fragments):
            return category
    return "other"


def seconds_by_category(step, steps: int = 3) -> tuple[dict, list]:
    """({category: GPU seconds a step}, [each kernel's name, category, seconds and calls a step,
    the longest first]) over `steps` calls of `step()` under torch's profiler, after one untimed
    call. A profiler that records no kernel (no CUPTI, or not allowed to read the counters) gives
    empty results: the caller says so rather than report zeros."""
    from torch.profiler import ProfilerActivity, profile  # loads the profiler only where a GPU breakdown runs

    step()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(steps):
            step()
        torch.cuda.synchronize()
    kernels = []
    for event in prof.key_averages():
        # torch >= 2.4 names it device_time_total (us); older, cuda_time_total
        us = getattr(event, "device_time_total", None) or getattr(event, "cuda_time_total", 0)
        if us > 0 and not event.key.startswith("cuda"):  # (not a runtime call: cudaGraphLaunch, ...)
            kernels.append({"name": event.key, "category": category_of(event.key),
                            "time_s": us * 1e-6 / steps, "calls_per_step": event.count / steps})
    kernels.sort(key=lambda k: -k["time_s"])
    seconds = {}
    for k in kernels:
        seconds[k["category"]] = seconds.get(k["category"], 0.0) + k["time_s"]
    return seconds, kernels
