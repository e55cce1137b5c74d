"""labkit.calibrate at tiny sizes: what it measures, its provenance, and the cache's life cycle."""
import inspect
import json
import math
import os
import socket
from datetime import datetime, timedelta, timezone

import pytest
import torch

from labkit import backend, calibrate, cpu_info, measure, recordings, timing
from labkit.calibrate import Plan
from labkit.specs import HardwareSpec

TINY = Plan(4 * 2**20, {"fp32": (64, 128), "bf16": (32,), "fp16": (32,)}, warmup=1, repeats=3, budget_s=0.05)
MIB = 2**20


@pytest.fixture(autouse=True)
def tiny_and_isolated(monkeypatch, tmp_path):
    monkeypatch.setenv("LABKIT_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.setitem(calibrate.PLANS, "cpu", TINY)
    monkeypatch.setattr(calibrate, "_UNCACHED", {})


@pytest.fixture
def quiet(monkeypatch):
    """The cache's life cycle, on a machine taken as quiet: whether every figure of a tiny
    calibration is confirmed on a busy test machine is luck, and the noisy path has its own tests."""
    real = calibrate.calibrate
    monkeypatch.setattr(calibrate, "calibrate", lambda device, plan=None: (lambda s, i: (s, {**i, "noisy": []}))(
        *real(device, plan)))


@pytest.fixture(scope="module")
def measured():
    return calibrate.calibrate("cpu", TINY)


def test_calibration_is_a_calibrated_spec_of_this_machine(measured):
    spec, info = measured
    assert isinstance(spec, HardwareSpec) and spec.kind == "calibrated"
    assert spec.name == f"this machine: {backend.device_name('cpu')}"
    assert spec.fp32_flops_per_s > 0 and spec.bf16_flops_per_s > 0 and spec.fp16_flops_per_s > 0
    assert spec.fp8_flops_per_s is None and spec.int8_ops_per_s is None  # no such path on the CPU
    assert spec.memory_bytes == backend.total_memory_bytes("cpu")
    assert spec.cache_levels == cpu_info.cpu_caches().as_pairs() and spec.memory_name == "DRAM"


def test_every_number_says_it_was_measured_and_when(measured):
    spec, info = measured
    for field in ("fp32_flops_per_s", "bf16_flops_per_s", "memory_bandwidth_bytes_per_s", "bandwidth_by_working_set"):
        assert spec.sources[field].startswith(f"measured by labkit.calibrate on {info['date']}")
    assert spec.sources["fp8_flops_per_s"].startswith("not measured")
    assert spec.sources["cache_levels"] == cpu_info.cpu_caches().source


def test_the_roof_at_each_working_set_is_the_fastest_of_read_gemv_and_copy(measured):
    spec, info = measured
    curve = info["bandwidth_by_working_set"]
    assert len(curve) >= calibrate.MIN_POINTS and curve[-1]["bytes"] == TINY.stream_bytes
    assert [p["bytes"] for p in curve] == sorted(p["bytes"] for p in curve)
    for point in curve:
        tests = point["tests"]
        assert set(tests) == {"read", "gemv", "copy"}
        assert point["bytes_per_s"] == max(t["bytes_per_s"] for t in tests.values())
        assert tests[point["best"]]["bytes_per_s"] == point["bytes_per_s"] and point["noisy"] == tests[point["best"]]["noisy"]
        for name, test in tests.items():  # the confirmed fastest call: bytes over the fastest sample
            # the copy reads the whole working set and writes as much (`COPY_BUFFERS`)
            assert test["bytes_moved"] == point["bytes"] * (calibrate.COPY_BUFFERS if name == "copy" else 1)
            assert test["bytes_per_s"] == pytest.approx(test["bytes_moved"] / min(test["samples_s"]))
            # at least 3 samples, or 2 where the last call outlasted a third of the budget
            # (`timing.sample_in_turns`: a long call stays near its budget; a busy machine makes one)
            last_call_s = test["samples_s"][-1] * test["calls_per_sample"]
            assert len(test["samples_s"]) >= (2 if last_call_s > TINY.budget_s / 3 else 3), (name, test)
    assert spec.bandwidth_by_working_set == tuple((p["bytes"], p["bytes_per_s"]) for p in curve)
    assert spec.memory_bandwidth_bytes_per_s == curve[-1]["bytes_per_s"]  # the largest working set's
    assert info["bandwidth"]["copy"] == curve[-1]["tests"]["copy"] and info["bandwidth"]["read"] == curve[-1]["tests"]["read"]


def test_every_bandwidth_test_reads_the_whole_working_set(monkeypatch):
    """A test filed under W bytes reads all W: a copy of one half into the other read W / 2, and
    where a cache held W / 2 its rate was that cache's, above what a step of W bytes can read."""
    called = []

    def record(fn, work, kind, plan):
        called.append(inspect.getclosurevars(fn).nonlocals)
        return {"rate": 1.0, "samples_s": [1.0] * 3, "calls_per_sample": 1, "noisy": False, "spread": 0.0}
    monkeypatch.setattr(calibrate, "_figure", record)
    size = 2 * MIB
    calibrate.bandwidth_by_working_set("cpu", [size], TINY)
    read, gemv, copy = called
    assert read["x"].numel() * 4 == size and gemv["rows"].numel() * 4 == size
    source, target = copy["x"], copy["dst"]
    assert source.numel() * 4 == size and target.numel() * 4 == size
    assert target.untyped_storage().data_ptr() != source.untyped_storage().data_ptr()  # not into itself


def test_matmul_peak_is_the_best_confirmed_rate_over_sizes(measured):
    spec, info = measured
    by_size = info["matmul"]["fp32"]["by_size"]
    assert set(by_size) == {"64", "128"}
    for n, result in by_size.items():
        assert result["flops_per_s"] == pytest.approx(2 * int(n) ** 3 / min(result["samples_s"]))
        assert len(result["samples_s"]) >= 3
    assert spec.fp32_flops_per_s == max(r["flops_per_s"] for r in by_size.values())


def test_the_cpu_fp32_peak_is_the_fastest_of_its_paths(measured):
    """torch's matmul and, where this torch has oneDNN, oneDNN's linear: each size keeps both rates
    and its rate is the faster's, and the spec's source names the path that set the peak."""
    spec, info = measured
    fp32 = info["matmul"]["fp32"]
    want = set(calibrate.CPU_FP32_PATHS) if torch.backends.mkldnn.is_available() else {"torch.mm"}
    for result in fp32["by_size"].values():
        assert set(result["paths"]) == want
        assert result["flops_per_s"] == max(p["flops_per_s"] for p in result["paths"].values())
        assert result["paths"][result["path"]]["flops_per_s"] == result["flops_per_s"]
    best = max(fp32["by_size"].values(), key=lambda r: r["flops_per_s"])
    assert fp32["path"] == best["path"]
    assert f"({best['path']}, the fastest of torch.mm and oneDNN linear)" in spec.sources["fp32_flops_per_s"]


def test_a_cpu_fp32_path_this_torch_lacks_is_passed_over(monkeypatch, quiet):
    """oneDNN's linear failing (a torch built without it) leaves torch's matmul as the peak; torch's
    own matmul failing is the dtype's error, as before."""
    real = calibrate._matmul_fn

    def no_onednn(kind, dtype, n, path="torch.mm"):
        if path == "oneDNN linear":
            raise RuntimeError("no oneDNN here")
        return real(kind, dtype, n, path)

    monkeypatch.setattr(calibrate, "_matmul_fn", no_onednn)
    result = calibrate._matmul_peak("cpu", "fp32", (64,), calibrate.PLANS["cpu"])
    assert set(result["by_size"]["64"]["paths"]) == {"torch.mm"} and result["path"] == "torch.mm"
    monkeypatch.setattr(calibrate, "_matmul_fn", lambda *a, **k: (_ for _ in ()).throw(RuntimeError("none")))
    assert calibrate._matmul_peak("cpu", "fp32", (64,), calibrate.PLANS["cpu"]) == {"error": "RuntimeError: none"}


def test_provenance_describes_the_run(measured):
    _, info = measured
    for key in ("device", "device_name", "torch", "triton", "python", "date", "command", "threads",
                "hostname", "plan", "elapsed_s", "cpu_identity", "caches", "caches_source", "noisy", "tier_edges"):
        assert key in info, key
    assert info["device"] == "cpu" and info["torch"] == torch.__version__
    assert list(info["plan"]["matmul_sizes"]["fp32"]) == [64, 128]
    assert datetime.fromisoformat(info["date"]).tzinfo is not None
    assert info["cpu_identity"] == cpu_info.cpu_identity()
    assert [tuple(c) for c in info["caches"]] == list(cpu_info.cpu_caches().as_pairs())


def test_the_sweep_runs_from_a_mebibyte_to_four_times_the_last_level_cache():
    caches = (("L2", 4 * MIB), ("L3", 480 * MIB))
    real = dict(calibrate.PLANS)  # the fixture replaced the CPU plan with TINY
    top = calibrate.top_bytes(calibrate.Plan(None, {}, 1, 5, 0.25, min_top_bytes=256 * MIB), caches)
    assert top == 4 * 480 * MIB
    sizes = calibrate.working_set_sizes(top, 480 * MIB)
    assert sizes[0] == MIB and sizes[-1] == top and len(sizes) >= 6
    ratios = [b / a for a, b in zip(sizes, sizes[1:])]
    below = [r for a, r in zip(sizes, ratios) if a < 480 * MIB]
    assert all(abs(r - math.sqrt(2)) < 0.01 for r in below[:-1])  # sqrt(2) apart inside the caches
    assert all(r <= 2.0 + 1e-9 for r in ratios)  # then doubling up to the top
    assert all(s % calibrate.QUANTUM == 0 for s in sizes)
    # no caches reported: 4x the stated assumption; a small cache: at least min_top_bytes
    assert calibrate.top_bytes(calibrate.Plan(None, {}, 1, 5, 0.25), ()) == 4 * cpu_info.FALLBACK_LAST_LEVEL_BYTES
    assert calibrate.top_bytes(calibrate.Plan(None, {}, 1, 5, 0.25, min_top_bytes=256 * MIB), (("L3", 8 * MIB),)) == 256 * MIB
    assert len(calibrate.working_set_sizes(4 * MIB)) >= calibrate.MIN_POINTS  # a tiny top still has six
    assert real["cpu"] is TINY


def test_a_figure_that_no_second_call_confirms_is_noisy(monkeypatch):
    """Calls that each take 1.6x the last one: the fastest is never seen twice, so the figure
    is flagged noisy rather than taken as the machine's speed; calls of a steady 20 ms are not.
    On a clock that only the calls move, with no other process busy: real sleeps overshoot by
    whatever else the machine runs (another test process beside this one), and that is the
    moment's verdict, not the rule's."""
    clock = {"now": 0.0}
    monkeypatch.setattr(calibrate.time, "perf_counter", lambda: clock["now"])
    monkeypatch.setattr(calibrate, "others_busy_share", lambda *args, **kwargs: 0.0)

    def taking(delays):
        def call():
            clock["now"] += next(delays)
        return call

    figure = calibrate._figure(taking(0.002 * 1.6 ** i for i in range(200)), 1.0, "cpu", TINY)
    assert figure["noisy"] is True
    steady = calibrate._figure(taking(iter(lambda: 0.02, None)), 1.0, "cpu", TINY)
    assert steady["noisy"] is False and steady["rate"] == pytest.approx(1 / 0.02)


def test_a_noisy_calibration_is_kept_for_this_process_but_never_cached(monkeypatch):
    real = calibrate.calibrate
    monkeypatch.setattr(calibrate, "calibrate", lambda device, plan=None: (lambda s, i: (
        s, {**i, "noisy": ["bandwidth at 1.0 MiB"]}))(*real(device, plan)))
    lines = []
    spec, info = calibrate.load_or_calibrate("cpu", log=lines.append)
    assert info["cache_file"] is None and not calibrate.cache_path("cpu").exists()
    assert info["cache_status"].startswith("measured (no cached calibration), not cached: noisy (1 figure(s)")
    assert "calibrate --refresh" in info["cache_status"] and "not cached: noisy" in lines[-1]
    monkeypatch.setattr(calibrate, "calibrate", pytest.fail)  # the same process: not measured again
    again, info_again = calibrate.load_or_calibrate("cpu")
    assert again == spec and info_again["cache_status"].startswith("measured earlier in this process, not cached")
    monkeypatch.setattr(calibrate, "_UNCACHED", {})  # another process measures again
    monkeypatch.setattr(calibrate, "calibrate", real)
    assert not calibrate.load_or_calibrate("cpu")[1]["cache_status"].startswith("measured earlier")


def test_a_missing_path_is_none_with_the_reason(monkeypatch):
    plan = Plan(2**20, {"fp32": (32,), "fp8": (32,)}, warmup=0, repeats=3, budget_s=0.01)
    spec, info = calibrate.calibrate("cpu", plan)
    assert spec.fp8_flops_per_s is None
    assert "CUDA only" in info["matmul"]["fp8"]["error"]
    assert "CUDA only" in spec.sources["fp8_flops_per_s"]


def test_cache_round_trip_measures_once(monkeypatch, tmp_path, quiet):
    spec, info = calibrate.load_or_calibrate("cpu")
    path = tmp_path / "cache" / f"calibration-cpu-{socket.gethostname()}.json"
    assert info["cache_file"] == str(path) and path.exists()
    assert info["cache_status"] == "measured (no cached calibration)"
    monkeypatch.setattr(calibrate, "calibrate", pytest.fail)  # a hit must not measure
    again, info_again = calibrate.load_or_calibrate("cpu")
    assert info_again["cache_status"] == "hit"
    assert again == spec and again.sources == spec.sources
    assert info_again["matmul"] == json.loads(json.dumps(info["matmul"]))


@pytest.mark.parametrize("content", ["{not json", "[1, 2]", '{"format": "2"}', "",
                                     '{"format": 4, "spec": {"name": "x"}, "provenance": {}}'])
def test_a_corrupted_cache_is_reported_and_measured_again(content, tmp_path, quiet):
    path = calibrate.cache_path("cpu")
    path.parent.mkdir(parents=True)
    path.write_text(content)
    with pytest.warns(UserWarning, match="unreadable"):
        spec, info = calibrate.load_or_calibrate("cpu")
    assert info["cache_status"] == "measured (cached calibration unreadable)"
    assert spec.fp32_flops_per_s > 0
    assert json.loads(path.read_text())["spec"]["fp32_flops_per_s"] == spec.fp32_flops_per_s
    assert json.loads(path.read_text())["format"] == calibrate.CACHE_FORMAT == 4


def test_a_cache_with_impossible_numbers_is_measured_again(quiet):
    spec, _ = calibrate.load_or_calibrate("cpu")
    path = calibrate.cache_path("cpu")
    data = json.loads(path.read_text())
    data["spec"]["memory_bandwidth_bytes_per_s"] = -1
    path.write_text(json.dumps(data))
    with pytest.warns(UserWarning, match="unreadable"):
        _, info = calibrate.load_or_calibrate("cpu")
    assert info["cache_status"].startswith("measured")


def test_an_old_cache_or_a_refresh_measures_again(quiet):
    calibrate.load_or_calibrate("cpu")
    path = calibrate.cache_path("cpu")
    data = json.loads(path.read_text())
    data["provenance"]["date"] = (datetime.now(timezone.utc) - timedelta(days=8)).isoformat()
    path.write_text(json.dumps(data))
    _, info = calibrate.load_or_calibrate("cpu")
    assert info["cache_status"] == "measured (cached calibration is 8.0 days old)"
    assert calibrate.load_or_calibrate("cpu")[1]["cache_status"] == "hit"
    assert calibrate.load_or_calibrate("cpu", refresh=True)[1]["cache_status"] == "measured (refresh asked for)"


def test_a_cache_from_another_device_is_not_trusted(quiet):
    calibrate.load_or_calibrate("cpu")
    path = calibrate.cache_path("cpu")
    data = json.loads(path.read_text())
    data["provenance"]["device_name"] = "some other CPU"
    path.write_text(json.dumps(data))
    assert "another device" in calibrate.load_or_calibrate("cpu")[1]["cache_status"]


@pytest.mark.parametrize("change, why", [
    # each a change from what this machine recorded, whatever machine runs the test
    (lambda p: p.update(cpu_identity=p["cpu_identity"] + " (another stepping)"), "another CPU model"),
    (lambda p: p.update(caches=[[name, 2 * size] for name, size in p["caches"]] or [["L3", 32 * MIB]]),
     "other cache sizes"),
    (lambda p: p.update(threads=p["threads"] + 7), "threads"),
])
def test_a_cache_from_another_cpu_is_measured_again_and_says_why(quiet, change, why):
    """A VM's "Intel(R) Xeon(R) Processor" names no generation: the CPU's family, model and
    caches, and the thread count, are checked too."""
    calibrate.load_or_calibrate("cpu")
    path = calibrate.cache_path("cpu")
    data = json.loads(path.read_text())
    change(data["provenance"])
    path.write_text(json.dumps(data))
    assert why in calibrate.load_or_calibrate("cpu")[1]["cache_status"]


def test_a_cache_older_than_the_last_boot_is_measured_again(quiet, monkeypatch):
    calibrate.load_or_calibrate("cpu")
    monkeypatch.setattr(cpu_info, "last_boot", lambda: datetime.now(timezone.utc))
    assert "predates this machine's last boot" in calibrate.load_or_calibrate("cpu")[1]["cache_status"]
    monkeypatch.setattr(cpu_info, "last_boot", lambda: None)  # an OS that does not say: the age rule alone
    assert calibrate.load_or_calibrate("cpu")[1]["cache_status"] == "hit"


@pytest.mark.parametrize("old", [1, 2, 3])
def test_a_cache_of_an_old_format_is_measured_again_without_a_warning(old, quiet, recwarn):
    """Format 1 had no bandwidth curve, format 2 a CPU fp32 peak from torch's matmul alone (half
    an AMD CPU's rate), format 3 a copy test that read half its working set (a cache's rate where
    the cache held that half): out of date, not broken."""
    path = calibrate.cache_path("cpu")
    path.parent.mkdir(parents=True)
    path.write_text(json.dumps({"format": old, "spec": {}, "provenance": {}}))
    assert calibrate.load_or_calibrate("cpu")[1]["cache_status"] == (
        f"measured (cached calibration is of format {old}, this labkit writes {calibrate.CACHE_FORMAT})")
    assert not [w for w in recwarn if "unreadable" in str(w.message)]


def test_a_failed_write_leaves_the_old_cache_whole(monkeypatch, quiet):
    calibrate.load_or_calibrate("cpu")
    path = calibrate.cache_path("cpu")
    before = path.read_bytes()

    def dies_halfway(obj, file, **kwargs):
        file.write('{"format": 1, "spec": {"na')
        raise RuntimeError("disk full")

    monkeypatch.setattr(recordings.json, "dump", dies_halfway)
    with pytest.raises(RuntimeError, match="disk full"):
        calibrate.load_or_calibrate("cpu", refresh=True)
    assert path.read_bytes() == before
    assert os.listdir(path.parent) == [path.name]  # no temporary file left behind


def test_an_unwritable_cache_still_returns_the_measurement_with_a_warning(monkeypatch, tmp_path, quiet):
    """A read-only home or a full disk: the calibration stands, uncached, and says so."""
    blocker = tmp_path / "not-a-directory"
    blocker.write_text("a file where the cache directory should be")
    monkeypatch.setenv("LABKIT_CACHE_DIR", str(blocker))
    with pytest.warns(UserWarning, match="could not cache the calibration"):
        spec, info = calibrate.load_or_calibrate("cpu")
    assert spec.memory_bandwidth_bytes_per_s > 0 and info["cache_file"] is None
    assert info["cache_status"].startswith("measured") and "not cached" in info["cache_status"]


def test_describe_summarises_for_a_notebook():
    spec, info = calibrate.load_or_calibrate("cpu")
    text = calibrate.describe(spec, info)
    assert text.splitlines()[0].startswith(spec.name)
    assert "bandwidth roof" in text and "DRAM" in text and "ridge point (fp32" in text
    assert "caches as the OS reports them" in text
    # the CPU's fp32 peak names the path that set it (`CPU_FP32_PATHS`)
    assert f"fp32 {measure.format_rate(spec.fp32_flops_per_s, 'FLOP/s')} ({info['matmul']['fp32']['path']})" in text
    noisy = calibrate.describe(spec, {**info, "noisy": ["bandwidth at 1.0 MiB"]})
    assert noisy.splitlines()[-1] == "  noisy (the machine was busy): bandwidth at 1.0 MiB"
    cached = calibrate.describe(spec, {**info, "cache_status": "hit"}).splitlines()[3]  # printed "…; hit"
    assert cached.endswith("FLOP/byte; read from the cache (`python -m labkit calibrate --refresh --device cpu` measures again)")
    for threads, said in ((1, "(cpu, 1 thread)"), (2, "(cpu, 2 threads)")):  # a 1-core Binder pod says 1
        assert said in calibrate.describe(spec, {**info, "threads": threads}).splitlines()[0]


@pytest.mark.gpu
def test_a_small_calibration_on_a_gpu():
    plan = Plan(256 * 2**20, {d: (1024,) for d in ("bf16", "fp16", "fp32", "fp8", "int8")},
                warmup=2, repeats=5, budget_s=0.5)
    spec, info = calibrate.calibrate("cuda", plan)
    assert spec.name == f"this machine: {torch.cuda.get_device_name(0)}"
    assert spec.bf16_flops_per_s > spec.fp32_flops_per_s > 0  # tensor cores vs plain fp32
    assert spec.memory_bandwidth_bytes_per_s > 1e11
    for field, dtype in (("fp8_flops_per_s", "fp8"), ("int8_ops_per_s", "int8")):
        assert getattr(spec, field) is not None or "error" in info["matmul"][dtype]
    assert info["driver"]


def test_bandwidth_now_is_the_roof_at_a_working_set_at_this_moment(monkeypatch):
    """A short re-run of the calibration's read, GEMV and copy tests at one working set: the
    fastest, with a budget of a tenth of a second whatever the plan says; by default at the
    plan's largest working set (the memory's); a real run on this CPU is a plausible rate."""
    seen = []
    with monkeypatch.context() as patch:
        patch.setattr(calibrate, "bandwidth_by_working_set", lambda kind, sizes, plan: seen.append((kind, sizes, plan))
                      or [{"bytes": sizes[0], "bytes_per_s": 9e9}])
        assert calibrate.bandwidth_now("cpu") == 9e9
        assert calibrate.bandwidth_now("cpu", 3 * MIB + 5) == 9e9
    (kind, sizes, plan), (_, at_3, _) = seen
    assert kind == "cpu" and sizes == [TINY.stream_bytes] and plan.budget_s == 0.1
    assert at_3 == [3 * MIB]  # rounded down to whole rows
    assert 1e8 < calibrate.bandwidth_now("cpu", 2 * MIB) < 1e13  # 2 MiB: a cache's rate, still a rate


def test_a_curve_that_rises_past_the_last_level_cache_is_noisy(monkeypatch):
    """Each working set's figure confirmed, but the memory changed speed between them: past the
    last-level cache a point over RISE_LIMIT x a smaller one is named noisy (so not cached);
    inside the caches, and within the limit, nothing is."""
    point = lambda mib, gb: {"bytes": mib * MIB, "bytes_per_s": gb * 1e9}  # noqa: E731
    moved = [point(16, 200), point(32, 150), point(64, 77), point(128, 57), point(256, 95)]
    assert calibrate.rises_past_cache(moved, 32 * MIB) == [
        "bandwidth at 256.0 MiB (95 GB/s) over that at 128.0 MiB (57 GB/s): the memory changed speed during "
        "the calibration"]
    steady = [point(16, 200), point(32, 150), point(64, 77), point(128, 57), point(256, 62)]  # +9 %: noise
    assert calibrate.rises_past_cache(steady, 32 * MIB) == [] and calibrate.rises_past_cache(moved, None) == []
    assert calibrate.rises_past_cache(moved, 512 * MIB) == []  # all inside the cache: its tiers may rise
    # calibrate() itself, on a curve whose largest working set read twice as fast as the rest: a
    # made-up curve, as the real one's small working sets can differ by 2x between neighbours on a
    # busy machine (1.0 MiB 157 GB/s, 1.4 MiB 75), which would hide or fake the rise
    monkeypatch.setattr(calibrate, "machine_caches", lambda kind: [("L3", 2 * MIB)])

    def curve(kind, sizes, plan):
        test = lambda rate: {"bytes_per_s": rate, "samples_s": [1.0] * 3, "noisy": False}  # noqa: E731
        return [{"bytes": size, "bytes_per_s": rate, "best": "read", "noisy": False,
                 "tests": {"read": test(rate), "gemv": test(rate / 2), "copy": test(rate / 2)}}
                for size in sizes for rate in [50e9 * (2 if size == max(sizes) else 1)]]
    monkeypatch.setattr(calibrate, "bandwidth_by_working_set", curve)
    spec, info = calibrate.calibrate("cpu", TINY)
    assert any(line.endswith("the memory changed speed during the calibration") for line in info["noisy"])
    steady = lambda kind, sizes, plan: [{**p, "bytes_per_s": 50e9} for p in curve(kind, sizes, plan)]  # noqa: E731
    monkeypatch.setattr(calibrate, "bandwidth_by_working_set", steady)
    assert not any("changed speed" in line for line in calibrate.calibrate("cpu", TINY)[1]["noisy"])


def test_a_calibration_while_other_processes_keep_the_cores_busy_is_noisy(monkeypatch):
    """A steady load confirms its own, slower, figures: the CPU time other processes used during
    the calibration (all processes' from /proc/stat, less this one's) flags it instead."""
    busy_s = [1000.0]

    def busy(cpus=None):  # the machine used another 1,000 CPU seconds between any two readings: not us
        busy_s[0] += 1000.0
        return busy_s[0]

    monkeypatch.setattr(cpu_info, "cpu_busy_s", busy)
    spec, info = calibrate.calibrate("cpu", TINY)
    assert info["others_busy_share"] > calibrate.OTHERS_BUSY_LIMIT
    assert info["noisy"][-1].startswith("other processes kept") and info["noisy"][-1].endswith("of the cores busy meanwhile")
    monkeypatch.setattr(cpu_info, "cpu_busy_s", lambda cpus=None: None)  # an OS without /proc/stat: not checked, not guessed
    real, shares = calibrate.others_busy_share, []
    monkeypatch.setattr(calibrate, "others_busy_share", lambda *a, **k: shares.append(real(*a, **k)) or shares[-1])
    spec, info = calibrate.calibrate("cpu", TINY)
    # neither the whole run nor any figure is judged by others' load (a figure may still be noisy by
    # its own samples: under `pytest -n 2` the other worker's load once left one unconfirmed)
    assert info["others_busy_share"] is None and len(shares) > 1 and set(shares) == {None}
    assert not any(reason.startswith("other processes kept") for reason in info["noisy"])


def test_a_figure_during_which_other_processes_were_busy_is_noisy(monkeypatch, tmp_path):
    """A load during one figure alone (a browser drawing while the matmul ran) can leave the whole
    calibration's share under the limit and still halve that figure: the figure is flagged, so
    the calibration is noisy and not cached. Judged over FIGURE_WINDOW_S at least."""
    real = calibrate.others_busy_share
    monkeypatch.setattr(calibrate, "others_busy_share",
                        lambda start, min_wall_s=0.0: 0.5 if min_wall_s else real(start, min_wall_s))
    spec, info = calibrate.calibrate("cpu", TINY)
    assert info["matmul"]["fp32"]["noisy"] and "fp32 matmul" in info["noisy"]
    assert all(p["noisy"] for p in info["bandwidth_by_working_set"])
    monkeypatch.setenv("LABKIT_CACHE_DIR", str(tmp_path))
    monkeypatch.setitem(calibrate.PLANS, "cpu", TINY)
    assert calibrate.load_or_calibrate("cpu")[1]["cache_file"] is None  # kept for this process only
    assert not calibrate.cache_path("cpu").exists()
    seen = []
    monkeypatch.setattr(calibrate, "others_busy_share", lambda start, min_wall_s=0.0: seen.append(min_wall_s) or 0.0)
    calibrate.calibrate("cpu", TINY)  # each figure asked over the window, the whole run over its own time
    assert set(seen) == {0.0, calibrate.FIGURE_WINDOW_S} and seen.count(0.0) == 1


def test_a_cpu_calibration_first_waits_for_a_quiet_moment(monkeypatch):
    """Lesson 01 calibrates in the notebook, right after a cell whose chart the browser may still
    be drawing: the calibration waits (up to timing.QUIET_WAIT_S, LABKIT_QUIET_WAIT_S) before its
    first figure, so the browser's drawing does not land in its roofs."""
    events = []
    monkeypatch.setattr(calibrate, "wait_for_quiet", lambda wait_s: events.append(("wait", wait_s)) or True)
    real = calibrate.load_snapshot
    monkeypatch.setattr(calibrate, "load_snapshot", lambda: events.append(("start",)) or real())
    monkeypatch.delenv("LABKIT_QUIET_WAIT_S", raising=False)
    calibrate.calibrate("cpu", TINY)
    assert events[:2] == [("wait", timing.QUIET_WAIT_S), ("start",)]
    monkeypatch.setenv("LABKIT_QUIET_WAIT_S", "0.5")
    events.clear()
    calibrate.calibrate("cpu", TINY)
    assert events[0] == ("wait", 0.5)


def test_waiting_for_quiet_for_0_s_does_not_wait(monkeypatch):
    monkeypatch.setattr(timing.time, "sleep", lambda s: pytest.fail("slept"))
    assert timing.wait_for_quiet(0) is False
