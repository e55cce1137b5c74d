"""scripts/gpu_tune.py, the GPU tuner whose recording the kernels' tile tables cite: its products
are the decode step's matmul weights, and its dry run (the interpreter, toy sizes) still runs
through every part and writes one recording that names the best tiles."""
import json
import subprocess
import sys
from pathlib import Path

import pytest

from labkit import roofline
from labkit.specs import get_model

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "scripts"))
import gpu_tune  # noqa: E402 - from scripts/, after the path


@pytest.mark.parametrize("model", ["llama-3.1-8b", "lab-cpu", "lab-tiny"])
def test_products_are_every_weight_a_decode_step_multiplies_by(model):
    spec = get_model(model)
    assert sum(N * K * count for N, K, count in gpu_tune.products(spec).values()) == roofline.param_count(spec, "matmul")


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
    assert len(record["step"]["before"]) == len(record["step"]["after"]) == len(gpu_tune.DRY_STEP_POINTS)
