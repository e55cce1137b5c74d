"""What the operating system says about this CPU: its model, its cache levels, its last boot.

Stdlib only, no torch: `calibrate` asks it how far the bandwidth sweep must go (past the
last-level cache) and whether a cached calibration still describes this machine.

    caches = cpu_caches()        # CacheLevels: L2 4 MiB (2 instances), L3 480 MiB (1 instance)
    caches.last_level_bytes      # 503,316,480
    cpu_identity()               # "vendor_id GenuineIntel cpu family 6 model 167 stepping 1: Intel(R) Xeon(R) Processor"
    cpu_vendor()                 # "GenuineIntel" ("" where the OS names none: macOS, some ARM boards)
    last_boot()                  # datetime of the last boot, or None where the OS does not say
    cpu_busy_s()                 # CPU seconds all processes used since boot (two readings: the load)

A cache level's `bytes` is what all the cores this process may run on hold together: a per-core
L2 counts once per core, a shared L3 once. That is the working set an all-core read keeps in
that level. Under a CPU quota (fewer threads than cores: `usable_cores`), only the instances that
many threads can fill count (`held_by`). Where each size comes from, in order:

  1. Linux sysfs, /sys/devices/system/cpu/cpu*/cache/index*/{level,type,size,shared_cpu_list}
     (x86 and most ARM servers): sizes and which cores share each instance;
  2. macOS, `sysctl hw.perflevel0.l2cachesize` / `hw.l2cachesize` / `hw.l3cachesize` (Apple
     silicon reports no L3; its system-level cache is not an OS-visible level);
  3. glibc's sysconf(_SC_LEVEL2_CACHE_SIZE / _SC_LEVEL3_CACHE_SIZE), assuming a private L2 per
     core and one shared L3;
  4. nothing reported (some ARM kernels, containers hiding /sys): FALLBACK_LAST_LEVEL_BYTES,
     stated as an assumption in `source`, so a calibration sweeps far enough anyway.
"""
from __future__ import annotations

import itertools
import os
import platform
import re
import subprocess
import time
from dataclasses import dataclass
from datetime import datetime, timezone
from pathlib import Path

from . import cgroups

SYSFS = Path("/sys/devices/system/cpu")
# The assumption where the OS reports no cache: 32 MiB is a common desktop and laptop
# last-level cache; a calibration still sweeps to 4x it, past where most machines' caches end.
FALLBACK_LAST_LEVEL_BYTES = 32 * 2**20
_UNITS = {"": 1, "K": 2**10, "M": 2**20, "G": 2**30}


@dataclass(frozen=True)
class CacheLevel:
    """One data (or unified) cache level as all the usable cores see it."""

    name: str  # "L2"
    bytes: int  # all its instances among the usable cores together
    instances: int  # a per-core cache has one per core, a shared one a single instance


@dataclass(frozen=True)
class CacheLevels:
    """The levels smallest first, and where the sizes came from (an assumption says so)."""

    levels: tuple[CacheLevel, ...]
    source: str

    @property
    def last_level_bytes(self) -> int:
        return self.levels[-1].bytes if self.levels else FALLBACK_LAST_LEVEL_BYTES

    def as_pairs(self) -> tuple[tuple[str, int], ...]:
        """((name, bytes), ...) smallest first: the form `specs.HardwareSpec.cache_levels` keeps."""
        return tuple((level.name, level.bytes) for level in self.levels)

    def describe(self) -> str:
        """"L2 4 MiB (2 instances), L3 480 MiB (1 instance), from Linux sysfs (...)"."""
        parts = [f"{lv.name} {_mib(lv.bytes)} ({lv.instances} instance{'s' if lv.instances > 1 else ''})"
                 for lv in self.levels]
        return f"{', '.join(parts) or 'no cache level reported'}, {self.source}"


def cpu_caches(cpus: set[int] | None = None, threads: int | None = None) -> CacheLevels:
    """The L2 and larger cache levels of the cores in `cpus` (default: those this process may
    run on), from the first source in the module docstring that reports any; where fewer
    `threads` run than there are cores (default `usable_cores`: a cgroup's CPU quota), as that
    many threads can hold them (`held_by`)."""
    threads = usable_cores() if threads is None and cpus is None else threads
    cpus = _usable_cpus() if cpus is None else set(cpus)
    for reader in (_from_sysfs, _from_sysctl, _from_sysconf):
        found = reader(cpus)
        if found is not None and found.levels:
            return held_by(found, threads) if threads is not None and threads < len(cpus) else found
    return CacheLevels((CacheLevel("LLC", FALLBACK_LAST_LEVEL_BYTES, 1),),
                       f"assumed: the OS reports no cache sizes here; a {_mib(FALLBACK_LAST_LEVEL_BYTES)} "
                       "last-level cache assumed")


def held_by(caches: CacheLevels, threads: int) -> CacheLevels:
    """`caches` as `threads` threads can fill them: a level's instances beyond one a thread are
    not theirs to fill. Why: a learner held to 2 CPUs of time (a cgroup quota, no cpuset) on a
    96-core EPYC with 1,152 MiB of L3 in 12 instances runs its reads on 2 threads, which reach 2
    of those instances (192 MiB) at most; counted whole, the calibration's sweep would reach 4x
    1,152 MiB, past a learner's memory limit, to find a DRAM rate the lab's working sets meet far
    sooner."""
    levels = tuple(CacheLevel(level.name, level.bytes * min(level.instances, threads) // level.instances,
                              min(level.instances, threads)) for level in caches.levels)
    return CacheLevels(levels, f"{caches.source}, as {threads} thread{'s' if threads != 1 else ''} "
                               "can fill them (a CPU quota)")


def parse_size(text: str) -> int:
    """sysfs and lscpu sizes: "48K", "2048K", "491520K", "1M", "32 MiB" -> bytes."""
    match = re.fullmatch(r"\s*(\d+)\s*([KMG]?)(?:i?B)?\s*", text, re.IGNORECASE)
    if not match:
        raise ValueError(f"not a cache size: {text!r}")
    return int(match.group(1)) * _UNITS[match.group(2).upper()]


def _from_sysfs(cpus: set[int], root: Path = SYSFS) -> CacheLevels | None:
    instances: dict[tuple[int, str], int] = {}  # (level, shared cpu list) -> size of that instance
    for cpu in sorted(cpus):
        for index in sorted((root / f"cpu{cpu}" / "cache").glob("index*")):
            try:
                level = int((index / "level").read_text())
                kind = (index / "type").read_text().strip()
                size = parse_size((index / "size").read_text())
                shared = (index / "shared_cpu_list").read_text().strip() if (index / "shared_cpu_list").exists() else str(cpu)
            except (OSError, ValueError):
                continue
            if level >= 2 and kind in ("Data", "Unified") and size > 0:
                instances[(level, shared)] = size
    return _levels(instances, "from Linux sysfs (/sys/devices/system/cpu/*/cache)") if instances else None


def _from_sysctl(cpus: set[int]) -> CacheLevels | None:
    if platform.system() != "Darwin":
        return None
    values = {}
    for key in ("hw.perflevel0.l2cachesize", "hw.perflevel0.cpusperl2", "hw.l2cachesize", "hw.l3cachesize"):
        out = run_command(["sysctl", "-n", key])
        values[key] = int(out) if out and out.isdigit() else 0
    l2 = values["hw.perflevel0.l2cachesize"] or values["hw.l2cachesize"]
    per_l2 = values["hw.perflevel0.cpusperl2"] or len(cpus)
    levels = []
    if l2:  # one L2 per cluster of `per_l2` cores (the performance cores' clusters on Apple silicon)
        clusters = max(1, len(cpus) // max(per_l2, 1))
        levels.append(CacheLevel("L2", l2 * clusters, clusters))
    if values["hw.l3cachesize"]:
        levels.append(CacheLevel("L3", values["hw.l3cachesize"], 1))
    return CacheLevels(tuple(levels), "from macOS sysctl (hw.*cachesize)") if levels else None


def _from_sysconf(cpus: set[int]) -> CacheLevels | None:
    levels = []
    for name, key, instances in (("L2", "SC_LEVEL2_CACHE_SIZE", len(cpus)), ("L3", "SC_LEVEL3_CACHE_SIZE", 1)):
        try:
            size = os.sysconf(key)
        except (ValueError, OSError, AttributeError):
            continue
        if size and size > 0:
            levels.append(CacheLevel(name, int(size) * instances, instances))
    return CacheLevels(tuple(levels), "from glibc sysconf; assumed: a private L2 per core, one shared L3") if levels else None


def _levels(instances: dict[tuple[int, str], int], source: str) -> CacheLevels:
    by_level: dict[int, list[int]] = {}
    for (level, _shared), size in instances.items():
        by_level.setdefault(level, []).append(size)
    levels = tuple(CacheLevel(f"L{level}", sum(sizes), len(sizes)) for level, sizes in sorted(by_level.items()))
    return CacheLevels(levels, source)


def _usable_cpus() -> set[int]:
    try:
        return set(os.sched_getaffinity(0))
    except (AttributeError, OSError):  # macOS has no affinity call
        return set(range(os.cpu_count() or 1))


def usable_cores(cgroup_root: Path = cgroups.ROOT, self_cgroup: Path = cgroups.SELF) -> int:
    """How many cores this process may keep busy at once: the CPUs of its affinity mask (a
    `taskset`, a container's cpuset), fewer where a cgroup caps its CPU time (a container's
    `--cpus`, a hub's per-learner limit: `cgroups.cpu_limits`, the tightest), rounded down, at least 1.

    Why: torch's and numba's thread pools follow the mask but not a quota. Under a cgroup v1
    quota of one CPU on the 2-core EPYC VM, both started 2 threads, and the calibration's short
    figures, run in bursts the quota allows within each scheduler period, measured an fp32 peak
    of 212 GFLOP/s that the process cannot sustain; sized to one thread (labkit's import sets
    their variables from this), 109 GFLOP/s, and a decode point's roof fraction 0.62 against 0.42."""
    cores = len(_usable_cpus())
    for quota, period in cgroups.cpu_limits(cgroup_root, self_cgroup):
        if quota > 0 and period > 0:
            cores = min(cores, max(1, int(quota // period)))
    return max(1, cores)


def cpu_identity() -> str:
    """The CPU as precisely as the OS names it: vendor, family, model, stepping and model name
    from /proc/cpuinfo (a VM's "Intel(R) Xeon(R) Processor" alone names no generation), the
    brand string on macOS, else what `platform` says."""
    fields = {}
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            key, _, value = line.partition(":")
            fields.setdefault(key.strip(), value.strip())
            if not line.strip() and fields:
                break  # the first processor's block is enough
    except OSError:
        pass
    if "model name" in fields or "CPU part" in fields:
        ident = " ".join(f"{k} {fields[k]}" for k in ("vendor_id", "cpu family", "model", "stepping",
                                                          "CPU implementer", "CPU part", "CPU variant") if k in fields)
        return f"{ident}: {fields.get('model name', platform.machine())}"
    brand = run_command(["sysctl", "-n", "machdep.cpu.brand_string"]) if platform.system() == "Darwin" else None
    return brand or platform.processor() or platform.machine() or "unknown CPU"


def cpu_vendor() -> str:
    """The CPU's vendor string from /proc/cpuinfo ("GenuineIntel", "AuthenticAMD", ...), or ""
    where there is none (macOS, an ARM board without the field)."""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("vendor_id"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return ""


def last_boot() -> datetime | None:
    """When this machine last booted (UTC): /proc/stat's btime on Linux, kern.boottime on
    macOS; None where the OS does not say."""
    try:
        for line in Path("/proc/stat").read_text().splitlines():
            if line.startswith("btime "):
                return datetime.fromtimestamp(int(line.split()[1]), timezone.utc)
    except (OSError, ValueError, IndexError):
        pass
    out = run_command(["sysctl", "-n", "kern.boottime"]) if platform.system() == "Darwin" else None
    match = re.search(r"sec\s*=\s*(\d+)", out or "")
    return datetime.fromtimestamp(int(match.group(1)), timezone.utc) if match else None


def cpu_busy_s(cpus: set[int] | None = None, stat: str = "/proc/stat") -> float | None:
    """Seconds of CPU time all processes have used since boot, summed over cores (user, nice,
    system, irq, softirq, and steal: time the hypervisor gave this VM's cores to others), from
    /proc/stat: over every core, or over `cpus` only (their "cpuN" lines); None where the OS has
    no /proc/stat. Two readings bound the machine's load."""
    try:
        with open(stat) as file:  # the "cpu" lines come first; the rest (interrupts: long) is not read
            lines = list(itertools.takewhile(lambda line: line.startswith("cpu"), file))
    except OSError:
        return None
    wanted = {"cpu"} if cpus is None else {f"cpu{n}" for n in cpus}
    total = 0.0
    for line in lines:
        name, *values = line.split()
        if name not in wanted:
            continue
        try:
            user, nice, system, _idle, _iowait, irq, softirq, steal = (int(x) for x in values[:8])
        except ValueError:  # fewer than 8 fields, or not numbers
            return None
        total += user + nice + system + irq + softirq + steal
    return total / os.sysconf("SC_CLK_TCK")


def _counted_cpus() -> set[int] | None:
    """The CPUs whose load counts against this process: its affinity mask where that leaves some
    out (a container's cpuset, a hub's per-learner CPUs: the others' load is not on its cores),
    else None (every core)."""
    mask = _usable_cpus()
    return mask if len(mask) < (os.cpu_count() or 1) else None


def load_snapshot() -> tuple[float, float | None, float]:
    """(wall clock, CPU seconds of all processes on the counted cores, CPU seconds of this one) now."""
    own = os.times()
    return time.monotonic(), cpu_busy_s(_counted_cpus()), own.user + own.system


def others_busy_share(start: tuple, min_wall_s: float = 0.0) -> float | None:
    """The share of this process's cores (`usable_cores`) that other processes (and a VM's
    neighbours, through steal time) took from it since `start` (a `load_snapshot`), over at least
    `min_wall_s` of wall time: a confirmed figure can still be a busy machine's, when the load was
    steady. None where the OS does not say (no /proc/stat).

    The others' load is read on the cores this process may run on (`_counted_cpus`: its cpuset,
    else all); what of it fits on the cores it does not need (a CPU quota of 2 on a server of 64)
    takes nothing from it. So a learner held to 2 CPUs of time is disturbed only once the others
    leave fewer than 2 cores idle; without a quota, the others' share of all the cores."""
    end = load_snapshot()
    if start[1] is None or end[1] is None:
        return None
    wall_s = max(end[0] - start[0], min_wall_s, 1e-9)
    counted = _counted_cpus()
    cores = len(counted) if counted is not None else (os.cpu_count() or 1)
    mine = min(usable_cores(), cores)
    others = max(0.0, (end[1] - start[1]) - (end[2] - start[2])) / wall_s  # cores' worth of others' work
    return max(0.0, others - (cores - mine)) / mine


def run_command(args: list[str]) -> str | None:
    """A command's stripped stdout, or None if it is missing, fails or hangs (5 s)."""
    try:
        done = subprocess.run(args, capture_output=True, text=True, timeout=5, check=True)
    except (OSError, subprocess.SubprocessError):
        return None
    return done.stdout.strip() or None


def _mib(nbytes: int) -> str:
    return f"{nbytes / 2**20:,.0f} MiB" if nbytes >= 2**20 else f"{nbytes / 2**10:,.0f} KiB"
