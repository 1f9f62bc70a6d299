"""Files saved by kerasmp 0.1.0 (commit e3211c8, before the package
re-layout) still load, with the same classes, dtypes, state and outputs.

The files in tests/fixtures/saved_by_0.1.0 were written once by
`make_fixtures.py` beside them (TensorFlow backend) and are never
rewritten: they stand for the users' files on disk. The expected values
are what that kerasmp computed before saving.
"""

import json
from pathlib import Path

import keras
import numpy as np
import pytest

import kerasmp

FIXTURES = Path(__file__).resolve().parent / "fixtures" / "saved_by_0.1.0"
EXPECTED = json.loads((FIXTURES / "expected.json").read_text())


def _load(name):
    return keras.saving.load_model(FIXTURES / name)


def test_a_mixed_model_with_kerasmp_policy_and_optimizer_loads():
    model = _load("mixed_float16.keras")
    expected = EXPECTED["mixed_float16"]
    assert isinstance(model.optimizer, kerasmp.LossScaleOptimizer)
    assert model.optimizer.hysteresis == 2
    assert model.optimizer.max_scale == 2.0**20
    # The optimizer state came back (not re-initialised to initial_scale).
    assert model.optimizer.loss_scale == expected["loss_scale"]
    assert int(keras.ops.convert_to_numpy(model.optimizer.iterations)) == (
        expected["iterations"])
    # (The input layer's own dtype depends on the loading backend.)
    layers = {l.name: l.compute_dtype for l in model.layers[1:]}
    assert layers == {k: v for k, v in expected["compute_dtypes"].items()
                      if k in layers}
    assert layers["norm"] == "float32" and layers["dense"] == "float16"
    assert isinstance(model.get_layer("dense").dtype_policy, kerasmp.Policy)
    x = np.load(FIXTURES / "inputs.npy")
    np.testing.assert_allclose(model.predict(x, verbose=0),
                               expected["predict"], atol=2e-3)


def test_a_float8_model_loads_with_its_float8_layers():
    model = _load("float8_mixed_bfloat16.keras")
    expected = EXPECTED["float8_mixed_bfloat16"]
    assert [p for p, _ in kerasmp.float8.float8_layers(model)] == (
        expected["float8_layers"])
    policies = {l.name: type(l.dtype_policy).__name__
                for l in model.layers[1:]}
    assert policies == {k: v for k, v in expected["policies"].items()
                        if k in policies}
    assert policies["hidden"] == "Float8Assignment"
    x = np.load(FIXTURES / "float8_inputs.npy")
    np.testing.assert_allclose(model.predict(x, verbose=0),
                               expected["predict"], atol=2e-2)


def test_a_halfmodel_file_loads():
    model = _load("halfmodel_float32.keras")
    expected = EXPECTED["halfmodel_float32"]
    assert type(model).__name__ == expected["class"]
    x = np.load(FIXTURES / "inputs.npy")
    np.testing.assert_allclose(np.asarray(model(x)), expected["predict"],
                               atol=1e-5)


@pytest.mark.parametrize("name", ["export_float16.keras"])
def test_a_plain_float16_export_loads(name):
    model = _load(name)
    x = np.load(FIXTURES / "inputs.npy")
    np.testing.assert_allclose(
        model.predict(x, verbose=0), EXPECTED["mixed_float16"]["predict"],
        atol=5e-3)
