"""Half-precision copies of a Keras model that never rebuild it.

The engine behind `kerasmp.export.to_float16`. Rebuilding a model from its
config to change its dtypes fails for models whose get_config()/from_config()
do not reproduce them (some keras-hub backbones) and cannot pair the layers of
models that create them in another order than they call them. So nothing is
rebuilt: a `HalfModel` holds half-precision copies of the original model's
variables (float32 where a layer is kept) and, when called, runs the original
model's own `call` with

- every original variable read replaced by its copy (`keras.StatelessScope`:
  the originals are neither read nor changed), and
- every layer's dtype policy temporarily set to a plain
  `keras.DTypePolicy`: `mixed_<dtype>` (float16 compute) or `float32` for the
  kept layers, restored on exit, and the global policy set to the copy's
  (for the layers a `call` creates as it runs).

The original model is held but not tracked, so saving or exporting the
`HalfModel` stores only its half-precision variables. Layers are matched to
their variables by object identity on the original model, and by position
within the same class's own construction order when a `.keras` file is
loaded (the same code builds them in the same order).

`plan` and `decide` say which variables and layers stay float32 and why;
`convert` returns the `HalfModel` and `to_float16` is its public form.
"""

import contextlib
import functools

import keras
import numpy as np

from kerasmp import _keras_internals as _ki
from kerasmp._utils.arrays import FLOAT16_MAX
from kerasmp._utils.arrays import is_float
from kerasmp._utils.arrays import to_numpy
from kerasmp.export.arguments import check_dtype
from kerasmp.export.arguments import check_model
from kerasmp.export.arguments import keep_rules
from kerasmp.export.quiet import say
from kerasmp.policy import policy as _policy
from kerasmp.policy.handback import hand_back
from kerasmp.policy.measure import measure_once
from kerasmp.policy.plan import plan_of

DTYPES = ("float16", "bfloat16")


def is_container(layer):
    return isinstance(layer, (keras.Model, keras.layers.InputLayer))


def is_graph_model(model):
    return isinstance(model, (keras.Sequential, _ki.functional_class()))


# --------------------------------------------------------------------------
# to_float16
# --------------------------------------------------------------------------


def _beyond_float16(v):
    """max |value| of variable `v` if float16 cannot hold it, else None."""
    if not is_float(v.dtype):
        return None
    values = to_numpy(v)
    if values.size == 0:
        return None
    peak = float(np.max(np.abs(values.astype(np.float64))))
    return peak if np.isfinite(peak) and peak > FLOAT16_MAX else None


def _out_of_range(layer):
    """Returns `(weight name, max |value|)` of the first weight of `layer`
    that float16 cannot hold, or None."""
    for v in _ki.own_variables(layer):
        peak = _beyond_float16(v)
        if peak is not None:
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
    rule_policy = _policy.Policy(dtype, float32_layers=rules,
                                 float32_defaults=False)
    kept, out_of_range = {}, set()
    ancestors = {}
    layers = plan_of(model).walk()
    mixed = any(_half_policy(layer) for _, layer in layers)
    for path, layer in layers:
        parent = path.rsplit("/", 1)[0] if "/" in path else None
        reason = None
        if parent is not None and parent in ancestors:
            reason = f"inside {parent}"
        if dtype == "float16":
            bad = _out_of_range(layer)
            if bad is not None:
                name, peak = bad
                say(
                    f"kerasmp.export: layer {path!r} "
                    f"({type(layer).__name__}) has weight {name!r} with "
                    f"|value| up to {peak:.4g}, beyond the float16 maximum "
                    f"{FLOAT16_MAX:g}; keeping this layer in float32 (in "
                    "float16 the value would be inf).")
                reason = reason or f"weight {name!r} |x|={peak:.3g} > 65504"
                out_of_range.add(id(layer))
        if reason is None and not is_container(layer):
            rule = rule_policy.float32_rule(layer)
            measured = _measured_rule(layer)
            if rule is not None:
                reason = rule
            elif measured is not None:
                # kerasmp's measurement moved it (it fails in float16, or
                # routes experts): the copy computes as the model does.
                reason = measured
            elif mixed and _pinned_float32(layer):
                # The mixed-precision guide's float32 output layer, or any
                # layer the user pinned: it stays as the user built it.
                reason = "dtype='float32' in the model"
        if reason is not None and not isinstance(
            layer, keras.layers.InputLayer
        ):
            kept[id(layer)] = reason
            ancestors[path] = reason
    return kept, out_of_range


def _half_policy(layer):
    """Whether `layer` computes in float16 or bfloat16 (the model is a
    mixed-precision one)."""
    if isinstance(layer, keras.layers.InputLayer):
        return False
    return keras.backend.standardize_dtype(layer.compute_dtype) in (
        "float16", "bfloat16")


def _measured_rule(layer):
    """The rule of the `Float32Override` kerasmp's measurement gave
    `layer` (`"fails in float16"`, `"MoE router (calls top_k)"`, ...), or
    None."""
    stored = _policy.stored_policy(layer)
    if isinstance(stored, _policy.Float32Override):
        return stored.rule
    if isinstance(stored, _policy.Policy):  # a reloaded model's: by path
        entry = stored.measured.get(getattr(layer, "path", None))
        return entry.get("rule") if entry else None
    return None


def _pinned_float32(layer):
    """Whether `layer` was built with a plain float32 policy of its own
    (`dtype="float32"`), not one a kerasmp `Policy` gave it."""
    stored = _policy.stored_policy(layer)
    return type(stored) is keras.DTypePolicy and stored.name == "float32"


def unique_variables(model):
    """`model.variables`, each once (tied weights appear twice)."""
    seen, out = set(), []
    for v in model.variables:
        if id(v) not in seen:
            seen.add(id(v))
            out.append(v)
    return out


def _policy_name(layer):
    """The dtype policy name a layer has now, or None if not a float one."""
    policy = _policy.stored_policy(layer)
    if policy is None or getattr(policy, "quantization_mode", None):
        return None
    if isinstance(layer, keras.layers.InputLayer):
        return None
    return policy.name if is_float(layer.compute_dtype) else None


def plan(model, dtype, keep_float32=None):
    """Decides the dtypes of a half-precision copy of `model`.

    Returns:
        A dict with `variable_dtypes` (one per `unique_variables(model)`),
        `layer_policies` (one per `[model] + walk(model)` layer: a plain
        policy name, or None to leave the layer alone) and `kept_float32`
        (`{path: reason}` of the non-container layers computing in float32).
    """
    check_model(model)
    rules = keep_rules(model, keep_float32)
    kept, _ = decide(model, dtype, rules)
    layers = [("", model)] + plan_of(model).walk()
    owner = {}
    for _, layer in layers:
        for v in _ki.own_variables(layer):
            owner.setdefault(id(v), layer)
    half = f"mixed_{dtype}" if dtype != "float32" else "float32"
    layer_policies = []
    for _, layer in layers:
        if _policy_name(layer) is None:
            layer_policies.append(None)
        else:
            layer_policies.append("float32" if id(layer) in kept else half)
    variable_dtypes = []
    for v in unique_variables(model):
        layer = owner.get(id(v))
        if not is_float(v.dtype):
            variable_dtypes.append(str(v.dtype))
        elif dtype == "float32" or (layer is not None and id(layer) in kept):
            variable_dtypes.append("float32")
        elif dtype == "float16" and _beyond_float16(v) is not None:
            variable_dtypes.append("float32")
        else:
            variable_dtypes.append(dtype)
    kept_float32 = {
        path: kept[id(layer)]
        for path, layer in layers[1:]
        if id(layer) in kept and not is_container(layer)
    }
    return {
        "variable_dtypes": variable_dtypes,
        "layer_policies": layer_policies,
        "kept_float32": kept_float32,
    }


class _Hidden:
    """Holds what a HalfModel must not track or save."""

    __slots__ = ("source", "layers", "paths", "pairs")

    def __init__(self, source, layers, paths):
        self.source = source
        self.layers = layers  # [source] + its layers, in `walk` order
        self.paths = paths  # their paths ("" for source)
        self.pairs = []


@keras.saving.register_keras_serializable(package="kerasmp")
class HalfModel(keras.Model):
    """A half-precision copy of a model that runs the original's code.

    Made by `kerasmp.export.to_float16`; see the module docstring for how it
    works. Its variables are the half-precision copies (float32 for kept
    layers), so `model.weights`, saving and exporting see only those; the
    original model is `source_model()` and is never modified.

    Args:
        source: The original, built `keras.Model`.
        variable_dtypes: One dtype per variable of `source` (in
            `unique_variables` order).
        layer_policies: One plain policy name (or None) per layer of
            `[source] + walk(source)`.
        kept_float32: `{layer path: reason}` for the report.
        float16_inputs: Whether the model's float inputs are declared half
            precision (its serving signature takes them so).
        values: Optional initial values, one per variable (numpy arrays).
    """

    def __init__(self, source, variable_dtypes, layer_policies,
                 kept_float32=None, float16_inputs=False, values=None,
                 **kwargs):
        kwargs.setdefault("name", source.name)
        kwargs["dtype"] = "float32"
        super().__init__(**kwargs)
        sources = unique_variables(source)
        walked = [("", source)] + plan_of(source).walk()
        layers = [layer for _, layer in walked]
        if len(sources) != len(variable_dtypes) or len(layers) != len(
            layer_policies
        ):
            raise ValueError(
                f"HalfModel: model {source.name!r} has {len(sources)} "
                f"variables and {len(layers)} layers, but the saved copy "
                f"describes {len(variable_dtypes)} and {len(layer_policies)}"
                ": its get_config()/from_config() do not rebuild the same "
                "model. Export it to 'savedmodel', 'tflite' or 'onnx' "
                "instead."
            )
        # Hidden on purpose in a plain object: Keras tracking and `.keras`
        # saving (which walks attributes, lists and properties) must not
        # store its float32 variables, only the copies below.
        object.__setattr__(self, "_hidden", _Hidden(
            source, layers, [path for path, _ in walked]))
        self.variable_dtypes = list(variable_dtypes)
        self.layer_policies = list(layer_policies)
        self.kept_float32 = dict(kept_float32 or {})
        self.float16_inputs = bool(float16_inputs)
        copies = []
        for i, (v, dt) in enumerate(zip(sources, variable_dtypes)):
            copies.append(self.add_weight(
                shape=tuple(v.shape), dtype=dt, initializer="zeros",
                trainable=False, name=v.name,
            ))
        self._hidden.pairs = list(zip(sources, copies))
        if values is not None:
            for (_, c), value in zip(self._hidden.pairs, values):
                c.assign(np.asarray(value).astype(c.dtype))
        self.built = True

    def source_model(self):
        """The original model (not tracked, never modified).

        A method, not an attribute: `.keras` saving stores what attributes
        and properties hold.
        """
        return self._hidden.source

    def variable_dtype_map(self):
        """`{"layer path/variable name": dtype of its copy}`.

        The layer path is as in `layer_compute_dtypes` (`"mha/query"`).
        """
        names = {}
        hidden = self._hidden
        for path, layer in zip(hidden.paths[1:], hidden.layers[1:]):
            for v in _ki.own_variables(layer):
                names.setdefault(id(v), f"{path}/{v.name}")
        return {
            names.get(id(s), s.path): str(c.dtype)
            for s, c in self._hidden.pairs
        }

    def layer_compute_dtypes(self):
        """`{layer path: compute dtype}` of the layers, as it runs them."""
        paths = self._hidden.paths
        out = {}
        for path, layer, name in zip(
            paths, self._hidden.layers, self.layer_policies
        ):
            if path and not is_container(layer):
                out[path] = (keras.DTypePolicy(name).compute_dtype
                             if name else layer.compute_dtype)
        return out

    def call(self, inputs, training=False):
        mapping = [
            (s, keras.ops.cast(c.value, s.dtype)) for s, c in self._hidden.pairs
        ]
        saved, patched = [], []
        try:
            for layer, name in zip(self._hidden.layers, self.layer_policies):
                if name is None:
                    continue
                saved.append((layer, _policy.stored_policy(layer)))
                _ki.store_dtype_policy(layer, keras.DTypePolicy(name))
            for layer, dtype in self._handback():
                patched.append((layer, layer.__dict__.get("call")))
                object.__setattr__(layer, "call", _handing_back(layer, dtype))
            with keras.StatelessScope(state_mapping=mapping), \
                    self._global_policy():
                outputs = self._hidden.source(inputs, training=training)
        finally:
            for layer, call in reversed(patched):
                if call is None:
                    layer.__dict__.pop("call", None)
                else:
                    object.__setattr__(layer, "call", call)
            for layer, policy in reversed(saved):
                _ki.store_dtype_policy(layer, policy)
        if self.float16_inputs:
            return outputs
        return keras.tree.map_structure(_to_float32, outputs)

    def _global_policy(self):
        """The global policy while the copy runs: the copy's own (`float32`
        for the float32 copy), for the layers a `call` creates as it runs.

        keras-hub's EfficientNet blocks create their residual `Add` inside
        `call`; under the caller's `mixed_float16` it added in float16 in
        the float32 copy, and TFLite, which runs only float32 graphs,
        refused the file (Flex `AddV2`, `Mul`).
        """
        name = self.layer_policies[0]
        if name is None:
            return contextlib.nullcontext()
        return _policy.policy_scope(name)

    def _handback(self):
        """`(layer, dtype)`: the float32 layers whose float32 outputs go
        back to a half-precision parent, cast to its compute dtype.

        A layer kept in float32 inside a half-precision layer hands its
        output back in the parent's dtype, which the parent's own code
        (`x + residual` on backend tensors) expects. Top-level layers of a
        Functional or Sequential model need no cast: Keras casts each
        layer's inputs itself, and op nodes promote.
        """
        paths = self._hidden.paths
        index = {p: i for i, p in enumerate(paths)}
        graph = is_graph_model(self._hidden.source)
        out = []
        for path, layer, name in zip(
            paths, self._hidden.layers, self.layer_policies
        ):
            if not path or name != "float32":
                continue
            parent = path.rsplit("/", 1)[0] if "/" in path else ""
            if not parent and graph:
                continue
            p_layer = self._hidden.layers[index[parent]]
            p_name = self.layer_policies[index[parent]]
            dtype = (keras.DTypePolicy(p_name).compute_dtype if p_name
                     else p_layer.compute_dtype)
            if dtype != "float32" and is_float(dtype):
                out.append((layer, dtype))
        return out

    def get_config(self):
        return {
            "name": self.name,
            "source": keras.saving.serialize_keras_object(
                self._hidden.source
            ),
            "variable_dtypes": list(self.variable_dtypes),
            "layer_policies": list(self.layer_policies),
            "kept_float32": dict(self.kept_float32),
            "float16_inputs": self.float16_inputs,
        }

    @classmethod
    def from_config(cls, config):
        config = dict(config)
        source = keras.saving.deserialize_keras_object(config.pop("source"))
        if not source.built:
            raise ValueError(
                f"HalfModel: the saved model {source.name!r} could not be "
                "built again from its config (no build config)."
            )
        return cls(source, **config)


def _dtype_of(x):
    if not hasattr(x, "dtype"):
        return None
    return keras.backend.standardize_dtype(x.dtype)


def _to_float32(x):
    dtype = _dtype_of(x)
    if dtype is not None and is_float(dtype) and dtype != "float32":
        return keras.ops.cast(x, "float32")
    return x


def _handing_back(layer, dtype):
    """`layer.call` with its float32 outputs handed back in `dtype`
    (`kerasmp.policy.hand_back`, the cast kerasmp's policy applies)."""
    call = type(layer).call.__get__(layer)

    @functools.wraps(call)
    def wrapped(*args, **kwargs):
        return hand_back(call(*args, **kwargs), dtype)

    return wrapped


def check_rules(model, dtype, keep_float32=None):
    """Applies `keep_float32` to `model` for its checks and warnings only.

    For a format whose writer stores the float32 model's weights in half
    precision itself (TFLite): a bad `keep_float32` raises and a weight
    beyond the float16 range warns, naming its layer, as `convert` does.
    """
    decide(model, dtype, keep_rules(model, keep_float32))


def convert(model, dtype, keep_float32=None, float16_inputs=False):
    """Returns `(HalfModel, {path: reason} of layers kept in float32)`."""
    p = plan(model, dtype, keep_float32)
    values = [to_numpy(v) for v in unique_variables(model)]
    half = HalfModel(
        model, p["variable_dtypes"], p["layer_policies"],
        kept_float32=p["kept_float32"], float16_inputs=float16_inputs,
        values=values,
    )
    return half, p["kept_float32"]


def to_float16(model, keep_float32=None, float16_inputs=False,
               dtype="float16"):
    """Returns a half-precision copy of `model` for inference.

    Nothing is rebuilt: the copy holds half-precision copies of the
    variables and, when called, runs `model`'s own `call` with them
    (`keras.StatelessScope`) and with each layer's dtype policy temporarily
    set to `mixed_float16` (or `float32` for the kept layers). So it works
    for any model Keras can trace, keras-hub backbones and models without a
    `get_config()` included. Its variables and computations are float16 (or
    bfloat16), except the layers kept in float32:

    - the layers matched by `keep_float32`; by default the float32 layers of
      the model's `kerasmp.Policy` (or `kerasmp.DEFAULT_FLOAT32_LAYERS`:
      softmax and normalization layers, nested ones included, and layers
      whose activation is softmax);
    - the layers kerasmp's measurement moved to float32 (they fail in
      float16, or route a mixture of experts: `kerasmp.policy.measure`);
    - for float16, any layer with a weight float16 cannot represent
      (|x| > 65504), with a warning naming it: a BatchNormalization moving
      variance above 65504 would become inf and zero its channel.

    The weights are the float32 masters of `model`, rounded once. The inputs
    stay float32 (the first layers cast them) unless `float16_inputs=True`.
    `model` itself is not modified, and the copy has no compile state.

    Args:
        model: A built `keras.Model` (Sequential, Functional, subclassed).
        keep_float32: None for the defaults above, or a sequence of
            `keras.layers.Layer` subclasses and/or regular expressions
            matched against layer names (`re.fullmatch`) to keep in float32
            instead (weights beyond the float16 range are always kept). To
            add to the defaults, pass
            `[*kerasmp.DEFAULT_FLOAT32_LAYERS, "head"]`.
        float16_inputs: Whether the model's float inputs become half
            precision too. Defaults to False (float32 inputs).
        dtype: `"float16"` (default) or `"bfloat16"`.

    Returns:
        A `kerasmp.export.half.HalfModel` (a `keras.Model`): `half.weights` are
        the copies; `half.layer_compute_dtypes()`,
        `half.variable_dtype_map()` and `half.kept_float32` describe it;
        `half.source_model()` is `model`.

    Example:

    >>> with kerasmp.policy_scope("mixed_float16"):
    ...     model = keras.Sequential([keras.Input((8,)),
    ...                               keras.layers.Dense(4, name="d"),
    ...                               keras.layers.LayerNormalization(
    ...                                   name="ln")])
    >>> half = kerasmp.export.to_float16(model)
    >>> half.layer_compute_dtypes()
    {'d': 'float16', 'ln': 'float32'}
    """
    check_dtype(dtype, DTYPES)
    measure_once(model)  # as its first call would
    return convert(model, dtype, keep_float32, float16_inputs)[0]
