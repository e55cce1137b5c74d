"""labkit.cpu_kernels against their numpy references, and labkit.cpu_linear's three kinds of
products against each other: the CPU decode step's products and attention, each forced."""
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch

from kernels.tolerances import float_tolerance
from labkit import backend, cpu_kernels, cpu_linear
from labkit.cpu_kernels import _jit, attention_blocks, attention_int8
from labkit.errors import LabError

numba = pytest.importorskip("numba", reason="the CPU kernels need numba (a pin of requirements.txt)")
FP32 = dict(zip(("atol", "rtol"), float_tolerance("fp32")))
STORED = ("fp32", "bf16", "fp16", "fp8", "int8")


def rng(seed):
    return np.random.default_rng(seed)


def assert_close(out, ref, what, tol=FP32):
    err = np.abs(out.astype(np.float64) - ref)
    np.testing.assert_allclose(out, ref, **tol, err_msg=f"{what}: max abs err {err.max():.3e}, "
                               f"mean abs err {err.mean():.3e}, tolerance {tol}")


# ------------------------------------------------------------------ few_rows_linear
@pytest.mark.parametrize("rows", [1, 3, 4, 7, 16])
@pytest.mark.parametrize("out_features", [4, 10, 257])
def test_few_rows_linear_equals_its_reference(rows, out_features):
    """4 x 4 tiles, the rows past the last 4 and the columns past the last 4, each group range."""
    x = rng(0).standard_normal((rows, 96), dtype=np.float32)
    w = rng(1).standard_normal((out_features, 96), dtype=np.float32) * 96 ** -0.5
    ref = cpu_kernels.few_rows_linear_reference(x, w)
    out = np.full((rows, out_features), np.nan, np.float32)
    groups = (out_features + 3) // 4
    cpu_kernels.few_rows_linear(x, w, out, 0, groups // 2)  # two calls, as two threads would share it
    cpu_kernels.few_rows_linear(x, w, out, groups // 2, groups)
    assert_close(out, ref, f"{rows} x 96 @ 96 x {out_features}")


@pytest.mark.parametrize("rows", [2, 3, 4, 5, 16])
@pytest.mark.parametrize("out_features", [3, 4, 10, 257])
def test_tile_2x4_linear_equals_its_reference(rows, out_features):
    """2 x 4 tiles, an odd last row, the columns past the last 4, and two shares of the columns
    (its prefetch of the rows ahead stops at its share's end)."""
    x = rng(4).standard_normal((rows, 96), dtype=np.float32)
    w = rng(5).standard_normal((out_features, 96), dtype=np.float32) * 96 ** -0.5
    ref = cpu_kernels.few_rows_linear_reference(x, w)
    out = np.full((rows, out_features), np.nan, np.float32)
    middle = out_features // 8 * 4
    cpu_kernels.tile_2x4_linear(x, w, out, 0, middle)
    cpu_kernels.tile_2x4_linear(x, w, out, middle, out_features)
    assert_close(out, ref, f"tile_2x4_linear, {rows} x 96 @ 96 x {out_features}")


def test_pack_panels_lays_out_each_16_columns_contiguously_with_zeros_past_the_end():
    w = rng(11).standard_normal((40, 24), dtype=np.float32)
    panels = cpu_kernels.pack_panels(w.T.copy().T)  # any strides in: [in, out] storage here
    assert panels.shape == (3, 24, 16) and panels.flags.c_contiguous and panels.dtype == np.float32
    p, k, c = np.meshgrid(np.arange(3), np.arange(24), np.arange(16), indexing="ij")
    column = 16 * p + c
    inside = column < 40
    np.testing.assert_array_equal(panels[inside], w[column[inside], k[inside]])
    assert not panels[~inside].any(), "the 8 columns past N = 40 must be zeros"


@pytest.mark.parametrize("rows", [4, 8, 12, 16, 24, 28, 32, 40])
@pytest.mark.parametrize("out_features", [16, 40, 257])
def test_panel_linear_equals_its_reference(rows, out_features):
    """From 8 rows, pairs of panels in tiles of 8 rows and one of 4 (12, 28 rows), an odd panel
    (40, 257: 3 and 17 panels; a share of 5) in tiles of 16, 8 and 4; below 8 rows single panels;
    over two uneven shares of the panels (each share's prefetch stops at its own end) and on the
    cores; a padded last panel (40, 257). And the same bits as the rows taken 4 at a time (single
    panels only): every output sums its products in the same order whatever the tile."""
    x = rng(12).standard_normal((rows, 96), dtype=np.float32)
    w = rng(13).standard_normal((out_features, 96), dtype=np.float32) * 96 ** -0.5
    ref = cpu_kernels.few_rows_linear_reference(x, w)
    panels = cpu_kernels.pack_panels(w)
    out = np.full((rows, 16 * panels.shape[0]), np.nan, np.float32)
    middle = panels.shape[0] // 3
    cpu_kernels.panel_linear(x, panels, out, 0, middle)
    cpu_kernels.panel_linear(x, panels, out, middle, panels.shape[0])
    assert_close(out[:, :out_features], ref, f"panel_linear, {rows} x 96 @ 96 x {out_features}")
    assert not out[:, out_features:].any(), "the padded columns are the zero weights' products"
    again = np.full_like(out, np.nan)
    cpu_kernels.panel_linear_on_cores(x, panels, again, 2)
    np.testing.assert_array_equal(again, out)
    for first in range(0, rows, 4):
        single = np.full((4, out.shape[1]), np.nan, np.float32)
        cpu_kernels.panel_linear(np.ascontiguousarray(x[first:first + 4]), panels, single, 0, panels.shape[0])
        np.testing.assert_array_equal(single, out[first:first + 4])


@pytest.mark.parametrize("rows", [4, 8, 12, 32])
@pytest.mark.parametrize("out_features", [16, 40, 257])
def test_the_avx2_tiles_give_the_same_bits_as_the_avx512_ones(rows, out_features):
    """With AVX2 (`wide_tiles` false) every panel is met by 4-row tiles only: on fresh random
    inputs the reference's products, and the same bits as the wide tiles (each output sums its K
    products in the same order), over two uneven shares of the panels."""
    from labkit.cpu_kernels import panels as panel_module
    x = rng(14).standard_normal((rows, 96), dtype=np.float32)
    w = rng(15).standard_normal((out_features, 96), dtype=np.float32) * 96 ** -0.5
    panels = cpu_kernels.pack_panels(w)
    xt = np.ascontiguousarray(x.T)
    narrow, wide = (np.full((rows, 16 * panels.shape[0]), np.nan, np.float32) for _ in range(2))
    middle = panels.shape[0] // 3
    for first, stop in ((0, middle), (middle, panels.shape[0])):
        panel_module._panel_linear_t(xt, panels, narrow, first, stop, False)
        panel_module._panel_linear_t(xt, panels, wide, first, stop, True)
    assert_close(narrow[:, :out_features], cpu_kernels.few_rows_linear_reference(x, w), f"4-row tiles, {rows} rows")
    np.testing.assert_array_equal(narrow, wide)


def test_the_panel_product_is_chosen_with_avx512_or_avx2_and_fma_and_nowhere_else(monkeypatch):
    from labkit.cpu_kernels import panels as panel_module
    for features, registers, wide in (({"+avx512f", "+avx2", "+fma"}, True, True), ({"+avx2", "+fma"}, True, False),
                                      ({"+avx2"}, False, False), ({"+neon"}, False, False), (set(), False, False)):
        monkeypatch.setattr(panel_module, "host_features", lambda: frozenset(features))
        assert (panel_module.panels_in_registers(), panel_module.wide_tiles()) == (registers, wide), features


@pytest.mark.parametrize("rows", [1, 2, 4, 5, 11, 12, 13, 16])
@pytest.mark.parametrize("out_features", [4, 10, 257])
def test_linear_columns_and_on_cores_equal_the_reference(rows, out_features):
    """Each loop `linear_columns` picks by the number of rows (plain, pairs of weight rows, 4 x 4
    tiles) over column slices that split it unevenly, and `linear_on_cores` in 1-3 shares."""
    x = rng(2).standard_normal((rows, 96), dtype=np.float32)
    w = rng(3).standard_normal((out_features, 96), dtype=np.float32) * 96 ** -0.5
    ref = cpu_kernels.few_rows_linear_reference(x, w)
    out = np.full((rows, out_features), np.nan, np.float32)
    middle = out_features // 8 * 4  # a multiple of 4, as linear_on_cores cuts
    cpu_kernels.linear_columns(x, w, out, 0, middle)
    cpu_kernels.linear_columns(x, w, out, middle, out_features)
    assert_close(out, ref, f"linear_columns, {rows} x 96 @ 96 x {out_features}")
    for parts in (1, 2, 3):
        out[:] = np.nan
        cpu_kernels.linear_on_cores(x, w, out, parts)
        assert_close(out, ref, f"linear_on_cores({parts}), {rows} x 96 @ 96 x {out_features}")


# ------------------------------------------------------------------ widening the cache as stored
@numba.njit
def _widen_all(codes, out):
    for i in range(codes.shape[0]):
        out[i] = attention_blocks.widen(codes[i]) * attention_blocks.widen_unit(codes)


@pytest.mark.parametrize("storage", [np.uint8, np.uint16, np.int16, np.int8])
def test_widen_is_exact_for_every_code(storage):
    """fp8 (uint8 bits), bf16 (uint16 bits), fp16 (int16 bits), int8: every one of the 256 or
    65,536 codes widens, in its unit (fp8: 2^8), to torch's own cast, bit for bit (NaN codes
    aside: the quantisers never write one)."""
    info = np.iinfo(storage)
    codes = np.arange(info.min, info.max + 1).astype(storage)
    out = np.empty(codes.shape, np.float32)
    _widen_all(codes, out)
    ref = cpu_kernels.widen_reference(codes)
    finite = ~np.isnan(ref)
    assert np.array_equal(out[finite].view(np.uint32), ref[finite].view(np.uint32)), \
        f"{np.dtype(storage).name}: {(out[finite] != ref[finite]).sum()} codes widen wrongly"


@numba.njit
def _exp_all(x, out):
    for i in range(x.shape[0]):
        out[i] = _jit.exp_nonpositive(x[i])


def test_exp_nonpositive_is_fp32_accurate():
    x = -np.concatenate([np.linspace(0, 100, 200_001), rng(2).exponential(3, 10_000)]).astype(np.float32)
    out = np.empty_like(x)
    _exp_all(x, out)
    ref = np.exp(x.astype(np.float64))
    normal = x > -87
    relative = np.abs(out[normal] - ref[normal]) / ref[normal]
    assert relative.max() < 3e-7, f"max relative error {relative.max():.2e} at x = {x[normal][relative.argmax()]}"
    assert np.all(out[~normal] < 2e-38)  # flushed towards 0 below -87, never negative or NaN


# ------------------------------------------------------------------ decode attention
def stored_cache(kind, shape, seed):
    """(K or V as stored, its per-token scales or None) from random O(1) values, quantised as
    KVCache does on the CPU (kernels.kv_quant's torch reference for int8/fp8)."""
    from kernels.kv_quant import quantize_kv_reference as quantize
    x = torch.from_numpy(rng(seed).standard_normal(shape, dtype=np.float32))
    if kind == "fp32":
        return x.numpy(), None
    if kind in ("bf16", "fp16"):
        bits = x.to(torch.bfloat16 if kind == "bf16" else torch.float16).view(torch.int16).numpy()
        return (bits.view(np.uint16) if kind == "bf16" else bits), None
    q, scale = quantize(x, kind)
    if kind == "fp8":
        return q.view(torch.uint8).numpy(), None
    return q.numpy(), scale.numpy()


@pytest.mark.parametrize("kind", STORED)
@pytest.mark.parametrize("G", [2, 1, 3])  # 2: the pair loop the lab's CPU models take; else the general one
@pytest.mark.parametrize("dh", [16, 64, 128, 24])  # VECTOR_HEAD_DIMS (16, 64) as vector code (G = 2), the others in scalar loops
def test_decode_attention_equals_its_reference(kind, G, dh):
    """Every storage, rows of different lengths (one of them only the new key; 37 and 12: blocks of
    8 keys and a tail), fp8's per-layer scales != 1, units split into two ranges as two threads would."""
    B, Hkv, S = 3, 2, 37
    lengths = np.array([37, 12, 1], np.int32)
    q = rng(3).standard_normal((B, Hkv, G, dh), dtype=np.float32) * dh ** -0.5
    (k, k_scale), (v, v_scale) = stored_cache(kind, (B, Hkv, S, dh), 4), stored_cache(kind, (B, Hkv, S, dh), 5)
    per_token = k_scale is not None
    k_all, v_all = (np.float32(0.5), np.float32(2.0)) if kind == "fp8" else (np.float32(1), np.float32(1))
    none = np.ones((1, 1, 1), np.float32)
    out = np.full(q.shape, np.nan, np.float32)
    args = (q, k, v, per_token, k_scale if per_token else none, v_scale if per_token else none, k_all, v_all,
            lengths, out)
    cpu_kernels.decode_attention(*args, 0, 3)
    cpu_kernels.decode_attention(*args, 3, B * Hkv)
    ref = cpu_kernels.decode_attention_reference(q, k, v, k_scale if per_token else k_all,
                                                 v_scale if per_token else v_all, lengths)
    assert_close(out, ref, f"{kind} cache, G = {G}")


@pytest.mark.parametrize("kind", STORED)
@pytest.mark.parametrize("dh", [16, 64, 24])
def test_decode_attention_keeps_the_softmax_stable_on_sharp_scores(kind, dh):
    """Scores spread over a thousand (a query 300x the usual size): exp(s - max) needs the true
    running max of every key, the vector blocks' and the tail's (a row of 37: 4 blocks and 5 keys;
    of 32: blocks alone), or exp overflows fp32 (past e^88); the result is then nearly one-hot
    and still the reference's."""
    B, Hkv, S = 2, 2, 37
    lengths = np.array([37, 32], np.int32)
    q = rng(8).standard_normal((B, Hkv, 2, dh), dtype=np.float32) * dh ** -0.5 * 300
    (k, k_scale), (v, v_scale) = stored_cache(kind, (B, Hkv, S, dh), 9), stored_cache(kind, (B, Hkv, S, dh), 10)
    per_token, none, one = k_scale is not None, np.ones((1, 1, 1), np.float32), np.float32(1)
    out = np.full(q.shape, np.nan, np.float32)
    cpu_kernels.decode_attention(q, k, v, per_token, k_scale if per_token else none, v_scale if per_token else none,
                                 one, one, lengths, out, 0, B * Hkv)
    ref = cpu_kernels.decode_attention_reference(q, k, v, k_scale if per_token else one,
                                                 v_scale if per_token else one, lengths)
    assert np.isfinite(out).all(), f"{kind}: exp overflowed"
    assert_close(out, ref, f"{kind} cache, sharp scores")


# ------------------------------------------------------------------ cpu_linear: the three kinds of products
WEIGHTS = [torch.randn(257, 96, generator=torch.Generator().manual_seed(6)),
           torch.randn(96, 40, generator=torch.Generator().manual_seed(7)).t().contiguous().t()]  # [in, out] storage
KINDS = ["numba", "blas", pytest.param("mkl", marks=pytest.mark.skipif(
    not cpu_linear.mkl_packing_available()[0], reason=cpu_linear.mkl_packing_available()[1])),
    pytest.param("onednn", marks=pytest.mark.skipif(
        not cpu_linear.onednn_packing_available()[0], reason=cpu_linear.onednn_packing_available()[1]))]


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("rows", [1, 5, 8, 16])
def test_each_kind_of_products_equals_the_reference(kind, rows, monkeypatch):
    monkeypatch.setattr(cpu_linear, "NUMBA_SHARED_MIN_BYTES", 0)  # numba's products shared out to every core
    monkeypatch.setattr(cpu_linear, "ONEDNN_MIN_WEIGHT_BYTES", 0)  # these small weights packed by oneDNN
    products = cpu_linear.prepare(WEIGHTS, kind)
    assert products.name == kind and kind in products.reason
    for i, w in enumerate(WEIGHTS):
        x = rng(rows).standard_normal((rows, w.shape[1]), dtype=np.float32)
        ref = cpu_kernels.few_rows_linear_reference(x, w.numpy())
        with products.threads():  # as the step runs them (MKL's and oneDNN's on every core)
            assert_close(products(i, x), ref, f"{kind}, weight {i}, {rows} rows")


@pytest.mark.parametrize("rows", [1, 3, 4, 7, 11, 12])
def test_numba_streams_a_large_weight_for_a_few_rows(rows, monkeypatch):
    """A weight of STREAMED_MIN_BYTES and more, for STREAMED_ROWS rows, goes to the prefetching
    2 x 4 tile shared out on the Python pool (its 1,025 rows end in a partial group); other row
    counts to `linear_on_cores`. Both against the reference. (Without AVX-512: with it, the panel
    product takes these rows, tested below.)"""
    calls = []
    monkeypatch.setattr(cpu_kernels, "panels_in_registers", lambda: False)
    monkeypatch.setattr(cpu_linear, "STREAMED_MIN_BYTES", 1025 * 96 * 4)
    monkeypatch.setattr(cpu_linear, "CORES", 2)
    monkeypatch.setattr(cpu_linear, "on_every_core", lambda run, parts: calls.append(parts) or [run(p) for p in range(parts)])
    w = torch.randn(1025, 96, generator=torch.Generator().manual_seed(8))
    products = cpu_linear.prepare([w], "numba")
    x = rng(rows).standard_normal((rows, 96), dtype=np.float32)
    assert_close(products(0, x), cpu_kernels.few_rows_linear_reference(x, w.numpy()), f"{rows} rows, 1,025 x 96")
    assert calls == ([2] if rows in cpu_linear.STREAMED_ROWS else [])


def spy_panels(monkeypatch) -> list:
    """Record the (padded) rows of every panel product."""
    calls, real = [], cpu_kernels.panel_linear_on_cores
    monkeypatch.setattr(cpu_kernels, "panel_linear_on_cores", lambda x, *args: calls.append(x.shape[0]) or real(x, *args))
    return calls


BIG = torch.randn(1025, 96, generator=torch.Generator().manual_seed(9))  # "streamed" below: STREAMED_MIN_BYTES set to its size


def products_with_panels(monkeypatch, registers: bool, kind: str):
    """(`kind`'s products of BIG and a small weight on a CPU with or without AVX-512, the rows of
    every panel product they make)."""
    monkeypatch.setattr(cpu_kernels, "panels_in_registers", lambda: registers)
    monkeypatch.setattr(cpu_linear, "STREAMED_MIN_BYTES", BIG.numel() * 4)
    calls = spy_panels(monkeypatch)
    products = cpu_linear.prepare([BIG, WEIGHTS[0]], kind)
    assert ("panel product" in products.reason) == registers, products.reason
    return products, calls


@pytest.mark.parametrize("registers", [True, False], ids=["avx512", "no avx512"])
def test_numba_products_take_the_panel_product_from_its_rows(monkeypatch, registers):
    """With AVX-512, numba's products multiply by the panel product from PANEL_MIN_ROWS rows (rows
    padded to 4); below, and without AVX-512, by their own loops. Each against the reference."""
    products, calls = products_with_panels(monkeypatch, registers, "numba")
    expected = []
    for rows in (1, 3, 4, 5, 7, 8, 13, 16, 24, 33):
        x = rng(rows).standard_normal((rows, 96), dtype=np.float32)
        x = np.asfortranarray(x) if rows == 24 else x  # not C-contiguous: copied before the kernel reads it
        for i, w in enumerate((BIG, WEIGHTS[0])):
            assert_close(products(i, x), cpu_kernels.few_rows_linear_reference(x, w.numpy()), f"weight {i}, {rows} rows")
            expected += [-(-rows // 4) * 4] if registers and rows >= cpu_linear.PANEL_MIN_ROWS else []
    assert calls == expected
    assert sorted(products.panels.packed) == ([0, 1] if registers else [])


PACKERS = [pytest.param("mkl", marks=pytest.mark.skipif(not cpu_linear.mkl_packing_available()[0], reason="no MKL packing here")),
           pytest.param("onednn", marks=pytest.mark.skipif(not cpu_linear.onednn_packing_available()[0], reason="no oneDNN packing here"))]


@pytest.mark.parametrize("kind", PACKERS)
@pytest.mark.parametrize("registers", [True, False], ids=["avx512", "no avx512"])
def test_a_packer_hands_few_rows_to_numbas_products_where_the_panel_product_applies(monkeypatch, registers, kind):
    """With AVX-512, up to FEW_ROWS (MKL) or ONEDNN_FEW_ROWS rows go to numba's products (the panel product from its
    rows), and MKL or oneDNN packs only for more rows; without, MKL multiplies every product and
    oneDNN from ONEDNN_MIN_ROWS rows (BIG counts as large here). Each against the reference, and
    the one-call step's panels are offered exactly for the rows the panel product takes."""
    monkeypatch.setattr(cpu_linear, "ONEDNN_MIN_WEIGHT_BYTES", BIG.numel() * 4)  # oneDNN packs BIG only
    products, calls = products_with_panels(monkeypatch, registers, kind)
    all_rows = (1, 5, 8, 16, 24, 25, 32, 33, 64, 65)
    packed_for = []
    for rows in all_rows:
        x = rng(rows).standard_normal((rows, 96), dtype=np.float32)
        with products.threads():
            for i, w in enumerate((BIG, WEIGHTS[0])):
                assert_close(products(i, x), cpu_kernels.few_rows_linear_reference(x, w.numpy()), f"weight {i}, {rows} rows")
        packed_for += list(products.packs)
        assert (products.all_panels(rows) is not None) == (registers and rows <= products.few_rows), rows
    few = [rows for rows in all_rows if registers and rows <= products.few_rows]
    own = [rows for rows in all_rows if rows not in few and (kind == "mkl" or rows >= cpu_linear.ONEDNN_MIN_ROWS)]
    assert sorted(set(packed_for)) == own
    # the panel product: both weights up to `few_rows` rows; past them oneDNN's small weight (numba's) too
    paneled = [(rows, 2 if rows in few else 1) for rows in all_rows
               if registers and rows >= cpu_linear.PANEL_MIN_ROWS and (rows in few or kind == "onednn")]
    assert calls == [-(-rows // 4) * 4 for rows, weights in paneled for _ in range(weights)]


@pytest.mark.parametrize("registers, vendor", [(True, "GenuineIntel"), (True, "AuthenticAMD"), (True, ""),
                                               (False, "GenuineIntel"), (False, "AuthenticAMD")])
def test_the_panel_product_applies_wherever_there_is_avx512(monkeypatch, registers, vendor):
    """AVX-512's registers, whoever made the CPU (timed on an Intel Xeon and an AMD EPYC); without
    them numba's loops, saying why."""
    monkeypatch.setattr(cpu_kernels, "panels_in_registers", lambda: registers)
    monkeypatch.setattr(cpu_linear, "cpu_vendor", lambda: vendor)
    available, why = cpu_linear.Panels.available()
    assert available == registers and (why == "") == registers
    assert registers or "AVX-512" in why, why
    products = cpu_linear.prepare(WEIGHTS, "numba")
    assert products.panels.enabled == registers and ("panel product" in products.reason) == registers


def test_panel_copies_that_do_not_fit_are_never_made(monkeypatch):
    """Predicted against free memory before the first copy: too big, and the panel product is off
    for good, saying why, and the products stay right."""
    monkeypatch.setattr(cpu_kernels, "panels_in_registers", lambda: True)
    monkeypatch.setattr(backend, "free_memory_bytes", lambda device: 1000)
    calls = spy_panels(monkeypatch)
    products = cpu_linear.prepare(WEIGHTS, "numba")
    x = rng(16).standard_normal((16, 96), dtype=np.float32)
    assert_close(products(0, x), cpu_kernels.few_rows_linear_reference(x, WEIGHTS[0].numpy()), "16 rows")
    assert calls == [] and not products.panels.packed and not products.panels.enabled
    assert "the panel copies of the weights needs" in products.panels.why_not, products.panels.why_not


@pytest.mark.skipif(not cpu_linear.mkl_packing_available()[0], reason="no MKL packing here")
def test_mkl_keeps_the_packs_of_the_last_batch_sizes(monkeypatch):
    monkeypatch.setattr(cpu_kernels, "panels_in_registers", lambda: False)  # MKL for every row count
    products = cpu_linear.prepare(WEIGHTS, "mkl")
    for rows in (1, 4, 16, 4):
        products(0, np.ones((rows, 96), np.float32))
    assert list(products.packs) == [16, 4][-cpu_linear.MKL_PACKS_KEPT:]


@pytest.mark.skipif(not cpu_linear.onednn_packing_available()[0], reason="no oneDNN packing here")
def test_onednn_packs_only_from_its_row_count_and_keeps_the_last(monkeypatch):
    """oneDNN packs a weight of ONEDNN_MIN_WEIGHT_BYTES or more for ONEDNN_MIN_ROWS rows or more;
    numba multiplies the rest, and its product equals oneDNN's."""
    monkeypatch.setattr(cpu_kernels, "panels_in_registers", lambda: False)  # oneDNN for its rows, not the panels
    monkeypatch.setattr(cpu_linear, "ONEDNN_MIN_WEIGHT_BYTES", WEIGHTS[0].numel() * 4)  # the first only
    products = cpu_linear.prepare(WEIGHTS, "onednn")
    products(0, np.ones((cpu_linear.ONEDNN_MIN_ROWS - 1, 96), np.float32))  # numba's: nothing packed
    assert not products.packs
    for rows in (8, 16, 8):
        products(0, np.ones((rows, 96), np.float32))
    assert list(products.packs) == [16, 8][-cpu_linear.MKL_PACKS_KEPT:]
    big, small = products.packs[8]
    assert big is not None and small is None
    x = rng(8).standard_normal((8, 40), dtype=np.float32)
    assert_close(products(1, x), cpu_kernels.few_rows_linear_reference(x, WEIGHTS[1].numpy()), "small weight, 8 rows")


def test_the_choice_of_products(monkeypatch):
    """MKL's packing only on an Intel CPU; else numba's kernels with oneDNN's packing; else
    numba's alone; else numpy's BLAS; a forced kind that cannot run, or an unknown one, is one
    clear error; LABKIT_CPU_LINEAR forces too."""
    monkeypatch.setattr(cpu_linear, "cpu_vendor", lambda: "AuthenticAMD")
    monkeypatch.setattr(cpu_linear, "onednn_packing_available", lambda: (True, "torch's oneDNN"))
    kind, why = cpu_linear.choose_kind()
    assert kind == "onednn" and "AuthenticAMD" in why
    monkeypatch.setattr(cpu_linear, "onednn_packing_available", lambda: (False, "this torch has no oneDNN"))
    kind, why = cpu_linear.choose_kind()
    assert kind == "numba" and "AuthenticAMD" in why
    with pytest.raises(LabError, match="'onednn' asked for, but this torch has no oneDNN"):
        cpu_linear.choose_kind("onednn")
    with pytest.raises(LabError, match="'mkl' asked for"):
        cpu_linear.choose_kind("mkl")
    monkeypatch.setenv("LABKIT_CPU_LINEAR", "blas")
    assert cpu_linear.choose_kind()[0] == "blas"
    with pytest.raises(LabError, match="known: mkl, onednn, numba, blas"):
        cpu_linear.choose_kind("gemm")
    monkeypatch.delenv("LABKIT_CPU_LINEAR")
    monkeypatch.setattr(cpu_kernels, "AVAILABLE", False)
    assert cpu_linear.choose_kind()[0] == "blas"


def test_a_pack_too_big_for_memory_is_never_made(monkeypatch):
    """Packing copies every weight: where that copy does not fit in free memory, the choice is
    numba's unpacked kernels and says why (a 5 GB fp32 model on an 8 GB laptop would otherwise
    end the kernel at its first step of 8 rows); a forced packing kind is not second-guessed."""
    monkeypatch.setattr(cpu_linear, "cpu_vendor", lambda: "AuthenticAMD")
    monkeypatch.setattr(cpu_linear, "onednn_packing_available", lambda: (True, "torch's oneDNN"))
    monkeypatch.setattr(cpu_kernels, "AVAILABLE", True)
    gib = 2**30
    monkeypatch.setattr(backend, "free_memory_bytes", lambda device: 8 * gib)
    assert cpu_linear.choose_kind(weight_sizes=[5 * gib])[0] == "onednn"
    monkeypatch.setattr(backend, "free_memory_bytes", lambda device: 3 * gib)
    kind, why = cpu_linear.choose_kind(weight_sizes=[5 * gib])
    assert kind == "numba" and why == ("numba's few-row kernel (no packing: oneDNN's packed copy of the "
                                       "weights needs 5.5 GiB but cpu has 3.0 GiB free (keeping 10% and 96 MiB of headroom))")
    assert cpu_linear.pack_bytes("onednn", [5 * gib]) > 5 * gib and cpu_linear.pack_bytes("numba", [5 * gib]) == 0
    small = cpu_linear.ONEDNN_MIN_WEIGHT_BYTES - 1  # a layer's weight: numba's, never packed by oneDNN
    assert cpu_linear.pack_bytes("onednn", [small] * 100) == 0 < cpu_linear.pack_bytes("mkl", [small])
    monkeypatch.setattr(cpu_linear, "mkl_packing_available", lambda: (True, "torch's MKL"))
    kind, why = cpu_linear.choose_kind(weight_sizes=[2 * gib])  # MKL's copy (4 GiB) too big, oneDNN's fits
    assert kind == "onednn" and "MKL's packed copy of the weights needs 4.0 GiB" in why
    assert cpu_linear.choose_kind("onednn", weight_sizes=[5 * gib])[0] == "onednn"


def test_packs_of_a_new_batch_size_replace_the_old_before_they_are_made():
    """At most MKL_PACKS_KEPT sets of packs at any moment, the new one's making included."""
    alive = []

    def pack(rows):
        alive.append(rows)
        assert len(packs.kept) < cpu_linear.MKL_PACKS_KEPT, f"packing {rows} rows beside {list(packs.kept)}"
        return [rows]
    packs = cpu_linear.PacksByRows(pack)
    for rows in (8, 16, 16, 8):
        assert packs[rows] == [rows]
    assert alive == [8, 16, 8] and list(packs) == [16, 8][-cpu_linear.MKL_PACKS_KEPT:]


@pytest.mark.parametrize("rows", [1, 3, 16])
def test_the_fused_elementwise_kernels_equal_the_steps_numpy(rows):
    """rms_norm, rotate_in_place and swiglu (numba) against the CPU step's numpy forms, their
    references, on fresh random inputs: lab-cpu's widths, gates from -30 to 30 (the sigmoid's
    both tails), RoPE at a different position per row."""
    from labkit import cpu_decode
    r = rng(100 + rows)
    x = r.standard_normal((rows, 256), dtype=np.float32) * 3
    weight = r.standard_normal(256, dtype=np.float32)
    eps = np.float32(1e-5)
    want = cpu_decode.rms_norm(x, weight, eps)
    assert_close(cpu_kernels.rms_norm(x, weight, eps), want, "rms_norm")
    qk = r.standard_normal((rows, 6, 64), dtype=np.float32)
    angles = r.uniform(0, 8192, (rows, 1)).astype(np.float32) * r.uniform(0, 1, 32).astype(np.float32)
    cos, sin = np.cos(angles), np.sin(angles)
    cos, sin = np.concatenate((cos, cos), -1)[:, None], np.concatenate((-sin, sin), -1)[:, None]  # [rows, 1, 64]
    want = cpu_decode.CpuDecode._rotate(qk, cos, sin)
    got = qk.copy()
    cpu_kernels.rotate_in_place(got, cos, sin)
    assert_close(got, want, "rotate_in_place")
    gate_up = np.concatenate((r.uniform(-30, 30, (rows, 768)), r.standard_normal((rows, 768))), 1).astype(np.float32)
    assert_close(cpu_kernels.swiglu(gate_up), cpu_decode._swiglu(gate_up), "swiglu")


@pytest.mark.skipif(not cpu_kernels.int8_in_integers(), reason="this CPU has no AVX512-VNNI: int8 is widened to fp32")
@pytest.mark.parametrize("length", [4096, 1000, 257, 9])
def test_int8_attention_in_integers_stays_near_the_reference(length):
    """lab-cpu's int8 attention (dh = 64, G = 2) runs in integers here: `decode_attention` gives
    `attend_pair_int8`'s output (to 1e-6: inlined under fastmath, a division may become a
    multiply by its reciprocal; the float path is 1e-5 to 2e-4 away), and q and the weights
    rounded to int16 keep it within 1e-3 of the largest output of the float64 reference over the
    same codes (measured: ~2e-4 at 4,096 keys; the cache's own int8 rounding is ~4e-3 of each
    value). Rows longer than one int32 block (256 keys), odd lengths (a last key without a
    partner), a sharp and a flat softmax."""
    B, Hkv, S, dh = 2, 2, length + 3, 64
    lengths = np.array([length, length - 1], np.int32)
    for sharpness, seed in ((1.0, 21), (30.0, 22)):
        q = rng(seed).standard_normal((B, Hkv, 2, dh), dtype=np.float32) * dh ** -0.5 * sharpness
        (k, k_scale), (v, v_scale) = stored_cache("int8", (B, Hkv, S, dh), seed + 1), stored_cache("int8", (B, Hkv, S, dh), seed + 2)
        one = np.float32(1)
        out = np.full(q.shape, np.nan, np.float32)
        cpu_kernels.decode_attention(q, k, v, True, k_scale, v_scale, one, one, lengths, out, 0, B * Hkv)
        ref = cpu_kernels.decode_attention_reference(q, k, v, k_scale, v_scale, lengths)
        err = np.abs(out - ref).max() / np.abs(ref).max()
        assert err < 1e-3, f"{length} keys, sharpness {sharpness}: {err:.2e} of the largest output"
        direct = np.full((2, dh), np.nan, np.float32)
        attention_int8.attend_pair_int8(q[1, 1], k[1, 1], v[1, 1], k_scale[1, 1], v_scale[1, 1], one, one,
                                      lengths[1], direct)
        np.testing.assert_allclose(out[1, 1], direct, rtol=1e-6, atol=1e-6 * np.abs(direct).max())


@pytest.mark.skipif(not cpu_kernels.int8_in_integers(), reason="this CPU has no AVX512-VNNI: int8 is widened to fp32")
def test_int8_attention_in_integers_does_not_overflow():
    """The int32 sums at their largest: a flat softmax (q = 0: every weight the largest, 32,767)
    over 4,096 values all +127 in code. One block of 256 keys reaches 256 x 32,767 x 127 ~ 2^30;
    summed over more keys at once the int32 would wrap."""
    B, Hkv, S, dh = 1, 2, 4096, 64
    q = np.zeros((B, Hkv, 2, dh), np.float32)
    k = rng(30).integers(-127, 128, (B, Hkv, S, dh)).astype(np.int8)
    v = np.full((B, Hkv, S, dh), 127, np.int8)
    k_scale = rng(31).random((B, Hkv, S), dtype=np.float32) + np.float32(0.5)
    v_scale = np.full((B, Hkv, S), 0.01, np.float32)
    lengths, one = np.array([S], np.int32), np.float32(1)
    out = np.full(q.shape, np.nan, np.float32)
    cpu_kernels.decode_attention(q, k, v, True, k_scale, v_scale, one, one, lengths, out, 0, B * Hkv)
    np.testing.assert_allclose(out, np.float32(1.27), rtol=1e-5)


# ------------------------------------------------------------------ numba's cached builds
def test_stale_builds_are_dropped_when_the_kernels_change(tmp_path):
    """A cached build holds the kernels it calls compiled in, and numba keys it by its own file
    alone: builds made with other kernels are deleted (index and objects), another function's
    builds are left, and builds made with these kernels are kept."""
    index = "cpu_step.decode_step-57.py311.nbi"
    ours = [tmp_path / index, tmp_path / "cpu_step.decode_step-57.py311.1.nbc",
            tmp_path / "cpu_step.decode_step-57.py311.12.nbc"]
    other = [tmp_path / "cpu_step._product-46.py311.nbi", tmp_path / "cpu_step.decode_step-570.py311.nbi"]
    for path in ours + other:
        path.write_bytes(b"build")
    assert cpu_kernels.drop_stale_builds(tmp_path, index, "digest-1"), "builds without a mark are of unknown kernels"
    assert not any(p.exists() for p in ours) and all(p.exists() for p in other)
    assert (tmp_path / f"{index}.kernels").read_text() == "digest-1"
    for path in ours:  # numba's builds with these kernels
        path.write_bytes(b"build")
    assert not cpu_kernels.drop_stale_builds(tmp_path, index, "digest-1")
    assert all(p.exists() for p in ours)
    assert cpu_kernels.drop_stale_builds(tmp_path, index, "digest-2"), "a kernel's file changed"
    assert not any(p.exists() for p in ours) and all(p.exists() for p in other)


def test_the_sources_digest_changes_with_any_kernel_file(tmp_path):
    """The mark covers every file of the package: a copy hashes alike, and an edit to any one
    file (here the stores, which the attention's builds do not call) changes it."""
    package = Path(cpu_kernels.__file__).parent
    copy, edited = (shutil.copytree(package, tmp_path / name, ignore=shutil.ignore_patterns("__pycache__"))
                    for name in ("copy", "edited"))
    assert cpu_kernels.sources_digest(copy) == cpu_kernels.sources_digest()
    (edited / "stores.py").write_text((package / "stores.py").read_text() + "# an edit\n")
    assert cpu_kernels.sources_digest(edited) != cpu_kernels.sources_digest()


def test_every_cached_build_is_marked_with_these_kernels():
    """Importing the kernels and cpu_step marked every function numba caches, in every file of the
    package and cpu_step's, with the package's digest, through the numba internals
    `drop_stale_builds` is given (a numba that moves them fails here, not silently)."""
    from labkit import cpu_step
    from labkit.cpu_kernels import (_jit, attention, attention_blocks, attention_int8, elementwise, few_rows, panels,
                                    stores)
    marked = 0
    for module in (_jit, attention, attention_blocks, attention_int8, elementwise, few_rows, panels, stores, cpu_step):
        for dispatcher in vars(module).values():
            cache = getattr(dispatcher, "_cache", None)
            if isinstance(cache, numba.core.caching.FunctionCache):
                mark = Path(cache._cache_path) / f"{cache._cache_file._index_name}.kernels"
                assert mark.read_text() == cpu_kernels.sources_digest(), mark
                marked += 1
    assert marked >= 25, f"only {marked} cached functions found: numba's cache moved?"
