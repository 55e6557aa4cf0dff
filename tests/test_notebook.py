"""notebooks/quickstart.ipynb: executes headlessly top to bottom (any failing cell fails the test),
draws its plots inline, and is the clean output of notebooks/make_quickstart.py."""
from __future__ import annotations

import importlib.util
from pathlib import Path

import nbformat
import pytest
from nbclient import NotebookClient

NOTEBOOKS = Path(__file__).resolve().parents[1] / "notebooks"
NOTEBOOK = NOTEBOOKS / "quickstart.ipynb"


def _load_generator():
    spec = importlib.util.spec_from_file_location("make_quickstart",
                                                  NOTEBOOKS / "make_quickstart.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_committed_notebook_is_clean_and_matches_generator():
    nb = nbformat.read(NOTEBOOK, as_version=4)
    nbformat.validate(nb)
    for cell in nb.cells:
        if cell.cell_type == "code":
            assert cell.outputs == [] and cell.execution_count is None, (
                f"{cell.id} has outputs; regenerate with python notebooks/make_quickstart.py")
    assert NOTEBOOK.read_text() == _load_generator().render(), (
        "quickstart.ipynb is stale; run python notebooks/make_quickstart.py")


def test_local_model_cell_defaults_to_demo_model():
    # The user-edited cell must ship empty so the notebook never downloads anything.
    nb = nbformat.read(NOTEBOOK, as_version=4)
    sources = [c.source for c in nb.cells if c.cell_type == "code"]
    assert any(s.startswith('MODEL_PATH = ""') for s in sources)
    assert any('REPO_URL = ""' in s and '"google.colab" in sys.modules' in s for s in sources)


def _kernel_for_this_interpreter(tmp_path: Path, monkeypatch) -> str:
    """Name of a kernelspec that runs ipykernel on sys.executable (this venv).

    The notebook's own "python3" would usually resolve here too, but a user-level kernelspec of
    that name (~/.local/share/jupyter) pointing at another Python would take precedence.
    """
    from ipykernel.kernelspec import write_kernel_spec

    name = "brorl-notebook-test"
    root = tmp_path / "jupyter"
    write_kernel_spec(str(root / "kernels" / name))
    monkeypatch.setenv("JUPYTER_PATH", str(root))
    return name


@pytest.mark.slow
def test_quickstart_executes_top_to_bottom(tmp_path, monkeypatch):
    monkeypatch.setenv("BRORL_NOTEBOOK_WORKDIR", str(tmp_path / "work"))
    monkeypatch.setenv("BRORL_NOTEBOOK_QUICK", "1")      # every cell, fewer steps
    nb = nbformat.read(NOTEBOOK, as_version=4)
    client = NotebookClient(nb, timeout=300,
                            kernel_name=_kernel_for_this_interpreter(tmp_path, monkeypatch),
                            resources={"metadata": {"path": str(NOTEBOOKS)}})
    client.execute()        # raises CellExecutionError naming the cell if any cell fails

    errors = [o for c in nb.cells if c.cell_type == "code" for o in c.outputs
              if o.output_type == "error"]
    assert not errors
    images = [o for c in nb.cells if c.cell_type == "code" for o in c.outputs
              if o.output_type == "display_data" and "image/png" in o.get("data", {})]
    assert len(images) == 4, f"expected 4 inline plots, got {len(images)}"
    # The run wrote its metrics where the notebook was told to.
    assert (tmp_path / "work" / "tiny_run" / "metrics.jsonl").exists()
    text = "".join(o.get("text", "") for c in nb.cells if c.cell_type == "code"
                   for o in c.outputs if o.output_type == "stream")
    assert "MODEL_PATH is empty" in text
    assert "notebook ran in" in text
