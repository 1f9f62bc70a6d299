"""kerasmp's one train step (`kerasmp.train_step`, installed by compile).

- The logs do not depend on which callbacks are attached: the same seeded
  fit through overflowing steps, with and without both monitors, gives the
  same loss, metrics and weights (monitors only add keys).
- Honest logs on skipped steps (docs/monitoring.md): an epoch whose every
  step is skipped logs the loss that was computed (finite or NaN), never
  the 0.0 of an empty mean.
"""

import math
import re
import warnings

import keras
import numpy as np
import pytest
from _models import batch_norm_mlp
from _models import mlp
from _models import single_dense
from keras import ops

from kerasmp import train_step as _train_step
from kerasmp.callbacks import LossScaleMonitor
from kerasmp.callbacks import NonFiniteMonitor
from kerasmp.optimizer import LossScaleOptimizer

pytestmark = pytest.mark.torch  # also in the PyTorch pass (conftest.py)


def _data():
    rng = np.random.default_rng(0)
    x = rng.normal(size=(24, 6)).astype("float32")
    y = (x[:, :1] * 0.5 + 0.1).astype("float32")
    x[[5, 13, 20], 0] = 1e5  # inf in float16: those steps are skipped
    return x, y


def _model(jit, spe):
    model = batch_norm_mlp(seed=3)
    model.compile(
        optimizer=keras.optimizers.SGD(0.05),
        loss="mse",
        metrics=["mae"],
        jit_compile=jit,
        steps_per_execution=spe,
    )
    return model


def _fit(jit, spe, callbacks):
    x, y = _data()
    model = _model(jit, spe)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        history = model.fit(
            x,
            y,
            batch_size=4,
            epochs=2,
            shuffle=False,
            verbose=0,
            callbacks=callbacks,
        )
    weights = [np.array(ops.convert_to_numpy(w)) for w in model.weights]
    return history.history, weights


@pytest.mark.torch_jit  # torch.compile: kerasmp's step called itself there
@pytest.mark.parametrize("spe", [1, 3])
@pytest.mark.parametrize("jit", [False, True])
def test_logs_do_not_depend_on_the_monitors(jit, spe, mixed_policy):
    plain, w_plain = _fit(jit, spe, [])
    monitors = [LossScaleMonitor(), NonFiniteMonitor(action="warn")]
    watched, w_watched = _fit(jit, spe, monitors)
    # Overflowing steps were skipped, and the logs say so without monitors.
    assert plain["skipped_steps"][-1] >= 4
    assert "loss_scale" in plain
    for key, values in plain.items():
        np.testing.assert_array_equal(watched[key], values, err_msg=key)
    for a, b in zip(w_watched, w_plain):
        np.testing.assert_array_equal(a, b)
    # The monitor saw every execution of `spe` steps.
    assert len(monitors[0].trace) == 12 // spe
    assert monitors[0].trace[-1][2] == plain["skipped_steps"][-1]


def _reference_loss(model, x, y):
    """The mean squared error of `model` on `(x, y)`, in NumPy."""
    pred = np.asarray(ops.convert_to_numpy(model(x)), "float64")
    return float(np.mean((pred - y) ** 2))


@pytest.mark.parametrize("jit", [False, True])
def test_an_epoch_of_skipped_steps_logs_the_real_loss(jit, mixed_policy):
    # Targets of 1000: at the initial scale 2**15 every gradient overflows
    # float16, and 4 steps are too few for the scale to settle.
    model = mlp(3, 4, 1, hidden_activation=None, seed=0)
    model.compile(keras.optimizers.SGD(1e-3), "mse", jit_compile=jit)
    x = np.ones((4, 3), "float32")
    y = np.full((4, 1), 1000.0, "float32")
    history = model.fit(
        np.tile(x, (4, 1)),
        np.tile(y, (4, 1)),
        batch_size=4,
        epochs=1,
        verbose=0,
        shuffle=False,
    ).history
    assert history["skipped_steps"] == [4]
    # No step applied: the weights are those of before, and the loss logged
    # is the loss computed on them (every batch is the same).
    loss = history["loss"][0]
    assert loss == pytest.approx(_reference_loss(model, x, y), rel=1e-3)
    assert loss > 1e5


@pytest.mark.parametrize("jit", [False, True])
def test_a_nan_forward_pass_logs_nan_not_zero(jit, mixed_policy):
    model = keras.Sequential(
        [
            keras.Input((3,)),
            keras.layers.Dense(2),
            keras.layers.Lambda(lambda t: t * float("nan")),
            keras.layers.Dense(1),
        ]
    )
    model.compile(keras.optimizers.SGD(0.1), "mse", jit_compile=jit)
    x = np.ones((8, 3), "float32")
    history = model.fit(x, x[:, :1], batch_size=4, verbose=0).history
    assert history["skipped_steps"] == [2]
    assert math.isnan(history["loss"][0])


def test_installed_by_compile_and_scaled_with_kerasmps_optimizer_only(
        mixed_policy):
    model = single_dense(3, 1)
    x = np.ones((8, 3), "float32")
    model.compile("sgd", "mse")
    assert isinstance(model.optimizer, LossScaleOptimizer)
    assert _train_step.scaled(model)
    assert set(model.fit(x, x[:, :1], verbose=0).history) == {
        "loss", "loss_scale", "skipped_steps"}
    # Another optimizer: stock logs (the step is still kerasmp's).
    model.compile("sgd", "mse", auto_scale_loss=False)
    assert not _train_step.scaled(model)
    assert set(model.fit(x, x[:, :1], verbose=0).history) == {"loss"}
    assert len(_train_step.rows(model)) == 1


def test_stock_loss_scale_optimizer_monitors_say_so_in_one_line():
    keras.config.set_dtype_policy("mixed_float16")
    model = single_dense(3, 1)
    stock = keras.optimizers.LossScaleOptimizer(keras.optimizers.SGD())
    model.compile(stock, "mse")
    assert not _train_step.scaled(model)
    x = np.ones((8, 3), "float32")
    fix = "kerasmp.LossScaleOptimizer(optimizer)"
    with pytest.warns(UserWarning, match=re.escape(fix)) as record:
        model.fit(x, x[:, :1], verbose=0, callbacks=[LossScaleMonitor()])
    found = [w for w in record if fix in str(w.message)]
    assert len(found) == 1
    # The warning points at this file, not at Keras's callback list.
    assert found[0].filename == __file__
    # The fix it names works: kerasmp's optimizer takes the stock one, with
    # its inner optimizer, settings and current scale.
    converted = LossScaleOptimizer(stock)
    assert converted.inner_optimizer is stock.inner_optimizer
    assert converted.initial_scale == float(
        keras.ops.convert_to_numpy(stock.dynamic_scale))
    assert converted.dynamic_growth_steps == stock.dynamic_growth_steps


@pytest.mark.parametrize("verbose", [1, 2])
def test_the_progress_bar_shows_the_logged_scale_and_skips(
        capsys, mixed_policy, verbose):
    # docs/monitoring.md ("Limits"): Keras's Progbar prints every log value
    # as a float, a value <= 1e-3 in exponent form; kerasmp's progress bar
    # patch (kerasmp/train_step/progbar.py) prints `skipped_steps` as the
    # count it is.
    x, y = _data()
    model = _model(jit=False, spe=1)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        history = model.fit(
            x, y, batch_size=4, epochs=2, shuffle=False, verbose=verbose
        ).history
    out = capsys.readouterr().out
    # verbose=2: one line per epoch; verbose=1: a line per update ("\r"
    # and backspaces rewrite it), the epoch's last one at its end.
    lines = [line.strip("\b") for line in out.splitlines()
             if "skipped_steps" in line]
    if verbose == 2:
        assert len(lines) == 2
    for line in lines:
        assert re.search(r"skipped_steps: \d+(\s|$)", line), line
    for line, scale, skipped in zip(
        lines[-1:] if verbose == 1 else lines,
        history["loss_scale"][-1:] if verbose == 1 else history["loss_scale"],
        history["skipped_steps"][-1:] if verbose == 1
        else history["skipped_steps"],
    ):
        assert f"loss_scale: {scale:.4f}" in line
        assert re.search(rf"skipped_steps: {int(skipped)}(\s|$)", line), line
    assert history["skipped_steps"][0] >= 1
    # History keeps Keras's floats; only the progress bar's copy changes.
    assert all(type(v) is float for v in history["skipped_steps"])
    # No overflow: 0 skipped steps, a count, not Keras's 0.0000e+00.
    model = single_dense(6, 1)
    model.compile(keras.optimizers.SGD(1e-3), "mse")
    history = model.fit(x[:4] * 1e-3, y[:4] * 1e-3, batch_size=4,
                        verbose=verbose).history
    out = capsys.readouterr().out
    assert re.search(r"skipped_steps: 0(\s|$)", out), out
    assert "skipped_steps: 0.0000e+00" not in out
    assert history["skipped_steps"] == [0.0]
