"""What `compile` decides about a model's precision.

`needs_loss_scaling(model)`: whether a kerasmp policy makes trainable layers
of the model compute in float16, so that `compile` wraps the optimizer in
`kerasmp.LossScaleOptimizer`.
"""

from kerasmp import _keras_internals as _ki
from kerasmp.policy.policy import Policy
from kerasmp.policy.policy import stored_policy


def governed_layers(model):
    """Layers of `model` (itself included) whose policy is a kerasmp one."""
    layers = [model] + _ki.sublayers(model)
    return [
        l
        for l in layers
        if isinstance(stored_policy(l), Policy)
    ]


def needs_loss_scaling(model):
    """Whether a kerasmp policy makes trainable layers of `model` float16.

    A layer counts when it is trainable, computes in float16 and owns
    trainable variables (its sublayers' variables count for the sublayers).
    Before `build` a layer's variables are unknown, so an unbuilt trainable
    float16 layer with no sublayers counts.
    """
    for layer in governed_layers(model):
        if layer.compute_dtype != "float16" or not layer.trainable:
            continue
        if layer.built:
            if _ki.has_own_trainable_variables(layer):
                return True
        elif not _ki.sublayers(layer):
            return True
    return False
