"""The plain Keras `.keras` file kerasmp.export writes (issue 16): it loads
without kerasmp on either backend with the same dtypes and predictions
(keras-hub's BERT too), reads back with kerasmp (`dtype_report`), keeps a
user's pinned float32 output, and a failure quotes its root cause. Also a
keras.applications ConvNeXt saved under kerasmp (`model.save`) predicting
the same without it.

References: the float32 model built with the same weights
(`mixed_with_float32_twin`), and the files read back by stock
`keras.saving.load_model` in a process where kerasmp cannot be imported.
"""

import json
import subprocess
import sys
import warnings

import keras
import numpy as np
import pytest
from _helpers import BLOCK_KERASMP
from _helpers import slow_on
from _helpers import subprocess_env
from _helpers import uniform_inputs
from _models import mixed_with_float32_twin
from _models import tiny_bert
from _models import transformer_classifier
from keras import layers

from kerasmp import export as kx
from kerasmp.export.inputs import draw_inputs
from kerasmp.export.inputs import input_specs
from kerasmp.policy import Policy
from kerasmp.policy import policy_scope
from kerasmp.policy.report import dtype_report

BACKEND = keras.backend.backend()


LOAD_PLAIN = BLOCK_KERASMP + """
import keras, numpy as np
model = keras.saving.load_model(sys.argv[1], compile=False)
x = np.load(sys.argv[2])
y = keras.ops.convert_to_numpy(model(x, training=False)).astype("float64")
kept = {}
for layer in model.layers:
    kept[layer.name] = [layer.compute_dtype,
                        sorted({str(w.dtype) for w in layer.weights})]
MHA = keras.layers.MultiHeadAttention
mha = [l for l in model.layers if isinstance(l, MHA)]
if mha:
    kept["mha/softmax"] = [mha[0]._softmax.compute_dtype, []]
print("RESULT " + json.dumps({"y": y.tolist(), "layers": kept}))
"""


@pytest.mark.parametrize("backend", ["tensorflow", "jax"])
def test_plain_keras_loads_without_kerasmp(tmp_path, backend):
    model, ref = mixed_with_float32_twin(transformer_classifier)
    path = tmp_path / "m16.keras"
    report = kx.export(model, str(path), format="keras")
    x = uniform_inputs(model)
    np.save(tmp_path / "x.npy", x)
    proc = subprocess.run(
        [sys.executable, "-c", LOAD_PLAIN, str(path),
         str(tmp_path / "x.npy")],
        capture_output=True, text=True, env=subprocess_env(backend),
        timeout=300)
    lines = [l for l in proc.stdout.splitlines() if l.startswith("RESULT ")]
    assert proc.returncode == 0 and lines, proc.stderr[-3000:]
    out = json.loads(lines[-1][len("RESULT "):])
    got = np.asarray(out["y"])
    want = keras.ops.convert_to_numpy(ref(x)).astype("float64")
    # Predictions within the parity figure of a float16 run.
    assert np.max(np.abs(got - want)) / np.ptp(want) <= 2e-2
    assert np.mean(got.argmax(-1) == want.argmax(-1)) >= 0.95
    layers_ = out["layers"]
    assert layers_["embed"] == ["float16", ["float16"]]
    assert layers_["mha"][0] == "float16"
    assert layers_["ln"] == ["float32", ["float32"]]
    assert layers_["head"] == ["float32", ["float32"]]
    assert layers_["mha/softmax"][0] == "float32"
    assert set(report.kept_float32) >= {"ln", "head"}


def test_plain_keras_with_kerasmp_and_dtype_report(tmp_path):
    model, _ = mixed_with_float32_twin(transformer_classifier)
    path = str(tmp_path / "m16.keras")
    kx.export(model, path, format="keras")
    loaded = keras.saving.load_model(path, compile=False)
    report = dtype_report(loaded)
    rows = {r.path: r.compute_dtype for r in report}
    assert rows["embed"] == "float16" and rows["ln"] == "float32"
    assert rows["head"] == "float32"
    assert len(rows) >= len(model.layers) - 1  # every layer, inputs aside


HUB_LOAD = BLOCK_KERASMP + """
import keras, keras_hub, numpy as np
model = keras.saving.load_model(sys.argv[1], compile=False)
d = np.load(sys.argv[2])
y = model({k: d[k] for k in d.files}, training=False)
y = keras.ops.convert_to_numpy(y["sequence_output"]).astype("float64")
print("RESULT " + json.dumps({"y": y.tolist()}))
"""


@pytest.mark.parametrize("backend", ["tensorflow", "jax"])
def test_keras_hub_plain_keras_loads_without_kerasmp(tmp_path, backend):
    # Exported on either backend, the file loads and predicts on both. The
    # attention softmax has no Keras path, so only the encoder's map default
    # could make it float32, and that default also makes the encoder's own
    # Dropout float32 on float16 inputs: TensorFlow then refuses
    # `x + residual` (JAX promotes). So the softmax is float16 in the file,
    # with a warning naming it, on both backends alike.
    model = tiny_bert()
    path = tmp_path / "bert16.keras"
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        report = kx.export(model, str(path), format="keras", gate=True)
    said = [w for w in caught if "kerasmp" in str(w.message)]
    assert len(said) == 1, [str(w.message) for w in caught]
    assert "self_attention_layer/softmax" in str(said[0].message)
    assert "computes in float16, not float32" in str(said[0].message)
    assert said[0].filename == __file__  # the user's call, one sentence
    assert not any("softmax" in k for k in report.kept_float32)
    left = report.left_at_default
    assert left and all("/softmax" in k for k in left)
    assert {v["compute_dtype"] for v in left.values()} == {"float16"}
    assert "left at default" in str(report)
    assert any(k.endswith("self_attention_layer_norm")
               for k in report.kept_float32)
    assert report.weight_ratio <= 0.52
    specs = input_specs(model)
    arrays = draw_inputs(model, specs, 8, seed=3)
    sample = {name: a for (name, _, _), a in zip(specs, arrays)}
    np.savez(tmp_path / "x.npz", **sample)
    proc = subprocess.run(
        [sys.executable, "-c", HUB_LOAD, str(path), str(tmp_path / "x.npz")],
        capture_output=True, text=True, env=subprocess_env(backend),
        timeout=300)
    lines = [l for l in proc.stdout.splitlines() if l.startswith("RESULT ")]
    assert proc.returncode == 0 and lines, proc.stderr[-3000:]
    got = np.asarray(json.loads(lines[-1][len("RESULT "):])["y"])
    with policy_scope("float32"):
        ref = type(model).from_config(model.get_config())
    ref.set_weights(model.get_weights())
    want = keras.ops.convert_to_numpy(ref(sample)["sequence_output"])
    assert np.max(np.abs(got - want)) / np.ptp(want) <= 2e-2


CONVNEXT_LOAD = BLOCK_KERASMP + """
import keras, numpy as np
model = keras.saving.load_model(sys.argv[1], compile=False)
y = keras.ops.convert_to_numpy(model(np.load(sys.argv[2]))).astype("float64")
print("RESULT " + json.dumps({"y": y.tolist()}))
"""


@slow_on("jax")  # 70 s on JAX, 15 s on TensorFlow
def test_convnext_saved_under_kerasmp_predicts_the_same_without_it(
        tmp_path):
    # Issue 16 #7: keras.applications ConvNeXt code, small depths. Its
    # nested Sequential `..._downsampling_block_0` (LayerNormalization then
    # Conv2D) loses its dtype in Sequential.from_config; saved as "float32",
    # the LayerNormalization then got unrounded inputs without kerasmp
    # (relative 1.9e-4 measured before the fix).
    from keras.applications import ConvNeXtTiny

    convnext = __import__(ConvNeXtTiny.__module__, fromlist=["ConvNeXt"])
    with policy_scope(Policy("mixed_float16")):
        model = convnext.ConvNeXt(
            depths=[1, 1, 1, 1], projection_dims=[8, 16, 32, 64],
            input_shape=(32, 32, 3), weights=None, classes=10,
            name="tiny_convnext")
    x = np.random.default_rng(0).uniform(0, 255, (8, 32, 32, 3)).astype(
        "float32")
    want = keras.ops.convert_to_numpy(model(x)).astype("float64")
    path = tmp_path / "convnext.keras"
    model.save(path)
    np.save(tmp_path / "x.npy", x)
    proc = subprocess.run(
        [sys.executable, "-c", CONVNEXT_LOAD, str(path),
         str(tmp_path / "x.npy")],
        capture_output=True, text=True, env=subprocess_env(BACKEND),
        timeout=300)
    lines = [l for l in proc.stdout.splitlines() if l.startswith("RESULT ")]
    assert proc.returncode == 0 and lines, proc.stderr[-3000:]
    got = np.asarray(json.loads(lines[-1][len("RESULT "):])["y"])
    # Same arithmetic, same predictions (stock save/load is exact too).
    np.testing.assert_allclose(got, want, rtol=0, atol=1e-7)


def build_dict_inputs_pinned_output():
    # Inputs passed as a dict whose keys are not the tensors' names (Keras
    # warns but fit and predict take it), and the mixed-precision guide's
    # float32 output layer: `Activation("linear", dtype="float32")`.
    inputs = {"ids": keras.Input((6,)), "extra": keras.Input((4,))}
    x = layers.Concatenate(name="cat")([inputs["ids"], inputs["extra"]])
    x = layers.Dense(16, activation="relu", name="d16")(x)
    x = layers.Dense(3, name="logits")(x)
    out = layers.Activation("linear", dtype="float32", name="out32")(x)
    return keras.Model(inputs, out, name="pinned")


def test_a_pinned_float32_output_stays_float32_and_fit_style_samples_work(
        tmp_path):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)  # Keras: dict key names
        model, ref = mixed_with_float32_twin(
            build_dict_inputs_pinned_output)
    rng = np.random.default_rng(2)
    sample = {"ids": rng.uniform(0, 1, (32, 6)).astype("float32"),
              "extra": rng.uniform(0, 1, (32, 4)).astype("float32")}
    path = str(tmp_path / "pinned.keras")
    report = kx.export(model, path, format="keras", sample=sample)
    # The layer the user pinned to float32 stays so, and so do the outputs
    # the report promises ("float32 inputs/outputs").
    assert "dtype='float32'" in report.kept_float32["out32"]
    assert "d16" not in report.kept_float32
    assert report.output_dtypes == ("float32",)
    loaded = keras.saving.load_model(path, compile=False)
    assert loaded.get_layer("out32").compute_dtype == "float32"
    assert loaded.get_layer("d16").compute_dtype == "float16"
    got = keras.ops.convert_to_numpy(loaded(sample, training=False))
    want = keras.ops.convert_to_numpy(ref(sample, training=False))
    assert got.dtype == np.float32
    assert np.max(np.abs(got - want)) / np.ptp(want) <= 2e-2
    # A sample keyed neither way names both key sets.
    with pytest.raises(ValueError, match=r"\['extra', 'ids'\]"):
        kx.export(model, str(tmp_path / "bad.keras"), format="keras",
                  sample={"ids": sample["ids"]})
    # A float32 model has no pinned layers to keep: all of it is halved.
    plain = kx.export(ref, str(tmp_path / "f32.keras"), format="keras",
                      keep_float32=[])
    assert plain.kept_float32 == {} and plain.weight_ratio <= 0.52


def test_root_cause_quotes_a_long_first_line_cut_at_a_word():
    from kerasmp.export.keras_file import root_cause

    short = ValueError("short reason")
    assert root_cause(short) == "ValueError: short reason"
    words = " ".join(f"word{i}" for i in range(100))  # 689 characters
    cut = root_cause(TypeError(words))
    assert cut.startswith("TypeError: word0 word1 ") and cut.endswith(" ...")
    body = cut[len("TypeError: "):-len(" ...")]
    assert words.startswith(body + " ") and len(body) <= 300
