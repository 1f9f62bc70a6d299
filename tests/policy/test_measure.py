"""The rules compile finds by one symbolic run (`kerasmp.policy.measure`):
layers that fail in float16 move to float32, MoE routers compute in
float32; both compared with the same model run in float32."""

import warnings

import keras
import numpy as np
import pytest
from keras import ops

import kerasmp
from kerasmp.policy.measure import measure

pytestmark = pytest.mark.torch  # also in the PyTorch pass (conftest.py)


@keras.saving.register_keras_serializable(package="kerasmp_tests")
class HalfRefusing(keras.layers.Layer):
    """A layer whose training code has no float16 path: like the auxiliary
    loss of keras-hub's Qwen3-MoE router (float16 x float32, in training
    only) or TensorFlow's `range` with a float16 dtype (ESM), it raises in
    float16 once `fit` traces it (building the model works)."""

    def call(self, x, training=None):
        if training and keras.backend.standardize_dtype(x.dtype) == "float16":
            raise TypeError("Range has no float16 kernel")
        return ops.tanh(x) * 2.0


@keras.saving.register_keras_serializable(package="kerasmp_tests")
class AlwaysFails(keras.layers.Layer):
    def call(self, x, training=None):
        if training:
            raise ValueError("broken in every dtype")
        return x


@keras.saving.register_keras_serializable(package="kerasmp_tests")
class TinyMoE(keras.layers.Layer):
    """A top-2-of-4 mixture of experts: a gate Dense (one score per
    expert), softmax, `top_k`, and the experts (Dense layers)."""

    def __init__(self, experts=4, units=8, **kwargs):
        super().__init__(**kwargs)
        self.gate = keras.layers.Dense(experts, use_bias=False, name="gate")
        self.experts = [keras.layers.Dense(units, name=f"expert_{i}")
                        for i in range(experts)]
        self.num_experts = experts

    def call(self, x):
        probs = ops.softmax(self.gate(x), axis=-1)
        weights, chosen = ops.top_k(probs, k=2)
        one_hot = ops.cast(ops.one_hot(chosen, self.num_experts),
                           weights.dtype)
        mask = ops.sum(one_hot * weights[..., None], axis=1)
        outs = ops.stack([e(x) for e in self.experts], axis=1)
        mask = ops.cast(mask, outs.dtype)
        return ops.sum(outs * mask[..., None], axis=1), chosen


def _model(layer, width=8):
    inputs = keras.Input((width,))
    h = keras.layers.Dense(width, name="pre")(inputs)
    out = layer(h)
    if isinstance(out, tuple):
        out = out[0]
    return keras.Model(inputs, keras.layers.Dense(2, name="head")(out))


def _float32_twin(model, build):
    kerasmp.set_global_policy("float32")
    twin = build()
    twin.set_weights(model.get_weights())
    return twin


def test_a_layer_that_fails_in_float16_moves_to_float32(mixed_policy):
    model = _model(HalfRefusing(name="refusing"))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        model.compile("adam", "mse")
    said = [str(w.message) for w in caught if "kerasmp: layer" in
            str(w.message)]
    assert len(said) == 1 and "'refusing' (HalfRefusing) fails in " \
        "float16 (Range has no float16 kernel); it computes in float32." \
        in said[0]
    assert model.get_layer("refusing").compute_dtype == "float32"
    assert model.get_layer("pre").compute_dtype == "float16"
    report = str(kerasmp.dtype_report(model))
    assert "fails in float16" in report
    x = np.random.default_rng(0).normal(size=(16, 8)).astype("float32")
    history = model.fit(x, np.zeros((16, 2)), epochs=1, verbose=0)
    assert np.isfinite(history.history["loss"]).all()
    twin = _float32_twin(model, lambda: _model(HalfRefusing()))
    np.testing.assert_allclose(model.predict(x, verbose=0),
                               twin.predict(x, verbose=0), atol=2e-2)


def test_the_move_is_saved_and_loaded(mixed_policy, tmp_path):
    model = _model(HalfRefusing(name="refusing"))
    model.compile("adam", "mse")
    model.save(tmp_path / "m.keras")
    kerasmp.set_global_policy("float32")
    loaded = keras.saving.load_model(tmp_path / "m.keras")
    assert loaded.get_layer("refusing").compute_dtype == "float32"
    assert loaded.get_layer("pre").compute_dtype == "float16"


def test_a_failure_float32_does_not_cure_is_left_to_fit(mixed_policy):
    model = _model(AlwaysFails(name="broken"))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        model.compile("adam", "mse")
    assert not [w for w in caught if "kerasmp: layer" in str(w.message)]
    assert model.get_layer("broken").compute_dtype == "float16"
    with pytest.raises(ValueError, match="broken in every dtype"):
        model.fit(np.zeros((2, 8), "float32"), np.zeros((2, 2)), verbose=0)


def test_a_dry_run_says_what_compile_would_move_and_changes_nothing(
        mixed_policy):
    model = _model(HalfRefusing(name="refusing"))
    moved = measure(model, kerasmp.global_policy(), dry_run=True)
    assert moved == [("refusing", "fails in float16")]
    assert model.get_layer("refusing").compute_dtype == "float16"


def test_check_reports_what_compile_would_move_before_compile(
        mixed_policy):
    """`kerasmp.check` before compile names the layer that fails in float16
    and the MoE router (the same dry run; nothing moves), and after compile
    (they now compute in float32) no longer reports them."""
    model = _model(HalfRefusing(name="refusing"))
    report = kerasmp.check(model)
    found = {(f.code, f.path) for f in report}
    assert ("fails_in_half", "refusing") in found
    assert model.get_layer("refusing").compute_dtype == "float16"
    model.compile("adam", "mse")
    assert "fails_in_half" not in {f.code for f in kerasmp.check(model)}

    routed = _model(TinyMoE(name="moe"))
    codes = {(f.code, f.path) for f in kerasmp.check(routed)}
    assert ("moe_router", "moe") in codes
    assert ("moe_router", "moe/gate") in codes
    assert routed.get_layer("moe").compute_dtype == "float16"


@pytest.mark.tensorflow
def test_an_op_mixing_float16_with_float32_trains_under_kerasmp(
        mixed_policy):
    import tensorflow as tf

    @keras.saving.register_keras_serializable(package="kerasmp_tests")
    class MixesDtypes(keras.layers.Layer):
        """A float32 table multiplied with a raw TensorFlow op (no dtype
        promotion), like keras-hub SAM's prompt encoder."""

        def call(self, x, training=None):
            table = tf.constant(np.eye(8, dtype="float32"))
            if training:
                return tf.matmul(x, table)
            return x

    model = _model(MixesDtypes(name="mixes"))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model.compile("adam", "mse")
    assert model.get_layer("mixes").compute_dtype == "float32"
    x = np.random.default_rng(1).normal(size=(16, 8)).astype("float32")
    history = model.fit(x, np.zeros((16, 2)), epochs=1, verbose=0)
    assert np.isfinite(history.history["loss"]).all()


@pytest.mark.tensorflow
def test_a_layer_that_traces_only_with_known_sizes_does_not_hide_the_rest(
        mixed_policy):
    """keras-hub's Qwen3.5-MoE: its GatedDeltaNet branches in Python on a
    size, which a symbolic run with an unknown batch size cannot do (in
    float32 too), so the float16 x float32 multiply of the MoE block
    behind it went unfound and `fit` failed; measured again with the sizes
    known, as `fit` traces, the block is found and moved."""
    import tensorflow as tf

    class NeedsKnownSizes(keras.layers.Layer):
        def call(self, x):
            if ops.shape(x)[1] > 0:  # a Python bool of the length
                return x * 2.0
            return x

        def compute_output_shape(self, shape):  # so the model builds
            return shape

    class MixesDtypes(keras.layers.Layer):
        def call(self, x, training=None):
            if training:  # a raw TensorFlow op: no dtype promotion
                return tf.multiply(x, tf.constant(np.float32(0.5)))
            return x

    inputs = keras.Input((None, 8))  # the length is known in fit only
    h = NeedsKnownSizes(name="sized")(keras.layers.Dense(8)(inputs))
    model = keras.Model(
        inputs, keras.layers.Dense(2)(MixesDtypes(name="mixes")(h)))
    with pytest.warns(UserWarning, match="'mixes'.*fails in float16"):
        model.compile("adam", "mse")
    assert model.get_layer("mixes").compute_dtype == "float32"
    assert model.get_layer("sized").compute_dtype == "float16"
    x = np.random.default_rng(3).normal(size=(16, 3, 8)).astype("float32")
    history = model.fit(x, np.zeros((16, 3, 2)), epochs=1, verbose=0)
    assert np.isfinite(history.history["loss"]).all()


@pytest.mark.tensorflow
def test_a_float16_range_of_known_length_moves_to_float32(mixed_policy):
    """keras-hub's RoFormerV2 and D-FINE: `ops.arange(0, length,
    dtype=x.dtype)` with float16 `x`. TensorFlow builds it with a free
    length, but `predict` and `fit` know the length, fold it into
    constants and refuse the op ("Unsupported dtype19 ... Range"), under
    stock `mixed_float16` too. The measurement runs once more with the
    sizes known, as they trace, finds the layer and moves it; the model
    then computes as in float32."""

    class Positions(keras.layers.Layer):
        def call(self, x):
            length = ops.shape(x)[1]
            position = ops.arange(0, length, dtype=x.dtype)
            return x + ops.sin(position)[None, :, None]

    def build():
        inputs = keras.Input((None, 4))  # the length: known in fit only
        h = Positions(name="positions")(keras.layers.Dense(4)(inputs))
        return keras.Model(inputs, keras.layers.Dense(2)(h))

    model = build()
    with pytest.warns(UserWarning, match=(
            "'positions'.*TensorFlow's Range op takes no float16")):
        model.compile("adam", "mse")
    assert model.get_layer("positions").compute_dtype == "float32"
    x = np.random.default_rng(0).normal(size=(8, 6, 4)).astype("float32")
    y = model.predict(x, verbose=0)
    twin = _float32_twin(model, build)
    want = keras.ops.convert_to_numpy(twin(x))
    assert np.max(np.abs(y - want)) / np.ptp(want) < 2e-2
    kerasmp.set_global_policy("mixed_float16")
    history = model.fit(x, np.zeros((8, 6, 2)), epochs=1, verbose=0)
    assert np.isfinite(history.history["loss"]).all()


@keras.saving.register_keras_serializable(package="kerasmp_tests")
class NoHalfAtBuild(keras.layers.Layer):
    """Raises on float16 inputs in every call, building the model
    included: like keras-hub Flux's `TimestepEmbedding` (a float16 `range`
    TensorFlow refuses), whose failure stops the model's construction,
    before there is a model to measure."""

    def call(self, x):
        if keras.backend.standardize_dtype(x.dtype) == "float16":
            raise TypeError("no float16 path")
        return ops.tanh(x) * 2.0


def test_a_layer_that_fails_while_the_model_is_built_moves_to_float32(
        mixed_policy):
    def build():
        return _model(NoHalfAtBuild(name="timestep"))

    with pytest.warns(UserWarning, match=(
            r"'timestep' \(NoHalfAtBuild\) fails in float16 \(no float16 "
            r"path\); it computes in float32")):
        model = build()
    assert model.get_layer("timestep").compute_dtype == "float32"
    assert model.get_layer("pre").compute_dtype == "float16"
    assert "fails in float16" in str(kerasmp.dtype_report(model))
    x = np.random.default_rng(0).normal(size=(16, 8)).astype("float32")
    model.compile("adam", "mse")
    history = model.fit(x, np.zeros((16, 2)), epochs=1, verbose=0)
    assert np.isfinite(history.history["loss"]).all()
    twin = _float32_twin(model, build)
    np.testing.assert_allclose(model.predict(x, verbose=0),
                               twin.predict(x, verbose=0), atol=2e-2)
    # Under Keras's own mixed_float16 the model cannot be built at all.
    kerasmp.set_global_policy(keras.DTypePolicy("mixed_float16"))
    with pytest.raises(TypeError, match="no float16 path"):
        build()


def test_a_build_failure_float32_does_not_cure_is_raised_unchanged(
        mixed_policy):
    class Broken(keras.layers.Layer):
        def call(self, x):
            raise ValueError(f"broken in {x.dtype}")

    layer = Broken(name="broken")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with pytest.raises(ValueError, match="broken in .*float16"):
            _model(layer)
    assert not [w for w in caught if "kerasmp: layer" in str(w.message)]
    assert layer.compute_dtype == "float16"  # put back


@keras.saving.register_keras_serializable(package="kerasmp_tests")
class NoHalfKernel(keras.layers.Layer):
    """Raises on float16 inputs once the model runs, in inference as in
    training, as ESM's rotary embedding (TensorFlow's `range` has no
    float16 kernel) and Moonshine's encoder block (a float32 + float16 add)
    do at their first `predict`; building the model (`training=None`)
    works, as it does for them."""

    def call(self, x, training=None):
        if training is not None and (
                keras.backend.standardize_dtype(x.dtype) == "float16"):
            raise TypeError("Range has no float16 kernel")
        return ops.tanh(x) * 2.0


@pytest.mark.parametrize("first", ["predict", "call"])
def test_a_model_is_measured_at_its_first_call_before_compile(first):
    if first == "predict" and keras.backend.backend() == "jax":
        pytest.skip("JAX's predict calls the model through stateless_call, "
                    "with its variables purged: measured at compile there")
    x = np.random.default_rng(2).normal(size=(4, 8)).astype("float32")
    keras.config.set_dtype_policy("float32")
    keras.utils.set_random_seed(0)
    reference = _model(NoHalfKernel(name="no_half"))
    expected = reference.predict(x, verbose=0)

    kerasmp.set_global_policy("mixed_float16")
    model = _model(NoHalfKernel(name="no_half"))
    model.set_weights(reference.get_weights())
    assert model.get_layer("no_half").compute_dtype == "float16"
    with pytest.warns(UserWarning, match="'no_half'.*fails in float16"):
        if first == "predict":
            got = model.predict(x, verbose=0)
        else:
            got = keras.ops.convert_to_numpy(model(x))
    assert model.get_layer("no_half").compute_dtype == "float32"
    np.testing.assert_allclose(np.asarray(got, "float32"), expected,
                               atol=2e-2 * np.ptp(expected))
    # Measured once: compiling later moves nothing more, warns nothing.
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        model.compile("adam", "mse")


def _near_ties(seed=0, n=256):
    """Inputs whose gate scores for the second and third experts differ by
    0.01 per unit of input near 39: float16 (spacing 1/32 there) rounds the
    two to a tie and `top_k` keeps the lower index, float32 does not."""
    rng = np.random.default_rng(seed)
    x = np.zeros((n, 8), "float32")
    x[:, 0] = rng.uniform(1.0, 1.5, size=n)
    kernel = np.zeros((8, 4), "float32")
    kernel[0] = [40.0, 39.0, 39.01, 30.0]
    return x, kernel


def _moe_model():
    inputs = keras.Input((8,))
    out, chosen = TinyMoE(name="moe")(inputs)
    return keras.Model(inputs, [out, chosen])


def test_the_router_computes_in_float32_and_picks_float32s_experts(
        mixed_policy):
    model = _moe_model()
    model.compile("adam", "mse")
    moe = model.get_layer("moe")
    assert moe.compute_dtype == "float32"
    assert moe.gate.compute_dtype == "float32"
    assert {e.compute_dtype for e in moe.experts} == {"float16"}
    report = str(kerasmp.dtype_report(model))
    assert "MoE router (calls top_k)" in report
    assert "MoE router scores (moe)" in report
    x, kernel = _near_ties()
    moe.gate.kernel.assign(kernel)
    twin = _float32_twin(model, _moe_model)
    _, chosen = model.predict(x, verbose=0)
    _, expected = twin.predict(x, verbose=0)
    assert (np.sort(expected, 1) == [0, 2]).all()  # float32's choice
    np.testing.assert_array_equal(np.sort(chosen, 1), np.sort(expected, 1))
