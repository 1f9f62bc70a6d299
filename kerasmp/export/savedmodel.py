"""The SavedModel format: a `tf.Module` serving the model (each variable
stored once), its writer from TensorFlow or JAX, its reader
(`tf.saved_model.load`) and its weight counter. The TFLite and ONNX writers
convert the same serving function.
"""

import contextlib
import os
import re
import shutil

import keras
import numpy as np

from kerasmp import _keras_internals as _ki
from kerasmp._utils.arrays import is_float
from kerasmp.export.inputs import batched
from kerasmp.export.inputs import pack
from kerasmp.export.lengths import free_or_fixed
from kerasmp.export.lengths import summary
from kerasmp.export.quiet import say


def _signature(specs, io_dtype):
    """The serving signature: a `tf.TensorSpec` per input, float inputs in
    `io_dtype`."""
    import tensorflow as tf

    return [
        tf.TensorSpec(shape,
                      tf.as_dtype(io_dtype if is_float(dtype) else dtype),
                      name=name)
        for name, shape, dtype in specs
    ]


def serving_module(model, specs, io_dtype="float32"):
    """A `tf.Module` that tracks each variable once and serves `model`.

    Its function takes the float inputs in `io_dtype` (cast to what the
    model expects) and returns the float outputs in `io_dtype`.
    """
    import tensorflow as tf

    signature = _signature(specs, io_dtype)
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


def jax_archive(model, specs, io_dtype, shapes=None, constraints=()):
    """A `keras.export.ExportArchive` serving `model` from JAX: the route
    stock `model.export(format="tf_saved_model")` takes (jax2tf), with the
    same signature as `serving_module`.

    `shapes` (one jax2tf shape string per input, `jax_shapes`) and
    `constraints` (jax2tf's `polymorphic_constraints`) replace Keras's
    default, which gives every unknown dimension after the batch its own
    symbol."""
    signature = _signature(specs, io_dtype)

    def to_io(y):
        if is_float(keras.backend.standardize_dtype(y.dtype)):
            return keras.ops.cast(y, io_dtype)
        return y

    def serve(*args):
        args = [keras.ops.cast(a, d) for a, (_, _, d) in zip(args, specs)]
        y = model(pack(model, args), training=False)
        return keras.tree.map_structure(to_io, y)

    archive = keras.export.ExportArchive()
    archive.track(_without_seeds(model))
    options = {}
    if shapes is not None:
        # Serving takes no gradient: without one, the SavedModel writer
        # traces none (it fails to, under constraints).
        options["jax2tf_kwargs"] = {"polymorphic_shapes": list(shapes),
                                    "polymorphic_constraints":
                                        tuple(constraints),
                                    "with_gradient": False}
    archive.add_endpoint("serve", serve, input_signature=signature,
                         **options)
    return archive


def stablehlo_versions():
    """`{"jax": ..., "jax_oldest": ..., "jax_target": ..., "tensorflow":
    ..., "tf_reads": ...}`: the versions of JAX and TensorFlow installed,
    the StableHLO versions JAX can write (its oldest, and the one jax2tf
    writes by default), and the newest one TensorFlow reads (None if it
    does not say), read at run time."""
    import jax
    import tensorflow as tf

    oldest, target = _ki.jax_stablehlo_versions()
    return {"jax": jax.__version__, "jax_oldest": oldest,
            "jax_target": target, "tensorflow": tf.__version__,
            "tf_reads": _ki.tensorflow_stablehlo_version()}


def stablehlo_mismatch(versions, format):
    """The one-line refusal when JAX cannot write StableHLO as old as
    TensorFlow reads (`versions` as `stablehlo_versions` gives them), else
    None.

    Example:

    >>> stablehlo_mismatch({"jax": "0.12.1", "jax_oldest": "1.0.0",
    ...     "jax_target": "1.22.0", "tensorflow": "2.21.0",
    ...     "tf_reads": "0.9.0"}, "savedmodel")[:60]
    "format='savedmodel' cannot be written from JAX 0.12.1 for Ten"
    """
    reads = versions["tf_reads"]
    if reads is None or not _ki.stablehlo_older(reads,
                                                 versions["jax_oldest"]):
        return None
    return (
        f"format={format!r} cannot be written from JAX {versions['jax']} "
        f"for TensorFlow {versions['tensorflow']}: jax2tf writes StableHLO "
        f"{versions['jax_oldest']} or newer and TensorFlow reads up to "
        f"{reads}; export with KERAS_BACKEND=tensorflow (from the .keras "
        "file), or to 'keras', or install a TensorFlow that reads "
        f"StableHLO {versions['jax_oldest']} (or a JAX that writes "
        f"{reads}).")


def refuse_stablehlo_mismatch(format):
    """Raises `stablehlo_mismatch`'s one-line ValueError, if any: before
    any jax2tf conversion."""
    refusal = stablehlo_mismatch(stablehlo_versions(), format)
    if refusal:
        raise ValueError(refusal)


@contextlib.contextmanager
def readable_by_tensorflow():
    """While inside, jax2tf writes StableHLO that the installed TensorFlow
    reads. JAX targets a version a few weeks older than its own (1.22.0 in
    JAX 0.12.1), which a TensorFlow released before it may not read
    (TensorFlow 2.21 reads up to 1.13.7: `unregistered operation
    'vhlo.custom_call_v2'` when the SavedModel is called). So when
    TensorFlow's version is the older, the program is serialized at it
    (StableHLO downgrades it; `refuse_stablehlo_mismatch` first refuses a
    JAX that cannot write so old a version)."""
    versions = stablehlo_versions()
    reads = versions["tf_reads"]
    if reads is None or not _ki.stablehlo_older(reads,
                                                 versions["jax_target"]):
        yield
        return
    with _ki.jax_export_stablehlo_at_most(reads):
        yield


def versions_said():
    """`"JAX 0.12.1 and TensorFlow 2.21.0, StableHLO 1.13.7 (JAX's own
    1.22.0 is newer than TensorFlow reads)"`: what an error of the jax2tf
    route names."""
    v = stablehlo_versions()
    said = f"JAX {v['jax']} and TensorFlow {v['tensorflow']}, StableHLO "
    reads = v["tf_reads"]
    if reads is not None and _ki.stablehlo_older(reads, v["jax_target"]):
        return (said + f"{reads} (JAX's own {v['jax_target']} is newer "
                "than TensorFlow reads)")
    return said + v["jax_target"]


MAX_CONSTRAINTS = 8
"""Constraints `write_jax_savedmodel` adds before it fixes the lengths."""

_INCONCLUSIVE = re.compile(
    r"comparison '([^']+)' (<=|<|>=|>|==|!=) '([^']+)' is inconclusive")


def jax_shapes(specs, example):
    """`(shapes, sizes)`: one jax2tf shape string per input, the batch
    `"batch"` and each unknown dimension after it a symbol that the
    dimensions of the same size in `example` share (token ids and their
    padding mask: one length), and `{symbol: its size in example}`."""
    symbols, shapes = {}, []
    for (_, shape, _), a in zip(specs, example):
        dims = []
        for i, d in enumerate(shape):
            if d is not None:
                dims.append(str(d))
            elif i == 0:
                dims.append("batch")
            else:
                dims.append(symbols.setdefault(int(a.shape[i]),
                                               f"d{len(symbols)}"))
        shapes.append("(" + ", ".join(dims) + ")")
    sizes = {symbol: size for size, symbol in symbols.items()}
    sizes["batch"] = int(example[0].shape[0]) if example else 1
    return shapes, sizes


def constraint_for(error, sizes):
    """The jax2tf constraint that settles the comparison `error` (an
    `InconclusiveDimensionOperation`) found undecidable, the way `sizes`
    (the parity inputs') decide it; None when it compares other than one
    symbol with a number, or tests (in)equality.

    `"'d0' <= '5'"` from keras-hub's `PositionEmbedding` (a slice of its
    table as long as the input) with a length of 5 in `sizes` gives
    `"d0 <= 5"`: the file then serves every length up to 5 and refuses a
    longer one when called (jax2tf checks constraints at run time).
    """
    m = _INCONCLUSIVE.search(str(error))
    if m is None:
        return None
    left, op, right = m.groups()
    flip = {"<=": ">=", "<": ">", ">=": "<=", ">": "<"}
    if left.lstrip("-").isdigit() and right in sizes:
        left, op, right = right, flip.get(op, op), left
    if left not in sizes or not right.lstrip("-").isdigit() or op not in flip:
        return None
    n = int(right)
    holds = {"<=": sizes[left] <= n, "<": sizes[left] < n,
             ">=": sizes[left] >= n, ">": sizes[left] > n}[op]
    # The set of lengths on which the comparison goes as on the sample.
    at_most = {("<=", True): n, ("<", True): n - 1,
               (">=", False): n - 1, (">", False): n}
    at_least = {("<=", False): n + 1, ("<", False): n,
                (">=", True): n, (">", True): n + 1}
    if (op, holds) in at_most:
        return f"{left} <= {at_most[op, holds]}"
    return f"{left} >= {at_least[op, holds]}"


def write_jax_savedmodel(model, path, specs, io_dtype, example=None):
    """Writes the jax2tf SavedModel of `model` for `specs`' shapes.

    Keras's default gives every unknown length its own symbol, and then
    keras-hub's attention fails to broadcast the padding mask's length
    against the tokens'. Here the lengths of equal size in `example` (the
    parity inputs) share one symbol (`jax_shapes`); and where the model's
    code compares a length with a number that jax2tf cannot decide for
    every length (keras-hub's position embeddings slice a table of
    `max_sequence_length` rows), that comparison becomes a constraint,
    decided as on `example` (`constraint_for`; up to `MAX_CONSTRAINTS`),
    which the file checks when called. Returns the constraints added.
    """
    if example is None:
        with readable_by_tensorflow():
            _write(jax_archive(model, specs, io_dtype), path)
        return []
    shapes, sizes = jax_shapes(specs, example)
    constraints = []
    while True:
        try:
            with readable_by_tensorflow():
                _write(jax_archive(model, specs, io_dtype, shapes,
                                   constraints), path)
            return constraints
        except Exception as e:  # jax2tf's shape errors, of any type
            constraint = constraint_for(e, sizes)
            if (constraint is None or constraint in constraints
                    or len(constraints) >= MAX_CONSTRAINTS):
                raise
            constraints.append(constraint)


def _write(archive, path):
    shutil.rmtree(path, ignore_errors=True)
    archive.write_out(path, verbose=False)


def _named_lengths(specs, shapes):
    """`{symbol: "dimension 1 of token_ids and padding_mask"}` from
    `jax_shapes`' strings."""
    where = {}
    for (name, _, _), shape in zip(specs, shapes):
        for i, dim in enumerate(shape.strip("()").split(", ")):
            if dim == "batch":
                where.setdefault(dim, {})
            elif not dim.isdigit():
                where.setdefault(dim, {}).setdefault(i, []).append(name)
    out = {}
    for symbol, dims in where.items():
        if symbol == "batch":
            out[symbol] = "the batch"
            continue
        out[symbol] = " and ".join(
            f"dimension {i} of {', '.join(names)}" for i, names in
            dims.items())
    return out


def _readable(constraint, lengths):
    symbol, op, n = constraint.split(" ")
    words = {"<=": "up to", ">=": "from"}[op]
    return f"{lengths.get(symbol, symbol)} {words} {n}"


def _without_seeds(model):
    """A built layer whose variables are `model`'s less the states of its
    seed generators (`Dropout`'s RNG state, a uint32 variable).

    Tracked, the archive passes every variable through the jax2tf function
    and writes the non-trainable ones back after each call: a uint32
    read/assign that the TFLite converter refuses ("'tfl.read_variable' op
    result #0 must be tensor of 32-bit float ...", keras-hub GPT-2 and
    DeBERTa-v3 from JAX). Serving never draws from them (`training=False`);
    untracked, a state read is a constant of the program.
    """

    def kept(variables):
        return [v for v in variables if v.name != "seed_generator_state"]

    class Variables(keras.layers.Layer):
        @property
        def trainable_variables(self):
            return kept(model.trainable_variables)

        @property
        def non_trainable_variables(self):
            return kept(model.non_trainable_variables)

    layer = Variables(name=f"{model.name}_variables")
    layer.built = True
    return layer


def write_savedmodel(model, path, specs, dtype, io_dtype, example=None):
    """Writes `model` (the half-precision `HalfModel`, or the float32 one)
    as a SavedModel folder with a `serving_default` signature: free
    lengths where they trace and compute what the model does, else the
    parity inputs' (`lengths.free_or_fixed`)."""
    import tensorflow as tf

    jax = keras.backend.backend() == "jax"
    if jax:
        refuse_stablehlo_mismatch("savedmodel")
    constraints = []

    def write(shapes):
        if jax:
            constraints[:] = write_jax_savedmodel(model, path, shapes,
                                                  io_dtype, example)
            return
        module, serve, _ = serving_module(model, shapes, io_dtype)
        shutil.rmtree(path, ignore_errors=True)
        tf.saved_model.save(module, path,
                            signatures={"serving_default": serve})

    try:
        written = free_or_fixed(
            write, lambda rows, shapes: run_savedmodel(path, rows, shapes)[0],
            model, specs, example, "SavedModel")
    except Exception as e:
        if not jax:
            raise
        # What jax2tf writes and TensorFlow then cannot run (keras-hub's MoE
        # routers: JAX 0.10 writes `top_k` as a StableHLO composite that
        # TensorFlow 2.21 cannot read): one sentence with the versions and
        # the ways out.
        raise ValueError(
            f"format='savedmodel' cannot write "
            f"{getattr(model, 'name', 'model')!r} from JAX (jax2tf) "
            f"with {versions_said()}: {summary(e)}; export it with "
            "KERAS_BACKEND=tensorflow, or to 'keras'.") from e
    if constraints and written is specs:
        lengths = _named_lengths(specs, jax_shapes(specs, example)[0])
        said = "; ".join(_readable(c, lengths) for c in constraints)
        say(f"kerasmp.export: the SavedModel of "
            f"{getattr(model, 'name', 'model')!r} from JAX takes {said} (the "
            "model's code branches on these sizes; a call outside them is "
            "refused with a shape error).")


def run_savedmodel(path, arrays, specs):
    """Runs the SavedModel at `path` with `tf.saved_model.load`."""
    import tensorflow as tf

    fn = tf.saved_model.load(path).signatures["serving_default"]
    names = [name for name, _, _ in specs]
    ins = [fn.structured_input_signature[1][n].dtype.name for n in names]
    keys = []

    def run_batch(batch):
        y = fn(**{n: tf.constant(a.astype(d))
                  for n, a, d in zip(names, batch, ins)})
        keys[:] = keys or sorted(y, key=output_order)
        return [y[k].numpy() for k in keys]

    outs = batched(run_batch, arrays)
    return outs, ins, [o.dtype.name for o in outs]


def output_order(key):
    """Sort key of a signature's output names: `output_0`, `output_1`, ...
    in number order, then the named ones."""
    m = re.fullmatch(r"output_(\d+)", key)
    return (0, int(m.group(1)), "") if m else (1, 0, key)


def weights_savedmodel(path):
    """Bytes of the variables stored in the SavedModel at `path`."""
    import tensorflow as tf

    reader = tf.train.load_checkpoint(os.path.join(path, "variables",
                                                   "variables"))
    shapes = reader.get_variable_to_shape_map()
    dtypes = reader.get_variable_to_dtype_map()
    return sum(
        int(np.prod(shapes[k])) * dtypes[k].size
        for k in shapes if k.endswith(".ATTRIBUTES/VARIABLE_VALUE")
    )
