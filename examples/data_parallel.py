"""Data-parallel LayerNorm backward over the visible GPUs, gradients all-reduced with NCCL.

Each GPU runs forward and backward on its shard of the batch; dgamma/dbeta are summed over the
GPUs with NCCL all-reduce (one process driving every GPU, the calls grouped). The result must
match the single-GPU backward of the whole batch.

    python examples/data_parallel.py [--rows M] [--cols N]
"""

import argparse
import os
import sys

os.environ["NCCL_NVLS_ENABLE"] = "0"  # never NVLink multicast: it can take shared hosts down

import numpy as np  # noqa: E402

import cupyln  # noqa: E402
from cupyln._device import gpu  # noqa: E402


def data_parallel_backward(x, dy, gamma, devices, deterministic=True):
    """Shard the rows of host arrays x, dy over `devices`; return, per device, (dx shard,
    dgamma, dbeta) with dgamma/dbeta all-reduced (summed) over the devices."""
    import cupy as cp
    from cupy.cuda import nccl

    types = {np.dtype(np.float32): nccl.NCCL_FLOAT32, np.dtype(np.float64): nccl.NCCL_FLOAT64,
             np.dtype(np.float16): nccl.NCCL_FLOAT16}
    shards = np.array_split(np.arange(x.shape[0]), len(devices))
    comms = nccl.NcclCommunicator.initAll(list(devices))
    outs = []
    for dev, rows in zip(devices, shards, strict=True):
        with cp.cuda.Device(dev):
            xs, dys, g = cp.asarray(x[rows]), cp.asarray(dy[rows]), cp.asarray(gamma)
            _, mean, rstd = cupyln.layer_norm_fwd(xs, g)
            outs.append(cupyln.layer_norm_bwd(dys, xs, g, mean, rstd,
                                              deterministic=deterministic))
    nccl.groupStart()
    for dev, comm, (_, dg, db) in zip(devices, comms, outs, strict=True):
        with cp.cuda.Device(dev):
            stream = cp.cuda.get_current_stream().ptr
            for a in (dg, db):
                comm.allReduce(a.data.ptr, a.data.ptr, a.size, types[a.dtype],
                               nccl.NCCL_SUM, stream)
    nccl.groupEnd()
    for dev in devices:
        cp.cuda.Device(dev).synchronize()
    return outs


def main(M=8192, N=4096):
    import cupy as cp

    ndev = cp.cuda.runtime.getDeviceCount()
    rng = np.random.default_rng(0)
    x = (-2.3 + 0.5 * rng.standard_normal((M, N))).astype(np.float16)
    dy = (0.1 * rng.standard_normal((M, N))).astype(np.float16)
    gamma = (1 + 0.2 * rng.standard_normal(N)).astype(np.float32)
    outs = data_parallel_backward(x, dy, gamma, list(range(ndev)))
    with cp.cuda.Device(0):  # the whole batch on one GPU
        xs, dys, g = cp.asarray(x), cp.asarray(dy), cp.asarray(gamma)
        _, mean, rstd = cupyln.layer_norm_fwd(xs, g)
        _, dg1, db1 = cupyln.layer_norm_bwd(dys, xs, g, mean, rstd, deterministic=True)
        dg1, db1 = dg1.get(), db1.get()
    worst = 0.0
    for _, dg, db in outs:
        for got, want in ((dg.get(), dg1), (db.get(), db1)):
            worst = max(worst, float(np.abs(got - want).max() / np.abs(want).max()))
    print(f"{ndev} GPU(s), {M}x{N} float16: max |all-reduced - single GPU| / max = {worst:.2e}")
    return worst


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rows", type=int, default=8192, help="rows M of the batch (8192)")
    ap.add_argument("--cols", type=int, default=4096, help="normalized size N (4096)")
    a = ap.parse_args()
    cp_, why = gpu()
    if cp_ is None:
        sys.exit(f"data_parallel.py needs one or more GPUs: {why}")
    sys.exit(0 if main(a.rows, a.cols) <= 1e-4 else 1)
