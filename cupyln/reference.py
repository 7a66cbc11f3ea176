"""NumPy float64 reference of LayerNorm and RMSNorm, forward and backward: the test oracle.

Every function takes arrays of any supported dtype (float16, bfloat16, float32, float64),
computes in float64 and returns float64 arrays. ``norm_ndim`` is the number of trailing axes
that are normalized; the leading axes are rows. No validation here: the public API validates.

``quantize`` models the float8 outputs as the kernels compute them from their float32 y.

The fused residual add is modelled as the kernels store it: ``h = x + residual`` rounded to
``residual_dtype`` (x's dtype by default), and the norm is of that rounded ``h``.
``weight_offset`` scales by ``gamma + weight_offset``.
"""

from __future__ import annotations

import ml_dtypes
import numpy as np

#: float8 output dtypes and the largest finite value of each (what saturation clips to)
FLOAT8 = {np.dtype(ml_dtypes.float8_e4m3fn): 448.0, np.dtype(ml_dtypes.float8_e5m2): 57344.0}


def _rows(a, norm_ndim):
    """(M, N) float64 view of ``a`` with the trailing ``norm_ndim`` axes flattened."""
    n = int(np.prod(a.shape[a.ndim - norm_ndim :], dtype=np.int64))
    return np.asarray(a, dtype=np.float64).reshape(-1, n)


def _param(p, offset=0.0):
    return None if p is None else np.asarray(p, dtype=np.float64).reshape(-1) + offset


def residual_add(x, residual, residual_dtype=None):
    """``x + residual`` rounded to ``residual_dtype`` (x's dtype when None), as float64."""
    h_dtype = x.dtype if residual_dtype is None else np.dtype(residual_dtype)
    h = np.asarray(x, np.float64) + np.asarray(residual, np.float64)
    return h.astype(h_dtype).astype(np.float64)


def _default_ndim(gamma, beta, norm_ndim):
    if norm_ndim is not None:
        return norm_ndim
    for p in (gamma, beta):
        if p is not None:
            return p.ndim
    return 1


def layer_norm_fwd(x, gamma=None, beta=None, eps=1e-5, norm_ndim=None, *, residual=None,
                   residual_dtype=None, weight_offset=0.0):
    """Return ``(y, mean, rstd)`` in float64, and ``h`` after them when ``residual`` is given;
    mean/rstd have the leading shape of ``x``."""
    if residual is not None:
        h = residual_add(x, residual, residual_dtype)
        return (*layer_norm_fwd(h, gamma, beta, eps, norm_ndim, weight_offset=weight_offset), h)
    k = _default_ndim(gamma, beta, norm_ndim)
    lead = x.shape[: x.ndim - k]
    x2 = _rows(x, k)
    mean = x2.mean(axis=1)
    xc = x2 - mean[:, None]
    var = (xc * xc).mean(axis=1)  # biased, two-pass: never E[x^2] - E[x]^2
    rstd = 1.0 / np.sqrt(var + eps)
    y = xc * rstd[:, None]
    g, b = _param(gamma, weight_offset), _param(beta)
    if g is not None:
        y = y * g
    if b is not None:
        y = y + b
    return y.reshape(x.shape), mean.reshape(lead), rstd.reshape(lead)


def rms_norm_fwd(x, gamma=None, eps=1e-6, norm_ndim=None, *, residual=None,
                 residual_dtype=None, weight_offset=0.0):
    """Return ``(y, rstd)`` in float64, and ``h`` after them when ``residual`` is given."""
    if residual is not None:
        h = residual_add(x, residual, residual_dtype)
        return (*rms_norm_fwd(h, gamma, eps, norm_ndim, weight_offset=weight_offset), h)
    k = _default_ndim(gamma, None, norm_ndim)
    lead = x.shape[: x.ndim - k]
    x2 = _rows(x, k)
    rstd = 1.0 / np.sqrt((x2 * x2).mean(axis=1) + eps)
    y = x2 * rstd[:, None]
    g = _param(gamma, weight_offset)
    if g is not None:
        y = y * g
    return y.reshape(x.shape), rstd.reshape(lead)


def _norm_bwd(dy, x, gamma, mean, rstd, dresidual=None, weight_offset=0.0):
    """Shared backward: ``mean=None`` means RMSNorm (no centering, no mean(g) term). ``x`` is
    the forward's h where it had a residual; ``dresidual`` is added to dx."""
    k = x.ndim - rstd.ndim
    norm_shape = x.shape[x.ndim - k :]
    x2, dy2 = _rows(x, k), _rows(dy, k)
    r = np.asarray(rstd, dtype=np.float64).reshape(-1, 1)
    xc = x2 if mean is None else x2 - np.asarray(mean, dtype=np.float64).reshape(-1, 1)
    xhat = xc * r
    gm = _param(gamma, weight_offset)
    g = dy2 if gm is None else dy2 * gm
    inner = g - xhat * (g * xhat).mean(axis=1, keepdims=True)
    if mean is not None:
        inner = inner - g.mean(axis=1, keepdims=True)
    dx = r * inner
    if dresidual is not None:
        dx = dx + _rows(dresidual, k)
    dgamma = (dy2 * xhat).sum(axis=0).reshape(norm_shape)
    dbeta = dy2.sum(axis=0).reshape(norm_shape)
    return dx.reshape(x.shape), dgamma, dbeta


def layer_norm_bwd(dy, x, gamma, mean, rstd, *, dresidual=None, weight_offset=0.0):
    """Return ``(dx, dgamma, dbeta)`` in float64 (dgamma even when gamma is None)."""
    return _norm_bwd(dy, x, gamma, mean, rstd, dresidual, weight_offset)


def rms_norm_bwd(dy, x, gamma, rstd, *, dresidual=None, weight_offset=0.0):
    """Return ``(dx, dgamma)`` in float64."""
    dx, dgamma, _ = _norm_bwd(dy, x, gamma, None, rstd, dresidual, weight_offset)
    return dx, dgamma


def quantize(y, y_dtype, y_scale=None):
    """Rows of ``y`` (2-D, any float dtype) quantized to float8 ``y_dtype`` as the kernels do:
    y rounded to float32 first (the kernels' y), divided by a dequantization scale (correctly
    rounded float32 division), saturated to the format's largest finite value (NaN stays NaN),
    rounded to nearest even. ``y_scale`` None: each row's scale is its largest |y| over fmax
    (NaN ignored; 1 where that is 0); returns ``(y_q, scale)``, scale of shape (M,).
    ``y_scale`` (a float32 value): one scale for all, NaN output where it is not finite or not
    above 0; returns ``(y_q, amax)``, the largest non-NaN |y| of all rows (float32)."""
    y_dtype = np.dtype(y_dtype)
    fmax = np.float32(FLOAT8[y_dtype])
    y32 = np.asarray(y, np.float32)
    amax = np.fmax.reduce(np.abs(y32), axis=1, initial=np.float32(0))
    with np.errstate(divide="ignore", invalid="ignore", over="ignore"):
        if y_scale is None:
            scale = np.where(amax == 0, np.float32(1), amax / fmax).astype(np.float32)
            q = y32 / scale[:, None]
        else:
            s = np.float32(y_scale)
            q = y32 / s if np.isfinite(s) and s > 0 else np.full_like(y32, np.nan)
            scale = np.fmax.reduce(amax, initial=np.float32(0))
        return np.clip(q, -fmax, fmax).astype(y_dtype), scale
