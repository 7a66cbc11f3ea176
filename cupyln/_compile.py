"""Kernel source -> ``cupy.RawModule``: one cached module per (device, specialization).

A specialization (``cupyln._spec.Spec``) fixes the template arguments of one kernel family: the
data type, the parameter type (LayerNorm or RMSNorm only where a kernel fixes it; the others
take both, chosen by whether the host gives the mean), the vector width, the vectors per thread,
the warp size, for the long-row backward the blocks of a thread-block cluster and, for the row
kernel, the threads of a row. One module holds the kernels of one pass of a specialization (the
forward kernels; the backward kernels of rows within a block with the partial reduction; or,
for longer rows, the column-tile kernels with the row sums and the partial reduction), so a
call compiles little more than it launches. CuPy's own disk cache (``CUPY_CACHE_DIR``) keeps
the binaries across processes.
"""

from __future__ import annotations

import functools
import re
from pathlib import Path

OPTIONS = ("-std=c++17",)
HEADERS = ("float8.cuh", "common.cuh", "cluster.cuh", "bwd_common.cuh")
SOURCES = ("norm_fwd.cu", "norm_bwd.cu")


def _read(name):
    """A kernel source, from cupyln/kernels/."""
    return (Path(__file__).resolve().parent / "kernels" / name).read_text()


@functools.cache
def source():
    """All kernels as one translation unit (headers inlined: no include paths needed)."""
    return translation_unit(_read)


def translation_unit(read):
    """The kernels' files, each read by ``read(file name)``, as one translation unit."""
    local = re.compile(r'^(#pragma once|#include "\w+\.cuh")\s*$', flags=re.M)
    return "\n".join(local.sub("", read(name)) for name in HEADERS + SOURCES)


@functools.cache
def _module_cache():
    import cupy

    @cupy.memoize(for_each_device=True)
    def build(spec, pass_, text):
        names = spec.names(pass_)
        mod = cupy.RawModule(
            code=text or source(), options=OPTIONS, name_expressions=list(names.values()),
            backend="nvrtc",
        )
        try:
            mod.compile()
        except Exception as e:
            raise RuntimeError(f"cupyln: compiling the {pass_} pass of {spec} failed: {e}") from e
        return {k: mod.get_function(v) for k, v in names.items()}

    return build


def kernels(spec, pass_, text=None):
    """Dict of RawKernels of one pass of ``spec`` on the current device (compiled once each),
    from the shipped kernels or from ``text``, another translation unit (a config's source)."""
    return _module_cache()(spec, pass_, text)


# ----------------------------------------------------------------------------- offline checks


def compile_nvrtc(names, arch, text=None, ptx=None, syntax_only=False, log=None, options=()):
    """Compile the kernels named by ``names`` with NVRTC for ``arch`` (e.g. 'sm_90', or
    'compute_80' for PTX alone; ``syntax_only``: the front end alone, every template
    instantiated and checked, no code); no GPU needed. Returns the lowered (mangled) names, and
    puts the PTX text in the list ``ptx`` and NVRTC's log (with ``options`` such as
    ``-Xptxas=-v``: ptxas's report) in the list ``log`` where given; raises RuntimeError with
    the log on failure."""
    from cupy_backends.cuda.libs import nvrtc

    names = sorted(names)
    prog = nvrtc.createProgram(text or source(), "cupyln.cu", [], [])
    try:
        for n in names:
            nvrtc.addNameExpression(prog, n)
        try:
            front = ["-fdevice-syntax-only"] if syntax_only else []
            nvrtc.compileProgram(prog, [f"--gpu-architecture={arch}", *front, *OPTIONS,
                                        *options])
        except Exception as e:
            raise RuntimeError(f"NVRTC {arch}: {e}\n{nvrtc.getProgramLog(prog)}") from e
        if log is not None:
            log.append(nvrtc.getProgramLog(prog))
        if ptx is not None and not syntax_only:
            ptx.append(nvrtc.getPTX(prog).decode(errors="replace"))
        return {n: nvrtc.getLoweredName(prog, n) for n in names}
    finally:
        nvrtc.destroyProgram(prog)


def hip_source(names, text=None):
    """A HIP translation unit that instantiates the kernels named by ``names`` (hipcc checks),
    from the shipped kernels or from ``text``."""
    names = sorted(names)
    refs = ",\n  ".join(f"(const void*)&{n}" for n in names)
    return (
        "#include <hip/hip_runtime.h>\n" + (text or source())
        + f"\n__attribute__((used)) static const void* cupyln_instances[] = {{\n  {refs}\n}};\n"
    )
