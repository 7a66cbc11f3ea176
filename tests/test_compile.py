"""Every kernel the planner can launch compiles, without a GPU: with NVRTC for sm_80 and sm_90
(warp 32), and with hipcc for gfx90a and gfx940 (wave64) and gfx1030 (wave32). In CI
(CI=true) a missing compiler is a failure, not a skip. Also: the wheel ships the sources."""

import os
import shutil
import subprocess
import sys
import zipfile

import pytest

IN_CI = bool(os.environ.get("CI"))


def _missing(what):
    if IN_CI:
        pytest.fail(f"{what} is not available, and CI must run this test")
    pytest.skip(f"{what} is not available")


@pytest.mark.parametrize("arch", ["sm_80", "sm_90"])
def test_every_specialization_compiles_with_nvrtc(arch):
    try:
        from cupyln._launch import all_kernel_names

        from cupyln._compile import compile_nvrtc
    except ImportError as e:
        _missing(f"CuPy ({e})")
    names = all_kernel_names(32)
    lowered = compile_nvrtc(names, arch)
    assert set(lowered) == names and all(lowered.values())


@pytest.mark.parametrize("arch,warp", [("gfx90a", 64), ("gfx940", 64), ("gfx1030", 32)])
def test_every_specialization_compiles_with_hipcc(arch, warp, tmp_path):
    hipcc = shutil.which("hipcc")
    if hipcc is None:
        _missing("hipcc")
    try:
        from cupyln._launch import all_kernel_names

        from cupyln._compile import OPTIONS, hip_source
    except ImportError as e:
        _missing(f"CuPy ({e})")
    src = tmp_path / "cupyln_all.hip"
    src.write_text(hip_source(all_kernel_names(warp)))
    out = tmp_path / f"cupyln_{arch}.o"
    env = dict(os.environ, HIP_PLATFORM="amd")
    r = subprocess.run(
        [hipcc, "-x", "hip", f"--offload-arch={arch}", "--cuda-device-only", "-O3", "-Werror",
         *OPTIONS, "-c", str(src), "-o", str(out)],  # the options cupyln compiles with
        capture_output=True, text=True, env=env,
    )
    assert r.returncode == 0, r.stderr[-4000:]
    assert out.stat().st_size > 0


def test_wheel_ships_kernel_sources(tmp_path):
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    r = subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "--no-deps", "-q", "-w", str(tmp_path), root],
        capture_output=True, text=True,
    )
    assert r.returncode == 0, r.stderr[-4000:]
    (wheel,) = tmp_path.glob("cupyln-*.whl")
    names = set(zipfile.ZipFile(wheel).namelist())
    for f in ("common.cuh", "norm_fwd.cu", "norm_bwd.cu"):
        assert f"cupyln/kernels/{f}" in names


def test_installed_package_finds_its_sources():
    from cupyln import _compile

    src = _compile.source()
    assert "norm_fwd" in src and "row_allreduce" in src and '#include "common.cuh"' not in src


def test_use_source_swaps_the_source_the_modules_compile():
    from cupyln import _compile

    current = _compile.source
    try:
        _compile.use_source(lambda: "// a variant")
        assert _compile.source() == "// a variant"
        assert "// a variant" in _compile.hip_source([])
    finally:
        _compile.use_source(current)
    assert "row_allreduce" in _compile.source()
