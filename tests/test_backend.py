"""labkit.backend: the device choice and its reason, overrides, free memory, refusing oversized runs."""
import ctypes
import dataclasses

import pytest
import torch

from labkit import backend
from labkit.errors import FootprintError, LabError

GIB = 2**30


@pytest.fixture(autouse=True)
def clean_env(monkeypatch, tmp_path):
    monkeypatch.delenv("LABKIT_DEVICE", raising=False)
    monkeypatch.setenv("LABKIT_CACHE_DIR", str(tmp_path / "cache"))


@pytest.fixture
def fake_gpu(monkeypatch):
    """torch reports an H200, so the CUDA branch can be tested on a CPU machine."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda index=0: "NVIDIA H200")
    monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda including_emulation=True: True)


@pytest.fixture
def no_gpu(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)


def test_without_cuda_the_cpu_path_computes_in_fp32(no_gpu):
    chosen = backend.choose_device()
    assert chosen == backend.Backend("cpu", "no CUDA device: using the CPU path (PyTorch)", "fp32")
    assert chosen.torch_dtype is torch.float32


def test_with_cuda_the_gpu_path_computes_in_bf16(fake_gpu):
    chosen = backend.choose_device()
    assert chosen == backend.Backend("cuda", "CUDA available: NVIDIA H200", "bf16")
    assert chosen.torch_dtype is torch.bfloat16


def test_a_gpu_without_bf16_computes_in_fp16(fake_gpu, monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda including_emulation=True: False)
    chosen = backend.choose_device()
    assert chosen.compute_dtype == "fp16" and "fp16" in chosen.reason


def test_the_argument_forces_the_cpu_even_with_a_gpu(fake_gpu):
    chosen = backend.choose_device("cpu")
    assert chosen.device == "cpu" and chosen.compute_dtype == "fp32"
    assert chosen.reason == "device='cpu': using the CPU path (PyTorch)"


def test_the_environment_forces_a_device(fake_gpu, monkeypatch):
    monkeypatch.setenv("LABKIT_DEVICE", "CPU ")
    assert backend.choose_device().reason == "LABKIT_DEVICE=cpu: using the CPU path (PyTorch)"
    monkeypatch.setenv("LABKIT_DEVICE", "cuda")
    assert backend.choose_device() == backend.Backend("cuda", "LABKIT_DEVICE=cuda: NVIDIA H200", "bf16")


def test_the_argument_wins_over_the_environment(fake_gpu, monkeypatch):
    monkeypatch.setenv("LABKIT_DEVICE", "cuda")
    assert backend.choose_device("cpu").device == "cpu"


@pytest.mark.parametrize("how", ["argument", "environment"])
def test_asking_for_cuda_without_one_is_a_clear_error(no_gpu, monkeypatch, how):
    if how == "environment":
        monkeypatch.setenv("LABKIT_DEVICE", "cuda")
    # the remedy names what asked: the variable, or the argument (a CLI's --device said to unset the variable)
    fix = "unset LABKIT_DEVICE" if how == "environment" else r"use the CPU \(device cpu, or leave the device unset\)"
    with pytest.raises(LabError, match=rf"asks for CUDA, but torch .* sees no CUDA device.*{fix}"):
        backend.choose_device("cuda" if how == "argument" else None)


def test_an_unknown_device_is_refused():
    with pytest.raises(LabError, match=r"unknown device 'tpu'.*known: cpu, cuda"):
        backend.choose_device("tpu")


def test_auto_means_no_override(no_gpu, monkeypatch):
    monkeypatch.setenv("LABKIT_DEVICE", "auto")
    assert backend.choose_device().reason.startswith("no CUDA device")


def test_the_choice_is_frozen():
    with pytest.raises(dataclasses.FrozenInstanceError):
        backend.choose_device("cpu").device = "cuda"


def test_cpu_name_comes_from_cpuinfo(monkeypatch):
    monkeypatch.setattr(backend, "_read_lines", lambda path: ["processor : 0", "model name\t: AMD EPYC 9654"]
                        if path == "/proc/cpuinfo" else [])
    assert backend.device_name("cpu") == "AMD EPYC 9654"


@pytest.mark.parametrize("name, short", [
    ("Intel(R) Xeon(R) Platinum 8481C CPU @ 2.70GHz", "Intel Xeon Platinum 8481C"),
    ("AMD EPYC 9R14 96-Core Processor", "AMD EPYC 9R14 96-Core"),
    ("AMD EPYC", "AMD EPYC"), ("NVIDIA H200", "NVIDIA H200"), ("Apple M2", "Apple M2"), ("(R)", "unknown CPU")])
def test_a_chart_title_names_the_machine_without_trademarks_or_clock(monkeypatch, name, short):
    from labkit.units import machine_name
    assert machine_name(name) == short
    monkeypatch.setattr(backend, "device_name", lambda device: name)
    assert backend.choose_device("cpu").name == short


def test_a_record_names_its_machine_or_at_least_its_device():
    from labkit.units import machine_of
    assert machine_of({"device": "cpu", "device_name": "Intel(R) Xeon(R) CPU @ 2.10GHz"}) == "Intel Xeon"
    assert machine_of({"device": "cuda"}) == "cuda" and machine_of({"device_name": ""}) == "?"


def test_free_and_total_memory_come_from_meminfo(monkeypatch):
    meminfo = ["MemTotal:       16384 kB", "MemFree:  1 kB", "MemAvailable:    8192 kB"]
    monkeypatch.setattr(backend, "_read_lines", lambda path: meminfo if path == "/proc/meminfo" else [])
    assert backend.free_memory_bytes("cpu") == 8192 * 1024
    assert backend.total_memory_bytes("cpu") == 16384 * 1024


def test_a_container_limit_caps_free_and_total_memory(monkeypatch):
    """The tightest cgroup limit caps the total, the least room under any of them the free memory
    (a learner's service at 4 MiB with 1 MiB used, inside a slice at 6 MiB with 5 MiB used)."""
    files = {"/proc/meminfo": ["MemTotal: 16384 kB", "MemAvailable: 8192 kB"]}
    monkeypatch.setattr(backend, "_read_lines", lambda path: files.get(path, []))
    monkeypatch.setattr(backend.cgroups, "memory_limits", lambda: [(4194304, 1048576), (6291456, 5242880)])
    assert backend.free_memory_bytes("cpu") == 6291456 - 5242880
    assert backend.total_memory_bytes("cpu") == 4194304
    monkeypatch.setattr(backend.cgroups, "memory_limits", lambda: [])
    assert backend.free_memory_bytes("cpu") == 8192 * 1024 and backend.total_memory_bytes("cpu") == 16384 * 1024


def test_this_machine_reports_plausible_memory():
    free, total = backend.free_memory_bytes("cpu"), backend.total_memory_bytes("cpu")
    assert 0 < free <= total
    assert isinstance(backend.device_name("cpu"), str) and backend.device_name("cpu")


def test_check_fits_refuses_before_allocating_with_the_numbers(monkeypatch):
    monkeypatch.setattr(backend, "free_memory_bytes", lambda device: int(8.1 * GIB))
    with pytest.raises(FootprintError) as caught:
        backend.check_fits(12.3 * GIB, "cpu", "decode at batch 64")
    message = str(caught.value)
    assert message.startswith("decode at batch 64 needs 12.3 GiB but cpu has 8.1 GiB free")
    assert message.endswith("lower batch or context")
    assert "\n" not in message


def test_under_a_hubs_memory_limit_the_refusal_says_what_holds_the_memory_and_what_to_stop(monkeypatch):
    """A learner's other lessons' kernels use the same limit: the refusal names the limit and the
    memory in use, and says to shut down finished lessons' kernels, in one line; sizes under a
    GiB read in MiB (not "needs 0.0 GiB but cpu has 0.0 GiB free")."""
    monkeypatch.setattr(backend, "_meminfo_bytes", lambda field: 64 * GIB)
    monkeypatch.setattr(backend.cgroups, "memory_limits", lambda: [(4 * GIB, 4 * GIB - (12 << 20))])
    with pytest.raises(FootprintError) as caught:
        backend.check_fits(16 << 20, "cpu", "an fp32 KV cache of 1 x 4096 tokens for lab-cpu")
    assert str(caught.value) == (
        "an fp32 KV cache of 1 x 4096 tokens for lab-cpu needs 16 MiB but cpu has 12 MiB free (keeping 10% "
        "and 96 MiB of headroom); 4.0 GiB of this server's 4.0 GiB memory limit is in use, by this kernel and any other still "
        "running: shut down the kernels of the lessons you have finished (Kernel > Shut Down Kernel, or close "
        "their tabs), or lower batch or context")
    with pytest.raises(FootprintError) as caught:  # more than the whole limit: no kernel to stop would help
        backend.check_fits(5 * GIB, "cpu", "a cache")
    assert str(caught.value) == ("a cache needs 5.0 GiB but cpu has 12 MiB free (keeping 10% and 96 MiB of headroom); that is more "
                                 "than this server's 4.0 GiB memory limit allows; lower batch or context")
    monkeypatch.setattr(backend, "_meminfo_bytes", lambda field: 10 << 20)  # the machine itself is the tighter
    with pytest.raises(FootprintError) as caught:
        backend.check_fits(16 << 20, "cpu", "a cache")
    assert str(caught.value).endswith("needs 16 MiB but cpu has 10 MiB free (keeping 10% and 96 MiB of headroom); lower batch or context")


def test_memory_malloc_kept_is_handed_back_before_a_refusal(monkeypatch):
    """The memory a CPU process freed and malloc keeps for reuse (`cpu_memory`) counts as in use
    under a cgroup limit; check_fits hands it back and looks again before it refuses, and leaves it
    kept when the run fits anyway (the kept memory spares the next prefill its page faults)."""
    handed = []
    monkeypatch.setattr(backend.cpu_memory, "hand_back", lambda: handed.append(True) or True)
    monkeypatch.setattr(backend, "free_memory_bytes", lambda device: (300 << 20) if handed else (90 << 20))
    assert backend.check_fits(122 << 20, "cpu", "a cache") == 300 << 20 and len(handed) == 1
    assert backend.check_fits(122 << 20, "cpu", "a cache") == 300 << 20 and len(handed) == 1  # fits: kept
    handed.clear()
    monkeypatch.setattr(backend, "free_memory_bytes", lambda device: 90 << 20)  # nothing came back
    with pytest.raises(FootprintError, match=r"^a cache needs 122 MiB but cpu has 90 MiB free"):
        backend.check_fits(122 << 20, "cpu", "a cache")
    assert handed == [True]


def test_check_fits_keeps_ten_percent_headroom(monkeypatch):
    monkeypatch.setattr(backend, "free_memory_bytes", lambda device: 10 * GIB)
    assert backend.check_fits(8.9 * GIB, "cpu", "x") == 10 * GIB
    with pytest.raises(FootprintError):
        backend.check_fits(9.1 * GIB, "cpu", "x")


def test_devices_can_be_given_as_torch_devices_or_backends():
    assert backend.free_memory_bytes(torch.device("cpu")) > 0
    assert backend.device_name(backend.choose_device("cpu")) == backend.device_name("cpu")
    with pytest.raises(LabError, match="unknown device"):
        backend.free_memory_bytes("meta")


@pytest.mark.gpu
def test_on_a_real_gpu_the_choice_and_memory_are_consistent():
    chosen = backend.choose_device()
    assert chosen.device == "cuda" and chosen.reason.startswith("CUDA available: ")
    assert chosen.reason.endswith(torch.cuda.get_device_name(0)) or chosen.compute_dtype == "fp16"
    assert 0 < backend.free_memory_bytes("cuda") <= backend.total_memory_bytes("cuda")
    with pytest.raises(FootprintError):
        backend.check_fits(10 * backend.total_memory_bytes("cuda"), "cuda", "too much")


def test_importing_labkit_sets_the_thread_waits_before_torch_or_numpy_load():
    """OMP_WAIT_POLICY, GOMP_SPINCOUNT and OPENBLAS_THREAD_TIMEOUT are read once, when torch's
    OpenMP (and numba's) and numpy's OpenBLAS load: `import labkit` must set them (unless the user
    did) and load neither library."""
    import os
    import subprocess
    import sys

    code = ("import os, sys; import labkit; "
            "print(os.environ['OMP_WAIT_POLICY'], os.environ['OPENBLAS_THREAD_TIMEOUT'], os.environ['GOMP_SPINCOUNT'], "
            "'numpy' in sys.modules, 'torch' in sys.modules)")
    env = {k: v for k, v in os.environ.items() if k not in ("OMP_WAIT_POLICY", "OPENBLAS_THREAD_TIMEOUT", "GOMP_SPINCOUNT")}
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, env=env)
    assert out.stdout.split() == ["PASSIVE", "4", "10000", "False", "False"], out.stdout
    mine = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                          env={**env, "OPENBLAS_THREAD_TIMEOUT": "10", "GOMP_SPINCOUNT": "0"})
    assert mine.stdout.split()[1:3] == ["10", "0"]  # a user's own setting wins


def test_dtype_names_are_turned_into_torch_dtypes_in_one_place():
    from labkit import dtypes
    assert dtypes.torch_dtype("fp8") == torch.float8_e4m3fn and dtypes.dtype_name(torch.int8) == "int8"
    assert all(dtypes.dtype_name(dtypes.torch_dtype(name)) == name for name in dtypes.CACHE_DTYPES)
    with pytest.raises(LabError, match="known: fp32, bf16, fp16"):
        dtypes.torch_dtype("int8", dtypes.COMPUTE_DTYPES)


def test_a_dtype_name_takes_the_article_it_is_read_with():
    from labkit import dtypes
    assert [dtypes.with_article(n) for n in dtypes.CACHE_DTYPES] == [
        "an fp32", "a bf16", "an fp16", "an fp8", "an int8"]


def test_synchronize_is_a_no_op_on_the_cpu():
    assert backend.synchronize("cpu") is None


@pytest.mark.parametrize("interpret, cuda, mode, device, on_cpu, on_cuda", [
    pytest.param("1", False, "interpreter", "cpu", "interpreter", "interpreter", marks=pytest.mark.triton),
    pytest.param("1", True, "interpreter", "cpu", "interpreter", "interpreter",  # chosen: the interpreter wins
                 marks=pytest.mark.triton),
    pytest.param(None, True, "compiled", "cuda", None, "compiled", marks=pytest.mark.triton),
    (None, False, "none", None, None, None),
])
def test_how_the_triton_kernels_run_is_decided_once(monkeypatch, interpret, cuda, mode, device, on_cpu, on_cuda):
    if interpret is None:
        monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    else:
        monkeypatch.setenv("TRITON_INTERPRET", interpret)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: cuda)
    assert backend.triton_mode() == mode and backend.kernel_device() == device
    assert backend.kernels_run_on("cpu") == on_cpu and backend.kernels_run_on("cuda") == on_cuda


@pytest.mark.triton
def test_the_interpreter_can_be_chosen_only_before_triton_is_imported(monkeypatch):
    import sys
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    monkeypatch.setitem(sys.modules, "triton", sys.modules.get("triton") or object())
    with pytest.raises(LabError, match="set TRITON_INTERPRET=1 before triton is imported"):
        backend.use_interpreter()
    monkeypatch.delitem(sys.modules, "triton")
    backend.use_interpreter()
    assert backend.triton_mode() == "interpreter"


@pytest.mark.parametrize("interpret, cuda", [("1", False), ("1", True), (None, True)])
def test_without_triton_the_kernels_run_nowhere_and_say_why(monkeypatch, interpret, cuda):
    """macOS and Windows: no Triton wheels. `sys.modules["triton"] = None` is Python's own way to
    make an import fail; whatever TRITON_INTERPRET and CUDA say, the kernels cannot run, and
    choosing the interpreter is refused in one line that names the reason."""
    import sys
    here = backend.triton_installed()
    monkeypatch.setitem(sys.modules, "triton", None)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: cuda)
    if interpret is None:
        monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    else:
        monkeypatch.setenv("TRITON_INTERPRET", interpret)
    assert not backend.triton_installed()
    assert backend.triton_mode() == "none" and backend.kernel_device() is None
    assert backend.kernels_run_on("cpu") is None and backend.kernels_run_on("cuda") is None
    with pytest.raises(LabError, match=r"^Triton's interpreter cannot run: Triton is not installed \(no wheels"):
        backend.use_interpreter()
    monkeypatch.delitem(sys.modules, "triton")
    assert backend.triton_installed() == here, "the answer follows the import system, not a cached value"


@pytest.mark.parametrize("version, too_old", [("2.0.0", True), ("2.3.1+git5f3e2a", True), ("3.0.0", False),
                                              ("3.6.0", False), ("3.9.0", False), ("4.1", False), ("dev", False)])
def test_a_triton_before_3_is_named_too_old(version, too_old):
    """Triton 2 fails on importing the kernels with a KeyError inside its autotuner; the GPU check
    and the compile check say this line instead (exit 2). A version it cannot read is let through."""
    problem = backend.triton_too_old(version)
    assert (problem == f"triton {version} is too old for the lab's kernels: they need triton 3 (checked with 3.6 and "
                       "3.9)") if too_old else problem is None
    if backend.triton_installed():
        assert backend.triton_too_old() is None  # the pinned triton


# ------------------------------------------------------------------ a laptop's OS: no /proc (issue 16)
VM_STAT = """Mach Virtual Memory Statistics: (page size of 16384 bytes)
Pages free:                               12000.
Pages active:                            300000.
Pages inactive:                          250000.
Pages speculative:                         3000.
Pages throttled:                              0.
Pages wired down:                        150000.
Pages purgeable:                           9000.
"""


def test_on_macos_memory_and_the_cpu_name_come_from_sysctl_and_vm_stat(monkeypatch):
    """macOS has no /proc and its sysconf no SC_AVPHYS_PAGES: free memory is vm_stat's free,
    inactive and speculative pages, the CPU is the brand string (platform says only "arm")."""
    answers = {("sysctl", "-n", "hw.memsize"): "17179869184", ("vm_stat",): VM_STAT,
               ("sysctl", "-n", "machdep.cpu.brand_string"): "Apple M2"}
    monkeypatch.setattr(backend, "_read_lines", lambda path: [])
    monkeypatch.setattr(backend.platform, "system", lambda: "Darwin")
    monkeypatch.setattr(backend.cpu_info, "run_command", lambda args: answers.get(tuple(args)))
    assert backend.total_memory_bytes("cpu") == 16 * GIB
    assert backend.free_memory_bytes("cpu") == (12000 + 250000 + 3000) * 16384
    assert backend.device_name("cpu") == "Apple M2"


def test_on_windows_memory_comes_from_global_memory_status(monkeypatch):
    """Windows has no os.sysconf: GlobalMemoryStatusEx fills MEMORYSTATUSEX (64 bytes)."""
    assert ctypes.sizeof(backend._MemoryStatusEx) == 64
    monkeypatch.setattr(backend, "_read_lines", lambda path: [])
    monkeypatch.setattr(backend.platform, "system", lambda: "Windows")
    monkeypatch.setattr(backend, "_windows_memory_bytes", lambda: {"MemTotal": 32 * GIB, "MemAvailable": 20 * GIB})
    assert backend.free_memory_bytes("cpu") == 20 * GIB and backend.total_memory_bytes("cpu") == 32 * GIB
    assert backend._os_memory_bytes("Linux")["MemTotal"] > 0  # sysconf, where an OS has it


def test_an_os_that_reports_no_memory_is_one_clear_error(monkeypatch):
    monkeypatch.setattr(backend, "_read_lines", lambda path: [])
    monkeypatch.setattr(backend.platform, "system", lambda: "Darwin")
    monkeypatch.setattr(backend.cpu_info, "run_command", lambda args: None)
    with pytest.raises(LabError, match="^cannot tell this machine's free memory: Darwin reports it neither"):
        backend.free_memory_bytes("cpu")


@pytest.mark.parametrize("driver_sign, with_library, torch_version, visible, interpreted", [
    (None, True, "2.13.0", None, "1"),  # no driver
    ("/dev/nvidiactl", True, "2.13.0", None, None), ("/proc/driver/nvidia/version", True, "2.13.0", None, None),
    ("/dev/nvidiactl", False, "2.13.0", None, "1"),  # a device node without the driver's library
    ("/dev/nvidiactl", True, "2.13.0+cpu", None, "1"),  # a driver, but torch built for the CPU
    ("/dev/nvidiactl", True, "2.13.0", "", "1"), ("/dev/nvidiactl", True, "2.13.0", "-1", "1")])  # GPUs hidden
def test_a_gpu_machine_without_nvidia_smi_compiles_the_kernels(driver_sign, with_library, torch_version, visible,
                                                                interpreted):
    """A container given the GPU for compute only (NVIDIA_DRIVER_CAPABILITIES=compute) has the
    driver's device node, /proc entry and library but no nvidia-smi: by nvidia-smi alone, labkit
    chose Triton's interpreter there, slow and with wrong bf16. Where torch cannot use the GPU (a
    CPU-only build, GPUs hidden), the interpreter is still the only way the kernels run."""
    import os
    import subprocess
    import sys
    code = ("import ctypes, importlib.metadata, os, shutil\nreal, load = os.path.exists, ctypes.CDLL\n"
            f"os.path.exists = lambda p: p == {driver_sign!r} or real(p)\n"
            "shutil.which = lambda name, *a, **k: None\n"  # no nvidia-smi on PATH
            f"ctypes.CDLL = lambda name, *a, **k: object() if name == 'libcuda.so.1' and {with_library!r} else load(name, *a, **k)\n"
            f"importlib.metadata.version = lambda name: {torch_version!r}\n"
            "import labkit\nprint(os.environ.get('TRITON_INTERPRET'))")
    env = {k: v for k, v in os.environ.items() if k not in ("TRITON_INTERPRET", "CUDA_VISIBLE_DEVICES")}
    if visible is not None:
        env["CUDA_VISIBLE_DEVICES"] = visible
    if any(os.path.exists(p) for p in ("/dev/nvidiactl", "/proc/driver/nvidia/version")):
        pytest.skip("this machine has an NVIDIA driver")
    done = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == str(interpreted)
