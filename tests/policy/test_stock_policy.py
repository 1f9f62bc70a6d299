"""The TensorFlow guide's first line (Keras's own mixed policy) with kerasmp
imported: the first compile says once that kerasmp's rules do not apply."""

import warnings

import keras
import pytest

import kerasmp
from kerasmp.errors import StockPolicyWarning
from kerasmp.policy import stock as _stock_policy


@pytest.fixture(autouse=True)
def _not_warned_yet(monkeypatch):
    monkeypatch.setattr(_stock_policy, "_warned", False)


def _model():
    return keras.Sequential(
        [
            keras.Input((4,)),
            keras.layers.Dense(8),
            keras.layers.Dense(3, activation="softmax"),
        ]
    )


def _compile_recording(model):
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        model.compile("adam", "sparse_categorical_crossentropy")
    return [w for w in caught if issubclass(w.category, StockPolicyWarning)]


@pytest.mark.parametrize("name", ["mixed_float16", "mixed_bfloat16"])
def test_stock_mixed_policy_warns_once_naming_the_line(name):
    keras.mixed_precision.set_global_policy(name)
    model = _model()
    # What the warning is about: the softmax output layer stays half.
    assert model.layers[-1].compute_dtype == name[len("mixed_"):]
    caught = _compile_recording(model)
    assert len(caught) == 1
    message = str(caught[0].message)
    assert f"kerasmp.set_global_policy({name!r})" in message
    assert f"keras.mixed_precision.set_global_policy({name!r})" in message
    assert caught[0].filename == __file__  # points at the compile call
    # Once per process: a second model and compile say nothing.
    assert _compile_recording(_model()) == []


def test_kerasmp_policy_float32_and_pure_half_do_not_warn():
    kerasmp.set_global_policy("mixed_float16")
    model = _model()
    assert _compile_recording(model) == []
    # kerasmp's rules apply: float32 softmax, kerasmp's optimizer.
    assert model.layers[-1].compute_dtype == "float32"
    assert isinstance(model.optimizer, kerasmp.LossScaleOptimizer)
    for name in ("float32", "float16", "bfloat16"):
        keras.config.set_dtype_policy(name)
        assert _compile_recording(_model()) == []


def test_model_built_under_kerasmp_then_stock_global_does_not_warn():
    kerasmp.set_global_policy("mixed_float16")
    model = _model()
    keras.mixed_precision.set_global_policy("mixed_float16")
    assert _compile_recording(model) == []
