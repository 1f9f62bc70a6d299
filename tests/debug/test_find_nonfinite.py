"""kerasmp.debug.find_nonfinite: the first non-finite layer output, input
and gradient, and the loss scale it replays at.

References are independent of the code under test: a float32 twin of each
model (where nothing overflows), layer outputs recomputed by applying the
layers one at a time, and gradients of a float32 twin scaled by hand.
"""

import math

import keras
import numpy as np
import pytest
from _models import batch_norm_mlp
from _models import mlp
from keras import ops

from kerasmp.debug import NonFiniteReport
from kerasmp.debug import find_nonfinite

pytestmark = pytest.mark.torch  # also in the PyTorch pass (conftest.py)

FLOAT16_MAX = 65504.0


class Scale(keras.layers.Layer):
    """Multiplies its input by a constant (no weights).

    In two halves of sqrt(factor) each: 1e6 itself is not a float16 number
    (it would round to inf), while 1e3 is; so the overflow comes from the
    activations, as in a real model.
    """

    def __init__(self, factor, **kwargs):
        super().__init__(**kwargs)
        self.factor = factor

    def call(self, x):
        half = math.sqrt(self.factor)
        return (x * half) * half


class Block(keras.layers.Layer):
    """A nested layer: Dense followed by an injected Scale."""

    def __init__(self, factor, **kwargs):
        super().__init__(**kwargs)
        self.inner = keras.layers.Dense(8, name="inner")
        self.boom = Scale(factor, name="boom")

    def call(self, x):
        return self.boom(self.inner(x))


class Subclassed(keras.Model):
    def __init__(self, factor):
        super().__init__()
        self.first = keras.layers.Dense(8, name="first")
        self.block = Block(factor, name="block")
        self.head = keras.layers.Dense(1, name="head")

    def call(self, x):
        return self.head(self.block(self.first(x)))


class AmplifyGradient(keras.layers.Layer):
    """Identity in the forward pass; multiplies the gradient by `factor`."""

    def __init__(self, factor, **kwargs):
        super().__init__(**kwargs)
        self.factor = factor

    def call(self, x):
        # Forward: x + 0 exactly. Backward: 1 + (factor - 1).
        return x + (self.factor - 1) * (x - ops.stop_gradient(x))


def _sequential(factor):
    return keras.Sequential(
        [
            keras.Input((6,)),
            keras.layers.Dense(8, name="first"),
            keras.layers.Dense(8, name="second"),
            Scale(factor, name="boom"),
            keras.layers.Dense(4, name="third"),
            keras.layers.Dense(1, name="head"),
        ]
    )


def _functional(factor):
    inputs = keras.Input((6,))
    h = keras.layers.Dense(8, name="first")(inputs)
    a = keras.layers.Dense(8, name="second")(h)
    b = Scale(factor, name="boom")(a)
    h = keras.layers.Add(name="add")([b, h])
    outputs = keras.layers.Dense(1, name="head")(h)
    return keras.Model(inputs, outputs)


BUILDERS = {
    "sequential": (_sequential, "boom", ["first", "second"]),
    "functional": (_functional, "boom", ["first", "second"]),
    "subclassed": (Subclassed, "block/boom", ["first", "block/inner"]),
}


def _batch(n=8, d=6, seed=0):
    rng = np.random.RandomState(seed)
    return rng.randn(n, d).astype("float32"), rng.randn(n, 1).astype("float32")


@pytest.mark.parametrize("kind", sorted(BUILDERS))
def test_names_the_injected_layer_and_nothing_before_it(kind):
    build, expected, before = BUILDERS[kind]
    x, y = _batch()

    keras.config.set_dtype_policy("mixed_float16")
    model = build(1e6)
    model.compile(optimizer="sgd", loss="mse")
    report = find_nonfinite(model, x, y)

    assert isinstance(report, NonFiniteReport)
    assert report.layer == expected
    rows = {r.path: r for r in report.rows}
    for path in before:
        assert rows[path].finite, path
        assert rows[path].dtype == "float16"
    # The injected layer's row is the first non-finite one.
    first_bad = next(r.path for r in report.rows if not r.finite)
    assert first_bad == expected
    assert not np.isfinite(report.loss)

    # Reference: the same architecture in float32 does not overflow (1e6 x
    # O(1) fits in float32), so the locator must not flag anything.
    keras.config.set_dtype_policy("float32")
    reference = build(1e6)
    reference.compile(optimizer="sgd", loss="mse")
    clean = find_nonfinite(reference, x, y)
    assert clean.layer is None and clean.variable is None
    assert np.isfinite(clean.loss)


def test_rows_match_layer_outputs_recomputed_one_by_one():
    x, _ = _batch()
    keras.config.set_dtype_policy("mixed_float16")
    model = _sequential(100.0)
    report = find_nonfinite(model, x)

    assert [r.path for r in report.rows] == [l.name for l in model.layers]
    h = ops.convert_to_tensor(x)
    for layer, row in zip(model.layers, report.rows):
        h = layer(h)
        expected = float(np.max(np.abs(ops.convert_to_numpy(h).astype("f8"))))
        assert row.finite
        assert row.dtype == "float16"
        np.testing.assert_allclose(row.max_abs, expected, rtol=1e-3)
        np.testing.assert_allclose(
            row.headroom, FLOAT16_MAX / expected, rtol=1e-3
        )
    assert report.layer is None and report.variable is None


def test_first_nonfinite_gradient_in_backprop_order():
    """A layer that multiplies gradients by 200 in the backward pass only.

    With a loss scale chosen from a float32 twin's gradients, the layer just
    upstream of it overflows float16 in the backward pass while the layer
    after it does not: that is the variable to report. Variables upstream of
    it are non-finite too, so "first in forward order" (the first layer)
    would be the wrong answer.
    """
    x, y = _batch(n=16)

    def build():
        keras.utils.set_random_seed(3)
        model = keras.Sequential(
            [
                keras.Input((6,)),
                keras.layers.Dense(8, name="first"),
                keras.layers.Dense(8, name="second"),
                AmplifyGradient(200.0, name="amplify"),
                keras.layers.Dense(1, name="head"),
            ]
        )
        model.compile(optimizer="sgd", loss="mse")
        return model

    reference = build()
    ref = find_nonfinite(reference, x, y)
    grads = {r.path: r.grad_max_abs for r in ref.rows if r.grad_max_abs}
    assert grads["second"] > 20 * grads["head"]
    # Scaled, "second" lands 4x beyond float16's range, "head" well inside.
    scale = 4 * FLOAT16_MAX / grads["second"]
    assert scale * grads["head"] < FLOAT16_MAX / 4

    keras.config.set_dtype_policy("mixed_float16")
    model = build()
    report = find_nonfinite(model, x, y, loss_scale=scale)
    assert report.layer is None  # forward pass is fine
    assert report.variable == "second/kernel"
    rows = {r.path: r for r in report.rows}
    assert rows["head"].grad_finite
    assert not rows["first"].grad_finite and not rows["second"].grad_finite

    unscaled = find_nonfinite(model, x, y, loss_scale=1.0)
    assert unscaled.variable is None
    np.testing.assert_allclose(unscaled.loss, ref.loss, rtol=1e-2)


def test_model_state_is_restored():
    x, y = _batch()
    model = batch_norm_mlp(hidden_activation=None, dropout=0.5, seed=0)
    model.compile(optimizer="sgd", loss="mse", metrics=["mae"])
    model.evaluate(x, y, verbose=0)  # metrics now hold values
    before = [ops.convert_to_numpy(v.value).copy() for v in model.variables]
    metrics_before = [
        ops.convert_to_numpy(v.value).copy() for v in model.metrics_variables
    ]
    find_nonfinite(model, x, y, training=True)
    after = [ops.convert_to_numpy(v.value) for v in model.variables]
    for v, a, b in zip(model.variables, before, after):
        np.testing.assert_array_equal(a, b, err_msg=v.path)
    for a, v in zip(metrics_before, model.metrics_variables):
        np.testing.assert_array_equal(a, ops.convert_to_numpy(v.value))
    assert "call" not in model.layers[0].__dict__


def test_report_prints_as_a_table():
    x, y = _batch()
    keras.config.set_dtype_policy("mixed_float16")
    model = _sequential(1e6)
    model.compile(optimizer="sgd", loss="mse")
    text = str(find_nonfinite(model, x, y))
    lines = text.splitlines()
    assert lines[0].split()[:6] == [
        "#",
        "layer",
        "class",
        "dtype",
        "max|output|",
        "headroom",
    ]
    boom = next(line for line in lines if " boom " in line)
    assert "first non-finite output" in boom and "inf" in boom
    assert "first non-finite layer output: boom" in text


def test_bad_input():
    x, y = _batch()
    with pytest.raises(TypeError, match="model"):
        find_nonfinite(keras.layers.Dense(2), x)
    model = _sequential(1.0)  # not compiled: no loss for the gradients
    with pytest.raises(ValueError, match="loss"):
        find_nonfinite(model, x, y)
    # ...unless a loss is given.
    report = find_nonfinite(model, x, y, loss="mse")
    assert report.finite


@pytest.mark.parametrize(
    "loss_scale", [math.nan, math.inf, -1.0, 0.0, -math.inf, "2", True]
)
def test_bad_loss_scale(loss_scale):
    x, y = _batch()
    model = _sequential(1.0)
    model.compile(optimizer="sgd", loss="mse")
    with pytest.raises(ValueError, match="`loss_scale`"):
        find_nonfinite(model, x, y, loss_scale=loss_scale)


def test_input_beyond_float16_range_is_the_first_cause():
    x, y = _batch()
    x[3, 2] = 1e5  # a float32 value that is inf in float16
    keras.config.set_dtype_policy("mixed_float16")
    model = _sequential(1.0)
    model.compile(optimizer="sgd", loss="mse")
    report = find_nonfinite(model, x, y)
    assert report.inputs_out_of_range == [("x", 1e5)]
    assert not report.finite
    assert report.layer == "first"  # the first float16 layer to see it
    assert report.cause.startswith("model input x holds values up to")
    lines = str(report).splitlines()
    summary = lines.index(next(li for li in lines if "first cause" in li))
    assert "first cause: model input x" in lines[summary]
    assert "65504" in lines[summary]
    assert "first non-finite layer output: first" in lines[summary + 1]

    # The same input through a float32 model: no cause at all.
    keras.config.set_dtype_policy("float32")
    model32 = _sequential(1.0)
    model32.compile(optimizer="sgd", loss="mse")
    report32 = find_nonfinite(model32, x, y)
    assert report32.inputs_out_of_range == []
    assert report32.finite and report32.cause is None


def test_input_out_of_range_named_inside_dict_inputs():
    keras.config.set_dtype_policy("mixed_float16")
    a = keras.Input((4,), name="a")
    b = keras.Input((4,), name="b")
    h = keras.layers.Dense(4, name="mix")(
        keras.layers.Concatenate(name="cat")([a, b])
    )
    model = keras.Model({"a": a, "b": b}, h)
    rng = np.random.default_rng(0)
    x = {
        "a": rng.normal(size=(4, 4)).astype("float32"),
        "b": rng.normal(size=(4, 4)).astype("float32"),
    }
    x["b"][0, 0] = -7e4
    report = find_nonfinite(model, x)
    assert report.inputs_out_of_range == [("x['b']", 7e4)]
    assert "model input x['b']" in report.cause
    # In range: nothing reported.
    x["b"][0, 0] = 6e4
    assert find_nonfinite(model, x).inputs_out_of_range == []


@pytest.mark.parametrize("stock", [False, True])
def test_find_nonfinite_uses_the_optimizers_scale_before_the_first_fit(
        stock, mixed_policy):
    model = mlp(6, 8, 3, activation="softmax")
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
