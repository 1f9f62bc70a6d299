"""keras-hub backbones that define their own normalization layers, built from
scratch with tiny configs (no downloads), under the default
`kerasmp.Policy("mixed_float16")`: every normalization layer computes in
float32, every Dense/EinsumDense/Conv in float16, the logits are close to a
float32 copy with the same weights, and a few fit steps stay finite. Also the
T5 cases: its `-1e9` mask bias (NaN under stock mixed_float16) and
activations above 256 entering `T5LayerNorm`.

Each family's models are built once per module. Runs on TF and JAX.
"""

import keras
import numpy as np
import pytest
from _helpers import keras_hub_or_skip

import kerasmp
from kerasmp._utils.layers import walk
from kerasmp.policy import norms as _norm_rule

keras_hub = keras_hub_or_skip()

SEQ = 8
VOCAB = 64
BATCH = 4
DECODER = dict(vocabulary_size=VOCAB, num_layers=2, num_query_heads=2,
               num_key_value_heads=1, hidden_dim=16, intermediate_dim=32)

# family -> (backbone class name, kwargs, its normalization class)
FAMILIES = {
    "t5": ("T5Backbone", dict(vocabulary_size=VOCAB, num_layers=2,
                              num_heads=2, hidden_dim=16, intermediate_dim=32,
                              key_value_dim=8, dropout=0.0),
           "T5LayerNorm"),
    "gemma": ("GemmaBackbone", dict(DECODER, head_dim=8),
              "RMSNormalization"),
    "mistral": ("MistralBackbone", DECODER, "MistralLayerNormalization"),
    "llama": ("LlamaBackbone", DECODER, "LlamaLayerNorm"),
    "qwen3": ("Qwen3Backbone", dict(DECODER, head_dim=8), "Qwen3LayerNorm"),
    "phi3": ("Phi3Backbone", DECODER, "Phi3LayerNorm"),
}
MATMULS = (keras.layers.Dense, keras.layers.EinsumDense, keras.layers.Conv1D,
           keras.layers.Conv2D)


def _inputs(backbone):
    return {name: keras.Input((SEQ,), dtype="int32", name=name)
            for name in backbone.input}


def _build(family):
    cls_name, kwargs, _ = FAMILIES[family]
    keras.utils.set_random_seed(0)
    backbone = getattr(keras_hub.models, cls_name)(**kwargs)
    inputs = _inputs(backbone)
    out = backbone(inputs)
    if isinstance(out, dict):
        out = out.get("decoder_sequence_output", out.get("sequence_output"))
    logits = keras.layers.Dense(VOCAB, name="lm_head")(out)
    return keras.Model(inputs, logits)


def _data(model, seed=0, n=2 * BATCH):
    rng = np.random.default_rng(seed)
    x = {}
    for name in model.input:
        if "mask" in name:
            mask = np.ones((n, SEQ), "int32")
            mask[: n // 2, SEQ - 2:] = 0  # some padding
            x[name] = mask
        else:
            x[name] = rng.integers(1, VOCAB, (n, SEQ)).astype("int32")
    y = rng.integers(0, VOCAB, (n, SEQ)).astype("int32")
    return x, y


_MODELS = {}


def models(family):
    """(float32 model, kerasmp mixed_float16 model with the same weights)."""
    if family not in _MODELS:
        with kerasmp.policy_scope("float32"):
            reference = _build(family)
        with kerasmp.policy_scope("mixed_float16"):
            mixed = _build(family)
        mixed.set_weights(reference.get_weights())
        _MODELS[family] = reference, mixed
    return _MODELS[family]


def _governed(layer):
    return isinstance(kerasmp.stored_policy(layer), kerasmp.Policy)


@pytest.mark.parametrize("family", FAMILIES)
def test_every_norm_float32_every_matmul_float16(family):
    _, mixed = models(family)
    norm_class = FAMILIES[family][2]
    norms, matmuls = [], []
    for path, layer in walk(mixed):
        if type(layer).__name__ == norm_class or _norm_rule.\
                is_keras_normalization(layer):
            norms.append((path, layer.compute_dtype, layer.variable_dtype))
        elif isinstance(layer, MATMULS) and _governed(layer):
            matmuls.append((path, layer.compute_dtype))
    assert any(type(layer).__name__ == norm_class
               for _, layer in walk(mixed)), norm_class
    assert norms and matmuls
    assert [n for n in norms if n[1:] != ("float32", "float32")] == []
    assert [m for m in matmuls if m[1] != "float16"] == []
    report = kerasmp.dtype_report(mixed)
    rows = [r for r in report if r.layer_class == norm_class]
    assert rows and all(r.reason == (
        f"kerasmp override: normalization by name ({norm_class})")
        for r in rows)


@pytest.mark.parametrize("family", FAMILIES)
def test_logits_close_to_float32_and_fit_finite(family):
    reference, mixed = models(family)
    x, y = _data(mixed)
    ref = keras.ops.convert_to_numpy(reference(x))
    got = keras.ops.convert_to_numpy(mixed(x)).astype("float32")
    assert np.isfinite(got).all()
    scale = float(np.max(np.abs(ref)))
    assert float(np.max(np.abs(got - ref))) <= 2e-2 * max(scale, 1.0)
    mixed.compile(
        optimizer=keras.optimizers.Adam(1e-3),
        loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
        jit_compile=False)
    assert isinstance(mixed.optimizer, kerasmp.LossScaleOptimizer)
    history = mixed.fit(x, y, batch_size=BATCH, epochs=1, verbose=0)
    assert np.isfinite(history.history["loss"]).all()
    for w in mixed.weights:
        assert np.isfinite(keras.ops.convert_to_numpy(w)).all(), w.path


def test_t5_is_nan_without_the_hazard_rule():
    """The rule that fixes T5: without it its -1e9 mask bias is NaN."""
    _, mixed = models("t5")
    x, _ = _data(mixed)
    assert np.isfinite(keras.ops.convert_to_numpy(mixed(x))).all()
    without = [r for r in kerasmp.DEFAULT_FLOAT32_LAYERS
               if r is not kerasmp.policy.KNOWN_FLOAT16_HAZARDS]
    with kerasmp.policy_scope(kerasmp.Policy("mixed_float16", without,
                                             float32_defaults=False)):
        broken = _build("t5")
    broken.set_weights(mixed.get_weights())
    out = keras.ops.convert_to_numpy(broken(x))
    assert not np.isfinite(out).all()


def test_t5_fully_padded_rows_are_finite():
    """keras-hub's own T5 test batch is fully padded: the float32 attention
    adds its -1e9 mask bias and hands the position bias on; handed to
    float16 it stays finite (-65504, not -inf), so rows that attend to
    nothing are finite (not NaN) and the other rows match float32."""
    reference, _ = models("t5")
    with kerasmp.policy_scope("mixed_float16"):
        mixed = _build("t5")  # fresh: another test fits the shared one
    mixed.set_weights(reference.get_weights())
    x, _ = _data(mixed)
    for name in x:
        if "mask" in name:
            x[name][:2] = 0  # two rows attend to nothing
    out = keras.ops.convert_to_numpy(mixed(x)).astype("float32")
    assert np.isfinite(out).all()
    expected = keras.ops.convert_to_numpy(reference(x))
    np.testing.assert_allclose(out[2:], expected[2:], atol=5e-2 * np.abs(
        expected).max())


def test_t5_layer_norm_above_256_is_finite_under_kerasmp():
    """Activations above 256 entering T5LayerNorm: mean(square(x)) overflows
    float16 (256^2 > 65504). kerasmp keeps the norm float32; the stock
    mixed_float16 value is printed, not asserted."""
    from keras_hub.src.models.t5.t5_layer_norm import T5LayerNorm

    x = np.random.default_rng(0).normal(size=(4, SEQ, 16)).astype("float32")

    def build():
        inputs = keras.Input((SEQ, 16))
        h = keras.layers.Dense(16, name="up", use_bias=False,
                               kernel_initializer=keras.initializers.Identity(
                                   gain=1000.0))(inputs)
        h = T5LayerNorm(name="norm")(h)
        return keras.Model(inputs, keras.layers.Dense(4, name="out")(h))

    with kerasmp.policy_scope("float32"):
        reference = build()
    with kerasmp.policy_scope("mixed_float16"):
        mixed = build()
    mixed.set_weights(reference.get_weights())
    assert mixed.get_layer("up").compute_dtype == "float16"
    assert mixed.get_layer("norm").compute_dtype == "float32"
    ref = keras.ops.convert_to_numpy(reference(x))
    got = keras.ops.convert_to_numpy(mixed(x)).astype("float32")
    assert np.isfinite(got).all()
    np.testing.assert_allclose(got, ref, atol=2e-2 * np.abs(ref).max())

    previous = keras.config.dtype_policy()
    keras.config.set_dtype_policy(keras.DTypePolicy("mixed_float16"))
    try:
        stock = build()
    finally:
        keras.config.set_dtype_policy(previous)
    stock.set_weights(reference.get_weights())
    out = keras.ops.convert_to_numpy(stock(x)).astype("float32")
    finite = np.isfinite(out)
    print(f"\n[stock mixed_float16 T5LayerNorm at |x|~1000: finite "
          f"{finite.mean():.3f}, max |out| "
          f"{np.abs(np.where(finite, out, 0)).max():.3g}, max |out - "
          f"float32| {np.abs(np.where(finite, out, 0) - ref).max():.3g} "
          f"(float32 max |out| {np.abs(ref).max():.3g})]")


@pytest.mark.parametrize("name", ["T5GemmaBackbone", "T5Gemma2Backbone"])
def test_t5gemma_layers_build_their_mask_bias_in_float32(name):
    """T5Gemma's and T5Gemma2's encoder and decoder layers build the
    `(1 - mask) * -1e9` bias in their own `call`: NaN on every position in
    float16 (stock `mixed_float16` too); `KNOWN_FLOAT16_HAZARDS` computes
    those layers in float32, their attention and MLPs stay float16."""
    from zoo import hub
    from zoo import spec
    from zoo import worker

    zoo = hub.HUB[name]
    x = spec.draw(zoo.inputs, 2, seed=1)
    with kerasmp.policy_scope("float32"):
        reference, _ = worker.build(zoo)
    with kerasmp.policy_scope("mixed_float16"):
        mixed, _ = worker.build(zoo, None)
    mixed.set_weights(reference.get_weights())
    want = keras.ops.convert_to_numpy(reference(x))
    got = keras.ops.convert_to_numpy(mixed(x)).astype("float32")
    assert np.isfinite(got).all()
    assert spec.rel_diff(want, got) <= 2e-2
    from kerasmp.policy.norms import KNOWN_FLOAT16_HAZARDS

    layers = [(p, l) for p, l in walk(mixed)
              if type(l).__name__ in KNOWN_FLOAT16_HAZARDS]
    assert layers and all(l.compute_dtype == "float32" for _, l in layers)
    assert any(isinstance(l, keras.layers.EinsumDense)
               and l.compute_dtype == "float16" for _, l in walk(mixed))
    without = [r for r in kerasmp.DEFAULT_FLOAT32_LAYERS
               if r is not kerasmp.policy.KNOWN_FLOAT16_HAZARDS]
    with kerasmp.policy_scope(kerasmp.Policy("mixed_float16", without,
                                             float32_defaults=False)):
        broken, _ = worker.build(zoo)
    broken.set_weights(reference.get_weights())
    assert not np.isfinite(keras.ops.convert_to_numpy(broken(x))).all()


def test_flux_timestep_embedding_computes_its_phases_in_float32():
    """Flux's sinusoidal timestep embedding against the analytic one
    (float64 numpy): under kerasmp it is float32-accurate; computed in
    float16 (the rule removed, as stock `mixed_float16` does on JAX) the
    phases 1000 * t * freqs round to float16's spacing of 0.5 near 1000."""
    from keras_hub.src.models.flux.flux_maths import TimestepEmbedding

    dim = 64
    t = np.linspace(0.05, 1.0, 8).astype("float32")
    freqs = np.exp(-np.log(10000.0) * np.arange(dim // 2) / (dim // 2))
    phases = 1000.0 * t.astype("float64")[:, None] * freqs[None]
    expected = np.concatenate([np.cos(phases), np.sin(phases)], axis=-1)

    def error(layer):
        got = keras.ops.convert_to_numpy(layer(t, dim=dim)).astype("float64")
        return np.abs(got - expected).max()

    with kerasmp.policy_scope("mixed_float16"):
        layer = TimestepEmbedding()
    assert layer.compute_dtype == "float32"
    assert error(layer) < 1e-3
    without = [r for r in kerasmp.DEFAULT_FLOAT32_LAYERS
               if r is not kerasmp.policy.KNOWN_FLOAT16_HAZARDS]
    with kerasmp.policy_scope(kerasmp.Policy("mixed_float16", without,
                                             float32_defaults=False)):
        half = TimestepEmbedding()
    assert half.compute_dtype == "float16"
    assert error(half) > 1e-2
