"""A newcomer's first hour (issue 19): diagnostics that agree with each other,
commands that behave like Unix tools, a demo that refuses a missing parent."""

import keras
import numpy as np
import pytest

import kerasmp
from kerasmp.debug import find_nonfinite


def _mixed_model():
    kerasmp.set_global_policy("mixed_float16")
    model = keras.Sequential(
        [
            keras.Input((6,)),
            keras.layers.Dense(8, activation="relu"),
            keras.layers.Dense(3, activation="softmax"),
        ]
    )
    return model


@pytest.mark.parametrize("stock", [False, True])
def test_find_nonfinite_uses_the_optimizers_scale_before_the_first_fit(stock):
    model = _mixed_model()
    if stock:
        optimizer = keras.optimizers.LossScaleOptimizer(
            keras.optimizers.Adam(), initial_scale=1024.0
        )
        expected = 1024.0
    else:
        optimizer = "adam"  # compile wraps it: kerasmp.LossScaleOptimizer
        expected = 2.0**15
    model.compile(optimizer, "sparse_categorical_crossentropy")
    assert not model.optimizer.built  # before the first step
    x = np.random.default_rng(0).normal(size=(4, 6)).astype("float32")
    y = np.array([0, 1, 2, 0])
    report = find_nonfinite(model, x, y)
    assert report.loss_scale == expected
    assert f"gradients of loss x {expected:.3g}" in str(report)
    # Same gradients as asking for that scale explicitly.
    explicit = find_nonfinite(model, x, y, loss_scale=expected)
    assert [r.grad_max_abs for r in report.rows] == [
        r.grad_max_abs for r in explicit.rows
    ]
    if not stock:
        assert report.loss_scale == model.optimizer.loss_scale
