"""`kerasmp tune MODEL --sample S --target T [--out OUT]` on a saved model
whose two stock layers lose the input in float16 ((x + 1e4) - 1e4 as two
Rescaling layers): it keeps those two and meets the target, `--out` writes a
model whose outputs are within the target of float32 and which loads
without kerasmp (stock Keras in a process where kerasmp cannot be imported)
with the same predictions and the kept layers computing in float32, and
mistakes are one line and exit 2 with nothing written."""

import json
import subprocess
import sys

import keras
import numpy as np
import pytest
from _helpers import BLOCK_KERASMP
from _helpers import script_result
from _helpers import subprocess_env

import kerasmp
from kerasmp.apps import cli


def _build(policy):
    keras.utils.set_random_seed(0)
    with kerasmp.policy_scope(policy):
        inputs = keras.Input((16,))
        h = keras.layers.Dense(16, name="stem")(inputs)
        h = keras.layers.Rescaling(1.0, offset=1e4, name="up")(h)
        h = keras.layers.Rescaling(1.0, offset=-1e4, name="down")(h)
        return keras.Model(inputs, keras.layers.Dense(4, name="head")(h))


def _saved_model(folder):
    model = _build("mixed_float16")
    path = folder / "m.keras"
    model.save(path)
    x = np.random.default_rng(0).standard_normal((32, 16)).astype("float32")
    np.save(folder / "x.npy", x)
    return model, path, x


def _rel_diff(model, reference, x):
    got = keras.ops.convert_to_numpy(model(x)).astype("float64")
    ref = keras.ops.convert_to_numpy(reference(x)).astype("float64")
    return np.max(np.abs(got - ref)) / (ref.max() - ref.min())


@pytest.mark.torch
def test_tune_keeps_the_cancelling_layers_and_writes_the_tuned_model(
        tmp_path, capsys):
    model, path, x = _saved_model(tmp_path)
    reference = _build("float32")
    reference.set_weights(model.get_weights())
    assert _rel_diff(model, reference, x) > 1e-2  # float16 loses x

    out = tmp_path / "tuned.keras"
    code = cli.main(["tune", str(path), "--sample", str(tmp_path / "x.npy"),
                     "--target", "1e-2", "--out", str(out), "--json"])
    report = json.loads(capsys.readouterr().out)
    assert code == 0 and report["met"]
    assert set(report["float32_layers"]) <= {"stem", "up", "down"}
    assert {"up", "down"} & set(report["float32_layers"])
    tuned = keras.saving.load_model(out)
    assert _rel_diff(tuned, reference, x) <= 1e-2


STOCK_LOAD = BLOCK_KERASMP + """
import keras, numpy as np
model = keras.saving.load_model(sys.argv[1], compile=False)
x = np.load(sys.argv[2])
y = keras.ops.convert_to_numpy(model(x, training=False)).astype("float64")
dtypes = {layer.name: layer.compute_dtype for layer in model.layers}
print("RESULT " + json.dumps({"y": y.tolist(), "dtypes": dtypes}))
"""


@pytest.mark.torch
def test_tuned_file_loads_without_kerasmp_with_the_same_predictions(
        tmp_path, capsys):
    model, path, x = _saved_model(tmp_path)
    out = tmp_path / "tuned.keras"
    code = cli.main(["tune", str(path), "--sample", str(tmp_path / "x.npy"),
                     "--target", "1e-2", "--out", str(out), "--json"])
    kept = json.loads(capsys.readouterr().out)["float32_layers"]
    assert code == 0 and kept
    # The tuned model in kerasmp: the file read back with kerasmp.
    tuned = keras.saving.load_model(out)
    want = keras.ops.convert_to_numpy(tuned(x, training=False))
    reference = _build("float32")
    reference.set_weights(model.get_weights())
    assert _rel_diff(tuned, reference, x) <= 1e-2

    proc = subprocess.run(
        [sys.executable, "-c", STOCK_LOAD, str(out), str(tmp_path / "x.npy")],
        capture_output=True, text=True, timeout=300,
        env=subprocess_env(keras.backend.backend()))
    stock = script_result(proc.stdout, proc.stderr, proc.returncode)
    for name in kept:
        assert stock["dtypes"][name] == "float32", (name, stock["dtypes"])
    assert stock["dtypes"]["head"] == "float16"  # the rest stays mixed
    np.testing.assert_allclose(np.asarray(stock["y"]),
                               want.astype("float64"), rtol=0, atol=1e-6)


@pytest.mark.torch
def test_tune_mistakes_are_one_line_and_write_nothing(tmp_path, capsys):
    _, path, _ = _saved_model(tmp_path)
    sample = str(tmp_path / "x.npy")
    for args in (["--out", str(tmp_path / "t.h5")],
                 ["--target", "-1"],
                 ["--sample", str(tmp_path / "missing.npy")]):
        argv = ["tune", str(path), "--sample", sample] + args
        try:
            code = cli.main(argv)
        except SystemExit as e:  # argparse's own refusals
            code = e.code
        assert code == 2, argv
        err = capsys.readouterr().err.strip()
        assert len(err.splitlines()) == 1, err
        assert err.startswith("kerasmp tune: error: "), err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["m.keras", "x.npy"]
