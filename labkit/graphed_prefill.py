"""A CUDA prefill as a CUDA graph, captured when the same prefill comes again, replayed after that.

Why it exists: eagerly, a prefill of the 8B issues ~16 kernel launches and torch ops a layer, ~550
a prefill. On the H200 the recorded prefill of 512 tokens took 53.7 ms and of 1,024 tokens 56.4 ms,
against 9.6 and 19.5 ms predicted, both flagged host-bound (the GPU waited for Python to launch its
work; `data/recordings/prefill_sweep-h200-20261204-1813.json`), while from 2,048 tokens on, where
the GPU's own work outlasts its launcher, every point ran at 0.54-0.55 of the roof. So a learner's
short prompt measured the host, not the compute-bound phase the lesson is about. A replayed graph
issues the whole prefill in one call.

Which prefills: unlike a decode step (`graphed_decode`), a prefill bakes host numbers into its
kernels (where the chunk starts, which rows, how many tokens), so a graph serves only the very same
call again: a timing loop's repeats. The loop says so (`with model.prefill_graph.repeating():`, as
`sweeps.measure_prefill` and `breakdown` do); inside it a call is captured the second time its key
comes in a row (the first ran eagerly, autotuning and allocating as it went), and only if it has
at most MAX_TOKENS tokens: past that the GPU's work outlasts its launches, and a capture would cost
two more prefills and the graph's memory for nothing. Everything else runs eagerly — chunked
prefill's chunks, continuous batching's slots, the serving runs — so no capture ever lands inside
a timeline being measured (lesson 06's warm-up call and its first chunk can share a key), and the
graph is dropped when its loop ends.

Capture, its check against the eager run and the fallback are `cuda_graphs.capture`'s; a graph
that fails or differs turns prefill graphs off for the model, with the reason in `reason`. The
cache lengths are the caller's to set, outside the graph (`Llama._prefill`). The body rewrites the
same positions with the same values at every run, so warm-up and capture leave the cache as one
prefill would.

Shapes: tokens [B, P] int64 (a static copy is replayed); logits [B, V] fp32, cloned per call.
"""
from __future__ import annotations

import contextlib

import torch

from . import cuda_graphs
from .clock import OFF

# Tokens (B x P) up to which a repeated prefill is captured. The 8B on the H200 waited for its host
# at 512 and 1,024 tokens (~54 ms of launching), not at 2,048 (73 ms of GPU work, the launches
# hidden behind it); this bound covers the crossover with room for a slower host or a smaller model.
MAX_TOKENS = 4096
WARMUP_RUNS = 1  # eager runs on the side stream before capture: the first call already warmed up


class GraphedPrefill:
    """`run(tokens, cache, start, rows)` -> a prefill's logits by replay, or None for "run it
    eagerly" (`Llama._prefill` then does); only inside `repeating()` (a timing loop) is anything
    captured or replayed. `name` says what ran the last prefill (the ops' name, "+graph" when it
    was a replay), `reason` why."""

    def __init__(self, model):
        self.model = model
        self.allowed, self.not_allowed = cuda_graphs.allowed(model)
        self.key = None  # what the graph was captured for
        self.seen = None  # the last key run eagerly: the same key next is captured
        self.graph = self.tokens = self.logits = None
        # the last prefill: replayed? too long for a graph? inside a timing loop (`repeating`)?
        self.replayed = self.too_long = self.in_loop = False
        self.off = None  # why graphs were turned off, once they were
        self.enabled = False  # inside `repeating`

    @property
    def name(self) -> str:
        return self.model.ops.name + ("+graph" if self.replayed else "")

    @contextlib.contextmanager
    def repeating(self):
        """While a timing loop repeats one prefill: its second call is captured, the rest replay.
        The graph is dropped when the loop ends."""
        was, self.enabled = self.enabled, True
        try:
            yield self
        finally:
            self.enabled = was
            self.release()
            self.seen = None

    @property
    def reason(self) -> str:
        """Why the last prefill ran as it did."""
        if not self.allowed:
            return f"eager prefill: {self.not_allowed}"
        if self.off:
            return f"eager prefill: CUDA graph off, {self.off}"
        if self.replayed:
            return "prefill replayed as a CUDA graph (captured when the same prefill came again)"
        if not self.in_loop:
            return "eager prefill: a CUDA graph replays only a timing loop's repeated prefill"
        if self.too_long:
            return (f"eager prefill: over {MAX_TOKENS:,} tokens, the GPU's work outlasts its launches "
                    "(no CUDA graph)")
        return "eager prefill: a CUDA graph is captured when the same prefill comes again"

    def run(self, tokens: torch.Tensor, cache, start: int, rows: slice) -> torch.Tensor | None:
        self.replayed, self.too_long, self.in_loop = False, tokens.numel() > MAX_TOKENS, self.enabled
        if not (self.allowed and self.enabled) or self.off or self.model.clock is not OFF:
            return None  # (the breakdown's clock times each part on a CPU: eager)
        key = self._key(tokens, cache, start, rows)
        if key != self.key:
            self.release()  # free the old graph's memory before this prefill allocates its own
            if key != self.seen or self.too_long:
                self.seen = key
                return None
            self.tokens = tokens.clone()
            self.graph, self.logits, why_not = cuda_graphs.capture(
                lambda: self.model.prefill_layers(self.tokens, cache, start, rows), WARMUP_RUNS)
            if why_not:
                self.release()
                self.off = why_not
                return None
            self.key = key
        self.tokens.copy_(tokens)
        self.graph.replay()
        self.replayed = True
        return self.logits.clone()  # the next replay overwrites the static output

    def release(self):
        """Drop the graph and its memory (a new prefill, or the model's cache being replaced or freed)."""
        self.graph = self.tokens = self.logits = self.key = None

    @staticmethod
    def _key(tokens, cache, start, rows) -> tuple:
        """What the graph bakes in: the tokens' shape, where the chunk starts, the rows, and the
        cache it writes and reads back (`cuda_graphs.cache_identity`)."""
        return (tuple(tokens.shape), start, (rows.start, rows.stop, rows.step), *cuda_graphs.cache_identity(cache))
