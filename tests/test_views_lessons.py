"""Lessons 02-04's views build headless; toggles and measuring controls redraw or report errors."""
import pytest

pytest.importorskip("plotly")
pytest.importorskip("ipywidgets")

from labkit import explore, views  # noqa: E402
from labkit import roofline as r  # noqa: E402
from labkit.errors import LabError  # noqa: E402
from labkit.specs import get_gpu, get_model  # noqa: E402

EIGHT_B, H100 = get_model("llama-3.1-8b"), get_gpu("H100-SXM")


def test_counting_toggle_moves_the_crossover_and_reports_errors():
    models, grid = [EIGHT_B, get_model("llama-3.1-70b")], explore.log_grid(128, 262144, 16)
    fig = views.share_figure(explore.share_curves(models, grid), "t")
    view = views.ToggleView("counting", {"full": r.CHAPTER, "causal": r.Counting("causal", "all"), "bad": None}, fig,
                            lambda c: views.set_share_curves(fig, explore.share_curves(models, grid, c)))
    before = fig.data[2].x[0]
    view.toggle.value = r.Counting("causal", "all")
    assert fig.data[2].x[0] == pytest.approx(r.crossover_tokens(EIGHT_B, r.Counting("causal", "all"))) != before
    view.toggle.value = None
    assert "⚠" in view.error.widget.value


def test_band_and_recordings_append_after_a_slider_labs_traces():
    lab = views.SliderLab({"prompt_tokens": views.int_slider("P", 64, 64, 128, 64)}, lambda **v: {}, 
                          {"prompt_tokens": [64, 128], "predicted_time_s": [1, 2]}, "prompt_tokens", "P", "t")
    views.add_band(lab.figure, [64, 128], [1, 1.5], [1, 2], "linear only", "attention", row=1)
    views.add_recorded(lab.figure, [{"label": "recorded: H200, 2026-01-02", "x": [64], "y": [0.5]}], row=1)
    assert [t.name for t in lab.figure.data[4:]] == ["linear only", "attention", "recorded: H200, 2026-01-02"]
    views.add_recorded(lab.figure, [{"label": "r", "x": [1, 2], "y": [3, 4], "host_bound": [False, True]}])
    assert list(lab.figure.data[-1].marker.symbol) == ["diamond", "diamond-open"]
    assert list(lab.figure.data[-1].hovertext) == ["", explore.HOST_BOUND_NOTE]


def test_static_figures_build():
    views.prefill_terms_figure(explore.prefill_terms(EIGHT_B, [1024, 32768]), "t")
    views.cost_bars_figure(explore.prefill_cost_table(EIGHT_B, H100, [2048, 32768]), "t")
    views.traffic_figure(explore.attention_traffic([1024, 2048], 32, 8, 128), "t")
    views.error_histogram_figure([{"dtype": "fp32", "max_abs_error": 1e-6, "mean_abs_error": 1e-8,
                                   "abs_errors": [0.0, 1e-6]}], "t")
    series = explore.memory_series([{"method": "naive", "tokens": 8, "peak_bytes": 600, "device_name": "cpu"},
                                    {"method": "naive", "tokens": 16, "refused": "no", "device": "cpu"}], 1, [8, 16])
    views.memory_figure(series, 1000, "t")
    bands = explore.regime_bands()
    views.cache_share_figure(explore.cache_share_curves(EIGHT_B, [1024, 8192], [1, 64]), bands,
                             [{"context_tokens": 8192, "cache_share": 0.81, "label": "x"}], "t")
    views.throughput_figure(explore.throughput_prediction(EIGHT_B, H100, [1, 8], 0, "bf16", "bf16"),
                            {"batch": [1], "tokens_per_s": [10.0], "device_name": "cpu"}, "t")
    assert "<table>" in views.table([{"a": 1, "b": "x"}]).value


def fake_decode(batch, context_tokens, cache_dtype):
    if batch > 8:
        raise LabError("batch too large for this test")
    return {"time_s": 0.02, "predicted_time_s": 0.01, "tokens_per_s": batch / 0.02, "batch": batch, "bytes": 1000,
            "cache_share": 0.8, "regime": "cache-dominated", "context_tokens": context_tokens,
            "cache_dtype": cache_dtype, "device": "cpu", "device_name": "test cpu"}


def test_decode_lab_redraws_on_any_control_and_shows_errors():
    controls = {"batch": views.int_slider("B", 1, 1, 16), "context_tokens": views.int_slider("S", 0, 0, 100),
                "cache_dtype": views.toggle("cache", ["fp32", "int8"])}
    lab = views.MeasureLab(controls, fake_decode, views.decode_readout_figure(explore.regime_bands()), views.draw_decode)
    controls["cache_dtype"].value = "int8"
    assert list(lab.figure.data[0].y) == [20.0, 10.0] and lab.figure.data[2].x[0] == 0.8
    assert "cache-dominated" in lab.figure.data[2].text[0] and lab.records[-1]["cache_dtype"] == "int8"
    controls["batch"].value = 12
    assert "batch too large" in lab.error.widget.value and len(lab.records) == 1


def test_progress_callback_moves_the_bar():
    bar, advance = views.progress(3)
    advance(2, 3)
    assert bar.value == 2 and bar.max == 3
