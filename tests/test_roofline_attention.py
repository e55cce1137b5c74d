"""Attention memory traffic and footprint: what naive attention moves and holds, and what a
flash kernel does not."""
import pytest

from labkit import roofline as r
from labkit.errors import SpecError


def test_naive_bytes_count_inputs_output_and_four_passes_over_the_scores():
    # B=1, H=2, P=S=8, D=4 in fp16 (2 bytes), fp32 scores (4 bytes)
    qo = 2 * 1 * 2 * 8 * 4 * 2
    kv = 2 * 1 * 2 * 8 * 4 * 2
    scores = 4 * 1 * 2 * 8 * 8 * 4
    assert r.naive_attention_bytes(1, 2, 8, 8, 4, "fp16") == qo + kv + scores


def test_naive_bytes_grow_quadratically_with_the_sequence():
    small = r.naive_attention_bytes(1, 32, 4096, 4096, 128, kv_heads=8)
    big = r.naive_attention_bytes(1, 32, 8192, 8192, 128, kv_heads=8)
    assert 3.9 < big / small < 4.0


def test_flash_bytes_never_count_the_scores():
    # best case: Q, K, V, O each once
    assert r.flash_attention_bytes(1, 4, 64, 64, 16, "bf16") == 4 * 4 * 64 * 16 * 2
    # gqa: K and V read once per kv head
    assert r.flash_attention_bytes(1, 4, 64, 64, 16, "bf16", kv_heads=1) == (2 * 4 + 2 * 1) * 64 * 16 * 2


def test_flash_bytes_without_cache_reuse_reread_kv_per_query_tile():
    tiles = 3  # ceil(300 / 128)
    expected = 2 * 2 * 300 * 16 * 2 + 2 * (2 * tiles) * 300 * 16 * 2
    assert r.flash_attention_bytes(1, 2, 300, 300, 16, "bf16", block_m=128) == expected


def test_flash_moves_less_than_naive_for_llama_8b_shapes():
    for tokens in (2048, 32768, 120_000):
        naive = r.naive_attention_bytes(1, 32, tokens, tokens, 128, kv_heads=8, score_dtype="bf16")
        worst = r.flash_attention_bytes(1, 32, tokens, tokens, 128, kv_heads=8, block_m=128)
        best = r.flash_attention_bytes(1, 32, tokens, tokens, 128, kv_heads=8)
        assert best < worst < naive


def test_footprint_is_the_live_score_matrices():
    assert r.naive_attention_footprint_bytes(1, 1, 120_000, 120_000, "bf16", 1) == r.score_matrix_bytes(120_000)
    assert r.naive_attention_footprint_bytes(2, 4, 1024, 1024) == 2 * 2 * 4 * 1024 * 1024 * 4


def test_unknown_dtype_is_refused():
    with pytest.raises(SpecError):
        r.naive_attention_bytes(1, 1, 8, 8, 4, "fp12")


def test_plain_attention_s_three_kernels_add_up_to_its_flops_and_bytes():
    work = r.naive_attention_work(1, 32, 4096, 8192, 128, "bf16", 8, "fp32")
    assert list(work) == ["scores", "softmax", "mix"]
    assert sum(p["bytes"] for p in work.values()) == r.naive_attention_bytes(1, 32, 4096, 8192, 128, "bf16", 8, "fp32")
    assert sum(p["flops"] for p in work.values()) == r.attention_flops(1, 32, 128, 4096, 8192 - 4096)
    assert work["softmax"] == {"flops": 0, "bytes": 2 * 32 * 4096 * 8192 * 4}  # the square read, then written
    assert work["scores"]["flops"] == work["mix"]["flops"]
