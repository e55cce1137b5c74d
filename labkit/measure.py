"""The timing harness: warm up, time several calls, report the median and how noisy it was,
and put the roofline's bound beside what was achieved.

    timing = time_fn(lambda: model(tokens), "cuda", warmup=2, repeats=5)
    print(format_bound_line(flops, bytes_moved, timing, get_gpu("H100-SXM")))
    # predicted 12.1 ms (memory-bound at 3.35 TB/s), measured 13.0 ms = 0.93 of roof

On CUDA each call is bracketed by a pair of CUDA events, which time the GPU's own work
without the Python launch overhead between calls; a call under a millisecond is timed as the
mean of back-to-back calls between one pair, so the host's launch work overlaps the GPU's as it
does in a real program. On the CPU, PyTorch runs synchronously and `time.perf_counter`
brackets the call.
"""
from __future__ import annotations

import math
import statistics
import time
from dataclasses import dataclass
from typing import Callable

import torch

from . import roofline
from .errors import LabError
from .specs import HardwareSpec

# A run whose samples spread by more than a quarter of their median is flagged noisy: another
# process, frequency scaling or a cold cache moved the result more than a lesson claim can bear.
NOISY_SPREAD = 0.25
MIN_SAMPLES = 3  # a budget stops timing early, but never below this many samples
# On CUDA a call shorter than this is timed as the mean of back-to-back calls between one pair of
# events (at most MAX_CALLS_PER_SAMPLE): a single short call's events also catch the host's launch
# work and the synchronisation before it, tens of microseconds that a 30 us kernel does not spend.
CUDA_MIN_SAMPLE_S = 1e-3
MAX_CALLS_PER_SAMPLE = 100
# On CUDA, a run whose host spent at least this fraction of the GPU's time just issuing the work
# was host-bound: the GPU waited for Python to launch kernels, so its time says how fast the host
# launches, not how fast the GPU computes or reads (a decode step of many small kernels at batch 1).
HOST_BOUND_FRACTION = 0.9
# From this many samples on, `spread` uses the 10th-90th percentile range, which one outlier
# cannot move; below it those percentiles are mere interpolations of the extremes.
PERCENTILE_SAMPLES = 10


@dataclass(frozen=True)
class Timing:
    """Seconds per call for each timed call; the statistics are computed, never stored."""

    samples_s: tuple[float, ...]
    calls_per_sample: int = 1  # >1: each sample is the mean of that many back-to-back calls (CUDA)
    host_s: tuple[float, ...] = ()  # CUDA: per call, the host's time to issue it (launches, Python)

    def __post_init__(self):
        # NaN passes `<= 0` and inf would make the median and spread meaningless: refuse both.
        if not self.samples_s or not all(math.isfinite(s) and s > 0 for s in self.samples_s):
            raise LabError(f"a Timing needs positive, finite samples, got {self.samples_s!r}")

    @property
    def median_s(self) -> float:
        return statistics.median(self.samples_s)

    @property
    def host_bound(self) -> bool | None:
        """CUDA: did issuing the work take (nearly) as long as the GPU's time for it? None on
        the CPU, where the host does the work itself."""
        if not self.host_s:
            return None
        return statistics.median(self.host_s) >= HOST_BOUND_FRACTION * self.median_s

    @property
    def min_s(self) -> float:
        return min(self.samples_s)

    @property
    def max_s(self) -> float:
        return max(self.samples_s)

    @property
    def spread(self) -> float:
        """Relative spread: (p90 - p10) / median from PERCENTILE_SAMPLES samples on,
        else (max - min) / median. 0 for a single sample."""
        if len(self.samples_s) >= PERCENTILE_SAMPLES:
            deciles = statistics.quantiles(self.samples_s, n=10, method="inclusive")
            return (deciles[-1] - deciles[0]) / self.median_s
        return (self.max_s - self.min_s) / self.median_s

    @property
    def noisy(self) -> bool:
        return self.spread > NOISY_SPREAD

    def to_dict(self) -> dict:
        """JSON-ready summary, units in the keys."""
        return {"median_s": self.median_s, "min_s": self.min_s, "max_s": self.max_s,
                "spread": self.spread, "noisy": self.noisy, "samples_s": list(self.samples_s),
                "calls_per_sample": self.calls_per_sample,
                "host_median_s": statistics.median(self.host_s) if self.host_s else None,
                "host_bound": self.host_bound}


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
        torch.cuda.synchronize()
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


def _cpu_call_s(fn) -> float:
    start_s = time.perf_counter()
    fn()
    return time.perf_counter() - start_s


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
    """A Timing's median, or a plain number of seconds."""
    return timing.median_s if isinstance(timing, Timing) else float(timing)


def achieved(flops: float, bytes_moved: float, timing: Timing | float) -> dict:
    """Rates reached at the median time: FLOPs and bytes moved per second."""
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
    return line


def format_seconds(seconds: float) -> str:
    """Seconds for display: "1.23 s", "12.1 ms", "45.0 µs"."""
    if abs(seconds) >= 100:
        return f"{seconds:,.0f} s"
    for scale, unit in ((1.0, "s"), (1e-3, "ms"), (1e-6, "µs")):
        if abs(seconds) >= scale:
            return f"{_three_digits(seconds / scale)} {unit}"
    return f"{_three_digits(seconds / 1e-9)} ns"


def format_rate(value: float, unit: str) -> str:
    """A rate with an SI prefix: format_rate(3.35e12, "B/s") == "3.35 TB/s"."""
    for scale, prefix in ((1e15, "P"), (1e12, "T"), (1e9, "G"), (1e6, "M"), (1e3, "k")):
        if abs(value) >= scale:
            return f"{_three_digits(value / scale)} {prefix}{unit}"
    return f"{_three_digits(value)} {unit}"


def _three_digits(value: float) -> str:
    """Three significant digits, trailing zeros kept: 13.0, 9.40, 121."""
    decimals = 0 if abs(value) >= 100 else 1 if abs(value) >= 10 else 2
    return f"{value:.{decimals}f}"
