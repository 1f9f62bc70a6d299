"""Tests for kerasmp.debug.gradient_report and plot_gradient_report.

The reference for underflow and error is a float32 twin of each model
(built again under a float32 policy, same weights) whose
gradients the tests compute by hand with the backend's own autodiff, next to
hand-scaled mixed-precision gradients; the underflow/overflow scenarios are
built from analytic magnitudes (a loss multiplied by 1e-6 puts the output
gradients below float16's smallest subnormal, 6e-8; one multiplied by 1e4
puts them above 65504 once scaled).
"""

import json
import math

import keras
import numpy as np
import pytest
from _models import batch_norm_mlp
from _models import named_mlp

import kerasmp
from kerasmp.debug import GradientReport
from kerasmp.debug import gradient_report
from kerasmp.debug import plot_gradient_report
from kerasmp.optimizer import LossScaleOptimizer

pytestmark = pytest.mark.torch  # also in the PyTorch pass (conftest.py)


def _scaled_mse(factor):
    def loss(y, y_pred):
        return factor * keras.losses.mean_squared_error(y, y_pred)

    return loss


def _functional():
    inputs = keras.Input((16,), name="features")
    h = keras.layers.Dense(32, activation="relu", name="d1")(inputs)
    h = keras.layers.LayerNormalization(name="norm")(h)
    h = keras.layers.Dense(32, activation="relu", name="d2")(h)
    outputs = keras.layers.Dense(4, name="out")(h)
    return keras.Model(inputs, outputs)


class DictModel(keras.Model):
    """Subclassed, dict inputs, a nested layer."""

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.a = keras.layers.Dense(32, activation="relu", name="a")
        self.b = keras.layers.Dense(32, activation="relu", name="b")
        self.head = keras.Sequential(
            [keras.layers.Dense(32, activation="relu"), keras.layers.Dense(4)],
            name="head",
        )

    def call(self, inputs):
        return self.head(self.a(inputs["u"]) + self.b(inputs["v"]))


BUILDERS = {
    "sequential": lambda: named_mlp(16, 32, 4),
    "functional": _functional,
    "subclassed_dict": DictModel,
}


def _data(kind, n=32, seed=0):
    rng = np.random.default_rng(seed)
    y = rng.normal(size=(n, 4)).astype("float32")
    if kind == "subclassed_dict":
        x = {
            "u": rng.normal(size=(n, 16)).astype("float32"),
            "v": rng.normal(size=(n, 8)).astype("float32"),
        }
    else:
        x = rng.normal(size=(n, 16)).astype("float32")
    return x, y


def _model(kind, factor, policy="mixed_float16"):
    keras.utils.set_random_seed(0)
    with kerasmp.policy_scope(policy):
        model = BUILDERS[kind]()
    model.compile(optimizer="adam", loss=_scaled_mse(factor))
    x, y = _data(kind)
    model(x)  # build
    return model, x, y


@pytest.mark.parametrize("kind", sorted(BUILDERS))
def test_underflow_at_scale_1_fixed_by_the_recommended_scale(kind):
    model, x, y = _model(kind, 1e-6)
    report = gradient_report(model, x, y)
    assert isinstance(report, GradientReport)
    assert report.scales == [2.0**k for k in range(25)]
    one = report.at(1.0)
    assert not one.overflow
    assert one.underflow > 0.3
    best = report.at(report.recommended_scale)
    assert not best.overflow
    assert best.underflow < 0.02
    assert best.rel_error < one.rel_error
    assert report.recommended_scale > 1.0


@pytest.mark.parametrize("kind", sorted(BUILDERS))
def test_overflow_at_large_scales_recommendation_below_it(kind):
    model, x, y = _model(kind, 1e4)
    report = gradient_report(model, x, y)
    assert report.at(2.0**24).overflow
    assert math.isinf(report.at(2.0**24).rel_error)
    first = report.first_overflow
    assert first == min(r.scale for r in report.rows if r.overflow)
    assert report.recommended_scale is not None
    assert report.recommended_scale < first
    assert report.recommended_scale * report.margin <= first
    assert not report.at(report.recommended_scale).overflow


def _snapshot(variables):
    return {v.path: np.asarray(keras.ops.convert_to_numpy(v.value)).tobytes()
            for v in variables}


def test_weights_and_optimizer_state_unchanged_bitwise():
    keras.utils.set_random_seed(0)
    with kerasmp.policy_scope("mixed_float16"):
        model = batch_norm_mlp(16, 32, 4, dropout=0.2)
    model.compile(
        optimizer=LossScaleOptimizer(keras.optimizers.Adam(1e-3)),
        loss=_scaled_mse(1e-6),
        metrics=["mae"],
    )
    x, y = _data("sequential")
    model.fit(x, y, batch_size=16, epochs=1, verbose=0)
    weights = _snapshot(model.variables)
    optimizer = _snapshot(model.optimizer.variables)
    scale = model.optimizer.loss_scale
    gradient_report(model, x, y, scales=[1.0, 2.0**10, 2.0**24])
    assert _snapshot(model.variables) == weights
    assert _snapshot(model.optimizer.variables) == optimizer
    assert model.optimizer.loss_scale == scale


def _backend_grads(model, x, y, loss_fn, scale):
    """Gradients of `loss_fn(y, model(x)) * scale`, unscaled, as numpy.

    The loss sees float32 predictions, as Keras's compiled losses do.
    """
    variables = model.trainable_variables
    if keras.backend.backend() == "tensorflow":
        import tensorflow as tf

        with tf.GradientTape() as tape:
            y_pred = keras.ops.cast(model(x, training=True), "float32")
            value = keras.ops.mean(loss_fn(y, y_pred))
            scaled = keras.ops.cast(value, "float32") * scale
        grads = tape.gradient(scaled, variables)
    elif keras.backend.backend() == "torch":
        import torch

        y_pred = keras.ops.cast(model(x, training=True), "float32")
        value = keras.ops.mean(loss_fn(y, y_pred))
        scaled = keras.ops.cast(value, "float32") * scale
        grads = torch.autograd.grad(scaled, [v.value for v in variables])
    else:
        import jax

        non_trainable = [v.value for v in model.non_trainable_variables]

        def f(trainable):
            y_pred, _ = model.stateless_call(
                trainable, non_trainable, x, training=True)
            y_pred = keras.ops.cast(y_pred, "float32")
            value = keras.ops.mean(loss_fn(y, y_pred))
            return keras.ops.cast(value, "float32") * scale

        # Jitted, as JAX's fit runs its train step (XLA keeps some float16
        # intermediates wider than op-by-op execution does).
        grads = jax.jit(jax.grad(f))([v.value for v in variables])
    return [np.asarray(keras.ops.convert_to_numpy(g), np.float64) / scale
            for g in grads]


@pytest.mark.parametrize("kind", ["sequential", "functional"])
def test_numbers_match_a_float32_twin_computed_by_hand(kind):
    model, x, y = _model(kind, 1e-6)
    with kerasmp.policy_scope("float32"):
        twin = BUILDERS[kind]()
    twin(x)
    twin.set_weights(model.get_weights())
    assert all(layer.compute_dtype == "float32" for layer in twin.layers)
    loss_fn = _scaled_mse(1e-6)
    reference = _backend_grads(twin, x, y, loss_fn, 1.0)
    report = gradient_report(model, x, y, scales=[1.0, 8.0, 2.0**12])
    for scale in (1.0, 8.0, 2.0**12):
        mixed = _backend_grads(model, x, y, loss_fn, scale)
        nonzero = sum(int(np.count_nonzero(r)) for r in reference)
        lost = sum(int(np.count_nonzero((r != 0) & (g == 0)))
                   for g, r in zip(mixed, reference))
        err = math.sqrt(sum(float(np.sum((g - r) ** 2))
                            for g, r in zip(mixed, reference)))
        norm = math.sqrt(sum(float(np.sum(r**2)) for r in reference))
        row = report.at(scale)
        assert row.underflow == pytest.approx(lost / nonzero, abs=1e-3)
        assert row.rel_error == pytest.approx(err / norm, rel=1e-3)


def test_float32_model_has_no_underflow_and_no_error():
    model, x, y = _model("sequential", 1e-6, policy="float32")
    report = gradient_report(model, x, y, scales=[1.0, 2.0**24])
    for row in report.rows:
        assert not row.overflow
        assert row.underflow == 0.0
        assert row.rel_error == 0.0


def test_layers_name_every_variable_worst_first():
    model, x, y = _model("subclassed_dict", 1e-6)
    report = gradient_report(model, x, y)
    paths = [v.path for v in report.layers]
    assert sorted(paths) == sorted(v.path for v in model.trainable_variables)
    errors = [v.rel_error for v in report.layers]
    assert errors == sorted(errors, reverse=True)
    assert all(0.0 <= v.underflow <= 1.0 for v in report.layers)
    # Scale 1 loses most of the first layer's gradient.
    worst_at_one = report.layers_at(1.0)[0]
    assert worst_at_one.underflow > 0.3 or worst_at_one.rel_error > 0.3


def test_report_prints_and_serializes():
    model, x, y = _model("sequential", 1e4)
    report = gradient_report(model, x, y, scales=[1, 2**4, 2**8, 2**16])
    text = str(report)
    assert "<- recommended" in text and "overflow" in text
    data = json.loads(json.dumps(report.to_dict()))
    assert data["recommended_scale"] == report.recommended_scale
    assert [r["scale"] for r in data["rows"]] == [1.0, 16.0, 256.0, 65536.0]
    assert data["rows"][-1]["rel_error"] == "inf"
    with pytest.raises(KeyError, match="measured scales"):
        report.at(3.0)


def test_every_scale_overflowing_gives_no_recommendation():
    model, x, y = _model("sequential", 1e9)
    report = gradient_report(model, x, y, scales=[2.0**10, 2.0**20])
    assert all(r.overflow for r in report.rows)
    assert report.recommended_scale is None
    assert report.layers == []
    assert "none" in str(report)


@pytest.mark.parametrize(
    "scales", [[0.0], [-1.0], [math.nan], [math.inf], [], ["2"], True]
)
def test_bad_scales(scales):
    model, x, y = _model("sequential", 1.0)
    with pytest.raises(ValueError, match="`scales`"):
        gradient_report(model, x, y, scales=scales)


def test_bad_margin_and_model():
    model, x, y = _model("sequential", 1.0)
    with pytest.raises(ValueError, match="`margin`"):
        gradient_report(model, x, y, margin=0.5)
    with pytest.raises(TypeError, match="`model`"):
        gradient_report(keras.layers.Dense(2), x, y)


def test_plot_gradient_report(tmp_path):
    pytest.importorskip("matplotlib")
    model, x, y = _model("sequential", 1e4)
    report = gradient_report(model, x, y, scales=[1, 2**4, 2**8, 2**16])
    path = tmp_path / "g.png"
    plot_gradient_report(report, path)
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    with pytest.raises(TypeError, match="GradientReport"):
        plot_gradient_report({"rows": []}, tmp_path / "h.png")


def test_embedding_model_and_loss_override():
    # TensorFlow returns an Embedding's gradient as IndexedSlices; the
    # report densifies it. Uncompiled model: the loss comes from `loss=`.
    keras.utils.set_random_seed(0)
    with kerasmp.policy_scope("mixed_float16"):
        model = keras.Sequential([
            keras.Input((6,), dtype="int32"),
            keras.layers.Embedding(50, 8, name="embed"),
            keras.layers.GlobalAveragePooling1D(),
            keras.layers.Dense(4, name="out"),
        ])
    rng = np.random.default_rng(0)
    x = rng.integers(0, 50, size=(16, 6)).astype("int32")
    y = rng.normal(size=(16, 4)).astype("float32")
    report = gradient_report(model, x, y, loss=_scaled_mse(1e-6),
                             scales=[1.0, 2.0**16])
    assert report.at(1.0).underflow > 0.3
    assert report.at(2.0**16).underflow < 0.02
    embed = next(v for v in report.layers_at(2.0**16)
                 if v.path.endswith("embeddings"))
    assert embed.size == 50 * 8 and embed.rel_error < 0.05
