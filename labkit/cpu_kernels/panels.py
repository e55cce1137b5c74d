"""The panel product, on a CPU with AVX-512 or AVX2: a weight repacked once into panels of 16
output columns, each [K, 16] contiguous, multiplied by register tiles whose sums stay in vector
registers for the whole K loop.

What you learn here: with 32 vector registers of 16 fp32 (AVX-512), a tile of 16 rows x 16 columns
keeps all its sums in registers from k = 0 to K - 1 (no reduction across a vector's lanes at the
end), one vector load of the panel's row k feeding one FMA per row of the tile. AVX2 has 16
registers of 8 fp32: a row's 16 sums take two of them, so its tiles are 4 rows (8 registers of
sums, 2 of the panel's row, 1 broadcast). The tile asks for the panels ahead as it goes, so a
weight that streams from memory (the LM head) keeps streaming while the tile multiplies, and it
reads x transposed, so a tile's values of x at each k lie side by side. The tile is written as
LLVM IR (numba gives no vector types); `cpu_linear` chooses it where `panels_in_registers`.

Shapes: x [B, K], B a multiple of 4 (callers pad with zero rows); panels [P, K, 16]
(`pack_panels`); out [B, 16 P].
"""
from __future__ import annotations

import numpy as np

from ._jit import AVAILABLE, host_features, keep_builds_current

# `panel_linear`: output columns per panel (one 512-bit vector of fp32), rows per register tile (16
# sums of 16 lanes fill half of AVX-512's 32 vector registers; 8, then 4, for the rows past the last
# 16: a batch of 4 as one 4-row tile, not padded to 8, took half the FMAs and no padded copy), and
# how many panels ahead a tile asks for, into the L2 (16 KiB each at K = 256: 64 KiB ahead).
# From 8 rows on, a tile spans two adjacent panels (PANEL_PAIR_ROWS rows of 8, then 4, x 32
# columns): each broadcast of x then feeds two FMAs, so a step of K loads 10 values for 16 FMAs
# where the 16-row tile of one panel loaded 17. One core, K = 256, 32 rows: 197-201 -> 217-226
# GFLOP/s (N = 49,152 and 2,048); lab-cpu's head at 32 rows on 2 cores 2.16-2.40 -> 1.91-1.98 ms, at
# 64 rows 4.75-5.12 -> 3.90-4.00 (2-core EPYC VM, Zen 5). Each output still sums its K products in
# the same order, so the results are the same bits. Below 8 rows the single panels stay: streaming
# two panels at once, the 49,152-column head at 4 rows took 1.39-1.42 ms on one core against 1.11-1.16.
PANEL_COLUMNS, PANEL_TILE_ROWS, PANEL_PREFETCH_AHEAD = 16, (16, 8, 4), 4
PANEL_PAIR_ROWS = (8, 4)


def pack_panels(w):
    """w [N, K] (a linear's [out, in] weight, any strides) -> panels [ceil(N / 16), K, 16] fp32,
    C-contiguous: panel p holds output columns 16 p .. 16 p + 15, row k their weights for input k
    (columns past N are zeros). The layout `panel_linear` streams: each panel one contiguous run."""
    N, K = w.shape
    padded = np.zeros((-(-N // PANEL_COLUMNS) * PANEL_COLUMNS, K), np.float32)
    padded[:N] = w
    return np.ascontiguousarray(padded.reshape(-1, PANEL_COLUMNS, K).transpose(0, 2, 1))


def panels_in_registers() -> bool:
    """Whether a panel tile's sums fit in this CPU's vector registers: AVX-512's 32 of 16 fp32
    (every tile, `wide_tiles`) or AVX2's 16 of 8 with FMA (4-row tiles). Elsewhere (an ARM CPU's
    NEON, an x86 without AVX2) the sums would spill to memory, so the panel product is chosen only
    here (`cpu_linear`); it is right everywhere (tested)."""
    features = host_features()
    return "+avx512f" in features or {"+avx2", "+fma"} <= features


def wide_tiles() -> bool:
    """Whether the tiles of 8 and 16 rows and the two-panel tiles fit (AVX-512); with AVX2 only the
    4-row tile does: 8 rows of a 16-column panel take all 16 of its registers for their sums alone.
    lab-cpu's head and gate/up products on 2 cores, AVX2 code on the Zen 5 (numba's target haswell,
    AVX-512 hidden from the lab; no AVX2-only CPU was at hand), fastest of 30, at 8-32 rows: every
    tile 132-152 GFLOP/s, 4-row tiles only 223-241 (the calibrated AVX2 peak 257); the 49,152 x 256
    head at 16 rows 2.76 -> 1.67 ms, where numba's 2 x 4 tile took 2.84 and oneDNN's packed weight 2.54."""
    return "+avx512f" in host_features()


if AVAILABLE:
    import numba
    from llvmlite import ir
    from numba.core import cgutils, types
    from numba.extending import intrinsic

    from ._jit import loop_back, prefetch_flags, prefetch_ir, splat

    # ---- the panel product: x [B, K] (B a multiple of 4) @ panels [P, K, 16] -> out [B, 16 P]. Every
    # step of K is one vector load of the panel's row k, then per row of the tile a broadcast of xt[k, b]
    # and one FMA into that row's 16 sums, which live in registers from k = 0 to K - 1 (an LLVM loop
    # written out below: numba gives no vector types). One line of the panel PANEL_PREFETCH_AHEAD ahead
    # is asked for per step of K, so the weight streams in while the tile multiplies.

    def _panel_tile_codegen(rows, width):
        def codegen(context, builder, signature, args):
            xt_type, _, panels_type, _, _, out_type = signature.args
            xt, panels, out = (context.make_array(t)(context, builder, a)
                               for t, a in ((xt_type, args[0]), (panels_type, args[2]), (out_type, args[5])))
            i64, f32 = ir.IntType(64), ir.FloatType()
            vector = ir.VectorType(f32, PANEL_COLUMNS)
            first_row, panel, last = (context.cast(builder, args[i], signature.args[i], types.intp) for i in (1, 3, 4))
            K, rows_in_x = cgutils.unpack_tuple(builder, xt.shape, 2)
            _, N = cgutils.unpack_tuple(builder, out.shape, 2)
            panel_values = builder.mul(K, i64(PANEL_COLUMNS))
            x_rows = builder.gep(xt.data, [first_row])  # xt[0, first_row]
            weights, fetched = [], []  # per panel of the tile: panels[panel + c, 0, 0], and the one asked for ahead
            for c in range(width):
                weights.append(builder.gep(panels.data, [builder.mul(builder.add(panel, i64(c)), panel_values)]))
                ahead = builder.add(panel, i64(PANEL_PREFETCH_AHEAD + c))
                ahead = builder.select(builder.icmp_signed("<", ahead, last), ahead, last)  # never past `last`
                fetched.append(builder.gep(panels.data, [builder.mul(ahead, panel_values)]))
            byte, prefetch = ir.IntType(8).as_pointer(), prefetch_ir(builder)
            fma = cgutils.get_or_insert_function(builder.module, ir.FunctionType(
                vector, [vector, vector, vector]), f"llvm.fmuladd.v{PANEL_COLUMNS}f32")
            entry = builder.block
            loop, done = builder.append_basic_block("panel_k"), builder.append_basic_block("panel_done")
            builder.branch(loop)
            builder.position_at_end(loop)
            k = builder.phi(i64)
            k.add_incoming(i64(0), entry)
            sums = []  # [rows * width]: row r's sums for panel c at r * width + c
            for _ in range(rows * width):  # the tile's sums: zeros on entry, the last step's on every other
                phi = builder.phi(vector)
                phi.add_incoming(ir.Constant(vector, None), entry)
                sums.append(phi)
            offset = builder.mul(k, i64(PANEL_COLUMNS))
            w = [builder.load(builder.bitcast(builder.gep(start, [offset]), vector.as_pointer()), align=4)
                 for start in weights]
            # locality 2: into the L2 and L3, not the L1 (the LM head at 16 rows from DRAM, fastest of 12
            # alternating: 2.52 ms against 2.73 into the L1; from the L3 the same)
            for start in fetched:
                builder.call(prefetch, [builder.bitcast(builder.gep(start, [offset]), byte), *prefetch_flags(2)])
            new = []
            x_step = builder.gep(x_rows, [builder.mul(k, rows_in_x)])  # xt[k, first_row]: the tile's x, adjacent
            for r in range(rows):
                value = splat(builder, builder.load(builder.gep(x_step, [i64(r)])), PANEL_COLUMNS)
                new.extend(builder.call(fma, [value, w[c], sums[r * width + c]]) for c in range(width))
            loop_back(builder, k, K, sums, new, loop, done)
            for r in range(rows):
                row = builder.add(first_row, i64(r))
                for c in range(width):
                    column = builder.mul(builder.add(panel, i64(c)), i64(PANEL_COLUMNS))
                    target = builder.gep(out.data, [builder.add(builder.mul(row, N), column)])
                    builder.store(new[r * width + c], builder.bitcast(target, vector.as_pointer()), align=4)
            return context.get_dummy_value()
        return codegen

    def _panel_tile_for(rows, width=1):
        """The tile of `rows` rows and `width` adjacent panels: out[first_row : first_row + rows,
        16 panel : 16 (panel + width)] = those rows of x @ the panels; xt [K, B] (x transposed),
        panels [P, K, 16], out [B, 16 P], fp32 C-contiguous."""
        def typer(typingctx, xt, first_row, panels, panel, last, out):
            if not all(isinstance(a, types.Array) and a.dtype == types.float32 and a.layout == "C" and a.ndim == n
                       for a, n in ((xt, 2), (panels, 3), (out, 2))):
                return None
            return types.none(xt, first_row, panels, panel, last, out), _panel_tile_codegen(rows, width)
        return intrinsic(typer)

    _panel_tile_16, _panel_tile_8, _panel_tile_4 = (_panel_tile_for(rows) for rows in PANEL_TILE_ROWS)
    _pair_tile_8, _pair_tile_4 = (_panel_tile_for(rows, 2) for rows in PANEL_PAIR_ROWS)

    # Read once, when the kernels below compile: a constant in them (numba's cached builds are
    # kept per CPU model and features, so a build never meets another CPU's registers).
    WIDE_TILES = wide_tiles()

    @numba.njit(nogil=True, fastmath=True, cache=True)
    def _panel_linear_t(xt, panels, out, first, stop, wide):
        """`panel_linear` for x given transposed, xt [K, B] C-contiguous; `wide`: every tile
        (AVX-512), else 4-row tiles of one panel only (AVX2)."""
        B = xt.shape[1]
        panel = first
        if not wide:
            for panel in range(first, stop):  # the panel (16 KiB at K = 256) stays in L1 between tiles
                row = 0
                while row < B:
                    _panel_tile_4(xt, row, panels, panel, stop - 1, out)
                    row += 4
            return
        while B >= PANEL_PAIR_ROWS[0] and panel + 2 <= stop:  # two panels a tile
            row = 0
            while row + 8 <= B:
                _pair_tile_8(xt, row, panels, panel, stop - 1, out)
                row += 8
            if row < B:
                _pair_tile_4(xt, row, panels, panel, stop - 1, out)
            panel += 2
        for panel in range(panel, stop):  # one panel a tile: below 8 rows, and an odd last panel
            row = 0
            while row + 16 <= B:
                _panel_tile_16(xt, row, panels, panel, stop - 1, out)
                row += 16
            if row + 8 <= B:
                _panel_tile_8(xt, row, panels, panel, stop - 1, out)
                row += 8
            if row < B:
                _panel_tile_4(xt, row, panels, panel, stop - 1, out)

    @numba.njit(nogil=True, fastmath=True, cache=True)
    def panel_linear(x, panels, out, first, stop):
        """out[:, 16 first : 16 stop] of x [B, K] @ panels [P, K, 16] (`pack_panels`), B a multiple of
        4 (callers pad x with zero rows), out [B, 16 P]: panels `first` .. `stop` - 1. From 8 rows
        on, two panels at a time, met by tiles of 8 rows and one of 4 as the rest needs (`PANEL_PAIR_ROWS`);
        below 8 rows, and for an odd last panel, one panel at a time, met by tiles of 16 rows, then
        one of 8 and one of 4; with AVX2 (`WIDE_TILES` false) one panel at a time met by 4-row tiles.
        The panels (16 KiB each at K = 256) stay in L1 between the tiles. x, panels, out fp32 and
        C-contiguous.

        The tile reads x transposed (a copy, [K, B]): its rows' x[b, k] are then adjacent, each
        broadcast a fixed offset from one pointer that moves once per k. Read in place, each row's
        address took a scalar add per FMA on the ports the FMAs use. One core, 16 or 32 rows, N = 2,048
        to 49,152 at K = 256: 158-177 GFLOP/s read in place, 175-190 transposed (the FMA peak ~218);
        lab-cpu's head at 32 rows on 2 cores 2.46 -> 2.14 ms (2-core Xeon VM)."""
        _panel_linear_t(np.ascontiguousarray(x.T), panels, out, first, stop, WIDE_TILES)

    @numba.njit(nogil=True, fastmath=True, parallel=True, cache=True)
    def panel_linear_on_cores(x, panels, out, parts):
        """`panel_linear` over all P panels in `parts` near-equal shares, one per numba thread (x
        transposed once, for all of them).

        What sharing costs: the copy is written by this thread, and both threads then read it
        from each other's caches. lab-cpu's o projection (N = 256) at 16 rows: each thread's half
        took 9.1 us with a copy made just before, 5.8 with one made long before (and 5.7 on one
        thread alone). A copy per thread, made inside the parallel region, was no faster in a
        chain of 16 products (-0.6 to +0.9 us a product up to 16 rows, slower at 32): the
        activations cross between the cores either way (2-core Xeon VM)."""
        P = panels.shape[0]
        xt = np.ascontiguousarray(x.T)
        for p in numba.prange(parts):  # shares of whole pairs of panels; the last takes an odd one
            first = (P * p // parts) // 2 * 2
            stop = P if p == parts - 1 else (P * (p + 1) // parts) // 2 * 2
            _panel_linear_t(xt, panels, out, first, stop, WIDE_TILES)

    keep_builds_current(globals())
