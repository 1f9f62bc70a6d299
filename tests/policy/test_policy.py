"""kerasmp.Policy: per-layer float32 overrides, global use, save/load."""

import json
import os
import re
import subprocess
import sys

import keras
import numpy as np
import pytest
from _helpers import BLOCK_KERASMP
from _models import mlp
from _models import single_dense

import kerasmp
from kerasmp.optimizer import LossScaleOptimizer

pytestmark = pytest.mark.torch  # also in the PyTorch pass (conftest.py)


def _np(tensor, dtype=None):
    """A NumPy copy of `tensor` (PyTorch's need detaching first)."""
    return np.asarray(keras.ops.convert_to_numpy(tensor), dtype)


def _is_plain_adam(optimizer):
    """Keras's Adam (on PyTorch, its torch subclass), not wrapped."""
    return isinstance(optimizer, keras.optimizers.Adam)


def _big_softmax_input(n=2, features=16, seed=0):
    return np.random.default_rng(seed).normal(size=(n, features)).astype(
        "float32"
    )


@pytest.mark.parametrize("activation_layer", ["layer", "dense_activation"])
def test_100k_class_softmax_sums_to_one(activation_layer, capsys):
    # float16 softmax over 100,000 classes: sum(exp(x - max)) can exceed
    # 65504, and then every probability is 0. The analytic reference is a
    # sum of 1. Whether stock Keras fails depends on the CPU (it does on an
    # AMD EPYC, not on an Intel Xeon with AVX512_FP16), so its result is
    # only reported, never asserted.
    def build():
        if activation_layer == "layer":
            layers = [keras.layers.Dense(100_000), keras.layers.Softmax()]
        else:
            layers = [keras.layers.Dense(100_000, activation="softmax")]
        return keras.Sequential([keras.Input((16,))] + layers)

    x = _big_softmax_input()
    keras.config.set_dtype_policy("mixed_float16")  # stock Keras
    stock = build()
    stock_sums = _np(stock(x), dtype="float64").sum(-1)
    with capsys.disabled():
        print(f"\n[stock mixed_float16 softmax sums on this CPU: {stock_sums}]")

    kerasmp.set_global_policy(kerasmp.Policy("mixed_float16"))
    model = build()
    model.set_weights(stock.get_weights())
    probs = model(x)
    assert keras.backend.standardize_dtype(probs.dtype) == "float32"
    sums = _np(probs, dtype="float64").sum(-1)
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


def test_nested_layers_get_overrides(mixed_policy):
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
        "mixed_bfloat16", float32_layers=[keras.layers.Conv2D, r"logits.*"],
        float32_defaults=False,
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


def test_sublayers_built_in_init_with_dtype_none(mixed_policy):
    class Block(keras.layers.Layer):
        def __init__(self, **kwargs):
            super().__init__(**kwargs)
            self.dense = keras.layers.Dense(4)
            self.norm = keras.layers.LayerNormalization()

        def call(self, x):
            return self.norm(self.dense(x))

    block = Block()
    assert block.dense.compute_dtype == "float16"
    assert block.norm.compute_dtype == "float32"


def test_functional_sequential_and_subclassed_models(mixed_policy):
    class Net(keras.Model):
        def __init__(self):
            super().__init__()
            self.dense = keras.layers.Dense(4)
            self.norm = keras.layers.BatchNormalization()

        def call(self, x):
            return self.norm(self.dense(x))

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
        float32_defaults=False,
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
sys.path[:0] = [{tests_dir!r}, {tests_root!r}]
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
def test_save_and_load_in_fresh_process(tmp_path, block_cls, mixed_policy):
    # The loading process's global policy is float32: the saved policies,
    # not the global one, must decide every layer's dtype, also for the
    # sublayers PlainBlock creates with dtype=None.
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
        tests_dir=os.path.dirname(__file__),
        tests_root=os.path.dirname(os.path.dirname(__file__)), path=path,
        x_path=x_path)
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
    return mlp(4, 3, 2, hidden_activation=None)


def test_compile_wraps_float16_once(mixed_policy):
    model = _mlp()
    opt = _compile(model, keras.optimizers.SGD(0.1))
    assert type(opt) is LossScaleOptimizer
    assert isinstance(opt.inner_optimizer, keras.optimizers.SGD)
    # Compiling again with the wrapped optimizer does not wrap it twice.
    opt2 = _compile(model, model.optimizer)
    assert opt2 is opt
    assert not isinstance(opt2.inner_optimizer,
                          keras.optimizers.LossScaleOptimizer)
    # A string optimizer is wrapped too, once.
    opt3 = _compile(model, "adam")
    assert type(opt3) is LossScaleOptimizer
    assert isinstance(opt3.inner_optimizer, keras.optimizers.Adam)


def test_compile_respects_user_choices_and_other_dtypes():
    kerasmp.set_global_policy(kerasmp.Policy("mixed_bfloat16"))
    assert _is_plain_adam(_compile(_mlp()))

    kerasmp.set_global_policy(kerasmp.Policy("mixed_float16"))
    # Keras's own (the TF guide's) becomes kerasmp's, same inner optimizer.
    stock = keras.optimizers.LossScaleOptimizer(keras.optimizers.SGD())
    converted = _compile(_mlp(), stock)
    assert type(converted) is LossScaleOptimizer
    assert converted.inner_optimizer is stock.inner_optimizer
    assert _is_plain_adam(_compile(_mlp(), auto_scale_loss=False))

    # A float16 policy whose every trainable layer is overridden to float32.
    kerasmp.set_global_policy(
        kerasmp.Policy("mixed_float16", float32_layers=[keras.layers.Dense]))
    assert _is_plain_adam(_compile(_mlp()))

    kerasmp.set_global_policy("float32")
    assert _is_plain_adam(_compile(_mlp()))

    # Code that does not use kerasmp policies keeps stock Keras behaviour.
    keras.config.set_dtype_policy("mixed_float16")
    opt = _compile(_mlp())
    assert type(opt) is keras.optimizers.LossScaleOptimizer


def test_compile_wraps_unbuilt_subclassed_model(mixed_policy):
    class Net(keras.Model):
        def __init__(self):
            super().__init__()
            self.dense = keras.layers.Dense(2)

        def call(self, x):
            return self.dense(x)

    assert type(_compile(Net())) is LossScaleOptimizer


def test_dtype_report_names_a_stock_mixed_policy_read_from_a_file(tmp_path):
    """`kerasmp inspect` of a file saved under Keras's own mixed_float16
    labelled every layer "explicit dtype", while `check` said
    stock_policy."""
    keras.config.set_dtype_policy("mixed_float16")
    try:
        model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(
            3, name="hidden"), keras.layers.Dense(2, name="pinned",
                                                  dtype="float32")])
        model.save(tmp_path / "stock.keras")
    finally:
        keras.config.set_dtype_policy("float32")
    loaded = keras.saving.load_model(tmp_path / "stock.keras")
    rows = {r.path: r.reason for r in kerasmp.dtype_report(loaded)}
    assert rows["hidden"] == (
        "stock Keras policy mixed_float16 (no float32 rules)")
    assert rows["pinned"] == "global policy"  # float32, as the global now


def test_dtype_report_rows_and_reasons(mixed_policy):
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
    assert rows["norm"].reason == (
        "kerasmp override: Keras class (LayerNormalization)")
    assert rows["probs"].reason == "kerasmp override: Keras class (Softmax)"
    text = str(report)
    assert re.search(r"hidden\s+Dense\s+float16\s+float32\s+global policy",
                     text)


def test_cli_inspect_prints_saved_model_report(tmp_path, capsys, mixed_policy):
    from kerasmp.apps.cli import main

    model = _block_model()
    path = str(tmp_path / "m.keras")
    model.save(path)
    keras.config.set_dtype_policy("float32")
    assert main(["inspect", path]) == 0
    out = capsys.readouterr().out
    assert re.search(
        r"softmax\S*\s+Softmax\s+float32\s+float32\s+kerasmp override", out)
    assert re.search(r"head\s+Dense\s+float16", out)


# --- Overrides that compose (float32 inside, compute dtype between layers) --


class _PostLN(keras.layers.Layer):
    """The BERT pattern: a residual added to a LayerNormalization output."""

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.norm = keras.layers.LayerNormalization()
        self.ff = keras.layers.Dense(8)

    def call(self, x):
        x = self.norm(x)
        return self.norm(x + self.ff(x))


class _UserAdd(keras.layers.Layer):
    """User call() code adding a normalized tensor to a float16 one."""

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.norm = keras.layers.LayerNormalization()
        self.softmax = keras.layers.Softmax()
        self.ff = keras.layers.Dense(8)

    def call(self, x):
        h = self.ff(x)
        return self.norm(h) + h + self.softmax(h)


class _Probe(keras.layers.Layer):
    """Records the dtype of what it receives (no input cast)."""

    def __init__(self, **kwargs):
        super().__init__(autocast=False, **kwargs)
        self.seen = []

    def call(self, x):
        self.seen.append(keras.backend.standardize_dtype(x.dtype))
        return x


def _float32_twin_outputs(build, x):
    keras.config.set_dtype_policy("float32")
    ref = build()
    ref_out = _np(ref(x))
    kerasmp.set_global_policy(kerasmp.Policy("mixed_float16"))
    model = build()
    model.set_weights(ref.get_weights())
    return model, ref_out


@pytest.mark.parametrize("block", [_PostLN, _UserAdd])
def test_overridden_outputs_compose_with_float16(block):
    # Fails with `AddV2 ... half tensor but is a float tensor` on
    # TensorFlow when an overridden layer hands float32 to user code.
    x = np.random.default_rng(0).normal(size=(4, 8)).astype("float32")

    def build():
        inputs = keras.Input((8,))
        return keras.Model(inputs, block()(inputs))

    model, ref = _float32_twin_outputs(build, x)
    out = model(x)
    np.testing.assert_allclose(_np(out, "float32"), ref, atol=2e-2)
    inner = model.layers[1]
    assert inner.norm.compute_dtype == "float32"
    assert inner.ff.compute_dtype == "float16"


def test_activations_between_layers_stay_half_precision(mixed_policy):
    probe_norm, probe_softmax = _Probe(), _Probe()
    model = keras.Sequential([
        keras.Input((8,)),
        keras.layers.Dense(8),
        keras.layers.LayerNormalization(),
        probe_norm,
        keras.layers.Softmax(),
        probe_softmax,
        keras.layers.Dense(3),
        keras.layers.Softmax(),
    ])
    out = model(np.ones((2, 8), "float32"))
    assert probe_norm.seen[-1] == "float16"
    assert probe_softmax.seen[-1] == "float16"
    # The model's own output is the float32 softmax.
    assert keras.backend.standardize_dtype(out.dtype) == "float32"


def test_attention_probabilities_half_but_softmax_computed_in_float32(
        mixed_policy):
    # Attention over 100k keys: a float16 softmax may overflow its
    # denominator; kerasmp computes it in float32 and hands float16
    # probabilities on, so they still sum to 1.
    class Attend(keras.layers.Layer):
        def __init__(self, **kwargs):
            super().__init__(**kwargs)
            self.mha = keras.layers.MultiHeadAttention(1, 4, use_bias=False)

        def call(self, q, v):
            out, scores = self.mha(q, v, return_attention_scores=True)
            self.seen = keras.backend.standardize_dtype(scores.dtype)
            return out, scores

    layer = Attend()
    rng = np.random.default_rng(0)
    q = rng.normal(size=(1, 2, 4)).astype("float32")
    v = rng.normal(size=(1, 100_000, 4)).astype("float32")
    inputs_q, inputs_v = keras.Input((2, 4)), keras.Input((100_000, 4))
    out, scores = layer(inputs_q, inputs_v)
    model = keras.Model([inputs_q, inputs_v], [out, scores])
    out, scores = model([q, v])
    assert layer.mha._softmax.compute_dtype == "float32"
    # Inside the model the probabilities are float16; as the model's own
    # output they are the float32 values the softmax computed.
    assert layer.seen == "float16"
    assert keras.backend.standardize_dtype(out.dtype) == "float16"
    np.testing.assert_allclose(
        _np(scores, "float64").sum(-1), 1.0, rtol=1e-2)


def test_probabilities_that_reach_the_loss_are_float32():
    # A softmax whose true-class probability is ~1e-10, below float16's
    # smallest subnormal: -log(p) must match the float32 model, not
    # become inf (or a clipped value) from a float16 round trip.
    def build():
        return keras.Sequential([
            keras.Input((2,)),
            keras.layers.Dense(4, activation="softmax",
                               kernel_initializer="zeros"),
        ])

    def loss(y_true, y_pred):
        return -keras.ops.log(y_pred[:, 0])

    x = np.array([[12.0, 0.0]], "float32")
    y = np.zeros((1,), "float32")

    def weights(model):
        w = np.zeros((2, 4), "float32")
        w[0, 1:] = 2.0  # logits (0, 24, 24, 24): p0 ~ 1.3e-11
        model.set_weights([w, np.zeros(4, "float32")])

    results = []
    for policy in ("float32", kerasmp.Policy("mixed_float16")):
        kerasmp.set_global_policy(policy)
        model = build()
        weights(model)
        model.compile("sgd", loss)
        results.append(model.evaluate(x, y, verbose=0))
    assert np.isfinite(results[1])
    np.testing.assert_allclose(results[1], results[0], rtol=1e-3)


# --- Portable files ---------------------------------------------------------

_NO_KERASMP_SCRIPT = BLOCK_KERASMP + """
import numpy as np
import keras
model = keras.models.load_model({path!r})
assert "kerasmp" not in sys.modules
dtypes = {{l.name: l.compute_dtype for l in model.layers
          if not isinstance(l, keras.layers.InputLayer)}}
preds = model.predict(np.load({x_path!r}), verbose=0)
print(json.dumps({{"dtypes": dtypes, "preds": preds.tolist()}}))
"""


def _portable_model():
    inputs = keras.Input((6, 8))
    x = keras.layers.Dense(8, name="proj")(inputs)
    h = keras.layers.LayerNormalization(name="norm")(x)
    x = keras.layers.Add(name="residual")([x, keras.layers.Dense(8)(h)])
    x = keras.layers.GlobalAveragePooling1D(name="pool")(x)
    x = keras.layers.BatchNormalization(name="bn")(x)
    x = keras.layers.Dense(5, name="logits")(x)
    outputs = keras.layers.Softmax(name="probs")(x)
    return keras.Model(inputs, outputs)


@pytest.mark.slow
def test_saved_file_loads_without_kerasmp(tmp_path, mixed_policy):
    model = _portable_model()
    x = np.random.default_rng(2).normal(size=(4, 6, 8)).astype("float32")
    preds = model.predict(x, verbose=0)
    dtypes = {l.name: l.compute_dtype for l in model.layers
              if not isinstance(l, keras.layers.InputLayer)}
    assert dtypes["norm"] == dtypes["probs"] == dtypes["bn"] == "float32"
    assert dtypes["proj"] == "float16"
    path = str(tmp_path / "m.keras")
    model.save(path)
    np.save(tmp_path / "x.npy", x)
    script = _NO_KERASMP_SCRIPT.format(path=path,
                                       x_path=str(tmp_path / "x.npy"))
    out = subprocess.run([sys.executable, "-c", script], capture_output=True,
                         text=True,
                         env={**os.environ, "TF_CPP_MIN_LOG_LEVEL": "3"})
    assert out.returncode == 0, out.stderr[-3000:]
    loaded = json.loads(out.stdout.strip().splitlines()[-1])
    # Stock normalization layers kept in float32 load with the mixed policy
    # (float32 weights and arithmetic, float16 output: kerasmp's hand-back;
    # `kerasmp.policy.portable_policy_name`); the others keep their dtype.
    assert loaded["dtypes"] == dict(dtypes, norm="float16", bn="float16")
    np.testing.assert_allclose(np.asarray(loaded["preds"]), preds, atol=1e-6)

    # With kerasmp, the same file comes back with kerasmp's policies.
    kerasmp.set_global_policy("float32")
    again = keras.models.load_model(path)
    assert isinstance(kerasmp.stored_policy(again.get_layer("proj")),
                      kerasmp.Policy)
    assert isinstance(again.get_layer("probs").dtype_policy,
                      kerasmp.Float32Override)


def test_files_in_the_previous_format_still_load():
    # Version 0.1.0 saved the policy objects themselves
    # ("registered_name": "kerasmp>Policy"); such configs must keep loading.
    # Its list replaced the built-in rules: only "probs" in float32.
    old = kerasmp.Policy("mixed_float16", float32_layers=["probs"],
                         float32_defaults=False)
    kerasmp.set_global_policy(old)
    model = _portable_model()
    config = model.get_config()
    old_policy = keras.saving.serialize_keras_object(old)
    assert old_policy["config"]["float32_layers"] == [{"pattern": "probs"}]
    assert old_policy["registered_name"] == "kerasmp>Policy"
    for layer in config["layers"]:
        if isinstance(layer["config"].get("dtype"), dict):
            layer["config"]["dtype"] = old_policy
    kerasmp.set_global_policy("float32")
    loaded = keras.Model.from_config(config)
    assert loaded.get_layer("probs").compute_dtype == "float32"
    assert loaded.get_layer("norm").compute_dtype == "float16"  # not a rule
    assert loaded.get_layer("proj").compute_dtype == "float16"


def test_loading_never_imports_a_module_named_by_the_file(tmp_path,
                                                          monkeypatch):
    marker = tmp_path / "imported"
    (tmp_path / "kerasmp_evil_mod.py").write_text(
        f"open({str(marker)!r}, 'w').write('x')\n"
        "import keras\nclass Evil(keras.layers.Layer):\n    pass\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    config = {"name": "mixed_float16", "float32_layers": [
        {"module": "kerasmp_evil_mod", "class_name": "Evil"}]}
    with pytest.raises(ValueError, match="does not import"):
        kerasmp.Policy.from_config(config)
    saved = {**keras.dtype_policies.serialize(
        kerasmp.Policy("mixed_float16")), "kerasmp": {
        "class_name": "Policy", "config": config}}
    layer_config = {"units": 2, "dtype": saved}
    with pytest.raises(ValueError, match="does not import"):
        keras.layers.Dense.from_config(layer_config)
    saved["kerasmp"] = {"class_name": "os.system", "config": {}}
    with pytest.raises(ValueError, match="kerasmp dtype policy"):
        keras.layers.Dense.from_config(layer_config)
    assert not marker.exists()
    assert "kerasmp_evil_mod" not in sys.modules


def test_name_rules_are_linear_time_and_matched_once_per_layer(monkeypatch):
    # `(a|aa)+` against 'a' * 40 + 'b' takes Python's backtracking engine
    # ~2**28 steps; kerasmp's matcher is linear in the name.
    policy = kerasmp.Policy.from_config(
        {"name": "mixed_float16", "float32_layers": [{"pattern": "(a|aa)+"}]})
    from kerasmp._utils import namematch as _namematch

    calls = []
    original = _namematch.NameMatcher.fullmatch
    monkeypatch.setattr(_namematch.NameMatcher, "fullmatch",
                        lambda self, n: calls.append(n) or original(self, n))
    kerasmp.set_global_policy(policy)
    layers = [keras.layers.Dense(2, name="a" * 40 + "b"),
              keras.layers.Dense(2, name="a" * 40)]
    for _ in range(50):
        dtypes = [l.compute_dtype for l in layers]
    assert dtypes == ["float16", "float32"]
    assert sorted(calls) == sorted(l.name for l in layers)


@pytest.mark.parametrize("pattern", ["(a)\\1", "(?=a)b", "(?i)head"])
def test_unsupported_patterns_are_refused_naming_the_argument(pattern):
    with pytest.raises(ValueError, match="float32_layers"):
        kerasmp.Policy("mixed_float16", float32_layers=[pattern])


def test_uninstall_restores_stock_keras():
    try:
        kerasmp.uninstall()
        keras.config.set_dtype_policy("mixed_float16")
        softmax = keras.layers.Softmax()
        assert softmax.compute_dtype == "float16"  # stock: no override
        model = single_dense(4, 2)
        model.compile("sgd", "mse")
        # Stock rule: wrapped by the stock LossScaleOptimizer by name.
        assert type(model.optimizer) is keras.optimizers.LossScaleOptimizer
    finally:
        kerasmp.install()
    kerasmp.set_global_policy(kerasmp.Policy("mixed_float16"))
    assert keras.layers.Softmax().compute_dtype == "float32"


def test_dtype_report_paths_are_full_and_unique(mixed_policy):
    # Layers without weights keep their parent, MHA's softmaxes get their
    # MHA's path, and same-named layers in different blocks stay apart.
    class Block(keras.layers.Layer):
        def __init__(self, **kwargs):
            super().__init__(**kwargs)
            self.mha = keras.layers.MultiHeadAttention(2, 4, dropout=0.1)
            self.dropout = keras.layers.Dropout(0.1, name="ff_dropout")

        def call(self, x):
            return self.dropout(self.mha(x, x))

    inputs = keras.Input((4, 8))
    x = Block(name="block_a")(inputs)
    x = Block(name="block_b")(x)
    x = keras.layers.MaxPooling1D(name="pool")(x)
    model = keras.Model(inputs, x)
    report = kerasmp.dtype_report(model)
    paths = [r.path for r in report]
    assert len(paths) == len(set(paths))
    assert "block_a/ff_dropout" in paths and "block_b/ff_dropout" in paths
    softmaxes = [r for r in report if r.layer_class == "Softmax"]
    mha_paths = [r.path for r in report
                 if r.layer_class == "MultiHeadAttention"]
    assert len(softmaxes) == len(mha_paths) == 2
    for row, mha in zip(softmaxes, mha_paths):
        assert row.path.startswith(mha + "/")
    assert all(r.compute_dtype == "float32" for r in softmaxes)
    assert report["pool"].layer_class == "MaxPooling1D"
    with pytest.raises(KeyError, match="ambiguous"):
        report["ff_dropout"]
    assert report["block_b/ff_dropout"].layer_class == "Dropout"


def test_hand_back_casts_only_float_tensors_and_keeps_masks():
    from kerasmp.policy import hand_back

    x = keras.ops.ones((2, 3), "float32")
    mask = keras.ops.convert_to_tensor([True, False])
    kerasmp._keras_internals.set_keras_mask(x, mask)
    ids = keras.ops.ones((2,), "int32")
    symbolic = keras.KerasTensor((2,), "float32")
    originals = {}
    out = hand_back({"x": x, "ids": ids, "s": symbolic, "n": 3.0},
                    "float16", originals)
    assert keras.backend.standardize_dtype(out["x"].dtype) == "float16"
    np.testing.assert_array_equal(
        keras.ops.convert_to_numpy(kerasmp._keras_internals.get_keras_mask(
            out["x"])), [True, False])
    assert out["ids"] is ids and out["s"] is symbolic and out["n"] == 3.0
    assert originals == {id(out["x"]): (out["x"], x)}


def test_per_layer_policies_round_trip_and_compare_by_policy_and_reason():
    # The three policies a Policy sets on single layers share one mixin
    # (kerasmp._utils.marked.Marked); their saved configs keep the keys
    # files already hold ("rule" / "reason"), and equality needs the same
    # class, text and governing policy.
    from kerasmp.float8 import Float8Assignment
    from kerasmp.float8 import Float8Fallback

    mixed = kerasmp.Policy("mixed_float16")
    fp8 = kerasmp.Policy("float8_mixed_bfloat16")
    cases = [
        (kerasmp.Float32Override(mixed, "softmax"), "rule", "float32"),
        (Float8Assignment(fp8, "Dense"), "rule", "float8_from_mixed_bfloat16"),
        (Float8Fallback(fp8, "saturated"), "reason", "mixed_bfloat16"),
    ]
    for policy, key, name in cases:
        saved = keras.saving.serialize_keras_object(policy)
        assert set(saved["config"]) == {"policy", key}, saved
        back = keras.saving.deserialize_keras_object(saved)
        assert type(back) is type(policy) and back.name == name
        assert back == policy and hash(back) == hash(policy)
        assert getattr(back, key) == getattr(policy, key)
        assert repr(back) == (
            f'<kerasmp.{type(policy).__name__} "{name}" '
            f"({getattr(policy, key)})>"
        )
    override, assignment, fallback = (c[0] for c in cases)
    assert override != kerasmp.Float32Override(mixed, "LayerNormalization")
    assert override != kerasmp.Float32Override(
        kerasmp.Policy("mixed_bfloat16"), "softmax"
    )
    # Same text, different class: not equal.
    assert assignment != Float8Fallback(fp8, "Dense")
    assert fallback != keras.DTypePolicy("mixed_bfloat16")
