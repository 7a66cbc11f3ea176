"""Plan and launch the kernels on CuPy arrays.

This module is the one place that decides launch geometry: :func:`row_geometry` maps a row onto
threads, :func:`plan_fwd` / :func:`plan_bwd` add the grid, and :func:`all_kernel_names` lists
every kernel they can choose (the compile tests build each). Nothing here synchronizes with
the host: every launch goes on the current stream, so calls can be captured in a CUDA graph.
"""

from __future__ import annotations

import functools
import math
from typing import NamedTuple

import cupy as cp
import numpy as np

from . import _compile, _driver
from ._compile import ACC_DTYPES, Spec
from ._driver import Launcher
from .api import BFLOAT16, FLOAT16, FLOAT32, FLOAT64, _param_dtype, _span

# Geometry constants (see row_geometry).
# Forward: 4 vectors per thread in flight; blocks of one row unless rows are short (measured on
# the H200 with benchmarks/tune.py: stacking long rows in one block costs 5-15%).
FWD_NPT_MIN, FWD_NPT, FWD_TPR_MAX, FWD_BLOCK = 4, 4, 1024, 128
# Rows of at most a warp are stacked in blocks of FWD_SHORT_BLOCK threads. S13-4 (tune.py, us,
# means of four interleaved rounds, 128 / 256): 4096x1024 f16 9.90 / 9.68, bf16 9.95 / 9.65,
# RMSNorm 9.65 / 9.43, RMSNorm 131072x64 14.40 / 14.28; 8192x768 13.13 / 13.13, LayerNorm
# 131072x64 14.90 / 14.95 (S13-3: 512 as 256, 1024 slower on every short-row shape).
FWD_SHORT_BLOCK = 256
# Forward with small M (one vector per thread fills at most FWD_SMALL_M_FILL of the GPU's thread
# slots): one vector per thread, so rows get more threads and each thread a shorter chain, and
# the kernel loads gamma/beta with the row, before its reductions (NPT = 1). Nsight Compute kernel
# durations (S4-3, small_kernels.py), on / off: 32x512 f16 4.77 / 5.44 us, 96x768 f16 4.54 /
# 5.66, 192x1024 bf16 4.99 / 5.89, RMSNorm 32x512 3.65 / 5.09; at 1024x768 (36% of the slots)
# 5.76 / 5.73, and 7.3 / 6.8 us in event time (tune.py), hence a quarter then. Since gamma/beta
# load with the row (S5-2, tune.py): 1024x768 (36% of the slots) 6.3 us with the limit at all
# slots (FWD_SMALL_M_FILL = 1) against 6.9 at a quarter, the other tuned shapes within 0.2 us;
# at 4 (4096x1024 f16, f32 too) 11.0 / 16.6 us against 10.8 / 15.6.
# (Narrower vectors there, for 128 threads per row, made no difference: S5-2, within 0.1 us;
# S11-1, 8-byte vectors against 16, us: 32x512 f16 4.95 / 4.85, RMSNorm 4.75 / 4.6, 192x1024
# bf16 5.5 / 5.35, 1024x768 f16 6.35 / 6.0, 96x768 f16 5.1 / 5.1.)
# FWD_SMALL_NPT: vectors per thread on that path (tuning): rows in one warp with 2 or 4, so
# without a barrier, were slower (S9-1, tune.py: 32x512 f16 5.8 / 6.6 us against 5.1).
FWD_SMALL_M, FWD_SMALL_M_FILL, FWD_SMALL_NPT = True, 1.0, 1
# One vector per thread for any M where such a row fits in a warp (S5-5/S5-6 tune, 131072x64
# f16: RMSNorm 14.8 -> 14.4 us, LayerNorm 15.6 -> 15.0; the others unchanged).
# The forward grid's cap in blocks per SM (rows past it loop in the blocks): 64 had 131072x4096
# bf16 blocks loop over ~16 rows each; at 1024 (one block per rows-of-a-block on every shape of
# the benchmark) RMSNorm takes 521.3 us instead of 556.7, LayerNorm 534.9 instead of 556.7
# (S5-6; 256: 532.8 / 534.9; two rows per 256-thread block at cap 256: 521.9 / 539.6).
FWD_SHORT_NPT1, FWD_GRID_PER_SM = True, 1024
# Staged forward rows (cp.async, as BWD_STAGE below; a grid of the resident blocks, each looping
# over rows). "auto" stages where only one block of the direct kernel fits on an SM, so no other
# block's loads overlap its reductions: 4096x32768 f16 150.0 us against 172.7 direct. Where
# several fit, blocks overlap one another and the direct kernel's one-row blocks were faster
# (S7-1, tune.py, staged / direct: 4096x16384 f16 84.2 / 79.7 us, 16384x8192 bf16 155.6 /
# 144.6, 131072x4096 bf16 607.1 / 534.7). Two buffers (the next row's copy starts before this
# row's has landed): one or three were slower for LayerNorm at 4096x32768 f16 (S29-1: one
# 152.1 / 148.4 us; S29-2 and S18-2: three 150.9 / 147.6). "always" / "never": tests, tuning.
FWD_STAGE = "auto"
# Forward of several vectors per thread: gamma/beta loaded with the row, before the
# reductions (the "fwd_early" kernel), for 4-byte and wider types. S10-3 (tune.py, us, means of
# two, after the reductions / with the row; f32 LayerNorm unless said): 4096x1024 (1.9 waves)
# 15.1 / 13.6, 32768x1024 (15.5) 72.7 / 70.6, 65536x1024 (31) 136.4 / 134.7, 8192x4096 (15.5)
# 70.9 / 69.5, 16384x8192 (62) 273.8 / 273.7, RMSNorm 65536x1024 135.5 / 134.5. Not for 2-byte
# types, whose held packs spill (S10-1: 4096x1024 f16 10.3 / 12.1, bf16 10.5 / 12.9, 4096x2048
# f16 15.9 / 19.1, 16384x8192 bf16 144.7 / 216.5). False: never (tests, tuning).
FWD_EARLY = True
# LayerNorm rows whose length N is a multiple of the block's chunk (threads per row x vectors per
# thread x vector width: every thread's vectors lie in the row) run a variant of the direct
# kernels without the per-vector column tests (loads, the centred pass, stores): "_full". S12-9
# (tune.py, us, two rounds, with the tests / without): 4096x4096 f16 24.3, 24.3 / 23.6, 23.9,
# 4096x2048 f16 16.1, 15.6 / 15.0, 15.1, 4096x1024 f16 10.2, 10.2 / 9.7, 9.9, 4096x1024 f32
# 14.1, 14.0 / 13.6, 13.7, 16384x8192 bf16 145.2, 145.0 / 137.9, 137.8, 131072x4096 bf16 532.6,
# 533.2 / 516.8, 517.2. Not for RMSNorm (no centred pass): 16384x8192 bf16 134.5, 134.1 / 135.4,
# 135.4. False: never (tests, tuning).
FWD_FULL = True
# Forward rows of one chunk whose threads make FWD_FIXED_WARPS warps reduce with those threads
# fixed at compile time (Spec.tpr, a template argument of norm_fwd: a module per width), so the
# reductions' branches and the cross-warp butterfly's trip count are constants. S19-3 (tune.py,
# us, three rounds, blockDim.x / fixed): LN 16384x8192 bf16 (8 warps) 137.3, 137.6, 137.2 /
# 135.6, 136.0, 136.1; RMSNorm 135.2, 134.7, 135.3 / 135.5, 136.0, 135.3; LN 4096x16384 f16 (16
# warps) 75.2, 75.1, 75.0 / 74.1, 74.3, 74.1; RMSNorm 73.4, 73.3, 73.4 / 72.1, 72.2, 72.3. At 4
# warps LN 131072x4096 bf16 lost (520.0, 519.6, 520.0 / 522.8, 522.5, 523.6). S20-1, 32 warps
# (the staged LN 4096x32768 f16): 147.6, 148.0 / 146.9, 146.6. Rows of a warp or less and the
# small-M rows of 2-4 warps lost or gained nothing (S20-1: RMSNorm 131072x64 f16 14.1 / 15.1 us,
# 42 registers instead of 32; 32x512 to 1024x768 within 0.05 us). The widths are few so that
# every specialization is compiled by the offline checks. (): never (tests, tuning).
FWD_FIXED_WARPS = (8, 16, 32)
# Small-M rows of one vector of 16 bytes per thread, in one block of at most FWD_ROW_WARPS warps
# (the grid covering M): norm_fwd_row, the row's threads fixed at compile time, no row loop,
# gamma, beta and x loaded first, together, and one output path (the general kernel's path was
# 253 instructions per warp at 32x512 f16 against Liger's 149: S19-1). S21-1 (tune.py, us, three
# rounds, general / norm_fwd_row): LN 32x512 f16 4.96, 5.07, 4.94 / 4.90, 4.93, 4.83; 96x768
# 5.36, 5.34, 5.41 / 5.14, 5.09, 5.10; 192x1024 bf16 5.50, 5.57, 5.55 / 5.41, 5.38, 5.36;
# 1024x768 6.18, 6.21, 6.19 / 5.97, 6.00, 5.98; RMSNorm 32x512 4.93, 4.93, 5.01 / 4.80, 4.82,
# 4.75; 300x2048 bf16 (8 warps) 6.00, 6.10, 6.02 / 5.84, 5.82, 5.81. 0: never (tests, tuning).
# FWD_ROW_SHORT: the same kernel for rows of at most a warp (one vector of 16 bytes per thread,
# blockDim.y rows per block, the grid covering M), whatever M: 183 instructions per warp against
# the general kernel's 284 at RMSNorm 131072x64 f16 (31 registers against 32). S22-1 (tune.py,
# us, three rounds, off / on): RMSNorm 131072x64 f16 14.34, 14.35, 14.30 / 14.02, 14.08, 14.02;
# LN 131072x64 15.71, 15.10, 15.12 / 14.58, 14.70, 14.72; 65536x128 f16 15.46, 15.36, 15.42 /
# 14.54, 14.72, 14.78; RMSNorm 131072x32 bf16 9.62, 9.54, 9.60 / 9.49, 9.50, 9.47; 262144x16 f32
# 14.38, 14.51, 14.38 / 14.24, 14.14, 14.24; 16384x256 bf16 9.73-9.78 / 9.57-9.76. Two rows per
# thread (S22-4: 40 registers for RMSNorm, 54 for LayerNorm) gained at most 1.7%; blocks of 128
# threads (FWD_SHORT_BLOCK) were as fast or slower, of 512 as fast. False: never (tests, tuning).
FWD_ROW_WARPS, FWD_ROW_SHORT = 8, True
# FWD_ROW_NPT_WARPS: the row kernel also takes rows of one chunk of several vectors per thread
# (FWD_NPT) in 2 to FWD_ROW_NPT_WARPS whole warps (within FWD_ROW_WARPS), whatever M, one row per
# block (stacked rows taken apart), the grid covering M: gamma and beta are then in flight with
# the row, and no row loop. S24-2 (tune.py, us, three rounds, general kernel / row kernel, the
# same vectors per thread; outputs bitwise equal): LN 4096x2048 f16 (2 rows of 2 warps per block
# before) 15.04, 14.85, 14.99 / 13.62, 13.50, 13.50; 16384x2048 bf16 39.44, 39.47, 39.17 / 37.42,
# 37.28, 37.63; 4096x4096 f16 (4 warps) 23.41, 23.17, 23.26 / 21.60, 21.65, 21.68; 4096x1024 f32
# 13.44, 13.38, 13.41 / 13.22, 13.31, 13.17; LN 131072x4096 bf16 517.2-517.6 / 516.8-517.1, RMSNorm
# 511.4-512.1 / 512.7-513.1. Rows of 8 warps lost (S24-1, 16384x8192 bf16 135.0-135.8 against
# 138.6-140.3: 80 registers against 64), as did 8 and 16 warps of fewer vectors at 131072x4096
# (552-608 us) and stacked rows of a warp (S24-2: 4096x1024 f16 9.5 against 11.7, spilling under
# the 1024-thread launch bound). 0: never (tests, tuning).
FWD_ROW_NPT_WARPS = 4
# Backward also holds dy and two partial sums per element: one vector per thread for rows of up
# to 512 threads, two for rows of up to 1024 vectors (longer rows take the column-tile path);
# rows stacked up to 512 threads, so fewer blocks flush dgamma/dbeta partials. With staged rows
# two vectors in 512 threads beat one in 1024 (S7-4, tune.py: 16384x8192 bf16 222.3 vs 249.4 us,
# RMSNorm 221.4 vs 238.0, 4096x8192 f16 68.5 vs 75.7, 1151x8192 f16 33.5 vs 32.8); before
# staging (kernel v8b) one in 1024 had been as fast or faster (306.7 vs 308.8 us).
BWD_NPT_MIN, BWD_NPT, BWD_TPR_MAX, BWD_BLOCK = 1, 2, 512, 512
# Small M: rows per block shrink until about BWD_SPREAD blocks per SM get work. Every backward
# block also adds a row of dgamma/dbeta partials for the second kernel to read; fewer, fuller
# blocks (1, 0.5, 0.25 per SM) made no consistent difference on the small shapes (tune.py, S3-9).
BWD_SPREAD = 2
# The backward grid is the resident blocks (each loops over rows): twice or four times as many
# blocks (more partial rows) was slower on every large shape (S5-7 tune: 4096x1024 f16 20.3 /
# 23.2 / 30.9 us, 131072x4096 bf16 1028.5 / 1032.1 / 1040.1 us).
# dgamma/dbeta flush of the backward blocks: float32 atomicAdd into one zeroed 2N vector (the
# last block casts it and zeroes it again: one kernel), or per-block partials summed in a fixed
# order by a second kernel. On the H200 the partials were faster on almost every shape (tune.py:
# 4096x1024 f16 26.6 vs 42.9 us, 1151x8192 f16 57 vs 95 us, 16384x8192 bf16 358 vs 397 us:
# same-address atomics from hundreds of blocks serialize in L2; S4-3, one kernel against two on
# the small shapes: 32x512 f16 15.8 vs 8.1 us, 192x1024 bf16 40.6 vs 14.2), so both modes use
# them; the atomic flush stays available and tested.
ATOMIC_FLUSH = False
# A backward grid of at most FUSED_REDUCE_BLOCKS blocks (its rows not spread, see BWD_SPREAD),
# whose threads are at least N (so each sums at most two columns), sums the blocks' partials in
# its last block (found by the atomic flush's ticket counter; the kernel variant "bwd_last"), in
# norm_bwd_reduce's order: one launch instead of two. That is host time (#5; hostprof S8-1/S8-2,
# 32x512 f16 backward: 10.6-14.7 us against 14.5-24.3 before, interleaved in one process), for
# about as much device time (tune.py S8-2, fused / two kernels: 32x512 f16 8.6 / 8.3 us, RMSNorm
# 7.6 / 7.4). Where the last block sums more columns per thread it costs more than the second
# launch on the GPU (S8-2: 8x1000 f16 9.6 / 8.0 us, 16x1024 f32 9.8 / 8.9, 8x8192 f16 28.6 /
# 11.5).
FUSED_REDUCE_BLOCKS = 8
# On sm_90, a backward whose rows fit in CSUM_BLOCKS blocks at once runs as one thread-block
# cluster of that many blocks (rows spread over all of them; CSUM_BLOCKS is a template argument
# of the kernel, "bwd_csum"), which sum dgamma/dbeta through distributed shared memory: no
# scratch, fence or ticket counter, and the column sums shared by all blocks instead of done by
# the last one. Deterministic (a fixed order per grid). Measured (tune.py S11-1/S11-2, us, this
# / without clusters): 32x512 f16 6.5 / 8.6 (last block), RMSNorm 6.0 / 7.7, 8x8192 f16 9.7 /
# 11.5-12.3, 16x1024 f32 6.8 / 7.8-8.4, 8x1000 f16 6.3 / 7.5-8.2 (last block), 64x1024 bf16 8.3 /
# 9.0, 128x512 f16 8.1 / 8.5 (two kernels). Blocks looping over two or more groups of rows (one
# at a time, direct loads) lost: 192x1024 bf16 11.8 / 9.9, 96x768 f16 9.6 / 8.9, 256x1024 f16
# 14.0 / 10.8. False: the paths above (tests, tuning).
CSUM_BLOCKS, BWD_CLUSTER_SUMS = 8, True
# Staged backward rows (cp.async, CUDA sm_80 on; kernels/common.cuh, stage_packs): a block's
# next row is copied into shared memory while it reduces this one. Measured on the H200 (S6-5,
# tune.py, staged / direct): 131072x4096 bf16 885.0 / 1022.5 us, RMSNorm 877.7 / 1042.5,
# 16384x8192 bf16 247.3 / 292.3, 4096x8192 f16 75.3 / 86.3, 4096x4096 f16 43.3 / 49.6. It does
# not pay where each block runs one row (S6-3: 96x768 f16 10.4 / 9.7 us) nor for rows within a
# warp, whose reductions need no barrier (S6-3: 131072x64 f16 27.0 / 25.2).
# "auto" stages where blocks loop over rows that span warps; "always" / "never" (tests, tuning)
# wherever it can / nowhere.
BWD_STAGE = "auto"
# Staged backward rows taken dynamically (a ticket counter; the "bwd_staged_dyn" kernel, the
# plan's launch["bwd_dyn"]; RowTickets in kernels/common.cuh) where dgamma/dbeta need not be
# bitwise repeatable (deterministic=False): which block sums which rows then depends on timing.
# S16-3 (tune.py, us, static / dynamic, two rounds): 16384x8192 bf16 222.3, 221.5 / 217.5,
# 218.4, RMSNorm 220.3, 218.8 / 214.4, 215.1, 131072x4096 872.7, 871.5 / 842.0, 841.8, 4096x8192
# f16 70.3, 69.2 / 68.0, 68.6. Rows within a warp (no block barrier per row) and grids of 2^31
# groups of rows or more keep static rows. Not the clusters, nor the staged forward: with the
# same tickets they were slower (S16-3: 4096x16384 clusters 123 -> 128 us, 4096x32768 240 ->
# 262, forward 149 -> 164, its 64 registers spilling). False: static rows (tests, tuning).
BWD_DYNAMIC = True
TILE_TPR, TILE_NPT = 256, 2  # long-row backward: threads of a column tile, vectors per thread
# Long-row backward on sm_90: thread-block clusters of CLUSTER_TILES column tiles (a template
# argument of the kernel: Spec.tiles) of CLUSTER_NPT vectors per thread, which add their tiles'
# row sums through distributed shared memory, so x and dy are read once instead of twice
# (norm_bwd_rowsums, then the tiles). BWD_CLUSTER = False: the row sums path everywhere (tests,
# tuning). Measured (S7-2/S7-3, tune.py, us; clusters of 4 x 2 vectors / 4 x 1 / 8 x 2 / row
# sums path): 4096x16384 f16 153.4 / 184.4 / 160.3 / 191.3, 4096x32768 f16 326.4 / 395.7 /
# 331.5 / 351.6.
# Since the tiles exchange their row sums without a cluster barrier per row (S9-6): 4096x16384
# f16 128.4 us, 4096x32768 f16 251.4. Then (S9-11, 4 x 2 / 8 x 2 / 2 x 2): 4096x16384 129.2 /
# 125.8 / 126.5, 4096x32768 251.6 / 248.2 / row sums path, 1151x16384 48.1 / 46.7 / 48.2; so 8
# (a row of up to 8 x 2 x 512 vectors in one cluster). Since each warp sends its sums to every
# tile, with no block barrier per row (S23-1, tune.py, us, three rounds, warp sums / block sums):
# 4096x16384 f16 120.3-121.4 / 121.7-122.9, 4096x32768 233.1-233.9 / 239.5-240.7, RMSNorm
# 4096x16384 117.6-119.3 / 118.3-119.6; 4 tiles then (S23-4, 8 / 4): 4096x16384 120.8-122.1 /
# 121.5-122.7, 4096x32768 233.2-234.5 / 241.3-242.5, RMSNorm 118.8-120.0 / 117.9-119.4.
CLUSTER_TILES, CLUSTER_NPT, BWD_CLUSTER = 8, 2, True
ROWSUMS_TPR = 1024


def _cdiv(a, b):
    return -(-a // b)


def _round_up(a, b):
    return _cdiv(a, b) * b


def _pow2_ceil(a):
    return 1 << (max(a, 1) - 1).bit_length()


class Geometry(NamedTuple):
    tpr: int  # threads per row (blockDim.x)
    npt: int  # vectors per thread per chunk
    rpb: int  # rows per block (blockDim.y)
    fits: bool  # the whole row is one chunk in registers


def row_geometry(nvec, warp, npt_min, npt_max, tpr_max, block, short_block=None):
    """How a row of ``nvec`` vectors maps onto threads.

    Each thread keeps ``npt`` independent vector loads in flight: the smallest power of two from
    ``npt_min`` that lets the row fit in ``tpr_max`` threads, at most ``npt_max``. The threads of
    a row are a power of two up to a warp (several rows then share a warp, reducing with
    shuffles only) or whole warps up to ``tpr_max``; rows longer than ``tpr_max * npt_max``
    vectors are processed in chunks. Rows are stacked in blockDim.y up to ``block`` threads, or
    ``short_block`` (when given) for rows of at most a warp.
    """
    npt = npt_min
    while npt < npt_max and _cdiv(nvec, npt) > tpr_max:
        npt *= 2
    tpr = _cdiv(nvec, npt)
    if tpr <= warp:
        # short rows: at least 4 threads per row where the row has 4 vectors (measured faster)
        npt = max(1, min(npt, _pow2_ceil(nvec) // 4))
        tpr = _pow2_ceil(_cdiv(nvec, npt))
        npt = min(npt, _pow2_ceil(_cdiv(nvec, tpr)))
        block = short_block or block
    else:
        tpr = _round_up(tpr, warp)
    fits = tpr <= tpr_max
    if not fits:
        tpr = tpr_max
    return Geometry(tpr, npt, max(1, block // tpr), fits)


def _spread(g, M, warp, blocks):
    """Fewer rows per block when M is small, so that about ``blocks`` blocks get work; a block
    keeps at least one full warp (the shuffles assume whole warps)."""
    unit = _warp_rows(g, warp)
    return g._replace(rpb=max(unit, min(g.rpb, _round_up(_cdiv(M, max(1, blocks)), unit))))


def _warp_rows(g, warp):
    """Rows of geometry ``g`` per whole warp (1 for rows of a warp or more)."""
    return max(1, warp // g.tpr)


def _colsum_bytes(g, rpb, vec, dtype):
    """Shared memory of the backward's column sums over a block's ``rpb`` rows of geometry ``g``
    (block_column_sums; none for one row)."""
    return g.tpr * rpb * vec * ACC_DTYPES[dtype].itemsize if rpb > 1 else 0


def vec_options(dtype):
    """Vector widths for ``dtype``: 16 bytes down to one element."""
    v = 16 // dtype.itemsize
    out = []
    while v >= 1:
        out.append(v)
        v //= 2
    return out


def _row_kernel_widths(warp, npt=1):
    """The row threads norm_fwd_row is built for at ``npt`` vectors per thread: for one,
    powers of two below a warp (rows stacked in blockDim.y, FWD_ROW_SHORT) and 1 to
    FWD_ROW_WARPS whole warps; for more (from FWD_NPT_MIN), 2 to FWD_ROW_NPT_WARPS whole warps
    within those."""
    if npt > 1:
        top = min(FWD_ROW_WARPS, FWD_ROW_NPT_WARPS) if npt >= FWD_NPT_MIN else 0
        return [w * warp for w in range(2, top + 1)]
    short = [1 << i for i in range(warp.bit_length() - 1)] if FWD_ROW_SHORT else []
    return short + [w * warp for w in range(1, FWD_ROW_WARPS + 1)]


def all_kernel_names(warp):
    """Name expressions of every kernel the planner can launch on a device of this warp size."""
    pairs = [(FLOAT16, FLOAT16), (FLOAT16, FLOAT32), (BFLOAT16, BFLOAT16), (BFLOAT16, FLOAT32),
             (FLOAT32, FLOAT32), (FLOAT64, FLOAT64), (FLOAT64, FLOAT32)]
    bwd_npts = range(BWD_NPT_MIN, max(BWD_NPT, TILE_NPT, CLUSTER_NPT) + 1)
    passes = {"fwd": range(1, FWD_NPT + 1), "bwd": bwd_npts, "bwd_long": bwd_npts}
    names = set()
    for t, w in pairs:
        for ln in (True, False):
            for v in vec_options(t):
                for pass_, npts in passes.items():
                    for n in npts:
                        if n & (n - 1):
                            continue  # vectors per thread are powers of two
                        for tiles in {"bwd_long": (CLUSTER_TILES,),
                                      "bwd": (1, CSUM_BLOCKS)}.get(pass_, (1,)):
                            names.update(Spec(t, w, ln, v, n, warp, tiles).names(pass_).values())
                        for wide in FWD_FIXED_WARPS if pass_ == "fwd" else ():
                            if wide * warp > FWD_TPR_MAX:
                                continue  # wider than any row's threads
                            spec = Spec(t, w, ln, v, n, warp, tpr=wide * warp)
                            names.update(spec.names(pass_).values())
                        if pass_ == "fwd" and v * t.itemsize == 16:
                            for tpr in _row_kernel_widths(warp, n):
                                spec = Spec(t, w, ln, v, n, warp, tpr=tpr, row=True)
                                names.update(spec.names(pass_).values())
    return names


# ----------------------------------------------------------------------------- device facts


class DeviceInfo(NamedTuple):
    sms: int
    warp: int
    threads_per_sm: int
    regs_per_sm: int
    smem_per_sm: int
    async_copy: bool  # cp.async (CUDA, compute capability 8.0 on): see CLN_ASYNC_COPY
    clusters: bool  # thread-block clusters (CUDA, compute capability 9.0 on): CLN_CLUSTERS


@functools.cache
def device_info(dev_id):
    dev = cp.cuda.Device(dev_id)
    a = dev.attributes
    return DeviceInfo(
        sms=a.get("MultiProcessorCount", 1),
        warp=a.get("WarpSize", 32),
        threads_per_sm=a.get("MaxThreadsPerMultiProcessor", 2048),
        regs_per_sm=a.get("MaxRegistersPerMultiprocessor", 65536),
        smem_per_sm=a.get("MaxSharedMemoryPerMultiprocessor", 65536),
        async_copy=not cp.cuda.runtime.is_hip and int(dev.compute_capability) >= 80,
        clusters=not cp.cuda.runtime.is_hip and int(dev.compute_capability) >= 90,
    )


def _blocks_per_sm(kern, threads, smem, info):
    """Resident blocks of ``kern`` per multiprocessor, from its register and memory use."""
    regs = max(int(getattr(kern, "num_regs", 0) or 0), 1)
    by_threads = info.threads_per_sm // threads
    by_regs = info.regs_per_sm // (_round_up(regs, 8) * threads)
    static = int(getattr(kern, "shared_size_bytes", 0) or 0)
    by_smem = info.smem_per_sm // (smem + static + 1024)
    return max(1, min(by_threads, by_regs, by_smem, 32))


# ----------------------------------------------------------------------------- plans


class Plan:
    """One pass's kernels and geometry (hashed by identity: plans are made once, cached)."""

    __slots__ = ("spec", "variant", "kern", "grid", "block", "smem", "launch")

    def __init__(self, spec, variant, kern, grid, block, smem, launch):
        self.spec = spec
        # the pass's main kernel: its name in the module (see Spec.names), its RawKernel
        self.variant, self.kern = variant, kern
        self.grid, self.block, self.smem = grid, block, smem
        self.launch = launch  # name -> _driver.Launcher with this geometry, per kernel it runs

    @property
    def dynamic(self):
        """Whether the backward has staged rows from a ticket counter (launch["bwd_dyn"], for
        calls that need not be deterministic; BWD_DYNAMIC)."""
        return "bwd_dyn" in self.launch


# Argument kinds of the kernels (see _driver): p pointer, i int64, f float32, d float64.
_FWD_ARGS = "pipppppiiX"
_BWD_ARGS = "pipipppppppppppii"
_ROWSUMS_ARGS = "pipippppii"
_REDUCE_ARGS = "piipp"


def _kinds(args, dtype):
    return args.replace("X", "d" if ACC_DTYPES[dtype] == FLOAT64 else "f")


@functools.cache
def plan_fwd(dev_id, dtype, wdtype, is_ln, M, N, vec):
    info = device_info(dev_id)
    wp = info.warp
    g = row_geometry(N // vec, wp, FWD_NPT_MIN, FWD_NPT, FWD_TPR_MAX, FWD_BLOCK, FWD_SHORT_BLOCK)
    if FWD_SMALL_M:
        g1 = row_geometry(N // vec, wp, FWD_SMALL_NPT, FWD_SMALL_NPT, FWD_TPR_MAX, FWD_BLOCK,
                          FWD_SHORT_BLOCK)
        small = M * g1.tpr * FWD_SMALL_NPT <= FWD_SMALL_M_FILL * info.sms * info.threads_per_sm
        if g1.fits and (small or (FWD_SHORT_NPT1 and g1.tpr <= wp)):
            g = g1
    g = _spread(g, M, wp, 2 * info.sms)
    grid = (min(_cdiv(M, g.rpb), info.sms * FWD_GRID_PER_SM),)
    # norm_fwd_row (see FWD_ROW_WARPS, FWD_ROW_SHORT, FWD_ROW_NPT_WARPS): rows of one chunk of
    # 16-byte vectors, within the kernel's 32-bit offsets of y, the grid covering M; one vector
    # per thread in blocks of one row of whole warps or rows of at most a warp stacked, or
    # several in blocks of one row of 2 to FWD_ROW_NPT_WARPS whole warps (stacked rows apart)
    rg = g._replace(rpb=1) if g.npt > 1 else g
    row = (g.fits and vec * dtype.itemsize == 16 and M * N < 2**31
           and g.tpr in _row_kernel_widths(wp, g.npt)
           and _cdiv(M, rg.rpb) <= info.sms * FWD_GRID_PER_SM
           and (g.npt > 1 or g.rpb == 1 or (FWD_ROW_SHORT and g.tpr <= wp)))
    if row:
        g, grid = rg, (_cdiv(M, rg.rpb),)
    fixed = row or (g.fits and g.tpr in [w * wp for w in FWD_FIXED_WARPS])
    spec = Spec(dtype, wdtype, is_ln, vec, g.npt, wp, tpr=g.tpr if fixed else 0, row=row)
    kerns = _compile.kernels(spec, "fwd")
    main = "fwd_row" if row else "fwd" if g.fits else "fwd_chunked"
    block, smem = (g.tpr, g.rpb), 0
    stage = _staging_bytes(info, dtype, vec, g.npt, g.tpr, g.rpb) if main == "fwd" else 0
    if stage:
        # staged: the resident blocks, each looping over rows with the next ones in flight;
        # "auto" where only one direct block fits on an SM (see FWD_STAGE)
        threads = g.tpr * g.rpb
        resident = info.sms * _blocks_per_sm(kerns["fwd_staged"], threads, stage, info)
        alone = _blocks_per_sm(kerns[main], threads, 0, info) == 1
        if _stages(FWD_STAGE, alone and M > resident * g.rpb):
            main, smem = "fwd_staged", stage
            grid = (min(_cdiv(M, g.rpb), resident),)
    if main == "fwd" and "fwd_early" in kerns and FWD_EARLY:
        main = "fwd_early"  # gamma/beta with the row (see FWD_EARLY)
    if main + "_full" in kerns and FWD_FULL and N % (g.tpr * g.npt * vec) == 0:
        main += "_full"  # every thread's vectors lie in the row (see FWD_FULL)
    launch = {"fwd": Launcher(kerns[main], grid, block, smem, _kinds(_FWD_ARGS, dtype))}
    return Plan(spec, main, kerns[main], grid, block, smem, launch)


def _staging_bytes(info, dtype, vec, npt, tpr, rpb, wdtype=None):
    """Dynamic shared memory of staged rows (the kernels' STAGED rule: cp.async and packs of at
    least 4 bytes): two buffers of ``npt`` packs per thread of x (the forward), or of x and dy
    and then gamma once per block (the backward, which passes ``wdtype``)."""
    pack = vec * dtype.itemsize
    if not info.async_copy or pack < 4:
        return 0
    if wdtype is None:
        return npt * tpr * 2 * pack * rpb
    return npt * tpr * (4 * pack * rpb + vec * wdtype.itemsize)


def _stages(mode, rule):
    """Whether a pass stages its rows: ``mode`` is FWD_STAGE / BWD_STAGE ("always", "never", or
    "auto": where the pass's own ``rule`` holds; see those constants)."""
    return mode == "always" or (mode == "auto" and rule)


def _bwd_threads(npt):
    """The backward kernels' launch bound: threads per block at ``npt`` vectors per thread."""
    return 1024 if npt == 1 else 512


@functools.cache
def plan_bwd(dev_id, dtype, wdtype, is_ln, M, N, vec):
    """Backward geometry. The grid depends only on (device, dtypes, M, N, vec), so the
    deterministic reduction order is the same on every call."""
    info = device_info(dev_id)
    g = row_geometry(N // vec, info.warp, BWD_NPT_MIN, BWD_NPT, BWD_TPR_MAX, BWD_BLOCK)
    g = g._replace(rpb=max(1, min(g.rpb, _bwd_threads(g.npt) // g.tpr)))
    fused = g.fits and _cdiv(M, g.rpb) <= FUSED_REDUCE_BLOCKS and N <= g.tpr * g.rpb
    csum = _plan_csum(info, dtype, wdtype, is_ln, M, N, vec, g)
    if csum is not None:
        return csum
    if not fused:
        g = _spread(g, M, info.warp, int(BWD_SPREAD * info.sms))
    launch = {}
    if g.fits:
        spec = Spec(dtype, wdtype, is_ln, vec, g.npt, info.warp)
        kerns = _compile.kernels(spec, "bwd")
        block, tiles, cluster = (g.tpr, g.rpb), 1, False
        # the column sums over a block's rows
        colsum = _colsum_bytes(g, g.rpb, vec, dtype)
    else:
        # column tiles: a cluster of CLUSTER_TILES blocks per row where the row fits in them
        # (sm_90 on; the driver counts the clusters that fit, and where it cannot the row sums
        # path is taken), else TILE_TPR-thread tiles after the row sums kernel
        tpr = _round_up(_cdiv(N // vec, CLUSTER_TILES * CLUSTER_NPT), info.warp)
        cluster = info.clusters and BWD_CLUSTER and tpr <= _bwd_threads(CLUSTER_NPT)
        if cluster:
            spec = Spec(dtype, wdtype, is_ln, vec, CLUSTER_NPT, info.warp, CLUSTER_TILES)
            kerns = _compile.kernels(spec, "bwd_long")
            cluster = _driver.max_active_clusters(kerns["bwd_cluster"], (1, CLUSTER_TILES),
                                                  (tpr, 1), 0) > 0
        if cluster:
            block, tiles = (tpr, 1), CLUSTER_TILES
        else:
            spec = Spec(dtype, wdtype, is_ln, vec, TILE_NPT, info.warp)
            kerns = _compile.kernels(spec, "bwd_long")
            block, tiles = (TILE_TPR, 1), _cdiv(N, TILE_TPR * TILE_NPT * vec)
        colsum = 0
    main = "bwd_cluster" if cluster else "bwd"
    stage = _staging_bytes(info, dtype, vec, spec.npt, block[0], block[1], wdtype)

    def grid_of(kern, smem):  # the resident blocks (each loops over rows), at most one per row
        if cluster:  # whole clusters: the GPU places them by GPC (the driver counts them)
            fit = _driver.max_active_clusters(kern, (1, tiles), block, smem)
            return (max(1, min(M, fit)), tiles)
        resident = info.sms * _blocks_per_sm(kern, block[0] * block[1], smem, info)
        return (max(1, min(_cdiv(M, block[1]), _cdiv(resident, tiles))), tiles)

    grid = grid_of(kerns[main], colsum)
    # Staged rows by default where blocks loop over rows that span several warps (BWD_STAGE).
    loops = block[0] > info.warp and M > grid[0] * block[1]
    if stage and _stages(BWD_STAGE, loops):
        main += "_staged"
        smem = max(colsum, stage)
        grid = grid_of(kerns[main], smem)
    else:
        smem = colsum
    # the same rows from tickets, for calls that need not be deterministic (see BWD_DYNAMIC): a
    # kernel of its own, on the grid that both fit; its rows span warps (the reductions' block
    # barrier orders the tickets' hand-on), in one column tile (one counter, one set of rows),
    # fewer than 2^31 groups (counted in 32 bits)
    dyn = None
    if (BWD_DYNAMIC and main == "bwd_staged" and block[0] > info.warp and tiles == 1
            and _cdiv(M, block[1]) < 2**31):
        dyn = "bwd_staged_dyn"
        grid = min(grid, grid_of(kerns[dyn], smem))
    if not g.fits and not cluster:
        rs_grid = (min(M, info.sms * (info.threads_per_sm // ROWSUMS_TPR) * 4),)
        launch["rowsums"] = Launcher(kerns["rowsums"], rs_grid, (ROWSUMS_TPR, 1), 0,
                                     _ROWSUMS_ARGS)
    # the last-block sums are a variant of the direct kernel; a few blocks stage only when told
    # to (BWD_STAGE = "always"), and then take the reduction kernel
    if fused and main == "bwd":
        main = "bwd_last"
    else:
        launch["reduce"] = Launcher(kerns["reduce"], (_cdiv(2 * N, 32),), (32, 8), 0,
                                    _REDUCE_ARGS)
    launch["bwd"] = Launcher(kerns[main], grid, block, smem, _BWD_ARGS)
    if dyn:
        launch["bwd_dyn"] = Launcher(kerns[dyn], grid, block, smem, _BWD_ARGS)
    return Plan(spec, main, kerns[main], grid, block, smem, launch)


def _plan_csum(info, dtype, wdtype, is_ln, M, N, vec, g):
    """The plan of one cluster of CSUM_BLOCKS blocks (see BWD_CLUSTER_SUMS), or None where the
    device has no clusters, the rows do not fit in those blocks, or the driver cannot place it."""
    unit = _warp_rows(g, info.warp)
    most = _bwd_threads(g.npt) // g.tpr // unit * unit  # rows that one block can hold
    rpb = min(_round_up(_cdiv(M, CSUM_BLOCKS), unit), most)
    # (BWD_STAGE = "always" stages wherever it can: this kernel has direct rows only)
    if not (g.fits and info.clusters and BWD_CLUSTER_SUMS and BWD_STAGE != "always"
            and M <= CSUM_BLOCKS * rpb):
        return None
    spec = Spec(dtype, wdtype, is_ln, vec, g.npt, info.warp, CSUM_BLOCKS)
    kern = _compile.kernels(spec, "bwd")["bwd_csum"]
    # the values each block receives ([CSUM_BLOCKS][2N / CSUM_BLOCKS]), then the column sums
    # over its rows
    smem = CSUM_BLOCKS * _cdiv(2 * N, CSUM_BLOCKS) * ACC_DTYPES[dtype].itemsize
    smem += _colsum_bytes(g, rpb, vec, dtype)
    block = (g.tpr, rpb)
    if _driver.max_active_clusters(kern, (CSUM_BLOCKS, 1), block, smem) < 1:
        return None
    launch = {"bwd": Launcher(kern, (CSUM_BLOCKS,), block, smem, _BWD_ARGS)}
    return Plan(spec, "bwd_csum", kern, (CSUM_BLOCKS, 1), block, smem, launch)


# ----------------------------------------------------------------------------- layouts


def _row_stride(a, k):
    """Row stride (elements) of ``a`` viewed as rows of its trailing ``k`` axes, or None when
    the normalized part is not contiguous or the rows are not evenly spaced."""
    isz = a.itemsize
    shape, strides = a.shape, a.strides
    nd = a.ndim
    expect = isz
    for i in range(nd - 1, nd - k - 1, -1):
        if shape[i] != 1 and strides[i] != expect:
            return None
        expect *= shape[i]
    ld = span = None
    for i in range(nd - k - 1, -1, -1):
        if shape[i] == 1:
            continue
        if ld is None:
            ld = strides[i]
        elif strides[i] != span:
            return None
        span = strides[i] * shape[i]
    if ld is None:
        return expect // isz
    return ld // isz if ld % isz == 0 else None


def _rows(a, k, N):
    """(array, row stride) for the kernel: ``a`` itself when its layout allows, else a copy."""
    if a.flags.c_contiguous:
        return a, N
    ld = _row_stride(a, k)
    if ld is None:
        return cp.ascontiguousarray(a), N
    return a, ld


def _vec(dtype, N, lds, ptrs):
    """Widest vector that divides N and every row stride, and that every pointer is aligned to.
    ``ptrs`` are (address, itemsize) pairs."""
    isz = dtype.itemsize
    v = 16 // isz
    div = N
    for ld in lds:
        div |= ld
    while v > 1:
        if div % v == 0 and all(p % (v * s) == 0 for p, s in ptrs):
            return v
        v //= 2
    return 1


def _flat(p):
    """Parameters as contiguous 1-D arrays (no copy, and no CuPy call, when they already are)."""
    if p is None or (p.ndim == 1 and p.flags.c_contiguous):
        return p
    return cp.ascontiguousarray(p).reshape(-1)


class _Layout:
    """Arrays laid one after another (256-byte aligned) in one pool allocation, then scratch
    buffers the kernels use but the caller does not get (their addresses only: no arrays made).
    One allocation per call instead of one per output. ``parts`` are (shape, dtype) pairs,
    ``scratch`` byte counts."""

    __slots__ = ("parts", "scratch", "nbytes")

    def __init__(self, parts, scratch=()):
        self.parts, off = [], 0
        for shape, dtype in parts:
            self.parts.append((tuple(shape), dtype, off))
            off += _round_up(math.prod(shape) * dtype.itemsize, 256)
        self.scratch = []
        for nbytes in scratch:
            self.scratch.append(off)
            off += _round_up(nbytes, 256)
        self.nbytes = off

    def make(self):
        """The new arrays, and the allocation (None when there is nothing to allocate), whose
        ``ptr`` plus the ``scratch`` offsets address the scratch buffers."""
        if not self.nbytes:
            return [cp.ndarray(shape, dtype) for shape, dtype, _ in self.parts], None
        mem = _alloc(self.nbytes)
        return [_ndarray(shape, dtype, mem + off if off else mem)
                for shape, dtype, off in self.parts], mem


def _array_maker():
    """A function (shape, dtype, memptr) -> cupy.ndarray on that memory. CuPy's public
    constructor passes through Python-level __new__/__init__ wrappers (hostprof S5-1: 2.0 us per
    array, three arrays per forward call); its base class's own constructor and ``_init``, which
    that wrapper calls, do the same work. Used only if it builds the same array as the public
    constructor (checked once, on the first call); otherwise the public constructor."""
    try:
        from cupy._core.core import _ndarray_base

        new, init = _ndarray_base.__new__, _ndarray_base._init
    except (ImportError, AttributeError):
        return cp.ndarray

    def fast(shape, dtype, memptr):
        a = new(cp.ndarray)
        init(a, shape, dtype, memptr)
        return a

    def first(shape, dtype, memptr):
        global _ndarray
        want = cp.ndarray(shape, dtype, memptr)
        try:
            got = fast(shape, dtype, memptr)
            same = (type(got) is cp.ndarray and got.shape == want.shape
                    and got.strides == want.strides and got.dtype == want.dtype
                    and got.data.ptr == want.data.ptr and got.flags.c_contiguous
                    and got.data.mem is want.data.mem)
        except Exception:
            same = False
        _ndarray = fast if same else cp.ndarray
        return want

    return first


_alloc, _ndarray = cp.cuda.alloc, _array_maker()
_get_device, _current_stream = cp.cuda.runtime.getDevice, cp.cuda.get_current_stream
_is_capturing = cp.cuda.runtime.streamIsCapturing
# Scratch-only allocations of calls captured into CUDA graphs, kept for the rest of the process
# (an allocation that also holds an output lives as long as the output).
_CAPTURED = []


def _fill(given, new):
    """The caller's ``out=`` entries where given, the new arrays (in order) elsewhere."""
    if given is None:
        return new
    it = iter(new)
    return [next(it) if o is None else o for o in given]


def _ptr(a):
    return 0 if a is None else a.data.ptr


class _Extents:
    """Overlap check of ``out=`` arrays on remembered calls: each argument's byte range relative
    to its pointer depends only on the signature, so it is computed on the first check and then
    only the pointers are read; the pointers of the last call that passed are remembered, so a
    call with the same buffers (a training loop) compares one tuple."""

    __slots__ = ("ranges", "passed")

    def __init__(self):
        self.ranges = self.passed = None

    def overlap(self, outs, ins, ptrs):
        """Whether a non-empty given output touches an input or another output. ``ptrs``: the
        pointers of ``ins`` and ``outs`` (0 for None), in that order."""
        if ptrs == self.passed:
            return False
        arrays = [a if a is not None and a.size else None for a in (*ins, *outs)]
        if self.ranges is None:
            self.ranges = [None if a is None else tuple(e - a.data.ptr for e in _span(a))
                           for a in arrays]
        spans = []
        for i, (a, r, p) in enumerate(zip(arrays, self.ranges, ptrs, strict=True)):
            if a is None:
                continue
            lo, hi = p + r[0], p + r[1]
            if i >= len(ins) and any(lo < h and l_ < hi for l_, h in spans):
                return True
            spans.append((lo, hi))
        self.passed = ptrs
        return False


class _on_device:
    """Make ``dev_id`` current for the block, only when it is not already."""

    __slots__ = ("dev", "prev")

    def __init__(self, dev_id):
        self.dev = dev_id

    def __enter__(self):
        self.prev = cp.cuda.runtime.getDevice()
        if self.prev != self.dev:
            cp.cuda.runtime.setDevice(self.dev)

    def __exit__(self, *exc):
        if self.prev != self.dev:
            cp.cuda.runtime.setDevice(self.prev)


# ----------------------------------------------------------------------------- passes
#
# A pass is prepared once per signature (device, shapes, strides, dtypes, flags, which outputs
# were given) as a _HotFwd / _HotBwd: the plan's launchers, the output layout and the constant
# kernel arguments. Calling it costs the pointer reads, one allocation and the launches. It
# returns None (the caller then takes the general path) when this call's pointers do not suit
# the plan's vector width, an out= array overlaps an input, or another device is current.
# (Every step here is per call: hostprof.py measures them.)


class _HotFwd:
    __slots__ = ("dev", "launch", "layout", "given", "consts", "xmask", "wmask", "is_ln", "ext")

    def __init__(self, dev, plan, x_shape, lead, is_ln, given, ldx, M, N, eps):
        parts = [(x_shape, plan.spec.dtype)] + [(lead, FLOAT32)] * (2 if is_ln else 1)
        self.dev, self.launch, self.is_ln = dev, plan.launch["fwd"], is_ln
        self.given = given if given and any(given) else None  # which outputs out= gives
        self.layout = _Layout([p for i, p in enumerate(parts)
                               if self.given is None or not self.given[i]])
        self.consts = (ldx, M, N, eps)
        self.ext = _Extents()
        v = plan.spec.vec
        self.xmask = v * plan.spec.dtype.itemsize - 1
        self.wmask = v * plan.spec.wdtype.itemsize - 1

    def __call__(self, x, gamma, beta, out):
        if _get_device() != self.dev:
            return None
        xp = x.data.ptr
        gp = 0 if gamma is None else gamma.data.ptr
        bp = 0 if beta is None else beta.data.ptr
        outs = self.layout.make()[0]
        if self.given:
            outs = _fill(out, outs)
        y, rstd = outs[0], outs[-1]
        mean = outs[1] if self.is_ln else None
        yp, mp, rp = y.data.ptr, 0 if mean is None else mean.data.ptr, rstd.data.ptr
        if (xp | yp) & self.xmask or (gp | bp) & self.wmask:
            return None
        if self.given and self.ext.overlap(out, (x, gamma, beta), (xp, gp, bp, *map(_ptr, out))):
            return None
        ldx, M, N, eps = self.consts
        self.launch(_current_stream().ptr, xp, ldx, gp, bp, yp, mp, rp, M, N, eps)
        return (y, mean, rstd) if self.is_ln else (y, rstd)


class _HotBwd:
    __slots__ = ("dev", "launch", "main", "layout", "given", "want", "consts", "xmask", "wmask",
                 "atomic", "flushed", "dynamic", "counted", "acc_bytes", "ext", "rowsums",
                 "partial", "scratch_only")

    def __init__(self, dev, plan, x_shape, norm_shape, wdtype, want, given, partials, dynamic,
                 ldx, lddy, M, N):
        acc = ACC_DTYPES[plan.spec.dtype]
        parts = [(x_shape, plan.spec.dtype), (norm_shape, wdtype), (norm_shape, wdtype)]
        self.dev, self.want = dev, want
        self.launch = plan.launch
        self.given = given if given and any(given) else None  # which outputs out= gives
        new = [p for i, p in enumerate(parts)
               if want[i] and (self.given is None or not self.given[i])]
        # scratch after the outputs, in the same allocation (held while the outputs live): the
        # dgamma/dbeta partials of each block, the row sums of long rows, and (only while a graph
        # is being captured) the zeroed ticket counter and atomic sums (see _atomic_scratch)
        P = plan.grid[0]
        # dgamma/dbeta flushed through memory: not where one cluster sums them itself
        params = (want[1] or want[2]) and plan.variant != "bwd_csum"
        self.atomic = params and not partials
        # the last block, found by a ticket counter, flushes: the atomic sums, or the partials
        # where the plan has no reduction kernel; dynamic rows take their tickets from a
        # counter after that one
        self.flushed = self.atomic or (params and "reduce" not in plan.launch)
        self.dynamic = dynamic
        self.main = plan.launch["bwd_dyn" if dynamic else "bwd"]
        self.counted = self.flushed or dynamic
        self.acc_bytes = _ACC_OFFSET + (2 * N * acc.itemsize if self.atomic else 0)
        scratch = {"partial": P * 2 * N * acc.itemsize if params and partials else 0,
                   "rowsums": M * 2 * acc.itemsize if "rowsums" in plan.launch else 0,
                   "own": self.acc_bytes if self.counted else 0}
        self.layout = _Layout(new, [n for n in scratch.values() if n])
        offs = iter(self.layout.scratch)
        self.partial, self.rowsums, own = (next(offs) if n else None for n in scratch.values())
        self.scratch_only = not new and self.layout.nbytes > 0
        self.consts = (ldx, lddy, M, N, P, own)
        self.ext = _Extents()
        v = plan.spec.vec
        self.xmask = v * plan.spec.dtype.itemsize - 1
        self.wmask = v * wdtype.itemsize - 1

    def __call__(self, dy, x, gamma, mean, rstd, out):
        if _get_device() != self.dev:
            return None
        new, mem = self.layout.make()
        given = (*out, None, None)[:3] if self.given else _NONE3  # RMSNorm: 2 given
        it, want = iter(new), self.want
        dx = (next(it) if given[0] is None else given[0]) if want[0] else None
        dgamma = (next(it) if given[1] is None else given[1]) if want[1] else None
        dbeta = (next(it) if given[2] is None else given[2]) if want[2] else None
        dyp, xp, gp = dy.data.ptr, x.data.ptr, 0 if gamma is None else gamma.data.ptr
        dxp, dgp, dbp = _ptr(dx), _ptr(dgamma), _ptr(dbeta)
        if (dyp | xp | dxp) & self.xmask or gp & self.wmask:
            return None
        mp, rp = 0 if mean is None else mean.data.ptr, rstd.data.ptr
        if self.given and self.ext.overlap(given, (dy, x, gamma, mean, rstd),
                                           (dyp, xp, gp, mp, rp, *map(_ptr, given))):
            return None
        ldx, lddy, M, N, P, own = self.consts
        base = 0 if mem is None else mem.ptr
        rsp = 0 if self.rowsums is None else base + self.rowsums
        launch = self.launch
        stream = _current_stream().ptr
        if self.scratch_only and _is_capturing(stream):
            # a replay writes to this scratch, and no output keeps it: it must outlive the call
            _CAPTURED.append(mem)
        if rsp:
            launch["rowsums"](stream, dyp, lddy, xp, ldx, gp, mp, rp, rsp, M, N)
        pp = 0 if self.partial is None else base + self.partial
        cnt = ap = tk = 0
        if self.counted:
            scratch = _atomic_scratch(self.dev, stream, self.acc_bytes, base + own)
            if self.flushed:  # the last block's ticket counter
                cnt = scratch
            if self.atomic:  # float32 atomics into zeroed sums after the counters
                ap = scratch + _ACC_OFFSET
            if self.dynamic:  # the rows' ticket counter, after the last block's
                tk = scratch + _TICKETS
        self.main(stream, dyp, lddy, xp, ldx, gp, mp, rp, rsp, dxp, dgp, dbp, ap, cnt, tk, pp, M,
                  N)
        if pp and "reduce" in launch:
            launch["reduce"](stream, pp, P, N, dgp, dbp)
        return dx, dgamma, dbeta


_NONE3 = (None, None, None)
_ACC_OFFSET = 256  # the counters (the last block's, the rows' tickets), then the sums (aligned)
_TICKETS = 4  # the rows' ticket counter, after the last block's
_SCRATCH = {}  # (device, stream) -> zeroed memory of the ticket counters and atomic sums


def _atomic_scratch(dev, stream, nbytes, own):
    """Address of ``nbytes`` of zeroed memory (ticket counters, then the atomic flush's sums)
    for a backward whose last block flushes or whose rows are dynamic, on ``stream``. The
    kernel leaves it zeroed again, so launches on one stream (which run in order) share one;
    launches on other streams, which may run at the same time, have their own. A call being
    captured into a CUDA graph uses ``own`` (the address of its own scratch), zeroed by a memset
    captured with it: the graph may be replayed on any stream."""
    if _is_capturing(stream):
        cp.cuda.runtime.memsetAsync(own, 0, nbytes, stream)
        return own
    mem = _SCRATCH.get((dev, stream))
    if mem is None or mem.mem.size < nbytes:
        # a larger one, zeroed on this stream before the kernel that first uses it; the one it
        # replaces goes back to the pool, reused only in this stream's order
        size = max(nbytes, 1 << 16)
        mem = cp.cuda.alloc(size)
        cp.cuda.runtime.memsetAsync(mem.ptr, 0, size, stream)
        _SCRATCH[dev, stream] = mem
    return mem.ptr


@functools.lru_cache(maxsize=4096)
def _hot_fwd(*key):
    return _HotFwd(*key)


@functools.lru_cache(maxsize=4096)
def _hot_bwd(*key):
    return _HotBwd(*key)


def clear_caches():
    """Forget every plan and remembered call (after changing this module's constants)."""
    from . import api

    for f in (device_info, plan_fwd, plan_bwd, _hot_fwd, _hot_bwd):
        f.cache_clear()
    api._HOT.clear()


def _given(out):
    return None if out is None else tuple(o is not None for o in out)


def forward(x, gamma, beta, eps, k, is_ln, out=None, remember=None):
    """The forward pass on validated CuPy arrays. ``remember(hot)`` is called with the prepared
    pass when later calls of the same signature can use it as they are (no input copies)."""
    dev = x.data.device_id
    with _on_device(dev):
        lead = x.shape[: x.ndim - k]
        M = math.prod(lead)
        N = math.prod(x.shape[x.ndim - k :])
        if not M:
            parts = [(x.shape, x.dtype)] + [(lead, FLOAT32)] * (2 if is_ln else 1)
            outs = _fill(out, _Layout([p for p, o in zip(parts, out or (None,) * len(parts),
                                                          strict=True) if o is None]).make()[0])
            return tuple(outs) if is_ln else (outs[0], outs[-1])
        as_is = gamma is None or beta is None or gamma.dtype == beta.dtype
        if not as_is:
            gamma, beta = gamma.astype(FLOAT32), beta.astype(FLOAT32)
        g2, b2 = _flat(gamma), _flat(beta)
        xr, ldx = _rows(x, k, N)
        as_is = as_is and g2 is gamma and b2 is beta and xr is x
        ptrs = [(xr.data.ptr, x.itemsize)]
        ptrs += [(p.data.ptr, p.itemsize) for p in (g2, b2) if p is not None]
        if out is not None and out[0] is not None:  # y (the statistics are not vectors)
            ptrs.append((out[0].data.ptr, x.itemsize))
        vec = _vec(x.dtype, N, (ldx,), ptrs)
        wdtype = next((p.dtype for p in (g2, b2) if p is not None), x.dtype)
        plan = plan_fwd(dev, x.dtype, wdtype, is_ln, M, N, vec)
        hot = _hot_fwd(dev, plan, x.shape, lead, is_ln, _given(out), ldx, M, N, eps)
        if remember is not None and as_is:
            remember(hot)
        return hot(xr, g2, b2, out)


def backward(dy, x, gamma, mean, rstd, k, need_dx, need_dgamma, need_dbeta, deterministic,
             out=None, remember=None):
    """The backward pass on validated CuPy arrays; ``remember`` as in :func:`forward`."""
    dev = x.data.device_id
    with _on_device(dev):
        norm_shape = x.shape[x.ndim - k :]
        M = math.prod(x.shape[: x.ndim - k])
        N = math.prod(norm_shape)
        wdtype = _param_dtype(gamma, x.dtype)
        if not (need_dx or need_dgamma or need_dbeta):
            return None, None, None
        want = (need_dx, need_dgamma, need_dbeta)
        if not M:  # no rows: no kernel, zero parameter gradients
            parts = [(x.shape, x.dtype), (norm_shape, wdtype), (norm_shape, wdtype)]
            given = out or (None, None, None)
            new = iter(_Layout([p for p, w, o in zip(parts, want, given, strict=True)
                                if w and o is None]).make()[0])
            dx, dgamma, dbeta = ((next(new) if o is None else o) if w else None
                                 for w, o in zip(want, given, strict=True))
            for a in (dgamma, dbeta):
                if a is not None:
                    a.fill(0)
            return dx, dgamma, dbeta
        g2 = _flat(gamma)
        m2 = None if mean is None else cp.ascontiguousarray(mean)
        r2 = cp.ascontiguousarray(rstd)
        xr, ldx = _rows(x, k, N)
        dyr, lddy = _rows(dy, k, N)
        as_is = g2 is gamma and m2 is mean and r2 is rstd and xr is x and dyr is dy
        ptrs = [(xr.data.ptr, x.itemsize), (dyr.data.ptr, x.itemsize)]
        # vector accesses: x, dy, dx and gamma (dgamma/dbeta are written per element)
        ptrs += [(p.data.ptr, p.itemsize) for p in (g2, out and out[0]) if p is not None]
        vec = _vec(x.dtype, N, (ldx, lddy), ptrs)
        plan = plan_bwd(dev, x.dtype, wdtype, mean is not None, M, N, vec)
        partials = deterministic or not ATOMIC_FLUSH
        dynamic = plan.dynamic and not deterministic
        hot = _hot_bwd(dev, plan, x.shape, norm_shape, wdtype, want, _given(out), partials,
                       dynamic, ldx, lddy, M, N)
        if remember is not None and as_is:
            remember(hot)
        return hot(dyr, xr, g2, m2, r2, out)


def warmup(shapes, ops=("layernorm", "rmsnorm"), param_dtype=None):
    """Compile (or load from CuPy's disk cache) the kernels that contiguous inputs of these
    ``(M, N, dtype)`` shapes will use, forward and backward, on the current device."""
    dev = cp.cuda.runtime.getDevice()
    plans = []
    for M, N, dtype in shapes:
        dtype = np.dtype(dtype)
        wdtype = dtype if param_dtype is None else np.dtype(param_dtype)
        vec = _vec(dtype, N, (N,), [])
        for op in ops:
            is_ln = op == "layernorm"
            plans.append(plan_fwd(dev, dtype, wdtype, is_ln, max(M, 1), N, vec))
            plans.append(plan_bwd(dev, dtype, wdtype, is_ln, max(M, 1), N, vec))
    return len(plans)
