"""The hand-off matrix (`benchmarks/handoffs.py`, docs/export.md "The
hand-off matrix"): its JSON, the tables generated from it, and its cells
run again.

- Cheap: `benchmarks/results/handoffs.json` holds every cell of the spec,
  each `ok` or `refused: <one line>`; the README's, docs/guide.md's and
  docs/export.md's tables are what the JSON renders (no table claims a
  cell that has not run); the matrix's CNN is the demo's.
- Quick (each backend's pass): that backend's quick cell
  (`cells.QUICK`), produced in the test's process and read in a fresh
  one, must come out as the JSON says: a cell `ok` there must be `ok`, a
  refused one refused for the same reason (else the JSON is stale: rerun
  `python benchmarks/handoffs.py`).
- Slow (CI's slow pass): the subset `cells.SLOW`, every process fresh.
"""

import json
import re
import sys

import keras
import pytest
from _helpers import ROOT

import kerasmp

sys.path.insert(0, str(ROOT / "benchmarks"))

from handoffs import cells as spec  # noqa: E402
from handoffs import models  # noqa: E402
from handoffs import report  # noqa: E402
from handoffs import runner  # noqa: E402

RESULT = ROOT / "benchmarks" / "results" / "handoffs.json"
STALE = ("benchmarks/results/handoffs.json is stale or a cell broke: rerun "
         "`python benchmarks/handoffs.py` (and commit the JSON and tables) "
         "if the change is meant")


def _data():
    return json.loads(RESULT.read_text())


def _same(value):
    """A cell's value with its figures masked (a parity figure moves)."""
    return re.sub(r"\d+(\.\d+)?(e[-+]?\d+)?", "#", value)


def _check(results, data):
    got = {key: r["cell"] for key, r in results.items()}
    want = {key: data["cells"][key] for key in got}
    assert {k: _same(v) for k, v in got.items()} == {
        k: _same(v) for k, v in want.items()}, STALE


def test_the_json_holds_every_cell_ok_or_refused_with_one_line():
    data = _data()
    assert list(data["cells"]) == [c.key for c in spec.cells()]
    for key, value in data["cells"].items():
        assert value == "ok" or (
            value.startswith("refused: ") and len(value) > 12
            and "\n" not in value), (key, value)
    assert data["counts"] == report.counts(data["cells"])
    for field in ("date", "machine", "commit", "versions", "seconds",
                  "command"):
        assert data[field], field
    # The keras-hub model is one whose MoE routers kerasmp moves to
    # float32 (what a reload must keep).
    for producer in spec.PRODUCERS:
        routers = data["producers"][f"{producer}/gpt_oss"]["routers"]
        assert routers and set(routers.values()) == {"float32"}, producer


def test_the_tables_are_what_the_json_renders():
    data = _data()
    for rel, (text, new) in report.rendered(data, str(ROOT)).items():
        assert text == new, (
            f"{rel}'s hand-off table differs from the JSON's: run "
            "`python benchmarks/handoffs.py --render`")


def test_a_table_changes_with_the_json():
    data = _data()
    key = spec.Cell("tensorflow", "cnn", "onnx-float16", "onnxruntime").key
    flipped = dict(data, cells={**data["cells"], key: (
        "refused: load: made up" if data["cells"][key] == "ok" else "ok")})
    flipped["counts"] = report.counts(flipped["cells"])
    rendered = report.rendered(flipped, str(ROOT))
    assert rendered["docs/export.md"][0] != rendered["docs/export.md"][1]
    assert rendered["README.md"][0] != rendered["README.md"][1]


def test_the_matrix_cnn_is_the_demo_cnn():
    from kerasmp.apps.zoo import digits_cnn

    assert models.build("cnn").get_config() == digits_cnn().get_config()


@pytest.mark.torch
def test_the_quick_cell_of_this_backend_is_what_the_json_says(tmp_path):
    from handoffs import produce

    data = _data()
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
        _check(results, data)


@pytest.mark.slow
@pytest.mark.tensorflow  # it starts every backend's processes itself
def test_the_slow_subset_is_what_the_json_says(tmp_path):
    results, manifests = runner.run(list(spec.SLOW), str(tmp_path),
                                    log=lambda line: None)
    assert set(results) == {c.key for c in spec.SLOW}
    _check(results, _data())
