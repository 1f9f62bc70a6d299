"""Float8Monitor (kerasmp/callbacks/float8.py): telemetry keys and values
against the variables Keras keeps and against hand computations on crafted
tensors, the logs (History, CSVLogger), steps_per_execution, jit_compile,
and an injected saturating layer detected and fallen back alone. Runs on
TensorFlow and JAX."""

import csv
import warnings

import keras
import numpy as np
import pytest
from _helpers import float8_test_policy
from _models import single_dense

import kerasmp
from kerasmp import _keras_internals as _ki
from kerasmp import float8
from kerasmp.callbacks import Float8Monitor
from kerasmp.float8 import telemetry as tm

pytestmark = pytest.mark.torch  # also in the PyTorch pass (conftest.py)


@keras.saving.register_keras_serializable(package="test_float8_monitor")
class Gain(keras.layers.Layer):
    """Multiplies by a non-trainable gain (the injected fault's knob)."""

    def build(self, input_shape):
        self.gain = self.add_weight(shape=(), initializer="ones",
                                    trainable=False, name="gain")

    def call(self, x):
        return x * keras.ops.cast(self.gain, x.dtype)


class Grow(keras.callbacks.Callback):
    """Multiplies the gain by `factor` before every step from `start` on.

    On JAX the running fit's state is synced first (a JAX fit's variables
    hold placeholders until then, and an assignment reaches the next step
    only through a synced state); Float8Monitor itself never syncs."""

    def __init__(self, layer, factor=4.0, start=0):
        super().__init__()
        self.layer, self.factor, self.start = layer, factor, start
        self.steps = 0

    def on_train_batch_begin(self, batch, logs=None):
        self.steps += 1
        if self.steps > self.start:
            _ki.jax_state_sync(self.model)
            self.layer.gain.assign(self.layer.gain * self.factor)


def _model():
    """first -> gain -> hot (32x32) -> ln -> cool (32x32) -> head."""
    inp = keras.Input((16,))
    x = keras.layers.Dense(32, name="first")(inp)
    x = Gain(name="gain")(x)
    x = keras.layers.Dense(32, name="hot")(x)
    x = keras.layers.LayerNormalization(name="ln")(x)
    x = keras.layers.Dense(32, name="cool")(x)
    out = keras.layers.Dense(4, name="head")(x)
    return keras.Model(inp, out)


def _data(n=64):
    rng = np.random.default_rng(0)
    return (rng.normal(size=(n, 16)).astype("float32"),
            rng.normal(size=(n, 4)).astype("float32"))


def _read(layer, tensor):
    scale = float(np.asarray(getattr(layer, f"{tensor}_scale")))
    history = np.asarray(getattr(layer, f"{tensor}_amax_history"))
    return scale, history


# ------------------------------------------------------------- arguments


def test_bad_arguments_fail_at_construction():
    for kwargs, match in [
        ({"every_n_steps": 0}, "every_n_steps"),
        ({"action": "explode"}, "'log', 'warn', 'fallback', 'stop'"),
        ({"saturation_threshold": 2}, "saturation_threshold"),
        ({"spike_ratio": 0.5}, "spike_ratio"),
        ({"warmup_steps": -1}, "warmup_steps"),
        ({"tensors": ("inputs", "weights")}, "'outputs_grad'"),
        ({"data": (1, 2, 3)}, "x or \\(x, y\\)"),
    ]:
        with pytest.raises(ValueError, match=match):
            Float8Monitor(**kwargs)


def test_no_batch_end_hook_keeps_keras_async_dispatch():
    # Keras dispatches batch-end callbacks asynchronously only when no
    # callback overrides them; the monitor reads at batch begin instead.
    for hook in ("on_train_batch_end", "on_batch_end"):
        assert getattr(Float8Monitor, hook) is getattr(
            keras.callbacks.Callback, hook), hook


# ---------------------------------------------------- values and the logs


@pytest.mark.parametrize("jit", [False, True])
def test_logged_values_are_the_variables_keras_keeps(
        tmp_path, jit, float8_policy):
    model = _model()
    model.compile("adam", "mse", jit_compile=jit)
    x, y = _data()
    monitor = Float8Monitor(every_n_steps=1)
    log = tmp_path / "log.csv"
    history = model.fit(x, y, batch_size=16, epochs=2, verbose=0,
                        callbacks=[monitor, keras.callbacks.CSVLogger(log)])
    assert [r["step"] for r in monitor.records] == list(range(1, 9))
    last = monitor.records[-1]
    for path in ("hot", "cool"):
        layer = model.get_layer(path)
        for tensor in tm.TENSORS:
            scale, h = _read(layer, tensor)
            key = f"float8/{path}/{tensor}_"
            assert last[key + "scale"] == pytest.approx(scale, rel=1e-6)
            assert last[key + "amax"] == pytest.approx(float(h[0]), rel=1e-6)
            assert last[key + "amax_history_max"] == pytest.approx(
                float(h.max()), rel=1e-6)
        # The kernel fractions are the kernel's, at the kernel scale.
        scale, _ = _read(layer, "kernel")
        kernel = np.asarray(layer.kernel)
        assert last[f"float8/{path}/kernel_saturation"] == pytest.approx(
            np.mean(np.abs(kernel / scale) > 448.0))
        assert "float8/hot/inputs_saturation" not in last  # no `data`
    # Epoch logs: History and CSVLogger get the values of each epoch's end.
    assert history.history["float8/hot/kernel_scale"][-1] == pytest.approx(
        last["float8/hot/kernel_scale"])
    with open(log) as f:
        rows = list(csv.DictReader(f))
    assert len(rows) == 2
    assert float(rows[-1]["float8/cool/inputs_amax"]) == pytest.approx(
        last["float8/cool/inputs_amax"], rel=1e-6)
    assert monitor.events == []


class _SyncWatch(keras.callbacks.Callback):
    """Records, after each step's other callbacks, whether a JAX fit's
    state is still unsynced (without syncing it: not `self.model`)."""

    def __init__(self):
        super().__init__()
        self.unsynced = []

    def on_train_batch_end(self, batch, logs=None):
        model = _ki.callback_model(self)
        self.unsynced.append(_ki.jax_unsynced_state(model) is not None)


@pytest.mark.parametrize("jit,spe", [(True, 1), (False, 2)])
def test_readings_inside_a_fit_are_the_current_values(jit, spe, float8_policy):
    """Readings taken inside the fit (on JAX from the trainer's running
    state, which the monitor leaves unsynced) equal a reading of the model
    after the fit, and the replayed inputs' saturation a hand count on the
    layer's input. The replayed batch is 8x the training data, so at the
    trained scales part of it saturates (at the initial scale of 1, none)."""
    keras.utils.set_random_seed(0)
    model = _model()
    model.compile("adam", "mse", jit_compile=jit, steps_per_execution=spe)
    x, y = _data()
    probe = (8 * x[:16], y[:16])
    monitor = Float8Monitor(every_n_steps=spe, data=probe, action="log")
    watch = _SyncWatch()
    model.fit(x, y, batch_size=8, epochs=1, verbose=0,
              callbacks=[monitor, watch])
    assert [r["step"] for r in monitor.records] == list(range(spe, 9, spe))
    if keras.backend.backend() == "jax":
        assert watch.unsynced and all(watch.unsynced)  # the monitor never
        # synced, so its readings came from the running state
    last = dict(monitor.records[-1])
    assert last.pop("step") == 8
    after = monitor.measure(steps=spe)
    assert set(after) == set(last)
    for key, value in last.items():
        assert value == pytest.approx(after[key], rel=1e-6, abs=1e-9), key
    # Hand count: the input of `hot` is `gain`'s output on the batch.
    layer = model.get_layer("hot")
    inputs = keras.Model(model.input, model.get_layer("gain").output)
    a = np.asarray(keras.ops.convert_to_numpy(
        inputs(probe[0], training=False)), "float32")
    scale = float(np.asarray(layer.inputs_scale))
    expected = np.mean(np.abs(a / scale) > 448.0)
    assert expected > 0.01  # the check below can tell scales apart
    assert last["float8/hot/inputs_saturation"] == pytest.approx(
        expected, abs=2 / a.size)
    assert 0 < last["float8/hot/outputs_grad_scale"] < 1  # trained, not 1


def test_every_n_steps_and_steps_per_execution(float8_policy):
    model = _model()
    model.compile("adam", "mse", steps_per_execution=4)
    x, y = _data()
    monitor = Float8Monitor(every_n_steps=2)
    model.fit(x, y, batch_size=8, epochs=2, verbose=0, callbacks=[monitor])
    # Keras calls batch callbacks once per execution of 4 steps.
    assert [r["step"] for r in monitor.records] == [4, 8, 12, 16]
    h = np.asarray(model.get_layer("hot").inputs_amax_history)
    assert (h > 0).sum() == 16  # every step left its amax


def test_crafted_saturation_and_underflow_match_a_hand_count():
    """One float8 Dense (identity kernel) fed crafted inputs and targets:
    every fraction is countable by hand."""
    kerasmp.set_global_policy(float8_test_policy(
        exclude_first=False, exclude_last=False, min_kernel_size=0))
    model = single_dense(8, 8, name="f8")
    model.compile("sgd", "mse")
    layer = model.get_layer("f8")
    assert layer.quantization_mode == "float8"
    layer.kernel.assign(np.eye(8, dtype="float32"))
    layer.bias.assign(np.zeros(8, "float32"))
    layer.inputs_scale.assign(1.0)
    layer.kernel_scale.assign(2.0 ** -9)  # 1 / 2**-9 = 512 > 448: saturates
    layer.outputs_grad_scale.assign(2.0 ** -10)
    # Inputs, powers of two (exact in bfloat16 and E4M3): 2 of 16 above 448
    # (512, -1024), 2 below 2**-10 (2**-11, -2**-12), 12 ordinary.
    x = np.array([[512, -1024, 2 ** -11, -(2 ** -12), 1, 2, 4, 8],
                  [1, 1, 1, 1, 1, 1, 1, 1]], "float32")
    # mse gradient wrt the outputs: 2 * (pred - y) / 16 = (pred - y) / 8.
    # Scale 2**-10: |g| / scale > 57344 = 1.75 * 2**15 needs |g| > 56;
    # below 2**-17 * 2**-10 = 2**-27 flushes.
    # The forward clips the inputs to +-448 and flushes the tiny ones; the
    # kernel's ones clip to 448 * 2**-9 = 0.875.
    pred = np.clip(x, -448, 448)
    pred[0, 2:4] = 0
    pred = 0.875 * pred
    d = np.array([[0, 0, 0, 0, 512, 2 ** -21, 0, 0],
                  [8, 8, 8, 8, 8, 8, 2 ** -24, -1024]], "float32")
    y = pred - d
    # The output gradients are d / 8: 64, 2**-24, 1, 2**-27, -128.
    monitor = Float8Monitor(data=(x, y))
    monitor.set_model(model)
    values = monitor.measure()
    key = "float8/f8/"
    assert values[key + "inputs_saturation"] == pytest.approx(2 / 16)
    assert values[key + "inputs_underflow"] == pytest.approx(2 / 16)
    # Kernel: eight ones at scale 2**-9 -> 512 > 448.
    assert values[key + "kernel_saturation"] == pytest.approx(8 / 64)
    assert values[key + "kernel_underflow"] == 0.0
    # Saturated: 64 and -128 (65536 and 131072 > 57344 after the scale).
    # Flushed: 2**-27 -> 2**-17, half of E5M2's smallest subnormal 2**-16,
    # rounds to even: 0. (2**-24 -> 2**-14 survives.)
    assert values[key + "outputs_grad_saturation"] == pytest.approx(2 / 16)
    assert values[key + "outputs_grad_underflow"] == pytest.approx(1 / 16)


# ------------------------------------------------------ events, fallback


@pytest.mark.parametrize("jit,spe", [(False, 1), (True, 2)])
def test_injected_saturating_layer_falls_back_alone(jit, spe, float8_policy):
    model = _model()
    model.compile("adam", "mse", jit_compile=jit, steps_per_execution=spe)
    x, y = _data()
    grow = Grow(model.get_layer("gain"), start=4)
    monitor = Float8Monitor(data=(x[:16], y[:16]), action="fallback",
                            every_n_steps=1,
                            warmup_steps=4)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        history = model.fit(x, y, batch_size=8, epochs=3, verbose=0,
                            callbacks=[grow, monitor])
    assert monitor.fallbacks == ["hot"]
    assert {e["layer"] for e in monitor.events} == {"hot"}
    event = monitor.events[0]
    assert event["tensor"] == "inputs"
    assert event["kind"] in ("saturation", "amax_spike")
    assert event["fallback"] == "mixed_bfloat16"
    assert "Moved 'hot' alone off float8" in event["message"]
    assert any("Moved 'hot' alone" in str(w.message) for w in caught)
    assert [p for p, _ in float8.float8_layers(model)] == ["cool"]
    assert model.get_layer("hot").quantization_mode is None
    assert len(history.history["loss"]) == 3  # the fit went on
    assert np.isfinite(history.history["loss"]).all()
    # After the fallback only the remaining layer is logged.
    assert "float8/hot/inputs_scale" not in monitor.records[-1]
    assert "float8/cool/inputs_scale" in monitor.records[-1]


def test_amax_ratio_sees_the_step_that_clipped(float8_policy):
    """Gain x4 per step: each step's amax is ~16x the amax (two steps
    back) its scale was computed from."""
    keras.utils.set_random_seed(0)
    model = _model()
    model.compile("sgd", "mse")
    x, y = _data()
    monitor = Float8Monitor(action="log", warmup_steps=0, every_n_steps=1,
                            tensors=("inputs",))
    model.fit(x, y, batch_size=8, epochs=1, verbose=0,
              callbacks=[Grow(model.get_layer("gain"), start=3), monitor])
    ratio = monitor.records[-1]["float8/hot/inputs_amax_ratio"]
    # Keras's history: h[0] is the last step's amax, h[-2] the amax two
    # steps back, the largest one the last step's scale was computed from.
    h = np.asarray(model.get_layer("hot").inputs_amax_history)
    assert ratio == pytest.approx(h[0] / h[-2], rel=1e-6)
    assert 8.0 < ratio < 32.0  # 16 times the batch-to-batch variation
    assert monitor.records[-1]["float8/cool/inputs_amax_ratio"] < 2.0
    kinds = {(e["layer"], e["kind"]) for e in monitor.events}
    assert ("hot", "amax_spike") in kinds
    assert all(layer == "hot" for layer, _ in kinds)


def test_action_stop_stops_training(float8_policy):
    model = _model()
    model.compile("adam", "mse")
    x, y = _data()
    monitor = Float8Monitor(action="stop", warmup_steps=2, every_n_steps=1)
    with pytest.warns(UserWarning, match="Training stops"):
        model.fit(x, y, batch_size=8, epochs=3, verbose=0,
                  callbacks=[Grow(model.get_layer("gain"), start=2), monitor])
    assert monitor.records[-1]["step"] < 24


# ------------------------------------------------------------ plot_float8


def test_plot_float8_draws_the_monitors_records(tmp_path, float8_policy):
    """Each plotted line is one layer's tensor statistic, point for point
    the monitor's records (and the History's epoch values); the fallback
    and its event are drawn where the monitor recorded them."""
    pytest.importorskip("matplotlib")
    from kerasmp.plotting import parse_key

    model = _model()
    model.compile("adam", "mse")
    x, y = _data()
    monitor = Float8Monitor(data=(x[:16], y[:16]), action="fallback",
                            every_n_steps=2, warmup_steps=4)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        history = model.fit(
            x, y, batch_size=8, epochs=2, verbose=0,
            callbacks=[Grow(model.get_layer("gain"), start=4), monitor])
    assert monitor.fallbacks == ["hot"]
    figure = kerasmp.plot_float8(monitor, tmp_path / "f8.png")
    assert (tmp_path / "f8.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    panels = [ax.get_ylabel() for ax in figure.axes]
    assert panels == ["scale", "amax", "saturation", "underflow"]
    assert figure.axes[0].get_yscale() == "log"
    assert figure.axes[2].get_yscale() == "linear"
    drawn = 0
    for ax in figure.axes:
        stat = ax.get_ylabel()
        for line in ax.get_lines():
            if not line.get_label() or line.get_label().startswith("_"):
                continue  # event markers and fallback lines
            layer, tensor = line.get_label().split(" ")
            key = f"float8/{layer}/{tensor}_{stat}"
            expected = [(r["step"], r[key]) for r in monitor.records
                        if key in r]
            assert list(zip(line.get_xdata(), line.get_ydata())) == expected
            drawn += 1
    # hot, cool x 3 tensors x 4 stats ("hot" stops at its fallback).
    assert drawn == 24
    # The fallback: a vertical line at the event's step on every panel.
    step = monitor.events[0]["step"]
    for ax in figure.axes:
        assert [list(l.get_xdata()) for l in ax.get_lines()
                if l.get_linestyle() == "--" and l.get_color() == "tab:green"
                ] == [[step, step]]
    # The History: one point per epoch, the epoch logs' values.
    figure = kerasmp.plot_float8(history, tmp_path / "h.png",
                                 layers="cool", tensors="kernel",
                                 stats=("scale",))
    (line,) = figure.axes[0].get_lines()
    assert list(line.get_ydata()) == history.history[
        "float8/cool/kernel_scale"]
    assert list(line.get_xdata()) == [1, 2]
    assert figure.axes[-1].get_xlabel() == "epoch"
    # Keys with nested paths and underscored tensors parse.
    assert parse_key("float8/enc/ffn/outputs_grad_amax_history_max") == (
        "enc/ffn", "outputs_grad", "amax_history_max")
    assert parse_key("loss") is None
    for kwargs, match in [({"layers": "nope"}, "'cool', 'hot'"),
                          ({"tensors": "weights"}, "'outputs_grad'"),
                          ({"stats": ("scale", "mean")}, "'underflow'")]:
        with pytest.raises(ValueError, match=match):
            kerasmp.plot_float8(monitor, tmp_path / "x.png", **kwargs)
    with pytest.raises(TypeError, match="Float8Monitor"):
        kerasmp.plot_float8(42, tmp_path / "x.png")


def test_replayed_output_gradients_carry_the_current_loss_scale():
    """Under float8_mixed_float16 the replayed output gradients are the
    loss gradient times the optimizer's loss scale, as in a training step:
    d mse / d pred = 2 (pred - y) / size, by hand; after a compile with a
    new optimizer (another scale) the replay follows the new scale."""
    from kerasmp.float8 import probe as _float8_probe

    kerasmp.set_global_policy(kerasmp.Policy(
        "float8_mixed_float16", float8=float8.Float8Rule(
            exclude_first=False, exclude_last=False, min_kernel_size=0)))
    model = single_dense(8, 8, name="f8")
    x, y = _data(16)
    x, y = x[:, :8], np.zeros((16, 8), "float32")
    for scale in (2.0 ** 4, 2.0 ** 10):
        model.compile(kerasmp.LossScaleOptimizer(
            keras.optimizers.SGD(), initial_scale=scale), "mse")
        layer = model.get_layer("f8")
        assert layer.quantization_mode == "float8"
        (row,) = _float8_probe.record(model, [layer], x, y)
        pred = np.asarray(keras.ops.convert_to_numpy(model(x)), "float32")
        expected = scale * 2 * (pred - y) / pred.size
        np.testing.assert_allclose(row["outputs_grad"], expected,
                                   rtol=2e-3, atol=1e-6 * scale)
