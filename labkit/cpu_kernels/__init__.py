"""The CPU decode step's kernels, compiled by numba: the CPU counterpart of kernels/, where the GPU's
Triton kernels live. One idea per module, each kernel with its reference beside it:

  few_rows          few-row products that read each weight row once for all B rows (any CPU)
  panels            the panel product: a weight repacked into 16-column panels, register tiles (AVX-512, AVX2)
  attention         decode attention over a cache read as stored, and its float64 reference
  attention_blocks  what it is built of: a stored value widened in registers, the G = 2 vector passes
  attention_int8    an int8 cache attended in integers (AVX512-VNNI)
  stores            the new token's cache write: as is, int8 quantised, bf16/fp16/fp8 rounded as torch does
  elementwise       RMS norm, RoPE and SwiGLU, fused (their numpy references are in `cpu_decode`)
  _jit              what they all build on: numba's imports, intrinsics, LLVM IR helpers, an exp,
                    and the check that drops cached builds made with other sources
  _installed_builds the builds made at setup, copied for a learner who cannot write to the install

numba is pinned in requirements.txt but not a core dependency (a GPU image need not have it):
`AVAILABLE` says whether the kernels exist; without numba the CPU step keeps its numpy path.
Compiled code is cached beside these files (numba's `cache=True`), so a new process loads it. The
kernels run on the calling thread and release the GIL; the `*_on_cores` forms share one call out on
numba's thread pool. The names below are what the rest of labkit calls.
"""
from __future__ import annotations

from ._jit import AVAILABLE, drop_stale_builds, keep_builds_current, sources_digest
from .attention import decode_attention_reference
from .attention_blocks import PREFETCH_BYTES_AHEAD, VECTOR_HEAD_DIMS, widen_reference
from .attention_int8 import INT8_DOT_HEAD_DIM, int8_in_integers
from .few_rows import PREFETCH_WEIGHT_BYTES_AHEAD, few_rows_linear_reference
from .panels import PANEL_COLUMNS, PANEL_PAIR_ROWS, PANEL_TILE_ROWS, pack_panels, panels_in_registers, wide_tiles
from .stores import ROUNDED_STORES

if AVAILABLE:
    from .attention import decode_attention, decode_attention_on_cores
    from .elementwise import rms_norm, rotate_in_place, swiglu
    from .few_rows import few_rows_linear, linear_columns, linear_on_cores, tile_2x4_linear
    from .panels import panel_linear, panel_linear_on_cores
    from .stores import store_as_is, store_int8, store_rounded
