"""Run every kernel variant once on a small and a medium shape (for compute-sanitizer).

Variants: forward (one chunk, several chunks, rows split over a cluster or in parts over the
grid), backward with atomics and deterministic, both with staged rows (cp.async; backward rows
static or from tickets) and direct loads, for short rows (several per block), block rows (of 8,
16 and 32 warps), and long rows (clusters of 8 or 16 column tiles, or row sums + column tiles),
and few rows (one cluster that sums dgamma/dbeta, or the last block summing the partials);
LayerNorm and RMSNorm; and the fused residual add (with dresidual and a weight offset) over the
same shapes, staged backward rows or none. Exits non-zero when an output misses the reference
tolerance. CUPYLN_SANITIZE_K (a regular expression) runs only the cases whose "op MxN dtype"
it finds, CUPYLN_SANITIZE_VARIANTS ("4,5": indices into VARIANTS) only those variants, and
CUPYLN_SANITIZE_SHARD ("i/n") every n-th (case, variant) pair of those, from the i-th;
CUPYLN_SANITIZE_CONFIG (JSON: Config switches and fwd_<row> / bwd_<row> planner rows)
changes every variant's config, to check variants switched off by default.
"""

import json
import os
import re
import sys

import cupy as cp

from cupyln import check
from cupyln._config import config_of

CASES = [  # (op, M, N, dtype, param dtype)
    ("layernorm", 9, 24, "float16", "float32"),      # short rows, several per block
    ("rmsnorm", 9, 24, "bfloat16", None),            # (norm_fwd_row: rows of 4 threads)
    ("rmsnorm", 20001, 64, "float16", None),         # norm_fwd_row, the last block past M
    ("layernorm", 3000, 26, "float32", None),        # short rows of 8-byte vectors (general)
    ("layernorm", 8, 500, "float16", None),          # few rows: one cluster, or the last block
    ("layernorm", 33, 1000, "float32", None),        # one block per row (norm_fwd_row)
    ("layernorm", 32, 512, "bfloat16", None),        # norm_fwd_row without column tests
    ("rmsnorm", 33, 1000, "float16", None),
    ("layernorm", 3, 140000, "float16", None),       # forward parts or cluster; row sums + tiles
    ("rmsnorm", 2, 600000, "bfloat16", None),        # forward parts, or a cluster in chunks
    ("layernorm", 2, 70001, "float32", None),        # odd, few: peeled row sums in parts
    ("layernorm", 1, 140000, "bfloat16", None),      # one row of blocks writes dgamma/dbeta
    ("layernorm", 37, 3583, "float16", None),        # forward rows peeled (odd N), few: early
    ("layernorm", 150, 3583, "bfloat16", "float32"),  # gamma and beta; more rows: late
    ("layernorm", 140, 20001, "float16", None),      # peeled rows staged (looping blocks)
    ("rmsnorm", 5, 50257, "bfloat16", "float32"),    # peeled rows in parts, or over a
    ("layernorm", 3, 70001, "float16", None),        # cluster (sm_90; else in chunks)
    ("layernorm", 2, 300001, "bfloat16", None),      # past 8 blocks: parts or chunks
    ("layernorm", 3, 30001, "float32", None),        # or one block of 8 vectors per thread
    ("layernorm", 300, 20001, "float16", None),      # backward peeled on column tiles
    ("rmsnorm", 1, 40000, "float16", "float32"),     # (column tiles; a cluster of them)
    ("layernorm", 4, 50000, "bfloat16", None),       # few rows: 1 vector each, 16 tiles back
    ("rmsnorm", 7, 30000, "float16", None),          # long-row backward in clusters (sm_90)
    ("layernorm", 20, 131072, "bfloat16", None),     # backward in 16-block clusters, staged;
                                                     # forward clusters of whole chunks
    ("rmsnorm", 3, 300000, "bfloat16", None),        # forward in 16-block clusters (any M here)
    ("layernorm", 20, 262152, "float32", None),      # forward rows in a cluster's shared memory
    ("rmsnorm", 31, 300008, "float16", "float32"),   # (16 or 8 blocks, rings of 9 or 16 slots)
    ("layernorm", 16, 140000, "float16", None),      # backward rows in a cluster's shared
    ("rmsnorm", 20, 131072, "float32", "float32"),   # memory (16 tiles of 576 or 1024 threads)
    ("layernorm", 16, 262144, "bfloat16", "float32"),  # (fused: dresidual there staged, here
                                                       # read from L2: float32 gamma's room)
    ("layernorm", 100, 140000, "float32", None),     # backward over a cooperative grid, 4
                                                     # rows of tiles (fewer rows: 3x300000)
    ("layernorm", 40, 16384, "bfloat16", "float32"),
    ("layernorm", 150, 16384, "float16", None),      # staged clusters over several rows
    ("rmsnorm", 5, 40000, "bfloat16", "float32"),
    ("layernorm", 600, 4096, "bfloat16", None),      # medium
    ("rmsnorm", 600, 4096, "float16", "float32"),
    ("layernorm", 300, 12288, "float16", None),      # 384-thread rows (12 warps)
    ("rmsnorm", 700, 8192, "bfloat16", None),        # forward rows of 8 warps
    ("layernorm", 200, 32768, "float16", None),      # forward rows of 32 warps
    ("layernorm", 60, 32768, "float16", None),       # few rows of one block of 32 warps
    ("layernorm", 4000, 1024, "float16", None),      # staged backward rows from tickets
    ("layernorm", 1100000, 2, "float32", None),      # forward blocks over several row groups
    ("rmsnorm", 3000, 1032, "float16", "float32"),   # row kernel, 2 warps x 4 vectors, not full
]

VARIANTS = [(False, False, "always", True, False), (True, False, "always", True, False),
            (False, True, "always", True, False), (False, False, "never", True, False),
            (False, False, "never", False, False),
            (False, False, "always", True, True), (False, False, "never", True, True),
            (True, True, "never", False, True)]
ONLY = re.compile(os.environ.get("CUPYLN_SANITIZE_K", ""))
PICK = [int(i) for i in os.environ.get("CUPYLN_SANITIZE_VARIANTS", "").split(",") if i]
# "i/n": the i-th of n shares of the (case, variant) pairs, for n processes side by side
SHARD, SHARDS = map(int, os.environ.get("CUPYLN_SANITIZE_SHARD", "0/1").split("/"))
FIELDS = json.loads(os.environ.get("CUPYLN_SANITIZE_CONFIG", "{}"))
bad = 0
found = [case for case in CASES if ONLY.search("{} {}x{} {}".format(*case))]
variants = [VARIANTS[i] for i in PICK] if PICK else VARIANTS
pairs = [(case, variant) for case in found for variant in variants][SHARD::SHARDS]
for (op, M, N, dt, wdt), (det, atomic, stage, csum, fused) in pairs:
    # both dgamma/dbeta flushes; staged rows wherever possible, or nowhere; few rows in one
    # cluster (direct rows), or the last block summing; few long rows in parts over the grid
    # (forward, the fused add's too; backward row sums), or without csum not
    parts = 2.0 if csum else 0
    # rows held in a cluster's shared memory for any M, without csum in short rings, and
    # peeled rows past one block of 4 vectors per thread not in parts: 8 vectors or chunks
    resident = {} if csum else dict(resident_rows=0, resident_slots=9, peel_parts_rows=0)
    config = config_of(**{
        "stage": stage, "atomic_flush": atomic, "fwd_parts_rows": parts,
        "fwd_parts_rows_add": parts, "fwd_cluster_long_min_rows": 0,
        **{f"fwd_{k}": v for k, v in resident.items()},
        "bwd_cluster_sums": csum, "bwd_parts_rows": parts,  # (the backward's default is 0.5)
        "bwd_peel_rows": 8 if csum else 0, "bwd_peel_tile_rows": 4 if csum else 0,  # few too
        **FIELDS})
    rows = check.check(cp, op, M, N, dt, wdt, deterministic=det, config=config,
                        fused=fused)
    cp.cuda.Device().synchronize()
    worst = max(rows, key=lambda r: r[1] / r[2])
    ok = all(err <= tol for _, err, tol in rows)
    bad += not ok
    print(f"{op:<10} {M:>5}x{N:<6} {dt:<9} det={det!s:<5} atomic={atomic!s:<5} {stage:<6} "
          f"csum={csum!s:<5} fused={fused!s:<5} "
          f"worst {worst[0]}={worst[1]:.2e} {'ok' if ok else 'FAIL'}")
sys.exit(1 if bad else 0)
