"""The checks of `LossScaleOptimizer`'s arguments, at construction.

Every argument is checked against what the state can hold (a float32 scale,
int32 counters): a bad value raises a `ValueError` naming the argument and
its allowed values. Python and NumPy numbers, integers and bools are
accepted alike.
"""

import math
import numbers

import keras
import numpy as np

from kerasmp._utils.arrays import to_numpy


class _DefaultScale(float):
    """The default `initial_scale` (2**15), told apart from an explicit
    2**15 by identity: it moves into `[min_scale, max_scale]` when those
    bounds exclude it, where an explicit value raises."""


class _DefaultSteps(int):
    """The default `dynamic_growth_steps` (2000), told apart from an
    explicit 2000 by identity (a stock optimizer's own interval is kept
    unless one is given)."""


DEFAULT_GROWTH_STEPS = _DefaultSteps(2000)
DEFAULT_INITIAL_SCALE = _DefaultScale(2.0**15)
AUTO = "auto"
DEFAULT_MIN_SCALE = 1.0
DEFAULT_MAX_SCALE = 2.0**24

# What the float32 scale variable can hold, and the int32 counters.
_F32 = np.finfo(np.float32)
_F32_TINY = float(_F32.tiny)  # the smallest normal float32, 2**-126
_F32_MAX = float(_F32.max)
_INT32_MAX = int(np.iinfo(np.int32).max)
# The bounds as messages print them: the shortest decimals that float32
# reads back as the bound itself (3.4028235e+38 is just above `_F32_MAX` in
# float64, and rounds to it).
_TINY_TEXT = f"{_F32.tiny:.8g}"  # 1.1754944e-38
_MAX_TEXT = f"{_F32.max:.8g}"  # 3.4028235e+38
_ABOVE_ONE_TEXT = f"{np.nextafter(np.float32(1), 2):.8g}"  # 1.0000001
_BELOW_ONE_TEXT = f"{np.nextafter(np.float32(1), 0):.8g}"  # 0.99999994


def _as_float32(value):
    """`value` rounded to float32, as the scale's ops round it (inf beyond
    float32's range, even for an int too large for a float64)."""
    try:
        value = float(value)
    except OverflowError:
        value = math.inf if value > 0 else -math.inf
    with np.errstate(over="ignore", under="ignore"):
        return np.float32(value)


def _fail(name, value, allowed):
    raise ValueError(f"`{name}` must be {allowed}; received {name}={value!r}.")


def _check_number(name, value, in_range, allowed):
    """Raises a ValueError naming `name` unless `value` is a real number
    (not a bool, not NaN) for which `in_range(value)` holds. `allowed` is
    the complete description of the allowed values, for the message."""
    if (
        isinstance(value, (bool, np.bool_))
        or not isinstance(value, numbers.Real)
        or math.isnan(_as_float32(value))
        or not in_range(value)
    ):
        _fail(name, value, allowed)


def _check_integer(name, value, low):
    """Python and NumPy integers in `[low, int32 max]` (the counters are
    int32); bools are not integers here."""
    if (
        isinstance(value, (bool, np.bool_))
        or not isinstance(value, numbers.Integral)
        or not low <= value <= _INT32_MAX
    ):
        _fail(name, value, f"an integer from {low} to {_INT32_MAX}")


def _check_bool(name, value):
    if not isinstance(value, (bool, np.bool_)):
        _fail(name, value, "True or False")


def validate(
    inner_optimizer,
    *,
    initial_scale,
    dynamic_growth_steps,
    growth_factor,
    backoff_factor,
    hysteresis,
    consecutive_hysteresis,
    min_scale,
    max_scale,
    dynamic,
):
    """Checks every argument against what the state can hold (a float32
    scale, int32 counters) and returns the `initial_scale` to use."""
    if isinstance(inner_optimizer, keras.optimizers.LossScaleOptimizer):
        raise ValueError(
            "`inner_optimizer` must be a plain Keras optimizer, not a "
            "LossScaleOptimizer (loss scaling would be applied twice); "
            f"received {inner_optimizer!r}."
        )
    if not isinstance(inner_optimizer, keras.optimizers.Optimizer):
        raise ValueError(
            "`inner_optimizer` must be a `keras.optimizers.Optimizer` "
            f"instance; received {inner_optimizer!r}."
        )
    # The factors are applied in float32: one that rounds to 1 there would
    # never grow (or never back off: every later step skipped), one that
    # rounds to inf or 0 would be meaningless.
    _check_number(
        "growth_factor",
        growth_factor,
        lambda v: 1 < _as_float32(v) <= _F32_MAX,
        "a number > 1 that stays above 1 and finite in float32 (the "
        f"scale's dtype): from {_ABOVE_ONE_TEXT} to {_MAX_TEXT}",
    )
    _check_number(
        "backoff_factor",
        backoff_factor,
        lambda v: _F32_TINY <= _as_float32(v) < 1,
        "a number in the open interval (0, 1) that float32 (the scale's "
        f"dtype) holds as a normal number below 1: from {_TINY_TEXT} to "
        f"{_BELOW_ONE_TEXT}",
    )
    _check_integer("dynamic_growth_steps", dynamic_growth_steps, 1)
    _check_integer("hysteresis", hysteresis, 1)
    _check_bool("consecutive_hysteresis", consecutive_hysteresis)
    _check_bool("dynamic", dynamic)
    # A floor below the smallest normal float32 lets the scale underflow to
    # 0 (subnormals flush to 0 on most CPUs and GPUs), and a gradient
    # divided by 0 is inf.
    _check_number(
        "min_scale",
        min_scale,
        lambda v: _F32_TINY <= _as_float32(v) <= _F32_MAX,
        f"a number in float32's normal range [{_TINY_TEXT}, {_MAX_TEXT}] "
        "(the scale is a float32; a smaller floor lets it underflow to 0)",
    )
    if max_scale is not None:
        _check_number(
            "max_scale",
            max_scale,
            lambda v: v >= min_scale and _as_float32(v) <= _F32_MAX,
            f"None or a number from min_scale ({min_scale!r}) to the "
            f"largest finite float32, {_MAX_TEXT}",
        )
    if initial_scale is DEFAULT_INITIAL_SCALE or initial_scale == AUTO:
        # Bounds that exclude the default move it rather than raise about
        # an argument the user never passed; "auto" starts at 1 (its first
        # step sets the scale).
        default = 1.0 if initial_scale == AUTO else float(initial_scale)
        if max_scale is not None:
            default = min(default, max_scale)
        return float(max(default, min_scale))

    def in_range(v):
        if max_scale is None:
            return min_scale <= v and _as_float32(v) <= _F32_MAX
        return min_scale <= v <= max_scale

    upper = (
        f"the largest finite float32, {_MAX_TEXT} (max_scale is None)"
        if max_scale is None
        else f"max_scale ({max_scale!r})"
    )
    _check_number(
        "initial_scale",
        initial_scale,
        in_range,
        f'"auto" or a number from min_scale ({min_scale!r}) to {upper}',
    )
    return float(initial_scale)


SETTINGS = ("auto", "initial_scale", "dynamic_growth_steps",
             "growth_factor", "backoff_factor", "hysteresis",
             "consecutive_hysteresis", "min_scale", "max_scale", "dynamic")


def resolve(
    inner_optimizer,
    stock,
    *,
    initial_scale,
    dynamic_growth_steps,
    growth_factor,
    backoff_factor,
    hysteresis,
    consecutive_hysteresis,
    min_scale,
    max_scale,
    dynamic,
    name,
):
    """`LossScaleOptimizer`'s arguments, checked and resolved:
    `(inner_optimizer, {attribute: value}, name)`; with `stock` (the
    optimizer is Keras's own LossScaleOptimizer) its inner optimizer, scale
    and interval, unless given."""
    if stock:
        stock = inner_optimizer
        inner_optimizer = stock.inner_optimizer
        if initial_scale is DEFAULT_INITIAL_SCALE:
            initial_scale = current_scale(stock)
        if dynamic_growth_steps is DEFAULT_GROWTH_STEPS:
            dynamic_growth_steps = stock.dynamic_growth_steps
        name = stock.name if name is None else name
    auto = isinstance(initial_scale, str) and initial_scale == AUTO
    initial_scale = validate(
        inner_optimizer,
        initial_scale=initial_scale,
        dynamic_growth_steps=dynamic_growth_steps,
        growth_factor=growth_factor,
        backoff_factor=backoff_factor,
        hysteresis=hysteresis,
        consecutive_hysteresis=consecutive_hysteresis,
        min_scale=min_scale,
        max_scale=max_scale,
        dynamic=dynamic,
    )
    settings = {
        "auto": auto,
        "initial_scale": initial_scale,
        "dynamic_growth_steps": int(dynamic_growth_steps),
        "growth_factor": float(growth_factor),
        "backoff_factor": float(backoff_factor),
        "hysteresis": int(hysteresis),
        "consecutive_hysteresis": bool(consecutive_hysteresis),
        "min_scale": float(min_scale),
        "max_scale": None if max_scale is None else float(max_scale),
        "dynamic": bool(dynamic),
    }
    return inner_optimizer, settings, name


def current_scale(optimizer):
    """A stock LossScaleOptimizer's scale: its current one once built."""
    scale = getattr(optimizer, "dynamic_scale", None)
    if scale is None:
        return float(optimizer.initial_scale)
    return float(to_numpy(scale))
