"""`kerasmp.check` and `kerasmp check`: each finding on a model built to have
that hazard, and a clean model that reports nothing. Runs on TensorFlow,
JAX and PyTorch."""

import json

import keras
import numpy as np
import pytest
from _helpers import keras_hub_or_skip

import kerasmp
from kerasmp.apps import cli
from kerasmp.debug import find_nonfinite

pytestmark = pytest.mark.torch  # also in the PyTorch pass (conftest.py)


class Scaler(keras.layers.Layer):
    """x / (|x| + epsilon): epsilon is added in the compute dtype."""

    def __init__(self, epsilon=1e-12, **kwargs):
        super().__init__(**kwargs)
        self.epsilon = epsilon

    def call(self, x):
        return x / (keras.ops.abs(x) + self.epsilon)


class LogSumExp(keras.layers.Layer):
    """Custom code no kerasmp rule sees: exp and log inside call."""

    def call(self, x):
        return keras.ops.log(keras.ops.sum(keras.ops.exp(x), axis=-1,
                                           keepdims=True))


class MaskBias(keras.layers.Layer):
    """The T5 pattern: (1 - mask) * -1e9 in the compute dtype (the constant
    cast to it: -inf in float16, and 0 x -inf is NaN on every backend;
    PyTorch would multiply by a bare Python -1e9 in float32 arithmetic)."""

    def call(self, x):
        mask = keras.ops.cast(keras.ops.greater(x, -100.0), x.dtype)
        return x + (1.0 - mask) * keras.ops.cast(-1e9, x.dtype)


class RMSNorm(keras.layers.Layer):
    def call(self, x):
        return x * keras.ops.rsqrt(
            keras.ops.mean(keras.ops.square(x), -1, keepdims=True) + 1e-6)


class Gate(keras.layers.Layer):
    """Calls its sublayer "inner" inside `keras.ops.cond` (JAX traces both
    branches, even in an eager pass: "inner" sees tracers there), then
    multiplies by `factor` in its own code (1e5: inf in float16)."""

    def __init__(self, factor=1.0, **kwargs):
        super().__init__(**kwargs)
        self.factor = factor
        self.inner = keras.layers.Dense(16, name="inner")

    def build(self, input_shape):
        self.inner.build(input_shape)

    def call(self, x):
        return keras.ops.cond(
            keras.ops.all(keras.ops.isfinite(x)),
            lambda: self.inner(x) * self.factor,
            lambda: x,
        )


def _functional(*layers, shape=(16,)):
    inputs = keras.Input(shape)
    x = inputs
    for layer in layers:
        x = layer(x)
    return keras.Model(inputs, x)


def _clean_model():
    """kerasmp mixed_float16, sizes multiples of 8, float32 probabilities."""
    with kerasmp.policy_scope("mixed_float16"):
        return _functional(
            keras.layers.Dense(32, activation="relu"),
            keras.layers.LayerNormalization(epsilon=1e-3),
            RMSNorm(),
            keras.layers.Dense(16, activation="softmax"))


def _finding(report, code):
    found = [f for f in report if f.code == code]
    assert found, f"{code} not in {report.codes()}:\n{report}"
    return found


def test_clean_model_reports_nothing():
    model = _clean_model()
    for gpu in (False, True):
        report = kerasmp.check(model, gpu=gpu)
        assert report.clean, str(report)
        assert not report.has_errors
        assert list(report) == []
    assert "no precision hazards found" in str(report)
    assert json.loads(report.to_json())["findings"] == []


def test_stock_mixed_policy_is_reported_with_what_kerasmp_changes():
    keras.config.set_dtype_policy(keras.DTypePolicy("mixed_float16"))
    model = _functional(keras.layers.Dense(16), RMSNorm(name="rms"),
                        keras.layers.Dense(8, activation="softmax",
                                           name="probs"))
    report = kerasmp.check(model)
    stock = _finding(report, "stock_policy")
    assert [f.severity for f in stock] == ["warning", "warning"]
    assert "the global policy is a stock keras.DTypePolicy('mixed_float16')"\
        in stock[0].message
    assert "3 layer(s) of this model" in stock[1].message
    assert "kerasmp would compute 2 of them in float32 (rms, probs)" in (
        stock[1].why)
    assert "LossScaleOptimizer" in stock[1].why
    assert "kerasmp.set_global_policy('mixed_float16')" in stock[0].fix
    # A kerasmp model while the stock policy is global: only the global.
    with kerasmp.policy_scope("mixed_float16"):
        model = _functional(keras.layers.Dense(16))
    assert len(_finding(kerasmp.check(model), "stock_policy")) == 1
    halves = {f.path for f in _finding(report, "half_precision_normalization")}
    assert halves == {"rms", "probs"}
    assert not report.has_errors


def test_normalization_in_float16_when_the_rule_is_removed():
    rules = [r for r in kerasmp.DEFAULT_FLOAT32_LAYERS
             if r is not kerasmp.policy.NORMALIZATION_BY_NAME]
    with kerasmp.policy_scope(kerasmp.Policy("mixed_float16", rules,
                                             float32_defaults=False)):
        model = _functional(keras.layers.Dense(16), RMSNorm(name="rms"),
                            keras.layers.Dense(8, activation="softmax"))
    found = _finding(kerasmp.check(model), "half_precision_normalization")
    assert [(f.path, f.severity) for f in found] == [("rms", "warning")]
    assert "a normalization (RMSNorm) computes in float16" in found[0].message


def test_exp_and_log_in_float16_inside_custom_code():
    with kerasmp.policy_scope("mixed_float16"):
        model = _functional(keras.layers.Dense(16), LogSumExp(name="lse"),
                            keras.layers.Activation("linear",
                                                    dtype="float32"))
    found = _finding(kerasmp.check(model), "half_precision_op")
    assert {(f.path, f.message.split()[3]) for f in found} == {
        ("lse", "exp"), ("lse", "log")}
    assert all(f.severity == "warning" for f in found)
    # The same code in float32 is not reported.
    with kerasmp.policy_scope("float32"):
        model = _functional(keras.layers.Dense(16), LogSumExp())
    assert kerasmp.check(model).clean


def test_epsilon_zero_or_subnormal_in_float16():
    with kerasmp.policy_scope("mixed_float16"):
        model = _functional(
            Scaler(1e-12, name="zero_eps"), Scaler(1e-6, name="sub_eps"),
            Scaler(1e-3, name="fine_eps"),
            keras.layers.Activation("linear", dtype="float32"))
    report = kerasmp.check(model)
    found = {f.path: f for f in _finding(report, "epsilon_underflow")}
    assert set(found) == {"zero_eps", "sub_eps"}
    assert found["zero_eps"].severity == "error"
    assert "epsilon=1e-12 is 0 in float16" in found["zero_eps"].message
    assert found["sub_eps"].severity == "warning"
    assert "subnormal" in found["sub_eps"].message
    assert float(np.float16(1e-6)) < 2.0 ** -14  # the reference: subnormal
    assert report.has_errors


class LoraAdapter(keras.layers.Layer):
    """A user's LoRA adapter: its weights in the layer's variable dtype
    (Keras 3.15's own `enable_lora` makes them float32)."""

    def build(self, input_shape):
        self.lora_a = self.add_weight(shape=(input_shape[-1], 2),
                                      name="lora_a")
        self.lora_b = self.add_weight(shape=(2, input_shape[-1]),
                                      name="lora_b", initializer="zeros")

    def call(self, x):
        return x + keras.ops.matmul(keras.ops.matmul(x, self.lora_a),
                                    self.lora_b)


def test_half_precision_trainable_variables_lora_and_optimizer_slots():
    model = _functional(keras.layers.Dense(16, name="full"),
                        keras.layers.Dense(8, name="bf16", dtype="bfloat16"),
                        LoraAdapter(name="adapter", dtype="bfloat16"))
    model.compile(optimizer="adam", loss="mse")
    model.optimizer.build(model.trainable_variables)
    report = kerasmp.check(model)
    lora = _finding(report, "half_precision_lora")
    assert [(f.path, f.severity) for f in lora] == [
        ("adapter", "error"), ("adapter", "error")]
    assert "keras-hub#2629" in lora[0].why
    variables = _finding(report, "half_precision_variable")
    assert {f.path for f in variables} == {"bf16"}
    assert all(f.severity == "error" for f in variables)
    slots = _finding(report, "half_precision_optimizer_slots")
    assert slots[0].severity == "error"
    assert "8 optimizer slot variable(s) are stored in bfloat16" in (
        slots[0].message)
    assert "full" not in {f.path for f in report}


def test_weights_beyond_float16_in_a_float16_layer():
    with kerasmp.policy_scope("mixed_float16"):
        model = _functional(keras.layers.Dense(16, name="big"),
                            keras.layers.Dense(8, name="small"),
                            keras.layers.Activation("linear",
                                                    dtype="float32"))
    kernel = model.get_layer("big").kernel
    kernel.assign(np.full(kernel.shape, 1e5, "float32"))
    found = _finding(kerasmp.check(model), "weight_out_of_float16_range")
    assert [(f.path, f.severity) for f in found] == [("big", "error")]
    assert "1e+05" in found[0].message


def test_half_precision_outputs():
    with kerasmp.policy_scope("mixed_float16"):
        model = _functional(keras.layers.Dense(16), keras.layers.Dense(8))
    found = _finding(kerasmp.check(model), "half_precision_outputs")
    assert found[0].severity == "warning" and found[0].path == ""
    assert "float16" in found[0].message


def test_tensor_core_sizes_are_gpu_advice_only():
    with kerasmp.policy_scope("mixed_float16"):
        model = _functional(keras.layers.Dense(10, name="odd"),
                            keras.layers.Dense(16, activation="softmax",
                                               name="even"), shape=(12,))
    assert "tensor_core_size" not in kerasmp.check(model, gpu=False).codes()
    report = kerasmp.check(model, gpu=True)
    found = _finding(report, "tensor_core_size")
    # "even" computes its softmax in float32: not a tensor-core matmul.
    assert {(f.path, f.message.split(" is ")[0]) for f in found} == {
        ("odd", "Dense input size 12"), ("odd", "Dense units 10")}
    assert all(f.severity == "info" for f in found)
    assert "pad 10 to 16 (1.60x" in [f.fix for f in found
                                     if "units 10" in f.message][0]
    assert not report.has_errors
    with pytest.raises(ValueError, match="`gpu`.*Allowed values"):
        kerasmp.check(model, gpu="yes")


def _attention(heads, key_dim, hidden):
    with kerasmp.policy_scope("mixed_float16"):
        x = keras.Input((8, hidden))
        y = keras.layers.MultiHeadAttention(heads, key_dim, name="mha")(x, x)
        return keras.Model(
            x, keras.layers.Activation("linear", dtype="float32")(y))


def test_tensor_core_sizes_of_einsum_dense_are_its_matmul_sizes():
    """MultiHeadAttention(num_heads=2, key_dim=16) on 32 features: every
    projection is a 32 x 32 matmul (the kernel's axis of 2 heads is part of
    a size, not one): nothing to pad. Each finding prints once."""
    assert kerasmp.check(_attention(2, 16, 32), gpu=True).clean
    report = kerasmp.check(_attention(2, 5, 12), gpu=True)
    sizes = {(f.path, f.message.split(" is ")[0]): f.fix for f in report}
    # query: "abc,cde->abde", kernel (12, 2, 5): contracts c, makes d x e.
    assert sizes == {
        **{(f"mha/{p}", "EinsumDense matmul input size 12"):
           "pad 12 to 16 (1.33x this size's work; usually still faster)"
           for p in ("query", "key", "value")},
        **{(f"mha/{p}", "EinsumDense matmul output size 10 (2 x 5)"):
           "pad 5 to 8: 2 x 8 = 16 (1.60x this size's work; usually still "
           "faster)" for p in ("query", "key", "value")},
        ("mha/attention_output", "EinsumDense matmul input size 10 (2 x 5)"):
            "pad 5 to 8: 2 x 8 = 16 (1.60x this size's work; usually still "
            "faster)",
        ("mha/attention_output", "EinsumDense matmul output size 12"):
            "pad 12 to 16 (1.33x this size's work; usually still faster)",
    }
    text = str(report)
    lines = text.splitlines()
    for f in report:
        assert sum(f.path in line and f.message in line
                   for line in lines) == 1, (f.path, f.message)
    assert text.count(report.findings[0].why) == 1


def test_mask_constant_that_becomes_inf_in_float16():
    with kerasmp.policy_scope("mixed_float16"):
        model = _functional(keras.layers.Dense(16, name="proj"),
                            MaskBias(name="bias"), keras.layers.Dense(8),
                            keras.layers.Activation("linear",
                                                    dtype="float32"))
    found = _finding(kerasmp.check(model), "nonfinite_in_float16")
    assert [(f.path, f.severity) for f in found] == [("bias", "error")]
    assert "-1e9" in found[0].why
    # The same model in float32 is finite: nothing to report.
    with kerasmp.policy_scope("float32"):
        model = _functional(keras.layers.Dense(16), MaskBias())
    assert kerasmp.check(model).clean


def test_t5_hazard_found_statically_and_by_the_traced_run():
    keras_hub = keras_hub_or_skip()
    rules = [r for r in kerasmp.DEFAULT_FLOAT32_LAYERS
             if r is not kerasmp.policy.KNOWN_FLOAT16_HAZARDS]

    def t5():
        return keras_hub.models.T5Backbone(
            vocabulary_size=32, num_layers=1, num_heads=2, hidden_dim=16,
            intermediate_dim=16, key_value_dim=8, dropout=0.0)

    with kerasmp.policy_scope(kerasmp.Policy("mixed_float16", rules,
                                             float32_defaults=False)):
        broken = t5()
    report = kerasmp.check(broken)
    hazards = _finding(report, "known_float16_hazard")
    assert all(f.path.endswith("attention") for f in hazards)
    assert "-1e9" in hazards[0].why
    if keras.backend.backend() != "torch":
        # T5 multiplies its float16 mask by the Python float -1e9, which
        # TensorFlow and JAX cast to float16 (-inf: 0 x -inf is NaN on the
        # all-ones sample mask); PyTorch computes it in float32 (0), so the
        # sample batch stays finite there and only the static finding holds.
        nonfinite = _finding(report, "nonfinite_in_float16")
        assert nonfinite[0].path.endswith("self_attention")
    assert report.has_errors
    with kerasmp.policy_scope("mixed_float16"):
        fixed = t5()
    report = kerasmp.check(fixed)
    assert not report.has_errors, str(report)
    # What remains is honest: the attention softmax of float16 scores.
    assert report.codes() <= {"half_precision_op"}


def _gated(factor):
    with kerasmp.policy_scope("mixed_float16"):
        return _functional(Gate(factor, name="gate"),
                           keras.layers.Activation("linear", dtype="float32"))


def test_layers_inside_keras_ops_cond_are_summarised_not_read():
    """On JAX "gate/inner" returns tracers (TracerArrayConversionError
    before): check reads only concrete values, names what it could not
    read, and reports no error for a clean model."""
    report = kerasmp.check(_gated(1.0))
    assert report.clean, str(report)
    traced = [n for n in report.notes if "traced control flow" in n]
    if keras.backend.backend() == "jax":
        assert len(traced) == 1 and "(gate/inner)" in traced[0], report.notes
    else:  # TensorFlow and PyTorch run the taken branch eagerly
        assert traced == []
    found = find_nonfinite(_gated(1.0), np.ones((2, 16), "float32"))
    assert found.layer is None
    assert found.traced == (
        ["gate/inner"] if keras.backend.backend() == "jax" else [])
    rows = [r.path for r in found.rows]
    assert "gate" in rows and (
        ("gate/inner" in rows) == (keras.backend.backend() != "jax"))


def test_an_overflow_inside_keras_ops_cond_is_named_at_its_layer():
    """x1e5 inside the branch: inf in float16. The first concrete
    non-finite output is the gate's, on every backend."""
    found = _finding(kerasmp.check(_gated(1e5)), "nonfinite_in_float16")
    assert [(f.path, f.severity) for f in found] == [("gate", "error")]
    assert find_nonfinite(_gated(1e5), np.ones((2, 16), "float32")).layer == (
        "gate")


def test_a_model_that_fails_on_the_sample_batch_is_a_note_not_a_crash():
    """SAM's prompt encoder refuses masks shaped (2, 8, 8, 8, 1), check's
    sample for (None, None, None, None, 1): the static checks still run."""

    class NeedsFour(keras.layers.Layer):
        def call(self, x):
            if x.shape[1] not in (None, 4):  # None: the symbolic call
                raise ValueError(f"expected 4 masks, got {x.shape[1]}")
            return x

        def compute_output_shape(self, input_shape):
            return input_shape

    with kerasmp.policy_scope("mixed_float16"):
        inputs = keras.Input((None, 3))
        outputs = keras.layers.Dense(2, dtype="float32")(NeedsFour()(inputs))
        model = keras.Model(inputs, outputs)
    report = kerasmp.check(model)
    assert report.clean
    assert len(report.notes) == 1
    assert "expected 4 masks, got 8" in report.notes[0]
    assert "--sample" in report.notes[0]
    assert "by the checks that ran (see the notes)" in str(report)
    assert kerasmp.check(model, x=np.ones((2, 4, 3), "float32")).notes == []


def test_check_refuses_what_is_not_a_built_model():
    with pytest.raises(TypeError, match="`model` must be a keras.Model"):
        kerasmp.check(keras.layers.Dense(2))
    with pytest.raises(ValueError, match="not built"):
        kerasmp.check(keras.Sequential([keras.layers.Dense(2)]))


def test_cli_check_exit_status_and_json(tmp_path, capsys):
    clean = tmp_path / "clean.keras"
    _clean_model_for_file().save(clean)
    bad = tmp_path / "bad.keras"
    model = _clean_model_for_file()
    kernel = model.layers[1].kernel
    kernel.assign(np.full(kernel.shape, 1e5, "float32"))
    model.save(bad)
    assert cli.main(["check", str(clean)]) == 0
    assert "no precision hazards found" in capsys.readouterr().out
    assert cli.main(["check", str(bad), "--json"]) == 1
    out = json.loads(capsys.readouterr().out)
    # The 1e5 kernel: seen statically, and its float16 output is inf.
    assert out["clean"] is False and out["errors"] == 2
    assert {f["code"] for f in out["findings"]} == {
        "weight_out_of_float16_range", "nonfinite_in_float16"}
    assert cli.main(["check", str(clean), "--gpu", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["findings"] == []
    assert cli.main(["check", str(tmp_path / "missing.keras")]) == 2
    assert "missing.keras" in capsys.readouterr().err


def _clean_model_for_file():
    """The clean model with Keras layers only (loads in safe mode)."""
    with kerasmp.policy_scope("mixed_float16"):
        return _functional(keras.layers.Dense(32, activation="relu"),
                           keras.layers.LayerNormalization(),
                           keras.layers.Dense(16, activation="softmax"))


class _Offset(keras.layers.Layer):
    """(x + 1e4) - 1e4: float16's spacing at 1e4 is 8, so x is lost."""

    def call(self, x):
        return (x + 1e4) - 1e4


@pytest.mark.torch
def test_a_sample_far_from_float32_points_to_kerasmp_tune():
    def model(offset):
        keras.utils.set_random_seed(0)
        with kerasmp.policy_scope("mixed_float16"):
            inputs = keras.Input((16,))
            h = keras.layers.Dense(16)(inputs)
            if offset:
                h = _Offset()(h)
            return keras.Model(inputs, keras.layers.Dense(4)(h))

    x = np.random.default_rng(0).standard_normal((32, 16)).astype("float32")
    found = _finding(kerasmp.check(model(True), x=x), "parity_over_target")
    assert len(found) == 1 and found[0].severity == "warning"
    assert "kerasmp tune" in found[0].fix and "--target 0.02" in found[0].fix
    # Within the target, or without a sample of the user's: nothing.
    assert "parity_over_target" not in kerasmp.check(model(False),
                                                     x=x).codes()
    assert "parity_over_target" not in kerasmp.check(model(True)).codes()
    with pytest.raises(ValueError, match="parity_target"):
        kerasmp.check(model(False), parity_target=-1)
