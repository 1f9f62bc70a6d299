"""Half-precision attention compiles on a CPU (`kerasmp/_patches.py`, 5).

On JAX, `keras.ops.dot_product_attention` calls `jax.nn.dot_product_attention`,
which asks XLA for the `F16_F16_F32` dot algorithm on float16 inputs; XLA's
CPU backend refuses it when the call is compiled, so stock Keras cannot
`fit` or `predict` a `MultiHeadAttention` model (or a keras-hub transformer)
under mixed_float16 on a CPU. These tests compare kerasmp's compiled runs
with a float32 reference, on every backend (on TensorFlow and PyTorch the
patch is not installed, and the same runs must hold there too).
"""

import keras
import numpy as np
import pytest

import kerasmp
from kerasmp import _keras_internals

pytestmark = pytest.mark.torch  # also in the PyTorch pass (conftest.py)


def _mha_model(seed=0):
    keras.utils.set_random_seed(seed)
    x = keras.Input((6, 8))
    y = keras.layers.MultiHeadAttention(num_heads=2, key_dim=4)(x, x)
    y = keras.layers.GlobalAveragePooling1D()(y)
    return keras.Model(x, keras.layers.Dense(1, dtype="float32")(y))


def test_compiled_half_attention_matches_float32():
    rng = np.random.default_rng(0)
    q = rng.normal(size=(2, 5, 2, 4)).astype("float32")
    k = rng.normal(size=(2, 7, 2, 4)).astype("float32")
    v = rng.normal(size=(2, 7, 2, 4)).astype("float32")
    reference = keras.ops.convert_to_numpy(
        keras.ops.dot_product_attention(q, k, v, is_causal=False)
    )

    # predict compiles the call (jit on JAX, tf.function on TensorFlow).
    got = _predict_three(q, k, v)
    assert got.dtype == np.float16
    # float16 rounding of inputs and output: a few ulps of float16.
    np.testing.assert_allclose(got.astype("float32"), reference, atol=4e-3)


def _predict_three(q, k, v):
    qi = keras.Input(q.shape[1:])
    ki = keras.Input(k.shape[1:])
    vi = keras.Input(v.shape[1:])
    out = keras.layers.Lambda(
        lambda t: keras.ops.dot_product_attention(
            *(keras.ops.cast(a, "float16") for a in t)
        )
    )([qi, ki, vi])
    return keras.Model([qi, ki, vi], out).predict([q, k, v], verbose=0)


def test_multi_head_attention_fits_under_mixed_float16():
    rng = np.random.default_rng(1)
    x = rng.normal(size=(16, 6, 8)).astype("float32")
    y = rng.normal(size=(16, 1)).astype("float32")

    keras.config.set_dtype_policy("float32")
    reference = _mha_model()
    weights = reference.get_weights()
    expected = reference.predict(x, verbose=0)

    kerasmp.set_global_policy("mixed_float16")
    model = _mha_model()
    model.set_weights(weights)
    got = model.predict(x, verbose=0)
    np.testing.assert_allclose(got, expected, atol=2e-2 * np.ptp(expected))

    model.compile(optimizer="adam", loss="mse")
    history = model.fit(x, y, batch_size=8, epochs=1, verbose=0)
    assert np.isfinite(history.history["loss"]).all()
    assert all(np.isfinite(w).all() for w in model.get_weights())


@pytest.mark.skipif(keras.backend.backend() != "jax",
                    reason="the patch exists on JAX only")
def test_uninstall_restores_keras_attention():
    nn = _keras_internals.backend_nn_module()
    patched = nn.dot_product_attention
    original = patched.__wrapped__  # functools.wraps keeps Keras's function
    assert original.__module__ == nn.__name__
    kerasmp.uninstall()
    try:
        assert nn.dot_product_attention is original
    finally:
        kerasmp.install()
    assert nn.dot_product_attention is patched
