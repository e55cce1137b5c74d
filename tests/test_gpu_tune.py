"""scripts/gpu_tune.py, the GPU tuner whose recording the kernels' tile tables cite: its dry run
(the interpreter, toy sizes) still runs through every part and writes one recording that names
the best tiles, and the kernels' tables are that recording's winners."""
import importlib
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "scripts"))
import gpu_tune  # noqa: E402 - from scripts/, after the path


@pytest.mark.triton
@pytest.mark.slow
def test_dry_run_writes_a_recording_with_the_best_tiles(tmp_path):
    done = subprocess.run([sys.executable, str(ROOT / "scripts" / "gpu_tune.py"), "--out", str(tmp_path), "--dry-run",
                           "--budget-s", "60"], capture_output=True, text=True, timeout=600, cwd=ROOT)
    assert done.returncode == 0, done.stderr[-2000:]
    (path,) = tmp_path.glob("gpu-tune-cpu-*.json")
    record = json.loads(path.read_text())
    assert record["provenance"]["command"].startswith("python3 scripts/gpu_tune.py")
    assert record["matmul"]["best"]["per_sm"] in gpu_tune.MATMUL_PER_SM
    assert all(e["correct"] for e in record["matmul"]["timings"])
    assert set(record["attention"]["best"]) == {"fp16", "int8"}
    assert all(e["correct"] for e in record["attention"]["timings"])
    # a 1-byte cache's tiles are timed with V scaled in them too (SCALE_V), right after the default
    int8 = [e for e in record["attention"]["timings"] if e["cache_dtype"] == "int8"]
    tiles = list(dict.fromkeys(tuple(e["tile"]) for e in int8))  # in the order timed
    assert len(tiles[0]) == 3 and tiles[1] == (*tiles[0], True)
    assert len(record["step"]["before"]) == len(record["step"]["after"]) == len(gpu_tune.DRY_STEP_POINTS)
    assert len(record["step"]["unfused"]) == len(gpu_tune.DRY_STEP_POINTS[:gpu_tune.UNFUSED_POINTS])


def test_the_unfused_step_runs_torchs_ops_then_the_kernels_again():
    from labkit.ops import TorchOps, TritonOps
    fused = TritonOps.__dict__["add_rms_norm"], TritonOps.__dict__["rope_and_store"]
    with pytest.raises(RuntimeError, match="inside"):
        with gpu_tune.torch_elementwise_ops():
            assert TritonOps.add_rms_norm is TorchOps.add_rms_norm
            assert TritonOps.rope_and_store is TorchOps.rope_and_store
            raise RuntimeError("inside")  # a failed measurement restores them too
    assert (TritonOps.__dict__["add_rms_norm"], TritonOps.__dict__["rope_and_store"]) == fused


def test_parts_outside_its_own_are_refused_in_one_line(tmp_path, capsys):
    assert gpu_tune.main(["--out", str(tmp_path), "--dry-run", "--parts", "matmul,flash"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("gpu_tune: error: --parts") and "matmul, attention, step, prefill" in err and "\n" not in err
    assert not list(tmp_path.iterdir())


@pytest.mark.triton  # the dry run runs in Triton's interpreter
def test_a_run_stopped_by_its_timeout_still_writes_what_it_measured(tmp_path, monkeypatch):
    """gpu_session.sh's `timeout` sends SIGTERM: the part running ends with an error, no later part
    starts, and the recording (the only file a lent GPU's run brings back) is still written."""
    def stopped_midway(run, deadline, result):
        os.kill(os.getpid(), signal.SIGTERM)  # as `timeout` would, while the part runs
        time.sleep(5)
        raise AssertionError("SIGTERM did not stop the part")

    monkeypatch.setattr(gpu_tune, "STOPPED", [])
    monkeypatch.setattr(gpu_tune, "time_steps", stopped_midway)
    before = signal.getsignal(signal.SIGTERM)
    assert gpu_tune.main(["--out", str(tmp_path), "--dry-run", "--parts", "step,prefill"]) == 0
    assert signal.getsignal(signal.SIGTERM) is before  # the tuner's handler lives as long as its run
    (path,) = tmp_path.glob("gpu-tune-cpu-*.json")
    record = json.loads(path.read_text())
    assert record["step"] == {"error": "Stopped: stopped by SIGTERM (its step's timeout) while running"}
    assert record["prefill"] == {"error": "not started: stopped (SIGTERM)"}


@pytest.mark.triton  # the dry run runs in Triton's interpreter
def test_the_prefill_part_times_each_prompt_eagerly_and_replayed(tmp_path):
    """In the dry run, on the CPU: the host's time to issue it, its time, where the host's time went."""
    assert gpu_tune.main(["--out", str(tmp_path), "--dry-run", "--parts", "prefill", "--budget-s", "30"]) == 0
    (path,) = tmp_path.glob("gpu-tune-cpu-*.json")
    (point,) = json.loads(path.read_text())["prefill"]["points"]
    assert point["prompt_tokens"] == gpu_tune.DRY_PREFILL_PROMPTS[0] and 0 < point["eager_host_s"] and 0 < point["eager_time_s"]
    assert 0 < len(point["host_profile"]) <= gpu_tune.HOST_PROFILE_ROWS and point["replayed_time_s"] > 0
    assert point["prefill_reason"] == "eager prefill: no CUDA graph (not on CUDA)"


RECORDING = ROOT / "data" / "recordings" / "gpu-tune-h200-20261204-1541.json"  # attention's tiles
MATMUL_RECORDING = ROOT / "data" / "recordings" / "gpu-tune-h200-20261204-1742.json"  # split-K's, since EVEN_K


@pytest.mark.triton
def test_the_kernels_decode_tiles_are_the_recorded_winners_on_hopper():
    """The tile tables cite the H200 tuning recording: on Hopper the wrappers pick its winners
    for the 8B's shapes (D = 128, bf16 q); Ampere and D = 256 keep the tiles that do not spill there."""
    da = importlib.import_module("kernels.decode_attention")  # may be the function
    mm = importlib.import_module("kernels.matmul")  # kernels.matmul may be the function
    record, matmul = (json.loads(path.read_text()) for path in (RECORDING, MATMUL_RECORDING))
    assert record["provenance"]["device_name"] == matmul["provenance"]["device_name"] == "NVIDIA H200"
    plan = mm.split_k_plan(1, 4096, 4096, 2, 132, interpreted=False, capability=(9, 0))
    chosen = ([plan[k] for k in ("BLOCK_N", "BLOCK_K", "num_stages", "num_warps")], mm.SPLIT_K_PROGRAMS_PER_SM)
    assert plan["programs"] >= chosen[1] * 132
    # Within 1 % of the fastest at M = 1 and 16 (the step's total of products), and the fastest
    # at M = 64 of the candidates timed there.
    ranked = {(tuple(e["tile"]), e["per_sm"]): e["relative_to_default"] for e in matmul["matmul"]["step_total_s"]}
    key = (tuple(chosen[0]), chosen[1])
    assert ranked[key] <= 1.01 * min(ranked.values()), (key, min(ranked.values()))
    at_64 = {(tuple(e["tile"]), e["per_sm"]): e["total_s"] for e in matmul["matmul"]["M64_total_s"]}
    assert min(at_64, key=at_64.get) == key
    ampere = mm.split_k_plan(1, 4096, 4096, 2, 108, interpreted=False, capability=(8, 0))
    assert (ampere["BLOCK_N"], ampere["BLOCK_K"]) == mm.SPLIT_K_TILE_AMPERE[:2]
    for cache_dtype, chosen in record["attention"]["best"].items():
        c = da.split_constexprs("bf16", cache_dtype, 128, 4, 232448, capability=(9, 0))
        assert [c["constexprs"]["BLOCK_N"], c["num_stages"], c["num_warps"]] == chosen["tile"], cache_dtype
        assert da.split_programs_per_sm(cache_dtype, "cuda") == chosen["per_sm"], cache_dtype
    for cache_dtype in ("int8", "fp8"):
        assert da.split_constexprs("bf16", cache_dtype, 256, 4, 232448, capability=(9, 0))["num_warps"] == 8
        # timed under a bf16 q: an fp16 q keeps the untuned tiles (the int8 one spills under triton 3.6)
        assert da.split_constexprs("fp16", cache_dtype, 128, 4, 232448, capability=(9, 0))["num_warps"] == 8
        assert da.split_constexprs("bf16", cache_dtype, 128, 4, 166912, capability=(8, 0))["num_warps"] == 8


def test_the_gpu_session_script_parses_and_asks_for_the_commit(tmp_path):
    """scripts/gpu_session.sh, what a lent GPU runs in one call: valid bash, and without the commit
    (the machine's .git is stale) it stops in one line before running anything."""
    script = ROOT / "scripts" / "gpu_session.sh"
    assert subprocess.run(["bash", "-n", str(script)], capture_output=True).returncode == 0
    env = {k: v for k, v in os.environ.items() if k != "LABKIT_GIT_COMMIT"}
    done = subprocess.run(["bash", str(script), str(tmp_path / "out")], capture_output=True, text=True, env=env)
    assert done.returncode != 0 and "set LABKIT_GIT_COMMIT" in done.stderr and done.stderr.count("\n") == 1
    assert not (tmp_path / "out").exists()


@pytest.mark.triton  # the dry run runs in Triton's interpreter; the session imports triton
def test_the_gpu_session_stops_at_once_where_torch_sees_no_gpu(tmp_path):
    """Where the lent machine's torch sees no CUDA GPU, the session says so in one line and stops,
    instead of spending the loan on steps that each refuse; its log names the versions."""
    import torch
    if torch.cuda.is_available():
        pytest.skip("torch sees a GPU here: the session would run")
    script = ROOT / "scripts" / "gpu_session.sh"
    env = {**os.environ, "LABKIT_GIT_COMMIT": "0" * 40, "PYTHON": sys.executable}
    env.pop("DRY", None)
    done = subprocess.run(["bash", str(script), str(tmp_path)], capture_output=True, text=True, env=env, timeout=120)
    assert done.returncode == 3 and done.stdout.rstrip().endswith(
        "[gpu_session] stopped: torch sees no CUDA GPU here, or torch or triton did not load (above; DRY=1 "
        "checks the script without a GPU)")
    (log,) = tmp_path.glob("session-*.log")
    assert "torch" in log.read_text() and "CUDA GPU: False" in log.read_text()


@pytest.mark.triton  # the dry run runs in Triton's interpreter; the session imports triton
def test_a_step_point_that_does_not_fit_is_skipped_and_the_rest_kept(tmp_path, monkeypatch):
    """On an H100, B = 64 at 8,192 tokens (79 GiB with the weights) is refused before allocating:
    the refusal ended the whole step part, and its B = 1 and B = 16 timings were lost with it. A
    later error in the part keeps what was measured before it, too."""
    from labkit import sweeps
    from labkit.errors import FootprintError
    calls = []

    def measure_decode(model, B, S, cache_dtype, device=None):
        calls.append(B)
        if B == 64:
            raise FootprintError("64 x 8,192 tokens needs 79.0 GiB; refused before allocating")
        if len(calls) > 3:  # the unfused pass: fails
            raise RuntimeError("a kernel failed")
        return {"batch": B, "context_tokens": S, "cache_dtype": cache_dtype, "time_s": 1e-3, "roof_fraction": 0.5,
                "kernels": "triton"}
    monkeypatch.setattr(sweeps, "measure_decode", measure_decode)
    monkeypatch.setattr(gpu_tune, "DRY_STEP_POINTS", ((1, 64, "fp16"), (64, 64, "fp16"), (16, 64, "fp16")))
    assert gpu_tune.main(["--out", str(tmp_path), "--dry-run", "--parts", "step"]) == 0
    (path,) = tmp_path.glob("gpu-tune-cpu-*.json")
    step = json.loads(path.read_text())["step"]
    assert [p["batch"] for p in step["before"]] == [1, 16]
    assert step["skipped"][0][:4] == ["before", 64, 64, "fp16"] and "refused before allocating" in step["skipped"][0][4]
    assert step["error"] == "RuntimeError: a kernel failed"


@pytest.mark.triton  # the dry run runs in Triton's interpreter; the session imports triton
def test_a_stop_cannot_be_swallowed_by_a_catch_all(tmp_path, monkeypatch):
    """A CUDA graph's capture falls back to eager on any Exception: a SIGTERM arriving during one
    was swallowed there, and the run carried on past its step's timeout."""
    def catch_all(run, deadline, result):
        try:
            os.kill(os.getpid(), signal.SIGTERM)
            time.sleep(5)
        except Exception:  # noqa: BLE001 - as cuda_graphs.capture does
            return {"swallowed": True}
        raise AssertionError("SIGTERM did not stop the part")

    monkeypatch.setattr(gpu_tune, "STOPPED", [])
    monkeypatch.setattr(gpu_tune, "time_steps", catch_all)
    assert gpu_tune.main(["--out", str(tmp_path), "--dry-run", "--parts", "step"]) == 0
    (path,) = tmp_path.glob("gpu-tune-cpu-*.json")
    assert json.loads(path.read_text())["step"] == {"error": "Stopped: stopped by SIGTERM (its step's timeout) while running"}


@pytest.mark.triton  # the dry run runs in Triton's interpreter
def test_a_stop_while_the_recording_is_written_is_ignored(tmp_path, monkeypatch):
    """A SIGTERM after the parts have ended (the budget spent close to the step's timeout) raised
    out of main() as the recording was written: nothing came back."""
    from labkit import recordings
    real = recordings.write_recording

    def stopped_while_writing(*args, **kwargs):
        os.kill(os.getpid(), signal.SIGTERM)
        return real(*args, **kwargs)
    monkeypatch.setattr(recordings, "write_recording", stopped_while_writing)
    monkeypatch.setattr(gpu_tune, "time_steps", lambda run, deadline, result: {"done": True})
    assert gpu_tune.main(["--out", str(tmp_path), "--dry-run", "--parts", "step"]) == 0
    (path,) = tmp_path.glob("gpu-tune-cpu-*.json")
    assert json.loads(path.read_text())["step"] == {"done": True}
