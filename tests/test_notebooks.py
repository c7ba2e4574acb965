"""The notebooks run top to bottom without an error, and are committed with their outputs cleared.

Needs `nbclient` (which brings `nbformat` and `jupyter_client`) and `ipykernel`; the kernel is this very
interpreter (a temporary kernelspec pointing at `sys.executable`), so a `python3` kernelspec of some
other environment cannot be picked up by mistake.
"""

import json
import os
import pathlib
import sys

import pytest

REPO = pathlib.Path(__file__).resolve().parents[1]
NOTEBOOKS = sorted((REPO / "notebooks").glob("*.ipynb"))
KERNEL = "jfp8-test-python"


def test_notebooks_exist():
    names = [p.name for p in NOTEBOOKS]
    assert "01_fp8_basics.ipynb" in names and "02_accumulation_precision.ipynb" in names, names


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.name)
def test_outputs_cleared(path):
    nb = json.loads(path.read_text())
    assert nb["nbformat"] == 4
    for i, cell in enumerate(nb["cells"]):
        if cell["cell_type"] == "code":
            assert cell.get("outputs") == [], f"{path.name} cell {i} has outputs: clear them before commit"
            assert cell.get("execution_count") is None, f"{path.name} cell {i} has an execution count"


@pytest.fixture
def this_python_kernel(tmp_path, monkeypatch):
    """A kernelspec named KERNEL that runs ipykernel in this interpreter, with the repo importable."""
    pytest.importorskip("ipykernel")
    spec = tmp_path / "kernels" / KERNEL
    spec.mkdir(parents=True)
    (spec / "kernel.json").write_text(json.dumps({
        "argv": [sys.executable, "-m", "ipykernel_launcher", "-f", "{connection_file}"],
        "display_name": "jfp8 tests",
        "language": "python",
    }))
    for var, first in (("JUPYTER_PATH", tmp_path), ("PYTHONPATH", REPO)):  # our spec first; jfp8 importable
        monkeypatch.setenv(var, os.pathsep.join(p for p in (str(first), os.environ.get(var, "")) if p))
    monkeypatch.setenv("MPLBACKEND", "Agg")
    return KERNEL


@pytest.mark.slow
@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.name)
def test_notebook_runs(path, this_python_kernel):
    nbformat = pytest.importorskip("nbformat")
    nbclient = pytest.importorskip("nbclient")
    nb = nbformat.read(path, as_version=4)
    client = nbclient.NotebookClient(
        nb,
        timeout=300,  # per cell
        kernel_name=this_python_kernel,
        resources={"metadata": {"path": str(path.parent)}},  # run from notebooks/, as a user would
    )
    client.execute()  # raises CellExecutionError, with the cell and the traceback, on any error
    errors = [o for c in nb.cells if c.cell_type == "code" for o in c.outputs if o.output_type == "error"]
    assert not errors, errors
