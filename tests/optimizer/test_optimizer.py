"""kerasmp.LossScaleOptimizer: construction, config and the update rules.

Every rule is checked against a reference written independently of the
implementation: hand-computed trajectories, a transcription of PyTorch's
`_amp_update_scale_` kernel and one of DeepSpeed's
`DynamicLossScaler.update_scale`. Runs on TensorFlow and JAX.
"""

import inspect
import json
import math

import keras
import numpy as np
import pytest
from _models import single_dense
from keras import ops

from kerasmp.optimizer import LossScaleOptimizer

pytestmark = pytest.mark.torch  # also in the PyTorch pass (conftest.py)

BACKEND = keras.backend.backend()
F32_MAX = float(np.finfo(np.float32).max)
F32_TINY = float(np.finfo(np.float32).tiny)  # smallest normal, 2**-126
# The largest and smallest values the constructor accepts, as its messages
# print them: shortest decimals that float32 reads back as its bounds.
LARGEST = 3.4028235e38  # float32 max; just above F32_MAX in float64
SMALLEST = 1.1754944e-38  # float32 tiny


# --------------------------------------------------------------- references


def pytorch_update(scale, tracker, found_inf, growth, backoff, interval):
    """PyTorch's GradScaler.update rule, transcribed from its CPU kernel
    `_amp_update_scale_cpu_` (aten/src/ATen/native/cpu/AmpGradScalerKernels):
    the scale is a float32 tensor, the factors are doubles."""
    if found_inf:
        return np.float32(np.float64(scale) * backoff), 0
    successful = tracker + 1
    if successful == interval:
        new_scale = np.float32(np.float64(scale) * growth)
        if np.isfinite(new_scale):
            scale = new_scale
        return scale, 0
    return scale, successful


class DeepSpeedScaler:
    """DeepSpeed's DynamicLossScaler.update_scale, transcribed
    (deepspeed/runtime/fp16/loss_scaler.py), raise_error_at_min_scale=False.
    """

    def __init__(self, init_scale, window, min_scale, delayed_shift, consec):
        self.cur_scale = init_scale
        self.cur_iter = 0
        self.last_overflow_iter = -1
        self.scale_factor = 2.0
        self.scale_window = window
        self.min_scale = min_scale
        self.delayed_shift = delayed_shift
        self.cur_hysteresis = delayed_shift
        self.consecutive_hysteresis = consec

    def update_scale(self, overflow):
        if overflow:
            if self.delayed_shift == 1 or self.cur_hysteresis == 1:
                self.cur_scale = max(
                    self.cur_scale / self.scale_factor, self.min_scale
                )
            else:
                self.cur_hysteresis -= 1
            self.last_overflow_iter = self.cur_iter
        else:
            if self.consecutive_hysteresis:
                self.cur_hysteresis = self.delayed_shift
            stable_interval = (self.cur_iter - self.last_overflow_iter) - 1
            if stable_interval > 0 and stable_interval % self.scale_window == 0:
                if not self.consecutive_hysteresis:
                    self.cur_hysteresis = self.delayed_shift
                self.cur_scale *= self.scale_factor
        self.cur_iter += 1


class MegatronScaler:
    """Megatron-LM's DynamicGradScaler.update, transcribed
    (megatron/core/optimizer/grad_scaler.py): float32 scale and factors."""

    def __init__(self, initial, min_scale, growth, backoff, interval, hyst):
        self.scale = np.float32(initial)
        self.min_scale = np.float32(min_scale)
        self.growth_factor = np.float32(growth)
        self.backoff_factor = np.float32(backoff)
        self.growth_interval = interval
        self.hysteresis = hyst
        self.growth_tracker = 0
        self.hysteresis_tracker = hyst

    def update(self, found_inf):
        if found_inf:
            self.growth_tracker = 0
            self.hysteresis_tracker -= 1
            if self.hysteresis_tracker <= 0:
                self.scale = max(
                    self.scale * self.backoff_factor, self.min_scale
                )
        else:
            self.growth_tracker += 1
            if self.growth_tracker == self.growth_interval:
                self.growth_tracker = 0
                self.hysteresis_tracker = self.hysteresis
                self.scale = self.scale * self.growth_factor


# ------------------------------------------------------------------ helpers


def _grad(value, shape=(4,)):
    return ops.convert_to_tensor(np.full(shape, value, dtype="float32"))


class Stepper:
    """Drives `optimizer.apply` one step at a time on one variable.

    TensorFlow: `apply` inside a `tf.function` (a compiled train step).
    JAX: `apply` outside `fit`, which runs the jitted stateless update.
    """

    def __init__(self, optimizer, initial=1.0, shape=(4,)):
        self.optimizer = optimizer
        self.var = keras.Variable(np.full(shape, initial, "float32"))
        self.shape = shape
        apply = lambda g: optimizer.apply([g], [self.var])  # noqa: E731
        if BACKEND == "tensorflow":
            import tensorflow as tf

            apply = tf.function(apply)
        self._apply = apply

    def step(self, finite, value=1.0):
        self._apply(_grad(value if finite else np.inf, self.shape))
        return self.state()

    def state(self):
        o = self.optimizer
        read = lambda v: ops.convert_to_numpy(v).item()  # noqa: E731
        return {
            "scale": o.loss_scale,
            "counter": read(o.step_counter),
            "budget": read(o.hysteresis_budget),
            "skipped": o.skipped_steps,
            "consecutive": read(o.consecutive_skipped_steps),
            "iterations": read(o.iterations),
        }


def _sgd(lr=1.0, **kwargs):
    return keras.optimizers.SGD(learning_rate=lr, **kwargs)


# ------------------------------------------------------------- construction


def test_constructor_signature_is_the_specified_one():
    params = inspect.signature(LossScaleOptimizer.__init__).parameters
    expected = {
        "inner_optimizer": inspect.Parameter.empty,
        "initial_scale": 2.0**15,
        "dynamic_growth_steps": 2000,
        "growth_factor": 2.0,
        "backoff_factor": 0.5,
        "hysteresis": 1,
        "consecutive_hysteresis": False,
        "min_scale": 1.0,
        "max_scale": 2.0**24,
        "dynamic": True,
        "name": None,
    }
    assert list(params)[1:-1] == list(expected)
    assert params["kwargs"].kind is inspect.Parameter.VAR_KEYWORD
    for name, default in expected.items():
        assert params[name].default == default, name


def test_is_a_stock_loss_scale_optimizer_and_compile_keeps_it():
    opt = LossScaleOptimizer(_sgd())
    assert isinstance(opt, keras.optimizers.LossScaleOptimizer)
    keras.config.set_dtype_policy("mixed_float16")
    model = single_dense(3, 1)
    model.compile(optimizer=opt, loss="mse")
    assert model.optimizer is opt  # not wrapped a second time
    model.compile(optimizer=opt, loss="mse")
    assert model.optimizer is opt


@pytest.mark.parametrize(
    "kwargs, argument, allowed",
    [
        ({"growth_factor": 1.0}, "growth_factor", "> 1"),
        ({"growth_factor": 0.5}, "growth_factor", "> 1"),
        ({"growth_factor": math.inf}, "growth_factor", "> 1"),
        ({"growth_factor": "2"}, "growth_factor", "a number > 1"),
        # Above 1 and finite in float64, not in float32 (the scale's dtype):
        # the scale would never grow.
        ({"growth_factor": 1.00000001}, "growth_factor", "1.0000001 to"),
        ({"growth_factor": 1e39}, "growth_factor", "to 3.4028235e+38"),
        ({"backoff_factor": 0.0}, "backoff_factor", "(0, 1)"),
        ({"backoff_factor": 1.0}, "backoff_factor", "(0, 1)"),
        ({"backoff_factor": -0.5}, "backoff_factor", "(0, 1)"),
        # Rounds to 1 in float32: never backs off, every step skipped.
        ({"backoff_factor": 0.99999999}, "backoff_factor", "0.99999994"),
        ({"backoff_factor": 1e-40}, "backoff_factor", "1.1754944e-38 to"),
        ({"dynamic_growth_steps": 0}, "dynamic_growth_steps", "from 1 to"),
        ({"dynamic_growth_steps": 1.5}, "dynamic_growth_steps", "integer"),
        ({"dynamic_growth_steps": 2**31}, "dynamic_growth_steps", "2147483647"),
        ({"dynamic_growth_steps": True}, "dynamic_growth_steps", "integer"),
        ({"hysteresis": 0}, "hysteresis", "from 1 to"),
        ({"hysteresis": np.bool_(True)}, "hysteresis", "integer"),
        ({"min_scale": 0.0}, "min_scale", "normal range"),
        ({"min_scale": -1.0}, "min_scale", "normal range"),
        # Subnormal or 0 in float32: the scale could underflow to 0.
        ({"min_scale": 1e-45}, "min_scale", "[1.1754944e-38, 3.4028235e+38]"),
        ({"min_scale": 1e-50}, "min_scale", "[1.1754944e-38, 3.4028235e+38]"),
        ({"min_scale": 1e39, "max_scale": None}, "min_scale", "normal range"),
        ({"max_scale": 0.5}, "max_scale", "from min_scale (1.0)"),
        (
            {"min_scale": 8.0, "max_scale": 4.0, "initial_scale": 4.0},
            "max_scale",
            "from min_scale (8.0)",
        ),
        ({"max_scale": 1e39}, "max_scale", "3.4028235e+38"),
        ({"max_scale": math.inf}, "max_scale", "3.4028235e+38"),
        ({"initial_scale": 0.5}, "initial_scale", "from min_scale (1.0)"),
        (
            {"initial_scale": 2.0**25},
            "initial_scale",
            "to max_scale (16777216.0)",
        ),
        (
            {"initial_scale": math.inf, "max_scale": None},
            "initial_scale",
            "3.4028235e+38 (max_scale is None)",
        ),
        # Finite in float64, inf in float32: every step would be skipped.
        (
            {"initial_scale": 1e39, "max_scale": None},
            "initial_scale",
            "3.4028235e+38 (max_scale is None)",
        ),
        ({"initial_scale": math.nan}, "initial_scale", "from min_scale"),
        # Explicitly out of range still raises (the default moves instead).
        (
            {"initial_scale": 2.0**15, "max_scale": 2.0**12},
            "initial_scale",
            "to max_scale (4096.0)",
        ),
        ({"dynamic": "False"}, "dynamic", "True or False"),
        ({"dynamic": None}, "dynamic", "True or False"),
        ({"dynamic": 0}, "dynamic", "True or False"),
        (
            {"consecutive_hysteresis": "false"},
            "consecutive_hysteresis",
            "True or False",
        ),
        (
            {"consecutive_hysteresis": 1},
            "consecutive_hysteresis",
            "True or False",
        ),
    ],
)
def test_bad_input_names_the_argument_and_range(kwargs, argument, allowed):
    with pytest.raises(ValueError) as info:
        LossScaleOptimizer(_sgd(), **kwargs)
    message = str(info.value)
    assert f"`{argument}`" in message
    assert allowed in message


def test_bad_inner_optimizer():
    with pytest.raises(ValueError, match="`inner_optimizer`.*Optimizer"):
        LossScaleOptimizer("sgd")
    with pytest.raises(ValueError, match="`inner_optimizer`.*not a Loss"):
        LossScaleOptimizer(LossScaleOptimizer(_sgd()))
    # Keras's own is unwrapped instead (tests/policy/test_stock_policy.py).
    inner = _sgd()
    assert LossScaleOptimizer(
        keras.optimizers.LossScaleOptimizer(inner)).inner_optimizer is inner


def test_edges_of_the_ranges_are_accepted():
    LossScaleOptimizer(_sgd(), initial_scale=1.0, max_scale=1.0)
    LossScaleOptimizer(_sgd(), initial_scale=2.0**30, max_scale=None)
    LossScaleOptimizer(_sgd(), dynamic_growth_steps=1, hysteresis=1)
    LossScaleOptimizer(
        _sgd(), dynamic_growth_steps=2**31 - 1, hysteresis=2**31 - 1
    )
    LossScaleOptimizer(_sgd(), growth_factor=1.0001, backoff_factor=0.9999)
    # float32's own edges, as the messages print them and exactly.
    for small, large in ((SMALLEST, LARGEST), (F32_TINY, F32_MAX)):
        LossScaleOptimizer(
            _sgd(), min_scale=small, initial_scale=small, max_scale=large
        )
        LossScaleOptimizer(_sgd(), initial_scale=large, max_scale=None)
        LossScaleOptimizer(_sgd(), growth_factor=large, backoff_factor=small)
    LossScaleOptimizer(_sgd(), growth_factor=1.0000001)
    LossScaleOptimizer(_sgd(), backoff_factor=0.99999994)


def test_messages_read_naturally():
    # The whole sentence, as a user reads it: no "must be not NaN, a finite
    # number", no "must be an integer, an integer >= 1".
    cases = [
        (
            {"hysteresis": 0},
            "`hysteresis` must be an integer from 1 to 2147483647; "
            "received hysteresis=0.",
        ),
        (
            {"dynamic_growth_steps": 2.5},
            "`dynamic_growth_steps` must be an integer from 1 to "
            "2147483647; received dynamic_growth_steps=2.5.",
        ),
        (
            {"initial_scale": math.nan},
            '`initial_scale` must be "auto" or a number from min_scale '
            "(1.0) to max_scale (16777216.0); received initial_scale=nan.",
        ),
        (
            {"dynamic": "False"},
            "`dynamic` must be True or False; received dynamic='False'.",
        ),
    ]
    for kwargs, message in cases:
        with pytest.raises(ValueError) as info:
            LossScaleOptimizer(_sgd(), **kwargs)
        assert str(info.value) == message


def test_default_initial_scale_moves_into_the_bounds():
    # The user never passed `initial_scale`: bounds that exclude the default
    # (2**15) move it to the nearest bound instead of raising about it.
    opt = LossScaleOptimizer(keras.optimizers.Adam(), max_scale=2**12)
    assert opt.initial_scale == 4096.0
    assert type(opt.initial_scale) is float
    assert opt.loss_scale == 4096.0
    opt = LossScaleOptimizer(_sgd(), min_scale=2.0**16, max_scale=None)
    assert opt.initial_scale == 2.0**16
    opt = LossScaleOptimizer(_sgd(), max_scale=2.0**20)
    assert opt.initial_scale == 2.0**15  # inside the bounds: unchanged
    # The moved default is what the variable starts at and what the config
    # carries; the config reloads as is.
    opt = LossScaleOptimizer(_sgd(), max_scale=100.0)
    Stepper(opt).step(True)
    assert opt.loss_scale == 100.0
    config = opt.get_config()
    assert config["initial_scale"] == 100.0
    assert LossScaleOptimizer.from_config(config).get_config() == config


@pytest.mark.parametrize("argument", ["dynamic", "consecutive_hysteresis"])
def test_numpy_bools_accepted_as_flags(argument):
    for value in (False, True, np.bool_(False), np.bool_(True)):
        opt = LossScaleOptimizer(_sgd(), **{argument: value})
        assert getattr(opt, argument) is bool(value)


def test_numpy_bool_false_makes_a_static_scale():
    opt = LossScaleOptimizer(_sgd(), initial_scale=8.0, dynamic=np.bool_(False))
    stepper = Stepper(opt)
    for _ in range(3):
        state = stepper.step(False)
    assert state["scale"] == 8.0 and state["skipped"] == 3


def test_numpy_numbers_accepted_like_python_numbers():
    kwargs = dict(
        initial_scale=np.float32(64.0),
        dynamic_growth_steps=np.int64(7),
        growth_factor=np.float64(4.0),
        backoff_factor=np.float16(0.25),
        hysteresis=np.uint8(3),
        consecutive_hysteresis=np.bool_(True),
        min_scale=np.float32(0.5),
        max_scale=np.int32(1024),
        dynamic=np.bool_(False),
        name="lso",
    )
    opt = LossScaleOptimizer(_sgd(0.3, momentum=0.5), **kwargs)
    config = opt.get_config()
    for key, value in ALL_ARGS.items():
        assert config[key] == value, key
        # Plain Python types: the config goes to JSON in `.keras` files.
        assert type(config[key]) is type(value), key
    restored = LossScaleOptimizer.from_config(json.loads(json.dumps(config)))
    assert restored.get_config() == config


def test_base_optimizer_arguments_still_rejected_like_stock():
    with pytest.raises(ValueError, match="on the `inner_optimizer`"):
        LossScaleOptimizer(_sgd(), clipnorm=1.0)
    with pytest.raises(ValueError, match="arguments: `foo`"):
        LossScaleOptimizer(_sgd(), foo=1)


# ------------------------------------------------------------------- config

ALL_ARGS = dict(
    initial_scale=64.0,
    dynamic_growth_steps=7,
    growth_factor=4.0,
    backoff_factor=0.25,
    hysteresis=3,
    consecutive_hysteresis=True,
    min_scale=0.5,
    max_scale=1024.0,
    dynamic=False,
    name="lso",
)


def test_get_config_carries_every_argument():
    opt = LossScaleOptimizer(_sgd(0.3, momentum=0.5), **ALL_ARGS)
    config = opt.get_config()
    for key, value in ALL_ARGS.items():
        assert config[key] == value, key
    params = set(inspect.signature(LossScaleOptimizer.__init__).parameters)
    assert params - {"self", "kwargs"} <= set(config)

    clone = LossScaleOptimizer.from_config(config)
    assert clone.get_config() == config
    assert isinstance(clone.inner_optimizer, keras.optimizers.SGD)
    assert clone.inner_optimizer.momentum == 0.5


def test_max_scale_none_round_trips():
    opt = LossScaleOptimizer(_sgd(), max_scale=None)
    assert LossScaleOptimizer.from_config(opt.get_config()).max_scale is None


def test_registered_and_deserializes_without_custom_objects():
    opt = LossScaleOptimizer(_sgd(), **ALL_ARGS)
    serialized = keras.saving.serialize_keras_object(opt)
    assert serialized["registered_name"] == "kerasmp>LossScaleOptimizer"
    restored = keras.saving.deserialize_keras_object(serialized)
    assert type(restored) is LossScaleOptimizer
    assert restored.get_config() == opt.get_config()


# Written by kerasmp before the float32 bounds and the strict flag checks
# (`keras.saving.serialize_keras_object` of an optimizer with ALL_ARGS but
# max_scale=None), as a `.keras` file stores it.
SAVED_BEFORE = """{"module": "kerasmp.optimizer", "class_name":
"LossScaleOptimizer", "config": {"name": "lso", "inner_optimizer": {"module":
"keras.optimizers", "class_name": "SGD", "config": {"name": "sgd",
"learning_rate": 0.25, "weight_decay": null, "clipnorm": null,
"global_clipnorm": null, "clipvalue": null, "use_ema": false, "ema_momentum":
0.99, "ema_overwrite_frequency": null, "loss_scale_factor": null,
"gradient_accumulation_steps": null, "momentum": 0.5, "nesterov": false},
"registered_name": null}, "initial_scale": 64.0, "dynamic_growth_steps": 7,
"growth_factor": 4.0, "backoff_factor": 0.25, "hysteresis": 3,
"consecutive_hysteresis": true, "min_scale": 0.5, "max_scale": null,
"dynamic": false}, "registered_name": "kerasmp>LossScaleOptimizer"}"""


def test_config_saved_by_the_previous_version_loads():
    saved = json.loads(SAVED_BEFORE)
    opt = keras.saving.deserialize_keras_object(saved)
    assert type(opt) is LossScaleOptimizer
    expected = dict(ALL_ARGS, max_scale=None)
    for key, value in expected.items():
        assert getattr(opt, key) == value, key
    assert opt.inner_optimizer.momentum == 0.5
    # And it saves back to the same config (on PyTorch, Keras serializes
    # its SGD under its torch module's name: compare the inner config).
    got = keras.saving.serialize_keras_object(opt)["config"]
    want = saved["config"]
    assert got["inner_optimizer"]["config"] == (
        want["inner_optimizer"]["config"])
    assert {k: v for k, v in got.items() if k != "inner_optimizer"} == {
        k: v for k, v in want.items() if k != "inner_optimizer"}
    if keras.backend.backend() != "torch":
        assert got == want


@pytest.mark.parametrize(
    "kwargs",
    [
        dict(min_scale=SMALLEST, initial_scale=SMALLEST, max_scale=LARGEST),
        dict(min_scale=F32_TINY, backoff_factor=F32_TINY, max_scale=None),
        dict(initial_scale=LARGEST, growth_factor=LARGEST, max_scale=None),
        dict(max_scale=2**12),  # the default initial_scale moved to 4096
    ],
)
def test_config_round_trips_at_the_float32_edges(kwargs):
    opt = LossScaleOptimizer(_sgd(), **kwargs)
    config = opt.get_config()
    restored = LossScaleOptimizer.from_config(json.loads(json.dumps(config)))
    assert restored.get_config() == config


def test_from_config_accepts_stock_configs():
    stock = keras.optimizers.LossScaleOptimizer(
        _sgd(0.5), initial_scale=8.0, dynamic_growth_steps=3, name="old"
    )
    config = stock.get_config()
    before = dict(config)
    opt = LossScaleOptimizer.from_config(config)
    assert config == before  # not modified
    assert (opt.name, opt.initial_scale, opt.dynamic_growth_steps) == (
        "old",
        8.0,
        3,
    )
    assert (opt.growth_factor, opt.backoff_factor, opt.hysteresis) == (
        2.0,
        0.5,
        1,
    )
    # Old stock configs also carried inert base-optimizer arguments.
    legacy = dict(config, weight_decay=None, clipnorm=None, use_ema=False)
    LossScaleOptimizer.from_config(legacy)


@pytest.mark.parametrize("initial", [2.0**30, 0.25, 2.0**-100])
def test_from_config_accepts_stock_configs_outside_the_default_bounds(initial):
    # Stock Keras has no floor or ceiling: its config may start above our
    # default max_scale (2**24) or below our default min_scale (1). The
    # default bound widens to hold it; the scale starts where stock's did.
    stock = keras.optimizers.LossScaleOptimizer(_sgd(), initial_scale=initial)
    opt = LossScaleOptimizer.from_config(stock.get_config())
    assert opt.initial_scale == initial
    assert opt.min_scale <= initial <= opt.max_scale
    stepper = Stepper(opt)
    assert stepper.step(False)["scale"] == max(initial / 2, opt.min_scale)
    # An explicit bound in the config is the user's: still enforced.
    config = dict(stock.get_config(), min_scale=1.0, max_scale=2.0**24)
    with pytest.raises(ValueError, match="`initial_scale`"):
        LossScaleOptimizer.from_config(config)


# -------------------------------------------------------------------- rules


def test_properties_before_and_after_build():
    opt = LossScaleOptimizer(_sgd(), initial_scale=16.0)
    assert opt.loss_scale == 16.0 and opt.skipped_steps == 0
    stepper = Stepper(opt)
    stepper.step(False)
    assert opt.loss_scale == 8.0 and opt.skipped_steps == 1
    assert isinstance(opt.loss_scale, float)
    assert isinstance(opt.skipped_steps, int)
    with pytest.raises(AttributeError):
        opt.loss_scale = 3.0
    with pytest.raises(AttributeError):
        opt.skipped_steps = 3


@pytest.mark.parametrize("name", ["dynamic_scale", "step_counter",
                                  "hysteresis_budget", "total_skipped_steps",
                                  "consecutive_skipped_steps"])
def test_state_variables_before_build_say_how_to_build(name):
    """The state variables (docs/loss_scaling.md) exist once the optimizer
    is built, as stock Keras's; read before, the AttributeError (so
    `hasattr` is still False) says how to build it and what to read
    meanwhile, where stock's says only that there is no such attribute."""
    opt = LossScaleOptimizer(_sgd(), initial_scale=16.0)
    assert not hasattr(opt, name)
    with pytest.raises(AttributeError) as raised:
        getattr(opt, name)
    text = str(raised.value)
    assert f"`{name}`" in text and "optimizer.build(" in text, text
    assert "optimizer.loss_scale` (16.0)" in text, text
    opt.build(single_dense(4, 1).trainable_variables)
    variable = getattr(opt, name)
    assert isinstance(variable, keras.Variable)
    assert any(v is variable for v in opt.variables)
    assert float(opt.dynamic_scale) == 16.0


def test_discarded_micro_steps_only_with_gradient_accumulation():
    opt = LossScaleOptimizer(_sgd())
    opt.build(single_dense(4, 1).trainable_variables)
    with pytest.raises(AttributeError, match="gradient_accumulation_steps"):
        opt.discarded_micro_steps
    opt = LossScaleOptimizer(_sgd(gradient_accumulation_steps=2))
    with pytest.raises(AttributeError, match=r"optimizer\.build\("):
        opt.discarded_micro_steps
    opt.build(single_dense(4, 1).trainable_variables)
    assert int(opt.discarded_micro_steps) == 0


def test_hand_computed_trajectory_with_hysteresis_and_bounds():
    opt = LossScaleOptimizer(
        _sgd(),
        initial_scale=8.0,
        dynamic_growth_steps=2,
        hysteresis=2,
        min_scale=2.0,
        max_scale=32.0,
    )
    stepper = Stepper(opt, initial=0.0)
    # (finite, scale, counter, budget, skipped, consecutive, iterations)
    # after each step, worked out by hand from the rules in the issue.
    expected = [
        (1, 8.0, 1, 2, 0, 0, 1),
        (1, 16.0, 0, 2, 0, 0, 2),  # 2 good steps: grow, budget full
        (0, 16.0, 0, 1, 1, 1, 2),  # overflow 1 of 2: budget spent, keep
        (0, 8.0, 0, 1, 2, 2, 2),  # overflow 2: back off
        (0, 4.0, 0, 1, 3, 3, 2),  # budget stays at 1: back off again
        (0, 2.0, 0, 1, 4, 4, 2),
        (0, 2.0, 0, 1, 5, 5, 2),  # floor: min_scale
        (1, 2.0, 1, 1, 5, 0, 3),  # good step: budget not refilled
        (0, 2.0, 0, 1, 6, 1, 3),  # counter reset, floor holds
        (1, 2.0, 1, 1, 6, 0, 4),
        (1, 4.0, 0, 2, 6, 0, 5),  # grow: budget refilled
        (1, 4.0, 1, 2, 6, 0, 6),
        (1, 8.0, 0, 2, 6, 0, 7),
        (1, 8.0, 1, 2, 6, 0, 8),
        (1, 16.0, 0, 2, 6, 0, 9),
        (1, 16.0, 1, 2, 6, 0, 10),
        (1, 32.0, 0, 2, 6, 0, 11),  # ceiling: max_scale
        (1, 32.0, 1, 2, 6, 0, 12),
        (1, 32.0, 0, 2, 6, 0, 13),  # growth event at the ceiling
        (0, 32.0, 0, 1, 7, 1, 13),
    ]
    keys = ("scale", "counter", "budget", "skipped", "consecutive")
    for i, (finite, *want) in enumerate(expected):
        # Gradients of the scaled loss are `scale` * 1, so each applied
        # step moves the weight by exactly -1 (SGD, learning rate 1).
        state = stepper.step(finite, value=opt.loss_scale)
        got = tuple(state[k] for k in keys + ("iterations",))
        assert got == tuple(want), f"step {i}"
        np.testing.assert_array_equal(
            ops.convert_to_numpy(stepper.var), -state["iterations"]
        )


def test_consecutive_hysteresis_refills_on_every_good_step():
    opt = LossScaleOptimizer(
        _sgd(),
        initial_scale=64.0,
        dynamic_growth_steps=100,
        hysteresis=3,
        consecutive_hysteresis=True,
    )
    stepper = Stepper(opt)
    expected = [  # (finite, scale, budget)
        (0, 64.0, 2),
        (0, 64.0, 1),
        (1, 64.0, 3),  # refilled without growing
        (0, 64.0, 2),
        (0, 64.0, 1),
        (0, 32.0, 1),  # third overflow in a row backs off
        (0, 16.0, 1),
        (1, 16.0, 3),
    ]
    for i, (finite, scale, budget) in enumerate(expected):
        state = stepper.step(finite)
        assert (state["scale"], state["budget"]) == (scale, budget), i


@pytest.mark.parametrize(
    "growth, backoff, interval",
    [
        (2.0, 0.5, 1),
        (2.0, 0.5, 3),
        (4.0, 0.25, 2),
        (2.0, 0.125, 5),
        (3.0, 0.75, 2),
    ],
)
def test_trajectory_equals_pytorch_grad_scaler(growth, backoff, interval):
    # Exact for factors that float32 represents exactly (PyTorch multiplies
    # the float32 scale by a double factor: the same single rounding).
    rng = np.random.default_rng(interval)
    pattern = rng.random(150) < 0.25  # True: this step overflows
    opt = LossScaleOptimizer(
        _sgd(),
        initial_scale=2.0**10,
        dynamic_growth_steps=interval,
        growth_factor=growth,
        backoff_factor=backoff,
        min_scale=2.0**-100,
        max_scale=None,
    )
    stepper = Stepper(opt)
    scale, tracker = np.float32(2.0**10), 0
    for i, found_inf in enumerate(pattern):
        scale, tracker = pytorch_update(
            scale, tracker, found_inf, growth, backoff, interval
        )
        assert scale > 2.0**-100  # the floor never binds here
        state = stepper.step(not found_inf)
        assert state["scale"] == float(scale), f"step {i}"
        assert state["counter"] == tracker, f"step {i}"


def test_trajectory_close_to_pytorch_for_inexact_factors():
    # 0.3 and 1.7 are not float32 numbers: PyTorch multiplies in double,
    # kerasmp in float32 (on every backend), so each multiply may round
    # differently by one unit in the last place. The counter is identical.
    pattern = np.random.default_rng(7).random(150) < 0.3
    opt = LossScaleOptimizer(
        _sgd(),
        initial_scale=2.0**10,
        dynamic_growth_steps=2,
        growth_factor=1.7,
        backoff_factor=0.3,
        min_scale=2.0**-100,
        max_scale=None,
    )
    stepper = Stepper(opt)
    scale, tracker = np.float32(2.0**10), 0
    for i, found_inf in enumerate(pattern):
        scale, tracker = pytorch_update(scale, tracker, found_inf, 1.7, 0.3, 2)
        state = stepper.step(not found_inf)
        np.testing.assert_allclose(state["scale"], scale, rtol=1e-5)
        assert state["counter"] == tracker, f"step {i}"


def test_pytorch_transcription_matches_torch_itself():
    torch = pytest.importorskip("torch")
    rng = np.random.default_rng(0)
    scale_t = torch.full((1,), 2.0**10, dtype=torch.float32)
    tracker_t = torch.zeros((1,), dtype=torch.int32)
    scale, tracker = np.float32(2.0**10), 0
    for found_inf in rng.random(200) < 0.3:
        found = torch.full((1,), float(found_inf))
        torch._amp_update_scale_(scale_t, tracker_t, found, 3.0, 0.3, 2)
        scale, tracker = pytorch_update(scale, tracker, found_inf, 3.0, 0.3, 2)
        assert scale_t.item() == float(scale)
        assert tracker_t.item() == tracker


@pytest.mark.parametrize("consecutive", [False, True])
@pytest.mark.parametrize("hysteresis", [1, 2, 3])
def test_hysteresis_equals_deepspeed(hysteresis, consecutive):
    # DeepSpeed's first growth comes one step later than PyTorch's (its
    # window counts from the step after an overflow), so the growth timing
    # is checked against PyTorch above and the hand trajectories; here the
    # window is longer than any run of good steps and hysteresis, backoff
    # and the floor are compared with DeepSpeed step for step.
    rng = np.random.default_rng(10 * hysteresis + consecutive)
    pattern = rng.random(200) < 0.6
    ref = DeepSpeedScaler(2.0**12, 10**6, 4.0, hysteresis, consecutive)
    opt = LossScaleOptimizer(
        _sgd(),
        initial_scale=2.0**12,
        dynamic_growth_steps=10**6,
        hysteresis=hysteresis,
        consecutive_hysteresis=consecutive,
        min_scale=4.0,
    )
    stepper = Stepper(opt)
    for i, overflow in enumerate(pattern):
        ref.update_scale(bool(overflow))
        state = stepper.step(not overflow)
        assert state["scale"] == ref.cur_scale, f"step {i}"
        if hysteresis > 1:
            assert state["budget"] == ref.cur_hysteresis, f"step {i}"
    assert ref.cur_scale == 4.0  # the floor was reached and held


@pytest.mark.parametrize("hysteresis", [1, 2, 4])
@pytest.mark.parametrize("growth, backoff", [(2.0, 0.5), (1.5, 0.3)])
def test_trajectory_equals_megatron(hysteresis, growth, backoff):
    # Megatron counts growth like PyTorch, refills the hysteresis budget on
    # growth (DeepSpeed's default), has a floor, multiplies in float32 (so
    # even inexact factors match bit for bit) but no ceiling: the run keeps
    # the scale finite.
    rng = np.random.default_rng(hysteresis)
    pattern = rng.random(200) < 0.35
    ref = MegatronScaler(2.0**10, 1.0, growth, backoff, 3, hysteresis)
    opt = LossScaleOptimizer(
        _sgd(),
        initial_scale=2.0**10,
        dynamic_growth_steps=3,
        growth_factor=growth,
        backoff_factor=backoff,
        hysteresis=hysteresis,
        min_scale=1.0,
        max_scale=None,
    )
    stepper = Stepper(opt)
    floor_hit = False
    for i, found_inf in enumerate(pattern):
        ref.update(bool(found_inf))
        state = stepper.step(not found_inf)
        assert state["scale"] == float(ref.scale), f"step {i}"
        assert state["counter"] == ref.growth_tracker, f"step {i}"
        assert state["budget"] == max(ref.hysteresis_tracker, 1), f"step {i}"
        floor_hit |= float(ref.scale) == 1.0
    assert floor_hit or hysteresis == 4


def test_hysteresis_refill_on_growth_equals_deepspeed():
    # Window aligned by hand: our growth after W good steps is DeepSpeed's
    # after W - 1 for the first growth following an overflow.
    pattern = [1, 1, 0, 0, 1, 1, 1, 0, 0, 0, 1, 1, 1, 0, 1, 1, 1, 0, 0]
    ref = DeepSpeedScaler(2.0**8, 2, 1.0, 2, False)
    opt = LossScaleOptimizer(
        _sgd(), initial_scale=2.0**8, dynamic_growth_steps=3, hysteresis=2
    )
    stepper = Stepper(opt)
    for i, overflow in enumerate(pattern):
        ref.update_scale(bool(overflow))
        state = stepper.step(not overflow)
        assert (state["scale"], state["budget"]) == (
            ref.cur_scale,
            ref.cur_hysteresis,
        ), f"step {i}"


def test_scale_floor_under_a_long_run_of_overflows():
    # Stock Keras reaches exactly 0 after ~150 overflows and then writes NaN
    # into every weight. Here the scale stops at min_scale.
    opt = LossScaleOptimizer(
        _sgd(0.1), initial_scale=2.0**15, min_scale=1.0, dynamic_growth_steps=5
    )
    stepper = Stepper(opt, initial=3.0)
    for _ in range(200):
        state = stepper.step(False)
        assert state["scale"] >= 1.0
        assert np.isfinite(ops.convert_to_numpy(stepper.var)).all()
    assert state["scale"] == 1.0
    assert state["skipped"] == 200 and state["consecutive"] == 200
    assert state["iterations"] == 0
    np.testing.assert_array_equal(ops.convert_to_numpy(stepper.var), 3.0)
    for i in range(10):  # training resumes
        state = stepper.step(True, value=opt.loss_scale)
        np.testing.assert_allclose(
            ops.convert_to_numpy(stepper.var), 3.0 - 0.1 * (i + 1), rtol=1e-6
        )
    assert state["scale"] == 4.0 and state["consecutive"] == 0


def test_scale_ceiling_never_inf():
    opt = LossScaleOptimizer(
        _sgd(), dynamic_growth_steps=1, max_scale=None, initial_scale=2.0**15
    )
    stepper = Stepper(opt)
    for _ in range(300):
        state = stepper.step(True, value=0.0)
        assert math.isfinite(state["scale"])
    assert state["scale"] == 2.0**127  # the largest finite power of two
    assert state["scale"] * 2 > F32_MAX


def test_scale_ceiling_odd_growth_factor():
    opt = LossScaleOptimizer(
        _sgd(),
        dynamic_growth_steps=1,
        max_scale=None,
        initial_scale=1.0,
        growth_factor=3.0,
    )
    stepper = Stepper(opt)
    expected = np.float32(1.0)
    while np.float64(expected) * 3.0 <= F32_MAX:
        expected = np.float32(np.float64(expected) * 3.0)
    for _ in range(120):
        state = stepper.step(True, value=0.0)
    assert state["scale"] == float(expected)


STRESS_STEPS = 10_000

# PyTorch has no compiled loop to run 10,000 steps in; the rule is the same
# keras.ops code, run 10,000 times on TensorFlow and JAX.
NOT_ON_TORCH = pytest.mark.skipif(
    keras.backend.backend() == "torch",
    reason="10,000 eager optimizer steps: the compiled loop is TF/JAX only",
)


def run_compiled(optimizer, variable, gradient, steps):
    """Runs `steps` optimizer steps in one compiled loop (fast enough for
    thousands of steps) and returns the scale and `variable[0]` after each
    step, as float64 arrays. `gradient(i, scale)` is step i's gradient of
    the scaled loss, given the current scale.

    TensorFlow: `optimizer.apply` in a `tf.function` loop. JAX:
    `optimizer.stateless_apply` (what `apply` runs) in a `fori_loop`.
    """
    optimizer.build([variable])
    if BACKEND == "tensorflow":
        import tensorflow as tf

        @tf.function
        def loop():
            scales = tf.TensorArray(tf.float32, size=steps)
            weights = tf.TensorArray(tf.float32, size=steps)
            for i in tf.range(steps):
                scale = tf.convert_to_tensor(optimizer.dynamic_scale)
                optimizer.apply([gradient(i, scale)], [variable])
                scales = scales.write(
                    i, tf.convert_to_tensor(optimizer.dynamic_scale)
                )
                weights = weights.write(i, variable[0])
            return scales.stack(), weights.stack()

        scales, weights = loop()
    else:
        import jax
        import jax.numpy as jnp

        k = [v is optimizer.dynamic_scale for v in optimizer.variables]
        k = k.index(True)

        def body(i, carry):
            opt_values, values, scales, weights = carry
            grad = gradient(i, opt_values[k])
            values, opt_values = optimizer.stateless_apply(
                opt_values, [grad], values
            )
            scales = scales.at[i].set(opt_values[k])
            weights = weights.at[i].set(values[0][0])
            return list(opt_values), list(values), scales, weights

        carry = (
            [v.value for v in optimizer.variables],
            [variable.value],
            jnp.zeros(steps, "float32"),
            jnp.zeros(steps, "float32"),
        )
        opt_values, values, scales, weights = jax.jit(
            lambda c: jax.lax.fori_loop(0, steps, body, c)
        )(carry)
        for v, value in zip(optimizer.variables, opt_values):
            v.assign(value)
        variable.assign(values[0])
    return (
        ops.convert_to_numpy(scales).astype("float64"),
        ops.convert_to_numpy(weights).astype("float64"),
    )


@NOT_ON_TORCH
@pytest.mark.parametrize("backoff_factor", [0.5, SMALLEST])
def test_smallest_min_scale_survives_10000_overflows(backoff_factor):
    # The smallest accepted floor, reached over and over (with the smallest
    # accepted backoff factor the product underflows to 0 every time), with
    # one good step in 100 (growth after every good step). Reference: the
    # rule in numpy float32, which gives the same values whether or not
    # subnormals flush to 0. The good steps move the weight by exactly -lr
    # (the gradient of the scaled loss is `scale * 1`, unscaled back to 1),
    # where a scale of 0 would write inf.
    lr = 2.0**-4
    opt = LossScaleOptimizer(
        _sgd(lr),
        initial_scale=1.0,
        min_scale=SMALLEST,
        backoff_factor=backoff_factor,
        dynamic_growth_steps=1,
    )
    variable = keras.Variable(np.ones((1,), "float32"))
    good = np.arange(STRESS_STEPS) % 100 == 50

    def gradient(i, scale):
        finite = ops.equal(i % 100, 50)
        return ops.reshape(ops.where(finite, scale, np.inf), (1,))

    scales, weights = run_compiled(opt, variable, gradient, STRESS_STEPS)

    expected = []
    scale = np.float32(1.0)
    with np.errstate(under="ignore"):
        for finite in good:
            if finite:
                scale = scale * np.float32(2.0)
            else:
                scale = max(
                    scale * np.float32(backoff_factor), np.float32(F32_TINY)
                )
            expected.append(float(scale))
    np.testing.assert_array_equal(scales, expected)
    assert scales.min() == F32_TINY and np.isfinite(scales).all()
    np.testing.assert_array_equal(weights, 1.0 - lr * np.cumsum(good))
    assert opt.skipped_steps == STRESS_STEPS - good.sum()
    assert opt.loss_scale == F32_TINY


@NOT_ON_TORCH
@pytest.mark.parametrize(
    "growth_factor, max_scale", [(2.0, None), (LARGEST, LARGEST)]
)
def test_largest_scale_survives_10000_growth_steps(growth_factor, max_scale):
    # The largest accepted scale, asked to grow on every step (by 2, or by
    # the largest accepted factor, with and without a ceiling): it stays at
    # the largest finite float32, and every step applies a gradient that
    # unscales to exactly 2**-4 (`F32_MAX * 2**-4` is exact).
    opt = LossScaleOptimizer(
        _sgd(1.0),
        initial_scale=LARGEST,
        growth_factor=growth_factor,
        max_scale=max_scale,
        dynamic_growth_steps=1,
    )
    variable = keras.Variable(np.ones((1,), "float32"))

    def gradient(i, scale):
        return ops.reshape(scale * 2.0**-4, (1,))

    scales, weights = run_compiled(opt, variable, gradient, STRESS_STEPS)
    np.testing.assert_array_equal(scales, F32_MAX)
    steps = np.arange(1, STRESS_STEPS + 1)
    np.testing.assert_array_equal(weights, 1.0 - 2.0**-4 * steps)
    assert opt.skipped_steps == 0
    assert ops.convert_to_numpy(opt.iterations) == STRESS_STEPS


def test_max_scale_binds():
    opt = LossScaleOptimizer(
        _sgd(), dynamic_growth_steps=1, max_scale=2.0**20, initial_scale=2.0**15
    )
    stepper = Stepper(opt)
    scales = [stepper.step(True, value=0.0)["scale"] for _ in range(10)]
    assert scales == [2.0**k for k in (16, 17, 18, 19, 20)] + [2.0**20] * 5


def test_static_scale_skips_and_counts():
    opt = LossScaleOptimizer(
        _sgd(), initial_scale=128.0, dynamic=False, dynamic_growth_steps=1
    )
    stepper = Stepper(opt, initial=0.0)
    for i, finite in enumerate([1, 0, 0, 1, 1, 1, 0, 1]):
        state = stepper.step(finite, value=128.0)
        assert state["scale"] == 128.0
    assert state["skipped"] == 3 and state["iterations"] == 5
    np.testing.assert_array_equal(ops.convert_to_numpy(stepper.var), -5.0)
    assert opt.scale_loss(1.0) == 128.0


def test_skipped_step_leaves_weights_slots_and_iterations_untouched():
    opt = LossScaleOptimizer(keras.optimizers.Adam(0.1), initial_scale=4.0)
    stepper = Stepper(opt, initial=1.0)
    stepper.step(True, value=3.0)
    before = [ops.convert_to_numpy(v) for v in opt.inner_optimizer.variables]
    weights = ops.convert_to_numpy(stepper.var)
    for bad in (np.inf, -np.inf, np.nan):
        stepper._apply(_grad(bad))
    after = [ops.convert_to_numpy(v) for v in opt.inner_optimizer.variables]
    for b, a in zip(before, after):
        np.testing.assert_array_equal(a, b)
    np.testing.assert_array_equal(ops.convert_to_numpy(stepper.var), weights)
    assert stepper.state()["iterations"] == 1
    assert opt.skipped_steps == 3 and opt.loss_scale == 1.0  # 4 -> 2 -> 1


def test_one_non_finite_element_among_many_variables_skips():
    opt = LossScaleOptimizer(_sgd(), initial_scale=2.0)
    a = keras.Variable(np.zeros((3, 3), "float32"))
    b = keras.Variable(np.zeros((5,), "float32"))
    good = np.ones((3, 3), "float32")
    bad = np.ones((5,), "float32")
    bad[3] = np.nan
    opt.apply([ops.convert_to_tensor(good), ops.convert_to_tensor(bad)], [a, b])
    np.testing.assert_array_equal(ops.convert_to_numpy(a), 0.0)
    assert opt.skipped_steps == 1 and opt.loss_scale == 1.0


def test_state_variables_are_optimizer_variables():
    opt = LossScaleOptimizer(_sgd())
    Stepper(opt).step(True)
    names = [v.name for v in opt.variables]
    for name in (
        "step_counter",
        "dynamic_scale",
        "hysteresis_budget",
        "skipped_steps",
        "consecutive_skipped_steps",
    ):
        assert name in names
    # The stock optimizer's variables come first, in the stock order.
    stock = keras.optimizers.LossScaleOptimizer(_sgd())
    stock.build([keras.Variable(np.zeros(4, "float32"))])
    assert names[: len(stock._variables)] == [v.name for v in stock._variables]


# ------------------------------------------ Keras's own LossScaleOptimizer
# tests (keras/src/optimizers/loss_scale_optimizer_test.py), ported: with
# the stock settings kerasmp behaves as the stock does where it is correct.


def _apply(optimizer, grads, variables, stateless):
    if stateless:
        if not optimizer.built:
            optimizer.build(variables)
        new_vars, new_opt = optimizer.stateless_apply(
            [v.value for v in optimizer.variables],
            grads,
            [v.value for v in variables],
        )
        for ref, value in zip(optimizer.variables, new_opt):
            ref.assign(value)
        for ref, value in zip(variables, new_vars):
            ref.assign(value)
    else:
        optimizer.apply(grads, variables)


STATELESS = [False] + ([True] if BACKEND == "jax" else [])


@pytest.mark.parametrize("stateless", STATELESS)
def test_keras_finite_step(stateless):
    opt = LossScaleOptimizer(_sgd(0.5))
    grads = [ops.array([1.0, 6.0, 7.0, 2.0]) * opt.initial_scale]
    variables = [keras.Variable([1.0, 2.0, 3.0, 4.0])]
    _apply(opt, grads, variables, stateless)
    np.testing.assert_allclose(
        ops.convert_to_numpy(variables[0]), [0.5, -1.0, -0.5, 3.0], atol=1e-4
    )


@pytest.mark.parametrize("stateless", STATELESS)
def test_keras_finite_step_with_inner_loss_scale(stateless):
    opt = LossScaleOptimizer(_sgd(0.5, loss_scale_factor=100))
    grads = [ops.array([1.0, 6.0, 7.0, 2.0]) * opt.initial_scale]
    variables = [keras.Variable([1.0, 2.0, 3.0, 4.0])]
    _apply(opt, grads, variables, stateless)
    np.testing.assert_allclose(
        ops.convert_to_numpy(variables[0]), [0.5, -1.0, -0.5, 3.0], atol=1e-4
    )


def test_keras_apply_with_no_vars():
    opt = LossScaleOptimizer(_sgd(0.5))
    grads = [ops.array([1.0, 6.0, 7.0, 2.0]) * opt.initial_scale]
    variables = [keras.Variable([1.0, 2.0, 3.0, 4.0])]
    opt.build(variables)
    opt.apply(grads)
    np.testing.assert_allclose(
        ops.convert_to_numpy(variables[0]), [0.5, -1.0, -0.5, 3.0], atol=1e-4
    )


@pytest.mark.parametrize("stateless", STATELESS)
def test_keras_infinite_step(stateless):
    opt = LossScaleOptimizer(_sgd(0.5))
    variables = [keras.Variable([1.0, 2.0, 3.0, 4.0])]
    _apply(opt, [ops.array([np.inf] * 4)], variables, stateless)
    np.testing.assert_array_equal(
        ops.convert_to_numpy(variables[0]), [1.0, 2.0, 3.0, 4.0]
    )


@pytest.mark.parametrize("stateless", STATELESS)
def test_keras_finite_step_with_overwrite(stateless):
    opt = LossScaleOptimizer(_sgd(0.5))
    grads = [ops.array([1.0, 6.0, 7.0, 2.0])]
    variables = [keras.Variable([1.0, 2.0, 3.0, 4.0])]
    variables[0].overwrite_with_gradient = True
    _apply(opt, grads, variables, stateless)
    np.testing.assert_allclose(
        ops.convert_to_numpy(variables[0]), ops.convert_to_numpy(grads[0])
    )


@pytest.mark.parametrize("stateless", STATELESS)
def test_keras_downscaling(stateless):
    opt = LossScaleOptimizer(_sgd(0.5), initial_scale=400.0)
    variables = [keras.Variable([1.0, 2.0, 3.0, 4.0])]
    for _ in range(4):
        _apply(opt, [ops.array([np.inf] * 4)], variables, stateless)
    np.testing.assert_allclose(ops.convert_to_numpy(opt.scale_loss(1.0)), 25.0)


@pytest.mark.parametrize("stateless", STATELESS)
def test_keras_upscaling(stateless):
    opt = LossScaleOptimizer(
        _sgd(0.5), initial_scale=2.0, dynamic_growth_steps=2
    )
    variables = [keras.Variable([1.0, 2.0, 3.0, 4.0])]
    for _ in range(8):
        _apply(opt, [ops.array([1.0, 6.0, 7.0, 2.0])], variables, stateless)
    np.testing.assert_allclose(ops.convert_to_numpy(opt.scale_loss(1.0)), 32.0)


@pytest.mark.parametrize("stateless", STATELESS)
def test_keras_iterations_update(stateless):
    opt = LossScaleOptimizer(_sgd(0.5))
    variables = [keras.Variable([1.0, 2.0, 3.0, 4.0])]
    opt.build(variables)
    assert ops.convert_to_numpy(opt.iterations) == 0
    for i in range(3):
        _apply(opt, [ops.array([1.0, 6.0, 7.0, 2.0])], variables, stateless)
        assert ops.convert_to_numpy(opt.iterations) == i + 1


def test_same_trajectory_and_weights_as_stock_where_stock_is_correct():
    # Stock settings, bounds never binding: scale and weights identical to
    # the stock optimizer's, bit for bit.
    rng = np.random.default_rng(3)
    pattern = rng.random(60) < 0.2
    grads = rng.normal(size=(60, 4)).astype("float32")
    ours = LossScaleOptimizer(
        keras.optimizers.Adam(0.01),
        initial_scale=2.0**8,
        dynamic_growth_steps=4,
    )
    stock = keras.optimizers.LossScaleOptimizer(
        keras.optimizers.Adam(0.01),
        initial_scale=2.0**8,
        dynamic_growth_steps=4,
    )
    v_ours = keras.Variable(np.ones(4, "float32"))
    v_stock = keras.Variable(np.ones(4, "float32"))
    stateless = BACKEND == "jax"  # stock fails outside fit on JAX
    for i, overflow in enumerate(pattern):
        g = grads[i] * (np.inf if overflow else ours.loss_scale)
        _apply(ours, [ops.convert_to_tensor(g)], [v_ours], stateless)
        _apply(stock, [ops.convert_to_tensor(g)], [v_stock], stateless)
        assert ours.loss_scale == float(
            ops.convert_to_numpy(stock.dynamic_scale)
        )
        np.testing.assert_array_equal(
            ops.convert_to_numpy(v_ours), ops.convert_to_numpy(v_stock)
        )


# ------------------------------------------------ initial_scale="auto"


def test_auto_scale_is_picked_by_the_first_applied_step():
    # Starts at 1; the first step's largest gradient is 3 (unscaled at
    # scale 1), so the scale becomes the largest power of two keeping it
    # 8 times below 65504: 65504 / 24 = 2729.3 -> 2048. The step itself is
    # applied (SGD lr=1: 1 - 3 = -2 on that element).
    opt = LossScaleOptimizer(_sgd(), initial_scale="auto")
    assert opt.loss_scale == 1.0
    stepper = Stepper(opt)
    state = stepper.step(True, value=3.0)
    assert state["scale"] == 2048.0 and state["skipped"] == 0
    np.testing.assert_allclose(ops.convert_to_numpy(stepper.var), -2.0)
    # Later steps follow the ordinary rule (no second calibration).
    state = stepper.step(True, value=2048.0 * 100.0)
    assert state["scale"] == 2048.0 and state["iterations"] == 2


def test_auto_scale_skips_an_overflow_then_calibrates_on_the_next_step():
    opt = LossScaleOptimizer(_sgd(), initial_scale="auto", min_scale=1.0)
    stepper = Stepper(opt)
    state = stepper.step(False)
    assert state["skipped"] == 1 and state["scale"] == 1.0
    # Gradients at scale 1 of 0.5: 65504 / 4 = 16376 -> 8192.
    state = stepper.step(True, value=0.5)
    assert state["scale"] == 8192.0 and state["iterations"] == 1


def test_auto_scale_keeps_to_the_bounds_and_saves_as_auto():
    opt = LossScaleOptimizer(_sgd(), initial_scale="auto", max_scale=512.0)
    assert Stepper(opt).step(True, value=1e-3)["scale"] == 512.0
    config = opt.get_config()
    assert config["initial_scale"] == "auto"
    restored = LossScaleOptimizer.from_config(config)
    assert restored.auto and restored.loss_scale == 1.0
    with pytest.raises(ValueError, match='"auto" or a number'):
        LossScaleOptimizer(_sgd(), initial_scale="automatic")


def test_keras_unscale_hook_unscales_the_kerasmp_way():
    # Keras 3.16's stock apply unscales through this method (3.15 has no
    # such method and the call below is kerasmp's own); kerasmp's divides
    # each gradient by the scale in its own dtype, where stock Keras's
    # division turns a float16 gradient into float32. A gradient that
    # overwrites its variable (float8 scaling factors) is left as is.
    from kerasmp import _keras_internals as ki

    v = keras.Variable(np.ones(3, "float32"))
    w = keras.Variable(np.ones(3, "float32"))
    w.overwrite_with_gradient = True
    opt = LossScaleOptimizer(keras.optimizers.SGD(), initial_scale=8.0)
    opt.build([v, w])
    g = np.array([8.0, -24.0, 0.5], "float16")
    out = getattr(opt, ki.UNSCALE_GRADS_ATTR)(
        [ops.convert_to_tensor(g), ops.convert_to_tensor(g), None],
        [v, w, v])
    assert ops.dtype(out[0]) == "float16"
    np.testing.assert_array_equal(ops.convert_to_numpy(out[0]), g / 8)
    np.testing.assert_array_equal(ops.convert_to_numpy(out[1]), g)
    assert out[2] is None
