"""What `compile` decides for a model, from one walk of its layers.

`plan(model)` lists the model's layers once and returns a `Plan`: the
kerasmp policy governing the model, the float8 rule's decisions, and whether
a trainable layer computes in float16 (so the optimizer needs loss
scaling). kerasmp's compile patch (`kerasmp._patches`) builds it once and
everything it decides reads it: the float8 assignment, the loss-scale
optimizer, and the precision settings every worker of a multi-worker job
must share (`kerasmp.policy.workers`).
"""

import dataclasses

from kerasmp import _keras_internals as _ki
from kerasmp._utils.layers import walk
from kerasmp.float8.layers import decide
from kerasmp.float8.policies import POLICY_CLASSES
from kerasmp.policy.policy import Policy
from kerasmp.policy.policy import stored_policy


@dataclasses.dataclass(frozen=True)
class Plan:
    """The precision plan of one model.

    Attributes:
        policy: The `kerasmp.Policy` governing the model (its own, or its
            first governed layer's), or None when no kerasmp policy governs
            any layer: the model then compiles as in stock Keras.
        dtype_policy: The name of the model's own dtype policy.
        float8: The float8 rule's `Decision`s (`kerasmp.float8.decide`),
            one per layer a float8 policy governs.
        float16_training: Whether a trainable layer a kerasmp policy
            governs computes in float16 and owns trainable variables (its
            sublayers' variables count for the sublayers); before `build` a
            layer's variables are unknown, so an unbuilt trainable float16
            layer with no sublayers counts.
    """

    policy: object
    dtype_policy: str
    float8: tuple
    float16_training: bool

    @property
    def governed(self):
        """Whether a kerasmp policy governs the model."""
        return self.policy is not None

    @property
    def needs_loss_scaling(self):
        """Whether `compile` gives the model kerasmp's loss scaling."""
        return self.float16_training


def _governing(layer):
    """The kerasmp `Policy` that governs `layer`, or None: its stored
    policy, or the policy behind a per-layer float8 policy."""
    stored = stored_policy(layer)
    if isinstance(stored, POLICY_CLASSES):
        stored = stored.policy
    return stored if isinstance(stored, Policy) else None


def _trains_in_float16(layer):
    if layer.compute_dtype != "float16" or not layer.trainable:
        return False
    if layer.built:
        return _ki.has_own_trainable_variables(layer)
    return not _ki.direct_sublayers(layer)


def plan(model):
    """The `Plan` of `model`, from one walk of its layers.

    Args:
        model: A `keras.Model`.

    Example:

    >>> kerasmp.set_global_policy("mixed_float16")
    >>> model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(2)])
    >>> kerasmp.policy.plan.plan(model).needs_loss_scaling
    True
    >>> kerasmp.set_global_policy("float32")
    """
    layers = list(walk(model))
    governed = [
        layer for layer in [model] + [l for _, l in layers]
        if _governing(layer) is not None
    ]
    return Plan(
        policy=_governing(governed[0]) if governed else None,
        dtype_policy=model.dtype_policy.name,
        float8=tuple(decide(model, layers)) if governed else (),
        float16_training=any(_trains_in_float16(l) for l in governed),
    )
