"""A Llama-architecture decoder with separate `prefill` and `decode_step`, so each phase is timed alone.

What it shows:
  * prefill runs the whole prompt through the layers at once (big matmuls, M = B * P rows) and
    returns logits for the LAST position only: the next token depends on the last position, and
    a V-wide head over all P positions would cost 2 * P * V * d FLOPs and P * V * 4 bytes for
    nothing (KERNEL counting in `roofline` charges the head once per sequence for that reason);
  * decode_step runs one token per sequence (matmuls with M = B rows) and reads every weight
    and the whole KV cache to do it;
  * the same model runs on CPU (torch) and CUDA (the lab's Triton kernels); the choice is made
    once, at construction, and each operation has one function that dispatches (`TorchOps`,
    `TritonOps`).

Weights are random, drawn from a seeded generator on the model's device (no downloads): a
forward pass's time depends on shapes and dtypes, not on the weights' values. Linear weights
have std 1/sqrt(fan_in) and the embedding std 1, so activations, and the K/V written to the
cache, stay O(1) in every layer as in a trained model — which matters for int8/fp8 caches.

Layer (pre-norm, as Llama): x += o(attn(rope(q(n(x))), rope(k(n(x))), v(n(x))));
x += down(silu(gate(n(x))) * up(n(x))). q/k/v are one fused matrix `wqkv` and gate/up one
`w_gate_up` (as gpt-fast and vLLM store them: one matmul reads the normed x once).

Shapes: tokens [B, P] int64; x [B, P, d]; q [B, H, P, dh]; k, v [B, Hkv, P, dh]; logits [B, V] fp32.

CPU decode speed (lab-cpu, fp32 weights, the lab's 2-core EPYC VM, whose bandwidth reads 11-22
GB/s with the neighbours' load). A step reads 63 MB of matmul weights, 50 MB of them the head,
plus the cache, in phases that run one after another. What keeps it below the bandwidth
(instrumented steps and A/B runs in one process, 2026-11-29):
  * B = 1, S = 0 (~5.5-6.3 ms): the head's 48 MiB gemv runs at about the read rate on both
    cores (~3 ms); the 16 layer products, 12 MiB whose weights arrive cold, at ~7 GB/s on one
    thread (~1.9 ms: splitting them over two threads was slower, the hand-offs cost more than
    they save); ~150 small numpy calls and the step's bookkeeping ~1 ms;
  * B = 2..16: OpenBLAS packs the weight for a few-row gemm, so the head streams at 5-10 GB/s
    whatever the threading (its own threads, column blocks on worker threads as `blas_matmul`
    does, and at B = 4 oneDNN's prepacked weights were within 10 % of each other); and
    the FLOPs (~B/2 per weight byte against a ridge of 5-9) take their own time, which the
    memory-bound phases (attention) cannot hide: the step is a sequence, not an overlap;
  * attention reads each (row, kv head)'s K and V, 0.25-2 MiB blocks, from cold memory at
    3-5 GB/s a thread, half the rate of one long stream;
  * a fixed cost of ~400 aten calls a step (views included; norms, RoPE, residuals, SDPA), 1-20 us
    each: why an fp32 model on the CPU decodes through `cpu_decode` (the same layers as numpy
    calls, 1.3-1.6x faster at B <= 4) and this file's loop runs for bf16 and the Triton ops;
  * a bf16 cache: this CPU has no bf16 instructions and torch's SDPA converts as it reads —
    3 GB/s against 9 GB/s for an fp32 cache (one layer, B = 1, S = 4096, on a busy machine).
"""
from __future__ import annotations

import math
import os

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from . import roofline
from .errors import LabError
from .kvcache import KVCache
from .specs import ModelSpec, get_model

COMPUTE_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
# CPU decode over an int8/fp8 cache: fp32 temporaries per chunk, sized to stay in L2/L3
# (1-2 MiB was fastest on a 2-core EPYC; 32 MiB chunks ran 3-6x slower).
DECODE_CHUNK_BYTES = 2 << 20


# ------------------------------------------------------------------ CPU matmuls: numpy's OpenBLAS
# A small product (a decode step's layer matrices on lab-cpu: 0.25-1.5 MiB, a few rows) runs on
# one thread: splitting a ~20 us product over two threads costs more in wake-ups than it saves,
# and on a busy 2-core machine a descheduled second thread stalled such calls for 4-16 ms (a
# scheduler tick). Larger weights (the 48 MiB head) need every core to stream at the memory's
# rate, and prefill's products (thousands of rows) every core's FLOPs.
SINGLE_THREAD_WEIGHT_BYTES = 4 << 20
SINGLE_THREAD_FLOPS = 1 << 24  # ~0.3 ms on one core


def _find_openblas_threads():
    """(set_threads, max_threads) for numpy's bundled OpenBLAS through ctypes, or None when this
    numpy has none (then OpenBLAS keeps its own thread count; results are the same)."""
    import ctypes
    import glob
    here = os.path.dirname(np.__file__)
    for path in glob.glob(here + ".libs/*openblas*") + glob.glob(os.path.join(here, ".dylibs", "*openblas*")):
        try:
            lib = ctypes.CDLL(path)
        except OSError:
            continue
        for prefix in ("scipy_openblas", "openblas"):
            for suffix in ("64_", ""):
                setter = getattr(lib, f"{prefix}_set_num_threads{suffix}", None)
                getter = getattr(lib, f"{prefix}_get_num_threads{suffix}", None)
                if setter is not None and getter is not None:
                    setter.argtypes = [ctypes.c_int]
                    return setter, int(getter())
    return None


class _BlasThreads:
    """Sets numpy's OpenBLAS thread count per product, calling into OpenBLAS only on a change."""

    def __init__(self):
        self.found = None  # (setter, max threads), looked up on first use; False if none
        self.current = None

    def use(self, threads: int | None):
        """`threads` for the next products; None = all that OpenBLAS started with."""
        if self.found is None:
            self.found = _find_openblas_threads() or False
            self.current = self.found[1] if self.found else None
        if self.found:
            want = self.found[1] if threads is None else min(threads, self.found[1])
            if want != self.current:
                self.found[0](want)
                self.current = want


BLAS_THREADS = _BlasThreads()


# A large weight times a few rows (the head in decode at B = 2..16): OpenBLAS's own threads ran
# it at 2-5 GB/s (its small-M gemm packs the whole weight). Column blocks of BLOCK_COLUMNS
# (4 MiB of a 256-row weight, in L3), shared out to one Python thread per core, each running
# single-threaded OpenBLAS (numpy releases the GIL), streamed it 1.5-2.5x faster here.
SPLIT_MAX_ROWS = 16
BLOCK_COLUMNS = 4096
CORES = os.cpu_count() or 1
_POOL = None


def on_every_core(run, parts: int):
    """run(0) .. run(parts - 1) at once: part 0 in the calling thread, the others on worker
    threads (numpy releases the GIL in BLAS and in ufuncs), each with single-threaded OpenBLAS;
    returns when all are done. The caller working instead of waiting saves one thread wake-up
    (B=1 decode steps 0-10 % faster, in one process with the two alternating, 2026-11-29)."""
    global _POOL
    from concurrent.futures import ThreadPoolExecutor
    if _POOL is None:
        _POOL = ThreadPoolExecutor(max(1, min(CORES, 8) - 1), thread_name_prefix="labkit-blas")
    BLAS_THREADS.use(1)
    others = [_POOL.submit(run, i) for i in range(1, parts)]
    run(0)
    for future in others:
        future.result()


def blas_matmul(a, b):
    """a [M, K] @ b [K, N] with numpy (OpenBLAS), fp32 arrays -> a new [M, N] array; one
    thread for a small product (see SINGLE_THREAD_WEIGHT_BYTES), all of them otherwise."""
    small = b.nbytes <= SINGLE_THREAD_WEIGHT_BYTES and 2 * a.shape[0] * b.size <= SINGLE_THREAD_FLOPS
    if small or a.shape[0] > SPLIT_MAX_ROWS or CORES < 2:
        BLAS_THREADS.use(1 if small else None)
        return np.matmul(a, b)
    return _split_columns(a, b)


def _split_columns(a, b):
    """a @ b with b's column blocks shared out to one worker thread per core."""
    workers = min(CORES, 8)
    out = np.empty((a.shape[0], b.shape[1]), dtype=np.result_type(a, b))
    starts = range(0, b.shape[1], BLOCK_COLUMNS)

    def run(first):  # blocks first, first + workers, ...: neighbours interleave, loads even out
        for j in starts[first::workers]:
            np.matmul(a, b[:, j:j + BLOCK_COLUMNS], out=out[:, j:j + BLOCK_COLUMNS])
    on_every_core(run, workers)
    return out


# ------------------------------------------------------------------ ops: one function per operation
class TorchOps:
    """CPU path: torch matmuls, SDPA for prefill, a chunked online-softmax decode attention."""

    name = "torch"

    @staticmethod
    def linear(x, w):
        """x [..., in] @ w[out, in].T -> [..., out]. On the CPU in fp32 the weights are stored
        [in, out]-contiguous (see `_param`) and multiplied by numpy's BLAS (OpenBLAS): torch's
        MKL runs decode-shaped matmuls (a few rows, a weight far beyond cache) at 2-5 GB/s on the
        lab's AMD CPUs, OpenBLAS at 7-15 GB/s. Same arithmetic, a faster library."""
        wt = w.t()  # [in, out], a view
        if x.dtype == torch.float32 and x.device.type == "cpu" and wt.is_contiguous():
            rows = x.reshape(-1, x.shape[-1]).contiguous()
            return torch.from_numpy(blas_matmul(rows.numpy(), wt.numpy())).view(*x.shape[:-1], w.shape[0])
        return F.linear(x, w)

    @staticmethod
    def prefill_attention(q, k, v):
        """q [B, H, P, dh] are the last P of S positions; k, v [B, Hkv, S, dh]."""
        P, S = q.shape[2], k.shape[2]
        if P == S:
            return F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
        # Chunked prefill: query i sits at position S - P + i. SDPA's is_causal aligns top-left.
        visible = torch.arange(S, device=q.device)[None, :] <= torch.arange(S - P, S, device=q.device)[:, None]
        return F.scaled_dot_product_attention(q, k, v, attn_mask=visible, enable_gqa=True)

    @staticmethod
    def decode_attention(q, cache, layer, lengths, max_length, mixed):
        """q [B, H, dh] over each row's first lengths[b] cached positions -> [B, H, dh]."""
        if cache.cache_dtype in ("int8", "fp8"):
            return chunked_decode_attention(q, cache, layer, lengths, max_length, mixed)
        return sdpa_decode_attention(q, cache, layer, lengths, max_length, mixed)


class TritonOps:
    """CUDA path (or the Triton interpreter in tests): the kernels in kernels/."""

    name = "triton"

    @staticmethod
    def linear(x, w):
        from kernels.matmul import matmul
        out = matmul(x.reshape(-1, x.shape[-1]), w.t())  # w.t() is a view: the kernel follows strides
        return out.view(*x.shape[:-1], w.shape[0])

    @staticmethod
    def prefill_attention(q, k, v):
        from kernels.flash_attention import flash_attention
        return flash_attention(q, k, v, causal=True)

    @staticmethod
    def decode_attention(q, cache, layer, lengths, max_length, mixed):
        from kernels.decode_attention import decode_attention
        k_scale, v_scale = cache.layer_scales(layer)
        # KVCache validates lengths on the host; checking them here would sync with the device
        # once per layer and step.
        return decode_attention(q, cache.k[layer], cache.v[layer], lengths, k_scale, v_scale,
                                check_lengths=False)


OPS = {"torch": TorchOps, "triton": TritonOps}


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
    scalar code (~0.2 GB/s here, 2-3x slower than this): shifting the 7 exponent-and-mantissa
    bits left by 7 gives the fp16 with the same value times 2**-8 (exponent bias 15 vs 7; e4m3's
    subnormals land on fp16 subnormals), exact for every finite code."""
    if x.dtype != torch.float8_e4m3fn:
        return x.float()
    s = x.view(torch.int8).to(torch.int16)  # sign-extended: bits 15 and 14 set when negative
    return ((s << 7) ^ (s & 0x4000)).view(torch.float16).float() * 256.0  # clear bit 14 again


# ------------------------------------------------------------------ small pieces
def rms_norm(x, weight, eps):
    """x / rms(x) * weight, computed in fp32 (as Llama does) and cast back. In fp32 this is
    torch's fused rms_norm: one op instead of six, which counts in a decode step of ~100 ops."""
    if x.dtype == torch.float32 and weight.dtype == torch.float32:
        return F.rms_norm(x, (x.shape[-1],), weight, eps)
    xf = x.float()
    return (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps) * weight.float()).to(x.dtype)


def rope_inverse_frequencies(head_dim, theta, device="cpu"):
    """theta ** (-2i / dh) for i < dh/2, fp32 [dh/2]: the rotation speed of each pair of dims."""
    return theta ** (-torch.arange(0, head_dim, 2, device=device, dtype=torch.float32) / head_dim)


def rope_angles(positions, head_dim, theta):
    """(cos, sin) of the rotary angles, once per forward pass and shared by every layer.

    positions [T] or [B, T] (absolute, int) -> cos, sin [T, 1, 2, dh/2] or [B, T, 1, 2, dh/2]
    in fp32, laid out for `apply_rope` on x [B, T, heads, dh] viewed as [B, T, heads, 2, dh/2]:
    cos is (cos, cos) and sin is (-sin, +sin) over the two halves."""
    inv_freq = rope_inverse_frequencies(head_dim, theta, positions.device)  # [dh/2]
    angles = positions.float()[..., None] * inv_freq  # [T, dh/2] or [B, T, dh/2]
    cos, sin = angles.cos()[..., None, None, :], angles.sin()[..., None, None, :]  # [.., T, 1, 1, dh/2]
    return torch.cat((cos, cos), dim=-2), torch.cat((-sin, sin), dim=-2)


def apply_rope(x, cos, sin):
    """Rotary embedding, Hugging Face Llama layout (pairs are (i, i + dh/2)), in fp32:
    (x1, x2) -> (x1 cos - x2 sin, x2 cos + x1 sin), i.e. x * (cos, cos) + swap(x) * (-sin, sin)
    with swap(x1, x2) = (x2, x1): three ops for q and k of every head at once.

    x [B, T, heads, dh]; cos, sin from `rope_angles`. Returns a new [B, T, heads, dh] tensor."""
    B, T, n, dh = x.shape
    halves = x.float().reshape(B, T, n, 2, dh // 2)
    out = torch.addcmul(halves * cos, halves.flip(-2), sin)
    return out.view(B, T, n, dh).to(x.dtype)


def _param(generator, shape, std, dtype, device, linear=True):
    """A [out, in] weight. On the CPU a linear weight is laid out [in, out]-contiguous (its
    transpose is contiguous) so a decode-shaped x @ w.T streams it in the order BLAS reads it."""
    w = torch.randn(shape, generator=generator, device=device, dtype=torch.float32) * std
    w = w.to(dtype)
    if linear and torch.device(device).type == "cpu":
        w = w.t().contiguous().t()
    return nn.Parameter(w, requires_grad=False)


class Layer(nn.Module):
    """One decoder layer's weights: norms [d], wqkv [H dh + 2 Hkv dh, d], wo [d, H dh],
    w_gate_up [2 ffn, d], w_down [d, ffn] (nn.Linear layout: [out, in])."""

    def __init__(self, spec, generator, dtype, device):
        super().__init__()
        d, f = spec.hidden_size, spec.intermediate_size
        ones = lambda: nn.Parameter(torch.ones(d, dtype=dtype, device=device), requires_grad=False)  # noqa: E731
        self.attn_norm, self.mlp_norm = ones(), ones()
        self.wqkv = _param(generator, (spec.q_dim + 2 * spec.kv_dim, d), d ** -0.5, dtype, device)
        self.wo = _param(generator, (d, spec.q_dim), spec.q_dim ** -0.5, dtype, device)
        self.w_gate_up = _param(generator, (2 * f, d), d ** -0.5, dtype, device)
        self.w_down = _param(generator, (d, f), f ** -0.5, dtype, device)


# ------------------------------------------------------------------ the model
class Llama(nn.Module):
    """A Llama decoder for `spec` with random weights and a KV cache for `batch` x `max_tokens`.

    device/compute_dtype default to `backend.choose_device()` (CPU: fp32, CUDA: bf16);
    `kernels` ("torch" | "triton") overrides the per-device choice (tests run the Triton path on
    CPU in the interpreter). The predicted footprint is checked before anything is allocated."""

    def __init__(self, spec: ModelSpec | str, batch: int = 1, max_tokens: int | None = None,
                 cache_dtype: str | None = None, device: str | None = None,
                 compute_dtype: str | None = None, kernels: str | None = None, seed: int = 0):
        super().__init__()
        from . import backend
        self.spec = spec = get_model(spec) if isinstance(spec, str) else spec
        self.backend = backend.choose_device(device)
        self.device = torch.device(self.backend.device)
        self.compute_dtype = compute_dtype or self.backend.compute_dtype
        if self.compute_dtype not in COMPUTE_DTYPES:
            raise LabError(f"compute dtype {self.compute_dtype!r} unknown; known: {', '.join(COMPUTE_DTYPES)}")
        kernels = kernels or ("triton" if self.device.type == "cuda" else "torch")
        if kernels not in OPS:
            raise LabError(f"kernels {kernels!r} unknown; known: {', '.join(OPS)}")
        self.ops = OPS[kernels]
        max_tokens = max_tokens or min(spec.max_context, 4096)
        cache_dtype = cache_dtype or self.compute_dtype
        backend.check_fits(roofline.memory_footprint_bytes(spec, batch, max_tokens, self.compute_dtype, cache_dtype),
                           self.device.type, f"{spec.name} in {self.compute_dtype} with a {cache_dtype} cache "
                           f"of {batch} x {max_tokens} tokens")
        self._init_weights(seed)
        self.cache = self._new_cache(batch, max_tokens, cache_dtype)
        from . import cpu_decode, graphed_decode
        lean, self._numpy_reason = cpu_decode.applies(self)
        self.numpy_decode = cpu_decode.NumpyDecode(self) if lean else None
        graphs, self._graph_reason = graphed_decode.applies(self)
        self.graphed_decode = graphed_decode.GraphedDecode(self) if graphs else None

    @property
    def decode_reason(self) -> str:
        """Why a decode step runs as it does: the numpy step's reason, else why not and what the
        CUDA graph does (captured, waiting for its first step, or off and why)."""
        if self.numpy_decode is not None:
            return self._numpy_reason
        graph = self.graphed_decode.reason if self.graphed_decode is not None else self._graph_reason
        return f"{self._numpy_reason}; {graph}"

    @property
    def decode_kernels(self) -> str:
        """What runs a decode step: "numpy" (CPU, fp32; see `cpu_decode`), else the ops' name,
        with "+graph" once the step runs as a replayed CUDA graph (`graphed_decode`)."""
        if self.numpy_decode is not None:
            return "numpy"
        graphed = self.graphed_decode is not None and self.graphed_decode.graph is not None
        return self.ops.name + ("+graph" if graphed else "")

    def _init_weights(self, seed):
        spec, dtype, device = self.spec, COMPUTE_DTYPES[self.compute_dtype], self.device
        g = torch.Generator(device=device).manual_seed(seed)
        self.embed = _param(g, (spec.vocab_size, spec.hidden_size), 1.0, dtype, device,
                            linear=spec.tie_embeddings)  # [V, d]
        self.layers = nn.ModuleList(Layer(spec, g, dtype, device) for _ in range(spec.n_layers))
        self.norm = nn.Parameter(torch.ones(spec.hidden_size, dtype=dtype, device=device), requires_grad=False)
        if not spec.tie_embeddings:  # tied: the head *is* the embedding table, counted once
            self.head = _param(g, (spec.vocab_size, spec.hidden_size), spec.hidden_size ** -0.5, dtype, device)

    @property
    def head_weight(self):
        """The output head [V, d] (the embedding table when tied)."""
        return self.embed if self.spec.tie_embeddings else self.head

    def _new_cache(self, batch, max_tokens, cache_dtype):
        return KVCache(self.spec, batch, max_tokens, cache_dtype, self.device,
                       use_triton=self.ops is TritonOps, check=False)

    def setup_cache(self, batch: int, max_tokens: int, cache_dtype: str | None = None,
                    prefill_tokens: int | None = None) -> KVCache:
        """Replace the cache. Checked before anything is freed or allocated: the footprint (its
        activations for `prefill_tokens` per sequence, default max_tokens) less the weights
        (already resident) and less the old cache (freed first); if it does not fit,
        FootprintError and the old cache stays."""
        from . import backend
        cache_dtype = cache_dtype or self.compute_dtype
        need = (roofline.memory_footprint_bytes(self.spec, batch, max_tokens, self.compute_dtype, cache_dtype,
                                                prefill_tokens)
                - roofline.weight_bytes(self.spec, self.compute_dtype)
                - (self.cache.nbytes() if self.cache is not None else 0))
        backend.check_fits(need, self.device.type, f"a {cache_dtype} KV cache of {batch} x {max_tokens} "
                           f"tokens for {self.spec.name}")
        self.release_cache()  # free the old buffers before allocating the new ones
        self.cache = self._new_cache(batch, max_tokens, cache_dtype)
        return self.cache

    def release_cache(self):
        """Drop the KV cache, and the CUDA graph that points into it, so that its memory counts
        as free (`setup_cache` makes a new one)."""
        self.cache = None
        if self.graphed_decode is not None:
            self.graphed_decode.release()
        if self.device.type == "cuda":
            torch.cuda.empty_cache()

    # -------------------------------------------------------------- shared pieces of a layer
    def _qkv(self, layer, x, rope):
        """x [B, T, d] -> q [B, H, T, dh], k, v [B, Hkv, T, dh] (views), with RoPE (cos, sin)
        applied to q and k together."""
        s, (B, T, _) = self.spec, x.shape
        qkv = self.ops.linear(rms_norm(x, layer.attn_norm, s.norm_eps), layer.wqkv)  # [B, T, q + 2 kv]
        heads = qkv.view(B, T, s.n_heads + 2 * s.n_kv_heads, s.head_dim)
        qk = apply_rope(heads[:, :, :s.n_heads + s.n_kv_heads], *rope)  # [B, T, H + Hkv, dh]
        q, k = qk.transpose(1, 2).split([s.n_heads, s.n_kv_heads], dim=1)
        return q, k, heads[:, :, s.n_heads + s.n_kv_heads:].transpose(1, 2)

    def _finish_layer(self, layer, x, attn):
        """x [B, T, d], attn [B, H, T, dh] -> o projection + residual, then the SwiGLU block."""
        B, T, _ = x.shape
        x = x + self.ops.linear(attn.transpose(1, 2).reshape(B, T, -1), layer.wo)
        gate_up = self.ops.linear(rms_norm(x, layer.mlp_norm, self.spec.norm_eps), layer.w_gate_up)
        gate, up = gate_up.chunk(2, dim=-1)  # [B, T, ffn] each
        return x + self.ops.linear(F.silu(gate) * up, layer.w_down)

    def _logits(self, x_last):
        """x_last [B, d] -> fp32 logits [B, V]: final norm, then the head."""
        return self.ops.linear(rms_norm(x_last, self.norm, self.spec.norm_eps), self.head_weight).float()

    def _tokens(self, tokens):
        return torch.as_tensor(tokens, dtype=torch.long).to(self.device)

    # -------------------------------------------------------------- prefill
    @torch.inference_mode()
    def prefill(self, tokens, start: int = 0) -> torch.Tensor:
        """Run prompts tokens [B, P] (B = the cache's batch) through the model, filling cache
        positions start .. start + P - 1 of every row; start > 0 appends a chunk to rows that
        hold at least `start` tokens (chunked prefill). Returns the last position's logits [B, V]."""
        tokens = self._tokens(tokens)
        if tokens.dim() != 2 or tokens.shape[0] != self.cache.batch:
            raise LabError(f"prefill wants tokens [B, P] with B = {self.cache.batch} (the cache's batch); "
                           f"got shape {tuple(tokens.shape)} — use prefill_slot for one sequence")
        return self._prefill(tokens, start, slice(None))

    @torch.inference_mode()
    def prefill_slot(self, slot: int, tokens, start: int = 0) -> torch.Tensor:
        """Prefill one sequence tokens [P] (or [1, P]) into row `slot` of the batched cache, the
        other rows untouched (continuous batching). Returns its last position's logits [V]."""
        if not 0 <= slot < self.cache.batch:
            raise LabError(f"slot {slot} outside the cache's 0 .. {self.cache.batch - 1}")
        tokens = self._tokens(tokens).reshape(1, -1)
        return self._prefill(tokens, start, slice(slot, slot + 1))[0]

    def _prefill(self, tokens, start, rows):
        B, P = tokens.shape
        self._check_prefill(P, start, rows)
        positions = torch.arange(start, start + P, device=self.device)  # [P] absolute
        rope = rope_angles(positions, self.spec.head_dim, self.spec.rope_theta)
        x = F.embedding(tokens, self.embed)  # [B, P, d]
        for i, layer in enumerate(self.layers):
            q, k, v = self._qkv(layer, x, rope)
            self.cache.update(i, k, v, start, rows)
            if start:  # attend to the cached prefix too: read it back, dequantised
                k, v = self.cache.read(i, start + P, rows, dtype=x.dtype)
            x = self._finish_layer(layer, x, self.ops.prefill_attention(q, k, v))
        self.cache.set_lengths(start + P, rows)
        return self._logits(x[:, -1])  # only the last position: see the module docstring

    def _check_prefill(self, P, start, rows):
        if P < 1 or start < 0 or start + P > self.cache.max_tokens:
            raise LabError(f"prefill of {P} tokens after {start} does not fit a cache of "
                           f"{self.cache.max_tokens} positions (and needs P >= 1)")
        short = [n for n in self.cache.host_lengths[rows] if n < start]
        if start and short:
            raise LabError(f"chunked prefill from position {start}, but a row holds only {min(short)} tokens")

    # -------------------------------------------------------------- decode
    @torch.inference_mode()
    def decode_step(self, tokens) -> torch.Tensor:
        """Append one token per sequence, tokens [B] (or [B, 1]); returns logits [B, V].

        Every row is computed (static shapes); active rows (length > 0) advance by one, free rows
        (after `reset_sequence`) give throwaway logits and stay free."""
        cache = self.cache
        tokens = self._tokens(tokens).reshape(-1)
        self._check_decode(tokens)
        # Where each row's new token goes. The host mirror decides the shape of the work, so the
        # step never waits for the device: equal lengths (static batching, the sweeps) write one
        # slice at a host-known position; mixed lengths scatter by the device lengths [B].
        ends = [n + 1 for n in cache.host_lengths]
        mixed = len(set(ends)) > 1
        positions = cache.lengths if mixed else cache.host_lengths[0]
        if self.numpy_decode is not None:  # CPU, fp32: the same layers as numpy calls (cpu_decode)
            logits = self.numpy_decode.decode(tokens, positions, max(ends), mixed)
        else:  # CUDA: one replay of the captured step when it can (graphed_decode), else eagerly
            logits = self.graphed_decode.step(tokens) if self.graphed_decode is not None else None
            if logits is None:
                logits = self._decode_layers(tokens, positions, cache.lengths + 1, max(ends), mixed)
        cache.advance()
        return logits

    def _decode_layers(self, tokens, positions, attend, max_length: int, mixed: bool) -> torch.Tensor:
        """The decode step's arithmetic: tokens [B] -> logits [B, V], writing each row's K/V at
        `positions` (an int for all rows, or a device tensor [B]) and attending over `attend` [B]
        keys, at most `max_length`. `mixed`: positions is a tensor. Bookkeeping is the caller's."""
        cache = self.cache
        where = positions[:, None] if mixed else torch.arange(positions, positions + 1, device=self.device)
        rope = rope_angles(where, self.spec.head_dim, self.spec.rope_theta)
        x = F.embedding(tokens[:, None], self.embed)  # [B, 1, d]
        for i, layer in enumerate(self.layers):
            q, k, v = self._qkv(layer, x, rope)
            cache.update(i, k, v, positions)
            o = self.ops.decode_attention(q[:, :, 0], cache, i, attend, max_length, mixed)
            x = self._finish_layer(layer, x, o[:, :, None])
        return self._logits(x[:, 0])

    def _check_decode(self, tokens):
        cache = self.cache
        if tokens.shape[0] != cache.batch:
            raise LabError(f"decode_step wants one token per row: {cache.batch} tokens, got {tokens.shape[0]}")
        if not any(cache.active):
            raise LabError("decode_step with no active sequence: prefill first")
        if max(cache.host_lengths) >= cache.max_tokens:
            raise LabError(f"the KV cache is full ({cache.max_tokens} positions); make a larger one "
                           "with setup_cache")

    def reset_sequence(self, slot: int):
        """Free row `slot` of the cache for a new request (continuous batching)."""
        self.cache.reset_sequence(slot)
