"""Chunked prefill among decoding streams: the timeline's structure, its measured gaps, and the
caches it leaves behind. Runs the tiny model on the CPU (well under a second a timeline)."""
import numpy as np
import pytest

from labkit import interference as i
from labkit import sweeps
from labkit.errors import LabError

SIZES = dict(model="lab-tiny", streams=3, context_tokens=64, prompt_tokens=256, device="cpu")


def test_unchunked_runs_the_prompt_in_one_pass_between_two_decode_steps():
    line = i.run_timeline(**SIZES)
    assert not line.chunked and len(line.chunk_spans_s) == 1
    assert len(line.decode_end_s) == i.BEFORE_STEPS + 1 + i.AFTER_STEPS
    (start, end), = line.chunk_spans_s
    before = line.decode_end_s[i.BEFORE_STEPS - 1]
    after = line.decode_end_s[i.BEFORE_STEPS]
    # the gap that spans the prefill contains it whole
    assert before <= start < end <= after
    assert line.gaps_s().max() >= end - start


def test_chunked_interleaves_one_decode_step_after_every_chunk():
    line = i.run_timeline(chunk_tokens=64, **SIZES)
    assert line.chunked and len(line.chunk_spans_s) == 4
    assert len(line.decode_end_s) == i.BEFORE_STEPS + 4 + i.AFTER_STEPS
    ends = np.array(line.decode_end_s[i.BEFORE_STEPS:i.BEFORE_STEPS + 4])
    starts = np.array([s for s, _ in line.chunk_spans_s])
    assert np.all(np.diff(line.decode_end_s) > 0)
    assert np.all(starts[1:] >= ends[:-1])  # chunk k + 1 starts after the decode step after chunk k


def test_summary_keys_carry_units_and_are_consistent():
    s = i.run_timeline(chunk_tokens=100, **SIZES).summary()
    assert s["chunks"] == 3 and s["chunk_tokens"] == 100 and s["device"] == "cpu"
    assert 0 < s["itl_undisturbed_s"] <= s["itl_p99_s"] <= s["itl_max_s"]
    assert 0 < s["prefill_compute_s"] <= s["prefill_wall_s"]


def test_the_models_own_cache_is_left_alone():
    """The streams and the long prompt get caches of their own, passed to each call: the shared,
    cached model's default cache is never swapped out nor written."""
    built = sweeps.get_built_model("lab-tiny", "cpu")
    before = built.cache  # None after an earlier test released it
    lengths = None if before is None else list(before.host_lengths)
    i.compare(64, **SIZES)
    assert built.cache is before and (before is None or before.host_lengths == lengths)


def test_a_chunk_longer_than_the_prompt_means_no_chunking():
    line = i.run_timeline(chunk_tokens=10_000, **SIZES)
    assert not line.chunked and line.chunk_tokens == SIZES["prompt_tokens"]


@pytest.mark.parametrize("bad", [dict(streams=0), dict(prompt_tokens=-1), dict(chunk_tokens=0),
                                 dict(context_tokens=1.5)])
def test_bad_sizes_are_refused(bad):
    with pytest.raises(LabError):
        i.run_timeline(**{**SIZES, **bad})


def test_settings_for_both_devices():
    from labkit import sizes
    for device in ("cpu", "cuda"):
        s = sizes.chunking(device)
        low, high, step = s["chunk_range"]
        assert low <= s["chunk_tokens"] <= high and s["prompt_tokens"] <= high
    with pytest.raises(LabError, match="known: cpu, cuda"):
        sizes.chunking("tpu")
