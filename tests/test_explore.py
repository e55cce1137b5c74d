"""Chart data for lessons 02-04: plain lists from roofline, recordings turned into labelled series."""
import json

import pytest

from labkit import explore
from labkit import roofline as r
from labkit.recordings import load_recordings, write_recording
from labkit.specs import get_gpu, get_model

EIGHT_B, H100 = get_model("llama-3.1-8b"), get_gpu("H100-SXM")


def test_prefill_terms_cross_where_roofline_says():
    terms = explore.prefill_terms(EIGHT_B, [2000, 30633, 32768])
    assert terms["crossover_tokens"] == pytest.approx(r.crossover_tokens(EIGHT_B))
    assert terms["attention_share"][0] == pytest.approx(r.attention_share(EIGHT_B, 2000))
    assert terms["attention_share"][1] == pytest.approx(0.5, abs=1e-4)


def test_causal_counting_moves_every_crossover_out():
    full = explore.share_curves([EIGHT_B, get_model("llama-3.1-70b")], [1024])
    causal = explore.share_curves([EIGHT_B, get_model("llama-3.1-70b")], [1024], r.Counting("causal", "all"))
    assert all(c["crossover_tokens"] > f["crossover_tokens"] for f, c in zip(full, causal))


def test_split_prediction_gap_is_the_attention_term():
    split = explore.prefill_split_prediction(EIGHT_B, H100, [128, 32768], "bf16")
    assert split["linear_only_s"][0] <= split["predicted_time_s"][0]
    assert split["predicted_time_s"][1] / split["linear_only_s"][1] > 1.5


def test_cost_table_reproduces_the_31x():
    table = explore.prefill_cost_table(EIGHT_B, H100, [2048, 32768])
    assert round(table["time_ratio"][1]) == 31 and table["token_ratio"][1] == 16
    assert table["total_s"][0] == pytest.approx(0.089, abs=5e-4)


def test_growth_reads_the_ends_of_a_sweep():
    predicted = {"prompt_tokens": [100, 200], "predicted_time_s": [1.0, 3.0], "linear_only_s": [1.0, 2.0]}
    records = [{"prompt_tokens": 200, "time_s": 4.0, "device": "cpu"}, {"prompt_tokens": 100, "time_s": 1.0, "device": "cpu"}]
    g = explore.growth(records, "prompt_tokens", predicted)
    assert (g["x_ratio"], g["measured_ratio"], g["predicted_ratio"], g["linear_only_ratio"]) == (2, 4, 3, 2)


def _recording(device_name="NVIDIA H200", date="2026-01-02T03:04:05+00:00", dry_run=False):
    return {"provenance": {"device": "cuda", "device_name": device_name, "date": date}, "phase": "prefill",
            "dry_run": dry_run, "points": [
                {"step": "prefill P=4096", "model": "llama-3.1-8b", "prompt_tokens": 4096, "time_s": 0.4,
                 "host_bound": True},
                {"step": "prefill P=1024", "model": "llama-3.1-8b", "prompt_tokens": 1024, "time_s": 0.1},
                {"step": "prefill P=65536", "skipped": "does not fit"},
                {"step": "prefill P=2048", "error": "boom", "passed": False}]}


def test_recorded_series_from_a_written_recording(tmp_path):
    write_recording(tmp_path, "prefill_sweep-h200", _recording())
    write_recording(tmp_path, "decode_sweep-h200", {**_recording(), "phase": "decode"})
    series = explore.recorded_series(load_recordings(tmp_path, phase="prefill"), "prompt_tokens", model="llama-3.1-8b")
    assert len(series) == 1
    assert series[0]["x"] == [1024, 4096] and series[0]["y"] == [0.1, 0.4]
    assert series[0]["host_bound"] == [False, True]  # a point without the flag (older recordings): False
    assert series[0]["label"] == "recorded: NVIDIA H200, 2026-01-02"
    assert series[0]["path"].endswith("prefill_sweep-h200.json")


def test_recorded_series_handles_no_recordings_dry_runs_and_filters(tmp_path):
    assert explore.recorded_series(load_recordings(tmp_path / "none", phase="prefill"), "prompt_tokens") == []
    write_recording(tmp_path, "dry", _recording(dry_run=True))
    assert explore.recorded_series(load_recordings(tmp_path), "prompt_tokens") == []
    assert len(explore.recorded_series(load_recordings(tmp_path), "prompt_tokens", include_dry_runs=True)) == 1
    assert explore.recorded_series(load_recordings(tmp_path), "prompt_tokens", include_dry_runs=True, model="x") == []


def test_attention_traffic_orders_naive_above_flash():
    t = explore.attention_traffic([1024, 32768], 32, 8, 128)
    assert all(n > w > b for n, w, b in zip(t["naive_bytes"], t["flash_worst_bytes"], t["flash_best_bytes"]))


def test_memory_series_splits_methods_and_refusals():
    points = [{"method": "naive", "tokens": 8, "peak_bytes": 600, "device_name": "cpu x"},
              {"method": "flash", "tokens": 8, "peak_bytes": 10, "device_name": "cpu x"},
              {"method": "naive", "tokens": 16, "refused": "too big", "device": "cpu"}]
    s = explore.memory_series(points, 2, [8, 16])
    assert s["naive"] == {"tokens": [8], "peak_bytes": [600]} and s["flash"]["peak_bytes"] == [10]
    assert s["predicted"]["bytes"] == [2 * 2 * 64 * 4, 2 * 2 * 256 * 4]
    assert s["refused"] == [{"method": "naive", "tokens": 16, "message": "too big"}] and s["device_name"] == "cpu x"


def test_decode_readout_splits_the_read():
    rec = {"time_s": 0.02, "predicted_time_s": 0.01, "tokens_per_s": 200.0, "batch": 4, "bytes": 1000,
           "cache_share": 0.25, "regime": "mixed", "context_tokens": 1024, "cache_dtype": "int8", "device": "cpu"}
    out = explore.decode_readout(rec)
    assert out["time_ms"] == [20.0, 10.0] and out["tokens_per_s"] == [200.0, 400.0]
    assert (out["weights_bytes"], out["cache_bytes"]) == (750, 250)


def test_regime_bands_cover_zero_to_one_at_roofline_bounds():
    bands = explore.regime_bands()
    assert [b["regime"] for b in bands] == ["weights-dominated", "mixed", "cache-dominated"]
    assert (bands[0]["from"], bands[0]["to"], bands[2]["from"], bands[2]["to"]) == (0, 0.15, 0.7, 1)


def test_cache_share_curves_match_the_chapter_points():
    curves = explore.cache_share_curves(EIGHT_B, [2000, 131072], [1])
    assert curves[0]["cache_share"][1] == pytest.approx(r.cache_share(EIGHT_B, 1, 131072))


def test_throughput_prediction_flattens_past_the_compute_bound_batch():
    p = explore.throughput_prediction(EIGHT_B, H100, [1, 64, 512, 1024], 0, "bf16", "bf16", r.CHAPTER)
    assert p["compute_bound_batch"] == pytest.approx(r.decode_compute_bound_batch(EIGHT_B, H100))
    assert p["tokens_per_s"][3] == pytest.approx(p["tokens_per_s"][2])  # compute-bound: flat
    assert p["tokens_per_s"][1] == pytest.approx(64 * p["tokens_per_s"][0])  # bandwidth-bound: free


def test_chapter_choices_name_the_hidden_assumptions():
    rows = explore.chapter_decode_choices(EIGHT_B, H100)
    text = json.dumps(rows)
    assert "156.4" in text and "157.0" in text and "148" in text and "1.6%" in text and "6.1%" in text


def test_context_prediction_grows_with_the_cache_read():
    p = explore.context_prediction(EIGHT_B, H100, [0, 131072], 1, "bf16", "bf16")
    ratio = p["predicted_time_s"][1] / p["predicted_time_s"][0]
    assert ratio == pytest.approx(r.decode_bytes_per_step(EIGHT_B, 1, 131072, params="matmul")
                                  / r.decode_bytes_per_step(EIGHT_B, 1, 0, params="matmul"), rel=1e-6)


def test_histogram_bins_from_zero_to_the_maximum():
    h = explore.histogram([0.0, 0.1, 0.2, 1.0], bins=4)
    assert h["counts"] == [3, 0, 0, 1] and h["width"] == 0.25 and h["centres"][0] == 0.125
    assert sum(explore.histogram([0.0, 0.0])["counts"]) == 2


def test_a_run_faster_than_its_roof_gets_a_note_and_one_under_it_none():
    assert explore.above_roof_note(0.97) is None and explore.above_roof_note(1.0) is None
    assert explore.above_roof_note(float("nan")) is None
    note = explore.above_roof_note(1.06)
    assert note.startswith("106% of the calibrated roof") and "calibrate --refresh" in note and "--bracket" in note


def test_point_notes_gathers_what_a_reader_of_one_point_should_know():
    assert explore.point_notes({"roof_fraction": 0.8, "host_bound": None}) == [] and explore.point_notes({}) == []
    both = explore.point_notes({"roof_fraction": 1.2, "host_bound": True})
    assert both == [explore.above_roof_note(1.2), explore.HOST_BOUND_NOTE]


@pytest.mark.parametrize("moment, ends", [
    (0.8, "so the calibration is from a faster moment than this one (`python -m labkit calibrate --refresh` "
          "measures it again)"),
    (0.3, "so the calibration is from a faster moment than this one (`python -m labkit calibrate --refresh` "
          "measures it again), and this step itself falls short here (`python -m labkit breakdown` shows which part)"),
    (1.1, "over it too: data stayed in a cache between calls")])
def test_the_bandwidth_of_a_points_moment_says_whether_the_step_or_the_calibration_was_off(moment, ends):
    point = {"roof_fraction": 0.41, "roof_bandwidth_bytes_per_s": 146e9, "moment_bandwidth_bytes_per_s": 60e9,
             "moment_roof_fraction": moment, "host_bound": None}
    (note,) = explore.point_notes(point)
    assert note == (f"the memory read 60.0 GB/s at this working set just after it (the calibration: 146 GB/s at "
                    f"this size), and the step reached {moment:.2f} of that moment's roof, {ends}")
    above = dict(point, roof_fraction=1.3)  # the moment's reading says which of the above-roof note's reasons
    assert explore.point_notes(above) == [note] and explore.moment_note({"roof_fraction": 0.41}) is None
    if r.FAR_FROM_ROOF <= moment <= 1:  # a calibration from a slower moment than the point's
        slower = dict(above, roof_bandwidth_bytes_per_s=30e9)
        assert "from a slower moment than this one" in explore.moment_note(slower)


def test_the_two_fix_lists_share_no_lever():
    rows = explore.fix_lists()
    prefill, decode = (set(row["fixed by"].split(", ")) for row in rows)
    assert [row["phase"] for row in rows] == ["prefill", "decode"] and prefill and decode
    assert not prefill & decode
    assert "TTFT" in rows[0]["sets"] and "ITL" in rows[1]["sets"]


def test_a_predicted_split_names_the_shapes_that_do_not_fit():
    split = explore.predicted_split(EIGHT_B, H100, 256)
    assert not all(split["fits"]) and split["noisy"] == [not fit for fit in split["fits"]]
    assert all(("does not fit" in title) != fit for title, fit in zip(split["titles"], split["fits"]))
    assert "cannot run" in split["note"] and explore.predicted_split(EIGHT_B, H100, 1)["note"] == ""


def test_measured_throughput_carries_the_achieved_bandwidth_for_hovering():
    records = [{"batch": 4, "tokens_per_s": 400.0, "achieved_bytes_per_s": 2e10, "roof_fraction": 0.8,
                "bound": "memory", "device": "cpu", "device_name": "a CPU"},
               {"batch": 1, "tokens_per_s": 150.0, "achieved_bytes_per_s": 1.5e10, "roof_fraction": 0.6,
                "bound": "memory", "device": "cpu", "device_name": "a CPU"}]
    series = explore.throughput_series(records)
    assert series["batch"] == [1, 4] and series["hover"][1] == ("400 tokens/s; achieved 20.0 GB/s, 0.80 of the "
                                                                 "memory-bound roof (bandwidth; the chapter plans 0.75)")
    # a step whose kernels in turn lie off its roof says its fraction of theirs (`roof_phrase`)
    records[0].update(predicted_time_s=0.01, in_turn_predicted_time_s=0.012, in_turn_roof_fraction=0.9)
    assert explore.throughput_series(records)["hover"][1].endswith("0.90 of the roof of its kernels in turn")


def test_a_point_over_its_calibrated_roof_and_far_under_its_moments_says_both():
    """Lesson 04 in Chromium: 1.04 of a roof calibrated at 49.5 GB/s, and the memory read 82.7 GB/s
    just after it (0.62 of that): the calibration was from a slower moment, and the step falls short."""
    point = {"roof_fraction": 1.04, "roof_bandwidth_bytes_per_s": 49.5e9, "moment_bandwidth_bytes_per_s": 82.7e9,
             "moment_roof_fraction": 1.04 * 49.5 / 82.7}
    note = explore.moment_note(point)
    assert note.endswith("0.62 of that moment's roof, so the calibration is from a slower moment than this one "
                         "(`python -m labkit calibrate --refresh` measures it again), and this step itself falls "
                         "short here (`python -m labkit breakdown` shows which part)")
    # lesson 04's breakdown: 0.51 of a roof calibrated at 49.5 GB/s, the memory at 38.6 just after: both
    faster = {"roof_bandwidth_bytes_per_s": 49.5e9, "moment_bandwidth_bytes_per_s": 38.6e9,
              "moment_roof_fraction": 0.51 * 49.5 / 38.6}
    assert explore.moment_note(faster).endswith("reached 0.65 of that moment's roof, so the calibration is from a "
                                                "faster moment than this one (`python -m labkit calibrate "
                                                "--refresh` measures it again), and this step itself falls short "
                                                "here (`python -m labkit breakdown` shows which part)")
    # a calibration within a shared machine's noise of the moment's reading: only the step
    steady = dict(faster, moment_bandwidth_bytes_per_s=45e9, moment_roof_fraction=0.5 * 49.5 / 45)
    assert explore.moment_note(steady).endswith("reached 0.55 of that moment's roof, so this step itself falls short "
                                                "here (`python -m labkit breakdown` shows which part)")


def test_the_read_sizes_line_gives_what_lesson_04s_question_needs():
    """Lesson 04 asks how a long context slows a CPU step without ever stating lab-cpu's sizes: the
    line printed beside the calibration gives the streamed weights and the cache per token."""
    line = explore.read_sizes_line(get_model("lab-cpu"), "fp32", "fp32")
    lab_cpu = get_model("lab-cpu")
    weights, per_token = r.weight_bytes(lab_cpu, "fp32", "matmul"), r.kv_bytes_per_token(lab_cpu, "fp32")
    assert f"{weights / 1e6:,.0f} MB of fp32 weights" in line and f"{per_token / 1024:,.1f} KiB of fp32 cache" in line
    assert "15.01 GB of bf16 weights" in explore.read_sizes_line(EIGHT_B, "bf16", "bf16")
