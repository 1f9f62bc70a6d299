"""The TFLite format: a float32 graph with float16 weights (the only float16
form TFLite runs), converted with builtin ops only (what the plain LiteRT
interpreter runs); its reader (ai_edge_litert) and its weight counter.

With unknown sequence lengths, the converter keeps some ops of keras-hub
transformer decoders as TensorFlow ops (Flex ops): a `x[:, None, :, :]`
(a `StridedSlice` with `new_axis_mask`) in Mistral's and Gemma's attention
masks, int64 `Abs`/`Sign` in DeBERTa-v3's relative position buckets. With
the lengths known, the first become reshapes and the second, which depend
only on the length, are constant-folded. So `convert` first converts with
the model's own input shapes; if that fails and an input has an unknown
dimension after the batch, it converts again with those dimensions fixed
to the parity inputs' (the batch stays dynamic), with a warning giving the
shapes the file then takes. From JAX (jax2tf's StableHLO) the converter
can also mis-lower a dynamic batch, so there each conversion is checked
against the model on a few inputs (`verify`) and the last resort fixes the
batch to 1. Where Flex ops remain, it raises `NeedsFlexOps`, naming each op
and the layer it comes from.

From PyTorch, `litert_torch.convert` writes the file (`_write_tflite_torch`:
the float32 model, one example per call, inputs named as the model's) and
`half_weights` stores its float32 constants in float16.
"""

import keyword
import os
import re
import shutil
import tempfile

import keras
import numpy as np

from kerasmp import _keras_internals as _ki
from kerasmp._utils.layers import walk
from kerasmp.export.half import HalfModel
from kerasmp.export.inputs import PREDICT_BATCH
from kerasmp.export.inputs import batched
from kerasmp.export.inputs import predict
from kerasmp.export.lengths import static_specs
from kerasmp.export.parity import parity
from kerasmp.export.quiet import say
from kerasmp.export.savedmodel import jax_archive
from kerasmp.export.savedmodel import output_order
from kerasmp.export.savedmodel import readable_by_tensorflow
from kerasmp.export.savedmodel import refuse_stablehlo_mismatch
from kerasmp.export.savedmodel import serving_module
from kerasmp.export.savedmodel import versions_said

_FLEX = "TF Select ops:"
_ANSI = re.compile(r"\x1b\[[0-9;]*m")
# A converter location: `fused["StridedSlice:", callsite("a/b/op@fn"`.
_LOCATION = re.compile(r'fused\["(\w+):",\s*(?:callsite\()?"([^"@]+)@')


class NeedsFlexOps(ValueError):
    """The model needs TensorFlow (Flex) ops that builtin TFLite lacks."""


def needs_flex(error):
    """Whether a converter error says that Flex ops are needed."""
    text = str(error)
    return _FLEX in text or "neither a custom op nor a flex op" in text


def flex_ops(error):
    """`[(op type, TensorFlow op name)]` named by a converter error, in
    order, each op type once (its first location).

    Read from the error's structured `errors` (`ConverterErrorData`:
    `operator.name` such as `"tf.StridedSlice"`, `location.call[].name`
    such as `"m_1/block_1/attn_1/strided_slice@__inference_serve_7"`), else
    from its text.
    """
    found = {}
    for data in getattr(error, "errors", None) or []:
        op = getattr(getattr(data, "operator", None), "name", "") or ""
        op = op[3:] if op.startswith("tf.") else op
        if not op or op in found:
            continue
        calls = getattr(getattr(data, "location", None), "call", []) or []
        names = [c.name.split("@")[0] for c in calls
                 if getattr(c, "name", "")]
        found[op] = names[0] if names else ""
    if found:
        return list(found.items())
    text = str(error)
    listed = []
    m = re.search(re.escape(_FLEX) + r"\s*([^\n]+)", text)
    if m:
        listed = [t.strip() for t in m.group(1).split(",") if t.strip()]
    for op, name in _LOCATION.findall(text):
        found.setdefault(op, name)
    return [(op, found.get(op, "")) for op in listed or list(found)]


def layer_of(op_name, model):
    """The path of the deepest layer of `model` whose name scope holds the
    TensorFlow op `op_name` (`"m_1/m_1/block_0_1/attn_1/strided_slice"`:
    TensorFlow appends `_1` to reopened scopes), or None."""
    scope = op_name.split("/")[:-1]
    best = None
    for path, _ in walk(model):
        parts = path.split("/")
        pattern = "/".join(re.escape(p) + r"(?:_\d+)?" for p in parts)
        if re.search(rf"(?:^|/){pattern}$", "/".join(scope)) or re.search(
                rf"(?:^|/){pattern}/", "/".join(scope) + "/"):
            if best is None or len(parts) > len(best.split("/")):
                best = path
    return best


def named_ops(error, model):
    """`"StridedSlice in layer 'block/attn'; ..."` for a converter error."""
    parts = []
    for op, name in flex_ops(error):
        layer = layer_of(name, model) if name else None
        where = (f"in layer {layer!r}" if layer
                 else f"at {name!r}" if name else "")
        parts.append(f"{op} {where}".strip())
    return "; ".join(parts) or "unknown ops"


def describe(error, model, format_hint):
    """One sentence naming each Flex op and its layer."""
    ops = named_ops(error, model)
    return (f"format='tflite' cannot write {model.name!r} with builtin "
            f"TFLite ops only: {ops} would need Flex ops, which the plain "
            f"LiteRT interpreter cannot run; {format_hint}")


def convert(make_converter, model, specs, example, format_hint,
            verify=None, fix_batch=False):
    """The flatbuffer of `make_converter(specs).convert()` with builtin
    ops only; see the module docstring.

    Args:
        make_converter: `(specs) -> tf.lite.TFLiteConverter`, configured.
        model: The model (for names in messages).
        specs: `[(name, batch shape, dtype)]` of its inputs.
        example: The parity inputs (numpy arrays, one per spec) or None.
        format_hint: What to export to instead (end of the error message).
        verify: Optional `(flatbuffer, specs) -> None or a reason`: a
            conversion that runs but computes something else (the JAX
            route's dynamic batch) is then tried the next way.
        fix_batch: Whether the last resort fixes the batch to 1 as well.

    Raises:
        NeedsFlexOps: naming each op and its layer.
    """
    fixed = static_specs(specs, example)
    tries = [specs] + ([fixed] if fixed else [])
    if fix_batch and example is not None:
        tries.append([(n, (1,) + tuple(s[1:]), d)
                      for n, s, d in (fixed or specs)])
    first = previous = None
    for i, attempt in enumerate(tries):
        try:
            flat = make_converter(attempt).convert()
        except Exception as e:  # the converter's ConverterError, a trace
            error = e
        else:
            wrong = verify(flat, attempt) if verify is not None else None
            if wrong is None:
                if i:
                    _warn_fixed(model, attempt, previous)
                return flat
            error = ValueError(wrong)
        first = first if first is not None else error
        previous = error
        if i == len(tries) - 1:
            if needs_flex(error):
                raise NeedsFlexOps(
                    describe(error, model, format_hint)) from error
            if error is first:
                raise error
            raise error from first


def _warn_fixed(model, specs, error):
    """Warns that the file takes `specs`' shapes, because of `error` (the
    attempt before)."""
    if needs_flex(error):
        why = (f"TFLite needs Flex ops ({named_ops(error, model)}), which "
               "the plain LiteRT interpreter cannot run")
    else:  # jax2tf gives each unknown length its own symbol
        why = f"the conversion fails ({summary(error)})"
    shapes = ", ".join(f"{n}: {tuple(s)}" for n, s, _ in specs)
    batch = ("the batch may vary" if specs[0][1][0] is None
             else "one example per call")
    say(
        f"kerasmp.export: the TFLite file of {model.name!r} takes inputs "
        f"of fixed shape ({shapes}; {batch}): otherwise {why}. Pass "
        "`sample=` inputs of the length you serve.")


def summary(e):
    """One line saying what failed: a converter error's first message
    (`ConverterErrorData.error_message`), else the exception's text."""
    for data in getattr(e, "errors", None) or []:
        text = (getattr(data, "error_message", "") or "").strip()
        if text:
            text = _ANSI.sub("", text.splitlines()[0])[:200]
            return f"{type(e).__name__}: {text}"
    return _first_line(e)


def _first_line(e):
    lines = [l.strip() for l in str(e).splitlines() if l.strip()]
    text = lines[0] if lines else ""
    for line in lines:  # Keras's layer-call wrapper: the cause is inside
        if "incompatible" in line or "Error" in line:
            text = line
            break
    text = _ANSI.sub("", text)[:160]
    return f"{type(e).__name__}: {text}"


def write_tflite(model, path, specs, dtype, io_dtype, example=None):
    """`model` is float32: TFLite runs float16 only as float16 weights in a
    float32 graph, which the converter writes. Builtin ops only; an unknown
    length is fixed to `example`'s when that avoids Flex ops (see
    `convert`)."""
    if keras.backend.backend() == "torch":
        _write_tflite_torch(model, path, specs, dtype, io_dtype, example)
        return
    import tensorflow as tf

    if keras.backend.backend() == "jax":
        refuse_stablehlo_mismatch("tflite")
    folders = []

    def make_converter(specs):
        if keras.backend.backend() == "jax":
            # From JAX: a SavedModel (jax2tf, as stock Keras exports), then
            # the converter reads it.
            folder = tempfile.mkdtemp(prefix=".savedmodel-",
                                      dir=os.path.dirname(path) or ".")
            folders.append(folder)
            with readable_by_tensorflow():
                jax_archive(model, specs, io_dtype).write_out(
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
                key=lambda kv: output_order(kv[0]))],
            rows, size)
        p = parity(predict(model, rows), outs)
        if not p["rel_diff"] <= 0.1:
            return (f"converted with shapes {[tuple(s) for _, s, _ in specs]}"
                    f", it computes something else (max |diff| / range "
                    f"{p['rel_diff']:.3g} on {len(rows[0])} examples)")
        return None

    source = model.source_model() if isinstance(model, HalfModel) else model
    jax = keras.backend.backend() == "jax" and example is not None
    try:
        flat = convert(
            make_converter, source, specs, example,
            "export to 'savedmodel' or 'onnx' instead.",
            verify=verify if jax else None, fix_batch=jax)
    except NeedsFlexOps:
        raise
    except Exception as e:
        if keras.backend.backend() != "jax":
            raise
        raise ValueError(
            f"format='tflite' cannot convert {source.name!r} from JAX "
            f"(jax2tf, then the TFLite converter) with {versions_said()}: "
            f"{summary(e)}; export it with "
            "KERAS_BACKEND=tensorflow, or to 'savedmodel'.") from e
    finally:
        for folder in folders:
            shutil.rmtree(folder, ignore_errors=True)
    with open(path, "wb") as f:
        f.write(flat)


def run_tflite(path, arrays, specs):
    """Runs the .tflite file at `path` with the LiteRT interpreter."""
    from ai_edge_litert.interpreter import Interpreter

    interpreter = Interpreter(model_path=path)
    runner = interpreter.get_signature_runner("serving_default")
    names = [name for name, _, _ in specs]
    if keras.backend.backend() == "torch":  # see `_named_module`
        names = signature_names(specs)
    out_names = sorted(
        interpreter.get_signature_list()["serving_default"]["outputs"],
        key=output_order,
    )
    details = runner.get_input_details()
    ins = [np.dtype(details[name]["dtype"]).name for name in names]
    # A file written with a fixed batch (the JAX route's last resort, see
    # `convert`) takes batches of exactly that size.
    fixed = [int(details[n]["shape_signature"][0]) for n in names
             if len(details[n]["shape_signature"])]
    size = fixed[0] if fixed and fixed[0] > 0 else PREDICT_BATCH

    def run_batch(batch):
        y = runner(**{n: a.astype(d) for n, a, d in zip(names, batch, ins)})
        return [np.array(y[k]) for k in out_names]  # copies

    outs = batched(run_batch, arrays, size)
    return outs, ins, [o.dtype.name for o in outs]


def weights_tflite(path):
    """The bytes of the constant buffers (the weights) of a .tflite file,
    read from its flatbuffer (TensorFlow's generated schema)."""
    schema = _ki.tflite_schema()
    with open(path, "rb") as f:
        data = bytearray(f.read())
    model = schema.Model.GetRootAsModel(data, 0)
    total = 0
    for i in range(model.BuffersLength()):
        buffer = model.Buffers(i)
        total += buffer.DataLength()
    return total


def signature_names(specs):
    """The names of the TFLite signature inputs of a file written from
    PyTorch, one per spec: the model's input names, made Python identifiers
    (the file names its inputs after the arguments of the module it
    converts; see `_named_module`)."""
    names = []
    for name, _, _ in specs:
        text = re.sub(r"\W", "_", name)
        if not text.isidentifier() or keyword.iskeyword(text):
            text = "input_" + text
        names.append(text)
    if len(set(names)) != len(names):  # two names that differ in `\W`
        names = [f"{n}_{i}" for i, n in enumerate(names)]
    return names


def _named_module(model, specs, io_dtype):
    """The serving module (`pt2.serving_module`) with one named argument
    per input (`signature_names`), so that the converted file's signature
    takes the model's input names, as the other TFLite routes do."""
    import torch

    from kerasmp.export.pt2 import serving_module

    names = signature_names(specs)
    code = (f"def forward(self, {', '.join(names)}):\n"
            f"    return self.serve({', '.join(names)})\n")
    scope = {}
    exec(code, scope)  # the names are identifiers
    named = type("Named", (torch.nn.Module,), {"forward": scope["forward"]})
    module = named()
    module.serve = serving_module(model, specs, io_dtype)
    return module.eval(), names


def _write_tflite_torch(model, path, specs, dtype, io_dtype, example):
    """From PyTorch: `litert_torch.convert` of the serving module of the
    float32 model (`model`: float32 compute, as on the TensorFlow route),
    its inputs named after the model's; then, for `dtype="float16"`, every
    float32 weight stored in float16 behind a DEQUANTIZE op
    (`half_weights`: what the TensorFlow converter's float16 option
    writes, which litert-torch lacks).

    The file takes one example per call, every other dimension fixed to
    the parity inputs' (said once where the model leaves one unknown):
    litert-torch 0.10 lowers Keras's ops with a free batch to shapes it
    then refuses (`Only non-negative indices are allowed when broadcasting
    static shapes`, on two Dense layers), and each such try costs
    seconds."""
    import litert_torch
    import torch

    from kerasmp.export.pt2 import sample_args

    source = model.source_model() if isinstance(model, HalfModel) else model
    module, names = _named_module(model, specs, io_dtype)
    args = tuple(a[:1] for a in sample_args(specs, example, io_dtype))
    try:
        with torch.no_grad():
            edge = litert_torch.convert(
                module, sample_kwargs=dict(zip(names, args)))
    except Exception as e:  # torch.export's or the converter's error
        raise ValueError(
            f"format='tflite' cannot convert {source.name!r} from PyTorch "
            f"(litert-torch): {summary(e)}; export it to 'onnx' or "
            "'torch', or its .keras to 'tflite' with "
            "KERAS_BACKEND=tensorflow.") from e
    if any(d is None for _, s, _ in specs for d in s[1:]):
        shapes = ", ".join(f"{n}: {tuple(a.shape)}"
                           for (n, _, _), a in zip(specs, args))
        say(f"kerasmp.export: the TFLite file of {source.name!r} takes "
            f"inputs of fixed shape ({shapes}; one example per call): "
            "litert-torch converts fixed shapes only. Pass `sample=` "
            "inputs of the length you serve.")
    edge.export(path)
    if dtype == "float16":
        with open(path, "rb") as f:
            flat = half_weights(f.read())
        with open(path, "wb") as f:
            f.write(flat)


def half_weights(flat):
    """The .tflite flatbuffer `flat` with each float32 constant stored in
    float16 and read through a DEQUANTIZE op to float32: the float32 graph
    with float16 weights that the TensorFlow converter writes with
    `supported_types=[tf.float16]`. A constant that float16 cannot hold
    (a value beyond its range, or a nonzero one that rounds to zero, such
    as a 1e-12 epsilon) stays float32."""
    import flatbuffers

    schema = _ki.litert_schema()
    model = schema.ModelT.InitFromPackedBuf(flat, 0)
    float32, float16 = schema.TensorType.FLOAT32, schema.TensorType.FLOAT16
    opcode = _dequantize_opcode(model, schema)
    halves = {}  # float32 buffer -> its float16 buffer (or None: kept)
    for graph in model.subgraphs or []:
        ops = []
        inputs = set(np.asarray(graph.inputs or [], int).tolist())
        for index, tensor in enumerate(list(graph.tensors or [])):
            buffer = model.buffers[tensor.buffer] if tensor.buffer else None
            if (tensor.type != float32 or buffer is None or tensor.isVariable
                    or buffer.data is None or len(buffer.data) == 0
                    or index in inputs):
                continue
            if tensor.buffer not in halves:
                halves[tensor.buffer] = _half_buffer(buffer, schema, model)
            half = halves[tensor.buffer]
            if half is None:
                continue
            copy = schema.TensorT()
            copy.shape, copy.type, copy.buffer = tensor.shape, float16, half
            copy.name = (tensor.name or b"") + b"_float16"
            copy.shapeSignature, copy.hasRank = (tensor.shapeSignature,
                                                 tensor.hasRank)
            graph.tensors.append(copy)
            tensor.buffer = 0  # now computed: DEQUANTIZE(copy)
            op = schema.OperatorT()
            op.opcodeIndex = opcode
            op.inputs, op.outputs = [len(graph.tensors) - 1], [index]
            ops.append(op)
        graph.operators = ops + list(graph.operators or [])
    for old, half in halves.items():
        if half is not None:  # no float32 reader left
            model.buffers[old] = schema.BufferT()
    builder = flatbuffers.Builder(len(flat) + 1024)
    builder.Finish(model.Pack(builder), file_identifier=b"TFL3")
    return bytes(builder.Output())


def _half_buffer(buffer, schema, model):
    """Appends the float16 copy of a float32 `buffer` to `model.buffers`
    and returns its index, or None if float16 cannot hold it."""
    values = np.frombuffer(np.asarray(buffer.data, np.uint8).tobytes(),
                           "<f4")
    half = values.astype("<f2")
    if not np.all(np.isfinite(half)) or np.any((half == 0) & (values != 0)):
        return None
    copy = schema.BufferT()
    copy.data = np.frombuffer(half.tobytes(), np.uint8)
    model.buffers.append(copy)
    return len(model.buffers) - 1


def _dequantize_opcode(model, schema):
    """The index of the DEQUANTIZE operator code of `model`, added if
    missing."""
    code = schema.BuiltinOperator.DEQUANTIZE
    for i, op in enumerate(model.operatorCodes or []):
        if max(op.builtinCode, op.deprecatedBuiltinCode) == code:
            return i
    op = schema.OperatorCodeT()
    op.builtinCode = op.deprecatedBuiltinCode = code
    op.version = 1
    model.operatorCodes = list(model.operatorCodes or []) + [op]
    return len(model.operatorCodes) - 1
