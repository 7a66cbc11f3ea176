"""Forward variants that leave a stage out, timed as the benchmark times them (device time).

    python benchmarks/tools/leave_out.py [op:M:N:dtype ...]

For each shape: LayerNorm with gamma and beta, with gamma only, with neither, and RMSNorm with
and without gamma, all on the same x; µs and % of the copy bandwidth of the same run. What the
LayerNorm forward pays over RMSNorm's at the same shape splits into the parameter reads (beta)
and the statistics (the centred second reduction, the mean store).

Then the same kernels with the row reductions left out ("no reductions": each thread's
statistics are its own partial sums, so the output is wrong, but every load, store, staging copy
and the per-element arithmetic stay): what the rows' block reductions and their barriers cost,
and how near the kernel's memory structure alone comes to the copy.
"""

import functools
import sys

import cupy as cp

import cupyln
from cupyln import _compile
from cupyln.bench import copy_bandwidth, device_us, dtype_of, make_inputs, parse_shapes

SHAPES = ["layernorm:16384:8192:bfloat16", "layernorm:4096:16384:float16",
          "layernorm:4096:32768:float16", "layernorm:131072:4096:bfloat16"]
# The forward's row reductions (cupyln/kernels/norm_fwd.cu, chunk_stats: RMSNorm's one, LayerNorm's
# two), each with its barrier (or its cluster exchange).
REDUCTIONS = ("tile_allreduce<CL, WARP, TPR>(s, phase);",
              "tile_allreduce<CL, WARP, TPR>(s, 2 * phase);",
              "tile_allreduce<CL, WARP, TPR>(q, 2 * phase + 1);")


def without_reductions(src):
    """The kernel source with the forward's row reductions removed (each must be found)."""
    for call in REDUCTIONS:
        if src.count(call) != 1:
            raise RuntimeError(f"leave_out: the forward's reduction {call!r} is not in the source")
        src = src.replace(call, "")
    return src


def main(shapes):
    copy = copy_bandwidth()
    print(f"copy {copy:.0f} GB/s", flush=True)
    configs = ((cupyln.Config(), ""),
               (cupyln.Config(source=without_reductions(_compile.source())), ", no reductions"))
    for _, M, N, dt in parse_shapes(shapes):
        dtype = dtype_of(dt)
        x, _, g, b = make_inputs(M, N, dtype)
        variants = [("layernorm gamma+beta", cupyln.layer_norm_fwd, (x, g, b)),
                    ("layernorm gamma", cupyln.layer_norm_fwd, (x, g, None)),
                    ("layernorm none", cupyln.layer_norm_fwd, (x, None, None)),
                    ("rmsnorm gamma", cupyln.rms_norm_fwd, (x, g)),
                    ("rmsnorm none", cupyln.rms_norm_fwd, (x, None))]
        for config, tag in configs:
            for name, fn, args in variants:
                us = device_us(functools.partial(fn, *args, config=config), n_repeat=30)
                gbs = 2 * M * N * dtype.itemsize / us / 1e3  # x read, y written
                print(f"{M:>6}x{N:<6} {dt:<8} {name + tag:<37} {us:8.1f} us "
                      f"{100 * gbs / copy:5.1f}%", flush=True)
        x = g = b = None
        cp.get_default_memory_pool().free_all_blocks()


if __name__ == "__main__":
    main(sys.argv[1:] or SHAPES)
