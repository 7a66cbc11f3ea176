"""Planning: which kernel runs, with which geometry, for (config, M, N, dtypes, device).

This module is the one place that decides launch geometry: :func:`row_geometry` maps a row
onto threads, :func:`plan_fwd` / :func:`plan_bwd` add the variant and the grid, and
:func:`all_kernel_names` lists every kernel a config can launch (the compile tests build each).
A plan is a function of the problem, the device's facts (:class:`DeviceInfo`, gathered by
``cupyln._facts``: attributes, and the compiled kernels' register use and cluster occupancy)
and the config; this module imports neither CuPy nor the compiler. Plans are cached per
(device facts, config, signature) in bounded LRU caches.
"""

from __future__ import annotations

import dataclasses
import functools
import itertools
import math
from collections.abc import Callable
from typing import NamedTuple

from ._config import DEFAULT, Config
from ._dtypes import ACC_DTYPES, FLOAT64, PARAM_PAIRS, VEC, h_dtypes, tuned, vec_options
from ._spec import Spec
from ._tuning import BwdRows, FwdRows, Settings, family, settings

PLAN_CACHE_SIZE = 1024  # signatures kept per pass; a loop over many sequence lengths evicts


def cdiv(a, b):
    return -(-a // b)


def round_up(a, b):
    return cdiv(a, b) * b


def pow2_ceil(a):
    return 1 << (max(a, 1) - 1).bit_length()


# ----------------------------------------------------------------------------- row geometry


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
    while npt < npt_max and cdiv(nvec, npt) > tpr_max:
        npt *= 2
    tpr = cdiv(nvec, npt)
    if tpr <= warp:
        # short rows: at least 4 threads per row where the row has 4 vectors (measured faster)
        npt = max(1, min(npt, pow2_ceil(nvec) // 4))
        tpr = pow2_ceil(cdiv(nvec, npt))
        npt = min(npt, pow2_ceil(cdiv(nvec, tpr)))
        block = short_block or block
    else:
        tpr = round_up(tpr, warp)
    fits = tpr <= tpr_max
    if not fits:
        tpr = tpr_max
    return Geometry(tpr, npt, max(1, block // tpr), fits)


def warp_rows(g, warp):
    """Rows of geometry ``g`` per whole warp (1 for rows of a warp or more)."""
    return max(1, warp // g.tpr)


def spread(g, M, warp, blocks):
    """Fewer rows per block when M is small, so that about ``blocks`` blocks get work; a block
    keeps at least one full warp (the shuffles assume whole warps)."""
    unit = warp_rows(g, warp)
    return g._replace(rpb=max(unit, min(g.rpb, round_up(cdiv(M, max(1, blocks)), unit))))


def fwd_geometry(cfg: FwdRows, nvec, warp):
    return row_geometry(nvec, warp, cfg.npt, cfg.npt, cfg.tpr_max, cfg.block, cfg.short_block)


def fwd_small_geometry(cfg: FwdRows, nvec, warp):
    """One vector per thread (small M, rows within a warp)."""
    return row_geometry(nvec, warp, 1, 1, cfg.tpr_max, cfg.block, cfg.short_block)


def bwd_geometry(cfg: BwdRows, nvec, warp):
    g = row_geometry(nvec, warp, cfg.npt_min, cfg.npt, cfg.tpr_max, cfg.block)
    return g._replace(rpb=max(1, min(g.rpb, bwd_threads(g.npt) // g.tpr)))


RESIDENT_BWD_THREADS = 1024  # norm_bwd_resident's launch bound


def bwd_threads(npt):
    """The backward kernels' launch bound: threads per block at ``npt`` vectors per thread."""
    return 1024 if npt == 1 else 512


def colsum_bytes(g, rpb, vec, dtype):
    """Shared memory of the backward's column sums over a block's ``rpb`` rows of geometry ``g``
    (block_column_sums; none for one row)."""
    return g.tpr * rpb * vec * ACC_DTYPES[dtype].itemsize if rpb > 1 else 0


def row_kernel_widths(cfg: FwdRows, warp, npt=1):
    """The row threads norm_fwd_row is built for at ``npt`` vectors per thread: for one, 1 to
    ``row_warps`` whole warps; for the general path's ``npt``, 2 to ``row_npt_warps`` whole
    warps within those. (Rows within a warp, stacked, gained nothing measurable: NOTES.)"""
    if npt > 1:
        top = min(cfg.row_warps, cfg.row_npt_warps) if npt == cfg.npt else 0
        return [w * warp for w in range(2, top + 1)]
    return [w * warp for w in range(1, cfg.row_warps + 1)]


def all_kernel_names(warp, config: Config = DEFAULT, hip=False, clusters=None):
    """Name expressions of every kernel ``config`` can launch on a device of this warp size,
    CUDA or (``hip``) ROCm, which has neither cp.async staging nor clusters; ``clusters``
    (default: CUDA's) False for a CUDA device without them (before sm_90)."""
    clusters = not hip if clusters is None else clusters and not hip
    config = settings(config, family(hip, warp, clusters))
    names = set()
    for t, w in PARAM_PAIRS:
        for v in vec_options(t):
            s = Spec(t, w, v, 1, warp, hip=hip)
            fwd = _fwd_specs(config.fwd, s, clusters) if v in vec_options(t, False) else ()
            for spec, pass_ in itertools.chain(fwd, _bwd_specs(config.bwd, s, clusters)):
                names.update(spec.names(pass_).values())
    return names


def _fwd_specs(cfg: FwdRows, s: Spec, clusters):
    """(spec, pass) of every forward kernel of one (dtypes, norm, vector width) ``s``."""
    if s.wide and clusters:  # rows split over a cluster
        for h in (None, *h_dtypes(s.dtype)):
            for tiles in fwd_cluster_sizes(cfg, False, h):  # RMSNorm's: LayerNorm's and more
                yield s._replace(npt=cfg.npt, tiles=tiles, hdtype=h), "fwd"
        if cfg.small_m and cfg.cluster_tiles > 1:  # few rows: one vector per thread
            for tiles in _few_row_tiles(cfg, 1):
                yield s._replace(npt=1, tiles=tiles), "fwd"
        if cfg.resident_npt:  # rows in a cluster's shared memory
            for tiles in cluster_sizes(cfg):
                yield s._replace(npt=cfg.resident_npt, tiles=tiles, resident=True), "fwd"
        for tiles in fwd_cluster_sizes(cfg, False, None):  # peeled rows split over a cluster
            yield s._replace(npt=cfg.npt, tiles=tiles, peeled=True), "fwd"
    for n in (1, 2, 4):
        if n <= cfg.npt:
            yield s._replace(npt=n), "fwd"
            for h in h_dtypes(s.dtype):
                yield s._replace(npt=n, hdtype=h), "fwd"
        if s.wide:
            for tpr in row_kernel_widths(cfg, s.warp, n):
                yield s._replace(npt=n, tpr=tpr, row=True), "fwd"
    if s.wide:  # rows off the vector peeled (and the fused add's, h in x's dtype)
        for h in (None, s.dtype):
            for n in PEEL_NPTS:
                yield s._replace(npt=n, peeled=True, hdtype=h), "fwd"
            yield s._replace(npt=cfg.npt, peeled=True, hdtype=h), "fwd_long"
    # y in float8: rows of one chunk
    for n, h, ln, q in itertools.product([n for n in (1, 2, 4) if n <= cfg.npt],
                                         (None, *h_dtypes(s.dtype)),
                                         (True, False) if s.wide else (None,), ("row", "tensor")):
        yield s._replace(npt=n, hdtype=h, quant=q, ln=ln), "fwd"


def _bwd_specs(cfg: BwdRows, s: Spec, clusters):
    """(spec, pass) of every backward kernel of one (dtypes, norm, vector width) ``s``."""
    residuals = (False, True) if s.vec in vec_options(s.dtype, False) else (False,)  # + add's
    if s.wide and clusters and cfg.resident_npt and cfg.cluster_tiles_long > 1:
        for res in residuals:
            for ln in (True, False):  # its norm fixed (Spec.ln)
                yield s._replace(npt=cfg.resident_npt, tiles=cfg.cluster_tiles_long,
                                 resident=True, residual=res, ln=ln), "bwd_long"
    if s.wide and not s.hip and cfg.grid_vecs:
        for step, res, ln in itertools.product({1, cfg.grid_step_rows}, residuals,
                                               (True, False)):
            yield s._replace(npt=cfg.grid_npt, residual=res, grid=_grid_args(cfg, step),
                             ln=ln), "bwd_long"
    npts = [n for n in range(cfg.npt_min, max(cfg.npt, cfg.tile_npt, cfg.cluster_npt) + 1)
            if not n & (n - 1)]
    if s.wide:  # rows off the vector peeled (and the fused add's)
        for res in residuals:
            for n in npts[:2]:
                yield s._replace(npt=n, peeled=True, residual=res), "bwd"
            yield s._replace(npt=cfg.tile_npt, peeled=True, residual=res), "bwd_long"
    long_tiles = cluster_sizes(cfg) if clusters else (1,)  # the long-row backward's modules
    for n in npts:
        for pass_, tiles in (("bwd", 1), ("bwd", cfg.csum_blocks),
                             *(("bwd_long", t) for t in long_tiles)):
            if pass_ == "bwd_long" and n not in (cfg.tile_npt, cfg.cluster_npt):
                continue  # long rows take these widths alone
            if not clusters and tiles > 1 and pass_ == "bwd":
                continue  # one cluster alone: clusters only
            for res in residuals:
                yield s._replace(npt=n, tiles=tiles, residual=res), pass_


# ----------------------------------------------------------------------------- device facts


class DeviceInfo(NamedTuple):
    """A device's facts as the planner reads them."""

    sms: int
    warp: int
    threads_per_sm: int
    regs_per_sm: int
    smem_per_sm: int
    smem_per_block: int  # dynamic + static shared memory a block may opt into
    async_copy: bool  # cp.async (CUDA, compute capability 8.0 on): see CLN_ASYNC_COPY
    clusters: bool  # thread-block clusters (CUDA, compute capability 9.0 on): CLN_CLUSTERS
    hip: bool = False  # ROCm: its modules leave out the staged and cluster kernels
    max_grid: tuple = (2**31 - 1, 65535, 65535)  # blocks a launch may have in x, y and z
    device: int = 0  # which device: plans are cached per DeviceInfo
    # What the planner asks about kernels, answered by the facts layer (cupyln._facts) or a
    # test's mock: kernels(spec, pass_, source) -> {variant: kernel with num_regs,
    # local_size_bytes, shared_size_bytes}; active_clusters(kern, cluster, block, smem) -> how
    # many such clusters run at once; resident_blocks(kern, threads, smem) -> blocks per SM.
    kernels: Callable | None = None
    active_clusters: Callable | None = None
    resident_blocks: Callable | None = None


def _within_grid(plan, info, pass_, N):
    """``plan``, unless one of its launches needs more blocks than the device's grid allows (the
    column tiles of rows tens of millions long): then ValueError, before any work."""
    for name, launch in plan.launch.items():
        if any(g > most for g, most in zip(launch.grid, info.max_grid, strict=False)):
            raise ValueError(
                f"the {pass_} of rows of {N} elements needs a grid of {launch.grid} blocks "
                f"({name}), past this device's limit of {info.max_grid}: rows this long are "
                f"not supported")
    return plan


def kernel_resource(kern, name):
    """A compiled kernel's ``num_regs``, ``shared_size_bytes`` or ``local_size_bytes``: 0 for no
    kernel (bounds before compiling) or where the backend does not report it."""
    return int(getattr(kern, name, 0) or 0)


def blocks_per_sm(kern, threads, smem, info):
    """Resident blocks of ``kern`` per multiprocessor, from its register and memory use (kern
    None: the bound of threads and dynamic shared memory alone, before compiling)."""
    regs = max(kernel_resource(kern, "num_regs"), 1)
    by_threads = info.threads_per_sm // threads
    by_regs = info.regs_per_sm // (round_up(regs, 8) * threads)
    static = kernel_resource(kern, "shared_size_bytes")
    by_smem = info.smem_per_sm // (smem + static + 1024)
    return max(1, min(by_threads, by_regs, by_smem, 32))


def staging_bytes(info, dtype, vec, npt, tpr, rpb, wdtype=None, residual=False):
    """Dynamic shared memory of staged rows (the kernels' STAGED rule: cp.async and packs of at
    least 4 bytes): two buffers of ``npt`` packs per thread of x (the forward), or of x and dy
    (``residual`` at two or more packs per thread: and dresidual, as bwd_rows' DRES_STAGED) and
    then gamma once per block (the backward, which passes ``wdtype``)."""
    pack = vec * dtype.itemsize
    if not info.async_copy or pack < 4:
        return 0
    if wdtype is None:
        return npt * tpr * 2 * pack * rpb
    rows_in = 3 if residual and npt > 1 else 2
    return npt * tpr * (2 * rows_in * pack * rpb + vec * wdtype.itemsize)


def stages(mode, rule):
    """Whether a pass stages its rows: ``mode`` "always", "never", or "auto" (where ``rule``)."""
    return mode == "always" or (mode == "auto" and rule)


def _staged(mode, info, kern, dtype, vec, g, M, alone=True):
    """(dynamic shared memory, grid) of the forward's rows staged by ``kern``: resident blocks
    looping over the rows, where the config's stage ``mode`` says so ("auto": the rows outnumber
    the resident blocks', and ``alone``, for aligned rows: one direct block fills an SM, so
    nothing else hides its reductions) and one block's shared memory holds the two buffers;
    else None."""
    stage = staging_bytes(info, dtype, vec, g.npt, g.tpr, g.rpb)
    if not stage or stage + 1024 > info.smem_per_sm:
        return None
    resident = info.sms * blocks_per_sm(kern, g.tpr * g.rpb, stage, info)
    if not stages(mode, alone and M > resident * g.rpb):
        return None
    return stage, (min(cdiv(M, g.rpb), resident),)


# ----------------------------------------------------------------------------- plans


class Launch(NamedTuple):
    """One kernel launch of a plan: the launch layer makes it a ``_driver.Launcher``."""

    kern: object  # the kernel, as DeviceInfo.kernels returned it
    grid: tuple
    block: tuple
    smem: int
    kinds: str  # argument kinds (see kernel_args)
    cooperative: bool = False  # every block resident at once


class Plan:
    """One pass's kernels and geometry (hashed by identity: plans are made once, cached)."""

    __slots__ = ("spec", "variant", "kern", "grid", "block", "smem", "launch", "direct")

    def __init__(self, spec, variant, kern, grid, block, smem, launch, direct=False):
        self.spec = spec
        # the pass's main kernel: its name in the module (see Spec.names), its RawKernel
        self.variant, self.kern = variant, kern
        self.grid, self.block, self.smem = grid, block, smem
        self.launch = launch  # name -> Launch of this geometry, per kernel it runs
        # backward: one row of blocks, each holding every row of its columns, writes
        # dgamma/dbeta itself (no partials, no reduction, no atomics)
        self.direct = direct

    @property
    def dynamic(self):
        """Whether the backward has staged rows from a ticket counter (launch["bwd_dyn"], for
        calls that need not be deterministic)."""
        return "bwd_dyn" in self.launch


# Argument kinds of the kernels (see _driver): p pointer, i int64, f float32, d float64.
_FWD_ARGS = "pipppppiiX"
_FWD_ADD_ARGS = _FWD_ARGS + "pip"  # then the residual, its row stride, h
_FWD_Q_ARGS = _FWD_ADD_ARGS + "pppi"  # then the row scales, the static scale, amax, qflags
_BWD_ARGS = "pipipppppppppppiipi"  # ..., M, N, then dresidual and its row stride
_ROWSUMS_ARGS = "pipippppii"
_MERGE_ARGS = "pipi"  # the parts, their count per row, the row sums, M
_REDUCE_ARGS = "piipp"


def kernel_args(function):
    """The argument kinds of kernel ``function`` (its name): the host-kernel contract, which
    tests/test_compile.py reads against each kernel's C parameter list."""
    if function == "norm_bwd_rowsums_merge":
        return _MERGE_ARGS
    if function == "norm_bwd_rowsums":
        return _ROWSUMS_ARGS
    if function.startswith("norm_bwd_reduce"):
        return _REDUCE_ARGS
    if function.startswith("norm_bwd"):
        return _BWD_ARGS
    if function == "norm_fwd_q":
        return _FWD_Q_ARGS
    args = _FWD_ADD_ARGS if "_add" in function else _FWD_ARGS
    return args + "p" if function.endswith("_parts") else args  # the parts' statistics


def _kinds(args, dtype):
    return args.replace("X", "d" if ACC_DTYPES[dtype] == FLOAT64 else "f")


def _fwd_row_geometry(cfg, info, M, N, vec):
    """The general geometry, or one vector per thread for small M and rows within a warp."""
    wp = info.warp
    g = fwd_geometry(cfg, N // vec, wp)
    if cfg.small_m:
        g1 = fwd_small_geometry(cfg, N // vec, wp)
        small = M * g1.tpr <= cfg.small_m_fill * info.sms * info.threads_per_sm
        if g1.fits and (small or (cfg.short_npt1 and g1.tpr <= wp)):
            g = g1
    return spread(g, M, wp, 2 * info.sms)


def _takes_row_kernel(cfg, info, g, dtype, M, N, vec):
    """Rows of one chunk of 16-byte vectors, the grid covering M (one row per block for
    several vectors per thread), in the widths norm_fwd_row is built for."""
    wp = info.warp
    rg = g._replace(rpb=1) if g.npt > 1 else g
    ok = (g.fits and tuned(dtype, vec) and M * N < 2**31
          and g.tpr in row_kernel_widths(cfg, wp, g.npt)
          and cdiv(M, rg.rpb) <= info.sms * cfg.grid_per_sm
          and (g.npt > 1 or g.rpb == 1))
    return rg if ok else None


PEEL_NPTS = (1, 4, 8)  # the vectors per thread norm_fwd_peeled is built for (2: rows too short)


def _plan_fwd_peeled(config, info, dtype, wdtype, is_ln, M, N, hdtype=None):
    """Rows whose heads and tails are peeled off 16-byte vectors: the general geometry of their
    16-byte vectors, in one chunk of at least 2 * VEC threads (one per peeled element); rows
    longer than one chunk in parts over the grid where they are at most ``sms *
    peel_parts_rows`` (the fused add's: ``parts_rows_add``), else at 8 vectors per thread
    (staged where the rows outnumber the resident blocks), or in chunks where 8 do not hold the
    row or their unstaged block spills (over a cluster instead where ``peel_cluster`` places
    one); None elsewhere (single elements then). ``hdtype``: the fused add's h, peeled where it
    is x's dtype, on the same geometry but never staged."""
    cfg, wp = config.fwd, info.warp
    vec = VEC[dtype]
    if not config.peel or N < 2 * vec or hdtype not in (None, dtype):
        return None
    g = _fwd_row_geometry(cfg, info, M, N // vec * vec, vec)
    rows = cfg.peel_parts_rows if hdtype is None else cfg.parts_rows_add
    if not g.fits and M <= min(info.sms * rows, 2**16 - 1):
        spec = Spec(dtype, wdtype, vec, cfg.npt, wp, hip=info.hip, peeled=True,
                    hdtype=hdtype)
        return _parts_plan(config, info, spec, "fwd_long", "fwd_peeled_parts", M,
                           N // vec * vec, _FWD_ARGS if hdtype is None else _FWD_ADD_ARGS)
    # past one chunk: over a cluster (x read once) where chunks would read it twice
    long = functools.partial(_plan_fwd_peeled_long, config, info, dtype, wdtype, is_ln, M, N, g,
                             hdtype)
    if not g.fits:
        g = spread(row_geometry(N // vec, wp, 8, 8, cfg.tpr_max, cfg.block), M, wp, 2 * info.sms)
    if not g.fits and cfg.peel_chunked:
        return long()
    if not g.fits or g.tpr < 2 * vec or g.npt not in PEEL_NPTS:
        return None
    spec = Spec(dtype, wdtype, vec, g.npt, wp, hip=info.hip, peeled=True, hdtype=hdtype)
    kerns = info.kernels(spec, "fwd", config.source)
    main = "fwd_peeled_early" if "fwd_peeled_early" in kerns and \
        M <= info.sms * cfg.peel_early_rows else "fwd_peeled"
    grid, block, smem = (min(cdiv(M, g.rpb), info.sms * cfg.grid_per_sm),), (g.tpr, g.rpb), 0
    # staged wherever the rows outnumber the resident blocks: the direct kernel spills
    staged = "fwd_peeled_staged" in kerns and _staged(config.stage, info,
                                                      kerns["fwd_peeled_staged"], dtype, vec, g, M)
    if staged:
        main, (smem, grid) = "fwd_peeled_staged", staged
    elif (cfg.peel_chunked and g.npt > cfg.npt
          and kernel_resource(kerns[main], "local_size_bytes") > cfg.peel_block_spill):
        return long()
    launch = {"fwd": Launch(kerns[main], grid, block, smem, _fwd_kinds(dtype, hdtype))}
    return Plan(spec, main, kerns[main], grid, block, smem, launch)


def _plan_fwd_peeled_long(config, info, dtype, wdtype, is_ln, M, N, g, hdtype):
    """Peeled rows that would run in chunks (read twice): over a cluster where
    ``_plan_fwd_peeled_cluster`` places one (not the fused add's), else in chunks."""
    cluster = None if hdtype is not None else \
        _plan_fwd_peeled_cluster(config, info, dtype, wdtype, is_ln, M, N, g)
    return cluster or _plan_fwd_peeled_chunked(config, info, dtype, wdtype, M, hdtype)


def _plan_fwd_peeled_cluster(config, info, dtype, wdtype, is_ln, M, N, g):
    """Peeled rows longer than one block (geometry ``g`` of their 16-byte vectors) split over the
    blocks of a cluster, whole warps each, where one chunk of it holds the row's middle
    (``fwd_cluster_tiles``; RMSNorm's: in blocks of ``peel_cluster_rms_threads`` threads or
    more), one row per cluster at a time; None where ``peel_cluster`` or the rules say no, or
    the driver cannot place such a cluster."""
    cfg, vec = config.fwd, VEC[dtype]
    tiles = cfg.peel_cluster and fwd_cluster_tiles(config, info, dtype, is_ln, None, vec, g, M, N)
    if not tiles:
        return None
    block = (round_up(cdiv(N // vec, tiles * cfg.npt), info.warp), 1)
    if not is_ln and block[0] < cfg.peel_cluster_rms_threads:
        return None
    spec = Spec(dtype, wdtype, vec, cfg.npt, info.warp, tiles, hip=info.hip, peeled=True)
    kern = info.kernels(spec, "fwd", config.source)["fwd_peeled_cluster"]
    if info.active_clusters(kern, (1, tiles), block, 0) == 0:
        return None
    grid = (min(M, info.sms * cfg.grid_per_sm), tiles)
    launch = {"fwd": Launch(kern, grid, block, 0, _kinds(_FWD_ARGS, dtype))}
    return Plan(spec, "fwd_peeled_cluster", kern, grid, block, 0, launch)


def _plan_fwd_peeled_chunked(config, info, dtype, wdtype, M, hdtype=None):
    """Peeled rows past one block of 8 vectors per thread (or of more than ``npt`` where that
    block spills), in chunks read twice: one row per block of ``tpr_max`` threads, the blocks
    looping over the rows."""
    cfg = config.fwd
    spec = Spec(dtype, wdtype, VEC[dtype], cfg.npt, info.warp, hip=info.hip,
                peeled=True, hdtype=hdtype)
    kern = info.kernels(spec, "fwd_long", config.source)["fwd_peeled_chunked"]
    grid, block = (min(M, info.sms * cfg.grid_per_sm),), (cfg.tpr_max, 1)
    launch = {"fwd": Launch(kern, grid, block, 0, _fwd_kinds(dtype, hdtype))}
    return Plan(spec, "fwd_peeled_chunked", kern, grid, block, 0, launch)


def _fwd_kinds(dtype, hdtype):
    """The forward kernels' argument kinds (the fused add's: and the residual, h)."""
    return _kinds(_FWD_ARGS if hdtype is None else _FWD_ADD_ARGS, dtype)


@functools.lru_cache(maxsize=PLAN_CACHE_SIZE)
def plan_fwd(info: DeviceInfo, config: Config, dtype, wdtype, is_ln, M, N, vec, hdtype=None,
             peel=False, quant=None):
    """Forward geometry and kernel; ``hdtype``: the fused residual add's h; ``peel``: rows
    that 16-byte vectors do not fit, starting alike in x and y within 16 bytes (the caller's
    check), so that their heads and tails can be peeled off; ``quant``: y in float8 scaled
    per row (``"row"``) or by one static scale (``"tensor"``). ValueError where the plan's
    grid passes the device's limits, or (``quant``) where one block does not hold the row."""
    if quant:
        plan = _plan_fwd_quant(settings(config, family(info.hip, info.warp, info.clusters)),
                               info, dtype, wdtype, is_ln, M, N, vec, hdtype, quant)
    else:
        plan = _fwd_plan(info, config, dtype, wdtype, is_ln, M, N, vec, hdtype, peel)
    return _within_grid(plan, info, "forward", N)


QUANT_THREADS = 512  # norm_fwd_q's launch bound past one element a vector: 1024 spilled


def _plan_fwd_quant(config, info, dtype, wdtype, is_ln, M, N, vec, hdtype, scaling):
    """y in float8 (norm_fwd_q): rows of one chunk held by one block in registers, in the
    general forward's geometry (one vector per thread for small M); scaled per row, y kept in
    shared memory between the row's amax and the output, under a static scale written as
    computed; ValueError for longer rows."""
    assert scaling in ("row", "tensor"), scaling
    cfg = config.fwd
    if vec > 1:
        cfg = dataclasses.replace(cfg, tpr_max=min(cfg.tpr_max, QUANT_THREADS))
    g = _fwd_row_geometry(cfg, info, M, N, vec)
    if not g.fits:
        raise ValueError(
            f"float8 y on the GPU is for rows that one block holds: at most "
            f"{cfg.tpr_max * cfg.npt * vec} elements of {dtype} at this row's vector width, "
            f"got {N}")
    grid, block = (min(cdiv(M, g.rpb), info.sms * cfg.grid_per_sm),), (g.tpr, g.rpb)
    spec = Spec(dtype, wdtype, vec, g.npt, info.warp, hip=info.hip, hdtype=hdtype,
                quant=scaling, ln=is_ln if tuned(dtype, vec) else None)
    kern = info.kernels(spec, "fwd", config.source)["fwd_q"]
    # each thread's y in float32 between its two passes
    smem = g.tpr * g.rpb * g.npt * vec * 4 if scaling == "row" else 0
    if smem and smem + kernel_resource(kern, "shared_size_bytes") > info.smem_per_block:
        raise ValueError(
            f"float8 y on the GPU keeps each row's y in a block's shared memory: {N} elements "
            f"need {smem} bytes, more than this device's {info.smem_per_block}")
    launch = {"fwd": Launch(kern, grid, block, smem, _kinds(_FWD_Q_ARGS, dtype))}
    return Plan(spec, "fwd_q", kern, grid, block, smem, launch)


def _fwd_plan(info, config, dtype, wdtype, is_ln, M, N, vec, hdtype, peel):
    config = settings(config, family(info.hip, info.warp, info.clusters))
    cfg = config.fwd
    peeled = _plan_fwd_peeled(config, info, dtype, wdtype, is_ln, M, N, hdtype) if peel \
        else None
    if peeled is not None:
        return peeled
    g = _fwd_row_geometry(cfg, info, M, N, vec)
    grid = (min(cdiv(M, g.rpb), info.sms * cfg.grid_per_sm),)
    resident = _plan_fwd_resident(config, info, dtype, wdtype, M, N, vec, hdtype, g)
    if resident is not None:
        return resident
    cluster = _plan_fwd_cluster(config, info, dtype, wdtype, is_ln, M, N, vec, hdtype, g)
    if cluster is not None:
        return cluster
    parts = _plan_fwd_parts(config, info, dtype, wdtype, M, N, vec, g, hdtype)
    if parts is not None:
        return parts
    if hdtype is not None:
        return _plan_fwd_add(config, info, dtype, wdtype, vec, hdtype, g, grid)
    rg = _takes_row_kernel(cfg, info, g, dtype, M, N, vec)
    if rg is not None:
        g, grid = rg, (cdiv(M, rg.rpb),)
    spec = Spec(dtype, wdtype, vec, g.npt, info.warp, tpr=g.tpr if rg else 0,
                row=rg is not None, hip=info.hip)
    kerns = info.kernels(spec, "fwd", config.source)
    main = "fwd_row" if rg else "fwd" if g.fits else "fwd_chunked"
    block, smem = (g.tpr, g.rpb), 0
    if main == "fwd" and "fwd_staged" in kerns:
        alone = blocks_per_sm(kerns[main], g.tpr * g.rpb, 0, info) == 1
        staged = _staged(config.stage, info, kerns["fwd_staged"], dtype, vec, g, M, alone)
        if staged:
            main, (smem, grid) = "fwd_staged", staged
    early = "fwd_early_ln" if is_ln else "fwd_early_rms"  # their norm fixed
    if main == "fwd" and early in kerns and cfg.early:
        main = early
    if is_ln and cfg.full and main + "_full" in kerns and N % (g.tpr * g.npt * vec) == 0:
        main += "_full"
    launch = {"fwd": Launch(kerns[main], grid, block, smem, _kinds(_FWD_ARGS, dtype))}
    return Plan(spec, main, kerns[main], grid, block, smem, launch)


def cluster_sizes(cfg: FwdRows | BwdRows):
    """The blocks per cluster a pass splits long rows over, fewest first (the portable size,
    then the larger one where on)."""
    return tuple(t for t in (cfg.cluster_tiles, cfg.cluster_tiles_long) if t > 1)


def split_order(fits, M, split_rows):
    """The cluster sizes that hold a pass's rows (fewest blocks first) in the order it tries
    them: for at most ``split_rows`` rows the most first, the same bytes in flight on more SMs;
    else the fewest alone."""
    return fits[::-1] if M <= split_rows else fits[:1]


def fwd_cluster_sizes(cfg: FwdRows, is_ln, hdtype):
    """The forward's cluster sizes: the larger one for RMSNorm alone, without the fused add
    (the cases it was measured to win)."""
    sizes = cluster_sizes(cfg)
    return sizes if not is_ln and hdtype is None else sizes[:1]


def fwd_cluster_tiles(config: Settings, info, dtype, is_ln, hdtype, vec, g, M, N):
    """The blocks of the cluster that forward rows of geometry ``g`` split over: sm_90, 16-byte
    vectors, rows longer than one block holds, the fewest blocks whose one chunk holds the row
    (x read once; more than 8 for at least ``cluster_long_min_rows`` rows); 0 where none
    does."""
    cfg = config.fwd
    if not (info.clusters and config.cluster and tuned(dtype, vec) and not g.fits):
        return 0
    tiles = next((t for t in fwd_cluster_sizes(cfg, is_ln, hdtype)
                  if N // vec <= t * cfg.tpr_max * cfg.npt), 0)
    return tiles if tiles <= cfg.cluster_tiles or M >= cfg.cluster_long_min_rows else 0


def _plan_fwd_cluster(config, info, dtype, wdtype, is_ln, M, N, vec, hdtype, g):
    """Rows split over the blocks of a cluster (``fwd_cluster_tiles``), whole warps each, where
    one chunk of the cluster holds the row: staged where resident clusters loop over rows, else
    one cluster per row (the fused add: direct, and in blocks of ``tpr_max`` threads for few
    rows only); one vector per thread for small M (``small_m``) where every row's cluster runs
    at once (``_few_row_tiles``). None where the rules say no or the driver cannot place such a
    cluster (longer rows: in parts over the grid where few, else a block each)."""
    cfg = config.fwd
    tiles = fwd_cluster_tiles(config, info, dtype, is_ln, hdtype, vec, g, M, N)
    if not tiles:
        return None
    if hdtype is None and tiles == cfg.cluster_tiles and cfg.small_m and cfg.npt > 1:
        tpr = round_up(cdiv(N // vec, tiles), info.warp)
        if tpr <= cfg.tpr_max and M * tiles * tpr <= cfg.small_m_fill * info.sms \
                * info.threads_per_sm:
            for few in _few_row_tiles(cfg, M):
                plan = _cluster_plan(config, info, dtype, wdtype, is_ln, M, N, vec, hdtype,
                                     few, 1)
                # every row's cluster at once (in turns, one vector lost: 32x65536 bf16)
                if plan is not None and M <= info.active_clusters(
                        plan.kern, (1, few), plan.block, 0):
                    return plan
    tpr = round_up(cdiv(N // vec, tiles * cfg.npt), info.warp)
    if hdtype is not None and tpr >= cfg.tpr_max and M > info.sms * cfg.cluster_few_rows:
        return None  # nothing overlaps the exchanges: split only where SMs would idle
    return _cluster_plan(config, info, dtype, wdtype, is_ln, M, N, vec, hdtype, tiles, cfg.npt)


def _few_row_tiles(cfg: FwdRows, M):
    """The cluster sizes, first choice first, of ``M`` forward rows of one vector per thread
    that ``cluster_tiles`` blocks hold (``split_order``)."""
    fits = tuple(t for t in cluster_sizes(cfg) if t >= cfg.cluster_tiles)
    return split_order(fits, M, cfg.cluster_split_rows)


def _cluster_plan(config, info, dtype, wdtype, is_ln, M, N, vec, hdtype, tiles, npt):
    """The plan of rows split over clusters of ``tiles`` blocks of ``npt`` vectors per thread
    (``_plan_fwd_cluster``'s rules); None where the driver cannot place such a cluster."""
    cfg = config.fwd
    block = (round_up(cdiv(N // vec, tiles * npt), info.warp), 1)
    spec = Spec(dtype, wdtype, vec, npt, info.warp, tiles, hip=info.hip, hdtype=hdtype)
    kerns = info.kernels(spec, "fwd", config.source)
    main = "fwd_cluster"
    if info.active_clusters(kerns[main], (1, tiles), block, 0) == 0:
        return None
    grid, smem = (min(M, info.sms * cfg.grid_per_sm), tiles), 0
    if "fwd_cluster_staged" in kerns:
        stage = staging_bytes(info, dtype, vec, npt, block[0], 1)
        resident = info.active_clusters(kerns["fwd_cluster_staged"], (1, tiles), block,
                                               stage)
        if resident and stages(config.stage, M > resident):
            main, smem, grid = "fwd_cluster_staged", stage, (resident, tiles)
    launch = {"fwd": Launch(kerns[main], grid, block, smem, _fwd_kinds(dtype, hdtype))}
    return Plan(spec, main, kerns[main], grid, block, smem, launch)


def _plan_fwd_resident(config, info, dtype, wdtype, M, N, vec, hdtype, g):
    """Rows longer than one chunk of the portable cluster's registers holds, in the shared
    memory of the fewest blocks of ``cluster_sizes`` whose ``resident_npt`` vectors per thread
    hold them (sm_90, 16-byte vectors, no fused add), at least ``resident_rows`` rows per
    cluster that fits at once; each thread's ring as many slots as one block's shared memory
    holds, at most two rows'. None elsewhere (16 blocks of rows in registers, or parts)."""
    cfg = config.fwd
    npt = cfg.resident_npt
    if not (npt and info.clusters and info.async_copy and config.cluster and hdtype is None
            and tuned(dtype, vec)
            and N // vec > cfg.cluster_tiles * cfg.tpr_max * cfg.npt):
        return None
    tiles = next((t for t in cluster_sizes(cfg) if N // vec <= t * cfg.tpr_max * npt), 0)
    if not tiles:
        return None
    tpr = round_up(cdiv(N // vec, tiles * npt), info.warp)
    spec = Spec(dtype, wdtype, vec, npt, info.warp, tiles, resident=True)
    kern = info.kernels(spec, "fwd", config.source)["fwd_resident"]
    pack = tpr * 16  # one slot: a vector per thread
    static = kernel_resource(kern, "shared_size_bytes")
    fit = (info.smem_per_sm - 1024 - static) // pack  # 1 KiB per block: the system's
    slots = min(2 * npt, fit, cfg.resident_slots or fit)
    smem = slots * pack
    resident = info.active_clusters(kern, (1, tiles), (tpr, 1), smem) if slots >= npt \
        else 0
    if not resident or M < cfg.resident_rows * resident:
        return None
    grid, block = (min(M, resident), tiles), (tpr, 1)
    launch = {"fwd": Launch(kern, grid, block, smem, _kinds(_FWD_ARGS, dtype))}
    return Plan(spec, "fwd_resident", kern, grid, block, smem, launch)


FWD_PARTS_NPT = 4  # vectors per thread of norm_fwd_parts' chunks (fixed in the kernel)


def parts_geometry(per_sm, npt, tpr_max, info, M, N, vec):
    """(threads per block, parts per row) of rows split over the grid: about ``per_sm`` blocks
    per SM over all rows, the fewest whole warps (at most ``tpr_max`` threads) of ``npt``
    vectors each that keep a row within its share."""
    nvec = cdiv(N, vec)
    share = cdiv(per_sm * info.sms, M)
    tpr = min(max(round_up(cdiv(nvec, npt * share), info.warp), info.warp), tpr_max)
    return tpr, cdiv(nvec, npt * tpr)


def _plan_fwd_parts(config, info, dtype, wdtype, M, N, vec, g, hdtype=None):
    """Rows longer than one block that no cluster takes (the planner asks for a cluster first),
    at most ``sms * parts_rows`` of them (the fused add's: ``parts_rows_add``), each split over
    blocks of the grid (two launches: the parts' statistics, with the fused add's h, then y);
    None elsewhere."""
    cfg = config.fwd
    spec = Spec(dtype, wdtype, vec, cfg.npt, info.warp, hip=info.hip, hdtype=hdtype)
    rows = cfg.parts_rows if hdtype is None else cfg.parts_rows_add
    if g.fits or M >= 2**16 or M > info.sms * rows or "fwd_parts" not in spec.names("fwd"):
        return None
    args = _FWD_ARGS if hdtype is None else _FWD_ADD_ARGS
    return _parts_plan(config, info, spec, "fwd", "fwd_parts", M, N, args)


def _parts_plan(config, info, spec, pass_, variant, M, N, args):
    """The two launches of rows in parts over the grid (each part's statistics, then y), from
    ``spec``'s module of ``pass_``: about ``parts_per_sm`` blocks per SM over rows of N
    elements in vectors."""
    cfg = config.fwd
    tpr, parts = parts_geometry(cfg.parts_per_sm, FWD_PARTS_NPT, cfg.tpr_max, info, M, N,
                                spec.vec)
    kerns = info.kernels(spec, pass_, config.source)
    grid, block, kinds = (parts, M), (tpr, 1), _kinds(args + "p", spec.dtype)
    launch = {"fwd_parts": Launch(kerns["fwd_parts"], grid, block, 0, kinds),
              "fwd": Launch(kerns["fwd_apply"], grid, block, 0, kinds)}
    return Plan(spec, variant, kerns["fwd_apply"], grid, block, 0, launch)


def _plan_fwd_add(config, info, dtype, wdtype, vec, hdtype, g, grid):
    """The fused residual add's forward: the general geometry on direct rows (one chunk in
    registers, or chunks), none of the row kernel, staging or early parameters."""
    spec = Spec(dtype, wdtype, vec, g.npt, info.warp, hip=info.hip, hdtype=hdtype)
    kerns = info.kernels(spec, "fwd", config.source)
    main = "fwd_add" if g.fits else "fwd_add_chunked"
    block = (g.tpr, g.rpb)
    launch = {"fwd": Launch(kerns[main], grid, block, 0, _fwd_kinds(dtype, hdtype))}
    return Plan(spec, main, kerns[main], grid, block, 0, launch)


def _bwd_long_kernels(config, info, dtype, wdtype, M, N, vec, residual):
    """Rows longer than one block: (spec, kernels, block, tiles, cluster) of a cluster of
    column tiles where the row fits in them and the driver can place one (the fewest of
    ``cluster_sizes``; for at most ``cluster_split_rows`` rows, the most), else of
    ``tile_tpr``-thread tiles after the row sums kernel."""
    cfg = config.bwd
    most = bwd_threads(cfg.cluster_npt)
    sizes = cluster_sizes(cfg) if info.clusters and config.cluster else ()
    fits = [t for t in sizes if cdiv(N // vec, t * cfg.cluster_npt) <= most]
    for tiles in split_order(fits, M, cfg.cluster_split_rows):
        spec = Spec(dtype, wdtype, vec, cfg.cluster_npt, info.warp, tiles,
                    residual=residual)
        if "bwd_cluster" not in spec.names("bwd_long"):  # the widths Spec builds them for
            continue
        tpr = round_up(cdiv(N // vec, tiles * cfg.cluster_npt), info.warp)
        kerns = info.kernels(spec, "bwd_long", config.source)
        if info.active_clusters(kerns["bwd_cluster"], (1, tiles), (tpr, 1), 0) > 0:
            return spec, kerns, (tpr, 1), tiles, True
    # its row sums over a cluster where clusters exist (the module then has its cluster kernels)
    tiles = cfg.cluster_tiles if info.clusters and config.cluster else 1
    spec = Spec(dtype, wdtype, vec, cfg.tile_npt, info.warp, tiles, hip=info.hip,
                residual=residual)
    kerns = info.kernels(spec, "bwd_long", config.source)
    return spec, kerns, (cfg.tile_tpr, 1), cdiv(N, cfg.tile_tpr * cfg.tile_npt * vec), False


def _reduce_launcher(cfg: BwdRows, kerns, N):
    """The sum of the partials: four columns per thread over rows of at least
    ``reduce_cols_n`` elements (a multiple of 4) where the module has that kernel, else 32
    columns per block of eight row groups (the same order, the same bits)."""
    if "reduce_cols" in kerns and N % 4 == 0 and N >= cfg.reduce_cols_n:
        return Launch(kerns["reduce_cols"], (cdiv(2 * N, 4 * 256),), (256, 1), 0,
                        _REDUCE_ARGS)
    return Launch(kerns["reduce"], (cdiv(2 * N, 32),), (32, 8), 0, _REDUCE_ARGS)


def _rowsums_launchers(info, cfg: BwdRows, kerns, M, N, spec):
    """The row sums before column tiles: for at most ``sms * parts_rows`` rows of at least
    ``parts_chunks`` chunks of one block, in parts over the grid (about ``parts_per_sm``
    blocks per SM; "rowsums" writes each part's sums, "rowsums_merge" adds them); else, for
    rows too few to give every SM a block (M * cluster_tiles <= SMs), per cluster of
    ``cluster_tiles`` blocks where the module has that kernel and the driver can place one;
    else one row per block."""
    long = N >= cfg.parts_chunks * cfg.rowsums_tpr * spec.npt * spec.vec
    if "rowsums_parts" in kerns and long and M <= info.sms * cfg.parts_rows and M < 2**31:
        tpr, parts = parts_geometry(cfg.parts_per_sm, spec.npt, cfg.rowsums_tpr, info, M, N,
                                    spec.vec)
        rows = cfg.rowsums_tpr // info.warp  # one warp per row
        return {"rowsums": Launch(kerns["rowsums_parts"], (M, parts), (tpr, 1), 0,
                                    _ROWSUMS_ARGS),
                "rowsums_merge": Launch(kerns["rowsums_merge"], (cdiv(M, rows),),
                                          (info.warp, rows), 0, _MERGE_ARGS)}
    rows = min(M, info.sms * (info.threads_per_sm // cfg.rowsums_tpr) * 4)
    block = (cfg.rowsums_tpr, 1)
    kern = kerns.get("rowsums_cluster")
    if (kern is not None and M * cfg.cluster_tiles <= info.sms
            and info.active_clusters(kern, (1, cfg.cluster_tiles), block, 0)):
        return {"rowsums": Launch(kern, (M, cfg.cluster_tiles), block, 0, _ROWSUMS_ARGS)}
    return {"rowsums": Launch(kerns["rowsums"], (rows,), block, 0, _ROWSUMS_ARGS)}


def _plan_bwd_peeled(config, info, dtype, wdtype, M, N, residual=False):
    """Rows peeled as the forward's: one row per block, of the backward geometry of their
    16-byte vectors (at least 2 * VEC threads), where M gives each resident block
    ``peel_rows`` rows; rows longer than one block on column tiles after their row sums (those
    of at most ``sms * parts_rows`` rows in parts over the grid), where each row of tiles
    takes ``peel_tile_rows`` rows or is alone. None elsewhere (narrower vectors then).
    ``residual``: the same plans on the kernels that add the fused add's dresidual to dx."""
    cfg, wp = config.bwd, info.warp
    vec = VEC[dtype]
    if not config.peel or N < 2 * vec:
        return None
    g = bwd_geometry(cfg, N // vec, wp)
    if not g.fits:
        g = Geometry(cfg.tile_tpr, cfg.tile_npt, 1, False)
    if g.tpr < 2 * vec:
        return None
    spec = Spec(dtype, wdtype, vec, g.npt, wp, hip=info.hip, peeled=True,
                residual=residual)
    main = "bwd_peeled" if g.fits else "bwd_peeled_tiles"
    kerns = info.kernels(spec, "bwd" if g.fits else "bwd_long", config.source)
    tiles = 1 if g.fits else cdiv(N // vec, g.tpr * g.npt)
    grid = min(M, info.sms * blocks_per_sm(kerns[main], g.tpr, 0, info) // tiles)
    if g.fits and M < cfg.peel_rows * grid:
        return None
    if grid < M:  # every block's rows share one head: its sums keep their columns
        period = vec // math.gcd(N, vec)
        grid = min(M, max(period, grid // period * period))
    if not g.fits and 1 < grid and M < cfg.peel_tile_rows * grid:
        return None  # the tiles' partials would cost more than their rows
    launch = {} if g.fits else _rowsums_launchers(info, cfg, kerns, M, N, spec)
    launch["bwd"] = Launch(kerns[main], (grid, tiles), (g.tpr, 1), 0, _BWD_ARGS)
    if grid > 1:
        launch["reduce"] = _reduce_launcher(cfg, kerns, N)
    return Plan(spec, main, kerns[main], (grid, tiles), (g.tpr, 1), 0, launch,
                direct=grid == 1)


@functools.lru_cache(maxsize=PLAN_CACHE_SIZE)
def plan_bwd(info: DeviceInfo, config: Config, dtype, wdtype, is_ln, M, N, vec, residual=False,
             peel=False):
    """Backward geometry (``residual``: the fused add's kernels, dresidual added to dx;
    ``peel`` as plan_fwd's, x's, dy's and dx's rows alike). The grid depends only on (device,
    config, dtypes, M, N, vec), so the deterministic reduction order is the same on every
    call. ValueError where the grid passes the device's limits."""
    plan = _bwd_plan(info, config, dtype, wdtype, is_ln, M, N, vec, residual, peel)
    return _within_grid(plan, info, "backward", N)


def _bwd_plan(info, config, dtype, wdtype, is_ln, M, N, vec, residual, peel):
    config = settings(config, family(info.hip, info.warp, info.clusters))
    cfg = config.bwd
    peeled = _plan_bwd_peeled(config, info, dtype, wdtype, M, N, residual) if peel \
        else None
    if peeled is not None:
        return peeled
    g = bwd_geometry(cfg, N // vec, info.warp)
    csum = _plan_csum(config, info, dtype, wdtype, M, N, vec, g, residual)
    if csum is not None:
        return csum
    fused = g.fits and cdiv(M, g.rpb) <= cfg.fused_reduce_blocks and N <= g.tpr * g.rpb
    if not fused:
        g = spread(g, M, info.warp, int(cfg.spread * info.sms))
    if not g.fits:
        for rule in (_plan_bwd_grid, _plan_bwd_resident):
            plan = rule(config, info, dtype, wdtype, is_ln, M, N, vec, residual)
            if plan is not None:
                return plan
    return _plan_bwd_blocks(config, info, dtype, wdtype, M, N, vec, residual, g, fused)


def _plan_bwd_blocks(config, info, dtype, wdtype, M, N, vec, residual, g, fused):
    """Rows within a block (``g`` fits; ``fused``: few enough blocks that the last sums the
    partials) or on column tiles (in clusters, or after their row sums), on the blocks that
    run at once (each loops over rows), staged where they loop."""
    cfg = config.bwd
    if g.fits:
        spec = Spec(dtype, wdtype, vec, g.npt, info.warp, hip=info.hip,
                    residual=residual)
        kerns = info.kernels(spec, "bwd", config.source)
        block, tiles, cluster = (g.tpr, g.rpb), 1, False
        colsum = colsum_bytes(g, g.rpb, vec, dtype)
    else:
        spec, kerns, block, tiles, cluster = _bwd_long_kernels(config, info, dtype, wdtype, M,
                                                               N, vec, residual)
        colsum = 0
    grid_of = functools.partial(_resident_grid, info, M, block, tiles, cluster)
    main = "bwd_cluster" if cluster else "bwd"
    grid, smem = grid_of(kerns[main], colsum), colsum
    stage = staging_bytes(info, dtype, vec, spec.npt, block[0], block[1], wdtype, residual)
    loops = block[0] > info.warp and M > grid[0] * block[1]
    if stage and stages(config.stage, loops) and main + "_staged" in kerns:
        main += "_staged"
        smem = max(colsum, stage)
        grid = grid_of(kerns[main], smem)
    dyn = _takes_tickets(config.dynamic, kerns, main, block, tiles, M, info.warp)
    if dyn:  # on the grid that both kernels fit
        grid = min(grid, grid_of(kerns["bwd_staged_dyn"], smem))
    launch = {}
    if not g.fits and not cluster:
        launch.update(_rowsums_launchers(info, cfg, kerns, M, N, spec))
    # one row of blocks (one long row) needs no partials: each block writes its columns'
    # dgamma/dbeta, with no second launch
    direct = grid[0] == 1 and not fused
    if fused and main == "bwd":
        main = "bwd_last"  # the last block sums the partials: one launch
    elif not direct:
        launch["reduce"] = _reduce_launcher(cfg, kerns, N)
    launch["bwd"] = Launch(kerns[main], grid, block, smem, _BWD_ARGS)
    if dyn:
        launch["bwd_dyn"] = Launch(kerns["bwd_staged_dyn"], grid, block, smem, _BWD_ARGS)
    return Plan(spec, main, kerns[main], grid, block, smem, launch, direct)


def _resident_grid(info, M, block, tiles, cluster, kern, smem):
    """The blocks of ``kern`` that run at once (each loops over rows), at most one per row."""
    if cluster:  # whole clusters: the GPU places them by GPC (the driver counts them)
        fit = info.active_clusters(kern, (1, tiles), block, smem)
        return (max(1, min(M, fit)), tiles)
    resident = info.sms * blocks_per_sm(kern, block[0] * block[1], smem, info)
    return (max(1, min(cdiv(M, block[1]), cdiv(resident, tiles))), tiles)


def _takes_tickets(dynamic, kerns, main, block, tiles, M, warp):
    """Whether calls that need not be deterministic take rows from tickets: staged rows that
    span warps (the reductions' block barrier orders the tickets' hand-on), one column tile,
    fewer than 2^31 groups of rows (counted in 32 bits)."""
    return (dynamic and main == "bwd_staged" and block[0] > warp and tiles == 1
            and cdiv(M, block[1]) < 2**31 and "bwd_staged_dyn" in kerns)


def _plan_bwd_resident(config, info, dtype, wdtype, is_ln, M, N, vec, residual=False):
    """Rows longer than the register tiles' clusters of ``cluster_tiles_long`` blocks hold
    (16-byte vectors, sm_90), in that many column tiles of ``resident_npt`` vectors per thread
    that keep x and dy in shared memory (the fused add's dresidual too where a block may have
    the room and as many clusters fit with it, else read from L2), at least ``resident_rows``
    rows per cluster that fits at once; None elsewhere (row sums and tiles)."""
    cfg = config.bwd
    npt, tiles = cfg.resident_npt, cfg.cluster_tiles_long
    if not (npt and tiles > 1 and info.clusters and info.async_copy and config.cluster
            and tuned(dtype, vec)):
        return None
    if N // vec <= tiles * bwd_threads(cfg.cluster_npt) * cfg.cluster_npt or \
            N // vec > tiles * RESIDENT_BWD_THREADS * npt:
        return None
    tpr = round_up(cdiv(N // vec, tiles * npt), info.warp)
    spec = Spec(dtype, wdtype, vec, npt, info.warp, tiles, resident=True,
                residual=residual, ln=is_ln)
    kerns = info.kernels(spec, "bwd_long", config.source)
    smem = staging_bytes(info, dtype, vec, npt, tpr, 1, wdtype)  # bwd_rows' staged layout
    fit = info.active_clusters(kerns["bwd_resident"], (1, tiles), (tpr, 1), smem)
    if not fit or M < cfg.resident_rows * fit:
        return None
    if residual:  # one buffer more, of dresidual, in the kernel that stages it
        dres, staged = smem + npt * tpr * 16, kerns["bwd_resident_staged"]
        if (dres + kernel_resource(staged, "shared_size_bytes") <= info.smem_per_block
                and info.active_clusters(staged, (1, tiles), (tpr, 1), dres) == fit):
            smem, kerns = dres, {**kerns, "bwd_resident": staged}
    return _plan_bwd_rows_of_tiles(cfg, spec, kerns, "bwd_resident", (min(M, fit), tiles), tpr,
                                   smem, N)


def _plan_bwd_rows_of_tiles(cfg, spec, kerns, variant, grid, tpr, smem, N, cooperative=False):
    """The plan of ``kerns[variant]`` on ``grid`` (rows of tiles, tiles a row): one row of tiles
    writes dgamma/dbeta itself, more leave partials for the reduction."""
    kern = kerns[variant]
    launch = {"bwd": Launch(kern, grid, (tpr, 1), smem, _BWD_ARGS, cooperative=cooperative)}
    if grid[0] > 1:
        launch["reduce"] = _reduce_launcher(cfg, kerns, N)
    return Plan(spec, variant, kern, grid, (tpr, 1), smem, launch, direct=grid[0] == 1)


def _plan_bwd_grid(config, info, dtype, wdtype, is_ln, M, N, vec, residual=False):
    """Rows of more than ``grid_vecs`` 16-byte vectors (CUDA, cp.async, float32 sums) on column
    tiles of ``grid_tpr`` threads x ``grid_npt`` vectors, in as many rows of tiles (at most M)
    as run at once, each taking at most ``grid_rows`` rows, the grid launched cooperatively
    (``residual``: the fused add's dresidual staged with x and dy, where each block collects at
    most ``grid_add_sums`` tiles' row sums); None elsewhere."""
    cfg = config.bwd
    if not (cfg.grid_vecs and info.async_copy and tuned(dtype, vec)
            and N // vec > cfg.grid_vecs):
        return None
    tpr = cfg.grid_tpr
    columns = cdiv(N // vec, tpr * cfg.grid_npt)  # column tiles per row
    rows_in = 3 if residual else 2  # x, dy (dresidual) a row; then gamma
    smem = (cfg.grid_buffers * rows_in * 16 + vec * wdtype.itemsize) * cfg.grid_npt * tpr

    # the rows of tiles that run at once; 0 where each takes over grid_rows rows (the fused
    # add's: or where a block collects over grid_add_sums tiles' row sums)
    def rows_of_tiles(per_sm):
        groups = min(M, info.sms * per_sm // columns)
        rows = cdiv(M, max(groups, 1))
        fits = rows <= cfg.grid_rows and (not residual or rows * columns <= cfg.grid_add_sums)
        return groups if groups >= 1 and fits else 0

    # not compiled where even the bound of threads and shared memory per SM leaves none
    most = rows_of_tiles(blocks_per_sm(None, tpr, smem, info))
    if not most:
        return None
    # fewer rows a row of tiles than grid_step_min_rows go one at a time
    step = cfg.grid_step_rows if cdiv(M, most) >= cfg.grid_step_min_rows else 1
    spec = Spec(dtype, wdtype, vec, cfg.grid_npt, info.warp, residual=residual,
                grid=_grid_args(cfg, step), ln=is_ln)
    kerns = info.kernels(spec, "bwd_long", config.source)
    groups = rows_of_tiles(info.resident_blocks(kerns["bwd_grid"], tpr, smem))
    if not groups:
        return None
    return _plan_bwd_rows_of_tiles(cfg, spec, kerns, "bwd_grid", (groups, columns), tpr, smem, N,
                                   cooperative=True)


def _grid_args(cfg, step):
    """The cooperative grid kernel's (buffers, lag, rows a step) template arguments."""
    return cfg.grid_buffers, cfg.grid_lag, step


def grid_sums_bytes(plan):
    """The zeroed area of a cooperative grid's row sums (GridRowSums): a count of blocks done
    (16 bytes), then 2 * lag + 2 steps' tagged 8-byte sums (two a row) per group and tile."""
    groups, columns = plan.grid[:2]
    _, lag, rows = plan.spec.grid
    return 16 + groups * (2 * lag + 2) * columns * 2 * rows * 8


def _plan_csum(config, info, dtype, wdtype, M, N, vec, g, residual):
    """The plan of one cluster of ``csum_blocks`` blocks holding every row at once (the fused
    add's too), or None where the device has no clusters, the rows do not fit, or the driver
    cannot place it."""
    cfg = config.bwd
    unit = warp_rows(g, info.warp)
    most = bwd_threads(g.npt) // g.tpr // unit * unit  # rows that one block can hold
    rpb = min(round_up(cdiv(M, cfg.csum_blocks), unit), most)
    # "always" stages wherever it can: this kernel has direct rows only
    if not (g.fits and info.clusters and config.cluster and cfg.cluster_sums
            and config.stage != "always"
            and M <= cfg.csum_blocks * rpb):
        return None
    spec = Spec(dtype, wdtype, vec, g.npt, info.warp, cfg.csum_blocks,
                residual=residual)
    kern = info.kernels(spec, "bwd", config.source)["bwd_csum"]
    # the values each block receives ([blocks][2N / blocks]), then its rows' column sums
    smem = cfg.csum_blocks * cdiv(2 * N, cfg.csum_blocks) * ACC_DTYPES[dtype].itemsize
    smem += colsum_bytes(g, rpb, vec, dtype)
    block = (g.tpr, rpb)
    if info.active_clusters(kern, (cfg.csum_blocks, 1), block, smem) < 1:
        return None
    launch = {"bwd": Launch(kern, (cfg.csum_blocks,), block, smem, _BWD_ARGS)}
    return Plan(spec, "bwd_csum", kern, (cfg.csum_blocks, 1), block, smem, launch)


def clear():
    """Forget every plan (kernels stay compiled)."""
    for f in (plan_fwd, plan_bwd):
        f.cache_clear()
