"""The GPU check's kernel timings: each Triton kernel against its torch baseline, the roofline's
bound printed before each is timed (counts from labkit.roofline), and the headline numbers the
final line reports against the targets.

Targets: matmul >= 0.85 x torch.matmul; causal flash attention >= 400 TFLOP/s from P = 4k;
fp8/int8 decode attention >= 1.5 x as fast as over the float cache at long contexts.
"""
from __future__ import annotations

from .. import roofline
from ..units import format_rate, format_seconds
from .run import Run, quantized_cache, randn, rates, roof_text, roofs, run_steps

TARGET_MATMUL_VS_TORCH = 0.85
TARGET_FLASH_FLOPS_PER_S = 400e12
TARGET_QUANT_SPEEDUP = 1.5


def kernels_section(run: Run) -> dict:
    s = run.sizes
    steps = [(f"matmul {M}x{K}x{N}", lambda M=M, K=K, N=N: time_matmul(run, M, K, N)) for M, K, N in s.matmuls]
    steps += [(f"flash P={P}", lambda P=P: time_flash(run, P)) for P in s.flash_timings]
    steps += [(f"decode {c} B={B} S={S}", lambda B=B, S=S, c=c: time_decode(run, B, S, c))
              for B, S in s.decode_timings for c in (run.dtype, "fp8", "int8")]
    timings = run_steps(run, steps)
    times = {(t["shape"]["B"], t["shape"]["S"], t["cache_dtype"]): t["time_s"]
             for t in timings if t.get("kernel") == "decode_attention" and "time_s" in t}
    speedups = [{"batch": B, "context_tokens": S, "cache_dtype": c, "over": run.dtype,
                 "speedup": times[(B, S, run.dtype)] / t} for (B, S, c), t in times.items()
                if c != run.dtype and S >= s.long_context and (B, S, run.dtype) in times]
    for sp in speedups:
        run.log(f"decode B={sp['batch']} S={sp['context_tokens']}: {sp['cache_dtype']} cache "
                f"{sp['speedup']:.2f}x as fast as {run.dtype} (target >= {TARGET_QUANT_SPEEDUP})")
    summarize_kernels(run, timings, [sp["speedup"] for sp in speedups])
    return {"timings": timings, "quant_speedups": speedups}


def bench(run: Run, label: str, flops: float, nbytes: float, ours, baseline: str, base, target: str = "") -> dict:
    """Print the roof, then time the kernel and its torch baseline; rates and the speed ratio."""
    from ..measure import time_fn
    run.log(f"{label}: {flops / 1e9:,.3g} GFLOP, {nbytes / 2**20:,.3g} MiB; "
            + roof_text(run, lambda hw: roofline.roofline_time_s(flops, nbytes, hw, run.dtype)))
    s = run.sizes
    t_ours, t_base = (time_fn(fn, run.device, s.warmup, s.repeats, s.measure_budget_s) for fn in (ours, base))
    r = rates(run, flops, nbytes, t_ours)
    ratio = t_base.median_s / t_ours.median_s
    fractions = ", ".join(f"{r[f'roof_fraction_{k}']:.2f} of {k} roof" for k in roofs(run)
                          if r[f"roof_fraction_{k}"] is not None)
    host_bound = [name for name, t in (("triton", t_ours), (baseline, t_base)) if t.host_bound]
    run.log(f"  triton {format_seconds(t_ours.median_s)} = {format_rate(r['achieved_flops_per_s'], 'FLOP/s')}, "
            f"{format_rate(r['achieved_bytes_per_s'], 'B/s')} ({fractions}); {baseline} "
            f"{format_seconds(t_base.median_s)}: triton {ratio:.2f}x as fast{target}"
            + (f"; HOST-BOUND: {', '.join(host_bound)}" if host_bound else ""))
    return {**r, "baseline": baseline, "baseline_time_s": t_base.median_s, "ratio_to_baseline": ratio,
            "baseline_host_bound": t_base.host_bound}


def time_matmul(run: Run, M: int, K: int, N: int) -> dict:
    import torch
    from kernels.matmul import matmul
    a, b = randn(run, (M, K), 1), randn(run, (N, K), 2, scale=K ** -0.5).t()  # b: a weight's transpose, a view
    return {"kernel": "matmul", "shape": {"M": M, "K": K, "N": N},
            **bench(run, f"matmul {M}x{K}x{N} {run.dtype}", roofline.matmul_flops(M, K, N),
                    roofline.matmul_bytes(M, K, N, run.dtype), lambda: matmul(a, b),
                    "torch.matmul", lambda: torch.matmul(a, b), f" (target >= {TARGET_MATMUL_VS_TORCH})")}


def time_flash(run: Run, P: int) -> dict:
    """Causal self-attention over P tokens. SDPA gets K/V expanded to H heads: its fused kernels
    want equal head counts, and prefill attention is compute-bound, so reading 4x the K/V costs
    it little."""
    import torch.nn.functional as F
    from kernels.flash_attention import flash_attention
    H, Hkv, D = run.sizes.heads
    q, k, v = randn(run, (1, H, P, D), 3), randn(run, (1, Hkv, P, D), 4), randn(run, (1, Hkv, P, D), 5)
    kx, vx = k.repeat_interleave(H // Hkv, dim=1), v.repeat_interleave(H // Hkv, dim=1)
    flops = roofline.attention_flops(1, H, D, P, 0, "causal")
    nbytes = roofline.flash_attention_bytes(1, H, P, P, D, run.dtype, kv_heads=Hkv)  # q, o; k, v once
    target = f" (target >= {TARGET_FLASH_FLOPS_PER_S / 1e12:.0f} TFLOP/s)" if P >= run.sizes.flash_target_from else ""
    return {"kernel": "flash_attention", "causal": True, "shape": {"B": 1, "H": H, "Hkv": Hkv, "P": P, "D": D},
            **bench(run, f"flash P={P} {run.dtype}", flops, nbytes, lambda: flash_attention(q, k, v, causal=True),
                    "SDPA", lambda: F.scaled_dot_product_attention(q, kx, vx, is_causal=True), target)}


def time_decode(run: Run, B: int, S: int, cache_dtype: str) -> dict:
    """One query per sequence over full caches. The baseline is torch with no fused kernel:
    dequantise the cache to q's dtype, then SDPA with one query (GQA by enable_gqa)."""
    import torch
    import torch.nn.functional as F
    from kernels.decode_attention import decode_attention
    H, Hkv, D = run.sizes.heads
    q = randn(run, (B, H, D), 6)
    k, v, ks, vs = quantized_cache(run, randn(run, (B, Hkv, S, D), 7), randn(run, (B, Hkv, S, D), 8), cache_dtype)
    lengths = torch.full((B,), S, dtype=torch.int32, device=run.device)

    def dequantized(x, scale):  # [B, Hkv, S, D] in q's dtype
        return x if scale is None else x.to(q.dtype) * (scale[..., None] if scale.dim() else scale).to(q.dtype)

    def torch_decode():
        return F.scaled_dot_product_attention(q[:, :, None], dequantized(k, ks), dequantized(v, vs), enable_gqa=True)

    nbytes = roofline.decode_attention_bytes(B, H, Hkv, S, D, cache_dtype, run.dtype)
    return {"kernel": "decode_attention", "cache_dtype": cache_dtype,
            "shape": {"B": B, "H": H, "Hkv": Hkv, "S": S, "D": D},
            **bench(run, f"decode {cache_dtype} B={B} S={S}", roofline.decode_attention_flops(B, H, D, S), nbytes,
                    lambda: decode_attention(q, k, v, lengths, ks, vs, check_lengths=False),  # no host sync in the timing
                    "torch (dequantise + SDPA)", torch_decode)}


def summarize_kernels(run: Run, timings: list, speedups: list):
    """The headline numbers for the final line; None where nothing was measured."""
    def values(kernel, key, keep=lambda t: True):
        return [t[key] for t in timings if t.get("kernel") == kernel and key in t and keep(t)]
    ratios, decode = values("matmul", "ratio_to_baseline"), "decode_attention"
    flash = values("flash_attention", "achieved_flops_per_s", lambda t: t["shape"]["P"] >= run.sizes.flash_target_from)
    run.results.update({
        "matmul_min_ratio_to_torch": min(ratios, default=None),
        "flash_min_flops_per_s_at_target_p": min(flash, default=None),
        "decode_max_bandwidth_fraction_datasheet": max(values(decode, "bandwidth_fraction_datasheet"), default=None),
        "decode_max_bandwidth_fraction_calibrated": max(values(decode, "bandwidth_fraction_calibrated"), default=None),
        "quant_min_speedup_long_context": min(speedups, default=None),
        "targets_met": {"matmul": min(ratios) >= TARGET_MATMUL_VS_TORCH if ratios else None,
                        "flash": min(flash) >= TARGET_FLASH_FLOPS_PER_S if flash else None,
                        "quant": min(speedups) >= TARGET_QUANT_SPEEDUP if speedups else None}})
