"""Issue 27 items 3 and 5: a `keep_float32` pattern that matches no layer
is refused before any work, and the report's `kept_float32` is what the
artifact holds; the converters run quietly unless `verbose=True`, and
kerasmp's own warnings come once each, at the user's call.
"""

import logging
import os
import warnings

import keras
import numpy as np
import pytest
from keras import layers

from kerasmp import export as kx
from kerasmp.export import quiet
from kerasmp.policy import Policy
from kerasmp.policy import policy_scope

pytestmark = pytest.mark.torch
BACKEND = keras.backend.backend()


def _model():
    with policy_scope(Policy("mixed_float16")):
        inputs = keras.Input((8,), name="x")
        h = layers.Dense(16, name="d1")(inputs)
        h = layers.LayerNormalization(name="ln")(h)
        h = layers.Dense(16, name="d2")(h)
        outputs = layers.Dense(4, activation="softmax", name="head")(h)
        return keras.Model(inputs, outputs, name="m")


def test_a_pattern_that_matches_no_layer_is_refused_first(tmp_path):
    model = _model()
    path = tmp_path / "m.keras"
    with pytest.raises(ValueError) as info:
        kx.export(model, str(path), format="keras",
                  keep_float32=["d1", "lnorm"])
    message = str(info.value)
    assert "'lnorm' matches no layer of 'm'" in message
    for name in ("'d1' (Dense)", "'ln' (LayerNormalization)", "'head'"):
        assert name in message
    assert "\n" not in message and list(tmp_path.iterdir()) == []
    # A class name given as a pattern: the error says to pass the class.
    with pytest.raises(ValueError, match="pass the class "
                       "keras.layers.LayerNormalization"):
        kx.to_float16(model, keep_float32=["LayerNormalization"])


def test_kept_float32_is_what_the_keras_file_holds(tmp_path):
    model = _model()
    path = tmp_path / "m.keras"
    report = kx.export(model, str(path), format="keras",
                       keep_float32=["d2", keras.layers.LayerNormalization])
    loaded = keras.saving.load_model(path, compile=False)
    computes = {layer.name: layer.compute_dtype for layer in loaded.layers
                if not isinstance(layer, keras.layers.InputLayer)}
    # The rules replace the defaults: the softmax head is not kept.
    assert set(report.kept_float32) == {"d2", "ln"}
    assert computes == {"d1": "float16", "ln": "float32", "d2": "float32",
                        "head": "float16"}
    assert loaded.get_layer("d2").kernel.dtype == "float32"


def test_converters_are_silenced_unless_verbose(capfd):
    logger = logging.getLogger("tensorflow")

    def noisy():
        os.write(2, b"I0000 00:00 cpp_info.cc:1] C++ INFO line\n")
        warnings.warn("a converter's FutureWarning", FutureWarning)
        return logger.isEnabledFor(logging.WARNING)

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with quiet.converters(verbose=False):
            assert not noisy()  # INFO:tensorflow lines and warnings
        assert caught == []
        assert capfd.readouterr().err == ""
        with quiet.converters(verbose=True):
            assert noisy()
        assert "C++ INFO line" in capfd.readouterr().err
        assert len(caught) == 1
    assert logger.isEnabledFor(logging.WARNING)  # restored


def _out_of_range_model():
    model = _model()
    kernel = model.get_layer("d2").kernel
    values = np.full(kernel.shape, 1e-3, "float32")
    values[0, 0] = 1e5  # beyond the float16 maximum: kept in float32
    kernel.assign(values)
    return model


def test_kerasmp_warnings_come_once_at_the_call(tmp_path, capfd):
    model = _out_of_range_model()
    fmt, name = (("savedmodel", "sm") if BACKEND != "torch"
                 else ("torch", "m.pt2"))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        report = kx.export(model, str(tmp_path / name), format=fmt)
    said = [w for w in caught if "kerasmp" in str(w.message)]
    assert len(said) == 1, [str(w.message) for w in caught]
    assert "'d2'" in str(said[0].message) and said[0].filename == __file__
    assert "d2" in report.kept_float32
    err = capfd.readouterr().err
    noise = [line for line in err.splitlines()
             if line.startswith(("I0000", "W0000", "INFO:"))]
    assert noise == [], err[-2000:]


@pytest.mark.skipif(BACKEND != "jax", reason="TensorFlow's start-up lines "
                    "come from Keras's serializer importing it on JAX")
def test_a_keras_export_on_jax_prints_nothing(tmp_path):
    """A fresh process: Keras's serializer imports TensorFlow lazily during
    the `.keras` export, whose C++ start-up lines reached the user."""
    import subprocess
    import sys

    script = (
        "import keras, kerasmp\n"
        "kerasmp.set_global_policy('mixed_float16')\n"
        "m = keras.Sequential([keras.Input((4,)), keras.layers.Dense(3), "
        "keras.layers.Softmax()])\n"
        f"kerasmp.export.export(m, {str(tmp_path / 'm.keras')!r}, "
        "format='keras')\n"
    )
    env = dict(os.environ, KERAS_BACKEND="jax")
    env.pop("TF_CPP_MIN_LOG_LEVEL", None)  # as a user's shell has it
    proc = subprocess.run([sys.executable, "-c", script], env=env,
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout == "" and proc.stderr == "", proc.stderr
