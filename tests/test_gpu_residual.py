"""The fused residual add and the weight offset on the GPU, against the float64 reference, over
dtypes, geometries and the backward's variants (marked `gpu`)."""

import numpy as np
import pytest
from gpu_cases import (
    BF16,
    F16,
    F32,
    F64,
    LAYOUTS,
    PAIRS,
    PEEL_FEW,
    assert_close,
    host,
    padded,
)
from hypothesis import given
from hypothesis import strategies as st
from strategies import BOUNDARY_N

import cupyln
from cupyln import reference as ref
from cupyln._dtypes import VEC, tuned
from cupyln.check import dweight_floors, dx_floor

cp = pytest.importorskip("cupy")
pytestmark = pytest.mark.gpu


def run_fused(op, M, N, dt, wdt, hdt=None, *, rdt=None, offset=0.0, layout=lambda a: a,
              config=None, deterministic=False, has_g=True, seed=0):
    """Forward with a residual and backward with dresidual on the GPU against the reference: h
    bit for bit (one rounding of the exact sum, as the reference), the rest within tolerance.
    Returns the plans' outputs (y, h, dx, dgamma) as CuPy arrays."""
    H = hdt or dt
    x_h = host((M, N), dt, seed, 0.5, -2.3)
    r_h = host((M, N), rdt or H, seed + 1, 0.5, 1.0)
    dy_h = host((M, N), H, seed + 2, 0.1)
    dr_h = host((M, N), H, seed + 3, 0.1)
    g_h = host((N,), wdt, seed + 4, 0.2, 1.0 - offset) if has_g else None
    b_h = host((N,), wdt, seed + 5, 0.2) if op == "ln" else None
    x, r = layout(cp.asarray(x_h)), layout(cp.asarray(r_h))
    dy, dr = layout(cp.asarray(dy_h)), layout(cp.asarray(dr_h))
    g = None if g_h is None else cp.asarray(g_h)
    kw = {"residual": r, "residual_dtype": hdt, "weight_offset": offset, "config": config}
    if op == "ln":
        y, mean, rstd, h = cupyln.layer_norm_fwd(x, g, cp.asarray(b_h), 1e-5, **kw)
        ry, rm, rr, rh = ref.layer_norm_fwd(x_h, g_h, b_h, 1e-5, residual=r_h,
                                            residual_dtype=hdt, weight_offset=offset)
        assert_close(mean, rm, "mean")
    else:
        y, rstd, h = cupyln.rms_norm_fwd(x, g, 1e-6, **kw)
        mean = None
        ry, rr, rh = ref.rms_norm_fwd(x_h, g_h, 1e-6, residual=r_h, residual_dtype=hdt,
                                      weight_offset=offset)
    assert (y.dtype, h.dtype, h.shape) == (dt, H, x.shape) and h.flags.c_contiguous
    np.testing.assert_array_equal(h.get(), rh.astype(H))
    assert_close(y, ry, "y")
    assert_close(rstd, rr, "rstd")
    bkw = {"dresidual": dr, "weight_offset": offset, "deterministic": deterministic,
           "config": config}
    if g is not None and g.dtype not in (H, F32):  # 16-bit gamma of a float32 h: as float32
        g = g.astype(F32)
    if op == "ln":
        dx, dg, db = cupyln.layer_norm_bwd(dy, h, g, mean, rstd, **bkw)
    else:
        (dx, dg), db = cupyln.rms_norm_bwd(dy, h, g, rstd, **bkw), None
    m_h = None if mean is None else mean.get()
    rdx, rdg, rdb = ref._norm_bwd(dy_h, h.get(), g_h, m_h, rstd.get(), dr_h, offset)
    assert dx.dtype == H
    g_eff = None if g_h is None else g_h.astype(np.float64) + offset
    assert_close(dx, rdx, "dx", dx_floor(dy_h, g_eff, rstd) + np.abs(dr_h).max(initial=0))
    floors = dweight_floors(dy_h, h, mean, rstd)
    if dg is not None:
        assert_close(dg, rdg, "dgamma", floors[0])
    if db is not None:
        assert_close(db, rdb, "dbeta", floors[1])
    return y, h, dx, dg


H_PAIRS = [(dt, wdt, hdt) for dt, wdt in PAIRS for hdt in ([None, F32] if dt.itemsize == 2
                                                           else [None])]


@pytest.mark.parametrize("op", ["ln", "rms"])
@pytest.mark.parametrize("dt,wdt,hdt", H_PAIRS)
@pytest.mark.parametrize("N", [64, 1000, 4096, 12288, 65536])
def test_fused_add_dtypes_and_row_lengths(op, dt, wdt, hdt, N):
    """Rows of one chunk and of several (65536), every dtype pair, h in x's dtype or float32."""
    run_fused(op, 67, N, dt, wdt, hdt)


@pytest.mark.parametrize("op", ["ln", "rms"])
@pytest.mark.parametrize("M,N", [(m, n) for n in BOUNDARY_N for m in (1, 37)]
                         + [(0, 64), (65537, 129), (2, 300000), (4096, 1024)])
def test_fused_add_sizes(op, M, N):
    dt, wdt = PAIRS[(M + N) % len(PAIRS)]
    run_fused(op, M, N, dt, wdt, F32 if dt.itemsize == 2 and N % 2 else None)


@pytest.mark.parametrize("layout", LAYOUTS, ids=list(LAYOUTS))
def test_fused_add_layouts(layout):
    """Strided and misaligned x, residual, dy and dresidual (h is always C-contiguous)."""
    run_fused("ln", 45, 760, BF16, F32, F32, layout=LAYOUTS[layout])
    run_fused("rms", 45, 1024, F16, F16, layout=LAYOUTS[layout])


def test_residual_in_x_dtype_with_a_float32_stream():
    """A bfloat16 residual summed into a float32 h (the first layer of a float32 stream)."""
    run_fused("ln", 33, 2048, BF16, F32, F32, rdt=BF16)


@pytest.mark.parametrize("op", ["ln", "rms"])
@pytest.mark.parametrize("offset", [1.0, -0.25])
@pytest.mark.parametrize("N", [64, 4096, 65536])
def test_weight_offset(op, offset, N):
    """gamma + offset forward and backward, with and without a residual; the same outputs as
    an explicit gamma + offset (float32 parameters: the kernels add in float32)."""
    run_fused(op, 300, N, BF16, F32, offset=offset)
    x = cp.asarray(host((300, N), F16, 7, 0.5, 1.0))
    g = cp.asarray(host((N,), F32, 8, 0.2))
    fn = cupyln.layer_norm_fwd if op == "ln" else cupyln.rms_norm_fwd
    got = fn(x, g, weight_offset=offset)
    want = fn(x, g + np.float32(offset))
    for a, b in zip(got, want, strict=True):
        cp.testing.assert_array_equal(a, b)
    dy = cp.asarray(host((300, N), F16, 9, 0.1))
    bwd = cupyln.layer_norm_bwd if op == "ln" else cupyln.rms_norm_bwd
    dx, dg, *_ = bwd(dy, x, g, *got[1:], weight_offset=offset, deterministic=True)
    dx2, dg2, *_ = bwd(dy, x, g + np.float32(offset), *got[1:], deterministic=True)
    cp.testing.assert_array_equal(dx, dx2)
    cp.testing.assert_array_equal(dg, dg2)


@pytest.mark.parametrize("op", ["ln", "rms"])
@pytest.mark.parametrize("M,N,dt,wdt,hdt", [
    (1, 1 << 20, BF16, F32, None), (3, 262152, F16, F16, F32), (2, 70001, F32, F32, None),
    (5, 300008, F32, F32, None), (1, 1048575, BF16, F32, None), (3, 262151, F16, F16, F32),
    (4, 50257, F16, F16, None)])
def test_fused_add_rows_in_parts(plans, op, M, N, dt, wdt, hdt):
    """Few long rows of the fused forward in parts over the grid (h stored by the first launch,
    read back by the second; h in float32) match the reference, as without parts: rows of
    16-byte vectors, and odd rows peeled where h is x's dtype; other odd rows take chunks."""
    plans.spy("fwd")
    for rows in (2.0, 0):
        plans.replan(fwd_parts_rows_add=rows)
        run_fused(op, M, N, dt, wdt, hdt, config=plans.config)
        wide = N % VEC[dt] == 0
        want = "fwd_parts" if wide else "fwd_peeled_parts"
        parts = rows > 0 and (wide or hdt is None)
        assert plans and all((p.variant == want) == parts for p in plans), \
            [p.variant for p in plans]


@pytest.mark.parametrize("op", ["ln", "rms"])
@pytest.mark.parametrize("M,N,dt,wdt,hdt,extra", [
    (8, 3583, F16, F16, None, 0), (37, 3583, BF16, F32, None, 0),
    (300, 50257, BF16, BF16, None, 0), (1000, 4099, F32, F32, None, 0),
    (5, 777, F64, F64, None, 0), (40, 3583, F16, F16, None, 8), (40, 3583, F16, F16, None, 1),
    (600, 9001, F16, F32, None, 0), (64, 4097, BF16, BF16, F32, 0),
    (9, 131071, F16, F32, None, 0), (3, 70001, BF16, BF16, None, 8)])
def test_fused_add_rows_peeled(plans, op, M, N, dt, wdt, hdt, extra):
    """The fused add on rows whose 16-byte vectors do not fit as they are (odd N, row strides
    ``extra`` elements longer) matches the reference with the rows' heads and tails peeled off
    and without. The peeled kernels run as the plain passes' do, where the rows of every input
    and output start alike within 16 bytes: the forward's where h is x's dtype (residual added
    to x, h stored), the backward's (dresidual added to dx) for any h."""
    layout = (lambda a: padded(a, extra)) if extra else (lambda a: a)
    for pass_, dtype in (("fwd", dt), ("bwd", hdt or dt)):
        wide = VEC[dtype]
        alike = tuned(dtype, wide) and extra % wide == 0 and N % wide != 0 and N >= 2 * wide
        tiles = N // wide > 1024
        long = N // wide >= 8 * wide if pass_ == "fwd" else 64 <= N // wide <= 1024 or tiles
        plans.spy(pass_)
        for peel in (True, False):
            plans.replan(peel=peel, **(PEEL_FEW if peel else {}))
            run_fused(op, M, N, dt, wdt, hdt, layout=layout, config=plans.config)
            peeled = [p.variant.startswith(f"{pass_}_peeled") for p in plans]
            can = peel and alike and (pass_ == "bwd" or hdt is None)
            assert plans and (all(peeled) if can and long else True if can
                              else not any(peeled)), peeled
        plans.monkeypatch.undo()


# The backward's variants, each reached by its config: rows in a block with partials or atomics,
# staged rows, column tiles after the row sums, clusters of column tiles, one cluster of all rows,
# long rows held in shared memory or over a cooperative grid.
BWD_VARIANTS = {
    "direct": ({"stage": "never", "bwd_cluster_sums": False}, 4096, 1024),
    "staged": ({"stage": "always", "bwd_cluster_sums": False}, 4096, 1024),
    # two vectors per thread (bfloat16): dresidual staged with x and dy
    "staged, two vectors": ({"stage": "always", "bwd_cluster_sums": False}, 600, 8192),
    "atomic": ({"atomic_flush": True, "bwd_cluster_sums": False}, 2000, 4096),
    "row sums and tiles": ({"cluster": False}, 64, 40000),
    "cluster tiles": ({}, 64, 40000),
    "cluster tiles, single elements": ({}, 8, 3583),
    "staged cluster tiles": ({"stage": "always"}, 300, 40000),
    "one cluster of all rows": ({}, 16, 512),
    "rows held in 16 tiles": ({}, 20, 140000),
    "rows held in 16 tiles, dresidual from L2": ({}, 16, 262144),
    "cooperative grid": ({}, 20, 300008),
    "cooperative grid, few rows": ({}, 3, 300008),
}
# The long rows' plans for the two calls below (bfloat16 LayerNorm, float32 RMSNorm), where the
# device has clusters and cp.async: the variant, the grid's rows a step, and whether the
# resident tiles stage dresidual (no room beside 1024 threads' float32 gamma: read from L2).
LONG_BWD = {"rows held in 16 tiles": (("bwd_resident", None, True), ("bwd_grid", 1, None)),
            "rows held in 16 tiles, dresidual from L2": (("bwd_resident", None, False),
                                                         ("bwd_grid", 2, None)),
            "cooperative grid": (("bwd_grid", 1, None), ("bwd_grid", 2, None)),
            "cooperative grid, few rows": (("bwd_grid", 1, None), ("bwd_grid", 1, None))}


def long_plan(info, p):
    """(variant, the grid's rows a step, dresidual staged on the resident tiles) of plan p."""
    from cupyln import _plan

    held = _plan.staging_bytes(info, p.spec.dtype, p.spec.vec, p.spec.npt, p.block[0], 1,
                               p.spec.wdtype)
    return (p.variant, p.spec.grid[2] if p.spec.grid else None,
            p.smem > held if p.variant == "bwd_resident" else None)


@pytest.mark.parametrize("variant", BWD_VARIANTS, ids=list(BWD_VARIANTS))
def test_dresidual_in_every_backward_variant(plans, variant):
    from cupyln import _facts

    fields, M, N = BWD_VARIANTS[variant]
    info = _facts.device_info(cp.cuda.Device().id)
    plans.spy("bwd")
    plans.replan(**fields)
    for op, dt, wdt in (("ln", BF16, F32), ("rms", F32, F32)):
        run_fused(op, M, N, dt, wdt, config=plans.config)
    if variant in LONG_BWD and info.clusters and info.async_copy:
        assert [long_plan(info, p) for p in plans] == list(LONG_BWD[variant])
    if variant == "one cluster of all rows":
        assert all((p.variant == "bwd_csum") == info.clusters for p in plans)


def test_deterministic_fused_backward_is_bitwise_repeatable():
    first = run_fused("ln", 5000, 2048, BF16, F32, F32, deterministic=True)
    again = run_fused("ln", 5000, 2048, BF16, F32, F32, deterministic=True)
    for a, b in zip(first, again, strict=True):
        cp.testing.assert_array_equal(a, b)


@given(st.sampled_from(["ln", "rms"]), st.integers(1, 300),
       st.one_of(st.sampled_from(BOUNDARY_N), st.integers(1, 9000)),
       st.sampled_from(H_PAIRS), st.sampled_from([0.0, 1.0]), st.integers(0, 1000))
def test_fused_add_fuzz(op, M, N, pair, offset, seed):
    dt, wdt, hdt = pair
    run_fused(op, M, N, dt, wdt, hdt, offset=offset, seed=seed)


def test_bad_fused_calls_write_nothing():
    """A rejected call leaves a given out= untouched (the checks run before any launch)."""
    x = cp.ones((4, 8), F16)
    out = (cp.full((4, 8), 7, F16), cp.full(4, 7, F32), cp.full((4, 8), 7, F16))
    with pytest.raises(TypeError, match="residual has dtype float64"):
        cupyln.rms_norm_fwd(x, cp.ones(8, F16), residual=cp.ones((4, 8)), out=out)
    with pytest.raises(ValueError, match="needs gamma"):
        cupyln.rms_norm_fwd(x, None, residual=x.copy(), weight_offset=1.0, out=out)
    for a in out:
        assert bool((a == 7).all())


def test_fused_calls_are_remembered_and_replayed():
    """The second identical fused call (forward and backward) takes the remembered launch and
    gives the same bits; calls with a weight offset (gamma + offset made per call) are never
    remembered, and every one of them applies the offset."""
    from cupyln import api

    x = cp.asarray(host((64, 4096), BF16, 1))
    r = cp.asarray(host((64, 4096), F32, 2))
    g = cp.asarray(host((4096,), F32, 3, 0.2, 1.0))
    cupyln.clear_caches()
    runs = []
    for _ in range(2):
        y, rstd, h = cupyln.rms_norm_fwd(x, g, residual=r, residual_dtype=F32)
        dx, dg = cupyln.rms_norm_bwd(h, h, g, rstd, dresidual=r)
        runs.append((y, rstd, h, dx, dg))
        assert len(api._HOT) == 2  # one forward, one backward signature
    for u, v in zip(*runs, strict=True):
        cp.testing.assert_array_equal(u, v)
    want = cupyln.rms_norm_fwd(x, g + np.float32(1.0), residual=r, residual_dtype=F32)
    for _ in range(3):
        got = cupyln.rms_norm_fwd(x, g, residual=r, residual_dtype=F32, weight_offset=1.0)
        for u, v in zip(got, want, strict=True):
            cp.testing.assert_array_equal(u, v)
