"""Lesson 01: the two phases on a roofline: the calibrated roofline's curve, each phase's point on
it, the predicted lines measured prefill and decode are drawn against (with the chapter's plan,
the kernels-in-turn roof and the cache tiers), and the chapter's fix lists."""
from __future__ import annotations

from .. import roofline as r
from .. import workloads
from ..errors import whole_number
from ..specs import HardwareSpec, ModelSpec
from .points import log_grid

# ---- lesson 01: the two phases on a roofline
def roofline_curve(hardware: HardwareSpec, dtype: str = "bf16", low: float = 0.1,
                   high: float = 1e5) -> dict:
    """The roof: attainable FLOP/s = min(peak, intensity x bandwidth) over an intensity grid."""
    peak = hardware.peak_flops_per_s(dtype)
    bandwidth = hardware.memory_bandwidth_bytes_per_s
    grid = log_grid(low, high)
    return {"name": hardware.name, "dtype": dtype, "kind": hardware.kind,
            "intensity_flops_per_byte": grid,
            "attainable_flops_per_s": [min(peak, i * bandwidth) for i in grid],
            "ridge_flops_per_byte": r.ridge_point_flops_per_byte(hardware, dtype),
            "peak_flops_per_s": peak, "bandwidth_bytes_per_s": bandwidth}


def phase_points(model: ModelSpec, hardware: HardwareSpec, prompt_tokens: int, batch: int,
                 context_tokens: int = 0, dtype: str = "bf16", counting: r.Counting = r.CHAPTER) -> list[dict]:
    """Prefill (one prompt) and decode (one step of `batch` sequences) placed on the roofline."""
    prompt_tokens, batch = whole_number("prompt tokens", prompt_tokens), whole_number("batch", batch)
    context_tokens = whole_number("context tokens", context_tokens, low=0)
    prefill = r.prefill_intensity_flops_per_byte(model, prompt_tokens, 1, counting, dtype)
    decode = r.decode_intensity_flops_per_byte(model, batch, context_tokens, counting, dtype,
                                               dtype if dtype in r.CACHE_DTYPES else "bf16")
    # S=0 is an empty cache (the step reads the weights only); "S=0" alone reads as no decode at all
    cache = f"S={context_tokens:,}" if context_tokens else "empty cache"
    points = []
    for phase, intensity, label in (("prefill", prefill, f"prefill, P={prompt_tokens:,}"),
                                    ("decode", decode, f"decode, B={batch:,}, {cache}")):
        attainable = min(hardware.peak_flops_per_s(dtype), intensity * hardware.memory_bandwidth_bytes_per_s)
        bound = "compute" if intensity >= r.ridge_point_flops_per_byte(hardware, dtype) else "memory"
        points.append({"phase": phase, "label": label, "intensity_flops_per_byte": intensity,
                       "attainable_flops_per_s": attainable, "bound": bound})
    return points


def prefill_prediction(model: ModelSpec, hardware: HardwareSpec, prompts: list[int], dtype: str,
                       batch: int = 1, counting: r.Counting = r.KERNEL) -> dict:
    """Predicted prefill time for each prompt length on `hardware` (calibrated: efficiency 1),
    with the chapter's planning line and the roof's tiers (`with_plan_and_tiers`)."""
    time_s = lambda p, **plan: r.predicted_prefill_time_s(model, p, hardware, batch, dtype, counting, **plan)  # noqa: E731
    working_sets = [r.prefill_bytes(model, p, batch, dtype, r.cache_dtype_for(dtype), counting.params) for p in prompts]
    return with_plan_and_tiers({"prompt_tokens": list(prompts)}, prompts, time_s, working_sets, hardware)


def decode_prediction(model: ModelSpec, hardware: HardwareSpec, batches: list[int], context_tokens: int,
                      dtype: str, cache_dtype: str, counting: r.Counting = r.KERNEL) -> dict:
    """Predicted decode step time for each batch size at a fixed context length, with the
    chapter's planning line and the roof's tiers (`with_plan_and_tiers`), and in_turn_time_s: the
    step's kernels one after another, each at its own roof (`roofline.predicted_decode_step_in_turn_s`),
    which parts from the whole step's roof where the products turn compute-bound before the step does."""
    time_s = lambda b, **plan: r.predicted_decode_step_s(model, b, context_tokens, hardware, dtype,  # noqa: E731
                                                         cache_dtype, counting, **plan)
    working_sets = [r.decode_bytes_per_step(model, b, context_tokens, dtype, cache_dtype, counting.params) for b in batches]
    in_turn = [r.predicted_decode_step_in_turn_s(model, b, context_tokens, hardware, dtype, cache_dtype, counting)
               for b in batches]
    return with_plan_and_tiers({"batch": list(batches), "in_turn_time_s": in_turn}, batches, time_s, working_sets,
                               hardware)


def with_plan_and_tiers(prediction: dict, xs: list, time_s, working_sets: list[float], hardware: HardwareSpec) -> dict:
    """`prediction` plus, at each x: predicted_time_s (`time_s(x)`, the roof), planned_time_s
    (`time_s(x, mfu=CHAPTER_MFU, bandwidth_efficiency=CHAPTER_BANDWIDTH_EFFICIENCY)`, the chapter's
    planning line) and working_set_bytes; `tiers`, the marks where the working set crosses a
    measured tier edge (`tier_marks`), and `roof_tiers`, the tiers the line is drawn at."""
    plan = {"mfu": r.CHAPTER_MFU, "bandwidth_efficiency": r.CHAPTER_BANDWIDTH_EFFICIENCY}
    tiers = [r.memory_tier(w, hardware) for w in working_sets] if hardware.bandwidth_by_working_set else []
    return {**prediction, "predicted_time_s": [time_s(x) for x in xs], "planned_time_s": [time_s(x, **plan) for x in xs],
            "working_set_bytes": list(working_sets), "tiers": tier_marks(hardware, list(xs), working_sets),
            "roof_tiers": list(dict.fromkeys(tiers))}


def tier_marks(hardware: HardwareSpec, xs: list, working_sets: list[float]) -> list[dict]:
    """Where along a chart's x axis the working set crosses one of `hardware`'s measured tier
    edges (`roofline.tier_edges`), so a bend caused by the data leaving a cache is drawn as that:
    {"x", "label" ("past the L3: DRAM"), "detail"}. x is interpolated linearly in the working set
    between the two grid points around the edge. None on a datasheet (one bandwidth, no edges)."""
    if not hardware.bandwidth_by_working_set:
        return []
    marks, mib = [], 2**20
    for edge in r.tier_edges(hardware.bandwidth_by_working_set, hardware.cache_levels, hardware.memory_name):
        cross = edge["bytes"]
        for (x0, w0), (x1, w1) in zip(zip(xs, working_sets), zip(xs[1:], working_sets[1:])):
            if w0 != w1 and min(w0, w1) < cross <= max(w0, w1):
                marks.append({"x": x0 + (cross - w0) / (w1 - w0) * (x1 - x0), "label": edge["label"], "detail": (
                    f"working set {cross / mib:,.0f} MiB: the roof falls from {edge['from_bytes_per_s'] / 1e9:,.3g} "
                    f"to {edge['to_bytes_per_s'] / 1e9:,.3g} GB/s (the OS reports a {edge['cache_bytes'] / mib:,.0f} MiB "
                    f"{edge['from']})")})
                break
    return marks


def fix_lists() -> list[dict]:
    """The chapter's two fix lists (`workloads.PREFILL_LEVERS`, `DECODE_LEVERS`), one row per
    phase with the clock it sets and the resource it waits on, for a table."""
    return [{"phase": "prefill", "sets": "time to first token (TTFT)", "waits on": "arithmetic (FLOP/s)",
             "fixed by": ", ".join(workloads.PREFILL_LEVERS)},
            {"phase": "decode", "sets": "inter-token latency (ITL), tokens per second", "waits on": "memory bandwidth",
             "fixed by": ", ".join(workloads.DECODE_LEVERS)}]
