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
    (ValueError, r"x has shape \(4, 0\), whose normalized part \(0,\) is empty", lambda: cupyln.layer_norm_fwd(_rand((4, 0)))),
    (TypeError, "gamma has dtype float16; expected float32, like x$", lambda: cupyln.layer_norm_fwd(X, G.astype("f2"))),
    (TypeError, r"gamma has dtype float64; expected float16 \(like x\) or float32$", lambda: cupyln.rms_norm_fwd(X.astype("f2"), G.astype("f8"))),
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


# --------------------------------------------------------------------------- out=


def test_out_receives_the_results_and_is_returned():
    x, dy = _rand((6, 8)), _rand((6, 8), seed=5)
    want = cupyln.layer_norm_fwd(x, G, G)
    out = (np.empty((6, 8), np.float32), None, np.empty(6, np.float32))
    got = cupyln.layer_norm_fwd(x, G, G, out=out)
    assert got[0] is out[0] and got[2] is out[2] and got[1].shape == (6,)
    for a, b in zip(got, want, strict=True):
        np.testing.assert_array_equal(a, b)
    mean, rstd = want[1], want[2]
    bw = cupyln.layer_norm_bwd(dy, x, G, mean, rstd)
    o = (np.empty((6, 8), np.float32), np.empty(8, np.float32), np.empty(8, np.float32))
    gb = cupyln.layer_norm_bwd(dy, x, G, mean, rstd, out=o)
    assert all(a is b for a, b in zip(gb, o, strict=True))
    for a, b in zip(gb, bw, strict=True):
        np.testing.assert_array_equal(a, b)
    y2, r2 = cupyln.rms_norm_fwd(x, G, out=(np.empty((6, 8), np.float32), None))
    d2, g2 = cupyln.rms_norm_bwd(dy, x, G, r2, out=(None, np.empty(8, np.float32)))
    np.testing.assert_array_equal(g2, cupyln.rms_norm_bwd(dy, x, G, r2)[1])


def _outs():
    return (np.full((4, 8), 7.0, np.float32), np.full(4, 7.0, np.float32),
            np.full(4, 7.0, np.float32))


BAD_OUT = [
    (TypeError, r"out must be None or a tuple of 3 entries \(y, mean, rstd\).* got tuple of 2", lambda o: cupyln.layer_norm_fwd(X, G, out=o[:2])),
    (TypeError, "out must be None or a tuple of 2 .* got ndarray$", lambda o: cupyln.rms_norm_fwd(X, G, out=o[0])),
    (TypeError, "out must be None or a tuple of 3 .* got list of 3$", lambda o: cupyln.layer_norm_fwd(X, G, out=list(o))),
    (TypeError, "out y has dtype float16", lambda o: cupyln.layer_norm_fwd(
        X, G, out=(o[0].astype("f2"), None, None))),
    (ValueError, r"out mean has shape \(3,\)", lambda o: cupyln.layer_norm_fwd(
        X, G, out=(None, o[1][:3], None))),
    (ValueError, "out y must be C-contiguous", lambda o: cupyln.layer_norm_fwd(
        X, G, out=(np.zeros((8, 4), np.float32).T, None, None))),
    (TypeError, "out rstd must be", lambda o: cupyln.layer_norm_fwd(X, G, out=(None, None, [0]))),
    (ValueError, "out y overlaps the input x", lambda o: cupyln.layer_norm_fwd(
        X, G, out=(X, None, None))),
    (ValueError, "out rstd overlaps out mean", lambda o: cupyln.layer_norm_fwd(
        X, G, out=(None, o[1], o[1]))),
    (ValueError, "out dgamma was given, but dgamma is not computed", lambda o: cupyln.layer_norm_bwd(
        X, X, None, MEAN, RSTD, out=(None, np.zeros(8, np.float32), None))),
    (ValueError, "out dx was given, but dx is not computed", lambda o: cupyln.rms_norm_bwd(
        X, X, G, RSTD, need_dx=False, out=(o[0], None))),
    (ValueError, "eps must be finite", lambda o: cupyln.layer_norm_fwd(X, G, eps=-1.0, out=o)),
]


@pytest.mark.parametrize("exc,msg,call", BAD_OUT)
def test_bad_out_raises_and_writes_nothing(exc, msg, call):
    o = _outs()
    with pytest.raises(exc, match=msg):
        call(o)
    assert all((a == 7.0).all() for a in o)


X64 = _rand((8, 64), seed=3)

BAD_USER = [  # the messages name the argument that is wrong
    (ValueError, r"gamma has shape \(63,\) but x",
     lambda: cupyln.layer_norm_fwd(X64, _rand((63,)), _rand((64,)))),
    (ValueError, r"mean has shape \(9,\)",
     lambda: cupyln.layer_norm_bwd(X64, X64, None, np.zeros(9, np.float32),
                                   np.ones(8, np.float32))),
    (TypeError, "normalized_shape must be an int or a tuple of ints, got str",
     lambda: cupyln.layer_norm_fwd(X64, normalized_shape="abc")),
    (TypeError, "normalized_shape must hold ints",
     lambda: cupyln.layer_norm_fwd(X64, normalized_shape=(64.0,))),
    (TypeError, "byte order other than the machine's",
     lambda: cupyln.layer_norm_fwd(X64.astype(X64.dtype.newbyteorder("S")))),
]


@pytest.mark.parametrize("exc,msg,call", BAD_USER)
def test_bad_input_names_the_argument(exc, msg, call):
    with pytest.raises(exc, match=msg):
        call()


def test_read_only_out_is_refused_before_any_output_is_written():
    y = np.full(X64.shape, 7, np.float32)
    mean = np.full(8, 7, np.float32)
    rstd = np.full(8, 7, np.float32)
    rstd.flags.writeable = False
    with pytest.raises(ValueError, match="out rstd is read-only"):
        cupyln.layer_norm_fwd(X64, out=(y, mean, rstd))
    assert (y == 7).all() and (mean == 7).all()


def test_eps_zero_on_a_constant_row_is_documented_and_quiet():
    import warnings

    x = np.ones((2, 16), np.float32)
    x[1] = np.arange(16)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        y, mean, rstd = cupyln.layer_norm_fwd(x, eps=0.0)
        dx, _, _ = cupyln.layer_norm_bwd(np.ones_like(x), x, None, mean, rstd)
    assert np.isinf(rstd[0]) and np.isnan(y[0]).all()  # 0 * inf: as the docstring says
    assert np.isfinite(y[1]).all() and np.isfinite(dx[1]).all()  # other rows untouched


@pytest.mark.parametrize("M,N", [(37, 100), (5, 3000), (1, 7)])
def test_numpy_path_in_blocks_equals_the_reference(monkeypatch, M, N):
    from cupyln import _numpy_path

    monkeypatch.setattr(_numpy_path, "BLOCK_BYTES", 8 * N * 2)  # two rows per block
    x, dy, g, b = (_rand(s, seed=i) for i, s in enumerate([(M, N), (M, N), (N,), (N,)]))
    y, mean, rstd = cupyln.layer_norm_fwd(x, g, b)
    ry, rm, rr = ref.layer_norm_fwd(x, g, b)
    np.testing.assert_allclose(y, ry, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(mean, rm, rtol=1e-6, atol=1e-6)
    dx, dg, db = cupyln.layer_norm_bwd(dy, x, g, mean, rstd)
    rdx, rdg, rdb = ref.layer_norm_bwd(dy, x, g, mean, rstd)
    for a, w in ((dx, rdx), (dg, rdg), (db, rdb)):
        np.testing.assert_allclose(a, w, rtol=1e-4, atol=1e-4)


def test_docstring_examples_run():
    import doctest

    from cupyln import api

    result = doctest.testmod(api, optionflags=doctest.NORMALIZE_WHITESPACE)
    assert result.attempted >= 4 and result.failed == 0


@pytest.mark.parametrize("rows,field,msg", [
    (dict(fwd_npt=0), "fwd_npt", "at least 1, got 0"),
    (dict(fwd_tpr_max=100), "fwd_tpr_max", "a multiple of 64, got 100"),
    (dict(fwd_tpr_max=2048), "fwd_tpr_max", "from 64 to 1024"),
    (dict(fwd_block=2048), "fwd_block", "from 1 to 1024, got 2048"),
    (dict(fwd_cluster_tiles=32), "fwd_cluster_tiles", "from 0 to 16, got 32"),
    (dict(bwd_npt_min=2, bwd_npt=1), "bwd_npt", "at least 2, got 1"),
    (dict(bwd_tile_tpr=96), "bwd_tile_tpr", "a multiple of 64, got 96"),
    (dict(bwd_csum_blocks=17), "bwd_csum_blocks", "from 0 to 16, got 17"),
    (dict(bwd_cluster_split_rows=-1), "bwd_cluster_split_rows", "at least 0, got -1"),
    (dict(fwd_parts_rows=float("nan")), "fwd_parts_rows", "at least 0, got nan")])
def test_configs_the_kernels_cannot_launch_are_refused_when_made(rows, field, msg):
    """A planner row outside what the kernels launch (block threads, counts, cluster sizes)
    raises a ValueError naming the row when the config is made, before any plan; the
    defaults and the rows' edges are accepted."""
    with pytest.raises(ValueError, match=rf"Config\.tuning: row {field} must be .*{msg}"):
        cupyln.Config(tuning=rows)
    cupyln.Config(tuning=dict(fwd_tpr_max=64, fwd_block=1, fwd_cluster_tiles=16,
                              fwd_parts_rows=0, bwd_tile_tpr=1024, bwd_npt_min=2, bwd_npt=2,
                              bwd_csum_blocks=0, bwd_cluster_split_rows=0))


@pytest.mark.parametrize("kwargs,error,msg", [
    (dict(stage="sometimes"), ValueError, "Config.stage must be one of"),
    (dict(cluster=1), TypeError, "Config.cluster must be a bool, got 1"),
    (dict(tuning=dict(fwd_nothing=1)), ValueError, "names no planner row: .'fwd_nothing'."),
    (dict(tuning=dict(fwd_npt=2.0)), TypeError, "tuning.'fwd_npt'. must be int, got 2.0"),
    (dict(tuning=dict(fwd_full=0)), TypeError, "tuning.'fwd_full'. must be bool, got 0"),
    (dict(tuning=[1, 2]), TypeError, "Config.tuning must be a dict")])
def test_config_switches_and_rows_of_the_wrong_kind_are_refused(kwargs, error, msg):
    """A stage not listed, a switch that is not a bool, a row the tables do not have or a value
    of another type than the row's: refused when the config is made."""
    with pytest.raises(error, match=msg):
        cupyln.Config(**kwargs)


def test_config_is_hashable_and_its_rows_order_free():
    """Equal rows in any order make equal, equally hashed configs (the plan caches' keys)."""
    a = cupyln.Config(tuning={"fwd_npt": 2, "bwd_npt": 4})
    b = cupyln.Config(tuning={"bwd_npt": 4, "fwd_npt": 2})
    assert a == b and hash(a) == hash(b) and a != cupyln.Config()
