"""kerasmp.export on models it cannot rebuild: keras-hub backbones, models
that create their layers in another order than they call them, models whose
get_config()/from_config() do not round-trip (issue 9.3).

References are independent of kerasmp.export: the same model built in plain
float32 with the master weights (`get_weights()`), and each artifact run
here with its own runtime.
"""

import os

import keras
import numpy as np
import pytest
from _helpers import keras_hub_or_skip

from kerasmp import export as kx
from kerasmp.export.parity import size as artifact_size
from kerasmp.policy import Policy
from kerasmp.policy import policy_scope

keras_hub = keras_hub_or_skip()

# Tiny, from scratch (no download). The vocabulary is what makes most of
# the weights, so that the size ratio measures weights, not graph overhead.
HUB_CONFIG = dict(
    vocabulary_size=32768, num_layers=2, num_heads=2, hidden_dim=32,
    intermediate_dim=64, max_sequence_length=16,
)
SEQ = 16
N = 64


def _hub_model(name, policy):
    keras.utils.set_random_seed(0)
    cls = {"gpt2": keras_hub.models.GPT2Backbone,
           "bert": keras_hub.models.BertBackbone}[name]
    with policy_scope(policy):
        return cls(**HUB_CONFIG)


def _hub_sample(name):
    rng = np.random.default_rng(1)
    lengths = rng.integers(4, SEQ + 1, N)
    sample = {
        "token_ids": rng.integers(0, HUB_CONFIG["vocabulary_size"],
                                  (N, SEQ)).astype("int32"),
        "padding_mask": (np.arange(SEQ) < lengths[:, None]).astype("int32"),
    }
    if name == "bert":
        sample["segment_ids"] = (np.arange(SEQ) >= SEQ // 2).astype(
            "int32")[None].repeat(N, 0)
    return sample


@pytest.fixture(scope="module")
def hub():
    """`(mixed_float16 model, float32 reference outputs, sample)`."""
    cache = {}

    def get(name):
        if name not in cache:
            model = _hub_model(name, Policy("mixed_float16"))
            ref_model = _hub_model(name, "float32")
            ref_model.set_weights(model.get_weights())
            sample = _hub_sample(name)
            ref = keras.tree.flatten(ref_model(sample, training=False))
            ref = [keras.ops.convert_to_numpy(r).astype(np.float64)
                   for r in ref]
            cache[name] = (model, ref, sample)
        return cache[name]

    return get


def _max_diff(ref, outs):
    return max(
        float(np.max(np.abs(r - np.asarray(o, np.float64).reshape(r.shape))))
        for r, o in zip(ref, outs)
    )


def _run(fmt, path, sample):
    """Runs an artifact with its own runtime; flat outputs in Keras order."""
    if fmt == "keras":
        model = keras.saving.load_model(path, compile=False)
        return [keras.ops.convert_to_numpy(y) for y in
                keras.tree.flatten(model.predict(sample, verbose=0))]
    if fmt == "savedmodel":
        import tensorflow as tf

        serve = tf.saved_model.load(path).signatures["serving_default"]
        out = serve(**{k: tf.constant(v) for k, v in sample.items()})
        return [out[k].numpy() for k in sorted(out)]
    if fmt == "onnx":
        import onnxruntime

        session = onnxruntime.InferenceSession(
            path, providers=["CPUExecutionProvider"])
        out = session.run(None, {i.name: sample[i.name]
                                 for i in session.get_inputs()})
        names = [o.name for o in session.get_outputs()]
        return [o for _, o in sorted(zip(names, out))]
    from ai_edge_litert.interpreter import Interpreter

    runner = Interpreter(model_path=path).get_signature_runner()
    out = runner(**sample)
    return [out[k] for k in sorted(out)]


HUB_FORMATS = [
    pytest.param("keras", "m.keras", id="keras"),
    pytest.param("savedmodel", "served", id="savedmodel",
                 marks=pytest.mark.tensorflow),
    pytest.param("tflite", "m.tflite", id="tflite",
                 marks=pytest.mark.tensorflow),
    pytest.param("onnx", "m.onnx", id="onnx", marks=pytest.mark.tensorflow),
]


@pytest.mark.parametrize("name", ["gpt2", "bert"])
def test_keras_hub_to_float16(hub, name):
    model, ref, sample = hub(name)
    half = kx.to_float16(model)
    dtypes = half.layer_compute_dtypes()
    # Normalization and the attention softmax stay float32, the rest float16.
    assert dtypes["transformer_layer_0/self_attention_layer_norm"] == (
        "float32")
    assert any(p.endswith("softmax") and d == "float32"
               for p, d in dtypes.items())
    assert dtypes["token_embedding"] == "float16"
    var_dtypes = half.variable_dtype_map()
    assert var_dtypes["token_embedding/embeddings"] == "float16"
    weight_bytes = sum(int(np.prod(v.shape)) * np.dtype(v.dtype).itemsize
                       for v in half.weights)
    assert weight_bytes <= 0.52 * 4 * model.count_params()
    # The original is untouched: float32 variables, its own policies.
    assert all(v.dtype == "float32" for v in model.weights
               if "float" in v.dtype)
    assert isinstance(model.get_layer("token_embedding").dtype_policy,
                      Policy)
    out = keras.tree.flatten(half.predict(sample, verbose=0))
    assert _max_diff(ref, out) <= 2e-2


@pytest.mark.parametrize("name", ["gpt2", "bert"])
@pytest.mark.parametrize("fmt,filename", HUB_FORMATS)
def test_keras_hub_export(hub, tmp_path, name, fmt, filename):
    model, ref, sample = hub(name)
    path = str(tmp_path / filename)
    report = kx.export(model, path, format=fmt, sample=sample)
    assert report.size_ratio <= 0.55
    assert report.bytes == artifact_size(path)
    assert np.isfinite(report.max_abs_diff) and report.max_abs_diff <= 2e-2
    assert report.num_samples == N
    # Independent check against the float32 model.
    assert _max_diff(ref, _run(fmt, path, sample)) <= 2e-2
    assert os.listdir(tmp_path) == [filename]


# --------------------------------------------------------------------------
# The layer-order repro (no keras-hub) and a broken config round trip
# --------------------------------------------------------------------------


@keras.saving.register_keras_serializable(package="kerasmp_test")
class Backbone(keras.Model):
    """Creates `norm` before `proj` but calls `proj` first (as keras-hub)."""

    def __init__(self, units=8, **kwargs):
        self.norm = keras.layers.LayerNormalization(name="norm")
        self.proj = keras.layers.Dense(units, name="proj")
        inp = keras.Input((4,), name="x")
        out = self.norm(self.proj(inp))
        super().__init__(inp, out, **kwargs)
        self.units = units

    def get_config(self):
        return {"units": self.units, "name": self.name}


@keras.saving.register_keras_serializable(package="kerasmp_test")
class Unrebuildable(keras.Model):
    """A Functional subclass whose from_config cannot rebuild it."""

    def __init__(self, table, **kwargs):
        inp = keras.Input((4,), name="x")
        h = keras.layers.Dense(len(table), name="proj")(inp)
        out = keras.layers.LayerNormalization(name="norm")(h)
        super().__init__(inp, out, **kwargs)
        self.table = table

    def get_config(self):
        return {"name": self.name}  # `table` missing: from_config fails


def _pair(cls, *args):
    with policy_scope(Policy("mixed_float16")):
        model = cls(*args)
    with policy_scope("float32"):
        ref = cls(*args)
    ref.set_weights(model.get_weights())
    x = np.random.default_rng(0).standard_normal((32, 4)).astype("float32")
    return model, ref.predict(x, verbose=0), x


@pytest.mark.parametrize("kind", ["layer_order", "broken_config"])
def test_to_float16_without_rebuild(kind):
    model, ref, x = (_pair(Backbone) if kind == "layer_order"
                     else _pair(Unrebuildable, list(range(8))))
    half = kx.to_float16(model)
    assert half.layer_compute_dtypes() == {
        "norm": "float32", "proj": "float16"}
    assert half.variable_dtype_map() == {
        "norm/gamma": "float32", "norm/beta": "float32",
        "proj/kernel": "float16", "proj/bias": "float16"}
    assert set(half.kept_float32) == {"norm"}
    np.testing.assert_allclose(half.predict(x, verbose=0), ref, atol=1e-2)


def test_layer_order_keras_leaves_proj_at_the_default(tmp_path):
    # Its __init__ creates `proj` with dtype=None: a plain Keras file cannot
    # give it float16 (stock Keras gives it the global policy at load). The
    # .keras export leaves it there (float32) since the file passes parity
    # so, and says which layer and what it costs (issue 27; it refused the
    # model before).
    model, ref, x = _pair(Backbone)
    path = str(tmp_path / "m.keras")
    with pytest.warns(UserWarning, match="proj"):
        report = kx.export(model, path, format="keras", sample=x)
    left = report.left_at_default
    assert len(left) == 1 and next(iter(left)).endswith("proj"), left
    entry = next(iter(left.values()))
    assert (entry["weights_dtype"], entry["wanted"]) == ("float32",
                                                         "float16")
    assert entry["extra_bytes"] == 2 * (4 * 8 + 8)
    loaded = keras.saving.load_model(path, compile=False)
    np.testing.assert_allclose(loaded.predict(x, verbose=0), ref, atol=1e-2)


def test_broken_config_keras_fails_cleanly(tmp_path):
    model, _, x = _pair(Unrebuildable, list(range(8)))
    with pytest.raises(ValueError, match=r"(?s)does not rebuild.*savedmodel"):
        kx.export(model, str(tmp_path / "m.keras"), format="keras", sample=x)
    assert os.listdir(tmp_path) == []


@pytest.mark.tensorflow
@pytest.mark.parametrize("fmt,filename", HUB_FORMATS[1:3])
def test_broken_config_exports(tmp_path, fmt, filename):
    model, ref, x = _pair(Unrebuildable, list(range(8)))
    path = str(tmp_path / filename)
    report = kx.export(model, path, format=fmt, sample=x)
    assert report.max_abs_diff <= 1e-2
    out = _run(fmt, path, {"x": x})[0]
    np.testing.assert_allclose(out, ref, atol=1e-2)
