"""The planner's choices as values: what each kernel variant is for, and where it runs.

A :class:`Config` is frozen and hashable; the planner takes one (``DEFAULT`` unless a caller
passes another), so tests and tuning scripts reach every variant without patching globals.
Each field says why it holds its default; the measurements behind them are in
``benchmarks/NOTES.md`` and git history (``benchmarks/tools/tune.py`` times the variants).
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields

STAGE_MODES = ("auto", "always", "never")


THREADS = (64, 1024, 64)  # a block's threads: whole 64-thread groups (a warp on any device)
BLOCK = (1, 1024, 1)  # threads per block the planner aims at
COUNT = (1, None, 1)  # vectors per thread, blocks per SM
CLUSTER = (0, 16, 1)  # blocks of a cluster: 0 or 1 for none, up to the hardware's 16


def _check_fields(config, **ranges):
    """ValueError, before any plan, for a ``stage`` not listed, a field outside its range
    (``field=(lowest, highest or None, step)``): values the kernels cannot launch, or any other
    count or share below 0 (0 turns a variant off; below it nothing is meant)."""
    if config.stage not in STAGE_MODES:
        raise ValueError(f"stage must be one of {STAGE_MODES}, got {config.stage!r}")
    for f in fields(config):
        v = getattr(config, f.name)
        if f.name not in ranges and f.type in ("int", "float") and not v >= 0:
            raise ValueError(f"{type(config).__name__}.{f.name} must be at least 0, got {v}")
    for f, (lo, hi, step) in ranges.items():
        v = getattr(config, f)
        if v < lo or (hi is not None and v > hi) or v % step:
            rng = f"at least {lo}" if hi is None else f"from {lo} to {hi}"
            every = f", a multiple of {step}" if step > 1 else ""
            raise ValueError(f"{type(config).__name__}.{f} must be {rng}{every}, got {v}")


@dataclass(frozen=True)
class FwdConfig:
    """Forward planner choices."""

    # Vectors per thread in flight on the general path: four keep enough loads outstanding.
    npt: int = 4
    # Threads of one row at most; longer rows are read in chunks.
    tpr_max: int = 1024
    # Threads per block for rows of more than a warp: stacking long rows in one block lost.
    block: int = 128
    # Threads per block for rows of at most a warp: more rows a block than 128 threads hold won.
    short_block: int = 256
    # Small M (one vector per thread fills at most `small_m_fill` of the thread slots): one vector
    # per thread, so rows get more threads and shorter chains; also rows split over a cluster
    # where every row's cluster runs at once (staged, at many rows, it lost).
    small_m: bool = True
    small_m_fill: float = 1.0
    # One vector per thread wherever such a row fits in a warp: more rows in flight.
    short_npt1: bool = True
    # Grid cap in blocks per SM; past it blocks loop over rows (every benchmark shape gets one
    # block per row group: fewer blocks that loop lost).
    grid_per_sm: int = 1024
    # Staged rows (cp.async into shared memory, the resident blocks looping over rows): "auto"
    # where only one direct block fits on an SM, so nothing else hides its reductions;
    # elsewhere direct blocks overlap and win. Peeled rows of several vectors per thread stage
    # wherever they outnumber the resident blocks: their staged kernel reads the row from shared
    # memory in each pass, where the direct one spills.
    stage: str = "auto"
    # gamma/beta loaded with the row for 4-byte and wider types; 2-byte types spill their held
    # packs and lose.
    early: bool = True
    # LayerNorm rows that are a whole number of chunks (rows split over a cluster: of its
    # chunks) skip the per-vector column tests; RMSNorm has no centred pass and gains nothing.
    full: bool = True
    # Rows of one chunk of 16-byte vectors in at most `row_warps` warps take the row kernel (the
    # row's threads fixed at compile time, no row loop, one output path).
    row_warps: int = 8
    # The row kernel also for rows of at most a warp, stacked.
    row_short: bool = True
    # ... and for rows of several vectors per thread in 2 to `row_npt_warps` warps; 8 warps
    # spill and lose.
    row_npt_warps: int = 4
    # On sm_90, rows longer than one block holds split over a cluster of `cluster_tiles` blocks
    # that add their sums through distributed shared memory: read once, not twice, up to
    # cluster_tiles * tpr_max * npt vectors. Rows of one block lost when split.
    cluster: bool = True
    cluster_tiles: int = 8
    # Rows that one chunk of those 8 blocks cannot hold, over `cluster_tiles_long` blocks (a
    # cluster past the portable size, which the kernels opt into; 0: off), for RMSNorm without
    # the fused add, at least `cluster_long_min_rows` rows: x read once, not twice. LayerNorm's
    # two exchanges per row over 16 blocks gained nothing, nor did fewer rows (a second round of
    # clusters for one row).
    cluster_tiles_long: int = 16
    cluster_long_min_rows: int = 12
    # At most this many rows that `cluster_tiles` blocks of one vector per thread hold (small_m)
    # take `cluster_tiles_long` blocks of half the threads, as the backward's: the same bytes in
    # flight on twice the SMs (8 rows lost). 0: off.
    cluster_split_rows: int = 4
    # The fused add's split rows that nothing overlaps (unstaged, in blocks of tpr_max threads,
    # one per SM) only for few rows, M <= sms * cluster_few_rows, which unsplit leave SMs idle.
    cluster_few_rows: float = 0.5
    # Rows longer than one chunk of `cluster_tiles` blocks' registers, at least `resident_rows`
    # per cluster that fits at once, held in the shared memory of the fewest blocks of
    # `cluster_sizes` whose `resident_npt` vectors per thread hold them, the next row streaming
    # into a ring of slots as this one is written: x read once, not twice as in parts, and in 8
    # blocks rather than RMSNorm's 16 of rows in registers (fewer rows lost). 0: off.
    resident_npt: int = 8
    resident_rows: float = 2.0
    # Slots of each thread's ring (0: as many as one block's shared memory holds, at most two
    # rows'); fewer only to exercise short rings (tests, sanitizers) and to measure them.
    resident_slots: int = 0
    # Rows longer than one block (on sm_90: than one chunk of a cluster), at most sms *
    # parts_rows of them, split over the grid in two launches (each part's statistics, then the
    # parts merged and y written, x read again), `parts_per_sm` blocks per SM in all, so that
    # every SM streams; rows a cluster holds lost. 0: off.
    parts_rows: float = 2.0
    parts_per_sm: int = 2
    # The fused add's forward in parts for at most sms * parts_rows_add rows (more lost to
    # chunks), peeled odd rows too.
    parts_rows_add: float = 0.5

    # Rows on which 16-byte vectors do not fit as they are (odd N, odd row strides): each row's
    # head and tail peeled off, the middle in 16-byte vectors, where x's and y's rows start
    # alike within 16 bytes (the fused add's: and the residual's and h's, h in x's dtype,
    # never staged or in parts); else narrower vectors over the whole row.
    peel: bool = True
    # Peeled rows longer than one chunk of `npt` vectors, at most sms * peel_parts_rows of them,
    # in parts over the grid (as `parts_rows`' rows); more rows keep the block, whose waves fill
    # the GPU.
    peel_parts_rows: float = 4.0
    # Peeled rows that would run in chunks (read twice), over the blocks of a cluster where
    # `cluster`'s rule places the aligned rows' (norm_fwd_peeled_cluster, x read once). Not in
    # place of the staged or 8-vector block, which it lost to.
    peel_cluster: bool = True
    # RMSNorm's only in blocks of at least `peel_cluster_rms_threads`: its chunks won against
    # blocks of 256, lost against 512.
    peel_cluster_rms_threads: int = 512
    # Peeled rows past one block of 8 vectors per thread, more than parts take: the middle in
    # chunks of 16-byte vectors, read twice (norm_fwd_peeled_chunked), against narrow vectors
    # over the whole row (False: norm_fwd_chunked, one element a vector).
    peel_chunked: bool = True
    # Chunks also where one unstaged block of 8 vectors per thread would keep more than this many
    # bytes in local memory (16-bit rows: 64-176 B; float32 8).
    peel_block_spill: int = 16
    # Peeled rows of one vector per thread, at most sms * peel_early_rows of them (too few to
    # fill the GPU: each memory trip waits), read gamma and beta with the row instead of after
    # its reductions (at twice as many rows it lost). 0: off.
    peel_early_rows: float = 1.0

    def __post_init__(self):
        _check_fields(self, tpr_max=THREADS, block=BLOCK, short_block=BLOCK, npt=COUNT,
                      grid_per_sm=COUNT, cluster_tiles=CLUSTER, cluster_tiles_long=CLUSTER)


@dataclass(frozen=True)
class BwdConfig:
    """Backward planner choices."""

    # The backward holds x, dy and two partial sums per element: one vector per thread up to 512
    # threads, then two (two in 512 threads beat one in 1024).
    npt_min: int = 1
    npt: int = 2
    tpr_max: int = 512
    block: int = 512
    # Small M: rows per block shrink until about `spread` blocks per SM get work.
    spread: float = 2.0
    # dgamma/dbeta by float32 atomics into one vector when the call need not be deterministic;
    # off: per-block partials and a fixed-order sum were faster on every measured shape
    # (same-address atomics serialize in L2). A tested option all the same.
    atomic_flush: bool = False
    # A grid of at most this many blocks, whose threads cover N, sums the partials in its last
    # block: one launch instead of two (host time; the GPU time is the same).
    fused_reduce_blocks: int = 8
    # On sm_90, rows that fit in one cluster of `csum_blocks` blocks sum dgamma/dbeta through
    # distributed shared memory, without scratch or a second launch (the fused add's too).
    csum_blocks: int = 8
    cluster_sums: bool = True
    # Staged rows (cp.async) where blocks loop over rows that span warps; not for one row per
    # block nor rows within a warp.
    stage: str = "auto"
    # Staged rows handed out by a ticket counter when the call need not be deterministic.
    dynamic: bool = True
    # Long rows without clusters of tiles: column tiles of `tile_tpr` threads x `tile_npt` vectors
    # after a row-sums kernel of `rowsums_tpr` threads per row; on sm_90, for rows that leave
    # SMs idle (at most `sms / cluster_tiles` of them), the row sums over a cluster of
    # cluster_tiles blocks (more rows lost).
    tile_tpr: int = 256
    tile_npt: int = 2
    rowsums_tpr: int = 1024
    # ... and for at most sms * parts_rows such rows, the row sums in parts over the grid
    # (`parts_per_sm` blocks per SM in all, one more launch adds the parts), so that every SM
    # streams; at more rows the extra launch and pass lost, and so did rows of fewer than
    # `parts_chunks` chunks of the one-block row sums.
    parts_rows: float = 0.5
    parts_per_sm: int = 2
    parts_chunks: int = 8
    # The partials of rows of at least `reduce_cols_n` elements (a multiple of 4) summed four
    # columns per thread: a long row's sum in blocks of 32 columns ran mostly idle threads.
    reduce_cols_n: int = 65536
    # Rows peeled as the forward's (its `peel`), where a row fits one block, one row per block,
    # and M is at least `peel_rows` rows per resident block: below it the partials of their grid
    # cost more than the narrow path's reads.
    peel: bool = True
    peel_rows: int = 8
    # Peeled rows longer than one block, on column tiles, where each row of tiles takes at
    # least `peel_tile_rows` rows (or is alone): below it its partials, 2N floats, cost more
    # than their reads.
    peel_tile_rows: int = 4
    # Long rows on sm_90: a cluster of `cluster_tiles` column tiles exchanging row sums through
    # distributed shared memory, so x and dy are read once.
    cluster: bool = True
    cluster_tiles: int = 8
    cluster_npt: int = 2
    # Rows that 8 tiles cannot hold, over `cluster_tiles_long` tiles (a cluster past the
    # portable size, which the kernels opt into; 0: off), x and dy read once, not twice as by
    # row sums and tiles.
    cluster_tiles_long: int = 16
    # At most this many rows that `cluster_tiles` tiles hold take `cluster_tiles_long` tiles of
    # half the threads, the same bytes in flight on twice the SMs (8 rows lost). 0: off.
    cluster_split_rows: int = 4
    # Rows longer than those tiles hold, at least `resident_rows` per cluster that fits at
    # once, in as many column tiles of up to 1024 threads of `resident_npt` vectors that keep x
    # and dy in shared memory (the next row copied ahead): read once, not twice as by row sums
    # and tiles. 0: off.
    resident_npt: int = 2
    resident_rows: float = 2.0
    # Rows of more than `grid_vecs` 16-byte vectors (past what the resident tiles hold; CUDA,
    # float32 sums) on column tiles of `grid_tpr` threads x `grid_npt` vectors spread over a
    # cooperative grid (every block resident at once), whose blocks add each row's sums through
    # global memory, where each row of tiles takes at most `grid_rows` rows: x and dy read once,
    # not twice as by row sums and tiles. Each block holds `grid_buffers` rows of x and dy in
    # shared memory and sends `grid_step_rows` rows' sums through one exchange, since a row's
    # exchange, not its bytes, bounds it, where a row of tiles takes `grid_step_min_rows` rows
    # or more (a step waits for all its rows, which few rows do not hide); it waits for a step's
    # sums `grid_lag` steps after giving its own. 0: off.
    grid_vecs: int = 32768
    grid_rows: int = 128
    grid_tpr: int = 256
    grid_npt: int = 2
    grid_buffers: int = 4
    grid_lag: int = 1
    grid_step_rows: int = 2
    grid_step_min_rows: int = 8
    # The fused add's grid (dresidual staged too: 2 blocks an SM, not 3) saves a third of the
    # bytes, not two fifths, so only where each block collects at most `grid_add_sums` tiles'
    # row sums (rows of its row of tiles x column tiles). 0: the fused add off the grid.
    grid_add_sums: int = 16384

    def __post_init__(self):
        steps = self.grid_buffers // max(self.grid_step_rows, 1)
        if self.grid_step_rows < 1 or self.grid_buffers % self.grid_step_rows or \
                not 0 <= self.grid_lag < steps:
            raise ValueError(
                "grid_buffers must hold whole steps of grid_step_rows rows, more steps than "
                f"grid_lag: got grid_buffers={self.grid_buffers}, grid_step_rows="
                f"{self.grid_step_rows}, grid_lag={self.grid_lag}")
        _check_fields(self, tpr_max=THREADS, tile_tpr=THREADS, rowsums_tpr=THREADS,
                      grid_tpr=THREADS, block=BLOCK, npt_min=COUNT, npt=(self.npt_min, None, 1),
                      tile_npt=COUNT, cluster_npt=COUNT, grid_npt=COUNT, cluster_tiles=CLUSTER,
                      cluster_tiles_long=CLUSTER, csum_blocks=CLUSTER)


@dataclass(frozen=True)
class Config:
    """Forward and backward planner choices (``cupyln.Config()`` is the default plan)."""

    fwd: FwdConfig = field(default_factory=FwdConfig)
    bwd: BwdConfig = field(default_factory=BwdConfig)
    # Another kernel translation unit to compile instead of cupyln/kernels/ (benchmarks' variants).
    source: str | None = field(default=None, repr=False)


DEFAULT = Config()
