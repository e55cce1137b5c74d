"""The CUDA decode step as one CUDA graph: captured once per KV cache, replayed every step.

Why it exists: eagerly, a decode step of the 8B issues ~30 kernel launches and torch ops per
layer, ~1,000 a step. At 5-20 us of Python each (an estimate, not yet measured on a GPU here)
that is 5-20 ms on the host, against the 3.1 ms an H200 needs to read 15 GB of weights at batch
1. The GPU would wait for the host (`measure`'s host_bound flags it), and the lab would time its
launcher, not the memory the lesson is about. A replayed graph issues the whole step in one
call (gpt-fast and vLLM decode under CUDA graphs for the same reason).

What makes the step capturable: no host number enters it. Every row writes its new token at its
device length and attends over length + 1 keys (the path mixed lengths take eagerly anyway), and
the decode kernel's grid follows the cache's capacity, not the current length. So one graph
serves every later step of the same cache; a new cache (`setup_cache`) is captured anew. The
host mirror of the lengths still advances outside the graph (`KVCache.advance`).

Capture (`cuda_graphs.capture`) follows eager warm-up steps and is kept only if its first replay
equals an eager step from the same state; otherwise graphs are turned off for the model, which then
runs eagerly, with the reason in `reason` (a decode point's decode_reason). LABKIT_CUDA_GRAPHS=0
turns them off. Not on the CPU (no graphs) nor for the torch ops.

Shapes: tokens [B] int64 (a static copy is replayed); logits [B, V] fp32, cloned per step.
"""
from __future__ import annotations

import torch

from . import cuda_graphs
from .kvcache import DecodePlan

WARMUP_STEPS = 3  # eager steps before capture: autotuning, lazy allocations, cuBLAS/Triton caches


def applies(model) -> tuple[bool, str]:
    """(capture the decode step?, why): `cuda_graphs.allowed`."""
    ok, why_not = cuda_graphs.allowed(model)
    return ok, "decode step as a CUDA graph once captured" if ok else why_not


def device_plan(cache) -> DecodePlan:
    """The step's plan with no host number in it: every row writes at its device length and
    attends over length + 1 keys, with the cache's capacity as the longest row."""
    return DecodePlan(cache.lengths, cache.max_tokens, True)


class GraphedDecode:
    """A decode path (see `decode_paths`): `step(tokens, cache, plan)` replays the model's decode
    arithmetic as a CUDA graph, captured on the first step of each cache, or runs it eagerly
    (`Llama.decode_layers`) once graphs are off. Bookkeeping stays with `Llama.decode_step`.
    `before`: why the steps before this one in `decode_paths.choose_decode_path` did not apply."""

    def __init__(self, model, before: str = ""):
        self.model, self.before = model, before
        self.key = None  # the cache (and batch) the graph was captured for
        self.graph = self.tokens = self.logits = None
        self.off = None  # why graphs were turned off, once they were

    def step(self, tokens: torch.Tensor, cache, plan: DecodePlan) -> torch.Tensor:
        logits = self._replay(tokens, cache)
        return logits if logits is not None else self.model.decode_layers(tokens, cache, plan)

    @property
    def name(self) -> str:
        """What ran the last step: the ops' name, "+graph" once a captured graph replays."""
        return self.model.ops.name + ("+graph" if self.graph is not None else "")

    @property
    def reason(self) -> str:
        if self.off:
            state = f"eager decode: CUDA graph off, {self.off}"
        else:
            state = "decode step replayed as a CUDA graph" if self.graph is not None else \
                "decode step as a CUDA graph once captured"
        return f"{self.before}; {state}" if self.before else state

    def _replay(self, tokens, cache) -> torch.Tensor | None:
        """The step by replay (capturing it first for a new cache), or None when graphs are off."""
        if self.off:
            return None
        key = self._key(tokens, cache)
        if key != self.key:
            self.release()  # free the old graph's memory first
            self.tokens = tokens.clone()
            self.graph, self.logits, why_not = cuda_graphs.capture(lambda: self._body(cache), WARMUP_STEPS)
            if why_not:  # the warm-up steps rewrote the same positions: the cache state is unchanged
                self._turn_off(why_not)
                return None
            self.key = key
        self.tokens.copy_(tokens)
        self.graph.replay()
        return self.logits.clone()  # the next replay overwrites the static output

    def release(self):
        """Drop the graph and its memory (the model's cache is being replaced or freed)."""
        self.graph = self.tokens = self.logits = self.key = None

    def _key(self, tokens, cache) -> tuple:
        """What the graph bakes in: the batch and the cache (`cuda_graphs.cache_identity`)."""
        return (tokens.shape[0], *cuda_graphs.cache_identity(cache))

    def _body(self, cache):
        """The step as captured: positions and attended lengths from the device, the cache's
        capacity as the longest row (`device_plan`)."""
        return self.model.decode_layers(self.tokens, cache, device_plan(cache))

    def _turn_off(self, why: str):
        self.release()
        self.off = why
