"""The float8 policy (kerasmp/float8/rule.py): names, the rule's layer
assignment
at compile, save/load (with and without kerasmp), finite training, and the
fallback of one layer. Runs on TensorFlow and JAX."""

import os
import subprocess
import sys

import keras
import numpy as np
import pytest
from _helpers import float8_test_policy
from _models import float8_mlp

import kerasmp
from kerasmp import _keras_internals as ki
from kerasmp import float8
from kerasmp._utils.layers import walk

pytestmark = pytest.mark.torch  # also in the PyTorch pass (conftest.py)

RULE = float8.Float8Rule(min_kernel_size=256)
BACKEND = keras.backend.backend()


def _data(n=64, seed=0):
    rng = np.random.default_rng(seed)
    x = rng.normal(size=(n, 16)).astype("float32")
    y = keras.utils.to_categorical(rng.integers(0, 4, n), 4)
    return x, y


def _float8_paths(model):
    return [p for p, _ in float8.float8_layers(model)]


# ------------------------------------------------------------------ names


def test_float8_names_compute_like_their_base_policy():
    for name, base in float8.FLOAT8_NAMES.items():
        policy = kerasmp.Policy(name)
        ref = keras.DTypePolicy(base)
        assert policy.name == name
        assert (policy.compute_dtype, policy.variable_dtype) == (
            ref.compute_dtype, ref.variable_dtype)
        assert policy.float8 == float8.Float8Rule()
    assert kerasmp.Policy("mixed_bfloat16").float8 is None


def test_bad_arguments_fail_at_construction_naming_the_argument():
    with pytest.raises(ValueError, match="float8_mixed_bfloat16"):
        kerasmp.Policy("float8_mixed")
    with pytest.raises(ValueError, match="`float8` applies only"):
        kerasmp.Policy("mixed_bfloat16", float8=float8.Float8Rule())
    with pytest.raises(TypeError, match="`float8` must be"):
        kerasmp.Policy("float8_mixed_bfloat16", float8=3)
    with pytest.raises(ValueError, match="min_kernel_size"):
        float8.Float8Rule(min_kernel_size=-1)
    with pytest.raises(TypeError, match="exclude_first"):
        float8.Float8Rule(exclude_first="yes")
    with pytest.raises(ValueError, match="amax_history_length"):
        float8.Float8Rule(amax_history_length=0)
    with pytest.raises(ValueError, match="`include` entry"):
        float8.Float8Rule(include=["(unclosed"])
    with pytest.raises(TypeError, match="`exclude` entry"):
        float8.Float8Rule(exclude=[keras.layers.Dense])


def test_policy_config_round_trip_keeps_the_rule():
    policy = float8_test_policy(exclude=["head"], include=["small"],
                                amax_history_length=16)
    again = kerasmp.Policy.from_config(policy.get_config())
    assert again == policy
    assert again.float8.amax_history_length == 16
    assert again.float8.include == ("small",)


# ------------------------------------------------------------- assignment


def test_rule_assigns_large_middle_matmuls_at_compile(float8_policy):
    model = float8_mlp()
    assert _float8_paths(model) == []  # built, not yet compiled
    model.compile("adam", "categorical_crossentropy")
    assert _float8_paths(model) == ["mid", "mid2"]
    reasons = {d.path: (d.float8, d.reason) for d in float8.decide(model)}
    assert reasons["first"] == (False, "first matmul layer (exclude_first)")
    assert reasons["small"] == (False,
                                "kernel 32x4 = 128 < min_kernel_size 256")
    assert reasons["head"][0] is False
    assert reasons["mid"] == (True, "kernel 32x32 = 1024 >= 256")
    for path in ("mid", "mid2"):
        layer = model.get_layer(path)
        assert layer.quantization_mode == "float8"
        assert layer.compute_dtype == "bfloat16"
        assert layer.dtype_policy.amax_history_length == 1024
        names = sorted(v.name for v in layer.weights)
        assert "inputs_amax_history" in names and "outputs_grad_scale" in names
    # Float32 rules still apply; the rest computes in bfloat16.
    assert model.get_layer("ln").compute_dtype == "float32"
    assert model.get_layer("head").compute_dtype == "float32"
    assert model.get_layer("first").compute_dtype == "bfloat16"
    assert float8.report_reason(model.get_layer("mid")) == (
        "kerasmp float8 (kernel 32x32 = 1024 >= 256)")
    assert float8.report_reason(model.get_layer("first")) is None


def test_overrides_include_exclude_first_last():
    kerasmp.set_global_policy(float8_test_policy(
        include=["small"], exclude=["mid2"], exclude_first=False,
        amax_history_length=8))
    model = float8_mlp()
    model.compile("adam", "categorical_crossentropy")
    # head is float32 by the softmax rule: never float8.
    assert _float8_paths(model) == ["first", "mid", "small"]
    assert model.get_layer("mid").dtype_policy.amax_history_length == 8
    assert tuple(model.get_layer("mid").inputs_amax_history.shape) == (8,)


def test_explicit_dtype_and_subclasses_are_left_alone():
    class MyDense(keras.layers.Dense):
        pass

    kerasmp.set_global_policy(float8_test_policy(exclude_first=False,
                                                 exclude_last=False))
    inp = keras.Input((32,))
    x = keras.layers.Dense(32, dtype="float32", name="explicit")(inp)
    x = MyDense(32, name="sub")(x)
    x = keras.layers.EinsumDense("ab,bc->ac", output_shape=32,
                                 name="einsum")(x)
    model = keras.Model(inp, x)
    model.compile("adam", "mse")
    assert _float8_paths(model) == ["einsum"]
    reasons = {d.path: d.reason for d in float8.decide(model)}
    assert reasons["sub"] == "MyDense has no float8 mode"
    assert "explicit" not in reasons


def test_unbuilt_model_warns_and_assign_layers_later():
    kerasmp.set_global_policy(float8_test_policy(exclude_first=False,
                                                 exclude_last=False))
    model = keras.Sequential([keras.layers.Dense(32), keras.layers.Dense(32)])
    with pytest.warns(UserWarning, match="not built"):
        model.compile("adam", "mse")
    model.build((None, 32))
    assert len(float8.assign_layers(model)) == 2
    model.compile("adam", "mse")
    x = np.ones((8, 32), "float32")
    model.fit(x, x, epochs=1, verbose=0)
    assert np.isfinite(model.predict(x, verbose=0)).all()


def test_float16_variant_gets_loss_scaling():
    kerasmp.set_global_policy(float8_test_policy("float8_mixed_float16",
                                                 exclude_first=False,
                                                 exclude_last=False))
    model = keras.Sequential([keras.Input((32,)), keras.layers.Dense(32),
                              keras.layers.Dense(32)])
    model.compile("adam", "mse")
    # Every float16 layer is float8 now: the float8 layers ask for it.
    assert _float8_paths(model) == ["dense", "dense_1"]
    assert isinstance(model.optimizer, kerasmp.LossScaleOptimizer)
    kerasmp.set_global_policy(float8_test_policy("float8_mixed_bfloat16"))
    model = float8_mlp()
    model.compile("adam", "categorical_crossentropy")
    assert not isinstance(model.optimizer, keras.optimizers.LossScaleOptimizer)


# --------------------------------------------------------------- training


@pytest.mark.parametrize("name", sorted(float8.FLOAT8_NAMES))
@pytest.mark.parametrize("jit", [False, True])
def test_training_is_finite_and_scales_follow_the_amax(name, jit):
    kerasmp.set_global_policy(float8_test_policy(name))
    model = float8_mlp()
    model.compile("adam", "categorical_crossentropy", jit_compile=jit)
    x, y = _data()
    history = model.fit(x, y, batch_size=16, epochs=2, verbose=0)
    losses = history.history["loss"]
    assert np.isfinite(losses).all() and losses[-1] < losses[0] * 1.2
    assert np.isfinite(model.predict(x, verbose=0)).all()
    mid = model.get_layer("mid")
    hist = np.asarray(mid.inputs_amax_history)
    assert (hist > 0).sum() == 8  # one amax per step, 8 steps
    # Keras's delayed scaling: the scale left after the last step is the
    # history max (without the last step's amax) over the E4M3 maximum.
    chrono = np.concatenate([hist[1:], hist[:1]])
    expect = chrono[:-1].max() / 448.0
    np.testing.assert_allclose(float(np.asarray(mid.inputs_scale)), expect,
                               rtol=1e-6)


def test_float8_training_matches_float32_roughly():
    """Float8 trains to about the float32 loss (same init and data)."""
    x, y = _data(256)
    losses = {}
    for name in ("float32", "float8_mixed_bfloat16"):
        keras.utils.set_random_seed(1)
        policy = float8_test_policy(name) if name != "float32" else "float32"
        kerasmp.set_global_policy(policy)
        model = float8_mlp()
        model.compile(keras.optimizers.Adam(0.01), "categorical_crossentropy")
        model.fit(x, y, batch_size=32, epochs=5, verbose=0)
        losses[name] = model.evaluate(x, y, verbose=0)
    assert abs(losses["float8_mixed_bfloat16"] - losses["float32"]) < 0.1 * (
        losses["float32"])


# -------------------------------------------------------------- save/load


def _trained(tmp_path):
    kerasmp.set_global_policy(float8_test_policy(amax_history_length=32))
    model = float8_mlp()
    model.compile("adam", "categorical_crossentropy")
    x, y = _data()
    model.fit(x, y, batch_size=16, epochs=1, verbose=0)
    path = str(tmp_path / "float8.keras")
    model.save(path)
    kerasmp.set_global_policy("float32")
    return model, path, x, y


def test_save_load_keeps_float8_layers_and_scaling_state(tmp_path):
    model, path, x, y = _trained(tmp_path)
    loaded = keras.models.load_model(path)
    assert _float8_paths(loaded) == ["mid", "mid2"]
    for p, layer in walk(model):
        other = loaded.get_layer(p) if p in [q for q, _ in walk(loaded)] \
            else None
        if other is None or not layer.weights:
            continue
        assert type(other.dtype_policy) is type(layer.dtype_policy), p
        assert other.compute_dtype == layer.compute_dtype, p
        ours = {v.name: np.asarray(v) for v in layer.weights}
        theirs = {v.name: np.asarray(v) for v in other.weights}
        assert sorted(ours) == sorted(theirs), p
        for name, value in ours.items():
            np.testing.assert_array_equal(value, theirs[name], err_msg=name)
    assert ki.stored_dtype_policy(loaded.get_layer("mid")) == (
        ki.stored_dtype_policy(model.get_layer("mid")))
    np.testing.assert_array_equal(model.predict(x, verbose=0),
                                  loaded.predict(x, verbose=0))
    loaded.compile("adam", "categorical_crossentropy")
    assert _float8_paths(loaded) == ["mid", "mid2"]  # not re-assigned
    loaded.fit(x, y, batch_size=16, epochs=1, verbose=0)
    assert np.isfinite(loaded.predict(x, verbose=0)).all()


def test_stock_keras_loads_the_file_with_the_same_float8_layers(tmp_path):
    model, path, x, _ = _trained(tmp_path)
    np.save(tmp_path / "x.npy", x)
    np.save(tmp_path / "ref.npy", model.predict(x, verbose=0))
    script = f"""
import numpy as np, keras
m = keras.models.load_model({path!r})
assert "kerasmp" not in __import__("sys").modules
modes = [l.name for l in m.layers if l.quantization_mode == "float8"]
assert modes == ["mid", "mid2"], modes
assert m.get_layer("mid").dtype_policy.amax_history_length == 32
assert m.get_layer("first").compute_dtype == "bfloat16"
d = np.abs(m.predict(np.load({str(tmp_path / "x.npy")!r}), verbose=0)
           - np.load({str(tmp_path / "ref.npy")!r})).max()
print("RESULT", d)
"""
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    env["KERAS_BACKEND"] = BACKEND
    proc = subprocess.run([sys.executable, "-c", script], env=env,
                          capture_output=True, text=True, timeout=300,
                          cwd=str(tmp_path))
    assert proc.returncode == 0, proc.stderr[-3000:]
    diff = float(proc.stdout.split("RESULT")[-1])
    # Stock Keras has no float32 rules: LayerNormalization and the softmax
    # head compute in bfloat16 there, so outputs agree to bfloat16 only.
    assert diff < 0.05


# --------------------------------------------------------------- fallback


def test_fall_back_moves_one_layer_and_survives_save_load(
        tmp_path, float8_policy):
    model = float8_mlp()
    model.compile("adam", "categorical_crossentropy")
    x, y = _data()
    model.fit(x, y, batch_size=16, epochs=1, verbose=0)
    kernel = np.asarray(model.get_layer("mid").kernel)
    float8.fall_back(model.get_layer("mid"), "test")
    mid = model.get_layer("mid")
    assert mid.quantization_mode is None
    assert mid.compute_dtype == "bfloat16"
    np.testing.assert_array_equal(np.asarray(mid.kernel), kernel)
    assert _float8_paths(model) == ["mid2"]
    assert float8.report_reason(mid) == "kerasmp float8 fallback (test)"
    with pytest.raises(ValueError, match="was not put in float8"):
        float8.fall_back(model.get_layer("first"), "test")
    model.make_train_function(force=True)
    model.fit(x, y, batch_size=16, epochs=1, verbose=0)
    assert np.isfinite(model.predict(x, verbose=0)).all()
    path = str(tmp_path / "fallback.keras")
    model.save(path)
    loaded = keras.models.load_model(path)
    assert _float8_paths(loaded) == ["mid2"]
    loaded.compile("adam", "categorical_crossentropy")
    assert _float8_paths(loaded) == ["mid2"]  # fallback is not undone
    np.testing.assert_allclose(loaded.predict(x, verbose=0),
                               model.predict(x, verbose=0), atol=1e-6)
