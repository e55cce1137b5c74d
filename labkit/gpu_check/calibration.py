"""The GPU check's first section: where it runs (provenance) and the roofs it compares with, the
datasheet's (labkit.specs, when the device has a preset) and this machine's measured one
(labkit.calibrate), so every later timing can be read as a fraction of both."""
from __future__ import annotations

import dataclasses

from .. import roofline
from ..units import format_rate
from .run import Run, command, run_steps


def calibration_section(run: Run) -> dict:
    from .. import calibrate
    from ..recordings import provenance
    p = provenance(run.device, command(run.args))
    run.log(f"{p['device_name']}, driver {p['driver']}, torch {p['torch']}, triton {p['triton']}, {p['date']}")
    ds = run.datasheet
    if ds:
        run.log(f"datasheet {ds.name}: {format_rate(ds.bf16_flops_per_s, 'FLOP/s')} bf16, "
                f"{format_rate(ds.memory_bandwidth_bytes_per_s, 'B/s')}, "
                f"ridge {roofline.ridge_point_flops_per_byte(ds):.0f} FLOP/byte")
    else:
        run.log("datasheet: none for this device in labkit.specs; fractions are of the calibration")

    def measure():  # measured afresh on a GPU (and cached for the sweeps); a dry run takes the cache
        run.calibrated, info = calibrate.load_or_calibrate(run.device, refresh=not run.args.dry_run, log=run.log)
        peak = getattr(run.calibrated, f"{run.dtype}_flops_per_s")
        run.log(f"calibrated: {format_rate(peak or 0, 'FLOP/s')} {run.dtype}, "
                f"{format_rate(run.calibrated.memory_bandwidth_bytes_per_s, 'B/s')}")
        return {"calibrated": dataclasses.asdict(run.calibrated), "calibration": info}

    return {"datasheet": dataclasses.asdict(ds) if ds else None, "steps": run_steps(run, [("calibrate", measure)])}
