"""Compare two benchmark records: cupyln's device time per pass, new against old.

    python benchmarks/tools/compare.py OLD.json NEW.json [N]   # the N worst and best ratios (5)
"""

import json
import sys


def device_rows(path):
    """{(op, M, N, dtype, pass): us} of cupyln's device-time rows of a record."""
    rows = json.load(open(path))["rows"]
    return {(r["op"], r["M"], r["N"], r["dtype"], r["pass"]): r["us"] for r in rows
            if r["provider"] == "cupyln" and r["GBs"] is not None and r["us"] is not None}


def main(old, new, n=5):
    a, b = device_rows(old), device_rows(new)
    ratios = sorted((b[k] / a[k], k) for k in a.keys() & b.keys())
    for r, k in ratios[::-1][:n]:
        print(f"slower {r:.3f}  {k}  {a[k]:.2f} -> {b[k]:.2f} us")
    for r, k in ratios[:n]:
        print(f"faster {r:.3f}  {k}  {a[k]:.2f} -> {b[k]:.2f} us")
    print(f"{len(ratios)} passes compared; {sum(r > 1.02 for r, _ in ratios)} over 2% slower")


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2], int(sys.argv[3]) if len(sys.argv) > 3 else 5)
