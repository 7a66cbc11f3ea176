"""Where the host time of a hot call goes: the cost of the pieces a call is built from, the
calls themselves (default and with out=; also those of another copy of the package, to compare
host paths in one process), then cProfile of 2,000 calls at 32x512 float16.

    python benchmarks/hostprof.py                 # this package
    python benchmarks/hostprof.py OLD_DIR         # and OLD_DIR/cupyln_old (a renamed copy)
"""

import cProfile
import importlib
import pstats
import sys

import cupy as cp
import numpy as np
from cupy_backends.cuda.api import driver as drv

import cupyln
from cupyln import _layout
from cupyln._driver import Launcher
from cupyln.bench import host_us_per_call as per_call
from cupyln.bench import make_inputs

x, dy, g, b = make_inputs(32, 512, np.float16)
y, mean, rstd = cupyln.layer_norm_fwd(x, g, b)
k = cp.RawKernel('extern "C" __global__ void nop(const void* a, long long n, float e) {}', "nop")
k((1,), (32,), (x, np.int64(3), np.float32(1)))
lk = Launcher(k, (1,), (32,), 0, "pif")
lk._pack(lk._buf, 0, x.data.ptr, 3, 1.0)
dims = lk._dims
params = lk._params_ptr
mem = cp.cuda.alloc(1 << 16)
xp = x.data.ptr
F16 = np.dtype(np.float16)
print("fast constructor in use:", _layout._ndarray.__name__ == "fast")
pieces = {
    "cupy.empty": lambda: cp.empty((32, 512), cp.float16),
    "cupy.cuda.alloc": lambda: cp.cuda.alloc(32 * 512 * 2),
    "ndarray(shape, dtype, memptr)": lambda: cp.ndarray((32, 512), cp.float16, mem),
    "ndarray(shape, np.dtype, memptr)": lambda: cp.ndarray((32, 512), F16, mem),
    "_layout._ndarray (fast constructor)": lambda: _layout._ndarray((32, 512), F16, mem),
    "memptr + offset": lambda: mem + 256,
    "runtime.getDevice": cp.cuda.runtime.getDevice,
    "get_current_stream().ptr": lambda: cp.cuda.get_current_stream().ptr,
    "x.data.ptr": lambda: x.data.ptr,
    "signature of x": lambda: (type(x), x.shape, x.strides, x.dtype, x.data.device_id),
    "RawKernel launch (3 args)": lambda: k((1,), (32,), (x, np.int64(3), np.float32(1))),
    "driver.launchKernel (args packed)": lambda: drv.launchKernel(*dims, 0, params, 0),
    "Launcher launch (3 args)": lambda: lk(0, xp, 3, 1.0),
    "runtime.streamIsCapturing": lambda: cp.cuda.runtime.streamIsCapturing(0),
}
# A default forward call, step by step: its signature, the lookup, the prepared pass (pointers,
# allocation, arrays, launch), and the floor of what a call must do (allocation, three arrays,
# one launch).
key = cupyln.api._key((True, 1e-5), (x, g, b), None)
hot = cupyln.api._HOT[key]
oy, om, orr = (off for _, _, off in hot.layout.parts)  # y, mean, rstd in one allocation


def floor():
    arrays, m = hot.layout.make()
    p = m.ptr
    hot.launch(0, xp, 512, g.data.ptr, b.data.ptr, p + oy, p + om, p + orr, 32, 512, 1e-5)
    return arrays


pieces.update({
    "fwd step: signature (_key)": lambda: cupyln.api._key((True, 1e-5), (x, g, b), None),
    "fwd step: signature + lookup": lambda: cupyln.api._HOT.get(
        cupyln.api._key((True, 1e-5), (x, g, b), None)),
    "fwd step: layout.make": hot.layout.make,
    "fwd step: prepared pass": lambda: hot(x, g, b, None),
    "fwd floor (alloc, 3 arrays, launch)": floor,
})
for name, fn in pieces.items():
    print(f"{name:<36} {per_call(fn):7.2f} us")


def calls(pkg):
    fo = (cp.empty_like(x), cp.empty(32, cp.float32), cp.empty(32, cp.float32))
    bo = (cp.empty_like(x), cp.empty_like(g), cp.empty_like(b))
    return {"fwd": lambda: pkg.layer_norm_fwd(x, g, b),
            "bwd": lambda: pkg.layer_norm_bwd(dy, x, g, mean, rstd),
            "fwd out=": lambda: pkg.layer_norm_fwd(x, g, b, out=fo),
            "bwd out=": lambda: pkg.layer_norm_bwd(dy, x, g, mean, rstd, out=bo),
            "rms fwd": lambda: pkg.rms_norm_fwd(x, g),
            "rms bwd": lambda: pkg.rms_norm_bwd(dy, x, g, rstd)}


pkgs = {"cupyln": cupyln}
if len(sys.argv) > 1:
    sys.path.insert(0, sys.argv[1])
    pkgs["cupyln_old"] = importlib.import_module("cupyln_old")
table = {name: calls(p) for name, p in pkgs.items()}
for _ in range(3):  # alternate the packages: the host's speed drifts during a run
    for name, fns in table.items():
        print(f"{name:<11} " + "  ".join(f"{c} {per_call(fn):6.2f}" for c, fn in fns.items())
              + " us")
atomic = cupyln.Config(bwd=cupyln.BwdConfig(atomic_flush=True))  # one kernel: the atomic flush
print(f"{'layer_norm_bwd (atomic flush)':<36} "
      f"{per_call(lambda: cupyln.layer_norm_bwd(dy, x, g, mean, rstd, config=atomic)):7.2f} us")
for name, fn in list(table["cupyln"].items())[:2]:
    pr = cProfile.Profile()
    pr.enable()
    for _ in range(2000):
        fn()
    pr.disable()
    print(f"---- {name}: top functions by own time (2000 calls)")
    pstats.Stats(pr).sort_stats("tottime").print_stats(12)
