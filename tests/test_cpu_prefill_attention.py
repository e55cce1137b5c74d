"""The blocked prefill attention (oneDNN's linear, AMD CPUs) against torch's SDPA, its reference."""
import pytest
import torch

from labkit import cpu_info, cpu_prefill_attention, ops
from labkit.ops import TorchOps

pytestmark = pytest.mark.skipif(not torch.backends.mkldnn.is_available(), reason="this torch has no oneDNN")


def inputs(B, H, Hkv, P, S, dh, seed):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(B, H, P, dh, generator=g), torch.randn(B, Hkv, S, dh, generator=g),
            torch.randn(B, Hkv, S, dh, generator=g))


@pytest.mark.parametrize("B, H, Hkv, P, S, block", [
    (1, 4, 2, 1024, 1024, 256),   # lab-cpu's heads, whole blocks
    (2, 4, 4, 300, 300, 128),     # no GQA, a part block at the end, two sequences
    (1, 8, 2, 77, 77, 32),        # four query heads a KV head
    (1, 4, 2, 1, 1, 256),         # one token
    (1, 4, 2, 200, 520, 64),      # a chunk of a chunked prefill: queries at 320-519
    (2, 2, 1, 5, 9, 2),           # tiny blocks, a chunk
])
def test_blocked_prefill_attention_equals_sdpa(B, H, Hkv, P, S, block):
    q, k, v = inputs(B, H, Hkv, P, S, 64, seed=P + S + block)
    got = cpu_prefill_attention.blocked_prefill_attention(q, k, v, block)
    want = cpu_prefill_attention.sdpa_prefill_attention(q, k, v)
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)


def test_strided_views_as_the_model_passes_them():
    """q, k, v as views of [B, P, heads, dh] (the model's layout after its projection): the same
    result as contiguous copies, and as SDPA's."""
    g = torch.Generator().manual_seed(11)
    q, k, v = (torch.randn(1, 96, heads, 64, generator=g).transpose(1, 2) for heads in (4, 2, 2))
    assert not k.is_contiguous()
    got = cpu_prefill_attention.blocked_prefill_attention(q, k, v, 32)
    assert torch.equal(got, cpu_prefill_attention.blocked_prefill_attention(q.contiguous(), k.contiguous(), v.contiguous(), 32))
    torch.testing.assert_close(got, cpu_prefill_attention.sdpa_prefill_attention(q, k, v), atol=1e-5, rtol=1e-5)


def test_a_masked_key_changes_nothing_and_a_visible_one_does():
    """Causality, not just closeness: a key after a query's position leaves its output as it was,
    one at its position moves it (query 100 of a 128-token prefill, blocks of 32)."""
    q, k, v = inputs(1, 4, 2, 128, 128, 64, seed=3)
    before = cpu_prefill_attention.blocked_prefill_attention(q, k, v, 32)
    k2, v2 = k.clone(), v.clone()
    k2[:, :, 101], v2[:, :, 101] = 5.0, -5.0  # after query 100
    after = cpu_prefill_attention.blocked_prefill_attention(q, k2, v2, 32)
    assert torch.equal(after[:, :, :101], before[:, :, :101])
    assert not torch.allclose(after[:, :, 101:], before[:, :, 101:])


@pytest.mark.parametrize("vendor, blocked", [("AuthenticAMD", True), ("GenuineIntel", False), ("", False)])
def test_the_cpu_path_takes_the_blocked_attention_on_amd_only(monkeypatch, vendor, blocked):
    """fp32 on an AMD CPU with a working oneDNN linear; elsewhere, and for other dtypes, SDPA."""
    monkeypatch.setattr(cpu_info, "cpu_vendor", lambda: vendor)
    ops.mkl_for_many_rows.cache_clear(), ops.onednn_for_many_rows.cache_clear()
    calls = []
    real = cpu_prefill_attention.blocked_prefill_attention
    monkeypatch.setattr(ops, "blocked_prefill_attention", lambda *a: calls.append(1) or real(*a))
    try:
        q, k, v = inputs(1, 4, 2, 40, 40, 16, seed=5)
        torch.testing.assert_close(TorchOps.prefill_attention(q, k, v),
                                   cpu_prefill_attention.sdpa_prefill_attention(q, k, v), atol=1e-5, rtol=1e-5)
        assert calls == ([1] if blocked else [])
        TorchOps.prefill_attention(q.bfloat16(), k.bfloat16(), v.bfloat16())
        assert calls == ([1] if blocked else [])
    finally:
        ops.mkl_for_many_rows.cache_clear(), ops.onednn_for_many_rows.cache_clear()
