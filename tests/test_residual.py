"""The fused residual add and the weight offset on NumPy arrays: the reference's properties
(fused equals add then norm, gradients through the residual, the offset equals an explicit
gamma + offset) and the validation contract of the new arguments."""

import ml_dtypes
import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st
from strategies import DTYPES, shapes, values

import cupyln
from cupyln import reference as ref

BF16 = np.dtype(ml_dtypes.bfloat16)
F16 = np.dtype(np.float16)
F32 = np.dtype(np.float32)
LN_RMS = st.sampled_from(["ln", "rms"])


def _rand(shape, dtype=np.float32, seed=0):
    return np.random.default_rng(seed).standard_normal(shape).astype(dtype)


def fwd(op, x, gamma=None, beta=None, **kw):
    if op == "ln":
        return cupyln.layer_norm_fwd(x, gamma, beta, **kw)
    return cupyln.rms_norm_fwd(x, gamma, **kw)


def bwd(op, dy, x, gamma, stats, **kw):
    if op == "ln":
        return cupyln.layer_norm_bwd(dy, x, gamma, *stats, **kw)
    return (*cupyln.rms_norm_bwd(dy, x, gamma, *stats, **kw), None)


def _h_dtypes(dtype):
    return [None, F32] if dtype.itemsize == 2 else [None]


# --------------------------------------------------------------------------- fused = add + norm


@given(shapes(max_elems=3000), st.sampled_from(DTYPES), LN_RMS, st.data())
def test_fused_add_equals_add_then_norm(shape, dtype, op, data):
    """y, statistics and h of the fused call are those of the norm of h = x + residual rounded
    to residual_dtype, bit for bit on the NumPy path; h is C-contiguous in residual_dtype."""
    m, n = shape
    hdt = data.draw(st.sampled_from(_h_dtypes(dtype)))
    rdt = data.draw(st.sampled_from([dtype, hdt or dtype]))
    x = data.draw(values((m, n), dtype))
    r = data.draw(values((m, n), rdt))
    gamma, beta = _rand((n,), F32, 1), _rand((n,), F32, 2)
    *outs, h = fwd(op, x, gamma, beta if op == "ln" else None, residual=r, residual_dtype=hdt)
    want_h = (x.astype(np.float64) + r.astype(np.float64)).astype(hdt or dtype)
    assert h.dtype == (hdt or dtype) and h.flags.c_contiguous
    np.testing.assert_array_equal(h, want_h)
    # the norm of h widened exactly, its y rounded once to x's dtype: h's own call would round y
    # to float32 first, and a float32 h's 16-bit y then differs in the last bit where that
    # rounding lands on a tie (double rounding)
    plain = fwd(op, h.astype(np.float64), gamma, beta if op == "ln" else None)
    assert outs[0].dtype == dtype  # y in x's dtype, whatever h's
    np.testing.assert_array_equal(outs[0], plain[0].astype(dtype))
    for a, b in zip(outs[1:], plain[1:], strict=True):
        np.testing.assert_array_equal(a, b)


@given(shapes(max_elems=3000), st.sampled_from(DTYPES), LN_RMS, st.data())
def test_dresidual_is_added_to_dx(shape, dtype, op, data):
    m, n = shape
    x = data.draw(values((m, n), dtype))
    dy = data.draw(values((m, n), dtype, offset=0.0))
    dr = data.draw(values((m, n), dtype, offset=0.0))
    gamma = _rand((n,), dtype, 3)
    stats = fwd(op, x, gamma)[1:]
    dx, dg, db = bwd(op, dy, x, gamma, stats, dresidual=dr)
    dx0, dg0, db0 = bwd(op, dy, x, gamma, stats)
    want = ref._norm_bwd(dy, x, gamma, stats[0] if op == "ln" else None, stats[-1], dr)[0]
    assert dx.dtype == dtype
    np.testing.assert_array_equal(dx, want.astype(dtype))
    np.testing.assert_array_equal(dg, dg0)  # the parameter gradients do not see dresidual
    if op == "ln":
        np.testing.assert_array_equal(db, db0)


def _directional(f, x, v, h=1e-5):
    d1 = f(x + h * v) - f(x - h * v)
    d2 = f(x + 2 * h * v) - f(x - 2 * h * v)
    return (8 * d1 - d2) / (12 * h)


@given(shapes(max_elems=2000), LN_RMS, st.floats(-1.5, 1.5), st.integers(0, 2**32 - 1))
def test_gradients_through_the_residual_match_central_differences(shape, op, off, seed):
    """With L = sum(dy * y) + sum(dh * h), h = x + residual: the backward given h and
    dresidual = dh returns the gradient of L in x and in residual (both: dh/dx = dh/dr = 1), and
    dgamma, under a weight offset, by central differences in float64."""
    m, n = shape
    if m == 0:
        return
    rng = np.random.default_rng(seed)
    x, r = rng.standard_normal((m, n)) + 0.5, rng.standard_normal((m, n))
    dy, dh = rng.standard_normal((m, n)), rng.standard_normal((m, n))
    gamma = rng.standard_normal(n)
    beta = rng.standard_normal(n) if op == "ln" else None

    def rfwd(xx, rr, gg):  # the float64 reference: float64 statistics too
        if op == "ln":
            return ref.layer_norm_fwd(xx, gg, beta, 1e-5, residual=rr, weight_offset=off)
        return ref.rms_norm_fwd(xx, gg, 1e-6, residual=rr, weight_offset=off)

    def loss(xx=x, rr=r, gg=gamma):
        *o, h = rfwd(xx, rr, gg)
        return float(np.sum(dy * o[0]) + np.sum(dh * h))

    *outs, h = rfwd(x, r, gamma)
    mean = outs[1] if op == "ln" else None
    dx, dg, _ = ref._norm_bwd(dy, h, gamma, mean, outs[-1], dh, off)
    for grad, at, f in [(dx, x, lambda t: loss(xx=t)), (dx, r, lambda t: loss(rr=t)),
                        (dg, gamma, lambda t: loss(gg=t))]:
        v = rng.standard_normal(at.shape)
        analytic = float(np.sum(grad * v))
        numeric = _directional(f, at, v)
        tol = 1e-5 * max(abs(analytic), 1e-2 * np.linalg.norm(grad) * np.linalg.norm(v)) + 1e-6
        assert abs(numeric - analytic) <= tol, (numeric, analytic)


# --------------------------------------------------------------------------- weight offset


@given(shapes(max_elems=3000), st.sampled_from(DTYPES), LN_RMS, st.sampled_from([1.0, -0.5, 3.0]),
       st.data())
def test_weight_offset_equals_an_explicit_offset_gamma(shape, dtype, op, off, data):
    """Forward and dx with weight_offset equal the same calls with gamma + offset (float64
    parameters, so the explicit sum is exact); dgamma is the same with and without it."""
    m, n = shape
    x = data.draw(values((m, n), dtype))
    dy = data.draw(values((m, n), dtype, offset=0.0))
    gamma = data.draw(values((n,), np.float64, scale=0.5, offset=0.0)).astype(F32)
    shifted = gamma.astype(np.float64) + off
    beta = _rand((n,), F32, 5) if op == "ln" else None
    got = fwd(op, x, gamma, beta, weight_offset=off)
    ry = (ref.layer_norm_fwd(x, shifted, beta, 1e-5) if op == "ln"
          else ref.rms_norm_fwd(x, shifted, 1e-6))[0]
    np.testing.assert_array_equal(got[0], ry.astype(dtype))
    dx, dg, _ = bwd(op, dy, x, gamma, got[1:], weight_offset=off)
    want = ref._norm_bwd(dy, x, shifted, got[1] if op == "ln" else None, got[-1])
    np.testing.assert_array_equal(dx, want[0].astype(dtype))
    np.testing.assert_array_equal(dg, want[1].astype(F32))
    np.testing.assert_array_equal(dg, bwd(op, dy, x, gamma, got[1:])[1])


# --------------------------------------------------------------------------- validation


def _ok():
    x = _rand((4, 8), BF16)
    return x, _rand((4, 8), BF16, 1), _rand((8,), F32, 2)


@pytest.mark.parametrize("kw,exc,msg", [
    ({"residual": _rand((4, 8), np.float64)}, TypeError, "residual has dtype float64"),
    ({"residual": _rand((4, 8), F16)}, TypeError, "residual has dtype float16"),
    ({"residual": _rand((4, 9), BF16)}, ValueError, "residual has shape"),
    ({"residual": [[1.0]]}, TypeError, "residual must be a numpy.ndarray"),
    ({"residual": _rand((4, 8), BF16), "residual_dtype": np.float16}, TypeError,
     "residual_dtype is float16"),
    ({"residual": _rand((4, 8), BF16), "residual_dtype": "nonsense"}, TypeError,
     "residual_dtype must be a dtype"),
    ({"residual_dtype": np.float32}, ValueError, "residual_dtype was given but residual"),
    ({"weight_offset": float("nan")}, ValueError, "weight_offset must be finite"),
    ({"weight_offset": True}, TypeError, "weight_offset must be a real number"),
    ({"weight_offset": "1"}, TypeError, "weight_offset must be a real number"),
    ({"weight_offset": np.array([1.0, 2.0])}, TypeError, "weight_offset must be a real number"),
])
def test_forward_rejects_bad_residual_and_offset(kw, exc, msg):
    x, _, g = _ok()
    for op in ("ln", "rms"):
        with pytest.raises(exc, match=msg):
            fwd(op, x, g, **kw)


def test_weight_offset_needs_gamma():
    x, _, _ = _ok()
    with pytest.raises(ValueError, match="weight_offset=1.0 needs gamma"):
        cupyln.rms_norm_fwd(x, None, weight_offset=1.0)
    y, rstd = cupyln.rms_norm_fwd(x, None, weight_offset=0)  # zero is no offset
    with pytest.raises(ValueError, match="needs gamma"):
        cupyln.rms_norm_bwd(y, x, None, rstd, weight_offset=2.0)
    with pytest.raises(TypeError, match="weight_offset must be a real number"):
        cupyln.rms_norm_bwd(y, x, None, rstd, weight_offset=np.ones(2))


def test_residual_dtype_float32_only_for_16_bit_rows():
    x = _rand((4, 8), np.float64)
    with pytest.raises(TypeError, match="residual_dtype is float32; expected float64"):
        cupyln.layer_norm_fwd(x, residual=x.copy(), residual_dtype=np.float32)


def test_backward_rejects_bad_dresidual_and_dy():
    x, r, g = _ok()
    y, mean, rstd, h = cupyln.layer_norm_fwd(x, g, residual=r, residual_dtype=np.float32)
    dr = np.ones_like(h)
    cases = [
        ({"dresidual": dr.astype(BF16)}, TypeError, "dresidual has dtype bfloat16"),
        ({"dresidual": dr[:, :4]}, ValueError, "dresidual has shape"),
        ({"dresidual": dr, "need_dx": False}, ValueError, "need_dx is False"),
        ({"dresidual": [1.0]}, TypeError, "dresidual must be a numpy.ndarray"),
    ]
    for kw, exc, msg in cases:
        with pytest.raises(exc, match=msg):
            cupyln.layer_norm_bwd(np.ones_like(h), h, g, mean, rstd, **kw)
    # dy in h's dtype: y's bfloat16 is refused with a float32 h
    with pytest.raises(TypeError, match="dy has dtype bfloat16; expected x's dtype float32"):
        cupyln.layer_norm_bwd(y, h, g, mean, rstd)


def test_out_takes_h_and_checks_it():
    x, r, g = _ok()
    out = (np.empty_like(x), np.empty(4, F32), np.empty(4, F32), np.empty((4, 8), F32))
    res = cupyln.layer_norm_fwd(x, g, residual=r, residual_dtype=F32, out=out)
    assert all(a is b for a, b in zip(res, out, strict=True))
    np.testing.assert_array_equal(out[3], x.astype(F32) + r.astype(F32))
    with pytest.raises(TypeError, match="out must be None or a tuple of 4"):
        cupyln.layer_norm_fwd(x, g, residual=r, out=out[:3])
    with pytest.raises(TypeError, match="out h has dtype float32; expected bfloat16"):
        cupyln.layer_norm_fwd(x, g, residual=r, out=out)
    with pytest.raises(ValueError, match="out h overlaps the input residual"):
        cupyln.rms_norm_fwd(x, g, residual=r, out=(None, None, r))


def test_float32_residual_stream_round_trip():
    """bfloat16 rows with a float32 residual stream: h and dx in float32, y in bfloat16; the
    backward takes dy in h's dtype."""
    x, r, _ = _ok()
    g = np.ones(8, F32)
    r32 = r.astype(F32) * 1.001
    y, mean, rstd, h = cupyln.layer_norm_fwd(x, g, residual=r32, residual_dtype=F32)
    assert (y.dtype, h.dtype) == (BF16, F32)
    dx, dg, db = cupyln.layer_norm_bwd(np.ones_like(h), h, g, mean, rstd,
                                       dresidual=np.ones_like(h))
    assert (dx.dtype, dg.dtype, db.dtype) == (F32, F32, F32)
    np.testing.assert_allclose(dx, 1.0, atol=1e-5)  # dy * gamma constant along the row: dx is dh
