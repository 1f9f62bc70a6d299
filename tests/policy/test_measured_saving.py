"""What `compile`'s measurement moves to float32 is in the saved file: a
reload with kerasmp computes those layers in float32 from the start, and a
reload without kerasmp does too wherever stock Keras can compute them as
kerasmp does (`kerasmp.policy.saving.stock_measured`)."""

import json
import os
import subprocess
import sys
from pathlib import Path

import keras
import numpy as np
import pytest
from _helpers import BLOCK_KERASMP

import kerasmp

sys.path.insert(0, str(Path(__file__).parent))
from _routed import MoE  # noqa: E402

pytestmark = pytest.mark.torch

ROUTER = ("moe/router", "moe/router/scores")


def _trained(cast):
    keras.utils.set_random_seed(0)
    with kerasmp.policy_scope(kerasmp.Policy("mixed_float16")):
        inputs = keras.Input((8,))
        x = MoE(4, 3, cast=cast, name="moe")(inputs)
        outputs = keras.layers.Dense(2, activation="softmax", name="head")(x)
        model = keras.Model(inputs, outputs)
    model.compile("adam", "mse")
    rng = np.random.default_rng(0)
    x = rng.normal(size=(16, 8)).astype("float32")
    model.fit(x, rng.random((16, 2)).astype("float32"), epochs=2,
              batch_size=8, verbose=0)
    return model, x


def _dtypes(model):
    return {l.path: l.compute_dtype for l in model._flatten_layers()
            if l.path in ROUTER}


@pytest.mark.parametrize("cast", [True, False])
def test_moves_reload_with_kerasmp_before_any_call(cast, tmp_path):
    model, x = _trained(cast)
    assert _dtypes(model) == dict.fromkeys(ROUTER, "float32")
    model.save(tmp_path / "m.keras")
    loaded = keras.saving.load_model(tmp_path / "m.keras", compile=False)
    # Before any call (nothing measured it yet).
    assert _dtypes(loaded) == dict.fromkeys(ROUTER, "float32")
    np.testing.assert_array_equal(loaded.predict(x, verbose=0),
                                  model.predict(x, verbose=0))


_STOCK = BLOCK_KERASMP + """
import numpy as np
import keras
sys.path.insert(0, {here!r})
import _routed  # noqa: F401  (registers the block, as a user would)
x = np.load({x!r})
out = {{}}
for cast, path in {paths!r}.items():
    model = keras.saving.load_model(path)
    dtypes = {{l.path: l.compute_dtype for l in model._flatten_layers()
              if l.path in {router!r}}}
    preds = model.predict(x, verbose=0)
    model.fit(x, np.zeros((len(x), 2), "float32"), verbose=0)
    out[cast] = {{"dtypes": dtypes, "preds": preds.tolist(),
                 "trained": bool(all(np.isfinite(w).all()
                                     for w in model.get_weights()))}}
print(json.dumps(out))
"""


def test_portable_moves_reload_in_float32_without_kerasmp(tmp_path):
    paths, preds = {}, {}
    for cast in (True, False):
        model, x = _trained(cast)
        paths[str(cast)] = str(tmp_path / f"m_{cast}.keras")
        model.save(paths[str(cast)])
        preds[str(cast)] = model.predict(x, verbose=0)
    np.save(tmp_path / "x.npy", x)
    out = subprocess.run(
        [sys.executable, "-c", _STOCK.format(
            here=str(Path(__file__).parent), x=str(tmp_path / "x.npy"),
            paths=paths, router=ROUTER)],
        capture_output=True, text=True,
        env={**os.environ, "TF_CPP_MIN_LOG_LEVEL": "3"})
    assert out.returncode == 0, out.stderr[-3000:]
    rows = json.loads(out.stdout.strip().splitlines()[-1])
    # The block casts the router's gates: stock Keras computes the router in
    # float32 from the file's DTypePolicyMap, as kerasmp did. (PyTorch's
    # symbolic trace shows float32 throughout, so a file written there
    # keeps the move for kerasmp only.)
    if keras.backend.backend() != "torch":
        assert rows["True"]["dtypes"] == dict.fromkeys(ROUTER, "float32")
        np.testing.assert_allclose(rows["True"]["preds"], preds["True"],
                                   atol=1e-5)
    # The block multiplies the float32 gates into float16 expert outputs:
    # stock Keras (no hand-back) would fail there or compute the rest in
    # float32, so the file leaves the router to the block's mixed policy.
    assert rows["False"]["dtypes"] == dict.fromkeys(ROUTER, "float16")
    assert np.isfinite(rows["False"]["preds"]).all()
    assert rows["True"]["trained"] and rows["False"]["trained"]
