"""Makes docs/img/gradient_report.png and the table in docs/loss_scaling.md.

The scenario of notebooks/04_underflow.ipynb: a digits MLP (64-64-64-10)
under kerasmp's mixed_float16 policy whose cross-entropy is weighted by 1e-6,
so most of its gradients are below float16's smallest subnormal (6e-8).
`gradient_report` measures one batch of 64; then three models train from the
same weights for 4 epochs (Adam, epsilon 1e-12): float32, mixed_float16 with
a static loss scale of 1, and with the recommended static scale.

    KERAS_BACKEND=tensorflow python docs/img/gradient_report_example.py
"""

import os

import keras

import kerasmp
from kerasmp.data import load_digits
from kerasmp.debug import gradient_report
from kerasmp.debug import plot_gradient_report
from kerasmp.optimizer import LossScaleOptimizer

EPOCHS = 4
LOSS_WEIGHT = 1e-6
(x_train, y_train), (x_test, y_test) = load_digits()
x_train = x_train.reshape(len(x_train), -1)
x_test = x_test.reshape(len(x_test), -1)


def loss(y_true, y_pred):
    return LOSS_WEIGHT * keras.losses.sparse_categorical_crossentropy(
        y_true, y_pred
    )


def build_model(policy):
    keras.utils.set_random_seed(0)
    with kerasmp.policy_scope(policy):
        return keras.Sequential(
            [
                keras.Input((64,)),
                keras.layers.Dense(64, activation="relu"),
                keras.layers.Dense(64, activation="relu"),
                keras.layers.Dense(10, activation="softmax"),
            ]
        )


def train(policy, loss_scale=None):
    model = build_model(policy)
    optimizer = keras.optimizers.Adam(1e-3, epsilon=1e-12)
    if loss_scale is not None:
        optimizer = LossScaleOptimizer(
            optimizer, initial_scale=loss_scale, dynamic=False
        )
    model.compile(optimizer=optimizer, loss=loss, metrics=["accuracy"])
    model.fit(x_train, y_train, batch_size=64, epochs=EPOCHS, verbose=0)
    return model.evaluate(x_test, y_test, verbose=0)[1]


model = build_model("mixed_float16")
model.compile(optimizer="adam", loss=loss)
report = gradient_report(model, x_train[:64], y_train[:64])
print(report)
path = os.path.join(os.path.dirname(os.path.abspath(__file__)),
                    "gradient_report.png")
plot_gradient_report(
    report, path, title="Digits MLP, loss x 1e-6, mixed_float16: one batch"
)
print(f"wrote {path}")
print(f"test accuracy after {EPOCHS} epochs:")
print(f"  float32:                    {train('float32'):.3f}")
print(f"  mixed_float16, scale 1:     {train('mixed_float16', 1.0):.3f}")
scale = report.recommended_scale
print(f"  mixed_float16, scale {scale:g}: "
      f"{train('mixed_float16', scale):.3f}")
