"""Float8 outputs on the GPU against the NumPy path (the float64 reference quantized), and into
torch._scaled_mm (marked `gpu`)."""

import ml_dtypes
import numpy as np
import pytest
from gpu_cases import BF16, F16, F32, F64, host

import cupyln
from cupyln import _plan, reference

cp = pytest.importorskip("cupy")
pytestmark = pytest.mark.gpu

E4M3, E5M2 = np.dtype(ml_dtypes.float8_e4m3fn), np.dtype(ml_dtypes.float8_e5m2)
F8 = {"float8_e4m3fn": E4M3, "float8_e5m2": E5M2}


def _codes(q):
    """Float8 bits (uint8) as signed integers ordered as the values (+-0 both 0)."""
    q = q.astype(np.int32)
    return np.where(q & 0x80, -(q & 0x7F), q)


def _run(op, M, N, dt, f8, static, residual, seed=0):
    """The GPU's outputs, the NumPy path's, and the reference's y in float64 (host arrays)."""
    x = host((M, N), dt, seed, 0.7, 0.3)
    g = host((N,), dt, seed + 1, 0.3, 1.0)
    b = host((N,), dt, seed + 2, 0.2)
    r = host((M, N), dt, seed + 3, 0.5) if residual else None
    s = np.array([0.02], np.float32) if static else None
    fn, args = (cupyln.layer_norm_fwd, (x, g, b)) if op == "ln" else (cupyln.rms_norm_fwd,
                                                                       (x, g))
    kw = dict(residual=r, y_dtype=f8, y_scale=s)
    want = fn(*args, **kw)
    gpu = fn(*(cp.asarray(a) for a in args), **{k: None if v is None else
                                                (cp.asarray(v) if isinstance(v, np.ndarray)
                                                 else v) for k, v in kw.items()})
    rows = want[-1] if residual else x  # h as stored (x's dtype), normalized
    f64 = [a.astype(np.float64) for a in (rows, *args[1:])]
    y64 = (reference.layer_norm_fwd if op == "ln" else reference.rms_norm_fwd)(*f64)[0]
    return [a.get() for a in gpu], want, y64


def _code_bounds(y64, scale, f8, err):
    """The float8 codes of (y64 - err) / scale and (y64 + err) / scale: where a y within err
    of y64 quantizes to, per element (``scale`` per row or one)."""
    def codes(v):
        q, _ = reference.quantize(v / np.reshape(scale, (-1, 1)), f8, np.float32(1))
        return _codes(q.view(np.uint8))

    return codes(y64 - err), codes(y64 + err)


@pytest.mark.parametrize("op", ["ln", "rms"])
@pytest.mark.parametrize("f8", list(F8))
@pytest.mark.parametrize("static", [False, True], ids=["per-row", "static"])
@pytest.mark.parametrize("dt", [F16, BF16, F32, F64], ids=str)
@pytest.mark.parametrize("M,N,residual", [(1000, 4096, False), (37, 768, True), (5, 33, False),
                                          (300, 8192, False), (2, 32768 // 2, True)])
def test_float8_outputs_match_the_reference_within_float32s_error(op, f8, static, dt, M, N,
                                                                  residual):
    """y_q equal to the NumPy path's bits nearly everywhere (where the kernel's float32 y rounds
    as the reference's), and everywhere between the codes of the float64 y -+ float32's error
    (relative to the row's largest |y|: near 0, where x - mean cancels, e5m2's range resolves
    that error into many codes); the scales or the amax and the statistics within float32's
    error, h bit for bit."""
    if N * np.dtype(dt).itemsize > 16 * 4 * _plan.QUANT_THREADS:  # (N even: 16-byte vectors)
        pytest.skip("longer than a row one block holds")
    got, want, y64 = _run(op, M, N, dt, f8, static, residual)
    stats = 2 if op == "ln" else 1
    assert got[0].dtype == np.uint8 and got[0].shape == (M, N)
    code = _codes(got[0])
    assert (code != _codes(want[0].view(np.uint8))).mean() < 0.01
    scale = want[1 + stats] if not static else np.float32(0.02)
    err = 1e-5 * np.abs(y64).max(axis=1, keepdims=True)
    lo, hi = _code_bounds(y64, scale, F8[f8], err)
    assert ((lo <= code) & (code <= hi)).all(), np.argwhere((code < lo) | (code > hi))[:5]
    tol = 1e-6 if dt == F64 else 1e-5  # the kernel's float32 statistics against float64's
    np.testing.assert_allclose(got[1 + stats], want[1 + stats], rtol=tol)
    for a, w in zip(got[1 : 1 + stats], want[1 : 1 + stats], strict=True):
        np.testing.assert_allclose(a, w, rtol=tol, atol=tol)
    if residual:
        assert np.array_equal(got[-1], want[-1])


@pytest.mark.parametrize("f8", list(F8))
@pytest.mark.parametrize("bad", [0.0, -1.0, np.inf, np.nan])
def test_a_device_scale_that_is_not_finite_and_positive_gives_nan(bad, f8):
    """A CuPy y_scale is not read back: where it is not finite and above 0, every element of y_q
    is NaN with the bits the NumPy path writes for a NaN quotient (ml_dtypes' of float32's NaN;
    the NumPy path refuses such a scale before any work), never a silently scaled y; amax is still
    y's."""
    xh = host((64, 1024), BF16, 0)
    x = cp.asarray(xh)
    yq, mean, rstd, amax = cupyln.layer_norm_fwd(x, y_dtype=f8,
                                                 y_scale=cp.array([bad], cp.float32))
    with pytest.raises(ValueError, match="y_scale"):
        cupyln.layer_norm_fwd(xh, y_dtype=f8, y_scale=np.array([bad], np.float32))
    want = np.full(xh.shape, np.nan, np.float32).astype(F8[f8]).view(np.uint8)
    assert np.array_equal(yq.get(), want)
    y, _, _ = cupyln.layer_norm_fwd(x)
    assert float(amax[0]) == pytest.approx(float(cp.abs(y.astype(cp.float32)).max()), rel=1e-2)


@pytest.mark.parametrize("op", ["ln", "rms"])
@pytest.mark.parametrize("f8", list(F8))
@pytest.mark.parametrize("static", [False, True], ids=["per-row", "static"])
@pytest.mark.parametrize("wdt", [BF16, F32], ids=str)
@pytest.mark.parametrize("N", [1024, 1023])
def test_nans_keep_the_numpy_paths_bits(op, f8, static, wdt, N):
    """A NaN in x (its whole row NaN) and in gamma (its column NaN): those codes are the NumPy
    path's NaN bits (ml_dtypes', e5m2's 0x7e), the scales are the other elements' (NaN
    ignored: 1 for a row of NaNs), and the rest match as in the test above."""
    x = host((64, N), BF16, 0, 0.7, 0.3)
    g = host((N,), BF16, 1, 0.3, 1.0).astype(wdt)
    b = host((N,), BF16, 2, 0.2).astype(wdt)
    x[3, 5] = g[7] = np.nan
    fn, args = (cupyln.layer_norm_fwd, (x, g, b)) if op == "ln" else (cupyln.rms_norm_fwd,
                                                                       (x, g))
    s = np.array([0.02], np.float32) if static else None
    want = fn(*args, y_dtype=f8, y_scale=s)
    got = [a.get() for a in fn(*map(cp.asarray, args), y_dtype=f8,
                               y_scale=None if s is None else cp.asarray(s))]
    nan = np.isnan(want[0].astype(np.float32))
    assert nan[3].all() and nan[:, 7].all() and nan.sum() == N + 63
    assert np.array_equal(got[0][nan], want[0].view(np.uint8)[nan])
    assert (_codes(got[0][~nan]) != _codes(want[0].view(np.uint8)[~nan])).mean() < 0.01
    np.testing.assert_allclose(got[-1], want[-1], rtol=1e-5)


def test_rows_one_block_does_not_hold_are_refused_before_any_work():
    x = cp.ones((4, 40000), cp.float16)
    out = (cp.full((4, 40000), 7, cp.uint8), None, None, None)
    with pytest.raises(ValueError, match="rows that one block holds"):
        cupyln.layer_norm_fwd(x, y_dtype="float8_e4m3fn", out=out)
    assert (out[0] == 7).all()


def test_row_scales_feed_torch_scaled_mm():
    """cupyln.torch's float8 LayerNorm and its per-row scales into torch._scaled_mm (row-wise
    scales, sm_89 on) against the bfloat16 matmul of the unquantized y: within float8's error;
    and its bits are the array API's on the same input."""
    torch = pytest.importorskip("torch")
    import cupyln.torch as ct

    if torch.cuda.get_device_capability() < (8, 9):
        pytest.skip("float8 matmuls need sm_89 or later")
    M, K, Nout = 256, 1024, 512
    x = torch.randn(M, K, device="cuda", dtype=torch.bfloat16)
    yq, scale = ct.layer_norm_fp8(x, K)
    arr = cupyln.layer_norm_fwd(cp.from_dlpack(x.view(torch.int16)).view(BF16),
                                y_dtype="float8_e4m3fn")
    assert torch.equal(yq.view(torch.uint8), torch.from_dlpack(arr[0]))
    w = torch.randn(Nout, K, device="cuda", dtype=torch.bfloat16)
    w_scale = w.abs().amax(dim=1, keepdim=True).float() / 448.0
    wq = (w / w_scale).to(torch.float8_e4m3fn)
    got = torch._scaled_mm(yq, wq.t(), scale_a=scale[:, None], scale_b=w_scale.t(),
                           out_dtype=torch.bfloat16)
    want = torch.nn.functional.layer_norm(x, (K,)) @ w.t()
    err = (got.float() - want.float()).norm() / want.float().norm()
    assert err < 0.1, float(err)
