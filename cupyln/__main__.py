"""``python -m cupyln``: self-check against the reference, then the benchmark table on a GPU.

    python -m cupyln            # self-check; on a GPU also the benchmark
    python -m cupyln check      # self-check only
    python -m cupyln bench ...  # benchmark only (arguments as benchmarks/bench.py)
"""

from __future__ import annotations

import sys

import numpy as np

from . import _check


def _gpu():
    """(cupy module, device name) when a GPU is usable, else (None, reason)."""
    try:
        import cupy

        if cupy.cuda.runtime.getDeviceCount() < 1:
            return None, "no GPU found"
        props = cupy.cuda.runtime.getDeviceProperties(cupy.cuda.Device().id)
        return cupy, props["name"].decode()
    except Exception as e:  # no CuPy, no driver, no device
        return None, f"no usable GPU ({type(e).__name__}: {e})".splitlines()[0]


def run_check(xp, label):
    print(f"self-check on {label}: cupyln vs the NumPy float64 reference")
    table = _check.self_check(xp)
    print(_check.format_table(table))
    bad = [r for r in table if not r[-1]]
    print(f"{len(table) - len(bad)}/{len(table)} outputs within tolerance")
    return not bad


def main(argv=None):
    argv = list(sys.argv[1:] if argv is None else argv)
    cmd = argv.pop(0) if argv and argv[0] in ("check", "bench") else "all"
    cp, what = _gpu()
    if cp is None:
        if cmd == "bench":
            print(f"{what}: the benchmark needs a GPU")
            return 1
        print(f"{what}: running the NumPy path (reference implementation) on the CPU")
        return 0 if run_check(np, "CPU (NumPy path)") else 1
    ok = True
    if cmd in ("all", "check"):
        ok = run_check(cp, f"GPU {what}")
    if cmd in ("all", "bench") and ok:
        from . import bench

        return bench.main(argv)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
