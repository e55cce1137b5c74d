"""Capturing a model's work as a CUDA graph, checked before it is trusted: what the decode step's
graph (`graphed_decode`) and the prefill's (`graphed_prefill`) share.

    ok, why = allowed(model)                  # CUDA, the Triton ops, LABKIT_CUDA_GRAPHS not 0
    graph, out, why_not = capture(body, warmups=3)
    graph.replay()                            # `out` now holds the replayed result

Why graphs: a prefill or a decode step of the 8B is hundreds of kernel launches and torch ops, each
costing the host microseconds of Python, and where the GPU's own work is short it waits for them
(`measure`'s host_bound). A replayed graph issues the whole of it in one call, so the lab times the
GPU's work, which is what its roofline predicts.

Safety, since a wrong graph is a silent wrong answer: `capture` runs `body` eagerly first, on a side
stream as capture requires (Triton autotunes there, never during capture); then captures it, replays
it once, and trusts the graph only if the replay equals the last eager result (MATCH_TOLERANCE). Any
error or mismatch comes back as a reason, and the caller turns its graphs off and runs eagerly.
Not on the CPU (no graphs), nor for the torch ops.
"""
from __future__ import annotations

import os

import torch

cuda = torch.cuda  # the graph API, one name so a test can stand in for it on a CPU
# Replay against the eager run it captured: the same kernels on the same inputs, so equal but for
# the order of a few atomics-free reductions; a baked-in host number would differ by O(1).
MATCH_TOLERANCE = dict(rtol=1e-3, atol=1e-3)


def allowed(model) -> tuple[bool, str]:
    """(may `model`'s work be captured?, why not): CUDA with the Triton ops, unless LABKIT_CUDA_GRAPHS=0."""
    if model.device.type != "cuda":
        return False, "no CUDA graph (not on CUDA)"
    if model.ops.name != "triton":
        return False, f"no CUDA graph ({model.ops.name} ops)"
    if os.environ.get("LABKIT_CUDA_GRAPHS") == "0":
        return False, "no CUDA graph (LABKIT_CUDA_GRAPHS=0)"
    return True, ""


def cache_identity(cache) -> tuple:
    """What a graph bakes in of a KV cache: its dtype, shape, and the address of every tensor it
    reads or writes (`KVCache.tensors`). A new cache that reuses freed memory at the same addresses
    with the same shapes would replay correctly; anything else must be captured anew."""
    return (cache.cache_dtype, tuple(cache.k.shape),
            tuple(t.data_ptr() if t is not None else None for t in cache.tensors()))


def capture(body, warmups: int):
    """(graph, out, None) with `out` the tensor the graph writes on each replay, or (None, None, why)
    when the graph must not be used. `body()` -> a tensor, run `warmups` (>= 1) times eagerly on a
    side stream (autotuning, lazy allocations, cuBLAS/Triton caches), then once under capture; the
    graph is replayed once and kept only if that equals the last eager result. `body` must give
    the same result each time it runs (it rewrites the same cache positions with the same values)."""
    try:
        side = cuda.Stream()  # warm-up off the default stream, as CUDA graph capture requires
        side.wait_stream(cuda.current_stream())
        with cuda.stream(side):
            for _ in range(warmups):
                eager = body()
        cuda.current_stream().wait_stream(side)
        graph = cuda.CUDAGraph()
        with cuda.graph(graph):
            out = body()
        graph.replay()
    except Exception as err:  # noqa: BLE001 - the caller runs eagerly instead, and says why
        return None, None, f"capture failed: {type(err).__name__}: {err}".splitlines()[0]
    if not torch.allclose(out, eager, **MATCH_TOLERANCE):
        worst = (out - eager).abs().max().item()
        return None, None, f"the replay differs from the eager run by up to {worst:.3g}"
    return graph, out, None
