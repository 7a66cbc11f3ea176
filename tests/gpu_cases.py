"""Shared by the GPU tests: inputs, the reference comparison, and the record of plans."""

import ml_dtypes
import numpy as np
import pytest

import cupyln
from cupyln import reference as ref
from cupyln._config import config_of
from cupyln.check import TOL, dweight_floors, dx_floor, max_err

cp = pytest.importorskip("cupy")

F16, BF16, F32, F64 = (np.dtype(t) for t in (np.float16, ml_dtypes.bfloat16, np.float32,
                                            np.float64))
PAIRS = [(F16, F16), (F16, F32), (BF16, BF16), (BF16, F32), (F32, F32), (F64, F64)]
# the backward's peeled kernels on rows however few (the planner's rules for them: CPU-tested)
PEEL_FEW = {"bwd_peel_rows": 0, "bwd_peel_tile_rows": 0}


def host(shape, dtype, seed, scale=1.0, offset=0.0):
    rng = np.random.default_rng(seed)
    return (offset + scale * rng.standard_normal(shape)).astype(dtype)


def assert_close(out, want, name, floor=0.0):
    err = max_err(out, want, floor)
    tol = TOL[np.dtype(out.dtype)]
    assert err <= tol, f"{name}: max error {err:.3g} > {tol:g}"


def padded(a, extra):
    """``a`` (2-D) as the first columns of rows ``extra`` elements longer."""
    big = cp.zeros((a.shape[0], a.shape[1] + extra), a.dtype)
    big[:, : a.shape[1]] = a
    return big[:, : a.shape[1]]


def check_case(op, x_h, dy_h, g_h, b_h, *, layout=lambda a: a, k=None, deterministic=False,
               need=(True, True, True), config=None):
    """Run fwd + bwd on the GPU (planned by ``config``) with inputs made by `layout` from host
    arrays; compare every output (including None-ness) with the reference."""
    x, dy = layout(cp.asarray(x_h)), layout(cp.asarray(dy_h))
    g = None if g_h is None else cp.asarray(g_h)
    b = None if b_h is None else cp.asarray(b_h)
    kw = {} if k is None or g is not None or b is not None else {"normalized_shape": x.shape[-k:]}
    kw["config"] = config
    if op == "ln":
        y, mean, rstd = cupyln.layer_norm_fwd(x, g, b, eps=1e-5, **kw)
        ry, rm, rr = ref.layer_norm_fwd(x_h, g_h, b_h, 1e-5, k)
        assert_close(mean, rm, "mean")
        dx, dg, db = cupyln.layer_norm_bwd(dy, x, g, mean, rstd, need_dx=need[0],
                                           need_dgamma=need[1], need_dbeta=need[2],
                                           deterministic=deterministic, config=config)
        rdx, rdg, rdb = ref.layer_norm_bwd(dy_h, x_h, g_h, mean.get(), rstd.get())
    else:
        y, rstd = cupyln.rms_norm_fwd(x, g, eps=1e-6, **kw)
        ry, rr = ref.rms_norm_fwd(x_h, g_h, 1e-6, k)
        dx, dg = cupyln.rms_norm_bwd(dy, x, g, rstd, need_dx=need[0], need_dgamma=need[1],
                                     deterministic=deterministic, config=config)
        db = None
        rdx, rdg = ref.rms_norm_bwd(dy_h, x_h, g_h, rstd.get())
    assert y.dtype == x.dtype and rstd.dtype == F32
    assert_close(y, ry, "y")
    assert_close(rstd, rr, "rstd")
    assert (dx is None) == (not need[0])
    assert (dg is None) == (not need[1] or g is None)
    if dx is not None:
        assert dx.dtype == x.dtype and dx.shape == x.shape
        assert_close(dx, rdx, "dx", dx_floor(dy_h, g_h, rstd))
    floors = dweight_floors(dy_h, x_h, mean if op == "ln" else None, rstd)
    if dg is not None:
        assert dg.dtype == g.dtype
        assert_close(dg, rdg, "dgamma", floors[0])
    if op == "ln":
        assert (db is None) == (not need[2])
        if db is not None:
            assert db.dtype == (x.dtype if g is None else g.dtype)
            assert_close(db, rdb, "dbeta", floors[1])
    return dg, db


def inputs(M, N, dtype, wdtype, has_g=True, has_b=True, seed=0):
    shape = (M, N)
    x = host(shape, dtype, seed, 0.5, -2.3)
    dy = host(shape, dtype, seed + 1, 0.1)
    g = host((N,), wdtype, seed + 2, 0.2, 1.0) if has_g else None
    b = host((N,), wdtype, seed + 3, 0.2) if has_b else None
    return x, dy, g, b


LAYOUTS = {
    "row slice of a wider buffer": lambda a: cp.pad(a, ((0, 0), (3, 5)))[:, 3:-5],
    "every other row": lambda a: cp.repeat(a, 2, axis=0)[::2],
    "reversed rows": lambda a: a[::-1].copy()[::-1],
    "reversed columns": lambda a: a[:, ::-1].copy()[:, ::-1],
    "transposed (copy path)": lambda a: cp.asfortranarray(a),
    "misaligned base": lambda a: cp.concatenate([cp.zeros(1, a.dtype), a.ravel()])[1:].reshape(
        a.shape),
}



class Plans(list):
    """The plans the calls make, once :meth:`spy` has started recording a pass's planner, and
    the config (:meth:`replan`) the calls are to pass."""

    def __init__(self, monkeypatch):
        super().__init__()
        self.monkeypatch = monkeypatch
        self.config = None

    def spy(self, pass_):
        """Record every plan that plan_fwd ("fwd") or plan_bwd ("bwd") returns."""
        from cupyln import _plan

        fn = getattr(_plan, f"plan_{pass_}")

        def record(*args):
            self.append(fn(*args))
            return self[-1]

        record.cache_clear = fn.cache_clear
        self.monkeypatch.setattr(_plan, f"plan_{pass_}", record)

    def replan(self, **fields):
        """Plan the next calls with ``config_of(**fields)``; clear the record, and forget the
        remembered calls, so that the next calls plan (and are recorded) again."""
        self.config = config_of(**fields)
        cupyln.clear_caches()
        self.clear()

    @property
    def rows(self):
        """The planner's rows (``.fwd``, ``.bwd``) under this config on the current device."""
        from cupyln import _facts, _tuning

        info = _facts.device_info(cp.cuda.Device().id)
        return _tuning.settings(self.config, _tuning.family(info.hip, info.warp, info.clusters))
