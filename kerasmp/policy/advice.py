"""What `compile` says about a policy that cannot do what the code asks.

Two mistakes leave a model in another precision than its code reads, and
nothing fails:

- a name pattern in `float32_layers` (or `float32_exclude`) that matches no
  layer of the model: a misspelt `"logit"` keeps nothing in float32;
- a half-precision `kerasmp.Policy` set after the model was built: its
  layers took the policy in force when they were built (float32), so it
  trains in float32 with no loss scaling.

kerasmp's compile patch (`kerasmp._patches._compile`) calls
`warn_about_policy(model, plan)`, which warns once per model (and
pattern), located at the user's `compile` call. `export`'s `keep_float32`
refuses an unmatched pattern with the same description of the nearest
layer names (`matches_a_layer`, `nearest_layers`, `class_hint`).
"""

import difflib
import re
import weakref

import keras

from kerasmp._utils.namematch import NameMatcher
from kerasmp._utils.warn import warn
from kerasmp.errors import PolicyWarning
from kerasmp.policy.norms import Exclude
from kerasmp.policy.plan import plan_of
from kerasmp.policy.policy import Policy

_HALF = ("float16", "bfloat16")
_warned = weakref.WeakKeyDictionary()  # model -> what it was warned about


def model_layers(model):
    """The layers of `model` a rule can match, the model first (no
    `InputLayer`), as its plan lists them (`kerasmp.policy.plan.plan_of`)."""
    return [model] + [layer for _, layer in plan_of(model).walk()
                      if not isinstance(layer, keras.layers.InputLayer)]


def matches_a_layer(pattern, layers):
    """Whether the name regex `pattern` (a compiled `re.Pattern`) matches
    the whole name of one of `layers`, as a policy matches it."""
    matcher = NameMatcher(pattern.pattern)
    return any(matcher.fullmatch(layer.name or "") for layer in layers)


def nearest_layers(pattern, layers):
    """`layers` sorted by how close their name is to `pattern`'s text
    (case ignored), the nearest first; ties keep the model's order."""
    text = pattern.pattern.lower()

    def distance(layer):
        ratio = difflib.SequenceMatcher(
            None, text, (layer.name or "").lower()).ratio()
        return -ratio

    return sorted(layers, key=distance)


def describe(layers):
    """`'name' (Class), ...` for a no-match message."""
    return ", ".join(f"{l.name!r} ({type(l).__name__})" for l in layers)


def class_hint(pattern, layers):
    """`"; to keep every X layer, pass the class ..."` when `pattern` is
    the name of one of `layers`' classes, else `""`."""
    classes = {type(l).__name__: type(l) for l in layers}
    cls = classes.get(pattern.pattern)
    if cls is None:
        return ""
    name = (f"keras.layers.{cls.__name__}"
            if getattr(keras.layers, cls.__name__, None) is cls
            else "itself")
    return (f"; to match every {cls.__name__} layer, pass the class "
            f"{name}")


_NEAREST = 3
"""How many layer names a compile warning names."""


def _user_patterns(policy):
    """`(argument, compiled pattern)` for the name patterns of `policy`."""
    for rule in policy.float32_layers:
        if isinstance(rule, Exclude):
            if isinstance(rule.rule, re.Pattern):
                yield "float32_exclude", rule.rule
        elif isinstance(rule, re.Pattern):
            yield "float32_layers", rule


def _once(model, key):
    try:
        keys = _warned.setdefault(model, set())
    except TypeError:  # not weakly referenceable: warn every time
        return True
    if key in keys:
        return False
    keys.add(key)
    return True


def warn_unmatched_patterns(model, policy, layers):
    """Warns (`PolicyWarning`) for each name pattern of `policy` that
    matches no layer of `model`, naming the nearest layer names."""
    for argname, pattern in _user_patterns(policy):
        if matches_a_layer(pattern, layers):
            continue
        if not _once(model, (argname, pattern.pattern)):
            continue
        nearest = describe(nearest_layers(pattern, layers[1:])[:_NEAREST])
        verb = "keeps" if argname == "float32_layers" else "excludes"
        warn(
            f"kerasmp: the `{argname}` pattern {pattern.pattern!r} of the "
            f"policy {policy.name!r} matches no layer of {model.name!r}, "
            f"so it {verb} nothing (a pattern must match a whole layer "
            f"name, case included); the nearest layer names: {nearest}"
            f"{class_hint(pattern, layers)}. Fix the pattern in "
            f"kerasmp.Policy({argname}=[...]). (This warning is shown once "
            "per model and pattern.)",
            PolicyWarning,
        )


def warn_if_built_before_policy(model, plan, layers):
    """Warns (`PolicyWarning`) when the global policy is a half-precision
    `kerasmp.Policy` but no layer of `model` computes in half precision
    and none is governed by a half-precision kerasmp policy: the model was
    built (or loaded) before that policy was set."""
    policy = keras.config.dtype_policy()
    if not isinstance(policy, Policy) or policy.compute_dtype not in _HALF:
        return
    if plan.policy is not None and plan.policy.compute_dtype in _HALF:
        return  # governed by one: its float32 layers are its rules' doing
    if len(layers) < 2 or any(l.compute_dtype in _HALF for l in layers):
        return
    if not _once(model, "built before the policy"):
        return
    warn(
        f"kerasmp: the global policy is kerasmp.Policy({policy.name!r}), "
        f"but {model.name!r} was built before it was set: its layers "
        "compute in float32 (the policy in force when they were built), "
        "so it trains in float32 and compile adds no loss scaling. Call "
        f"kerasmp.set_global_policy({policy.name!r}) before building the "
        "model (for a model loaded from a file: build it from code under "
        "the policy, then load_weights). (This warning is shown once per "
        "model.)",
        PolicyWarning,
    )


def warn_about_policy(model, plan):
    """The warnings of `compile` (see the module docstring).

    Args:
        model: The `keras.Model` being compiled.
        plan: Its `kerasmp.policy.plan.Plan`.
    """
    layers = model_layers(model)
    if plan.policy is not None:
        warn_unmatched_patterns(model, plan.policy, layers)
    warn_if_built_before_policy(model, plan, layers)
