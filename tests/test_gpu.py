"""GPU path against the float64 reference. Marked `gpu`: skipped where no GPU is present."""

import ml_dtypes
import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st
from strategies import BOUNDARY_N

import cupyln
from cupyln import reference as ref
from cupyln._check import TOL, dx_floor, max_err

cp = pytest.importorskip("cupy")
pytestmark = pytest.mark.gpu

F16, BF16, F32, F64 = (np.dtype(t) for t in (np.float16, ml_dtypes.bfloat16, np.float32,
                                            np.float64))
PAIRS = [(F16, F16), (F16, F32), (BF16, BF16), (BF16, F32), (F32, F32), (F64, F64)]


def host(shape, dtype, seed, scale=1.0, offset=0.0):
    rng = np.random.default_rng(seed)
    return (offset + scale * rng.standard_normal(shape)).astype(dtype)


def assert_close(out, want, name, floor=0.0):
    err = max_err(out, want, floor)
    tol = TOL[np.dtype(out.dtype)]
    assert err <= tol, f"{name}: max error {err:.3g} > {tol:g}"


def check_case(op, x_h, dy_h, g_h, b_h, *, layout=lambda a: a, k=None, deterministic=False,
               need=(True, True, True)):
    """Run fwd + bwd on the GPU with inputs made by `layout` from host arrays; compare every
    output (including None-ness) with the reference."""
    x, dy = layout(cp.asarray(x_h)), layout(cp.asarray(dy_h))
    g = None if g_h is None else cp.asarray(g_h)
    b = None if b_h is None else cp.asarray(b_h)
    kw = {} if k is None or g is not None or b is not None else {"normalized_shape": x.shape[-k:]}
    if op == "ln":
        y, mean, rstd = cupyln.layer_norm_fwd(x, g, b, eps=1e-5, **kw)
        ry, rm, rr = ref.layer_norm_fwd(x_h, g_h, b_h, 1e-5, k)
        assert_close(mean, rm, "mean")
        dx, dg, db = cupyln.layer_norm_bwd(dy, x, g, mean, rstd, need_dx=need[0],
                                           need_dgamma=need[1], need_dbeta=need[2],
                                           deterministic=deterministic)
        rdx, rdg, rdb = ref.layer_norm_bwd(dy_h, x_h, g_h, mean.get(), rstd.get())
    else:
        y, rstd = cupyln.rms_norm_fwd(x, g, eps=1e-6, **kw)
        ry, rr = ref.rms_norm_fwd(x_h, g_h, 1e-6, k)
        dx, dg = cupyln.rms_norm_bwd(dy, x, g, rstd, need_dx=need[0], need_dgamma=need[1],
                                     deterministic=deterministic)
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
    if dg is not None:
        assert dg.dtype == g.dtype
        assert_close(dg, rdg, "dgamma")
    if op == "ln":
        assert (db is None) == (not need[2])
        if db is not None:
            assert db.dtype == (x.dtype if g is None else g.dtype)
            assert_close(db, rdb, "dbeta")
    return dg, db


def inputs(M, N, dtype, wdtype, has_g=True, has_b=True, seed=0):
    shape = (M, N)
    x = host(shape, dtype, seed, 0.5, -2.3)
    dy = host(shape, dtype, seed + 1, 0.1)
    g = host((N,), wdtype, seed + 2, 0.2, 1.0) if has_g else None
    b = host((N,), wdtype, seed + 3, 0.2) if has_b else None
    return x, dy, g, b


# --------------------------------------------------------------------------- sizes and dtypes

SIZES = [(m, n) for n in BOUNDARY_N for m in (0, 1, 37, 199)]
SIZES += [(1025, n) for n in (1, 33, 760, 2001)] + [(65537, n) for n in (1, 32, 129, 760)]
SIZES += [(7, n) for n in (4096, 8192, 16384, 32768, 40000, 65536)]
SIZES += [(20000, 1), (9001, 3), (30001, 16)]  # short rows spread over blocks of whole warps


@pytest.mark.parametrize("op", ["ln", "rms"])
@pytest.mark.parametrize("M,N", SIZES)
def test_sizes(op, M, N):
    dt, wdt = PAIRS[(M + N) % len(PAIRS)]  # spread dtype pairs over the sizes
    check_case(op, *inputs(M, N, dt, wdt))


@pytest.mark.parametrize("op", ["ln", "rms"])
@pytest.mark.parametrize("dt,wdt", PAIRS)
@pytest.mark.parametrize("has_g,has_b", [(True, True), (True, False), (False, True),
                                         (False, False)])
@pytest.mark.parametrize("N", [64, 1000, 4096, 12288])
def test_dtypes_and_parameters(op, dt, wdt, has_g, has_b, N):
    check_case(op, *inputs(67, N, dt, wdt, has_g, has_b and op == "ln"))


@pytest.mark.parametrize("need", [(True, False, False), (False, True, False),
                                  (False, False, True), (False, True, True),
                                  (False, False, False)])
@pytest.mark.parametrize("N", [33, 2048, 20000])
def test_need_flags(need, N):
    check_case("ln", *inputs(45, N, F16, F32), need=need)
    check_case("rms", *inputs(45, N, BF16, BF16), need=need)


def test_float64_with_float32_parameters():
    check_case("ln", *inputs(19, 300, F64, F32))


# --------------------------------------------------------------------------- layouts


def test_leading_dims_and_multi_dim_gamma():
    x = host((3, 5, 4, 6), F16, 0, 0.5, -2.3)
    dy = host((3, 5, 4, 6), F16, 1, 0.1)
    g = host((4, 6), F32, 2, 0.2, 1.0)
    b = host((4, 6), F32, 3, 0.2)
    check_case("ln", x, dy, g, b, k=2)
    check_case("rms", x, dy, g, None, k=2)
    check_case("ln", x, dy, None, None, k=2)  # normalized_shape=(4, 6)


LAYOUTS = {
    "row slice of a wider buffer": lambda a: cp.pad(a, ((0, 0), (3, 5)))[:, 3:-5],
    "every other row": lambda a: cp.repeat(a, 2, axis=0)[::2],
    "reversed rows": lambda a: a[::-1].copy()[::-1],
    "reversed columns": lambda a: a[:, ::-1].copy()[:, ::-1],
    "transposed (copy path)": lambda a: cp.asfortranarray(a),
    "misaligned base": lambda a: cp.concatenate([cp.zeros(1, a.dtype), a.ravel()])[1:].reshape(
        a.shape),
}


@pytest.mark.parametrize("layout", LAYOUTS, ids=list(LAYOUTS))
@pytest.mark.parametrize("N", [8, 760, 4096, 20000])
def test_layouts(layout, N):
    f = LAYOUTS[layout]
    check_case("ln", *inputs(33, N, F16, F16), layout=f)
    check_case("rms", *inputs(33, N, F32, F32), layout=f)


def test_non_blocking_stream():
    s = cp.cuda.Stream(non_blocking=True)
    with s:
        check_case("ln", *inputs(513, 2048, BF16, F32))
        check_case("rms", *inputs(513, 20000, F16, F16))
    s.synchronize()


def test_outputs_fully_written_over_garbage():
    """Fill the memory pool with NaN bytes first: every output element must be overwritten."""
    pool = cp.get_default_memory_pool()
    for N in (31, 1024, 20000):
        junk = cp.full(64 << 20, 0xFF, dtype=cp.uint8)  # NaN in every float format
        del junk
        for op in ("ln", "rms"):
            check_case(op, *inputs(77, N, F16, F32), deterministic=N == 1024)
        pool.free_all_blocks()


def test_nan_and_inf_stay_in_their_rows():
    x, dy, g, b = inputs(64, 1000, F32, F32)
    x[5, 17] = np.nan
    x[9, 3] = np.inf
    xs, dys = cp.asarray(x), cp.asarray(dy)
    gs, bs = cp.asarray(g), cp.asarray(b)
    y, mean, rstd = cupyln.layer_norm_fwd(xs, gs, bs)
    dx, dg, db = cupyln.layer_norm_bwd(dys, xs, gs, mean, rstd)
    bad = np.zeros(64, bool)
    bad[[5, 9]] = True
    assert np.isnan(y.get()[bad]).all(axis=1).all()
    assert np.isfinite(y.get()[~bad]).all() and np.isfinite(dx.get()[~bad]).all()
    ry, _, _ = ref.layer_norm_fwd(x[~bad], g, b)
    assert_close(y[cp.asarray(~bad)], ry, "y")
    assert np.isfinite(db.get()).all()  # dy is finite: dbeta never sees x
    assert_close(db, dy.astype(np.float64).sum(0), "dbeta")
    assert np.isnan(dg.get()).all()  # every column touches the NaN rows' xhat


# --------------------------------------------------------------------------- atomic flush


@pytest.fixture
def atomic_flush(monkeypatch):
    """The backward's alternative dgamma/dbeta flush (float32 atomicAdd, last block casts)."""
    from cupyln import _launch

    monkeypatch.setattr(_launch, "ATOMIC_FLUSH", True)
    _launch.clear_caches()  # calls remembered with the partials flush must not be reused
    yield
    _launch.clear_caches()


@pytest.mark.parametrize("op", ["ln", "rms"])
@pytest.mark.parametrize("M,N", [(0, 64), (1, 1), (37, 33), (1025, 760), (199, 4096),
                                 (9, 20000), (65537, 129)])
def test_atomic_flush(atomic_flush, op, M, N):
    dt, wdt = PAIRS[(M + N) % len(PAIRS)]
    check_case(op, *inputs(M, N, dt, wdt))
    check_case(op, *inputs(M, N, dt, wdt), need=(False, True, False))


# --------------------------------------------------------------------------- plans


class Plans(list):
    """The plans the calls make, once :meth:`spy` has started recording a pass's planner."""

    def __init__(self, monkeypatch):
        super().__init__()
        self.monkeypatch = monkeypatch

    def spy(self, pass_):
        """Record every plan that plan_fwd ("fwd") or plan_bwd ("bwd") returns."""
        from cupyln import _launch

        fn = getattr(_launch, f"plan_{pass_}")

        def record(*args):
            self.append(fn(*args))
            return self[-1]

        record.cache_clear = fn.cache_clear
        self.monkeypatch.setattr(_launch, f"plan_{pass_}", record)

    def replan(self, **constants):
        """Set planner constants, forget every plan and remembered call, clear the record."""
        from cupyln import _launch

        for name, value in constants.items():
            self.monkeypatch.setattr(_launch, name, value)
        _launch.clear_caches()
        self.clear()


@pytest.fixture
def plans(monkeypatch):
    """A :class:`Plans` record; no plan made under patched constants outlives the test."""
    from cupyln import _launch

    yield Plans(monkeypatch)
    _launch.clear_caches()


# --------------------------------------------------------------------------- staged rows


@pytest.mark.parametrize("pass_", ["fwd", "bwd"])
@pytest.mark.parametrize("op", ["ln", "rms"])
@pytest.mark.parametrize("M,N", [(37, 33), (1025, 760), (199, 4096), (3001, 4096), (700, 8192),
                                 (9, 20000), (700, 20000), (65537, 129), (5000, 1000)])
def test_staged_and_direct_rows_agree(plans, pass_, op, M, N):
    """Staged rows (cp.async into shared memory) against direct loads, forward and backward, on
    shapes either path can take: each matches the reference, and the two agree bitwise (the same
    arithmetic in the same order; the backward's dgamma/dbeta where both kernels get the same
    grid, which sets the order of the partial sums, and the staged rows are not dynamic)."""
    from cupyln import _launch

    dt, wdt = PAIRS[(M + N) % len(PAIRS)]
    case = inputs(M, N, dt, wdt)
    plans.spy(pass_)
    out, grids, dynamic = {}, {}, False
    for mode in ("always", "never"):
        plans.replan(**{f"{pass_.upper()}_STAGE": mode})
        x, dy, g = (cp.asarray(a) for a in case[:3])
        if op == "ln":
            fwd = cupyln.layer_norm_fwd(x, g, None)
            out[mode] = fwd if pass_ == "fwd" else cupyln.layer_norm_bwd(dy, x, g, *fwd[1:])
        else:
            fwd = cupyln.rms_norm_fwd(x, g)
            out[mode] = fwd if pass_ == "fwd" else cupyln.rms_norm_bwd(dy, x, g, fwd[1])
        (plan,) = plans
        grids[mode] = plan.grid
        dynamic |= pass_ == "bwd" and plan.dynamic
        staged = plan.variant.endswith("_staged")
        once = plan.variant == "fwd_chunked" or plan.spec.row  # rows never staged
        can = _launch.device_info(x.device.id).async_copy and plan.spec.vec * dt.itemsize >= 4
        assert staged == (can and not once and mode == "always"), (mode, plan.grid)
        assert (plan.smem > 0) >= staged
        check_case(op, *case)
    same_order = pass_ == "fwd" or (grids["always"] == grids["never"] and not dynamic)
    for i, (a, b) in enumerate(zip(out["always"], out["never"], strict=True)):
        assert cp.array_equal(a, b) or (i > 0 and not same_order), i


@pytest.mark.parametrize("op", ["ln", "rms"])
@pytest.mark.parametrize("M,N,dt,wdt,meant", [
    (6000, 1024, F16, F32, "bwd_staged"), (20001, 1000, BF16, BF16, "bwd_staged"),
    (3001, 4096, F32, F32, "bwd_staged"), (1000, 1024, F16, F16, None),
    (1500, 8192, BF16, F32, "bwd_staged"), (5000, 96, F32, F32, None),
    (600, 16384, F16, F32, None)])
def test_dynamic_rows_of_the_staged_backward(plans, op, M, N, dt, wdt, meant):
    """Staged backward rows taken from a ticket counter (deterministic=False; BWD_DYNAMIC)
    against static rows (BWD_DYNAMIC off, or deterministic=True): the plan is dynamic exactly
    where staged blocks of one column tile span warps; every one of several calls matches the
    reference (the counter must come back to zero after each launch, or the next would drop or
    repeat rows), with dgamma/dbeta or without them (dx alone: the tickets are the only
    scratch); dx is bitwise the static rows' (rows are independent; the reference checks it
    once, the rest is compared on the device), and deterministic calls are bitwise repeatable
    either way, and the same either way where both plans have the same grid. `meant`: the
    variant the case is meant to take with tickets, where the device has it; 1000x1024 takes
    too few rows for tickets (static groups only), 5000x96 has rows within a warp, 600x16384
    column tiles (in clusters on sm_90): static rows."""
    from cupyln import _launch

    xh, dyh, gh, _ = inputs(M, N, dt, wdt)
    x, dy, g = (cp.asarray(a) for a in (xh, dyh, gh))
    warp = _launch.device_info(x.device.id).warp
    if op == "ln":
        _, mean, rstd = cupyln.layer_norm_fwd(x, g)
        want = ref.layer_norm_bwd(dyh, xh, gh, mean.get(), rstd.get())
    else:
        mean, (_, rstd) = None, cupyln.rms_norm_fwd(x, g)
        want = ref.rms_norm_bwd(dyh, xh, gh, rstd.get())
    floor = dx_floor(dyh, gh, rstd)

    def bwd(deterministic, params=True):
        kw = {"deterministic": deterministic, "need_dgamma": params}
        if op == "ln":
            return cupyln.layer_norm_bwd(dy, x, g, mean, rstd, need_dbeta=params, **kw)
        return cupyln.rms_norm_bwd(dy, x, g, rstd, **kw)

    def check(outs, params=True, dx=True):
        if dx:
            assert_close(outs[0], want[0], "dx", floor)
        for out, w, name in zip(outs[1:], want[1:], ("dgamma", "dbeta")[:len(want) - 1],
                                strict=True):
            if params:
                assert_close(out, w, name)
            else:
                assert out is None, name

    plans.spy("bwd")
    dxs, det, grids = {}, {}, {}
    for on in (True, False):
        plans.replan(BWD_DYNAMIC=on)
        dxs[on] = []
        for i, params in enumerate((True, True, False, True)):
            outs = bwd(False, params)
            check(outs, params, dx=i == 0 and not on)
            dxs[on].append(outs[0])
        plan = plans[0]
        staged_wide = (plan.variant == "bwd_staged" and plan.block[0] > warp
                       and plan.grid[1] == 1)
        assert plan.dynamic == (on and staged_wide), (plan.variant, plan.block, plan.grid)
        if meant and _launch.device_info(x.device.id).async_copy:
            assert plan.variant == meant and staged_wide, (plan.variant, plan.block)
        det[on] = [bwd(True) for _ in range(2)]
        grids[on] = plan.grid
        check(det[on][0], dx=False)
    for a in dxs[True] + dxs[False][1:]:
        assert cp.array_equal(a, dxs[False][0])
    # The grid sets the order of the partial sums: a plan with tickets runs on the grid that both
    # kernels fit (fewer blocks where the dynamic one takes more registers), so deterministic
    # calls agree across the two settings only on the same grid.
    for on in (True, False):
        for outs in det[on][1:] + (det[not on] if grids[True] == grids[False] else []):
            for a, b in zip(outs, det[on][0], strict=True):
                assert cp.array_equal(a, b)


@pytest.mark.parametrize("op", ["ln", "rms"])
@pytest.mark.parametrize("M,N,dt,wdt", [(4096, 1024, F32, F32), (300, 1000, F32, F32),
                                        (77, 4100, F64, F64), (500, 2048, F64, F32),
                                        (5000, 1024, F16, F32), (60000, 1024, F32, F32)])
@pytest.mark.parametrize("has_b", [True, False])
def test_parameters_loaded_with_the_row_or_after(plans, op, M, N, dt, wdt, has_b):
    """The forward that loads gamma/beta with the row (4-byte and wider types, several vectors
    per thread) against the one that loads them after the reductions: the planner takes the
    first exactly where it is built and FWD_EARLY is on; each matches the reference, and the two
    agree bitwise (the same arithmetic in the same order)."""
    x_h, dy_h, g_h, b_h = inputs(M, N, dt, wdt, has_b=has_b)
    x, g = cp.asarray(x_h), cp.asarray(g_h)
    b = None if b_h is None else cp.asarray(b_h)
    plans.spy("fwd")
    out, variants = {}, {}
    for early in (False, True):
        plans.replan(FWD_EARLY=early, FWD_FULL=False, FWD_ROW_WARPS=0)
        out[early] = (cupyln.layer_norm_fwd(x, g, b) if op == "ln"
                      else cupyln.rms_norm_fwd(x, g))
        (plan,) = plans
        variants[early] = plan.variant
        check_case(op, x_h, dy_h, g_h, b_h)
    built = "fwd_early" in plan.spec.names("fwd")  # the module's rule (checked in test_planner)
    assert variants == {False: "fwd", True: "fwd_early" if built else "fwd"}
    for a, c in zip(out[False], out[True], strict=True):
        assert cp.array_equal(a, c)


@pytest.mark.parametrize("M,N,dt,wdt,has_b", [
    (4096, 1024, F16, F16, True), (32, 512, F16, F16, True),  # one vector per thread
    (7, 768, F32, F32, False), (300, 4096, BF16, F32, True), (1000, 2048, F64, F32, True),
    (5, 8192, F16, F16, False), (3001, 16, F32, F32, True),  # short rows, several per block
    (37, 1000, F16, F16, True),  # not a multiple of the chunk: the tested kernel either way
])
def test_full_rows_without_column_tests(plans, M, N, dt, wdt, has_b):
    """LayerNorm rows whose length is a multiple of the block's chunk run the forward variant
    without per-column tests (FWD_FULL): the planner takes it exactly there, it matches the
    reference, also far from zero (a mean 1000 times the spread), and it gives bitwise what the
    tested kernel gives (the same arithmetic)."""
    x_h, dy_h, g_h, b_h = inputs(M, N, dt, wdt, has_b=has_b)
    x, g = cp.asarray(x_h), cp.asarray(g_h)
    b = None if b_h is None else cp.asarray(b_h)
    plans.spy("fwd")
    out = {}
    for full in (False, True):
        plans.replan(FWD_FULL=full)
        out[full] = cupyln.layer_norm_fwd(x, g, b)
        (plan,) = plans
        multiple = N % (plan.block[0] * plan.spec.npt * plan.spec.vec) == 0
        assert plan.variant.endswith("_full") == (full and multiple), plan.variant
        check_case("ln", x_h, dy_h, g_h, b_h)
    far = (x_h.astype(np.float64) + 1000 * x_h.astype(np.float64).std()).astype(dt)
    check_case("ln", far, dy_h, g_h, b_h)  # FWD_FULL on
    for a, c in zip(out[True], out[False], strict=True):
        assert cp.array_equal(a, c)


@pytest.mark.parametrize("op", ["ln", "rms"])
@pytest.mark.parametrize("M,N,dt,wdt,has_b,stage", [
    (2000, 8192, BF16, BF16, True, "auto"), (33, 16384, F16, F32, False, "auto"),  # 8, 16 warps
    (7, 16384, F32, F32, False, "auto"), (300, 32768, F16, F16, True, "always"),  # 32 warps
    (5, 2048, F16, F16, True, "auto"),  # one vector per thread (small M)
    (700, 8192, BF16, F32, True, "always"),  # staged rows
    (100, 8192, F32, F32, True, "auto"), (9, 4096, F64, F64, False, "auto"),  # gamma/beta early
    (400, 8000, F16, F16, True, "auto"),  # not a multiple of the chunk
])
def test_wide_rows_with_fixed_threads(plans, op, M, N, dt, wdt, has_b, stage):
    """Forward rows of one chunk of FWD_FIXED_WARPS warps reduce with their threads fixed at
    compile time: the planner fixes them exactly there, at the block's width; both kernels match
    the reference, and they agree bitwise (the same additions in the same order)."""
    from cupyln import _launch

    widths = _launch.FWD_FIXED_WARPS
    x_h, dy_h, g_h, b_h = inputs(M, N, dt, wdt, has_b=has_b)
    x, g = cp.asarray(x_h), cp.asarray(g_h)
    b = None if b_h is None else cp.asarray(b_h)
    plans.spy("fwd")
    out = {}
    for fixed in ((), widths):
        plans.replan(FWD_FIXED_WARPS=fixed, FWD_STAGE=stage, FWD_ROW_WARPS=0)
        out[fixed] = cupyln.layer_norm_fwd(x, g, b) if op == "ln" else cupyln.rms_norm_fwd(x, g)
        (plan,) = plans
        wide = plan.variant != "fwd_chunked" and plan.block[0] // plan.spec.warp in fixed
        assert plan.spec.tpr == (plan.block[0] if wide else 0), (plan.variant, plan.block)
        staged = stage == "always" and _launch.device_info(x.device.id).async_copy
        assert plan.variant.startswith("fwd_staged") == staged
        check_case(op, x_h, dy_h, g_h, b_h)
    assert plan.spec.tpr > 0  # these shapes are such rows
    for a, c in zip(out[()], out[widths], strict=True):
        assert cp.array_equal(a, c)


@pytest.mark.parametrize("op", ["ln", "rms"])
@pytest.mark.parametrize("M,N,dt,wdt,params", [
    (32, 512, F16, F16, "gb"), (96, 768, F16, F32, "gb"), (192, 1024, BF16, BF16, "b"),  # 2-4 warps
    (1024, 768, F16, F16, "g"), (7, 256, F32, F32, ""), (100, 256, F16, F32, "gb"),  # 3-1
    (300, 2048, BF16, F32, "gb"), (5, 512, F64, F64, "g"),  # 8 warps
    (9, 1000, F16, F16, "gb"), (200, 200, F32, F32, "b"),  # not a multiple of the block's row
    (20001, 64, F16, F16, "gb"), (70000, 64, BF16, F32, "g"),  # rows of 8 threads, stacked
    (5000, 256, F16, F32, "b"), (3001, 4, F32, F32, "gb"), (100000, 8, F16, F16, ""),  # 32, 1
    (4097, 40, BF16, BF16, "gb"), (50000, 24, F64, F64, "b"),  # not a multiple of the row's
    # several vectors per thread (FWD_ROW_NPT_WARPS): rows of 2 warps stacked in the general
    # kernel, of 2 not filling the chunk, of 4 and 3 warps, of 2 and 4 warps of 4-byte and
    # 8-byte types
    (4096, 2048, F16, F16, "gb"), (5000, 1032, F16, F32, "gb"), (3000, 4096, BF16, BF16, "b"),
    (2000, 3072, F16, F16, "g"), (4096, 1024, F32, F32, ""), (1500, 1024, F64, F64, "gb"),
])
def test_row_kernel(plans, op, M, N, dt, wdt, params):
    """16-byte vectors: the row kernel (norm_fwd_row) exactly where FWD_ROW_WARPS, FWD_ROW_SHORT
    and FWD_ROW_NPT_WARPS allow it: one vector per thread in one row per block of whole warps
    (small M) or rows of at most a warp stacked in blockDim.y, or several in one row per block
    of 2-4 warps, the grid covering M. It matches the reference, with gamma and
    beta given or not (``params``), and agrees bitwise with the general kernel on the same rows
    (the same additions in the same order; beta added in the product's rounding in both)."""
    x_h, dy_h, g_h, b_h = inputs(M, N, dt, wdt, has_g="g" in params, has_b="b" in params)
    x = cp.asarray(x_h)
    g, b = (None if a is None else cp.asarray(a) for a in (g_h, b_h))
    plans.spy("fwd")
    out = {}
    for on in (False, True):
        plans.replan(FWD_ROW_WARPS=8 if on else 0, FWD_ROW_SHORT=on)
        out[on] = cupyln.layer_norm_fwd(x, g, b) if op == "ln" else cupyln.rms_norm_fwd(x, g)
        (plan,) = plans
        assert plan.spec.row == on == plan.variant.startswith("fwd_row"), plan.variant
        check_case(op, x_h, dy_h, g_h, b_h)
    tpr, rpb = plan.block
    assert plan.grid == (-(-M // rpb),) and plan.spec.tpr == tpr
    assert rpb == 1 or tpr <= plan.spec.warp
    for a, c in zip(out[False], out[True], strict=True):
        assert cp.array_equal(a, c)


@pytest.mark.parametrize("op", ["ln", "rms"])
@pytest.mark.parametrize("M,N,dt,wdt", [(700, 20000, F16, F16), (5, 16384, BF16, F32),
                                        (33, 32768, F16, F32), (1000, 9000, F32, F32),
                                        (3, 4100, F64, F64), (2, 70000, F32, F32)])
def test_cluster_and_row_sums_backward(plans, op, M, N, dt, wdt):
    """Long rows: clusters of column tiles that exchange their row sums (sm_90) and the row
    sums kernel before the tiles both match the reference, deterministic and not; the plan takes
    the cluster path exactly where the device has clusters and the row fits in its tiles."""
    from cupyln import _launch

    case = inputs(M, N, dt, wdt)
    plans.spy("bwd")
    for on in (True, False):
        plans.replan(BWD_CLUSTER=on)
        check_case(op, *case)
        check_case(op, *case, deterministic=True)
        plan = plans[0]
        cluster = plan.variant.startswith("bwd_cluster")
        info = _launch.device_info(cp.cuda.Device().id)
        npt = _launch.CLUSTER_NPT
        fits = N // plan.spec.vec <= _launch.CLUSTER_TILES * npt * _launch._bwd_threads(npt)
        assert cluster == (on and info.clusters and fits), plan.grid
        assert ("rowsums" in plan.launch) != cluster
        assert plan.grid[1] == _launch.CLUSTER_TILES or not cluster


@pytest.mark.parametrize("need", [(False, True, True), (False, True, False), (True, False, False)])
def test_staged_clusters_with_need_flags(plans, need):
    """The staged cluster backward (blocks looping over rows, sm_90) with dx or a parameter's
    gradient left out: every row still takes its exchange, and what is computed matches the
    reference."""
    from cupyln import _launch

    plans.spy("bwd")
    check_case("ln", *inputs(301, 20000, F16, F32), need=need)
    check_case("rms", *inputs(301, 20000, BF16, BF16), need=need)
    assert plans
    if _launch.device_info(cp.cuda.Device().id).clusters:
        assert all(p.variant == "bwd_cluster_staged" and p.grid[0] < 301 for p in plans), \
            [(p.variant, p.grid) for p in plans]


@pytest.mark.parametrize("op", ["ln", "rms"])
@pytest.mark.parametrize("M,N,dt,wdt", [(32, 512, F16, F16), (1, 1, F32, F32),
                                        (37, 33, BF16, F32), (5, 512, F16, F32),
                                        (64, 512, F16, F32), (8, 500, F32, F32),
                                        (60, 256, BF16, BF16), (3, 300, F64, F64),
                                        (150, 256, BF16, BF16), (500, 128, F16, F16)])
def test_partials_summed_in_the_last_block(plans, op, M, N, dt, wdt):
    """A grid of few blocks sums its dgamma/dbeta partials in its last block (one kernel): it
    matches the reference, deterministic or not, with either parameter gradient alone too; and
    on the same grid (rows not spread over more blocks) it gives bitwise what the separate
    reduction kernel gives. Up to 64 blocks here (the default limit is lower), so that the
    eight interleaved groups of partial rows take more than one row each."""
    case = inputs(M, N, dt, wdt)
    plans.spy("bwd")
    got = {}
    for fused in (True, False):
        plans.replan(BWD_SPREAD=0, FUSED_REDUCE_BLOCKS=64 if fused else 0,
                     BWD_CLUSTER_SUMS=False)
        got[fused] = check_case(op, *case, deterministic=True)
        check_case(op, *case)
        check_case(op, *case, need=(False, op == "rms", op == "ln"))
        plan = plans[0]
        assert ("reduce" in plan.launch) != fused, plan.grid
        assert plan.variant == ("bwd_last" if fused else "bwd")
    for a, b in zip(got[True], got[False], strict=True):
        assert (a is None and b is None) or cp.array_equal(a, b)


@pytest.mark.parametrize("op", ["ln", "rms"])
@pytest.mark.parametrize("M,N,dt,wdt", [(32, 512, F16, F16), (1, 1, F32, F32),
                                        (37, 33, BF16, F32), (5, 512, F16, F32),
                                        (8, 500, F32, F32), (3, 300, F64, F64),
                                        (60, 256, BF16, BF16), (8, 8192, F16, F16),
                                        (16, 1024, F32, F32), (2, 2048, F64, F64),
                                        (32, 1000, BF16, F32)])
def test_cluster_sums(plans, op, M, N, dt, wdt):
    """Rows that fit in one cluster of CSUM_BLOCKS blocks run there, and the blocks sum
    dgamma/dbeta through distributed shared memory: it matches the reference, deterministic or
    not, with one parameter gradient alone (dbeta for LayerNorm, dgamma for RMSNorm) and with dx
    alone, and is bitwise repeatable; so does the path without clusters. The plan takes it
    exactly where the device has clusters (every case here fits in one)."""
    from cupyln import _launch

    case = inputs(M, N, dt, wdt)
    plans.spy("bwd")
    got = {}
    for on in (True, False):
        plans.replan(BWD_CLUSTER_SUMS=on)
        got[on] = check_case(op, *case, deterministic=True)
        check_case(op, *case)
        check_case(op, *case, need=(False, op == "rms", op == "ln"))
        check_case(op, *case, need=(True, False, False))
        plan = plans[0]
        info = _launch.device_info(cp.cuda.Device().id)
        assert (plan.variant == "bwd_csum") == (on and info.clusters), plan.variant
        if plan.variant == "bwd_csum":
            assert plan.grid == (_launch.CSUM_BLOCKS, 1) and "reduce" not in plan.launch
    for _ in range(2):  # the cluster's order is fixed: the same bits on every call
        plans.replan(BWD_CLUSTER_SUMS=True)
        again = check_case(op, *case)
        for a, b in zip(got[True], again, strict=True):
            assert (a is None and b is None) or cp.array_equal(a, b)


# --------------------------------------------------------------------------- determinism


@pytest.mark.parametrize("op", ["ln", "rms"])
@pytest.mark.parametrize("M,N", [(4099, 1024), (1000, 33), (257, 20000), (37, 512)])
def test_deterministic_is_bitwise_repeatable(op, M, N):
    x, dy, g, b = inputs(M, N, F16, F32)
    dg0, db0 = check_case(op, x, dy, g, b, deterministic=True)
    for _ in range(3):
        dg, db = check_case(op, x, dy, g, b, deterministic=True)
        assert cp.array_equal(dg, dg0)
        if db0 is not None:
            assert cp.array_equal(db, db0)


# --------------------------------------------------------------------------- validation on GPU


def test_mixed_numpy_and_cupy_raise_type_error():
    x = cp.ones((4, 8), cp.float32)
    with pytest.raises(TypeError, match="gamma is a numpy array"):
        cupyln.layer_norm_fwd(x, np.ones(8, np.float32))
    _, mean, rstd = cupyln.layer_norm_fwd(x)
    with pytest.raises(TypeError, match="mean is a numpy array"):
        cupyln.layer_norm_bwd(x, x, None, mean.get(), rstd)


# --------------------------------------------------------------------------- fuzz


@st.composite
def gpu_problem(draw, op):
    n = draw(st.one_of(st.sampled_from(BOUNDARY_N), st.integers(1, 3000)))
    m = draw(st.integers(0, max(0, min(300, 200_000 // n))))
    dt, wdt = draw(st.sampled_from(PAIRS))
    has_g, has_b = draw(st.booleans()), draw(st.booleans()) and op == "ln"
    layout = draw(st.sampled_from(sorted(LAYOUTS)))
    det = draw(st.booleans())
    seed = draw(st.integers(0, 2**31))
    return op, m, n, dt, wdt, has_g, has_b, layout, det, seed


@pytest.mark.parametrize("op", ["ln", "rms"])
@given(data=st.data())
def test_fuzz_against_reference(op, data):
    p = data.draw(gpu_problem(op))
    op, m, n, dt, wdt, has_g, has_b, layout, det, seed = p
    check_case(op, *inputs(m, n, dt, wdt, has_g, has_b, seed), layout=LAYOUTS[layout],
               deterministic=det)


# --------------------------------------------------------------------------- big


@pytest.mark.slow
def test_over_2_pow_31_elements():
    """bfloat16 (2^21 + 3) x 1024: rows around element 2^31 and the last row, against the
    reference on those rows alone (rows are independent)."""
    M, N = (1 << 21) + 3, 1024
    x = cp.empty((M, N), BF16)
    dy = cp.empty((M, N), BF16)
    rs = cp.random.RandomState(1)
    for a, sc, off in ((x, 0.5, -2.3), (dy, 0.1, 0.0)):
        for i in range(0, M, 1 << 18):  # fill in slices to bound the float32 temporaries
            a[i : i + (1 << 18)] = (off + sc * rs.standard_normal((min(1 << 18, M - i), N),
                                                                  dtype=cp.float32)).astype(BF16)
    g = cp.asarray(host((N,), BF16, 2, 0.2, 1.0))
    y, mean, rstd = cupyln.layer_norm_fwd(x, g)
    dx, dg, db = cupyln.layer_norm_bwd(dy, x, g, mean, rstd, need_dgamma=False,
                                       need_dbeta=False)
    rows = np.array([(1 << 21) - 2, (1 << 21) - 1, 1 << 21, (1 << 21) + 1, M - 1])
    xh, dyh = x[rows].get(), dy[rows].get()
    ry, rm, rr = ref.layer_norm_fwd(xh, g.get(), None)
    assert_close(y[rows], ry, "y")
    assert_close(rstd[rows], rr, "rstd")
    rdx, _, _ = ref.layer_norm_bwd(dyh, xh, g.get(), mean[rows].get(), rstd[rows].get())
    assert_close(dx[rows], rdx, "dx", dx_floor(dyh, g.get(), rstd[rows]))


@pytest.mark.slow
@pytest.mark.parametrize("op", ["ln", "rms"])
def test_one_million_columns(op):
    check_case(op, *inputs(3, 1 << 20, F16, F32))
    check_case(op, *inputs(2, 1 << 20, F32, F32), deterministic=True)


# --------------------------------------------------------------------------- graphs, warmup


@pytest.mark.parametrize("given", [False, True], ids=["allocated", "out="])
@pytest.mark.parametrize("flush,M,N", [
    *((f, M, N) for M, N in ((300, 1000), (64, 512))
      for f in ("default", "deterministic", "atomic", "last block")),
    # staged backward rows from tickets (not deterministic), their counter after the flush's
    # in the scratch
    ("default", 6000, 1024), ("atomic", 6000, 1024)])
def test_cuda_graph_capture_and_replay(monkeypatch, flush, M, N, given):
    """Forward + backward captured on a stream, inputs refilled, graph replayed (twice, on
    another stream while the same signature runs on the capturing one): the results match the
    reference on the new inputs. A pool of its own keeps the captured buffers. With every
    output given (out=), the backward's scratch belongs to no output: the direct calls must not
    get it from the pool while the graph still writes to it. One cluster that sums dgamma/dbeta
    (64x512 on sm_90, unless "last block") has no scratch: that capture allocates nothing."""
    from cupyln import _launch

    deterministic = flush == "deterministic"
    monkeypatch.setattr(_launch, "ATOMIC_FLUSH", flush == "atomic")
    monkeypatch.setattr(_launch, "BWD_CLUSTER_SUMS", flush != "last block")
    _launch.clear_caches()
    stream = cp.cuda.Stream(non_blocking=True)
    pool = cp.cuda.MemoryPool()
    xh, dyh, gh, bh = inputs(M, N, F16, F32)
    try:
        with cp.cuda.using_allocator(pool.malloc), stream:
            x, dy, g, b = (cp.asarray(a) for a in (xh, dyh, gh, bh))

            def buffers():
                if not given:
                    return None, None
                stats = (cp.empty(M, cp.float32), cp.empty(M, cp.float32))
                return ((cp.empty_like(x), *stats),
                        (cp.empty_like(x), cp.empty_like(g), cp.empty_like(b)))

            def step(fo, bo):
                y, mean, rstd = cupyln.layer_norm_fwd(x, g, b, out=fo)
                return (y, mean, rstd) + cupyln.layer_norm_bwd(
                    dy, x, g, mean, rstd, deterministic=deterministic, out=bo)

            captured, direct = buffers(), buffers()  # outputs of the graph, of direct calls
            step(*captured)  # compile, plan and fill the pool outside the capture
            stream.synchronize()
            used = pool.used_bytes()
            stream.begin_capture()
            outs = step(*captured)
            graph = stream.end_capture()
            # the replays write to the scratch: it must not go back to the pool (where the
            # direct calls below could get it) when no output holds it
            plan = _launch.plan_bwd(x.device.id, F16, F32, True, M, N, 8)
            scratch = plan.variant != "bwd_csum"
            assert (pool.used_bytes() > used) == scratch or not given, "captured scratch"
        other = cp.cuda.Stream(non_blocking=True)
        for seed in (7, 8):
            xh2, dyh2, _, _ = inputs(M, N, F16, F32, seed=seed)
            x.set(xh2, stream=stream)
            dy.set(dyh2, stream=stream)
            stream.synchronize()
            graph.launch(other)
            with cp.cuda.using_allocator(pool.malloc), stream:
                for _ in range(20):  # direct calls of the same signature, at the same time
                    step(*direct)
            other.synchronize()
            stream.synchronize()
            y, mean, rstd, dx, dg, db = outs
            ry, rm, rr = ref.layer_norm_fwd(xh2, gh, bh)
            rdx, rdg, rdb = ref.layer_norm_bwd(dyh2, xh2, gh, mean.get(), rstd.get())
            for out, want, name in ((y, ry, "y"), (mean, rm, "mean"), (rstd, rr, "rstd"),
                                    (dg, rdg, "dgamma"), (db, rdb, "dbeta")):
                assert_close(out, want, name)
            assert_close(dx, rdx, "dx", dx_floor(dyh2, gh, rstd))
    finally:
        _launch.clear_caches()  # no plan made under the patched flush mode outlives the test


@pytest.mark.parametrize("atomic", [True, False], ids=["atomic", "partials"])
@pytest.mark.parametrize("M,N", [(48, 768), (2000, 1024), (6000, 1024)])
def test_concurrent_streams_each_get_correct_gradients(plans, atomic, M, N):
    """Backwards whose scratch counters are zeroed once per stream and left zeroed by each
    launch (the atomic flush's last block and sums; the dynamic staged rows' tickets,
    6000x1024) running on several streams at once: every call's dgamma/dbeta are those of its
    own inputs."""
    plans.replan(ATOMIC_FLUSH=atomic)  # no call remembered under the other flush is reused
    streams = [cp.cuda.Stream(non_blocking=True) for _ in range(4)]
    cases = [inputs(M, N, BF16, F32, seed=10 * i) for i in range(len(streams))]
    results = [[] for _ in streams]
    for _ in range(25):
        for s, (xh, dyh, gh, _), res in zip(streams, cases, results, strict=True):
            with s:
                x, dy, g = cp.asarray(xh), cp.asarray(dyh), cp.asarray(gh)
                y, mean, rstd = cupyln.layer_norm_fwd(x, g)
                res.append((mean, rstd) + cupyln.layer_norm_bwd(dy, x, g, mean, rstd)[1:])
    for s in streams:
        s.synchronize()
    for (xh, dyh, gh, _), res in zip(cases, results, strict=True):
        # the forward is deterministic: every call's mean/rstd are the first call's
        _, rm, rr = ref.layer_norm_fwd(xh, gh, None)
        assert_close(res[0][0], rm, "mean")
        assert_close(res[0][1], rr, "rstd")
        _, rdg, rdb = ref.layer_norm_bwd(dyh, xh, gh, res[0][0].get(), res[0][1].get())
        for mean, rstd, dg, db in res:
            assert cp.array_equal(mean, res[0][0]) and cp.array_equal(rstd, res[0][1])
            assert_close(dg, rdg, "dgamma")
            assert_close(db, rdb, "dbeta")


def test_warmup_compiles_the_plans_calls_use():
    from cupyln import _launch

    n = cupyln.warmup([(64, 768, "float16"), (8, 4096, BF16)], param_dtype="float32")
    assert n == 8
    dev = cp.cuda.runtime.getDevice()
    assert _launch.plan_fwd.cache_info().currsize >= 4
    x = cp.asarray(host((64, 768), F16, 0))
    before = _launch.plan_fwd.cache_info().misses
    cupyln.layer_norm_fwd(x, cp.ones(768, cp.float32))
    assert _launch.plan_fwd.cache_info().misses == before  # the call found its plan ready
    assert dev == x.device.id


# --------------------------------------------------------------------------- out=


@pytest.mark.parametrize("M,N", [(0, 64), (37, 1000), (5, 20000)])
def test_out_matches_the_allocating_path(M, N):
    x_h, dy_h, g_h, b_h = inputs(M, N, BF16, F32)
    x, dy, g, b = (cp.asarray(a) for a in (x_h, dy_h, g_h, b_h))
    y, mean, rstd = cupyln.layer_norm_fwd(x, g, b)
    outs = (cp.full(x.shape, 7, x.dtype), None, cp.full(M, 7, cp.float32))
    got = cupyln.layer_norm_fwd(x, g, b, out=outs)
    assert got[0] is outs[0] and got[2] is outs[2]
    for a, w in zip(got, (y, mean, rstd), strict=True):
        assert cp.array_equal(a, w)
    dx, dg, db = cupyln.layer_norm_bwd(dy, x, g, mean, rstd, deterministic=True)
    o = (None, cp.full(N, 7, cp.float32), cp.full(N, 7, cp.float32))
    gd = cupyln.layer_norm_bwd(dy, x, g, mean, rstd, deterministic=True, out=o)
    assert gd[1] is o[1] and gd[2] is o[2]
    for a, w in zip(gd, (dx, dg, db), strict=True):
        assert cp.array_equal(a, w)
    yr, rr = cupyln.rms_norm_fwd(x, g)
    got = cupyln.rms_norm_fwd(x, g, out=(cp.empty_like(x), cp.empty(M, cp.float32)))
    assert cp.array_equal(got[0], yr) and cp.array_equal(got[1], rr)
    got = cupyln.rms_norm_bwd(dy, x, g, rr, deterministic=True,
                              out=(cp.empty_like(x), cp.empty(N, cp.float32)))
    want = cupyln.rms_norm_bwd(dy, x, g, rr, deterministic=True)
    assert cp.array_equal(got[0], want[0]) and cp.array_equal(got[1], want[1])


# --------------------------------------------------------------------------- remembered calls


@pytest.mark.parametrize("op", ["ln", "rms"])
@pytest.mark.parametrize("M,N,dt", [(7, 64, F16), (300, 4096, BF16), (3, 20000, F32)])
def test_repeated_calls_of_one_signature(op, M, N, dt):
    """Calls after the first take the remembered launch: new values, same results as the
    reference; an input at an address the plan's vector width does not suit (an element past
    an aligned one) and an out= array that overlaps an input are still caught."""
    from cupyln import api

    for seed in range(3):
        check_case(op, *inputs(M, N, dt, dt, seed=seed))
    # the forward was remembered: key ((is_ln, eps), out is None, x, gamma, beta),
    # x = (type, shape, ...)
    assert any(k[2][1] == (M, N) for k in api._HOT if k[1] and len(k) == 5)
    x_h, dy_h, g_h, b_h = inputs(M, N, dt, dt, seed=5)

    def shifted(a):  # same shape, strides and dtype; the data starts one element later
        buf = cp.empty(a.size + 1, a.dtype)
        v = buf[1:].reshape(a.shape)
        v[...] = a
        return v

    check_case(op, x_h, dy_h, g_h, b_h, layout=shifted)
    x, g = cp.asarray(x_h), cp.asarray(g_h)
    fwd = (lambda o: cupyln.layer_norm_fwd(x, g, None, out=o)) if op == "ln" else (
        lambda o: cupyln.rms_norm_fwd(x, g, out=o))
    stats = tuple(cp.empty(M, cp.float32) for _ in range(2 if op == "ln" else 1))
    fwd((cp.empty_like(x), *stats))  # remembered with out=
    with pytest.raises(ValueError, match="overlaps the input x"):
        fwd((x, *stats))
    if op == "ln":  # two outputs in one array: same signature, caught on the remembered path
        with pytest.raises(ValueError, match="out rstd overlaps out mean"):
            fwd((cp.empty_like(x), stats[0], stats[0]))


def test_out_of_the_wrong_kind_raises():
    x = cp.ones((4, 8), cp.float32)
    with pytest.raises(TypeError, match="out y must be a cupy array"):
        cupyln.layer_norm_fwd(x, out=(np.empty((4, 8), np.float32), None, None))
