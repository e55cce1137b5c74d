"""`cpu_memory`: a CPU process keeps the memory its tensors free, so a prefill's next tensors take
no page faults."""
import subprocess
import sys

import pytest

from labkit import cpu_memory

# lab-cpu's prefill at P = 1,024, three times after a warm-up; prints the minor page faults of the
# three. "default" leaves glibc's malloc as it is (the model would otherwise tune it on creation).
PREFILLS_PY = r"""
import resource, sys, torch
from labkit import cpu_memory, model
if sys.argv[1] == "default":
    model.cpu_memory.keep_freed_memory = lambda: "left as it is: the test's baseline"
m = model.Llama("lab-cpu", device="cpu", max_tokens=1024)
tokens = torch.randint(0, m.spec.vocab_size, (1, 1024))
m.prefill(tokens)
before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
for _ in range(3):
    m.prefill(tokens)
print(m.memory_setting, file=sys.stderr)
print(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
"""


def prefill_faults(mode: str) -> int:
    out = subprocess.run([sys.executable, "-c", PREFILLS_PY, mode], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    return int(out.stdout.strip().splitlines()[-1])


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's mallopt: Linux only")
def test_a_prefill_with_the_memory_kept_faults_few_pages_in():
    # 2-core EPYC VM: 3,000-9,000 faults a prefill by default, 0-800 with the memory kept.
    default, kept = prefill_faults("default"), prefill_faults("keep")
    assert kept * 4 < default, f"{kept} minor page faults in three prefills with freed memory kept, {default} without"


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's mallopt: Linux only")
def test_the_setting_is_made_once_and_says_what_it_did():
    setting = cpu_memory.keep_freed_memory()
    assert setting is cpu_memory.keep_freed_memory()
    assert setting.startswith("glibc ") and "32 MiB" in setting and "1 GiB" in setting, setting


def test_without_glibc_nothing_changes_and_it_says_why(monkeypatch):
    monkeypatch.setattr(cpu_memory.ctypes.util, "find_library", lambda name: None)
    monkeypatch.setattr(cpu_memory.ctypes, "CDLL", lambda name: (_ for _ in ()).throw(OSError("no libc")))
    assert cpu_memory.keep_freed_memory.__wrapped__().startswith("left as it is: no glibc malloc")


def test_a_model_on_the_cpu_keeps_freed_memory():
    from labkit.model import Llama
    model = Llama("lab-tiny", device="cpu", max_tokens=64)
    assert model.memory_setting == cpu_memory.keep_freed_memory()
