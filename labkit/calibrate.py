"""Measure this machine's own roofline: bandwidth by working set, and matmul peak per dtype.

A datasheet says what a chip could do; the lab's CPU path needs to know what *this* machine
does, and a GPU's datasheet peak is rarely reached. `calibrate` measures, in 5-15 s on a 2-core
CPU (5 s on the 2-core EPYC VM with its 32 MiB L3, idle; more where a large L3 sends the working
sets further, or a busy machine makes figures repeat) and a few seconds on a GPU:

  * the bandwidth roof by working set, on all cores: working sets from about 1 MiB to
    WORKING_SET_FACTOR x the last-level cache (`cpu_info.cpu_caches`; a GPU's L2), each read
    three ways — `x.sum()` over float32 ones and a matrix-vector product `x.view(-1, 256) @ ones`
    (counted as the bytes read), and a copy of all of it into a second buffer (bytes read +
    written; `COPY_BUFFERS` says why not half into the other half) — and the roof at that working
    set is the fastest of the three. A decode step's GEMV then
    cannot beat its roof on an idle machine: the roof was measured with a GEMV too. A step whose
    weights fit in the L3 reads at the L3's rate, not the DRAM's (issue 13: 37-52 GB/s for
    4-64 MiB against 17-24 GB/s past 128 MiB on a 2-core Xeon VM);
  * matmul peak per dtype: 2 n^3 FLOPs over the time of an n x n @ n x n product, best over a
    few sizes. fp32 is plain IEEE fp32 (TF32 off); on a CPU it is the fastest of torch's matmul
    and oneDNN's linear (`CPU_FP32_PATHS`: on an AMD CPU torch's MKL ran at half the cores' rate,
    and the lab's own products ran past a roof it measured). On CUDA, fp8 uses `torch._scaled_mm` and int8
    `torch._int_mm` when this torch and GPU have them, else None.

Each figure is repeated until it is trustworthy: on a CPU the fastest call counts once a
second call comes within timing.CONFIRM_TOLERANCE (10 %) of it (`timing.time_until_stable`); on
CUDA the median of event-timed samples whose spread is under timing.NOISY_SPREAD (25 %). A figure
that does not get there within its budget is named in info["noisy"]; so is a CPU calibration
during which other processes kept more than timing.OTHERS_BUSY_LIMIT (8 %) of the cores busy (a steady
load confirms its own, slower, figures), and so is any one figure during which they did (judged
over at least FIGURE_WINDOW_S: a load during the matmul alone halved the fp32 peak while the whole
run's share stayed under the limit). Such a calibration is kept for this process only, never
cached: a roof measured while the machine was busy would judge every later point against too low
a ceiling.

The spec's `memory_bandwidth_bytes_per_s` is the roof at the largest working set (the memory's,
past every cache); `bandwidth_by_working_set` keeps the whole curve, which
`roofline.roof_at_working_set` reads. Results are cached per device and host in
$LABKIT_CACHE_DIR (default ~/.cache/labkit); a cache from another CPU (model, caches, thread
count), another torch, older than MAX_AGE_S or than the machine's last boot is measured again,
and the log line says why.
"""
from __future__ import annotations

import dataclasses
import json
import math
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

from . import cpu_info, roofline
from .backend import check_fits, device_name, total_memory_bytes
from .cpu_info import load_snapshot, others_busy_share
from .dtypes import COMPUTE_DTYPES, torch_dtype
from .measure import format_rate, time_fn, time_until_stable
from .recordings import provenance as base_provenance
from .recordings import write_json_atomic
from .specs import HardwareSpec, preset_for_device_name
from .timing import OTHERS_BUSY_LIMIT, quiet_wait_s, wait_for_quiet

MIB, GIB = 2**20, 2**30
CACHE_FORMAT = 4  # 2: the bandwidth curve, the caches, noisy figures; 3: the CPU's fp32 peak by the fastest of two paths;
# 4: the copy test reads the whole working set (`COPY_BUFFERS`: a half copy's roofs could be a cache's)
MAX_AGE_S = 7 * 24 * 3600  # a week: drivers, clocks and neighbours change
WORKING_SET_FACTOR = 4  # the sweep reaches 4x the last-level cache: well past it, into memory
SMALLEST_WORKING_SET = MIB
MIN_POINTS = 6
MIN_SAMPLE_S = 2e-3  # a CPU call shorter than this is repeated back to back within one sample
CPU_MAX_SAMPLES = 100
# A CPU calibration during which other processes kept more than timing.OTHERS_BUSY_LIMIT of all
# cores busy is noisy: its roofs are a loaded machine's (issue 13: 12.1 GB/s cached during a test
# run, 20.0 idle). So is a figure during which they did, judged over at least this long (`_figure`).
FIGURE_WINDOW_S = 1.0
ROW = 256  # the GEMV read's row length (the lab-cpu model's hidden size)
QUANTUM = 2 * ROW * 4  # working sets a whole number of pairs of fp32 rows of ROW (pairs: the sizes of earlier calibrations)


@dataclass(frozen=True)
class Plan:
    """What to measure on one kind of device: sizes, and how long each figure may take."""

    stream_bytes: int | None  # the largest working set; None: WORKING_SET_FACTOR x the last-level cache
    matmul_sizes: dict  # dtype -> tuple of n for n x n @ n x n
    warmup: int  # CUDA: untimed calls first (clocks, caches); a CPU figure always takes one
    repeats: int  # CUDA: samples per figure (a CPU figure samples until confirmed, at most CPU_MAX_SAMPLES)
    budget_s: float  # per figure; a CPU figure goes on to max_budget_s while unconfirmed
    max_budget_s: float | None = None  # None: 4 x budget_s
    step: float = math.sqrt(2)  # between working sets up to the last-level cache (2x past it)
    min_top_bytes: int = 0  # the sweep reaches at least this far, whatever the caches say


PLANS = {
    # fp32 at 1024 and 2048 reaches the BLAS's steady state; bf16/fp16 at 256 is enough where
    # they have no fast path. Past the caches the sweep goes to at least 256 MiB.
    "cpu": Plan(None, {"fp32": (1024, 2048), "bf16": (256,), "fp16": (256,)}, warmup=1, repeats=5,
                budget_s=0.25, max_budget_s=1.0, min_top_bytes=256 * MIB),
    # 2 GiB is 40x an H100's 50 MiB L2. 8192 fills all SMs with full tiles; more warm-up lets
    # the clocks settle before timing.
    "cuda": Plan(None, {d: (4096, 8192) for d in ("bf16", "fp16", "fp32", "fp8", "int8")},
                 warmup=5, repeats=20, budget_s=2.0, step=2.0, min_top_bytes=2 * GIB),
}
_FIELD = {"bf16": "bf16_flops_per_s", "fp16": "fp16_flops_per_s", "fp32": "fp32_flops_per_s",
          "fp8": "fp8_flops_per_s", "int8": "int8_ops_per_s"}
_UNCACHED: dict[str, tuple[HardwareSpec, dict]] = {}  # noisy calibrations, kept for this process only


def calibrate(device, plan: Plan | None = None) -> tuple[HardwareSpec, dict]:
    """Measure `device` ("cpu" | "cuda") now; return its calibrated HardwareSpec and provenance."""
    kind = _kind(device)
    plan = plan or PLANS[kind]
    if kind == "cpu":  # not while the browser still draws the cell before (lesson 01 calibrates in the notebook)
        wait_for_quiet(quiet_wait_s())
    start_s, load = time.perf_counter(), load_snapshot()
    caches = machine_caches(kind)
    sizes = working_set_sizes(top_bytes(plan, caches), caches[-1][1] if caches else None, plan.step)
    curve = bandwidth_by_working_set(kind, sizes, plan)
    matmul = {dtype: _matmul_peak(kind, dtype, n, plan) for dtype, n in plan.matmul_sizes.items()}
    if kind == "cuda":
        torch.cuda.empty_cache()
    noisy = [f"bandwidth at {p['bytes'] / MIB:,.1f} MiB" for p in curve if p["noisy"]]
    noisy += rises_past_cache(curve, caches[-1][1] if caches else None)
    noisy += [f"{dtype} matmul" for dtype, result in matmul.items() if result.get("noisy")]
    others = others_busy_share(load) if kind == "cpu" else None
    if others is not None and others > OTHERS_BUSY_LIMIT:
        noisy.append(f"other processes kept {others:.0%} of the cores busy meanwhile")
    info = {**base_provenance(kind), "kind": "calibration", "plan": dataclasses.asdict(plan),
            "cpu_identity": cpu_info.cpu_identity() if kind == "cpu" else None,
            "caches": [list(level) for level in caches], "caches_source": _caches_source(kind),
            "elapsed_s": time.perf_counter() - start_s, "bandwidth_by_working_set": curve,
            "bandwidth": {name: curve[-1]["tests"][name] for name in ("copy", "read")},
            "matmul": matmul, "others_busy_share": others, "noisy": noisy}
    spec = _spec(kind, curve, caches, matmul, info["date"])
    info["tier_edges"] = roofline.tier_edges(spec.bandwidth_by_working_set, caches, spec.memory_name)
    return spec, info


# Past the last-level cache a larger working set reads no faster than a smaller one; a rise of
# more than this between two points there is the machine changing speed mid-calibration.
RISE_LIMIT = 1.15


def rises_past_cache(curve: list[dict], last_level_bytes: float | None) -> list[str]:
    """The points past the last-level cache whose rate is over RISE_LIMIT x that of a smaller
    working set past it, each named as a noisy figure: each was confirmed on its own, but not at
    the same moment as the others (the 2-core EPYC VM's memory switched between ~50 and ~95 GB/s
    at 256 MiB within seconds; bench-cpu-31's calibration read 57 GB/s at 128 MiB and 95 at 256).
    The roof is then raised to the faster (`roofline.roof_envelope`) and not cached."""
    if not last_level_bytes:
        return []
    past = [p for p in curve if p["bytes"] > last_level_bytes]
    rises = []
    for i, point in enumerate(past[1:], start=1):
        slowest = min(past[:i], key=lambda p: p["bytes_per_s"])
        if point["bytes_per_s"] > RISE_LIMIT * slowest["bytes_per_s"]:
            rises.append(f"bandwidth at {point['bytes'] / MIB:,.1f} MiB ({point['bytes_per_s'] / 1e9:,.3g} GB/s) over "
                         f"that at {slowest['bytes'] / MIB:,.1f} MiB ({slowest['bytes_per_s'] / 1e9:,.3g} GB/s): the "
                         "memory changed speed during the calibration")
    return rises


def _kind(device) -> str:
    return torch.device(getattr(device, "device", device)).type


# ---------------------------------------------------------------- caches and working sets
def machine_caches(kind: str) -> tuple[tuple[str, int], ...]:
    """((name, bytes), ...) smallest first: the CPU's levels as all its cores hold them
    (`cpu_info.cpu_caches`), or the GPU's L2 as the device reports it (else its preset's)."""
    if kind == "cpu":
        return cpu_info.cpu_caches().as_pairs()
    l2 = getattr(torch.cuda.get_device_properties(torch.cuda.current_device()), "L2_cache_size", 0) or 0
    if not l2:
        preset = preset_for_device_name(torch.cuda.get_device_name())
        l2 = next((size for name, size in (preset.cache_levels if preset else ()) if name == "L2"), 0)
    return (("L2", int(l2)),) if l2 else ()


def _caches_source(kind: str) -> str:
    if kind == "cpu":
        return cpu_info.cpu_caches().source
    return "torch.cuda.get_device_properties().L2_cache_size (else the preset's, labkit.specs)"


def top_bytes(plan: Plan, caches) -> int:
    """The largest working set: the plan's, else WORKING_SET_FACTOR x the last-level cache (the
    fallback's where the OS names none), at least plan.min_top_bytes."""
    if plan.stream_bytes is not None:
        return int(plan.stream_bytes)
    last = caches[-1][1] if caches else cpu_info.FALLBACK_LAST_LEVEL_BYTES
    return max(WORKING_SET_FACTOR * int(last), plan.min_top_bytes)


def working_set_sizes(top: int, last_level_bytes: int | None = None, step: float = math.sqrt(2)) -> list[int]:
    """Working sets from SMALLEST_WORKING_SET (lower when `top` is small, so there are always
    MIN_POINTS) to `top`: `step` apart up to the last-level cache, then doubling. Each is a
    multiple of QUANTUM bytes."""
    bottom = min(SMALLEST_WORKING_SET, top / step ** (MIN_POINTS - 1))
    sizes, size = [], float(bottom)
    while size < top * 0.999:
        sizes.append(size)
        size *= step if last_level_bytes is None or size < last_level_bytes else 2.0
    sizes.append(float(top))
    return sorted({max(QUANTUM, round(s / QUANTUM) * QUANTUM) for s in sizes})


# ---------------------------------------------------------------- measuring one figure
def _figure(fn: Callable[[], object], work: float, kind: str, plan: Plan) -> dict:
    """`work` (bytes or FLOPs) per call of `fn` over the call's time: on a CPU the confirmed
    fastest of back-to-back batches lasting >= MIN_SAMPLE_S (`timing.time_until_stable`), on CUDA
    the median of event-timed samples (`measure.time_fn`). Keeps the samples and says if noisy."""
    if kind == "cuda":
        timing = time_fn(fn, kind, plan.warmup, plan.repeats, plan.budget_s)
        return {"rate": work / timing.estimate_s, "samples_s": list(timing.samples_s),
                "calls_per_sample": timing.calls_per_sample, "noisy": timing.noisy, "spread": timing.spread}
    load = load_snapshot()
    once_s = time.perf_counter()  # the first call: how long one takes (page faults only make it longer)
    fn()
    once_s = time.perf_counter() - once_s
    calls = max(1, min(1000, math.ceil(MIN_SAMPLE_S / max(once_s, 1e-9))))
    batch = fn if calls == 1 else (lambda: [fn() for _ in range(calls)])
    timing = time_until_stable(batch, plan.budget_s, plan.max_budget_s or 4 * plan.budget_s, 3, CPU_MAX_SAMPLES)
    # Another process busy during this figure alone: its samples can agree with each other and
    # still be half the machine's (a browser drawing while the matmul ran: fp32 226 GFLOP/s cached
    # against 470 idle, 2-core EPYC VM), though the whole calibration's share stays under the limit.
    # Judged over at least FIGURE_WINDOW_S: /proc/stat counts in 10 ms ticks, and a figure of a few
    # ms would otherwise be "busy" for one tick of a kernel thread.
    others = others_busy_share(load, min_wall_s=FIGURE_WINDOW_S)
    busy = others is not None and others > OTHERS_BUSY_LIMIT
    return {"rate": calls * work / timing.estimate_s, "samples_s": [s / calls for s in timing.samples_s],
            "calls_per_sample": calls, "noisy": timing.noisy or busy, "spread": timing.spread,
            "others_busy_share": others}


def bandwidth_by_working_set(kind: str, sizes: list[int], plan: Plan) -> list[dict]:
    """For each working set (bytes): the read (sum), GEMV and copy rates, and the roof there,
    the fastest of them. One buffer of the largest size; smaller working sets are its start."""
    check_fits(COPY_BUFFERS * max(sizes), kind, "the calibration's bandwidth sweep")
    buffer = torch.ones(max(sizes) // 4, dtype=torch.float32, device=kind)  # ones: no denormals
    target = torch.empty_like(buffer)  # the copy's destination (`COPY_BUFFERS`)
    ones = torch.ones(ROW, dtype=torch.float32, device=kind)
    curve = []
    for size in sizes:
        n = size // 4
        x, dst = buffer[:n], target[:n]
        rows = x.view(-1, ROW)
        moved = {"read": size, "gemv": size, "copy": COPY_BUFFERS * size}
        tests = {"read": _figure(lambda: x.sum(), moved["read"], kind, plan),
                 "gemv": _figure(lambda: torch.mv(rows, ones), moved["gemv"], kind, plan),
                 "copy": _figure(lambda: dst.copy_(x), moved["copy"], kind, plan)}
        best = max(tests, key=lambda name: tests[name]["rate"])
        curve.append({"bytes": size, "bytes_per_s": tests[best]["rate"], "best": best, "noisy": tests[best]["noisy"],
                      "tests": {name: {"bytes_per_s": t["rate"], "bytes_moved": moved[name],
                                       **{k: t[k] for k in ("samples_s", "calls_per_sample", "noisy", "spread")}}
                                for name, t in tests.items()}})
    del buffer, target
    return curve


# The copy test at a working set of W bytes reads all W into a second buffer of W (2 W moved: read +
# written), so it reads as many bytes as a decode step of that working set, which reads them all.
# It used to copy one half into the other: it read W / 2 (and large copies may write past the
# caches, their destination taking no room there), so in a cache holding W / 2 its rate was a
# cache's, filed under W.
# 2-core EPYC VM whose two cores sometimes sit on two L3s (2 x 32 MiB), at W = 64 MiB: the half copy
# 130-138 GB/s against the read's 100-120 (calibrate's own figures), and a bracket of 152 GB/s put
# a B=1 decode step (64 MiB) at 0.43 of its roof (bench-cpu-33); torch timings interleaved, while
# the cores sat on two L3s: the whole copy 91 GB/s median, the read 94, the half copy 105 (872
# triples), and on one L3 48, 61 and 61 (1,193 triples; 2026-12-04).
COPY_BUFFERS = 2


def _matmul_peak(kind: str, dtype: str, sizes: tuple, plan: Plan) -> dict:
    """Best rate over `sizes` for n x n @ n x n in `dtype`, each size's samples kept, and on a CPU
    in fp32 the fastest of `CPU_FP32_PATHS` at each size ("path" names it); {"error": ...} and no
    rate if this torch or device cannot do it."""
    by_size = {}
    for n in sizes:
        paths = {}
        for path in (CPU_FP32_PATHS if (kind, dtype) == ("cpu", "fp32") else ("torch.mm",)):
            try:
                fn = _matmul_fn(kind, dtype, n, path)
            except (RuntimeError, TypeError, AttributeError, NotImplementedError) as err:
                if path != "torch.mm":
                    continue  # another library's path, where this torch has it
                first_line = (str(err).splitlines() or [""])[0]
                return {"error": f"{type(err).__name__}: {first_line}"}
            with _plain_fp32():
                paths[path] = _figure(fn, 2 * n**3, kind, plan)
        path = max(paths, key=lambda name: paths[name]["rate"])
        by_size[str(n)] = {"flops_per_s": paths[path]["rate"], "samples_s": paths[path]["samples_s"],
                           "noisy": paths[path]["noisy"], "path": path,
                           "paths": {name: {"flops_per_s": f["rate"], "noisy": f["noisy"]} for name, f in paths.items()}}
    best = max(by_size.values(), key=lambda s: s["flops_per_s"])
    return {"flops_per_s": best["flops_per_s"], "noisy": best["noisy"], "path": best["path"], "by_size": by_size}


# On a CPU the fp32 peak is the fastest of torch's matmul (MKL in torch's x86 wheels) and oneDNN's
# linear, also in torch: on AMD CPUs MKL runs its AVX2 kernels, at half what the cores do with
# AVX-512, and the lab's own products (numba's panel product, oneDNN's packed weights) ran past a
# roof measured by it. 2-core AMD EPYC VM (Zen 5, cpu family 26), n x n fp32, fastest of 10:
# torch.mm 206-214 GFLOP/s, oneDNN's linear 473-506 (n = 512-2,048); the panel product 380-426 on
# decode-shaped products (16-128 rows, K = 256). On the lab's Xeon MKL is the faster one or close.
CPU_FP32_PATHS = ("torch.mm", "oneDNN linear")


def _matmul_fn(kind: str, dtype: str, n: int, path: str = "torch.mm") -> Callable[[], object]:
    """A ready-to-time n x n matmul in `dtype` by `path` (`CPU_FP32_PATHS`), run once here so
    unsupported paths fail early."""
    a = torch.randn(n, n, device=kind)  # random, not zeros: data-dependent power affects clocks
    b = torch.randn(n, n, device=kind)
    if path == "oneDNN linear":  # a @ b.T, b as a linear's [out, in] weight (the same FLOPs)
        if not torch.backends.mkldnn.is_available():
            raise NotImplementedError("this torch has no oneDNN")
        fn = lambda: torch.ops.mkldnn._linear_pointwise(a, b, None, "none", [], "")  # noqa: E731
    elif dtype in COMPUTE_DTYPES:
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


def _spec(kind: str, curve: list[dict], caches, matmul: dict, date: str) -> HardwareSpec:
    measured = f"measured by labkit.calibrate on {date}"
    peaks, sources = {}, {}
    for dtype, field in _FIELD.items():
        result = matmul.get(dtype, {})
        peaks[field] = result.get("flops_per_s")
        why_not = result.get("error") or f"no {dtype} matmul path on the {kind} in this lab"
        among = f", the fastest of {' and '.join(CPU_FP32_PATHS)}" if (kind, dtype) == ("cpu", "fp32") else ""
        sources[field] = (f"{measured} ({result['path']}{among})" if peaks[field] is not None
                          else f"not measured: {why_not}")
    top = curve[-1]
    sources["memory_bandwidth_bytes_per_s"] = (f"{measured} (the {top['best']} test, the fastest of read, GEMV "
                                               f"and copy, at the largest working set, {top['bytes'] / MIB:,.0f} MiB)")
    sources["bandwidth_by_working_set"] = f"{measured}: the fastest of read, GEMV and copy at each working set"
    sources["cache_levels"] = _caches_source(kind)
    sources["memory_bytes"] = f"total memory reported to labkit.backend on {date}"
    preset = preset_for_device_name(device_name(kind)) if kind == "cuda" else None
    memory_name = "DRAM" if kind == "cpu" else (preset.memory_name if preset else "memory")
    return HardwareSpec(name=f"this machine: {device_name(kind)}", **peaks,
                        memory_bandwidth_bytes_per_s=top["bytes_per_s"],
                        memory_bytes=float(total_memory_bytes(kind)), sources=sources, kind="calibrated",
                        cache_levels=tuple(caches), memory_name=memory_name,
                        bandwidth_by_working_set=tuple((p["bytes"], p["bytes_per_s"]) for p in curve))


def bandwidth_now(device, working_set_bytes: int | None = None, plan: Plan | None = None) -> float:
    """The bandwidth roof at `working_set_bytes` (default: the calibration's largest, the
    memory's) at this moment, bytes/s: the calibration's read, GEMV and copy tests, the fastest.

    Why: a shared machine's bandwidth moves with its neighbours' load, so a fraction against a
    calibration made an hour ago can be off by 2x either way. Two of these around a measurement
    bound the roof of its own moment and tier (`sweeps.bracketed`). Not cached, not written."""
    # Seen: 10.7 to 20.2 GB/s within 30 minutes on the lab's 2-core VM (2026-11-29).
    kind = _kind(device)
    plan = dataclasses.replace(plan or PLANS[kind], budget_s=0.1, max_budget_s=0.3)
    size = int(working_set_bytes or top_bytes(plan, machine_caches(kind)))
    curve = bandwidth_by_working_set(kind, [max(QUANTUM, size // QUANTUM * QUANTUM)], plan)
    if kind == "cuda":
        torch.cuda.empty_cache()
    return curve[0]["bytes_per_s"]


def describe(spec: HardwareSpec, info: dict) -> str:
    """A few lines for a notebook: what was measured, where, when, the tiers and the ridge point."""
    compute_dtype = "fp32" if info.get("device") == "cpu" else "bf16"
    fp32_path = (info.get("matmul") or {}).get("fp32", {}).get("path") if info.get("device") == "cpu" else None
    peaks = ", ".join(f"{d} {format_rate(spec.peak_flops_per_s(d), 'FLOP/s')}"
                      + (f" ({fp32_path})" if d == "fp32" and fp32_path else "")
                      for d in _FIELD if getattr(spec, _FIELD[d]) is not None)
    ridge = roofline.ridge_point_flops_per_byte(spec, compute_dtype)
    tiers = [f"{e['from']} {format_rate(e['from_bytes_per_s'], 'B/s')} up to ~{e['bytes'] / MIB:,.0f} MiB"
             for e in info.get("tier_edges", [])]
    tiers.append(f"{spec.memory_name} {format_rate(spec.memory_bandwidth_bytes_per_s, 'B/s')}")
    caches = ", ".join(f"{name} {size / MIB:,.0f} MiB" for name, size in spec.cache_levels) or "none reported"
    noisy = info.get("noisy") or []
    threads = info.get("threads")
    lines = [f"{spec.name} ({info.get('device')}, {threads} thread{'' if threads == 1 else 's'}), "
             f"calibrated {info.get('date')}",
             f"  bandwidth roof: {'; '.join(tiers)} (caches as the OS reports them: {caches})",
             f"  matmul peak {peaks}",
             f"  ridge point ({compute_dtype}, at the {spec.memory_name}'s bandwidth) {ridge:,.1f} FLOP/byte; "
             f"{_status_words(info)}"]
    if noisy:
        lines.append(f"  noisy (the machine was busy): {', '.join(noisy[:4])}{' …' if len(noisy) > 4 else ''}")
    return "\n".join(lines)


def _status_words(info: dict) -> str:
    """The cache status as a learner reads it: "hit" (the JSON's word) says where it came from and how
    to measure again, for this device (a lesson run on the CPU of a GPU machine: the CPU's)."""
    status = info.get("cache_status", "not cached")
    if status != "hit":
        return status
    device = f" --device {info['device']}" if info.get("device") in ("cpu", "cuda") else ""
    return f"read from the cache (`python -m labkit calibrate --refresh{device}` measures again)"


# ---------------------------------------------------------------- the cache file
def cache_dir() -> Path:
    return Path(os.environ.get("LABKIT_CACHE_DIR") or Path.home() / ".cache" / "labkit")


def cache_path(device) -> Path:
    kind = _kind(device)
    host = re.sub(r"[^A-Za-z0-9._-]", "_", socket.gethostname()) or "unknown-host"
    return cache_dir() / f"calibration-{kind}-{host}.json"


def load_or_calibrate(device, refresh: bool = False, max_age_s: float = MAX_AGE_S,
                      log: Callable[[str], None] | None = None) -> tuple[HardwareSpec, dict]:
    """The cached calibration of `device` on this host if it still describes this machine, else
    a new one, cached unless noisy (a noisy one is kept for this process only, and
    info["cache_status"] says so). A cache that is unreadable, older than `max_age_s` or than the
    last boot, or from another CPU, device or torch is measured again; an unreadable one is also
    reported with a warning. `log` gets one line saying what happened (e.g. `print`)."""
    kind = _kind(device)
    path = cache_path(kind)
    why = "refresh asked for" if refresh else _stale_reason(path, kind, max_age_s)
    if why is None:
        spec, info = _read_cache(path)
        return spec, {**info, "cache_file": str(path), "cache_status": "hit"}
    kept = _UNCACHED.get(str(path))
    if kept and not refresh and _stale_info_reason(kept[1], kind, max_age_s) is None:
        return kept[0], {**kept[1], "cache_status": f"measured earlier in this process, not cached: {_noisy_text(kept[1])}"}
    if log:
        log(f"labkit: calibrating {kind} ({why}); {'5 to 15' if kind == 'cpu' else 'about 5'} s")
    spec, info = calibrate(kind)
    if info["noisy"]:
        _UNCACHED[str(path)] = (spec, {**info, "cache_file": None})
        status = f"measured ({why}), not cached: {_noisy_text(info)}"
        if log:
            log(f"labkit: {status}")
        return spec, {**info, "cache_file": None, "cache_status": status}
    _UNCACHED.pop(str(path), None)
    try:
        write_json_atomic(path, {"format": CACHE_FORMAT, "spec": dataclasses.asdict(spec), "provenance": info})
    except OSError as err:  # a read-only home, a full disk: the measurement still stands, uncached
        warnings.warn(f"labkit: could not cache the calibration in {path} ({err}); set LABKIT_CACHE_DIR "
                      "to a writable directory, or it is measured again next time", stacklevel=2)
        return spec, {**info, "cache_file": None, "cache_status": f"measured ({why}), not cached: {err}"}
    if log:
        log(f"labkit: calibration cached in {path}")
    return spec, {**info, "cache_file": str(path), "cache_status": f"measured ({why})"}


def _noisy_text(info: dict) -> str:
    noisy = info.get("noisy") or ["?"]
    return (f"noisy ({len(noisy)} figure(s) unconfirmed or inconsistent, e.g. {noisy[0]}: the machine was busy); "
            "`python -m labkit calibrate --refresh` when it is quieter")


def _stale_reason(path: Path, kind: str, max_age_s: float) -> str | None:
    """Why the cache at `path` cannot be used, or None if it can."""
    if not path.exists():
        return "no cached calibration"
    try:
        data = json.loads(path.read_text())
        if isinstance(data, dict) and isinstance(data.get("format"), int) and data["format"] != CACHE_FORMAT:
            return f"cached calibration is of format {data['format']}, this labkit writes {CACHE_FORMAT}"
        _, info = _read_cache(path)
        return _stale_info_reason(info, kind, max_age_s)
    except (OSError, UnicodeDecodeError, ValueError, KeyError, TypeError) as err:
        warnings.warn(f"labkit: calibration cache {path} is unreadable ({type(err).__name__}: {err}); "
                      f"measuring again", stacklevel=3)
        return "cached calibration unreadable"


def _stale_info_reason(info: dict, kind: str, max_age_s: float) -> str | None:
    """Why a calibration's provenance no longer describes this machine now, or None."""
    date = datetime.fromisoformat(info["date"])
    age_s = (datetime.now(timezone.utc) - date).total_seconds()
    if age_s > max_age_s:
        return f"cached calibration is {age_s / 86400:.1f} days old"
    if info.get("device_name") != device_name(kind) or info.get("torch") != torch.__version__:
        return "cached calibration is from another device or torch version"
    if kind == "cpu":
        if info.get("cpu_identity") != cpu_info.cpu_identity():
            return "cached calibration is from another CPU model"
        if [tuple(c) for c in info.get("caches", [])] != list(machine_caches(kind)):
            return "cached calibration is from a CPU with other cache sizes"
        if info.get("threads") != torch.get_num_threads():
            return f"cached calibration used {info.get('threads')} threads, this process {torch.get_num_threads()}"
        booted = cpu_info.last_boot()
        if booted is not None and date < booted:
            return f"cached calibration predates this machine's last boot ({booted.isoformat(timespec='seconds')})"
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
    roofline.bandwidth_curve(spec.bandwidth_by_working_set)  # positive numbers, or SpecError (a ValueError)
    return spec, dict(data["provenance"])
