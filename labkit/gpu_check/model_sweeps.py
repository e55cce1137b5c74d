"""The GPU check's model sweeps: the Llama-shaped model's prefill over prompt lengths and its
decode step over batches, contexts and cache dtypes, each point measured by labkit.sweeps (as
the lessons measure theirs) beside labkit.roofline's prediction on both roofs. A point that
would not fit in memory is refused before anything is allocated, and recorded as skipped."""
from __future__ import annotations

from .. import roofline
from ..errors import FootprintError
from ..explore import HOST_BOUND_NOTE
from ..units import format_seconds
from .run import Run, error_line, roof_text, run_steps

CACHE_DTYPES = ("bf16", "fp8", "int8")


def sweep_section(run: Run, phase: str) -> dict:
    """Build the model once (labkit.sweeps keeps it) and measure each point with a fresh KV cache,
    refused before allocating if it does not fit; if the model itself does not fit, every point
    says so."""
    from .. import sweeps
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
    from .. import sweeps

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
    from .. import sweeps
    s = run.sizes

    def point(B, S, c):
        spec, dtype = model.spec, model.compute_dtype
        return sweep_point(run, model, {"phase": "decode", "batch": B, "context_tokens": S, "cache_dtype": c},
                           roofline.memory_footprint_bytes(spec, B, S + 1, dtype, c, prefill_tokens=1),
                           lambda hw: roofline.predicted_decode_step_s(spec, B, S, hw, dtype, c),
                           lambda: sweeps.measure_decode(spec.name, B, S, c, run.device, repeats=s.sweep_repeats))

    grid = [(B, s.context, c) for c in CACHE_DTYPES for B in decode_batches(run, model, c)]
    grid += [(1, S, c) for c in CACHE_DTYPES for S in s.contexts if S != s.context]
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
    from ..backend import check_fits
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
            f"({point['bound']}-bound), {point['tokens_per_s']:,.0f} tokens/s"
            + (f"; {HOST_BOUND_NOTE}" if point.get("host_bound") else ""))
    return point
