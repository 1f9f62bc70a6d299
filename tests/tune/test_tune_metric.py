"""`kerasmp.tune(..., metric="accuracy", max_drop=...)` on the 8x8 digits
that ship with kerasmp: a classifier trained in float32, with a layer that
loses its input in float16 ((x + 1e4) - 1e4) put between its two Dense
layers, loses its accuracy in float16; tune keeps that layer in float32
and the accuracy comes back within `max_drop` of the float32 run's. The
same classifier without that layer keeps nothing."""

import keras
import numpy as np
import pytest

import kerasmp
from kerasmp.data import load_digits


class Offset(keras.layers.Layer):
    """(x + 1e4) - 1e4: float16's spacing at 1e4 is 8, so x is lost."""

    def call(self, x):
        return (x + 1e4) - 1e4


def _classifier(policy, offset):
    with kerasmp.policy_scope(policy):
        inputs = keras.Input((8, 8, 1))
        h = keras.layers.Flatten()(inputs)
        h = keras.layers.Dense(32, activation="relu", name="hidden")(h)
        if offset:
            h = Offset(name="offset")(h)
        outputs = keras.layers.Dense(10, name="logits")(h)
        return keras.Model(inputs, outputs)


@pytest.fixture(scope="module")
def trained():
    keras.utils.set_random_seed(0)
    (x, y), (x_test, y_test) = load_digits()
    model = _classifier("float32", offset=False)
    model.compile(keras.optimizers.Adam(1e-2),
                  keras.losses.SparseCategoricalCrossentropy(from_logits=True),
                  metrics=["accuracy"])
    model.fit(x, y, batch_size=64, epochs=8, verbose=0)
    accuracy = model.evaluate(x_test, y_test, verbose=0)[1]
    assert accuracy > 0.85  # a classifier worth keeping
    return model.get_weights(), x_test, y_test, accuracy


@pytest.mark.torch
@pytest.mark.parametrize("offset", [True, False])
def test_the_metric_mode_keeps_what_the_accuracy_needs(trained, offset):
    weights, x_test, y_test, float32_accuracy = trained
    model = _classifier("mixed_float16", offset=offset)
    model.set_weights(weights)
    report = kerasmp.tune(model, x_test, y=y_test, metric="accuracy",
                          max_drop=0.005)
    assert report.met, report.reason
    values = report.metric_values
    assert values["float32"] == pytest.approx(float32_accuracy, abs=1e-6)
    if offset:  # float16 loses the hidden layer: the accuracy collapses
        assert values["before"] < float32_accuracy - 0.2, values
    if offset:
        assert report.float32_layers == ("offset",), report.float32_layers
    else:
        assert report.float32_layers == ()
    # The tuned model's accuracy, counted here by hand, is within half a
    # point of the float32 classifier's.
    report.apply(model)
    logits = keras.ops.convert_to_numpy(model(x_test)).astype("float32")
    accuracy = float(np.mean(np.argmax(logits, -1) == y_test))
    assert accuracy >= float32_accuracy - 0.005, (accuracy, float32_accuracy)
