"""Public API: validation, then dispatch to the NumPy reference path or the CuPy kernels.

Every check runs before any work, so a bad call raises and writes nothing. The checks cost a
fixed number of attribute reads per argument: nothing here grows with the array size.
"""

from __future__ import annotations

import math
import numbers
import sys
from collections.abc import Sequence
from typing import Any

import numpy as np

from . import _numpy_path
from ._config import DEFAULT, Config
from ._dtypes import (
    FLOAT8_DTYPES,
    FLOAT32,
    SUPPORTED_DTYPES,
    SUPPORTED_NAMES,
    h_dtypes,
    param_dtype,
)
from ._layout import span

try:  # CuPy is optional: without it only NumPy arrays are accepted.
    import cupy as _cp

    _CUPY_ARRAY = _cp.ndarray
except Exception:  # pragma: no cover - exercised on machines without CuPy
    _CUPY_ARRAY = ()

Array = Any  # numpy.ndarray or cupy.ndarray
Outputs = tuple | None

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
        if a.dtype.newbyteorder("=") in SUPPORTED_DTYPES:
            raise TypeError(
                f"{name} has dtype {a.dtype.str}, a byte order other than the machine's: convert "
                f"it first, e.g. {name}.astype({name}.dtype.newbyteorder('='))")
        raise TypeError(f"{name} has dtype {a.dtype}; expected {SUPPORTED_NAMES}")


def _check_param_dtype(name, p, x_dtype):
    if p.dtype != x_dtype and p.dtype != FLOAT32:
        want = "float32, like x" if x_dtype == FLOAT32 else f"{x_dtype} (like x) or float32"
        raise TypeError(f"{name} has dtype {p.dtype}; expected {want}")


def _real(name, v):
    """``v`` as a float: a real number, not a bool."""
    if isinstance(v, (bool, np.bool_)) or not isinstance(v, numbers.Real):
        raise TypeError(f"{name} must be a real number, got {type(v).__name__}")
    return float(v)


def _check_eps(eps):
    if type(eps) is float and math.isfinite(eps) and eps >= 0:  # the common case, fast
        return eps
    eps = _real("eps", eps)
    if not math.isfinite(eps) or eps < 0:
        raise ValueError(f"eps must be finite and >= 0, got {eps}")
    return eps


def _check_offset(weight_offset, gamma):
    """weight_offset as a float: finite, and nonzero only with a gamma to offset."""
    if type(weight_offset) is float and weight_offset == 0.0:  # the common case, fast
        return 0.0
    v = _real("weight_offset", weight_offset)
    if not math.isfinite(v):
        raise ValueError(f"weight_offset must be finite, got {v}")
    if v != 0.0 and gamma is None:
        raise ValueError(f"weight_offset={v} needs gamma: the norm scales by gamma + "
                         "weight_offset")
    return v


def _h_dtype(x, residual, residual_dtype):
    """The dtype of h = x + residual (None without a residual), after checking residual and
    residual_dtype: h is x's dtype or, for 16-bit x, float32; residual is x's or h's dtype."""
    if residual is None:
        if residual_dtype is not None:
            raise ValueError("residual_dtype was given but residual is None")
        return None
    if residual_dtype is None:
        hd = x.dtype
    else:
        try:
            hd = np.dtype(residual_dtype)
        except TypeError as e:
            raise TypeError(f"residual_dtype must be a dtype, got {residual_dtype!r}") from e
    allowed = h_dtypes(x.dtype)
    if hd not in allowed:
        names = " or ".join(str(d) for d in allowed)
        raise TypeError(f"residual_dtype is {hd}; expected {names} (x's dtype, or float32 for "
                        "16-bit x)")
    _check_dtype("residual", residual)
    if residual.dtype not in (x.dtype, hd):
        raise TypeError(f"residual has dtype {residual.dtype}; expected x's dtype ({x.dtype})"
                        + (f" or residual_dtype ({hd})" if hd != x.dtype else ""))
    if residual.shape != x.shape:
        raise ValueError(f"residual has shape {tuple(residual.shape)}; expected x's shape "
                         f"{tuple(x.shape)}")
    return hd


def _y_dtype(y_dtype, x):
    """The float8 dtype y is quantized to, or None for y in x's dtype (``y_dtype`` None or x's
    dtype); TypeError for any other."""
    if y_dtype is None:
        return None
    try:
        dt = np.dtype(FLOAT8_DTYPES.get(y_dtype, y_dtype)) if isinstance(y_dtype, str) \
            else np.dtype(y_dtype)
    except TypeError:
        dt = None
    if dt == x.dtype:
        return None
    if dt not in FLOAT8_DTYPES.values():
        raise TypeError(f"y_dtype must be 'float8_e4m3fn' or 'float8_e5m2' (or x's dtype, "
                        f"{x.dtype}), got {y_dtype!r}")
    return dt


def _y_scale(y_scale, y_dtype, kind):
    """ValueError unless ``y_scale`` (given) is a float32 array of one element, with a float8
    ``y_dtype``; on NumPy its value must be finite and above 0 (a CuPy scale stays on the
    device: the kernel writes NaN where it is not)."""
    if y_scale is None:
        return
    if y_dtype is None:
        raise ValueError("y_scale was given but y_dtype is not a float8 dtype: y_scale "
                         "quantizes y")
    if y_scale.dtype != FLOAT32 or y_scale.size != 1:
        raise ValueError(f"y_scale must be a float32 array of one element, got dtype "
                         f"{y_scale.dtype} and shape {tuple(y_scale.shape)}")
    if kind == "numpy":
        v = float(y_scale.reshape(()))
        if not (math.isfinite(v) and v > 0):
            raise ValueError(f"y_scale must be finite and above 0, got {v}")


def _check_config(config):
    if config is None:
        return DEFAULT
    if not isinstance(config, Config):
        raise TypeError(f"config must be a cupyln.Config or None, got {type(config).__name__}")
    return config


def _check_flag(name, v):
    if not isinstance(v, (bool, np.bool_)):
        raise TypeError(f"{name} must be a bool, got {type(v).__name__}")
    return bool(v)


def _shape_arg(normalized_shape):
    """normalized_shape as a tuple of ints (TypeError / ValueError naming it otherwise)."""
    if isinstance(normalized_shape, numbers.Integral):
        normalized_shape = (normalized_shape,)
    if isinstance(normalized_shape, (str, bytes)) or not hasattr(normalized_shape, "__iter__"):
        raise TypeError("normalized_shape must be an int or a tuple of ints, "
                        f"got {type(normalized_shape).__name__}")
    want = tuple(normalized_shape)
    if not all(isinstance(s, numbers.Integral) for s in want):
        raise TypeError(f"normalized_shape must hold ints, got {want!r}")
    if not want:
        raise ValueError("normalized_shape must name at least one axis, got ()")
    return tuple(int(s) for s in want)


def _norm_ndim(x, gamma, beta, normalized_shape):
    """Number of trailing normalized axes of x, checked against gamma, beta, normalized_shape.
    A parameter that disagrees is blamed against x's own trailing axes, so that of gamma (63,)
    and beta (64,) with x (.., 64) the message names gamma."""
    if x.ndim == 0:
        raise ValueError("x must have at least one axis (the normalized one), got a 0-d array")
    named = [("normalized_shape", _shape_arg(normalized_shape))] if normalized_shape is not None \
        else []
    for name, p in (("gamma", gamma), ("beta", beta)):
        if p is not None:
            if p.ndim == 0:
                raise ValueError(f"{name} must have at least one axis, got a 0-d array")
            named.append((name, tuple(p.shape)))
    if not named:
        named = [("x", (x.shape[-1],))]
    for name, want in named:
        k = len(want)
        if k > x.ndim or tuple(x.shape[x.ndim - k :]) != want:
            raise ValueError(
                f"{name} has shape {want} but x has shape {tuple(x.shape)}: the trailing axes "
                "of x must equal the normalized shape")
    source, want = named[0]
    for name, other in named[1:]:  # each matches x's trailing axes, over different numbers
        if other != want:
            raise ValueError(f"{name} has shape {other}; expected the normalized shape {want} "
                             f"(from {source})")
    if 0 in want:
        raise ValueError(f"x has shape {tuple(x.shape)}, whose normalized part {want} is empty: "
                         "each row needs at least one element")
    return len(want)


def _check_stats(x, stats):
    """mean/rstd: float32, each a proper leading part of x's shape, one shape. Returns
    norm_ndim."""
    for name, st in stats:
        if st.dtype != FLOAT32:
            raise ValueError(f"{name} has dtype {st.dtype}; expected float32")
        n = st.ndim
        if n >= x.ndim or tuple(x.shape[:n]) != tuple(st.shape):
            raise ValueError(
                f"{name} has shape {tuple(st.shape)}; expected the leading shape of x "
                f"(a proper prefix of {tuple(x.shape)})")
    shapes = {tuple(st.shape) for _, st in stats}
    if len(shapes) > 1:
        raise ValueError("mean has shape {}, rstd {}: they must be one shape".format(
            *(tuple(st.shape) for _, st in stats)))
    n = stats[0][1].ndim
    if 0 in x.shape[n:]:
        raise ValueError(f"x has shape {tuple(x.shape)}, whose normalized part "
                         f"{tuple(x.shape[n:])} is empty: each row needs at least one element")
    return x.ndim - n


def _check_bwd(dy, x, gamma, stats, dresidual=None):
    for name, a in [("dy", dy), ("x", x)] + stats:
        if a is None:
            raise TypeError(f"{name} must be a numpy.ndarray or cupy.ndarray, got None")
    kind = _kind([("dy", dy), ("x", x), ("gamma", gamma), ("dresidual", dresidual)] + stats)
    _check_dtype("x", x)
    if dy.dtype != x.dtype:  # h's dtype where the forward had a residual (cast dy to it)
        raise TypeError(f"dy has dtype {dy.dtype}; expected x's dtype {x.dtype}")
    if dy.shape != x.shape:
        raise ValueError(f"dy has shape {tuple(dy.shape)}; expected x's shape {tuple(x.shape)}")
    if dresidual is not None:
        if dresidual.dtype != x.dtype:
            raise TypeError(f"dresidual has dtype {dresidual.dtype}; expected x's (h's) dtype "
                            f"{x.dtype}")
        if dresidual.shape != x.shape:
            raise ValueError(f"dresidual has shape {tuple(dresidual.shape)}; expected x's "
                             f"shape {tuple(x.shape)}")
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
        _check_devices([("dy", dy), ("x", x), ("gamma", gamma), ("dresidual", dresidual)]
                       + stats)
    return kind, k


class OutDtypeError(TypeError, ValueError):
    """An ``out=`` entry of the wrong dtype: a wrong type of array and a wrong value of the
    argument, so ``except TypeError`` and ``except ValueError`` both catch it."""


def _check_out(out, want, kind, dev, inputs):
    """Validate ``out=``: None, or a tuple with one entry per output, each None (allocate it) or
    an array of the output's exact shape and dtype, C-contiguous, of the inputs' kind and device,
    overlapping no input and no other output. ``want`` holds (name, shape, dtype, computed) per
    output. Returns the tuple of entries (all None when out is None)."""
    if out is None:
        return (None,) * len(want)
    names = ", ".join(w[0] for w in want)
    if type(out) is not tuple or len(out) != len(want):
        raise TypeError(f"out must be None or a tuple of {len(want)} entries ({names}), each an "
                        f"array or None; got {type(out).__name__}"
                        + (f" of {len(out)}" if isinstance(out, (tuple, list)) else ""))
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
            raise OutDtypeError(f"{label} has dtype {o.dtype}; expected {np.dtype(dtype)}")
        if tuple(o.shape) != tuple(shape):
            raise ValueError(f"{label} has shape {tuple(o.shape)}; expected {tuple(shape)}")
        if not o.flags.c_contiguous:
            raise ValueError(f"{label} must be C-contiguous")
        if not getattr(o.flags, "writeable", True):
            raise ValueError(f"{label} is read-only")
        if kind == "cupy" and o.data.device_id != dev:
            raise ValueError(f"{label} is on device {o.data.device_id}; the inputs are on {dev}")
        if spans is None:
            spans = [(f"the input {n}", span(a)) for n, a in inputs if a is not None and a.size]
        lo, hi = span(o)
        for n, (ilo, ihi) in spans:
            if o.size and lo < ihi and ilo < hi:
                raise ValueError(f"{label} overlaps {n}")
        if o.size:
            spans.append((label, (lo, hi)))  # outputs must not share memory either
    return tuple(out)


# ----------------------------------------------------------------------------- hot calls
#
# A CuPy call whose signature (types, shapes, strides, dtypes, devices, eps and flags, the same
# for out= arrays) passed validation once, and whose arrays went to the kernels without a copy,
# is remembered with its prepared launch: a later call of that signature skips validation and
# planning. What depends on more than the signature (pointer alignment, out= overlap, the current
# device) is still checked on every call, by the prepared pass (see _passes).
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


def _remember(key, prepared=None):
    """The callback that remembers a call's prepared pass under ``key`` (None: a call that is
    not a candidate) and hands it to ``prepared`` (cupyln.torch's table of its own calls)."""
    if key is None:
        return prepared

    def put(hot):
        if len(_HOT) >= _HOT_MAX:
            _HOT.clear()
        _HOT[key] = hot
        if prepared is not None:
            prepared(hot)

    return put


# ----------------------------------------------------------------------------- forward


def _fwd(x, gamma, beta, eps, normalized_shape, is_ln, out, config, residual=None,
         residual_dtype=None, weight_offset=0.0, prepared=None, y_dtype=None, y_scale=None):
    key = None
    if type(x) is _CUPY_ARRAY and type(eps) is float and type(weight_offset) is float and (
            y_dtype is None and y_scale is None) and (
            normalized_shape is None or type(normalized_shape) is tuple) and (
            residual_dtype is None or isinstance(residual_dtype, (np.dtype, type, str))):
        head = (is_ln, eps, normalized_shape, config, residual_dtype, weight_offset)
        plain = normalized_shape is None and config is None and residual_dtype is None \
            and weight_offset == 0.0
        key = _key(head[:2] if plain else head, (x, gamma, beta, residual), out)
        hot = _HOT.get(key)
        if hot is not None:
            res = hot(x, gamma, beta, out, residual)
            if res is not None:
                if prepared is not None:
                    prepared(hot)
                return res
    if x is None:
        raise TypeError("x must be a numpy.ndarray or cupy.ndarray, got None")
    inputs = [("x", x), ("gamma", gamma), ("beta", beta), ("residual", residual),
              ("y_scale", y_scale)]
    kind = _kind(inputs)
    _check_dtype("x", x)
    y_dtype = _y_dtype(y_dtype, x)
    _y_scale(y_scale, y_dtype, kind)
    for name, p in (("gamma", gamma), ("beta", beta)):
        if p is not None:
            _check_param_dtype(name, p, x.dtype)
    eps = _check_eps(eps)
    woff = _check_offset(weight_offset, gamma)
    h_dtype = _h_dtype(x, residual, residual_dtype)
    config = _check_config(config)
    k = _norm_ndim(x, gamma, beta, normalized_shape)
    dev = None
    if kind == "cupy":
        dev = _check_devices(inputs)
        if math.prod(x.shape[x.ndim - k :]) >= _MAX_GPU_N:
            raise ValueError(
                f"x's normalized size must be below 2**31 elements on the GPU, got shape "
                f"{tuple(x.shape[x.ndim - k:])}"
            )
    quant = None if y_dtype is None else (y_dtype, y_scale)
    if out is not None:
        lead = tuple(x.shape[: x.ndim - k])
        y_store = x.dtype if y_dtype is None else y_dtype if kind == "numpy" else np.uint8
        want = [("y", x.shape, y_store, True)] + [("mean", lead, FLOAT32, True)] * is_ln
        want.append(("rstd", lead, FLOAT32, True))
        if y_dtype is not None:
            want.append(("scale", lead, FLOAT32, True) if y_scale is None else
                        ("amax", y_scale.shape, FLOAT32, True))
        if h_dtype is not None:
            want.append(("h", x.shape, h_dtype, True))
        out = _check_out(out, want, kind, dev, inputs)
    if kind == "cupy":
        from . import _passes

        return _passes.forward(x, gamma, beta, eps, k, is_ln, out, _remember(key, prepared),
                               config, residual, h_dtype, woff, quant)
    return _numpy_path.forward(x, gamma, beta, eps, k, is_ln, out, residual, h_dtype, woff,
                               quant)


def layer_norm_fwd(
    x: Array, gamma: Array | None = None, beta: Array | None = None, eps: float = 1e-5, *,
    normalized_shape: int | Sequence[int] | None = None, residual: Array | None = None,
    residual_dtype: Any = None, weight_offset: float = 0.0, y_dtype: Any = None,
    y_scale: Array | None = None, out: Outputs = None, config: Config | None = None,
) -> tuple[Array, ...]:
    """LayerNorm forward: ``y = (x - mean) * rstd * gamma + beta`` over the normalized axes.

    Parameters
    ----------
    x : numpy.ndarray or cupy.ndarray
        float16, bfloat16 (``ml_dtypes.bfloat16``), float32 or float64, any strides. The
        trailing ``gamma.ndim`` axes are normalized (the last axis when gamma and beta are None,
        or the axes ``normalized_shape`` names); every leading axis is a row.
    gamma, beta : array or None
        The normalized shape, in x's dtype or float32. None: no scale (1) / no shift (0).
    eps : float
        Added to the variance; finite and >= 0. With ``eps=0`` a constant row gives
        ``rstd = inf`` and ``y = nan``.
    normalized_shape : int or tuple of ints, optional
        The normalized axes' shape when gamma and beta are None (torch-style).
    residual : array, optional
        Fused residual add: the norm is of ``h = x + residual``, which the kernel also stores
        and returns. x's shape; x's dtype or ``residual_dtype``.
    residual_dtype : dtype, optional
        h's dtype: x's (the default) or, for float16/bfloat16 x, float32 (a residual stream
        kept in float32). Only with ``residual``.
    weight_offset : float
        The norm scales by ``gamma + weight_offset`` (computed in float32; 1.0 for Gemma-style
        weights stored around zero). Nonzero only with gamma.
    y_dtype : str or dtype, optional
        ``"float8_e4m3fn"`` or ``"float8_e5m2"`` (or ml_dtypes' types): y quantized to float8
        in the same pass, with a dequantization scale (``y ~ y_q * scale``). None or x's
        dtype: y in x's dtype.
    y_scale : array, optional
        float32, one element: one static scale for all of y, ``y_q = saturate(rne(y /
        y_scale))``. None (with a float8 ``y_dtype``): a scale per row, ``amax(|y|) / fmax``.
    out : tuple (y, mean, rstd) or (y, mean, rstd, h), optional
        Preallocated, writable, C-contiguous arrays of the outputs' shapes and dtypes (an entry
        may be None), overlapping no input and no other output.
    config : cupyln.Config, optional
        The planner's choices (kernel variants); None is ``cupyln.Config()``. GPU only.

    Returns
    -------
    y : array
        x's shape and dtype; with a float8 ``y_dtype``, y_q: that dtype on NumPy, its bits as
        uint8 on CuPy.
    mean, rstd : array
        float32, of x's leading shape (``rstd = 1 / sqrt(var + eps)``, var biased).
    scale or amax : array
        Only with a float8 ``y_dtype``: each row's dequantization scale (float32, x's leading
        shape), or with ``y_scale`` the largest |y| before scaling (float32, y_scale's shape).
    h : array
        Only with ``residual``: ``x + residual`` in ``residual_dtype``, C-contiguous. Pass it
        to the backward in place of x.

    Raises
    ------
    TypeError
        A non-array, an unsupported dtype (of x, gamma, beta, residual, residual_dtype or
        y_dtype), NumPy and CuPy arrays mixed, a bad ``eps`` or ``weight_offset`` type.
    ValueError
        Shapes that do not match, a negative or non-finite ``eps``, a non-finite
        ``weight_offset`` or one without gamma, ``residual_dtype`` without ``residual``, a
        ``y_scale`` not float32 or not of one element (on NumPy: not finite or not above 0) or
        without a float8 ``y_dtype``, arrays on different devices, an ``out=`` entry that
        overlaps an input or is read-only.

    Examples
    --------
    >>> import numpy as np, cupyln
    >>> x = np.array([[1.0, 2.0, 3.0, 4.0]], np.float32)
    >>> y, mean, rstd = cupyln.layer_norm_fwd(x)
    >>> mean, np.round(y, 3)
    (array([2.5], dtype=float32), array([[-1.342, -0.447,  0.447,  1.342]], dtype=float32))
    >>> y, mean, rstd, h = cupyln.layer_norm_fwd(x, residual=np.ones_like(x))
    >>> h, mean
    (array([[2., 3., 4., 5.]], dtype=float32), array([3.5], dtype=float32))
    >>> y_q, mean, rstd, scale = cupyln.layer_norm_fwd(x, y_dtype="float8_e4m3fn")
    >>> y_q.astype(np.float32)
    array([[-448., -144.,  144.,  448.]], dtype=float32)
    >>> np.round(y_q.astype(np.float32) * scale, 3)  # y ~ y_q * scale
    array([[-1.342, -0.431,  0.431,  1.342]], dtype=float32)
    """
    return _fwd(x, gamma, beta, eps, normalized_shape, True, out, config, residual,
                residual_dtype, weight_offset, y_dtype=y_dtype, y_scale=y_scale)


def rms_norm_fwd(
    x: Array, gamma: Array | None = None, eps: float = 1e-6, *,
    normalized_shape: int | Sequence[int] | None = None, residual: Array | None = None,
    residual_dtype: Any = None, weight_offset: float = 0.0, y_dtype: Any = None,
    y_scale: Array | None = None, out: Outputs = None, config: Config | None = None,
) -> tuple[Array, ...]:
    """RMSNorm forward: ``y = x * rstd * gamma`` with ``rstd = 1 / sqrt(mean(x^2) + eps)``.

    Parameters are those of :func:`layer_norm_fwd` without beta; ``out=(y, rstd)``, then
    ``scale`` or ``amax`` with a float8 ``y_dtype``, then ``h`` with a residual.

    Returns
    -------
    y : array
        x's shape and dtype.
    rstd : array
        float32, of x's leading shape.
    scale or amax : array
        Only with a float8 ``y_dtype``, as in :func:`layer_norm_fwd`.
    h : array
        Only with ``residual``, as in :func:`layer_norm_fwd`.

    Raises
    ------
    TypeError, ValueError
        As :func:`layer_norm_fwd`.

    Examples
    --------
    >>> import numpy as np, cupyln
    >>> y, rstd = cupyln.rms_norm_fwd(np.array([[3.0, 4.0]]), eps=0.0)
    >>> y, rstd
    (array([[0.84852814, 1.13137085]]), array([0.28284273], dtype=float32))
    >>> w = np.zeros(2)  # Gemma-style: the norm scales by 1 + w
    >>> y, rstd = cupyln.rms_norm_fwd(np.array([[3.0, 4.0]]), w, eps=0.0, weight_offset=1.0)
    >>> y
    array([[0.84852814, 1.13137085]])
    """
    return _fwd(x, gamma, None, eps, normalized_shape, False, out, config, residual,
                residual_dtype, weight_offset, y_dtype=y_dtype, y_scale=y_scale)


# ----------------------------------------------------------------------------- backward


def _bwd(dy, x, gamma, mean, rstd, need_dx, need_dgamma, need_dbeta, deterministic, out,
         config, dresidual=None, weight_offset=0.0, prepared=None):
    key = None
    flags = (need_dx, need_dgamma, need_dbeta, deterministic)
    if config is not None or type(weight_offset) is not float or weight_offset != 0.0:
        flags += (config, weight_offset)
    if type(x) is _CUPY_ARRAY and type(need_dx) is type(need_dgamma) is type(need_dbeta) is type(
        deterministic
    ) is bool and type(weight_offset) is float:
        key = _key(flags, (dy, x, gamma, mean, rstd, dresidual), out)
        hot = _HOT.get(key)
        if hot is not None:
            res = hot(dy, x, gamma, mean, rstd, out, dresidual)
            if res is not None:
                if prepared is not None:
                    prepared(hot)
                return res
    stats = [("rstd", rstd)] if mean is None else [("mean", mean), ("rstd", rstd)]
    kind, k = _check_bwd(dy, x, gamma, stats, dresidual)
    need_dx = _check_flag("need_dx", need_dx)
    need_dgamma = _check_flag("need_dgamma", need_dgamma) and gamma is not None
    need_dbeta = _check_flag("need_dbeta", need_dbeta)
    deterministic = _check_flag("deterministic", deterministic)
    woff = _check_offset(weight_offset, gamma)
    if dresidual is not None and not need_dx:
        raise ValueError("dresidual was given but need_dx is False: dresidual is added to dx")
    config = _check_config(config)
    inputs = [("dy", dy), ("x", x), ("gamma", gamma), ("dresidual", dresidual)] + stats
    if out is not None:
        norm = tuple(x.shape[x.ndim - k :])
        pdt = param_dtype(gamma, x.dtype)
        want = [("dx", x.shape, x.dtype, need_dx), ("dgamma", norm, pdt, need_dgamma)]
        want += [("dbeta", norm, pdt, need_dbeta)] if mean is not None else []
        dev = x.data.device_id if kind == "cupy" else None
        out = _check_out(out, want, kind, dev, inputs)
        out = out + (None,) * (3 - len(out))  # RMSNorm: no dbeta
    if kind == "cupy":
        from . import _passes

        return _passes.backward(
            dy, x, gamma, mean, rstd, k, need_dx, need_dgamma, need_dbeta, deterministic, out,
            _remember(key, prepared), config, dresidual, woff,
        )
    return _numpy_path.backward(dy, x, gamma, mean, rstd, k,
                                (need_dx, need_dgamma, need_dbeta), out, dresidual, woff)


def layer_norm_bwd(
    dy: Array, x: Array, gamma: Array | None, mean: Array, rstd: Array, *,
    dresidual: Array | None = None, weight_offset: float = 0.0,
    need_dx: bool = True, need_dgamma: bool = True, need_dbeta: bool = True,
    deterministic: bool = False, out: Outputs = None, config: Config | None = None,
) -> tuple[Array | None, Array | None, Array | None]:
    """LayerNorm backward from the forward's saved ``mean`` and ``rstd``.

    Parameters
    ----------
    dy, x : array
        The gradient of y and the forward's input (its ``h`` where the forward had a
        residual): one shape, one dtype (with ``residual_dtype=float32``, dy in float32 too).
    gamma : array or None
        The forward's gamma (None: dgamma is None), in x's dtype or float32: 16-bit gamma of a
        forward with ``residual_dtype=float32`` goes in as ``gamma.astype(float32)``.
    mean, rstd : array
        float32, of the leading shape: they say which axes are normalized.
    dresidual : array, optional
        The gradient reaching h from the residual stream: x's shape and dtype, added to dx in
        the same kernel (dx is then the gradient of both the forward's x and its residual).
        Needs ``need_dx``.
    weight_offset : float
        The forward's ``weight_offset`` (dx uses ``gamma + weight_offset``; dgamma is the same
        either way).
    need_dx, need_dgamma, need_dbeta : bool
        Outputs to compute; one not asked for is returned as None.
    deterministic : bool
        True: dgamma/dbeta bitwise identical across runs on the same device and shapes. False
        lets the plan take rows dynamically and accumulate with float32 atomics where faster.
    out : tuple (dx, dgamma, dbeta), optional
        As in :func:`layer_norm_fwd`; the entry of an output not computed must be None.
    config : cupyln.Config, optional
        As in :func:`layer_norm_fwd`.

    Returns
    -------
    dx : array or None
        x's shape and dtype (plus ``dresidual`` where given).
    dgamma, dbeta : array or None
        The normalized shape, in gamma's dtype (x's when gamma is None); dbeta is computed
        whether or not beta was given.

    Raises
    ------
    TypeError
        A non-array, an unsupported dtype, dy's or dresidual's dtype not x's, a non-bool flag,
        a bad ``weight_offset`` type.
    ValueError
        Shapes that do not match (mean/rstd not a leading part of x's shape), mean or rstd not
        float32, arrays on different devices, a bad ``out=`` entry, ``dresidual`` without
        ``need_dx``, ``weight_offset`` as in the forward.

    Examples
    --------
    >>> import numpy as np, cupyln
    >>> x = np.array([[1.0, 2.0, 3.0, 4.0]])
    >>> y, mean, rstd = cupyln.layer_norm_fwd(x, np.ones(4), np.zeros(4))
    >>> dx, dgamma, dbeta = cupyln.layer_norm_bwd(np.ones_like(x), x, np.ones(4), mean, rstd)
    >>> bool(np.abs(dx).max() < 1e-6), dbeta  # dy constant along the row: dx is 0
    (True, array([1., 1., 1., 1.]))
    """
    if mean is None:
        raise TypeError("mean must be a numpy.ndarray or cupy.ndarray, got None")
    return _bwd(dy, x, gamma, mean, rstd, need_dx, need_dgamma, need_dbeta, deterministic, out,
                config, dresidual, weight_offset)


def rms_norm_bwd(
    dy: Array, x: Array, gamma: Array | None, rstd: Array, *, dresidual: Array | None = None,
    weight_offset: float = 0.0, need_dx: bool = True, need_dgamma: bool = True,
    deterministic: bool = False, out: Outputs = None, config: Config | None = None,
) -> tuple[Array | None, Array | None]:
    """RMSNorm backward from the forward's saved ``rstd``.

    Parameters (``dresidual`` and ``weight_offset`` included), errors and determinism as in
    :func:`layer_norm_bwd`, without mean and dbeta; ``out=(dx, dgamma)``.

    Returns
    -------
    dx : array or None
        x's shape and dtype.
    dgamma : array or None
        The normalized shape, in gamma's dtype.

    Examples
    --------
    >>> import numpy as np, cupyln
    >>> x = np.array([[3.0, 4.0]])
    >>> y, rstd = cupyln.rms_norm_fwd(x, np.ones(2))
    >>> dx, dgamma = cupyln.rms_norm_bwd(np.ones_like(x), x, np.ones(2), rstd)
    >>> np.round(dgamma, 4)  # sum over rows of dy * x * rstd
    array([0.8485, 1.1314])
    """
    dx, dgamma, _ = _bwd(dy, x, gamma, None, rstd, need_dx, need_dgamma, False, deterministic,
                         out, config, dresidual, weight_offset)
    return dx, dgamma


def clear_caches() -> None:
    """Forget every plan and remembered call (compiled kernels stay)."""
    _HOT.clear()
    if "cupyln._passes" in sys.modules:
        sys.modules["cupyln._passes"].clear_caches()
