"""The model's operations, one function each, in two implementations chosen once per model.

    ops = choose_ops(None, torch.device("cpu"))   # TorchOps on the CPU, TritonOps on CUDA
    ops.linear(x, w); ops.prefill_attention(q, k, v); ops.decode_attention(q, cache, layer, ...)

Between the products, `add_rms_norm` (a residual add and the norm after it), decode's
`rope_and_store` and a prefill's `rope_and_store_prefill` (RoPE, then K and V into the cache), and
`swiglu` (the MLP's gate) are torch ops on the CPU and one kernel each on the Triton path, where a
decode step's launches, not its bytes, set their cost, and an eager prefill's (lesson 06's chunks)
set its host's.

`TorchOps` is the CPU path: fp32 linears through numpy's OpenBLAS (`cpu_blas`) or, for many rows,
torch's MKL on an Intel CPU and oneDNN's linear on an AMD one (`linear`), torch's SDPA for
prefill (on an AMD CPU blocks of queries through oneDNN's linear: `cpu_prefill_attention`) and
for decode over a float cache, and a chunked online-softmax decode attention over an
int8/fp8 cache, which upcasts a chunk at a time so the temporaries stay in the CPU caches and
the memory traffic stays about the compact cache's bytes. `TritonOps` is the CUDA path (and
the Triton interpreter in tests): the lab's kernels in kernels/, where Triton is installed
(it publishes no wheels for macOS or Windows).

Shapes: x [..., in]; w [out, in]; prefill q [B, H, P, dh], k, v [B, Hkv, S, dh]; decode q
[B, H, dh] over cache rows [B, Hkv, S_max, dh], lengths int32 [B] (the new token included).
"""
from __future__ import annotations

import functools
import math

import torch
import torch.nn.functional as F

from . import backend, cpu_info
from .cpu_blas import blas_matmul
from .cpu_prefill_attention import blocked_prefill_attention, sdpa_prefill_attention
from .errors import LabError
from .layer_math import rms_norm, rotate_qkv, swiglu

# The int8/fp8 decode attention's fp32 temporaries per chunk: small enough to stay in L2/L3
# (chunks of tens of MiB spill to memory and ran several times slower).
DECODE_CHUNK_BYTES = 2 << 20
# From this many rows (a prefill, a chunk of one) an fp32 product on an Intel CPU goes to torch's own
# BLAS, MKL, one of the two the calibration's fp32 peak is measured with. On the lab's 2-core Xeon
# (Emerald Rapids) VM it multiplied lab-cpu's four layer products faster than numpy's OpenBLAS at
# every row count from 16 up: 64 rows 0.37 against 0.51 ms, 1,024 rows 5.0 against 6.0 ms; prefill
# P = 2,048 took 109-118 ms against 125-143 (alternating processes). Fewer rows (a decode step
# outside `cpu_decode`) keep OpenBLAS's column blocks for a large weight (`cpu_blas`); an AMD CPU
# multiplies many rows by oneDNN's linear (below), others keep OpenBLAS for all: torch's MKL streamed
# decode-shaped products slowly on the lab's AMD CPUs.
MKL_MIN_ROWS = 32


@functools.lru_cache(maxsize=1)
def mkl_for_many_rows() -> bool:
    """Whether `TorchOps.linear` multiplies many-row fp32 products with torch's MKL: an Intel CPU
    and a torch built with MKL."""
    return torch.backends.mkl.is_available() and cpu_info.cpu_vendor() == "GenuineIntel"


# ... and on an AMD CPU with the same rows, oneDNN's linear (in torch too): on an AMD CPU torch's MKL
# runs its AVX2 kernels, and numpy's OpenBLAS picks its kernels by CPU and by OPENBLAS_CORETYPE (a
# machine may set it to an older set for safety). oneDNN chose AVX-512 there. 2-core EPYC VM (Zen 5,
# cpu family 26), fp32, fastest of 10, lab-cpu's prefill products (1,024 and 4,096 rows, K = 256 or
# 768): oneDNN 406-449 GFLOP/s, torch's MKL 184-190, OpenBLAS with its AVX2 kernels ("Haswell", as
# that machine set) 210-224, with its AVX-512 ones ("SkylakeX", its own choice) 364-438.
@functools.lru_cache(maxsize=1)
def onednn_for_many_rows() -> bool:
    """Whether `TorchOps.linear` multiplies many-row fp32 products with oneDNN's linear: an AMD
    CPU (where it was timed; ARM's keep OpenBLAS) and a torch whose oneDNN linear gives a trial
    product right."""
    if cpu_info.cpu_vendor() != "AuthenticAMD" or not torch.backends.mkldnn.is_available():
        return False
    try:  # a trial: the op can exist in a build (ARM, macOS) and still fail
        w = torch.randn(24, 40, generator=torch.Generator().manual_seed(0)).t().contiguous().t()  # [out, in] view
        x = torch.randn(MKL_MIN_ROWS, 40, generator=torch.Generator().manual_seed(1))
        got = torch.ops.mkldnn._linear_pointwise(x, w, None, "none", [], "")
    except (AttributeError, RuntimeError):
        return False
    return bool(torch.allclose(got, x @ w.T, rtol=1e-4, atol=1e-4))


class TorchOps:
    """CPU path: numpy's BLAS for fp32 linears, SDPA for prefill, decode attention per cache dtype."""

    name = "torch"

    @staticmethod
    def linear(x, w):
        """x [..., in] @ w[out, in].T -> [..., out]. On the CPU in fp32 the weights are stored
        [in, out]-contiguous (see `model._param`) and multiplied by numpy's OpenBLAS
        (`cpu_blas.blas_matmul`): torch's MKL streams decode-shaped matmuls (a few rows, a weight
        far beyond cache) at a fraction of OpenBLAS's rate on the lab's AMD CPUs. Same
        arithmetic, a faster library. On an Intel CPU a product of `MKL_MIN_ROWS` rows or more
        (prefill) runs on torch's MKL, which is faster there (see `MKL_MIN_ROWS`)."""
        wt = w.t()  # [in, out], a view
        if x.dtype == torch.float32 and x.device.type == "cpu" and wt.is_contiguous():
            many = x.numel() >= MKL_MIN_ROWS * x.shape[-1]
            if many and mkl_for_many_rows():
                return F.linear(x, w)
            rows = x.reshape(-1, x.shape[-1]).contiguous()
            if many and onednn_for_many_rows():
                return torch.ops.mkldnn._linear_pointwise(rows, w, None, "none", [], "").view(*x.shape[:-1], w.shape[0])
            return torch.from_numpy(blas_matmul(rows.numpy(), wt.numpy())).view(*x.shape[:-1], w.shape[0])
        return F.linear(x, w)

    @staticmethod
    def prefill_attention(q, k, v):
        """q [B, H, P, dh] are the last P of S positions; k, v [B, Hkv, S, dh]. torch's SDPA, or
        in fp32 on an AMD CPU blocks of queries through oneDNN's linear (`cpu_prefill_attention`)."""
        if q.dtype == torch.float32 and q.device.type == "cpu" and onednn_for_many_rows():
            return blocked_prefill_attention(q, k, v)
        return sdpa_prefill_attention(q, k, v)

    @staticmethod
    def add_rms_norm(x, delta, weight, eps):
        """(x + delta, rms_norm(x + delta)) for x, delta [..., d] (delta None: (x, rms_norm(x))):
        a residual add and the norm that follows it, as two torch ops."""
        x = x if delta is None else x + delta
        return x, rms_norm(x, weight, eps)

    @staticmethod
    def swiglu(gate_up):
        """gate_up [..., 2 ffn] (the fused product's gate half, then its up half) -> silu(gate) * up
        [..., ffn]: two torch ops."""
        return swiglu(*gate_up.chunk(2, dim=-1))

    @staticmethod
    def rope_and_store(qkv, rope, cache, layer, positions):
        """Decode's qkv [B, 1, (H + 2 Hkv) dh] -> q [B, H, dh], RoPE on q and k, k and v
        written into `cache` at `positions` (an int, or a tensor [B]: `KVCache.update`)."""
        q, k, v = rotate_qkv(qkv, cache.spec.n_heads, cache.spec.n_kv_heads, rope)
        cache.update(layer, k, v, positions)
        return q[:, :, 0]

    @staticmethod
    def rope_and_store_prefill(qkv, rope, cache, layer, start, rows):
        """A prefill's qkv [b, P, (H + 2 Hkv) dh] -> q [b, H, P, dh], k, v [b, Hkv, P, dh] (views),
        RoPE on q and k, k and v written into cache rows `rows` at start .. start + P - 1."""
        q, k, v = rotate_qkv(qkv, cache.spec.n_heads, cache.spec.n_kv_heads, rope)
        cache.update(layer, k, v, start, rows)
        return q, k, v

    @staticmethod
    def decode_attention(q, cache, layer, lengths, max_length, mixed):
        """q [B, H, dh] over each row's first lengths[b] cached positions -> [B, H, dh]."""
        if cache.cache_dtype in ("int8", "fp8"):
            return chunked_decode_attention(q, cache, layer, lengths, max_length, mixed)
        return sdpa_decode_attention(q, cache, layer, lengths, max_length, mixed)


class TritonOps:
    """CUDA path (or the Triton interpreter in tests): the kernels in kernels/.

    kernels/ is imported inside each method, on first use: it imports triton, which reads
    TRITON_INTERPRET once, at its import, so importing labkit.model must not fix it before the
    caller has decided (labkit's import sets it where torch can use no NVIDIA GPU; `gpu_check.main` sets it later,
    on a driver without a usable GPU). The CPU path never calls these and never loads triton here."""

    name = "triton"

    @staticmethod
    def linear(x, w):
        from kernels.matmul import matmul  # on first use: see the class docstring
        out = matmul(x.reshape(-1, x.shape[-1]), w.t())  # w.t() is a view: the kernel follows strides
        return out.view(*x.shape[:-1], w.shape[0])

    @staticmethod
    def prefill_attention(q, k, v):
        from kernels.flash_attention import flash_attention  # on first use: see the class docstring
        return flash_attention(q, k, v, causal=True)

    @staticmethod
    def add_rms_norm(x, delta, weight, eps):
        """One kernel for the residual add and the next norm (kernels/add_rms_norm.py)."""
        from kernels.add_rms_norm import MAX_N, add_rms_norm  # on first use: see the class docstring
        d = x.shape[-1]
        if d > MAX_N:  # a row wider than one program holds (a config.json's model): torch's two ops
            return TorchOps.add_rms_norm(x, delta, weight, eps)
        total, normed = add_rms_norm(x.reshape(-1, d), None if delta is None else delta.reshape(-1, d), weight, eps)
        return total.view(x.shape), normed.view(x.shape)

    @staticmethod
    def rope_and_store(qkv, rope, cache, layer, positions):
        """One kernel for decode's RoPE and cache write (kernels/rope_store.py): qkv [B, 1, ...]
        -> q [B, H, dh]; cos, sin from `rope_angles` are viewed as [1 or B, dh]."""
        from kernels.rope_store import rope_and_store  # on first use: see the class docstring
        (cos, sin), dh = rope, cache.spec.head_dim
        k_scale, v_scale = cache.layer_scales(layer)
        return rope_and_store(qkv.reshape(qkv.shape[0], -1), cos.reshape(-1, dh), sin.reshape(-1, dh),
                              cache.k[layer], cache.v[layer], k_scale, v_scale, positions)

    @staticmethod
    def swiglu(gate_up):
        """One kernel for the MLP's gate (kernels/swiglu.py): gate_up [..., 2 ffn] -> [..., ffn]."""
        from kernels.swiglu import swiglu  # on first use: see the class docstring
        return swiglu(gate_up.reshape(-1, gate_up.shape[-1])).view(*gate_up.shape[:-1], gate_up.shape[-1] // 2)

    @staticmethod
    def rope_and_store_prefill(qkv, rope, cache, layer, start, rows):
        """One kernel for a prefill's RoPE and cache write (kernels/rope_store.py): qkv [b, P, ...]
        -> q [b, H, P, dh], k, v [b, Hkv, P, dh], views of the kernel's output and of qkv."""
        from kernels.rope_store import rope_and_store_prefill  # on first use: see the class docstring
        (cos, sin), spec = rope, cache.spec
        H, Hkv, dh = spec.n_heads, spec.n_kv_heads, spec.head_dim
        k_scale, v_scale = cache.layer_scales(layer)
        if k_scale is not None and k_scale.dim():  # int8: a scale per row and position; fp8's is the layer's
            k_scale, v_scale = k_scale[rows], v_scale[rows]
        qk = rope_and_store_prefill(qkv, cos.reshape(-1, dh), sin.reshape(-1, dh), cache.k[layer][rows],
                                    cache.v[layer][rows], k_scale, v_scale, start)  # [b, P, H + Hkv, dh]
        b, P = qkv.shape[:2]
        v = qkv.view(b, P, H + 2 * Hkv, dh)[:, :, H + Hkv:]
        return qk[:, :, :H].transpose(1, 2), qk[:, :, H:].transpose(1, 2), v.transpose(1, 2)

    @staticmethod
    def decode_attention(q, cache, layer, lengths, max_length, mixed):
        from kernels.decode_attention import decode_attention  # on first use: see the class docstring
        k_scale, v_scale = cache.layer_scales(layer)
        # KVCache validates lengths on the host; checking them here would sync with the device
        # once per layer and step.
        return decode_attention(q, cache.k[layer], cache.v[layer], lengths, k_scale, v_scale,
                                check_lengths=False)


OPS = {"torch": TorchOps, "triton": TritonOps}


def choose_ops(kernels: str | None, device: torch.device):
    """The ops called `kernels` ("torch" | "triton"); None: Triton's on CUDA, torch's elsewhere
    (tests run the Triton path on the CPU, in the interpreter, by asking for it). Where Triton is
    not installed (Windows' CUDA torch brings none) None means torch's, and asking for "triton"
    is refused in one line."""
    # Triton is asked about only where the answer matters (a CUDA device, or Triton's ops asked
    # for): a CPU model built with torch's ops runs the same whether it is installed or not, and
    # `make test` reruns with Triton only the tests that asked (tests/no_triton/sitecustomize.py).
    # Asked once: a default of "triton" was chosen because it is installed.
    if not kernels:
        kernels = "triton" if device.type == "cuda" and backend.triton_installed() else "torch"
    elif kernels not in OPS:
        raise LabError(f"kernels {kernels!r} unknown; known: {', '.join(OPS)}")
    elif kernels == "triton" and not backend.triton_installed():
        raise LabError(f"kernels 'triton' skipped: {backend.TRITON_MISSING}; use kernels='torch'")
    return OPS[kernels]


# ------------------------------------------------------------------ CPU decode attention
def sdpa_decode_attention(q, cache, layer, lengths, max_length, mixed):
    """Decode attention over a float (fp32/bf16/fp16) cache with torch's CPU flash kernel, which
    reads the cache in blocks with an online softmax, upcasting each block as it goes.

    The G = H / Hkv query heads of a kv head act as G queries of one "sequence", so K and V are
    read once per kv head (no GQA expansion). q is rounded to the cache dtype (SDPA wants one
    dtype): for a bf16 cache an error of the same order as the cache's own rounding."""
    B, H, dh = q.shape
    Hkv = cache.spec.n_kv_heads
    k, v = cache.k[layer, :, :, :max_length], cache.v[layer, :, :, :max_length]  # [B, Hkv, S, dh] views
    qg = q.reshape(B, Hkv, H // Hkv, dh).to(k.dtype)  # [B, Hkv, G, dh]
    mask = None
    if mixed:  # rows shorter than max_length: hide their padding
        mask = (torch.arange(max_length, device=q.device) < lengths[:, None])[:, None, None, :]  # [B, 1, 1, S]
    return F.scaled_dot_product_attention(qg, k, v, attn_mask=mask).reshape(B, H, dh).to(q.dtype)


def chunked_decode_attention(q, cache, layer, lengths, max_length, mixed):
    """One query per sequence over its int8/fp8 cache row, in chunks with an online softmax.

    q [B, H, dh]; cache rows [B, Hkv, S_max, dh]; lengths int32 [B] (the new token included).
    Each chunk is upcast to fp32 just before use, so temporaries stay in CPU cache and memory
    traffic is about the compact cache bytes. Scales are applied to scores (K) and probabilities
    (V), as the Triton kernel does. Returns [B, H, dh] in q's dtype."""
    B, H, dh = q.shape
    Hkv = cache.spec.n_kv_heads
    qg = q.view(B, Hkv, H // Hkv, dh).float() * (1.0 / math.sqrt(dh))  # [B, Hkv, G, dh]
    m = torch.full((B, Hkv, H // Hkv, 1), float("-inf"), device=q.device)  # running max
    denom = torch.zeros_like(m)  # running sum of exp(s - m)
    acc = torch.zeros_like(qg)  # running unnormalised output
    chunk = max(64, DECODE_CHUNK_BYTES // (B * Hkv * dh * 4))
    _, v_scale = cache.layer_scales(layer)
    # Chunk 0 holds position 0, valid for every row, so m is finite after it: no NaN from -inf - -inf.
    for s0 in range(0, max_length, chunk):
        s1 = min(s0 + chunk, max_length)
        s = _chunk_scores(qg, cache, layer, s0, s1, lengths if mixed else None)  # [B, Hkv, G, T]
        m_new = torch.maximum(m, s.amax(-1, keepdim=True))
        p = torch.exp(s - m_new)
        alpha = torch.exp(m - m_new)
        denom = denom * alpha + p.sum(-1, keepdim=True)
        if cache.cache_dtype == "int8":
            p = p * v_scale[:, :, None, s0:s1]  # sum_n p_n (v_n s_n) = sum_n (p_n s_n) v_n
        acc = acc * alpha + p @ upcast(cache.v[layer, :, :, s0:s1])  # [B, Hkv, G, dh]
        m = m_new
    if cache.cache_dtype == "fp8":
        acc = acc * v_scale  # one per-tensor scale: apply it once at the end
    return (acc / denom).view(B, H, dh).to(q.dtype)


def _chunk_scores(qg, cache, layer, s0, s1, lengths=None):
    """Scores [B, Hkv, G, T] of qg [B, Hkv, G, dh] against cache positions s0 .. s1 - 1, K's
    scales applied; with `lengths` [B], positions at or past a row's length are -inf."""
    k_scale, _ = cache.layer_scales(layer)
    s = qg @ upcast(cache.k[layer, :, :, s0:s1]).transpose(-1, -2)
    if cache.cache_dtype == "int8":
        s = s * k_scale[:, :, None, s0:s1]  # (q . k_int8) * scale == q . (k_int8 * scale)
    elif cache.cache_dtype == "fp8":
        s = s * k_scale
    if lengths is not None:
        pad = torch.arange(s0, s1, device=qg.device) >= lengths[:, None]  # [B, T]
        s = s.masked_fill(pad[:, None, None, :], float("-inf"))
    return s


def upcast(x):
    """A cache chunk as fp32. fp8 e4m3 goes through its bits, because torch's CPU fp8 cast is
    scalar code, several times slower than this: shifting the 7 exponent-and-mantissa bits left
    by 7 gives the fp16 with the same value times 2**-8 (exponent bias 15 vs 7; e4m3's
    subnormals land on fp16 subnormals), exact for every finite code."""
    if x.dtype != torch.float8_e4m3fn:
        return x.float()
    s = x.view(torch.int8).to(torch.int16)  # sign-extended: bits 15 and 14 set when negative
    return ((s << 7) ^ (s & 0x4000)).view(torch.float16).float() * 256.0  # clear bit 14 again
