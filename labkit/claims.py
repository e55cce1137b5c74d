"""Every number the lessons' prose states, computed here from labkit's formulas.

A lesson's Markdown quotes numbers literally, so a reader sees plain text. `tests/test_lessons.py`
extracts every number from each notebook's Markdown and requires it to be one of
`lesson_numbers(lesson)`, and every one of those to appear in the text: change a formula so a
lesson's sentence becomes false, and `make test` fails.
"""
from __future__ import annotations

import dataclasses
import math
import re

from . import batching, quiz, sizes, timing, traces, workloads
from . import roofline as r
from .specs import get_gpu, get_model


def fmt(value: float, digits: int = 0) -> str:
    """The way prose writes a number: thousands separators, `digits` decimals."""
    return f"{value:,.{digits}f}"


def _chapter_setting():
    return get_model("llama-3.1-8b"), get_gpu("H100-SXM"), get_gpu("H200")


def lesson_01() -> dict[str, str]:
    """The two phases on the roofline."""
    model, h100, h200 = _chapter_setting()
    prompt, batch = 2000, 1
    prefill = r.prefill_intensity_flops_per_byte(model, prompt)
    decode = r.decode_intensity_flops_per_byte(model, batch, 0)
    return {
        "h100_peak_tflops": fmt(h100.bf16_flops_per_s / 1e12),
        "h100_bandwidth_tb_per_s": fmt(h100.memory_bandwidth_bytes_per_s / 1e12, 2),
        "h100_ridge": fmt(r.ridge_point_flops_per_byte(h100)),
        "h200_bandwidth_tb_per_s": fmt(h200.memory_bandwidth_bytes_per_s / 1e12, 1),
        "h200_ridge": fmt(r.ridge_point_flops_per_byte(h200)),
        "prompt": fmt(prompt),
        "prefill_intensity": fmt(prefill),
        "decode_batch": fmt(batch),
        "decode_intensity": fmt(decode),
        "gap": fmt(round(prefill / decode, -3)),
        "params_billion": fmt(r.param_count(model) / 1e9, 2),
        "weights_gb": fmt(r.weight_bytes(model) / 1e9, 2),
        "bytes_per_param": fmt(2),
        "flops_per_param": fmt(2),
        "confirm_tolerance_pct": fmt(100 * timing.CONFIRM_TOLERANCE),
    }


def lesson_02() -> dict[str, str]:
    """Prefill's two terms: linear 2NP and attention 4LP^2d, their crossover, the 31x."""
    model, h100, _ = _chapter_setting()
    big, huge = get_model("llama-3.1-70b"), get_model("llama-3.1-405b")
    short, long = 2048, 32768
    t_short = r.compute_time_s(r.prefill_flops(model, short), h100, "bf16", r.CHAPTER_MFU)
    t_long = r.compute_time_s(r.prefill_flops(model, long), h100, "bf16", r.CHAPTER_MFU)
    # The datasheet chart's grid (128 .. the long prompt): what the causal kernel executes of the
    # chapter's count there.
    grid = [128 * 2 ** i for i in range(int(math.log2(long / 128)) + 1)]
    kernel_share = [r.prefill_flops(model, p, 1, r.KERNEL) / r.prefill_flops(model, p) for p in grid]
    return {
        "params_billion": fmt(r.param_count(model) / 1e9, 2),
        "layers": fmt(model.n_layers), "hidden": fmt(model.hidden_size), "two": fmt(2), "four": fmt(4),
        "crossover_8b": fmt(r.crossover_tokens(model)),
        "crossover_70b": fmt(round(r.crossover_tokens(big), -3)),
        "crossover_405b": fmt(round(r.crossover_tokens(huge), -3)),
        "crossover_8b_causal": fmt(r.crossover_tokens(model, r.Counting("causal", "all"))),
        "crossover_8b_kernel": fmt(r.crossover_tokens(model, r.KERNEL)),
        "share_prompt": fmt(2000), "share_at_2000_pct": fmt(100 * r.attention_share(model, 2000)),
        "long_prompt": fmt(long), "share_at_long_pct": fmt(100 * r.attention_share(model, long)),
        "short_prompt": fmt(short), "mfu_pct": fmt(100 * r.CHAPTER_MFU),
        "h100_peak_tflops": fmt(h100.bf16_flops_per_s / 1e12),
        "t_short_ms": fmt(1000 * t_short), "t_long_s": fmt(t_long, 1),
        "ratio": fmt(t_long / t_short), "naive_ratio": fmt(long / short),
        "square_ratio": fmt((long / short) ** 2),
        **_doubling(model, long), **_doubling(model, 4 * long, "far_"),
        "kernel_share_low": fmt(min(kernel_share), 2), "kernel_share_high": fmt(max(kernel_share), 2),
    }


def _doubling(model, prompt: int, prefix: str = "") -> dict[str, str]:
    """Lesson 02: how much one more doubling of the prompt costs from `prompt` tokens (a FLOP
    ratio, so a time ratio at a fixed utilisation), counted the chapter's way and the kernels'."""
    chapter = r.prefill_flops(model, 2 * prompt) / r.prefill_flops(model, prompt)
    kernel = r.prefill_flops(model, 2 * prompt, 1, r.KERNEL) / r.prefill_flops(model, prompt, 1, r.KERNEL)
    figures = {f"{prefix}doubling_from": fmt(prompt), f"{prefix}doubling_to": fmt(2 * prompt),
               f"{prefix}doubling_ratio": fmt(chapter, 2)}
    if not prefix:
        figures["doubling_ratio_kernel"] = fmt(kernel, 2)
    return figures


def lesson_03() -> dict[str, str]:
    """FlashAttention: the score matrix that is never written."""
    tokens = 120_000
    return {
        "tokens": fmt(tokens),
        "scores_billion": fmt(r.score_matrix_elements(tokens) / 1e9, 1),
        "scores_gb": fmt(r.score_matrix_bytes(tokens, "bf16") / 1e9, 1),
        "bytes_per_score": fmt(2),
    }


def lesson_04() -> dict[str, str]:
    """Decode and the cache read: bytes per step, the cache's share, three regimes."""
    model, h100, _ = _chapter_setting()
    eff = r.CHAPTER_BANDWIDTH_EFFICIENCY
    alone = r.tokens_per_s_per_sequence(r.memory_time_s(r.weight_bytes(model), h100, eff))
    step = r.decode_bytes_per_step(model, 64, 8192)
    loaded = r.tokens_per_s_per_sequence(r.memory_time_s(step, h100, eff))
    return {
        "kv_kib_per_token": fmt(r.kv_bytes_per_token(model) / 2**10),
        "layers": fmt(model.n_layers), "kv_heads": fmt(model.n_kv_heads), "head_dim": fmt(model.head_dim),
        "two": fmt(2),
        "long_context": fmt(131072), "share_long_pct": fmt(100 * r.cache_share(model, 1, 131072)),
        "context": fmt(8192), "batch": fmt(64), "share_batch_pct": fmt(100 * r.cache_share(model, 64, 8192)),
        "cache_gb": fmt(r.kv_cache_bytes(model, 8192, 64) / 1e9, 1),
        "weights_gb": fmt(r.weight_bytes(model) / 1e9, 2),
        "step_gb": fmt(step / 1e9, 1), "slowdown": fmt(step / r.weight_bytes(model), 1),
        "bandwidth_eff_pct": fmt(100 * eff), "h100_bandwidth_tb_per_s": fmt(h100.memory_bandwidth_bytes_per_s / 1e12, 2),
        "tokens_alone": fmt(alone), "tokens_loaded": fmt(loaded),
        "weights_below_pct": fmt(100 * r.WEIGHTS_DOMINATED_BELOW), "cache_from_pct": fmt(100 * r.CACHE_DOMINATED_FROM),
        "chat_context": fmt(2000), "share_chat_pct": fmt(100 * r.cache_share(model, 1, 2000), 1),
        "long_slowdown": fmt(r.decode_bytes_per_step(model, 1, 131072) / r.weight_bytes(model), 1),
        "ridge": fmt(r.ridge_point_flops_per_byte(h100)),
        "batch_bf16": fmt(r.decode_compute_bound_batch(model, h100)),
        "batch_8bit": fmt(r.decode_compute_bound_batch(model, h100, weight_dtype="fp8")),
        "fp8_kv_kib_per_token": fmt(r.kv_bytes_per_token(model, "fp8") / 2**10),
        # The chapter's own roundings and a figure it borrowed from prefill, named as such.
        "tokens_alone_chapter": fmt(r.tokens_per_s_per_sequence(
            r.memory_time_s(round(r.weight_bytes(model), -9), h100, eff))),
        "weights_gb_rounded": fmt(round(r.weight_bytes(model), -9) / 1e9),
        "batch_8bit_chapter": fmt(round(r.decode_compute_bound_batch(model, h100, weight_dtype="fp8"), -1)),
        "prefill_share_at_chat_pct": fmt(100 * r.attention_share(model, 2000)),
        # The embedding table's place in "the weights": decode gathers B rows of it, streams the rest.
        "embedding_gb": fmt((r.weight_bytes(model) - r.weight_bytes(model, "bf16", "matmul")) / 1e9, 2),
        "streamed_gb": fmt(r.weight_bytes(model, "bf16", "matmul") / 1e9, 2),
        "share_long_streamed_pct": fmt(100 * r.cache_share(model, 1, 131072, params="matmul"), 1),
        "share_batch_streamed_pct": fmt(100 * r.cache_share(model, 64, 8192, params="matmul"), 1),
        "tokens_alone_streamed": fmt(r.tokens_per_s_per_sequence(
            r.memory_time_s(r.weight_bytes(model, "bf16", "matmul"), h100, eff))),
        # Readings of the chapter's "about 150", and the context past which no batch is compute-bound.
        "batch_half_peak": fmt(r.decode_compute_bound_batch(
            model, dataclasses.replace(h100, bf16_flops_per_s=h100.bf16_flops_per_s / 2))),
        "batch_planning": fmt(r.decode_compute_bound_batch(model, dataclasses.replace(
            h100, bf16_flops_per_s=r.CHAPTER_MFU * h100.bf16_flops_per_s,
            memory_bandwidth_bytes_per_s=eff * h100.memory_bandwidth_bytes_per_s))),
        "no_ridge_from_tokens": fmt(_first_context_without_ridge(model, h100)),
        "attention_flops_per_byte": fmt(r.decode_attention_flops(1, model.n_heads, model.head_dim, 8192)
                                        / r.decode_attention_bytes(1, model.n_heads, model.n_kv_heads, 8192,
                                                                   model.head_dim)),
        "mixed_low_pct": fmt(100 / 3), "mixed_high_pct": fmt(50), "mfu_pct": fmt(100 * r.CHAPTER_MFU),
    }


def _first_context_without_ridge(model, hardware, limit: int = 1 << 20) -> int:
    """The shortest context at which no batch makes decode compute-bound (bf16 weights and cache):
    past it every added sequence brings as many bytes of cache as FLOPs (bisection)."""
    low, high = 0, limit  # a batch exists at `low`; none at `high`
    while high - low > 1:
        middle = (low + high) // 2
        low, high = (middle, high) if r.decode_compute_bound_batch(model, hardware, middle) else (low, middle)
    return high


def lesson_06() -> dict[str, str]:
    """Chunked prefill: one long prompt stalls every stream unless it is sliced."""
    model, h100, _ = _chapter_setting()
    prompt, chunk = 50_000, 2048
    stall = r.compute_time_s(r.prefill_flops(model, prompt, counting=r.KERNEL), h100, "bf16", r.CHAPTER_MFU)
    chunks = -(-prompt // chunk)
    first_chunk = r.compute_time_s(r.prefill_flops(model, chunk, counting=r.KERNEL), h100, "bf16", r.CHAPTER_MFU)
    # the last full chunk attends to every token cached before it: the longest of them
    last_past = (prompt // chunk - 1) * chunk
    last_chunk = r.compute_time_s(r.prefill_flops(model, chunk, counting=r.KERNEL, past_tokens=last_past),
                                  h100, "bf16", r.CHAPTER_MFU)
    return {
        "prompt": fmt(prompt), "stall_s": fmt(stall, 1), "mfu_pct": fmt(100 * r.CHAPTER_MFU),
        "chunk": fmt(chunk), "chunks": fmt(chunks), "first_chunk_ms": fmt(1000 * first_chunk),
        "last_chunk_ms": fmt(1000 * last_chunk), "last_over_first": fmt(last_chunk / first_chunk, 1),
    }



def lesson_05() -> dict[str, str]:
    """Static vs continuous batching: the mean/max estimate on the chapter's shapes and the trace."""
    outputs = [w.output_tokens for w in workloads.WORKLOADS.values()]
    figures = {"mix_mean": fmt(sum(outputs) / len(outputs)), "mix_max": fmt(max(outputs)),
               "mix_util_pct": fmt(100 * batching.static_utilisation_estimate(outputs))}
    for name in traces.SUMMARIES:
        out = traces.load_summary(name)["output_tokens"]
        figures.update({f"{name}_mean": fmt(out["mean"]), f"{name}_max": fmt(out["max"]),
                        f"{name}_util_pct": fmt(100 * out["mean"] / out["max"], 1)})
    return figures


def lesson_07() -> dict[str, str]:
    """Workload shapes: the six shapes, their predicted shares on an H100, the CPU scaling."""
    model, h100, _ = _chapter_setting()
    figures = {"agent_steps": fmt(workloads.AGENT_STEPS), "pushed_batch": fmt(workloads.PUSHED_BATCH),
               "chapter_batch": fmt(workloads.CHAPTER_BATCH), "mfu_pct": fmt(100 * r.CHAPTER_MFU),
               "bandwidth_pct": fmt(100 * r.CHAPTER_BANDWIDTH_EFFICIENCY),
               "cpu_scale": fmt(sizes.CPU_SHAPE_SCALE),
               "cpu_summary_prompt": fmt(workloads.WORKLOADS["summarisation"].prompt_tokens / sizes.CPU_SHAPE_SCALE),
               "crossover_cpu": fmt(r.crossover_tokens(get_model("lab-cpu"), r.KERNEL)),
               "crossover_8b": fmt(r.crossover_tokens(model, r.KERNEL)),
               "classification_75_batch": fmt(workloads.batch_for_prefill_share(model, h100, "classification", 0.75)),
               "chat_decode_pct": fmt(100 * workloads.request_time_split(model, h100, "chat")["decode_share"]),
               "classification_pushed_pct": fmt(100 * workloads.request_time_split(
                   model, h100, "classification", workloads.PUSHED_BATCH)["prefill_share"])}
    # "RAG and the agent step both send 40 prompt tokens for every token of answer": one number
    # only while the two ratios agree.
    for name in ("rag", "agent"):
        w = workloads.WORKLOADS[name]
        figures[f"{name}_prompt_per_output"] = fmt(w.prompt_tokens / w.output_tokens)
    for w in workloads.WORKLOADS.values():
        split = workloads.request_time_split(model, h100, w, workloads.CHAPTER_BATCH)
        figures.update({f"{w.name}_prompt": fmt(w.prompt_tokens), f"{w.name}_output": fmt(w.output_tokens),
                        f"{w.name}_prefill_pct": fmt(100 * split["prefill_share"])})
        for i, number in enumerate(re.findall(r"\d+", w.chapter_split)):  # the chapter's own claim
            figures[f"{w.name}_chapter_{i}"] = number
    return figures


def lesson_08() -> dict[str, str]:
    """Check yourself: the inputs the questions state (the answers are labkit's, not in the prose)."""
    _, h100, _ = _chapter_setting()
    return {"h100_peak_tflops": fmt(h100.bf16_flops_per_s / 1e12),
            "h100_bandwidth_tb_per_s": fmt(h100.memory_bandwidth_bytes_per_s / 1e12, 2),
            "prompt": fmt(quiz.PROMPT), "short": fmt(quiz.SHORT), "long": fmt(quiz.LONG),
            "scores_tokens": fmt(quiz.SCORES_TOKENS), "stall_prompt": fmt(quiz.STALL_PROMPT),
            "mfu_pct": fmt(100 * r.CHAPTER_MFU), "context": fmt(quiz.CONTEXT), "batch": fmt(quiz.BATCH),
            "logits_prompt": fmt(quiz.LOGITS_PROMPT), "long_context": fmt(quiz.LONG_CONTEXT),
            "tiny_chunk": fmt(quiz.CHUNKS[0]), "chunk": fmt(quiz.CHUNKS[1])}

LESSONS = {"01": lesson_01, "02": lesson_02, "03": lesson_03, "04": lesson_04, "05": lesson_05, "06": lesson_06,
           "07": lesson_07, "08": lesson_08}


def lesson_numbers(lesson: str) -> dict[str, str]:
    """The numbers lesson `lesson` ("01", "02", …) may state, as they are written."""
    return LESSONS[lesson]()
