"""The three places where kerasmp changes how Keras behaves.

All are installed once, when `kerasmp.policy` is imported, and all do
nothing for layers and models that no `kerasmp.Policy` governs, so code that
does not use kerasmp policies sees stock Keras.

1. Policy resolution. `keras.layers.Layer._dtype_policy` becomes a data
   descriptor. Keras keeps writing the layer's policy to it as before (it is
   stored in the instance `__dict__`); reading it returns
   `policy.policy_for(layer)` when the stored policy is a `kerasmp.Policy`,
   and the stored policy unchanged otherwise. Every Keras code path that asks
   a layer for its compute or variable dtype goes through this read, so one
   rule covers `dtype=None` layers, layers handed a parent's policy (the
   `Softmax` inside `MultiHeadAttention`), and attributes set after
   `Layer.__init__` (an `Activation` layer's activation).

2. Loss scaling at compile time. Stock `Model.compile` wraps the optimizer in
   a loss-scale optimizer only when the model's policy is *named*
   `"mixed_float16"`. When a model has layers governed by a `kerasmp.Policy`,
   kerasmp decides instead: if any trainable layer computes in float16, a
   plain optimizer is wrapped once in `kerasmp.LossScaleOptimizer`; an
   optimizer that already is a `keras.optimizers.LossScaleOptimizer` is kept;
   bfloat16 and float32 models get no loss scaling. `compile(...,
   auto_scale_loss=False)` turns it off, as in stock Keras.

3. Loading. Stock `Operation.from_config` deserializes a layer's `dtype`
   config and then, for backward compatibility, passes only the policy's
   *name* to the constructor, which would turn a saved `kerasmp.Policy` into
   a plain `DTypePolicy` without its float32 rules. For kerasmp's policy
   classes, kerasmp passes the policy object itself, and makes the layer's
   kerasmp policy global while its constructor runs (as it was when the
   layer was first built), so sublayers that a custom layer creates in
   `__init__` with `dtype=None` get it too. A model saved under a kerasmp
   policy reloads with the same per-layer dtypes and reasons.
"""

import functools
import inspect

import keras
from keras.src import dtype_policies as _dtype_policies
from keras.src.ops import operation as _operation
from keras.src.trainers import trainer as _trainer

_installed = False
_policy_cls = None  # kerasmp.Policy
_saved_classes = ()  # kerasmp policy classes that loading must keep


class _ResolvedDTypePolicy:
    """Data descriptor installed as `keras.layers.Layer._dtype_policy`."""

    def __get__(self, layer, owner=None):
        if layer is None:
            return self
        try:
            stored = layer.__dict__["_dtype_policy"]
        except KeyError:
            raise AttributeError("_dtype_policy") from None
        if isinstance(stored, _policy_cls):
            return stored.policy_for(layer)
        return stored

    def __set__(self, layer, value):
        layer.__dict__["_dtype_policy"] = value


def stored_policy(layer):
    """Returns the policy Keras stored on `layer`, before resolution."""
    return layer.__dict__.get("_dtype_policy")


def _governed_layers(model):
    """Layers of `model` (itself included) whose policy is a kerasmp one."""
    layers = [model] + list(model._flatten_layers(include_self=False))
    return [l for l in layers if isinstance(stored_policy(l), _policy_cls)]


def needs_loss_scaling(model):
    """Whether a kerasmp policy makes trainable layers of `model` float16.

    A layer counts when it is trainable, computes in float16 and owns
    trainable variables (its sublayers' variables count for the sublayers).
    Before `build` a layer's variables are unknown, so an unbuilt trainable
    float16 layer with no sublayers counts.
    """
    for layer in _governed_layers(model):
        if layer.compute_dtype != "float16" or not layer.trainable:
            continue
        if layer.built:
            if layer._trainable_variables:
                return True
        elif not list(layer._flatten_layers(include_self=False)):
            return True
    return False


_original_compile = _trainer.Trainer.compile
_compile_signature = inspect.signature(_original_compile)


@functools.wraps(_original_compile)
def _compile(self, *args, **kwargs):
    if not _governed_layers(self):
        return _original_compile(self, *args, **kwargs)
    bound = _compile_signature.bind(self, *args, **kwargs)
    bound.apply_defaults()
    arguments = bound.arguments
    if arguments["auto_scale_loss"] and needs_loss_scaling(self):
        optimizer = keras.optimizers.get(arguments["optimizer"])
        if optimizer is not None and not isinstance(
            optimizer, keras.optimizers.LossScaleOptimizer
        ):
            from kerasmp.optimizer import LossScaleOptimizer

            optimizer = LossScaleOptimizer(
                optimizer, name="loss_scale_optimizer"
            )
        arguments["optimizer"] = optimizer
    # kerasmp has decided; keep stock Keras's name-based rule out of it.
    arguments["auto_scale_loss"] = False
    return _original_compile(*bound.args, **bound.kwargs)


_original_from_config = _operation.Operation.from_config.__func__


@functools.wraps(_original_from_config)
def _from_config(cls, config):
    dtype = config.get("dtype") if isinstance(config, dict) else None
    if not isinstance(dtype, dict):
        return _original_from_config(cls, config)
    policy = _dtype_policies.deserialize(dtype)
    if not isinstance(policy, _saved_classes):
        return _original_from_config(cls, config)
    # Build the layer the way it was built before saving: with its kerasmp
    # policy global, so that sublayers its __init__ creates with dtype=None
    # get that policy too, whatever the global policy of the loading process.
    governing = policy if isinstance(policy, _policy_cls) else policy.policy
    previous = keras.config.dtype_policy()
    keras.config.set_dtype_policy(governing)
    try:
        return _original_from_config(cls, {**config, "dtype": policy})
    finally:
        keras.config.set_dtype_policy(previous)


def install(policy_cls, saved_classes):
    """Installs the hooks (idempotent). Called by `kerasmp.policy`.

    Args:
        policy_cls: `kerasmp.Policy`, the class that is resolved per layer.
        saved_classes: The kerasmp policy classes that loading passes to
            layer constructors as objects rather than names.
    """
    global _installed, _policy_cls, _saved_classes
    _policy_cls = policy_cls
    _saved_classes = tuple(saved_classes)
    if _installed:
        return
    keras.layers.Layer._dtype_policy = _ResolvedDTypePolicy()
    _trainer.Trainer.compile = _compile
    _operation.Operation.from_config = classmethod(_from_config)
    _installed = True
