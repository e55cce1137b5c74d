"""Triton kernels for the prefill-vs-decode lab, one kernel per module, each beside a torch reference.

  matmul            prefill linear layers (compute-bound)
  flash_attention   prefill attention, online softmax, causal / chunked prefill, GQA
  decode_attention  one query per sequence over a (quantised) KV cache, split-KV
  kv_quant          int8 / fp8 KV-cache quantisation

On a machine without CUDA, set TRITON_INTERPRET=1 before importing triton to run the kernels in
Triton's interpreter (slow; for tests).
"""
from .decode_attention import decode_attention, decode_attention_reference, default_num_splits
from .flash_attention import attention_reference, flash_attention
from .kv_quant import KV_CACHE_DTYPES, dequantize_kv, quantize_kv, quantize_kv_reference
from .matmul import matmul, matmul_reference

__all__ = [
    "KV_CACHE_DTYPES", "attention_reference", "decode_attention", "decode_attention_reference",
    "default_num_splits", "dequantize_kv", "flash_attention", "matmul", "matmul_reference",
    "quantize_kv", "quantize_kv_reference",
]
