"""Roofline formulas for prefill and decode: pure functions, no torch, no I/O, SI units.

Every function counts one thing and its docstring says what it ignores. Units are in the names
(`_flops`, `_bytes`, `_s`, `_per_s`); convert to GiB or TB/s only for display.

Two hidden choices behind the chapter's figures are made explicit by `Counting`:
  * attention over the full P x P square (the chapter's 4LP^2d) or the causal half a real
    kernel computes;
  * N as all parameters (the chapter's 2NP) or only the weights a token is multiplied by
    (layer matmuls, plus the output head for the positions whose logits are needed).
`CHAPTER` reproduces the chapter; `KERNEL` is what the lab's kernels really execute.

A calibrated machine also carries its bandwidth roof by working set (`HardwareSpec.
bandwidth_by_working_set`): a step whose weights and cache fit in a cache reads at that cache's
rate, not the memory's. `roof_at_working_set` gives the roofline of one working set, and the
predicted times below use it; a datasheet has no such curve and keeps its one bandwidth.

Besides whole models, single kernel calls are counted here too (a matmul, an attention call, a
decode attention call over a quantised cache), for lesson 03 and for the GPU check, which prints
each call's roof before timing it: every prediction in the lab comes from this module.
"""
from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass

from .specs import BYTES_PER_ELEMENT, HardwareSpec, ModelSpec, SpecError

# The chapter's planning conventions, named so a reader can find and change them.
CHAPTER_MFU = 0.40  # "use 40 % to plan": prefill at 40 % of dense peak
CHAPTER_BANDWIDTH_EFFICIENCY = 0.75  # behind "157 tokens a second": 0.75 * 3.35e12 / 16.06e9
# A measured point under this fraction of its roof is far from it: the lab's own bar (issue 13's,
# `bench.ROOF_TARGET`). On a CPU, a lesson's point bound by memory that far off has the bandwidth
# of its moment read too (`sweeps.with_moment`), and at this fraction of that roof or more it was
# the calibration, not the step, that was off; under it there too, the step itself falls short.
# (At 0.5, a point at 0.55-0.7 of a roof calibrated at a fast moment of the EPYC VM's memory was
# left unexplained, though the bench bars it.)
FAR_FROM_ROOF = 0.7
# A sweep's points are many (lesson 04's batch sweep has nine), each shown in a hover, not a status
# line: each reads the bandwidth of its moment only under this fraction. A reading takes 0.15-0.4 s
# beside a point's 0.3-1.4 s, and with a browser drawing on the same 2 cores most of a sweep's points
# fall between the two fractions (lesson 04's Voila test: 31 s with a sweep's points read under 0.7,
# 24 s under 0.5, on the 2-core EPYC VM).
SWEEP_FAR_FROM_ROOF = 0.5
# Cache share of a decode step's read at the regime boundaries: the chapter's "under 15 %"
# (weights dominate) and "70-90 %" (cache dominates); in between is "mixed".
WEIGHTS_DOMINATED_BELOW = 0.15
CACHE_DOMINATED_FROM = 0.70
# A measured step counts as a change of memory tier when one tier's best rate is at least this
# many times the next one's (smaller steps are the noise of a shared machine, not a cache edge).
TIER_STEP = 1.25
# GPU: a working set under L2_FLUSH_FACTOR x the L2 may be served from L2 rather than HBM, so a
# timing of it flushes the L2 between calls or is flagged (`l2_resident`).
L2_FLUSH_FACTOR = 2
INT8_SCALE_BYTES = 4  # one fp32 scale per token per kv head, for K and for V
FP8_SCALE_BYTES = 4  # one fp32 scale per tensor, for K and for V
CACHE_DTYPES = ("bf16", "fp16", "fp32", "fp8", "int8")


@dataclass(frozen=True)
class Counting:
    """Which FLOPs are counted: `attention` "full" | "causal"; `params` "all" | "matmul"."""

    attention: str = "full"
    params: str = "all"

    def __post_init__(self):
        if self.attention not in ("full", "causal"):
            raise SpecError(f"attention counting must be 'full' or 'causal', got {self.attention!r}")
        if self.params not in ("all", "matmul"):
            raise SpecError(f"parameter counting must be 'all' or 'matmul', got {self.params!r}")


CHAPTER = Counting(attention="full", params="all")
KERNEL = Counting(attention="causal", params="matmul")


# ---------------------------------------------------------------- parameters and bytes
def layer_params(model: ModelSpec) -> int:
    """Parameters of one decoder layer: q, k, v, o projections, SwiGLU's three matrices, two norms."""
    attention = model.hidden_size * (model.q_dim + 2 * model.kv_dim) + model.q_dim * model.hidden_size
    mlp = 3 * model.hidden_size * model.intermediate_size
    return attention + mlp + 2 * model.hidden_size


def linear_shapes(model: ModelSpec) -> dict[str, tuple[int, int, int]]:
    """The products a token goes through, {name: (K, N, count per pass)}: each layer's fused q/k/v,
    o, fused gate/up and down projections (as labkit.model stores them), then the LM head. Their
    K x N x count adds up to param_count(model, "matmul")."""
    d, f, L = model.hidden_size, model.intermediate_size, model.n_layers
    return {"qkv": (d, model.q_dim + 2 * model.kv_dim, L), "o": (model.q_dim, d, L), "gate_up": (d, 2 * f, L),
            "down": (f, d, L), "head": (d, model.vocab_size, 1)}


def layer_matmul_params(model: ModelSpec) -> int:
    """Weights one token is multiplied by in one layer (the norms' vectors are not matmuls)."""
    return layer_params(model) - 2 * model.hidden_size


def head_params(model: ModelSpec) -> int:
    """The output head V x d: the logits matmul (shares the embedding table when tied)."""
    return model.vocab_size * model.hidden_size


def param_count(model: ModelSpec, params: str = "all") -> int:
    """N. "all": every stored parameter (embedding, layers, final norm, untied head) — what
    config cards quote. "matmul": the weights one token is multiplied by — layer matmuls and
    the head (the embedding is a table lookup, not a matmul)."""
    if params == "matmul":
        return model.n_layers * layer_matmul_params(model) + head_params(model)
    if params != "all":
        raise SpecError(f"params must be 'all' or 'matmul', got {params!r}")
    untied_head = 0 if model.tie_embeddings else head_params(model)
    embedding = model.vocab_size * model.hidden_size
    return embedding + model.n_layers * layer_params(model) + model.hidden_size + untied_head


def weight_bytes(model: ModelSpec, dtype: str = "bf16", params: str = "all") -> int:
    """Bytes of the weights in `dtype` (the chapter's 16.06 GB is all 8.03 B parameters in bf16)."""
    return param_count(model, params) * BYTES_PER_ELEMENT[_check_dtype(dtype)]


def kv_bytes_per_token(model: ModelSpec, cache_dtype: str = "bf16") -> int:
    """Cache bytes one token adds: K and V, every layer, every kv head: 2 * L * Hkv * dh * bytes.
    int8 adds its scales (one fp32 per token per kv head, for K and V); fp8 uses one scale per
    tensor, which is negligible and not counted."""
    values = 2 * model.n_layers * model.kv_dim * BYTES_PER_ELEMENT[_check_cache_dtype(cache_dtype)]
    scales = 2 * model.n_layers * model.n_kv_heads * INT8_SCALE_BYTES if cache_dtype == "int8" else 0
    return values + scales


def kv_cache_bytes(model: ModelSpec, tokens: int, batch: int = 1, cache_dtype: str = "bf16") -> int:
    """The whole cache for `batch` sequences of `tokens` tokens each."""
    return batch * tokens * kv_bytes_per_token(model, cache_dtype)


def logits_bytes(model: ModelSpec, positions: int, dtype: str = "fp32") -> int:
    """Logits for `positions` positions: V scores each (fp32, as samplers keep them)."""
    return positions * model.vocab_size * BYTES_PER_ELEMENT[_check_dtype(dtype)]


def score_matrix_elements(tokens: int) -> int:
    """Attention scores for one head of one layer if materialised: a P x P square."""
    return tokens * tokens


def score_matrix_bytes(tokens: int, dtype: str = "bf16") -> int:
    """Bytes of that square in `dtype` — what FlashAttention never writes to memory."""
    return score_matrix_elements(tokens) * BYTES_PER_ELEMENT[_check_dtype(dtype)]


# ---------------------------------------------------------------- FLOPs
def attention_pairs(query_tokens: int, past_tokens: int = 0, attention: str = "full") -> int:
    """(query, key) pairs scored: full = q * (past + q); causal = q * past + q(q+1)/2."""
    if attention == "causal":
        return query_tokens * past_tokens + query_tokens * (query_tokens + 1) // 2
    return query_tokens * (past_tokens + query_tokens)


def prefill_linear_flops(model: ModelSpec, prompt_tokens: int, batch: int = 1, params: str = "all") -> int:
    """2 FLOPs (multiply + add) per weight per position. "all" is the chapter's 2NP;
    "matmul" multiplies every position by the layer weights and only the last by the head
    (prefill needs logits for one position). Ignores norms, RoPE, softmax (O(P d))."""
    if params == "all":
        return 2 * param_count(model, "all") * prompt_tokens * batch
    per_sequence = 2 * model.n_layers * layer_matmul_params(model) * prompt_tokens + 2 * head_params(model)
    return per_sequence * batch


def attention_flops(batch: int, heads: int, head_dim: int, query_tokens: int, past_tokens: int = 0,
                    attention: str = "full") -> int:
    """One attention call (one layer): Q K^T and P V, 2 FLOPs (multiply + add) per scored pair per
    head dimension for each, so 4 * B * H * dh * pairs. Ignores the scaling, mask and softmax
    (O(pairs), not O(pairs dh)). A causal self-attention kernel over P tokens does P(P+1)/2 pairs."""
    return 4 * batch * heads * head_dim * attention_pairs(query_tokens, past_tokens, attention)


def prefill_attention_flops(model: ModelSpec, prompt_tokens: int, batch: int = 1,
                            attention: str = "full", past_tokens: int = 0) -> int:
    """`attention_flops` in every layer: 4 * L * (H dh) * pairs. "full" with no past is the
    chapter's 4LP^2d. `past_tokens` are already cached (chunked prefill)."""
    return model.n_layers * attention_flops(batch, model.n_heads, model.head_dim, prompt_tokens,
                                            past_tokens, attention)


def prefill_flops(model: ModelSpec, prompt_tokens: int, batch: int = 1, counting: Counting = CHAPTER,
                  past_tokens: int = 0) -> int:
    """Linear + attention FLOPs of one prefill pass."""
    return (prefill_linear_flops(model, prompt_tokens, batch, counting.params)
            + prefill_attention_flops(model, prompt_tokens, batch, counting.attention, past_tokens))


def attention_share(model: ModelSpec, prompt_tokens: int, counting: Counting = CHAPTER) -> float:
    """Fraction of prefill FLOPs spent in attention (6 % at 2,000 tokens on the 8B, chapter counting)."""
    attention = prefill_attention_flops(model, prompt_tokens, attention=counting.attention)
    return attention / prefill_flops(model, prompt_tokens, counting=counting)


def crossover_tokens(model: ModelSpec, counting: Counting = CHAPTER) -> float:
    """Prompt length where attention FLOPs equal linear FLOPs. With chapter counting this is
    N / (2 L d); in general the positive root of a * P^2 + b * P + c = 0."""
    four_ld = 4 * model.n_layers * model.q_dim
    if counting.params == "all":
        per_token, fixed = 2 * param_count(model, "all"), 0
    else:
        per_token, fixed = 2 * model.n_layers * layer_matmul_params(model), 2 * head_params(model)
    if counting.attention == "full":  # 4Ld P^2 = per_token P + fixed
        a, b = four_ld, -per_token
    else:  # 4Ld P(P+1)/2 = per_token P + fixed
        a, b = four_ld / 2, four_ld / 2 - per_token
    return (-b + math.sqrt(b * b + 4 * a * fixed)) / (2 * a)


def decode_flops_per_step(model: ModelSpec, batch: int, context_tokens: int, counting: Counting = CHAPTER) -> int:
    """One new token for each of `batch` sequences: 2N per token plus attention of one query
    over `context_tokens` keys, 4 * L * (H dh) * S. Decode attention is linear in S, not quadratic."""
    n = param_count(model, counting.params)
    return batch * 2 * n + model.n_layers * decode_attention_flops(batch, model.n_heads, model.head_dim,
                                                                     context_tokens)


def decode_attention_flops(batch: int, heads: int, head_dim: int, context_tokens: int) -> int:
    """One decode attention call (one layer): one query per sequence over `context_tokens` keys,
    4 * B * H * dh * S (Q K^T and P V, 2 FLOPs per key per head dimension each). Linear in S."""
    return 4 * batch * heads * head_dim * context_tokens


# ---------------------------------------------------------------- bytes moved and intensity
def decode_bytes_per_step(model: ModelSpec, batch: int, context_tokens: int, weight_dtype: str = "bf16",
                          cache_dtype: str = "bf16", params: str = "all") -> int:
    """One decode step reads every weight once and every active sequence's whole cache.
    Ignores activations (O(B d)) and the new token's cache write (one token per sequence)."""
    return weight_bytes(model, weight_dtype, params) + kv_cache_bytes(model, context_tokens, batch, cache_dtype)


def cache_share(model: ModelSpec, batch: int, context_tokens: int, weight_dtype: str = "bf16",
                cache_dtype: str = "bf16", params: str = "all") -> float:
    """The cache's fraction of a decode step's read (52 % at 131,072 x 1 on the 8B)."""
    cache = kv_cache_bytes(model, context_tokens, batch, cache_dtype)
    return cache / decode_bytes_per_step(model, batch, context_tokens, weight_dtype, cache_dtype, params)


def decode_regime(share: float) -> str:
    """"weights-dominated" (< 15 %), "mixed", or "cache-dominated" (>= 70 %), by cache share."""
    if share < WEIGHTS_DOMINATED_BELOW:
        return "weights-dominated"
    return "cache-dominated" if share >= CACHE_DOMINATED_FROM else "mixed"


def prefill_bytes(model: ModelSpec, prompt_tokens: int, batch: int = 1, weight_dtype: str = "bf16",
                  cache_dtype: str = "bf16", params: str = "all") -> int:
    """Weights read once plus the cache written. Ignores activations, which stay in on-chip
    memory in a fused kernel only partly; this is the floor, not the total."""
    return weight_bytes(model, weight_dtype, params) + kv_cache_bytes(model, prompt_tokens, batch, cache_dtype)


def intensity_flops_per_byte(flops: float, bytes_moved: float) -> float:
    """Arithmetic intensity: FLOPs done per byte moved from memory."""
    return flops / bytes_moved


def prefill_intensity_flops_per_byte(model: ModelSpec, prompt_tokens: int, batch: int = 1,
                                     counting: Counting = CHAPTER, weight_dtype: str = "bf16") -> float:
    """Prefill FLOPs over weight + cache bytes: about the prompt length (2 FLOPs per 2-byte weight)."""
    return intensity_flops_per_byte(prefill_flops(model, prompt_tokens, batch, counting),
                                    prefill_bytes(model, prompt_tokens, batch, weight_dtype))


def decode_intensity_flops_per_byte(model: ModelSpec, batch: int, context_tokens: int,
                                    counting: Counting = CHAPTER, weight_dtype: str = "bf16",
                                    cache_dtype: str = "bf16") -> float:
    """Decode FLOPs over bytes per step: about the batch size while the weights dominate."""
    return intensity_flops_per_byte(
        decode_flops_per_step(model, batch, context_tokens, counting),
        decode_bytes_per_step(model, batch, context_tokens, weight_dtype, cache_dtype, counting.params))


def ridge_point_flops_per_byte(hardware: HardwareSpec, dtype: str = "bf16") -> float:
    """Intensity where compute and bandwidth take equally long: peak / bandwidth (295 on an H100)."""
    return hardware.peak_flops_per_s(dtype) / hardware.memory_bandwidth_bytes_per_s


def decode_compute_bound_batch(model: ModelSpec, hardware: HardwareSpec, context_tokens: int = 0,
                               weight_dtype: str = "bf16", cache_dtype: str = "bf16",
                               compute_dtype: str = "bf16", counting: Counting = CHAPTER) -> float | None:
    """Batch at which decode intensity reaches the `compute_dtype` ridge point; None if it never
    does (the cache read grows with the batch as fast as the FLOPs). Solves
    B (2N + 4LqS) = R (W + B S k). With bf16 weights and no cache this is the ridge itself (295);
    8-bit weights computed in bf16 halve it (about 150, the chapter's figure)."""
    ridge = ridge_point_flops_per_byte(hardware, compute_dtype)
    flops_per_sequence = decode_flops_per_step(model, 1, context_tokens, counting)
    cache_per_sequence = kv_cache_bytes(model, context_tokens, 1, cache_dtype)
    denominator = flops_per_sequence - ridge * cache_per_sequence
    if denominator <= 0:
        return None
    return ridge * weight_bytes(model, weight_dtype, counting.params) / denominator


def decode_compute_bound_batch_at_roof(model: ModelSpec, hardware: HardwareSpec, context_tokens: int = 0,
                                       weight_dtype: str = "bf16", cache_dtype: str = "bf16",
                                       compute_dtype: str = "bf16", counting: Counting = CHAPTER,
                                       most: int = 1024) -> float | None:
    """`decode_compute_bound_batch` on the cache-aware roof: with a measured bandwidth curve, each
    batch's memory time is at the bandwidth of the bytes its step reads (`roof_at_working_set`), so
    a step whose weights sit in a cache turns compute-bound sooner than the memory's bandwidth
    says. The first whole batch up to `most` whose compute time reaches its memory time, refined by
    the closed form at that batch's bandwidth (kept within a batch of it); None if none does. On a
    datasheet (no curve), `decode_compute_bound_batch` itself."""
    if not hardware.bandwidth_by_working_set:
        return decode_compute_bound_batch(model, hardware, context_tokens, weight_dtype, cache_dtype, compute_dtype, counting)
    for batch in range(1, most + 1):
        nbytes = decode_bytes_per_step(model, batch, context_tokens, weight_dtype, cache_dtype, counting.params)
        roof = roof_at_working_set(hardware, nbytes)
        if compute_time_s(decode_flops_per_step(model, batch, context_tokens, counting), roof, compute_dtype) \
                >= memory_time_s(nbytes, roof):
            at_roof = decode_compute_bound_batch(model, roof, context_tokens, weight_dtype, cache_dtype, compute_dtype, counting)
            return float(batch) if at_roof is None else min(float(batch), max(batch - 1.0, at_roof))
    return None


# ---------------------------------------------------------------- predicted times
def compute_time_s(flops: float, hardware: HardwareSpec, dtype: str = "bf16", mfu: float = 1.0) -> float:
    """Time to do `flops` at `mfu` of the dense peak for `dtype`."""
    return flops / (hardware.peak_flops_per_s(dtype) * _fraction(mfu, "mfu"))


def memory_time_s(bytes_moved: float, hardware: HardwareSpec, bandwidth_efficiency: float = 1.0) -> float:
    """Time to move `bytes_moved` at `bandwidth_efficiency` of the memory bandwidth."""
    return bytes_moved / (hardware.memory_bandwidth_bytes_per_s * _fraction(bandwidth_efficiency, "bandwidth efficiency"))


def roofline_time_s(flops: float, bytes_moved: float, hardware: HardwareSpec, dtype: str = "bf16",
                    mfu: float = 1.0, bandwidth_efficiency: float = 1.0) -> float:
    """The roofline's prediction: the slower of compute and memory (they overlap perfectly)."""
    return max(compute_time_s(flops, hardware, dtype, mfu), memory_time_s(bytes_moved, hardware, bandwidth_efficiency))


def bound_by(flops: float, bytes_moved: float, hardware: HardwareSpec, dtype: str = "bf16") -> str:
    """"compute" or "memory": which roof the operation sits under."""
    compute = compute_time_s(flops, hardware, dtype)
    return "compute" if compute >= memory_time_s(bytes_moved, hardware) else "memory"


def predicted_prefill_time_s(model: ModelSpec, prompt_tokens: int, hardware: HardwareSpec, batch: int = 1,
                             dtype: str = "bf16", counting: Counting = KERNEL, mfu: float = 1.0,
                             bandwidth_efficiency: float = 1.0, past_tokens: int = 0) -> float:
    """Roofline time of one prefill pass with weights and activations in `dtype`. With a
    calibrated `hardware` and efficiencies of 1 this is what the lab plots as "predicted"; its
    bandwidth is the one at the pass's working set (weights and the cache written) where
    `hardware` has a measured curve (`roof_at_working_set`)."""
    flops = prefill_flops(model, prompt_tokens, batch, counting, past_tokens)
    nbytes = prefill_bytes(model, prompt_tokens, batch, dtype, cache_dtype_for(dtype), counting.params)
    return roofline_time_s(flops, nbytes, roof_at_working_set(hardware, nbytes), dtype, mfu, bandwidth_efficiency)


def predicted_decode_step_s(model: ModelSpec, batch: int, context_tokens: int, hardware: HardwareSpec,
                            dtype: str = "bf16", cache_dtype: str = "bf16", counting: Counting = KERNEL,
                            mfu: float = 1.0, bandwidth_efficiency: float = 1.0) -> float:
    """Roofline time of one decode step (weights in `dtype`, cache in `cache_dtype`), at the
    bandwidth of the step's working set (the weights and the cache it reads) where `hardware`
    has a measured curve (`roof_at_working_set`)."""
    flops = decode_flops_per_step(model, batch, context_tokens, counting)
    nbytes = decode_bytes_per_step(model, batch, context_tokens, dtype, cache_dtype, counting.params)
    return roofline_time_s(flops, nbytes, roof_at_working_set(hardware, nbytes), dtype, mfu, bandwidth_efficiency)


def in_turn_time_s(work: dict[str, dict[str, int]], hardware: HardwareSpec, dtype: str = "bf16",
                   mfu: float = 1.0, bandwidth_efficiency: float = 1.0) -> float:
    """The parts of one pass (`decode_work_by_category`, `prefill_work_by_category`) run one
    after another, each at its own roof: the sum of their `roofline_time_s`.

    Why beside the whole pass's roof: that one takes the slower of all the FLOPs at peak and all
    the bytes at the bandwidth, as if the compute of one kernel overlapped the reads of another.
    An engine runs its kernels in turn. Where every part is bound by the same resource the two
    agree (the parts count a few bytes more: q, the attention output, the elementwise work); where
    the products are compute-bound and attention memory-bound, the whole pass's roof is out of
    reach: lab-cpu at B = 32, S = 1,024 on a calibration of the 2-core EPYC VM (497 GFLOP/s, 58.5
    GB/s at the step's 188 MiB), products 2.03 ms at peak and attention 2.30 ms at the bandwidth, where
    the whole step's roof is 3.37 ms."""
    return sum(roofline_time_s(part["flops"], part["bytes"], hardware, dtype, mfu, bandwidth_efficiency)
               for part in work.values())


def predicted_decode_step_in_turn_s(model: ModelSpec, batch: int, context_tokens: int, hardware: HardwareSpec,
                                    dtype: str = "bf16", cache_dtype: str = "bf16", counting: Counting = KERNEL,
                                    mfu: float = 1.0, bandwidth_efficiency: float = 1.0) -> float:
    """`predicted_decode_step_s` with the step's kernels in turn (`in_turn_time_s` over
    `decode_work_by_category`), at the same bandwidth: that of the step's working set."""
    nbytes = decode_bytes_per_step(model, batch, context_tokens, dtype, cache_dtype, counting.params)
    work = decode_work_by_category(model, batch, context_tokens, dtype, cache_dtype, counting)
    return in_turn_time_s(work, roof_at_working_set(hardware, nbytes), dtype, mfu, bandwidth_efficiency)


def tokens_per_s_per_sequence(step_time_s: float) -> float:
    """Streaming speed one user sees: one token per decode step."""
    return 1.0 / step_time_s


def time_roof_fraction(predicted_time_s: float, measured_time_s: float) -> float:
    """How close a measurement came to its roof: the roof's time over the measured time; 1.0 on
    the roof, above 1 faster than it (a stale roof, or data that stayed in cache)."""
    return predicted_time_s / measured_time_s


def bandwidth_fraction(bytes_per_s: float, hardware: HardwareSpec) -> float:
    """An achieved rate of bytes moved per second over the memory bandwidth of `hardware`."""
    return bytes_per_s / hardware.memory_bandwidth_bytes_per_s


def chapter_plan_fraction(bound: str) -> float:
    """The chapter's planning line as a fraction of the roof: CHAPTER_MFU of peak FLOP/s for a
    compute-bound operation, CHAPTER_BANDWIDTH_EFFICIENCY of the bandwidth for a memory-bound one."""
    if bound not in ("compute", "memory"):
        raise SpecError(f"bound must be 'compute' or 'memory', got {bound!r}")
    return CHAPTER_MFU if bound == "compute" else CHAPTER_BANDWIDTH_EFFICIENCY


# ---------------------------------------------------------------- memory tiers: a cache-aware roof
def bandwidth_curve(curve) -> list[tuple[float, float]]:
    """A measured curve as ascending (bytes, bytes_per_s) pairs; it may be given as pairs or as
    calibrate's {"bytes": ..., "bytes_per_s": ...} dicts. Refuses an empty curve or a point
    that is not positive."""
    pairs = sorted((float(p["bytes"]), float(p["bytes_per_s"])) if isinstance(p, dict) else (float(p[0]), float(p[1]))
                   for p in curve)
    if not pairs or not all(b > 0 and rate > 0 for b, rate in pairs):
        raise SpecError(f"a bandwidth curve needs points of positive bytes and bytes/s, got {list(curve)!r}")
    return pairs


def roof_envelope(pairs: list[tuple[float, float]]) -> list[tuple[float, float]]:
    """Ascending (bytes, bytes_per_s) pairs with each rate raised to the fastest measured at any
    larger working set: what a larger working set was read at, a smaller one can be too (it
    needs no byte more from any tier), so the roof never rises with the working set.

    Why: a calibration measures one working set after another, each at its own moment, and a
    shared machine's memory changes speed between them. The 2-core EPYC VM's bench-cpu-31
    calibration read 57 GB/s at 128 MiB and 95 at 256 MiB; on that curve a decode step's roof
    rose from 58 to 95 GB/s as its context grew from 1,024 to 4,096 tokens, a bend in the
    predicted line no phase of decode makes. `calibrate` also marks such a calibration noisy."""
    raised, best = [], 0.0
    for size, rate in reversed(pairs):
        best = max(best, rate)
        raised.append((size, best))
    return raised[::-1]


def bandwidth_at_bytes_per_s(curve, working_set_bytes: float, edges=()) -> float:
    """The bandwidth roof at `working_set_bytes`: interpolated in log(bytes)-log(rate) between
    the two measured neighbours (`roof_envelope`: never below a larger working set's), held flat
    past either end of the curve. Tier-aware: with `edges` (working sets where the roof changes
    tier, `tier_edges`), only points on the same side of every edge are used, so a working set
    just past the L3 gets a memory rate, not a blend with the L3's. Ignores the order of access
    (a sweep reads every byte once per pass)."""
    pairs = roof_envelope(bandwidth_curve(curve))
    if working_set_bytes <= 0:
        raise SpecError(f"working set must be positive bytes, got {working_set_bytes!r}")
    bounds = [0.0, *sorted(edges), math.inf]
    for low, high in zip(bounds, bounds[1:]):
        if low < working_set_bytes <= high:
            pairs = [p for p in pairs if low < p[0] <= high] or pairs
            break
    if working_set_bytes <= pairs[0][0]:
        return pairs[0][1]
    for (b0, r0), (b1, r1) in zip(pairs, pairs[1:]):
        if working_set_bytes == b1:  # a measured point: exactly its rate
            return r1
        if working_set_bytes < b1:
            t = math.log(working_set_bytes / b0) / math.log(b1 / b0)
            return math.exp(math.log(r0) + t * math.log(r1 / r0))
    return pairs[-1][1]


def tier_edges(curve, cache_levels=(), memory_name: str = "memory") -> list[dict]:
    """Where the measured roof steps down from one tier to the next, smallest first.

    The tiers are the cache levels ((name, bytes) as all cores hold them, smallest first) and
    the memory past them; each measured point belongs to the first level it fits in. A tier's
    rate is its best point's; where it is at least TIER_STEP x the next tier's, the edge is the
    working set at which the curve falls through the geometric mean of the two rates (log-log
    between the points around it) — on a VM, or a CPU whose L3 is shared with other tenants,
    that can lie well below the size the OS reports, which each edge keeps as `cache_bytes`.
    Each edge: bytes, from, to, cache_bytes, from_bytes_per_s, to_bytes_per_s, label ("past the
    L3: DRAM")."""
    pairs = bandwidth_curve(curve)
    uppers = [(name, float(size)) for name, size in cache_levels] + [(memory_name, math.inf)]
    tiers, low = [], 0.0
    for name, high in uppers:
        inside = [i for i, (b, _) in enumerate(pairs) if low < b <= high]
        if inside:
            tiers.append((name, high, inside))
        low = high
    edges, start = [], 0
    for (name_a, size_a, in_a), (name_b, _, in_b) in zip(tiers, tiers[1:]):
        rate_a = max(pairs[i][1] for i in in_a)
        rate_b = max(pairs[i][1] for i in in_b)
        if rate_a < TIER_STEP * rate_b:
            continue
        edge = _crossing(pairs, max(start, max(in_a, key=lambda i: pairs[i][1])), math.sqrt(rate_a * rate_b))
        edge = size_a if edge is None else edge
        start = next((i for i, (b, _) in enumerate(pairs) if b > edge), len(pairs))
        edges.append({"bytes": edge, "from": name_a, "to": name_b, "cache_bytes": size_a,
                      "from_bytes_per_s": rate_a, "to_bytes_per_s": rate_b, "label": f"past the {name_a}: {name_b}"})
    return edges


def _crossing(pairs, start: int, rate: float) -> float | None:
    """The working set, from pairs[start] on, where the curve first falls through `rate`."""
    for (b0, r0), (b1, r1) in zip(pairs[start:], pairs[start + 1:]):
        if r0 >= rate > r1:
            return math.exp(math.log(b0) + math.log(rate / r0) / math.log(r1 / r0) * math.log(b1 / b0))
    return None


def memory_tier(working_set_bytes: float, hardware: HardwareSpec) -> str:
    """The tier a working set is read from: by the measured edges where `hardware` has a curve,
    else by the cache sizes alone (the first level it fits in), else the memory."""
    if hardware.bandwidth_by_working_set:
        edges = tier_edges(hardware.bandwidth_by_working_set, hardware.cache_levels, hardware.memory_name)
        if edges:
            return next((e["from"] for e in edges if working_set_bytes <= e["bytes"]), edges[-1]["to"])
    return next((name for name, size in hardware.cache_levels if working_set_bytes <= size), hardware.memory_name)


def roof_at_working_set(hardware: HardwareSpec, working_set_bytes: float) -> HardwareSpec:
    """`hardware` with the bandwidth of a `working_set_bytes` working set as its memory
    bandwidth (`bandwidth_at_bytes_per_s` on its measured curve, tier-aware), its source saying
    so; `hardware` itself when it has no curve (a datasheet)."""
    if not hardware.bandwidth_by_working_set:
        return hardware
    curve = hardware.bandwidth_by_working_set
    edges = [e["bytes"] for e in tier_edges(curve, hardware.cache_levels, hardware.memory_name)]
    bandwidth = bandwidth_at_bytes_per_s(curve, working_set_bytes, edges)
    why = (f"the measured roof at a working set of {working_set_bytes / 2**20:,.1f} MiB "
           f"({memory_tier(working_set_bytes, hardware)})")
    return dataclasses.replace(hardware, memory_bandwidth_bytes_per_s=bandwidth,
                               sources={**hardware.sources, "memory_bandwidth_bytes_per_s": why})


def l2_resident(working_set_bytes: float, l2_bytes: float | None, factor: float = L2_FLUSH_FACTOR) -> bool:
    """Could a GPU serve this working set from its L2 rather than from HBM between back-to-back
    calls? True under `factor` x the L2; such a timing must flush the L2 between calls or be
    flagged and kept out of headline figures. False when the L2 is unknown (None)."""
    return l2_bytes is not None and working_set_bytes < factor * l2_bytes


# ---------------------------------------------------------------- memory footprint
def activation_bytes(model: ModelSpec, tokens: int, batch: int = 1, dtype: str = "bf16") -> int:
    """Peak activations of one layer's forward for `batch * tokens` positions: the residual,
    q/k/v, attention output and SwiGLU's two ffn-wide intermediates. Flash attention keeps the
    score matrix on chip, so no P x P term. An estimate for refusing oversized runs."""
    width = 2 * model.hidden_size + model.q_dim + 2 * model.kv_dim + 3 * model.intermediate_size
    return batch * tokens * width * BYTES_PER_ELEMENT[_check_dtype(dtype)]


def memory_footprint_bytes(model: ModelSpec, batch: int, context_tokens: int, weight_dtype: str = "bf16",
                           cache_dtype: str = "bf16", prefill_tokens: int | None = None) -> int:
    """Weights + a cache of `context_tokens` per sequence + the prefill's activations and the
    last position's fp32 logits. `prefill_tokens` defaults to the whole context in one pass."""
    tokens = context_tokens if prefill_tokens is None else prefill_tokens
    return (weight_bytes(model, weight_dtype) + kv_cache_bytes(model, context_tokens, batch, cache_dtype)
            + activation_bytes(model, tokens, batch, weight_dtype) + logits_bytes(model, batch))


# ---------------------------------------------------------------- checks
def cache_dtype_for(dtype: str) -> str:
    """The cache dtype a prefill in `dtype` writes: its own, or bf16 where no cache is kept in it."""
    return dtype if dtype in CACHE_DTYPES else "bf16"


def _check_dtype(dtype: str) -> str:
    if dtype not in BYTES_PER_ELEMENT:
        raise SpecError(f"unknown dtype {dtype!r}; known: {', '.join(BYTES_PER_ELEMENT)}")
    return dtype


def _check_cache_dtype(dtype: str) -> str:
    if dtype not in CACHE_DTYPES:
        raise SpecError(f"unknown cache dtype {dtype!r}; known: {', '.join(CACHE_DTYPES)}")
    return dtype


def _fraction(value: float, name: str) -> float:
    if not 0 < value <= 1:
        raise SpecError(f"{name} must be in (0, 1], got {value!r}")
    return value


# ---------------------------------------------------------------- one kernel call (lesson 03, the GPU check)
def matmul_flops(m: int, k: int, n: int) -> int:
    """[m, k] @ [k, n]: one multiply and one add per output element per inner index, 2 m k n."""
    return 2 * m * k * n


def matmul_bytes(m: int, k: int, n: int, dtype: str = "bf16") -> int:
    """A [m, k] and B [k, n] read once, C [m, n] written once, in `dtype`. The floor a good GEMM
    comes close to; ignores tiles re-read because they fell out of cache."""
    return (m * k + k * n + m * n) * BYTES_PER_ELEMENT[_check_dtype(dtype)]


def decode_attention_bytes(batch: int, heads: int, kv_heads: int, context_tokens: int, head_dim: int,
                           cache_dtype: str = "bf16", q_dtype: str = "bf16") -> int:
    """What one decode attention call must move: K and V for S positions of B x Hkv heads in
    `cache_dtype`, their scales (int8: one fp32 per position per kv head for K and V; fp8: one
    per tensor for K and V), q read and the output written in `q_dtype`. Ignores the lengths."""
    cache = 2 * batch * kv_heads * context_tokens * head_dim * BYTES_PER_ELEMENT[_check_cache_dtype(cache_dtype)]
    scales = {"int8": 2 * batch * kv_heads * context_tokens * INT8_SCALE_BYTES,
              "fp8": 2 * FP8_SCALE_BYTES}.get(cache_dtype, 0)
    return cache + scales + 2 * batch * heads * head_dim * BYTES_PER_ELEMENT[_check_dtype(q_dtype)]


def naive_attention_bytes(batch: int, heads: int, query_tokens: int, key_tokens: int, head_dim: int,
                          dtype: str = "bf16", kv_heads: int | None = None, score_dtype: str = "fp32") -> int:
    """Memory traffic of attention done as three separate kernels that write the scores out:
    S = Q K^T (write S), softmax (read S, write the probabilities), O = probabilities @ V (read
    them). Counts Q, K, V read once, O written once, and the P x S matrix four times per query
    head in `score_dtype`. Ignores the mask, the softmax's row statistics and any re-reading
    inside each matmul (a good GEMM reads its inputs about once). The sum of
    `naive_attention_work`'s three kernels."""
    work = naive_attention_work(batch, heads, query_tokens, key_tokens, head_dim, dtype, kv_heads, score_dtype)
    return sum(part["bytes"] for part in work.values())


def naive_attention_work(batch: int, heads: int, query_tokens: int, key_tokens: int, head_dim: int,
                         dtype: str = "bf16", kv_heads: int | None = None,
                         score_dtype: str = "fp32") -> dict[str, dict[str, int]]:
    """Plain attention's three kernels, each {"flops", "bytes"} (`naive_attention_bytes` is their
    bytes, `attention_flops` their FLOPs), for `in_turn_time_s`: "scores" (Q K^T: half the FLOPs;
    Q and K read, the P x S scores written), "softmax" (no FLOPs counted: the scores read, the
    probabilities written), "mix" (probabilities @ V: the other half; the probabilities and V
    read, O written).

    Why split: the whole call's roof overlaps the products' arithmetic with the softmax's
    traffic, which run one after another. Where the products are compute-bound (a CPU, whose
    ridge is low) the whole call's roof is that of the fused kernel, as if the square cost
    nothing; in turn, the softmax's two passes over the square add their own time."""
    kv_heads = heads if kv_heads is None else kv_heads
    element = BYTES_PER_ELEMENT[_check_dtype(dtype)]
    rows = batch * heads * query_tokens * head_dim * element  # Q read, or O written
    keys = batch * kv_heads * key_tokens * head_dim * element  # K read, or V read
    square = batch * heads * query_tokens * key_tokens * BYTES_PER_ELEMENT[_check_dtype(score_dtype)]
    half = attention_flops(batch, heads, head_dim, query_tokens, key_tokens - query_tokens) // 2  # full, not causal
    return {"scores": {"flops": half, "bytes": rows + keys + square},
            "softmax": {"flops": 0, "bytes": 2 * square},
            "mix": {"flops": half, "bytes": square + keys + rows}}


def flash_attention_bytes(batch: int, heads: int, query_tokens: int, key_tokens: int, head_dim: int,
                          dtype: str = "bf16", kv_heads: int | None = None, block_m: int | None = None) -> int:
    """Memory traffic of a fused (flash) attention kernel: the scores stay on chip, never counted.
    Q is read and O written once. K and V: with `block_m` None, read once per kv head — the
    best case, when a head's K and V stay in cache while all its query tiles run; with
    `block_m`, re-read once per tile of `block_m` queries for every query head — the worst
    case, no cache reuse at all (still quadratic in the sequence, but smaller than the scores'
    traffic by about 2 * block_m * score bytes / (head_dim * element bytes))."""
    kv_heads = heads if kv_heads is None else kv_heads
    element = BYTES_PER_ELEMENT[_check_dtype(dtype)]
    qo = 2 * batch * heads * query_tokens * head_dim * element
    passes = kv_heads if block_m is None else heads * math.ceil(query_tokens / block_m)
    return qo + 2 * batch * passes * key_tokens * head_dim * element


def naive_attention_footprint_bytes(batch: int, heads: int, query_tokens: int, key_tokens: int,
                                    score_dtype: str = "fp32", live_matrices: int = 2) -> int:
    """Peak memory of materialised attention's score matrices: `live_matrices` P x S matrices
    per query head exist at once (2: the scores and the softmax's output while it is computed).
    Ignores the O(P d) inputs, their fp32 copies and the output, small beside P x S."""
    return live_matrices * batch * heads * query_tokens * key_tokens * BYTES_PER_ELEMENT[_check_dtype(score_dtype)]


# ---------------------------------------------------------------- one step by category (labkit.breakdown)
# A step's parts as `labkit.clock` times them: the weight matrices' products, attention, and
# everything else the layers do (norms, RoPE, SiLU, residual adds, cache writes, the embedding).
STEP_CATEGORIES = ("products", "attention", "other")


def elementwise_bytes_per_position(model: ModelSpec, dtype: str = "bf16", cache_dtype: str = "bf16") -> int:
    """What one position's work outside the products and attention moves, through every layer,
    each operand read and each result written once: per layer the two RMS norms (d read, d
    written, each), RoPE on q and k (q + kv read and written), the new K and V into the cache
    (2 kv read in `dtype`, written in `cache_dtype` with int8's scales: `kv_bytes_per_token` / L),
    SwiGLU's silu(gate) * up (2 ffn read, ffn written) and the two residual adds (2 d read, d
    written, each); plus the embedding row gathered (d read, d written). In `dtype` elements per
    layer: 10 d + 2 q + 4 kv + 3 ffn. Ignores relayouts a kernel could fuse away, the norms'
    weights (d each, read once per call, not per position) and that such small operands often
    stay in a cache between operations."""
    d, q, kv, ffn = model.hidden_size, model.q_dim, model.kv_dim, model.intermediate_size
    element = BYTES_PER_ELEMENT[_check_dtype(dtype)]
    per_layer = (10 * d + 2 * q + 4 * kv + 3 * ffn) * element
    return model.n_layers * per_layer + kv_bytes_per_token(model, cache_dtype) + 2 * d * element


def elementwise_bytes(model: ModelSpec, positions: int, sequences: int, dtype: str = "bf16",
                      cache_dtype: str = "bf16") -> int:
    """Everything else one pass moves: `positions` positions through every layer
    (`elementwise_bytes_per_position`; B x P in a prefill, B in a decode step) and the final norm
    of the `sequences` positions whose logits are computed (d read, d written, each)."""
    element = BYTES_PER_ELEMENT[_check_dtype(dtype)]
    return (positions * elementwise_bytes_per_position(model, dtype, cache_dtype)
            + sequences * 2 * model.hidden_size * element)


def prefill_attention_bytes(model: ModelSpec, prompt_tokens: int, batch: int = 1, dtype: str = "bf16") -> int:
    """What the attention calls of one prefill (no cached prefix) move, every layer, at best:
    `flash_attention_bytes` with K and V read once per kv head, Q read and O written once."""
    return model.n_layers * flash_attention_bytes(batch, model.n_heads, prompt_tokens, prompt_tokens,
                                                  model.head_dim, dtype, model.n_kv_heads)


def decode_linear_flops(model: ModelSpec, batch: int, params: str = "matmul") -> int:
    """The products of one decode step: 2 FLOPs per weight for each of `batch` new tokens, 2 B N
    (`decode_flops_per_step` less its attention)."""
    return batch * 2 * param_count(model, params)


def decode_step_attention_flops(model: ModelSpec, batch: int, context_tokens: int) -> int:
    """The attention of one decode step, every layer: L x `decode_attention_flops`, as
    `decode_flops_per_step` counts it (over `context_tokens` keys)."""
    return model.n_layers * decode_attention_flops(batch, model.n_heads, model.head_dim, context_tokens)


def decode_step_attention_bytes(model: ModelSpec, batch: int, context_tokens: int, cache_dtype: str = "bf16",
                                q_dtype: str = "bf16") -> int:
    """What the attention of one decode step moves, every layer: L x `decode_attention_bytes` (the
    cache of `context_tokens` positions per sequence with its scales, q read and the output written)."""
    return model.n_layers * decode_attention_bytes(batch, model.n_heads, model.n_kv_heads, context_tokens,
                                                   model.head_dim, cache_dtype, q_dtype)


def prefill_work_by_category(model: ModelSpec, prompt_tokens: int, batch: int = 1, dtype: str = "bf16",
                             cache_dtype: str = "bf16", counting: Counting = KERNEL) -> dict[str, dict[str, int]]:
    """One prefill of `batch` prompts (no cached prefix) by `STEP_CATEGORIES`, each {"flops",
    "bytes"}: products `prefill_linear_flops` over the weights read once (`weight_bytes`);
    attention `prefill_attention_flops` over `prefill_attention_bytes`; everything else no FLOPs
    counted (O(P d) beside O(P N)) over `elementwise_bytes`. The products' and attention's FLOPs
    sum to `prefill_flops`."""
    return {"products": {"flops": prefill_linear_flops(model, prompt_tokens, batch, counting.params),
                         "bytes": weight_bytes(model, dtype, counting.params)},
            "attention": {"flops": prefill_attention_flops(model, prompt_tokens, batch, counting.attention),
                          "bytes": prefill_attention_bytes(model, prompt_tokens, batch, dtype)},
            "other": {"flops": 0, "bytes": elementwise_bytes(model, batch * prompt_tokens, batch, dtype, cache_dtype)}}


def decode_work_by_category(model: ModelSpec, batch: int, context_tokens: int, dtype: str = "bf16",
                            cache_dtype: str = "bf16", counting: Counting = KERNEL) -> dict[str, dict[str, int]]:
    """One decode step of `batch` sequences over `context_tokens` cached tokens each, by
    `STEP_CATEGORIES`, each {"flops", "bytes"}: products `decode_linear_flops` over the weights
    read once; attention `decode_step_attention_flops` over `decode_step_attention_bytes` (the
    cache read as stored); everything else no FLOPs counted over `elementwise_bytes` (B positions,
    the new token's cache write included). The products' and attention's FLOPs sum to
    `decode_flops_per_step`; their bytes exceed `decode_bytes_per_step` by q and the attention
    output (and fp8's scales)."""
    return {"products": {"flops": decode_linear_flops(model, batch, counting.params),
                         "bytes": weight_bytes(model, dtype, counting.params)},
            "attention": {"flops": decode_step_attention_flops(model, batch, context_tokens),
                          "bytes": decode_step_attention_bytes(model, batch, context_tokens, cache_dtype, dtype)},
            "other": {"flops": 0, "bytes": elementwise_bytes(model, batch, batch, dtype, cache_dtype)}}
