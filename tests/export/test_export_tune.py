"""`kerasmp.export(..., keep_float32="tune")` (issue 37 item 6): on a model
with one layer that loses its input in float16 (x * 1e-8, scaled back), the
plain half-precision `.keras` export fails the parity gate; with "tune" it keeps
that layer in float32, passes, and the report lists it. A model without
such a layer keeps nothing more than its rules. The parity figures are the
artifact read back and run next to the same weights computed in float32
(the export's own reference), and the file read back by stock Keras
computes the kept layer in float32. Bad uses are refused at the call."""

import keras
import numpy as np
import pytest

import kerasmp
from kerasmp import export as kx
from kerasmp.policy.measure import TUNE_RULE

pytestmark = pytest.mark.torch


@keras.saving.register_keras_serializable(package="kerasmp_tests")
class Underflow(keras.layers.Layer):
    """x * 1e-8 * 1e4 * 1e4: 1e-8 is below float16's smallest subnormal
    (6e-8), so x is lost (1e4 is a float16 number, 1e8 is not). The tune
    tests' (x + 1e4) - 1e4 is lost in eager float16, but XLA on a CPU
    computes a jitted float16 chain in float32 and rounds once: JAX's
    artifact would keep x."""

    def call(self, x):
        return x * 1e-8 * 1e4 * 1e4


def _model(offset, policy="mixed_float16"):
    keras.utils.set_random_seed(0)
    with kerasmp.policy_scope(policy):
        inputs = keras.Input((16,))
        h = keras.layers.Dense(32, activation="relu", name="hidden")(inputs)
        h = keras.layers.LayerNormalization(name="norm")(h)
        if offset:
            h = Underflow(name="offset")(h)
        h = keras.layers.Dense(32, activation="relu", name="mid")(h)
        return keras.Model(inputs, keras.layers.Dense(4, name="head")(h),
                           name="m")


def _x():
    return np.random.default_rng(0).standard_normal((64, 16)).astype(
        "float32")


def _rel_diff(got, want):
    got, want = np.asarray(got, "float64"), np.asarray(want, "float64")
    return np.max(np.abs(got - want)) / np.ptp(want)


def test_tune_keeps_the_lossy_layer_and_passes_the_gate(tmp_path):
    model, x = _model(offset=True), _x()
    reference = _model(offset=True, policy="float32")
    reference.set_weights(model.get_weights())
    want = keras.ops.convert_to_numpy(reference(x))

    with pytest.raises(kx.ParityError) as info:  # the plain export fails
        kx.export(model, str(tmp_path / "plain.keras"), format="keras",
                  sample=x, gate=True)
    assert info.value.report.rel_diff > kx.DEFAULT_MAX_REL_DIFF["float16"]
    assert "offset" not in info.value.report.kept_float32

    path = tmp_path / "tuned.keras"
    report = kx.export(model, str(path), format="keras", sample=x,
                       keep_float32="tune")
    assert report.tuned_float32 == ("offset",)
    assert report.kept_float32["offset"] == TUNE_RULE
    assert report.kept_float32["norm"] != TUNE_RULE  # the rules still hold
    assert report.passed() and "offset" in str(report)
    # The file, read back, against the same weights computed in float32.
    loaded = keras.saving.load_model(path, compile=False)
    assert loaded.get_layer("offset").compute_dtype == "float32"
    assert loaded.get_layer("mid").compute_dtype == "float16"
    assert _rel_diff(keras.ops.convert_to_numpy(loaded(x)), want) <= 2e-2
    # The model is left as it was.
    assert model.get_layer("offset").compute_dtype == "float16"


def test_tune_keeps_nothing_more_on_a_clean_model(tmp_path):
    model, x = _model(offset=False), _x()
    plain = kx.export(model, str(tmp_path / "plain.keras"), format="keras",
                      sample=x)
    report = kx.export(model, str(tmp_path / "tuned.keras"), format="keras",
                       sample=x, keep_float32="tune")
    assert report.tuned_float32 == ()
    assert report.kept_float32 == plain.kept_float32
    assert report.rel_diff == plain.rel_diff <= 2e-2


def test_tune_is_refused_at_the_call(tmp_path):
    model = _model(offset=True)
    path = str(tmp_path / "m.keras")
    cases = [
        (dict(keep_float32="tune", dtype="float32"), "dtype='float32'"),
        (dict(keep_float32="tune", dtype="bfloat16"), "dtype='float16'"),
        (dict(keep_float32="Tune"), "'tune'"),  # a pattern matching nothing
    ]
    for kwargs, words in cases:
        with pytest.raises(ValueError, match="keep_float32") as info:
            kx.export(model, path, format="keras", **kwargs)
        assert words in str(info.value), str(info.value)
    with pytest.raises(ValueError, match="'tune' is for"):
        kx.to_float16(model, keep_float32="tune")
    float32 = _model(offset=True, policy="float32")
    with pytest.raises(ValueError, match="half-precision kerasmp.Policy"):
        kx.export(float32, path, format="keras", keep_float32="tune")
    assert list(tmp_path.iterdir()) == []


def _stock_lossy():
    """Stock layers only (the command loads no code): x * 1e-8 (0 in
    float16) scaled back by 1e4 twice."""
    keras.utils.set_random_seed(0)
    with kerasmp.policy_scope("mixed_float16"):
        inputs = keras.Input((16,))
        h = keras.layers.Dense(16, name="stem")(inputs)
        h = keras.layers.Rescaling(1e-8, name="tiny")(h)
        h = keras.layers.Rescaling(1e4, name="up")(h)
        h = keras.layers.Rescaling(1e4, name="up2")(h)
        return keras.Model(inputs, keras.layers.Dense(4, name="head")(h))


def test_cli_keep_float32_tune(tmp_path, capsys):
    import json

    from kerasmp.apps import cli

    model = _stock_lossy()
    model.save(tmp_path / "m.keras")
    np.save(tmp_path / "x.npy", _x())
    args = ["export", str(tmp_path / "m.keras"), str(tmp_path / "o.keras"),
            "--format", "keras", "--sample", str(tmp_path / "x.npy"),
            "--json"]
    assert cli.main(args) == 1  # the gate refuses the plain export
    assert "parity FAILED" in capsys.readouterr().err
    assert not (tmp_path / "o.keras").exists()

    assert cli.main(args + ["--keep-float32", "tune"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["rel_diff"] <= 2e-2
    assert "tiny" in report["tuned_float32"]
    assert set(report["tuned_float32"]) <= {"stem", "tiny", "up", "up2"}
    for path in report["tuned_float32"]:
        assert report["kept_float32"][path] == TUNE_RULE

    # "tune" alone: with a pattern it is one line and exit 2.
    code = cli.main(args + ["--keep-float32", "tune", "--keep-float32",
                            "head", "--overwrite"])
    err = capsys.readouterr().err.strip()
    assert code == 2 and len(err.splitlines()) == 1, err
    assert "--keep-float32 tune" in err
