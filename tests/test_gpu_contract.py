"""The public contract on the GPU, against the float64 reference (marked `gpu`)."""

import ml_dtypes  # noqa: F401
import numpy as np
import pytest
from gpu_cases import (
    BF16,
    F16,
    F32,
    F64,
    LAYOUTS,
    PAIRS,
    assert_close,
    check_case,
    host,
    inputs,
)
from hypothesis import given
from hypothesis import strategies as st
from strategies import BOUNDARY_N

import cupyln
from cupyln import reference as ref
from cupyln.check import dx_floor

cp = pytest.importorskip("cupy")
pytestmark = pytest.mark.gpu


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


@pytest.mark.parametrize("layout", LAYOUTS, ids=list(LAYOUTS))
@pytest.mark.parametrize("N", [8, 760, 4096, 20000])
def test_layouts(layout, N):
    f = LAYOUTS[layout]
    check_case("ln", *inputs(33, N, F16, F16), layout=f)
    check_case("rms", *inputs(33, N, F32, F32), layout=f)


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


def test_rows_past_the_grid_limit_raise_before_any_work():
    """A backward whose column tiles would need more blocks than the grid holds (rows of
    33554433 float16 elements read one at a time, x's rows starting 2 bytes past dx's: 65537
    tiles) raises ValueError while planning; the outputs given stay as they were. The forward
    of such a row runs, and so does the backward where x's and dx's rows start alike (peeled,
    in 16-byte vectors)."""
    x = cp.ones((1, 2**25 + 2), F16)[:, 1:]
    y, mean, rstd = cupyln.layer_norm_fwd(x)
    assert float(mean[0]) == 1.0
    dx = cp.full_like(x, 7)
    with pytest.raises(ValueError, match="rows of 33554433 elements"):
        cupyln.layer_norm_bwd(x, x, None, mean, rstd, out=(dx, None, None))
    assert bool((dx == 7).all())
    x = x.copy()  # its row starting as dx's, 256-byte aligned
    dx = cupyln.layer_norm_bwd(x, x, None, mean, rstd)[0]
    # dy == 1 and x == its mean: no gradient, but for the float32 sum of 2^25 + 1 ones
    assert float(abs(dx).max()) < 1e-3


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


# --------------------------------------------------------------------------- out=


@pytest.mark.parametrize("M,N,shift", [(0, 64, 0), (37, 1000, 0), (5, 20000, 1), (1, 140000, 0),
                                       (1, 140000, 1)])
def test_out_matches_the_allocating_path(M, N, shift):
    """``out=`` gives bitwise what the allocating calls give; ``shift``: dgamma/dbeta given one
    element past an aligned start (one long row: each block writes them itself)."""
    x_h, dy_h, g_h, b_h = inputs(M, N, BF16, F32)
    x, dy, g, b = (cp.asarray(a) for a in (x_h, dy_h, g_h, b_h))
    y, mean, rstd = cupyln.layer_norm_fwd(x, g, b)
    outs = (cp.full(x.shape, 7, x.dtype), None, cp.full(M, 7, cp.float32))
    got = cupyln.layer_norm_fwd(x, g, b, out=outs)
    assert got[0] is outs[0] and got[2] is outs[2]
    for a, w in zip(got, (y, mean, rstd), strict=True):
        assert cp.array_equal(a, w)
    dx, dg, db = cupyln.layer_norm_bwd(dy, x, g, mean, rstd, deterministic=True)
    o = (None, *(cp.full(N + shift, 7, cp.float32)[shift:] for _ in range(2)))
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


