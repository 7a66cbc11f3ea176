"""The command line's parsers (no CuPy import: ``--help`` and ``--version`` work anywhere)."""

from __future__ import annotations

import argparse

BENCH_DESCRIPTION = """\
Benchmark cupyln against PyTorch and Liger-Kernel (where installed) on one GPU, in one process:
device time (CUDA events, cold L2), GB/s and the fraction of the device-to-device copy
bandwidth measured in the same run, host time per call and first-call compile latency. The
JSON schema is documented in benchmarks/README.md."""


def add_bench_arguments(ap):
    ap.add_argument("--shapes", help="JSON file like benchmark_shapes.json (default: bundled)")
    ap.add_argument("--shape", nargs=4, action="append", metavar=("OP", "M", "N", "DTYPE"),
                    default=[], help="an extra shape, e.g. layernorm 4096 1024 float16")
    ap.add_argument("--only", action="store_true", help="only the --shape shapes")
    ap.add_argument("--no-sweep", action="store_true",
                    help="leave out the long-row sweep (LayerNorm bfloat16, M*N = 2^27)")
    ap.add_argument("--out", default="bench.json", help="JSON output path (default bench.json)")
    ap.add_argument("--plot", default=None, help="PNG plot path (needs matplotlib)")
    ap.add_argument("--no-progress", action="store_true", help="no progress bar")
    return ap


def bench_parser(prog="python -m cupyln.bench"):
    return add_bench_arguments(argparse.ArgumentParser(
        prog=prog, description=BENCH_DESCRIPTION,
        formatter_class=argparse.RawDescriptionHelpFormatter))


def main_parser(version):
    ap = argparse.ArgumentParser(
        prog="python -m cupyln",
        description="cupyln: LayerNorm and RMSNorm for training, on CuPy (NumPy on a CPU).")
    ap.add_argument("--version", action="version", version=f"cupyln {version}")
    sub = ap.add_subparsers(dest="command", metavar="{check,bench,info}")
    sub.add_parser("check", help="compare cupyln with the float64 reference (the default): "
                                 "on the GPU where one is usable, else the NumPy path")
    add_bench_arguments(sub.add_parser(
        "bench", help="the benchmark (needs a GPU)", description=BENCH_DESCRIPTION,
        formatter_class=argparse.RawDescriptionHelpFormatter))
    sub.add_parser("info", help="versions, the device and the compile-cache folder")
    return ap
