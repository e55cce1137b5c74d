"""The CPU/GPU choice, made once, with the reason for it; how the Triton kernels run; what
memory the device has free. Every module that asks "which device?" or "can the kernels run
here?" asks this one, so the answer cannot differ between the lessons, the CLI and the GPU check.

    backend = choose_device()          # CUDA if torch sees a GPU, else the CPU path
    backend = choose_device("cpu")     # or LABKIT_DEVICE=cpu: force a path (tests, comparisons)
    triton_mode()                      # "compiled" | "interpreter" | "none"
    triton_installed()                 # False on macOS and Windows: Triton publishes no wheels there
    kernels_run_on("cpu")              # how the kernels would run on that device's tensors, or None
    check_fits(footprint_bytes, backend.device, "decode at batch 64")   # before allocating

The CPU path computes in fp32, not bf16: on this lab's CPUs a bf16 matmul runs at about
1 GFLOP/s against about 110 for fp32 (no bf16 matrix units, so PyTorch falls back to a slow
kernel). The GPU path computes in bf16, the dtype the chapter's peaks are quoted for.

Triton kernels run compiled on a CUDA GPU, or in Triton's interpreter (slow; any tensor) when
TRITON_INTERPRET=1 was set before triton was imported; `import labkit` sets it on a machine
without an NVIDIA driver. kernels/ keeps its own copy of that check (kernels/_runtime.py): it
cannot import labkit.

Where Triton is not installed (macOS and Windows, which it publishes no wheels for) the CPU path
runs as everywhere else, since it never launches a Triton kernel; what needs Triton (the GPU
path, the kernels in the interpreter, the compile check) says `TRITON_MISSING` and is skipped.
"""
from __future__ import annotations

import ctypes
import importlib.util
import os
import platform
import re
import sys
from dataclasses import dataclass
from importlib import metadata
from pathlib import Path

import torch

from . import cgroups, cpu_info, cpu_memory
from .dtypes import COMPUTE_DTYPES, torch_dtype
from .errors import FootprintError, LabError
from .units import format_bytes, machine_name

DEVICES = ("cpu", "cuda")
ENV_VAR = "LABKIT_DEVICE"
# Fraction of free memory kept back by `check_fits`: the allocator's caching and fragmentation,
# the CUDA context and the notebook's own tensors all need room beyond the formula's footprint.
HEADROOM = 0.10
# ...and on the CPU this much more, for what a measurement allocates that no footprint counts. Why:
# choosing lab-cpu's decode path (numba's compiled kernels, loaded the first time in a process) made
# it 69 MiB more resident beyond the 108 MiB its model check counted; under a 2 GiB cgroup with
# 440 MiB free before lesson 05 loaded, the model passed its check and the OOM killer ended the
# kernel before the sweep's next check. Measured on the 2-core EPYC VM, 2026-12-06.
CPU_WORKING_BYTES = 96 * 2**20
INTERPRET_VAR = "TRITON_INTERPRET"  # "1": Triton kernels run in its interpreter; read when triton is imported
# What a skipped Triton part says where `import triton` fails, as on a Mac or a Windows laptop.
TRITON_MISSING = "Triton is not installed (no wheels for this platform)"
MIN_TRITON_MAJOR = 3


@dataclass(frozen=True)
class Backend:
    """Where the lab runs: `device` "cpu" | "cuda", why, and the dtype matmuls compute in."""

    device: str
    reason: str
    compute_dtype: str  # "bf16" on CUDA (fp16 on GPUs without bf16), "fp32" on the CPU

    @property
    def torch_dtype(self) -> torch.dtype:
        return torch_dtype(self.compute_dtype, COMPUTE_DTYPES)

    @property
    def name(self) -> str:
        """The machine's name for a chart title, as its legends say it (`units.machine_name`)."""
        return machine_name(device_name(self.device))


def choose_device(override: str | None = None) -> Backend:
    """CUDA when torch sees a GPU, else the CPU. `override` (or env LABKIT_DEVICE) forces
    "cpu" or "cuda"; asking for CUDA on a machine without one raises LabError."""
    requested, source = _requested(override)
    if requested == "cuda" and not torch.cuda.is_available():
        fix = (f"use cpu or unset {ENV_VAR}" if override is None
               else "use the CPU (device cpu, or leave the device unset)")
        raise LabError(f"{source} asks for CUDA, but torch {torch.__version__} sees no CUDA device "
                       f"(built for CUDA {torch.version.cuda or 'none'}); {fix}")
    if requested == "cpu":
        return Backend("cpu", f"{source}: using the CPU path (PyTorch)", "fp32")
    if not torch.cuda.is_available():
        return Backend("cpu", "no CUDA device: using the CPU path (PyTorch)", "fp32")
    name = torch.cuda.get_device_name(0)
    why = source if requested else "CUDA available"
    if _has_bf16_tensor_cores():
        return Backend("cuda", f"{why}: {name}", "bf16")
    # Pre-Ampere GPUs (T4, V100) have fp16 tensor cores but no bf16 ones.
    return Backend("cuda", f"{why}: {name} (no bf16 tensor cores: computing in fp16)", "fp16")


def synchronize(device) -> None:
    """Wait until `device` has finished the work issued to it: a CUDA synchronize, nothing on the
    CPU (where torch runs synchronously). Call it before reading a wall clock around GPU work."""
    if torch.device(getattr(device, "device", device)).type == "cuda":
        torch.cuda.synchronize()


def triton_installed() -> bool:
    """Whether `import triton` can succeed here, asked without importing it (the import is slow,
    and must come after the interpreter choice). False on macOS and Windows: no wheels."""
    try:
        return importlib.util.find_spec("triton") is not None
    except (ImportError, ValueError):  # a finder that refuses it; a stub in sys.modules without a spec
        return False


def triton_too_old(version: str | None = None) -> str | None:
    """Why the installed triton (or `version`) cannot run the lab's kernels, or None: they use
    triton 3's APIs (checked with 3.6 and 3.9); triton 2's autotuner fails on importing them with a
    KeyError, deep in its own code. Asked without importing triton; None if its version is unknown."""
    if version is None:
        try:
            version = metadata.version("triton")
        except metadata.PackageNotFoundError:
            return None
    major = re.match(r"(\d+)", version)
    if major and int(major.group(1)) < MIN_TRITON_MAJOR:
        return (f"triton {version} is too old for the lab's kernels: they need triton {MIN_TRITON_MAJOR} "
                "(checked with 3.6 and 3.9)")
    return None


def triton_mode() -> str:
    """How the lab's Triton kernels run in this process: "none" where triton is not installed;
    "interpreter" when TRITON_INTERPRET=1 (Triton's interpreter, on any tensor, slowly), else
    "compiled" when torch sees a CUDA GPU, else "none" (no GPU and the interpreter not chosen)."""
    if not triton_installed():
        return "none"
    if os.environ.get(INTERPRET_VAR) == "1":
        return "interpreter"
    return "compiled" if torch.cuda.is_available() else "none"


def kernels_run_on(device) -> str | None:
    """How the kernels run on tensors of `device` ("cpu" | "cuda" | a torch.device | a Backend):
    "compiled", "interpreter", or None where they cannot (CPU tensors without the interpreter)."""
    kind, _ = _kind_and_index(device)
    mode = triton_mode()
    if mode == "interpreter":
        return mode
    return "compiled" if mode == "compiled" and kind == "cuda" else None


def kernel_device() -> str | None:
    """The device to check and time the kernels on: "cuda" when they run compiled, "cpu" in the
    interpreter (whose copies to and from a GPU would only add time), None when they cannot run."""
    return {"compiled": "cuda", "interpreter": "cpu"}.get(triton_mode())


def use_interpreter() -> None:
    """Choose Triton's interpreter for this process (a CPU dry run). LabError if triton is
    already imported: it read TRITON_INTERPRET then, so setting it now would change nothing."""
    if sys.modules.get("triton") is not None:  # imported (None there is Python's way to block an import)
        if os.environ.get(INTERPRET_VAR) == "1":
            return
        raise LabError(f"set {INTERPRET_VAR}=1 before triton is imported")
    if not triton_installed():
        raise LabError(f"Triton's interpreter cannot run: {TRITON_MISSING}")
    os.environ[INTERPRET_VAR] = "1"


def _has_bf16_tensor_cores() -> bool:
    try:  # without emulation: a T4 "supports" bf16 only by emulating it, slowly
        return torch.cuda.is_bf16_supported(including_emulation=False)
    except TypeError:  # torch before 2.4 has no such argument and does not count emulation
        return torch.cuda.is_bf16_supported()


def _requested(override: str | None) -> tuple[str | None, str]:
    """The forced device (None: automatic) and who forced it, e.g. "LABKIT_DEVICE=cpu"."""
    from_env = override is None
    value = (os.environ.get(ENV_VAR, "") if from_env else str(override)).strip().lower()
    source = f"{ENV_VAR}={value}" if from_env else f"device={value!r}"
    if value in ("", "auto"):
        return None, source
    if value not in DEVICES:
        raise LabError(f"unknown device {value!r} (from {source}); known: {', '.join(DEVICES)} or auto")
    return value, source


def _kind_and_index(device) -> tuple[str, int]:
    """"cuda:1" -> ("cuda", 1); accepts a str, a torch.device or a Backend."""
    device = torch.device(getattr(device, "device", device))
    if device.type not in DEVICES:
        raise LabError(f"unknown device {str(device)!r}; known: {', '.join(DEVICES)}")
    return device.type, device.index or 0


def device_name(device) -> str:
    """The CPU model (from /proc/cpuinfo) or the GPU's name, for reports and provenance."""
    kind, index = _kind_and_index(device)
    if kind == "cuda":
        return torch.cuda.get_device_name(index)
    for line in _read_lines("/proc/cpuinfo"):
        if line.startswith("model name"):
            return line.split(":", 1)[1].strip()
    # macOS has no /proc, and its platform.processor() says only "arm": the brand string, "Apple M2".
    brand = cpu_info.run_command(["sysctl", "-n", "machdep.cpu.brand_string"]) if platform.system() == "Darwin" else None
    return brand or platform.processor() or platform.machine() or "unknown CPU"


def free_memory_bytes(device) -> int:
    """Memory free for new tensors: CUDA's free count, or MemAvailable on the CPU, capped by the
    room left under every cgroup memory limit on this process (`cgroups.memory_limits`: a
    container's, a hub's per-learner one), since /proc/meminfo shows the whole host. A learner
    limited to 4 GB on a server with 200 GB free is refused a 6 GB cache in one line, not killed."""
    kind, index = _kind_and_index(device)
    if kind == "cuda":
        return int(torch.cuda.mem_get_info(index)[0])
    available = _meminfo_bytes("MemAvailable")
    for limit, used in cgroups.memory_limits():  # the container's or a hub's limit on this learner
        if used is not None:
            available = min(available, max(limit - used, 0))
    return available


def total_memory_bytes(device) -> int:
    """The device's whole memory: the GPU's capacity, or MemTotal (capped by the tightest cgroup limit)."""
    kind, index = _kind_and_index(device)
    if kind == "cuda":
        return int(torch.cuda.get_device_properties(index).total_memory)
    return min([_meminfo_bytes("MemTotal"), *(limit for limit, _ in cgroups.memory_limits())])


def check_fits(required_bytes: float, device, what: str, remedy: str = "lower batch or context") -> int:
    """Raise FootprintError unless `required_bytes` fit in the device's free memory less its
    headroom (`room_bytes`). Call it before allocating: an out-of-memory error mid-run can leave a
    notebook's GPU unusable until restart, and a CPU kernel killed. Returns the free bytes it
    compared against. `remedy`: what the user can lower (a model's weights: a smaller model)."""
    kind, _ = _kind_and_index(device)
    free = free_memory_bytes(device)
    if required_bytes > room_bytes(free, kind) and kind == "cpu" and cpu_memory.hand_back():
        # The memory this process freed and malloc keeps for its own reuse (`cpu_memory`) counts as
        # in use to the OS and a cgroup: hand it back before refusing. Lesson 07 under a 1 GiB limit
        # (QUICK, 2-core EPYC VM): its serving left 236 MiB kept; handed back, RSS 908 -> 667 MB.
        free = free_memory_bytes(device)
    if required_bytes > room_bytes(free, kind):
        limit = _binding_limit(free) if kind == "cpu" else None
        # past the whole limit, stopping other kernels frees nothing that would help
        if limit is not None and required_bytes > room_bytes(limit[0], kind):
            remedy = f"that is more than this server's {format_bytes(limit[0])} memory limit allows; {remedy}"
        elif limit is not None:
            remedy = (f"{format_bytes(limit[1])} of this server's {format_bytes(limit[0])} memory limit is in use, by "
                      "this kernel and any other still running: shut down the kernels of the lessons you have "
                      f"finished (Kernel > Shut Down Kernel, or close their tabs), or {remedy}")
        kept = f"{HEADROOM:.0%} and {format_bytes(CPU_WORKING_BYTES)}" if kind == "cpu" else f"{HEADROOM:.0%}"
        raise FootprintError(f"{what} needs {format_bytes(required_bytes)} but {kind} has {format_bytes(free)} free "
                             f"(keeping {kept} of headroom); {remedy}")
    return free


def room_bytes(free: float, kind: str) -> float:
    """What `check_fits` lets a run allocate out of `free` bytes on a device of `kind` ("cpu",
    "cuda"): HEADROOM of it kept back, and CPU_WORKING_BYTES more on the CPU."""
    return free * (1 - HEADROOM) - (CPU_WORKING_BYTES if kind == "cpu" else 0)


def _binding_limit(free: int) -> tuple[int, int] | None:
    """(limit, in use) of the cgroup memory limit that leaves only `free` bytes (`free_memory_bytes`),
    or None where the machine's own free memory is the tighter: under a hub's per-learner limit,
    the memory in use is most often other kernels of the same learner, which the learner can stop."""
    for limit, used in cgroups.memory_limits():
        if used is not None and max(limit - used, 0) == free:
            return limit, used
    return None


def _meminfo_bytes(field: str) -> int:
    """"MemAvailable" or "MemTotal" in bytes: Linux's /proc/meminfo, else what the OS reports
    (`_os_memory_bytes`); LabError, one line, where nothing does."""
    for line in _read_lines("/proc/meminfo"):
        if line.startswith(field + ":"):
            return int(line.split()[1]) * 1024  # /proc/meminfo says "kB" and means KiB
    found = _os_memory_bytes(platform.system()).get(field)
    if not found:
        what = "free" if field == "MemAvailable" else "total"
        raise LabError(f"cannot tell this machine's {what} memory: {platform.system() or 'this OS'} reports it "
                       "neither in /proc/meminfo nor where the lab asks (sysctl and vm_stat, GlobalMemoryStatusEx, sysconf)")
    return found


def _os_memory_bytes(system: str) -> dict[str, int]:
    """{"MemTotal": bytes, "MemAvailable": bytes} as far as the OS says, without /proc:
    macOS: hw.memsize, and vm_stat's free + inactive + speculative pages (what it can hand out
    without swapping; its sysconf has no SC_AVPHYS_PAGES); Windows: GlobalMemoryStatusEx (no
    os.sysconf at all); other Unixes: sysconf's physical pages."""
    if system == "Darwin":
        return _darwin_memory_bytes(cpu_info.run_command(["sysctl", "-n", "hw.memsize"]),
                                    cpu_info.run_command(["vm_stat"]))
    if system == "Windows":
        return _windows_memory_bytes()
    found = {}
    for field, pages in (("MemTotal", "SC_PHYS_PAGES"), ("MemAvailable", "SC_AVPHYS_PAGES")):
        try:
            found[field] = os.sysconf(pages) * os.sysconf("SC_PAGE_SIZE")
        except (ValueError, OSError, AttributeError):  # a name this OS lacks
            pass
    return found


def _darwin_memory_bytes(memsize: str | None, vm_stat: str | None) -> dict[str, int]:
    """macOS's `sysctl -n hw.memsize` and `vm_stat` ("(page size of 16384 bytes)", "Pages free:
    12345.", ...) as bytes."""
    found = {"MemTotal": int(memsize)} if memsize and memsize.isdigit() else {}
    page = re.search(r"page size of (\d+) bytes", vm_stat or "")
    counts = dict(re.findall(r"^Pages (free|inactive|speculative):\s+(\d+)\.", vm_stat or "", re.M))
    if page and "free" in counts:
        found["MemAvailable"] = int(page.group(1)) * sum(int(n) for n in counts.values())
    return found


class _MemoryStatusEx(ctypes.Structure):
    """Windows' MEMORYSTATUSEX (64 bytes), which GlobalMemoryStatusEx fills."""

    _fields_ = [("dwLength", ctypes.c_uint32), ("dwMemoryLoad", ctypes.c_uint32),
                ("ullTotalPhys", ctypes.c_uint64), ("ullAvailPhys", ctypes.c_uint64),
                ("ullTotalPageFile", ctypes.c_uint64), ("ullAvailPageFile", ctypes.c_uint64),
                ("ullTotalVirtual", ctypes.c_uint64), ("ullAvailVirtual", ctypes.c_uint64),
                ("ullAvailExtendedVirtual", ctypes.c_uint64)]


def _windows_memory_bytes() -> dict[str, int]:
    status = _MemoryStatusEx()
    status.dwLength = ctypes.sizeof(status)
    try:
        if not ctypes.windll.kernel32.GlobalMemoryStatusEx(ctypes.byref(status)):
            return {}
    except (AttributeError, OSError):  # not Windows after all
        return {}
    return {"MemTotal": int(status.ullTotalPhys), "MemAvailable": int(status.ullAvailPhys)}


def _read_lines(path: str) -> list[str]:
    try:
        return Path(path).read_text().splitlines()
    except OSError:
        return []
