"""The timing harness: warm up, time several calls, report a robust estimate and how noisy the
calls were, and put the roofline's bound beside what was achieved.

    timing = time_fn(lambda: model(tokens), "cuda", warmup=2, repeats=5)
    print(format_bound_line(flops, bytes_moved, timing, get_gpu("H100-SXM")))
    # predicted 12.1 ms (memory-bound at 3.35 TB/s), measured 13.0 ms = 0.93 of roof

On CUDA each call is bracketed by a pair of CUDA events, which time the GPU's own work
without the Python launch overhead between calls; a call under a millisecond is timed as the
mean of back-to-back calls between one pair, so the host's launch work overlaps the GPU's as it
does in a real program. On the CPU, PyTorch runs synchronously and `time.perf_counter`
brackets the call.

On a CPU under load, `timing.time_until_stable` (re-exported here) takes the confirmed fastest
call instead; `timing` holds the statistics of a list of samples.
"""
from __future__ import annotations

import math
import time
from typing import Callable

import torch

from . import backend, roofline
from .errors import LabError
from .specs import HardwareSpec
from .timing import (CONFIRM_TOLERANCE, MIN_SAMPLES, NOISY_SPREAD, Timing,  # noqa: F401 — re-exported
                     _cpu_call_s, sample_until_stable, time_until_stable)
from .units import format_rate, format_seconds  # noqa: F401 — re-exported: callers import them from here

# On CUDA a call shorter than this is timed as the mean of back-to-back calls between one pair of
# events (at most MAX_CALLS_PER_SAMPLE): a single short call's events also catch the host's launch
# work and the synchronisation before it, tens of microseconds that a 30 us kernel does not spend.
CUDA_MIN_SAMPLE_S = 1e-3
MAX_CALLS_PER_SAMPLE = 100


def time_fn(fn: Callable[[], object], device, warmup: int = 2, repeats: int = 5,
            budget_s: float | None = None) -> Timing:
    """Call `fn` `warmup` times untimed (compilation, caches, allocator), then take up to
    `repeats` samples. Once `budget_s` of wall time (warm-up included) is spent, stop, but keep
    at least MIN_SAMPLES samples (or `repeats`, if fewer were asked for).

    A sample is one call, except on CUDA for a call under CUDA_MIN_SAMPLE_S: then it is the mean
    of enough back-to-back calls to last that long (one more untimed call measures it)."""
    if warmup < 0 or repeats < 1:
        raise LabError(f"need warmup >= 0 and repeats >= 1, got warmup={warmup}, repeats={repeats}")
    cuda = torch.device(getattr(device, "device", device)).type == "cuda"
    start_s = time.perf_counter()
    for _ in range(warmup):
        fn()
    calls = 1
    if cuda:
        backend.synchronize(device)
        calls = min(MAX_CALLS_PER_SAMPLE, max(1, math.ceil(CUDA_MIN_SAMPLE_S / _cuda_calls_s(fn, 1)[0])))
    samples_s, host_s = [], []
    while len(samples_s) < repeats:
        if cuda:
            gpu_s, issue_s = _cuda_calls_s(fn, calls)
            samples_s.append(gpu_s / calls)
            host_s.append(issue_s / calls)
        else:
            samples_s.append(_cpu_call_s(fn))
        spent_s = time.perf_counter() - start_s
        if budget_s is not None and spent_s >= budget_s and len(samples_s) >= MIN_SAMPLES:
            break
    return Timing(tuple(samples_s), calls, tuple(host_s))


def _cuda_calls_s(fn, calls: int) -> tuple[float, float]:
    """(GPU seconds between one pair of CUDA events around `calls` back-to-back calls, host
    seconds spent issuing them)."""
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    issue_s = time.perf_counter()
    start.record()
    for _ in range(calls):
        fn()
    end.record()
    issue_s = time.perf_counter() - issue_s
    end.synchronize()  # wait for the GPU to finish before reading the events
    return start.elapsed_time(end) / 1e3, issue_s  # elapsed_time is in milliseconds


def _seconds(timing: Timing | float) -> float:
    """A Timing's estimate, or a plain number of seconds."""
    return timing.estimate_s if isinstance(timing, Timing) else float(timing)


def achieved(flops: float, bytes_moved: float, timing: Timing | float) -> dict:
    """Rates reached at the measured time (a Timing's estimate): FLOPs and bytes moved per second."""
    time_s = _seconds(timing)
    return {"time_s": time_s, "achieved_flops_per_s": flops / time_s,
            "achieved_bytes_per_s": bytes_moved / time_s}


def roof_fraction(flops: float, bytes_moved: float, timing: Timing | float, hardware: HardwareSpec,
                  dtype: str = "bf16") -> float:
    """How close the run came to its roof: achieved FLOP/s over the `dtype` peak for a
    compute-bound operation, achieved bytes/s over the bandwidth for a memory-bound one.
    Equals the roofline's time over the measured time; 1.0 is the ceiling."""
    rates = achieved(flops, bytes_moved, timing)
    if roofline.bound_by(flops, bytes_moved, hardware, dtype) == "compute":
        return rates["achieved_flops_per_s"] / hardware.peak_flops_per_s(dtype)
    return rates["achieved_bytes_per_s"] / hardware.memory_bandwidth_bytes_per_s


def format_bound_line(flops: float, bytes_moved: float, timing: Timing | float, hardware: HardwareSpec,
                      dtype: str = "bf16") -> str:
    """One line with the roofline's prediction beside the measurement, e.g.
    "predicted 12.1 ms (memory-bound at 9.4 GB/s), measured 13.0 ms = 0.93 of roof"."""
    predicted_s = roofline.roofline_time_s(flops, bytes_moved, hardware, dtype)
    if roofline.bound_by(flops, bytes_moved, hardware, dtype) == "compute":
        roof = f"compute-bound at {format_rate(hardware.peak_flops_per_s(dtype), 'FLOP/s')} {dtype}"
    else:
        roof = f"memory-bound at {format_rate(hardware.memory_bandwidth_bytes_per_s, 'B/s')}"
    fraction = roof_fraction(flops, bytes_moved, timing, hardware, dtype)
    line = (f"predicted {format_seconds(predicted_s)} ({roof}), "
            f"measured {format_seconds(_seconds(timing))} = {fraction:.2f} of roof")
    if isinstance(timing, Timing) and timing.noisy:
        line += f" (noisy: spread {timing.spread:.0%} over {len(timing.samples_s)} samples)"
    elif isinstance(timing, Timing) and timing.estimator == "fastest":
        line += f" (fastest of {len(timing.samples_s)} calls, spread {timing.spread:.0%})"
    return line
