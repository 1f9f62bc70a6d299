"""`kerasmp.tune` on models built for it: it finds the one layer that loses
precision in float16 and meets the target against a float32 run of the same
weights; on a model without such a layer it keeps nothing."""

import keras
import numpy as np
import pytest

import kerasmp


class Cancel(keras.layers.Layer):
    """(x + 1e4) - 1e4: float16's spacing at 1e4 is 8, so x is lost."""

    def call(self, x):
        return (x + 1e4) - 1e4


class Block(keras.layers.Layer):
    def __init__(self, units, cancel=False, **kwargs):
        super().__init__(**kwargs)
        self.a = keras.layers.Dense(units, activation="relu", name="a")
        self.b = keras.layers.Dense(units, name="b")
        self.c = Cancel(name="cancel") if cancel else None

    def call(self, x):
        h = self.b(self.a(x))
        return x + (self.c(h) if self.c is not None else h)


def _model(cancel_at):
    keras.utils.set_random_seed(0)
    with kerasmp.policy_scope("mixed_float16"):
        inputs = keras.Input((16,))
        h = keras.layers.Dense(16, name="stem")(inputs)
        for i in range(4):
            h = Block(16, cancel=(i == cancel_at), name=f"block{i}")(h)
        return keras.Model(inputs, keras.layers.Dense(4, name="head")(h))


def _x():
    return np.random.default_rng(0).standard_normal((32, 16)).astype(
        "float32")


@pytest.mark.torch
def test_finds_the_cancelling_layer_and_meets_the_target():
    report = kerasmp.tune(_model(2), _x(), target=1e-2)
    assert report.before > 1e-2  # float16 loses it (against float32)
    assert "block2/cancel" in report.float32_layers
    assert len(report.float32_layers) <= 2
    assert report.met and report.after <= 1e-2
    assert report.passes <= 40
    restored = kerasmp.Policy.from_config(report.policy.get_config())
    assert "block2/cancel" in restored.measured


@pytest.mark.torch
def test_keeps_nothing_without_such_a_layer():
    report = kerasmp.tune(_model(None), _x(), target=1e-2)
    assert report.float32_layers == () and report.met
    assert report.after == report.before <= 1e-2
