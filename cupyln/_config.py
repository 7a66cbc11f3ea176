"""The planner's choices as values: what each kernel variant is for, and where it runs.

A :class:`Config` is frozen and hashable; the planner takes one (``DEFAULT`` unless a caller
passes another), so tests and tuning scripts reach every variant without patching globals.
Each field says why it holds its default, with the figure behind it; the measurements
themselves live in ``benchmarks/NOTES.md`` (all on one H200, ``benchmarks/tools/tune.py``).
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
    # Threads per block for rows of more than a warp; stacking long rows in one block cost 5-15%.
    block: int = 128
    # Threads per block for rows of at most a warp (2% faster than 128 at 4096x1024).
    short_block: int = 256
    # Small M (one vector per thread fills at most `small_m_fill` of the thread slots): one vector
    # per thread, so rows get more threads and shorter chains (32x512 f16: 4.8 against 5.4 us);
    # also rows split over a cluster where every row's cluster runs at once (H100: 1x65536 bf16
    # 8.13 against 8.91 us, RMS 7.18 / 8.93, 8x65536 8.74 / 9.26; staged at 32 rows, it lost).
    small_m: bool = True
    small_m_fill: float = 1.0
    # One vector per thread wherever such a row fits in a warp (131072x64 f16: 4% faster).
    short_npt1: bool = True
    # Grid cap in blocks per SM; past it blocks loop over rows (1024: every benchmark shape gets
    # one block per row group, 6% faster than 64 at 131072x4096).
    grid_per_sm: int = 1024
    # Staged rows (cp.async into shared memory, the resident blocks looping over rows): "auto"
    # where only one direct block fits on an SM, so nothing else hides its reductions
    # (4096x32768 f16: 150 against 173 us); elsewhere direct blocks overlap and win. Peeled rows
    # of several vectors per thread stage wherever they outnumber the resident blocks (their
    # staged kernel reads the row from shared memory in each pass, the direct one spills):
    # LN 2670x50257 bf16 276.5 against 379.7 us, f16 278.9 / 664.1, RMS bf16 196.0 / 339.3,
    # LN 6000x12001 bf16 134.2 / 158.1 (two blocks per SM), 4000x20001 f16 165.0 / 198.2.
    stage: str = "auto"
    # gamma/beta loaded with the row for 4-byte and wider types (4096x1024 f32: 10% faster);
    # 2-byte types spill their held packs and lose.
    early: bool = True
    # LayerNorm rows that are a whole number of chunks skip the per-vector column tests
    # (16384x8192 bf16: 5% faster; rows split over a cluster, of its chunks: 2048x65536 bf16
    # 188 against 197 us, 512x262144 215 / 225, 300x65536 f32 57.2 / 59.0); RMSNorm has no
    # centred pass and gains nothing.
    full: bool = True
    # Rows of one chunk of 16-byte vectors in at most `row_warps` warps take the row kernel (the
    # row's threads fixed at compile time, no row loop, one output path: 32x512 f16 2% faster).
    row_warps: int = 8
    # The row kernel also for rows of at most a warp, stacked (131072x64 f16 3-7% faster).
    row_short: bool = True
    # ... and for rows of several vectors per thread in 2 to `row_npt_warps` warps (4096x2048
    # f16: 10% faster); 8 warps spill and lose.
    row_npt_warps: int = 4
    # On sm_90, rows longer than one block holds split over a cluster of `cluster_tiles` blocks
    # that add their sums through distributed shared memory: read once, not twice, up to
    # cluster_tiles * tpr_max * npt vectors (2048x65536 bf16: 196 us staged, 219 direct, 260
    # unsplit; 512x262144 bf16: 227 against 290). Rows of one block lost when split for few rows
    # (64x32768 bf16: 10.5 against 9.9 us).
    cluster: bool = True
    cluster_tiles: int = 8
    # Rows that one chunk of those 8 blocks cannot hold, over `cluster_tiles_long` blocks (a
    # cluster past the portable size, which the kernels opt into; 0: off), for RMSNorm without
    # the fused add, at least `cluster_long_min_rows` rows (x read once, not twice): RMS
    # 256x524288 bf16 192 against 227 us in parts, 16x524288 23.3 / 24.9, 512x400000 295 / 385
    # (a block per row), 256x262144 f32 185 / 220. LayerNorm's two exchanges per row over 16
    # blocks gained nothing (256x524288 bf16 278 / 283, 256x262144 f32 237 / 229), nor did 8
    # rows (LN 8x524288 22.0 / 17.4: 7 clusters of 16 fit, a second round for one row).
    cluster_tiles_long: int = 16
    cluster_long_min_rows: int = 12
    # At most this many rows that `cluster_tiles` blocks of one vector per thread hold (small_m)
    # take `cluster_tiles_long` blocks of half the threads, as the backward's: the same bytes in
    # flight on twice the SMs (H100, against 8: LN 1x65536 bf16 7.97 / 8.13 us, LN 4x50000 7.94
    # / 8.14, RMS 4x65536 7.06 / 7.34, RMS 1x65536 6.96 / 7.10; 8 rows lost, 9.25 / 8.48). 0: off.
    cluster_split_rows: int = 4
    # The fused add's split rows that nothing overlaps (unstaged, in blocks of tpr_max threads,
    # one per SM) only for few rows, M <= sms * cluster_few_rows, which unsplit leave SMs idle
    # (fused RMSNorm 512x262144 bf16: 391 against 342 us unsplit).
    cluster_few_rows: float = 0.5
    # Rows longer than one chunk of `cluster_tiles` blocks' registers, at least `resident_rows`
    # per cluster that fits at once, held in the shared memory of the fewest blocks of
    # `cluster_sizes` whose `resident_npt` vectors per thread hold them, the next row streaming
    # into a ring of slots as this one is written: x read once, not twice as in parts (LN
    # 64x1048576 bf16 137.6 against 152.1 us, RMS 106.3 / 126.0, LN 256x524288 215.1 / 283.3,
    # 16x1048576 47.8 / 49.5, 8 rows lost: 33.8 / 28.5), and in 8 blocks rather than RMSNorm's
    # 16 of rows in registers (RMS 256x524288 bf16 175.7 / 193.8, 256x262144 f32 173.1 / 186.6).
    # 0: off.
    resident_npt: int = 8
    resident_rows: float = 2.0
    # Slots of each thread's ring (0: as many as one block's shared memory holds, at most two
    # rows'); fewer only to exercise short rings (tests, sanitizers) and to measure them.
    resident_slots: int = 0
    # Rows longer than one block (on sm_90: than one chunk of a cluster), at most sms *
    # parts_rows of them, split over the grid in two launches (each part's statistics, then the
    # parts merged and y written, x read again), `parts_per_sm` blocks per SM in all, so that
    # every SM streams: 1x1048576 bf16 13.5 against 35.4 us (a cluster in chunks), 64x1048576
    # 151 / 183, 256x262144 f32 228 against 245 (a block per row); 128x1048576 the same; rows a
    # cluster holds lost (1x65536 bf16 10.9 against 8.9, 512x262144 282 against 225). 0: off.
    parts_rows: float = 2.0
    parts_per_sm: int = 2
    # The fused add's forward in parts for at most sms * parts_rows_add rows: 1x1048576 bf16
    # 14.4 against 39.7 us, 64x1048576 193 / 238, but 128x1048576 362 / 351 (rows in chunks).
    # Peeled odd rows too (H100): LN 1x1048575 bf16 16.3 against 300.7, 32x262143 51.2 / 92.5,
    # 66x50257 f16 23.2 / 26.5, but 130x50257 bf16 33.8 against 29.1 (parts_rows_add=4).
    parts_rows_add: float = 0.5

    # Rows on which 16-byte vectors do not fit as they are (odd N, odd row strides): each row's
    # head and tail peeled off, the middle in 16-byte vectors, where x's and y's rows start
    # alike within 16 bytes (the fused add's: and the residual's and h's, h in x's dtype,
    # never staged or in parts; LN 37459x3583 bf16 375.6 against 689.1 us, H100); else
    # narrower vectors over the whole row.
    peel: bool = True
    # Peeled rows longer than one chunk of `npt` vectors, at most sms * peel_parts_rows of them,
    # in parts over the grid (as `parts_rows`' rows): 300x50257 f16 60.6 against 105.3 us in
    # one block of 8 vectors per thread, 1x50257 bf16 11.6 / 19.4; more rows keep the block,
    # whose waves fill the GPU (1000x20001 f32 74.1 / 106.7, LN 2670x50257 bf16 380 / 413).
    peel_parts_rows: float = 4.0
    # Peeled rows that would run in chunks (read twice), over the blocks of a cluster where
    # `cluster`'s rule places the aligned rows' (norm_fwd_peeled_cluster, x read once; H100,
    # against chunks): LN 2048x65535 bf16 304 against 313 us, LN 1024x131071 331 / 334. Not in
    # place of the staged or 8-vector block, which it lost to (LN 2670x50257 bf16 355 / 286).
    peel_cluster: bool = True
    # RMSNorm's only in blocks of at least `peel_cluster_rms_threads`: its chunks won against
    # blocks of 256 (2048x65535 bf16 241 against 251 us), lost against 512 (1024x131071 302 /
    # 268).
    peel_cluster_rms_threads: int = 512
    # Peeled rows past one block of 8 vectors per thread, more than parts take: the middle in
    # chunks of 16-byte vectors, read twice (norm_fwd_peeled_chunked), against narrow vectors
    # over the whole row (False: norm_fwd_chunked, one element a vector): LN 1024x131071 bf16
    # 305.5 against 718.3 us, RMS 236.6 / 524.3.
    peel_chunked: bool = True
    # Chunks also where one unstaged block of 8 vectors per thread would keep more than this many
    # bytes in local memory (16-bit rows: 64-176 B; float32 8): LN 2048x65535 bf16 303.9
    # against 387.4 us in that block, 2048x60001 f16 285.3 / 333.0.
    peel_block_spill: int = 16
    # Peeled rows of one vector per thread, at most sms * peel_early_rows of them (too few to
    # fill the GPU: each memory trip waits), read gamma and beta with the row instead of after
    # its reductions: LN 8x3583 f16 5.98 against 6.46 us, 132x3583 bf16 6.43 / 6.83, 100x1001
    # f32 5.47 / 5.98; even at 264 rows, and 528 lost (10.74 / 9.58). 0: off.
    peel_early_rows: float = 1.0

    def __post_init__(self):
        _check_fields(self, tpr_max=THREADS, block=BLOCK, short_block=BLOCK, npt=COUNT,
                      grid_per_sm=COUNT, cluster_tiles=CLUSTER, cluster_tiles_long=CLUSTER)


@dataclass(frozen=True)
class BwdConfig:
    """Backward planner choices."""

    # The backward holds x, dy and two partial sums per element: one vector per thread up to 512
    # threads, then two (two in 512 threads beat one in 1024 by 11% at 16384x8192 bf16).
    npt_min: int = 1
    npt: int = 2
    tpr_max: int = 512
    block: int = 512
    # Small M: rows per block shrink until about `spread` blocks per SM get work.
    spread: float = 2.0
    # dgamma/dbeta by float32 atomics into one vector when the call need not be deterministic;
    # off: per-block partials and a fixed-order sum were faster on every measured shape
    # (16384x8192 bf16: 358 against 397 us; same-address atomics serialize in L2).
    atomic_flush: bool = False
    # A grid of at most this many blocks, whose threads cover N, sums the partials in its last
    # block: one launch instead of two (host time; the GPU time is the same).
    fused_reduce_blocks: int = 8
    # On sm_90, rows that fit in one cluster of `csum_blocks` blocks sum dgamma/dbeta through
    # distributed shared memory, without scratch (32x512 f16: 6.5 against 8.6 us; the fused
    # add's, H200: 6.62 / 8.80, RMS 16x1024 bf16 6.46 / 8.10, LN 8x8192 f16 10.08 / 11.73).
    csum_blocks: int = 8
    cluster_sums: bool = True
    # Staged rows (cp.async) where blocks loop over rows that span warps (131072x4096 bf16: 885
    # against 1023 us); not for one row per block nor rows within a warp.
    stage: str = "auto"
    # Staged rows handed out by a ticket counter when the call need not be deterministic
    # (131072x4096 bf16: 3.5% faster than static rows).
    dynamic: bool = True
    # Long rows without clusters of tiles: column tiles of `tile_tpr` threads x `tile_npt` vectors
    # after a row-sums kernel of `rowsums_tpr` threads per row; on sm_90, for rows that leave
    # SMs idle (at most `sms / cluster_tiles` of them), the row sums over a cluster of
    # cluster_tiles blocks (1x1048576 bf16: 72 against 150 us; at 64 rows it lost 5%).
    tile_tpr: int = 256
    tile_npt: int = 2
    rowsums_tpr: int = 1024
    # ... and for at most sms * parts_rows such rows, the row sums in parts over the grid
    # (`parts_per_sm` blocks per SM in all, one more launch adds the parts), so that every SM
    # streams: 1x1048576 bf16 64 against 73 us, 64x1048576 265 / 281, 2x300000 f32 31 / 35; at
    # 128 rows and more the extra launch and pass lost (128x1048576 457 / 416); so did rows of
    # fewer than `parts_chunks` chunks of the one-block row sums (fused 8x3583 f16: 14.3 / 13.3).
    parts_rows: float = 0.5
    parts_per_sm: int = 2
    parts_chunks: int = 8
    # The partials of rows of at least `reduce_cols_n` elements (a multiple of 4) summed four
    # columns per thread: 1x1048576 bf16's sum took 55 us in 65536 blocks of 32 columns each.
    reduce_cols_n: int = 65536
    # Rows peeled as the forward's (its `peel`), where a row fits one block, one row per block,
    # and M is at least `peel_rows` rows per resident block: the partials of their grid cost
    # few rows more than the narrow path's (512x3583 bf16, 2 rows per block: 32.0 against 21.9
    # us; 4096x777 f64, 15: 45.1 against 47.6; 37460x3583 bf16: 349 against 941).
    peel: bool = True
    peel_rows: int = 8
    # Peeled rows longer than one block, on column tiles, where each row of tiles takes at
    # least `peel_tile_rows` rows (or is alone): its partials, 2N floats, cost few rows more
    # than their reads (H100, against narrow vectors: 8x131071 bf16 55.6 against 34.3 us,
    # 3x1048575 129.6 / 86.4; 64x1048575 427.6 / 730.1, 66x50257 f16 48.4 / 53.6).
    peel_tile_rows: int = 4
    # Long rows on sm_90: a cluster of `cluster_tiles` column tiles exchanging row sums through
    # distributed shared memory, so x and dy are read once (4096x32768 f16: 234 against 352 us).
    cluster: bool = True
    cluster_tiles: int = 8
    cluster_npt: int = 2
    # Rows that 8 tiles cannot hold, over `cluster_tiles_long` tiles (a cluster past the
    # portable size, which the kernels opt into; 0: off), x and dy read once, not twice:
    # 1024x131072 bf16 306-310 against 427 us (row sums, then tiles), 1x131072 8.7 / 12.8,
    # 512x65536 f32 131 / 197, fused 1024x131072 bf16 312 / 488.
    cluster_tiles_long: int = 16
    # At most this many rows that `cluster_tiles` tiles hold take `cluster_tiles_long` tiles of
    # half the threads, the same bytes in flight on twice the SMs (H200, against 8 tiles: LN
    # 1x65536 bf16 7.46 against 8.02 us, RMS 7.31 / 7.74, 2x65536 12.16 / 13.07, 4x50000 12.85
    # / 14.11, fused RMS 4x65536 11.47 / 12.66; H100: 8 rows lost, 16.80 / 16.11). 0: off.
    cluster_split_rows: int = 4
    # Rows longer than those tiles hold, at least `resident_rows` per cluster that fits at
    # once, in as many column tiles of up to 1024 threads of `resident_npt` vectors that keep x
    # and dy in shared memory (the next row copied ahead): read once, not twice as by row sums
    # and tiles (RMS 512x262144 bf16 291 against 410 us, LN 336 / 412, 200x131072 f32 121 /
    # 165, 64x262144 bf16 72.5 / 78.0). 0: off.
    resident_npt: int = 2
    resident_rows: float = 2.0
    # Rows of more than `grid_vecs` 16-byte vectors (past what the resident tiles hold; CUDA,
    # float32 sums) on column tiles of `grid_tpr` threads x `grid_npt` vectors spread over a
    # cooperative grid (every block resident at once), whose blocks add each row's sums through
    # global memory, where each row of tiles takes at most `grid_rows` rows: x and dy read once,
    # not twice as by row sums and tiles (LN 64x1048576 bf16 193.8 against 213.9 us, RMS 188.5 /
    # 200.5, 8x1048576 31.9 / 48.6, 1x1048576 18.2 / 25.2, LN 256x262144 f32 297.6 / 371.8 in
    # 3 rows of tiles). Each block holds `grid_buffers` rows of x and dy in shared memory and
    # sends `grid_step_rows` rows' sums through one exchange, since a row's exchange, not its
    # bytes, bounds it (2 rows: 64x1048576 188.9 against 197.7 us, 256x262144 f32 285.4 / 306.2;
    # 3 rows or 6 buffers: 212.0, 199.7), where a row of tiles takes `grid_step_min_rows` rows
    # or more (a step waits for all its rows: 1x1048576 16.9 against 13.1 us, 2x1048576 19.2 /
    # 15.2, 8x1048576 35.6 / 36.2); so up to 128 rows a row of tiles, where one row at a time
    # lost to row sums and tiles (256x524288 341.6 against 372.3, 128x1048576 363.9 / 364.1),
    # and waits for a step's sums `grid_lag` steps after giving its own (none: 322.0 us at
    # 64x1048576; 6 and 2: 200.8). 0: off.
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
    # row sums (rows of its row of tiles x column tiles; LN 64x1048576 bf16, 64 x 256: 239.2
    # against 253.5 us, 256x262144 f32, 128 x 128: 381.7 / 434.7, 128x1048576, 128 x 256:
    # 464.2 / 437.3). 0: the fused add off the grid.
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
