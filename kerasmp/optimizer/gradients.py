"""The gradients a `LossScaleOptimizer` checks and unscales: dense
tensors, or TensorFlow's `IndexedSlices` (an embedding's), whose values
alone are read and mapped."""

from keras import ops


def max_abs(grads):
    """The largest |value| over all gradients, as a float32 scalar."""
    peaks = [
        ops.max(ops.abs(ops.cast(values(g), "float32")))
        for g in grads
        if g is not None
    ]
    return ops.max(ops.stack(peaks)) if peaks else ops.zeros((), "float32")



def values(g):
    """The dense values of a gradient (`tf.IndexedSlices` keeps its values)."""
    return getattr(g, "values", g) if is_indexed_slices(g) else g


def map_values(fn, g):
    if is_indexed_slices(g):
        import tensorflow as tf

        return tf.IndexedSlices(fn(g.values), g.indices, g.dense_shape)
    return fn(g)


def is_indexed_slices(g):
    return type(g).__name__ == "IndexedSlices"
