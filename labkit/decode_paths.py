"""How a decode step runs: one of three paths, chosen once per model, each saying what it is and why.

    path = choose_decode_path(model)     # at construction; `model.decode_path`
    logits = path.step(tokens, cache, cache.decode_plan())
    path.name     # "mkl+numba" | "onednn+numba" | "numba" | "numpy" | "torch" | "triton" | "triton+graph": a decode
                  # point's "kernels" (the CPU step's: its products + its attention, see cpu_decode)
    path.reason   # why this path (and why not the others): a decode point's "decode_reason"

The same arithmetic, three ways to issue it, because a decode step is many small operations and
what issuing each one costs depends on the machine:

  `cpu_decode.CpuDecode`          CPU, fp32: the layers as numpy calls, far cheaper per call than
                                  torch's, each weight read once for all rows (`cpu_linear`), the
                                  cache read as stored (`cpu_kernels`);
  `graphed_decode.GraphedDecode`  CUDA with the Triton ops: the step captured once per cache as a
                                  CUDA graph and replayed, one launch instead of ~1,000;
  `EagerDecode`                   everything else (bf16 on a CPU, the Triton ops in the
                                  interpreter, graphs turned off): `Llama.decode_layers` as it is.

A path's `step(tokens [B], cache, plan) -> logits [B, V]` writes each row's new K/V into `cache`
and leaves the lengths to `Llama.decode_step`; `release()` drops anything tied to a cache being
freed. A test may set `model.decode_path` to another path (e.g. `EagerDecode(model)`).
"""
from __future__ import annotations

from typing import Protocol

import torch

from . import cpu_decode, graphed_decode
from .kvcache import DecodePlan, KVCache


class DecodePath(Protocol):
    name: str
    reason: str

    def step(self, tokens: torch.Tensor, cache: KVCache, plan: DecodePlan) -> torch.Tensor: ...

    def release(self) -> None: ...


class EagerDecode:
    """The model's own decode arithmetic (`Llama.decode_layers`), one op at a time."""

    def __init__(self, model, reason: str = "eager decode step"):
        self.model, self.reason = model, reason

    @property
    def name(self) -> str:
        return self.model.ops.name

    def step(self, tokens, cache, plan) -> torch.Tensor:
        return self.model.decode_layers(tokens, cache, plan)

    def release(self):
        """Nothing to drop: the step holds no state tied to a cache."""


def choose_decode_path(model) -> DecodePath:
    """The CPU step where it applies, else the CUDA graph where it applies, else the eager
    step; the reason names each condition that decided it."""
    cpu_ok, cpu_why = cpu_decode.applies(model)
    if cpu_ok:
        return cpu_decode.CpuDecode(model, cpu_why)
    graph_ok, graph_why = graphed_decode.applies(model)
    if graph_ok:
        return graphed_decode.GraphedDecode(model, before=cpu_why)
    return EagerDecode(model, f"{cpu_why}; {graph_why}")
