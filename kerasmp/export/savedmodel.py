"""The SavedModel format: a `tf.Module` serving the model (each variable
stored once), its writer from TensorFlow or JAX, its reader
(`tf.saved_model.load`) and its weight counter. The TFLite and ONNX writers
convert the same serving function.
"""

import os
import re

import keras
import numpy as np

from kerasmp._utils.arrays import is_float
from kerasmp.export.inputs import batched
from kerasmp.export.inputs import pack


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


def jax_archive(model, specs, io_dtype):
    """A `keras.export.ExportArchive` serving `model` from JAX: the route
    stock `model.export(format="tf_saved_model")` takes (jax2tf), with the
    same signature as `serving_module`."""
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
    archive.add_endpoint("serve", serve, input_signature=signature)
    return archive


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
    as a SavedModel folder with a `serving_default` signature."""
    import tensorflow as tf

    if keras.backend.backend() == "jax":
        jax_archive(model, specs, io_dtype).write_out(path, verbose=False)
        return
    module, serve, _ = serving_module(model, specs, io_dtype)
    tf.saved_model.save(
        module, path, signatures={"serving_default": serve}
    )


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
