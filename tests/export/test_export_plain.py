"""kerasmp.export (issue 16): a plain Keras `.keras`, scale-free parity with
default inputs that respect the model, every package checked before any
work, I/O dtypes read back with each runtime, weight bytes.

References: the float32 model rebuilt by its builder with the master weights
(`get_weights()`), and artifacts read back by their own runtimes (stock
`keras.saving.load_model` in a process where kerasmp cannot be imported,
`tf.saved_model.load`, the LiteRT interpreter, onnxruntime).
"""

import json
import subprocess
import sys
import warnings

import keras
import numpy as np
import pytest
from _helpers import BLOCK_KERASMP
from _helpers import slow_on
from _helpers import subprocess_env
from keras import layers

from kerasmp import export as kx
from kerasmp.export import specs as _format_specs
from kerasmp.export.inputs import draw_inputs
from kerasmp.export.inputs import input_specs
from kerasmp.export.parity import parity
from kerasmp.policy import Policy
from kerasmp.policy import policy_scope
from kerasmp.policy.report import dtype_report

BACKEND = keras.backend.backend()


def build_transformer():
    inputs = keras.Input((8, 16), name="tokens")
    x = layers.Dense(32, name="embed")(inputs)
    a = layers.MultiHeadAttention(2, 16, dropout=0.1, name="mha")(x, x)
    x = layers.LayerNormalization(name="ln")(x + a)
    x = layers.GlobalAveragePooling1D(name="pool")(x)
    outputs = layers.Dense(5, activation="softmax", name="head")(x)
    return keras.Model(inputs, outputs, name="tiny_transformer")


def build_mlp():
    return keras.Sequential([keras.Input((12,), name="x"),
                             layers.Dense(64, activation="relu", name="d1"),
                             layers.Dense(64, activation="relu", name="d2"),
                             layers.Dense(3, name="out")], name="mlp")


def _mixed(builder):
    with policy_scope(Policy("mixed_float16")):
        model = builder()
    with policy_scope("float32"):
        ref = builder()
    rng = np.random.default_rng(0)
    ref.set_weights([rng.normal(0, 0.3, w.shape).astype("float32")
                     for w in ref.get_weights()])
    model.set_weights(ref.get_weights())
    return model, ref


def _inputs(model, n=64):
    shape = (n,) + tuple(model.input_shape[1:])
    return np.random.default_rng(1).uniform(0, 1, shape).astype("float32")


LOAD_PLAIN = BLOCK_KERASMP + """
import keras, numpy as np
model = keras.saving.load_model(sys.argv[1], compile=False)
x = np.load(sys.argv[2])
y = keras.ops.convert_to_numpy(model(x, training=False)).astype("float64")
kept = {}
for layer in model.layers:
    kept[layer.name] = [layer.compute_dtype,
                        sorted({str(w.dtype) for w in layer.weights})]
MHA = keras.layers.MultiHeadAttention
mha = [l for l in model.layers if isinstance(l, MHA)]
if mha:
    kept["mha/softmax"] = [mha[0]._softmax.compute_dtype, []]
print("RESULT " + json.dumps({"y": y.tolist(), "layers": kept}))
"""


@pytest.mark.parametrize("backend", ["tensorflow", "jax"])
def test_plain_keras_loads_without_kerasmp(tmp_path, backend):
    model, ref = _mixed(build_transformer)
    path = tmp_path / "m16.keras"
    report = kx.export(model, str(path), format="keras")
    x = _inputs(model)
    np.save(tmp_path / "x.npy", x)
    proc = subprocess.run(
        [sys.executable, "-c", LOAD_PLAIN, str(path),
         str(tmp_path / "x.npy")],
        capture_output=True, text=True, env=subprocess_env(backend),
        timeout=300)
    lines = [l for l in proc.stdout.splitlines() if l.startswith("RESULT ")]
    assert proc.returncode == 0 and lines, proc.stderr[-3000:]
    out = json.loads(lines[-1][len("RESULT "):])
    got = np.asarray(out["y"])
    want = keras.ops.convert_to_numpy(ref(x)).astype("float64")
    # Predictions within the parity figure of a float16 run.
    assert np.max(np.abs(got - want)) / np.ptp(want) <= 2e-2
    assert np.mean(got.argmax(-1) == want.argmax(-1)) >= 0.95
    layers_ = out["layers"]
    assert layers_["embed"] == ["float16", ["float16"]]
    assert layers_["mha"][0] == "float16"
    assert layers_["ln"] == ["float32", ["float32"]]
    assert layers_["head"] == ["float32", ["float32"]]
    assert layers_["mha/softmax"][0] == "float32"
    assert set(report.kept_float32) >= {"ln", "head"}


def test_plain_keras_with_kerasmp_and_dtype_report(tmp_path):
    model, _ = _mixed(build_transformer)
    path = str(tmp_path / "m16.keras")
    kx.export(model, path, format="keras")
    loaded = keras.saving.load_model(path, compile=False)
    report = dtype_report(loaded)
    rows = {r.path: r.compute_dtype for r in report}
    assert rows["embed"] == "float16" and rows["ln"] == "float32"
    assert rows["head"] == "float32"
    assert len(rows) >= len(model.layers) - 1  # every layer, inputs aside


def test_weight_ratio_all_eligible(tmp_path):
    model, _ = _mixed(build_mlp)  # no layer kept in float32
    n_float = sum(int(np.prod(w.shape)) for w in model.weights)
    for fmt, name in (("keras", "m.keras"), ("savedmodel", "sm")):
        if fmt != "keras" and BACKEND != "tensorflow":
            continue
        report = kx.export(model, str(tmp_path / name), format=fmt,
                           keep_float32=[])
        assert report.master_weight_bytes == 4 * n_float
        assert report.weight_ratio <= 0.52, report
        assert "weights" in str(report) and "rest of artifact" in str(report)


def test_scale_free_parity_figure():
    ref = [np.array([[0.0, 30.0], [10.0, 20.0]]),
           np.array([[1e-3, 0.0], [0.0, 1e-3]])]
    out = [ref[0] + 0.3, ref[1] + 1e-5]
    p = parity(ref, out)
    assert p["max_abs_diff"] == pytest.approx(0.3)
    assert p["rel_diffs"] == pytest.approx([0.3 / 30, 1e-5 / 1e-3])
    assert p["rel_diff"] == pytest.approx(0.01)
    assert p["top1"] == 1.0


def test_default_inputs_respect_the_model():
    ids = keras.Input((6,), dtype="int32", name="token_ids")
    mask = keras.Input((6,), dtype="int32", name="padding_mask")
    e = layers.Embedding(37, 4)(ids)
    m = keras.Model([ids, mask], layers.GlobalAveragePooling1D()(e))
    specs = input_specs(m)
    tok, pad = draw_inputs(m, specs, 256)
    assert tok.min() >= 0 and tok.max() < 37 and tok.max() > 30
    assert np.all(pad == 1)
    img = keras.Sequential([keras.Input((4,)), layers.Rescaling(1 / 255),
                            layers.Dense(2)])
    (x,) = draw_inputs(img, input_specs(img), 256)
    assert x.min() >= 0 and x.max() < 255 and x.max() > 200
    plain = build_mlp()
    (x,) = draw_inputs(plain, input_specs(plain), 256)
    assert x.min() >= 0 and x.max() < 1


def test_parity_failure_names_sample(tmp_path):
    model, _ = _mixed(build_mlp)
    with pytest.raises(kx.ParityError, match="sample=") as info:
        kx.export(model, str(tmp_path / "m.keras"), format="keras",
                  max_rel_diff=1e-9)
    assert not (tmp_path / "m.keras").exists()
    assert info.value.report.rel_diff > 1e-9


def test_dependencies_checked_before_any_work(tmp_path, monkeypatch):
    real = _format_specs.importlib.util.find_spec
    monkeypatch.setattr(
        _format_specs.importlib.util, "find_spec",
        lambda name, *a: None if name == "ai_edge_litert" else real(name, *a))
    with pytest.raises(ImportError, match=r"pip install kerasmp\[tflite\]"):
        # not even a model: the check comes first
        kx.export(None, str(tmp_path / "m.tflite"), format="tflite")
    with pytest.raises(ImportError, match=r"ai_edge_litert"):
        _format_specs.check_target(str(tmp_path / "m.tflite"), "tflite")
    with pytest.raises(ValueError, match="io_dtype"):
        _format_specs.check_target(str(tmp_path / "m.keras"), "keras",
                                   io_dtype="float16")


@pytest.mark.tensorflow
@pytest.mark.parametrize("fmt,name", [("savedmodel", "sm"),
                                      ("tflite", "m.tflite"),
                                      ("onnx", "m.onnx")])
@pytest.mark.parametrize("io_dtype", ["float32", "float16"])
def test_io_dtype_read_back_with_each_runtime(tmp_path, fmt, name,
                                              io_dtype):
    import tensorflow as tf

    model, ref = _mixed(build_mlp)
    path = str(tmp_path / name)
    report = kx.export(model, path, format=fmt, io_dtype=io_dtype)
    assert report.io_dtype == io_dtype
    x = _inputs(model)
    if fmt == "savedmodel":
        fn = tf.saved_model.load(path).signatures["serving_default"]
        ins = [s.dtype.name for s in fn.structured_input_signature[1].values()]
        y = next(iter(fn(x=tf.constant(x.astype(io_dtype))).values()))
        outs, y = [y.dtype.name], y.numpy()
    elif fmt == "tflite":
        from ai_edge_litert.interpreter import Interpreter

        runner = Interpreter(model_path=path).get_signature_runner(
            "serving_default")
        ins = [np.dtype(d["dtype"]).name
               for d in runner.get_input_details().values()]
        y = next(iter(runner(x=x.astype(io_dtype)).values()))
        outs = [y.dtype.name]
    else:
        import onnxruntime

        s = onnxruntime.InferenceSession(path,
                                         providers=["CPUExecutionProvider"])
        ins = [i.type for i in s.get_inputs()]
        ins = ["float16" if t == "tensor(float16)" else "float32"
               for t in ins]
        y = s.run(None, {s.get_inputs()[0].name: x.astype(io_dtype)})[0]
        outs = [y.dtype.name]
    assert ins == [io_dtype] and outs == [io_dtype]
    assert list(report.input_dtypes) == [io_dtype]
    want = keras.ops.convert_to_numpy(ref(x))
    assert np.max(np.abs(y.astype("float64") - want)) / np.ptp(want) < 2e-2


@pytest.mark.tensorflow
def test_cli_default_export_passes_on_demo_model(tmp_path):
    from kerasmp.apps import zoo

    with policy_scope(Policy("mixed_float16")):
        model = zoo.digits_cnn()
    model.compile("adam", "sparse_categorical_crossentropy")
    rng = np.random.default_rng(0)
    x = rng.uniform(0, 1, (256, 8, 8, 1)).astype("float32")
    model.fit(x, rng.integers(0, 10, 256), epochs=1, verbose=0)
    src = tmp_path / "model.keras"
    model.save(src)
    for fmt, name in (("keras", "m16.keras"), ("savedmodel", "sm")):
        proc = subprocess.run(
            [sys.executable, "-m", "kerasmp", "export", str(src),
             str(tmp_path / name), "--format", fmt, "--json"],
            capture_output=True, text=True, timeout=300,
            env=subprocess_env("tensorflow"))
        assert proc.returncode == 0, proc.stderr[-2000:]
        report = json.loads(proc.stdout[proc.stdout.index("{"):])
        assert report["rel_diff"] <= 2e-2 and report["inputs"] == (
            "default draws")


def _hub_bert():
    keras_hub = pytest.importorskip("keras_hub")
    keras.utils.set_random_seed(0)
    with policy_scope(Policy("mixed_float16")):
        return keras_hub.models.BertBackbone(
            vocabulary_size=2048, num_layers=2, num_heads=2, hidden_dim=32,
            intermediate_dim=64, max_sequence_length=16)


def _application():
    with policy_scope(Policy("mixed_float16")):
        return keras.applications.MobileNetV3Small(
            input_shape=(32, 32, 3), weights=None, minimalistic=True,
            alpha=0.75, classes=10)


HUB_LOAD = BLOCK_KERASMP + """
import keras, keras_hub, numpy as np
model = keras.saving.load_model(sys.argv[1], compile=False)
d = np.load(sys.argv[2])
y = model({k: d[k] for k in d.files}, training=False)
y = keras.ops.convert_to_numpy(y["sequence_output"]).astype("float64")
print("RESULT " + json.dumps({"y": y.tolist()}))
"""


@pytest.mark.parametrize("backend", ["tensorflow", "jax"])
def test_keras_hub_plain_keras_loads_without_kerasmp(tmp_path, backend):
    # Exported on either backend, the file loads and predicts on both. The
    # attention softmax has no Keras path, so only the encoder's map default
    # could make it float32, and that default also makes the encoder's own
    # Dropout float32 on float16 inputs: TensorFlow then refuses
    # `x + residual` (JAX promotes). So the softmax is float16 in the file,
    # with a warning naming it, on both backends alike.
    model = _hub_bert()
    path = tmp_path / "bert16.keras"
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        report = kx.export(model, str(path), format="keras", gate=True)
    said = [str(w.message) for w in caught
            if "compute in float16, not float32" in str(w.message)]
    assert len(said) == 1, [str(w.message) for w in caught]
    assert "self_attention_layer/softmax" in said[0]
    assert not any("softmax" in k for k in report.kept_float32)
    assert any(k.endswith("self_attention_layer_norm")
               for k in report.kept_float32)
    assert report.weight_ratio <= 0.52
    specs = input_specs(model)
    arrays = draw_inputs(model, specs, 8, seed=3)
    sample = {name: a for (name, _, _), a in zip(specs, arrays)}
    np.savez(tmp_path / "x.npz", **sample)
    proc = subprocess.run(
        [sys.executable, "-c", HUB_LOAD, str(path), str(tmp_path / "x.npz")],
        capture_output=True, text=True, env=subprocess_env(backend),
        timeout=300)
    lines = [l for l in proc.stdout.splitlines() if l.startswith("RESULT ")]
    assert proc.returncode == 0 and lines, proc.stderr[-3000:]
    got = np.asarray(json.loads(lines[-1][len("RESULT "):])["y"])
    with policy_scope("float32"):
        ref = type(model).from_config(model.get_config())
    ref.set_weights(model.get_weights())
    want = keras.ops.convert_to_numpy(ref(sample)["sequence_output"])
    assert np.max(np.abs(got - want)) / np.ptp(want) <= 2e-2


# The keras.applications model on JAX: 100 s (eager convolutions in the
# parity draws); its TensorFlow run stays in the default suite.
@pytest.mark.parametrize(
    "which", ["keras_hub",
              pytest.param("applications", marks=slow_on("jax"))])
def test_default_gate_passes_on_real_models(tmp_path, which):
    model = _hub_bert() if which == "keras_hub" else _application()
    fmts = [("keras", "m.keras")]
    if BACKEND == "tensorflow":
        fmts += [("savedmodel", "sm"), ("tflite", "m.tflite")]
    for fmt, name in fmts:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            report = kx.export(model, str(tmp_path / name), format=fmt,
                               gate=True)  # the CLI's default gate
        assert report.rel_diff <= kx.DEFAULT_MAX_REL_DIFF["float16"]
        assert report.inputs == "default draws"
        assert report.weight_ratio <= 0.52


@pytest.mark.skipif(BACKEND != "jax", reason="the JAX route (jax2tf)")
@pytest.mark.parametrize("fmt,name", [("savedmodel", "sm"),
                                      ("tflite", "m.tflite")])
def test_jax_to_savedmodel_and_tflite(tmp_path, fmt, name):
    import tensorflow as tf

    model, ref = _mixed(build_mlp)
    path = str(tmp_path / name)
    report = kx.export(model, path, format=fmt, gate=True)
    x = _inputs(model)
    if fmt == "savedmodel":
        fn = tf.saved_model.load(path).signatures["serving_default"]
        y = next(iter(fn(x=tf.constant(x)).values())).numpy()
    else:
        from ai_edge_litert.interpreter import Interpreter

        runner = Interpreter(model_path=path).get_signature_runner(
            "serving_default")
        y = next(iter(runner(x=x).values()))
    want = keras.ops.convert_to_numpy(ref(x))
    assert np.max(np.abs(y - want)) / np.ptp(want) < 2e-2
    assert report.rel_diff < 2e-2 and report.input_dtypes == ("float32",)


CONVNEXT_LOAD = BLOCK_KERASMP + """
import keras, numpy as np
model = keras.saving.load_model(sys.argv[1], compile=False)
y = keras.ops.convert_to_numpy(model(np.load(sys.argv[2]))).astype("float64")
print("RESULT " + json.dumps({"y": y.tolist()}))
"""


@slow_on("jax")  # 70 s on JAX, 15 s on TensorFlow
def test_convnext_saved_under_kerasmp_predicts_the_same_without_it(
        tmp_path):
    # Issue 16 #7: keras.applications ConvNeXt code, small depths. Its
    # nested Sequential `..._downsampling_block_0` (LayerNormalization then
    # Conv2D) loses its dtype in Sequential.from_config; saved as "float32",
    # the LayerNormalization then got unrounded inputs without kerasmp
    # (relative 1.9e-4 measured before the fix).
    from keras.applications import ConvNeXtTiny

    convnext = __import__(ConvNeXtTiny.__module__, fromlist=["ConvNeXt"])
    with policy_scope(Policy("mixed_float16")):
        model = convnext.ConvNeXt(
            depths=[1, 1, 1, 1], projection_dims=[8, 16, 32, 64],
            input_shape=(32, 32, 3), weights=None, classes=10,
            name="tiny_convnext")
    x = np.random.default_rng(0).uniform(0, 255, (8, 32, 32, 3)).astype(
        "float32")
    want = keras.ops.convert_to_numpy(model(x)).astype("float64")
    path = tmp_path / "convnext.keras"
    model.save(path)
    np.save(tmp_path / "x.npy", x)
    proc = subprocess.run(
        [sys.executable, "-c", CONVNEXT_LOAD, str(path),
         str(tmp_path / "x.npy")],
        capture_output=True, text=True, env=subprocess_env(BACKEND),
        timeout=300)
    lines = [l for l in proc.stdout.splitlines() if l.startswith("RESULT ")]
    assert proc.returncode == 0 and lines, proc.stderr[-3000:]
    got = np.asarray(json.loads(lines[-1][len("RESULT "):])["y"])
    # Same arithmetic, same predictions (stock save/load is exact too).
    np.testing.assert_allclose(got, want, rtol=0, atol=1e-7)


def test_docs_say_what_each_artifact_needs_to_load():
    from pathlib import Path

    docs = Path(__file__).resolve().parents[2] / "docs"
    export_md = (docs / "export.md").read_text(encoding="utf-8")
    guide = (docs / "guide.md").read_text(encoding="utf-8")
    section = export_md[export_md.index("### What each artifact needs"):]
    section = section[:section.index("### Caveats")]
    loaders = {"keras": "keras.saving.load_model",
               "savedmodel": "tf.saved_model.load",
               "tflite": "Interpreter", "onnx": "onnxruntime"}
    for name, spec in _format_specs.SPECS.items():
        assert f"- `{name}`:" in section, name
        assert loaders[name] in section and loaders[name] in guide
        if spec.extra:
            assert f"pip install kerasmp[{spec.extra}]" in section
            assert f"kerasmp[{spec.extra}]" in guide
    # The .keras is plain Keras: what the test above loads without kerasmp.
    assert "without kerasmp" in section and "without\nkerasmp" in guide
    assert "Loading needs `import kerasmp`" not in export_md


def test_onnx_from_jax_is_one_clear_error_before_any_work(tmp_path):
    # tf2onnx cannot convert jax2tf's XlaCallModule (docs/export.md, Known
    # limits): from JAX the export stops at once, naming the backend to
    # set and the formats that work there.
    path = str(tmp_path / "m.onnx")
    with pytest.raises(ValueError) as info:
        if BACKEND == "jax":
            kx.export(None, path, format="onnx")  # no model needed
        else:
            _format_specs.check_target(path, "onnx", backend="jax")
    message = str(info.value)
    assert "needs the TensorFlow backend" in message and "\n" not in message
    assert "KERAS_BACKEND=tensorflow" in message and "'tflite'" in message
    assert list(tmp_path.iterdir()) == []


def build_dict_inputs_pinned_output():
    # Inputs passed as a dict whose keys are not the tensors' names (Keras
    # warns but fit and predict take it), and the mixed-precision guide's
    # float32 output layer: `Activation("linear", dtype="float32")`.
    inputs = {"ids": keras.Input((6,)), "extra": keras.Input((4,))}
    x = layers.Concatenate(name="cat")([inputs["ids"], inputs["extra"]])
    x = layers.Dense(16, activation="relu", name="d16")(x)
    x = layers.Dense(3, name="logits")(x)
    out = layers.Activation("linear", dtype="float32", name="out32")(x)
    return keras.Model(inputs, out, name="pinned")


def test_a_pinned_float32_output_stays_float32_and_fit_style_samples_work(
        tmp_path):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)  # Keras: dict key names
        model, ref = _mixed(build_dict_inputs_pinned_output)
    rng = np.random.default_rng(2)
    sample = {"ids": rng.uniform(0, 1, (32, 6)).astype("float32"),
              "extra": rng.uniform(0, 1, (32, 4)).astype("float32")}
    path = str(tmp_path / "pinned.keras")
    report = kx.export(model, path, format="keras", sample=sample)
    # The layer the user pinned to float32 stays so, and so do the outputs
    # the report promises ("float32 inputs/outputs").
    assert "dtype='float32'" in report.kept_float32["out32"]
    assert "d16" not in report.kept_float32
    assert report.output_dtypes == ("float32",)
    loaded = keras.saving.load_model(path, compile=False)
    assert loaded.get_layer("out32").compute_dtype == "float32"
    assert loaded.get_layer("d16").compute_dtype == "float16"
    got = keras.ops.convert_to_numpy(loaded(sample, training=False))
    want = keras.ops.convert_to_numpy(ref(sample, training=False))
    assert got.dtype == np.float32
    assert np.max(np.abs(got - want)) / np.ptp(want) <= 2e-2
    # A sample keyed neither way names both key sets.
    with pytest.raises(ValueError, match=r"\['extra', 'ids'\]"):
        kx.export(model, str(tmp_path / "bad.keras"), format="keras",
                  sample={"ids": sample["ids"]})
    # A float32 model has no pinned layers to keep: all of it is halved.
    plain = kx.export(ref, str(tmp_path / "f32.keras"), format="keras",
                      keep_float32=[])
    assert plain.kept_float32 == {} and plain.weight_ratio <= 0.52


def test_root_cause_quotes_a_long_first_line_cut_at_a_word():
    from kerasmp.export.keras_file import root_cause

    short = ValueError("short reason")
    assert root_cause(short) == "ValueError: short reason"
    words = " ".join(f"word{i}" for i in range(100))  # 689 characters
    cut = root_cause(TypeError(words))
    assert cut.startswith("TypeError: word0 word1 ") and cut.endswith(" ...")
    body = cut[len("TypeError: "):-len(" ...")]
    assert words.startswith(body + " ") and len(body) <= 300
