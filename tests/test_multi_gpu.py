"""Several GPUs: per-device compile cache and placement, device mismatch errors, and the
data-parallel example (NCCL all-reduce of dgamma/dbeta). Skipped with fewer than two GPUs."""

import os
import sys

import numpy as np
import pytest

import cupyln
from cupyln import reference as ref
from cupyln.check import TOL, max_err

cp = pytest.importorskip("cupy")
pytestmark = [pytest.mark.gpu, pytest.mark.multi_gpu]


def _problem(M=257, N=1000, seed=0):
    rng = np.random.default_rng(seed)
    x = (-2.3 + 0.5 * rng.standard_normal((M, N))).astype(np.float16)
    dy = (0.1 * rng.standard_normal((M, N))).astype(np.float16)
    g = (1 + 0.2 * rng.standard_normal(N)).astype(np.float32)
    return x, dy, g


def _check_on(dev, x, dy, g):
    with cp.cuda.Device(dev):
        xs, dys, gs = cp.asarray(x), cp.asarray(dy), cp.asarray(g)
    y, mean, rstd = cupyln.layer_norm_fwd(xs, gs)  # called from whatever device is current
    dx, dg, db = cupyln.layer_norm_bwd(dys, xs, gs, mean, rstd)
    for a in (y, mean, rstd, dx, dg, db):
        assert a.device.id == dev
    ry, _, _ = ref.layer_norm_fwd(x, g, None)
    _, rdg, rdb = ref.layer_norm_bwd(dy, x, g, mean.get(), rstd.get())
    for out, want in ((y, ry), (dg, rdg), (db, rdb)):
        assert max_err(out, want) <= TOL[np.dtype(out.dtype)]


def test_same_specialization_on_each_device_in_turn():
    x, dy, g = _problem()
    for dev in (0, 1, 0, 1):
        with cp.cuda.Device(dev):
            _check_on(dev, x, dy, g)


def test_inputs_on_another_device_run_there():
    x, dy, g = _problem(seed=1)
    with cp.cuda.Device(0):
        _check_on(1, x, dy, g)
        assert cp.cuda.runtime.getDevice() == 0  # the caller's device is restored


def test_arrays_on_different_devices_raise_before_launch():
    with cp.cuda.Device(0):
        x = cp.ones((4, 8), cp.float32)
    with cp.cuda.Device(1):
        g = cp.ones(8, cp.float32)
        _, mean, rstd = cupyln.layer_norm_fwd(cp.ones((4, 8), cp.float32))
    with pytest.raises(ValueError, match="gamma is on device 1"):
        cupyln.layer_norm_fwd(x, g)
    with pytest.raises(ValueError, match="on device 1"):
        cupyln.layer_norm_bwd(x, x, None, mean, rstd)


def test_data_parallel_example_matches_single_gpu():
    sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "examples"))
    import data_parallel

    assert data_parallel.main(M=2048, N=1024) <= 1e-4


def test_ddp_with_cupyln_modules_gives_the_gradients_of_one_gpu(tmp_path):
    """cupyln.torch's modules under DistributedDataParallel (NCCL, one process per GPU, two
    GPUs): the all-reduced gradients after one step equal those of the whole batch on one GPU
    (the mean of the shards' losses is the whole batch's loss)."""
    torch = pytest.importorskip("torch")
    import socket
    import subprocess

    sys.path.insert(0, os.path.dirname(__file__))
    import ddp_worker

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    out = tmp_path / "grads.pt"
    worker = os.path.join(os.path.dirname(__file__), "ddp_worker.py")
    procs = [subprocess.Popen([sys.executable, worker, str(r), "2", str(port), str(out)])
             for r in range(2)]
    assert all(p.wait(timeout=600) == 0 for p in procs)
    got = torch.load(out)
    net = ddp_worker.model().cuda(0)
    x, target = (t.cuda(0) for t in ddp_worker.batch())
    torch.nn.functional.mse_loss(net(x), target).backward()
    for name, p in net.named_parameters():
        want = p.grad.cpu()
        err = float((got[name] - want).abs().max() / want.abs().max())
        assert err <= 1e-5, (name, err)
