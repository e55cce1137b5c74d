"""Predict, then measure: each lesson's key measurement as a question the learner answers first.

A learner commits an estimate (a number with its unit, or a choice) in `views.Predict`; only then
does the lab compute the formula's answer and measure this machine, and the reveal shows all three
side by side with one line on the gap. Each `reveal_*` function below is that one labkit call: it
takes the estimate, predicts with `roofline` on this machine's calibrated roof, measures with the
lab's own timing (the confirmed fastest call on a CPU), and returns `explore.reveal`'s dict.

`DEFAULTS` holds a recorded estimate per question: a run without a person at the keyboard (nbval,
papermill, `make report`; `LABKIT_AUTO_REVEAL=1`) commits it, so every reveal still executes.
"""
from __future__ import annotations

from . import attention, backend, batching, calibrate, explore, roofline, sizes, sweeps, workloads
from .errors import LabError
from .specs import get_gpu, get_model

# What a learner without a keyboard "guessed": the naive answers the lessons set out to correct.
DEFAULTS = {"decode_batch": 16.0, "prefill_growth": 8.0, "flash_speedup": 1.0, "context_slowdown": 1.0,
            "static_utilisation": 90.0, "stall": 100.0, "decode_heaviest": "Inline code completion"}


def _lab(device: str | None):
    """(model spec, device, compute dtype, cache dtype, this machine's calibrated roof)."""
    kind = backend.choose_device(device).device
    settings = sizes.lab_settings(kind)
    roof, _ = calibrate.load_or_calibrate(kind)
    return get_model(settings["model"]), kind, settings["dtype"], settings["cache_dtype"], roof


def _busy_share(*points: dict) -> float | None:
    """The largest share of the cores other programs kept busy while one of `points` was timed,
    among those it disturbed (`timing.Timing.disturbed`); None where none was: a reveal's measured
    ratio is then partly the other programs'."""
    shares = [p["others_busy_share"] for p in points if p.get("disturbed")]
    return max(shares) if shares else None


def _closeness(formula: float, top: dict, bottom: dict, top_name: str, bottom_name: str) -> str:
    """`explore.efficiency_sentence` for a reveal's two measured points (top ÷ bottom)."""
    return explore.efficiency_sentence(formula, top.get("roof_fraction"), bottom.get("roof_fraction"),
                                       top_name, bottom_name)


def reveal_decode_batch(estimate: float, batch: int = 16, device: str | None = None, measure=None) -> dict:
    """Lesson 01: how many times longer a decode step at `batch` takes than at batch 1.
    `measure(batch=B)`: a decode point at the lab's context and cache dtype (default
    `sweeps.bind_decode`); lesson 01 passes its slider's `shared_run.SharedPoints` reader, so
    the answer and the chart show the same steps."""
    model, kind, dtype, cache_dtype, roof = _lab(device)
    context = sizes.lab_settings(kind)["context"][3]
    step = lambda b: roofline.predicted_decode_step_s(model, b, context, roof, dtype, cache_dtype, roofline.KERNEL)
    measure = measure or sweeps.bind_decode(model, context_tokens=context, cache_dtype=cache_dtype, device=kind)
    many, one = (measure(batch=b) for b in (batch, 1))  # the longer first, as a slider's `prime` times them
    formula = step(batch) / step(1)
    return explore.reveal(f"decode step at batch {batch} ÷ batch 1 ({context:,} tokens each)", "×", estimate,
                          formula, many["time_s"] / one["time_s"], one["device_name"],
                          "one read of the weights serves the whole batch; only the cache and the arithmetic grow",
                          then=_closeness(formula, many, one, f"batch-{batch} one", "batch-1 step"),
                          busy_share=_busy_share(many, one))


def reveal_prefill_growth(estimate: float, low: int = 512, high: int = 4096, device: str | None = None,
                          measure=None) -> dict:
    """Lesson 02: how many times longer a prefill of `high` tokens takes than one of `low`.
    `measure(prompt_tokens=P)`: a batch-1 prefill point (default `sweeps.bind_prefill`); lesson
    02 passes its slider's `shared_run.SharedPoints` reader, as lesson 01 does."""
    model, kind, dtype, _, roof = _lab(device)
    time = lambda p: roofline.predicted_prefill_time_s(model, p, roof, 1, dtype, roofline.KERNEL)
    measure = measure or sweeps.bind_prefill(model, device=kind)
    long, short = (measure(prompt_tokens=p) for p in (high, low))  # the longer first, as `prime`
    formula = time(high) / time(low)
    return explore.reveal(f"prefill of {high:,} tokens ÷ {low:,} tokens ({high / low:.0f}× the tokens)", "×",
                          estimate, formula, long["time_s"] / short["time_s"], short["device_name"],
                          "the attention term grows with the square of the prompt",
                          then=_closeness(formula, long, short, f"{high:,}-token one", f"{low:,}-token prefill"),
                          busy_share=_busy_share(long, short))


def reveal_flash_speedup(estimate: float, tokens: int, heads: int, kv_heads: int, head_dim: int,
                         device: str | None = None) -> dict:
    """Lesson 03: how many times faster the fused (flash) attention call is than plain attention
    at P = `tokens`: the roofline's times against both calls timed here. Same FLOPs; plain
    attention's three kernels in turn (`roofline.naive_attention_work`: the products at their roof,
    the softmax's passes at the bandwidth of the tier the scores and probabilities lie in), the fused kernel
    as one call at its roof."""
    kind = backend.choose_device(device)
    roof, _ = calibrate.load_or_calibrate(kind.device)
    dtype = kind.compute_dtype
    flops = roofline.attention_flops(1, heads, head_dim, tokens)
    work = roofline.naive_attention_work(1, heads, tokens, tokens, head_dim, dtype, kv_heads, "fp32")
    square = roofline.roof_at_working_set(roof, work["softmax"]["bytes"])  # the scores and the probabilities
    flash_bytes = roofline.flash_attention_bytes(1, heads, tokens, tokens, head_dim, dtype, kv_heads)
    predicted = (roofline.in_turn_time_s(work, square, dtype)
                 / roofline.roofline_time_s(flops, flash_bytes, roof, dtype))
    naive, flash = (attention.time_point(m, tokens, heads, kv_heads, head_dim, dtype, kind.device)
                    for m in ("naive", "flash"))
    why = ("both do the same FLOPs; plain attention runs them as three kernels in turn and, between its two "
           "products, writes the P × P scores, reads them for the softmax, writes the probabilities and reads them "
           "back: traffic the fused kernel never makes")
    return explore.reveal(f"plain attention's time ÷ the fused kernel's at P = {tokens:,} ({heads} heads)", "×",
                          estimate, predicted, naive["time_s"] / flash["time_s"], naive["device_name"],
                          why, busy_share=_busy_share(naive, flash))


def reveal_context_slowdown(estimate: float, device: str | None = None, sweep=None) -> dict:
    """Lesson 04: how many times longer a batch-1 decode step takes at the longest context than at
    none. `sweep()`: batch-1 decode points over contexts from 0 to the longest (default
    `sweeps.decode_sweep` over those two, in two rounds); lesson 04 passes its context sweep's
    `shared_run.SharedRun` reader, so the answer and the chart under it show the same steps."""
    model, kind, dtype, cache_dtype, roof = _lab(device)
    step = lambda s: roofline.predicted_decode_step_s(model, 1, s, roof, dtype, cache_dtype, roofline.KERNEL)
    sweep = sweep or (lambda: sweeps.decode_sweep(model, [1], [0, sizes.lab_settings(kind)["context"][1]],
                                                  [cache_dtype], kind, rounds=2))
    points = sorted(sweep(), key=lambda p: p["context_tokens"])
    empty, full = points[0], points[-1]
    shortest = f"{empty['context_tokens']:,} tokens" if empty["context_tokens"] else "none"
    formula = step(full["context_tokens"]) / step(empty["context_tokens"])
    return explore.reveal(f"decode step at {full['context_tokens']:,} tokens of context ÷ at {shortest} (batch 1)",
                          "×", estimate, formula, full["time_s"] / empty["time_s"], empty["device_name"],
                          "every step reads the whole cache: its share of the read grows with the context",
                          then=_closeness(formula, full, empty, f"one at {full['context_tokens']:,} tokens",
                                          f"step at {shortest}" if empty["context_tokens"] else "step with no context"),
                          busy_share=_busy_share(empty, full))


def reveal_static_utilisation(estimate: float, requests, max_batch: int, step_time_s, label: str) -> dict:
    """Lesson 05: the share of a static batch's slot-steps that emit a token, on `requests`
    (rows of arrival, prompt, output): the mean/max estimate against a simulation on measured steps."""
    outputs = [row[2] for row in requests]
    simulated = batching.compare(requests, max_batch, step_time_s)["static"]["slot_utilisation"]
    return explore.reveal(f"static batching's slot utilisation at max batch {max_batch}", "%", estimate,
                          100 * batching.static_utilisation_estimate(outputs), 100 * simulated, label,
                          "a static batch holds every slot until its longest request finishes",
                          formula_label="the chapter's formula: mean output ÷ longest output",
                          measured_label=f"simulated on step times measured on {label}", measured_noun="simulation")


def reveal_stall(estimate: float, run, device: str | None = None) -> dict:
    """Lesson 06: the streams' worst gap between tokens while one long prompt is prefilled in one
    pass (`run()`: `interference.run_timeline` with its sizes bound, unchunked), against the
    roofline's time for that prefill."""
    model, kind, dtype, _, roof = _lab(device)
    timeline = run()
    summary = timeline.summary()
    predicted = roofline.predicted_prefill_time_s(model, timeline.prompt_tokens, roof, 1, dtype, roofline.KERNEL)
    return explore.reveal(f"worst gap between stream tokens while {timeline.prompt_tokens:,} prompt tokens are "
                          "prefilled in one pass", "ms", estimate, 1e3 * predicted,
                          1e3 * summary["itl_max_s"], timeline.device_name,
                          "every stream waits for the whole prefill before its next token",
                          busy_share=_busy_share(summary))


def reveal_decode_heaviest(estimate: str, serve, titles: list[str], gpu: str = "H100-SXM") -> dict:
    """Lesson 07: which shape spends the largest share of its time in decode — on a GPU preset by
    the formula, and measured here (`serve()`: the shapes' `serving.serve_shapes` results; lesson 07
    passes its `serving.SharedServing`, so the answer and the chart show the same runs)."""
    predicted = explore.predicted_split(get_model("llama-3.1-8b"), get_gpu(gpu), workloads.CHAPTER_BATCH)
    results = serve()
    measured = explore.split_extremes(explore.measured_split(results, titles))
    shown = explore.reveal("the shape that leans furthest towards decode", None, estimate,
                           explore.split_extremes(predicted)["decode_heaviest"],
                           measured["decode_heaviest"], results[0]["device_name"],
                           "the longest answer for the length of its prompt", formula_label=f"the formula on the {gpu}")
    if measured["left_out_names"]:  # a shape whose timing was never confirmed is not ranked: say so
        shown["gap"] += (f" Not ranked, as this machine's timings of them were never confirmed (too busy): "
                         f"{', '.join(measured['left_out_names'])}; run the cell again when it is quieter.")
    return shown


def ask(name: str, **bound) -> dict:
    """Everything `views.Predict` needs for question `name`, with `bound` arguments (device,
    sizes, measured data) passed to its reveal: the question, unit or options, the recorded
    default estimate, and the reveal itself. `views.Predict(**predict.ask(...))`."""
    if name not in _ASK:
        raise LabError(f"unknown prediction {name!r}; known: {', '.join(_ASK)}")
    question, unit, reveal = _ASK[name]
    options = [w.title for w in workloads.WORKLOADS.values()] if unit is None else None
    return {"question": question(**bound), "unit": unit, "options": options, "default": DEFAULTS[name],
            "reveal": lambda estimate: reveal(estimate, **bound), "name": name}


def _context(device=None, **_):
    return sizes.lab_settings(backend.choose_device(device).device)["context"]


_ASK = {
    "decode_batch": (lambda batch=16, device=None, measure=None: f"How many times longer does one decode step take at batch "
                     f"{batch} than at batch 1 on this machine, with {_context(device)[3]:,} tokens of context each?",
                     "×", reveal_decode_batch),
    "prefill_growth": (lambda low=512, high=4096, device=None, measure=None: f"A prompt of {high:,} tokens has {high / low:.0f} "
                       f"times the tokens of one of {low:,}. How many times longer does its prefill take on this machine?",
                       "×", reveal_prefill_growth),
    "flash_speedup": (lambda tokens, heads, kv_heads, head_dim, device=None: f"At P = {tokens:,} tokens ({heads} heads), "
                      "how many times faster is the fused attention call than plain attention on this machine?",
                      "×", reveal_flash_speedup),
    "context_slowdown": (lambda device=None, sweep=None: f"At batch 1, how many times longer does a decode step take with "
                         f"{_context(device)[1]:,} tokens of context than with none?", "×", reveal_context_slowdown),
    "static_utilisation": (lambda requests, max_batch, step_time_s, label: "On the chapter's request mix at max batch "
                           f"{max_batch}, what share of a static batch's slot-steps emit a token?", "%",
                           reveal_static_utilisation),
    "stall": (lambda run, device=None: "A long prompt arrives while other users stream. Prefilled in one pass, how "
              "long is the streams' worst gap between tokens on this machine?", "ms", reveal_stall),
    "decode_heaviest": (lambda serve, titles, gpu="H100-SXM": "Which of the six shapes spends the largest share "
                        "of its time in decode?", None, reveal_decode_heaviest),
}

