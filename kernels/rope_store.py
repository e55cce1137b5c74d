"""Decode's rotary embedding and KV-cache write in one kernel: q and k rotated, k and v stored.

What you learn here:
  * between a decode step's qkv product and its attention, torch runs RoPE as five elementwise
    ops (widen to fp32, a product, two multiply-adds, round back) and writes the new K and V into
    the cache with two scatters: seven launches a layer for (H + 2 Hkv) * D values a sequence.
    In the 8B's step on an H200 at batch 1 they took at least 0.5 of 5.7 ms of kernels (the
    profile in data/recordings/gpu-tune-h200-20261204-1751.json: index_put 0.24 ms, addcmul 0.10,
    the fp32 product and the casts to fp32 and back 0.18);
  * one program per (sequence, head) does all of it: a q head is rotated and written to q; a kv
    head's k is rotated, its v taken as it is, both quantised for the cache (int8: a scale per
    token; fp8: the layer's one scale) and written at the sequence's position;
  * the rounding is the unfused ops': rotated in fp32, rounded to the activations' dtype, then
    quantised, so the cache holds the same codes either way.

A prefill (`rope_and_store_prefill`) runs the same kernel over T tokens a sequence, one program
per (token, head): torch's way was five elementwise ops for RoPE over [B, T, H + Hkv, D] in fp32
and a copy (or a quantiser and copies) for each of K and V into the cache, seven launches or more a
layer of the ~17 an eager prefill of the 8B issues; here one. It writes the rotated k heads out
beside q, since attention over a fresh prompt reads them in the activations' dtype, not the cache's.

Shapes: qkv [B, (H + 2 Hkv) * D] (decode) or [B, T, (H + 2 Hkv) * D] (prefill): q heads, then k
heads, then v heads, as wqkv's rows; cos, sin [B or 1, D] (decode) or [T, D] (prefill) fp32, laid
out as labkit's `rope_angles`: (cos, cos) and (-sin, +sin) over the two halves of a head (pairs are
(i, i + D/2)); k_cache, v_cache [B, Hkv, S_max, D]; positions an int (every row) or an int tensor
[B]; decode returns q [B, H, D], prefill qk [B, T, H + Hkv, D] (q heads, then the rotated k heads),
in qkv's dtype.
"""
import torch

try:
    import triton
    import triton.language as tl
except ImportError:  # macOS, Windows: no Triton wheels; the torch reference below still runs
    triton = tl = None

from ._runtime import check_dtype_supported, check_runnable
from .kv_quant import quantize_kv_reference

# Pseudocode, one program per (row r = b T + t, head), head < H + Hkv:
#   x1, x2 = the head's two halves of qkv[r]                       # [D/2] each, in fp32
#   r = (x1 cos - x2 sin, x2 cos + x1 sin), rounded to qkv's dtype  # cos, sin of row b (decode) or token t
#   head < OUT_HEADS (H: decode; H + Hkv: prefill):  out[r, head] = r
#   kv head: k_cache[b, kv, pos] = quantise(r); v_cache[b, kv, pos] = quantise(v half-rows),
#            pos = pos[b] (a tensor) or pos0 + t (int8: codes and a scale absmax / 127 per row;
#            fp8: codes of x / layer scale)
CACHE_FLOAT, CACHE_INT8, CACHE_FP8 = 0, 1, 2


if triton is not None:  # the kernel exists where Triton does; `rope_and_store_reference` everywhere
    from .kv_quant import absmax_of, fp8_codes, int8_codes

    @triton.jit
    def _store_head(dst, scale_dst, a, b, offs, mask, HALF, CACHE_KIND: tl.constexpr):
        """Store one head's row, halves a and b [BLOCK_HALF], into a cache row at dst (and its
        int8 scale at scale_dst; for fp8, scale_dst is the layer's scale, read)."""
        if CACHE_KIND == 1:
            af, bf = a.to(tl.float32), b.to(tl.float32)
            absmax = tl.maximum(absmax_of(af, 0), absmax_of(bf, 0), propagate_nan=tl.PropagateNan.ALL)  # masked lanes are 0
            tl.store(dst + offs, int8_codes(af, absmax).to(tl.int8), mask=mask)
            tl.store(dst + HALF + offs, int8_codes(bf, absmax).to(tl.int8), mask=mask)
            tl.store(scale_dst, absmax / 127.0)
        elif CACHE_KIND == 2:
            inv = tl.math.div_rn(1.0, tl.load(scale_dst))  # IEEE, as the reference's reciprocal
            tl.store(dst + offs, fp8_codes(a.to(tl.float32), inv), mask=mask)
            tl.store(dst + HALF + offs, fp8_codes(b.to(tl.float32), inv), mask=mask)
        else:
            tl.store(dst + offs, a.to(dst.dtype.element_ty), mask=mask)
            tl.store(dst + HALF + offs, b.to(dst.dtype.element_ty), mask=mask)

    # One compiled variant for every position and prompt length (T = 1 in decode, P in a prefill).
    @triton.jit(do_not_specialize=["pos0", "T"])
    def _rope_store_kernel(
        qkv_ptr,  # [B T, (H + 2 Hkv) * D] row stride stride_qkv, unit column stride
        cos_ptr, sin_ptr,  # fp32 rows of D: row b * stride_cos_b + t * stride_cos_t (decode: b's or
                           # the one row, strides 0; prefill: token t's)
        q_ptr,  # [B T, OUT_HEADS, D] out, contiguous
        k_ptr, v_ptr,  # [B, Hkv, S_max, D] caches, strides below, unit along D
        k_scale_ptr, v_scale_ptr,  # int8: [B, Hkv, S_max] fp32; fp8: 0-dim fp32; float: unused
        pos_ptr,  # [B] int positions (POS_FROM_PTR; T = 1)
        pos0,  # the position of token 0 of every row (not POS_FROM_PTR): token t writes at pos0 + t
        T,  # tokens a sequence
        H, Hkv,  # query heads, kv heads
        OUT_HEADS,  # heads written out: H (decode), H + Hkv (prefill: the rotated k heads too)
        stride_qkv, stride_cos_b, stride_cos_t,
        stride_cb, stride_ch, stride_cs,  # cache strides: sequence, kv head, position (k and v alike)
        stride_sb, stride_sh, stride_ss,  # int8 scales' strides (0 for other caches)
        HALF,  # D / 2
        CACHE_KIND: tl.constexpr,  # 0 float (a cast), 1 int8 (a scale per token), 2 fp8 (the layer's scale)
        POS_FROM_PTR: tl.constexpr,  # True: row b writes at pos_ptr[b] (a CUDA graph, mixed lengths)
        BLOCK_HALF: tl.constexpr,  # next power of two >= HALF
    ):
        r = tl.program_id(0).to(tl.int64)  # int64: b * stride_cb passes 2**31 for big batched caches
        b, t = r // T, r % T
        head = tl.program_id(1)  # 0 .. H + Hkv - 1: the q heads, then the kv heads
        offs = tl.arange(0, BLOCK_HALF)
        mask = offs < HALF
        row = qkv_ptr + r * stride_qkv + head * (2 * HALF)
        x1 = tl.load(row + offs, mask=mask, other=0.0)  # [BLOCK_HALF]
        x2 = tl.load(row + HALF + offs, mask=mask, other=0.0)
        angles = b * stride_cos_b + t * stride_cos_t
        c = tl.load(cos_ptr + angles + offs, mask=mask, other=0.0)  # cos, the first half
        s = tl.load(sin_ptr + angles + HALF + offs, mask=mask, other=0.0)  # +sin, the second
        x1f, x2f = x1.to(tl.float32), x2.to(tl.float32)
        r1 = (x1f * c - x2f * s).to(x1.dtype)  # rounded to the activations' dtype, as torch's rope
        r2 = (x2f * c + x1f * s).to(x1.dtype)
        if head < OUT_HEADS:
            out = q_ptr + (r * OUT_HEADS + head) * (2 * HALF)
            tl.store(out + offs, r1, mask=mask)
            tl.store(out + HALF + offs, r2, mask=mask)
        if head >= H:
            kv = head - H
            if POS_FROM_PTR:
                pos = tl.load(pos_ptr + b).to(tl.int64)
            else:
                pos = pos0.to(tl.int64) + t
            at = b * stride_cb + kv * stride_ch + pos * stride_cs
            scale_at = b * stride_sb + kv * stride_sh + pos * stride_ss  # 0 but for int8
            _store_head(k_ptr + at, k_scale_ptr + scale_at, r1, r2, offs, mask, HALF, CACHE_KIND)
            vrow = qkv_ptr + r * stride_qkv + (H + Hkv + kv) * (2 * HALF)
            v1 = tl.load(vrow + offs, mask=mask, other=0.0)
            v2 = tl.load(vrow + HALF + offs, mask=mask, other=0.0)
            _store_head(v_ptr + at, v_scale_ptr + scale_at, v1, v2, offs, mask, HALF, CACHE_KIND)


def _cache_kind(k_cache, k_scale, v_scale) -> int:
    """CACHE_INT8, CACHE_FP8 or CACHE_FLOAT, after checking the scales fit the cache's dtype."""
    kind = {torch.int8: CACHE_INT8, torch.float8_e4m3fn: CACHE_FP8}.get(k_cache.dtype, CACHE_FLOAT)
    want = {CACHE_INT8: k_cache.shape[:-1], CACHE_FP8: ()}.get(kind)
    for name, scale in (("k_scale", k_scale), ("v_scale", v_scale)):
        if want is None and scale is not None:
            raise ValueError(f"rope_and_store: a {k_cache.dtype} cache takes no {name}")
        if want is not None and (not isinstance(scale, torch.Tensor) or scale.shape != want
                                 or scale.dtype != torch.float32):
            raise ValueError(f"rope_and_store: a {k_cache.dtype} cache needs {name} fp32 of shape "
                             f"{tuple(want)}; got {getattr(scale, 'shape', scale)}")
    if kind == CACHE_INT8 and (k_scale.stride() != v_scale.stride() or k_scale.stride(2) != 1):
        raise ValueError("rope_and_store: the int8 scales must share strides, unit along positions")
    return kind


def _check(qkv, cos, sin, k_cache, v_cache, tokens: int | None = None):
    """(B, H, Hkv, D) after checking the shapes agree: qkv [B, W] and cos, sin [1 or B, D]
    (decode), or with `tokens` = T, qkv [B T, W] and cos, sin [T, D] (a prefill)."""
    name = "rope_and_store" if tokens is None else "rope_and_store_prefill"
    if k_cache.dim() != 4 or k_cache.shape != v_cache.shape or k_cache.dtype != v_cache.dtype \
            or k_cache.stride() != v_cache.stride() or k_cache.stride(3) != 1:
        raise ValueError(f"{name}: k_cache and v_cache must be [B, Hkv, S_max, D] alike, unit "
                         f"stride along D; got {tuple(k_cache.shape)} and {tuple(v_cache.shape)}")
    B, Hkv, _, D = k_cache.shape
    rows = B * (tokens or 1)
    if D % 2 or qkv.dim() != 2 or qkv.shape[0] != rows or qkv.shape[1] % D or qkv.stride(1) != 1 \
            or qkv.shape[1] // D <= 2 * Hkv:
        want = f"[{B}, (H + 2 * {Hkv}) * {D}]" if tokens is None else f"[{B}, {tokens}, (H + 2 * {Hkv}) * {D}]"
        raise ValueError(f"{name}: qkv must be {want} (an even D), unit column stride; got {tuple(qkv.shape)}")
    angle_rows, want = ((1, B), f"[1 or {B}, {D}]") if tokens is None else ((tokens,), f"[{tokens}, {D}]")
    for what, t in (("cos", cos), ("sin", sin)):
        if t.dtype != torch.float32 or t.dim() != 2 or t.shape[0] not in angle_rows or t.shape[1] != D \
                or t.stride(1) != 1 or t.stride() != cos.stride():
            raise ValueError(f"{name}: {what} must be fp32 {want} with cos's strides; "
                             f"got {t.dtype} {tuple(t.shape)}")
    return B, qkv.shape[1] // D - 2 * Hkv, Hkv, D


def rope_and_store(qkv, cos, sin, k_cache, v_cache, k_scale, v_scale, positions):
    """Rotate q and k of qkv [B, (H + 2 Hkv) * D] by (cos, sin), store k and v (quantised for an
    int8 or fp8 cache) at `positions` of each sequence's cache row; returns q [B, H, D].
    Positions in a tensor are not range-checked here (that would wait for the device): the
    caller's cache bookkeeping keeps them inside S_max."""
    B, H, Hkv, D = _check(qkv, cos, sin, k_cache, v_cache)
    kind = _cache_kind(k_cache, k_scale, v_scale)
    check_runnable(qkv, "rope_and_store")
    check_dtype_supported(k_cache, "rope_and_store")  # an fp8 cache before sm_89: refused here
    from_ptr = isinstance(positions, torch.Tensor)
    if from_ptr and (positions.shape != (B,) or positions.dtype not in (torch.int32, torch.int64)):
        raise ValueError(f"rope_and_store: positions must be an int or int32/int64 [{B}]; got "
                         f"{positions.dtype} {tuple(positions.shape)}")
    if not from_ptr and not 0 <= positions < k_cache.shape[2]:
        raise ValueError(f"rope_and_store: position {positions} outside the cache's 0 .. {k_cache.shape[2] - 1}")
    q = torch.empty((B, H, D), dtype=qkv.dtype, device=qkv.device)
    _launch(qkv, cos, sin, q, k_cache, v_cache, k_scale, v_scale, kind, positions, 1, H, Hkv, D,
            cos_strides=(cos.stride(0) if cos.shape[0] > 1 else 0, 0))
    return q


def rope_and_store_prefill(qkv, cos, sin, k_cache, v_cache, k_scale, v_scale, start: int):
    """A prefill's RoPE and cache write: qkv [B, T, (H + 2 Hkv) * D] for positions start ..
    start + T - 1 of every sequence, cos, sin [T, D] (`rope_angles` of those positions); rotates
    q and k, stores k and v (quantised for an int8 or fp8 cache) at those positions of each
    sequence's cache row. Returns qk [B, T, H + Hkv, D]: q's heads, then k's, rotated, in qkv's dtype."""
    if qkv.dim() != 3:
        raise ValueError(f"rope_and_store_prefill: qkv must be [B, T, (H + 2 Hkv) * D]; got {tuple(qkv.shape)}")
    B, T = qkv.shape[:2]
    rows = qkv.reshape(B * T, qkv.shape[2])  # [B T, W]: a view where qkv is contiguous
    _, H, Hkv, D = _check(rows, cos, sin, k_cache, v_cache, tokens=T)
    kind = _cache_kind(k_cache, k_scale, v_scale)
    check_runnable(qkv, "rope_and_store_prefill")
    check_dtype_supported(k_cache, "rope_and_store_prefill")
    if not isinstance(start, int) or not 0 <= start <= k_cache.shape[2] - T:
        raise ValueError(f"rope_and_store_prefill: positions {start} .. {start} + {T} - 1 outside the cache's "
                         f"0 .. {k_cache.shape[2] - 1}")
    qk = torch.empty((B, T, H + Hkv, D), dtype=qkv.dtype, device=qkv.device)
    if B * T:
        _launch(rows, cos, sin, qk, k_cache, v_cache, k_scale, v_scale, kind, start, T, H + Hkv, Hkv, D,
                cos_strides=(0, cos.stride(0)), q_heads=H)
    return qk


def _launch(rows, cos, sin, out, k_cache, v_cache, k_scale, v_scale, kind, positions, T, out_heads, Hkv, D,
            cos_strides, q_heads=None):
    """One program per (row of `rows` [B T, W], head): see the kernel. `out_heads` heads of each
    row go to `out`; the kv heads go to the caches."""
    H = out_heads if q_heads is None else q_heads
    from_ptr = isinstance(positions, torch.Tensor)
    scale_strides = k_scale.stride() if kind == CACHE_INT8 else (0, 0, 0)
    unused = k_cache  # any tensor stands for a pointer the kernel does not read
    _rope_store_kernel[(rows.shape[0], H + Hkv)](
        rows, cos, sin, out, k_cache, v_cache,
        k_scale if kind != CACHE_FLOAT else unused, v_scale if kind != CACHE_FLOAT else unused,
        positions if from_ptr else unused, 0 if from_ptr else positions, T, H, Hkv, out_heads,
        rows.stride(0), *cos_strides,
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2), *scale_strides, D // 2,
        CACHE_KIND=kind, POS_FROM_PTR=from_ptr, BLOCK_HALF=triton.next_power_of_2(D // 2),
        num_warps=1)


def rope_and_store_reference(qkv, cos, sin, k_cache, v_cache, k_scale, v_scale, positions):
    """The kernel's arithmetic in torch (rotation in fp32, rounded to qkv's dtype, then
    `quantize_kv_reference`), writing the same caches; returns q [B, H, D]."""
    B, H, Hkv, D = _check(qkv, cos, sin, k_cache, v_cache)
    half = D // 2
    heads = qkv.view(B, H + 2 * Hkv, D)
    x1, x2 = heads[:, :H + Hkv, :half].float(), heads[:, :H + Hkv, half:].float()
    c, s = cos[:, None, :half], sin[:, None, half:]  # [B or 1, 1, D/2]
    rotated = torch.cat((x1 * c - x2 * s, x2 * c + x1 * s), -1).to(qkv.dtype)  # [B, H + Hkv, D]
    rows = torch.arange(B, device=qkv.device)
    where = positions.long() if isinstance(positions, torch.Tensor) else torch.full_like(rows, positions)
    fp8 = k_cache.dtype == torch.float8_e4m3fn
    for cache, scale, new in ((k_cache, k_scale, rotated[:, H:]), (v_cache, v_scale, heads[:, H + Hkv:])):
        codes, row_scale = quantize_kv_reference(new, cache.dtype, scale if fp8 else None)
        cache[rows, :, where] = codes  # [B, Hkv, D] into rows b at positions where[b]
        if cache.dtype == torch.int8:
            scale[rows, :, where] = row_scale
    return rotated[:, :H].contiguous()


def rope_and_store_prefill_reference(qkv, cos, sin, k_cache, v_cache, k_scale, v_scale, start: int):
    """`rope_and_store_prefill`'s arithmetic in torch (the decode reference's, over T tokens),
    writing the same caches; returns qk [B, T, H + Hkv, D]."""
    B, T = qkv.shape[:2]
    _, H, Hkv, D = _check(qkv.reshape(B * T, -1), cos, sin, k_cache, v_cache, tokens=T)
    half = D // 2
    heads = qkv.view(B, T, H + 2 * Hkv, D)
    x1, x2 = heads[:, :, :H + Hkv, :half].float(), heads[:, :, :H + Hkv, half:].float()
    c, s = cos[None, :, None, :half], sin[None, :, None, half:]  # [1, T, 1, D/2]
    rotated = torch.cat((x1 * c - x2 * s, x2 * c + x1 * s), -1).to(qkv.dtype)  # [B, T, H + Hkv, D]
    fp8 = k_cache.dtype == torch.float8_e4m3fn
    for cache, scale, new in ((k_cache, k_scale, rotated[:, :, H:]), (v_cache, v_scale, heads[:, :, H + Hkv:])):
        codes, row_scale = quantize_kv_reference(new.transpose(1, 2), cache.dtype, scale if fp8 else None)
        cache[:, :, start:start + T] = codes  # [B, Hkv, T, D]
        if cache.dtype == torch.int8:
            scale[:, :, start:start + T] = row_scale
    return rotated
