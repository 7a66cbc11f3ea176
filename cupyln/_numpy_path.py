"""The NumPy path: the float64 reference, applied to blocks of rows, so that its float64
temporaries stay a few tens of MiB whatever the input's size (peak memory: the inputs, the
outputs, and one block's temporaries)."""

from __future__ import annotations

import math

import numpy as np

from . import reference as _ref
from ._dtypes import FLOAT32, param_dtype

BLOCK_BYTES = 16 << 20  # float64 bytes of one block of rows


def _blocks(M, N):
    step = max(1, BLOCK_BYTES // (8 * max(N, 1)))
    return [(r, min(M, r + step)) for r in range(0, M, step)]


def _new(o, shape, dtype):
    return np.empty(shape, dtype) if o is None else o


def forward(x, gamma, beta, eps, k, is_ln, out, residual=None, h_dtype=None, woff=0.0,
            quant=None):
    """(y, mean, rstd) or (y, rstd) of validated NumPy arrays, then y's scales (``quant``:
    (float8 dtype, y_scale or None)) and h where ``residual`` is given; into ``out`` entries
    if given."""
    lead = x.shape[: x.ndim - k]
    M, N = math.prod(lead), math.prod(x.shape[x.ndim - k :])
    add = residual is not None
    y_dtype, y_scale = quant or (None, None)
    out = out or (None,) * ((3 if is_ln else 2) + (quant is not None) + add)
    y = _new(out[0], x.shape, x.dtype if quant is None else y_dtype)
    nstats = 2 if is_ln else 1
    stats = [_new(o, lead, FLOAT32) for o in out[1 : 1 + nstats]]
    if quant is not None:  # per-row scales, or the amax of all rows (filled as rows come)
        scale = _new(out[1 + nstats], lead if y_scale is None else y_scale.shape, FLOAT32)
        scale[...] = 0
        stats.append(scale)
    h = _new(out[-1], x.shape, h_dtype) if add else None
    x2, y2 = x.reshape(M, N), y.reshape(M, N)
    r2, h2 = (None, None) if not add else (residual.reshape(M, N), h.reshape(M, N))
    s2 = [s.reshape(-1) for s in stats]
    g = None if gamma is None else gamma.reshape(N)
    b = None if beta is None else beta.reshape(N)
    with np.errstate(divide="ignore", invalid="ignore"):  # eps = 0 on a constant row: documented
        for r0, r1 in _blocks(M, N):
            xb = x2[r0:r1]
            if add:
                h2[r0:r1] = _ref.residual_add(xb, r2[r0:r1], h_dtype)
                xb = h2[r0:r1]
            if is_ln:
                yb, *sb = _ref.layer_norm_fwd(xb, g, b, eps, 1, weight_offset=woff)
            else:
                yb, *sb = _ref.rms_norm_fwd(xb, g, eps, 1, weight_offset=woff)
            if quant is not None:
                yb, qs = _ref.quantize(yb, y_dtype, y_scale)
                if y_scale is None:
                    sb.append(qs)
                else:
                    s2[-1][0] = np.fmax(s2[-1][0], qs)
            y2[r0:r1] = yb
            for s, v in zip(s2, sb, strict=False):
                s[r0:r1] = v
    return (y, *stats, h) if add else (y, *stats)


def backward(dy, x, gamma, mean, rstd, k, want, out, dresidual=None, woff=0.0):
    """(dx, dgamma, dbeta) of validated NumPy arrays (None where not wanted); ``dresidual``
    is added to dx."""
    norm_shape = x.shape[x.ndim - k :]
    M, N = math.prod(x.shape[: x.ndim - k]), math.prod(norm_shape)
    out = out or (None, None, None)
    pdt = param_dtype(gamma, x.dtype)
    dx = _new(out[0], x.shape, x.dtype) if want[0] else None
    sums = [np.zeros(N) for _ in range(2)]  # dgamma, dbeta in float64
    x2, dy2 = x.reshape(M, N), dy.reshape(M, N)
    dx2 = None if dx is None else dx.reshape(M, N)
    dr2 = None if dresidual is None else dresidual.reshape(M, N)
    g = None if gamma is None else gamma.reshape(N)
    m2 = None if mean is None else mean.reshape(M)
    r2 = rstd.reshape(M)
    with np.errstate(divide="ignore", invalid="ignore"):
        for r0, r1 in _blocks(M, N):
            m = None if m2 is None else m2[r0:r1]
            drb = None if dr2 is None else dr2[r0:r1]
            dxb, dgb, dbb = _ref._norm_bwd(dy2[r0:r1], x2[r0:r1], g, m, r2[r0:r1], drb, woff)
            if dx2 is not None:
                dx2[r0:r1] = dxb
            sums[0] += dgb
            sums[1] += dbb
    grads = [dx]
    for i, s in enumerate(sums, start=1):
        if not want[i]:
            grads.append(None)
        elif out[i] is None:
            grads.append(s.reshape(norm_shape).astype(pdt))
        else:
            np.copyto(out[i], s.reshape(norm_shape), casting="unsafe")
            grads.append(out[i])
    return tuple(grads)
