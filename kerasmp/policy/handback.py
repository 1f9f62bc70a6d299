"""How a layer kerasmp keeps in another dtype hands its outputs on.

Inside a model, a layer a kerasmp rule keeps in float32 (softmax, a
normalization, an MoE router) passes its floating outputs to the layer that
called it in that caller's compute dtype (`handoff_dtype`, `hand_back`), so
it composes with the half-precision tensors around it; kerasmp's
`Layer.__call__` patch (`kerasmp._patches`) applies it.
"""

import keras

from kerasmp import _keras_internals as _ki
from kerasmp._utils.arrays import FLOAT16_MAX
from kerasmp.policy.policy import Float32Override
from kerasmp.policy.policy import Policy
from kerasmp.policy.policy import stored_policy
from kerasmp.policy.rules import AS_COMPUTED

FALLBACK_RULE = "NonFiniteMonitor fallback"
"""The rule of a layer `NonFiniteMonitor`'s fallback moved to float32: its
outputs may not fit in half precision, so they are handed on as computed."""

_HALF = ("float16", "bfloat16")


def handoff_dtype(layer, caller=None):
    """The dtype in which `layer` hands its float outputs on inside a model.

    A layer a kerasmp policy governs hands its floating outputs to the layer
    (or model) that called it in that caller's compute dtype: a layer a
    kerasmp rule keeps in float32 (softmax, a normalization, an MoE router)
    passes them to the half-precision layers after it in half precision, as
    stock Keras's BatchNormalization does, and a half-precision layer called
    by a float32 layer passes them up in float32, so the caller's own code
    never mixes the two. Without a caller, the governing policy's compute
    dtype. Returns None when the outputs go on as computed: same dtype, a
    layer no kerasmp policy governs, or one `NonFiniteMonitor`'s fallback
    moved to float32 (its outputs may not fit in half precision).

    Args:
        layer: A `keras.layers.Layer`.
        caller: The layer whose `call` called `layer`, if any.

    Example:

    >>> kerasmp.set_global_policy("mixed_float16")
    >>> kerasmp.policy.handoff_dtype(keras.layers.LayerNormalization())
    'float16'
    """
    if AS_COMPUTED and id(layer) in AS_COMPUTED:
        return None
    stored = stored_policy(layer)
    if isinstance(stored, Float32Override):
        if stored.rule == FALLBACK_RULE:
            return None
        governing = stored.policy
    elif isinstance(stored, Policy):
        governing = stored
    else:
        return None
    target = (governing if caller is None else caller).compute_dtype
    own = layer.compute_dtype
    if target == own or "float" not in own or "float" not in target:
        return None
    if caller is None and target not in _HALF:
        return None
    return target


def _is_castable(x, target):
    if x is None or isinstance(x, keras.KerasTensor):
        return False
    dtype = getattr(x, "dtype", None)
    if dtype is None or not keras.ops.is_tensor(x):
        return False
    dtype = keras.backend.standardize_dtype(dtype)
    if "float" not in dtype or dtype == target:
        return False
    return not (dtype == "float64" and target == "float32")


def hand_back(outputs, dtype, originals=None):
    """A layer's outputs, cast to the compute `dtype` of the layer they are
    handed to (the one hand-off cast of kerasmp, see `handoff_dtype`).

    Every floating backend tensor in the structure whose dtype is not
    `dtype` is cast to it (float64 stays float64 for a float32 caller),
    keeping its Keras mask; symbolic `KerasTensor`s, integer tensors and
    non-tensors pass unchanged. Handed to float16, values below -65504
    become -65504, not -inf: a large negative mask bias (T5's `-1e9` in its
    float32 attention, handed on as the position bias) stays a finite "never
    attend" instead of a -inf that turns a fully masked row into NaN;
    positive overflow still becomes inf, for the monitors to see. Used by
    the `Layer.__call__` patch in `kerasmp._patches` (through
    `handoff_dtype`) and by the exported `HalfModel`
    (`kerasmp/export/half.py`).

    Args:
        outputs: A tensor or a structure of tensors.
        dtype: The compute dtype to hand back in, e.g. `"float16"`.
        originals: Optional dict: `id(cast)` maps to `(cast, original)`
            for each tensor cast to half precision, so the outermost call
            can give the float32 originals back.

    Example:

    >>> y = kerasmp.policy.hand_back(keras.ops.ones((2,)), "float16")
    >>> keras.backend.standardize_dtype(y.dtype)
    'float16'
    """

    def cast(x):
        if not _is_castable(x, dtype):
            return x
        x_kept = x
        if dtype == "float16":
            x = keras.ops.maximum(x, -FLOAT16_MAX)
        y = keras.ops.cast(x, dtype)
        mask = _ki.get_keras_mask(x_kept)
        if mask is not None:
            _ki.set_keras_mask(y, mask)
        if originals is not None and dtype in _HALF:
            originals[id(y)] = (y, x_kept)
        return y

    return keras.tree.map_structure(cast, outputs)


