"""A half-precision copy of a model that plain Keras loads (no kerasmp).

The `.keras` export. The model's own config is kept, and each layer's
`dtype` entry becomes a stock policy (`keras_config`): a plain
`keras.DTypePolicy` where the layer and the sublayers it creates itself
take one policy (the half-precision dtype, `"float16"` or `"bfloat16"`, or
`"float32"` for a layer kerasmp keeps), else a
`keras.dtype_policies.DTypePolicyMap` whose default is the half-precision
dtype and which maps the `Layer.path` of each kept sublayer to `"float32"`
(a stock normalization layer that a layer's own code creates gets
`"mixed_float16"`: float32 variables and arithmetic, its output handed back
in float16, as kerasmp does for a kept layer nested in a half-precision
one). Keras resolves a layer's dtypes through such a map by the layer's own
path, also for the sublayers a layer creates itself with
`dtype=self.dtype_policy` (the softmax inside `MultiHeadAttention`, the
layers of a keras-hub block), so the file says everything with stock
classes and `keras.saving.load_model` reads it where kerasmp is not
installed.

A sublayer that stock policies cannot reach (its parent creates it without
passing its dtype policy, or it has no Keras path) is left at the loader's
default (`Plain.left_at_default`, with the bytes it costs); `export` writes
the file only if it then passes parity. A model whose config does not
rebuild the same layers raises `NotExpressible` naming the layer, before
anything is written; so does a layer whose config `.keras` saving cannot
write. The format's writer (the weights in compact HDF5 groups), reader
(`keras.saving.load_model`) and weight counter close the module.
"""

import dataclasses
import functools
import os
import re
import shutil
import tempfile
import zipfile

import keras
import numpy as np

from kerasmp import _keras_internals as _ki
from kerasmp._utils.arrays import is_float
from kerasmp._utils.arrays import to_numpy
from kerasmp._utils.layers import walk
from kerasmp.export.half import is_container
from kerasmp.export.half import plan
from kerasmp.export.half import unique_variables
from kerasmp.export.inputs import PREDICT_BATCH
from kerasmp.export.inputs import input_specs
from kerasmp.export.inputs import pack
from kerasmp.export.keras_config import NotExpressible
from kerasmp.export.keras_config import cannot_write
from kerasmp.export.keras_config import copy_assets
from kerasmp.export.keras_config import float32_global
from kerasmp.export.keras_config import instead
from kerasmp.export.keras_config import pairs
from kerasmp.export.keras_config import plain_policy
from kerasmp.export.keras_config import policy_map
from kerasmp.export.keras_config import rebuild
from kerasmp.export.keras_config import replace_policies
from kerasmp.export.keras_config import rewrite
from kerasmp.export.keras_config import root_cause

__all__ = ["NotExpressible", "Plain", "build", "run_keras", "weights_keras",
           "write_keras"]

# Stock normalization layers: float32 arithmetic inside under a mixed policy.
_UPCASTING = (keras.layers.BatchNormalization,
              keras.layers.LayerNormalization,
              keras.layers.GroupNormalization)
_WEIGHTS = "model.weights.h5"


@dataclasses.dataclass
class Plain:
    """What `build` returns.

    Attributes:
        model: The plain Keras model (stock policies, `dtype` weights).
        kept: `{path: reason}` of the layers computing in float32 in it.
        left_at_default: `{path: {"class", "compute_dtype",
            "weights_dtype", "wanted", "extra_bytes", "why"}}` of the layers
            stock policies cannot reach: the dtypes they get at load (the
            loader's default), the one kerasmp decided, what storing their
            weights so costs in bytes (negative: saves), and why.
    """

    model: object
    kept: dict
    left_at_default: dict


@dataclasses.dataclass
class _Job:
    model: object
    dtype: str
    kept: dict
    variable_dtypes: list
    config: dict
    probe: object
    wpath: dict
    check: object
    unreached: list  # paths of the layers that take the global policy


def build(model, dtype, keep_float32=None, example=None):
    """Returns the `Plain` copy of `model` in `dtype` for a `.keras` file.

    The plain model is a stock Keras model rebuilt from `model`'s config
    with the policies described in the module docstring, holding the
    float32 master weights of `model` rounded once to `dtype` (float32 for
    the kept layers; a layer left at the loader's default stores its
    weights in that default's dtype). With `example` (the parity inputs:
    one array per model input), it is checked by running it on their first
    8 rows; it is always checked to serialize as `.keras` saving will.

    A kept layer that Keras gives no `Layer.path` (a `Softmax` has no
    build) is reached through its parent's map default, which then makes
    the parent's other pathless sublayers (its `Dropout`) float32 as well.
    If that run raises with that (a parent's own code adding a
    float32 to a float16 tensor), or if that default makes a pathless layer
    kerasmp keeps in half precision compute in float32 on half-precision
    inputs (its float32 output may then meet a float16 tensor in the
    parent's code: TensorFlow refuses to add them, JAX promotes silently, so
    the file would load on one backend only), the model is rebuilt with
    those layers in the half-precision dtype; they are then left at the
    default (`Plain.left_at_default`). A float32 default that reaches kept
    layers only (a top-level `Activation(dtype="float32")`) is always kept.

    A layer without its own `get_config` gets one from Keras only when its
    `__init__` arguments are plain values; a policy map is not one, so
    such a layer gets a plain policy instead, and the sublayers that needed
    the map are left at the default.

    Raises:
        NotExpressible: naming the layer, before anything is written.
    """
    p = plan(model, dtype, keep_float32)
    try:
        config = keras.saving.serialize_keras_object(model)
    except NotImplementedError as e:  # no get_config()
        raise cannot_write(model, f"{type(model).__name__} has no usable "
                           "get_config() (add one returning its __init__ "
                           "arguments)") from e
    check = None
    if example is not None:
        few = [a[:8] for a in example]
        check = lambda plain: compiled_predict(plain, few)  # noqa: E731
    config.pop("compile_config", None)  # inference only: no optimizer
    # Pass 1 learns each rebuilt layer's `Layer.path` (the maps' keys), and
    # which layers no policy in the config reaches: built under a global
    # policy of its own, they hold that very object.
    default = keras.DTypePolicy(dtype)
    probe = rebuild(replace_policies(config, policy_map(dtype, {})), model,
                    global_policy=default)
    probe_pairs = pairs(model, probe)
    job = _Job(model, dtype, dict(p["kept_float32"]), p["variable_dtypes"],
               config, probe, {id(b): path for path, _, b in probe_pairs},
               check, sorted(
                   (path for path, _, b in probe_pairs
                    if _ki.stored_dtype_policy(b) is default
                    and not is_container(b)),  # those with weights first
                   key=lambda q: not _has_weights(q, probe_pairs)))
    plain_only = set()
    while True:
        plain = _first_that_runs(job, plain_only)
        unsavable, error = _unsavable(model, plain.model)
        if not unsavable:
            return plain
        if unsavable <= plain_only:
            path = sorted(unsavable)[0]
            layer = dict((q, b) for q, _, b in pairs(model, plain.model))[
                path]
            raise cannot_write(
                model, f"layer {path!r} ({type(layer).__name__}) has no "
                "get_config() and Keras cannot write one for it ("
                f"{_first_sentence(error)})") from error
        plain_only |= unsavable


def _has_weights(path, layer_pairs):
    layer = next(b for q, _, b in layer_pairs if q == path)
    return any(is_float(v.dtype) for v in _ki.own_variables(layer))


def _first_sentence(error):
    text = " ".join(str(error).split())
    return text.split(". ")[0].rstrip(".")


def _unsavable(model, rebuilt):
    """`(paths, error)`: the layers of `rebuilt` whose config `.keras`
    saving asks for and cannot get (Keras's automatic `get_config` takes
    only plain `__init__` arguments: `NotImplementedError` "Object X was
    created by passing non-serializable argument values"), by their path in
    `model`; `(set(), None)` when it serializes."""
    try:
        keras.saving.serialize_keras_object(rebuilt)
        return set(), None
    except NotImplementedError as e:
        error = e
    m = re.search(r"Object (\w+) was created", str(error))
    found = set()
    for path, _, layer in pairs(model, rebuilt):
        if m and type(layer).__name__ != m.group(1):
            continue
        try:
            layer.get_config()
        except NotImplementedError:
            found.add(path)
    if not found:
        raise cannot_write(model, "Keras cannot write its config ("
                           f"{_first_sentence(error)})") from error
    return found, error


def _first_that_runs(job, plain_only):
    """The `Plain` copy whose pathless kept layers are float32 if it runs
    so (see `build`), else with them in the half-precision dtype."""
    try:
        rebuilt, left, _ = _attempt(job, True, plain_only)
    except _RunFailed as first:
        try:
            rebuilt, left, pathless = _attempt(job, False, plain_only)
        except _RunFailed as e:
            raise _fails_to_run(job.model, e.__cause__) from e.__cause__
        if not pathless:
            raise _fails_to_run(job.model,
                                first.__cause__) from first.__cause__
        for path in (p for p in pathless if p in left):
            left[path]["why"] = (
                "it has no Keras path, so only its parent's default reaches "
                "it, and a float32 default breaks the parent ("
                f"{root_cause(first.__cause__)})")
    kept = {k: v for k, v in job.kept.items() if k not in left}
    return Plain(rebuilt, kept, left)


class _RunFailed(Exception):
    pass


def _fails_to_run(model, error):
    """The `NotExpressible` of a plain copy of `model` that raised `error`
    when run."""
    return cannot_write(model, "with stock dtype policies it fails to run "
                        f"({root_cause(error)})")


def _left(layer, wanted_compute, wanted, why):
    """A `Plain.left_at_default` entry for the rebuilt `layer`."""
    extra = 0
    for v in _ki.own_variables(layer):
        if is_float(v.dtype) and id(v) in wanted:
            size = int(np.prod(v.shape))
            extra += size * (np.dtype(str(v.dtype)).itemsize
                             - np.dtype(wanted[id(v)]).itemsize)
    return {"class": type(layer).__name__,
            "compute_dtype": layer.compute_dtype,
            "weights_dtype": layer.variable_dtype,
            "wanted": wanted_compute, "extra_bytes": int(extra), "why": why}


def _auto_named(layer):
    """`{id(sublayer)}` of the sublayers `layer`'s own code creates whose
    `Layer.path` holds a name Keras made up with a counter of the process
    (`esm_rotary_embedding_6`: the class's snake-case name and `_6`),
    theirs or a parent's. The loader names them with its own counters, so
    a policy map cannot address them by path: they are reached through
    their parent's map default, like layers without a path. A bare stem
    (`position_embedding`) is what code that names its layers writes, and
    what a new process names the first one: it stays addressable."""
    out, at = set(), {}
    for path, sub in walk(layer):
        at[path] = sub
        parent = path.rsplit("/", 1)[0] if "/" in path else None
        made_up = re.fullmatch(
            re.escape(_snake_case(type(sub).__name__)) + r"_\d+", sub.name)
        if made_up or (parent is not None and id(at.get(parent)) in out):
            out.add(id(sub))
    return out


def _snake_case(name):
    """Keras's auto-name stem of a class name (`ESMRotaryEmbedding` ->
    `esm_rotary_embedding`)."""
    name = re.sub(r"\W+", "", name)
    name = re.sub("(.)([A-Z][a-z]+)", r"\1_\2", name)
    return re.sub("([a-z])([A-Z])", r"\1_\2", name).lower()


def _attempt(job, pathless_float32, plain_only):
    model, dtype, kept = job.model, job.dtype, job.kept
    handed_back, pathless = set(), []

    def node_policy(layer):
        if layer is None:  # an op node (`x + y`)
            return plain_policy(dtype)
        own = job.wpath.get(id(layer), "")
        if own in plain_only:
            return plain_policy("float32" if own in kept else dtype)
        family = [(job.wpath.get(id(l), ""), l)
                  for l in [layer] + [l for _, l in walk(layer)]]
        unstable = _auto_named(layer)
        entries, pathless_kept, widens = {}, [], False
        for i, (path, sub) in enumerate(family):
            name = "float32" if path in kept else dtype
            if (name == "float32" and dtype != "float32" and i > 0
                    and isinstance(sub, _UPCASTING)):
                # Created by its parent's own code, which may add its
                # output to a half-precision tensor: as kerasmp hands a
                # float32 output back in the parent's dtype, the stock
                # mixed policy keeps float32 variables and arithmetic and
                # returns the parent's dtype.
                name = f"mixed_{dtype}"
                handed_back.add(path)
            if sub.path and id(sub) not in unstable:
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
        default = "float32" if float32_default else dtype
        names = set(entries.values())
        if not (pathless_kept or widens) and len(names) == 1:
            return plain_policy(names.pop())
        if names <= {default}:
            return plain_policy(default)
        return policy_map(default, entries)

    try:
        rebuilt = rebuild(rewrite(job.config, job.probe, node_policy), model)
    except NotExpressible as e:
        if not job.unreached:
            raise
        path = job.unreached[0]
        layer = dict((q, b) for q, _, b in pairs(model, job.probe))[path]
        raise cannot_write(
            model, f"stock dtype policies cannot reach layer {path!r} ("
            f"{type(layer).__name__}) (its parent creates it without "
            "passing its dtype policy), and at the loader's default "
            "(float32) the model does not rebuild "
            f"({root_cause(e.__cause__ or e)})") from e
    sources = unique_variables(model)
    copies = unique_variables(rebuilt)
    if [tuple(v.shape) for v in sources] != [tuple(v.shape) for v in copies]:
        raise cannot_write(model, "the model rebuilt from its config "
                           "creates its variables differently")
    for s, c in zip(sources, copies):
        c.assign(to_numpy(s).astype(np.dtype(str(c.dtype))))
    copy_assets(model, rebuilt)
    wanted = {id(c): w for c, w in zip(copies, job.variable_dtypes)}
    left = {}
    for path, _, layer in pairs(model, rebuilt):
        if is_container(layer):
            continue
        if path in kept:
            if (is_float(layer.compute_dtype)
                    and layer.compute_dtype != "float32"
                    and not (path in handed_back
                             and layer.variable_dtype == "float32")):
                left[path] = _left(
                    layer, "float32", wanted,
                    "stock dtype policies cannot reach it (its parent "
                    "creates it with a dtype of its own, or cannot take a "
                    "policy map)")
        elif (layer.path and layer.variable_dtype != dtype and any(
                is_float(v.dtype) for v in _ki.own_variables(layer))):
            left[path] = _left(
                layer, dtype, wanted,
                "its parent creates it without passing its dtype policy, "
                "so it gets the loader's global policy")
    # The layers a float32 map default moves from half precision to float32
    # although kerasmp keeps them in half precision (a parent's `Dropout`).
    widened = [(path, layer) for path, _, layer in pairs(model, rebuilt)
               if pathless_float32 and dtype != "float32" and not layer.path
               and path not in kept
               and not is_container(layer)
               and layer.compute_dtype == "float32"]
    if job.check is not None:
        _run_check(job, rebuilt, widened, left, dict(
            (q, l) for q, _, l in pairs(model, rebuilt)))
    return rebuilt, left, pathless


def _run_check(job, rebuilt, widened, left, layers):
    """Runs `rebuilt` on the first parity inputs, recording the input
    dtypes of the layers that compute in float32 where kerasmp computes in
    half precision: those a float32 map default widens (`widened`), and
    those left at a float32 default (`left`).

    A widened layer turns a half-precision tensor into a float32 one that
    its parent's code may add to a half-precision tensor: JAX and PyTorch
    promote silently, TensorFlow refuses (`x + residual` in keras-hub's
    TransformerEncoder). So one that sees half-precision inputs fails the
    attempt (`_RunFailed`), on every backend alike. A run that raises
    fails it too, or, where a layer left at a float32 default saw
    half-precision inputs, refuses the file naming that layer
    (`NotExpressible`).
    """
    dtype = job.dtype
    stuck = [(path, layers[path]) for path, v in left.items()
             if v["compute_dtype"] == "float32" and v["wanted"] != "float32"]
    recorders = [(path, layer, _ki.stored_dtype_policy(layer),
                  _InputDtypes(layer.compute_dtype))
                 for path, layer in widened + stuck]
    for _, layer, _, rec in recorders:
        _ki.store_dtype_policy(layer, rec)
    failed = None
    try:
        job.check(rebuilt)
    except Exception as e:
        failed = e
    finally:
        for _, layer, original, _ in recorders:
            _ki.store_dtype_policy(layer, original)
    upcast = [(path, layer) for path, layer, _, rec in recorders
              if rec.seen & {dtype}]
    if failed is not None:
        stuck_upcast = [(p, l) for p, l in upcast if p in left]
        if stuck_upcast:
            path, layer = stuck_upcast[0]
            raise cannot_write(
                job.model, "stock dtype policies cannot reach layer "
                f"{path!r} ({type(layer).__name__}), which at the loader's "
                f"default computes in float32 on {dtype} inputs, and its "
                f"parent then fails ({root_cause(failed)})") from failed
        raise _RunFailed() from failed
    upcast = [(p, l) for p, l in upcast if p not in left]
    if upcast:
        path, layer = upcast[0]
        more = (f" and {len(upcast) - 1} other layer(s)"
                if len(upcast) > 1 else "")
        raise _RunFailed() from TypeError(
            f"it also makes {path!r} ({type(layer).__name__}){more} "
            f"compute in float32 on {dtype} inputs, whose float32 "
            f"outputs TensorFlow refuses to add to {dtype} tensors")


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
    """Writes the plain copy `model` (see `build`) as a `.keras` file, its
    weights in compact HDF5 groups (`compact_weights`)."""
    keras.saving.save_model(model, path)
    compact_weights(path)


def compact_weights(path):
    """Rewrites the weights inside the `.keras` file at `path` with HDF5's
    compact groups (the file format of HDF5 1.8, `libver="v108"`).

    Keras writes one HDF5 group per layer and per layer's variables in the
    original format, about 1 KB each: more than the weights of a small
    model (a tiny keras-hub Gemma3: 106 KB of HDF5 for 6.6 KB of weights;
    37.5 KB once compact). The groups, datasets and attributes are the
    same, and any h5py reads them. Nothing else in the archive changes.
    """
    import h5py

    tmp = tempfile.mkdtemp(prefix=".kerasmp-compact-",
                           dir=os.path.dirname(os.path.abspath(path)))
    try:
        loose, compact = (os.path.join(tmp, n) for n in ("in.h5", "out.h5"))
        out = os.path.join(tmp, "out.keras")
        with zipfile.ZipFile(path) as z:
            infos = z.infolist()
            if _WEIGHTS not in z.namelist():
                return
            with z.open(_WEIGHTS) as f, open(loose, "wb") as g:
                shutil.copyfileobj(f, g)
            with h5py.File(loose, "r") as a, h5py.File(
                    compact, "w", libver=("v108", "v108")) as b:
                _copy_group(a, b)
            with zipfile.ZipFile(out, "w") as zo:
                for info in infos:
                    if info.filename == _WEIGHTS:
                        zo.write(compact, _WEIGHTS,
                                 compress_type=info.compress_type)
                    else:
                        zo.writestr(info, z.read(info.filename))
        os.replace(out, path)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def _copy_group(source, target):
    import h5py

    target.attrs.update(source.attrs)
    for name, obj in source.items():
        if isinstance(obj, h5py.Group):
            _copy_group(obj, target.create_group(name))
        else:
            data = target.create_dataset(name, data=obj[()])
            data.attrs.update(obj.attrs)


def compiled_predict(model, arrays):
    """`model.predict` on `arrays` (flat, numpy), as a user runs a loaded
    file: compiled (a `tf.function` on TensorFlow), where TensorFlow checks
    what an eager call lets through (a float16 `range` of known length:
    Keras's eager `arange` falls back to float32).

    A keras-hub task with a preprocessor (`model.preprocessor`) runs
    Keras's own `predict`: the task's runs the preprocessor first (text
    in), and `arrays` are what the model itself takes (token ids)."""
    run = model.predict
    if getattr(model, "preprocessor", None) is not None:
        run = functools.partial(keras.Model.predict, model)
    y = run(pack(model, arrays), batch_size=PREDICT_BATCH, verbose=0)
    return [np.asarray(t) for t in keras.tree.flatten(y)]


def run_keras(path, arrays, specs):
    """Loads the `.keras` file at `path` with plain Keras, under a float32
    global policy as a process without kerasmp does, and runs it."""
    try:
        with float32_global():
            model = keras.saving.load_model(path, compile=False)
    except Exception as e:
        raise NotExpressible(
            f"The exported .keras file does not load back ({root_cause(e)})"
            f"; {instead()}.") from e
    try:
        outs = compiled_predict(model, arrays)
    except ValueError:
        raise
    except Exception as e:  # the stock policies break the model's code
        raise _fails_to_run(model, e) from e
    ins = [dtype for _, _, dtype in input_specs(model)]
    return outs, ins, [str(o.dtype) for o in outs]


def weights_keras(path):
    """Bytes of the weights stored in the `.keras` file at `path`."""
    import h5py

    total = 0
    with zipfile.ZipFile(path) as z, z.open(_WEIGHTS) as f:
        with h5py.File(f, "r") as h5:
            def add(_, obj):
                nonlocal total
                if isinstance(obj, h5py.Dataset):
                    total += obj.size * obj.dtype.itemsize
            h5.visititems(add)
    return total
