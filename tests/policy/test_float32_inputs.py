"""A layer kept in float32 that opts out of Keras's input casting
(`autocast=False`: Keras's LayerNormalization) computes from float32 inputs.

Before, Keras's LayerNormalization under a kerasmp rule received the half
tensors of the layers before it, computed in float32, rounded the result to
the input's half dtype and cast it back up: its "float32" output held half
precision, at two extra casts a call (issue 43: kerasmp's mixed_bfloat16
transformer was slower than stock Keras's on PyTorch). The reference here is
numpy's float32 layer normalization of the same half-precision inputs.
"""

import keras
import numpy as np
import pytest

import kerasmp
from kerasmp.policy.handback import takes_float32_inputs

pytestmark = pytest.mark.torch


def _reference_layer_norm(x, epsilon):
    x = x.astype("float32")
    mean = x.mean(-1, keepdims=True)
    var = ((x - mean) ** 2).mean(-1, keepdims=True)
    return (x - mean) / np.sqrt(var + epsilon)


@pytest.mark.parametrize("policy", ["mixed_bfloat16", "mixed_float16"])
def test_output_layer_norm_is_float32_from_float32_inputs(policy):
    kerasmp.set_global_policy(kerasmp.Policy(policy))
    keras.utils.set_random_seed(0)
    inputs = keras.Input((64,))
    hidden = keras.layers.Dense(64, name="dense")(inputs)
    norm = keras.layers.LayerNormalization(epsilon=1e-5, name="norm")
    model = keras.Model(inputs, norm(hidden))
    assert takes_float32_inputs(norm)
    assert not takes_float32_inputs(model.get_layer("dense"))
    x = np.random.default_rng(0).normal(size=(8, 64)).astype("float32")
    half = keras.ops.convert_to_numpy(
        keras.ops.cast(model.get_layer("dense")(x), "float32"))
    y = model(x)
    assert keras.backend.standardize_dtype(y.dtype) == "float32"
    y = keras.ops.convert_to_numpy(y)
    expected = _reference_layer_norm(half, 1e-5)
    np.testing.assert_allclose(y, expected, atol=2e-5, rtol=0)
    # Not the half-rounded result it returned before (which this bound
    # rejects: bfloat16 keeps 8 bits, float16 11).
    rounded = keras.ops.convert_to_numpy(keras.ops.cast(
        keras.ops.cast(expected, policy[len("mixed_"):]), "float32"))
    assert np.abs(rounded - expected).max() > 2e-5


def test_inside_the_model_the_next_layer_still_gets_half():
    kerasmp.set_global_policy(kerasmp.Policy("mixed_bfloat16"))
    seen = []

    class Probe(keras.layers.Layer):
        def call(self, x):
            seen.append(keras.backend.standardize_dtype(x.dtype))
            return x

    inputs = keras.Input((16,))
    x = keras.layers.Dense(16)(inputs)
    x = keras.layers.LayerNormalization()(x)
    model = keras.Model(inputs, Probe()(x))
    model(np.ones((2, 16), "float32"))
    assert seen[-1] == "bfloat16"


def test_stock_and_float32_policies_are_left_alone():
    norm = keras.layers.LayerNormalization()
    assert not takes_float32_inputs(norm)  # float32 global policy
    keras.config.set_dtype_policy("mixed_bfloat16")
    assert not takes_float32_inputs(keras.layers.LayerNormalization())
    kerasmp.set_global_policy(kerasmp.Policy("float32"))
    assert not takes_float32_inputs(keras.layers.LayerNormalization())
