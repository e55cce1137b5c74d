"""`python -m labkit.warm`: compile the CPU decode step's numba kernels once, when the lab is set up.

Why: numba compiles a kernel on its first call and keeps the machine code in `labkit/__pycache__`
(`cache=True`), where every later process loads it in milliseconds. Without this, a learner's first
decode step on a fresh machine waited ~10 s and the first step with each other cache dtype ~5 s
more (2-core Xeon VM), in the middle of a lesson. `make venv` (so `make lab` and `make test`) runs it
at setup (~40 s) and again whenever the CPU step's code changes (its stamp, .venv/.warm, is older
than labkit/cpu_*.py); a run finds what an earlier one compiled and takes a few seconds.

On two or more cores it compiles in two processes at once: this one takes the first cache dtype,
a helper (`--cache-dtypes` the others) the rest, as numba compiles on one thread. From cold on the
2-core EPYC VM: 51-55 s in one process, 39-41 s split so (fp32 | bf16, int8); numba writes each
cache entry to a temporary file and renames it, so the two never corrupt a build (at worst one
entry is left for the first step that needs it).

It runs lab-cpu's own decode step (so the kernels meet the same array types, layouts and sizes as in
the lessons: which kernel a product or an attention takes depends on them) for every CPU cache
dtype at batch sizes that reach each kernel: 1 (one row at a time), 4 and 16 (the panel product,
attention shared out to the cores), as one call (`cpu_step`) where that applies, and again as the
separate calls a breakdown times (`clock.CALL_BY_CALL`: some kernels there meet other layouts; ~1 s
of compiling that a learner's first breakdown did before). Contexts are short: nothing here is timed.
A learner who cannot write to where this compiled starts from its builds (`cpu_kernels._installed_builds`).

    python -m labkit.warm          # prints one line: what it compiled, and how long it took
    python -m labkit.warm --cache-dtypes int8   # only these (what the helper runs)
"""
from __future__ import annotations

import subprocess
import sys
import time

import torch

from . import backend, cpu_kernels, sizes
from .cli_args import Parser, UsageError
from .clock import CALL_BY_CALL, OFF
from .cpu_blas import CORES
from .errors import LabError
from .model import Llama

CACHE_DTYPES = sizes.CACHE_DTYPES["cpu"]
BATCHES = (1, 4, 16)
# the step as the lessons run it (OFF: one call, `cpu_step`, where that applies) and as a breakdown
# times it (CALL_BY_CALL: the same kernels called one by one, some of them compiled for other layouts)
CLOCKS = (OFF, CALL_BY_CALL)
CONTEXT = 64  # tokens: at batch 16 a layer's K and V pass cpu_decode.ATTENTION_SPLIT_MIN_BYTES


def warm(cache_dtypes: tuple[str, ...] | None = None, helper: bool = True) -> str:
    """Run one decode step for each of `cache_dtypes` (default CACHE_DTYPES) at each batch in
    BATCHES on lab-cpu, all but the first in a helper process where there are two cores and
    `helper`; a line saying what ran."""
    if not cpu_kernels.AVAILABLE:
        return "warm: numba is not installed; the CPU step uses numpy's forms, nothing to compile"
    if backend.choose_device(None).device != "cpu":
        return ("warm: a GPU runs the lab; the CPU kernels are compiled on first use if ever needed "
                "(LABKIT_DEVICE=cpu python -m labkit.warm compiles them now, for learners held to the CPU)")
    cache_dtypes = tuple(cache_dtypes or CACHE_DTYPES)
    start = time.perf_counter()
    mine, theirs = (cache_dtypes[:1], cache_dtypes[1:]) if helper and CORES > 1 else (cache_dtypes, ())
    helping = subprocess.Popen([sys.executable, "-m", "labkit.warm", "--cache-dtypes", ",".join(theirs)],
                               stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True) if theirs else None
    try:
        model = Llama(sizes.lab_settings("cpu")["model"], batch=1, max_tokens=CONTEXT + 2, device="cpu", seed=0)
        tokens = torch.Generator().manual_seed(0)
        for cache_dtype in mine:
            for batch in BATCHES:
                for clock in CLOCKS:
                    model.clock = clock
                    model.setup_cache(batch, CONTEXT + 2, cache_dtype)
                    model.prefill(torch.randint(0, model.spec.vocab_size, (batch, CONTEXT), generator=tokens))
                    model.decode_step(torch.randint(0, model.spec.vocab_size, (batch,), generator=tokens))
        model.release_cache()
    finally:
        said = helping.communicate()[0] if helping else ""
    if helping and helping.returncode != 0:
        raise LabError(f"the helper warming {', '.join(theirs)} failed (exit {helping.returncode}): "
                       f"{said.strip().splitlines()[-1] if said.strip() else 'no output'}")
    return (f"warm: the CPU decode step's kernels compiled or loaded for {', '.join(cache_dtypes)} caches "
            f"at batch {', '.join(map(str, BATCHES))} ({model.decode_path.name}) in {time.perf_counter() - start:.0f} s")


def _cache_dtypes(text: str) -> tuple[str, ...]:
    names = tuple(name.strip() for name in text.split(",") if name.strip())
    unknown = [name for name in names if name not in CACHE_DTYPES]
    if unknown or not names:
        raise UsageError(f"--cache-dtypes: {', '.join(unknown) or 'none given'}; the CPU offers {', '.join(CACHE_DTYPES)}")
    return names


def main(argv=None) -> int:
    parser = Parser(prog="python -m labkit.warm", description=__doc__.splitlines()[0])
    parser.add_argument("--cache-dtypes", default=None,
                        help=f"comma-separated, of {', '.join(CACHE_DTYPES)}: only these, in this process "
                             "(default: all, in two processes on two or more cores)")
    try:
        args = parser.parse_args(argv)
        chosen = CACHE_DTYPES if args.cache_dtypes is None else _cache_dtypes(args.cache_dtypes)
    except UsageError as err:
        print(f"warm: error: {err}", file=sys.stderr)
        return 2
    try:
        print(warm(chosen, helper=args.cache_dtypes is None), flush=True)
    except LabError as err:
        print(f"warm: error: {err}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
