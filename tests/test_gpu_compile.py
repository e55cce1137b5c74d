"""labkit.gpu_compile and what it found: kernels compiled for real GPUs on a machine without one.

The compiles run in subprocesses (TRITON_INTERPRET must be 0 before triton is imported, and this
test session imported triton in interpreter mode); the pure parts (specialisation, the launch
plans, the findings) are checked here directly.
"""
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from labkit import backend

if not backend.triton_installed():  # macOS, Windows: no Triton, so no compiler (tests/test_no_triton.py: it says so)
    pytest.skip(f"skipped: {backend.TRITON_MISSING}", allow_module_level=True)

from kernels import matmul as _matmul  # noqa: E402,F401 - loads the module object below
from labkit import gpu_compile as gc  # noqa: E402
from labkit.specs import get_model, gpu_limits  # noqa: E402

MM = sys.modules["kernels.matmul"]
ROOT = Path(__file__).resolve().parent.parent


def run_in_compiler(code: str, timeout=600) -> subprocess.CompletedProcess:
    """Run `code` in a fresh python with labkit.gpu_compile.use_compiler() already called."""
    prelude = "from labkit import gpu_compile as gc; gc.use_compiler()\n"
    return subprocess.run([sys.executable, "-c", prelude + code], cwd=ROOT, capture_output=True, text=True,
                          timeout=timeout, env={**os.environ, "TRITON_INTERPRET": "0"})


def test_specialisation_follows_the_launchers_rules():
    assert gc.specialise(1) == ("constexpr", 1)
    assert gc.specialise(4096) == ("i32", "D") and gc.specialise(4097) == ("i32", "")
    assert gc.specialise(2**31) == ("i64", "D") and gc.specialise(2**31 - 1) == ("i32", "")
    assert gc.specialise(1, specialise_value=False) == ("i32", None)  # do_not_specialize
    assert gc.specialise(gc.Pointer("bf16")) == ("*bf16", "D") and gc.specialise(0.5) == ("fp32", None)


def test_specialisation_agrees_with_triton_itself():
    """The mirror of triton's specialize_impl, against triton's own (in a compiling process)."""
    done = run_in_compiler(
        "from triton._C.libtriton import native_specialize_impl as spec\n"
        "from triton.backends.nvidia.compiler import CUDABackend as B\n"
        "vals = [1, 0, 16, 17, 4096, 2**31 - 1, 2**31, -5]\n"
        "print(all(tuple(spec(B, v, False, True, True))[:2] == gc.specialise(v) for v in vals))\n")
    if "ImportError" in done.stderr or "cannot import" in done.stderr:
        pytest.skip("this triton has no native_specialize_impl")
    assert done.stdout.strip() == "True", done.stderr[-2000:]


@pytest.mark.parametrize("target,has,lacks", [
    ("sm_75", {"fp16", "fp32", "int8"}, {"bf16", "fp8"}), ("sm_80", {"bf16", "int8"}, {"fp8"}),
    ("sm_89", {"bf16", "fp8"}, set()), ("sm_90a", {"bf16", "fp8", "int8", "fp16", "fp32"}, set())])
def test_each_target_compiles_the_dtypes_its_gpu_has(target, has, lacks):
    dtypes = set(gc.target_dtypes(gpu_limits(gc.TARGETS[target]).compute_capability))
    assert has <= dtypes and not lacks & dtypes
    variants = gc.variants_for([target], gc.KERNEL_NAMES)
    used = {v.config.get(k) for v in variants for k in ("dtype", "q", "cache", "x")} - {None}
    assert not lacks & used and {"fp16", "fp32"} <= used


def test_every_kernel_and_path_is_in_the_check():
    variants = gc.variants_for(["sm_90a"], gc.KERNEL_NAMES)
    names = {(v.kernel, v.fn_name) for v in variants}
    assert names == {("matmul", "_matmul_kernel"), ("matmul", "_matmul_split_k_kernel"),
                     ("matmul", "_split_k_sum_kernel"), ("flash_attention", "_flash_attention_kernel"),
                     ("decode_attention", "_decode_split_kernel"), ("decode_attention", "_decode_combine_kernel"),
                     ("kv_quant", "_quantize_kv_kernel"), ("add_rms_norm", "_add_rms_norm_kernel"),
                     ("rope_store", "_rope_store_kernel"), ("swiglu", "_swiglu_kernel")}
    bf16 = [v for v in variants if v.fn_name == "_matmul_kernel" and v.config["dtype"] == "bf16"]
    assert len(bf16) == len(MM.TILES_16BIT) and all("wgmma" in v.checks for v in bf16)
    split = [v for v in variants if v.fn_name == "_matmul_split_k_kernel"]
    assert all(("async16" in v.checks) == (v.config["even_k"] and v.config["dtype"] != "fp32") for v in split)
    assert any("async16" in v.checks for v in split)
    assert {v.config["D"] for v in variants if v.kernel == "flash_attention"} == set(gc.HEAD_DIMS)
    assert {v.config["form"] for v in variants if v.kernel == "rope_store"} == {"decode", "prefill"}


def test_findings_name_each_problem():
    v = gc.Variant("matmul", "_matmul_kernel", {}, 4, 3, {}, target="sm_75")
    v.results = {"shared_bytes": 70000, "spill_bytes": 8, "registers": 255, "wgmma": False}
    assert gc.findings(v) == ["70,000 bytes of shared memory > 65,536", "spills 8 bytes of registers",
                              "no wgmma on sm_90a"]
    v.results = {"shared_bytes": 1024, "spill_bytes": 0, "registers": 40, "async16": False}
    assert gc.findings(v) == ["global loads not all 16-byte asynchronous copies"] and gc.line(v)["async16"] is False
    v.results = {"error": "PTXASError: boom"}
    assert gc.findings(v) == ["does not compile: PTXASError: boom"]
    v.results = {"shared_bytes": 1024, "spill_bytes": 0, "registers": 40}
    assert gc.findings(v) == [] and gc.line(v)["ok"] is True


def test_async16_tells_16_byte_copies_from_narrower_loads():
    copy16 = "cp.async.cg.shared.global [ %r1 + 0 ], [ %rd1 + 0 ], 0x10, %r2;\n"
    assert gc.async16(copy16 * 4)
    assert not gc.async16(copy16 + "ld.global.b16 { %rs1 }, [ %rd2 + 0 ];\n")  # the split-K kernel before EVEN_K
    assert not gc.async16(copy16 + "cp.async.ca.shared.global [ %r3 + 0 ], [ %rd3 + 0 ], 0x8, %r4;\n")
    assert not gc.async16("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32\n")  # no copies at all


def test_the_ptxas_report_is_read():
    log = ("ptxas info    : Function properties for k\n    8840 bytes stack frame, 13464 bytes spill stores, "
           "22344 bytes spill loads\nptxas info    : Used 64 registers, used 1 barriers\n")
    assert gc.ptxas_report(log) == {"registers": 64, "spill_bytes": 13464}
    assert gc.ptxas_report("") == {"registers": None, "spill_bytes": None}


def test_bad_arguments_exit_2_with_one_line():
    for args in (["--targets", "sm_61"], ["--kernels", "gemv"], ["--jobs", "0"]):
        done = subprocess.run([sys.executable, "-m", "labkit.gpu_compile", *args], cwd=ROOT, capture_output=True,
                              text=True, timeout=120)
        assert done.returncode == 2 and len(done.stderr.strip().splitlines()) == 1, done.stderr


@pytest.mark.parametrize("version", ["2.0", "abc"])
def test_make_gpu_compile_refuses_a_triton_before_3_before_making_its_venv(version):
    """TRITON=2.0 built a side venv (a download), then died with a KeyError in triton 2's autotuner."""
    done = subprocess.run(["make", "--no-print-directory", "-o", "venv", "gpu-compile", f"TRITON={version}"], cwd=ROOT,
                          capture_output=True, text=True, timeout=60)
    assert done.returncode == 2 and done.stdout == "" and not (ROOT / "build" / f"venv-triton{version}").exists()
    assert done.stderr.splitlines()[0] == (f"gpu-compile: error: TRITON={version}: the lab's kernels need triton 3 "
                                           "(checked with 3.6 and 3.9)")


# ---------------------------------------------------------------- 64-bit offsets, in the compiled IR
LARGEST_TOKENS = 256 * 32768  # the lab's largest batch x prompt on a GPU (labkit.sizes.LAB_SETTINGS)


def test_offsets_that_can_pass_2_31_are_64_bit_in_the_compiled_ir():
    """The largest products the lab allows, compiled for sm_90a without allocating anything:
    every store's offsets are i64 where a product of sizes passes 2**31 (M x N of the 8B's
    gate/up product at 8.4M tokens; the rows x D of a KV cache quantised at B = 256, S = 128k)."""
    spec = get_model("llama-3.1-8b")
    M, N, K = LARGEST_TOKENS, spec.intermediate_size, spec.hidden_size
    assert M * N > 2**31 and M < 2**31  # the sizes alone fit i32: only their product wraps
    rows, D = 256 * spec.n_kv_heads * spec.max_context, spec.head_dim
    assert rows * D > 2**31
    code = (
        "import json\n"
        "out = {}\n"
        "v = [v for v in gc.matmul_variants(('fp16',), None) if v.fn_name == '_matmul_kernel'][-1]\n"
        f"v.args.update(M={M}, N={N}, K={K}, M_BUCKET=8192, stride_am={K}, stride_bn={K}, stride_cm={N}); v.target = 'sm_90a'\n"
        "out['matmul'] = gc.store_offset_types(gc.compiled_ir(v))\n"
        "v = [v for v in gc.matmul_variants(('fp16',), None) if v.fn_name == '_matmul_split_k_kernel'][-1]\n"
        f"v.args.update(M=64, N={N}, K={K}, stride_am={K}, stride_bn={K}); v.target = 'sm_90a'\n"
        "out['matmul split-k'] = gc.store_offset_types(gc.compiled_ir(v))\n"
        "v = [v for v in gc.kv_quant_variants(('fp16', 'int8'), None) if v.config['D'] == 128][0]\n"
        f"v.args.update(R={rows}, D={D}, stride_xr={D}); v.target = 'sm_90a'\n"
        "out['kv_quant'] = gc.store_offset_types(gc.compiled_ir(v))\n"
        "print(json.dumps(out))\n")
    done = run_in_compiler(code)
    assert done.returncode == 0, done.stderr[-3000:]
    found = json.loads(done.stdout.strip().splitlines()[-1])
    for kernel, chains in found.items():
        assert chains and all("i64" in chain for chain in chains), f"{kernel}: store offsets {chains}"


def test_v_scaled_in_its_tile_reads_a_1_byte_cache_s_v_from_shared_memory_in_words_not_bytes():
    """What decode_attention's comment on SCALE_V says of the sm_90a code, per 1-byte cache at the
    8B's D = 128 under a bf16 q: the tuned tile reads V a byte at a time from shared memory
    (ld.shared.b8), the SCALE_V candidate never does."""
    code = (
        "import json\n"
        "out = {}\n"
        "for v in gc.decode_variants(('bf16', 'fp8', 'int8'), 232448, (9, 0)):\n"
        "    if v.fn_name == '_decode_split_kernel' and v.config['q'] == 'bf16' and v.config['D'] == 128 \\\n"
        "            and v.config['cache'] in ('fp8', 'int8'):\n"
        "        v.target = 'sm_90a'\n"
        "        out[v.config['cache'] + (' SCALE_V' if v.config.get('SCALE_V') else '')] = \\\n"
        "            gc.compiled_ir(v, 'ptx').count('ld.shared.b8')\n"
        "print(json.dumps(out))\n")
    done = run_in_compiler(code)
    assert done.returncode == 0, done.stderr[-3000:]
    bytewise = json.loads(done.stdout.strip().splitlines()[-1])
    assert set(bytewise) == {"fp8", "fp8 SCALE_V", "int8", "int8 SCALE_V"}
    assert bytewise["fp8"] > 0 and bytewise["int8"] > 0, bytewise
    assert bytewise["fp8 SCALE_V"] == bytewise["int8 SCALE_V"] == 0, bytewise


@pytest.mark.slow
def test_the_check_compiles_a_kernel_and_prints_its_lines(tmp_path):
    """The command end to end on the smallest kernel: JSON lines with the promised keys, then the
    summary; a second run takes every result from the cache."""
    env = {**os.environ, "LABKIT_CACHE_DIR": str(tmp_path)}
    cmd = [sys.executable, "-m", "labkit.gpu_compile", "--targets", "sm_90a", "--kernels", "kv_quant", "--jobs", "2"]
    first = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=600, env=env)
    assert first.returncode == 0, first.stdout[-3000:] + first.stderr[-3000:]
    lines = [json.loads(x) for x in first.stdout.strip().splitlines()]
    *variants, summary = lines
    assert variants and all({"kernel", "config", "target", "shared_bytes", "spill_bytes", "registers"} <= set(v)
                            for v in variants)
    assert all(v["target"] == "sm_90a" and v["ok"] and v["registers"] > 0 for v in variants)
    assert summary["gpu_compile"] == "ok" and summary["variants"] == len(variants)
    again = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=600, env=env)
    assert json.loads(again.stdout.strip().splitlines()[-1])["cached"] == len(variants)
