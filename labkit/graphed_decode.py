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

Safety, since a wrong graph would be a silent wrong answer: capture comes after eager warm-up
steps on a side stream (Triton autotunes there, never during capture); the first replay must
equal an eager step from the same state; any error or mismatch turns graphs off for the model,
which then runs eagerly, with the reason in `reason` (a decode point's decode_reason).
LABKIT_CUDA_GRAPHS=0 turns them off. Not on the CPU (no graphs) nor for the torch ops.

Shapes: tokens [B] int64 (a static copy is replayed); logits [B, V] fp32, cloned per step.
"""
from __future__ import annotations

import os

import torch

from .kvcache import DecodePlan

cuda = torch.cuda  # the graph API, one name so a test can stand in for it on a CPU
WARMUP_STEPS = 3  # eager steps before capture: autotuning, lazy allocations, cuBLAS/Triton caches
# Replay against the eager step it captured: the same kernels on the same inputs, so equal but for
# the order of a few atomics-free reductions; a baked-in host number would differ by O(1).
MATCH_TOLERANCE = dict(rtol=1e-3, atol=1e-3)


def applies(model) -> tuple[bool, str]:
    """(capture the decode step?, why): CUDA with the Triton ops, unless LABKIT_CUDA_GRAPHS=0."""
    if model.device.type != "cuda":
        return False, "no CUDA graph (not on CUDA)"
    if model.ops.name != "triton":
        return False, f"no CUDA graph ({model.ops.name} ops)"
    if os.environ.get("LABKIT_CUDA_GRAPHS") == "0":
        return False, "no CUDA graph (LABKIT_CUDA_GRAPHS=0)"
    return True, "decode step as a CUDA graph once captured"


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
            try:
                self._capture(tokens, cache)
            except Exception as err:  # noqa: BLE001 - fall back to the eager step, and say why
                self._turn_off(f"capture failed: {type(err).__name__}: {err}".splitlines()[0])
                return None
            if self.off:
                return None
            self.key = key
        self.tokens.copy_(tokens)
        self.graph.replay()
        return self.logits.clone()  # the next replay overwrites the static output

    def release(self):
        """Drop the graph and its memory (the model's cache is being replaced or freed)."""
        self.graph = self.tokens = self.logits = self.key = None

    def _key(self, tokens, cache) -> tuple:
        """What the graph bakes in: the address, shape and dtype of every cache tensor it reads or
        writes, and the batch. A new cache that reuses freed memory at the same addresses with
        the same shapes would replay correctly; anything else is captured anew."""
        return (tokens.shape[0], cache.cache_dtype, tuple(cache.k.shape),
                tuple(t.data_ptr() if t is not None else None for t in cache.tensors()))

    def _body(self, cache):
        """The step as captured: positions and attended lengths from the device, the cache's
        capacity as the longest row (`device_plan`)."""
        return self.model.decode_layers(self.tokens, cache, device_plan(cache))

    def _capture(self, tokens, cache):
        self.tokens = tokens.clone()
        side = cuda.Stream()  # warm-up off the default stream, as CUDA graph capture requires
        side.wait_stream(cuda.current_stream())
        with cuda.stream(side):
            for _ in range(WARMUP_STEPS):
                eager = self._body(cache)  # rewrites the same positions: the cache state is unchanged
        cuda.current_stream().wait_stream(side)
        graph = cuda.CUDAGraph()
        with cuda.graph(graph):
            self.logits = self._body(cache)
        graph.replay()
        if not torch.allclose(self.logits, eager, **MATCH_TOLERANCE):
            worst = (self.logits - eager).abs().max().item()
            self._turn_off(f"the replayed step differs from the eager one by up to {worst:.3g}")
            return
        self.graph = graph

    def _turn_off(self, why: str):
        self.release()
        self.off = why
