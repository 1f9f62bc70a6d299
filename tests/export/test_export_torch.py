"""Export on the PyTorch backend (issue 28): `format="torch"` (a
`torch.export` program, `.pt2`), `"onnx"` (`torch.onnx.export`) and
`"keras"`; `"savedmodel"` refused in one sentence naming the formats this
backend writes; `"tflite"` needs `litert-torch`, checked first.

References: the same model built in float32 with the master weights, run
here; the artifacts read back in a process where kerasmp cannot be
imported (`torch.export.load(path).module()`, onnxruntime).
"""

import json
import subprocess
import sys

import keras
import numpy as np
import pytest
from _helpers import BLOCK_KERASMP
from _helpers import subprocess_env
from keras import layers

from kerasmp import export as kx
from kerasmp.export import specs as _specs
from kerasmp.policy import Policy
from kerasmp.policy import policy_scope

pytestmark = pytest.mark.torch
BACKEND = keras.backend.backend()
on_torch = pytest.mark.skipif(BACKEND != "torch",
                              reason="writes from the PyTorch backend")


def _pair():
    """`(mixed_float16 model, float32 reference, inputs)`, same weights."""
    def build():
        inputs = keras.Input((8,), name="x")
        h = layers.Dense(16, activation="gelu", name="d1")(inputs)
        h = layers.LayerNormalization(name="ln")(h)
        outputs = layers.Dense(4, activation="softmax", name="head")(h)
        return keras.Model(inputs, outputs, name="m")

    with policy_scope(Policy("mixed_float16")):
        model = build()
    with policy_scope("float32"):
        ref = build()
    rng = np.random.default_rng(0)
    ref.set_weights([rng.normal(0, 0.5, w.shape).astype("float32")
                     for w in ref.get_weights()])
    model.set_weights(ref.get_weights())
    x = rng.uniform(-2, 2, (64, 8)).astype("float32")
    return model, ref, x


def _rel(got, want):
    return float(np.max(np.abs(got - want)) / np.ptp(want))


LOAD_PT2 = BLOCK_KERASMP + """
import numpy as np, torch
program = torch.export.load(sys.argv[1])
x = torch.from_numpy(np.load(sys.argv[2]))
y = program.module()(x)[0].detach().numpy().astype("float64")
tensors = list(program.state_dict.values()) + [
    t for t in program.constants.values() if isinstance(t, torch.Tensor)]
print("RESULT " + json.dumps({"y": y.tolist(), "dtypes": sorted(
    {str(t.dtype) for t in tensors if t.is_floating_point()})}))
"""


def _run(code, *args):
    proc = subprocess.run([sys.executable, "-c", code, *map(str, args)],
                          capture_output=True, text=True,
                          env=subprocess_env("torch"), timeout=300)
    lines = [l for l in proc.stdout.splitlines() if l.startswith("RESULT ")]
    assert proc.returncode == 0 and lines, proc.stderr[-3000:]
    return json.loads(lines[-1][len("RESULT "):])


@on_torch
def test_torch_program_loads_without_kerasmp(tmp_path):
    model, ref, x = _pair()
    path = tmp_path / "m16.pt2"
    report = kx.export(model, str(path), format="torch", sample=x, gate=True)
    want = ref.predict(x, verbose=0).astype("float64")
    # Another batch size than the sample's rows the program was traced on.
    np.save(tmp_path / "x.npy", x[:5])
    out = _run(LOAD_PT2, path, tmp_path / "x.npy")
    assert _rel(np.asarray(out["y"]), want[:5]) <= 2e-2
    # d1 in float16; ln and the softmax head kept in float32.
    assert out["dtypes"] == ["torch.float16", "torch.float32"]
    assert {"ln", "head"} <= set(report.kept_float32)
    # float16: d1 (8*16+16); float32: ln (2*16) and head (16*4+4).
    assert report.weight_bytes == 2 * 144 + 4 * (32 + 68)
    assert report.master_weight_bytes == 4 * (144 + 32 + 68)
    assert report.input_dtypes == ("float32",)
    assert report.output_dtypes == ("float32",)


@on_torch
def test_torch_onnx_stores_float16_weights(tmp_path):
    pytest.importorskip("onnxscript")
    ort = pytest.importorskip("onnxruntime")
    model, ref, x = _pair()
    path = tmp_path / "m16.onnx"
    report = kx.export(model, str(path), format="onnx", sample=x, gate=True)
    session = ort.InferenceSession(str(path))
    name = session.get_inputs()[0].name
    got = session.run(None, {name: x[:7]})[0].astype("float64")
    assert _rel(got, ref.predict(x[:7], verbose=0)) <= 2e-2
    # The float16 kernel that Keras multiplies in float32 on a CPU is
    # stored in float16, not as the exporter's folded float32 copy.
    # (A few bytes of scalar constants besides: GELU's, the epsilon.)
    assert 2 * 144 + 4 * (32 + 68) <= report.weight_bytes
    assert report.weight_bytes <= 2 * 144 + 4 * (32 + 68) + 32
    assert report.weight_ratio < 0.75


@on_torch
def test_keras_file_from_torch_loads_on_tensorflow_without_kerasmp(
        tmp_path):
    from test_export_keras_reach import _run_plain

    model, ref, x = _pair()
    path = tmp_path / "m16.keras"
    kx.export(model, str(path), format="keras", sample=x, gate=True)
    np.save(tmp_path / "x.npy", x)
    out = _run_plain(path, tmp_path / "x.npy", "tensorflow")
    assert out["dtypes"] == ["float16", "float32"]
    assert _rel(np.asarray(out["y"]), ref.predict(x, verbose=0)) <= 2e-2


def test_savedmodel_from_torch_is_refused_in_one_sentence(tmp_path):
    path = tmp_path / "sm"
    with pytest.raises(ValueError) as info:
        if BACKEND == "torch":
            kx.export(None, str(path), format="savedmodel")  # no model
        else:
            _specs.check_target(str(path), "savedmodel", backend="torch")
    message = str(info.value)
    assert message.count(". ") == 0 and "\n" not in message
    assert "PyTorch backend" in message
    assert "'keras', 'tflite', 'onnx' or 'torch'" in message
    assert list(tmp_path.iterdir()) == []


def test_torch_format_needs_the_torch_backend(tmp_path):
    if BACKEND == "torch":
        pytest.skip("the PyTorch backend writes it")
    with pytest.raises(ValueError, match="KERAS_BACKEND=torch") as info:
        kx.export(None, str(tmp_path / "m.pt2"), format="torch")
    assert "\n" not in str(info.value)


def test_tflite_from_torch_needs_litert_torch_first(tmp_path, monkeypatch):
    import importlib.util

    find_spec = importlib.util.find_spec
    monkeypatch.setattr(  # as where it is not installed
        importlib.util, "find_spec",
        lambda name, *a: None if name == "litert_torch" else find_spec(
            name, *a))
    with pytest.raises(ImportError) as info:
        if BACKEND == "torch":
            kx.export(None, str(tmp_path / "m.tflite"), format="tflite")
        else:
            _specs.check_target(str(tmp_path / "m.tflite"), "tflite",
                                backend="torch")
    assert "litert_torch" in str(info.value)
    assert 'pip install "kerasmp[tflite-torch]"' in str(info.value)
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("torch_version, moved", [
    ("2.13.0", False), ("2.14.1", False), ("2.15.0", True),
    ("2.16.0.dev20261201+cpu", True)])
def test_tflite_from_torch_says_where_the_extra_moves_torch(
        tmp_path, monkeypatch, torch_version, moved):
    """litert-torch 0.10, its newest release, takes torch<2.15: past that,
    `pip install "kerasmp[tflite-torch]"` would move torch back, so the
    one-line error says so and names the formats that take this torch."""
    import importlib.util

    find_spec = importlib.util.find_spec
    monkeypatch.setattr(  # as where it is not installed
        importlib.util, "find_spec",
        lambda name, *a: None if name == "litert_torch" else find_spec(
            name, *a))
    monkeypatch.setattr(_specs, "_torch_version", lambda: torch_version)
    with pytest.raises(ImportError) as info:
        _specs.check_target(str(tmp_path / "m.tflite"), "tflite",
                            backend="torch")
    message = str(info.value)
    assert 'pip install "kerasmp[tflite-torch]"' in message
    assert "\n" not in message
    said = (f"takes torch<2.15, so that moves torch {torch_version} back "
            "below 2.15; or export to 'onnx' or 'torch'")
    assert (said in message) == moved, message
    assert list(tmp_path.iterdir()) == []


def test_the_newest_litert_torch_is_the_one_installed_or_older():
    """`LITERT_TORCH_NEWEST` against litert-torch's own metadata where it is
    installed: the same release, refusing the same torch."""
    import importlib.metadata

    try:
        version = importlib.metadata.version("litert-torch")
    except importlib.metadata.PackageNotFoundError:
        pytest.skip("litert-torch is not installed")
    release, refused = _specs.LITERT_TORCH_NEWEST
    installed = tuple(int(v) for v in version.split(".")[:2])
    assert installed <= tuple(int(v) for v in release.split(".")), (
        f"litert-torch {version} is newer than LITERT_TORCH_NEWEST "
        f"({release}): update it and pyproject.toml's tflite-torch extra")
    if version.startswith(release + "."):
        (torch_req,) = [r for r in importlib.metadata.requires(
            "litert-torch") if r.split("<")[0].split(">")[0].strip() == "torch"]
        assert f"<{refused[0]}.{refused[1]}" in torch_req, torch_req


@on_torch
def test_the_command_writes_a_torch_program(tmp_path):
    import torch

    from kerasmp.apps import cli

    model, ref, x = _pair()
    model.save(tmp_path / "m.keras")
    out = tmp_path / "m16.pt2"
    assert cli.main(["export", str(tmp_path / "m.keras"), str(out),
                     "--format", "torch"]) == 0
    module = torch.export.load(str(out)).module()
    got = module(torch.from_numpy(x))[0].detach().numpy()
    assert _rel(got.astype("float64"), ref.predict(x, verbose=0)) <= 2e-2
