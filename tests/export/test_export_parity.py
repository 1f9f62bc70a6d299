"""kerasmp.export's parity check (issue 16): a scale-free figure, default
inputs drawn to respect the model (token ids below the vocabulary, masks
of ones, pixels for a Rescaling), a failure that names the sample, and the
CLI's default gate passing on real models (the demo's CNN, a keras-hub
BERT, a keras.applications MobileNetV3).

References: parity figures computed by hand, and the float32 model built
with the same weights (`mixed_with_float32_twin`).
"""

import json
import subprocess
import sys
import warnings

import keras
import numpy as np
import pytest
from _helpers import slow_on
from _helpers import subprocess_env
from _models import mixed_with_float32_twin
from _models import named_mlp
from _models import tiny_bert
from keras import layers

from kerasmp import export as kx
from kerasmp.export.inputs import draw_inputs
from kerasmp.export.inputs import input_specs
from kerasmp.export.parity import parity
from kerasmp.policy import Policy
from kerasmp.policy import policy_scope

BACKEND = keras.backend.backend()


def test_scale_free_parity_figure():
    ref = [np.array([[0.0, 30.0], [10.0, 20.0]]),
           np.array([[1e-3, 0.0], [0.0, 1e-3]])]
    out = [ref[0] + 0.3, ref[1] + 1e-5]
    p = parity(ref, out)
    assert p["max_abs_diff"] == pytest.approx(0.3)
    assert p["rel_diffs"] == pytest.approx([0.3 / 30, 1e-5 / 1e-3])
    assert p["rel_diff"] == pytest.approx(0.01)
    assert p["top1"] == 1.0


def test_default_inputs_respect_the_model():
    ids = keras.Input((6,), dtype="int32", name="token_ids")
    mask = keras.Input((6,), dtype="int32", name="padding_mask")
    e = layers.Embedding(37, 4)(ids)
    m = keras.Model([ids, mask], layers.GlobalAveragePooling1D()(e))
    specs = input_specs(m)
    tok, pad = draw_inputs(m, specs, 256)
    assert tok.min() >= 0 and tok.max() < 37 and tok.max() > 30
    assert np.all(pad == 1)
    img = keras.Sequential([keras.Input((4,)), layers.Rescaling(1 / 255),
                            layers.Dense(2)])
    (x,) = draw_inputs(img, input_specs(img), 256)
    assert x.min() >= 0 and x.max() < 255 and x.max() > 200
    plain = named_mlp(input_name="x", name="mlp")
    (x,) = draw_inputs(plain, input_specs(plain), 256)
    assert x.min() >= 0 and x.max() < 1


def test_parity_failure_names_sample(tmp_path):
    model, _ = mixed_with_float32_twin(named_mlp, input_name="x",
                                         name="mlp")
    with pytest.raises(kx.ParityError, match="sample=") as info:
        kx.export(model, str(tmp_path / "m.keras"), format="keras",
                  max_rel_diff=1e-9)
    assert not (tmp_path / "m.keras").exists()
    assert info.value.report.rel_diff > 1e-9


@pytest.mark.tensorflow
def test_cli_default_export_passes_on_demo_model(tmp_path):
    from kerasmp.apps import zoo

    with policy_scope(Policy("mixed_float16")):
        model = zoo.digits_cnn()
    model.compile("adam", "sparse_categorical_crossentropy")
    rng = np.random.default_rng(0)
    x = rng.uniform(0, 1, (256, 8, 8, 1)).astype("float32")
    model.fit(x, rng.integers(0, 10, 256), epochs=1, verbose=0)
    src = tmp_path / "model.keras"
    model.save(src)
    for fmt, name in (("keras", "m16.keras"), ("savedmodel", "sm")):
        proc = subprocess.run(
            [sys.executable, "-m", "kerasmp.apps.cli", "export", str(src),
             str(tmp_path / name), "--format", fmt, "--json"],
            capture_output=True, text=True, timeout=300,
            env=subprocess_env("tensorflow"))
        assert proc.returncode == 0, proc.stderr[-2000:]
        report = json.loads(proc.stdout[proc.stdout.index("{"):])
        assert report["rel_diff"] <= 2e-2 and report["inputs"] == (
            "default draws")


def _application():
    with policy_scope(Policy("mixed_float16")):
        return keras.applications.MobileNetV3Small(
            input_shape=(32, 32, 3), weights=None, minimalistic=True,
            alpha=0.75, classes=10)


# The keras.applications model on JAX: 100 s (eager convolutions in the
# parity draws); its TensorFlow run stays in the default suite.
@pytest.mark.parametrize(
    "which", ["keras_hub",
              pytest.param("applications", marks=slow_on("jax"))])
def test_default_gate_passes_on_real_models(tmp_path, which):
    model = tiny_bert() if which == "keras_hub" else _application()
    fmts = [("keras", "m.keras")]
    if BACKEND == "tensorflow":
        fmts += [("savedmodel", "sm"), ("tflite", "m.tflite")]
    for fmt, name in fmts:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            report = kx.export(model, str(tmp_path / name), format=fmt,
                               gate=True)  # the CLI's default gate
        assert report.rel_diff <= kx.DEFAULT_MAX_REL_DIFF["float16"]
        assert report.inputs == "default draws"
        assert report.weight_ratio <= 0.52
