"""Float8 outputs on the NumPy path: the reference's quantization, its properties, the API's
checks. (The kernels' conversion is checked against ml_dtypes in test_compile.py; their
outputs against this path in test_gpu_float8.py.)"""

import ml_dtypes
import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st
from strategies import DTYPES, shapes, values

import cupyln
from cupyln import reference as ref

E4M3, E5M2 = np.dtype(ml_dtypes.float8_e4m3fn), np.dtype(ml_dtypes.float8_e5m2)
FMAX = {E4M3: 448.0, E5M2: 57344.0}
F8 = st.sampled_from([E4M3, E5M2])


def _step(q, dtype):
    """The spacing of float8 ``dtype`` values at each |q| (subnormal spacing below its normals)."""
    fi = ml_dtypes.finfo(dtype)
    e = np.floor(np.log2(np.maximum(np.abs(q), float(fi.tiny))))
    return np.maximum(2.0 ** (e - fi.nmant), float(fi.smallest_subnormal))


@given(shapes(max_elems=4000), F8, st.data())
def test_dynamic_scales_put_each_rows_largest_value_at_fmax(shape, f8, data):
    """Each row's scale is its largest |y| over fmax; that element quantizes to +-fmax, every
    element to within half a float8 step of y / scale, none past fmax."""
    y = data.draw(values(shape, np.float64)).reshape(shape)
    q, scale = ref.quantize(y, f8)
    y32 = y.astype(np.float32)
    amax = np.abs(y32).max(axis=1, initial=0)
    want = np.where(amax == 0, 1, amax / np.float32(FMAX[f8])).astype(np.float32)
    assert scale.dtype == np.float32 and np.array_equal(scale, want)
    qf = q.astype(np.float64)
    assert np.all(np.abs(qf) <= FMAX[f8])
    exact = y32.astype(np.float64) / scale[:, None].astype(np.float64)
    assert np.all(np.abs(qf - exact) <= 0.5 * _step(qf, f8) + 1e-6 * np.abs(exact))
    top = amax > 0
    assert np.all(np.abs(qf[top]).max(axis=1) == FMAX[f8])


@given(shapes(max_elems=4000), F8, st.floats(1 / 8192, 10.0, width=32), st.data())
def test_static_scale_saturates_and_returns_the_amax(shape, f8, s, data):
    """One scale for all: y / s rounded to nearest even, saturated at +-fmax (no NaN from
    overflow); the returned amax is the largest |y| of all rows, before scaling."""
    y = data.draw(values(shape, np.float64, scale=data.draw(st.floats(0.1, 1e5)))).reshape(shape)
    q, amax = ref.quantize(y, f8, np.float32(s))
    y32 = y.astype(np.float32)
    assert amax == np.abs(y32).max(initial=0) and amax.dtype == np.float32
    want = np.clip(y32 / np.float32(s), -FMAX[f8], FMAX[f8]).astype(f8)
    assert np.array_equal(q.view(np.uint8), want.view(np.uint8))
    assert not np.isnan(q.astype(np.float32)).any()


@pytest.mark.parametrize("f8", [E4M3, E5M2])
def test_nan_stays_in_its_element_zero_rows_scale_by_one(f8):
    """NaN in y is NaN in y_q and ignored by the amax; an all-zero row has scale 1 and zeros;
    an all-NaN row has scale 1; a bad static scale makes every element NaN."""
    y = np.array([[1.0, np.nan, -2.0], [0.0, -0.0, 0.0], [np.nan] * 3])
    q, scale = ref.quantize(y, f8)
    qf = q.astype(np.float32)
    assert np.isnan(qf[0, 1]) and qf[0, 2] == -FMAX[f8] and qf[0, 0] == FMAX[f8] / 2
    assert list(scale[1:]) == [1.0, 1.0] and not qf[1].any() and np.isnan(qf[2]).all()
    assert scale[0] == np.float32(2.0) / np.float32(FMAX[f8])
    for bad in (0.0, -1.0, np.inf, np.nan):
        q, amax = ref.quantize(y, f8, np.float32(bad))
        assert np.isnan(q.astype(np.float32)).all() and amax == 2.0


@given(shapes(max_elems=3000), st.sampled_from(DTYPES), F8, st.booleans(), st.booleans(),
       st.data())
def test_numpy_path_quantizes_the_references_y(shape, dtype, f8, is_ln, static, data):
    """layer_norm_fwd / rms_norm_fwd with y_dtype: the statistics as without it, y_q and the
    scale (or amax) those of the reference's y quantized, in that order, h last."""
    M, N = shape
    x = data.draw(values((M, N), dtype))
    g = data.draw(values((N,), dtype))
    r = data.draw(values((M, N), dtype)) if data.draw(st.booleans()) else None
    s = np.array([data.draw(st.floats(1e-3, 1.0))], np.float32) if static else None
    fn = cupyln.layer_norm_fwd if is_ln else cupyln.rms_norm_fwd
    args = (x, g, g) if is_ln else (x, g)
    plain = fn(*args, residual=r)
    got = fn(*args, residual=r, y_dtype=f8.name, y_scale=s)
    stats = 2 if is_ln else 1
    assert len(got) == len(plain) + 1 and got[0].dtype == f8 and got[0].shape == x.shape
    for a, b in zip(got[1 : 1 + stats] + got[2 + stats :], plain[1:], strict=True):
        assert np.array_equal(a, b)
    want = ref.layer_norm_fwd(x, g, g, residual=r) if is_ln else ref.rms_norm_fwd(x, g,
                                                                                  residual=r)
    q, sc = ref.quantize(want[0].reshape(M, N), f8, None if s is None else s[0])
    assert np.array_equal(got[0].view(np.uint8), q.view(np.uint8))
    assert np.array_equal(got[1 + stats].reshape(-1), np.reshape(sc, -1))
    assert got[1 + stats].shape == ((M,) if s is None else s.shape)


def test_out_takes_the_float8_output_and_the_scales():
    """out= holds y_q in its float8 dtype and the scales after the statistics; the same values
    come back as without out=."""
    x = np.random.default_rng(1).standard_normal((6, 40)).astype(np.float32)
    want = cupyln.rms_norm_fwd(x, y_dtype="float8_e5m2")
    out = (np.empty(x.shape, E5M2), np.empty(6, np.float32), np.empty(6, np.float32))
    got = cupyln.rms_norm_fwd(x, y_dtype=E5M2, out=out)
    assert all(a is b for a, b in zip(got, out, strict=True))
    assert all(np.array_equal(a.view(np.uint8) if a.dtype == E5M2 else a,
                              b.view(np.uint8) if b.dtype == E5M2 else b)
               for a, b in zip(got, want, strict=True))


def test_y_dtype_of_x_or_none_is_the_plain_forward():
    x = np.ones((2, 4), np.float32)
    for y_dtype in (None, np.float32, "float32"):
        assert len(cupyln.layer_norm_fwd(x, y_dtype=y_dtype)) == 3


_X = np.ones((2, 4), np.float32)
_S = np.array([0.5], np.float32)


@pytest.mark.parametrize("exc,msg,kw", [
    (TypeError, "y_dtype must be 'float8_e4m3fn' or 'float8_e5m2'", dict(y_dtype="int8")),
    (TypeError, "y_dtype must be", dict(y_dtype=np.float16)),
    (TypeError, "y_dtype must be", dict(y_dtype="float8_e4m3")),
    (TypeError, "y_dtype must be", dict(y_dtype=3)),
    (ValueError, "y_scale was given but y_dtype is not a float8", dict(y_scale=_S)),
    (ValueError, "y_scale was given but y_dtype is not a float8",
     dict(y_dtype=np.float32, y_scale=_S)),
    (ValueError, "float32 array of one element, got dtype float64",
     dict(y_dtype="float8_e4m3fn", y_scale=np.array([0.5]))),
    (ValueError, r"one element, got dtype float32 and shape \(2,\)",
     dict(y_dtype="float8_e4m3fn", y_scale=np.ones(2, np.float32))),
    (ValueError, "finite and above 0, got -1.0",
     dict(y_dtype="float8_e4m3fn", y_scale=np.array([-1.0], np.float32))),
    (ValueError, "finite and above 0, got 0.0",
     dict(y_dtype="float8_e4m3fn", y_scale=np.zeros(1, np.float32))),
    (ValueError, "finite and above 0, got nan",
     dict(y_dtype="float8_e4m3fn", y_scale=np.array([np.nan], np.float32))),
    (ValueError, "finite and above 0, got inf",
     dict(y_dtype="float8_e5m2", y_scale=np.array([np.inf], np.float32))),
    (TypeError, "y_scale must be a numpy.ndarray or cupy.ndarray, got float",
     dict(y_dtype="float8_e5m2", y_scale=0.5)),
    (cupyln.OutDtypeError, "out y has dtype float32; expected float8_e4m3fn",
     dict(y_dtype="float8_e4m3fn", out=(np.empty((2, 4), np.float32), None, None, None))),
    (ValueError, r"out amax has shape \(2,\); expected \(1,\)",
     dict(y_dtype="float8_e4m3fn", y_scale=_S,
          out=(None, None, None, np.empty(2, np.float32)))),
])
def test_bad_float8_arguments_raise_before_any_work(exc, msg, kw):
    with pytest.raises(exc, match=msg):
        cupyln.layer_norm_fwd(_X, **kw)


@pytest.mark.parametrize("caught", [TypeError, ValueError])
def test_a_wrong_out_dtype_is_caught_as_a_type_or_a_value_error(caught):
    y = np.zeros((2, 4), np.uint8)  # a float8's bits, but not its dtype on NumPy
    with pytest.raises(caught, match="out y has dtype uint8; expected float8_e5m2"):
        cupyln.rms_norm_fwd(_X, y_dtype="float8_e5m2", out=(y, None, None))
    assert not y.any()


def test_torch_functions_return_float8_tensors_and_their_scales():
    """cupyln.torch's float8 functions (CPU tensors: the NumPy path) give the array API's bits
    as torch float8 tensors, the scales as float32 tensors, h last; they refuse to record
    gradients and take only torch's float8 dtypes."""
    torch = pytest.importorskip("torch")
    import cupyln.torch as ct

    x = torch.randn(6, 96, dtype=torch.bfloat16)
    w, r = torch.randn(96, dtype=torch.bfloat16), torch.randn(6, 96, dtype=torch.bfloat16)
    xa, wa, ra = (t.view(torch.int16).numpy().view(ml_dtypes.bfloat16) for t in (x, w, r))
    y, scale, h = ct.rms_norm_fp8(x, 96, w, 1e-6, y_dtype=torch.float8_e5m2, residual=r)
    want = cupyln.rms_norm_fwd(xa, wa, 1e-6, residual=ra, y_dtype="float8_e5m2")
    assert y.dtype == torch.float8_e5m2 and scale.dtype == torch.float32
    assert np.array_equal(y.view(torch.uint8).numpy(), want[0].view(np.uint8))
    assert np.array_equal(scale.numpy(), want[2])
    assert np.array_equal(h.view(torch.int16).numpy(), want[3].view(np.int16))
    s = torch.tensor([0.05])
    y, amax = ct.layer_norm_fp8(x, (96,), w, None, y_scale=s)
    want = cupyln.layer_norm_fwd(xa, wa, None, y_dtype="float8_e4m3fn", y_scale=s.numpy())
    assert np.array_equal(y.view(torch.uint8).numpy(), want[0].view(np.uint8))
    assert amax.shape == (1,) and float(amax) == float(want[3][0])
    with pytest.raises(TypeError, match="torch.float8_e4m3fn or torch.float8_e5m2"):
        ct.layer_norm_fp8(x, 96, y_dtype=torch.float16)
    with pytest.raises(RuntimeError, match="carry no gradient"):
        ct.layer_norm_fp8(x.clone().requires_grad_(), 96)
    with torch.no_grad():
        assert ct.layer_norm_fp8(x.clone().requires_grad_(), 96)[0].dtype == torch.float8_e4m3fn


def test_modules_quantize_with_their_own_parameters():
    """A module's forward_fp8 is the float8 function with the module's weight, bias, eps and
    weight offset (the fused-add modules' residual dtype too), under torch.no_grad()."""
    torch = pytest.importorskip("torch")
    import cupyln.torch as ct

    x, r = torch.randn(5, 48), torch.randn(5, 48)
    ln, rms = ct.LayerNorm(48, eps=1e-3), ct.FusedAddRMSNorm(48, weight_offset=1.0)
    with torch.no_grad():
        ln.weight.uniform_(), ln.bias.uniform_(), rms.weight.uniform_()
        got = ln.forward_fp8(x)
        want = ct.layer_norm_fp8(x, 48, ln.weight, ln.bias, 1e-3)
        assert all(torch.equal(a.view(torch.uint8) if a.dtype == torch.float8_e4m3fn else a,
                               b.view(torch.uint8) if b.dtype == torch.float8_e4m3fn else b)
                   for a, b in zip(got, want, strict=True))
        y, scale, h = rms.forward_fp8(x, r, y_dtype=torch.float8_e5m2)
        want = ct.rms_norm_fp8(x, 48, rms.weight, y_dtype=torch.float8_e5m2, residual=r,
                               weight_offset=1.0)
        assert torch.equal(y.view(torch.uint8), want[0].view(torch.uint8))
        assert torch.equal(scale, want[1]) and torch.equal(h, x + r)
    with pytest.raises(RuntimeError, match="carry no gradient"):
        ln.forward_fp8(x)
