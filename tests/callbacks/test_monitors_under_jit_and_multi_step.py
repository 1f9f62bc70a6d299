"""Monitors under jit_compile (XLA) and steps_per_execution > 1, exact
per-step events, forward- vs backward-pass overflow, and clean-up.

References: PyTorch GradScaler.update written from its documented rule, a
run with steps_per_execution=1 (for runs with k > 1), a fit on the same data
without the skipped batch (for the logged loss), and event steps fixed by the
data.
"""

import math
import shutil
import warnings

import keras
import numpy as np
import pytest
from _helpers import slow_on
from _models import proj_head
from _models import single_dense
from keras import ops

from kerasmp.callbacks import LossScaleMonitor
from kerasmp.callbacks import NonFiniteMonitor
from kerasmp.errors import NonFiniteWarning
from kerasmp.optimizer import LossScaleOptimizer
from kerasmp.policy import Policy
from kerasmp.policy import set_global_policy

pytestmark = pytest.mark.torch  # also in the PyTorch pass (conftest.py)

BATCH = 8
JAX = keras.backend.backend() == "jax"


class StepCounter(keras.callbacks.Callback):
    def __init__(self):
        super().__init__()
        self.steps = 0

    def on_train_batch_end(self, batch, logs=None):
        # One call per execution; count the steps it ran.
        self.steps += batch - self._begin + 1

    def on_train_batch_begin(self, batch, logs=None):
        self._begin = batch


def _model(optimizer, jit=False, spe=1, seed=1, softmax=True):
    model = proj_head("naive_softmax" if softmax else None, seed=seed)
    model.compile(
        optimizer=optimizer,
        loss="mse",
        jit_compile=jit,
        steps_per_execution=spe,
    )
    return model


def _data(batches, seed=0):
    rng = np.random.RandomState(seed)
    x = rng.randn(batches * BATCH, 4).astype("float32")
    y = rng.randn(batches * BATCH, 1).astype("float32")
    return x, y


def _overflow(x, batches):
    """float16 inputs of 1e5: the first layer's outputs overflow."""
    x = x.copy()
    for b in batches:
        x[b * BATCH] = 1e5
    return x


def _scale(model):
    return float(ops.convert_to_numpy(model.optimizer.dynamic_scale))


def _grad_scaler(overflows, scale, growth_interval):
    """PyTorch GradScaler.update: (scale after each step, skipped so far)."""
    tracker, skipped, scales, totals = 0, 0, [], []
    for overflow in overflows:
        if overflow:
            scale, tracker, skipped = scale * 0.5, 0, skipped + 1
        elif tracker + 1 == growth_interval:
            scale, tracker = scale * 2.0, 0
        else:
            tracker += 1
        scales.append(scale)
        totals.append(skipped)
    return scales, totals


CONFIGS = [(False, 1), (False, 2), (True, 1), (True, 2)]


@pytest.mark.parametrize("jit, spe", CONFIGS)
def test_loss_scale_follows_grad_scaler_under_jit_and_multi_step(
        jit, spe, mixed_policy):
    """The first fit of a fresh model: no warm-up, no optimizer.build."""
    x, y = _data(4)
    x = _overflow(x, [1])  # batch 1 of every epoch overflows (forward)
    optimizer = LossScaleOptimizer(
        keras.optimizers.SGD(0.01), initial_scale=2.0, dynamic_growth_steps=1
    )
    model = _model(optimizer, jit=jit, spe=spe)
    lsm, nfm = LossScaleMonitor(), NonFiniteMonitor(locate=False)
    history = model.fit(
        x,
        y,
        batch_size=BATCH,
        epochs=3,
        shuffle=False,
        verbose=0,
        callbacks=[lsm, nfm],
    )
    scales, skipped = _grad_scaler(
        [i % 4 == 1 for i in range(12)], scale=2.0, growth_interval=1
    )
    assert history.history["loss_scale"] == [scales[3], scales[7], scales[11]]
    assert history.history["loss_scale"][-1] == _scale(model)
    assert history.history["skipped_steps"] == [1, 2, 3]
    # Per step, whatever steps_per_execution.
    assert [s for _, s, _ in nfm.trace] == scales
    assert [k for _, _, k in nfm.trace] == skipped
    assert [(e["step"], e["kind"]) for e in nfm.events] == [
        (1, "overflow"),
        (5, "overflow"),
        (9, "overflow"),
    ]
    assert all(e["loss_finite"] is False for e in nfm.events)
    assert all(math.isfinite(v) for v in history.history["loss"])


def _skip_pattern_run(jit, spe, patience, action="warn", locate=True):
    """32 steps; steps 0-4 and 8-15 overflow in the forward pass."""
    x, y = _data(32)
    x = _overflow(x, list(range(0, 5)) + list(range(8, 16)))
    optimizer = LossScaleOptimizer(
        keras.optimizers.SGD(0.01), initial_scale=2.0**15
    )
    model = _model(optimizer, jit=jit, spe=spe, softmax=False)
    monitor = NonFiniteMonitor(action=action, patience=patience, locate=locate)
    counter = StepCounter()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", NonFiniteWarning)
        model.fit(
            x,
            y,
            batch_size=BATCH,
            shuffle=False,
            verbose=0,
            callbacks=[monitor, counter],
        )
    return monitor, counter.steps, model


def _summary(events):
    return [
        (
            e["step"],
            e["kind"],
            e["consecutive_skips"],
            e["loss_scale"],
            e["next_loss_scale"],
            e["loss_finite"],
            e["overflow_in"],
            e["action"],
        )
        for e in events
    ]


@pytest.mark.parametrize(
    "jit", [pytest.param(False, marks=slow_on("jax")), True])  # eager JAX: 23 s
def test_multi_step_events_equal_single_step_events(jit, mixed_policy):
    """Issue 10.5: 5 skips, 3 good steps, 8 skips, patience 10: no stuck,
    all steps run, and each event at its own step."""
    single, single_steps, _ = _skip_pattern_run(jit, 1, patience=10)
    multi, multi_steps, _ = _skip_pattern_run(jit, 8, patience=10)
    assert single_steps == multi_steps == 32
    expected_steps = list(range(0, 5)) + list(range(8, 16))
    assert [e["step"] for e in single.events] == expected_steps
    assert all(e["kind"] == "overflow" for e in single.events)
    assert [e["consecutive_skips"] for e in single.events] == [
        1, 2, 3, 4, 5, 1, 2, 3, 4, 5, 6, 7, 8
    ]
    assert _summary(multi.events) == _summary(single.events)
    assert multi.trace == single.trace

    # patience 3: stuck at step 2 (action) and 10 (a new run, acts again).
    single, single_steps, _ = _skip_pattern_run(jit, 1, patience=3)
    multi, multi_steps, _ = _skip_pattern_run(jit, 8, patience=3)
    assert _summary(multi.events) == _summary(single.events)
    acted = [(e["step"], e["kind"]) for e in single.events if e["action"]]
    assert acted == [(2, "stuck"), (10, "stuck")]
    # The stuck event of the run ending a group is located on every backend
    # (TensorFlow keeps the group's last batch, a skipped step of that run).
    stuck = [e for e in multi.events if e["step"] == 10][0]
    assert stuck["layer"] == "proj"
    if JAX:  # JAX keeps every batch of the group
        assert [e["layer"] for e in multi.events] == [
            e["layer"] for e in single.events
        ]


@pytest.mark.parametrize("jit", [False, True])
def test_stop_under_multi_step_stops_after_the_group(jit, mixed_policy):
    single, single_steps, _ = _skip_pattern_run(jit, 1, 3, action="stop")
    multi, multi_steps, model = _skip_pattern_run(jit, 8, 3, action="stop")
    assert single_steps == 3  # steps 0, 1, 2: stuck at 2
    assert multi_steps == 8  # the group that holds step 2 runs to its end
    assert [(e["step"], e["action"]) for e in multi.events if e["action"]] == [
        (2, "stop")
    ]
    assert _summary(multi.events)[:3] == _summary(single.events)


# --------------------------------------------------------------------------
# forward vs backward overflow


def test_forward_overflow_stuck_event_says_forward_and_every_gradient(
        mixed_policy):
    x, y = _data(8)
    x = _overflow(x, range(8))
    optimizer = LossScaleOptimizer(
        keras.optimizers.SGD(0.01), initial_scale=4.0, dynamic_growth_steps=1
    )
    model = _model(optimizer, softmax=False)
    monitor = NonFiniteMonitor(action="stop", patience=50)
    with pytest.warns(NonFiniteWarning, match="stuck"):
        model.fit(x, y, batch_size=BATCH, shuffle=False, verbose=0,
                  callbacks=[monitor])
    # 4 -> 2 -> 1: the third skip is at the minimum scale.
    kinds = [(e["step"], e["kind"]) for e in monitor.events]
    assert kinds == [(0, "overflow"), (1, "overflow"), (2, "stuck")]
    stuck = monitor.events[-1]
    assert stuck["at_min_scale"] and stuck["action"] == "stop"
    assert stuck["loss_finite"] is False
    assert stuck["overflow_in"] == "forward"
    assert stuck["all_gradients_nonfinite"] is True
    assert stuck["variable"] is None
    assert stuck["layer"] == "proj"
    message = stuck["message"]
    assert "forward pass overflows" in message
    assert "gradients still overflow" not in message
    assert "Every gradient is non-finite" in message
    assert "proj/kernel" not in message and "head/kernel" not in message
    for e in monitor.events:
        assert e["overflow_in"] == "forward" and e["loss_finite"] is False


def test_backward_only_overflow_says_backward(mixed_policy):
    """A fixed scale of 2**22 overflows the scaled gradients (|g| ~ 0.1..1)
    in float16 while the loss stays finite."""
    x, y = _data(6)
    optimizer = LossScaleOptimizer(
        keras.optimizers.SGD(0.01), initial_scale=2.0**22, dynamic=False
    )
    model = _model(optimizer, softmax=False)
    monitor = NonFiniteMonitor(action="stop", patience=3)
    with pytest.warns(NonFiniteWarning, match="stuck"):
        model.fit(x, y, batch_size=BATCH, shuffle=False, verbose=0,
                  callbacks=[monitor])
    assert [(e["step"], e["kind"]) for e in monitor.events] == [
        (0, "calibration"),
        (1, "calibration"),
        (2, "stuck"),
    ] or [(e["step"], e["kind"]) for e in monitor.events] == [
        (0, "overflow"),
        (1, "overflow"),
        (2, "stuck"),
    ]
    stuck = monitor.events[-1]
    assert stuck["loss_finite"] is True
    assert stuck["overflow_in"] == "backward"
    assert stuck["layer"] is None  # every layer output is finite
    assert "backward pass overflows" in stuck["message"]
    assert "forward pass" not in stuck["message"]


def test_fallback_warns_naming_the_layer_and_restores_the_scale(mixed_policy):
    """Every batch overflows the float16 softmax; after the fallback the
    scale is the one before the run of skips, not the backed-off one (which
    would otherwise stay for dynamic_growth_steps=2000 steps)."""
    x, y = _data(16)
    x *= 10.0  # |logits| ~ 30: exp overflows float16, not float32
    model = _model(
        LossScaleOptimizer(keras.optimizers.SGD(0.01), initial_scale=1024.0)
    )
    monitor = NonFiniteMonitor(action="fallback", patience=3)
    with pytest.warns(NonFiniteWarning, match="naive_softmax.*float32"):
        model.fit(x, y, batch_size=BATCH, shuffle=False, verbose=0,
                  callbacks=[monitor])
    fallback = [e for e in monitor.events if e.get("fallback_layers")]
    assert len(fallback) == 1
    assert fallback[0]["step"] == 2
    assert fallback[0]["loss_scale"] == 256.0  # 1024 backed off twice
    assert fallback[0]["loss_scale_reset_to"] == 1024.0
    assert len(monitor.events) == 3
    assert _scale(model) == 1024.0  # 13 more steps, none skipped
    assert model.optimizer.skipped_steps == 3


def test_skipped_forward_nan_does_not_poison_the_epoch_loss(mixed_policy):
    """Batch 2 of 6 overflows in the forward pass and is skipped. With a
    monitor or without, the epoch's loss averages the 5 applied steps (equal
    to a fit without that batch) and TerminateOnNaN lets the run finish."""
    x, y = _data(6)
    bad = _overflow(x, [2])

    def fit(x, y, callbacks):
        model = _model(
            LossScaleOptimizer(keras.optimizers.SGD(0.01), initial_scale=8.0),
            softmax=False,
        )
        counter = StepCounter()
        history = model.fit(x, y, batch_size=BATCH, shuffle=False, verbose=0,
                            callbacks=callbacks + [counter])
        return history.history, counter.steps

    keep = np.r_[0 : 2 * BATCH, 3 * BATCH : 6 * BATCH]
    reference, _ = fit(x[keep], y[keep], [])
    monitored, steps = fit(
        bad,
        y,
        [
            NonFiniteMonitor(locate=False),
            LossScaleMonitor(),
            keras.callbacks.TerminateOnNaN(),
        ],
    )
    assert steps == 6
    np.testing.assert_allclose(
        monitored["loss"], reference["loss"], rtol=1e-5
    )
    assert monitored["skipped_steps"] == [1]
    # Without a monitor: the same logs (stock Keras's running loss would be
    # NaN from the bad step and TerminateOnNaN would stop at step 3).
    plain, plain_steps = fit(bad, y, [keras.callbacks.TerminateOnNaN()])
    assert plain_steps == 6
    np.testing.assert_array_equal(plain["loss"], monitored["loss"])


def test_nan_loss_on_applied_steps_is_still_nan():
    set_global_policy(Policy("float32"))
    x, y = _data(4)
    x[2 * BATCH] = np.nan
    keras.utils.set_random_seed(1)
    model = single_dense(4, 1)
    model.compile(optimizer=keras.optimizers.SGD(0.01), loss="mse")
    monitor = NonFiniteMonitor(action="warn", locate=False)
    with pytest.warns(NonFiniteWarning):
        history = model.fit(x, y, batch_size=BATCH, shuffle=False, verbose=0,
                            callbacks=[monitor])
    assert math.isnan(history.history["loss"][0])
    assert [(e["step"], e["kind"]) for e in monitor.events][0] == (
        2,
        "nonfinite_loss",
    )


# --------------------------------------------------------------------------
# arguments, log file, clean-up


def test_patience_accepts_numpy_integers_and_rejects_bools():
    assert NonFiniteMonitor(patience=np.int64(3)).patience == 3
    assert type(NonFiniteMonitor(patience=np.int32(2)).patience) is int
    for bad in (np.bool_(True), True, np.float64(3.0)):
        with pytest.raises(ValueError, match="`patience`"):
            NonFiniteMonitor(patience=bad)


def test_unwritable_log_file_warns_once_and_training_continues(
        tmp_path, mixed_policy):
    directory = tmp_path / "logs"
    directory.mkdir()
    monitor = NonFiniteMonitor(
        action="warn", patience=100, log_file=directory / "events.jsonl"
    )
    shutil.rmtree(directory)  # the disk goes away after construction
    x, y = _data(6)
    x = _overflow(x, [1, 3, 4])
    model = _model(
        LossScaleOptimizer(keras.optimizers.SGD(0.01), initial_scale=8.0),
        softmax=False,
    )
    counter = StepCounter()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        model.fit(x, y, batch_size=BATCH, shuffle=False, verbose=0,
                  callbacks=[monitor, counter])
    assert counter.steps == 6
    assert [e["step"] for e in monitor.events] == [1, 3, 4]
    messages = [str(w.message) for w in caught if "log_file" in str(w.message)]
    assert len(messages) == 1 and "cannot write" in messages[0]


class _Abort(keras.callbacks.Callback):
    def on_train_batch_end(self, batch, logs=None):
        if batch == 2:
            raise RuntimeError("abort")


def _failing_batches(x, y):
    for i in range(len(x) // BATCH):
        if i == 2:
            raise ValueError("bad data")
        yield x[i * BATCH : (i + 1) * BATCH], y[i * BATCH : (i + 1) * BATCH]


def test_a_fit_that_raises_leaves_the_next_fit_as_usual(mixed_policy):
    x, y = _data(6)
    model = _model(
        LossScaleOptimizer(keras.optimizers.SGD(0.01), initial_scale=8.0)
    )
    # An exception from the data, raised out of the train function.
    with pytest.raises(Exception, match="bad data"):
        model.fit(_failing_batches(x, y), verbose=0, shuffle=False,
                  callbacks=[LossScaleMonitor(), NonFiniteMonitor()])
    # An exception from another callback.
    with pytest.raises(RuntimeError, match="abort"):
        model.fit(x, y, batch_size=BATCH, verbose=0,
                  callbacks=[LossScaleMonitor(), _Abort()])
    # Monitors patch nothing: the next fit logs what compile set up.
    history = model.fit(x, y, batch_size=BATCH, verbose=0)
    assert set(history.history) == {"loss", "loss_scale", "skipped_steps"}
    assert not model.optimizer.__dict__.get("finalize_variable_values")


@pytest.mark.parametrize("jit", [False, True])
def test_skipped_step_leaves_batch_norm_statistics(jit, mixed_policy):
    """Batch 2 of 5 overflows in the forward pass: with a monitor the skipped
    step leaves the moving statistics as they were, so they equal those of a
    fit on the same data without that batch (and stay finite)."""
    x, y = _data(5)
    bad = _overflow(x, [2])

    def fit(x, y, callbacks):
        model = proj_head("batch_norm", seed=3)
        model.compile(
            optimizer=LossScaleOptimizer(
                keras.optimizers.SGD(0.01), initial_scale=8.0
            ),
            loss="mse",
            jit_compile=jit,
        )
        model.fit(x, y, batch_size=BATCH, shuffle=False, verbose=0,
                  callbacks=callbacks)
        bn = model.get_layer("bn")
        return [
            ops.convert_to_numpy(v)
            for v in (bn.moving_mean, bn.moving_variance)
        ], model

    keep = np.r_[0 : 2 * BATCH, 3 * BATCH : 5 * BATCH]
    reference, _ = fit(x[keep], y[keep], [])
    monitored, model = fit(bad, y, [NonFiniteMonitor(locate=False)])
    assert model.optimizer.skipped_steps == 1
    for got, want in zip(monitored, reference):
        assert np.isfinite(got).all()
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)
