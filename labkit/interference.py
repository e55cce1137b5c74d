"""One long prompt arriving while other users stream: measured, with and without chunked prefill.

The question: *a prefill and the decode steps of other users share one machine — what do those
users feel when a long prompt arrives?* This module runs it for real on the lab's model:

    streams      B sequences already decoding, each holding S cached tokens (random K/V, as in
                 `sweeps`: a step's time depends on how much it reads, not on the values)
    long prompt  P tokens for one more request, prefilled into a cache of its own
                 (both caches share the model's weights: each call names the cache it works on,
                 as paged attention keeps each sequence's blocks apart)
    timeline     a few decode steps; the prompt arrives; then, until it is prefilled, one chunk
                 of C tokens (`Llama.prefill_slot(0, tokens[start:start + C], long_cache,
                 start=start)`) followed by one decode step for the streams; then a few more
                 decode steps.
                 Without chunking C = P: the whole prompt in one pass between two decode steps.

Every decode step's end is a wall-clock timestamp (CUDA: after a synchronize), so the gap
between two of them is the inter-token latency (ITL) each stream really saw. Chunking should
shrink the worst gap to about one chunk plus one step; its cost is the long request's prefill
time (its time to first token), which grows because decode steps are interleaved and every
chunk re-reads the prompt's cached prefix for attention.

What a serving engine does differently: it fuses a chunk and the streams' decode tokens into
ONE forward pass (one read of the weights for both), while here they run back to back. The
stall without chunking is the same; the chunked timeline here is slightly pessimistic.
The long request's own decode after its prefill is not run: only the streams are timed.
"""
from __future__ import annotations

import math
import time
from dataclasses import dataclass, field

import numpy as np
import torch

from . import backend, cpu_info, sweeps, timing
from .errors import LabError, whole_number
from .kvcache import cache_footprint_bytes
from .timing import HOST_BOUND_FRACTION, OTHERS_BUSY_LIMIT

# Decode steps before the prompt arrives: their gaps' median is the streams' undisturbed ITL. With
# 4 steps (3 gaps), a browser still drawing the chart of a slider's last move (a 10-30 ms burst on a
# 2-core machine) stretched two of them: lesson 06 in Chromium showed 13 ms undisturbed gaps beside
# 1-2 ms ones from the same machine. 8 steps cost ~10 ms more on a CPU.
BEFORE_STEPS = 8
AFTER_STEPS = 3  # decode steps after its prefill is done
# A timeline is timed again until its prefill is confirmed (the two fastest runs' chunks, summed,
# within timing.CONFIRM_TOLERANCE of each other), at most MAX_RUNS times, and the run with the
# fastest prefill is kept: the lab's "confirmed fastest" estimate (`timing`), for a whole timeline.
# Timed once, lesson 06's comparison rested on one sample each: `make report` on the 2-core EPYC VM
# (2026-12-06) timed its unchunked 4,096-token prefill at 634 ms, where three runs a minute later
# took 444-460 ms, and the chunked one (491 ms) came out cheaper than the single pass, against the
# sentence above the chart. The warm-up is not repeated: the runs after the first reuse its pages.
MAX_RUNS = 4


@dataclass
class Timeline:
    """One measured run. Times in seconds from the first timed decode step's start."""

    prompt_tokens: int
    chunk_tokens: int  # == prompt_tokens: no chunking
    streams: int
    context_tokens: int
    model: str
    device: str
    device_name: str
    decode_end_s: list[float] = field(default_factory=list)  # when each decode step finished
    chunk_spans_s: list[tuple[float, float]] = field(default_factory=list)  # (start, end) of each chunk
    # CUDA: the host's time to issue each chunk (the call returns before the GPU is done); a chunk
    # whose issuing took nearly its whole span waited for Python's launches, not for the GPU
    chunk_host_s: list[float] = field(default_factory=list)
    # CPU: the share of the cores other processes kept busy while the timeline ran (None on CUDA,
    # or where the OS does not say): a browser drawing meanwhile stretches every chunk and step
    others_busy_share: float | None = None
    # the chunk size asked for: None for the unchunked run; lesson 06's slider reaches the whole
    # prompt, a run to tell apart from the unchunked one beside it (`explore.interference_series`)
    chunk_asked: int | None = None
    runs: int = 1  # how many times the timeline was timed; this is the run with the fastest prefill
    confirmed: bool = False  # whether another run's prefill came within timing.CONFIRM_TOLERANCE of it

    @property
    def chunked(self) -> bool:
        return self.chunk_tokens < self.prompt_tokens

    def gaps_s(self) -> np.ndarray:
        """Inter-token latency the streams saw: time between successive decode steps' ends."""
        return np.diff(self.decode_end_s)

    def summary(self) -> dict:
        """Streams' ITL (undisturbed median, p99, max) and the long request's prefill: wall-clock
        from its arrival to its last chunk's end (its TTFT), and the chunks' own time summed."""
        gaps = self.gaps_s()
        return {
            "chunk_tokens": self.chunk_tokens, "chunked": self.chunked, "chunks": len(self.chunk_spans_s),
            "prompt_tokens": self.prompt_tokens, "streams": self.streams, "context_tokens": self.context_tokens,
            "model": self.model, "device": self.device, "device_name": self.device_name,
            "itl_undisturbed_s": float(np.median(gaps[:BEFORE_STEPS - 1])),
            "itl_p99_s": float(np.quantile(gaps, 0.99)), "itl_max_s": float(gaps.max()),
            "prefill_wall_s": self.chunk_spans_s[-1][1] - self.chunk_spans_s[0][0],
            "prefill_compute_s": _prefill_s(self),
            # CUDA: chunks whose time was the host's launch rate (timing.HOST_BOUND_FRACTION); None on a CPU
            "chunks_host_bound": (sum(host >= HOST_BOUND_FRACTION * (end - start)
                                      for host, (start, end) in zip(self.chunk_host_s, self.chunk_spans_s))
                                  if self.device == "cuda" else None),
            "others_busy_share": self.others_busy_share,
            "runs": self.runs, "confirmed": self.confirmed,
            "disturbed": self.others_busy_share is not None and self.others_busy_share > OTHERS_BUSY_LIMIT,
        }


def run_timeline(model: str = "lab-cpu", streams: int = 4, context_tokens: int = 1024,
                 prompt_tokens: int = 4096, chunk_tokens: int | None = None, device: str | None = None,
                 warmup: bool | None = None, max_runs: int = MAX_RUNS) -> Timeline:
    """Time the timeline until its prefill is confirmed, at most `max_runs` times, and return the
    run with the fastest prefill (`Timeline.runs`, `Timeline.confirmed` say how it went).
    `chunk_tokens` None (or >= the prompt) = no chunking. `warmup` (default: on CUDA) runs it once
    untimed first, so Triton's autotuning for each chunk shape is not timed; on the CPU one decode
    step and one chunk of the timed size warm up instead."""
    _check(streams, context_tokens, prompt_tokens, chunk_tokens)
    whole_number("max_runs", max_runs)
    built = sweeps.get_built_model(model, device)
    chunk = min(chunk_tokens or prompt_tokens, prompt_tokens)
    kind = built.device.type
    if warmup if warmup is not None else kind == "cuda":
        run_timeline(model, streams, context_tokens, prompt_tokens, chunk_tokens, device, warmup=False, max_runs=1)
    steps = BEFORE_STEPS + math.ceil(prompt_tokens / chunk) + AFTER_STEPS + 1
    stream_cache, long_cache = _caches(built, streams, context_tokens, context_tokens + steps, prompt_tokens, chunk)
    g = torch.Generator().manual_seed(0)
    stream_tokens = torch.randint(0, built.spec.vocab_size, (streams,), generator=g).to(built.device)
    prompt = torch.randint(0, built.spec.vocab_size, (prompt_tokens,), generator=g).to(built.device)
    built.decode_step(stream_tokens, stream_cache)  # warm-up, untimed
    # A whole chunk, the timed size, warms up (overwritten below): a CPU prefill's first pass at a
    # size faults in its megabytes of fresh pages, which later passes reuse (`cpu_memory`), as a
    # serving engine's would. Measured on the 2-core EPYC VM (lab-cpu, 4 streams at 1,024, a
    # 4,096-token prompt unchunked, one process each): warmed by 256 tokens the stall took
    # 457-533 ms, by the whole prompt 391-399.
    built.prefill_slot(0, prompt[:chunk], long_cache, start=0)
    after_warmup = context_tokens + 1

    def timed() -> Timeline:
        stream_cache.set_lengths(after_warmup)  # each run's steps read what the first run's read
        line = Timeline(prompt_tokens, chunk, streams, context_tokens, built.spec.name, kind,
                        backend.device_name(kind), chunk_asked=chunk_tokens)
        if kind == "cpu":  # not while the browser still draws the cell before (the lesson's charts)
            timing.wait_for_quiet(timing.quiet_wait_s())
            load = cpu_info.load_snapshot()
        clock = _Clock(kind)

        def decode():
            built.decode_step(stream_tokens, stream_cache)
            line.decode_end_s.append(clock.now())

        for _ in range(BEFORE_STEPS):
            decode()
        for start in range(0, prompt_tokens, chunk):
            began = clock.now()
            built.prefill_slot(0, prompt[start:start + chunk], long_cache, start=start)
            issued = clock.elapsed()  # before the GPU finishes (CUDA)
            line.chunk_spans_s.append((began, clock.now()))
            line.chunk_host_s.append(issued - began)
            decode()
        for _ in range(AFTER_STEPS):
            decode()
        if kind == "cpu":
            line.others_busy_share = cpu_info.others_busy_share(load, timing.BUSY_WINDOW_S)
        return line

    runs = []
    while len(runs) < max_runs:
        runs.append(timed())
        confirmed = timing.Timing(tuple(map(_prefill_s, runs)), estimator="fastest").confirmed
        if confirmed:
            break
    best = min(runs, key=_prefill_s)
    best.runs, best.confirmed = len(runs), confirmed
    return best


def _prefill_s(line: Timeline) -> float:
    """The chunks' own time, summed: what a run's confirmation and the choice among runs go by."""
    return sum(end - start for start, end in line.chunk_spans_s)


def compare(chunk_tokens: int, **sizes) -> dict:
    """Both timelines at the same sizes: {"unchunked": Timeline, "chunked": Timeline}."""
    return {"unchunked": run_timeline(chunk_tokens=None, **sizes),
            "chunked": run_timeline(chunk_tokens=chunk_tokens, **sizes)}


def _caches(built, streams: int, context_tokens: int, capacity: int, prompt_tokens: int, chunk: int):
    """The streams' cache (`capacity` positions a row, the first `context_tokens` filled with
    random K/V) and the long request's own cache, in the model's compute dtype, refused before
    either is allocated unless both fit with the prefill of a `chunk`-token piece
    (`Llama.prefill_bytes`). The model's own cache is left alone."""
    need = (sum(cache_footprint_bytes(built.spec, rows, tokens, built.compute_dtype)  # what make_cache checks
                for rows, tokens in ((streams, capacity), (1, prompt_tokens)))
            + built.prefill_bytes(1, chunk))
    backend.check_fits(need, built.device.type, f"{streams} streams' caches of {capacity:,} tokens, a "
                       f"{prompt_tokens:,}-token prompt's cache and its prefill {chunk:,} tokens at a time")
    stream_cache = built.make_cache(streams, capacity, check=False)  # checked above
    stream_cache.fill_random(context_tokens)
    long_cache = built.make_cache(1, prompt_tokens, check=False)
    return stream_cache, long_cache


class _Clock:
    """Seconds since construction; on CUDA the GPU's queued work finishes first."""

    def __init__(self, kind: str):
        self.kind = kind
        backend.synchronize(kind)
        self.start = time.perf_counter()

    def now(self) -> float:
        backend.synchronize(self.kind)
        return self.elapsed()

    def elapsed(self) -> float:
        """Seconds since construction, without waiting for the GPU."""
        return time.perf_counter() - self.start


def _check(streams, context_tokens, prompt_tokens, chunk_tokens):
    for name, value in (("streams", streams), ("context_tokens", context_tokens), ("prompt_tokens", prompt_tokens)):
        whole_number(name, value)
    if chunk_tokens is not None and (not isinstance(chunk_tokens, int) or chunk_tokens < 1):
        raise LabError(f"chunk_tokens must be a positive integer or None, got {chunk_tokens!r}")
