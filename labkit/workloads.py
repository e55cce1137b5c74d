"""Workload shapes: where a request's time goes, prefill or decode, and which levers move it.

The question a lesson asks: *for this traffic, which phase owns the time?* The answer is not a
property of the model — it is the prompt/output shape of the requests. The chapter's table gives
six shapes; `request_time_split` puts each through labkit's roofline.

How a request is timed (the lab's convention, shared with `labkit.batching`):

    prefill  one pass over the P prompt tokens; its last position yields the first output token
    decode   n - 1 further passes for an answer of n tokens; pass j (j = 1 … n-1) attends over
             S = P + j cached keys, so the cache read grows by one token per pass
    batch    B identical requests served together in lock-step: one prefill pass for all B
             prompts, then decode passes at batch B. Every pass serves the B requests equally,
             so the time shares are also each request's share of the GPU's time.

    prefill_s = roofline.predicted_prefill_time_s(P, batch=B)            (compute-bound: FLOPs / (mfu · peak))
    decode_s  = Σ_{j=1}^{n-1} roofline.predicted_decode_step_s(B, P + j) (bandwidth-bound: bytes / (eff · bw))
    ttft_s    = prefill_s (no queueing, no front end);  itl_s = decode_s / (n - 1)

The chapter does not say at which batch its shares hold, and no single batch reproduces them
all. `CHAPTER_BATCH = 1` (one request alone on the GPU) reproduces chat's "decode 95%" (95.7 %)
and code completion's "mixed" (41 % prefill); `PUSHED_BATCH = 64` is the lab's reading of "push
the batch hard", under which classification's "prefill 75%+" holds (93.5 %; 75 % from batch 10).
At batch 1 the roofline gives RAG 23 % prefill (chapter ~40 %), classification 25 %, agent 23 %
and summarisation 49 % — pinned as such in tests/test_workloads.py rather than bent;
`batch_for_prefill_share` finds the batch where a claimed share first holds.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from . import roofline as r
from .errors import SpecError, whole_number
from .roofline import CHAPTER, CHAPTER_BANDWIDTH_EFFICIENCY, CHAPTER_MFU, Counting
from .specs import HardwareSpec, ModelSpec

_TABLE = "chapter 05 'The machine and the two phases', table of workload shapes"
_LAB = "this lab's choice (labkit/workloads.py)"

CHAPTER_BATCH = 1  # one request alone on the GPU: reproduces chat's "decode 95%"
PUSHED_BATCH = 64  # "push the batch hard" (classification); any batch >= 10 gives prefill 75%+
AGENT_STEPS = 10  # the chapter says "many steps"; 10 model calls per agent task is our choice

# The chapter's fix lists for each phase (its two-phase table, "Fixed by").
PREFILL_LEVERS = ("prefix caching", "chunked prefill", "shorter prompts", "more FLOP/s")
DECODE_LEVERS = ("more bandwidth", "smaller KV cache", "bigger batch", "quantised weights",
                 "speculative decoding")


@dataclass(frozen=True)
class Workload:
    """One traffic shape: P prompt tokens and n output tokens per model call, `steps` calls per
    task (an agent loop resends its context every step). `chapter_split` is where the chapter
    says the time goes; `helps` is our summary of its advice; `sources` covers every number."""

    name: str
    title: str
    prompt_tokens: int
    output_tokens: int
    steps: int
    chapter_split: str
    helps: str
    levers: tuple[str, ...]
    sources: dict = field(default_factory=dict, compare=False, hash=False)

    def __post_init__(self):
        for name in ("prompt_tokens", "output_tokens", "steps"):
            whole_number(f"workload {self.name!r}: {name}", getattr(self, name), error=SpecError)


def _shape(name, title, prompt, output, split, helps, levers, steps=1, steps_source=_TABLE):
    sources = {"prompt_tokens": _TABLE, "output_tokens": _TABLE, "chapter_split": _TABLE,
               "steps": steps_source if steps > 1 else "one model call per request"}
    return Workload(name, title, prompt, output, steps, split, helps, levers, sources)


WORKLOADS: dict[str, Workload] = {w.name: w for w in (
    _shape("chat", "Chat", 2000, 300, "decode 95%",
           "Streaming the answer is the cost, so spend on decode: memory bandwidth, a lighter KV "
           "cache, more users per step; speculation pays off when few users share the GPU. A "
           "reused prefix shortens the first-token wait but hardly changes the total.",
           ("more bandwidth", "smaller KV cache", "bigger batch", "speculative decoding")),
    _shape("rag", "RAG question answering", 8000, 200, "prefill ~40%",
           "Both phases count. Long, bursty prompts make chunked prefill a must; the retrieved "
           "text changes with every question, so a prefix cache finds little to reuse.",
           ("chunked prefill", "more FLOP/s", "more bandwidth", "bigger batch")),
    _shape("classification", "Classification / extraction", 1000, 20, "prefill 75%+",
           "Batch as deep as memory allows, since no one reads the output as it streams: batched, "
           "the prompt is the work (alone, the few decode steps still take most of the time), so "
           "buy FLOP/s, not bandwidth. Speculating on 20 tokens buys nothing.",
           ("more FLOP/s", "bigger batch")),
    _shape("agent", "Agent loop", 6000, 150, "prefill-heavy, and it repeats",
           "Each step sends the same tool definitions and history again, so caching that prefix "
           "removes most of each step's prefill, which is most of its time once steps are batched.",
           ("prefix caching", "chunked prefill"),
           steps=AGENT_STEPS, steps_source=f"{_LAB}; the chapter says 'x many steps'"),
    _shape("summarisation", "Long-document summarisation", 60000, 800, "prefill dominates, quadratically",
           "The prompt is past the attention crossover, so attention is most of the prefill. "
           "Chunk the prefill, and question whether the whole document has to be in context.",
           ("chunked prefill", "shorter prompts", "more FLOP/s")),
    _shape("code-completion", "Inline code completion", 3000, 30, "mixed, tight budget",
           "Both phases matter under a first-token budget of a few hundred milliseconds: cache "
           "the prefix built from the open files, and draft tokens speculatively, which code "
           "accepts well.",
           ("prefix caching", "speculative decoding", "more FLOP/s", "more bandwidth")),
)}


def get_workload(name: str) -> Workload:
    """The shape called `name` (case-insensitive); SpecError lists the known ones."""
    for key, workload in WORKLOADS.items():
        if key.lower() == str(name).lower():
            return workload
    raise SpecError(f"unknown workload {name!r}; known: {', '.join(WORKLOADS)}")


def _as_workload(workload) -> Workload:
    return workload if isinstance(workload, Workload) else get_workload(workload)


def _check_batch(batch) -> int:
    return whole_number("batch", batch, error=SpecError)


def decode_time_s(model: ModelSpec, hardware: HardwareSpec, prompt_tokens: int, output_tokens: int,
                  batch: int = CHAPTER_BATCH, mfu: float = CHAPTER_MFU,
                  bandwidth_efficiency: float = CHAPTER_BANDWIDTH_EFFICIENCY,
                  counting: Counting = CHAPTER, dtype: str = "bf16") -> float:
    """The n - 1 decode passes after prefill, pass j reading a cache of P + j tokens per sequence,
    each timed by `roofline.predicted_decode_step_s` at `batch`, weights and cache in `dtype`.
    Ignores sampling and the scheduler; zero for a one-token answer (prefill produced it)."""
    return sum(r.predicted_decode_step_s(model, batch, prompt_tokens + j, hardware, dtype=dtype, cache_dtype=dtype,
                                         counting=counting, mfu=mfu, bandwidth_efficiency=bandwidth_efficiency)
               for j in range(1, output_tokens))


def request_time_split(model: ModelSpec, hardware: HardwareSpec, workload, batch: int = CHAPTER_BATCH,
                       mfu: float = CHAPTER_MFU, bandwidth_efficiency: float = CHAPTER_BANDWIDTH_EFFICIENCY,
                       counting: Counting = CHAPTER, dtype: str = "bf16") -> dict:
    """Prefill vs decode time of `workload` (a Workload or its name) served as `batch` identical
    requests in lock-step, over all its steps, weights, activations and cache in `dtype` (fp16 on
    a GPU without bf16, as the lab computes there). Keys carry units; `levers` are the workload's,
    `phase_levers` the chapter's fix list for whichever phase takes most of the time;
    `fits_in_memory` checks weights + the batch's full cache + prefill activations."""
    w = _as_workload(workload)
    batch = _check_batch(batch)
    prefill_one = r.predicted_prefill_time_s(model, w.prompt_tokens, hardware, batch, dtype, counting=counting,
                                             mfu=mfu, bandwidth_efficiency=bandwidth_efficiency)
    decode_one = decode_time_s(model, hardware, w.prompt_tokens, w.output_tokens, batch, mfu,
                               bandwidth_efficiency, counting, dtype)
    total = prefill_one + decode_one
    footprint = r.memory_footprint_bytes(model, batch, w.prompt_tokens + w.output_tokens, dtype, dtype,
                                         prefill_tokens=w.prompt_tokens)
    dominant = "prefill" if prefill_one >= decode_one else "decode"
    return {
        "workload": w.name, "prompt_tokens": w.prompt_tokens, "output_tokens": w.output_tokens,
        "steps": w.steps, "batch": batch, "dtype": dtype,
        "prefill_s": w.steps * prefill_one, "decode_s": w.steps * decode_one,
        "prefill_share": prefill_one / total, "decode_share": decode_one / total,
        "ttft_s": prefill_one,
        "itl_s": decode_one / (w.output_tokens - 1) if w.output_tokens > 1 else None,
        "footprint_bytes": footprint, "fits_in_memory": footprint <= hardware.memory_bytes,
        "dominant_phase": dominant, "chapter_split": w.chapter_split, "levers": w.levers,
        "phase_levers": PREFILL_LEVERS if dominant == "prefill" else DECODE_LEVERS,
    }


def time_split_table(model: ModelSpec, hardware: HardwareSpec, batch: int = CHAPTER_BATCH, **settings) -> list[dict]:
    """`request_time_split` for every registered shape, in the chapter's order."""
    return [request_time_split(model, hardware, w, batch, **settings) for w in WORKLOADS.values()]


def batch_for_prefill_share(model: ModelSpec, hardware: HardwareSpec, workload, share: float,
                            max_batch: int = 4096, **settings) -> int | None:
    """Smallest lock-step batch at which prefill takes at least `share` of the time, or None if
    no batch up to `max_batch` does. Prefill time grows in proportion to B while a decode pass
    shares its weight read among B sequences, so the prefill share rises with B: bisect."""
    def reaches(b: int) -> bool:
        return request_time_split(model, hardware, workload, b, **settings)["prefill_share"] >= share

    if not reaches(max_batch):
        return None
    low, high = 0, max_batch  # reaches(high) holds; reaches(low) does not (or low == 0)
    while high - low > 1:
        middle = (low + high) // 2
        low, high = (low, middle) if reaches(middle) else (middle, high)
    return high


def chapter_mix(copies: int = 8, seed: int = 0, prompt_scale: int = 1):
    """The chapter's six workload shapes, `copies` requests of each, shuffled, all waiting at t = 0:
    rows of (arrival_s, prompt_tokens, output_tokens) for `labkit.batching`. Prompts are divided
    by `prompt_scale` (`sizes.CPU_SHAPE_SCALE` keeps them inside the CPU model's measured contexts)."""
    shapes = [(max(1, round(w.prompt_tokens / prompt_scale)), w.output_tokens)
              for w in WORKLOADS.values()] * copies
    rows = np.array([(0.0, p, n) for p, n in shapes], dtype=float)
    return rows[np.random.default_rng(seed).permutation(len(rows))]
