"""Lesson 03's measurements: flash matches naive attention; peak memory is measured and
oversized runs are refused before anything is allocated."""
import json
import os
import subprocess
import sys

import pytest
import torch

from labkit import attention, backend
from labkit.errors import FootprintError, LabError


def test_flash_matches_naive_on_fresh_inputs_fp32():
    result = attention.compare_with_reference(heads=2, kv_heads=1, tokens=32, head_dim=16, dtype="fp32", device="cpu")
    assert result["max_abs_error"] < 1e-5, f"max {result['max_abs_error']:.2e}, mean {result['mean_abs_error']:.2e}"
    assert len(result["abs_errors"]) == 2 * 32 * 16
    assert result["device"] == "cpu"


@pytest.mark.triton
def test_bf16_in_the_interpreter_is_refused_with_a_reason():
    with pytest.raises(LabError, match="interpreter"):
        attention.compare_with_reference(tokens=16, head_dim=16, dtype="bf16", device="cpu")


@pytest.mark.triton
@pytest.mark.parametrize("causal, P, S", [(True, 24, 24), (True, 8, 40), (False, 24, 24)])
@pytest.mark.parametrize("dtype", ["fp32", "fp16"])
def test_naive_attention_is_the_kernels_reference_bit_for_bit(causal, P, S, dtype):
    """The CPU path's naive attention (no triton) computes what kernels/flash_attention.py's
    reference computes, on fresh inputs, GQA and chunked prefill (P < S) included."""
    from kernels.flash_attention import attention_reference  # loads triton: this test needs it
    q = attention.random_qkv(4, 2, P, 16, dtype, "cpu")[0]
    _, k, v = attention.random_qkv(4, 2, S, 16, dtype, "cpu")
    got, want = attention.naive_attention(q, k, v, causal), attention_reference(q, k, v, causal)
    assert got.dtype == want.dtype and torch.equal(got, want), f"max |diff| {(got - want).abs().max().item():.2e}"


@pytest.mark.parametrize("dtype, bound", [("fp32", 1e-5), ("fp16", 5e-3), ("bf16", 3e-2)])
def test_without_triton_the_check_compares_torchs_fused_attention_and_says_so(monkeypatch, dtype, bound):
    """macOS, Windows: no Triton. Lesson 03's check still runs, on torch's fused attention,
    labelled as such, with the reason the lab's kernel was skipped."""
    monkeypatch.setattr(backend, "triton_installed", lambda: False)
    result = attention.compare_with_reference(heads=4, kv_heads=2, tokens=48, head_dim=16, dtype=dtype, device="cpu")
    assert result["kernel"] == "torch's fused SDPA"
    assert "the lab's Triton kernel was skipped: Triton is not installed (no wheels for this platform)" in result["note"]
    assert result["max_abs_error"] < bound, f"max {result['max_abs_error']:.2e}, mean {result['mean_abs_error']:.2e}"
    assert len(result["abs_errors"]) == 4 * 48 * 16


@pytest.mark.triton
def test_with_triton_the_check_names_the_lab_kernel():
    result = attention.compare_with_reference(heads=2, kv_heads=1, tokens=16, head_dim=16, dtype="fp32", device="cpu")
    assert result["kernel"] in ("Triton interpreter", "compiled Triton") and result["note"] is None


@pytest.fixture(scope="module")
def fresh_peaks():
    """Lesson 03's naive and flash peaks at P = 2,048 (2 heads, head dim 32), measured as the lesson
    measures them: in a process of their own. A process that built a model first keeps its freed
    heap for reuse (`cpu_memory`), and a peak measured there depends on what ran before in it: 0
    bytes before `_fresh_pages_for_big_allocations` handed that heap back, 1.52x after, where a
    fresh process measures 1.02x."""
    code = ("import json; from labkit import attention; "
            "print(json.dumps([attention.memory_point(m, 2048, 2, 1, 32, 'fp32', 'cpu') for m in ('naive', 'flash')]))")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                          env={**os.environ, "LABKIT_DEVICE": "cpu"})
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


def test_naive_peak_memory_is_measured_near_its_prediction(fresh_peaks):
    point, _ = fresh_peaks
    assert point["predicted_bytes"] == 2 * 2 * 2048 * 2048 * 4
    assert 0.8 < point["peak_bytes"] / point["predicted_bytes"] < 1.5, point


def test_flash_peak_memory_is_far_below_naive(fresh_peaks):
    naive, flash = fresh_peaks
    assert 0 < flash["peak_bytes"] < naive["peak_bytes"] / 10


def test_a_peak_after_a_model_was_built_in_the_process_is_not_hidden_by_kept_heap():
    """After a prefill (whose model keeps freed heap resident), the naive call's matrices still
    show in the resident set: not 0, as before malloc_trim; not far past the fresh process's."""
    from labkit import sweeps
    sweeps.get_built_model("lab-tiny", "cpu")  # built: the process keeps freed heap from now on
    held = [torch.ones(4 << 20) for _ in range(6)]  # 16 MiB each, under the kept heap's 32 MiB blocks
    del held  # freed, resident, adjacent: 96 MiB of heap the next big tensors could take as they are
    point = attention.memory_point("naive", 2048, 2, 1, 32, "fp32", "cpu")
    assert 0.8 < point["peak_bytes"] / point["predicted_bytes"] < 2.0, point


def test_a_peak_measured_after_plain_attention_was_timed_is_still_its_own():
    """Timing keeps plain attention's matrices' pages for reuse (`cpu_memory.reused_memory`); a
    learner who reruns the memory sweep after the question measures in a process that did so: the
    peak there is still near the prediction, not hidden by kept heap."""
    code = ("import json; from labkit import attention; "
            "attention.time_point('naive', 2048, 2, 1, 32, 'fp32', 'cpu'); "
            "print(json.dumps(attention.memory_point('naive', 2048, 2, 1, 32, 'fp32', 'cpu')))")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                          env={**os.environ, "LABKIT_DEVICE": "cpu", "LABKIT_QUIET_WAIT_S": "0"})
    assert done.returncode == 0, done.stderr[-3000:]
    point = json.loads(done.stdout.strip().splitlines()[-1])
    assert 0.8 < point["peak_bytes"] / point["predicted_bytes"] < 1.5, point


def test_oversized_sizes_are_refused_before_allocating():
    with pytest.raises(FootprintError, match="budget"):
        attention.memory_point("naive", 1 << 20, 32, 8, 128, "fp32", "cpu", budget_bytes=2**30)


def test_sweep_records_the_refusal_and_stops_naive_there():
    done = []
    points = attention.memory_sweep([256, 4096, 8192], 1, 1, 16, "fp32", "cpu", budget_bytes=2**26,
                                    progress=lambda i, n: done.append((i, n)))
    naive = [p for p in points if p["method"] == "naive"]
    assert [("refused" in p) for p in naive] == [False, True]
    assert len([p for p in points if p["method"] == "flash"]) == 3
    assert done[-1] == (6, 6)


def test_the_question_is_asked_where_the_sweep_measured_plain_attention_last(monkeypatch):
    """Lesson 03's settings on a CPU (2 heads, head dim 64, fp32, lengths 512..16,384, a 0.5 GiB
    budget): the sweep measures plain attention up to 4,096 and refuses 8,192 (1 GiB), so the
    question times 4,096, not the 16,384 it once ran (4 GiB) right under that refusal."""
    lengths = [512 * 2**i for i in range(6)]
    assert attention.longest_fitting(lengths, 2, 64, "fp32", "cpu", 2**29) == 4096
    points = attention.memory_sweep(lengths[:5], 2, 1, 64, "fp32", "cpu", 2**29)
    measured = [p["tokens"] for p in points if p["method"] == "naive" and "peak_bytes" in p]
    assert measured[-1] == attention.longest_fitting(lengths[:5], 2, 64, "fp32", "cpu", 2**29)
    # without a budget the device's free memory decides; where nothing fits, one line says so
    monkeypatch.setattr(backend, "free_memory_bytes", lambda device: 2**31)
    assert attention.longest_fitting(lengths, 2, 64, "fp32", "cpu") == 8192  # 1 GiB fits, 4 GiB does not
    with pytest.raises(LabError, match="does not fit at P=512 .*budget"):
        attention.longest_fitting(lengths, 2, 64, "fp32", "cpu", 2**20)
    assert attention.longest_fitting(lengths, 2, 64, "fp32", "cpu", 2**24, method="flash") == 16384  # 8 MiB
    # the lesson's GPU settings (32 heads, lengths 1,024..65,536, no budget) on an H200's 141 GB
    # free: 16,384 (69 GB); 32,768 would need 275 GB, and 65,536, the sweep's last, 1.1 TB
    monkeypatch.setattr(backend, "free_memory_bytes", lambda device: 141e9)
    assert attention.longest_fitting([1024 * 2**i for i in range(7)], 32, 128, "bf16", "cpu") == 16384


def test_where_peak_memory_cannot_be_read_every_point_says_why(monkeypatch, tmp_path):
    """macOS and Windows have no /proc/self/status: the sweep allocates nothing and each point is
    a refusal that names the reason (the chart marks it, the lesson prints it)."""
    monkeypatch.setattr(attention, "_STATUS", tmp_path / "status")  # does not exist
    monkeypatch.setattr(attention, "random_qkv", lambda *a, **k: pytest.fail("allocated inputs"))
    seen = []
    points = attention.memory_sweep([512, 1024], 2, 1, 32, "fp32", "cpu", progress=lambda i, n: seen.append((i, n)))
    assert [(p["method"], p["tokens"]) for p in points] == [("naive", 512), ("flash", 512), ("naive", 1024), ("flash", 1024)]
    assert all(p["refused"].startswith("not measured: a CPU's peak memory is read from Linux's") for p in points)
    assert seen[-1] == (4, 4) and "peak_bytes" not in points[0]
    assert attention.peak_memory_unmeasurable("cuda") is None


def test_lesson_03s_memory_sentences_hold_on_both_paths():
    """Lesson 03 under its memory chart: naive grows with slope two, the fused kernel with slope
    one (where it said 'barely moves', the fused peak grew 32x over the CPU sweep); the naive
    prediction crosses the chart's limit before the long prompt; and with every query head of one
    8B layer it needs terabytes there, more than any GPU preset holds."""
    from labkit.specs import GPUS, get_model
    for heads, head_dim, lengths, limit in ((2, 64, (512, 16384), 2**29), (32, 128, (1024, 65536), 80e9)):
        grew = lengths[1] / lengths[0]
        naive = [attention.footprint_bytes("naive", p, heads, head_dim, "fp32") for p in lengths]
        flash = [attention.footprint_bytes("flash", p, heads, head_dim, "fp32") for p in lengths]
        assert naive[1] / naive[0] == pytest.approx(grew ** 2) and flash[1] / flash[0] == pytest.approx(grew)
        assert attention.footprint_bytes("naive", 120_000, heads, head_dim, "fp32") > limit
    heads = get_model("llama-3.1-8b").n_heads
    whole = attention.footprint_bytes("naive", 120_000, heads, 128, "bf16")
    assert whole > 1e12 and whole > 10 * max(gpu.memory_bytes for gpu in GPUS.values())


def test_the_flash_kernel_is_tuned_at_a_length_before_its_peak_is_measured(monkeypatch):
    """On a GPU the autotuner's first call at a new length benchmarks its tiles, and triton's
    do_bench allocates a 256 MiB buffer to flush the L2 between them: measured inside the peak,
    lesson 03's 8 MiB flash output at P = 1,024 would have read as ~264 MiB."""
    calls = []
    monkeypatch.setattr(attention.backend, "kernels_run_on", lambda device: "compiled")
    monkeypatch.setattr(attention, "_flash", lambda q, k, v, device: calls.append(q.shape[-2]))

    def peak(fn, device):
        calls.append("measured")
        fn()
        return None, 0
    monkeypatch.setattr(attention, "peak_memory_bytes", peak)
    attention.memory_point("flash", 64, 3, 1, 16, "fp32", "cpu")
    assert calls[-3:] == [64, "measured", 64]  # one call at this length before the measured one
