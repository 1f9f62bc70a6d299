"""What the census does with a model, the same for every model.

- `Gen` and its constructors (`tokens`, `ones`, `zeros`, `uniform`,
  `normal`, `rows`): how one input is drawn, batch left out.
- `ZooModel`: one row of the census: how to build the backbone, its inputs,
  which output to compare.
- `feature_model`: inputs -> the compared output (the pooled or sequence
  output); `train_model`: that plus a small classification head.
- `normalization_layers`: the layers the "norms float32" column checks.
- `rel_diff`: the parity figure (max |diff| / range of the float32 output).

Imports neither kerasmp nor keras-hub (the stock stage runs with kerasmp
blocked; keras-hub is imported by the builders in `hub`).
"""

import dataclasses
import re

import numpy as np

NUM_CLASSES = 4
"""Classes of the head the fit column trains."""

PREFERRED_OUTPUTS = ("sequence_output", "pooled_output")
"""Dict outputs compared, in this order, unless a `ZooModel` names one."""


# --------------------------------------------------------------------------
# Inputs
# --------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Gen:
    """How one input of a model is drawn (`draw(n, rng)`: n rows).

    kind: "tokens" (integers in [0, high)), "ones", "zeros", "uniform"
    (in [low, high)), "normal", "rows" (`value`'s rows, cycled over the
    batch), "image" (pixels through `keras.applications.<value>`'s
    `preprocess_input`).
    """

    kind: str
    shape: tuple = ()
    dtype: str = "float32"
    low: float = 0.0
    high: float = 1.0
    value: tuple = ()

    def draw(self, n, rng):
        shape = (n,) + tuple(self.shape)
        if self.kind == "tokens":
            return rng.integers(0, int(self.high), shape).astype(self.dtype)
        if self.kind == "ones":
            return np.ones(shape, self.dtype)
        if self.kind == "zeros":
            return np.zeros(shape, self.dtype)
        if self.kind == "uniform":
            return rng.uniform(self.low, self.high, shape).astype(self.dtype)
        if self.kind == "normal":
            return rng.normal(0, 1, shape).astype(self.dtype)
        if self.kind == "rows":
            rows = np.asarray(self.value, self.dtype)
            return rows[np.arange(n) % len(rows)]
        if self.kind == "image":
            # RGB pixels in [0, 255), through the keras.applications
            # family's `preprocess_input` (`value`: the module name).
            import importlib

            module = importlib.import_module(
                f"keras.applications.{self.value}")
            pixels = rng.uniform(0, 255, shape).astype(self.dtype)
            return np.asarray(module.preprocess_input(pixels), self.dtype)
        raise ValueError(f"Unknown input kind {self.kind!r}")


def tokens(length, vocabulary, dtype="int32"):
    """Token ids drawn uniformly from the vocabulary (keras-hub's tests
    feed `ones`: every token the same, which makes parity trivial)."""
    return Gen("tokens", (length,), dtype, high=vocabulary)


def ones(*shape, dtype="int32"):
    return Gen("ones", shape, dtype)


def zeros(*shape, dtype="int32"):
    return Gen("zeros", shape, dtype)


def uniform(*shape, low=0.0, high=1.0, dtype="float32"):
    return Gen("uniform", shape, dtype, low=low, high=high)


def normal(*shape, dtype="float32"):
    return Gen("normal", shape, dtype)


def rows(value, dtype="int32"):
    """Fixed rows (as keras-hub's tests give them), cycled over the batch."""
    value = np.asarray(value)
    return Gen("rows", value.shape[1:], dtype, value=value.tolist())


def image(size, family):
    """A keras.applications image: pixels in [0, 255), preprocessed as the
    family's `preprocess_input` does."""
    return Gen("image", (size, size, 3), value=family)


def draw(inputs, n, seed):
    """`n` rows of every input: one array, or a dict of them."""
    rng = np.random.default_rng(seed)
    if isinstance(inputs, Gen):
        return inputs.draw(n, rng)
    return {name: gen.draw(n, rng) for name, gen in inputs.items()}


# --------------------------------------------------------------------------
# Models
# --------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class ZooModel:
    """One row of the census.

    Attributes:
        name: The row's name (the keras-hub class, or the
            `keras.applications` function).
        source: "keras-hub" or "keras.applications".
        build: `() -> keras.Model`, built under the global policy.
        inputs: A `Gen`, or a dict of them keyed by the backbone's inputs.
        output: The key of the dict output to compare, None for the
            default (`PREFERRED_OUTPUTS`, or the only output).
        config: Where the config comes from (the keras-hub test file).
        note: What the census changed from that config, and why.
        fast: Part of the fast subset (tests/test_zoo_census.py).
    """

    name: str
    source: str
    build: object
    inputs: object
    output: str = None
    config: str = ""
    note: str = ""
    fast: bool = False


def primary(outputs, key=None):
    """The output the census compares, from a backbone's outputs."""
    if key is not None:
        return outputs[key]
    if not isinstance(outputs, dict):
        if isinstance(outputs, (list, tuple)):
            return outputs[0]
        return outputs
    for name in PREFERRED_OUTPUTS:
        if name in outputs:
            return outputs[name]
    if len(outputs) == 1:
        return next(iter(outputs.values()))
    raise ValueError(
        f"Name the output to compare: the backbone returns {sorted(outputs)}")


def feature_model(zoo):
    """`(model, backbone)`: `model` maps the backbone's inputs to the
    output the census compares (`zoo.output`)."""
    import keras

    backbone = zoo.build()
    spec = backbone.input

    def new_input(name, t):
        return keras.Input(tuple(t.shape[1:]), dtype=t.dtype, name=name)

    if isinstance(spec, dict):
        inputs = {name: new_input(name, t) for name, t in spec.items()}
        args = inputs
    elif isinstance(spec, (list, tuple)):
        # A list of named inputs (Gemma3n): fed by name, as a dict.
        inputs = {_input_name(t): new_input(_input_name(t), t)
                  for t in spec}
        args = list(inputs.values())
    else:
        inputs = args = new_input(_input_name(spec), spec)
    out = primary(backbone(args), zoo.output)
    return keras.Model(inputs, out, name="zoo_features"), backbone


def _input_name(tensor):
    name = getattr(tensor, "name", "") or "inputs"
    return re.sub(r"\W", "_", name.split(":")[0])


def _pool_class():
    import keras

    class Pool(keras.layers.Layer):
        """The mean over `axes` (fixed from the symbolic shape: every axis
        but the batch and the channels, and the channels too when their
        number is unknown, as CLIP's batch x batch logits), as (batch, k)."""

        def __init__(self, axes, **kwargs):
            super().__init__(**kwargs)
            self.axes = list(axes)

        def call(self, x):
            y = keras.ops.mean(x, axis=self.axes)
            return keras.ops.expand_dims(y, -1) if len(y.shape) == 1 else y

    return Pool


def train_model(features):
    """`features` with a head: the mean over every axis but the batch and
    the channels, `Dense(NUM_CLASSES)` and a float32 softmax (as the
    TensorFlow mixed-precision guide has it). Not saved: the census exports
    the feature model."""
    import keras

    Pool = _pool_class()
    x = features.output
    axes = list(range(1, len(x.shape) - 1))
    if x.shape[-1] is None:
        axes.append(len(x.shape) - 1)
    if axes:
        x = Pool(axes, name="zoo_pool")(x)
    x = keras.layers.Dense(NUM_CLASSES, name="zoo_logits")(x)
    out = keras.layers.Activation("softmax", dtype="float32",
                                  name="zoo_probs")(x)
    return keras.Model(features.input, out, name="zoo_train")


def labels(n, seed):
    return np.random.default_rng(seed).integers(0, NUM_CLASSES, n)


# --------------------------------------------------------------------------
# Normalization layers
# --------------------------------------------------------------------------

NORM_NAME = re.compile(r"(?i).*norm(alization)?(_?gated)?(2d)?")
COMPOSITES = ("AdaptiveLayerNormalization", "ConvNormAct",
              "DFineConvNormLayer")
"""Classes named like a normalization that hold a Dense or a convolution
(they compute in the compute dtype, like any Dense)."""


def walk(layer, path=""):
    """`(path, layer)` of `layer` and every layer nested in it."""
    path = f"{path}/{layer.name}" if path else layer.name
    yield path, layer
    for sub in layer._flatten_layers(include_self=False, recursive=False):
        yield from walk(sub, path)


def is_normalization(layer):
    """Keras's BatchNormalization, LayerNormalization, GroupNormalization,
    RMSNormalization, UnitNormalization, or a layer whose class is named
    like one (keras-hub's ~20 own classes), less the `COMPOSITES`."""
    import keras

    names = [c.__name__ for c in type(layer).__mro__
             if isinstance(c, type) and issubclass(c, keras.layers.Layer)]
    if any(n in COMPOSITES for n in names):
        return False
    keras_norms = tuple(
        getattr(keras.layers, n) for n in (
            "BatchNormalization", "LayerNormalization",
            "GroupNormalization", "RMSNormalization", "UnitNormalization")
        if hasattr(keras.layers, n))
    return isinstance(layer, keras_norms) or bool(
        NORM_NAME.fullmatch(type(layer).__name__))


def normalization_layers(model):
    """`{path: compute dtype}` of the normalization layers of `model`."""
    return {path: layer.compute_dtype for path, layer in walk(model)
            if is_normalization(layer)}


# --------------------------------------------------------------------------
# Figures
# --------------------------------------------------------------------------


def rel_diff(reference, value):
    """max |value - reference| / (max - min of reference); inf when
    `value` is not finite or the shapes differ."""
    reference = np.asarray(reference, "float64")
    value = np.asarray(value, "float64")
    if reference.shape != value.shape or not np.isfinite(value).all():
        return float("inf")
    spread = float(reference.max() - reference.min()) if reference.size else 0
    diff = float(np.abs(value - reference).max()) if reference.size else 0.0
    if spread == 0.0:
        spread = max(float(np.abs(reference).max()), 1.0)
    return diff / spread


def finite(values):
    return bool(all(np.isfinite(np.asarray(v, "float64")).all()
                    for v in values))
