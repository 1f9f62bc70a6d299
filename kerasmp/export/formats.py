"""Inputs, parity and the per-format writers and readers of kerasmp.export.

Each format has a writer (`write_<format>`) and a reader (`run_<format>`)
that loads the artifact with its own runtime and runs it on numpy inputs:
Keras for `.keras`, `tf.saved_model.load` for SavedModel, ai_edge_litert for
TFLite, onnxruntime for ONNX.

Length: four formats, each a writer and a reader with its runtime's quirks
(SavedModel signatures, the TFLite converter, tf2onnx), plus the input specs
and batched runs they share; splitting one file per format would spread the
shared spec and run helpers over five modules.
"""

import dataclasses
import os
import re
import warnings

import keras
import numpy as np

from kerasmp import _keras_internals as _ki
from kerasmp._utils.layers import walk
from kerasmp.export import tflite_convert as _tflite_convert
from kerasmp.export.half import HalfModel
from kerasmp.export.half import is_float
from kerasmp.export.half import is_graph_model
from kerasmp.export.half import numpy_value
from kerasmp.export.half import unique_variables
from kerasmp.export.specs import SPECS
from kerasmp.export.specs import FormatSpec

ONNX_PACKAGES = SPECS["onnx"].packages
_PREDICT_BATCH = 128
DEFAULT_LENGTH = 16  # unknown dimensions of the default parity inputs


def _sanitize(name, i):
    name = re.sub(r"\W", "_", name or "")
    if not name or name[0].isdigit():
        name = f"input_{i}"
    return name


def input_specs(model):
    """`[(name, batch_shape, dtype)]` of the model's inputs, flat."""
    if isinstance(model, HalfModel):
        specs = input_specs(model.source_model())
        if model.float16_inputs:
            specs = [
                (n, s, "float16" if is_float(d) else d) for n, s, d in specs
            ]
        return specs
    first = next(iter(_ki.direct_sublayers(model)), None)
    if isinstance(model, keras.Sequential) and isinstance(
        first, keras.layers.InputLayer
    ):
        x = first.output
        specs = [(first.name, tuple(x.shape), str(x.dtype))]
    elif is_graph_model(model) and not isinstance(model, keras.Sequential):
        specs = [
            (x.name, tuple(x.shape), str(x.dtype))
            for x in keras.tree.flatten(model.input)
        ]
    else:
        build = model.get_build_config() or {}
        if "input_shape" not in build:
            raise ValueError(
                f"Cannot tell the inputs of subclassed model {model.name!r}: "
                "build it by calling it on a single input array."
            )
        specs = [("inputs", tuple(build["input_shape"]), "float32")]
    names, out = set(), []
    for i, (name, shape, dtype) in enumerate(specs):
        name = _sanitize(name, i)
        while name in names:
            name += "_"
        names.add(name)
        out.append((name, (None,) + tuple(shape[1:]), dtype))
    return out


def _front_layer(model, name):
    """The first layer that reads input `name` of a graph model, or None."""
    if not is_graph_model(model):
        return None
    for _, layer in walk(model):
        if isinstance(layer, keras.layers.InputLayer):
            continue
        if isinstance(layer, keras.Model):
            return _front_layer(layer, name)
        return layer if len(keras.tree.flatten(model.inputs)) == 1 else None
    return None


def draw_inputs(model, specs, n, seed=0):
    """Parity inputs for each spec that respect what the model says.

    - integer inputs: token ids uniform in `[0, vocabulary)` of the
      smallest `Embedding` (else 0 or 1); inputs named `*mask*`: all ones;
    - float inputs read first by a `Rescaling(scale, offset)` layer: uniform
      in `[0, 1 / |scale|)` (raw pixels for `scale=1/255`);
    - float inputs read first by an adapted `Normalization`: normal with
      its mean and variance;
    - other float inputs: uniform in `[0, 1)` (the documented default);
    - an unknown dimension (a sequence length) is `DEFAULT_LENGTH` (16).
    """
    rng = np.random.default_rng(seed)
    vocab = [
        l.input_dim for _, l in walk(model)
        if isinstance(l, keras.layers.Embedding)
    ]
    arrays = []
    for name, shape, dtype in specs:
        full = (n,) + tuple(
            DEFAULT_LENGTH if d is None else d for d in shape[1:])
        if is_float(dtype):
            front = _front_layer(model, name)
            if isinstance(front, keras.layers.Rescaling):
                high = 1.0 / max(abs(float(np.max(front.scale))), 1e-12)
                x = rng.uniform(0.0, high, full)
            elif isinstance(front, keras.layers.Normalization) and getattr(
                front, "mean", None
            ) is not None:
                mean = numpy_value(front.mean)
                std = np.sqrt(numpy_value(front.variance))
                x = rng.standard_normal(full) * std + mean
            else:
                x = rng.uniform(0.0, 1.0, full)
            arrays.append(x.astype(dtype))
        elif dtype == "bool":
            arrays.append(np.ones(full, bool) if "mask" in name
                          else rng.integers(0, 2, full).astype(bool))
        elif "mask" in name:
            arrays.append(np.ones(full, dtype))
        else:
            high = min(vocab) if vocab else 2
            arrays.append(rng.integers(0, high, full).astype(dtype))
    return arrays


def _input_keys(model):
    """The keys of a graph model's dict of inputs in `specs` order (what
    `fit` and `predict` take), or None when its inputs are not a dict."""
    if isinstance(model, HalfModel):
        return _input_keys(model.source_model())
    if not is_graph_model(model) or isinstance(model, keras.Sequential):
        return None
    inputs = model.input
    if not isinstance(inputs, dict):
        return None
    return keras.tree.flatten({key: key for key in inputs})


def as_input_list(sample, specs, model):
    """`sample` (an array, a list of arrays, or a dict keyed by input name
    or by the keys of `model`'s dict of inputs) as the list of arrays in
    `specs` order, each checked against its spec."""
    if isinstance(sample, dict):
        names = [name for name, _, _ in specs]
        keys = _input_keys(model)
        if keys is not None and not set(names) <= set(sample):
            names = keys  # keyed as `fit` and `predict` take the inputs
        missing = [name for name in names if name not in sample]
        if missing:
            allowed = [s[0] for s in specs]
            if keys is not None and keys != allowed:
                allowed = f"{keys} (the model's input keys) or {allowed}"
            raise ValueError(
                f"`sample` is missing inputs {missing}; expected keys "
                f"{allowed}."
            )
        arrays = [np.asarray(sample[name]) for name in names]
    elif isinstance(sample, (list, tuple)):
        arrays = [np.asarray(a) for a in sample]
    else:
        arrays = [np.asarray(sample)]
    if len(arrays) != len(specs):
        raise ValueError(
            f"`sample` has {len(arrays)} input arrays; the model takes "
            f"{len(specs)} ({[s[0] for s in specs]})."
        )
    out = []
    for a, (name, shape, dtype) in zip(arrays, specs):
        if a.ndim != len(shape) or any(
            d is not None and d != s for d, s in zip(shape[1:], a.shape[1:])
        ):
            raise ValueError(
                f"`sample` input {name!r} has shape {a.shape}; the model "
                f"expects {shape}."
            )
        out.append(a.astype(dtype) if is_float(dtype) else a)
    if len({a.shape[0] for a in out}) != 1:
        raise ValueError("`sample` arrays must share their first dimension.")
    return out


def pack(model, arrays):
    if isinstance(model, HalfModel):
        return pack(model.source_model(), arrays)
    if is_graph_model(model) and not isinstance(model, keras.Sequential):
        return keras.tree.pack_sequence_as(model.input, arrays)
    return arrays[0]


def _flat_outputs(y):
    return [numpy_value(t) for t in keras.tree.flatten(y)]


def batched(run_batch, arrays, size=_PREDICT_BATCH):
    """Runs `run_batch(list of input slices) -> list of outputs` over
    `arrays` in batches of `size` (128) and concatenates each output
    (numpy)."""
    outs = None
    n = arrays[0].shape[0]
    for i in range(0, n, size):
        y = run_batch([a[i:i + size] for a in arrays])
        y = [np.asarray(t) for t in y]
        outs = [[t] for t in y] if outs is None else [
            o + [t] for o, t in zip(outs, y)
        ]
    return [np.concatenate(o) for o in outs]


def predict_keras(model, arrays):
    return batched(
        lambda batch: _flat_outputs(model(pack(model, batch),
                                          training=False)),
        arrays,
    )


def parity(reference, outputs):
    """Compares the artifact's outputs with the float32 reference.

    Returns:
        A dict: `max_abs_diff` (largest |difference| over all outputs),
        `rel_diff` (per output, max |difference| divided by the range of
        the float32 output, max - min, or its largest |value| when that is
        larger (a near-constant output); the worst output's value: a
        scale-free figure, the same for logits of size 30 and probabilities
        of size 1e-3), `rel_diffs` (one per output) and `top1` (fraction of
        rows with the same argmax over the last axis, for outputs with more
        than one unit; None if none). inf where the artifact gives inf/NaN.
    """
    if len(reference) != len(outputs):
        raise ValueError(
            f"The exported model returns {len(outputs)} outputs; the "
            f"original returns {len(reference)}."
        )
    worst, rels, agree = 0.0, [], []
    for r, o in zip(reference, outputs):
        r = r.astype(np.float64)
        o = np.asarray(o).astype(np.float64).reshape(r.shape)
        diff = np.abs(r - o)
        diff[~np.isfinite(diff)] = np.inf
        peak = float(diff.max()) if diff.size else 0.0
        worst = max(worst, peak)
        finite = r[np.isfinite(r)]
        span = (max(float(finite.max() - finite.min()),
                    float(np.abs(finite).max())) if finite.size else 0.0)
        rels.append(peak / span if span > 0 else (0.0 if peak == 0
                                                  else float("inf")))
        if r.ndim >= 2 and r.shape[-1] > 1:
            agree.append((r.argmax(-1) == o.argmax(-1)).ravel())
    top1 = float(np.concatenate(agree).mean()) if agree else None
    return {"max_abs_diff": worst, "rel_diff": max(rels, default=0.0),
            "rel_diffs": rels, "top1": top1}


# --------------------------------------------------------------------------
# Writers and readers
# --------------------------------------------------------------------------


def size(path):
    if os.path.isfile(path):
        return os.path.getsize(path)
    return sum(
        os.path.getsize(os.path.join(root, f))
        for root, _, files in os.walk(path)
        for f in files
    )


def _float_io(dtype, io_dtype):
    return io_dtype if is_float(dtype) else dtype


def serving_module(model, specs, io_dtype="float32"):
    """A `tf.Module` that tracks each variable once and serves `model`.

    Its function takes the float inputs in `io_dtype` (cast to what the
    model expects) and returns the float outputs in `io_dtype`.
    """
    import tensorflow as tf

    signature = [
        tf.TensorSpec(shape, tf.as_dtype(_float_io(dtype, io_dtype)),
                      name=name)
        for name, shape, dtype in specs
    ]
    module = tf.Module()
    # Track the backing tf.Variables (once each): `model.export()` tracks
    # Keras's wrappers as well and stores every variable twice (keras#23553).
    module.model_variables = [v.value for v in model.variables]

    def to_io(y):
        if y.dtype.is_floating and y.dtype.name != io_dtype:
            return tf.cast(y, io_dtype)
        return y

    @tf.function(input_signature=signature)
    def serve(*args):
        args = [tf.cast(a, d) if a.dtype.name != d else a
                for a, (_, _, d) in zip(args, specs)]
        y = model(pack(model, args), training=False)
        return tf.nest.map_structure(to_io, y)

    module.serve = serve
    return module, serve, signature


def write_keras(model, path, specs, dtype, io_dtype, example=None):
    keras.saving.save_model(model, path)


def _jax_archive(model, specs, io_dtype):
    """A `keras.export.ExportArchive` serving `model` from JAX: the route
    stock `model.export(format="tf_saved_model")` takes (jax2tf), with the
    same signature as `serving_module`."""
    import tensorflow as tf

    signature = [
        tf.TensorSpec(shape, tf.as_dtype(_float_io(dtype, io_dtype)),
                      name=name)
        for name, shape, dtype in specs
    ]

    def to_io(y):
        if is_float(keras.backend.standardize_dtype(y.dtype)):
            return keras.ops.cast(y, io_dtype)
        return y

    def serve(*args):
        args = [keras.ops.cast(a, d) for a, (_, _, d) in zip(args, specs)]
        y = model(pack(model, args), training=False)
        return keras.tree.map_structure(to_io, y)

    archive = keras.export.ExportArchive()
    archive.track(model)
    archive.add_endpoint("serve", serve, input_signature=signature)
    return archive


def write_savedmodel(model, path, specs, dtype, io_dtype, example=None):
    import tensorflow as tf

    if keras.backend.backend() == "jax":
        _jax_archive(model, specs, io_dtype).write_out(path, verbose=False)
        return
    module, serve, _ = serving_module(model, specs, io_dtype)
    tf.saved_model.save(
        module, path, signatures={"serving_default": serve}
    )


def write_tflite(model, path, specs, dtype, io_dtype, example=None):
    """`model` is float32: TFLite runs float16 only as float16 weights in a
    float32 graph, which the converter writes. Builtin ops only; an unknown
    length is fixed to `example`'s when that avoids Flex ops
    (`kerasmp.export.tflite_convert`)."""
    import shutil
    import tempfile

    import tensorflow as tf

    folders = []

    def make_converter(specs):
        if keras.backend.backend() == "jax":
            # From JAX: a SavedModel (jax2tf, as stock Keras exports), then
            # the converter reads it.
            folder = tempfile.mkdtemp(prefix=".savedmodel-",
                                      dir=os.path.dirname(path) or ".")
            folders.append(folder)
            _jax_archive(model, specs, io_dtype).write_out(
                os.path.join(folder, "m"), verbose=False)
            converter = tf.lite.TFLiteConverter.from_saved_model(
                os.path.join(folder, "m"))
        else:
            module, serve, _ = serving_module(model, specs, io_dtype)
            converter = tf.lite.TFLiteConverter.from_concrete_functions(
                [serve.get_concrete_function()], module
            )
        if dtype == "float16":
            converter.optimizations = [tf.lite.Optimize.DEFAULT]
            converter.target_spec.supported_types = [tf.float16]
        return converter

    def verify(flat, specs):
        """From JAX, a conversion with a free batch can run and compute
        something else (keras-hub Mistral: 0.31 of the output range):
        compared here with the model on a few examples."""
        from ai_edge_litert.interpreter import Interpreter

        rows = [a[:4] for a in example]
        runner = Interpreter(model_content=flat).get_signature_runner(
            "serving_default")
        names = [n for n, _, _ in specs]
        size = specs[0][1][0] or len(rows[0])
        outs = batched(
            lambda b: [np.asarray(v) for _, v in sorted(
                runner(**dict(zip(names, b))).items(),
                key=lambda kv: _output_order(kv[0]))],
            rows, size)
        p = parity(predict_keras(model, rows), outs)
        if not p["rel_diff"] <= 0.1:
            return (f"converted with shapes {[tuple(s) for _, s, _ in specs]}"
                    f", it computes something else (max |diff| / range "
                    f"{p['rel_diff']:.3g} on {len(rows[0])} examples)")
        return None

    source = model.source_model() if isinstance(model, HalfModel) else model
    jax = keras.backend.backend() == "jax" and example is not None
    try:
        flat = _tflite_convert.convert(
            make_converter, source, specs, example,
            "export to 'savedmodel' or 'onnx' instead.",
            verify=verify if jax else None, fix_batch=jax)
    except _tflite_convert.NeedsFlexOps:
        raise
    except Exception as e:
        if keras.backend.backend() != "jax":
            raise
        raise ValueError(
            f"format='tflite' cannot convert {source.name!r} from JAX "
            f"(jax2tf, then the TFLite converter): "
            f"{_tflite_convert.summary(e)}; export it with "
            "KERAS_BACKEND=tensorflow, or to 'savedmodel'.") from e
    finally:
        for folder in folders:
            shutil.rmtree(folder, ignore_errors=True)
    with open(path, "wb") as f:
        f.write(flat)


def _onnx_erfc_to_erf(proto):
    """Rewrites every `Erfc(x)` node as `1 - Erf(x)`, in place.

    Keras's exact GELU is `0.5 * x * erfc(-x / sqrt(2))`; tf2onnx writes
    `Erfc`, which is not an ONNX operator, so no runtime loads the model.
    The constant 1 takes the type of `x` (`CastLike`: float16 or float32).
    """
    from onnx import TensorProto
    from onnx import helper

    graph = proto.graph
    nodes = list(graph.node)
    if not any(n.op_type == "Erfc" and n.domain in ("", "ai.onnx")
               for n in nodes):
        return proto
    one = "kerasmp_erfc_one"
    graph.initializer.append(
        helper.make_tensor(one, TensorProto.FLOAT, [], [1.0])
    )
    del graph.node[:]
    for n in nodes:
        if n.op_type != "Erfc" or n.domain not in ("", "ai.onnx"):
            graph.node.append(n)
            continue
        erf_out = n.output[0] + "_kerasmp_erf"
        one_like = n.output[0] + "_kerasmp_one"
        graph.node.append(helper.make_node(
            "Erf", [n.input[0]], [erf_out], name=n.name + "_erf"))
        graph.node.append(helper.make_node(
            "CastLike", [one, n.input[0]], [one_like],
            name=n.name + "_one"))
        graph.node.append(helper.make_node(
            "Sub", [one_like, erf_out], [n.output[0]],
            name=n.name + "_one_minus"))
    return proto


def _onnx_half_initializers(proto):
    """Stores as float16 the float32 weights that are only cast to float16.

    The traced graph reads each float16 variable through a cast to float32
    (the original variable's dtype) and back to float16 (the layer's compute
    dtype); constant folding keeps the float32 copy. Each such weight holds
    float16 values exactly, so it is stored in float16 and its casts become
    identities.
    """
    from onnx import TensorProto
    from onnx import helper
    from onnx import numpy_helper

    graph = proto.graph
    users = {}
    for n in graph.node:
        for i in n.input:
            users.setdefault(i, []).append(n)

    def to_half(n):
        return n.op_type == "Cast" and any(
            a.name == "to" and a.i == TensorProto.FLOAT16
            for a in n.attribute
        )

    def gathers_from(n, name):
        return n.op_type == "Gather" and n.input[0] == name

    after = {}  # gather node name -> the cast that follows it
    for k, init in enumerate(graph.initializer):
        consumers = users.get(init.name, [])
        if init.data_type != TensorProto.FLOAT or not consumers:
            continue
        casts = all(to_half(n) for n in consumers)
        gathers = all(gathers_from(n, init.name) for n in consumers)
        if not (casts or gathers):
            continue
        values = numpy_helper.to_array(init)
        half = values.astype(np.float16)
        if not np.array_equal(half.astype(np.float32), values):
            continue  # not float16 values (a float32 weight): keep it
        graph.initializer[k].CopyFrom(numpy_helper.from_array(half, init.name))
        for n in consumers:
            if casts:
                n.op_type = "Identity"
                del n.attribute[:]
                continue
            # An embedding read in float32 (Keras's Embedding does not
            # autocast): gather the float16 rows, then cast them, exactly.
            out = n.output[0]
            n.output[0] = out + "_kerasmp_f16"
            after[n.name] = helper.make_node(
                "Cast", [n.output[0]], [out], to=TensorProto.FLOAT,
                name=n.name + "_kerasmp_f32")
    if after:  # keep the nodes in topological order
        nodes = list(graph.node)
        del graph.node[:]
        for n in nodes:
            graph.node.append(n)
            if n.name in after:
                graph.node.append(after[n.name])
    return proto


def write_onnx(model, path, specs, dtype, io_dtype, example=None):
    """Converts `model`'s serving function with tf2onnx (opset 17).

    `model` is the half-precision `HalfModel` (or the float32 one): tf2onnx
    converts its float16 graph as traced, float16 weights included, with
    `io_dtype` inputs and outputs; layers kept in float32 stay so.
    (Converting the float32 graph to float16 afterwards with
    onnxconverter-common left type mismatches that onnxruntime refuses in
    keras-hub backbones: integer ids cast to float, masked softmax.)
    """
    import tf2onnx

    _, serve, signature = serving_module(model, specs, io_dtype)
    _ki.patch_tf2onnx()  # numpy 2 compatibility, as keras.export does
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)
        proto, _ = tf2onnx.convert.from_function(
            serve, input_signature=signature, opset=17
        )
    proto = _onnx_half_initializers(_onnx_erfc_to_erf(proto))
    with open(path, "wb") as f:
        f.write(proto.SerializeToString())


def run_onnx(path, arrays, specs):
    import onnxruntime

    try:
        session = onnxruntime.InferenceSession(
            path, providers=["CPUExecutionProvider"]
        )
    except Exception as e:
        raise ValueError(
            "onnxruntime cannot load the exported ONNX graph "
            f"({type(e).__name__}: {e}); export to 'savedmodel' or "
            "'tflite' instead."
        ) from e
    inputs = session.get_inputs()
    names = [i.name for i in inputs]
    ins = [_ONNX_TYPES.get(i.type, i.type) for i in inputs]
    outs = batched(
        lambda batch: session.run(None, {
            n: a.astype(d) for n, a, d in zip(names, batch, ins)}),
        arrays,
    )
    return outs, ins, [o.dtype.name for o in outs]


_ONNX_TYPES = {
    "tensor(float)": "float32",
    "tensor(float16)": "float16",
    "tensor(int32)": "int32",
    "tensor(int64)": "int64",
    "tensor(bool)": "bool",
}


def run_keras(path, arrays, specs):
    try:
        model = keras.saving.load_model(path, compile=False)
    except Exception as e:
        raise ValueError(
            f"The exported .keras file does not load back ({type(e).__name__}"
            f": {e}); export to 'savedmodel', 'tflite' or 'onnx' instead."
        ) from e
    outs = predict_keras(model, arrays)
    ins = [dtype for _, _, dtype in input_specs(model)]
    return outs, ins, [str(o.dtype) for o in outs]


def run_savedmodel(path, arrays, specs):
    import tensorflow as tf

    fn = tf.saved_model.load(path).signatures["serving_default"]
    names = [name for name, _, _ in specs]
    ins = [fn.structured_input_signature[1][n].dtype.name for n in names]
    keys = []

    def run_batch(batch):
        y = fn(**{n: tf.constant(a.astype(d))
                  for n, a, d in zip(names, batch, ins)})
        keys[:] = keys or sorted(y, key=_output_order)
        return [y[k].numpy() for k in keys]

    outs = batched(run_batch, arrays)
    return outs, ins, [o.dtype.name for o in outs]


def _output_order(key):
    m = re.fullmatch(r"output_(\d+)", key)
    return (0, int(m.group(1)), "") if m else (1, 0, key)


def _tflite_interpreter(path):
    from ai_edge_litert.interpreter import Interpreter

    return Interpreter(model_path=path)


def run_tflite(path, arrays, specs):
    interpreter = _tflite_interpreter(path)
    runner = interpreter.get_signature_runner("serving_default")
    names = [name for name, _, _ in specs]
    out_names = sorted(
        interpreter.get_signature_list()["serving_default"]["outputs"],
        key=_output_order,
    )
    details = runner.get_input_details()
    ins = [np.dtype(details[name]["dtype"]).name for name in names]
    # A file written with a fixed batch (the JAX route's last resort, see
    # kerasmp.export.tflite_convert) takes batches of exactly that size.
    fixed = [int(details[n]["shape_signature"][0]) for n in names
             if len(details[n]["shape_signature"])]
    size = fixed[0] if fixed and fixed[0] > 0 else _PREDICT_BATCH

    def run_batch(batch):
        y = runner(**{n: a.astype(d) for n, a, d in zip(names, batch, ins)})
        return [np.array(y[k]) for k in out_names]  # copies

    outs = batched(run_batch, arrays, size)
    return outs, ins, [o.dtype.name for o in outs]


# --------------------------------------------------------------------------
# Weight bytes stored in each artifact
# --------------------------------------------------------------------------


def weights_keras(path):
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


def weights_savedmodel(path):
    import tensorflow as tf

    reader = tf.train.load_checkpoint(os.path.join(path, "variables",
                                                   "variables"))
    shapes = reader.get_variable_to_shape_map()
    dtypes = reader.get_variable_to_dtype_map()
    return sum(
        int(np.prod(shapes[k])) * dtypes[k].size
        for k in shapes if k.endswith(".ATTRIBUTES/VARIABLE_VALUE")
    )


def weights_onnx(path):
    import onnx
    from onnx import numpy_helper

    proto = onnx.load(path)
    return sum(numpy_helper.to_array(t).nbytes
               for t in proto.graph.initializer)


def weights_tflite(path):
    """The bytes of the constant buffers (the weights) of a .tflite file,
    read from its flatbuffer (TensorFlow's generated schema)."""
    from tensorflow.lite.python import schema_py_generated as schema

    with open(path, "rb") as f:
        data = bytearray(f.read())
    model = schema.Model.GetRootAsModel(data, 0)
    total = 0
    for i in range(model.BuffersLength()):
        buffer = model.Buffers(i)
        total += buffer.DataLength()
    return total


def master_weight_bytes(model):
    """Bytes of `model`'s variables with floats as float32 (the masters)."""
    return sum(
        int(np.prod(v.shape)) * (4 if is_float(v.dtype)
                                 else np.dtype(str(v.dtype)).itemsize)
        for v in unique_variables(model)
    )


# --------------------------------------------------------------------------
# The format registry
# --------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class ExportFormat(FormatSpec):
    """One export format: its rules (`FormatSpec`), writer and reader.

    Attributes:
        write: `(model, path, specs, dtype, io_dtype, example=None) ->
            None`; `example` is the parity inputs (TFLite may fix an
            unknown length to theirs).
        run: `(path, arrays, specs) -> (outputs, input dtypes, output
            dtypes)`, read back with the format's own runtime.
        weights: `(path) -> int`, the weight bytes stored in the artifact.
    """

    write: object = None
    run: object = None
    weights: object = None


def _format(name):
    spec = SPECS[name]
    fields = {f.name: getattr(spec, f.name)
              for f in dataclasses.fields(FormatSpec)}
    g = globals()
    return ExportFormat(**fields, write=g[f"write_{name}"],
                        run=g[f"run_{name}"], weights=g[f"weights_{name}"])


REGISTRY = {name: _format(name) for name in SPECS}


def format_table():
    """The docs' format table (Markdown), generated from `REGISTRY`.

    docs/export.md holds it between `<!-- formats:begin -->` and
    `<!-- formats:end -->`; a test checks that it is up to date.
    """
    rows = [
        "| format | path | backend | half precision | I/O dtypes "
        "| what is written | needs | read it with |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for f in REGISTRY.values():
        needs = (", ".join(f.packages) or "keras") + (
            f" (`pip install kerasmp[{f.extra}]`)" if f.extra else "")
        rows.append(
            f"| `{f.name}` | {f'`*{f.suffix}`' if f.suffix else 'a folder'} "
            f"| {'TensorFlow' if f.needs_tensorflow else 'any'} "
            f"| {', '.join(f.half_dtypes)} | {', '.join(f.io_dtypes)} "
            f"| {f.help} | {needs} | {f.read_with} |"
        )
    return "\n".join(rows) + "\n"
