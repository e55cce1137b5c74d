"""`python -m labkit`: JSON equal to labkit.roofline's numbers, readable tables, one-line errors."""
import json
import re
import subprocess
import sys
import types
from pathlib import Path

import pytest

from labkit import calibrate, cli, roofline
from labkit.calibrate import Plan
from labkit.specs import GPUS, MODELS, get_gpu, get_model

ROOT = Path(__file__).resolve().parent.parent
L8, H100 = get_model("llama-3.1-8b"), get_gpu("H100-SXM")
TINY = Plan(4 * 2**20, {"fp32": (64,), "bf16": (32,), "fp16": (32,)}, warmup=1, repeats=3, budget_s=0.05)


@pytest.fixture(autouse=True)
def isolated(monkeypatch, tmp_path):
    monkeypatch.setenv("LABKIT_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.delenv("LABKIT_DEVICE", raising=False)
    monkeypatch.setitem(calibrate.PLANS, "cpu", TINY)
    monkeypatch.setattr(calibrate, "_UNCACHED", {})


def quiet_calibrations(monkeypatch):
    """Calibrations taken as quiet: whether a busy test machine confirms every figure is luck."""
    real = calibrate.calibrate
    monkeypatch.setattr(calibrate, "calibrate", lambda device, plan=None: (lambda s, i: (s, {**i, "noisy": []}))(
        *real(device, plan)))


def run_json(capsys, *argv) -> dict:
    assert cli.main([*argv, "--json"]) == 0
    out = capsys.readouterr().out
    assert out.count("\n") == 1  # one JSON object on one line
    return json.loads(out)


def test_predict_prefill_matches_roofline(capsys):
    got = run_json(capsys, "predict", "prefill", "--prompt", "2000")
    flops = roofline.prefill_flops(L8, 2000)
    bytes_moved = roofline.prefill_bytes(L8, 2000)
    expected = {
        "model": "llama-3.1-8b", "gpu": "H100-SXM", "counting": "chapter", "prompt_tokens": 2000, "batch": 1,
        "linear_flops": roofline.prefill_linear_flops(L8, 2000),
        "attention_flops": roofline.prefill_attention_flops(L8, 2000),
        "attention_share": roofline.attention_share(L8, 2000),
        "crossover_tokens": roofline.crossover_tokens(L8),
        "time_s": roofline.roofline_time_s(flops, bytes_moved, H100, "bf16", roofline.CHAPTER_MFU,
                                           roofline.CHAPTER_BANDWIDTH_EFFICIENCY),
        "kv_cache_bytes": roofline.kv_cache_bytes(L8, 2000),
        "intensity_flops_per_byte": roofline.prefill_intensity_flops_per_byte(L8, 2000),
        "ridge_point_flops_per_byte": roofline.ridge_point_flops_per_byte(H100),
        "bound": "compute",
    }
    assert {k: got[k] for k in expected} == expected
    # The chapter's figures: 6 % of FLOPs in attention at 2,000 tokens; crossover N / (2Ld).
    assert round(got["attention_share"], 2) == 0.06
    assert got["crossover_tokens"] == pytest.approx(roofline.param_count(L8) / (2 * 32 * 4096))


def test_predict_prefill_with_kernel_counting_and_other_options(capsys):
    got = run_json(capsys, "predict", "prefill", "--prompt", "8192", "--batch", "4", "--gpu", "h200",
                   "--counting", "kernel", "--mfu", "0.5", "--weight-dtype", "fp8", "--cache-dtype", "int8")
    h200 = get_gpu("H200")
    flops = roofline.prefill_flops(L8, 8192, 4, roofline.KERNEL)
    bytes_moved = roofline.prefill_bytes(L8, 8192, 4, "fp8", "int8")
    assert got["gpu"] == "H200" and got["counting"] == "kernel" and got["attention_counting"] == "causal"
    assert got["linear_flops"] == roofline.prefill_linear_flops(L8, 8192, 4, "matmul")
    assert got["attention_flops"] == roofline.prefill_attention_flops(L8, 8192, 4, "causal")
    assert got["crossover_tokens"] == roofline.crossover_tokens(L8, roofline.KERNEL)
    assert got["kv_cache_bytes"] == roofline.kv_cache_bytes(L8, 8192, 4, "int8")
    assert got["time_s"] == roofline.roofline_time_s(flops, bytes_moved, h200, "bf16", 0.5,
                                                     roofline.CHAPTER_BANDWIDTH_EFFICIENCY)


def test_predict_decode_matches_roofline(capsys):
    got = run_json(capsys, "predict", "decode", "--gpu", "H200", "--context", "8192", "--batch", "64",
                   "--cache-dtype", "fp8")
    h200 = get_gpu("H200")
    flops = roofline.decode_flops_per_step(L8, 64, 8192)
    bytes_moved = roofline.decode_bytes_per_step(L8, 64, 8192, "bf16", "fp8")
    step_s = roofline.roofline_time_s(flops, bytes_moved, h200, "bf16", roofline.CHAPTER_MFU,
                                      roofline.CHAPTER_BANDWIDTH_EFFICIENCY)
    share = roofline.cache_share(L8, 64, 8192, "bf16", "fp8")
    footprint = roofline.memory_footprint_bytes(L8, 64, 8192, "bf16", "fp8")
    expected = {
        "kv_bytes_per_token": roofline.kv_bytes_per_token(L8, "fp8"), "weight_bytes": roofline.weight_bytes(L8),
        "kv_cache_bytes": roofline.kv_cache_bytes(L8, 8192, 64, "fp8"), "bytes_per_step": bytes_moved,
        "cache_share": share, "regime": roofline.decode_regime(share), "time_per_step_s": step_s,
        "tokens_per_s_per_sequence": 1 / step_s,
        "intensity_flops_per_byte": roofline.decode_intensity_flops_per_byte(L8, 64, 8192, cache_dtype="fp8"),
        "memory_footprint_bytes": footprint, "fits_in_memory": footprint <= h200.memory_bytes,
        "gpu": "H200", "model": "llama-3.1-8b", "cache_dtype": "fp8",
    }
    assert {k: got[k] for k in expected} == expected
    assert got["regime"] == "mixed" and got["fits_in_memory"] is True


def test_predict_decode_reproduces_the_chapters_streaming_speed(capsys):
    # "157 tokens a second": 0.75 * 3.35e12 B/s over the 16.06 GB of bf16 weights.
    got = run_json(capsys, "predict", "decode", "--context", "0")
    assert got["weight_bytes"] == 16_060_522_496
    assert got["tokens_per_s_per_sequence"] == pytest.approx(0.75 * 3.35e12 / 16.06e9, rel=1e-3)
    assert got["regime"] == "weights-dominated" and got["bound"] == "memory"


def test_a_model_too_big_for_the_gpu_does_not_fit(capsys):
    got = run_json(capsys, "predict", "decode", "--model", "llama-3.1-405b")
    assert got["fits_in_memory"] is False and got["memory_footprint_bytes"] > 80e9


def test_predict_on_this_machine_uses_its_calibrated_roofline(capsys):
    got = run_json(capsys, "predict", "decode", "--gpu", "this", "--context", "256", "--model", "lab-cpu")
    spec, _ = calibrate.load_or_calibrate("cpu")  # the cached calibration the command made
    assert got["gpu"] == spec.name and got["gpu_kind"] == "calibrated"
    assert got["compute_dtype"] == got["weight_dtype"] == got["cache_dtype"] == "fp32"  # the CPU path
    assert got["ridge_point_flops_per_byte"] == roofline.ridge_point_flops_per_byte(spec, "fp32")


def test_a_warning_is_one_line_without_pythons_source_line(capsys, monkeypatch, tmp_path):
    (tmp_path / "a-file").write_text("not a folder")
    monkeypatch.setenv("LABKIT_CACHE_DIR", str(tmp_path / "a-file"))  # the calibration cannot be cached
    quiet_calibrations(monkeypatch)  # a noisy one is not cached, so nothing would warn
    assert cli.main(["predict", "decode", "--gpu", "this", "--model", "lab-cpu"]) == 0
    err = capsys.readouterr().err
    warned = [line for line in err.splitlines() if "could not cache" in line]
    assert len(warned) == 1 and warned[0].startswith("labkit: could not cache the calibration in ")
    assert "UserWarning" not in err and "load_or_calibrate(" not in err


def test_human_output_is_an_aligned_table_in_display_units(capsys):
    assert cli.main(["predict", "decode"]) == 0
    lines = capsys.readouterr().out.splitlines()
    table = dict(line.split("  ", 1) for line in lines)
    assert table["weight"].strip() == "14.96 GiB"
    assert table["time per step"].strip().endswith(" ms")
    assert table["regime"].strip() == "weights-dominated"
    value_columns = {re.match(r"\S.*?\S?\s{2,}(\S)", line).start(1) for line in lines}
    assert len(value_columns) == 1  # every value starts in the same column


def test_gpus_and_models_list_every_preset_with_sources(capsys):
    gpus = run_json(capsys, "gpus")["gpus"]
    assert [g["name"] for g in gpus] == list(GPUS)
    h100 = gpus[0]
    assert h100["memory_bandwidth_bytes_per_s"] == 3.35e12 and round(h100["ridge_point_bf16_flops_per_byte"]) == 295
    assert "datasheet" in h100["sources"]["bf16_flops_per_s"]
    models = run_json(capsys, "models")["models"]
    assert [m["name"] for m in models] == list(MODELS)
    assert models[0]["params"] == roofline.param_count(L8) == 8_030_261_248
    assert "config.json" in models[0]["source"]
    assert cli.main(["gpus"]) == 0 and "H100-SXM" in capsys.readouterr().out


def test_calibrate_reports_and_caches_this_machine(capsys, monkeypatch):
    quiet_calibrations(monkeypatch)
    got = run_json(capsys, "calibrate", "--device", "cpu")
    spec, info = calibrate.load_or_calibrate("cpu")
    assert info["cache_status"] == "hit" and got["cache_file"] == info["cache_file"]
    assert got["fp32_flops_per_s"] == spec.fp32_flops_per_s > 0
    curve = got["bandwidth_by_working_set"]  # the cache-aware roof: at least six working sets
    assert len(curve) >= 6 and all(set(p) == {"bytes", "bytes_per_s"} for p in curve)
    assert [p["bytes"] for p in curve] == sorted(p["bytes"] for p in curve) and curve[-1]["bytes"] == TINY.stream_bytes
    assert got["memory_bandwidth_bytes_per_s"] == curve[-1]["bytes_per_s"] >= max(got["copy_bytes_per_s"],
                                                                                   got["read_bytes_per_s"])
    assert got["cache_levels"] and got["memory_name"] == "DRAM" and got["noisy"] == []
    assert got["provenance"]["device"] == "cpu" and got["fp8_flops_per_s"] is None
    assert run_json(capsys, "calibrate", "--device", "cpu", "--refresh")["cache_status"].startswith("measured")
    assert cli.main(["calibrate", "--device", "cpu"]) == 0  # for people: the curve as a table too
    out = capsys.readouterr().out
    table = out.split("bandwidth roof by working set")[1].splitlines()[2:]
    assert len([line for line in table if line.endswith("B/s")]) >= 6


BAD = [
    (["predict", "prefill", "--gpu", "X"], "unknown GPU 'X'; known: H100-SXM"),
    (["predict", "prefill", "--model", "nope"], "unknown model 'nope'"),
    (["predict", "prefill", "--prompt", "0"], "--prompt must be in 1..131,072"),
    (["predict", "prefill", "--prompt", "131073"], "--prompt must be in 1..131,072"),
    (["predict", "decode", "--context", "-1"], "--context must be in 0..131,072"),
    (["predict", "decode", "--batch", "0"], "--batch must be in 1..4,096"),
    (["predict", "decode", "--batch", "4097"], "--batch must be in 1..4,096"),
    (["predict", "prefill", "--mfu", "0"], "--mfu must be in 0.01..1"),
    (["predict", "decode", "--bandwidth-efficiency", "1.5"], "--bandwidth-efficiency must be in 0.01..1"),
    # a tiny fraction printed "time_s": Infinity, which is not JSON, and a time of 300 digits
    (["predict", "prefill", "--mfu", "1e-320", "--json"], "--mfu must be in 0.01..1"),
    (["predict", "decode", "--bandwidth-efficiency", "nan"], "--bandwidth-efficiency must be in 0.01..1"),
    # checked before `--gpu this` calibrates (a measurement), not after it
    (["predict", "prefill", "--gpu", "this", "--mfu", "0"], "--mfu must be in 0.01..1"),
    # a flag of the other phase was accepted and ignored
    (["predict", "decode", "--prompt", "-5"], "--prompt (the prompt's tokens) applies to prefill, not to decode"),
    (["predict", "prefill", "--context", "99"], "--context (the tokens each sequence has cached) applies to decode"),
    (["measure", "decode", "--prompt", "5"], "--prompt (the prompt's tokens) applies to prefill"),
    (["breakdown", "prefill", "--context", "5"], "--context (the tokens each sequence has cached) applies to decode"),
    (["measure", "prefill", "--cache-dtype", "fp8"], "--cache-dtype applies to decode"),
    (["predict", "decode", "--batch", "9" * 50], "--batch must be in 1..4,096, got a number of 50 digits"),
    # the weights alone: lowering batch or context cannot help (it said to)
    (["measure", "decode", "--model", "llama-3.1-405b", "--device", "cpu", "--bracket"],
     "llama-3.1-405b (its weights alone, in fp32) needs"),
    (["predict", "prefill", "--batch", "x"], "invalid int value: 'x'"),
    (["predict", "decode", "--cache-dtype", "fp4"], "invalid choice: 'fp4'"),
    (["predict", "prefill", "--gpu", "T4"], "T4 has no bf16 peak"),
    (["predict"], "required"),
    ([], "required"),
    (["measure", "decode", "--device", "cuda"] if not __import__("torch").cuda.is_available()
     else ["measure", "decode", "--batch", "0"], "labkit: error: "),
]


@pytest.mark.parametrize("argv, message", BAD, ids=[" ".join(a) or "nothing" for a, _ in BAD])
def test_bad_input_is_one_line_and_exit_code_2(capsys, argv, message):
    assert cli.main(argv) == 2
    captured = capsys.readouterr()
    assert captured.out == ""
    assert captured.err.startswith("labkit: error: ") and captured.err.count("\n") == 1
    assert message in captured.err and "Traceback" not in captured.err


def test_python_dash_m_labkit_runs_without_torch_for_predictions():
    # Predictions are pure arithmetic: the command must not pay torch's import time.
    code = ("import sys, json; from labkit.cli import main; rc = main(['predict', 'decode', '--json']);"
            "assert 'torch' not in sys.modules, 'predict imported torch'; sys.exit(rc)")
    done = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    via_m = subprocess.run([sys.executable, "-m", "labkit", "predict", "decode", "--json"], cwd=ROOT,
                           capture_output=True, text=True, timeout=120)
    assert via_m.returncode == 0 and json.loads(via_m.stdout) == json.loads(done.stdout)
    bad = subprocess.run([sys.executable, "-m", "labkit", "predict", "prefill", "--gpu", "X"], cwd=ROOT,
                         capture_output=True, text=True, timeout=120)
    assert bad.returncode == 2 and bad.stdout == "" and "Traceback" not in bad.stderr
    assert bad.stderr.splitlines() == [f"labkit: error: unknown GPU 'X'; known: {', '.join(GPUS)}"]


def test_measure_passes_its_arguments_to_sweeps(monkeypatch, capsys):
    calls = []
    fake = types.SimpleNamespace(
        measure_prefill=lambda *args: calls.append(("prefill", *args)) or {"device": args[3], "time_s": 0.5},
        measure_decode=lambda *args: calls.append(("decode", *args)) or {"device": args[4], "time_s": 0.1})
    monkeypatch.setitem(sys.modules, "labkit.sweeps", fake)
    monkeypatch.setattr("labkit.sweeps", fake, raising=False)
    assert run_json(capsys, "measure", "prefill", "--device", "cpu", "--prompt", "64") == {"device": "cpu", "time_s": 0.5}
    assert run_json(capsys, "measure", "decode", "--device", "cpu", "--model", "lab-tiny", "--batch", "2",
                    "--context", "16", "--cache-dtype", "int8") == {"device": "cpu", "time_s": 0.1}
    assert calls[0] == ("prefill", get_model("lab-cpu"), 64, 1, "cpu")  # lab-cpu is the CPU default
    assert calls[1] == ("decode", get_model("lab-tiny"), 2, 16, "int8", "cpu")


def test_measure_bracket_wraps_the_point_in_bandwidth_readings(monkeypatch, capsys):
    fake = types.SimpleNamespace(
        measure_decode=lambda *args: {"device": args[4], "time_s": 0.1},
        decode_working_set_bytes=lambda *args: ("working set of", *args),
        bracketed=lambda run, device, working_set: {**run(), "bracketed_on": device, "working_set": working_set})
    monkeypatch.setitem(sys.modules, "labkit.sweeps", fake)
    monkeypatch.setattr("labkit.sweeps", fake, raising=False)
    got = run_json(capsys, "measure", "decode", "--device", "cpu", "--bracket")
    assert {k: got[k] for k in ("device", "time_s", "bracketed_on")} == {"device": "cpu", "time_s": 0.1, "bracketed_on": "cpu"}
    # read at the working set the point reads: lab-cpu's B=1, S=1,024, fp32 cache on the CPU
    assert got["working_set"][0] == "working set of" and got["working_set"][2:] == [1, 1024, "fp32", "cpu"]
    assert "bracketed_on" not in run_json(capsys, "measure", "decode", "--device", "cpu")


def test_measure_says_why_a_run_beat_its_roof(monkeypatch, capsys):
    fake = types.SimpleNamespace(measure_decode=lambda *args: {"device": "cpu", "time_s": 0.1, "roof_fraction": 1.3})
    monkeypatch.setitem(sys.modules, "labkit.sweeps", fake)
    monkeypatch.setattr("labkit.sweeps", fake, raising=False)
    assert cli.main(["measure", "decode", "--device", "cpu", "--json"]) == 0
    out = capsys.readouterr()
    assert json.loads(out.out)["roof_fraction"] == 1.3  # stdout stays one JSON object
    assert out.err.startswith("labkit: note: 130% of the calibrated roof")


def test_measure_checks_ranges_before_running(monkeypatch, capsys):
    monkeypatch.setitem(sys.modules, "labkit.sweeps", types.SimpleNamespace(measure_prefill=pytest.fail))
    assert cli.main(["measure", "prefill", "--device", "cpu", "--model", "lab-tiny", "--prompt", "5000"]) == 2
    assert "--prompt must be in 1..4,096 (the max context of lab-tiny)" in capsys.readouterr().err


def test_measure_runs_a_real_prefill_and_decode_on_the_cpu(capsys):
    pytest.importorskip("labkit.sweeps", reason="labkit.sweeps is not written yet")
    prefill = run_json(capsys, "measure", "prefill", "--device", "cpu", "--model", "lab-tiny", "--prompt", "32")
    decode = run_json(capsys, "measure", "decode", "--device", "cpu", "--model", "lab-tiny", "--context", "64",
                      "--batch", "2")
    for point in (prefill, decode):
        assert point["device"] == "cpu" and point["time_s"] > 0 and point["predicted_time_s"] > 0
        assert 0 < point["roof_fraction"] and point["achieved_flops_per_s"] > 0
    assert prefill["prompt_tokens"] == 32 and decode["context_tokens"] == 64 and decode["batch"] == 2
    assert decode["cache_dtype"] == "fp32"  # the CPU default


def test_measure_refuses_an_fp8_cache_on_the_cpu_saying_why(capsys):
    pytest.importorskip("labkit.sweeps", reason="labkit.sweeps is not written yet")
    assert cli.main(["measure", "decode", "--device", "cpu", "--model", "lab-tiny", "--context", "16",
                     "--cache-dtype", "fp8"]) == 2
    err = capsys.readouterr().err
    assert "the CPU path offers no fp8 KV cache" in err and "offered here: fp32, bf16, int8" in err
    assert "Traceback" not in err
