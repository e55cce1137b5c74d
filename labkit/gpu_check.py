"""Check a GPU against the lab in one command: kernels correct, kernels fast, both phases measured.

    python -m labkit.gpu_check --out DIR [--dry-run] [--budget-s 420] [--only SECTION,...]
    make gpu-check OUT=DIR [DRY=1]

Sections, in order; each writes its recording into DIR the moment it finishes, named
`<section>-<device>-<YYYYmmdd-HHMM>.json` (labkit.recordings: never overwritten). Until then its
finished steps are appended to `<same name>.partial.jsonl`, so a run killed mid-section keeps
them; a section that raises is recorded with its error and the next one runs:

  calibration    provenance (device, driver, torch/triton versions, date, command) and this
                 machine's measured roofline (labkit.calibrate; measured afresh on a GPU)
  correctness    each kernel against its torch reference on fresh seeded random inputs, at the
                 8B's sizes: matmul M=2048 (K, N = 4096/14336); causal flash attention H=32,
                 Hkv=8, D=128 at P = 1k, 4k and 1k queries after 3k cached; decode attention over
                 bf16, fp8 and int8 caches quantised on the GPU, B=16 at S=8k and B=1 at S=64k;
                 int8/fp8 quantisation itself (the fp8 cast the CPU interpreter gets wrong);
                 tolerances from kernels/tolerances.py, the table the kernel tests read
  kernels        each kernel against its torch baseline, the roofline bound printed first
  prefill_sweep  the Llama-3.1-8B-shaped model's prefill, P = 512 ... 32k, batch 1; up to 4k
                 tokens replayed as a CUDA graph (labkit.graphed_prefill: "triton+graph", or
                 the point's "prefill_reason" says why not)
  decode_sweep   its decode step at S = 8k, batch 1 ... the largest that fits (>= 64), and at
                 batch 1 for S = 1k ... 128k; bf16, fp8 and int8 caches; the step replayed as
                 a CUDA graph (labkit.decode_paths: each point's "kernels" says "triton+graph",
                 or its "decode_reason" says why not)

Targets (reported in the final JSON line; only a failed correctness check changes the exit code):
  matmul >= 0.85 x torch.matmul;  flash attention >= 400 TFLOP/s (causal bf16) at P >= 4k;
  fp8/int8 decode attention >= 1.5 x faster than bf16 at S >= 32k.

--budget-s is shared among the sections (SHARES; time a section leaves passes to the next). A
step starts only while its section has at least as long left as its previous step took; what
does not start is recorded as `skipped: budget`, as is what does not fit in memory (checked
before allocating). --dry-run takes the same steps at toy sizes with the lab-tiny model, in under
a minute: on the GPU if there is one, else on the CPU in Triton's interpreter with fp16 kernels
(its bf16 is broken). Exit codes: 0 done (the last line names any correctness check that did not
run, and why), or a dry run skipped where Triton is not installed (macOS, Windows: it says so);
1 a correctness check failed; 2 bad arguments, no GPU, no Triton for a full run, or DIR unwritable.
Not measured here: L2 residency. Caches under the L2's 50-60 MB (fp8/int8 at S=16k, B=1) stay
partly in an H100/H200's L2 between timed calls, so their bandwidth fraction can read high.

On a GPU machine with no make (and no .git beside the tree), as one command:
    LABKIT_GIT_COMMIT=<commit> PYTHONUNBUFFERED=1 timeout 480 python3 -m labkit.gpu_check --out DIR

Three modules, one job each (beyond the standard library and labkit's Jupyter-free core they
import only torch, triton and numpy, so the check runs on a GPU image with nothing else):

  gpu_check     this command: arguments, device and interpreter, the sections in turn, the last line
  gpu_run       what the sections share: sizes, the budget, steps logged as they finish,
                recordings, the roofs each timing is compared with
  gpu_sections  the five sections: what is checked and measured, and against which roof
"""
from __future__ import annotations

import json
import os
import sys
import time

from . import gpu_sections
from .cli_args import Parser, UsageError
from .errors import LabError
from .gpu_run import SECTIONS, Budget, Run, autotune_estimate, error_line, write_section
from .recordings import check_writable
from .sizes import GPU_CHECK_DRY, GPU_CHECK_FULL
from .specs import preset_for_device_name

# 7 minutes of steps: a step starts only if its section has time left, so each section can run
# over by its last step (prefill at 32k, with its autotuning, ~20 s), and the start (imports,
# CUDA context) comes first: the whole command stays inside the 8 minutes it is allowed.
DEFAULT_BUDGET_S = 420.0
NO_GPU = "no CUDA GPU: run with --dry-run, or on a GPU machine"
# The kernels' dtype: bf16 on a GPU, the dtype the chapter's peaks are quoted for (fp16 on one
# without bf16, a T4: labkit.backend's compute dtype, and the run says so); fp16 in Triton's
# interpreter, whose bf16 arithmetic is wrong (triton issue #11584).
KERNEL_DTYPE = {"cuda": "bf16", "cpu": "fp16"}
SECTION_FUNCTIONS = {"calibration": gpu_sections.calibration_section,
                     "correctness": gpu_sections.correctness_section, "kernels": gpu_sections.kernels_section,
                     "prefill_sweep": lambda run: gpu_sections.sweep_section(run, "prefill"),
                     "decode_sweep": lambda run: gpu_sections.sweep_section(run, "decode")}


def parse_args(argv=None):
    parser = Parser(prog="python -m labkit.gpu_check", description=__doc__.splitlines()[0])
    parser.add_argument("--out", required=True, help="directory for the recordings (created if missing)")
    parser.add_argument("--dry-run", action="store_true", help="toy sizes; on a CPU in Triton's interpreter")
    parser.add_argument("--budget-s", type=float, default=DEFAULT_BUDGET_S,
                        help=f"wall-time budget in seconds ({DEFAULT_BUDGET_S:.0f})")
    parser.add_argument("--only", default=",".join(SECTIONS), help=f"a comma-separated subset of {','.join(SECTIONS)}")
    args = parser.parse_args(argv)
    if not 0 < args.budget_s < float("inf"):
        raise UsageError(f"--budget-s must be a positive number of seconds, got {args.budget_s}")
    wanted = {name.strip().replace("-", "_") for name in args.only.split(",") if name.strip()}
    if not wanted or wanted - set(SECTIONS):
        raise UsageError(f"--only: unknown section(s) {', '.join(sorted(wanted - set(SECTIONS))) or '(none)'}; "
                         f"known: {','.join(SECTIONS)}")
    if os.path.exists(args.out) and not os.path.isdir(args.out):
        raise UsageError(f"--out {args.out!r} exists and is not a directory")
    check_writable(args.out)  # before any section spends GPU time on what it could not keep
    args.sections, args.argv = tuple(s for s in SECTIONS if s in wanted), argv
    return args


def kernel_device(dry_run: bool) -> str | None:
    """"cuda" where the kernels run compiled; else, for a dry run, "cpu" in Triton's interpreter
    (chosen here if need be: LabError if triton was imported first, or is not installed); else
    None, no GPU."""
    from . import backend  # torch loads here, after the arguments are checked
    device = backend.kernel_device()
    if device != "cuda" and not dry_run:
        return None
    if device is None:  # no GPU, interpreter not chosen yet: the kernels run in it
        backend.use_interpreter()
    return device or "cpu"


def main(argv=None) -> int:
    try:
        args = parse_args(argv)
        from .backend import TRITON_MISSING, triton_installed, triton_too_old  # torch loads here, after the arguments
        if not triton_installed():  # macOS, Windows: every section runs the lab's Triton kernels
            print(f"gpu_check: skipped: {TRITON_MISSING}", flush=True)
            return 0 if args.dry_run else 2
        if too_old := triton_too_old():
            raise UsageError(too_old)
        device = kernel_device(args.dry_run)
    except (UsageError, LabError) as err:
        print(f"gpu_check: error: {err}", file=sys.stderr)
        return 2
    if device is None:
        print(NO_GPU, file=sys.stderr)
        return 2
    from .backend import choose_device, device_name  # loaded by kernel_device already
    datasheet = preset_for_device_name(device_name(device)) if device == "cuda" else None
    dtype = choose_device("cuda").compute_dtype if device == "cuda" else KERNEL_DTYPE[device]
    run = Run(args, device, dtype, GPU_CHECK_DRY if args.dry_run else GPU_CHECK_FULL,
              Budget(args.budget_s, args.sections), datasheet)
    if device == "cuda" and dtype != KERNEL_DTYPE["cuda"]:
        run.results["kernel_dtype_note"] = choose_device("cuda").reason
    if args.dry_run:
        print(json.dumps({"full_run_autotuning": autotune_estimate(GPU_CHECK_FULL, DEFAULT_BUDGET_S)}), flush=True)
    if not run_sections(run):
        return 2
    print(json.dumps(summary(run)), flush=True)
    return 0 if run.results.get("correctness_passed", True) else 1


def run_sections(run: Run) -> bool:
    """Each section in turn, its recording written as it ends; False if --out is unwritable."""
    for section in run.args.sections:
        run.budget.section, run.budget.last_step_s = section, 0.0
        try:
            body = SECTION_FUNCTIONS[section](run)
        except Exception as err:  # noqa: BLE001 - recorded; the next sections still run
            run.log(f"ERROR {error_line(err)}")
            body = {"error": error_line(err)}
            run.results.setdefault("section_errors", {})[section] = body["error"]
        try:
            write_section(run, section, body)
        except OSError as err:  # --out unwritable: nothing can be kept, so stop
            print(f"gpu_check: error: could not write the {section} recording: {err}", file=sys.stderr)
            return False
    return True


def summary(run: Run) -> dict:
    """The final line: how it went, where, and the headline numbers of every section."""
    passed = run.results.get("correctness_passed", True)
    not_run = run.results.get("correctness_not_run") or {}
    status = "correctness failed" if not passed else "ok" if not not_run else \
        f"ok, but not run: {'; '.join(f'{step} ({why})' for step, why in not_run.items())}"
    return {"gpu_check": status, "dry_run": run.args.dry_run, "device": run.device,
            "datasheet": run.datasheet.name if run.datasheet else None, "budget_s": run.args.budget_s,
            "wall_s": round(time.perf_counter() - run.budget.start_s, 1), **run.results,
            "recordings": run.recordings}


if __name__ == "__main__":
    raise SystemExit(main())
