"""The models kerasmp's applications train: one place for each.

- `digits_cnn`: the small CNN of `kerasmp demo` (8x8 digits),
- `build_model(spec)`: the `kerasmp bench` models (an MLP, a CNN and a
  transformer encoder) at the sizes a `ModelSpec` gives, with
  `encoder_block` and `make_data` (random inputs and labels for them).

The benchmark scripts in `benchmarks/` and the tests keep their own models:
they are different models (other shapes, names and heads), and the numbers
recorded in `benchmarks/results/` were measured on them.
"""

import dataclasses

import keras
import numpy as np

from kerasmp.apps.choices import BENCH_MODELS

NUM_CLASSES = 10


def digits_cnn(num_classes=10, input_shape=(8, 8, 1)):
    """The demo's CNN: two convolutions, batch norm, a dense head, softmax.

    Under a `kerasmp.Policy` the convolutions and dense layers compute in
    half precision and `BatchNormalization` and the final softmax in float32.

    Args:
        num_classes: Number of output classes. Defaults to 10.
        input_shape: Shape of one image. Defaults to `(8, 8, 1)`.

    Returns:
        A `keras.Sequential` model (outputs: class probabilities).

    Example:

    >>> model = kerasmp.apps.zoo.digits_cnn()
    >>> model.output_shape
    (None, 10)
    """
    layers = keras.layers
    return keras.Sequential(
        [
            keras.Input(input_shape, name="image"),
            layers.Conv2D(16, 3, padding="same", activation="relu",
                          name="conv1"),
            layers.BatchNormalization(momentum=0.9, name="bn"),
            layers.Conv2D(32, 3, padding="same", activation="relu",
                          name="conv2"),
            layers.MaxPooling2D(name="pool"),
            layers.Flatten(name="flatten"),
            layers.Dense(64, activation="relu", name="dense"),
            layers.Dense(num_classes, name="logits"),
            layers.Activation("softmax", name="softmax"),
        ],
        name="digits_cnn",
    )


@dataclasses.dataclass(frozen=True)
class ModelSpec:
    """Sizes of one benchmark model.

    Args:
        name: `"mlp"`, `"cnn"` or `"transformer"`.
        batch_size: Training batch size.
        width: MLP hidden units, CNN base filters, or transformer `d_model`.
        depth: Hidden layers (MLP), conv blocks (CNN) or encoder blocks.
        input_size: MLP input features, CNN image side, transformer sequence
            length.
        heads: Attention heads (transformer only).
        vocab: Vocabulary of the transformer's token ids (its input is int32
            ids through an `Embedding`, so each step moves little data to
            the device).
        dropout: Attention dropout (transformer only). Above 0, Keras's
            `MultiHeadAttention` takes its explicit einsum + `Softmax` path
            (the softmax computes in float32 under a kerasmp policy); at 0
            it calls the fused `ops.dot_product_attention`, the fast path
            on a GPU (on JAX on a CPU, where stock Keras cannot compile it
            in float16, kerasmp computes it from float32 copies:
            docs/policies.md).
    """

    name: str
    batch_size: int
    width: int
    depth: int
    input_size: int
    heads: int = 1
    dropout: float = 0.0
    vocab: int = 1000

    def describe(self):
        if self.name == "mlp":
            return (f"MLP {self.input_size}-" + "-".join(
                [str(self.width)] * self.depth) + f"-{NUM_CLASSES}")
        if self.name == "cnn":
            return (f"CNN {self.input_size}x{self.input_size}x3, "
                    f"{self.depth} conv blocks from {self.width} filters")
        return (f"transformer encoder x{self.depth}, d_model {self.width}, "
                f"{self.heads} heads, seq {self.input_size}, vocab "
                f"{self.vocab}, attention dropout {self.dropout:g}")


def build_model(spec):
    """Builds the benchmark model of `spec` under the current global policy.

    Args:
        spec: A `ModelSpec`.

    Returns:
        A `keras.Model` ending in a softmax over 10 classes.

    Example:

    >>> spec = ModelSpec("mlp", batch_size=32, width=64, depth=2,
    ...                  input_size=16)
    >>> build_model(spec).output_shape
    (None, 10)
    >>> x, y = make_data(spec, 64)   # inputs and labels for 64 samples
    """
    layers = keras.layers
    if spec.name == "mlp":
        inputs = keras.Input((spec.input_size,), name="features")
        x = inputs
        for i in range(spec.depth):
            x = layers.Dense(spec.width, activation="relu",
                             name=f"dense_{i}")(x)
    elif spec.name == "cnn":
        inputs = keras.Input((spec.input_size, spec.input_size, 3),
                             name="image")
        x = inputs
        for i in range(spec.depth):
            filters = spec.width * 2**i
            x = layers.Conv2D(filters, 3, padding="same", name=f"conv_{i}")(x)
            x = layers.BatchNormalization(name=f"bn_{i}")(x)
            x = layers.Activation("relu", name=f"relu_{i}")(x)
            if i < spec.depth - 1:
                x = layers.MaxPooling2D(name=f"pool_{i}")(x)
        x = layers.GlobalAveragePooling2D(name="gap")(x)
    elif spec.name == "transformer":
        inputs = keras.Input((spec.input_size,), dtype="int32",
                             name="tokens")
        x = layers.Embedding(spec.vocab, spec.width, name="embedding")(inputs)
        for i in range(spec.depth):
            x = encoder_block(x, spec.width, spec.heads, 4 * spec.width,
                              dropout=spec.dropout, name=f"block_{i}")
        x = layers.GlobalAveragePooling1D(name="pool")(x)
    else:
        raise ValueError(
            f"Invalid model name {spec.name!r}. Allowed values: "
            f"{', '.join(BENCH_MODELS)}."
        )
    x = layers.Dense(NUM_CLASSES, name="logits")(x)
    outputs = layers.Activation("softmax", name="softmax")(x)
    return keras.Model(inputs, outputs, name=f"bench_{spec.name}")


def encoder_block(x, d_model, heads, d_ff, dropout=0.0, name="block"):
    """A pre-norm transformer encoder block (functional API).

    Args:
        x: A symbolic tensor of shape `(batch, seq, d_model)`.
        d_model: Model width.
        heads: Number of attention heads (`d_model % heads == 0`).
        d_ff: Width of the feed-forward layer.
        dropout: Attention dropout. Defaults to 0.
        name: Prefix of the layer names.

    Returns:
        The block's output, same shape as `x`.
    """
    layers = keras.layers
    h = layers.LayerNormalization(name=f"{name}_ln1")(x)
    h = layers.MultiHeadAttention(heads, d_model // heads, dropout=dropout,
                                  name=f"{name}_mha")(h, h)
    x = layers.Add(name=f"{name}_add1")([x, h])
    h = layers.LayerNormalization(name=f"{name}_ln2")(x)
    h = layers.Dense(d_ff, activation="gelu", name=f"{name}_ff1")(h)
    h = layers.Dense(d_model, name=f"{name}_ff2")(h)
    return layers.Add(name=f"{name}_add2")([x, h])


def make_data(spec, n, seed=0):
    """Random inputs and labels for `n` samples of `spec`'s model.

    Args:
        spec: A `ModelSpec`.
        n: Number of samples.
        seed: Seed of the NumPy generator. Defaults to 0.

    Returns:
        `(x, y)`: float32 features/images (int32 token ids for the
        transformer) and int32 labels in `[0, NUM_CLASSES)`.
    """
    rng = np.random.default_rng(seed)
    if spec.name == "transformer":
        x = rng.integers(0, spec.vocab, size=(n, spec.input_size),
                         dtype="int32")
    else:
        if spec.name == "mlp":
            shape = (n, spec.input_size)
        else:
            shape = (n, spec.input_size, spec.input_size, 3)
        x = rng.standard_normal(shape, dtype="float32")
    y = rng.integers(0, NUM_CLASSES, size=(n,)).astype("int32")
    return x, y
