"""Makes docs/img/loss_scale.png: the run shown in docs/monitoring.md.

A model with a hand-written softmax (no max subtraction: exp overflows
float16 above 11) trains under kerasmp's mixed_float16 policy. The scale
starts at 2**24 and calibrates down, grows every 8 steps and backs off on
the odd overflow; from step 70 the inputs are 12x larger, the softmax
overflows on every batch, and after 5 skipped steps NonFiniteMonitor moves
that one layer to float32 and training carries on.

    KERAS_BACKEND=tensorflow python docs/img/loss_scale_example.py
"""

import os
import warnings

import keras
import numpy as np
from keras import ops

from kerasmp.callbacks import LossScaleMonitor
from kerasmp.callbacks import NonFiniteMonitor
from kerasmp.optimizer import LossScaleOptimizer
from kerasmp.plotting import plot_loss_scale
from kerasmp.policy import Policy
from kerasmp.policy import set_global_policy


class NaiveSoftmax(keras.layers.Layer):
    def call(self, x):
        e = ops.exp(x)  # no max subtraction: overflows float16 for x > 11
        return e / ops.sum(e, axis=-1, keepdims=True)


set_global_policy(Policy("mixed_float16"))
keras.utils.set_random_seed(0)
rng = np.random.RandomState(0)
x = rng.randn(120 * 16, 8).astype("float32")
y = (x[:, :1] > 0).astype("float32")
x[70 * 16 :] *= 12  # from step 70 the naive softmax overflows float16
model = keras.Sequential(
    [
        keras.Input((8,)),
        keras.layers.Dense(16, name="proj"),
        NaiveSoftmax(name="naive_softmax"),
        keras.layers.Dense(1, name="head"),
    ]
)
model.compile(
    optimizer=LossScaleOptimizer(
        keras.optimizers.SGD(0.05),
        initial_scale=2.0**24,
        dynamic_growth_steps=8,
    ),
    loss="mse",
)
monitor = NonFiniteMonitor(action="fallback", patience=5)
with warnings.catch_warnings():
    warnings.simplefilter("ignore")
    model.fit(
        x,
        y,
        batch_size=16,
        epochs=1,
        shuffle=False,
        verbose=0,
        callbacks=[LossScaleMonitor(), monitor],
    )
for e in monitor.events:
    print(
        e["step"],
        e["kind"],
        e["loss_scale"],
        e["layer"],
        e.get("fallback_layers") or "",
    )
plot_loss_scale(
    monitor,
    os.path.join(os.path.dirname(os.path.abspath(__file__)), "loss_scale.png"),
    title="Loss scale: calibration, growth, a float16 overflow fixed by "
    "fallback",
)
