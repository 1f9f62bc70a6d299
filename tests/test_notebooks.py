"""The notebooks in notebooks/ execute top to bottom without error.

Each notebook ends with a cell that asserts its key results (accuracy, the
dtypes of the layers, the located layer, the export's parity...), so a
notebook that runs but shows the wrong thing fails here too. They are stored
without outputs; this test checks that as well.

Notebooks 01, 02 and 04 run on the backend of the test run (the kernel inherits
KERAS_BACKEND); 03 needs TensorFlow (SavedModel, TFLite).
"""

import os
import pathlib

import keras
import pytest
from _helpers import slow_on

nbformat = pytest.importorskip("nbformat")
nbclient = pytest.importorskip("nbclient")
pytest.importorskip("ipykernel")

NOTEBOOKS = pathlib.Path(__file__).resolve().parent.parent / "notebooks"
ROOT = NOTEBOOKS.parent
TIMEOUT_PER_CELL = 300


def _run(name, tmp_path, backend):
    notebook = nbformat.read(NOTEBOOKS / name, as_version=4)
    env_backup = dict(os.environ)
    os.environ["KERAS_BACKEND"] = backend
    os.environ["TF_CPP_MIN_LOG_LEVEL"] = "2"
    # The kernel imports kerasmp from this checkout, installed or not.
    os.environ["PYTHONPATH"] = os.pathsep.join(
        p for p in (str(ROOT), env_backup.get("PYTHONPATH")) if p
    )
    try:
        client = nbclient.NotebookClient(
            notebook,
            timeout=TIMEOUT_PER_CELL,
            kernel_name="python3",
            resources={"metadata": {"path": str(tmp_path)}},
        )
        client.execute()
    finally:
        os.environ.clear()
        os.environ.update(env_backup)
    return notebook


def _outputs_text(notebook):
    text = []
    for cell in notebook.cells:
        for out in cell.get("outputs", []):
            text.append(out.get("text", ""))
            text.append(str(out.get("data", {}).get("text/plain", "")))
    return "\n".join(text)


@pytest.mark.parametrize("name", sorted(p.name for p in
                                        NOTEBOOKS.glob("*.ipynb")))
def test_stored_without_outputs(name):
    notebook = nbformat.read(NOTEBOOKS / name, as_version=4)
    nbformat.validate(notebook)
    for cell in notebook.cells:
        if cell.cell_type == "code":
            assert cell.outputs == [], f"{name}: a cell has stored outputs"
            assert cell.execution_count is None
    code = "\n".join(c.source for c in notebook.cells
                     if c.cell_type == "code")
    assert "assert " in code, f"{name} has no cell asserting its results"


@pytest.mark.parametrize(
    "name", [
        # Each runs once in the default suite, on the cheaper backend, and
        # on the other in CI's slow pass: 01 trains a CNN for 8 epochs (100 s
        # on TensorFlow, float16 convolutions without XLA; 20 s on JAX).
        pytest.param("01_quickstart.ipynb", marks=slow_on("tensorflow")),
        pytest.param("02_debugging_nonfinite.ipynb", marks=slow_on("jax")),
        pytest.param("04_underflow.ipynb", marks=slow_on("jax")),
    ]
)
def test_notebook_runs(name, tmp_path):
    notebook = _run(name, tmp_path, keras.backend.backend())
    assert "all checks passed" in _outputs_text(notebook)


@pytest.mark.tensorflow
def test_export_notebook_runs(tmp_path):
    notebook = _run("03_export_fp16.ipynb", tmp_path, "tensorflow")
    assert "all checks passed" in _outputs_text(notebook)
    assert (tmp_path / "digits_fp16_savedmodel" / "saved_model.pb").exists()
    assert (tmp_path / "digits_fp16.keras").exists()


def test_the_guide_lists_every_notebook():
    """docs/guide.md's table of notebooks named 3 of the 4."""
    guide = (ROOT / "docs" / "guide.md").read_text(encoding="utf-8")
    for path in sorted(NOTEBOOKS.glob("*.ipynb")):
        assert f"(../notebooks/{path.name})" in guide, path.name
