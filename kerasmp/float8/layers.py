"""Applying the float8 rule to a model: `decide`, `assign_layers` (called
by `compile`), `fall_back`, and what `dtype_report` says of float8 layers.

Keras quantizes *built* layers, and the rule needs the kernel sizes and the
model's first and last matmul, so the layers are assigned at
`model.compile()`. A model that is not built at compile (a subclassed model
without an input shape) gets a warning; build it and call
`kerasmp.float8.assign_layers(model)`.
"""

import dataclasses
import math
import warnings

import keras

from kerasmp import _keras_internals as _ki
from kerasmp._utils.layers import walk
from kerasmp._utils.warn import user_stacklevel
from kerasmp.float8.policies import POLICY_CLASSES
from kerasmp.float8.policies import Float8Assignment
from kerasmp.float8.policies import Float8Fallback
from kerasmp.float8.rule import Float8Rule

MATMUL_CLASSES = (keras.layers.Dense, keras.layers.EinsumDense)
"""The layer classes with a float8 mode in Keras (exact classes)."""


@dataclasses.dataclass(frozen=True)
class Decision:
    """What the float8 rule decides for one layer.

    Attributes:
        path: the layer's path (`dtype_report`'s).
        layer: the layer.
        float8: whether it trains (or is to train) in float8.
        reason: why, in a few words.
    """

    path: str
    layer: object
    float8: bool
    reason: str


def _float8_policy(layer):
    """The float8 kerasmp policy governing `layer`, or None."""
    stored = _ki.stored_dtype_policy(layer)
    if isinstance(stored, POLICY_CLASSES):
        return stored.policy
    rule = getattr(stored, "float8", None)
    return stored if isinstance(rule, Float8Rule) else None


def _kernel_shape(layer):
    kernel = getattr(layer, "kernel", None) if layer.built else None
    return None if kernel is None else tuple(kernel.shape)


def _is_matmul(layer):
    return type(layer) in MATMUL_CLASSES


def decide(model, layers=None):
    """Applies the float8 rule to every layer of `model`.

    Args:
        model: A `keras.Model` or layer, built (unbuilt matmul layers are
            reported as not float8, "not built").
        layers: Optional `(path, layer)` pairs of `walk(model)` already
            listed (compile's plan walks the model once).

    Returns:
        A list of `Decision`, one per layer a float8 policy governs (or that
        was assigned or moved off float8), in `dtype_report` order.
    """
    everything = list(walk(model)) if layers is None else list(layers)
    rows = [(p, l) for p, l in everything if _float8_policy(l) is not None
            and not isinstance(l, keras.layers.InputLayer)]
    matmuls = [p for p, l in everything if _is_matmul(l)]
    first = matmuls[0] if matmuls else None
    last = matmuls[-1] if matmuls else None
    out = []
    for path, layer in rows:
        stored = _ki.stored_dtype_policy(layer)
        if isinstance(stored, Float8Assignment):
            out.append(Decision(path, layer, True, stored.rule))
            continue
        if isinstance(stored, Float8Fallback):
            out.append(Decision(path, layer, False,
                                f"fallback: {stored.reason}"))
            continue
        out.append(Decision(path, layer, *_judge(stored.float8, layer, path,
                                                 first, last)))
    return out


def _judge(rule, layer, path, first, last):
    if rule.excluded(layer, path):
        return False, "excluded by name"
    if not _is_matmul(layer):
        return False, f"{type(layer).__name__} has no float8 mode"
    if getattr(layer, "lora_enabled", False):
        return False, "LoRA enabled (Keras's float8 has no LoRA)"
    if layer.compute_dtype in ("float32", "float64"):
        return False, f"computes in {layer.compute_dtype} (float32 rule)"
    shape = _kernel_shape(layer)
    if shape is None:
        return False, "not built"
    size = math.prod(shape)
    dims = "x".join(str(d) for d in shape)
    if rule.included(layer, path):
        return True, f"included by name (kernel {dims})"
    if rule.exclude_first and path == first:
        return False, "first matmul layer (exclude_first)"
    if rule.exclude_last and path == last:
        return False, "last matmul layer (exclude_last)"
    if size < rule.min_kernel_size:
        return False, (f"kernel {dims} = {size} < min_kernel_size "
                       f"{rule.min_kernel_size}")
    return True, f"kernel {dims} = {size} >= {rule.min_kernel_size}"


def assign_layers(model, decisions=None):
    """Moves the layers the float8 rule selects to Keras's float8 mode.

    kerasmp's compile hook calls it; call it yourself for a model that was
    not built when it was compiled (then compile again, so that the train
    function sees the new variables). Layers already in float8, or moved
    off it, are left alone.

    Args:
        model: A built `keras.Model` whose layers a float8 `kerasmp.Policy`
            governs (anything else: nothing happens).
        decisions: Optional: `decide(model)`, already made.

    Returns:
        The paths of the layers in float8 after the call.

    Example:

    >>> kerasmp.set_global_policy("float8_mixed_bfloat16")
    >>> model = keras.Sequential([keras.Input((64,))] + [
    ...     keras.layers.Dense(64) for _ in range(3)])
    >>> kerasmp.float8.assign_layers(model)
    ['dense_1']
    >>> kerasmp.set_global_policy("float32")
    """
    if decisions is None:
        decisions = decide(model)
    if not decisions:
        return []
    if any(d.reason == "not built" for d in decisions):
        warnings.warn(
            f"Float8 policy: some layers of model {model.name!r} are not "
            "built, so they stay out of float8. Build the model (an Input, "
            "or model.build(shape)), then call "
            "kerasmp.float8.assign_layers(model) and compile again.",
            stacklevel=user_stacklevel(),
        )
    for d in decisions:
        stored = _ki.stored_dtype_policy(d.layer)
        if d.float8 and not isinstance(stored, Float8Assignment):
            # The public setter quantizes a built layer (Dense.quantize
            # "float8": the six scale and amax-history variables).
            d.layer.dtype_policy = Float8Assignment(_float8_policy(d.layer),
                                                    d.reason)
    return [d.path for d in decisions if d.float8]


def float8_layers(model):
    """`(path, layer)` of every layer of `model` in Keras's float8 mode."""
    return [(p, l) for p, l in walk(model)
            if getattr(l, "quantization_mode", None) == "float8"]


def fall_back(layer, reason):
    """Moves one float8 layer to its policy's base dtype (no float8).

    The layer keeps its kernel and bias (trained so far) and its float8
    scale variables, which stop being used (Keras warns that they get no
    gradient). Rebuild the train function afterwards
    (`model.make_train_function(force=True)`; `Float8Monitor` does).

    Args:
        layer: A layer with a `Float8Assignment` policy.
        reason: Why (kept in its `Float8Fallback` policy and the report).

    Raises:
        ValueError: `layer` is not a layer a float8 policy put in float8.
    """
    stored = _ki.stored_dtype_policy(layer)
    if not isinstance(stored, Float8Assignment):
        raise ValueError(
            f"`layer` {layer.name!r} was not put in float8 by a kerasmp "
            f"float8 policy (its policy is {stored!r})."
        )
    layer.dtype_policy = Float8Fallback(stored.policy, reason)


def report_reason(layer):
    """The `dtype_report` "why" of a layer a float8 policy governs, or None.

    "float8 (<reason>)", "float8 fallback (<reason>)", or None for layers
    no float8 policy governs or that the rule leaves in the base policy
    (their usual reason applies).
    """
    stored = _ki.stored_dtype_policy(layer)
    if isinstance(stored, Float8Assignment):
        return f"kerasmp float8 ({stored.rule})"
    if isinstance(stored, Float8Fallback):
        return f"kerasmp float8 fallback ({stored.reason})"
    return None
