"""The long-row, fused-add and float8 targets, met or missed, read from one record.

    python benchmarks/targets.py RECORD.json [OLD.json] [-v]   # OLD: "no pass 2% slower"

A line per target: met / MISSED, the worst case and its margin (-v: then every missed case).
Only cupyln's device-time rows count; a target whose rows the record lacks says so, not met.
"""

import json
import sys

LARGE = 256 << 20  # bytes of one row array from which a pass must reach the bandwidth targets
SIZES = {"float16": 2, "bfloat16": 2, "float32": 4, "float64": 8}


def load(path):
    """(copy GB/s, {(op, M, N, dtype, pass, provider): row}) of a record's device-time rows."""
    with open(path) as f:
        rec = json.load(f)
    rows = {(r["op"], r["M"], r["N"], r["dtype"], r["pass"], r["provider"]): r
            for r in rec["rows"] if r["GBs"] is not None and r["us"] is not None}
    return rec["copy_GBs"], rows


def worst(cases):
    """The case of least margin: cases are (margin, text); a margin below 0 misses."""
    if not cases:
        return "no rows  (the record lacks them)"
    m, text = min(cases)
    return f"{'met   ' if m >= 0 else 'MISSED'}  worst {text}  ({len(cases)} passes)"


def bandwidth(copy, rows, ops, pass_, need, large=True):
    """Margins of cupyln's passes against a fraction of copy."""
    out = []
    for (op, M, N, dt, p, prov), r in rows.items():
        if op in ops and p == pass_ and prov == "cupyln" and (M * N * SIZES[dt] >= LARGE) == large:
            frac = r["GBs"] / copy
            out.append((frac - need, f"{op} {M}x{N} {dt} {100 * frac:.1f}%"))
    return out


def peers(rows, provider="cupyln"):
    """Margins of cupyln against the fastest peer of each pass (a peer's time / cupyln's - 1)."""
    out = []
    for (op, M, N, dt, p, prov), r in rows.items():
        others = [o["us"] for k, o in rows.items() if k[:5] == (op, M, N, dt, p)
                  and k[5] in ("torch", "liger")]
        if prov == provider and p in ("fwd", "bwd") and others:
            best = min(others)
            text = f"{op} {M}x{N} {dt} {p} {r['us']:.1f} / peer {best:.1f} us"
            out.append((best / r["us"] - 1, text))
    return out


def shape_us(rows, op, M, N, dt, pass_, limit):
    r = rows.get((op, M, N, dt, pass_, "cupyln"))
    return [] if r is None else [(limit - r["us"], f"{op} {M}x{N} {dt} {pass_} {r['us']:.2f} us")]


def fused(copy, rows):
    """The fused passes' fraction of copy against the plain pass's, and the speed-ups."""
    frac, speed = {"fwd": [], "bwd": []}, {"fwd": [], "bwd": []}
    for (op, M, N, dt, p, prov), r in rows.items():
        if not op.endswith("_add") or prov != "cupyln":
            continue
        plain = rows.get((op[:-4], M, N, dt, p, "cupyln"))
        if plain is not None and M * N * SIZES[dt] >= LARGE:
            f, g = r["GBs"] / copy, plain["GBs"] / copy
            frac[p].append((f - g, f"{op} {M}x{N} {dt} {100 * f:.1f}% / plain {100 * g:.1f}%"))
        unfused = rows.get((op, M, N, dt, p, "cupyln_unfused"))
        if unfused is not None:
            need = 1.2 if p == "fwd" else 1.4
            x = unfused["us"] / r["us"]
            speed[p].append((x - need, f"{op} {M}x{N} {dt} {x:.2f}x"))
    return frac, speed


def quantize_speed(rows):
    """Margins of the one-pass float8 forward against torch's norm then quantization, per-row
    scales and static, at 16384x8192 bf16."""
    out = []
    for op in ("layernorm_fp8", "rmsnorm_fp8"):
        for ours, theirs in (("cupyln", "torch"), ("cupyln_static", "torch_static")):
            a = rows.get((op, 16384, 8192, "bfloat16", "fwd", ours))
            b = rows.get((op, 16384, 8192, "bfloat16", "fwd", theirs))
            if a is not None and b is not None:
                x = b["us"] / a["us"]
                out.append((x - 1.8, f"{op} {ours} {a['us']:.1f} / {theirs} {b['us']:.1f} us "
                                      f"{x:.2f}x"))
    return out


def main(path, old=None, verbose=False):
    copy, rows = load(path)
    lines = [("long rows: large passes, forward >= 88% of copy",
              bandwidth(copy, rows, ("layernorm", "rmsnorm"), "fwd", 0.88)),
             ("long rows: large passes, backward >= 82% of copy",
              bandwidth(copy, rows, ("layernorm", "rmsnorm"), "bwd", 0.82))]
    for p in ("fwd", "bwd"):
        lines.append((f"long rows: 64x1048576 bf16 {p} >= 70% of copy",
                      bandwidth(copy, {k: v for k, v in rows.items() if k[1:3] == (64, 1048576)},
                                ("layernorm", "rmsnorm"), p, 0.70, large=False)))
    for p, limit in (("fwd", 15.0), ("bwd", 20.0)):
        lines.append((f"long rows: 1x1048576 bf16 {p} <= {limit:g} us",
                      shape_us(rows, "layernorm", 1, 1048576, "bfloat16", p, limit)))
    for p in ("fwd", "bwd"):
        lines.append((f"long rows: 1x65536 bf16 {p} <= 8 us",
                      shape_us(rows, "layernorm", 1, 65536, "bfloat16", p, 8.0)))
    lines.append(("long rows: no slower than the best peer (plain passes)",
                  [c for c in peers(rows) if "_add" not in c[1] and "_fp8" not in c[1]]))
    if old is not None:
        _, before = load(old)
        cases = [(1.02 - r["us"] / before[k]["us"], f"{' '.join(map(str, k[:5]))} "
                  f"{before[k]['us']:.1f} -> {r['us']:.1f} us")
                 for k, r in rows.items() if k[5] == "cupyln" and k in before]
        lines.append(("long rows: no pass more than 2% slower than OLD", cases))
    frac, speed = fused(copy, rows)
    for p in ("fwd", "bwd"):
        lines.append((f"fused add {p}: the plain pass's fraction of copy", frac[p]))
        lines.append((f"fused add {p} >= {1.2 if p == 'fwd' else 1.4}x add + norm", speed[p]))
    lines.append(("fused add: RMSNorm no slower than Liger's",
                  peers({k: v for k, v in rows.items()
                         if k[0] == "rmsnorm_add" and k[5] != "torch"})))
    lines.append(("float8: large passes >= 90% of copy",
                  bandwidth(copy, rows, ("layernorm_fp8", "rmsnorm_fp8"), "fwd", 0.90)))
    lines.append(("float8: 16384x8192 bf16 >= 1.8x norm then quantize", quantize_speed(rows)))
    width = max(len(t) for t, _ in lines)
    for title, cases in lines:
        missed = sum(m < 0 for m, _ in cases)
        print(f"{title:<{width}}  {worst(cases)}" + (f"  {missed} missed" if missed else ""))
        for _, text in sorted(cases)[:missed] if verbose else ():
            print(f"    {text}")


if __name__ == "__main__":
    args = [a for a in sys.argv[1:] if a != "-v"]
    main(*args[:2], verbose="-v" in sys.argv)
