"""The CPU path on a CPU that is not Intel's, as this x86 machine can show it (issue 16, item 4):
Apple silicon (no /proc at all) and Graviton (an ARM /proc/cpuinfo without vendor_id).

MKL is Intel's, so `cpu_linear` keeps its packed products to "GenuineIntel"; elsewhere it must
fall back to oneDNN's packing with numba's kernels, numba's kernels alone, or numpy's BLAS, and
each must give the reference's products and, in the decode step, the torch step's logits. Here
the vendor is forced, and each fallback forced in turn, on fresh random inputs.
"""
from __future__ import annotations

import io

import numpy as np
import pytest
import torch

from labkit import cpu_info, cpu_kernels, cpu_linear, decode_paths, ops
from labkit.model import Llama
from labkit.specs import get_model
from test_model import assert_step_close  # the decode step's comparison, one-code cache flips allowed

TINY = get_model("lab-tiny")
NUMBA = cpu_kernels.AVAILABLE
GRAVITON = ("processor\t: 0\nBogoMIPS\t: 243.75\nFeatures\t: fp asimd evtstrm aes pmull sha1 sha2 crc32\n"
            "CPU implementer\t: 0x41\nCPU architecture: 8\nCPU variant\t: 0x1\nCPU part\t: 0xd40\n\n")


def fake_cpuinfo(text: str | None):
    """`open` for cpu_info: /proc/cpuinfo reads `text`, or is missing (None: macOS)."""
    def fake_open(path, *args, **kwargs):
        if text is None:
            raise FileNotFoundError(path)
        return io.StringIO(text)
    return fake_open


@pytest.mark.parametrize("machine, cpuinfo", [("Apple silicon: no /proc", None), ("Graviton", GRAVITON)])
def test_an_arm_cpu_has_no_vendor_and_gets_no_mkl_packing(monkeypatch, machine, cpuinfo):
    monkeypatch.setattr(cpu_info, "open", fake_cpuinfo(cpuinfo), raising=False)
    ops.mkl_for_many_rows.cache_clear()
    assert cpu_info.cpu_vendor() == "" and cpu_linear.cpu_vendor() == ""
    assert not ops.mkl_for_many_rows(), "MKL for prefill's products on a CPU that is not Intel's"
    ops.mkl_for_many_rows.cache_clear()  # the real answer again for the tests after this one
    ok, why = cpu_linear.mkl_packing_available()
    assert not ok and ("CPU vendor unknown" in why or "no MKL" in why or "no packed MKL" in why), why
    kind, reason = cpu_linear.choose_kind()
    assert kind != "mkl" and kind == ("onednn" if NUMBA and cpu_linear.onednn_packing_available()[0]
                                      else "numba" if NUMBA else "blas"), reason


def arm(monkeypatch, onednn: bool, numba: bool):
    """This machine as an Apple CPU with oneDNN's packing and numba present or not."""
    monkeypatch.setattr(cpu_linear, "cpu_vendor", lambda: "Apple")
    if not onednn:
        monkeypatch.setattr(cpu_linear, "onednn_packing_available", lambda: (False, "this torch has no oneDNN"))
    if not numba:
        monkeypatch.setattr(cpu_kernels, "AVAILABLE", False)


FALLBACKS = [pytest.param(True, True, "onednn", marks=pytest.mark.skipif(
                 not (NUMBA and cpu_linear.onednn_packing_available()[0]), reason="no oneDNN or no numba here")),
             pytest.param(False, True, "numba", marks=pytest.mark.skipif(not NUMBA, reason="numba is not installed")),
             (False, False, "blas")]


@pytest.mark.parametrize("onednn, numba, expected", FALLBACKS)
@pytest.mark.parametrize("rows", [1, 4, 16])
def test_each_fallback_is_chosen_in_turn_and_gives_the_reference_products(monkeypatch, onednn, numba, expected, rows):
    arm(monkeypatch, onednn, numba)
    weights = [torch.randn(384, 96), torch.randn(40, 96).t().contiguous().t()]  # [out, in], one [in, out]-stored
    products = cpu_linear.prepare(weights)
    assert products.name == expected and "Apple" in products.reason, products.reason
    for i, w in enumerate(weights):
        x = np.random.default_rng().standard_normal((rows, w.shape[1]), dtype=np.float32)
        want = (torch.from_numpy(x).double() @ w.double().t()).numpy()
        np.testing.assert_allclose(products(i, x), want, rtol=1e-4, atol=1e-4, err_msg=f"{expected}, weight {i}")


@pytest.mark.parametrize("kind, name", [pytest.param("numba", "numba", marks=pytest.mark.skipif(
    not NUMBA, reason="numba is not installed")), ("blas", "blas+numba" if NUMBA else "numpy")])
@pytest.mark.parametrize("cache_dtype", ["fp32", "int8"])
def test_the_decode_step_with_each_forced_product_gives_the_torch_steps_logits(monkeypatch, kind, name, cache_dtype):
    """LABKIT_CPU_LINEAR=numba|blas on a CPU that is not Intel's: the step says which products it
    runs, and its logits are the torch step's on fresh tokens, step after step."""
    monkeypatch.setattr(cpu_linear, "cpu_vendor", lambda: "Apple")
    monkeypatch.setenv("LABKIT_CPU_LINEAR", kind)
    fast, plain = (Llama(TINY, batch=3, max_tokens=32, cache_dtype=cache_dtype, device="cpu", seed=5) for _ in range(2))
    plain.decode_path = decode_paths.EagerDecode(plain)
    assert fast.decode_path.name == name, fast.decode_path.reason
    prompt = torch.randint(0, TINY.vocab_size, (3, 7))
    fast.prefill(prompt), plain.prefill(prompt)
    for i in range(3):
        step = torch.randint(0, TINY.vocab_size, (3,))
        # test_model's comparison: fp32-tight, but a row whose int8 cache took a one-code flip to that code's weight
        assert_step_close(fast.decode_step(step), plain.decode_step(step), fast.cache, plain.cache, cache_dtype, f"step {i}")


@pytest.mark.parametrize("shape", [(1, 256, 96), (4, 96, 9000), (600, 96, 40)])  # one thread, split, all threads
def test_a_numpy_without_openblas_still_multiplies(monkeypatch, shape):
    """numpy's macOS arm64 wheels link Apple's Accelerate, not OpenBLAS: there is no OpenBLAS
    thread count to set, and `cpu_blas` leaves the threads to the library, products unchanged."""
    from labkit import cpu_blas
    monkeypatch.setattr(cpu_blas, "_find_openblas_threads", lambda: None)
    monkeypatch.setattr(cpu_blas, "BLAS_THREADS", cpu_blas.BlasThreads())
    monkeypatch.setattr(cpu_blas, "CORES", 2)
    rows, inner, cols = shape
    a = np.random.default_rng().standard_normal((rows, inner), dtype=np.float32)
    b = np.random.default_rng().standard_normal((inner, cols), dtype=np.float32)
    got = cpu_blas.blas_matmul(a, b)
    assert cpu_blas.BLAS_THREADS.found is False, "looked for OpenBLAS, found none"
    np.testing.assert_allclose(got, a.astype(np.float64) @ b.astype(np.float64), rtol=1e-4, atol=1e-3)
