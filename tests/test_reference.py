"""Properties of the NumPy float64 reference: gradients by finite differences, and metamorphic
relations that any correct LayerNorm/RMSNorm satisfies."""

import numpy as np
from hypothesis import given
from hypothesis import strategies as st
from strategies import shapes, values

from cupyln import reference as ref
from cupyln.check import dweight_floors, max_err

LN_RMS = st.sampled_from(["ln", "rms"])


def fwd(op, x, gamma=None, beta=None, eps=1e-5):
    if op == "ln":
        return ref.layer_norm_fwd(x, gamma, beta, eps)
    y, rstd = ref.rms_norm_fwd(x, gamma, eps)
    return y, None, rstd


def bwd(op, dy, x, gamma, mean, rstd):
    if op == "ln":
        return ref.layer_norm_bwd(dy, x, gamma, mean, rstd)
    dx, dgamma = ref.rms_norm_bwd(dy, x, gamma, rstd)
    return dx, dgamma, None


@st.composite
def problem(draw, max_elems=40_000, min_m=0):
    m, n = draw(shapes(max_elems=max_elems))
    m = max(m, min_m)
    x = draw(values((m, n)))
    gamma = draw(st.one_of(st.none(), values((n,), scale=1.0, offset=1.0)))
    beta = draw(st.one_of(st.none(), values((n,), scale=1.0, offset=0.0)))
    dy = draw(values((m, n), offset=0.0))
    eps = draw(st.sampled_from([1e-5, 1e-3, 0.1, 1.0]))
    return x, gamma, beta, dy, eps


# --------------------------------------------------------------------------- gradients


def _directional(f, x, v, h):
    """Five-point central difference of f along v (truncation error O(h^4))."""
    d1 = f(x + h * v) - f(x - h * v)
    d2 = f(x + 2 * h * v) - f(x - 2 * h * v)
    return (8 * d1 - d2) / (12 * h)


@given(problem(max_elems=6000, min_m=1), LN_RMS, st.integers(0, 2**32 - 1))
def test_gradients_match_central_differences(p, op, seed):
    """<grad, v> equals the central difference of L = sum(dy * y) along a random v, for x,
    gamma and beta (rtol 1e-5). dy is random, never all ones."""
    x, gamma, beta, dy, eps = p
    if op == "rms":
        beta = None
    rng = np.random.default_rng(seed)
    y, mean, rstd = fwd(op, x, gamma, beta, eps)
    dx, dgamma, dbeta = bwd(op, dy, x, gamma, mean, rstd)
    g1 = np.ones(x.shape[1]) if gamma is None else gamma

    def loss(xx=x, gg=g1, bb=beta):
        return float(np.sum(dy * fwd(op, xx, gg, bb, eps)[0]))

    h = 1e-5
    # rounding of the loss itself, amplified by 1/h in the difference quotient
    round_off = 10 * np.finfo(np.float64).eps * float(np.sum(np.abs(dy * y))) / h

    checks = [(dx, x, lambda t: loss(xx=t))]
    checks.append((dgamma, g1, lambda t: loss(gg=t)))
    if beta is not None:
        checks.append((dbeta, beta, lambda t: loss(bb=t)))
    for grad, at, f in checks:
        v = rng.standard_normal(at.shape)
        analytic = float(np.sum(grad * v))
        numeric = _directional(f, at, v, h)
        # rtol 1e-5 of the derivative, or of its natural scale |grad||v| / 100 where the
        # directional derivative itself cancels to near zero
        tol = 1e-5 * max(abs(analytic), 1e-2 * np.linalg.norm(grad) * np.linalg.norm(v))
        assert abs(numeric - analytic) <= tol + round_off, (numeric, analytic)


# --------------------------------------------------------------------------- forward relations


@given(problem(), LN_RMS)
def test_normalized_rows_have_zero_mean_and_unit_scale(p, op):
    """Without gamma/beta: LayerNorm rows have mean 0 and mean square var/(var+eps); RMSNorm
    rows have mean square ms/(ms+eps). Catches an N-1 variance and a dropped eps."""
    x, _, _, _, eps = p
    y, _, _ = fwd(op, x, eps=eps)
    if x.shape[0] == 0:
        return
    if op == "ln":
        np.testing.assert_allclose(y.mean(axis=1), 0.0, atol=1e-9)
        var = x.var(axis=1)
    else:
        var = (x * x).mean(axis=1)
    np.testing.assert_allclose((y * y).mean(axis=1), var / (var + eps), rtol=1e-9, atol=1e-12)


@given(problem(), st.floats(-50.0, 50.0))
def test_layernorm_is_shift_invariant(p, c):
    x, gamma, beta, _, eps = p
    y1, _, _ = fwd("ln", x, gamma, beta, eps)
    y2, _, _ = fwd("ln", x + c, gamma, beta, eps)
    np.testing.assert_allclose(y2, y1, rtol=1e-6, atol=1e-6)


@given(problem(), LN_RMS, st.floats(1e-2, 1e2))
def test_scale_with_scaled_eps(p, op, a):
    """y(a x, a^2 eps) == y(x, eps)."""
    x, gamma, beta, _, eps = p
    y1, _, _ = fwd(op, x, gamma, beta if op == "ln" else None, eps)
    y2, _, _ = fwd(op, a * x, gamma, beta if op == "ln" else None, a * a * eps)
    np.testing.assert_allclose(y2, y1, rtol=1e-9, atol=1e-9)


@given(problem(), LN_RMS)
def test_affine_split(p, op):
    """y(x, gamma, beta) == gamma * y(x, 1, 0) + beta."""
    x, gamma, beta, _, eps = p
    n = x.shape[1]
    g = np.ones(n) if gamma is None else gamma
    b = np.zeros(n) if beta is None or op == "rms" else beta
    y, _, _ = fwd(op, x, g, b if op == "ln" else None, eps)
    y0, _, _ = fwd(op, x, eps=eps)
    np.testing.assert_allclose(y, g * y0 + b, rtol=1e-12, atol=1e-12)


@given(problem(), LN_RMS, st.integers(0, 2**32 - 1))
def test_row_permutation_and_locality(p, op, seed):
    x, gamma, beta, dy, eps = p
    beta = beta if op == "ln" else None
    rng = np.random.default_rng(seed)
    perm = rng.permutation(x.shape[0])
    y, mean, rstd = fwd(op, x, gamma, beta, eps)
    yp, _, rstdp = fwd(op, x[perm], gamma, beta, eps)
    np.testing.assert_array_equal(yp, y[perm])
    np.testing.assert_array_equal(rstdp, rstd[perm])
    if x.shape[0] == 0:
        return
    r = rng.integers(x.shape[0])
    x2 = x.copy()
    x2[r] = x2[r] * 3.0 + 1.0
    y2, _, _ = fwd(op, x2, gamma, beta, eps)
    others = np.arange(x.shape[0]) != r
    np.testing.assert_array_equal(y2[others], y[others])
    dx, _, _ = bwd(op, dy, x, gamma, mean, rstd)
    dy2 = dy.copy()
    dy2[r] += 1.0
    dx2, _, _ = bwd(op, dy2, x, gamma, mean, rstd)
    np.testing.assert_array_equal(dx2[others], dx[others])


@given(problem(), LN_RMS, st.data())
def test_batch_split(p, op, data):
    x, gamma, beta, dy, eps = p
    beta = beta if op == "ln" else None
    cut = data.draw(st.integers(0, x.shape[0]))
    y, mean, rstd = fwd(op, x, gamma, beta, eps)
    ya, _, _ = fwd(op, x[:cut], gamma, beta, eps)
    yb, _, _ = fwd(op, x[cut:], gamma, beta, eps)
    np.testing.assert_array_equal(np.concatenate([ya, yb]), y)
    _, dg, db = bwd(op, dy, x, gamma, mean, rstd)
    sl = (slice(None, cut), slice(cut, None))
    parts = [bwd(op, dy[s], x[s], gamma, None if mean is None else mean[s], rstd[s]) for s in sl]
    np.testing.assert_allclose(parts[0][1] + parts[1][1], dg, rtol=1e-10, atol=1e-10)
    if db is not None:
        np.testing.assert_allclose(parts[0][2] + parts[1][2], db, rtol=1e-10, atol=1e-10)


# --------------------------------------------------------------------------- backward relations


@given(problem())
def test_dbeta_is_sum_of_dy_and_dx_rows_sum_to_zero(p):
    x, gamma, _, dy, eps = p
    _, mean, rstd = fwd("ln", x, gamma, None, eps)
    dx, dgamma, dbeta = bwd("ln", dy, x, gamma, mean, rstd)
    assert dbeta.shape == (x.shape[1],) and dgamma.shape == (x.shape[1],)
    np.testing.assert_allclose(dbeta, dy.sum(axis=0), rtol=1e-12, atol=1e-12)
    scale = np.abs(dx).sum(axis=1) + 1e-12
    np.testing.assert_array_less(np.abs(dx.sum(axis=1)), 1e-9 * scale + 1e-12)


@given(problem())
def test_rmsnorm_dx_orthogonal_to_x_without_eps(p):
    """RMSNorm is scale invariant when eps = 0, so sum(dx * x) vanishes on every row."""
    x, gamma, _, dy, _ = p
    _, _, rstd = fwd("rms", x, gamma, eps=0.0)
    dx, _, _ = bwd("rms", dy, x, gamma, None, rstd)
    g = dy if gamma is None else dy * gamma
    scale = 2 * np.abs(g * x).sum(axis=1) * rstd + 1e-300
    np.testing.assert_array_less(np.abs((dx * x).sum(axis=1)), 1e-9 * scale)


@given(problem(), LN_RMS, st.floats(-3, 3), st.floats(-3, 3), st.integers(0, 2**32 - 1))
def test_backward_is_linear_in_dy(p, op, a, b, seed):
    x, gamma, _, dy1, eps = p
    dy2 = np.random.default_rng(seed).standard_normal(dy1.shape)
    _, mean, rstd = fwd(op, x, gamma, None, eps)
    r1 = bwd(op, dy1, x, gamma, mean, rstd)
    r2 = bwd(op, dy2, x, gamma, mean, rstd)
    r = bwd(op, a * dy1 + b * dy2, x, gamma, mean, rstd)
    for out, o1, o2 in zip(r, r1, r2, strict=True):
        if out is None:
            continue
        want = a * o1 + b * o2
        np.testing.assert_allclose(out, want, rtol=1e-9, atol=1e-9 * (np.abs(want).max(initial=0) + 1))


def test_multi_axis_normalized_shape_equals_flattened():
    rng = np.random.default_rng(0)
    x = rng.standard_normal((3, 4, 5, 6))
    gamma = rng.standard_normal((5, 6))
    y, mean, rstd = ref.layer_norm_fwd(x, gamma, None)
    y2, mean2, rstd2 = ref.layer_norm_fwd(x.reshape(12, 30), gamma.reshape(30), None)
    assert mean.shape == (3, 4)
    np.testing.assert_allclose(y.reshape(12, 30), y2)
    np.testing.assert_allclose(mean.reshape(-1), mean2)
    np.testing.assert_allclose(rstd.reshape(-1), rstd2)


def test_dweight_floor_measures_a_cancelling_column_sum_by_its_terms():
    """One column of 177 rows whose dgamma cancels to 1e-5 from terms of 0.1: float32's
    rounding is far above 1e-4 of the sum but within 1e-4 of the floor; a row left out is
    not."""
    rng = np.random.default_rng(0)
    h = 1.0 + 0.5 * rng.standard_normal((177, 1))
    dy = 0.1 * rng.standard_normal((177, 1))
    rstd = 1 / np.sqrt(h[:, 0] ** 2 + 1e-6)
    dy[-1] -= ((dy[:, 0] * h[:, 0] * rstd).sum() - 1e-5) / (h[-1, 0] * rstd[-1])
    terms = dy[:, 0] * h[:, 0] * rstd
    _, want = ref.rms_norm_bwd(dy, h, np.ones(1), rstd)
    summed = np.cumsum(terms.astype(np.float32))[-1:]  # a float32 running sum
    floor = dweight_floors(dy, h, None, rstd)[0]
    assert max_err(summed, want) > 1e-4
    assert max_err(summed, want, floor) <= 1e-4
    assert max_err(want - np.median(np.abs(terms)), want, floor) > 1e-4
