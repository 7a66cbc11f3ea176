"""Kernel durations of the small benchmark shapes under Nsight Compute: every provider, and
cupyln with planner variants, one profiled call each after warm-up, behind an L2 flush.

    ncu --csv --metrics "$(python benchmarks/tools/small_kernels.py --metrics)" \\
        --profile-from-start off --log-file k.csv python benchmarks/tools/small_kernels.py cases.txt
    python benchmarks/tools/small_kernels.py --table cases.txt k.csv
    CUPYLN_SMALL_SHAPES=layernorm:4096:4096:float16 ...            # other shapes

The first command writes the case of each profiled group to cases.txt; the second sums each
group's kernels (the flush kernel separates the groups) and prints a table: microseconds, and
per kernel the busiest SM's active cycles and the warp instructions executed. With `--metrics
stalls` instead, the kernels' warp stall reasons (cycles per issued instruction, by reason) are
collected, and the table lists them per kernel.
"""

import csv
import os
import sys

from cupyln.bench import env_shapes

SHAPES = [("layernorm", 32, 512, "float16"), ("layernorm", 96, 768, "float16"),
          ("layernorm", 192, 1024, "bfloat16"), ("layernorm", 1024, 768, "float16"),
          ("rmsnorm", 32, 512, "float16")]
# CUPYLN_SMALL_SHAPES="op:M:N:dtype,..." profiles those instead (the format of tune.py's).
SHAPES = env_shapes("CUPYLN_SMALL_SHAPES", SHAPES)
# cupyln variants: forward config fields set for the case (the others keep their defaults), and
# other kernel sources as in tune.py (CUPYLN_TUNE_SOURCES: name=file pairs)
VARIANTS = {"cupyln": {}, "cupyln small_m=False": {"fwd_small_m": False}}
for item in filter(None, os.environ.get("CUPYLN_TUNE_SOURCES", "").split(",")):
    name, path = item.split("=", 1)
    VARIANTS[f"cupyln {name}"] = {"source": path}
FLUSH = "l2_flush"
DURATION, ACTIVE = "gpu__time_duration.sum", "sm__cycles_active.max"
INSTR = "smsp__inst_executed.sum"
READ, WRITE = "dram__bytes_read.sum", "dram__bytes_write.sum"
METRICS = ",".join((DURATION, ACTIVE, INSTR, READ, WRITE))
_STALL = "smsp__average_warps_issue_stalled_"
STALLS = ["long_scoreboard", "short_scoreboard", "wait", "barrier", "no_instruction", "imc_miss",
          "membar", "drain"]
STALL_METRICS = ",".join([f"{_STALL}{r}_per_issue_active.ratio" for r in STALLS]
                         + ["smsp__average_warps_active_per_issue_active.ratio"])


def run(cases_path):
    import cupy as cp
    import numpy as np

    from cupyln._config import config_of
    from cupyln.bench import _liger, _torch, cases, dtype_of, make_inputs

    flush_buf = cp.empty(256 << 20, cp.uint8)
    flush = cp.RawKernel(f'extern "C" __global__ void {FLUSH}(unsigned int* p, long long n) {{'
                         "for (long long i = blockIdx.x * (long long)blockDim.x + threadIdx.x;"
                         " i < n; i += (long long)gridDim.x * blockDim.x) p[i] = 0; }", FLUSH)
    torch, liger = _torch(), _liger()

    labels = []
    for op, M, N, dt in SHAPES:
        x, dy, g, b = make_inputs(M, N, dtype_of(dt))
        for name, variant in VARIANTS.items():
            fields = {k: v for k, v in variant.items() if k != "source"}
            path = variant.get("source")
            config = config_of(source=None if path is None else open(path).read(), **fields)
            peers = (torch, liger) if name == "cupyln" else (None, None)  # peers once per shape
            for (prov, pass_), fn in cases(op, x, dy, g, b, *peers, config=config).items():
                fn(), fn()  # compile, plan, warm
                cp.cuda.runtime.deviceSynchronize()
                cp.cuda.profiler.start()
                flush((1024,), (256,), (flush_buf, np.int64(flush_buf.size // 4)))
                fn()
                cp.cuda.runtime.deviceSynchronize()
                cp.cuda.profiler.stop()
                labels.append(f"{op} {M}x{N} {dt} {pass_} {name if prov == 'cupyln' else prov}")
    with open(cases_path, "w") as f:
        f.write("\n".join(labels) + "\n")


def table(cases_path, csv_path):
    labels = open(cases_path).read().split("\n")[:-1]
    lines = [ln for ln in open(csv_path) if ln.startswith('"')]
    kernels = {}  # ID -> (name, {metric: value})
    for row in csv.DictReader(lines):
        value = float(row["Metric Value"].replace(",", ""))
        if row["Metric Name"] == DURATION:
            value *= {"nsecond": 1e-3, "ns": 1e-3, "usecond": 1.0, "us": 1.0, "msecond": 1e3,
                      "ms": 1e3}[row["Metric Unit"]]
        elif row["Metric Name"] in (READ, WRITE):  # in MB
            value *= {"byte": 1e-6, "Kbyte": 1e-3, "Mbyte": 1.0, "Gbyte": 1e3}[row["Metric Unit"]]
        kernels.setdefault(int(row["ID"]), (row["Kernel Name"], {}))[1][row["Metric Name"]] = value
    groups = []
    for _, (name, m) in sorted(kernels.items()):
        if name.startswith(FLUSH):
            groups.append([])
        elif groups:
            groups[-1].append(m)
    if groups and groups[0] and DURATION not in groups[0][0]:  # stall reasons
        total = "smsp__average_warps_active_per_issue_active.ratio"
        print(f"{'case':<52} cycles per issued instruction: total ({', '.join(STALLS)})")
        for label, ks in zip(labels, groups, strict=False):
            for k in ks:
                parts = " ".join(f"{k.get(f'{_STALL}{r}_per_issue_active.ratio', 0):.1f}"
                                 for r in STALLS)
                print(f"{label:<52} {k.get(total, 0):5.1f} ({parts})")
        return
    print(f"{'case':<52} {'us':>6}  per kernel: us / busiest SM's active cycles / warp instr."
          " / DRAM MB read / written")
    for label, ks in zip(labels, groups, strict=False):
        parts = " + ".join(f"{k.get(DURATION, 0):.2f}/{k.get(ACTIVE, 0):.0f}/{k.get(INSTR, 0):.0f}"
                           f"/{k.get(READ, 0):.1f}/{k.get(WRITE, 0):.1f}" for k in ks)
        print(f"{label:<52} {sum(k.get(DURATION, 0) for k in ks):6.2f}  ({parts})")
    if len(labels) != len(groups):
        print(f"warning: {len(labels)} cases but {len(groups)} profiled groups")


if __name__ == "__main__":
    if sys.argv[1] == "--table":
        table(sys.argv[2], sys.argv[3])
    elif sys.argv[1] == "--metrics":
        print(STALL_METRICS if sys.argv[2:] == ["stalls"] else METRICS)
    else:
        run(sys.argv[1])
