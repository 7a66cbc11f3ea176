"""The planner's thresholds: one table per architecture family, each row with its reason.

A :class:`cupyln.Config` holds what a user would set (staging, clusters, peeling, atomics,
dynamic rows); everything else the planner weighs is a row here. :func:`settings` joins the two
into the values the planner reads. sm_90's rows were measured on the H100 and H200
(``benchmarks/NOTES.md`` says where each kernel family runs and why); the other families take
sm_90's rows until measured on their own hardware, and their device facts already leave out
what they lack (clusters before sm_90; cp.async staging and the cooperative grid on HIP).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, make_dataclass

THREADS = (64, 1024, 64)  # a block's threads: whole 64-thread groups (a warp on any device)
BLOCK = (1, 1024, 1)  # threads per block the planner aims at
COUNT = (1, None, 1)  # vectors per thread, blocks per SM
CLUSTER = (0, 16, 1)  # blocks of a cluster: 0 or 1 for none, up to the hardware's 16

# name: (value, why). Counts of rows are per SM ("sms * x") where the reason says "per SM".
SM90_FWD = {
    "npt": (4, "vectors per thread in flight on the general path: four keep loads outstanding"),
    "tpr_max": (1024, "threads of one row at most; longer rows are read in chunks"),
    "block": (128, "threads per block for rows longer than a warp: stacking long rows lost"),
    "short_block": (256, "threads per block for rows within a warp: more rows a block won"),
    "small_m": (True, "few rows take one vector per thread: more threads, shorter chains"),
    "small_m_fill": (1.0, "few means one vector per thread fills at most this share of the GPU"),
    "short_npt1": (True, "one vector per thread where a row fits in a warp: more rows in flight"),
    "grid_per_sm": (1024, "grid cap in blocks per SM; one block per row group everywhere measured"),
    "early": (True, "4-byte gamma/beta loaded with the row; 2-byte packs held that long spill"),
    "full": (True, "LN rows of whole chunks skip the column tests; RMSNorm gains nothing"),
    "row_warps": (8, "rows of one chunk in up to this many warps take the fixed-width row kernel"),
    "row_npt_warps": (4, "the row kernel at several vectors per thread up to this many warps"),
    "cluster_tiles": (8, "rows past one block split over this many cluster blocks: read once"),
    "cluster_tiles_long": (16, "RMS rows past 8 blocks over 16 (non-portable; 0: off)"),
    "cluster_long_min_rows": (12, "16-block rows only from this many rows: fewer lost"),
    "cluster_split_rows": (4, "up to this many 8-block rows take 16 blocks of half the threads"),
    "cluster_few_rows": (0.5, "the fused add's split rows only up to this many per SM"),
    "resident_npt": (8, "rows past a cluster's registers held in its shared memory (0: off)"),
    "resident_rows": (2.0, "... where at least this many rows fall to each resident cluster"),
    "resident_slots": (0, "ring slots per thread (0: all a block holds); fewer for tests only"),
    "parts_rows": (2.0, "rows past one block, up to this many per SM, in parts over the grid"),
    "parts_per_sm": (2, "blocks per SM of the parts: every SM streams"),
    "parts_rows_add": (0.5, "the fused add's parts up to this many rows per SM (more lost)"),
    "peel_parts_rows": (4.0, "peeled rows past one chunk in parts up to this many per SM"),
    "peel_cluster": (True, "peeled rows that would run in chunks split over a cluster instead"),
    "peel_cluster_rms_threads": (512, "RMS peeled cluster rows only in blocks this wide or more"),
    "peel_chunked": (True, "peeled rows past 8 vectors per thread in 16-byte chunks, not elements"),
    "peel_block_spill": (16, "chunks also where an 8-vector block spills more bytes than this"),
    "peel_early_rows": (1.0, "peeled one-vector rows up to this many per SM read gamma early"),
}
SM90_BWD = {
    "npt_min": (1, "x, dy and two partial sums per element: one vector per thread at first"),
    "npt": (2, "... then two: two vectors in 512 threads beat one in 1024"),
    "tpr_max": (512, "threads of one row at most"),
    "block": (512, "threads per block"),
    "spread": (2.0, "few rows: rows per block shrink until this many blocks per SM get work"),
    "fused_reduce_blocks": (8, "grids of at most this many blocks sum partials in the last one"),
    "csum_blocks": (8, "rows one cluster of this many blocks holds sum dgamma in shared memory"),
    "cluster_sums": (True, "... on: no scratch and no second launch"),
    "tile_tpr": (256, "long rows' column tiles: threads"),
    "tile_npt": (2, "long rows' column tiles: vectors per thread"),
    "rowsums_tpr": (1024, "threads per row of the row-sums kernel before the tiles"),
    "parts_rows": (0.5, "row sums in parts over the grid up to this many rows per SM"),
    "parts_per_sm": (2, "blocks per SM of the row sums' parts"),
    "parts_chunks": (8, "parts only for rows of at least this many one-block chunks"),
    "reduce_cols_n": (65536, "partials of rows this long summed four columns per thread"),
    "peel_rows": (8, "peeled one-block rows where each resident block gets this many rows"),
    "peel_tile_rows": (4, "peeled long rows where each row of tiles gets this many rows"),
    "cluster_tiles": (8, "long rows over a cluster of this many tiles: x and dy read once"),
    "cluster_npt": (2, "vectors per thread of the cluster tiles"),
    "cluster_tiles_long": (16, "rows past 8 tiles over 16 (non-portable; 0: off)"),
    "cluster_split_rows": (4, "up to this many 8-tile rows take 16 tiles of half the threads"),
    "resident_npt": (2, "rows past 16 tiles keep x and dy in shared memory (0: off)"),
    "resident_rows": (2.0, "... where at least this many rows fall to each resident cluster"),
    "grid_vecs": (32768, "rows of more 16-byte vectors on a cooperative grid (0: off)"),
    "grid_rows": (128, "... where each row of tiles takes at most this many rows"),
    "grid_tpr": (256, "the grid's column tiles: threads"),
    "grid_npt": (2, "the grid's column tiles: vectors per thread"),
    "grid_buffers": (4, "rows of x and dy each grid block holds in shared memory"),
    "grid_lag": (1, "steps between giving a step's sums and waiting for them"),
    "grid_step_rows": (2, "rows per exchange: the exchange, not the bytes, bounds a row"),
    "grid_step_min_rows": (8, "two-row steps only where a row of tiles takes this many rows"),
    "grid_add_sums": (16384, "the fused add on the grid up to this many tile sums per block"),
}

FwdRows = make_dataclass("FwdRows", list(SM90_FWD), frozen=True)
BwdRows = make_dataclass("BwdRows", list(SM90_BWD), frozen=True)


TABLES = {
    "sm_90": (SM90_FWD, SM90_BWD),
    "sm_80": (SM90_FWD, SM90_BWD),  # not measured apart: no clusters, the rest as sm_90
    "cdna": (SM90_FWD, SM90_BWD),  # not measured: 64-lane waves, no staging, no clusters
    "rdna": (SM90_FWD, SM90_BWD),  # not measured: 32-lane waves, no staging, no clusters
}


def family(hip, warp, clusters):
    """The table a device plans with: CDNA (64-lane waves) or RDNA on ROCm; sm_90 where CUDA
    has clusters, else sm_80."""
    if hip:
        return "cdna" if warp == 64 else "rdna"
    return "sm_90" if clusters else "sm_80"


def _check_fields(values, name, **ranges):
    """ValueError for a row outside its range (``field=(lowest, highest or None, step)``) or
    any other count or share below 0 (0 turns a variant off; below it nothing is meant)."""
    for f, v in values.items():
        if f not in ranges and not isinstance(v, bool) and not v >= 0:
            raise ValueError(f"Config.tuning: row {name}{f} must be at least 0, got {v}")
    for f, (lo, hi, step) in ranges.items():
        v = values[f]
        if v < lo or (hi is not None and v > hi) or v % step:
            rng = f"at least {lo}" if hi is None else f"from {lo} to {hi}"
            every = f", a multiple of {step}" if step > 1 else ""
            raise ValueError(f"Config.tuning: row {name}{f} must be {rng}{every}, got {v}")


@dataclass(frozen=True)
class Settings:
    """What the planner reads: a family's rows (``fwd``, ``bwd``: namespaces of them), the
    config's switches, and its kernel source."""

    fwd: FwdRows
    bwd: BwdRows
    stage: str
    cluster: bool
    peel: bool
    atomic_flush: bool
    dynamic: bool
    source: str | None


def _validate(fwd, bwd):
    step, buffers, lag = bwd["grid_step_rows"], bwd["grid_buffers"], bwd["grid_lag"]
    if step < 1 or buffers % step or not 0 <= lag < buffers // step:
        raise ValueError(
            "Config.tuning: bwd_grid_buffers must hold whole steps of bwd_grid_step_rows rows, "
            f"more steps than bwd_grid_lag: got grid_buffers={buffers}, "
            f"grid_step_rows={step}, grid_lag={lag}")
    _check_fields(fwd, "fwd_", tpr_max=THREADS, block=BLOCK, short_block=BLOCK, npt=COUNT,
                  grid_per_sm=COUNT, cluster_tiles=CLUSTER, cluster_tiles_long=CLUSTER)
    _check_fields(bwd, "bwd_", tpr_max=THREADS, tile_tpr=THREADS, rowsums_tpr=THREADS,
                  grid_tpr=THREADS, block=BLOCK, npt_min=COUNT, npt=(bwd["npt_min"], None, 1),
                  tile_npt=COUNT, cluster_npt=COUNT, grid_npt=COUNT, cluster_tiles=CLUSTER,
                  cluster_tiles_long=CLUSTER, csum_blocks=CLUSTER)


def rows(fam, tuning=()):
    """(fwd, bwd) value dicts of family ``fam`` with ``tuning``'s overrides
    (``(("fwd_npt", 2), ...)``); ValueError for an override outside its row's range."""
    fwd_t, bwd_t = TABLES[fam]
    fwd = {k: v for k, (v, _) in fwd_t.items()}
    bwd = {k: v for k, (v, _) in bwd_t.items()}
    for key, v in tuning:
        table = fwd if key.startswith("fwd_") else bwd
        want = type(table[key[4:]])
        if not (isinstance(v, want) if want is bool else
                isinstance(v, (int, float) if want is float else int) and not isinstance(v, bool)):
            raise TypeError(f"Config.tuning[{key!r}] must be {want.__name__}, got {v!r}")
        table[key[4:]] = v
    _validate(fwd, bwd)
    return fwd, bwd


def check_tuning(tuning):
    """``tuning`` as a sorted tuple of (row, value) pairs, checked against every family's table:
    names it knows (else ValueError listing the others), values of the row's type and range."""
    try:
        items = tuple(sorted(dict(tuning).items()))
    except (TypeError, ValueError):
        raise TypeError("Config.tuning must be a dict of planner rows to values, got "
                        f"{tuning!r}") from None
    known = {f"fwd_{k}" for k in SM90_FWD} | {f"bwd_{k}" for k in SM90_BWD}
    unknown = [k for k, _ in items if k not in known]
    if unknown:
        raise ValueError(f"Config.tuning names no planner row: {unknown}; rows are fwd_<name> "
                         f"or bwd_<name> of cupyln._tuning's tables")
    for fam in TABLES:
        rows(fam, items)
    return items


@functools.lru_cache(maxsize=64)
def settings(config, fam: str) -> Settings:
    """The values the planner reads for ``config`` on a device of family ``fam``."""
    fwd, bwd = rows(fam, config.tuning)
    return Settings(FwdRows(**fwd), BwdRows(**bwd), config.stage,
                    config.cluster, config.peel, config.atomic_flush, config.dynamic,
                    config.source)
