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

from . import backend, sweeps
from .errors import LabError


def serve_request(model: str, prompt_tokens: int, output_tokens: int, batch: int = 1,
                  device: str | None = None, seed: int = 0) -> dict:
    """Serve `batch` identical-shape requests in lock-step; return the measured split (keys
    carry units): prefill_s, decode_s, their shares, ttft_s and the mean itl_s."""
    for name, value in (("prompt_tokens", prompt_tokens), ("output_tokens", output_tokens), ("batch", batch)):
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise LabError(f"{name} must be a positive integer, got {value!r}")
    built = sweeps.get_built_model(model, device)
    kind = built.device.type
    sync = torch.cuda.synchronize if kind == "cuda" else (lambda: None)
    built.setup_cache(batch, prompt_tokens + output_tokens, built.compute_dtype, prompt_tokens)
    g = torch.Generator().manual_seed(seed)
    prompt = torch.randint(0, built.spec.vocab_size, (batch, prompt_tokens), generator=g).to(built.device)
    sync()
    start = time.perf_counter()
    logits = built.prefill(prompt)
    sync()
    prefilled = time.perf_counter()
    for _ in range(output_tokens - 1):
        logits = built.decode_step(logits.argmax(-1))
    sync()
    prefill_s, decode_s = prefilled - start, time.perf_counter() - prefilled
    return {"model": built.spec.name, "device": kind, "device_name": backend.device_name(kind),
            "prompt_tokens": prompt_tokens, "output_tokens": output_tokens, "batch": batch,
            "prefill_s": prefill_s, "decode_s": decode_s,
            "prefill_share": prefill_s / (prefill_s + decode_s), "decode_share": decode_s / (prefill_s + decode_s),
            "ttft_s": prefill_s, "itl_s": decode_s / (output_tokens - 1) if output_tokens > 1 else None}


def serve_shapes(model: str, shapes: list[dict], device: str | None = None, progress=None) -> list[dict]:
    """`serve_request` once for each shape (dicts with prompt_tokens, output_tokens, as
    `explore.scaled_shapes` gives them); progress(done, total) after each."""
    results = []  # no warm-up here: sweeps.get_built_model warms a model up once when it builds it
    for i, shape in enumerate(shapes):
        results.append(serve_request(model, shape["prompt_tokens"], shape["output_tokens"], device=device))
        if progress:
            progress(i + 1, len(shapes))
    return results
