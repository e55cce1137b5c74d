"""Check a GPU against the lab in one command: kernels correct, kernels fast, both phases measured.

    python -m labkit.gpu_check --out DIR [--dry-run] [--budget-s 420] [--only SECTION,...]
    make gpu-check OUT=DIR [DRY=1]

Sections, in order; each writes its recording into DIR the moment it finishes, named
`<section>-<device>-<YYYYmmdd-HHMM>.json` (labkit.recordings: never overwritten). Until then its
finished steps are appended to `<same name>.partial.jsonl`, so a run killed mid-section keeps
them; a section that raises is recorded with its error and the next one runs:

  calibration    provenance (device, driver, torch/triton versions, date, command) and this
                 machine's measured roofline (labkit.calibrate; measured afresh on a GPU)
  correctness    each kernel against its torch reference on fresh seeded random inputs, at the
                 8B's sizes: matmul M=2048 (K, N = 4096/14336); causal flash attention H=32,
                 Hkv=8, D=128 at P = 1k, 4k and 1k queries after 3k cached; decode attention over
                 bf16, fp8 and int8 caches quantised on the GPU, B=16 at S=8k and B=1 at S=64k;
                 int8/fp8 quantisation itself (the fp8 cast the CPU interpreter gets wrong)
  kernels        each kernel against its torch baseline, the roofline bound printed first
  prefill_sweep  the Llama-3.1-8B-shaped model's prefill, P = 512 ... 32k, batch 1
  decode_sweep   its decode step at S = 8k, batch 1 ... the largest that fits (>= 64), and at
                 batch 1 for S = 1k ... 128k; bf16, fp8 and int8 caches; the step replayed as
                 a CUDA graph (labkit.graphed_decode: each point's "kernels" says "triton+graph",
                 or the model's decode_reason says why not)

Targets (reported in the final JSON line; only a failed correctness check changes the exit code):
  matmul >= 0.85 x torch.matmul;  flash attention >= 400 TFLOP/s (causal bf16) at P >= 4k;
  fp8/int8 decode attention >= 1.5 x faster than bf16 at S >= 32k.

--budget-s is shared among the sections (SHARES; time a section leaves passes to the next). A
step starts only while its section has at least as long left as its previous step took; what
does not start is recorded as `skipped: budget`, as is what does not fit in memory (checked
before allocating). --dry-run takes the same steps at toy sizes with the lab-tiny model, in under
a minute: on the GPU if there is one, else on the CPU in Triton's interpreter with fp16 kernels
(its bf16 is broken). Exit codes: 0 done (the last line names any correctness check that did not
run, and why); 1 a correctness check failed; 2 bad arguments, no GPU, or DIR unwritable.
Not measured here: L2 residency. Caches under the L2's 50-60 MB (fp8/int8 at S=16k, B=1) stay
partly in an H100/H200's L2 between timed calls, so their bandwidth fraction can read high.

On a GPU machine with no make (and no .git beside the tree), as one command:
    LABKIT_GIT_COMMIT=<commit> PYTHONUNBUFFERED=1 timeout 480 python3 -m labkit.gpu_check --out DIR
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
from .errors import FootprintError, LabError
from .explore import HOST_BOUND_NOTE
from .specs import BYTES_PER_ELEMENT, GPUS

SECTIONS = ("calibration", "correctness", "kernels", "prefill_sweep", "decode_sweep")
# 7 minutes of steps: a step starts only if its section has time left, so each section can run
# over by its last step (prefill at 32k, with its autotuning, ~20 s), and the start (imports,
# CUDA context) comes first: the whole command stays inside the 8 minutes it is allowed.
DEFAULT_BUDGET_S = 420.0
# Shares of --budget-s. Correctness pays the kernels' first compilation and autotuning; the
# model sweeps pay autotuning again for every new matmul shape (M = B * P, or B in decode).
SHARES = {"calibration": 0.05, "correctness": 0.15, "kernels": 0.20, "prefill_sweep": 0.25, "decode_sweep": 0.35}
TARGET_MATMUL_VS_TORCH = 0.85
TARGET_FLASH_FLOPS_PER_S = 400e12
TARGET_QUANT_SPEEDUP = 1.5
# (atol, rtol) per kernel dtype, as in tests/test_kernels_*: inputs and outputs round to the dtype,
# accumulators and softmax statistics stay fp32. Quantised caches: probabilities scaled by int8's
# per-token scales round in q's dtype too, which fp16 (no bf16-like exponent range) feels.
TOLERANCE = {"fp32": (1e-4, 1e-4), "fp16": (2e-3, 2e-3), "bf16": (1.6e-2, 1.6e-2)}
QUANTISED_CACHE_TOLERANCE = (5e-3, 5e-3)
# Queries ~ 4 N(0, 1): scores of std 4 make softmax peaked and outputs O(1). With std 1 the output
# averages 64k random values to ~0.004, and a kernel returning zeros would pass the tolerance.
Q_SHARPNESS = 4.0
NO_GPU = "no CUDA GPU: run with --dry-run, or on a GPU machine"
# torch.cuda.get_device_name -> specs.GPUS. A name matching none gets no datasheet, never a guess
# (H100 NVL and H200 NVL parts have other clocks or bandwidth than the SXM ones).
PRESET_BY_NAME = ((r"\bH200\b(?!.*NVL)", "H200"), (r"\bH100\b.*\bPCIe\b", "H100-PCIe"),
                  (r"\bH100\b.*\b(SXM|HBM3)\b", "H100-SXM"), (r"\bA100\b.*80GB", "A100-80GB"),
                  (r"\bA100\b.*40GB", "A100-40GB"), (r"\bL4\b", "L4"), (r"\bT4\b", "T4"),
                  (r"\bRTX 4090\b", "RTX-4090"))


@dataclass(frozen=True)
class Sizes:
    """What one run measures. matmuls (M, K, N); heads (H, Hkv, D); flash (P, S): P queries
    after S - P cached keys; decode (B, S); flash_target_from / long_context: the P and S from
    which the flash and quantised-cache targets apply. Decode batches run at `context` and
    double while the last fits, up to max_batch; `contexts` run at batch 1."""

    matmuls: tuple
    heads: tuple
    flash_checks: tuple
    flash_timings: tuple
    flash_target_from: int
    decode_checks: tuple
    decode_timings: tuple
    long_context: int
    model: str
    prompts: tuple
    batches: tuple
    max_batch: int
    context: int
    contexts: tuple
    warmup: int
    repeats: int
    measure_budget_s: float | None  # per kernel timing (labkit.measure.time_fn)
    sweep_repeats: int | None  # None: labkit.sweeps' own


FULL = Sizes(
    matmuls=((2048, 4096, 4096), (2048, 4096, 14336), (2048, 14336, 4096)), heads=(32, 8, 128),
    flash_checks=((1024, 1024), (4096, 4096), (1024, 4096)), flash_timings=(1024, 4096, 8192, 16384),
    flash_target_from=4096, decode_checks=((16, 8192), (1, 65536)),
    decode_timings=((1, 16384), (1, 32768), (1, 131072), (16, 8192), (64, 8192)), long_context=32768,
    model="llama-3.1-8b", prompts=(512, 1024, 2048, 4096, 8192, 16384, 32768), batches=(1, 8, 16, 32, 64),
    max_batch=1024, context=8192, contexts=(1024, 8192, 32768, 65536, 131072),
    warmup=3, repeats=20, measure_budget_s=1.0, sweep_repeats=None)
# The same steps at toy sizes, GQA 4 kept (H=4, Hkv=1); D=16 is the kernels' smallest head.
DRY = Sizes(
    matmuls=((64, 32, 48), (64, 32, 112), (64, 112, 32)), heads=(4, 1, 16),
    flash_checks=((32, 32), (64, 64), (16, 48)), flash_timings=(32, 64), flash_target_from=64,
    decode_checks=((2, 64), (1, 256)), decode_timings=((1, 128), (1, 256), (2, 64)), long_context=256,
    model="lab-tiny", prompts=(16, 64), batches=(1, 4), max_batch=8, context=64, contexts=(64, 256),
    warmup=0, repeats=2, measure_budget_s=None, sweep_repeats=2)


# ---------------------------------------------------------------- the run: budget, steps, recordings
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
    import torch
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
    from .backend import device_name
    name = run.datasheet.name if run.datasheet else device_name(run.device) if run.device == "cuda" else "cpu"
    return re.sub(r"[^a-z0-9]+", "-", name.lower()).strip("-")[:40]


def write_section(run: Run, section: str, body: dict):
    """The section's recording, at once: provenance, dry_run, dtype, sizes, then its results;
    then its `.partial.jsonl`, which holds nothing the recording does not, is removed."""
    from .recordings import provenance, write_recording
    payload = {"section": section, "dry_run": run.args.dry_run, "device": run.device, "dtype": run.dtype,
               "sizes": dataclasses.asdict(run.sizes), "budget_s": run.args.budget_s,
               "provenance": provenance(run.device, command(run.args)), **body}
    run.recordings.append(str(write_recording(run.args.out, f"{section}-{device_slug(run)}-{run.stamp}", payload)))
    run.log(f"wrote {run.recordings[-1]}")
    if os.path.exists(partial_path(run, section)):
        os.remove(partial_path(run, section))


def command(args) -> str:
    return "python -m labkit.gpu_check " + " ".join(sys.argv[1:] if args.argv is None else args.argv)


# ---------------------------------------------------------------- roofs, inputs, comparisons
def datasheet_for(name: str):
    """The specs.GPUS preset whose pattern matches a CUDA device name, else None."""
    return next((GPUS[preset] for pattern, preset in PRESET_BY_NAME if re.search(pattern, name)), None)


def roofs(run: Run) -> dict:
    """{"datasheet": spec, "calibrated": spec}, without a datasheet the device lacks."""
    if run.calibrated is None:  # --only without calibration: the cached one, else measured now
        from . import calibrate
        run.calibrated, _ = calibrate.load_or_calibrate(run.device, log=run.log)
    return {k: v for k, v in (("datasheet", run.datasheet), ("calibrated", run.calibrated)) if v}


def roof_text(run: Run, predict) -> str:
    """"roof 1.23 ms (datasheet) | 1.50 ms (calibrated)": predict(hardware) seconds per roof,
    leaving out a roof with no peak for the dtype."""
    from .measure import format_seconds
    parts = []
    for kind, hw in roofs(run).items():
        try:
            parts.append(f"{format_seconds(predict(hw))} ({kind})")
        except LabError:
            continue
    return "roof " + " | ".join(parts)


def rates(run: Run, flops: float, nbytes: float, timing) -> dict:
    """Achieved FLOP/s and bytes/s, and the fraction reached of each roof and its bandwidth."""
    from . import measure
    out = {"flops": flops, "bytes": nbytes, **measure.achieved(flops, nbytes, timing),
           "spread": timing.spread, "noisy": timing.noisy, "calls_per_sample": timing.calls_per_sample,
           "host_bound": timing.host_bound}
    for kind, hw in roofs(run).items():
        out[f"bandwidth_fraction_{kind}"] = out["achieved_bytes_per_s"] / hw.memory_bandwidth_bytes_per_s
        try:
            out[f"roof_fraction_{kind}"] = measure.roof_fraction(flops, nbytes, timing, hw, run.dtype)
        except LabError:  # no peak for this dtype on that roof
            out[f"roof_fraction_{kind}"] = None
    return out


def randn(run: Run, shape, seed: int, scale: float = 1.0):
    """Seeded N(0, scale^2) in the kernels' dtype on the run's device: fresh, never zeros."""
    import torch
    g = torch.Generator(device=run.device).manual_seed(seed)
    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16}[run.dtype]
    return (torch.randn(shape, generator=g, device=run.device) * scale).to(dtype)


def quantized_cache(run: Run, k, v, cache_dtype: str):
    """(k, v, k_scale, v_scale) stored as `cache_dtype` by kernels.kv_quant, with the Triton
    kernel (on CUDA; int8 also in the interpreter, which miscasts fp32 -> fp8 inside a kernel)."""
    import torch
    from kernels.kv_quant import quantize_kv
    if cache_dtype == run.dtype:
        return k, v, None, None
    scale = torch.tensor(0.5, device=run.device) if cache_dtype == "fp8" else None  # not 1: exercise it
    use_triton = run.device == "cuda" or cache_dtype == "int8"
    (kq, ks), (vq, vs) = (quantize_kv(x, cache_dtype, scale, use_triton=use_triton) for x in (k, v))
    return kq, vq, ks, vs


def compare(run: Run, label: str, out, ref, tolerance=None, **what) -> dict:
    """Max/mean abs error and pass/fail of |out - ref| <= atol + rtol |ref|, logged."""
    atol, rtol = tolerance or TOLERANCE[run.dtype]
    err = (out.float() - ref.float()).abs()
    result = {**what, "dtype": run.dtype, "max_abs_err": err.max().item(), "mean_abs_err": err.mean().item(),
              "ref_max_abs": ref.float().abs().max().item(), "atol": atol, "rtol": rtol,
              "passed": bool((err <= atol + rtol * ref.float().abs()).all())}
    run.log(f"{label}: max abs err {result['max_abs_err']:.2e}, mean {result['mean_abs_err']:.2e} "
            f"(|ref| <= {result['ref_max_abs']:.2f}; atol {atol:g}, rtol {rtol:g}) "
            f"{'ok' if result['passed'] else 'FAILED'}")
    return result


def decode_attention_bytes(B: int, H: int, Hkv: int, S: int, D: int, cache_dtype: str, q_dtype: str) -> int:
    """What one decode attention call must move: K and V for S positions of B x Hkv heads, int8's
    per-position fp32 scales (fp8's two per-tensor scales: 8 bytes), q read and out written."""
    cache = 2 * B * Hkv * S * D * BYTES_PER_ELEMENT[cache_dtype]
    scales = 2 * B * Hkv * S * 4 if cache_dtype == "int8" else 8 if cache_dtype == "fp8" else 0
    return cache + scales + 2 * B * H * D * BYTES_PER_ELEMENT[q_dtype]


# ---------------------------------------------------------------- 1. calibration
def calibration_section(run: Run) -> dict:
    from . import calibrate
    from .measure import format_rate
    from .recordings import provenance
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
              for B, S in s.decode_checks for c in (run.dtype, "fp8", "int8")]
    steps += [(f"kv_quant {c}", lambda c=c: check_kv_quant(run, c)) for c in ("int8", "fp8")]
    checks = run_steps(run, steps)
    # A check the budget skipped did not fail, but it did not pass either: the summary names it.
    run.results["correctness_passed"] = all(c.get("passed", True) for c in checks)
    run.results["correctness_not_run"] = {c["step"]: c["skipped"] for c in checks if "skipped" in c}
    return {"checks": checks, "all_passed": run.results["correctness_passed"],
            "not_run": run.results["correctness_not_run"]}


def check_matmul(run: Run, M: int, K: int, N: int) -> dict:
    from kernels.matmul import matmul, matmul_reference
    a, w = randn(run, (M, K), 1), randn(run, (N, K), 2, scale=K ** -0.5)  # w: an nn.Linear weight; c is O(1)
    return compare(run, f"matmul {M}x{K}x{N}", matmul(a, w.t()), matmul_reference(a, w.t()),
                   kernel="matmul", shape={"M": M, "K": K, "N": N})


def check_flash(run: Run, P: int, S: int) -> dict:
    """Every head through the kernel; the fp32 reference on the query heads of the first two kv
    heads, which keeps its [P, S] score matrices small and still checks the GQA head mapping."""
    from kernels.flash_attention import attention_reference, flash_attention
    H, Hkv, D = run.sizes.heads
    q, k, v = randn(run, (1, H, P, D), 3, Q_SHARPNESS), randn(run, (1, Hkv, S, D), 4), randn(run, (1, Hkv, S, D), 5)
    out, kv_heads = flash_attention(q, k, v, causal=True), min(Hkv, 2)
    heads = H // Hkv * kv_heads
    ref = attention_reference(q[:, :heads], k[:, :kv_heads], v[:, :kv_heads], causal=True)
    return compare(run, f"flash P={P} S={S}", out[:, :heads], ref, kernel="flash_attention", causal=True,
                   shape={"B": 1, "H": H, "Hkv": Hkv, "P": P, "S": S, "D": D}, heads_checked=heads)


def check_decode(run: Run, B: int, S: int, cache_dtype: str) -> dict:
    """Sequences of random lengths up to S (the last one full), so the masking is checked too."""
    import torch
    from kernels.decode_attention import decode_attention, decode_attention_reference
    H, Hkv, D = run.sizes.heads
    q = randn(run, (B, H, D), 6, Q_SHARPNESS)
    k, v, ks, vs = quantized_cache(run, randn(run, (B, Hkv, S, D), 7), randn(run, (B, Hkv, S, D), 8), cache_dtype)
    lengths = torch.randint(1, S + 1, (B,), generator=torch.Generator().manual_seed(9), dtype=torch.int32)
    lengths[-1] = S
    lengths = lengths.to(run.device)
    tolerance = None if cache_dtype == run.dtype else max(TOLERANCE[run.dtype], QUANTISED_CACHE_TOLERANCE)
    return compare(run, f"decode {cache_dtype} B={B} S={S}", decode_attention(q, k, v, lengths, ks, vs),
                   decode_attention_reference(q, k, v, lengths, ks, vs), tolerance, kernel="decode_attention",
                   cache_dtype=cache_dtype, shape={"B": B, "H": H, "Hkv": Hkv, "S": S, "D": D})


def check_kv_quant(run: Run, cache_dtype: str) -> dict:
    """The Triton quantiser against its reference, in codes: int8 may differ by one code on CUDA
    (its fp32 division can round a tie the other way), fp8 by one e4m3 step (2^-3 of the value,
    2^-9 among the subnormals); int8's scales to 1e-6."""
    import torch
    from kernels.kv_quant import quantize_kv, quantize_kv_reference
    if cache_dtype == "fp8" and run.device != "cuda":
        run.log("kv_quant fp8: skipped (the interpreter miscasts fp32 -> fp8 inside a kernel)")
        return {"kernel": "kv_quant", "cache_dtype": "fp8", "passed": True,
                "skipped": "needs a GPU: the interpreter miscasts fp32 -> fp8 inside a kernel"}
    (B, S), (_, Hkv, D) = run.sizes.decode_checks[0], run.sizes.heads
    x = randn(run, (B, Hkv, S, D), 10, scale=3.0)
    scale = torch.tensor(0.5, device=run.device) if cache_dtype == "fp8" else None
    q, s = quantize_kv(x, cache_dtype, scale, use_triton=True)
    q_ref, s_ref = quantize_kv_reference(x, cache_dtype, scale)
    codes = (float(run.device == "cuda"), 0.0) if cache_dtype == "int8" else (2 ** -9, 2 ** -3)
    result = compare(run, f"kv_quant {cache_dtype} codes", q.float(), q_ref.float(), codes,
                     kernel="kv_quant", cache_dtype=cache_dtype, shape=list(x.shape))
    if cache_dtype == "int8":
        scales = compare(run, "kv_quant int8 scales", s, s_ref, (0.0, 1e-6))
        result.update(scale_max_abs_err=scales["max_abs_err"], passed=result["passed"] and scales["passed"])
    return result


# ---------------------------------------------------------------- 3. kernel timing
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
    from .measure import format_rate, format_seconds, time_fn
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
    nbytes = (M * K + K * N + M * N) * BYTES_PER_ELEMENT[run.dtype]
    return {"kernel": "matmul", "shape": {"M": M, "K": K, "N": N},
            **bench(run, f"matmul {M}x{K}x{N} {run.dtype}", 2 * M * K * N, nbytes, lambda: matmul(a, b),
                    "torch.matmul", lambda: torch.matmul(a, b), f" (target >= {TARGET_MATMUL_VS_TORCH})")}


def time_flash(run: Run, P: int) -> dict:
    """Causal self-attention, FLOPs = 4 H D P(P+1)/2 (QK^T and PV over the causal pairs). SDPA
    gets K/V expanded to H heads: its fused kernels want equal head counts, and prefill attention
    is compute-bound, so reading 4x the K/V costs it little."""
    import torch.nn.functional as F
    from kernels.flash_attention import flash_attention
    H, Hkv, D = run.sizes.heads
    q, k, v = randn(run, (1, H, P, D), 3), randn(run, (1, Hkv, P, D), 4), randn(run, (1, Hkv, P, D), 5)
    kx, vx = k.repeat_interleave(H // Hkv, dim=1), v.repeat_interleave(H // Hkv, dim=1)
    flops = 4 * H * D * roofline.attention_pairs(P, 0, "causal")
    nbytes = 2 * (H + Hkv) * P * D * BYTES_PER_ELEMENT[run.dtype]  # q and o; k and v
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

    nbytes = decode_attention_bytes(B, H, Hkv, S, D, cache_dtype, run.dtype)
    return {"kernel": "decode_attention", "cache_dtype": cache_dtype,
            "shape": {"B": B, "H": H, "Hkv": Hkv, "S": S, "D": D},
            **bench(run, f"decode {cache_dtype} B={B} S={S}", 4 * B * H * D * S, nbytes,
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


# ---------------------------------------------------------------- 4. model sweeps
def sweep_section(run: Run, phase: str) -> dict:
    """Build the model once (labkit.sweeps keeps it) and measure each point with a fresh KV cache,
    refused before allocating if it does not fit; if the model itself does not fit, every point
    says so."""
    from . import sweeps
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
    return {"phase": phase, "model": run.sizes.model, "points": points}


def prefill_steps(run: Run, model) -> list:
    from . import sweeps

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
    from . import sweeps
    s = run.sizes

    def point(B, S, c):
        spec, dtype = model.spec, model.compute_dtype
        return sweep_point(run, model, {"phase": "decode", "batch": B, "context_tokens": S, "cache_dtype": c},
                           roofline.memory_footprint_bytes(spec, B, S + 1, dtype, c, prefill_tokens=1),
                           lambda hw: roofline.predicted_decode_step_s(spec, B, S, hw, dtype, c),
                           lambda: sweeps.measure_decode(spec.name, B, S, c, run.device, repeats=s.sweep_repeats))

    grid = [(B, s.context, c) for c in ("bf16", "fp8", "int8") for B in decode_batches(run, model, c)]
    grid += [(1, S, c) for c in ("bf16", "fp8", "int8") for S in s.contexts if S != s.context]
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
    from .backend import check_fits
    try:
        check_fits(footprint_bytes - roofline.weight_bytes(model.spec, model.compute_dtype), run.device, what)
    except FootprintError as err:
        return str(err)
    return None


def sweep_point(run: Run, model, where: dict, footprint_bytes: float, predict, measure) -> dict:
    """One labkit.sweeps point: the old cache freed, the new one refused before allocating if it
    does not fit, else the roof printed, the point measured and the datasheet's roof added."""
    from .measure import format_seconds
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
        point.update(datasheet_predicted_time_s=predicted_s, datasheet_roof_fraction=predicted_s / point["time_s"])
    run.log(f"  measured {format_seconds(point['time_s'])} = {point['roof_fraction']:.2f} of the calibrated roof "
            f"({point['bound']}-bound), {point['tokens_per_s']:,.0f} tokens/s"
            + (f"; {HOST_BOUND_NOTE}" if point.get("host_bound") else ""))
    return point


# ---------------------------------------------------------------- command line
SECTION_FUNCTIONS = {"calibration": calibration_section, "correctness": correctness_section,
                     "kernels": kernels_section, "prefill_sweep": lambda run: sweep_section(run, "prefill"),
                     "decode_sweep": lambda run: sweep_section(run, "decode")}


class _UsageError(Exception):
    """argparse's complaint, or ours, shown as one line."""


class _Parser(argparse.ArgumentParser):
    def error(self, message):  # argparse would print the usage too; one line is the contract
        raise _UsageError(message)


def parse_args(argv=None) -> argparse.Namespace:
    parser = _Parser(prog="python -m labkit.gpu_check", description=__doc__.splitlines()[0])
    parser.add_argument("--out", required=True, help="directory for the recordings (created if missing)")
    parser.add_argument("--dry-run", action="store_true", help="toy sizes; on a CPU in Triton's interpreter")
    parser.add_argument("--budget-s", type=float, default=DEFAULT_BUDGET_S,
                        help=f"wall-time budget in seconds ({DEFAULT_BUDGET_S:.0f})")
    parser.add_argument("--only", default=",".join(SECTIONS), help=f"a comma-separated subset of {','.join(SECTIONS)}")
    args = parser.parse_args(argv)
    if not 0 < args.budget_s < float("inf"):
        raise _UsageError(f"--budget-s must be a positive number of seconds, got {args.budget_s}")
    wanted = {name.strip().replace("-", "_") for name in args.only.split(",") if name.strip()}
    if not wanted or wanted - set(SECTIONS):
        raise _UsageError(f"--only: unknown section(s) {', '.join(sorted(wanted - set(SECTIONS))) or '(none)'}; "
                          f"known: {','.join(SECTIONS)}")
    if os.path.exists(args.out) and not os.path.isdir(args.out):
        raise _UsageError(f"--out {args.out!r} exists and is not a directory")
    args.sections, args.argv = tuple(s for s in SECTIONS if s in wanted), argv
    return args


def main(argv=None) -> int:
    try:
        args = parse_args(argv)
    except _UsageError as err:
        print(f"gpu_check: error: {err}", file=sys.stderr)
        return 2
    import torch  # torch does not import triton; the kernels do, later
    device = "cuda" if torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET") != "1" else "cpu"
    if device == "cpu" and not args.dry_run:
        print(NO_GPU, file=sys.stderr)
        return 2
    if device == "cpu" and os.environ.get("TRITON_INTERPRET") != "1":
        if "triton" in sys.modules:
            print("gpu_check: error: set TRITON_INTERPRET=1 before triton is imported", file=sys.stderr)
            return 2
        os.environ["TRITON_INTERPRET"] = "1"  # no GPU: the kernels run in Triton's interpreter
    datasheet = datasheet_for(torch.cuda.get_device_name(0)) if device == "cuda" else None
    run = Run(args, device, "bf16" if device == "cuda" else "fp16", DRY if args.dry_run else FULL,
              Budget(args.budget_s, args.sections), datasheet)
    for section in args.sections:
        run.budget.section, run.budget.last_step_s = section, 0.0
        try:
            body = SECTION_FUNCTIONS[section](run)
        except Exception as err:  # noqa: BLE001 - recorded; the next sections still run
            run.log(f"ERROR {error_line(err)}")
            body = {"error": error_line(err)}
            run.results.setdefault("section_errors", {})[section] = body["error"]
        try:
            write_section(run, section, body)
        except OSError as err:  # --out unwritable: nothing can be kept, so stop
            print(f"gpu_check: error: could not write the {section} recording: {err}", file=sys.stderr)
            return 2
    passed = run.results.get("correctness_passed", True)
    not_run = run.results.get("correctness_not_run") or {}
    status = "correctness failed" if not passed else "ok" if not not_run else \
        f"ok, but not run: {'; '.join(f'{step} ({why})' for step, why in not_run.items())}"
    print(json.dumps({"gpu_check": status, "dry_run": args.dry_run, "device": device,
                      "datasheet": run.datasheet.name if run.datasheet else None, "budget_s": args.budget_s,
                      "wall_s": round(time.perf_counter() - run.budget.start_s, 1), **run.results,
                      "recordings": run.recordings}), flush=True)
    return 0 if passed else 1


if __name__ == "__main__":
    raise SystemExit(main())
