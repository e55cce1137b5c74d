"""Static vs continuous batching: hand-checked schedules, the chapter's utilisation estimate,
conservation (every request completes once), and speed."""
import time

import numpy as np
import pytest

from labkit import batching as b
from labkit import roofline as r
from labkit import traces
from labkit.errors import LabError
from labkit.specs import get_gpu, get_model

L8 = get_model("llama-3.1-8b")
H100 = get_gpu("H100-SXM")
STEP = b.roofline_step_time(L8, H100)
PREFILL = b.roofline_prefill_time(L8, H100)


def one_second(batch, total_context_tokens):
    return np.ones_like(np.asarray(total_context_tokens, dtype=float))


def at_once(prompts, outputs):
    """Requests that all arrive at t = 0."""
    return np.column_stack([np.zeros(len(outputs)), prompts, outputs])


def varied(n=200, seed=0):
    rng = np.random.default_rng(seed)
    return at_once(rng.integers(100, 3000, n), rng.integers(1, 600, n))


# ---------------------------------------------------------------- schedules checked by hand
def test_static_schedule_by_hand():
    # prefill 0.5 s each, decode passes 1 s: both prefilled by t = 1, the 3-token one needs 2 passes
    result = b.simulate_static(at_once([10, 10], [3, 1]), 2, one_second, lambda p: 0.5 * np.ones(np.shape(p)))
    assert result.first_token_s.tolist() == [1.0, 1.0]
    assert result.finish_s.tolist() == [3.0, 1.0]
    assert result.summary()["slot_utilisation"] == 4 / (2 * 3)


def test_continuous_refills_a_freed_slot_at_the_next_pass():
    # two slots; the 2-token request leaves after pass 2, the third takes its slot in pass 3
    requests = at_once([10, 10, 10], [10, 2, 2])
    continuous = b.simulate_continuous(requests, 2, one_second)
    assert continuous.first_token_s.tolist() == [0.0, 0.0, 2.0]
    assert continuous.finish_s.tolist() == [9.0, 1.0, 3.0]
    static = b.simulate_static(requests, 2, one_second)
    assert static.finish_s.tolist() == [9.0, 1.0, 10.0]  # the third waits for the bus to return
    assert continuous.summary()["total_time_s"] == 9.0 and static.summary()["total_time_s"] == 10.0


def test_arrivals_wait_for_the_gpu_or_find_it_idle():
    requests = np.array([[0.0, 10, 3], [0.5, 10, 2], [10.0, 10, 1]])
    continuous = b.simulate_continuous(requests, 4, one_second)
    # the second arrives during pass 1 (0 → 1 s) and joins at the pass starting at t = 1
    assert continuous.first_token_s.tolist() == [0.0, 2.0, 10.0]
    assert continuous.finish_s.tolist() == [2.0, 3.0, 10.0]
    static = b.simulate_static(requests, 4, one_second)
    assert static.first_token_s.tolist() == [0.0, 2.0, 10.0]  # it waits for the first batch to leave


# ---------------------------------------------------------------- the chapter's claims
@pytest.mark.parametrize("outputs", [[5, 20, 100, 1, 40, 7, 60, 100], [300] * 8, [1, 2000, 5, 5, 5, 5, 5, 5]])
def test_static_utilisation_is_mean_over_max_for_a_full_batch(outputs):
    result = b.simulate_static(at_once(np.full(8, 500), outputs), 8, STEP, PREFILL)
    assert result.summary()["slot_utilisation"] == pytest.approx(b.static_utilisation_estimate(outputs), rel=1e-12)


def test_continuous_beats_static_on_varied_lengths():
    comparison = b.compare(varied(), 16, STEP, PREFILL)
    assert comparison["continuous"]["throughput_tokens_per_s"] > comparison["static"]["throughput_tokens_per_s"]
    assert comparison["continuous"]["slot_utilisation"] > comparison["static"]["slot_utilisation"]
    assert comparison["throughput_ratio"] > 1.2


@pytest.mark.parametrize("n", [64, 70])  # a whole number of batches, and a partial last batch
def test_equal_lengths_make_the_policies_equal(n):
    requests = at_once(np.random.default_rng(1).integers(100, 3000, n), np.full(n, 128))
    static = b.simulate_static(requests, 16, STEP, PREFILL)
    continuous = b.simulate_continuous(requests, 16, STEP, PREFILL)
    assert np.allclose(continuous.finish_s, static.finish_s, rtol=1e-12, atol=0)
    assert continuous.summary()["throughput_tokens_per_s"] == pytest.approx(
        static.summary()["throughput_tokens_per_s"], rel=1e-12)


@pytest.mark.parametrize("policy", [b.simulate_static, b.simulate_continuous])
@pytest.mark.parametrize("max_batch", [1, 3, 32])
def test_every_request_completes_exactly_once(policy, max_batch):
    sample = traces.sample_requests(traces.load_summary("conv"), 300, seed=2)
    result = policy(sample.requests, max_batch, STEP, PREFILL)
    assert result.completions.tolist() == [1] * len(sample)
    assert result.useful_slot_passes == sample.output_tokens.sum()
    assert np.all(result.first_token_s >= result.arrival_s) and np.all(result.finish_s >= result.first_token_s)
    assert 0 < result.summary()["slot_utilisation"] <= 1


# ---------------------------------------------------------------- time functions and speed
def test_roofline_step_time_is_labkit_roofline():
    for batch, per_sequence in [(1, 2000), (32, 1000.5), (64, 8192)]:
        expected = r.predicted_decode_step_s(L8, batch, per_sequence, H100, counting=r.CHAPTER,
                                             mfu=r.CHAPTER_MFU, bandwidth_efficiency=r.CHAPTER_BANDWIDTH_EFFICIENCY)
        assert STEP(batch, batch * per_sequence) == pytest.approx(expected, rel=1e-12)
    assert STEP(8, np.array([8000, 16000])).shape == (2,)
    assert PREFILL(np.array([2000]))[0] == r.predicted_prefill_time_s(L8, 2000, H100, counting=r.CHAPTER, mfu=0.4,
                                                                      bandwidth_efficiency=0.75)


@pytest.mark.parametrize("policy", [b.simulate_static, b.simulate_continuous])
def test_two_thousand_requests_simulate_well_under_a_second(policy):
    requests = traces.sample_requests(traces.load_summary("conv"), 2000, seed=0).requests
    saturated = np.column_stack([np.zeros(2000), requests[:, 1:]])
    for rows in (requests, saturated):
        best = min(_cpu_seconds(policy, rows) for _ in range(2))
        assert best < 1.0, f"{policy.__name__}: {best:.2f} s of CPU for 2,000 requests"


def _cpu_seconds(policy, rows):
    start = time.process_time()
    policy(rows, 32, STEP, PREFILL)
    return time.process_time() - start


# ---------------------------------------------------------------- bad input
@pytest.mark.parametrize("requests, message", [
    (np.zeros((3, 2)), "rows of"),
    (np.array([[0.0, 10, 0]]), "output_tokens"),
    (np.array([[-1.0, 10, 5]]), "arrival"),
])
def test_bad_requests(requests, message):
    with pytest.raises(LabError, match=message):
        b.simulate_continuous(requests, 4, one_second)


def test_bad_time_functions():
    scalar_only = lambda batch, tokens: max(0.01, tokens * 1e-9)  # noqa: E731 (uses Python's max)
    with pytest.raises(LabError, match="numpy.vectorize"):
        b.simulate_static(varied(10), 4, scalar_only)
    with pytest.raises(LabError, match="negative"):
        b.simulate_continuous(varied(10), 4, lambda batch, tokens: -np.ones(np.shape(tokens)))
    with pytest.raises(LabError, match="max_batch"):
        b.simulate_static(varied(10), 0, one_second)


# ---------------------------------------------------------------- measured time functions
def decode_points(batches=(1, 8, 32), contexts=(256, 2048), device="cpu"):
    """Points of an affine step time 10 ms + 1 ms per sequence + 1 µs per cached key."""
    return [{"batch": B, "context_tokens": S, "time_s": 0.01 + 0.001 * B + 1e-6 * B * S,
             "device": device, "device_name": f"test {device}", "cache_dtype": "fp32"}
            for B in batches for S in contexts]


def affine(batch, tokens):
    return 0.01 + 0.001 * np.asarray(batch, dtype=float) + 1e-6 * np.asarray(tokens, dtype=float)


def test_measured_step_time_passes_through_the_points_and_interpolates():
    step = b.step_time_from_records(decode_points())
    for B, S in [(1, 256), (8, 2048), (32, 256), (8, 1000), (20, 700)]:
        assert step(B, B * S) == pytest.approx(affine(B, B * S), rel=1e-9) or B == 20
    # linear in S inside a row; between batches linear in B at fixed S (affine: exact)
    assert step(20, 20 * 700) == pytest.approx(affine(20, 20 * 700), rel=0.05)
    assert "test cpu" in step.label and "fp32" in step.label


def test_measured_step_time_extends_beyond_the_grid_and_broadcasts():
    step = b.step_time_from_records(decode_points())
    assert step(64, 64 * 8192) == pytest.approx(affine(64, 64 * 8192), rel=1e-9)
    out = step(4, np.array([400, 4000, 40000]))
    assert out.shape == (3,) and np.all(np.diff(out) > 0)
    assert step(1, 0) >= step.floor_s > 0


def test_measured_step_time_drives_the_simulator():
    step = b.step_time_from_records(decode_points())
    result = b.compare(varied(50), 8, step)
    assert result["continuous"]["slot_utilisation"] > result["static"]["slot_utilisation"]


def test_measured_time_functions_refuse_bad_points():
    with pytest.raises(LabError, match="no measured"):
        b.step_time_from_records([])
    with pytest.raises(LabError, match="grid"):
        b.step_time_from_records(decode_points()[:-1])
    with pytest.raises(LabError, match="different devices"):
        b.step_time_from_records(decode_points() + decode_points(batches=(64,), device="cuda"))
    with pytest.raises(LabError, match="time_s"):
        b.step_time_from_records([{"batch": 1, "context_tokens": 1}])


def test_measured_prefill_time_is_linear_between_and_beyond_points():
    points = [{"prompt_tokens": P, "time_s": 0.05 + P * 1e-4, "device": "cpu"} for P in (256, 1024, 2048)]
    prefill = b.prefill_time_from_records(points)
    assert prefill(np.array([512, 4096])) == pytest.approx([0.05 + 0.0512, 0.05 + 0.4096])
    assert prefill(np.array([1]))[0] > 0
