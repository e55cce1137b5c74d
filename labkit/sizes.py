"""The sizes each device gets, in one place: the model, dtypes and slider ranges of the lessons, and
how far the chapter's request shapes shrink on a CPU.

A CPU runs the lab's small Llama-shaped model (`lab-cpu`), sized so that every regime shift the
lessons show happens inside these ranges at a slider move's pace; a GPU runs the chapter's
Llama 3.1 8B. The lessons, the CLI and the GPU check read their per-device sizes from here.
"""
from __future__ import annotations

from dataclasses import dataclass

from .errors import LabError

# The model and slider ranges each device gets: on a CPU the lab's small model, sized so the
# phenomena fall inside these ranges in about 2 s a point; on a GPU the chapter's Llama 3.1 8B.
LAB_SETTINGS = {
    "cpu": {"model": "lab-cpu", "dtype": "fp32", "cache_dtype": "fp32",
            "prompt": (64, 4096, 64, 1024), "batch": (1, 64, 1, 1), "context": (0, 8192, 256, 1024)},
    "cuda": {"model": "llama-3.1-8b", "dtype": "bf16", "cache_dtype": "bf16",
             "prompt": (128, 32768, 128, 2048), "batch": (1, 256, 1, 1), "context": (0, 131072, 1024, 8192)},
}


# The KV-cache dtypes each device's lab offers (the lessons' toggles, `make bench`, `labkit.warm`, the
# measurements of `sweeps` and `breakdown`): a GPU computes in bf16, so fp32 would only double the
# read; a CPU offers no fp8, for the reason NOT_OFFERED gives (the CPU kernels still read one: tests).
CACHE_DTYPES = {"cpu": ("fp32", "bf16", "int8"), "cuda": ("bf16", "fp8", "int8")}
# Why a device's lab does not offer a cache dtype. The figures are bench-cpu-15's (pinned by
# tests/test_sizes.py): the fp8 step's bracketed fraction of its roof, its step time over fp32's,
# measured and predicted. Per 64-value row, widening e4m3 took ~16 vector micro-ops (shift, mask,
# two fp16 -> fp32 conversions of two each per 16 values) where int8 takes 2, and a 2-core CPU
# streaming from its L3 has time for ~17 in all, the dot products included; bf16 dot products
# (AVX512-BF16) ran at half the FMAs' rate there, so they saved nothing.
NOT_OFFERED = {"cpu": {"fp8": (
    "the CPU path offers no fp8 KV cache: the CPUs this lab runs on have no fp8 arithmetic, and "
    "widening e4m3 to fp32 in software took longer than reading it (2-core Xeon VM, lab-cpu at "
    "B = 16, S = 4,096: 0.57 of its roof, a step 0.43 of fp32's where the roofline predicts 0.26; "
    "data/recordings/bench-cpu-15.json). An int8 cache stores one byte a value too; fp8 is measured on a GPU")}}


def check_offered(device: str, cache_dtype: str) -> None:
    """Refuse, saying why, a cache dtype that `device`'s lab does not offer (NOT_OFFERED)."""
    why = NOT_OFFERED.get(device, {}).get(cache_dtype)
    if why is not None:
        raise LabError(f"{why}; offered here: {', '.join(CACHE_DTYPES[device])}")


def lab_settings(device: str) -> dict:
    """Model, dtypes and (low, high, step, default) slider ranges for `device` ("cpu" | "cuda")."""
    if device not in LAB_SETTINGS:
        raise LabError(f"no lab settings for device {device!r}; known: {', '.join(LAB_SETTINGS)}")
    return LAB_SETTINGS[device]


# On the CPU the chapter's shapes are divided by this factor: their prompts, and in lesson 07 their
# answers' decode steps too (`explore.scaled_shapes`). The summarisation prompt (60,000) becomes
# 7,500, inside lab-cpu's 8,192-token context and past its attention crossover (~3,075 tokens,
# kernel counting) as 60,000 is past the 8B's (~53,247).
CPU_SHAPE_SCALE = 8


# ---- lesson 06: a long prefill among decoding streams (labkit.interference)
# Sizes per device: a few seconds a run on a 2-core CPU; the chapter's scale on a GPU.
CHUNKING = {
    "cpu": {"model": "lab-cpu", "streams": 4, "context_tokens": 1024, "prompt_tokens": 4096,
            "chunk_tokens": 512, "chunk_range": (128, 4096, 128)},
    "cuda": {"model": "llama-3.1-8b", "streams": 16, "context_tokens": 4096, "prompt_tokens": 32768,
             "chunk_tokens": 2048, "chunk_range": (512, 32768, 512)},
}


def chunking(device: str) -> dict:
    """Lesson 06's default sizes and its chunk slider's (low, high, step) for "cpu" or "cuda"."""
    if device not in CHUNKING:
        raise LabError(f"no chunking sizes for device {device!r}; known: {', '.join(CHUNKING)}")
    return CHUNKING[device]


# ---- the GPU check (labkit.gpu_check): a full run on a GPU, a dry run at toy sizes anywhere
@dataclass(frozen=True)
class GpuCheckSizes:
    """What one run measures. matmuls (M, K, N); heads (H, Hkv, D); flash (P, S): P queries
    after S - P cached keys; decode (B, S); flash_target_from / long_context: the P and S from
    which the flash and quantised-cache targets apply. Decode batches run at `context` and
    double while the last fits, up to max_batch; `contexts` run at batch 1."""

    matmuls: tuple
    heads: tuple
    flash_checks: tuple
    flash_timings: tuple
    flash_target_from: int
    decode_checks: tuple
    decode_timings: tuple
    long_context: int
    model: str
    prompts: tuple
    batches: tuple
    max_batch: int
    context: int
    contexts: tuple
    warmup: int
    repeats: int
    measure_budget_s: float | None  # per kernel timing (labkit.measure.time_fn)
    sweep_repeats: int | None  # None: labkit.sweeps' own


# The full run: Llama 3.1 8B's shapes (its linears' K and N; H=32, Hkv=8, D=128), prompts to 32k, contexts to 128k.
GPU_CHECK_FULL = GpuCheckSizes(
    matmuls=((2048, 4096, 4096), (2048, 4096, 14336), (2048, 14336, 4096)), heads=(32, 8, 128),
    flash_checks=((1024, 1024), (4096, 4096), (1024, 4096)), flash_timings=(1024, 4096, 8192, 16384),
    flash_target_from=4096, decode_checks=((16, 8192), (1, 65536)),
    decode_timings=((1, 16384), (1, 32768), (1, 131072), (16, 8192), (64, 8192)), long_context=32768,
    model=LAB_SETTINGS["cuda"]["model"], prompts=(512, 1024, 2048, 4096, 8192, 16384, 32768), batches=(1, 8, 16, 32, 64),
    max_batch=1024, context=LAB_SETTINGS["cuda"]["context"][3], contexts=(1024, 8192, 32768, 65536, 131072),
    warmup=3, repeats=20, measure_budget_s=1.0, sweep_repeats=None)
# The same steps at toy sizes, GQA 4 kept (H=4, Hkv=1); D=16 is the kernels' smallest head.
GPU_CHECK_DRY = GpuCheckSizes(
    matmuls=((64, 32, 48), (64, 32, 112), (64, 112, 32)), heads=(4, 1, 16),
    flash_checks=((32, 32), (64, 64), (16, 48)), flash_timings=(32, 64), flash_target_from=64,
    decode_checks=((2, 64), (1, 256)), decode_timings=((1, 128), (1, 256), (2, 64)), long_context=256,
    model="lab-tiny", prompts=(16, 64), batches=(1, 4), max_batch=8, context=64, contexts=(64, 256),
    warmup=0, repeats=2, measure_budget_s=None, sweep_repeats=2)


# ---- `make bench` (labkit.bench): each table measured this many times over, one whole pass after
# another; the tables show each point's median round, the recording keeps every round. A shared VM's
# neighbours move a point by tens of percent from minute to minute, which one pass cannot tell apart.
BENCH_ROUNDS, MAX_BENCH_ROUNDS = 3, 10
