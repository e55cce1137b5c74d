"""The KV cache: preallocated K and V buffers that decode reads in full at every step.

What it shows:
  * every token leaves K and V behind in every layer, 2 * L * Hkv * dh values, so the cache
    grows by `roofline.kv_bytes_per_token` per token and sequence — `used_bytes()` measures that
    growth on the real buffers (the tests tie the two together);
  * storing the cache in fewer bytes (int8, fp8) shrinks what each decode step must read.
    int8 keeps one fp32 scale per token per kv head (absmax / 127); fp8 e4m3 keeps one fixed
    fp32 scale per layer for K and for V, 1.0 here — real engines calibrate it on sample data.
    The Triton path quantises with kernels/kv_quant.py's kernel, the CPU path with its torch
    reference beside it, which imports without Triton (none on macOS or Windows);
  * buffers are allocated once for `max_tokens` positions (as gpt-fast and vLLM do), so decode
    never reallocates; `lengths` says how much of each row is in use.

A model's `prefill` and `decode_step` take the cache they work on (the model keeps one as a
default), so two caches can share one model's weights: a stream of decoding users and a long
prompt's own, as `interference` runs them.

Shapes: k, v [L, B, Hkv, S_max, dh]; int8 scales [L, B, Hkv, S_max] fp32; fp8 scales [L] fp32;
lengths int32 [B] on the device, mirrored on the host (`host_lengths`) so that bookkeeping
never waits for the device.
"""
from __future__ import annotations

import math
from typing import NamedTuple

import numpy as np
import torch

from . import backend, roofline
from .dtypes import CACHE_DTYPES, torch_dtype, with_article
from .errors import LabError
from .specs import ModelSpec

FLOAT_DTYPES = ("fp32", "bf16", "fp16")  # stored as they are; the others are quantised


def cache_footprint_bytes(spec: ModelSpec, batch: int, max_tokens: int, cache_dtype: str) -> int:
    """What the constructor is about to allocate: the formula's cache bytes for `max_tokens`
    positions per sequence (the per-layer fp8 scales, 8 bytes a layer, are not counted)."""
    return roofline.kv_cache_bytes(spec, max_tokens, batch, cache_dtype)


class DecodePlan(NamedTuple):
    """Where one decode step writes each row's new token and how far it attends.

    positions   an int: every row writes at this position (equal lengths: one slice copy);
                or an int32 tensor [B] on the device: row b writes at positions[b] (mixed)
    max_length  the longest row after the step: attention reads at most this many positions
    mixed       rows hold different numbers of tokens (positions is then a tensor)"""

    positions: int | torch.Tensor
    max_length: int
    mixed: bool


class KVCache:
    """Preallocated K/V buffers for `batch` sequences of up to `max_tokens` positions."""

    def __init__(self, spec: ModelSpec, batch: int, max_tokens: int, cache_dtype: str = "bf16",
                 device="cpu", use_triton: bool | None = None, check: bool = True):
        dtype = torch_dtype(cache_dtype, CACHE_DTYPES)  # refuses an unknown name, listing the known
        if batch < 1 or max_tokens < 1:
            raise LabError(f"a KV cache needs batch >= 1 and max_tokens >= 1, got {batch}, {max_tokens}")
        device = torch.device(device)
        if check:  # refuse before allocating anything
            backend.check_fits(cache_footprint_bytes(spec, batch, max_tokens, cache_dtype), device.type,
                               f"{with_article(cache_dtype)} KV cache of {batch} x {max_tokens} tokens for {spec.name}")
        self.spec, self.batch, self.max_tokens, self.cache_dtype = spec, batch, max_tokens, cache_dtype
        self.device = device
        self.use_triton = device.type == "cuda" if use_triton is None else use_triton
        shape = (spec.n_layers, batch, spec.n_kv_heads, max_tokens, spec.head_dim)
        self.k, self.v = _zeros(shape, dtype, device), _zeros(shape, dtype, device)
        self.k_scale = self.v_scale = None
        if cache_dtype == "int8":  # one scale per (layer, sequence, kv head, position)
            self.k_scale = torch.zeros(shape[:-1], dtype=torch.float32, device=device)
            self.v_scale = torch.zeros(shape[:-1], dtype=torch.float32, device=device)
        elif cache_dtype == "fp8":  # one fixed scale per layer; [layer] is the 0-dim view kernels want
            self.k_scale = torch.ones(spec.n_layers, dtype=torch.float32, device=device)
            self.v_scale = torch.ones(spec.n_layers, dtype=torch.float32, device=device)
        self.lengths = torch.zeros(batch, dtype=torch.int32, device=device)
        self._steps = torch.zeros(batch, dtype=torch.int32, device=device)  # 1 per active row: advance()
        # On the CPU, numpy views of both: after a decode step has streamed the weights and the cache
        # through the CPU's caches, one torch add took ~30-90 us (its dispatch code evicted), numpy's
        # fewer instructions less (see `advance`)
        self._numpy = (self.lengths.numpy(), self._steps.numpy()) if self.lengths.device.type == "cpu" else None
        self._rows = torch.arange(batch, device=device)  # row indices for decode's scattered writes
        # What a decode path derives from this cache once and reuses every step (the CPU step's
        # numpy views of its buffers); it lives and dies with the cache
        self.memo: dict = {}
        self.host_lengths = [0] * batch
        self.active = [False] * batch
        self.filled_tokens = 0  # positions holding `fill_random` values (decode timing)

    # ------------------------------------------------------------ writing
    def update(self, layer: int, k: torch.Tensor, v: torch.Tensor, positions, rows=slice(None)):
        """Quantise and store new keys/values k, v [b, Hkv, T, dh] for cache rows `rows`.

        `positions` an int: all rows write positions positions .. positions + T - 1 (prefill,
        and decode when every row holds the same number of tokens: one slice copy).
        `positions` an int tensor [b]: row i writes its one token (T = 1) at positions[i] (decode,
        where sequences have different lengths)."""
        for buf, scales, new in ((self.k, self.k_scale, k), (self.v, self.v_scale, v)):
            scale = scales[layer] if self.cache_dtype == "fp8" else None
            q, row_scale = _quantize(new, self.cache_dtype, scale, self.use_triton)
            if isinstance(positions, int):
                end = positions + new.shape[2]
                buf[layer, rows, :, positions:end] = q
                if self.cache_dtype == "int8":
                    scales[layer, rows, :, positions:end] = row_scale
            else:  # advanced indexing: [b] rows x [b] positions -> [b, Hkv, dh]
                index, where = self._rows[rows], positions.long()
                buf[layer][index, :, where] = q[:, :, 0]
                if self.cache_dtype == "int8":
                    scales[layer][index, :, where] = row_scale[:, :, 0]

    def set_lengths(self, lengths, rows=slice(None), active: bool | None = None):
        """Set how many positions rows hold (an int for all of `rows`, or a list). A row is
        active (decode_step advances it) if `active`, or by default if its length is > 0.
        Host and device copies are set together."""
        index = range(self.batch)[rows]
        values = [lengths] * len(index) if isinstance(lengths, int) else list(lengths)
        was_active = list(self.active)
        for i, n in zip(index, values):
            if not 0 <= n <= self.max_tokens:
                raise LabError(f"length {n} outside the cache's 0 .. {self.max_tokens} positions")
            self.host_lengths[i], self.active[i] = int(n), n > 0 if active is None else active
        if isinstance(lengths, int) and len(index) == self.batch:  # no host-to-device copy: cheap in a timed loop
            if self._numpy is not None:
                self._numpy[0].fill(lengths)
            else:
                self.lengths.fill_(lengths)
        else:
            self.lengths.copy_(torch.tensor(self.host_lengths, dtype=torch.int32))
        if self.active != was_active:  # rarely: a sequence starts or ends
            self._steps.copy_(torch.tensor(self.active, dtype=torch.int32))

    def advance(self):
        """Count one decoded token in every active row (free rows stay at 0). Device work only:
        no host-to-device copy, so a decode step never waits for the device here."""
        if self._numpy is not None:
            lengths, steps = self._numpy
            np.add(lengths, 1 if all(self.active) else steps, out=lengths)
        else:
            self.lengths += 1 if all(self.active) else self._steps
        self.host_lengths = [n + a for n, a in zip(self.host_lengths, self.active)]

    def decode_plan(self) -> DecodePlan:
        """The next decode step's plan, from the host mirror of the lengths only, so the step never
        waits for the device: equal lengths (static batching, the sweeps) write one slice at a
        host-known position; mixed lengths scatter by the device lengths [B]."""
        ends = [n + 1 for n in self.host_lengths]
        mixed = len(set(ends)) > 1
        return DecodePlan(self.lengths if mixed else self.host_lengths[0], max(ends), mixed)

    def reset_sequence(self, row: int):
        """Free slot `row` for a new request (continuous batching). Old values stay but are unread."""
        self.set_lengths(0, slice(row, row + 1))

    def fill_random(self, length: int, seed: int = 0, block_bytes: int = 64 << 20):
        """Make every row hold `length` positions of random O(1) K/V, as a prefill would leave
        them, without running one (a decode step's time depends on how much it reads, not on
        the values). Per layer, one random block (at most `block_bytes` of fp32, at most 256
        positions) is quantised and tiled along the sequence: about one pass over the cache."""
        g = torch.Generator(device=self.device).manual_seed(seed)
        L, B, Hkv, _, dh = self.k.shape
        block = max(1, min(256, length, block_bytes // (B * Hkv * dh * 4)))
        reps, rest = divmod(length, block)
        for layer in range(L if length else 0):
            for buf, scales in ((self.k, self.k_scale), (self.v, self.v_scale)):
                x = torch.randn((B, Hkv, block, dh), generator=g, device=self.device)
                q, row_scale = _quantize(x, self.cache_dtype, None, self.use_triton)  # fp8: scale 1
                _tile(buf[layer], q, reps, rest)  # [B, Hkv, S_max, dh] <- [B, Hkv, block, dh]
                if self.cache_dtype == "int8":
                    _tile(scales[layer, ..., None], row_scale[..., None], reps, rest)
        self.set_lengths(length)
        self.filled_tokens = length

    # ------------------------------------------------------------ reading
    def read(self, layer: int, end: int, rows=slice(None), dtype=torch.float32):
        """Dequantised K, V [b, Hkv, end, dh] in `dtype`: positions 0 .. end - 1 (chunked prefill)."""
        out = []
        for buf, scales in ((self.k, self.k_scale), (self.v, self.v_scale)):
            x = buf[layer, rows, :, :end]
            if self.cache_dtype == "int8":
                x = x.to(dtype) * scales[layer, rows, :, :end, None].to(dtype)
            elif self.cache_dtype == "fp8":
                x = x.to(dtype) * scales[layer].to(dtype)
            out.append(x.to(dtype))
        return out

    def tensors(self) -> tuple:
        """Every device tensor a decode step reads or writes, None for absent scales (a captured
        CUDA graph bakes in their addresses: `graphed_decode` keys its graph on them)."""
        return (self.k, self.v, self.k_scale, self.v_scale, self.lengths, self._rows)

    def layer_scales(self, layer: int):
        """(k_scale, v_scale) for `layer` as decode_attention wants them (None for float caches)."""
        if self.k_scale is None:
            return None, None
        return self.k_scale[layer], self.v_scale[layer]

    # ------------------------------------------------------------ bytes
    def bytes_per_token(self) -> int:
        """Bytes one position of one sequence occupies, from the real buffers' shapes and element
        sizes: K and V for every layer and kv head, plus int8's per-token scales."""
        values = 2 * self.k[:, 0, :, 0].numel() * self.k.element_size()
        if self.cache_dtype != "int8":
            return values
        return values + 2 * self.k_scale[:, 0, :, 0].numel() * self.k_scale.element_size()

    def used_bytes(self) -> int:
        """Bytes holding live tokens: sum of lengths x bytes_per_token (what decode reads)."""
        return sum(self.host_lengths) * self.bytes_per_token()

    def nbytes(self) -> int:
        """Everything allocated: values plus scales (int8 per token, fp8 per layer), the lengths
        and the per-row steps `advance` adds."""
        tensors = [self.k, self.v, self.k_scale, self.v_scale, self.lengths, self._steps]
        return sum(t.numel() * t.element_size() for t in tensors if t is not None)


def _zeros(shape, dtype, device) -> torch.Tensor:
    """torch.zeros(shape, dtype, device), on the CPU from numpy's allocator: numpy asks the kernel
    for 2 MiB pages (transparent huge pages) for arrays of 4 MiB and more, torch's allocator does not
    by default, and a decode step streams its whole cache, with a TLB miss every 4 KiB on small
    pages. Only the cache: asking for them for every tensor (torch's THP_MEM_ALLOC_ENABLE=1) slowed
    prefill, which allocates its activations afresh each pass (P = 1,024 / 2,048: 44-54 / 116-187
    ms against 43-48 / 109-121, 3 alternating processes). Whole decode steps with the cache from
    numpy against from torch, 4 alternating processes on the 2-core Xeon VM, B = 16, S = 4,096:
    bf16 8.88-9.42 ms against 9.79-10.25, int8 6.22-6.81 against 6.57-7.04."""
    if device.type != "cpu":
        return torch.zeros(shape, dtype=dtype, device=device)
    nbytes = math.prod(shape) * dtype.itemsize
    return torch.from_numpy(np.zeros(nbytes, np.uint8)).view(dtype).view(shape)


def _quantize(x, cache_dtype, scale, use_triton):
    """kernels.kv_quant's kernel where the cache runs the Triton path (CUDA, or the interpreter in
    tests); its torch reference elsewhere, which needs no triton (none on macOS, Windows)."""
    if cache_dtype in FLOAT_DTYPES:
        return x.to(torch_dtype(cache_dtype)), None
    # On first use, as `ops.TritonOps` imports kernels: kv_quant imports triton where it is
    # installed, which reads TRITON_INTERPRET once, and importing labkit.model must not fix it early.
    from kernels.kv_quant import quantize_kv, quantize_kv_reference
    if not use_triton:
        return quantize_kv_reference(x, cache_dtype, scale)
    return quantize_kv(x, cache_dtype, scale, use_triton=True)


def _tile(dst, block, reps, rest):
    """dst[:, :, :reps * T + rest] = block [B, Hkv, T, D] repeated along positions (one copy op)."""
    B, Hkv, T, D = block.shape
    dst[:, :, :reps * T].view(B, Hkv, reps, T, D).copy_(block[:, :, None].expand(B, Hkv, reps, T, D))
    dst[:, :, reps * T:reps * T + rest] = block[:, :, :rest]
