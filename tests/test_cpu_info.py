"""labkit.cpu_info: cache sizes as the OS reports them (a fake sysfs here), a stated fallback,
the CPU's identity, its last boot and its busy time."""
from datetime import datetime, timezone

import pytest

from labkit import cpu_info


def _index(root, cpu, index, level, kind, size, shared):
    d = root / f"cpu{cpu}" / "cache" / f"index{index}"
    d.mkdir(parents=True)
    for name, value in (("level", level), ("type", kind), ("size", size), ("shared_cpu_list", shared)):
        (d / name).write_text(f"{value}\n")


def test_sizes_parse_as_sysfs_and_lscpu_write_them():
    assert cpu_info.parse_size("48K") == 48 * 2**10 and cpu_info.parse_size("491520K") == 480 * 2**20
    assert cpu_info.parse_size("32 MiB") == 32 * 2**20 and cpu_info.parse_size("1M") == 2**20
    with pytest.raises(ValueError):
        cpu_info.parse_size("lots")


def test_per_core_levels_count_once_per_core_and_shared_ones_once(tmp_path):
    """Two cores, each with its own 2 MiB L2 and a 48 KiB L1d, sharing a 480 MiB L3: all cores
    together hold 4 MiB in L2 and 480 MiB in L3; instruction caches and L1 are not levels here."""
    for cpu in (0, 1):
        _index(tmp_path, cpu, 0, 1, "Data", "48K", cpu)
        _index(tmp_path, cpu, 1, 1, "Instruction", "64K", cpu)
        _index(tmp_path, cpu, 2, 2, "Unified", "2048K", cpu)
        _index(tmp_path, cpu, 3, 3, "Unified", "491520K", "0-1")
    caches = cpu_info._from_sysfs({0, 1}, tmp_path)
    assert caches.as_pairs() == (("L2", 4 * 2**20), ("L3", 480 * 2**20))
    assert [lv.instances for lv in caches.levels] == [2, 1] and caches.last_level_bytes == 480 * 2**20
    assert caches.describe().startswith("L2 4 MiB (2 instances), L3 480 MiB (1 instance), from Linux sysfs")
    assert cpu_info._from_sysfs({0}, tmp_path).as_pairs() == (("L2", 2 * 2**20), ("L3", 480 * 2**20))  # one core's share
    assert cpu_info._from_sysfs({0, 1}, tmp_path / "missing") is None


def test_where_the_os_reports_nothing_the_assumption_is_stated(monkeypatch):
    for reader in ("_from_sysfs", "_from_sysctl", "_from_sysconf"):
        monkeypatch.setattr(cpu_info, reader, lambda cpus: None)
    caches = cpu_info.cpu_caches({0, 1})
    assert caches.last_level_bytes == cpu_info.FALLBACK_LAST_LEVEL_BYTES
    assert caches.source.startswith("assumed: the OS reports no cache sizes here")


def test_this_machine_is_described():
    caches = cpu_info.cpu_caches()
    assert caches.levels and all(size > 0 for _, size in caches.as_pairs())
    assert cpu_info.cpu_identity() and ":" in cpu_info.cpu_identity() or cpu_info.cpu_identity()
    booted = cpu_info.last_boot()
    assert booted is None or booted <= datetime.now(timezone.utc)
    first = cpu_info.cpu_busy_s()
    assert first is None or 0 < first <= cpu_info.cpu_busy_s()


# ------------------------------------------------------------------ laptops and ARM (issue 16)
def test_on_apple_silicon_the_caches_and_the_name_come_from_sysctl(monkeypatch):
    """An M2 (as `sysctl` reports it): 4 performance cores share each 16 MiB L2, and there is no
    L3 the OS names. No /proc, no sysfs: sysctl answers, and the brand string names the CPU."""
    answers = {"hw.perflevel0.l2cachesize": "16777216", "hw.perflevel0.cpusperl2": "4", "hw.l2cachesize": "4194304",
               "machdep.cpu.brand_string": "Apple M2", "kern.boottime": "{ sec = 1764547200, usec = 0 } Mon Dec  1"}
    monkeypatch.setattr(cpu_info.platform, "system", lambda: "Darwin")
    monkeypatch.setattr(cpu_info, "run_command", lambda args: answers.get(args[-1]) if args[:2] == ["sysctl", "-n"] else None)
    monkeypatch.setattr(cpu_info, "_from_sysfs", lambda cpus: None)
    monkeypatch.setattr(cpu_info, "Path", lambda path: _Missing())  # no /proc/cpuinfo, no /proc/stat
    caches = cpu_info.cpu_caches(set(range(8)))
    assert caches.as_pairs() == (("L2", 32 * 2**20),) and caches.levels[0].instances == 2
    assert caches.source == "from macOS sysctl (hw.*cachesize)"
    assert cpu_info.cpu_identity() == "Apple M2"
    assert cpu_info.last_boot() == datetime(2025, 12, 1, tzinfo=timezone.utc)


class _Missing:
    """A path that does not exist: what /proc/cpuinfo and /proc/stat are on macOS."""

    def read_text(self):
        raise FileNotFoundError("no /proc on macOS")


def test_an_arm_linux_cpu_is_named_by_implementer_and_part(monkeypatch):
    """A Graviton's /proc/cpuinfo has no vendor_id nor model name: implementer and part say which CPU."""
    text = ("processor\t: 0\nBogoMIPS\t: 243.75\nFeatures\t: fp asimd evtstrm aes\nCPU implementer\t: 0x41\n"
            "CPU architecture: 8\nCPU variant\t: 0x1\nCPU part\t: 0xd40\nCPU revision\t: 1\n\n")

    class Fake:
        def __init__(self, path):
            self.path = str(path)

        def read_text(self):
            if self.path == "/proc/cpuinfo":
                return text
            raise FileNotFoundError(self.path)
    monkeypatch.setattr(cpu_info, "Path", Fake)
    monkeypatch.setattr(cpu_info.platform, "machine", lambda: "aarch64")
    assert cpu_info.cpu_identity() == "CPU implementer 0x41 CPU part 0xd40 CPU variant 0x1: aarch64"


def test_usable_cores_are_the_affinity_mask_capped_by_the_tightest_cpu_quota(monkeypatch):
    """16 CPUs in the mask; quotas of 2.5 and 4 CPUs on the cgroups: 2 cores (rounded down); none:
    the mask; half a CPU: 1."""
    monkeypatch.setattr(cpu_info, "_usable_cpus", lambda: set(range(16)))
    for limits, cores in (([(250000.0, 100000.0), (400000.0, 100000.0)], 2), ([], 16), ([(50000.0, 100000.0)], 1)):
        monkeypatch.setattr(cpu_info.cgroups, "cpu_limits", lambda *args, limits=limits: limits)
        assert cpu_info.usable_cores() == cores


@pytest.mark.skipif(not hasattr(__import__("os"), "sched_setaffinity"), reason="no affinity call on this OS")
def test_a_process_allowed_one_cpu_runs_one_thread_in_every_pool():
    """Under `taskset` to one CPU, labkit's import sizes torch's, numba's and OpenBLAS's pools and
    the products' workers to it, where numba alone would start a thread per CPU the OS lists."""
    import json
    import os
    import subprocess
    import sys
    code = ("import labkit, torch, numba; from labkit import cpu_blas; import json; "
            "print(json.dumps([torch.get_num_threads(), numba.get_num_threads(), cpu_blas.CORES]))")
    env = {k: v for k, v in os.environ.items() if not k.endswith("_NUM_THREADS")}
    first = sorted(os.sched_getaffinity(0))[0]
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, check=True,
                         preexec_fn=lambda: os.sched_setaffinity(0, {first}), timeout=120)
    assert json.loads(out.stdout.strip().splitlines()[-1]) == [1, 1, 1]


def test_busy_time_is_read_for_all_cores_or_for_the_cores_of_a_mask(tmp_path):
    """/proc/stat's fields (user nice system idle iowait irq softirq steal) in clock ticks: the
    busy time leaves idle and iowait out; a mask counts its own cores' lines only."""
    import os
    tick = os.sysconf("SC_CLK_TCK")
    stat = tmp_path / "stat"
    stat.write_text("cpu  30 0 10 500 7 1 1 2 0 0\ncpu0 10 0 5 250 3 0 1 0 0 0\ncpu1 20 0 5 250 4 1 0 2 0 0\nintr 1\n")
    assert cpu_info.cpu_busy_s(stat=str(stat)) == 44 / tick
    assert cpu_info.cpu_busy_s({1}, str(stat)) == 28 / tick and cpu_info.cpu_busy_s({0}, str(stat)) == 16 / tick
    assert cpu_info.cpu_busy_s(stat=str(tmp_path / "none")) is None


def test_a_process_held_to_some_cores_counts_only_their_load(monkeypatch):
    """A learner held to CPU 3 of 8 (a cpuset): the others' load is read on CPU 3 alone and shared
    over that one core; without a mask, over all eight."""
    asked, busy = [], iter([100.0, 100.5])
    monkeypatch.setattr(cpu_info.os, "cpu_count", lambda: 8)
    monkeypatch.setattr(cpu_info, "_usable_cpus", lambda: {3})
    monkeypatch.setattr(cpu_info, "cpu_busy_s", lambda cpus=None: asked.append(cpus) or next(busy))
    monkeypatch.setattr(cpu_info.time, "monotonic", iter([0.0, 1.0]).__next__)
    monkeypatch.setattr(cpu_info.os, "times", lambda: type("T", (), {"user": 0.0, "system": 0.0})())
    start = cpu_info.load_snapshot()
    assert cpu_info.others_busy_share(start) == 0.5 and asked == [{3}, {3}]
    monkeypatch.setattr(cpu_info, "_usable_cpus", lambda: set(range(8)))
    assert cpu_info._counted_cpus() is None


def test_under_a_cpu_quota_only_the_others_load_past_the_idle_cores_it_needs_counts(monkeypatch):
    """A learner with 2 CPUs of time on 8 cores: others busy on 5 cores leave 3 idle, so nothing
    is taken from it; on 7, one of its 2 cores' worth (0.5). Without a quota, 7 of 8 cores."""
    monkeypatch.setattr(cpu_info.os, "cpu_count", lambda: 8)
    monkeypatch.setattr(cpu_info, "_usable_cpus", lambda: set(range(8)))
    monkeypatch.setattr(cpu_info.os, "times", lambda: type("T", (), {"user": 0.0, "system": 0.0})())
    for usable, others, share in ((2, 5.0, 0.0), (2, 7.0, 0.5), (8, 7.0, 7 / 8)):
        monkeypatch.setattr(cpu_info, "usable_cores", lambda usable=usable: usable)
        readings = iter([100.0, 100.0 + others])
        monkeypatch.setattr(cpu_info, "cpu_busy_s", lambda cpus=None, readings=readings: next(readings))
        monkeypatch.setattr(cpu_info.time, "monotonic", iter([0.0, 1.0]).__next__)
        assert cpu_info.others_busy_share(cpu_info.load_snapshot()) == share


def test_a_cpu_quota_counts_only_the_cache_instances_its_threads_can_fill(tmp_path, monkeypatch):
    """8 cores, a 1 MiB L2 each, an L3 of 32 MiB per pair of cores (4 instances): 2 threads (a
    quota of 2 CPUs, every core in the mask) can fill 2 L2s and 2 L3 instances, 2 MiB and 64 MiB;
    with a thread a core (no quota) every instance counts."""
    for cpu in range(8):
        _index(tmp_path, cpu, 0, 2, "Unified", "1024K", cpu)
        _index(tmp_path, cpu, 1, 3, "Unified", "32768K", f"{cpu // 2 * 2}-{cpu // 2 * 2 + 1}")
    whole = cpu_info._from_sysfs(set(range(8)), tmp_path)
    assert whole.as_pairs() == (("L2", 8 * 2**20), ("L3", 128 * 2**20))
    held = cpu_info.held_by(whole, 2)
    assert held.as_pairs() == (("L2", 2 * 2**20), ("L3", 64 * 2**20)) and held.levels[1].instances == 2
    assert held.source.endswith("as 2 threads can fill them (a CPU quota)")
    monkeypatch.setattr(cpu_info, "_from_sysfs", lambda cpus: whole)
    monkeypatch.setattr(cpu_info, "_usable_cpus", lambda: set(range(8)))
    monkeypatch.setattr(cpu_info, "usable_cores", lambda: 2)
    assert cpu_info.cpu_caches().as_pairs() == held.as_pairs()
    monkeypatch.setattr(cpu_info, "usable_cores", lambda: 8)
    assert cpu_info.cpu_caches() == whole
