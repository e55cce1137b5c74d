"""What each lesson's charts show, as plain data: lists of numbers keyed by name.

Views (`labkit.views`) only turn these into traces, so every number on a chart comes from here,
and everything here comes from `roofline` (predicted) or `sweeps` records (measured). No plotly,
no widgets, no torch: this module is testable headless and importable on a GPU image.
"""
from __future__ import annotations

import math

from . import roofline as r
from .specs import HardwareSpec, ModelSpec


def log_grid(low: float, high: float, points: int = 64) -> list[float]:
    """`points` values spaced evenly in log between `low` and `high` (inclusive)."""
    step = (math.log10(high) - math.log10(low)) / (points - 1)
    return [10 ** (math.log10(low) + i * step) for i in range(points)]


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
    """Predicted prefill time for each prompt length on `hardware` (calibrated: efficiency 1)."""
    return {"prompt_tokens": list(prompts),
            "predicted_time_s": [r.predicted_prefill_time_s(model, p, hardware, batch, dtype, counting)
                                 for p in prompts]}


def decode_prediction(model: ModelSpec, hardware: HardwareSpec, batches: list[int], context_tokens: int,
                      dtype: str, cache_dtype: str, counting: r.Counting = r.KERNEL) -> dict:
    """Predicted decode step time for each batch size at a fixed context length."""
    return {"batch": list(batches),
            "predicted_time_s": [r.predicted_decode_step_s(model, b, context_tokens, hardware, dtype,
                                                           cache_dtype, counting) for b in batches]}


def measured_series(records: list[dict], x_key: str) -> dict:
    """Measured points sorted by `x_key`, with predicted time and residual (measured / predicted - 1).
    Noisy points (spread above measure.NOISY_SPREAD) are kept apart so charts can flag them."""
    rows = sorted(records, key=lambda rec: rec[x_key])
    series = {"x": [], "time_s": [], "predicted_time_s": [], "residual": [], "noisy": [],
              "spread": [], "label": []}
    for rec in rows:
        series["x"].append(rec[x_key])
        series["time_s"].append(rec["time_s"])
        series["predicted_time_s"].append(rec["predicted_time_s"])
        series["residual"].append(rec["time_s"] / rec["predicted_time_s"] - 1)
        series["noisy"].append(bool(rec.get("noisy", False)))
        series["spread"].append(rec.get("spread", 0.0))
        series["label"].append(f"{rec.get('device_name', rec.get('device', '?'))}, {rec.get('bound', '')}-bound")
    return series


# The model and slider ranges each device gets: on a CPU the lab's small model, sized so the
# phenomena fall inside these ranges in about 2 s a point; on a GPU the chapter's Llama 3.1 8B.
LAB_SETTINGS = {
    "cpu": {"model": "lab-cpu", "dtype": "fp32", "cache_dtype": "fp32",
            "prompt": (64, 4096, 64, 1024), "batch": (1, 64, 1, 1), "context": (0, 8192, 256, 1024)},
    "cuda": {"model": "llama-3.1-8b", "dtype": "bf16", "cache_dtype": "bf16",
             "prompt": (128, 32768, 128, 2048), "batch": (1, 256, 1, 1), "context": (0, 131072, 1024, 8192)},
}


def lab_settings(device: str) -> dict:
    """Model, dtypes and (low, high, step, default) slider ranges for `device` ("cpu" | "cuda")."""
    return LAB_SETTINGS[device]


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
    """From the shortest to the longest measured point: how much x grew, how much the measured
    time grew, and how much the prediction grew with and without attention (`predicted` from
    `prefill_split_prediction`, which must contain both x values)."""
    rows = sorted(records, key=lambda rec: rec[x_key])
    first, last = rows[0], rows[-1]
    at = {x: i for i, x in enumerate(predicted[x_key])}
    i, j = at[first[x_key]], at[last[x_key]]
    return {"from": first[x_key], "to": last[x_key], "x_ratio": last[x_key] / first[x_key],
            "measured_ratio": last["time_s"] / first["time_s"],
            "predicted_ratio": predicted["predicted_time_s"][j] / predicted["predicted_time_s"][i],
            "linear_only_ratio": predicted["linear_only_s"][j] / predicted["linear_only_s"][i],
            "device_name": last.get("device_name", last.get("device"))}


def recorded_series(recordings: list[dict], x_key: str, y_key: str = "time_s", include_dry_runs: bool = False,
                    **where) -> list[dict]:
    """Each recording's measured points (skipped or failed steps left out) as one series,
    labelled with the hardware and date it was recorded on. `where` keeps only points whose
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
                           "device": prov["device"], "path": rec.get("_path")})
    return series


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


# ---- lesson 04: decode and the cache read
def decode_readout(record: dict) -> dict:
    """One `sweeps.measure_decode` record as chart data: step time and tokens/s, measured and
    predicted; the weights' and the cache's bytes in the step's read; the cache share and regime."""
    cache = record["cache_share"] * record["bytes"]
    return {"time_ms": [1e3 * record["time_s"], 1e3 * record["predicted_time_s"]],
            "tokens_per_s": [record["tokens_per_s"], record["batch"] / record["predicted_time_s"]],
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


def throughput_prediction(model: ModelSpec, hardware: HardwareSpec, batches: list[int], context_tokens: int,
                          dtype: str, cache_dtype: str, counting: r.Counting = r.KERNEL) -> dict:
    """Predicted decode throughput (batch / step time, tokens/s) and the batch where decode
    becomes compute-bound on `hardware` (None if the cache read keeps it bandwidth-bound)."""
    times = [r.predicted_decode_step_s(model, b, context_tokens, hardware, dtype, cache_dtype, counting) for b in batches]
    bound = r.decode_compute_bound_batch(model, hardware, context_tokens, dtype, cache_dtype, dtype, counting)
    return {"batch": list(batches), "tokens_per_s": [b / t for b, t in zip(batches, times)],
            "compute_bound_batch": bound}


def throughput_series(records: list[dict]) -> dict:
    """Measured decode throughput (batch / median step time) by batch, with each point's device."""
    rows = sorted(records, key=lambda rec: rec["batch"])
    return {"batch": [rec["batch"] for rec in rows], "tokens_per_s": [rec["tokens_per_s"] for rec in rows],
            "device_name": rows[0].get("device_name", rows[0]["device"]) if rows else "?"}


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


# ---- lesson 02 (continued)
def spread(low: int, high: int, step: int, count: int) -> list[int]:
    """`count` values from `low` to `high`, evenly spaced and snapped to the slider's `step`."""
    if count < 2:
        return [high]
    return sorted({low + round((high - low) * i / (count - 1) / step) * step for i in range(count)})


# ---- lesson 04 (continued)
def context_prediction(model: ModelSpec, hardware: HardwareSpec, contexts: list[int], batch: int, dtype: str,
                       cache_dtype: str, counting: r.Counting = r.KERNEL) -> dict:
    """Predicted decode step time at each context length for a fixed batch."""
    return {"context_tokens": list(contexts),
            "predicted_time_s": [r.predicted_decode_step_s(model, batch, s, hardware, dtype, cache_dtype, counting)
                                 for s in contexts]}
