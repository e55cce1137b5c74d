"""Compile every kernel the lab can launch for the GPUs learners have, on a machine with none.

    python -m labkit.gpu_compile [--targets sm_90a,...] [--kernels matmul,...] [--jobs N]
    make gpu-compile [TRITON=3.6]

Triton's wheel ships NVIDIA's `ptxas`, so `triton.compile` with a `GPUTarget` turns a kernel
into a cubin for any architecture without a GPU or a driver. This check compiles each kernel
with every autotune config and every constexpr combination the wrappers in kernels/ use (the
dtypes each GPU has, the lab's head dims, the KV-cache dtypes, the split-K and direct paths),
specialised as a launch from the lab specialises it (16-byte aligned pointers, unit strides
folded in, sizes divisible by 16 marked so), for:

  sm_75   T4 (the free Colab GPU)   fp16 and fp32; no bf16, no fp8     64 KiB shared per block
  sm_80   A100                      + bf16                             163 KiB
  sm_89   L4, RTX 4090              + fp8 caches                       99 KiB
  sm_90a  H100, H200                all                                227 KiB

(limits: labkit.specs, each with its source). It prints one JSON line per kernel and config:
kernel, config, target, shared_bytes, spill_bytes, registers (from ptxas's own report), and
fails (exit 1) on a compile error, on shared memory over the target's limit, on a register
spill in a config the lab keeps, or if the bf16 matmul does not use Hopper's wgmma on sm_90a.
Every failure is named on the last line. It runs without TRITON_INTERPRET (it sets it to 0
before triton is imported); results are cached by the kernel's source hash, options and
target, so a rerun with unchanged kernels compiles nothing. Where Triton is not installed (macOS,
Windows: no wheels) it says it is skipped, and why, and exits 0.
"""
from __future__ import annotations

import contextlib
import io
import json
import os
import re
import sys
import time
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

from .cli_args import Parser, UsageError
from .cpu_info import usable_cores
from .specs import gpu_limits

# (target name, the GPUS preset whose limits it is checked against)
TARGETS = {"sm_75": "T4", "sm_80": "A100-80GB", "sm_89": "L4", "sm_90a": "H100-SXM"}
KERNEL_NAMES = ("matmul", "flash_attention", "decode_attention", "kv_quant", "add_rms_norm", "rope_store", "swiglu")
# Head dims: the lab's GPU model (Llama 3.1 8B: 128), the dry run's lab-tiny (16), and 256, the
# largest the attention wrappers accept (where shared memory is tightest).
HEAD_DIMS = (16, 128, 256)
CACHE_VERSION = 1


@dataclass(frozen=True)
class Pointer:
    """A tensor argument as a launch specialises it: its element type, 16-byte aligned."""

    dtype: str  # triton's name: "bf16", "fp16", "fp32", "fp8e4nv", "i8", "i32"
    aligned: bool = True


@dataclass
class Variant:
    """One compilation: a kernel, its arguments as the wrapper passes them, a config, a target."""

    kernel: str  # the kernel's wrapper module, e.g. "matmul"
    fn_name: str  # the @triton.jit function in it
    args: dict  # every parameter by name: Pointer, int, float, str or bool (constexprs too)
    num_warps: int
    num_stages: int
    config: dict  # what the JSON line names: tile sizes, dtypes, paths
    target: str = ""
    checks: tuple = ()  # extra checks: "wgmma"
    results: dict = field(default_factory=dict)


# ---------------------------------------------------------------- specialisation, as a launch does it
def specialise(value, specialise_value: bool = True):
    """(type, attribute) of one argument as Triton's launcher specialises it: an int of 1 becomes
    the constant 1, one divisible by 16 is marked so ("D"), one of 2**31 or more is i64; a
    do_not_specialize parameter keeps only its type. Mirrors triton's specialize_impl (checked
    against it by tests/test_gpu_compile.py)."""
    if isinstance(value, Pointer):
        return f"*{value.dtype}", "D" if value.aligned else ""
    if isinstance(value, bool):
        return "u1", None
    if isinstance(value, int):
        kind = "i32" if -2**31 <= value < 2**31 else "u64" if value >= 2**63 else "i64"
        if not specialise_value:
            return kind, None
        if value == 1:
            return "constexpr", 1
        return kind, "D" if value % 16 == 0 else ""
    if isinstance(value, float):
        return "fp32", None
    raise TypeError(f"cannot specialise {value!r}")


def source_for(fn, args: dict):
    """triton.compiler.ASTSource for `fn` with `args` (constexpr parameters given by value)."""
    from triton.compiler import ASTSource  # triton after TRITON_INTERPRET is set (main)
    signature, constexprs, attrs = {}, {}, {}
    for i, param in enumerate(fn.params):
        name, value = param.name, args[param.name]
        if param.is_constexpr:
            signature[name], constexprs[name] = "constexpr", value
            continue
        kind, attr = specialise(value, not param.do_not_specialize)
        signature[name] = kind
        if kind == "constexpr":
            constexprs[name] = attr
        elif attr == "D":
            attrs[(i,)] = [["tt.divisibility", 16]]
    return ASTSource(fn=fn, signature=signature, constexprs=constexprs, attrs=attrs)


# ---------------------------------------------------------------- the launches of each kernel
TRITON_DTYPE = {"bf16": "bf16", "fp16": "fp16", "fp32": "fp32", "fp8": "fp8e4nv", "int8": "i8"}
ELEM_BYTES = {"bf16": 2, "fp16": 2, "fp32": 4, "fp8": 1, "int8": 1}


def kernel_module(name: str):
    """kernels.<name> (kernels/__init__ names its wrapper functions like their modules)."""
    import importlib  # the kernel modules load triton: only after TRITON_INTERPRET is set (main)
    return importlib.import_module(f"kernels.{name}")


def target_dtypes(capability: tuple[int, int]) -> tuple[str, ...]:
    """The dtypes the wrappers accept on a GPU of `capability` (kernels._runtime.MIN_CAPABILITY)."""
    import torch  # the kernels' own table is keyed by torch dtypes

    from kernels._runtime import MIN_CAPABILITY  # triton after TRITON_INTERPRET is set (main)
    names = {torch.bfloat16: "bf16", torch.float8_e4m3fn: "fp8"}
    too_new = {names[d] for d, need in MIN_CAPABILITY.items() if tuple(capability) < need}
    return tuple(d for d in ("fp16", "bf16", "fp32", "fp8", "int8") if d not in too_new)


def matmul_variants(dtypes, shared_limit: int | None, capability: tuple | None = None) -> list[Variant]:
    """The autotuned tiles the wrapper keeps for each dtype on this GPU, at the 8B's K = N = 4096
    with b a weight's transpose (ops.linear); the split-K path at each BLOCK_M, direct and partial;
    the split-K sum."""
    mm = kernel_module("matmul")
    K = N = 4096
    out = []
    for dt in (d for d in ("fp16", "bf16", "fp32") if d in dtypes):
        p, precision = Pointer(TRITON_DTYPE[dt]), "ieee" if dt == "fp32" else "tf32"
        for bm, bn, bk, stages, warps in mm.tiles_for(ELEM_BYTES[dt], shared_limit, capability):
            args = dict(a_ptr=p, b_ptr=p, c_ptr=p, M=2048, N=N, K=K, M_BUCKET=2048, stride_am=K, stride_ak=1,
                        stride_bk=1, stride_bn=K, stride_cm=N, stride_cn=1, INPUT_PRECISION=precision,
                        BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk, GROUP_M=mm.GROUP_M)
            out.append(Variant("matmul", "_matmul_kernel", args, warps, stages,
                               {"path": "tiled", "dtype": dt, "BLOCK_M": bm, "BLOCK_N": bn, "BLOCK_K": bk},
                               checks=("wgmma",) if dt == "bf16" else ()))
        for M in (16, 32, 64):
            plan = mm.split_k_plan(M, N, K, ELEM_BYTES[dt], sms=1, interpreted=False, capability=capability)
            # K = 4,096 steps evenly (EVEN_K, every model's products); a K that does not (masked
            # along K) once, at M = 16 with partial sums.
            for partial, even_k in ((False, True), (True, True)) + (((True, False),) if M == 16 else ()):
                args = dict(a_ptr=p, b_ptr=p, c_ptr=p, partial_ptr=Pointer("fp32"), M=M, N=N, K=K,
                            K_PER_SPLIT=plan["K_PER_SPLIT"], stride_am=K, stride_ak=1, stride_bk=1, stride_bn=K,
                            INPUT_PRECISION=precision, PARTIAL=partial, BLOCK_M=plan["BLOCK_M"],
                            BLOCK_N=plan["BLOCK_N"], BLOCK_K=plan["BLOCK_K"], EVEN_K=even_k)
                out.append(Variant("matmul", "_matmul_split_k_kernel", args, plan["num_warps"], plan["num_stages"],
                                   {"path": "split-k", "dtype": dt, "BLOCK_M": plan["BLOCK_M"], "BLOCK_N": plan["BLOCK_N"],
                                    "BLOCK_K": plan["BLOCK_K"], "partial": partial, "even_k": even_k},
                                   # 16-bit weights, the decode path's: an fp32 a tile of 16 x 16
                                   # is 1-2 values a thread, copied in 4 or 8 bytes
                                   checks=("async16",) if even_k and ELEM_BYTES[dt] == 2 else ()))
        args = dict(partial_ptr=Pointer("fp32"), c_ptr=p, MN=64 * N, SPLIT_K=3, BLOCK=mm.REDUCE_BLOCK)
        out.append(Variant("matmul", "_split_k_sum_kernel", args, 4, 3, {"path": "split-k sum", "dtype": dt}))
    return out


def flash_variants(dtypes, shared_limit: int | None, capability: tuple | None = None) -> list[Variant]:
    """Each autotune config the wrapper keeps for a dtype and head dim on this GPU, causal and not,
    q/k/v [B, H, P, D] contiguous."""
    fa = kernel_module("flash_attention")
    out = []
    for dt in (d for d in ("fp16", "bf16", "fp32") if d in dtypes):
        p = Pointer(TRITON_DTYPE[dt])
        for D in HEAD_DIMS:
            for bm, bn, stages, warps in fa.tiles_for(ELEM_BYTES[dt], D, shared_limit, capability):
                for causal in (True, False) if D == 128 else (True,):  # the lab's prefill is causal
                    strides = dict(zip(("b", "h", "p", "d"), (32 * 4096 * D, 4096 * D, D, 1)))
                    args = dict(q_ptr=p, k_ptr=p, v_ptr=p, o_ptr=p, qk_scale=0.1, H=32, P=4096, S=4096,
                                P_BUCKET=fa.bucket(4096), S_BUCKET=fa.bucket(4096), GROUP=4,
                                CAUSAL=causal, HEAD_DIM=D, INPUT_PRECISION="ieee" if dt == "fp32" else "tf32",
                                BLOCK_M=bm, BLOCK_N=bn)
                    for t in "qkvo":
                        args.update({f"stride_{t}{'p' if t in 'qo' else 's'}": strides["p"]}, **{
                            f"stride_{t}{k}": strides[k] for k in "bhd"})
                    out.append(Variant("flash_attention", "_flash_attention_kernel", args, warps, stages,
                                       {"dtype": dt, "D": D, "causal": causal, "BLOCK_M": bm, "BLOCK_N": bn}))
    return out


# The SCALE_V candidate compiled beside a 1-byte cache's tuned tile on Hopper: 64-key tiles, as
# int8's 128-key one spilled 16 bytes with it under triton 3.6 (the GPU image's; none under 3.9).
SCALE_V_TILE = (64, 3, 4, True)


def decode_variants(dtypes, shared_limit: int | None, capability: tuple | None = None) -> list[Variant]:
    """Every (q dtype, cache dtype, head dim) the wrapper accepts on this GPU, with the tile it
    picks there, and on Hopper for a 1-byte cache under a bf16 q SCALE_V_TILE too (the candidate
    scripts/gpu_tune.py times beside it); the combine kernel at each of its split blocks."""
    da = kernel_module("decode_attention")
    out = []
    for q_dt in (d for d in ("fp16", "bf16", "fp32") if d in dtypes):
        for c_dt in (d for d in ("fp16", "bf16", "fp32", "fp8", "int8") if d in dtypes):
            for D in HEAD_DIMS:
                c = da.split_constexprs(q_dt, c_dt, D, group=4, shared_limit=shared_limit, capability=capability)
                if c is None:  # the wrapper refuses this combination on this GPU
                    continue
                plans = [c]
                if capability is not None and da.tuned_tiles(q_dt, c_dt, D, capability) and not c["constexprs"]["SCALE_V"]:
                    plans.append(da.split_constexprs(q_dt, c_dt, D, group=4, shared_limit=shared_limit,
                                                     capability=capability, tile=SCALE_V_TILE))
                out += [_decode_split_variant(q_dt, c_dt, D, plan) for plan in plans]
        for D in HEAD_DIMS:
            for block_s in sorted(set(da.COMBINE_BLOCKS)):
                args = dict(m_ptr=Pointer("fp32"), l_ptr=Pointer("fp32"), acc_ptr=Pointer("fp32"),
                            o_ptr=Pointer(TRITON_DTYPE[q_dt]), NUM_SPLITS=8, HEAD_DIM=D, BLOCK_S=block_s)
                out.append(Variant("decode_attention", "_decode_combine_kernel", args, 4, 3,
                                   {"combine": True, "q": q_dt, "D": D, "BLOCK_S": block_s}))
    return out


def _decode_split_variant(q_dt: str, c_dt: str, D: int, plan: dict) -> Variant:
    """The split kernel at the 8B's heads (8 KV heads, groups of 4) over an 8,192-key cache, with
    `plan` (`split_constexprs`' output)."""
    S, scale = 8192, Pointer("fp32")
    args = dict(q_ptr=Pointer(TRITON_DTYPE[q_dt]), k_ptr=Pointer(TRITON_DTYPE[c_dt]),
                v_ptr=Pointer(TRITON_DTYPE[c_dt]), k_scale_ptr=scale, v_scale_ptr=scale,
                lengths_ptr=Pointer("i32"), m_ptr=Pointer("fp32"), l_ptr=Pointer("fp32"),
                acc_ptr=Pointer("fp32"), qk_scale=0.1, Hkv=8, GROUP=4, NUM_SPLITS=8,
                stride_qb=32 * D, stride_qh=D, stride_qd=1,
                stride_kb=8 * S * D, stride_kh=S * D, stride_ks=D, stride_kd=1,
                stride_vb=8 * S * D, stride_vh=S * D, stride_vs=D, stride_vd=1,
                **_int8_scale_strides(c_dt, 8, S), **plan["constexprs"])
    config = {"q": q_dt, "cache": c_dt, "D": D, "BLOCK_N": plan["constexprs"]["BLOCK_N"], "stages": plan["num_stages"]}
    if plan["constexprs"]["SCALE_V"]:
        config["SCALE_V"] = True
    return Variant("decode_attention", "_decode_split_kernel", args, plan["num_warps"], plan["num_stages"], config)


def _int8_scale_strides(cache_dtype: str, kv_heads: int, positions: int) -> dict:
    """stride_sb, stride_sh, stride_ss of int8's [B, Hkv, S] scales; 0 for other caches (unread)."""
    int8 = cache_dtype == "int8"
    return dict(stride_sb=kv_heads * positions if int8 else 0, stride_sh=positions if int8 else 0,
                stride_ss=1 if int8 else 0)


def kv_quant_variants(dtypes, shared_limit: int | None, capability: tuple | None = None) -> list[Variant]:
    """The quantiser for each input dtype and quantised cache dtype, at each head dim."""
    kq = kernel_module("kv_quant")
    out = []
    for x_dt in (d for d in ("fp16", "bf16", "fp32") if d in dtypes):
        for c_dt in (d for d in ("int8", "fp8") if d in dtypes):
            for D in HEAD_DIMS[:2]:  # a row loop: the head dim changes only the row's width
                args = dict(x_ptr=Pointer(TRITON_DTYPE[x_dt]), q_ptr=Pointer(TRITON_DTYPE[c_dt]),
                            scale_ptr=Pointer("fp32"), inv_scale_ptr=Pointer("fp32"), R=65536, D=D,
                            stride_xr=D, IS_INT8=c_dt == "int8", BLOCK_R=kq.BLOCK_R, BLOCK_D=D)
                out.append(Variant("kv_quant", "_quantize_kv_kernel", args, 4, 3, {"x": x_dt, "cache": c_dt, "D": D}))
    return out


def add_rms_norm_variants(dtypes, shared_limit: int | None, capability: tuple | None = None) -> list[Variant]:
    """The residual add and norm for each activation dtype at the hidden sizes of lab-tiny (the
    dry run), the 8B and the widest row the wrapper takes, with and without the add."""
    an = kernel_module("add_rms_norm")
    out = []
    for dt in (d for d in ("fp16", "bf16", "fp32") if d in dtypes):
        for N in (64, 4096, an.MAX_N):
            for has_delta in (True, False):
                args = dict(x_ptr=Pointer(TRITON_DTYPE[dt]), delta_ptr=Pointer(TRITON_DTYPE[dt]),
                            weight_ptr=Pointer(TRITON_DTYPE[dt]), sum_ptr=Pointer(TRITON_DTYPE[dt]),
                            out_ptr=Pointer(TRITON_DTYPE[dt]), R=65536, N=N, stride_x=N, stride_d=N, eps=1e-5,
                            HAS_DELTA=has_delta, BLOCK_N=N)
                out.append(Variant("add_rms_norm", "_add_rms_norm_kernel", args, an.num_warps_for(N), 3,
                                   {"x": dt, "N": N, "HAS_DELTA": has_delta}))
    return out


def rope_store_variants(dtypes, shared_limit: int | None, capability: tuple | None = None) -> list[Variant]:
    """RoPE and the cache write for each activation dtype and cache dtype, at each head dim: a
    decode step's (q heads out; the position from the cache's device lengths, a CUDA graph, or one
    int, eager) and a prefill's (q and k heads out, one start for T tokens)."""
    rs = kernel_module("rope_store")
    kind = {"int8": rs.CACHE_INT8, "fp8": rs.CACHE_FP8}
    H, Hkv, S, P = 32, 8, 8192, 4096  # the 8B's heads over an 8,192-position cache; a prefill of 4,096
    forms = (("decode", True), ("decode", False), ("prefill", False))
    out = []
    for act in (d for d in ("fp16", "bf16", "fp32") if d in dtypes):
        for c_dt in dtypes:
            for D, (form, from_ptr) in ((D, f) for D in HEAD_DIMS[:2] for f in forms):  # a row: D is its width
                prefill = form == "prefill"
                args = dict(qkv_ptr=Pointer(TRITON_DTYPE[act]), cos_ptr=Pointer("fp32"), sin_ptr=Pointer("fp32"),
                            q_ptr=Pointer(TRITON_DTYPE[act]), k_ptr=Pointer(TRITON_DTYPE[c_dt]),
                            v_ptr=Pointer(TRITON_DTYPE[c_dt]), k_scale_ptr=Pointer("fp32"),
                            v_scale_ptr=Pointer("fp32"), pos_ptr=Pointer("i32"), pos0=0, T=P if prefill else 1,
                            H=H, Hkv=Hkv, OUT_HEADS=H + Hkv if prefill else H, stride_qkv=(H + 2 * Hkv) * D,
                            stride_cos_b=0 if prefill else D, stride_cos_t=D if prefill else 0,
                            stride_cb=Hkv * S * D, stride_ch=S * D,
                            stride_cs=D, **_int8_scale_strides(c_dt, Hkv, S), HALF=D // 2,
                            CACHE_KIND=kind.get(c_dt, rs.CACHE_FLOAT), POS_FROM_PTR=from_ptr, BLOCK_HALF=D // 2)
                config = {"x": act, "cache": c_dt, "D": D, "form": form}
                if not prefill:
                    config["POS_FROM_PTR"] = from_ptr
                out.append(Variant("rope_store", "_rope_store_kernel", args, 1, 3, config))
    return out


def swiglu_variants(dtypes, shared_limit: int | None, capability: tuple | None = None) -> list[Variant]:
    """The MLP's gate for each activation dtype, at the 8B's width (14,336) and lab-tiny's (the dry
    run's), in blocks of BLOCK_F columns."""
    sw = kernel_module("swiglu")
    out = []
    for dt in (d for d in ("fp16", "bf16", "fp32") if d in dtypes):
        for F in (14336, 128):
            args = dict(gate_up_ptr=Pointer(TRITON_DTYPE[dt]), out_ptr=Pointer(TRITON_DTYPE[dt]), R=65536, F=F,
                        stride_gu=2 * F, BLOCK=sw.BLOCK_F)
            out.append(Variant("swiglu", "_swiglu_kernel", args, 8, 3, {"x": dt, "F": F}))
    return out


VARIANTS = {"matmul": matmul_variants, "flash_attention": flash_variants,
            "decode_attention": decode_variants, "kv_quant": kv_quant_variants,
            "add_rms_norm": add_rms_norm_variants, "rope_store": rope_store_variants, "swiglu": swiglu_variants}


# ---------------------------------------------------------------- compiling one variant
def capability_of(target: str) -> int:
    """"sm_90a" -> 90."""
    return int(re.sub(r"\D", "", target))


def cache_dir() -> Path:
    """Where results are kept between runs: $LABKIT_CACHE_DIR/gpu-compile (default ~/.cache/labkit)."""
    return Path(os.environ.get("LABKIT_CACHE_DIR") or Path.home() / ".cache" / "labkit") / "gpu-compile"


def compile_variant(variant: Variant, use_cache: bool = True) -> dict:
    """Compile `variant` for its target; its JSON line's fields, with "error" on failure. A result
    is cached under the kernel source's hash (triton's own, which covers the functions it calls),
    the arguments' specialisation, the options, the target and triton's version."""
    import hashlib  # the cache key

    import triton  # after TRITON_INTERPRET is set (main)
    fn = getattr(kernel_module(variant.kernel), variant.fn_name)
    fn = fn.fn if hasattr(fn, "configs") else fn  # an autotuned kernel wraps the JITFunction
    key = hashlib.sha256(repr((CACHE_VERSION, source_for(fn, variant.args).hash(), variant.target, variant.num_warps,
                               variant.num_stages, variant.checks, triton.__version__)).encode()).hexdigest()[:32]
    path = cache_dir() / f"{key}.json"
    if use_cache and path.exists():
        return {**json.loads(path.read_text()), "cached": True}
    result = _compile(fn, variant)
    if use_cache and "error" not in result:
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            tmp = path.with_suffix(f".{os.getpid()}.tmp")
            tmp.write_text(json.dumps(result))
            tmp.replace(path)
        except OSError:  # an unwritable cache only costs time
            pass
    return result


def _compile(fn, variant: Variant) -> dict:
    import triton  # after TRITON_INTERPRET is set (main)
    from triton.backends.compiler import GPUTarget  # after TRITON_INTERPRET is set (main)
    start_s = time.perf_counter()
    log = io.StringIO()
    try:
        with contextlib.redirect_stdout(log):  # ptxas's report, printed by triton (TRITON_DUMP_PTXAS_LOG)
            compiled = triton.compile(source_for(fn, variant.args), target=GPUTarget("cuda", capability_of(variant.target), 32),
                                      options={"num_warps": variant.num_warps, "num_stages": variant.num_stages})
    except Exception as err:  # noqa: BLE001 - a compile error is this check's finding
        return {"error": f"{type(err).__name__}: {str(err).strip().splitlines()[0] if str(err).strip() else ''}"[:300],
                "compile_s": round(time.perf_counter() - start_s, 2)}
    report = ptxas_report(log.getvalue())
    result = {"shared_bytes": compiled.metadata.shared, **report, "compile_s": round(time.perf_counter() - start_s, 2)}
    if "wgmma" in variant.checks and capability_of(variant.target) >= 90:
        result["wgmma"] = "wgmma.mma_async" in compiled.asm["ptx"]
    if "async16" in variant.checks and capability_of(variant.target) >= 80:  # cp.async came with sm_80
        result["async16"] = async16(compiled.asm["ptx"])
    return result


def async16(ptx: str) -> bool:
    """Whether a kernel's global loads are all 16-byte asynchronous copies (`cp.async.cg`, which
    moves only 16 bytes): none plain (`ld.global`), none of 4 or 8 bytes (`cp.async.ca`). The
    decode-shaped matmul's weights stream at HBM speed only so; when Triton could not prove them
    aligned it loaded them two bytes at a time (`ld.global.b16`), at half the speed on an H200."""
    return "cp.async.cg.shared.global" in ptx and not re.search(r"\bld\.global\b|\bcp\.async\.ca\.", ptx)


def ptxas_report(log: str) -> dict:
    """registers and spill_bytes (stores) from ptxas -v's report; None where it printed none."""
    regs = re.findall(r"Used (\d+) registers", log)
    spills = re.findall(r"(\d+) bytes spill stores", log)
    return {"registers": int(regs[-1]) if regs else None, "spill_bytes": int(spills[-1]) if spills else None}


# ---------------------------------------------------------------- the check
def variants_for(targets, kernels) -> list[Variant]:
    """Every variant of `kernels` for each of `targets`, each tagged with its target."""
    out = []
    for target in targets:
        gpu = gpu_limits(TARGETS[target])
        dtypes = target_dtypes(gpu.compute_capability)
        for kernel in kernels:
            for v in VARIANTS[kernel](dtypes, gpu.shared_bytes_per_block, gpu.compute_capability):
                v.target = target
                out.append(v)
    return out


# Spills that a GPU timing showed cost less than the tile they come with, as (kernel function,
# config entries naming the tile) -> bytes allowed: the split-K tile and the fp8 decode tile that
# scripts/gpu_tune.py timed fastest on an H200 (data/recordings/gpu-tune-h200-20261204-1541.json,
# compiled there by triton 3.6), where triton 3.9's ptxas reports 32 and 20 bytes of spill. The
# nearest tiles that do not spill took 3 % (split-K at M = 1 and 16; 28 % at M = 64) and 8 % (fp8) longer.
# Since EVEN_K the split-K tile spills only on its masked path (a K that is not a multiple of 128).
TIMED_SPILLS = {("_matmul_split_k_kernel", (("BLOCK_N", 64), ("BLOCK_K", 128), ("num_warps", 4))): 32,
                ("_decode_split_kernel", (("cache", "fp8"), ("BLOCK_N", 64), ("num_warps", 4), ("SCALE_V", None))): 20}


def spill_allowed(variant: Variant) -> int:
    """Bytes of spill TIMED_SPILLS allows this variant (0 for every other)."""
    seen = {**variant.config, "num_warps": variant.num_warps}
    return max((allowed for (fn, entries), allowed in TIMED_SPILLS.items()
                if fn == variant.fn_name and all(seen.get(k) == v for k, v in entries)), default=0)


def findings(variant: Variant) -> list[str]:
    """What is wrong with a compiled variant, as short phrases (none: it passes)."""
    r, limit = variant.results, gpu_limits(TARGETS[variant.target]).shared_bytes_per_block
    if "error" in r:
        return [f"does not compile: {r['error']}"]
    wrong = []
    if r["shared_bytes"] > limit:
        wrong.append(f"{r['shared_bytes']:,} bytes of shared memory > {limit:,}")
    if r["spill_bytes"] is None:
        wrong.append("no ptxas report")
    elif r["spill_bytes"] > spill_allowed(variant):
        wrong.append(f"spills {r['spill_bytes']} bytes of registers")
    if r.get("wgmma") is False:
        wrong.append("no wgmma on sm_90a")
    if r.get("async16") is False:
        wrong.append("global loads not all 16-byte asynchronous copies")
    return wrong


def line(variant: Variant) -> dict:
    """The variant's JSON line."""
    r = variant.results
    out = {"kernel": variant.kernel if variant.fn_name.startswith(f"_{variant.kernel}") or variant.kernel == "matmul"
           and variant.fn_name == "_matmul_kernel" else f"{variant.kernel}:{variant.fn_name.strip('_')}",
           "config": {**variant.config, "num_warps": variant.num_warps, "num_stages": variant.num_stages},
           "target": variant.target, "shared_bytes": r.get("shared_bytes"), "spill_bytes": r.get("spill_bytes"),
           "registers": r.get("registers")}
    for check in ("wgmma", "async16"):
        if check in r:
            out[check] = r[check]
    wrong = findings(variant)
    out["ok"] = not wrong
    if wrong:
        out["problems"] = wrong
    return out


def _compile_in_worker(variant: Variant) -> dict:
    return compile_variant(variant)


def run(targets, kernels, jobs: int, out=sys.stdout) -> int:
    """Compile every variant (in `jobs` processes), print a JSON line each and a summary; 1 if any failed."""
    start_s = time.perf_counter()
    variants = variants_for(targets, kernels)
    if jobs > 1:
        import multiprocessing  # a fork per worker: triton and the kernels are imported already
        with ProcessPoolExecutor(jobs, mp_context=multiprocessing.get_context("fork")) as pool:
            results = list(pool.map(_compile_in_worker, variants, chunksize=1))
    else:
        results = [compile_variant(v) for v in variants]
    failed = []
    for v, r in zip(variants, results):
        v.results = r
        entry = line(v)
        print(json.dumps(entry), file=out, flush=True)
        if not entry["ok"]:
            failed.append(f"{entry['kernel']} {entry['target']} {entry['config']}: {'; '.join(entry['problems'])}")
    import triton  # loaded by the compiles already
    summary = {"gpu_compile": "ok" if not failed else f"{len(failed)} failed", "variants": len(variants),
               "targets": list(targets), "triton": triton.__version__,
               "wall_s": round(time.perf_counter() - start_s, 1),
               "compile_s": round(sum(r.get("compile_s", 0) for r in results if not r.get("cached")), 1),
               "cached": sum(1 for r in results if r.get("cached"))}
    if failed:
        summary["failed"] = failed
    print(json.dumps(summary), file=out, flush=True)
    return 1 if failed else 0


def parse_args(argv=None):
    parser = Parser(prog="python -m labkit.gpu_compile", description=__doc__.splitlines()[0])
    parser.add_argument("--targets", default=",".join(TARGETS), help=f"a comma-separated subset of {','.join(TARGETS)}")
    parser.add_argument("--kernels", default=",".join(KERNEL_NAMES), help=f"a subset of {','.join(KERNEL_NAMES)}")
    parser.add_argument("--jobs", type=int, default=usable_cores(),
                        help="compiler processes (the cores this process may use)")
    args = parser.parse_args(argv)
    for name, known in (("targets", TARGETS), ("kernels", KERNEL_NAMES)):
        chosen = tuple(x.strip() for x in getattr(args, name).split(",") if x.strip())
        if not chosen or set(chosen) - set(known):
            raise UsageError(f"--{name}: unknown {', '.join(sorted(set(chosen) - set(known))) or '(none)'}; "
                             f"known: {','.join(known)}")
        setattr(args, name, chosen)
    if args.jobs < 1:
        raise UsageError(f"--jobs must be at least 1, got {args.jobs}")
    return args


def use_compiler() -> None:
    """Compile for real in this process: TRITON_INTERPRET=0 before triton is imported (`import
    labkit` sets it to 1 on a machine without an NVIDIA driver), ptxas's report printed."""
    if "triton" in sys.modules and os.environ.get("TRITON_INTERPRET") == "1":
        raise UsageError("triton was imported in interpreter mode; run the check in a fresh process")
    os.environ["TRITON_INTERPRET"] = "0"
    os.environ["TRITON_DUMP_PTXAS_LOG"] = "1"  # registers and spills, from ptxas itself
    os.environ["TRITON_ALWAYS_COMPILE"] = "1"  # so ptxas runs (and reports) even for a cached kernel
    os.environ.setdefault("TRITON_DEFAULT_FP_FUSION", "1")  # triton 3.9's default, without its warning


def main(argv=None) -> int:
    try:
        args = parse_args(argv)
        use_compiler()
    except UsageError as err:
        print(f"gpu_compile: error: {err}", file=sys.stderr)
        return 2
    from .backend import TRITON_MISSING, triton_installed, triton_too_old  # torch loads here, after the arguments
    if not triton_installed():  # macOS, Windows: nothing to compile with (ptxas comes in triton's wheel)
        print(f"gpu_compile: skipped: {TRITON_MISSING}", flush=True)
        return 0
    if too_old := triton_too_old():
        print(f"gpu_compile: error: {too_old}", file=sys.stderr)
        return 2
    return run(args.targets, args.kernels, args.jobs)


if __name__ == "__main__":
    raise SystemExit(main())


def compiled_ir(variant: Variant, stage: str = "ttir") -> str:
    """The IR of `variant` at `stage` ("ttir", "ttgir", "ptx"), compiled afresh for its target."""
    import triton  # after TRITON_INTERPRET is set (main)
    from triton.backends.compiler import GPUTarget  # after TRITON_INTERPRET is set (main)
    fn = getattr(kernel_module(variant.kernel), variant.fn_name)
    fn = fn.fn if hasattr(fn, "configs") else fn
    compiled = triton.compile(source_for(fn, variant.args), target=GPUTarget("cuda", capability_of(variant.target), 32),
                              options={"num_warps": variant.num_warps, "num_stages": variant.num_stages})
    return compiled.asm[stage]


def store_offset_types(ir: str) -> list[list[str]]:
    """For each tt.store in `ir`, the element types of the offsets added along its pointer's
    chain of tt.addptr ops (followed back through splats and broadcasts), outermost first: a
    store whose rows x row-length offset is 64-bit shows an "i64" there (a small column offset
    added last may stay "i32")."""
    defs = {}
    for text in ir.splitlines():
        m = re.match(r"\s*(%[\w.]+)(?::\d+)? = (\S+) (.*)", text)
        if m:
            defs[m.group(1)] = (m.group(2), m.group(3))
    found = []
    for text in ir.splitlines():
        m = re.match(r"\s*tt\.store (%[\w.]+)", text)
        if not m:
            continue
        name, chain = m.group(1), []
        while name in defs:
            op, rest = defs[name]
            if op == "tt.addptr":
                chain.append(re.findall(r"(i\d+)>?", rest.split(":")[-1])[-1])
            elif op not in ("tt.splat", "tt.broadcast", "tt.expand_dims"):
                break
            name = rest.split()[0].rstrip(",")
        found.append(chain)
    return found
