"""Streams, CUDA graphs, warmup and remembered calls on the GPU (marked `gpu`)."""

import ml_dtypes  # noqa: F401
import numpy as np
import pytest
from gpu_cases import (
    BF16,
    F16,
    F32,
    assert_close,
    check_case,
    host,
    inputs,
)

import cupyln
from cupyln import reference as ref
from cupyln._config import config_of
from cupyln.check import dx_floor

cp = pytest.importorskip("cupy")
pytestmark = pytest.mark.gpu


# --------------------------------------------------------------------------- streams, graphs, warmup


def test_non_blocking_stream():
    s = cp.cuda.Stream(non_blocking=True)
    with s:
        check_case("ln", *inputs(513, 2048, BF16, F32))
        check_case("rms", *inputs(513, 20000, F16, F16))
    s.synchronize()




@pytest.mark.parametrize("given", [False, True], ids=["allocated", "out="])
@pytest.mark.parametrize("flush,M,N", [
    *((f, M, N) for M, N in ((300, 1000), (64, 512))
      for f in ("default", "deterministic", "atomic", "last block")),
    # staged backward rows from tickets (not deterministic), their counter after the flush's
    # in the scratch
    ("default", 6000, 1024), ("atomic", 6000, 1024),
    # few long rows: the forward's parts in scratch, the backward's row sums and column tiles
    ("default", 3, 70000),
    # rows over a cooperative grid (its row sums' area in the zeroed scratch; one row of
    # tiles, then several with partials), while the direct calls' grids run on the other stream
    ("default", 3, 300008), ("deterministic", 100, 280000)])
def test_cuda_graph_capture_and_replay(flush, M, N, given):
    """Forward + backward captured on a stream, inputs refilled, graph replayed (twice, on
    another stream while the same signature runs on the capturing one): the results match the
    reference on the new inputs. A pool of its own keeps the captured buffers. With every
    output given (out=), the backward's scratch belongs to no output: the direct calls must not
    get it from the pool while the graph still writes to it. One cluster that sums dgamma/dbeta
    (64x512 on sm_90, unless "last block") has no scratch: that capture allocates nothing."""
    from cupyln import _facts, _plan

    deterministic = flush == "deterministic"
    config = config_of(atomic_flush=flush == "atomic", bwd_cluster_sums=flush != "last block")
    stream = cp.cuda.Stream(non_blocking=True)
    pool = cp.cuda.MemoryPool()
    xh, dyh, gh, bh = inputs(M, N, F16, F32)
    with cp.cuda.using_allocator(pool.malloc), stream:
        x, dy, g, b = (cp.asarray(a) for a in (xh, dyh, gh, bh))

        def buffers():
            if not given:
                return None, None
            stats = (cp.empty(M, cp.float32), cp.empty(M, cp.float32))
            return ((cp.empty_like(x), *stats),
                    (cp.empty_like(x), cp.empty_like(g), cp.empty_like(b)))

        def step(fo, bo):
            y, mean, rstd = cupyln.layer_norm_fwd(x, g, b, out=fo, config=config)
            return (y, mean, rstd) + cupyln.layer_norm_bwd(
                dy, x, g, mean, rstd, deterministic=deterministic, out=bo, config=config)

        captured, direct = buffers(), buffers()  # outputs of the graph, of direct calls
        step(*captured)  # compile, plan and fill the pool outside the capture
        stream.synchronize()
        used = pool.used_bytes()
        stream.begin_capture()
        outs = step(*captured)
        graph = stream.end_capture()
        # the replays write to the scratch: it must not go back to the pool (where the
        # direct calls below could get it) when no output holds it
        plan = _plan.plan_bwd(_facts.device_info(x.device.id), config, F16, F32, True, M, N, 8)
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
        assert_step_matches_reference(outs, xh2, dyh2, gh, bh)


def assert_step_matches_reference(outs, xh, dyh, gh, bh):
    """A LayerNorm forward's and backward's outputs against the reference on those inputs."""
    y, mean, rstd, dx, dg, db = outs
    ry, rm, rr = ref.layer_norm_fwd(xh, gh, bh)
    rdx, rdg, rdb = ref.layer_norm_bwd(dyh, xh, gh, mean.get(), rstd.get())
    for out, want, name in ((y, ry, "y"), (mean, rm, "mean"), (rstd, rr, "rstd"),
                            (dg, rdg, "dgamma"), (db, rdb, "dbeta")):
        assert_close(out, want, name)
    assert_close(dx, rdx, "dx", dx_floor(dyh, gh, rstd))



@pytest.mark.parametrize("atomic", [True, False], ids=["atomic", "partials"])
@pytest.mark.parametrize("M,N", [(48, 768), (2000, 1024), (6000, 1024)])
def test_concurrent_streams_each_get_correct_gradients(plans, atomic, M, N):
    """Backwards whose scratch counters are zeroed once per stream and left zeroed by each
    launch (the atomic flush's last block and sums; the dynamic staged rows' tickets,
    6000x1024) running on several streams at once: every call's dgamma/dbeta are those of its
    own inputs."""
    plans.replan(atomic_flush=atomic)
    streams = [cp.cuda.Stream(non_blocking=True) for _ in range(4)]
    cases = [inputs(M, N, BF16, F32, seed=10 * i) for i in range(len(streams))]
    results = [[] for _ in streams]
    for _ in range(25):
        for s, (xh, dyh, gh, _), res in zip(streams, cases, results, strict=True):
            with s:
                x, dy, g = cp.asarray(xh), cp.asarray(dyh), cp.asarray(gh)
                y, mean, rstd = cupyln.layer_norm_fwd(x, g)
                res.append((mean, rstd) + cupyln.layer_norm_bwd(dy, x, g, mean, rstd,
                                                                config=plans.config)[1:])
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
    from cupyln import _plan

    n = cupyln.warmup([(64, 768, "float16"), (8, 4096, BF16)], param_dtype="float32")
    assert n == 8
    dev = cp.cuda.runtime.getDevice()
    assert _plan.plan_fwd.cache_info().currsize >= 4
    x = cp.asarray(host((64, 768), F16, 0))
    before = _plan.plan_fwd.cache_info().misses
    cupyln.layer_norm_fwd(x, cp.ones(768, cp.float32))
    assert _plan.plan_fwd.cache_info().misses == before  # the call found its plan ready
    assert dev == x.device.id


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
    # the forward was remembered: key ((is_ln, eps), out is None, x, gamma, beta, residual),
    # x = (type, shape, ...)
    assert any(k[2][1] == (M, N) for k in api._HOT if k[1] and len(k) == 6)
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
