"""`kerasmp bench --model FILE`: the user's own model under each policy
(issue 43 item 3). No timing is asserted: the rows are measurements of the
model rebuilt under each policy, which the tests check against the original
model (same weights, same float32 outputs) and kerasmp's rules."""

import json

import keras
import numpy as np
import pytest

from kerasmp.apps import bench_model
from kerasmp.apps import cli
from kerasmp.apps.doctor import from_bench

pytestmark = pytest.mark.torch


def _model():
    keras.utils.set_random_seed(0)
    inputs = keras.Input((12,), name="features")
    x = keras.layers.Dense(32, activation="relu", name="hidden")(inputs)
    x = keras.layers.LayerNormalization(name="norm")(x)
    outputs = keras.layers.Dense(3, activation="softmax", name="head")(x)
    return keras.Model(inputs, outputs)


def test_copy_under_a_policy_has_its_dtypes_and_the_models_weights():
    model = _model()
    x = np.random.default_rng(0).random((5, 12), dtype="float32")
    copy = bench_model.under_policy(model, "float32")
    # Same weights, so the float32 copy computes what the model computes.
    for a, b in zip(model.get_weights(), copy.get_weights()):
        np.testing.assert_array_equal(a, b)
    np.testing.assert_allclose(keras.ops.convert_to_numpy(copy(x)),
                               keras.ops.convert_to_numpy(model(x)),
                               rtol=1e-6, atol=1e-7)
    half = bench_model.under_policy(model, "mixed_bfloat16")
    assert half.get_layer("hidden").compute_dtype == "bfloat16"
    assert half.get_layer("norm").compute_dtype == "float32"  # the rules
    assert model.get_layer("hidden").compute_dtype == "float32"  # untouched


def test_cli_bench_model_rows_and_doctor_advice(tmp_path, capsys):
    path = tmp_path / "model.keras"
    _model().save(path)
    sample = tmp_path / "sample.npy"
    np.save(sample, np.random.default_rng(1).random((6, 12), "float32"))
    out = tmp_path / "bench.json"
    assert cli.main(["bench", "--model", str(path), "--sample", str(sample),
                     "--steps", "3", "--repeats", "1", "--policies",
                     "float32", "mixed_bfloat16", "--json", str(out)]) == 0
    printed = capsys.readouterr().out
    result = json.loads(out.read_text())
    assert result["user_model"] == "model.keras"
    assert result["inputs"] == "sample"
    rows = {r["policy"]: r for r in result["rows"]}
    assert set(rows) == {"float32", "mixed_bfloat16"}
    assert rows["mixed_bfloat16"]["compute_dtype"] == "bfloat16"
    for r in rows.values():
        assert r["batch_size"] == 6 and r["steps"] == 3
        assert r["steps_per_s"] > 0 and r["loss_finite"]
        assert r["params"] == _model().count_params()
    assert rows["float32"]["speedup_vs_baseline"] == 1.0
    # The doctor reads the file as it reads the presets' results.
    assert from_bench(result)[0] in ("float32", "mixed_bfloat16")
    assert "model model.keras" in printed


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--sample", "x.npy"], "--sample needs --model"),
        (["--model", "M", "--quick"], "--quick"),
        (["--model", "M", "--preset", "cpu"], "--preset"),
        (["--model", "missing.keras"], "no such file"),
    ],
)
def test_cli_bench_model_usage_errors(tmp_path, capsys, argv, message):
    path = tmp_path / "model.keras"
    _model().save(path)
    argv = [str(path) if a == "M" else a for a in argv]
    assert cli.main(["bench", *argv]) == 2
    assert message in capsys.readouterr().err
