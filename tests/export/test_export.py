"""Tests for kerasmp.export: half-precision copies and exports with parity.

References are independent of kerasmp.export: each model is rebuilt by its
builder in plain float32 and loaded with the trained master weights
(`get_weights()`), and exported artifacts are read back here with their own
runtimes (Keras, `tf.saved_model.load` in a fresh process, ai_edge_litert).
"""

import glob
import json
import os
import re
import subprocess
import sys
import textwrap

import keras
import numpy as np
import pytest
from _models import single_dense
from _models import transformer_classifier
from keras import layers

from kerasmp import export as kx
from kerasmp.export.inputs import input_specs
from kerasmp.export.parity import size as artifact_size
from kerasmp.policy import Policy
from kerasmp.policy import policy_scope

BACKEND = keras.backend.backend()
tensorflow_only = pytest.mark.tensorflow
N_PARITY = 512


# --------------------------------------------------------------------------
# Models
# --------------------------------------------------------------------------


def build_cnn():
    inputs = keras.Input((12, 12, 3), name="pixels")
    x = inputs
    for i, filters in enumerate((16, 32)):
        x = layers.Conv2D(filters, 3, padding="same", name=f"conv{i}")(x)
        x = layers.BatchNormalization(name=f"bn{i}")(x)
        x = layers.ReLU()(x)
    x = layers.GlobalAveragePooling2D()(x)
    x = layers.Dense(640, activation="relu", name="fc1")(x)
    x = layers.Dense(640, activation="relu", name="fc2")(x)
    outputs = layers.Dense(10, activation="softmax", name="head")(x)
    return keras.Model(inputs, outputs, name="cnn")


def build_transformer():
    # ff1 uses Keras's exact GELU (erfc): the ONNX test below checks it.
    return transformer_classifier(
        seq=16, features=32, dim=128, heads=4, key_dim=32, feed_forward=1024,
        classes=10, name="transformer")


BUILDERS = {"cnn": build_cnn, "transformer": build_transformer}
INPUT_SHAPES = {"cnn": (12, 12, 3), "transformer": (16, 32)}
# Layers the kerasmp policy computes in float32 (its default rules).
EXPECTED_KEPT = {
    "cnn": {"bn0", "bn1", "head"},
    "transformer": {"mha/softmax", "ln1", "ln2", "head"},
}


def _data(name, n, seed):
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((n,) + INPUT_SHAPES[name]).astype("float32")
    # A learnable task: the class is a fixed linear function of the mean
    # over positions, so the trained model is confident and top-1 is stable.
    w = np.random.default_rng(123).standard_normal((x.shape[-1], 10))
    y = (x.reshape(n, -1, x.shape[-1]).mean(1) @ w).argmax(-1)
    return x, y


def _train(name):
    """Trains briefly under the kerasmp float16 policy."""
    with policy_scope(Policy("mixed_float16")):
        model = BUILDERS[name]()
    model.compile(
        optimizer=keras.optimizers.Adam(2e-3),
        loss="sparse_categorical_crossentropy",
        # XLA: TensorFlow's float16 convolutions without it are 100x slower
        # on a CPU (the CNN took a minute to train).
        jit_compile=True,
    )
    x, y = _data(name, 1024, seed=1)
    model.fit(x, y, epochs=3, batch_size=64, verbose=0)
    return model


@pytest.fixture(scope="module")
def trained():
    cache = {}

    def get(name):
        if name not in cache:
            cache[name] = _train(name)
        return cache[name]

    return get


def float32_reference(name, model):
    """The same architecture built in plain float32 with the master weights."""
    with policy_scope("float32"):
        ref = BUILDERS[name]()
    ref.set_weights(model.get_weights())
    return ref


def parity_inputs(name):
    return _data(name, N_PARITY, seed=7)[0]


def assert_parity(name, ref_probs, probs):
    probs = np.asarray(probs, dtype=np.float64)
    assert np.all(np.isfinite(probs))
    assert np.max(np.abs(probs - ref_probs)) <= 1e-2
    agreement = np.mean(probs.argmax(-1) == ref_probs.argmax(-1))
    assert agreement >= 0.99


def _unsuffixed(path):
    """`mha/softmax_3` -> `mha/softmax`: Keras numbers auto-named layers."""
    return re.sub(r"_\d+$", "", path)


def _variables_bytes(model):
    return sum(
        int(np.prod(v.shape)) * np.dtype(v.dtype).itemsize
        for v in model.weights
    )


# --------------------------------------------------------------------------
# to_float16
# --------------------------------------------------------------------------


@pytest.mark.parametrize("name", ["cnn", "transformer"])
def test_to_float16_dtypes_and_kept_layers(trained, name):
    model = trained(name)
    half = kx.to_float16(model)

    # The copy's variables, by the original variable's path: float32 for
    # the kept layers, float16 for the others.
    var_dtypes = half.variable_dtype_map()
    kept, half_layers = set(), 0
    for path, dtype in half.layer_compute_dtypes().items():
        own = [d for p, d in var_dtypes.items()
               if p.rsplit("/", 1)[0] == path]
        if dtype == "float32":
            kept.add(_unsuffixed(path))
            assert all(d == "float32" for d in own)
        else:
            assert dtype == "float16"
            assert all(d == "float16" for d in own)
            half_layers += 1
    assert kept == EXPECTED_KEPT[name]
    assert {_unsuffixed(p) for p in half.kept_float32} == kept
    assert half_layers >= 5
    # float32 inputs, and the original model is untouched.
    assert all(v.dtype == "float32" for v in model.weights)
    assert not half.compiled
    # Half the bytes, give or take the kept layers.
    assert _variables_bytes(half) / _variables_bytes(model) < 0.52

    ref = float32_reference(name, model)
    x = parity_inputs(name)
    assert_parity(
        name, ref.predict(x, verbose=0).astype(np.float64),
        half.predict(x, verbose=0),
    )


def test_float16_inputs_and_bfloat16(trained):
    model = trained("cnn")
    half = kx.to_float16(model, float16_inputs=True)
    assert [d for _, _, d in input_specs(half)] == ["float16"]
    x16 = parity_inputs("cnn")[:8].astype("float16")
    assert np.all(np.isfinite(half.predict(x16, verbose=0)))
    bf16 = kx.to_float16(model, dtype="bfloat16")
    var_dtypes = bf16.variable_dtype_map()
    assert var_dtypes["fc1/kernel"] == "bfloat16"
    assert var_dtypes["bn0/moving_variance"] == "float32"
    ref = float32_reference("cnn", model)
    x = parity_inputs("cnn")[:64]
    diff = np.abs(bf16.predict(x, verbose=0) - ref.predict(x, verbose=0))
    assert diff.max() <= 5e-2  # bfloat16 keeps 8 bits of mantissa


def _huge_variance_model():
    # Seeded: with an unseeded Dense kernel, a sample whose channel-0
    # pre-activation happens to be near 0 made the test flaky.
    keras.utils.set_random_seed(0)
    inputs = keras.Input((4,))
    x = layers.Dense(4, name="dense")(inputs)
    outputs = layers.BatchNormalization(name="bn")(x)
    model = keras.Model(inputs, outputs)
    variance = np.ones(4, "float32")
    variance[0] = 1e5  # > 65504: inf in float16
    model.get_layer("bn").moving_variance.assign(variance)
    model.get_layer("bn").beta.assign(np.zeros(4, "float32"))
    x = np.random.default_rng(0).standard_normal((64, 4)).astype("float32")
    return model, x * 300.0


def test_batchnorm_beyond_float16_range_is_kept_in_float32():
    model, x = _huge_variance_model()
    ref = model.predict(x, verbose=0)
    assert np.all(np.abs(ref[:, 0]) > 1e-3)  # channel 0 carries signal

    # Without the rule: the stock recipe (clone every layer with
    # dtype="float16", copy the weights) turns the variance into inf and
    # silently zeroes channel 0 (beta = 0), without any NaN.
    def to_half(layer):
        config = layer.get_config()
        if "dtype" in config:
            config["dtype"] = "float16"
        return layer.__class__.from_config(config)

    naive = keras.models.clone_model(model, clone_function=to_half)
    naive.set_weights(model.get_weights())
    assert np.isinf(keras.ops.convert_to_numpy(
        naive.get_layer("bn").moving_variance)[0])
    naive_out = naive.predict(x, verbose=0)
    assert np.all(naive_out[:, 0] == 0.0)
    assert np.all(np.isfinite(naive_out))

    # With it: kept in float32 even when the normalization rule is off,
    # with a warning naming the layer and the weight.
    with pytest.warns(UserWarning, match=r"'bn'.*moving_variance.*65504"):
        half = kx.to_float16(model, keep_float32=())
    assert half.layer_compute_dtypes()["bn"] == "float32"
    var_dtypes = half.variable_dtype_map()
    assert all(d == "float32" for p, d in var_dtypes.items()
               if p.startswith("bn/"))
    assert var_dtypes["dense/kernel"] == "float16"
    out = half.predict(x, verbose=0)
    np.testing.assert_allclose(out, ref, rtol=2e-3, atol=0.5)
    # (|ref| reaches ~800: float16 inputs to the BN carry ~0.05% error.)

    # Default rules keep it too (normalization), still with the warning.
    with pytest.warns(UserWarning, match="moving_variance"):
        kx.to_float16(model)


class Block(keras.layers.Layer):
    """A subclassed layer; kept out of the Keras registry on purpose."""

    def __init__(self, units=8, **kwargs):
        super().__init__(**kwargs)
        self.units = units

    def build(self, input_shape):
        self.dense = layers.Dense(self.units, dtype=self.dtype_policy)
        self.dense.build(input_shape)
        self.norm = layers.LayerNormalization(dtype=self.dtype_policy)
        self.norm.build(input_shape[:-1] + (self.units,))

    def call(self, x):
        return self.norm(self.dense(x))

    def get_config(self):
        return {**super().get_config(), "units": self.units}


@keras.saving.register_keras_serializable(package="kerasmp_test")
class TinyNet(keras.Model):
    def __init__(self, units=8, **kwargs):
        super().__init__(**kwargs)
        self.units = units
        self.hidden = layers.Dense(units, activation="relu")
        self.bn = layers.BatchNormalization()
        self.out = layers.Dense(3, activation="softmax")

    def call(self, x):
        return self.out(self.bn(self.hidden(x)))

    def get_config(self):
        return {**super().get_config(), "units": self.units}


class NoConfigNet(keras.Model):
    def __init__(self, table, **kwargs):
        super().__init__(**kwargs)
        self.table = table  # not serializable: no automatic get_config
        self.dense = layers.Dense(3)

    def call(self, x):
        return self.dense(x)


def _nested_functional():
    inner = keras.Sequential(
        [keras.Input((8,)), layers.Dense(8, name="inner_dense"),
         layers.LayerNormalization(name="inner_ln")],
        name="inner",
    )
    a = keras.Input((8,), name="a")
    b = keras.Input((8,), name="b")
    x = inner(a) + layers.Dense(8, name="b_dense")(b)  # an op node
    x = keras.ops.relu(x)
    x = Block(8, name="block")(x)  # nested LayerNormalization made in build
    x = layers.Dense(3, name="logits")(x)
    return keras.Model([a, b], layers.Softmax(name="probs")(x))


@pytest.mark.parametrize("kind", ["nested_functional", "subclassed"])
def test_nested_op_nodes_and_subclassed(kind):
    with policy_scope(Policy("mixed_float16")):
        model = _nested_functional() if kind != "subclassed" else TinyNet(8)
    rng = np.random.default_rng(0)
    if kind == "subclassed":
        x = rng.standard_normal((32, 8)).astype("float32")
        model(x)
    else:
        x = [rng.standard_normal((32, 8)).astype("float32") for _ in "ab"]
    with policy_scope("float32"):
        ref_model = _nested_functional() if kind != "subclassed" else TinyNet(8)
        ref_model(x)
    ref_model.set_weights(model.get_weights())
    ref = ref_model.predict(x, verbose=0)

    half = kx.to_float16(model)
    var_dtypes = half.variable_dtype_map()
    dtypes = {
        path: (dtype, [d for p, d in var_dtypes.items()
                       if p.rsplit("/", 1)[0] == path])
        for path, dtype in half.layer_compute_dtypes().items()
    }
    if kind == "subclassed":
        assert sorted(d[0] for d in dtypes.values()) == [
            "float16", "float32", "float32"]  # hidden / bn, softmax head
    else:
        assert dtypes["inner/inner_dense"] == ("float16", ["float16"] * 2)
        assert dtypes["inner/inner_ln"] == ("float32", ["float32"] * 2)
        assert dtypes["b_dense"][0] == "float16"
        assert dtypes["logits"][0] == "float16"
        assert dtypes["probs"][0] == "float32"
        # The block's own sublayers: created in build(), resolved by rule.
        block = {p.split("/")[1].rstrip("_0123456789"): d[0]
                 for p, d in dtypes.items() if p.startswith("block/")}
        assert block["dense"] == "float16"
        assert block["layer_normalization"] == "float32"
    out = half.predict(x, verbose=0)
    np.testing.assert_allclose(out, ref, atol=5e-3)


def test_subclassed_without_get_config(tmp_path):
    # No config is needed for a half-precision copy (nothing is rebuilt)...
    model = NoConfigNet(np.arange(3))
    x = np.random.default_rng(0).standard_normal((8, 4)).astype("float32")
    ref = keras.ops.convert_to_numpy(model(x))
    half = kx.to_float16(model)
    assert set(half.variable_dtype_map().values()) == {"float16"}
    np.testing.assert_allclose(half.predict(x, verbose=0), ref, atol=1e-2)
    # ... but a .keras file is rebuilt from it: refused up front.
    with pytest.raises(TypeError, match=r"NoConfigNet.*get_config"):
        kx.export(model, str(tmp_path / "m.keras"), format="keras")
    assert os.listdir(tmp_path) == []


def test_unbuilt_and_bad_arguments_are_rejected(tmp_path):
    unbuilt = keras.Sequential([layers.Dense(3)])
    with pytest.raises(ValueError, match="not built"):
        kx.to_float16(unbuilt)
    with pytest.raises(ValueError, match="not built"):
        kx.export(unbuilt, str(tmp_path / "m.keras"), format="keras")
    model = single_dense(4, 3)
    with pytest.raises(ValueError, match=r"`dtype`.*'int8'.*'float16'"):
        kx.to_float16(model, dtype="int8")
    with pytest.raises(TypeError, match="keep_float32"):
        kx.to_float16(model, keep_float32=[3])
    with pytest.raises(ValueError, match=r"`format`.*'onnx2'.*'savedmodel'"):
        kx.export(model, str(tmp_path / "m"), format="onnx2")
    with pytest.raises(ValueError, match=r"`dtype`.*'float8'"):
        kx.export(model, str(tmp_path / "m.keras"), format="keras",
                  dtype="float8")
    with pytest.raises(ValueError, match=r"bfloat16.*tflite"):
        kx.export(model, str(tmp_path / "m.tflite"), format="tflite",
                  dtype="bfloat16")
    with pytest.raises(ValueError, match=r"\.keras"):
        kx.export(model, str(tmp_path / "m.h5"), format="keras")
    with pytest.raises(TypeError, match="keras.Model"):
        kx.export(layers.Dense(3), str(tmp_path / "m.keras"), format="keras")
    with pytest.raises(ValueError, match="sample"):
        kx.export(model, str(tmp_path / "m.keras"), format="keras",
                  sample=np.zeros((8, 5), "float32"))
    assert os.listdir(tmp_path) == []


def test_existing_path_and_failed_export_leave_nothing_behind(tmp_path):
    model = single_dense(4, 3)
    target = tmp_path / "model.keras"
    target.write_bytes(b"precious")
    with pytest.raises(FileExistsError, match="overwrite=True"):
        kx.export(model, str(target), format="keras")
    assert target.read_bytes() == b"precious"

    # A layer class Keras cannot find again: writing works, reading the file
    # back fails; the export must fail without leaving anything.
    unknown = keras.Sequential([keras.Input((4,)), Block(4, name="block")])
    with pytest.raises(Exception, match="Block"):
        kx.export(unknown, str(target), format="keras", overwrite=True)
    assert target.read_bytes() == b"precious"
    fresh = tmp_path / "fresh.keras"
    with pytest.raises(Exception, match="Block"):
        kx.export(unknown, str(fresh), format="keras")
    assert sorted(os.listdir(tmp_path)) == ["model.keras"]


# --------------------------------------------------------------------------
# export: every format
# --------------------------------------------------------------------------


FORMATS = [
    pytest.param("keras", "model.keras", id="keras"),
    pytest.param("savedmodel", "saved", id="savedmodel",
                 marks=tensorflow_only),
    pytest.param("tflite", "model.tflite", id="tflite",
                 marks=tensorflow_only),
]


def _run_artifact(fmt, path, x):
    """Runs an exported artifact with its own runtime."""
    if fmt == "keras":
        return keras.saving.load_model(path, compile=False).predict(
            x, verbose=0)
    if fmt == "savedmodel":
        import tensorflow as tf

        serve = tf.saved_model.load(path).signatures["serving_default"]
        (name,) = serve.structured_input_signature[1]
        (out,) = serve(**{name: tf.constant(x)}).values()
        return out.numpy()
    from ai_edge_litert.interpreter import Interpreter

    interpreter = Interpreter(model_path=path)
    (name,) = interpreter.get_signature_list()["serving_default"]["inputs"]
    (out,) = interpreter.get_signature_runner()(**{name: x}).values()
    return out


@pytest.mark.parametrize("name", ["cnn", "transformer"])
@pytest.mark.parametrize("fmt,filename", FORMATS)
def test_export_size_and_parity(trained, tmp_path, name, fmt, filename):
    model = trained(name)
    x = parity_inputs(name)
    path = str(tmp_path / filename)
    report = kx.export(model, path, format=fmt, sample=x)

    assert os.path.exists(path)
    assert report.path == path and report.format == fmt
    assert report.dtype == "float16"
    assert report.size_ratio <= 0.55
    assert report.bytes == artifact_size(path)
    assert report.max_abs_diff <= 1e-2
    assert report.top1_agreement >= 0.99
    assert report.num_samples == N_PARITY
    assert report.input_dtypes == ("float32",)
    if fmt == "savedmodel":
        kept = {_unsuffixed(p) for p in report.kept_float32}
        assert kept == EXPECTED_KEPT[name]

    # Independent check: run the artifact here, against the float32 masters.
    ref = float32_reference(name, model).predict(x, verbose=0)
    assert_parity(name, ref.astype(np.float64), _run_artifact(fmt, path, x))

    # The report prints as a table and serializes.
    text = str(report)
    assert "ratio" in text and "top-1" in text
    assert json.loads(json.dumps(report.to_dict()))["format"] == fmt
    assert glob.glob(str(tmp_path / ".kerasmp-export-*")) == []


@tensorflow_only
def test_savedmodel_fresh_process_and_two_bytes_per_parameter(
        trained, tmp_path):
    model = trained("transformer")
    path = str(tmp_path / "served")
    x = parity_inputs("transformer")[:32]
    np.save(tmp_path / "x.npy", x)
    kx.export(model, path, format="savedmodel", sample=x)
    path32 = str(tmp_path / "served32")
    kx.export(model, path32, format="savedmodel", dtype="float32", sample=x)

    # Variables stored once: ~2 bytes per parameter in float16 (the kept
    # LayerNorm/head weights add a little), ~4 in float32; the double storage
    # of `model.export()` (keras#23553) would give ~4 and ~8.
    params = model.count_params()
    per_param = artifact_size(os.path.join(path, "variables")) / params
    per_param32 = artifact_size(os.path.join(path32, "variables")) / params
    assert 1.9 <= per_param <= 2.2
    assert 3.9 <= per_param32 <= 4.2

    script = textwrap.dedent(f"""
        import sys
        import numpy as np
        import tensorflow as tf
        loaded = tf.saved_model.load({path!r})
        serve = loaded.signatures["serving_default"]
        spec = serve.structured_input_signature[1]["tokens"]
        assert spec.dtype == tf.float32, spec
        x = np.load({str(tmp_path / "x.npy")!r})
        (out,) = serve(tokens=tf.constant(x)).values()
        np.save({str(tmp_path / "y.npy")!r}, out.numpy())
        assert "kerasmp" not in sys.modules
        print("modules:", "keras" in sys.modules)
    """)
    env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="3")
    result = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True,
        env=env, cwd=str(tmp_path), timeout=300,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    y = np.load(tmp_path / "y.npy")
    ref = float32_reference("transformer", model).predict(x, verbose=0)
    assert y.dtype == np.float32
    assert np.max(np.abs(y - ref)) <= 1e-2


@tensorflow_only
def test_onnx_export_with_exact_gelu(trained, tmp_path):
    pytest.importorskip("tf2onnx")
    onnx = pytest.importorskip("onnx")
    onnxruntime = pytest.importorskip("onnxruntime")

    model = trained("transformer")  # ff1 uses Keras's exact GELU (erfc)
    x = parity_inputs("transformer")
    path = str(tmp_path / "model.onnx")
    report = kx.export(model, path, format="onnx", sample=x)
    assert report.size_ratio <= 0.55
    assert report.max_abs_diff <= 1e-2 and report.top1_agreement >= 0.99

    graph = onnx.load(path).graph
    ops = {n.op_type for n in graph.node}
    assert "Erfc" not in ops and "Erf" in ops
    assert graph.input[0].type.tensor_type.elem_type == onnx.TensorProto.FLOAT
    session = onnxruntime.InferenceSession(
        path, providers=["CPUExecutionProvider"])
    (out,) = session.run(None, {session.get_inputs()[0].name: x})
    ref = float32_reference("transformer", model).predict(x, verbose=0)
    assert_parity("transformer", ref.astype(np.float64), out)


@tensorflow_only
def test_tflite_holds_float16_weights(trained, tmp_path):
    from ai_edge_litert.interpreter import Interpreter

    model = trained("cnn")
    path = str(tmp_path / "model.tflite")
    kx.export(model, path, format="tflite", sample=parity_inputs("cnn"))
    interpreter = Interpreter(model_path=path)
    f16 = sum(
        int(np.prod(t["shape"])) for t in interpreter.get_tensor_details()
        if t["dtype"] == np.float16
    )
    # Nearly every parameter is stored as float16 (BatchNormalization
    # statistics are folded into the convolutions by the converter).
    assert f16 >= 0.97 * model.count_params()
    assert os.path.getsize(path) < 2.2 * model.count_params()


@tensorflow_only
@pytest.mark.parametrize("fmt,filename", FORMATS)
def test_huge_variance_export_parity(tmp_path, fmt, filename):
    model, x = _huge_variance_model()
    with pytest.warns(UserWarning, match="moving_variance"):
        report = kx.export(model, str(tmp_path / filename), format=fmt,
                           sample=x, keep_float32=())
    ref = model.predict(x, verbose=0)
    out = _run_artifact(fmt, str(tmp_path / filename), x)
    np.testing.assert_allclose(out, ref, rtol=2e-3, atol=0.5)
    assert np.isfinite(report.max_abs_diff)
    assert report.max_abs_diff <= 2e-3 * np.abs(ref).max()


def test_cli_export(trained, tmp_path, capsys):
    from kerasmp.apps import cli

    model = trained("cnn")
    src = str(tmp_path / "trained.keras")
    model.save(src)
    x = parity_inputs("cnn")[:128]
    np.save(tmp_path / "sample.npy", x)
    out = str(tmp_path / "half.keras")
    code = cli.main(["export", src, out, "--format", "keras", "--sample",
                     str(tmp_path / "sample.npy")])
    printed = capsys.readouterr().out
    assert code == 0
    assert "kerasmp export report" in printed and "ratio" in printed
    assert os.path.exists(out)
    # A parity threshold no float16 model can meet: exit code 1.
    code = cli.main(["export", src, str(tmp_path / "h2.keras"), "--format",
                     "keras", "--sample", str(tmp_path / "sample.npy"),
                     "--max-rel-diff", "1e-9", "--json"])
    captured = capsys.readouterr()
    assert code == 1
    assert json.loads(captured.out)["rel_diff"] > 1e-9
    assert "parity FAILED" in captured.err and "--sample" in captured.err
    assert not os.path.exists(tmp_path / "h2.keras")  # gate before commit
    # An existing output without --overwrite: a clear error, exit code 2.
    assert cli.main(["export", src, out, "--format", "keras"]) == 2
    assert "already exists; pass --overwrite" in capsys.readouterr().err
