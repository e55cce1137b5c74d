"""`python -m labkit.gpu_check`: the command around the sections. It parses the arguments (one
line and exit 2 for bad ones, before torch loads), picks where the kernels run (labkit.backend:
compiled on a GPU, or Triton's interpreter for a CPU dry run), runs the sections in turn under
one budget, keeps running past a section that raises, and ends with one JSON line.
"""
from __future__ import annotations

import json
import os
import sys
import time

from ..cli_args import Parser, UsageError
from ..errors import LabError
from .calibration import calibration_section
from .correctness import correctness_section
from .kernel_timing import kernels_section
from .model_sweeps import sweep_section
from .run import DRY, FULL, SECTIONS, Budget, Run, error_line, write_section

DESCRIPTION = "Check a GPU against the lab in one command: kernels correct, kernels fast, both phases measured."
# 7 minutes of steps: a step starts only if its section has time left, so each section can run
# over by its last step (prefill at 32k, with its autotuning, ~20 s), and the start (imports,
# CUDA context) comes first: the whole command stays inside the 8 minutes it is allowed.
DEFAULT_BUDGET_S = 420.0
NO_GPU = "no CUDA GPU: run with --dry-run, or on a GPU machine"
# The kernels' dtype: bf16 on a GPU, the dtype the chapter's peaks are quoted for; fp16 in
# Triton's interpreter, whose bf16 arithmetic is wrong (triton issue #11584).
KERNEL_DTYPE = {"cuda": "bf16", "cpu": "fp16"}
SECTION_FUNCTIONS = {"calibration": calibration_section, "correctness": correctness_section,
                     "kernels": kernels_section, "prefill_sweep": lambda run: sweep_section(run, "prefill"),
                     "decode_sweep": lambda run: sweep_section(run, "decode")}


def parse_args(argv=None):
    parser = Parser(prog="python -m labkit.gpu_check", description=DESCRIPTION)
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
    args.sections, args.argv = tuple(s for s in SECTIONS if s in wanted), argv
    return args


def kernel_device(dry_run: bool) -> str:
    """"cuda" where the kernels run compiled; else, for a dry run, "cpu" in Triton's interpreter
    (chosen here if need be); else UsageError. Imports torch, not triton."""
    from .. import backend
    device = backend.kernel_device()
    if device != "cuda" and not dry_run:
        raise UsageError(NO_GPU)
    if device is None:  # no GPU, interpreter not chosen yet: the kernels run in it
        backend.use_interpreter()
    return device or "cpu"


def main(argv=None) -> int:
    try:
        args = parse_args(argv)
    except UsageError as err:
        print(f"gpu_check: error: {err}", file=sys.stderr)
        return 2
    try:
        device = kernel_device(args.dry_run)
    except UsageError as err:
        print(str(err), file=sys.stderr)
        return 2
    except LabError as err:
        print(f"gpu_check: error: {err}", file=sys.stderr)
        return 2
    from ..backend import device_name
    from ..specs import preset_for_device_name
    datasheet = preset_for_device_name(device_name(device)) if device == "cuda" else None
    run = Run(args, device, KERNEL_DTYPE[device], DRY if args.dry_run else FULL,
              Budget(args.budget_s, args.sections), datasheet)
    for section in args.sections:
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
            return 2
    print(json.dumps(summary(run)), flush=True)
    return 0 if run.results.get("correctness_passed", True) else 1


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
