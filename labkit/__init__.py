"""labkit: the prefill/decode lab's library — specs, roofline formulas, calibration,
measurement, a Llama-shaped model, sweeps and views. The core imports without Jupyter
packages (a GPU image has only torch, triton and numpy); `labkit.views` needs plotly/ipywidgets."""
import os
import shutil

# CPU timing: torch's OpenMP threads spin after each op by default, and fight numpy's BLAS threads
# (the CPU path's decode matmuls) for the same cores: decode steps ran 1.5x slower here. It must be
# set before torch loads OpenMP, so it is set on import of labkit, which the lessons import first.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
# ...but not asleep at once: a decode step hands ~20 small products and attentions to numba's
# OpenMP threads (libgomp, a second copy beside torch's), and waking a sleeping thread took ~50 us
# in the lab's 2-core VMs, more than a layer's product. GOMP_SPINCOUNT overrides the policy's spin
# count in both copies: 10,000 spins (~0.1 ms) kept a step's hand-offs warm. Measured on a 2-core
# EPYC VM, `measure decode --batch 1`: 4.0-4.2 ms asleep at once, 2.3-2.4 ms at 10,000 spins;
# prefill (P = 1,024) unchanged at 76-84 ms; 100,000 spins and more slowed prefill to 96-116 ms.
# The spins hold only while a libgomp copy runs no more threads than the machine has cores: past
# that it spins a "throttled" count, which PASSIVE sets to 0. A second Python thread that calls a
# numba parallel kernel gets a thread team of its own, more threads than cores, and from then on
# every hand-off sleeps, in every thread of that copy while the team lives: lab-cpu's decode step
# at B = 4 took 2.1-2.4 ms on a second thread against 1.0-1.6 ms on the main one, in the same runs
# (2-core EPYC VM; with ACTIVE, whose throttled count is 1,000, 1.3-1.5 ms on both).
# So the lab times every step on one thread (`views.base.LessonWidget` sends a slider's work to
# the main thread), and keeps PASSIVE: other OpenMP runtimes (LLVM's on macOS, Intel's on
# Windows) ignore GOMP_SPINCOUNT and would spin for good under ACTIVE.
os.environ.setdefault("GOMP_SPINCOUNT", "10000")
# The other way round: after each product numpy's OpenBLAS threads spin for up to 2^28 cycles
# (~0.1 s) waiting for more, and keep the cores from torch's threads (prefill's SDPA and norms run
# next); waiting 2^4 cycles gives the cores back at once. Read when numpy loads.
os.environ.setdefault("OPENBLAS_THREAD_TIMEOUT", "4")

# A process allowed fewer cores than the machine lists (a `taskset`, a container's cpuset or CPU
# quota, a hub's per-learner limit: `cpu_info.usable_cores`) gets thread pools of that size, where
# torch's, numba's and OpenBLAS's would each start one thread per listed CPU. Read when each loads.
from .cpu_info import usable_cores as _usable_cores  # noqa: E402 (stdlib only: nothing loads before the variables)

_cores = _usable_cores()
if _cores < (os.cpu_count() or 1):
    for _name in ("OMP_NUM_THREADS", "NUMBA_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS"):
        os.environ.setdefault(_name, str(_cores))

# Without an NVIDIA GPU, Triton kernels can only run in Triton's interpreter, which must be chosen
# before triton is imported (the FlashAttention lesson runs the lab's kernel on small inputs). This
# is the one place that choice is made; `backend.triton_mode` reports it, and the tests import labkit
# first to get the same choice. Where Triton is not installed (macOS and Windows have no wheels) the
# variable is set but never read: the CPU path imports no triton, and `backend.triton_installed` says so.
# An NVIDIA driver shows itself by its device node or /proc entry and its library even where a
# container carries no nvidia-smi (NVIDIA_DRIVER_CAPABILITIES=compute): by nvidia-smi alone, such a
# GPU machine ran every kernel in the interpreter, slowly and with wrong bf16. The library is only
# loaded, never initialised (cuInit here would make every forked child's CUDA unusable).
_NVIDIA_DRIVER = ("/dev/nvidiactl", "/proc/driver/nvidia/version")


def _nvidia_driver() -> bool:
    if shutil.which("nvidia-smi") is not None:
        return True
    if not any(os.path.exists(p) for p in _NVIDIA_DRIVER):
        return False
    import ctypes  # only where a driver's node is there: loading libcuda is the last sign
    try:
        ctypes.CDLL("libcuda.so.1")
    except OSError:  # a device node without the driver's library: no CUDA here
        return False
    return True


def _torch_sees_no_gpu() -> bool:
    """Whether torch cannot use a GPU that is there, told without importing torch (which loads
    after this choice, and after `import_room`'s check): a CPU-only build ("2.13.0+cpu", what
    `make venv` installs where nvidia-smi is missing), or CUDA_VISIBLE_DEVICES set empty or to -1.
    There the kernels can run only in the interpreter, as on a machine with no driver at all."""
    import importlib.metadata  # stdlib; only the installed version string is read
    try:
        if "+cpu" in importlib.metadata.version("torch"):
            return True
    except importlib.metadata.PackageNotFoundError:
        pass
    return os.environ.get("CUDA_VISIBLE_DEVICES", None) in ("", "-1")


if not _nvidia_driver() or _torch_sees_no_gpu():
    os.environ.setdefault("TRITON_INTERPRET", "1")

# Under a memory limit with no room to load torch, the kernel's OOM killer would end this kernel or
# another lesson's while torch loads: the first `import torch` refuses in one line first
# (`import_room`). Once torch is loaded (imported before labkit) there is nothing left to refuse.
from .import_room import check_before_torch_loads as _check_before_torch_loads  # noqa: E402 (stdlib only)

_check_before_torch_loads()
