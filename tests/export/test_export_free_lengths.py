"""Free lengths in the SavedModel written from JAX, and captured constants
in ONNX from TensorFlow (issue 26: the census's export column).

From JAX, stock Keras's jax2tf route gives every unknown length its own
symbol, so a keras-hub transformer cannot be traced at all (its padding
mask's length does not broadcast against the tokens'), and a position
embedding's slice of `max_sequence_length` rows is undecidable for a free
length. kerasmp names the lengths of equal size in the parity inputs with
one symbol, settles such comparisons with a constraint that the file
checks when called, and runs the file against the model before keeping
it; otherwise it fixes the lengths to the parity inputs'.

References: the float32 model rebuilt from the backbone's config with the
same weights, run by Keras, against the SavedModel run by
`tf.saved_model.load` (no Keras) and the ONNX file run by onnxruntime;
the constraints against the comparisons worked out by hand.
"""

import warnings

import keras
import numpy as np
import pytest
from _helpers import keras_hub_or_skip

from kerasmp import export as kx
from kerasmp.export import savedmodel
from kerasmp.policy import Policy
from kerasmp.policy import policy_scope

BACKEND = keras.backend.backend()
LENGTH = 12  # the parity inputs' length
MAX_LENGTH = 16  # the backbone's position-embedding table


# --------------------------------------------------------------------------
# The pure parts: symbols and constraints
# --------------------------------------------------------------------------


def test_lengths_of_equal_size_share_a_symbol():
    specs = [("ids", (None, None), "int32"), ("mask", (None, None), "int32"),
             ("image", (None, 8, None, 3), "float32")]
    example = [np.zeros((4, 12)), np.zeros((4, 12)),
               np.zeros((4, 8, 7, 3))]
    shapes, sizes = savedmodel.jax_shapes(specs, example)
    assert shapes == ["(batch, d0)", "(batch, d0)", "(batch, 8, d1, 3)"]
    assert sizes == {"d0": 12, "d1": 7, "batch": 4}


def test_failing_at_fixed_lengths_too_raises_that_error_caused_by_the_first():
    # RWKV-7's ONNX: the free length fails in a Python loop over it, the
    # fixed one in the converter; the second is what the user must act on.
    from kerasmp.export.lengths import free_or_fixed

    attempts = []

    def write(specs):
        attempts.append(specs[0][1])
        if specs[0][1][1] is None:
            raise TypeError("loop over a symbolic length")
        raise ValueError("No Op registered for TensorListReserve")

    example = [np.zeros((4, 6), "int32")]
    with pytest.raises(ValueError, match="TensorListReserve") as info:
        free_or_fixed(write, None, None, [("x", (None, None), "int32")],
                      example, "ONNX file")
    assert isinstance(info.value.__cause__, TypeError)
    assert attempts == [(None, None), (None, 6)]


@pytest.mark.parametrize("message,size,want", [
    # keras-hub PositionEmbedding: a slice as long as the input from a
    # table of 5 rows; a sample of length 3 lies inside.
    ("Symbolic dimension comparison 'd0' <= '5' is inconclusive.", 3,
     "d0 <= 5"),
    # ... a sample of length 7 does not: the other side of the branch.
    ("comparison 'd0' <= '5' is inconclusive", 7, "d0 >= 6"),
    ("comparison 'd0' < '5' is inconclusive", 3, "d0 <= 4"),
    ("comparison 'd0' < '5' is inconclusive", 5, "d0 >= 5"),
    ("comparison 'd0' >= '5' is inconclusive", 5, "d0 >= 5"),
    ("comparison 'd0' > '5' is inconclusive", 5, "d0 <= 5"),
    # The number on the left: 5 >= d0 is d0 <= 5.
    ("comparison '5' >= 'd0' is inconclusive", 2, "d0 <= 5"),
    # Equality cannot be a range; nor an expression of several symbols.
    ("comparison 'd0' == '5' is inconclusive", 5, None),
    ("comparison 'mod(d0, 2)' != '0' is inconclusive", 4, None),
    ("comparison 'd0' <= 'd1' is inconclusive", 4, None),
    ("min got incompatible shapes for broadcasting", 4, None),
])
def test_a_constraint_decides_the_comparison_as_the_sample_does(
        message, size, want):
    assert savedmodel.constraint_for(
        ValueError(message), {"d0": size, "batch": 2}) == want


# --------------------------------------------------------------------------
# The JAX route, on keras-hub backbones
# --------------------------------------------------------------------------


def _reference(model, inputs):
    with policy_scope("float32"):
        ref = type(model).from_config(model.get_config())
    ref.set_weights(model.get_weights())
    y = ref(inputs)
    return keras.ops.convert_to_numpy(
        y["sequence_output"] if isinstance(y, dict) else y)


def _tokens(n, length, seed=0):
    rng = np.random.default_rng(seed)
    ids = rng.integers(0, 64, (n, length)).astype("int32")
    mask = np.ones((n, length), "int32")
    mask[: n // 4, -2:] = 0  # some padding
    return {"token_ids": ids, "padding_mask": mask}


def _serve(path, inputs):
    import tensorflow as tf

    fn = tf.saved_model.load(path).signatures["serving_default"]
    y = fn(**{k: tf.constant(v) for k, v in inputs.items()})
    return y["output_0"].numpy() if "output_0" in y else y[
        "sequence_output"].numpy()


def _export(model, path, sample):
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        report = kx.export(model, path, format="savedmodel", sample=sample,
                           gate=True)
    return report, [str(w.message) for w in caught
                    if "kerasmp.export" in str(w.message)]


def _close(y, want):
    return np.max(np.abs(y - want)) / np.ptp(want) < 2e-2


class _TopK(keras.layers.Layer):
    """Keeps each row's 2 largest values, as keras-hub's MoE routers pick
    experts."""

    def call(self, x):
        values, _ = keras.ops.top_k(x, 2)
        return values


@pytest.mark.skipif(BACKEND != "jax", reason="the JAX route (jax2tf)")
def test_a_savedmodel_from_jax_that_tensorflow_cannot_run_is_one_sentence(
        tmp_path):
    # JAX 0.10 writes top_k as a StableHLO composite that TensorFlow 2.21
    # cannot read: the file must not fail later, nor with TensorFlow's
    # graph-execution error, but say what works. With versions that read
    # it, the file must compute what the model does.
    with policy_scope(Policy("mixed_float16")):
        inputs = keras.Input((6,), name="x")
        model = keras.Model(inputs, _TopK()(keras.layers.Dense(6)(inputs)))
    x = np.random.default_rng(0).uniform(-1, 1, (8, 6)).astype("float32")
    path = str(tmp_path / "sm")
    try:
        report = kx.export(model, path, format="savedmodel", sample=x)
    except ValueError as e:
        assert type(e) is ValueError
        text = str(e)
        assert "from JAX (jax2tf)" in text
        assert "KERAS_BACKEND=tensorflow" in text and "'keras'" in text
        assert "\n" not in text
        return
    assert report.rel_diff < 2e-2


@pytest.mark.skipif(BACKEND != "jax", reason="the JAX route (jax2tf)")
def test_bert_savedmodel_from_jax_serves_every_length_up_to_its_table(
        tmp_path):
    keras_hub = keras_hub_or_skip()
    keras.utils.set_random_seed(0)
    with policy_scope(Policy("mixed_float16")):
        model = keras_hub.models.BertBackbone(
            vocabulary_size=64, num_layers=1, num_heads=2, hidden_dim=16,
            intermediate_dim=32, max_sequence_length=MAX_LENGTH)
    sample = {**_tokens(16, LENGTH),
              "segment_ids": np.zeros((16, LENGTH), "int32")}
    path = str(tmp_path / "bert")
    report, said = _export(model, path, sample)
    assert report.rel_diff < 2e-2
    # One warning, naming the lengths and the bound; none about fixing them.
    assert len(said) == 1, said
    assert f"up to {MAX_LENGTH}" in said[0] and "token_ids" in said[0]
    assert "fixed length" not in said[0]
    for length in (LENGTH, 5, MAX_LENGTH):  # shorter and longer than sample
        x = {**_tokens(3, length, seed=length),
             "segment_ids": np.zeros((3, length), "int32")}
        assert _close(_serve(path, x), _reference(model, x)), length
    too_long = {**_tokens(3, MAX_LENGTH + 1),
                "segment_ids": np.zeros((3, MAX_LENGTH + 1), "int32")}
    with pytest.raises(Exception, match="constraint|shape"):
        _serve(path, too_long)


@pytest.mark.skipif(BACKEND != "jax", reason="the JAX route (jax2tf)")
def test_decoder_savedmodel_from_jax_keeps_lengths_free(tmp_path):
    # Stock Keras's symbols (one per input) cannot trace a keras-hub
    # decoder: "min got incompatible shapes for broadcasting: (batch, 1,
    # a), (batch, b, b)" (the mask's length against the tokens').
    keras_hub = keras_hub_or_skip()
    keras.utils.set_random_seed(0)
    with policy_scope(Policy("mixed_float16")):
        model = keras_hub.models.LlamaBackbone(
            vocabulary_size=64, num_layers=1, num_query_heads=2,
            num_key_value_heads=1, hidden_dim=16, intermediate_dim=32)
    sample = _tokens(16, LENGTH)
    with pytest.raises(Exception, match="broadcast"):
        archive = keras.export.ExportArchive()  # stock's symbols
        archive.track(model)
        archive.add_endpoint(
            "serve", lambda ids, mask: model(
                {"token_ids": ids, "padding_mask": mask}),
            input_signature=[keras.InputSpec(shape=(None, None),
                                             dtype="int32")] * 2)
        archive.write_out(str(tmp_path / "stock"), verbose=False)
    path = str(tmp_path / "llama")
    report, said = _export(model, path, sample)
    assert said == [] and report.rel_diff < 2e-2
    for length in (3, LENGTH, 2 * LENGTH + 1):  # any length
        x = _tokens(2, length, seed=length)
        assert _close(_serve(path, x), _reference(model, x)), length


@pytest.mark.skipif(BACKEND != "jax", reason="the JAX route (jax2tf)")
def test_a_branch_on_a_free_length_falls_back_to_the_samples(tmp_path):
    # jax2tf decides `length % 2 == 0` as False for a free length: the
    # file would silently compute the odd branch. kerasmp runs the file
    # against the model, then fixes the length, with a warning.
    class EvenOnly(keras.layers.Layer):
        def call(self, x):
            if x.shape[1] is not None and x.shape[1] % 2 == 0:
                return x * 2.0
            return x

    with policy_scope(Policy("mixed_float16")):
        inputs = keras.Input((None, 4), name="x")
        model = keras.Model(inputs, keras.layers.Dense(3)(EvenOnly()(inputs)))
    sample = np.random.default_rng(0).uniform(0, 1, (8, 6, 4)).astype(
        "float32")
    path = str(tmp_path / "even")
    report, said = _export(model, path, sample)
    assert report.rel_diff < 2e-2
    assert len(said) == 1 and "fixed length (x: (None, 6, 4)" in said[0]
    assert "computes something else" in said[0]
    import tensorflow as tf

    fn = tf.saved_model.load(path).signatures["serving_default"]
    assert fn.structured_input_signature[1]["x"].shape.as_list() == [
        None, 6, 4]


@pytest.mark.tensorflow
@pytest.mark.parametrize("fmt,name", [("savedmodel", "sm"),
                                      ("onnx", "m.onnx")])
def test_a_loop_over_the_length_gets_the_samples_length(tmp_path, fmt,
                                                        name):
    # keras-hub RWKV-7's time mix: `for t in range(T)` needs a Python int,
    # which a free length is not ("'SymbolicTensor' object cannot be
    # interpreted as an integer"): the file takes the parity inputs'
    # length, with a warning saying so and why.
    class Scan(keras.layers.Layer):
        def call(self, x):
            total, out = 0.0, []
            for t in range(ops_shape(x)[1]):
                total = total + x[:, t]
                out.append(total)
            return keras.ops.stack(out, axis=1)

        def compute_output_shape(self, shape):  # so the model builds
            return shape

    def ops_shape(x):
        return keras.ops.shape(x)

    def build():
        inputs = keras.Input((None, 4), name="x")
        h = keras.layers.Dense(4)(inputs)
        return keras.Model(inputs, keras.layers.Dense(2)(Scan()(h)))

    with policy_scope(Policy("mixed_float16")):
        model = build()
    sample = np.random.default_rng(0).uniform(0, 1, (8, 5, 4)).astype(
        "float32")
    path = str(tmp_path / name)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        report = kx.export(model, path, format=fmt, sample=sample, gate=True)
    said = [str(w.message) for w in caught if "fixed length" in
            str(w.message)]
    assert len(said) == 1 and "(x: (None, 5, 4)" in said[0]
    assert "cannot be interpreted as an integer" in said[0], said
    with policy_scope("float32"):
        ref = build()
    ref.set_weights(model.get_weights())
    x = sample[:3]
    if fmt == "savedmodel":
        y = _serve(path, {"x": x})
    else:
        import onnxruntime

        y = onnxruntime.InferenceSession(path).run(None, {"x": x})[0]
    assert _close(y, keras.ops.convert_to_numpy(ref(x)))
    assert report.rel_diff < 2e-2


# --------------------------------------------------------------------------
# ONNX from TensorFlow: a constant the trace captures
# --------------------------------------------------------------------------


@pytest.mark.tensorflow
def test_onnx_of_a_model_scaling_by_a_captured_constant(tmp_path):
    # keras-hub Gemma's `x * ops.cast(ops.sqrt(hidden_dim), x.dtype)`: a
    # tensor built with the functional model, captured by the trace, which
    # tf2onnx's `from_function` made a graph input that onnxruntime then
    # asked for in every feed.
    import onnxruntime

    with policy_scope(Policy("mixed_float16")):
        inputs = keras.Input((8,), name="x")
        h = keras.layers.Dense(8)(inputs)
        h = h * keras.ops.cast(keras.ops.sqrt(8.0), h.dtype)
        model = keras.Model(inputs, keras.layers.Dense(2)(h))
    path = str(tmp_path / "m.onnx")
    report = kx.export(model, path, format="onnx", gate=True)
    session = onnxruntime.InferenceSession(path)
    assert [i.name for i in session.get_inputs()] == ["x"]
    x = np.random.default_rng(0).uniform(0, 1, (5, 8)).astype("float32")
    y = session.run(None, {"x": x})[0]
    with policy_scope("float32"):
        ref = keras.Model.from_config(model.get_config())
    ref.set_weights(model.get_weights())
    assert _close(y, keras.ops.convert_to_numpy(ref(x)))
    assert report.rel_diff < 2e-2


@pytest.mark.tensorflow
def test_onnx_of_a_grouped_convolution(tmp_path):
    # Keras's TensorFlow backend runs a grouped convolution through an XLA
    # function (keras.applications ConvNeXt, keras-hub HGNetV2), which the
    # frozen graph kept as a PartitionedCall onnxruntime cannot load.
    import onnx
    import onnxruntime

    with policy_scope(Policy("mixed_float16")):
        inputs = keras.Input((6, 6, 4), name="x")
        h = keras.layers.Conv2D(4, 3, groups=4, padding="same")(inputs)
        model = keras.Model(inputs, keras.layers.Conv2D(2, 1)(h))
    path = str(tmp_path / "m.onnx")
    kx.export(model, path, format="onnx", gate=True)
    ops = {node.op_type for node in onnx.load(path).graph.node}
    assert "Conv" in ops and not ops & {"PartitionedCall",
                                        "StatefulPartitionedCall"}
    x = np.random.default_rng(0).uniform(0, 1, (3, 6, 6, 4)).astype("float32")
    y = onnxruntime.InferenceSession(path).run(None, {"x": x})[0]
    with policy_scope("float32"):
        ref = keras.Model.from_config(model.get_config())
    ref.set_weights(model.get_weights())
    assert _close(y, keras.ops.convert_to_numpy(ref(x)))


@pytest.mark.tensorflow
@pytest.mark.parametrize("interpolation", ["bilinear", "bicubic"])
def test_onnx_of_a_float16_resize(tmp_path, interpolation):
    # tf.image.resize reads float16 and returns float32 (keras-hub
    # DeepLabV3, SegFormer); ONNX's Resize returned float16 and the clip
    # after it mixed the two, which onnxruntime refused to load.
    import onnxruntime

    with policy_scope(Policy("mixed_float16")):
        inputs = keras.Input((5, 5, 3), name="x")
        h = keras.layers.Conv2D(3, 1)(inputs)
        h = keras.layers.Resizing(9, 7, interpolation=interpolation)(h)
        model = keras.Model(inputs, keras.layers.Conv2D(2, 1)(h))
    path = str(tmp_path / "m.onnx")
    kx.export(model, path, format="onnx", gate=True)
    x = np.random.default_rng(0).uniform(0, 1, (3, 5, 5, 3)).astype("float32")
    y = onnxruntime.InferenceSession(path).run(None, {"x": x})[0]
    with policy_scope("float32"):
        ref = keras.Model.from_config(model.get_config())
    ref.set_weights(model.get_weights())
    assert y.shape == (3, 9, 7, 2)
    assert _close(y, keras.ops.convert_to_numpy(ref(x)))


@pytest.mark.tensorflow
def test_onnx_of_a_resize_whose_scale_is_not_exact_in_float32(tmp_path):
    # keras-hub DepthAnything's neck: 5 x 5 resized to 9 x 9, then added to
    # a 9 x 9 map. tf2onnx stored the scale 9 / 5 as 1.7999999523, ONNX
    # infers floor(5 * scale) = 8, and onnxruntime refused the Add.
    import onnxruntime

    def build():
        small = keras.Input((5, 5, 3), name="small")
        large = keras.Input((9, 9, 3), name="large")
        h = keras.layers.Conv2D(4, 1, name="a")(small)
        h = keras.layers.Resizing(9, 9, name="up")(h)
        h = keras.layers.Add()([h, keras.layers.Conv2D(4, 1, name="b")(large)])
        return keras.Model([small, large], keras.layers.Conv2D(2, 1)(h))

    with policy_scope(Policy("mixed_float16")):
        model = build()
    path = str(tmp_path / "m.onnx")
    kx.export(model, path, format="onnx")
    rng = np.random.default_rng(0)
    x = {"small": rng.uniform(0, 1, (3, 5, 5, 3)).astype("float32"),
         "large": rng.uniform(0, 1, (3, 9, 9, 3)).astype("float32")}
    y = onnxruntime.InferenceSession(path).run(None, x)[0]
    with policy_scope("float32"):
        ref = build()
    ref.set_weights(model.get_weights())
    assert y.shape == (3, 9, 9, 2)
    assert _close(y, keras.ops.convert_to_numpy(ref(x)))


@pytest.mark.tensorflow
def test_onnx_of_a_float16_select_with_an_infinite_branch(tmp_path):
    # keras-hub Gemma3n's attention: `ops.where(mask, logits, -1e9)` in
    # float16, where -1e9 is -inf. tf2onnx writes a float16 select as
    # `cond * x + (1 - cond) * y` (its inf check covers float32 only), and
    # 0 * -inf made every masked softmax row NaN under onnxruntime.
    import onnxruntime

    class MaskedSoftmax(keras.layers.Layer):
        def call(self, x):
            logits = keras.ops.where(x > 0.5, x * 3.0, -1e9)
            return keras.ops.softmax(logits, axis=-1)

    def build():
        inputs = keras.Input((8,), name="x")
        h = keras.layers.Dense(8, name="pre")(inputs)
        h = MaskedSoftmax(name="masked")(h)
        return keras.Model(inputs, keras.layers.Dense(2, name="out")(h))

    with policy_scope(Policy("mixed_float16")):
        model = build()
    assert model.get_layer("masked").compute_dtype == "float16"
    path = str(tmp_path / "m.onnx")
    kx.export(model, path, format="onnx")
    x = np.random.default_rng(0).uniform(0, 1, (16, 8)).astype("float32")
    y = onnxruntime.InferenceSession(path).run(None, {"x": x})[0]
    with policy_scope("float32"):
        ref = build()
    ref.set_weights(model.get_weights())
    assert np.isfinite(y).all()
    assert _close(y, keras.ops.convert_to_numpy(ref(x)))


# --------------------------------------------------------------------------
# Layers kerasmp's measurement moved to float32 stay float32 in the copy
# --------------------------------------------------------------------------


def test_a_layer_measured_to_fail_in_float16_stays_float32_in_the_export(
        tmp_path):
    # keras-hub ESM's rotary embedding (a float16 `range` TensorFlow
    # refuses): the model predicts under kerasmp, where measurement moved
    # the layer to float32; the half-precision copy must keep it so, or
    # its SavedModel fails to trace.
    class NoHalf(keras.layers.Layer):
        def call(self, x):
            if keras.backend.standardize_dtype(x.dtype) == "float16":
                raise TypeError("no float16 path")
            return keras.ops.tanh(x) * 2.0

    def build():
        inputs = keras.Input((8,), name="x")
        h = NoHalf(name="rotary")(keras.layers.Dense(8, name="pre")(inputs))
        return keras.Model(inputs, keras.layers.Dense(2)(h))

    with policy_scope(Policy("mixed_float16")):
        with pytest.warns(UserWarning, match="'rotary'.*fails in float16"):
            model = build()
    half = kx.to_float16(model)
    assert half.kept_float32["rotary"] == "fails in float16"
    assert half.layer_compute_dtypes()["pre"] == "float16"
    path = str(tmp_path / "sm")
    report = kx.export(model, path, format="savedmodel", gate=True)
    assert "rotary" in report.kept_float32
    with policy_scope("float32"):
        ref = build()
    ref.set_weights(model.get_weights())
    x = np.random.default_rng(0).uniform(0, 1, (5, 8)).astype("float32")
    assert _close(_serve(path, {"x": x}), keras.ops.convert_to_numpy(ref(x)))
