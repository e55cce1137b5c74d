"""kernels.matmul against its torch reference (Triton interpreter on CPU, real kernel on CUDA)."""
import pytest
import torch

from labkit.backend import TRITON_MISSING, triton_installed

if not triton_installed():  # macOS, Windows: no wheels; every kernel module imports triton
    pytest.skip(f"skipped: {TRITON_MISSING}", allow_module_level=True)

from kernel_util import DEVICE, FLOAT_TOL, gpu_only, needs_cuda_or_interpreter  # noqa: E402
from kernels.matmul import matmul, matmul_reference  # noqa: E402

pytestmark = needs_cuda_or_interpreter
# kernels/tolerances.FLOAT, shared with the GPU check (the reasons for each number are there).
TOL = FLOAT_TOL


def randn(*shape, dtype, seed):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(*shape, generator=g).to(device=DEVICE, dtype=dtype)


def assert_close(out, ref, dtype, what):
    err = (out.float() - ref.float()).abs()
    assert out.shape == ref.shape and out.dtype == ref.dtype, f"{what}: {out.shape} {out.dtype}"
    torch.testing.assert_close(out.float(), ref.float(), **TOL[dtype], msg=lambda _: (
        f"{what}: max abs err {err.max().item():.3e}, mean abs err {err.mean().item():.3e}, "
        f"tolerance {TOL[dtype]}"))


@pytest.mark.parametrize("dtype", [torch.float16, torch.float32])
@pytest.mark.parametrize("M,K,N", [(67, 45, 33), (64, 96, 128), (1, 64, 33)])
def test_matmul_matches_reference_with_transposed_weight(M, K, N, dtype):
    a = randn(M, K, dtype=dtype, seed=0)
    w = randn(N, K, dtype=dtype, seed=1)  # nn.Linear layout; b = w.T is a strided view
    assert_close(matmul(a, w.T), matmul_reference(a, w.T), dtype, f"matmul {M}x{K}x{N} {dtype}")


def test_matmul_contiguous_b_and_strided_a():
    big = randn(67, 90, dtype=torch.float16, seed=2)
    a = big[:, ::2]  # [67, 45] with column stride 2
    b = randn(45, 33, dtype=torch.float16, seed=3)
    assert_close(matmul(a, b), matmul_reference(a, b), torch.float16, "strided a")


def test_matmul_k_zero_gives_zeros():
    a = randn(5, 0, dtype=torch.float32, seed=4)
    b = randn(0, 7, dtype=torch.float32, seed=5)
    assert torch.equal(matmul(a, b), torch.zeros(5, 7, device=DEVICE))


@gpu_only("the interpreter's bf16 arithmetic is wrong in triton 3.9 (triton issue #11584)")
def test_matmul_bf16():
    a = randn(67, 45, dtype=torch.bfloat16, seed=6)
    w = randn(33, 45, dtype=torch.bfloat16, seed=7)
    assert_close(matmul(a, w.T), matmul_reference(a, w.T), torch.bfloat16, "bf16")


@gpu_only("prefill-sized shapes take minutes in the interpreter; exercises the autotuned tiles")
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32])
def test_matmul_prefill_sized(dtype):
    a = randn(1000, 1024, dtype=dtype, seed=8)
    w = randn(1536, 1024, dtype=dtype, seed=9)
    assert_close(matmul(a, w.T), matmul_reference(a, w.T), dtype, f"prefill-sized {dtype}")


@pytest.mark.parametrize("a_shape,b_shape,dtype,match", [
    ((4,), (4, 3), torch.float16, "a must be a 2-D tensor"),
    ((4, 5), (6, 3), torch.float16, r"inner dims differ.*K=5.*K=6"),
    ((4, 5), (5, 3), torch.float64, "a dtype torch.float64 not supported"),
])
def test_matmul_bad_inputs(a_shape, b_shape, dtype, match):
    a = torch.ones(a_shape, dtype=dtype, device=DEVICE)
    b = torch.ones(b_shape, dtype=dtype, device=DEVICE)
    with pytest.raises(ValueError, match=match):
        matmul(a, b)


def test_matmul_mixed_dtype_and_device_rejected():
    a = torch.ones(4, 5, dtype=torch.float16, device=DEVICE)
    with pytest.raises(ValueError, match="a dtype torch.float16 and b dtype torch.float32 differ"):
        matmul(a, torch.ones(5, 3, dtype=torch.float32, device=DEVICE))
    with pytest.raises(ValueError, match="expected the same device"):
        matmul(a, torch.ones(5, 3, dtype=torch.float16, device="meta"))


# ---------------------------------------------------------------- decode-shaped products (split-K)
def test_decode_shaped_products_fill_every_sm_of_an_h100_and_h200():
    """The 8B's linear layers at B = 1 ... 64 rows: the split-K grid has at least as many programs
    as the GPU has SMs (before, wo and w_down launched at most 64 programs on 132 SMs)."""
    from kernels.matmul import SPLIT_K_MAX_M, split_k_plan
    from labkit.specs import get_model, gpu_limits
    spec = get_model("llama-3.1-8b")
    d, ffn = spec.hidden_size, spec.intermediate_size
    products = {"wqkv": (d, spec.q_dim + 2 * spec.kv_dim), "wo": (spec.q_dim, d), "w_gate_up": (d, 2 * ffn),
                "w_down": (ffn, d), "lm_head": (d, spec.vocab_size)}  # (K, N), as labkit.model multiplies them
    for gpu in ("H100-SXM", "H200"):
        sms = gpu_limits(gpu).sm_count
        assert sms == 132
        for B in range(1, SPLIT_K_MAX_M + 1):
            for name, (K, N) in products.items():
                plan = split_k_plan(B, N, K, 2, sms, interpreted=False, capability=(9, 0))
                assert plan["programs"] >= sms, f"{gpu} B={B} {name}: {plan}"
                assert plan["K_PER_SPLIT"] % plan["BLOCK_K"] == 0 and plan["BLOCK_M"] >= B
                assert (plan["SPLIT_K"] - 1) * plan["K_PER_SPLIT"] < K  # no empty slice


@pytest.mark.parametrize("dtype", [torch.float16, torch.float32])
@pytest.mark.parametrize("M,K,N", [(1, 256, 40), (5, 300, 64), (33, 128, 96), (64, 96, 128)])
def test_split_k_path_matches_reference(M, K, N, dtype):
    """M <= 64 takes the split-K path (in the interpreter with INTERPRETER_SMS, so several slices)."""
    from kernels.matmul import split_k_plan
    if M == 1:  # 2 column tiles of 32 on 4 stand-in SMs: the sum kernel runs too
        assert split_k_plan(M, N, K, 2, 4)["SPLIT_K"] == 2
    a = randn(M, K, dtype=dtype, seed=20)
    w = randn(N, K, dtype=dtype, seed=21) * K ** -0.5
    assert_close(matmul(a, w.T), matmul_reference(a, w.T), dtype, f"split-k {M}x{K}x{N} {dtype}")


def test_autotune_keys_are_bucketed():
    from kernels.matmul import M_BUCKET_MAX, M_BUCKET_MIN, m_bucket
    assert [m_bucket(m) for m in (65, 128, 129, 2000, 2048, 32768)] == [M_BUCKET_MIN, 128, 256, 2048, 2048, M_BUCKET_MAX]
