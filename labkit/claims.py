"""Every number the lessons' prose states, computed here from labkit's formulas.

A lesson's Markdown quotes numbers literally, so a reader sees plain text. `tests/test_lessons.py`
extracts every number from each notebook's Markdown and requires it to be one of
`lesson_numbers(lesson)`, and every one of those to appear in the text: change a formula so a
lesson's sentence becomes false, and `make test` fails.
"""
from __future__ import annotations

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
    }


LESSONS = {"01": lesson_01}


def lesson_numbers(lesson: str) -> dict[str, str]:
    """The numbers lesson `lesson` ("01", "02", …) may state, as they are written."""
    return LESSONS[lesson]()
