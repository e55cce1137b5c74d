"""Roofline formulas: properties that must hold for any model, beyond the chapter's figures."""
import pytest

from labkit import roofline as r
from labkit.specs import MODELS, HardwareSpec, SpecError, get_gpu, get_model

L8 = get_model("llama-3.1-8b")
H200 = get_gpu("H200")
COUNTINGS = [r.CHAPTER, r.KERNEL, r.Counting("causal", "all"), r.Counting("full", "matmul")]


@pytest.mark.parametrize("name", list(MODELS))
@pytest.mark.parametrize("counting", COUNTINGS)
def test_at_the_crossover_attention_equals_linear(name, counting):
    model = MODELS[name]
    p = r.crossover_tokens(model, counting)
    # Evaluate the two terms as continuous functions of P at the crossover.
    linear = (2 * r.param_count(model) * p if counting.params == "all"
              else 2 * model.n_layers * r.layer_matmul_params(model) * p + 2 * r.head_params(model))
    pairs = p * p if counting.attention == "full" else p * (p + 1) / 2
    attention = 4 * model.n_layers * model.q_dim * pairs
    assert attention == pytest.approx(linear, rel=1e-9)


def test_causal_pairs_are_the_lower_triangle():
    assert r.attention_pairs(4, 0, "causal") == 10
    assert r.attention_pairs(4, 0, "full") == 16
    # a chunk of 3 after 5 cached tokens sees 5 + (1, 2, 3) keys
    assert r.attention_pairs(3, 5, "causal") == 15 + 6


def test_chunked_prefill_flops_add_up_to_one_shot():
    whole = r.prefill_attention_flops(L8, 4096, attention="causal")
    chunks = sum(r.prefill_attention_flops(L8, 1024, attention="causal", past_tokens=s)
                 for s in range(0, 4096, 1024))
    assert chunks == whole


def test_matmul_params_exclude_embedding_lookup_and_norms():
    n_all, n_mm = r.param_count(L8, "all"), r.param_count(L8, "matmul")
    norms = (2 * L8.n_layers + 1) * L8.hidden_size
    assert n_all - n_mm == L8.vocab_size * L8.hidden_size + norms


@pytest.mark.parametrize("name", list(MODELS))
def test_linear_shapes_are_every_weight_a_token_is_multiplied_by(name):
    """The products the GPU tuner and the autotuning estimate walk are the model's matmul weights:
    K x N x count over them is param_count(model, "matmul"), and each is stored as model.Layer
    stores its weight (qkv, o, gate_up, down; [N, K] there)."""
    model = get_model(name)
    shapes = r.linear_shapes(model)
    assert sum(K * N * count for K, N, count in shapes.values()) == r.param_count(model, "matmul")
    assert shapes["qkv"][:2] == (model.hidden_size, model.q_dim + 2 * model.kv_dim)
    assert shapes["head"] == (model.hidden_size, model.vocab_size, 1)


def test_tied_head_is_counted_once_in_all():
    tied = get_model("llama-3.2-1b")
    assert r.param_count(tied, "all") == (tied.vocab_size * tied.hidden_size
                                          + tied.n_layers * r.layer_params(tied) + tied.hidden_size)


@pytest.mark.parametrize("dtype,per_token", [("bf16", 131072), ("fp8", 65536), ("int8", 65536 + 2048),
                                             ("fp32", 262144)])
def test_kv_bytes_per_token_per_dtype(dtype, per_token):
    assert r.kv_bytes_per_token(L8, dtype) == per_token


def test_regime_boundaries():
    assert r.decode_regime(0.1499) == "weights-dominated"
    assert r.decode_regime(0.15) == "mixed"
    assert r.decode_regime(0.6999) == "mixed"
    assert r.decode_regime(0.70) == "cache-dominated"


def test_decode_intensity_tracks_batch_while_weights_dominate():
    for batch in (1, 8, 64):
        assert r.decode_intensity_flops_per_byte(L8, batch, 0) == pytest.approx(batch)


def test_roofline_time_is_the_slower_roof():
    flops, nbytes = 1e15, 1e9
    t = r.roofline_time_s(flops, nbytes, H200)
    assert t == pytest.approx(flops / H200.bf16_flops_per_s)
    assert r.bound_by(flops, nbytes, H200) == "compute"
    assert r.bound_by(1e9, 1e12, H200) == "memory"


def test_h200_decode_is_faster_by_its_bandwidth_ratio():
    h100 = get_gpu("H100-SXM")
    step = r.decode_bytes_per_step(L8, 8, 4096)
    assert r.memory_time_s(step, h100) / r.memory_time_s(step, H200) == pytest.approx(4.8 / 3.35)


def test_footprint_grows_with_batch_and_context():
    small = r.memory_footprint_bytes(L8, 1, 1024)
    assert r.memory_footprint_bytes(L8, 2, 1024) > small
    assert r.memory_footprint_bytes(L8, 1, 2048) > small
    assert small > r.weight_bytes(L8)


@pytest.mark.parametrize("call", [
    lambda: r.kv_bytes_per_token(L8, "fp4"),
    lambda: r.weight_bytes(L8, "fp64"),
    lambda: r.compute_time_s(1e12, H200, mfu=0),
    lambda: r.memory_time_s(1e9, H200, bandwidth_efficiency=1.5),
    lambda: r.Counting("half", "all"),
    lambda: r.param_count(L8, "some"),
])
def test_bad_arguments_raise_spec_errors(call):
    with pytest.raises(SpecError):
        call()


# ---- one kernel call: the counts the GPU check used to compute itself, pinned to its old formulas
def test_matmul_flops_and_bytes():
    M, K, N = 2048, 4096, 14336
    assert r.matmul_flops(M, K, N) == 2 * M * K * N
    assert r.matmul_bytes(M, K, N, "bf16") == (M * K + K * N + M * N) * 2
    assert r.matmul_bytes(64, 32, 48, "fp16") == (64 * 32 + 32 * 48 + 64 * 48) * 2


@pytest.mark.parametrize("P", [32, 4096])
def test_causal_flash_attention_flops_and_bytes(P):
    H, Hkv, D = 32, 8, 128
    assert r.attention_flops(1, H, D, P, 0, "causal") == 4 * H * D * r.attention_pairs(P, 0, "causal")
    assert r.attention_flops(1, H, D, P, 0, "causal") == 4 * H * D * P * (P + 1) // 2
    assert r.flash_attention_bytes(1, H, P, P, D, "bf16", kv_heads=Hkv) == 2 * (H + Hkv) * P * D * 2


def test_prefill_attention_flops_is_attention_flops_in_every_layer():
    for past, counting in ((0, "full"), (0, "causal"), (3000, "causal")):
        old = 4 * L8.n_layers * L8.q_dim * r.attention_pairs(1024, past, counting) * 2
        assert r.prefill_attention_flops(L8, 1024, 2, counting, past) == old


def test_decode_attention_flops_and_the_step_it_is_part_of():
    assert r.decode_attention_flops(16, 32, 128, 8192) == 4 * 16 * 32 * 128 * 8192
    for counting in (r.CHAPTER, r.KERNEL):
        old = 3 * (2 * r.param_count(L8, counting.params) + 4 * L8.n_layers * L8.q_dim * 5000)
        assert r.decode_flops_per_step(L8, 3, 5000, counting) == old


def test_decode_attention_bytes_counts_cache_scales_and_q_out():
    # B=1, H=32, Hkv=8, S=32768, D=128: K+V = 2 * 8 * 32768 * 128 values; q and out 2 * 32 * 128 bf16.
    values, q_out = 2 * 8 * 32768 * 128, 2 * 32 * 128 * 2
    assert r.decode_attention_bytes(1, 32, 8, 32768, 128, "bf16", "bf16") == 2 * values + q_out
    assert r.decode_attention_bytes(1, 32, 8, 32768, 128, "fp8", "bf16") == values + 8 + q_out
    assert r.decode_attention_bytes(1, 32, 8, 32768, 128, "int8", "bf16") == values + 2 * 8 * 32768 * 4 + q_out
    with pytest.raises(SpecError):
        r.decode_attention_bytes(1, 32, 8, 16, 128, "int4", "bf16")


def test_fractions_of_a_roof():
    h100 = get_gpu("H100-SXM")
    assert r.bandwidth_fraction(3.35e12 / 2, h100) == pytest.approx(0.5)
    assert r.time_roof_fraction(1e-3, 4e-3) == 0.25


# ---------------------------------------------------------------- the cache-aware roof
MIB, GIB = 2**20, 2**30
H100 = get_gpu("H100-SXM")
# The shape of a 2-core Xeon VM's measured roof (issue 13): an L2 rate up to a few MiB, an L3
# rate to ~64 MiB, then DRAM.
CURVE = ((1 * MIB, 140e9), (2 * MIB, 178e9), (4 * MIB, 107e9), (8 * MIB, 57e9), (16 * MIB, 57e9),
         (32 * MIB, 50e9), (64 * MIB, 9e9), (128 * MIB, 12e9), (512 * MIB, 11e9), (2048 * MIB, 12e9))
CACHES = (("L2", 4 * MIB), ("L3", 480 * MIB))


def test_bandwidth_at_a_working_set_interpolates_in_log_space_and_holds_at_the_ends():
    assert r.bandwidth_at_bytes_per_s(CURVE, 8 * MIB) == 57e9  # a measured point is itself
    # half-way in log(bytes) between 32 MiB and 64 MiB: the geometric mean of the two rates (64 MiB's
    # 9 GB/s raised to the 12 read at 128 MiB: `roof_envelope`)
    assert r.bandwidth_at_bytes_per_s(CURVE, 32 * MIB * 2**0.5) == pytest.approx((50e9 * 12e9) ** 0.5)
    assert r.bandwidth_at_bytes_per_s(CURVE, 1) == 178e9 and r.bandwidth_at_bytes_per_s(CURVE, 2**40) == 12e9
    as_dicts = [{"bytes": b, "bytes_per_s": rate} for b, rate in reversed(CURVE)]  # calibrate's form, any order
    assert r.bandwidth_at_bytes_per_s(as_dicts, 3 * MIB) == r.bandwidth_at_bytes_per_s(CURVE, 3 * MIB)
    with pytest.raises(SpecError):
        r.bandwidth_at_bytes_per_s([], MIB)
    with pytest.raises(SpecError):
        r.bandwidth_at_bytes_per_s(CURVE, 0)


def test_the_roof_never_rises_with_the_working_set():
    """`roof_envelope`: a point read slower than a larger working set takes that one's rate
    (bench-cpu-31's calibration, 2-core EPYC VM: 57 GB/s at 128 MiB, 95 at 256 MiB), so a decode
    step's roof cannot rise as its context grows; a falling curve is left as measured."""
    moved = ((32 * MIB, 150e9), (64 * MIB, 77e9), (128 * MIB, 57e9), (256 * MIB, 95e9))
    assert r.roof_envelope(list(moved)) == [(32 * MIB, 150e9), (64 * MIB, 95e9), (128 * MIB, 95e9), (256 * MIB, 95e9)]
    assert r.roof_envelope(list(CURVE[4:])) == [(16 * MIB, 57e9), (32 * MIB, 50e9), (64 * MIB, 12e9),
                                                 (128 * MIB, 12e9), (512 * MIB, 12e9), (2048 * MIB, 12e9)]
    assert r.bandwidth_at_bytes_per_s(moved, 128 * MIB) == 95e9
    assert r.bandwidth_at_bytes_per_s(moved, 100 * MIB) == pytest.approx(95e9)
    rates = [r.bandwidth_at_bytes_per_s(moved, size) for size in (40 * MIB, 80 * MIB, 160 * MIB, 300 * MIB)]
    assert rates == sorted(rates, reverse=True)


def test_tier_edges_lie_where_the_measured_roof_falls_and_name_the_tiers():
    edges = r.tier_edges(CURVE, CACHES, "DRAM")
    assert [e["label"] for e in edges] == ["past the L2: L3", "past the L3: DRAM"]
    l2, l3 = edges
    assert 4 * MIB < l2["bytes"] < 8 * MIB and l2["cache_bytes"] == 4 * MIB  # the falls through the
    assert 32 * MIB < l3["bytes"] < 64 * MIB and l3["cache_bytes"] == 480 * MIB  # geometric means
    assert (l3["from_bytes_per_s"], l3["to_bytes_per_s"]) == (57e9, 12e9)  # each tier's best point
    assert r.bandwidth_at_bytes_per_s(CURVE, l3["bytes"] * 1.01, [e["bytes"] for e in edges]) == 12e9
    flat = ((MIB, 10e9), (64 * MIB, 9.5e9), (2048 * MIB, 10e9))  # no tier 1.25x faster: no edge
    assert r.tier_edges(flat, CACHES, "DRAM") == []


def test_interpolation_never_blends_across_a_tier_edge():
    """Just past the L3's edge the roof is a DRAM rate, not a blend with the L3's 50 GB/s."""
    edges = [e["bytes"] for e in r.tier_edges(CURVE, CACHES, "DRAM")]
    past = edges[1] * 1.05
    # held at the first DRAM-side point (64 MiB's 9 GB/s raised to 128 MiB's 12: `roof_envelope`)
    assert r.bandwidth_at_bytes_per_s(CURVE, past, edges) == 12e9
    assert r.bandwidth_at_bytes_per_s(CURVE, past) > 12e9  # without the edges: blended
    assert r.bandwidth_at_bytes_per_s(CURVE, edges[1] * 0.95, edges) == 50e9


def test_the_roof_at_a_working_set_is_the_calibration_at_that_tier():
    calibrated = HardwareSpec("calibrated", None, None, None, None, 300e9, 12e9, 24e9, kind="calibrated",
                              cache_levels=CACHES, memory_name="DRAM", bandwidth_by_working_set=CURVE)
    in_l3, in_dram = r.roof_at_working_set(calibrated, 16 * MIB), r.roof_at_working_set(calibrated, GIB)
    assert in_l3.memory_bandwidth_bytes_per_s == 57e9 and "(L3)" in in_l3.sources["memory_bandwidth_bytes_per_s"]
    assert in_dram.memory_bandwidth_bytes_per_s == pytest.approx(r.bandwidth_at_bytes_per_s(CURVE, GIB))
    assert r.memory_tier(16 * MIB, calibrated) == "L3" and r.memory_tier(GIB, calibrated) == "DRAM"
    assert r.memory_tier(MIB, calibrated) == "L2"
    assert r.roof_at_working_set(H100, 10 * MIB) is H100  # a datasheet has one bandwidth
    assert r.memory_tier(10 * MIB, H100) == "L2" and r.memory_tier(GIB, H100) == "HBM"  # by its L2 alone
    # predictions read the working set's roof: lab-cpu's fp32 weights (~62 MB) are past this L3's edge
    model = get_model("lab-cpu")
    step = r.predicted_decode_step_s(model, 1, 0, calibrated, "fp32", "fp32")
    weights = r.weight_bytes(model, "fp32", "matmul")
    assert step == pytest.approx(weights / r.roof_at_working_set(calibrated, weights).memory_bandwidth_bytes_per_s)
    small = r.predicted_decode_step_s(get_model("lab-tiny"), 1, 0, calibrated, "fp32", "fp32")
    # in the L2, at the 178 GB/s read at 2 MiB (`roof_envelope`: 1 MiB was read at 140)
    assert small == pytest.approx(r.weight_bytes(get_model("lab-tiny"), "fp32", "matmul") / 178e9)
    assert r.predicted_decode_step_s(model, 1, 0, H100, "fp32", "fp32") == r.roofline_time_s(
        r.decode_flops_per_step(model, 1, 0, r.KERNEL), weights, H100, "fp32")  # a datasheet: unchanged


def test_l2_resident_flags_working_sets_under_twice_the_l2():
    l2 = 50 * MIB
    assert r.l2_resident(99 * MIB, l2) and not r.l2_resident(100 * MIB, l2)
    assert not r.l2_resident(MIB, None)  # an unknown L2 flags nothing


def test_the_chapter_plans_40_percent_of_peak_and_75_percent_of_bandwidth():
    assert r.chapter_plan_fraction("compute") == r.CHAPTER_MFU == 0.40
    assert r.chapter_plan_fraction("memory") == r.CHAPTER_BANDWIDTH_EFFICIENCY == 0.75
    with pytest.raises(SpecError):
        r.chapter_plan_fraction("cache")
