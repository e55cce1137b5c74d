"""The CPU decode step's products, x [B, in] @ w [out, in].T for a few rows: each weight read once.

Why it exists: at B = 4-32 a plain BLAS gemm copies ("packs") the whole weight into its own tile
layout at every call before it multiplies, and for a few rows that copy costs more than the
product: the lab's 49,152 x 256 LM head read at 42-44 GB/s as a B = 1 product but at 4-23 GB/s
at B = 4-32 (the issue's measurements). So the decode step prepares its weights ONCE, and three
ways to do that are tried in this order, the first that applies is used:

  "mkl"    Intel CPUs with torch's MKL: MKL's own packed weight (cblas_sgemm_pack, the op
           inductor's `freezing` emits), packed once per batch size (the last `MKL_PACKS_KEPT`
           sizes kept). Only there: torch's MKL streamed decode products slowly on the lab's
           AMD CPUs (`ops.TorchOps.linear`), and this path has not been timed on one;
  "numba"  everywhere numba installs (x86, ARM): `cpu_kernels.few_rows_linear` over a contiguous
           [out, in] copy of each weight, 4 weight rows x 4 rows of x per register tile;
  "blas"   without numba: numpy's OpenBLAS on the model's own weights (`cpu_blas.blas_matmul`),
           the step as it was before the other two.

`prepare(weights, kind=None)` picks; `kind` forces one (tests run each against the others; set
LABKIT_CPU_LINEAR=mkl|numba|blas to compare them on a machine). The result's `name` and
`reason` say what runs and why.

Shapes: x [B, in] fp32 numpy; each weight a torch [out, in] fp32 tensor (any strides).
"""
from __future__ import annotations

import os
from collections import OrderedDict
from contextlib import nullcontext

import numpy as np
import torch

from . import cpu_kernels
from .cpu_blas import CORES, MAX_WORKERS, SINGLE_THREAD_FLOPS, SINGLE_THREAD_WEIGHT_BYTES, blas_matmul, on_every_core
from .errors import LabError

KINDS = ("mkl", "numba", "blas")
SPLIT_FLOPS = 1 << 24  # a product of more FLOPs than this (and any weight over 4 MiB) is shared out
# Batch sizes whose packed weights stay: each is a copy of every weight, and more (lab-cpu's 63 MB
# of products took 126 MiB more resident memory at B = 16); a new batch size repacks (~50 ms).
MKL_PACKS_KEPT = 1


def cpu_vendor() -> str:
    """The CPU's vendor string from /proc/cpuinfo ("GenuineIntel", "AuthenticAMD", ...), or ""
    where there is none (macOS, an ARM board without the field)."""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("vendor_id"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return ""


def mkl_packing_available() -> tuple[bool, str]:
    """(can MKL's packed weights be used here?, why or why not)."""
    if not torch.backends.mkl.is_available():
        return False, "this torch has no MKL"
    try:
        torch.ops.mkl._mkl_linear, torch.ops.mkl._mkl_reorder_linear_weight  # noqa: B018
    except (AttributeError, RuntimeError):
        return False, "this torch has no packed MKL linear"
    vendor = cpu_vendor()
    if vendor != "GenuineIntel":
        return False, f"CPU vendor {vendor or 'unknown'} (MKL's packed path is Intel's)"
    return True, "an Intel CPU and torch's MKL"


def choose_kind(kind: str | None = None) -> tuple[str, str]:
    """(kind, reason): `kind` or LABKIT_CPU_LINEAR when given, else the first that applies."""
    kind = kind or os.environ.get("LABKIT_CPU_LINEAR") or None
    if kind is not None:
        if kind not in KINDS:
            raise LabError(f"CPU linear {kind!r} unknown; known: {', '.join(KINDS)}")
        if kind == "mkl" and not mkl_packing_available()[0]:
            raise LabError(f"CPU linear 'mkl' asked for, but {mkl_packing_available()[1]}")
        if kind == "numba" and not cpu_kernels.AVAILABLE:
            raise LabError("CPU linear 'numba' asked for, but numba is not installed")
        return kind, f"{kind} products asked for"
    mkl_ok, mkl_why = mkl_packing_available()
    if mkl_ok:
        return "mkl", f"MKL's packed weights ({mkl_why})"
    if cpu_kernels.AVAILABLE:
        return "numba", f"numba's few-row kernel (no MKL packing: {mkl_why})"
    return "blas", f"numpy's BLAS (no MKL packing: {mkl_why}; numba not installed)"


def prepare(weights, kind: str | None = None):
    """The products for `weights` (torch [out, in] tensors), prepared once: a `Products` whose
    `products(i, x)` is x @ weights[i].T."""
    kind, reason = choose_kind(kind)
    return {"mkl": MklProducts, "numba": NumbaProducts, "blas": BlasProducts}[kind](weights, reason)


class MklProducts:
    """MKL's packed weights, packed for the batch sizes of the last steps. A large product is packed
    in column blocks that every core multiplies at once (`cpu_blas.on_every_core`), each block's
    MKL call on one thread: MKL's own OpenMP threads, woken for each of the step's 17 products,
    stalled whole steps on a busy machine, and the lab's pool shares the cores as well."""

    name = "mkl"

    def __init__(self, weights, reason):
        self.weights = [w.detach() for w in weights]  # [out, in] views: MKL packs from any strides
        self.reason = reason
        self.packs: OrderedDict[int, list] = OrderedDict()  # batch size -> per weight [(block, packed)]

    def threads(self):
        """A context for the step's products: torch (and so MKL) on one thread in this one."""
        return _TorchThreads(1)

    def _packed(self, rows: int) -> list:
        """Per weight, its column blocks and their packs for `rows` rows (packed on first use)."""
        packs = self.packs.get(rows)
        if packs is None:
            packs = self.packs[rows] = [
                [(w[_block(w.shape[0], p, n)], None) for p in range(n)]
                for w, n in ((w, _parts(w, rows)) for w in self.weights)]
            for blocks in packs:
                blocks[:] = [(b, torch.ops.mkl._mkl_reorder_linear_weight(b, rows)) for b, _ in blocks]
            while len(self.packs) > MKL_PACKS_KEPT:
                self.packs.popitem(last=False)
        self.packs.move_to_end(rows)
        return packs

    def __call__(self, i: int, x: np.ndarray) -> np.ndarray:
        rows = x.shape[0]
        blocks, xt = self._packed(rows)[i], torch.from_numpy(np.ascontiguousarray(x))
        if len(blocks) == 1:
            (w, packed), = blocks
            return torch.ops.mkl._mkl_linear(xt, packed, w, None, rows).numpy()
        out = np.empty((rows, self.weights[i].shape[0]), np.float32)
        columns = [_block(out.shape[1], p, len(blocks)) for p in range(len(blocks))]

        def run(p):
            w, packed = blocks[p]
            out[:, columns[p]] = torch.ops.mkl._mkl_linear(xt, packed, w, None, rows).numpy()
        on_every_core(run, len(blocks))
        return out


def _parts(w, rows: int) -> int:
    """Column blocks a product is shared out in: 1 for a small one (waking another thread costs
    more than it saves, as in `cpu_blas`), one per core (at most MAX_WORKERS) for a large weight
    or many FLOPs."""
    small = w.numel() * 4 <= SINGLE_THREAD_WEIGHT_BYTES and 2 * rows * w.numel() <= SPLIT_FLOPS
    return 1 if small or CORES < 2 else min(CORES, MAX_WORKERS)


def _block(n: int, part: int, parts: int) -> slice:
    """Part `part` of `parts` near-equal slices of range(n)."""
    return slice(n * part // parts, n * (part + 1) // parts)


class _TorchThreads:
    """torch.set_num_threads(n) inside the block, the previous count restored after it."""

    def __init__(self, n: int):
        self.n = n

    def __enter__(self):
        self.before = torch.get_num_threads()
        if self.before != self.n:
            torch.set_num_threads(self.n)

    def __exit__(self, *exc):
        if self.before != self.n:
            torch.set_num_threads(self.before)


class NumbaProducts:
    """`cpu_kernels.few_rows_linear` over a contiguous [out, in] copy of each weight."""

    name = "numba"

    def __init__(self, weights, reason):
        self.weights = [np.ascontiguousarray(w.detach().numpy()) for w in weights]  # [out, in]
        self.reason = reason

    def threads(self):
        """A context for the step's products: nothing to set (the kernel runs where it is called)."""
        return nullcontext()

    def __call__(self, i: int, x: np.ndarray) -> np.ndarray:
        """x @ w.T: a small product on this thread (waking another costs more than it saves, as
        in `cpu_blas`), a large one in column groups on every core."""
        w, x = self.weights[i], np.ascontiguousarray(x)
        out = np.empty((x.shape[0], w.shape[0]), np.float32)
        groups = (w.shape[0] + 3) // 4  # the kernel's tasks: 4 output columns each
        small = w.nbytes <= SINGLE_THREAD_WEIGHT_BYTES and 2 * x.shape[0] * w.size <= SINGLE_THREAD_FLOPS
        if small or CORES < 2:
            cpu_kernels.few_rows_linear(x, w, out, 0, groups)
            return out
        parts = min(CORES, MAX_WORKERS)
        on_every_core(lambda p: cpu_kernels.few_rows_linear(x, w, out, groups * p // parts,
                                                            groups * (p + 1) // parts), parts)
        return out


class BlasProducts:
    """numpy's OpenBLAS on [in, out] views of the model's weights (no copy)."""

    name = "blas"

    def __init__(self, weights, reason):
        self.weights = [w.detach().numpy().T for w in weights]  # [in, out] views
        self.reason = reason

    def threads(self):
        """A context for the step's products: nothing to set (`cpu_blas` sets OpenBLAS's count)."""
        return nullcontext()

    def __call__(self, i: int, x: np.ndarray) -> np.ndarray:
        return blas_matmul(x, self.weights[i])
