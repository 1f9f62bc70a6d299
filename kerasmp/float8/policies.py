"""The per-layer policies a float8 `kerasmp.Policy` gives: `Float8Assignment`
(the layer trains in float8) and `Float8Fallback` (moved off float8). Both
save and load like the other kerasmp policies (a stock Keras loads the file
too, with the same float8 layers)."""

import keras

from kerasmp._utils.marked import Marked
from kerasmp.float8.rule import base_name


@keras.saving.register_keras_serializable(package="kerasmp")
class Float8Assignment(
    Marked, keras.dtype_policies.QuantizedFloat8DTypePolicy
):
    """The policy of a layer that a float8 `kerasmp.Policy` trains in float8.

    It is Keras's `QuantizedFloat8DTypePolicy("float8", <base policy>)` (the
    layer computes in the base policy's dtype around float8 matmuls) that
    remembers which kerasmp policy and rule put the layer there.

    Args:
        policy: The float8 `kerasmp.Policy`.
        rule: Why the layer is float8 (a short text).
    """

    WHY = "rule"

    def __init__(self, policy, rule):
        super().__init__(
            "float8",
            source_name=base_name(policy.name),
            amax_history_length=policy.float8.amax_history_length,
        )
        self.policy = policy
        self.rule = rule

    def stock_policy(self):
        """The stock Keras policy a file saves for Keras without kerasmp."""
        return keras.dtype_policies.QuantizedFloat8DTypePolicy(
            "float8", source_name=base_name(self.policy.name),
            amax_history_length=self.amax_history_length,
        )


@keras.saving.register_keras_serializable(package="kerasmp")
class Float8Fallback(Marked, keras.DTypePolicy):
    """The policy of a layer moved off float8 (by `Float8Monitor`'s
    fallback, or by `fall_back`): it computes in the float8 policy's base
    policy (`mixed_bfloat16` or `mixed_float16`) and is never re-assigned.

    Args:
        policy: The float8 `kerasmp.Policy`.
        reason: Why the layer left float8 (a short text).
    """

    WHY = "reason"

    def __init__(self, policy, reason):
        super().__init__(base_name(policy.name))
        self.policy = policy
        self.reason = reason


POLICY_CLASSES = (Float8Assignment, Float8Fallback)
"""The policy classes this module adds (saved and loaded by kerasmp's hooks)."""
