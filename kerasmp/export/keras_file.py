"""A half-precision copy of a model that plain Keras loads (no kerasmp).

The `.keras` export. The model's own config is kept, and every layer's
`dtype` entry becomes one stock `keras.dtype_policies.DTypePolicyMap`: its
default policy is the half-precision dtype (`"float16"` or `"bfloat16"`:
half-precision variables and computations), and it maps the `Layer.path` of
each layer kerasmp keeps in float32 to `"float32"` (a stock normalization
layer that a layer's own code creates gets `"mixed_float16"`: float32
variables and arithmetic, its output handed back in float16, as kerasmp
does for a kept layer nested in a half-precision one). Keras resolves a layer's
dtypes through such a map by the layer's own path, also for the sublayers a
layer creates itself with `dtype=self.dtype_policy` (the softmax inside
`MultiHeadAttention`, the layers of a keras-hub block), so the file says
everything with stock classes and `keras.saving.load_model` reads it where
kerasmp is not installed.

Where that cannot express the model (its config does not rebuild the same
layers, or a kept layer is created with an explicit dtype the map does not
reach), `build` raises `NotExpressible` naming the layer. The format's
writer, reader (`keras.saving.load_model`) and weight counter close the
module.
"""

import copy
import re
import warnings

import keras
import numpy as np

from kerasmp import _keras_internals as _ki
from kerasmp._utils.arrays import is_float
from kerasmp._utils.arrays import to_numpy
from kerasmp._utils.layers import walk
from kerasmp.export.half import is_container
from kerasmp.export.half import is_graph_model
from kerasmp.export.half import plan
from kerasmp.export.half import unique_variables
from kerasmp.export.inputs import input_specs
from kerasmp.export.inputs import predict

# Each non-.keras format works without a config round trip.
OTHER_FORMATS = "'savedmodel', 'tflite' or 'onnx'"
# Stock normalization layers: float32 arithmetic inside under a mixed policy.
_UPCASTING = (keras.layers.BatchNormalization,
              keras.layers.LayerNormalization,
              keras.layers.GroupNormalization)
_POLICY_CLASSES = ("DTypePolicy", "FloatDTypePolicy", "DTypePolicyMap")


class NotExpressible(ValueError, TypeError):
    """The model cannot be written as a plain Keras `.keras` file (a
    ValueError; also a TypeError, as the no-get_config() case was)."""


def _policy_map(default, entries):
    policy_map = keras.dtype_policies.DTypePolicyMap(
        default_policy=keras.DTypePolicy(default),
        policy_map={p: keras.DTypePolicy(n) for p, n in entries.items()},
    )
    return keras.saving.serialize_keras_object(policy_map)


def _replace_policies(config, policy):
    """`config` with every dtype policy entry replaced by `policy`.

    The `dtype` of an `InputLayer` (a tensor dtype, not a policy) and
    quantized policies are left alone.
    """
    if isinstance(config, list):
        return [_replace_policies(c, policy) for c in config]
    if not isinstance(config, dict):
        return config
    out = {}
    for key, value in config.items():
        if key == "dtype" and isinstance(value, dict) and value.get(
            "class_name"
        ) in _POLICY_CLASSES:
            out[key] = copy.deepcopy(policy)
        else:
            out[key] = _replace_policies(value, policy)
    return out


def _rewrite(config, layer, node_policy):
    """`config` (of `layer`) with each layer's dtype = `node_policy(layer)`.

    Functional and Sequential models are walked into: each of their layers
    gets its own entry. Any other layer's config (and what it nests) gets
    one map covering the layer and the sublayers it creates itself.
    """
    if is_graph_model(layer) and isinstance(config.get("config"),
                                                  dict):
        inner = dict(config["config"])
        children = []
        for sub in inner.get("layers", []):
            name = (sub.get("config") or {}).get("name")
            if sub.get("class_name") == "InputLayer" or name is None:
                children.append(sub)
                continue
            try:
                child = layer.get_layer(name)
            except ValueError:  # an op node (`x + y`), not a layer
                child = None
            children.append(_rewrite(sub, child, node_policy))
        inner["layers"] = children
        if isinstance(inner.get("dtype"), dict):
            inner["dtype"] = node_policy(layer)
        return {**config, "config": inner}
    return _replace_policies(config, node_policy(layer))


def _rebuild(config, model):
    try:
        with _float32_global():
            rebuilt = keras.saving.deserialize_keras_object(config)
    except Exception as e:  # any failure of a user's from_config
        raise NotExpressible(
            f"format='keras' cannot write {model.name!r} as a plain Keras "
            f"file: its config does not rebuild it ({root_cause(e)}); "
            f"export to {OTHER_FORMATS} instead."
        ) from e
    if not rebuilt.built:
        raise NotExpressible(
            f"format='keras' cannot write {model.name!r} as a plain Keras "
            "file: the model rebuilt from its config is not built (no build "
            f"config); export to {OTHER_FORMATS} instead."
        )
    return rebuilt


def root_cause(e):
    """The first line of the innermost exception, or Keras's "Could not
    locate class" sentence (naming the unregistered class) when present."""
    m = re.search(r"Could not locate class '[^']+'", str(e))
    if m:
        return m.group(0) + " (register it with "\
            "@keras.saving.register_keras_serializable())"
    while e.__cause__ is not None or e.__context__ is not None:
        e = e.__cause__ or e.__context__
    text = str(e).strip().splitlines()
    line = text[0] if text else ""
    if len(line) > _CAUSE_CHARS:  # cut at a word, and say so
        line = line[:_CAUSE_CHARS].rsplit(" ", 1)[0] + " ..."
    return f"{type(e).__name__}: {line}"


_CAUSE_CHARS = 300
"""How much of the innermost exception's first line `root_cause` quotes."""


class _float32_global:
    """The global dtype policy is float32 while the copy is rebuilt, as in
    a process that loads the file without kerasmp."""

    def __enter__(self):
        self.previous = keras.config.dtype_policy()
        keras.config.set_dtype_policy("float32")

    def __exit__(self, *exc):
        keras.config.set_dtype_policy(self.previous)
        return False


def _pairs(model, rebuilt):
    """`[(path, source layer, rebuilt layer)]`, checked to be the same."""
    source = list(walk(model))
    copy = list(walk(rebuilt))
    same = len(source) == len(copy) and all(
        type(a) is type(b)
        for (_, a), (_, b) in zip(source, copy)
    )
    if not same:
        first = next(
            (p for (p, a), (_, b) in zip(source, copy)
             if type(a) is not type(b)),
            source[min(len(source), len(copy)) - 1][0] if source else "",
        )
        raise NotExpressible(
            f"format='keras' cannot write {model.name!r} as a plain Keras "
            f"file: its config does not rebuild the same layers (first "
            f"difference at layer {first!r}); export to {OTHER_FORMATS} "
            "instead."
        )
    return [(p, a, b) for (p, a), (_, b) in zip(source, copy)]


def build(model, dtype, keep_float32=None, example=None):
    """Returns `(plain model, {path: reason} of layers kept in float32)`.

    The plain model is a stock Keras model rebuilt from `model`'s config
    with the policy maps described in the module docstring, holding the
    float32 master weights of `model` rounded once to `dtype` (float32 for
    the kept layers). With `example` (the parity inputs: one array per
    model input), it is checked by running it on their first 8 rows.

    A kept layer that Keras gives no `Layer.path` (a `Softmax` has no
    build) is reached through its parent's map default, which then makes
    the parent's other pathless sublayers (its `Dropout`) float32 as well.
    If that run raises with that (a parent's own code adding a
    float32 to a float16 tensor), or if that default makes a pathless layer
    kerasmp keeps in half precision compute in float32 on half-precision
    inputs (its float32 output may then meet a float16 tensor in the
    parent's code: TensorFlow refuses to add them, JAX promotes silently, so
    the file would load on one backend only), the model is rebuilt with
    those layers in the half-precision dtype, with a warning naming them;
    they are left out of the returned kept layers. A float32 default that
    reaches kept layers only (a top-level `Activation(dtype="float32")`)
    is always kept.

    Raises:
        NotExpressible: naming the layer, before anything is written.
    """
    p = plan(model, dtype, keep_float32)
    kept = dict(p["kept_float32"])
    try:
        config = keras.saving.serialize_keras_object(model)
    except NotImplementedError as e:  # no get_config()
        raise NotExpressible(
            f"format='keras' cannot write {model.name!r} as a plain Keras "
            f"file: {type(model).__name__} has no usable get_config() (add "
            "one returning its __init__ arguments); export to "
            f"{OTHER_FORMATS} instead.") from e
    check = None
    if example is not None:
        few = [a[:8] for a in example]
        check = lambda plain: predict(plain, few)  # noqa: E731
    config.pop("compile_config", None)  # inference only: no optimizer
    # Pass 1 learns each rebuilt layer's `Layer.path` (the maps' keys).
    probe = _rebuild(_replace_policies(config, _policy_map(dtype, {})),
                     model)
    wpath = {id(b): p for p, _, b in _pairs(model, probe)}
    try:
        rebuilt, _ = _attempt(model, dtype, kept, config, probe, wpath,
                              pathless_float32=True, check=check)
        return rebuilt, kept
    except _RunFailed as first:
        try:
            rebuilt, pathless = _attempt(
                model, dtype, kept, config, probe, wpath,
                pathless_float32=False, check=check)
        except _RunFailed as e:
            raise _fails_to_run(model, e.__cause__) from e.__cause__
        if not pathless:
            raise _fails_to_run(model, first.__cause__) from first.__cause__
        warnings.warn(
            f"kerasmp.export: in the .keras file of {model.name!r}, "
            f"{', '.join(repr(x) for x in pathless)} compute in {dtype}, "
            "not float32: stock dtype policies reach a layer without a "
            "Keras path only through its parent's default, and a float32 "
            f"default breaks the parent ({root_cause(first.__cause__)}); "
            "'savedmodel', 'tflite' and 'onnx' keep them in float32.",
            stacklevel=3)
        return rebuilt, {k: v for k, v in kept.items() if k not in pathless}


class _RunFailed(Exception):
    pass


def _fails_to_run(model, error):
    """The `NotExpressible` of a plain copy of `model` that raised `error`
    when run."""
    return NotExpressible(
        f"format='keras' cannot write {model.name!r} as a plain Keras file: "
        "with stock dtype policies it fails to run "
        f"({root_cause(error)}); export to {OTHER_FORMATS} instead.")


def _attempt(model, dtype, kept, config, probe, wpath, pathless_float32,
             check):
    handed_back, pathless = set(), []

    def node_policy(layer):
        if layer is None:
            return _policy_map(dtype, {})
        family = [(wpath.get(id(l), ""), l)
                  for l in [layer] + [l for _, l in walk(layer)]]
        entries, pathless_kept, widens = {}, [], False
        for i, (path, sub) in enumerate(family):
            name = "float32" if path in kept else dtype
            if name == "float32" and i > 0 and isinstance(sub, _UPCASTING):
                # Created by its parent's own code, which may add its
                # output to a half-precision tensor: as kerasmp hands a
                # float32 output back in the parent's dtype, the stock
                # mixed policy keeps float32 variables and arithmetic and
                # returns the parent's dtype.
                name = f"mixed_{dtype}"
                handed_back.add(path)
            if sub.path:
                entries[sub.path] = name
            elif path in kept:
                pathless_kept.append(path)
            else:
                widens = True  # a float32 default would reach this one too
        # A float32 default that reaches only kept layers (a top-level
        # `Activation(dtype="float32")`: no sublayers) is always right.
        float32_default = bool(pathless_kept) and (
            pathless_float32 or not widens)
        if not float32_default:
            pathless.extend(p for p in pathless_kept if p not in pathless)
        return _policy_map("float32" if float32_default else dtype, entries)

    rebuilt = _rebuild(_rewrite(config, probe, node_policy), model)
    for path, src, layer in _pairs(model, rebuilt):
        if (path in kept and not is_container(layer)
                and is_float(layer.compute_dtype)
                and layer.compute_dtype != "float32"
                and not (path in handed_back
                         and layer.variable_dtype == "float32")
                and not (path in pathless and not pathless_float32)):
            raise NotExpressible(
                f"format='keras' cannot write {model.name!r} as a plain "
                f"Keras file: layer {path!r} ({type(layer).__name__}) "
                f"would compute in {layer.compute_dtype}, not float32, "
                "because stock dtype policies cannot reach it; export to "
                f"{OTHER_FORMATS} instead."
            )
        if (path not in kept and layer.path and any(
                is_float(v.dtype) for v in _ki.own_variables(layer))
                and layer.variable_dtype != dtype):
            raise NotExpressible(
                f"format='keras' cannot write {model.name!r} as a plain "
                f"Keras file: layer {path!r} ({type(layer).__name__}) "
                f"would store {layer.variable_dtype} weights, not {dtype} "
                "(its parent creates it without passing its dtype policy, "
                "so stock Keras gives it the global policy); export to "
                f"{OTHER_FORMATS} instead."
            )
    sources = unique_variables(model)
    copies = unique_variables(rebuilt)
    if [tuple(v.shape) for v in sources] != [tuple(v.shape) for v in copies]:
        raise NotExpressible(
            f"format='keras' cannot write {model.name!r} as a plain Keras "
            "file: the model rebuilt from its config creates its variables "
            f"differently; export to {OTHER_FORMATS} instead."
        )
    for s, c in zip(sources, copies):
        value = to_numpy(s)
        c.assign(value.astype(np.dtype(str(c.dtype))))
    # The layers a float32 map default moves from half precision to float32
    # although kerasmp keeps them in half precision (a parent's `Dropout`).
    widened = [(path, layer) for path, _, layer in _pairs(model, rebuilt)
               if pathless_float32 and not layer.path and path not in kept
               and not is_container(layer)
               and layer.compute_dtype == "float32"]
    if check is not None:
        recorders = [(path, layer, _ki.stored_dtype_policy(layer),
                      _InputDtypes(layer.compute_dtype))
                     for path, layer in widened]
        for _, layer, _, rec in recorders:
            _ki.store_dtype_policy(layer, rec)
        try:
            check(rebuilt)
        except Exception as e:
            raise _RunFailed() from e
        finally:
            for _, layer, original, _ in recorders:
                _ki.store_dtype_policy(layer, original)
        upcast = [(path, layer) for path, layer, _, rec in recorders
                  if rec.seen & {dtype}]
        if upcast:
            # Such a layer turns a half-precision tensor into a float32 one
            # that its parent's code may add to a half-precision tensor:
            # JAX promotes silently, TensorFlow refuses (`x + residual` in
            # keras-hub's TransformerEncoder). Same verdict on both.
            path, layer = upcast[0]
            more = (f" and {len(upcast) - 1} other layer(s)"
                    if len(upcast) > 1 else "")
            raise _RunFailed() from TypeError(
                f"it also makes {path!r} ({type(layer).__name__}){more} "
                f"compute in float32 on {dtype} inputs, whose float32 "
                f"outputs TensorFlow refuses to add to {dtype} tensors")
    return rebuilt, pathless


class _InputDtypes(keras.DTypePolicy):
    """A stock float policy that records the dtypes of the float inputs
    `Layer.__call__` converts with it (in `seen`)."""

    def __init__(self, name):
        super().__init__(name)
        self.seen = set()

    def convert_input(self, x, autocast, dtype):
        if hasattr(x, "dtype"):
            d = keras.backend.standardize_dtype(x.dtype)
            if is_float(d):
                self.seen.add(d)
        return super().convert_input(x, autocast, dtype)


def write_keras(model, path, specs, dtype, io_dtype, example=None):
    """Writes the plain copy `model` (see `build`) as a `.keras` file."""
    keras.saving.save_model(model, path)


def run_keras(path, arrays, specs):
    """Loads the `.keras` file at `path` with plain Keras and runs it."""
    try:
        model = keras.saving.load_model(path, compile=False)
    except Exception as e:
        raise ValueError(
            f"The exported .keras file does not load back ({type(e).__name__}"
            f": {e}); export to 'savedmodel', 'tflite' or 'onnx' instead."
        ) from e
    try:
        outs = predict(model, arrays)
    except ValueError:
        raise
    except Exception as e:  # the stock policies break the model's code
        raise _fails_to_run(model, e) from e
    ins = [dtype for _, _, dtype in input_specs(model)]
    return outs, ins, [str(o.dtype) for o in outs]


def weights_keras(path):
    """Bytes of the weights stored in the `.keras` file at `path`."""
    import zipfile

    import h5py

    total = 0
    with zipfile.ZipFile(path) as z, z.open("model.weights.h5") as f:
        with h5py.File(f, "r") as h5:
            def add(_, obj):
                nonlocal total
                if isinstance(obj, h5py.Dataset):
                    total += obj.size * obj.dtype.itemsize
            h5.visititems(add)
    return total
