"""What each export format needs and gives (issue 16): every package
checked before any work, the I/O dtypes read back with each runtime, the
weight bytes, the JAX routes (jax2tf to SavedModel and TFLite; ONNX
refused at once), and the docs that say what each artifact needs to load.

References: the float32 model built with the same weights
(`mixed_with_float32_twin`), and artifacts read back by their own runtimes
(`tf.saved_model.load`, the LiteRT interpreter, onnxruntime).
"""

import importlib.util

import keras
import numpy as np
import pytest
from _helpers import uniform_inputs
from _models import mixed_with_float32_twin
from _models import named_mlp

from kerasmp import export as kx
from kerasmp.export import specs as _format_specs

BACKEND = keras.backend.backend()


def test_weight_ratio_all_eligible(tmp_path):
    model, _ = mixed_with_float32_twin(named_mlp, input_name="x",
                                         name="mlp")  # no layer kept in float32
    n_float = sum(int(np.prod(w.shape)) for w in model.weights)
    for fmt, name in (("keras", "m.keras"), ("savedmodel", "sm")):
        if fmt != "keras" and BACKEND != "tensorflow":
            continue
        report = kx.export(model, str(tmp_path / name), format=fmt,
                           keep_float32=[])
        assert report.master_weight_bytes == 4 * n_float
        assert report.weight_ratio <= 0.52, report
        assert "weights" in str(report) and "rest of artifact" in str(report)


def test_dependencies_checked_before_any_work(tmp_path, monkeypatch):
    real = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util, "find_spec",
        lambda name, *a: None if name == "ai_edge_litert" else real(name, *a))
    with pytest.raises(ImportError,
                       match=r'pip install "kerasmp\[tflite\]"'):
        # not even a model: the check comes first
        kx.export(None, str(tmp_path / "m.tflite"), format="tflite")
    with pytest.raises(ImportError, match=r"ai_edge_litert"):
        _format_specs.check_target(str(tmp_path / "m.tflite"), "tflite")
    with pytest.raises(ValueError, match="io_dtype"):
        _format_specs.check_target(str(tmp_path / "m.keras"), "keras",
                                   io_dtype="float16")


@pytest.mark.torch
@pytest.mark.parametrize("missing,words", [
    (("onnxscript",), "onnxscript, which is not installed"),
    (("onnxscript", "onnxruntime"),
     "onnxscript and onnxruntime, which are not installed"),
    (("onnx", "onnxscript", "onnxruntime"),
     "onnx, onnxscript and onnxruntime, which are not installed"),
])
def test_missing_packages_named_in_words(tmp_path, monkeypatch, missing,
                                         words):
    """One missing package "is" not installed, several "are", listed as
    words ("a, b and c"), whatever the backend (the names of PyTorch's
    ONNX route, checked by name, not by running it)."""
    real = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util, "find_spec",
        lambda name, *a: None if name in missing else real(name, *a))
    with pytest.raises(ImportError) as raised:
        _format_specs.check_target(str(tmp_path / "m.onnx"), "onnx",
                                   backend="torch")
    assert str(raised.value) == (
        f"format='onnx' on the PyTorch backend needs {words}: "
        'pip install "kerasmp[onnx]"')


@pytest.mark.tensorflow
@pytest.mark.parametrize("fmt,name", [("savedmodel", "sm"),
                                      ("tflite", "m.tflite"),
                                      ("onnx", "m.onnx")])
@pytest.mark.parametrize("io_dtype", ["float32", "float16"])
def test_io_dtype_read_back_with_each_runtime(tmp_path, fmt, name,
                                              io_dtype):
    import tensorflow as tf

    model, ref = mixed_with_float32_twin(named_mlp, input_name="x",
                                         name="mlp")
    path = str(tmp_path / name)
    report = kx.export(model, path, format=fmt, io_dtype=io_dtype)
    assert report.io_dtype == io_dtype
    x = uniform_inputs(model)
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


@pytest.mark.skipif(BACKEND != "jax", reason="the JAX route (jax2tf)")
@pytest.mark.parametrize("fmt,name", [("savedmodel", "sm"),
                                      ("tflite", "m.tflite")])
def test_jax_to_savedmodel_and_tflite(tmp_path, fmt, name):
    import tensorflow as tf

    model, ref = mixed_with_float32_twin(named_mlp, input_name="x",
                                         name="mlp")
    path = str(tmp_path / name)
    report = kx.export(model, path, format=fmt, gate=True)
    x = uniform_inputs(model)
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


def test_docs_say_what_each_artifact_needs_to_load():
    from pathlib import Path

    docs = Path(__file__).resolve().parents[2] / "docs"
    export_md = (docs / "export.md").read_text(encoding="utf-8")
    guide = (docs / "guide.md").read_text(encoding="utf-8")
    section = export_md[export_md.index("### What each artifact needs"):]
    section = section[:section.index("### Caveats")]
    loaders = {"keras": "keras.saving.load_model",
               "savedmodel": "tf.saved_model.load",
               "tflite": "Interpreter", "onnx": "onnxruntime",
               "torch": "torch.export.load"}
    for name, spec in _format_specs.SPECS.items():
        assert f"- `{name}`:" in section, name
        assert loaders[name] in section
        assert loaders[name] in guide
        if spec.extra:
            assert f"pip install kerasmp[{spec.extra}]" in section
            assert f"kerasmp[{spec.extra}]" in guide
    # The .keras is plain Keras: what test_export_keras_file.py loads
    # without kerasmp.
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
    assert "cannot be written from the JAX backend" in message
    assert "\n" not in message
    assert "KERAS_BACKEND=tensorflow" in message and "'tflite'" in message
    assert list(tmp_path.iterdir()) == []


@pytest.mark.tensorflow
def test_tflite_of_a_model_whose_call_creates_layers(tmp_path):
    # keras-hub's EfficientNet blocks create their residual `Add` inside
    # `call`: the float32 copy TFLite converts made it under the caller's
    # global mixed_float16, a float16 AddV2 the builtin ops cannot run.
    from ai_edge_litert.interpreter import Interpreter

    from kerasmp.policy import policy_scope

    class Residual(keras.layers.Layer):
        def __init__(self, **kwargs):
            super().__init__(**kwargs)
            self.dense = keras.layers.Dense(4, name="inner")

        def build(self, shape):
            self.dense.build(shape)

        def call(self, x):
            return keras.layers.Add()([self.dense(x), x])

    def build():
        inputs = keras.Input((4,), name="x")
        h = Residual(name="block")(keras.layers.Dense(4, name="pre")(inputs))
        return keras.Model(inputs, keras.layers.Dense(2, name="out")(h))

    with policy_scope("mixed_float16"):
        model = build()
        path = str(tmp_path / "m.tflite")
        report = kx.export(model, path, format="tflite")
        assert report.rel_diff < 2e-2
    with policy_scope("float32"):
        ref = build()
    ref.set_weights(model.get_weights())
    x = np.random.default_rng(0).uniform(0, 1, (5, 4)).astype("float32")
    runner = Interpreter(model_path=path).get_signature_runner(
        "serving_default")
    y = next(iter(runner(x=x).values()))
    want = keras.ops.convert_to_numpy(ref(x))
    assert np.max(np.abs(y - want)) / np.ptp(want) < 2e-2
