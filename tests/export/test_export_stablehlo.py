"""JAX to SavedModel and TFLite across JAX and TensorFlow releases (issue
44, item 7): jax2tf stores the JAX program as a StableHLO artifact that
TensorFlow's `XlaCallModule` op reads when the file is called. JAX 0.12
targets StableHLO 1.22, which TensorFlow 2.21 (reads up to 1.13.7) cannot
read (`unregistered operation 'vhlo.custom_call_v2'`); kerasmp writes the
artifact at the version TensorFlow reads, and refuses, before converting,
a JAX that cannot write so old a version.

References: the float32 model built with the same weights
(`mixed_with_float32_twin`), read back with `tf.saved_model.load` and the
LiteRT interpreter; the StableHLO versions read from JAX and TensorFlow
at run time.
"""

import re

import keras
import numpy as np
import pytest
from _helpers import uniform_inputs
from _models import mixed_with_float32_twin
from _models import named_mlp

from kerasmp import _keras_internals as ki
from kerasmp import export as kx
from kerasmp.export import savedmodel as sm
from kerasmp.export import tflite

BACKEND = keras.backend.backend()
jax_route = pytest.mark.skipif(BACKEND != "jax",
                               reason="the JAX route (jax2tf)")


def _version(text):
    return tuple(int(p) for p in text.split("."))


@jax_route
def test_the_savedmodel_holds_stablehlo_that_tensorflow_reads(tmp_path):
    import tensorflow as tf

    reads = ki.tensorflow_stablehlo_version()
    assert reads is not None, "TensorFlow no longer says its StableHLO"
    model, ref = mixed_with_float32_twin(named_mlp, input_name="x",
                                         name="mlp")
    path = tmp_path / "sm"
    kx.export(model, str(path), format="savedmodel")
    # The XlaCallModule's artifact names the version it was written at.
    written = re.findall(rb"StableHLO_v([0-9]+\.[0-9]+\.[0-9]+)",
                         (path / "saved_model.pb").read_bytes())
    assert written, "no StableHLO artifact in the SavedModel"
    assert all(_version(v.decode()) <= _version(reads) for v in written), (
        written, reads)
    loaded = tf.saved_model.load(str(path))
    x = uniform_inputs(model)
    y = next(iter(loaded.signatures["serving_default"](
        x=tf.constant(x)).values())).numpy()
    want = keras.ops.convert_to_numpy(ref(x))
    assert np.max(np.abs(y - want)) / np.ptp(want) < 2e-2


def test_the_versions_are_read_at_run_time():
    pytest.importorskip("jax")
    pytest.importorskip("tensorflow")
    import jax
    import tensorflow as tf

    v = sm.stablehlo_versions()
    assert (v["jax"], v["tensorflow"]) == (jax.__version__, tf.__version__)
    assert _version(v["jax_oldest"]) <= _version(v["jax_target"])
    # The pair installed here works: nothing is refused.
    assert sm.stablehlo_mismatch(v, "savedmodel") is None


def test_a_jax_too_new_for_tensorflow_is_one_line_naming_both():
    pytest.importorskip("jax")
    pytest.importorskip("tensorflow")
    v = dict(sm.stablehlo_versions())
    # A TensorFlow reading only a StableHLO older than this JAX writes.
    major, minor, _ = _version(v["jax_oldest"])
    v["tf_reads"] = f"{major}.{minor - 1}.0" if minor else f"{major - 1}.99.0"
    text = sm.stablehlo_mismatch(v, "tflite")
    assert text is not None and "\n" not in text
    assert text.startswith("format='tflite' cannot be written from JAX ")
    for part in (f"JAX {v['jax']}", f"TensorFlow {v['tensorflow']}",
                 f"StableHLO {v['jax_oldest']} or newer",
                 f"up to {v['tf_reads']}", "KERAS_BACKEND=tensorflow",
                 "'keras'"):
        assert part in text, (part, text)


@jax_route
@pytest.mark.parametrize("fmt,name", [("savedmodel", "sm"),
                                      ("tflite", "m.tflite")])
def test_the_refusal_comes_before_converting(tmp_path, monkeypatch, fmt,
                                             name):
    model, _ = mixed_with_float32_twin(named_mlp, input_name="x",
                                       name="mlp")
    oldest, _ = ki.jax_stablehlo_versions()
    major, minor, _ = _version(oldest)
    older = f"{major}.{minor - 1}.0" if minor else f"{major - 1}.99.0"
    # This TensorFlow, as if it read only versions older than JAX writes.
    monkeypatch.setattr(ki, "tensorflow_stablehlo_version", lambda: older)
    converted = []
    real = sm.jax_archive
    for module in (sm, tflite):
        monkeypatch.setattr(
            module, "jax_archive",
            lambda *a, **k: converted.append(1) or real(*a, **k))
    with pytest.raises(ValueError) as e:
        kx.export(model, str(tmp_path / name), format=fmt)
    assert type(e.value) is ValueError and "\n" not in str(e.value)
    assert str(e.value).startswith(f"format={fmt!r} cannot be written "
                                   "from JAX ")
    assert f"up to {older}" in str(e.value)
    assert not converted and not (tmp_path / name).exists()
