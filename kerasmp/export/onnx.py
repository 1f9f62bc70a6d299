"""The ONNX format: the half-precision serving function converted by
tf2onnx (its frozen graph with XLA-marked calls inlined, float16 images cast
to float32 before a resize and infinite constants of float16 selects made
finite; resizes given their output sizes, exact GELU's `Erfc` rewritten as
`1 - Erf`, weights that are only
read in float16 stored in float16), or on the PyTorch backend by
`torch.onnx.export` (its dynamo exporter, from the `torch.export` program
of `pt2.exported`: a free batch, where stock Keras's TorchScript route
fails on a free batch); its reader (onnxruntime) and its weight counter.
"""

import keras
import numpy as np

from kerasmp import _keras_internals as _ki
from kerasmp.export.inputs import batched
from kerasmp.export.lengths import free_or_fixed
from kerasmp.export.pt2 import exported
from kerasmp.export.savedmodel import serving_module


def _erfc_to_erf(proto):
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


def _resize_to_sizes(proto):
    """Gives each `Resize` that tf2onnx wrote with constant scales the
    output sizes they stand for, in place.

    tf2onnx writes `tf.image.resize(x, (nh, nw))` of a known input size
    `(h, w)` as ONNX `Resize` with scales `nh / h`, in float32, and ONNX
    sizes the output `floor(h * scale)`: 9 / 5 is stored as 1.7999999523,
    so 5 pixels resized to 9 are inferred as 8. keras-hub DepthAnything's
    neck resizes 5 to 9 and adds a 9 x 9 map, and onnxruntime refused to
    load the file ("Incompatible dimensions"). Where the floor falls short
    of the rounded product, the node gets `sizes`: the input's batch and
    channels (read at run time) and the rounded height and width.
    """
    from onnx import helper
    from onnx import numpy_helper
    from onnx import shape_inference

    graph = proto.graph
    consts = {i.name: i for i in graph.initializer}
    for n in graph.node:
        if n.op_type == "Constant" and n.attribute[0].name == "value":
            consts[n.output[0]] = n.attribute[0].t
    resizes = [n for n in graph.node if n.op_type == "Resize"
               and len(n.input) == 3 and n.input[2] in consts]
    if not resizes:
        return proto
    inferred = shape_inference.infer_shapes(proto).graph
    dims = {v.name: [d.dim_value if d.HasField("dim_value") else None
                     for d in v.type.tensor_type.shape.dim]
            for v in list(inferred.value_info) + list(inferred.input)}
    before = {}
    for n in resizes:
        scales = numpy_helper.to_array(consts[n.input[2]]).astype(np.float64)
        shape = dims.get(n.input[0])
        if (scales.shape != (4,) or not shape or len(shape) != 4
                or None in shape[2:] or not np.all(scales[:2] == 1.0)):
            continue
        spatial = np.asarray(shape[2:], np.float64) * scales[2:]
        sizes = np.round(spatial).astype(np.int64)
        if np.array_equal(np.floor(spatial).astype(np.int64), sizes):
            continue  # the scales give these sizes already
        base = n.name + "/kerasmp_sizes"
        graph.initializer.extend([
            numpy_helper.from_array(np.array([0], np.int64), base + "/0"),
            numpy_helper.from_array(np.array([2], np.int64), base + "/2"),
            numpy_helper.from_array(sizes, base + "/hw"),
        ])
        before[n.name] = [
            helper.make_node("Shape", [n.input[0]], [base + "/shape"],
                             name=base + "/shape"),
            helper.make_node("Slice", [base + "/shape", base + "/0",
                                       base + "/2"], [base + "/nc"],
                             name=base + "/nc"),
            helper.make_node("Concat", [base + "/nc", base + "/hw"], [base],
                             axis=0, name=base),
        ]
        n.input[2] = ""
        n.input.append(base)
    if before:  # keep the nodes in topological order
        nodes = list(graph.node)
        del graph.node[:]
        for n in nodes:
            graph.node.extend(before.get(n.name, []))
            graph.node.append(n)
    return proto


def _half_initializers(proto):
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
    """Converts `model`'s serving function to ONNX (opset 17 with tf2onnx,
    18 with torch.onnx on the PyTorch backend).

    `model` is the half-precision `HalfModel` (or the float32 one): tf2onnx
    converts its float16 graph as traced, float16 weights included, with
    `io_dtype` inputs and outputs; layers kept in float32 stay so.
    (Converting the float32 graph to float16 afterwards with
    onnxconverter-common left type mismatches that onnxruntime refuses in
    keras-hub backbones: integer ids cast to float, masked softmax.)
    """
    if keras.backend.backend() == "torch":
        _write_onnx_torch(model, path, specs, io_dtype, example)
        return
    _ki.patch_tf2onnx()  # numpy 2 compatibility, as keras.export does

    def write(shapes):
        _, serve, _ = serving_module(model, shapes, io_dtype)
        proto = _half_initializers(_erfc_to_erf(_resize_to_sizes(
            _from_function(serve, 17))))
        with open(path, "wb") as f:
            f.write(proto.SerializeToString())

    free_or_fixed(write, lambda rows, shapes: run_onnx(path, rows,
                                                       shapes)[0],
                  model, specs, example, "ONNX file")


def _from_function(serve, opset):
    """The ONNX graph of the `tf.function` `serve` (its input signature
    traced), whose inputs are the signature's alone.

    `tf2onnx.convert.from_function` makes every non-resource input of the
    concrete function a graph input, constants the function captures
    included: keras-hub Gemma scales its embeddings by
    `ops.cast(ops.sqrt(hidden_dim), x.dtype)`, a float16 tensor built with
    the functional model and captured by the trace, and onnxruntime then
    asks for it in every feed ("Required inputs (['.../Mul/y:0']) are
    missing"). Freezing turns the captures into constants; only the
    signature's placeholders are named as inputs here.
    """
    import tensorflow as tf
    import tf2onnx

    concrete = serve.get_concrete_function()
    captured = {inner.name for _, inner in concrete.graph.captures}
    inputs = [t.name for t in concrete.inputs
              if t.dtype != tf.resource and t.name not in captured]
    outputs = [t.name for t in concrete.outputs if t.dtype != tf.resource]
    renames = tf2onnx.convert.tensor_names_from_structed(
        concrete, inputs, outputs)
    with tf.device("/cpu:0"):
        frozen = tf2onnx.tf_loader.from_function(concrete, inputs, outputs)
        frozen = _inline_compiled_calls(frozen, inputs, outputs)
        _resize_from_float32(frozen)
        _finite_select_constants(frozen)
        proto, _ = tf2onnx.convert.from_graph_def(
            frozen, name=concrete.name, input_names=inputs,
            output_names=outputs, opset=opset, tensors_to_rename=renames)
    return proto


_CALLS = ("PartitionedCall", "StatefulPartitionedCall")
_NOT_INLINED = ("_XlaMustCompile", "_noinline")


def _inline_compiled_calls(graph_def, inputs, outputs):
    """`graph_def` with the calls of functions marked for XLA inlined.

    Keras's TensorFlow backend runs a grouped or depthwise-as-grouped
    convolution (keras.applications ConvNeXt, keras-hub HGNetV2) through a
    `tf.function(jit_compile=True)`, since TensorFlow has no grouped
    convolution kernel for the CPU. Grappler never inlines a function marked
    for XLA (`_XlaMustCompile`, `_noinline`), so the frozen graph keeps a
    `PartitionedCall` node that tf2onnx passes through and onnxruntime
    rejects ("No Op registered for PartitionedCall"). The marks only ask for
    XLA; the function body is plain TensorFlow ops (one `Conv2D` with a
    `groups`-shaped kernel), which ONNX's `Conv` expresses, so they are
    dropped and grappler inlines the call.
    """
    import tensorflow as tf
    import tf2onnx

    if not any(node.op in _CALLS for node in graph_def.node):
        return graph_def
    for node in graph_def.node:
        if node.op in _CALLS:
            for mark in _NOT_INLINED:
                node.attr.pop(mark, None)
    for function in graph_def.library.function:
        for mark in _NOT_INLINED:
            function.attr.pop(mark, None)
    with tf.Graph().as_default():  # grappler works on a graph, not eagerly
        return tf2onnx.tf_loader.tf_optimize(inputs, outputs, graph_def)


# TensorFlow's resize ops that return float32 whatever their input's type.
_FLOAT_RESIZES = ("ResizeBilinear", "ResizeBicubic", "ResizeArea")


def _resize_from_float32(graph_def):
    """Feeds each float16 image of a float-returning resize through a cast
    to float32, in place.

    `tf.image.resize` (Keras's `Resizing`, and the upsampling of keras-hub
    DeepLabV3 and SegFormer) reads a float16 image and returns float32;
    tf2onnx maps it to ONNX `Resize`, whose output has its input's type, and
    the next op then mixes float16 with the float32 TensorFlow expected
    ("Type parameter (T) of Optype (Min) bound to different types"). Casting
    float16 to float32 is exact and TensorFlow resizes in float32 anyway, so
    the rewritten graph computes the same values.
    """
    from tensorflow.core.framework import types_pb2

    half, single = types_pb2.DT_HALF, types_pb2.DT_FLOAT
    for node in list(graph_def.node):
        if node.op not in _FLOAT_RESIZES or node.attr["T"].type != half:
            continue
        cast = graph_def.node.add()
        cast.name = node.name + "/kerasmp_to_float32"
        cast.op = "Cast"
        cast.input.append(node.input[0])
        cast.attr["SrcT"].type = half
        cast.attr["DstT"].type = single
        cast.attr["Truncate"].b = False
        if node.device:
            cast.device = node.device
        node.input[0] = cast.name
        node.attr["T"].type = single


def _finite_select_constants(graph_def):
    """Gives each float16 `Select`/`SelectV2` finite constants, in place:
    an infinite constant branch becomes float16's largest finite value,
    with its sign.

    keras-hub's Gemma3n attention masks its logits with
    `ops.where(mask, logits, -1e9)`; in float16 the `-1e9` is `-inf`.
    tf2onnx writes a select as `cond * x + (1 - cond) * y` unless a branch is
    a non-finite constant, a test it makes for float32 and float64 only:
    the float16 `0 * -inf` is NaN, so every masked position, then the whole
    softmax row, is NaN under onnxruntime (TensorFlow's select has no such
    product). A constant of -65504 selects the same way, and after the
    softmax `exp(-65504 - max)` is 0 as `exp(-inf)` is; a row that masks
    every position gets uniform weights, as the float32 model's `-1e9`
    gives, where `-inf` gives NaN.
    """
    import tensorflow as tf
    from tensorflow.core.framework import types_pb2

    limit = float(np.finfo(np.float16).max)
    consts = {n.name: n for n in graph_def.node if n.op == "Const"}
    for node in list(graph_def.node):
        if (node.op not in ("Select", "SelectV2")
                or node.attr["T"].type != types_pb2.DT_HALF):
            continue
        for k in (1, 2):
            const = consts.get(node.input[k].split(":")[0])
            if const is None:
                continue
            values = tf.make_ndarray(const.attr["value"].tensor)
            if not np.isinf(values).any():
                continue
            finite = graph_def.node.add()
            finite.CopyFrom(const)
            finite.name = const.name + "/kerasmp_finite"
            finite.attr["value"].tensor.CopyFrom(tf.make_tensor_proto(
                np.clip(values, -limit, limit).astype(np.float16)))
            node.input[k] = finite.name


def _write_onnx_torch(model, path, specs, io_dtype, example):
    """`torch.onnx.export` (dynamo) of the program `pt2.exported` captures,
    input names from `specs`, the weights stored in the graph."""
    import torch

    names = [name for name, _, _ in specs]

    def convert(module, args, shapes):
        return torch.onnx.export(
            module, args, dynamo=True, dynamic_shapes=shapes,
            input_names=names, opset_version=18, verbose=False,
            external_data=False)

    program = exported(model, specs, io_dtype, example, convert=convert)
    program.optimize()
    program.save(path, external_data=False)
    import onnx

    proto = _half_constants(_half_initializers(onnx.load(path)))
    for node in proto.graph.node:  # the exporter's stack traces
        node.doc_string = ""
        del node.metadata_props[:]
    with open(path, "wb") as f:
        f.write(proto.SerializeToString())


def _half_constants(proto):
    """Stores as float16, read through a `Cast` to float32, the float32
    initializers whose values are all float16 values.

    Keras's PyTorch backend multiplies float16 matrices in float32 on a CPU
    (`ops.matmul` casts both sides), and the exporter folds the cast of a
    float16 kernel into a float32 constant: the file would hold float32
    copies of float16 weights. The values are float16 exactly, so storing
    them so and casting at run time changes no output.
    """
    from onnx import TensorProto
    from onnx import helper
    from onnx import numpy_helper

    graph = proto.graph
    inputs = {i.name for i in graph.input}
    casts = []
    for k, init in enumerate(graph.initializer):
        if init.data_type != TensorProto.FLOAT or init.name in inputs:
            continue
        values = numpy_helper.to_array(init)
        if values.size < 2:
            continue
        half = values.astype(np.float16)
        if not np.array_equal(half.astype(np.float32), values):
            continue  # a float32 weight (a kept layer's): keep it
        name = init.name
        stored = name + "_kerasmp_f16"
        graph.initializer[k].CopyFrom(numpy_helper.from_array(half, stored))
        casts.append(helper.make_node(
            "Cast", [stored], [name], to=TensorProto.FLOAT,
            name=name + "_kerasmp_f32"))
    if casts:  # before every node that reads them
        nodes = list(graph.node)
        del graph.node[:]
        graph.node.extend(casts + nodes)
    return proto


# onnxruntime's input types as numpy dtype names.
_ONNX_TYPES = {
    "tensor(float)": "float32",
    "tensor(float16)": "float16",
    "tensor(int32)": "int32",
    "tensor(int64)": "int64",
    "tensor(bool)": "bool",
}


def run_onnx(path, arrays, specs):
    """Runs the ONNX graph at `path` with onnxruntime (CPU)."""
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


def weights_onnx(path):
    """Bytes of the initializers (the weights) of the ONNX graph at `path`."""
    import onnx
    from onnx import numpy_helper

    proto = onnx.load(path)
    return sum(numpy_helper.to_array(t).nbytes
               for t in proto.graph.initializer)
