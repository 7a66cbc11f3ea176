"""The passes on validated CuPy arrays: forward, backward and warmup.

A pass is prepared once per signature (device, plan, shapes, strides, dtypes, flags, which
outputs were given) as a :class:`HotFwd` / :class:`HotBwd`: the plan's launchers, the output
layout and the constant kernel arguments. Calling it costs the pointer reads, one allocation
and the launches; nothing here synchronizes with the host, so calls can be captured in a CUDA
graph. It returns None (the caller then takes the general path) when this call's pointers do
not suit the plan's vector width, an out= array overlaps an input, or another device is current.
"""

from __future__ import annotations

import functools
import math

import cupy as cp
import numpy as np

from . import _plan
from ._config import DEFAULT
from ._dtypes import ACC_DTYPES, FLOAT32, kernel_param_dtype, param_dtype
from ._facts import device_info, launcher
from ._layout import Extents, Layout, fill, flat, peelable, ptr, rows, vec_width
from ._recipe import Builder

_get_device, _current_stream = cp.cuda.runtime.getDevice, cp.cuda.get_current_stream
_is_capturing = cp.cuda.runtime.streamIsCapturing
# Scratch-only allocations of calls captured into CUDA graphs, kept for the rest of the process
# (an allocation that also holds an output lives as long as the output).
_CAPTURED = []


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


class _Prepared:
    """What HotFwd and HotBwd share: the launch on raw addresses (for cupyln.torch)."""

    __slots__ = ()

    @property
    def scratch_bytes(self):
        """Memory :meth:`launch_at` needs for the kernels alone (outputs all given)."""
        return self.layout.nbytes

    def launch_at(self, stream, ptrs, scratch):
        """The pass on raw addresses ``ptrs`` (in ``_launch``'s order), for callers that
        allocated every output (none overlapping an input) and ``scratch_bytes`` at
        ``scratch``, with this pass's device current. False (nothing launched) where this pass
        allocates outputs or the addresses do not suit its vectors."""
        return not self.layout.parts and self._launch(stream, ptrs, scratch)

    def native(self):
        """The recipe for cupyln.torch's C++ layer, where it can run this pass: every output
        given, so nothing is allocated here (None otherwise)."""
        return None if self.layout.parts else self.recipe.native()


class HotFwd(_Prepared):
    __slots__ = ("dev", "parts", "layout", "given", "is_ln", "ext", "add", "recipe")

    def __init__(self, dev, plan, x_shape, lead, is_ln, given, ldx, M, N, eps, ldr=0):
        hdtype = plan.spec.hdtype
        self.add = hdtype is not None  # the fused residual add: h after the statistics
        parts = [(x_shape, plan.spec.dtype)] + [(lead, FLOAT32)] * (2 if is_ln else 1)
        parts += [(x_shape, hdtype)] if self.add else []
        self.dev, self.is_ln = dev, is_ln
        self.given = given if given and any(given) else None  # which outputs out= gives
        # rows in parts: their statistics in scratch after the outputs (one allocation)
        self.parts = plan.launch.get("fwd_parts")
        part_bytes = M * plan.grid[0] * 2 * ACC_DTYPES[plan.spec.dtype].itemsize
        self.layout = Layout([p for i, p in enumerate(parts)
                              if self.given is None or not self.given[i]],
                             [part_bytes] if self.parts else [])
        self.ext = Extents()
        self.recipe = self._recipe(plan, hdtype, ldx, M, N, eps, ldr)

    def _recipe(self, plan, hdtype, ldx, M, N, eps, ldr):
        b = Builder(("x", "gamma", "beta", "residual", "y", "mean", "rstd", "h"))
        # peeled rows: any element address, x's and y's rows alike within 16 bytes
        v = 1 if plan.spec.peeled else plan.spec.vec
        b.aligned(("x", "y"), v * plan.spec.dtype.itemsize - 1)
        b.aligned(("gamma", "beta"), v * plan.spec.wdtype.itemsize - 1)
        if self.add:
            b.aligned(("residual", "h"), v * hdtype.itemsize - 1)
        if plan.spec.peeled:
            for other in ("y", "residual", "h") if self.add else ("y",):
                b.alike("x", other)
        args = ["x", b.const(ldx), "gamma", "beta", "y", "mean", "rstd", b.const(M), b.const(N),
                b.const(eps)]
        if self.add:
            args += ["residual", b.const(ldr), "h"]
        if self.parts:  # the parts' statistics, in the scratch after the outputs
            args.append(b.scratch(self.layout.scratch[0]))
            b.launch(launcher(self.parts), args)
        b.launch(launcher(plan.launch["fwd"]), args)
        return b.build(self.layout.nbytes)

    def __call__(self, x, gamma, beta, out, residual=None):
        if _get_device() != self.dev:
            return None
        outs, mem = self.layout.make()
        if self.given:
            outs = fill(out, outs)
        ins = (x, gamma, beta, residual)
        y, *stats = outs[: 3 if self.is_ln else 2]
        mean, rstd = stats if self.is_ln else (None, stats[0])
        ptrs = (*map(ptr, ins), ptr(y), ptr(mean), ptr(rstd), ptr(outs[-1]) if self.add else 0)
        if self.given and self.ext.overlap(out, ins[:3 + self.add], (
                *ptrs[:3 + self.add], *map(ptr, out))):
            return None
        stream = _current_stream().ptr
        if not self._launch(stream, ptrs, 0 if mem is None else mem.ptr):
            return None
        if self.parts and not self.layout.parts and _is_capturing(stream):
            _CAPTURED.append(mem)  # scratch alone, written by every replay: kept
        return tuple(outs)

    def _launch(self, stream, ptrs, base):
        """``ptrs``: x, gamma, beta, residual, then y, mean, rstd, h (0 for None: RMSNorm's
        mean, the add's absent)."""
        if not self.recipe.suits(ptrs):
            return False
        self.recipe.run(stream, ptrs, base, 0)
        return True


class HotBwd(_Prepared):
    __slots__ = ("dev", "layout", "given", "want", "atomic", "flushed", "partial", "own",
                 "scratch_only", "ext", "recipe")

    def __init__(self, dev, plan, x_shape, norm_shape, wdtype, want, given, partials, dynamic,
                 ldx, lddy, M, N, ldres=None):
        acc = ACC_DTYPES[plan.spec.dtype]
        parts = [(x_shape, plan.spec.dtype), (norm_shape, wdtype), (norm_shape, wdtype)]
        self.dev, self.want = dev, want
        self.given = given if given and any(given) else None  # which outputs out= gives
        new = [p for i, p in enumerate(parts)
               if want[i] and (self.given is None or not self.given[i])]
        # scratch after the outputs, in the same allocation (held while the outputs live): the
        # dgamma/dbeta partials of each block, the row sums of long rows, and (only while a graph
        # is being captured) the zeroed ticket counter and atomic sums (see _atomic_scratch)
        P = plan.grid[0]
        # dgamma/dbeta flushed through memory: not where one cluster sums them itself, nor
        # where each block holds all rows of its columns (plan.direct)
        params = (want[1] or want[2]) and plan.variant != "bwd_csum" and not plan.direct
        partials = partials or plan.spec.peeled  # those kernels have no atomic flush
        self.atomic = params and not partials
        # the last block, found by a ticket counter, flushes: the atomic sums, or the partials
        # where the plan has no reduction kernel; dynamic rows take their tickets from a
        # counter after that one
        self.flushed = self.atomic or (params and "reduce" not in plan.launch)
        # a cooperative grid's row sums: in the zeroed area, after the atomic sums
        grid = bool(plan.spec.grid)
        counted = self.flushed or dynamic or grid
        acc_bytes = _ACC_OFFSET + (2 * N * acc.itemsize if self.atomic else 0)
        grid_sums = acc_bytes if grid else None
        acc_bytes += _plan.grid_sums_bytes(plan) if grid else 0
        merge = plan.launch.get("rowsums_merge")
        G = plan.launch["rowsums"].grid[1] if merge else 0  # parts per row
        scratch = {"partial": P * 2 * N * acc.itemsize if params and partials else 0,
                   "rowsums": M * 2 * acc.itemsize if "rowsums" in plan.launch else 0,
                   "parts": M * G * 2 * acc.itemsize,
                   "own": acc_bytes if counted else 0}
        self.layout = Layout(new, [n for n in scratch.values() if n])
        offs = iter(self.layout.scratch)
        self.partial, rowsums, parts_at, self.own = (next(offs) if n else None
                                                     for n in scratch.values())
        self.scratch_only = not new and self.layout.nbytes > 0
        self.ext = Extents()
        b = Builder(("dy", "x", "gamma", "mean", "rstd", "dresidual", "dx", "dgamma", "dbeta"))
        # peeled rows: any element address, x's, dy's and dx's rows alike within 16 bytes
        v = 1 if plan.spec.peeled else plan.spec.vec
        b.aligned(("dy", "x", "dx", "dresidual"), v * plan.spec.dtype.itemsize - 1)
        b.aligned(("gamma",), v * wdtype.itemsize - 1)
        if plan.spec.peeled:
            for other in ("dy", "dx", "dresidual"):
                b.alike("x", other)
        ldx, lddy, M, N = (b.const(c) for c in (ldx, lddy, M, N))
        rs = b.scratch(rowsums)
        stats = ("gamma", "mean", "rstd")
        if G:  # the row sums in parts, then added
            at = b.scratch(parts_at)
            b.launch(launcher(plan.launch["rowsums"]), ["dy", lddy, "x", ldx, *stats, at, M, N])
            b.launch(launcher(merge), [at, b.const(G), rs, M])
        elif rowsums is not None:
            b.launch(launcher(plan.launch["rowsums"]), ["dy", lddy, "x", ldx, *stats, rs, M, N])
        pp = b.scratch(self.partial)
        # the zeroed memory: the last block's ticket counter, float32 atomic sums after the
        # counters, the rows' ticket counter after the last block's (or the grid's row sums)
        cnt = b.zeroed(0 if self.flushed else None)
        ap = b.zeroed(_ACC_OFFSET if self.atomic else None)
        tk = b.zeroed(_TICKETS if dynamic else grid_sums)
        b.launch(launcher(plan.launch["bwd_dyn" if dynamic else "bwd"]),
                 ["dy", lddy, "x", ldx, *stats, rs, "dx", "dgamma", "dbeta", ap, cnt, tk, pp, M,
                  N, "dresidual", b.const(ldres or 0)])
        if self.partial is not None and "reduce" in plan.launch:
            b.launch(launcher(plan.launch["reduce"]), [pp, b.const(P), N, "dgamma", "dbeta"])
        self.recipe = b.build(self.layout.nbytes, acc_bytes if counted else 0)

    def __call__(self, dy, x, gamma, mean, rstd, out, dres=None):
        if _get_device() != self.dev:
            return None
        new, mem = self.layout.make()
        given = (*out, None, None)[:3] if self.given else _NONE3  # RMSNorm: 2 given
        it, want = iter(new), self.want
        dx = (next(it) if given[0] is None else given[0]) if want[0] else None
        dgamma = (next(it) if given[1] is None else given[1]) if want[1] else None
        dbeta = (next(it) if given[2] is None else given[2]) if want[2] else None
        ins = (dy, x, gamma, mean, rstd, dres)
        ptrs = (*map(ptr, ins), ptr(dx), ptr(dgamma), ptr(dbeta))
        if self.given and self.ext.overlap(given, ins, (*ptrs[:6], *map(ptr, given))):
            return None
        stream = _current_stream().ptr
        if not self._launch(stream, ptrs, 0 if mem is None else mem.ptr):
            return None
        if self.scratch_only and _is_capturing(stream):
            # a replay writes to this scratch, and no output keeps it: it must outlive the call
            _CAPTURED.append(mem)
        return dx, dgamma, dbeta

    def _launch(self, stream, ptrs, base):
        """``ptrs``: dy, x, gamma, mean, rstd, dresidual, then dx, dgamma, dbeta (0 for
        None)."""
        r = self.recipe
        if not r.suits(ptrs):
            return False
        zero = _atomic_scratch(self.dev, stream, r.zeroed_bytes, base + self.own) \
            if r.zeroed_bytes else 0
        r.run(stream, ptrs, base, zero)
        return True


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
        if len(_SCRATCH) >= 256:  # streams a program made and dropped: their scratch freed
            _SCRATCH.clear()
        mem = cp.cuda.alloc(size)
        cp.cuda.runtime.memsetAsync(mem.ptr, 0, size, stream)
        _SCRATCH[dev, stream] = mem
    return mem.ptr


@functools.lru_cache(maxsize=4096)
def _hot_fwd(*key):
    return HotFwd(*key)


@functools.lru_cache(maxsize=4096)
def _hot_bwd(*key):
    return HotBwd(*key)


def clear_caches():
    """Forget every plan and prepared pass (kernels stay compiled)."""
    _plan.clear()
    launcher.cache_clear()
    for f in (_hot_fwd, _hot_bwd):
        f.cache_clear()


def _given(out):
    return None if out is None else tuple(o is not None for o in out)


def _kernel_params(p, x_dtype, gamma, beta):
    """``p`` (gamma or beta) in the dtype the kernels take: float32 where gamma and beta differ,
    x's where the kernels have no float32 pair for x's dtype (float64 rows)."""
    if p is None:
        return None
    w = p.dtype
    if gamma is not None and beta is not None and gamma.dtype != beta.dtype:
        w = FLOAT32
    return p.astype(kernel_param_dtype(x_dtype, w), copy=False)


def _forward_inputs(x, gamma, beta, residual, k, N, hdtype, woff):
    """(gamma, beta, x's rows and row stride, the residual's and its) as the forward kernels take
    them: parameters flat in the kernels' dtype (gamma + woff a new array: never remembered),
    the residual in h's dtype."""
    gk = _offset(gamma, x.dtype, woff)
    g2, b2 = (flat(_kernel_params(p, x.dtype, gk, beta)) for p in (gk, beta))
    xr, ldx = rows(x, k, N)
    r2, ldr = (None, 0) if residual is None else rows(residual.astype(hdtype, copy=False), k, N)
    return g2, b2, xr, ldx, r2, ldr


def forward(x, gamma, beta, eps, k, is_ln, out=None, remember=None, config=DEFAULT,
            residual=None, hdtype=None, woff=0.0, quant=None):
    """The forward pass on validated CuPy arrays (``residual``: the fused add, h in
    ``hdtype``; ``quant``: (float8 dtype, y_scale or None), y in float8). ``remember(hot)`` is
    called with the prepared pass when later calls of the same signature can use it as they
    are (no input copies)."""
    if quant is not None:
        return _quantized_forward(x, gamma, beta, eps, k, is_ln, out, config, residual,
                                  hdtype, woff, *quant)
    dev = x.data.device_id
    with _on_device(dev):
        lead = x.shape[: x.ndim - k]
        M = math.prod(lead)
        N = math.prod(x.shape[x.ndim - k :])
        if not M:
            return _empty_forward(x, lead, is_ln, hdtype, out)
        g2, b2, xr, ldx, r2, ldr = _forward_inputs(x, gamma, beta, residual, k, N, hdtype, woff)
        as_is = g2 is gamma and b2 is beta and xr is x and r2 is residual
        # the given y and h (the statistics are not vectors)
        y, h = (out[0], out[-1] if hdtype is not None else None) if out else (None, None)
        ptrs = [(p.data.ptr, p.itemsize) for p in (xr, g2, b2, y, h, r2) if p is not None]
        vec = vec_width(x.dtype, N, (ldx,) + ((ldr,) if r2 is not None else ()), ptrs)
        wdtype = next((p.dtype for p in (g2, b2) if p is not None), x.dtype)
        ins = [(xr, ldx)] + ([(r2, ldr)] if r2 is not None else [])
        peel = peelable(x.dtype, vec, N, ins, [y, h] if hdtype is not None else [y])
        plan = _plan.plan_fwd(device_info(dev), config, x.dtype, wdtype, is_ln, M, N, vec,
                              hdtype, peel)
        hot = _hot_fwd(dev, plan, x.shape, lead, is_ln, _given(out), ldx, M, N, eps, ldr)
        if remember is not None and as_is:
            remember(hot)
        return hot(xr, g2, b2, out, r2)


def _quantized_forward(x, gamma, beta, eps, k, is_ln, out, config, residual, hdtype, woff,
                       y_dtype, y_scale):
    """The forward with y in float8 (uint8 bits): one launch of the plan's norm_fwd_q, planned
    on every call; a static scale's amax zeroed first (the kernel takes the max into it)."""
    dev = x.data.device_id
    with _on_device(dev):
        lead = x.shape[: x.ndim - k]
        M, N = math.prod(lead), math.prod(x.shape[x.ndim - k :])
        parts = [(x.shape, np.dtype(np.uint8))] + [(lead, FLOAT32)] * (2 if is_ln else 1)
        parts.append((lead, FLOAT32) if y_scale is None else (y_scale.shape, FLOAT32))
        parts += [(x.shape, hdtype)] if hdtype is not None else []
        res = [cp.empty(s, d) if o is None else o
               for (s, d), o in zip(parts, out or (None,) * len(parts), strict=True)]
        nstats = 2 if is_ln else 1
        yq, qs, h = res[0], res[1 + nstats], res[-1] if hdtype is not None else None
        if not M:
            if y_scale is not None:
                qs.fill(0)
            return tuple(res)
        g2, b2, xr, ldx, r2, ldr = _forward_inputs(x, gamma, beta, residual, k, N, hdtype, woff)
        ptrs = [(p.data.ptr, p.itemsize) for p in (xr, g2, b2, h, r2) if p is not None]
        lds = (ldx,) + ((ldr,) if r2 is not None else ())
        vec = vec_width(x.dtype, N, lds, ptrs + [(yq.data.ptr, 1)])
        wdtype = next((p.dtype for p in (g2, b2) if p is not None), x.dtype)
        plan = _plan.plan_fwd(device_info(dev), config, x.dtype, wdtype, is_ln, M, N, vec,
                              hdtype, False, "row" if y_scale is None else "tensor")
        # (a ValueError above: nothing written yet)
        if y_scale is not None:
            qs.fill(0)
        mean, rstd = res[1:3] if is_ln else (None, res[1])
        args = [ptr(xr), ldx, ptr(g2), ptr(b2), ptr(yq), ptr(mean), ptr(rstd), M, N, eps,
                ptr(r2), ldr, ptr(h), ptr(qs) if y_scale is None else 0,
                ptr(y_scale), ptr(qs) if y_scale is not None else 0,
                int(np.dtype(y_dtype).name == "float8_e5m2")]
        launcher(plan.launch["fwd"])(_current_stream().ptr, *args)
        return tuple(res)


def _empty_forward(x, lead, is_ln, hdtype, out):
    """No rows: empty outputs, no kernel."""
    parts = [(x.shape, x.dtype)] + [(lead, FLOAT32)] * (2 if is_ln else 1)
    parts += [(x.shape, hdtype)] if hdtype is not None else []
    given = out or (None,) * len(parts)
    return tuple(fill(out, Layout([p for p, o in zip(parts, given, strict=True)
                                   if o is None]).make()[0]))


def backward(dy, x, gamma, mean, rstd, k, need_dx, need_dgamma, need_dbeta, deterministic,
             out=None, remember=None, config=DEFAULT, dres=None, woff=0.0):
    """The backward pass on validated CuPy arrays (``dres``: the fused add's gradient from the
    residual stream, added to dx); ``remember`` as in :func:`forward`."""
    want = (need_dx, need_dgamma, need_dbeta)
    if not any(want):
        return None, None, None
    wdtype = param_dtype(gamma, x.dtype)
    dev = x.data.device_id
    with _on_device(dev):
        if woff or kernel_param_dtype(x.dtype, wdtype) != wdtype:
            return _widened_backward(dy, x, gamma, mean, rstd, k, want, deterministic, out,
                                     config, dres, woff)
        norm_shape = x.shape[x.ndim - k :]
        M = math.prod(x.shape[: x.ndim - k])
        N = math.prod(norm_shape)
        if not M:
            return _empty_backward(x.shape, norm_shape, x.dtype, wdtype, want, out)
        g2 = flat(gamma)
        m2 = None if mean is None else cp.ascontiguousarray(mean)
        r2 = cp.ascontiguousarray(rstd)
        xr, ldx = rows(x, k, N)
        dyr, lddy = rows(dy, k, N)
        drr, ldres = (None, None) if dres is None else rows(dres, k, N)
        as_is = (g2 is gamma and m2 is mean and r2 is rstd and xr is x and dyr is dy
                 and drr is dres)
        ptrs = [(xr.data.ptr, x.itemsize), (dyr.data.ptr, x.itemsize)]
        # vector accesses: x, dy, dx, dresidual and gamma (dgamma/dbeta are per element)
        ptrs += [(p.data.ptr, p.itemsize) for p in (g2, out and out[0], drr) if p is not None]
        lds = (ldx, lddy) + ((ldres,) if drr is not None else ())
        # narrower vectors for the plain backward; the fused add's: 16 bytes or one element
        vec = vec_width(x.dtype, N, lds, ptrs, narrow=drr is None)
        dx = out[0] if out else None
        inputs = [(xr, ldx), (dyr, lddy)] + ([(drr, ldres)] if drr is not None else [])
        peel = peelable(x.dtype, vec, N, inputs, [dx])
        plan = _plan.plan_bwd(device_info(dev), config, x.dtype, wdtype, mean is not None, M, N,
                              vec, drr is not None, peel)
        partials = deterministic or not config.atomic_flush
        dynamic = plan.dynamic and not deterministic
        hot = _hot_bwd(dev, plan, x.shape, norm_shape, wdtype, want, _given(out), partials,
                       dynamic, ldx, lddy, M, N, ldres)
        if remember is not None and as_is:
            remember(hot)
        return hot(dyr, xr, g2, m2, r2, out, drr)


def _empty_backward(x_shape, norm_shape, dtype, wdtype, want, out):
    """No rows: no kernel, zero parameter gradients."""
    parts = [(x_shape, dtype), (norm_shape, wdtype), (norm_shape, wdtype)]
    given = out or (None, None, None)
    new = iter(Layout([p for p, w, o in zip(parts, want, given, strict=True)
                       if w and o is None]).make()[0])
    grads = [(next(new) if o is None else o) if w else None
             for w, o in zip(want, given, strict=True)]
    for a in grads[1:]:
        if a is not None:
            a.fill(0)
    return tuple(grads)


def _widened_backward(dy, x, gamma, mean, rstd, k, want, deterministic, out, config, dres,
                      woff):
    """gamma in the accumulation dtype, plus ``woff`` (the weight offset): float64 rows with
    float32 gamma, and any offset (added once on the N-vector: the kernels stay as they are).
    dgamma/dbeta come back in gamma's dtype (N-vectors, cast on the device)."""
    dx_out = None if out is None else out[0]
    dx, dg, db = backward(dy, x, _offset(gamma, x.dtype, woff, True), mean, rstd, k, *want,
                          deterministic, None if dx_out is None else (dx_out, None, None), None,
                          config, dres)
    given = out or (None, None, None)
    return dx, *(_narrowed(g, o, gamma.dtype) for g, o in zip((dg, db), given[1:], strict=True))


def _offset(gamma, x_dtype, woff, widen=False):
    """gamma + woff in the dtype the kernels compute in (gamma itself without an offset, unless
    ``widen``): the weight offset, added in float32 (float64 for float64 rows)."""
    if gamma is None or not (woff or widen):
        return gamma
    acc = ACC_DTYPES[x_dtype]
    return gamma.astype(acc) + acc.type(woff) if woff else gamma.astype(acc)


def _narrowed(grad, out, dtype):
    """``grad`` cast to ``dtype``, into ``out`` where given."""
    if grad is None or out is None:
        return None if grad is None else grad.astype(dtype)
    out[...] = grad
    return out


def warmup(shapes, ops=("layernorm", "rmsnorm"), param_dtype=None, config=DEFAULT,
           progress=False):
    """Compile (or load from CuPy's disk cache) the kernels that contiguous inputs of these
    ``(M, N, dtype)`` shapes will use, forward and backward, on the current device."""
    dev = cp.cuda.runtime.getDevice()
    jobs = [(M, N, np.dtype(dt), op) for M, N, dt in shapes for op in ops]
    plans = 0
    for M, N, dtype, op in _progress(jobs, progress, "cupyln warmup"):
        wdtype = dtype if param_dtype is None else np.dtype(param_dtype)
        wdtype = kernel_param_dtype(dtype, wdtype)  # what the calls will launch
        vec, bvec = (vec_width(dtype, N, (N,), [], narrow) for narrow in (False, True))
        peel = peelable(dtype, vec, N, [], [None])  # contiguous rows start alike
        is_ln, M = op == "layernorm", max(M, 1)
        # the arguments as the calls give them (the plans' LRU caches key on them)
        _plan.plan_fwd(device_info(dev), config, dtype, wdtype, is_ln, M, N, vec, None, peel)
        _plan.plan_bwd(device_info(dev), config, dtype, wdtype, is_ln, M, N, bvec, False, peel)
        plans += 2
    return plans


def _progress(items, show, desc):
    """``items``, with a progress bar where asked for and tqdm is installed."""
    if show:
        try:
            from tqdm import tqdm

            return tqdm(items, desc=desc)
        except ImportError:
            pass
    return items
