"""`python -m labkit.warm` (run by `make venv`): lab-cpu's decode step once per cache dtype and
batch, so numba compiles at setup; it says what it did, and what it skipped and why."""
from __future__ import annotations

import pytest

from labkit import backend, clock, cpu_kernels, warm


@pytest.mark.skipif(not cpu_kernels.AVAILABLE, reason="numba is not installed")
def test_warm_runs_the_step_it_names(monkeypatch):
    """One dtype at one batch (the whole set takes ~40 s from cold): the real model's step runs, as
    one call and call by call, and the line names what ran."""
    monkeypatch.setattr(warm, "CACHE_DTYPES", ("int8",))
    monkeypatch.setattr(warm, "BATCHES", (4,))
    steps = []
    real = warm.Llama.decode_step
    monkeypatch.setattr(warm.Llama, "decode_step", lambda self, tokens, *a: steps.append(
        (self.spec.name, self.cache.cache_dtype, tokens.shape[0], self.clock)) or real(self, tokens, *a))
    line = warm.warm()
    # the one-call step, then the separate calls a breakdown times
    assert steps == [("lab-cpu", "int8", 4, clock.OFF), ("lab-cpu", "int8", 4, clock.CALL_BY_CALL)]
    assert line.startswith("warm: the CPU decode step's kernels compiled or loaded for int8 caches at batch 4"), line


def test_without_numba_or_on_a_gpu_it_says_why_and_runs_nothing(monkeypatch):
    monkeypatch.setattr(warm, "Llama", lambda *a, **k: pytest.fail("built a model"))
    monkeypatch.setattr(cpu_kernels, "AVAILABLE", False)
    assert warm.warm() == "warm: numba is not installed; the CPU step uses numpy's forms, nothing to compile"
    monkeypatch.setattr(cpu_kernels, "AVAILABLE", True)
    monkeypatch.setattr(backend, "choose_device", lambda device: type("Choice", (), {"device": "cuda"})())
    assert warm.warm().startswith("warm: a GPU runs the lab")


def test_a_bad_argument_is_one_line_and_exit_2(capsys):
    assert warm.main(["--bogus"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("warm: error:") and len(err.strip().splitlines()) == 1


def test_on_two_cores_a_helper_takes_all_but_the_first_dtype(monkeypatch):
    """The helper is `python -m labkit.warm --cache-dtypes <the rest>` (which warms alone); this
    process warms the first; a helper that fails is an error naming it, after both have ended."""
    monkeypatch.setattr(warm, "CORES", 2)
    monkeypatch.setattr(warm, "BATCHES", (4,))
    ran, started = [], []
    monkeypatch.setattr(warm.Llama, "decode_step", lambda self, tokens, *a: ran.append(self.cache.cache_dtype))

    class Helper:
        def __init__(self, argv, **kwargs):
            started.append(argv[1:])
            self.returncode = exit_code

        def communicate(self):
            return ("Traceback ...\nMemoryError", None) if exit_code else ("warm: ...", None)

    monkeypatch.setattr(warm.subprocess, "Popen", Helper)
    exit_code = 0
    line = warm.warm(("fp32", "bf16", "int8"))
    assert started == [["-m", "labkit.warm", "--cache-dtypes", "bf16,int8"]] and ran == ["fp32"] * len(warm.CLOCKS)
    assert line.startswith("warm: the CPU decode step's kernels compiled or loaded for fp32, bf16, int8 caches"), line
    exit_code = 1
    with pytest.raises(warm.LabError, match=r"helper warming bf16, int8 failed \(exit 1\): MemoryError"):
        warm.warm(("fp32", "bf16", "int8"))
    started.clear()
    warm.warm(("fp32", "bf16"), helper=False)  # the helper's own call: no helper of its own
    monkeypatch.setattr(warm, "CORES", 1)
    warm.warm(("fp32", "bf16"))  # one core: everything here
    assert started == []


def test_cache_dtypes_are_checked_before_anything_runs(capsys, monkeypatch):
    monkeypatch.setattr(warm, "warm", lambda *a, **k: pytest.fail("warmed"))
    for bad in ("fp8", "fp32,bogus", ","):
        assert warm.main(["--cache-dtypes", bad]) == 2
        err = capsys.readouterr().err
        assert err.startswith("warm: error: --cache-dtypes:") and "the CPU offers fp32, bf16, int8" in err, err
