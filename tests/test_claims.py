"""The chapter's figures, reproduced by labkit's formulas (../shared/seed/).

Each test names the choice behind the figure: the chapter counts attention over the full P x P
square and N as all parameters (`roofline.CHAPTER`), plans prefill at 40 % MFU and decode at
~75 % of peak bandwidth. If a formula changes so that one of these stops holding, the lessons
that quote it are wrong too, and this file fails first.
"""
import pytest

from labkit import roofline as r
from labkit.specs import get_gpu, get_model

GiB = 2**30
KiB = 2**10

L8 = get_model("llama-3.1-8b")
L70 = get_model("llama-3.1-70b")
L405 = get_model("llama-3.1-405b")
H100 = get_gpu("H100-SXM")


def close(actual, expected, rel):
    return actual == pytest.approx(expected, rel=rel)


def test_ridge_point_is_295():
    assert round(r.ridge_point_flops_per_byte(H100, "bf16")) == 295


def test_intensity_prefill_about_prompt_length_decode_about_one():
    # "Prefill sits at 2,000 ... decode at batch 1 sits at 1": FLOPs per weight byte, bf16.
    prefill = r.prefill_intensity_flops_per_byte(L8, 2000)
    assert close(prefill, 2000, 0.05), prefill  # 2,096: attention and the cache write add ~5 %
    assert close(r.decode_intensity_flops_per_byte(L8, 1, 0), 1, 1e-9)
    assert round(prefill / r.decode_intensity_flops_per_byte(L8, 1, 0), -3) == 2000


def test_param_count_is_8_03_billion():
    assert r.param_count(L8, "all") == 8_030_261_248


def test_kv_cache_128_kib_per_token_and_0_24_gib_for_2000():
    assert r.kv_bytes_per_token(L8, "bf16") == 128 * KiB
    assert round(r.kv_cache_bytes(L8, 2000) / GiB, 2) == 0.24


@pytest.mark.parametrize("model,expected", [(L8, 30_633), (L70, 53_802), (L405, 98_304)])
def test_crossover_n_over_2ld(model, expected):
    assert close(r.crossover_tokens(model, r.CHAPTER), expected, 1e-3)


def test_crossover_is_n_over_2ld_exactly_for_chapter_counting():
    n, big_l, d = r.param_count(L8), L8.n_layers, L8.hidden_size
    assert r.crossover_tokens(L8, r.CHAPTER) == pytest.approx(n / (2 * big_l * d), rel=1e-12)


def test_attention_share_6_percent_at_2000_and_52_at_32768():
    assert round(100 * r.attention_share(L8, 2000)) == 6
    assert round(100 * r.attention_share(L8, 32768)) == 52


def test_prefill_89_ms_and_2_8_s_at_40_percent_mfu_ratio_31():
    short = r.compute_time_s(r.prefill_flops(L8, 2048), H100, "bf16", r.CHAPTER_MFU)
    long = r.compute_time_s(r.prefill_flops(L8, 32768), H100, "bf16", r.CHAPTER_MFU)
    assert round(short * 1000) == 89
    assert round(long, 1) == 2.8
    assert round(long / short) == 31


def test_cache_52_percent_at_131072_by_1_and_81_at_8192_by_64():
    assert round(100 * r.cache_share(L8, 1, 131072)) == 52
    assert round(100 * r.cache_share(L8, 64, 8192)) == 81
    assert r.decode_regime(r.cache_share(L8, 64, 8192)) == "cache-dominated"
    assert r.decode_regime(r.cache_share(L8, 1, 131072)) == "mixed"
    assert r.decode_regime(r.cache_share(L8, 1, 2000)) == "weights-dominated"


def test_long_conversation_cache_6_percent_at_2000_and_latency_doubles_at_131072():
    # "At 2,000 tokens it is 6 % of the read"; the GROW figure: latency roughly doubles.
    # The chapter's 6 % at 2,000 is the prefill attention share; the decode cache share at
    # 2,000 is 1.6 % — the lesson shows both (see labkit.claims).
    assert round(100 * r.cache_share(L8, 1, 2000), 1) == 1.6
    ratio = r.decode_bytes_per_step(L8, 1, 131072) / r.decode_bytes_per_step(L8, 1, 0)
    assert round(ratio, 1) == 2.1


def test_cache_68_7_gb_against_16_06_gb_step_84_8_gb_times_5_3():
    assert round(r.kv_cache_bytes(L8, 8192, 64) / 1e9, 1) == 68.7
    assert round(r.weight_bytes(L8, "bf16") / 1e9, 2) == 16.06
    step = r.decode_bytes_per_step(L8, 64, 8192)
    assert round(step / 1e9, 1) == 84.8
    assert round(step / r.weight_bytes(L8), 1) == 5.3


def test_157_to_about_30_tokens_per_s():
    # 0.75 x 3.35 TB/s / 16.06 GB = 156.4 tokens/s; the chapter quotes 157.
    alone = r.tokens_per_s_per_sequence(
        r.memory_time_s(r.weight_bytes(L8), H100, r.CHAPTER_BANDWIDTH_EFFICIENCY))
    loaded = r.tokens_per_s_per_sequence(
        r.memory_time_s(r.decode_bytes_per_step(L8, 64, 8192), H100, r.CHAPTER_BANDWIDTH_EFFICIENCY))
    assert abs(alone - 157) < 1, alone
    assert round(loaded) == 30


def test_logits_3_9_gib_at_8192():
    assert round(r.logits_bytes(L8, 8192, "fp32") / GiB, 1) == 3.9


def test_score_matrix_14_4_billion_and_28_8_gb_per_head_at_120000():
    assert r.score_matrix_elements(120_000) == 14_400_000_000
    assert r.score_matrix_bytes(120_000, "bf16") / 1e9 == pytest.approx(28.8)


def test_decode_stops_scaling_near_150_is_half_the_ridge():
    # bf16 weights: intensity = batch, so the ridge is reached at B ~ 295 (cache ignored);
    # the chapter's "about 150" is half of that, what 8-bit weights computed in bf16 give.
    assert round(r.decode_compute_bound_batch(L8, H100)) == 295
    assert round(r.decode_compute_bound_batch(L8, H100, weight_dtype="fp8"), -1) == 150
    # With an 8k cache per sequence the intensity never reaches the ridge at all.
    assert r.decode_compute_bound_batch(L8, H100, context_tokens=8192) is None


def test_causal_counting_moves_the_crossover_about_twice_as_far():
    full, causal = r.crossover_tokens(L8, r.CHAPTER), r.crossover_tokens(L8, r.Counting("causal", "all"))
    assert causal == pytest.approx(2 * full - 1, rel=1e-9)
    assert r.crossover_tokens(L8, r.KERNEL) < causal  # matmul-only N is smaller than all of N
