"""The three models of the hand-off matrix, their inputs and labels.

No kerasmp here: a consumer without kerasmp rebuilds a model to load a
`.weights.h5` into it, as a user's own code would. Keras (and keras-hub)
are imported inside the functions.

- `cnn`: the demo's CNN, the layers of `kerasmp.apps.zoo.digits_cnn`
  (tests/test_handoffs.py keeps the two configs equal), on 8x8 images.
- `transformer`: token ids, an embedding, one pre-norm encoder block
  (`MultiHeadAttention`, `LayerNormalization`, a GELU feed-forward), mean
  pooling, a softmax over 10 classes.
- `gpt_oss`: keras-hub's `GptOssBackbone` at the census's tiny config
  (`benchmarks/zoo/hub.py`, keras-hub's own test numbers), whose MoE
  routers kerasmp measures and moves to float32 (at the model's first
  call, here its construction; else at `compile`), under mean pooling
  and a softmax over 10 classes.
"""

import os
import sys

import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
BENCHMARKS = os.path.dirname(HERE)
if BENCHMARKS not in sys.path:
    sys.path.insert(0, BENCHMARKS)

NUM_CLASSES = 10
PARITY_SAMPLES = 32
FIT_BATCH = 8
FIT_STEPS = 2
SEQUENCE = 8
VOCABULARY = 32


def build(name):
    """The model `name` under the current global policy, seeded."""
    import keras

    keras.utils.set_random_seed(0)
    return {"cnn": _cnn, "transformer": _transformer,
            "gpt_oss": _gpt_oss}[name]()


def _cnn():
    import keras

    layers = keras.layers
    return keras.Sequential([
        keras.Input((8, 8, 1), name="image"),
        layers.Conv2D(16, 3, padding="same", activation="relu",
                      name="conv1"),
        layers.BatchNormalization(momentum=0.9, name="bn"),
        layers.Conv2D(32, 3, padding="same", activation="relu",
                      name="conv2"),
        layers.MaxPooling2D(name="pool"),
        layers.Flatten(name="flatten"),
        layers.Dense(64, activation="relu", name="dense"),
        layers.Dense(NUM_CLASSES, name="logits"),
        layers.Activation("softmax", name="softmax"),
    ], name="digits_cnn")


def _transformer():
    import keras

    layers = keras.layers
    tokens = keras.Input((SEQUENCE,), dtype="int32", name="tokens")
    x = layers.Embedding(VOCABULARY, 16, name="embedding")(tokens)
    h = layers.LayerNormalization(name="ln1")(x)
    h = layers.MultiHeadAttention(2, 8, name="mha")(h, h)
    x = layers.Add(name="add1")([x, h])
    h = layers.LayerNormalization(name="ln2")(x)
    h = layers.Dense(32, activation="gelu", name="ff1")(h)
    h = layers.Dense(16, name="ff2")(h)
    x = layers.Add(name="add2")([x, h])
    x = layers.GlobalAveragePooling1D(name="pool")(x)
    x = layers.Dense(NUM_CLASSES, name="logits")(x)
    out = layers.Activation("softmax", name="softmax")(x)
    return keras.Model(tokens, out, name="transformer")


def _gpt_oss():
    import keras
    from zoo import hub
    from zoo import spec

    features, _ = spec.feature_model(hub.HUB["GptOssBackbone"])
    x = keras.layers.GlobalAveragePooling1D(name="pool")(features.output)
    x = keras.layers.Dense(NUM_CLASSES, name="logits")(x)
    out = keras.layers.Activation("softmax", name="softmax")(x)
    return keras.Model(features.input, out, name="gpt_oss")


def inputs(name, n, seed):
    """`n` inputs of model `name`: an array, or a dict keyed by input."""
    rng = np.random.default_rng(seed)
    if name == "cnn":
        return rng.uniform(0, 1, (n, 8, 8, 1)).astype("float32")
    if name == "transformer":
        return rng.integers(0, VOCABULARY, (n, SEQUENCE)).astype("int32")
    from zoo import hub
    from zoo import spec

    return spec.draw(hub.HUB["GptOssBackbone"].inputs, n, seed)


def labels(n, seed):
    return np.random.default_rng(seed).integers(0, NUM_CLASSES, n)


def data(name):
    """`{"parity": x, "fit": (x, y)}`: the parity inputs and the two steps
    of training data."""
    n = FIT_BATCH * FIT_STEPS
    return {"parity": inputs(name, PARITY_SAMPLES, 1),
            "fit": (inputs(name, n, 2), labels(n, 3))}
