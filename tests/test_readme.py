"""README.md cannot drift: its API table's signatures are the functions' own, and every Python
example in it runs (the CuPy one on a GPU, the PyTorch one where torch is installed)."""

import inspect
import pathlib
import re

import pytest

import cupyln

README = (pathlib.Path(__file__).parent.parent / "README.md").read_text()
ROWS = re.findall(r"^\| `((?:cupyln\.torch\.)?\w+)(\(.*?\))` \|", README, re.M)
BLOCKS = re.findall(r"```python\n(.*?)```", README, re.S)


def _plain(fn):
    """``fn``'s signature as the README writes it: without annotations."""
    sig = inspect.signature(fn)
    params = [p.replace(annotation=p.empty) for p in sig.parameters.values()]
    return str(sig.replace(parameters=params, return_annotation=sig.empty))


def _resolve(name):
    if name.startswith("cupyln.torch."):
        return getattr(pytest.importorskip("cupyln.torch"), name.rsplit(".", 1)[1])
    return getattr(cupyln, name)


def test_the_table_lists_every_public_function():
    listed = {n for n, _ in ROWS}
    assert {n for n in cupyln.__all__ if callable(getattr(cupyln, n))
            and not isinstance(getattr(cupyln, n), type)} <= listed
    assert {"cupyln.torch.layer_norm", "cupyln.torch.rms_norm", "cupyln.torch.add_layer_norm",
            "cupyln.torch.add_rms_norm", "cupyln.torch.replace_norms"} <= listed


@pytest.mark.parametrize("name,sig", ROWS, ids=[n for n, _ in ROWS])
def test_the_tables_signature_is_the_functions(name, sig):
    assert sig == _plain(_resolve(name))


def _needs(src):
    if re.search(r"^import cupy( |$)", src, re.M):
        pytest.importorskip("cupy")
        from conftest import gpu_count

        if gpu_count() < 1:
            pytest.skip("needs a GPU (none found)")
    for module in ("torch", "transformers"):
        if re.search(rf"^import {module}( |$)", src, re.M):
            pytest.importorskip(module)


def test_there_are_examples():
    assert len(BLOCKS) >= 3


@pytest.mark.parametrize("i", range(len(BLOCKS)))
def test_the_example_runs(i, capsys):
    src = BLOCKS[i]
    _needs(src)
    exec(compile(src, f"README.md python block {i}", "exec"), {"__name__": "readme"})
    if "print(model[1])" in src:
        assert capsys.readouterr().out.startswith("cupyln.torch.LayerNorm((64,), eps=1e-05")
    if "print(len(report.swapped), report.left)" in src:
        assert capsys.readouterr().out == "5 {}\n"
