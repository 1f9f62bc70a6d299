"""Rebuilds a Keras model in half precision, keeping fragile layers float32.

The engine behind `kerasmp.export.to_float16`. A model is rebuilt layer by
layer (from each layer's config, or the model's for a subclassed model)
while the global dtype policy is a `kerasmp.Policy` in the target dtype whose
float32 rules are the layers to keep; kerasmp's policy hook resolves it per
layer, so sublayers that a parent creates in `build()` (the Softmax in
`MultiHeadAttention`) follow the rules too. Layers the original keeps for a
reason only it can tell (a weight beyond the float16 range) get a float32
policy before they are built. Afterwards every policy is frozen to the plain
`keras.DTypePolicy` it resolved to, so the copy no longer depends on kerasmp,
and the float32 master weights are copied in, rounded once.
"""

import re
import warnings

import keras
import numpy as np

from kerasmp import policy as _policy
from kerasmp._layers import walk

DTYPES = ("float16", "bfloat16")
FLOAT16_MAX = float(np.finfo(np.float16).max)  # 65504


def own_variables(layer):
    """The variables `layer` creates itself (not its sublayers')."""
    return list(getattr(layer, "_trainable_variables", ())) + list(
        getattr(layer, "_non_trainable_variables", ())
    )


def numpy_value(x):
    """A numpy copy of a Keras variable or backend tensor."""
    x = getattr(x, "value", x)  # a Keras variable -> its backend value
    if hasattr(x, "numpy"):
        return np.asarray(x.numpy())  # TensorFlow
    return np.asarray(x)


def is_float(dtype):
    return "float" in str(dtype)


def is_container(layer):
    return isinstance(layer, (keras.Model, keras.layers.InputLayer))


def _plain(policy):
    """A plain `keras.DTypePolicy` with the same name as `policy`."""
    return keras.DTypePolicy(policy.name)


def is_graph_model(model):
    from keras.src.models.functional import Functional

    return isinstance(model, (keras.Sequential, Functional))


# --------------------------------------------------------------------------
# Argument checks
# --------------------------------------------------------------------------


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
        for layer in [model] + [l for _, l in walk(model)]:
            stored = _policy.stored_policy(layer)
            if isinstance(stored, _policy.Policy):
                return tuple(stored.float32_layers)
        return tuple(_policy.DEFAULT_FLOAT32_LAYERS)
    if isinstance(keep_float32, (str, type, re.Pattern)):
        keep_float32 = [keep_float32]
    try:
        entries = list(keep_float32)
    except TypeError:
        raise TypeError(
            "`keep_float32` must be None or a sequence of keras.layers.Layer "
            "subclasses and/or regular expressions matched against layer "
            f"names. Received: {keep_float32!r}"
        ) from None
    return tuple(
        _policy.parse_rule(entry, argname="keep_float32") for entry in entries
    )


# --------------------------------------------------------------------------
# to_float16
# --------------------------------------------------------------------------


def _out_of_range(layer):
    """Returns `(weight name, max |value|)` of the first weight of `layer`
    that float16 cannot hold, or None."""
    for v in own_variables(layer):
        if not is_float(v.dtype):
            continue
        values = numpy_value(v)
        if values.size == 0:
            continue
        peak = float(np.max(np.abs(values.astype(np.float64))))
        if np.isfinite(peak) and peak > FLOAT16_MAX:
            return v.name, peak
    return None


def decide(model, dtype, rules):
    """Decides which layers of `model` stay float32.

    Returns:
        `(kept, out_of_range)`: `{id(layer): reason}` for every kept layer,
        and the set of `id(layer)` kept because of a weight beyond float16.
    """
    if dtype == "float32":
        return {}, set()
    rule_policy = _policy.Policy(dtype, float32_layers=rules)
    kept, out_of_range = {}, set()
    ancestors = {}
    for path, layer in walk(model):
        parent = path.rsplit("/", 1)[0] if "/" in path else None
        reason = None
        if parent is not None and parent in ancestors:
            reason = f"inside {parent}"
        if dtype == "float16":
            bad = _out_of_range(layer)
            if bad is not None:
                name, peak = bad
                warnings.warn(
                    f"kerasmp.export: layer {path!r} "
                    f"({type(layer).__name__}) has weight {name!r} with "
                    f"|value| up to {peak:.4g}, beyond the float16 maximum "
                    f"{FLOAT16_MAX:g}; keeping this layer in float32 (in "
                    "float16 the value would be inf).",
                    stacklevel=3,
                )
                reason = reason or f"weight {name!r} |x|={peak:.3g} > 65504"
                out_of_range.add(id(layer))
        if reason is None and not is_container(layer):
            rule = rule_policy.float32_rule(layer)
            if rule is not None:
                reason = rule
        if reason is not None and not isinstance(
            layer, keras.layers.InputLayer
        ):
            kept[id(layer)] = reason
            ancestors[path] = reason
    return kept, out_of_range


class _Cloner:
    """Rebuilds a model layer by layer with new dtype policies."""

    def __init__(self, dtype, build_policy, kept, half_inputs):
        self.dtype = dtype
        self.build_policy = build_policy
        self.kept = kept
        self.half_inputs = half_inputs
        self.float32 = keras.DTypePolicy("float32")
        self.cache = {}

    def policy_for(self, layer):
        return self.float32 if id(layer) in self.kept else self.build_policy

    def input_dtype(self, dtype, top):
        if top and self.half_inputs and is_float(dtype):
            return self.dtype
        return dtype

    def clone_layer(self, layer):
        if id(layer) in self.cache:
            return self.cache[id(layer)]
        if not isinstance(layer, keras.layers.Layer):
            new = layer  # an op node (`x + y`): stateless, no dtype policy
        elif is_graph_model(layer):
            new = self.clone_model(layer, top=False)
        else:
            try:
                config = layer.get_config()
            except NotImplementedError as e:
                raise TypeError(
                    f"Cannot rebuild layer {layer.name!r} "
                    f"({type(layer).__name__}) in half precision: it has no "
                    "usable get_config(). Implement get_config() (and "
                    f"from_config() if needed) on {type(layer).__name__}."
                ) from e
            policy = self.policy_for(layer)
            if "dtype" in config:
                config = dict(config, dtype=policy)
            new = layer.__class__.from_config(config)
            new._dtype_policy = policy
        self.cache[id(layer)] = new
        return new

    def clone_model(self, model, top=True):
        if isinstance(model, keras.Sequential):
            return self._clone_sequential(model, top)
        if is_graph_model(model):
            return self._clone_functional(model, top)
        return self._clone_subclassed(model)

    def _clone_sequential(self, model, top):
        layers = list(model.layers)
        first = model._layers[0] if model._layers else None
        if isinstance(first, keras.layers.InputLayer):
            inputs = keras.Input(
                batch_shape=first.batch_shape,
                dtype=self.input_dtype(first.output.dtype, top),
                name=first.name,
            )
        else:
            build = model.get_build_config() or {}
            if "input_shape" not in build:
                raise ValueError(
                    f"Cannot find the input shape of Sequential model "
                    f"{model.name!r}; give it a keras.Input first layer."
                )
            inputs = keras.Input(
                batch_shape=build["input_shape"],
                dtype=self.input_dtype("float32", top),
            )
        new_layers = [self.clone_layer(l) for l in layers]
        new = keras.Sequential([inputs] + new_layers, name=model.name)
        new._dtype_policy = self.policy_for(model)
        return new

    def _clone_functional(self, model, top):
        inputs = keras.tree.map_structure(
            lambda x: keras.Input(
                batch_shape=x.shape,
                dtype=self.input_dtype(x.dtype, top),
                name=x.name,
            ),
            model.input,
        )
        outputs = model._run_through_graph(
            inputs, operation_fn=self.clone_layer
        )
        # A plain keras.Model: no compile state, whatever `model` carried.
        new = keras.Model(inputs, outputs, name=model.name)
        new._dtype_policy = self.policy_for(model)
        return new

    def _clone_subclassed(self, model):
        cls = type(model)
        try:
            config = model.get_config()
        except NotImplementedError as e:
            raise TypeError(
                f"Cannot rebuild subclassed model {model.name!r} "
                f"({cls.__name__}) in half precision: it has no usable "
                f"get_config(). Add get_config() to {cls.__name__} returning "
                "its __init__ arguments (and from_config() if they are not "
                "plain Python values), as for saving it to .keras."
            ) from e
        if "dtype" in config:
            config = dict(config, dtype=self.build_policy)
        try:
            new = cls.from_config(config)
        except Exception as e:
            raise TypeError(
                f"Cannot rebuild subclassed model {model.name!r} "
                f"({cls.__name__}) from its get_config(): "
                f"{type(e).__name__}: {e}. Make get_config() return every "
                f"__init__ argument (and add from_config() to "
                f"{cls.__name__} if they are not plain Python values)."
            ) from e
        # Sublayers made in __init__ exist now, unbuilt: set the policy of
        # those the original keeps in float32 before build makes variables.
        self._pair_unbuilt(model, new)
        build = model.get_build_config() or {}
        if "input_shape" in build:
            shape = tuple(1 if d is None else d for d in build["input_shape"])
            new(np.zeros(shape, "float32"))
        else:
            new.build_from_config(build)
        return new

    def _pair_unbuilt(self, orig, new):
        for o, n in zip(orig._layers, new._layers):
            if type(o) is not type(n):
                return
            if id(o) in self.kept:
                n._dtype_policy = self.float32
            self._pair_unbuilt(o, n)


def _pair_layers(orig, new):
    """Pairs the sublayers of two models of the same structure."""
    a, b = list(walk(orig)), list(walk(new))
    mismatch = len(a) != len(b) or any(
        type(x) is not type(y) for (_, x), (_, y) in zip(a, b)
    )
    if mismatch:
        raise ValueError(
            f"The rebuilt model does not have the layers of {orig.name!r} "
            f"({len(a)} layers in the original, {len(b)} rebuilt): its "
            "get_config()/from_config() do not reproduce it."
        )
    return [(pa, x, y) for (pa, x), (_, y) in zip(a, b)]


def convert(model, dtype, keep_float32=None, float16_inputs=False):
    """Returns `(new model, {path: reason} of layers kept in float32)`."""
    check_model(model)
    rules = keep_rules(model, keep_float32)
    kept, out_of_range = decide(model, dtype, rules)
    # Weight-range keeps also become name rules, so that a nested layer that
    # its parent creates in build() (invisible to the cloner) still gets them.
    names = [
        re.escape(layer.name)
        for _, layer in walk(model)
        if id(layer) in out_of_range
    ]
    build_policy = _policy.Policy(
        dtype, float32_layers=rules + tuple(names) if dtype != "float32" else ()
    )
    cloner = _Cloner(dtype, build_policy, kept, float16_inputs)
    previous = keras.config.dtype_policy()
    keras.config.set_dtype_policy(build_policy)
    try:
        new = cloner.clone_model(model)
    finally:
        keras.config.set_dtype_policy(previous)

    # Freeze: replace every kerasmp policy by the plain policy it resolves to,
    # so the model no longer depends on kerasmp to compute as it does now.
    for layer in [new] + [l for _, l in walk(new)]:
        stored = _policy.stored_policy(layer)
        if isinstance(stored, _policy.Policy):
            layer._dtype_policy = _plain(layer.dtype_policy)

    report = {}
    for path, o, n in _pair_layers(model, new):
        ov, nv = own_variables(o), own_variables(n)
        if len(ov) != len(nv) or any(
            tuple(a.shape) != tuple(b.shape) for a, b in zip(ov, nv)
        ):
            raise ValueError(
                f"Layer {path!r} was rebuilt with different weights "
                f"({[tuple(v.shape) for v in ov]} vs "
                f"{[tuple(v.shape) for v in nv]})."
            )
        reason = kept.get(id(o))
        if id(o) in out_of_range:
            wrong = [v.name for v in nv if is_float(v.dtype)
                     and v.dtype != "float32"]
            if wrong:
                raise ValueError(
                    f"Layer {path!r} must stay float32 ({reason}) but its "
                    f"parent created it with dtype {n.dtype_policy.name!r}. "
                    "Keep its parent in float32: pass its name in "
                    "`keep_float32`."
                )
        for a, b in zip(ov, nv):
            value = keras.ops.convert_to_tensor(numpy_value(a))
            b.assign(keras.ops.cast(value, b.dtype))
        if (
            dtype != "float32"
            and not is_container(n)
            and n.compute_dtype == "float32"
        ):
            report[path] = reason or "explicit float32 dtype"
    return new, report
