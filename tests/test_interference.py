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


@pytest.mark.parametrize("chunk", [None, 384])
def test_the_untimed_warm_up_prefills_one_chunk_of_the_timed_size(monkeypatch, chunk):
    """A CPU prefill's first pass at a size faults in fresh pages that later passes reuse; a
    smaller warm-up left that cost inside the timed stall (457-533 against 391-399 ms on lab-cpu)."""
    built = sweeps.get_built_model(SIZES["model"], SIZES["device"])
    calls = []
    real = built.prefill_slot

    def spy(slot, tokens, cache=None, *, start=0):
        calls.append((len(tokens), start))
        return real(slot, tokens, cache, start=start)

    monkeypatch.setattr(built, "prefill_slot", spy)
    sizes = {**SIZES, "prompt_tokens": 768}  # chunks past the 256 tokens that once warmed up
    i.run_timeline(chunk_tokens=chunk, **sizes)
    size = chunk or 768
    assert calls[0] == (size, 0)  # the warm-up, before any timed chunk, and only before the first run
    runs = (len(calls) - 1) // (768 // size)
    assert runs >= 1 and calls[1:] == [(size, start) for start in range(0, 768, size)] * runs


def test_summary_keys_carry_units_and_are_consistent():
    s = i.run_timeline(chunk_tokens=100, **SIZES).summary()
    assert s["chunks"] == 3 and s["chunk_tokens"] == 100 and s["device"] == "cpu"
    assert 0 < s["itl_undisturbed_s"] <= s["itl_p99_s"] <= s["itl_max_s"]
    assert 0 < s["prefill_compute_s"] <= s["prefill_wall_s"]


def test_each_chunk_records_the_hosts_time_to_issue_it_and_a_gpus_host_bound_chunks_are_counted():
    """On the CPU the host does the work, so issuing a chunk is its whole span and no chunk is
    called host-bound; on CUDA a chunk is host-bound when issuing it took timing.HOST_BOUND_FRACTION
    of its span, and the lesson's status line says how many were."""
    from labkit import explore
    line = i.run_timeline(chunk_tokens=64, **SIZES)
    assert len(line.chunk_host_s) == 4
    assert all(0 < h <= end - start for h, (start, end) in zip(line.chunk_host_s, line.chunk_spans_s))
    assert line.summary()["chunks_host_bound"] is None
    gpu = i.Timeline(256, 64, 3, 64, "llama-3.1-8b", "cuda", "NVIDIA H200", decode_end_s=[0.0, 0.01, 0.02, 0.09, 0.1,
                     0.16, 0.17, 0.2, 0.21, 0.22], chunk_spans_s=[(0.021, 0.08), (0.101, 0.15)], chunk_host_s=[0.058, 0.01])
    summary = gpu.summary()
    assert summary["chunks_host_bound"] == 1  # 58 of 59 ms issuing; then 10 of 49 ms
    status = explore.chunk_view(lambda chunk_tokens: gpu, gpu, 64)["status"]
    assert status.endswith("; host-bound: 1 of 2 chunks waited for Python to launch their work, so their time "
                           "measures the host, not the GPU")
    assert "host-bound" not in explore.chunk_view(lambda chunk_tokens: line, line, 64)["status"]


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


def test_a_cpu_timeline_starts_after_a_quiet_moment_and_says_how_busy_the_machine_was(monkeypatch):
    """Lesson 06's stall in Chromium measured 544 ms where a terminal measured 391-399: the browser
    drawing the cell before stretched the one timeline. It waits for a quiet moment first, records
    other processes' share of the cores while it ran, and its status line and reveal say so when
    it passed timing.OTHERS_BUSY_LIMIT."""
    from labkit import explore, predict, timing
    waits = []
    monkeypatch.setattr(timing, "wait_for_quiet", lambda wait_s: waits.append(wait_s) or True)
    monkeypatch.delenv("LABKIT_QUIET_WAIT_S", raising=False)
    monkeypatch.setattr(i.cpu_info, "others_busy_share", lambda start, min_wall_s=0.0: 0.3)
    line = i.run_timeline(chunk_tokens=64, **SIZES)
    assert waits == [timing.QUIET_WAIT_S] * line.runs  # before each run
    summary = line.summary()
    assert summary["others_busy_share"] == 0.3 and summary["disturbed"]
    busy = "other programs (a browser drawing?) kept 30% of the cores busy while it was timed"
    assert explore.chunk_view(lambda chunk_tokens: line, line, 64)["status"].endswith(busy)
    assert predict.reveal_stall(100.0, lambda: line, device="cpu")["gap"].endswith(busy + ".")
    monkeypatch.setattr(i.cpu_info, "others_busy_share", lambda start, min_wall_s=0.0: 0.05)
    quiet = i.run_timeline(chunk_tokens=64, **SIZES)
    assert not quiet.summary()["disturbed"]
    assert "other programs" not in explore.chunk_view(lambda chunk_tokens: quiet, quiet, 64)["status"]


def test_a_timeline_that_would_not_fit_is_refused_before_its_caches_are_made(monkeypatch):
    """Both caches and the prefill of one chunk are checked together before either cache is
    allocated: under a 640 MiB limit lesson 06's kernel was killed by the OOM killer mid-prefill."""
    from labkit import backend, sweeps
    from labkit.errors import FootprintError
    built = sweeps.get_built_model("lab-tiny", "cpu")
    monkeypatch.setattr(backend, "free_memory_bytes", lambda device: 1 << 10)
    monkeypatch.setattr(built, "make_cache", lambda *a, **k: pytest.fail("a cache was allocated"))
    with pytest.raises(FootprintError, match=r"^2 streams' caches of \d+ tokens, a 64-token prompt's cache and its "
                                             r"prefill 16 tokens at a time needs "):
        i.run_timeline(model="lab-tiny", device="cpu", streams=2, context_tokens=32, prompt_tokens=64,
                       chunk_tokens=16)


def test_the_slider_at_the_whole_prompt_is_told_apart_from_the_unchunked_run():
    """Lesson 06's chunk slider reaches the prompt's length: that run was also named 'no chunking',
    so its bars stacked on the unchunked run's and the table showed two 'no chunking' rows."""
    from labkit import explore
    unchunked, whole = i.run_timeline(**SIZES), i.run_timeline(chunk_tokens=SIZES["prompt_tokens"], **SIZES)
    assert not whole.chunked and whole.chunk_asked == SIZES["prompt_tokens"] and unchunked.chunk_asked is None
    names = explore.interference_bars([unchunked, whole])["names"]
    assert names == ["no chunking", "one chunk of 256 tokens (the whole prompt)"]
    assert [row["run"] for row in explore.interference_rows([unchunked, whole])] == names
    assert explore.interference_series(i.run_timeline(chunk_tokens=64, **SIZES))["name"] == "chunks of 64 tokens"


def _paced(monkeypatch, seconds_a_chunk: list[float]):
    """lab-tiny's timeline on a clock of its own: a chunk takes seconds_a_chunk[k] in the k-th
    timed run, a decode step 1 ms (the warm-up's calls take none). Returns the streams' cache
    length at each timed decode step, in order."""
    built = sweeps.get_built_model(SIZES["model"], SIZES["device"])
    real_prefill, real_decode = built.prefill_slot, built.decode_step
    now, timed, runs, lengths = [0.0], [False], [0], []

    class Clock:
        def __init__(self, kind):
            timed[0], runs[0] = True, runs[0] + 1

        def now(self):
            return now[0]

        elapsed = now

    def prefill(slot, tokens, cache=None, *, start=0):
        if timed[0]:
            now[0] += seconds_a_chunk[runs[0] - 1]
        return real_prefill(slot, tokens, cache, start=start)

    def decode(tokens, cache):
        if timed[0]:
            lengths.append(cache.host_lengths[0])
            now[0] += 0.001
        return real_decode(tokens, cache)

    monkeypatch.setattr(i, "_Clock", Clock)
    # a quiet machine, whatever the other test workers do: no busy clause after the status line's own
    monkeypatch.setattr(i.cpu_info, "others_busy_share", lambda start, min_wall_s=0.0: 0.0)
    monkeypatch.setattr(i.timing, "wait_for_quiet", lambda max_wait_s: True)
    monkeypatch.setattr(built, "prefill_slot", prefill)
    monkeypatch.setattr(built, "decode_step", decode)
    return lengths


def test_a_timeline_is_timed_until_two_runs_agree_on_its_prefill_and_the_fastest_is_kept(monkeypatch):
    """Lesson 06's one timed run a side made chunking look free: `make report` timed the unchunked
    4,096-token prefill at 634 ms where later runs took 444-460, and the chunked one (491 ms) beat
    it. A slow first run is timed again; two runs within timing.CONFIRM_TOLERANCE end it."""
    from labkit import explore
    lengths = _paced(monkeypatch, [0.2, 0.05, 0.054, 1.0])
    line = i.run_timeline(chunk_tokens=64, **SIZES)  # 4 chunks a run
    assert (line.runs, line.confirmed) == (3, True)
    assert line.summary()["prefill_compute_s"] == pytest.approx(4 * 0.05)  # the second run's, the fastest
    # each run's decode steps read what the first run's read: the streams' cache starts again
    # after the untimed warm-up step, every time
    first = SIZES["context_tokens"] + 1
    assert lengths == list(range(first, first + i.BEFORE_STEPS + 4 + i.AFTER_STEPS)) * 3
    assert "not confirmed" not in explore.chunk_view(lambda chunk_tokens: line, line, 64)["status"]


def test_runs_that_never_agree_stop_at_max_runs_and_the_status_line_says_so(monkeypatch):
    from labkit import explore
    _paced(monkeypatch, [0.06, 0.02, 0.12, 0.24])
    line = i.run_timeline(chunk_tokens=64, **SIZES)
    assert (line.runs, line.confirmed) == (i.MAX_RUNS, False)
    assert line.summary()["prefill_compute_s"] == pytest.approx(4 * 0.02)  # the second run's, the fastest
    status = explore.chunk_view(lambda chunk_tokens: line, line, 64)["status"]
    assert status.endswith(f"; not confirmed: the fastest of {i.MAX_RUNS} runs is shown, and no other prefill came "
                           "within 10% of it")
    with pytest.raises(LabError, match="max_runs must be a positive integer, got 0"):
        i.run_timeline(chunk_tokens=64, max_runs=0, **SIZES)
