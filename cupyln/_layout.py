"""Array layout on the GPU: row strides, vector widths, the overlap of ``out=`` arrays, and one
pool allocation per call for the outputs and the kernels' scratch. ``span`` alone serves the
NumPy path too, so CuPy is imported only where it is present."""

from __future__ import annotations

import math

import numpy as np

from ._dtypes import VEC, tuned, vec_options

try:
    import cupy as cp
except ImportError:  # the NumPy path needs only span()
    cp = None


def _round_up(a, b):
    return -(-a // b) * b


def span(a):
    """[lo, hi) byte range that array ``a`` touches (any strides)."""
    ptr = a.data.ptr if not isinstance(a, np.ndarray) else a.__array_interface__["data"][0]
    if a.flags.c_contiguous:  # the common case, without a loop over the axes
        return ptr, ptr + a.nbytes
    lo = hi = ptr
    for n, st in zip(a.shape, a.strides, strict=True):
        if n == 0:
            return ptr, ptr
        lo += min(0, (n - 1) * st)
        hi += max(0, (n - 1) * st)
    return lo, hi + a.itemsize


def row_stride(a, k):
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


def rows(a, k, N):
    """(array, row stride) for the kernel: ``a`` itself when its layout allows, else a copy."""
    if a.flags.c_contiguous:
        return a, N
    ld = row_stride(a, k)
    if ld is None:
        return cp.ascontiguousarray(a), N
    return a, ld


def vec_width(dtype, N, lds, ptrs, narrow=False):
    """The widest vector (of 16 bytes, or with ``narrow`` narrower ones, else one element) that
    divides N and every row stride, and that every pointer is aligned to. ``ptrs`` are
    (address, itemsize) pairs."""
    div = N
    for ld in lds:
        div |= ld
    for v in vec_options(dtype, narrow):
        if div % v == 0 and all(p % (v * s) == 0 for p, s in ptrs):
            return v
    return 1


def peelable(dtype, vec, N, inputs, outs):
    """Whether rows of 16-byte vectors that ``vec`` falls short of can be peeled: every input's
    rows (``inputs``: (array, row stride) pairs) start at the same offset within 16 bytes as
    every output's (``outs``: rows of N; None for one allocated 256-byte aligned), row after
    row; never float64's (the general kernels alone)."""
    wide = VEC[dtype]
    offsets = {0 if o is None else o.data.ptr % 16 for o in outs}
    if vec >= wide or not tuned(dtype, wide) or len(offsets) != 1:
        return False
    (at,) = offsets
    return all((ld - N) % wide == 0 and a.data.ptr % 16 == at for a, ld in inputs)


def flat(p):
    """Parameters as contiguous 1-D arrays (no copy, and no CuPy call, when they already are)."""
    if p is None or (p.ndim == 1 and p.flags.c_contiguous):
        return p
    return cp.ascontiguousarray(p).reshape(-1)


class Layout:
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
    constructor passes through Python-level __new__/__init__ wrappers (2.0 us per array, three
    arrays per forward call); its base class's own constructor and ``_init``, which
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


def fill(given, new):
    """The caller's ``out=`` entries where given, the new arrays (in order) elsewhere."""
    if given is None:
        return new
    it = iter(new)
    return [next(it) if o is None else o for o in given]


def ptr(a):
    return 0 if a is None else a.data.ptr


class Extents:
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
            self.ranges = [None if a is None else tuple(e - a.data.ptr for e in span(a))
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


if cp is not None:
    _alloc, _ndarray = cp.cuda.alloc, _array_maker()
