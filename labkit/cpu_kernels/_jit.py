"""What every CPU kernel file builds on: numba's imports (and `AVAILABLE`, whether it installed),
the CPU's features, bit reinterpretations and prefetches as numba intrinsics, the few LLVM IR
helpers the vector kernels are written with (numba gives no vector types), a vectorisable exp,
and the check that drops numba's cached builds made with other kernels.

Why the last: numba keys a cached build by its own file only, but a build holds every kernel it
calls compiled into it. After one file of this package changed (a `git pull`, an edit), a cached
build in another file kept running the old code (seen: an edited panel product left the one-call
step's time unchanged) while freshly compiled callers ran the new one. So every cached build here,
and `cpu_step`'s, is dropped unless the mark beside it says it was made with these sources
(`keep_builds_current`).

On import, before any kernel is defined, it copies the builds made at setup to where numba will keep
this package's builds, where that is not beside these files (`_installed_builds`: a learner who
cannot write to a shared install).
"""
from __future__ import annotations

import functools
import hashlib
from pathlib import Path

import numpy as np

try:
    import numba
    from llvmlite import binding, ir
    from numba.core import caching, cgutils, types
    from numba.extending import intrinsic
except ImportError:  # the core installs without numba (a GPU image): the CPU step keeps numpy's path
    numba = None

AVAILABLE = numba is not None

if AVAILABLE:  # before any kernel here is defined: numba picks each one's cache folder as it decorates it
    from ._installed_builds import seed_from_install
    seed_from_install([Path(__file__).parent])


@functools.lru_cache(maxsize=1)
def host_features() -> frozenset[str]:
    """This CPU's features as LLVM names them ("+avx512f", ...); empty without numba."""
    if not AVAILABLE:
        return frozenset()
    return frozenset(binding.get_host_cpu_features().flatten().split(","))


@functools.lru_cache(maxsize=None)
def sources_digest(folder: Path = Path(__file__).parent) -> str:
    """A hash of the sources in `folder` (this package's, by default): the kernels every cached
    build here was made with."""
    digest = hashlib.sha256()
    for path in sorted(folder.glob("*.py")):
        digest.update(path.name.encode() + b"\0" + path.read_bytes())
    return digest.hexdigest()


def drop_stale_builds(folder: Path, index_name: str, kernels_digest: str) -> bool:
    """Delete numba's cached builds of one function (`index_name`, its .nbi, and its .nbc files in
    `folder`) unless the mark beside them says they were made with the kernels whose sources hash
    to `kernels_digest`; then write that mark. True if builds were dropped (see the module docstring)."""
    mark = folder / f"{index_name}.kernels"
    try:
        if mark.read_text() == kernels_digest:
            return False
    except OSError:
        pass
    stem = index_name.removesuffix(".nbi")
    dropped = False
    try:
        for path in folder.glob(f"{stem}.*"):
            if path.suffix in (".nbi", ".nbc"):
                path.unlink(missing_ok=True)
                dropped = True
        mark.write_text(kernels_digest)
    except OSError:  # a read-only install: numba itself then caches elsewhere or not at all
        pass
    return dropped


def keep_builds_current(namespace: dict) -> None:
    """`drop_stale_builds` for every function defined in `namespace` (a module's globals) that numba
    caches on disk, against `sources_digest`; the kernels it imports are its own modules' to check."""
    for dispatcher in list(namespace.values()):
        # numba 0.68's FunctionCache (a change of numba that moves it fails a test)
        cache = getattr(dispatcher, "_cache", None)
        defined_here = getattr(getattr(dispatcher, "py_func", None), "__module__", None) == namespace.get("__name__")
        if defined_here and isinstance(cache, caching.FunctionCache):
            drop_stale_builds(Path(cache._cache_path), cache._cache_file._index_name, sources_digest())


if AVAILABLE:
    @intrinsic
    def bits_as_float32(typingctx, bits):
        """The fp32 whose bits are the low 32 bits of the integer `bits` (a register
        reinterpretation; numba widens integer arithmetic to 64 bits, so the high half is dropped)."""
        if not isinstance(bits, types.Integer) or bits.bitwidth < 32:
            return None

        def codegen(context, builder, signature, args):
            low = args[0] if bits.bitwidth == 32 else builder.trunc(args[0], ir.IntType(32))
            return builder.bitcast(low, ir.FloatType())
        return types.float32(bits), codegen

    @intrinsic
    def half_bits_as_float32(typingctx, bits):
        """The fp32 value of the fp16 whose bits are the low 16 bits of the integer `bits`."""
        if not isinstance(bits, types.Integer) or bits.bitwidth < 16:
            return None

        def codegen(context, builder, signature, args):
            low = args[0] if bits.bitwidth == 16 else builder.trunc(args[0], ir.IntType(16))
            return builder.fpext(builder.bitcast(low, ir.HalfType()), ir.FloatType())
        return types.float32(bits), codegen

    @intrinsic
    def prefetch(typingctx, array, row, col):
        """Ask the CPU to bring the cache line of array[row, col] (a 2-D array) in; no effect on
        results (LLVM's prefetch: a read, kept in every cache level)."""
        if not isinstance(array, types.Array) or array.ndim != 2:
            return None

        def codegen(context, builder, signature, args):
            array_type = signature.args[0]
            data = context.make_array(array_type)(context, builder, args[0])
            index = [context.cast(builder, value, ty, types.intp) for value, ty in zip(args[1:], signature.args[1:])]
            pointer = cgutils.get_item_pointer(context, builder, array_type, data, index, wraparound=False)
            builder.call(prefetch_ir(builder), [builder.bitcast(pointer, ir.IntType(8).as_pointer()), *prefetch_flags(3)])
            return context.get_dummy_value()
        return types.none(array, row, col), codegen

    def prefetch_ir(builder):
        """LLVM's prefetch, declared in the builder's module: call it with an i8* and `prefetch_flags`."""
        i32 = ir.IntType(32)
        return cgutils.get_or_insert_function(builder.module, ir.FunctionType(
            ir.VoidType(), [ir.IntType(8).as_pointer(), i32, i32, i32]), "llvm.prefetch.p0")

    def prefetch_flags(locality):
        """`prefetch_ir`'s arguments after the address: a read, kept at `locality` (3: every cache
        level; 2: the L2 and L3, not the L1), of data."""
        i32 = ir.IntType(32)
        return i32(0), i32(locality), i32(1)

    def splat(builder, value, lanes):
        """The scalar `value` (a float, an i32, ...) in every lane of a <lanes x its type> vector."""
        vector = ir.VectorType(value.type, lanes)
        first = builder.insert_element(ir.Constant(vector, ir.Undefined), value, ir.IntType(32)(0))
        return builder.shuffle_vector(first, ir.Constant(vector, ir.Undefined),
                                      ir.Constant(ir.VectorType(ir.IntType(32), lanes), [0] * lanes))

    def loop_open(builder, first, stop, name, starts):
        """Open a one-block loop over counter = first, .. < stop (none if first >= stop), carrying
        sums that start as `starts` (vectors): (entry, loop, done, counter, the sums' phis), the
        builder inside the loop; `loop_back` closes it."""
        entry = builder.block
        loop, done = builder.append_basic_block(name), builder.append_basic_block(f"{name}_done")
        builder.cbranch(builder.icmp_signed("<", first, stop), loop, done)
        builder.position_at_end(loop)
        counter = builder.phi(ir.IntType(64))
        counter.add_incoming(first, entry)
        phis = []
        for start in starts:
            phi = builder.phi(start.type)
            phi.add_incoming(start, entry)
            phis.append(phi)
        return entry, loop, done, counter, phis

    def loop_back(builder, counter, bound, phis, values, loop, done, step=1):
        """Close a one-block loop: counter + step and `values` flow back into `counter` and `phis`;
        on to `done` once counter + step reaches `bound`."""
        following = builder.add(counter, ir.IntType(64)(step))
        counter.add_incoming(following, loop)
        for phi, value in zip(phis, values):
            phi.add_incoming(value, loop)
        builder.cbranch(builder.icmp_signed("<", following, bound), loop, done)
        builder.position_at_end(done)

    def shuffle(builder, a, b, lanes):
        return builder.shuffle_vector(a, b, ir.Constant(ir.VectorType(ir.IntType(32), len(lanes)), lanes))

    def row_bytes(builder, array, row):
        """An i8* to row `row` of a [rows, dh] array whose rows are contiguous (any row stride)."""
        stride = cgutils.unpack_tuple(builder, array.strides, 2)[0]
        return builder.gep(builder.bitcast(array.data, ir.IntType(8).as_pointer()), [builder.mul(row, stride)])

    def load_row(builder, array, row, dh, element):
        """Row `row` of a [rows, dh] array (its rows contiguous) as one <dh x element> vector."""
        pointer = row_bytes(builder, array, row)
        return builder.load(builder.bitcast(pointer, ir.VectorType(element, dh).as_pointer()), align=1)

    @intrinsic
    def float32_bits(typingctx, value):
        """The bits of an fp32 as a uint32."""
        if value != types.float32:
            return None

        def codegen(context, builder, signature, args):
            return builder.bitcast(args[0], ir.IntType(32))
        return types.uint32(value), codegen

    @numba.njit(fastmath=True, cache=True)
    def exp_nonpositive(x):
        """exp(x) for x <= 0 in fp32, written out so that LLVM vectorises it (numba calls libm's
        scalar exp otherwise): x = n ln2 + r with |r| <= ln2 / 2, exp(r) by its Taylor series to
        r^7 (error < 2e-7 relative), times 2^n built in the exponent bits; below -87 it is 0."""
        x = max(x, np.float32(-87.0))
        n = np.floor(x * np.float32(1.4426950408889634) + np.float32(0.5))
        r = x - n * np.float32(0.693359375) + n * np.float32(2.12194440e-4)  # ln2 in two parts
        p = np.float32(1.0 / 5040)
        p = p * r + np.float32(1.0 / 720)
        p = p * r + np.float32(1.0 / 120)
        p = p * r + np.float32(1.0 / 24)
        p = p * r + np.float32(1.0 / 6)
        p = p * r + np.float32(0.5)
        p = p * r + np.float32(1.0)
        p = p * r + np.float32(1.0)
        return p * bits_as_float32((np.int32(n) + np.int32(127)) << np.int32(23))


    keep_builds_current(globals())
