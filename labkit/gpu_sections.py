"""The GPU check's five sections: what each checks or measures, and against which roof.

  calibration    where it runs (provenance), the datasheet's roof (labkit.specs, when the device
                 has a preset) and this machine's measured one (labkit.calibrate)
  correctness    each kernel against its torch reference, within kernels/tolerances.py's bound
                 (the table the kernel tests read too); a failure makes the command exit 1
  kernels        each Triton kernel against its torch baseline, the roof printed first (FLOP and
                 byte counts from labkit.roofline), headline numbers against the targets
  prefill_sweep, decode_sweep   the Llama-shaped model measured by labkit.sweeps, as the lessons
                 measure it, beside labkit.roofline's prediction on both roofs; a point that would
                 not fit is refused before anything is allocated

Targets: matmul >= 0.85 x torch.matmul; causal flash attention >= 400 TFLOP/s from P = 4k;
fp8/int8 decode attention >= 1.5 x as fast as over the float cache at long contexts.

Torch, kernels/ (triton) and the labkit modules that load torch are imported inside the
functions: the command chooses Triton's interpreter, when it must, before triton is imported.
"""
from __future__ import annotations

import dataclasses

from . import roofline, sizes
from .errors import FootprintError
from .explore import HOST_BOUND_NOTE
from .gpu_run import Run, command, error_line, quantized_cache, randn, rates, roof_text, roofs, run_steps
from .recordings import provenance
from .specs import get_model
from .units import format_rate, format_seconds

# Queries ~ 4 N(0, 1): scores of std 4 make softmax peaked and outputs O(1). With std 1 the output
# averages 64k random values to ~0.004, and a kernel returning zeros would pass the tolerance.
Q_SHARPNESS = 4.0
TARGET_MATMUL_VS_TORCH = 0.85
TARGET_FLASH_FLOPS_PER_S = 400e12
TARGET_QUANT_SPEEDUP = 1.5
CACHE_DTYPES = ("bf16", "fp8", "int8")
FP8_CAPABILITY = (8, 9)  # kernels/_runtime.MIN_CAPABILITY: fp8 e4m3 from Ada (L4, RTX 4090) on


def cache_dtypes(run: Run, float_cache: str) -> tuple:
    """The caches a run checks and times: `float_cache`, fp8 and int8; without fp8 on a GPU that
    has none (before sm_89: T4, A100), which the final line then names."""
    if run.device == "cuda":
        import torch  # after the arguments are checked
        if torch.cuda.get_device_capability() < FP8_CAPABILITY:
            run.results["not_on_this_gpu"] = "fp8 KV cache (needs compute capability 8.9: L4, RTX 4090, H100)"
            return (float_cache, "int8")
    return (float_cache, "fp8", "int8")


# ---------------------------------------------------------------- 1. calibration
def calibration_section(run: Run) -> dict:
    from . import calibrate  # loads torch
    p = provenance(run.device, command(run.args))
    run.log(f"{p['device_name']}, driver {p['driver']}, torch {p['torch']}, triton {p['triton']}, {p['date']}")
    ds = run.datasheet
    if ds:
        run.log(f"datasheet {ds.name}: {format_rate(ds.bf16_flops_per_s, 'FLOP/s')} bf16, "
                f"{format_rate(ds.memory_bandwidth_bytes_per_s, 'B/s')}, "
                f"ridge {roofline.ridge_point_flops_per_byte(ds):.0f} FLOP/byte")
    else:
        run.log("datasheet: none for this device in labkit.specs; fractions are of the calibration")

    def measure():  # measured afresh on a GPU (and cached for the sweeps); a dry run takes the cache
        run.calibrated, info = calibrate.load_or_calibrate(run.device, refresh=not run.args.dry_run, log=run.log)
        peak = getattr(run.calibrated, f"{run.dtype}_flops_per_s")
        run.log(f"calibrated: {format_rate(peak or 0, 'FLOP/s')} {run.dtype}, "
                f"{format_rate(run.calibrated.memory_bandwidth_bytes_per_s, 'B/s')}")
        return {"calibrated": dataclasses.asdict(run.calibrated), "calibration": info}

    return {"datasheet": dataclasses.asdict(ds) if ds else None, "steps": run_steps(run, [("calibrate", measure)])}

# ---------------------------------------------------------------- 2. correctness
def correctness_section(run: Run) -> dict:
    s = run.sizes
    steps = [(f"matmul {M}x{K}x{N}", lambda M=M, K=K, N=N: check_matmul(run, M, K, N)) for M, K, N in s.matmuls]
    steps += [(f"flash P={P} S={S}", lambda P=P, S=S: check_flash(run, P, S)) for P, S in s.flash_checks]
    steps += [(f"decode {c} B={B} S={S}", lambda B=B, S=S, c=c: check_decode(run, B, S, c))
              for B, S in s.decode_checks for c in cache_dtypes(run, run.dtype)]
    steps += [(f"kv_quant {c}", lambda c=c: check_kv_quant(run, c)) for c in ("int8", "fp8")]
    steps += [("add_rms_norm", lambda: check_add_rms_norm(run))]
    steps += [("swiglu", lambda: check_swiglu(run))]
    steps += [(f"rope_store {c}", lambda c=c: check_rope_store(run, c)) for c in cache_dtypes(run, run.dtype)]
    steps += [(f"rope_store prefill {c}", lambda c=c: check_rope_store_prefill(run, c))
              for c in cache_dtypes(run, run.dtype)]
    checks = run_steps(run, steps)
    # A check the budget skipped did not fail, but it did not pass either: the summary names it.
    run.results["correctness_passed"] = all(c.get("passed", True) for c in checks)
    run.results["correctness_not_run"] = {c["step"]: c["skipped"] for c in checks if "skipped" in c}
    return {"checks": checks, "all_passed": run.results["correctness_passed"],
            "not_run": run.results["correctness_not_run"]}


def compare(run: Run, label: str, out, ref, tolerance, **what) -> dict:
    """Max/mean abs error and pass/fail of |out - ref| <= atol + rtol |ref|, logged."""
    atol, rtol = tolerance
    err = (out.float() - ref.float()).abs()
    result = {**what, "dtype": run.dtype, "max_abs_err": err.max().item(), "mean_abs_err": err.mean().item(),
              "ref_max_abs": ref.float().abs().max().item(), "atol": atol, "rtol": rtol,
              "passed": bool((err <= atol + rtol * ref.float().abs()).all())}
    run.log(f"{label}: max abs err {result['max_abs_err']:.2e}, mean {result['mean_abs_err']:.2e} "
            f"(|ref| <= {result['ref_max_abs']:.2f}; atol {atol:g}, rtol {rtol:g}) "
            f"{'ok' if result['passed'] else 'FAILED'}")
    return result


def check_matmul(run: Run, M: int, K: int, N: int) -> dict:
    from kernels.matmul import matmul, matmul_reference  # triton: after the interpreter choice
    from kernels.tolerances import float_tolerance  # triton: after the interpreter choice
    a, w = randn(run, (M, K), 1), randn(run, (N, K), 2, scale=K ** -0.5)  # w: an nn.Linear weight; c is O(1)
    return compare(run, f"matmul {M}x{K}x{N}", matmul(a, w.t()), matmul_reference(a, w.t()),
                   float_tolerance(run.dtype), kernel="matmul", shape={"M": M, "K": K, "N": N})


def check_flash(run: Run, P: int, S: int) -> dict:
    """Every head through the kernel; the fp32 reference on the query heads of the first two kv
    heads, which keeps its [P, S] score matrices small and still checks the GQA head mapping."""
    from kernels.flash_attention import attention_reference, flash_attention  # triton: after the interpreter choice
    from kernels.tolerances import float_tolerance  # triton: after the interpreter choice
    H, Hkv, D = run.sizes.heads
    q, k, v = randn(run, (1, H, P, D), 3, Q_SHARPNESS), randn(run, (1, Hkv, S, D), 4), randn(run, (1, Hkv, S, D), 5)
    out, kv_heads = flash_attention(q, k, v, causal=True), min(Hkv, 2)
    heads = H // Hkv * kv_heads
    ref = attention_reference(q[:, :heads], k[:, :kv_heads], v[:, :kv_heads], causal=True)
    return compare(run, f"flash P={P} S={S}", out[:, :heads], ref, float_tolerance(run.dtype),
                   kernel="flash_attention", causal=True,
                   shape={"B": 1, "H": H, "Hkv": Hkv, "P": P, "S": S, "D": D}, heads_checked=heads)


def check_decode(run: Run, B: int, S: int, cache_dtype: str) -> dict:
    """Sequences of random lengths up to S (the last one full), so the masking is checked too."""
    import torch  # after the arguments are checked
    from kernels.decode_attention import (decode_attention,  # triton: after the interpreter choice
                                          decode_attention_reference)
    from kernels.tolerances import decode_attention_tolerance  # triton: after the interpreter choice
    H, Hkv, D = run.sizes.heads
    q = randn(run, (B, H, D), 6, Q_SHARPNESS)
    k, v, ks, vs = quantized_cache(run, randn(run, (B, Hkv, S, D), 7), randn(run, (B, Hkv, S, D), 8), cache_dtype)
    lengths = torch.randint(1, S + 1, (B,), generator=torch.Generator().manual_seed(9), dtype=torch.int32)
    lengths[-1] = S
    lengths = lengths.to(run.device)
    return compare(run, f"decode {cache_dtype} B={B} S={S}", decode_attention(q, k, v, lengths, ks, vs),
                   decode_attention_reference(q, k, v, lengths, ks, vs),
                   decode_attention_tolerance(run.dtype, cache_dtype), kernel="decode_attention",
                   cache_dtype=cache_dtype, shape={"B": B, "H": H, "Hkv": Hkv, "S": S, "D": D})


def _fp8_needs_a_gpu(run: Run, kernel: str, what: str | None = None) -> dict:
    """A check of `kernel` writing an fp8 cache, skipped off a GPU (logged as `what`, default the
    kernel's name): the interpreter miscasts fp32 -> fp8 inside a kernel."""
    run.log(f"{what or kernel} fp8: skipped (the interpreter miscasts fp32 -> fp8 inside a kernel)")
    return {"kernel": kernel, "cache_dtype": "fp8", "passed": True,
            "skipped": "needs a GPU: the interpreter miscasts fp32 -> fp8 inside a kernel"}


def check_kv_quant(run: Run, cache_dtype: str) -> dict:
    """The Triton quantiser against its reference, in codes, and int8's scales (tolerances and
    their reasons: kernels/tolerances.py)."""
    import torch  # after the arguments are checked
    from kernels.kv_quant import quantize_kv, quantize_kv_reference  # triton: after the interpreter choice
    from kernels.tolerances import INT8_SCALES, kv_quant_code_tolerance  # triton: after the interpreter choice
    if cache_dtype == "fp8" and run.device != "cuda":
        return _fp8_needs_a_gpu(run, "kv_quant")
    (B, S), (_, Hkv, D) = run.sizes.decode_checks[0], run.sizes.heads
    x = randn(run, (B, Hkv, S, D), 10, scale=3.0)
    scale = torch.tensor(0.5, device=run.device) if cache_dtype == "fp8" else None
    q, s = quantize_kv(x, cache_dtype, scale, use_triton=True)
    q_ref, s_ref = quantize_kv_reference(x, cache_dtype, scale)
    codes = kv_quant_code_tolerance(cache_dtype, compiled=run.device == "cuda")
    result = compare(run, f"kv_quant {cache_dtype} codes", q.float(), q_ref.float(), codes,
                     kernel="kv_quant", cache_dtype=cache_dtype, shape=list(x.shape))
    if cache_dtype == "int8":
        scales = compare(run, "kv_quant int8 scales", s, s_ref, INT8_SCALES)
        result.update(scale_max_abs_err=scales["max_abs_err"], passed=result["passed"] and scales["passed"])
    return result


def check_add_rms_norm(run: Run) -> dict:
    """The residual add and norm at the model's hidden size (H * D), a decode batch of rows."""
    from kernels.add_rms_norm import add_rms_norm, add_rms_norm_reference  # triton: after the interpreter choice
    from kernels.tolerances import float_tolerance  # triton: after the interpreter choice
    (B, _), (H, _, D) = run.sizes.decode_checks[0], run.sizes.heads
    x, delta, weight = randn(run, (B, H * D), 11), randn(run, (B, H * D), 12), 1 + randn(run, (H * D,), 13, scale=0.1)
    total, normed = add_rms_norm(x, delta, weight, 1e-5)
    total_ref, normed_ref = add_rms_norm_reference(x, delta, weight, 1e-5)
    result = compare(run, "add_rms_norm normed", normed, normed_ref, float_tolerance(run.dtype),
                     kernel="add_rms_norm", shape={"R": B, "N": H * D})
    sums = compare(run, "add_rms_norm sum", total, total_ref, float_tolerance(run.dtype))
    return {**result, "passed": result["passed"] and sums["passed"]}


def check_swiglu(run: Run) -> dict:
    """The MLP's gate over a decode batch of rows as wide as the model's hidden size (H * D) twice."""
    from kernels.swiglu import swiglu, swiglu_reference  # triton: after the interpreter choice
    from kernels.tolerances import float_tolerance  # triton: after the interpreter choice
    (B, _), (H, _, D) = run.sizes.decode_checks[0], run.sizes.heads
    gate_up = randn(run, (B, 2 * H * D), 19, scale=3.0)
    return compare(run, "swiglu", swiglu(gate_up), swiglu_reference(gate_up), float_tolerance(run.dtype),
                   kernel="swiglu", shape={"R": B, "F": H * D})


def check_rope_store(run: Run, cache_dtype: str) -> dict:
    """Decode's RoPE and cache write: q, and the cache rows it wrote at each sequence's position,
    against the reference on a copy of the same cache (codes for int8/fp8)."""
    import torch  # after the arguments are checked
    from kernels.rope_store import rope_and_store, rope_and_store_reference  # triton: after the interpreter choice
    from kernels.tolerances import float_tolerance  # triton: after the interpreter choice

    from .layer_math import rope_angles, rope_inverse_frequencies  # loads torch
    if cache_dtype == "fp8" and run.device != "cuda":
        return _fp8_needs_a_gpu(run, "rope_store")
    (B, S), (H, Hkv, D) = run.sizes.decode_checks[0], run.sizes.heads
    qkv = randn(run, (B, (H + 2 * Hkv) * D), 14, scale=2.0)
    cache = quantized_cache(run, randn(run, (B, Hkv, S, D), 16), randn(run, (B, Hkv, S, D), 17), cache_dtype)
    positions = torch.randint(0, S, (B,), generator=torch.Generator().manual_seed(18), dtype=torch.int32).to(run.device)
    # the model's angles for each row's position, viewed [B, D] as TritonOps.rope_and_store views them
    inv_freq = rope_inverse_frequencies(D, get_model(run.sizes.model).rope_theta, run.device)
    cos, sin = (t.reshape(B, D) for t in rope_angles(positions[:, None], inv_freq))
    mine, ref = ([t if t is None else t.clone() for t in cache] for _ in range(2))  # the kernel's and the reference's
    q, q_ref = rope_and_store(qkv, cos, sin, *mine, positions), rope_and_store_reference(qkv, cos, sin, *ref, positions)
    result = compare(run, f"rope_store {cache_dtype} q", q, q_ref, float_tolerance(run.dtype), kernel="rope_store",
                     cache_dtype=cache_dtype, shape={"B": B, "H": H, "Hkv": Hkv, "S": S, "D": D})
    return _caches_agree(run, f"rope_store {cache_dtype}", cache_dtype, mine, ref, result)


def _caches_agree(run: Run, what: str, cache_dtype: str, mine, ref, result: dict) -> dict:
    """`result` with the k and v caches the kernel wrote (`mine`) compared with the reference's: codes
    for int8/fp8 at the quantiser's code tolerance, else at the cache dtype's; the scales too, at
    INT8_SCALES: an int8 cache's per-token ones (the kernel divides by Triton's approximate
    division), and fp8's one layer scale, which both sides only read."""
    from kernels.tolerances import INT8_SCALES, float_tolerance, kv_quant_code_tolerance  # triton: after the interpreter choice
    codes = kv_quant_code_tolerance(cache_dtype, run.device == "cuda") if cache_dtype in ("int8", "fp8") \
        else float_tolerance(cache_dtype)
    for name, got, want in zip(("k", "v"), mine[:2], ref[:2]):
        stored = compare(run, f"{what} {name} cache", got.float(), want.float(), codes)
        result["passed"] = result["passed"] and stored["passed"]
    for name, got, want in zip(("k", "v"), mine[2:], ref[2:]):
        if got is not None and want is not None:
            stored = compare(run, f"{what} {name} scales", got.float(), want.float(), INT8_SCALES)
            result["passed"] = result["passed"] and stored["passed"]
    return result


def check_rope_store_prefill(run: Run, cache_dtype: str) -> dict:
    """A prefill's RoPE and cache write: the last flash check's P tokens of each sequence after
    a cached prefix, q and k rotated, and the cache rows it wrote, against the reference on a copy
    of the same cache (codes for int8/fp8)."""
    import torch  # after the arguments are checked
    from kernels.rope_store import rope_and_store_prefill, rope_and_store_prefill_reference  # triton: after the interpreter choice
    from kernels.tolerances import float_tolerance  # triton: after the interpreter choice

    from .layer_math import rope_angles, rope_inverse_frequencies  # loads torch
    if cache_dtype == "fp8" and run.device != "cuda":
        return _fp8_needs_a_gpu(run, "rope_store", "rope_store prefill")
    (B, _), (P, S), (H, Hkv, D) = run.sizes.decode_checks[0], run.sizes.flash_checks[-1], run.sizes.heads
    start = S - P  # the prompt's last P positions: a chunk after a cached prefix (0 for a whole prompt)
    qkv = randn(run, (B, P, (H + 2 * Hkv) * D), 20, scale=2.0)
    cache = quantized_cache(run, randn(run, (B, Hkv, S, D), 21), randn(run, (B, Hkv, S, D), 22), cache_dtype)
    inv_freq = rope_inverse_frequencies(D, get_model(run.sizes.model).rope_theta, run.device)
    cos, sin = (t.reshape(P, D) for t in rope_angles(torch.arange(start, S, device=run.device), inv_freq))
    mine, ref = ([t if t is None else t.clone() for t in cache] for _ in range(2))  # the kernel's and the reference's
    qk = rope_and_store_prefill(qkv, cos, sin, *mine, start)
    qk_ref = rope_and_store_prefill_reference(qkv, cos, sin, *ref, start)
    result = compare(run, f"rope_store prefill {cache_dtype} q, k", qk, qk_ref, float_tolerance(run.dtype),
                     kernel="rope_store", cache_dtype=cache_dtype,
                     shape={"B": B, "P": P, "S": S, "H": H, "Hkv": Hkv, "D": D})
    return _caches_agree(run, f"rope_store prefill {cache_dtype}", cache_dtype, mine, ref, result)


# ---------------------------------------------------------------- 3. kernel timing
def kernels_section(run: Run) -> dict:
    s = run.sizes
    steps = [(f"matmul {M}x{K}x{N}", lambda M=M, K=K, N=N: time_matmul(run, M, K, N)) for M, K, N in s.matmuls]
    steps += [(f"flash P={P}", lambda P=P: time_flash(run, P)) for P in s.flash_timings]
    steps += [(f"decode {c} B={B} S={S}", lambda B=B, S=S, c=c: time_decode(run, B, S, c))
              for B, S in s.decode_timings for c in cache_dtypes(run, run.dtype)]
    timings = run_steps(run, steps)
    times = {(t["shape"]["B"], t["shape"]["S"], t["cache_dtype"]): t["time_s"]  # host-bound, cache-resident: out
             for t in timings if t.get("kernel") == "decode_attention" and "time_s" in t and not left_out_why(t)}
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
    from .measure import time_fn  # loads torch
    run.log(f"{label}: {flops / 1e9:,.3g} GFLOP, {nbytes / 2**20:,.3g} MiB; "
            + roof_text(run, lambda hw: roofline.roofline_time_s(flops, nbytes, hw, run.dtype)))
    s = run.sizes
    # isolate: the GPU's time alone (launch cost out, L2 flushed for a working set under 2x L2).
    t_ours, t_base = (time_fn(fn, run.device, s.warmup, s.repeats, s.measure_budget_s, isolate=True,
                              working_set_bytes=nbytes) for fn in (ours, base))
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
            "baseline_host_bound": t_base.host_bound, "timing_method": t_ours.method,
            "l2_flushed": t_ours.l2_flushed, "l2_resident": l2_resident_unflushed(run, nbytes, t_ours)}


def l2_resident_unflushed(run: Run, nbytes: float, timing) -> bool | None:
    """Could this timing have read its working set from L2 (under 2x the L2, and not flushed)?"""
    if run.device != "cuda":
        return None
    from .measure import l2_bytes, l2_resident  # loads torch
    resident = l2_resident(nbytes, l2_bytes(run.device))
    return None if resident is None else resident and not timing.l2_flushed


def time_matmul(run: Run, M: int, K: int, N: int) -> dict:
    import torch  # after the arguments are checked
    from kernels.matmul import matmul  # triton: after the interpreter choice
    a, b = randn(run, (M, K), 1), randn(run, (N, K), 2, scale=K ** -0.5).t()  # b: a weight's transpose, a view
    return {"kernel": "matmul", "shape": {"M": M, "K": K, "N": N},
            **bench(run, f"matmul {M}x{K}x{N} {run.dtype}", roofline.matmul_flops(M, K, N),
                    roofline.matmul_bytes(M, K, N, run.dtype), lambda: matmul(a, b),
                    "torch.matmul", lambda: torch.matmul(a, b), f" (target >= {TARGET_MATMUL_VS_TORCH})")}


def time_flash(run: Run, P: int) -> dict:
    """Causal self-attention over P tokens. SDPA gets K/V expanded to H heads: its fused kernels
    want equal head counts, and prefill attention is compute-bound, so reading 4x the K/V costs
    it little."""
    import torch.nn.functional as F  # after the arguments are checked
    from kernels.flash_attention import flash_attention  # triton: after the interpreter choice
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
    import torch  # after the arguments are checked
    import torch.nn.functional as F  # after the arguments are checked
    from kernels.decode_attention import decode_attention  # triton: after the interpreter choice
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


def left_out_why(t: dict) -> str | None:
    """Why a timing stays out of the headline figures: its host issued the work as slowly as the
    GPU ran it (host-bound), or its working set could sit in L2 unflushed (cache-resident)."""
    if t.get("host_bound") or t.get("baseline_host_bound"):
        return "host-bound"
    if t.get("l2_resident"):
        return "cache-resident (working set under 2x L2, not flushed)"
    return None


def summarize_kernels(run: Run, timings: list, speedups: list):
    """The headline numbers for the final line; None where nothing was measured. Host-bound and
    cache-resident timings are left out, and named under "headline_left_out"."""
    kept = [t for t in timings if "time_s" in t and not left_out_why(t)]
    left_out = {t["step"]: left_out_why(t) for t in timings if "time_s" in t and left_out_why(t)}

    def values(kernel, key, keep=lambda t: True):
        return [t[key] for t in kept if t.get("kernel") == kernel and key in t and keep(t)]
    ratios, decode = values("matmul", "ratio_to_baseline"), "decode_attention"
    flash = values("flash_attention", "achieved_flops_per_s", lambda t: t["shape"]["P"] >= run.sizes.flash_target_from)
    run.results.update({
        "matmul_min_ratio_to_torch": min(ratios, default=None),
        "flash_min_flops_per_s_at_target_p": min(flash, default=None),
        "decode_max_bandwidth_fraction_datasheet": max(values(decode, "bandwidth_fraction_datasheet"), default=None),
        "decode_max_bandwidth_fraction_calibrated": max(values(decode, "bandwidth_fraction_calibrated"), default=None),
        "quant_min_speedup_long_context": min(speedups, default=None),
        "headline_left_out": left_out,
        "targets_met": {"matmul": min(ratios) >= TARGET_MATMUL_VS_TORCH if ratios else None,
                        "flash": min(flash) >= TARGET_FLASH_FLOPS_PER_S if flash else None,
                        "quant": min(speedups) >= TARGET_QUANT_SPEEDUP if speedups else None}})

# ---------------------------------------------------------------- 4. model sweeps
def sweep_section(run: Run, phase: str) -> dict:
    """Build the model once (labkit.sweeps keeps it) and measure each point with a fresh KV cache,
    refused before allocating if it does not fit; if the model itself does not fit, every point
    says so."""
    from . import sweeps  # loads torch
    try:
        model, why = sweeps.get_built_model(run.sizes.model, run.device), None
    except FootprintError as err:
        model, why = None, str(err)
    except Exception as err:  # noqa: BLE001 - a compile error or OOM in the warm-up: say so on every point
        model, why = None, f"the model could not be built: {error_line(err)}"
        run.log(f"{phase} sweep: ERROR {why}")
    steps = (prefill_steps if phase == "prefill" else decode_steps)(run, model)
    if model is None:
        steps = [(label, lambda: {"skipped": why}) for label, _ in steps]
    points = run_steps(run, steps)
    if model:
        model.release_cache()
    section = {"phase": phase, "model": run.sizes.model, "points": points}
    if phase == "decode" and "decode_sweep_not_offered" in run.results:  # set by decode_steps
        section["not_offered"] = run.results["decode_sweep_not_offered"]
    return section


def prefill_steps(run: Run, model) -> list:
    from . import sweeps  # loads torch

    def point(P):
        spec, dtype = model.spec, model.compute_dtype
        return sweep_point(run, model, {"phase": "prefill", "prompt_tokens": P, "batch": 1},
                           roofline.memory_footprint_bytes(spec, 1, P, dtype, dtype),
                           lambda hw: roofline.predicted_prefill_time_s(spec, P, hw, 1, dtype),
                           lambda: sweeps.measure_prefill(spec.name, P, 1, run.device, repeats=run.sizes.sweep_repeats))

    return [(f"prefill P={P}", lambda P=P: point(P)) for P in run.sizes.prompts]


def decode_steps(run: Run, model) -> list:
    """Per cache dtype: the batches at `context`, then batch 1 at the other `contexts`. A decode
    point fills its cache at random (no prefill), so it needs one position's activations."""
    from . import sweeps  # loads torch
    s = run.sizes

    def point(B, S, c):
        spec, dtype = model.spec, model.compute_dtype
        return sweep_point(run, model, {"phase": "decode", "batch": B, "context_tokens": S, "cache_dtype": c},
                           roofline.memory_footprint_bytes(spec, B, S + 1, dtype, c, prefill_tokens=1),
                           lambda hw: roofline.predicted_decode_step_s(spec, B, S, hw, dtype, c),
                           lambda: sweeps.measure_decode(spec.name, B, S, c, run.device, repeats=s.sweep_repeats))

    # The model's float cache: bf16, or fp16 on a GPU without bf16 (labkit.backend computes in it there).
    caches = cache_dtypes(run, "fp16" if run.device == "cuda" and run.dtype == "fp16" else CACHE_DTYPES[0])
    # a dry run on the CPU measures as the CPU's lab does: the cache dtypes it offers (sizes.NOT_OFFERED)
    refused = {c: why for c, why in sizes.NOT_OFFERED.get(run.device, {}).items() if c in caches}
    if refused:
        run.results["decode_sweep_not_offered"] = refused
        caches = tuple(c for c in caches if c not in refused)
    grid = [(B, s.context, c) for c in caches for B in decode_batches(run, model, c)]
    grid += [(1, S, c) for c in caches for S in s.contexts if S != s.context]
    return [(f"decode {c} B={B} S={S}", lambda B=B, S=S, c=c: point(B, S, c)) for B, S, c in grid]


def decode_batches(run: Run, model, cache_dtype: str) -> list[int]:
    """sizes.batches, then doubled while the last one fits (up to max_batch); the first that does
    not fit stays in the list, so the recording shows where memory ran out."""
    s, batches = run.sizes, list(run.sizes.batches)
    if model is not None:
        model.release_cache()
        spec, dtype = model.spec, model.compute_dtype
        while batches[-1] * 2 <= s.max_batch and not refusal(run, model, roofline.memory_footprint_bytes(
                spec, batches[-1], s.context + 1, dtype, cache_dtype, prefill_tokens=1), "decode"):
            batches.append(batches[-1] * 2)
    return batches


def refusal(run: Run, model, footprint_bytes: float, what: str) -> str | None:
    """Why backend.check_fits refuses what `footprint_bytes` adds to the resident weights, or None."""
    from .backend import check_fits  # loads torch
    try:
        check_fits(footprint_bytes - roofline.weight_bytes(model.spec, model.compute_dtype), run.device, what)
    except FootprintError as err:
        return str(err)
    return None


def sweep_point(run: Run, model, where: dict, footprint_bytes: float, predict, measure) -> dict:
    """One labkit.sweeps point: the old cache freed, the new one refused before allocating if it
    does not fit, else the roof printed, the point measured and the datasheet's roof added."""
    label = where["phase"] + " " + " ".join(f"{k}={v}" for k, v in where.items() if k != "phase")
    model.release_cache()
    refused = refusal(run, model, footprint_bytes, label)
    if refused:
        run.log(f"{label}: skipped, {refused}")
        return {**where, "skipped": refused}
    run.log(f"{label}: {roof_text(run, predict)}")
    point = measure()
    if run.datasheet:
        predicted_s = predict(run.datasheet)
        point.update(datasheet_predicted_time_s=predicted_s,
                     datasheet_roof_fraction=roofline.time_roof_fraction(predicted_s, point["time_s"]))
    run.log(f"  measured {format_seconds(point['time_s'])} = {point['roof_fraction']:.2f} of the calibrated roof "
            f"({point['bound']}-bound), {point['tokens_per_s']:,.0f} tokens/s, kernels {point['kernels']}"
            + (f"; {HOST_BOUND_NOTE}" if point.get("host_bound") else ""))
    return point
