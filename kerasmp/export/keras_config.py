"""The config side of the `.keras` export: a model's config with each
layer's `dtype` rewritten to stock Keras dtype policies, rebuilt under a
float32 global policy as a process without kerasmp loads it, and paired
layer by layer with the model it came from.

`keras_file.build` decides the policies; this module writes them into the
config (`rewrite`, `plain_policy`, `policy_map`), rebuilds it (`rebuild`),
gives the rebuilt layers the assets a config does not carry
(`copy_assets`: a tokenizer's vocabulary) and says what failed
(`NotExpressible`, `root_cause`, `instead`).
"""

import copy
import re
import shutil
import tempfile

import keras

from kerasmp._utils.arrays import is_float
from kerasmp._utils.layers import walk
from kerasmp.export.half import is_graph_model
from kerasmp.export.specs import alternatives
from kerasmp.policy.plan import plan_of

_POLICY_CLASSES = ("DTypePolicy", "FloatDTypePolicy", "DTypePolicyMap")


class NotExpressible(ValueError, TypeError):
    """The model cannot be written as a plain Keras `.keras` file (a
    ValueError; also a TypeError, as the no-get_config() case was)."""


def instead():
    """`"export to 'savedmodel', 'tflite' or 'onnx' instead"`: the other
    formats this process's backend writes."""
    return (f"export to {alternatives('keras', keras.backend.backend())} "
            "instead")


def cannot_write(model, why):
    """The one-sentence `NotExpressible` for `model`: `why`, then the
    formats that work."""
    return NotExpressible(
        f"format='keras' cannot write {model.name!r} as a plain Keras "
        f"file: {why}; {instead()}.")


def plain_policy(name):
    """A stock `DTypePolicy(name)`, serialized: what a layer whose
    sublayers all take one policy gets (Keras passes it to `__init__` as
    the name, which its automatic `get_config` can store)."""
    return keras.saving.serialize_keras_object(keras.DTypePolicy(name))


def policy_map(default, entries):
    """A stock `DTypePolicyMap`, serialized: `default` and `{layer path:
    policy name}`."""
    mapping = keras.dtype_policies.DTypePolicyMap(
        default_policy=keras.DTypePolicy(default),
        policy_map={p: keras.DTypePolicy(n) for p, n in entries.items()},
    )
    return keras.saving.serialize_keras_object(mapping)


def replace_policies(config, policy):
    """`config` with every dtype policy entry replaced by `policy`.

    The `dtype` of an `InputLayer` (a tensor dtype, not a policy),
    quantized policies and the policies of layers that compute in no float
    dtype (a keras-hub tokenizer's `int32` or `string`) are left alone.
    """
    if isinstance(config, list):
        return [replace_policies(c, policy) for c in config]
    if not isinstance(config, dict):
        return config
    out = {}
    for key, value in config.items():
        if key == "dtype" and _is_float_policy(value):
            out[key] = copy.deepcopy(policy)
        else:
            out[key] = replace_policies(value, policy)
    return out


def _is_float_policy(value):
    """Whether `value` is a serialized stock float dtype policy (or map)."""
    if not isinstance(value, dict):
        return False
    kind = value.get("class_name")
    if kind == "DTypePolicyMap":
        return True
    name = (value.get("config") or {}).get("name")
    return kind in _POLICY_CLASSES and is_float(name)


def rewrite(config, layer, node_policy):
    """`config` (of `layer`) with each layer's dtype = `node_policy(layer)`.

    Functional and Sequential models are walked into: each of their layers
    gets its own entry. Any other layer's config (and what it nests) gets
    one policy (or map) covering the layer and the sublayers it creates
    itself; so does a functional model whose config is its own (no
    `layers` list: a keras-hub backbone, or a task, whose config nests its
    backbone's and its preprocessor's).
    """
    inner = config.get("config")
    if is_graph_model(layer) and isinstance(inner, dict) and isinstance(
            inner.get("layers"), list):
        inner = dict(inner)
        children = []
        for sub in inner["layers"]:
            name = (sub.get("config") or {}).get("name")
            if sub.get("class_name") == "InputLayer" or name is None:
                children.append(sub)
                continue
            try:
                child = layer.get_layer(name)
            except ValueError:  # an op node (`x + y`), not a layer
                child = None
            children.append(rewrite(sub, child, node_policy))
        inner["layers"] = children
        if isinstance(inner.get("dtype"), dict):
            inner["dtype"] = node_policy(layer)
        return {**config, "config": inner}
    if (isinstance(inner, dict) and isinstance(inner.get("preprocessor"), dict)
            and getattr(layer, "preprocessor", None) is not None):
        # A keras-hub task: its preprocessor (a tokenizer, an image
        # converter) computes nothing of the model, so it gets float32, as
        # a process without kerasmp builds it, and its tokenizer keeps its
        # int32 or string policy.
        rest = {k: v for k, v in inner.items() if k != "preprocessor"}
        out = replace_policies({**config, "config": rest}, node_policy(layer))
        out["config"]["preprocessor"] = replace_policies(
            inner["preprocessor"], plain_policy("float32"))
        return out
    return replace_policies(config, node_policy(layer))


def rebuild(config, model, global_policy="float32"):
    """The model `config` describes, built under a float32 global policy
    (as a process without kerasmp loads the file; or `global_policy`);
    `model` names it in errors."""
    try:
        with float32_global(global_policy):
            rebuilt = keras.saving.deserialize_keras_object(config)
    except Exception as e:  # any failure of a user's from_config
        raise cannot_write(model, "its config does not rebuild it "
                           f"({root_cause(e)})") from e
    if not rebuilt.built:
        raise cannot_write(model, "the model rebuilt from its config is "
                           "not built (no build config)")
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


class float32_global:
    """The global dtype policy is float32 (or `policy`) while the copy is
    rebuilt, as in a process that loads the file without kerasmp."""

    def __init__(self, policy="float32"):
        self.policy = policy

    def __enter__(self):
        self.previous = keras.config.dtype_policy()
        keras.config.set_dtype_policy(self.policy)

    def __exit__(self, *exc):
        keras.config.set_dtype_policy(self.previous)
        return False


def pairs(model, rebuilt):
    """`[(path, source layer, rebuilt layer)]`, checked to be the same."""
    source = plan_of(model).walk()
    copies = list(walk(rebuilt))
    same = len(source) == len(copies) and all(
        type(a) is type(b)
        for (_, a), (_, b) in zip(source, copies)
    )
    if not same:
        first = next(
            (p for (p, a), (_, b) in zip(source, copies)
             if type(a) is not type(b)),
            source[min(len(source), len(copies)) - 1][0] if source else "",
        )
        raise cannot_write(model, "its config does not rebuild the same "
                           f"layers (first difference at layer {first!r})")
    return [(p, a, b) for (p, a), (_, b) in zip(source, copies)]


def copy_assets(model, rebuilt):
    """Gives each layer of `rebuilt` the assets of its layer in `model`
    (a keras-hub tokenizer's vocabulary and merges, a `StringLookup`'s
    vocabulary): what `.keras` saving writes beside the weights, through
    the layers' own `save_assets` / `load_assets`, which a config does not
    carry. A keras-hub task's preprocessor is reached also where Keras
    does not track it as a layer (on PyTorch)."""
    both = [(s, c) for _, s, c in pairs(model, rebuilt)]
    source = getattr(model, "preprocessor", None)
    target = getattr(rebuilt, "preprocessor", None)
    if source is not None and target is not None and not any(
            s is source for s, _ in both):
        both += [(source, target)] + [
            (s, c) for (_, s), (_, c) in zip(walk(source), walk(target))]
    for source, target in both:
        if not (hasattr(source, "save_assets")
                and hasattr(target, "load_assets")):
            continue
        folder = tempfile.mkdtemp(prefix="kerasmp-assets-")
        try:
            source.save_assets(folder)
            target.load_assets(folder)
        finally:
            shutil.rmtree(folder, ignore_errors=True)
