"""The `.keras` export never crashes and covers every family `model.save`
handles (issue 26), and a float32 `.keras` is a plain Keras model (issue 27).

- A layer without its own `get_config` (Keras's automatic one takes plain
  `__init__` arguments only) gets a plain dtype policy, not a policy map,
  so the file is written (it crashed in the writer: keras-hub Gemma3's
  `RMSNormalization` in a Functional model).
- A sublayer that stock policies cannot reach (its parent creates it
  without passing its dtype policy) is left at the loader's default: the
  file is written when it loads and passes parity so, and the report says
  which layers and what they cost; otherwise one sentence naming the layer
  and the formats that work, and nothing written.

References: the same model built in float32 with the master weights, run
here, and the files read back by stock `keras.saving.load_model` in a
process where kerasmp cannot be imported.
"""

import json
import os
import subprocess
import sys

import keras
import numpy as np
import pytest
from _helpers import BLOCK_KERASMP
from _helpers import keras_hub_or_skip
from _helpers import slow_on
from _helpers import subprocess_env
from keras import layers
from keras import ops

from kerasmp import export as kx
from kerasmp.policy import Policy
from kerasmp.policy import policy_scope

BACKEND = keras.backend.backend()


@keras.saving.register_keras_serializable(package="kerasmp_test")
class Scale(layers.Layer):
    """No `get_config`: Keras writes one from the `__init__` arguments, as
    long as they are plain values (a policy map is not)."""

    def __init__(self, factor=2.0, **kwargs):
        super().__init__(**kwargs)
        self.factor = factor

    def call(self, x):
        return x * self.factor


@keras.saving.register_keras_serializable(package="kerasmp_test")
class NormBlock(layers.Layer):
    """No `get_config`; creates a LayerNormalization with its own policy
    (kerasmp keeps it float32: a policy map would reach it)."""

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.norm = layers.LayerNormalization(dtype=self.dtype_policy,
                                              name="norm")

    def build(self, input_shape):
        self.norm.build(input_shape)

    def call(self, x):
        return self.norm(x)


@keras.saving.register_keras_serializable(package="kerasmp_test")
class Unreached(layers.Layer):
    """Creates its Dense without passing its dtype policy (as keras-hub's
    Qwen3-MoE and SmolLM3 blocks): at load it gets the global policy."""

    def __init__(self, units=16, add_input=False, **kwargs):
        super().__init__(**kwargs)
        self.units = units
        self.add_input = add_input
        self.inner = layers.Dense(units, name="inner")

    def build(self, input_shape):
        self.inner.build(input_shape)

    def call(self, x):
        y = self.inner(x)
        # `x + y` on backend tensors: TensorFlow refuses float16 + float32
        # (JAX and PyTorch promote; Keras's `ops.add` promotes everywhere).
        return x + y if self.add_input else y

    def get_config(self):
        return {**super().get_config(), "units": self.units,
                "add_input": self.add_input}


def _functional(middle):
    inputs = keras.Input((16,), name="x")
    h = layers.Dense(16, name="d1")(inputs)
    h = middle(h)
    return keras.Model(inputs, layers.Dense(4, name="out")(h), name="m")


def _pair(make):
    """`(mixed_float16 model, float32 reference, inputs)`, same weights."""
    with policy_scope(Policy("mixed_float16")):
        model = _functional(make())
    with policy_scope("float32"):
        ref = _functional(make())
    rng = np.random.default_rng(0)
    ref.set_weights([rng.normal(0, 0.3, w.shape).astype("float32")
                     for w in ref.get_weights()])
    model.set_weights(ref.get_weights())
    x = rng.uniform(0, 1, (64, 16)).astype("float32")
    return model, ref, x


def _load_and_run(path, x):
    loaded = keras.saving.load_model(path, compile=False)
    return loaded, keras.ops.convert_to_numpy(loaded(x)).astype("float64")


def _rel(got, want):
    return np.max(np.abs(got - want)) / np.ptp(want)


def test_a_layer_without_get_config_in_a_functional_is_written(tmp_path):
    # Before: NotImplementedError "Object Scale was created by passing
    # non-serializable argument values" from the writer (a DTypePolicyMap
    # passed to Scale's __init__), though `model.save` works.
    model, ref, x = _pair(lambda: Scale(name="scale"))
    model.save(tmp_path / "plain_save.keras")  # stock save works
    path = str(tmp_path / "m16.keras")
    report = kx.export(model, path, format="keras", sample=x)
    loaded, got = _load_and_run(path, x)
    assert loaded.get_layer("scale").compute_dtype == "float16"
    assert loaded.get_layer("d1").get_weights()[0].dtype == np.float16
    assert _rel(got, ref.predict(x, verbose=0)) <= 2e-2
    assert report.left_at_default == {}


def test_a_layer_that_cannot_take_a_policy_map_gets_a_plain_one(tmp_path):
    # NormBlock's float32 LayerNormalization needs a map (the block is
    # float16), which NormBlock's automatic config cannot store: the block
    # gets a plain float16 policy, its LayerNormalization is left at it,
    # and the file is written since it passes parity so.
    model, ref, x = _pair(lambda: NormBlock(name="block"))
    path = str(tmp_path / "m16.keras")
    with pytest.warns(UserWarning, match="cannot reach 1 layer") as caught:
        report = kx.export(model, path, format="keras", sample=x)
    said = [w for w in caught if "kerasmp" in str(w.message)]
    assert len(said) == 1 and said[0].filename == __file__
    assert list(report.left_at_default) == ["block/norm"]
    entry = report.left_at_default["block/norm"]
    assert (entry["compute_dtype"], entry["wanted"]) == ("float16", "float32")
    assert entry["extra_bytes"] == -2 * 2 * 16  # gamma and beta in float16
    loaded, got = _load_and_run(path, x)
    assert _rel(got, ref.predict(x, verbose=0)) <= 2e-2


def test_an_unreached_sublayer_is_left_at_the_default_and_reported(
        tmp_path):
    # The small version of Qwen3-MoE / SmolLM3: `inner` gets the loader's
    # global policy (float32). Written, loads without kerasmp on both
    # backends, parity with float32, the cost in bytes said.
    model, ref, x = _pair(lambda: Unreached(name="block"))
    path = str(tmp_path / "m16.keras")
    with pytest.warns(UserWarning, match="block/inner"):
        report = kx.export(model, path, format="keras", sample=x)
    entry = report.left_at_default["block/inner"]
    assert entry["weights_dtype"] == "float32" and entry["wanted"] == (
        "float16")
    assert entry["extra_bytes"] == 2 * (16 * 16 + 16)
    assert report.left_at_default_bytes == entry["extra_bytes"]
    text = str(report)
    assert "left at default" in text and "block/inner" in text
    assert "+544 B" in text
    _, got = _load_and_run(path, x)
    assert _rel(got, ref.predict(x, verbose=0)) <= 2e-2


@pytest.mark.tensorflow
def test_an_unreached_sublayer_that_breaks_the_parent_is_refused(tmp_path):
    # `inner` computes in float32 at the default and its parent adds its
    # output to a float16 tensor with `+`: TensorFlow refuses. One
    # sentence naming the layer and the formats that work; nothing written.
    model, _, x = _pair(lambda: Unreached(add_input=True, name="block"))
    path = str(tmp_path / "m16.keras")
    with pytest.raises(kx.NotExpressible) as info:
        kx.export(model, path, format="keras", sample=x)
    message = str(info.value)
    assert "'block/inner' (Dense)" in message and "\n" not in message
    assert "'savedmodel', 'tflite' or 'onnx' instead" in message
    assert os.listdir(tmp_path) == []


@keras.saving.register_keras_serializable(package="kerasmp_test")
class NaiveRMSNorm(layers.Layer):
    """`x / sqrt(mean(x**2))` in the compute dtype: overflows float16 for
    |x| > 256 (as keras-hub's T5LayerNorm); kerasmp keeps it float32 by
    name."""

    def call(self, x):
        return x * ops.rsqrt(ops.mean(ops.square(x), -1, keepdims=True)
                             + 1e-6)


@keras.saving.register_keras_serializable(package="kerasmp_test")
class NaiveNormBlock(NormBlock):
    def __init__(self, **kwargs):
        layers.Layer.__init__(self, **kwargs)
        self.norm = NaiveRMSNorm(dtype=self.dtype_policy, name="norm")


def test_a_layer_left_at_a_default_that_fails_parity_is_refused(tmp_path):
    # The block needs a map for its float32 norm and cannot store one, so
    # the norm is left at float16, where it overflows on these inputs.
    model, _, x = _pair(lambda: NaiveNormBlock(name="block"))
    x = x * 300
    path = str(tmp_path / "m16.keras")
    with pytest.raises(kx.NotExpressible) as info:
        kx.export(model, path, format="keras", sample=x)
    message = str(info.value)
    assert "'block/norm'" in message and "fail parity" in message
    assert "\n" not in message and os.listdir(tmp_path) == []
    # The other formats keep the norm in float32 and pass.
    if BACKEND == "tensorflow":
        report = kx.export(model, str(tmp_path / "sm"), sample=x)
        assert report.passed() and "block/norm" in report.kept_float32


LOAD_PLAIN = BLOCK_KERASMP + """
import keras, numpy as np
model = keras.saving.load_model(sys.argv[1], compile=False)
y = keras.ops.convert_to_numpy(model(np.load(sys.argv[2]))).astype("float64")
config = open(sys.argv[1], "rb").read()
print("RESULT " + json.dumps({"y": y.tolist(), "class": type(model).__name__,
      "dtypes": sorted({str(w.dtype) for w in model.weights})}))
"""


def _run_plain(path, x_path, backend):
    proc = subprocess.run(
        [sys.executable, "-c", LOAD_PLAIN, str(path), str(x_path)],
        capture_output=True, text=True, env=subprocess_env(backend),
        timeout=300)
    lines = [l for l in proc.stdout.splitlines() if l.startswith("RESULT ")]
    assert proc.returncode == 0 and lines, proc.stderr[-3000:]
    return json.loads(lines[-1][len("RESULT "):])


def _mlp_pair():
    def build():
        return keras.Sequential([
            keras.Input((8,), name="x"), layers.Dense(16, name="d1"),
            layers.LayerNormalization(name="ln"),
            layers.Dense(3, activation="softmax", name="head")], name="mlp")

    with policy_scope(Policy("mixed_float16")):
        model = build()
    with policy_scope("float32"):
        ref = build()
    ref.set_weights(model.get_weights())
    return model, ref


@pytest.mark.parametrize("backend", ["tensorflow", "jax"])
def test_a_float32_keras_export_is_plain_keras(tmp_path, backend):
    # Issue 27 item 2: it was a `kerasmp>HalfModel` ("Could not locate
    # class 'HalfModel'" without kerasmp).
    model, ref = _mlp_pair()
    path = tmp_path / "f32.keras"
    report = kx.export(model, str(path), format="keras", dtype="float32")
    assert report.weight_ratio == 1.0 and report.kept_float32 == {}
    import zipfile

    with zipfile.ZipFile(path) as z:
        assert b"kerasmp" not in z.read("config.json")
    x = np.random.default_rng(0).uniform(0, 1, (16, 8)).astype("float32")
    np.save(tmp_path / "x.npy", x)
    out = _run_plain(path, tmp_path / "x.npy", backend)
    assert out["class"] == "Sequential" and out["dtypes"] == ["float32"]
    np.testing.assert_allclose(out["y"], ref.predict(x, verbose=0),
                               rtol=0, atol=1e-6)


def test_the_command_writes_a_plain_float32_keras(tmp_path, capsys):
    from kerasmp.apps import cli

    model, _ = _mlp_pair()
    model.save(tmp_path / "m.keras")
    out = tmp_path / "f32.keras"
    assert cli.main(["export", str(tmp_path / "m.keras"), str(out),
                     "--format", "keras", "--dtype", "float32"]) == 0
    loaded = keras.saving.load_model(out, compile=False)
    assert type(loaded) is keras.Sequential
    assert {str(w.dtype) for w in loaded.weights} == {"float32"}


def test_files_written_by_0_1_0_still_load_with_kerasmp():
    from pathlib import Path

    path = (Path(__file__).resolve().parents[1] / "fixtures"
            / "saved_by_0.1.0" / "halfmodel_float32.keras")
    loaded = keras.saving.load_model(path, compile=False)
    assert type(loaded).__name__ == "HalfModel"


# --------------------------------------------------------------------------
# keras-hub families, from their backbone tests' tiny configs
# --------------------------------------------------------------------------


def _hub(family):
    keras_hub = keras_hub_or_skip()
    ones = {"token_ids": np.ones((2, 7), "int32"),
            "padding_mask": np.ones((2, 7), "int32")}
    if family == "gemma3":
        backbone = keras_hub.models.Gemma3Backbone(
            vocabulary_size=256, image_size=16, num_layers=2,
            num_query_heads=2, num_key_value_heads=1, hidden_dim=8,
            intermediate_dim=16, head_dim=4, query_head_dim_normalize=True,
            use_query_key_norm=True, use_post_ffw_norm=True,
            use_post_attention_norm=True, final_logit_soft_cap=None,
            attention_logit_soft_cap=None, use_sliding_window_attention=True,
            sliding_window_size=1024)
        # `model.save` writes this; the export crashed in the writer
        # ("Object RMSNormalization was created by passing non-serializable
        # argument values").
        model = keras.Model(backbone.input, backbone.output)
        rng = np.random.default_rng(0)
        return model, {"token_ids": rng.integers(0, 256, (4, 8)).astype(
            "int32"), "padding_mask": np.ones((4, 8), "int32")}
    if family == "qwen3_moe":
        model = keras_hub.models.Qwen3MoeBackbone(
            vocabulary_size=20, num_layers=2, num_query_heads=4,
            num_key_value_heads=2, hidden_dim=16, intermediate_dim=32,
            head_dim=2, moe_intermediate_dim=16, num_experts=4, top_k=2,
            norm_top_k_prob=True, decoder_sparse_step=1,
            layer_norm_epsilon=1e-6, rope_max_wavelength=10000,
            rope_scaling_factor=1.0, dropout=0.0, sliding_window_size=4096,
            router_aux_loss_coefficient=0.01, tie_word_embeddings=False,
            mlp_only_layers=[])  # the test's "dtype": "float32" pin dropped
        return model, ones
    if family == "smollm3":
        model = keras_hub.models.SmolLM3Backbone(
            vocabulary_size=100, hidden_dim=64, intermediate_dim=128,
            num_layers=2, num_attention_heads=4, num_key_value_heads=2,
            attention_bias=False, attention_dropout=0.0,
            rope_layer_enabled_list=[True, True],
            layer_types=["attention", "attention"], mlp_bias=False,
            layer_norm_epsilon=1e-5, max_position_embeddings=128,
            rope_theta=10000.0, partial_rotary_factor=1.0)
        return model, {k: v[:, :5] for k, v in ones.items()}
    model = keras_hub.models.RWKV7Backbone(
        vocabulary_size=10, hidden_size=16, num_layers=2, head_size=4,
        intermediate_dim=32, gate_lora=32, mv_lora=16, aaa_lora=16,
        decay_lora=16)
    return model, {k: np.ones((2, 16), "int32") for k in ones}


HUB_LOAD = BLOCK_KERASMP + """
import keras, keras_hub, numpy as np
model = keras.saving.load_model(sys.argv[1], compile=False)
d = np.load(sys.argv[2])
y = model({k: d[k] for k in d.files}, training=False)
y = keras.ops.convert_to_numpy(y).astype("float64")
print("RESULT " + json.dumps({"y": y.tolist()}))
"""


@slow_on("jax", "tensorflow")  # 20-60 s each: two rebuilds per dtype
@pytest.mark.parametrize("family", ["gemma3", "qwen3_moe", "smollm3",
                                    "rwkv7"])
def test_keras_hub_families_export_to_plain_keras(tmp_path, family):
    other = "jax" if BACKEND == "tensorflow" else "tensorflow"
    keras.utils.set_random_seed(0)
    with policy_scope(Policy("mixed_float16")):
        model, sample = _hub(family)
    with policy_scope("float32"):
        keras.utils.set_random_seed(0)
        ref, _ = _hub(family)
    ref.set_weights(model.get_weights())
    want = keras.ops.convert_to_numpy(ref(sample, training=False))
    path = tmp_path / f"{family}.keras"
    report = kx.export(model, str(path), format="keras", sample=sample)
    assert report.passed()
    if family in ("smollm3", "rwkv7"):  # created without the parent's dtype
        assert report.left_at_default, report
    np.savez(tmp_path / "x.npz", **sample)
    got = np.asarray(_run_plain_hub(path, tmp_path / "x.npz", other))
    assert _rel(got, want.astype("float64")) <= 2e-2


def _run_plain_hub(path, x_path, backend):
    proc = subprocess.run(
        [sys.executable, "-c", HUB_LOAD, str(path), str(x_path)],
        capture_output=True, text=True, env=subprocess_env(backend),
        timeout=300)
    lines = [l for l in proc.stdout.splitlines() if l.startswith("RESULT ")]
    assert proc.returncode == 0 and lines, proc.stderr[-3000:]
    return json.loads(lines[-1][len("RESULT "):])["y"]


ESM_LOAD = BLOCK_KERASMP + """
import keras, keras_hub, numpy as np
# Other ESM layers first: the loader's own counters then name the file's
# rotary embeddings `esm_rotary_embedding_2`, `_3`, not as the writer did.
keras_hub.models.ESMBackbone(**json.loads(sys.argv[3]))
model = keras.saving.load_model(sys.argv[1], compile=False)
y = model.predict({"token_ids": np.load(sys.argv[2])}, verbose=0)
print("RESULT " + json.dumps({"y": y.astype("float64").tolist()}))
"""


@pytest.mark.tensorflow
def test_a_measured_layer_with_a_made_up_name_stays_float32_in_a_keras(
        tmp_path):
    # keras-hub ESM's rotary embedding: created by its attention layer
    # without a name (Keras names it `esm_rotary_embedding_<counter>`),
    # moved to float32 by kerasmp's measurement (a float16 `range` of
    # known length, refused by TensorFlow in a compiled predict). A policy
    # map keyed by that made-up path missed it in a new process, and the
    # file's predict failed there; reached through its parent's map
    # default, it is float32 whatever the loader's counters.
    keras_hub = keras_hub_or_skip()
    config = dict(vocabulary_size=10, num_layers=2, num_heads=1,
                  hidden_dim=4, intermediate_dim=8)
    keras.utils.set_random_seed(0)
    with policy_scope(Policy("mixed_float16")):
        model = keras_hub.models.ESMBackbone(**config)
    with policy_scope("float32"):
        ref = keras_hub.models.ESMBackbone(**config)
    ref.set_weights(model.get_weights())
    ids = np.random.default_rng(0).integers(0, 10, (4, 6)).astype("int32")
    path = tmp_path / "esm.keras"
    report = kx.export(model, str(path), format="keras",
                       sample={"token_ids": ids}, gate=True)
    assert any("rotary" in p and why == "fails in float16"
               for p, why in report.kept_float32.items()), report
    np.save(tmp_path / "ids.npy", ids)
    proc = subprocess.run(
        [sys.executable, "-c", ESM_LOAD, str(path), str(tmp_path / "ids.npy"),
         json.dumps(config)], capture_output=True, text=True,
        env=subprocess_env("tensorflow"), timeout=300)
    lines = [l for l in proc.stdout.splitlines() if l.startswith("RESULT ")]
    assert proc.returncode == 0 and lines, proc.stderr[-3000:]
    got = np.asarray(json.loads(lines[-1][len("RESULT "):])["y"])
    want = keras.ops.convert_to_numpy(ref({"token_ids": ids}))
    assert _rel(got, want.astype("float64")) <= 2e-2
