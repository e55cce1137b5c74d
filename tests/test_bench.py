"""`make bench` / `python -m labkit bench`: issue 13's tables, each point bracketed, written as one
recording with provenance that never overwrites. Run here on lab-tiny with a tiny calibration:
what is checked is the recording, not any speed."""
import json

import pytest

from labkit import bench, calibrate, cli, sizes, sweeps
from labkit.calibrate import Plan
from labkit.errors import LabError
from labkit.recordings import load_recordings

TINY = Plan(4 * 2**20, {"fp32": (64,), "bf16": (32,), "fp16": (32,)}, warmup=1, repeats=3, budget_s=0.05)
STEPS = [{"table": "decode_batch", "phase": "decode", "batch": b, "context_tokens": 64, "cache_dtype": "fp32"}
         for b in (1, 16)]
STEPS += [{"table": "cache_dtype", "phase": "decode", "batch": 2, "context_tokens": 64, "cache_dtype": d}
          for d in ("fp32", "int8")]
STEPS += [{"table": "prefill", "phase": "prefill", "prompt_tokens": 32}]


@pytest.fixture(autouse=True)
def small(monkeypatch, tmp_path):
    monkeypatch.setenv("LABKIT_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.setitem(calibrate.PLANS, "cpu", TINY)
    monkeypatch.setattr(calibrate, "_UNCACHED", {})
    monkeypatch.setattr(sweeps, "CPU_BUDGET_S", 0.1)
    monkeypatch.setattr(sweeps, "CPU_MAX_BUDGET_S", 0.3)


def test_the_steps_are_the_issues_tables():
    steps = bench.bench_steps("cpu", "fp32")
    decode = [(s["batch"], s["context_tokens"]) for s in steps if s["table"] == "decode_batch"]
    assert decode == [(1, 1024), (4, 1024), (16, 1024), (32, 1024)]
    dtypes = [(s["cache_dtype"], s["batch"], s["context_tokens"]) for s in steps if s["table"] == "cache_dtype"]
    assert dtypes == [(d, 16, 4096) for d in ("fp32", "bf16", "int8")], "the CPU offers no fp8 (sizes.NOT_OFFERED)"
    assert [s["prompt_tokens"] for s in steps if s["table"] == "prefill"] == [1024, 2048, 4096]


def test_a_bench_writes_one_bracketed_recording_and_never_overwrites(tmp_path):
    lines = []
    path, payload = bench.run_bench("cpu", tmp_path / "rec", "lab-tiny", STEPS, log=lines.append, rounds=2)
    assert path == tmp_path / "rec" / "bench-cpu.json"
    saved = json.loads(path.read_text())
    assert saved["phase"] == "bench" and saved["model"] == "lab-tiny" and saved["device"] == "cpu"
    assert 0 <= saved["others_busy_share"] <= 1 and len(saved["load_average"]["before"]) == 3  # the machine's load
    for key in ("device_name", "torch", "date", "command", "git_commit", "threads"):
        assert key in saved["provenance"], key
    assert [len(saved["tables"][t]) for t in ("decode_batch", "cache_dtype", "prefill")] == [2, 2, 1]
    assert saved["rounds"] == 2 and [p["round"] for p in saved["points"]] == [1] * 5 + [2] * 5  # every round kept
    for i, shown in enumerate(r for t in saved["tables"].values() for r in t):  # each row: its step's median round
        mine = [p for p in saved["points"] if p["step"] == i]
        assert shown["rounds_time_s"] == [p["time_s"] for p in mine]
        assert shown["time_s"] == min(p["time_s"] for p in mine)  # of two rounds, the faster
    for point in saved["points"]:  # every point bracketed at its working set, with its roof and plan
        for key in ("bandwidth_before_bytes_per_s", "bracketed_roof_fraction", "working_set_bytes",
                    "roof_bandwidth_bytes_per_s", "roof_tier", "planned_time_s", "roof_fraction"):
            assert key in point, key
    for table, rows in saved["tables"].items():  # a decode step also against its kernels in turn
        for shown in rows:
            assert ("bracketed_in_turn_fraction" in shown) == (table != "prefill"), (table, shown)
            if table != "prefill":
                assert shown["in_turn_predicted_time_s"] >= shown["predicted_time_s"]
    first = saved["tables"]["decode_batch"][0]
    assert first["point"] == "decode B=1, S=64, cache fp32" and first["time_s"] > 0
    assert set(saved["ratios"]) == {"tokens_per_s_b16_over_b1", "step_int8_over_fp32"}
    assert set(saved["targets"]) == {"decode_batches", "cache_dtypes", "prefill", "gain_b16_over_b1", "cache_ratios"}
    assert saved["targets"]["prefill"]["fractions"] == {}  # lab-tiny's P = 32 is not the issue's P >= 1,024
    assert saved["not_offered"] == sizes.NOT_OFFERED["cpu"] and "fp8" in saved["not_offered"]
    gain = saved["ratios"]["tokens_per_s_b16_over_b1"]
    b1, b16 = saved["tables"]["decode_batch"]
    assert gain["measured"] == pytest.approx(b16["tokens_per_s"] / b1["tokens_per_s"])
    assert gain["predicted"] == pytest.approx(16 * b1["predicted_time_s"] / b16["predicted_time_s"])
    b1, b16 = (next(p for p in saved["points"] if p["step"] == i and p["time_s"] == row["time_s"]) for i, row in
               enumerate((b1, b16)))  # each row's point: its roofline time on its own bracketed roof
    assert gain["predicted_bracketed"] == pytest.approx(16 * b1["bracketed_predicted_time_s"]
                                                        / b16["bracketed_predicted_time_s"])
    dtype = saved["ratios"]["step_int8_over_fp32"]
    assert set(dtype) == {"measured", "predicted", "predicted_bracketed"} and all(v > 0 for v in dtype.values())
    calibration = saved["calibration"]
    assert calibration["cache_status"].startswith("measured (refresh asked for)")
    assert len(calibration["bandwidth_by_working_set"]) >= 6 and "samples_s" not in json.dumps(calibration)
    assert any("bench recording written" in line for line in lines)
    again, _ = bench.run_bench("cpu", tmp_path / "rec", "lab-tiny", STEPS[:1])
    assert again.name == "bench-cpu-2.json" and json.loads(path.read_text()) == saved
    assert len(load_recordings(tmp_path / "rec", phase="bench")) == 2
    assert load_recordings(tmp_path / "rec", phase="decode") == []  # kept out of the lessons' recorded series


def test_the_recording_names_the_calibration_its_points_were_judged_by(tmp_path, monkeypatch):
    """A fresh calibration that is noisy is not cached, so the points are judged by the cached one
    (`sweeps` asks load_or_calibrate): the recording's `calibration` is that one, and the noisy
    fresh one is kept beside it as `fresh_calibration`, marked as not used."""
    real = calibrate.calibrate
    # a quiet one, cached: whether every figure of a real calibration is confirmed on a loaded test
    # machine is luck (a neighbour's steal time during one figure flags it), and this is not its test
    monkeypatch.setattr(calibrate, "calibrate", lambda kind, plan=None: (lambda s, i: (s, {**i, "noisy": []}))(
        *real(kind, plan)))
    _, first = bench.run_bench("cpu", tmp_path, "lab-tiny", STEPS[:1], rounds=1)
    assert "fresh_calibration" not in first

    def noisy(kind, plan=None):
        spec, info = real(kind, plan)
        return spec, {**info, "date": "2026-12-01T23:59:59+00:00", "noisy": ["bandwidth at 4.0 MiB"]}
    monkeypatch.setattr(calibrate, "calibrate", noisy)
    _, payload = bench.run_bench("cpu", tmp_path, "lab-tiny", STEPS[:1], rounds=1)
    assert payload["calibration"]["date"] == first["calibration"]["date"] != payload["fresh_calibration"]["date"]
    assert payload["fresh_calibration"]["not_used"].startswith("noisy, so not cached")
    hardware, _ = calibrate.load_or_calibrate("cpu")
    point = payload["points"][0]
    assert point["predicted_time_s"] > 0 and payload["calibration"]["spec"]["fp32_flops_per_s"] == hardware.fp32_flops_per_s


def test_the_median_round_is_a_real_point():
    readings = [(105e9, 75e9), (60e9, 62e9), (70e9, 70e9)]  # the first round's memory changed speed
    rounds = [{"time_s": t, "bracketed_roof_fraction": f, "round": r,
               "bandwidth_before_bytes_per_s": b, "bandwidth_after_bytes_per_s": a}
              for r, ((t, f), (b, a)) in enumerate(zip([(3.0, 0.5), (1.0, 0.9), (2.0, 0.7)], readings), start=1)]
    shown = bench.median_round(rounds)
    assert shown["round"] == 3 and shown["time_s"] == 2.0 and shown["bracketed_roof_fraction"] == 0.7
    assert shown["rounds_time_s"] == [3.0, 1.0, 2.0] and shown["rounds_bracketed_roof_fraction"] == [0.5, 0.9, 0.7]
    assert shown["rounds_moment_changed"] == [True, False, False]
    assert bench.row({**shown, "phase": "prefill", "prompt_tokens": 64})["rounds_moment_changed"] == [True, False, False]
    assert bench.median_round(rounds[:2])["round"] == 2  # of an even count, the faster middle one
    skipped = [{"table": "prefill", "skipped": "too long"}] * 3
    assert bench.median_round(skipped) == skipped[0]


@pytest.mark.parametrize("before, after, changed", [(100e9, 125e9, False), (100e9, 126e9, True), (126e9, 100e9, True),
                                                   (None, 80e9, None), (80e9, 0.0, None)])
def test_a_moment_changed_where_the_readings_around_a_point_part_by_more_than_the_noisy_spread(before, after, changed):
    """More than timing.NOISY_SPREAD apart, either way round; without both readings, unknown."""
    point = {"bandwidth_before_bytes_per_s": before, "bandwidth_after_bytes_per_s": after}
    assert bench.moment_changed(point) is changed


def _tries(readings):
    """A stand-in for `bench._measure` that returns one point per (before, after) reading in turn."""
    made = iter(readings)

    def measure(spec, device, step):
        before, after = next(made)
        return {"table": step["table"], "time_s": before / 1e12, "bracketed_roof_fraction": 0.5,
                "bandwidth_before_bytes_per_s": before, "bandwidth_after_bytes_per_s": after}
    return measure


def test_a_point_the_memory_changed_speed_during_is_measured_again_and_both_are_kept(monkeypatch):
    monkeypatch.setattr(bench, "_measure", _tries([(105e9, 75e9), (70e9, 72e9)]))
    point = bench._measure_settled(None, "cpu", STEPS[0])
    assert point["bandwidth_before_bytes_per_s"] == 70e9 and bench.moment_changed(point) is False  # the retry
    assert point["moment_changed_tries"] == [{"time_s": 0.105, "bracketed_roof_fraction": 0.5,
                                              "bandwidth_before_bytes_per_s": 105e9,
                                              "bandwidth_after_bytes_per_s": 75e9}]


def test_retries_stop_after_moment_retries_and_a_settled_point_is_measured_once(monkeypatch):
    monkeypatch.setattr(bench, "_measure", _tries([(105e9, 75e9)] * (bench.MOMENT_RETRIES + 2)))
    point = bench._measure_settled(None, "cpu", STEPS[0])
    assert len(point["moment_changed_tries"]) == bench.MOMENT_RETRIES and bench.moment_changed(point)  # still flagged
    monkeypatch.setattr(bench, "_measure", _tries([(70e9, 72e9)]))  # a second call would find no reading
    assert "moment_changed_tries" not in bench._measure_settled(None, "cpu", STEPS[0])
    monkeypatch.setattr(bench, "_measure", lambda spec, device, step: {**step, "skipped": "too long"})
    assert bench._measure_settled(None, "cpu", STEPS[0])["skipped"] == "too long"  # no readings: not retried


def test_the_rounds_range_reads_as_one_figure_where_its_ends_round_alike():
    assert cli._spread([0.45, 0.671, 0.5]) == "45-67%" and cli._spread([0.566, 0.57, 0.574]) == "57%"
    assert cli._spread([None, 0.8]) == "80%" and cli._spread([None]) == "-" and cli._spread([0.95, 1.05]) == "95-105%"


def test_the_table_counts_the_rounds_the_memory_changed_speed_during():
    assert cli._moment_changes([True, False, None]) == " (1 of 3 changed)"
    assert cli._moment_changes([False, False, False]) == cli._moment_changes([]) == ""


def test_rounds_out_of_range_are_refused(tmp_path, capsys):
    with pytest.raises(LabError, match=r"rounds must be an integer in 1\.\.10, got 0"):
        bench.run_bench("cpu", tmp_path, "lab-tiny", STEPS[:1], rounds=0)
    assert cli.main(["bench", "--device", "cpu", "--rounds", "11", "--out", str(tmp_path)]) == 2
    assert "--rounds must be in 1..10, got 11" in capsys.readouterr().err
    assert not list(tmp_path.iterdir())  # refused before anything ran or was written


def test_an_unwritable_out_is_refused_before_anything_is_measured(tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(calibrate, "load_or_calibrate", lambda *a, **k: pytest.fail("calibrated before checking --out"))
    (tmp_path / "a-file").write_text("not a folder")
    out = tmp_path / "a-file" / "recordings"
    assert cli.main(["bench", "--device", "cpu", "--out", str(out)]) == 2
    assert capsys.readouterr().err == f"labkit: error: cannot write recordings in {str(out)!r}: Not a directory\n"


def test_make_bench_takes_out_from_the_command_line_and_data_recordings_otherwise():
    import subprocess
    from pathlib import Path
    root = Path(__file__).resolve().parent.parent

    def command(*args):  # make -n: what the recipe would run, nothing run
        done = subprocess.run(["make", "--no-print-directory", "-n", "-o", "venv", "bench", *args], cwd=root,
                              capture_output=True, text=True, timeout=60)
        return done.stdout.strip().splitlines()[-1]
    assert command().endswith("-m labkit bench --out data/recordings")
    assert command("OUT=/tmp/elsewhere").endswith("-m labkit bench --out /tmp/elsewhere")


def test_a_step_the_device_refuses_is_kept_with_why(tmp_path):
    too_long = [{"table": "prefill", "phase": "prefill", "prompt_tokens": 10**6}]
    _, payload = bench.run_bench("cpu", tmp_path, "lab-tiny", too_long)
    assert "prompt_tokens must be an integer in 1..4,096" in payload["tables"]["prefill"][0]["skipped"]


def test_the_command_prints_the_tables_and_the_recording(monkeypatch, capsys, tmp_path):
    monkeypatch.setattr(bench, "bench_steps", lambda device, cache_dtype: STEPS[:2] + STEPS[-1:])
    assert cli.main(["bench", "--device", "cpu", "--model", "lab-tiny", "--out", str(tmp_path), "--rounds", "2"]) == 0
    out = capsys.readouterr().out
    assert "each point: its median of 2 rounds" in out and "bracketed rounds" in out
    assert "the memory changed speed during: its readings before and after more than 25% apart" in out
    assert "decode_batch:" in out and "prefill:" in out and "tokens per s b16 over b1: measured" in out
    assert "issue 13's targets" in out and "met: every batch up to the compute-bound batch" in out
    assert out.strip().endswith(f"recording: {tmp_path / 'bench-cpu.json'}")
    assert cli.main(["bench", "--device", "cpu", "--model", "lab-tiny", "--out", str(tmp_path), "--json"]) == 0
    got = json.loads(capsys.readouterr().out)
    assert got["recording"].endswith("bench-cpu-2.json") and got["tables"]["prefill"][0]["point"] == "prefill P=32"


def test_targets_set_each_figure_beside_the_issues_target():
    """`bench.targets`: the issue's words, judged on bench-cpu-32's figures (median rounds):
    decode and cache dtypes by their bracketed fractions, the gain and the ratios against the
    calibration's prediction; batches past the compute-bound one are out of range."""
    def point(table, fraction, **shape):
        return {"table": table, "time_s": 1.0, "bracketed_roof_fraction": fraction, "roof_fraction": fraction, **shape}
    points = [point("decode_batch", f, batch=b) for b, f in ((1, 0.76), (4, 0.81), (16, 0.73), (32, 0.59))]
    points += [point("cache_dtype", f, cache_dtype=d) for d, f in (("fp32", 0.72), ("int8", 0.75))]
    points += [point("prefill", f, prompt_tokens=p) for p, f in ((1024, 0.54), (4096, 0.62))]
    gains = {"tokens_per_s_b16_over_b1": {"measured": 5.92, "predicted": 6.02, "predicted_bracketed": 6.44},
             "step_int8_over_fp32": {"measured": 0.46, "predicted": 0.39, "predicted_bracketed": 0.42}}
    got = bench.targets(points, gains, compute_bound_batch=None)  # every batch in range: B=32's 0.59 misses
    assert got["decode_batches"]["fractions"] == {"B=1": 0.76, "B=4": 0.81, "B=16": 0.73, "B=32": 0.59}
    assert got["decode_batches"]["met"] is False and "no batch reaches it" in got["decode_batches"]["what"]
    assert bench.targets(points, gains, compute_bound_batch=17.2)["decode_batches"]["met"] is True  # B=32 past it
    assert got["cache_dtypes"]["met"] is True and got["prefill"]["met"] is True
    assert got["gain_b16_over_b1"]["of_predicted"]["predicted"] == pytest.approx(5.92 / 6.02)
    assert got["gain_b16_over_b1"]["met"] is True
    assert got["cache_ratios"]["off_predicted"]["step_int8_over_fp32"]["predicted"] == pytest.approx(0.46 / 0.39 - 1)
    assert got["cache_ratios"]["met"] is True  # +18 %
    gains["step_int8_over_fp32"]["measured"] = 0.52  # +33 %: out
    assert bench.targets(points, gains, None)["cache_ratios"]["met"] is False


def test_the_decode_target_names_the_most_a_step_in_turn_can_reach_where_it_is_under_one():
    """Near the ridge the products are compute-bound and attention memory-bound: in turn their
    times add where the whole-step roof hides one under the other. The report gives that ceiling
    (whole-step roof time over in-turn roof time) beside the fraction, and only where it bites."""
    def point(batch, whole_s, in_turn_s):
        return {"table": "decode_batch", "batch": batch, "time_s": 10e-3, "bracketed_roof_fraction": whole_s / 10e-3,
                "bracketed_predicted_time_s": whole_s, "bracketed_in_turn_predicted_time_s": in_turn_s}
    points = [point(1, 7.5e-3, 7.5e-3), point(32, 6.07e-3, 8.84e-3)]
    got = bench.targets(points, {}, compute_bound_batch=None)["decode_batches"]
    assert got["in_turn_ceilings"] == {"B=1": 1.0, "B=32": pytest.approx(6.07 / 8.84)}
    assert bench.in_turn_ceiling({"bracketed_predicted_time_s": 1.0}) is None  # a prefill point: none
    line = cli._target_figures(got)
    assert line == "B=1 0.75, B=32 0.61 (in turn at most 0.69)"


def test_a_lesson_explains_every_point_the_bench_would_bar():
    """A lesson's memory-bound CPU point under the bench's bar has the bandwidth of its moment read
    (`sweeps.with_moment` below roofline.FAR_FROM_ROOF), so its status line says why it fell short."""
    from labkit import roofline
    assert roofline.FAR_FROM_ROOF == bench.ROOF_TARGET


def test_a_model_too_big_or_unknown_is_refused_before_the_calibration_and_the_folder(tmp_path, monkeypatch):
    """bench --model llama-3.1-70b calibrated first, then skipped every point; a bad name made --out's
    folder before it was refused."""
    from labkit import bench, calibrate
    from labkit.errors import FootprintError, SpecError
    monkeypatch.setattr(calibrate, "load_or_calibrate", lambda *a, **k: pytest.fail("calibrated first"))
    with pytest.raises(FootprintError, match=r"llama-3.1-405b \(its weights alone, in fp32\) needs .*smaller model"):
        bench.run_bench("cpu", tmp_path / "a", "llama-3.1-405b")
    with pytest.raises(SpecError, match="unknown model 'bogus'"):
        bench.run_bench("cpu", tmp_path / "b", "bogus")
    assert not (tmp_path / "a").exists() and not (tmp_path / "b").exists()
