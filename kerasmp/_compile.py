"""The compile patch: kerasmp decides loss scaling and installs its train
step when a model is compiled.

Stock `Model.compile` wraps the optimizer in a loss-scale optimizer only when
the model's policy is *named* `"mixed_float16"`. When a model has layers
governed by a `kerasmp.Policy`, kerasmp decides instead: if any trainable
layer computes in float16, a plain optimizer is wrapped once in
`kerasmp.LossScaleOptimizer`; an optimizer that already is a
`keras.optimizers.LossScaleOptimizer` is kept; bfloat16 and float32 models
get no loss scaling. `compile(..., auto_scale_loss=False)` turns it off, as
in stock Keras. Models no kerasmp policy governs compile as in stock Keras.

Then, for every model, `kerasmp._train_step.install` puts kerasmp's train
step in place: the one place the train step is changed (it undoes skipped
steps and logs the loss scale while the optimizer is a
`kerasmp.LossScaleOptimizer`). For a
governed model under a multi-worker strategy,
`kerasmp.distributed.check_workers_agree` then checks that every worker has
the same precision settings.

This module sits above `policy`, `optimizer`, `distributed` and
`_train_step` (it imports them, none imports it). `kerasmp/__init__.py`
imports it as soon as Keras is imported, which installs the patch; its
`install()` and `uninstall()` are the public `kerasmp.install()` and
`kerasmp.uninstall()`, which also cover the policy patches at the end of
`kerasmp/policy.py`.
"""

import functools
import inspect

import keras

from kerasmp import _keras_internals as _ki
from kerasmp import _stock_policy
from kerasmp import _train_step
from kerasmp import float8 as _float8
from kerasmp import policy as _policy
from kerasmp.distributed import check_workers_agree
from kerasmp.optimizer import LossScaleOptimizer

_originals = {}


def _governed_layers(model):
    """Layers of `model` (itself included) whose policy is a kerasmp one."""
    layers = [model] + _ki.sublayers(model)
    return [
        l
        for l in layers
        if isinstance(_policy.stored_policy(l), _policy.Policy)
    ]


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
            if _ki.has_own_trainable_variables(layer):
                return True
        elif not _ki.sublayers(layer):
            return True
    return False


def _compile(self, *args, **kwargs):
    original = _originals["compile"]
    _stock_policy.warn_if_stock_mixed_policy(self)  # the TF guide's policy
    if not _governed_layers(self):
        result = original(self, *args, **kwargs)
        _train_step.install(self)
        return result
    _float8.assign_layers(self)  # float8 policies: the rule's layers
    bound = inspect.signature(original).bind(self, *args, **kwargs)
    bound.apply_defaults()
    arguments = bound.arguments
    if arguments["auto_scale_loss"] and (
        needs_loss_scaling(self) or _float8.needs_loss_scaling(self)
    ):
        optimizer = keras.optimizers.get(arguments["optimizer"])
        if optimizer is not None and not isinstance(
            optimizer, keras.optimizers.LossScaleOptimizer
        ):
            optimizer = LossScaleOptimizer(
                optimizer, name="loss_scale_optimizer"
            )
        arguments["optimizer"] = optimizer
    # kerasmp has decided; keep stock Keras's name-based rule out of it.
    arguments["auto_scale_loss"] = False
    result = original(*bound.args, **bound.kwargs)
    _train_step.install(self)
    # Every worker of a multi-worker job compiles: check there that they
    # all train with the same precision settings (a no-op in one process).
    check_workers_agree(self)
    return result


def _install_compile():
    trainer = _ki.trainer_class()
    if "compile" not in _originals:
        _originals["compile"] = trainer.compile
        trainer.compile = functools.wraps(trainer.compile)(_compile)


def install():
    """Installs kerasmp's hooks into Keras (idempotent).

    Importing kerasmp installs them, so user code never needs to: the
    policy patches (the end of `kerasmp/policy.py`: per-layer policy
    resolution, the float32 hand-back, saving and loading) and the compile
    patch (this module). They act only on models and layers that a
    `kerasmp.Policy` governs or that are compiled with
    `kerasmp.LossScaleOptimizer`.
    """
    _policy.install()
    _install_compile()


def uninstall():
    """Removes kerasmp's hooks: Keras behaves exactly as without kerasmp.

    Layers built under a `kerasmp.Policy` keep it, but then compute in its
    dtype without float32 overrides. `kerasmp.install()` puts the hooks
    back (creating a `Policy` puts back the policy patches).

    Example:

    >>> kerasmp.uninstall()
    >>> keras.layers.Softmax(dtype="mixed_float16").compute_dtype
    'float16'
    >>> kerasmp.install()
    """
    if "compile" in _originals:
        _ki.trainer_class().compile = _originals.pop("compile")
    _policy.uninstall()


_install_compile()
