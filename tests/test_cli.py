"""``cupyln`` / ``python -m cupyln``: help, version, the self-check and errors on any machine
(these run without a GPU)."""

import os
import shutil
import subprocess
import sys

import numpy as np
import pytest

import cupyln
from cupyln import api, check


def _run(*args):
    return subprocess.run([sys.executable, "-m", *args], capture_output=True, text=True,
                          timeout=300)


@pytest.mark.parametrize("args", [("cupyln", "--help"), ("cupyln", "-h"),
                                  ("cupyln", "bench", "--help"), ("cupyln.bench", "--help")])
def test_help_works_anywhere(args):
    r = _run(*args)
    assert r.returncode == 0 and "usage: python -m cupyln" in r.stdout


@pytest.mark.parametrize("command,words", [
    ("check", ["finite differences", "float64 reference", "Exit status"]),
    ("bench", ["PyTorch and Liger-Kernel", 'pip install "cupyln[cuda13]"', "--shape OP M N DTYPE",
               "JSON output", "provider"]),
    ("info", ["versions", "compile-cache"]),
    ("docs", ["API contract"]),
])
def test_each_commands_help_says_what_it_does(command, words):
    r = _run("cupyln", command, "--help")
    assert r.returncode == 0 and f"usage: python -m cupyln {command}" in r.stdout
    text = " ".join(r.stdout.split())
    for w in words:
        assert w in text, w


def test_version():
    r = _run("cupyln", "--version")
    assert r.returncode == 0 and r.stdout.strip() == f"cupyln {cupyln.__version__}"


def test_installed_version_is_the_package_version():
    """The wheel's metadata takes its version from cupyln.__version__ (one place)."""
    from importlib import metadata

    assert metadata.version("cupyln") == cupyln.__version__


@pytest.mark.parametrize("args", [("bogus",), ("check", "--bogus"), ("info", "extra")])
def test_unknown_arguments_exit_2(args):
    r = _run("cupyln", *args)
    assert r.returncode == 2 and "error" in r.stderr


def test_info_names_versions_device_and_cache():
    r = _run("cupyln", "info")
    assert r.returncode == 0
    for word in (f"cupyln {cupyln.__version__}", "numpy", "compile cache", "device"):
        assert word in r.stdout


def test_docs_prints_the_contract():
    r = _run("cupyln", "docs")
    assert r.returncode == 0 and "layer_norm_fwd(x, gamma=None" in r.stdout


def test_check_checks_gradients_and_precision():
    r = _run("cupyln")
    assert r.returncode == 0, r.stdout + r.stderr
    assert "gradients on" in r.stdout and "finite differences" in r.stdout
    assert "precision on" in r.stdout
    done = r.stdout.strip().splitlines()[-1]
    n = int(done.split("/")[0])
    assert done == f"{n}/{n} outputs within tolerance" and n >= 40


def test_gpu_commands_name_the_extra_to_install():
    try:
        import cupy  # noqa: F401

        pytest.skip("CuPy is installed: the message is for machines without it")
    except ImportError:
        pass
    r = _run("cupyln", "bench")
    assert r.returncode == 1 and 'pip install "cupyln[cuda13]"' in r.stderr


def test_console_script():
    exe = shutil.which("cupyln") or os.path.join(os.path.dirname(sys.executable), "cupyln")
    if not os.path.exists(exe):
        pytest.skip("cupyln is not installed with its console script here")
    r = subprocess.run([exe, "--help"], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0 and r.stdout.startswith("usage: cupyln ")


def test_gradient_check_passes_and_catches_a_wrong_backward(monkeypatch):
    for op, fused in check.GRADIENT_PROBLEMS:
        for name, err, tol in check.gradient_check(np, op, fused):
            assert err <= tol, (op, fused, name, err)
    bwd = api.layer_norm_bwd

    def off(*a, **kw):  # dgamma 0.1% off
        dx, dg, db = bwd(*a, **kw)
        return dx, dg * 1.001, db

    monkeypatch.setattr(api, "layer_norm_bwd", off)
    rows = dict((n, e) for n, e, _ in check.gradient_check(np, "layernorm", False))
    assert rows["dgamma"] > 100 * check.GRAD_TOL and rows["dx"] <= check.GRAD_TOL
