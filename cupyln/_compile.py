"""Kernel source -> ``cupy.RawModule``: one cached module per (device, specialization).

A specialization (:class:`Spec`) fixes the template arguments of one kernel family: the data
type, the parameter type, LayerNorm or RMSNorm, the vector width, the vectors per thread, the
warp size, for the long-row backward the blocks of a thread-block cluster and, for wide forward
rows and the row kernel's rows, the threads of a row. One module holds
the kernels of one pass of a specialization (the forward kernels; the backward kernels of rows
within a block with the partial reduction; or, for longer rows, the column-tile kernels with the
row sums and the partial reduction), so a call compiles little more than it launches. CuPy's
own disk cache (``CUPY_CACHE_DIR``) keeps the binaries across processes.
"""

from __future__ import annotations

import functools
import importlib.resources
import re
from pathlib import Path
from typing import NamedTuple

import numpy as np

from .api import BFLOAT16, FLOAT16, FLOAT32, FLOAT64

#: The one table of dtype -> C storage type of the kernels.
CTYPES = {FLOAT16: "cl_half", BFLOAT16: "cl_bf16", FLOAT32: "float", FLOAT64: "double"}
#: Accumulation (compute) dtype for each data dtype.
ACC_DTYPES = {FLOAT16: FLOAT32, BFLOAT16: FLOAT32, FLOAT32: FLOAT32, FLOAT64: FLOAT64}

OPTIONS = ("-std=c++17",)
SOURCES = ("norm_fwd.cu", "norm_bwd.cu")


class Spec(NamedTuple):
    dtype: np.dtype  # x, dy, y, dx
    wdtype: np.dtype  # gamma, beta, dgamma, dbeta
    is_ln: bool
    vec: int  # elements per vector access
    npt: int  # vectors per thread per chunk
    warp: int  # 32 or 64
    tiles: int = 1  # backward: blocks per thread-block cluster (1: no cluster kernels)
    tpr: int = 0  # forward: threads per row fixed at compile time (0: blockDim.x)
    row: bool = False  # forward: rows of one chunk of tpr threads (norm_fwd_row alone)

    def _args(self):
        t, w = CTYPES[self.dtype], CTYPES[self.wdtype]
        ln = "true" if self.is_ln else "false"
        return f"{t}, {w}, {ln}, {self.vec}, {self.npt}, {self.warp}"

    def names(self, pass_):
        """The name expression of each kernel of one pass: 'fwd', 'bwd' (rows within a block;
        with ``tiles`` > 1 the kernel of a grid of one cluster alone) or 'bwd_long' (longer
        rows)."""
        a = self._args()
        if pass_ == "fwd":
            t, w = CTYPES[self.dtype], CTYPES[self.wdtype]
            ln = "true" if self.is_ln else "false"
            if self.row:  # no column tests ("_full") for LayerNorm only, as below
                row = f"norm_fwd_row<{t}, {w}, {ln}, {self.vec}, {self.warp}, {self.tpr}"
                npt = f", {self.npt}" if self.npt > 1 else ""
                return {"fwd_row": row + f", false{npt}>",
                        **({"fwd_row_full": row + f", true{npt}>"} if self.is_ln else {})}
            # the rows' threads fixed (tpr): rows of one chunk only, so no chunked kernel
            fixed = f", {self.tpr}" if self.tpr else ""
            names = {"fwd": f"norm_fwd<{a}, false, false, false{fixed}>",
                     "fwd_staged": f"norm_fwd<{a}, true, false, false{fixed}>"}
            if not self.tpr:
                names["fwd_chunked"] = f"norm_fwd_chunked<{t}, {w}, {ln}, {self.vec}, {self.warp}>"
            # gamma/beta loaded with the row (one vector per thread: "fwd" does already). Built
            # for 4-byte and wider types only: 2-byte ones spilled and lost everywhere (S10-1).
            if self.npt > 1 and self.dtype.itemsize >= 4:
                names["fwd_early"] = f"norm_fwd<{a}, false, true, false{fixed}>"
            # LayerNorm rows whose length is a multiple of the chunk: no column tests ("_full"
            # variants; RMSNorm lost 0.2-0.7% without them, S12-9)
            if self.is_ln:
                names["fwd_full"] = f"norm_fwd<{a}, false, false, true{fixed}>"
                if "fwd_early" in names:
                    names["fwd_early_full"] = f"norm_fwd<{a}, false, true, true{fixed}>"
            return names
        if pass_ == "bwd" and self.tiles > 1:  # a grid of one cluster of `tiles` blocks, alone
            return {"bwd_csum": f"norm_bwd_csum<{a}, {self.tiles}>"}
        acc = CTYPES[ACC_DTYPES[self.dtype]]
        names = {
            "bwd": f"norm_bwd<{a}, false, false>",
            "bwd_staged": f"norm_bwd<{a}, true, false>",
            "bwd_staged_dyn": f"norm_bwd<{a}, true, false, true>",  # rows from tickets
            "bwd_last": f"norm_bwd<{a}, false, true>",  # the last block sums the partials
            "reduce": f"norm_bwd_reduce<{acc}, {CTYPES[self.wdtype]}>",
        }
        if pass_ == "bwd_long":  # rows longer than one block: column tiles
            names["rowsums"] = f"norm_bwd_rowsums<{a}>"
            if self.tiles > 1:  # in clusters of `tiles` blocks
                names["bwd_cluster"] = f"norm_bwd_cluster<{a}, false, {self.tiles}>"
                names["bwd_cluster_staged"] = f"norm_bwd_cluster<{a}, true, {self.tiles}>"
        return names

    def __str__(self):
        op = "layernorm" if self.is_ln else "rmsnorm"
        return (
            f"{op}[x={self.dtype}, gamma={self.wdtype}, vec={self.vec}, npt={self.npt}, "
            f"warp={self.warp}" + (f", tiles={self.tiles}" if self.tiles > 1 else "")
            + (f", tpr={self.tpr}" if self.tpr else "") + (", row]" if self.row else "]")
        )


def _read(name):
    try:  # installed: the wheel maps kernels/ to cupyln.kernels
        return importlib.resources.files("cupyln.kernels").joinpath(name).read_text()
    except ModuleNotFoundError:  # imported from a source checkout: kernels/ beside cupyln/
        return (Path(__file__).resolve().parent.parent / "kernels" / name).read_text()


@functools.cache
def source():
    """All kernels as one translation unit (common.cuh inlined: no include paths needed)."""
    common = re.sub(r"^#pragma once\s*$", "", _read("common.cuh"), flags=re.M)
    parts = [common]
    for name in SOURCES:
        parts.append(re.sub(r'^#include "common.cuh"\s*$', "", _read(name), flags=re.M))
    return "\n".join(parts)


def _cupy():
    import cupy

    return cupy


@functools.cache
def _module_cache():
    cupy = _cupy()

    @cupy.memoize(for_each_device=True)
    def build(spec, pass_):
        names = spec.names(pass_)
        mod = cupy.RawModule(
            code=source(), options=OPTIONS, name_expressions=list(names.values()),
            backend="nvrtc",
        )
        try:
            mod.compile()
        except Exception as e:
            raise RuntimeError(f"cupyln: compiling the {pass_} pass of {spec} failed: {e}") from e
        return {k: mod.get_function(v) for k, v in names.items()}

    return build


def kernels(spec, pass_):
    """Dict of RawKernels of one pass of ``spec`` on the current device (compiled once each)."""
    return _module_cache()(spec, pass_)


def use_source(make):
    """Compile from ``make()`` from now on (a function returning one translation unit, as
    :func:`source` does), with a fresh module cache: the benchmarks' kernel variants. Plans and
    remembered calls keep their kernels until ``_launch.clear_caches()``."""
    global source
    source = make
    _module_cache.cache_clear()


# ----------------------------------------------------------------------------- offline checks


def compile_nvrtc(names, arch):
    """Compile the kernels named by ``names`` with NVRTC for ``arch`` (e.g. 'sm_90'); no GPU
    needed. Returns the lowered (mangled) names; raises RuntimeError with NVRTC's log on failure.
    """
    from cupy_backends.cuda.libs import nvrtc

    names = sorted(names)
    prog = nvrtc.createProgram(source(), "cupyln.cu", [], [])
    try:
        for n in names:
            nvrtc.addNameExpression(prog, n)
        try:
            nvrtc.compileProgram(prog, [f"--gpu-architecture={arch}", *OPTIONS])
        except Exception as e:
            raise RuntimeError(f"NVRTC {arch}: {e}\n{nvrtc.getProgramLog(prog)}") from e
        return {n: nvrtc.getLoweredName(prog, n) for n in names}
    finally:
        nvrtc.destroyProgram(prog)


def hip_source(names):
    """A HIP translation unit that instantiates the kernels named by ``names`` (hipcc checks)."""
    names = sorted(names)
    refs = ",\n  ".join(f"(const void*)&{n}" for n in names)
    return (
        "#include <hip/hip_runtime.h>\n" + source()
        + f"\n__attribute__((used)) static const void* cupyln_instances[] = {{\n  {refs}\n}};\n"
    )
