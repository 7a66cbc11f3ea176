"""Two readings of kernel SASS, no GPU needed.

    python benchmarks/tools/sass.py stalls ncu_sass.csv [TOP]    # gpu_check.sh's ncu_src stage
    python benchmarks/tools/sass.py ctrl kernels.sass SUBSTRING  # cuobjdump -sass of a cubin

``stalls``: for each kernel of an Nsight Compute source-page export (``ncu --page source --csv
--print-source sass``), the warp-state samples by reason, the instruction mix weighted by
executions, and the TOP instructions by samples with their three largest reasons.

``ctrl``: the SASS of the functions whose name holds SUBSTRING, each instruction with its control
bits decoded from the high word of its encoding (sm_70 on): stall cycles, the scoreboard it sets
for its result (W) and for its operands' reuse (R), and the scoreboards it waits on. This shows
which earlier load an instruction waits for (once: a join that waited on the next row's
prefetched statistics).
"""

import collections
import csv
import re
import sys

SAMPLES = "Warp Stall Sampling (All Samples)"
EXECUTED = "Instructions Executed"


def _kernels(path):
    """[(name, header, rows)] of a source-page CSV (one header line per kernel)."""
    out = []
    for r in csv.reader(open(path)):
        if r and r[0] == "Kernel Name":
            out.append((r[1], None, []))
        elif r and r[0] == "Address" and out:
            out[-1] = (out[-1][0], r, [])
        elif out and out[-1][1] and len(r) == len(out[-1][1]):
            out[-1][2].append(r)
    return out


def _opcode(src):
    m = re.match(r"\s*(@!?U?P\w+\s+)?([A-Z0-9_]+)", src)
    return m.group(2) if m else "?"


def stalls(path, top=30):
    for name, head, rows in _kernels(path):
        if head is None:  # a kernel without a source page
            continue
        col = {c: i for i, c in enumerate(head)}

        def num(r, c, col=col):
            return float(r[col[c]] or 0) if c in col else 0.0

        total = sum(num(r, SAMPLES) for r in rows) or 1.0
        executed = sum(num(r, EXECUTED) for r in rows) or 1.0
        reasons = [c for c in head if c.startswith("stall_") and "Not Issued" not in c]
        by = sorted(((sum(num(r, c) for r in rows), c[6:]) for c in reasons), reverse=True)
        mix = collections.Counter()
        for r in rows:
            mix[_opcode(r[col["Source"]])] += num(r, EXECUTED)
        print(f"== {name[:120]}")
        print(f"   {len(rows)} instructions, {executed:.0f} warp instructions executed, "
              f"{total:.0f} samples")
        print("   by reason: "
              + ", ".join(f"{n} {v / total:.1%}" for v, n in by if v / total > .005))
        print("   mix: " + ", ".join(f"{k} {v / executed:.1%}" for k, v in mix.most_common(16)))
        order = sorted(range(len(rows)), key=lambda i: -num(rows[i], SAMPLES))
        for i in order[:top]:
            r = rows[i]
            s = num(r, SAMPLES)
            why = sorted(((num(r, c), c[6:]) for c in reasons), reverse=True)[:3]
            print(f"   {i:5d} {s / total:6.1%} x{num(r, EXECUTED):>9.0f}  "
                  f"{r[col['Source']].strip()[:64]:64s} "
                  + " ".join(f"{n}:{v / s:.0%}" for v, n in why if v))


def ctrl(path, want):
    on, cur, idx = False, None, 0
    for line in open(path):
        if "Function :" in line:
            on, idx = want in line, 0
            if on:
                print(line.strip())
            continue
        if not on:
            continue
        m = re.match(r"\s*/\*([0-9a-f]{4,})\*/\s+(.*?)\s*;?\s*/\* (0x[0-9a-f]+) \*/", line)
        if m:
            cur = (m.group(1), m.group(2).rstrip(" ;"))
            continue
        m = re.match(r"\s*/\* (0x[0-9a-f]+) \*/", line)
        if m and cur:
            hi = int(m.group(1), 16)
            stall, wb, rb = (hi >> 41) & 0xF, (hi >> 46) & 7, (hi >> 49) & 7
            wait = (hi >> 52) & 0x3F
            bits = "".join(str(b) for b in range(6) if wait >> b & 1)
            wr = f"W{wb}" if wb != 7 else "--"
            rd = f"R{rb}" if rb != 7 else "--"
            waits = f"wait[{bits}]" if bits else ""
            print(f"{idx:5d} {cur[0]} S{stall:02d} {wr} {rd} {waits:9s} {cur[1]}")
            idx, cur = idx + 1, None


if __name__ == "__main__":
    if len(sys.argv) < 3 or sys.argv[1] not in ("stalls", "ctrl"):
        sys.exit(__doc__)
    if sys.argv[1] == "stalls":
        stalls(sys.argv[2], int(sys.argv[3]) if len(sys.argv) > 3 else 30)
    else:
        ctrl(sys.argv[2], sys.argv[3])
