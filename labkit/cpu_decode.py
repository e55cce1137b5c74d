"""The CPU decode step: the same layers as `model.Llama.decode_layers`, with fewer, cheaper calls,
each weight read once for all B rows and the cache read as stored.

Why it exists: a decode step of the lab's CPU model is 17 small products and ~200 elementwise
operations on vectors of a few hundred numbers. Issued as torch calls, dispatch and thread
wake-ups are a large part of a small step; as plain BLAS calls, every few-row product first
copies (packs) its whole weight; and a compact cache widened to fp32 before attention is read
more than once. So here:

  * elementwise work runs as numba's fused kernels (`cpu_kernels.rms_norm`, `rotate_in_place`,
    `swiglu`: one call where numpy makes 4-8), or as numpy calls without numba (far cheaper per
    call than torch's; they are the fused kernels' references);
  * the 17 products run on weights prepared once (`cpu_linear`: numba's panel product wherever
    there is AVX-512 or AVX2, up to 32 rows on Intel's CPUs and 64 on AMD's; past them, and without,
    MKL's packed weights on an Intel CPU, elsewhere numba's few-row kernels with oneDNN's packed
    weights from 8 rows; numpy's BLAS without numba), so the step reads each weight once whatever
    B is, as the roofline counts;
  * attention is `cpu_kernels.decode_attention` on the cache's own buffers for every cache dtype
    and for rows of different lengths: fp32, bf16, fp8 or int8 read as stored and widened in
    registers, as the GPU kernels do, so a step reads the bytes `roofline.kv_bytes_per_token`
    counts. Without numba, the earlier attentions stay (`_attention`, and the model's torch
    attention for a compact cache or mixed lengths).

Nothing is copied from the model but what `cpu_linear` prepares: the elementwise weights are
numpy views of the model's tensors. At equal lengths the step writes the cache itself through
numpy views of its buffers: fp32 as is, int8 quantised by `cpu_kernels.store_int8` (without numba
`quantize_int8`, the kernels' reference in numpy), bf16, fp16 and fp8 rounded by
`cpu_kernels.store_rounded` (without numba `store_converted`, one converting torch copy each, fp8
scaled and clamped first as the reference does), all bit for bit; at mixed lengths through
`KVCache.update` (which quantises).
Where every product is the panel product, attention is numba's and the lengths are equal, the
whole step runs as one numba call instead (`cpu_step.decode_step`: the same kernels and cache
writes, bit for bit (within 1e-5 where an fp8 layer scale is not a power of two: the attention is
compiled with fastmath, whose choice among equal forms of its scaling can differ between the two
builds; tests/test_cpu_step.py), without the ~40 trips through Python whose code the streamed weights and cache
had evicted; B = 1 at S = 1,024 1.53 ms against 1.65-1.84, B = 4 1.79 against 1.94-2.02, three
alternating processes on the 2-core Xeon VM). The breakdown's clocks keep the separate calls.
`tests/test_model.py` holds this step to the torch step for every cache dtype, both kinds of
lengths, and each forced choice of products and attention; `tests/test_cpu_step.py` the one call
to the separate calls.

Shapes: tokens [B]; x [B, d]; qkv [B, H + 2 Hkv, dh]; K, V [B, Hkv, S, dh]; logits [B, V] fp32.
"""
from __future__ import annotations

import numpy as np
import torch

from . import cpu_kernels, cpu_linear, cpu_step
from .clock import OFF
from .cpu_blas import CORES, MAX_WORKERS, on_every_core
from .errors import LabError

INT8_MAX = np.float32(127)  # as kernels.kv_quant.INT8_MAX: the symmetric int8 range [-127, 127]
FP8_MAX = np.float32(448)  # as kernels.kv_quant.FP8_MAX: float8_e4m3fn's largest finite value

# K+V one layer of a step reads from which every core attends: numba's kernel hands over through
# numba's pool (~10-20 us), numpy's through a Python pool (50-65 us), so numpy's needs more work to pay.
ATTENTION_SPLIT_MIN_BYTES = 256 << 10
NUMPY_ATTENTION_SPLIT_MIN_BYTES = 2 << 20
ATTENTIONS = ("numba", "numpy")
# How a cache's buffers reach the numba kernel: numpy has no bf16 or fp8, so those go as their bits.
# (torch view, numpy view) of the buffers: bf16 as uint16 bits, fp16 as int16 bits, fp8 as uint8 bits.
AS_STORED = {"fp32": (torch.float32, np.float32), "bf16": (torch.int16, np.uint16),
             "fp16": (torch.int16, np.int16), "fp8": (torch.uint8, np.uint8), "int8": (torch.int8, np.int8)}
NO_SCALES = np.ones((1, 1, 1, 1), np.float32)  # [L, B, Hkv, S] stand-in for a cache without per-token scales


def applies(model) -> tuple[bool, str]:
    """(use this step?, why): only for fp32 on the CPU with the torch ops (numpy has no bf16,
    and the Triton path is what the CUDA model and the interpreter tests run)."""
    if model.device.type != "cpu":
        return False, "not on the CPU"
    if model.compute_dtype != "fp32":
        return False, f"compute dtype {model.compute_dtype} (the CPU step is fp32)"
    if model.ops.name != "torch":
        return False, f"{model.ops.name} kernels asked for"
    return True, "CPU, fp32"


class CpuDecode:
    """A decode path (see `decode_paths`) for a CPU fp32 `Llama`: `step(tokens, cache, plan)` runs
    the layers as numpy and numba calls, products prepared by `cpu_linear`, attention and the
    elementwise work by `cpu_kernels`.

    `linear` ("mkl" | "onednn" | "numba" | "blas") and `attention` ("numba" | "numpy": the
    attention's and the elementwise work's kernels) force a choice (tests compare each with the
    torch step); by default the fastest that applies here."""

    def __init__(self, model, reason: str = "CPU, fp32", linear: str | None = None,
                 attention: str | None = None):
        self.model = model
        view = lambda w: w.detach().numpy()  # noqa: E731 — shares memory with the model's tensor
        # the 17 products: per layer wqkv, wo, w_gate_up, w_down; then the head
        weights = [w for L in model.layers for w in (L.wqkv, L.wo, L.w_gate_up, L.w_down)] + [model.head_weight]
        self.products = cpu_linear.prepare(weights, linear)
        self._out_features = [w.shape[0] for w in weights]
        self.norms = [(view(L.attn_norm), view(L.mlp_norm)) for L in model.layers]  # [d] each
        self.embed, self.norm = view(model.embed), view(model.norm)  # [V, d], [d]
        # the torch step's own fp32 frequencies, so the angles match it bit for bit
        self.inv_freq = model.rope_inv_freq.numpy()  # [dh/2]
        attention = attention or ("numba" if cpu_kernels.AVAILABLE else "numpy")
        if attention not in ATTENTIONS or (attention == "numba" and not cpu_kernels.AVAILABLE):
            raise LabError(f"attention {attention!r} unavailable: known {', '.join(ATTENTIONS)}"
                           + ("" if cpu_kernels.AVAILABLE else "; numba is not installed"))
        self.attention = attention
        # The elementwise work follows the attention's kernels: numba's fused forms (one call each
        # where numpy makes 4-8), or the numpy forms, which are their references. Fastest of 40
        # steps, 6 alternating rounds in one process, 2-core Xeon VM, S = 1,024: B = 1 3.22 against
        # 3.52 ms, B = 16 10.2 against 10.6 ms (at B = 4 within the noise).
        eps, fused = np.float32(model.spec.norm_eps), attention == "numba"
        self._eps, self._norm_tuples = eps, tuple(tuple(n[j] for n in self.norms) for j in (0, 1))
        rms = cpu_kernels.rms_norm if fused else rms_norm
        self.rms = lambda x, weight: rms(x, weight, eps)  # noqa: E731
        self.rotate, self.gating = (_rotate_in_place, cpu_kernels.swiglu) if fused else (self._rotate, _swiglu)
        self.store_int8 = cpu_kernels.store_int8 if fused else store_int8
        self.store_rounded = cpu_kernels.store_rounded if fused else None  # else `store_converted`
        self._panels_at: dict = {}  # batch size -> the panels `cpu_step` multiplies by, or None
        no_rows = np.empty((0, 1, model.spec.head_dim), np.float32)
        self._rope_table = (no_rows, no_rows)  # (cos, sin) [T, 1, dh]: `_rope_rows`
        pair = (self.products.name, attention)
        self.name = {("blas", "numpy"): "numpy", ("numba", "numba"): "numba"}.get(pair, "+".join(pair))
        self.reason = (f"{reason}: products by {self.products.reason}; attention by "
                       + ("numba's kernel over the cache as stored" if attention == "numba"
                          else "numpy (fp32, equal lengths) or torch (numba not installed)"))
        if attention == "numba" and getattr(self.products, "panels_enabled", False):
            self.reason += ("; where every product is the panel product, at equal lengths, the whole step as one "
                            "numba call (cpu_step)")

    def release(self):
        """Nothing to drop: the step holds no state tied to a cache."""

    def step(self, tokens, cache, plan) -> torch.Tensor:
        """tokens [B] -> logits [B, V] fp32, writing each row's K/V into `cache` as `plan` says
        (`KVCache.decode_plan`); the cache's lengths are the caller's to advance."""
        spec = self.model.spec
        positions, max_length, mixed = plan
        B, H, Hkv, dh = tokens.shape[0], spec.n_heads, spec.n_kv_heads, spec.head_dim
        panels = self._fused_panels(B, cache, mixed)
        if panels is not None:
            return self._fused_step(tokens, cache, positions, max_length, panels)
        # ---- the breakdown's timer hook (`labkit.clock`): each call below is timed as a part of its
        # category when `model.clock` is a Clock; the default, OFF, returns every function as it is.
        part = self.model.clock
        mm = part.timed("products", self.products)
        attend = part.timed("attention", self._reader(cache, mixed, max_length))
        rms, rotate, rope = (part.timed("other", f) for f in (self.rms, self.rotate, self._rope_rows))
        add, gating = part.timed("other", np.add), part.timed("other", self.gating)
        # ----
        at = cache.lengths.numpy() if mixed else np.array([positions])  # [B] or [1] new positions
        cos, sin = rope(at)  # [B or 1, 1, dh], from the table `_rope_rows` keeps
        # At equal lengths the cache is written here: fp32 and int8 through numpy views of its buffers
        # [L, B, Hkv, T, dh] (and int8's scales [L, B, Hkv, T]), bf16, fp16 and fp8 through its
        # as-stored views by numba's rounding store (the one-call step's), without numba by one torch
        # copy each that converts as it stores (fp8 after the reference's scale and clamp, in numpy);
        # mixed lengths through KVCache.update. Why: update's ~8 torch calls a layer for K and V
        # cost ~45 us (bf16) to ~90 us (fp8) a layer at B = 16, these ~10 us.
        write_here = not mixed
        as_numpy = write_here and cache.cache_dtype in ("fp32", "int8")
        rounded = write_here and self.store_rounded is not None and cache.cache_dtype in cpu_kernels.ROUNDED_STORES
        K_all, V_all, KS_all, VS_all = _as_stored(cache) if as_numpy or rounded else (cache.k, cache.v, None, None)
        int8 = write_here and cache.cache_dtype == "int8"
        fp8 = write_here and cache.cache_dtype == "fp8"
        # fp8's per-layer inverse scales [L], as the reference takes them: scale.reciprocal()
        K_inv, V_inv = (cache.k_scale.reciprocal().numpy(), cache.v_scale.reciprocal().numpy()) if fp8 else (None, None)
        with part.time("other"):
            x = self.embed[tokens.numpy()]  # [B, d]
        with self.products.threads():
            for i, (attn_norm, mlp_norm) in enumerate(self.norms):
                qkv = mm(4 * i, rms(x, attn_norm)).reshape(B, H + 2 * Hkv, dh)
                qk = rotate(qkv[:, :H + Hkv], cos, sin)  # [B, H + Hkv, dh], RoPE on q and k at once
                with part.time("other"):
                    if int8:  # [B, Hkv, dh] each into [B, Hkv, T, dh] codes and [B, Hkv, T] scales
                        self.store_int8(qk[:, H:], K_all[i], KS_all[i], positions)
                        self.store_int8(qkv[:, H + Hkv:], V_all[i], VS_all[i], positions)
                    elif as_numpy:
                        K_all[i, :, :, positions], V_all[i, :, :, positions] = qk[:, H:], qkv[:, H + Hkv:]
                    elif rounded:  # bf16, fp16, fp8 [B, Hkv, dh] each, by numba
                        code, one = cpu_kernels.ROUNDED_STORES[cache.cache_dtype], np.float32(1)
                        self.store_rounded(qk[:, H:], K_all[i], positions, code, K_inv[i] if fp8 else one)
                        self.store_rounded(qkv[:, H + Hkv:], V_all[i], positions, code, V_inv[i] if fp8 else one)
                    elif write_here:  # bf16, fp16, fp8 [B, Hkv, dh] each, without numba
                        store_converted(K_all[i, :, :, positions], qk[:, H:], K_inv[i] if fp8 else None)
                        store_converted(V_all[i, :, :, positions], qkv[:, H + Hkv:], V_inv[i] if fp8 else None)
                    else:
                        k, v = torch.from_numpy(qk[:, H:, None]), torch.from_numpy(qkv[:, H + Hkv:, None])  # [B, Hkv, 1, dh]
                        cache.update(i, k, v, positions)
                o = attend(i, qk[:, :H])  # [B, H, dh]
                x = add(x, mm(4 * i + 1, o.reshape(B, H * dh)))
                gate_up = mm(4 * i + 2, rms(x, mlp_norm))  # [B, 2 ffn]: gate, then up
                x = add(x, mm(4 * i + 3, gating(gate_up)))
            return torch.from_numpy(mm(4 * len(self.norms), rms(x, self.norm)))

    def _fused_panels(self, B, cache, mixed):
        """The 17 products' panels where `cpu_step.decode_step` takes this step (see its module
        docstring), else None: numba's attention, equal lengths, a cache dtype it writes, every
        product the panel product at B rows with whole panels of outputs, and the model's clock
        OFF (the breakdown's clocks, `Clock` and `CALL_BY_CALL`, ask for separate calls)."""
        if (self.attention != "numba" or mixed or self.model.clock is not OFF
                or cache.cache_dtype not in cpu_step.STORES):
            return None
        if B not in self._panels_at:  # asked once per batch size: the panels never change
            all_panels = getattr(self.products, "all_panels", None)
            panels = all_panels(B) if all_panels is not None else None
            # the one call adds and splits the products' outputs as they come, every column real:
            # a weight whose outputs are not whole panels of 16 keeps the separate calls (they slice)
            whole = panels is not None and all(p.shape[0] * cpu_kernels.PANEL_COLUMNS == n
                                               for p, n in zip(panels, self._out_features))
            self._panels_at[B] = panels if whole else None
        return self._panels_at[B]

    def _fused_step(self, tokens, cache, position, max_length, panels):
        """`step` as one call of `cpu_step.decode_step` -> logits [B, V] fp32. What does not change
        between steps is made once: the cache's views (in `cache.memo`), the rotary table, the
        model's constants. Why: this Python runs with its code evicted by the last step's streams,
        ~150 us at B = 1 when every step rebuilt them (a tenth of the step)."""
        spec, B = self.model.spec, tokens.shape[0]
        views = cache.memo.get("cpu_step")
        if views is None:
            views = cache.memo["cpu_step"] = self._fused_views(cache)
        K_all = views[0]
        attention_parts = _attention_parts(B * spec.n_kv_heads,
                                           2 * B * max_length * spec.n_kv_heads * spec.head_dim * K_all.itemsize)
        cos, sin = self._rope_rows(position)
        step = cpu_kernels.PANEL_TILE_ROWS[-1]
        # contiguous (no copy where it is already): a strided view of tokens (a column of a [B, T]
        # tensor) is another type to numba, and the whole step compiled again for it (3.3 s, lab-tiny
        # on the 2-core EPYC VM)
        logits = cpu_step.run_step(np.ascontiguousarray(tokens.numpy()), position, max_length, cos, sin, *views,
                                   panels, self.embed, self._norm_tuples[0], self._norm_tuples[1], self.norm, self._eps,
                                   (spec.n_heads, spec.n_kv_heads), np.float32(spec.head_dim ** -0.5),
                                   min(CORES, MAX_WORKERS), attention_parts, -(-B // step) * step)
        if logits.shape != (B, spec.vocab_size):  # padded rows or columns to drop
            logits = logits[:B, :spec.vocab_size]
        return torch.from_numpy(logits)

    def _fused_views(self, cache):
        """(K, V, k_scales, v_scales, k_all, v_all, store code) of `cache` for `cpu_step.decode_step`:
        `_as_stored`'s views, fp8's per-layer scales [L] (views, so a scale set later is seen; ones
        for the others) and how the step writes this dtype (`cpu_step.STORES`)."""
        ones = np.ones(self.model.spec.n_layers, np.float32)
        k_all, v_all = ((cache.k_scale.numpy(), cache.v_scale.numpy()) if cache.cache_dtype == "fp8"
                        else (ones, ones))
        return (*_as_stored(cache), k_all, v_all, cpu_step.STORES[cache.cache_dtype])

    def _rope_rows(self, positions):
        """(cos, sin) [n, 1, dh] for positions [n] (an int: n = 1, views), rows of a table of
        `_rope` made once for every position up to the largest asked (doubling as it grows)."""
        one = isinstance(positions, (int, np.integer))
        rows = slice(positions, positions + 1) if one else positions
        top = (positions if one else int(np.max(positions))) + 1
        if top > self._rope_table[0].shape[0]:
            self._rope_table = self._rope(np.arange(max(top, 2 * self._rope_table[0].shape[0], 1024)))
        cos, sin = self._rope_table
        return cos[rows], sin[rows]

    def _reader(self, cache, mixed, max_length):
        """attend(layer, q [B, H, dh]) -> [B, H, dh] over each row's cached keys and the new one."""
        if self.attention == "numba":
            return self._numba_reader(cache, mixed, max_length)
        if not mixed and cache.cache_dtype == "fp32":
            K_all, V_all = cache.k.numpy(), cache.v.numpy()
            return lambda i, q: self._attention(q, K_all[i, :, :, :max_length], V_all[i, :, :, :max_length])
        lengths = cache.lengths + 1  # [B] keys each query sees, the new one included
        return lambda i, q: self.model.ops.decode_attention(torch.from_numpy(q), cache, i, lengths, max_length,
                                                            mixed).numpy()

    def _numba_reader(self, cache, mixed, max_length):
        """`cpu_kernels.decode_attention` on numpy views of the cache's buffers, as stored."""
        K_all, V_all, k_scales, v_scales = _as_stored(cache)
        per_token = cache.cache_dtype == "int8"
        per_layer = cache.cache_dtype == "fp8"  # one scale per layer for K and for V
        lengths = (cache.lengths.numpy() + 1 if mixed  # [B] keys each row sees, the new one included
                   else np.full(cache.batch, max_length, np.int32))
        spec = self.model.spec
        G, scale = spec.n_heads // spec.n_kv_heads, np.float32(spec.head_dim ** -0.5)

        units = cache.batch * spec.n_kv_heads  # the kernel's tasks: one (row, kv head) each
        parts = _attention_parts(units, 2 * int(lengths.sum()) * spec.n_kv_heads * spec.head_dim * K_all.itemsize)

        def attend(i, q):
            B, H, dh = q.shape
            qg = (q * scale).reshape(B, H // G, G, dh)  # [B, Hkv, G, dh], pre-scaled
            out = np.empty_like(qg)
            k_all = np.float32(cache.k_scale[i]) if per_layer else np.float32(1)
            v_all = np.float32(cache.v_scale[i]) if per_layer else np.float32(1)
            layer = i if per_token else 0
            args = (qg, K_all[i], V_all[i], per_token, k_scales[layer], v_scales[layer], k_all, v_all, lengths, out)
            if parts == 1:
                cpu_kernels.decode_attention(*args, 0, units)
            else:  # a large cache: every core attends for a share of the units, on numba's pool
                cpu_kernels.decode_attention_on_cores(*args, parts)  # (as the products: one pool, no contention)
            return out.reshape(B, H, dh)
        return attend

    def _rope(self, positions):
        """(cos, sin) [n, 1, dh] for positions [n], laid out as `layer_math.rope_angles`: (cos, cos) and
        (-sin, +sin) over the two halves."""
        angles = positions.astype(np.float32)[:, None] * self.inv_freq  # [n, dh/2]
        cos, sin = np.cos(angles), np.sin(angles)
        return (np.concatenate((cos, cos), axis=-1)[:, None],
                np.concatenate((-sin, sin), axis=-1)[:, None])

    @staticmethod
    def _rotate(x, cos, sin):
        """Rotary embedding, Hugging Face layout: x * (cos, cos) + swap(x) * (-sin, sin), where
        swap exchanges the two halves of the head dimension. x [B, n, dh] -> a new array."""
        half = x.shape[-1] // 2
        return x * cos + np.concatenate((x[..., half:], x[..., :half]), axis=-1) * sin

    def _attention(self, q, K, V):
        """q [B, H, dh] over K, V [B, Hkv, S, dh] (views of an fp32 cache) -> [B, H, dh].

        The work is B * Hkv independent (row, kv head) units, each the G = H / Hkv queries that
        share one kv head. Over a large cache (a layer's K + V >= NUMPY_ATTENTION_SPLIT_MIN_BYTES) the
        units are shared out to every core: numpy loops over stacked products on one thread, and
        one thread reads memory at a fraction of what all cores can. Below it, one thread: the
        hand-off costs more."""
        B, H, dh = q.shape
        Hkv, S = K.shape[1], K.shape[2]
        n, G = B * Hkv, H // Hkv
        # [n, ...] views: rows and kv heads merge because a row's kv heads are adjacent in the cache
        qu, Ku, Vu = q.reshape(n, G, dh), K.reshape(n, S, dh), V.reshape(n, S, dh)
        out = np.empty_like(q)
        ou = out.reshape(n, G, dh)
        if K.nbytes + V.nbytes < NUMPY_ATTENTION_SPLIT_MIN_BYTES or CORES < 2 or n < 2:
            _attend(qu, Ku, Vu, ou)
            return out
        parts = min(n, CORES)
        units = [slice(n * p // parts, n * (p + 1) // parts) for p in range(parts)]
        on_every_core(lambda p: _attend(qu[units[p]], Ku[units[p]], Vu[units[p]], ou[units[p]]), parts)
        return out


def _as_stored(cache):
    """(K, V, k_scales, v_scales) of `cache` for numba's attention: numpy views of its buffers
    [L, B, Hkv, T, dh] as stored (`AS_STORED`), int8's per-token scales [L, B, Hkv, T] (else
    `NO_SCALES`, unread). Made once per cache (`KVCache.memo`): the attention reader, the
    call-by-call step's cache writes and the one-call step all take them every step."""
    stored = cache.memo.get("as_stored")
    if stored is None:
        as_torch, as_numpy = AS_STORED[cache.cache_dtype]
        K_all, V_all = (t.view(as_torch).numpy().view(as_numpy) for t in (cache.k, cache.v))
        scales = (cache.k_scale.numpy(), cache.v_scale.numpy()) if cache.cache_dtype == "int8" else (NO_SCALES, NO_SCALES)
        stored = cache.memo["as_stored"] = (K_all, V_all, *scales)
    return stored


def _attention_parts(units: int, read_bytes: int) -> int:
    """How many cores numba's attention shares a layer's `units` (row, kv head) tasks among: one
    below ATTENTION_SPLIT_MIN_BYTES of K + V a layer (the hand-off costs more), else every core."""
    return 1 if read_bytes < ATTENTION_SPLIT_MIN_BYTES or CORES < 2 or units < 2 else min(units, CORES)


def quantize_int8(x):
    """x [..., dh] fp32 -> (codes [..., dh] int8, scales [...] fp32): one scale per row, the
    formulas of `kernels.kv_quant.quantize_kv_reference` in numpy, bit for bit (a true division
    for the inverse and for the scale, separate multiply and add before the floor; tested). Why:
    that reference's ~10 torch calls took ~180 us per layer at B = 16, these numpy calls ~20 us.
    A row holding a NaN: a NaN scale (max propagates it) and zero codes (its inverse is 0; the
    NaN's own code, whose cast to int8 is undefined, is set to 0, what torch's cast gives here).
    An inf row (inf scale) or a subnormal one (an inverse past fp32) as the reference, without
    numpy's warnings, which a learner would see under the cell as if something had failed."""
    absmax = np.abs(x).max(axis=-1)
    with np.errstate(invalid="ignore", over="ignore"):
        inv = np.divide(np.float32(INT8_MAX), absmax, out=np.zeros_like(absmax), where=absmax > 0)
        codes = np.clip(np.floor(x * inv[..., None] + np.float32(0.5)), -INT8_MAX, INT8_MAX)
    codes[np.isnan(codes)] = 0
    return codes.astype(np.int8), absmax / np.float32(INT8_MAX)


def store_converted(target, x, inverse_scale=None):
    """target (a torch view of a bf16, fp16 or fp8 cache's buffer) = x (fp32 numpy, same shape) as
    `KVCache.update` stores it, bit for bit (tested): one torch copy, which rounds as `.to()` does;
    for fp8 x is first scaled by `inverse_scale` (the layer's scale.reciprocal()) and clamped to
    +-448, the formulas of `kernels.kv_quant.quantize_kv_reference`, here in numpy."""
    if inverse_scale is not None:
        x = np.clip(x * inverse_scale, -FP8_MAX, FP8_MAX)
    target.copy_(torch.from_numpy(x))


def store_int8(x, codes, scales, position):
    """`quantize_int8` of x [B, Hkv, dh] stored at `position` of codes [B, Hkv, T, dh] and scales
    [B, Hkv, T]: the numpy form, and reference, of `cpu_kernels.store_int8`."""
    codes[:, :, position], scales[:, :, position] = quantize_int8(x)


def rms_norm(x, weight, eps):
    """x / rms(x) * weight over the last axis, fp32, as `layer_math.rms_norm` (the sum of squares by
    a ufunc reduce: np.mean's Python wrapper cost more than the arithmetic at these sizes)."""
    mean_square = np.add.reduce(x * x, axis=-1, keepdims=True) * np.float32(1.0 / x.shape[-1])
    return x * (1.0 / np.sqrt(mean_square + eps)) * weight


def _rotate_in_place(x, cos, sin):
    """`CpuDecode._rotate` by numba, in place on x [B, n, dh] (a view of the step's fresh qkv):
    x itself, rotated."""
    cpu_kernels.rotate_in_place(x, cos, sin)
    return x


def _swiglu(gate_up):
    """SwiGLU's gating of gate_up [B, 2 ffn] (gate, then up, as the fused weight writes them):
    silu(gate) * up [B, ffn], silu(g) = g * sigmoid(g), with sigmoid through tanh, so a large -g
    gives no overflow warning."""
    n = gate_up.shape[1] // 2
    gate, up = gate_up[:, :n], gate_up[:, n:]
    return gate * (0.5 + 0.5 * np.tanh(0.5 * gate)) * up


def _attend(q, K, V, out):
    """out[:] = softmax(q K^T / sqrt(dh)) V for q, out [n, G, dh] and K, V [n, S, dh].

    Both products are written as matrix @ column, K [S, dh] @ q_g [dh, 1] and V^T [dh, S] @ p_g
    [S, 1], so numpy calls BLAS's gemv once per query head: gemv streams K and V at close to the
    read rate, where the [G, dh] @ [dh, S] gemm form spends its time packing the tiny operand.
    The G heads of a kv head read it back-to-back, the second from cache."""
    dh = q.shape[-1]
    scores = np.matmul(K[:, None], (q * np.float32(dh ** -0.5))[..., None])[..., 0]  # [n, G, S]
    scores -= scores.max(axis=-1, keepdims=True)
    np.exp(scores, out=scores)
    scores /= scores.sum(axis=-1, keepdims=True)
    out[:] = np.matmul(V.transpose(0, 2, 1)[:, None], scores[..., None])[..., 0]  # [n, G, dh]
