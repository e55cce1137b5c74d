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
