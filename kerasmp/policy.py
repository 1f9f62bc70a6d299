"""Mixed-precision dtype policies with per-layer float32 overrides.

`Policy` is a real `keras.DTypePolicy`: pass it wherever Keras takes a dtype
policy. What it adds is a list of layers that must compute in float32 even
when the policy computes in float16 or bfloat16: softmax and normalization
layers by default, plus any layer class or layer-name pattern the user names.

How the override reaches layers: a layer's policy is whatever Keras stored in
`layer._dtype_policy` (the global policy when `dtype=None`, or the parent's
policy for layers such as the `Softmax` inside `MultiHeadAttention`). When that
stored policy is a `kerasmp.Policy`, a descriptor (at the end of this module)
resolves it against the layer each time Keras reads it
(`Policy.policy_for(layer)`), so the rules also apply
to nested layers and to attributes set after `super().__init__()`
(an `Activation` layer's activation, say). Any other policy, including an
explicit `dtype=` given by the user, is returned untouched and so wins.

Length: `Policy`, its float32 rules and the global-policy helpers; the
patches that resolve, hand back, save and load it at the bottom of this
module (the compile patch in `kerasmp._compile`), the pattern matcher in
`kerasmp._namematch`.
"""

import contextlib
import functools
import re
import sys
import threading

import keras

from kerasmp import _keras_internals as _ki
from kerasmp import _norm_rule
from kerasmp import float8 as _float8
from kerasmp._namematch import NameMatcher
from kerasmp._policy_marker import Marked

_FLOAT_NAMES = ("mixed_float16", "mixed_bfloat16", "float16", "bfloat16",
                "float32", "float64") + tuple(_float8.FLOAT8_NAMES)
_SOFTMAX_ACTIVATIONS = ("softmax", "log_softmax")


def _normalization_layers():
    return _norm_rule.KERAS_NORMALIZATION_CLASSES


NORMALIZATION_BY_NAME = _norm_rule.NORMALIZATION_BY_NAME
"""The structural name rule for normalizations Keras does not define
(`T5LayerNorm`, `MistralLayerNormalization`, a user's `RMSNorm`, ...): a
layer whose class name ends in "Norm" or "Normalization" and that holds no
compute-heavy sublayer or kernel (see docs/policies.md)."""

KNOWN_FLOAT16_HAZARDS = _norm_rule.FLOAT16_HAZARDS
"""Classes that compute NaN/inf in float16 only (keras-hub's
`T5MultiHeadAttention` and its `-1e9` mask bias), kept in float32 under
float16 policies; their Dense sublayers stay float16."""

DEFAULT_FLOAT32_LAYERS = (
    (keras.layers.Softmax,) + _normalization_layers()
    + (NORMALIZATION_BY_NAME, KNOWN_FLOAT16_HAZARDS)
)
"""Layers a `Policy` computes in float32 unless told otherwise.

Softmax, every Keras normalization layer, `NORMALIZATION_BY_NAME` (the
normalizations of model libraries and users) and `KNOWN_FLOAT16_HAZARDS`.
`keras.layers.Softmax` in the list also covers every layer whose `activation`
is softmax or log_softmax (`Activation("softmax")`,
`Dense(n, activation="softmax")`): their output is a softmax, and a float16
softmax over more than ~65k classes overflows its denominator and returns
zeros without any NaN to warn you.
"""

_KERAS_DEFAULT_CLASSES = (keras.layers.Softmax,) + _normalization_layers()


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
    if isinstance(rule, (_norm_rule.BuiltinRule, _norm_rule.Exclude)):
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


def _rule_name(rule):
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


def _rule_to_config(rule):
    if isinstance(rule, _norm_rule.Exclude):
        return {"exclude": _rule_to_config(rule.rule)}
    if isinstance(rule, _norm_rule.BuiltinRule):
        return {"builtin": rule.key}
    if isinstance(rule, re.Pattern):
        return {"pattern": rule.pattern}
    if isinstance(rule, type):
        return _class_to_config(rule)
    return {"predicate": _function_to_config(rule, "float32_layers")}


def _rule_from_config(config):
    if not isinstance(config, dict):
        raise ValueError(f"Invalid `float32_layers` entry: {config!r:.200}")
    if "exclude" in config:
        return _norm_rule.Exclude(parse_rule(_rule_from_config(
            config["exclude"])))
    if "builtin" in config:
        rule = _norm_rule.BUILTIN_RULES.get(config["builtin"])
        if rule is None:
            raise ValueError(
                f"Unknown built-in rule {config['builtin']!r} in "
                f"`float32_layers`; this kerasmp knows "
                f"{sorted(_norm_rule.BUILTIN_RULES)}."
            )
        return rule
    if "pattern" in config:
        return config["pattern"]
    if "predicate" in config:
        return _function_from_config(config["predicate"])
    return _class_from_config(config)


def _activation_name(layer):
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


@keras.saving.register_keras_serializable(package="kerasmp")
class Float32Override(Marked, keras.DTypePolicy):
    """The float32 policy a `Policy` gives the layers its rules match.

    It computes and stores variables in float32 like
    `keras.DTypePolicy("float32")`, and remembers which kerasmp policy and
    rule put the layer there, so that a saved model reloads with the same
    dtypes and `dtype_report` can say why.

    Args:
        policy: The `kerasmp.Policy` whose rule matched.
        rule: The description of the rule, as `Policy.float32_rule` gives it.
    """

    WHY = "rule"

    def __init__(self, policy, rule):
        super().__init__("float32")
        self.policy = policy
        self.rule = rule


@keras.saving.register_keras_serializable(package="kerasmp")
class Policy(keras.DTypePolicy):
    """A `keras.DTypePolicy` that keeps fragile layers in float32.

    Layers governed by this policy compute in the policy's compute dtype,
    except the layers matched by `float32_layers`, which compute in float32
    with float32 variables. Inside a model such a layer hands its output on
    in the policy's compute dtype, so it composes with the half-precision
    tensors around it (a post-LN residual `x + norm(x)` works); the outputs
    of the model itself (or of an overridden layer called on its own) are
    the float32 values, so the probabilities that reach a loss are float32.
    A layer is governed by the policy when it was built with `dtype=None`
    while this policy was global, or was handed this policy by its parent
    layer. A layer built with any other explicit
    `dtype=` keeps that dtype.

    Args:
        name: The policy name, any name `keras.DTypePolicy` accepts for a
            floating-point policy: `"mixed_float16"`, `"mixed_bfloat16"`,
            `"float16"`, `"bfloat16"`, `"float32"` or `"float64"`.
        float32_layers: A sequence of rules: `keras.layers.Layer`
            subclasses, regular expressions, predicates and kerasmp's
            built-in rules. A layer matches when it is an instance of one of
            the classes, when a regular expression matches its whole `name`
            (`re.fullmatch`), when a predicate (a module-level function of
            the layer, called once the layer is constructed) returns True,
            or when a built-in rule matches it. `keras.layers.Softmax` also
            matches layers whose `activation` is softmax or log_softmax.
            Defaults to `DEFAULT_FLOAT32_LAYERS`: softmax, every Keras
            normalization layer, `NORMALIZATION_BY_NAME` (normalizations
            that model libraries and users define, such as keras-hub's
            `T5LayerNorm` or a `class RMSNorm(keras.layers.Layer)`) and
            `KNOWN_FLOAT16_HAZARDS`. Add to it with
            `[*kerasmp.DEFAULT_FLOAT32_LAYERS, MyLayer]`; pass `()` for no
            overrides.
        float32_exclude: A sequence of layer classes, regular expressions
            and predicates (as in `float32_layers`): a layer they match is
            never put in float32 by `float32_layers`, whatever rule would
            match it. Defaults to `()`.
        float8: For the float8 names only (`"float8_mixed_bfloat16"`,
            `"float8_mixed_float16"`): a `kerasmp.float8.Float8Rule` saying
            which Dense/EinsumDense layers train in Keras's float8 mode
            (assigned at `compile`, see `kerasmp.float8`). Defaults to
            `Float8Rule()`. Every other layer computes as under the base
            policy (`"mixed_bfloat16"` / `"mixed_float16"`).

    Example:

    >>> import kerasmp
    >>> kerasmp.set_global_policy(kerasmp.Policy("mixed_float16"))
    >>> keras.layers.Dense(4).compute_dtype
    'float16'
    >>> keras.layers.Softmax().compute_dtype
    'float32'
    >>> class RMSNorm(keras.layers.Layer):
    ...     def call(self, x):
    ...         return x * keras.ops.rsqrt(keras.ops.mean(x * x, -1, True))
    >>> RMSNorm().compute_dtype  # normalization by name
    'float32'
    >>> kerasmp.set_global_policy("float32")
    """

    def __init__(self, name="mixed_float16",
                 float32_layers=DEFAULT_FLOAT32_LAYERS, float32_exclude=(),
                 float8=None):
        if not isinstance(name, str) or name not in _FLOAT_NAMES:
            raise ValueError(
                f"Invalid `name` for kerasmp.Policy: {name!r}. Allowed "
                f"values: {', '.join(_FLOAT_NAMES)}."
            )
        if isinstance(float32_layers, (str, type, re.Pattern)):
            raise TypeError(
                "`float32_layers` must be a sequence (list or tuple) of layer "
                "classes and/or regular expressions, not a single entry. "
                f"Received: {float32_layers!r}"
            )
        try:
            rules = tuple(float32_layers)
        except TypeError:
            raise TypeError(
                "`float32_layers` must be a sequence of layer classes and/or "
                f"regular expressions. Received: {float32_layers!r}"
            ) from None
        excludes = _rule_sequence(float32_exclude, "float32_exclude")
        for entry in excludes:
            if isinstance(entry, (_norm_rule.BuiltinRule,
                                  _norm_rule.Exclude)):
                raise TypeError(
                    "Invalid `float32_exclude` entry: expected a layer "
                    "class, a regular expression or a predicate. To drop a "
                    "built-in rule, leave it out of `float32_layers`. "
                    f"Received: {entry!r}"
                )
        self._float8 = _float8.rule_for(name, float8)
        install()
        super().__init__(name)
        self._rules = tuple(
            _norm_rule.Exclude(parse_rule(r, "float32_exclude"))
            for r in excludes
        ) + tuple(parse_rule(r) for r in rules)
        self._matchers = {
            r.pattern: NameMatcher(r.pattern)
            for r in (getattr(r, "rule", r) for r in self._rules)
            if isinstance(r, re.Pattern)
        }
        self._overrides = {}  # rule description -> Float32Override
        # (layer class, name, activation) -> rule description or None, so
        # that each layer is matched once, not on every dtype lookup.
        self._decisions = {}

    def _parse_name(self, name):
        # A float8 name computes like its base policy (kerasmp.float8).
        base = keras.DTypePolicy(_float8.base_name(name))
        return base.compute_dtype, base.variable_dtype

    @property
    def float8(self):
        """The `Float8Rule` of a float8 policy, else None."""
        return self._float8

    def stock_policy(self):
        """The stock Keras policy a saved file holds for Keras without
        kerasmp (the base policy of a float8 name)."""
        return keras.DTypePolicy(_float8.base_name(self.name))

    @property
    def float32_layers(self):
        """The rules: layer classes, compiled regexes, predicates and
        built-in rules, after the `float32_exclude` entries (each wrapped
        so that `Policy(name, float32_layers=p.float32_layers)` excludes
        the same layers)."""
        return self._rules

    @property
    def has_float16_compute(self):
        """Whether layers under this policy compute in float16."""
        return self.compute_dtype == "float16"

    def float32_rule(self, layer):
        """Returns the rule that puts `layer` in float32, or None.

        Args:
            layer: A `keras.layers.Layer`.

        Returns:
            A short description of the matching rule: what kind of rule
            matched, then its detail: `"Keras class (LayerNormalization)"`,
            `"Keras class (Softmax: activation=softmax)"`,
            `"normalization by name (T5LayerNorm)"`,
            `"known float16 hazard (T5MultiHeadAttention)"`,
            `"user rule (name~'head.*')"`, `"user rule (MyBlock)"` or
            `"user rule (predicate is_norm)"`; or None.
        """
        activation = _activation_name(layer)
        key = (type(layer), layer.name, activation)
        try:
            return self._decisions[key]
        except KeyError:
            pass
        decision, final = self._match(layer, activation)
        if final:
            self._decisions[key] = decision
        return decision

    def _matches(self, rule, layer, activation):
        """(detail or None, final): final is False while a rule cannot
        judge the layer yet (its `__init__` is running)."""
        if isinstance(rule, re.Pattern):
            if self._matchers[rule.pattern].fullmatch(layer.name or ""):
                return f"name~{rule.pattern!r}", True
            return None, True
        if isinstance(rule, type):
            if isinstance(layer, rule):
                return rule.__name__, True
            if (rule is keras.layers.Softmax
                    and activation in _SOFTMAX_ACTIVATIONS):
                return f"Softmax: activation={activation}", True
            return None, True
        if isinstance(rule, _norm_rule.BuiltinRule):
            if rule.float16_only and self.compute_dtype != "float16":
                return None, True
            detail = rule.match(layer)
            if detail is _norm_rule.UNDECIDED:
                return None, False
            return detail, True
        if _norm_rule.in_construction(layer):
            return None, False
        return (_rule_name(rule) if rule(layer) else None), True

    def _match(self, layer, activation):
        final = True
        for rule in self._rules:
            exclude = isinstance(rule, _norm_rule.Exclude)
            detail, decided = self._matches(
                rule.rule if exclude else rule, layer, activation)
            final = final and decided
            if detail is None:
                continue
            if exclude:
                return None, final
            if isinstance(rule, _norm_rule.BuiltinRule):
                return f"{rule.kind} ({detail})", final
            if rule in _KERAS_DEFAULT_CLASSES:
                return f"Keras class ({detail})", final
            return f"user rule ({detail})", final
        return None, final

    def policy_for(self, layer):
        """Returns the policy `layer` actually computes with.

        Args:
            layer: A `keras.layers.Layer` whose stored policy is this one.

        Returns:
            A `Float32Override` when `layer` matches `float32_layers` and
            this policy does not already compute in float32 or float64, else
            this policy.
        """
        if self.compute_dtype in ("float32", "float64"):
            return self
        rule = self.float32_rule(layer)
        if rule is None:
            return self
        if rule not in self._overrides:
            self._overrides[rule] = Float32Override(self, rule)
        return self._overrides[rule]

    def get_config(self):
        rules = [_rule_to_config(rule) for rule in self._rules]
        config = {"name": self.name, "float32_layers": rules}
        if self._float8 is not None:
            config["float8"] = self._float8.get_config()
        return config

    @classmethod
    def from_config(cls, config):
        config = dict(config)
        rules = config.pop("float32_layers", None)
        if rules is None:
            return cls(**config)
        if not isinstance(rules, (list, tuple)):
            raise ValueError(
                f"Invalid `float32_layers` in a saved policy: {rules!r:.200}")
        parsed = [_rule_from_config(r) for r in rules]
        return cls(float32_layers=parsed, **config)

    def __eq__(self, other):
        # The rules themselves, not `get_config()`: a lambda predicate
        # cannot be saved, but its policy can still be compared.
        return (
            isinstance(other, Policy)
            and self.name == other.name
            and self.float32_layers == other.float32_layers
        )

    def __hash__(self):
        return hash((self.name, len(self._rules)))

    def __repr__(self):
        n = len(self._rules)
        return f'<kerasmp.Policy "{self.name}", {n} float32 rules>'


def _rule_sequence(value, argname):
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


def _as_policy(policy_or_name, argname="policy"):
    if isinstance(policy_or_name, keras.DTypePolicy):
        return policy_or_name
    if isinstance(policy_or_name, str):
        return Policy(policy_or_name)
    raise TypeError(
        f"`{argname}` must be a policy name ({', '.join(_FLOAT_NAMES)}), a "
        f"kerasmp.Policy or a keras.DTypePolicy. Received: {policy_or_name!r}"
    )


def set_global_policy(policy_or_name):
    """Sets the global dtype policy that layers built afterwards use.

    A name is turned into `kerasmp.Policy(name)` with the default float32
    layers; `set_global_policy("float32")` goes back to plain float32. While
    a float16 `kerasmp.Policy` governs a model's layers, `model.compile()`
    wraps a plain optimizer in `kerasmp.LossScaleOptimizer` (see
    `kerasmp._compile`).

    Args:
        policy_or_name: A policy name (`"mixed_float16"`, `"mixed_bfloat16"`,
            `"float32"`, ...), a `kerasmp.Policy` or a `keras.DTypePolicy`.

    Example:

    >>> kerasmp.set_global_policy("mixed_float16")
    >>> model = keras.Sequential([keras.Input((8,)), keras.layers.Dense(2)])
    >>> kerasmp.set_global_policy("float32")
    """
    keras.config.set_dtype_policy(_as_policy(policy_or_name))


def global_policy():
    """Returns the global dtype policy (a `keras.DTypePolicy`)."""
    return keras.config.dtype_policy()


@contextlib.contextmanager
def policy_scope(policy_or_name):
    """Context manager that sets the global policy and restores the old one.

    Args:
        policy_or_name: As for `set_global_policy`.

    Example:

    >>> with kerasmp.policy_scope("mixed_bfloat16"):
    ...     layer = keras.layers.Dense(2)
    >>> layer.compute_dtype
    'bfloat16'
    """
    previous = global_policy()
    set_global_policy(policy_or_name)
    try:
        yield global_policy()
    finally:
        keras.config.set_dtype_policy(previous)


def stored_policy(layer):
    """Returns the policy stored on `layer`, before kerasmp's resolution.

    None while `Layer.__init__` has not stored one yet.
    """
    return _ki.stored_dtype_policy(layer)


def float32_rule(layer, policy=None):
    """Returns the kerasmp rule that computes `layer` in float32, or None.

    Args:
        layer: A `keras.layers.Layer`.
        policy: The `kerasmp.Policy` whose rules to apply. Defaults to the
            layer's own kerasmp policy, or `Policy()` with the default rules
            when the layer is not governed by one.
    """
    if policy is None:
        stored = stored_policy(layer)
        policy = stored if isinstance(stored, Policy) else Policy()
    return policy.float32_rule(layer)


# =============================================================================
# The patches that make Keras honour a kerasmp policy. All are installed by
# `install()` (on the first import of this module) and removed by
# `uninstall()`, and all do nothing for layers that no `kerasmp.Policy`
# governs. Every Keras class, module and private name they patch comes from
# `kerasmp._keras_internals` (docs/architecture.md). The compile patch is in
# `kerasmp._compile` (above this module); `kerasmp.install()` and
# `kerasmp.uninstall()` cover both.
#
# 1. Resolution. `keras.layers.Layer._dtype_policy` becomes a data
#    descriptor: Keras keeps writing the layer's policy to it (stored in the
#    instance `__dict__`); reading it returns `policy.policy_for(layer)` when
#    the stored policy is a `kerasmp.Policy`, the stored policy otherwise.
#    Every Keras read of a compute or variable dtype goes through it, so one
#    rule covers `dtype=None` layers, layers handed a parent's policy (the
#    `Softmax` inside `MultiHeadAttention`) and attributes set after
#    `Layer.__init__`.
# 2. Hand-back. A layer a kerasmp rule keeps in float32, called inside
#    another layer or model, hands its floating outputs back in the governing
#    policy's compute dtype (as stock BatchNormalization does); the outputs of
#    the outermost call stay the float32 values computed.
# 3. Saving and loading. A kerasmp policy is saved as the stock
#    `keras.DTypePolicy` plain Keras can load (a stock normalization layer's
#    override under the governing mixed policy, which stock Keras computes
#    the same way: `portable_policy_name`) plus a `"kerasmp"` entry stock
#    Keras ignores; with kerasmp, `dtype_policies.deserialize` rebuilds the
#    kerasmp policy (only kerasmp's own classes) and `Operation.from_config`
#    passes the policy object to the constructor with it made global while
#    the constructor runs (sublayers created in `__init__` get it too).
# =============================================================================

_originals = {}  # what install() replaced, for uninstall()
_installed = False


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
        if isinstance(stored, Policy):
            return stored.policy_for(layer)
        return stored

    def __set__(self, layer, value):
        layer.__dict__[_ki.DTYPE_POLICY_ATTR] = value


_calls = threading.local()  # depth of nested Layer.__call__, float32 outputs


def handoff_dtype(layer):
    """The dtype in which `layer` hands its float outputs on inside a model.

    A layer that a kerasmp rule keeps in float32 computes in float32 but
    passes its outputs to the layers after it in the governing policy's
    compute dtype (see `Policy`); every other layer passes them on as
    computed, and this function returns None.

    Args:
        layer: A `keras.layers.Layer`.

    Example:

    >>> kerasmp.set_global_policy("mixed_float16")
    >>> kerasmp.policy.handoff_dtype(keras.layers.LayerNormalization())
    'float16'
    """
    stored = stored_policy(layer)
    if not isinstance(stored, Policy) or stored.policy_for(layer) is stored:
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


def hand_back(outputs, dtype, originals=None):
    """A float32 layer's outputs, cast to the half-precision `dtype` of
    the layer they are handed to (the one hand-back cast of kerasmp).

    Every float32 (or float64) backend tensor in the structure is cast to
    `dtype`, keeping its Keras mask; symbolic `KerasTensor`s, integer
    tensors and non-tensors pass unchanged. Used by the `Layer.__call__`
    wrapper below (through `handoff_dtype`) and by the exported
    `HalfModel` (`kerasmp/_half.py`).

    Args:
        outputs: A tensor or a structure of tensors.
        dtype: The compute dtype to hand back in, e.g. `"float16"`.
        originals: Optional dict: `id(cast)` maps to `(cast, original)`
            for each tensor cast, so the outermost call can give the
            float32 originals back.

    Example:

    >>> y = kerasmp.policy.hand_back(keras.ops.ones((2,)), "float16")
    >>> keras.backend.standardize_dtype(y.dtype)
    'float16'
    """

    def cast(x):
        if not _is_castable(x, dtype):
            return x
        y = keras.ops.cast(x, dtype)
        mask = _ki.get_keras_mask(x)
        if mask is not None:
            _ki.set_keras_mask(y, mask)
        if originals is not None:
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
            outputs = hand_back(outputs, target, originals)
    elif originals:
        outputs = _restore_float32(outputs, originals)
        _calls.originals = {}
    return outputs


_KERASMP_KEY = "kerasmp"
_SAVED_CLASSES = {
    cls.__name__: cls
    for cls in (Policy, Float32Override) + _float8.POLICY_CLASSES
}


# Stock normalization layers: float32 arithmetic inside, output in the
# compute dtype (BatchNormalization, LayerNormalization, GroupNormalization
# upcast and cast back).
_UPCASTING_CLASSES = ("BatchNormalization", "LayerNormalization",
                      "GroupNormalization")


def portable_policy_name(policy):
    """The stock policy name a kerasmp policy is saved under.

    A kerasmp float32 override of a stock normalization layer (its rule
    names the class: `"Keras class (LayerNormalization)"`) is saved as its
    governing policy's name (`"mixed_float16"`): stock Keras then rounds the
    layer's input to float16, computes in float32 with float32 weights and
    returns float16, which is what kerasmp computes inside a model (the
    hand-back above). Saved as `"float32"`, a load without kerasmp returned
    unrounded float32 outputs into residual adds, and lost the rounding of
    the input where a container whose `from_config` drops its dtype (a
    nested `Sequential`: ConvNeXt) used to do it. Any other policy keeps
    its own name.
    """
    if isinstance(policy, Float32Override):
        rule = policy.rule or ""
        detail = rule[rule.find("(") + 1:-1] if rule.endswith(")") else rule
        governing = policy.policy
        if (detail in _UPCASTING_CLASSES and isinstance(governing, Policy)
                and governing.compute_dtype in ("float16", "bfloat16")):
            return _float8.base_name(governing.name)  # a name Keras knows
    return policy.name


def _serialize(policy):
    """`dtype_policies.serialize` that stock Keras can read back."""
    if not isinstance(policy, tuple(_SAVED_CLASSES.values())):
        return _originals["serialize"](policy)
    stock = getattr(policy, "stock_policy", None)  # float8 policies
    stock = stock() if stock else keras.DTypePolicy(
        portable_policy_name(policy))
    config = _originals["serialize"](stock)
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
    cls = _SAVED_CLASSES.get(name)
    if cls is None or not isinstance(entry.get("config"), dict):
        raise ValueError(
            "Invalid kerasmp dtype policy in the saved file: expected "
            f"{sorted(_SAVED_CLASSES)} with a config dict. Received: "
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
    if not isinstance(policy, (Policy, Float32Override)):
        return original(cls, config)
    # Build the layer the way it was built before saving: with its kerasmp
    # policy global, whatever the global policy of the loading process.
    governing = policy if isinstance(policy, Policy) else policy.policy
    previous = keras.config.dtype_policy()
    keras.config.set_dtype_policy(governing)
    try:
        return original(cls, {**config, "dtype": policy})
    finally:
        keras.config.set_dtype_policy(previous)


def install():
    """Installs the patches above into Keras (idempotent).

    Importing this module and creating a `Policy` install them; they act
    only on layers whose policy is a kerasmp one. `kerasmp.install()` also
    installs the compile patch.
    """
    global _installed
    if not _installed:
        operation = _ki.operation_class()
        modules = _ki.dtype_policy_modules()
        _originals.update(
            __call__=keras.layers.Layer.__call__,
            from_config=operation.from_config.__func__,
            serialize=modules[0].serialize,
            deserialize=modules[0].deserialize,
        )
        _ki.install_dtype_policy_descriptor(_ResolvedDTypePolicy())
        keras.layers.Layer.__call__ = functools.wraps(_originals["__call__"])(
            _layer_call
        )
        operation.from_config = classmethod(
            functools.wraps(_originals["from_config"])(_from_config)
        )
        for module in modules:
            module.serialize = _serialize
            module.deserialize = _deserialize
        _installed = True


def uninstall():
    """Removes the patches above (`kerasmp.uninstall()` removes the compile
    patch too). Layers built under a `kerasmp.Policy` keep it, but then
    compute in its dtype without float32 overrides."""
    global _installed
    if not _installed:
        return
    _ki.remove_dtype_policy_descriptor()
    keras.layers.Layer.__call__ = _originals["__call__"]
    _ki.operation_class().from_config = classmethod(_originals["from_config"])
    for module in _ki.dtype_policy_modules():
        module.serialize = _originals["serialize"]
        module.deserialize = _originals["deserialize"]
    _installed = False


def is_installed():
    """Whether the hooks are in place."""
    return _installed


install()
