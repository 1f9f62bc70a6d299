"""`dequantize`: a copy of a float8 model without float8, for export."""

import keras

from kerasmp import _keras_internals as _ki
from kerasmp._utils.arrays import to_numpy
from kerasmp._utils.layers import walk
from kerasmp.float8.layers import float8_layers
from kerasmp.float8.policies import POLICY_CLASSES
from kerasmp.float8.rule import Float8Rule
from kerasmp.float8.rule import base_name


def _plain_policy(policy):
    """The non-float8 policy standing in for `policy` in a plain copy.

    kerasmp's classes are recognised by what they hold (a `Policy` has
    `float8`, a `Float32Override` `policy` and `rule`), so that this module
    does not import `kerasmp.policy`, which imports it.
    """
    if isinstance(policy, POLICY_CLASSES):
        policy = policy.policy
    if isinstance(getattr(policy, "float8", None), Float8Rule):
        return type(policy)(base_name(policy.name),
                            float32_layers=policy.float32_layers,
                            float32_defaults=False)
    if hasattr(policy, "rule") and hasattr(policy, "policy"):  # override
        return type(policy)(_plain_policy(policy.policy), policy.rule)
    if isinstance(policy, keras.dtype_policies.QuantizedFloat8DTypePolicy):
        return keras.DTypePolicy(policy.name.split("_from_", 1)[1])
    return policy


def _plain_config(config):
    if isinstance(config, list):
        return [_plain_config(c) for c in config]
    if not isinstance(config, dict):
        return config
    if config.get("class_name") in ("DTypePolicy", "QuantizedFloat8DTypePolicy"
                                    ) and "config" in config:
        policy = keras.dtype_policies.deserialize(config)
        return keras.dtype_policies.serialize(_plain_policy(policy))
    return {k: _plain_config(v) for k, v in config.items()}


def dequantize(model):
    """A copy of `model` without float8: for export and inference.

    Every layer in Keras's float8 mode becomes the plain layer of its
    policy's base dtype (`mixed_bfloat16` or `mixed_float16`, with the same
    kerasmp float32 rules); its kernel is the quantize-dequantized kernel
    the float8 forward pass computes with (`kernel_scale`, E4M3), so the
    copy's weights are the ones the float8 model used. Its inputs are no
    longer rounded to float8, so the copy's outputs differ from the float8
    model's by that rounding (measure it: docs/float8.md). The float8
    scale and amax-history variables are dropped. Export the copy with
    `kerasmp.export.export`.

    Args:
        model: A `keras.Model` whose config round-trips (Sequential,
            Functional, or a registered subclass with `get_config`).

    Returns:
        A new, built `keras.Model`.

    Example:

    >>> plain = kerasmp.float8.dequantize(model)  # doctest: +SKIP
    >>> kerasmp.export.export(plain, "served", sample=x)  # doctest: +SKIP
    """
    if not isinstance(model, keras.Model):
        raise TypeError(f"`model` must be a keras.Model. Received: {model!r}")
    config = _plain_config(keras.saving.serialize_keras_object(model))
    plain = keras.saving.deserialize_keras_object(config)
    quantized = {}
    for _, layer in float8_layers(model):
        scale = float(to_numpy(layer.kernel_scale))
        qdq = keras.quantizers.quantize_and_dequantize(
            keras.ops.convert_to_tensor(to_numpy(layer.kernel)), scale,
            "float8_e4m3fn", "float32")
        quantized[id(layer.kernel)] = to_numpy(qdq)
    for copy, source in _pairs(model, plain):
        value = quantized.get(id(source))
        copy.assign(to_numpy(source) if value is None else value)
    return plain


def _pairs(model, plain):
    """`(copy's variable, model's variable)` for every variable of the
    copy, paired by layer path (`walk`) and variable name: the same config
    builds the same layers, but a model built in memory and its rebuilt
    copy can name their variables' paths differently (`sequential/first/
    kernel` and `first/kernel`)."""
    source = {path: layer for path, layer in walk(model)}
    source[""] = model
    pairs = []
    for path, layer in [("", plain)] + list(walk(plain)):
        owner = source.get(path)
        by_name = {v.name: v for v in _ki.own_variables(owner)} if (
            owner is not None) else {}
        for v in _ki.own_variables(layer):
            if v.name not in by_name:
                raise ValueError(
                    f"Cannot dequantize: the copy's variable "
                    f"{path + '/' if path else ''}{v.name} has no "
                    "counterpart in the model (does its config "
                    "round-trip?)."
                )
            pairs.append((v, by_name[v.name]))
    return pairs
