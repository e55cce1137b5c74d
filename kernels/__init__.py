"""Triton kernels for the prefill-vs-decode lab, one kernel per module, each beside a torch reference.

  matmul            prefill linear layers (compute-bound)
  flash_attention   prefill attention, online softmax, causal / chunked prefill, GQA
  decode_attention  one query per sequence over a (quantised) KV cache, split-KV
  kv_quant          int8 / fp8 KV-cache quantisation
  add_rms_norm      a residual add and the RMSNorm after it, one pass
  rope_store        RoPE on q and k and the K/V cache write, one launch (a decode step's or a prefill's)
  swiglu            the MLP's gate, silu(gate) * up, one pass

On a machine without CUDA, set TRITON_INTERPRET=1 before importing triton to run the kernels in
Triton's interpreter (slow; for tests).

The names below load their kernel module on first use (PEP 562), not when the package is
imported: `kernels.tolerances` and `kernels._runtime` need no triton, and on macOS or Windows,
where Triton publishes no wheels, importing them must not fail on a kernel the CPU path never runs.
"""
import importlib

_HOMES = {
    "decode_attention": "decode_attention", "decode_attention_reference": "decode_attention",
    "default_num_splits": "decode_attention",
    "attention_reference": "flash_attention", "flash_attention": "flash_attention",
    "KV_CACHE_DTYPES": "kv_quant", "dequantize_kv": "kv_quant", "quantize_kv": "kv_quant",
    "quantize_kv_reference": "kv_quant",
    "matmul": "matmul", "matmul_reference": "matmul",
    "add_rms_norm": "add_rms_norm", "add_rms_norm_reference": "add_rms_norm",
    "rope_and_store": "rope_store", "rope_and_store_reference": "rope_store",
    "rope_and_store_prefill": "rope_store", "rope_and_store_prefill_reference": "rope_store",
    "swiglu": "swiglu", "swiglu_reference": "swiglu",
}

__all__ = sorted(_HOMES)


def __getattr__(name):
    """A kernel's function or its reference, from its module, loaded now (triton with it). Three
    functions share their module's name (matmul, flash_attention, decode_attention, add_rms_norm): once that
    module has been imported, `kernels.matmul` is the module, so the lab imports each function
    from its module (`from kernels.matmul import matmul`)."""
    if name not in _HOMES:
        raise AttributeError(f"module 'kernels' has no attribute {name!r}")
    value = getattr(importlib.import_module(f".{_HOMES[name]}", __name__), name)
    globals()[name] = value  # later lookups skip this function
    return value
