"""The CPU path's int8/fp8 cache quantises through kernels/kv_quant.py's torch reference, which
imports without Triton (macOS, Windows), and stores exactly what that reference gives."""
import dataclasses
import sys

import numpy as np
import pytest
import torch

from labkit import dtypes, kvcache
from labkit.specs import get_model

TINY = get_model("lab-tiny")


def fresh_rows(dtype, shape=(2, 3, 17, 32)):
    """Fresh random rows [B, Hkv, T, dh] with the cases that round differently: an all-zero row,
    a row of ties (x * 127 / absmax lands on .5), values past e4m3's 448."""
    x = torch.randn(shape) * torch.rand(shape[:-1] + (1,)) * 4
    x[0, 0, 0] = 0.0
    x[0, 1, 0] = torch.tensor([1.0, 0.5 / 127] * (shape[-1] // 2))  # absmax 1: the second value is a tie
    x[1, 2, 3, :4] = torch.tensor([600.0, -900.0, 448.0, 1e-9])
    return x.to(dtype)


def quantize(x, cache_dtype, scale=None):
    """What a CPU cache stores for rows x (the path without Triton's kernel)."""
    return kvcache._quantize(x, cache_dtype, scale, use_triton=False)


@pytest.mark.parametrize("cache_dtype", ["int8", "fp8"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_quantize_is_the_kernels_reference_bit_for_bit(cache_dtype, dtype):
    from kernels.kv_quant import quantize_kv_reference  # imports with or without triton
    x = fresh_rows(dtype)
    for scale in ([None] if cache_dtype == "int8" else [None, torch.rand(()) + 0.25]):
        got, got_scale = quantize(x, cache_dtype, scale)
        want, want_scale = quantize_kv_reference(x, cache_dtype, scale)
        assert got.dtype == want.dtype and torch.equal(got.view(torch.int8), want.view(torch.int8)), \
            f"{cache_dtype} from {dtype}: {(got.view(torch.int8) != want.view(torch.int8)).sum().item()} codes differ"
        assert torch.equal(got_scale, want_scale)


def test_the_cpu_steps_numpy_int8_is_the_kernels_reference_bit_for_bit():
    """`cpu_decode.quantize_int8` (the CPU decode step's own int8 cache write, numpy's form) and
    `cpu_kernels.store_int8` (numba's) store what the reference stores: every code and every scale,
    ties and an all-zero row included."""
    from kernels.kv_quant import INT8_MAX, quantize_kv_reference
    from labkit import cpu_decode, cpu_kernels
    assert cpu_decode.INT8_MAX == INT8_MAX
    for seed in range(20):
        torch.manual_seed(seed)
        x = fresh_rows(torch.float32) * (10.0 ** (seed % 5 - 2))  # scales from 0.01 to 100
        got, got_scale = cpu_decode.quantize_int8(x.numpy())
        want, want_scale = quantize_kv_reference(x, "int8")
        assert (got == want.numpy()).all(), f"seed {seed}: {(got != want.numpy()).sum()} codes differ"
        assert (got_scale == want_scale.numpy()).all() and got_scale.dtype == want_scale.numpy().dtype
        if cpu_kernels.AVAILABLE:  # the step's numba store of the same rows, one position at a time
            B, Hkv, T, dh = x.shape
            codes, scales = np.zeros((B, Hkv, T + 2, dh), np.int8), np.zeros((B, Hkv, T + 2), np.float32)
            for t in range(T):
                cpu_kernels.store_int8(x[:, :, t].numpy(), codes, scales, t + 1)  # a strided view, as in the step
            assert (codes[:, :, 1:T + 1] == want.numpy()).all() and not codes[:, :, [0, T + 1]].any()
            assert (scales[:, :, 1:T + 1].view(np.uint32) == want_scale.numpy().view(np.uint32)).all()


def test_a_nan_poisons_its_rows_int8_scale_in_the_cpu_steps_stores_as_in_the_reference():
    """A row holding a NaN (first, middle or last of its values) is stored with a NaN scale and zero
    codes by both CPU stores, as by the reference, so it reads back as NaN; numba's max() left the
    NaN out and stored a finite scale, hiding an overflow upstream. The other rows, an inf row and a
    subnormal one among them, are stored as the reference stores them, and numpy's path warns of
    nothing (its undefined cast of the NaN, the inf row's inf * 0 and the subnormal's inverse did)."""
    import warnings

    from kernels.kv_quant import quantize_kv_reference
    from labkit import cpu_decode, cpu_kernels
    torch.manual_seed(7)
    x = fresh_rows(torch.float32)
    poisoned = [(0, 2, 5, 0), (1, 0, 9, 13), (1, 1, 16, 31)]  # [b, h, t, j]
    for b, h, t, j in poisoned:
        x[b, h, t, j] = float("nan")
    x[0, 1, 3, 4] = float("-inf")  # an overflow upstream: an inf scale, and NaN read back
    x[1, 2, 7] = torch.randn(x.shape[-1]) * 1e-39  # subnormal: its inverse 127 / absmax is past fp32
    want, want_scale = quantize_kv_reference(x, "int8")
    nan_rows = torch.isnan(want_scale).numpy()
    assert nan_rows.sum() == len(poisoned)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        got, got_scale = cpu_decode.quantize_int8(x.numpy())
    stored = [(got, got_scale)]
    if cpu_kernels.AVAILABLE:
        B, Hkv, T, dh = x.shape
        codes, scales = np.zeros((B, Hkv, T, dh), np.int8), np.zeros((B, Hkv, T), np.float32)
        for t in range(T):
            cpu_kernels.store_int8(x[:, :, t].numpy(), codes, scales, t)
        stored.append((codes, scales))
    for codes, scales in stored:
        assert (np.isnan(scales) == nan_rows).all()
        assert not codes[nan_rows].any()
        assert (codes[~nan_rows] == want.numpy()[~nan_rows]).all()
        assert (scales[~nan_rows] == want_scale.numpy()[~nan_rows]).all()
        with np.errstate(invalid="ignore"):  # 0 * inf: the inf row reads back as NaN too
            read_back = codes.astype(np.float32) * scales[..., None]
        lost = nan_rows | np.isinf(want_scale.numpy())
        assert np.isinf(scales[0, 1, 3]) and np.isnan(read_back[lost]).all() and not np.isnan(read_back[~lost]).any()


@pytest.mark.parametrize("cache_dtype", ["bf16", "fp16", "fp8"])
def test_the_cpu_steps_converting_copy_stores_what_update_stores_bit_for_bit(cache_dtype):
    """`cpu_decode.store_converted` (the CPU decode step's bf16, fp16 and fp8 cache write at equal
    lengths) against `KVCache.update` on the same new K/V: every stored bit equal, over scales from
    0.01 to 100 (fp8 past its 448, clamped), with an fp8 layer scale other than 1."""
    from labkit import cpu_decode
    from kernels.kv_quant import FP8_MAX
    assert cpu_decode.FP8_MAX == FP8_MAX
    spec = dataclasses.replace(get_model("lab-tiny"), n_heads=6, n_kv_heads=3, head_dim=32)  # fresh_rows' shape
    for seed in range(10):
        torch.manual_seed(seed)
        x = fresh_rows(torch.float32, (2, 3, 4, 32)) * (10.0 ** (seed % 5 - 2))  # [B, Hkv, T, dh]
        mine, theirs = (kvcache.KVCache(spec, 2, 8, cache_dtype, use_triton=False) for _ in range(2))
        if cache_dtype == "fp8":
            for cache in (mine, theirs):
                cache.k_scale[1] = 0.37 + seed  # a calibrated scale, as a real engine would set
        inverse = mine.k_scale.reciprocal().numpy()[1] if cache_dtype == "fp8" else None
        for t in range(4):  # one decode step's token each
            cpu_decode.store_converted(mine.k[1, :, :, 2 + t], x[:, :, t].numpy(), inverse)
            theirs.update(1, x[:, :, t:t + 1], x[:, :, t:t + 1], 2 + t)
        got, want = (c.k.view(torch.uint8) if c.k.element_size() == 1 else c.k.view(torch.int16) for c in (mine, theirs))
        assert torch.equal(got, want), f"seed {seed}: {(got != want).sum().item()} stored values differ"


def test_a_cpu_cache_gets_huge_pages_where_the_kernel_gives_them():
    """A KV cache on the CPU comes from numpy's allocator, which asks for 2 MiB pages: a 32 MiB
    bf16 cache is counted in AnonHugePages (torch's own allocator gives none by default). Skipped
    where the kernel has transparent huge pages off, or is not Linux."""
    import subprocess
    from pathlib import Path

    thp = Path("/sys/kernel/mm/transparent_hugepage/enabled")
    if not thp.exists() or "[never]" in thp.read_text():
        pytest.skip("transparent huge pages are off (or not Linux) here")
    code = ("import torch; from labkit.kvcache import KVCache; from labkit.specs import get_model; "
            "c = KVCache(get_model('lab-cpu'), 16, 1024, 'bf16', 'cpu'); c.k.fill_(1); c.v.fill_(1); "
            "assert c.k.dtype == torch.bfloat16 and c.k.shape == (4, 16, 2, 1024, 64); "
            "print([int(l.split()[1]) for l in open('/proc/self/smaps_rollup') if l.startswith('AnonHugePages')][0])")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert int(out.stdout) >= 24 << 10, f"AnonHugePages {out.stdout.strip()} kB for a 32 MiB bf16 cache"


def test_a_cpu_cache_starts_as_zeros_of_its_dtype_and_shape():
    for cache_dtype in ("fp32", "bf16", "fp8", "int8"):
        cache = kvcache.KVCache(get_model("lab-tiny"), 3, 5, cache_dtype, "cpu")
        for buffer in (cache.k, cache.v):
            assert buffer.shape == (2, 3, 2, 5, 16) and buffer.is_contiguous() and buffer.device.type == "cpu"
            assert buffer.dtype == dtypes.torch_dtype(cache_dtype)
            assert not buffer.float().any(), f"{cache_dtype}: not zeros"
        assert cache.k.data_ptr() != cache.v.data_ptr()


def test_int8_codes_round_trip_within_half_a_step():
    x = fresh_rows(torch.float32)
    codes, scale = quantize(x, "int8")
    assert codes.dtype == torch.int8 and scale.shape == x.shape[:-1]
    assert codes.abs().max().item() <= 127
    err = (codes.float() * scale[..., None] - x).abs()
    assert (err <= scale[..., None] / 2 + 1e-6).all(), f"max |err| {err.max().item():.3g}"
    assert (codes[0, 0, 0] == 0).all() and scale[0, 0, 0] == 0, "an all-zero row: scale 0, codes 0"


def test_fp8_saturates_instead_of_overflowing():
    x = fresh_rows(torch.float32)
    codes, scale = quantize(x, "fp8")
    assert codes.dtype == torch.float8_e4m3fn and scale.item() == 1.0
    assert codes[1, 2, 3, :3].float().tolist() == [448.0, -448.0, 448.0]
    assert torch.isfinite(codes.float()).all()


def test_a_float_cache_dtype_is_not_quantised():
    values, scale = quantize(torch.randn(2, 4), "bf16")
    assert values.dtype == torch.bfloat16 and scale is None


@pytest.mark.parametrize("cache_dtype", ["int8", "fp8"])
def test_the_cpu_path_fills_and_reads_a_quantised_cache_without_kernels(monkeypatch, cache_dtype):
    """`sys.modules["triton"] = None` makes importing triton fail, as on macOS and Windows: the
    kernels' module imports again without it, and the CPU cache quantises through its reference."""
    monkeypatch.setitem(sys.modules, "triton", None)
    monkeypatch.setitem(sys.modules, "triton.language", None)
    monkeypatch.delitem(sys.modules, "kernels.kv_quant", raising=False)  # imported again, under the block
    cache = kvcache.KVCache(TINY, batch=2, max_tokens=16, cache_dtype=cache_dtype, device="cpu")
    assert cache.use_triton is False
    k = torch.randn(2, TINY.n_kv_heads, 5, TINY.head_dim)
    cache.update(0, k, -k, 0)
    cache.fill_random(3)
    cache.update(1, k, -k, 3)
    got_k, got_v = cache.read(1, 8)
    step = 0.07 if cache_dtype == "fp8" else 0.01  # e4m3's 3 mantissa bits; int8's absmax / 254
    torch.testing.assert_close(got_k[:, :, 3:8], k, atol=step * k.abs().max().item(), rtol=0.07)
    torch.testing.assert_close(got_v[:, :, 3:8], -k, atol=step * k.abs().max().item(), rtol=0.07)


def _lengths_state(cache):
    return (list(cache.host_lengths), list(cache.active), cache.lengths.tolist(), cache._steps.tolist())


@pytest.mark.parametrize("active", [None, True, False])
def test_one_length_for_every_row_sets_what_the_per_row_path_sets(active):
    """`set_lengths(n)` for every row (the timed loops' reset, the int branch): from each start
    (all free, all busy, mixed) it leaves the host lists, the lengths and the per-row steps as
    a list of n per row does."""
    starts = ([0, 0, 0], [5, 5, 5], [0, 7, 2])
    for start in starts:
        for n in (0, 1, 9):
            fast, slow = (kvcache.KVCache(TINY, batch=3, max_tokens=16, cache_dtype="fp32", device="cpu")
                          for _ in range(2))
            for cache in (fast, slow):
                cache.set_lengths(list(start))
            fast.set_lengths(n, active=active)
            slow.set_lengths([n] * 3, active=active)
            busy = n > 0 if active is None else active
            assert _lengths_state(fast) == ([n] * 3, [busy] * 3, [n] * 3, [int(busy)] * 3), (start, n, active)
            assert _lengths_state(fast) == _lengths_state(slow), (start, n, active)
            fast.advance(), slow.advance()
            assert _lengths_state(fast) == _lengths_state(slow), (start, n, active)


@pytest.mark.parametrize("n", [-1, 17])
def test_a_length_outside_the_cache_is_refused_and_changes_nothing(n):
    cache = kvcache.KVCache(TINY, batch=2, max_tokens=16, cache_dtype="fp32", device="cpu")
    cache.set_lengths([3, 0])
    before = _lengths_state(cache)
    with pytest.raises(kvcache.LabError, match="outside the cache's 0 .. 16 positions"):
        cache.set_lengths(n)
    assert _lengths_state(cache) == before
