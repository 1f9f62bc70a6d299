"""The places where kerasmp changes how Keras behaves.

All are installed by `install()` (on the first import of `kerasmp.policy`)
and removed by `uninstall()`, and all do nothing for layers and models that
no `kerasmp.Policy` governs, so code that does not use kerasmp policies sees
stock Keras.

1. Policy resolution. `keras.layers.Layer._dtype_policy` becomes a data
   descriptor. Keras keeps writing the layer's policy to it as before (it is
   stored in the instance `__dict__`); reading it returns
   `policy.policy_for(layer)` when the stored policy is a `kerasmp.Policy`,
   and the stored policy unchanged otherwise. Every Keras code path that asks
   a layer for its compute or variable dtype goes through this read, so one
   rule covers `dtype=None` layers, layers handed a parent's policy (the
   `Softmax` inside `MultiHeadAttention`), and attributes set after
   `Layer.__init__` (an `Activation` layer's activation).

2. Outputs that compose. A layer that a kerasmp rule keeps in float32
   computes in float32, but when it is called inside another layer or model
   its floating outputs are cast back to the governing policy's compute
   dtype (as stock `BatchNormalization` and `LayerNormalization` do), so a
   post-LN residual `x + norm(x)` adds two float16 tensors and activations
   stay half precision between layers. The outputs of the outermost call
   (the model's predictions, or a layer called on its own) are the float32
   values the layer computed, so the probabilities that reach the loss are
   float32.

3. Loss scaling at compile time. Stock `Model.compile` wraps the optimizer in
   a loss-scale optimizer only when the model's policy is *named*
   `"mixed_float16"`. When a model has layers governed by a `kerasmp.Policy`,
   kerasmp decides instead: if any trainable layer computes in float16, a
   plain optimizer is wrapped once in `kerasmp.LossScaleOptimizer`; an
   optimizer that already is a `keras.optimizers.LossScaleOptimizer` is kept;
   bfloat16 and float32 models get no loss scaling. `compile(...,
   auto_scale_loss=False)` turns it off, as in stock Keras. Under a
   multi-worker strategy, compile then checks that every worker has the
   same policy, float32 rules and loss-scale settings
   (`kerasmp.distributed.check_workers_agree`).

4. Saving and loading. A kerasmp policy is saved as the stock
   `keras.DTypePolicy` a plain Keras can load (the policy's name, or
   `"float32"` for an overridden layer; a stock normalization layer's
   override is saved under the governing mixed policy's name, which stock
   Keras computes the same way: `portable_policy_name`) plus a `"kerasmp"`
   entry that stock Keras ignores, so a `.keras` file loads without kerasmp
   with the same predictions. With kerasmp, `dtype_policies.deserialize`
   rebuilds the kerasmp policy from that entry (accepting only kerasmp's own
   classes), and `Operation.from_config` passes the policy *object* to the
   constructor (stock Keras passes only its name) with the layer's kerasmp
   policy made global while the constructor runs, so sublayers that a custom
   layer creates in `__init__` with `dtype=None` get it too.

This module is the patching half of kerasmp's seam to Keras: it decides
*what* changes. Every Keras class, module and private attribute it patches
or reads comes from `kerasmp._keras_internals`, the one module that knows
Keras's private names (docs/architecture.md).
"""

import functools
import inspect
import threading

import keras

from kerasmp import _keras_internals as _ki

_Trainer = _ki.trainer_class()
_Operation = _ki.operation_class()

_installed = False
_policy_cls = None  # kerasmp.Policy
_saved_classes = {}  # name -> kerasmp policy class that files may name
_originals = {}  # what install() replaced, for uninstall()


class _ResolvedDTypePolicy:
    """Data descriptor installed on `keras.layers.Layer` under
    `_keras_internals.DTYPE_POLICY_ATTR`."""

    def __get__(self, layer, owner=None):
        if layer is None:
            return self
        try:
            stored = layer.__dict__[_ki.DTYPE_POLICY_ATTR]
        except KeyError:
            raise AttributeError(_ki.DTYPE_POLICY_ATTR) from None
        if isinstance(stored, _policy_cls):
            return stored.policy_for(layer)
        return stored

    def __set__(self, layer, value):
        layer.__dict__[_ki.DTYPE_POLICY_ATTR] = value


stored_policy = _ki.stored_dtype_policy
sublayers = _ki.sublayers
has_trainable_variables = _ki.has_own_trainable_variables


def _governed_layers(model):
    """Layers of `model` (itself included) whose policy is a kerasmp one."""
    layers = [model] + sublayers(model)
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
            if has_trainable_variables(layer):
                return True
        elif not sublayers(layer):
            return True
    return False


# --- 2. Outputs that compose -------------------------------------------------

_calls = threading.local()  # depth of nested Layer.__call__, float32 outputs


def handoff_dtype(layer):
    """The dtype an overridden layer's float outputs are cast to, or None.

    None when no kerasmp rule keeps `layer` in float32: its outputs then
    leave it as computed.
    """
    stored = stored_policy(layer)
    if not isinstance(stored, _policy_cls):
        return None
    if stored.policy_for(layer) is stored:
        return None
    return stored.compute_dtype


def _is_castable(x, target):
    if x is None or isinstance(x, keras.KerasTensor):
        return False
    dtype = getattr(x, "dtype", None)
    if dtype is None or not keras.ops.is_tensor(x):
        return False
    dtype = keras.backend.standardize_dtype(dtype)
    return dtype in ("float32", "float64") and dtype != target


def _cast_down(outputs, target, originals):
    def cast(x):
        if not _is_castable(x, target):
            return x
        y = keras.ops.cast(x, target)
        mask = _ki.get_keras_mask(x)
        if mask is not None:
            _ki.set_keras_mask(y, mask)
        originals[id(y)] = (y, x)
        return y

    return keras.tree.map_structure(cast, outputs)


def _restore_float32(outputs, originals):
    def restore(y):
        entry = originals.get(id(y))
        return entry[1] if entry is not None and entry[0] is y else y

    return keras.tree.map_structure(restore, outputs)


def _layer_call(self, *args, **kwargs):
    depth = getattr(_calls, "depth", 0)
    if depth == 0:
        _calls.originals = {}
    _calls.depth = depth + 1
    try:
        outputs = _originals["__call__"](self, *args, **kwargs)
    finally:
        _calls.depth = depth
    originals = _calls.originals
    if depth > 0:
        target = handoff_dtype(self)
        if target is not None:
            outputs = _cast_down(outputs, target, originals)
    elif originals:
        outputs = _restore_float32(outputs, originals)
        _calls.originals = {}
    return outputs


# --- 3. Loss scaling at compile time ----------------------------------------


def _compile(self, *args, **kwargs):
    from kerasmp import _skip_guard

    original = _originals["compile"]
    if not _governed_layers(self):
        result = original(self, *args, **kwargs)
        _skip_guard.guard_skipped_steps(self)  # kerasmp's optimizer, if given
        return result
    bound = inspect.signature(original).bind(self, *args, **kwargs)
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
    result = original(*bound.args, **bound.kwargs)
    _skip_guard.guard_skipped_steps(self)  # skipped steps keep BN statistics
    # Every worker of a multi-worker job compiles: check there that they
    # all train with the same precision settings (a no-op in one process).
    from kerasmp.distributed import check_workers_agree

    check_workers_agree(self)
    return result


# --- 4. Saving and loading --------------------------------------------------

_KERASMP_KEY = "kerasmp"


# Stock normalization layers: float32 arithmetic inside, output in the
# compute dtype (docs/keras-internals: BatchNormalization, LayerNormalization,
# GroupNormalization upcast and cast back).
_UPCASTING_RULES = ("BatchNormalization", "LayerNormalization",
                    "GroupNormalization")


def portable_policy_name(policy):
    """The stock policy name a kerasmp policy is saved under.

    A kerasmp float32 override of a stock normalization layer is saved as
    its governing policy's name (`"mixed_float16"`): stock Keras then rounds
    the layer's input to float16, computes in float32 with float32 weights
    and returns float16, which is what kerasmp computes inside a model (its
    float32 output handed back, section 2). Saved as `"float32"`, a load
    without kerasmp returned unrounded float32 outputs into residual adds,
    and lost the rounding of the input where a container whose
    `from_config` drops its dtype (a nested `Sequential`: ConvNeXt, issue
    16 #7) used to do it. Any other policy keeps its own name.
    """
    governing = getattr(policy, "policy", None)
    if (getattr(policy, "rule", None) in _UPCASTING_RULES
            and isinstance(governing, _policy_cls)
            and governing.compute_dtype in ("float16", "bfloat16")):
        return governing.name
    return policy.name


def _serialize(policy):
    """`dtype_policies.serialize` that stock Keras can read back."""
    if not isinstance(policy, tuple(_saved_classes.values())):
        return _originals["serialize"](policy)
    config = _originals["serialize"](
        keras.DTypePolicy(portable_policy_name(policy)))
    config[_KERASMP_KEY] = {
        "class_name": type(policy).__name__,
        "config": policy.get_config(),
    }
    return config


def policy_from_saved(entry):
    """Rebuilds a kerasmp policy from the `"kerasmp"` entry of a file.

    Only kerasmp's own policy classes are accepted: a file cannot make this
    function import a module or build any other object.

    Raises:
        ValueError: The entry names anything else.
    """
    name = entry.get("class_name") if isinstance(entry, dict) else None
    cls = _saved_classes.get(name)
    if cls is None or not isinstance(entry.get("config"), dict):
        raise ValueError(
            "Invalid kerasmp dtype policy in the saved file: expected "
            f"{sorted(_saved_classes)} with a config dict. Received: "
            f"{entry!r:.200}"
        )
    return cls.from_config(entry["config"])


def _deserialize(config, custom_objects=None):
    """`dtype_policies.deserialize` that restores kerasmp policies."""
    if isinstance(config, dict) and _KERASMP_KEY in config:
        return policy_from_saved(config[_KERASMP_KEY])
    return _originals["deserialize"](config, custom_objects=custom_objects)


def _from_config(cls, config):
    original = _originals["from_config"]
    dtype = config.get("dtype") if isinstance(config, dict) else None
    if not isinstance(dtype, dict):
        return original(cls, config)
    policy = _deserialize(dtype)
    if not isinstance(policy, tuple(_saved_classes.values())):
        return original(cls, config)
    # Build the layer the way it was built before saving: with its kerasmp
    # policy global, so that sublayers its __init__ creates with dtype=None
    # get that policy too, whatever the global policy of the loading process.
    governing = policy if isinstance(policy, _policy_cls) else policy.policy
    previous = keras.config.dtype_policy()
    keras.config.set_dtype_policy(governing)
    try:
        return original(cls, {**config, "dtype": policy})
    finally:
        keras.config.set_dtype_policy(previous)


def install(policy_cls, saved_classes):
    """Installs the hooks (idempotent). Called by `kerasmp.policy`.

    Args:
        policy_cls: `kerasmp.Policy`, the class that is resolved per layer.
        saved_classes: The kerasmp policy classes that are saved in the
            portable format and that loading may build.
    """
    global _installed, _policy_cls, _saved_classes
    _policy_cls = policy_cls
    _saved_classes = {c.__name__: c for c in saved_classes}
    if _installed:
        return
    _originals.update(
        __call__=keras.layers.Layer.__call__,
        compile=_Trainer.compile,
        from_config=_Operation.from_config.__func__,
    )
    modules = _ki.dtype_policy_modules()
    _originals.update(
        serialize=modules[0].serialize,
        deserialize=modules[0].deserialize,
    )
    _ki.install_dtype_policy_descriptor(_ResolvedDTypePolicy())
    keras.layers.Layer.__call__ = functools.wraps(_originals["__call__"])(
        _layer_call
    )
    _Trainer.compile = functools.wraps(_originals["compile"])(_compile)
    _Operation.from_config = classmethod(
        functools.wraps(_originals["from_config"])(_from_config)
    )
    for module in modules:
        module.serialize = _serialize
        module.deserialize = _deserialize
    _installed = True


def uninstall():
    """Removes every hook `install()` put in place (idempotent).

    Layers keep the policies stored on them; those built under a
    `kerasmp.Policy` then compute in the policy's dtype without overrides.
    """
    global _installed
    if not _installed:
        return
    _ki.remove_dtype_policy_descriptor()
    keras.layers.Layer.__call__ = _originals["__call__"]
    _Trainer.compile = _originals["compile"]
    _Operation.from_config = classmethod(_originals["from_config"])
    for module in _ki.dtype_policy_modules():
        module.serialize = _originals["serialize"]
        module.deserialize = _originals["deserialize"]
    _installed = False


def is_installed():
    """Whether the hooks are in place."""
    return _installed
