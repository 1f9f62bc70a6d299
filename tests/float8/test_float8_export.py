"""Export of a float8-trained model (kerasmp.float8.dequantize + the public
kerasmp.export.export): the plain copy's layers and weights, and the parity
of the float16 artifact with the copy and with the float8 model."""

import keras
import numpy as np
import pytest
from _helpers import float8_test_policy
from _models import float8_mlp

import kerasmp
from kerasmp import float8

E4M3 = "float8_e4m3fn"


def _trained():
    kerasmp.set_global_policy(float8_test_policy())
    keras.utils.set_random_seed(0)
    model = float8_mlp(small=False)
    model.compile(keras.optimizers.Adam(0.01), "categorical_crossentropy")
    rng = np.random.default_rng(0)
    x = rng.normal(size=(256, 16)).astype("float32")
    y = keras.utils.to_categorical((x[:, 0] > 0) + 2 * (x[:, 1] > 0), 4)
    model.fit(x, y, batch_size=32, epochs=3, verbose=0)
    kerasmp.set_global_policy("float32")
    return model, x


def test_dequantize_gives_plain_layers_with_the_kernels_float8_used():
    model, x = _trained()
    plain = float8.dequantize(model)
    assert float8.float8_layers(plain) == []
    for name in ("first", "mid", "mid2"):
        assert plain.get_layer(name).compute_dtype == "bfloat16"
    assert plain.get_layer("ln").compute_dtype == "float32"  # rules kept
    assert len(plain.weights) == len(model.weights) - 2 * 6
    mid = model.get_layer("mid")
    expect = keras.quantizers.quantize_and_dequantize(
        keras.ops.convert_to_tensor(np.asarray(mid.kernel)),
        float(np.asarray(mid.kernel_scale)), E4M3, "float32")
    expect = keras.ops.convert_to_numpy(expect)
    np.testing.assert_array_equal(np.asarray(plain.get_layer("mid").kernel),
                                  expect)
    np.testing.assert_array_equal(np.asarray(plain.get_layer("first").kernel),
                                  np.asarray(model.get_layer("first").kernel))
    # Only the float8 rounding of the inputs separates the two.
    a, b = model.predict(x, verbose=0), plain.predict(x, verbose=0)
    assert np.abs(a - b).max() < 0.1
    assert (a.argmax(1) == b.argmax(1)).mean() > 0.9


def test_dequantize_rejects_non_models():
    with pytest.raises(TypeError, match="`model` must be a keras.Model"):
        float8.dequantize(keras.layers.Dense(2))


@pytest.mark.tensorflow
def test_float16_savedmodel_export_parity(tmp_path):
    import tensorflow as tf

    model, x = _trained()
    plain = float8.dequantize(model)
    report = kerasmp.export.export(plain, str(tmp_path / "served"),
                                   sample=x)
    assert report.passed(1e-2), report
    assert report.top1_agreement > 0.99
    served = tf.saved_model.load(str(tmp_path / "served"))
    fn = served.signatures["serving_default"]
    out = list(fn(tf.constant(x)).values())[0].numpy()
    ref = model.predict(x, verbose=0)
    # Against the float8 model itself: its inputs were rounded to E4M3.
    assert np.abs(out - ref).max() < 0.1
    assert (out.argmax(1) == ref.argmax(1)).mean() > 0.9
