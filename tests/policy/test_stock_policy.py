"""The TensorFlow guide's first line (Keras's own mixed policy) with kerasmp
imported: the first compile says once that kerasmp's rules do not apply."""

import warnings

import keras
import pytest

import kerasmp
from kerasmp.errors import StockOptimizerWarning
from kerasmp.errors import StockPolicyWarning
from kerasmp.policy import stock as _stock_policy

pytestmark = pytest.mark.torch  # also in the PyTorch pass (conftest.py)


@pytest.fixture(autouse=True)
def _not_warned_yet(monkeypatch):
    monkeypatch.setattr(_stock_policy, "_warned", set())


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


# -------------------------------------------- the TF guide's optimizer


def _guide_optimizer():
    """The TensorFlow guide's optimizer: Keras's own LossScaleOptimizer."""
    inner = keras.optimizers.RMSprop(1e-3)
    return inner, keras.optimizers.LossScaleOptimizer(
        inner, initial_scale=2.0**12, dynamic_growth_steps=500
    )


def test_compile_replaces_the_guides_optimizer_keeping_its_inner_one(
        mixed_policy):
    inner, stock = _guide_optimizer()
    model = _model()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        model.compile(stock, "sparse_categorical_crossentropy")
    optimizer = model.optimizer
    assert isinstance(optimizer, kerasmp.LossScaleOptimizer)
    assert optimizer.inner_optimizer is inner
    assert optimizer.loss_scale == 2.0**12
    assert optimizer.dynamic_growth_steps == 500
    said = [w for w in caught
            if issubclass(w.category, StockOptimizerWarning)]
    assert len(said) == 1 and said[0].filename == __file__
    assert "kerasmp.LossScaleOptimizer(" in str(said[0].message)
    # A second model says nothing (once per process).
    model = _model()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        model.compile(_guide_optimizer()[1], "mse")
    assert not [w for w in caught
                if issubclass(w.category, StockOptimizerWarning)]


def test_without_a_kerasmp_policy_the_guides_optimizer_is_kept():
    _, stock = _guide_optimizer()
    model = _model()
    model.compile(stock, "sparse_categorical_crossentropy")
    assert model.optimizer is stock


def test_kerasmp_optimizer_takes_a_stock_one_directly():
    inner, stock = _guide_optimizer()
    optimizer = kerasmp.LossScaleOptimizer(stock)
    assert optimizer.inner_optimizer is inner
    assert optimizer.loss_scale == 2.0**12
    assert optimizer.dynamic_growth_steps == 500
    assert optimizer.name == stock.name
    # Arguments given win over the stock optimizer's.
    given = kerasmp.LossScaleOptimizer(
        _guide_optimizer()[1], initial_scale=8.0, dynamic_growth_steps=7)
    assert (given.loss_scale, given.dynamic_growth_steps) == (8.0, 7)
    # kerasmp's own is still refused: the loss would be scaled twice.
    with pytest.raises(ValueError, match="inner_optimizer"):
        kerasmp.LossScaleOptimizer(optimizer)
