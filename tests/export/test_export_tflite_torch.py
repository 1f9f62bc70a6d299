"""TFLite from the PyTorch backend (issue 35, item 2), through litert-torch:
the three models that failed (two Dense layers: `KeyError: 'input_layer'`;
Embedding + MultiHeadAttention: `KeyError: 'tokens'`; the demo's CNN
through `kerasmp export --format tflite`: `failed to legalize operation
'tfl.pad'` of a float16 tensor) are written, pass parity, store float16
weights, and are served by the LiteRT interpreter in a process where
kerasmp cannot be imported; litert-torch prints nothing unless `verbose`.

References: the same model built in float32 with the master weights,
run here (`predict`); the file read back without kerasmp.
"""

import json
import subprocess
import sys

import keras
import numpy as np
import pytest
from _helpers import BLOCK_KERASMP
from _helpers import subprocess_env
from keras import layers

from kerasmp import export as kx
from kerasmp.apps.zoo import digits_cnn
from kerasmp.policy import Policy
from kerasmp.policy import policy_scope

pytestmark = [
    pytest.mark.torch,
    pytest.mark.skipif(keras.backend.backend() != "torch",
                       reason="writes from the PyTorch backend"),
]

# The file takes one example per call (litert-torch converts fixed shapes).
SERVE = BLOCK_KERASMP + """
import numpy as np
from ai_edge_litert.interpreter import Interpreter
interpreter = Interpreter(model_path=sys.argv[1])
runner = interpreter.get_signature_runner("serving_default")
name = interpreter.get_signature_list()["serving_default"]["inputs"][0]
x = np.load(sys.argv[2])
ys = [runner(**{name: x[i:i + 1]})["output_0"] for i in range(len(x))]
halves = sum(t["dtype"] is np.float16 for t in interpreter.get_tensor_details())
print("RESULT " + json.dumps({
    "input": name, "y": np.concatenate(ys).astype("float64").tolist(),
    "float16_tensors": int(halves)}))
"""


def _serve(path, x, tmp_path):
    """`{"input", "y", "float16_tensors"}` of the .tflite at `path` run on
    `x` by the LiteRT interpreter in a process without kerasmp."""
    np.save(tmp_path / "x.npy", x)
    proc = subprocess.run(
        [sys.executable, "-c", SERVE, str(path), str(tmp_path / "x.npy")],
        capture_output=True, text=True, env=subprocess_env("torch"),
        timeout=300)
    lines = [l for l in proc.stdout.splitlines() if l.startswith("RESULT ")]
    assert proc.returncode == 0 and lines, proc.stderr[-3000:]
    return json.loads(lines[-1][len("RESULT "):])


def _pair(build, scale=0.5, seed=0):
    """`(mixed_float16 model, float32 reference)` with the same random
    weights, N(0, `scale`) (biases and normalization statistics too, so
    none is folded away as zero or one)."""
    with policy_scope(Policy("mixed_float16")):
        model = build()
    with policy_scope("float32"):
        ref = build()
    rng = np.random.default_rng(seed)
    for w in ref.weights:  # a moving variance stays positive
        value = rng.normal(0, scale, w.shape)
        w.assign((np.abs(value) + 0.5 if "variance" in w.path else value)
                 .astype("float32"))
    model.set_weights(ref.get_weights())
    return model, ref


def _rel(got, want):
    return float(np.max(np.abs(got - want)) / np.ptp(want))


def _check(report, path, ref, x, tmp_path, input_name):
    """Parity of the served file against the float32 reference, its
    float16 weights, and its input named as the model's."""
    pytest.importorskip("ai_edge_litert")
    want = ref.predict(x, verbose=0).astype("float64")
    served = _serve(path, x[:9], tmp_path)
    assert served["input"] == input_name
    assert _rel(np.asarray(served["y"]), want[:9]) <= 2e-2
    assert np.array_equal(np.argmax(served["y"], -1), np.argmax(want[:9], -1))
    assert served["float16_tensors"] >= 2  # a kernel and a bias at least
    assert report.rel_diff <= 2e-2 and report.top1_agreement == 1.0
    # float16 weights: half the float32 masters' bytes, give or take the
    # few constants float16 cannot hold and those the converter adds.
    assert 0.45 <= report.weight_ratio <= 0.55


def test_two_dense_layers(tmp_path, capfd):
    pytest.importorskip("litert_torch")

    def build():
        return keras.Sequential([
            keras.Input((8,)), layers.Dense(16, activation="relu"),
            layers.Dense(4, activation="softmax")])

    model, ref = _pair(build)
    x = np.random.default_rng(1).uniform(-2, 2, (64, 8)).astype("float32")
    path = tmp_path / "m16.tflite"
    capfd.readouterr()
    report = kx.export(model, str(path), format="tflite", sample=x,
                       gate=True)
    printed = capfd.readouterr()
    # litert-torch's [START]/[DONE] progress lines, on stdout, are off.
    assert "LiteRT-Torch" not in printed.out + printed.err
    assert "[START]" not in printed.out + printed.err
    assert report.input_dtypes == ("float32",)
    _check(report, path, ref, x, tmp_path, "input_layer")


def test_embedding_and_attention(tmp_path):
    pytest.importorskip("litert_torch")

    def build():
        tokens = keras.Input((12,), dtype="int32", name="tokens")
        h = layers.Embedding(50, 16)(tokens)
        h = layers.MultiHeadAttention(2, 8)(h, h)
        h = layers.LayerNormalization()(h)
        h = layers.GlobalAveragePooling1D()(h)
        return keras.Model(tokens, layers.Dense(4, activation="softmax")(h))

    model, ref = _pair(build)
    x = np.random.default_rng(2).integers(0, 50, (64, 12)).astype("int32")
    path = tmp_path / "m16.tflite"
    report = kx.export(model, str(path), format="tflite", sample=x,
                       gate=True)
    assert report.input_dtypes == ("int32",)
    _check(report, path, ref, x, tmp_path, "tokens")


def test_the_demo_cnn_through_the_command(tmp_path, capsys):
    pytest.importorskip("litert_torch")
    from kerasmp.apps import cli

    # Weights of a trained model's size (N(0, 0.5) kernels over 512 inputs
    # give logits in the hundreds, which magnify float16 rounding).
    model, ref = _pair(lambda: digits_cnn(), scale=0.1)
    x = np.random.default_rng(3).uniform(0, 1, (64, 8, 8, 1)).astype(
        "float32")
    model.save(tmp_path / "model.keras")
    np.save(tmp_path / "sample.npy", x)
    out = tmp_path / "model.tflite"
    capsys.readouterr()
    assert cli.main(["export", str(tmp_path / "model.keras"), str(out),
                     "--format", "tflite", "--sample",
                     str(tmp_path / "sample.npy"), "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["rel_diff"] <= 2e-2 and report["top1_agreement"] == 1.0
    assert 0.45 <= report["weight_ratio"] <= 0.55
    pytest.importorskip("ai_edge_litert")
    want = ref.predict(x, verbose=0).astype("float64")
    served = _serve(out, x[:9], tmp_path)
    assert served["input"] == "image"
    assert _rel(np.asarray(served["y"]), want[:9]) <= 2e-2
    assert np.array_equal(np.argmax(served["y"], -1), np.argmax(want[:9], -1))
    assert served["float16_tensors"] >= 4  # two convolutions, two Dense


def test_half_weights_keeps_what_float16_cannot_hold(tmp_path):
    """A constant beyond float16's range (1e5) or one that rounds to zero
    there (1e-9) stays float32; the others are stored in float16."""
    litert_torch = pytest.importorskip("litert_torch")
    pytest.importorskip("ai_edge_litert")
    import torch
    from ai_edge_litert.interpreter import Interpreter

    from kerasmp.export.tflite import half_weights

    rng = np.random.default_rng(4)
    normal = rng.normal(0, 1, (8, 8)).astype("float32")
    large = np.full((8,), 1e5, "float32")
    tiny = np.full((8,), 1e-9, "float32")

    class Module(torch.nn.Module):
        def forward(self, x):
            return (x @ torch.from_numpy(normal) + torch.from_numpy(large),
                    x * torch.from_numpy(tiny))

    x = rng.normal(0, 1, (1, 8)).astype("float32")
    edge = litert_torch.convert(Module().eval(),
                                sample_kwargs={"x": torch.from_numpy(x)})
    edge.export(str(tmp_path / "m.tflite"))
    flat = half_weights((tmp_path / "m.tflite").read_bytes())
    interpreter = Interpreter(model_content=flat)
    kinds = {t["dtype"].__name__ for t in interpreter.get_tensor_details()}
    got = interpreter.get_signature_runner("serving_default")(x=x)
    assert "float16" in kinds  # the normal kernel
    # Stored in float16, 1e5 would be inf and 1e-9 zero.
    want = x @ normal.astype("float16").astype("float32") + large
    np.testing.assert_allclose(got["output_0"], want, rtol=1e-6)
    np.testing.assert_allclose(got["output_1"], x * tiny, rtol=1e-6)
