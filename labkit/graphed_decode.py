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
which then runs eagerly, with the reason in `model.decode_reason` (from `reason`). LABKIT_CUDA_GRAPHS=0 turns
them off. Not on the CPU (no graphs) nor for the torch ops.

Shapes: tokens [B] int64 (a static copy is replayed); logits [B, V] fp32, cloned per step.
"""
from __future__ import annotations

import os

import torch

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


class GraphedDecode:
    """`step(tokens)`: the model's decode arithmetic by graph replay, or None when graphs are
    off (the caller then runs it eagerly). Bookkeeping stays with `Llama.decode_step`."""

    def __init__(self, model):
        self.model = model
        self.key = None  # the cache (and batch) the graph was captured for
        self.graph = self.tokens = self.logits = None
        self.off = None  # why graphs were turned off, once they were

    def step(self, tokens: torch.Tensor) -> torch.Tensor | None:
        if self.off:
            return None
        key = self._key(tokens)
        if key != self.key:
            self.release()  # free the old graph's memory first
            try:
                self._capture(tokens)
            except Exception as err:  # noqa: BLE001 - fall back to the eager step, and say why
                self._turn_off(f"capture failed: {type(err).__name__}: {err}".splitlines()[0])
                return None
            if self.off:
                return None
            self.key = key
        self.tokens.copy_(tokens)
        self.graph.replay()
        return self.logits.clone()  # the next replay overwrites the static output

    @property
    def reason(self) -> str:
        if self.off:
            return f"eager decode: CUDA graph off, {self.off}"
        return "decode step replayed as a CUDA graph" if self.graph is not None else \
            "decode step as a CUDA graph once captured"

    def release(self):
        """Drop the graph and its memory (the model's cache is being replaced or freed)."""
        self.graph = self.tokens = self.logits = self.key = None

    def _key(self, tokens) -> tuple:
        """What the graph bakes in: the address, shape and dtype of every cache tensor it reads or
        writes, and the batch. A new cache that reuses freed memory at the same addresses with
        the same shapes would replay correctly; anything else is captured anew."""
        cache = self.model.cache
        tensors = (cache.k, cache.v, cache.k_scale, cache.v_scale, cache.lengths, cache._rows)
        return (tokens.shape[0], cache.cache_dtype, tuple(cache.k.shape),
                tuple(t.data_ptr() if t is not None else None for t in tensors))

    def _body(self):
        """The step as captured: positions and attended lengths from the device, the cache's
        capacity as the longest row."""
        cache = self.model.cache
        return self.model._decode_layers(self.tokens, cache.lengths, cache.lengths + 1, cache.max_tokens, True)

    def _capture(self, tokens):
        self.tokens = tokens.clone()
        side = cuda.Stream()  # warm-up off the default stream, as CUDA graph capture requires
        side.wait_stream(cuda.current_stream())
        with cuda.stream(side):
            for _ in range(WARMUP_STEPS):
                eager = self._body()  # rewrites the same positions: the cache state is unchanged
        cuda.current_stream().wait_stream(side)
        graph = cuda.CUDAGraph()
        with cuda.graph(graph):
            self.logits = self._body()
        graph.replay()
        if not torch.allclose(self.logits, eager, **MATCH_TOLERANCE):
            worst = (self.logits - eager).abs().max().item()
            self._turn_off(f"the replayed step differs from the eager one by up to {worst:.3g}")
            return
        self.graph = graph

    def _turn_off(self, why: str):
        self.release()
        self.off = why
