"""labkit.cpu_step, the CPU decode step as one numba call: its cache writes bit for bit against the
call-by-call step's (`cpu_decode.store_converted`, torch's conversions), the whole step bit for bit
against the call-by-call step for every cache dtype, and when `CpuDecode` takes it."""
import dataclasses
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from labkit import cpu_decode, cpu_kernels, cpu_linear, cpu_step, decode_paths
from labkit.clock import CALL_BY_CALL, Clock
from labkit.model import Llama
from labkit.specs import get_model

numba = pytest.importorskip("numba", reason="the one-call step is numba's")
ROOT = Path(__file__).resolve().parents[1]
TINY = get_model("lab-tiny")
# lab-cpu's head size (64: the attention's other vector kernels) with a small vocabulary and 2 layers
CPU_SHAPED = dataclasses.replace(get_model("lab-cpu"), n_layers=2, vocab_size=640)
STORED = ("fp32", "bf16", "fp16", "fp8", "int8")


def values_to_round(seed):
    """fp32 values over every range the conversions treat apart: random ones from 1e-12 to 1e4 of
    both signs, each format's subnormals, exact ties between neighbours (bf16, fp16, e4m3), +-0,
    and fp8's clamp at +-448 and past it."""
    rng = np.random.default_rng(seed)
    spread = rng.standard_normal(4000) * 10.0 ** rng.uniform(-12, 4, 4000)
    ties = []  # halfway between a code and the next one up, exact in fp32; random signs
    for dtype, as_int, low, high in ((torch.bfloat16, torch.int16, 0x0080, 0x7F7F), (torch.float16, torch.int16, 1, 0x7BFF),
                                     (torch.float8_e4m3fn, torch.uint8, 1, 0x7E)):
        codes = torch.from_numpy(rng.integers(low, high, 300).astype(np.int64))
        lower, upper = ((codes + step).to(as_int).view(dtype).float() for step in (0, 1))
        ties.append(((lower + upper) / 2).numpy() * rng.choice([-1, 1], 300))
    subnormals = np.concatenate([rng.uniform(-1, 1, 300) * 2.0 ** -6, rng.uniform(-1, 1, 300) * 2.0 ** -14,
                                 rng.uniform(-1, 1, 300) * 2.0 ** -126])
    edges = np.array([0.0, -0.0, 448.0, -448.0, 447.9, 450.0, -470.0, 479.0, 1e6, -1e6, 2.0 ** -9, 2.0 ** -10,
                      3 * 2.0 ** -11, 65504.0, 65520.0, 1e-45])
    return np.concatenate([spread, *ties, subnormals, edges]).astype(np.float32)


@pytest.mark.parametrize("cache_dtype", ["bf16", "fp16", "fp8"])
@pytest.mark.parametrize("seed", [0, 1])
def test_rounded_stores_equal_the_torch_copy_bit_for_bit(cache_dtype, seed):
    """`cpu_kernels.store_rounded` against `cpu_decode.store_converted` (one torch copy, which rounds as
    `.to()` does) on the same values: every stored bit equal, fp8 with a layer scale other than 1."""
    x = values_to_round(seed)
    n = x.size // 8 * 8
    x = x[:n].reshape(2, 4, 1, n // 8)  # [B, Hkv, T = 1, dh]
    as_torch, as_numpy = cpu_decode.AS_STORED[cache_dtype]
    torch_dtype = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp8": torch.float8_e4m3fn}[cache_dtype]
    theirs = torch.zeros(x.shape, dtype=torch_dtype)
    mine = torch.zeros(x.shape, dtype=torch_dtype)
    inverse = np.float32(1 / 0.37 if seed else 1) if cache_dtype == "fp8" else None  # seed 0: the ties kept
    with np.errstate(over="ignore"):  # bf16's largest ties times fp8's inverse: inf, clamped to 448
        cpu_decode.store_converted(theirs[:, :, 0], x[:, :, 0], inverse)
    cpu_kernels.store_rounded(x[:, :, 0], mine.view(as_torch).numpy().view(as_numpy), 0,
                              cpu_kernels.ROUNDED_STORES[cache_dtype], inverse if inverse is not None else np.float32(1))
    got, want = (t.view(as_torch) for t in (mine, theirs))
    assert torch.equal(got, want), f"{(got != want).sum().item()} of {got.numel()} stored values differ"


def build(spec, batch, cache_dtype, seed=5):
    return Llama(spec, batch=batch, max_tokens=40, cache_dtype=cache_dtype, device="cpu", seed=seed)


def run_steps(model, batch, steps=3):
    """Prefill 9 tokens a row, then `steps` decode steps: their logits [steps, B, V]."""
    gen = torch.Generator().manual_seed(11)
    model.prefill(torch.randint(0, model.spec.vocab_size, (batch, 9), generator=gen))
    return torch.stack([model.decode_step(torch.randint(0, model.spec.vocab_size, (batch,), generator=gen))
                        for _ in range(steps)])


def with_panels(monkeypatch):
    """The panel product on (AVX-512 pretended where missing: it is right anywhere), and Intel's
    CPU pretended, so MKL's kind can run where torch has MKL."""
    monkeypatch.setattr(cpu_kernels, "panels_in_registers", lambda: True)
    monkeypatch.setattr(cpu_linear, "cpu_vendor", lambda: "GenuineIntel")


def bits(t):
    return t.view(torch.int32) if t.dtype == torch.float32 else t.view(torch.uint8)


def both_step_forms(spec, batch, cache_dtype, linear, monkeypatch, fp8_scales=(0.5, 2.0)):
    """The same model and tokens through `cpu_step` and through `CpuDecode`'s separate calls
    (`clock.CALL_BY_CALL`), three steps each: (the two models, their logits [3, B, V]). fp8 gets
    layer scales other than 1 (`fp8_scales`: layer 1's K, layer 0's V), as a calibrated engine sets them."""
    with_panels(monkeypatch)
    if linear == "mkl" and not cpu_linear.mkl_packing_available()[0]:
        pytest.skip("no MKL packing here")
    if linear == "onednn" and not cpu_linear.onednn_packing_available()[0]:
        pytest.skip("no oneDNN packing here")
    calls = []
    real = cpu_step.run_step
    monkeypatch.setattr(cpu_step, "run_step", lambda *args: (calls.append(args[-1]), real(*args))[1])
    one, separate = build(spec, batch, cache_dtype), build(spec, batch, cache_dtype)
    for model in (one, separate):
        model.decode_path = cpu_decode.CpuDecode(model, linear=linear, attention="numba")
    separate.clock = CALL_BY_CALL
    if cache_dtype == "fp8":
        for model in (one, separate):
            model.cache.k_scale[1], model.cache.v_scale[0] = fp8_scales
    got, want = run_steps(one, batch), run_steps(separate, batch)
    assert calls == [-(-batch // 4) * 4] * 3  # every step of `one` (B padded to the 4-row tile), none of the other's
    assert "one numba call (cpu_step)" in one.decode_path.reason
    return (one, separate), (got, want)


@pytest.mark.parametrize("cache_dtype", STORED)
@pytest.mark.parametrize("spec, batch", [(TINY, 1), (TINY, 3), (TINY, 5), (TINY, 16), (CPU_SHAPED, 2), (CPU_SHAPED, 13)])
@pytest.mark.parametrize("linear", ["numba", "mkl", "onednn"])
def test_one_call_step_equals_the_call_by_call_step_bit_for_bit(cache_dtype, spec, batch, linear, monkeypatch):
    """Three steps' logits and every cache byte (and int8's scales) equal: both forms run the same
    kernels, so nothing may differ, not even the last bit. fp8's layer scales here are powers of
    two (0.5, 2.0), which scale exactly, so every form of an expression that fastmath lets LLVM
    pick rounds alike (other scales: the test below)."""
    (one, separate), (got, want) = both_step_forms(spec, batch, cache_dtype, linear, monkeypatch)
    assert torch.equal(got, want), f"logits differ by up to {(got - want).abs().max().item():.3e}"
    for a, b in ((one.cache.k, separate.cache.k), (one.cache.v, separate.cache.v)):
        assert torch.equal(bits(a), bits(b))
    if cache_dtype == "int8":
        assert torch.equal(one.cache.k_scale, separate.cache.k_scale)
        assert torch.equal(one.cache.v_scale, separate.cache.v_scale)


def test_a_strided_tokens_view_reaches_the_one_call_step_contiguous(monkeypatch):
    """A column of a [B, T] token tensor is a strided view; numba would take it as another type
    and compile the whole step again for it (3.3 s for lab-tiny, in the middle of a lesson). The step gets
    C-contiguous tokens and the same logits as for a contiguous copy."""
    with_panels(monkeypatch)
    seen = []
    real = cpu_step.run_step
    monkeypatch.setattr(cpu_step, "run_step", lambda *args: (seen.append(args[0]), real(*args))[1])
    batch = 3
    models = [build(TINY, batch, "fp32") for _ in range(2)]
    for model in models:
        model.decode_path = cpu_decode.CpuDecode(model, linear="numba", attention="numba")
        model.prefill(torch.randint(0, model.spec.vocab_size, (batch, 9), generator=torch.Generator().manual_seed(3)))
    columns = torch.randint(0, TINY.vocab_size, (batch, 2), generator=torch.Generator().manual_seed(4))
    assert not columns[:, 0].is_contiguous()
    strided, contiguous = models[0].decode_step(columns[:, 0]), models[1].decode_step(columns[:, 0].contiguous())
    assert len(seen) == 2 and all(tokens.flags.c_contiguous for tokens in seen)
    assert torch.equal(strided, contiguous)


@pytest.mark.parametrize("linear", ["numba", "onednn"])
def test_the_step_forms_agree_with_any_fp8_scale(linear, monkeypatch):
    """fp8 with layer scales that are not powers of two (0.37, 2.5): the logits of the two forms
    within 1e-5. Why not bit for bit: the attention is compiled with fastmath, which lets LLVM
    pick among algebraically equal forms (exp(s k - top k) or exp((s - top) k); a division by the
    softmax's sum or a multiply by its reciprocal), and which it picks can depend on where the
    kernel was compiled: inside the one-call step, or on its own, or loaded from numba's cache
    that another process wrote. Seen: a fresh build under `pytest -n 2`, in one order of the tests,
    put their logits 0.8e-6 to 2.6e-6 apart every time (and the powers of two above never apart)."""
    _, (got, want) = both_step_forms(CPU_SHAPED, 13, "fp8", linear, monkeypatch, fp8_scales=(0.37, 2.5))
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("why", ["mixed lengths", "breakdown clock", "numpy attention", "no panel product",
                                 "MKL's own rows", "oneDNN's own rows", "outputs past whole panels"])
def test_the_call_by_call_step_runs_where_one_call_does_not_apply(why, monkeypatch):
    """Mixed lengths (continuous batching), a breakdown's clock, numpy's attention, products that
    are not the panel product, and batches MKL multiplies itself keep the separate calls."""
    with_panels(monkeypatch)
    if why == "no panel product":
        monkeypatch.setattr(cpu_kernels, "panels_in_registers", lambda: False)
    calls = []
    monkeypatch.setattr(cpu_step, "run_step", lambda *args: calls.append(args))
    batch = {"MKL's own rows": cpu_linear.FEW_ROWS + 4, "oneDNN's own rows": cpu_linear.ONEDNN_FEW_ROWS + 4}.get(why, 3)
    if why == "MKL's own rows" and not cpu_linear.mkl_packing_available()[0]:
        pytest.skip("no MKL packing here")
    if why == "oneDNN's own rows" and not cpu_linear.onednn_packing_available()[0]:
        pytest.skip("no oneDNN packing here")
    # hidden size 72 (4.5 panels of 16): the separate calls slice the padded outputs, the one call does not
    model = build(dataclasses.replace(TINY, hidden_size=72) if why == "outputs past whole panels" else TINY,
                  batch, "fp32")
    linear = {"MKL's own rows": "mkl", "oneDNN's own rows": "onednn"}.get(why, "numba")
    model.decode_path = cpu_decode.CpuDecode(model, linear=linear,
                                             attention="numpy" if why == "numpy attention" else "numba")
    if why == "mixed lengths":
        model.prefill_slot(0, torch.arange(4))
        model.prefill_slot(1, torch.arange(7))
    else:
        model.prefill(torch.arange(5).repeat(batch, 1))
    model.clock = Clock() if why == "breakdown clock" else model.clock
    logits = model.decode_step(torch.arange(batch))
    assert calls == [] and logits.shape == (batch, TINY.vocab_size) and torch.isfinite(logits[:2]).all()
    if why == "outputs past whole panels":  # and it is the step it should be: the torch step's logits
        ref = build(dataclasses.replace(TINY, hidden_size=72), batch, "fp32")
        ref.decode_path = decode_paths.EagerDecode(ref)
        ref.prefill(torch.arange(5).repeat(batch, 1))
        torch.testing.assert_close(logits, ref.decode_step(torch.arange(batch)), atol=2e-5, rtol=2e-5)


def test_a_fresh_process_loads_the_one_call_step_from_numbas_cache_and_runs_it():
    """Numba's cache holds `decode_step`, which is not a parallel function but calls two: loaded in
    a process where no parallel function has run yet, it found no thread pool and crashed
    (numba 0.68). `run_step` starts the pool first. Two fresh processes: the first may compile,
    the second loads from the cache, and both must finish."""
    script = ("import torch; from labkit import cpu_kernels, cpu_linear, cpu_step\n"
              "cpu_kernels.panels_in_registers = lambda: True\n"
              "cpu_linear.cpu_vendor = lambda: 'GenuineIntel'\n"
              "from labkit.model import Llama; from labkit.specs import get_model\n"
              "calls = []; real = cpu_step.run_step\n"
              "cpu_step.run_step = lambda *a: (calls.append(1), real(*a))[1]\n"
              "m = Llama(get_model('lab-tiny'), batch=4, max_tokens=16, device='cpu', seed=1)\n"
              "from labkit import cpu_decode; m.decode_path = cpu_decode.CpuDecode(m, linear='numba')\n"
              "m.prefill(torch.arange(5).repeat(4, 1)); m.decode_step(torch.arange(4))\n"
              "assert calls == [1], calls\n")
    for run in range(2):
        done = subprocess.run([sys.executable, "-c", script], cwd=ROOT, capture_output=True, text=True, timeout=300)
        assert done.returncode == 0, f"run {run}: exit {done.returncode}\n{done.stderr[-2000:]}"


def test_run_step_starts_numbas_pool_once_a_process(monkeypatch):
    """`run_step` asks numba to start its pool the first time in a process (and again in a
    forked child, whose pid differs), not before every step."""
    asked = []
    monkeypatch.setattr(cpu_step.numba, "get_num_threads", lambda: asked.append(1) or 2)
    monkeypatch.setattr(cpu_step, "decode_step", lambda *args: args)
    monkeypatch.setattr(cpu_step, "_POOL_STARTED_IN", [None])
    assert cpu_step.run_step(1, 2) == (1, 2) and cpu_step.run_step(3) == (3,)
    assert asked == [1]
    monkeypatch.setattr(cpu_step.os, "getpid", lambda: -1)  # as in a forked child
    cpu_step.run_step(4)
    cpu_step.run_step(5)
    assert asked == [1, 1]
