"""Lessons 05-07: static against continuous batching, a long prefill among decoding streams,
and where a request's time goes by workload shape."""
from __future__ import annotations

from .. import batching, workloads
from .. import roofline as r
from ..errors import SpecError
from ..specs import HardwareSpec, ModelSpec
from ..timing import CONFIRM_TOLERANCE, busy_phrase
from ..units import machine_name, machine_of

# ---- lesson 05: static vs continuous batching
def batching_bars(request_sets: dict, max_batch: int, step_time_s, prefill_time_s=None) -> dict:
    """Static and continuous batching on each request set: slot utilisation (%) and output
    throughput (tokens/s), as bar-chart lists in the order of `request_sets`."""
    bars = {"sets": list(request_sets), "max_batch": max_batch,
            "requests": [len(rows) for rows in request_sets.values()]}
    for policy in ("static", "continuous"):
        bars[policy] = {"utilisation_pct": [], "tokens_per_s": [], "ttft_p50_s": []}
    for rows in request_sets.values():
        result = batching.compare(rows, max_batch, step_time_s, prefill_time_s)
        for policy in ("static", "continuous"):
            bars[policy]["utilisation_pct"].append(100 * result[policy]["slot_utilisation"])
            bars[policy]["tokens_per_s"].append(result[policy]["throughput_tokens_per_s"])
            bars[policy]["ttft_p50_s"].append(result[policy]["ttft_p50_s"])
    return bars


def batching_line(bars: dict) -> str:
    """`batching_bars` in one line: the max batch and each set's continuous over static throughput,
    "simulated at max batch 16; continuous / static throughput: chapter shapes 1.70x, ...", and
    for a set whose every request fits in one batch, why their utilisations tie: with no request left
    waiting there is no seat to refill (continuous still steps faster: `labkit.batching`'s static
    batch carries its finished sequences as padding, continuous drops them)."""
    gains = ", ".join(f"{name} {continuous / static:.2f}x" for name, static, continuous in
                      zip(bars["sets"], bars["static"]["tokens_per_s"], bars["continuous"]["tokens_per_s"]))
    line = f"simulated at max batch {bars['max_batch']}; continuous / static throughput: {gains}"
    for name, requests in zip(bars["sets"], bars["requests"]):
        if requests <= bars["max_batch"]:
            line += (f"; {name}: all {requests:,} requests fit in one batch, so no seat is refilled and both"
                     " use their seats alike (continuous is faster only because finished sequences leave its steps)")
    return line


def step_time_curves(records: list[dict], step_time_s, context_tokens: int, name: str) -> list[dict]:
    """Measured decode points at `context_tokens` per sequence (markers) and the interpolated
    step time through them (a line), against batch, for `views.step_time_figure`."""
    points = sorted((rec["batch"], rec["time_s"]) for rec in records if rec["context_tokens"] == context_tokens)
    batches = list(range(1, 2 * max(b for b, _ in points) + 1))
    line = [float(step_time_s(b, b * context_tokens)) for b in batches]
    return [{"name": f"{name}: measured, {context_tokens:,} tokens each", "batch": [b for b, _ in points],
             "time_s": [t for _, t in points], "mode": "markers"},
            {"name": f"{name}: interpolated (extended past the last batch)", "batch": batches, "time_s": line}]


# ---- lesson 06: a long prefill among decoding streams
def interference_series(timeline) -> dict:
    """One `interference.Timeline` as chart data: each decode step's end (s) and the gap before
    it (ms), and the prefill chunks' (start, end) spans (s)."""
    ends = list(timeline.decode_end_s)
    gaps = [1e3 * g for g in timeline.gaps_s()]
    if timeline.chunked:
        name = f"chunks of {timeline.chunk_tokens:,} tokens"
    elif timeline.chunk_asked:  # the slider at the whole prompt: one chunk, beside the unchunked run
        name = f"one chunk of {timeline.prompt_tokens:,} tokens (the whole prompt)"
    else:
        name = "no chunking"
    return {"name": name, "end_s": ends[1:], "gap_ms": gaps, "chunks_s": list(timeline.chunk_spans_s),
            "device_name": machine_name(timeline.device_name)}


def interference_bars(timelines: list) -> dict:
    """Streams' worst and p99 gap, their undisturbed gap, and the long prompt's prefill time (ms),
    one bar per timeline."""
    rows = [t.summary() for t in timelines]
    return {"names": [interference_series(t)["name"] for t in timelines],
            "itl_max_ms": [1e3 * s["itl_max_s"] for s in rows], "itl_p99_ms": [1e3 * s["itl_p99_s"] for s in rows],
            "itl_undisturbed_ms": [1e3 * s["itl_undisturbed_s"] for s in rows],
            "prefill_wall_ms": [1e3 * s["prefill_wall_s"] for s in rows],
            "prefill_compute_ms": [1e3 * s["prefill_compute_s"] for s in rows]}


def interference_rows(timelines: list) -> list[dict]:
    """One table row per `interference.Timeline`: the streams' gaps and the prompt's prefill, in ms."""
    rows = []
    for t in timelines:
        s = t.summary()
        rows.append({"run": interference_series(t)["name"], "device": s["device_name"],
                     "undisturbed gap (ms)": f"{1e3 * s['itl_undisturbed_s']:,.0f}",
                     "p99 gap (ms)": f"{1e3 * s['itl_p99_s']:,.0f}", "worst gap (ms)": f"{1e3 * s['itl_max_s']:,.0f}",
                     "prefill, arrival to last chunk (ms)": f"{1e3 * s['prefill_wall_s']:,.0f}",
                     "chunks alone (ms)": f"{1e3 * s['prefill_compute_s']:,.0f}"})
    return rows


def chunk_view(run, unchunked, chunk_tokens: int) -> dict:
    """Lesson 06's chunk slider in one call: run the chunked timeline (`run(chunk_tokens=C)`, an
    `interference.run_timeline` with its sizes bound) and return it with everything the charts,
    the table and the status line show beside the fixed `unchunked` timeline."""
    timeline = run(chunk_tokens=chunk_tokens)
    summary = timeline.summary()
    return {"timeline": timeline, "series": interference_series(timeline),
            "bars": interference_bars([unchunked, timeline]), "rows": interference_rows([unchunked, timeline]),
            "status": (f"measured on {summary['device_name']}: worst gap {summary['itl_max_s'] * 1e3:,.0f} ms, "
                       f"prefill {summary['prefill_wall_s'] * 1e3:,.0f} ms" + _host_bound_chunks(summary)
                       + _unconfirmed(summary)
                       + (f"; {busy_phrase(summary['others_busy_share'])}" if summary.get("disturbed") else ""))}


def _unconfirmed(summary: dict) -> str:
    """"; not confirmed: ..." where no two of a timeline's runs agreed on its prefill, else ""."""
    if summary["confirmed"] or summary["runs"] < 2:
        return ""
    return (f"; not confirmed: the fastest of {summary['runs']} runs is shown, and no other prefill came within "
            f"{100 * CONFIRM_TOLERANCE:.0f}% of it")


def _host_bound_chunks(summary: dict) -> str:
    """"; host-bound: 3 of 8 chunks ..." where a GPU's chunks waited for their launches, else ""."""
    n = summary.get("chunks_host_bound")
    if not n:
        return ""
    return (f"; host-bound: {n} of {summary['chunks']} chunks waited for Python to launch their work, so their "
            "time measures the host, not the GPU")


# ---- lesson 07: where a request's time goes, by workload shape
def scaled_shapes(scale: int = 1) -> list[dict]:
    """The chapter's shapes with the prompt and the answer's decode steps divided by `scale`, in
    the chapter's order. What a shape's balance rests on is its decode steps per prompt token (the
    first answer token comes from prefill, each later one costs a step), so the steps are what is
    divided, rounded to whole steps and at least one: classification's 20-token answer (19 steps)
    becomes 3 tokens (2 steps) at a scale of 8, where dividing the tokens made it 2 (1 step), and
    left it less than half its decode work per prompt token."""
    return [{"name": w.name, "title": w.title, "steps": w.steps,
             "prompt_tokens": max(1, round(w.prompt_tokens / scale)),
             "output_tokens": 1 + max(1, round((w.output_tokens - 1) / scale))} for w in workloads.WORKLOADS.values()]


def scaled_balance(scale: int) -> dict[str, float]:
    """Each scaled shape's decode steps per prompt token over the full-size shape's (1 = kept):
    what rounding to whole steps leaves of the balance `scaled_shapes` keeps."""
    full = {w.name: (w.output_tokens - 1) / w.prompt_tokens for w in workloads.WORKLOADS.values()}
    return {s["name"]: (s["output_tokens"] - 1) / s["prompt_tokens"] / full[s["name"]] for s in scaled_shapes(scale)}


def split_dtype(hardware: HardwareSpec) -> str:
    """The dtype `predicted_split` computes in on `hardware`: bf16, or fp16 on a GPU without a bf16
    path (the T4), as the lab itself computes there (`backend`)."""
    try:
        hardware.peak_flops_per_s("bf16")
        return "bf16"
    except SpecError:
        return "fp16"


def predicted_split(model: ModelSpec, hardware: HardwareSpec, batch: int) -> dict:
    """`workloads.request_time_split` for every shape on `hardware` at `batch`: shares (%) and
    per-request times, as bar-chart lists."""
    dtype = split_dtype(hardware)
    rows = workloads.time_split_table(model, hardware, batch, dtype=dtype)
    names = [workloads.get_workload(row["workload"]).title for row in rows]
    fits = [row["fits_in_memory"] for row in rows]
    too_big = [name for name, fit in zip(names, fits) if not fit]
    return {"titles": [name if fit else f"{name} (does not fit)" for name, fit in zip(names, fits)],
            "names": names, "noisy": [not fit for fit in fits],  # drawn pale, like an untrustworthy bar
            "prefill_pct": [100 * row["prefill_share"] for row in rows],
            "decode_pct": [100 * row["decode_share"] for row in rows],
            "prefill_s": [row["prefill_s"] for row in rows], "decode_s": [row["decode_s"] for row in rows],
            "chapter": [row["chapter_split"] for row in rows], "fits": fits,
            "label": f"{model.name} on {hardware.name} (roofline, chapter counting, {r.CHAPTER_MFU:.0%} MFU, "
                     f"{r.CHAPTER_BANDWIDTH_EFFICIENCY:.0%} of bandwidth"
                     + ("" if dtype == "bf16" else f", in {dtype}: the {hardware.name} has no bf16 path")
                     + f"), batch {batch}",
            "note": _split_note(model, hardware, batch, dtype, too_big)}


def _split_note(model: ModelSpec, hardware: HardwareSpec, batch: int, dtype: str, too_big: list[str]) -> str:
    """Why some bars are pale: the shapes that do not fit at this batch, or, where the weights alone
    are more than the GPU holds (the 8B on a T4), that no batch fits; "" when all fit."""
    if not too_big:
        return ""
    memory = f"the {hardware.name}'s {hardware.memory_bytes / 1e9:,.0f} GB"
    weights = r.weight_bytes(model, dtype)
    if weights > hardware.memory_bytes:
        return (f"{model.name}'s weights alone, {weights / 1e9:,.1f} GB in {dtype}, are more than {memory}: "
                "every bar is drawn pale, a prediction for a model that cannot run there")
    one = len(too_big) == 1
    return (f"at batch {batch}, {', '.join(too_big)} {'needs' if one else 'need'} more than {memory} (weights, "
            f"every request's cache and the prefill's activations): {'its' if one else 'their'} bars, drawn pale, "
            "show a batch that cannot run")


def measured_split(results: list[dict], titles: list[str]) -> dict:
    """`serving.serve_shapes` results (one per shape) as the same bar-chart lists, plus
    which shapes were too noisy to trust (their title says so; the chart pales their bars)."""
    first = results[0]
    noisy = [bool(x.get("noisy")) for x in results]
    return {"titles": [f"{t} (noisy)" if n else t for t, n in zip(titles, noisy)], "names": list(titles),
            "noisy": noisy,
            "prefill_pct": [100 * x["prefill_share"] for x in results],
            # where each share may lie, fastest to second-fastest call of each phase (serving.share_range)
            "prefill_pct_range": [tuple(100 * v for v in x["prefill_share_range"]) if "prefill_share_range" in x
                                  else None for x in results],
            "decode_pct": [100 * x["decode_share"] for x in results],
            "prefill_s": [x["prefill_s"] for x in results], "decode_s": [x["decode_s"] for x in results],
            "shapes": [f"{x['prompt_tokens']:,} / {x['output_tokens']:,}" for x in results],
            "label": f"{first['model']} measured on {machine_of(first)}, batch {first['batch']}"}


def split_extremes(split: dict) -> dict:
    """The shapes that lean furthest towards decode and towards prefill (lowest and highest
    prefill share), among the ranked shapes; None where none is ranked, the ranked shapes' names
    from most decode-heavy to most prefill-heavy, and the names left out. A shape is ranked unless
    it is flagged noisy and its share's range (`prefill_pct_range`, from the fastest to the second
    fastest call of each phase) meets another shape's range: an unconfirmed chat whose whole range
    lies far below every other shape's still leans furthest towards decode."""
    names = split.get("names", split["titles"])
    noisy = split.get("noisy", [False] * len(names))
    # Without its range a noisy shape could lie anywhere, a confirmed one where it was measured.
    ranges = [given or ((0.0, 100.0) if flag else (pct, pct)) for pct, flag, given in
              zip(split["prefill_pct"], noisy, split.get("prefill_pct_range", [None] * len(names)))]

    def placed(i: int) -> bool:  # its place in the order holds anywhere in its range
        (low, high) = ranges[i]
        return all(high < other_low or other_high < low for j, (other_low, other_high) in enumerate(ranges) if j != i)

    shapes = [(pct, name, flag and not placed(i))
              for i, (pct, name, flag) in enumerate(zip(split["prefill_pct"], names, noisy))]
    rows = sorted((pct, name) for pct, name, left_out in shapes if not left_out)
    noisy_names = [name for _, name, left_out in shapes if left_out]
    return {"decode_heaviest": rows[0][1] if rows else None, "prefill_heaviest": rows[-1][1] if rows else None,
            "order": [name for _, name in rows], "left_out": len(noisy_names), "left_out_names": noisy_names}


def served_lines(measured: dict, results: list[dict]) -> str:
    """Lesson 07's served shapes as printed lines: each one's prefill and decode time, its decode
    steps and runs, then `split_extremes_line`."""
    lines = []
    for name, result in zip(measured["names"], results):
        steps = result["output_tokens"] - 1
        lines.append(f"{name:>28}: prefill {result['prefill_s'] * 1e3:8,.1f} ms, decode {result['decode_s'] * 1e3:8,.1f} ms "
                     f"({steps} step{'s' * (steps != 1)}, fastest of {result['runs']} runs"
                     f"{', noisy' if result['noisy'] else ''})")
    return "\n".join(lines + [split_extremes_line(measured)])


def split_extremes_line(split: dict) -> str:
    """`split_extremes` as the sentence a lesson prints."""
    ends = split_extremes(split)
    noisy = f" ({ends['left_out']} noisy shape(s) left out)" if ends["left_out"] else ""
    if len(ends["order"]) < 2:
        return f"Too few trustworthy shapes to compare{noisy}: run the cell again when the machine is quieter."
    pct = dict(zip(split.get("names", split["titles"]), split["prefill_pct"]))
    return (f"Furthest towards decode: {ends['decode_heaviest']} ({pct[ends['decode_heaviest']]:.0f}% prefill). "
            f"Furthest towards prefill: {ends['prefill_heaviest']} ({pct[ends['prefill_heaviest']]:.0f}% prefill){noisy}.")


def lever_rows() -> list[dict]:
    """Each shape's levers and the lab's advice (from `workloads`), for a table."""
    return [{"workload": w.title, "prompt / output": f"{w.prompt_tokens:,} / {w.output_tokens:,}"
             + (f" × {w.steps} steps" if w.steps > 1 else ""), "levers": ", ".join(w.levers), "why": w.helps}
            for w in workloads.WORKLOADS.values()]
