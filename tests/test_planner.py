"""The planner's geometry and layout decisions, checked on the CPU (no GPU needed)."""

import functools
import json
import os
import pathlib
import re
import subprocess
import sys
from typing import NamedTuple

import numpy as np
import pytest
from hypothesis import example, given
from hypothesis import strategies as st

from cupyln import _layout, _plan, _tuning
from cupyln._config import DEFAULT, Config
from cupyln._dtypes import BFLOAT16, VEC, h_dtypes, tuned

FWD, BWD = _tuning.settings(DEFAULT, "sm_90").fwd, _tuning.settings(DEFAULT, "sm_90").bwd
NO_PARTS = Config(tuning=dict(fwd_parts_rows=0, bwd_parts_rows=0))
# the long backward rows' row sums and tiles, in place of the grid and the resident tiles
ROW_SUMS_ROWS = dict(bwd_grid_vecs=0, bwd_resident_npt=0)
ROW_SUMS = Config(tuning=ROW_SUMS_ROWS)
NO_RESIDENT = Config(tuning=dict(fwd_resident_npt=0))

WARPS = st.sampled_from([32, 64])


@given(st.integers(1, 1 << 21), WARPS, st.integers(0, 1 << 22), st.integers(0, 400))
def test_row_geometry_covers_the_row_with_whole_warps(nvec, warp, M, blocks):
    for npt_min, npt_max, tpr_max, block, short in (
        (FWD.npt, FWD.npt, FWD.tpr_max, FWD.block, FWD.short_block),
        (BWD.npt_min, BWD.npt, BWD.tpr_max, BWD.block, None),
    ):
        g = _plan.row_geometry(nvec, warp, npt_min, npt_max, tpr_max, block, short)
        if g.tpr <= warp:  # rows within a warp fill the block for short rows
            assert g.tpr * g.rpb == (short or block)
        if M:
            g = _plan.spread(g, M, warp, blocks)
        assert g.npt & (g.npt - 1) == 0 and 1 <= g.npt <= npt_max
        if g.tpr < warp:  # a power-of-two group of lanes, whole warps per block
            assert g.tpr & (g.tpr - 1) == 0 and (g.tpr * g.rpb) % warp == 0
        else:  # whole warps per row
            assert g.tpr % warp == 0
        assert g.tpr <= tpr_max and g.tpr * g.rpb <= 1024
        assert g.fits == (g.tpr * g.npt >= nvec)
        if g.fits:  # no smaller row group of the same kind would hold the row
            smaller = g.tpr - warp if g.tpr > warp else g.tpr // 2
            assert smaller * g.npt < nvec


def _addresses(a):
    idx = np.indices(a.shape).reshape(a.ndim, -1)
    return a.__array_interface__["data"][0] + (np.array(a.strides)[:, None] * idx).sum(0)


VIEWS = {
    "contiguous": lambda b: b,
    "row slice": lambda b: b[:, 1:-2],
    "every other row": lambda b: b[::2],
    "reversed rows": lambda b: b[::-1],
    "reversed columns": lambda b: b[:, ::-1],
    "transposed": lambda b: b.T,
    "3-d split rows": lambda b: b.reshape(2, -1, b.shape[1])[:, ::2],
    "column step": lambda b: b[:, ::2],
}


@given(st.sampled_from(sorted(VIEWS)), st.integers(2, 9), st.integers(4, 12))
def test_row_stride_describes_the_view_exactly(view, m, n):
    a = VIEWS[view](np.zeros((2 * m, n), np.float16))
    ld = _layout.row_stride(a, 1)
    if ld is None:
        return  # the caller copies: nothing to check
    rows, cols = np.prod(a.shape[:-1], dtype=int), a.shape[-1]
    r, c = np.divmod(np.arange(rows * cols), cols)
    want = a.__array_interface__["data"][0] + (r * ld + c) * a.itemsize
    assert np.array_equal(_addresses(a), want)


def test_row_stride_accepts_the_views_the_contract_names():
    b = np.zeros((8, 16), np.float32)
    assert _layout.row_stride(b[:, 2:10], 1) == 16  # rows of a wider buffer: no copy
    assert _layout.row_stride(b[::-1], 1) == -16  # reversed rows: no copy
    assert _layout.row_stride(b[:, ::-1], 1) is None  # reversed normalized axis: copy
    assert _layout.row_stride(b.T, 1) is None


@given(st.sampled_from([np.float16, np.float32, np.float64]), st.integers(1, 4096),
       st.integers(0, 64))
def test_vector_width_divides_sizes_and_alignments(dtype, N, offset):
    dtype = np.dtype(dtype)
    ptr = 4096 + offset * dtype.itemsize
    v = _layout.vec_width(dtype, N, (N,), [(ptr, dtype.itemsize)])
    assert v in (VEC[dtype], 1) and N % v == 0 and ptr % (v * dtype.itemsize) == 0
    assert (v == VEC[dtype]) == (N % VEC[dtype] == 0 and ptr % (VEC[dtype] * dtype.itemsize) == 0)
    n = _layout.vec_width(dtype, N, (N,), [(ptr, dtype.itemsize)], narrow=True)  # the backward's
    assert n * dtype.itemsize <= 16 and N % n == 0 and ptr % (n * dtype.itemsize) == 0
    assert n == max(w for w in (1, 2, 4, 8) if w <= VEC[dtype] and N % w == 0
                    and ptr % (w * dtype.itemsize) == 0)


@given(st.text(alphabet="pifd", min_size=1, max_size=20))
def test_launch_argument_buffer_follows_c_layout(kinds):
    import struct

    from cupyln._driver import _STRUCT, param_layout

    fmt, offs = param_layout(kinds)
    sizes = [struct.calcsize(_STRUCT[k]) for k in kinds]
    assert offs[0] == 0
    for o, n in zip(offs, sizes, strict=True):
        assert o % n == 0  # each argument at its natural alignment
    for (o, n), o2 in zip(zip(offs, sizes, strict=True), offs[1:], strict=False):
        assert o + n <= o2 < o + n + 8  # no overlap, padding only
    assert struct.calcsize(fmt) == offs[-1] + sizes[-1]
    packed = struct.pack(fmt, *range(1, len(kinds) + 1))  # each value lands at its offset
    for i, (k, o) in enumerate(zip(kinds, offs, strict=True)):
        assert struct.unpack_from("@" + _STRUCT[k], packed, o)[0] == i + 1


def _dtype(dt):
    """The dtype named ``dt`` (bfloat16 as ml_dtypes has it)."""
    return BFLOAT16 if dt == "bfloat16" else np.dtype(dt)


class _FakeKernel:
    """What the planner reads of a compiled kernel (its resources), without a GPU, and its
    name expression."""

    num_regs, shared_size_bytes, max_dynamic_shared_size_bytes = 64, 0, 48 * 1024
    local_size_bytes = 0

    def __init__(self, name):
        self.name = name


_SMEM_PER_SM = 233472  # the H200's shared memory per multiprocessor


def _fake_resident_blocks(kern, threads, smem):
    """The driver's resident blocks of a 64-register kernel (_FakeKernel's) on the mock."""
    return min(2048 // threads, 65536 // (64 * threads), _SMEM_PER_SM // (smem + 1024))


def _plan_without_gpu(pass_, dt, M, N, warp, clusters=True, config=DEFAULT, hip=False,
                      hdtype=None, residual=False, peel=False, is_ln=True, most_blocks=16,
                      most_smem=None, at_once=1, quant=None):
    """The plan of contiguous (M, N) LayerNorm inputs of dtype ``dt`` on a mocked H200-like
    device (kernels not compiled; the driver places any cluster), and the kernels of the modules
    it asked for, by variant name. ``hdtype``, ``residual``: the fused residual add's forward
    and backward; ``peel``: rows on which 16-byte vectors do not fit, peelable; ``is_ln``
    False: RMSNorm's plan; ``most_blocks``: the largest cluster the driver places,
    ``at_once`` of them at a time; ``most_smem`` (if given) the most shared memory a block may
    have (else the H200's)."""
    dtype = _dtype(dt)
    built = {}

    def kernels(spec, p, text=None):
        names = spec.names(p)
        built.update(names)
        return {k: _FakeKernel(v) for k, v in names.items()}

    info = _plan.DeviceInfo(
        132, warp, 2048, 65536, _SMEM_PER_SM, most_smem or 227 * 1024, not hip,
        clusters and not hip, hip, kernels=kernels,
        active_clusters=lambda k, cl, *a: at_once * (cl[0] * cl[1] <= most_blocks),
        resident_blocks=_fake_resident_blocks)
    plain_bwd = pass_ == "bwd" and not residual and hdtype is None and not quant
    vec = _layout.vec_width(dtype, N, (N,), [], narrow=plain_bwd)  # the calls' rule
    peel = peel and vec < VEC[dtype] and tuned(dtype, VEC[dtype])  # and peelable's
    if hdtype is not None or quant:
        return _plan.plan_fwd.__wrapped__(info, config, dtype, dtype, is_ln, M, N,
                                          vec, hdtype, peel, quant), built
    if residual:
        return _plan.plan_bwd.__wrapped__(info, config, dtype, dtype, is_ln, M, N,
                                          vec, True, peel), built
    planner = _plan.plan_fwd if pass_ == "fwd" else _plan.plan_bwd
    return planner.__wrapped__(info, config, dtype, dtype, is_ln, M, N, vec, peel=peel), built


@given(st.sampled_from(["float16", "bfloat16", "float32", "float64"]), st.integers(1, 1 << 20),
       st.integers(1, 1 << 16), WARPS)
# rows of 2-4 warps of several vectors each, stacked before (4096x2048) or not, past the grid's
# cap, not a multiple of the chunk, of 64-lane warps
@example("float16", 4096, 2048, 32)
@example("bfloat16", 131072, 4096, 32)
@example("bfloat16", 132 * 1024 + 1, 4096, 32)
@example("float16", 5000, 1032, 32)
@example("float32", 4096, 2048, 64)
def test_forward_plan_takes_a_kernel_its_module_builds(dt, M, N, warp):
    """What a forward plan must hold for its kernel to be right, whatever the rules that chose
    it: the kernel is one of the module it compiles; a kernel whose row threads are fixed at
    compile time (the row kernel) runs with that many, and no other kernel fixes them; the
    variant without column tests only where every thread's vectors lie below N (N a multiple
    of the chunk, 16-byte vectors); the row kernel's 32-bit element offsets below 2^31. Which
    variant a shape gets is the golden table's business."""
    plan, built = _plan_without_gpu("fwd", dt, M, N, warp)
    assert plan.variant in built and plan.kern.name in built.values()
    tpr, _ = plan.block
    s = plan.spec
    assert s.tpr == (tpr if plan.variant.startswith("fwd_row") else 0)
    chunk = tpr * s.npt * s.vec * s.tiles  # (a cluster's: its blocks' chunks)
    assert not plan.variant.endswith("_full") or (N % chunk == 0 and s.wide)
    assert not s.row or M * N < 2**31


@given(st.sampled_from(["float16", "bfloat16", "float32", "float64"]), st.integers(1, 1 << 20),
       st.integers(1, 1 << 21), WARPS, st.booleans(), st.booleans())
@example("bfloat16", 2048, 65536, 32, True, True)  # longer than a block: staged clusters
@example("bfloat16", 2048, 65544, 32, True, True)  # ... not a whole number of chunks
@example("bfloat16", 64, 1 << 20, 32, True, True)  # longer than a cluster: in parts, or a block
@example("bfloat16", 256, 1 << 19, 32, True, False)  # longer than 8 blocks hold: 16, staged
@example("bfloat16", 11, 1 << 19, 32, True, False)  # ... but too few rows: none
@example("bfloat16", 1, 65536, 32, True, True)  # one row: direct, one vector per thread
@example("float16", 1, 131072, 32, True, True)  # ... where 8 blocks of them hold it: here not
@example("bfloat16", 131, 32768, 32, True, True)  # fits a block
def test_forward_rows_split_over_a_cluster_where_longer_than_a_block(dt, M, N, warp, clusters,
                                                                     ln):
    """Forward rows split over a cluster (rows held in a cluster's shared memory, off here, have
    their own test), as the cluster kernels need them: only where clusters exist, at 16-byte
    vectors, over 8 or 16 blocks of one row each of whole warps, a row within one chunk of the
    cluster (these kernels read x once); shared memory for two buffers of each block's part
    where staged; no column tests only over whole chunks; only rows longer than a block.
    Which rows split is the golden table's business."""
    no_parts = Config(tuning=dict(fwd_parts_rows=0, fwd_resident_npt=0))
    plan, built = _plan_without_gpu("fwd", dt, M, N, warp, clusters, config=no_parts, is_ln=ln)
    s = plan.spec
    assert s.tiles == 1 or (clusters and s.vec * s.dtype.itemsize == 16)
    if s.tiles == 1:
        return
    tpr = plan.block[0]
    assert s.tiles in (FWD.cluster_tiles, FWD.cluster_tiles_long) and plan.block[1] == 1
    assert tpr % warp == 0 and tpr <= FWD.tpr_max and plan.grid[1] == s.tiles
    cover = s.tiles * tpr * s.npt * s.vec  # the elements one chunk of the cluster holds
    assert N <= cover and N > FWD.tpr_max * FWD.npt * s.vec  # longer than a block
    staged = plan.variant.startswith("fwd_cluster_staged")
    assert plan.smem == (2 * s.npt * tpr * 16 if staged else 0)
    assert not plan.variant.endswith("_full") or N % cover == 0
    assert set(built.values()) <= _plan.all_kernel_names(warp)


@pytest.mark.parametrize("ln", [True, False])
@pytest.mark.parametrize("dt,M,N,most,tiles,npt", [
    ("bfloat16", 1, 65536, 16, 16, 1),  # 16 blocks of 512 threads
    ("bfloat16", 4, 50000, 16, 16, 1),  # not whole chunks; the most rows split
    ("float32", 2, 32768, 16, 16, 1),
    ("bfloat16", 5, 65536, 16, 8, 1),  # more rows: 8 blocks of 1024
    ("bfloat16", 1, 65536, 8, 8, 1),  # the driver places no 16-block cluster
    ("bfloat16", 1, 131072, 16, 8, 4),  # 8 blocks of one vector per thread do not hold it
    ("bfloat16", 1, 32768, 16, 1, 4)])  # one block holds it
def test_few_forward_rows_split_over_the_larger_cluster(ln, dt, M, N, most, tiles, npt):
    """At most ``cluster_split_rows`` forward rows that ``cluster_tiles`` blocks of one vector
    per thread hold take ``cluster_tiles_long`` blocks of half the threads, where the driver
    places such a cluster (LayerNorm and RMSNorm alike; eight clusters at once here, so no row
    is staged); with the rule off, or for more rows, ``cluster_tiles``."""
    plan, built = _plan_without_gpu("fwd", dt, M, N, 32, most_blocks=most, is_ln=ln, at_once=8)
    vec = 16 // _dtype(dt).itemsize
    threads = -(-(N // vec) // (tiles * npt * 32)) * 32
    assert (plan.spec.tiles, plan.spec.npt, plan.block, plan.smem) == (tiles, npt, (threads, 1), 0)
    if tiles > 1:
        assert plan.variant == "fwd_cluster" and plan.grid == (M, tiles)
    assert set(built.values()) <= _plan.all_kernel_names(32)
    off = Config(tuning=dict(fwd_cluster_split_rows=0))
    plain, _ = _plan_without_gpu("fwd", dt, M, N, 32, config=off, is_ln=ln, at_once=8)
    assert plain.spec.tiles == (8 if tiles == 16 else tiles) and plain.spec.npt == npt


@given(st.sampled_from(["float16", "bfloat16", "float32", "float64"]), st.integers(1, 1 << 12),
       st.integers(1 << 15, 1 << 21), WARPS, st.booleans(), st.sampled_from([1, 8, 16]))
@example("bfloat16", 64, 1 << 20, 32, True, 16)  # 16 blocks of 8 vectors per thread
@example("bfloat16", 256, 1 << 19, 32, False, 16)  # RMSNorm's: 8 blocks, not 16 in registers
@example("bfloat16", 1, 1 << 20, 32, True, 16)  # one row: in parts
@example("bfloat16", 2, 1 << 20, 32, True, 16)  # two rows: resident_rows' bound
@example("float16", 100, 600000, 32, True, 16)  # not a whole number of vectors per thread
@example("bfloat16", 2048, 65536, 32, True, 16)  # 8 blocks' registers hold it: not here
@example("bfloat16", 64, 1 << 20, 32, True, 8)  # the driver places no 16-block cluster
def test_forward_rows_held_in_a_clusters_shared_memory(dt, M, N, warp, ln, most):
    """Rows held in a cluster's shared memory, as norm_fwd_resident needs them: 16-byte
    vectors, 8 or 16 blocks of one row each of whole warps, ``resident_npt`` vectors per thread
    holding the row, a ring of whole one-vector-per-thread slots, at least a chunk's, within a
    block's shared memory. Which rows are held there is the golden table's business."""
    plan, nvec = _resident_plan("fwd", dt, M, N, warp, ln, most)
    if plan is None:
        return
    tpr, tiles, npt = plan.block[0], plan.spec.tiles, plan.spec.npt
    assert tiles in (FWD.cluster_tiles, FWD.cluster_tiles_long) and npt == FWD.resident_npt
    assert tpr % warp == 0 and tpr <= FWD.tpr_max and plan.block[1] == 1
    assert tpr * tiles * npt >= nvec and plan.grid[1] == tiles
    slot = tpr * 16
    slots = plan.smem // slot
    assert plan.smem == slots * slot and npt <= slots and plan.smem <= _SMEM_PER_SM - 1024


def _resident_plan(pass_, dt, M, N, warp, ln, most):
    """The ``pass_`` plan where it holds rows in a cluster's shared memory (at 16-byte vectors
    only), else None, its kernels in the offline list; and the row's vectors."""
    plan, built = _plan_without_gpu(pass_, dt, M, N, warp, is_ln=ln, most_blocks=most)
    dtype = _dtype(dt)
    vec = _layout.vec_width(dtype, N, (N,), [])
    taken = plan.variant == f"{pass_}_resident"
    assert not taken or vec * dtype.itemsize == 16
    assert set(built.values()) <= _plan.all_kernel_names(warp)
    return (plan if taken else None), N // vec


@given(st.sampled_from(["float16", "bfloat16", "float32", "float64"]), st.integers(1, 1 << 12),
       st.integers(1, 1 << 21), WARPS, st.sampled_from(["sm_90", "sm_80", "hip"]))
@example("bfloat16", 1, 1 << 20, 32, "sm_90")
@example("bfloat16", 64, 1 << 20, 32, "sm_90")
@example("bfloat16", 1, 65536, 32, "sm_80")
@example("float32", 66, 1 << 21, 64, "hip")
@example("bfloat16", 64, 1 << 20, 32, "sm_90")
def test_few_long_forward_rows_split_over_the_grid(dt, M, N, warp, target):
    """Rows in parts over the grid, as its two launches need them: rows longer than one block
    at 16-byte vectors, a grid of (parts, M) blocks of whole warps (the fused add's too: h
    stored by the first, read back by the second), every part non-empty and the parts
    covering the row, each row's parts within its share of ``parts_per_sm`` blocks per SM (or
    blocks of ``tpr_max`` threads), on any device. Which rows go in parts is the golden
    table's business."""
    hip = target == "hip"
    dtype = _dtype(dt)
    for hdtype in (None, *h_dtypes(dtype)):
        _check_fwd_parts(dt, M, N, warp, target, hip, hdtype)


def _check_parts_geometry(parts, tpr, npt, vec, M, N, warp, tpr_max, per_sm):
    """Rows in parts: blocks of whole warps, at most tpr_max threads of npt vectors, every part
    non-empty and the parts covering the row; the fewest warps that keep each row within its
    share of per_sm * SMs blocks (or blocks of tpr_max threads)."""
    chunk = tpr * npt * vec
    assert tpr % warp == 0 and warp <= tpr <= tpr_max
    assert (parts - 1) * chunk < N <= parts * chunk
    share, nvec = -(-per_sm * 132 // M), -(-N // vec)
    assert parts <= share or tpr == tpr_max
    assert tpr == warp or -(-nvec // (npt * (tpr - warp))) > share


def _peeled_plan(pass_, dt, M, N, warp, hip, most, sure):
    """The ``pass_`` plan of peelable rows, and its kernels: never peeled where 16-byte vectors
    fit, below 2 * VEC elements or past ``most`` vectors, or in float64; peeled where ``sure``.
    The plan where peeled, else None."""
    plan, built = _plan_without_gpu(pass_, dt, M, N, warp, hip=hip, peel=True)
    wide = VEC[_dtype(dt)] if tuned(_dtype(dt), VEC[_dtype(dt)]) else 1  # float64: never
    peeled = plan.variant in (f"{pass_}_peeled", "fwd_peeled_early", "fwd_peeled_staged",
                              "fwd_peeled_parts", "fwd_peeled_cluster", "fwd_peeled_chunked")
    if wide == 1 or N % wide == 0 or N < 2 * wide or N // wide > most:
        assert not peeled
    elif sure:
        assert peeled
    return (plan, built) if peeled else (None, built)


@given(st.sampled_from(["float16", "bfloat16", "float32", "float64"]), st.integers(1, 1 << 20),
       st.integers(1, 1 << 17), WARPS, st.booleans())
@example("float16", 8, 3583, 32, False)
@example("float16", 132, 3583, 32, False)
@example("float16", 133, 3583, 32, False)
@example("float16", 133, 50257, 32, False)
@example("bfloat16", 6000, 12001, 32, False)
@example("bfloat16", 2670, 50257, 64, False)
@example("float32", 3000, 32001, 32, False)
@example("bfloat16", 2670, 50257, 32, False)
@example("float32", 4096, 4099, 64, True)
@example("float16", 37460, 3583, 32, False)
@example("bfloat16", 1, 50257, 64, True)
@example("float32", 1000, 20001, 32, False)
@example("float16", 300, 50257, 32, False)
@example("bfloat16", 1024, 131071, 32, False)
@example("float32", 2048, 65535, 64, True)
def test_forward_rows_peeled_where_vectors_do_not_fit(dt, M, N, warp, hip):
    """Peeled rows as the peeled kernels need them, whichever one runs: never rows of 16-byte
    vectors, below 2 * VEC elements, or (from 8 * VEC vectors, where the peeled kernels are
    sure to take them) in single elements; at least 2 * VEC threads per row (one per peeled
    element), whole warps or a power of two within one; in parts, blocks of one row whose parts
    cover the row's vectors; in chunks, blocks of ``tpr_max`` threads; else one chunk of at
    most 8 vectors per thread holding the row's middle, staged kernels with their two buffers
    in shared memory and no staging elsewhere. Which peeled kernel runs is the golden table's
    business."""
    wide = 16 // _dtype(dt).itemsize
    plan, built = _peeled_plan("fwd", dt, M, N, warp, hip, N, N // wide >= 8 * wide)
    assert set(built.values()) <= _plan.all_kernel_names(warp, hip=hip)
    if plan is None:
        return
    s, nvec, v = plan.spec, N // wide, plan.variant
    assert s.peeled and s.vec == wide
    tpr, rpb = (tuple(plan.block) + (1,))[:2]
    assert tpr >= 2 * wide and (tpr % warp == 0 or (tpr < warp and warp % tpr == 0))
    if v == "fwd_peeled_parts":
        parts, rows = plan.grid
        assert rows == M and rpb == 1 and (parts - 1) * tpr * s.npt < nvec <= parts * tpr * s.npt
        assert set(plan.launch) == {"fwd_parts", "fwd"}
    elif v == "fwd_peeled_chunked":
        assert plan.block == (FWD.tpr_max, 1) and plan.smem == 0
    elif v != "fwd_peeled_cluster":  # (split over a cluster: its own test)
        assert s.npt in _plan.PEEL_NPTS and tpr * s.npt >= nvec and tpr * rpb <= 1024
        assert plan.smem == (2 * s.npt * tpr * rpb * 16 if v == "fwd_peeled_staged" else 0)


@given(st.sampled_from(["float16", "bfloat16", "float32", "float64"]), st.integers(1, 1 << 20),
       st.integers(1, 1 << 19), WARPS, st.booleans())
@example("bfloat16", 2670, 50257, 32, True)
@example("float32", 1000, 20001, 64, True)
@example("bfloat16", 1024, 131071, 32, False)
@example("bfloat16", 2048, 65535, 32, True)
@example("bfloat16", 2048, 65535, 32, False)
@example("bfloat16", 3, 400001, 32, False)
@example("bfloat16", 20, 400001, 32, False)
@example("bfloat16", 600, 400001, 32, False)
def test_peeled_rows_over_a_cluster_in_place_of_chunks(dt, M, N, warp, is_ln):
    """``peel_cluster`` (on): peeled rows that would go in chunks (``peel_cluster=False``)
    split over the cluster the aligned rows' rule gives (the fewest blocks whose one chunk
    holds the middle: 8, RMSNorm's 16 from ``cluster_long_min_rows`` rows; RMSNorm's only in
    blocks of ``peel_cluster_rms_threads`` or more), whole warps each covering the row's
    middle, the grid's clusters covering M or at its cap; every other plan is the one without
    the switch."""
    off_cfg = Config(tuning=dict(fwd_peel_cluster=False))
    off, _ = _plan_without_gpu("fwd", dt, M, N, warp, peel=True, is_ln=is_ln, config=off_cfg)
    on, built = _plan_without_gpu("fwd", dt, M, N, warp, peel=True, is_ln=is_ln)
    wide = 16 // _dtype(dt).itemsize
    nvec, chunk = N // wide, FWD.tpr_max * FWD.npt
    held = [t for t in _plan.fwd_cluster_sizes(FWD, is_ln, None) if nvec <= t * chunk]
    tiles = held[0] if held and (held[0] <= FWD.cluster_tiles
                                 or M >= FWD.cluster_long_min_rows) else 0
    threads = -(-nvec // (tiles * FWD.npt * warp)) * warp if tiles else 0  # a block's
    cluster = off.variant == "fwd_peeled_chunked" and tiles and \
        (is_ln or threads >= FWD.peel_cluster_rms_threads)
    assert (on.variant == "fwd_peeled_cluster") == bool(cluster), (on.variant, off.variant)
    if not cluster:
        assert (on.variant, on.grid, on.block) == (off.variant, off.grid, off.block)
        return
    (grid, t), (tpr, one) = on.grid, on.block
    assert t == on.spec.tiles == tiles and one == 1 and tpr % warp == 0 and tpr <= FWD.tpr_max
    assert (tpr - warp) * tiles * FWD.npt < nvec <= tpr * tiles * FWD.npt
    assert grid == min(M, 132 * FWD.grid_per_sm) and on.spec.peeled and on.spec.vec == wide
    assert set(on.launch) == {"fwd"} and set(built.values()) <= _plan.all_kernel_names(warp)


def test_peeled_chunks_are_a_switch():
    """``peel_chunked=False``: many peeled rows past one block of 8 vectors per thread run
    single elements over the whole row, as before the chunked kernel. Rows of more than ``npt``
    vectors per thread of one unstaged block go in chunks where that block's kernel keeps more
    than ``peel_block_spill`` bytes in local memory, and stay in it where it keeps no more or
    where they are staged."""
    from unittest import mock

    off, spill = Config(tuning=dict(fwd_peel_chunked=False)), FWD.peel_block_spill
    for config, M, N, local, variant, vec, npt in (
            (DEFAULT, 2048, 131071, 0, "fwd_peeled_chunked", 8, FWD.npt),
            (off, 2048, 131071, 0, "fwd_chunked", 1, 4),
            (DEFAULT, 2048, 60001, spill, "fwd_peeled", 8, 8),
            (DEFAULT, 2048, 60001, spill + 1, "fwd_peeled_chunked", 8, FWD.npt),
            (off, 2048, 60001, 152, "fwd_peeled", 8, 8),
            (DEFAULT, 2670, 50257, 152, "fwd_peeled_staged", 8, 8)):
        with mock.patch.object(_FakeKernel, "local_size_bytes", local):  # (no clusters)
            plan, _ = _plan_without_gpu("fwd", "bfloat16", M, N, 32, False, config, peel=True)
        assert (plan.variant, plan.spec.vec, plan.spec.npt) == (variant, vec, npt), (M, N, local)


@given(st.sampled_from(["float16", "bfloat16", "float32", "float64"]), st.integers(1, 1 << 20),
       st.integers(1, 1 << 14), WARPS, st.booleans())
@example("float16", 8, 3583, 32, False)
@example("bfloat16", 37460, 3583, 32, False)
@example("float32", 4096, 4099, 64, True)
@example("float16", 700000, 1001, 32, False)
def test_backward_rows_peeled_where_one_block_holds_them(dt, M, N, warp, hip):
    """The peeled backward of rows one block holds, as its kernel needs them (any device; taken
    certainly from 2 * warp vectors and enough rows): one block of the backward's geometry
    holding the row's 16-byte vectors in at least 2 * VEC threads, one row per block, a grid
    that is a multiple of the rows' heads' period (each block's rows share their head),
    partials summed by the reduction."""
    wide = 16 // _dtype(dt).itemsize
    sure = N // wide >= 2 * warp and M >= BWD.peel_rows * 132 * 32  # (at most 32 blocks per SM)
    plan, built = _peeled_plan("bwd", dt, M, N, warp, hip, BWD.npt * BWD.tpr_max, sure)
    if plan is None:
        return
    s, nvec = plan.spec, N // wide
    (grid, one), (tpr, rows) = plan.grid, plan.block
    assert s.peeled and s.vec == wide and one == rows == 1 and tpr >= 2 * wide
    assert tpr * s.npt >= nvec and tpr <= _plan.bwd_threads(s.npt)
    assert grid <= M and grid % (wide // np.gcd(N, wide)) == 0 and "reduce" in plan.launch
    assert set(built.values()) <= _plan.all_kernel_names(warp, hip=hip)


@given(st.sampled_from(["float16", "bfloat16", "float32", "float64"]), st.integers(1, 1 << 16),
       st.integers(1, 1 << 20), WARPS, st.booleans())
@example("bfloat16", 2670, 50257, 32, False)
@example("float32", 67, 20001, 64, True)
@example("float16", 66, 50257, 32, False)
@example("float64", 1 << 16, 16385, 32, False)
@example("bfloat16", 1, 300001, 32, False)  # one row of tiles; row sums in parts
@example("bfloat16", 32, 300001, 32, False)  # rows of tiles and partials; row sums in parts
def test_backward_long_rows_peeled_on_column_tiles(dt, M, N, warp, hip):
    """Peeled long rows on column tiles after their peeled row sums, as those kernels need
    them (any device), for rows longer than one block of the backward: tiles of ``tile_tpr``
    threads x ``tile_npt`` vectors covering the middle, at least 2 * VEC threads in tile 0 (the
    head and tail), a grid of rows covering M or a multiple of the heads' period, partials
    summed by the reduction exactly where that grid has more than one row of blocks; the row
    sums one row per block, or in parts over the grid (then added, whole warps covering the
    row). Which rows take the tiles is the golden table's business."""
    wide = 16 // _dtype(dt).itemsize
    plan, built = _plan_without_gpu("bwd", dt, M, N, warp, hip=hip, peel=True)
    assert set(built.values()) <= _plan.all_kernel_names(warp, hip=hip)
    if plan.variant != "bwd_peeled_tiles":
        return
    assert N % wide and N // wide > BWD.npt * BWD.tpr_max
    s, nvec = plan.spec, N // wide
    (grid, tiles), (tpr, rows) = plan.grid, plan.block
    assert s.peeled and s.vec == wide and s.npt == BWD.tile_npt and rows == 1
    assert tpr == BWD.tile_tpr >= 2 * wide and (tiles - 1) * tpr * s.npt < nvec <= tiles * tpr * s.npt
    assert grid == M or (grid < M and grid % (wide // np.gcd(N, wide)) == 0)
    assert ("reduce" in plan.launch) == (grid > 1) == (not plan.direct)
    sums = plan.launch["rowsums"]
    parts = "rowsums_merge" in plan.launch
    assert "cln::peeled" in sums.kern.name and ("cln::in_parts" in sums.kern.name) == parts
    if parts:
        (rows, nparts), (tpr, one) = sums.grid, sums.block
        assert rows == M and one == 1
        _check_parts_geometry(nparts, tpr, s.npt, wide, M, N, warp, BWD.rowsums_tpr,
                              BWD.parts_per_sm)
    else:
        assert sums.block == (BWD.rowsums_tpr, 1) and sums.grid[0] <= M


@given(st.sampled_from(["float16", "bfloat16", "float32", "float64"]), st.integers(1, 1 << 18),
       st.integers(1, 1 << 17), WARPS, st.booleans(), st.booleans(), st.booleans())
@example("bfloat16", 37459, 3583, 32, False, True, False)
@example("bfloat16", 2670, 50257, 32, False, True, False)
@example("float16", 8, 3583, 32, False, True, False)
@example("float16", 8, 3583, 32, False, True, True)
@example("bfloat16", 64, 1048575, 32, False, False, False)
@example("float32", 300, 20001, 64, True, True, False)
def test_fused_add_rows_peeled_where_plain_rows_are(dt, M, N, warp, hip, is_ln, f32_h):
    """The fused add's forward peels the rows the plain forward peels where h is x's dtype
    (never for a float32 h of 16-bit rows): the plain plan where that is one block of direct
    rows or chunks, or parts of at most ``sms * parts_rows_add`` rows; the same block unstaged
    where the plain rows stage; one block of 8 vectors per thread, or chunks, for more rows
    where the plain rows go in parts, and where they split over a cluster. Its kernels add the
    residual."""
    dtype = _dtype(dt)
    hdtype = np.dtype("float32") if f32_h and dtype.itemsize == 2 else dtype
    plain, _ = _plan_without_gpu("fwd", dt, M, N, warp, hip=hip, peel=True, is_ln=is_ln)
    fused, built = _plan_without_gpu("fwd", dt, M, N, warp, hip=hip, peel=True, is_ln=is_ln,
                                     hdtype=hdtype)
    assert fused.spec.hdtype == hdtype
    assert fused.spec.peeled == (plain.spec.peeled and hdtype == dtype)
    assert set(built.values()) <= _plan.all_kernel_names(warp, hip=hip)
    if not fused.spec.peeled:
        return
    parts = plain.variant == "fwd_peeled_parts" and M <= 132 * FWD.parts_rows_add
    assert fused.launch.keys() == ({"fwd_parts", "fwd"} if parts else {"fwd"})
    assert all("_add" in launch.kern.name for launch in fused.launch.values())
    if parts or plain.variant in ("fwd_peeled", "fwd_peeled_early", "fwd_peeled_chunked"):
        assert (fused.variant, fused.grid, fused.block, fused.spec.npt) == \
            (plain.variant, plain.grid, plain.block, plain.spec.npt)
    elif plain.variant == "fwd_peeled_staged":
        assert (fused.variant, fused.block, fused.spec.npt, fused.smem) == \
            ("fwd_peeled", plain.block, plain.spec.npt, 0)
    else:  # the fused add has no peeled cluster
        assert plain.variant in ("fwd_peeled_parts", "fwd_peeled_cluster")
        assert fused.variant == "fwd_peeled_chunked" or \
            (fused.variant, fused.spec.npt) == ("fwd_peeled", 8)


@given(st.sampled_from(["float16", "bfloat16", "float32", "float64"]), st.integers(1, 1 << 18),
       st.integers(1, 1 << 17), WARPS, st.booleans(), st.booleans())
@example("bfloat16", 37459, 3583, 32, False, True)
@example("bfloat16", 2670, 50257, 32, False, False)
@example("float16", 8, 3583, 32, False, True)
@example("float32", 1000, 4099, 64, True, True)
def test_fused_add_backward_rows_peeled_where_plain_rows_are(dt, M, N, warp, hip, is_ln):
    """The fused add's backward peels exactly the rows the plain backward peels, with its plan
    (variant, grid, block, launches), on kernels that add dresidual to dx; elsewhere it runs
    unpeeled, as before."""
    plain, _ = _plan_without_gpu("bwd", dt, M, N, warp, hip=hip, peel=True, is_ln=is_ln)
    fused, built = _plan_without_gpu("bwd", dt, M, N, warp, hip=hip, peel=True, is_ln=is_ln,
                                     residual=True)
    assert fused.spec.residual and fused.spec.peeled == plain.spec.peeled
    if plain.spec.peeled:
        assert (fused.variant, fused.grid, fused.block, fused.spec.npt) == \
            (plain.variant, plain.grid, plain.block, plain.spec.npt)
        assert fused.launch.keys() == plain.launch.keys()
        assert "cln::dresidual" in fused.kern.name and "cln::dresidual" not in plain.kern.name
    assert set(built.values()) <= _plan.all_kernel_names(warp, hip=hip)


def _check_fwd_parts(dt, M, N, warp, target, hip, hdtype):
    plan, built = _plan_without_gpu("fwd", dt, M, N, warp, target == "sm_90", hip=hip,
                                    hdtype=hdtype, config=NO_RESIDENT)
    s = plan.spec
    assert set(built.values()) <= _plan.all_kernel_names(warp, hip=hip, clusters=target == "sm_90")
    if plan.variant != "fwd_parts":
        assert "fwd_parts" not in plan.launch
        return
    assert s.vec * s.dtype.itemsize == 16 and -(-N // s.vec) > FWD.tpr_max * FWD.npt
    (parts, rows), (tpr, one) = plan.grid, plan.block
    assert rows == M and one == 1
    _check_parts_geometry(parts, tpr, FWD.npt, s.vec, M, N, warp, FWD.tpr_max, FWD.parts_per_sm)
    assert set(plan.launch) == {"fwd_parts", "fwd"}
    assert plan.launch["fwd"].kern.name == built["fwd_apply"]


@given(st.sampled_from([1, 2, 8]), st.integers(1, 264), st.integers(1 << 15, 1 << 21),
       st.sampled_from(["sm_90", "sm_80"]))
@example(1, 2, 131072, "sm_90")
def test_forward_parts_cover_the_row_whatever_vectors_per_thread(npt, M, N, target):
    """The parts' geometry counts the vectors per thread that norm_fwd_parts is built with,
    not the config's ``npt``: every part of the grid starts within the row (the kernel traps on
    a part past it), and the parts cover it."""
    config = Config(tuning=dict(fwd_npt=npt, fwd_resident_npt=0))
    plan, _ = _plan_without_gpu("fwd", "float16", M, N, 32, target == "sm_90", config=config)
    if plan.variant != "fwd_parts":
        return
    (parts, rows), (tpr, _) = plan.grid, plan.block
    assert rows == M
    _check_parts_geometry(parts, tpr, _plan.FWD_PARTS_NPT, 8, M, N, 32, FWD.tpr_max,
                          FWD.parts_per_sm)


@given(st.sampled_from(["float16", "bfloat16", "float32", "float64"]), st.integers(1, 1 << 12),
       st.integers(1, 1 << 21), WARPS, st.sampled_from(["sm_90", "sm_80", "hip"]))
@example("bfloat16", 1, 1 << 20, 32, "sm_90")
@example("bfloat16", 264, 1 << 20, 32, "sm_80")
@example("float32", 3, 70001, 64, "hip")
@example("float16", 8, 3583, 32, "sm_90")  # two chunks: one block per row
def test_long_backward_row_sums_in_parts_for_few_rows(dt, M, N, warp, target):
    """Row sums in parts over the grid, as their kernels need them (any device): 16-byte
    vectors, the parts' kernel exactly where a merge adds them, blocks of whole warps of at
    most ``rowsums_tpr`` threads, the parts covering the row, each row within its share of
    ``parts_per_sm`` blocks per SM, one warp per row adding them. Which rows is the golden
    table's business."""
    hip = target == "hip"
    plan, built = _plan_without_gpu("bwd", dt, M, N, warp, target == "sm_90", hip=hip,
                                    config=ROW_SUMS)
    assert set(built.values()) <= _plan.all_kernel_names(warp, hip=hip, clusters=target == "sm_90")
    if "rowsums" not in plan.launch:
        return
    rs, s = plan.launch["rowsums"], plan.spec
    parts = "rowsums_merge" in plan.launch
    assert parts == (rs.kern.name == built.get("rowsums_parts"))
    if not parts:
        return
    assert s.vec * s.dtype.itemsize == 16
    (rows, nparts), (tpr, one) = rs.grid, rs.block
    assert rows == M and one == 1
    _check_parts_geometry(nparts, tpr, s.npt, s.vec, M, N, warp, BWD.rowsums_tpr,
                          BWD.parts_per_sm)
    merge = plan.launch["rowsums_merge"]
    assert merge.block[0] == warp and merge.grid[0] * merge.block[1] >= M


@given(st.sampled_from(["float16", "bfloat16", "float32", "float64"]), st.integers(1, 1 << 12),
       st.integers(1 << 13, 1 << 19), WARPS, st.booleans(), st.sampled_from([8, 16]))
@example("bfloat16", 512, 1 << 18, 32, True, 16)  # 16 tiles of 1024 threads
@example("bfloat16", 2, 1 << 18, 32, True, 16)  # two rows: resident_rows' bound
@example("bfloat16", 1, 1 << 18, 32, True, 16)  # one row: row sums and tiles
@example("float16", 100, 200000, 32, True, 16)  # not a whole number of vectors per thread
@example("bfloat16", 1024, 1 << 17, 32, True, 16)  # the register tiles hold it: not here
@example("bfloat16", 512, 1 << 18, 32, True, 8)  # the driver places no 16-block cluster
def test_backward_rows_held_in_a_clusters_shared_memory(dt, M, N, warp, ln, most):
    """Backward rows whose x and dy are held in the shared memory of a cluster's tiles, as
    norm_bwd_resident needs them: ``cluster_tiles_long`` tiles of whole warps whose
    ``resident_npt`` vectors per thread hold the row, two buffers of x and dy and gamma once
    in shared memory, dgamma/dbeta written by the cluster itself only where it is the only
    one. Which rows are held there is the golden table's business."""
    plan, nvec = _resident_plan("bwd", dt, M, N, warp, ln, most)
    if plan is None:
        return
    tpr, vec, tiles, npt = plan.block[0], plan.spec.vec, plan.spec.tiles, plan.spec.npt
    assert tiles == BWD.cluster_tiles_long and npt == BWD.resident_npt and tpr % warp == 0
    assert tpr * tiles * npt >= nvec and plan.grid[1] == tiles
    assert plan.smem == npt * tpr * (4 * 16 + vec * plan.spec.wdtype.itemsize)
    assert not plan.direct or plan.grid[0] == 1


@given(st.sampled_from(["float16", "bfloat16", "float32", "float64"]), st.integers(1, 1 << 10),
       st.integers(1 << 15, 1 << 21), WARPS, st.booleans(), st.sampled_from(["sm_90", "sm_80",
                                                                             "hip"]))
@example("bfloat16", 64, 1 << 20, 32, True, "sm_90")  # one row of tiles
@example("bfloat16", 128, 1 << 20, 32, True, "sm_90")  # grid_rows in one row of tiles
@example("bfloat16", 2, 1 << 20, 32, True, "sm_90")  # few rows: one a step
@example("bfloat16", 129, 1 << 20, 32, True, "sm_90")  # past grid_rows: row sums and tiles
@example("float32", 256, 1 << 18, 32, False, "sm_90")  # several rows of tiles
@example("bfloat16", 300, 300000, 32, True, "sm_80")  # a partial last tile; no clusters
@example("bfloat16", 512, 1 << 18, 32, True, "sm_90")  # the resident tiles hold it: not here
@example("float64", 1, 1 << 20, 32, True, "sm_90")  # float64 sums: not here
def test_backward_rows_split_over_a_cooperative_grid(dt, M, N, warp, ln, target):
    """Backward rows on a cooperative grid, as norm_bwd_grid needs them: CUDA, float32 sums,
    16-byte vectors; column tiles of ``grid_tpr`` threads x ``grid_npt`` vectors covering the
    row, as many rows of tiles as run at once (at most M), ``grid_buffers`` rows of x and dy
    and gamma in shared memory, a step of one row or ``grid_step_rows``; dgamma/dbeta written
    by the grid itself only where it is one row of tiles, else partials summed after. Which
    rows run there is the golden table's business."""
    hip = target == "hip"
    plan, built = _plan_without_gpu("bwd", dt, M, N, warp, clusters=target == "sm_90",
                                    hip=hip, is_ln=ln)
    assert set(built.values()) <= _plan.all_kernel_names(warp, hip=hip,
                                                         clusters=target == "sm_90")
    if plan.variant != "bwd_grid":
        return
    dtype, s = _dtype(dt), plan.spec
    assert not hip and s.vec * dtype.itemsize == 16 and dt != "float64"
    span = BWD.grid_tpr * BWD.grid_npt
    groups, columns = plan.grid
    assert s.grid[:2] == (BWD.grid_buffers, BWD.grid_lag) and s.grid[2] in (1, BWD.grid_step_rows)
    assert s.npt == BWD.grid_npt and plan.block == (BWD.grid_tpr, 1) and 1 <= groups <= M
    assert columns * span >= N // s.vec > (columns - 1) * span
    assert plan.smem == (BWD.grid_buffers * 32 + s.vec * dtype.itemsize) * span
    resident = _fake_resident_blocks(None, BWD.grid_tpr, plan.smem)
    assert groups * columns <= 132 * resident  # every block resident: a cooperative launch
    assert plan.direct == (groups == 1) and ("reduce" in plan.launch) == (groups > 1)


@given(st.sampled_from(["float16", "bfloat16", "float32", "float64"]), st.integers(1, 1 << 16),
       st.integers(1, 1 << 19), WARPS, st.booleans(), st.booleans())
@example("bfloat16", 2048, 65536, 32, True, False)  # 8 tiles hold it
@example("bfloat16", 1024, 131072, 32, True, False)  # 16 tiles
@example("float32", 1, 65536, 32, True, True)  # 16 tiles, fused
@example("bfloat16", 64, 131080, 32, True, False)  # past 16 tiles: row sums, then tiles
@example("float16", 3, 70001, 32, True, False)  # single elements past 8 tiles: not built
@example("bfloat16", 1, 65536, 32, True, False)  # few rows 8 tiles hold: 16 tiles
@example("bfloat16", 5, 65536, 32, True, False)  # more: 8 tiles
@example("float16", 2, 65535, 32, True, False)  # single elements: 8 tiles, whatever M
def test_backward_long_rows_in_the_fewest_cluster_tiles_that_hold_them(dt, M, N, warp,
                                                                       clusters, residual):
    """Backward rows in a cluster of column tiles, as the cluster kernels need them, plain or
    fused: only where clusters exist, 8 tiles (16 past the portable size: 16-byte vectors
    only), whole warps of ``cluster_npt`` vectors per thread covering the row, no row sums
    before them. Which rows run there is the golden table's business."""
    plan, built = _plan_without_gpu("bwd", dt, M, N, warp, clusters, residual=residual)
    s = plan.spec
    assert set(built.values()) <= _plan.all_kernel_names(warp, clusters=clusters)
    if not plan.variant.startswith("bwd_cluster"):
        return
    wide = s.vec * s.dtype.itemsize == 16
    assert clusters and s.tiles in (BWD.cluster_tiles, *((BWD.cluster_tiles_long,) * wide))
    assert plan.grid[1] == s.tiles and "rowsums" not in plan.launch
    assert plan.block[0] % warp == 0 and plan.block[0] <= _plan.bwd_threads(BWD.cluster_npt)
    assert plan.block[0] * s.tiles * s.npt * s.vec >= N


@given(st.sampled_from(["float16", "bfloat16", "float32"]), st.integers(12, 1 << 10),
       st.integers(1 << 14, 1 << 19), WARPS)
@example("bfloat16", 1024, 131072, 32)  # the backward in 16 tiles
@example("bfloat16", 256, 1 << 19, 32)  # RMSNorm's forward in 16 blocks
def test_rows_for_16_blocks_where_the_driver_places_only_8(dt, M, N, warp):
    """Where the driver places no cluster past 8 blocks (a GPU whose GPCs hold fewer SMs, a MIG
    slice), no plan asks for one: the rows 16 blocks would take run as without them (row sums
    and tiles; rows in parts where few, else a block each); plans of rows 8 blocks hold are
    unchanged."""
    no16 = Config(tuning=dict(fwd_cluster_tiles_long=0, bwd_cluster_tiles_long=0))
    for pass_, ln in (("bwd", True), ("fwd", False)):
        plan, built = _plan_without_gpu(pass_, dt, M, N, warp, is_ln=ln, most_blocks=8)
        want, _ = _plan_without_gpu(pass_, dt, M, N, warp, is_ln=ln, config=no16)
        assert plan.spec.tiles <= 8 and (plan.variant, plan.grid, plan.block) == (
            want.variant, want.grid, want.block)
        assert set(built.values()) <= _plan.all_kernel_names(warp)


@given(st.sampled_from(["float16", "bfloat16", "float32", "float64"]), st.integers(1, 1 << 12),
       st.integers(1, 1 << 21), WARPS, st.booleans())
@example("bfloat16", 1, 1 << 20, 32, True)
@example("bfloat16", 64, 1 << 20, 32, True)
def test_long_backward_row_sums_over_a_cluster_for_few_rows(dt, M, N, warp, clusters):
    """Row sums (where not in parts) as their kernels need them: over a cluster of
    ``cluster_tiles`` blocks per row only where clusters exist and the module builds that kernel
    (16-byte vectors, single elements), a grid of (M, tiles); else a grid of at most M blocks;
    blocks of ``rowsums_tpr`` threads of one row. Which rows split is the golden table's
    business."""
    plan, built = _plan_without_gpu("bwd", dt, M, N, warp, clusters,
                                    config=Config(tuning=dict(bwd_parts_rows=0, **ROW_SUMS_ROWS)))
    assert set(built.values()) <= _plan.all_kernel_names(warp, clusters=clusters)
    if "rowsums" not in plan.launch:
        return
    rs, s = plan.launch["rowsums"], plan.spec
    assert rs.block == (BWD.rowsums_tpr, 1)
    if rs.kern.name == built.get("rowsums_cluster"):
        assert clusters and (s.vec * s.dtype.itemsize == 16 or s.vec == 1)
        assert rs.grid == (M, BWD.cluster_tiles)
    else:
        assert len(rs.grid) == 1 and rs.grid[0] <= M


@given(st.sampled_from(["float16", "bfloat16", "float32", "float64"]), st.integers(1, 1 << 16),
       st.integers(1, 1 << 21), WARPS, st.sampled_from(["sm_90", "sm_80", "hip"]))
@example("bfloat16", 1, 1 << 20, 32, "sm_90")
@example("float32", 64, 65540, 64, "hip")
@example("bfloat16", 64, 65538, 32, "sm_80")
def test_backward_partials_where_and_how_summed(dt, M, N, warp, target):
    """The backward's dgamma/dbeta partials: none on one row of blocks (each block writes its
    columns' sums itself). Those of rows of at least ``reduce_cols_n`` elements, a multiple of
    4, are summed four columns per thread in blocks of one row of threads, the grid covering 2N
    columns; all other partials 32 columns per block of eight row groups; on any device."""
    hip = target == "hip"
    plan, built = _plan_without_gpu("bwd", dt, M, N, warp, target == "sm_90", hip=hip)
    # one row of blocks writes dgamma/dbeta itself; the last block or a cluster sums its own
    assert plan.direct == (plan.grid[0] == 1 and plan.variant not in ("bwd_last", "bwd_csum"))
    assert ("reduce" in plan.launch) == (plan.grid[0] > 1 and plan.variant not in (
        "bwd_last", "bwd_csum"))
    if "reduce" not in plan.launch:
        return
    red = plan.launch["reduce"]
    cols = N >= BWD.reduce_cols_n and N % 4 == 0
    assert (red.kern.name == built.get("reduce_cols")) == cols
    per_block = red.block[0] * 4 if cols else 32
    assert red.block[1] == (1 if cols else 8) and (red.grid[0] - 1) * per_block < 2 * N
    assert red.grid[0] * per_block >= 2 * N
    assert set(built.values()) <= _plan.all_kernel_names(warp, hip=hip, clusters=target == "sm_90")


@given(st.sampled_from(["float16", "bfloat16", "float32"]), st.integers(1, 1 << 20),
       st.integers(1, 1 << 18), WARPS, st.booleans())
def test_backward_rows_come_from_tickets_exactly_where_staged_blocks_span_warps(dt, M, N, warp,
                                                                               clusters):
    """A backward plan has a kernel that takes its rows from tickets (RowTickets) exactly where
    its blocks stage rows wider than a warp (the tickets are handed on through the reductions'
    block barrier) in one column tile (one counter, one set of rows): the "_dyn" kernel of its
    module, beside the static one that deterministic calls keep, on the same grid."""
    plan, built = _plan_without_gpu("bwd", dt, M, N, warp, clusters)
    staged = plan.variant == "bwd_staged"
    want = staged and plan.block[0] > warp and plan.grid[1] == 1
    assert plan.dynamic == want, (plan.variant, plan.block, plan.grid)
    assert not plan.dynamic or "bwd_staged_dyn" in built
    assert plan.variant in built


@given(st.sampled_from(["float16", "bfloat16", "float32", "float64"]), st.integers(1, 1 << 14),
       st.integers(1, 1 << 14), WARPS, st.booleans())
@example("float16", 32, 512, 32, True)  # one cluster of all rows
def test_backward_cluster_plan_holds_every_row_at_once(dt, M, N, warp, clusters):
    """A backward whose dgamma/dbeta one cluster sums in shared memory, as its kernel needs it:
    clusters, one cluster of ``csum_blocks`` blocks holding every row in one pass (no block
    loops over rows), whole warps, its shared memory on the SM. Which rows run there is the
    golden table's business."""
    plan, _ = _plan_without_gpu("bwd", dt, M, N, warp, clusters)
    if plan.variant != "bwd_csum":
        return
    assert clusters
    tpr, rpb = plan.block
    assert plan.grid == (BWD.csum_blocks, 1) and plan.spec.tiles == BWD.csum_blocks
    assert M <= BWD.csum_blocks * rpb  # no block loops over rows
    assert (tpr * rpb) % warp == 0 and tpr * rpb <= _plan.bwd_threads(plan.spec.npt)
    assert 0 < plan.smem <= _SMEM_PER_SM


@given(st.sampled_from(["float16", "bfloat16", "float32", "float64"]), st.integers(1, 1 << 16),
       st.integers(1, 1 << 17), WARPS, st.booleans(), st.booleans())
@example("bfloat16", 512, 262144, 32, True, False)  # many rows of 1024-thread blocks: unsplit
@example("bfloat16", 2048, 65536, 32, True, False)  # 256-thread blocks: split
@example("bfloat16", 64, 1 << 20, 32, False, False)  # few rows: split, in chunks
def test_fused_add_plans_direct_rows_in_the_offline_list(dt, M, N, warp, wide_h, hip):
    """The fused residual add's forward runs its own kernels, every one compiled offline, as
    they need it: 16-byte vectors or single elements, h of the asked dtype; rows split over a
    cluster in its cluster kernel alone; rows of one chunk only where the chunk holds the row
    (else in chunks, or in parts). Which of them runs is the golden table's business."""
    dtype = _dtype(dt)
    hdtype = h_dtypes(dtype)[-1 if wide_h else 0]
    plan, built = _plan_without_gpu("fwd", dt, M, N, warp, not hip, hip=hip, hdtype=hdtype)
    assert set(built.values()) <= _plan.all_kernel_names(warp, hip=hip)
    if plan.variant == "fwd_parts":  # few long rows: as the plain forward's, tested above
        assert set(plan.launch) == {"fwd_parts", "fwd"} and "fwd_add_parts<" in str(built)
        return
    s = plan.spec
    assert s.vec in (16 // dtype.itemsize, 1) and s.hdtype == hdtype
    if s.tiles > 1:
        assert not hip and set(built) == {"fwd_cluster"}
        assert all(n.startswith("norm_fwd_add_cluster<") for n in built.values())
        return
    assert set(built) - {"fwd_parts", "fwd_apply"} == {"fwd_add", "fwd_add_chunked"}
    assert plan.variant in ("fwd_add", "fwd_add_chunked")
    assert plan.variant == "fwd_add_chunked" or s.npt * plan.block[0] * s.vec >= N


@given(st.sampled_from(["float16", "bfloat16", "float32", "float64"]), st.integers(1, 1 << 16),
       st.integers(1, 1 << 21), WARPS, st.sampled_from(["sm_90", "sm_80", "hip"]))
@example("bfloat16", 512, 1 << 18, 32, "sm_90")  # held in 16 tiles' shared memory
@example("bfloat16", 64, 1 << 20, 32, "sm_90")  # over a cooperative grid
@example("float32", 256, 1 << 18, 32, "sm_80")  # the grid where no cluster is
@example("bfloat16", 128, 1 << 20, 32, "sm_90")  # too many sums to collect: not the grid
@example("float16", 32, 512, 32, "sm_90")  # one cluster of all rows
def test_fused_add_backward_plans_its_own_kernels(dt, M, N, warp, target):
    """The backward with dresidual builds only the fused add's kernels (in the offline list), at
    16-byte vectors or single elements, and never takes rows from tickets; on the cooperative
    grid each block collects at most ``grid_add_sums`` tiles' row sums, and its shared memory
    holds dresidual's buffers too. Which of them runs is the golden table's business."""
    hip, clusters = target == "hip", target == "sm_90"
    plan, built = _plan_without_gpu("bwd", dt, M, N, warp, clusters, hip=hip, residual=True)
    assert set(built.values()) <= _plan.all_kernel_names(warp, hip=hip, clusters=clusters)
    assert all(n.startswith(("norm_bwd_add", "norm_bwd_rowsums", "norm_bwd_reduce"))
               or n.endswith(("cln::dresidual>", "cln::dresidual_staged>"))
               for n in built.values())
    assert plan.spec.residual and not plan.dynamic
    assert plan.spec.vec in (16 // plan.spec.dtype.itemsize, 1)
    if plan.variant == "bwd_grid":
        groups, columns = plan.grid
        span = BWD.grid_tpr * BWD.grid_npt
        assert -(-M // groups) * columns <= BWD.grid_add_sums
        assert plan.smem == (BWD.grid_buffers * 48 + plan.spec.vec * plan.spec.dtype.itemsize) \
            * span


@pytest.mark.parametrize("dt,N", [("bfloat16", 1 << 18), ("float16", 140000), ("float32", 1 << 17)])
def test_fused_add_resident_backward_stages_dresidual_where_it_fits(dt, N):
    """The fused add's backward on the resident tiles gives each block one buffer more (of
    dresidual, staged by the kernel that stages it) where a block may have it and as many
    clusters fit with it; elsewhere the plain backward's shared memory (and the kernel that
    reads dresidual from L2)."""
    plain, _ = _plan_without_gpu("bwd", dt, 64, N, 32)
    assert plain.variant == "bwd_resident"
    staged, _ = _plan_without_gpu("bwd", dt, 64, N, 32, residual=True)
    assert (staged.variant, staged.grid, staged.block) == (plain.variant, plain.grid, plain.block)
    assert staged.smem == plain.smem + BWD.resident_npt * plain.block[0] * 16
    assert staged.kern.name.endswith(", cln::dresidual_staged>")
    assert staged.launch["bwd"].kern is staged.kern
    from_l2, _ = _plan_without_gpu("bwd", dt, 64, N, 32, residual=True, most_smem=plain.smem)
    assert (from_l2.variant, from_l2.smem) == ("bwd_resident", plain.smem)
    assert from_l2.kern.name.endswith(", cln::dresidual>")


@pytest.mark.parametrize("fields", [
    {"grid_buffers": 5, "grid_step_rows": 2}, {"grid_step_rows": 0}, {"grid_lag": 4},
    {"grid_buffers": 4, "grid_step_rows": 2, "grid_lag": 2}, {"grid_lag": -1}])
def test_grid_buffers_hold_whole_steps_and_more_than_the_lag(fields):
    """Grid buffers that do not hold whole steps, or no step past the lag, are refused when the
    config is made, naming the three rows (the kernel would not compile, or wait on itself)."""
    with pytest.raises(ValueError, match="grid_buffers.*grid_step_rows.*grid_lag"):
        Config(tuning={f"bwd_{k}": v for k, v in fields.items()})
    ok = Config(tuning=dict(bwd_grid_buffers=6, bwd_grid_step_rows=3, bwd_grid_lag=1))
    assert _tuning.settings(ok, "sm_90").bwd.grid_step_rows == 3


@pytest.mark.parametrize("pass_,dt,M,N,peel,refused", [
    ("bwd", "bfloat16", 1, 2**25 + 1, False, True),  # single elements: 65537 tiles of 512
    ("bwd", "bfloat16", 1, 2**25 + 1, True, False),  # peeled: tiles of 16-byte vectors
    ("bwd", "bfloat16", 1, 2**24 + 1, False, False), ("bwd", "float32", 3, 2**27, True, True),
    ("bwd", "bfloat16", 1, 2**27, True, False), ("bwd", "float32", 2, 2**29, True, True),
    ("fwd", "bfloat16", 1, 2**25 + 1, True, False), ("fwd", "float32", 3, 2**29, True, False)])
def test_plans_past_the_grid_limit_are_refused(pass_, dt, M, N, peel, refused):
    """A plan one of whose launches needs more blocks than the device's grid holds in a
    dimension (the backward's column tiles or row sums of rows tens of millions long) is a
    ValueError naming the rows' length, raised while planning; the others stand, within it.
    ``peel``: rows that may peel (False: rows that start unlike, in single elements)."""
    if refused:
        with pytest.raises(ValueError, match=f"rows of {N} elements needs a grid"):
            _plan_without_gpu(pass_, dt, M, N, 32, peel=peel)
        return
    plan, _ = _plan_without_gpu(pass_, dt, M, N, 32, peel=peel)
    for launch in plan.launch.values():
        assert launch.grid[0] < 2**31 and max(launch.grid[1:], default=1) <= 65535


def test_plan_caches_are_bounded():
    assert _plan.plan_fwd.cache_info().maxsize == _plan.PLAN_CACHE_SIZE
    assert _plan.plan_bwd.cache_info().maxsize == _plan.PLAN_CACHE_SIZE


def test_hip_modules_leave_out_the_staged_and_cluster_kernels():
    cuda, hip = _plan.all_kernel_names(32), _plan.all_kernel_names(32, hip=True)
    assert hip < cuda
    assert not any("cln::staged" in n or "cluster" in n or "csum" in n for n in hip)
    # CUDA before sm_90: staged rows, no clusters (compiled offline for sm_80 alone)
    sm80 = _plan.all_kernel_names(32, clusters=False)
    assert hip < sm80 < cuda and any("cln::staged" in n for n in sm80)
    assert not any("cluster" in n or "csum" in n or ", 8>" in n for n in sm80)
    # half of the specializations before the configs were values, the fused add's apart (the
    # backward's too: its kernels of their own, norm_bwd_add* or cln::dresidual, since dresidual
    # left the plain ones)
    assert len([n for n in cuda if "_add" not in n and "cln::dresidual" not in n]) < 2671 // 2


@pytest.mark.parametrize("partials", [False, True])
def test_peeled_backward_flushes_through_partials(partials, monkeypatch):
    """The peeled backward kernel has no atomic flush: a call that allows atomics (the config's
    atomic_flush, deterministic=False) still gets its partials and the reduction."""
    pytest.importorskip("cupy")  # the launch layer's hot path
    from cupyln import _passes

    monkeypatch.setattr(_passes, "launcher", lambda launch: launch)  # no driver here

    plan, _ = _plan_without_gpu("bwd", "float16", 700000, 1001, 32, peel=True)
    assert plan.variant == "bwd_peeled" and "reduce" in plan.launch
    hot = _passes.HotBwd(0, plan, (700000, 1001), (1001,), np.dtype("float16"),
                         (True, True, True), None, partials, False, 1001, 1001, 700000, 1001)
    assert not hot.atomic and not hot.flushed and hot.partial is not None


class _Arr(NamedTuple):  # what _peelable reads of an array: its address
    data: "_Ptr"


class _Ptr(NamedTuple):
    ptr: int


@given(st.sampled_from(["float16", "bfloat16", "float32", "float64"]), st.integers(1, 5000),
       st.lists(st.tuples(st.integers(0, 63), st.integers(0, 40)), min_size=1, max_size=3),
       st.lists(st.one_of(st.none(), st.integers(0, 63)), min_size=1, max_size=2),
       st.integers(1, 8))
def test_rows_peel_where_inputs_and_outputs_start_alike_row_after_row(dt, N, inputs, outs_at,
                                                                      vec):
    """Narrower vectors than 16 bytes peel exactly where each input's row r starts at the same
    offset within 16 bytes as each output's row r (rows of N; allocated: 256-byte aligned), for
    every r: the rule the peeled kernels' heads rely on (the fused add: y and h, or dx; x, the
    residual or dresidual, dy). float64 rows never peel (the general kernels alone)."""
    dtype = _dtype(dt)
    s, wide = dtype.itemsize, VEC[dtype]
    vec = min(vec, wide)
    arrays = [(_Arr(_Ptr(4096 + off * s)), N + pad) for off, pad in inputs]
    outs = [None if at is None else _Arr(_Ptr(8192 + at * s)) for at in outs_at]
    starts = [0 if o is None else o.data.ptr for o in outs]
    alike = all((a.data.ptr + r * ld * s - (at + r * N * s)) % 16 == 0
                for a, ld in arrays for at in starts for r in range(2 * wide))
    alike = alike and all((b - starts[0]) % 16 == 0 for b in starts)
    assert _layout.peelable(dtype, vec, N, arrays, outs) == (vec < wide and alike
                                                             and dt != "float64")


# The golden table: each benchmark shape's plans per architecture on the mocked devices (their
# facts: 132 SMs, 64-register kernels, one cluster of up to 16 blocks at a time), so that a
# refactor of the planner that changes a plan shows which: the shapes of the benchmark's list
# and of its long-row sweep (odd lengths peeled, as contiguous calls peel them), each pass
# plain, with the fused add (h in x's dtype) and with y in float8. CUPYLN_WRITE_GOLDEN=1
# rewrites it (then the diff of tests/golden_plans.json is the change to review).
GOLDEN = pathlib.Path(__file__).with_name("golden_plans.json")
ARCHS = {"sm_90": dict(warp=32), "sm_80": dict(warp=32, clusters=False),
         "cdna": dict(warp=64, hip=True), "rdna": dict(warp=32, hip=True)}
KINDS = {"fwd": dict(pass_="fwd"), "bwd": dict(pass_="bwd"), "fwd_add": dict(pass_="fwd"),
         "bwd_add": dict(pass_="bwd", residual=True), "fwd_float8": dict(pass_="fwd", quant="row")}


def _golden_shapes():
    from cupyln.bench import SWEEP

    listed = json.loads((pathlib.Path(_plan.__file__).parent / "benchmark_shapes.json")
                        .read_text())
    shapes = [(op, M, N, dt) for op in ("layernorm", "rmsnorm") for M, N, dt in listed[op]]
    return shapes + [s for s in SWEEP if s not in shapes]


def _plan_text(plan):
    s = plan.spec
    launches = "; ".join(f"{k}: {ln.kern.name} grid {list(ln.grid)} block {list(ln.block)} "
                         f"smem {ln.smem}" for k, ln in sorted(plan.launch.items()))
    return (f"{plan.variant} vec {s.vec} npt {s.npt} tiles {s.tiles} tpr {s.tpr} | "
            f"{launches}")


def _golden_rows():
    rows = {}
    for arch, kw in ARCHS.items():
        for op, M, N, dt in _golden_shapes():
            for kind, how in KINDS.items():
                h = _dtype(dt) if kind == "fwd_add" else None
                try:
                    plan, _ = _plan_without_gpu(dt=dt, M=M, N=N, is_ln=op == "layernorm",
                                                peel=True, hdtype=h, **how, **kw)
                    text = _plan_text(plan)
                except ValueError as e:  # refused before any work (float8's long rows)
                    text = f"ValueError: {e}"
                rows[f"{arch} {op} {kind} {M}x{N} {dt}"] = text
    return rows


@functools.cache
def _offline_names(warp, hip, clusters):
    return _plan.all_kernel_names(warp, hip=hip, clusters=clusters)


@given(st.sampled_from(["float16", "bfloat16", "float32", "float64"]), st.integers(1, 1 << 18),
       st.one_of(st.integers(1, 1 << 14), st.integers(1, 1 << 21)), st.sampled_from(sorted(ARCHS)),
       st.sampled_from(sorted(KINDS)), st.booleans(), st.booleans())
@example("bfloat16", 2670, 50257, "sm_90", "bwd", True, True)
@example("float16", 64, 1048575, "sm_90", "fwd_add", False, True)
@example("float32", 3, 400001, "cdna", "fwd", True, True)
def test_every_plan_launches_offline_kernels_within_the_devices_limits(dt, M, N, arch, kind,
                                                                       is_ln, peel):
    """The invariants of every plan, whatever the rules: every kernel of the modules it compiles
    is in the offline compile list of its architecture; each launch's has the argument kinds of
    its C parameters; blocks of at
    most 1024 threads, a row's threads whole warps or (rows within a warp) a power of two;
    grids within the device's limits (or a ValueError before any work); shared memory within
    what a block may opt into."""
    kw = ARCHS[arch]
    warp, hip, clusters = kw["warp"], kw.get("hip", False), kw.get("clusters", True)
    h = _dtype(dt) if kind == "fwd_add" else None
    try:
        plan, built = _plan_without_gpu(dt=dt, M=M, N=N, is_ln=is_ln, peel=peel, hdtype=h,
                                        **KINDS[kind], **kw)
    except ValueError as e:
        assert "rows that one block holds" in str(e) or "past this device's limit" in str(e)
        return
    names = _offline_names(warp, hip, clusters and not hip)
    assert set(built.values()) <= names
    for launch in plan.launch.values():
        name = launch.kern.name
        assert name in built.values(), name
        want = _plan.kernel_args(name.split("<")[0])
        assert launch.kinds == want.replace("X", "d" if dt == "float64" else "f"), name
        tpr, rows = (tuple(launch.block) + (1,))[:2]
        assert tpr * rows <= 1024 and (tpr % warp == 0 or (tpr < warp and not tpr & (tpr - 1)))
        assert all(0 < g <= most for g, most in zip(launch.grid, (2**31 - 1, 65535, 65535),
                                                    strict=False))
        assert 0 <= launch.smem <= 227 * 1024


@given(st.sampled_from(["float16", "bfloat16", "float32", "float64"]), st.integers(1, 1 << 18),
       st.integers(1, 40000), WARPS, st.booleans(), st.booleans(),
       st.sampled_from(["row", "tensor"]))
def test_float8_plans_take_their_kernel_where_one_block_holds_the_row(dt, M, N, warp, add, hip,
                                                                       scaling):
    """y in float8: norm_fwd_q of the offline list, 16-byte vectors or single elements, each
    row in one chunk of one block's threads (at most the kernel's launch bound) and every row
    covered, wherever that many threads of ``npt`` vectors hold the row; a ValueError past
    that. Scaled per row, each thread's y has room in shared memory; under a static scale the
    launch takes none."""
    dtype = _dtype(dt)
    vec = _layout.vec_width(dtype, N, (N,), [])
    h = dtype if add else None
    threads = _plan.QUANT_THREADS if vec > 1 else FWD.tpr_max
    if N > threads * FWD.npt * vec:
        with pytest.raises(ValueError, match="rows that one block holds: at most"):
            _plan_without_gpu("fwd", dt, M, N, warp, hip=hip, hdtype=h, quant=scaling)
        return
    plan, built = _plan_without_gpu("fwd", dt, M, N, warp, hip=hip, hdtype=h, quant=scaling)
    s, (tpr, rpb) = plan.spec, plan.block
    assert plan.variant == "fwd_q" and s.quant == scaling and s.hdtype == h and s.vec == vec
    scaled = "row_scales" if scaling == "row" else "tensor_scale"
    assert plan.kern.name == built["fwd_q"] and \
        f"cln::{'residual_add' if add else 'no_add'}, cln::{scaled}>" in plan.kern.name
    assert built["fwd_q"] in _plan.all_kernel_names(warp, hip=hip)
    assert tpr * s.npt * vec >= N and tpr * rpb <= threads
    assert plan.grid[0] * rpb >= M or plan.grid[0] == 132 * FWD.grid_per_sm
    assert plan.smem == plan.launch["fwd"].smem == \
        (tpr * rpb * s.npt * vec * 4 if scaling == "row" else 0)


def test_float8_threads_are_the_kernels_launch_bound():
    """The planner's thread limit for float8 rows of vectors is the least norm_fwd_q is
    compiled for (512; the flagged kernels 768, single elements 1024): a wider block would fail
    to launch."""
    from cupyln._compile import _read

    src = _read("norm_fwd.cu")
    assert "__launch_bounds__(quant_max_threads(NORM, VEC, sizeof(W))) norm_fwd_q(" in src
    body = src[src.index("constexpr int quant_max_threads("):]
    body = body[: body.index("}")]
    bounds = [int(t) for t in re.findall(r"(?:\?|:)\s*(\d+)", body)]  # the ternaries' values
    assert bounds and min(bounds) == _plan.QUANT_THREADS, bounds
    assert FWD.tpr_max == 1024


def test_the_planner_imports_neither_cupy_nor_the_compiler():
    """The planner is a function of the problem, the device's facts and a config: it imports
    with CuPy unimportable, and loads no compiler and no driver layer (cupyln._facts gathers
    the facts)."""
    code = ("import sys; sys.modules['cupy'] = None; import cupyln._plan; "
            "print(sorted(m for m in ('cupyln._compile', 'cupyln._driver', 'cupyln._facts') "
            "if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]", out.stdout


def test_benchmark_shapes_plan_as_the_golden_table():
    rows = _golden_rows()
    if os.environ.get("CUPYLN_WRITE_GOLDEN"):
        GOLDEN.write_text(json.dumps(rows, indent=1) + "\n")
    golden = json.loads(GOLDEN.read_text())
    changed = {k: (golden.get(k), v) for k, v in rows.items() if golden.get(k) != v}
    assert not changed and set(golden) == set(rows), changed
