"""``cupyln [check|bench|info|docs]`` (or ``python -m cupyln``): see ``cupyln --help``."""

from __future__ import annotations

import os
import sys
from pathlib import Path

from . import __version__
from ._cli import main_parser
from ._device import GPU_EXTRAS, gpu, require_gpu, with_hint


def _table(title, table):
    from . import check as _check

    print(title)
    print(_check.format_table(table))
    return [r for r in table if not r[-1]]


def check():
    import numpy as np

    from . import check as _check

    cp, what = gpu()
    xp, where = (np, "the NumPy path (CPU)") if cp is None else (cp, f"the GPU ({what})")
    if cp is None:
        print(f"{with_hint(what)}. Checking the NumPy path.")
    grads = _check.gradient_table(xp)
    bad = _table(f"\n1. gradients on {where}: each backward output against central finite "
                 "differences of the forward, float64", grads)
    if cp is None:
        title = ("2. precision on the NumPy path: float16, bfloat16 and float32 outputs against "
                 "the float64 reference (the reference rounded once to the output's dtype)")
    else:
        title = (f"2. precision on the GPU ({what}): the kernels' outputs against the float64 "
                 "NumPy reference")
    table = _check.self_check(xp)
    bad += _table("\n" + title, table)
    rows = len(grads) + len(table)
    print(f"\n{rows - len(bad)}/{rows} outputs within tolerance")
    return 0 if not bad else 1


def info():
    import numpy as np

    print(f"cupyln {__version__} ({os.path.dirname(os.path.abspath(__file__))})")
    print(f"python {sys.version.split()[0]}, numpy {np.__version__}")
    try:
        import cupy
    except ImportError as e:
        print(f"cupy: not installed ({e}); only NumPy arrays are accepted; for the GPU, "
              f"{GPU_EXTRAS}")
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


def docs():
    """The contract: the package's copy of docs/api.md (a checkout's where not installed)."""
    here = Path(__file__).resolve().parent
    path = here / "docs" / "api.md"
    print((path if path.exists() else here.parent / "docs" / "api.md").read_text(), end="")
    return 0


def main(argv=None):
    prog = "cupyln" if Path(sys.argv[0]).name == "cupyln" else "python -m cupyln"
    parser = main_parser(__version__, prog)
    args, rest = parser.parse_known_args(argv)
    if rest and args.command != "bench":
        parser.parse_args(argv)  # exits 2 naming the unknown arguments
    if args.command == "info":
        return info()
    if args.command == "docs":
        return docs()
    if args.command == "bench":
        try:
            require_gpu("the benchmark")
        except RuntimeError as e:
            print(e, file=sys.stderr)
            return 1
        from . import bench

        return bench.run_args(args)
    return check()


def console():
    """The ``cupyln`` console script."""
    sys.exit(main())


if __name__ == "__main__":
    console()
