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

from . import backend, sweeps, timing
from .errors import whole_number
from .shared_run import SharedRun

# Shapes are served in turns until every shape's fastest prefill and fastest decode are each
# confirmed by a second run (`timing.sample_in_turns`), each shape in about SHAPE_BUDGET_S of its
# own time, at most SHAPE_MAX_BUDGET_S.
SHAPE_BUDGET_S, SHAPE_MAX_BUDGET_S, SHAPE_MAX_RUNS = 4.0, 10.0, 30


def serve_request(model: str, prompt_tokens: int, output_tokens: int, batch: int = 1,
                  device: str | None = None, seed: int = 0) -> dict:
    """Serve `batch` identical-shape requests in lock-step; return the measured split (keys
    carry units): prefill_s, decode_s, their shares, ttft_s and the mean itl_s."""
    for name, value in (("prompt_tokens", prompt_tokens), ("output_tokens", output_tokens), ("batch", batch)):
        whole_number(name, value)
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
    decoded = time.perf_counter()
    return {"model": built.spec.name, "device": kind, "device_name": backend.device_name(kind),
            "prompt_tokens": prompt_tokens, "output_tokens": output_tokens, "batch": batch,
            **time_split(prefilled - start, decoded - prefilled, output_tokens)}


def time_split(prefill_s: float, decode_s: float, output_tokens: int) -> dict:
    """A request's time split: both phases' seconds, their shares, ttft_s and the mean itl_s
    (None for a one-token answer, which has no decode step)."""
    return {"prefill_s": prefill_s, "decode_s": decode_s,
            "prefill_share": prefill_s / (prefill_s + decode_s), "decode_share": decode_s / (prefill_s + decode_s),
            "ttft_s": prefill_s, "itl_s": decode_s / (output_tokens - 1) if output_tokens > 1 else None}


def serve_shapes(model: str, shapes: list[dict], device: str | None = None, progress=None,
                 batch: int = 1) -> list[dict]:
    """Serve each shape (dicts with prompt_tokens, output_tokens, as `explore.scaled_shapes`
    gives them) until its fastest prefill and fastest decode are confirmed, the shapes in turns
    (`timing.sample_in_turns`): one request of each shape a round, so a slow spell of the
    machine lands on every shape alike and cannot reorder them. A learner's browser and
    JupyterLab share a laptop's cores with the lab, and their bursts only ever add time, so each
    split is computed from the fastest of each phase. Per shape, `serve_request`'s keys plus runs,
    spreads and `noisy` (a phase whose fastest run no second run confirmed). progress(done,
    total) after each round: the shapes confirmed so far."""
    last: list[dict] = [{} for _ in shapes]

    def sampler(i: int, shape: dict):
        def sample():
            last[i] = serve_request(model, shape["prompt_tokens"], shape["output_tokens"], batch, device)
            return {"prefill": last[i]["prefill_s"], "decode": last[i]["decode_s"]}
        return sample

    def after_round(timings):
        progress(sum(all(t.confirmed for t in named.values()) for named in timings), len(shapes))

    every = timing.sample_in_turns([sampler(i, shape) for i, shape in enumerate(shapes)], SHAPE_BUDGET_S,
                                   SHAPE_MAX_BUDGET_S, 3, SHAPE_MAX_RUNS, after_round if progress else None)
    if progress:
        progress(len(shapes), len(shapes))
    return [{**served,
             **time_split(timings["prefill"].estimate_s, timings["decode"].estimate_s, served["output_tokens"]),
             "runs": len(timings["prefill"].samples_s), "prefill_spread": timings["prefill"].spread,
             "decode_spread": timings["decode"].spread, "noisy": timings["prefill"].noisy or timings["decode"].noisy,
             "prefill_share_range": share_range(timings["prefill"], timings["decode"])}
            for served, timings in zip(last, every)]


def share_range(prefill: timing.Timing, decode: timing.Timing) -> tuple[float, float]:
    """The prefill share if each phase took anywhere from its fastest call to its second fastest:
    where an unconfirmed fastest call (a moment faster than the rest: this VM's memory caught at its
    fast speed once) may put the share, and where a confirmed one does (within CONFIRM_TOLERANCE)."""
    return (prefill.min_s / (prefill.min_s + decode.second_fastest_s),
            prefill.second_fastest_s / (prefill.second_fastest_s + decode.min_s))


class SharedServing(SharedRun):
    """One serving of the shapes that lesson 07's answer to its question and its chart both read
    (`shared_run.SharedRun`): the same runs, one wait (~10 s on 2 cores)."""

    def __init__(self, model: str, shapes: list[dict], device: str | None = None, batch: int = 1):
        self.model, self.shapes, self.device, self.batch = model, shapes, device, batch
        # serve_shapes looked up when it runs, not bound here: tests put a stand-in in its place
        super().__init__(lambda progress: serve_shapes(self.model, self.shapes, self.device, progress, self.batch))

    @property
    def servings(self) -> int:
        """How many times the shapes were served."""
        return self.runs

    def read(self, reader: str, progress=None) -> list[dict]:
        """`serve_shapes`' results for `reader` (`SharedRun.read`); progress(done, total) as in
        serve_shapes, or at once to the end when the latest serving is read again."""
        if progress and self.has_fresh(reader):
            progress(len(self.shapes), len(self.shapes))
        return super().read(reader, progress)
