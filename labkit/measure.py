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

`isolate=True` times a kernel's GPU work alone, for the GPU check: a short call (under
CUDA_MIN_SAMPLE_S) is replayed from a CUDA graph of many launches (`triton.testing.
do_bench_cudagraph`), so no host cost (argument checks, allocations, Triton's argument binding:
~50 us per decode_attention call, more than the kernel at B=1) reaches the timing; a call whose
working set is under roofline.L2_FLUSH_FACTOR x the L2 has the L2 flushed before each call
(`triton.testing.do_bench`, which does it), so it is read from HBM as in a real model step. A
short call with a small working set gets both: a graph of (flush, call) pairs, less a graph of
the flushes alone, since neither helper does both. `cuda_plan` makes the choice; the Timing
names it (`method`, `l2_flushed`).

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
                     call_seconds, quiet_wait_s, sample_until_stable, time_on_a_quiet_cpu, time_until_stable,
                     wait_for_quiet)
from .units import format_rate, format_seconds  # noqa: F401 — re-exported: callers import them from here

# On CUDA a call shorter than this is timed as the mean of back-to-back calls between one pair of
# events (at most MAX_CALLS_PER_SAMPLE): a single short call's events also catch the host's launch
# work and the synchronisation before it, tens of microseconds that a 30 us kernel does not spend.
CUDA_MIN_SAMPLE_S = 1e-3
MAX_CALLS_PER_SAMPLE = 100
GRAPH_CALLS = 20  # launches per graph sample (isolate=True, a short call with a small working set)


def time_fn(fn: Callable[[], object], device, warmup: int = 2, repeats: int = 5,
            budget_s: float | None = None, isolate: bool = False,
            working_set_bytes: float | None = None) -> Timing:
    """Call `fn` `warmup` times untimed (compilation, caches, allocator), then take up to
    `repeats` samples. Once `budget_s` of wall time (warm-up included) is spent, stop, but keep
    at least MIN_SAMPLES samples (or `repeats`, if fewer were asked for).

    A sample is one call, except on CUDA for a call under CUDA_MIN_SAMPLE_S: then it is the mean
    of enough back-to-back calls to last that long (one more untimed call measures it). With
    `isolate` on CUDA, `cuda_plan` decides instead (see the module docstring); `working_set_bytes`
    is what the call reads and writes, for the L2 rule."""
    if warmup < 0 or repeats < 1:
        raise LabError(f"need warmup >= 0 and repeats >= 1, got warmup={warmup}, repeats={repeats}")
    cuda = torch.device(getattr(device, "device", device)).type == "cuda"
    start_s = time.perf_counter()
    for _ in range(warmup):
        fn()
    calls = 1
    if cuda:
        backend.synchronize(device)
        call_s = _cuda_calls_s(fn, 1)[0]
        if isolate:
            plan = cuda_plan(call_s, working_set_bytes, l2_bytes(device))
            return _isolated(fn, plan, repeats, budget_s)
        calls = min(MAX_CALLS_PER_SAMPLE, max(1, math.ceil(CUDA_MIN_SAMPLE_S / call_s)))
    samples_s, host_s = [], []
    while len(samples_s) < repeats:
        if cuda:
            gpu_s, issue_s = _cuda_calls_s(fn, calls)
            samples_s.append(gpu_s / calls)
            host_s.append(issue_s / calls)
        else:
            samples_s.append(call_seconds(fn))
        spent_s = time.perf_counter() - start_s
        if budget_s is not None and spent_s >= budget_s and len(samples_s) >= MIN_SAMPLES:
            break
    return Timing(tuple(samples_s), calls, tuple(host_s), method="events" if cuda else None,
                  l2_flushed=False if cuda else None)


def l2_resident(working_set_bytes: float | None, l2: float | None) -> bool | None:
    """roofline.l2_resident (under L2_FLUSH_FACTOR x the L2: an H100's is 50 MiB, an fp8 cache at
    B=1, S=16k reads 32 MiB), or None where the working set or the L2 is unknown."""
    if working_set_bytes is None or not l2:
        return None
    return roofline.l2_resident(working_set_bytes, l2)


def cuda_plan(call_s: float, working_set_bytes: float | None, l2: float | None) -> dict:
    """How isolate=True times a CUDA call: "graph" (launch cost out) for a call under
    CUDA_MIN_SAMPLE_S, "flush" for an L2-resident working set, and the method's name."""
    graph, flush = call_s < CUDA_MIN_SAMPLE_S, bool(l2_resident(working_set_bytes, l2))
    method = {(True, True): "cuda graph of (L2 flush, call) pairs, flushes subtracted",
              (True, False): "cuda graph (triton.testing.do_bench_cudagraph)",
              (False, True): "events, L2 flushed before each call (triton.testing.do_bench)",
              (False, False): "events"}[graph, flush]
    return {"graph": graph, "flush": flush, "method": method}


def l2_bytes(device) -> int | None:
    """The CUDA device's L2 size as it reports it, or None."""
    index = torch.device(getattr(device, "device", device)).index or 0
    return getattr(torch.cuda.get_device_properties(index), "L2_cache_size", None) or None


def _isolated(fn, plan: dict, repeats: int, budget_s: float | None) -> Timing:
    """Samples of `fn`'s GPU time per call by `plan` (cuda_plan). Triton's helpers return
    milliseconds; `rep` is the wall time each may spend, from the budget."""
    from triton import testing  # the GPU path only: triton after the interpreter choice
    rep_ms = max(20, int(1e3 * (budget_s or 1.0) / 2))
    if plan["graph"] and plan["flush"]:
        samples_s, calls = _graph_flush_samples_s(fn, max(repeats, MIN_SAMPLES)), GRAPH_CALLS
    elif plan["graph"]:
        samples_s, calls = [ms / 1e3 for ms in testing.do_bench_cudagraph(fn, rep=rep_ms, return_mode="all")], 0
    elif plan["flush"]:
        samples_s, calls = [ms / 1e3 for ms in testing.do_bench(fn, warmup=0, rep=rep_ms, return_mode="all")], 1
    else:
        samples_s, calls = [_cuda_calls_s(fn, 1)[0] for _ in range(max(repeats, MIN_SAMPLES))], 1
    positive = tuple(s for s in samples_s if s > 0)
    if not positive:  # the flushes' own time, subtracted, swamped the call's
        raise LabError(f"could not time the call by {plan['method']}: every sample was <= 0 s")
    return Timing(positive, max(calls, 1), (), method=plan["method"], l2_flushed=plan["flush"])


def _graph_flush_samples_s(fn, samples: int) -> list[float]:
    """Per sample: one replay of a graph of GRAPH_CALLS (flush, fn) pairs minus one of the flushes
    alone, over GRAPH_CALLS. The flush writes a buffer as large as triton's do_bench uses."""
    from triton import runtime  # the GPU path only: triton after the interpreter choice
    cache = runtime.driver.active.get_empty_cache_for_benchmark()
    both, flushes = torch.cuda.CUDAGraph(), torch.cuda.CUDAGraph()
    stream = torch.cuda.Stream()
    with torch.cuda.stream(stream):
        with torch.cuda.graph(both, stream=stream):
            for _ in range(GRAPH_CALLS):
                cache.zero_()
                fn()
        with torch.cuda.graph(flushes, stream=stream):
            for _ in range(GRAPH_CALLS):
                cache.zero_()
    torch.cuda.synchronize()
    out = []
    for _ in range(samples):
        with_calls, alone = _replay_s(both), _replay_s(flushes)
        out.append((with_calls - alone) / GRAPH_CALLS)
    return out


def _replay_s(graph) -> float:
    """GPU seconds of one replay of a CUDA graph, between two events."""
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    graph.replay()
    end.record()
    end.synchronize()
    return start.elapsed_time(end) / 1e3


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
    if isinstance(timing, Timing) and (timing.noisy or timing.estimator == "fastest"):
        line += f" ({timing.how_timed})"
    return line
