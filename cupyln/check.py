"""Check cupyln's numbers: the tolerances its tests hold it to, the comparison with the float64
reference, the gradients against finite differences of the forward, and the self-check that
``python -m cupyln check`` runs. Works on NumPy arrays or CuPy arrays.

    from cupyln import check
    err = check.max_err(y, want)          # max |y - want| / max |want|
    ok = err <= check.TOL[y.dtype]        # the tolerance of y's dtype
    rows = check.gradient_check(np)       # (op, output, err, tol) per gradient
"""

from __future__ import annotations

import numpy as np

from . import api
from . import reference as ref
from ._dtypes import BFLOAT16, FLOAT16, FLOAT32, FLOAT64

#: Largest |out - ref| allowed, relative to max |ref| of that output, by the output's dtype.
#: 16-bit outputs are dominated by their own rounding (2^-11, 2^-8); float32 by accumulation.
TOL = {FLOAT16: 4e-3, BFLOAT16: 3e-2, FLOAT32: 1e-4, FLOAT64: 1e-9}


def to_numpy(a):
    return a.get() if hasattr(a, "get") else np.asarray(a)


def max_err(out, want, floor=0.0):
    """max |out - want| / max(max |want|, floor) (NaN-aware: a NaN where want is finite is an
    infinite error); 0 for empty arrays. ``floor`` is the size of the terms the output is
    computed from, where it can cancel to far below them (see :func:`dx_floor`)."""
    o = to_numpy(out).astype(np.float64)
    w = np.asarray(want, dtype=np.float64)
    if o.shape != w.shape:
        raise AssertionError(f"shape {o.shape} != reference shape {w.shape}")
    if w.size == 0:
        return 0.0
    if not np.array_equal(np.isnan(o), np.isnan(w)):
        return float("inf")
    fin = np.isfinite(w)
    if not np.array_equal(o[~fin & ~np.isnan(w)], w[~fin & ~np.isnan(w)]):
        return float("inf")
    scale = max(np.abs(w[fin]).max(initial=0.0), floor)
    diff = np.abs(o[fin] - w[fin]).max(initial=0.0)
    return float(diff / scale) if scale > 0 else float(diff)


def dx_floor(dy, gamma, rstd):
    """Largest term of dx = rstd * (g - ...): dx can cancel far below it (RMSNorm with N = 1
    gives rstd * g * eps / (x^2 + eps)), and float32 then leaves an error relative to it."""
    dy = to_numpy(dy).astype(np.float64)
    r = to_numpy(rstd).astype(np.float64).reshape(-1, 1)
    if r.size == 0:
        return 0.0
    g = dy.reshape(r.shape[0], -1)
    if gamma is not None:
        g = g * to_numpy(gamma).astype(np.float64).reshape(-1)
    return float((np.abs(g) * r).max(initial=0.0))


def dweight_floors(dy, x, mean, rstd):
    """Sizes of dgamma = sum dy * xhat and dbeta = sum dy over the rows: the root-sum-square of
    the terms, largest column. Few rows of random sign cancel far below it (177 rows of one
    column summed to 3e-4 from terms of 0.1), and float32 then leaves an error relative to it."""
    r = to_numpy(rstd).astype(np.float64).reshape(-1, 1)
    if r.size == 0:
        return 0.0, 0.0
    xhat = to_numpy(x).astype(np.float64).reshape(r.shape[0], -1)
    if mean is not None:
        xhat = xhat - to_numpy(mean).astype(np.float64).reshape(-1, 1)
    dy = to_numpy(dy).astype(np.float64).reshape(xhat.shape)
    return tuple(float(np.sqrt((t * t).sum(axis=0)).max(initial=0.0)) for t in (dy * xhat * r, dy))


def problem(xp, M, N, dtype, wdtype=None, seed=0):
    """Inputs as in Triton's tutorial: x = -2.3 + 0.5 randn, dy = 0.1 randn, gamma/beta random."""
    rng = np.random.default_rng(seed)
    dtype = np.dtype(dtype)
    wdtype = dtype if wdtype is None else np.dtype(wdtype)
    x = (-2.3 + 0.5 * rng.standard_normal((M, N))).astype(dtype)
    dy = (0.1 * rng.standard_normal((M, N))).astype(dtype)
    gamma = (1.0 + 0.2 * rng.standard_normal(N)).astype(wdtype)
    beta = (0.2 * rng.standard_normal(N)).astype(wdtype)
    return tuple(xp.asarray(a) for a in (x, dy, gamma, beta))


def check(xp, op, M, N, dtype, wdtype=None, seed=0, deterministic=False, config=None,
          fused=False):
    """Run forward and backward of ``op`` ('layernorm'/'rmsnorm') through cupyln on ``xp``
    arrays and return rows ``(output, max_err, tol)`` against the reference. ``fused``: with a
    residual (and h), dresidual and a weight offset of 0.5."""
    x, dy, gamma, beta = problem(xp, M, N, dtype, wdtype, seed)
    h = [to_numpy(a) for a in (x, dy, gamma, beta)]
    fkw, rkw, bkw, rbkw = {}, {}, {}, {}
    if fused:
        res, dres = problem(xp, M, N, dtype, wdtype, seed + 1)[:2]
        fkw = {"residual": res, "weight_offset": 0.5}
        rkw = {"residual": to_numpy(res), "weight_offset": 0.5}
        bkw, rbkw = {"dresidual": dres, "weight_offset": 0.5}, {"weight_offset": 0.5}
        rbkw["dresidual"] = to_numpy(dres)
    is_ln = op == "layernorm"
    fwd, rfwd = (api.layer_norm_fwd, ref.layer_norm_fwd) if is_ln else (api.rms_norm_fwd,
                                                                         ref.rms_norm_fwd)
    params, rparams = ((gamma, beta), (h[2], h[3])) if is_ln else ((gamma,), (h[2],))
    outs = fwd(x, *params, config=config, **fkw)
    routs = rfwd(h[0], *rparams, **rkw)
    names = (["y", "mean", "rstd"] if is_ln else ["y", "rstd"]) + (["h"] if fused else [])
    xin = outs[-1] if fused else x  # the backward reads h where the forward had a residual
    stats = outs[1:len(outs) - fused]
    if is_ln:
        grads = api.layer_norm_bwd(dy, xin, gamma, *stats, deterministic=deterministic,
                                   config=config, **bkw)
        rgrads = ref.layer_norm_bwd(h[1], to_numpy(xin), h[2], *map(to_numpy, stats), **rbkw)
    else:
        grads = api.rms_norm_bwd(dy, xin, gamma, *stats, deterministic=deterministic,
                                 config=config, **bkw)
        rgrads = ref.rms_norm_bwd(h[1], to_numpy(xin), h[2], *map(to_numpy, stats), **rbkw)
    rows = list(zip(names, outs, routs, strict=True))
    rows += list(zip(("dx", "dgamma", "dbeta"), grads, rgrads, strict=False))
    g_eff = h[2].astype(np.float64) + (0.5 if fused else 0.0)
    floor = {"dx": dx_floor(h[1], g_eff, stats[-1]) + (np.abs(rbkw["dresidual"]).max(initial=0.0)
                                                     if fused else 0.0)}
    floor["dgamma"], floor["dbeta"] = dweight_floors(h[1], to_numpy(xin),
                                                     to_numpy(stats[0]) if is_ln else None,
                                                     to_numpy(stats[-1]))
    return [(name, max_err(out, want, floor.get(name, 0.0)), TOL[np.dtype(out.dtype)])
            for name, out, want in rows]


#: Largest gradient error allowed against central differences (float64, relative to the sum of
#: the terms of the directional derivative): the step's truncation and rounding are far below.
GRAD_TOL = 1e-7
GRADIENT_PROBLEMS = [("layernorm", False), ("rmsnorm", False), ("layernorm", True),
                     ("rmsnorm", True)]


def gradient_check(xp, op, fused, M=5, N=48, seed=0, step=1e-5):
    """Rows ``(output, err, GRAD_TOL)``: each gradient of the backward against central
    differences of the forward's loss ``L = <dy, y>`` (plus ``<dresidual, h>`` with the fused
    add, whose weight offset is 0.5) along a random direction, all in float64 on ``xp``."""
    rng = np.random.default_rng(seed)
    is_ln = op == "layernorm"
    at = {"x": rng.standard_normal((M, N)), "gamma": 1 + 0.2 * rng.standard_normal(N)}
    if is_ln:
        at["beta"] = 0.2 * rng.standard_normal(N)
    if fused:
        at["residual"] = rng.standard_normal((M, N))
    dy = rng.standard_normal((M, N))
    dres = rng.standard_normal((M, N)) if fused else None
    woff = 0.5 if fused else 0.0
    fwd, bwd = (api.layer_norm_fwd, api.layer_norm_bwd) if is_ln else (api.rms_norm_fwd,
                                                                         api.rms_norm_bwd)

    def forward(v):
        a = {k: xp.asarray(t) for k, t in v.items()}
        params = (a["gamma"], a["beta"]) if is_ln else (a["gamma"],)
        return fwd(a["x"], *params, residual=a.get("residual"), weight_offset=woff)

    def loss(v):
        outs = forward(v)
        return float((dy * to_numpy(outs[0])).sum()
                     + ((dres * to_numpy(outs[-1])).sum() if fused else 0.0))

    outs = forward(at)
    stats = outs[1:len(outs) - fused]
    xin = outs[-1] if fused else xp.asarray(at["x"])
    grads = bwd(xp.asarray(dy), xin, xp.asarray(at["gamma"]), *stats, weight_offset=woff,
                dresidual=None if dres is None else xp.asarray(dres))
    named = dict(zip(("dx", "dgamma", "dbeta"), map(to_numpy, grads), strict=False))
    rows = []
    for name, grad in (("x", "dx"), ("residual", "dx"), ("gamma", "dgamma"), ("beta", "dbeta")):
        if name not in at:
            continue
        v = rng.standard_normal(at[name].shape)
        up, down = dict(at), dict(at)
        up[name], down[name] = at[name] + step * v, at[name] - step * v
        fd = (loss(up) - loss(down)) / (2 * step)
        terms = named[grad] * v
        rows.append((f"d{name}", abs(fd - terms.sum()) / np.abs(terms).sum(), GRAD_TOL))
    return rows


SELF_CHECK_PROBLEMS = [
    ("layernorm", 37, 1000, FLOAT16, FLOAT32),
    ("layernorm", 64, 4096, BFLOAT16, None),
    ("layernorm", 129, 257, FLOAT32, None),
    ("layernorm", 5, 40000, FLOAT16, None),
    ("rmsnorm", 37, 1000, BFLOAT16, FLOAT32),
    ("rmsnorm", 64, 768, FLOAT16, None),
    ("rmsnorm", 3, 8117, FLOAT64, None),
]


def self_check(xp, problems=SELF_CHECK_PROBLEMS):
    """Rows (op, M, N, dtype, output, err, tol, ok) for each problem and output. On NumPy arrays
    float64 problems are left out: the NumPy path is the float64 reference itself there."""
    table = []
    for op, M, N, dt, wdt in problems:
        if xp is np and np.dtype(dt) == FLOAT64:
            continue
        for name, err, tol in check(xp, op, M, N, dt, wdt):
            table.append((op, M, N, np.dtype(dt).name, name, err, tol, err <= tol))
    return table


def gradient_table(xp, problems=GRADIENT_PROBLEMS):
    """Rows (op, M, N, dtype, output, err, tol, ok) of :func:`gradient_check` for each problem
    (op, fused add), in self_check's form."""
    table = []
    for op, fused in problems:
        for name, err, tol in gradient_check(xp, op, fused):
            table.append((op + "+add" * fused, 5, 48, "float64", name, err, tol, err <= tol))
    return table


def format_table(table):
    lines = [f"{'op':<14}{'M':>6}{'N':>7}  {'dtype':<9}{'output':<10}{'max err':>10}{'tol':>9}  ok"]
    for op, M, N, dt, name, err, tol, ok in table:
        lines.append(f"{op:<14}{M:>6}{N:>7}  {dt:<9}{name:<10}{err:>10.2e}{tol:>9.0e}  "
                     f"{'yes' if ok else 'NO'}")
    return "\n".join(lines)
