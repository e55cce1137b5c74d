"""Check yourself: the chapter's questions as numbers a learner computes, checked by labkit.

    print(quiz.check_ridge(295))        # "right: …" or what to reconsider
    print(quiz.show_answer("ridge"))    # labkit's own arithmetic

Every expected value is computed here from `roofline`, `specs`, `workloads` and `batching`
(never typed in), with a relative tolerance wide enough for the chapter's rounding and for
"about". A check never raises: None means "not answered yet", a wrong type or a non-finite
number gets one line saying what was expected.
"""
from __future__ import annotations

import math
import numbers
from dataclasses import dataclass
from typing import Callable

from . import batching
from . import roofline as r
from . import workloads
from .specs import get_gpu, get_model

MODEL, GPU = "llama-3.1-8b", "H100-SXM"
# The questions' inputs, named so the notebook and labkit.claims quote the same figures.
PROMPT = 2000  # tokens, for the intensity question
SHORT, LONG = 2048, 32768  # tokens, for the "sixteen times longer" question
SCORES_TOKENS = 120_000  # tokens, for the score-matrix question
STALL_PROMPT = 50_000  # tokens, the pasted document
CONTEXT, BATCH = 8192, 64  # the loaded decode step
LOGITS_PROMPT = 8192  # tokens, logits for every position
BATCH_OUTPUTS = (5, 20, 150, 300, 2000)  # output lengths of one static batch


@dataclass(frozen=True)
class Question:
    """One exercise: what to compute (`ask`), its unit, labkit's value and working, the relative
    tolerance, and what to reconsider when an answer is off."""

    ask: str
    unit: str
    expected: Callable[[], float]
    working: Callable[[], str]
    rel_tol: float
    hint: str
    # Other defensible countings: {how it was counted: its value}. `accepts_others`: the question
    # allows them (a right answer); else an answer matching one was "counted differently".
    others: Callable[[], dict[str, float]] = lambda: {}
    accepts_others: bool = False


def _setting():
    return get_model(MODEL), get_gpu(GPU)


def _ridge():
    return r.ridge_point_flops_per_byte(_setting()[1])


def _intensity_gap():
    m, _ = _setting()
    return r.prefill_intensity_flops_per_byte(m, PROMPT) / r.decode_intensity_flops_per_byte(m, 1, 0)


def _crossover():
    return r.crossover_tokens(_setting()[0])


def _prefill_s(tokens, counting: r.Counting = r.CHAPTER):
    m, h = _setting()
    return r.compute_time_s(r.prefill_flops(m, tokens, 1, counting), h, "bf16", r.CHAPTER_MFU)


KERNEL_COUNTING = "counting what the kernels execute (the causal half of attention, matmul weights only)"
CHAPTER_COUNTING = "counting as the chapter does (the full P × P square, all N parameters)"


def _kv_kib():
    return r.kv_bytes_per_token(_setting()[0]) / 2**10


def _slowdown():
    m, _ = _setting()
    return r.decode_bytes_per_step(m, BATCH, CONTEXT) / r.weight_bytes(m)


def _chat_decode_pct():
    m, h = _setting()
    return 100 * workloads.request_time_split(m, h, "chat", workloads.CHAPTER_BATCH)["decode_share"]


def _explain(*lines):
    return lambda: "\n".join(line() if callable(line) else line for line in lines)


QUESTIONS: dict[str, Question] = {
    "ridge": Question(
        "the H100 SXM's ridge point in bf16", "FLOP/byte", _ridge,
        _explain(lambda: f"peak / bandwidth = {_setting()[1].bf16_flops_per_s / 1e12:,.1f}e12 FLOP/s / "
                         f"{_setting()[1].memory_bandwidth_bytes_per_s / 1e12:.2f}e12 B/s = {_ridge():,.0f} FLOP/byte"),
        0.05, "divide the dense bf16 peak (FLOP/s) by the memory bandwidth (bytes/s); both in the same SI prefix"),
    "intensity_gap": Question(
        "prefill's intensity at the 2,000-token prompt divided by decode's at batch 1", "x", _intensity_gap,
        _explain(lambda: f"prefill ≈ P = {PROMPT:,} FLOP/byte (labkit, with attention and the cache written: "
                         f"{r.prefill_intensity_flops_per_byte(_setting()[0], PROMPT):,.0f}); decode ≈ B = 1; "
                         f"ratio {_intensity_gap():,.0f}"),
        0.10, "one read of the weights serves every prompt token in prefill, but one token per sequence in decode"),
    "crossover": Question(
        f"the prompt length where attention's FLOPs equal the linear term's, Llama 3.1 8B, {CHAPTER_COUNTING}",
        "tokens", _crossover,
        _explain(lambda: f"2NP = 4LP²d  →  P = N / (2Ld) = {r.param_count(_setting()[0]):,} / "
                         f"(2 × {_setting()[0].n_layers} × {_setting()[0].hidden_size:,}) = {_crossover():,.0f} tokens"),
        0.03, "set 2NP equal to 4LP²d and solve for P; N counts all the parameters",
        lambda: {KERNEL_COUNTING: r.crossover_tokens(_setting()[0], r.KERNEL),
                 "counting the causal half of attention": r.crossover_tokens(_setting()[0], r.Counting("causal", "all"))}),
    "long_prompt_ratio": Question(
        f"how many times longer a 32,768-token prefill takes than a 2,048-token one, {CHAPTER_COUNTING}", "x",
        lambda: _prefill_s(LONG) / _prefill_s(SHORT),
        _explain(lambda: f"(2N·{LONG:,} + 4L·{LONG:,}²·d) / (2N·{SHORT:,} + 4L·{SHORT:,}²·d) = "
                         f"{_prefill_s(LONG) * 1e3:,.0f} ms / {_prefill_s(SHORT) * 1e3:,.0f} ms = "
                         f"{_prefill_s(LONG) / _prefill_s(SHORT):.1f}"),
        0.08, "the prompt is sixteen times longer, but the attention term grows with its square",
        lambda: {KERNEL_COUNTING: _prefill_s(LONG, r.KERNEL) / _prefill_s(SHORT, r.KERNEL)}),
    "score_matrix_gb": Question(
        "the size of one head's score matrix at 120,000 tokens in bf16", "GB",
        lambda: r.score_matrix_bytes(SCORES_TOKENS) / 1e9,
        _explain(lambda: f"{SCORES_TOKENS:,}² scores × 2 bytes = {r.score_matrix_bytes(SCORES_TOKENS) / 1e9:.1f} GB"),
        0.05, "the matrix is P × P scores, each two bytes in bf16; 1 GB = 1e9 bytes"),
    "stall_s": Question(
        "how long a 50,000-token prefill holds an H100 at 40% of dense peak", "s", lambda: _prefill_s(STALL_PROMPT),
        _explain(lambda: f"FLOPs = 2NP + 4LP²d = {r.prefill_flops(_setting()[0], STALL_PROMPT):.3g}; at "
                         f"{r.CHAPTER_MFU:.0%} of {_setting()[1].bf16_flops_per_s:.3g} FLOP/s: "
                         f"{_prefill_s(STALL_PROMPT):.2f} s {CHAPTER_COUNTING}; "
                         f"{_prefill_s(STALL_PROMPT, r.KERNEL):.1f} s {KERNEL_COUNTING}, as lesson 06 counts"),
        0.15, "count both terms, 2NP and 4LP²d (as the chapter counts, attention is the larger at 50,000 "
              "tokens); divide by 40% of the peak",
        lambda: {KERNEL_COUNTING: _prefill_s(STALL_PROMPT, r.KERNEL)}, accepts_others=True),
    "kv_kib_per_token": Question(
        "the size of the KV cache one token adds for Llama 3.1 8B in bf16", "KiB", _kv_kib,
        _explain(lambda: f"2 (K and V) × {_setting()[0].n_layers} layers × {_setting()[0].n_kv_heads} kv heads × "
                         f"{_setting()[0].head_dim} × 2 bytes = {r.kv_bytes_per_token(_setting()[0]):,} B = {_kv_kib():.0f} KiB"),
        0.02, "K and V, for every layer and every key/value head (not every query head); 1 KiB = 1,024 bytes"),
    "decode_slowdown": Question(
        "how many times longer a decode step at 8,192 tokens and batch 64 takes than reading the weights alone",
        "x", _slowdown,
        _explain(lambda: f"(weights {r.weight_bytes(_setting()[0]) / 1e9:.2f} GB + cache "
                         f"{r.kv_cache_bytes(_setting()[0], CONTEXT, BATCH) / 1e9:.1f} GB) / weights = {_slowdown():.1f}"),
        0.05, "every step reads all the weights once and every sequence's whole cache",
        lambda: {"counting only the weights a step streams (no embedding table), as lesson 04 also does":
                 r.decode_bytes_per_step(_setting()[0], BATCH, CONTEXT, params="matmul")
                 / r.weight_bytes(_setting()[0], params="matmul")}),
    "compute_bound_batch": Question(
        "the batch at which decode with 8-bit weights (bf16 arithmetic) reaches the ridge, short context",
        "sequences", lambda: r.decode_compute_bound_batch(_setting()[0], _setting()[1], weight_dtype="fp8"),
        _explain(lambda: f"intensity ≈ 2B FLOPs per weight / 1 byte = 2B; 2B = {_ridge():,.0f} → B ≈ "
                         f"{r.decode_compute_bound_batch(_setting()[0], _setting()[1], weight_dtype='fp8'):,.0f}"),
        0.10, "with one byte per weight, each sequence in the batch adds two FLOPs per byte read"),
    "logits_gib": Question(
        "the logits tensor (fp32) if an 8,192-token prefill scored every position", "GiB",
        lambda: r.logits_bytes(_setting()[0], LOGITS_PROMPT) / 2**30,
        _explain(lambda: f"{LOGITS_PROMPT:,} positions × {_setting()[0].vocab_size:,} scores × 4 bytes = "
                         f"{r.logits_bytes(_setting()[0], LOGITS_PROMPT) / 2**30:.1f} GiB"),
        0.05, "one score per vocabulary entry per position, four bytes each; 1 GiB = 2³⁰ bytes"),
    "chat_decode_pct": Question(
        "the share of a chat request's time (2,000 in, 300 out, alone on an H100) spent in decode", "%",
        _chat_decode_pct,
        _explain(lambda: "prefill ≈ (2NP + 4LP²d) / (40% peak); "
                         f"decode ≈ 299 steps × bytes per step / (75% bandwidth); "
                         f"decode share = {_chat_decode_pct():.1f}%"),
        0.04, "time prefill at 40% of peak FLOP/s and each decode step as one read of weights and cache"),
    "static_utilisation_pct": Question(
        "the slot utilisation of one static batch with the output lengths given", "%",
        lambda: 100 * batching.static_utilisation_estimate(BATCH_OUTPUTS),
        _explain(lambda: f"mean / max = {sum(BATCH_OUTPUTS) / len(BATCH_OUTPUTS):,.0f} / {max(BATCH_OUTPUTS):,} = "
                         f"{100 * batching.static_utilisation_estimate(BATCH_OUTPUTS):.1f}%"),
        0.05, "every slot is held until the longest request finishes; useful passes / held passes"),
}


def _num(value: float) -> str:
    """Four significant digits, and no exponent for a large number (53,247, not 5.325e+04) short of
    an absurd one: 1e300 typed as an answer is "1e+300", not its 301 digits."""
    if abs(value) >= 1e15:
        return f"{value:.4g}"
    return f"{value:,.0f}" if abs(value) >= 1000 else f"{value:,.4g}"


def check(name: str, answer) -> str:
    """One line of feedback on `answer` to question `name`; never raises."""
    question = QUESTIONS.get(name)
    if question is None:
        return f"unknown question {name!r}; known: {', '.join(QUESTIONS)}"
    if answer is None:
        return f"{name}: not answered yet — compute {question.ask} ({question.unit})."
    if isinstance(answer, bool) or not isinstance(answer, numbers.Real):
        return f"{name}: expected a number in {question.unit}, got {type(answer).__name__} {answer!r}."
    value = float(answer)
    if not math.isfinite(value):
        return f"{name}: expected a finite number in {question.unit}, got {value!r}."
    expected = float(question.expected())
    if abs(value - expected) <= question.rel_tol * abs(expected):
        return f"{name}: right — {_num(value)} {question.unit} (labkit computes {_num(expected)})."
    for how, other in question.others().items():
        if abs(value - other) <= question.rel_tol * abs(other):
            if question.accepts_others:
                return (f"{name}: right, {how} — {_num(value)} {question.unit} (labkit computes {_num(other)}; "
                        f"the chapter's count gives {_num(expected)}).")
            return (f"{name}: counted differently — {_num(value)} {question.unit} is the answer {how} (labkit: "
                    f"{_num(other)}). Not wrong, but this question asks for the chapter's count: {_num(expected)} "
                    f"{question.unit}.")
    if value == 0 or (value > 0) != (expected > 0):
        off = "has the wrong sign or is zero"
    else:
        ratio = value / expected
        off = f"is {ratio:,.3g} times too large" if ratio > 1 else f"is {1 / ratio:,.3g} times too small"
    return f"{name}: not yet — {_num(value)} {question.unit} {off}. Reconsider: {question.hint}."


def show_answer(name: str) -> str:
    """Labkit's working for question `name`, the arithmetic written out."""
    question = QUESTIONS.get(name)
    if question is None:
        return f"unknown question {name!r}; known: {', '.join(QUESTIONS)}"
    return f"{name} ({question.ask}):\n  {question.working()}"


# ---------------------------------------------------------------- questions of judgement: pick one
LONG_CONTEXT = 131_072  # tokens, one user's long conversation
CHUNKS = (32, 2048)  # tokens, the chunk sizes offered
@dataclass(frozen=True)
class Choice:
    """A conceptual question: the options, labkit's answer computed from the formulas (`answer`),
    why (`why`), and what each wrong option overlooks (`slips`)."""

    ask: str
    options: tuple[str, ...]
    answer: Callable[[], str]
    why: Callable[[], str]
    slips: dict = None


def _regime_at(batch: int, context: int) -> str:
    return r.decode_regime(r.cache_share(_setting()[0], batch, context))


def _smallest_compute_bound_chunk(chunks) -> int:
    """The smallest of `chunks` whose prefill pass is still above the ridge (compute-bound)."""
    return min(c for c in chunks if r.prefill_intensity_flops_per_byte(_setting()[0], c) >= _ridge())


def _bound_phase() -> str:
    m, h = _setting()
    return "prefill" if r.prefill_intensity_flops_per_byte(m, PROMPT) >= _ridge() else "decode"


CHOICES: dict[str, Choice] = {
    "regime_long_chat": Choice(
        f"One user, {LONG_CONTEXT:,} tokens of context on Llama 3.1 8B: which regime is decode in?",
        ("weights-dominated", "mixed", "cache-dominated"),
        lambda: _regime_at(1, LONG_CONTEXT),
        lambda: f"the cache is {100 * r.cache_share(_setting()[0], 1, LONG_CONTEXT):.0f}% of a step's read "
                f"(mixed from {100 * r.WEIGHTS_DOMINATED_BELOW:.0f}%, cache-dominated from {100 * r.CACHE_DOMINATED_FROM:.0f}%)",
        {"weights-dominated": "one user, but a long cache: 128 KiB for each of its tokens",
         "cache-dominated": "the weights are still almost half the read at batch one"}),
    "lever_loaded_batch": Choice(
        "64 users at 8,192 tokens each are streaming too slowly. Which lever helps most?",
        ("quantise the weights to 8 bits", "an fp8 KV cache", "a faster GPU with the same bandwidth"),
        lambda: "an fp8 KV cache" if r.cache_share(_setting()[0], BATCH, CONTEXT) > 0.5 else "quantise the weights to 8 bits",
        lambda: f"the cache is {100 * r.cache_share(_setting()[0], BATCH, CONTEXT):.0f}% of the read: halving it "
                f"saves far more than halving the weights",
        {"quantise the weights to 8 bits": "the weights are under a fifth of this step's read",
         "a faster GPU with the same bandwidth": "decode here waits on memory, not on arithmetic"}),
    "phase_prompt": Choice(
        "A 2,000-token prompt on an H100: is its prefill bound by arithmetic or by memory?",
        ("arithmetic (compute-bound)", "memory (bandwidth-bound)"),
        lambda: "arithmetic (compute-bound)" if _bound_phase() == "prefill" else "memory (bandwidth-bound)",
        lambda: f"its intensity, {r.prefill_intensity_flops_per_byte(_setting()[0], PROMPT):,.0f} FLOP/byte, is far "
                f"above the ridge of {_ridge():,.0f}",
        {"memory (bandwidth-bound)": "one read of the weights serves every one of the 2,000 prompt tokens"}),
    "chunk_size": Choice(
        "Streams decode while 50,000-token prompts arrive. Which chunk size keeps their gaps short "
        "without making the long prompt's prefill take far longer than it would in one pass?",
        ("no chunking", f"{CHUNKS[1]:,} tokens", f"{CHUNKS[0]:,} tokens"),
        lambda: f"{_smallest_compute_bound_chunk(CHUNKS):,} tokens",
        lambda: f"a chunk bounds the stall each decode step waits for; a 2,048-token chunk still does "
                f"{r.prefill_intensity_flops_per_byte(_setting()[0], 2048):,.0f} FLOP per byte, above the ridge "
                f"of {_ridge():,.0f}, while a 32-token chunk does {r.prefill_intensity_flops_per_byte(_setting()[0], 32):,.0f}"
                f" and turns the long prompt's prefill bandwidth-bound",
        {"no chunking": f"the whole prompt holds the GPU for {_prefill_s(STALL_PROMPT, r.KERNEL):.1f} s: every "
                        "stream stalls that long",
         "32 tokens": "each chunk re-reads all the weights for very few tokens: the long prompt's prefill "
                      "turns bandwidth-bound and takes far longer"}),
}


def show_choice_answer(name: str) -> str:
    """Labkit's pick for conceptual question `name`, and why."""
    choice = CHOICES.get(name)
    if choice is None:
        return f"unknown question {name!r}; known: {', '.join(CHOICES)}"
    return f"{name} ({choice.ask}):\n  {choice.answer()}: {choice.why()}"


def check_choice(name: str, answer) -> str:
    """One line of feedback on a pick for conceptual question `name`; never raises."""
    choice = CHOICES.get(name)
    if choice is None:
        return f"unknown question {name!r}; known: {', '.join(CHOICES)}"
    if answer is None:
        return f"{name}: not answered yet — pick one of: {'; '.join(choice.options)}."
    # a pick typed by hand: "Mixed" or " mixed " is the option "mixed" (it was "not one of the options")
    typed = " ".join(answer.split()).lower() if isinstance(answer, str) else None
    answer = next((option for option in choice.options if option.lower() == typed), answer)
    if answer not in choice.options:
        return f"{name}: {answer!r} is not one of the options: {'; '.join(choice.options)}."
    if answer == choice.answer():
        return f"{name}: right — {answer}: {choice.why()}."
    slip = (choice.slips or {}).get(answer, "look again at which part of the work grows")
    return f"{name}: not this one — {answer}: {slip}. Reconsider."


# ---------------------------------------------------------------- one check function per question
def check_ridge(answer) -> str:
    """Feedback on question "ridge"."""
    return check("ridge", answer)


def check_intensity_gap(answer) -> str:
    """Feedback on question "intensity_gap"."""
    return check("intensity_gap", answer)


def check_crossover(answer) -> str:
    """Feedback on question "crossover"."""
    return check("crossover", answer)


def check_long_prompt_ratio(answer) -> str:
    """Feedback on question "long_prompt_ratio"."""
    return check("long_prompt_ratio", answer)


def check_score_matrix_gb(answer) -> str:
    """Feedback on question "score_matrix_gb"."""
    return check("score_matrix_gb", answer)


def check_stall_s(answer) -> str:
    """Feedback on question "stall_s"."""
    return check("stall_s", answer)


def check_kv_kib_per_token(answer) -> str:
    """Feedback on question "kv_kib_per_token"."""
    return check("kv_kib_per_token", answer)


def check_decode_slowdown(answer) -> str:
    """Feedback on question "decode_slowdown"."""
    return check("decode_slowdown", answer)


def check_compute_bound_batch(answer) -> str:
    """Feedback on question "compute_bound_batch"."""
    return check("compute_bound_batch", answer)


def check_logits_gib(answer) -> str:
    """Feedback on question "logits_gib"."""
    return check("logits_gib", answer)


def check_chat_decode_pct(answer) -> str:
    """Feedback on question "chat_decode_pct"."""
    return check("chat_decode_pct", answer)


def check_static_utilisation_pct(answer) -> str:
    """Feedback on question "static_utilisation_pct"."""
    return check("static_utilisation_pct", answer)
