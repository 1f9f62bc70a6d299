"""Mixed-precision dtype policies with per-layer float32 overrides.

`Policy` is a real `keras.DTypePolicy`: pass it wherever Keras takes a dtype
policy. What it adds is a list of layers that must compute in float32 even
when the policy computes in float16 or bfloat16: softmax and normalization
layers by default, plus any layer class or layer-name pattern the user names.

How the override reaches layers: a layer's policy is whatever Keras stored in
`layer._dtype_policy` (the global policy when `dtype=None`, or the parent's
policy for layers such as the `Softmax` inside `MultiHeadAttention`). When that
stored policy is a `kerasmp.Policy`, `kerasmp._hooks` resolves it against the
layer each time Keras reads it (`Policy.policy_for(layer)`), so the rules also
apply to nested layers and to attributes set after `super().__init__()`
(an `Activation` layer's activation, say). Any other policy, including an
explicit `dtype=` given by the user, is returned untouched and so wins.

Length: `Policy`, its float32 rules and the global-policy helpers; the
Keras patches live in `kerasmp._hooks`, the pattern matcher in
`kerasmp._namematch`.
"""

import contextlib
import re
import sys

import keras

from kerasmp import _hooks
from kerasmp import float8 as _float8
from kerasmp._namematch import NameMatcher

_FLOAT_NAMES = ("mixed_float16", "mixed_bfloat16", "float16", "bfloat16",
                "float32", "float64") + tuple(_float8.FLOAT8_NAMES)
_SOFTMAX_ACTIVATIONS = ("softmax", "log_softmax")


def _normalization_layers():
    names = (
        "BatchNormalization",
        "LayerNormalization",
        "GroupNormalization",
        "UnitNormalization",
        "RMSNormalization",
        "Normalization",
    )
    return tuple(
        getattr(keras.layers, n) for n in names if hasattr(keras.layers, n)
    )


DEFAULT_FLOAT32_LAYERS = (keras.layers.Softmax,) + _normalization_layers()
"""Layers a `Policy` computes in float32 unless told otherwise.

`keras.layers.Softmax` in the list also covers every layer whose `activation`
is softmax or log_softmax (`Activation("softmax")`,
`Dense(n, activation="softmax")`): their output is a softmax, and a float16
softmax over more than ~65k classes overflows its denominator and returns
zeros without any NaN to warn you.
"""


def parse_rule(rule, argname="float32_layers"):
    """Returns a float32 rule as a layer class or a compiled regex.

    Args:
        rule: A `keras.layers.Layer` subclass, a compiled regex, or a string
            (a regular expression matched against the whole layer name).
        argname: The argument the rule came from, for error messages.

    Raises:
        ValueError: `rule` is a string that is not a valid regex.
        TypeError: `rule` is anything else.
    """
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
    raise TypeError(
        f"Invalid `{argname}` entry: expected a keras.layers.Layer "
        "subclass or a regular expression (str) matched against the layer "
        f"name. Received: {rule!r} (of type {type(rule).__name__})"
    )


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
class Float32Override(keras.DTypePolicy):
    """The float32 policy a `Policy` gives the layers its rules match.

    It computes and stores variables in float32 like
    `keras.DTypePolicy("float32")`, and remembers which kerasmp policy and
    rule put the layer there, so that a saved model reloads with the same
    dtypes and `dtype_report` can say why.

    Args:
        policy: The `kerasmp.Policy` whose rule matched.
        rule: The description of the rule, as `Policy.float32_rule` gives it.
    """

    def __init__(self, policy, rule):
        super().__init__("float32")
        self.policy = policy
        self.rule = rule

    def get_config(self):
        return {"policy": keras.saving.serialize_keras_object(self.policy),
                "rule": self.rule}

    @classmethod
    def from_config(cls, config):
        policy = keras.saving.deserialize_keras_object(config["policy"])
        return cls(policy, config["rule"])

    def __eq__(self, other):
        return (isinstance(other, Float32Override)
                and self.rule == other.rule and self.policy == other.policy)

    def __hash__(self):
        return hash(("float32", self.rule))

    def __repr__(self):
        return f'<kerasmp.Float32Override "float32" ({self.rule})>'


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
        float32_layers: A sequence of `keras.layers.Layer` subclasses and/or
            regular expressions. A layer matches when it is an instance of
            one of the classes, or when a regular expression matches its whole
            `name` (`re.fullmatch`). `keras.layers.Softmax` also matches
            layers whose `activation` is softmax or log_softmax. Defaults to
            `DEFAULT_FLOAT32_LAYERS` (softmax and every Keras normalization
            layer). Pass `()` for no overrides.
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
    >>> kerasmp.set_global_policy("float32")
    """

    def __init__(self, name="mixed_float16",
                 float32_layers=DEFAULT_FLOAT32_LAYERS, float8=None):
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
        self._float8 = _float8.rule_for(name, float8)
        install()
        super().__init__(name)
        self._rules = tuple(parse_rule(r) for r in rules)
        self._matchers = {
            r.pattern: NameMatcher(r.pattern)
            for r in self._rules
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
        """The override rules: layer classes and compiled regexes."""
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
            A short description of the matching rule, e.g. `"Softmax"`,
            `"activation=softmax"` or `"name~'head.*'"`, or None.
        """
        activation = _activation_name(layer)
        key = (type(layer), layer.name, activation)
        try:
            return self._decisions[key]
        except KeyError:
            pass
        decision = self._match(layer, activation)
        self._decisions[key] = decision
        return decision

    def _match(self, layer, activation):
        for rule in self._rules:
            if isinstance(rule, re.Pattern):
                if self._matchers[rule.pattern].fullmatch(layer.name or ""):
                    return f"name~{rule.pattern!r}"
            elif isinstance(layer, rule):
                return rule.__name__
            elif (
                rule is keras.layers.Softmax
                and activation in _SOFTMAX_ACTIVATIONS
            ):
                return f"activation={activation}"
        return None

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
        rules = []
        for rule in self._rules:
            if isinstance(rule, re.Pattern):
                rules.append({"pattern": rule.pattern})
            else:
                rules.append(_class_to_config(rule))
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
        parsed = [
            r["pattern"] if "pattern" in r else _class_from_config(r)
            for r in rules
        ]
        return cls(float32_layers=parsed, **config)

    def __eq__(self, other):
        return (
            isinstance(other, Policy)
            and self.name == other.name
            and self.get_config() == other.get_config()
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
    `kerasmp._hooks`).

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
    """Returns the policy stored on `layer`, before kerasmp's resolution."""
    return _hooks.stored_policy(layer)


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
    return _hooks.handoff_dtype(layer)


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


def install():
    """Installs kerasmp's hooks into Keras (idempotent).

    Importing kerasmp and creating a `Policy` install them, so user code
    never needs to; see `kerasmp._hooks` for what they change. They act only
    on layers whose policy is a kerasmp one.
    """
    _hooks.install(Policy, saved_classes=(Policy, Float32Override)
                   + _float8.POLICY_CLASSES)


def uninstall():
    """Removes kerasmp's hooks: Keras behaves exactly as without kerasmp.

    Layers built under a `kerasmp.Policy` keep it, but then compute in its
    dtype without float32 overrides. Creating a `Policy` installs the hooks
    again.

    Example:

    >>> kerasmp.uninstall()
    >>> keras.layers.Softmax(dtype="mixed_float16").compute_dtype
    'float16'
    """
    _hooks.uninstall()


install()
