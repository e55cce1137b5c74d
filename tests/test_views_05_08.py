"""Lessons 05-08's chart data and widgets build headless, and a slider move redraws them."""
import html
from functools import partial

import numpy as np
import pytest

pytest.importorskip("plotly")
pytest.importorskip("ipywidgets")

from labkit import batching, explore, interference, recordings, sizes, traces, views, workloads  # noqa: E402
from labkit.errors import LabError, SpecError  # noqa: E402
from labkit.specs import get_gpu, get_model  # noqa: E402


def affine(batch, tokens):
    return 0.01 + 0.001 * np.asarray(batch, dtype=float) + 1e-7 * np.asarray(tokens, dtype=float)


def test_trace_requests_falls_back_to_the_committed_figures_and_says_so(tmp_path):
    trace, note = traces.first_or_sampled(tmp_path, "conv", 50)
    assert len(trace) == 50 and "not found" in note and "histograms" in note


def test_no_gpu_recording_is_reported_not_raised(tmp_path):
    assert recordings.gpu_decode_points(tmp_path / "missing") == ([], f"no recordings folder at {tmp_path / 'missing'}")
    points, why = recordings.gpu_decode_points(tmp_path)
    assert points == [] and "no GPU decode recording" in why


def test_batching_lab_redraws_on_release():
    sets = {"mix": workloads.chapter_mix(2, prompt_scale=8), "backlog": batching.as_backlog(workloads.chapter_mix(1))}
    lab = views.BatchingLab(partial(explore.batching_bars, sets, step_time_s=affine), 4, 1, 32, "t")
    before = list(lab.figure.data[0].y)
    assert "simulated at max batch 4; continuous / static throughput: mix " in lab.error.widget.value
    lab.slider.value = 12
    assert lab.error.last_error is None and list(lab.figure.data[0].x) == ["mix", "backlog"]
    assert list(lab.figure.data[0].y) != before
    assert all(0 < u <= 100 for u in lab.figure.data[2].y)  # continuous utilisation
    bars = explore.batching_bars(sets, 12, step_time_s=affine)  # the status line follows the slider
    gains = [c / s for s, c in zip(bars["static"]["tokens_per_s"], bars["continuous"]["tokens_per_s"])]
    fits = "".join(f"; {name}: all {n} requests fit in one batch, so no seat is refilled and both use their seats"
                   " alike (continuous is faster only because finished sequences leave its steps)"
                   for name, n in (("mix", 12), ("backlog", 6)))
    assert explore.batching_line(bars) == (f"simulated at max batch 12; continuous / static throughput: "
                                           f"mix {gains[0]:.2f}x, backlog {gains[1]:.2f}x" + fits)
    assert explore.batching_line(bars) in html.unescape(lab.error.widget.value)


def test_lesson_05s_what_to_look_for_holds_on_its_own_request_sets():
    """Lesson 05's sentences under its batching chart, on the lesson's chapter-shapes set (a backlog):
    static batching mostly loses utilisation as the limit grows; continuous keeps its seats busier
    while requests wait; raising the limit empties its seats too (the drain); and from the limit
    that holds every request the two policies' utilisations tie, which the status line says, while
    continuous stays faster. A step time that grows with the batch, as measured ones do."""
    rows = batching.as_backlog(workloads.chapter_mix(8, prompt_scale=sizes.CPU_SHAPE_SCALE))
    n = len(rows)
    util = {limit: batching.compare(rows, limit, affine) for limit in (2, 16, 32, n - 1, n, 2 * n)}
    static = {limit: r["static"]["slot_utilisation"] for limit, r in util.items()}
    continuous = {limit: r["continuous"]["slot_utilisation"] for limit, r in util.items()}
    assert static[2] > static[16] > static[32]
    assert continuous[16] > static[16] and continuous[32] > static[32]
    assert continuous[2] > continuous[16] > continuous[32] > continuous[n - 1]
    assert continuous[n - 1] > static[n - 1]  # one request still waits for a seat
    for limit in (n, 2 * n):
        assert continuous[limit] == pytest.approx(static[limit])
        # ...and continuous still wins on time: its finished sequences leave the batch, static's ride along
        assert util[limit]["throughput_ratio"] > 1.05
        line = explore.batching_line(explore.batching_bars({"chapter shapes": rows}, limit, affine))
        assert f"chapter shapes: all {n} requests fit in one batch" in line
    below = explore.batching_bars({"chapter shapes": rows}, n - 1, affine)
    assert "fit in one batch" not in explore.batching_line(below)


def test_split_lab_follows_the_dropdown_and_the_batch():
    model = get_model("llama-3.1-8b")
    lab = views.SplitLab(lambda g, b: explore.predicted_split(model, get_gpu(g), b), ["H100-SXM", "H200"], "H100-SXM", 1, 256)
    chat_alone = lab.figure.data[0].x[0]
    lab.batch.value = 64
    assert lab.figure.data[0].x[0] > chat_alone and "batch 64" in lab.figure.layout.title.text
    lab.gpu.value = "H200"
    assert "H200" in lab.figure.layout.title.text
    assert len(explore.lever_rows()) == len(workloads.WORKLOADS)


def test_a_narrow_split_bar_is_labelled_inside_its_neighbour():
    """Lesson 07's 2-3% bars clipped their own labels to a sliver: a share under NARROW_PCT is
    named in the wide bar beside it, and every share still appears once on the chart."""
    split = {"titles": ["Chat", "Summarise", "Even"], "prefill_pct": [2.4, 97.0, 50.0],
             "decode_pct": [97.6, 3.0, 50.0], "label": "t"}
    fig = views.split_figure(split, "t")
    assert list(fig.data[0].text) == ["", "97% (decode 3%)", "50%"]
    assert list(fig.data[1].text) == ["98% (prefill 2%)", "", "50%"]
    assert {bar.textposition for bar in fig.data} == {"inside"}
    odd = views.split_labels({"prefill_pct": [3.0, 99.7], "decode_pct": [4.0, 0.3]})  # both narrow; under 0.5%
    assert odd == {"prefill_pct": ["3%", "100% (decode <1%)"], "decode_pct": ["4%", ""]}


def test_a_lessons_bad_parameters_are_one_clear_error_before_any_widget():
    """Lesson 07's GPU = "B200" ended in ipywidgets' "Invalid selection: value not found"; a
    start outside a slider's range was clamped, the first chart drawn at the value asked for."""
    model = get_model("llama-3.1-8b")
    split = lambda g, b: explore.predicted_split(model, get_gpu(g), b)  # noqa: E731
    with pytest.raises(SpecError, match=r"^unknown GPU 'B200'; known: H100-SXM, "):
        views.SplitLab(split, ["H100-SXM", "H200"], "B200", 1, 256)
    assert views.SplitLab(split, ["H100-SXM", "H200"], "h200", 1, 256).gpu.value == "H200"  # as get_gpu reads it
    for batch in (0, 257, 2.5, True):
        with pytest.raises(LabError, match=rf"^batch B must start at a whole number in 1..256, got {batch!r}$"):
            views.SplitLab(split, ["H100-SXM"], "H100-SXM", batch, 256)
    with pytest.raises(LabError, match=r"^the number of requests must be a positive integer, got -5$"):
        traces.first_or_sampled("nowhere", "conv", -5)
    with pytest.raises(LabError, match=r"^prompt tokens must be a positive integer, got 0$"):
        explore.phase_points(model, get_gpu("H100-SXM"), 0, 1)
    with pytest.raises(LabError, match=r"^context tokens must be an integer >= 0, got -1$"):
        explore.phase_points(model, get_gpu("H100-SXM"), 2000, 1, context_tokens=-1)


def test_a_decode_point_names_an_empty_cache_rather_than_s_zero():
    model, gpu = get_model("llama-3.1-8b"), get_gpu("H100-SXM")
    labels = [p["label"] for p in explore.phase_points(model, gpu, 2000, 4)]
    assert labels == ["prefill, P=2,000", "decode, B=4, empty cache"]
    assert explore.phase_points(model, gpu, 2000, 4, context_tokens=1024)[1]["label"] == "decode, B=4, S=1,024"


def test_chunk_lab_reruns_the_chunked_timeline():
    sizes = dict(model="lab-tiny", device="cpu", streams=2, context_tokens=32, prompt_tokens=128)
    unchunked = interference.run_timeline(**sizes)
    lab = views.ChunkLab(partial(interference.run_timeline, **sizes), unchunked, 64, 16, 128, 16, "t")
    assert lab.timeline.chunk_tokens == 64
    lab.slider.value = 32
    assert lab.error.last_error is None and lab.timeline.chunk_tokens == 32
    assert list(lab.bars.data[0].x) == ["no chunking", "chunks of 32 tokens"]
    assert len(explore.interference_rows([unchunked, lab.timeline])) == 2
    # the table (shown in its own cell) follows the slider too, not the chunk it was built with
    assert lab.table.value == views.table_html(explore.interference_rows([unchunked, lab.timeline]))
    assert "chunks of 32 tokens" in lab.table.value and "chunks of 64 tokens" not in lab.table.value


def test_scaled_shapes_keep_a_decode_phase_and_fit_the_cpu_model():
    shapes = explore.scaled_shapes(sizes.CPU_SHAPE_SCALE)
    limit = get_model("lab-cpu").max_context
    assert all(s["output_tokens"] >= 2 and s["prompt_tokens"] + s["output_tokens"] <= limit for s in shapes)


def test_scaled_shapes_keep_each_shapes_balance_of_reading_and_writing():
    """Lesson 07: dividing prompt and answer by 8 keeps each shape's decode steps per prompt token.
    Dividing the answer's tokens (rounded, at least 2) left classification 1 step for 125 prompt
    tokens where the full shape has 19 for 1,000: 0.42 of its balance."""
    balance = explore.scaled_balance(sizes.CPU_SHAPE_SCALE)
    assert set(balance) == set(workloads.WORKLOADS)
    assert all(0.8 <= kept <= 1.15 for kept in balance.values()), balance
    assert explore.scaled_balance(1) == pytest.approx({name: 1.0 for name in workloads.WORKLOADS})


def test_the_chunk_lab_says_what_its_first_run_measured_from_the_start():
    """After Run All, lesson 06's status line stayed empty until the slider was first moved."""
    sizes_ = dict(model="lab-tiny", streams=2, context_tokens=32, prompt_tokens=128, device="cpu")
    unchunked = interference.run_timeline(**sizes_)
    lab = views.ChunkLab(partial(interference.run_timeline, **sizes_), unchunked, 32, 32, 128, 32, "t")
    assert html.unescape(lab.error.widget.value).count("measured on ") == 1 and "worst gap" in lab.error.widget.value
