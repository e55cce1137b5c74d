"""`make bench`: issue 13's tables measured for real, each point bracketed, as one recording.

    python -m labkit bench                      # data/recordings/bench-cpu.json (-2, -3 ... if taken)
    python -m labkit bench --out DIR --json

A benchmark, not a timed test: nothing here passes or fails on speed. It calibrates afresh
(`calibrate.load_or_calibrate(refresh=True)`: the roofs of this moment, the bandwidth by working
set included), then measures on the lab's model for this device (`sizes.lab_settings`):

    decode_batch   decode B = 1, 4, 16, 32 at S = 1,024, the lab's cache dtype
    cache_dtype    decode B = 16, S = 4,096, each cache dtype the device offers (`sizes.CACHE_DTYPES`;
                   the recording's `not_offered` names the others, with why: the CPU's fp8)
    prefill        prefill P = 1,024, 2,048, 4,096

each with `sweeps.bracketed` (the bandwidth read just before and after, at the point's working
set), every table `rounds` times over (`sizes.BENCH_ROUNDS`, one whole pass after another; the
tables show each point's median round, `median_round`), and writes every round's point, the calibration it was judged by, the machine's load (its load
average, and the share of the cores other processes kept busy meanwhile) and the provenance (`recordings.write_recording`, never overwriting). `ratios` puts the measured
gains beside the roofline's: tokens/s at B = 16 over B = 1, and each cache dtype's step time
over fp32's (the issue's targets for a CPU decode step that batches and a cache dtype lever
that works); `targets` sets every figure beside the issue's target for it.
"""
from __future__ import annotations

import dataclasses
import os
from pathlib import Path

from . import backend, calibrate, cpu_info, roofline, sizes, sweeps
from .errors import LabError
from .model import check_weights_fit
from .recordings import check_writable, write_recording
from .specs import get_model
from .timing import NOISY_SPREAD

DEFAULT_OUT = Path(__file__).resolve().parent.parent / "data" / "recordings"
DECODE_BATCHES, DECODE_CONTEXT = (1, 4, 16, 32), 1024
DTYPE_BATCH, DTYPE_CONTEXT = 16, 4096
PREFILL_PROMPTS = (1024, 2048, 4096)


def bench_steps(device: str, cache_dtype: str) -> list[dict]:
    """The points of the three tables, in order: table, phase and the measurement's arguments."""
    steps = [{"table": "decode_batch", "phase": "decode", "batch": b, "context_tokens": DECODE_CONTEXT,
              "cache_dtype": cache_dtype} for b in DECODE_BATCHES]
    steps += [{"table": "cache_dtype", "phase": "decode", "batch": DTYPE_BATCH, "context_tokens": DTYPE_CONTEXT,
               "cache_dtype": d} for d in sizes.CACHE_DTYPES[device]]
    steps += [{"table": "prefill", "phase": "prefill", "prompt_tokens": p} for p in PREFILL_PROMPTS]
    return steps


def run_bench(device: str | None = None, out: str | Path = DEFAULT_OUT, model: str | None = None,
              steps: list[dict] | None = None, log=None, rounds: int = sizes.BENCH_ROUNDS) -> tuple[Path, dict]:
    """Calibrate, measure every step bracketed in `rounds` rounds (all steps, then all again), write
    one recording; (its path, its payload)."""
    if not (isinstance(rounds, int) and not isinstance(rounds, bool) and 1 <= rounds <= sizes.MAX_BENCH_ROUNDS):
        raise LabError(f"rounds must be an integer in 1..{sizes.MAX_BENCH_ROUNDS}, got {rounds!r}")
    log = log or (lambda line: None)
    here = backend.choose_device(device)
    settings = sizes.lab_settings(here.device)
    spec = get_model(model or settings["model"])  # a bad name refused before the folder is made
    # a model whose weights alone do not fit, refused before the calibration, not point by point after it
    check_weights_fit(spec, here.compute_dtype, here.device)
    check_writable(out)  # a minute of measuring that could not be kept would be lost
    steps = steps if steps is not None else bench_steps(here.device, settings["cache_dtype"])
    load_before, busy_from = _load_average(), cpu_info.load_snapshot()
    fresh, fresh_info = calibrate.load_or_calibrate(here.device, refresh=True, log=log)
    log(calibrate.describe(fresh, fresh_info))
    # What every point is judged by (`sweeps` asks load_or_calibrate): the fresh calibration, or,
    # where that was noisy and so not cached, the cached one; the recording names the one used.
    hardware, info = calibrate.load_or_calibrate(here.device)
    unused = None
    if info.get("date") == fresh_info.get("date"):
        hardware, info = fresh, fresh_info  # the same one, with how it came about
    else:
        unused = {**_calibration_summary(fresh, fresh_info),
                  "not_used": f"noisy, so not cached: the points are judged by the cached calibration of {info.get('date')}"}
        log(f"labkit: the fresh calibration was noisy; the points are judged by the cached one of {info.get('date')}")
    points = []  # every round's points, in the order they were measured
    for r in range(1, rounds + 1):
        for i, step in enumerate(steps, start=1):
            points.append({**_measure_settled(spec, here.device, step), "round": r, "step": i - 1})
            again = " (measured again: the memory changed speed during the first try)" \
                if points[-1].get("moment_changed_tries") else ""
            log(f"[round {r}/{rounds}, {i}/{len(steps)}] {row(points[-1])['point']}: {_line(row(points[-1]))}{again}")
    medians = [median_round([p for p in points if p["step"] == i]) for i in range(len(steps))]
    gains = ratios(medians)
    payload = {"phase": "bench", "device": here.device, "model": spec.name, "compute_dtype": here.compute_dtype,
               "issue": 13, "rounds": rounds, "calibration": _calibration_summary(hardware, info),
               **({"fresh_calibration": unused} if unused else {}),
               "load_average": {"before": load_before, "after": _load_average()},
               # the share of all cores other processes kept busy over the whole run (None: not known here)
               "others_busy_share": cpu_info.others_busy_share(busy_from),
               "tables": {t: [row(p) for p in medians if p["table"] == t] for t in dict.fromkeys(s["table"] for s in steps)},
               "ratios": gains,
               "targets": targets(medians, gains, roofline.decode_compute_bound_batch_at_roof(
                   spec, hardware, DECODE_CONTEXT, here.compute_dtype, settings["cache_dtype"], here.compute_dtype,
                   roofline.KERNEL)),
               "not_offered": sizes.NOT_OFFERED.get(here.device, {}), "points": points}
    path = write_recording(out, f"bench-{here.device}", payload)
    log(f"labkit: bench recording written to {path}")
    return path, payload


def _measure(spec, device: str, step: dict) -> dict:
    """One step, bracketed at its working set; a step the device refuses is kept, with why."""
    args = {k: v for k, v in step.items() if k not in ("table", "phase")}
    try:
        if step["phase"] == "decode":
            working_set = sweeps.decode_working_set_bytes(spec, device=device, **args)
            point = sweeps.bracketed(lambda: sweeps.measure_decode(spec, device=device, **args), device, working_set)
        else:
            working_set = sweeps.prefill_working_set_bytes(spec, device=device, **args)
            point = sweeps.bracketed(lambda: sweeps.measure_prefill(spec, device=device, **args), device, working_set)
    except LabError as err:
        return {**step, "skipped": str(err)}
    return {"table": step["table"], **point}


# A point the memory changed speed during (`moment_changed`) is measured this many times more, at
# once: its bracket judged it by a moment it may not have run in. The try kept is the round's
# point; the ones before it stay in the recording beside it (`moment_changed_tries`), so nothing
# measured is dropped. As a calibration figure is repeated until a second call confirms it.
MOMENT_RETRIES = 1
_TRY_KEYS = ("time_s", "bracketed_roof_fraction", "bandwidth_before_bytes_per_s", "bandwidth_after_bytes_per_s")


def _measure_settled(spec, device: str, step: dict) -> dict:
    """`_measure`, and again, up to MOMENT_RETRIES times, while the memory changed speed during it;
    the last try, with the earlier ones' figures as its "moment_changed_tries" where there were any."""
    point, tries = _measure(spec, device, step), []
    while moment_changed(point) and len(tries) < MOMENT_RETRIES:
        tries.append({k: point.get(k) for k in _TRY_KEYS})
        point = _measure(spec, device, step)
    return {**point, "moment_changed_tries": tries} if tries else point


def median_round(rounds: list[dict]) -> dict:
    """Of one step's points, one per round, the round of the median step time (of an even count
    the faster middle one): a real measured point, as the tables show it, with every round's time
    and bracketed roof fraction beside it. A shared VM's neighbours move a point by tens of percent
    from minute to minute (a 2-core Xeon VM: B = 16 decode 8.4 and 10.9 ms in two runs minutes
    apart), which no single pass can tell from the lab's own speed; a skipped step stays skipped."""
    timed = sorted((p for p in rounds if "time_s" in p), key=lambda p: p["time_s"])
    if not timed:
        return rounds[0]
    chosen = timed[(len(timed) - 1) // 2]
    in_order = [p for p in rounds if "time_s" in p]
    return {**chosen, "rounds_time_s": [p["time_s"] for p in in_order],
            "rounds_bracketed_roof_fraction": [p["bracketed_roof_fraction"] for p in in_order],
            "rounds_moment_changed": [moment_changed(p) for p in in_order]}


def moment_changed(point: dict) -> bool | None:
    """Whether the bandwidth read just before a bracketed point and the one just after differ by
    more than timing.NOISY_SPREAD (the spread a trusted figure stays under): the machine changed
    speed during the point, so its bracketed fraction judges it by a moment it may not have run
    in. None for a point without both readings. Seen: a B=1 step read 105 GB/s before and 75
    after, and its round put it at 0.58 of its roof where the other two gave 0.62 and 0.87
    (bench-cpu-37, 2-core EPYC VM)."""
    before, after = point.get("bandwidth_before_bytes_per_s"), point.get("bandwidth_after_bytes_per_s")
    if not before or not after:
        return None
    return max(before, after) > (1 + NOISY_SPREAD) * min(before, after)


def row(point: dict) -> dict:
    """One point as a table row: the issue's columns (measured, predicted, bracketed roof
    fraction) with the tokens/s, the tier and the planning line beside them, and for a decode
    step its fractions of the roof of its kernels in turn."""
    shape = (f"decode B={point['batch']}, S={point['context_tokens']:,}, cache {point['cache_dtype']}"
             if point["phase"] == "decode" else f"prefill P={point['prompt_tokens']:,}")
    if "skipped" in point:
        return {"point": shape, "skipped": point["skipped"]}
    keys = ("time_s", "predicted_time_s", "planned_time_s", "tokens_per_s", "roof_fraction", "bracketed_roof_fraction",
            "bound", "roof_tier", "roof_bandwidth_bytes_per_s", "working_set_bytes", "noisy", "kernels")
    # a decode step's kernels in turn, each at its own roof (`roofline.in_turn_time_s`)
    keys += tuple(k for k in ("in_turn_predicted_time_s", "in_turn_roof_fraction", "bracketed_in_turn_fraction")
                  if k in point)
    rounds = {k: point[k] for k in ("round", "rounds_time_s", "rounds_bracketed_roof_fraction", "rounds_moment_changed")
              if k in point}
    return {"point": shape, **{k: point.get(k) for k in keys}, **rounds}


def ratios(points: list[dict]) -> dict:
    """Measured against predicted: tokens/s at B = 16 over B = 1 (S = 1,024), and each cache
    dtype's step time over fp32's (B = 16, S = 4,096); absent where a point is missing.

    "predicted" is the calibration's; "predicted_bracketed" each point's own moment's, from the
    roofline times on their bracketed roofs (`sweeps.bracketed`), as the points' bracketed roof
    fractions are judged. Why both: on a VM whose caches and memory change speed from minute to
    minute, a calibration caught at a fast moment at 128-188 MiB and a slow one at 316 MiB
    predicted bf16/fp32 0.44 where the steps' own moments gave 0.77 and the steps measured 0.76
    (bench-cpu-29, 2-core EPYC VM)."""
    timed = [p for p in points if "time_s" in p]
    by_batch = {p["batch"]: p for p in timed if p["table"] == "decode_batch"}
    by_dtype = {p["cache_dtype"]: p for p in timed if p["table"] == "cache_dtype"}
    result = {}
    if 1 in by_batch and 16 in by_batch:  # tokens/s: B over the step time
        result["tokens_per_s_b16_over_b1"] = _ratio(by_batch[16], by_batch[1], "tokens_per_s",
                                                    lambda p, t: p["batch"] / t)
    base = by_dtype.get("fp32")
    for dtype, point in by_dtype.items():
        if base is not None and dtype != "fp32":
            result[f"step_{dtype}_over_fp32"] = _ratio(point, base, "time_s", lambda p, t: t)
    return result


# Issue 13's targets as its "what resolved means" states them, for `targets`.
ROOF_TARGET = 0.7  # decode points: of the roof of their moment and tier (the bracketed fraction)
GAIN_TARGET = 0.75  # tokens/s at B = 16 over B = 1: of the ratio the roofline predicts
RATIO_TOLERANCE = 0.25  # each cache dtype's step over fp32's: within this of the predicted ratio
PREFILL_TARGET = 0.5  # prefill at P >= 1,024: of the calibrated matmul peak


def targets(points: list[dict], gains: dict, compute_bound_batch: float | None) -> dict:
    """Issue 13's targets beside what this run measured, each {"what", the figures, "met"}: a
    report for whoever judges the issue, not a test (the bench passes or fails nothing). "met"
    follows the issue's words: decode and cache-dtype points by their bracketed fraction; the
    gain and the ratios against the calibration's prediction (the bracketed one shown beside).
    `points`: the tables' points (median rounds); `gains`: `ratios`' output; compute_bound_batch:
    the calibration's at S = DECODE_CONTEXT (`roofline.decode_compute_bound_batch_at_roof`;
    None: no batch reaches it, so every batch is in range)."""
    timed = [p for p in points if "time_s" in p]
    in_range = [p for p in timed if p["table"] == "decode_batch"
                and (compute_bound_batch is None or p["batch"] <= compute_bound_batch)]
    dtypes = [p for p in timed if p["table"] == "cache_dtype"]
    prefill = [p for p in timed if p["table"] == "prefill" and p["prompt_tokens"] >= 1024]
    ceiling = "no batch reaches it" if compute_bound_batch is None else f"B ≈ {compute_bound_batch:,.1f}"

    def at_least(what: str, fractions: dict, target: float) -> dict:  # met: some measured, all reach it
        return {"what": what, "fractions": fractions, "met": bool(fractions) and min(fractions.values()) >= target}
    result = {
        "decode_batches": at_least(f"every batch up to the compute-bound batch at S = {DECODE_CONTEXT:,} ({ceiling}) "
                                   f"at >= {ROOF_TARGET} of its bracketed roof",
                                   {f"B={p['batch']}": p["bracketed_roof_fraction"] for p in in_range}, ROOF_TARGET),
        "cache_dtypes": at_least(f"every cache dtype at >= {ROOF_TARGET} of its bracketed roof",
                                 {p["cache_dtype"]: p["bracketed_roof_fraction"] for p in dtypes}, ROOF_TARGET),
        "prefill": at_least(f"prefill at P >= 1,024 at >= {PREFILL_TARGET} of the calibrated matmul peak",
                            {f"P={p['prompt_tokens']}": p["roof_fraction"] for p in prefill}, PREFILL_TARGET),
    }
    ceilings = {f"B={p['batch']}": c for p in in_range if (c := in_turn_ceiling(p)) is not None}
    if ceilings:
        result["decode_batches"]["in_turn_ceilings"] = ceilings
    gain = gains.get("tokens_per_s_b16_over_b1")
    if gain:
        shares = {k: gain["measured"] / gain[k] for k in ("predicted", "predicted_bracketed") if k in gain}
        result["gain_b16_over_b1"] = {"what": f"tokens/s at B = 16 over B = 1 at >= {GAIN_TARGET} of the predicted ratio",
                                      "of_predicted": shares, "met": shares.get("predicted", 0) >= GAIN_TARGET}
    steps = {name: ratio for name, ratio in gains.items() if name.startswith("step_")}
    if steps:
        off = {name: {k: ratio["measured"] / ratio[k] - 1 for k in ("predicted", "predicted_bracketed") if k in ratio}
               for name, ratio in steps.items()}
        result["cache_ratios"] = {"what": f"each cache dtype's step over fp32's within {RATIO_TOLERANCE:.0%} of the "
                                          "predicted ratio", "off_predicted": off,
                                  "met": all(abs(o.get("predicted", 1)) <= RATIO_TOLERANCE for o in off.values())}
    return result


def in_turn_ceiling(point: dict) -> float | None:
    """The highest fraction of its whole-step roof a decode step whose kernels run one after
    another can reach on its moment's roofs (`sweeps.bracketed`): its whole-step roof time over
    the roof time of its kernels in turn, each at its own roof. 1 where every kernel has the
    step's bound; below 1 near the ridge, where the products turn compute-bound while attention
    still waits on memory, and the two times add where the whole-step roof lets one hide under the
    other. Seen: lab-cpu at B = 32, S = 1,024, products 4.60 ms at peak, attention 4.14 ms and the
    rest 0.10 ms at bandwidth, 8.84 ms in turn against 6.07 ms for the whole step: in turn at
    most 0.69 (2-core EPYC VM, `python -m labkit breakdown decode --batch 32 --context 1024`).
    None without both times."""
    whole, in_turn = point.get("bracketed_predicted_time_s"), point.get("bracketed_in_turn_predicted_time_s")
    return whole / in_turn if whole and in_turn else None


def _ratio(top: dict, bottom: dict, measured: str, of_time) -> dict:
    """`top` over `bottom`: measured (their `measured` key), and predicted from each point's
    predicted time t through `of_time(point, t)` (the calibration's, and where both were bracketed,
    their moments')."""
    result = {"measured": top[measured] / bottom[measured]}
    for name, key in (("predicted", "predicted_time_s"), ("predicted_bracketed", "bracketed_predicted_time_s")):
        if key in top and key in bottom:
            result[name] = of_time(top, top[key]) / of_time(bottom, bottom[key])
    return result


def _calibration_summary(hardware, info: dict) -> dict:
    """What the points were judged by, without the raw samples (they stay in the calibration cache)."""
    curve = [{"bytes": p["bytes"], "bytes_per_s": p["bytes_per_s"], "best": p["best"], "noisy": p["noisy"],
              **{f"{name}_bytes_per_s": t["bytes_per_s"] for name, t in p["tests"].items()}}
             for p in info.get("bandwidth_by_working_set", [])]
    spec = {k: v for k, v in dataclasses.asdict(hardware).items() if k != "bandwidth_by_working_set"}
    keep = ("date", "cache_status", "cache_file", "noisy", "tier_edges", "caches", "caches_source", "cpu_identity",
            "elapsed_s", "threads")
    return {"spec": spec, "bandwidth_by_working_set": curve, **{k: info.get(k) for k in keep}}


def _load_average() -> list[float] | None:
    try:
        return [round(x, 2) for x in os.getloadavg()]
    except (AttributeError, OSError):  # not on every OS
        return None


def _line(r: dict) -> str:
    if "skipped" in r:
        return f"skipped: {r['skipped']}"
    bracketed = r["bracketed_roof_fraction"]
    return (f"{r['time_s'] * 1e3:,.1f} ms ({r['tokens_per_s']:,.0f} tok/s), predicted {r['predicted_time_s'] * 1e3:,.1f} ms, "
            f"{r['roof_fraction']:.2f} of the {r['bound']}-bound roof ({r['roof_tier']})"
            + (f", {bracketed:.2f} bracketed" if bracketed is not None else "")
            + (f"; kernels in turn {r['bracketed_in_turn_fraction']:.2f} bracketed" if "bracketed_in_turn_fraction" in r else "")
            + (" (noisy)" if r["noisy"] else ""))
