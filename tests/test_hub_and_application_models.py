"""kerasmp on models nobody here wrote: keras-hub transformers (post-LN BERT,
pre-LN GPT-2) and keras.applications CNNs, all built from scratch with small
configs (no downloads).

For each model, under `kerasmp.Policy("mixed_float16")` with a softmax head:
`fit` with both monitors with `jit_compile` False and True, save to `.keras`
and reload in a process where kerasmp cannot be imported, and export to
every format with the parity report. TensorFlow's float16 convolutions
without XLA are very slow on a CPU, so the CNN inputs are tiny.
"""

import itertools
import json
import os
import subprocess
import sys

import keras
import numpy as np
import pytest
from _helpers import BLOCK_KERASMP
from _helpers import keras_hub_or_skip

import kerasmp

keras_hub = keras_hub_or_skip()

BACKEND = keras.backend.backend()
SEQ = 8
VOCAB = 16384
BATCH = 4
# A large vocabulary so that the weights, not the file format's overhead,
# dominate the artifacts' size (the embedding: 16384 x 32).
TRANSFORMER = dict(vocabulary_size=VOCAB, num_layers=2, num_heads=2,
                   hidden_dim=32, intermediate_dim=64,
                   max_sequence_length=SEQ)


def _token_inputs(backbone):
    return {name: keras.Input((SEQ,), dtype="int32", name=name)
            for name in backbone.input}


def _transformer(cls):
    def build():
        backbone = cls(**TRANSFORMER)
        inputs = _token_inputs(backbone)
        out = backbone(inputs)
        seq = out["sequence_output"] if isinstance(out, dict) else out
        x = keras.layers.GlobalAveragePooling1D()(seq)
        outputs = keras.layers.Dense(3, activation="softmax")(x)
        return keras.Model(inputs, outputs)

    def data(n, seed=0):
        rng = np.random.default_rng(seed)
        x = {"token_ids": rng.integers(0, VOCAB, (n, SEQ)).astype("int32"),
             "padding_mask": np.ones((n, SEQ), "int32")}
        if cls is keras_hub.models.BertBackbone:
            x["segment_ids"] = np.zeros((n, SEQ), "int32")
        return x

    return build, data


def _application(fn, size=32):
    def build():
        base = fn(weights=None, include_top=False, pooling="avg",
                  input_shape=(size, size, 3))
        inputs = keras.Input((size, size, 3))
        # Untrained backbones' pooled features are huge or tiny; normalized,
        # they give the head probabilities that vary from image to image,
        # so the parity checks compare something.
        x = keras.layers.LayerNormalization()(base(inputs))
        outputs = keras.layers.Dense(3, activation="softmax")(x)
        return keras.Model(inputs, outputs)

    def data(n, seed=0):
        # Images that differ in what survives global pooling: per-image
        # channel gains and offsets on a noise texture (iid noise images
        # all pool to the same features).
        rng = np.random.default_rng(seed)
        gain = rng.uniform(0.2, 1.0, (n, 1, 1, 3))
        offset = rng.uniform(0, 128, (n, 1, 1, 3))
        noise = rng.uniform(0, 127, (n, size, size, 3))
        return (offset + gain * noise).astype("float32")

    return build, data


CNNS = ("vgg16", "resnet50")
MODELS = {
    "bert": _transformer(keras_hub.models.BertBackbone),
    "gpt2": _transformer(keras_hub.models.GPT2Backbone),
    # Not MobileNetV3Small (or MobileNet, MobileNetV2): built from scratch
    # their pooled features are ~1e-10, below float16's range, so every
    # output is the same in both precisions and parity would prove nothing.
    # Not DenseNet121: XLA compiles its train step for 4-6 minutes on a CPU.
    "vgg16": _application(keras.applications.VGG16),
    "resnet50": _application(keras.applications.ResNet50),
}


# The default suite runs the matrix but for its costliest cells, which CI's
# slow pass (`bash tests/run.sh --slow`) runs: every ResNet-50 cell (its
# XLA train step alone takes 3 minutes on TensorFlow) and the eager
# (jit_compile=False) JAX fits, of the CNNs and the transformers.
def _cells(*axes, slow):
    """pytest params over the product of `axes`, marked slow where
    `slow(*values)` says."""
    return [
        pytest.param(*values, marks=[pytest.mark.slow] if slow(*values) else [])
        for values in itertools.product(*axes)
    ]


def _build(name):
    keras.utils.set_random_seed(0)  # the same weights in every run
    kerasmp.set_global_policy(kerasmp.Policy("mixed_float16"))
    try:
        return MODELS[name][0]()
    finally:
        kerasmp.set_global_policy("float32")


def _labels(n, seed=0):
    return np.random.default_rng(seed).integers(0, 3, n)


def _all_finite(model):
    return all(np.isfinite(np.asarray(w, "float32")).all()
               for w in model.get_weights())


@pytest.mark.parametrize("name,jit_compile", _cells(
    list(MODELS), [False, True],
    slow=lambda name, jit: name == "resnet50" or (
        BACKEND == "jax" and not jit)))
def test_fit_with_monitors(name, jit_compile):
    if (BACKEND == "tensorflow" and not jit_compile
            and name in CNNS):
        pytest.skip("TF float16 convolutions without XLA are 100x+ slower on "
                    "a CPU; the XLA run covers the model")
    model = _build(name)
    x, y = MODELS[name][1](2 * BATCH), _labels(2 * BATCH)
    model.compile("adam", "sparse_categorical_crossentropy",
                  jit_compile=jit_compile)
    assert isinstance(model.optimizer, kerasmp.LossScaleOptimizer)
    nonfinite = kerasmp.callbacks.NonFiniteMonitor(action="warn")
    history = model.fit(
        x, y, batch_size=BATCH, epochs=2, verbose=0,
        callbacks=[kerasmp.callbacks.LossScaleMonitor(), nonfinite])
    losses = history.history["loss"]
    assert np.isfinite(losses).all()
    assert history.history["loss_scale"][-1] == pytest.approx(
        float(model.optimizer.loss_scale))
    assert _all_finite(model)
    probs = model.predict(x, verbose=0)
    assert probs.dtype == np.float32
    np.testing.assert_allclose(probs.sum(-1), 1.0, rtol=1e-3)


_NO_KERASMP = BLOCK_KERASMP + """
import numpy as np
import keras
import keras_hub  # noqa: F401  (registers its layers, as a user would)
model = keras.models.load_model({path!r})
data = dict(np.load({x_path!r}))
x = data["x"] if list(data) == ["x"] else data
preds = model.predict(x, verbose=0)
dtypes = {{l.name: l.compute_dtype
          for l in (model._flatten_layers() if {leaves} else model.layers)
          if not l._layers and not isinstance(l, keras.layers.InputLayer)}}
print(json.dumps({{"preds": preds.tolist(), "dtypes": dtypes}}))
"""


@pytest.mark.parametrize("name", _cells(
    list(MODELS), slow=lambda name: name == "resnet50"))
def test_saved_file_reloads_without_kerasmp(name, tmp_path):
    model = _build(name)
    x = MODELS[name][1](BATCH, seed=1)
    preds = model.predict(x, verbose=0)
    path = str(tmp_path / "model.keras")
    model.save(path)
    np.savez(tmp_path / "x.npz", **(x if isinstance(x, dict) else {"x": x}))
    # keras.applications models are graphs of Keras layers: every layer,
    # nested ones too, reloads with its own dtype and the predictions are
    # the same. Transformer blocks create their sublayers in code, which
    # (without kerasmp) take the block's policy: the top-level layers keep
    # their dtypes, and the predictions differ at float16 level.
    cnn = name in CNNS
    out = subprocess.run(
        [sys.executable, "-c", _NO_KERASMP.format(
            path=path, x_path=str(tmp_path / "x.npz"), leaves=cnn)],
        capture_output=True, text=True,
        env={**os.environ, "TF_CPP_MIN_LOG_LEVEL": "3"})
    assert out.returncode == 0, out.stderr[-3000:]
    loaded = json.loads(out.stdout.strip().splitlines()[-1])
    dtypes = {l.name: l.compute_dtype
              for l in (model._flatten_layers() if cnn else model.layers)
              if not l._layers and not isinstance(l, keras.layers.InputLayer)}
    # Stock normalization layers kept in float32 load with the mixed policy
    # (float32 weights and arithmetic, half-precision output: kerasmp's
    # hand-back; `kerasmp.policy.portable_policy_name`).
    norms = (keras.layers.BatchNormalization,
             keras.layers.LayerNormalization,
             keras.layers.GroupNormalization)
    for l in (model._flatten_layers() if cnn else model.layers):
        stored = kerasmp.stored_policy(l)
        if (l.name in dtypes and isinstance(l, norms)
                and dtypes[l.name] == "float32"
                and isinstance(stored, kerasmp.Policy)):
            dtypes[l.name] = stored.compute_dtype
    assert loaded["dtypes"] == dtypes
    assert "float32" in dtypes.values() or not cnn
    atol = 1e-6 if cnn else 2e-2
    np.testing.assert_allclose(np.asarray(loaded["preds"]), preds, atol=atol)


def _formats():
    if BACKEND != "tensorflow":
        return ["keras"]
    return ["keras", "savedmodel", "tflite", "onnx"]


@pytest.mark.parametrize("name,fmt", _cells(
    list(MODELS), _formats(),
    slow=lambda name, fmt: name == "resnet50"))
def test_export_with_parity_report(name, fmt, tmp_path):
    if fmt == "onnx":
        pytest.importorskip("tf2onnx")
    model = _build(name)
    suffix = {"keras": ".keras", "tflite": ".tflite", "onnx": ".onnx"}
    path = str(tmp_path / f"model{suffix.get(fmt, '')}")
    sample = MODELS[name][1](16, seed=2)
    # The parity check means something only if the outputs vary.
    assert model.predict(sample, verbose=0).std(0).max() > 1e-4
    report = kerasmp.export.export(model, path, format=fmt, sample=sample)
    assert os.path.exists(path)
    assert report.max_abs_diff <= 1e-2, str(report)
    # Half-precision weights; small models carry format overhead (graph,
    # many small batch-norm vectors), so the ratio is not exactly 0.5.
    assert report.size_ratio <= 0.6, str(report)
    print(f"\n{name} {fmt}: size ratio {report.size_ratio:.3f}, "
          f"max diff {report.max_abs_diff:.2e}")
    if report.top1_agreement is not None:
        assert report.top1_agreement >= 0.9
