"""For every lesson: grids of x values, measured points as chart series, and what to say about
a point (how close to its roof, notes on a faster or slower moment, the predict-first reveal, a
status line), and recorded runs as series."""
from __future__ import annotations

import math

from .. import roofline as r
from ..timing import busy_phrase, calls_phrase
from ..units import format_rate, format_seconds, machine_name, machine_of

# ---- every lesson: grids, measured points and what to say about them
def log_grid(low: float, high: float, points: int = 64) -> list[float]:
    """`points` values spaced evenly in log between `low` and `high` (inclusive)."""
    step = (math.log10(high) - math.log10(low)) / (points - 1)
    return [10 ** (math.log10(low) + i * step) for i in range(points)]


def spread(low: int, high: int, step: int, count: int) -> list[int]:
    """`count` values from `low` to `high`, evenly spaced and snapped to the slider's `step`."""
    if count < 2:
        return [high]
    return sorted({low + round((high - low) * i / (count - 1) / step) * step for i in range(count)})


def measured_series(records: list[dict], x_key: str) -> dict:
    """Measured points sorted by `x_key`, with predicted time and residual (measured / predicted - 1),
    and each point's fraction of its roof (`roof_phrase`, in its hover label, with `moment_note`
    on a line of its own where the point was judged by its moment too). Noisy points (spread
    above measure.NOISY_SPREAD) are kept apart so charts can flag them. "note": `over_roof_note`,
    for the chart as a whole."""
    rows = sorted(records, key=lambda rec: rec[x_key])
    series = {"x": [], "time_s": [], "predicted_time_s": [], "residual": [], "noisy": [],
              "spread": [], "roof_fraction": [], "label": []}
    for rec in rows:
        series["x"].append(rec[x_key])
        series["time_s"].append(rec["time_s"])
        series["predicted_time_s"].append(rec["predicted_time_s"])
        series["residual"].append(rec["time_s"] / rec["predicted_time_s"] - 1)
        series["noisy"].append(bool(rec.get("noisy", False)))
        series["spread"].append(rec.get("spread", 0.0))
        series["roof_fraction"].append(rec.get("roof_fraction"))
        roof = roof_phrase(rec) or f"{rec.get('bound', '')}-bound"
        moment = moment_note(rec)  # a point far from its roof: what the bandwidth just after it said
        timed = calls_phrase(rec.get("estimator", "median"), rec.get("samples", 1), rec.get("spread", 0.0),
                             _median_over_fastest(rec))
        series["label"].append(f"{machine_of(rec)}, {roof}, {timed}"
                               + (" (noisy)" if rec.get("noisy") else "") + (f"<br>{moment}" if moment else "")
                               + (f"<br>{busy_phrase(rec['others_busy_share'])}" if rec.get("disturbed") else ""))
    series["note"] = over_roof_note(rows)
    return series


# The kernels-in-turn roof is shown where it lies more than 2 % off the whole step's (`in_turn_parts`):
# at batch 1 the two differ only by the few bytes the parts count besides.
IN_TURN_PARTS = 1.02
IN_TURN_LABEL = "predicted, kernels in turn (each at its own roof)"
PLAN_LABEL = (f"the chapter's planning line ({r.CHAPTER_MFU:.0%} of peak FLOP/s, "
              f"{r.CHAPTER_BANDWIDTH_EFFICIENCY:.0%} of bandwidth)")


def roof_phrase(point: dict) -> str | None:
    """How close a measured point came to its roof, beside the chapter's planning fraction:
    "0.62 of the memory-bound roof (L3 bandwidth; the chapter plans 0.75)" or "0.41 of the
    compute-bound roof (peak FLOP/s; the chapter plans 0.40)"; None without a roof fraction. A
    decode step whose kernels in turn (`roofline.in_turn_time_s`) take over IN_TURN_PARTS of its
    roof's time adds its fraction of theirs: ", 0.72 of the roof of its kernels in turn"."""
    if point.get("roof_fraction") is None or point.get("bound") not in ("compute", "memory"):
        return None
    bound = point["bound"]
    what = "peak FLOP/s" if bound == "compute" else (f"{point['roof_tier']} bandwidth" if point.get("roof_tier")
                                                     else "bandwidth")
    plan = point.get("plan_fraction") or r.chapter_plan_fraction(bound)
    said = f"{point['roof_fraction']:.2f} of the {bound}-bound roof ({what}; the chapter plans {plan:.2f})"
    if in_turn_parts([point.get("in_turn_predicted_time_s")], [point.get("predicted_time_s")]):
        said += f", {point['in_turn_roof_fraction']:.2f} of the roof of its kernels in turn"
    return said


EFFICIENCY_GAP = 0.05  # two fractions of roof whose ratio lies within this of 1 are not worth a sentence


def efficiency_sentence(formula_ratio: float, top_fraction: float | None, bottom_fraction: float | None,
                        top_name: str, bottom_name: str, formula_name: str = "the formula's") -> str:
    """Why a measured ratio of two times (top ÷ bottom) differs from the formula's, as a sentence:
    each point's fraction of its own roof (`measure.roof_fraction`: roof time ÷ measured time).
    Measured top ÷ bottom is exactly the roof times' ratio × bottom's fraction ÷ top's, so a short
    prompt that runs further below its roof than a long one makes the measured growth smaller
    than the formula's (lab-cpu on the 2-core Zen 5: a 512-token prefill at 0.51 of its roof, a
    4,096-token one at 0.57; 15.9x by the formula, 14.1x measured). The sentence works the scaling
    from the fractions it prints, so its arithmetic checks by hand. '' when a fraction is missing,
    their ratio lies within EFFICIENCY_GAP of 1, or they print alike."""
    if not top_fraction or not bottom_fraction or abs(bottom_fraction / top_fraction - 1) < EFFICIENCY_GAP:
        return ""
    top, bottom = round(top_fraction, 2), round(bottom_fraction, 2)
    if top == bottom or not top:
        return ""
    return (f"The {bottom_name} ran at {bottom:.2f} of its roof and the {top_name} at {top:.2f}, which scales "
            f"{formula_name} {formula_ratio:.3g}× by {bottom:.2f} ÷ {top:.2f} to ≈ {formula_ratio * bottom / top:.3g}×.")


def in_turn_parts(in_turn, roof) -> bool:
    """Whether the kernels-in-turn roof (`roofline.in_turn_time_s`; times or tokens/s, None where
    not known) lies more than IN_TURN_PARTS off the whole step's anywhere: shown only then, in a
    point's line (`roof_phrase`) and as a chart's dotted line (`views`), not as a second line
    under the first where every part is bound by the same resource."""
    return any(a and b and max(a / b, b / a) > IN_TURN_PARTS for a, b in zip(in_turn or (), roof))


def above_roof_note(fraction: float) -> str | None:
    """What a run faster than its roof (fraction > 1) means, in one sentence; None below it.

    A true roof cannot be beaten, so either the roof is stale (a calibration made when the
    machine was slower: a shared machine's bandwidth moved 2x within half an hour on the lab's
    VM) or the run read less from memory than counted (data kept in a cache between calls)."""
    if not fraction > 1.0:
        return None
    return (f"{fraction:.0%} of the calibrated roof: the machine is faster now than when it was "
            "calibrated, or data stayed in cache between calls; `python -m labkit calibrate --refresh` "
            "measures the roof again, `measure --bracket` judges one run by the bandwidth of its moment")


def over_roof_note(records: list[dict]) -> str | None:
    """One line for a chart whose measured points beat their calibrated roof: how many, by how
    much, and which of `above_roof_note`'s two reasons the bandwidth read just after them
    (`sweeps.with_moment`) points to; None where none did.

    Why a chart needs it: a point's hover label says this, and a slider's status line says it of
    the latest point, but a chart of several points (a fixed sweep, or a slider's points so far)
    shows only negative residual bars, which a learner reads as the roofline being wrong. On the
    2-core EPYC VM (Zen 5) every point of lesson 04's context sweep took 11-22 % less time than
    its roof's in one `make report` run, against a calibration from a slower moment."""
    over = [rec for rec in records if (rec.get("roof_fraction") or 0.0) > 1.0]
    if not over:
        return None
    most = max(rec["roof_fraction"] for rec in over)
    who = ("This point" if len(records) == 1 else f"All {len(over)} points" if len(over) == len(records)
           else f"{len(over)} of {len(records)} points")
    said = f"{who} ran faster than the calibrated roof (up to {most:.2f}×; hover {'it' if len(over) == 1 else 'one'} for its reading):"
    read = [rec["moment_roof_fraction"] for rec in over if rec.get("moment_roof_fraction") is not None]
    if len(read) < len(over):  # some not read again (a GPU's, a compute-bound one's): either reason
        return (f"{said}<br>the machine is faster now than when it was calibrated, "
                "or data stayed in a cache between calls")
    beat = sum(fraction > 1.0 for fraction in read)
    lines = [said]
    if beat < len(over):
        who = "it" if len(over) == 1 else "them" if not beat else f"{len(over) - beat} of them"
        lines.append(f"the memory read as fast just after {who}, so the calibration is from a slower moment "
                     "(`python -m labkit calibrate --refresh`)")
    if beat:
        who = ("it" if len(over) == 1 else "they" if beat == len(over) else f"{beat} of them")
        lines.append(f"{who} beat the memory read just after too: data stayed in a cache between calls")
    return "<br>".join(lines)


HOST_BOUND_NOTE = "host-bound: the GPU waited for Python to launch its work; this time measures the host, not the GPU"
L2_RESIDENT_NOTE = ("L2-resident: this working set is under twice the GPU's L2, so back-to-back calls may read it "
                    "from the L2, not HBM; left out of the conclusions")


def moment_note(point: dict, where_slow: str = " (`python -m labkit breakdown` shows which part)") -> str | None:
    """What the bandwidth read just after a point far from its roof says (`sweeps.with_moment`),
    in one sentence; None without that reading. Near the roof of its moment, the calibration was
    from another moment; far from it there too, the step itself falls short (`where_slow`: what
    says where). Both where both hold: over the calibrated roof, or a calibration more than
    `roofline.TIER_STEP` off the moment's reading, and far under the moment's roof too."""
    now = point.get("moment_bandwidth_bytes_per_s")
    if now is None:
        return None
    fraction, calibrated = point["moment_roof_fraction"], point["roof_bandwidth_bytes_per_s"]
    # "at this size": the calibration's figure is its curve's at this working set, not the DRAM figure
    # it prints first (a learner in Chromium met 63.1 GB/s here beside a printed "DRAM 45.7 GB/s")
    said = (f"the memory read {format_rate(now, 'B/s')} at this working set just after it (the calibration: "
            f"{format_rate(calibrated, 'B/s')} at this size), and the step reached {fraction:.2f} of that "
            f"moment's roof")
    if fraction > 1.0:
        return said + ", over it too: data stayed in a cache between calls"
    clauses = []
    # the calibration's roof was off: the point is near the moment's roof, or over the calibrated one,
    # or the two readings lie further apart than a shared machine's noise (r.TIER_STEP)
    apart = max(now / calibrated, calibrated / now) >= r.TIER_STEP
    if fraction >= r.FAR_FROM_ROOF or fraction * now / calibrated > 1.0 or apart:
        pace = "faster" if calibrated > now else "slower"
        clauses.append(f"the calibration is from a {pace} moment than this one "
                       "(`python -m labkit calibrate --refresh` measures it again)")
    if fraction < r.FAR_FROM_ROOF:
        clauses.append("this step itself falls short here" + where_slow)
    return said + ", so " + ", and ".join(clauses)


def point_notes(point: dict) -> list[str]:
    """What a reader of one measured point should know beyond its numbers: that it beat its
    roof (`above_roof_note`), what the bandwidth of its moment says (`moment_note`), that its GPU
    waited on the host (`host_bound`), or that its working set could stay in a GPU's L2 between
    calls (`l2_resident`)."""
    moment = moment_note(point)  # where read, it says which of the above-roof note's two reasons it was
    notes = [moment or above_roof_note(point.get("roof_fraction", 0.0)),
             HOST_BOUND_NOTE if point.get("host_bound") else None,
             L2_RESIDENT_NOTE if point.get("l2_resident") else None]
    return [note for note in notes if note]


# How `reveal` names the estimate (its row, a pick's sentence, a number's sentence), and how
# `as_sample` renames it where nobody typed it (a report, nbval: `predict.DEFAULTS`' value).
YOURS = ("your estimate", "Your pick", "Your estimate")
SAMPLE = ("a sample estimate", "The sample pick", "The sample estimate")


def shown_value(value, unit: str | None) -> str:
    """A reveal's value as its rows show it: three figures and the unit ("8.1×", "120 ms"), a pick as is."""
    return value if unit is None else f"{value:,.3g}{'' if unit in ('×', '%') else ' '}{unit}"


CLOSE_WITHIN = 0.25  # an estimate within a quarter of the measurement is said to be close


def reveal(question: str, unit: str | None, estimate, formula, measured, device_name: str, why: str,
           formula_label: str = "the formula, on this machine's calibrated roofline",
           measured_label: str | None = None, measured_noun: str = "measurement", then: str = "",
           busy_share: float | None = None) -> dict:
    """A committed estimate beside the formula's answer and the measurement, with one line on the
    gap (`views.Predict` shows it). `unit` None: a choice, compared for equality; else numbers,
    compared as ratios (within `CLOSE_WITHIN` counts as close); "values" keeps the three unrounded
    (`estimates` keeps them for a room's summary). What is not measured directly says
    what it is (`measured_label`, `measured_noun`: lesson 05's figure is a simulation run on
    measured step times). `then`: a sentence after the why (`efficiency_sentence`). `busy_share`:
    the share of the cores other programs kept busy while a measured point was timed, where one was
    disturbed: said after the why, and kept in "values", so a room's summary leaves that measurement
    out of its figures."""
    if busy_share is not None:
        why += f"; {busy_phrase(busy_share)}"
    rows = [(YOURS[0], shown_value(estimate, unit)), (formula_label, shown_value(formula, unit)),
            (measured_label or f"measured on {machine_name(device_name)}", shown_value(measured, unit))]
    if unit is None:
        verdict = "matches" if estimate == measured else "differs from"
        agree = "agrees" if formula == measured else f"says {formula}"
        gap = f"{YOURS[1]} {verdict} the {measured_noun}; the formula {agree}. Why: {why}."
    else:
        gap = (f"{YOURS[2]} {_relative(estimate, measured)} the {measured_noun}; the formula "
               f"{_relative(formula, measured)} it. Why: {why}.")
    return {"question": question, "rows": rows, "gap": gap + (f" {then}" if then else ""),
            "values": {"estimate": estimate, "formula": formula, "measured": measured,
                       **({"busy_share": busy_share} if busy_share is not None else {})}}


def as_sample(shown: dict) -> dict:
    """`reveal`'s result with its estimate called a sample, not the reader's: the first row's name
    and the gap's opening words (a report's reader must not take the recorded default for theirs)."""
    rows = [(SAMPLE[0] if name == YOURS[0] else name, value) for name, value in shown["rows"]]
    gap = shown["gap"]
    for yours, sample in zip(YOURS[1:], SAMPLE[1:]):
        if gap.startswith(yours + " "):
            gap = sample + gap[len(yours):]
    return {**shown, "rows": rows, "gap": gap}


def _relative(value: float, reference: float) -> str:
    """'matches', 'is within 10% of' or 'is 2.1 times' — how `value` compares with `reference`.
    The percentage is rounded up, so it is a true bound and never reads 'within 0%'."""
    if not value or not reference:
        return "is not comparable with"
    ratio = value / reference
    if abs(ratio - 1) < 5e-4:  # equal to the 3 figures the reveal's rows show
        return "matches"
    if abs(ratio - 1) <= CLOSE_WITHIN:
        return f"is within {math.ceil(round(abs(ratio - 1) * 100, 6)):.0f}% of"
    return f"is {ratio:.2g} times"


def _median_over_fastest(point: dict) -> float | None:
    """The median call's time over the fastest's, from a measured point (None where not recorded)."""
    median, fastest = point.get("time_median_s"), point.get("time_min_s")
    return median / fastest if median and fastest else None


def point_summary(point: dict) -> str:
    """One measured point for a status bar, in short lines: measured beside predicted, the rate
    and how close to the roof; where and how it was timed; then each of `point_notes` on a line
    of its own (one line of ~80 words was hard to read under a chart)."""
    rate = f"{point['tokens_per_s']:,.0f} tokens/s" if point.get("tokens_per_s") else None
    timed = calls_phrase(point.get("estimator", "median"), point["samples"], point.get("spread") or 0.0,
                         _median_over_fastest(point)) if point.get("samples") else None
    result = [f"measured {format_seconds(point['time_s'])}" + (f" ({rate})" if rate else ""),
              f"predicted {format_seconds(point['predicted_time_s'])}",
              roof_phrase(point)]
    timing = [f"on {machine_of(point)}", timed,
              "noisy: the machine was busy, move the slider again to re-measure" if point.get("noisy") else None,
              busy_phrase(point["others_busy_share"]) + ": its time is partly theirs" if point.get("disturbed") else None]
    lines = ["; ".join(p for p in result if p), "; ".join(p for p in timing if p), *point_notes(point)]
    return "\n".join(lines)


def recorded_series(recordings: list[dict], x_key: str, y_key: str = "time_s", include_dry_runs: bool = False,
                    **where) -> list[dict]:
    """Each recording's measured points (skipped or failed steps left out) as one series,
    labelled with the hardware and date it was recorded on, with which points were host-bound
    (the GPU waited on Python's launches: the host's rate, not the GPU's). `where` keeps only points whose
    fields equal the given values (model="llama-3.1-8b", cache_dtype="bf16", ...). Dry runs
    (toy sizes on a CPU) are left out unless `include_dry_runs`."""
    series = []
    for rec in recordings:
        if rec.get("dry_run") and not include_dry_runs:
            continue
        points = sorted((p for p in rec.get("points", []) if y_key in p and x_key in p
                         and all(p.get(k) == v for k, v in where.items())), key=lambda p: p[x_key])
        if points:
            prov = rec["provenance"]
            label = f"recorded: {machine_of(prov)}, {str(prov['date'])[:10]}"
            series.append({"label": label, "x": [p[x_key] for p in points], "y": [p[y_key] for p in points],
                           "host_bound": [bool(p.get("host_bound")) for p in points],
                           "device": prov["device"], "path": rec.get("_path")})
    return series
