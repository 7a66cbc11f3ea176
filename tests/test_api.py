"""The public API on NumPy arrays: output dtypes/shapes/None-ness, and the validation contract.
The same validation runs before the CuPy path (tests/test_gpu.py checks it writes nothing)."""

import ml_dtypes
import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st
from strategies import DTYPES, shapes, values

import cupyln
from cupyln import reference as ref

BF16 = np.dtype(ml_dtypes.bfloat16)
F32 = np.dtype(np.float32)


def _rand(shape, dtype=np.float32, seed=0):
    return np.random.default_rng(seed).standard_normal(shape).astype(dtype)


# --------------------------------------------------------------------------- outputs


@given(shapes(max_elems=5000), st.sampled_from(DTYPES), st.sampled_from(["same", "f32", None]),
       st.data())
def test_numpy_path_matches_reference_with_contract_dtypes(shape, dtype, pkind, data):
    m, n = shape
    x = data.draw(values((m, n), dtype))
    dy = data.draw(values((m, n), dtype, offset=0.0))
    pdt = {"same": dtype, "f32": F32, None: None}[pkind]
    gamma = None if pdt is None else _rand((n,), pdt, 1)
    beta = None if pdt is None else _rand((n,), pdt, 2)
    y, mean, rstd = cupyln.layer_norm_fwd(x, gamma, beta)
    assert (y.dtype, y.shape) == (dtype, x.shape)
    assert mean.dtype == rstd.dtype == F32 and mean.shape == rstd.shape == (m,)
    ry, rm, rr = ref.layer_norm_fwd(x, gamma, beta)
    np.testing.assert_array_equal(y, ry.astype(dtype))
    np.testing.assert_array_equal(rstd, rr.astype(F32))
    dx, dg, db = cupyln.layer_norm_bwd(dy, x, gamma, mean, rstd)
    assert (dx.dtype, dx.shape) == (dtype, x.shape)
    wdt = dtype if gamma is None else gamma.dtype
    assert dg is None if gamma is None else (dg.dtype, dg.shape) == (wdt, (n,))
    assert (db.dtype, db.shape) == (wdt, (n,))
    if m == 0:
        assert not db.astype(np.float64).any()
    y2, rstd2 = cupyln.rms_norm_fwd(x, gamma)
    assert (y2.dtype, rstd2.dtype, rstd2.shape) == (dtype, F32, (m,))
    dx2, dg2 = cupyln.rms_norm_bwd(dy, x, gamma, rstd2)
    assert dx2.dtype == dtype and (dg2 is None) == (gamma is None)


def test_need_flags_give_none():
    x, dy = _rand((4, 8)), _rand((4, 8), seed=3)
    g = _rand((8,), seed=4)
    _, mean, rstd = cupyln.layer_norm_fwd(x, g)
    assert cupyln.layer_norm_bwd(dy, x, g, mean, rstd, need_dx=False)[0] is None
    assert cupyln.layer_norm_bwd(dy, x, g, mean, rstd, need_dgamma=False)[1] is None
    assert cupyln.layer_norm_bwd(dy, x, g, mean, rstd, need_dbeta=False)[2] is None
    assert cupyln.rms_norm_bwd(dy, x, g, rstd, need_dgamma=False)[1] is None
    _, dg, db = cupyln.layer_norm_bwd(dy, x, None, mean, rstd)
    assert dg is None and db.shape == (8,)


def test_multi_axis_gamma_and_normalized_shape():
    x = _rand((2, 3, 4, 5))
    g = _rand((4, 5), seed=1)
    y, mean, rstd = cupyln.layer_norm_fwd(x, g)
    assert mean.shape == (2, 3)
    y2, mean2, _ = cupyln.layer_norm_fwd(x, normalized_shape=(4, 5))
    assert mean2.shape == (2, 3)
    np.testing.assert_allclose(y2 * g, y, rtol=1e-5, atol=1e-5)
    dx, dg, db = cupyln.layer_norm_bwd(x, x, g, mean, rstd)
    assert dx.shape == x.shape and dg.shape == db.shape == (4, 5)
    y1, m1, _ = cupyln.layer_norm_fwd(_rand((7,)))  # a single row: 0-d statistics
    assert m1.shape == () and y1.shape == (7,)


def test_mixed_parameter_dtypes():
    x = _rand((3, 16), np.float16)
    g, b = _rand((16,), np.float16, 1), _rand((16,), np.float32, 2)
    y, _, _ = cupyln.layer_norm_fwd(x, g, b)
    ry, _, _ = ref.layer_norm_fwd(x, g, b)
    np.testing.assert_array_equal(y, ry.astype(np.float16))


# --------------------------------------------------------------------------- validation

X = _rand((4, 8))
G = _rand((8,), seed=1)
_, MEAN, RSTD = cupyln.layer_norm_fwd(X, G)

BAD_FWD = [
    (TypeError, "x must be", lambda: cupyln.layer_norm_fwd([[1.0, 2.0]])),
    (TypeError, "x must be", lambda: cupyln.layer_norm_fwd(None)),
    (TypeError, "x has dtype int32", lambda: cupyln.layer_norm_fwd(X.astype(np.int32))),
    (TypeError, "x has dtype complex64", lambda: cupyln.rms_norm_fwd(X.astype(np.complex64))),
    (TypeError, "gamma has dtype float64", lambda: cupyln.layer_norm_fwd(X, G.astype(np.float64))),
    (TypeError, "beta has dtype float16", lambda: cupyln.layer_norm_fwd(X, G, G.astype("f2"))),
    (TypeError, "gamma must be", lambda: cupyln.layer_norm_fwd(X, list(G))),
    (ValueError, r"gamma has shape \(7,\) but x", lambda: cupyln.layer_norm_fwd(X, _rand((7,)))),
    (ValueError, "trailing axes", lambda: cupyln.layer_norm_fwd(X, _rand((4, 8, 1)))),
    (ValueError, "beta has shape", lambda: cupyln.layer_norm_fwd(X, G, _rand((4,)))),
    (ValueError, "at least one axis", lambda: cupyln.layer_norm_fwd(np.array(1.0, np.float32))),
    (ValueError, "at least one element", lambda: cupyln.layer_norm_fwd(_rand((4, 0)))),
    (ValueError, "eps must be finite and >= 0", lambda: cupyln.layer_norm_fwd(X, eps=-1e-5)),
    (ValueError, "eps must be finite", lambda: cupyln.rms_norm_fwd(X, eps=float("nan"))),
    (ValueError, "eps must be finite", lambda: cupyln.rms_norm_fwd(X, eps=float("inf"))),
    (TypeError, "eps must be a real number", lambda: cupyln.layer_norm_fwd(X, eps="1e-5")),
    (TypeError, "eps must be a real number", lambda: cupyln.layer_norm_fwd(X, eps=True)),
    (ValueError, "normalized_shape has shape", lambda: cupyln.layer_norm_fwd(X, normalized_shape=3)),
    (ValueError, "gamma has shape", lambda: cupyln.layer_norm_fwd(X, G, normalized_shape=(4, 8))),
]

BAD_BWD = [
    (TypeError, "dy must be", lambda: cupyln.layer_norm_bwd(None, X, G, MEAN, RSTD)),
    (TypeError, "rstd must be", lambda: cupyln.layer_norm_bwd(X, X, G, MEAN, None)),
    (TypeError, "mean must be", lambda: cupyln.layer_norm_bwd(X, X, G, None, RSTD)),
    (TypeError, "dy has dtype float16", lambda: cupyln.layer_norm_bwd(X.astype("f2"), X, G, MEAN, RSTD)),
    (ValueError, "dy has shape", lambda: cupyln.layer_norm_bwd(X[:2], X, G, MEAN, RSTD)),
    (ValueError, "mean has dtype float64", lambda: cupyln.layer_norm_bwd(X, X, G, MEAN.astype("f8"), RSTD)),
    (ValueError, "rstd has dtype float16", lambda: cupyln.rms_norm_bwd(X, X, G, RSTD.astype("f2"))),
    (ValueError, "rstd has shape", lambda: cupyln.layer_norm_bwd(X, X, G, MEAN, RSTD[:3])),
    (ValueError, "mean has shape", lambda: cupyln.layer_norm_bwd(X, X, G, MEAN[:3], RSTD[:3])),
    (ValueError, "rstd has shape", lambda: cupyln.rms_norm_bwd(X, X, G, _rand((4, 8)))),
    (ValueError, "gamma has shape", lambda: cupyln.layer_norm_bwd(X, X, G[:4], MEAN, RSTD)),
    (TypeError, "gamma has dtype float64", lambda: cupyln.layer_norm_bwd(X, X, G.astype("f8"), MEAN, RSTD)),
    (TypeError, "need_dx must be a bool", lambda: cupyln.layer_norm_bwd(X, X, G, MEAN, RSTD, need_dx=1)),
    (TypeError, "deterministic must be a bool", lambda: cupyln.rms_norm_bwd(X, X, G, RSTD, deterministic="yes")),
]


@pytest.mark.parametrize("exc,msg,call", BAD_FWD + BAD_BWD)
def test_bad_input_raises_named_error(exc, msg, call):
    with pytest.raises(exc, match=msg):
        call()


def test_float32_parameters_accepted_for_16bit_data():
    x = _rand((2, 8), BF16)
    y, _, _ = cupyln.layer_norm_fwd(x, G, G)
    assert y.dtype == BF16
