"""Makes docs/img/float8_example.png: the run shown in docs/float8.md.

Four Dense layers under `kerasmp.Policy("float8_mixed_bfloat16")` on random
data; "hot" and "cool" (64x64) train in float8 (the first and last layers
are excluded, as by default). From step 30
the input of layer "hot" doubles every step (a gain in front of it): its
inputs' amax outruns the delayed scale, the replayed batch saturates, and
`Float8Monitor(action="fallback")` moves "hot" alone off float8 while "cool"
trains on.

    KERAS_BACKEND=tensorflow python docs/img/float8_example.py
"""

import os
import warnings

import keras
import numpy as np

import kerasmp
from kerasmp import float8
from kerasmp.callbacks import Float8Monitor


class Gain(keras.layers.Layer):
    def build(self, input_shape):
        self.gain = self.add_weight(shape=(), initializer="ones",
                                    trainable=False, name="gain")

    def call(self, x):
        return x * keras.ops.cast(self.gain, x.dtype)


class Grow(keras.callbacks.Callback):
    """Doubles the gain before every step from step `start` on."""

    def __init__(self, layer, start):
        super().__init__()
        self.layer, self.start, self.steps = layer, start, 0

    def on_train_batch_begin(self, batch, logs=None):
        self.steps += 1
        if self.steps > self.start:
            if keras.backend.backend() == "jax":
                self.model.jax_state_sync()  # so the assign reaches the fit
            self.layer.gain.assign(self.layer.gain * 2.0)


keras.utils.set_random_seed(0)
kerasmp.set_global_policy(kerasmp.Policy(
    "float8_mixed_bfloat16", float8=float8.Float8Rule(min_kernel_size=1024)))
inp = keras.Input((32,))
h = keras.layers.Dense(64, activation="relu", name="first")(inp)
h = Gain(name="gain")(h)
h = keras.layers.Dense(64, activation="relu", name="hot")(h)
h = keras.layers.LayerNormalization(name="ln")(h)
h = keras.layers.Dense(64, activation="relu", name="cool")(h)
out = keras.layers.Dense(4, name="head")(h)
model = keras.Model(inp, out)
model.compile(keras.optimizers.Adam(1e-3), "mse")
rng = np.random.default_rng(0)
x = rng.normal(size=(640, 32)).astype("float32")
y = rng.normal(size=(640, 4)).astype("float32")
monitor = Float8Monitor(every_n_steps=2, data=(x[:64], y[:64]),
                        action="fallback")
with warnings.catch_warnings():
    warnings.simplefilter("ignore")
    model.fit(x, y, batch_size=16, epochs=2, verbose=0, shuffle=False,
              callbacks=[Grow(model.get_layer("gain"), start=30), monitor])
for e in monitor.events:
    print(e["message"])
kerasmp.plot_float8(
    monitor,
    os.path.join(os.path.dirname(os.path.abspath(__file__)),
                 "float8_example.png"),
    tensors=("inputs", "kernel"),
    title="Float8Monitor: layer 'hot' saturates and falls back alone",
)
kerasmp.set_global_policy("float32")
