"""kernels.flash_attention against attention_reference (interpreter on CPU, real kernel on CUDA)."""
import pytest
import torch

from labkit.backend import TRITON_MISSING, triton_installed

if not triton_installed():  # macOS, Windows: no wheels; every kernel module imports triton
    pytest.skip(f"skipped: {TRITON_MISSING}", allow_module_level=True)

from kernel_util import DEVICE, FLOAT_TOL, gpu_only, needs_cuda_or_interpreter  # noqa: E402
from kernels.flash_attention import attention_reference, flash_attention  # noqa: E402

pytestmark = needs_cuda_or_interpreter
# kernels/tolerances.FLOAT, shared with the GPU check (the reasons for each number are there).
TOL = FLOAT_TOL


def qkv(B, H, Hkv, P, S, D, dtype, seed=0):
    g = torch.Generator().manual_seed(seed)
    q, k, v = (torch.randn(B, h, n, D, generator=g).to(device=DEVICE, dtype=dtype)
               for h, n in ((H, P), (Hkv, S), (Hkv, S)))
    return q, k, v


def check(q, k, v, causal, what, sm_scale=None):
    out = flash_attention(q, k, v, causal=causal, sm_scale=sm_scale)
    ref = attention_reference(q, k, v, causal=causal, sm_scale=sm_scale)
    assert out.shape == ref.shape and out.dtype == q.dtype, f"{what}: {out.shape} {out.dtype}"
    assert out.transpose(1, 2).is_contiguous(), f"{what}: o not token by token in memory"  # a view for wo
    err = (out.float() - ref.float()).abs()
    torch.testing.assert_close(out.float(), ref.float(), **TOL[q.dtype], msg=lambda _: (
        f"{what}: max abs err {err.max().item():.3e}, mean abs err {err.mean().item():.3e}, "
        f"tolerance {TOL[q.dtype]}"))


@pytest.mark.parametrize("dtype", [torch.float16, torch.float32])
@pytest.mark.parametrize("group", [1, 4, 8])  # H // Hkv: multi-head, GQA, 8 query heads per kv head
def test_causal_prefill_gqa(group, dtype):
    q, k, v = qkv(1, 8, 8 // group, 37, 37, 64, dtype)  # 37: not a multiple of any block size
    check(q, k, v, True, f"causal P=S=37 group={group} {dtype}")


@pytest.mark.parametrize("causal", [True, False])
def test_chunked_prefill_queries_are_last_positions(causal):
    # S > P: 37 new queries after 16 cached tokens; query i sits at position 16 + i.
    q, k, v = qkv(2, 8, 2, 37, 53, 64, torch.float16, seed=1)
    check(q, k, v, causal, f"chunked prefill P=37 S=53 causal={causal}")


def test_single_query_and_explicit_scale():
    q, k, v = qkv(1, 4, 4, 1, 20, 64, torch.float32, seed=2)
    check(q, k, v, True, "P=1 S=20", sm_scale=0.3)


def test_head_dim_128_and_strided_q():
    q, k, v = qkv(1, 4, 2, 19, 30, 128, torch.float16, seed=3)
    q = q.transpose(1, 2).contiguous().transpose(1, 2)  # [B, H, P, D] view of a [B, P, H, D] buffer
    check(q, k, v, True, "D=128 strided q")


@gpu_only("the interpreter's bf16 arithmetic and tl.dot are wrong in triton 3.9 (issue #11584)")
@pytest.mark.parametrize("P,S", [(37, 37), (37, 53)])
def test_bf16(P, S):
    q, k, v = qkv(2, 8, 2, P, S, 64, torch.bfloat16, seed=4)
    check(q, k, v, True, f"bf16 P={P} S={S}")


@gpu_only("prefill-sized shapes take far too long in the interpreter; exercises autotuned tiles")
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("P,S", [(1024, 1024), (500, 1500)])
def test_prefill_sized(P, S, dtype):
    q, k, v = qkv(2, 32, 8, P, S, 128, dtype, seed=5)
    check(q, k, v, True, f"prefill-sized P={P} S={S} {dtype}")


@pytest.mark.parametrize("q_shape,kv_shape,match", [
    ((1, 4, 8, 64), (1, 4, 6, 64), "S=6 keys < P=8 queries"),
    ((1, 6, 8, 64), (1, 4, 8, 64), "H=6 query heads not a multiple of Hkv=4"),
    ((1, 4, 8, 48), (1, 4, 8, 48), "head dim D=48 not supported"),
    ((4, 8, 64), (1, 4, 8, 64), "q must be a 4-D tensor"),
    ((2, 4, 8, 64), (1, 4, 8, 64), "does not match q"),
])
def test_bad_shapes_raise(q_shape, kv_shape, match):
    q = torch.ones(q_shape, dtype=torch.float16, device=DEVICE)
    k = torch.ones(kv_shape, dtype=torch.float16, device=DEVICE)
    with pytest.raises(ValueError, match=match):
        flash_attention(q, k, k.clone())


def test_bad_dtype_raises():
    q, k, v = qkv(1, 4, 4, 8, 8, 64, torch.float16)
    with pytest.raises(ValueError, match="k dtype torch.float32 not supported"):
        flash_attention(q, k.float(), v)
    with pytest.raises(ValueError, match="v shape"):
        flash_attention(q, k, v[:, :, :4])
