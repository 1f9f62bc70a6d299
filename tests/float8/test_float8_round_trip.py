"""The float8 ship path as docs/float8.md walks it, on every backend: train a
Sequential model in float8, dequantize the model in memory (no save and
reload first), export it, and serve the file where kerasmp is absent."""

import subprocess
import sys

import keras
import numpy as np
import pytest
from _helpers import BLOCK_KERASMP
from _helpers import script_result
from _helpers import subprocess_env

import kerasmp

pytestmark = pytest.mark.torch  # also in the PyTorch pass (conftest.py)

SERVE = BLOCK_KERASMP + """
import keras, numpy as np
model = keras.saving.load_model(sys.argv[1], compile=False)
y = keras.ops.convert_to_numpy(model(np.load(sys.argv[2]))).astype("float64")
print("RESULT " + json.dumps(y.tolist()))
"""


def test_dequantize_the_in_memory_model_export_and_serve(float8_policy,
                                                         tmp_path):
    keras.utils.set_random_seed(0)
    model = keras.Sequential([
        keras.Input((64,)),
        keras.layers.Dense(128, activation="relu", name="first"),
        keras.layers.Dense(128, activation="relu", name="hidden"),
        keras.layers.Dense(10, activation="softmax", name="head"),
    ])
    model.compile("adam", "sparse_categorical_crossentropy")
    assert [p for p, _ in kerasmp.float8.float8_layers(model)] == ["hidden"]
    rng = np.random.default_rng(0)
    x = rng.normal(size=(128, 64)).astype("float32")
    y = rng.integers(0, 10, 128)
    model.fit(x, y, batch_size=32, epochs=1, verbose=0)
    # The in-memory Sequential names its variables "sequential/first/...",
    # its rebuilt copy "first/...": the copy still gets every weight.
    plain = kerasmp.float8.dequantize(model)
    assert kerasmp.float8.float8_layers(plain) == []
    np.testing.assert_array_equal(
        keras.ops.convert_to_numpy(plain.get_layer("first").kernel),
        keras.ops.convert_to_numpy(model.get_layer("first").kernel))
    expected = keras.ops.convert_to_numpy(model(x[:16])).astype("float64")
    np.testing.assert_allclose(
        keras.ops.convert_to_numpy(plain(x[:16])), expected, atol=0.05)

    kerasmp.set_global_policy("float32")
    path = tmp_path / "served.keras"
    report = kerasmp.export.export(plain, path, format="keras",
                                   sample=x[:64])
    assert report.passed()
    np.save(tmp_path / "x.npy", x[:16])
    backend = keras.backend.backend()
    out = subprocess.run(
        [sys.executable, "-c", SERVE, str(path), str(tmp_path / "x.npy")],
        capture_output=True, text=True, env=subprocess_env(backend),
        timeout=300,
    )
    served = np.asarray(script_result(out.stdout, out.stderr,
                                      out.returncode))
    # float16 weights and the float8 input rounding the copy drops.
    np.testing.assert_allclose(served, expected, atol=0.05)
    assert (served.argmax(1) == expected.argmax(1)).mean() >= 0.9
