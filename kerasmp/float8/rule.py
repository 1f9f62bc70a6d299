"""Float8 training under a kerasmp policy: which layers, and when.

`kerasmp.Policy("float8_mixed_bfloat16")` (or `"float8_mixed_float16"`)
computes like `"mixed_bfloat16"` (`"mixed_float16"`, with kerasmp's loss
scaling) and keeps kerasmp's float32 rules; in addition the large
`Dense` / `EinsumDense` matmuls train in Keras's own float8 mode (the stock
`QuantizedFloat8DTypePolicy` machinery: E4M3 inputs and kernel, E5M2 output
gradients, delayed scaling from an amax history).

When: Keras quantizes *built* layers, and the rule needs the kernel sizes and
the model's first and last matmul, so the layers are assigned at
`model.compile()` (kerasmp's compile hook calls `assign_layers`). A model
that is not built at compile (a subclassed model without an input shape)
gets a warning; build it and call `kerasmp.float8.assign_layers(model)`.

The rule (`Float8Rule`), applied to every layer that the float8 policy
governs (a layer with an explicit `dtype=` keeps it), in this order:

1. `exclude` (layer name or path patterns) wins: not float8.
2. Only layers whose class is exactly `keras.layers.Dense` or
   `keras.layers.EinsumDense` have a float8 mode (Keras refuses
   subclasses), and not with LoRA enabled, and not a layer a float32 rule
   keeps in float32.
3. `include` (name or path patterns): float8, whatever its size or place.
4. The first and the last such matmul layer of the model (in `dtype_report`
   order) are excluded by default (`exclude_first`, `exclude_last`): the
   first sees raw inputs, the last produces the logits.
5. A kernel with fewer than `min_kernel_size` elements is not worth a
   float8 matmul (default 4096, e.g. 64x64).

Assigned layers get a `Float8Assignment` policy (a `QuantizedFloat8DTypePolicy`
that remembers the kerasmp policy and the reason); a layer moved off float8
by `Float8Monitor(action="fallback")` gets a `Float8Fallback`. Both save
and load like the other kerasmp policies (a stock Keras loads the file too,
with the same float8 layers).
"""

import dataclasses
import math
import re
import warnings

import keras

from kerasmp import _keras_internals as _ki
from kerasmp._utils.layers import walk
from kerasmp._utils.marked import Marked
from kerasmp._utils.namematch import NameMatcher

FLOAT8_NAMES = {
    "float8_mixed_bfloat16": "mixed_bfloat16",
    "float8_mixed_float16": "mixed_float16",
}
"""The kerasmp policy names that train in float8, and the policy every other
layer computes with."""


def is_float8_name(name):
    """Whether `name` is one of `FLOAT8_NAMES`."""
    return isinstance(name, str) and name in FLOAT8_NAMES


def base_name(name):
    """The non-float8 policy name behind `name` (`name` itself if plain)."""
    return FLOAT8_NAMES.get(name, name)


def _patterns(value, argname):
    if isinstance(value, (str, re.Pattern)):
        value = (value,)
    try:
        items = tuple(value)
    except TypeError:
        raise TypeError(
            f"`{argname}` must be a sequence of regular expressions (str) "
            f"matched against layer names or paths. Received: {value!r}"
        ) from None
    out = []
    for item in items:
        pattern = item.pattern if isinstance(item, re.Pattern) else item
        if not isinstance(pattern, str):
            raise TypeError(
                f"Invalid `{argname}` entry: expected a regular expression "
                f"(str). Received: {item!r} (of type {type(item).__name__})"
            )
        try:
            NameMatcher(pattern)
        except (ValueError, re.error) as e:
            raise ValueError(
                f"Invalid `{argname}` entry: {pattern!r} is not a supported "
                f"regular expression ({e})."
            ) from None
        out.append(pattern)
    return tuple(out)


@keras.saving.register_keras_serializable(package="kerasmp")
class Float8Rule:
    """Which layers a float8 `kerasmp.Policy` trains in float8.

    Args:
        min_kernel_size: Smallest kernel (number of elements) trained in
            float8. Default 4096 (a 64x64 kernel). Smaller matmuls gain
            nothing from float8 and lose precision.
        exclude_first: Keep the model's first Dense/EinsumDense out of
            float8. Default True.
        exclude_last: Keep the model's last Dense/EinsumDense (usually the
            classifier or LM head) out of float8. Default True.
        include: Regular expressions; a Dense/EinsumDense whose name or path
            (as `dtype_report` prints it) matches one is float8 whatever its
            size or place.
        exclude: Regular expressions; a layer whose name or path matches one
            is never float8 (wins over `include`).
        amax_history_length: Length of each layer's amax history (Keras's
            delayed scaling window). Default 1024, as Keras.

    Example:

    >>> rule = kerasmp.float8.Float8Rule(min_kernel_size=256, exclude=["head"])
    >>> policy = kerasmp.Policy("float8_mixed_bfloat16", float8=rule)
    """

    def __init__(self, min_kernel_size=4096, exclude_first=True,
                 exclude_last=True, include=(), exclude=(),
                 amax_history_length=1024):
        if (not isinstance(min_kernel_size, int)
                or isinstance(min_kernel_size, bool) or min_kernel_size < 0):
            raise ValueError(
                "`min_kernel_size` must be an integer >= 0 (kernel elements). "
                f"Received: {min_kernel_size!r}"
            )
        for argname, value in (("exclude_first", exclude_first),
                               ("exclude_last", exclude_last)):
            if not isinstance(value, bool):
                raise TypeError(
                    f"`{argname}` must be True or False. Received: {value!r}"
                )
        if (not isinstance(amax_history_length, int)
                or isinstance(amax_history_length, bool)
                or amax_history_length < 1):
            raise ValueError(
                "`amax_history_length` must be an integer >= 1. Received: "
                f"{amax_history_length!r}"
            )
        self.min_kernel_size = min_kernel_size
        self.exclude_first = exclude_first
        self.exclude_last = exclude_last
        self.include = _patterns(include, "include")
        self.exclude = _patterns(exclude, "exclude")
        self.amax_history_length = amax_history_length
        self._include = [NameMatcher(p) for p in self.include]
        self._exclude = [NameMatcher(p) for p in self.exclude]

    def get_config(self):
        return {
            "min_kernel_size": self.min_kernel_size,
            "exclude_first": self.exclude_first,
            "exclude_last": self.exclude_last,
            "include": list(self.include),
            "exclude": list(self.exclude),
            "amax_history_length": self.amax_history_length,
        }

    @classmethod
    def from_config(cls, config):
        return cls(**config)

    def __eq__(self, other):
        return (isinstance(other, Float8Rule)
                and self.get_config() == other.get_config())

    def __hash__(self):
        return hash((self.min_kernel_size, self.include, self.exclude))

    def __repr__(self):
        return f"Float8Rule({self.get_config()})"

    @staticmethod
    def _matches(matchers, layer, path):
        return any(m.fullmatch(layer.name or "") or m.fullmatch(path)
                   for m in matchers)

    def excluded(self, layer, path):
        return self._matches(self._exclude, layer, path)

    def included(self, layer, path):
        return self._matches(self._include, layer, path)


def rule_for(name, float8):
    """The `Float8Rule` of a policy named `name` given `float8` (None, a
    `Float8Rule` or its config dict); None for a non-float8 name.

    Raises:
        ValueError: `float8` was given for a policy that is not float8.
        TypeError: `float8` is not a `Float8Rule`, a dict or None.
    """
    if not is_float8_name(name):
        if float8 is not None:
            raise ValueError(
                f"`float8` applies only to the policies {sorted(FLOAT8_NAMES)}"
                f". Received: name={name!r}, float8={float8!r}"
            )
        return None
    if float8 is None:
        return Float8Rule()
    if isinstance(float8, dict):
        return Float8Rule.from_config(float8)
    if isinstance(float8, Float8Rule):
        return float8
    raise TypeError(
        "`float8` must be a kerasmp.float8.Float8Rule, its config dict or "
        f"None. Received: {float8!r} (of type {type(float8).__name__})"
    )


# ----------------------------------------------------------------- policies


@keras.saving.register_keras_serializable(package="kerasmp")
class Float8Assignment(
    Marked, keras.dtype_policies.QuantizedFloat8DTypePolicy
):
    """The policy of a layer that a float8 `kerasmp.Policy` trains in float8.

    It is Keras's `QuantizedFloat8DTypePolicy("float8", <base policy>)` (the
    layer computes in the base policy's dtype around float8 matmuls) that
    remembers which kerasmp policy and rule put the layer there.

    Args:
        policy: The float8 `kerasmp.Policy`.
        rule: Why the layer is float8 (a short text).
    """

    WHY = "rule"

    def __init__(self, policy, rule):
        super().__init__(
            "float8",
            source_name=base_name(policy.name),
            amax_history_length=policy.float8.amax_history_length,
        )
        self.policy = policy
        self.rule = rule

    def stock_policy(self):
        """The stock Keras policy a file saves for Keras without kerasmp."""
        return keras.dtype_policies.QuantizedFloat8DTypePolicy(
            "float8", source_name=base_name(self.policy.name),
            amax_history_length=self.amax_history_length,
        )


@keras.saving.register_keras_serializable(package="kerasmp")
class Float8Fallback(Marked, keras.DTypePolicy):
    """The policy of a layer moved off float8 (by `Float8Monitor`'s
    fallback, or by `fall_back`): it computes in the float8 policy's base
    policy (`mixed_bfloat16` or `mixed_float16`) and is never re-assigned.

    Args:
        policy: The float8 `kerasmp.Policy`.
        reason: Why the layer left float8 (a short text).
    """

    WHY = "reason"

    def __init__(self, policy, reason):
        super().__init__(base_name(policy.name))
        self.policy = policy
        self.reason = reason


POLICY_CLASSES = (Float8Assignment, Float8Fallback)
"""The policy classes this module adds (saved and loaded by kerasmp's hooks)."""


# ------------------------------------------------------------------- rule


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


def decide(model):
    """Applies the float8 rule to every layer of `model`.

    Args:
        model: A `keras.Model` or layer, built (unbuilt matmul layers are
            reported as not float8, "not built").

    Returns:
        A list of `Decision`, one per layer a float8 policy governs (or that
        was assigned or moved off float8), in `dtype_report` order.
    """
    everything = list(walk(model))
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


def assign_layers(model):
    """Moves the layers the float8 rule selects to Keras's float8 mode.

    kerasmp's compile hook calls it; call it yourself for a model that was
    not built when it was compiled (then compile again, so that the train
    function sees the new variables). Layers already in float8, or moved
    off it, are left alone.

    Args:
        model: A built `keras.Model` whose layers a float8 `kerasmp.Policy`
            governs (anything else: nothing happens).

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
    decisions = decide(model)
    if not decisions:
        return []
    if any(d.reason == "not built" for d in decisions):
        warnings.warn(
            f"Float8 policy: some layers of model {model.name!r} are not "
            "built, so they stay out of float8. Build the model (an Input, "
            "or model.build(shape)), then call "
            "kerasmp.float8.assign_layers(model) and compile again.",
            stacklevel=3,
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


def needs_loss_scaling(model):
    """Whether a trainable float8 layer of `model` computes in float16."""
    return any(l.trainable and l.compute_dtype == "float16"
               for _, l in float8_layers(model))


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


# ----------------------------------------------------------------- export


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
                            float32_layers=policy.float32_layers)
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


def _numpy(x):
    x = getattr(x, "value", x)
    if hasattr(x, "numpy"):
        return x.numpy()
    return keras.ops.convert_to_numpy(x)


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
        scale = float(_numpy(layer.kernel_scale))
        qdq = keras.quantizers.quantize_and_dequantize(
            keras.ops.convert_to_tensor(_numpy(layer.kernel)), scale,
            "float8_e4m3fn", "float32")
        quantized[layer.kernel.path] = _numpy(qdq)
    source = {v.path: v for v in model.weights}
    for v in plain.weights:
        if v.path not in source:
            raise ValueError(
                f"Cannot dequantize: the copy's variable {v.path!r} has no "
                "counterpart in the model (does its config round-trip?)."
            )
        value = quantized.get(v.path)
        v.assign(_numpy(source[v.path]) if value is None else value)
    return plain
