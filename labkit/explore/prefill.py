"""Lessons 02 and 03: prefill's two terms (linear work and quadratic attention, their shares,
costs and growth) and FlashAttention's traffic, memory and error."""
from __future__ import annotations

from .. import roofline as r
from ..specs import HardwareSpec, ModelSpec
from ..units import machine_of
from .points import efficiency_sentence

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
    the two is the quadratic bend. Same roofline as `prefill_prediction` (efficiency 1), the bytes
    at the bandwidth of the pass's working set for both (`roofline.roof_at_working_set`): with the
    linear term at the DRAM's, a short prompt on a CPU drew it above the prediction with attention
    (lab-cpu, P = 64: 1.29 ms against 0.90), a negative attention band."""
    def linear_only(p: int) -> float:
        nbytes = r.prefill_bytes(model, p, 1, dtype, r.cache_dtype_for(dtype), counting.params)
        return r.roofline_time_s(r.prefill_linear_flops(model, p, 1, counting.params), nbytes,
                                 r.roof_at_working_set(hardware, nbytes), dtype)
    linear = [linear_only(p) for p in prompts]
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

    Points timed on a busy machine are left out (`left_out` counts them): noisy ones (no second
    call confirmed the fastest) and disturbed ones (other programs kept the cores busy while they
    were timed, which slows even the fastest call, a short prompt's more than a long one's: lesson
    02 in the browser on the 2-core EPYC VM with one core kept busy measured 7.5x the time for 8x
    the tokens, a straight line where idle it bends). A conclusion drawn from those times would
    teach the opposite of the lesson. So are GPU points whose working set could stay in the L2
    (`l2_resident`). With fewer than two clean points of different x, the ratios are None."""
    clean = sorted((rec for rec in records
                    if not rec.get("noisy") and not rec.get("disturbed") and not rec.get("l2_resident")),
                   key=lambda rec: rec[x_key])
    result = {"left_out": len(records) - len(clean), "device_name": None, "from": None, "to": None,
              "x_ratio": None, "measured_ratio": None, "predicted_ratio": None, "linear_only_ratio": None,
              "from_roof_fraction": None, "to_roof_fraction": None}
    if len(clean) < 2 or clean[0][x_key] == clean[-1][x_key]:
        return result
    first, last = clean[0], clean[-1]
    at = {x: i for i, x in enumerate(predicted[x_key])}
    i, j = at[first[x_key]], at[last[x_key]]
    return {**result, "from": first[x_key], "to": last[x_key], "x_ratio": last[x_key] / first[x_key],
            "measured_ratio": last["time_s"] / first["time_s"],
            "predicted_ratio": predicted["predicted_time_s"][j] / predicted["predicted_time_s"][i],
            "linear_only_ratio": predicted["linear_only_s"][j] / predicted["linear_only_s"][i],
            "from_roof_fraction": first.get("roof_fraction"), "to_roof_fraction": last.get("roof_fraction"),
            "device_name": machine_of(last)}


def growth_line(g: dict, x_name: str = "P") -> str:
    """`growth` as the one sentence a lesson prints; says so when too few points were clean."""
    noisy = f" ({g['left_out']} point(s) timed on a busy machine left out)" if g["left_out"] else ""
    if g["measured_ratio"] is None:
        return (f"Too few trustworthy points to compare{noisy}: the machine was busy while they were "
                "measured. Move the slider to re-measure them once it is quieter.")
    efficiency = efficiency_sentence(g["predicted_ratio"], g.get("to_roof_fraction"), g.get("from_roof_fraction"),
                                     f"one at {x_name} = {g['to']:,}", f"prefill at {x_name} = {g['from']:,}",
                                     "the predicted")
    return (f"On {g['device_name']}: {x_name} from {g['from']:,} to {g['to']:,} is {g['x_ratio']:.1f}× the tokens; "
            f"measured time {g['measured_ratio']:.1f}×; predicted {g['predicted_ratio']:.1f}× with attention, "
            f"{g['linear_only_ratio']:.1f}× without{noisy}." + (f"\n{efficiency}" if efficiency else ""))

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
            "device_name": next((machine_of(p) for p in points if "device_name" in p), "?")}


def histogram(values: list[float], bins: int = 40) -> dict:
    """Counts of `values` in `bins` equal-width bins from 0 to their maximum (for |errors|)."""
    top = max(values, default=0.0) or 1.0
    counts = [0] * bins
    for v in values:
        counts[min(int(v / top * bins), bins - 1)] += 1
    return {"centres": [(i + 0.5) * top / bins for i in range(bins)], "counts": counts, "width": top / bins}
