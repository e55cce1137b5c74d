"""Lessons 02 and 04: where one measured step's time goes (the breakdown), and decode's cache
read: the readout, the regimes, the cache's share, throughput against the batch, the context."""
from __future__ import annotations

import math

from .. import roofline as r
from ..specs import HardwareSpec, ModelSpec
from ..timing import busy_phrase
from ..units import format_seconds, machine_of
from .phases import decode_prediction, with_plan_and_tiers
from .points import above_roof_note, moment_note, roof_phrase

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
            "title": f"Where the time goes: {b['model']}, {breakdown_setting(b)}, on {machine_of(b)}"
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
    if b.get("disturbed"):
        notes.append(busy_phrase(b["others_busy_share"]) + ": run it again when it is quieter")
    # far from its roof: what the bandwidth of its moment said (`sweeps.moment`), else over it why it can be
    beyond = moment_note(b, ": its parts above say where") or above_roof_note(b["step_fraction"])
    if beyond:
        notes.append(beyond)
    return (f"On {machine_of(b)}, this {breakdown_setting(b)} ran at {b['step_fraction']:.0%} of {rate} "
            f"(the chapter plans {b['plan_fraction']:.0%}). Each part adds its share of the time times its own "
            f"fraction, in percentage points of the step's {b['step_fraction']:.0%}: {'; '.join(parts)}."
            + "".join(f" Note: {note}." for note in notes))

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
                      f"on {machine_of(record)}")}


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


def read_sizes_line(model: ModelSpec, dtype: str, cache_dtype: str) -> str:
    """What one decode step of `model` reads, in one line: the weights a step streams and the cache
    each token of context adds per sequence, so a learner can work out a step's read before the lab
    measures it (lesson 04's questions on the CPU's small model, whose sizes no lesson states)."""
    weights = r.weight_bytes(model, dtype, params="matmul")
    per_token = r.kv_bytes_per_token(model, cache_dtype)
    size = f"{weights / 1e9:.2f} GB" if weights >= 1e9 else f"{weights / 1e6:,.0f} MB"
    return (f"{model.name}: a decode step streams {size} of {dtype} weights, and each token of "
            f"context adds {per_token / 1024:,.1f} KiB of {cache_dtype} cache per sequence")


def chapter_decode_choices(model: ModelSpec, hardware: HardwareSpec) -> list[dict]:
    """Three of the chapter's decode figures, each recomputed with the assumption it hides."""
    eff, weights = r.CHAPTER_BANDWIDTH_EFFICIENCY, r.weight_bytes(model)
    alone = r.tokens_per_s_per_sequence(r.memory_time_s(weights, hardware, eff))
    rounded = r.tokens_per_s_per_sequence(r.memory_time_s(round(weights, -9), hardware, eff))
    bf16, fp8 = r.decode_compute_bound_batch(model, hardware), r.decode_compute_bound_batch(model, hardware, weight_dtype="fp8")
    return [
        {"figure": "tokens/s for one user", "assumption": f"{eff:.0%} of {hardware.memory_bandwidth_bytes_per_s / 1e12:.2f} TB/s",
         "recomputed": f"{alone:.1f} with {weights / 1e9:.2f} GB of weights; {rounded:.1f} with them rounded to {round(weights, -9) / 1e9:.0f} GB"},
        {"figure": "batch where decode turns compute-bound", "assumption": "not stated; one reading: 8-bit weights, bf16 arithmetic",
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
            "device_name": machine_of(rows[0]) if rows else "?"}


def context_prediction(model: ModelSpec, hardware: HardwareSpec, contexts: list[int], batch: int, dtype: str,
                       cache_dtype: str, counting: r.Counting = r.KERNEL) -> dict:
    """Predicted decode step time at each context length for a fixed batch, with the chapter's
    planning line and the roof's tiers (`with_plan_and_tiers`)."""
    time_s = lambda s, **plan: r.predicted_decode_step_s(model, batch, s, hardware, dtype, cache_dtype,  # noqa: E731
                                                         counting, **plan)
    working_sets = [r.decode_bytes_per_step(model, batch, s, dtype, cache_dtype, counting.params) for s in contexts]
    return with_plan_and_tiers({"context_tokens": list(contexts)}, contexts, time_s, working_sets, hardware)
