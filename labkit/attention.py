"""Lesson 03's measurements: flash attention against naive attention on fresh random inputs.

    compare_with_reference(heads=4, kv_heads=2, tokens=128, head_dim=64, dtype="fp32")
    memory_sweep([1024, 2048, 4096], heads=2, kv_heads=1, head_dim=64, budget_bytes=2**30)

Naive attention (`naive_attention`) materialises the P x S scores in fp32, with the formulas of
`kernels.flash_attention.attention_reference`. Flash attention is the lab's Triton kernel (on a
CPU in Triton's interpreter, which is slow: keep sizes small there; where Triton is not
installed, macOS and Windows, torch's fused attention stands in and the result says so). For
memory, the CPU path times torch's fused `scaled_dot_product_attention` instead, since the
interpreter is far too slow at long lengths.

Peak memory is measured, not computed:
  * CUDA: `torch.cuda.max_memory_allocated` after resetting the peak, minus what was allocated
    before the call — the most the caching allocator handed out during it;
  * CPU (Linux): the process's peak resident set (VmHWM in /proc/self/status) after resetting it
    through /proc/self/clear_refs, minus the resident set before the call — the most memory the
    process held at once during the call. Memory freed earlier and reused without returning it
    to the OS would not show, so on glibc the measurement first fixes malloc's mmap threshold
    (`mallopt(M_MMAP_THRESHOLD, 128 KiB)`, for this process): every tensor above that size then
    gets fresh pages and gives them back when freed, instead of reusing a freed tensor's.
Time is measured the other way round: on a CPU inside `cpu_memory.reused_memory`, so plain
attention's matrices fault their pages in once, not on every call, as a GPU's caching allocator
serves them. Every size is refused before allocating when its predicted footprint would not fit. kernels/ is
imported where the Triton kernel runs, so importing this module (lesson 03 does) does not wait for
triton, and the CPU path never needs it.
"""
from __future__ import annotations

import functools
import platform
from pathlib import Path

import torch
import torch.nn.functional as F

from . import backend, cpu_memory, measure, roofline
from .dtypes import COMPUTE_DTYPES, torch_dtype
from .errors import FootprintError, LabError
from .specs import BYTES_PER_ELEMENT
from .units import format_bytes

_STATUS = Path("/proc/self/status")


def random_qkv(heads: int, kv_heads: int, tokens: int, head_dim: int, dtype: str, device: str, batch: int = 1):
    """Fresh (unseeded) q [B, H, P, D] and k, v [B, Hkv, P, D] from a standard normal."""
    shapes = ((batch, heads, tokens, head_dim), (batch, kv_heads, tokens, head_dim), (batch, kv_heads, tokens, head_dim))
    return tuple(torch.randn(s, device=device).to(torch_dtype(dtype, COMPUTE_DTYPES)) for s in shapes)


def compare_with_reference(heads: int = 4, kv_heads: int = 2, tokens: int = 128, head_dim: int = 64,
                           dtype: str = "fp32", device: str | None = None, causal: bool = True) -> dict:
    """Run the Triton flash kernel and naive attention on the same fresh inputs; return the
    element-wise absolute differences (a plain list) with their max and mean, and which fused
    kernel ran ("kernel"). Where Triton is not installed (macOS, Windows) torch's fused SDPA
    stands in for the lab's kernel, and "note" says the kernel was skipped, and why."""
    chosen = backend.choose_device(device).device
    fused, kernel, note = _fused_for_check(chosen, dtype)
    q, k, v = random_qkv(heads, kv_heads, tokens, head_dim, dtype, chosen)
    errors = (fused(q, k, v, causal).float() - naive_attention(q, k, v, causal).float()).abs()
    return {"dtype": dtype, "device": chosen, "device_name": backend.device_name(chosen),
            "shape": f"B=1, H={heads}, Hkv={kv_heads}, P=S={tokens}, D={head_dim}", "kernel": kernel, "note": note,
            "max_abs_error": errors.max().item(), "mean_abs_error": errors.mean().item(),
            "abs_errors": errors.flatten().tolist()}


def _fused_for_check(device: str, dtype: str):
    """(fused attention fn(q, k, v, causal), its name, a note or None) for `compare_with_reference`."""
    if not backend.triton_installed():
        return (_sdpa, "torch's fused SDPA",
                f"the lab's Triton kernel was skipped: {backend.TRITON_MISSING}; torch's fused attention "
                "(scaled_dot_product_attention) is compared with naive attention instead")
    how = backend.kernels_run_on(device)
    if how is None:
        raise LabError(f"the Triton kernel cannot run on the {device} here: set TRITON_INTERPRET=1 "
                       "before triton is imported (import labkit does so where it finds no NVIDIA driver)")
    if dtype == "bf16" and how == "interpreter":
        raise LabError("bf16 is not supported by Triton's CPU interpreter; use fp32 or fp16 here")
    from kernels.flash_attention import flash_attention  # triton loads on first use
    return flash_attention, ("compiled Triton" if how == "compiled" else "Triton interpreter"), None


def naive_attention(q, k, v, causal: bool = True):
    """Plain attention that materialises the [B, H, P, S] fp32 scores: q [B, H, P, dh], k, v
    [B, Hkv, S, dh], queries the last P of S positions. The kernels' own torch reference, which
    imports without Triton (macOS, Windows)."""
    from kernels.flash_attention import attention_reference  # triton, where installed: after the interpreter choice
    return attention_reference(q, k, v, causal)


def _sdpa(q, k, v, causal: bool = False):
    """torch's fused attention (flash-style on the CPU: no [P, S] scores in memory); P = S here."""
    return F.scaled_dot_product_attention(q, k, v, is_causal=causal, enable_gqa=True)


def _status_bytes(field: str) -> int:
    for line in _STATUS.read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1]) * 1024  # reported in kB, meaning KiB
    raise LabError(f"/proc/self/status has no {field}")


def _fresh_pages_for_big_allocations():
    """glibc raises its mmap threshold after big frees (up to 32 MiB), so a later tensor can reuse
    resident heap and not show in the resident set; a fixed threshold stops that. And freed heap
    the process keeps resident (`cpu_memory.keep_freed_memory`, once a model was built in it) would
    serve the call's matrices without growing the resident set at all (a peak of 0 bytes measured
    after a lab-tiny prefill in the same process): malloc_trim hands it back first."""
    libc, _ = cpu_memory.glibc()
    if libc is None:  # not glibc: measure as is
        return
    libc.mallopt(cpu_memory.M_MMAP_THRESHOLD, cpu_memory.DEFAULT_MMAP_THRESHOLD_BYTES)
    cpu_memory.hand_back()


def peak_memory_unmeasurable(device: str) -> str | None:
    """Why peak memory cannot be measured on `device` here, or None where it can (CUDA; Linux)."""
    if device == "cuda" or _STATUS.exists():
        return None
    return (f"not measured: a CPU's peak memory is read from Linux's {_STATUS}, "
            f"which {platform.system() or 'this OS'} does not have")


def peak_memory_bytes(fn, device: str) -> tuple[object, int]:
    """Run fn(); return its result and the peak memory gained while it ran (see module doc)."""
    if device == "cuda":
        backend.synchronize(device)
        before = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
        result = fn()
        backend.synchronize(device)
        return result, torch.cuda.max_memory_allocated() - before
    if not _STATUS.exists():
        raise LabError("measuring CPU peak memory needs Linux's /proc/self/status")
    _fresh_pages_for_big_allocations()
    before = _status_bytes("VmRSS")
    Path("/proc/self/clear_refs").write_text("5")  # resets VmHWM to the current resident set
    result = fn()
    return result, max(_status_bytes("VmHWM") - before, 0)


def _flash(q, k, v, device: str):
    """The Triton kernel where it runs compiled; else torch's fused SDPA (the interpreter is far
    too slow at the lengths a memory sweep reaches)."""
    if backend.kernels_run_on(device) == "compiled":
        from kernels.flash_attention import flash_attention  # triton loads on first use
        return flash_attention(q, k, v, causal=False)
    return _sdpa(q, k, v)


@functools.cache
def _pay_first_call_costs(method: str, heads: int, kv_heads: int, head_dim: int, dtype: str, device: str):
    """One call of `method` at 16 tokens, once a process and shape: a process's first attention
    call on a CPU grows its resident set by what every later call reuses (thread pools, the
    products' buffers), which the first measured peak would otherwise count: naive attention at
    P = 2,048 (2 heads, head dim 32, fp32) peaked at 2.21x its two score matrices first in a
    process, 1.02x after (2-core EPYC VM), and 1.03x after this call."""
    q, k, v = random_qkv(heads, kv_heads, 16, head_dim, dtype, device)
    naive_attention(q, k, v, causal=False) if method == "naive" else _flash(q, k, v, device)


def footprint_bytes(method: str, tokens: int, heads: int, head_dim: int, dtype: str) -> float:
    """What one call ("naive" | "flash") over P = S = `tokens` holds beyond its inputs, bytes:
    plain attention its P × P fp32 matrices per head (`roofline.naive_attention_footprint_bytes`),
    the fused kernel only its output [heads, P, head_dim]."""
    if method == "naive":
        return roofline.naive_attention_footprint_bytes(1, heads, tokens, tokens, "fp32")
    return heads * tokens * head_dim * BYTES_PER_ELEMENT[dtype]


def check_footprint(method: str, tokens: int, heads: int, head_dim: int, dtype: str, device: str,
                    budget_bytes: float | None = None) -> float:
    """`footprint_bytes`, after checking it fits `budget_bytes` (if given) and the device's free
    memory: FootprintError, one line, before anything is allocated."""
    predicted = footprint_bytes(method, tokens, heads, head_dim, dtype)
    what = f"{method} attention at P={tokens:,} ({heads} heads)"
    if budget_bytes is not None and predicted > budget_bytes:
        raise FootprintError(f"{what} needs {format_bytes(predicted)}, over the "
                             f"{format_bytes(budget_bytes)} budget; refused before allocating")
    backend.check_fits(predicted, device, what)
    return predicted


def longest_fitting(tokens: list[int], heads: int, head_dim: int, dtype: str, device: str | None = None,
                    budget_bytes: float | None = None, method: str = "naive") -> int:
    """The longest of `tokens` (ascending, as `memory_sweep` takes them) before the first at which
    `method` does not fit (`check_footprint`): where the sweep measured it last. Why: lesson 03's
    question times plain attention; at the sweep's longest length it would run a size the sweep
    had just refused (4 GiB at P = 16,384 on a CPU, past its 0.5 GiB budget; on a GPU, 1.1 TB at
    P = 65,536, which no GPU holds). LabError, one line, where not even the shortest fits."""
    chosen = backend.choose_device(device).device
    longest = None
    for p in tokens:
        try:
            check_footprint(method, p, heads, head_dim, dtype, chosen, budget_bytes)
        except FootprintError:
            break
        longest = p
    if longest is None:
        raise LabError(f"{method} attention does not fit at P={tokens[0]:,} ({heads} heads) on this "
                       f"{chosen}{'' if budget_bytes is None else ' within the budget'}: raise the budget or lower the heads")
    return longest


def memory_point(method: str, tokens: int, heads: int, kv_heads: int, head_dim: int, dtype: str,
                 device: str, budget_bytes: float | None = None) -> dict:
    """Peak memory of one attention call ("naive" | "flash") over P = S = `tokens`, after
    checking its predicted footprint fits (free memory, and `budget_bytes` if given)."""
    predicted = check_footprint(method, tokens, heads, head_dim, dtype, device, budget_bytes)
    _pay_first_call_costs(method, heads, kv_heads, head_dim, dtype, device)
    q, k, v = random_qkv(heads, kv_heads, tokens, head_dim, dtype, device)
    run = (lambda: naive_attention(q, k, v, causal=False)) if method == "naive" else (lambda: _flash(q, k, v, device))
    if method == "flash" and backend.kernels_run_on(device) == "compiled":
        # The autotuner's key is the length's bucket: its first call at a new one benchmarks the
        # tiles, and triton's do_bench allocates a 256 MiB buffer to flush the L2 between them,
        # which the peak would count (8 MiB of output at P = 1,024, 32 heads, D = 128, read as
        # ~264 MiB). Tuned here, outside the measured call.
        run()
    _, peak = peak_memory_bytes(run, device)
    return {"method": method, "tokens": tokens, "peak_bytes": peak, "predicted_bytes": predicted,
            "device": device, "device_name": backend.device_name(device), "dtype": dtype, "heads": heads}


def memory_sweep(tokens: list[int], heads: int, kv_heads: int, head_dim: int, dtype: str, device: str | None = None,
                 budget_bytes: float | None = None, progress=None) -> list[dict]:
    """memory_point for naive and flash at each length. A refused size becomes a record with
    "refused" (the message) and no "peak_bytes"; naive stops at its first refusal. Where peak
    memory cannot be measured (a CPU without Linux's /proc: macOS, Windows) every point is such a
    record, saying why."""
    chosen = backend.choose_device(device).device
    points, stopped = [], set()
    grid = [(p, m) for p in tokens for m in ("naive", "flash")]
    why = peak_memory_unmeasurable(chosen)
    if why is not None:  # macOS, Windows: every point says so, nothing is allocated
        for i, (p, method) in enumerate(grid):
            points.append({"method": method, "tokens": p, "refused": why, "device": chosen,
                           "device_name": backend.device_name(chosen)})
            if progress:
                progress(i + 1, len(grid))
        return points
    for i, (p, method) in enumerate(grid):
        try:
            if method not in stopped:
                points.append(memory_point(method, p, heads, kv_heads, head_dim, dtype, chosen, budget_bytes))
        except FootprintError as err:
            points.append({"method": method, "tokens": p, "refused": str(err), "device": chosen})
            stopped.add(method)
        if progress:
            progress(i + 1, len(grid))
    return points


def time_point(method: str, tokens: int, heads: int, kv_heads: int, head_dim: int, dtype: str,
               device: str) -> dict:
    """Time one attention call ("naive" | "flash") over P = S = `tokens` (full, not causal) with
    the lab's timing: the confirmed fastest call on a CPU, CUDA events on a GPU. Its footprint is
    checked first, as `memory_point` does."""
    check_footprint(method, tokens, heads, head_dim, dtype, device)
    q, k, v = random_qkv(heads, kv_heads, tokens, head_dim, dtype, device)
    run = (lambda: naive_attention(q, k, v, causal=False)) if method == "naive" else (lambda: _flash(q, k, v, device))
    if device == "cuda":
        timing = measure.time_fn(run, device, 2, 10, 2.0)
    else:
        with cpu_memory.reused_memory():  # its matrices' pages faulted in once, not every call
            timing = measure.time_on_a_quiet_cpu(run, 2.0, 5.0)
    return {"method": method, "tokens": tokens, "time_s": timing.estimate_s, "noisy": timing.noisy,
            "device": device, "device_name": backend.device_name(device), "dtype": dtype, "heads": heads,
            # what a reveal says of the machine's load while it was timed (`predict._busy_share`)
            "others_busy_share": timing.others_busy_share, "disturbed": timing.disturbed}

