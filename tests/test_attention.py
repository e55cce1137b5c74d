"""Lesson 03's measurements: flash matches naive attention; peak memory is measured and
oversized runs are refused before anything is allocated."""
import pytest

from labkit import attention
from labkit.errors import FootprintError, LabError


def test_flash_matches_naive_on_fresh_inputs_fp32():
    result = attention.compare_with_reference(heads=2, kv_heads=1, tokens=32, head_dim=16, dtype="fp32", device="cpu")
    assert result["max_abs_error"] < 1e-5, f"max {result['max_abs_error']:.2e}, mean {result['mean_abs_error']:.2e}"
    assert len(result["abs_errors"]) == 2 * 32 * 16
    assert result["device"] == "cpu"


def test_bf16_in_the_interpreter_is_refused_with_a_reason():
    with pytest.raises(LabError, match="interpreter"):
        attention.compare_with_reference(tokens=16, head_dim=16, dtype="bf16", device="cpu")


def test_naive_peak_memory_is_measured_near_its_prediction():
    point = attention.memory_point("naive", 2048, 2, 1, 32, "fp32", "cpu")
    assert point["predicted_bytes"] == 2 * 2 * 2048 * 2048 * 4
    assert 0.8 < point["peak_bytes"] / point["predicted_bytes"] < 1.5, point


def test_flash_peak_memory_is_far_below_naive():
    naive = attention.memory_point("naive", 2048, 2, 1, 32, "fp32", "cpu")
    flash = attention.memory_point("flash", 2048, 2, 1, 32, "fp32", "cpu")
    assert flash["peak_bytes"] < naive["peak_bytes"] / 10


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
