"""Numbers and names for people: seconds and rates with SI prefixes and three significant digits,
and a machine's name as a chart or a sentence shows it.

Pure (no torch, no numpy), so charts, status lines, the CLI and the GPU check format alike.
"""
from __future__ import annotations

import re


def format_seconds(seconds: float) -> str:
    """Seconds for display: "1.23 s", "12.1 ms", "45.0 µs"; nothing is "0 s", not "0.00 ns"."""
    if seconds == 0:
        return "0 s"
    if abs(seconds) >= 100:
        return f"{seconds:,.0f} s"
    for scale, unit in ((1.0, "s"), (1e-3, "ms"), (1e-6, "µs")):
        if abs(seconds) >= scale:
            return f"{_three_digits(seconds / scale)} {unit}"
    return f"{_three_digits(seconds / 1e-9)} ns"


def format_rate(value: float, unit: str) -> str:
    """A rate with an SI prefix: format_rate(3.35e12, "B/s") == "3.35 TB/s"; zero is "0 B", not
    "0.00 B" (lesson 04's cache at a context of 0 read as a figure cut short)."""
    if value == 0:
        return f"0 {unit}"
    for scale, prefix in ((1e18, "E"), (1e15, "P"), (1e12, "T"), (1e9, "G"), (1e6, "M"), (1e3, "k")):
        if abs(value) >= scale:
            return f"{_three_digits(value / scale)} {prefix}{unit}"
    return f"{_three_digits(value)} {unit}"


def format_bytes(nbytes: float, decimals: int | None = None) -> str:
    """Memory in binary units, as the OS and `free` show it: "12.3 GiB", "16 MiB", "512 KiB" (one
    decimal from a GiB up, none below); `decimals` fixes them for every unit ("14.96 GiB", the CLI's
    tables)."""
    for scale, unit in ((2**40, "TiB"), (2**30, "GiB"), (2**20, "MiB"), (2**10, "KiB")):
        if abs(nbytes) >= scale:
            places = decimals if decimals is not None else 1 if scale >= 2**30 else 0
            return f"{nbytes / scale:,.{places}f} {unit}"
    return f"{nbytes:,.0f} B"


def _three_digits(value: float) -> str:
    """Three significant digits, trailing zeros kept: 13.0, 9.40, 121."""
    decimals = 0 if abs(value) >= 100 else 1 if abs(value) >= 10 else 2
    return f"{value:.{decimals}f}"


def machine_name(name: str) -> str:
    """A CPU's or GPU's name as a learner reads it in a title, legend or sentence: without the
    trademarks, the CPU word and the clock that make a title wrap and tell nothing ("Intel(R)
    Xeon(R) Platinum 8481C CPU @ 2.70GHz" -> "Intel Xeon Platinum 8481C"). Records and provenance
    keep the full name (`backend.device_name`): it is what a calibration cache is matched by. "CPU"
    goes only before the clock and "Processor" only at the end: "a CPU" or "unknown CPU" stay."""
    name = re.sub(r"\((R|TM|tm)\)|(\sCPU)?\s@\s*[\d.]+\s*GHz|\sProcessor\s*$", " ", name)
    return " ".join(name.split()) or "unknown CPU"


def machine_of(record: dict) -> str:
    """The machine a measured point, breakdown or set of records names, as a learner reads it
    (`machine_name`); its device ("cpu", "cuda") where it names none."""
    return machine_name(record.get("device_name") or record.get("device") or "?")
