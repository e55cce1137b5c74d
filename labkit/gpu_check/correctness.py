"""The GPU check's correctness section: each kernel against its torch reference on fresh seeded
random inputs at the run's sizes, within the tolerance kernels/tolerances.py gives it (the table
the kernel tests read too). A failed check is the one thing that makes the command exit 1.

kernels/ (and with it triton) is imported inside the checks: the command chooses Triton's
interpreter, when it must, before triton is first imported.
"""
from __future__ import annotations

from .run import Run, quantized_cache, randn, run_steps

# Queries ~ 4 N(0, 1): scores of std 4 make softmax peaked and outputs O(1). With std 1 the output
# averages 64k random values to ~0.004, and a kernel returning zeros would pass the tolerance.
Q_SHARPNESS = 4.0


def correctness_section(run: Run) -> dict:
    s = run.sizes
    steps = [(f"matmul {M}x{K}x{N}", lambda M=M, K=K, N=N: check_matmul(run, M, K, N)) for M, K, N in s.matmuls]
    steps += [(f"flash P={P} S={S}", lambda P=P, S=S: check_flash(run, P, S)) for P, S in s.flash_checks]
    steps += [(f"decode {c} B={B} S={S}", lambda B=B, S=S, c=c: check_decode(run, B, S, c))
              for B, S in s.decode_checks for c in (run.dtype, "fp8", "int8")]
    steps += [(f"kv_quant {c}", lambda c=c: check_kv_quant(run, c)) for c in ("int8", "fp8")]
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
    from kernels.matmul import matmul, matmul_reference
    from kernels.tolerances import float_tolerance
    a, w = randn(run, (M, K), 1), randn(run, (N, K), 2, scale=K ** -0.5)  # w: an nn.Linear weight; c is O(1)
    return compare(run, f"matmul {M}x{K}x{N}", matmul(a, w.t()), matmul_reference(a, w.t()),
                   float_tolerance(run.dtype), kernel="matmul", shape={"M": M, "K": K, "N": N})


def check_flash(run: Run, P: int, S: int) -> dict:
    """Every head through the kernel; the fp32 reference on the query heads of the first two kv
    heads, which keeps its [P, S] score matrices small and still checks the GQA head mapping."""
    from kernels.flash_attention import attention_reference, flash_attention
    from kernels.tolerances import float_tolerance
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
    import torch
    from kernels.decode_attention import decode_attention, decode_attention_reference
    from kernels.tolerances import decode_attention_tolerance
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


def check_kv_quant(run: Run, cache_dtype: str) -> dict:
    """The Triton quantiser against its reference, in codes, and int8's scales (tolerances and
    their reasons: kernels/tolerances.py)."""
    import torch
    from kernels.kv_quant import quantize_kv, quantize_kv_reference
    from kernels.tolerances import INT8_SCALES, kv_quant_code_tolerance
    if cache_dtype == "fp8" and run.device != "cuda":
        run.log("kv_quant fp8: skipped (the interpreter miscasts fp32 -> fp8 inside a kernel)")
        return {"kernel": "kv_quant", "cache_dtype": "fp8", "passed": True,
                "skipped": "needs a GPU: the interpreter miscasts fp32 -> fp8 inside a kernel"}
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
