"""The normalization rule (kerasmp/policy/norms.py) on real classes: keras-hub
0.32's own normalization layers, a user's `RMSNorm`, and composite blocks
that must stay in the compute dtype; the user's add/remove of rules (a class,
a name pattern, a predicate); and what `dtype_report` says about each rule,
the NonFiniteMonitor fallback and `policy_scope`. Runs on TF and JAX."""

import importlib
import re

import keras
import numpy as np
import pytest
from _helpers import keras_hub_or_skip

import kerasmp
from kerasmp.callbacks import nonfinite_fallback as _nonfinite_fallback
from kerasmp.policy import KNOWN_FLOAT16_HAZARDS
from kerasmp.policy import NORMALIZATION_BY_NAME
from kerasmp.policy import norms as _norm_rule

pytestmark = pytest.mark.torch  # also in the PyTorch pass (conftest.py)

keras_hub = keras_hub_or_skip()

HUB = "keras_hub.src.models."
# keras-hub 0.32.0 normalization classes: (module, class, constructor args).
HUB_NORMS = [
    ("keras_hub.src.layers.modeling.rms_normalization", "RMSNormalization",
     {"input_dim": 8}),
    (HUB + "t5.t5_layer_norm", "T5LayerNorm", {}),
    (HUB + "mistral.mistral_layer_norm", "MistralLayerNormalization", {}),
    (HUB + "mixtral.mixtral_layer_norm", "MixtralLayerNormalization", {}),
    (HUB + "gemma.rms_normalization", "RMSNormalization", {}),
    (HUB + "gemma3.gemma3_layers", "RMSNormalization", {}),
    (HUB + "gemma3n.rms_normalization", "Gemma3nRMSNorm", {"dim": 8}),
    (HUB + "gemma4.gemma4_layers", "Gemma4VNorm", {}),
    (HUB + "gemma4.gemma4_layers", "Gemma4FrozenNorm", {}),
    (HUB + "llama.llama_layernorm", "LlamaLayerNorm", {}),
    (HUB + "qwen.qwen_layernorm", "QwenLayerNorm", {}),
    (HUB + "qwen_moe.qwen_moe_layernorm", "QwenMoeLayerNorm", {}),
    (HUB + "qwen3.qwen3_layernorm", "Qwen3LayerNorm", {}),
    (HUB + "qwen3_moe.qwen3_moe_layernorm", "Qwen3MoeLayerNorm", {}),
    (HUB + "qwen3_5.qwen3_5_layers", "Qwen3_5LayerNorm", {}),
    (HUB + "qwen3_5.qwen3_5_layers", "Qwen3_5RMSNormGated", {}),
    (HUB + "phi3.phi3_layernorm", "Phi3LayerNorm", {}),
    (HUB + "gpt_oss.gpt_oss_layer_norm", "GptOssLayerNormalization", {}),
    (HUB + "roformer_v2.roformer_v2_attention", "RoformerNorm", {}),
    (HUB + "mobilenetv5.mobilenetv5_layers", "RmsNorm2d", {"dim": 8}),
    (HUB + "flux.flux_layers", "QKNorm", {"input_dim": 8}),
    (HUB + "edrec.edrec_layers", "EdRecRMSNormalization", {}),
]
# Composite blocks whose names mention normalization: a conv or dense inside.
HUB_COMPOSITES = [
    (HUB + "mobilenetv5.mobilenetv5_layers", "ConvNormAct",
     {"out_chs": 8, "kernel_size": 3, "channel_axis": -1}),
    (HUB + "d_fine.d_fine_layers", "DFineConvNormLayer",
     {"filters": 8, "kernel_size": 3, "batch_norm_eps": 1e-5, "stride": 1,
      "groups": 1, "padding": None, "activation_function": "relu",
      "channel_axis": -1}),
    (HUB + "stable_diffusion_3.mmdit", "AdaptiveLayerNormalization",
     {"hidden_dim": 8}),
]


def _make(module, name, kwargs):
    return getattr(importlib.import_module(module), name)(**kwargs)


def _id(entry):
    return f"{entry[0].rsplit('.', 2)[-2]}.{entry[1]}"


class RMSNorm(keras.layers.Layer):
    """The RMSNorm of every LLM tutorial: float16 arithmetic end to end."""

    def __init__(self, epsilon=1e-6, **kwargs):
        super().__init__(**kwargs)
        self.epsilon = epsilon

    def build(self, input_shape):
        self.scale = self.add_weight(shape=(input_shape[-1],),
                                     initializer="ones", name="scale")

    def call(self, x):
        ms = keras.ops.mean(keras.ops.square(x), axis=-1, keepdims=True)
        return x * keras.ops.rsqrt(ms + self.epsilon) * self.scale


class MyLayerNorm(RMSNorm):
    pass


class Scaled(RMSNorm):
    """A subclass whose own name says nothing: its base's name counts."""


class ConvNorm(keras.layers.Layer):
    """A user's composite: a convolution, then a normalization."""

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.conv = keras.layers.Conv1D(8, 3, dtype=self.dtype_policy)
        self.norm = keras.layers.LayerNormalization()

    def call(self, x):
        return self.norm(self.conv(x))


class ProjNorm(keras.layers.Layer):
    """A layer named like a norm that creates a dense kernel in build."""

    def build(self, input_shape):
        self.kernel = self.add_weight(shape=(input_shape[-1], 8))

    def call(self, x):
        return keras.ops.matmul(x, self.kernel)


def is_norm_named(layer):
    """A module-level predicate (saved by name with the policy)."""
    return layer.name.startswith("norm_")


@pytest.mark.parametrize("entry", HUB_NORMS, ids=_id)
def test_keras_hub_normalizations_compute_in_float32(mixed_policy, entry):
    layer = _make(*entry)
    assert layer.compute_dtype == "float32"
    rule = kerasmp.float32_rule(layer)
    assert rule == f"normalization by name ({entry[1]})"
    # The stock rule (Keras classes only) leaves it in float16.
    stock = kerasmp.Policy("mixed_float16",
                           float32_layers=_norm_rule.KERAS_NORMALIZATION_CLASSES,
                           float32_defaults=False)
    assert stock.float32_rule(layer) is None


@pytest.mark.parametrize("entry", HUB_COMPOSITES, ids=_id)
def test_keras_hub_composite_blocks_stay_in_the_compute_dtype(
        mixed_policy, entry):
    layer = _make(*entry)
    assert layer.compute_dtype == "float16"
    assert kerasmp.float32_rule(layer) is None
    # Their inner normalization (and only it) is float32; the conv/dense
    # stays float16.
    inner = {type(s).__name__: s.compute_dtype
             for s in kerasmp._keras_internals.sublayers(layer)}
    heavy = [n for n in inner if n in ("Conv2D", "Dense")]
    assert heavy and all(inner[n] == "float16" for n in heavy)
    norms = [n for n in inner if "Norm" in n]
    assert all(inner[n] == "float32" for n in norms)


def test_user_rmsnorm_inside_a_model_is_float32_and_finite(mixed_policy):
    inputs = keras.Input((4, 16))
    x = keras.layers.Dense(16, name="up", kernel_initializer=keras.
                           initializers.Identity(gain=1000.0))(inputs)
    x = RMSNorm(name="rms")(x)
    x = MyLayerNorm(name="mine")(x)
    x = Scaled(name="scaled")(x)
    model = keras.Model(inputs, keras.layers.Dense(4, name="out")(x))
    for name in ("rms", "mine", "scaled"):
        assert model.get_layer(name).compute_dtype == "float32", name
        assert model.get_layer(name).variable_dtype == "float32"
    assert model.get_layer("up").compute_dtype == "float16"
    assert kerasmp.float32_rule(model.get_layer("scaled")) == (
        "normalization by name (RMSNorm)")
    # |x| ~ 1000 > 256: the float16 square overflows, the float32 one not.
    x = np.random.default_rng(0).normal(size=(2, 4, 16)).astype("float32")
    y = keras.ops.convert_to_numpy(model(x))
    assert np.isfinite(y).all()
    # The float32 reference, computed in NumPy from the same weights.
    h = x @ keras.ops.convert_to_numpy(model.get_layer("up").kernel)
    for _ in range(3):
        h = h / np.sqrt(np.mean(h * h, axis=-1, keepdims=True) + 1e-6)
    expected = h @ keras.ops.convert_to_numpy(model.get_layer("out").kernel)
    np.testing.assert_allclose(y, expected, atol=2e-2)


def test_user_composite_and_kernel_owning_layers(mixed_policy):
    block = ConvNorm()
    assert block.compute_dtype == "float16"
    assert block.conv.compute_dtype == "float16"
    assert block.norm.compute_dtype == "float32"
    # Spectral normalization wraps a Dense: a composite.
    spectral = keras.layers.SpectralNormalization(keras.layers.Dense(4))
    assert spectral.compute_dtype == "float16"
    # A built layer that owns a 2-D kernel is not a normalization.
    proj = ProjNorm()
    proj.build((None, 4))
    assert _norm_rule.normalization_by_name(proj) is None


def test_name_rule_pure_function():
    assert _norm_rule.match_normalization(keras.layers.LayerNormalization()) \
        == "Keras class (LayerNormalization)"
    assert _norm_rule.match_normalization(RMSNorm()) == (
        "normalization by name (RMSNorm)")
    assert _norm_rule.match_normalization(keras.layers.Dense(2)) is None
    for name in ("RMSNorm", "T5LayerNorm", "RmsNorm2d", "MyNormalization",
                 "Qwen3_5RMSNormGated", "group_norm_1d"):
        assert _norm_rule.NORMALIZATION_NAME.fullmatch(name), name
    for name in ("ConvNormAct", "DFineConvNormLayer", "Normal", "Dense",
                 "NormalizedDense", "Enormous"):
        assert not _norm_rule.NORMALIZATION_NAME.fullmatch(name), name


def test_remove_the_name_rule_or_exclude_a_class_pattern_predicate():
    t5_norm = (HUB + "t5.t5_layer_norm", "T5LayerNorm", {})
    without = [r for r in kerasmp.DEFAULT_FLOAT32_LAYERS
               if r is not NORMALIZATION_BY_NAME]
    kerasmp.set_global_policy(kerasmp.Policy("mixed_float16", without,
                                             float32_defaults=False))
    assert _make(*t5_norm).compute_dtype == "float16"
    assert RMSNorm().compute_dtype == "float16"
    assert keras.layers.LayerNormalization().compute_dtype == "float32"

    policy = kerasmp.Policy(
        "mixed_float16",
        float32_exclude=[MyLayerNorm, "keep_.*", is_norm_named])
    kerasmp.set_global_policy(policy)
    assert MyLayerNorm().compute_dtype == "float16"  # class
    assert RMSNorm(name="keep_me").compute_dtype == "float16"  # pattern
    assert RMSNorm(name="norm_a").compute_dtype == "float16"  # predicate
    assert keras.layers.LayerNormalization(
        name="norm_b").compute_dtype == "float16"
    assert RMSNorm(name="other").compute_dtype == "float32"
    # ProjNorm's kernel is created in build, after the decision: exclude it.
    assert ProjNorm().compute_dtype == "float32"
    kerasmp.set_global_policy(kerasmp.Policy(
        "mixed_float16", float32_exclude=[ProjNorm]))
    assert ProjNorm().compute_dtype == "float16"


def test_add_a_predicate_and_save_it_with_the_policy(tmp_path):
    policy = kerasmp.Policy(
        "mixed_float16",
        float32_layers=[*kerasmp.DEFAULT_FLOAT32_LAYERS, is_norm_named],
        float32_exclude=["head"])
    kerasmp.set_global_policy(policy)
    inputs = keras.Input((4,))
    x = keras.layers.Dense(4, name="norm_dense")(inputs)
    x = RMSNorm(name="rms")(x)
    out = keras.layers.Dense(2, name="head", activation="softmax")(x)
    model = keras.Model(inputs, out)
    assert model.get_layer("norm_dense").compute_dtype == "float32"
    assert model.get_layer("head").compute_dtype == "float16"  # excluded
    assert kerasmp.float32_rule(model.get_layer("norm_dense")) == (
        "user rule (predicate is_norm_named)")
    again = kerasmp.Policy.from_config(policy.get_config())
    assert again == policy
    assert again.float32_layers == policy.float32_layers
    path = str(tmp_path / "m.keras")
    model.save(path)
    loaded = keras.saving.load_model(
        path, custom_objects={"RMSNorm": RMSNorm})
    dtypes = {l.name: l.compute_dtype for l in loaded.layers[1:]}
    assert dtypes == {"norm_dense": "float32", "rms": "float32",
                      "head": "float16"}


def test_bad_rules_are_refused_at_construction():
    with pytest.raises(TypeError, match="float32_layers.*predicate"):
        kerasmp.Policy("mixed_float16", float32_layers=[3])
    with pytest.raises(TypeError, match="float32_exclude"):
        kerasmp.Policy("mixed_float16", float32_exclude=RMSNorm)
    with pytest.raises(TypeError, match="float32_exclude.*built-in"):
        kerasmp.Policy("mixed_float16",
                       float32_exclude=[NORMALIZATION_BY_NAME])
    with pytest.raises(ValueError, match="float32_exclude"):
        kerasmp.Policy("mixed_float16", float32_exclude=["(unclosed"])
    lam = kerasmp.Policy("mixed_float16",
                         [lambda layer: layer.name == "picked"])
    with pytest.raises(ValueError, match="cannot be saved.*module level"):
        lam.get_config()
    # Until it is saved, a lambda works: in a model, in the report.
    kerasmp.set_global_policy(lam)
    inputs = keras.Input((4,))
    model = keras.Model(inputs, keras.layers.Dense(2, name="picked")(inputs))
    row = kerasmp.dtype_report(model)["picked"]
    assert (row.compute_dtype, row.reason) == (
        "float32", "kerasmp override: user rule (predicate "
        "test_bad_rules_are_refused_at_construction.<locals>.<lambda>)")


def test_hazard_rule_applies_to_float16_only():
    from keras_hub.src.models.t5.t5_multi_head_attention import (
        T5MultiHeadAttention,
    )

    def t5_attention():
        return T5MultiHeadAttention(is_decoder=False, hidden_dim=8,
                                    key_value_dim=4, num_heads=2, dropout=0)

    kerasmp.set_global_policy("mixed_float16")
    mha = t5_attention()
    assert mha.compute_dtype == "float32"
    assert kerasmp.float32_rule(mha) == (
        "known float16 hazard (T5MultiHeadAttention)")
    # Its projections were created while it was constructed: float16.
    assert mha.query_projector.compute_dtype == "float16"
    kerasmp.set_global_policy("mixed_bfloat16")
    assert t5_attention().compute_dtype == "bfloat16"
    assert KNOWN_FLOAT16_HAZARDS.float16_only


def test_dtype_report_names_the_rule_kind(mixed_policy):
    kerasmp.set_global_policy(kerasmp.Policy(
        "mixed_float16",
        float32_layers=[*kerasmp.DEFAULT_FLOAT32_LAYERS, "head"]))
    inputs = keras.Input((4,))
    x = keras.layers.LayerNormalization(name="ln")(inputs)
    x = RMSNorm(name="rms")(x)
    x = keras.layers.Dense(4, name="head")(x)
    model = keras.Model(inputs, keras.layers.Softmax(name="probs")(x))
    reasons = {r.path: r.reason for r in kerasmp.dtype_report(model)}
    assert reasons == {
        "ln": "kerasmp override: Keras class (LayerNormalization)",
        "rms": "kerasmp override: normalization by name (RMSNorm)",
        "head": "kerasmp override: user rule (name~'head')",
        "probs": "kerasmp override: Keras class (Softmax)",
    }


def test_dtype_report_policy_scope_and_fallback_reasons():
    # Layers built inside policy_scope: their policy is kerasmp's, not
    # "saved or inherited".
    with kerasmp.policy_scope("mixed_float16"):
        inputs = keras.Input((3,))
        block = keras.Sequential([keras.layers.Dense(4, name="inner")],
                                 name="block")
        outputs = keras.layers.Dense(1, name="head")(block(inputs))
        model = keras.Model(inputs, outputs)
    rows = {r.path: r for r in kerasmp.dtype_report(model)}
    assert rows["head"].reason == (
        "kerasmp policy mixed_float16 (not the global policy now)")
    assert "saved or inherited" not in str(kerasmp.dtype_report(model))

    class Report:
        def layer_object(self, path):
            return model.get_layer(path)

    from kerasmp.callbacks.nonfinite_events import Rules
    from kerasmp.callbacks.nonfinite_events import State

    result = _nonfinite_fallback.fall_back(
        {"kind": "stuck", "layer": "block"}, Report(),
        State(scale=64.0, skipped=3, last_consecutive=3),
        Rules(patience=3, scaled=True, dynamic=True, min_scale=1.0))
    assert result.refusal is None
    rows = {r.path: r for r in kerasmp.dtype_report(model)}
    assert rows["block"].compute_dtype == "float32"
    assert rows["block"].reason == "float32 by NonFiniteMonitor fallback"
    assert rows["block/inner"].reason == "float32 by NonFiniteMonitor fallback"
    assert rows["head"].compute_dtype == "float16"
    assert not re.search("explicit dtype", str(kerasmp.dtype_report(model)))


def test_export_keeps_the_same_layers_float32():
    """`kerasmp.export.to_float16` applies the model's policy rules: the
    name-rule norm and an excluded layer come out as they trained."""
    kerasmp.set_global_policy(kerasmp.Policy(
        "mixed_float16", float32_exclude=["plain_norm"]))
    inputs = keras.Input((4,))
    x = keras.layers.Dense(4, name="proj")(inputs)
    x = RMSNorm(name="rms")(x)
    x = RMSNorm(name="plain_norm")(x)
    model = keras.Model(inputs, keras.layers.Dense(2, name="head")(x))
    trained = {l.name: l.compute_dtype for l in model.layers[1:]}
    assert trained == {"proj": "float16", "rms": "float32",
                       "plain_norm": "float16", "head": "float16"}
    half = kerasmp.export.to_float16(model)
    assert half.layer_compute_dtypes() == trained
    assert set(half.kept_float32) == {"rms"}
    assert half.kept_float32["rms"] == "normalization by name (RMSNorm)"
