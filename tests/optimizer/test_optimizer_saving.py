"""The files a user writes after kerasmp's `compile` (`model.save`,
`ModelCheckpoint` `.keras` and `.weights.h5`) load compiled and train on,
with plain Keras where kerasmp is not installed, and with kerasmp with every
setting and the whole scale state (`kerasmp.optimizer.saving`)."""

import json
import os
import subprocess
import sys

import keras
import numpy as np
import pytest
from _helpers import BLOCK_KERASMP

import kerasmp

pytestmark = pytest.mark.torch

SETTINGS = dict(initial_scale=2.0**10, dynamic_growth_steps=2,
                growth_factor=4.0, backoff_factor=0.25, hysteresis=3,
                consecutive_hysteresis=True, min_scale=2.0**-4,
                max_scale=2.0**14)


def _data():
    rng = np.random.default_rng(0)
    return (rng.random((32, 4)).astype("float32"),
            rng.random((32, 2)).astype("float32"))


def _model():
    keras.utils.set_random_seed(0)
    with kerasmp.policy_scope(kerasmp.Policy("mixed_float16")):
        model = keras.Sequential([
            keras.Input((4,)), keras.layers.Dense(8, name="hidden"),
            keras.layers.Dense(2, name="out")])
    model.compile(kerasmp.LossScaleOptimizer(
        keras.optimizers.Adam(1e-2), **SETTINGS), "mse")
    return model


def _fit(model, epochs, initial_epoch=0, callbacks=()):
    x, y = _data()
    model.fit(x, y, batch_size=8, epochs=epochs, initial_epoch=initial_epoch,
              shuffle=False, verbose=0, callbacks=list(callbacks))


def _numpy(variables):
    return [np.asarray(keras.ops.convert_to_numpy(v)) for v in variables]


def _state(optimizer):
    """The scale state of a kerasmp optimizer, by name."""
    return {name: float(keras.ops.convert_to_numpy(v))
            for name, v in optimizer.state_variables().items()}


def _checkpoints(tmp_path):
    """Trains 2 epochs under kerasmp with both checkpoints and saves the
    model after the first: the files of epoch 1 and the straight run."""
    model = _model()
    callbacks = [
        keras.callbacks.ModelCheckpoint(str(tmp_path / "ckpt-{epoch}.keras")),
        keras.callbacks.ModelCheckpoint(
            str(tmp_path / "ckpt-{epoch}.weights.h5"),
            save_weights_only=True),
    ]
    _fit(model, 1, callbacks=callbacks)
    model.save(tmp_path / "model.keras")
    saved = dict(
        weights=_numpy(model.weights),
        optimizer=_numpy(model.optimizer.variables),
        state=_state(model.optimizer),
    )
    _fit(model, 2, initial_epoch=1, callbacks=callbacks)
    files = {"model.save": tmp_path / "model.keras",
             "ModelCheckpoint .keras": tmp_path / "ckpt-1.keras",
             "ModelCheckpoint .weights.h5": tmp_path / "ckpt-1.weights.h5"}
    return model, saved, files


_STOCK = BLOCK_KERASMP + """
import numpy as np
import keras

def numpy(variables):
    return [np.asarray(keras.ops.convert_to_numpy(v)) for v in variables]

rng = np.random.default_rng(0)
x = rng.random((32, 4)).astype("float32")
y = rng.random((32, 2)).astype("float32")
saved = np.load({saved!r})
files = {files!r}

def stock_model():
    keras.config.set_dtype_policy("mixed_float16")
    model = keras.Sequential([
        keras.Input((4,)), keras.layers.Dense(8, name="hidden"),
        keras.layers.Dense(2, name="out")])
    keras.config.set_dtype_policy("float32")
    model.compile(keras.optimizers.LossScaleOptimizer(
        keras.optimizers.Adam(1e-2), dynamic_growth_steps=2), "mse")
    model.optimizer.build(model.trainable_variables)
    return model

out = {{}}
for kind, path in files.items():
    if path.endswith(".weights.h5"):
        model = stock_model()
        model.load_weights(path)
    else:
        model = keras.saving.load_model(path)
    opt = model.optimizer
    row = {{"class": type(opt).__module__ + "." + type(opt).__name__,
           "inner": type(opt.inner_optimizer).__name__,
           "dtypes": [l.compute_dtype for l in model.layers]}}
    # The state the file restored, against the trained optimizer's: the
    # stock layout (its own variables, then the inner optimizer's).
    row["state_equal"] = [bool(np.array_equal(a, b)) for a, b in zip(
        numpy(opt.variables), [saved[f"o{{i}}"] for i in range(
            len(opt.variables))])]
    row["weights_equal"] = all(np.array_equal(a, saved[f"w{{i}}"])
                               for i, a in enumerate(numpy(model.weights)))
    # Reference: the same weights and optimizer state set by hand on a
    # freshly compiled stock model; one more epoch must give the same.
    reference = stock_model()
    reference.set_weights([saved[f"w{{i}}"] for i in range(
        len(reference.weights))])
    for i, v in enumerate(reference.optimizer.variables):
        v.assign(saved[f"o{{i}}"])
    for m in (model, reference):
        m.fit(x, y, batch_size=8, epochs=1, shuffle=False, verbose=0)
    row["resumed_equal"] = all(np.array_equal(a, b) for a, b in zip(
        numpy(model.weights), numpy(reference.weights)))
    row["finite"] = all(np.isfinite(w).all() for w in numpy(model.weights))
    out[kind] = row
print(json.dumps(out))
"""


def test_files_after_compile_load_and_train_without_kerasmp(tmp_path):
    model, saved, files = _checkpoints(tmp_path)
    # What stock Keras's optimizer holds: kerasmp's variables without its
    # own counters (hysteresis budget, skipped steps).
    own = {id(v) for v in model.optimizer.state_variables().values()}
    own -= {id(model.optimizer.dynamic_scale),
            id(model.optimizer.step_counter),
            id(model.optimizer.inner_optimizer.iterations)}
    expected = [a for a, v in zip(saved["optimizer"],
                                  model.optimizer.variables)
                if id(v) not in own]
    np.savez(tmp_path / "saved.npz",
             **{f"w{i}": w for i, w in enumerate(saved["weights"])},
             **{f"o{i}": o for i, o in enumerate(expected)})
    out = subprocess.run(
        [sys.executable, "-c", _STOCK.format(
            saved=str(tmp_path / "saved.npz"),
            files={k: str(v) for k, v in files.items()})],
        capture_output=True, text=True,
        env={**os.environ, "TF_CPP_MIN_LOG_LEVEL": "3"})
    assert out.returncode == 0, out.stderr[-3000:]
    rows = json.loads(out.stdout.strip().splitlines()[-1])
    assert set(rows) == set(files)
    for kind, row in rows.items():
        assert row["class"] == (
            "keras.src.optimizers.loss_scale_optimizer.LossScaleOptimizer"
        ), kind
        assert row["inner"] == "Adam", kind
        assert row["dtypes"] == ["float16", "float16"], kind
        assert row["weights_equal"], kind
        # Every variable of the stock optimizer (scale, growth counter,
        # Adam's iterations and slots) is the trained one.
        assert len(row["state_equal"]) == len(expected), kind
        assert all(row["state_equal"]), (kind, row["state_equal"])
        assert row["resumed_equal"] and row["finite"], kind


@pytest.mark.parametrize("kind", ["model.save", "ModelCheckpoint .keras",
                                  "ModelCheckpoint .weights.h5"])
def test_kerasmp_reload_resumes_exactly(kind, tmp_path):
    straight, saved, files = _checkpoints(tmp_path)
    if kind.endswith(".weights.h5"):
        model = _model()
        model.optimizer.build(model.trainable_variables)
        model.load_weights(files[kind])
    else:
        model = keras.saving.load_model(files[kind])
    optimizer = model.optimizer
    assert type(optimizer) is kerasmp.LossScaleOptimizer
    for name, value in SETTINGS.items():
        if name != "initial_scale":
            assert getattr(optimizer, name) == value, name
    assert _state(optimizer) == saved["state"]
    for a, b in zip(_numpy(optimizer.variables), saved["optimizer"]):
        np.testing.assert_array_equal(a, b)
    _fit(model, 2, initial_epoch=1)
    for a, b in zip(_numpy(model.weights), _numpy(straight.weights)):
        np.testing.assert_array_equal(a, b)
    assert _state(optimizer) == _state(straight.optimizer)


def test_the_stock_entry_keeps_kerasmp_settings_beside_it():
    entry = keras.saving.serialize_keras_object(kerasmp.LossScaleOptimizer(
        keras.optimizers.SGD(), initial_scale="auto", dynamic=False))
    portable = kerasmp.optimizer.saving.portable_entry(entry)
    assert portable["module"] == "keras.optimizers"
    assert portable["registered_name"] is None
    assert set(portable["config"]) == {
        "name", "inner_optimizer", "initial_scale", "dynamic_growth_steps"}
    # Stock Keras builds it (it refuses "auto" and dynamic=False).
    stock = keras.optimizers.LossScaleOptimizer.from_config(
        dict(portable["config"]))
    assert stock.initial_scale == 1.0
    restored = kerasmp.optimizer.saving.restored_entry(
        portable, kerasmp.LossScaleOptimizer.__module__)
    optimizer = keras.saving.deserialize_keras_object(restored)
    assert type(optimizer) is kerasmp.LossScaleOptimizer
    assert optimizer.auto and not optimizer.dynamic
    with pytest.raises(ValueError, match="kerasmp optimizer"):
        kerasmp.optimizer.saving.restored_entry(
            {**portable, "kerasmp": {"class_name": "os.system",
                                     "config": {}}}, "x")


def _modules(value):
    """Every `"module"` named in a serialized config."""
    if isinstance(value, dict):
        found = [value["module"]] if isinstance(value.get("module"), str) \
            else []
        return found + [m for v in value.values() for m in _modules(v)]
    if isinstance(value, list):
        return [m for v in value for m in _modules(v)]
    return []


@pytest.mark.parametrize("optimizer", ["adam", "kerasmp"])
def test_a_compiled_file_names_no_backend_module(optimizer):
    # On PyTorch Keras serializes keras.optimizers.Adam as its backend
    # subclass (keras.src.backend.torch.optimizers.torch_adam), which
    # TensorFlow then imports and runs on its variables: a file compiled on
    # PyTorch did not train on TensorFlow. A file names keras.optimizers,
    # which builds each backend's own class.
    with kerasmp.policy_scope(kerasmp.Policy("mixed_float16")):
        model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(2)])
    model.compile(
        "adam" if optimizer == "adam"
        else kerasmp.LossScaleOptimizer(keras.optimizers.Adam()), "mse")
    config = model.get_compile_config()
    modules = _modules(config["optimizer"])
    assert modules and not [m for m in modules
                            if m.startswith("keras.src.backend.")], modules
    reloaded = keras.saving.deserialize_keras_object(
        kerasmp.optimizer.saving.restored_compile_config(
            config, kerasmp.LossScaleOptimizer.__module__)["optimizer"])
    assert isinstance(reloaded.inner_optimizer, keras.optimizers.Adam)
