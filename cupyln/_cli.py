"""The command line's parsers (no CuPy import: ``--help`` and ``--version`` work anywhere)."""

from __future__ import annotations

import argparse
import textwrap

from ._device import GPU_EXTRAS

CHECK_DESCRIPTION = """\
Check cupyln's numbers and print what was checked, one line per output (the default command).

- Gradients: the backward formulas (LayerNorm, RMSNorm, the fused residual add, a weight
  offset) against central finite differences of the forward, in float64.
- Precision: each pass in float16, bfloat16 and float32 against the float64 reference (the
  errors allowed are the ones the test suite holds the kernels to).
On a usable GPU both run the CuPy kernels (float64 included); without one they run the NumPy
path, whose lower-precision outputs are the float64 reference rounded once.

Exit status 0 when every output is within its tolerance, else 1."""

BENCH_DESCRIPTION = """\
Benchmark cupyln against PyTorch and Liger-Kernel (where installed) on one GPU, in one process:
device time (CUDA events, cold L2), GB/s and the fraction of the device-to-device copy
bandwidth measured in the same run, host time per call and first-call compile latency.
""" + textwrap.fill(f"Needs a GPU: {GPU_EXTRAS}.", 95)

BENCH_SCHEMA = """\
JSON output (schema 1): {schema, device, copy_GBs, versions: {cupyln, cupy, torch, liger},
rows: [...], model_steps: [...]}. A model step is {config, provider, compiled, ms}: a whole
training step of a small model with the provider's norms (python -m cupyln.bench_models --help).
A row is {op, M, N, dtype, pass, provider, us, GBs}:
  op        layernorm, rmsnorm, or their fused residual add layernorm_add / rmsnorm_add, or
            y in float8_e4m3fn layernorm_fp8 / rmsnorm_fp8 (16-bit rows up to 8192)
  pass      fwd, bwd (device time); module_fwd, module_bwd (a PyTorch module's forward, and its
            backward through autograd); fwd_host, bwd_host (host time per call of 2,000
            back-to-back calls at 32x512 float16), *_host_out (the same with out=),
            module_fwd_host, module_bwd_host, module_fwd_nograd_host (a module's calls);
            fwd_compile_cold, bwd_compile_cold (first call, empty compile cache),
            fwd_first_call_warm, bwd_first_call_warm (first call, cache filled)
  provider  cupyln, torch, liger (functions); cupyln_unfused (cupyln's norm and a separate
            add); cupyln.torch, torch.nn, liger.nn (modules); for the float8 ops: cupyln (per-row
            scales), cupyln_static, cupyln_norm (y in x's dtype), torch / torch_static (torch's
            norm, then (y / s).clamp(-448, 448).to(float8_e4m3fn), s per row or static)
  us        microseconds (median); GBs: bytes moved / time (null for host and first-call rows):
            forward 2*M*N*s + parameters + statistics, backward 3*M*N*s + gamma +
            dgamma/dbeta + statistics (s: element size; the fused add 4*M*N*s each; float8:
            (s + 1)*M*N + parameters + statistics + scales)"""


def add_bench_arguments(ap):
    ap.add_argument("--shapes", help="JSON file like benchmark_shapes.json (default: bundled)")
    ap.add_argument("--shape", nargs=4, action="append", metavar=("OP", "M", "N", "DTYPE"),
                    default=[], help="an extra shape, e.g. layernorm 4096 1024 float16")
    ap.add_argument("--only", action="store_true", help="only the --shape shapes")
    ap.add_argument("--no-sweep", action="store_true",
                    help="leave out the long-row sweep (LayerNorm bfloat16, M*N = 2^27)")
    ap.add_argument("--no-models", action="store_true",
                    help="leave out the whole training steps of small models (model_steps)")
    ap.add_argument("--out", default="bench.json", help="JSON output path (default bench.json)")
    ap.add_argument("--plot", default=None, help="PNG plot path (needs matplotlib)")
    ap.add_argument("--no-progress", action="store_true", help="no progress bar")
    return ap


def _bench_parser(make, prog):
    return add_bench_arguments(make(
        prog=prog, description=BENCH_DESCRIPTION, epilog=BENCH_SCHEMA,
        formatter_class=argparse.RawDescriptionHelpFormatter))


def bench_parser(prog="python -m cupyln.bench"):
    return _bench_parser(argparse.ArgumentParser, prog)


def main_parser(version, prog="python -m cupyln"):
    ap = argparse.ArgumentParser(
        prog=prog,
        description="cupyln: LayerNorm and RMSNorm for training, on CuPy (NumPy on a CPU). "
                    "Without a command: check.")
    ap.add_argument("--version", action="version", version=f"cupyln {version}")
    sub = ap.add_subparsers(dest="command", metavar="{check,bench,info,docs}")
    raw = argparse.RawDescriptionHelpFormatter
    sub.add_parser("check", help="check gradients and precision against float64 (the default)",
                   description=CHECK_DESCRIPTION, formatter_class=raw)
    _bench_parser(lambda **kw: sub.add_parser(
        "bench", help="the benchmark against PyTorch and Liger-Kernel (needs a GPU)", **kw),
        f"{prog} bench")
    sub.add_parser("info", help="versions, the device and the compile-cache folder",
                   description="Print cupyln's, Python's, NumPy's and CuPy's versions, the GPU "
                               "cupyln would use (or why none) and CuPy's compile-cache folder.")
    sub.add_parser("docs", help="print the API contract (docs/api.md, shipped in the package)",
                   description="Print cupyln's API contract: every function, its shapes, dtypes, "
                               "errors, determinism and streams (the package's docs/api.md).")
    return ap
