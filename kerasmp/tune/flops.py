"""How many matmul and convolution FLOPs each layer computes itself.

An estimate from layer kinds and the shapes one forward pass saw (2 FLOPs
per multiply-add): `Dense`, `EinsumDense`, every `Conv*` (depthwise,
separable and transposed too), and the two attention products of
`MultiHeadAttention` and `GroupQueryAttention` (their projections are
their `EinsumDense` sublayers). Other layers count 0: their arithmetic is
elementwise, small beside these, or unknown. `tune` reports the share of
these FLOPs computed in float32: the speed cost of a float32 layer.
"""

import math

import keras


def _size(shape):
    return math.prod(int(d) for d in shape) if shape else 1


def _shapes(structure):
    return [tuple(t.shape) for t in keras.tree.flatten(structure)
            if getattr(t, "shape", None) is not None]


def _einsum_flops(layer, out):
    try:
        inputs, output = layer.equation.split("->")
        _, kernel_spec = inputs.split(",")
    except (AttributeError, ValueError):
        return 0
    kernel_spec = kernel_spec.replace("...", "")
    shape = tuple(layer.kernel.shape)
    if len(kernel_spec) != len(shape):
        return 0
    contracted = math.prod(d for a, d in zip(kernel_spec, shape)
                           if a not in output)
    return 2 * _size(out) * contracted


def _attention_flops(layer, args, kwargs):
    query = args[0] if args else kwargs.get("query")
    value = args[1] if len(args) > 1 else kwargs.get("value", query)
    if getattr(query, "shape", None) is None or len(query.shape) != 3:
        return 0
    batch, tq = query.shape[0], query.shape[1]
    tk = value.shape[1] if getattr(value, "shape", None) is not None else tq
    if isinstance(layer, keras.layers.MultiHeadAttention):
        per = layer.num_heads * (layer.key_dim + (layer.value_dim
                                                  or layer.key_dim))
    else:
        per = layer.num_query_heads * 2 * layer.head_dim
    return 2 * int(batch) * int(tq) * int(tk) * per


def own_flops(layer, args, kwargs, outputs):
    """The matmul/conv FLOPs of one call of `layer`'s own code.

    Args:
        layer: The layer.
        args, kwargs: What its `call` was given.
        outputs: What it returned.
    """
    outs = _shapes(outputs)
    if not outs:
        return 0
    out = outs[0]
    if isinstance(layer, (keras.layers.MultiHeadAttention,
                          keras.layers.GroupQueryAttention)):
        return _attention_flops(layer, args, kwargs)
    kernel = getattr(layer, "kernel", None)
    if isinstance(layer, keras.layers.EinsumDense) and kernel is not None:
        return _einsum_flops(layer, out)
    if isinstance(layer, keras.layers.Dense) and kernel is not None:
        return 2 * _size(out) * int(kernel.shape[0])
    name = type(layer).__name__
    if "Conv" not in name:
        return 0
    if "Separable" in name:
        depthwise = getattr(layer, "depthwise_kernel", None)
        pointwise = getattr(layer, "pointwise_kernel", None)
        if depthwise is None or pointwise is None:
            return 0
        d_shape = tuple(depthwise.shape)
        middle = d_shape[-2] * d_shape[-1]  # channels x multiplier
        spatial = _size(out) // max(int(pointwise.shape[-1]), 1)
        return 2 * spatial * middle * (_size(d_shape[:-2])
                                       + int(pointwise.shape[-1]))
    if kernel is None or len(kernel.shape) < 3:
        return 0
    shape = tuple(kernel.shape)
    if "Transpose" in name:
        ins = _shapes(args[:1] or kwargs.get("inputs"))
        return 2 * _size(ins[0]) * _size(shape) // max(shape[-1], 1) \
            if ins else 0
    if "Depthwise" in name:
        return 2 * _size(out) * _size(shape[:-2])
    return 2 * _size(out) * _size(shape) // max(shape[-1], 1)


def flop_share(flops, layers, float32_paths=None):
    """The share of `flops` (`{path: FLOPs}`) computed in float32: by the
    layers' compute dtypes now, or with `float32_paths` in float32 too.
    0.0 when no layer counts FLOPs."""
    total = sum(flops.values())
    if not total:
        return 0.0
    extra = float32_paths or ()
    in_float32 = sum(
        n for path, n in flops.items()
        if path in extra or layers[path].compute_dtype in ("float32",
                                                           "float64"))
    return in_float32 / total
