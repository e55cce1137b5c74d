"""Hardware and model specs: frozen dataclasses in registries, a source on every number.

Notation used across the lab (the lesson's letters -> code names):

    P   prompt tokens              prompt_tokens
    S   context (cached) tokens    context_tokens
    B   batch (sequences)          batch
    L   layers                     ModelSpec.n_layers
    d   hidden size                ModelSpec.hidden_size
    H   query heads                ModelSpec.n_heads
    Hkv key/value heads            ModelSpec.n_kv_heads
    dh  head dimension             ModelSpec.head_dim
    N   parameters                 roofline.param_count(model, ...)
    V   vocabulary                 ModelSpec.vocab_size

Derived quantities (ridge point, parameter counts) are computed in `roofline`, never stored here.
An unknown name raises `SpecError` listing the known ones; a Hugging Face-style `config.json`
given by path is read offline. A CUDA device's name (as torch reports it) finds its preset with
`preset_for_device_name`, or None: a GPU the lab has no datasheet for gets no roof, not a guess.
"""
from __future__ import annotations

import dataclasses
import json
import math
import os
import re
import stat
from dataclasses import dataclass, field
from pathlib import Path

from .errors import SpecError

DTYPES = ("fp32", "bf16", "fp16", "fp8", "int8")
# Bound on every model dimension: far above any real model (2**40 ~ 1.1e12), and low enough that
# the roofline's products of several dimensions stay finite floats (beyond ~1e308 they overflow).
MAX_SIZE = 2**40
MAX_CONFIG_BYTES = 2**20  # a config.json is a few KB; refuse devices, pipes and huge files
BYTES_PER_ELEMENT = {"fp32": 4, "bf16": 2, "fp16": 2, "fp8": 1, "int8": 1}


@dataclass(frozen=True)
class HardwareSpec:
    """One machine's roofline: dense peak per dtype, memory bandwidth and capacity.

    Peaks are *dense* (no 2:4 sparsity) tensor-core figures. `None` means the dtype has no
    tensor-core path on that chip. `sources` maps each numeric field to where it came from.
    """

    name: str
    bf16_flops_per_s: float | None
    fp16_flops_per_s: float | None
    fp8_flops_per_s: float | None
    int8_ops_per_s: float | None
    fp32_flops_per_s: float | None
    memory_bandwidth_bytes_per_s: float
    memory_bytes: float
    sources: dict = field(default_factory=dict, compare=False, hash=False)
    kind: str = "datasheet"  # "datasheet" or "calibrated"
    # The caches a working set can stay in, smallest first: ((name, bytes), ...), bytes being what
    # all the cores (or SMs) hold together; past the last one the data comes from `memory_name`.
    cache_levels: tuple = ()
    memory_name: str = "memory"
    # Calibrations only: the measured bandwidth roof by working set, ((bytes, bytes_per_s), ...)
    # ascending (`roofline.bandwidth_at_bytes_per_s` reads it); empty on a datasheet.
    bandwidth_by_working_set: tuple = ()

    def __post_init__(self):
        # JSON (a cached calibration) gives lists; frozen specs keep tuples, so they stay hashable.
        for name in ("cache_levels", "bandwidth_by_working_set"):
            object.__setattr__(self, name, tuple(tuple(pair) for pair in getattr(self, name)))

    def peak_flops_per_s(self, dtype: str) -> float:
        """Dense peak for `dtype`; raises SpecError if the chip has no such path."""
        if dtype not in DTYPES:
            raise SpecError(f"unknown dtype {dtype!r}; known: {', '.join(DTYPES)}")
        value = getattr(self, "int8_ops_per_s" if dtype == "int8" else f"{dtype}_flops_per_s")
        if value is None:
            raise SpecError(f"{self.name} has no {dtype} peak (no tensor-core path for it)")
        return value


@dataclass(frozen=True)
class ModelSpec:
    """A Llama-architecture decoder (RMSNorm, RoPE, GQA, SwiGLU), as its config.json states it."""

    name: str
    hidden_size: int
    n_layers: int
    n_heads: int
    n_kv_heads: int
    head_dim: int
    intermediate_size: int
    vocab_size: int
    tie_embeddings: bool
    rope_theta: float
    norm_eps: float
    max_context: int
    source: str

    def __post_init__(self):
        for name in ("hidden_size", "n_layers", "n_heads", "n_kv_heads", "head_dim",
                     "intermediate_size", "vocab_size", "max_context"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or not 1 <= value <= MAX_SIZE:
                shown = repr(value) if len(repr(value)) <= 40 else f"a value of {len(repr(value)):,} characters"
                raise SpecError(f"model {self.name!r}: {name} must be a positive integer at most "
                                f"{MAX_SIZE:,}, got {shown}")
        if self.n_heads % self.n_kv_heads:
            raise SpecError(f"model {self.name!r}: n_heads ({self.n_heads}) must be a multiple "
                            f"of n_kv_heads ({self.n_kv_heads}) for grouped-query attention")
        if self.head_dim % 2:
            raise SpecError(f"model {self.name!r}: head_dim ({self.head_dim}) must be even for RoPE")

    @property
    def q_dim(self) -> int:
        """Width of all query heads together, H * dh (equals d for every Llama preset)."""
        return self.n_heads * self.head_dim

    @property
    def kv_dim(self) -> int:
        """Width of all key (or value) heads together, Hkv * dh."""
        return self.n_kv_heads * self.head_dim


_NV_H100 = "NVIDIA H100 Tensor Core GPU datasheet (2023), dense = half the with-sparsity figure"
_NV_H200 = "NVIDIA H200 Tensor Core GPU datasheet (2024), dense = half the with-sparsity figure"
_NV_A100 = "NVIDIA A100 Tensor Core GPU datasheet (2021)"
_NV_L4 = "NVIDIA L4 Tensor Core GPU datasheet (2023), dense = half the with-sparsity figure"
_NV_T4 = "NVIDIA T4 Tensor Core GPU datasheet (2019)"
_NV_ADA = "NVIDIA Ada Lovelace GPU Architecture whitepaper v2.1, Appendix A (GeForce RTX 4090), FP32 accumulate"


def _gpu(name, bf16, fp16, fp8, int8, fp32, bandwidth, memory, source, memory_name="HBM", **extra_sources):
    fields = ("bf16_flops_per_s", "fp16_flops_per_s", "fp8_flops_per_s", "int8_ops_per_s",
              "fp32_flops_per_s", "memory_bandwidth_bytes_per_s", "memory_bytes")
    sources = {f: extra_sources.get(f, source) for f in fields}
    l2 = GPU_L2_BYTES.get(name)
    sources["cache_levels"] = l2[1] if l2 else L2_UNKNOWN
    return HardwareSpec(name, bf16, fp16, fp8, int8, fp32, bandwidth, memory, sources,
                        cache_levels=(("L2", l2[0]),) if l2 else (), memory_name=memory_name)


# Each preset's L2, (bytes, source): what a working set under ~2x of it may be served from instead
# of HBM (`roofline.l2_resident`). NVIDIA's "MB" taken as MiB, as CUDA reports L2 sizes
# (cudaDevAttrL2CacheSize); a 5 % difference, far inside the 2x margin. On a GPU the device's own
# figure, torch.cuda.get_device_properties(i).L2_cache_size, is the one to use (`l2_bytes_of`).
_L2_HOPPER = "NVIDIA H100 Tensor Core GPU Architecture whitepaper (2022), Table 3: 50 MB L2 (SXM5 and PCIe)"
GPU_L2_BYTES = {
    "H100-SXM": (50 * 2**20, _L2_HOPPER),
    "H100-PCIe": (50 * 2**20, _L2_HOPPER),
    "H200": (50 * 2**20, "the H200 datasheet states no L2; it is the H100 SXM's GH100 with HBM3e, so " + _L2_HOPPER),
    "A100-40GB": (40 * 2**20, "NVIDIA A100 Tensor Core GPU Architecture whitepaper (2020): 40 MB L2"),
    "A100-80GB": (40 * 2**20, "NVIDIA A100 Tensor Core GPU Architecture whitepaper (2020): 40 MB L2"),
    "RTX-4090": (72 * 2**20, "NVIDIA Ada Lovelace GPU Architecture whitepaper v2.1, Appendix A: 73,728 KB L2"),
}
L2_UNKNOWN = "not in this preset's datasheet: read it from the device (torch.cuda.get_device_properties)"


def l2_bytes_of(hardware: HardwareSpec) -> float | None:
    """The L2 of a spec (a preset's from GPU_L2_BYTES, a calibration's as the device reported
    it), or None where unknown. The GPU check uses it to flag or flush timings whose working set
    could stay in L2 (`roofline.l2_resident`)."""
    return next((size for name, size in hardware.cache_levels if name == "L2"), None)


T = 1e12
GB = 1e9
GPUS: dict[str, HardwareSpec] = {g.name: g for g in (
    # The chapter's machine: 989 TFLOP/s dense bf16 and 3.35 TB/s give its ridge point of 295.
    _gpu("H100-SXM", 989.4 * T, 989.4 * T, 1978.9 * T, 1978.9 * T, 66.9 * T, 3.35e12, 80 * GB, _NV_H100),
    _gpu("H100-PCIe", 756.0 * T, 756.0 * T, 1513.0 * T, 1513.0 * T, 51.0 * T, 2.0e12, 80 * GB, _NV_H100),
    # Same compute as the H100 SXM, more and faster HBM3e.
    _gpu("H200", 989.4 * T, 989.4 * T, 1978.9 * T, 1978.9 * T, 66.9 * T, 4.8e12, 141 * GB, _NV_H200),
    _gpu("A100-40GB", 312.0 * T, 312.0 * T, None, 624.0 * T, 19.5 * T, 1.555e12, 40 * GB, _NV_A100),
    _gpu("A100-80GB", 312.0 * T, 312.0 * T, None, 624.0 * T, 19.5 * T, 2.039e12, 80 * GB, _NV_A100),
    _gpu("L4", 121.0 * T, 121.0 * T, 242.5 * T, 242.5 * T, 30.3 * T, 300e9, 24 * GB, _NV_L4, memory_name="GDDR6"),
    # Turing has fp16 tensor cores but no bf16 or fp8.
    _gpu("T4", None, 65.0 * T, None, 130.0 * T, 8.1 * T, 320e9, 16 * GB, _NV_T4, memory_name="GDDR6"),
    _gpu("RTX-4090", 165.2 * T, 165.2 * T, 330.3 * T, 660.6 * T, 82.6 * T, 1008e9, 24 * GB, _NV_ADA,
         memory_name="GDDR6X"),
)}

_HF = "config.json of meta-llama/{} on Hugging Face"


def _llama(name, repo, d, L, H, Hkv, dh, ffn, tie, max_context=131072):
    return ModelSpec(name=name, hidden_size=d, n_layers=L, n_heads=H, n_kv_heads=Hkv, head_dim=dh,
                     intermediate_size=ffn, vocab_size=128256, tie_embeddings=tie, rope_theta=500000.0,
                     norm_eps=1e-5, max_context=max_context, source=_HF.format(repo))


MODELS: dict[str, ModelSpec] = {m.name: m for m in (
    _llama("llama-3.1-8b", "Llama-3.1-8B", 4096, 32, 32, 8, 128, 14336, False),
    _llama("llama-3.1-70b", "Llama-3.1-70B", 8192, 80, 64, 8, 128, 28672, False),
    _llama("llama-3.1-405b", "Llama-3.1-405B", 16384, 126, 128, 8, 128, 53248, False),
    _llama("llama-3.2-1b", "Llama-3.2-1B", 2048, 16, 32, 8, 64, 8192, True),
    _llama("llama-3.2-3b", "Llama-3.2-3B", 3072, 28, 24, 8, 128, 8192, True),
    # The lab's CPU model: Llama-shaped, sized so that on a 2-core CPU (fp32) prefill passes its
    # causal attention crossover (~3,000 tokens) below 4,096 tokens and decode moves from weights-
    # to cache-dominated within batch <= 64 and context <= 8,192, each measured point taking under
    # ~2 s. The large vocabulary puts ~63 MB of matmul weights (fp32) beyond a 32 MiB L3 cache, so
    # decode really streams from DRAM, while prefill pays for the output head on one position only.
    ModelSpec(name="lab-cpu", hidden_size=256, n_layers=4, n_heads=4, n_kv_heads=2, head_dim=64,
              intermediate_size=768, vocab_size=49152, tie_embeddings=False, rope_theta=500000.0,
              norm_eps=1e-5, max_context=8192, source="this lab (labkit/specs.py), sized for 2 CPU cores"),
    # A tiny model for tests and dry runs.
    ModelSpec(name="lab-tiny", hidden_size=64, n_layers=2, n_heads=4, n_kv_heads=2, head_dim=16,
              intermediate_size=128, vocab_size=256, tie_embeddings=False, rope_theta=10000.0,
              norm_eps=1e-5, max_context=4096, source="this lab (labkit/specs.py), for tests"),
)}


# torch.cuda.get_device_name -> a GPUS preset, first match wins. A part whose name matches none
# gets no datasheet, never a guess: H100 NVL and H200 NVL have other clocks or bandwidth than the
# SXM parts, a GH200's HBM is not an H200's, an L40S is not an L4.
PRESET_BY_DEVICE_NAME = (
    (r"\bH200\b(?!.*NVL)", "H200"),  # "NVIDIA H200"; not "NVIDIA H200 NVL"
    (r"\bH100\b.*\bPCIe\b", "H100-PCIe"),  # "NVIDIA H100 PCIe"
    (r"\bH100\b.*\b(SXM|HBM3)\b", "H100-SXM"),  # "NVIDIA H100 80GB HBM3" is the SXM part
    (r"\bA100\b.*80GB", "A100-80GB"),  # "NVIDIA A100-SXM4-80GB"
    (r"\bA100\b.*40GB", "A100-40GB"),
    (r"\bL4\b", "L4"), (r"\bT4\b", "T4"), (r"\bRTX 4090\b", "RTX-4090"),
)


def preset_for_device_name(device_name: str) -> HardwareSpec | None:
    """The GPUS preset for a CUDA device name as torch reports it, or None for a device the lab
    has no datasheet for (an unknown GPU yields no roof, never a guessed one)."""
    for pattern, preset in PRESET_BY_DEVICE_NAME:
        if re.search(pattern, device_name):
            return GPUS[preset]
    return None


@dataclass(frozen=True)
class GpuLimits:
    """What one program of a kernel may use on a GPU, and how many run at once: the compute
    capability (which dtypes its tensor cores and converters have), the SM count (how many
    programs a grid needs to fill it) and the shared memory one block may opt in to. The GPU
    compile check (labkit.gpu_compile) compiles for each capability against its limit; the
    kernels ask a real device for its own figures."""

    compute_capability: tuple
    sm_count: int
    shared_bytes_per_block: int
    sources: dict = field(default_factory=dict, compare=False, hash=False)


_CUDA_GUIDE = ("CUDA C++ Programming Guide, Compute Capabilities: maximum shared memory per thread block "
               "(opt-in) {} KB for compute capability {}")
_CC_LIST = "NVIDIA CUDA GPUs list (developer.nvidia.com/cuda-gpus): {} is compute capability {}"
_SMS = {  # preset: (SMs, source)
    "H100-SXM": (132, "NVIDIA H100 Tensor Core GPU Architecture whitepaper (2022): 132 SMs (SXM5)"),
    "H100-PCIe": (114, "NVIDIA H100 Tensor Core GPU Architecture whitepaper (2022): 114 SMs (PCIe)"),
    "H200": (132, "the H200 is the H100 SXM's GH100 with HBM3e: 132 SMs (H100 whitepaper, SXM5)"),
    "A100-40GB": (108, "NVIDIA A100 Tensor Core GPU Architecture whitepaper (2020): 108 SMs"),
    "A100-80GB": (108, "NVIDIA A100 Tensor Core GPU Architecture whitepaper (2020): 108 SMs"),
    "L4": (58, "NVIDIA L4 datasheet: 7,424 CUDA cores, 128 per Ada SM (Ada whitepaper v2.1) = 58 SMs"),
    "T4": (40, "NVIDIA Turing GPU Architecture whitepaper (2018): Tesla T4, 40 SMs"),
    "RTX-4090": (128, "NVIDIA Ada Lovelace GPU Architecture whitepaper v2.1, Appendix A: 128 SMs"),
}
_CAPABILITY = {"H100-SXM": (9, 0), "H100-PCIe": (9, 0), "H200": (9, 0), "A100-40GB": (8, 0), "A100-80GB": (8, 0),
               "L4": (8, 9), "T4": (7, 5), "RTX-4090": (8, 9)}
# Shared memory per block (opt-in) by compute capability, in KiB (the guide's "KB").
_SHARED_KIB = {(7, 5): 64, (8, 0): 163, (8, 9): 99, (9, 0): 227}


def _limits(preset: str) -> GpuLimits:
    cc, (sms, sms_source) = _CAPABILITY[preset], _SMS[preset]
    kib = _SHARED_KIB[cc]
    return GpuLimits(cc, sms, kib * 1024, {
        "compute_capability": _CC_LIST.format(preset, f"{cc[0]}.{cc[1]}"), "sm_count": sms_source,
        "shared_bytes_per_block": _CUDA_GUIDE.format(kib, f"{cc[0]}.{cc[1]}")})


GPU_LIMITS: dict[str, GpuLimits] = {name: _limits(name) for name in _CAPABILITY}


def gpu_limits(name: str) -> GpuLimits:
    """The GpuLimits of a GPUS preset (case-insensitive); SpecError lists the known ones."""
    return GPU_LIMITS[get_gpu(name).name]


def get_gpu(name: str) -> HardwareSpec:
    """The preset called `name` (case-insensitive); SpecError lists the known ones."""
    for key, spec in GPUS.items():
        if key.lower() == str(name).lower():
            return spec
    raise SpecError(f"unknown GPU {name!r}; known: {', '.join(GPUS)}")


def get_model(name_or_path: str) -> ModelSpec:
    """A preset by name (case-insensitive), or a Hugging Face-style config.json by path."""
    for key, spec in MODELS.items():
        if key.lower() == str(name_or_path).lower():
            return spec
    path = Path(str(name_or_path))
    if path.suffix == ".json" or _is_existing_path(path):
        return model_from_config(path)
    raise SpecError(f"unknown model {name_or_path!r}; known: {', '.join(MODELS)} "
                    f"(or give the path of a Hugging Face config.json)")


def _is_existing_path(path: Path) -> bool:
    """Whether `path` names something on disk; False for names no path can have (too long, NUL)."""
    try:
        return path.exists()
    except (OSError, ValueError):
        return False


_REQUIRED = ("hidden_size", "num_hidden_layers", "num_attention_heads", "intermediate_size", "vocab_size")


def model_from_config(path: str | Path) -> ModelSpec:
    """Read a Hugging Face-style Llama config.json (offline). Malformed files raise SpecError."""
    path = Path(path)
    try:
        config = json.loads(_read_config_bytes(path).decode("utf-8-sig"))
    except FileNotFoundError:
        raise SpecError(f"config file {str(path)!r} not found") from None
    except SpecError:
        raise
    # ValueError: bad JSON, or an integer of more than 4,300 digits; RecursionError: nesting too deep.
    except (OSError, UnicodeDecodeError, ValueError, RecursionError) as err:
        raise SpecError(f"config file {str(path)!r} is not readable JSON: {err}") from None
    if not isinstance(config, dict):
        raise SpecError(f"config file {str(path)!r} must hold a JSON object, got {type(config).__name__}")
    missing = [k for k in _REQUIRED if k not in config]
    if missing:
        raise SpecError(f"config file {str(path)!r} lacks {', '.join(missing)}")
    heads = config["num_attention_heads"]
    hidden = config["hidden_size"]
    if not isinstance(heads, int) or not isinstance(hidden, int) or heads < 1:
        raise SpecError(f"config file {str(path)!r}: hidden_size and num_attention_heads must be positive integers")
    name = config.get("_name_or_path")
    try:
        return ModelSpec(
            name=name if isinstance(name, str) and name else path.stem, hidden_size=hidden,
            n_layers=config["num_hidden_layers"], n_heads=heads,
            n_kv_heads=config.get("num_key_value_heads", heads),
            head_dim=config.get("head_dim", hidden // heads),
            intermediate_size=config["intermediate_size"], vocab_size=config["vocab_size"],
            tie_embeddings=bool(config.get("tie_word_embeddings", False)),
            rope_theta=_positive_real(config, "rope_theta", 10000.0),
            norm_eps=_positive_real(config, "rms_norm_eps", 1e-5),
            max_context=config.get("max_position_embeddings", 131072), source=str(path))
    except SpecError as err:  # a field's check names the field: say which key of the file it came from
        message = str(err)
        for name, key in _CONFIG_KEYS.items():
            message = re.sub(rf"\b{name}\b", key, message)
        raise SpecError(f"config file {str(path)!r}: {message}") from None
    except (TypeError, ValueError, OverflowError) as err:  # OverflowError: float() of a huge integer
        raise SpecError(f"config file {str(path)!r}: {err}") from None


# ModelSpec's fields as a Hugging Face config.json names them, for error messages
_CONFIG_KEYS = {"n_layers": "num_hidden_layers", "n_heads": "num_attention_heads", "n_kv_heads": "num_key_value_heads",
                "intermediate_size": "intermediate_size", "vocab_size": "vocab_size",
                "max_context": "max_position_embeddings", "hidden_size": "hidden_size", "head_dim": "head_dim"}


def _positive_real(config: dict, key: str, default: float) -> float:
    """config[key] (or `default`) as a finite positive float; SpecError naming the key otherwise
    (a null, a list, NaN or 1e999 were taken, or failed without saying which key)."""
    value = config.get(key, default)
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value <= 0:
        raise SpecError(f"{key} must be a finite positive number, got {value!r}")
    return float(value)


def _read_config_bytes(path: Path) -> bytes:
    """The file's bytes if it is a regular file of at most MAX_CONFIG_BYTES: reading /dev/zero,
    /dev/stdin or a named pipe would never end (O_NONBLOCK: opening a pipe does not wait)."""
    fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK)
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            raise SpecError(f"config file {str(path)!r} is not a regular file")
        with open(fd, "rb", closefd=False) as file:
            data = file.read(MAX_CONFIG_BYTES + 1)
    finally:
        os.close(fd)
    if len(data) > MAX_CONFIG_BYTES:
        raise SpecError(f"config file {str(path)!r} is larger than {MAX_CONFIG_BYTES:,} bytes; "
                        f"is it a config.json?")
    return data


def with_changes(spec, **changes):
    """A copy of a spec with some fields replaced (e.g. a shorter model for a quick run)."""
    return dataclasses.replace(spec, **changes)
