"""labkit.cgroups: the CPU and memory limits on this process's cgroups, read from a fake cgroup
tree (v2, v1, and v1 beside v2's unified hierarchy), at every level from its own cgroup up."""
import pytest

from labkit import cgroups


def tree(tmp_path, lines, files):
    """A fake /proc/self/cgroup (`lines`) and cgroup mount (`files`: path under it -> text)."""
    tmp_path.mkdir(parents=True, exist_ok=True)
    (tmp_path / "self").write_text("\n".join(lines) + "\n")
    for path, text in files.items():
        (tmp_path / "root" / path).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / "root" / path).write_text(text + "\n")
    return tmp_path / "root", tmp_path / "self"


def test_v2_limits_on_a_learners_service_and_its_slice_are_all_read(tmp_path):
    """TLJH-style: the learner's server runs in hub.slice/jupyter-ada.service; the service is
    capped at 2.5 CPUs and 4 GiB, the slice at 4 CPUs; the root has no limits."""
    root, me = tree(tmp_path, ["0::/hub.slice/jupyter-ada.service"], {
        "cgroup.controllers": "cpu memory", "cpu.max": "max 100000",
        "hub.slice/cpu.max": "400000 100000", "hub.slice/memory.max": "max",
        "hub.slice/jupyter-ada.service/cpu.max": "250000 100000",
        "hub.slice/jupyter-ada.service/memory.max": str(4 << 30),
        "hub.slice/jupyter-ada.service/memory.current": str(1 << 30)})
    assert sorted(cgroups.cpu_limits(root, me)) == [(250000.0, 100000.0), (400000.0, 100000.0)]
    assert cgroups.memory_limits(root, me) == [(4 << 30, 1 << 30)]


def test_v1_quotas_and_limits_and_their_no_limit_values(tmp_path):
    """A Docker container seen from the host's hierarchies: 3 CPUs of quota and 2 GiB on its own
    cgroups; -1 and v1's near-2^63 "no limit" above it count as none."""
    root, me = tree(tmp_path, ["4:memory:/docker/abc", "2:cpu,cpuacct:/docker/abc", "0::/"], {
        "unified/cgroup.controllers": "", "cpu,cpuacct/cpu.cfs_quota_us": "-1",
        "cpu,cpuacct/cpu.cfs_period_us": "100000",
        "cpu,cpuacct/docker/abc/cpu.cfs_quota_us": "300000", "cpu,cpuacct/docker/abc/cpu.cfs_period_us": "100000",
        "memory/memory.limit_in_bytes": "9223372036854771712",
        "memory/docker/abc/memory.limit_in_bytes": str(2 << 30),
        "memory/docker/abc/memory.usage_in_bytes": str(300 << 20)})
    assert cgroups.cpu_limits(root, me) == [(300000.0, 100000.0)]
    assert cgroups.memory_limits(root, me) == [(2 << 30, 300 << 20)]


def test_memory_in_use_leaves_out_the_page_cache_the_kernel_would_drop(tmp_path):
    """A learner's cgroup is charged for the files their lessons read; the inactive ones are
    dropped before the limit refuses anything, so they do not count as in use (v2's
    inactive_file; v1's total_inactive_file, which like usage_in_bytes counts the cgroups below)."""
    v2_root, v2_me = tree(tmp_path / "v2", ["0::/jupyter-ada.service"], {
        "cgroup.controllers": "cpu memory", "jupyter-ada.service/memory.max": str(4 << 30),
        "jupyter-ada.service/memory.current": str(3 << 30),
        "jupyter-ada.service/memory.stat": f"anon {2 << 30}\nfile {1 << 30}\nactive_file {600 << 20}\n"
                                           f"inactive_file {424 << 20}"})
    assert cgroups.memory_limits(v2_root, v2_me) == [(4 << 30, (3 << 30) - (424 << 20))]
    v1_root, v1_me = tree(tmp_path / "v1", ["4:memory:/workshop/ada"], {
        "memory/workshop/ada/memory.limit_in_bytes": str(4 << 30),
        "memory/workshop/ada/memory.usage_in_bytes": str(3 << 30),
        "memory/workshop/ada/memory.stat": f"inactive_file {1 << 20}\ntotal_inactive_file {400 << 20}"})
    assert cgroups.memory_limits(v1_root, v1_me) == [(4 << 30, (3 << 30) - (400 << 20))]


def test_no_cgroups_no_limits(tmp_path):
    """macOS and Windows have no /proc/self/cgroup; an unlimited v2 root says "max"."""
    assert cgroups.cpu_limits(tmp_path / "none", tmp_path / "no-self") == []
    assert cgroups.memory_limits(tmp_path / "none", tmp_path / "no-self") == []
    root, me = tree(tmp_path, ["0::/"], {"cgroup.controllers": "cpu memory", "cpu.max": "max 100000"})
    assert cgroups.cpu_limits(root, me) == [] and cgroups.memory_limits(root, me) == []


@pytest.mark.skipif(not cgroups.SELF.exists(), reason="no cgroups on this OS")
def test_this_machine_s_cgroup_folders_exist_and_its_limits_read():
    """On Linux the process's own cgroup folders are found (its own first, then those above it)
    and whatever limits they hold read as positive numbers."""
    folders = cgroups.own_folders("memory") + cgroups.own_folders("cpu")
    assert folders and all(folder.is_dir() and version in (1, 2) for folder, version in folders)
    assert all(quota > 0 and period > 0 for quota, period in cgroups.cpu_limits())
    assert all(limit > 0 for limit, _ in cgroups.memory_limits())
