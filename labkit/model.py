"""A Llama-architecture decoder with separate `prefill` and `decode_step`, so each phase is timed alone.

What it shows:
  * prefill runs the whole prompt through the layers at once (big matmuls, M = B * P rows) and
    returns logits for the LAST position only: the next token depends on the last position, and
    a V-wide head over all P positions would cost 2 * P * V * d FLOPs and P * V * 4 bytes for
    nothing (KERNEL counting in `roofline` charges the head once per sequence for that reason);
  * decode_step runs one token per sequence (matmuls with M = B rows) and reads every weight
    and the whole KV cache to do it;
  * both work on a KV cache they are given (`kvcache.KVCache`; the model keeps one as a default),
    so one model's weights can serve several caches.

Weights are random, drawn from a seeded generator on the model's device (no downloads): a
forward pass's time depends on shapes and dtypes, not on the weights' values. Linear weights
have std 1/sqrt(fan_in) and the embedding std 1, so activations, and the K/V written to the
cache, stay O(1) in every layer as in a trained model — which matters for int8/fp8 caches.

Layer (pre-norm, as Llama): x += o(attn(rope(q(n(x))), rope(k(n(x))), v(n(x))));
x += down(silu(gate(n(x))) * up(n(x))). q/k/v are one fused matrix `wqkv` and gate/up one
`w_gate_up` (as gpt-fast and vLLM store them: one matmul reads the normed x once).

What runs each operation is chosen once, at construction: `ops` (torch on the CPU, the lab's
Triton kernels on CUDA) and `decode_paths` (how a decode step is issued: the CPU step on a CPU in
fp32, a replayed CUDA graph on CUDA, else this file's `decode_layers`); on CUDA a prefill that a
timing loop repeats is replayed as a CUDA graph too (`graphed_prefill`, else `prefill_layers`). Issued as torch calls, a
CPU decode step stays below the memory's bandwidth for fixed costs — hundreds of small calls, a
few-row product's packing of the weight at every call, a compact cache widened before it is read
— which is why the CPU step (`cpu_decode`, with `cpu_linear` and `cpu_kernels`) exists.

Shapes: tokens [B, P] int64; x [B, P, d]; q [B, H, P, dh]; k, v [B, Hkv, P, dh]; logits [B, V] fp32.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from . import backend, cpu_memory, roofline
from .clock import OFF
from .decode_paths import choose_decode_path
from .dtypes import COMPUTE_DTYPES, torch_dtype, with_article
from .errors import LabError
from .graphed_prefill import GraphedPrefill
from .kvcache import DecodePlan, KVCache, cache_footprint_bytes
from .layer_math import rope_angles, rope_inverse_frequencies
from .ops import TritonOps, choose_ops
from .specs import ModelSpec, get_model

# How much a CPU prefill's memory (its process's resident set) grows, over the activations
# `roofline.activation_bytes` counts: the heap keeps what each layer frees (`cpu_memory`), and a
# freed block serves only requests that fit it. Measured on lab-cpu, the peak growth of one prefill
# in a fresh process after a P = 256 one, 2-core EPYC VM (Zen 5), glibc 2.36: 2.4x at P = 1,024,
# 3.1x at 2,048, 3.3x at 4,096, 3.2x at 8,192; 3.5 leaves a margin over the most seen.
CPU_PREFILL_GROWTH = 3.5


# ------------------------------------------------------------------ the layer's weights
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
def check_weights_fit(spec: ModelSpec, dtype: str, device: str):
    """Refuse a model whose weights alone do not fit `device`, saying so: no batch or context
    makes a model smaller than its weights (the whole footprint's message said to lower them)."""
    backend.check_fits(roofline.weight_bytes(spec, dtype), device, f"{spec.name} (its weights alone, in {dtype})",
                       "choose a smaller model (python -m labkit models)")


class Llama(nn.Module):
    """A Llama decoder for `spec` with random weights and a KV cache for `batch` x `max_tokens`.

    device/compute_dtype default to `backend.choose_device()` (CPU: fp32, CUDA: bf16);
    `kernels` ("torch" | "triton") overrides the per-device choice (tests run the Triton path on
    CPU in the interpreter). The predicted footprint is checked before anything is allocated.
    `cache` is the default KV cache of `prefill` and `decode_step`; `decode_path` says how a
    decode step runs (`.name`) and why (`.reason`). `clock` is the timer hook `labkit.breakdown`
    sets to time the parts of a step (`labkit.clock`; OFF, the default, times nothing)."""

    def __init__(self, spec: ModelSpec | str, batch: int = 1, max_tokens: int | None = None,
                 cache_dtype: str | None = None, device: str | None = None,
                 compute_dtype: str | None = None, kernels: str | None = None, seed: int = 0):
        super().__init__()
        self.spec = spec = get_model(spec) if isinstance(spec, str) else spec
        self.backend = backend.choose_device(device)
        self.device = torch.device(self.backend.device)
        self.compute_dtype = compute_dtype or self.backend.compute_dtype
        dtype = torch_dtype(self.compute_dtype, COMPUTE_DTYPES)
        self.ops = choose_ops(kernels, self.device)
        # On the CPU a prefill's megabyte tensors reuse freed memory instead of faulting pages in
        self.memory_setting = cpu_memory.keep_freed_memory() if self.device.type == "cpu" else None
        max_tokens = max_tokens or min(spec.max_context, 4096)
        cache_dtype = cache_dtype or self.compute_dtype
        check_weights_fit(spec, self.compute_dtype, self.device.type)
        backend.check_fits(roofline.memory_footprint_bytes(spec, batch, max_tokens, self.compute_dtype, cache_dtype),
                           self.device.type, f"{spec.name} in {self.compute_dtype} with {with_article(cache_dtype)} cache "
                           f"of {batch} x {max_tokens} tokens")
        self._init_weights(seed, dtype)
        self.cache = self.make_cache(batch, max_tokens, cache_dtype, check=False)  # checked above
        self.decode_path = choose_decode_path(self)
        self.prefill_graph = GraphedPrefill(self)
        self.clock = OFF

    def _init_weights(self, seed, dtype):
        spec, device = self.spec, self.device
        g = torch.Generator(device=device).manual_seed(seed)
        self.embed = _param(g, (spec.vocab_size, spec.hidden_size), 1.0, dtype, device,
                            linear=spec.tie_embeddings)  # [V, d]
        self.layers = nn.ModuleList(Layer(spec, g, dtype, device) for _ in range(spec.n_layers))
        self.norm = nn.Parameter(torch.ones(spec.hidden_size, dtype=dtype, device=device), requires_grad=False)
        if not spec.tie_embeddings:  # tied: the head *is* the embedding table, counted once
            self.head = _param(g, (spec.vocab_size, spec.hidden_size), spec.hidden_size ** -0.5, dtype, device)
        self.rope_inv_freq = rope_inverse_frequencies(spec.head_dim, spec.rope_theta, device)  # [dh/2] fp32

    @property
    def head_weight(self):
        """The output head [V, d] (the embedding table when tied)."""
        return self.embed if self.spec.tie_embeddings else self.head

    # -------------------------------------------------------------- caches
    def make_cache(self, batch: int, max_tokens: int, cache_dtype: str | None = None,
                   check: bool = True) -> KVCache:
        """A new KV cache for this model (default dtype: the compute dtype), refused before
        allocating if its bytes do not fit (`check`); the model's own `cache` is left alone."""
        return KVCache(self.spec, batch, max_tokens, cache_dtype or self.compute_dtype, self.device,
                       use_triton=self.ops is TritonOps, check=check)

    def setup_cache(self, batch: int, max_tokens: int, cache_dtype: str | None = None,
                    prefill_tokens: int | None = None) -> KVCache:
        """Replace the default cache. Checked before anything is freed or allocated: the footprint
        (its activations for `prefill_tokens` per sequence, default max_tokens) less the weights
        (already resident) and less the old cache (freed first); if it does not fit,
        FootprintError and the old cache stays."""
        cache_dtype = cache_dtype or self.compute_dtype
        self.check_cache(batch, max_tokens, cache_dtype, prefill_tokens)
        self.release_cache()  # free the old buffers before allocating the new ones
        self.cache = self.make_cache(batch, max_tokens, cache_dtype, check=False)  # checked above
        return self.cache

    def check_cache(self, batch: int, max_tokens: int, cache_dtype: str | None = None,
                    prefill_tokens: int | None = None) -> None:
        """`setup_cache`'s check, allocating nothing: FootprintError unless the footprint (less the
        resident weights and the old cache, which `setup_cache` frees first) fits."""
        cache_dtype = cache_dtype or self.compute_dtype
        need = (cache_footprint_bytes(self.spec, batch, max_tokens, cache_dtype)
                + self.prefill_bytes(batch, max_tokens if prefill_tokens is None else prefill_tokens)
                - (self.cache.nbytes() if self.cache is not None else 0))
        backend.check_fits(need, self.device.type, f"{with_article(cache_dtype)} KV cache of {batch} x {max_tokens} "
                           f"tokens for {self.spec.name}")

    def prefill_bytes(self, batch: int, prefill_tokens: int) -> int:
        """The memory a prefill of `batch` x `prefill_tokens` tokens takes beside the weights and
        the cache: its activations and the last positions' logits (`roofline.memory_footprint_bytes`'s
        terms), the activations times CPU_PREFILL_GROWTH on the CPU."""
        growth = CPU_PREFILL_GROWTH if self.device.type == "cpu" else 1
        return int(growth * roofline.activation_bytes(self.spec, prefill_tokens, batch, self.compute_dtype)
                   + roofline.logits_bytes(self.spec, batch))

    def check_prefill(self, batch: int, prefill_tokens: int) -> None:
        """FootprintError unless a prefill's `prefill_bytes` fit beside what is already resident:
        for a prefill into a cache that is already big enough (`sweeps.ensure_cache`)."""
        backend.check_fits(self.prefill_bytes(batch, prefill_tokens), self.device.type,
                           f"a prefill of {batch} x {prefill_tokens:,} tokens of {self.spec.name} (its activations)")

    def release_cache(self):
        """Drop the default KV cache, and a CUDA graph that points into a cache, so that its memory
        counts as free (`setup_cache` makes a new one)."""
        self.cache = None
        self.decode_path.release()
        self.prefill_graph.release()
        if self.device.type == "cuda":
            torch.cuda.empty_cache()

    def reset_sequence(self, slot: int, cache: KVCache | None = None):
        """Free row `slot` of the cache for a new request (continuous batching)."""
        self._cache(cache).reset_sequence(slot)

    def _cache(self, cache: KVCache | None) -> KVCache:
        """`cache`, or the model's default one."""
        cache = self.cache if cache is None else cache
        if not isinstance(cache, KVCache):
            raise LabError(f"expected a KVCache (make one with make_cache or setup_cache), got {cache!r}")
        return cache

    # -------------------------------------------------------------- shared pieces of a layer
    # Each operation runs inside a part of `self.clock` (the breakdown's timer hook; OFF times
    # nothing): "products" the weight matrices, "attention", "other" everything else.
    def _add_norm(self, x, delta, weight):
        """(x + delta, its RMSNorm by `weight`): a residual add and the norm after it, one op
        (one kernel on the Triton path). delta None: (x, the norm of x)."""
        with self.clock.time("other"):
            return self.ops.add_rms_norm(x, delta, weight, self.spec.norm_eps)

    def _finish_layer(self, layer, x, attn, next_norm):
        """x [B, T, d], attn [B, H, T, dh] -> o projection + residual, then the SwiGLU block, then
        (x, x normed by `next_norm`: the next layer's attention norm or the final norm), or
        (x, None) where next_norm is None."""
        (B, T, _), clock = x.shape, self.clock
        with clock.time("other"):
            heads = attn.transpose(1, 2).reshape(B, T, -1)  # [B, T, H dh]
        with clock.time("products"):
            o = self.ops.linear(heads, layer.wo)
        x, normed = self._add_norm(x, o, layer.mlp_norm)
        with clock.time("products"):
            gate_up = self.ops.linear(normed, layer.w_gate_up)  # [B, T, 2 ffn]: gate, then up
        with clock.time("other"):
            gated = self.ops.swiglu(gate_up)  # [B, T, ffn]
        with clock.time("products"):
            down = self.ops.linear(gated, layer.w_down)
        if next_norm is None:
            with clock.time("other"):
                return x + down, None
        return self._add_norm(x, down, next_norm)

    def _next_norm(self, i):
        """The norm that follows layer i's last residual add: layer i + 1's attention norm, or the
        final norm after the last layer."""
        return self.layers[i + 1].attn_norm if i + 1 < len(self.layers) else self.norm

    def _logits(self, x_last):
        """x_last [B, d] -> fp32 logits [B, V]: final norm, then the head."""
        _, normed = self._add_norm(x_last, None, self.norm)
        return self._head(normed)

    def _head(self, normed):
        """normed [B, d] (after the final norm) -> fp32 logits [B, V]."""
        with self.clock.time("products"):
            return self.ops.linear(normed, self.head_weight).float()

    def _tokens(self, tokens):
        if isinstance(tokens, torch.Tensor) and tokens.dtype == torch.long and tokens.device == self.device:
            return tokens  # what as_tensor and .to would return, without their two dispatches (decode's ~20 us)
        return torch.as_tensor(tokens, dtype=torch.long).to(self.device)

    # -------------------------------------------------------------- prefill
    @torch.inference_mode()
    def prefill(self, tokens, cache: KVCache | None = None, *, start: int = 0) -> torch.Tensor:
        """Run prompts tokens [B, P] (B = the cache's batch) through the model, filling positions
        start .. start + P - 1 of every row of `cache` (default: the model's); start > 0 appends
        a chunk to rows that hold at least `start` tokens (chunked prefill). Returns the last
        position's logits [B, V]."""
        cache, tokens = self._cache(cache), self._tokens(tokens)
        if tokens.dim() != 2 or tokens.shape[0] != cache.batch:
            raise LabError(f"prefill wants tokens [B, P] with B = {cache.batch} (the cache's batch); "
                           f"got shape {tuple(tokens.shape)} — use prefill_slot for one sequence")
        return self._prefill(tokens, cache, start, slice(None))

    @torch.inference_mode()
    def prefill_slot(self, slot: int, tokens, cache: KVCache | None = None, *, start: int = 0) -> torch.Tensor:
        """Prefill one sequence tokens [P] (or [1, P]) into row `slot` of a batched cache, the
        other rows untouched (continuous batching). Returns its last position's logits [V]."""
        cache = self._cache(cache)
        if not 0 <= slot < cache.batch:
            raise LabError(f"slot {slot} outside the cache's 0 .. {cache.batch - 1}")
        tokens = self._tokens(tokens).reshape(1, -1)
        return self._prefill(tokens, cache, start, slice(slot, slot + 1))[0]

    def _prefill(self, tokens, cache, start, rows):
        """`prefill_layers` (by replay where `prefill_graph` has it), then the rows' new lengths."""
        P = tokens.shape[1]
        _check_prefill(cache, P, start, rows)
        logits = self.prefill_graph.run(tokens, cache, start, rows)
        if logits is None:
            logits = self.prefill_layers(tokens, cache, start, rows)
        cache.set_lengths(start + P, rows)
        return logits

    def prefill_layers(self, tokens, cache: KVCache, start: int, rows: slice) -> torch.Tensor:
        """The prefill's arithmetic, layer by layer with `ops`: tokens [b, P] -> the last position's
        logits [b, V], writing positions start .. start + P - 1 of cache rows `rows` (and reading
        back the cached prefix when start > 0). The lengths are the caller's to set (`_prefill`;
        `graphed_prefill` captures this)."""
        P, clock = tokens.shape[1], self.clock
        with clock.time("other"):
            positions = torch.arange(start, start + P, device=self.device)  # [P] absolute
            rope = rope_angles(positions, self.rope_inv_freq)
            x = F.embedding(tokens, self.embed)  # [B, P, d]
        x, normed = self._add_norm(x, None, self.layers[0].attn_norm)
        for i, layer in enumerate(self.layers):
            with clock.time("products"):
                qkv = self.ops.linear(normed, layer.wqkv)  # [b, P, q + 2 kv]
            with clock.time("other"):  # RoPE on q and k, k and v into the cache: one kernel on Triton's path
                q, k, v = self.ops.rope_and_store_prefill(qkv, rope, cache, i, start, rows)
            with clock.time("attention"):
                if start:  # attend to the cached prefix too: read it back, dequantised
                    k, v = cache.read(i, start + P, rows, dtype=x.dtype)
                attn = self.ops.prefill_attention(q, k, v)
            last = i + 1 == len(self.layers)  # then the final norm, of the last position only (_logits)
            x, normed = self._finish_layer(layer, x, attn, None if last else self._next_norm(i))
        return self._logits(x[:, -1])  # only the last position: see the module docstring

    # -------------------------------------------------------------- decode
    @torch.inference_mode()
    def decode_step(self, tokens, cache: KVCache | None = None) -> torch.Tensor:
        """Append one token per sequence, tokens [B] (or [B, 1]), to `cache` (default: the
        model's); returns logits [B, V].

        Every row is computed (static shapes); active rows (length > 0) advance by one, free rows
        (after `reset_sequence`) give throwaway logits and stay free. The arithmetic runs on
        `decode_path` (numpy calls, a CUDA graph or `decode_layers`), the bookkeeping here."""
        cache, tokens = self._cache(cache), self._tokens(tokens)
        tokens = tokens if tokens.dim() == 1 else tokens.reshape(-1)
        _check_decode(cache, tokens)
        logits = self.decode_path.step(tokens, cache, cache.decode_plan())
        cache.advance()
        return logits

    def decode_layers(self, tokens, cache: KVCache, plan: DecodePlan) -> torch.Tensor:
        """The decode step's arithmetic, layer by layer with `ops`: tokens [B] -> logits [B, V],
        writing each row's K/V into `cache` at `plan.positions` and attending over each row's
        length + 1 keys, at most `plan.max_length`. The lengths are the caller's to advance
        (`decode_step`; `graphed_decode` captures this with a plan of device numbers only)."""
        (positions, max_length, mixed), clock = plan, self.clock
        with clock.time("other"):
            where = positions[:, None] if mixed else torch.arange(positions, positions + 1, device=self.device)
            rope = rope_angles(where, self.rope_inv_freq)
            attend = cache.lengths + 1  # [B] keys each query sees, the new one included
            x = F.embedding(tokens[:, None], self.embed)  # [B, 1, d]
        x, normed = self._add_norm(x, None, self.layers[0].attn_norm)
        for i, layer in enumerate(self.layers):
            with clock.time("products"):
                qkv = self.ops.linear(normed, layer.wqkv)  # [B, 1, q + 2 kv]
            with clock.time("other"):  # RoPE on q and k, k and v into the cache: one kernel on Triton's path
                q = self.ops.rope_and_store(qkv, rope, cache, i, positions)  # [B, H, dh]
            with clock.time("attention"):
                o = self.ops.decode_attention(q, cache, i, attend, max_length, mixed)
            x, normed = self._finish_layer(layer, x, o[:, :, None], self._next_norm(i))
        return self._head(normed[:, 0])


def _check_prefill(cache: KVCache, P: int, start: int, rows):
    if P < 1 or start < 0 or start + P > cache.max_tokens:
        raise LabError(f"prefill of {P} tokens after {start} does not fit a cache of "
                       f"{cache.max_tokens} positions (and needs P >= 1)")
    short = [n for n in cache.host_lengths[rows] if n < start]
    if start and short:
        raise LabError(f"chunked prefill from position {start}, but a row holds only {min(short)} tokens")


def _check_decode(cache: KVCache, tokens):
    if tokens.shape[0] != cache.batch:
        raise LabError(f"decode_step wants one token per row: {cache.batch} tokens, got {tokens.shape[0]}")
    if not any(cache.active):
        raise LabError("decode_step with no active sequence: prefill first")
    if max(cache.host_lengths) >= cache.max_tokens:
        raise LabError(f"the KV cache is full ({cache.max_tokens} positions); make a larger one "
                       "with setup_cache")
