"""A kernel specialization (:class:`Spec`): the template arguments of one kernel family, and
the name expressions of the kernels each pass's module holds. Pure: the planner reads it
without compiling.
"""

from __future__ import annotations

from typing import NamedTuple

import numpy as np

from ._dtypes import ACC_DTYPES, CTYPES, tuned

PORTABLE_CLUSTER = 8  # blocks per cluster every sm_90 device runs; more need an opt-in


class Spec(NamedTuple):
    dtype: np.dtype  # x, dy, y, dx
    wdtype: np.dtype  # gamma, beta, dgamma, dbeta
    vec: int  # elements per vector access
    npt: int  # vectors per thread per chunk
    warp: int  # 32 or 64
    tiles: int = 1  # blocks per thread-block cluster (1: no cluster kernels)
    tpr: int = 0  # forward row kernel: threads per row fixed at compile time
    row: bool = False  # forward: rows of one chunk of tpr threads (norm_fwd_row alone)
    hip: bool = False  # ROCm: no staged (cp.async) or cluster kernels
    hdtype: np.dtype | None = None  # forward: the fused residual add's h (its kernels alone)
    residual: bool = False  # backward: the fused residual add's dresidual (its kernels alone)
    peeled: bool = False  # rows' heads and tails peeled off 16-byte vectors (their kernels alone)
    resident: bool = False  # rows held in a cluster's shared memory (their kernels alone)
    grid: tuple[int, ...] = ()  # rows over a cooperative grid: (buffers, lag, rows a step) (alone)
    quant: str | None = None  # forward: y in float8 scaled per "row" or by one "tensor" scale
    # (its kernel alone; hdtype: with the fused add)
    ln: bool | None = None  # LayerNorm or RMSNorm, for the kernels that fix it (kernels' is_ln)

    def _types(self):
        return CTYPES[self.dtype], CTYPES[self.wdtype]

    def _norm(self):
        """The norm of the kernels that fix it (the others take cln::either_norm, their default)."""
        if self.ln is None:
            raise ValueError(f"{self}: this kernel's norm is fixed, and the spec names none")
        return "cln::layernorm" if self.ln else "cln::rmsnorm"

    def _args(self):
        return f"{', '.join(self._types())}, {self.vec}, {self.npt}, {self.warp}"

    def _vec_warp(self):
        """The template arguments of the kernels without vectors per thread."""
        return f"{', '.join(self._types())}, {self.vec}, {self.warp}"

    @property
    def wide(self):
        """16-byte vectors of a dtype models train in (``_dtypes.tuned``). The variants beyond
        the basic kernels (staged rows, early parameters, rows without column tests; clusters
        of column tiles also for single elements) are built for them alone: narrower widths
        serve rare alignments, and float64 takes the basic kernels."""
        return tuned(self.dtype, self.vec)

    @property
    def in_parts(self):
        """16-byte vectors of any dtype: few long rows split over the grid (float64's too,
        which would otherwise leave most of the GPU idle)."""
        return self.vec * self.dtype.itemsize == 16

    @property
    def large_cluster(self):
        """Clusters past the portable size (8 blocks on sm_90, more with an opt-in), built for
        rows of 16-byte vectors that a portable cluster cannot hold."""
        return self.tiles > PORTABLE_CLUSTER

    @property
    def stages(self):
        """Whether the module holds staged kernels (cp.async; CUDA, 16-byte vectors)."""
        return not self.hip and self.wide

    def names(self, pass_):
        """The name expression of each kernel of one pass: 'fwd', 'fwd_long' (peeled rows in
        parts over the grid or in chunks), 'bwd' (rows within a block; with ``tiles`` > 1 the
        kernel of a grid of one cluster alone) or 'bwd_long' (longer rows). Template arguments
        are the named constants of cupyln/kernels/common.cuh (cln::)."""
        if pass_ == "fwd":
            return self._fwd_names()
        if pass_ == "fwd_long":
            return self._fwd_peeled_parts_names()
        if self.grid or self.resident:
            return self._bwd_long_row_names()
        if self.peeled:
            return self._bwd_peeled_names(pass_)
        if pass_ == "bwd" and self.tiles > 1:  # a grid of one cluster of `tiles` blocks, alone
            add = ", cln::dresidual" if self.residual else ""
            return {"bwd_csum": f"norm_bwd_csum<{self._args()}, {self.tiles}{add}>"}
        if pass_ == "bwd_long":
            return self._bwd_tile_names()
        return self._bwd_row_names()

    def _fwd_names(self):
        if self.quant:  # y in float8, rows of one chunk, with or without the fused add
            t, w = self._types()
            h, add = (t, "no_add") if self.hdtype is None else (CTYPES[self.hdtype],
                                                               "residual_add")
            # its norm fixed where 16-byte vectors run (faster there), else decided at run time
            norm = self._norm() if self.wide else "cln::either_norm"
            scaling = {"row": "row_scales", "tensor": "tensor_scale"}[self.quant]
            return {"fwd_q": f"norm_fwd_q<{t}, {w}, {h}, {norm}, {self.vec}, {self.npt}, "
                             f"{self.warp}, cln::{add}, cln::{scaling}>"}
        if self.peeled:
            return self._fwd_peeled_names()
        if self.resident:  # rows split over a cluster, in its shared memory
            t, w = self._types()
            return {"fwd_resident": f"norm_fwd_resident<{t}, {w}, {self.npt}, "
                                    f"{self.warp}, {self.tiles}>"}
        if self.tiles > 1:
            return self._fwd_cluster_names()
        if self.hdtype is not None:
            return self._fwd_add_names()
        if self.row:
            return self._fwd_row_names()
        return self._fwd_rows_names()

    def _fwd_peeled_names(self):
        """Peeled rows of one chunk (the fused add's, h in x's dtype: kernels of their own,
        never staged), or of one chunk of a cluster of ``tiles`` blocks."""
        t, w = self._types()
        if self.tiles > 1:
            return {"fwd_peeled_cluster": f"norm_fwd_peeled_cluster<{t}, {w}, {self.npt}, "
                                          f"{self.warp}, {self.tiles}>"}
        kern = "norm_fwd_peeled_add" if self.hdtype is not None else "norm_fwd_peeled"
        a = f"{kern}<{t}, {w}, {self.npt}, {self.warp}"
        names = {"fwd_peeled": f"{a}>"}
        if self.npt == 1:  # few rows: gamma and beta read with the row
            names["fwd_peeled_early"] = f"{a}, cln::params_early>"
        elif self.stages and self.hdtype is None:  # rows past the resident blocks: staged
            names["fwd_peeled_staged"] = f"{a}, cln::params_late, cln::staged>"
        return names

    def _fwd_peeled_parts_names(self):
        """Peeled rows longer than one block, in parts over the grid, or (more rows) in chunks
        (the fused add's: kernels of their own, h in x's dtype)."""
        t, w = self._types()
        if self.hdtype is not None:
            parts = f"norm_fwd_add_parts<{t}, {w}, {t}, {self.vec}, {self.warp}"
            chunked = f"norm_fwd_peeled_add_chunked<{t}, {w}, {self.warp}>"
        else:
            parts = f"norm_fwd_parts<{self._vec_warp()}"
            chunked = f"norm_fwd_peeled_chunked<{t}, {w}, {self.warp}>"
        return {"fwd_parts": f"{parts}, cln::part_stats, cln::peeled>",
                "fwd_apply": f"{parts}, cln::part_apply, cln::peeled>",
                "fwd_peeled_chunked": chunked}

    def _fwd_cluster_names(self):
        """Rows split over a cluster, in one chunk (longer ones: in parts)."""
        t, w = self._types()
        h = f"{CTYPES[self.hdtype]}, " if self.hdtype is not None else ""
        kern = "norm_fwd_add_cluster" if h else "norm_fwd_cluster"
        a = f"{kern}<{t}, {w}, {h}{self.vec}, {self.npt}, {self.warp}, {self.tiles}"
        names = {"fwd_cluster": f"{a}, cln::one_chunk>"}
        # resident clusters, the next row copied ahead; rows of one vector per thread (few
        # rows, each cluster alone) never are
        if self.stages and not h and self.npt > 1:
            names["fwd_cluster_staged"] = f"{a}, cln::one_chunk, cln::staged>"
        return names

    def _fwd_add_names(self):
        """The fused residual add: direct rows, chunks, parts."""
        t, w = self._types()
        a = f"{t}, {w}, {CTYPES[self.hdtype]}, {self.vec}"
        names = {"fwd_add": f"norm_fwd_add<{a}, {self.npt}, {self.warp}>",
                 "fwd_add_chunked": f"norm_fwd_add_chunked<{a}, {self.warp}>"}
        if self.in_parts:  # few long rows in parts over the grid, as the plain forward's
            names["fwd_parts"] = f"norm_fwd_add_parts<{a}, {self.warp}, cln::part_stats>"
            names["fwd_apply"] = f"norm_fwd_add_parts<{a}, {self.warp}, cln::part_apply>"
        return names

    def _fwd_row_names(self):
        """The row kernel: one chunk, threads fixed."""
        npt = f", {self.npt}" if self.npt > 1 else ""
        return {"fwd_row": f"norm_fwd_row<{self._vec_warp()}, {self.tpr}{npt}>"}

    def _fwd_rows_names(self):
        """Rows in one chunk (direct or staged), chunked rows, rows in parts."""
        fwd, base = f"norm_fwd<{self._args()}, cln::direct", self._vec_warp()
        names = {"fwd": f"{fwd}, cln::params_late, cln::cols_tested>",
                 "fwd_chunked": f"norm_fwd_chunked<{base}>"}
        if self.in_parts:  # few long rows split over the grid, in two launches
            names["fwd_parts"] = f"norm_fwd_parts<{base}, cln::part_stats>"
            names["fwd_apply"] = f"norm_fwd_parts<{base}, cln::part_apply>"
        if self.stages:
            names["fwd_staged"] = f"norm_fwd<{self._args()}, cln::staged, cln::params_late, " \
                                  "cln::cols_tested>"
        # rows that are a whole number of chunks: no column tests
        if self.wide:
            names["fwd_full"] = f"{fwd}, cln::params_late, cln::cols_full>"
        # gamma/beta loaded with the row: 4-byte and wider types only (2-byte ones spill), the
        # norm fixed (fwd_early_ln, fwd_early_rms; LayerNorm's also without column tests)
        if self.npt > 1 and self.dtype.itemsize >= 4 and self.wide:
            for norm, op in (("ln", "cln::layernorm"), ("rms", "cln::rmsnorm")):
                names[f"fwd_early_{norm}"] = f"{fwd}, cln::params_early, cln::cols_tested, {op}>"
            names["fwd_early_ln_full"] = f"{fwd}, cln::params_early, cln::cols_full, " \
                                         "cln::layernorm>"
        return names

    def _sums(self):
        """The partials' sums (rows of partials; columns of long rows)."""
        acc, w = CTYPES[ACC_DTYPES[self.dtype]], CTYPES[self.wdtype]
        return {"reduce": f"norm_bwd_reduce<{acc}, {w}>",
                "reduce_cols": f"norm_bwd_reduce_cols<{acc}, {w}>"}

    def _rowsums_merge(self):
        """The sum of long rows' row sums in parts."""
        return f"norm_bwd_rowsums_merge<{CTYPES[ACC_DTYPES[self.dtype]]}, {self.warp}>"

    def _bwd_head(self):
        """The leading template arguments of the kernels whose vector width follows the type."""
        t, w = self._types()
        return f"{t}, {w}, {self.npt}, {self.warp}"

    def _bwd_long_row_names(self):
        """Long rows split over a cooperative grid, or held in a cluster's shared memory (their
        norm fixed)."""
        add = ", cln::dresidual" if self.residual else ""  # the fused add's (ADD)
        t, w = self._types()
        head = f"{t}, {w}, {self._norm()}, {self.npt}, {self.warp}"
        if self.grid:
            grid = ", ".join(map(str, self.grid))
            return {"bwd_grid": f"norm_bwd_grid<{head}, {grid}{add}>", **self._sums()}
        resident = f"norm_bwd_resident<{head}, {self.tiles}"
        names = {"bwd_resident": f"{resident}{add}>", **self._sums()}
        if self.residual:  # dresidual staged in shared memory, where a block has the room
            names["bwd_resident_staged"] = f"{resident}, cln::dresidual_staged>"
        return names

    def _bwd_peeled_names(self, pass_):
        """Rows peeled as the forward's: one block each, or column tiles (the fused add's
        dresidual: kernels of their own)."""
        peeled, reduce = f"norm_bwd_peeled<{self._bwd_head()}", self._sums()["reduce"]
        add = ", cln::dresidual" if self.residual else ""
        if pass_ == "bwd":
            return {"bwd_peeled": f"{peeled}, cln::row_blocks{add}>" if add else f"{peeled}>",
                    "reduce": reduce}
        rowsums = f"norm_bwd_rowsums<{self._args()}, 1"
        return {"bwd_peeled_tiles": f"{peeled}, cln::col_tiles{add}>",
                "rowsums": f"{rowsums}, cln::whole_rows, cln::peeled>",
                # few rows: their sums in parts over the grid, then added
                "rowsums_parts": f"{rowsums}, cln::in_parts, cln::peeled>",
                "rowsums_merge": self._rowsums_merge(),
                "reduce": reduce}

    def _bwd_row_names(self):
        """Rows within a block. The fused add's dresidual: kernels of their own, none with
        tickets or staged clusters."""
        a = self._args()
        rows = "norm_bwd_add" if self.residual else "norm_bwd"
        names = {"bwd": f"{rows}<{a}, cln::direct, cln::partials>",
                 "bwd_last": f"{rows}<{a}, cln::direct, cln::last_block_sums>",
                 "reduce": self._sums()["reduce"]}
        if self.stages:
            names["bwd_staged"] = f"{rows}<{a}, cln::staged, cln::partials>"
            if not self.residual:
                names["bwd_staged_dyn"] = f"norm_bwd<{a}, cln::staged, cln::partials, " \
                                          "cln::tickets>"
        return names

    def _bwd_tile_names(self):
        """Rows longer than one block: column tiles, after their row sums or in clusters."""
        a = self._args()
        names = {**self._bwd_row_names(), "reduce_cols": self._sums()["reduce_cols"],
                 "rowsums": f"norm_bwd_rowsums<{a}>"}
        # clusters of `tiles` blocks: for 16-byte vectors and single elements (odd N too, where
        # they beat row sums + tiles, the fused add's as well)
        if self.tiles > 1 and not self.hip and (self.wide or self.vec == 1):
            names["rowsums_cluster"] = f"norm_bwd_rowsums<{a}, {self.tiles}>"  # few rows
            kern = "norm_bwd_add_cluster" if self.residual else "norm_bwd_cluster"
            names["bwd_cluster"] = f"{kern}<{a}, cln::direct, {self.tiles}>"
            if self.stages:
                names["bwd_cluster_staged"] = f"{kern}<{a}, cln::staged, {self.tiles}>"
        if self.large_cluster:  # for rows only it holds: its cluster kernels alone
            return {k: v for k, v in names.items()
                    if (self.wide and k.startswith("bwd_cluster")) or k.startswith("reduce")}
        if self.in_parts:  # few long rows in parts over the grid
            names["rowsums_parts"] = f"norm_bwd_rowsums<{a}, 1, cln::in_parts>"
            names["rowsums_merge"] = self._rowsums_merge()
        return names

    def __str__(self):
        return (
            f"{'norm' if self.ln is None else 'layernorm' if self.ln else 'rmsnorm'}"
            f"[x={self.dtype}, gamma={self.wdtype}, vec={self.vec}, npt={self.npt}, "
            f"warp={self.warp}" + (f", tiles={self.tiles}" if self.tiles > 1 else "")
            + (f", tpr={self.tpr}" if self.tpr else "") + (", row" if self.row else "")
            + (f", h={self.hdtype}" if self.hdtype is not None else "")
            + (", peeled" if self.peeled else "") + (", resident" if self.resident else "")
            + (f", grid={self.grid}" if self.grid else "")
            + (", dresidual]" if self.residual else "]")
        )
