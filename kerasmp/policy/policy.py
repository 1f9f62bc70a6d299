"""Mixed-precision dtype policies with per-layer float32 overrides.

`Policy` is a real `keras.DTypePolicy`: pass it wherever Keras takes a dtype
policy. What it adds is a list of layers that must compute in float32 even
when the policy computes in float16 or bfloat16: softmax and normalization
layers by default, plus any layer class or layer-name pattern the user names.

How the override reaches layers: a layer's policy is whatever Keras stored in
`layer._dtype_policy` (the global policy when `dtype=None`, or the parent's
policy for layers such as the `Softmax` inside `MultiHeadAttention`). When that
stored policy is a `kerasmp.Policy`, the resolution patch (`kerasmp._patches`)
resolves it against the layer each time Keras reads it
(`Policy.policy_for(layer)`), so the rules also apply to nested layers and
to attributes set after `super().__init__()` (an `Activation` layer's
activation, say). Any other policy, including an explicit `dtype=` given by
the user, is returned untouched and so wins. A float32 layer inside a model
hands its outputs back in the policy's compute dtype (`hand_back`).
"""

import contextlib
import re

import keras

from kerasmp import _keras_internals as _ki
from kerasmp._utils.marked import Marked
from kerasmp._utils.namematch import NameMatcher
from kerasmp.float8.rule import FLOAT8_NAMES
from kerasmp.float8.rule import base_name
from kerasmp.float8.rule import rule_for
from kerasmp.policy.norms import FLOAT16_HAZARDS
from kerasmp.policy.norms import KERAS_NORMALIZATION_CLASSES
from kerasmp.policy.norms import NORMALIZATION_BY_NAME
from kerasmp.policy.norms import UNDECIDED
from kerasmp.policy.norms import BuiltinRule
from kerasmp.policy.norms import Exclude
from kerasmp.policy.norms import in_construction
from kerasmp.policy.rules import SOFTMAX_ACTIVATIONS
from kerasmp.policy.rules import activation_name
from kerasmp.policy.rules import measured_entries
from kerasmp.policy.rules import parse_rule
from kerasmp.policy.rules import rule_from_config
from kerasmp.policy.rules import rule_name
from kerasmp.policy.rules import rule_sequence
from kerasmp.policy.rules import rule_to_config
from kerasmp.policy.rules import with_defaults

_FLOAT_NAMES = ("mixed_float16", "mixed_bfloat16", "float16", "bfloat16",
                "float32", "float64") + tuple(FLOAT8_NAMES)

def _normalization_layers():
    return KERAS_NORMALIZATION_CLASSES


NORMALIZATION_BY_NAME = NORMALIZATION_BY_NAME
"""The structural name rule for normalizations Keras does not define
(`T5LayerNorm`, `MistralLayerNormalization`, a user's `RMSNorm`, ...): a
layer whose class name ends in "Norm" or "Normalization" and that holds no
compute-heavy sublayer or kernel (see docs/policies.md)."""

KNOWN_FLOAT16_HAZARDS = FLOAT16_HAZARDS
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

    def kept_half(self, layer):
        """Whether `layer` kept the half policy when measurement moved the
        parent that handed it this override (`Policy.measured`)."""
        lookup = getattr(self.policy, "measured_entry", None)
        entry = lookup(getattr(layer, "path", None)) if lookup else None
        return entry is not None and "half" in entry


@keras.saving.register_keras_serializable(package="kerasmp")
class Policy(keras.DTypePolicy):
    """A `keras.DTypePolicy` that keeps fragile layers in float32.

    Layers governed by this policy compute in the policy's compute dtype,
    except the layers its rules match (the built-in ones,
    `DEFAULT_FLOAT32_LAYERS`, and those added in `float32_layers`), which
    compute in float32 with float32 variables. Inside a model such a layer
    hands its output on in the policy's compute dtype, so it composes with
    the half-precision tensors around it (a post-LN residual `x + norm(x)`
    works); the outputs of the model itself (or of an overridden layer
    called on its own) are the float32 values, so the probabilities that
    reach a loss are float32. A layer is governed by the policy when it was
    built with `dtype=None` while this policy was global, or was handed
    this policy by its parent layer. A layer built with any other explicit
    `dtype=` keeps that dtype.

    Args:
        name: The policy name, any name `keras.DTypePolicy` accepts for a
            floating-point policy: `"mixed_float16"`, `"mixed_bfloat16"`,
            `"float16"`, `"bfloat16"`, `"float32"` or `"float64"`.
        float32_layers: A sequence of rules to add to the built-in ones:
            `keras.layers.Layer` subclasses, regular expressions, predicates
            and kerasmp's built-in rules. A layer matches when it is an
            instance of one of the classes, when a regular expression
            matches its whole `name` (`re.fullmatch`), when a predicate (a
            module-level function of the layer, called once the layer is
            constructed) returns True, or when a built-in rule matches it.
            `keras.layers.Softmax` also matches layers whose `activation` is
            softmax or log_softmax. Defaults to `()`: the built-in rules
            only.
        float32_exclude: A sequence of layer classes, regular expressions
            and predicates (as in `float32_layers`): a layer they match is
            never put in float32 by a rule, built-in or not. Defaults to
            `()`.
        float8: For the float8 names only (`"float8_mixed_bfloat16"`,
            `"float8_mixed_float16"`): a `kerasmp.float8.Float8Rule` saying
            which Dense/EinsumDense layers train in Keras's float8 mode
            (assigned at `compile`, see `kerasmp.float8`). Defaults to
            `Float8Rule()`. Every other layer computes as under the base
            policy (`"mixed_bfloat16"` / `"mixed_float16"`).
        float32_defaults: Whether the built-in rules,
            `DEFAULT_FLOAT32_LAYERS`, apply besides `float32_layers`:
            softmax, every Keras normalization layer,
            `NORMALIZATION_BY_NAME` (normalizations that model libraries and
            users define, such as keras-hub's `T5LayerNorm` or a
            `class RMSNorm(keras.layers.Layer)`) and `KNOWN_FLOAT16_HAZARDS`.
            Defaults to True. With False, `float32_layers` is the whole list:
            pass the built-in rules to keep in it (`()` for no rules).
        measured: What `compile`'s measurement moved to float32, by
            `Layer.path`, so that a saved model reloads so (kerasmp fills
            it: `kerasmp.policy.rules.measured_entries`). Defaults to None.

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
    >>> policy = kerasmp.Policy("mixed_float16", float32_layers=["logits"])
    >>> keras.layers.Dense(4, name="logits", dtype=policy).compute_dtype
    'float32'
    >>> keras.layers.Softmax(dtype=policy).compute_dtype  # built-in rule
    'float32'
    >>> kerasmp.set_global_policy("float32")
    """

    def __init__(self, name="mixed_float16", float32_layers=(),
                 float32_exclude=(), float8=None, float32_defaults=True,
                 measured=None):
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
        if not isinstance(float32_defaults, bool):
            raise ValueError(
                "Invalid `float32_defaults` for kerasmp.Policy: "
                f"{float32_defaults!r}. Allowed values: True (the built-in "
                "rules, DEFAULT_FLOAT32_LAYERS, apply besides "
                "`float32_layers`), False (`float32_layers` alone)."
            )
        excludes = rule_sequence(float32_exclude, "float32_exclude")
        for entry in excludes:
            if isinstance(entry, (BuiltinRule,
                                  Exclude)):
                raise TypeError(
                    "Invalid `float32_exclude` entry: expected a layer "
                    "class, a regular expression or a predicate. To drop a "
                    "built-in rule, pass `float32_defaults=False` and list "
                    "the rules to keep in `float32_layers`. "
                    f"Received: {entry!r}"
                )
        self._float8 = rule_for(name, float8)
        super().__init__(name)
        self._rules = tuple(
            Exclude(parse_rule(r, "float32_exclude"))
            for r in excludes
        ) + with_defaults(tuple(parse_rule(r) for r in rules),
                          DEFAULT_FLOAT32_LAYERS, float32_defaults)
        self._matchers = {
            r.pattern: NameMatcher(r.pattern)
            for r in (getattr(r, "rule", r) for r in self._rules)
            if isinstance(r, re.Pattern)
        }
        self._measured = measured_entries(measured)
        self._overrides = {}  # rule description -> Float32Override
        # (layer class, name, activation) -> rule description or None, so
        # that each layer is matched once, not on every dtype lookup.
        self._decisions = {}

    def _parse_name(self, name):
        # A float8 name computes like its base policy (kerasmp.float8).
        base = keras.DTypePolicy(base_name(name))
        return base.compute_dtype, base.variable_dtype

    @property
    def float8(self):
        """The `Float8Rule` of a float8 policy, else None."""
        return self._float8

    def stock_policy(self):
        """The stock Keras policy a saved file holds for Keras without
        kerasmp (the base policy of a float8 name)."""
        return keras.DTypePolicy(base_name(self.name))

    @property
    def measured(self):
        """The `measured` argument (a copy)."""
        return {path: dict(entry) for path, entry in self._measured.items()}

    def measured_entry(self, path):
        return self._measured.get(path) if self._measured else None

    def with_measured(self, measured):
        """This policy (equal to it) with `measured` in place of its own."""
        return Policy(self.name, float32_layers=self.float32_layers,
                      float8=self.float8, float32_defaults=False,
                      measured=measured)

    @property
    def float32_layers(self):
        """Every rule the policy applies, built-in ones included: layer
        classes, compiled regexes, predicates and built-in rules, after the
        `float32_exclude` entries (each wrapped so that
        `Policy(name, float32_layers=p.float32_layers,
        float32_defaults=False)` is the same policy)."""
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
        return self._rule(layer)[0]

    def _rule(self, layer):
        """(rule description or None, final): final is False while a rule
        cannot judge `layer` yet (its `__init__` is running)."""
        activation = activation_name(layer)
        key = (type(layer), layer.name, activation)
        try:
            return self._decisions[key], True
        except KeyError:
            pass
        decision, final = self._match(layer, activation)
        if final:
            self._decisions[key] = decision
        return decision, final

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
                    and activation in SOFTMAX_ACTIVATIONS):
                return f"Softmax: activation={activation}", True
            return None, True
        if isinstance(rule, BuiltinRule):
            if rule.float16_only and self.compute_dtype != "float16":
                return None, True
            detail = rule.match(layer)
            if detail is UNDECIDED:
                return None, False
            return detail, True
        if in_construction(layer):
            return None, False
        return (rule_name(rule) if rule(layer) else None), True

    def _match(self, layer, activation):
        final = True
        for rule in self._rules:
            exclude = isinstance(rule, Exclude)
            detail, decided = self._matches(
                rule.rule if exclude else rule, layer, activation)
            final = final and decided
            if detail is None:
                continue
            if exclude:
                return None, final
            if isinstance(rule, BuiltinRule):
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
        return self.resolve(layer)[0]

    def resolve(self, layer):
        """`policy_for(layer)`, and whether that answer is final.

        Args:
            layer: A `keras.layers.Layer` whose stored policy is this one.

        Returns:
            `(policy, final)`: `policy` as `policy_for` returns it; `final`
            is False while a rule cannot judge the layer yet (its
            `__init__` is running), so that the answer may still change.
            A final answer holds for the layer's lifetime under this policy
            object (a policy never changes; `with_measured` makes a new
            one), so callers may keep it.
        """
        if self.compute_dtype in ("float32", "float64"):
            return self, True
        entry = self.measured_entry(getattr(layer, "path", None))
        if entry is not None:
            kept = self if "half" in entry else self._override(entry["rule"])
            return kept, True
        rule, final = self._rule(layer)
        return (self if rule is None else self._override(rule)), final

    def _override(self, rule):
        if rule not in self._overrides:
            self._overrides[rule] = Float32Override(self, rule)
        return self._overrides[rule]

    def get_config(self):
        # The whole list, built-in rules included, as every kerasmp wrote
        # it: `from_config` reads a saved list as all the rules
        # (`float32_defaults=False`), so a file computes what it did when
        # saved, and older kerasmp versions still read it.
        rules = [rule_to_config(rule) for rule in self._rules]
        config = {"name": self.name, "float32_layers": rules}
        if self._float8 is not None:
            config["float8"] = self._float8.get_config()
        if self._measured:
            config["measured"] = self.measured
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
        parsed = [rule_from_config(r) for r in rules]
        # A saved list holds every rule (`get_config`): it replaces the
        # built-in ones, as it did when it was saved.
        config.setdefault("float32_defaults", False)
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
    `kerasmp._patches`).

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
