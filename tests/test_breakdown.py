"""labkit.breakdown and its hook (labkit.clock): the parts of a real step add up to the whole, the
hook changes no result, the roof beside each part is roofline's, and the CLI, the sentence and
the chart read the record."""
import json
import math
import re
import time
from types import SimpleNamespace

import pytest
import torch

from labkit import backend, breakdown, calibrate, cli, explore, gpu_profile, measure, sweeps
from labkit import model as model_module
from labkit import roofline as r
from labkit.clock import CATEGORIES, OFF, Clock
from labkit.cpu_decode import CpuDecode
from labkit.decode_paths import EagerDecode
from labkit.errors import LabError
from labkit.model import Llama
from labkit.specs import BYTES_PER_ELEMENT, HardwareSpec, get_model
from labkit.timing import Timing

TINY, LAB = get_model("lab-tiny"), get_model("lab-cpu")
# A stand-in for this machine's calibration (~10 s): a CPU's shape, with a roof that falls from a
# cache's rate to the memory's, so the roof at the step's working set is the memory's.
FAKE_ROOF = HardwareSpec("test CPU roof", None, None, None, None, 100e9, 10e9, 16e9, kind="calibrated",
                         bandwidth_by_working_set=((2**16, 80e9), (2**30, 10e9)))
QUICK_S = 0.2  # a short timing budget: lab-tiny's steps take well under a millisecond


@pytest.fixture
def fake_roof(monkeypatch):
    monkeypatch.setattr(calibrate, "load_or_calibrate", lambda device, refresh=False, **kw: (FAKE_ROOF, {}))


def fresh_tokens(*shape):
    """Fresh random token ids each run (no fixed seed): the hook must not matter for any input."""
    return torch.randint(0, TINY.vocab_size, shape)


# ------------------------------------------------------------------ the clock
def test_a_clock_adds_each_part_to_its_category_and_off_times_nothing():
    clock = Clock()
    with clock.time("products"):
        time.sleep(0.01)
    slept = clock.timed("other", time.sleep)
    slept(0.005)
    slept(0.005)
    assert clock.seconds["products"] >= 0.01 and clock.seconds["other"] >= 0.01
    assert clock.seconds["attention"] == 0.0 and set(clock.seconds) == set(CATEGORIES)
    assert OFF.timed("products", time.sleep) is time.sleep  # nothing wrapped, nothing to pay
    with OFF.time("products"):
        pass


def test_parts_never_nest_and_categories_are_known():
    clock = Clock()
    with pytest.raises(LabError, match="never nest"):
        with clock.time("products"):
            with clock.time("other"):
                pass
    with pytest.raises(LabError, match="known: products, attention, other"):
        clock.time("softmax")


# ------------------------------------------------------------------ the hook changes nothing
@pytest.mark.parametrize("cache_dtype", ["fp32", "int8"])
@pytest.mark.parametrize("path", ["cpu", "eager"])
def test_the_hook_changes_no_logits_and_times_every_category(path, cache_dtype):
    runs = []
    prompt, steps = fresh_tokens(3, 20), [fresh_tokens(3) for _ in range(2)]
    for clock in (OFF, Clock()):
        m = Llama(TINY, batch=3, max_tokens=32, cache_dtype=cache_dtype, device="cpu", seed=5)
        if path == "eager":
            m.decode_path = EagerDecode(m)
        assert isinstance(m.decode_path, EagerDecode if path == "eager" else CpuDecode)
        m.clock = clock
        runs.append(([m.prefill(prompt)] + [m.decode_step(t) for t in steps], m.cache.k.clone(), clock))
    (plain, plain_k, _), (hooked, hooked_k, clock) = runs
    for i, (a, b) in enumerate(zip(plain, hooked)):
        assert torch.equal(a, b), f"call {i}: max |diff| {(a - b).abs().max().item():.3g}"
    assert torch.equal(plain_k.view(torch.uint8), hooked_k.view(torch.uint8))
    assert all(clock.seconds[c] > 0 for c in CATEGORIES), clock.seconds


# ------------------------------------------------------------------ the predicted side
def test_each_parts_work_is_roofline_s():
    for P, B in ((100, 2), (2048, 1)):
        work = r.prefill_work_by_category(LAB, P, B, "fp32", "int8")
        assert work["products"]["flops"] + work["attention"]["flops"] == r.prefill_flops(LAB, P, B, r.KERNEL)
        assert work["products"]["bytes"] == r.weight_bytes(LAB, "fp32", "matmul")
        assert work["attention"]["bytes"] == LAB.n_layers * r.flash_attention_bytes(
            B, LAB.n_heads, P, P, LAB.head_dim, "fp32", LAB.n_kv_heads)
        assert work["other"] == {"flops": 0, "bytes": r.elementwise_bytes(LAB, B * P, B, "fp32", "int8")}
    for B, S, cache in ((1, 0, "fp32"), (4, 1000, "fp8"), (16, 4096, "int8")):
        work = r.decode_work_by_category(LAB, B, S, "fp32", cache)
        assert work["products"]["flops"] + work["attention"]["flops"] == r.decode_flops_per_step(LAB, B, S, r.KERNEL)
        # the products and attention read what a step reads, plus q and the attention output (fp8: its scales)
        extra = LAB.n_layers * (2 * B * LAB.q_dim * 4 + (2 * r.FP8_SCALE_BYTES if cache == "fp8" else 0))
        assert (work["products"]["bytes"] + work["attention"]["bytes"]
                == r.decode_bytes_per_step(LAB, B, S, "fp32", cache, "matmul") + extra)


def test_everything_else_counts_each_operand_once():
    """lab-tiny (d 64, q 64, kv 32, ffn 128, L 2) by hand: per layer norms 4d, RoPE 2(q + kv), K and V
    read 2 kv, residual adds 6d, SwiGLU 3 ffn elements; the cache write in its own dtype; the
    embedding 2d; the final norm 2d per sequence."""
    d, q, kv, ffn, L = 64, 64, 32, 128, 2
    per_layer = 4 * d + 2 * (q + kv) + 2 * kv + 6 * d + 3 * ffn
    for dtype, cache in (("fp32", "fp32"), ("bf16", "int8")):
        e = BYTES_PER_ELEMENT[dtype]
        cache_write = L * (2 * kv * BYTES_PER_ELEMENT[cache] + (2 * 2 * 4 if cache == "int8" else 0))
        assert r.elementwise_bytes_per_position(TINY, dtype, cache) == L * per_layer * e + cache_write + 2 * d * e
        assert r.elementwise_bytes(TINY, 10, 2, dtype, cache) == (10 * (L * per_layer * e + cache_write + 2 * d * e)
                                                                   + 2 * 2 * d * e)


# ------------------------------------------------------------------ the record
def check_record(b, work):
    rows = {row["category"]: row for row in b["categories"]}
    assert list(rows) == list(breakdown.PARTS)
    assert all(row["time_s"] >= 0 and row["share"] >= 0 for row in rows.values())
    parts = sum(rows[c]["time_s"] for c in CATEGORIES)
    assert parts == pytest.approx(b["parts_time_s"])
    total = sum(row["time_s"] for row in rows.values())
    # overhead is the whole less its timed parts; 0 (and flagged) when the parts outran the whole
    assert total == pytest.approx(max(b["time_s"], parts), rel=1e-12)
    assert b["parts_exceed_whole"] == (parts > b["time_s"])
    assert sum(row["share"] for row in rows.values()) == pytest.approx(total / b["time_s"])
    # the step's fraction is the parts' contributions, added
    assert sum(row["contributed_fraction"] for row in rows.values()) == pytest.approx(b["step_fraction"])
    roof = r.roof_at_working_set(FAKE_ROOF, b["working_set_bytes"])
    assert b["roof_bandwidth_bytes_per_s"] == roof.memory_bandwidth_bytes_per_s < 80e9
    for c in CATEGORIES:
        assert (rows[c]["flops"], rows[c]["bytes"]) == (work[c]["flops"], work[c]["bytes"])
        assert rows[c]["roof_time_s"] == r.roofline_time_s(work[c]["flops"], work[c]["bytes"], roof, "fp32")
        assert rows[c]["roof_fraction"] == pytest.approx(rows[c]["roof_time_s"] / rows[c]["time_s"])
    assert rows["overhead"]["roof_time_s"] == 0 and rows["overhead"]["roof_fraction"] is None
    flops = work["products"]["flops"] + work["attention"]["flops"]
    assert b["predicted_time_s"] == r.roofline_time_s(flops, b["working_set_bytes"], roof, "fp32")
    assert b["planned_time_s"] > b["predicted_time_s"] and b["samples"] >= 2


def test_a_prefill_splits_into_parts_that_add_up(fake_roof):
    b = breakdown.prefill_breakdown("lab-tiny", prompt_tokens=48, batch=2, device="cpu", budget_s=QUICK_S)
    assert (b["phase"], b["prompt_tokens"], b["batch"], b["device"], b["kernels"]) == ("prefill", 48, 2, "cpu", "torch")
    check_record(b, r.prefill_work_by_category(TINY, 48, 2, "fp32", "fp32"))
    assert b["measured_by"] == "peak FLOP/s" and b["plan_fraction"] == r.CHAPTER_MFU
    assert b["working_set_bytes"] == sweeps.prefill_working_set_bytes("lab-tiny", 48, 2, "cpu")
    flops = r.prefill_flops(TINY, 48, 2, r.KERNEL)
    assert b["step_fraction"] == pytest.approx(flops / (b["time_s"] * FAKE_ROOF.fp32_flops_per_s))


@pytest.mark.parametrize("cache_dtype", ["fp32", "int8"])
def test_a_decode_step_splits_into_parts_that_add_up(fake_roof, cache_dtype):
    b = breakdown.decode_breakdown("lab-tiny", batch=3, context_tokens=100, cache_dtype=cache_dtype, device="cpu",
                                   budget_s=QUICK_S)
    work = r.decode_work_by_category(TINY, 3, 100, "fp32", cache_dtype)
    check_record(b, work)
    assert b["measured_by"] == "bandwidth" and b["plan_fraction"] == r.CHAPTER_BANDWIDTH_EFFICIENCY
    assert b["working_set_bytes"] == sweeps.decode_working_set_bytes("lab-tiny", 3, 100, cache_dtype, "cpu")
    moved = sum(w["bytes"] for w in work.values())
    assert b["step_fraction"] == pytest.approx(moved / (b["time_s"] * b["roof_bandwidth_bytes_per_s"]))
    cache = sweeps.get_built_model("lab-tiny", "cpu").cache
    assert cache.host_lengths == [100] * 3  # every timed step was taken back to the same context
    assert sweeps.get_built_model("lab-tiny", "cpu").clock is OFF  # the hook is removed afterwards


def test_overhead_is_what_the_parts_leave_out(fake_roof, monkeypatch):
    """Work outside every part (here 100 ms of busy work in the step's bookkeeping) shows up as
    overhead and in no part. Busy, not asleep: after a 20 ms sleep the next kernel waited for the
    pool's idle cores to wake (the parts measured 3.9-4.0 ms where they take 0.2, and the overhead
    17.9 ms, on the 2-core EPYC VM). Busy work can let them fall asleep too, beside another test
    process (make test's parallel run on a Zen 5 EPYC VM: overhead 16.3 ms), so the pause is
    looked for in the whole step, and the parts must stay under half of it. 100 ms, not 20: with a
    third process busy on the 2 cores, the parts measured 10.4 ms."""
    pause_s = 0.1
    check = model_module._check_decode

    def busy_then_check(cache, tokens):
        until = time.perf_counter() + pause_s
        while time.perf_counter() < until:
            pass
        return check(cache, tokens)
    monkeypatch.setattr(model_module, "_check_decode", busy_then_check)
    b = breakdown.decode_breakdown("lab-tiny", batch=1, context_tokens=16, cache_dtype="fp32", device="cpu",
                                   budget_s=QUICK_S)
    rows = {row["category"]: row for row in b["categories"]}
    assert rows["overhead"]["time_s"] + b["parts_time_s"] == pytest.approx(b["time_s"])
    assert b["time_s"] >= pause_s * 0.95
    assert b["parts_time_s"] < pause_s / 2 < rows["overhead"]["time_s"]


# ------------------------------------------------------------------ on CUDA: the profiler's kernel times
# Kernel names as the H200 profiled the 8B's graphed decode step (gpu-tune-h200-20261204-1751.json),
# then cuBLAS's and torch SDPA's (the torch ops on a GPU) and the lab's flash attention
KERNEL_NAMES = {
    "_matmul_split_k_kernel": "products", "_split_k_sum_kernel": "products", "_matmul_kernel": "products",
    "_decode_split_kernel": "attention", "_decode_combine_kernel": "attention", "_flash_attention_kernel": "attention",
    "void at::native::(anonymous namespace)::vectorized_layer_norm_kernel<c10::BFloat16, float, true>(int, float, c":
        "other",
    "void at::native::index_elementwise_kernel<128, 4, at::native::gpu_index_kernel<at::native::index_put_kernel_im":
        "other",
    "void at::native::elementwise_kernel<128, 2, at::native::gpu_kernel_impl_nocast<at::native::addcmul_cuda_kernel": "other",
    "void at::native::vectorized_elementwise_kernel<8, at::native::(anonymous namespace)::silu_kernel(at::TensorIte":
        "other",
    "Memcpy DtoD (Device -> Device)": "other", "memcpy32_post": "other",
    "_rope_store_kernel": "other", "_swiglu_kernel": "other", "_add_rms_norm_kernel": "other",
    "sm90_xmma_gemm_bf16bf16_bf16f32_f32_tn_n_tilesize128x128x64_warpgroupsize1x1x1_execute_segment_k_off_kernel__5x_cublas":
        "products",
    "nvjet_hsh_128x256_64x4_1x2_h_bz_coopA_NTN": "products",
    "void pytorch_flash::flash_fwd_kernel<Flash_fwd_kernel_traits<128, 128, 64, 4, false, false, cutlass::bfloat16_t>>":
        "attention",
    "fmha_cutlassF_bf16_aligned_64x128_rf_sm80(PyTorchMemEffAttention::AttentionKernel<cutlass::bfloat16_t>)": "attention",
}


@pytest.mark.parametrize("name, category", KERNEL_NAMES.items())
def test_each_gpu_kernel_falls_into_its_category_by_name(name, category):
    assert gpu_profile.category_of(name) == category


def cuda_stand_in(monkeypatch, kernel_seconds):
    """A model that says it is on CUDA (it never runs), CUDA events' median of 11 ms for the whole
    step, and a profiler that found `kernel_seconds` ({category: seconds a step})."""
    built = SimpleNamespace(device=torch.device("cuda"), compute_dtype="fp32", spec=TINY,  # (the stand-in roof's dtype)
                            decode_path=SimpleNamespace(name="triton+graph"), prefill_graph=SimpleNamespace(name="triton"))
    ran = []

    def time_fn(fn, device, warmup, repeats, budget_s):
        fn()
        return Timing((0.010, 0.011, 0.012))

    def profiled(fn, steps):
        fn()
        kernels = [{"name": f"a {c} kernel", "category": c, "time_s": t, "calls_per_step": 2.0}
                   for c, t in kernel_seconds.items()]
        return dict(kernel_seconds), kernels

    monkeypatch.setattr(measure, "time_fn", time_fn)
    monkeypatch.setattr(gpu_profile, "seconds_by_category", profiled)
    monkeypatch.setattr(backend, "device_name", lambda device: "NVIDIA H200")
    return built, ran


def test_on_cuda_the_parts_are_the_gpus_kernel_times_and_the_rest_is_overhead(monkeypatch, fake_roof, capsys):
    built, ran = cuda_stand_in(monkeypatch, {"products": 0.006, "attention": 0.002, "other": 0.001})
    timings = breakdown._time_parts(built, lambda: ran.append("step"), lambda: ran.append("after"), QUICK_S)
    assert ran == ["step", "after"] * 2  # timed whole and profiled, each step followed by `after`
    work = r.decode_work_by_category(TINY, 1, 16, "fp32", "fp32")
    b = breakdown._split("decode", built, timings, work, 1 << 20, "bytes", batch=1, context_tokens=16, cache_dtype="fp32")
    rows = {row["category"]: row for row in b["categories"]}
    assert b["time_s"] == 0.011 and b["estimator"] == "median" and b["hook_cost_s"] == 0.0
    assert rows["products"]["time_s"] == 0.006 and rows["attention"]["time_s"] == 0.002 and rows["other"]["time_s"] == 0.001
    assert rows["overhead"]["time_s"] == pytest.approx(0.002) and "waiting for work to be launched" in rows["overhead"]["what"]
    assert b["step_form"] == breakdown.CUDA_FORM and b["kernels"] == "triton+graph" and not b["parts_exceed_whole"]
    assert [k["name"] for k in b["gpu_kernels"]] == ["a products kernel", "a attention kernel", "a other kernel"]
    assert sum(row["contributed_fraction"] for row in b["categories"]) == pytest.approx(b["step_fraction"])
    assert explore.breakdown_line(b).startswith("On NVIDIA H200, this decode step at B=1, S=16")
    cli._print_human("breakdown", {**b, "summary": explore.breakdown_line(b)})  # the kernels, then the record
    printed = capsys.readouterr().out
    assert re.search(r"a products kernel +products +6\.00 ms +2\n", printed), printed
    assert printed.index("a other kernel") < printed.index("phase")


def test_on_cuda_a_profiler_that_saw_no_kernel_is_said_not_reported_as_zeros(monkeypatch):
    built, ran = cuda_stand_in(monkeypatch, {})
    with pytest.raises(LabError, match="recorded no GPU kernels"):
        breakdown._time_parts(built, lambda: None, lambda: None, QUICK_S)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_a_real_gpu_step_splits_into_its_kernels():
    for b in (breakdown.decode_breakdown("lab-tiny", batch=2, context_tokens=64, cache_dtype="bf16", device="cuda"),
              breakdown.prefill_breakdown("lab-tiny", prompt_tokens=128, device="cuda")):
        rows = {row["category"]: row for row in b["categories"]}
        assert rows["products"]["time_s"] > 0 and rows["attention"]["time_s"] > 0, b["gpu_kernels"]
        assert b["parts_time_s"] <= 1.1 * b["time_s"], (b["parts_time_s"], b["time_s"])
        assert any("matmul" in k["name"] for k in b["gpu_kernels"]) and b["step_form"] == breakdown.CUDA_FORM


@pytest.mark.parametrize("call, message", [
    (lambda: breakdown.prefill_breakdown("lab-tiny", prompt_tokens=0, device="cpu"), "prompt_tokens must be"),
    (lambda: breakdown.prefill_breakdown("lab-tiny", prompt_tokens=64, batch=True, device="cpu"), "batch must be"),
    (lambda: breakdown.decode_breakdown("lab-tiny", context_tokens=5000, device="cpu"), "context_tokens must be"),
    (lambda: breakdown.decode_breakdown("lab-tiny", context_tokens=8, device="cpu", budget_s=60), "budget_s"),
])
def test_bad_settings_are_one_clear_line(fake_roof, call, message):
    with pytest.raises(LabError, match=message):
        call()


# ------------------------------------------------------------------ the sentence, the chart, the CLI
def record(phase="prefill", seconds=(0.05, 0.02, 0.02, 0.01), parts_exceed=False, noisy=False):
    """A breakdown record whose numbers are easy to check: a 0.1 s step split as `seconds`."""
    names = dict(zip(breakdown.PARTS, ("matrix products", "attention", "everything else", "overhead")))
    rates = (0.8, 0.5, 0.1, 0.0)
    rows = [{"category": c, "name": names[c], "what": breakdown.WHAT[c], "time_s": s, "share": s / 0.1,
             "roof_time_s": s * rate, "bound": None if c == "overhead" else "compute",
             "roof_fraction": None if c == "overhead" else rate, "rate_fraction": rate,
             "contributed_fraction": s / 0.1 * rate} for c, s, rate in zip(breakdown.PARTS, seconds, rates)]
    shape = {"prompt_tokens": 1024} if phase == "prefill" else {"context_tokens": 2048, "cache_dtype": "int8"}
    return {"phase": phase, "device_name": "test CPU", "model": "lab-cpu", "batch": 1, **shape, "time_s": 0.1,
            "parts_time_s": sum(seconds[:3]), "parts_exceed_whole": parts_exceed, "noisy": noisy,
            "measured_by": "peak FLOP/s" if phase == "prefill" else "bandwidth", "roof_tier": "DRAM",
            "step_fraction": sum(row["contributed_fraction"] for row in rows), "plan_fraction": 0.4,
            "planned_time_s": 0.12, "categories": rows}


def test_the_sentence_says_where_the_fraction_comes_from():
    line = explore.breakdown_line(record())
    assert line.startswith("On test CPU, this prefill of P=1,024, B=1 ran at 52% of peak FLOP/s "
                           "(the chapter plans 40%).")
    assert "in percentage points of the step's" in line  # a learner met "(40 points)" unexplained
    assert "matrix products 50% of the time at 80% of peak (40 points)" in line
    assert "attention 20% of the time at 50% of peak (10 points)" in line
    assert "overhead 10% of the time (0 points)" in line and "Note" not in line
    decode = explore.breakdown_line(record("decode", parts_exceed=True, noisy=True))
    assert "decode step at B=1, S=2,048, int8 cache ran at 52% of the DRAM bandwidth" in decode
    assert "below the timing's resolution" in decode and "noisy" in decode


def test_a_cpu_breakdown_waits_for_quiet_and_says_when_other_programs_were_busy(fake_roof, monkeypatch):
    """As sweeps' points: the split starts after a quiet moment, records other processes' share of
    the cores while it ran, and its sentence says so past timing.OTHERS_BUSY_LIMIT."""
    from labkit import timing
    waits = []
    monkeypatch.setattr(breakdown, "wait_for_quiet", lambda wait_s: waits.append(wait_s) or True)
    monkeypatch.delenv("LABKIT_QUIET_WAIT_S", raising=False)
    monkeypatch.setattr(breakdown.cpu_info, "others_busy_share", lambda start, min_wall_s=0.0: 0.25)
    b = breakdown.prefill_breakdown("lab-tiny", 16, device="cpu", budget_s=0.2)
    assert waits == [timing.QUIET_WAIT_S] and b["others_busy_share"] == 0.25 and b["disturbed"]
    assert ("other programs (a browser drawing?) kept 25% of the cores busy while it was timed: run it again "
            "when it is quieter") in explore.breakdown_line(b)
    # (not "busy": an unconfirmed tiny split on a loaded test machine says "noisy: the machine was busy")
    assert "other programs" not in explore.breakdown_line({**b, "others_busy_share": 0.0, "disturbed": False})


def test_the_bars_and_the_lab_draw_the_record():
    pytest.importorskip("plotly")
    from labkit import views  # Jupyter side: plotly and ipywidgets
    bars = explore.breakdown_bars(record())
    assert bars["measured_ms"] == pytest.approx([50, 20, 20, 10]) and bars["roof_ms"] == pytest.approx([40, 10, 2, 0])
    assert bars["plan_ms"] == pytest.approx(120) and "P=1,024" in bars["title"]

    def measure(prompt_tokens):
        if prompt_tokens > 100:
            raise LabError("too long for this test")
        return record()
    lab = views.BreakdownLab({"prompt_tokens": views.int_slider("P", 64, 64, 128, 64)}, measure)
    lab.on_change()
    assert [t.name for t in lab.figure.data[:4]] == bars["names"]
    assert list(lab.figure.data[0].x) == pytest.approx([50, 40]) and list(lab.figure.data[4].x) == [120]
    assert "52% of peak FLOP/s" in lab.error.widget.value
    lab.controls["prompt_tokens"].value = 128
    assert "⚠" in lab.error.widget.value and "too long" in lab.error.widget.value


@pytest.fixture
def quick_cli(monkeypatch, fake_roof):
    monkeypatch.setattr(sweeps, "CPU_BUDGET_S", QUICK_S)
    monkeypatch.delenv("LABKIT_DEVICE", raising=False)


def test_cli_prints_one_json_line_and_a_table(quick_cli, capsys):
    assert cli.main(["breakdown", "decode", "--model", "lab-tiny", "--batch", "2", "--context", "64",
                     "--cache-dtype", "int8", "--device", "cpu", "--json"]) == 0
    out = capsys.readouterr().out
    assert out.count("\n") == 1
    got = json.loads(out)
    assert (got["phase"], got["batch"], got["context_tokens"], got["cache_dtype"]) == ("decode", 2, 64, "int8")
    assert [row["category"] for row in got["categories"]] == list(breakdown.PARTS)
    assert got["summary"] == explore.breakdown_line(got)
    assert cli.main(["breakdown", "prefill", "--model", "lab-tiny", "--prompt", "32", "--device", "cpu"]) == 0
    out = capsys.readouterr().out
    assert out.splitlines()[0].split()[:3] == ["name", "time", "s"]
    assert "matrix products" in out and out.rstrip().splitlines()[-1].startswith("On ")


@pytest.mark.parametrize("argv, message", [
    (["breakdown"], "phase"),
    (["breakdown", "fill"], "invalid choice"),
    (["breakdown", "decode", "--batch", "0", "--device", "cpu"], "--batch must be in"),
    (["breakdown", "prefill", "--model", "lab-tiny", "--prompt", "5000", "--device", "cpu"], "--prompt must be in"),
    (["breakdown", "decode", "--bracket"], "unrecognized arguments"),
])
def test_cli_bad_arguments_are_one_line_and_exit_2(quick_cli, capsys, argv, message):
    assert cli.main(argv) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and message in err and err.startswith("labkit: error:")


def test_the_chapter_plan_is_between_the_roof_and_its_inverse(fake_roof):
    b = breakdown.decode_breakdown("lab-tiny", batch=1, context_tokens=8, cache_dtype="fp32", device="cpu",
                                   budget_s=QUICK_S)
    ratio = b["planned_time_s"] / b["predicted_time_s"]
    assert math.isclose(ratio, 1 / r.CHAPTER_BANDWIDTH_EFFICIENCY) or math.isclose(ratio, 1 / r.CHAPTER_MFU)


def test_a_step_far_from_its_roof_says_what_the_bandwidth_of_its_moment_said(monkeypatch):
    """Over its roof (or far under it), a step judged by bandwidth reads the bandwidth of its
    moment, and its line says which was off; a step over peak FLOP/s gets the above-roof note."""
    over = {**record("decode"), "step_fraction": 1.04, "roof_bandwidth_bytes_per_s": 60e9}
    assert "faster now than when it was calibrated" in explore.breakdown_line(over)  # no reading: why it can be
    read = {**over, "moment_bandwidth_bytes_per_s": 70e9, "moment_roof_fraction": 0.89}
    line = explore.breakdown_line(read)
    assert "the memory read 70.0 GB/s at this working set just after it (the calibration: 60.0 GB/s at this " \
           "size), and the step reached 0.89 of that moment's roof, so the calibration is from a slower moment " \
           "than this one" in line
    slow = explore.breakdown_line({**read, "moment_roof_fraction": 0.3})
    assert "so this step itself falls short here: its parts above say where" in slow and "python -m" not in slow
    assert "calibrated" not in explore.breakdown_line(record())  # near its roof: no note
    monkeypatch.setattr(calibrate, "bandwidth_now", lambda device, working_set_bytes=None: 80e9)
    assert sweeps.moment("cpu", "memory", 1.2, 64 << 20, 72e9) == {"moment_bandwidth_bytes_per_s": 80e9,
                                                                   "moment_roof_fraction": 0.9}
    assert sweeps.moment("cpu", "memory", 0.8, 64 << 20, 72e9) == {}  # near its roof: nothing read
    assert sweeps.moment("cpu", "compute", 1.2, 64 << 20, 72e9) == {}  # judged by peak FLOP/s
