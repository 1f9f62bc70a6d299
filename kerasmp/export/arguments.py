"""The checks of `export`'s and `to_float16`'s arguments: the model, the
dtype and the `keep_float32` rules (each name pattern must match a layer),
raised before any copy is made.
"""

import re

import keras

from kerasmp.policy import policy as _policy
from kerasmp.policy.advice import class_hint
from kerasmp.policy.advice import describe
from kerasmp.policy.advice import matches_a_layer
from kerasmp.policy.advice import model_layers
from kerasmp.policy.advice import nearest_layers
from kerasmp.policy.plan import plan_of


def check_dtype(dtype, allowed, argname="dtype"):
    if not isinstance(dtype, str) or dtype not in allowed:
        raise ValueError(
            f"Invalid `{argname}`: {dtype!r}. Allowed values: "
            f"{', '.join(repr(d) for d in allowed)}."
        )


def check_model(model):
    if not isinstance(model, keras.Model):
        raise TypeError(
            "`model` must be a keras.Model (Sequential, Functional or a "
            f"subclass). Received: {model!r} (of type "
            f"{type(model).__name__})"
        )
    if not model.built or not model.weights:
        raise ValueError(
            f"`model` ({model.name!r}) is not built: its weights do not "
            "exist yet, so there is nothing to export. Call it on a batch of "
            "data or call `model.build(input_shape)` first."
        )


def keep_rules(model, keep_float32):
    """The float32 rules (layer classes and name regexes) to apply."""
    if keep_float32 is None:
        made = plan_of(model)
        for entry in (made.root,) + made.layers:
            stored = entry.stored
            if isinstance(stored, _policy.Policy):
                return tuple(stored.float32_layers)
        return tuple(_policy.DEFAULT_FLOAT32_LAYERS)
    if isinstance(keep_float32, str) and keep_float32 == "tune":
        raise ValueError(
            "Invalid `keep_float32`: 'tune' is for kerasmp.export.export "
            "(the layers that pass its parity gate, measured on its "
            "inputs). Allowed values here: None (the model's rules), or a "
            "sequence of keras.layers.Layer subclasses and/or name "
            "patterns.")
    if isinstance(keep_float32, (str, type, re.Pattern)):
        keep_float32 = [keep_float32]
    try:
        entries = list(keep_float32)
    except TypeError:
        raise TypeError(
            "`keep_float32` must be None, a sequence of keras.layers.Layer "
            "subclasses and/or regular expressions matched against layer "
            "names, or (for export) 'tune'. Received: "
            f"{keep_float32!r}"
        ) from None
    rules = tuple(
        _policy.parse_rule(entry, argname="keep_float32") for entry in entries
    )
    _check_patterns_match(model, rules)
    return rules


_LISTED_LAYERS = 12
"""How many of a model's layers the no-match error lists."""


def _check_patterns_match(model, rules):
    """Raises a ValueError for a name pattern of `rules` that matches no
    layer of `model`, listing its layers (names and classes), the nearest
    names first (`kerasmp.policy.advice`, which `compile`'s warning for
    a `float32_layers` pattern uses too)."""
    layers = model_layers(model)[1:]
    for rule in rules:
        if not isinstance(rule, re.Pattern) or matches_a_layer(rule, layers):
            continue
        listed = describe(nearest_layers(rule, layers)[:_LISTED_LAYERS])
        if len(layers) > _LISTED_LAYERS:
            listed += f", and {len(layers) - _LISTED_LAYERS} more"
        raise ValueError(
            f"Invalid `keep_float32`: the pattern {rule.pattern!r} matches "
            f"no layer of {model.name!r} (a pattern must match a whole "
            f"layer name, case included; its layers, nearest first: "
            f"{listed}){class_hint(rule, layers)}. Allowed values: None, "
            "layer classes and/or name patterns, or (for export) 'tune'."
        )
