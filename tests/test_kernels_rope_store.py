"""kernels.rope_store (RoPE and the cache write, one kernel, for a decode step and for a prefill)
against its reference and against the model's torch path (layer_math's RoPE, KVCache.update)."""
import pytest
import torch

from labkit.backend import TRITON_MISSING, triton_installed

if not triton_installed():  # macOS, Windows: no wheels; every kernel module imports triton
    pytest.skip(f"skipped: {TRITON_MISSING}", allow_module_level=True)

from kernel_util import CUDA, DEVICE, FLOAT_TOL, gpu_only, needs_cuda_or_interpreter, tol  # noqa: E402
from kernels.kv_quant import dequantize_kv  # noqa: E402
from kernels.rope_store import (rope_and_store, rope_and_store_prefill,  # noqa: E402
                                rope_and_store_prefill_reference, rope_and_store_reference)
from kernels.tolerances import INT8_SCALES, kv_quant_code_tolerance  # noqa: E402
from labkit.layer_math import rope_angles, rope_inverse_frequencies, rotate_qkv  # noqa: E402

pytestmark = needs_cuda_or_interpreter
CODE_TOL = {"int8": tol(kv_quant_code_tolerance("int8", compiled=CUDA)),
            "fp8": tol(kv_quant_code_tolerance("fp8", compiled=CUDA))}
CACHE = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16, "int8": torch.int8,
         "fp8": torch.float8_e4m3fn}


def make_case(B, H, Hkv, S, D, act, cache, positions, seed=0, shared_angles=False):
    """qkv [B, (H + 2 Hkv) D] of O(1) values, rope_angles' cos/sin as [1 or B, D], caches
    already holding random codes (so a stray write shows), and their scales."""
    g = torch.Generator().manual_seed(seed)
    qkv = (torch.randn(B, (H + 2 * Hkv) * D, generator=g) * 2).to(DEVICE, act)
    where = torch.tensor([positions[0]] if shared_angles else positions)[:, None]  # [B or 1, 1]
    cos, sin = (t.reshape(-1, D).to(DEVICE) for t in rope_angles(where, rope_inverse_frequencies(D, 10000.0)))
    shape = (B, Hkv, S, D)
    if cache == "int8":
        k, v = (torch.randint(-127, 128, shape, generator=g, dtype=torch.int8).to(DEVICE) for _ in range(2))
        ks, vs = (torch.rand(shape[:-1], generator=g).to(DEVICE) for _ in range(2))
    else:
        k, v = (torch.randn(shape, generator=g).to(DEVICE, CACHE[cache]) for _ in range(2))
        ks = vs = torch.tensor(0.5, device=DEVICE) if cache == "fp8" else None
    return qkv, cos, sin, k, v, ks, vs


def clone(case):
    return tuple(t.clone() if isinstance(t, torch.Tensor) else t for t in case)


def compare(got, want, cache, what):
    """Caches and scales as floats: codes at the code tolerance, float caches at their dtype's."""
    for name, a, b in zip(("k", "v", "k_scale", "v_scale"), got, want):
        if a is None or (name.endswith("scale") and cache == "fp8"):
            continue
        t = (tol(INT8_SCALES) if name.endswith("scale") else CODE_TOL.get(cache)
             or FLOAT_TOL[CACHE[cache]])
        err = (a.float() - b.float()).abs()
        torch.testing.assert_close(a.float(), b.float(), **t, msg=lambda _: (
            f"{what}, {name}: max abs err {err.max().item():.3e}, {int((err > 0).sum())} values differ"))


@pytest.mark.parametrize("cache", ["fp32", "fp16", "int8"])
@pytest.mark.parametrize("act", [torch.float32, torch.float16])
@pytest.mark.parametrize("positions", ["one int", "a tensor"])
def test_kernel_matches_reference(cache, act, positions):
    # B = 3 rows at positions 4, 0 and 12 of 13 (the last one), GQA 3:1, D = 80 (half not a power of two)
    case = make_case(3, 6, 2, 13, 80, act, cache, [4, 0, 12])
    pos = torch.tensor([4, 0, 12], dtype=torch.int32, device=DEVICE) if positions == "a tensor" else 7
    if positions == "one int":
        case = make_case(3, 6, 2, 13, 80, act, cache, [7, 7, 7], shared_angles=True)
    got, want = clone(case), clone(case)
    q = rope_and_store(got[0], got[1], got[2], *got[3:], pos)
    q_ref = rope_and_store_reference(want[0], want[1], want[2], *want[3:], pos)
    assert q.shape == (3, 6, 80) and q.dtype == act
    torch.testing.assert_close(q.float(), q_ref.float(), **FLOAT_TOL[act])
    compare(got[3:], want[3:], cache, f"{cache} cache, {act}, {positions}")
    written = torch.zeros(case[3].shape[:3], dtype=torch.bool, device=DEVICE)
    rows = [4, 0, 12] if positions == "a tensor" else [7, 7, 7]
    written[torch.arange(3), :, torch.tensor(rows)] = True
    assert torch.equal(got[3][~written], case[3][~written]), "the kernel wrote K outside the new positions"
    assert torch.equal(got[4][~written], case[4][~written]), "the kernel wrote V outside the new positions"


@pytest.mark.parametrize("cache", ["fp32", "int8"])
def test_kernel_agrees_with_the_models_torch_path(cache):
    """The independent path: layer_math's RoPE (what TorchOps runs) for q and k, then the codes
    the kernel stored, dequantised, against that k and v."""
    B, H, Hkv, D = 2, 4, 2, 16
    case = make_case(B, H, Hkv, 9, D, torch.float32, cache, [3, 8])
    pos = torch.tensor([3, 8], dtype=torch.int32, device=DEVICE)
    got = clone(case)
    q = rope_and_store(got[0], got[1], got[2], *got[3:], pos)
    rope = tuple(t.view(B, 1, 1, 2, D // 2) for t in case[1:3])
    q_t, k_t, v_t = rotate_qkv(case[0].view(B, 1, -1), H, Hkv, rope)  # [B, heads, 1, D]
    torch.testing.assert_close(q, q_t[:, :, 0], **FLOAT_TOL[torch.float32])
    for cached, scales, want in ((got[3], got[5], k_t), (got[4], got[6], v_t)):
        rows = cached[torch.arange(B), :, pos.long()]  # [B, Hkv, D]
        back = dequantize_kv(rows, scales[torch.arange(B), :, pos.long()]) if cache == "int8" else rows
        step = want.abs().amax(-1) / 127 if cache == "int8" else torch.zeros(())  # half an int8 step
        assert ((back - want[:, :, 0]).abs() <= step / 2 + 1e-5).all(), f"{cache}: stored rows differ"


def test_a_nan_in_a_new_key_poisons_its_int8_scale():
    """As kernels.kv_quant: tl.max left the NaN out, and the token was stored with finite codes
    and a finite scale, an overflow upstream hidden in the cache."""
    case = make_case(2, 4, 2, 9, 16, torch.float32, "int8", [3, 8])
    case[0][1, 4 * 16 + 5] = float("nan")  # row 1's first key head (k follows H = 4 query heads of D = 16)
    pos = torch.tensor([3, 8], dtype=torch.int32, device=DEVICE)
    got = clone(case)
    rope_and_store(got[0], got[1], got[2], *got[3:], pos)
    k_scales = got[5][torch.arange(2), :, pos.long()]  # [B, Hkv]
    assert torch.isnan(k_scales[1, 0]) and not torch.isnan(k_scales[0]).any() and not torch.isnan(k_scales[1, 1])


@gpu_only("the interpreter's in-kernel fp32 -> fp8 e4m3 cast is wrong for a few % of values")
def test_fp8_cache_on_a_gpu():
    case = make_case(3, 8, 2, 17, 128, torch.bfloat16, "fp8", [1, 16, 5])
    pos = torch.tensor([1, 16, 5], dtype=torch.int32, device=DEVICE)
    got, want = clone(case), clone(case)
    torch.testing.assert_close(rope_and_store(*got[:3], *got[3:], pos).float(),
                               rope_and_store_reference(*want[:3], *want[3:], pos).float(), **FLOAT_TOL[torch.bfloat16])
    compare(got[3:], want[3:], "fp8", "fp8 cache")


@gpu_only("the interpreter's bf16 arithmetic is wrong in triton 3.9 (triton issue #11584)")
@pytest.mark.parametrize("cache", ["bf16", "int8"])
def test_bf16_activations_on_a_gpu(cache):
    case = make_case(2, 32, 8, 33, 128, torch.bfloat16, cache, [32, 7])
    pos = torch.tensor([32, 7], dtype=torch.int32, device=DEVICE)
    got, want = clone(case), clone(case)
    torch.testing.assert_close(rope_and_store(*got[:3], *got[3:], pos).float(),
                               rope_and_store_reference(*want[:3], *want[3:], pos).float(), **FLOAT_TOL[torch.bfloat16])
    compare(got[3:], want[3:], cache, f"bf16 activations, {cache} cache")


@pytest.mark.parametrize("change,match", [
    (lambda c: (c[0][:, :-8], *c[1:]), r"qkv must be \[2, \(H \+ 2 \* 2\) \* 16\]"),
    (lambda c: (c[0], c[1].double(), *c[2:]), "cos must be fp32"),
    (lambda c: (*c[:4], c[4][:, :, :-1], *c[5:]), "k_cache and v_cache must be"),
    (lambda c: (*c[:5], None, c[6]), "needs k_scale fp32 of shape"),
])
def test_bad_arguments_are_refused_in_one_line(change, match):
    case = change(make_case(2, 4, 2, 9, 16, torch.float32, "int8", [3, 8]))
    with pytest.raises(ValueError, match=match):
        rope_and_store(*case, 3)


def test_a_position_past_the_cache_is_refused():
    case = make_case(2, 4, 2, 9, 16, torch.float32, "fp32", [3, 8])
    with pytest.raises(ValueError, match=r"position 9 outside the cache's 0 \.\. 8"):
        rope_and_store(*case, 9)


def make_prefill_case(B, T, H, Hkv, S, D, act, cache, start, seed=0):
    """qkv [B, T, (H + 2 Hkv) D], cos/sin [T, D] of positions start .. start + T - 1, and caches
    holding random codes, as make_case."""
    qkv, _, _, k, v, ks, vs = make_case(B, H, Hkv, S, D, act, cache, [0] * B, seed)
    g = torch.Generator().manual_seed(seed + 1)
    qkv = (torch.randn(B, T, (H + 2 * Hkv) * D, generator=g) * 2).to(DEVICE, act)
    positions = torch.arange(start, start + T)
    cos, sin = (t.reshape(T, D).to(DEVICE) for t in rope_angles(positions, rope_inverse_frequencies(D, 10000.0)))
    return qkv, cos, sin, k, v, ks, vs


@pytest.mark.parametrize("cache", ["fp32", "fp16", "int8"])
@pytest.mark.parametrize("act", [torch.float32, torch.float16])
@pytest.mark.parametrize("start", [0, 6])
def test_prefill_kernel_matches_reference(cache, act, start):
    # B = 2 sequences of T = 5 tokens at positions start .. start + 4 of 13 (start 6: up to the
    # second last), GQA 3:1, D = 80 (half not a power of two)
    B, T, H, Hkv, S, D = 2, 5, 6, 2, 13, 80
    case = make_prefill_case(B, T, H, Hkv, S, D, act, cache, start)
    got, want = clone(case), clone(case)
    qk = rope_and_store_prefill(*got, start)
    qk_ref = rope_and_store_prefill_reference(*want, start)
    assert qk.shape == (B, T, H + Hkv, D) and qk.dtype == act
    torch.testing.assert_close(qk.float(), qk_ref.float(), **FLOAT_TOL[act])
    compare(got[3:], want[3:], cache, f"prefill, {cache} cache, {act}, start {start}")
    written = torch.zeros(S, dtype=torch.bool)
    written[start:start + T] = True
    for new, old, name in ((got[3], case[3], "K"), (got[4], case[4], "V")):
        assert torch.equal(new[:, :, ~written], old[:, :, ~written]), f"the kernel wrote {name} outside the new positions"
        assert not torch.equal(new[:, :, written], old[:, :, written]), f"the kernel wrote no {name}"


@pytest.mark.parametrize("cache", ["fp32", "int8"])
def test_prefill_kernel_agrees_with_the_models_torch_path(cache):
    """The independent path: layer_math's rotate_qkv (what TorchOps runs in a prefill) for q and k,
    and KVCache.update's quantiser, dequantised, for what the kernel stored."""
    B, T, H, Hkv, S, D, start = 2, 7, 4, 2, 12, 16, 3
    case = make_prefill_case(B, T, H, Hkv, S, D, torch.float32, cache, start)
    got = clone(case)
    qk = rope_and_store_prefill(*got, start)
    rope = tuple(t.view(T, 1, 2, D // 2) for t in case[1:3])
    q_t, k_t, v_t = rotate_qkv(case[0], H, Hkv, rope)  # [B, heads, T, D]
    torch.testing.assert_close(qk[:, :, :H], q_t.transpose(1, 2), **FLOAT_TOL[torch.float32])
    torch.testing.assert_close(qk[:, :, H:], k_t.transpose(1, 2), **FLOAT_TOL[torch.float32])
    for cached, scales, want in ((got[3], got[5], k_t), (got[4], got[6], v_t)):
        rows = cached[:, :, start:start + T]  # [B, Hkv, T, D]
        back = dequantize_kv(rows, scales[:, :, start:start + T]) if cache == "int8" else rows
        step = want.abs().amax(-1, keepdim=True) / 127 if cache == "int8" else torch.zeros(())
        assert ((back - want).abs() <= step / 2 + 1e-5).all(), f"{cache}: stored rows differ"


@gpu_only("the interpreter's bf16 arithmetic is wrong in triton 3.9 (triton issue #11584), and its "
          "in-kernel fp32 -> fp8 e4m3 cast is wrong for a few % of values")
@pytest.mark.parametrize("cache", ["bf16", "int8", "fp8"])
def test_prefill_bf16_activations_on_a_gpu(cache):
    case = make_prefill_case(2, 300, 32, 8, 512, 128, torch.bfloat16, cache, 100)
    got, want = clone(case), clone(case)
    torch.testing.assert_close(rope_and_store_prefill(*got, 100).float(),
                               rope_and_store_prefill_reference(*want, 100).float(), **FLOAT_TOL[torch.bfloat16])
    compare(got[3:], want[3:], cache, f"prefill, bf16 activations, {cache} cache")


@pytest.mark.parametrize("change,start,match", [
    (lambda c: c, 8, r"positions 8 \.\. 8 \+ 5 - 1 outside the cache's 0 \.\. 11"),
    (lambda c: (c[0], c[1][:-1], c[2][:-1], *c[3:]), 0, r"cos must be fp32 \[5, 16\]"),
    (lambda c: (c[0][:, :, :-8], *c[1:]), 0, r"qkv must be \[2, 5, \(H \+ 2 \* 2\) \* 16\]"),
    (lambda c: (c[0][0], *c[1:]), 0, r"qkv must be \[B, T, \(H \+ 2 Hkv\) \* D\]"),
])
def test_bad_prefill_arguments_are_refused_in_one_line(change, start, match):
    case = change(make_prefill_case(2, 5, 4, 2, 12, 16, torch.float32, "fp32", 0))
    with pytest.raises(ValueError, match=match):
        rope_and_store_prefill(*case, start)
