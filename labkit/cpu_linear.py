"""The CPU decode step's products, x [B, in] @ w [out, in].T for a few rows: each weight read once.

Why it exists: at B = 4-32 a plain BLAS gemm copies ("packs") the whole weight into its own tile
layout at every call before it multiplies, and for a few rows that copy costs more than the
product: the lab's 49,152 x 256 LM head read at 42-44 GB/s as a B = 1 product but at 4-23 GB/s
at B = 4-32 (the issue's measurements). So the decode step prepares its weights ONCE, and four
ways to do that are tried in this order, the first that applies is used:

  "mkl"    Intel CPUs with torch's MKL: MKL's own packed weight (cblas_sgemm_pack, the op
           inductor's `freezing` emits), packed once per batch size (the last `MKL_PACKS_KEPT`
           sizes kept); with AVX-512, up to `FEW_ROWS` rows go to numba's products with their
           panel product instead (`Panels`: the whole step then runs on numba's threads, see
           `FEW_ROWS`). Only on Intel: torch's MKL streamed decode products slowly on the
           lab's AMD CPUs (`ops.TorchOps.linear`), and this path has not been timed on one;
  "onednn" other CPUs with torch's oneDNN and numba (AMD, ARM): numba's kernels below
           `ONEDNN_MIN_ROWS` rows, where a product streams its weight, and oneDNN's packed weight
           (`torch.ops.mkldnn._reorder_linear_weight`, packed once per batch size as MKL's) from there up, where
           the head turns compute-bound and oneDNN's tiles reach 163 GFLOP/s at B = 16 against the
           numba tile's 91 (2-core EPYC, Zen 3: 2.48 ms against 4.4 ms for the 49,152 x 256 head);
           with AVX-512, up to `ONEDNN_FEW_ROWS` rows numba's products with the panel product
           instead, as the "mkl" kind (`ONEDNN_FEW_ROWS` says what that gained on a Zen 5);
  "numba"  everywhere numba installs (x86, ARM): `cpu_kernels.linear_columns` over a contiguous
           [out, in] copy of each weight, the loop chosen by the number of rows, and a weight that
           streams from memory (the LM head) for 4-11 rows by `cpu_kernels.tile_2x4_linear`,
           which prefetches the rows ahead; on a CPU with AVX-512 the panel product instead
           from `PANEL_MIN_ROWS` rows (`Panels`);
  "blas"   without numba: numpy's OpenBLAS on the model's own weights (`cpu_blas.blas_matmul`),
           the step as it was before the other two.

`prepare(weights, kind=None)` picks; `kind` forces one (tests run each against the others; set
LABKIT_CPU_LINEAR=mkl|onednn|numba|blas to compare them on a machine). The result's `name` and
`reason` say what runs and why. A packing kind is passed over where its copy of the weights would
not fit in free memory (`packing_fits`, asked before anything is packed).

Shapes: x [B, in] fp32 numpy; each weight a torch [out, in] fp32 tensor (any strides).
"""
from __future__ import annotations

import functools
import os
from collections import OrderedDict
from contextlib import nullcontext

import numpy as np
import torch

from . import backend, cpu_kernels
from .cpu_info import cpu_vendor  # a name here, so tests can pretend another vendor
from .cpu_blas import CORES, MAX_WORKERS, blas_matmul, on_every_core
from .errors import FootprintError, LabError

KINDS = ("mkl", "onednn", "numba", "blas")
# From this many rows the "onednn" kind multiplies with oneDNN's packed weights, below with numba's
# kernels: at B = 4 both took 1.4 ms for the head, at B = 1 numba 0.75 ms and oneDNN 2.2 ms.
ONEDNN_MIN_ROWS = 8
# ... and only for a weight of at least this size (lab-cpu's 48 MiB LM head; its layers' weights are
# 0.25-1.5 MiB): for those, oneDNN's call costs more than its tiles save. Layer products summed, both
# cores of a Zen 3, two runs each: B = 8 numba 1.47-1.50 ms, oneDNN 2.65-2.85; B = 16 2.56-2.67 and
# 3.60-3.77 (the head: oneDNN 4.3-4.6 and 6.1-6.8 ms, numba 4.3-4.4 and 8.4-8.7).
ONEDNN_MIN_WEIGHT_BYTES = 4 << 20
# Batch sizes whose packed weights stay: each is a copy of every weight, and more (lab-cpu's 63 MB
# of products took 126 MiB more resident memory at B = 16); a new batch size repacks (~50 ms).
MKL_PACKS_KEPT = 1
# A pack's resident bytes per byte of the weights it copies: MKL's took 126 MiB for lab-cpu's 63 MB
# (B = 16, Xeon); oneDNN's 67, 64 and 53 MB at B = 8, 16, 32 (2-core EPYC, RSS before and after).
PACK_BYTES_PER_WEIGHT_BYTE = {"mkl": 2.0, "onednn": 1.1}
PACKER = {"mkl": "MKL", "onednn": "oneDNN"}
# numba's products share out every weight of at least this size (a decode step's smallest, 256 x 256
# fp32, is 256 KiB): read from memory, one core streams it at well under half of what two do.
NUMBA_SHARED_MIN_BYTES = 128 << 10
# A weight of at least this size streams from memory at every step (lab-cpu's 48 MiB LM head; its
# layers' weights are 0.25-1.5 MiB): for STREAMED_ROWS rows numba's 2 x 4 tile, which prefetches the
# rows ahead, shares it out on the Python pool (a ~50 us hand-off, once a step, against ~1-3 ms of
# reading). Head alone, both cores of a Zen 3, p10 of 60: B = 4, 8, 11: 2.75, 3.66, 4.17 ms against
# 2.81, 4.13, 5.29 for `linear_on_cores`; at B = 1-2 the plain loop was faster (1.57, 1.98 ms
# against 1.64, 2.26). From 12 rows the 4 x 4 tile or oneDNN, where the arithmetic sets the time.
STREAMED_MIN_BYTES = 8 << 20
STREAMED_ROWS = range(4, 12)
# On a CPU with AVX-512 (`Panels.available`), numba's products multiply from 1 row
# (padded to a multiple of 4) by the panel product over a panel copy of each weight (`Panels`), whose 16 x 16
# register tiles keep the weight streaming while they multiply, where MKL's kernel for a few rows kept
# the cores waiting on memory once the decode step's cache had pushed the head out of the L3. The
# 49,152 x 256 head alone on the 2-core Xeon (Emerald Rapids) VM, fastest of 8, in the L3 / just read
# back from memory (a 600 MiB sweep between): B = 8 0.94-1.01 / 1.13-1.21 ms against MKL's 1.05-1.33
# / 2.3-2.6; B = 16 1.57-1.61 / 1.76 against 1.74-1.78 / 2.86-3.18; B = 32 3.15-3.18 / 3.47 against
# 2.89-3.47 / 3.9-4.4. The layers' small weights from 4 rows too rather than 8 (numba's loop over
# pairs of weight rows): steps at S = 1,024, 5 rounds alternating in one process, medians, B = 4, 5,
# 6: 2.34, 2.39, 2.57 ms against 2.36, 2.51, 2.73. And from 1 row once the 4-row tile came (a row or
# three padded to 4): steps at S = 1,024, 3 alternating processes, B = 1, 2, 3: 1.70-1.72,
# 1.81-1.83, 1.92-1.96 ms against the few-row loops' 1.69-2.18, 2.19-2.32, 2.70-2.99.
PANEL_MIN_ROWS = 1
# ... and so the "mkl" kind hands up to this many rows to numba's products where the panel product
# applies: the step's products and its attention then share numba's threads, where MKL's (torch's
# OpenMP) and numba's two pools otherwise hand the cores back and forth ~10 times a step. Whole
# decode steps at S = 1,024 (`sweeps.measure_decode`, fastest of 3, two alternating processes each),
# numba's products with panels against MKL's: B = 1 1.68-1.70 against 1.76-1.77 ms, 4 2.27-2.30
# against 2.35-2.44, 8 2.78-2.82 against 2.97-3.08, 12 4.41-4.67 against 4.66-4.91, 16 5.12 against
# 5.34-5.69; 24 as fast (8.95-9.26 against 8.62-9.33), and at S = 256 (3 rounds alternating in one
# process, fastest / median) 4.70 / 5.51 against 5.18 / 5.88; from 32 rows MKL's were faster (S = 256:
# 32 6.72 / 7.00 against 6.79 / 7.60, 64 11.4 / 11.8 against 14.6 / 14.7), where the arithmetic sets
# the time. (With 16, lesson 04's throughput curve dipped at B = 24, where MKL took over.) 24 -> 28
# once the panel product prefetched into the L2 and the step wrote its cache itself (3 alternating
# processes each): B = 28 at S = 1,024 10.2-10.5 ms against MKL's 10.7-11.6, at S = 256 6.6-7.0
# against 7.6-8.3; at 32 rows as fast or slower (S = 1,024 11.1-11.4 against 11.1-11.4, S = 256
# 7.1-7.7 against 7.1-7.2), at 36 and 40 slower (12.9-13.0, 13.9-14.2 against 11.8-12.3, 12.9-13.2).
# 28 -> 32 once the panel product's step ran as one call (`cpu_step`; 5 rounds alternating in one
# process): B = 32 at S = 1,024 10.1-10.8 ms against MKL's 10.4-11.2, at S = 256 5.3-6.2 against
# 5.7-6.8; at 36 rows no faster (11.3-12.4 against 11.3-11.9), so MKL keeps those.
FEW_ROWS = 32
# The same on an AMD CPU with AVX-512 for the "onednn" kind, up to 64 rows (the CPU lab's largest
# batch): 2-core EPYC VM (Zen 5, cpu family 26), lab-cpu's 49,152 x 256 head alone, fastest of 30,
# panel product against oneDNN's packed weight: 8 rows 1.12 against 1.60 ms, 16 0.94 against 1.39,
# 32 1.92 against 2.17, 64 4.10 against 3.70, 128 7.76 against 7.05; whole steps
# (`sweeps.measure_decode`, 3 alternating processes, ranges), with the panel product and the
# one-call step against numba's loops and oneDNN's packs: at S = 1,024 B = 1 1.32-1.69 against
# 1.65-1.86 ms, 4 1.61-2.04 against 2.83-3.30, 16 3.30-4.35 against 4.27-6.30, 32 6.59-6.97 against
# 7.20-8.00; B = 16, S = 4,096 fp32 8.7-10.9 against 9.2-10.6, bf16 5.1-5.3 against 6.5-7.0, int8
# 3.4-4.8 against 4.6-5.9. In the step the panel product kept its lead to 64 rows, where the head
# alone had lost it (at S = 256, handing over up to 64 rows against up to 32): B = 48 6.34-7.12
# against 7.23-7.52 ms, 64 8.75-8.96 against 8.95-9.31, 32 as fast (4.24-4.79 against 4.35-4.83).
ONEDNN_FEW_ROWS = 64


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


@functools.lru_cache(maxsize=1)
def onednn_packing_available() -> tuple[bool, str]:
    """(can oneDNN's packed weights be used here?, why or why not), by one trial product."""
    if not torch.backends.mkldnn.is_available():
        return False, "this torch has no oneDNN"
    try:  # a trial product: the ops can exist in a build (an ARM or macOS one) and still fail
        w, x = torch.randn(16, 32, generator=torch.Generator().manual_seed(0)), torch.ones(8, 32)
        packed = torch.ops.mkldnn._reorder_linear_weight(w, 8)
        got = torch.ops.mkldnn._linear_pointwise(x, packed, None, "none", [], "")
    except (AttributeError, RuntimeError) as exc:
        return False, f"this torch's packed oneDNN linear does not run ({str(exc).splitlines()[0][:80]})"
    if not torch.allclose(got, x @ w.T, rtol=1e-4, atol=1e-4):
        return False, "this torch's packed oneDNN linear gave a wrong trial product"
    return True, "torch's oneDNN"


def packed(kind: str, weight_bytes: int) -> bool:
    """Whether `kind` packs a weight of `weight_bytes` (MKL every one, oneDNN the large ones)."""
    return kind == "mkl" or (kind == "onednn" and weight_bytes >= ONEDNN_MIN_WEIGHT_BYTES)


def pack_bytes(kind: str, weight_sizes) -> int:
    """Resident bytes of one batch size's packs of weights of `weight_sizes` bytes (0: `kind` packs
    none). The panel product's copies are `Panels`' own, checked when they are made."""
    return int(PACK_BYTES_PER_WEIGHT_BYTE.get(kind, 0) * sum(n for n in weight_sizes if packed(kind, n)))


def packing_fits(kind: str, weight_sizes) -> tuple[bool, str]:
    """(fits, why not): whether `kind`'s packed copy of the weights fits in free memory
    (`backend.check_fits`), predicted before any is made: a pack too big for the machine would
    end the learner's kernel mid-step, where the unpacked products only run slower."""
    try:
        backend.check_fits(pack_bytes(kind, weight_sizes), "cpu", f"{PACKER[kind]}'s packed copy of the weights")
    except FootprintError as err:
        return False, str(err).split("; ")[0]
    return True, ""


def choose_kind(kind: str | None = None, weight_sizes=()) -> tuple[str, str]:
    """(kind, reason): `kind` or LABKIT_CPU_LINEAR when given, else the first that applies; a
    packing kind only where its copy of weights of `weight_sizes` bytes fits in memory
    (`packing_fits`)."""
    kind = kind or os.environ.get("LABKIT_CPU_LINEAR") or None
    if kind is not None:
        if kind not in KINDS:
            raise LabError(f"CPU linear {kind!r} unknown; known: {', '.join(KINDS)}")
        if kind == "mkl" and not mkl_packing_available()[0]:
            raise LabError(f"CPU linear 'mkl' asked for, but {mkl_packing_available()[1]}")
        if kind in ("numba", "onednn") and not cpu_kernels.AVAILABLE:
            raise LabError(f"CPU linear {kind!r} asked for, but numba is not installed")
        if kind == "onednn" and not onednn_packing_available()[0]:
            raise LabError(f"CPU linear 'onednn' asked for, but {onednn_packing_available()[1]}")
        return kind, f"{kind} products asked for"
    mkl_ok, mkl_why = mkl_packing_available()
    if mkl_ok:
        mkl_ok, too_big = packing_fits("mkl", weight_sizes)
        if mkl_ok:
            return "mkl", f"MKL's packed weights ({mkl_why})"
        mkl_why = too_big
    onednn_ok, _ = onednn_packing_available()
    if cpu_kernels.AVAILABLE and onednn_ok:
        onednn_ok, too_big = packing_fits("onednn", weight_sizes)
        if not onednn_ok:
            return "numba", f"numba's few-row kernel (no packing: {too_big})"
    if cpu_kernels.AVAILABLE and onednn_ok:
        return "onednn", (f"numba's kernels below {ONEDNN_MIN_ROWS} rows and for weights under "
                          f"{ONEDNN_MIN_WEIGHT_BYTES >> 20} MiB, oneDNN's packed weights for the others "
                          f"(no MKL packing: {mkl_why})")
    if cpu_kernels.AVAILABLE:
        return "numba", f"numba's few-row kernel (no MKL packing: {mkl_why})"
    return "blas", f"numpy's BLAS (no MKL packing: {mkl_why}; numba not installed)"


def prepare(weights, kind: str | None = None):
    """The products for `weights` (torch [out, in] tensors), prepared once: a `Products` whose
    `products(i, x)` is x @ weights[i].T."""
    kind, reason = choose_kind(kind, [w.numel() * w.element_size() for w in weights])
    return {"mkl": MklProducts, "onednn": OneDnnProducts, "numba": NumbaProducts,
            "blas": BlasProducts}[kind](weights, reason)


class PacksByRows:
    """Packed weights by batch size, packed by `pack(rows)` on first use; only the last
    `MKL_PACKS_KEPT` batch sizes are kept (each is a copy of every weight). Iterates over the
    batch sizes kept, oldest first."""

    def __init__(self, pack):
        self.pack = pack
        self.kept: OrderedDict[int, list] = OrderedDict()

    def __getitem__(self, rows: int) -> list:
        packs = self.kept.get(rows)
        if packs is None:
            while len(self.kept) >= MKL_PACKS_KEPT:  # dropped first: never one copy more than kept
                self.kept.popitem(last=False)
            packs = self.kept[rows] = self.pack(rows)
        self.kept.move_to_end(rows)
        return packs

    def __iter__(self):
        return iter(self.kept)

    def __bool__(self):
        return bool(self.kept)


class _HandsFewRows:
    """What the packing kinds share: up to `few_rows` rows their products go to `few`, numba's
    products (a `NumbaProducts`, or None), where those multiply by the panel product, so the whole
    step can be one numba call (`cpu_step`)."""

    few_rows: int
    few: NumbaProducts | None

    @property
    def panels_enabled(self) -> bool:
        """Whether its few rows are numba's panel product (`Panels`) here."""
        return self.few is not None and self.few.panels_enabled

    def hands_over(self, rows: int) -> bool:
        """Whether a product of `rows` rows goes to numba's panel product."""
        return rows <= self.few_rows and self.panels_enabled

    def all_panels(self, rows: int) -> tuple | None:
        """Every weight's panels where every product at `rows` rows is the panel product, else None."""
        return self.few.all_panels(rows) if self.hands_over(rows) else None

    def _few_reason(self) -> str:
        """The reason's words for the rows handed over ("" where none are)."""
        if not self.panels_enabled:
            return ""
        registers = "AVX-512" if cpu_kernels.wide_tiles() else "AVX2, 4-row tiles"
        return f"; up to {self.few_rows} rows numba's products with the panel product ({registers})"


class MklProducts(_HandsFewRows):
    """MKL's packed weights, packed for the batch sizes of the last steps, each product on MKL's
    own threads (torch's OpenMP pool: every core shares it).

    Why MKL's threads and not the lab's pool: MKL splits a product over its threads inside one
    call, the lab's pool hands column blocks to Python threads (~50 us each, and each block's
    single-thread MKL call streamed the LM head at a third of the L3's bandwidth). Measured on a
    2-core Xeon (Emerald Rapids) VM, the 49,152 x 256 head alone: B = 1, 4, 16 in 1.25, 1.33,
    2.8-3.9 ms on MKL's two threads against 2.5, 5.3, 7.0 ms on one; the decode step at S = 1,024
    (`sweeps.measure_decode`, two runs each) B = 1, 4, 16, 32: 2.5-2.6, 4.1-4.4, 8.1-8.3,
    13.6 ms against 3.4-4.8, 6.5-6.9, 10.6-10.8, 19.3-19.4 ms with the lab's column blocks. The
    smallest products gain nothing from one thread: a step with those at most 2^18 or 2^20 FLOPs on
    one thread was as fast as with all on two, within the VM's noise (6 alternating rounds).
    With another process busy on one core, four runs each: B = 1 2.3-7.4 ms against 3.4-5.2 ms
    with the column blocks, B = 16 15.9-22.3 against 14.4-16.6: MKL's threads lose some of their
    lead there, and a step is then flagged or spread as `timing` sees it."""

    name = "mkl"
    few_rows = FEW_ROWS  # up to this many rows numba's panel product, where it applies

    def __init__(self, weights, reason):
        self.weights = [w.detach() for w in weights]  # [out, in] views: MKL packs from any strides
        # up to `few_rows` rows: numba's products with the panel product, where that applies
        self.few = NumbaProducts(weights, reason) if Panels.available()[0] else None
        self.reason = reason + self._few_reason()
        self.packs = PacksByRows(self._pack)  # batch size -> per weight its pack

    def threads(self):
        """A context for the step's products: torch (and so MKL) on every core."""
        return _TorchThreads(min(CORES, MAX_WORKERS))

    def _pack(self, rows: int) -> list:
        """Per weight, its pack for `rows` rows."""
        return [torch.ops.mkl._mkl_reorder_linear_weight(w, rows) for w in self.weights]

    def __call__(self, i: int, x: np.ndarray) -> np.ndarray:
        rows = x.shape[0]
        if self.hands_over(rows):
            return self.few(i, x)
        packed, xt = self.packs[rows][i], torch.from_numpy(np.ascontiguousarray(x))
        return torch.ops.mkl._mkl_linear(xt, packed, self.weights[i], None, rows).numpy()


class Panels:
    """numba's panel product (`cpu_kernels.panel_linear`) on a CPU with AVX-512 or AVX2 (`available`), for `PANEL_MIN_ROWS` rows and more: each weight copied into panels on its first
    such product (its bytes again, kept across batch sizes; all the copies predicted against free
    memory before the first is made, and none made, saying why, where they would not fit), x
    padded with zero rows to a multiple of 4, the panels shared out on numba's pool. Where it is
    not available it takes no product."""

    def __init__(self, weights):
        self.weights = weights  # torch [out, in], any strides
        self.enabled, self.why_not = self.available()
        self.packed: dict[int, np.ndarray] = {}  # weight index -> its panels [ceil(out / 16), in, 16]

    @staticmethod
    def available() -> tuple[bool, str]:
        """(does the panel product apply here?, why not): AVX-512's registers (timed on an Intel
        Xeon, Emerald Rapids, and an AMD EPYC, Zen 5: `FEW_ROWS`, `ONEDNN_FEW_ROWS`), or AVX2's
        with FMA, in 4-row tiles (`cpu_kernels.wide_tiles`; timed as AVX2 code on the Zen 5)."""
        if not cpu_kernels.panels_in_registers():
            return False, "no AVX-512 or AVX2" if cpu_kernels.AVAILABLE else "numba is not installed"
        return True, ""

    def takes(self, i: int, rows: int) -> bool:
        """Whether product `i` at `rows` rows is the panel product's."""
        return self.enabled and rows >= PANEL_MIN_ROWS

    def fits(self) -> bool:
        """Whether the panel copies fit in free memory (asked once, before the first is made);
        where they do not, the panel product is off for good and `why_not` says why."""
        if not self.packed:
            try:
                backend.check_fits(sum(w.numel() * 4 for w in self.weights), "cpu", "the panel copies of the weights")
            except FootprintError as err:
                self.enabled, self.why_not = False, str(err).split("; ")[0]
        return self.enabled

    def all(self) -> tuple:
        """Every weight's panels, in order (copied on first use, as `__call__` copies them), or
        None where they do not fit in free memory."""
        if not self.fits():
            return None
        for i, w in enumerate(self.weights):
            if i not in self.packed:
                self.packed[i] = cpu_kernels.pack_panels(w.numpy())
        return tuple(self.packed[i] for i in range(len(self.weights)))

    def __call__(self, i: int, x: np.ndarray) -> np.ndarray:
        """x [B, in] @ weights[i].T -> [B, out] fp32 (a view of a padded result)."""
        panels = self.packed.get(i)
        if panels is None:
            panels = self.packed[i] = cpu_kernels.pack_panels(self.weights[i].numpy())
        rows, step = x.shape[0], min(cpu_kernels.PANEL_TILE_ROWS)
        padded = x  # as it is where it can be (4, 8, 12, ... rows), else a zero-padded copy
        if rows % step or x.dtype != np.float32 or not x.flags.c_contiguous:
            padded = np.zeros((-(-rows // step) * step, x.shape[1]), np.float32)
            padded[:rows] = x
        out = np.empty((padded.shape[0], panels.shape[0] * cpu_kernels.PANEL_COLUMNS), np.float32)
        cpu_kernels.panel_linear_on_cores(padded, panels, out, min(CORES, MAX_WORKERS))
        return out[:rows, :self.weights[i].shape[0]]


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
    """`cpu_kernels.few_rows_linear` over a contiguous [out, in] copy of each weight, and on a CPU
    with AVX-512 the panel product from `PANEL_MIN_ROWS` rows (`Panels`)."""

    name = "numba"

    def __init__(self, weights, reason):
        self.weights = [np.ascontiguousarray(w.detach().numpy()) for w in weights]  # [out, in]
        self.panels = Panels([w.detach() for w in weights])
        self.reason = reason + (f"; the panel product from {PANEL_MIN_ROWS} rows (AVX-512)"
                                if self.panels.enabled else "")

    def threads(self):
        """A context for the step's products: nothing to set (the kernel runs where it is called)."""
        return nullcontext()

    @property
    def panels_enabled(self) -> bool:
        """Whether the panel product (`Panels`) applies here."""
        return self.panels.enabled

    def all_panels(self, rows: int) -> tuple | None:
        """Every weight's panels where every product at `rows` rows is the panel product, else None."""
        if not all(self.panels.takes(i, rows) for i in range(len(self.weights))):
            return None
        return self.panels.all()

    def __call__(self, i: int, x: np.ndarray) -> np.ndarray:
        """x @ w.T: a small product on this thread (even numba's hand-off costs more than it
        saves), any other on every core through numba's own pool (`cpu_kernels.linear_on_cores`)."""
        if self.panels.takes(i, x.shape[0]) and self.panels.fits():
            return self.panels(i, x)
        w, x = self.weights[i], np.ascontiguousarray(x)
        out = np.empty((x.shape[0], w.shape[0]), np.float32)
        if w.nbytes >= STREAMED_MIN_BYTES and x.shape[0] in STREAMED_ROWS and CORES > 1:
            parts = min(CORES, MAX_WORKERS)
            shares = [_block(w.shape[0] // 4, p, parts) for p in range(parts)]  # in groups of 4 rows
            on_every_core(lambda p: cpu_kernels.tile_2x4_linear(
                x, w, out, 4 * shares[p].start, w.shape[0] if p == parts - 1 else 4 * shares[p].stop), parts)
        elif w.nbytes < NUMBA_SHARED_MIN_BYTES or CORES < 2:
            cpu_kernels.linear_columns(x, w, out, 0, w.shape[0])
        else:
            cpu_kernels.linear_on_cores(x, w, out, min(CORES, MAX_WORKERS))
        return out


class OneDnnProducts(_HandsFewRows):
    """numba's kernels for a few rows and for small weights, oneDNN's packed weights (one copy per
    weight of `ONEDNN_MIN_WEIGHT_BYTES` or more, packed for the batch sizes of the last steps as
    `MklProducts`) for `ONEDNN_MIN_ROWS` rows and more, on torch's threads. Measured on the 2-core
    EPYC (Zen 3) at S = 1,024, fastest of 40 steps: B = 16 in 7.3 ms (numba's products alone: 9.0
    ms), and with one other busy process 11.0 ms (numba's: 15.3 ms). Splitting the head into
    per-thread blocks on the lab's Python pool was slower idle (9.6 ms) and no better busy.

    With AVX-512 (`Panels.available`), up to `ONEDNN_FEW_ROWS` rows go to numba's products with the
    panel product instead, as `MklProducts` hands them: the whole step is then one numba call (`cpu_step`)."""

    name = "onednn"
    few_rows = ONEDNN_FEW_ROWS  # up to this many rows numba's panel product, where it applies

    def __init__(self, weights, reason):
        self.few = NumbaProducts(weights, reason)
        self.weights = [torch.from_numpy(w) for w in self.few.weights]  # [out, in], contiguous
        self.reason = reason + self._few_reason()
        self.packed = [packed(self.name, w.nbytes) for w in self.few.weights]  # per product: by oneDNN?
        self.packs = PacksByRows(self._pack)  # batch size -> packed weight per product (None: numba's)

    def threads(self):
        """A context for the step's products: torch (oneDNN) on every core, numba's on its own pool."""
        return _TorchThreads(min(CORES, MAX_WORKERS))

    def _pack(self, rows: int) -> list:
        """Per weight, its oneDNN pack for `rows` rows, or None where numba's kernel multiplies it."""
        return [torch.ops.mkldnn._reorder_linear_weight(w, rows) if big else None
                for w, big in zip(self.weights, self.packed)]

    def __call__(self, i: int, x: np.ndarray) -> np.ndarray:
        rows = x.shape[0]
        if rows < ONEDNN_MIN_ROWS or not self.packed[i] or self.hands_over(rows):
            return self.few(i, x)
        xt = torch.from_numpy(np.ascontiguousarray(x))
        return torch.ops.mkldnn._linear_pointwise(xt, self.packs[rows][i], None, "none", [], "").numpy()


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
