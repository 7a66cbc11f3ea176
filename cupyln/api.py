"""Public API: validation, then dispatch to the NumPy reference path or the CuPy kernels.

Every check runs before any work, so a bad call raises and writes nothing. The checks cost a
fixed number of attribute reads per argument: nothing here grows with the array size.
"""

from __future__ import annotations

import math
import numbers

import ml_dtypes
import numpy as np

from . import reference as _ref

try:  # CuPy is optional: without it only NumPy arrays are accepted.
    import cupy as _cp

    _CUPY_ARRAY = _cp.ndarray
except Exception:  # pragma: no cover - exercised on machines without CuPy
    _CUPY_ARRAY = ()

FLOAT16 = np.dtype(np.float16)
BFLOAT16 = np.dtype(ml_dtypes.bfloat16)
FLOAT32 = np.dtype(np.float32)
FLOAT64 = np.dtype(np.float64)
#: dtypes accepted for x and dy
SUPPORTED_DTYPES = (FLOAT16, BFLOAT16, FLOAT32, FLOAT64)
_SUPPORTED_NAMES = "float16, bfloat16, float32 or float64"
_MAX_GPU_N = 2**31  # the forward kernel indexes within a row with 32-bit offsets


# ----------------------------------------------------------------------------- validation


def _kind(arrays):
    """'numpy' or 'cupy' for the given non-None arrays; TypeError for anything else or a mix."""
    kind = None
    for name, a in arrays:
        if a is None:
            continue
        if isinstance(a, np.ndarray):
            k = "numpy"
        elif _CUPY_ARRAY and isinstance(a, _CUPY_ARRAY):
            k = "cupy"
        else:
            raise TypeError(
                f"{name} must be a numpy.ndarray or cupy.ndarray, got {type(a).__name__}"
            )
        if kind is None:
            kind = k
        elif k != kind:
            raise TypeError(
                f"{name} is a {k} array but earlier arguments are {kind} arrays: "
                "all arrays of one call must be of the same kind"
            )
    return kind


def _check_devices(arrays):
    """ValueError unless every CuPy array lives on one device; returns that device id."""
    dev = None
    for name, a in arrays:
        if a is None:
            continue
        d = a.data.device_id
        if dev is None:
            dev = d
        elif d != dev:
            raise ValueError(
                f"{name} is on device {d} but earlier arguments are on device {dev}: "
                "all arrays of one call must be on the same device"
            )
    return dev


def _check_dtype(name, a):
    if a.dtype not in SUPPORTED_DTYPES:
        raise TypeError(f"{name} has dtype {a.dtype}; expected {_SUPPORTED_NAMES}")


def _check_param_dtype(name, p, x_dtype):
    if p.dtype != x_dtype and p.dtype != FLOAT32:
        raise TypeError(
            f"{name} has dtype {p.dtype}; expected x's dtype ({x_dtype}) or float32"
        )


def _check_eps(eps):
    if type(eps) is float and math.isfinite(eps) and eps >= 0:  # the common case, fast
        return eps
    if isinstance(eps, (bool, np.bool_)) or not isinstance(eps, numbers.Real):
        raise TypeError(f"eps must be a real number, got {type(eps).__name__}")
    eps = float(eps)
    if not math.isfinite(eps) or eps < 0:
        raise ValueError(f"eps must be finite and >= 0, got {eps}")
    return eps


def _check_flag(name, v):
    if not isinstance(v, (bool, np.bool_)):
        raise TypeError(f"{name} must be a bool, got {type(v).__name__}")
    return bool(v)


def _norm_ndim(x, gamma, beta, normalized_shape):
    """Number of trailing normalized axes of x, checked against gamma, beta, normalized_shape."""
    if x.ndim == 0:
        raise ValueError("x must have at least one axis (the normalized one), got a 0-d array")
    want = source = None
    if normalized_shape is not None:
        if isinstance(normalized_shape, numbers.Integral):
            normalized_shape = (normalized_shape,)
        try:
            want = tuple(int(s) for s in normalized_shape)
        except TypeError:
            raise TypeError(
                "normalized_shape must be an int or a tuple of ints, "
                f"got {type(normalized_shape).__name__}"
            ) from None
        if not want:
            raise ValueError("normalized_shape must name at least one axis, got ()")
        source = "normalized_shape"
    for name, p in (("gamma", gamma), ("beta", beta)):
        if p is None:
            continue
        if p.ndim == 0:
            raise ValueError(f"{name} must have at least one axis, got a 0-d array")
        if want is None:
            want, source = tuple(p.shape), name
        elif tuple(p.shape) != want:
            raise ValueError(
                f"{name} has shape {tuple(p.shape)}; expected the normalized shape {want} "
                f"(from {source})"
            )
    if want is None:
        want = (x.shape[-1],)
    k = len(want)
    if k > x.ndim or tuple(x.shape[x.ndim - k :]) != want:
        raise ValueError(
            f"{source} has shape {want} but x has shape {tuple(x.shape)}: the trailing axes "
            "of x must equal the normalized shape"
        )
    if 0 in want:
        raise ValueError(f"the normalized shape {want} must have at least one element (N >= 1)")
    return k


def _check_stats(x, stats):
    """mean/rstd: float32, one shape, equal to a leading part of x's shape. Returns norm_ndim."""
    shape = None
    for name, s in stats:
        if s.dtype != FLOAT32:
            raise ValueError(f"{name} has dtype {s.dtype}; expected float32")
        if shape is None:
            shape = tuple(s.shape)
        elif tuple(s.shape) != shape:
            raise ValueError(f"{name} has shape {tuple(s.shape)}; expected {shape} like mean")
    k = x.ndim - len(shape)
    if k < 1 or tuple(x.shape[: len(shape)]) != shape:
        raise ValueError(
            f"{stats[0][0]} has shape {shape}; expected the leading shape of x "
            f"(a proper prefix of {tuple(x.shape)})"
        )
    if 0 in x.shape[len(shape) :]:
        raise ValueError("the normalized part of x must have at least one element (N >= 1)")
    return k


def _check_bwd(dy, x, gamma, stats):
    for name, a in [("dy", dy), ("x", x)] + stats:
        if a is None:
            raise TypeError(f"{name} must be a numpy.ndarray or cupy.ndarray, got None")
    kind = _kind([("dy", dy), ("x", x), ("gamma", gamma)] + stats)
    _check_dtype("x", x)
    if dy.dtype != x.dtype:
        raise TypeError(f"dy has dtype {dy.dtype}; expected x's dtype {x.dtype}")
    if dy.shape != x.shape:
        raise ValueError(f"dy has shape {tuple(dy.shape)}; expected x's shape {tuple(x.shape)}")
    if x.ndim == 0:
        raise ValueError("x must have at least one axis, got a 0-d array")
    k = _check_stats(x, stats)
    if gamma is not None:
        _check_param_dtype("gamma", gamma, x.dtype)
        if tuple(gamma.shape) != tuple(x.shape[x.ndim - k :]):
            raise ValueError(
                f"gamma has shape {tuple(gamma.shape)}; expected the normalized shape "
                f"{tuple(x.shape[x.ndim - k:])} (x's shape after mean/rstd's)"
            )
    if kind == "cupy":
        _check_devices([("dy", dy), ("x", x), ("gamma", gamma)] + stats)
    return kind, k


def _span(a):
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


def _check_out(out, want, kind, dev, inputs):
    """Validate ``out=``: None, or a tuple with one entry per output, each None (allocate it) or
    an array of the output's exact shape and dtype, C-contiguous, of the inputs' kind and device,
    overlapping no input and no other output. ``want`` holds (name, shape, dtype, computed) per
    output. Returns the tuple of entries (all None when out is None)."""
    if out is None:
        return (None,) * len(want)
    names = ", ".join(w[0] for w in want)
    if not isinstance(out, (tuple, list)) or len(out) != len(want):
        raise TypeError(f"out must be a tuple of {len(want)} arrays or None ({names})")
    spans = None
    for o, (name, shape, dtype, computed) in zip(out, want, strict=True):
        if o is None:
            continue
        label = f"out {name}"
        if not computed:
            raise ValueError(f"{label} was given, but {name} is not computed by this call")
        if _kind([(label, o)]) != kind:
            raise TypeError(f"{label} must be a {kind} array like the inputs")
        if o.dtype != dtype:
            raise TypeError(f"{label} has dtype {o.dtype}; expected {np.dtype(dtype)}")
        if tuple(o.shape) != tuple(shape):
            raise ValueError(f"{label} has shape {tuple(o.shape)}; expected {tuple(shape)}")
        if not o.flags.c_contiguous:
            raise ValueError(f"{label} must be C-contiguous")
        if kind == "cupy" and o.data.device_id != dev:
            raise ValueError(f"{label} is on device {o.data.device_id}; the inputs are on {dev}")
        if spans is None:
            spans = [(f"the input {n}", _span(a)) for n, a in inputs if a is not None and a.size]
        lo, hi = _span(o)
        for n, (ilo, ihi) in spans:
            if o.size and lo < ihi and ilo < hi:
                raise ValueError(f"{label} overlaps {n}")
        if o.size:
            spans.append((label, (lo, hi)))  # outputs must not share memory either
    return tuple(out)


def _into(o, value):
    """Write ``value`` into the out entry ``o`` (NumPy path) or return it as the output."""
    if o is None:
        return value
    np.copyto(o, value, casting="unsafe")
    return o


def _param_dtype(gamma, x_dtype):
    """dtype of dgamma/dbeta: gamma's, or x's when there is no gamma."""
    return x_dtype if gamma is None else gamma.dtype


# ----------------------------------------------------------------------------- hot calls
#
# A CuPy call whose signature (types, shapes, strides, dtypes, devices, eps and flags, the same
# for out= arrays) passed validation once, and whose arrays went to the kernels without a copy,
# is remembered with its prepared launch: a later call of that signature skips validation and
# planning. What depends on more than the signature (pointer alignment, out= overlap, the current
# device) is still checked on every call, by the prepared launch (see _launch).
_HOT = {}
_HOT_MAX = 4096  # signatures kept; past that the table starts over


def _key(head, arrays, out):
    """The signature of a CuPy call: each argument's, then each out= entry's (type, shape,
    strides, dtype, device), or None (not a candidate: validation takes it). One inlined
    comprehension, no function call per array: this runs on every call."""
    try:
        return (head, out is None, *[
            None if a is None else (type(a), a.shape, a.strides, a.dtype, a.data.device_id)
            for a in (*arrays, *(() if out is None else out))])
    except (AttributeError, TypeError):  # not arrays: validation will say what is wrong
        return None


def _remember(key):
    if key is None:
        return None

    def put(hot):
        if len(_HOT) >= _HOT_MAX:
            _HOT.clear()
        _HOT[key] = hot

    return put


# ----------------------------------------------------------------------------- forward


def _fwd(x, gamma, beta, eps, normalized_shape, is_ln, out):
    key = None
    if type(x) is _CUPY_ARRAY and type(eps) is float and normalized_shape is None:
        key = _key((is_ln, eps), (x, gamma, beta), out)
        hot = _HOT.get(key)
        if hot is not None:
            res = hot(x, gamma, beta, out)
            if res is not None:
                return res
    if x is None:
        raise TypeError("x must be a numpy.ndarray or cupy.ndarray, got None")
    inputs = [("x", x), ("gamma", gamma), ("beta", beta)]
    kind = _kind(inputs)
    _check_dtype("x", x)
    for name, p in (("gamma", gamma), ("beta", beta)):
        if p is not None:
            _check_param_dtype(name, p, x.dtype)
    eps = _check_eps(eps)
    k = _norm_ndim(x, gamma, beta, normalized_shape)
    dev = None
    if kind == "cupy":
        dev = _check_devices(inputs)
        if math.prod(x.shape[x.ndim - k :]) >= _MAX_GPU_N:
            raise ValueError(
                f"x's normalized size must be below 2**31 elements on the GPU, got shape "
                f"{tuple(x.shape[x.ndim - k:])}"
            )
    if out is not None:
        lead = tuple(x.shape[: x.ndim - k])
        want = [("y", x.shape, x.dtype, True)] + [("mean", lead, FLOAT32, True)] * is_ln
        want.append(("rstd", lead, FLOAT32, True))
        out = _check_out(out, want, kind, dev, inputs)
    if kind == "cupy":
        from . import _launch

        return _launch.forward(x, gamma, beta, eps, k, is_ln, out, _remember(key))
    out = out or (None,) * (3 if is_ln else 2)
    if is_ln:
        y, mean, rstd = _ref.layer_norm_fwd(x, gamma, beta, eps, k)
        return (_into(out[0], y.astype(x.dtype)), _into(out[1], mean.astype(FLOAT32)),
                _into(out[2], rstd.astype(FLOAT32)))
    y, rstd = _ref.rms_norm_fwd(x, gamma, eps, k)
    return _into(out[0], y.astype(x.dtype)), _into(out[1], rstd.astype(FLOAT32))


def layer_norm_fwd(x, gamma=None, beta=None, eps=1e-5, *, normalized_shape=None, out=None):
    """LayerNorm forward. Returns ``(y, mean, rstd)``; mean/rstd are float32 of x's leading shape.

    The trailing ``gamma.ndim`` axes of ``x`` are normalized (the last axis when gamma and beta
    are None, or the axes ``normalized_shape`` names). ``out=(y, mean, rstd)`` writes into
    preallocated C-contiguous arrays (an entry may be None); they must not overlap the inputs.
    """
    return _fwd(x, gamma, beta, eps, normalized_shape, True, out)


def rms_norm_fwd(x, gamma=None, eps=1e-6, *, normalized_shape=None, out=None):
    """RMSNorm forward. Returns ``(y, rstd)``; rstd is float32 of x's leading shape.
    ``out=(y, rstd)`` as in :func:`layer_norm_fwd`."""
    return _fwd(x, gamma, None, eps, normalized_shape, False, out)


# ----------------------------------------------------------------------------- backward


def _bwd(dy, x, gamma, mean, rstd, need_dx, need_dgamma, need_dbeta, deterministic, out):
    key = None
    flags = (need_dx, need_dgamma, need_dbeta, deterministic)
    if type(x) is _CUPY_ARRAY and type(need_dx) is type(need_dgamma) is type(need_dbeta) is type(
        deterministic
    ) is bool:
        key = _key(flags, (dy, x, gamma, mean, rstd), out)
        hot = _HOT.get(key)
        if hot is not None:
            res = hot(dy, x, gamma, mean, rstd, out)
            if res is not None:
                return res
    stats = [("rstd", rstd)] if mean is None else [("mean", mean), ("rstd", rstd)]
    kind, k = _check_bwd(dy, x, gamma, stats)
    need_dx = _check_flag("need_dx", need_dx)
    need_dgamma = _check_flag("need_dgamma", need_dgamma) and gamma is not None
    need_dbeta = _check_flag("need_dbeta", need_dbeta)
    deterministic = _check_flag("deterministic", deterministic)
    if out is not None:
        norm = tuple(x.shape[x.ndim - k :])
        pdt = _param_dtype(gamma, x.dtype)
        want = [("dx", x.shape, x.dtype, need_dx), ("dgamma", norm, pdt, need_dgamma)]
        want += [("dbeta", norm, pdt, need_dbeta)] if mean is not None else []
        dev = x.data.device_id if kind == "cupy" else None
        out = _check_out(out, want, kind, dev, [("dy", dy), ("x", x), ("gamma", gamma)] + stats)
        out = out + (None,) * (3 - len(out))  # RMSNorm: no dbeta
    if kind == "cupy":
        from . import _launch

        return _launch.backward(
            dy, x, gamma, mean, rstd, k, need_dx, need_dgamma, need_dbeta, deterministic, out,
            _remember(key),
        )
    out = out or (None, None, None)
    dx, dgamma, dbeta = _ref._norm_bwd(dy, x, gamma, mean, rstd)
    pdt = _param_dtype(gamma, x.dtype)
    return (
        _into(out[0], dx.astype(x.dtype)) if need_dx else None,
        _into(out[1], dgamma.astype(pdt)) if need_dgamma else None,
        _into(out[2], dbeta.astype(pdt)) if need_dbeta else None,
    )


def layer_norm_bwd(
    dy, x, gamma, mean, rstd, *, need_dx=True, need_dgamma=True, need_dbeta=True,
    deterministic=False, out=None,
):
    """LayerNorm backward. Returns ``(dx, dgamma, dbeta)``; an output not asked for is None.

    dgamma is None when gamma is None; dgamma/dbeta have gamma's dtype (x's when gamma is None).
    ``deterministic=True`` makes dgamma/dbeta bitwise repeatable on the same device and shapes.
    ``out=(dx, dgamma, dbeta)`` writes into preallocated C-contiguous arrays; an entry may be
    None, and must be None for an output that is not computed.
    """
    if mean is None:
        raise TypeError("mean must be a numpy.ndarray or cupy.ndarray, got None")
    return _bwd(dy, x, gamma, mean, rstd, need_dx, need_dgamma, need_dbeta, deterministic, out)


def rms_norm_bwd(dy, x, gamma, rstd, *, need_dx=True, need_dgamma=True, deterministic=False,
                 out=None):
    """RMSNorm backward. Returns ``(dx, dgamma)``; an output not asked for is None.
    ``out=(dx, dgamma)`` as in :func:`layer_norm_bwd`."""
    dx, dgamma, _ = _bwd(dy, x, gamma, None, rstd, need_dx, need_dgamma, False, deterministic,
                         out)
    return dx, dgamma
