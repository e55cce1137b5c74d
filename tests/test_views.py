"""Views build headless; a slider move changes the chart; errors land under the widget."""
import pytest

pytest.importorskip("plotly")
pytest.importorskip("ipywidgets")

from labkit import explore, views  # noqa: E402
from labkit.errors import LabError  # noqa: E402
from labkit.specs import get_gpu, get_model  # noqa: E402


def fake_measure(prompt_tokens):
    """Stands in for sweeps.measure_prefill: a record with the keys views read."""
    if prompt_tokens > 500:
        raise LabError("prompt too long for this test")
    return {"prompt_tokens": prompt_tokens, "time_s": 1e-3 * prompt_tokens, "predicted_time_s": 8e-4 * prompt_tokens,
            "device": "cpu", "device_name": "test cpu", "bound": "compute", "spread": 0.01, "noisy": False}


def make_lab():
    slider = views.int_slider("P", 100, 10, 1000, 10)
    predicted = {"prompt_tokens": [10, 1000], "predicted_time_s": [8e-3, 0.8]}
    return views.SliderLab({"prompt_tokens": slider}, fake_measure, predicted, "prompt_tokens", "P", "t")


def test_slider_move_adds_a_measured_point_and_residual():
    lab = make_lab()
    lab.controls["prompt_tokens"].value = 200
    assert list(lab.figure.data[1].x) == [200]
    assert lab.figure.data[3].y[0] == pytest.approx(0.25)  # 1.0 / 0.8 - 1
    assert "measured" in lab.error.widget.value and lab.error.last_error is None


def test_error_in_callback_shows_one_line_and_keeps_the_chart():
    lab = make_lab()
    lab.controls["prompt_tokens"].value = 200
    lab.controls["prompt_tokens"].value = 900
    assert "prompt too long" in lab.error.widget.value
    assert "Traceback" not in lab.error.widget.value
    assert list(lab.figure.data[1].x) == [200]


def test_sliders_fire_only_on_release():
    assert make_lab().controls["prompt_tokens"].continuous_update is False


def test_noisy_points_are_drawn_apart():
    lab = make_lab()
    lab.records = [dict(fake_measure(100), noisy=True)]
    views.set_measured(lab.figure, explore.measured_series(lab.records, "prompt_tokens"))
    assert list(lab.figure.data[2].x) == [100] and list(lab.figure.data[1].x) == []


def test_the_tallest_residual_bar_ends_below_the_frame():
    lab = make_lab()
    lab.records = [fake_measure(100), fake_measure(200)]
    series = explore.measured_series(lab.records, "prompt_tokens")
    views.set_measured(lab.figure, series)
    low, high = lab.figure.layout.yaxis2.range
    top = max(series["residual"], key=abs)
    assert (low < top < 0 or 0 < top < high) and abs(top) < 0.95 * max(abs(low), abs(high))
    assert views.measured.residual_range([0.47, 0.5]) == [0.0, 0.55]
    assert views.measured.residual_range([-0.2, 0.3]) == [-0.25, 0.35] and views.measured.residual_range([]) is None


def test_roofline_figure_places_both_phases():
    model, gpu = get_model("llama-3.1-8b"), get_gpu("H100-SXM")
    fig = views.roofline_figure([explore.roofline_curve(gpu)], [explore.phase_points(model, gpu, 2000, 1)], "t")
    bounds = [t for t in fig.data[2].text]
    assert "compute-bound" in bounds[0] and "memory-bound" in bounds[1]
    # decode sits near the left edge (about 1 FLOP/byte on a grid from 0.1): its label runs right
    assert list(fig.data[2].textposition) == ["top center", "top right"]


def test_importing_views_skips_jsonschemas_iri_grammars_but_leaves_them_importable():
    """Every lesson's kernel imports labkit.views; rfc3987_syntax's grammars cost 3-5 s of it."""
    import subprocess
    import sys

    code = ("import sys, importlib.util; import labkit.views; "
            "print('lark' in sys.modules, 'nbformat' in sys.modules); "
            "spec = importlib.util.find_spec('rfc3987_syntax'); "
            "print(spec is None or importlib.import_module('rfc3987_syntax') is not None)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.split()
    assert out == ["False", "True", "True"], out


def test_a_point_above_its_roof_says_why_in_the_status_line():
    lab = views.SliderLab({"prompt_tokens": views.int_slider("P", 100, 10, 1000, 10)},
                          lambda prompt_tokens: {**fake_measure(prompt_tokens), "roof_fraction": 1.2},
                          {"prompt_tokens": [10, 1000], "predicted_time_s": [8e-3, 0.8]}, "prompt_tokens", "P", "t")
    lab.controls["prompt_tokens"].value = 200
    assert "120% of the calibrated roof" in lab.error.widget.value and "calibrate --refresh" in lab.error.widget.value
    host = views.SliderLab({"prompt_tokens": views.int_slider("P", 100, 10, 1000, 10)},
                           lambda prompt_tokens: {**fake_measure(prompt_tokens), "host_bound": True},
                           {"prompt_tokens": [10, 1000], "predicted_time_s": [8e-3, 0.8]}, "prompt_tokens", "P", "t")
    host.controls["prompt_tokens"].value = 200
    assert explore.HOST_BOUND_NOTE in host.error.widget.value and "calibrated roof" not in host.error.widget.value
    plain = make_lab()  # records without roof_fraction, or under the roof: no note
    plain.controls["prompt_tokens"].value = 200
    assert "calibrated roof" not in plain.error.widget.value


def test_measured_vs_predicted_shows_the_plan_beside_the_roof_and_where_the_tier_changes():
    """Issue 13, items 1 and 6: the chapter's planning line (trace 4, after the four the measured
    points update) and a labelled mark where the working set leaves a cache; the hover and the
    status line give each point's fraction of its roof beside the plan."""
    from labkit.specs import HardwareSpec
    mib = 2**20
    cpu = HardwareSpec("a CPU", None, None, None, None, 300e9, 12e9, 24e9, kind="calibrated",
                       cache_levels=(("L2", 4 * mib), ("L3", 480 * mib)), memory_name="DRAM",
                       bandwidth_by_working_set=((mib, 140e9), (4 * mib, 107e9), (8 * mib, 57e9), (32 * mib, 50e9),
                                                 (64 * mib, 12e9), (2048 * mib, 12e9)))
    predicted = explore.context_prediction(get_model("lab-tiny"), cpu, list(range(0, 8193, 256)), 64, "fp32", "fp32")
    lab = views.SliderLab({"context_tokens": views.int_slider("S", 256, 0, 8192, 256)},
                          lambda context_tokens: {**fake_measure(100), "context_tokens": context_tokens,
                                                  "roof_fraction": 0.6, "bound": "memory", "roof_tier": "L3",
                                                  "plan_fraction": 0.75},
                          predicted, "context_tokens", "S", "t")
    fig = lab.figure
    assert fig.data[4].name == explore.PLAN_LABEL and fig.data[4].line.dash == "dashdot"
    # Never drawn like a prediction's dashed linear term (lesson 02's band), nor in its blue.
    assert fig.data[4].line.color != views.LINEAR["color"]
    assert list(fig.data[4].y) == predicted["planned_time_s"]
    assert "L2 then L3 then DRAM bandwidth" in fig.data[0].name
    labels = [a.text for a in fig.layout.annotations]
    assert "past the L2: L3" in labels and "past the L3: DRAM" in labels
    marks = [s for s in fig.layout.shapes if s.type == "line"]
    assert len(marks) == 2 * len(predicted["tiers"])  # on the time and the residual rows
    lab.controls["context_tokens"].value = 512
    assert "0.60 of the memory-bound roof (L3 bandwidth; the chapter plans 0.75)" in fig.data[1].hovertext[0]
    assert "0.60 of the memory-bound roof (L3 bandwidth; the chapter plans 0.75)" in lab.error.widget.value
    plain = make_lab().figure  # a prediction without the plan: the four traces as before
    assert len(plain.data) == 4 and not plain.layout.shapes


def test_the_decode_readout_and_throughput_charts_show_the_plan():
    fig = views.decode_readout_figure(explore.regime_bands())
    views.draw_decode(fig, {"time_s": 0.02, "predicted_time_s": 0.01, "planned_time_s": 0.0133, "tokens_per_s": 200.0,
                            "batch": 4, "bytes": 1e9, "cache_share": 0.5, "regime": "mixed", "context_tokens": 10,
                            "cache_dtype": "fp32", "device": "cpu"})
    assert list(fig.data[0].x) == ["measured", "roofline", "chapter's plan"] and len(fig.data[1].y) == 3
    assert list(fig.data[2].text) == ["50% (500 MB of 1.00 GB): mixed"], "bytes with an SI prefix, not '0.5 of 1 GB'"
    model, gpu = get_model("llama-3.1-8b"), get_gpu("H100-SXM")
    through = views.throughput_figure(explore.throughput_prediction(model, gpu, [1, 8], 0, "bf16", "bf16"),
                                      explore.throughput_series([]), "t")
    assert explore.PLAN_LABEL in [t.name for t in through.data]
