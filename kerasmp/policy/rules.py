"""The float32 rules of a `kerasmp.Policy`: parsing and saving them.

A rule is a `keras.layers.Layer` subclass, a regular expression matched
against the whole layer name, a predicate (a module-level function of the
layer) or one of kerasmp's built-in rules (`kerasmp.policy.norms`).
`parse_rule` checks one; `rule_to_config` / `rule_from_config` write it to a
saved policy and read it back without importing any module a file names.
"""

import contextlib
import re
import sys

import keras

from kerasmp._utils.namematch import NameMatcher
from kerasmp._utils.warn import warn
from kerasmp.errors import PolicyWarning
from kerasmp.policy.norms import BUILTIN_RULES
from kerasmp.policy.norms import BuiltinRule
from kerasmp.policy.norms import Exclude

SOFTMAX_ACTIVATIONS = ("softmax", "log_softmax")


def parse_rule(rule, argname="float32_layers"):
    """Returns a float32 rule as a layer class, a compiled regex, a
    predicate or a built-in rule.

    Args:
        rule: A `keras.layers.Layer` subclass, a compiled regex, a string
            (a regular expression matched against the whole layer name), a
            function of the layer returning True for a match (a predicate),
            or one of kerasmp's built-in rules (`NORMALIZATION_BY_NAME`,
            `KNOWN_FLOAT16_HAZARDS`).
        argname: The argument the rule came from, for error messages.

    Raises:
        ValueError: `rule` is a string that is not a valid regex.
        TypeError: `rule` is anything else.
    """
    if isinstance(rule, (BuiltinRule, Exclude)):
        return rule
    if isinstance(rule, type) and issubclass(rule, keras.layers.Layer):
        return rule
    if isinstance(rule, (str, re.Pattern)):
        pattern = rule.pattern if isinstance(rule, re.Pattern) else rule
        try:
            NameMatcher(pattern)
            return rule if isinstance(rule, re.Pattern) else re.compile(rule)
        except (ValueError, re.error) as e:
            raise ValueError(
                f"Invalid `{argname}` entry: {pattern!r} is not a supported "
                f"regular expression ({e}). Allowed entries: "
                "keras.layers.Layer subclasses, or regular expressions "
                "(literals, classes, groups, |, * + ? {m,n}, ^ $) matched "
                "against the whole layer name."
            ) from None
    if callable(rule) and not isinstance(rule, type):
        return rule
    raise TypeError(
        f"Invalid `{argname}` entry: expected a keras.layers.Layer "
        "subclass, a regular expression (str) matched against the layer "
        "name, a predicate (a function of the layer returning True or "
        "False) or a kerasmp built-in rule (kerasmp.policy."
        "NORMALIZATION_BY_NAME, KNOWN_FLOAT16_HAZARDS). Received: "
        f"{rule!r} (of type {type(rule).__name__})"
    )


def rule_name(rule):
    if isinstance(rule, type):
        return rule.__name__
    if isinstance(rule, re.Pattern):
        return f"name~{rule.pattern!r}"
    return f"predicate {getattr(rule, '__qualname__', repr(rule))}"


def _function_to_config(fn, argname):
    registered = keras.saving.get_registered_name(fn)
    if registered != getattr(fn, "__name__", None):
        return {"registered_name": registered}
    qualname = getattr(fn, "__qualname__", "")
    module = getattr(fn, "__module__", None)
    if not module or not qualname or "<" in qualname:
        raise ValueError(
            f"The `{argname}` predicate {fn!r} cannot be saved: define it "
            "as a function at module level (or register it with "
            "keras.saving.register_keras_serializable) so that a saved "
            "policy can name it."
        )
    return {"module": module, "function": qualname}


def _function_from_config(config):
    """Finds a saved predicate without importing anything (like classes)."""
    if "registered_name" in config:
        fn = keras.saving.get_registered_object(config["registered_name"])
        name = config["registered_name"]
    else:
        fn = sys.modules.get(str(config.get("module")))
        for part in str(config.get("function", "")).split("."):
            fn = getattr(fn, part, None)
        name = config.get("function")
    if not callable(fn) or isinstance(fn, type):
        raise ValueError(
            f"Unknown predicate {name!r} in `float32_layers`: kerasmp does "
            "not import modules named by a file. Import the module that "
            "defines it before loading."
        )
    return fn


def rule_to_config(rule):
    if isinstance(rule, Exclude):
        return {"exclude": rule_to_config(rule.rule)}
    if isinstance(rule, BuiltinRule):
        return {"builtin": rule.key}
    if isinstance(rule, re.Pattern):
        return {"pattern": rule.pattern}
    if isinstance(rule, type):
        return _class_to_config(rule)
    return {"predicate": _function_to_config(rule, "float32_layers")}


def rule_from_config(config):
    if not isinstance(config, dict):
        raise ValueError(f"Invalid `float32_layers` entry: {config!r:.200}")
    if "exclude" in config:
        return Exclude(parse_rule(rule_from_config(
            config["exclude"])))
    if "builtin" in config:
        rule = BUILTIN_RULES.get(config["builtin"])
        if rule is None:
            raise ValueError(
                f"Unknown built-in rule {config['builtin']!r} in "
                f"`float32_layers`; this kerasmp knows "
                f"{sorted(BUILTIN_RULES)}."
            )
        return rule
    if "pattern" in config:
        return config["pattern"]
    if "predicate" in config:
        return _function_from_config(config["predicate"])
    return _class_from_config(config)


def activation_name(layer):
    activation = getattr(layer, "activation", None)
    return getattr(activation, "__name__", None)


def _class_to_config(cls):
    registered = keras.saving.get_registered_name(cls)
    if registered != cls.__name__:
        return {"registered_name": registered}
    return {"module": cls.__module__, "class_name": cls.__qualname__}


def _class_from_config(config):
    """Finds a saved rule's layer class without importing anything.

    A file names the class; kerasmp looks it up in Keras's registry or in a
    module that is already imported, so loading a file never imports (and
    runs) a module it names.
    """
    if not isinstance(config, dict):
        raise ValueError(f"Invalid `float32_layers` entry: {config!r:.200}")
    name = config.get("registered_name") or config.get("class_name")
    if "registered_name" in config:
        cls = keras.saving.get_registered_object(config["registered_name"])
    else:
        obj = sys.modules.get(str(config.get("module")))
        for part in str(config.get("class_name", "")).split("."):
            obj = getattr(obj, part, None)
        cls = obj
    if not (isinstance(cls, type) and issubclass(cls, keras.layers.Layer)):
        raise ValueError(
            f"Unknown layer class {name!r} in `float32_layers`: kerasmp "
            "does not import modules named by a file. Import the module "
            "that defines it before loading."
        )
    return cls


_BUILTIN_NAMES = {"normalization_by_name": "NORMALIZATION_BY_NAME",
                  "known_float16_hazards": "KNOWN_FLOAT16_HAZARDS"}


def default_rule_name(rule):
    """How the docs name a rule of `DEFAULT_FLOAT32_LAYERS`."""
    if isinstance(rule, BuiltinRule):
        return _BUILTIN_NAMES.get(rule.key, rule.key)
    if isinstance(rule, type) and getattr(keras.layers, rule.__name__,
                                          None) is rule:
        return f"keras.layers.{rule.__name__}"
    return rule_name(rule)


def with_defaults(rules, defaults, use_defaults):
    """A policy's rules: `rules`, then the built-in `defaults` that `rules`
    does not hold (`rules` alone when `use_defaults` is False).

    A list that holds some of the defaults but not all was written for
    kerasmp 0.1.0, where `float32_layers` replaced the defaults, to drop
    the others: they now stay, and a `PolicyWarning` says so.
    """
    if not use_defaults:
        return rules
    missing = tuple(d for d in defaults if d not in rules)
    if missing and len(missing) < len(defaults):
        names = ", ".join(default_rule_name(d) for d in missing)
        warn(
            f"kerasmp.Policy: `float32_layers` lists some of the built-in "
            f"rules (kerasmp.DEFAULT_FLOAT32_LAYERS) but not {names}; "
            "they still apply, since `float32_layers` adds to the built-in "
            "rules. To drop them, pass `float32_defaults=False` with the "
            "list of the rules to keep.",
            PolicyWarning,
        )
    return rules + missing


def rule_sequence(value, argname):
    if isinstance(value, (str, type, re.Pattern)) or (
            callable(value) and not isinstance(value, (list, tuple))):
        raise TypeError(
            f"`{argname}` must be a sequence (list or tuple) of layer "
            "classes, regular expressions and/or predicates, not a single "
            f"entry. Received: {value!r}"
        )
    try:
        return tuple(value)
    except TypeError:
        raise TypeError(
            f"`{argname}` must be a sequence of layer classes, regular "
            f"expressions and/or predicates. Received: {value!r}"
        ) from None


def measured_entries(measured):
    """The checked `measured` argument of `Policy`: `{path: {"rule": str,
    "portable": bool}}` for a layer moved to float32, `{"half": True}` for
    a sublayer of one that computes in the governing policy."""
    if measured is None or (isinstance(measured, dict) and not measured):
        return {}
    entries = {}
    items = measured.items() if isinstance(measured, dict) else None
    for path, entry in items or [(None, None)]:
        half = isinstance(entry, dict) and entry.get("half") is True
        if not (isinstance(path, str) and isinstance(entry, dict)
                and (half or isinstance(entry.get("rule"), str))
                and isinstance(entry.get("portable", False), bool)):
            raise ValueError(
                "Invalid `measured` for kerasmp.Policy: expected "
                "{layer path: {'rule': str, 'portable': bool} or "
                f"{{'half': True}}}}. Received: {measured!r:.200}")
        entries[path] = {"half": True} if half else {
            "rule": entry["rule"], "portable": entry.get("portable", False)}
    return entries


AS_COMPUTED = set()  # ids of layers handing their outputs on as computed


@contextlib.contextmanager
def outputs_as_computed(layers):
    """`layers` hand their outputs on as computed (as in stock Keras)
    while the block runs."""
    ids = {id(layer) for layer in layers} - AS_COMPUTED
    AS_COMPUTED.update(ids)
    try:
        yield
    finally:
        AS_COMPUTED.difference_update(ids)
