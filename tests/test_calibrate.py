"""labkit.calibrate at tiny sizes: what it measures, its provenance, and the cache's life cycle."""
import json
import os
import socket
from datetime import datetime, timedelta, timezone

import pytest
import torch

from labkit import backend, calibrate, recordings
from labkit.calibrate import Plan
from labkit.specs import HardwareSpec

TINY = Plan(4 * 2**20, {"fp32": (64, 128), "bf16": (32,), "fp16": (32,)}, warmup=1, repeats=3, budget_s=0.05)


@pytest.fixture(autouse=True)
def tiny_and_isolated(monkeypatch, tmp_path):
    monkeypatch.setenv("LABKIT_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.setitem(calibrate.PLANS, "cpu", TINY)


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


def test_every_number_says_it_was_measured_and_when(measured):
    spec, info = measured
    for field in ("fp32_flops_per_s", "bf16_flops_per_s", "memory_bandwidth_bytes_per_s"):
        assert spec.sources[field].startswith(f"measured by labkit.calibrate on {info['date']}")
    assert spec.sources["fp8_flops_per_s"].startswith("not measured")


def test_bandwidth_roof_is_the_faster_of_copy_and_read(measured):
    spec, info = measured
    copy, read = info["bandwidth"]["copy"], info["bandwidth"]["read"]
    assert spec.memory_bandwidth_bytes_per_s == max(copy["bytes_per_s"], read["bytes_per_s"])
    assert copy["bytes_moved"] == 2 * TINY.stream_bytes  # copy counts the read and the write
    assert read["bytes_moved"] == TINY.stream_bytes
    samples = sorted(copy["samples_s"])
    assert copy["bytes_per_s"] == pytest.approx(copy["bytes_moved"] / samples[len(samples) // 2])


def test_matmul_peak_is_the_best_median_rate_over_sizes(measured):
    spec, info = measured
    by_size = info["matmul"]["fp32"]["by_size"]
    assert set(by_size) == {"64", "128"}
    for n, result in by_size.items():
        median_s = sorted(result["samples_s"])[len(result["samples_s"]) // 2]
        assert result["flops_per_s"] == pytest.approx(2 * int(n) ** 3 / median_s)
        assert len(result["samples_s"]) >= 3
    assert spec.fp32_flops_per_s == max(r["flops_per_s"] for r in by_size.values())


def test_provenance_describes_the_run(measured):
    _, info = measured
    for key in ("device", "device_name", "torch", "triton", "python", "date", "command", "threads",
                "hostname", "plan", "elapsed_s"):
        assert key in info, key
    assert info["device"] == "cpu" and info["torch"] == torch.__version__
    assert list(info["plan"]["matmul_sizes"]["fp32"]) == [64, 128]
    assert datetime.fromisoformat(info["date"]).tzinfo is not None


def test_a_missing_path_is_none_with_the_reason(monkeypatch):
    plan = Plan(2**20, {"fp32": (32,), "fp8": (32,)}, warmup=0, repeats=3, budget_s=0.01)
    spec, info = calibrate.calibrate("cpu", plan)
    assert spec.fp8_flops_per_s is None
    assert "CUDA only" in info["matmul"]["fp8"]["error"]
    assert "CUDA only" in spec.sources["fp8_flops_per_s"]


def test_cache_round_trip_measures_once(monkeypatch, tmp_path):
    spec, info = calibrate.load_or_calibrate("cpu")
    path = tmp_path / "cache" / f"calibration-cpu-{socket.gethostname()}.json"
    assert info["cache_file"] == str(path) and path.exists()
    assert info["cache_status"] == "measured (no cached calibration)"
    monkeypatch.setattr(calibrate, "calibrate", pytest.fail)  # a hit must not measure
    again, info_again = calibrate.load_or_calibrate("cpu")
    assert info_again["cache_status"] == "hit"
    assert again == spec and again.sources == spec.sources
    assert info_again["matmul"] == json.loads(json.dumps(info["matmul"]))


@pytest.mark.parametrize("content", ["{not json", "[1, 2]", '{"format": 1}', "",
                                     '{"format": 1, "spec": {"name": "x"}, "provenance": {}}'])
def test_a_corrupted_cache_is_reported_and_measured_again(content, tmp_path):
    path = calibrate.cache_path("cpu")
    path.parent.mkdir(parents=True)
    path.write_text(content)
    with pytest.warns(UserWarning, match="unreadable"):
        spec, info = calibrate.load_or_calibrate("cpu")
    assert info["cache_status"] == "measured (cached calibration unreadable)"
    assert spec.fp32_flops_per_s > 0
    assert json.loads(path.read_text())["spec"]["fp32_flops_per_s"] == spec.fp32_flops_per_s


def test_a_cache_with_impossible_numbers_is_measured_again():
    spec, _ = calibrate.load_or_calibrate("cpu")
    path = calibrate.cache_path("cpu")
    data = json.loads(path.read_text())
    data["spec"]["memory_bandwidth_bytes_per_s"] = -1
    path.write_text(json.dumps(data))
    with pytest.warns(UserWarning, match="unreadable"):
        _, info = calibrate.load_or_calibrate("cpu")
    assert info["cache_status"].startswith("measured")


def test_an_old_cache_or_a_refresh_measures_again():
    calibrate.load_or_calibrate("cpu")
    path = calibrate.cache_path("cpu")
    data = json.loads(path.read_text())
    data["provenance"]["date"] = (datetime.now(timezone.utc) - timedelta(days=8)).isoformat()
    path.write_text(json.dumps(data))
    _, info = calibrate.load_or_calibrate("cpu")
    assert info["cache_status"] == "measured (cached calibration is 8.0 days old)"
    assert calibrate.load_or_calibrate("cpu")[1]["cache_status"] == "hit"
    assert calibrate.load_or_calibrate("cpu", refresh=True)[1]["cache_status"] == "measured (refresh asked for)"


def test_a_cache_from_another_device_is_not_trusted():
    calibrate.load_or_calibrate("cpu")
    path = calibrate.cache_path("cpu")
    data = json.loads(path.read_text())
    data["provenance"]["device_name"] = "some other CPU"
    path.write_text(json.dumps(data))
    assert "another device" in calibrate.load_or_calibrate("cpu")[1]["cache_status"]


def test_a_failed_write_leaves_the_old_cache_whole(monkeypatch):
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


def test_an_unwritable_cache_still_returns_the_measurement_with_a_warning(monkeypatch, tmp_path):
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
    assert "memory bandwidth" in text and "ridge point (fp32)" in text


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


def test_bandwidth_now_is_the_faster_stream_test_at_this_moment(monkeypatch):
    """A short re-run of the calibration's copy and read tests: the faster of the two, with one
    warm-up and three calls whatever the plan says; a real run on this CPU is a plausible rate."""
    seen = []
    with monkeypatch.context() as patch:
        patch.setattr(calibrate, "_stream_bandwidth", lambda kind, plan: seen.append((kind, plan)) or {
            "copy": {"bytes_per_s": 7e9}, "read": {"bytes_per_s": 9e9}})
        assert calibrate.bandwidth_now("cpu") == 9e9
    kind, plan = seen[0]
    assert kind == "cpu" and plan.stream_bytes == TINY.stream_bytes and (plan.warmup, plan.repeats) == (1, 3)
    assert 1e8 < calibrate.bandwidth_now("cpu") < 1e13  # 4 MiB tensors: a cache's rate, still a rate
