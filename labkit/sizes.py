"""The sizes each device gets, in one place: the model, dtypes and slider ranges of the lessons, and
how far the chapter's request shapes shrink on a CPU.

A CPU runs the lab's small Llama-shaped model (`lab-cpu`), sized so that every regime shift the
lessons show happens inside these ranges at a slider move's pace; a GPU runs the chapter's
Llama 3.1 8B. The lessons, the CLI and the GPU check read their per-device sizes from here.
"""
from __future__ import annotations

from .errors import LabError

# The model and slider ranges each device gets: on a CPU the lab's small model, sized so the
# phenomena fall inside these ranges in about 2 s a point; on a GPU the chapter's Llama 3.1 8B.
LAB_SETTINGS = {
    "cpu": {"model": "lab-cpu", "dtype": "fp32", "cache_dtype": "fp32",
            "prompt": (64, 4096, 64, 1024), "batch": (1, 64, 1, 1), "context": (0, 8192, 256, 1024)},
    "cuda": {"model": "llama-3.1-8b", "dtype": "bf16", "cache_dtype": "bf16",
             "prompt": (128, 32768, 128, 2048), "batch": (1, 256, 1, 1), "context": (0, 131072, 1024, 8192)},
}


def lab_settings(device: str) -> dict:
    """Model, dtypes and (low, high, step, default) slider ranges for `device` ("cpu" | "cuda")."""
    if device not in LAB_SETTINGS:
        raise LabError(f"no lab settings for device {device!r}; known: {', '.join(LAB_SETTINGS)}")
    return LAB_SETTINGS[device]


# On the CPU the chapter's shapes are divided by this factor, prompts and outputs alike: the
# summarisation prompt (60,000) becomes 7,500, inside lab-cpu's 8,192-token context and past its
# attention crossover (~3,075 tokens, kernel counting) as 60,000 is past the 8B's (~53,247).
CPU_SHAPE_SCALE = 8
