"""The inputs of an export: the model's input specs, the parity inputs
(`sample` checked against the specs, or default draws that respect the
model) and batched runs of a model or an artifact on them.
"""

import re

import keras
import numpy as np

from kerasmp import _keras_internals as _ki
from kerasmp._utils.arrays import is_float
from kerasmp._utils.arrays import to_numpy
from kerasmp.export.half import HalfModel
from kerasmp.export.half import is_graph_model
from kerasmp.policy.plan import plan_of

PREDICT_BATCH = 128
DEFAULT_LENGTH = 16  # unknown dimensions of the default parity inputs


def parity_inputs(model, sample, n):
    """The model's input specs and the inputs its parity is measured on.

    Args:
        model: A built `keras.Model`.
        sample: None, or what `as_input_list` takes.
        n: How many inputs to draw when `sample` is None.

    Returns:
        `(specs, arrays, origin)`: `input_specs(model)`, one array per spec
        (`sample`, checked against them, or `n` draws of `draw_inputs`) and
        where they came from (`"sample"` or `"default draws"`).
    """
    specs = input_specs(model)
    if sample is None:
        return specs, draw_inputs(model, specs, n), "default draws"
    return specs, as_input_list(sample, specs, model), "sample"


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
    for _, layer in plan_of(model).walk():
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
        l.input_dim for _, l in plan_of(model).walk()
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
                mean = to_numpy(front.mean)
                std = np.sqrt(to_numpy(front.variance))
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
    """`arrays` (in `input_specs` order) structured as `model` takes them."""
    if isinstance(model, HalfModel):
        return pack(model.source_model(), arrays)
    if is_graph_model(model) and not isinstance(model, keras.Sequential):
        return keras.tree.pack_sequence_as(model.input, arrays)
    return arrays[0]


def _flat_outputs(y):
    return [to_numpy(t) for t in keras.tree.flatten(y)]


def batched(run_batch, arrays, size=PREDICT_BATCH):
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


def predict(model, arrays):
    """`model`'s outputs on `arrays` (flat, numpy), in batches."""
    return batched(
        lambda batch: _flat_outputs(model(pack(model, batch),
                                          training=False)),
        arrays,
    )
