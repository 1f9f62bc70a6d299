"""The hand-off matrix (`benchmarks/handoffs.py`, docs/export.md "The
hand-off matrix"): its cells run again.

- Quick (each backend's pass): that backend's quick cell
  (`cells.QUICK`: TensorFlow's compiled `model.save` read by Keras on
  TensorFlow without kerasmp, JAX's `.weights.h5` by Keras on JAX,
  PyTorch's float16 ONNX by onnxruntime), produced in the test's process
  and read in a fresh one, must be `ok`.
- Slow (CI's slow pass): the subset `cells.SLOW`, every process fresh: each
  cell `ok`, or refused with kerasmp's own sentence for a format its
  backend cannot write.
"""

import sys

import keras
import pytest
from _helpers import ROOT

import kerasmp

sys.path.insert(0, str(ROOT / "benchmarks"))

from handoffs import cells as spec  # noqa: E402
from handoffs import models  # noqa: E402
from handoffs import runner  # noqa: E402

CANNOT_WRITE = "cannot be written from the"


def test_the_matrix_cnn_is_the_demo_cnn():
    from kerasmp.apps.zoo import digits_cnn

    assert models.build("cnn").get_config() == digits_cnn().get_config()


@pytest.mark.torch
def test_the_quick_cell_of_this_backend_is_ok(tmp_path):
    from handoffs import produce

    for cell in spec.QUICK[keras.backend.backend()]:
        folder = tmp_path / cell.producer / cell.model
        try:
            manifest = produce.produce(cell.model, str(folder),
                                       [cell.artifact])
        finally:
            kerasmp.set_global_policy("float32")
        results, _ = runner.run(
            [cell], str(tmp_path),
            manifests={f"{cell.producer}/{cell.model}": manifest},
            log=lambda line: None)
        assert results[cell.key]["cell"] == "ok", results[cell.key]


@pytest.mark.slow
@pytest.mark.tensorflow  # it starts every backend's processes itself
def test_the_slow_subset_is_ok_where_the_backend_writes_it(tmp_path):
    results, _ = runner.run(list(spec.SLOW), str(tmp_path),
                            log=lambda line: None)
    assert set(results) == {c.key for c in spec.SLOW}
    for key, result in results.items():
        cell = result["cell"]
        assert cell == "ok" or CANNOT_WRITE in cell, (key, cell)


def test_the_tables_are_the_recorded_matrix_and_every_cell_has_a_verdict():
    """README.md, docs/guide.md and docs/export.md show what
    benchmarks/results/handoffs.json recorded (no table claims a cell that
    has not run), and that JSON holds every cell of `cells.py`, each `ok`
    or `refused: <reason>`."""
    import json

    from handoffs import report

    with open(ROOT / "benchmarks" / "results" / "handoffs.json") as f:
        data = json.load(f)
    assert set(data["cells"]) == {c.key for c in spec.cells()}
    for key, value in data["cells"].items():
        assert value == "ok" or value.startswith("refused: "), (key, value)
    assert report.write_tables(data, str(ROOT), check=True) == []
