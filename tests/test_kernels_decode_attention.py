"""kernels.decode_attention against its reference, on plain and quantised KV caches."""
import pytest
import torch

from labkit.backend import TRITON_MISSING, triton_installed

if not triton_installed():  # macOS, Windows: no wheels; every kernel module imports triton
    pytest.skip(f"skipped: {TRITON_MISSING}", allow_module_level=True)

from kernel_util import DEVICE, FLOAT_TOL, gpu_only, needs_cuda_or_interpreter, tol  # noqa: E402
from kernels.decode_attention import (decode_attention, decode_attention_reference,  # noqa: E402
                                      default_num_splits)
from kernels.kv_quant import quantize_kv_reference  # noqa: E402
from kernels.tolerances import decode_attention_tolerance  # noqa: E402
from labkit.dtypes import dtype_name  # noqa: E402

pytestmark = needs_cuda_or_interpreter


def make_case(B, H, Hkv, S_max, D, q_dtype, cache, lengths, seed=0, fp8_scale=0.5):
    """Random q and a cache quantised on the host (torch), so the kernel's fp8/int8 path is tested
    without the interpreter's faulty in-kernel fp8 cast."""
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(B, H, D, generator=g).to(DEVICE, q_dtype)
    k, v = (torch.randn(B, Hkv, S_max, D, generator=g).to(DEVICE) for _ in range(2))
    scale = torch.tensor(fp8_scale, device=DEVICE) if cache == "fp8" else None
    k_cache, k_scale = quantize_kv_reference(k, cache, scale)
    v_cache, v_scale = quantize_kv_reference(v, cache, scale)
    lengths = torch.tensor(lengths, dtype=torch.int32, device=DEVICE)
    return q, k_cache, v_cache, lengths, k_scale, v_scale


def check(case, what, num_splits=None):
    out = decode_attention(*case, num_splits=num_splits)
    ref = decode_attention_reference(*case)
    q, k_cache = case[0], case[1]
    # Kernel and reference read the SAME quantised cache: the tolerance bounds arithmetic only.
    tolerance = tol(decode_attention_tolerance(dtype_name(q.dtype), dtype_name(k_cache.dtype)))
    assert out.shape == q.shape and out.dtype == q.dtype, f"{what}: {out.shape} {out.dtype}"
    err = (out.float() - ref.float()).abs()
    torch.testing.assert_close(out.float(), ref.float(), **tolerance, msg=lambda _: (
        f"{what}: max abs err {err.max().item():.3e}, mean abs err {err.mean().item():.3e}, "
        f"tolerance {tolerance}"))


@pytest.mark.parametrize("cache", ["fp16", "int8", "fp8"])
@pytest.mark.parametrize("group", [1, 4, 8])  # H // Hkv
def test_mixed_lengths_gqa(cache, group):
    # One batch holds a length-1 sequence, a full one and one in between; S_max = 53 is odd.
    case = make_case(3, 8, 8 // group, 53, 64, torch.float16, cache, [1, 53, 30], seed=group)
    check(case, f"{cache} cache, group={group}, lengths [1, 53, 30]")


@pytest.mark.parametrize("cache", ["int8", "fp8"])
def test_v_scaled_in_its_tile_gives_the_same_attention(monkeypatch, cache):
    """SCALE_V (a tile's fourth entry, a candidate scripts/gpu_tune.py times): V widened, scaled
    and rounded to q's dtype in its tile instead of scaling the probabilities (int8) or the output
    (fp8); the same attention within the dtype's tolerance, over several tiles and splits."""
    import kernels.decode_attention as da
    tile = da.INTERPRETER_SPLIT_TILE if DEVICE != "cuda" else da.QUANT_SPLIT_TILES[cache][0][:3]
    chosen = []
    original = da.split_constexprs

    def with_scale_v(*args, **kw):
        plan = original(*args, **{**kw, "tile": (*tile, True)})
        chosen.append(plan["constexprs"]["SCALE_V"])
        return plan
    monkeypatch.setattr(da, "split_constexprs", with_scale_v)
    case = make_case(2, 8, 2, 70, 64, torch.float16, cache, [70, 33], seed=11)
    check(case, f"{cache} cache, V scaled in its tile", num_splits=3)
    assert chosen == [True]
    assert original("fp16", "fp16", 64, 4, None, interpreted=True, tile=(16, 1, 4, True))["constexprs"]["SCALE_V"] is False


@pytest.mark.parametrize("q_dtype,cache", [(torch.float32, "fp32"), (torch.float32, "int8"),
                                           (torch.float16, "fp32")])
def test_fp32_paths(q_dtype, cache):
    # fp16 q with an fp32 cache takes the DOT_FP32 path (the cache can't be cast down exactly).
    # Compiled, an fp32 q over an int8 cache is refused (its fp32 dots spill: make gpu-compile).
    case = make_case(2, 8, 2, 40, 64, q_dtype, cache, [17, 40], seed=3)
    if DEVICE == "cuda" and q_dtype == torch.float32 and cache != "fp32":
        with pytest.raises(ValueError, match="an fp32 q needs an fp32 cache on a GPU"):
            check(case, "refused")
        return
    check(case, f"q {q_dtype}, {cache} cache")


def test_context_length_one_everywhere():
    check(make_case(2, 4, 2, 1, 128, torch.float16, "fp16", [1, 1], seed=4), "S_max=1, D=128")


@pytest.mark.parametrize("cache", ["fp16", "int8"])
def test_long_context_uses_several_splits(cache):
    # 700 tokens, 16-key tiles in the interpreter: each of 6 splits gets 128 keys (8 tiles).
    case = make_case(1, 8, 2, 700, 64, torch.float16, cache, [700], seed=5)
    check(case, f"700 tokens, 6 splits, {cache}", num_splits=6)
    splits = default_num_splits(1, 2, 700, DEVICE)
    assert splits > 1, f"the heuristic should split a 700-token context at batch 1; got {splits}"
    check(case, f"700 tokens, default {splits} splits, {cache}")


def test_more_splits_than_a_short_sequence_needs():
    # Splits past the end of sequence 0 are empty; the combine step must give them weight 0.
    case = make_case(2, 4, 4, 200, 64, torch.float16, "fp16", [5, 200], seed=6)
    check(case, "lengths [5, 200] with 8 splits", num_splits=8)


@gpu_only("the interpreter's bf16 arithmetic and tl.dot are wrong in triton 3.9 (issue #11584)")
@pytest.mark.parametrize("cache", ["bf16", "int8", "fp8"])
def test_bf16_query(cache):
    case = make_case(3, 8, 2, 53, 64, torch.bfloat16, cache, [1, 53, 30], seed=7)
    check(case, f"bf16 q, {cache} cache")


@gpu_only("decode-sized caches take far too long in the interpreter; uses the SM-count heuristic")
@pytest.mark.parametrize("cache", ["bf16", "fp16", "int8", "fp8"])
def test_decode_sized(cache):
    q_dtype = torch.float16 if cache == "fp16" else torch.bfloat16
    case = make_case(4, 32, 8, 4096, 128, q_dtype, cache, [4096, 1, 2049, 300], seed=8)
    check(case, f"decode-sized, {cache} cache")


def bad(**overrides):
    """A valid small fp16 case with some arguments replaced."""
    q, k, v, lengths, ks, vs = make_case(2, 4, 2, 8, 64, torch.float16, "fp16", [3, 8])
    args = dict(q=q, k_cache=k, v_cache=v, lengths=lengths, k_scale=ks, v_scale=vs)
    args.update(overrides)
    return args


@pytest.mark.parametrize("name,make,match", [
    ("float64 cache", lambda a: dict(k_cache=a["k_cache"].double(), v_cache=a["v_cache"].double()),
     "k_cache dtype torch.float64 not supported; expected one of bf16, fp16, fp32, float8_e4m3fn, int8"),
    ("int64 lengths", lambda a: dict(lengths=a["lengths"].long()), "lengths must be an int32 tensor"),
    ("zero length", lambda a: dict(lengths=a["lengths"] * 0), r"lengths must lie in \[1, S_max=8\]"),
    ("length > S_max", lambda a: dict(lengths=a["lengths"] + 1), "got min 4, max 9"),
    ("H % Hkv", lambda a: dict(q=a["q"][:, :3]), "expected .* H % Hkv == 0"),
    ("2-D q", lambda a: dict(q=a["q"][0]), "q must be .B, H, D."),
    ("v differs", lambda a: dict(v_cache=a["v_cache"][:, :, :4]), "v_cache .* differs from k_cache"),
    ("scale on fp16", lambda a: dict(k_scale=torch.tensor(1.0, device=DEVICE)), "k_scale must be None"),
])
def test_bad_inputs_raise(name, make, match):
    args = bad()
    args.update(make(args))
    with pytest.raises(ValueError, match=match):
        decode_attention(**args)


def test_bad_scales_and_splits_raise():
    q, k, v, lengths, ks, vs = make_case(2, 4, 2, 8, 64, torch.float16, "int8", [3, 8])
    with pytest.raises(ValueError, match=r"k_scale for a torch.int8 cache must be a float32 .*\(2, 2, 8\)"):
        decode_attention(q, k, v, lengths, None, vs)
    q, k, v, lengths, ks, vs = make_case(2, 4, 2, 8, 64, torch.float16, "fp8", [3, 8])
    with pytest.raises(ValueError, match=r"v_scale for a torch.float8_e4m3fn cache .* 0-dim"):
        decode_attention(q, k, v, lengths, ks, vs.reshape(1))
    with pytest.raises(ValueError, match="num_splits must be an int in"):
        decode_attention(q, k, v, lengths, ks, vs, num_splits=0)


def test_check_lengths_false_reads_nothing_back(monkeypatch):
    """check_lengths=False (the model's path: KVCache checks lengths on the host) must not read
    lengths back from the device, a host sync per call on CUDA; results are unchanged."""
    case = make_case(2, 4, 2, 40, 64, torch.float16, "fp16", [17, 40], seed=9)
    ref = decode_attention_reference(*case)

    def no_sync(*args, **kwargs):
        raise AssertionError("decode_attention read a tensor back to the host")
    for name in ("__bool__", "item", "tolist", "__int__"):
        monkeypatch.setattr(torch.Tensor, name, no_sync)
    out = decode_attention(*case, check_lengths=False)
    with pytest.raises(AssertionError, match="read a tensor back"):
        decode_attention(*case)  # the default checks lengths: one read back
    monkeypatch.undo()
    torch.testing.assert_close(out.float(), ref.float(), **FLOAT_TOL[torch.float16])


def test_a_dtype_the_gpu_lacks_is_refused_before_the_compiler(monkeypatch):
    """An fp8 cache on a T4 (sm_75) or A100 (sm_80), bf16 on a T4: one clear line, no compile."""
    from kernels import _runtime

    class FakeCuda:  # a CUDA tensor's dtype and device, on a machine without a GPU
        is_cuda, device = True, "cuda:0"

        def __init__(self, dtype):
            self.dtype = dtype

    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "Tesla T4")
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (7, 5))
    with pytest.raises(ValueError, match=r"decode_attention: torch.float8_e4m3fn needs a GPU of compute "
                                         r"capability 8.9 or newer; Tesla T4 is 7.5: use an int8 cache"):
        _runtime.check_dtype_supported(FakeCuda(torch.float8_e4m3fn), "decode_attention")
    with pytest.raises(ValueError, match="bfloat16 needs a GPU of compute capability 8.0.*use fp16"):
        _runtime.check_dtype_supported(FakeCuda(torch.bfloat16), "matmul")
    _runtime.check_dtype_supported(FakeCuda(torch.int8), "decode_attention")  # int8 runs everywhere
    _runtime.check_dtype_supported(FakeCuda(torch.float16), "matmul")


def test_compiled_kernels_refuse_pairs_that_spill_and_fit_every_gpu():
    """What the wrapper picks on each GPU (the tables make gpu-compile checks): an fp32 cache at
    D = 256 fits an H100's 227 KiB (it needed 276 KiB before); on a T4's 64 KiB no tile fits, and
    the wrapper says so (None); spilling pairs are refused."""
    from kernels.decode_attention import compiled_refusal, split_constexprs, split_shared_bytes
    plan = split_constexprs("fp32", "fp32", 256, 4, 232448, capability=(9, 0))
    assert plan and split_shared_bytes(plan["constexprs"]["BLOCK_N"], plan["num_stages"], 256, 4, 4) <= 232448
    assert split_constexprs("fp32", "fp32", 256, 4, 65536, capability=(7, 5)) is None
    assert split_constexprs("fp16", "fp16", 128, 4, 65536, capability=(7, 5))["constexprs"]["BLOCK_N"] == 32
    assert compiled_refusal("fp16", "bf16") and compiled_refusal("fp32", "int8")
    assert split_constexprs("bf16", "fp16", 128, 4, None) is None
    assert compiled_refusal("bf16", "fp8") is None and compiled_refusal("bf16", "fp32") is None
    assert split_constexprs("fp32", "int8", 128, 4, None, interpreted=True)  # the interpreter takes all
