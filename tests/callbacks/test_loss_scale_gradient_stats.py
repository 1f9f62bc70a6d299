"""LossScaleMonitor(gradient_stats_every=N) logs `grad_underflow`, the
fraction of gradient elements that are zero in mixed precision and not in
float32.

Reference: a loss multiplied by 1e-6 has gradients around 1e-8 at the
output layer, below float16's smallest subnormal (6e-8): without loss
scaling (static scale 1) a large share of the gradient elements flush to
zero in float16 while the float32 reference keeps them (a fifth to a half
of them on this model, depending on the batch and the backend's float16
arithmetic); at 2**15 they are representable.
"""

import csv

import keras
import numpy as np
import pytest
from _models import mlp
from keras import ops

from kerasmp.callbacks import LossScaleMonitor
from kerasmp.optimizer import LossScaleOptimizer

pytestmark = pytest.mark.torch  # also in the PyTorch pass (conftest.py)

BATCH = 8
STEPS = 4


def tiny_loss(y_true, y_pred):
    return 1e-6 * ops.mean(ops.square(y_true - y_pred), axis=-1)


def _model(scale):
    model = mlp(6, 16, 4, seed=0)
    model.compile(
        optimizer=LossScaleOptimizer(
            keras.optimizers.SGD(1e-3), initial_scale=scale, dynamic=False
        ),
        loss=tiny_loss,
    )
    return model


def _data():
    rng = np.random.default_rng(0)
    x = rng.normal(size=(BATCH * STEPS, 6)).astype("float32")
    y = 0.1 * rng.normal(size=(BATCH * STEPS, 4)).astype("float32")
    return x, y


@pytest.mark.parametrize(
    "scale, low, high", [(1.0, 0.2, 1.0), (2.0**15, 0.0, 0.05)]
)
def test_grad_underflow_is_logged_every_n_steps(
        tmp_path, scale, low, high, mixed_policy):
    x, y = _data()
    model = _model(scale)
    monitor = LossScaleMonitor(gradient_stats_every=np.int64(3))
    batches = []
    logger = keras.callbacks.CSVLogger(str(tmp_path / "log.csv"))

    class Batches(keras.callbacks.Callback):
        def on_train_batch_end(self, batch, logs=None):
            batches.append(dict(logs))

    weights = [w.copy() for w in model.get_weights()]
    history = model.fit(
        x, y, batch_size=BATCH, epochs=2, shuffle=False, verbose=0,
        callbacks=[monitor, logger, Batches()],
    )
    # The first step of the run, then every third one (8 steps in all).
    assert [s for s, _, _ in monitor.underflow_trace] == [0, 3, 6]
    values = [u for _, _, u in monitor.underflow_trace]
    assert all(low <= u <= high for u in values), values
    assert all(s == scale for _, s, _ in monitor.underflow_trace)
    # Every step's logs carry the latest measurement, the epoch logs too.
    assert [b["grad_underflow"] for b in batches] == (
        [values[0]] * 3 + [values[1]] * 3 + [values[2]] * 2
    )
    assert history.history["grad_underflow"] == [values[1], values[2]]
    with open(tmp_path / "log.csv") as f:
        rows = list(csv.DictReader(f))
    assert [float(r["grad_underflow"]) for r in rows] == pytest.approx(
        [values[1], values[2]]
    )
    # Measuring changed neither the weights' trajectory nor the optimizer:
    # a fit without it ends on the same weights.
    plain = _model(scale)
    plain.set_weights(weights)
    plain.fit(x, y, batch_size=BATCH, epochs=2, shuffle=False, verbose=0)
    for a, b in zip(model.get_weights(), plain.get_weights()):
        np.testing.assert_array_equal(a, b)
    assert int(ops.convert_to_numpy(model.optimizer.iterations)) == 2 * STEPS


def test_grad_underflow_is_off_by_default(mixed_policy):
    x, y = _data()
    model = _model(1.0)
    history = model.fit(
        x, y, batch_size=BATCH, epochs=1, verbose=0,
        callbacks=[LossScaleMonitor()],
    )
    assert "grad_underflow" not in history.history
    assert "loss_scale" in history.history


@pytest.mark.parametrize("value", [0, -2, 1.5, True, np.bool_(True), "10"])
def test_gradient_stats_every_is_validated(value):
    with pytest.raises(ValueError, match="gradient_stats_every"):
        LossScaleMonitor(gradient_stats_every=value)
