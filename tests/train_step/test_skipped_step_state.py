"""A step that kerasmp.LossScaleOptimizer skips leaves every variable as it
was, non-trainable ones included, with no monitor attached.

A batch holding a value beyond float16's range overflows the forward pass of
a mixed_float16 CNN: the loss and every gradient are non-finite and the step
is skipped. BatchNormalization's moving statistics must then hold, bit for
bit, the values they had before that step (stock Keras lets the forward pass
write NaN into them, whatever the optimizer decides), and later steps must
update them as usual.

The tests marked `torch` run on PyTorch too; the others check how the
TensorFlow and JAX steps pick the variables to write back at trace time
(PyTorch's eager step copies every non-trainable variable instead), or need
`tf.distribute`.
"""

import json
import os
import subprocess
import sys
import textwrap
import warnings
from pathlib import Path

import keras
import numpy as np
import pytest
from _models import mlp
from keras import ops

from kerasmp import train_step as _train_step
from kerasmp.errors import StockPolicyWarning
from kerasmp.optimizer import LossScaleOptimizer
from kerasmp.train_step import jax as _jax_step
from kerasmp.train_step import tensorflow as _tf_step

BATCH = 8
ROOT = Path(__file__).resolve().parents[2]


def _cnn(jit, optimizer=None):
    """A seeded CNN with BatchNormalization "bn", compiled (the tests build
    it under `mixed_policy`)."""
    keras.utils.set_random_seed(0)
    model = keras.Sequential(
        [
            keras.Input((6, 6, 1)),
            keras.layers.Conv2D(4, 3, name="conv"),
            keras.layers.BatchNormalization(name="bn"),
            keras.layers.ReLU(),
            keras.layers.GlobalAveragePooling2D(),
            keras.layers.Dense(1, name="head"),
        ]
    )
    model.compile(
        optimizer=optimizer or keras.optimizers.SGD(0.01),
        loss="mse",
        jit_compile=jit,
    )
    return model


def _batches():
    rng = np.random.default_rng(0)
    x = rng.normal(size=(BATCH, 6, 6, 1)).astype("float32")
    y = rng.normal(size=(BATCH, 1)).astype("float32")
    bad = x.copy()
    bad[3, 2, 2, 0] = 1e5  # inf in float16: the forward pass overflows
    return x, y, bad


def _statistics(model):
    bn = model.get_layer("bn")
    return [
        np.array(ops.convert_to_numpy(v))
        for v in (bn.moving_mean, bn.moving_variance)
    ]


def _fit(model, x, y):
    model.fit(x, y, batch_size=BATCH, epochs=1, shuffle=False, verbose=0)


@pytest.mark.torch
@pytest.mark.parametrize("jit", [False, True])
def test_skipped_step_keeps_batch_norm_statistics_without_monitor(
        jit, mixed_policy):
    x, y, bad = _batches()
    model = _cnn(jit)
    assert isinstance(model.optimizer, LossScaleOptimizer)
    _fit(model, x, y)  # a normal step first: the statistics have moved
    before = _statistics(model)
    assert model.optimizer.skipped_steps == 0

    _fit(model, bad, y)
    assert model.optimizer.skipped_steps == 1
    after = _statistics(model)
    for got, want in zip(after, before):
        # Bit for bit: the skipped step's write is undone, not recomputed.
        assert got.dtype == want.dtype
        np.testing.assert_array_equal(got.view(np.uint32),
                                      want.view(np.uint32))

    # Later steps update the statistics normally: the same change a fresh
    # model makes on that batch from the same state.
    _fit(model, x, y)
    assert model.optimizer.skipped_steps == 1
    moved = _statistics(model)
    reference = _cnn(jit)
    _fit(reference, x, y)
    _fit(reference, x, y)
    for got, want, old in zip(moved, _statistics(reference), before):
        assert np.isfinite(got).all()
        assert not np.array_equal(got, old)
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)
    assert np.isfinite(model.predict(x, verbose=0)).all()


def _stock_cnn(jit):
    """`_cnn` as the TensorFlow guide builds it: Keras's own mixed policy
    and LossScaleOptimizer (no kerasmp policy, so compile keeps both)."""
    keras.mixed_precision.set_global_policy("mixed_float16")
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", StockPolicyWarning)
            return _cnn(jit, keras.optimizers.LossScaleOptimizer(
                keras.optimizers.SGD(0.01)))
    finally:
        keras.mixed_precision.set_global_policy("float32")


@pytest.mark.torch
def test_stock_optimizer_keeps_stock_behaviour_with_a_monitor():
    """Keras's own LossScaleOptimizer is stock Keras: kerasmp's step undoes
    nothing for it, and a monitor changes nothing either (the statistics
    after a skipped step are the same with and without one)."""
    from kerasmp.callbacks import NonFiniteMonitor

    x, y, bad = _batches()
    results = []
    jit = keras.backend.backend() != "torch"  # torch.compile: see conftest
    for callbacks in ([], [NonFiniteMonitor(locate=False)]):
        model = _stock_cnn(jit)
        assert not _train_step.scaled(model)
        _fit(model, x, y)
        model.fit(bad, y, batch_size=BATCH, shuffle=False, verbose=0,
                  callbacks=callbacks)
        results.append(_statistics(model))
    for got, want in zip(*results):
        np.testing.assert_array_equal(got, want)


@pytest.mark.torch
def test_applied_steps_update_statistics_as_without_the_guard(mixed_policy):
    """The guard changes nothing on applied steps: statistics equal those of
    the stock LossScaleOptimizer under Keras's own mixed policy (which also
    computes batch normalization in float32), on finite data."""
    x, y, _ = _batches()
    ours = _cnn(False)
    stock = _stock_cnn(False)
    assert not _train_step.scaled(stock)
    for _ in range(2):
        _fit(ours, x, y)
        _fit(stock, x, y)
    for got, want in zip(_statistics(ours), _statistics(stock)):
        np.testing.assert_array_equal(got, want)


@pytest.mark.torch
def test_recompiling_with_another_optimizer_removes_the_undo(mixed_policy):
    model = _cnn(False)
    assert _train_step.scaled(model)
    model.compile(
        optimizer=keras.optimizers.SGD(0.01), loss="mse",
        auto_scale_loss=False,
    )
    assert not _train_step.scaled(model)


@pytest.mark.torch
def test_no_guard_work_when_nothing_is_assigned(mixed_policy):
    """A model without forward-assigned variables trains exactly as before
    (the guard adds nothing; weights equal the stock optimizer's)."""
    x, y, _ = _batches()
    x = x.reshape(BATCH, -1)

    def dense(optimizer):
        model = mlp(36, 4, 1, hidden_activation=None, seed=0)
        model.compile(optimizer=optimizer, loss="mse")
        _fit(model, x, y)
        return model

    ours = dense(LossScaleOptimizer(keras.optimizers.SGD(0.01)))
    stock = dense(
        keras.optimizers.LossScaleOptimizer(keras.optimizers.SGD(0.01))
    )
    for a, b in zip(ours.get_weights(), stock.get_weights()):
        np.testing.assert_array_equal(a, b)


MIRRORED = textwrap.dedent(
    """
    import json, os, sys
    os.environ["KERAS_BACKEND"] = "tensorflow"
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")
    import numpy as np
    import tensorflow as tf

    cpu = tf.config.list_physical_devices("CPU")[0]
    tf.config.set_logical_device_configuration(
        cpu, [tf.config.LogicalDeviceConfiguration()] * 2
    )
    import keras
    import kerasmp

    rng = np.random.default_rng(0)
    x = rng.normal(size=(8, 6, 6, 1)).astype("float32")
    y = rng.normal(size=(8, 1)).astype("float32")
    bad = x.copy()
    bad[6, 2, 2, 0] = 1e5  # in replica 1's half of the batch only

    strategy = tf.distribute.MirroredStrategy(["/cpu:0", "/cpu:1"])
    with strategy.scope():
        kerasmp.set_global_policy(kerasmp.Policy("mixed_float16"))
        keras.utils.set_random_seed(0)
        model = keras.Sequential([
            keras.Input((6, 6, 1)),
            keras.layers.Conv2D(4, 3),
            keras.layers.BatchNormalization(name="bn"),
            keras.layers.GlobalAveragePooling2D(),
            keras.layers.Dense(1),
        ])
        model.compile(keras.optimizers.SGD(0.01), "mse")

    def stats():
        bn = model.get_layer("bn")
        out = []
        for v in (bn.moving_mean, bn.moving_variance):
            value = v.value
            parts = getattr(value, "values", (value,))
            out.append([np.asarray(p.numpy()).tolist() for p in parts])
        return out

    def fit(x):
        model.fit(x, y, batch_size=8, shuffle=False, verbose=0)

    fit(x)
    before = stats()
    fit(bad)
    after = stats()
    skipped = model.optimizer.skipped_steps
    fit(x)
    print("RESULT " + json.dumps({
        "replicas": strategy.num_replicas_in_sync,
        "before": before, "after": after, "skipped": skipped,
        "later": stats(),
    }))
    """
)


@pytest.mark.tensorflow
@pytest.mark.slow
@pytest.mark.skipif(
    keras.backend.backend() != "tensorflow", reason="tf.distribute"
)
def test_skipped_step_keeps_statistics_under_mirrored_strategy():
    env = dict(os.environ, PYTHONPATH=str(ROOT), KERAS_BACKEND="tensorflow")
    done = subprocess.run(
        [sys.executable, "-c", MIRRORED],
        capture_output=True, text=True, env=env, timeout=600, cwd=ROOT,
    )
    lines = [
        line for line in done.stdout.splitlines() if line.startswith("RESULT ")
    ]
    assert lines, done.stdout[-2000:] + done.stderr[-3000:]
    out = json.loads(lines[-1][len("RESULT "):])
    assert out["replicas"] == 2
    assert out["skipped"] == 1
    # Every replica's copy of each statistic is exactly as before the step.
    assert out["after"] == out["before"]
    for later, before in zip(out["later"], out["before"]):
        assert np.isfinite(np.array(later, dtype=float)).all()
        assert later != before


@pytest.mark.parametrize("jit", [False, True])
def test_only_variables_the_step_assigns_are_written_back(
        monkeypatch, jit, mixed_policy):
    """The guard finds, at trace time, which non-trainable variables the
    step writes: batch-norm statistics and the dropout seed yes, a frozen
    layer's weights no (nothing is read or written back for them)."""
    restored = []
    if keras.backend.backend() == "jax":
        original = _jax_step.restore

        def spy(old, new, skipped):
            restored.append([
                i for i, (o, n) in enumerate(zip(old, new)) if n is not o
            ])
            return original(old, new, skipped)

        monkeypatch.setattr(_jax_step, "restore", spy)
    else:
        original = _tf_step.Frozen.assigned

        def spy(self):
            pairs = original(self)
            restored.append([
                i for i, v in enumerate(self.variables)
                if any(v is w for w, _ in pairs)
            ])
            return pairs

        monkeypatch.setattr(_tf_step.Frozen, "assigned", spy)
    keras.utils.set_random_seed(0)
    frozen = keras.layers.Dense(3, name="frozen")
    model = keras.Sequential([
        keras.Input((4,)), frozen, keras.layers.BatchNormalization(),
        keras.layers.Dropout(0.1, seed=1), keras.layers.Dense(1),
    ])
    frozen.trainable = False
    model.compile(optimizer="sgd", loss="mse", jit_compile=jit)
    x = np.ones((8, 4), "float32")
    model.fit(x, x[:, :1], batch_size=8, verbose=0)
    paths = [v.path for v in model.non_trainable_variables]
    want = [i for i, p in enumerate(paths) if "frozen/" not in p]
    assert len(want) == len(paths) - 2  # kernel and bias of `frozen`
    if keras.backend.backend() == "jax":
        restored = restored[::2]  # then the metrics, on every step
    # The metric variables come after the model's (TensorFlow).
    restored = [[i for i in r if i < len(paths)] for r in restored]
    assert restored and all(r == want for r in restored), (restored, paths)


@pytest.mark.torch
def test_a_skipped_step_changes_no_variable_but_the_scale(mixed_policy):
    """Weights, optimizer slots and iterations, batch-norm statistics, the
    dropout seed state: all as before the skipped step; the metrics hold
    only the applied steps (here none: their reset values)."""
    keras.utils.set_random_seed(0)
    model = keras.Sequential([
        keras.Input((4,)), keras.layers.Dense(8, name="d1"),
        keras.layers.BatchNormalization(), keras.layers.Dropout(0.5, seed=1),
        keras.layers.Dense(1, name="d2"),
    ])
    optimizer = LossScaleOptimizer(keras.optimizers.Adam(1e-3),
                                   initial_scale=2**8)
    model.compile(optimizer, "mse", metrics=["mae"])
    x = np.random.default_rng(0).normal(size=(8, 4)).astype("float32")
    model.fit(x, x[:, :1], batch_size=8, verbose=0)  # slots exist, moved
    assert optimizer.skipped_steps == 0
    # All but the scale rule's own state (the scale and its counters).
    tracked = model.variables + optimizer.inner_optimizer.variables
    assert any("seed_generator" in v.path for v in tracked), [
        v.path for v in tracked]
    before = {v.path: np.array(ops.convert_to_numpy(v)) for v in tracked}
    # Targets of 1e6: every float16 gradient overflows at any scale.
    logs = model.fit(x, np.full((8, 1), 1e6, "float32"), batch_size=8,
                     verbose=0).history
    assert optimizer.skipped_steps == 1 and logs["skipped_steps"] == [1]
    changed = [v.path for v in tracked if not np.array_equal(
        np.array(ops.convert_to_numpy(v)), before[v.path])]
    assert changed == [], changed
    for v in model.metrics_variables:  # reset at the epoch's start
        assert not np.any(ops.convert_to_numpy(v)), v.path
