"""What the measured-vs-predicted charts show about the roof: the chapter's planning line beside
it, the tier it is drawn at and where the working set leaves a cache, and each point's fraction."""
import dataclasses

import pytest

from labkit import explore
from labkit import roofline as r
from labkit.specs import HardwareSpec, get_gpu, get_model

MIB = 2**20
LAB_CPU, H100 = get_model("lab-cpu"), get_gpu("H100-SXM")
# A 2-core VM's measured roof: L2 to a few MiB, L3 to ~64 MiB, then DRAM (issue 13's shape).
CURVE = ((1 * MIB, 140e9), (2 * MIB, 178e9), (4 * MIB, 107e9), (8 * MIB, 57e9), (16 * MIB, 57e9),
         (32 * MIB, 50e9), (64 * MIB, 12e9), (128 * MIB, 12e9), (512 * MIB, 11e9), (2048 * MIB, 12e9))
CPU = HardwareSpec("this machine: a CPU", None, None, None, None, 300e9, 12e9, 24e9, kind="calibrated",
                   cache_levels=(("L2", 4 * MIB), ("L3", 480 * MIB)), memory_name="DRAM", bandwidth_by_working_set=CURVE)


def test_the_planning_line_is_the_chapters_40_and_75_percent():
    """A memory-bound decode step planned at 75 % of the bandwidth takes 1/0.75 of the roof's time;
    a compute-bound prefill at 40 % of peak 1/0.40 of it."""
    decode = explore.decode_prediction(get_model("llama-3.1-8b"), H100, [1, 8], 2000, "bf16", "bf16")
    assert decode["planned_time_s"][0] == pytest.approx(decode["predicted_time_s"][0] / 0.75)
    prefill = explore.prefill_prediction(get_model("llama-3.1-8b"), H100, [8192], "bf16")
    assert prefill["planned_time_s"][0] == pytest.approx(prefill["predicted_time_s"][0] / 0.40)
    assert decode["tiers"] == [] and decode["roof_tiers"] == []  # a datasheet: one bandwidth, no edges
    assert "40%" in explore.PLAN_LABEL and "75%" in explore.PLAN_LABEL and "chapter" in explore.PLAN_LABEL


def test_a_decode_sweep_marks_where_its_working_set_leaves_the_l3():
    """lab-cpu at S=1,024 in fp32: weights ~62 MB plus 4 KiB of cache per token per sequence.
    On this curve the L3's measured edge (~45 MiB) is crossed before batch 1, so the marks lie
    along the context axis of a tiny-batch sweep instead: check both."""
    edges = r.tier_edges(CURVE, CPU.cache_levels, "DRAM")
    contexts = list(range(0, 8193, 256))
    tiny = get_model("lab-tiny")
    by_context = explore.context_prediction(tiny, CPU, contexts, 64, "fp32", "fp32")
    working = by_context["working_set_bytes"]
    assert working == [r.decode_bytes_per_step(tiny, 64, s, "fp32", "fp32", "matmul") for s in contexts]
    labels = [m["label"] for m in by_context["tiers"]]
    assert labels == ["past the L2: L3", "past the L3: DRAM"]
    for mark, edge in zip(by_context["tiers"], edges):  # each mark where the working set equals the edge
        i = next(i for i, w in enumerate(working) if w >= edge["bytes"])
        assert contexts[i - 1] < mark["x"] <= contexts[i]
        assert "the OS reports a" in mark["detail"] and "GB/s" in mark["detail"]
    assert by_context["roof_tiers"] == ["L2", "L3", "DRAM"]
    # each predicted point is the roof of its own working set
    at = by_context["working_set_bytes"][-1]
    assert by_context["predicted_time_s"][-1] == pytest.approx(
        r.predicted_decode_step_s(tiny, 64, 8192, r.roof_at_working_set(CPU, at), "fp32", "fp32"))
    batches = explore.decode_prediction(LAB_CPU, CPU, [1, 4, 16, 32], 1024, "fp32", "fp32")
    assert batches["tiers"] == [] and batches["roof_tiers"] == ["DRAM"]  # all past this L3's edge


def test_throughput_prediction_carries_the_planning_line_and_tiers():
    got = explore.throughput_prediction(get_model("lab-tiny"), CPU, [1, 64], 8192, "fp32", "fp32")
    assert got["planned_tokens_per_s"][0] < got["tokens_per_s"][0]
    assert [m["label"] for m in got["tiers"]] and got["roof_tiers"][-1] == "DRAM"


# A roof whose L3 (to ~96 MiB) is fast enough that lab-cpu's step turns compute-bound inside it.
FAST_L3 = ((1 * MIB, 180e9), (4 * MIB, 180e9), (8 * MIB, 75e9), (64 * MIB, 72e9), (96 * MIB, 70e9),
           (128 * MIB, 35e9), (512 * MIB, 30e9), (2048 * MIB, 30e9))
FAST_L3_CPU = HardwareSpec("this machine: a CPU", None, None, None, None, 367e9, 30e9, 30e9, kind="calibrated",
                           cache_levels=(("L2", 4 * MIB), ("L3", 480 * MIB)), memory_name="DRAM",
                           bandwidth_by_working_set=FAST_L3)


@pytest.mark.parametrize("context", [64, 256])  # lab-cpu at S = 1,024 stays bandwidth-bound on this roof
def test_the_compute_bound_batch_is_where_the_predicted_line_goes_flat(context):
    """On the cache-aware roof the mark sits where each batch's own roof turns compute-bound (the
    line goes flat there), earlier than the memory's bandwidth alone says; on a datasheet it is the
    closed form."""
    got = r.decode_compute_bound_batch_at_roof(LAB_CPU, FAST_L3_CPU, context, "fp32", "fp32", "fp32", r.KERNEL)
    dram_only = r.decode_compute_bound_batch(LAB_CPU, FAST_L3_CPU, context, "fp32", "fp32", "fp32", r.KERNEL)
    assert got is not None and got < dram_only
    first = int(-(-got // 1))  # the first whole batch at or past the mark
    for batch, compute_bound in ((first, True), (first - 1, False)):
        nbytes = r.decode_bytes_per_step(LAB_CPU, batch, context, "fp32", "fp32", "matmul")
        roof = r.roof_at_working_set(FAST_L3_CPU, nbytes)
        flops = r.decode_flops_per_step(LAB_CPU, batch, context, r.KERNEL)
        assert (r.compute_time_s(flops, roof, "fp32") >= r.memory_time_s(nbytes, roof)) == compute_bound, batch
    shown = explore.throughput_prediction(LAB_CPU, FAST_L3_CPU, [1], context, "fp32", "fp32")["compute_bound_batch"]
    assert shown == got
    assert r.decode_compute_bound_batch_at_roof(LAB_CPU, H100, context) == r.decode_compute_bound_batch(LAB_CPU, H100, context)


def test_each_measured_point_reports_its_fraction_of_the_roof_and_the_plan():
    records = [{"batch": 1, "time_s": 0.004, "predicted_time_s": 0.003, "roof_fraction": 0.75, "bound": "memory",
                "roof_tier": "L3", "plan_fraction": 0.75, "device_name": "a CPU", "samples": 9, "spread": 0.05},
               {"batch": 2, "time_s": 0.5, "predicted_time_s": 0.2, "roof_fraction": 0.4, "bound": "compute",
                "device_name": "a CPU", "samples": 3, "spread": 0.02}]
    series = explore.measured_series(records, "batch")
    assert series["roof_fraction"] == [0.75, 0.4]
    assert "0.75 of the memory-bound roof (L3 bandwidth; the chapter plans 0.75)" in series["label"][0]
    assert "0.40 of the compute-bound roof (peak FLOP/s; the chapter plans 0.40)" in series["label"][1]
    assert explore.roof_phrase({"bound": "memory"}) is None  # no fraction measured: nothing claimed
    assert "<br>" not in "".join(series["label"])  # judged by the calibration alone: no second line
    judged = dict(records[0], roof_fraction=0.3, roof_bandwidth_bytes_per_s=100e9, achieved_bytes_per_s=30e9,
                  moment_bandwidth_bytes_per_s=35e9, moment_roof_fraction=30 / 35)
    assert explore.measured_series([judged], "batch")["label"][0].endswith("<br>" + explore.moment_note(judged))
    assert "from a faster moment than this one" in explore.moment_note(judged)
    # a decode step whose kernels in turn lie off its roof: its fraction of theirs too, else not
    step = dict(records[0], in_turn_predicted_time_s=0.0039, in_turn_roof_fraction=0.975)
    assert explore.roof_phrase(step).endswith("plans 0.75), 0.97 of the roof of its kernels in turn")
    assert "in turn" not in explore.roof_phrase(dict(step, in_turn_predicted_time_s=0.00305))


def test_the_decode_readout_shows_the_plan_as_a_third_bar_when_measured():
    rec = {"time_s": 0.02, "predicted_time_s": 0.01, "planned_time_s": 0.0133, "tokens_per_s": 200.0, "batch": 4,
           "bytes": 1e9, "cache_share": 0.5, "regime": "mixed", "context_tokens": 10, "cache_dtype": "fp32",
           "device": "cpu"}
    out = explore.decode_readout(rec)
    assert out["bars"] == ["measured", "roofline", "chapter's plan"] and out["time_ms"] == pytest.approx([20.0, 10.0, 13.3])
    assert out["tokens_per_s"][2] == pytest.approx(4 / 0.0133)
    rec.pop("planned_time_s")
    assert explore.decode_readout(rec)["bars"] == ["measured", "roofline"]


def test_a_gpu_point_that_may_read_from_l2_says_so_and_stays_out_of_conclusions():
    """On a GPU a working set under 2x the L2 (roofline.l2_resident) may be served from the L2
    between back-to-back calls: the point says so and `growth` leaves it out."""
    assert explore.L2_RESIDENT_NOTE in explore.point_notes({"l2_resident": True})
    assert explore.point_notes({"l2_resident": False}) == []
    predicted = {"prompt_tokens": [100, 200, 400], "predicted_time_s": [1.0, 2.0, 4.0], "linear_only_s": [1.0, 2.0, 4.0]}
    records = [{"prompt_tokens": 100, "time_s": 1.0, "device": "cuda", "l2_resident": True},
               {"prompt_tokens": 200, "time_s": 2.0, "device": "cuda", "l2_resident": False},
               {"prompt_tokens": 400, "time_s": 4.0, "device": "cuda", "l2_resident": False}]
    g = explore.growth(records, "prompt_tokens", predicted)
    assert g["left_out"] == 1 and g["from"] == 200


# The 2-core EPYC VM's calibration of 2026-12-03 in round figures: 497 GFLOP/s fp32, ~58 GB/s
# from DRAM (one bandwidth, so every working set reads at it).
EPYC = HardwareSpec("this machine: a CPU", None, None, None, None, 497e9, 58.5e9, 24e9, kind="calibrated")


def test_a_step_whose_kernels_run_in_turn_sums_each_at_its_own_roof():
    """`roofline.in_turn_time_s`: products, attention and the rest, each at the slower of its
    FLOPs at peak and its bytes at the bandwidth, added. lab-cpu at B = 32, S = 1,024: the
    products (80 % of their FLOPs the LM head) are compute-bound and attention memory-bound, so
    the kernels in turn take ~1.3x the whole step's roof, which counts the products' FLOPs as
    hidden under attention's bytes; at batch 1 every part is memory-bound and the two agree."""
    work = r.decode_work_by_category(LAB_CPU, 32, 1024, "fp32", "fp32")
    parts = {name: r.roofline_time_s(w["flops"], w["bytes"], EPYC, "fp32") for name, w in work.items()}
    assert parts["products"] == pytest.approx(work["products"]["flops"] / 497e9)  # compute-bound
    assert parts["attention"] == pytest.approx(work["attention"]["bytes"] / 58.5e9)  # memory-bound
    in_turn = r.predicted_decode_step_in_turn_s(LAB_CPU, 32, 1024, EPYC, "fp32", "fp32")
    assert in_turn == pytest.approx(sum(parts.values())) == r.in_turn_time_s(work, EPYC, "fp32")
    whole = r.predicted_decode_step_s(LAB_CPU, 32, 1024, EPYC, "fp32", "fp32")
    assert 1.25 < in_turn / whole < 1.35
    one = r.predicted_decode_step_in_turn_s(LAB_CPU, 1, 1024, EPYC, "fp32", "fp32")
    assert 1.0 <= one / r.predicted_decode_step_s(LAB_CPU, 1, 1024, EPYC, "fp32", "fp32") < 1.02
    for batch in (1, 4, 16, 32, 64, 256):  # never below the whole step's roof
        for context in (0, 1024, 8192):
            assert (r.predicted_decode_step_in_turn_s(LAB_CPU, batch, context, CPU, "fp32", "fp32")
                    >= r.predicted_decode_step_s(LAB_CPU, batch, context, CPU, "fp32", "fp32"))


def test_the_charts_draw_the_kernels_in_turn_only_where_they_part_from_the_roof():
    """Lesson 04's throughput and lesson 01's decode chart: a dotted line for the kernels in turn
    where it lies off the whole step's roof (lab-cpu past the LM head's ridge), none where the two
    coincide (every part memory-bound: batch 1 to 4)."""
    from labkit import views
    names = lambda fig: [trace.name for trace in fig.data]  # noqa: E731
    parted = explore.throughput_prediction(LAB_CPU, EPYC, [1, 16, 32, 64], 1024, "fp32", "fp32")
    assert all(a <= b * 1.0001 for a, b in zip(parted["in_turn_tokens_per_s"], parted["tokens_per_s"]))
    measured = {"batch": [1], "tokens_per_s": [100.0], "device_name": "CPU"}
    assert explore.IN_TURN_LABEL in names(views.throughput_figure(parted, measured, "t"))
    together = explore.throughput_prediction(LAB_CPU, EPYC, [1, 2, 4], 1024, "fp32", "fp32")
    assert explore.IN_TURN_LABEL not in names(views.throughput_figure(together, measured, "t"))
    steps = explore.decode_prediction(LAB_CPU, EPYC, [1, 16, 32, 64], 1024, "fp32", "fp32")
    fig = views.measured_vs_predicted_figure("batch", steps, "batch", "t")
    assert names(fig)[5] == explore.IN_TURN_LABEL and list(fig.data[5].y) == steps["in_turn_time_s"]


def test_a_chart_whose_points_beat_their_roof_says_so_and_why_under_its_title():
    """A chart of several points shows only negative residual bars where points beat their roof;
    its note says how many and which reason the bandwidth read just after them points to."""
    from labkit import views
    base = {"time_s": 0.001, "predicted_time_s": 0.001, "bound": "memory", "device_name": "a CPU",
            "roof_bandwidth_bytes_per_s": 50e9}
    under = dict(base, batch=1, roof_fraction=0.9)
    slower_moment = dict(base, batch=2, roof_fraction=1.22, moment_bandwidth_bytes_per_s=62e9, moment_roof_fraction=0.98)
    cached = dict(base, batch=4, roof_fraction=1.1, moment_bandwidth_bytes_per_s=52e9, moment_roof_fraction=1.06)
    unread = dict(base, batch=8, roof_fraction=1.05)
    assert explore.measured_series([under], "batch")["note"] is None
    note = explore.over_roof_note([under, slower_moment])
    assert note.startswith("1 of 2 points ran faster than the calibrated roof (up to 1.22×; hover it for its reading)")
    assert note.endswith("<br>the memory read as fast just after it, so the calibration is from a slower moment "
                         "(`python -m labkit calibrate --refresh`)")
    assert explore.over_roof_note([cached]).endswith(
        "<br>it beat the memory read just after too: data stayed in a cache between calls")
    mixed = explore.over_roof_note([slower_moment, cached, dict(slower_moment, batch=16)]).split("<br>")
    assert mixed[0].startswith("All 3 points") and mixed[1].startswith("the memory read as fast just after 2 of them")
    assert mixed[2].startswith("1 of them beat the memory read just after too")
    assert "faster now than when it was calibrated, or data stayed" in explore.over_roof_note([unread, slower_moment])
    assert explore.over_roof_note([unread]).startswith("This point ran faster than the calibrated roof (up to 1.05×")
    assert explore.over_roof_note([unread, cached]).startswith("All 2 points ran faster")
    fig = views.measured_vs_predicted_figure("batch", {"batch": [1, 8], "predicted_time_s": [0.001, 0.001]}, "batch", "t")
    views.set_measured(fig, explore.measured_series([under, slower_moment], "batch"))
    assert fig.layout.title.subtitle.text == note
    views.set_measured(fig, explore.measured_series([under], "batch"))  # the note goes once no point beats its roof
    assert not fig.layout.title.subtitle.text


def test_the_linear_only_line_uses_the_same_tiered_roof_as_the_prediction():
    """Lesson 02's dashed line (attention left out) was timed at the DRAM's bandwidth while the solid
    one used the working set's: on a CPU a short prompt drew the dashed line above the solid one,
    a negative 'attention adds' band. Over lab-cpu's slider, the band is never negative."""
    prompts = [64, 128, 256, 512, 1024, 2048, 4096]
    # the weights (~60 MiB) read at the L3's 72 GB/s, not the DRAM's 30: short prompts memory-bound
    fast = dataclasses.replace(FAST_L3_CPU, fp32_flops_per_s=2e12)
    split = explore.prefill_split_prediction(LAB_CPU, fast, prompts, "fp32")
    assert all(linear <= whole * (1 + 1e-12) for linear, whole in zip(split["linear_only_s"], split["predicted_time_s"]))
    assert split["predicted_time_s"][-1] / split["linear_only_s"][-1] > 1.3  # the bend is still there


@pytest.mark.parametrize("device", ["cpu", "cuda"])
def test_lesson_01s_what_to_look_for_holds_over_its_sliders(device):
    """Lesson 01: predicted prefill time grows faster than the prompt over the whole slider (time per
    token rises, once the arithmetic outlasts the weights' read); predicted decode step time grows far
    more slowly than the batch, and all the way (it said 'barely moves' where it rose 2.45x by B = 16
    on the 2-core EPYC's calibration)."""
    from labkit import sizes
    settings = sizes.lab_settings(device)
    model, hardware = get_model(settings["model"]), (FAST_L3_CPU if device == "cpu" else H100)
    low, high, step, _ = settings["prompt"]
    prompts = list(range(low, high + 1, step))
    prefill = explore.prefill_prediction(model, hardware, prompts, settings["dtype"])["predicted_time_s"]
    # from where the arithmetic outlasts the weights' read: faster than the prompt; before it, flat-ish
    flops = [r.prefill_flops(model, p, 1, r.KERNEL) for p in prompts]
    first = next(i for i, (f, t) in enumerate(zip(flops, prefill)) if f / hardware.peak_flops_per_s(settings["dtype"]) >= t)
    p0, t0 = prompts[first], prefill[first]
    assert prefill[-1] / t0 > 1.2 * prompts[-1] / p0
    assert all(t / t0 >= p / p0 for p, t in zip(prompts, prefill) if p >= 4 * p0)  # (the head, read once, blurs 2x)
    assert first == 0 or prefill[first] / prefill[0] < prompts[first] / prompts[0]
    low, high, _, _ = settings["batch"]
    batches = list(range(low, high + 1))
    decode = explore.decode_prediction(model, hardware, batches, settings["context"][3], settings["dtype"],
                                       settings["cache_dtype"])["predicted_time_s"]
    assert all(t / decode[0] < b / 2 for b, t in zip(batches, decode) if b >= 8)  # far more slowly than B
    assert all(b > a for a, b in zip(decode, decode[1:]))
