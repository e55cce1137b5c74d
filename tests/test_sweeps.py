"""labkit.sweeps: real measurements on lab-tiny come back complete and sane; the lab-cpu model's
phenomena fall inside the CPU sliders' ranges (by formula, not by timing)."""
import dataclasses
import math
from pathlib import Path

import pytest

from labkit import calibrate, roofline, sizes, sweeps
from labkit.errors import FootprintError, LabError
from labkit.roofline import KERNEL
from labkit.specs import HardwareSpec, get_model

COMMON_KEYS = {"phase", "device", "device_name", "hardware", "model", "batch", "cache_dtype", "compute_dtype",
               "kernels", "time_s", "time_min_s", "time_max_s", "spread", "noisy", "samples", "flops", "bytes",
               "predicted_time_s", "bound", "achieved_flops_per_s", "achieved_bytes_per_s", "roof_fraction",
               "residual", "tokens_per_s", "host_bound", "working_set_bytes", "roof_bandwidth_bytes_per_s",
               "roof_tier", "plan_fraction", "l2_resident", "planned_time_s", "others_busy_share", "disturbed"}
# A stand-in for this machine's calibration (which takes ~10 s): the shape of a 2-core CPU's roof.
FAKE_ROOF = HardwareSpec("test CPU roof", None, None, None, None, 100e9, 10e9, 16e9, kind="calibrated")


@pytest.fixture
def fake_roof(monkeypatch):
    monkeypatch.setattr(calibrate, "load_or_calibrate", lambda device, refresh=False: (FAKE_ROOF, {}))


def check_point(point, phase, x_key, x):
    missing = COMMON_KEYS - set(point)
    assert not missing, f"{phase} point lacks {sorted(missing)}"
    assert point["phase"] == phase and point[x_key] == x and point["device"] == "cpu"
    assert point["time_min_s"] <= point["time_s"] <= point["time_max_s"] and point["time_s"] > 0
    assert point["predicted_time_s"] > 0 and point["roof_fraction"] > 0 and point["flops"] > 0
    assert point["bound"] in ("compute", "memory") and point["samples"] >= 1
    assert point["host_bound"] is None  # a CPU point: the host does the work, nothing to wait for
    assert math.isclose(point["residual"], point["time_s"] / point["predicted_time_s"] - 1)
    assert math.isclose(point["achieved_flops_per_s"], point["flops"] / point["time_s"])
    assert point["working_set_bytes"] == point["bytes"] and point["l2_resident"] is None  # a CPU has no L2 flag
    assert point["plan_fraction"] == roofline.chapter_plan_fraction(point["bound"])
    # the chapter's plan: 40 % of peak, 75 % of bandwidth, so between 1/0.75 and 1/0.40 of the roof's time
    assert 0.999 / 0.75 <= point["planned_time_s"] / point["predicted_time_s"] <= 1.001 / 0.40


def test_measure_prefill_on_lab_tiny(fake_roof):
    point = sweeps.measure_prefill("lab-tiny", prompt_tokens=64, batch=2, device="cpu")
    check_point(point, "prefill", "prompt_tokens", 64)
    spec = get_model("lab-tiny")
    assert point["flops"] == roofline.prefill_flops(spec, 64, 2, KERNEL)
    weights, cache = roofline.weight_bytes(spec, "fp32", "matmul"), roofline.kv_cache_bytes(spec, 64, 2, "fp32")
    assert point["bytes"] == weights + cache
    assert point["compute_dtype"] == "fp32" and point["kernels"] == "torch"


@pytest.mark.parametrize("cache_dtype", ["fp32", "int8"])
def test_measure_decode_on_lab_tiny(fake_roof, cache_dtype):
    point = sweeps.measure_decode("lab-tiny", batch=3, context_tokens=100, cache_dtype=cache_dtype, device="cpu")
    check_point(point, "decode", "context_tokens", 100)
    spec = get_model("lab-tiny")
    assert point["bytes"] == roofline.decode_bytes_per_step(spec, 3, 100, "fp32", cache_dtype, "matmul")
    assert point["regime"] in ("weights-dominated", "mixed", "cache-dominated")
    assert 0 < point["cache_share"] < 1 and math.isclose(point["tokens_per_s"], 3 / point["time_s"])
    # its kernels in turn, on the roof at its working set: each part at its own roof, added
    assert point["work_by_category"] == roofline.decode_work_by_category(spec, 3, 100, "fp32", cache_dtype)
    assert point["in_turn_predicted_time_s"] == pytest.approx(
        roofline.predicted_decode_step_in_turn_s(spec, 3, 100, FAKE_ROOF, "fp32", cache_dtype))
    assert point["in_turn_predicted_time_s"] >= point["predicted_time_s"]
    assert point["in_turn_roof_fraction"] == pytest.approx(point["in_turn_predicted_time_s"] / point["time_s"])
    cache = sweeps.get_built_model("lab-tiny", "cpu").cache
    assert cache.host_lengths == [100] * 3, "timed steps must leave the context length where it was"


def test_decode_at_context_zero_and_sweeps(fake_roof, monkeypatch):
    seen, reads = [], []
    monkeypatch.setattr(calibrate, "bandwidth_now", lambda device, working_set_bytes=None: reads.append(
        working_set_bytes) or 20e9)
    points = sweeps.decode_sweep("lab-tiny", batches=[1, 2], contexts=[0, 40], cache_dtypes=["bf16"],
                                 device="cpu", progress=lambda i, n: seen.append((i, n)))
    assert [(p["batch"], p["context_tokens"]) for p in points] == [(1, 0), (1, 40), (2, 0), (2, 40)]
    assert seen == [(1, 4), (2, 4), (3, 4), (4, 4)]
    prefill = sweeps.prefill_sweep("lab-tiny", prompts=[16, 32], device="cpu")
    assert [p["prompt_tokens"] for p in prefill] == [16, 32]
    # a sweep's point far from its roof is judged by its moment too, as a slider's (`with_moment`)
    far = [p for p in points + prefill if p["bound"] == "memory" and not roofline.SWEEP_FAR_FROM_ROOF <= p["roof_fraction"] <= 1]
    assert far and reads == [p["working_set_bytes"] for p in far]
    assert all(("moment_roof_fraction" in p) == (p in far) for p in points + prefill)
    record = sweeps.bind_decode("lab-tiny", context_tokens=8, cache_dtype="fp32", device="cpu")(batch=2)
    assert (record["batch"], record["context_tokens"]) == (2, 8)


def test_a_sweep_in_rounds_times_every_point_there_and_back_and_keeps_its_fastest(monkeypatch):
    """rounds=2: the grid forwards, then backwards (a ratio of its ends is not one moment against
    another); each point keeps its fastest timing; progress counts every timing."""
    order, seen = [], []
    times = iter([0.5, 0.9, 0.7, 0.4])  # S=0, S=40 forwards, then S=40, S=0 backwards

    def fake_measure(model, batch, context_tokens, cache_dtype, device, capacity=None):
        order.append(context_tokens)
        return {"batch": batch, "context_tokens": context_tokens, "time_s": next(times), "device": "cpu",
                "bound": "memory", "roof_fraction": 0.8, "capacity": capacity}

    monkeypatch.setattr(sweeps, "measure_decode", fake_measure)
    points = sweeps.decode_sweep("lab-tiny", [1], [40, 0], ["fp32"], "cpu", lambda i, n: seen.append((i, n)), rounds=2)
    assert order == [0, 40, 40, 0] and seen == [(1, 4), (2, 4), (3, 4), (4, 4)]
    assert [(p["context_tokens"], p["time_s"]) for p in points] == [(0, 0.4), (40, 0.7)]
    assert {p["capacity"] for p in points} == {41}


def test_the_context_question_reads_the_ends_of_the_sweep_it_is_given(fake_roof):
    from labkit import predict
    ran = []
    sweep = lambda: ran.append(1) or [{"context_tokens": c, "time_s": t, "device_name": "a CPU"}
                                      for c, t in ((8192, 0.006), (0, 0.004), (2048, 0.0045))]
    out = predict.reveal_context_slowdown(2.0, device="cpu", sweep=sweep)
    assert ran == [1] and out["rows"][2] == ("measured on a CPU", "1.5×")
    assert "8,192 tokens of context ÷ at none" in str(out)


def test_models_are_reused():
    assert sweeps.get_built_model("lab-tiny", "cpu") is sweeps.get_built_model("lab-tiny", "cpu")


def test_a_new_model_is_warmed_up_once_and_left_empty(monkeypatch):
    warmed = []
    monkeypatch.setattr(sweeps, "_MODELS", type(sweeps._MODELS)())
    monkeypatch.setattr(sweeps, "_warm_up", lambda built, real=sweeps._warm_up: (warmed.append(built), real(built)))
    built = sweeps.get_built_model("lab-tiny", "cpu")
    assert sweeps.get_built_model("lab-tiny", "cpu") is built and warmed == [built]
    assert built.cache.host_lengths == [0] and not any(built.cache.active)


class FakeTimer:
    """threading.Timer that never runs by itself: the test fires it."""
    made = []

    def __init__(self, interval, function):
        self.interval, self.function, self.cancelled, self.daemon = interval, function, False, False
        FakeTimer.made.append(self)

    def start(self):
        pass

    def cancel(self):
        self.cancelled = True


def test_each_cpu_model_asked_for_restarts_the_countdown_to_rest_on_a_daemon_thread(monkeypatch):
    FakeTimer.made = []
    monkeypatch.setattr(sweeps.threading, "Timer", FakeTimer)
    monkeypatch.setattr(sweeps, "_rest_timer", None)
    monkeypatch.setattr(sweeps, "_MODELS", type(sweeps._MODELS)())
    built = sweeps.get_built_model("lab-tiny", "cpu")
    assert sweeps.get_built_model("lab-tiny", "cpu") is built
    first, second = FakeTimer.made
    assert first.cancelled and not second.cancelled and second.daemon
    assert (second.interval, second.function) == (sweeps.REST_AFTER_S, sweeps.rest)


def test_rest_lets_the_cpu_models_go_and_hands_the_freed_memory_back(monkeypatch):
    handed = []
    monkeypatch.setattr(sweeps.threading, "Timer", FakeTimer)
    monkeypatch.setattr(sweeps, "_MODELS", type(sweeps._MODELS)())
    monkeypatch.setattr(sweeps.cpu_memory, "hand_back", lambda: handed.append(1) or True)
    held = sweeps.get_built_model("lab-tiny", "cpu")
    assert sweeps.rest() == 1 and not sweeps._MODELS and handed == [1]
    assert held.cache is not None, "whoever holds a model keeps it whole"
    again = sweeps.get_built_model("lab-tiny", "cpu")
    assert again is not held and again.spec == held.spec, "the next point builds it again"


@pytest.mark.slow
@pytest.mark.skipif(not Path("/proc/self/status").exists(), reason="reads the resident set from Linux's /proc")
def test_at_rest_a_process_gives_back_lab_cpu_its_cache_and_the_memory_it_kept():
    """Real memory: lab-cpu built (~0.2 GB of weights and packed copies) and a 64 MiB cache
    filled as a decode point at B = 16, S = 1,024 would, then `rest`."""
    def resident_bytes():
        return int(next(line for line in open("/proc/self/status") if line.startswith("VmRSS")).split()[1]) * 1024

    def build_and_fill():  # no reference to the model outlives this call
        sweeps.ensure_cache(sweeps.get_built_model("lab-cpu", "cpu"), 16, 1025, "fp32", 1).fill_random(1024)
    build_and_fill()
    before = resident_bytes()
    assert sweeps.rest() >= 1
    after = resident_bytes()
    assert before - after > 150e6, f"{before / 1e6:.0f} MB before rest, {after / 1e6:.0f} MB after"


# ------------------------------------------------------------------ lab-cpu phenomena, by formula
CPU = sizes.lab_settings("cpu")
LAB_CPU = get_model(CPU["model"])


def test_prefill_crosses_attention_crossover_within_prompt_slider():
    low, high = CPU["prompt"][:2]
    crossover = roofline.crossover_tokens(LAB_CPU, KERNEL)
    assert low < crossover < high, f"crossover at {crossover:.0f} tokens, slider {low}..{high}"


def test_decode_goes_from_weights_to_cache_dominated_within_sliders():
    batch_high, context_high = CPU["batch"][1], CPU["context"][1]
    share = lambda b, s: roofline.cache_share(LAB_CPU, b, s, CPU["dtype"], CPU["cache_dtype"], "matmul")  # noqa: E731
    assert roofline.decode_regime(share(1, 256)) == "weights-dominated"
    assert roofline.decode_regime(share(batch_high, context_high)) == "cache-dominated"
    for cache_dtype in ("bf16", "int8", "fp8"):  # even the compact caches get there
        s = roofline.cache_share(LAB_CPU, batch_high, context_high, CPU["dtype"], cache_dtype, "matmul")
        assert roofline.decode_regime(s) == "cache-dominated", cache_dtype


@pytest.mark.slow
def test_decode_compute_bound_batch_within_batch_slider_on_calibrated_cpu():
    """On this machine's calibrated roof (measured once per test session, ~10 s), decode with a
    short context turns compute-bound inside the batch slider."""
    roof, _ = calibrate.load_or_calibrate("cpu")
    batch = roofline.decode_compute_bound_batch(LAB_CPU, roof, 0, CPU["dtype"], CPU["cache_dtype"],
                                                CPU["dtype"], KERNEL)
    low, high = CPU["batch"][:2]
    assert batch is not None and low < batch < high, f"compute-bound from batch {batch}, slider {low}..{high}"


def test_a_point_is_judged_at_the_roof_of_its_working_set(monkeypatch):
    """A calibration with a curve: a lab-tiny step (~0.3 MB of fp32 weights) sits in the L2, and
    its prediction, bound and fraction use the L2's rate, not the DRAM's."""
    mib = 2**20
    roof = dataclasses.replace(FAKE_ROOF, cache_levels=(("L2", 4 * mib), ("L3", 64 * mib)), memory_name="DRAM",
                               bandwidth_by_working_set=((mib // 4, 80e9), (mib, 80e9), (16 * mib, 30e9),
                                                         (256 * mib, 10e9)))
    monkeypatch.setattr(calibrate, "load_or_calibrate", lambda device, refresh=False: (roof, {}))
    point = sweeps.measure_decode("lab-tiny", batch=1, context_tokens=8, cache_dtype="fp32", device="cpu")
    assert point["roof_tier"] == "L2" and point["roof_bandwidth_bytes_per_s"] == pytest.approx(80e9)
    at_tier = roofline.roof_at_working_set(roof, point["working_set_bytes"])
    assert point["predicted_time_s"] == roofline.roofline_time_s(point["flops"], point["bytes"], at_tier, "fp32")
    assert point["roof_fraction"] == pytest.approx(point["predicted_time_s"] / point["time_s"])


def test_working_sets_are_known_before_the_point_runs():
    spec = get_model("lab-tiny")
    assert sweeps.decode_working_set_bytes("lab-tiny", 3, 100, "int8", "cpu") == roofline.decode_bytes_per_step(
        spec, 3, 100, "fp32", "int8", "matmul")
    assert sweeps.prefill_working_set_bytes("lab-tiny", 64, 2, "cpu") == roofline.prefill_bytes(spec, 64, 2, "fp32", "fp32",
                                                                                                "matmul")


def test_bracketed_judges_a_point_against_the_bandwidth_of_its_moment(fake_roof, monkeypatch):
    """The bandwidth read just before and after a point, at its working set; the faster reading
    is the roof of its moment. A memory-bound point's fraction follows it; the FLOP peak stays
    the calibration's."""
    readings, order = iter([12e9, 15e9]), []
    monkeypatch.setattr(calibrate, "bandwidth_now", lambda device, working_set_bytes=None: order.append(
        ("bandwidth", working_set_bytes)) or next(readings))
    point = {"device": "cpu", "flops": 1e6, "bytes": 1e8, "time_s": 0.02, "compute_dtype": "fp32",
             "roof_fraction": 0.5}
    got = sweeps.bracketed(lambda: order.append("point") or dict(point), "cpu", 10**8)
    assert order == [("bandwidth", 10**8), "point", ("bandwidth", 10**8)]
    assert got["bandwidth_before_bytes_per_s"] == 12e9 and got["bandwidth_after_bytes_per_s"] == 15e9
    assert got["bracketed_roof_fraction"] == pytest.approx(1e8 / 0.02 / 15e9)  # 5 GB/s of 15
    assert got["bracketed_predicted_time_s"] == pytest.approx(1e8 / 15e9)  # the roofline's time on that roof
    assert got["roof_fraction"] == 0.5  # the calibration's fraction is kept beside it
    monkeypatch.setattr(calibrate, "bandwidth_now", lambda device, working_set_bytes=None: 30e9)
    compute_bound = dict(point, flops=1e12, time_s=20.0)  # 1e12 FLOP at FAKE_ROOF's 100 GFLOP/s: 10 s
    got = sweeps.bracketed(lambda: dict(compute_bound), "cpu")
    assert got["bracketed_roof_fraction"] == pytest.approx(0.5) and got["bracketed_predicted_time_s"] == pytest.approx(10)
    assert "bracketed_in_turn_fraction" not in got  # no parts given: not a decode step
    # a decode step's kernels in turn on the same roof: 1e12 FLOP at 100 GFLOP/s, then 3e8 B at 30 GB/s
    work = {"products": {"flops": 1e12, "bytes": 1e7}, "attention": {"flops": 1e6, "bytes": 3e8}}
    got = sweeps.bracketed(lambda: dict(compute_bound, work_by_category=work), "cpu")
    assert got["bracketed_in_turn_predicted_time_s"] == pytest.approx(10 + 0.01)
    assert got["bracketed_in_turn_fraction"] == pytest.approx(10.01 / 20)


def test_a_slider_point_far_from_its_roof_reads_the_bandwidth_of_its_moment(monkeypatch):
    """`with_moment`: only a CPU point bound by memory under FAR_FROM_ROOF or over 1 of its
    calibrated roof pays for a reading, at its own working set; the bound measures go through it."""
    reads = []
    monkeypatch.setattr(calibrate, "bandwidth_now", lambda device, working_set_bytes=None: reads.append(
        (device, working_set_bytes)) or 50e9)
    point = {"device": "cpu", "bound": "memory", "roof_fraction": 0.4, "working_set_bytes": 64 << 20,
             "achieved_bytes_per_s": 40e9}
    got = sweeps.with_moment(point)
    assert reads == [("cpu", 64 << 20)] and got["moment_bandwidth_bytes_per_s"] == 50e9
    assert got["moment_roof_fraction"] == pytest.approx(0.8) and "moment_roof_fraction" not in point
    for near, reason in ((dict(point, roof_fraction=0.7), "near its roof"), (dict(point, bound="compute"), "compute"),
                         (dict(point, device="cuda"), "a GPU"), (dict(point, roof_fraction=None), "no roof")):
        assert sweeps.with_moment(near) == near, reason
    assert len(reads) == 1 and "moment_roof_fraction" in sweeps.with_moment(dict(point, roof_fraction=1.4))
    # a sweep's point reads only further off (a reading per point of a sweep adds up)
    between = dict(point, roof_fraction=0.6)
    assert "moment_roof_fraction" in sweeps.with_moment(between)
    assert sweeps.with_moment(between, roofline.SWEEP_FAR_FROM_ROOF) == between and len(reads) == 3
    measured = []
    monkeypatch.setattr(sweeps, "measure_decode", lambda model, **kw: measured.append(kw) or dict(point))
    assert sweeps.bind_decode("lab-tiny", cache_dtype="fp32")(batch=2)["moment_roof_fraction"] == pytest.approx(0.8)
    assert measured == [{"cache_dtype": "fp32", "batch": 2}]
    # no room for the reading's buffers (a 1 GiB limit): the point stands as measured, not refused
    def no_room(device, working_set_bytes=None):
        raise FootprintError("the calibration's bandwidth sweep needs 632 MiB but cpu has 99 MiB free")
    monkeypatch.setattr(calibrate, "bandwidth_now", no_room)
    assert sweeps.with_moment(point) == point


def test_a_cache_dtype_the_cpu_does_not_offer_is_refused_before_anything_is_allocated(fake_roof, monkeypatch):
    from labkit import breakdown
    built = sweeps.get_built_model("lab-tiny", "cpu")
    monkeypatch.setattr(built, "setup_cache", lambda *a, **k: pytest.fail("a cache was allocated"))
    for measure in (sweeps.measure_decode, breakdown.decode_breakdown):
        with pytest.raises(LabError, match="the CPU path offers no fp8 KV cache"):
            measure("lab-tiny", batch=2, context_tokens=10, cache_dtype="fp8", device="cpu")


def test_a_chart_is_primed_only_with_the_batches_whose_cache_fits(monkeypatch):
    """`fitting_batches`: what `measure_decode` would refuse is left out, allocating nothing; a
    cache already big enough counts as fitting; an unoffered dtype is still refused in one line."""
    from labkit import backend
    built = sweeps.get_built_model("lab-tiny", "cpu")
    built.setup_cache(2, 200, "fp32")
    per_row = roofline.kv_cache_bytes(built.spec, 200, 1, "fp32")
    monkeypatch.setattr(backend, "free_memory_bytes", lambda device: int((36 * per_row + backend.CPU_WORKING_BYTES) / (1 - backend.HEADROOM)))  # 36 rows of room
    monkeypatch.setattr(built, "setup_cache", lambda *a, **k: pytest.fail("a cache was allocated"))
    assert sweeps.fitting_batches("lab-tiny", [1, 2, 16, 64, 4096], 199, "fp32", "cpu") == [1, 2, 16]
    monkeypatch.setattr(backend, "free_memory_bytes", lambda device: 0)
    # the cache it has serves batch 2; batch 3 needs more than the old cache frees (batch 1 would not)
    assert sweeps.fitting_batches("lab-tiny", [2, 3], 150, "fp32", "cpu") == [2]
    with pytest.raises(LabError, match="no fp8 KV cache"):
        sweeps.fitting_batches("lab-tiny", [1], 10, "fp8", "cpu")


def test_a_prefill_into_a_cache_big_enough_is_still_checked_for_its_activations(fake_roof, monkeypatch):
    """A model's cache of 4,096 tokens serves every prefill up to 4,096 as it is; the prefill's
    activations are new all the same. On the CPU they count CPU_PREFILL_GROWTH times over (the heap
    grew ~3.3x them, measured), so under a 640 MiB limit P = 4,096 is refused in one line, where
    before the kernel's OOM killer ended the lesson's kernel."""
    from labkit import backend, model
    built = sweeps.get_built_model("lab-tiny", "cpu")
    built.setup_cache(1, 512, "fp32")
    need = built.prefill_bytes(1, 512)
    activations = roofline.activation_bytes(built.spec, 512, 1, "fp32")
    assert need == int(model.CPU_PREFILL_GROWTH * activations) + roofline.logits_bytes(built.spec, 1)
    monkeypatch.setattr(backend, "free_memory_bytes", lambda device: int((need + backend.CPU_WORKING_BYTES) / (1 - backend.HEADROOM)) - 1)
    monkeypatch.setattr(built, "prefill", lambda *a, **k: pytest.fail("a prefill ran"))
    with pytest.raises(FootprintError, match=r"^a prefill of 1 x 512 tokens of lab-tiny \(its activations\) needs "):
        sweeps.measure_prefill("lab-tiny", prompt_tokens=512, device="cpu")
    assert built.cache.max_tokens == 512  # the cache it had stays
    sweeps.ensure_cache(built, 1, 10, "fp32", 1)  # a decode step's one token: no prefill to check


def test_lesson_01s_gpu_decode_chart_starts_with_what_an_h100_holds():
    """The reason `fitting_batches` primes lesson 01's decode chart: at its GPU context (8,192
    tokens) the 8B's cache at batch 64 and its weights need more than an H100's 80 GB less the
    lab's headroom, batch 32 fits (the footprint `Llama.check_cache` checks, weights included)."""
    from labkit import backend
    gpu = sizes.lab_settings("cuda")
    spec, room = get_model(gpu["model"]), 80e9 * (1 - backend.HEADROOM)
    need = lambda batch: roofline.memory_footprint_bytes(spec, batch, gpu["context"][3] + 1, gpu["dtype"],  # noqa: E731
                                                         gpu["cache_dtype"], 1)
    assert need(64) > room > need(32)


def _cpu_timings(monkeypatch, shares, quiet=True):
    """sweeps._time on the CPU with scripted timings (each call's estimate and others' share, in
    turn) and wait_for_quiet answering `quiet`; returns (the timing kept, calls made, waits made)."""
    from labkit import timing
    made, waits = [], []

    def fake_time(fn, *args):
        seconds, share = shares[len(made)]
        made.append(1)
        return timing.Timing((seconds, seconds), estimator="fastest", others_busy_share=share)

    monkeypatch.setattr(timing, "time_until_stable", fake_time)
    monkeypatch.setattr(timing, "wait_for_quiet", lambda wait_s: waits.append(wait_s) or quiet)
    monkeypatch.setattr(timing, "_last_vain_wait", [-math.inf])
    return lambda: (sweeps._time(lambda: None, "cpu", None), len(made), waits)


def test_a_cpu_point_is_timed_once_quiet_and_again_if_others_were_busy_all_the_same(monkeypatch):
    """The browser drawing the last chart throughout a point slowed every call (lesson 01's 1,088-token
    prefill 87-93 ms with others at 11.5-13.8 % of the cores, 65 ms from a terminal): a point is
    timed after a quiet moment, and if others kept the cores busy all the same, again after another;
    the quiet figure is kept even where it is the slower, and a second busy one only where it is
    the faster."""
    from labkit import timing
    monkeypatch.delenv("LABKIT_QUIET_WAIT_S", raising=False)
    kept, calls, waits = _cpu_timings(monkeypatch, [(0.083, 0.16), (0.065, 0.01)])()
    assert (kept.estimate_s, calls, waits) == (0.065, 2, [timing.QUIET_WAIT_S] * 2) and not kept.disturbed
    kept, calls, _ = _cpu_timings(monkeypatch, [(0.060, 0.16), (0.065, 0.01)])()
    assert kept.estimate_s == 0.065 and calls == 2
    kept, _, _ = _cpu_timings(monkeypatch, [(0.083, 0.5), (0.070, 0.3)])()
    assert kept.estimate_s == 0.070 and kept.disturbed
    kept, _, _ = _cpu_timings(monkeypatch, [(0.060, 0.5), (0.070, 0.3)])()
    assert kept.estimate_s == 0.060 and kept.disturbed
    kept, calls, waits = _cpu_timings(monkeypatch, [(0.065, 0.05)])()  # quiet throughout: timed once
    assert calls == 1 and waits == [timing.QUIET_WAIT_S]


def test_a_machine_with_no_quiet_moment_is_not_waited_for_again_for_a_while(monkeypatch):
    monkeypatch.delenv("LABKIT_QUIET_WAIT_S", raising=False)
    run = _cpu_timings(monkeypatch, [(0.083, 0.5)] * 3, quiet=False)
    kept, calls, waits = run()
    assert kept.disturbed and calls == 1 and len(waits) == 1  # waited in vain, timed once, flagged
    _, calls, waits = run()
    assert calls == 2 and len(waits) == 1  # within QUIET_RETRY_AFTER_S: no second wait
    from labkit import timing
    monkeypatch.setattr(timing, "_last_vain_wait", [timing.time.monotonic() - timing.QUIET_RETRY_AFTER_S - 1])
    run()
    assert len(waits) == 2


def test_labkit_quiet_wait_s_sets_the_wait_and_0_turns_the_timing_again_off(monkeypatch):
    monkeypatch.setenv("LABKIT_QUIET_WAIT_S", "0")
    _, calls, waits = _cpu_timings(monkeypatch, [(0.083, 0.5)])()
    assert calls == 1 and waits == []
    monkeypatch.setenv("LABKIT_QUIET_WAIT_S", "0.5")
    from labkit import timing
    assert timing.quiet_wait_s() == 0.5
    for bad in ("-1", "soon", "nan", "1e9"):
        monkeypatch.setenv("LABKIT_QUIET_WAIT_S", bad)
        with pytest.raises(LabError, match="LABKIT_QUIET_WAIT_S must be seconds from 0 to 600"):
            timing.quiet_wait_s()
