"""The tiny models several test files build (imported as `_models`: pytest
puts tests/ on sys.path).

Each builder returns an uncompiled model built under the global policy of
the moment (`mixed_policy` in conftest.py sets kerasmp's), so a test
compiles it its own way. The arguments cover what the tests that share a
builder differ in (sizes, activations, a seed); the layer names are part
of the model, since tests look layers up by name. A model particular to one
test stays in that test's file.
"""

import keras
import numpy as np
from _helpers import keras_hub_or_skip
from keras import layers
from keras import ops

from kerasmp.policy import Policy
from kerasmp.policy import policy_scope


class NaiveSoftmax(keras.layers.Layer):
    """exp(x) / sum(exp(x)) without subtracting the max: overflows float16
    (exp(x) > 65504 for x > 11.1) long before float32 (x > 88.7)."""

    def call(self, x):
        e = ops.exp(x)
        return e / ops.sum(e, axis=-1, keepdims=True)


def _seeded(seed):
    if seed is not None:
        keras.utils.set_random_seed(seed)


def single_dense(features, units, *, name=None):
    """`Input(features)` -> `Dense(units)`: the smallest trainable model."""
    return keras.Sequential([keras.Input((features,)),
                             layers.Dense(units, name=name)])


def mlp(features=8, hidden=16, outputs=1, *, hidden_activation="relu",
        activation=None, seed=None):
    """`Input(features)` -> `Dense(hidden, hidden_activation)` ->
    `Dense(outputs, activation)`, Keras's default layer names; seeded first
    when `seed` is given (the weights then depend on nothing else)."""
    _seeded(seed)
    return keras.Sequential([
        keras.Input((features,)),
        layers.Dense(hidden, activation=hidden_activation),
        layers.Dense(outputs, activation=activation),
    ])


def named_mlp(features=12, hidden=64, outputs=3, *, input_name=None,
              name=None):
    """`Input(features)` -> "d1" and "d2" (`Dense(hidden, "relu")`) ->
    "out" (`Dense(outputs)`, linear)."""
    return keras.Sequential([
        keras.Input((features,), name=input_name),
        layers.Dense(hidden, activation="relu", name="d1"),
        layers.Dense(hidden, activation="relu", name="d2"),
        layers.Dense(outputs, name="out"),
    ], name=name)


def batch_norm_mlp(features=6, hidden=8, outputs=1, *,
                   hidden_activation="relu", dropout=None, seed=None):
    """`Input(features)` -> `Dense(hidden, hidden_activation)` ->
    `BatchNormalization` [-> `Dropout(dropout)`] -> `Dense(outputs)`: moving
    statistics that the forward pass writes (and a dropout seed)."""
    _seeded(seed)
    stack = [keras.Input((features,)),
             layers.Dense(hidden, activation=hidden_activation),
             layers.BatchNormalization()]
    if dropout is not None:
        stack.append(layers.Dropout(dropout))
    stack.append(layers.Dense(outputs))
    return keras.Sequential(stack)


def proj_head(middle="naive_softmax", *, seed=1):
    """`Input(4)` -> "proj" (`Dense(8)`) -> the middle layer -> "head"
    (`Dense(1)`), seeded.

    `middle`: "naive_softmax" (a `NaiveSoftmax`, which overflows float16
    once the inputs are ~10x larger than N(0, 1) draws), "batch_norm" (a
    `BatchNormalization` named "bn") or None (none).
    """
    _seeded(seed)
    stack = [keras.Input((4,)), layers.Dense(8, name="proj")]
    if middle == "naive_softmax":
        stack.append(NaiveSoftmax(name="naive_softmax"))
    elif middle == "batch_norm":
        stack.append(layers.BatchNormalization(name="bn"))
    elif middle is not None:
        raise ValueError(f"unknown middle layer {middle!r}")
    stack.append(layers.Dense(1, name="head"))
    return keras.Sequential(stack)


def transformer_classifier(seq=8, features=16, dim=32, heads=2, key_dim=16,
                           feed_forward=None, classes=5,
                           name="tiny_transformer"):
    """Tokens `(seq, features)` named "tokens" -> "embed" (`Dense(dim)`) ->
    "mha" (self-attention, dropout 0.1) -> residual and LayerNormalization
    -> [a GELU feed-forward block] -> average over positions -> "head"
    (`Dense(classes, "softmax")`).

    Without `feed_forward` one LayerNormalization, "ln", then "pool"; with
    it, "ln1", "ff1" (`Dense(feed_forward, "gelu")`), "ff2", "ln2" and an
    unnamed pooling layer.

    dropout > 0 makes MultiHeadAttention use its einsum + Softmax path (the
    Softmax sublayer the kerasmp policy keeps in float32). With dropout=0
    it calls the fused ops.dot_product_attention instead (which kerasmp
    makes compile in float16 on JAX on a CPU, where stock Keras fails:
    tests/policy/test_attention_on_cpu.py).
    """
    inputs = keras.Input((seq, features), name="tokens")
    x = layers.Dense(dim, name="embed")(inputs)
    a = layers.MultiHeadAttention(heads, key_dim, dropout=0.1, name="mha")(
        x, x)
    if feed_forward is None:
        x = layers.LayerNormalization(name="ln")(x + a)
        x = layers.GlobalAveragePooling1D(name="pool")(x)
    else:
        x = layers.LayerNormalization(name="ln1")(x + a)
        f = layers.Dense(feed_forward, activation="gelu", name="ff1")(x)
        f = layers.Dense(dim, name="ff2")(f)
        x = layers.LayerNormalization(name="ln2")(x + f)
        x = layers.GlobalAveragePooling1D()(x)
    outputs = layers.Dense(classes, activation="softmax", name="head")(x)
    return keras.Model(inputs, outputs, name=name)


def float8_mlp(small=True):
    """first (16x32), mid (32x32, relu), ln, mid2 (32x32), [small (32x4)],
    head (4x4 or 32x4, softmax): with `float8_test_policy()` (a threshold
    of 256 elements, the first and last layers excluded) the rule picks mid
    and mid2."""
    inputs = keras.Input((16,))
    x = layers.Dense(32, name="first")(inputs)
    x = layers.Dense(32, activation="relu", name="mid")(x)
    x = layers.LayerNormalization(name="ln")(x)
    x = layers.Dense(32, name="mid2")(x)
    if small:
        x = layers.Dense(4, name="small")(x)
    outputs = layers.Dense(4, activation="softmax", name="head")(x)
    return keras.Model(inputs, outputs)


def mixed_with_float32_twin(builder, **kwargs):
    """`(model, reference)`: `builder(**kwargs)` under `kerasmp.Policy(
    "mixed_float16")` and under float32, both holding the same random
    weights (N(0, 0.3) draws, seed 0)."""
    with policy_scope(Policy("mixed_float16")):
        model = builder(**kwargs)
    with policy_scope("float32"):
        reference = builder(**kwargs)
    rng = np.random.default_rng(0)
    reference.set_weights([rng.normal(0, 0.3, w.shape).astype("float32")
                           for w in reference.get_weights()])
    model.set_weights(reference.get_weights())
    return model, reference


def tiny_bert():
    """A keras-hub `BertBackbone` (vocabulary 2048, 2 layers, hidden 32,
    sequences up to 16) under `kerasmp.Policy("mixed_float16")`, seeded;
    skips the test where keras-hub cannot be imported."""
    keras_hub = keras_hub_or_skip()
    keras.utils.set_random_seed(0)
    with policy_scope(Policy("mixed_float16")):
        return keras_hub.models.BertBackbone(
            vocabulary_size=2048, num_layers=2, num_heads=2, hidden_dim=32,
            intermediate_dim=64, max_sequence_length=16)


def tiny_gpt2_task():
    """A GPT2CausalLM (vocabulary 8, 2 layers, hidden 16) with its
    preprocessor (sequences of 8), over a byte-pair vocabulary made here;
    skips the test where keras-hub cannot be imported."""
    keras_hub = keras_hub_or_skip()
    vocabulary = {"<|endoftext|>": 0, "Ġ": 1, "a": 2, "b": 3, "Ġa": 4,
                  "Ġb": 5, "ab": 6, "Ġab": 7}
    merges = ["Ġ a", "Ġ b", "a b", "Ġa b"]
    tokenizer = keras_hub.models.GPT2Tokenizer(vocabulary=vocabulary,
                                               merges=merges)
    preprocessor = keras_hub.models.GPT2CausalLMPreprocessor(
        tokenizer, sequence_length=8)
    backbone = keras_hub.models.GPT2Backbone(
        vocabulary_size=8, num_layers=2, num_heads=2, hidden_dim=16,
        intermediate_dim=32, max_sequence_length=16)
    return keras_hub.models.GPT2CausalLM(backbone, preprocessor)
