"""Measure this machine's own roofline: memory bandwidth and matmul peak per dtype.

A datasheet says what a chip could do; the lab's CPU path needs to know what *this* machine
does, and a GPU's datasheet peak is rarely reached. `calibrate` measures, in about 10 s on a
2-core CPU and a few seconds on a GPU:

  * copy bandwidth: `dst.copy_(src)`, counted as bytes read + bytes written;
  * read bandwidth: `x.sum()` over float32 ones, counted as the bytes read. A float32 sum is
    vectorised and was the fastest honest read tried (fp32/fp64/int64 sums, max reductions);
    an int8 sum widens element by element and reads at ~0.1 GB/s on the CPU, far below memory;
  * matmul peak per dtype: 2 n^3 FLOPs over the median time of an n x n @ n x n product,
    best over a few sizes. fp32 is plain IEEE fp32 (TF32 off). On CUDA, fp8 uses
    `torch._scaled_mm` and int8 `torch._int_mm` when this torch and GPU have them, else None.
    On the CPU bf16 and fp16 run at ~1 GFLOP/s, so they are timed briefly at a small size.

Tensors are far beyond the last-level cache (256 MiB on the CPU, 2 GiB on a GPU), so the
bandwidth is the memory's, not a cache's. The roof used for `memory_bandwidth_bytes_per_s` is
the higher of copy and read: a roof must be the best rate any operation was seen to reach.
Results are cached per device and host in $LABKIT_CACHE_DIR (default ~/.cache/labkit).
"""
from __future__ import annotations

import dataclasses
import json
import os
import re
import socket
import time
import warnings
from contextlib import contextmanager
from dataclasses import dataclass
from datetime import datetime, timezone
from pathlib import Path
from typing import Callable

import torch

from . import roofline
from .backend import check_fits, device_name, total_memory_bytes
from .dtypes import COMPUTE_DTYPES, torch_dtype
from .measure import format_rate, time_fn
from .recordings import provenance as base_provenance
from .recordings import write_json_atomic
from .specs import HardwareSpec

MIB, GIB = 2**20, 2**30
CACHE_FORMAT = 1
MAX_AGE_S = 7 * 24 * 3600  # a week: drivers, clocks and neighbours change


@dataclass(frozen=True)
class Plan:
    """What to measure on one kind of device: sizes, and how long each measurement may take."""

    stream_bytes: int  # size of each tensor for the bandwidth tests
    matmul_sizes: dict  # dtype -> tuple of n for n x n @ n x n
    warmup: int
    repeats: int
    budget_s: float  # per size and measurement; MIN_SAMPLES are taken regardless


PLANS = {
    # 256 MiB is ~100x a server CPU's per-core share of L3; fp32 at 1024 and 2048 reaches the
    # BLAS's steady state; bf16/fp16 at 256 already takes ~30 ms a call at ~1 GFLOP/s.
    "cpu": Plan(256 * MIB, {"fp32": (1024, 2048), "bf16": (256,), "fp16": (256,)},
                warmup=1, repeats=5, budget_s=1.5),
    # 2 GiB is 40x an H100's 50 MiB L2. 8192 fills all SMs with full tiles; more warm-up lets
    # the clocks settle before timing.
    "cuda": Plan(2 * GIB, {d: (4096, 8192) for d in ("bf16", "fp16", "fp32", "fp8", "int8")},
                 warmup=5, repeats=20, budget_s=2.0),
}
_FIELD = {"bf16": "bf16_flops_per_s", "fp16": "fp16_flops_per_s", "fp32": "fp32_flops_per_s",
          "fp8": "fp8_flops_per_s", "int8": "int8_ops_per_s"}


def calibrate(device, plan: Plan | None = None) -> tuple[HardwareSpec, dict]:
    """Measure `device` ("cpu" | "cuda") now; return its calibrated HardwareSpec and provenance."""
    kind = torch.device(getattr(device, "device", device)).type
    plan = plan or PLANS[kind]
    start_s = time.perf_counter()
    check_fits(2 * plan.stream_bytes, kind, "calibration's bandwidth test")
    stream = _stream_bandwidth(kind, plan)
    matmul = {dtype: _matmul_peak(kind, dtype, sizes, plan) for dtype, sizes in plan.matmul_sizes.items()}
    if kind == "cuda":
        torch.cuda.empty_cache()
    info = {**base_provenance(kind), "kind": "calibration", "plan": dataclasses.asdict(plan),
            "elapsed_s": time.perf_counter() - start_s, "bandwidth": stream, "matmul": matmul}
    return _spec(kind, stream, matmul, info["date"]), info


def _spec(kind: str, stream: dict, matmul: dict, date: str) -> HardwareSpec:
    measured = f"measured by labkit.calibrate on {date}"
    peaks, sources = {}, {}
    for dtype, field in _FIELD.items():
        result = matmul.get(dtype, {})
        peaks[field] = result.get("flops_per_s")
        why_not = result.get("error") or f"no {dtype} matmul path on the {kind} in this lab"
        sources[field] = measured if peaks[field] is not None else f"not measured: {why_not}"
    best = max(("copy", "read"), key=lambda k: stream[k]["bytes_per_s"])
    sources["memory_bandwidth_bytes_per_s"] = f"{measured} (the {best} test, the faster of copy and read)"
    sources["memory_bytes"] = f"total memory reported to labkit.backend on {date}"
    return HardwareSpec(name=f"this machine: {device_name(kind)}", **peaks,
                        memory_bandwidth_bytes_per_s=stream[best]["bytes_per_s"],
                        memory_bytes=float(total_memory_bytes(kind)), sources=sources, kind="calibrated")


def bandwidth_now(device, plan: Plan | None = None) -> float:
    """The memory bandwidth at this moment, bytes/s: the calibration's copy and read tests, the
    faster of the two, one warm-up and three timed calls each.

    Why: a shared machine's bandwidth moves with its neighbours' load, so a fraction against a
    calibration made an hour ago can be off by 2x either way. Two of these around a measurement
    bound the roof of its own moment (`sweeps.bracketed`). Not cached, not written anywhere."""
    # Seen: 10.7 to 20.2 GB/s within 30 minutes on the lab's 2-core VM (2026-11-29); this check
    # took about 0.3 s there.
    kind = torch.device(getattr(device, "device", device)).type
    plan = dataclasses.replace(plan or PLANS[kind], warmup=1, repeats=3, budget_s=1.0)
    check_fits(2 * plan.stream_bytes, kind, "the bandwidth check")
    stream = _stream_bandwidth(kind, plan)
    if kind == "cuda":
        torch.cuda.empty_cache()
    return max(result["bytes_per_s"] for result in stream.values())


def _stream_bandwidth(kind: str, plan: Plan) -> dict:
    """Copy (read + write bytes) and read (sum) bandwidth over plan.stream_bytes tensors."""
    n = plan.stream_bytes // 4
    src = torch.ones(n, dtype=torch.float32, device=kind)  # ones: no denormals, all pages touched
    dst = torch.empty_like(src)
    result = {}
    for name, fn, bytes_moved in (("copy", lambda: dst.copy_(src), 2 * n * 4),
                                  ("read", lambda: src.sum(), n * 4)):
        timing = time_fn(fn, kind, plan.warmup, plan.repeats, plan.budget_s)
        result[name] = {"bytes_per_s": bytes_moved / timing.median_s, "bytes_moved": bytes_moved,
                        "samples_s": list(timing.samples_s)}
    return result


def _matmul_peak(kind: str, dtype: str, sizes: tuple, plan: Plan) -> dict:
    """Best median rate over `sizes` for n x n @ n x n in `dtype`, each size's samples kept;
    {"error": ...} and no rate if this torch or device cannot do it."""
    by_size = {}
    for n in sizes:
        try:
            fn = _matmul_fn(kind, dtype, n)
        except (RuntimeError, TypeError, AttributeError, NotImplementedError) as err:
            first_line = (str(err).splitlines() or [""])[0]
            return {"error": f"{type(err).__name__}: {first_line}"}
        with _plain_fp32():
            timing = time_fn(fn, kind, plan.warmup, plan.repeats, plan.budget_s)
        by_size[str(n)] = {"flops_per_s": 2 * n**3 / timing.median_s, "samples_s": list(timing.samples_s)}
    best = max(by_size.values(), key=lambda s: s["flops_per_s"])["flops_per_s"]
    return {"flops_per_s": best, "by_size": by_size}


def _matmul_fn(kind: str, dtype: str, n: int) -> Callable[[], object]:
    """A ready-to-time n x n matmul in `dtype`, run once here so unsupported paths fail early."""
    a = torch.randn(n, n, device=kind)  # random, not zeros: data-dependent power affects clocks
    b = torch.randn(n, n, device=kind)
    if dtype in COMPUTE_DTYPES:
        a, b = a.to(torch_dtype(dtype, COMPUTE_DTYPES)), b.to(torch_dtype(dtype, COMPUTE_DTYPES))
        out = torch.empty_like(a)
        fn = lambda: torch.mm(a, b, out=out)  # noqa: E731
    elif kind != "cuda":
        raise NotImplementedError(f"{dtype} matmul is measured on CUDA only")
    elif dtype == "fp8":
        # _scaled_mm wants the second operand column-major, and per-tensor fp32 scales. Fast
        # accumulation is what inference engines run, so it is the ceiling their kernels meet.
        a8, b8 = a.to(torch_dtype("fp8")), b.to(torch_dtype("fp8")).t().contiguous().t()
        one = torch.ones((), device=kind)
        fn = lambda: torch._scaled_mm(a8, b8, one, one, out_dtype=torch.bfloat16, use_fast_accum=True)  # noqa: E731
    else:  # int8: cuBLASLt's fast int8 path is row-major A times column-major B
        a8, b8 = _to_int8(a), _to_int8(b).t().contiguous().t()
        fn = lambda: torch._int_mm(a8, b8)  # noqa: E731
    fn()
    return fn


def _to_int8(x: torch.Tensor) -> torch.Tensor:
    return (x * 32).clamp(-127, 127).to(torch.int8)


@contextmanager
def _plain_fp32():
    """TF32 off while timing, so fp32 means IEEE fp32 (TF32 is a different, 8x faster roof)."""
    saved = torch.backends.cuda.matmul.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = False
    try:
        yield
    finally:
        torch.backends.cuda.matmul.allow_tf32 = saved


def describe(spec: HardwareSpec, info: dict) -> str:
    """A few lines for a notebook: what was measured, where, when, and the ridge point."""
    compute_dtype = "fp32" if info.get("device") == "cpu" else "bf16"
    bandwidth = info.get("bandwidth", {})
    streams = ", ".join(f"{k} {format_rate(v['bytes_per_s'], 'B/s')}" for k, v in bandwidth.items())
    peaks = ", ".join(f"{d} {format_rate(spec.peak_flops_per_s(d), 'FLOP/s')}" for d in _FIELD
                      if getattr(spec, _FIELD[d]) is not None)
    ridge = roofline.ridge_point_flops_per_byte(spec, compute_dtype)
    return "\n".join([
        f"{spec.name} ({info.get('device')}, {info.get('threads')} threads), calibrated {info.get('date')}",
        f"  memory bandwidth {format_rate(spec.memory_bandwidth_bytes_per_s, 'B/s')} ({streams})",
        f"  matmul peak {peaks}",
        f"  ridge point ({compute_dtype}) {ridge:,.1f} FLOP/byte; {info.get('cache_status', 'not cached')}"])


# ---------------------------------------------------------------- the cache
def cache_dir() -> Path:
    return Path(os.environ.get("LABKIT_CACHE_DIR") or Path.home() / ".cache" / "labkit")


def cache_path(device) -> Path:
    kind = torch.device(getattr(device, "device", device)).type
    host = re.sub(r"[^A-Za-z0-9._-]", "_", socket.gethostname()) or "unknown-host"
    return cache_dir() / f"calibration-{kind}-{host}.json"


def load_or_calibrate(device, refresh: bool = False, max_age_s: float = MAX_AGE_S,
                      log: Callable[[str], None] | None = None) -> tuple[HardwareSpec, dict]:
    """The cached calibration of `device` on this host if fresh, else a new one (then cached).
    A cache that is unreadable, older than `max_age_s`, or from another device name or torch
    version is measured again; an unreadable one is also reported with a warning. `log` gets
    one line saying what happened (e.g. `print`)."""
    kind = torch.device(getattr(device, "device", device)).type
    path = cache_path(kind)
    why = "refresh asked for" if refresh else _stale_reason(path, kind, max_age_s)
    if why is None:
        spec, info = _read_cache(path)
        return spec, {**info, "cache_file": str(path), "cache_status": "hit"}
    if log:
        log(f"labkit: calibrating {kind} ({why}); about {'10' if kind == 'cpu' else '5'} s")
    spec, info = calibrate(kind)
    try:
        write_json_atomic(path, {"format": CACHE_FORMAT, "spec": dataclasses.asdict(spec), "provenance": info})
    except OSError as err:  # a read-only home, a full disk: the measurement still stands, uncached
        warnings.warn(f"labkit: could not cache the calibration in {path} ({err}); set LABKIT_CACHE_DIR "
                      "to a writable directory, or it is measured again next time", stacklevel=2)
        return spec, {**info, "cache_file": None, "cache_status": f"measured ({why}), not cached: {err}"}
    if log:
        log(f"labkit: calibration cached in {path}")
    return spec, {**info, "cache_file": str(path), "cache_status": f"measured ({why})"}


def _stale_reason(path: Path, kind: str, max_age_s: float) -> str | None:
    """Why the cache at `path` cannot be used, or None if it can."""
    if not path.exists():
        return "no cached calibration"
    try:
        spec, info = _read_cache(path)
        age_s = (datetime.now(timezone.utc) - datetime.fromisoformat(info["date"])).total_seconds()
    except (OSError, UnicodeDecodeError, ValueError, KeyError, TypeError) as err:
        warnings.warn(f"labkit: calibration cache {path} is unreadable ({type(err).__name__}: {err}); "
                      f"measuring again", stacklevel=3)
        return "cached calibration unreadable"
    if age_s > max_age_s:
        return f"cached calibration is {age_s / 86400:.1f} days old"
    if info.get("device_name") != device_name(kind) or info.get("torch") != torch.__version__:
        return "cached calibration is from another device or torch version"
    return None


def _read_cache(path: Path) -> tuple[HardwareSpec, dict]:
    """Parse and validate a cache file; any defect raises ValueError, KeyError or TypeError."""
    data = json.loads(path.read_text())
    if not isinstance(data, dict):
        raise TypeError(f"expected a JSON object, got {type(data).__name__}")
    if data.get("format") != CACHE_FORMAT:
        raise ValueError(f"format {data.get('format')!r}, expected {CACHE_FORMAT}")
    spec = HardwareSpec(**data["spec"])
    numbers = (spec.memory_bandwidth_bytes_per_s, spec.memory_bytes, spec.fp32_flops_per_s)
    if spec.kind != "calibrated" or not all(isinstance(v, (int, float)) and v > 0 for v in numbers):
        raise ValueError("spec is not a calibrated spec with positive bandwidth, memory and fp32 peak")
    return spec, dict(data["provenance"])
