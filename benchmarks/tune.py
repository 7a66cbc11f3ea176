"""Variants timed on one machine: the planner's geometry constants, and the kernel source.

    python benchmarks/tune.py
    CUPYLN_TUNE_SOURCES=old=old.cu,b=b.cu python benchmarks/tune.py   # also other kernel sources
    CUPYLN_TUNE_PASSES=fwd python benchmarks/tune.py                   # forward only
    CUPYLN_TUNE_SHAPES=layernorm:4096:1024:float16 python benchmarks/tune.py  # other shapes

For each configuration the compile and plan caches are cleared, and every shape's forward and
backward are timed as the benchmark does; the kernels' register and local-memory use are
printed with them, and the copy bandwidth of the same run first; last, a summary of each
configuration's times over the rounds.
"""

import json
import os

import cupy as cp

from cupyln import _compile, _launch
from cupyln.bench import cases, copy_bandwidth, device_us, dtype_of, env_shapes, make_inputs

SHAPES = [("layernorm", 4096, 1024, "float16"), ("layernorm", 131072, 4096, "bfloat16"),
          ("layernorm", 4096, 1024, "float32"), ("rmsnorm", 131072, 64, "float16"),
          ("layernorm", 16384, 8192, "bfloat16"), ("layernorm", 4096, 8192, "float16"),
          ("layernorm", 1151, 8192, "float16"), ("layernorm", 131072, 64, "float16"),
          ("layernorm", 1024, 768, "float16"), ("layernorm", 192, 1024, "bfloat16"),
          ("layernorm", 96, 768, "float16"), ("layernorm", 32, 512, "float16"),
          ("rmsnorm", 131072, 4096, "bfloat16"), ("layernorm", 4096, 2048, "float16"),
          ("layernorm", 4096, 4096, "float16"), ("rmsnorm", 16384, 8192, "bfloat16")]
# CUPYLN_TUNE_SHAPES="op:M:N:dtype,..." times those instead.
SHAPES = env_shapes("CUPYLN_TUNE_SHAPES", SHAPES)
# Kernel sources: the current one, and others (CUPYLN_TUNE_SOURCES: name=file pairs, each file
# holding all kernels as one translation unit, as _compile.source() makes it).
SOURCES = {"current": _compile.source}
for item in filter(None, os.environ.get("CUPYLN_TUNE_SOURCES", "").split(",")):
    name, path = item.split("=", 1)
    SOURCES[name] = lambda path=path: open(path).read()
# Each configuration: the kernel source and planner constants of _launch (the others keep the
# module's values).
FWD = [dict(SOURCE=s) for s in SOURCES] + [
    dict(SOURCE="current", FWD_STAGE="always"), dict(SOURCE="current", FWD_STAGE="never")]
BWD = [dict(SOURCE=s) for s in SOURCES] + [
    dict(SOURCE="current", BWD_STAGE="never"), dict(SOURCE="current", BWD_CLUSTER=False),
    dict(SOURCE="current", CLUSTER_NPT=1)]
# CUPYLN_TUNE_FWD / CUPYLN_TUNE_BWD='[{"SOURCE": "current", "CLUSTER_NPT": 1}, ...]' (JSON) time
# those configurations instead.
FWD = json.loads(os.environ.get("CUPYLN_TUNE_FWD", "null")) or FWD
BWD = json.loads(os.environ.get("CUPYLN_TUNE_BWD", "null")) or BWD
PASSES = os.environ.get("CUPYLN_TUNE_PASSES", "fwd,bwd").split(",")
DEFAULTS = {k: getattr(_launch, k) for cfg in FWD + BWD for k in cfg if k != "SOURCE"}


def attrs(k):
    return f"regs={k.num_regs} local={k.local_size_bytes}"


def summary(times):
    """Lines of {(op, M, N, dtype, pass): {config: [us, ...]}}: per shape and pass, each
    configuration's times in the order run (a configuration listed several times in
    CUPYLN_TUNE_FWD/BWD gives one time per round)."""
    lines = []
    for (op, M, N, dt, pass_), by_cfg in times.items():
        runs = " | ".join(f"{cfg}: {', '.join(f'{t:.2f}' for t in ts)}"
                          for cfg, ts in by_cfg.items())
        lines.append(f"{op} {M}x{N} {dt} {pass_}: {runs}")
    return lines


def main():
    copy = copy_bandwidth()
    print(f"copy {copy:.0f} GB/s", flush=True)
    times = {}
    for op, M, N, dt in SHAPES:
        dtype = dtype_of(dt)
        x, dy, g, b = make_inputs(M, N, dtype)
        isz = dtype.itemsize
        for pass_, configs in (("fwd", FWD), ("bwd", BWD)):
            if pass_ not in PASSES:
                continue
            for cfg in configs:
                for k, v in {**DEFAULTS, **cfg}.items():
                    if k == "SOURCE":
                        _compile.use_source(SOURCES[v])
                    else:
                        setattr(_launch, k, v)
                _launch.clear_caches()
                fn = cases(op, x, dy, g, b, None, None)["cupyln", pass_]
                us = device_us(fn, n_repeat=30)
                label = json.dumps(cfg, sort_keys=True)
                times.setdefault((op, M, N, dt, pass_), {}).setdefault(label, []).append(us)
                plan = (_launch.plan_fwd if pass_ == "fwd" else _launch.plan_bwd)(
                    x.device.id, dtype, dtype, op == "layernorm", M, N, 16 // isz)
                vec = plan.spec.vec
                gbs = (2 if pass_ == "fwd" else 3) * M * N * isz / us / 1e3
                print(f"{op:<9} {M:>6}x{N:<5} {dt:<8} {pass_} {cfg} grid={plan.grid} "
                      f"block={plan.block} vec={vec} smem={plan.smem} {plan.variant}"
                      f"{' dynamic' if plan.dynamic else ''} "
                      f"{attrs(plan.kern)}: "
                      f"{us:8.2f} us "
                      f"{gbs:6.0f} GB/s {100 * gbs / copy:5.1f}%", flush=True)
        x = dy = g = b = None
        cp.get_default_memory_pool().free_all_blocks()
    print("== summary: us per round", *summary(times), sep="\n")


if __name__ == "__main__":
    main()
