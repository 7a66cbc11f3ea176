"""Planner configurations and kernel sources timed against each other on one machine.

    python benchmarks/tools/tune.py
    CUPYLN_TUNE_SOURCES=old=old.cu,b=b.cu python benchmarks/tools/tune.py  # other sources too
    CUPYLN_TUNE_PASSES=fwd python benchmarks/tools/tune.py                   # forward only
    CUPYLN_TUNE_SHAPES=layernorm:4096:1024:float16 python benchmarks/tools/tune.py  # other shapes
    CUPYLN_TUNE_SHAPES=rmsnorm_add:64:1048576:bfloat16 python benchmarks/tools/tune.py  # fused add
    CUPYLN_TUNE_BWD='[{"bwd_cluster_npt": 1}, {"source": "old"}]' python benchmarks/tools/tune.py

A configuration is a dict of Config switches and planner rows (fwd_<row>, bwd_<row>), and
"source": the name of a kernel source (the others keep their defaults). Every shape's forward
and backward are timed as the benchmark does under each configuration; the kernels' register and
local-memory use are printed with them, and the copy bandwidth of the same run first; last, a
summary of each configuration's times over the rounds.
"""

import json
import os

import cupy as cp

import cupyln
from cupyln import _compile, _config, _plan
from cupyln.bench import (
    add_cases,
    cases,
    copy_bandwidth,
    device_us,
    dtype_of,
    env_shapes,
    make_inputs,
)

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
# Kernel sources: the shipped one, and others (CUPYLN_TUNE_SOURCES: name=file pairs, each file
# holding all kernels as one translation unit, as _compile.source() makes it).
SOURCES = {"current": None}
for item in filter(None, os.environ.get("CUPYLN_TUNE_SOURCES", "").split(",")):
    name, path = item.split("=", 1)
    SOURCES[name] = open(path).read()
FWD = [dict(source=s) for s in SOURCES] + [dict(stage="always"), dict(stage="never")]
BWD = [dict(source=s) for s in SOURCES] + [
    dict(stage="never"), dict(cluster=False), dict(bwd_cluster_npt=1)]
FWD = json.loads(os.environ.get("CUPYLN_TUNE_FWD", "null")) or FWD
BWD = json.loads(os.environ.get("CUPYLN_TUNE_BWD", "null")) or BWD
PASSES = os.environ.get("CUPYLN_TUNE_PASSES", "fwd,bwd").split(",")


def config_of(fields):
    """The Config of one configuration dict (switches, rows and "source")."""
    fields = dict(fields)
    return _config.config_of(SOURCES[fields.pop("source", "current")], **fields)


def attrs(k):
    return f"regs={k.num_regs} local={k.local_size_bytes}"


def summary(times):
    """Lines of {(op, M, N, dtype, pass): {config: [us, ...]}}: per shape and pass, each
    configuration's times in the order run (a configuration listed several times gives one time
    per round)."""
    lines = []
    for (op, M, N, dt, pass_), by_cfg in times.items():
        runs = " | ".join(f"{cfg}: {', '.join(f'{t:.2f}' for t in ts)}"
                          for cfg, ts in by_cfg.items())
        lines.append(f"{op} {M}x{N} {dt} {pass_}: {runs}")
    return lines


def plan_of(fn, pass_):
    """The plan a call of ``fn`` takes (planned again: its signature's caches cleared), so that
    a row names the kernel that ran (peeled rows and narrower vectors included)."""
    name = f"plan_{pass_}"
    planner, made = getattr(_plan, name), []

    def spy(*args):
        made.append(planner(*args))
        return made[-1]

    cupyln.clear_caches()
    setattr(_plan, name, spy)
    try:
        fn()
    finally:
        setattr(_plan, name, planner)
    return made[-1]


def time_shape(op, M, N, dt, copy, times):
    dtype = dtype_of(dt)
    x, dy, g, b = make_inputs(M, N, dtype)
    for pass_, configs in (("fwd", FWD), ("bwd", BWD)):
        if pass_ not in PASSES:
            continue
        for fields in configs:
            config = config_of(fields)
            made = add_cases if op.endswith("_add") else cases
            label = json.dumps(fields, sort_keys=True)
            try:
                fn = made(op, x, dy, g, b, None, None, config=config)["cupyln", pass_]
                us = device_us(fn, n_repeat=30)
            except Exception as e:  # one config that fails to launch: named, the rest timed
                print(f"{op} {M}x{N} {dt} {pass_} {label}: {type(e).__name__}: {e}", flush=True)
                continue
            times.setdefault((op, M, N, dt, pass_), {}).setdefault(label, []).append(us)
            if op.endswith("_add"):  # the fused add (h in x's dtype): its times alone
                print(f"{op:<13} {M:>6}x{N:<5} {dt:<8} {pass_} {label}: {us:8.2f} us",
                      flush=True)
                continue
            plan = plan_of(fn, pass_)
            gbs = (2 if pass_ == "fwd" else 3) * M * N * dtype.itemsize / us / 1e3
            print(f"{op:<9} {M:>6}x{N:<5} {dt:<8} {pass_} {label} grid={plan.grid} "
                  f"block={plan.block} vec={plan.spec.vec} smem={plan.smem} {plan.variant}"
                  f"{' dynamic' if plan.dynamic else ''} {attrs(plan.kern)}: {us:8.2f} us "
                  f"{gbs:6.0f} GB/s {100 * gbs / copy:5.1f}%", flush=True)


def main():
    assert _compile.source()  # the shipped kernels are readable before any timing
    copy = copy_bandwidth()
    print(f"copy {copy:.0f} GB/s", flush=True)
    times = {}
    for op, M, N, dt in SHAPES:
        time_shape(op, M, N, dt, copy, times)
        cp.get_default_memory_pool().free_all_blocks()
    print("== summary: us per round", *summary(times), sep="\n")


if __name__ == "__main__":
    main()
