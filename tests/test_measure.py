"""labkit.measure: timing statistics, the budgeted harness, achieved rates against the roof."""
import time

import pytest
import torch

from labkit import measure, roofline
from labkit.errors import LabError
from labkit.measure import Timing
from labkit.specs import get_gpu

H100 = get_gpu("H100-SXM")


@pytest.fixture(autouse=True)
def cache_dir(monkeypatch, tmp_path):
    monkeypatch.setenv("LABKIT_CACHE_DIR", str(tmp_path / "cache"))


def test_timing_statistics_from_few_samples_use_the_full_range():
    timing = Timing((0.010, 0.012, 0.011, 0.013, 0.009))
    assert (timing.median_s, timing.min_s, timing.max_s) == (0.011, 0.009, 0.013)
    assert timing.spread == pytest.approx((0.013 - 0.009) / 0.011)
    assert timing.noisy  # 36 % > NOISY_SPREAD


def test_timing_statistics_from_many_samples_ignore_one_outlier():
    samples = (0.010,) * 19 + (1.0,)  # one call hit by another process
    timing = Timing(samples)
    assert timing.spread == pytest.approx(0.0)  # the 10th-90th percentile range
    assert not timing.noisy
    assert Timing(samples[:9] + (1.0,)).noisy  # with 10 samples p90 reaches the outlier


def test_a_quiet_timing_is_not_noisy():
    timing = Timing((0.100, 0.101, 0.099))
    assert timing.spread == pytest.approx(0.02)
    assert not timing.noisy
    assert measure.NOISY_SPREAD == 0.25


def test_timing_refuses_empty_or_nonpositive_samples():
    with pytest.raises(LabError):
        Timing(())
    with pytest.raises(LabError):
        Timing((0.01, 0.0))


def test_timing_to_dict_carries_units():
    summary = Timing((1.0, 3.0, 2.0)).to_dict()
    assert summary == {"estimate_s": 2.0, "estimator": "median", "median_s": 2.0, "min_s": 1.0, "max_s": 3.0, "spread": 1.0, "noisy": True,
                       "samples_s": [1.0, 3.0, 2.0], "calls_per_sample": 1,
                       "host_median_s": None, "host_bound": None, "method": None, "l2_flushed": None,
                       "others_busy_share": None}


class Counter:
    """A callable that sleeps and counts its calls."""

    def __init__(self, sleep_s=0.0):
        self.calls, self.sleep_s = 0, sleep_s

    def __call__(self):
        self.calls += 1
        time.sleep(self.sleep_s)


def test_time_fn_warms_up_then_times_each_repeat():
    fn = Counter(0.002)
    timing = measure.time_fn(fn, "cpu", warmup=2, repeats=5)
    assert fn.calls == 7 and len(timing.samples_s) == 5
    assert all(0.002 <= s < 0.2 for s in timing.samples_s)


def test_a_spent_budget_stops_early_but_keeps_three_samples():
    fn = Counter(0.01)
    timing = measure.time_fn(fn, "cpu", warmup=1, repeats=50, budget_s=0.001)
    assert len(timing.samples_s) == measure.MIN_SAMPLES == 3
    assert fn.calls == 4


def test_fewer_repeats_than_the_minimum_are_honoured():
    assert len(measure.time_fn(Counter(), "cpu", warmup=0, repeats=2, budget_s=0).samples_s) == 2


def test_time_fn_refuses_no_repeats():
    with pytest.raises(LabError):
        measure.time_fn(Counter(), "cpu", repeats=0)


def test_time_fn_times_real_work_on_the_cpu():
    a = torch.randn(256, 256)
    timing = measure.time_fn(lambda: a @ a, "cpu", warmup=1, repeats=3)
    assert 0 < timing.min_s <= timing.median_s <= timing.max_s < 5


def test_achieved_rates_are_work_over_median_time():
    rates = measure.achieved(2e12, 4e9, Timing((1.0, 2.0, 3.0)))
    assert rates == {"time_s": 2.0, "achieved_flops_per_s": 1e12, "achieved_bytes_per_s": 2e9}
    assert measure.achieved(1.0, 1.0, 0.5)["achieved_flops_per_s"] == 2.0  # plain seconds too


def test_roof_fraction_of_a_memory_bound_op_is_bandwidth_fraction():
    bytes_moved = 3.35e12  # one second at the H100's 3.35 TB/s
    fraction = measure.roof_fraction(1e9, bytes_moved, Timing((2.0,)), H100)
    assert fraction == pytest.approx(0.5)
    assert fraction == pytest.approx(roofline.roofline_time_s(1e9, bytes_moved, H100) / 2.0)


def test_roof_fraction_of_a_compute_bound_op_is_peak_fraction_for_its_dtype():
    flops = 989.4e12  # one second at dense bf16 peak
    assert measure.roof_fraction(flops, 1e6, Timing((4.0,)), H100) == pytest.approx(0.25)
    assert measure.roof_fraction(66.9e12, 1e6, 4.0, H100, dtype="fp32") == pytest.approx(0.25)


def test_bound_line_puts_prediction_beside_measurement():
    bytes_moved = 0.0121 * 3.35e12
    line = measure.format_bound_line(1e9, bytes_moved, Timing((0.0130, 0.0131, 0.0129)), H100)
    assert line == "predicted 12.1 ms (memory-bound at 3.35 TB/s), measured 13.0 ms = 0.93 of roof"


def test_bound_line_names_the_compute_roof_and_flags_noise():
    line = measure.format_bound_line(989.4e12, 1e6, Timing((1.0, 2.0, 3.0)), H100)
    assert line.startswith("predicted 1.00 s (compute-bound at 989 TFLOP/s bf16), measured 2.00 s = 0.50 of roof")
    assert "noisy: spread 100% over 3 samples" in line


def test_bound_line_of_a_fastest_call_says_how_far_the_median_lay():
    """A few stalled calls blow the spread up (here over 500 %); the line gives the median's
    distance from the fastest call instead, which is what the figure rests on."""
    stalled = Timing((1.0, 1.01, 1.02, 1.0, 1.03, 1.01, 1.02, 1.0, 1.04, 1.01, 12.0, 13.0), estimator="fastest")
    assert stalled.spread > 5 and not stalled.noisy
    line = measure.format_bound_line(989.4e12, 1e6, stalled, H100)
    assert line.endswith("(fastest of 12 calls, their median 1.02× as long)") and "spread" not in line


def test_bound_line_of_an_unconfirmed_fastest_call_says_why_it_is_noisy():
    """A fastest call no second one came near is noisy for that reason, not for the spread."""
    lonely = Timing((1.0, 1.5, 1.6), estimator="fastest")
    assert lonely.noisy
    assert measure.format_bound_line(989.4e12, 1e6, lonely, H100).endswith(
        "(noisy: no second of 3 calls came within 10% of the fastest)")


def test_display_formats():
    assert measure.format_seconds(45.1e-6) == "45.1 µs"
    assert measure.format_seconds(2.5) == "2.50 s"
    assert measure.format_rate(9.4e9, "B/s") == "9.40 GB/s"
    assert measure.format_rate(0, "B") == "0 B" and measure.format_seconds(0) == "0 s"  # not "0.00 B"
    from labkit.units import format_bytes
    assert [format_bytes(n) for n in (512, 16 << 20, 0.95 * 2**30, 12.3 * 2**30)] == ["512 B", "16 MiB", "973 MiB",
                                                                                       "12.3 GiB"]
    assert format_bytes(14.96 * 2**30, decimals=2) == "14.96 GiB"


def test_a_short_cuda_call_is_timed_as_the_mean_of_back_to_back_calls(monkeypatch):
    """The logic only (no GPU needed): a 20 us call is measured once untimed, then each sample
    is 50 calls between one pair of events; a 5 ms call stays one call per sample."""
    batches = []

    def fake_events(fn, calls, call_s):
        batches.append(calls)
        return calls * call_s, calls * call_s * 0.5  # the host issues each call in half its GPU time

    monkeypatch.setattr(torch.cuda, "synchronize", lambda: None)
    for call_s, calls in ((20e-6, 50), (5e-3, 1), (1e-9, measure.MAX_CALLS_PER_SAMPLE)):
        batches.clear()
        monkeypatch.setattr(measure, "_cuda_calls_s", lambda fn, n, call_s=call_s: fake_events(fn, n, call_s))
        timing = measure.time_fn(lambda: None, "cuda", warmup=1, repeats=4)
        assert batches == [1] + [calls] * 4 and timing.calls_per_sample == calls
        assert timing.median_s == pytest.approx(call_s) and timing.to_dict()["calls_per_sample"] == calls
        assert timing.host_bound is False and timing.to_dict()["host_median_s"] == pytest.approx(call_s / 2)


def test_isolated_cuda_timing_plan():
    """isolate=True: a graph for calls under a millisecond, an L2 flush for working sets under 2x
    the L2 (an fp8 cache at B=1, S=16k reads 32 MiB, under an H100's 50 MiB L2), both for both."""
    l2 = 50 * 2**20
    assert measure.cuda_plan(30e-6, 32 * 2**20, l2) == {
        "graph": True, "flush": True, "method": "cuda graph of (L2 flush, call) pairs, flushes subtracted"}
    assert measure.cuda_plan(30e-6, 1 * 2**30, l2)["method"] == "cuda graph (triton.testing.do_bench_cudagraph)"
    assert measure.cuda_plan(5e-3, 64 * 2**20, l2)["method"].startswith("events, L2 flushed")
    assert measure.cuda_plan(5e-3, 4 * 2**30, l2) == {"graph": False, "flush": False, "method": "events"}
    assert measure.cuda_plan(5e-3, None, l2)["flush"] is False and measure.cuda_plan(5e-3, 1.0, None)["flush"] is False
    assert measure.l2_resident(99 * 2**20, l2) and not measure.l2_resident(100 * 2**20, l2)
    assert measure.l2_resident(None, l2) is None and measure.l2_resident(1.0, None) is None


@pytest.mark.triton  # the CUDA route reads triton's testing module
def test_isolated_timing_goes_through_the_plan_on_cuda(monkeypatch):
    """No GPU needed: the CUDA pieces are stand-ins; the chosen route's samples become the Timing,
    named by its method, with no host times (launch cost is not in them)."""
    routes = []
    monkeypatch.setattr(torch.cuda, "synchronize", lambda: None)
    monkeypatch.setattr(measure, "_cuda_calls_s", lambda fn, n: (n * 30e-6, n * 50e-6))  # 30 us kernel, 50 us host
    monkeypatch.setattr(measure, "l2_bytes", lambda device: 50 * 2**20)
    monkeypatch.setattr(measure, "_graph_flush_samples_s", lambda fn, n: routes.append("graph+flush") or [30e-6] * n)
    timing = measure.time_fn(lambda: None, "cuda", warmup=1, repeats=4, isolate=True, working_set_bytes=32 * 2**20)
    assert routes == ["graph+flush"] and timing.median_s == pytest.approx(30e-6)
    assert timing.l2_flushed is True and timing.host_bound is None and "flush" in timing.method
    plain = measure.time_fn(lambda: None, "cuda", warmup=1, repeats=4)  # not isolated: events, host time kept
    assert plain.method == "events" and plain.l2_flushed is False and plain.host_bound is True
    monkeypatch.setattr(measure, "_graph_flush_samples_s", lambda fn, n: [-1e-6] * n)
    with pytest.raises(LabError, match="every sample was <= 0 s"):
        measure.time_fn(lambda: None, "cuda", warmup=0, repeats=3, isolate=True, working_set_bytes=1.0)


def test_host_bound_when_issuing_takes_as_long_as_the_gpu():
    assert Timing((1e-3,) * 3, 1, (0.95e-3,) * 3).host_bound is True
    assert Timing((1e-3,) * 3, 1, (0.2e-3,) * 3).host_bound is False
    assert Timing((1e-3,) * 3).host_bound is None  # CPU: the host does the work


@pytest.mark.gpu
def test_time_fn_uses_cuda_events_on_a_gpu():
    a = torch.randn(4096, 4096, device="cuda", dtype=torch.bfloat16)
    timing = measure.time_fn(lambda: a @ a, "cuda", warmup=2, repeats=5)
    flops = 2 * 4096**3
    assert len(timing.samples_s) == 5
    # Events time the GPU's work: a 137 GFLOP matmul takes well under a second on any CUDA GPU
    # the lab supports, and cannot beat 2 PFLOP/s.
    assert flops / 2e15 < timing.median_s < 1.0
    small = torch.randn(1024, device="cuda")
    assert measure.time_fn(lambda: small.add_(1.0), "cuda", warmup=2, repeats=3).calls_per_sample > 1
