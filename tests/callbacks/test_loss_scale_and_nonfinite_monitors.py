"""kerasmp.callbacks' LossScaleMonitor and NonFiniteMonitor in a fit, and
kerasmp.plotting.plot_loss_scale on what they record.

References: a hand-written PyTorch GradScaler.update trajectory, a probe
callback that reads the optimizer's variable directly, a float32 twin of each
model, and step counts fixed by the data.
"""

import csv
import glob
import importlib.util
import json
import math
import os
import warnings

import keras
import numpy as np
import pytest
from _models import proj_head
from keras import ops

from kerasmp.callbacks import LossScaleMonitor
from kerasmp.callbacks import NonFiniteMonitor
from kerasmp.debug import gradient_report
from kerasmp.errors import NonFiniteError
from kerasmp.errors import NonFiniteWarning
from kerasmp.optimizer import LossScaleOptimizer
from kerasmp.policy import Policy
from kerasmp.policy import set_global_policy

pytestmark = pytest.mark.torch  # also in the PyTorch pass (conftest.py)

BATCH = 8


class StepCounter(keras.callbacks.Callback):
    def __init__(self):
        super().__init__()
        self.steps = 0

    def on_train_batch_end(self, batch, logs=None):
        self.steps += 1


class ScaleProbe(keras.callbacks.Callback):
    """Reads the optimizer's scale variable itself at each epoch's end."""

    def __init__(self):
        super().__init__()
        self.scales = []

    def on_epoch_end(self, epoch, logs=None):
        scale = self.model.optimizer.dynamic_scale
        self.scales.append(
            float(ops.convert_to_numpy(ops.convert_to_tensor(scale)))
        )


def _softmax_model(optimizer=None, seed=1):
    model = proj_head("naive_softmax", seed=seed)
    model.compile(optimizer=optimizer or keras.optimizers.SGD(0.05), loss="mse")
    return model


def _data(batches, seed=0, scale=1.0):
    rng = np.random.RandomState(seed)
    x = (rng.randn(batches * BATCH, 4) * scale).astype("float32")
    y = rng.randn(batches * BATCH, 1).astype("float32")
    return x, y


def _weights_finite(model):
    return all(
        np.isfinite(ops.convert_to_numpy(ops.convert_to_tensor(v))).all()
        for v in model.weights
        if "float" in str(v.dtype)
    )


def _torch_grad_scaler(overflows, scale, growth_interval):
    """PyTorch GradScaler.update, written from its documented semantics.

    Returns (scale after each step, cumulative skipped steps after each).
    """
    tracker, skipped, scales, totals = 0, 0, [], []
    for overflow in overflows:
        if overflow:
            scale *= 0.5
            tracker = 0
            skipped += 1
        elif tracker + 1 == growth_interval:
            scale *= 2.0
            tracker = 0
        else:
            tracker += 1
        scales.append(scale)
        totals.append(skipped)
    return scales, totals


def _tensorboard_scalars(log_dir):
    """{tag: [values]} from the event files under log_dir/train."""
    tf = pytest.importorskip("tensorflow")
    scalars = {}
    for path in glob.glob(os.path.join(log_dir, "train", "events.out.*")):
        for record in tf.data.TFRecordDataset(path):
            event = tf.compat.v1.Event.FromString(record.numpy())
            for value in event.summary.value:
                if value.metadata.plugin_data.plugin_name != "scalars":
                    continue
                number = tf.make_ndarray(value.tensor)
                scalars.setdefault(value.tag, []).append(float(number))
    return scalars


# --------------------------------------------------------------------------
# LossScaleMonitor


@pytest.mark.parametrize("monitors_first", [True, False])
def test_loss_scale_reaches_history_csv_and_tensorboard(
    tmp_path, monitors_first, mixed_policy
):
    """3 epochs x 4 steps; batch 1 of every epoch overflows.

    The scale starts at 2 and doubles after every finite step (no natural
    overflow at scales <= 128 for this model), so the whole trajectory is
    known from PyTorch's GradScaler rule.
    """
    x, y = _data(4)
    x[1 * BATCH] = 1e5  # float16 input overflows: inf loss, skipped step
    optimizer = LossScaleOptimizer(
        keras.optimizers.SGD(0.01), initial_scale=2.0, dynamic_growth_steps=1
    )
    model = _softmax_model(optimizer)
    csv_path = tmp_path / "log.csv"
    log_dir = str(tmp_path / "tb")
    # TensorBoard's callback needs the `tensorboard` package (a dev extra).
    has_tensorboard = importlib.util.find_spec("tensorboard") is not None
    stock = [keras.callbacks.CSVLogger(str(csv_path))]
    if has_tensorboard:
        stock.append(keras.callbacks.TensorBoard(log_dir=log_dir))
    monitors = [LossScaleMonitor(), NonFiniteMonitor(locate=False)]
    probe = ScaleProbe()
    callbacks = monitors + stock if monitors_first else stock + monitors
    history = model.fit(
        x,
        y,
        batch_size=BATCH,
        epochs=3,
        shuffle=False,
        verbose=0,
        callbacks=callbacks + [probe],
    )

    scales, skipped = _torch_grad_scaler(
        [i % 4 == 1 for i in range(12)], scale=2.0, growth_interval=1
    )
    expected_scale = [scales[3], scales[7], scales[11]]
    expected_skipped = [skipped[3], skipped[7], skipped[11]]
    assert expected_scale == [8.0, 32.0, 128.0]  # the rule, spelled out
    assert expected_skipped == [1, 2, 3]
    assert history.history["loss_scale"] == expected_scale
    assert history.history["loss_scale"] == probe.scales
    assert history.history["skipped_steps"] == expected_skipped

    with open(csv_path) as f:
        rows = list(csv.DictReader(f))
    assert [float(r["loss_scale"]) for r in rows] == expected_scale
    assert [float(r["skipped_steps"]) for r in rows] == expected_skipped

    if has_tensorboard:
        tb = _tensorboard_scalars(log_dir)
        assert tb["epoch_loss_scale"] == expected_scale
        assert tb["epoch_skipped_steps"] == expected_skipped

    # Per-step trace of the monitor follows the same rule step by step.
    assert [s for _, s, _ in monitors[0].trace] == scales
    assert [k for _, _, k in monitors[0].trace] == skipped

    # Without monitors the logs carry the same keys (compile set them up).
    history = model.fit(x[:16], y[:16], batch_size=BATCH, verbose=0)
    assert set(history.history) == {"loss", "loss_scale", "skipped_steps"}
    if not has_tensorboard:
        pytest.skip("tensorboard is not installed: TensorBoard not checked")


def test_batch_logs_carry_the_scale_of_each_step(mixed_policy):
    x, y = _data(4)
    optimizer = LossScaleOptimizer(
        keras.optimizers.SGD(0.01), initial_scale=2.0, dynamic_growth_steps=1
    )
    model = _softmax_model(optimizer)
    seen = []
    recorder = keras.callbacks.LambdaCallback(
        on_train_batch_end=lambda b, logs: seen.append(dict(logs))
    )
    model.fit(
        x,
        y,
        batch_size=BATCH,
        verbose=0,
        shuffle=False,
        callbacks=[recorder, LossScaleMonitor()],
    )
    assert [logs["loss_scale"] for logs in seen] == [4.0, 8.0, 16.0, 32.0]
    assert [logs["skipped_steps"] for logs in seen] == [0, 0, 0, 0]


class TraceCounting(keras.Sequential):
    """Counts how often its train step is traced (Python runs at trace)."""

    traces = 0

    def train_step(self, *args):
        type(self).traces += 1
        return super().train_step(*args)


def test_monitors_trace_the_step_as_often_as_a_plain_fit(mixed_policy):
    x, y = _data(4)

    def traces(callbacks_per_fit):
        keras.utils.set_random_seed(0)
        TraceCounting.traces = 0
        model = TraceCounting([keras.Input((4,)), keras.layers.Dense(1)])
        model.compile(optimizer=_safe_scale_optimizer(), loss="mse")
        for callbacks in callbacks_per_fit:
            model.fit(x, y, batch_size=BATCH, verbose=0, callbacks=callbacks())
        return TraceCounting.traces, model

    plain, _ = traces([list] * 3)
    monitors = lambda: [LossScaleMonitor(), NonFiniteMonitor()]  # noqa: E731
    monitored, model = traces([monitors] * 3)
    assert plain >= 1
    assert monitored == plain
    # Plain fits after monitored ones reuse the traced step: the monitors
    # changed nothing in the model. (PyTorch runs the step's Python at every
    # step, traced or not: there the same train function serves every fit.)
    before = TraceCounting.traces
    function = model.train_function
    for _ in range(2):
        history = model.fit(x, y, batch_size=BATCH, verbose=0)
        assert "loss_scale" in history.history
    if keras.backend.backend() == "torch":
        assert model.train_function is function
        assert TraceCounting.traces == before + 2 * len(x) // BATCH
    else:
        assert TraceCounting.traces == before


def test_a_fit_aborted_by_another_callback_leaves_nothing_behind(mixed_policy):
    x, y = _data(6)
    model = _softmax_model(_safe_scale_optimizer())

    class Abort(keras.callbacks.Callback):
        def on_train_batch_end(self, batch, logs=None):
            if batch == 2:
                raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        model.fit(
            x,
            y,
            batch_size=BATCH,
            verbose=0,
            callbacks=[LossScaleMonitor(), Abort()],
        )
    # The next monitored fit starts clean and cleans up after itself.
    monitor = LossScaleMonitor()
    history = model.fit(x, y, batch_size=BATCH, verbose=0, callbacks=[monitor])
    assert history.history["loss_scale"] == [1024.0]
    assert [step for step, _, _ in monitor.trace] == list(range(6))
    assert model.fit(x, y, batch_size=BATCH, verbose=0).history[
        "loss_scale"
    ] == [1024.0]


def test_stock_keras_loss_scale_optimizer_is_named_in_one_warning():
    """Keras's own LossScaleOptimizer keeps no skip counters: the monitor
    says in one line that kerasmp's (same config) logs them."""
    keras.config.set_dtype_policy("mixed_float16")
    x, y = _data(6)
    optimizer = keras.optimizers.LossScaleOptimizer(
        keras.optimizers.SGD(0.01), initial_scale=8.0, dynamic_growth_steps=100
    )
    model = _softmax_model(optimizer)
    with pytest.warns(UserWarning) as record:
        history = model.fit(
            x,
            y,
            batch_size=BATCH,
            shuffle=False,
            verbose=0,
            callbacks=[LossScaleMonitor()],
        )
    # (PyTorch's Keras adds DeprecationWarnings of its own: not counted.)
    messages = [
        str(w.message) for w in record if issubclass(w.category, UserWarning)
    ]
    assert len(messages) == 1
    assert "kerasmp.LossScaleOptimizer(optimizer)" in messages[0]
    assert "\n" not in messages[0]
    assert "loss_scale" not in history.history  # stock Keras, stock logs


def test_no_loss_scale_logs_nothing_and_warns_once():
    x, y = _data(2)
    model = _softmax_model()  # float32, plain SGD
    monitor = LossScaleMonitor()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for _ in range(2):
            history = model.fit(
                x, y, batch_size=BATCH, verbose=0, callbacks=[monitor]
            )
            assert "loss_scale" not in history.history
    messages = [
        str(w.message) for w in caught if "loss scale" in str(w.message)
    ]
    assert len(messages) == 1 and "SGD" in messages[0]


# --------------------------------------------------------------------------
# NonFiniteMonitor


def _safe_scale_optimizer(learning_rate=0.05):
    """A scale low enough that this model's gradients never overflow it."""
    return LossScaleOptimizer(
        keras.optimizers.SGD(learning_rate), initial_scale=1024.0
    )


def _trouble_from_batch_20(batches=40):
    x, y = _data(batches)
    x[20 * BATCH :] *= 40  # |logits| ~ 100: exp overflows float16, not float32
    return x, y


def test_stuck_stops_within_patience_and_names_the_layer(mixed_policy):
    x, y = _trouble_from_batch_20()
    model = _softmax_model(_safe_scale_optimizer())
    monitor = NonFiniteMonitor(action="stop", patience=10)
    counter = StepCounter()
    with pytest.warns(NonFiniteWarning, match="stuck"):
        model.fit(
            x,
            y,
            batch_size=BATCH,
            epochs=1,
            shuffle=False,
            verbose=0,
            callbacks=[monitor, counter],
        )

    assert counter.steps == 30  # steps 20..29 are the 10 allowed
    stuck = [e for e in monitor.events if e["kind"] == "stuck"]
    assert len(stuck) == 1
    event = stuck[0]
    assert event["step"] == 29
    assert event["layer"] == "naive_softmax"
    assert event["action"] == "stop"
    assert event["consecutive_skips"] == 10
    assert "stuck" in event["message"] and "naive_softmax" in event["message"]
    # The stuck event carries the run's facts: the forward pass overflowed.
    assert event["loss_finite"] is False and event["overflow_in"] == "forward"
    assert "gradients still overflow" not in event["message"]
    for key in ("step", "epoch", "kind", "loss_scale", "layer"):
        assert key in event
    assert all(e["step"] >= 20 for e in monitor.events)
    # The first skip is an overflow of the forward pass, located too.
    first = monitor.events[0]
    assert first["step"] == 20 and first["kind"] == "overflow"
    assert first["layer"] == "naive_softmax"
    assert first["loss_finite"] is False
    assert _weights_finite(model)


def test_raise_carries_the_same_diagnosis(mixed_policy):
    x, y = _trouble_from_batch_20()
    model = _softmax_model(_safe_scale_optimizer())
    with pytest.raises(NonFiniteError) as info:
        model.fit(
            x,
            y,
            batch_size=BATCH,
            epochs=1,
            shuffle=False,
            verbose=0,
            callbacks=[
                NonFiniteMonitor(action="raise", patience=10),
                LossScaleMonitor(),
            ],
        )
    event = info.value.event
    assert event["kind"] == "stuck" and event["step"] == 29
    assert event["layer"] == "naive_softmax"
    assert "stuck" in str(info.value) and "naive_softmax" in str(info.value)
    assert info.value.report.layer == "naive_softmax"
    assert _weights_finite(model)
    # A plain fit after the raise works as before.
    history = model.fit(x[:16], y[:16], batch_size=BATCH, verbose=0)
    assert set(history.history) == {"loss", "loss_scale", "skipped_steps"}


def test_fallback_trains_to_the_float32_loss():
    """Every batch overflows the float16 naive softmax. With fallback the
    layer moves to float32 after `patience` skipped steps and training ends
    within 5% of the float32 model's loss (same data, same seed)."""
    x, y = _data(32, scale=10.0)
    y = (x[:, :1] > 0).astype("float32")

    reference = _softmax_model(keras.optimizers.SGD(0.1))
    ref_history = reference.fit(
        x, y, batch_size=BATCH, epochs=3, shuffle=False, verbose=0
    )

    set_global_policy(Policy("mixed_float16"))
    model = _softmax_model(_safe_scale_optimizer(0.1))
    monitor = NonFiniteMonitor(action="fallback", patience=2)
    history = model.fit(
        x,
        y,
        batch_size=BATCH,
        epochs=3,
        shuffle=False,
        verbose=0,
        callbacks=[monitor],
    )

    fallbacks = [e for e in monitor.events if e.get("fallback_layers")]
    assert len(fallbacks) == 1
    assert fallbacks[0]["kind"] == "stuck" and fallbacks[0]["step"] == 1
    assert fallbacks[0]["fallback_layers"] == ["naive_softmax"]
    assert monitor.fallbacks == ["naive_softmax"]
    assert model.get_layer("naive_softmax").compute_dtype == "float32"
    assert model.get_layer("proj").compute_dtype == "float16"
    assert len(monitor.events) == 2  # nothing after the fallback
    final, ref_final = (
        history.history["loss"][-1],
        ref_history.history["loss"][-1],
    )
    assert math.isfinite(final)
    assert abs(final - ref_final) <= 0.05 * ref_final
    assert _weights_finite(model)


def test_calibration_is_normal_and_not_warned(mixed_policy):
    """A scale starting at 2**24 overflows the first steps' gradients: each
    such step halves the scale until an update goes through."""
    x, y = _data(12)
    optimizer = LossScaleOptimizer(
        keras.optimizers.SGD(0.01), initial_scale=2.0**24
    )
    model = _softmax_model(optimizer)
    calibrated = 0
    while gradient_report(
        model,
        x[calibrated * BATCH : (calibrated + 1) * BATCH],
        y[calibrated * BATCH : (calibrated + 1) * BATCH],
        scales=[2.0**24 / 2**calibrated],
    ).rows[0].overflow:
        calibrated += 1
    monitor = NonFiniteMonitor(action="raise", patience=3)
    with warnings.catch_warnings():
        warnings.simplefilter("error", NonFiniteWarning)
        model.fit(
            x,
            y,
            batch_size=BATCH,
            shuffle=False,
            verbose=0,
            callbacks=[monitor],
        )
    calibration = [e for e in monitor.events if e["kind"] == "calibration"]
    # The reference: step k runs batch k at 2**24 / 2**k on the initial
    # weights (every calibration step is skipped), and calibration ends at
    # the first step gradient_report finds no overflow at. From 2**24 that
    # takes at least 7 halvings (|g| ~ 0.01..1 scaled under 65504).
    assert len(calibration) == calibrated >= 7
    assert [e["step"] for e in calibration] == list(range(len(calibration)))
    for i, e in enumerate(calibration):
        assert e["loss_scale"] == 2.0**24 / 2**i
        assert e["next_loss_scale"] == e["loss_scale"] / 2
        assert e["action"] is None and "Normal" in e["message"]
    # Later skips, if any, are ordinary overflows, after an applied step.
    later = monitor.events[len(calibration) :]
    assert all(e["kind"] == "overflow" for e in later)
    assert all(e["step"] > len(calibration) for e in later)


def test_isolated_overflow_after_calibration_is_recorded_not_acted_on(
        mixed_policy):
    x, y = _data(12)
    x[6 * BATCH] = 1e5
    model = _softmax_model(
        LossScaleOptimizer(keras.optimizers.SGD(0.01), initial_scale=256.0)
    )
    monitor = NonFiniteMonitor(action="raise", patience=2)
    model.fit(
        x, y, batch_size=BATCH, shuffle=False, verbose=0, callbacks=[monitor]
    )
    assert [(e["step"], e["kind"], e["action"]) for e in monitor.events] == [
        (6, "overflow", None)
    ]
    assert monitor.events[0]["loss_scale"] == 256.0
    assert monitor.events[0]["layer"] == "proj"  # first layer fed the inf


def test_nonfinite_loss_without_loss_scaling_stops_like_terminate_on_nan():
    """float32, no loss scale: a NaN input at batch 3 breaks the weights.
    Keras's TerminateOnNaN stops at the same step; the monitor also says
    where."""
    x, y = _data(8)
    x[3 * BATCH] = np.nan
    stock = _softmax_model(seed=2)
    stock_counter = StepCounter()
    stock.fit(
        x,
        y,
        batch_size=BATCH,
        shuffle=False,
        verbose=0,
        callbacks=[keras.callbacks.TerminateOnNaN(), stock_counter],
    )

    model = _softmax_model(seed=2)
    monitor = NonFiniteMonitor(action="stop")
    counter = StepCounter()
    with pytest.warns(NonFiniteWarning):
        model.fit(
            x,
            y,
            batch_size=BATCH,
            shuffle=False,
            verbose=0,
            callbacks=[monitor, counter],
        )
    assert counter.steps == stock_counter.steps == 4
    kinds = [(e["step"], e["kind"], e["action"]) for e in monitor.events]
    assert kinds == [
        (3, "nonfinite_loss", None),
        (3, "nonfinite_weights", "stop"),
    ]
    assert monitor.events[0]["layer"] == "proj"
    assert monitor.events[0]["weights_finite"] is False
    assert monitor.events[1]["variable"].endswith("kernel")


def test_log_file_is_json_lines(tmp_path, mixed_policy):
    path = tmp_path / "events.jsonl"
    x, y = _trouble_from_batch_20(24)
    model = _softmax_model(_safe_scale_optimizer())
    monitor = NonFiniteMonitor(action="warn", patience=3, log_file=path)
    with pytest.warns(NonFiniteWarning):
        model.fit(
            x,
            y,
            batch_size=BATCH,
            shuffle=False,
            verbose=0,
            callbacks=[monitor],
        )
    lines = path.read_text().splitlines()
    assert len(lines) == len(monitor.events) == 4
    def strict(constant):
        raise ValueError(f"not strict JSON: {constant}")

    records = [json.loads(line, parse_constant=strict) for line in lines]
    assert [r["kind"] for r in records] == [
        "overflow",
        "overflow",
        "stuck",
        "stuck",
    ]
    assert [r["step"] for r in records] == [20, 21, 22, 23]
    assert records[2]["action"] == "warn" and records[3]["action"] is None
    # The forward pass overflowed on the skipped steps; the logged loss
    # averages the applied steps only, so it stays finite.
    assert all(r["loss_finite"] is False for r in records)
    assert all(r["overflow_in"] == "forward" for r in records)
    assert all(math.isfinite(r["loss"]) for r in records)
    # Appends: a second monitor on the same file adds lines.
    NonFiniteMonitor(log_file=str(path))
    assert len(path.read_text().splitlines()) == 4


@pytest.mark.parametrize(
    "kwargs, name",
    [
        ({"action": "explode"}, "action"),
        ({"action": None}, "action"),
        ({"patience": 0}, "patience"),
        ({"patience": 2.5}, "patience"),
        ({"patience": True}, "patience"),
        ({"locate": "yes"}, "locate"),
        ({"log_file": 3}, "log_file"),
    ],
)
def test_bad_arguments_raise_at_construction(kwargs, name):
    with pytest.raises(ValueError, match=f"`{name}`"):
        NonFiniteMonitor(**kwargs)


def test_unwritable_log_file_raises_at_construction(tmp_path):
    with pytest.raises(ValueError, match="`log_file`.*not writable"):
        NonFiniteMonitor(log_file=tmp_path / "missing_dir" / "events.jsonl")
    with pytest.raises(ValueError, match="`log_file`.*not writable"):
        NonFiniteMonitor(log_file=tmp_path)  # a directory


# --------------------------------------------------------------------------
# plot_loss_scale


def _png_size(path):
    with open(path, "rb") as f:
        header = f.read(24)
    assert header[:8] == b"\x89PNG\r\n\x1a\n"
    return int.from_bytes(header[16:20], "big"), int.from_bytes(
        header[20:24], "big"
    )


def test_plot_loss_scale_from_every_source(tmp_path, mixed_policy):
    pytest.importorskip("matplotlib")
    from kerasmp.plotting import plot_loss_scale

    x, y = _trouble_from_batch_20(24)
    model = _softmax_model(_safe_scale_optimizer())
    events = tmp_path / "events.jsonl"
    lsm = LossScaleMonitor()
    nfm = NonFiniteMonitor(action="warn", patience=3, log_file=events)
    with pytest.warns(NonFiniteWarning):
        history = model.fit(
            x,
            y,
            batch_size=BATCH,
            epochs=2,
            shuffle=False,
            verbose=0,
            callbacks=[lsm, nfm],
        )

    for name, source in [
        ("history", history),
        ("lsm", lsm),
        ("nfm", nfm),
        ("jsonl", events),
    ]:
        out = tmp_path / f"{name}.png"
        figure = plot_loss_scale(source, out)
        assert _png_size(out) == (800, 400)
        ax = figure.axes[0]
        assert ax.get_yscale() == "log"
        line = ax.get_lines()[0]
        if name == "history":
            assert list(line.get_ydata()) == history.history["loss_scale"]
            assert list(line.get_xdata()) == [23, 47]
        if name in ("lsm", "nfm"):
            # The scale each step ran with: 1024 first, then each step's
            # successor; one point more than steps (the scale after the end).
            assert list(line.get_ydata()) == [1024.0] + [
                s for _, s, _ in lsm.trace
            ]
            assert list(line.get_xdata()) == list(range(49))
        labels = [t.get_text() for t in ax.get_legend().get_texts()]
        assert any(l.startswith("skipped steps") for l in labels)
        if name in ("nfm", "jsonl"):
            assert any(l.startswith("stuck") for l in labels)

    with pytest.raises(TypeError, match="source"):
        plot_loss_scale(42, tmp_path / "x.png")


_DATA_PARALLEL_SCRIPT = """
import json
import keras
import numpy as np
import kerasmp
from kerasmp.callbacks import LossScaleMonitor, NonFiniteMonitor

keras.distribution.set_distribution(keras.distribution.DataParallel())
kerasmp.set_global_policy("mixed_float16")
rng = np.random.default_rng(0)
x = rng.normal(size=(256, 8)).astype("float32")
y = (x.sum(axis=1) > 0).astype("int32")
model = keras.Sequential([keras.Input((8,)), keras.layers.Dense(16, "relu"),
                          keras.layers.Dense(2, activation="softmax")])
model.compile(kerasmp.LossScaleOptimizer(keras.optimizers.Adam(),
                                         initial_scale=2.0**10),
              "sparse_categorical_crossentropy")
history = model.fit(x, y, batch_size=64, epochs=2, verbose=0, callbacks=[
    LossScaleMonitor(), NonFiniteMonitor(locate=False)])
print(json.dumps({"devices": len(keras.distribution.list_devices()),
                  "loss_scale": history.history["loss_scale"],
                  "scale": model.optimizer.loss_scale}))
"""


@pytest.mark.skipif(keras.backend.backend() != "jax",
                    reason="keras.distribution.DataParallel is JAX's")
def test_monitors_under_jax_data_parallel(tmp_path):
    # The wrapped train step must be built before JAX's fit empties the
    # variables: under a distribution, building reads their shardings.
    import json
    import os
    import subprocess
    import sys

    env = {**os.environ, "KERAS_BACKEND": "jax",
           "XLA_FLAGS": "--xla_force_host_platform_device_count=2"}
    out = subprocess.run([sys.executable, "-c", _DATA_PARALLEL_SCRIPT],
                         capture_output=True, text=True, env=env, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    result = json.loads(out.stdout.strip().splitlines()[-1])
    assert result["devices"] == 2
    assert result["loss_scale"] == [1024.0, 1024.0]
    assert result["scale"] == 1024.0
