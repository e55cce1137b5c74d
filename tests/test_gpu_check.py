"""labkit.gpu_check: the dry run end to end (recordings, provenance, no overwriting) and its CLI errors.
(Its formulas are tested in test_roofline.py, its device-name presets in test_specs.py and its
tolerances in test_kernels_tolerances.py.)

The dry run is run as the Makefile runs it, in a subprocess: TRITON_INTERPRET must be set before
triton is imported (the command does it), and its exit code and output are part of what is checked.
"""
import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from labkit import gpu_check as command
from labkit import gpu_run as gc_run
from labkit.gpu_check import NO_GPU
from labkit.gpu_run import SECTIONS, SHARES, Budget
from labkit.sizes import GPU_CHECK_DRY as DRY

ROOT = Path(__file__).resolve().parent.parent
NAME = re.compile(r"^(?P<section>[a-z_]+)-[a-z0-9-]+-\d{8}-\d{4}(-\d+)?\.json$")


def gpu_check(*args, timeout=300, **env):
    """Run `python -m labkit.gpu_check ARGS` from the repository root; env entries override. The
    command itself picks the interpreter where there is no GPU (labkit.backend), as under make."""
    return subprocess.run([sys.executable, "-m", "labkit.gpu_check", *args], cwd=ROOT, env={**os.environ, **env},
                          capture_output=True, text=True, timeout=timeout)


def recordings(directory: Path) -> dict:
    """{section: [recording, ...]} for every JSON file in `directory`, each with its "_name"."""
    found = {}
    for path in sorted(directory.glob("*.json")):
        match = NAME.match(path.name)
        assert match, f"unexpected recording name {path.name}"
        found.setdefault(match["section"], []).append({**json.loads(path.read_text()), "_name": path.name})
    return found


@pytest.fixture(scope="module")
def dry_run(tmp_path_factory):
    """`make gpu-check DRY=1`, as a user runs it (and `make test` runs it only here): the target's
    wiring, its private calibration cache (build/test-cache/gpu-check-dry) and the run itself."""
    out = tmp_path_factory.mktemp("gpu-check")
    done = subprocess.run(["make", "--no-print-directory", "-o", "venv", "-o", ".venv/.stamp", "gpu-check", "DRY=1",
                           f"OUT={out}"], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, f"exit {done.returncode}\n{done.stdout[-3000:]}\n{done.stderr[-3000:]}"
    return out, done


@pytest.mark.triton
@pytest.mark.slow
def test_dry_run_writes_one_recording_per_section(dry_run):
    out, done = dry_run
    found = recordings(out)
    assert sorted(found) == sorted(SECTIONS)
    for section, (record,) in found.items():
        assert record["dry_run"] is True and record["section"] == section
        assert record["provenance"]["device"] and record["provenance"]["date"]
        assert "labkit.gpu_check" in record["provenance"]["command"]
        assert record["dtype"] and record["sizes"]["model"] == DRY.model
    summary = json.loads(done.stdout.strip().splitlines()[-1])
    assert summary["dry_run"] is True and summary["correctness_passed"]
    # the checks the interpreter cannot run (an in-kernel fp8 cast) are named, with why; nothing else was left out
    assert list(summary["correctness_not_run"]) == ["kv_quant fp8", "rope_store fp8", "rope_store prefill fp8"]
    assert summary["gpu_check"].startswith("ok, but not run: kv_quant fp8 (needs a GPU")
    assert not list(out.glob("*.partial.jsonl")), "a finished section's partial log is replaced by its recording"
    assert len(summary["recordings"]) == len(SECTIONS)


def steps(record, key):
    """The steps a recording lists under `key`; none may have raised."""
    items = record[key]
    errors = [s for s in items if "error" in s]
    assert not errors, f"steps raised: {errors}"
    return items


@pytest.mark.triton
@pytest.mark.slow
def test_dry_run_correctness_checks_all_kernels_and_pass(dry_run):
    (record,) = recordings(dry_run[0])["correctness"]
    checks = steps(record, "checks")
    assert record["all_passed"] is True
    assert {c.get("kernel") for c in checks if "skipped" not in c} == {
        "matmul", "flash_attention", "decode_attention", "kv_quant", "add_rms_norm", "rope_store", "swiglu"}
    for check in checks:
        assert check["passed"], check
        if "skipped" not in check:  # the fp8 quantiser needs a GPU (the interpreter miscasts it)
            assert check["ref_max_abs"] > 10 * check["max_abs_err"], f"check too weak to fail: {check}"
    for kernel in ("decode_attention", "rope_store"):
        assert {c["cache_dtype"] for c in checks if c.get("kernel") == kernel} == {"fp16", "fp8", "int8"}


@pytest.mark.triton
@pytest.mark.slow
def test_dry_run_times_kernels_and_sweeps(dry_run):
    found = recordings(dry_run[0])
    timings = steps(found["kernels"][0], "timings")
    assert {t["kernel"] for t in timings} == {"matmul", "flash_attention", "decode_attention"}
    assert all(t["time_s"] > 0 and t["baseline_time_s"] > 0 for t in timings)
    assert found["kernels"][0]["quant_speedups"], "fp8/int8 vs float speed-ups at the long context"
    for section, phase in (("prefill_sweep", "prefill"), ("decode_sweep", "decode")):
        points = steps(found[section][0], "points")
        assert points and not [p for p in points if "skipped" in p], f"{section}: {points}"
        assert all(p["phase"] == phase and p["time_s"] > 0 and p["predicted_time_s"] > 0 for p in points)
    decode = found["decode_sweep"][0]["points"]
    assert {p["cache_dtype"] for p in decode} == {"bf16", "int8"}, "on the CPU, the cache dtypes its lab offers"
    assert "no fp8" in found["decode_sweep"][0]["not_offered"]["fp8"]
    assert max(p["batch"] for p in decode) == DRY.max_batch, "batches double up to what fits"


@pytest.mark.triton
@pytest.mark.slow
def test_dry_run_prints_the_roof_before_each_measurement(dry_run):
    lines = dry_run[1].stdout.splitlines()
    for i, line in enumerate(lines):
        if line.split("] ", 1)[-1].lstrip().startswith(("measured", "triton")):
            assert "roof" in lines[i - 1], f"no roof printed before: {line!r}"


@pytest.mark.triton
@pytest.mark.slow
def test_a_second_run_adds_recordings_and_overwrites_none(dry_run, tmp_path):
    """A second run into the same folder (its calibration only: names are stamped to the minute,
    so within it the name is taken) writes beside the first's recordings, changing none."""
    out = shutil.copytree(dry_run[0], tmp_path / "out")  # the fixture's folder stays as the dry run left it
    before = {p.name: p.read_bytes() for p in out.glob("*.json")}
    done = gpu_check("--out", str(out), "--dry-run", "--only", "calibration")
    assert done.returncode == 0, done.stderr[-3000:]
    after = {p.name: p.read_bytes() for p in out.glob("*.json")}
    added = sorted(set(after) - set(before))
    assert len(after) == len(before) + 1 and added[0].startswith("calibration-"), added
    assert all(after[name] == data for name, data in before.items())


@pytest.mark.triton
def test_out_of_budget_steps_are_recorded_as_skipped(tmp_path, capsys):
    # A budget spent before the first step: every step is skipped, every recording still written.
    code = command.main(["--out", str(tmp_path), "--dry-run", "--budget-s", "1e-6", "--only", "correctness,decode_sweep"])
    assert code == 0
    found = recordings(tmp_path)
    assert sorted(found) == ["correctness", "decode_sweep"]
    items = found["correctness"][0]["checks"] + found["decode_sweep"][0]["points"]
    assert items and all(item["skipped"] == "budget" for item in items)
    summary = json.loads(capsys.readouterr().out.splitlines()[-1])
    assert summary["correctness_passed"] is True  # nothing failed, but the summary says nothing ran
    assert set(summary["correctness_not_run"].values()) == {"budget"}
    assert len(summary["correctness_not_run"]) == len(found["correctness"][0]["checks"])
    assert summary["gpu_check"].startswith("ok, but not run: matmul")


@pytest.mark.triton
def test_a_section_that_raises_is_recorded_and_the_next_still_runs(tmp_path, monkeypatch, capsys):
    def broken(run):
        raise RuntimeError("CUDA error: an illegal memory access was encountered\nmore lines")
    monkeypatch.setitem(command.SECTION_FUNCTIONS, "calibration", broken)
    code = command.main(["--out", str(tmp_path), "--dry-run", "--budget-s", "1e-6", "--only", "calibration,correctness"])
    assert code == 0
    found = recordings(tmp_path)
    assert found["calibration"][0]["error"] == "RuntimeError: CUDA error: an illegal memory access was encountered"
    assert found["correctness"][0]["checks"], "the next section ran"
    summary = json.loads(capsys.readouterr().out.splitlines()[-1])
    assert summary["section_errors"] == {"calibration": found["calibration"][0]["error"]}


def test_each_finished_step_is_on_disk_before_its_section_ends(tmp_path):
    """A run killed mid-section keeps the steps it finished (the .partial.jsonl); the section's
    recording replaces the partial log when the section ends."""
    args = command.parse_args(["--out", str(tmp_path), "--dry-run"])
    run = gc_run.Run(args, "cpu", "fp16", DRY, Budget(60, SECTIONS), None)
    run.budget.section = "kernels"
    partial = Path(gc_run.partial_path(run, "kernels"))
    seen = []
    results = gc_run.run_steps(run, [("first", lambda: {"value": 1}),
                                 ("second", lambda: seen.append(partial.read_text().splitlines()) or 1 / 0)])
    assert [json.loads(line) for line in seen[0]] == [{"step": "first", "value": 1}]  # on disk before "second"
    lines = [json.loads(line) for line in partial.read_text().splitlines()]
    assert lines == results and lines[1]["error"] == "ZeroDivisionError: division by zero"
    gc_run.write_section(run, "kernels", {"timings": results})
    assert not partial.exists() and recordings(tmp_path)["kernels"][0]["timings"] == results


@pytest.mark.triton
@pytest.mark.slow
def test_a_failed_check_exits_1_and_is_recorded(tmp_path, monkeypatch, capsys):
    from kernels import tolerances  # the table the correctness section reads: nothing passes at 0
    monkeypatch.setattr(tolerances, "FLOAT", {dtype: (0.0, 0.0) for dtype in tolerances.FLOAT})
    monkeypatch.setattr(tolerances, "QUANTISED_CACHE", {dtype: (0.0, 0.0) for dtype in tolerances.QUANTISED_CACHE})
    assert command.main(["--out", str(tmp_path), "--dry-run", "--only", "correctness"]) == 1
    (record,) = recordings(tmp_path)["correctness"]
    assert record["all_passed"] is False and any(not c["passed"] for c in record["checks"])
    assert json.loads(capsys.readouterr().out.splitlines()[-1])["gpu_check"] == "correctness failed"


@pytest.mark.parametrize("args", [
    [],  # --out is required
    ["--out", "x", "--budget-s", "-5"],
    ["--out", "x", "--budget-s", "soon"],
    ["--out", "x", "--only", "kernels,warp_drive"],
    ["--out", "x", "--frobnicate"],
])
def test_bad_arguments_exit_2_with_one_line(args, tmp_path):
    done = gpu_check(*[str(tmp_path / a) if a == "x" else a for a in args], "--dry-run", timeout=60)
    assert done.returncode == 2
    assert "Traceback" not in done.stderr and len(done.stderr.strip().splitlines()) == 1, done.stderr
    assert not list(tmp_path.glob("**/*.json"))


def test_an_unwritable_out_is_refused_before_any_section_runs(tmp_path):
    (tmp_path / "a-file").write_text("not a folder")
    done = gpu_check("--out", str(tmp_path / "a-file" / "recordings"), "--dry-run", timeout=60)
    assert done.returncode == 2 and done.stdout == ""  # not even the dry run's autotuning line
    assert done.stderr.strip() == f"gpu_check: error: cannot write recordings in {str(tmp_path / 'a-file' / 'recordings')!r}: Not a directory"


@pytest.mark.triton
def test_no_gpu_without_dry_run_exits_2(tmp_path):
    done = gpu_check("--out", str(tmp_path), CUDA_VISIBLE_DEVICES="", timeout=60)  # hides any GPU
    assert done.returncode == 2 and done.stderr.strip() == NO_GPU
    assert not list(tmp_path.iterdir())


def test_budget_passes_unused_time_on():
    budget = Budget(100.0, ("correctness", "kernels"))
    shares = budget.deadline_s["correctness"] - budget.start_s, budget.deadline_s["kernels"] - budget.start_s
    total = SHARES["correctness"] + SHARES["kernels"]
    assert shares[0] == pytest.approx(100 * SHARES["correctness"] / total) and shares[1] == pytest.approx(100.0)


def test_importing_the_check_loads_neither_torch_nor_triton():
    """Bad arguments are answered before torch loads, and the interpreter can still be chosen
    after the import (triton reads TRITON_INTERPRET when it is imported)."""
    code = ("import sys, labkit.gpu_check; "
            "print('torch' in sys.modules, 'triton' in sys.modules)")
    done = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, check=True)
    assert done.stdout.split() == ["False", "False"]


def test_the_check_imports_no_jupyter_package():
    """A GPU image has torch, triton and numpy only: the check's modules must not need more."""
    code = ("import sys; import labkit.gpu_check; "
            "print(sorted(m for m in ('plotly', 'ipywidgets', 'IPython', 'nbformat', 'jupyter_core') if m in sys.modules))")
    done = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, check=True)
    assert done.stdout.strip() == "[]"


def test_headline_figures_leave_out_host_bound_and_cache_resident_timings(tmp_path):
    """decode_max_bandwidth_fraction_* is a max over timings of the GPU alone: a host-bound point
    and one whose working set sat in L2 unflushed are left out, and named."""
    from labkit import gpu_sections
    args = command.parse_args(["--out", str(tmp_path), "--dry-run"])
    run = gc_run.Run(args, "cuda", "bf16", DRY, Budget(60, SECTIONS), None)

    def timing(step, fraction, **flags):
        return {"step": step, "kernel": "decode_attention", "time_s": 1e-5, "bandwidth_fraction_datasheet": fraction,
                "shape": {"B": 1, "S": 16384}, "cache_dtype": "fp8", **flags}
    timings = [timing("ok", 0.8, l2_flushed=True, l2_resident=False), timing("slow host", 0.1, host_bound=True),
               timing("in L2", 1.4, l2_resident=True)]
    gpu_sections.summarize_kernels(run, timings, [])
    assert run.results["decode_max_bandwidth_fraction_datasheet"] == 0.8
    assert run.results["headline_left_out"] == {
        "slow host": "host-bound", "in L2": "cache-resident (working set under 2x L2, not flushed)"}


@pytest.mark.triton
def test_a_dry_run_states_what_full_autotuning_costs():
    from labkit.gpu_run import autotune_estimate
    from labkit.sizes import GPU_CHECK_FULL
    est = autotune_estimate(GPU_CHECK_FULL, 420.0)
    # bucketed keys: 7 prompts + 4 decode batches past the split-K path, 4 linears each, far
    # fewer than one key per distinct M; the cost is keys x tiles x triton's do_bench defaults
    assert 0 < est["matmul_keys"] <= 60 and 0 < est["flash_keys"] <= 12
    assert est["autotune_s"] == pytest.approx(est["seconds_per_tile"] * (
        est["matmul_keys"] * est["matmul_tiles_per_key"] + est["flash_keys"] * est["flash_tiles_per_key"]), abs=0.1)
    assert est["budget_fraction"] < 0.5


@pytest.mark.triton
def test_a_cache_write_is_checked_with_its_int8_scales():
    """The int8 per-token scales rope_store writes (Triton's approximate division) were never
    compared on the GPU: only the codes were."""
    import torch
    from types import SimpleNamespace
    from labkit import gpu_sections
    logs = []
    run = SimpleNamespace(dtype="fp16", device="cpu", log=logs.append)
    codes = torch.randint(-127, 128, (2, 2, 8, 4), dtype=torch.int8)
    scales = torch.rand(2, 2, 8) + 0.1
    ref = (codes, codes.clone(), scales, scales.clone())
    assert gpu_sections._caches_agree(run, "rope_store int8", "int8", ref, ref, {"passed": True})["passed"]
    wrong = (codes, codes.clone(), scales * 1.01, scales.clone())
    assert not gpu_sections._caches_agree(run, "rope_store int8", "int8", wrong, ref, {"passed": True})["passed"]
    assert any("k scales" in line and "FAILED" in line for line in logs)
