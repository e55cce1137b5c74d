"""Time the decode-shaped kernels' tile candidates on this GPU, and the 8B's decode step before and after.

    LABKIT_GIT_COMMIT=<commit> PYTHONUNBUFFERED=1 python3 scripts/gpu_tune.py --out DIR [--budget-s 300]
        [--parts matmul,attention,step]  # some parts: the budget is theirs
    python3 scripts/gpu_tune.py --out DIR --dry-run      # toy sizes, on the CPU in Triton's interpreter

Why: the first GPU check (one H200, 2026-12-04, `labkit.gpu_check` at acbe82d) measured the
Llama-3.1-8B decode step at 19 ms for B = 1, S = 8k: 0.19 of its bandwidth roof, the weights
read at 0.84 TB/s, nearly the same time at every batch up to 64. The step's matmuls have M = B
rows and take kernels.matmul's split-K path, whose one tile (and one program per SM) was chosen
without a GPU. Decode attention over fp8 and int8 caches read 2 TB/s where bf16 read 4.2 (its
tiles hold half the bytes).

What it does, each part within its share of --budget-s:
  1. every split-K candidate (tile x programs per SM) on the step's products (qkv, o, gate_up,
     down, LM head) at M = 1 and 16, each checked against torch; the best by the step's total
     (32 layers of each product, one head) is timed at M = 64 too;
  2. every decode-attention candidate (tile x split programs per SM; over a 1-byte cache each
     tile also with V scaled in it, kernels.decode_attention's SCALE_V) over bf16, fp8 and int8
     caches at B = 1, S = 32k and 128k and B = 16, S = 8k, each checked against torch; the best
     per cache dtype by geometric mean of time;
  3. the decode step (labkit.sweeps.measure_decode, CUDA graph) at a few points with the
     current tiles, a profile of one step by kernel, the first points again with the residual
     adds, norms, RoPE, cache writes and SwiGLU as torch's separate ops (what kernels/add_rms_norm.py,
     kernels/rope_store.py and kernels/swiglu.py replaced: "unfused"), then the points with the best
     tiles;
  4. the 8B's prefill at P = 512 and 2,048, eagerly (outside a timing loop's `repeating`) and
     replayed as a CUDA graph (labkit.graphed_prefill): the host's time to issue an eager prefill
     beside the GPU's time for it, the kernels it launches, and where the host's time goes
     (cProfile) — why a short eager prefill waited for its host (lesson 06's chunks run eagerly).
Writes one recording `gpu-tune-<device>-<stamp>.json` into DIR (never overwritten) with
provenance. It changes no file of the lab: the winners become the kernels' defaults by hand,
citing the recording.
"""
from __future__ import annotations

import argparse
import contextlib
import importlib
import functools
import gc
import json
import math
import os
import signal
import statistics
import sys
import time
from datetime import datetime, timezone
from types import SimpleNamespace

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

# (BLOCK_N, BLOCK_K, stages, warps). Since the split-K kernel's loads along K became 16-byte
# asynchronous copies (EVEN_K), deeper pipelines and longer K steps are worth timing again.
MATMUL_TILES = ((64, 128, 3, 4), (64, 128, 4, 4), (64, 128, 5, 4), (32, 128, 4, 4), (32, 256, 3, 4),
                (32, 256, 4, 4), (64, 256, 3, 4), (64, 256, 3, 8), (128, 128, 3, 8), (128, 128, 4, 4),
                (64, 64, 4, 4), (64, 64, 6, 4), (16, 256, 4, 4))
MATMUL_PER_SM = (1, 2, 4, 8)
ATTENTION_TILES = ((64, 3, 4), (64, 3, 8), (128, 2, 8), (128, 3, 8), (128, 3, 4), (256, 2, 8), (32, 4, 4))
ATTENTION_PER_SM = (1, 2, 4, 8)
SHARES = {"matmul": 0.35, "attention": 0.25, "step": 0.40, "prefill": 0.15}
STEP_POINTS = ((1, 8192, "bf16"), (16, 8192, "bf16"), (64, 8192, "bf16"), (16, 8192, "int8"), (16, 8192, "fp8"))
DRY_STEP_POINTS = ((2, 64, "int8"),)
UNFUSED_POINTS = 2  # the first STEP_POINTS timed again with torch's elementwise ops (B = 1 and 16)
# Prompts of the prefill part: 512 measured host-bound eagerly on the H200 (53.7 ms against 9.6
# predicted, prefill_sweep-h200-20261204-1813.json), 2,048 not (73.4 ms)
PREFILL_PROMPTS = (512, 2048)
DRY_PREFILL_PROMPTS = (16,)
HOST_PROFILE_ROWS = 15  # the functions with the most time of their own in one eager prefill


STOPPED = []  # non-empty once SIGTERM came


class Stopped(BaseException):
    """SIGTERM arrived: the part running ends here. A BaseException, so that labkit's own
    catch-alls (a CUDA graph's capture falls back to eager on any Exception) cannot swallow it
    and run on past the step's timeout."""


def _stop(signum, frame):
    """The first SIGTERM ends the part running; a later one (while the recording is written) is ignored."""
    STOPPED.append(signum)
    if len(STOPPED) == 1:
        raise Stopped("stopped by SIGTERM (its step's timeout) while running")


def log(text: str):
    print(f"[gpu_tune] {text}", flush=True)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", required=True)
    parser.add_argument("--budget-s", type=float, default=300.0)
    parser.add_argument("--dry-run", action="store_true")
    parser.add_argument("--parts", default=",".join(SHARES),
                        help=f"comma-separated, of {', '.join(SHARES)} (default all); the budget is shared among them")
    args = parser.parse_args(argv)
    parts = [p.strip() for p in args.parts.split(",") if p.strip()]
    if not parts or any(p not in SHARES for p in parts):
        print(f"gpu_tune: error: --parts {args.parts!r}: choose from {', '.join(SHARES)}", file=sys.stderr)
        return 2
    os.makedirs(args.out, exist_ok=True)
    from labkit import backend
    device = backend.kernel_device()
    if device != "cuda" and not args.dry_run:
        print("gpu_tune: error: no CUDA GPU (use --dry-run)", file=sys.stderr)
        return 2
    if device is None:
        backend.use_interpreter()
    device = device or "cpu"
    start = time.perf_counter()
    deadlines, spent, shares = {}, 0.0, sum(SHARES[p] for p in parts)
    for part in parts:
        spent += SHARES[part] / shares
        deadlines[part] = start + spent * args.budget_s
    run = SimpleNamespace(device=device, dtype="bf16" if device == "cuda" else "fp16", dry=args.dry_run)
    result = {"device": device, "dtype": run.dtype, "budget_s": args.budget_s}
    # `timeout` (gpu_session.sh) stops a run that outlasts its step with SIGTERM: the part then
    # running ends with an error, no other starts, and the recording still keeps what was measured
    STOPPED.clear()  # this run's: a run before it in the same process (a test) wrote "writing"
    previous = signal.signal(signal.SIGTERM, _stop)
    try:
        return _run_parts(args, parts, run, result, deadlines, start)
    finally:
        signal.signal(signal.SIGTERM, previous)


def _run_parts(args, parts, run, result, deadlines, start) -> int:
    """Each asked part in turn (an error recorded, the next still run; none after SIGTERM), then
    the one recording."""
    for part, fn in (("matmul", tune_matmul), ("attention", tune_attention), ("step", time_steps),
                     ("prefill", time_prefill)):
        if part not in parts:
            continue
        if STOPPED:
            result[part] = {"error": "not started: stopped (SIGTERM)"}
            continue
        try:
            result[part] = fn(run, deadlines[part], result)
        except (Exception, Stopped) as err:  # noqa: BLE001 - recorded; the next part still runs
            log(f"{part}: ERROR {type(err).__name__}: {err}")
            # what the part had measured before it failed (a part that keeps its results in
            # result[part] as it goes) stays beside the error
            partial = result.get(part) if isinstance(result.get(part), dict) else {}
            result[part] = {**partial, "error": f"{type(err).__name__}: {err}"}
    result["wall_s"] = round(time.perf_counter() - start, 1)
    STOPPED.append("writing")  # a SIGTERM from here on is ignored (`_stop`): the recording is written
    device = run.device
    from labkit.backend import device_name
    from labkit.recordings import provenance, write_recording
    slug = "cpu" if device != "cuda" else "".join(c if c.isalnum() else "-" for c in device_name(device).lower())
    stamp = datetime.now(timezone.utc).strftime("%Y%m%d-%H%M")
    path = write_recording(args.out, f"gpu-tune-{slug.replace('nvidia-', '')}-{stamp}",
                           {**result, "provenance": provenance(device, "python3 scripts/gpu_tune.py "
                                                                       + " ".join(sys.argv[1:]))})
    log(f"wrote {path}")
    print(json.dumps({k: result[k].get("best") if isinstance(result[k], dict) else result[k]
                      for k in ("matmul", "attention", "wall_s") if k in result}), flush=True)
    return 0


# ---------------------------------------------------------------- shapes
def model_spec(run):
    from labkit.specs import get_model
    return get_model("lab-tiny" if run.dry else "llama-3.1-8b")


def timed(run, fn, nbytes: float) -> float:
    from labkit.measure import time_fn
    return time_fn(fn, run.device, 1, 5, 0.1, isolate=run.device == "cuda", working_set_bytes=nbytes).median_s


# ---------------------------------------------------------------- 1. split-K matmul
def tune_matmul(run, deadline: float, _result) -> dict:
    """Candidates in turn (the current default first), each over every product, so a deadline
    drops whole candidates, never a product of one."""
    import torch

    mm = importlib.import_module("kernels.matmul")  # kernels.matmul may be the function
    from kernels.tolerances import float_tolerance
    from labkit import roofline
    from labkit.gpu_run import randn
    spec, original = model_spec(run), mm.split_k_plan
    shared = mm.shared_bytes_per_block(torch.device(run.device)) if run.device == "cuda" else None
    atol, rtol = float_tolerance(run.dtype)
    rows = (1, 4) if run.dry else (1, 16)
    device = torch.device(run.device)
    default = original(1, 4096, 4096, 2, mm.sm_count(device), capability=mm.capability(device))
    default = (tuple(default[k] for k in ("BLOCK_N", "BLOCK_K", "num_stages", "num_warps")), mm.SPLIT_K_PROGRAMS_PER_SM)
    tiles, per_sms = (MATMUL_TILES[-3:-2], (1, 4)) if run.dry else (MATMUL_TILES, MATMUL_PER_SM)  # dry: one small tile
    candidates = [default] + [(t, p) for t in tiles for p in per_sms if (t, p) != default
                              and (shared is None or mm.shared_bytes_estimate(16, t[0], t[1], t[2], 2) <= shared)]
    shapes = roofline.linear_shapes(spec)  # {name: (K, N, count per step)}
    out = {"default": {"tile": list(default[0]), "per_sm": default[1]}, "timings": [], "torch": [], "skipped": []}

    def time_all(M: int, cands) -> dict:
        """{candidate: the step's total seconds of products at M rows}, correct candidates only."""
        inputs = {}
        for name, (K, N, _count) in shapes.items():
            a, b = randn(run, (M, K), 1), randn(run, (N, K), 2, scale=K ** -0.5).t()
            nbytes = 2 * (M * K + K * N + M * N)
            inputs[name] = (a, b, mm.matmul_reference(a, b).float(), nbytes)
            base_s = timed(run, lambda: torch.matmul(a, b), nbytes)
            out["torch"].append({"M": M, "shape": name, "N": N, "K": K, "time_s": base_s, "bytes_per_s": nbytes / base_s})
        totals = {}
        for tile, per_sm in cands:
            if time.perf_counter() > deadline:
                out["skipped"].append({"M": M, "tile": tile, "per_sm": per_sm})
                continue
            total, correct = 0.0, True
            mm.split_k_plan = functools.partial(original, tile=tile, programs_per_sm=per_sm)
            try:
                for name, (a, b, ref, nbytes) in inputs.items():
                    K, N, count = shapes[name]
                    got = mm.matmul(a, b).float()
                    ok = bool(torch.allclose(got, ref, atol=atol, rtol=rtol))
                    t = timed(run, lambda: mm.matmul(a, b), nbytes)
                    plan = mm.split_k_plan(M, N, K, 2, mm.sm_count(a.device))
                    out["timings"].append({"M": M, "shape": name, "N": N, "K": K, "tile": tile, "per_sm": per_sm,
                                           "split_k": plan["SPLIT_K"], "programs": plan["programs"], "time_s": t,
                                           "bytes_per_s": nbytes / t, "max_abs_err": (got - ref).abs().max().item(),
                                           "correct": ok})
                    total, correct = total + count * t, correct and ok
            finally:
                mm.split_k_plan = original
            if correct:
                totals[(tile, per_sm)] = total
        for name in shapes:
            best = sorted((e for e in out["timings"] if e["M"] == M and e["shape"] == name and e["correct"]),
                          key=lambda e: e["time_s"])[:3]
            torch_bw = next(e["bytes_per_s"] for e in out["torch"] if e["M"] == M and e["shape"] == name)
            log(f"matmul M={M} {name} {shapes[name][1]}x{shapes[name][0]}: torch {torch_bw / 1e9:.0f} GB/s; best "
                + ", ".join(f"{e['tile']}x{e['per_sm']} {e['bytes_per_s'] / 1e9:.0f} GB/s" for e in best))
        return totals

    by_rows = {M: time_all(M, candidates) for M in rows}
    complete = [c for c in candidates if all(c in by_rows[M] for M in rows)]
    if default not in complete:
        out["best"] = None
        return out
    score = {c: sum(by_rows[M][c] / by_rows[M][default] for M in rows) / len(rows) for c in complete}
    ranked = sorted(complete, key=score.get)
    out["step_total_s"] = [{"tile": list(t), "per_sm": p, **{f"M{M}": by_rows[M][(t, p)] for M in rows},
                            "relative_to_default": score[(t, p)]} for t, p in ranked]
    out["best"] = {"tile": list(ranked[0][0]), "per_sm": ranked[0][1]}
    log(f"matmul best by the step's total: tile {ranked[0][0]} at {ranked[0][1]} per SM, "
        f"{score[ranked[0]]:.2f} of the default's time")
    if not run.dry and time.perf_counter() < deadline + 20:  # the best few at M = 64 too
        deadline += 20
        by_rows[64] = time_all(64, [default] + [c for c in ranked[:3] if c != default])
        out["M64_total_s"] = [{"tile": list(t), "per_sm": p, "total_s": v} for (t, p), v in by_rows[64].items()]
    return out


# ---------------------------------------------------------------- 2. decode attention
def tune_attention(run, deadline: float, _result) -> dict:
    """Per cache dtype (a third of the time each), candidates in turn over every shape."""
    import torch

    da = importlib.import_module("kernels.decode_attention")  # may be the function
    from kernels.tolerances import decode_attention_tolerance
    from labkit.dtypes import torch_dtype
    from labkit.gpu_run import quantized_cache, randn
    from labkit.roofline import INT8_SCALE_BYTES
    spec = model_spec(run)
    H, Hkv, D = spec.n_heads, spec.n_kv_heads, spec.head_dim
    shapes = ((1, 64), (2, 128)) if run.dry else ((1, 32768), (1, 131072), (16, 8192))
    shared = da.shared_bytes_per_block(torch.device(run.device)) if run.device == "cuda" else None
    caches = (run.dtype, "int8") if run.dry else ("bf16", "fp8", "int8")
    original = (da.split_constexprs, da.default_num_splits)
    out = {"timings": [], "skipped": [], "best": {},
           "default_per_sm": {c: da.split_programs_per_sm(c, run.device) for c in caches}}
    start = time.perf_counter()
    for i, cache_dtype in enumerate(caches):
        until = start + (i + 1) * (deadline - start) / len(caches)
        cbytes = torch_dtype(cache_dtype).itemsize
        plan = original[0](run.dtype, cache_dtype, D, H // Hkv, shared, capability=da.capability(torch.device(run.device)))
        default = ((plan["constexprs"]["BLOCK_N"], plan["num_stages"], plan["num_warps"]),
                   da.split_programs_per_sm(cache_dtype, run.device))
        tiles, per_sms = (ATTENTION_TILES[:1], (2,)) if run.dry else (ATTENTION_TILES, ATTENTION_PER_SM)
        if cbytes == 1:  # each tile also with V scaled in it (SCALE_V), the default's first
            tiles = [(*t, scale_v) for t in tiles for scale_v in (False, True)]
            cands = [default, ((*default[0][:3], True), default[1])]
        else:
            cands = [default]
        cands += [(t, p) for t in tiles for p in per_sms if (t, p) not in cands and (t[:3], p) != default
                  and (shared is None or da.split_shared_bytes(t[0], t[1], D, cbytes, 2) <= shared)]
        inputs = []
        for B, S in shapes:
            q = randn(run, (B, H, D), 6)
            k, v, ks, vs = quantized_cache(run, randn(run, (B, Hkv, S, D), 7), randn(run, (B, Hkv, S, D), 8),
                                           cache_dtype)
            lengths = torch.full((B,), S, dtype=torch.int32, device=run.device)
            ref = da.decode_attention_reference(q, k, v, lengths, ks, vs).float()
            nbytes = 2 * B * Hkv * S * (D * cbytes + (INT8_SCALE_BYTES if cache_dtype == "int8" else 0))
            inputs.append((B, S, (q, k, v, lengths, ks, vs), ref, nbytes))
        atol, rtol = decode_attention_tolerance(run.dtype, cache_dtype)
        times = {}
        for tile, per_sm in cands:
            if time.perf_counter() > until:
                out["skipped"].append({"cache_dtype": cache_dtype, "tile": tile, "per_sm": per_sm})
                continue
            da.split_constexprs = functools.partial(original[0], tile=tile)
            da.default_num_splits = functools.partial(original[1], programs_per_sm=per_sm)
            ts = []
            try:
                for B, S, args, ref, nbytes in inputs:
                    splits = da.default_num_splits(B, Hkv, S, args[0].device)

                    def call(args=args):
                        return da.decode_attention(*args, check_lengths=False)
                    got = call().float()
                    ok = bool(torch.allclose(got, ref, atol=atol, rtol=rtol))
                    t = timed(run, call, nbytes)
                    out["timings"].append({"cache_dtype": cache_dtype, "B": B, "S": S, "tile": tile, "per_sm": per_sm,
                                           "splits": splits, "time_s": t, "bytes_per_s": nbytes / t,
                                           "max_abs_err": (got - ref).abs().max().item(), "correct": ok})
                    ts.append(t if ok else None)
            finally:
                da.split_constexprs, da.default_num_splits = original
            if None not in ts:
                times[(tile, per_sm)] = ts
        for B, S, *_ in inputs:
            best = sorted((e for e in out["timings"] if e["cache_dtype"] == cache_dtype and e["B"] == B
                           and e["S"] == S and e["correct"]), key=lambda e: e["time_s"])[:3]
            log(f"attention {cache_dtype} B={B} S={S}: best " + ", ".join(
                f"{e['tile']}x{e['per_sm']} ({e['splits']} splits) {e['bytes_per_s'] / 1e9:.0f} GB/s" for e in best))
        if default in times:
            geo = {c: math.exp(sum(math.log(t / r) for t, r in zip(ts, times[default])) / len(ts))
                   for c, ts in times.items()}
            c = min(geo, key=geo.get)
            out["best"][cache_dtype] = {"tile": list(c[0]), "per_sm": c[1], "relative_to_default": geo[c],
                                        "default": {"tile": list(default[0]), "per_sm": default[1]}}
            log(f"attention {cache_dtype} best: tile {c[0]} at {c[1]} split programs per SM, "
                f"{geo[c]:.2f} of the default's time (default {default})")
    return out


# ---------------------------------------------------------------- 3. the decode step
def time_steps(run, deadline: float, result: dict) -> dict:
    import torch

    da = importlib.import_module("kernels.decode_attention")  # may be the function
    mm = importlib.import_module("kernels.matmul")  # kernels.matmul may be the function
    from labkit import sweeps
    from labkit.errors import FootprintError
    model = "lab-tiny" if run.dry else "llama-3.1-8b"
    points = DRY_STEP_POINTS if run.dry else STEP_POINTS
    # kept in `result` as it fills, so an error or a stop later in the part loses none of it
    out = result["step"] = {"model": model, "before": [], "after": []}

    def measure(label: str, at=points):
        for B, S, cache_dtype in at:
            if time.perf_counter() > deadline:
                out.setdefault("skipped", []).append([label, B, S, cache_dtype])
                continue
            try:
                p = sweeps.measure_decode(model, B, S, cache_dtype, device=run.device)
            except FootprintError as err:  # B = 64 at 8,192 tokens (79 GiB) does not fit an H100's 80 GB
                out.setdefault("skipped", []).append([label, B, S, cache_dtype, str(err)])
                log(f"step {label} B={B} S={S} {cache_dtype}: refused, {err}")
                continue
            keep = {k: p.get(k) for k in ("batch", "context_tokens", "cache_dtype", "time_s", "roof_fraction",
                                           "predicted_time_s", "kernels", "host_bound", "tokens_per_s")}
            out[label].append(keep)
            log(f"step {label} B={B} S={S} {cache_dtype}: {p['time_s'] * 1e3:.2f} ms = {p['roof_fraction']:.2f} "
                f"of the calibrated roof ({p.get('kernels')})")

    def fresh():
        sweeps._MODELS.clear()  # a new model captures a new graph with the patched tiles
        # The model and its captured graphs refer to each other: only the collector frees them,
        # and on an H100 the old models' 16-31 GiB left the next one no room.
        gc.collect()
        if run.device == "cuda":
            torch.cuda.empty_cache()

    measure("before")
    if run.device == "cuda" and time.perf_counter() < deadline:
        out["profile"] = profile_step(model, run.device)
    out["unfused"] = []
    with torch_elementwise_ops():
        fresh()
        measure("unfused", points[:UNFUSED_POINTS])
    fresh()
    mm_best = (result.get("matmul") or {}).get("best")
    at_best = (result.get("attention") or {}).get("best") or {}
    if not mm_best and not at_best:
        return out
    original = (mm.split_k_plan, da.split_constexprs, da.default_num_splits)
    names = {torch.bfloat16: "bf16", torch.float16: "fp16", torch.float8_e4m3fn: "fp8", torch.int8: "int8",
             torch.float32: "fp32"}

    def attention_tile(q_dt, c_dt, *args, **kw):
        best = at_best.get(c_dt)
        return original[1](q_dt, c_dt, *args, **kw, tile=tuple(best["tile"]) if best else None)

    def splits_for(k_dtype):
        best = at_best.get(k_dtype)
        return best["per_sm"] if best else da.split_programs_per_sm(k_dtype, run.device)

    decode_attention = da.decode_attention

    def patched_decode_attention(q, k_cache, *args, **kw):  # the split count follows the cache dtype
        da.default_num_splits = functools.partial(original[2], programs_per_sm=splits_for(names[k_cache.dtype]))
        return decode_attention(q, k_cache, *args, **kw)

    fresh()
    try:
        if mm_best:
            mm.split_k_plan = functools.partial(original[0], tile=tuple(mm_best["tile"]),
                                                programs_per_sm=mm_best["per_sm"])
        da.split_constexprs = attention_tile
        da.decode_attention = patched_decode_attention
        out["after_tiles"] = {"matmul": mm_best, "attention": at_best}
        measure("after")
        if run.device == "cuda" and time.perf_counter() < deadline + 20:
            out["profile_after"] = profile_step(model, run.device)
    finally:
        mm.split_k_plan, da.split_constexprs, da.default_num_splits = original
        da.decode_attention = decode_attention
        fresh()
    return out


def time_prefill(run, deadline: float, _result) -> dict:
    """Part 4: each prompt's prefill eagerly (host seconds to issue it, GPU seconds by CUDA events,
    kernels launched, the host's profile) and replayed as a CUDA graph (`sweeps.measure_prefill`)."""
    import cProfile
    import pstats

    import torch

    from labkit import gpu_profile, measure, sweeps
    spec = model_spec(run)
    built = sweeps.get_built_model(spec.name, run.device)
    cuda = run.device == "cuda"
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    out = {"model": spec.name, "points": []}
    for P in DRY_PREFILL_PROMPTS if run.dry else PREFILL_PROMPTS:
        if time.perf_counter() > deadline:
            log(f"prefill P={P}: skipped, budget")
            break
        sweeps.ensure_cache(built, 1, P, built.compute_dtype, P)
        tokens = sweeps._random_tokens(spec, (1, P), built.device)

        def eager():  # outside a timing loop's `repeating`, a prefill runs eagerly (graphed_prefill)
            built.prefill(tokens)

        gpu = measure.time_fn(eager, run.device, 1, 5, 1.0)  # on CUDA with the host's time to issue each call
        kernels = gpu_profile.seconds_by_category(eager, 1)[1] if cuda else []
        profiler = cProfile.Profile()
        profiler.enable()
        eager()
        profiler.disable()
        sync()
        stats = pstats.Stats(profiler)
        rows = sorted(stats.stats.items(), key=lambda kv: -kv[1][2])[:HOST_PROFILE_ROWS]  # by own time
        host_profile = [{"function": f"{os.path.basename(file)}:{line}({name})", "calls": calls,
                         "own_ms": own * 1e3, "cumulative_ms": cum * 1e3}
                        for (file, line, name), (_, calls, own, cum, _) in rows]
        replayed = sweeps.measure_prefill(spec.name, P, 1, run.device)
        # (on a CPU the host does the work: issuing it is the whole call)
        host_s = statistics.median(gpu.host_s) if gpu.host_s else gpu.estimate_s
        point = {"prompt_tokens": P, "eager_host_s": host_s, "eager_time_s": gpu.estimate_s,
                 "eager_host_bound": gpu.host_bound, "launches": sum(k["calls_per_step"] for k in kernels),
                 "kernels": kernels[:10], "host_profile": host_profile,
                 "replayed_time_s": replayed["time_s"], "replayed_kernels": replayed["kernels"],
                 "predicted_time_s": replayed["predicted_time_s"], "prefill_reason": replayed["prefill_reason"]}
        out["points"].append(point)
        log(f"prefill P={P}: eager {point['eager_time_s'] * 1e3:.1f} ms (host issues it in "
            f"{point['eager_host_s'] * 1e3:.1f} ms, {point['launches']:.0f} kernels), {replayed['kernels']} "
            f"{point['replayed_time_s'] * 1e3:.1f} ms, predicted {point['predicted_time_s'] * 1e3:.1f} ms; host's "
            "own time: " + "; ".join(f"{r['function']} {r['own_ms']:.1f} ms x{r['calls']}" for r in host_profile[:5]))
    return out


@contextlib.contextmanager
def torch_elementwise_ops():
    """TritonOps' fused residual-add-and-norm, RoPE-and-cache-write and SwiGLU swapped for TorchOps'
    torch ops for the duration: the step as it ran before kernels/add_rms_norm.py, rope_store.py
    and swiglu.py."""
    from labkit.ops import TorchOps, TritonOps
    names = ("add_rms_norm", "rope_and_store", "rope_and_store_prefill", "swiglu")
    saved = {name: TritonOps.__dict__[name] for name in names}
    try:
        for name in names:
            setattr(TritonOps, name, TorchOps.__dict__[name])
        yield
    finally:
        for name, method in saved.items():
            setattr(TritonOps, name, method)


def profile_step(model: str, device: str, B: int = 1, S: int = 8192) -> list:
    """GPU time by kernel over 3 decode steps at (B, S, bf16), the 20 largest (labkit.gpu_profile)."""
    from labkit import gpu_profile, sweeps
    built = sweeps.get_built_model(model, device)
    cache = sweeps.ensure_cache(built, B, S + 1, "bf16", 1)
    if cache.filled_tokens < S:
        cache.fill_random(cache.max_tokens - 1)
    cache.set_lengths(S, active=True)
    tokens = sweeps._random_tokens(built.spec, (B,), built.device)

    def step():  # one token per sequence, then back to the same context
        built.decode_step(tokens)
        cache.set_lengths(S, active=True)

    _, kernels = gpu_profile.seconds_by_category(step, steps=3)
    rows = [{"name": k["name"][:120], "category": k["category"], "gpu_us_per_step": k["time_s"] * 1e6,
             "calls_per_step": k["calls_per_step"]} for k in kernels]
    total = sum(r["gpu_us_per_step"] for r in rows)
    log(f"profile B={B} S={S}: {total / 1e3:.2f} ms of kernels a step; "
        + "; ".join(f"{r['name'][:40]} {r['gpu_us_per_step'] / 1e3:.2f} ms x{r['calls_per_step']:.0f}" for r in rows[:6]))
    return rows[:20]


if __name__ == "__main__":
    raise SystemExit(main())
