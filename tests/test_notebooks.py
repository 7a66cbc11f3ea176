"""Every notebook runs top to bottom (NumPy path without a GPU, the kernels with one)."""

import pathlib

import pytest

NOTEBOOKS = sorted((pathlib.Path(__file__).parent.parent / "notebooks").glob("*.ipynb"))


def test_there_are_notebooks():
    assert NOTEBOOKS


@pytest.mark.parametrize("path", NOTEBOOKS, ids=[p.name for p in NOTEBOOKS])
def test_notebook_executes(path):
    nbformat = pytest.importorskip("nbformat")
    nbclient = pytest.importorskip("nbclient")
    nb = nbformat.read(path, as_version=4)
    nbclient.NotebookClient(nb, timeout=600, kernel_name="python3",
                            resources={"metadata": {"path": str(path.parent)}}).execute()
    errors = [o for c in nb.cells if c.cell_type == "code" for o in c.get("outputs", [])
              if o.get("output_type") == "error"]
    assert not errors


@pytest.mark.parametrize("path", NOTEBOOKS, ids=[p.name for p in NOTEBOOKS])
def test_notebook_uses_public_api_only(path):
    import json
    import re

    code = "".join("".join(c["source"]) for c in json.loads(path.read_text())["cells"]
                   if c["cell_type"] == "code")
    assert not re.search(r"cupyln\._|from cupyln import _", code)


def test_readme_points_to_the_notebooks():
    readme = (pathlib.Path(__file__).parent.parent / "README.md").read_text()
    for p in NOTEBOOKS:
        assert f"notebooks/{p.name}" in readme
