"""Where the host time of a hot call goes: cProfile of 2,000 calls at 32x512 float16, plus the
cost of the CuPy primitives a call is built from."""

import cProfile
import pstats

import cupy as cp
import numpy as np

import cupyln
from cupyln.bench import host_us_per_call as per_call
from cupyln.bench import make_inputs

x, dy, g, b = make_inputs(32, 512, np.float16)
y, mean, rstd = cupyln.layer_norm_fwd(x, g, b)
k = cp.RawKernel('extern "C" __global__ void nop(const void* a, long long n, float e) {}', "nop")
print(f"cupy.empty            {per_call(lambda: cp.empty((32, 512), cp.float16)):6.2f} us")
launch = per_call(lambda: k((1,), (32,), (x, np.int64(3), np.float32(1))))
print(f"RawKernel launch      {launch:6.2f} us")
print(f"layer_norm_fwd        {per_call(lambda: cupyln.layer_norm_fwd(x, g, b)):6.2f} us")
bwd = per_call(lambda: cupyln.layer_norm_bwd(dy, x, g, mean, rstd))
print(f"layer_norm_bwd        {bwd:6.2f} us")
for name, fn in (("fwd", lambda: cupyln.layer_norm_fwd(x, g, b)),
                 ("bwd", lambda: cupyln.layer_norm_bwd(dy, x, g, mean, rstd))):
    pr = cProfile.Profile()
    pr.enable()
    for _ in range(2000):
        fn()
    pr.disable()
    print(f"---- {name}: top functions by own time (2000 calls)")
    pstats.Stats(pr).sort_stats("tottime").print_stats(14)
