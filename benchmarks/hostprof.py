"""Where the host time of a hot call goes: the cost of the pieces a call is built from, then
cProfile of 2,000 calls at 32x512 float16."""

import cProfile
import pstats

import cupy as cp
import numpy as np

import cupyln
from cupyln import _launch
from cupyln._driver import Launcher
from cupyln.bench import host_us_per_call as per_call
from cupyln.bench import make_inputs

x, dy, g, b = make_inputs(32, 512, np.float16)
y, mean, rstd = cupyln.layer_norm_fwd(x, g, b)
k = cp.RawKernel('extern "C" __global__ void nop(const void* a, long long n, float e) {}', "nop")
k((1,), (32,), (x, np.int64(3), np.float32(1)))
lk = Launcher(k, (1,), (32,), 0, "pif")
mem = cp.cuda.alloc(1 << 16)
xp = x.data.ptr
pieces = {
    "cupy.empty": lambda: cp.empty((32, 512), cp.float16),
    "cupy.cuda.alloc": lambda: cp.cuda.alloc(32 * 512 * 2),
    "ndarray(shape, dtype, memptr)": lambda: cp.ndarray((32, 512), cp.float16, mem),
    "memptr + offset": lambda: mem + 256,
    "runtime.getDevice": cp.cuda.runtime.getDevice,
    "get_current_stream().ptr": lambda: cp.cuda.get_current_stream().ptr,
    "x.data.ptr": lambda: x.data.ptr,
    "RawKernel launch (3 args)": lambda: k((1,), (32,), (x, np.int64(3), np.float32(1))),
    "Launcher launch (3 args)": lambda: lk(0, xp, 3, 1.0),
    "runtime.streamIsCapturing": lambda: cp.cuda.runtime.streamIsCapturing(0),
    "layer_norm_fwd": lambda: cupyln.layer_norm_fwd(x, g, b),
    "layer_norm_bwd": lambda: cupyln.layer_norm_bwd(dy, x, g, mean, rstd),
}
for name, fn in pieces.items():
    print(f"{name:<32} {per_call(fn):7.2f} us")
_launch.ATOMIC_FLUSH = True  # one kernel: the atomic flush
_launch.clear_caches()
print(f"{'layer_norm_bwd (atomic flush)':<32} "
      f"{per_call(lambda: cupyln.layer_norm_bwd(dy, x, g, mean, rstd)):7.2f} us")
_launch.ATOMIC_FLUSH = False
_launch.clear_caches()
for name, fn in (("fwd", lambda: cupyln.layer_norm_fwd(x, g, b)),
                 ("bwd", lambda: cupyln.layer_norm_bwd(dy, x, g, mean, rstd))):
    pr = cProfile.Profile()
    pr.enable()
    for _ in range(2000):
        fn()
    pr.disable()
    print(f"---- {name}: top functions by own time (2000 calls)")
    pstats.Stats(pr).sort_stats("tottime").print_stats(12)
