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

from . import _compile
from ._compile import ACC_DTYPES, Spec
from .api import BFLOAT16, FLOAT16, FLOAT32, FLOAT64

_NULL = np.uint64(0)  # a null pointer argument

# Geometry constants (see row_geometry).
# Forward: 4 vectors per thread in flight; blocks of one row unless rows are short (measured on
# the H200 with benchmarks/tune.py: stacking long rows in one block costs 5-15%).
FWD_NPT_MIN, FWD_NPT, FWD_TPR_MAX, FWD_BLOCK = 4, 4, 1024, 128
# Backward also holds dy and two partial sums per element: one vector per thread while the row
# fits in 512 threads, else two; 512-thread blocks, so fewer blocks flush dgamma/dbeta partials
# (tune.py on the H200: 131072x4096 bf16 1187 us with one vector, 1368 us with two).
BWD_NPT_MIN, BWD_NPT, BWD_TPR_MAX, BWD_BLOCK = 1, 2, 512, 512  # blocks of 1024 need npt = 1
# dgamma/dbeta flush of the backward blocks: float32 atomicAdd into one 2N vector, or per-block
# partials summed in a fixed order by a second kernel. On the H200 the partials were faster on
# every benchmark shape (tune.py: 4096x1024 f16 26.6 vs 42.9 us, 1151x8192 f16 57 vs 95 us,
# 16384x8192 bf16 358 vs 397 us: same-address atomics from hundreds of blocks serialize in L2),
# so both modes use them; the atomic flush stays available and tested.
ATOMIC_FLUSH = False
TILE_TPR = 256  # long-row backward: threads of one column tile (BWD_NPT vectors each)
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


def row_geometry(nvec, warp, npt_min, npt_max, tpr_max, block):
    """How a row of ``nvec`` vectors maps onto threads.

    Each thread keeps ``npt`` independent vector loads in flight: the smallest power of two from
    ``npt_min`` that lets the row fit in ``tpr_max`` threads, at most ``npt_max``. The threads of
    a row are a power of two up to a warp (several rows then share a warp, reducing with
    shuffles only) or whole warps up to ``tpr_max``; rows longer than ``tpr_max * npt_max``
    vectors are processed in chunks. Rows are stacked in blockDim.y up to ``block`` threads.
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
    else:
        tpr = _round_up(tpr, warp)
    fits = tpr <= tpr_max
    if not fits:
        tpr = tpr_max
    return Geometry(tpr, npt, max(1, block // tpr), fits)


def _spread(g, M, warp, sms):
    """Fewer rows per block when M is small, so that at least 2 blocks per SM get work; a block
    keeps at least one full warp (the shuffles assume whole warps)."""
    unit = max(1, warp // g.tpr)  # rows per whole warp
    return g._replace(rpb=max(unit, min(g.rpb, _round_up(_cdiv(M, 2 * sms), unit))))


def vec_options(dtype):
    """Vector widths for ``dtype``: 16 bytes down to one element."""
    v = 16 // dtype.itemsize
    out = []
    while v >= 1:
        out.append(v)
        v //= 2
    return out


def all_kernel_names(warp):
    """Name expressions of every kernel the planner can launch on a device of this warp size."""
    pairs = [(FLOAT16, FLOAT16), (FLOAT16, FLOAT32), (BFLOAT16, BFLOAT16), (BFLOAT16, FLOAT32),
             (FLOAT32, FLOAT32), (FLOAT64, FLOAT64), (FLOAT64, FLOAT32)]
    passes = {"fwd": range(1, FWD_NPT + 1), "bwd": range(BWD_NPT_MIN, BWD_NPT + 1)}
    names = set()
    for t, w in pairs:
        for ln in (True, False):
            for v in vec_options(t):
                for pass_, npts in passes.items():
                    for n in npts:
                        if n & (n - 1):
                            continue  # vectors per thread are powers of two
                        names.update(Spec(t, w, ln, v, n, warp).names(pass_).values())
    return names


# ----------------------------------------------------------------------------- device facts


class DeviceInfo(NamedTuple):
    sms: int
    warp: int
    threads_per_sm: int
    regs_per_sm: int
    smem_per_sm: int


@functools.cache
def device_info(dev_id):
    a = cp.cuda.Device(dev_id).attributes
    return DeviceInfo(
        sms=a.get("MultiProcessorCount", 1),
        warp=a.get("WarpSize", 32),
        threads_per_sm=a.get("MaxThreadsPerMultiProcessor", 2048),
        regs_per_sm=a.get("MaxRegistersPerMultiprocessor", 65536),
        smem_per_sm=a.get("MaxSharedMemoryPerMultiprocessor", 65536),
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


class Plan(NamedTuple):
    spec: Spec
    kerns: dict  # the pass's RawKernels on the plan's device
    grid: tuple
    block: tuple
    smem: int
    # long-row backward only: grid/block of the row-sum kernel (None otherwise)
    rs_grid: tuple | None = None
    rs_block: tuple | None = None


@functools.cache
def plan_fwd(dev_id, dtype, wdtype, is_ln, M, N, vec):
    info = device_info(dev_id)
    g = row_geometry(N // vec, info.warp, FWD_NPT_MIN, FWD_NPT, FWD_TPR_MAX, FWD_BLOCK)
    g = _spread(g, M, info.warp, info.sms)
    spec = Spec(dtype, wdtype, is_ln, vec, g.npt, info.warp)
    grid = min(_cdiv(M, g.rpb), info.sms * 64)
    kern = _compile.kernels(spec, "fwd")["fwd" if g.fits else "fwd_chunked"]
    return Plan(spec, {"fwd": kern}, (grid,), (g.tpr, g.rpb), 0)


@functools.cache
def plan_bwd(dev_id, dtype, wdtype, is_ln, M, N, vec):
    """Backward geometry. The grid depends only on (device, dtypes, M, N, vec), so the
    deterministic reduction order is the same on every call."""
    info = device_info(dev_id)
    g = row_geometry(N // vec, info.warp, BWD_NPT_MIN, BWD_NPT, BWD_TPR_MAX, BWD_BLOCK)
    if g.npt > 1:  # the kernel's launch bound: 512 threads when a thread holds two vectors
        g = g._replace(rpb=max(1, min(g.rpb, 512 // g.tpr)))
    g = _spread(g, M, info.warp, info.sms)
    acc_size = ACC_DTYPES[dtype].itemsize
    if g.fits:
        spec = Spec(dtype, wdtype, is_ln, vec, g.npt, info.warp)
        threads = g.tpr * g.rpb
        smem = threads * vec * acc_size if g.rpb > 1 else 0
        kerns = _compile.kernels(spec, "bwd")
        resident = info.sms * _blocks_per_sm(kerns["bwd"], threads, smem, info)
        grid = min(_cdiv(M, g.rpb), resident)
        return Plan(spec, kerns, (grid, 1), (g.tpr, g.rpb), smem)
    spec = Spec(dtype, wdtype, is_ln, vec, BWD_NPT, info.warp)
    tiles = _cdiv(N, TILE_TPR * BWD_NPT * vec)
    kerns = _compile.kernels(spec, "bwd")
    resident = info.sms * _blocks_per_sm(kerns["bwd"], TILE_TPR, 0, info)
    gx = max(1, min(M, _cdiv(resident, tiles)))
    rs_grid = min(M, info.sms * (info.threads_per_sm // ROWSUMS_TPR) * 4)
    return Plan(spec, kerns, (gx, tiles), (TILE_TPR, 1), 0, (rs_grid,), (ROWSUMS_TPR, 1))


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


def _views(mem, parts):
    """Arrays laid one after another (256-byte aligned) in one allocation ``mem``: one pool
    allocation instead of one per output. ``parts`` are (shape, dtype) pairs."""
    out, off = [], 0
    for shape, dtype in parts:
        out.append(cp.ndarray(shape, dtype, mem + off))
        off += _round_up(math.prod(shape) * dtype.itemsize, 256)
    return out


def _nbytes(parts):
    return sum(_round_up(math.prod(shape) * dtype.itemsize, 256) for shape, dtype in parts)


def _outputs(parts, given):
    """Arrays for the (shape, dtype) ``parts``: the caller's where ``given`` has one (``out=``,
    validated by the API), the rest views of one pool allocation."""
    missing = [p for p, o in zip(parts, given, strict=True) if o is None]
    new = iter(_views(cp.cuda.alloc(_nbytes(missing)), missing) if missing else ())
    return [next(new) if o is None else o for o in given]


def _ptr(a):
    return _NULL if a is None else a


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


def forward(x, gamma, beta, eps, k, is_ln, out=None):
    dev = x.data.device_id
    with _on_device(dev):
        lead = x.shape[: x.ndim - k]
        M = math.prod(lead)
        N = math.prod(x.shape[x.ndim - k :])
        parts = [(x.shape, x.dtype)] + [(lead, FLOAT32)] * (2 if is_ln else 1)
        outs = _outputs(parts, out or (None,) * len(parts))  # y, (mean,) rstd
        y, rstd = outs[0], outs[-1]
        mean = outs[1] if is_ln else None
        if M:
            if gamma is not None and beta is not None and gamma.dtype != beta.dtype:
                gamma, beta = gamma.astype(FLOAT32), beta.astype(FLOAT32)
            gamma, beta = _flat(gamma), _flat(beta)
            wdtype = next((p.dtype for p in (gamma, beta) if p is not None), x.dtype)
            xr, ldx = _rows(x, k, N)
            ptrs = [(xr.data.ptr, x.itemsize), (y.data.ptr, x.itemsize)]
            ptrs += [(p.data.ptr, p.itemsize) for p in (gamma, beta) if p is not None]
            vec = _vec(x.dtype, N, (ldx,), ptrs)
            plan = plan_fwd(dev, x.dtype, wdtype, is_ln, M, N, vec)
            acc = ACC_DTYPES[x.dtype].type
            plan.kerns["fwd"](plan.grid, plan.block,
                 (xr, np.int64(ldx), _ptr(gamma), _ptr(beta), y, _ptr(mean), rstd,
                  np.int64(M), np.int64(N), acc(eps)))
    return (y, mean, rstd) if is_ln else (y, rstd)


def backward(dy, x, gamma, mean, rstd, k, need_dx, need_dgamma, need_dbeta, deterministic,
             out=None):
    dev = x.data.device_id
    with _on_device(dev):
        norm_shape = x.shape[x.ndim - k :]
        M = math.prod(x.shape[: x.ndim - k])
        N = math.prod(norm_shape)
        wdtype = x.dtype if gamma is None else gamma.dtype
        if not (need_dx or need_dgamma or need_dbeta):
            return None, None, None
        wanted = [(x.shape, x.dtype, need_dx), (norm_shape, wdtype, need_dgamma),
                  (norm_shape, wdtype, need_dbeta)]
        given = out or (None, None, None)
        it = iter(_outputs([(sh, dt) for sh, dt, f in wanted if f],
                           [o for (_, _, f), o in zip(wanted, given, strict=True) if f]))
        dx, dgamma, dbeta = (next(it) if f else None for _, _, f in wanted)
        if not M:  # no rows: no kernel, zero parameter gradients
            for a in (dgamma, dbeta):
                if a is not None:
                    a.fill(0)
            return dx, dgamma, dbeta
        gamma = _flat(gamma)
        mean = None if mean is None else cp.ascontiguousarray(mean)
        rstd = cp.ascontiguousarray(rstd)
        xr, ldx = _rows(x, k, N)
        dyr, lddy = _rows(dy, k, N)
        ptrs = [(xr.data.ptr, x.itemsize), (dyr.data.ptr, x.itemsize)]
        ptrs += [(p.data.ptr, p.itemsize) for p in (dx, gamma, dgamma, dbeta) if p is not None]
        vec = _vec(x.dtype, N, (ldx, lddy), ptrs)
        plan = plan_bwd(dev, x.dtype, wdtype, mean is not None, M, N, vec)
        kerns = plan.kerns
        acc_dtype = ACC_DTYPES[x.dtype]
        need_params = need_dgamma or need_dbeta
        accum = counter = partial = rowsums = None
        P = plan.grid[0]
        if need_params:
            if deterministic or not ATOMIC_FLUSH:
                partial = cp.empty((P, 2 * N), acc_dtype)
            else:
                scratch = cp.zeros(2 * N + 2, acc_dtype)  # accumulators, then the counter
                accum, counter = scratch, scratch[2 * N :]
        i64 = np.int64
        if plan.rs_grid is not None:
            rowsums = cp.empty((M, 2), acc_dtype)
            kerns["rowsums"](plan.rs_grid, plan.rs_block,
                             (dyr, i64(lddy), xr, i64(ldx), _ptr(gamma), _ptr(mean), rstd,
                              rowsums, i64(M), i64(N)))
        kerns["bwd"](plan.grid, plan.block,
                     (dyr, i64(lddy), xr, i64(ldx), _ptr(gamma), _ptr(mean), rstd,
                      _ptr(rowsums), _ptr(dx), _ptr(dgamma), _ptr(dbeta), _ptr(accum),
                      _ptr(counter), _ptr(partial), i64(M), i64(N)),
                     shared_mem=plan.smem)
        if partial is not None:
            kerns["reduce"]((_cdiv(2 * N, 32),), (32, 8),
                            (partial, i64(P), i64(N), _ptr(dgamma), _ptr(dbeta)))
    return dx, dgamma, dbeta


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
