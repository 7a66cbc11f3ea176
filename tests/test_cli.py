"""``python -m cupyln``: help, version and errors on any machine (these run without a GPU)."""

import subprocess
import sys

import pytest

import cupyln


def _run(*args):
    return subprocess.run([sys.executable, "-m", *args], capture_output=True, text=True,
                          timeout=300)


@pytest.mark.parametrize("args", [("cupyln", "--help"), ("cupyln", "-h"),
                                  ("cupyln", "bench", "--help"), ("cupyln.bench", "--help")])
def test_help_works_anywhere(args):
    r = _run(*args)
    assert r.returncode == 0 and "usage: python -m cupyln" in r.stdout


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
