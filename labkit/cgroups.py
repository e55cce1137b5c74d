"""What this process's control groups (Linux cgroups) allow it: CPU time and memory.

Stdlib only. Why it exists: a container, or a hub that gives each learner a server of their own
(TLJH's systemd services, DockerSpawner, KubeSpawner), limits a learner by a cgroup, which
/proc/meminfo and the CPU count do not show. A limit may sit on the process's own cgroup or any
above it (a service inside a slice), so every level is read and the tightest counts:

    cpu_limits()          # [(250000.0, 100000.0)]: 2.5 CPUs of time per period (`cpu_info.usable_cores`)
    memory_limits()       # [(4294967296, 1073741824)]: (limit, in use) bytes a level (`backend`'s free memory)

cgroup v2 (one hierarchy; /proc/self/cgroup says "0::/path"): cpu.max ("max 100000" or
"250000 100000"), memory.max ("max" or bytes), memory.current and memory.stat. cgroup v1 (a
hierarchy a controller): cpu.cfs_quota_us (-1: none) over cpu.cfs_period_us,
memory.limit_in_bytes (a number near 2^63: none), memory.usage_in_bytes and memory.stat. In a
container with its own cgroup namespace the process's path is "/" and its limits are the root's
files.
"""
from __future__ import annotations

from pathlib import Path

ROOT = Path("/sys/fs/cgroup")
SELF = Path("/proc/self/cgroup")
UNLIMITED_V1_BYTES = 1 << 60  # v1 writes "no limit" as the largest page-aligned 63-bit number


def own_folders(controller: str, root: Path = ROOT, self_cgroup: Path = SELF) -> list[tuple[Path, int]]:
    """(folder, cgroup version) of this process's cgroup for `controller` ("cpu", "memory") and of
    each cgroup above it, its own first; empty where there are no cgroups (macOS, Windows)."""
    try:
        lines = self_cgroup.read_text().splitlines()
    except OSError:
        return []
    folders = []
    for line in lines:
        _, hierarchy, path = (line.split(":", 2) + ["", ""])[:3]
        if hierarchy == "":  # cgroup v2: one hierarchy, mounted at the root (or, beside v1, at unified/)
            bases = [base for base in (root, root / "unified") if (base / "cgroup.controllers").exists()]
            version = 2
        elif controller in hierarchy.split(","):
            bases = [root / name for name in (hierarchy, controller) if (root / name).is_dir()]  # "cpu,cpuacct" or its link "cpu"
            version = 1
        else:
            continue
        if not bases:
            continue
        folder = bases[0] / path.strip().strip("/")
        folders += [(here, version) for here in (folder, *folder.parents) if here.is_relative_to(bases[0])]
    return folders


def cpu_limits(root: Path = ROOT, self_cgroup: Path = SELF) -> list[tuple[float, float]]:
    """(quota, period) of every CPU-time limit on this process's cgroups (none for "no limit")."""
    limits = []
    for folder, version in own_folders("cpu", root, self_cgroup):
        if version == 2:
            fields = _first_line(folder / "cpu.max").split()
            if len(fields) == 2 and fields[0].isdigit() and fields[1].isdigit():  # "max 100000": none
                limits.append((float(fields[0]), float(fields[1])))
        else:
            quota, period = _first_line(folder / "cpu.cfs_quota_us"), _first_line(folder / "cpu.cfs_period_us")
            if quota.isdigit() and period.isdigit() and int(quota) > 0:  # "-1": none
                limits.append((float(quota), float(period)))
    return limits


def memory_limits(root: Path = ROOT, self_cgroup: Path = SELF) -> list[tuple[int, int | None]]:
    """(limit, bytes in use or None) of every memory limit on this process's cgroups. In use: the
    cgroup's charge less its inactive file pages (memory.stat's inactive_file, v1's
    total_inactive_file), the page cache the kernel drops before it refuses memory, as `docker
    stats` and the kubelet count it. Why: a learner's cgroup is charged for every file their
    lessons read (the libraries, the traces); under a 4 GiB limit that cache reached 0.4 GB, and
    with it counted the lab refused a 16 MiB cache that the kernel would have made room for."""
    names = {2: ("memory.max", "memory.current", "inactive_file"),
             1: ("memory.limit_in_bytes", "memory.usage_in_bytes", "total_inactive_file")}
    limits = []
    for folder, version in own_folders("memory", root, self_cgroup):
        limit_name, used_name, inactive_name = names[version]
        limit, used = _first_line(folder / limit_name), _first_line(folder / used_name)
        if limit.isdigit() and int(limit) < UNLIMITED_V1_BYTES:  # v2's "max": none
            in_use = max(int(used) - _stat(folder, inactive_name), 0) if used.isdigit() else None
            limits.append((int(limit), in_use))
    return limits


def _stat(folder: Path, name: str) -> int:
    """One counter of the cgroup's memory.stat ("name value" lines), 0 where absent."""
    try:
        for line in (folder / "memory.stat").read_text().splitlines():
            key, _, value = line.partition(" ")
            if key == name and value.strip().isdigit():
                return int(value)
    except OSError:
        pass
    return 0


def _first_line(path: Path) -> str:
    try:
        return path.read_text().split("\n", 1)[0].strip()
    except OSError:
        return ""
