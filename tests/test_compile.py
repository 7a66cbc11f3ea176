"""Every kernel the planner can launch compiles, without a GPU, for every target: with NVRTC
for sm_90 and sm_80 (warp 32; sm_80's own list, without cluster kernels) and with hipcc for
gfx90a and gfx940 (wave64) and gfx1030 (wave32). Each target's kernels are dealt out in turn
(sorted by name) into CHUNKS programs, so that pytest-xdist spreads them over the cores. Every
specialization goes through every target's front end (each template instantiated and checked,
against the target's builtins too), and to machine code where MACHINE_CODE says: sm_90 (as at
run time) three quarters of the chunks, sm_80 (PTX, scanned for sm_90's instructions) the last
quarter, gfx90a and gfx1030 a quarter each, so that each specialization reaches code for CUDA
and half of them for a HIP target. Eight chunks, not four: xdist steals pending tests by count,
not by time, and CI's pytest took 746 s with four chunks (sm_90's of 170-230 s), 673 s with
eight. These run with ``--all-kernels`` (CI does); in CI (CI=true) a missing compiler is a
failure, not a skip. Also: the wheel ships the sources.

Why not machine code everywhere: on CI's two cores the five full builds took about 21 of the
run's 24 minutes (1586 and 1290 NVRTC kernels, three times about 1160 hipcc kernels), and
machine code for sm_90 and gfx90a alone still 18 of a local run's 22. A front end takes 2 s
(NVRTC) or 5 s (hipcc) of a chunk's 40-110 s; what code generation alone would catch (an
instruction outside its architecture's guard, a resource limit) lies in helpers and kernel
families, which each chunk holds but for families of fewer than CHUNKS kernels."""

import os
import re
import shutil
import subprocess
import sys
import zipfile

import pytest

IN_CI = bool(os.environ.get("CI"))
CHUNKS = 8
NVRTC = ["sm_80", "sm_90"]
HIPCC = [("gfx90a", 64), ("gfx940", 64), ("gfx1030", 32)]
_QUARTER = CHUNKS // 4
MACHINE_CODE = {"sm_90": set(range(3 * _QUARTER)), "sm_80": set(range(3 * _QUARTER, CHUNKS)),
                "gfx90a": set(range(3 * _QUARTER, CHUNKS)), "gfx1030": set(range(_QUARTER)),
                "gfx940": set()}
# PTX that sm_80 does not run: clusters, their shared memory and barriers, tensor-memory copies
SM90_PTX = re.compile(r"\b(mapa|st\.async|barrier\.cluster|fence\.mbarrier_init|cp\.async\.bulk"
                      r"|elect\.sync|setmaxnreg|wgmma)\b|expect_tx|%cluster_|::cluster")


def _missing(what):
    if IN_CI:
        pytest.fail(f"{what} is not available, and CI must run this test")
    pytest.skip(f"{what} is not available")


def _chunk(names, i):
    return set(sorted(names)[i::CHUNKS])


@pytest.mark.all_kernels
@pytest.mark.parametrize("chunk", range(CHUNKS))
@pytest.mark.parametrize("arch", NVRTC)
def test_every_specialization_compiles_with_nvrtc(arch, chunk):
    try:
        from cupyln._compile import compile_nvrtc
        from cupyln._plan import all_kernel_names
    except ImportError as e:
        _missing(f"CuPy ({e})")
    # sm_80 launches no cluster kernels (the planner's rule, tests/test_planner.py)
    names = _chunk(all_kernel_names(32, clusters=arch != "sm_80"), chunk)
    code = chunk in MACHINE_CODE[arch]
    ptx = []
    target = arch if arch == "sm_90" else arch.replace("sm_", "compute_")  # sm_80: PTX
    lowered = compile_nvrtc(names, target, ptx=ptx, syntax_only=not code)
    assert set(lowered) == names and all(lowered.values())
    if code and arch == "sm_80":
        found = SM90_PTX.search(ptx[0])
        assert found is None, f"sm_90 PTX in sm_80's kernels: {found.group(0)!r}"


def test_nvrtc_front_end_finds_errors():
    pytest.importorskip("cupy")
    from cupyln._compile import compile_nvrtc, source
    from cupyln._dtypes import FLOAT16
    from cupyln._spec import Spec

    names = set(Spec(FLOAT16, FLOAT16, 8, 4, 32).names("fwd").values())
    bad = source().replace("const C rstd = cl_rsqrt(m2 * inv_n + eps);",
                           "const C rstd = cl_rsqrt(m2 * inv_n + eps) + gamma;", 1)
    assert bad != source()
    with pytest.raises(RuntimeError, match="arithmetic"):
        compile_nvrtc(names, "compute_80", text=bad, syntax_only=True)


def test_sm80_ptx_scan_finds_cluster_instructions():
    ptx = "\tmapa.shared::cluster.u32 %r5, %r4, %r3;\n\tcvt.rn.bf16x2.f32 %r1, %f2, %f1;"
    assert SM90_PTX.search(ptx).group(0) == "mapa"
    assert SM90_PTX.search("\tcp.async.cg.shared.global [%r1], [%rd2], 16, %r3;") is None


@pytest.mark.all_kernels
@pytest.mark.parametrize("chunk", range(CHUNKS))
@pytest.mark.parametrize("arch,warp", HIPCC)
def test_every_specialization_compiles_with_hipcc(arch, warp, chunk, tmp_path):
    hipcc = shutil.which("hipcc")
    if hipcc is None:
        _missing("hipcc")
    try:
        from cupyln._compile import OPTIONS, hip_source
        from cupyln._plan import all_kernel_names
    except ImportError as e:
        _missing(f"CuPy ({e})")
    src = tmp_path / "cupyln_all.hip"
    src.write_text(hip_source(_chunk(all_kernel_names(warp, hip=True), chunk)))
    out = tmp_path / f"cupyln_{arch}.o"
    env = dict(os.environ, HIP_PLATFORM="amd")
    full = chunk in MACHINE_CODE[arch]
    build = (["-c", str(src), "-o", str(out)] if full  # (hipcc passes linker flags: unused)
             else ["-fsyntax-only", "-Wno-unused-command-line-argument", str(src)])
    r = subprocess.run(
        [hipcc, "-x", "hip", f"--offload-arch={arch}", "--cuda-device-only", "-O3", "-Werror",
         *OPTIONS, *build],  # the options cupyln compiles with
        capture_output=True, text=True, env=env,
    )
    assert r.returncode == 0, r.stderr[-4000:]
    assert not full or out.stat().st_size > 0


def test_chunks_cover_every_name_once():
    names = {f"k{i}" for i in range(1279)}
    parts = [_chunk(names, i) for i in range(CHUNKS)]
    assert set().union(*parts) == names and sum(map(len, parts)) == len(names)
    # every chunk to CUDA code once (sm_90 or sm_80's PTX), half of them to a HIP target's
    cuda, hip = (MACHINE_CODE["sm_90"], MACHINE_CODE["sm_80"]), (MACHINE_CODE["gfx90a"],
                                                                 MACHINE_CODE["gfx1030"])
    assert set.union(*cuda) == set(range(CHUNKS)) and not set.intersection(*cuda)
    assert len(set.union(*hip)) == CHUNKS // 2 and not set.intersection(*hip)


def test_wheel_ships_kernel_sources(tmp_path):
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    r = subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "--no-deps", "-q", "-w", str(tmp_path), root],
        capture_output=True, text=True,
    )
    assert r.returncode == 0, r.stderr[-4000:]
    from cupyln import _compile

    (wheel,) = tmp_path.glob("cupyln-*.whl")
    names = set(zipfile.ZipFile(wheel).namelist())
    for f in (*_compile.HEADERS, *_compile.SOURCES):
        assert f"cupyln/kernels/{f}" in names
    assert "cupyln/py.typed" in names and "cupyln/docs/api.md" in names  # help(cupyln) names it
    assert "cupyln/_torch_native.cpp" in names  # cupyln.torch builds it


def test_the_kernel_folder_is_no_importable_package():
    """From the repository's root (on sys.path under ``python -m pytest``), ``import kernels``
    must not find cupyln's sources: transformers asks for Hugging Face's ``kernels`` package by
    that name, and takes any it finds."""
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    code = "import importlib.util as u; s = u.find_spec('kernels'); print(s and s.origin)"
    r = subprocess.run([sys.executable, "-c", code], cwd=root, capture_output=True, text=True)
    assert r.returncode == 0 and not r.stdout.strip().startswith(os.path.join(root, "kernels"))


def test_installed_package_finds_its_sources():
    from cupyln import _compile

    src = _compile.source()
    assert "norm_fwd" in src and "row_allreduce" in src and "ClusterSums" in src
    assert "#include" not in src and "#pragma once" not in src


def test_kernel_names_say_what_the_kernel_is():
    from cupyln._dtypes import FLOAT16
    from cupyln._spec import Spec

    names = Spec(FLOAT16, FLOAT16, 8, 4, 32).names("fwd")
    assert names["fwd_staged"] == (
        "norm_fwd<cl_half, cl_half, 8, 4, 32, cln::staged, cln::params_late, "
        "cln::cols_tested>")
    bwd = Spec(FLOAT16, FLOAT16, 8, 2, 32).names("bwd")
    assert bwd["bwd_staged_dyn"].endswith("cln::staged, cln::partials, cln::tickets>")


def _c_params(src, macro):
    """The parameters of a CLN_*_PARAMS macro's definition."""
    body = re.search(rf"#define {macro}\s+((?:.*\\\n)*.*)", src).group(1)
    return body.replace("\\\n", " ")


def _kind(param):
    """A C parameter's argument kind: p pointer, i int64, X the accumulation float."""
    param = " ".join(param.split())
    if "*" in param:
        return "p"
    if param.startswith("cl_i64 "):
        return "i"
    if param.startswith("typename Acc<T>::type "):
        return "X"
    raise AssertionError(f"a parameter of no known kind: {param!r}")


def test_each_kernels_parameters_are_the_planners_argument_kinds():
    """The host-kernel contract: every kernel's C parameter list (macros expanded) against the
    argument kinds the planner launches it with (_plan.kernel_args)."""
    from cupyln import _compile, _plan

    src = _compile.source()
    found = 0
    for m in re.finditer(r"__global__\s+void\s.*?(norm_\w+)\(([^{]*)\)\s*\{", src, re.S):
        name, params = m.group(1), m.group(2)
        while re.search(r"CLN_\w+_PARAMS", params):  # one macro may hold another
            macro = re.search(r"CLN_\w+_PARAMS", params).group(0)
            params = params.replace(macro, _c_params(src, macro))
        depth, parts, cur = 0, [], ""
        for ch in params:  # commas outside template brackets
            depth += (ch == "<") - (ch == ">")
            if ch == "," and depth == 0:
                parts.append(cur)
                cur = ""
            else:
                cur += ch
        kinds = "".join(_kind(p) for p in [*parts, cur])
        assert kinds == _plan.kernel_args(name), name
        found += 1
    assert found >= 25


_FLOAT8_HOST = r"""
#include <cmath>
#include <cstdio>
#include <cstring>
#define __device__
#define __forceinline__ inline
static unsigned __float_as_uint(float f) { unsigned u; std::memcpy(&u, &f, 4); return u; }
static float __uint_as_float(unsigned u) { float f; std::memcpy(&f, &u, 4); return f; }
static int __float2int_rn(float f) { return (int)std::nearbyint(f); }  // default: to even
static float __fmul_rn(float a, float b) { return a * b; }  // built with -ffp-contract=off
#define CLN_HOST
%s
// argv[3] "div": pairs (a, d) in, ClDivisor(d)(a) out; "rcp": ClReciprocal's a / d; else
// floats in, both float8s out.
int main(int argc, char** argv) {
  FILE* in = std::fopen(argv[1], "rb");
  FILE* out = std::fopen(argv[2], "wb");
  float v[2];
  if (argc > 3) {
    const bool rcp = argv[3][0] == 'r';
    while (std::fread(v, 4, 2, in) == 2) {
      const float q = rcp ? ClReciprocal(ClDivisor(v[1]))(v[0]) : ClDivisor(v[1])(v[0]);
      std::fwrite(&q, 4, 1, out);
    }
  } else {
    while (std::fread(v, 4, 1, in) == 1) {
      unsigned char q[2] = {cl_float8(v[0], false), cl_float8(v[0], true)};
      std::fwrite(q, 1, 2, out);
    }
  }
  return std::fclose(out) != 0;
}
"""


def _float8_host(tmp_path):
    """The host build of kernels/float8.cuh's conversion and divisor (see _FLOAT8_HOST)."""
    from cupyln._compile import _read

    cxx = shutil.which("c++") or shutil.which("g++")
    if cxx is None:
        _missing("a host C++ compiler")
    src = tmp_path / "f8.cpp"
    src.write_text(_FLOAT8_HOST % _read("float8.cuh").replace("#pragma once", ""))
    exe = tmp_path / "f8"
    subprocess.run([cxx, "-O1", "-std=c++17", "-ffp-contract=off", str(src), "-o", str(exe)],
                   check=True)
    return exe


def test_float8_conversion_matches_ml_dtypes_bit_for_bit(tmp_path):
    """The kernels' float32 -> float8 conversion (kernels/float8.cuh, built here by the host's
    C++ compiler) gives ml_dtypes' bits for x clipped to +-fmax: every float32 whose low 16
    bits are one of seven patterns (so every exponent, and the ties and their neighbours of
    every rounding position of both formats), infinities and NaN; NaN compared as NaN."""
    import ml_dtypes
    import numpy as np

    exe = _float8_host(tmp_path)
    high = np.arange(1 << 16, dtype=np.uint32) << 16
    low = np.array([0, 1, 0x7FFF, 0x8000, 0x8001, 0xFFFF, 0x1234], np.uint32)
    bits = (high[:, None] | low[None, :]).ravel()
    v = bits.view(np.float32)
    v.tofile(tmp_path / "in.bin")
    subprocess.run([str(exe), str(tmp_path / "in.bin"), str(tmp_path / "out.bin")], check=True)
    got = np.fromfile(tmp_path / "out.bin", np.uint8).reshape(-1, 2)
    for col, (dt, fmax) in enumerate([(ml_dtypes.float8_e4m3fn, 448.0),
                                      (ml_dtypes.float8_e5m2, 57344.0)]):
        want = np.clip(v, -fmax, fmax).astype(dt)
        nan = np.isnan(v)
        assert np.array_equal(got[~nan, col], want[~nan].view(np.uint8)), dt
        assert np.isnan(got[nan, col].view(dt).astype(np.float32)).all()
        assert (got[nan, col] & 0x80 == (bits[nan] >> 24) & 0x80).all()  # NaN keeps its sign


def _quotients(tmp_path, mode):
    """(pairs (a, d), a / d in float32 from the host build's ``mode``, the correctly rounded
    a / d): dividends and divisors of every exponent (subnormal, huge, infinite and NaN
    included), half of them as the kernels divide: y of 2^-30 to 2^20 by a scale of 2^-20 to
    2^20."""
    import numpy as np

    exe = _float8_host(tmp_path)
    rng = np.random.default_rng(0)
    n = 1 << 21
    bits = rng.integers(0, 1 << 32, size=(n, 2), dtype=np.uint64).astype(np.uint32)
    pairs = bits.view(np.float32).copy()
    near = rng.integers(0, 1 << 32, size=(n // 2, 2), dtype=np.uint64).astype(np.uint32)
    exps = (near % np.array([50, 40], np.uint32) + np.array([97, 107], np.uint32)) << 23
    pairs[: n // 2] = (near & 0x807FFFFF | exps).astype(np.uint32).view(np.float32)
    pairs[: n // 2, 1] = np.abs(pairs[: n // 2, 1])
    pairs[:8] = [[1, 0], [0, np.inf], [1, np.inf], [np.inf, np.inf], [np.inf, 3], [np.nan, 2],
                 [3, np.nan], [5e-45, 7e-45]]
    pairs.tofile(tmp_path / "in.bin")
    subprocess.run([str(exe), str(tmp_path / "in.bin"), str(tmp_path / "out.bin"), mode],
                   check=True)
    got = np.fromfile(tmp_path / "out.bin", np.float32)
    with np.errstate(all="ignore"):
        want = pairs[:, 0] / pairs[:, 1]
    return pairs, got, want


F8_MAX = (("float8_e4m3fn", 448.0), ("float8_e5m2", 57344.0))


def test_float8_divisor_rounds_as_division(tmp_path):
    """The correctly rounded quotients of kernels/float8.cuh (ClDivisor, built by the host's
    C++ compiler; the quantized forward's per-row scales): bit for bit the float32 quotient
    from 2^-17 to 2^17 (below, every float8 flushes it to 0; above, saturates it), and the same
    float8s everywhere (a zero of the quotient's sign; NaN for NaN, of either sign)."""
    import ml_dtypes
    import numpy as np

    pairs, got, want = _quotients(tmp_path, "div")
    same = (got.view(np.uint32) == want.view(np.uint32)) | (np.isnan(got) & np.isnan(want))
    resolved = (np.abs(want) >= 2.0**-17) & (np.abs(want) <= 2.0**17)
    assert resolved.sum() > len(pairs) // 4 and same[resolved].all(), pairs[~same & resolved][:5]
    for name, fmax in F8_MAX:
        dt = getattr(ml_dtypes, name)
        a, b = (np.clip(q, -fmax, fmax).astype(dt).view(np.uint8) for q in (got, want))
        differ = (a != b) & ~(np.isnan(got) & np.isnan(want))  # a NaN's sign is not kept
        assert not differ.any(), pairs[differ][:5]


def test_float8_reciprocal_quotients_are_within_one_code(tmp_path):
    """The quantized forward's y / scale (ClReciprocal: y times the scale's reciprocal): within
    1.5 float32 ulps of the correctly rounded quotient where the dividend and the quotient are
    normal floats, and everywhere each float8 code the quotient's or its neighbour (the
    quotient's on all but a few in a million); NaN for NaN."""
    import ml_dtypes
    import numpy as np

    pairs, got, want = _quotients(tmp_path, "rcp")
    nan = np.isnan(want)
    assert np.array_equal(np.isnan(got), nan)
    tiny = np.finfo(np.float32).tiny
    normal = (np.abs(want) >= tiny) & np.isfinite(want) & (np.abs(pairs[:, 0]) >= tiny)
    err = np.abs(got[normal].astype(np.float64) - want[normal]) / np.spacing(np.abs(want[normal]))
    assert normal.sum() > len(pairs) // 4 and (err <= 1.5).all()
    for name, fmax in F8_MAX:
        dt = getattr(ml_dtypes, name)
        a, b = (_f8_codes(np.clip(q[~nan], -fmax, fmax).astype(dt).view(np.uint8))
                for q in (got, want))
        assert (np.abs(a - b) <= 1).all() and (a != b).mean() < 1e-5, (a != b).mean()


def _f8_codes(q):
    """Float8 bits as signed integers ordered as the values (+-0 both 0)."""
    import numpy as np

    q = q.astype(np.int32)
    return np.where(q & 0x80, -(q & 0x7F), q)
