"""What each lesson's charts show, as plain data: lists of numbers keyed by name.

Views (`labkit.views`) only turn these into traces, so every number on a chart comes from here,
and everything here comes from `roofline` (predicted) or `sweeps` records (measured). No plotly,
no widgets, no torch: this module is testable headless and importable on a GPU image.
"""
from __future__ import annotations

import math

from . import batching, workloads
from . import roofline as r
from .errors import whole_number
from .specs import HardwareSpec, ModelSpec
from .timing import calls_phrase
from .units import format_rate, format_seconds


# ---- every lesson: grids, measured points and what to say about them
def log_grid(low: float, high: float, points: int = 64) -> list[float]:
    """`points` values spaced evenly in log between `low` and `high` (inclusive)."""
    step = (math.log10(high) - math.log10(low)) / (points - 1)
    return [10 ** (math.log10(low) + i * step) for i in range(points)]


def spread(low: int, high: int, step: int, count: int) -> list[int]:
    """`count` values from `low` to `high`, evenly spaced and snapped to the slider's `step`."""
    if count < 2:
        return [high]
    return sorted({low + round((high - low) * i / (count - 1) / step) * step for i in range(count)})


def measured_series(records: list[dict], x_key: str) -> dict:
    """Measured points sorted by `x_key`, with predicted time and residual (measured / predicted - 1),
    and each point's fraction of its roof (`roof_phrase`, in its hover label, with `moment_note`
    on a line of its own where the point was judged by its moment too). Noisy points (spread
    above measure.NOISY_SPREAD) are kept apart so charts can flag them."""
    rows = sorted(records, key=lambda rec: rec[x_key])
    series = {"x": [], "time_s": [], "predicted_time_s": [], "residual": [], "noisy": [],
              "spread": [], "roof_fraction": [], "label": []}
    for rec in rows:
        series["x"].append(rec[x_key])
        series["time_s"].append(rec["time_s"])
        series["predicted_time_s"].append(rec["predicted_time_s"])
        series["residual"].append(rec["time_s"] / rec["predicted_time_s"] - 1)
        series["noisy"].append(bool(rec.get("noisy", False)))
        series["spread"].append(rec.get("spread", 0.0))
        series["roof_fraction"].append(rec.get("roof_fraction"))
        roof = roof_phrase(rec) or f"{rec.get('bound', '')}-bound"
        moment = moment_note(rec)  # a point far from its roof: what the bandwidth just after it said
        timed = calls_phrase(rec.get("estimator", "median"), rec.get("samples", 1), rec.get("spread", 0.0),
                             _median_over_fastest(rec))
        series["label"].append(f"{rec.get('device_name', rec.get('device', '?'))}, {roof}, {timed}"
                               + (" (noisy)" if rec.get("noisy") else "") + (f"<br>{moment}" if moment else ""))
    return series


# The kernels-in-turn roof is shown where it lies more than 2 % off the whole step's (`in_turn_parts`):
# at batch 1 the two differ only by the few bytes the parts count besides.
IN_TURN_PARTS = 1.02
IN_TURN_LABEL = "predicted, kernels in turn (each at its own roof)"
PLAN_LABEL = (f"the chapter's planning line ({r.CHAPTER_MFU:.0%} of peak FLOP/s, "
              f"{r.CHAPTER_BANDWIDTH_EFFICIENCY:.0%} of bandwidth)")


def roof_phrase(point: dict) -> str | None:
    """How close a measured point came to its roof, beside the chapter's planning fraction:
    "0.62 of the memory-bound roof (L3 bandwidth; the chapter plans 0.75)" or "0.41 of the
    compute-bound roof (peak FLOP/s; the chapter plans 0.40)"; None without a roof fraction. A
    decode step whose kernels in turn (`roofline.in_turn_time_s`) take over IN_TURN_PARTS of its
    roof's time adds its fraction of theirs: ", 0.72 of the roof of its kernels in turn"."""
    if point.get("roof_fraction") is None or point.get("bound") not in ("compute", "memory"):
        return None
    bound = point["bound"]
    what = "peak FLOP/s" if bound == "compute" else (f"{point['roof_tier']} bandwidth" if point.get("roof_tier")
                                                     else "bandwidth")
    plan = point.get("plan_fraction") or r.chapter_plan_fraction(bound)
    said = f"{point['roof_fraction']:.2f} of the {bound}-bound roof ({what}; the chapter plans {plan:.2f})"
    if in_turn_parts([point.get("in_turn_predicted_time_s")], [point.get("predicted_time_s")]):
        said += f", {point['in_turn_roof_fraction']:.2f} of the roof of its kernels in turn"
    return said


def in_turn_parts(in_turn, roof) -> bool:
    """Whether the kernels-in-turn roof (`roofline.in_turn_time_s`; times or tokens/s, None where
    not known) lies more than IN_TURN_PARTS off the whole step's anywhere: shown only then, in a
    point's line (`roof_phrase`) and as a chart's dotted line (`views`), not as a second line
    under the first where every part is bound by the same resource."""
    return any(a and b and max(a / b, b / a) > IN_TURN_PARTS for a, b in zip(in_turn or (), roof))


def above_roof_note(fraction: float) -> str | None:
    """What a run faster than its roof (fraction > 1) means, in one sentence; None below it.

    A true roof cannot be beaten, so either the roof is stale (a calibration made when the
    machine was slower: a shared machine's bandwidth moved 2x within half an hour on the lab's
    VM) or the run read less from memory than counted (data kept in a cache between calls)."""
    if not fraction > 1.0:
        return None
    return (f"{fraction:.0%} of the calibrated roof: the machine is faster now than when it was "
            "calibrated, or data stayed in cache between calls; `python -m labkit calibrate --refresh` "
            "measures the roof again, `measure --bracket` judges one run by the bandwidth of its moment")


HOST_BOUND_NOTE = "host-bound: the GPU waited for Python to launch its work; this time measures the host, not the GPU"
L2_RESIDENT_NOTE = ("L2-resident: this working set is under twice the GPU's L2, so back-to-back calls may read it "
                    "from the L2, not HBM; left out of the conclusions")


def moment_note(point: dict, where_slow: str = " (`python -m labkit breakdown` shows which part)") -> str | None:
    """What the bandwidth read just after a point far from its roof says (`sweeps.with_moment`),
    in one sentence; None without that reading. Near the roof of its moment, the calibration was
    from another moment; far from it there too, the step itself is slow (`where_slow`: what says where)."""
    now = point.get("moment_bandwidth_bytes_per_s")
    if now is None:
        return None
    fraction = point["moment_roof_fraction"]
    said = (f"the memory read {format_rate(now, 'B/s')} at this working set just after it, where the "
            f"calibration has {format_rate(point['roof_bandwidth_bytes_per_s'], 'B/s')}: {fraction:.2f} of that roof")
    if fraction > 1.0:
        return said + ", over it too: data stayed in a cache between calls"
    if fraction >= r.FAR_FROM_ROOF:
        pace = "faster" if point["roof_bandwidth_bytes_per_s"] > now else "slower"
        return said + (f", so the calibration is from a {pace} moment than this one "
                       "(`python -m labkit calibrate --refresh` measures it again)")
    return said + ", so this step itself is slow here" + where_slow


def point_notes(point: dict) -> list[str]:
    """What a reader of one measured point should know beyond its numbers: that it beat its
    roof (`above_roof_note`), what the bandwidth of its moment says (`moment_note`), that its GPU
    waited on the host (`host_bound`), or that its working set could stay in a GPU's L2 between
    calls (`l2_resident`)."""
    moment = moment_note(point)  # where read, it says which of the above-roof note's two reasons it was
    notes = [moment or above_roof_note(point.get("roof_fraction", 0.0)),
             HOST_BOUND_NOTE if point.get("host_bound") else None,
             L2_RESIDENT_NOTE if point.get("l2_resident") else None]
    return [note for note in notes if note]


def reveal(question: str, unit: str | None, estimate, formula, measured, device_name: str, why: str,
           formula_label: str = "the formula, on this machine's calibrated roofline") -> dict:
    """A committed estimate beside the formula's answer and the measurement, with one line on the
    gap (`views.Predict` shows it). `unit` None: a choice, compared for equality; else numbers,
    compared as ratios (within a quarter counts as close)."""
    def shown(value):
        return value if unit is None else f"{value:,.3g}{'' if unit in ('×', '%') else ' '}{unit}"

    rows = [("your estimate", shown(estimate)), (formula_label, shown(formula)),
            (f"measured on {device_name}", shown(measured))]
    if unit is None:
        verdict = "matches" if estimate == measured else "differs from"
        agree = "agrees" if formula == measured else f"says {formula}"
        gap = f"Your pick {verdict} the measurement; the formula {agree}. Why: {why}."
    else:
        gap = (f"Your estimate is {_relative(estimate, measured)} the measurement; the formula is "
               f"{_relative(formula, measured)} it. Why: {why}.")
    return {"question": question, "rows": rows, "gap": gap}


def _relative(value: float, reference: float) -> str:
    """'within 10% of' or '2.1 times' — how `value` compares with `reference`."""
    if not value or not reference:
        return "not comparable with"
    ratio = value / reference
    if abs(ratio - 1) <= 0.25:
        return f"within {abs(ratio - 1):.0%} of"
    return f"{ratio:.2g} times"


def _median_over_fastest(point: dict) -> float | None:
    """The median call's time over the fastest's, from a measured point (None where not recorded)."""
    median, fastest = point.get("time_median_s"), point.get("time_min_s")
    return median / fastest if median and fastest else None


def point_summary(point: dict) -> str:
    """One measured point in a line for a status bar: measured beside predicted, the rate,
    how close to the roof, how it was timed, and `point_notes`."""
    rate = f"{point['tokens_per_s']:,.0f} tokens/s" if point.get("tokens_per_s") else None
    timed = calls_phrase(point.get("estimator", "median"), point["samples"], point.get("spread") or 0.0,
                         _median_over_fastest(point)) if point.get("samples") else None
    parts = [f"measured {format_seconds(point['time_s'])}" + (f" ({rate})" if rate else ""),
             f"predicted {format_seconds(point['predicted_time_s'])}",
             roof_phrase(point),
             f"on {point.get('device_name', point.get('device', '?'))}",
             timed, "noisy: the machine was busy, move the slider again to re-measure" if point.get("noisy") else None]
    return "; ".join(p for p in parts if p) + "".join(f" — {note}" for note in point_notes(point))


def recorded_series(recordings: list[dict], x_key: str, y_key: str = "time_s", include_dry_runs: bool = False,
                    **where) -> list[dict]:
    """Each recording's measured points (skipped or failed steps left out) as one series,
    labelled with the hardware and date it was recorded on, with which points were host-bound
    (the GPU waited on Python's launches: the host's rate, not the GPU's). `where` keeps only points whose
    fields equal the given values (model="llama-3.1-8b", cache_dtype="bf16", ...). Dry runs
    (toy sizes on a CPU) are left out unless `include_dry_runs`."""
    series = []
    for rec in recordings:
        if rec.get("dry_run") and not include_dry_runs:
            continue
        points = sorted((p for p in rec.get("points", []) if y_key in p and x_key in p
                         and all(p.get(k) == v for k, v in where.items())), key=lambda p: p[x_key])
        if points:
            prov = rec["provenance"]
            label = f"recorded: {prov.get('device_name') or prov['device']}, {str(prov['date'])[:10]}"
            series.append({"label": label, "x": [p[x_key] for p in points], "y": [p[y_key] for p in points],
                           "host_bound": [bool(p.get("host_bound")) for p in points],
                           "device": prov["device"], "path": rec.get("_path")})
    return series


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
    points = []
    for phase, intensity, label in (("prefill", prefill, f"prefill, P={prompt_tokens:,}"),
                                    ("decode", decode, f"decode, B={batch:,}, S={context_tokens:,}")):
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


# ---- lesson 02: prefill's two terms
def prefill_terms(model: ModelSpec, prompts: list[int], counting: r.Counting = r.CHAPTER) -> dict:
    """Linear and attention FLOPs of one prefill at each prompt length, attention's share of
    the total, and the crossover (the length where the two terms are equal)."""
    linear = [r.prefill_linear_flops(model, p, 1, counting.params) for p in prompts]
    attention = [r.prefill_attention_flops(model, p, 1, counting.attention) for p in prompts]
    return {"model": model.name, "prompt_tokens": list(prompts), "linear_flops": linear,
            "attention_flops": attention, "attention_share": [a / (a + b) for a, b in zip(attention, linear)],
            "crossover_tokens": r.crossover_tokens(model, counting)}


def share_curves(models: list[ModelSpec], prompts: list[int], counting: r.Counting = r.CHAPTER) -> list[dict]:
    """`prefill_terms` for each model: one attention-share curve and crossover per model."""
    return [prefill_terms(model, prompts, counting) for model in models]


def prefill_split_prediction(model: ModelSpec, hardware: HardwareSpec, prompts: list[int], dtype: str,
                             counting: r.Counting = r.KERNEL) -> dict:
    """Predicted prefill time with the attention term left out, and with it: the gap between
    the two is the quadratic bend. Same roofline as `prefill_prediction` (efficiency 1)."""
    cache = dtype if dtype in r.CACHE_DTYPES else "bf16"
    linear = [r.roofline_time_s(r.prefill_linear_flops(model, p, 1, counting.params),
                                r.prefill_bytes(model, p, 1, dtype, cache, counting.params), hardware, dtype)
              for p in prompts]
    return {"prompt_tokens": list(prompts), "linear_only_s": linear,
            "predicted_time_s": [r.predicted_prefill_time_s(model, p, hardware, 1, dtype, counting) for p in prompts]}


def prefill_cost_table(model: ModelSpec, hardware: HardwareSpec, prompts: list[int], mfu: float = r.CHAPTER_MFU,
                       counting: r.Counting = r.CHAPTER, dtype: str = "bf16") -> dict:
    """Compute time of each prompt at `mfu` of peak, split into its linear and attention parts,
    and each total's ratio to the first prompt's beside the ratio of token counts."""
    linear = [r.compute_time_s(r.prefill_linear_flops(model, p, 1, counting.params), hardware, dtype, mfu) for p in prompts]
    attention = [r.compute_time_s(r.prefill_attention_flops(model, p, 1, counting.attention), hardware, dtype, mfu)
                 for p in prompts]
    total = [a + b for a, b in zip(linear, attention)]
    return {"prompt_tokens": list(prompts), "linear_s": linear, "attention_s": attention, "total_s": total,
            "time_ratio": [t / total[0] for t in total], "token_ratio": [p / prompts[0] for p in prompts]}


def growth(records: list[dict], x_key: str, predicted: dict) -> dict:
    """From the shortest to the longest trustworthy measured point: how much x grew, how much
    the measured time grew, and how much the prediction grew with and without attention
    (`predicted` from `prefill_split_prediction`, which must contain both x values).

    Noisy points are left out (`left_out` counts them): a conclusion drawn from a time that a
    busy machine inflated would teach the opposite of the lesson; so are GPU points whose working
    set could stay in the L2 (`l2_resident`). With fewer than two clean
    points of different x, the ratios are None."""
    clean = sorted((rec for rec in records if not rec.get("noisy") and not rec.get("l2_resident")),
                   key=lambda rec: rec[x_key])
    result = {"left_out": len(records) - len(clean), "device_name": None, "from": None, "to": None,
              "x_ratio": None, "measured_ratio": None, "predicted_ratio": None, "linear_only_ratio": None}
    if len(clean) < 2 or clean[0][x_key] == clean[-1][x_key]:
        return result
    first, last = clean[0], clean[-1]
    at = {x: i for i, x in enumerate(predicted[x_key])}
    i, j = at[first[x_key]], at[last[x_key]]
    return {**result, "from": first[x_key], "to": last[x_key], "x_ratio": last[x_key] / first[x_key],
            "measured_ratio": last["time_s"] / first["time_s"],
            "predicted_ratio": predicted["predicted_time_s"][j] / predicted["predicted_time_s"][i],
            "linear_only_ratio": predicted["linear_only_s"][j] / predicted["linear_only_s"][i],
            "device_name": last.get("device_name", last.get("device"))}


def growth_line(g: dict, x_name: str = "P") -> str:
    """`growth` as the one sentence a lesson prints; says so when too few points were clean."""
    noisy = f" ({g['left_out']} noisy point(s) left out)" if g["left_out"] else ""
    if g["measured_ratio"] is None:
        return (f"Too few trustworthy points to compare{noisy}: the machine was busy while they were "
                "measured. Move the slider to re-measure them once it is quieter.")
    return (f"On {g['device_name']}: {x_name} from {g['from']:,} to {g['to']:,} is {g['x_ratio']:.1f}× the tokens; "
            f"measured time {g['measured_ratio']:.1f}×; predicted {g['predicted_ratio']:.1f}× with attention, "
            f"{g['linear_only_ratio']:.1f}× without{noisy}.")



# ---- lessons 02 and 04: where the time of one measured step goes (`breakdown`)
def breakdown_setting(b: dict) -> str:
    """What a `breakdown` record measured, in a few words: "prefill of P=1,024, B=1" or "decode
    step at B=1, S=1,024, fp32 cache"."""
    if b["phase"] == "prefill":
        return f"prefill of P={b['prompt_tokens']:,}, B={b['batch']:,}"
    return f"decode step at B={b['batch']:,}, S={b['context_tokens']:,}, {b['cache_dtype']} cache"


def breakdown_bars(b: dict) -> dict:
    """A `breakdown` record as chart data: each part's measured time and its time at the roof (ms),
    each with a hover line, and the whole step at the chapter's planning fraction."""
    rows = b["categories"]
    measured_hover, roof_hover = [], []
    for row in rows:
        roof = f", {row['roof_fraction']:.0%} of its roof" if row["roof_fraction"] is not None else ""
        measured_hover.append(f"{row['name']}: {format_seconds(row['time_s'])}, {row['share']:.0%} of the step{roof} "
                              f"({row['what']})")
        roof_hover.append(f"{row['name']} at the roof: {format_seconds(row['roof_time_s'])} ({row['bound']}-bound)"
                          if row["bound"] else f"{row['name']}: no time on the roofline")
    return {"parts": [row["category"] for row in rows], "names": [row["name"] for row in rows],
            "measured_ms": [1e3 * row["time_s"] for row in rows], "roof_ms": [1e3 * row["roof_time_s"] for row in rows],
            "measured_hover": measured_hover, "roof_hover": roof_hover, "plan_ms": 1e3 * b["planned_time_s"],
            "plan_label": f"the whole step at {b['plan_fraction']:.0%} of {b['measured_by']}",
            "title": f"Where the time goes: {b['model']}, {breakdown_setting(b)}, on {b['device_name']}"
                     + (" (noisy)" if b.get("noisy") else "")}


def breakdown_line(b: dict) -> str:
    """Where a step's fraction of the roof comes from, in sentences: the whole step's fraction
    of peak FLOP/s (prefill) or of bandwidth (decode) beside the chapter's plan, then each part's
    share of the time, its own fraction and the points it contributes (share x fraction; the
    points add up to the whole step's). Says so when the run was noisy or its parts outran it."""
    rate = b["measured_by"] if b["measured_by"] == "peak FLOP/s" else f"the {b['roof_tier']} bandwidth"
    points = lambda x: f"{100 * x:.0f} point{'' if round(100 * x) == 1 else 's'}"  # noqa: E731
    parts = []
    for row in b["categories"]:
        at = (f" at {row['rate_fraction']:.0%} of {'peak' if b['phase'] == 'prefill' else 'it'}"
              if row["rate_fraction"] else "")
        parts.append(f"{row['name']} {row['share']:.0%} of the time{at} ({points(row['contributed_fraction'])})")
    notes = []
    if b["parts_exceed_whole"]:
        notes.append(f"the parts summed to {b['parts_time_s'] / b['time_s'] - 1:.1%} more than the whole step, "
                     "so its overhead is below the timing's resolution and shown as 0")
    if b["noisy"]:
        notes.append("noisy: the machine was busy, run it again when it is quieter")
    # far from its roof: what the bandwidth of its moment said (`sweeps.moment`), else over it why it can be
    beyond = moment_note(b, ": its parts above say where") or above_roof_note(b["step_fraction"])
    if beyond:
        notes.append(beyond)
    return (f"On {b['device_name']}, this {breakdown_setting(b)} ran at {b['step_fraction']:.0%} of {rate} "
            f"(the chapter plans {b['plan_fraction']:.0%}). Each part adds its share of the time times its own "
            f"fraction: {'; '.join(parts)}." + "".join(f" Note: {note}." for note in notes))

# ---- lesson 03: FlashAttention
def attention_traffic(prompts: list[int], heads: int, kv_heads: int, head_dim: int, dtype: str = "bf16",
                      block_m: int = 128, score_dtype: str = "bf16") -> dict:
    """Bytes one layer's attention moves at each length (P = S, batch 1): naive (scores written
    and read back), flash with no cache reuse (K, V re-read per query tile) and flash at best."""
    return {"prompt_tokens": list(prompts),
            "naive_bytes": [r.naive_attention_bytes(1, heads, p, p, head_dim, dtype, kv_heads, score_dtype)
                            for p in prompts],
            "flash_worst_bytes": [r.flash_attention_bytes(1, heads, p, p, head_dim, dtype, kv_heads, block_m)
                                  for p in prompts],
            "flash_best_bytes": [r.flash_attention_bytes(1, heads, p, p, head_dim, dtype, kv_heads) for p in prompts]}


def memory_series(points: list[dict], heads: int, prompts: list[int]) -> dict:
    """Measured peak memory per method from `attention.memory_sweep`, the naive footprint
    predicted over `prompts`, and the refusals (length and message)."""
    def measured(method):
        rows = [p for p in points if p["method"] == method and "peak_bytes" in p]
        return {"tokens": [p["tokens"] for p in rows], "peak_bytes": [p["peak_bytes"] for p in rows]}
    return {"naive": measured("naive"), "flash": measured("flash"),
            "predicted": {"tokens": list(prompts),
                          "bytes": [r.naive_attention_footprint_bytes(1, heads, p, p, "fp32") for p in prompts]},
            "refused": [{"method": p["method"], "tokens": p["tokens"], "message": p["refused"]}
                        for p in points if "refused" in p],
            "device_name": next((p["device_name"] for p in points if "device_name" in p), "?")}


def histogram(values: list[float], bins: int = 40) -> dict:
    """Counts of `values` in `bins` equal-width bins from 0 to their maximum (for |errors|)."""
    top = max(values, default=0.0) or 1.0
    counts = [0] * bins
    for v in values:
        counts[min(int(v / top * bins), bins - 1)] += 1
    return {"centres": [(i + 0.5) * top / bins for i in range(bins)], "counts": counts, "width": top / bins}


# ---- lesson 04: decode and the cache read
def decode_readout(record: dict) -> dict:
    """One `sweeps.measure_decode` record as chart data: step time and tokens/s, measured and
    predicted; the weights' and the cache's bytes in the step's read; the cache share and regime."""
    cache = record["cache_share"] * record["bytes"]
    times = [record["time_s"], record["predicted_time_s"]] + ([record["planned_time_s"]] if "planned_time_s" in record else [])
    return {"bars": ["measured", "roofline", "chapter's plan"][:len(times)], "time_ms": [1e3 * t for t in times],
            "tokens_per_s": [record["tokens_per_s"]] + [record["batch"] / t for t in times[1:]],
            "weights_bytes": record["bytes"] - cache, "cache_bytes": cache,
            "cache_share": record["cache_share"], "regime": record["regime"],
            "label": (f"B={record['batch']}, S={record['context_tokens']:,}, cache {record['cache_dtype']} "
                      f"on {record.get('device_name', record['device'])}")}


def regime_bands() -> list[dict]:
    """The three decode regimes as ranges of the cache's share of the read (roofline's bounds)."""
    low, high = r.WEIGHTS_DOMINATED_BELOW, r.CACHE_DOMINATED_FROM
    return [{"regime": r.decode_regime(a), "from": a, "to": b} for a, b in ((0.0, low), (low, high), (high, 1.0))]


def cache_share_curves(model: ModelSpec, contexts: list[int], batches: list[int], weight_dtype: str = "bf16",
                       cache_dtype: str = "bf16") -> list[dict]:
    """The cache's share of one decode step's read against context length, one curve per batch."""
    return [{"batch": b, "context_tokens": list(contexts),
             "cache_share": [r.cache_share(model, b, s, weight_dtype, cache_dtype) for s in contexts]}
            for b in batches]


def chapter_decode_choices(model: ModelSpec, hardware: HardwareSpec) -> list[dict]:
    """Three of the chapter's decode figures, each recomputed with the assumption it hides."""
    eff, weights = r.CHAPTER_BANDWIDTH_EFFICIENCY, r.weight_bytes(model)
    alone = r.tokens_per_s_per_sequence(r.memory_time_s(weights, hardware, eff))
    rounded = r.tokens_per_s_per_sequence(r.memory_time_s(round(weights, -9), hardware, eff))
    bf16, fp8 = r.decode_compute_bound_batch(model, hardware), r.decode_compute_bound_batch(model, hardware, weight_dtype="fp8")
    return [
        {"figure": "tokens/s for one user", "assumption": f"{eff:.0%} of {hardware.memory_bandwidth_bytes_per_s / 1e12:.2f} TB/s",
         "recomputed": f"{alone:.1f} with {weights / 1e9:.2f} GB of weights; {rounded:.1f} with them rounded to {round(weights, -9) / 1e9:.0f} GB"},
        {"figure": "batch where decode turns compute-bound", "assumption": "8-bit weights, bf16 arithmetic",
         "recomputed": f"{bf16:.0f} with bf16 weights (the ridge itself); {fp8:.0f} with 8-bit weights"},
        {"figure": "cache share at 2,000 tokens, batch 1", "assumption": "prefill's attention share",
         "recomputed": f"decode cache share {r.cache_share(model, 1, 2000):.1%}; "
                       f"prefill attention share {r.attention_share(model, 2000):.1%}"},
    ]


def throughput_prediction(model: ModelSpec, hardware: HardwareSpec, batches: list[int], context_tokens: int,
                          dtype: str, cache_dtype: str, counting: r.Counting = r.KERNEL) -> dict:
    """Predicted decode throughput (batch / step time, tokens/s) and the batch where decode
    becomes compute-bound on `hardware`'s cache-aware roof, where the predicted line goes flat
    (`roofline.decode_compute_bound_batch_at_roof`; None if the cache read keeps it bandwidth-bound);
    in_turn_tokens_per_s, the same with the step's kernels in turn (`decode_prediction`)."""
    steps = decode_prediction(model, hardware, batches, context_tokens, dtype, cache_dtype, counting)
    bound = r.decode_compute_bound_batch_at_roof(model, hardware, context_tokens, dtype, cache_dtype, dtype, counting)
    return {"batch": list(batches), "tokens_per_s": [b / t for b, t in zip(batches, steps["predicted_time_s"])],
            "planned_tokens_per_s": [b / t for b, t in zip(batches, steps["planned_time_s"])],
            "in_turn_tokens_per_s": [b / t for b, t in zip(batches, steps["in_turn_time_s"])],
            "tiers": steps["tiers"], "roof_tiers": steps["roof_tiers"], "compute_bound_batch": bound}


def batches_through_ridge(batches: list[int], compute_bound_batch: float | None, most: int) -> list[int]:
    """`batches` plus, when the roofline's compute-bound batch is past them but within `most`,
    that batch (rounded up) and one half as large again: a sweep that reaches the ridge, so its
    mark sits among measured points instead of past the last one."""
    extra = []
    if compute_bound_batch is not None and max(batches) < compute_bound_batch <= most:
        ridge = math.ceil(compute_bound_batch)
        extra = [ridge, min(most, math.ceil(1.5 * ridge))]
    return sorted(set(batches) | set(extra))


def throughput_series(records: list[dict]) -> dict:
    """Measured decode throughput (batch / step time) by batch, with each point's device and, for
    hovering, the bandwidth it achieved: the diagnostic that tells a ridge plateau (achieved
    bandwidth falls) from a cache plateau (it stays near the roof)."""
    rows = sorted(records, key=lambda rec: rec["batch"])
    return {"batch": [rec["batch"] for rec in rows], "tokens_per_s": [rec["tokens_per_s"] for rec in rows],
            "hover": [", ".join(filter(None, (f"{rec['tokens_per_s']:,.0f} tokens/s; achieved "
                                              f"{rec['achieved_bytes_per_s'] / 1e9:,.1f} GB/s", roof_phrase(rec))))
                      for rec in rows],
            "device_name": rows[0].get("device_name", rows[0]["device"]) if rows else "?"}


def context_prediction(model: ModelSpec, hardware: HardwareSpec, contexts: list[int], batch: int, dtype: str,
                       cache_dtype: str, counting: r.Counting = r.KERNEL) -> dict:
    """Predicted decode step time at each context length for a fixed batch, with the chapter's
    planning line and the roof's tiers (`with_plan_and_tiers`)."""
    time_s = lambda s, **plan: r.predicted_decode_step_s(model, batch, s, hardware, dtype, cache_dtype,  # noqa: E731
                                                         counting, **plan)
    working_sets = [r.decode_bytes_per_step(model, batch, s, dtype, cache_dtype, counting.params) for s in contexts]
    return with_plan_and_tiers({"context_tokens": list(contexts)}, contexts, time_s, working_sets, hardware)


# ---- lesson 05: static vs continuous batching
def batching_bars(request_sets: dict, max_batch: int, step_time_s, prefill_time_s=None) -> dict:
    """Static and continuous batching on each request set: slot utilisation (%) and output
    throughput (tokens/s), as bar-chart lists in the order of `request_sets`."""
    bars = {"sets": list(request_sets), "max_batch": max_batch}
    for policy in ("static", "continuous"):
        bars[policy] = {"utilisation_pct": [], "tokens_per_s": [], "ttft_p50_s": []}
    for rows in request_sets.values():
        result = batching.compare(rows, max_batch, step_time_s, prefill_time_s)
        for policy in ("static", "continuous"):
            bars[policy]["utilisation_pct"].append(100 * result[policy]["slot_utilisation"])
            bars[policy]["tokens_per_s"].append(result[policy]["throughput_tokens_per_s"])
            bars[policy]["ttft_p50_s"].append(result[policy]["ttft_p50_s"])
    return bars


def batching_line(bars: dict) -> str:
    """`batching_bars` in one line: the max batch and each set's continuous over static throughput,
    "simulated at max batch 16; continuous / static throughput: chapter shapes 1.70x, ..."."""
    gains = ", ".join(f"{name} {continuous / static:.2f}x" for name, static, continuous in
                      zip(bars["sets"], bars["static"]["tokens_per_s"], bars["continuous"]["tokens_per_s"]))
    return f"simulated at max batch {bars['max_batch']}; continuous / static throughput: {gains}"


def step_time_curves(records: list[dict], step_time_s, context_tokens: int, name: str) -> list[dict]:
    """Measured decode points at `context_tokens` per sequence (markers) and the interpolated
    step time through them (a line), against batch, for `views.step_time_figure`."""
    points = sorted((rec["batch"], rec["time_s"]) for rec in records if rec["context_tokens"] == context_tokens)
    batches = list(range(1, 2 * max(b for b, _ in points) + 1))
    line = [float(step_time_s(b, b * context_tokens)) for b in batches]
    return [{"name": f"{name}: measured, {context_tokens:,} tokens each", "batch": [b for b, _ in points],
             "time_s": [t for _, t in points], "mode": "markers"},
            {"name": f"{name}: interpolated (extended past the last batch)", "batch": batches, "time_s": line}]


# ---- lesson 06: a long prefill among decoding streams
def interference_series(timeline) -> dict:
    """One `interference.Timeline` as chart data: each decode step's end (s) and the gap before
    it (ms), and the prefill chunks' (start, end) spans (s)."""
    ends = list(timeline.decode_end_s)
    gaps = [1e3 * g for g in timeline.gaps_s()]
    name = "no chunking" if not timeline.chunked else f"chunks of {timeline.chunk_tokens:,} tokens"
    return {"name": name, "end_s": ends[1:], "gap_ms": gaps, "chunks_s": list(timeline.chunk_spans_s),
            "device_name": timeline.device_name}


def interference_bars(timelines: list) -> dict:
    """Streams' worst and p99 gap, their undisturbed gap, and the long prompt's prefill time (ms),
    one bar per timeline."""
    rows = [t.summary() for t in timelines]
    return {"names": [interference_series(t)["name"] for t in timelines],
            "itl_max_ms": [1e3 * s["itl_max_s"] for s in rows], "itl_p99_ms": [1e3 * s["itl_p99_s"] for s in rows],
            "itl_undisturbed_ms": [1e3 * s["itl_undisturbed_s"] for s in rows],
            "prefill_wall_ms": [1e3 * s["prefill_wall_s"] for s in rows],
            "prefill_compute_ms": [1e3 * s["prefill_compute_s"] for s in rows]}


def interference_rows(timelines: list) -> list[dict]:
    """One table row per `interference.Timeline`: the streams' gaps and the prompt's prefill, in ms."""
    rows = []
    for t in timelines:
        s = t.summary()
        rows.append({"run": interference_series(t)["name"], "device": s["device_name"],
                     "undisturbed gap (ms)": f"{1e3 * s['itl_undisturbed_s']:,.0f}",
                     "p99 gap (ms)": f"{1e3 * s['itl_p99_s']:,.0f}", "worst gap (ms)": f"{1e3 * s['itl_max_s']:,.0f}",
                     "prefill, arrival to last chunk (ms)": f"{1e3 * s['prefill_wall_s']:,.0f}",
                     "chunks alone (ms)": f"{1e3 * s['prefill_compute_s']:,.0f}"})
    return rows


def chunk_view(run, unchunked, chunk_tokens: int) -> dict:
    """Lesson 06's chunk slider in one call: run the chunked timeline (`run(chunk_tokens=C)`, an
    `interference.run_timeline` with its sizes bound) and return it with everything the charts,
    the table and the status line show beside the fixed `unchunked` timeline."""
    timeline = run(chunk_tokens=chunk_tokens)
    summary = timeline.summary()
    return {"timeline": timeline, "series": interference_series(timeline),
            "bars": interference_bars([unchunked, timeline]), "rows": interference_rows([unchunked, timeline]),
            "status": (f"measured on {summary['device_name']}: worst gap {summary['itl_max_s'] * 1e3:,.0f} ms, "
                       f"prefill {summary['prefill_wall_s'] * 1e3:,.0f} ms")}


# ---- lesson 07: where a request's time goes, by workload shape
def scaled_shapes(scale: int = 1) -> list[dict]:
    """The chapter's shapes with prompt and output divided by `scale` (outputs at least 2, so
    every shape keeps a decode phase), in the chapter's order."""
    return [{"name": w.name, "title": w.title, "steps": w.steps,
             "prompt_tokens": max(1, round(w.prompt_tokens / scale)),
             "output_tokens": max(2, round(w.output_tokens / scale))} for w in workloads.WORKLOADS.values()]


def predicted_split(model: ModelSpec, hardware: HardwareSpec, batch: int) -> dict:
    """`workloads.request_time_split` for every shape on `hardware` at `batch`: shares (%) and
    per-request times, as bar-chart lists."""
    rows = workloads.time_split_table(model, hardware, batch)
    names = [workloads.get_workload(row["workload"]).title for row in rows]
    fits = [row["fits_in_memory"] for row in rows]
    too_big = [name for name, fit in zip(names, fits) if not fit]
    return {"titles": [name if fit else f"{name} (does not fit)" for name, fit in zip(names, fits)],
            "names": names, "noisy": [not fit for fit in fits],  # drawn pale, like an untrustworthy bar
            "prefill_pct": [100 * row["prefill_share"] for row in rows],
            "decode_pct": [100 * row["decode_share"] for row in rows],
            "prefill_s": [row["prefill_s"] for row in rows], "decode_s": [row["decode_s"] for row in rows],
            "chapter": [row["chapter_split"] for row in rows], "fits": fits,
            "label": f"{model.name} on {hardware.name} (roofline, chapter counting, {r.CHAPTER_MFU:.0%} MFU, "
                     f"{r.CHAPTER_BANDWIDTH_EFFICIENCY:.0%} of bandwidth), batch {batch}",
            "note": (f"at batch {batch}, {', '.join(too_big)} need more than the {hardware.name}'s "
                     f"{hardware.memory_bytes / 1e9:,.0f} GB (weights, every request's cache and the prefill's "
                     f"activations): their bars, drawn pale, show a batch that cannot run" if too_big else "")}


def measured_split(results: list[dict], titles: list[str]) -> dict:
    """`serving.serve_shapes` results (one per shape) as the same bar-chart lists, plus
    which shapes were too noisy to trust (their title says so; the chart pales their bars)."""
    first = results[0]
    noisy = [bool(x.get("noisy")) for x in results]
    return {"titles": [f"{t} (noisy)" if n else t for t, n in zip(titles, noisy)], "names": list(titles),
            "noisy": noisy,
            "prefill_pct": [100 * x["prefill_share"] for x in results],
            # where each share may lie, fastest to second-fastest call of each phase (serving.share_range)
            "prefill_pct_range": [tuple(100 * v for v in x["prefill_share_range"]) if "prefill_share_range" in x
                                  else None for x in results],
            "decode_pct": [100 * x["decode_share"] for x in results],
            "prefill_s": [x["prefill_s"] for x in results], "decode_s": [x["decode_s"] for x in results],
            "shapes": [f"{x['prompt_tokens']:,} / {x['output_tokens']:,}" for x in results],
            "label": f"{first['model']} measured on {first['device_name']} ({first['device']}), batch {first['batch']}"}


def split_extremes(split: dict) -> dict:
    """The shapes that lean furthest towards decode and towards prefill (lowest and highest
    prefill share), among the ranked shapes; None where none is ranked, the ranked shapes' names
    from most decode-heavy to most prefill-heavy, and the names left out. A shape is ranked unless
    it is flagged noisy and its share's range (`prefill_pct_range`, from the fastest to the second
    fastest call of each phase) meets another shape's range: an unconfirmed chat whose whole range
    lies far below every other shape's still leans furthest towards decode."""
    names = split.get("names", split["titles"])
    noisy = split.get("noisy", [False] * len(names))
    # Without its range a noisy shape could lie anywhere, a confirmed one where it was measured.
    ranges = [given or ((0.0, 100.0) if flag else (pct, pct)) for pct, flag, given in
              zip(split["prefill_pct"], noisy, split.get("prefill_pct_range", [None] * len(names)))]

    def placed(i: int) -> bool:  # its place in the order holds anywhere in its range
        (low, high) = ranges[i]
        return all(high < other_low or other_high < low for j, (other_low, other_high) in enumerate(ranges) if j != i)

    shapes = [(pct, name, flag and not placed(i))
              for i, (pct, name, flag) in enumerate(zip(split["prefill_pct"], names, noisy))]
    rows = sorted((pct, name) for pct, name, left_out in shapes if not left_out)
    noisy_names = [name for _, name, left_out in shapes if left_out]
    return {"decode_heaviest": rows[0][1] if rows else None, "prefill_heaviest": rows[-1][1] if rows else None,
            "order": [name for _, name in rows], "left_out": len(noisy_names), "left_out_names": noisy_names}


def split_extremes_line(split: dict) -> str:
    """`split_extremes` as the sentence a lesson prints."""
    ends = split_extremes(split)
    noisy = f" ({ends['left_out']} noisy shape(s) left out)" if ends["left_out"] else ""
    if len(ends["order"]) < 2:
        return f"Too few trustworthy shapes to compare{noisy}: run the cell again when the machine is quieter."
    pct = dict(zip(split.get("names", split["titles"]), split["prefill_pct"]))
    return (f"Furthest towards decode: {ends['decode_heaviest']} ({pct[ends['decode_heaviest']]:.0f}% prefill). "
            f"Furthest towards prefill: {ends['prefill_heaviest']} ({pct[ends['prefill_heaviest']]:.0f}% prefill){noisy}.")


def lever_rows() -> list[dict]:
    """Each shape's levers and the lab's advice (from `workloads`), for a table."""
    return [{"workload": w.title, "prompt / output": f"{w.prompt_tokens:,} / {w.output_tokens:,}"
             + (f" × {w.steps} steps" if w.steps > 1 else ""), "levers": ", ".join(w.levers), "why": w.helps}
            for w in workloads.WORKLOADS.values()]
