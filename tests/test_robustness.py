"""Robustness audit: bad and extreme input never ends in a traceback, a hang or a lost file.

* the CLI: hypothesis throws odd numbers, strings and malformed config.json files at it; every
  answer is exit code 0 (valid input) or 2 with exactly one "labkit: error: ..." line on stderr;
* the widgets: a SliderLab on the tiny model, with sliders pushed to and past their bounds and
  measure functions given bad arguments, shows one message under the chart and keeps running;
  a chart's widget state is the whole figure, as a browser that reloads it must see;
* recordings: the same name twice keeps both files; a write that fails leaves nothing behind;
* noisy timings are flagged and drawn apart from trusted points.
"""
from __future__ import annotations

import contextlib
import html
import io
import json
import math
import os
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

pytest.importorskip("plotly")
pytest.importorskip("ipywidgets")
hypothesis = pytest.importorskip("hypothesis")

from hypothesis import HealthCheck, assume, given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

from labkit import calibrate, cli, explore, measure, recordings, sweeps, views  # noqa: E402
from labkit.calibrate import Plan  # noqa: E402
from labkit.errors import LabError  # noqa: E402
from labkit.specs import DTYPES, GPUS, MODELS, get_model  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
TINY_PLAN = Plan(4 * 2**20, {"fp32": (64,), "bf16": (32,), "fp16": (32,)}, warmup=1, repeats=3, budget_s=0.05)
FAST = settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])


@pytest.fixture(autouse=True)
def isolated(monkeypatch, tmp_path):
    """A private labkit cache, the CPU, and a calibration of a fraction of a second."""
    monkeypatch.setenv("LABKIT_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.setenv("LABKIT_DEVICE", "cpu")
    monkeypatch.setitem(calibrate.PLANS, "cpu", TINY_PLAN)


# ------------------------------------------------------------------ the CLI contract
def run_cli(argv: list[str]) -> tuple[int, str, str]:
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        code = cli.main(argv)
    return code, out.getvalue(), err.getvalue()


def assert_contract(argv, code: int, out: str, err: str):
    """0 and nothing on stderr, or 2, nothing on stdout and one "labkit: error:" line."""
    shown = f"{argv!r} -> {code}; stdout {out[:200]!r}; stderr {err[:300]!r}"
    assert "Traceback" not in out + err, shown
    assert code in (0, 2), shown
    if code == 2:
        assert out == "" and err.endswith("\n"), shown
        assert err.count("\n") == 1 and err.startswith("labkit: error: "), shown
    else:
        assert err == "", shown
        if "--json" in argv:
            json.loads(out)  # one JSON object


INT_FLAGS = ("--prompt", "--context", "--batch")
FRACTION_FLAGS = ("--mfu", "--bandwidth-efficiency")
NAME_FLAGS = ("--model", "--gpu", "--cache-dtype", "--weight-dtype", "--compute-dtype", "--counting")
ODD_STRINGS = ["", " ", "nan", "NaN", "inf", "-inf", "1e3", "1e309", "-0", "0x10", "1_000", "٣", "1.5",
               "−1", "+5", " 7 ", "\x00", "9" * 5000, "1" * 4301, "é", "🦙", "\n", "--json", "-x"]
numbers_as_text = st.one_of(
    st.integers(-10**40, 10**40).map(str),
    st.floats(allow_nan=True, allow_infinity=True).map(repr),
    st.sampled_from(ODD_STRINGS),
    st.text(max_size=12),
)
names = st.one_of(st.sampled_from([*MODELS, *GPUS, *DTYPES, "chapter", "kernel", "LLAMA-3.1-8B", "h200"]),
                  st.text(max_size=30), st.sampled_from(ODD_STRINGS)).filter(lambda s: s.lower() != cli.THIS)


@FAST
@given(phase=st.sampled_from(["prefill", "decode"]),
       settings_=st.lists(st.tuples(st.sampled_from(INT_FLAGS + FRACTION_FLAGS), numbers_as_text)
                          | st.tuples(st.sampled_from(NAME_FLAGS), names), max_size=4),
       as_json=st.booleans())
def test_predict_answers_any_flags_with_a_result_or_one_error_line(phase, settings_, as_json):
    argv = ["predict", phase, *(f"{flag}={value}" for flag, value in settings_), *(["--json"] if as_json else [])]
    assert_contract(argv, *run_cli(argv))


@pytest.mark.parametrize("argv", [
    ["predict", "prefill", "--prompt", str(10**40)], ["predict", "decode", "--context", "-1"],
    ["predict", "decode", "--batch", "0"], ["predict", "prefill", "--mfu", "nan"],
    ["predict", "prefill", "--mfu", "inf"], ["predict", "decode", "--bandwidth-efficiency", "-inf"],
    ["predict", "prefill", "--mfu", "5e-324", "--json"], ["predict", "prefill", "--prompt", ""],
    ["predict", "decode", "--model", "🦙"], ["predict", "decode", "--gpu", "H100\n"],
    ["predict", "decode", "--cache-dtype", "fp4"], ["predict", "prefill", "--model", "."],
    ["predict", "prefill", "--model", "/dev/null"], ["gpus", "--json"], ["models"], ["nonsense"],
])
def test_extreme_values_keep_the_contract(argv):
    assert_contract(argv, *run_cli(argv))


@pytest.mark.parametrize("argv", [
    ["measure", "prefill", "--model", "lab-tiny", "--prompt", "0"],
    ["measure", "prefill", "--model", "lab-tiny", "--prompt", "5000"],  # over its max context, 4,096
    ["measure", "decode", "--model", "lab-tiny", "--batch", "4097"],
    ["measure", "decode", "--model", "lab-tiny", "--context", "-3"],
    ["measure", "decode", "--model", "nope"],
])
def test_measure_refuses_bad_shapes_before_running(argv):
    assert_contract(argv, *run_cli(argv))


# ------------------------------------------------------------------ config.json given as --model
VALID_CONFIG = {"hidden_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
                "intermediate_size": 128, "vocab_size": 256, "max_position_embeddings": 4096}
json_values = st.recursive(
    st.none() | st.booleans() | st.integers(-10**400, 10**400) | st.floats() | st.text(max_size=10),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner, max_size=4),
    max_leaves=12)


@st.composite
def config_bytes(draw) -> bytes:
    """A config.json that is valid, mutated (a key removed or given any JSON value), random JSON,
    a valid file cut short, or random bytes."""
    kind = draw(st.sampled_from(["mutated", "json", "truncated", "bytes"]))
    if kind == "json":
        return json.dumps(draw(json_values)).encode()
    text = json.dumps({**VALID_CONFIG, "_name_or_path": draw(st.text(max_size=10))}).encode()
    if kind == "truncated":
        return text[:draw(st.integers(0, len(text)))]
    if kind == "bytes":
        return draw(st.binary(max_size=64))
    config = dict(VALID_CONFIG)
    for key in draw(st.lists(st.sampled_from([*VALID_CONFIG, "head_dim", "rope_theta", "rms_norm_eps",
                                              "tie_word_embeddings", "_name_or_path"]), min_size=1, max_size=3)):
        if key in config and draw(st.booleans()):
            del config[key]
        else:
            config[key] = draw(json_values)
    return json.dumps(config).encode()


@FAST
@given(content=config_bytes(), phase=st.sampled_from(["prefill", "decode"]), as_json=st.booleans())
def test_a_malformed_config_json_is_one_error_line_never_a_traceback(content, phase, as_json):
    with tempfile.TemporaryDirectory() as folder:
        path = Path(folder) / "config.json"
        path.write_bytes(content)
        argv = ["predict", phase, "--model", str(path), "--prompt", "1", "--context", "0",
                *(["--json"] if as_json else [])]
        assert_contract(argv, *run_cli(argv))


@pytest.mark.parametrize("name, content", [
    ("nested", b"[" * 100_000 + b"]" * 100_000),  # json's recursion limit
    ("huge-int", json.dumps({**VALID_CONFIG, "hidden_size": 10**400, "num_attention_heads": 1}).encode()),
    ("huge-vocab", json.dumps({**VALID_CONFIG, "vocab_size": 10**300}).encode()),
    ("huge-rope", json.dumps({**VALID_CONFIG, "rope_theta": 10**400}).encode()),
    ("many-digits", b'{"hidden_size": ' + b"9" * 5000 + b"}"),
    ("not-utf8", b"\xff\xfe{\x00"),
    ("big", b" " * (2**20 + 1)),
])
def test_config_files_that_used_to_raise_are_one_error_line(tmp_path, name, content):
    # Found by this audit: deep nesting raised RecursionError, integers beyond a float
    # raised OverflowError, and a file of any size was read whole.
    path = tmp_path / f"{name}.json"
    path.write_bytes(content)
    argv = ["predict", "decode", "--model", str(path)]
    code, out, err = run_cli(argv)
    assert_contract(argv, code, out, err)
    assert code == 2 and name in err  # the file or the model named after it


def test_a_config_with_a_utf8_byte_order_mark_is_read(tmp_path):
    path = tmp_path / "bom.json"
    path.write_bytes(b"\xef\xbb\xbf" + json.dumps(VALID_CONFIG).encode())
    assert get_model(str(path)).hidden_size == 64


def run_module(*args: str, timeout_s: float = 60) -> subprocess.CompletedProcess:
    """`python -m labkit ...` in a fresh process, stdin closed, with a timeout against hangs."""
    return subprocess.run([sys.executable, "-m", "labkit", *args], cwd=ROOT, capture_output=True, text=True,
                          timeout=timeout_s, stdin=subprocess.DEVNULL)


@pytest.mark.parametrize("model", ["/dev/zero", "/dev/stdin", "fifo"])
def test_a_device_or_pipe_as_config_is_refused_without_reading_it(tmp_path, model):
    # Before: /dev/zero was read until memory ran out, a named pipe waited for a writer forever.
    if model == "fifo":
        model = str(tmp_path / "config.json")
        os.mkfifo(model)
    done = run_module("predict", "prefill", "--model", model)
    assert done.returncode == 2 and done.stdout == "" and "Traceback" not in done.stderr
    assert done.stderr.splitlines() == [f"labkit: error: config file {model!r} is not a regular file"]


@pytest.mark.parametrize("args", [
    ("predict", "prefill", "--prompt", "nan"),
    ("predict", "decode", "--mfu", "inf", "--json"),
    ("predict", "decode", "--model", "/nonexistent/config.json"),
    ("predict", "decode", "--gpu", "\u202eH100"),
])
def test_subprocess_errors_are_one_line_on_stderr(args):
    done = run_module(*args)
    assert done.returncode == 2 and done.stdout == "" and "Traceback" not in done.stderr
    assert len(done.stderr.splitlines()) == 1 and done.stderr.startswith("labkit: error: ")


# ------------------------------------------------------------------ widget callbacks
@pytest.fixture
def prefill_lab():
    """A SliderLab measuring real prefills of the tiny model on the CPU, as lesson 01 builds it."""
    model = get_model("lab-tiny")
    roof, _ = calibrate.load_or_calibrate("cpu")
    grid = list(range(16, 257, 16))
    slider = views.int_slider("prompt length P", 64, 16, 256, 16)
    lab = views.SliderLab({"prompt_tokens": slider}, sweeps.bind_prefill(model, device="cpu", repeats=1),
                          explore.prefill_prediction(model, roof, grid, "fp32"), "prompt_tokens",
                          "prompt tokens P", "prefill")
    return lab


def error_text(lab) -> str:
    return lab.error.widget.value


@pytest.mark.timeout(300)
def test_sliders_at_and_beyond_their_bounds_measure_or_explain(prefill_lab):
    lab, slider = prefill_lab, prefill_lab.controls["prompt_tokens"]
    for value in (slider.max, slider.max + 10_000, slider.min, slider.min - 10_000, 0, -1):
        slider.value = value  # the widget clamps to [min, max]; a change runs one measurement
        assert slider.min <= slider.value <= slider.max
        assert lab.error.last_error is None, error_text(lab)
    assert sorted({r["prompt_tokens"] for r in lab.records}) == [slider.min, slider.max]
    # Past the model's own limit (max context 4,096): the slider allows it, the lab must refuse.
    slider.max = 10_000
    slider.value = 10_000
    assert isinstance(lab.error.last_error, LabError), error_text(lab)
    assert "⚠" in error_text(lab) and "Traceback" not in error_text(lab)
    slider.value = 128  # and the next move measures again
    assert lab.error.last_error is None and lab.records[-1]["prompt_tokens"] == 128


@pytest.mark.timeout(300)
@pytest.mark.parametrize("bad", [
    dict(context_tokens=-5), dict(context_tokens=10**9), dict(cache_dtype="fp4"), dict(cache_dtype=None),
    dict(device="tpu"), dict(nonsense=1),
])
def test_bad_arguments_through_a_slider_lab_show_a_message_and_the_lab_lives(bad):
    model = get_model("lab-tiny")
    measure_fn = sweeps.bind_decode(model, **{"context_tokens": 64, "cache_dtype": "fp32", "device": "cpu",
                                              "repeats": 1, **bad})
    predicted = {"batch": [1, 2], "predicted_time_s": [1e-3, 2e-3]}
    lab = views.SliderLab({"batch": views.int_slider("batch B", 1, 1, 4)}, measure_fn, predicted, "batch", "B", "t")
    lab.controls["batch"].value = 2
    assert lab.error.last_error is not None, f"{bad} was measured: {lab.records}"
    message = error_text(lab)
    assert "⚠" in message and len(message) > len("<span style='color:#b00'>⚠ </span>") + 5
    assert "Traceback" not in message
    assert list(lab.figure.data[1].x) == []  # nothing drawn as measured


@pytest.mark.timeout(300)
def test_a_float_slider_value_reaching_an_integer_shape_is_explained(prefill_lab):
    lab = prefill_lab
    lab.compute = sweeps.bind_prefill(get_model("lab-tiny"), device="cpu", repeats=1)
    float_slider = views.widgets.FloatSlider(value=64.0, min=16.0, max=256.0, step=0.5)
    float_slider.observe(lab.on_change, names="value")
    lab.controls = {"prompt_tokens": float_slider}
    float_slider.value = 64.5
    assert lab.error.last_error is not None and "⚠" in error_text(lab)


def test_a_chart_inside_a_container_holds_its_whole_current_figure_as_widget_state():
    # Voilà, and JupyterLab reopening a notebook, build each widget from the state the kernel
    # reports when the page loads, and they may load after the last change: the chart's state
    # must be the whole current figure, never the figure as first built plus deltas.
    predicted = {"prompt_tokens": [64, 128], "predicted_time_s": [1e-3, 2e-3]}
    lab = views.SliderLab({"prompt_tokens": views.int_slider("P", 64, 64, 128, 64)},
                          lambda prompt_tokens: {"prompt_tokens": prompt_tokens, "time_s": 1e-3,
                                                 "predicted_time_s": 1e-3, "device": "cpu"},
                          predicted, "prompt_tokens", "P", "title")
    lab.prime([{"prompt_tokens": 64}])
    lab.controls["prompt_tokens"].value = 128

    (shown,) = lab.figure.widget.get_state()["outputs"]
    figure = shown["data"]["application/vnd.plotly.v1+json"]
    assert [trace["type"] for trace in figure["data"]] == ["scatter", "scatter", "scatter", "bar"]
    assert figure["data"][1]["x"] == [64, 128]  # the primed point and the slider's, both added after construction
    assert figure["layout"]["title"]["text"] == "title"
    json.dumps(shown)  # what the widget sends is plain JSON


def test_a_chart_is_sent_to_the_browser_only_once_shown_and_then_after_every_change():
    fig = views.measured_vs_predicted_figure("P", {"p": [1, 2], "predicted_time_s": [1.0, 2.0]}, "p", "t")
    fig.add_scatter(x=[1], y=[1])
    assert fig._output.outputs == ()  # built, not shown: nothing sent yet
    assert fig.widget is fig.widget and len(fig.widget.outputs) == 1
    drawn = lambda: fig.widget.outputs[0]["data"]["application/vnd.plotly.v1+json"]  # noqa: E731
    assert len(drawn()["data"]) == 5
    views.add_band(fig, [1, 2], [1, 1], [2, 2], "low", "band", row=1)  # traces added after display
    fig.layout.title = "new title"                                     # a property set outside a batch
    assert len(drawn()["data"]) == 7 and drawn()["layout"]["title"]["text"] == "new title"
    assert fig._repr_mimebundle_()["application/vnd.jupyter.widget-view+json"]["model_id"] == fig.widget.model_id


# ------------------------------------------------------------------ recordings
record_names = st.text(st.characters(blacklist_categories=("Cs",), blacklist_characters="/\\\x00"),
                       min_size=1, max_size=20).filter(lambda n: not n.startswith(".") and n not in (".json",))
payload_values = st.recursive(st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False) | st.text(),
                              lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(), inner, max_size=3),
                              max_leaves=8)


@FAST
@given(name=record_names, payloads=st.lists(st.dictionaries(st.text(max_size=8), payload_values, max_size=4),
                                           min_size=2, max_size=4))
def test_the_same_name_written_again_never_overwrites(name, payloads):
    given_provenance = {"device": "cpu", "date": "2026-01-01T00:00:00+00:00"}
    with tempfile.TemporaryDirectory() as folder:
        try:
            paths = [recordings.write_recording(folder, name, {**p, "provenance": given_provenance}) for p in payloads]
        except OSError as err:  # a name the file system refuses (too long in bytes) is not our concern
            assume(False, f"{err}")
        assert len(set(paths)) == len(payloads) and all(p.exists() for p in paths)
        for path, payload in zip(paths, payloads):
            written = json.loads(path.read_text())
            assert written == {"provenance": given_provenance, **{k: v for k, v in payload.items() if k != "provenance"}}
        assert not [f for f in os.listdir(folder) if f.startswith(".tmp-")]


class Interrupted(Exception):
    pass


@pytest.mark.parametrize("error", [Interrupted, KeyboardInterrupt])
def test_a_write_that_fails_midway_leaves_no_file_at_all(tmp_path, monkeypatch, error):
    real_dump = json.dump

    def half_a_dump(obj, file, **kwargs):
        file.write(json.dumps(obj, **{k: v for k, v in kwargs.items() if k != "default"}, default=str)[:10])
        raise error("disk full, say")

    monkeypatch.setattr(json, "dump", half_a_dump)
    with pytest.raises(error):
        recordings.write_recording(tmp_path, "sweep", {"provenance": {"device": "cpu", "date": "x"}, "x": 1})
    assert os.listdir(tmp_path) == []
    (tmp_path / "kept.json").write_text('{"old": true}')
    with pytest.raises(error):
        recordings.write_json_atomic(tmp_path / "kept.json", {"new": True})
    assert json.loads((tmp_path / "kept.json").read_text()) == {"old": True}  # the old file, whole
    assert os.listdir(tmp_path) == ["kept.json"]
    monkeypatch.setattr(json, "dump", real_dump)


def test_without_hard_links_a_failed_rename_leaves_no_empty_file(tmp_path, monkeypatch):
    # Where links are unsupported the name is reserved with O_EXCL first; if the rename then
    # fails, the reserved (empty) file must go too, or readers would find a broken recording.
    def no_links(*_args):
        raise OSError("links not supported here")

    def failing_replace(*_args):
        raise OSError("rename failed")

    monkeypatch.setattr(os, "link", no_links)
    monkeypatch.setattr(os, "replace", failing_replace)
    with pytest.raises(OSError, match="rename failed"):
        recordings.write_recording(tmp_path, "sweep", {"provenance": {"device": "cpu", "date": "x"}})
    assert os.listdir(tmp_path) == []


def test_without_hard_links_recordings_still_never_overwrite(tmp_path, monkeypatch):
    def no_links(*_args):
        raise OSError("links not supported here")

    monkeypatch.setattr(os, "link", no_links)
    first = recordings.write_recording(tmp_path, "sweep", {"provenance": {"device": "cpu", "date": "x"}, "n": 1})
    second = recordings.write_recording(tmp_path, "sweep", {"provenance": {"device": "cpu", "date": "x"}, "n": 2})
    assert [json.loads(p.read_text())["n"] for p in (first, second)] == [1, 2]
    assert sorted(os.listdir(tmp_path)) == ["sweep-2.json", "sweep.json"]


# ------------------------------------------------------------------ noisy measurements
@FAST
@given(samples=st.lists(st.floats(allow_nan=True, allow_infinity=True), min_size=0, max_size=12))
def test_a_timing_is_refused_or_has_finite_statistics(samples):
    try:
        timing = measure.Timing(tuple(samples))
    except LabError:
        return
    assert all(math.isfinite(s) and s > 0 for s in timing.samples_s)
    assert math.isfinite(timing.median_s) and timing.spread >= 0
    assert timing.noisy == (timing.spread > measure.NOISY_SPREAD)


def test_a_wide_spread_is_flagged_noisy_and_drawn_apart_from_trusted_points():
    steady, noisy = measure.Timing((1.00, 1.01, 0.99)), measure.Timing((0.5, 1.0, 2.0))
    assert not steady.noisy and noisy.noisy and noisy.spread == pytest.approx(1.5)
    records = [{"prompt_tokens": p, "time_s": t.median_s, "predicted_time_s": 0.8, "noisy": t.noisy,
                "spread": t.spread, "device": "cpu"} for p, t in ((64, steady), (128, noisy))]
    fig = views.measured_vs_predicted_figure("P", {"prompt_tokens": [64, 128], "predicted_time_s": [0.8, 0.8]},
                                             "prompt_tokens", "t")
    views.set_measured(fig, explore.measured_series(records, "prompt_tokens"))
    assert list(fig.data[1].x) == [64]  # measured: trusted points only
    assert list(fig.data[2].x) == [128]  # the noisy one, its own pale cross
    # Its residual is no more trustworthy than its time: drawn in the noisy colour, not as fact.
    colors = list(fig.data[3].marker.color)
    assert colors == [views.MEASURED["color"], views.NOISY["color"]]


def test_prime_times_every_point_longest_first_and_only_then_draws():
    """A chart redrawn in the browser takes the cores a point is being timed on: prime measures
    all its settings (the last first), then draws them in their own order."""
    events = []
    predicted = {"prompt_tokens": [64, 128, 192], "predicted_time_s": [1e-3, 2e-3, 3e-3]}

    def measure(prompt_tokens):
        events.append(("measure", prompt_tokens))
        return {"prompt_tokens": prompt_tokens, "time_s": 1e-3, "predicted_time_s": 1e-3, "device": "cpu"}

    lab = views.SliderLab({"prompt_tokens": views.int_slider("P", 64, 64, 192, 64)}, measure,
                          predicted, "prompt_tokens", "P", "title")
    real_add = lab.add
    lab.draw = lambda record: (events.append(("draw", record["prompt_tokens"])), real_add(record))[1]
    lab.prime([{"prompt_tokens": p} for p in (64, 128, 192)])
    assert events == [("measure", 192), ("measure", 128), ("measure", 64),
                      ("draw", 64), ("draw", 128), ("draw", 192)]
    assert lab.result["prompt_tokens"] == 192 and [r["prompt_tokens"] for r in lab.records] == [64, 128, 192]
    # the status line says what the last point measured, as after a move (it stayed empty until one)
    status = html.unescape(lab.error.widget.value)
    assert status.count(explore.point_summary(lab.result).replace("\n", "<br>")) == 1  # its lines, one under another
    # ...named, as the slider still reads its own value (64), not the last point's (192)
    assert "3 points measured; the last, P = 192: " in status and lab.controls["prompt_tokens"].value == 64
