"""`ops.TorchOps.linear`, the CPU model's fp32 products: numpy's OpenBLAS, or torch's MKL for
many rows on an Intel CPU (prefill), each on fresh random inputs against a float64 reference,
and each routed where `ops.MKL_MIN_ROWS` and the CPU's vendor say."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from labkit import cpu_info, ops
from labkit.model import _param

TOL = dict(rtol=1e-4, atol=1e-4)  # fp32 products of K <= 768 against float64


def weight(out_features: int, in_features: int) -> torch.Tensor:
    """A [out, in] weight laid out as the CPU model lays it out ([in, out]-contiguous), fresh random."""
    return _param(torch.Generator().manual_seed(int(np.random.default_rng().integers(1 << 30))),
                  (out_features, in_features), 0.05, torch.float32, "cpu").data


def spy_blas(monkeypatch) -> list:
    """Record every call `TorchOps.linear` makes to numpy's BLAS (the rows of each)."""
    calls, real = [], ops.blas_matmul
    monkeypatch.setattr(ops, "blas_matmul", lambda a, b: calls.append(a.shape[0]) or real(a, b))
    return calls


ONEDNN = torch.backends.mkldnn.is_available()


@pytest.mark.parametrize("vendor", ["intel", pytest.param("amd", marks=pytest.mark.skipif(not ONEDNN, reason="no oneDNN")),
                                    "other"])
@pytest.mark.parametrize("shape", [(1, 5, 256), (1, ops.MKL_MIN_ROWS - 1, 96), (1, ops.MKL_MIN_ROWS, 96), (2, 300, 256)])
def test_products_are_right_and_go_where_the_rows_and_the_vendor_say(monkeypatch, vendor, shape):
    """Many rows: MKL on an Intel CPU, oneDNN's linear on an AMD one, OpenBLAS elsewhere; few rows
    OpenBLAS everywhere."""
    monkeypatch.setattr(ops, "mkl_for_many_rows", lambda: vendor == "intel")
    monkeypatch.setattr(ops, "onednn_for_many_rows", lambda: vendor == "amd")
    calls = spy_blas(monkeypatch)
    x, w = torch.randn(shape), weight(384, shape[-1])
    got = ops.TorchOps.linear(x, w)
    want = (x.double() @ w.double().T).float()
    torch.testing.assert_close(got, want, **TOL)
    many = x.numel() // x.shape[-1] >= ops.MKL_MIN_ROWS
    assert (calls == []) == (vendor != "other" and many), f"rows {x.numel() // x.shape[-1]}, {vendor}: BLAS calls {calls}"


@pytest.mark.parametrize("vendor, want", [("GenuineIntel", False), ("AuthenticAMD", True), ("", False)])
def test_onednn_takes_many_rows_only_on_an_amd_cpu_with_a_torch_whose_onednn_works(monkeypatch, vendor, want):
    monkeypatch.setattr(cpu_info, "cpu_vendor", lambda: vendor)
    ops.onednn_for_many_rows.cache_clear()
    try:
        assert ops.onednn_for_many_rows() == (want and ONEDNN)
        ops.onednn_for_many_rows.cache_clear()
        monkeypatch.setattr(torch.ops.mkldnn, "_linear_pointwise", lambda *a: (_ for _ in ()).throw(RuntimeError("no")),
                            raising=False)
        assert not ops.onednn_for_many_rows()  # a build whose op fails keeps OpenBLAS
    finally:
        ops.onednn_for_many_rows.cache_clear()


@pytest.mark.parametrize("vendor, want", [("GenuineIntel", True), ("AuthenticAMD", False), ("", False)])
def test_mkl_takes_many_rows_only_on_an_intel_cpu_with_a_torch_that_has_mkl(monkeypatch, vendor, want):
    monkeypatch.setattr(cpu_info, "cpu_vendor", lambda: vendor)
    ops.mkl_for_many_rows.cache_clear()
    try:
        assert ops.mkl_for_many_rows() == (want and torch.backends.mkl.is_available())
    finally:
        ops.mkl_for_many_rows.cache_clear()
