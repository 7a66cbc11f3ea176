"""Every planner variant against the reference and against the variant it replaces: the
plans are chosen by passing configs (marked `gpu`)."""

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
    PEEL_FEW,
    assert_close,
    check_case,
    inputs,
    padded,
)
from hypothesis import given, settings
from hypothesis import strategies as st

import cupyln
from cupyln import _tuning
from cupyln import reference as ref
from cupyln._dtypes import VEC, tuned
from cupyln.check import dx_floor

cp = pytest.importorskip("cupy")
pytestmark = pytest.mark.gpu


# --------------------------------------------------------------------------- atomic flush


ATOMIC = cupyln.Config(atomic_flush=True)


@pytest.mark.parametrize("op", ["ln", "rms"])
@pytest.mark.parametrize("M,N", [(0, 64), (1, 1), (37, 33), (1025, 760), (199, 4096),
                                 (9, 20000), (65537, 129)])
def test_atomic_flush(op, M, N):
    """The backward's alternative dgamma/dbeta flush (float32 atomicAdd, the last block casts),
    which non-deterministic calls take where the config asks for it."""
    dt, wdt = PAIRS[(M + N) % len(PAIRS)]
    check_case(op, *inputs(M, N, dt, wdt), config=ATOMIC)
    check_case(op, *inputs(M, N, dt, wdt), need=(False, True, False), config=ATOMIC)


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
    from cupyln import _facts

    dt, wdt = PAIRS[(M + N) % len(PAIRS)]
    case = inputs(M, N, dt, wdt)
    plans.spy(pass_)
    out, grids, dynamic = {}, {}, False
    for mode in ("always", "never"):
        plans.replan(stage=mode)
        x, dy, g = (cp.asarray(a) for a in case[:3])
        cfg = plans.config
        if op == "ln":
            fwd = cupyln.layer_norm_fwd(x, g, None, config=cfg)
            out[mode] = fwd if pass_ == "fwd" else cupyln.layer_norm_bwd(dy, x, g, *fwd[1:],
                                                                          config=cfg)
        else:
            fwd = cupyln.rms_norm_fwd(x, g, config=cfg)
            out[mode] = fwd if pass_ == "fwd" else cupyln.rms_norm_bwd(dy, x, g, fwd[1],
                                                                        config=cfg)
        (plan,) = plans
        grids[mode] = plan.grid
        dynamic |= pass_ == "bwd" and plan.dynamic
        staged = plan.variant.endswith("_staged")
        # rows never staged: read in chunks, the row kernel, or peeled
        once = plan.variant in ("fwd_chunked", "fwd_cluster_chunked", "fwd_parts") \
            or plan.spec.row or plan.spec.peeled
        # staged kernels: cp.async, 16-byte vectors (Spec.wide)
        can = _facts.device_info(x.device.id).async_copy and plan.spec.wide
        assert staged == (can and not once and mode == "always"), (mode, plan.grid)
        assert (plan.smem > 0) >= staged
        check_case(op, *case, config=cfg)
    same_order = pass_ == "fwd" or (grids["always"] == grids["never"] and not dynamic)
    for i, (a, b) in enumerate(zip(out["always"], out["never"], strict=True)):
        assert cp.array_equal(a, b) or (i > 0 and not same_order), i


def backward_case(op, M, N, dt, wdt, plans):
    """(x, bwd, check) of one backward case: ``bwd(deterministic, params)`` calls cupyln's
    backward under ``plans``' config as it is at the call (dgamma/dbeta asked for or not),
    ``check(outs, params, dx)`` compares its outputs with the reference (dx where asked; no
    dgamma/dbeta where not asked for)."""
    xh, dyh, gh, _ = inputs(M, N, dt, wdt)
    x, dy, g = (cp.asarray(a) for a in (xh, dyh, gh))
    if op == "ln":
        _, mean, rstd = cupyln.layer_norm_fwd(x, g)
        want = ref.layer_norm_bwd(dyh, xh, gh, mean.get(), rstd.get())
    else:
        mean, (_, rstd) = None, cupyln.rms_norm_fwd(x, g)
        want = ref.rms_norm_bwd(dyh, xh, gh, rstd.get())
    floor = dx_floor(dyh, gh, rstd)

    def bwd(deterministic, params=True):
        kw = {"deterministic": deterministic, "need_dgamma": params, "config": plans.config}
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

    return x, bwd, check


@pytest.mark.parametrize("op", ["ln", "rms"])
@pytest.mark.parametrize("M,N,dt,wdt,meant", [
    (6000, 1024, F16, F32, "bwd_staged"), (20001, 1000, BF16, BF16, "bwd_staged"),
    (3001, 4096, F32, F32, "bwd_staged"), (1000, 1024, F16, F16, None),
    (1500, 8192, BF16, F32, "bwd_staged"), (5000, 96, F32, F32, None),
    (600, 16384, F16, F32, None)])
def test_dynamic_rows_of_the_staged_backward(plans, op, M, N, dt, wdt, meant):
    """Staged backward rows taken from a ticket counter (deterministic=False; bwd.dynamic)
    against static rows (bwd.dynamic off, or deterministic=True): the plan is dynamic exactly
    where staged blocks of one column tile span warps; every one of several calls matches the
    reference (the counter must come back to zero after each launch, or the next would drop or
    repeat rows), with dgamma/dbeta or without them (dx alone: the tickets are the only
    scratch); dx is bitwise the static rows' (rows are independent; the reference checks it
    once, the rest is compared on the device), and deterministic calls are bitwise repeatable
    either way, and the same either way where both plans have the same grid. `meant`: the
    variant the case is meant to take with tickets, where the device has it; 1000x1024 takes
    too few rows for tickets (static groups only), 5000x96 has rows within a warp, 600x16384
    column tiles (in clusters on sm_90): static rows."""
    from cupyln import _facts

    x, bwd, check = backward_case(op, M, N, dt, wdt, plans)
    warp = _facts.device_info(x.device.id).warp
    plans.spy("bwd")
    dxs, det, grids = {}, {}, {}
    for on in (True, False):
        plans.replan(dynamic=on)
        dxs[on] = []
        for i, params in enumerate((True, True, False, True)):
            outs = bwd(False, params)
            check(outs, params, dx=i == 0 and not on)
            dxs[on].append(outs[0])
        plan = plans[0]
        staged_wide = (plan.variant == "bwd_staged" and plan.block[0] > warp
                       and plan.grid[1] == 1)
        assert plan.dynamic == (on and staged_wide), (plan.variant, plan.block, plan.grid)
        if meant and _facts.device_info(x.device.id).async_copy:
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
    first exactly where it is built and fwd.early is on; each matches the reference, and the two
    agree bitwise (the same arithmetic in the same order)."""
    x_h, dy_h, g_h, b_h = inputs(M, N, dt, wdt, has_b=has_b)
    x, g = cp.asarray(x_h), cp.asarray(g_h)
    b = None if b_h is None else cp.asarray(b_h)
    plans.spy("fwd")
    out, variants = {}, {}
    for early in (False, True):
        plans.replan(fwd_early=early, fwd_full=False, fwd_row_warps=0)
        cfg = plans.config
        out[early] = (cupyln.layer_norm_fwd(x, g, b, config=cfg) if op == "ln"
                      else cupyln.rms_norm_fwd(x, g, config=cfg))
        (plan,) = plans
        variants[early] = plan.variant
        check_case(op, x_h, dy_h, g_h, b_h, config=cfg)
    early = "fwd_early_ln" if op == "ln" else "fwd_early_rms"  # the norm fixed
    built = early in plan.spec.names("fwd")  # the module's rule (checked in test_planner)
    assert variants == {False: "fwd", True: early if built else "fwd"}
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
    without per-column tests (fwd.full; the general rows', the row kernel off: it and the
    clusters have none, which gained less than 3%): the planner takes it exactly there, it matches the
    reference, also far from zero (a mean 1000 times the spread), and it gives bitwise what the
    tested kernel gives (the same arithmetic)."""
    x_h, dy_h, g_h, b_h = inputs(M, N, dt, wdt, has_b=has_b)
    x, g = cp.asarray(x_h), cp.asarray(g_h)
    b = None if b_h is None else cp.asarray(b_h)
    plans.spy("fwd")
    out = {}
    for full in (False, True):
        plans.replan(fwd_full=full, fwd_row_warps=0)
        out[full] = cupyln.layer_norm_fwd(x, g, b, config=plans.config)
        (plan,) = plans
        multiple = N % (plan.block[0] * plan.spec.npt * plan.spec.vec) == 0
        wide = plan.spec.wide  # the variant is built for 16-byte vectors (not float64's)
        assert plan.variant.endswith("_full") == (full and multiple and wide), plan.variant
        check_case("ln", x_h, dy_h, g_h, b_h, config=plans.config)
    far = (x_h.astype(np.float64) + 1000 * x_h.astype(np.float64).std()).astype(dt)
    check_case("ln", far, dy_h, g_h, b_h, config=plans.config)  # fwd.full on
    for a, c in zip(out[True], out[False], strict=True):
        assert cp.array_equal(a, c)


@pytest.mark.parametrize("op", ["ln", "rms"])
@pytest.mark.parametrize("M,N,dt,wdt,params", [
    (32, 512, F16, F16, "gb"), (96, 768, F16, F32, "gb"), (192, 1024, BF16, BF16, "b"),  # 2-4 warps
    (1024, 768, F16, F16, "g"), (7, 256, F32, F32, ""), (100, 256, F16, F32, "gb"),  # 3-1
    (300, 2048, BF16, F32, "gb"), (5, 1024, F32, F32, "g"),  # 8 warps
    (9, 1000, F16, F16, "gb"), (200, 200, F32, F32, "b"),  # not a multiple of the block's row
    # several vectors per thread (fwd.row_npt_warps): rows of 2 warps stacked in the general
    # kernel, of 2 not filling the chunk, of 4 and 3 warps, of 2 and 4 warps of 4-byte types
    (4096, 2048, F16, F16, "gb"), (5000, 1032, F16, F32, "gb"), (3000, 4096, BF16, BF16, "b"),
    (2000, 3072, F16, F16, "g"), (4096, 1024, F32, F32, ""), (1500, 2048, F32, F32, "gb"),
])
def test_row_kernel(plans, op, M, N, dt, wdt, params):
    """16-byte vectors: the row kernel (norm_fwd_row) exactly where fwd.row_warps and
    row_npt_warps allow it: one vector per thread in one row per block of whole warps
    (small M), or several in one row per block of 2-4 warps, the grid covering M. It matches
    the reference, with gamma and beta given or not (``params``), and agrees bitwise with the
    general kernel on the same rows (the same additions in the same order; beta added in the
    product's rounding in both)."""
    x_h, dy_h, g_h, b_h = inputs(M, N, dt, wdt, has_g="g" in params, has_b="b" in params)
    x = cp.asarray(x_h)
    g, b = (None if a is None else cp.asarray(a) for a in (g_h, b_h))
    plans.spy("fwd")
    out = {}
    for on in (False, True):
        plans.replan(fwd_row_warps=8 if on else 0)
        cfg = plans.config
        out[on] = (cupyln.layer_norm_fwd(x, g, b, config=cfg) if op == "ln"
                   else cupyln.rms_norm_fwd(x, g, config=cfg))
        (plan,) = plans
        assert plan.spec.row == on == plan.variant.startswith("fwd_row"), plan.variant
        check_case(op, x_h, dy_h, g_h, b_h, config=cfg)
    tpr, rpb = plan.block
    assert plan.grid == (-(-M // rpb),) and plan.spec.tpr == tpr
    assert rpb == 1
    for a, c in zip(out[False], out[True], strict=True):
        assert cp.array_equal(a, c)


@pytest.mark.parametrize("op", ["ln", "rms"])
@pytest.mark.parametrize("M,N,dt,wdt", [(700, 20000, F16, F16), (5, 16384, BF16, F32),
                                        (33, 32768, F16, F32), (1000, 9000, F32, F32),
                                        (3, 4100, F64, F64), (2, 70000, F32, F32),
                                        (1, 300000, BF16, F32), (37, 140000, F16, F16),
                                        (40, 98312, BF16, F32), (9, 131072, BF16, BF16)])
def test_cluster_and_row_sums_backward(plans, op, M, N, dt, wdt):
    """Long rows: clusters of column tiles that exchange their row sums (sm_90; 16 tiles, past
    the portable size, for rows that 8 cannot hold; staged where clusters loop over rows) and
    the row sums kernel (in parts, one per column tile) before the tiles both match the
    reference, deterministic and not; the plan takes the cluster path exactly where the device
    has clusters and the row fits in its tiles, the fewest that hold it (for few rows the
    most)."""
    from cupyln import _facts, _plan

    case = inputs(M, N, dt, wdt)
    plans.spy("bwd")
    for on in (True, False):
        # (rows in shared memory and over a cooperative grid: their own tests)
        plans.replan(cluster=on, bwd_resident_npt=0, bwd_grid_vecs=0)
        check_case(op, *case, config=plans.config)
        check_case(op, *case, deterministic=True, config=plans.config)
        plan = plans[0]
        cluster = plan.variant.startswith("bwd_cluster")
        info = _facts.device_info(cp.cuda.Device().id)
        cfg = plans.rows.bwd
        npt, wide = cfg.cluster_npt, plan.spec.wide
        fits = [t for t in _plan.cluster_sizes(cfg)
                if N // plan.spec.vec <= t * npt * _plan.bwd_threads(npt)]
        # the widths clusters are built for: 16-byte vectors, single elements in 8 tiles
        built = fits and (wide or plan.spec.vec == 1 and fits[0] == cfg.cluster_tiles)
        assert cluster == bool(on and info.clusters and built), plan.grid
        assert ("rowsums" in plan.launch) != cluster
        few = wide and M <= cfg.cluster_split_rows  # few rows: the most tiles that hold them
        assert not cluster or plan.grid[1] == fits[-1 if few else 0]


def _fwd_cluster_tiles(cfg, info, op, M, N, vec):
    """The blocks of the cluster whose one chunk holds a forward row, the fewest: 8, or for
    RMSNorm's rows, at least ``cluster_long_min_rows`` of them, 16; 0 where none does."""
    held = [t for t in (cfg.cluster_tiles, cfg.cluster_tiles_long)
            if N // vec <= t * cfg.tpr_max * cfg.npt]
    if held and held[0] > cfg.cluster_tiles and (op == "ln" or M < cfg.cluster_long_min_rows):
        return 0
    return held[0] if held else 0


@pytest.mark.parametrize("op", ["ln", "rms"])
@pytest.mark.parametrize("M,N,dt,wdt,has_b", [
    (300, 65536, BF16, F32, True), (3, 65544, F16, F16, False), (2, 1 << 20, BF16, BF16, True),
    (5, 300008, F32, F32, True), (1, 65536, BF16, F32, False), (6, 50000, BF16, BF16, True),
    (2, 40000, F64, F64, True), (400, 40000, F32, F32, True), (3, 262152, F16, F32, False),
    (300, 200000, F32, F32, True)])
def test_forward_rows_split_over_a_cluster(plans, op, M, N, dt, wdt, has_b):
    """Forward rows longer than a block split over a cluster (direct, or staged where resident
    clusters loop over rows; one vector per thread for few rows (1 x 65536 in 16 blocks,
    6 x 50000 in 8); rows not a multiple of the cluster's chunk, strided rows; 16 blocks, past
    the portable size, where 8 do not hold RMSNorm's rows) match the reference, as
    the path without clusters does; the plan takes it exactly where the device has clusters and
    one chunk of the cluster holds the row, the fewest blocks that do (rows in parts turned
    off: longer rows then take a block each)."""
    from cupyln import _facts

    case = inputs(M, N, dt, wdt, has_b=has_b)
    every_other_row = LAYOUTS["every other row"]
    plans.spy("fwd")
    for on in (True, False):
        plans.replan(cluster=on, fwd_parts_rows=0, fwd_resident_npt=0)
        check_case(op, *case, config=plans.config)
        check_case(op, *case, layout=every_other_row, config=plans.config)
        info, cfg = _facts.device_info(cp.cuda.Device().id), plans.rows.fwd
        # clusters: 16-byte vectors of the tuned dtypes (Spec.wide; float64 takes none)
        held = [_fwd_cluster_tiles(cfg, info, op, M, N, p.spec.vec) if p.spec.wide else 0
                for p in plans]
        # few rows that 8 blocks of one vector per thread hold: 16 blocks of half the threads
        few = [h == cfg.cluster_tiles and M <= cfg.cluster_split_rows
               and N // p.spec.vec <= h * cfg.tpr_max for p, h in zip(plans, held, strict=True)]
        held = [cfg.cluster_tiles_long if f else h for f, h in zip(few, held, strict=True)]
        assert all(p.spec.tiles == (h if on and info.clusters and h else 1)
                   for p, h in zip(plans, held, strict=True)), plans[0].variant
        staged = [p.variant.startswith("fwd_cluster_staged") for p in plans]
        assert all(p.spec.tiles == 1 or (p.grid[0] < M if s else p.grid[0] == M)
                   for p, s in zip(plans, staged, strict=True))
        # more rows than an H200 holds clusters of these (at most 132): staged
        assert any(staged) == (on and info.clusters and M >= 300 and any(held))


@pytest.mark.parametrize("fields,M,variant", [
    (dict(fwd_npt=1, fwd_resident_npt=0), 2, "fwd_parts"),  # parts at their kernel's 4 vectors
    (dict(fwd_npt=2, cluster=False), 2, "fwd_parts"),
    (dict(fwd_cluster_tiles=16), 1, "fwd_cluster")])  # 16 blocks
def test_forward_configs_off_the_defaults_plan_what_runs(plans, fields, M, variant):
    """Configs the defaults never take plan kernels that launch and match the reference: rows
    in parts under any ``fwd_npt`` (the parts' kernel is built for 4 vectors per thread),
    LayerNorm's rows over 16 blocks (past the portable cluster size)."""
    from cupyln import _facts

    if variant == "fwd_cluster" and not _facts.device_info(cp.cuda.Device().id).clusters:
        pytest.skip("needs thread-block clusters (sm_90)")
    plans.spy("fwd")
    plans.replan(**fields)
    check_case("ln", *inputs(M, 131072, F16, F16, has_b=True), config=plans.config)
    assert {p.variant for p in plans} == {variant}


@pytest.mark.parametrize("op", ["ln", "rms"])
@pytest.mark.parametrize("M,N,dt,wdt,has_b", [
    (16, 1 << 20, BF16, BF16, True), (30, 600008, F16, F32, False), (40, 262152, F32, F32, True),
    (35, 140000, F32, F32, True), (40, 524288, BF16, F32, True)])
def test_forward_rows_held_in_a_clusters_shared_memory(plans, op, M, N, dt, wdt, has_b):
    """Rows longer than the portable cluster's registers hold, held in the shared memory of a
    cluster of 8 or 16 blocks (each thread's ring of slots: two whole rows, or fewer; rows not
    a multiple of the cluster's chunk, strided rows), match the reference, as the
    paths without them do; on sm_90 the plan takes them for every such row here, at least
    ``resident_rows`` per resident cluster, and for none when off."""
    from cupyln import _facts

    case = inputs(M, N, dt, wdt, has_b=has_b)
    plans.spy("fwd")
    info = _facts.device_info(cp.cuda.Device().id)
    for npt, slots in ((8, 0), (8, 9), (0, 0)):  # the ring as large as fits, short, none
        plans.replan(fwd_resident_npt=npt, fwd_resident_slots=slots)
        check_case(op, *case, config=plans.config)
        check_case(op, *case, layout=LAYOUTS["every other row"], config=plans.config)
        resident = [p for p in plans if p.variant == "fwd_resident"]
        assert len(resident) == (len(plans) if npt and info.clusters else 0), \
            [p.variant for p in plans]
        for p in resident:
            tpr, tiles = p.block[0], p.spec.tiles
            assert p.grid == (p.grid[0], tiles) and M >= 2 * p.grid[0]
            assert tpr * tiles * npt * p.spec.vec >= N and npt * tpr * 16 <= p.smem
            assert not slots or p.smem == slots * tpr * 16


@pytest.mark.parametrize("op", ["ln", "rms"])
@pytest.mark.parametrize("M,N,dt,wdt,has_b,det", [
    (40, 262144, BF16, BF16, True, False), (30, 200000, F16, F32, False, True),
    (20, 131072, F32, F32, True, False), (16, 120000, F32, F32, True, True)])
def test_backward_rows_held_in_a_clusters_shared_memory(plans, op, M, N, dt, wdt, has_b, det):
    """Backward rows longer than the register tiles' 16-block clusters hold, with x and dy kept
    in the shared memory of 16 column tiles (rows not a multiple of the tiles' chunk, strided
    rows, float32 parameters of 16-bit rows), match the reference, as row sums and
    tiles do; on sm_90 the plan takes them for every such row here, and for none when off."""
    from cupyln import _facts

    case = inputs(M, N, dt, wdt, has_b=has_b)
    plans.spy("bwd")
    info = _facts.device_info(cp.cuda.Device().id)
    for npt in (2, 0):
        plans.replan(bwd_resident_npt=npt)
        check_case(op, *case, deterministic=det, config=plans.config)
        check_case(op, *case, layout=LAYOUTS["every other row"], deterministic=det,
                   config=plans.config)
        resident = [p for p in plans if p.variant == "bwd_resident"]
        assert len(resident) == (len(plans) if npt and info.clusters else 0), \
            [p.variant for p in plans]
        for p in resident:
            tpr, tiles = p.block[0], p.spec.tiles
            assert tiles == 16 and M >= 2 * p.grid[0] and tpr * tiles * npt * p.spec.vec >= N
            assert "reduce" in p.launch


@pytest.mark.parametrize("op", ["ln", "rms"])
@pytest.mark.parametrize("M,N,dt,wdt,has_b,det", [
    (64, 1 << 20, BF16, BF16, True, True), (3, 300008, F16, F32, False, False),
    (200, 270000, F32, F32, True, True), (1, 1 << 20, BF16, F32, True, False)])
def test_backward_rows_split_over_a_cooperative_grid(plans, op, M, N, dt, wdt, has_b, det):
    """Backward rows past the resident tiles, split over a cooperative grid of column tiles
    whose row sums meet in global memory (one row of tiles or several, a partial last tile,
    strided rows, float32 parameters of 16-bit rows), match the reference, dgamma/dbeta bitwise
    the same on a second call when deterministic; on CUDA the plan takes it for every such row
    here, and for none when off."""
    from cupyln import _facts

    case = inputs(M, N, dt, wdt, has_b=has_b)
    plans.spy("bwd")
    info = _facts.device_info(cp.cuda.Device().id)
    for vecs in (32768, 0):
        plans.replan(bwd_grid_vecs=vecs)
        first = check_case(op, *case, deterministic=det, config=plans.config)
        again = check_case(op, *case, deterministic=det, config=plans.config)
        if det:
            for a, b in zip(first, again, strict=True):
                assert a is None or bool(cp.all(a == b))
        check_case(op, *case, layout=LAYOUTS["every other row"], deterministic=det,
                   config=plans.config)
        grid = [p for p in plans if p.variant == "bwd_grid"]
        assert len(grid) == (len(plans) if vecs and info.async_copy else 0), \
            [p.variant for p in plans]
        for p in grid:
            assert p.grid[0] * plans.rows.bwd.grid_rows >= M
            assert ("reduce" in p.launch) == (p.grid[0] > 1)


@pytest.mark.parametrize("op", ["ln", "rms"])
@pytest.mark.parametrize("buffers,step", [(4, 1), (6, 3)])
def test_cooperative_grid_rows_per_exchange(plans, op, buffers, step):
    """The cooperative grid with another number of rows per exchange (one; three, the last step
    of 7 rows partly empty) matches the reference, bitwise repeatable when deterministic."""
    from cupyln import _facts

    if not _facts.device_info(cp.cuda.Device().id).async_copy:
        pytest.skip("the cooperative grid backward needs cp.async (CUDA sm_80 on)")
    case = inputs(7, 300008, F16, F32, has_b=True)
    plans.spy("bwd")
    plans.replan(bwd_grid_buffers=buffers, bwd_grid_step_rows=step, bwd_grid_step_min_rows=1)
    first = check_case(op, *case, deterministic=True, config=plans.config)
    again = check_case(op, *case, deterministic=True, config=plans.config)
    assert all(a is None or bool(cp.all(a == b)) for a, b in zip(first, again, strict=True))
    check_case(op, *case, config=plans.config)
    assert [p.spec.grid for p in plans] and all(
        p.spec.grid == (buffers, 1, step) for p in plans), [p.variant for p in plans]


@pytest.mark.parametrize("op", ["ln", "rms"])
@pytest.mark.parametrize("M,N,dt,wdt,has_b", [
    (1, 1 << 20, BF16, BF16, True), (3, 262152, F16, F32, False), (2, 70001, F32, F32, True),
    (5, 300008, F32, F32, True), (1, 65536, BF16, F32, False), (2, 140000, F64, F64, True),
    (264, 140000, F32, F32, True), (4, 4097 * 8, BF16, F32, True)])
def test_few_long_forward_rows_in_parts(plans, op, M, N, dt, wdt, has_b):
    """Few forward rows longer than a block, split over the grid in two launches (a part's
    statistics, then the merge and y; parts not a multiple of the chunk, float64, strided
    rows), match the reference, as the path without parts does, and the plan takes two launches
    exactly where asked, at 16-byte vectors, and a cluster does not hold the row (sm_90)."""
    from cupyln import _facts

    case = inputs(M, N, dt, wdt, has_b=has_b)
    plans.spy("fwd")
    info = _facts.device_info(cp.cuda.Device().id)
    for rows in (2.0, 0):
        plans.replan(fwd_parts_rows=rows, fwd_resident_npt=0)
        check_case(op, *case, config=plans.config)
        check_case(op, *case, layout=LAYOUTS["every other row"], config=plans.config)
        cfg = plans.rows.fwd
        wide = [p.spec.in_parts for p in plans]  # parts: 16-byte vectors
        held = [p.spec.wide and info.clusters  # clusters: not float64's
                and _fwd_cluster_tiles(cfg, info, op, M, N, p.spec.vec) for p in plans]
        assert plans and all((p.variant == "fwd_parts") == (rows > 0 and w and not h)
                             for p, w, h in zip(plans, wide, held, strict=True)), \
            [p.variant for p in plans]


@pytest.mark.parametrize("op", ["ln", "rms"])
@pytest.mark.parametrize("M,N,dt,wdt", [
    (1, 1 << 20, BF16, BF16), (3, 70001, F32, F32), (5, 300008, F32, F32),
    (66, 140000, F16, F32), (2, 40000, F64, F64)])
def test_few_long_backward_rows_sum_in_parts(plans, op, M, N, dt, wdt):
    """The long-row backward's row sums in parts over the grid, added by a second kernel, then
    the column tiles (deterministic or not; float64, several warps per part) match the
    reference, as the path without parts does, and the plan takes the parts exactly where
    asked, at 16-byte vectors (single elements: one block per row)."""
    case = inputs(M, N, dt, wdt)
    plans.spy("bwd")
    for rows in (0.5, 0):
        # 140000 f16: no cluster; 1 << 20: no cooperative grid
        plans.replan(bwd_parts_rows=rows, bwd_cluster_tiles_long=0, bwd_grid_vecs=0)
        for det in (True, False):
            check_case(op, *case, deterministic=det, config=plans.config)
        long = [p for p in plans if "rowsums" in p.launch]
        assert long and all(("rowsums_merge" in p.launch) == (
            rows > 0 and p.spec.in_parts) for p in long)


@pytest.mark.parametrize("op", ["ln", "rms"])
@pytest.mark.parametrize("M,N,dt,wdt", [
    (2, 1 << 20, BF16, BF16), (3, 140000, F16, F32), (2, 40000, F64, F64),
    (400, 20000, F16, F16), (70, 9002, BF16, F32), (5, 65540, F32, F32)])
def test_long_rows_partials_summed_four_columns_per_thread(plans, op, M, N, dt, wdt):
    """The long-row backward's partials summed four columns per thread match the reference and
    give bitwise what 32 columns per block give (the same order; 400 and 70 rows: several
    partial rows per group), taken exactly where asked on rows of a multiple of 4."""
    case = inputs(M, N, dt, wdt)
    plans.spy("bwd")
    got = {}
    for least in (0, 1 << 62):
        plans.replan(bwd_reduce_cols_n=least, bwd_grid_vecs=0)  # partials at 2 x 1 << 20
        got[least] = check_case(op, *case, deterministic=True, config=plans.config)
        check_case(op, *case, need=(False, op == "rms", op == "ln"), config=plans.config)
        # four columns per thread: blocks of one row of threads (else eight row groups)
        blocks = [p.launch["reduce"].block for p in plans if "reduce" in p.launch]
        assert blocks and all((b[1] == 1) == (least == 0 and N % 4 == 0)
                              for b in blocks), blocks
    for a, b in zip(got[0], got[1 << 62], strict=True):
        assert (a is None and b is None) or cp.array_equal(a, b)


@pytest.mark.parametrize("op", ["ln", "rms"])
@pytest.mark.parametrize("M,N,dt,wdt", [
    (1, 1 << 20, BF16, BF16), (1, 140000, F16, F32), (1, 70001, F32, F32), (1, 40000, F16, F16),
    (1, 65536, BF16, F32), (1, 9000, F64, F64)])
def test_one_row_of_blocks_writes_dgamma_dbeta(plans, op, M, N, dt, wdt):
    """A backward grid of one row of blocks (one long row: column tiles, or a cluster of them)
    writes dgamma/dbeta from each block's sums, with no partials and no second launch: it
    matches the reference, deterministic or not, with either parameter gradient alone."""
    case = inputs(M, N, dt, wdt)
    plans.spy("bwd")
    plans.replan(atomic_flush=True)  # not taken: nothing to accumulate across blocks
    for det in (True, False):
        check_case(op, *case, deterministic=det, config=plans.config)
    check_case(op, *case, need=(False, op == "rms", op == "ln"), config=plans.config)
    check_case(op, *case, need=(True, op == "ln", False), config=plans.config)
    assert plans and all(p.direct and p.grid[0] == 1 and "reduce" not in p.launch
                         for p in plans), [(p.variant, p.grid) for p in plans]


@pytest.mark.parametrize("need", [(False, True, True), (False, True, False), (True, False, False)])
def test_staged_clusters_with_need_flags(plans, need):
    """The staged cluster backward (blocks looping over rows, sm_90) with dx or a parameter's
    gradient left out: every row still takes its exchange, and what is computed matches the
    reference."""
    from cupyln import _facts

    plans.spy("bwd")
    check_case("ln", *inputs(301, 20000, F16, F32), need=need)
    check_case("rms", *inputs(301, 20000, BF16, BF16), need=need)
    assert plans
    if _facts.device_info(cp.cuda.Device().id).clusters:
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
    reduction kernel gives (or, on one row of blocks, what each block writes itself). Up to 64
    blocks here (the default limit is lower), so that the eight interleaved groups of partial
    rows take more than one row each."""
    case = inputs(M, N, dt, wdt)
    plans.spy("bwd")
    got = {}
    for fused in (True, False):
        plans.replan(bwd_spread=0, bwd_fused_reduce_blocks=64 if fused else 0,
                     bwd_cluster_sums=False)
        cfg = plans.config
        got[fused] = check_case(op, *case, deterministic=True, config=cfg)
        check_case(op, *case, config=cfg)
        check_case(op, *case, need=(False, op == "rms", op == "ln"), config=cfg)
        plan = plans[0]
        # no second launch: the last block sums, or one row of blocks writes them itself
        assert ("reduce" in plan.launch) == (not fused and plan.grid[0] > 1), plan.grid
        assert plan.direct == (not fused and plan.grid[0] == 1)
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
    """Rows that fit in one cluster of bwd.csum_blocks blocks run there, and the blocks sum
    dgamma/dbeta through distributed shared memory: it matches the reference, deterministic or
    not, with one parameter gradient alone (dbeta for LayerNorm, dgamma for RMSNorm) and with dx
    alone, and is bitwise repeatable; so does the path without clusters. The plan takes it
    exactly where the device has clusters (every case here fits in one)."""
    from cupyln import _facts

    case = inputs(M, N, dt, wdt)
    plans.spy("bwd")
    got = {}
    for on in (True, False):
        plans.replan(bwd_cluster_sums=on)
        cfg = plans.config
        got[on] = check_case(op, *case, deterministic=True, config=cfg)
        check_case(op, *case, config=cfg)
        check_case(op, *case, need=(False, op == "rms", op == "ln"), config=cfg)
        check_case(op, *case, need=(True, False, False), config=cfg)
        plan = plans[0]
        info = _facts.device_info(cp.cuda.Device().id)
        assert (plan.variant == "bwd_csum") == (on and info.clusters), plan.variant
        if plan.variant == "bwd_csum":
            assert plan.grid == (plans.rows.bwd.csum_blocks, 1) and "reduce" not in plan.launch
    for _ in range(2):  # the cluster's order is fixed: the same bits on every call
        again = check_case(op, *case, config=cupyln.Config())
        for a, b in zip(got[True], again, strict=True):
            assert (a is None and b is None) or cp.array_equal(a, b)




# --------------------------------------------------------------------------- peeled rows


@pytest.mark.parametrize("op", ["ln", "rms"])
@pytest.mark.parametrize("M,N,dt,wdt,extra", [
    (8, 3583, F16, F16, 0), (37, 3583, BF16, F32, 0), (300, 50257, BF16, BF16, 0),
    (1000, 4099, F32, F32, 0), (5, 777, F64, F64, 0), (33000, 130, F16, F32, 0),
    (64, 17, F16, F16, 0), (3, 33, F32, F32, 0), (70, 4100, BF16, BF16, 0),
    (40, 3583, F16, F16, 8), (40, 3583, F16, F16, 1), (9, 1001, F32, F32, 4),
    (1, 3583, BF16, F32, 0), (100, 20001, F32, F32, 0), (67, 50257, F16, F32, 8),
    (80, 16001, F64, F64, 0), (600, 9001, F16, F32, 0), (2, 300001, F16, F16, 0),
    (9, 131071, BF16, F32, 8)])
def test_rows_peeled_where_vectors_do_not_fit(plans, op, M, N, dt, wdt, extra):
    """Rows on which 16-byte vectors do not fit as they are (odd N, row strides ``extra``
    elements longer) match the reference with their heads and tails peeled off, and without,
    forward and backward (dx, or the parameters' gradients alone, deterministic); the peeled
    kernels run exactly where x's (dy's) and y's (dx's) rows start alike within 16 bytes and
    the row is long enough and fits one chunk (the forward: or its rows are few, in parts; the
    backward: one block, or column tiles after the row sums, those of few rows in parts)."""

    case = inputs(M, N, dt, wdt)
    layout = (lambda a: padded(a, extra)) if extra else (lambda a: a)
    wide = VEC[dt]
    alike = tuned(dt, wide) and extra % wide == 0 and N % wide != 0 and N >= 2 * wide
    tiles = N // wide > 1024
    for pass_, long in (("fwd", N // wide >= 8 * wide),
                        ("bwd", 64 <= N // wide <= 1024 or tiles)):
        plans.spy(pass_)
        for peel in (True, False):
            plans.replan(peel=peel, **(PEEL_FEW if peel else {}))
            check_case(op, *case, layout=layout, config=plans.config)
            check_case(op, *case, layout=layout, config=plans.config, deterministic=True,
                       need=(False, True, op == "ln"))
            peeled = [p.variant.startswith(f"{pass_}_peeled") for p in plans]
            assert plans and (all(peeled) if peel and alike and long
                              else not any(peeled) if not (peel and alike) else True), peeled
        plans.monkeypatch.undo()


@pytest.mark.parametrize("op", ["ln", "rms"])
@pytest.mark.parametrize("M,N,dt,wdt,extra", [
    (40, 70001, BF16, BF16, 0), (9, 131071, F16, F32, 8), (30, 40001, F32, F32, 0),
    (5, 65537, F32, F32, 0), (3, 1048575, BF16, F32, 0)])
def test_peeled_rows_in_chunks(plans, op, M, N, dt, wdt, extra):
    """Peeled rows past one block of 8 vectors per thread, their middles read in chunks twice
    (here for few rows: ``peel_parts_rows=0``), against the reference, rows of longer strides
    included; ``peel_chunked=False``: single elements over the row, the same results."""
    layout = (lambda a: padded(a, extra)) if extra else (lambda a: a)
    case = inputs(M, N, dt, wdt)
    plans.spy("fwd")
    for chunked in (True, False):  # (clusters: their own test)
        plans.replan(fwd_peel_parts_rows=0, fwd_peel_chunked=chunked, fwd_peel_cluster=False)
        check_case(op, *case, layout=layout, config=plans.config)
        variants = {p.variant for p in plans}
        assert variants == {"fwd_peeled_chunked"} if chunked else \
            not any(v.startswith("fwd_peeled") for v in variants), variants


@pytest.mark.parametrize("op", ["ln", "rms"])
@pytest.mark.parametrize("M,N,dt,wdt,extra", [
    (40, 70001, BF16, BF16, 0), (9, 131071, F16, F32, 8), (30, 40001, F32, F32, 0),
    (5, 65537, F32, F32, 0), (3, 262143, BF16, F32, 0), (3, 400001, BF16, BF16, 0),
    (300, 50257, F16, F16, 8)])
def test_peeled_rows_over_a_cluster(plans, op, M, N, dt, wdt, extra):
    """Peeled rows that would go in chunks split over a cluster instead (sm_90; here for few
    rows too: ``peel_parts_rows=0``; RMSNorm's in blocks of ``peel_cluster_rms_threads`` or
    more, and its rows of 16 blocks for any M) and match the reference, rows of longer strides
    included, as without (``peel_cluster=False``); the plan takes the cluster exactly where
    the device has clusters, its fewest blocks hold the row's middle and the plan without it
    is the chunked kernel."""
    from cupyln import _facts

    layout = (lambda a: padded(a, extra)) if extra else (lambda a: a)
    case = inputs(M, N, dt, wdt)
    info = _facts.device_info(cp.cuda.Device().id)
    plans.spy("fwd")
    chunked = []
    for on in (False, True):
        plans.replan(fwd_peel_parts_rows=0, fwd_peel_cluster=on, fwd_cluster_long_min_rows=0)
        check_case(op, *case, layout=layout, config=plans.config)
        assert plans and all(p.variant.startswith("fwd_peeled") for p in plans)
        if not on:
            chunked = [p.variant == "fwd_peeled_chunked" for p in plans]
            continue
        cfg = plans.rows.fwd
        tiles = _fwd_cluster_tiles(cfg, info, op, M, N, VEC[dt])
        wp = info.warp
        threads = -(-(N // VEC[dt]) // (tiles * cfg.npt * wp)) * wp if tiles else 0
        held = tiles > 0 and (op == "ln" or threads >= cfg.peel_cluster_rms_threads)
        assert [p.variant == "fwd_peeled_cluster" for p in plans] == \
            [c and info.clusters and held for c in chunked], [p.variant for p in plans]
        assert all(p.grid[1] == tiles for p in plans if p.variant == "fwd_peeled_cluster")


@pytest.mark.parametrize("op", ["ln", "rms"])
@pytest.mark.parametrize("dt,wdt", [(F16, F16), (F16, F32), (BF16, BF16)])
def test_peeled_rows_of_8_vectors_per_thread(plans, op, dt, wdt):
    """Odd rows that one block holds only at 8 vectors per thread (57345 to 65536 16-bit
    elements), where no staged buffer pair fits, here for few rows (``peel_parts_rows=0``), as
    the planner runs them for more than 4 rows per multiprocessor: the peeled kernel holds them
    in registers (float16 packed) where it spills no more than ``peel_block_spill`` bytes (or
    that bound is lifted), else they go in chunks; either against the reference."""
    case = inputs(40, 60001, dt, wdt)
    plans.spy("fwd")
    plans.replan(fwd_peel_parts_rows=0, fwd_peel_block_spill=1 << 20,
                 fwd_peel_cluster=False)
    check_case(op, *case, config=plans.config)
    assert [(p.variant, p.spec.npt) for p in plans] == [("fwd_peeled", 8)]
    spills = plans[0].kern.local_size_bytes > _tuning.SM90_FWD["peel_block_spill"][0]
    plans.replan(fwd_peel_parts_rows=0, fwd_peel_cluster=False)
    check_case(op, *case, config=plans.config)
    assert [p.variant for p in plans] == ["fwd_peeled_chunked" if spills else "fwd_peeled"]


@st.composite
def _long_rows(draw):
    """Rows of 2049 to 70001 elements, odd or not, few or many (at most 2^22 elements in
    all), row strides longer by 0, 1 or 8 elements."""
    n = draw(st.integers(2049, 70001))
    m = draw(st.integers(1, min(700, (1 << 22) // n)))
    return m, n, draw(st.sampled_from(PAIRS)), draw(st.sampled_from([0, 1, 8]))


@pytest.mark.parametrize("op", ["ln", "rms"])
@settings(max_examples=max(1, settings().max_examples // 4))
@given(_long_rows(), st.booleans(), st.integers(0, 1000))
def test_fuzz_peeled_long_rows(op, rows, det, seed):
    """Long rows of any length against the reference: peeled in parts or in one block
    (forward), on column tiles (backward), or single elements, as the planner picks."""
    M, N, (dt, wdt), extra = rows
    layout = (lambda a: padded(a, extra)) if extra else (lambda a: a)
    check_case(op, *inputs(M, N, dt, wdt, seed=seed), layout=layout, deterministic=det)


@st.composite
def _rows_past_8_cluster_blocks(draw):
    """Rows of 32769 to 300000 elements (past what 8 cluster blocks hold for some pass and
    dtype: the backward's 16 tiles from 65537 16-bit or 32769 float32 elements, RMSNorm's
    forward from 262145 or 131073), 1 to 40 of them (at most 2^22 elements in all), row
    strides longer by 0 or 8 elements."""
    n = draw(st.integers(32769, 300000))
    m = draw(st.integers(1, min(40, (1 << 22) // n)))
    return m, n, draw(st.sampled_from(PAIRS)), draw(st.sampled_from([0, 8]))


@pytest.mark.parametrize("op", ["ln", "rms"])
@settings(max_examples=max(1, settings().max_examples // 4))
@given(_rows_past_8_cluster_blocks(), st.booleans(), st.integers(0, 1000))
def test_fuzz_rows_past_8_cluster_blocks(op, rows, det, seed):
    """Long rows against the reference wherever 16-block clusters may run (sm_90), and the
    paths beside them (8 blocks, parts, row sums and tiles), as the planner picks."""
    M, N, (dt, wdt), extra = rows
    layout = (lambda a: padded(a, extra)) if extra else (lambda a: a)
    check_case(op, *inputs(M, N, dt, wdt, seed=seed), layout=layout, deterministic=det)


def test_peeled_rows_with_y_unlike_x(plans):
    """A peelable signature called again with y given one element past an aligned start (its
    rows then start unlike x's within 16 bytes) runs single elements, and still matches."""
    x_h, _, g_h, b_h = inputs(40, 3583, F16, F16)
    x, g, b = cp.asarray(x_h), cp.asarray(g_h), cp.asarray(b_h)
    plans.spy("fwd")
    want = ref.layer_norm_fwd(x_h, g_h, b_h, 1e-5)
    for shift in (0, 0, 1, 0):
        y = cp.full(x.size + shift, 7, x.dtype)[shift:].reshape(x.shape)
        got = cupyln.layer_norm_fwd(x, g, b, out=(y, None, None))
        assert got[0] is y
        assert_close(y, want[0], "y")
    assert [p.variant for p in plans] == ["fwd_peeled_early", "fwd"], [p.variant for p in plans]


def _peeled_fwd_alike(plans, op, x_h, x, g_h, b_h, configs):
    """The forward of x (its host copy x_h) under each of ``configs`` (the config's fields, and
    the variant it must plan): y, mean and rstd the same bitwise under all, y the reference's."""
    g, b = (None if a is None else cp.asarray(a) for a in (g_h, b_h))
    outs = []
    for fields, want in configs:
        plans.spy("fwd")
        plans.replan(**fields)
        outs.append(cupyln.layer_norm_fwd(x, g, b, eps=1e-5, config=plans.config)
                    if op == "ln" else cupyln.rms_norm_fwd(x, g, eps=1e-5, config=plans.config))
        assert [p.variant for p in plans] == [want], [p.variant for p in plans]
        plans.monkeypatch.undo()
    assert all(cp.array_equal(a, c) for o in outs[1:] for a, c in zip(outs[0], o, strict=True))
    ry = (ref.layer_norm_fwd(x_h, g_h, b_h, 1e-5) if op == "ln"
          else ref.rms_norm_fwd(x_h, g_h, 1e-5))[0]
    assert_close(outs[0][0], ry, "y")


@pytest.mark.parametrize("op", ["ln", "rms"])
@pytest.mark.parametrize("M,N,dt,wdt", [
    (8, 3583, F16, F16), (1, 3583, BF16, F32), (132, 3583, BF16, BF16), (100, 1001, F32, F32),
    (64, 777, F16, F32), (5, 777, BF16, BF16)])
def test_peeled_rows_with_early_parameters(plans, op, M, N, dt, wdt):
    """Few peeled rows of one vector per thread read gamma and beta with the row (each absent
    too): the same y, mean and rstd bitwise as the kernel that reads them after the row's
    reductions (``peel_early_rows=0``), and the reference's."""
    x_h, _, g_h, b_h = inputs(M, N, dt, wdt)
    params = [(g_h, b_h), (None, None), (g_h, None), (None, b_h)] if op == "ln" else \
        [(g_h, None), (None, None)]
    for g, b in params:
        _peeled_fwd_alike(plans, op, x_h, cp.asarray(x_h), g, b,
                          [({"fwd_peel_early_rows": 1.0}, "fwd_peeled_early"),
                           ({"fwd_peel_early_rows": 0}, "fwd_peeled")])


@pytest.mark.parametrize("op", ["ln", "rms"])
@pytest.mark.parametrize("M,N,dt,wdt,extra", [
    (600, 50257, BF16, BF16, 0), (600, 20001, F16, F32, 8), (700, 20001, F32, F32, 4)])
def test_peeled_rows_staged(plans, op, M, N, dt, wdt, extra):
    """Long peeled rows, more than the resident blocks hold, staged (the next row's middle
    copied ahead, read from shared memory in each pass): the same y, mean and rstd bitwise as
    the direct kernel's, and the reference's."""
    x_h, _, g_h, b_h = inputs(M, N, dt, wdt)
    x = padded(cp.asarray(x_h), extra) if extra else cp.asarray(x_h)
    _peeled_fwd_alike(plans, op, x_h, x, g_h, b_h if op == "ln" else None,
                      [({"stage": "auto"}, "fwd_peeled_staged"),
                       ({"stage": "never", "fwd_peel_block_spill": 1 << 20},
                        "fwd_peeled")])


@pytest.mark.parametrize("dt,wdt,N", [(BF16, BF16, 3583), (F16, F32, 3583), (F32, F32, 3583),
                                      (BF16, BF16, 50257), (F32, F32, 20001)])
def test_peeled_backward_gamma_misaligned(plans, dt, wdt, N):
    """The peeled backward (rows in one block, or on column tiles after their row sums) reads
    an aligned gamma as shifted packs and a gamma one element past an aligned start per
    element: the same values, so the same bits of dx and dgamma."""
    x_h, dy_h, g_h, _ = inputs(600 if N < 4096 else 200, N, dt, wdt)
    x, dy = cp.asarray(x_h), cp.asarray(dy_h)
    _, rstd = cupyln.rms_norm_fwd(x, cp.asarray(g_h))
    plans.replan(**PEEL_FEW)
    plans.spy("bwd")
    got = []
    for shift in (0, 1):
        g = cp.zeros(g_h.size + shift, wdt)[shift:]
        g[:] = cp.asarray(g_h)
        got.append(cupyln.rms_norm_bwd(dy, x, g, rstd, deterministic=True,
                                       config=plans.config))
    # (the second call may take the first's prepared pass: the kernel tests gamma's alignment)
    assert plans and all(p.variant.startswith("bwd_peeled") for p in plans), \
        [p.variant for p in plans]
    for a, b in zip(*got, strict=True):
        cp.testing.assert_array_equal(a, b)
    assert_close(got[0][0], ref.rms_norm_bwd(dy_h, x_h, g_h, rstd.get())[0], "dx")
