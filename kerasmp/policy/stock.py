"""The warnings for a user who follows the TensorFlow mixed-precision guide.

The guide's first step is `keras.mixed_precision.set_global_policy(
"mixed_float16")`. With kerasmp imported, that line sets Keras's own policy:
softmax and normalization layers stay float16, `compile` adds Keras's own
loss scaling (only for that exact name), and nothing says kerasmp is not in
play. `warn_if_stock_mixed_policy(model)`, called by kerasmp's `compile`
patch (`kerasmp._patches._compile`), says so once per process, naming the line
to change.
"""

import warnings

import keras

from kerasmp._utils.warn import user_stacklevel
from kerasmp.errors import StockOptimizerWarning
from kerasmp.errors import StockPolicyWarning

_MIXED = ("mixed_float16", "mixed_bfloat16")
_warned = set()  # which of the warnings were shown


def stock_mixed_policy(model):
    """The name of the stock mixed policy in force for `model`, or None.

    None when the global policy is not a mixed one, is a `kerasmp.Policy`,
    or when the model itself was built under a kerasmp policy.
    """
    from kerasmp.policy.policy import Policy
    from kerasmp.policy.policy import stored_policy

    policy = keras.config.dtype_policy()
    if isinstance(policy, Policy) or policy.name not in _MIXED:
        return None
    if isinstance(stored_policy(model), Policy):
        return None
    return policy.name


def warn_if_stock_mixed_policy(model):
    """Warns once per process (`StockPolicyWarning`) when `compile` runs
    under a stock mixed global policy; the warning points at the caller of
    `compile`."""
    if "policy" in _warned:
        return
    name = stock_mixed_policy(model)
    if name is None:
        return
    _warned.add("policy")
    warnings.warn(
        f"kerasmp: the global dtype policy is Keras's own {name!r} (set by "
        f"keras.mixed_precision.set_global_policy({name!r}) or "
        "keras.config.set_dtype_policy), not a kerasmp.Policy, so kerasmp's "
        "rules are not applied: softmax and normalization layers compute in "
        f"{name[len('mixed_'):]} and the optimizer is Keras's own. Change "
        f"that line to kerasmp.set_global_policy({name!r}), before building "
        "the model. (This warning is shown once.)",
        StockPolicyWarning,
        stacklevel=user_stacklevel(),
    )


def say_stock_optimizer_replaced():
    """Warns once per process (`StockOptimizerWarning`) that `compile` put
    `kerasmp.LossScaleOptimizer` in place of Keras's own; the warning
    points at the caller of `compile`."""
    if "optimizer" in _warned:
        return
    _warned.add("optimizer")
    warnings.warn(
        "kerasmp: compile uses kerasmp.LossScaleOptimizer in place of "
        "keras.optimizers.LossScaleOptimizer (same inner optimizer and "
        "settings), so that the loss scale stays bounded and skipped steps "
        "are undone. Pass kerasmp.LossScaleOptimizer(...) to compile to "
        "avoid this message. (This warning is shown once.)",
        StockOptimizerWarning,
        stacklevel=user_stacklevel(),
    )
