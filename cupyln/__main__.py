"""``python -m cupyln [check|bench|info]``: see ``python -m cupyln --help``."""

from __future__ import annotations

import os
import sys

from . import __version__
from ._cli import main_parser
from ._device import gpu


def run_check(xp, label):
    from . import _check

    print(f"self-check on {label}: cupyln vs the NumPy float64 reference")
    table = _check.self_check(xp)
    print(_check.format_table(table))
    bad = [r for r in table if not r[-1]]
    print(f"{len(table) - len(bad)}/{len(table)} outputs within tolerance")
    return not bad


def check():
    cp, what = gpu()
    if cp is None:
        import numpy as np

        print(f"{what}: running the NumPy path (reference implementation) on the CPU")
        return 0 if run_check(np, "CPU (NumPy path)") else 1
    return 0 if run_check(cp, f"GPU {what}") else 1


def info():
    import numpy as np

    print(f"cupyln {__version__} ({os.path.dirname(os.path.abspath(__file__))})")
    print(f"python {sys.version.split()[0]}, numpy {np.__version__}")
    try:
        import cupy
    except ImportError as e:
        print(f"cupy: not installed ({e}); only NumPy arrays are accepted")
        print("compile cache: none (no CuPy)")
        print("device: none (no CuPy)")
        return 0
    rt = cupy.cuda.runtime
    platform = "ROCm/HIP" if rt.is_hip else "CUDA"
    try:
        ver = rt.runtimeGetVersion()
        print(f"cupy {cupy.__version__}, {platform} runtime {ver // 1000}.{ver % 1000 // 10}")
    except Exception as e:
        print(f"cupy {cupy.__version__}, {platform} runtime unavailable ({type(e).__name__})")
    cache = os.environ.get("CUPY_CACHE_DIR", os.path.expanduser("~/.cupy/kernel_cache"))
    print(f"compile cache: {cache}")
    cp, what = gpu()
    print(f"device: {what}" if cp is not None else f"device: none ({what})")
    return 0


def main(argv=None):
    args, rest = main_parser(__version__).parse_known_args(argv)
    if rest and args.command != "bench":
        main_parser(__version__).parse_args(argv)  # exits 2 naming the unknown arguments
    if args.command == "info":
        return info()
    if args.command == "bench":
        cp, what = gpu()
        if cp is None:
            print(f"the benchmark needs a GPU: {what}", file=sys.stderr)
            return 1
        from . import bench

        return bench.run_args(args)
    return check()


if __name__ == "__main__":
    sys.exit(main())
