"""`cpu_memory`: a CPU process keeps the memory its tensors free, so a prefill's next tensors take
no page faults."""
import os
import subprocess
import sys

import pytest

from labkit import cpu_memory

# lab-cpu's prefill at P = 1,024, three times after a warm-up; prints the minor page faults of the
# three. "default" leaves glibc's malloc as the environment set it (the model would otherwise tune
# it on creation).
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


# Page faults are counted in 4 KiB pages: where transparent huge pages are "always" (Fedora's and
# RHEL's default), one fault maps 2 MiB of a big block and the counts below mean nothing (a 64 MiB
# block: 32 faults, not 16,384). Each process turns them off for itself first (prctl, Linux 3.15+).
NO_HUGE_PAGES = """
import ctypes
PR_SET_THP_DISABLE = 41
if ctypes.CDLL(None, use_errno=True).prctl(PR_SET_THP_DISABLE, 1, 0, 0, 0) != 0:
    raise SystemExit(f"prctl(PR_SET_THP_DISABLE) failed: errno {ctypes.get_errno()}")
"""


def run_python(code: str, mode: str, env: dict[str, str] | None = None) -> list[int]:
    """`code` in a fresh process with argv[1] = `mode`, `env` added to ours and transparent huge
    pages off: the numbers of its last line of output."""
    out = subprocess.run([sys.executable, "-c", NO_HUGE_PAGES + code, mode], capture_output=True, text=True, timeout=300,
                         env={**os.environ, **(env or {})})
    assert out.returncode == 0, out.stderr[-2000:]
    return [int(n) for n in out.stdout.strip().splitlines()[-1].split()]


# glibc maps a block over 128 KiB afresh until a freed mapped block raises that threshold, so how
# many pages a default process faults in depends on the order of its allocations: three prefills,
# 10,000-17,000 faults on the 2-core EPYC VM (Zen 5), 640 on a CI machine. Pinned at its starting
# 128 KiB (a tunable set this way stays put), every big block is mapped afresh: the baseline is the
# same everywhere, and the setting must override it.
NOTHING_KEPT = {"GLIBC_TUNABLES": "glibc.malloc.mmap_threshold=131072"}


def prefill_faults(mode: str) -> int:
    return run_python(PREFILLS_PY, mode, NOTHING_KEPT)[0]


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's mallopt: Linux only")
def test_a_prefill_with_the_memory_kept_faults_few_pages_in():
    # EPYC VM: ~150,000 faults in three prefills with nothing kept, 0-513 with the memory kept.
    nothing_kept, kept = prefill_faults("default"), prefill_faults("keep")
    assert nothing_kept > 20_000, f"the baseline faulted only {nothing_kept} pages: its tunable was not applied"
    assert kept * 20 < nothing_kept, f"{kept} minor page faults in three prefills with freed memory kept, {nothing_kept} with nothing kept"


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


# A 64 MiB block (past glibc's largest heap block, so always mapped afresh) made and dropped
# fourteen times, inside `reused_memory` or not, then once more after it; prints the minor page
# faults of the last two of the fourteen, of the one after, and the resident set (KiB) after it ended.
BIG_BLOCKS_PY = r"""
import contextlib, resource, sys, torch
from labkit import cpu_memory
faults = lambda: resource.getrusage(resource.RUSAGE_SELF).ru_minflt
rss = lambda: int(open("/proc/self/status").read().split("VmRSS:")[1].split()[0])
make = lambda: torch.ones(16 * 2**20).sum()  # 64 MiB of fp32, written and read, then freed
around = cpu_memory.reused_memory() if sys.argv[1] == "reused" else contextlib.nullcontext()
make()
with around:
    for _ in range(12):  # inside, the heap settles after up to 7 blocks (EPYC VM, 8 runs)
        make()
    before = faults()
    for _ in range(2):
        make()
    last = faults() - before
before = faults()
make()
print(last, faults() - before, rss())
"""


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's mallopt: Linux only")
def test_inside_reused_memory_a_block_past_32_mib_reuses_its_pages_and_after_it_they_are_handed_back():
    """16,384 pages a 64 MiB block. Made fresh, every block faults them all in; inside, once the
    heap has room for it (up to 7 blocks, as small tensors settle between them), none. After, big
    blocks are mapped afresh again and the freed heap is not kept: the resident set drops back."""
    plain, plain_after, plain_rss = run_python(BIG_BLOCKS_PY, "plain")
    reused, reused_after, reused_rss = run_python(BIG_BLOCKS_PY, "reused")
    assert plain > 2 * 15_000 and reused < 2_000, (plain, reused)
    assert reused_after > 15_000 and plain_after > 15_000, (reused_after, plain_after)
    assert reused_rss < plain_rss + 32 * 1024, (reused_rss, plain_rss)


def test_reused_memory_without_glibc_runs_what_it_wraps(monkeypatch):
    monkeypatch.setattr(cpu_memory.ctypes.util, "find_library", lambda name: None)
    monkeypatch.setattr(cpu_memory.ctypes, "CDLL", lambda name: (_ for _ in ()).throw(OSError("no libc")))
    ran = []
    with cpu_memory.reused_memory():
        ran.append(True)
    assert ran == [True]
