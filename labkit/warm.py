"""`python -m labkit.warm`: compile the CPU decode step's numba kernels once, when the lab is set up.

Why: numba compiles a kernel on its first call and keeps the machine code in `labkit/__pycache__`
(`cache=True`), where every later process loads it in milliseconds. Without this, a learner's first
decode step on a fresh machine waited ~10 s and the first step with each other cache dtype ~5 s
more (2-core Xeon VM), in the middle of a lesson. `make venv` (so `make lab` and `make test`) runs it
at setup (~40 s) and again whenever the CPU step's code changes (its stamp, .venv/.warm, is older
than labkit/cpu_*.py); a run finds what an earlier one compiled and takes a few seconds.

It runs lab-cpu's own decode step (so the kernels meet the same array types, layouts and sizes as in
the lessons: which kernel a product or an attention takes depends on them) for every CPU cache
dtype at batch sizes that reach each kernel: 1 (one row at a time), 4 and 16 (the panel product,
attention shared out to the cores), as one call (`cpu_step`) where that applies; the separate calls
a breakdown times reuse those kernels and take ~0.3 s more on their first step. Contexts are short:
nothing here is timed.

    python -m labkit.warm          # prints one line: what it compiled, and how long it took
"""
from __future__ import annotations

import sys
import time

import torch

from . import backend, cpu_kernels, sizes
from .cli_args import Parser, UsageError
from .model import Llama

CACHE_DTYPES = sizes.CACHE_DTYPES["cpu"]
BATCHES = (1, 4, 16)
CONTEXT = 64  # tokens: at batch 16 a layer's K and V pass cpu_decode.ATTENTION_SPLIT_MIN_BYTES


def warm() -> str:
    """Run one decode step for each cache dtype and batch in BATCHES on lab-cpu; a line saying what ran."""
    if not cpu_kernels.AVAILABLE:
        return "warm: numba is not installed; the CPU step uses numpy's forms, nothing to compile"
    if backend.choose_device(None).device != "cpu":
        return "warm: a GPU runs the lab; the CPU kernels are compiled on first use if ever needed"
    start = time.perf_counter()
    model = Llama(sizes.lab_settings("cpu")["model"], batch=1, max_tokens=CONTEXT + 2, device="cpu", seed=0)
    tokens = torch.Generator().manual_seed(0)
    for cache_dtype in CACHE_DTYPES:
        for batch in BATCHES:
            model.setup_cache(batch, CONTEXT + 2, cache_dtype)
            model.prefill(torch.randint(0, model.spec.vocab_size, (batch, CONTEXT), generator=tokens))
            model.decode_step(torch.randint(0, model.spec.vocab_size, (batch,), generator=tokens))
    model.release_cache()
    return (f"warm: the CPU decode step's kernels compiled or loaded for {', '.join(CACHE_DTYPES)} caches "
            f"at batch {', '.join(map(str, BATCHES))} ({model.decode_path.name}) in {time.perf_counter() - start:.0f} s")


def main(argv=None) -> int:
    try:
        Parser(prog="python -m labkit.warm", description=__doc__.splitlines()[0]).parse_args(argv)
    except UsageError as err:
        print(f"warm: error: {err}", file=sys.stderr)
        return 2
    print(warm(), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
