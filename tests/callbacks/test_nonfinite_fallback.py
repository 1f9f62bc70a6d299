"""NonFiniteMonitor's locating and fallback
(kerasmp/callbacks/nonfinite_fallback.py),
on small models without a fit: which layers move to float32 and when the
fallback refuses, the loss scale it restarts from, the scale reset, and the
event keys locating gives; and the monitor's fallback moving every layer a
batch overflows in one event. Runs on TensorFlow, JAX and PyTorch."""

import math

import keras
import numpy as np
import pytest

import kerasmp
from kerasmp.callbacks import NonFiniteMonitor
from kerasmp.callbacks import nonfinite_fallback as fallback
from kerasmp.callbacks.nonfinite_events import Rules
from kerasmp.callbacks.nonfinite_events import SkipRun
from kerasmp.callbacks.nonfinite_events import State
from kerasmp.errors import NonFiniteWarning
from kerasmp.optimizer import LossScaleOptimizer

pytestmark = pytest.mark.torch  # also in the PyTorch pass (conftest.py)

RULES = Rules(patience=3, scaled=True, dynamic=True, min_scale=1.0)
STUCK = State(
    scale=64.0,
    skipped=9,
    last_consecutive=4,
    base=1,
    run=SkipRun(start_scale=1024.0, forward=True, layer="block"),
    stuck=True,
)


class Report:
    """The part of a `NonFiniteReport` the fallback uses."""

    def __init__(self, model):
        self.model = model

    def layer_object(self, path):
        return self.model.get_layer(path)


def _model(block_dtype="mixed_float16", head_dtype="mixed_float16"):
    """input -> block (Sequential: two Dense) -> head (Dense)."""
    block = keras.Sequential(
        [
            keras.layers.Dense(4, name="inner1", dtype=block_dtype),
            keras.layers.Dense(4, name="inner2", dtype=block_dtype),
        ],
        name="block",
    )
    inputs = keras.Input((3,))
    outputs = keras.layers.Dense(1, name="head", dtype=head_dtype)(
        block(inputs)
    )
    return keras.Model(inputs, outputs)


def _stuck_event(layer="block", kind="stuck"):
    return {"kind": kind, "layer": layer}


def _compute_dtypes(model):
    block = model.get_layer("block")
    return (
        [layer.compute_dtype for layer in block.layers],
        model.get_layer("head").compute_dtype,
    )


def test_fall_back_moves_the_layer_and_its_sublayers():
    model = _model()
    result = fallback.fall_back(_stuck_event(), Report(model), STUCK, RULES)
    assert result.refusal is None
    assert result.layer == "block"
    assert _compute_dtypes(model) == (["float32", "float32"], "float16")
    assert model.get_layer("block").compute_dtype == "float32"
    # The scale restarts from before the run of skips; the run is forgotten
    # (its 3 skips after the base no longer count towards patience).
    assert result.reset_to == 1024.0
    assert result.state == State(
        scale=64.0, skipped=9, last_consecutive=4, base=4
    )


@pytest.mark.parametrize(
    "state, rules, reset_to",
    [
        # No run of skips (a non-finite loss): restart from the scale now.
        (State(scale=64.0), RULES, 64.0),
        (State(scale=64.0, run=SkipRun(start_scale=None)), RULES, 64.0),
        # A static scale, or none, is not reset.
        (STUCK, Rules(patience=3, dynamic=False), None),
        (State(), Rules(patience=3, scaled=False), None),
    ],
)
def test_fall_back_scale_to_restart_from(state, rules, reset_to):
    result = fallback.fall_back(_stuck_event(), Report(_model()), state, rules)
    assert result.refusal is None
    assert result.reset_to == reset_to


@pytest.mark.parametrize(
    "event, report, state, model_kwargs, refusal",
    [
        (
            _stuck_event(layer=None),
            True,
            STUCK,
            {},
            "no layer output was non-finite on the offending batch",
        ),
        (
            _stuck_event(),
            None,
            STUCK,
            {},
            "no layer output was non-finite on the offending batch",
        ),
        (
            _stuck_event(kind="nonfinite_weights"),
            True,
            STUCK,
            {},
            "the weights are already non-finite",
        ),
        (
            _stuck_event(kind="nonfinite_loss"),
            True,
            State(weights_bad=True),
            {},
            "the weights are already non-finite",
        ),
        (
            _stuck_event(),
            True,
            STUCK,
            {"block_dtype": "float16"},
            "layer 'block' has variables that are not float32",
        ),
        (
            _stuck_event(),
            True,
            STUCK,
            {"block_dtype": "float32"},
            "layer 'block' already computes in float32",
        ),
    ],
)
def test_fall_back_refuses(event, report, state, model_kwargs, refusal):
    model = _model(**model_kwargs)
    before = _compute_dtypes(model)
    result = fallback.fall_back(
        event, Report(model) if report else None, state, RULES
    )
    assert result.refusal == refusal
    assert result.layer is None and result.reset_to is None
    assert result.state is state  # nothing forgotten
    assert _compute_dtypes(model) == before  # nothing moved


def _built_optimizer(optimizer):
    variable = keras.Variable(np.ones((2,), "float32"))
    optimizer.build([variable])
    return optimizer


@pytest.mark.parametrize("hysteresis", [1, 3])
def test_reset_loss_scale(hysteresis):
    optimizer = _built_optimizer(
        LossScaleOptimizer(
            keras.optimizers.SGD(0.1),
            initial_scale=2.0**10,
            hysteresis=hysteresis,
        )
    )
    optimizer.dynamic_scale.assign(4.0)
    optimizer.step_counter.assign(17)
    optimizer.hysteresis_budget.assign(0)
    fallback.reset_loss_scale(optimizer, 512.0)
    assert float(optimizer.dynamic_scale) == 512.0
    assert int(optimizer.step_counter) == 0
    assert int(optimizer.hysteresis_budget) == hysteresis


def test_reset_loss_scale_of_keras_optimizer():
    optimizer = _built_optimizer(
        keras.optimizers.LossScaleOptimizer(keras.optimizers.SGD(0.1))
    )
    optimizer.dynamic_scale.assign(4.0)
    optimizer.step_counter.assign(17)
    fallback.reset_loss_scale(optimizer, 512.0)
    assert float(optimizer.dynamic_scale) == 512.0
    assert int(optimizer.step_counter) == 0


def test_reset_loss_scale_without_a_scale_raises():
    # The monitor catches this and warns; the unit itself does not hide it.
    with pytest.raises(AttributeError):
        fallback.reset_loss_scale(keras.optimizers.SGD(0.1), 512.0)


def _proj_model():
    keras.utils.set_random_seed(0)
    model = keras.Sequential(
        [
            keras.Input((4,)),
            keras.layers.Dense(3, name="proj", dtype="mixed_float16"),
            keras.layers.Dense(1, name="out", dtype="float32"),
        ]
    )
    model.compile(optimizer="sgd", loss="mse")
    return model


def test_locate_names_the_first_nonfinite_layer():
    model = _proj_model()
    x = np.full((2, 4), 1e5, "float32")  # float16 proj outputs overflow
    y = np.zeros((2, 1), "float32")
    report, fields = fallback.locate(model, (x, y, None), 8.0)
    assert report.layer == "proj"
    assert list(fields)[0] == "layer" and list(fields)[-1] == "variable"
    assert fields["layer"] == "proj"
    assert fields["loss_finite"] is False
    assert fields["all_gradients_nonfinite"] is True
    assert fields["variable"] == report.variable
    # An event's own variable (found in the weights) is kept.
    _, kept = fallback.locate(model, (x, y, None), 8.0, variable="w")
    assert kept["variable"] == "w"


def test_locate_without_a_batch_or_when_replay_fails():
    model = _proj_model()
    assert fallback.locate(model, None, 8.0) == (
        None,
        {"locate_error": "the offending batch is not available"},
    )
    wrong = np.ones((2, 7), "float32")  # the model takes 4 features
    report, fields = fallback.locate(model, (wrong, None, None), 8.0)
    assert report is None
    assert list(fields) == ["locate_error"]
    assert fields["locate_error"].split(":")[0].endswith("Error")


def test_first_nonfinite_weight():
    model = _proj_model()
    assert fallback.first_nonfinite_weight(model) is None
    kernel = model.get_layer("out").kernel
    kernel.assign(np.full(kernel.shape, np.nan, "float32"))
    assert fallback.first_nonfinite_weight(model) == kernel.path
    bias = model.get_layer("proj").bias
    bias.assign(np.full(bias.shape, np.inf, "float32"))
    assert fallback.first_nonfinite_weight(model) == bias.path


def _boost_shrink(jit=False):
    """proj -> "boost" (x1e5: inf in float16) -> "shrink" (x1e-5: its
    float16 input is inf once "boost" computes in float32) -> head."""
    keras.utils.set_random_seed(0)
    model = keras.Sequential([
        keras.Input((4,)),
        keras.layers.Dense(8, name="proj"),
        keras.layers.Rescaling(1e5, name="boost"),
        keras.layers.Rescaling(1e-5, name="shrink"),
        keras.layers.Dense(1, name="head"),
    ])
    model.compile(
        LossScaleOptimizer(keras.optimizers.SGD(0.05), initial_scale=2.0**8),
        "mse", jit_compile=jit)
    return model


@pytest.mark.parametrize("jit", [False, True])
def test_fallback_moves_every_layer_the_batch_overflows_in_one_event(
        jit, mixed_policy):
    """Two layers overflow in float16, one after the other: one fallback
    event moves both (the batch is replayed after each move), where it took
    one run of `patience` skipped steps per layer. Afterwards no step is
    skipped, and the loss follows a float32 model's (same seed and data)."""
    rng = np.random.default_rng(0)
    x = rng.normal(size=(96, 4)).astype("float32")
    y = (x[:, :1] * 0.5).astype("float32")
    model = _boost_shrink(jit)
    monitor = NonFiniteMonitor(action="fallback", patience=2)
    with pytest.warns(NonFiniteWarning, match="boost, shrink now compute"):
        history = model.fit(x, y, batch_size=8, epochs=2, shuffle=False,
                            verbose=0, callbacks=[monitor])
    fallbacks = [e for e in monitor.events if e.get("fallback_layers")]
    assert [e["fallback_layers"] for e in fallbacks] == [["boost", "shrink"]]
    assert "fallback_note" not in fallbacks[0]
    assert monitor.fallbacks == ["boost", "shrink"]
    assert monitor.events[-1] is fallbacks[0]  # nothing after it
    assert model.optimizer.skipped_steps == 2  # the patience, once
    assert [model.get_layer(n).compute_dtype
            for n in ("proj", "boost", "shrink", "head")] == [
        "float16", "float32", "float32", "float16"]
    with kerasmp.policy_scope("float32"):
        reference = _boost_shrink()
    reference.fit(x[16:], y[16:], batch_size=8, epochs=1, shuffle=False,
                  verbose=0)
    reference.fit(x, y, batch_size=8, epochs=1, shuffle=False, verbose=0)
    assert all(math.isfinite(v) for v in history.history["loss"])
    got, want = model.evaluate(x, y, verbose=0), reference.evaluate(
        x, y, verbose=0)
    assert got == pytest.approx(want, rel=0.05)


def test_fall_back_all_says_why_a_batch_still_overflows(mixed_policy):
    """exp(200+) overflows float32 too: "boost" moves, then it still outputs
    inf in float32, which no fallback can fix: the note says so."""
    keras.utils.set_random_seed(0)
    model = keras.Sequential([
        keras.Input((4,)),
        keras.layers.Dense(8, name="proj"),
        keras.layers.Activation("exponential", name="boost"),
        keras.layers.Dense(1, name="head"),
    ])
    model.compile(
        LossScaleOptimizer(keras.optimizers.SGD(0.05), initial_scale=2.0**8),
        "mse")
    x = np.full((8, 4), 200.0, "float32")
    batch = (x, np.zeros((8, 1), "float32"), None)
    report, fields = fallback.locate(model, batch, 1.0)
    assert fields["layer"] == "boost"
    result = fallback.fall_back_all(
        model, _stuck_event("boost"), report, STUCK, RULES, batch, 1.0)
    assert result.refusal is None
    assert result.layers == ("boost",)
    assert result.note == (
        "'boost' still outputs inf/NaN on that batch: layer 'boost' already "
        "computes in float32")
    assert result.reset_to == 1024.0
