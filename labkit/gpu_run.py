"""What the GPU check's sections share: the sizes of a run, the budget, the steps (each written
to disk the moment it finishes), the recordings, and the roofs each timing is compared with.

A section is a list of (label, fn) steps given to `run_steps`; each fn returns a dict that
becomes one entry of the section's recording. Torch (and the labkit modules that load it) is
imported inside the functions that need it, so that `python -m labkit.gpu_check --bad-flag`
answers before torch loads, and triton loads only after the command chose the interpreter.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import os
import re
import sys
import time
from dataclasses import dataclass
from datetime import datetime, timezone

from . import roofline
from .sizes import GpuCheckSizes as Sizes
from .errors import LabError
from .recordings import provenance, write_recording
from .units import format_seconds

SECTIONS = ("calibration", "correctness", "kernels", "prefill_sweep", "decode_sweep")
# Shares of --budget-s. Correctness pays the kernels' first compilation and autotuning; the
# model sweeps pay autotuning again for every new matmul shape (M = B * P, or B in decode).
SHARES = {"calibration": 0.05, "correctness": 0.15, "kernels": 0.20, "prefill_sweep": 0.25, "decode_sweep": 0.35}


# ---------------------------------------------------------------- the budget and the run
class Budget:
    """Section i may run until start + total * (shares of sections 0..i) / (sum of shares), so
    time one section leaves unused passes to the next."""

    def __init__(self, total_s: float, sections):
        self.start_s, self.deadline_s, done = time.perf_counter(), {}, 0.0
        for s in sections:
            done += SHARES[s] / sum(SHARES[x] for x in sections)
            self.deadline_s[s] = self.start_s + total_s * done
        self.section, self.last_step_s = None, 0.0

    def allows_step(self) -> bool:
        """Time left in the section, and at least as much as its last step took."""
        left_s = self.deadline_s[self.section] - time.perf_counter()
        return left_s > 0 and left_s >= self.last_step_s


@dataclass
class Run:
    """What the sections share: where, at what size, the roofs, and what happened so far."""

    args: argparse.Namespace
    device: str  # "cuda", or "cpu" for a dry run in Triton's interpreter
    dtype: str  # the kernels' dtype: bf16 on CUDA, fp16 in the interpreter
    sizes: Sizes
    budget: Budget
    datasheet: object  # specs.HardwareSpec, or None for a device with no preset
    stamp: str = dataclasses.field(default_factory=lambda: datetime.now(timezone.utc).strftime("%Y%m%d-%H%M"))
    calibrated: object = None
    recordings: list = dataclasses.field(default_factory=list)
    results: dict = dataclasses.field(default_factory=dict)

    def log(self, text: str):
        print(f"[{self.budget.section}] {text}", flush=True)


def run_steps(run: Run, steps) -> list[dict]:
    """Run (label, fn) steps in order, each fn returning a dict. Once the budget refuses one, it
    and the rest are {"skipped": "budget"}; an exception becomes {"error": ..., "passed": False},
    so one bad step never loses what the others measured."""
    import torch  # after the arguments are checked
    results = []
    for label, fn in steps:
        if results and results[-1].get("skipped") == "budget" or not run.budget.allows_step():
            results.append({"step": label, "skipped": "budget"})
            run.log(f"{label}: skipped (budget)")
            continue
        start_s = time.perf_counter()
        try:
            result = {"step": label, **fn()}
        except Exception as err:  # noqa: BLE001 - recorded, and fails a correctness check
            result = {"step": label, "error": error_line(err), "passed": False}
            run.log(f"{label}: ERROR {result['error']}")
        if run.device == "cuda":
            try:  # after a sticky CUDA error this raises too: keep the step, say so
                torch.cuda.empty_cache()
            except Exception as err:  # noqa: BLE001
                result["after_step_error"] = error_line(err)
        run.budget.last_step_s = time.perf_counter() - start_s
        results.append(result)
        log_step(run, result)
    return results


def error_line(err: BaseException) -> str:
    return f"{type(err).__name__}: {err}".splitlines()[0]


# ---------------------------------------------------------------- recordings
def log_step(run: Run, result: dict):
    """Append one finished step to the section's `.partial.jsonl` in --out, so that a run killed
    mid-section (a timeout, a hung kernel) still leaves every step it finished. The section's
    recording replaces it when the section ends."""
    path = partial_path(run, run.budget.section)
    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    with open(path, "a", encoding="utf-8") as out:
        out.write(json.dumps(result, default=str) + "\n")


def partial_path(run: Run, section: str) -> str:
    return os.path.join(run.args.out, f"{section}-{device_slug(run)}-{run.stamp}.partial.jsonl")


def device_slug(run: Run) -> str:
    from .backend import device_name  # loads torch
    name = run.datasheet.name if run.datasheet else device_name(run.device) if run.device == "cuda" else "cpu"
    return re.sub(r"[^a-z0-9]+", "-", name.lower()).strip("-")[:40]


def write_section(run: Run, section: str, body: dict):
    """The section's recording, at once: provenance, dry_run, dtype, sizes, then its results;
    then its `.partial.jsonl`, which holds nothing the recording does not, is removed."""
    payload = {"section": section, "dry_run": run.args.dry_run, "device": run.device, "dtype": run.dtype,
               "sizes": dataclasses.asdict(run.sizes), "budget_s": run.args.budget_s,
               "provenance": provenance(run.device, command(run.args)), **body}
    run.recordings.append(str(write_recording(run.args.out, f"{section}-{device_slug(run)}-{run.stamp}", payload)))
    run.log(f"wrote {run.recordings[-1]}")
    if os.path.exists(partial_path(run, section)):
        os.remove(partial_path(run, section))


def command(args) -> str:
    return "python -m labkit.gpu_check " + " ".join(sys.argv[1:] if args.argv is None else args.argv)


# ---------------------------------------------------------------- roofs and inputs
def roofs(run: Run) -> dict:
    """{"datasheet": spec, "calibrated": spec}, without a datasheet the device lacks."""
    if run.calibrated is None:  # --only without calibration: the cached one, else measured now
        from . import calibrate  # loads torch
        run.calibrated, _ = calibrate.load_or_calibrate(run.device, log=run.log)
    return {k: v for k, v in (("datasheet", run.datasheet), ("calibrated", run.calibrated)) if v}


def roof_text(run: Run, predict) -> str:
    """"roof 1.23 ms (datasheet) | 1.50 ms (calibrated)": predict(hardware) seconds per roof,
    leaving out a roof with no peak for the dtype."""
    parts = []
    for kind, hw in roofs(run).items():
        try:
            parts.append(f"{format_seconds(predict(hw))} ({kind})")
        except LabError:
            continue
    return "roof " + " | ".join(parts)


def rates(run: Run, flops: float, nbytes: float, timing) -> dict:
    """Achieved FLOP/s and bytes/s, and the fraction reached of each roof and its bandwidth."""
    from . import measure  # loads torch
    out = {"flops": flops, "bytes": nbytes, **measure.achieved(flops, nbytes, timing),
           "spread": timing.spread, "noisy": timing.noisy, "calls_per_sample": timing.calls_per_sample,
           "host_bound": timing.host_bound}
    for kind, hw in roofs(run).items():
        out[f"bandwidth_fraction_{kind}"] = roofline.bandwidth_fraction(out["achieved_bytes_per_s"], hw)
        try:
            out[f"roof_fraction_{kind}"] = measure.roof_fraction(flops, nbytes, timing, hw, run.dtype)
        except LabError:  # no peak for this dtype on that roof
            out[f"roof_fraction_{kind}"] = None
    return out


def randn(run: Run, shape, seed: int, scale: float = 1.0):
    """Seeded N(0, scale^2) in the kernels' dtype on the run's device: fresh, never zeros."""
    import torch  # after the arguments are checked

    from .dtypes import COMPUTE_DTYPES, torch_dtype  # imports torch
    g = torch.Generator(device=run.device).manual_seed(seed)
    return (torch.randn(shape, generator=g, device=run.device) * scale).to(torch_dtype(run.dtype, COMPUTE_DTYPES))


def quantized_cache(run: Run, k, v, cache_dtype: str):
    """(k, v, k_scale, v_scale) stored as `cache_dtype` by kernels.kv_quant, with the Triton
    kernel (on CUDA; int8 also in the interpreter, which miscasts fp32 -> fp8 inside a kernel)."""
    import torch  # after the arguments are checked
    from kernels.kv_quant import quantize_kv  # triton: after the interpreter choice
    if cache_dtype == run.dtype:
        return k, v, None, None
    scale = torch.tensor(0.5, device=run.device) if cache_dtype == "fp8" else None  # not 1: exercise it
    use_triton = run.device == "cuda" or cache_dtype == "int8"
    (kq, ks), (vq, vs) = (quantize_kv(x, cache_dtype, scale, use_triton=use_triton) for x in (k, v))
    return kq, vq, ks, vs


# ---------------------------------------------------------------- autotuning, bounded
def autotune_estimate(sizes: Sizes, budget_s: float = 420.0, model: str | None = None) -> dict:
    """What a run at `sizes` costs in autotuning: the autotune keys it meets (M, P and S bucketed
    to powers of two by the kernels: kernels.matmul.m_bucket, kernels.flash_attention.bucket),
    the tiles each key benchmarks on an H100, and the time that takes at triton's own benchmark
    defaults (do_bench's warmup + rep per tile), against `budget_s`. `autotuned_variants`: the
    autotuned kernels' variants, one per tile, dtype and head dim (the sizes are not specialised),
    so bounded by the tile tables; the other kernels' fixed variants (split-K's, decode's per cache
    dtype, the quantiser's, RoPE's, the norms') compile once each and are not counted here
    (`make gpu-compile` lists every one)."""
    import inspect  # triton's do_bench defaults

    from triton import testing  # after the interpreter choice (gpu_check.main)

    from kernels.flash_attention import bucket  # after the interpreter choice (gpu_check.main)
    from kernels.flash_attention import tiles_for as flash_tiles_for  # after the interpreter choice
    from kernels.matmul import SPLIT_K_MAX_M, m_bucket, tiles_for  # after the interpreter choice
    from .specs import get_model  # the model whose linears the run multiplies
    spec = get_model(model or sizes.model)
    shapes = roofline.linear_shapes(spec)
    linears = [(K, N) for name, (K, N, _) in shapes.items() if name != "head"]
    head_k, head_n, _ = shapes["head"]
    rows = {M for M, _, _ in sizes.matmuls} | set(sizes.prompts) | set(_batches(sizes))
    mm_keys = {(m_bucket(M), K, N) for M, K, N in sizes.matmuls if M > SPLIT_K_MAX_M}
    mm_keys |= {(m_bucket(M), K, N) for M in rows if M > SPLIT_K_MAX_M for K, N in linears}
    mm_keys |= {(m_bucket(B), head_k, head_n) for B in _batches(sizes) if B > SPLIT_K_MAX_M}  # the output head
    D = sizes.heads[2]
    lengths = set(sizes.flash_checks) | {(P, P) for P in (*sizes.flash_timings, *sizes.prompts)}
    flash_keys = {(bucket(P), bucket(S)) for P, S in lengths}
    params = inspect.signature(testing.do_bench).parameters
    per_tile_s = (params["warmup"].default + params["rep"].default) / 1e3
    mm_tiles, flash_tiles = len(tiles_for(2, capability=(9, 0))), len(flash_tiles_for(2, D, capability=(9, 0)))
    cost_s = per_tile_s * (len(mm_keys) * mm_tiles + len(flash_keys) * flash_tiles)
    return {"matmul_keys": len(mm_keys), "matmul_tiles_per_key": mm_tiles, "flash_keys": len(flash_keys),
            "flash_tiles_per_key": flash_tiles, "seconds_per_tile": per_tile_s, "autotune_s": round(cost_s, 1),
            "budget_s": budget_s, "budget_fraction": round(cost_s / budget_s, 3),
            "autotuned_variants": mm_tiles + flash_tiles}


def _batches(sizes: Sizes) -> list[int]:
    """The decode batches a full run may reach: sizes.batches, doubled up to max_batch."""
    batches = list(sizes.batches)
    while batches[-1] * 2 <= sizes.max_batch:
        batches.append(batches[-1] * 2)
    return batches
