"""kerasmp.Policy: per-layer float32 overrides, global use, save/load."""

import json
import os
import re
import subprocess
import sys

import keras
import numpy as np
import pytest

import kerasmp
from kerasmp.optimizer import LossScaleOptimizer


def _big_softmax_input(n=2, features=16, seed=0):
    return np.random.default_rng(seed).normal(size=(n, features)).astype(
        "float32"
    )


@pytest.mark.parametrize("activation_layer", ["layer", "dense_activation"])
def test_100k_class_softmax_sums_to_one_only_with_kerasmp(activation_layer):
    # float16 softmax over 100,000 classes: sum(exp(x - max)) > 65504 = inf,
    # so every probability is 0. The analytic reference is a sum of 1.
    def build():
        if activation_layer == "layer":
            layers = [keras.layers.Dense(100_000), keras.layers.Softmax()]
        else:
            layers = [keras.layers.Dense(100_000, activation="softmax")]
        return keras.Sequential([keras.Input((16,))] + layers)

    x = _big_softmax_input()
    keras.config.set_dtype_policy("mixed_float16")  # stock Keras
    stock = build()
    stock_sums = np.asarray(stock(x), dtype="float64").sum(-1)
    assert not np.allclose(stock_sums, 1.0, rtol=1e-3)

    kerasmp.set_global_policy(kerasmp.Policy("mixed_float16"))
    model = build()
    model.set_weights(stock.get_weights())
    sums = np.asarray(model(x), dtype="float64").sum(-1)
    np.testing.assert_allclose(sums, 1.0, rtol=1e-3)


@keras.saving.register_keras_serializable(package="kerasmp_tests")
class TransformerBlock(keras.layers.Layer):
    """Subclassed layer whose sublayers are built in __init__.

    Like Keras's own composite layers (MultiHeadAttention), it hands its
    policy to its sublayers, so that a saved model reloads with the same
    dtypes whatever the global policy is at load time.
    """

    def __init__(self, dim=8, heads=2, **kwargs):
        super().__init__(**kwargs)
        self.dim, self.heads = dim, heads
        dtype = self.dtype_policy
        self.attention = keras.layers.MultiHeadAttention(
            heads, dim // heads, dropout=0.1, dtype=dtype)
        self.norm = keras.layers.LayerNormalization(dtype=dtype)
        self.ffn = keras.layers.Dense(dim, activation="gelu", dtype=dtype)

    def call(self, x):
        # Pre-LN block. Overridden layers output float32; the layers after
        # them cast their inputs back to float16 themselves.
        h = self.norm(x)
        x = x + self.attention(h, h)
        return x + self.ffn(x)

    def get_config(self):
        return {**super().get_config(), "dim": self.dim, "heads": self.heads}


@keras.saving.register_keras_serializable(package="kerasmp_tests")
class PlainBlock(keras.layers.Layer):
    """Subclassed layer whose sublayers take the global policy (dtype=None),
    as most user code writes them."""

    def __init__(self, dim=8, **kwargs):
        super().__init__(**kwargs)
        self.dim = dim
        self.attention = keras.layers.MultiHeadAttention(2, dim // 2,
                                                         dropout=0.1)
        self.norm = keras.layers.LayerNormalization()
        self.ffn = keras.layers.Dense(dim, activation="gelu")

    def call(self, x):
        h = self.norm(x)
        x = x + self.attention(h, h)
        return x + self.ffn(x)

    def get_config(self):
        return {**super().get_config(), "dim": self.dim}


def _block_model(block_cls=TransformerBlock):
    inputs = keras.Input((5, 8))
    x = block_cls(name="block")(inputs)
    x = keras.layers.GlobalAveragePooling1D()(x)
    x = keras.layers.Dense(3, name="head")(x)
    outputs = keras.layers.Activation("softmax", name="probs")(x)
    return keras.Model(inputs, outputs)


def test_nested_layers_get_overrides():
    kerasmp.set_global_policy(kerasmp.Policy("mixed_float16"))
    model = _block_model()
    block = model.get_layer("block")
    # The Softmax inside MultiHeadAttention gets the parent's policy object
    # (dtype=self.dtype_policy), not dtype=None: the rule must still apply.
    assert block.attention._softmax.compute_dtype == "float32"
    assert block.norm.compute_dtype == "float32"
    assert block.ffn.compute_dtype == "float16"
    assert block.attention._query_dense.compute_dtype == "float16"
    assert model.get_layer("head").compute_dtype == "float16"
    assert model.get_layer("probs").compute_dtype == "float32"
    # Variables stay float32 masters everywhere.
    assert {v.dtype for v in model.weights} == {"float32"}
    # Outputs follow: the model output comes from a float32 softmax.
    y = model(np.zeros((2, 5, 8), "float32"))
    assert keras.backend.standardize_dtype(y.dtype) == "float32"


def test_name_patterns_and_classes_and_explicit_dtype_wins():
    policy = kerasmp.Policy(
        "mixed_bfloat16", float32_layers=[keras.layers.Conv2D, r"logits.*"]
    )
    with kerasmp.policy_scope(policy):
        conv = keras.layers.Conv2D(2, 3)
        logits = keras.layers.Dense(2, name="logits_out")
        other = keras.layers.Dense(2, name="hidden")
        explicit = keras.layers.Conv2D(2, 3, dtype="mixed_bfloat16")
        # Softmax is not in this policy's list.
        softmax = keras.layers.Softmax()
    assert conv.compute_dtype == "float32"
    assert logits.compute_dtype == "float32"
    assert other.compute_dtype == "bfloat16"
    assert explicit.compute_dtype == "bfloat16"
    assert softmax.compute_dtype == "bfloat16"
    assert kerasmp.global_policy().name == "float32"  # scope restored


def test_default_rules_cover_normalization_and_softmax_activations():
    with kerasmp.policy_scope("mixed_float16"):
        layers = {
            "bn": keras.layers.BatchNormalization(),
            "ln": keras.layers.LayerNormalization(),
            "gn": keras.layers.GroupNormalization(groups=1),
            "un": keras.layers.UnitNormalization(),
            "norm": keras.layers.Normalization(),
            "logsm": keras.layers.Activation("log_softmax"),
            "relu": keras.layers.Activation("relu"),
            "conv": keras.layers.Conv1D(2, 3),
        }
    expected = {k: "float32" for k in layers}
    expected.update(relu="float16", conv="float16")
    assert {k: v.compute_dtype for k, v in layers.items()} == expected


def test_sublayers_built_in_init_with_dtype_none():
    class Block(keras.layers.Layer):
        def __init__(self, **kwargs):
            super().__init__(**kwargs)
            self.dense = keras.layers.Dense(4)
            self.norm = keras.layers.LayerNormalization()

        def call(self, x):
            return self.norm(self.dense(x))

    kerasmp.set_global_policy("mixed_float16")
    block = Block()
    assert block.dense.compute_dtype == "float16"
    assert block.norm.compute_dtype == "float32"


def test_functional_sequential_and_subclassed_models():
    class Net(keras.Model):
        def __init__(self):
            super().__init__()
            self.dense = keras.layers.Dense(4)
            self.norm = keras.layers.BatchNormalization()

        def call(self, x):
            return self.norm(self.dense(x))

    kerasmp.set_global_policy("mixed_float16")
    seq = keras.Sequential([keras.Input((3,)), keras.layers.Dense(4),
                            keras.layers.BatchNormalization()])
    net = Net()
    net(np.zeros((1, 3), "float32"))
    for model in (seq, net):
        dtypes = [l.compute_dtype for l in model._flatten_layers(
            include_self=False) if not isinstance(l, keras.layers.InputLayer)]
        assert dtypes == ["float16", "float32"]


def test_bad_input_names_the_argument():
    with pytest.raises(ValueError, match=r"`name`.*mixed_float16"):
        kerasmp.Policy("mixed_float8")
    with pytest.raises(ValueError, match=r"`float32_layers`.*regular"):
        kerasmp.Policy(float32_layers=["dense(["])
    with pytest.raises(TypeError, match=r"`float32_layers`.*Layer subclass"):
        kerasmp.Policy(float32_layers=[keras.optimizers.Adam])
    with pytest.raises(TypeError, match=r"`float32_layers`.*Layer subclass"):
        kerasmp.Policy(float32_layers=[42])
    with pytest.raises(TypeError, match=r"`float32_layers` must be a "
                       "sequence"):
        kerasmp.Policy(float32_layers=keras.layers.Softmax)
    with pytest.raises(TypeError, match=r"`policy`"):
        kerasmp.set_global_policy(16)


def test_policy_config_round_trip():
    policy = kerasmp.Policy(
        "mixed_bfloat16",
        float32_layers=[TransformerBlock, keras.layers.Softmax, "head.*"],
    )
    config = json.loads(json.dumps(keras.saving.serialize_keras_object(
        policy)))
    restored = keras.saving.deserialize_keras_object(config)
    assert isinstance(restored, kerasmp.Policy)
    assert restored == policy
    assert restored.float32_layers[0] is TransformerBlock
    assert restored.float32_layers[2].pattern == "head.*"
    assert restored != kerasmp.Policy("mixed_bfloat16")
    assert isinstance(policy, keras.DTypePolicy)
    assert (policy.compute_dtype, policy.variable_dtype) == (
        "bfloat16", "float32")


_LOAD_SCRIPT = """
import json, sys
import numpy as np
import keras
import kerasmp  # registers kerasmp.Policy; no custom_objects below
sys.path.insert(0, {tests_dir!r})
import test_policy  # registers the test's TransformerBlock
model = keras.models.load_model({path!r})
dtypes = {{l.path or l.name: l.compute_dtype
          for l in model._flatten_layers(include_self=False)
          if not isinstance(l, keras.layers.InputLayer)}}
preds = model.predict(np.load({x_path!r}), verbose=0)
print(json.dumps({{"dtypes": dtypes, "preds": preds.tolist()}}))
"""


@pytest.mark.slow
@pytest.mark.parametrize("block_cls", [TransformerBlock, PlainBlock])
def test_save_and_load_in_fresh_process(tmp_path, block_cls):
    # The loading process's global policy is float32: the saved policies,
    # not the global one, must decide every layer's dtype, also for the
    # sublayers PlainBlock creates with dtype=None.
    kerasmp.set_global_policy(kerasmp.Policy("mixed_float16"))
    model = _block_model(block_cls)
    x = np.random.default_rng(1).normal(size=(4, 5, 8)).astype("float32")
    preds = model.predict(x, verbose=0)
    dtypes = {l.path or l.name: l.compute_dtype
              for l in model._flatten_layers(include_self=False)
              if not isinstance(l, keras.layers.InputLayer)}
    path = str(tmp_path / "model.keras")
    model.save(path)
    x_path = str(tmp_path / "x.npy")
    np.save(x_path, x)
    keras.config.set_dtype_policy("float32")

    script = _LOAD_SCRIPT.format(
        tests_dir=os.path.dirname(__file__), path=path, x_path=x_path)
    out = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True,
        env={**os.environ, "TF_CPP_MIN_LOG_LEVEL": "3"},
    )
    assert out.returncode == 0, out.stderr[-3000:]
    loaded = json.loads(out.stdout.strip().splitlines()[-1])
    assert loaded["dtypes"] == dtypes
    assert "float32" in loaded["dtypes"].values()
    assert "float16" in loaded["dtypes"].values()
    np.testing.assert_allclose(np.asarray(loaded["preds"]), preds, atol=1e-6)


def _compile(model, optimizer="adam", **kwargs):
    model.compile(optimizer=optimizer, loss="mse", **kwargs)
    return model.optimizer


def _mlp():
    return keras.Sequential([keras.Input((4,)), keras.layers.Dense(3),
                             keras.layers.Dense(2)])


def test_compile_wraps_float16_once():
    kerasmp.set_global_policy(kerasmp.Policy("mixed_float16"))
    model = _mlp()
    opt = _compile(model, keras.optimizers.SGD(0.1))
    assert type(opt) is LossScaleOptimizer
    assert type(opt.inner_optimizer) is keras.optimizers.SGD
    # Compiling again with the wrapped optimizer does not wrap it twice.
    opt2 = _compile(model, model.optimizer)
    assert opt2 is opt
    assert not isinstance(opt2.inner_optimizer,
                          keras.optimizers.LossScaleOptimizer)
    # A string optimizer is wrapped too, once.
    opt3 = _compile(model, "adam")
    assert type(opt3) is LossScaleOptimizer
    assert type(opt3.inner_optimizer) is keras.optimizers.Adam


def test_compile_respects_user_choices_and_other_dtypes():
    kerasmp.set_global_policy(kerasmp.Policy("mixed_bfloat16"))
    assert type(_compile(_mlp())) is keras.optimizers.Adam

    kerasmp.set_global_policy(kerasmp.Policy("mixed_float16"))
    stock = keras.optimizers.LossScaleOptimizer(keras.optimizers.SGD())
    assert _compile(_mlp(), stock) is stock
    assert type(_compile(_mlp(), auto_scale_loss=False)) is (
        keras.optimizers.Adam)

    # A float16 policy whose every trainable layer is overridden to float32.
    kerasmp.set_global_policy(
        kerasmp.Policy("mixed_float16", float32_layers=[keras.layers.Dense]))
    assert type(_compile(_mlp())) is keras.optimizers.Adam

    kerasmp.set_global_policy("float32")
    assert type(_compile(_mlp())) is keras.optimizers.Adam

    # Code that does not use kerasmp policies keeps stock Keras behaviour.
    keras.config.set_dtype_policy("mixed_float16")
    opt = _compile(_mlp())
    assert type(opt) is keras.optimizers.LossScaleOptimizer


def test_compile_wraps_unbuilt_subclassed_model():
    class Net(keras.Model):
        def __init__(self):
            super().__init__()
            self.dense = keras.layers.Dense(2)

        def call(self, x):
            return self.dense(x)

    kerasmp.set_global_policy("mixed_float16")
    assert type(_compile(Net())) is LossScaleOptimizer


def test_dtype_report_rows_and_reasons():
    kerasmp.set_global_policy("mixed_float16")
    inputs = keras.Input((4,))
    x = keras.layers.Dense(3, name="hidden")(inputs)
    x = keras.layers.Dense(3, name="pinned", dtype="float32")(x)
    x = keras.layers.LayerNormalization(name="norm")(x)
    model = keras.Model(inputs, keras.layers.Softmax(name="probs")(x))
    report = kerasmp.dtype_report(model)
    rows = {r.path.split("/")[-1]: r for r in report}
    assert set(rows) == {"hidden", "pinned", "norm", "probs"}
    assert (rows["hidden"].compute_dtype, rows["hidden"].variable_dtype,
            rows["hidden"].reason) == ("float16", "float32", "global policy")
    assert rows["pinned"].reason == "explicit dtype"
    assert rows["norm"].reason == "kerasmp override (LayerNormalization)"
    assert rows["probs"].reason == "kerasmp override (Softmax)"
    text = str(report)
    assert re.search(r"hidden\s+Dense\s+float16\s+float32\s+global policy",
                     text)


def test_cli_inspect_prints_saved_model_report(tmp_path, capsys):
    from kerasmp.cli import main

    kerasmp.set_global_policy("mixed_float16")
    model = _block_model()
    path = str(tmp_path / "m.keras")
    model.save(path)
    keras.config.set_dtype_policy("float32")
    assert main(["inspect", path]) == 0
    out = capsys.readouterr().out
    assert re.search(
        r"softmax\S*\s+Softmax\s+float32\s+float32\s+kerasmp override", out)
    assert re.search(r"head\s+Dense\s+float16", out)
