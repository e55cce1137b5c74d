"""Decode attention over a KV cache: one new query per sequence, split-KV ("flash-decoding").

What you learn here:
  * decode reads the whole cache (S * Hkv * D * 2 values per layer and sequence) to produce one
    token, so its speed is memory bandwidth: the kernel is built to read each K/V byte once;
  * GQA pays off here: one program serves all H // Hkv query heads of a kv head, so each K/V tile
    is loaded once per group, not once per query head;
  * split-KV: with B * Hkv programs a GPU with 132 SMs sits mostly idle at small batch, so the
    context is cut into num_splits slices processed in parallel; each writes a partial
    (max m, sum l, unnormalised acc) and a second small kernel merges them exactly:
        M = max_s m_s,   o = sum_s 2**(m_s - M) * acc_s / sum_s 2**(m_s - M) * l_s;
  * quantised caches: int8 (a scale per token) or fp8 (one scale per tensor) travel from memory
    in 1 byte per value; int8 and e4m3 values are exact in fp16/bf16, so the kernel upcasts the
    raw tile for the dot and applies the scales to the scores (K) and probabilities (V).

Shapes: q [B, H, D]; k_cache, v_cache [B, Hkv, S_max, D]; lengths [B] int32; o [B, H, D].
"""
import math

import torch
import triton
import triton.language as tl

from ._runtime import (INTERPRETED, capability, check_dtype_supported, check_runnable, shared_bytes_per_block,
                       sm_count)
from .kv_quant import dequantize_kv

# Pseudocode, split kernel, one program per ((b, kv head), split):
#   L = lengths[b];  chunk = round_up(cdiv(L, NUM_SPLITS), BLOCK_N);  keys [split*chunk, end)
#   Q = q[b, the GROUP query heads of this kv head]        # [BLOCK_H, D], rows >= GROUP are 0
#   m = -inf, l = 0, acc = 0
#   for each BLOCK_N key tile:  s = (Q @ K^T) * k_scale * sm_scale * log2(e)   (online softmax)
#       p = 2 ** (s - m_new);  acc = acc * alpha + (p * v_scale) @ V
#   write m, l, acc to fp32 scratch [B, H, NUM_SPLITS(, D)]
# Combine kernel, one program per (b, h): o = sum_s 2**(m_s - M) acc_s / sum_s 2**(m_s - M) l_s

KV_QUANT_NONE, KV_QUANT_PER_TOKEN, KV_QUANT_PER_TENSOR = 0, 1, 2


@triton.jit(do_not_specialize=["NUM_SPLITS"])  # one compiled variant for every split count
def _decode_split_kernel(
    q_ptr,  # [B, H, D] queries, any strides
    k_ptr, v_ptr,  # [B, Hkv, S_max, D] caches (bf16/fp16/fp32/fp8 e4m3/int8), any strides
    k_scale_ptr, v_scale_ptr,  # int8: [B, Hkv, S_max] fp32; fp8: 0-dim fp32; else unused
    lengths_ptr,  # [B] int32: sequence b attends to positions 0 .. lengths[b] - 1
    m_ptr, l_ptr,  # [B, H, NUM_SPLITS] fp32 scratch: running max and sum per split
    acc_ptr,  # [B, H, NUM_SPLITS, D] fp32 scratch: unnormalised output per split
    qk_scale,  # sm_scale * log2(e)
    Hkv, GROUP,  # kv heads; query heads per kv head (H = Hkv * GROUP)
    stride_qb, stride_qh, stride_qd,  # element strides of q
    stride_kb, stride_kh, stride_ks, stride_kd,  # element strides of k_cache
    stride_vb, stride_vh, stride_vs, stride_vd,  # element strides of v_cache
    stride_sb, stride_sh, stride_ss,  # element strides of the int8 scales (k and v alike)
    NUM_SPLITS,  # slices of the context, one per program along axis 1
    KV_QUANT: tl.constexpr,  # 0 none, 1 per-token (int8), 2 per-tensor (fp8)
    SCALE_V: tl.constexpr,  # 1-byte caches: V scaled in its tile before the dot (see QUANT_SPLIT_TILES)
    DOT_FP32: tl.constexpr,  # True: dots in fp32 (fp32 q, or q and cache dtypes differ)
    INPUT_PRECISION: tl.constexpr,  # "ieee" for exact fp32 dots, else the default "tf32"
    HEAD_DIM: tl.constexpr,  # D
    BLOCK_H: tl.constexpr,  # GROUP padded to a power of two >= 16 (tl.dot minimum)
    BLOCK_N: tl.constexpr,  # keys per inner-loop step
):
    pid_bh = tl.program_id(0)
    split = tl.program_id(1)
    b = (pid_bh // Hkv).to(tl.int64)  # int64: b * stride_kb passes 2**31 for big batched caches
    kv_h = (pid_bh % Hkv).to(tl.int64)
    seq_len = tl.load(lengths_ptr + b)
    chunk = tl.cdiv(tl.cdiv(seq_len, NUM_SPLITS), BLOCK_N) * BLOCK_N  # whole tiles per split
    start = split * chunk
    end = tl.minimum(start + chunk, seq_len)  # empty (start >= end) for splits past the end

    offs_h = tl.arange(0, BLOCK_H)  # [BLOCK_H] query heads within the group
    offs_n = tl.arange(0, BLOCK_N)  # [BLOCK_N]
    offs_d = tl.arange(0, HEAD_DIM)  # [D]
    heads = kv_h * GROUP + offs_h  # [BLOCK_H] absolute query heads
    h_mask = offs_h < GROUP
    q = tl.load(q_ptr + b * stride_qb + heads[:, None] * stride_qh + offs_d[None, :] * stride_qd,
                mask=h_mask[:, None], other=0.0)  # [BLOCK_H, D]
    if DOT_FP32:
        q = q.to(tl.float32)
    scale = qk_scale
    if KV_QUANT == 2:
        scale = scale * tl.load(k_scale_ptr)  # per-tensor K scale folds into the softmax scale
    kT_base = k_ptr + b * stride_kb + kv_h * stride_kh + offs_d[:, None] * stride_kd  # [D, 1]
    v_base = v_ptr + b * stride_vb + kv_h * stride_vh + offs_d[None, :] * stride_vd  # [1, D]
    s_base = b * stride_sb + kv_h * stride_sh

    m_i = tl.full([BLOCK_H], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_H], dtype=tl.float32)
    acc = tl.zeros([BLOCK_H, HEAD_DIM], dtype=tl.float32)
    for start_n in range(start, end, BLOCK_N):
        keys = start_n + offs_n  # [BLOCK_N] cache positions
        k_mask = keys < end
        # Only the compact cache bytes are loaded; the upcast to q's dtype is exact for int8/fp8.
        kT = tl.load(kT_base + keys[None, :] * stride_ks, mask=k_mask[None, :], other=0.0)
        s = tl.dot(q, kT.to(q.dtype), input_precision=INPUT_PRECISION) * scale  # [BLOCK_H, BLOCK_N]
        if KV_QUANT == 1:
            ks = tl.load(k_scale_ptr + s_base + keys * stride_ss, mask=k_mask, other=0.0)
            s = s * ks[None, :]  # (q . k_int8) * scale == q . (k_int8 * scale)
        s = tl.where(k_mask[None, :], s, float("-inf"))
        # The first tile of a non-empty split has a valid key, so m_new is finite from then on.
        m_new = tl.maximum(m_i, tl.max(s, axis=1))
        p = tl.exp2(s - m_new[:, None])  # [BLOCK_H, BLOCK_N]
        alpha = tl.exp2(m_i - m_new)
        l_i = l_i * alpha + tl.sum(p, axis=1)
        v = tl.load(v_base + keys[:, None] * stride_vs, mask=k_mask[:, None], other=0.0)  # [N, D]
        if KV_QUANT == 1:
            vs = tl.load(v_scale_ptr + s_base + keys * stride_ss, mask=k_mask, other=0.0)  # [N]
        # Two dots written apart: one expression for both spilled 20 bytes on int8's tuned tile.
        if SCALE_V:  # V dequantised in its tile: v * scale in fp32, rounded once to q's dtype
            if KV_QUANT == 1:
                vq = (v.to(tl.float32) * vs[:, None]).to(q.dtype)
            else:
                vq = (v.to(tl.float32) * tl.load(v_scale_ptr)).to(q.dtype)
            pv = tl.dot(p.to(q.dtype), vq, input_precision=INPUT_PRECISION)  # [BLOCK_H, D]
        else:
            if KV_QUANT == 1:
                p = p * vs[None, :]  # sum_n p_n (v_n * s_n) == sum_n (p_n * s_n) v_n
            pv = tl.dot(p.to(q.dtype), v.to(q.dtype), input_precision=INPUT_PRECISION)  # [BLOCK_H, D]
        acc = acc * alpha[:, None] + pv
        m_i = m_new
    if KV_QUANT == 2 and not SCALE_V:
        acc = acc * tl.load(v_scale_ptr)  # per-tensor V scale applies once, at the end

    row = (b * Hkv * GROUP + heads) * NUM_SPLITS + split  # index into [B, H, NUM_SPLITS]
    tl.store(m_ptr + row, m_i, mask=h_mask)
    tl.store(l_ptr + row, l_i, mask=h_mask)
    tl.store(acc_ptr + row[:, None] * HEAD_DIM + offs_d[None, :], acc, mask=h_mask[:, None])


@triton.jit(do_not_specialize=["NUM_SPLITS"])
def _decode_combine_kernel(
    m_ptr, l_ptr,  # [B * H, NUM_SPLITS] fp32 partial max and sum (contiguous)
    acc_ptr,  # [B * H, NUM_SPLITS, D] fp32 partial outputs (contiguous)
    o_ptr,  # [B, H, D] output, contiguous, dtype of q
    NUM_SPLITS,  # splits written by the first kernel
    HEAD_DIM: tl.constexpr,  # D
    BLOCK_S: tl.constexpr,  # a COMBINE_BLOCKS entry >= NUM_SPLITS
):
    bh = tl.program_id(0)  # one (batch, query head) per program
    offs_s = tl.arange(0, BLOCK_S)
    offs_d = tl.arange(0, HEAD_DIM)
    s_mask = offs_s < NUM_SPLITS
    m = tl.load(m_ptr + bh * NUM_SPLITS + offs_s, mask=s_mask, other=float("-inf"))  # [BLOCK_S]
    l = tl.load(l_ptr + bh * NUM_SPLITS + offs_s, mask=s_mask, other=0.0)
    acc = tl.load(acc_ptr + (bh * NUM_SPLITS + offs_s[:, None]) * HEAD_DIM + offs_d[None, :],
                  mask=s_mask[:, None], other=0.0)  # [BLOCK_S, D]
    m_max = tl.max(m, axis=0)  # finite: split 0 always holds key 0 (lengths >= 1)
    w = tl.exp2(m - m_max)  # [BLOCK_S]; empty splits (m = -inf) get weight 0
    o = tl.sum(acc * w[:, None], axis=0) / tl.sum(l * w, axis=0)  # [D]
    tl.store(o_ptr + bh * HEAD_DIM + offs_d, o.to(o_ptr.dtype.element_ty))


_Q_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
_CACHE_DTYPES = (torch.bfloat16, torch.float16, torch.float32, torch.float8_e4m3fn, torch.int8)
_NAMES = {torch.bfloat16: "bf16", torch.float16: "fp16", torch.float32: "fp32", torch.float8_e4m3fn: "fp8",
          torch.int8: "int8"}
_BYTES = {"bf16": 2, "fp16": 2, "fp32": 4, "fp8": 1, "int8": 1}
MAX_SPLITS = 64  # the combine kernel holds all splits of one head in registers
COMBINE_BLOCKS = (16, MAX_SPLITS)  # its BLOCK_S: two compiled variants, not one per split count
# Split-kernel tiles on CUDA, (BLOCK_N, num_stages), best first: the first whose buffers fit the
# GPU's shared memory is used (an fp32 cache at D = 256 needed 276 KiB at (64, 3); H100 has 227).
# Sized by make gpu-compile's register report: fp32 dots (an fp32 cache) take half-width tiles,
# and an int8/fp8 cache's upcast tiles take 8 warps, or they spill on sm_90a (but see QUANT_SPLIT_TILES).
SPLIT_TILES = ((64, 3), (64, 2), (32, 2), (16, 2))
SPLIT_TILES_FP32_DOT = ((32, 2), (16, 2))
# 1-byte caches on Hopper at D <= 128, tried before the tiles above: (BLOCK_N, stages, warps) timed
# on an H200 (scripts/gpu_tune.py; data/recordings/gpu-tune-h200-20261204-1541.json). With (64, 3)
# at 8 warps an int8 or fp8 cache streamed at 1.7-2.0 TB/s where bf16 reached 3.5-4.2: each tile
# holds half the bytes. int8 read 2.0-2.8 TB/s in 128-key tiles at 4 warps; fp8 1.9-2.4 in 64-key
# tiles at 4 warps with 8 split programs per SM (below).
QUANT_SPLIT_TILES = {"int8": ((128, 3, 4),), "fp8": ((64, 3, 4),)}
# A tile's optional fourth entry, SCALE_V (False where absent), for a 1-byte cache: True widens the V
# tile to fp32, scales it and rounds it to q's dtype before the dot (int8: instead of scaling the
# probabilities; fp8: instead of the output, once). Why it is a candidate: V is the dot's second
# operand with its contiguous dim (D) not the one the dot sums over (keys), and for 8-bit values
# the sm_90a code without it reads that operand from shared memory a byte at a time (ld.shared.b8:
# 128 in the int8 kernel's code for a 128-key tile, 64 in fp8's for a 64-key one) after copying it
# in with 8-byte cp.async; with it, in 8- and 16-byte loads, and an fp8 tile arrives by 16-byte
# copies, without the 20 bytes of spill (triton 3.9's ptxas, make gpu-compile). Not timed on a GPU
# yet: scripts/gpu_tune.py times both (on the H200 1-byte caches read 1.7-2.8 TB/s where bf16 read
# 3.5-4.2, data/recordings/gpu-tune-h200-20261204-1541.json).
# Split programs per SM (before the caps in default_num_splits), by cache dtype, else the default.
SPLITS_PROGRAMS_PER_SM = 2
SPLITS_PROGRAMS_PER_SM_BY_CACHE = {"fp8": 8}
INTERPRETER_SPLIT_TILE = (16, 1, 4)  # interpreter: small tiles keep the tests quick


def split_shared_bytes(block_n: int, stages: int, head_dim: int, cache_bytes: int, dot_bytes: int) -> int:
    """K and V tiles per pipeline stage in the cache's bytes, and both once more in the dot's
    dtype (the upcast copies the tensor cores read)."""
    return 2 * block_n * head_dim * (stages * cache_bytes + dot_bytes)


def compiled_refusal(q_dtype: str, cache_dtype: str) -> str | None:
    """Why the compiled kernel does not take this pair of dtypes (lab names), or None. An fp32 dot
    over a cache converted on the fly (fp16 q over a bf16 cache, fp32 q over a 16- or 8-bit one)
    spills registers at every tile (make gpu-compile); the lab stores its cache in q's dtype, in
    fp32, or as int8/fp8 under a 16-bit q. The interpreter takes every pair (the tests use them)."""
    if q_dtype == "fp32" and cache_dtype != "fp32":
        return f"an fp32 q needs an fp32 cache on a GPU; got a {cache_dtype} cache"
    if q_dtype != cache_dtype and cache_dtype in ("bf16", "fp16"):
        return f"a {q_dtype} q over a {cache_dtype} cache; store the cache as {q_dtype}, fp32, int8 or fp8"
    return None


def tuned_tiles(q_dtype: str, cache_dtype: str, head_dim: int, capability: tuple | None = None) -> tuple:
    """QUANT_SPLIT_TILES' tiles for this pair where they apply (a 1-byte cache on Hopper, None:
    Hopper, at 16 < D <= 128 under a bf16 q), else (). The tuner timed them under a bf16 q (the
    GPU's compute dtype); under fp16 the int8 tile spills 8 bytes with triton 3.6 (make
    gpu-compile TRITON=3.6): fp16 keeps SPLIT_TILES."""
    hopper = capability is None or tuple(capability) >= (9, 0)
    return QUANT_SPLIT_TILES.get(cache_dtype, ()) if hopper and 16 < head_dim <= 128 and q_dtype == "bf16" else ()


def split_constexprs(q_dtype: str, cache_dtype: str, head_dim: int, group: int, shared_limit: int | None,
                     interpreted: bool = False, capability: tuple | None = None,
                     tile: tuple | None = None) -> dict | None:
    """The split kernel's constexprs, warps and stages for these dtypes (lab names), or None when
    compiled kernels do not take the pair (`compiled_refusal`) or no tile fits `shared_limit`
    bytes (None: no limit). Tiles are (BLOCK_N, stages, warps[, SCALE_V]); `tile` replaces the
    table's choice: scripts/gpu_tune.py times candidates through it."""
    kv_quant = {"int8": KV_QUANT_PER_TOKEN, "fp8": KV_QUANT_PER_TENSOR}.get(cache_dtype, KV_QUANT_NONE)
    # Dot in q's dtype when the cache converts exactly (same dtype, int8, fp8); else in fp32.
    dot_fp32 = q_dtype == "fp32" or not (cache_dtype == q_dtype or kv_quant)
    dot_bytes = 4 if dot_fp32 else _BYTES[q_dtype]
    if interpreted:
        tiles = [INTERPRETER_SPLIT_TILE]
    elif compiled_refusal(q_dtype, cache_dtype):
        return None
    else:
        # D = 16 (lab-tiny) and Turing (stages in registers) keep to 32-key tiles: wider ones spill.
        narrow = head_dim <= 16 or (capability is not None and tuple(capability) < (8, 0))
        warps = 8 if (kv_quant or dot_fp32) and head_dim > 16 else 4
        general = tuple((*t, warps) for t in (SPLIT_TILES_FP32_DOT if dot_fp32 else SPLIT_TILES))
        tiles = [t for t in tuned_tiles(q_dtype, cache_dtype, head_dim, capability) + general
                 if (shared_limit is None or split_shared_bytes(t[0], t[1], head_dim, _BYTES[cache_dtype],
                                                                dot_bytes) <= shared_limit)
                 and not (narrow and t[0] > 32)]
    if tile is not None:
        tiles = [tile]
    if not tiles:
        return None
    block_n, stages, warps, *scale_v = tiles[0]
    return {"constexprs": {"KV_QUANT": kv_quant, "SCALE_V": bool(scale_v and scale_v[0] and kv_quant),
                           "DOT_FP32": dot_fp32,
                           "INPUT_PRECISION": "ieee" if dot_fp32 else "tf32", "HEAD_DIM": head_dim,
                           "BLOCK_H": max(16, triton.next_power_of_2(group)), "BLOCK_N": block_n},
            "num_warps": warps, "num_stages": stages}


def combine_block(num_splits: int) -> int:
    """The combine kernel's BLOCK_S: the smallest COMBINE_BLOCKS entry that holds num_splits."""
    return next(b for b in COMBINE_BLOCKS if b >= num_splits)


def _block_n(device: torch.device) -> int:
    """Keys per tile for sizing the splits: the widest CUDA tile, or the interpreter's."""
    return SPLIT_TILES[0][0] if device.type == "cuda" else INTERPRETER_SPLIT_TILE[0]


def split_programs_per_sm(cache_dtype: str | None, device) -> int:
    """The split programs per SM default_num_splits aims for over a cache of `cache_dtype` (lab
    name): the tuned value for it on CUDA, else SPLITS_PROGRAMS_PER_SM."""
    by_cache = SPLITS_PROGRAMS_PER_SM_BY_CACHE if torch.device(device).type == "cuda" else {}
    return by_cache.get(cache_dtype, SPLITS_PROGRAMS_PER_SM)


def default_num_splits(batch: int, num_kv_heads: int, s_max: int, device, cache_dtype: str | None = None,
                       programs_per_sm: int | None = None) -> int:
    """Splits so that batch * num_kv_heads * splits is about programs_per_sm x the SM count on
    CUDA (by default SPLITS_PROGRAMS_PER_SM, or the cache dtype's; 8 programs in the interpreter),
    capped so each split gets at least 4 x SPLIT_TILES' widest tile (64 keys) of the s_max-long cache.

    Capped by the cache capacity s_max, not by lengths.max(): reading lengths would need a
    device-to-host sync on every decode step. Splits past a short sequence's end exit at once.
    """
    device = torch.device(device)
    if programs_per_sm is None:
        programs_per_sm = split_programs_per_sm(cache_dtype, device)
    target = programs_per_sm * sm_count(device)  # 264 on an H100 at 2 a SM; 8 in the interpreter
    splits = triton.cdiv(target, max(1, batch * num_kv_heads))
    max_useful = triton.cdiv(s_max, 4 * _block_n(device))
    return max(1, min(splits, max_useful, MAX_SPLITS))


def _check_scales(k_cache, k_scale, v_scale):
    B, Hkv, S_max, _ = k_cache.shape
    for name, sc in (("k_scale", k_scale), ("v_scale", v_scale)):
        if k_cache.dtype in (torch.bfloat16, torch.float16, torch.float32):
            if sc is not None:
                raise ValueError(f"decode_attention: {name} must be None for a {k_cache.dtype} cache")
            continue
        want = (B, Hkv, S_max) if k_cache.dtype == torch.int8 else ()
        kind = "[B, Hkv, S_max] per-token" if want else "0-dim per-tensor"
        if not isinstance(sc, torch.Tensor) or sc.dtype != torch.float32 or tuple(sc.shape) != want:
            got = f"{sc.dtype} {tuple(sc.shape)}" if isinstance(sc, torch.Tensor) else repr(sc)
            raise ValueError(f"decode_attention: {name} for a {k_cache.dtype} cache must be a "
                             f"float32 {kind} scale of shape {want}; got {got}")
        if sc.device != k_cache.device:
            raise ValueError(f"decode_attention: {name} on {sc.device} but k_cache on {k_cache.device}")


def _check_inputs(q, k_cache, v_cache, lengths, k_scale, v_scale, check_lengths=True):
    if not isinstance(q, torch.Tensor) or q.dim() != 3 or q.dtype not in _Q_DTYPES:
        got = f"{q.dtype} {tuple(q.shape)}" if isinstance(q, torch.Tensor) else type(q).__name__
        raise ValueError(f"decode_attention: q must be [B, H, D] of bf16, fp16 or fp32; got {got}")
    for name, t in (("k_cache", k_cache), ("v_cache", v_cache)):
        if not isinstance(t, torch.Tensor) or t.dim() != 4:
            raise ValueError(f"decode_attention: {name} must be a 4-D tensor [B, Hkv, S_max, D]; "
                             f"got {tuple(t.shape) if isinstance(t, torch.Tensor) else type(t).__name__}")
        if t.dtype not in _CACHE_DTYPES:
            raise ValueError(f"decode_attention: {name} dtype {t.dtype} not supported; expected one "
                             "of bf16, fp16, fp32, float8_e4m3fn, int8")
    if v_cache.shape != k_cache.shape or v_cache.dtype != k_cache.dtype:
        raise ValueError(f"decode_attention: v_cache {v_cache.dtype} {tuple(v_cache.shape)} differs "
                         f"from k_cache {k_cache.dtype} {tuple(k_cache.shape)}; expected the same")
    (B, H, D), (Bk, Hkv, S_max, Dk) = q.shape, k_cache.shape
    if Bk != B or Dk != D or S_max == 0 or Hkv == 0 or H % Hkv != 0:
        raise ValueError(f"decode_attention: k_cache {tuple(k_cache.shape)} does not fit q "
                         f"{tuple(q.shape)}; expected [B, Hkv, S_max>=1, D] with H % Hkv == 0")
    if D < 16 or D > 256 or D & (D - 1):
        raise ValueError(f"decode_attention: head dim D={D} not supported; expected a power of "
                         "two in [16, 256]")
    if not isinstance(lengths, torch.Tensor) or lengths.dtype != torch.int32 or lengths.shape != (B,):
        got = f"{lengths.dtype} {tuple(lengths.shape)}" if isinstance(lengths, torch.Tensor) else repr(lengths)
        raise ValueError(f"decode_attention: lengths must be an int32 tensor of shape ({B},); got {got}")
    for name, t in (("k_cache", k_cache), ("v_cache", v_cache), ("lengths", lengths)):
        if t.device != q.device:
            raise ValueError(f"decode_attention: {name} on {t.device} but q on {q.device}")
    _check_scales(k_cache, k_scale, v_scale)
    # One host sync to catch out-of-range lengths, which would read past the cache otherwise.
    if check_lengths and bool(((lengths < 1) | (lengths > S_max)).any()):
        raise ValueError(f"decode_attention: lengths must lie in [1, S_max={S_max}]; got min "
                         f"{int(lengths.min())}, max {int(lengths.max())}")
    check_runnable(q, "decode_attention")
    check_dtype_supported(k_cache, "decode_attention")  # an fp8 cache before sm_89: refused here


def decode_attention(q, k_cache, v_cache, lengths, k_scale=None, v_scale=None, num_splits=None,
                     check_lengths: bool = True):
    """o [B, H, D]: q [B, H, D] attends to the first lengths[b] positions of its cache rows.

    Caches are bf16/fp16/fp32 (scales None), int8 (fp32 scales [B, Hkv, S_max]) or fp8 e4m3
    (0-dim fp32 scales). num_splits=None uses default_num_splits(). Output has q's dtype.
    check_lengths=True checks 1 <= lengths <= S_max, which reads lengths back from the device (a
    host sync); a caller that tracks lengths on the host and checks them itself (the model's
    KVCache, once per layer and decode step) passes False. Lengths out of range then read
    past the cache.
    """
    _check_inputs(q, k_cache, v_cache, lengths, k_scale, v_scale, check_lengths)
    B, H, D = q.shape
    Hkv, S_max = k_cache.shape[1], k_cache.shape[2]
    if num_splits is None:
        num_splits = default_num_splits(B, Hkv, S_max, q.device, _NAMES[k_cache.dtype])
    if not isinstance(num_splits, int) or not 1 <= num_splits <= MAX_SPLITS:
        raise ValueError(f"decode_attention: num_splits must be an int in [1, {MAX_SPLITS}]; "
                         f"got {num_splits!r}")
    group = H // Hkv
    limit = shared_bytes_per_block(q.device)
    plan = split_constexprs(_NAMES[q.dtype], _NAMES[k_cache.dtype], D, group, limit, INTERPRETED,
                            capability(q.device))
    if plan is None:
        why = compiled_refusal(_NAMES[q.dtype], _NAMES[k_cache.dtype]) or (
            f"no tile for a {k_cache.dtype} cache at head dim {D} fits this GPU's {limit:,} bytes of "
            "shared memory per block; use a 16-bit or 8-bit cache")
        raise ValueError(f"decode_attention: {why}")
    kv_quant = plan["constexprs"]["KV_QUANT"]
    if kv_quant == KV_QUANT_NONE:
        k_scale = v_scale = lengths  # placeholders: pointers the kernel never reads
    elif kv_quant == KV_QUANT_PER_TOKEN and k_scale.stride() != v_scale.stride():
        k_scale, v_scale = k_scale.contiguous(), v_scale.contiguous()  # one set of strides below
    scale_strides = k_scale.stride() if kv_quant == KV_QUANT_PER_TOKEN else (0, 0, 0)

    m = torch.empty((B, H, num_splits), dtype=torch.float32, device=q.device)
    l = torch.empty_like(m)
    acc = torch.empty((B, H, num_splits, D), dtype=torch.float32, device=q.device)
    _decode_split_kernel[(B * Hkv, num_splits)](
        q, k_cache, v_cache, k_scale, v_scale, lengths, m, l, acc,
        (1.0 / math.sqrt(D)) * math.log2(math.e), Hkv, group,
        *q.stride(), *k_cache.stride(), *v_cache.stride(), *scale_strides, num_splits,
        **plan["constexprs"], num_warps=plan["num_warps"], num_stages=plan["num_stages"],
    )
    o = torch.empty((B, H, D), dtype=q.dtype, device=q.device)
    _decode_combine_kernel[(B * H,)](m, l, acc, o, num_splits, HEAD_DIM=D, BLOCK_S=combine_block(num_splits))
    return o


def decode_attention_reference(q, k_cache, v_cache, lengths, k_scale=None, v_scale=None):
    """Plain torch: dequantise to fp32, mask positions >= lengths[b], fp32 softmax."""
    B, H, D = q.shape
    Hkv, S_max = k_cache.shape[1], k_cache.shape[2]
    k = dequantize_kv(k_cache, k_scale).repeat_interleave(H // Hkv, dim=1)  # [B, H, S_max, D]
    v = dequantize_kv(v_cache, v_scale).repeat_interleave(H // Hkv, dim=1)
    scores = torch.einsum("bhd,bhsd->bhs", q.float(), k) / math.sqrt(D)  # [B, H, S_max]
    valid = torch.arange(S_max, device=q.device)[None, :] < lengths[:, None].long()  # [B, S_max]
    scores = scores.masked_fill(~valid[:, None, :], float("-inf"))
    probs = torch.softmax(scores, dim=-1)
    return torch.einsum("bhs,bhsd->bhd", probs, v).to(q.dtype)
