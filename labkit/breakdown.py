"""Where the time of one measured step goes: matrix products, attention, everything else, overhead,
each beside its roofline time — the chapter's "where does the 40 % come from?" on this machine.

    b = prefill_breakdown("lab-cpu", prompt_tokens=1024)
    b = decode_breakdown("lab-cpu", batch=1, context_tokens=1024, cache_dtype="fp32")
    b["categories"]     # products, attention, other, overhead: time_s, share, roof_time_s, ...
    b["step_fraction"]  # the whole step's fraction of peak FLOP/s (prefill) or of bandwidth (decode)

How a step is split, honestly: every sample times the real step twice, back to back — once as
it always runs (`time_s`, the whole) and once with a `clock.Clock` hooked into the model, which
adds each part's perf_counter seconds to its category (`model.Llama` and `cpu_decode.CpuDecode`
bracket every product, attention call and elementwise operation). What the brackets leave out of
the whole — Python between the calls, dispatch, thread hand-offs — is the overhead:
`time_s - (products + attention + other)`, measured, not guessed. As everywhere on a CPU
(`timing.sample_until_stable`), each figure is the fastest of its samples once a second confirms
it; a run whose budget ran out first is flagged noisy. Should the parts ever sum to more than
the whole (the timer's own cost, ~0.35 us a part, or noise), the overhead shows as 0 and
`parts_exceed_whole` says so.

The CPU decode step normally runs as one compiled call (`cpu_step`), which has nothing between its
kernels to bracket. A breakdown therefore times the same kernels issued call by call, both the
whole and the timed run (`clock.CALL_BY_CALL`): its overhead is the Python between those calls,
which the one-call step does not pay, and its whole can be slower than `measure decode`'s step
(`step_form` says which form was timed).

The roof beside each part comes from `roofline.prefill_work_by_category` /
`decode_work_by_category`: its FLOPs at the calibrated matmul peak and its bytes at the bandwidth
of the step's working set (`roofline.roof_at_working_set`, the roof `sweeps` judges the same step
by), the slower of the two. Overhead has no roof: on the roofline it takes no time.

The whole step's fraction splits exactly into the parts' contributions: with work W (FLOPs in a
prefill, bytes in a decode step) and rate R (the peak, or the bandwidth),
W / (T R) = sum over parts of (t_part / T) x (W_part / (t_part R)): each part's share of the time
times its own fraction of the rate.

On CUDA a host bracket would time a kernel's launch, not the GPU's work, and the decode step is one
replayed CUDA graph with no parts to bracket. There the step is timed whole as `sweeps` times it
(CUDA events, the median), and its parts are the GPU's own time in each kernel over PROFILED_STEPS
steps, from torch's profiler (`gpu_profile`), each kernel in a category by its name; the overhead
is the rest of the whole: time the GPU spent between kernels, waiting for work to be launched.
The step runs as it always does (a replayed graph), so `step_form` says that and the hook costs 0.
"""
from __future__ import annotations

import torch

from . import backend, calibrate, cpu_info, gpu_profile, measure, roofline, sweeps
from .clock import CALL_BY_CALL, CATEGORIES, OFF, Clock
from .errors import LabError
from .specs import ModelSpec
from .timing import (BUSY_WINDOW_S, OTHERS_BUSY_LIMIT, call_seconds, quiet_wait_s, sample_until_stable,
                     wait_for_quiet)

PARTS = (*CATEGORIES, "overhead")  # what a step's time is split into, in the charts' order
NAMES = {"products": "matrix products", "attention": "attention", "other": "everything else", "overhead": "overhead"}
WHAT = {"products": "the weight matrices' products (q/k/v, o, gate/up, down, the head)",
        "attention": "attention over the keys and values",
        "other": "norms, RoPE, SiLU, residual adds, cache writes, the embedding",
        "overhead": "what no part brackets: Python between the calls, dispatch, thread hand-offs"}
WHAT_ON_CUDA = {**WHAT, "overhead": "the GPU idle between kernels, waiting for work to be launched"}
PROFILED_STEPS = 3  # steps under the profiler on CUDA: each kernel's time a step is their mean
CPU_FORM = "call by call (the parts bracketed one by one)"
CUDA_FORM = "as it runs, each part the GPU time of its kernels (torch's profiler)"


# ------------------------------------------------------------------ one step, split
def prefill_breakdown(model: ModelSpec | str = sweeps.DEFAULT_MODEL, prompt_tokens: int = 1024, batch: int = 1,
                      device: str | None = None, cache_dtype: str | None = None,
                      budget_s: float | None = None) -> dict:
    """Time one prefill of `batch` random prompts of `prompt_tokens` tokens whole and in parts
    (cache in the compute dtype unless `cache_dtype` is given); `budget_s` shortens the timing
    (default `sweeps.CPU_BUDGET_S`)."""
    budget_s = _budget(budget_s)
    built = sweeps.get_built_model(model, device)
    spec, dtype = built.spec, built.compute_dtype
    sweeps.check_shape(spec, batch, prompt_tokens, "prompt_tokens", low=1)
    cache_dtype = cache_dtype or dtype
    sweeps.ensure_cache(built, batch, prompt_tokens, cache_dtype, prompt_tokens)
    tokens = _random_tokens(spec, (batch, prompt_tokens), built.device)
    with built.prefill_graph.repeating():  # as `sweeps.measure_prefill` times it (a CUDA graph on CUDA)
        timings = _time_parts(built, lambda: built.prefill(tokens), lambda: None, budget_s)
    work = roofline.prefill_work_by_category(spec, prompt_tokens, batch, dtype, cache_dtype)
    working_set = roofline.prefill_bytes(spec, prompt_tokens, batch, dtype, cache_dtype, roofline.KERNEL.params)
    return _split("prefill", built, timings, work, working_set, "flops",
                  prompt_tokens=prompt_tokens, batch=batch, cache_dtype=cache_dtype)


def decode_breakdown(model: ModelSpec | str = sweeps.DEFAULT_MODEL, batch: int = 1, context_tokens: int = 1024,
                     cache_dtype: str = "fp32", device: str | None = None, budget_s: float | None = None) -> dict:
    """Time one decode step of `batch` sequences over `context_tokens` cached tokens each (the
    cache filled with random values, as `sweeps.measure_decode` does) whole and in parts."""
    budget_s = _budget(budget_s)
    built = sweeps.get_built_model(model, device)
    spec, dtype = built.spec, built.compute_dtype
    sweeps.check_shape(spec, batch, context_tokens, "context_tokens", low=0)
    cache = sweeps.ensure_cache(built, batch, context_tokens + 1, cache_dtype, 1)  # no prefill
    if cache.filled_tokens < context_tokens:  # what a real cache holds, read the same way
        cache.fill_random(cache.max_tokens - 1)
    tokens = _random_tokens(spec, (batch,), built.device)

    def back():  # every timed step appends a token: back to the same context before the next
        cache.set_lengths(context_tokens, active=True)

    back()
    timings = _time_parts(built, lambda: built.decode_step(tokens), back, budget_s)
    work = roofline.decode_work_by_category(spec, batch, context_tokens, dtype, cache_dtype)
    working_set = roofline.decode_bytes_per_step(spec, batch, context_tokens, dtype, cache_dtype,
                                                 roofline.KERNEL.params)
    return _split("decode", built, timings, work, working_set, "bytes", batch=batch,
                  context_tokens=context_tokens, cache_dtype=cache_dtype)


def bind_prefill(model: ModelSpec | str = sweeps.DEFAULT_MODEL, **fixed):
    """measure(**control_values) -> prefill_breakdown(model, **fixed, **control_values), for a view."""
    return lambda **values: prefill_breakdown(model, **{**fixed, **values})


def bind_decode(model: ModelSpec | str = sweeps.DEFAULT_MODEL, **fixed):
    """measure(**control_values) -> decode_breakdown(model, **fixed, **control_values), for a view."""
    return lambda **values: decode_breakdown(model, **{**fixed, **values})


# ------------------------------------------------------------------ timing
def _budget(budget_s: float | None) -> float:
    """The timing's budget: `sweeps.CPU_BUDGET_S` unless given, at most `sweeps.CPU_MAX_BUDGET_S`
    (a point goes on to that while its fastest call is unconfirmed)."""
    budget_s = budget_s or sweeps.CPU_BUDGET_S
    if not 0 < budget_s <= sweeps.CPU_MAX_BUDGET_S:
        raise LabError(f"budget_s must be in (0, {sweeps.CPU_MAX_BUDGET_S}] s, got {budget_s!r}")
    return budget_s


def _time_parts(built, step, after, budget_s: float) -> dict:
    """{"whole": seconds of the step as timed, "timed": of the step with the clock hooked in, each
    category's seconds, "noisy", "samples", "form", "kernels"}: `_cpu_parts` or `_cuda_parts`.
    `after()` runs untimed after every step (on CUDA inside the timing, as `sweeps` times a step)."""
    return (_cuda_parts if built.device.type == "cuda" else _cpu_parts)(built, step, after, budget_s)


def _cpu_parts(built, step, after, budget_s: float) -> dict:
    """The fastest confirmed sample of "whole" (the step called one by one, as timed below),
    "timed" (the same step with the clock hooked in) and each category's parts within it."""
    def sample() -> dict[str, float]:
        built.clock = CALL_BY_CALL  # the same calls as the timed run (no one-call CPU step)
        try:
            whole_s = call_seconds(step)
        finally:
            built.clock = OFF
        after()
        clock = Clock()
        built.clock = clock
        try:
            timed_s = call_seconds(step)
        finally:
            built.clock = OFF
        after()
        return {"whole": whole_s, "timed": timed_s, **clock.seconds}

    wait_for_quiet(quiet_wait_s())  # not while the browser still draws the last chart (as sweeps' points)
    load = cpu_info.load_snapshot()
    timings = sample_until_stable(sample, budget_s, sweeps.CPU_MAX_BUDGET_S, max_samples=sweeps.CPU_MAX_SAMPLES)
    others = cpu_info.others_busy_share(load, BUSY_WINDOW_S)
    return {**{name: t.estimate_s for name, t in timings.items()}, "noisy": any(t.noisy for t in timings.values()),
            "samples": len(timings["whole"].samples_s), "form": CPU_FORM, "kernels": None,
            "others_busy_share": others, "disturbed": others is not None and others > OTHERS_BUSY_LIMIT}


def _cuda_parts(built, step, after, budget_s: float) -> dict:
    """The step whole as `sweeps` times it on CUDA (events, the median), and its parts as the GPU's
    time in each category's kernels (`gpu_profile`, PROFILED_STEPS steps). `budget_s` is the CPU's."""
    def run():
        step()
        after()

    whole = measure.time_fn(run, "cuda", sweeps.CUDA_WARMUP, sweeps.CUDA_REPEATS, sweeps.CUDA_BUDGET_S)
    seconds, kernels = gpu_profile.seconds_by_category(run, PROFILED_STEPS)
    if not kernels:
        raise LabError("torch's profiler recorded no GPU kernels here (CUPTI missing, or not allowed to read the "
                       "GPU's counters), so the step cannot be split; measure it whole with `measure`")
    return {"whole": whole.estimate_s, "timed": whole.estimate_s, **{c: seconds.get(c, 0.0) for c in CATEGORIES},
            "noisy": whole.noisy, "samples": len(whole.samples_s), "form": CUDA_FORM, "kernels": kernels[:20]}


# ------------------------------------------------------------------ the record
def _split(phase: str, built, timings: dict, work: dict, working_set_bytes: int, measure_by: str,
           **shape) -> dict:
    """The flat record: the whole, each part beside its roof, and the step's fraction of the rate
    it is judged by (`measure_by` "flops": peak FLOP/s; "bytes": the roof's bandwidth)."""
    dtype = built.compute_dtype
    hardware, _ = calibrate.load_or_calibrate(built.device.type)
    roof = roofline.roof_at_working_set(hardware, working_set_bytes)
    rate = roof.peak_flops_per_s(dtype) if measure_by == "flops" else roof.memory_bandwidth_bytes_per_s
    whole_s = timings["whole"]
    parts_s = sum(timings[c] for c in CATEGORIES)
    seconds = {**{c: timings[c] for c in CATEGORIES}, "overhead": max(0.0, whole_s - parts_s)}
    what = WHAT_ON_CUDA if built.device.type == "cuda" else WHAT
    rows = []
    for part in PARTS:
        flops, nbytes = (work[part]["flops"], work[part]["bytes"]) if part in work else (0, 0)
        roof_s = roofline.roofline_time_s(flops, nbytes, roof, dtype) if part in work else 0.0
        done = flops if measure_by == "flops" else nbytes
        rate_fraction = done / (seconds[part] * rate) if seconds[part] > 0 else 0.0
        rows.append({"category": part, "name": NAMES[part], "what": what[part], "time_s": seconds[part],
                     "share": seconds[part] / whole_s, "flops": flops, "bytes": nbytes, "roof_time_s": roof_s,
                     "bound": roofline.bound_by(flops, nbytes, roof, dtype) if part in work else None,
                     "roof_fraction": roof_s / seconds[part] if part in work and seconds[part] > 0 else None,
                     "rate_fraction": rate_fraction,
                     "contributed_fraction": seconds[part] / whole_s * rate_fraction})
    flops_total = sum(w["flops"] for w in work.values())
    step_work = flops_total if measure_by == "flops" else sum(w["bytes"] for w in work.values())
    step_fraction = step_work / (whole_s * rate)
    return {"phase": phase, "device": built.device.type, "device_name": backend.device_name(built.device.type),
            "hardware": hardware.name, "model": built.spec.name, **shape, "compute_dtype": dtype,
            "kernels": built.decode_path.name if phase == "decode" else built.prefill_graph.name,
            "step_form": timings["form"],
            "time_s": whole_s, "timed_time_s": timings["timed"],
            "hook_cost_s": timings["timed"] - whole_s, "parts_time_s": parts_s,
            "parts_exceed_whole": parts_s > whole_s, "noisy": timings["noisy"],
            # CPU: other processes' share of the cores while it was timed, and whether it passed the limit
            "others_busy_share": timings.get("others_busy_share"), "disturbed": timings.get("disturbed", False),
            "samples": timings["samples"], "estimator": "median" if built.device.type == "cuda" else "fastest",
            "working_set_bytes": working_set_bytes, "roof_tier": roofline.memory_tier(working_set_bytes, hardware),
            "roof_bandwidth_bytes_per_s": roof.memory_bandwidth_bytes_per_s,
            "peak_flops_per_s": roof.peak_flops_per_s(dtype),
            "predicted_time_s": roofline.roofline_time_s(flops_total, working_set_bytes, roof, dtype),
            # the chapter's planning line for the whole step: 40 % of peak FLOP/s, 75 % of the bandwidth
            "planned_time_s": roofline.roofline_time_s(flops_total, working_set_bytes, roof, dtype,
                                                       roofline.CHAPTER_MFU, roofline.CHAPTER_BANDWIDTH_EFFICIENCY),
            "roof_parts_time_s": roofline.in_turn_time_s(work, roof, dtype),  # the parts in turn
            "flops": flops_total, "bytes": sum(w["bytes"] for w in work.values()),  # every part's, counted
            "measured_by": "peak FLOP/s" if measure_by == "flops" else "bandwidth",
            "step_fraction": step_fraction,
            "plan_fraction": roofline.CHAPTER_MFU if measure_by == "flops" else roofline.CHAPTER_BANDWIDTH_EFFICIENCY,
            "categories": rows,
            # CUDA: the 20 longest kernels a step (`gpu_profile`), the parts' makings
            **({"gpu_kernels": timings["kernels"]} if timings["kernels"] else {}),
            # far from its roof, the bandwidth of its moment, so the line can say whether the calibration
            # or the step was off (`explore.moment_note`): lesson 04's breakdown read "104% of the DRAM
            # bandwidth, products at 119%" with no word on why (2-core EPYC VM)
            **sweeps.moment(built.device.type, "memory" if measure_by == "bytes" else "compute", step_fraction,
                            working_set_bytes, step_work / whole_s)}


# ------------------------------------------------------------------ set-up
def _random_tokens(spec: ModelSpec, shape, device) -> torch.Tensor:
    """Seeded random token ids on `device`: a step's time does not depend on which tokens."""
    return torch.randint(0, spec.vocab_size, shape, generator=torch.Generator().manual_seed(0)).to(device)

