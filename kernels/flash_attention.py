"""Flash attention forward for prefill: exact softmax attention without the P x S score matrix.

What you learn here:
  * prefill attends P new queries to S keys; a naive version writes the P x S scores to memory
    (P * S * 4 bytes per head: 256 MiB for P = S = 8192), flash attention keeps them on chip;
  * online softmax: walk the keys in tiles, keep per query a running max m and running sum l,
    and rescale the partial output whenever m grows, so one pass gives the exact result;
  * exp2 instead of exp: softmax(x) is unchanged if we use 2**(x * log2(e)), and log2(e) is
    folded into the 1/sqrt(D) scale, so the inner loop pays one multiply;
  * causal masking skips whole key tiles that lie after the last query of the tile, and masks
    only the tiles on the diagonal: the tiles before it are visible to every query of the tile
    and run without a compare and select per score (as Triton's own fused-attention tutorial);
  * chunked prefill: when S > P the queries are the last P positions, query i sits at absolute
    position S - P + i and sees keys 0 .. S - P + i;
  * grouped-query attention (GQA): H query heads share Hkv kv heads, head h reads kv head
    h // (H // Hkv), so the KV cache is H / Hkv times smaller.

Shapes: q [B, H, P, D]; k, v [B, Hkv, S, D]; o [B, H, P, D].
"""
import math

import torch

try:
    import triton
    import triton.language as tl
except ImportError:  # macOS, Windows: no Triton wheels; the torch reference below still runs
    triton = tl = None

from ._runtime import INTERPRETED, capability, check_runnable, shared_bytes_per_block

# Pseudocode, one program per (BLOCK_M queries, one (batch, head)):
#   qs = q_tile * sm_scale * log2(e)                          # [BLOCK_M, D]
#   m = -inf, l = 0, acc = 0                                   # [BLOCK_M], [BLOCK_M], [BLOCK_M, D]
#   for each key tile k_j, v_j (BLOCK_N keys; causal: stop after the tile's last visible key;
#                               first the tiles every query sees, with no mask, then the rest):
#       s     = qs @ k_j^T, masked to -inf where key > query position or key >= S
#       m_new = max(m, rowmax(s))
#       p     = 2 ** (s - m_new)                               # [BLOCK_M, BLOCK_N]
#       alpha = 2 ** (m - m_new)                               # rescales the old partial sums
#       l     = l * alpha + rowsum(p);  acc = acc * alpha + p @ v_j;  m = m_new
#   o_tile = acc / l


# Autotune candidates on CUDA, (BLOCK_M, BLOCK_N, num_stages, num_warps). make gpu-compile compiles
# each one the lab keeps for sm_75/80/89/90a, and these lists are what it left without register
# spills: (128, 64, 3, 4) spilled at D = 128 on sm_90a (255 registers) and runs at 8 warps here;
# Ampere/Ada keep small tiles at D >= 128 (the others spill 8-16 bytes on sm_80), Hopper small
# rows at D = 256, Turing (no asynchronous copies: stages in registers) small tiles throughout.
# (128, 128, 2, 8) is the one 128-key tile that fits a Hopper's shared memory at D = 128 (160 KiB;
# 3 stages need ~256), with no spill under triton 3.6 or 3.9: there for the autotuner to time
# against the 64-key tiles, with which causal attention reached 319-374 TFLOP/s on an H200
# (data/recordings/kernels-h200-20261204-1749.json); not yet timed on a GPU.
TILES = ((128, 64, 3, 8), (128, 64, 4, 8), (128, 128, 3, 8), (128, 128, 2, 8), (64, 64, 4, 4), (128, 32, 4, 4),
         (32, 32, 2, 4))
TILES_HOPPER_D256 = ((64, 32, 3, 4), (64, 32, 2, 4), (64, 64, 2, 8), (32, 32, 2, 4))
TILES_AMPERE_WIDE = ((32, 32, 2, 4), (32, 16, 2, 4))  # sm_80 / sm_89 at D >= 128
TILES_TURING = ((64, 32, 2, 4), (32, 32, 1, 4))  # sm_75 at D <= 64
TILES_TURING_WIDE = ((32, 16, 2, 4), (16, 32, 2, 4))  # sm_75 at D = 128 (D = 256: none, refused)
TILES_FP32 = ((32, 16, 2, 4),)  # exact fp32 dots, D <= 128 only (others spill on sm_89)
TILES_FP32_HOPPER = ((32, 16, 2, 4), (16, 32, 2, 4))  # (32, 32, 2, 8) spilled 8 bytes under triton 3.6
INTERPRETER_TILE = (16, 16, 1, 4)
# The fewest keys a tile needs to run the tiles every query sees in a loop of their own (see the
# kernel); in the interpreter its one tile does, so the tests there check that loop too.
UNMASKED_LOOP_MIN_BLOCK_N = tl.constexpr(INTERPRETER_TILE[1] if INTERPRETED else 64) if tl else None
# Autotune keys: P and S rounded up to powers of two (see kernels/matmul.py's m_bucket).
BUCKET_MIN, BUCKET_MAX = 128, 32768


def bucket(n: int) -> int:
    """P or S as an autotune key: the next power of two, clamped to [BUCKET_MIN, BUCKET_MAX]."""
    return min(BUCKET_MAX, max(BUCKET_MIN, triton.next_power_of_2(max(1, n))))


def shared_bytes_estimate(block_m: int, block_n: int, stages: int, head_dim: int, elem_bytes: int) -> int:
    """The q tile once, K and V tiles once per pipeline stage (the pipeliner buffers `stages - 1`
    ahead plus the one in use), and the p tile for the second dot."""
    return (block_m * head_dim + stages * 2 * block_n * head_dim + block_m * block_n) * elem_bytes


def tiles_for(elem_bytes: int, head_dim: int, shared_limit: int | None = None,
              capability: tuple | None = None) -> list[tuple]:
    """The autotune tiles for this element size and head dim on a GPU of `capability` (None:
    Hopper's lists) that fit `shared_limit` bytes per block (None: all)."""
    cc = tuple(capability) if capability is not None else (9, 0)
    if elem_bytes == 4:
        tiles = () if head_dim > 128 else TILES_FP32_HOPPER if cc >= (9, 0) else TILES_FP32
    elif cc < (8, 0):
        tiles = TILES_TURING if head_dim <= 64 else TILES_TURING_WIDE if head_dim <= 128 else ()
    elif cc < (9, 0):
        tiles = TILES if head_dim <= 64 else TILES_AMPERE_WIDE
    else:
        tiles = TILES if head_dim <= 128 else TILES_HOPPER_D256
    return [t for t in tiles if shared_limit is None
            or shared_bytes_estimate(t[0], t[1], t[2], head_dim, elem_bytes) <= shared_limit]


def _configs():
    """All CUDA tiles (the prune below keeps the ones that fit the GPU); one in the interpreter."""
    tiles = [INTERPRETER_TILE] if INTERPRETED else sorted(set(TILES + TILES_HOPPER_D256 + TILES_AMPERE_WIDE + TILES_TURING
                                                            + TILES_TURING_WIDE + TILES_FP32_HOPPER))
    return [triton.Config({"BLOCK_M": bm, "BLOCK_N": bn}, num_stages=s, num_warps=w) for bm, bn, s, w in tiles]


def _prune(configs, named_args, **kwargs):
    q = named_args["q_ptr"]
    keep = set(tiles_for(q.element_size(), kwargs["HEAD_DIM"], shared_bytes_per_block(q.device), capability(q.device)))
    return [c for c in configs if (c.kwargs["BLOCK_M"], c.kwargs["BLOCK_N"], c.num_stages, c.num_warps) in keep]


if triton is not None:  # the kernel exists where Triton does; `attention_reference` everywhere
    @triton.jit
    def _attend(acc, l_i, m_i, q, kT_ptrs, v_ptrs, q_pos, lo, hi, S, qk_scale, stride_ks, stride_vs,
                MASKED: tl.constexpr, CAUSAL: tl.constexpr, INPUT_PRECISION: tl.constexpr, BLOCK_N: tl.constexpr):
        """The online softmax over key tiles lo, lo + BLOCK_N, ... < hi: (acc, l_i, m_i) updated.
        MASKED: keys at or past S, and (CAUSAL) after a query's position, are hidden; else every
        key of every tile is visible to every query, and nothing is masked."""
        offs_n = tl.arange(0, BLOCK_N)  # [BLOCK_N]
        for start_n in range(lo, hi, BLOCK_N):
            keys = start_n + offs_n  # [BLOCK_N] absolute key positions
            if MASKED:
                kT = tl.load(kT_ptrs + start_n * stride_ks, mask=keys[None, :] < S, other=0.0)  # [D, BLOCK_N]
            else:
                kT = tl.load(kT_ptrs + start_n * stride_ks)
            s = tl.dot(q, kT, input_precision=INPUT_PRECISION) * qk_scale  # [BLOCK_M, BLOCK_N]
            if MASKED:
                visible = keys[None, :] < S
                if CAUSAL:
                    visible = visible & (keys[None, :] <= q_pos[:, None])
                s = tl.where(visible, s, float("-inf"))
            # Key 0 is visible to every row and lies in the first tile either loop takes, so m_new is
            # finite from then on and the -inf entries become exact zeros in p.
            m_new = tl.maximum(m_i, tl.max(s, axis=1))  # [BLOCK_M]
            p = tl.exp2(s - m_new[:, None])  # [BLOCK_M, BLOCK_N]
            alpha = tl.exp2(m_i - m_new)  # [BLOCK_M]; 0 on the first tile (m_i = -inf)
            l_i = l_i * alpha + tl.sum(p, axis=1)
            if MASKED:
                v = tl.load(v_ptrs + start_n * stride_vs, mask=keys[:, None] < S, other=0.0)  # [BLOCK_N, D]
            else:
                v = tl.load(v_ptrs + start_n * stride_vs)
            # p is rounded to v's dtype so the second dot runs on tensor cores like the first.
            acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=INPUT_PRECISION)
            m_i = m_new
        return acc, l_i, m_i

    @triton.autotune(configs=_configs(), key=["P_BUCKET", "S_BUCKET", "HEAD_DIM", "CAUSAL"],
                     prune_configs_by={"early_config_prune": _prune})
    @triton.jit(do_not_specialize=["P", "S", "P_BUCKET", "S_BUCKET"])  # one compiled variant for every length
    def _flash_attention_kernel(
        q_ptr,  # [B, H, P, D] queries (fp16/bf16/fp32), any strides
        k_ptr,  # [B, Hkv, S, D] keys, same dtype
        v_ptr,  # [B, Hkv, S, D] values, same dtype
        o_ptr,  # [B, H, P, D] output, dtype of q
        qk_scale,  # sm_scale * log2(e): scores come out in base 2
        H, P, S,  # query heads, queries, keys (S >= P; queries are the last P positions)
        P_BUCKET, S_BUCKET,  # bucket(P), bucket(S): the autotune key in place of P and S; unused
        GROUP,  # H // Hkv: query heads per kv head
        stride_qb, stride_qh, stride_qp, stride_qd,  # element strides of q
        stride_kb, stride_kh, stride_ks, stride_kd,  # element strides of k
        stride_vb, stride_vh, stride_vs, stride_vd,  # element strides of v
        stride_ob, stride_oh, stride_op, stride_od,  # element strides of o
        CAUSAL: tl.constexpr,  # mask keys after each query's absolute position
        HEAD_DIM: tl.constexpr,  # D, a power of two in [16, 256]
        INPUT_PRECISION: tl.constexpr,  # "ieee" for exact fp32 dots
        BLOCK_M: tl.constexpr,  # queries per program
        BLOCK_N: tl.constexpr,  # keys per inner-loop step
    ):
        start_m = tl.program_id(0)
        pid_bh = tl.program_id(1)
        b = (pid_bh // H).to(tl.int64)  # int64: b * stride_qb can pass 2**31 for long batched prompts
        h = (pid_bh % H).to(tl.int64)
        kv_h = h // GROUP  # GQA: consecutive query heads share one kv head

        offs_m = start_m * BLOCK_M + tl.arange(0, BLOCK_M)  # [BLOCK_M] query rows within P
        offs_n = tl.arange(0, BLOCK_N)  # [BLOCK_N]
        offs_d = tl.arange(0, HEAD_DIM)  # [D]
        q_pos = S - P + offs_m  # absolute positions of the queries (chunked prefill)

        q_ptrs = (q_ptr + b * stride_qb + h * stride_qh
                  + offs_m[:, None] * stride_qp + offs_d[None, :] * stride_qd)  # [BLOCK_M, D]
        q = tl.load(q_ptrs, mask=offs_m[:, None] < P, other=0.0)
        # K is read as its transpose [D, BLOCK_N] straight from memory, so q @ kT needs no tl.trans.
        kT_ptrs = (k_ptr + b * stride_kb + kv_h * stride_kh
                   + offs_n[None, :] * stride_ks + offs_d[:, None] * stride_kd)  # [D, BLOCK_N]
        v_ptrs = (v_ptr + b * stride_vb + kv_h * stride_vh
                  + offs_n[:, None] * stride_vs + offs_d[None, :] * stride_vd)  # [BLOCK_N, D]

        m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)  # running max (base-2 scores)
        l_i = tl.zeros([BLOCK_M], dtype=tl.float32)  # running sum of 2**(s - m_i)
        acc = tl.zeros([BLOCK_M, HEAD_DIM], dtype=tl.float32)  # running unnormalised output

        # Keys every query of the tile sees need no mask: with causal masking those before the tile's
        # first query position, otherwise every whole tile of S. They come first, unmasked (no
        # compare and select per score, unmasked loads); the rest, up to the tile's last query
        # position (causal: keys after it are masked for every row, so skipped), with the masks.
        if CAUSAL:
            lo = (S - P + start_m * BLOCK_M) // BLOCK_N * BLOCK_N
            hi = tl.minimum(S, S - P + (start_m + 1) * BLOCK_M)
        else:
            lo = S // BLOCK_N * BLOCK_N
            hi = S
        # Two loops need more registers than one: with BLOCK_N < 64 (on sm_90a under triton 3.6: 4-16
        # bytes of spill at D = 128 and 256) and fp32's exact dots (8-636 bytes on sm_89 and sm_90a)
        # the tile keeps one loop, every key tile masked.
        if INPUT_PRECISION != "ieee" and BLOCK_N >= UNMASKED_LOOP_MIN_BLOCK_N:
            acc, l_i, m_i = _attend(acc, l_i, m_i, q, kT_ptrs, v_ptrs, q_pos, 0, lo, S, qk_scale, stride_ks,
                                    stride_vs, MASKED=False, CAUSAL=CAUSAL, INPUT_PRECISION=INPUT_PRECISION,
                                    BLOCK_N=BLOCK_N)
        else:
            lo = 0
        acc, l_i, m_i = _attend(acc, l_i, m_i, q, kT_ptrs, v_ptrs, q_pos, lo, hi, S, qk_scale, stride_ks, stride_vs,
                                MASKED=True, CAUSAL=CAUSAL, INPUT_PRECISION=INPUT_PRECISION, BLOCK_N=BLOCK_N)

        o = acc / l_i[:, None]
        o_ptrs = (o_ptr + b * stride_ob + h * stride_oh
                  + offs_m[:, None] * stride_op + offs_d[None, :] * stride_od)  # [BLOCK_M, D]
        tl.store(o_ptrs, o.to(o_ptr.dtype.element_ty), mask=offs_m[:, None] < P)


_DTYPES = (torch.float16, torch.bfloat16, torch.float32)


def _check_inputs(q, k, v):
    for name, t in (("q", q), ("k", k), ("v", v)):
        if not isinstance(t, torch.Tensor) or t.dim() != 4:
            got = f"shape {tuple(t.shape)}" if isinstance(t, torch.Tensor) else type(t).__name__
            raise ValueError(f"flash_attention: {name} must be a 4-D tensor; got {got}")
        if t.dtype != q.dtype or t.dtype not in _DTYPES:
            raise ValueError(f"flash_attention: {name} dtype {t.dtype} not supported; expected "
                             f"q, k, v all one of bf16, fp16, fp32 (q is {q.dtype})")
        if t.device != q.device:
            raise ValueError(f"flash_attention: {name} on {t.device} but q on {q.device}")
    (B, H, P, D), (Bk, Hkv, S, Dk) = q.shape, k.shape
    if v.shape != k.shape:
        raise ValueError(f"flash_attention: v shape {tuple(v.shape)} != k shape {tuple(k.shape)}")
    if Bk != B or Dk != D:
        raise ValueError(f"flash_attention: k {tuple(k.shape)} does not match q {tuple(q.shape)}; "
                         "expected q [B, H, P, D], k/v [B, Hkv, S, D] with the same B and D")
    if Hkv == 0 or H % Hkv != 0:
        raise ValueError(f"flash_attention: H={H} query heads not a multiple of Hkv={Hkv} kv heads")
    if S < P:
        raise ValueError(f"flash_attention: S={S} keys < P={P} queries; expected S >= P "
                         "(queries are the last P positions)")
    if D < 16 or D > 256 or D & (D - 1):
        raise ValueError(f"flash_attention: head dim D={D} not supported; expected a power of "
                         "two in [16, 256]")
    check_runnable(q, "flash_attention")


def flash_attention(q, k, v, causal=True, sm_scale=None):
    """Exact attention o [B, H, P, D] for q [B, H, P, D], k/v [B, Hkv, S, D]; see module docstring.

    sm_scale defaults to 1/sqrt(D). Output has q's dtype, token by token in memory (o.transpose(1, 2)
    is contiguous); softmax statistics are kept in fp32.
    """
    _check_inputs(q, k, v)
    B, H, P, D = q.shape
    Hkv, S = k.shape[1], k.shape[2]
    sm_scale = 1.0 / math.sqrt(D) if sm_scale is None else float(sm_scale)
    # o [B, H, P, D], laid out token by token ([B, P, H, D] in memory): what reads it next, the
    # output projection, wants each token's heads side by side, and o.transpose(1, 2) then needs no
    # copy to become [B, P, H * D] (the model's prefill: one copy kernel a layer fewer)
    o = torch.empty((B, P, H, D), dtype=q.dtype, device=q.device).transpose(1, 2)
    if B * H * P == 0:
        return o
    if not INTERPRETED and not tiles_for(q.element_size(), D, shared_bytes_per_block(q.device), capability(q.device)):
        raise ValueError(f"flash_attention: no tile for {q.dtype} at head dim {D} fits this GPU's "
                         f"{shared_bytes_per_block(q.device):,} bytes of shared memory per block; "
                         "use a 16-bit dtype or a smaller head dim")

    def grid(meta):  # axis 0: query tiles, axis 1: (batch, head) pairs
        return (triton.cdiv(P, meta["BLOCK_M"]), B * H)

    _flash_attention_kernel[grid](
        q, k, v, o, sm_scale * math.log2(math.e), H, P, S, bucket(P), bucket(S), H // Hkv,
        *q.stride(), *k.stride(), *v.stride(), *o.stride(),
        CAUSAL=bool(causal), HEAD_DIM=D,
        INPUT_PRECISION="ieee" if q.dtype == torch.float32 else "tf32",
    )
    return o


def attention_reference(q, k, v, causal=True, sm_scale=None):
    """Plain torch attention with an explicit fp32 softmax; materialises the [P, S] scores."""
    B, H, P, D = q.shape
    Hkv, S = k.shape[1], k.shape[2]
    sm_scale = 1.0 / math.sqrt(D) if sm_scale is None else float(sm_scale)
    k = k.float().repeat_interleave(H // Hkv, dim=1)  # [B, H, S, D]: head h -> kv head h // G
    v = v.float().repeat_interleave(H // Hkv, dim=1)
    # The scale on q [B, H, P, D], not on the scores: three kernels over the square (Q K^T, softmax,
    # P V), as `roofline.naive_attention_work` counts them, not a fourth pass to scale it.
    scores = (q.float() * sm_scale) @ k.transpose(-1, -2)  # [B, H, P, S]
    if causal:
        q_pos = torch.arange(S - P, S, device=q.device)  # absolute query positions [P]
        visible = torch.arange(S, device=q.device)[None, :] <= q_pos[:, None]  # [P, S]
        scores = scores.masked_fill(~visible, float("-inf"))
    probs = torch.softmax(scores, dim=-1)
    return (probs @ v).to(q.dtype)
