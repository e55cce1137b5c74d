"""One request served end to end on the lab's model: a real prefill, then decode token by token.

The question: *for a request of P prompt tokens and n output tokens, how much of its time is
prefill and how much decode — measured, not predicted?* `serve_request` runs exactly the
lab's convention (`labkit.workloads`): one prefill pass over P tokens that yields the first
token, then n - 1 decode steps, each appending one token (greedy: the argmax feeds the next
step, as a real generation loop does). Timestamps are wall-clock (CUDA: after a synchronize).
"""
from __future__ import annotations

import time

import torch

from . import backend, measure, sweeps
from .errors import LabError

# Each shape is served until its fastest prefill and fastest decode are each confirmed by a second
# run (`measure.sample_until_stable`), in about SHAPE_BUDGET_S, at most SHAPE_MAX_BUDGET_S.
SHAPE_BUDGET_S, SHAPE_MAX_BUDGET_S, SHAPE_MAX_RUNS = 4.0, 10.0, 30


def serve_request(model: str, prompt_tokens: int, output_tokens: int, batch: int = 1,
                  device: str | None = None, seed: int = 0) -> dict:
    """Serve `batch` identical-shape requests in lock-step; return the measured split (keys
    carry units): prefill_s, decode_s, their shares, ttft_s and the mean itl_s."""
    for name, value in (("prompt_tokens", prompt_tokens), ("output_tokens", output_tokens), ("batch", batch)):
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise LabError(f"{name} must be a positive integer, got {value!r}")
    built = sweeps.get_built_model(model, device)
    kind = built.device.type
    built.setup_cache(batch, prompt_tokens + output_tokens, built.compute_dtype, prompt_tokens)
    g = torch.Generator().manual_seed(seed)
    prompt = torch.randint(0, built.spec.vocab_size, (batch, prompt_tokens), generator=g).to(built.device)
    backend.synchronize(kind)
    start = time.perf_counter()
    logits = built.prefill(prompt)
    backend.synchronize(kind)
    prefilled = time.perf_counter()
    for _ in range(output_tokens - 1):
        logits = built.decode_step(logits.argmax(-1))
    backend.synchronize(kind)
    prefill_s, decode_s = prefilled - start, time.perf_counter() - prefilled
    return {"model": built.spec.name, "device": kind, "device_name": backend.device_name(kind),
            "prompt_tokens": prompt_tokens, "output_tokens": output_tokens, "batch": batch,
            "prefill_s": prefill_s, "decode_s": decode_s,
            "prefill_share": prefill_s / (prefill_s + decode_s), "decode_share": decode_s / (prefill_s + decode_s),
            "ttft_s": prefill_s, "itl_s": decode_s / (output_tokens - 1) if output_tokens > 1 else None}


def serve_until_stable(model: str, prompt_tokens: int, output_tokens: int, batch: int = 1,
                       device: str | None = None) -> dict:
    """`serve_request` repeated until its fastest prefill and fastest decode are confirmed
    (a warm-up run first, untimed). A learner's browser and JupyterLab share a laptop's cores
    with the lab, and their bursts only ever add time, so the split is computed from the
    fastest of each phase. Keys as `serve_request`'s, plus runs, spreads and `noisy` (a phase
    whose fastest run no second run confirmed)."""
    last: dict = {}

    def sample():
        last.update(serve_request(model, prompt_tokens, output_tokens, batch, device))
        return {"prefill": last["prefill_s"], "decode": last["decode_s"]}

    timings = measure.sample_until_stable(sample, SHAPE_BUDGET_S, SHAPE_MAX_BUDGET_S, 3, SHAPE_MAX_RUNS)
    prefill_s, decode_s = timings["prefill"].estimate_s, timings["decode"].estimate_s
    return {**last, "prefill_s": prefill_s, "decode_s": decode_s,
            "prefill_share": prefill_s / (prefill_s + decode_s), "decode_share": decode_s / (prefill_s + decode_s),
            "ttft_s": prefill_s, "itl_s": decode_s / (output_tokens - 1) if output_tokens > 1 else None,
            "runs": len(timings["prefill"].samples_s), "prefill_spread": timings["prefill"].spread,
            "decode_spread": timings["decode"].spread,
            "noisy": timings["prefill"].noisy or timings["decode"].noisy}


def serve_shapes(model: str, shapes: list[dict], device: str | None = None, progress=None) -> list[dict]:
    """`serve_until_stable` for each shape (dicts with prompt_tokens, output_tokens, as
    `explore.scaled_shapes` gives them); progress(done, total) after each."""
    results = []
    for i, shape in enumerate(shapes):
        results.append(serve_until_stable(model, shape["prompt_tokens"], shape["output_tokens"], device=device))
        if progress:
            progress(i + 1, len(shapes))
    return results
