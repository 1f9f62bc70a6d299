"""compile's decision for a bfloat16 policy on a CPU (issue 43 item 1).

On a CPU with bfloat16 instructions, TensorFlow trains mixed_bfloat16 fast
with compile's defaults (no XLA on a CPU) and slower than float32 with an
explicit `jit_compile=True` (XLA's CPU dots run in float32). compile keeps
what the user asked for and says so once, with the measured ratios. Nothing
here times anything: the CPU's flags and device are given to the decision,
so the tests pass on any CPU.
"""

import warnings

import keras
import pytest

import kerasmp
from kerasmp._utils import cpu_speed
from kerasmp.errors import SpeedWarning
from kerasmp.policy import speed

BF16_CPU = {"avx512f", "avx512_bf16", "amx_bf16"}
PLAIN_CPU = {"avx2", "avx512f"}


@pytest.mark.parametrize(
    "backend, jit, dtypes, kind, flags, slow",
    [
        ("tensorflow", True, {"bfloat16", "float32"}, "cpu", BF16_CPU, True),
        # compile's default resolves to False on a TensorFlow CPU.
        ("tensorflow", False, {"bfloat16"}, "cpu", BF16_CPU, False),
        # No bfloat16 instructions: no bfloat16 speed to lose.
        ("tensorflow", True, {"bfloat16"}, "cpu", PLAIN_CPU, False),
        # XLA on a GPU runs bfloat16 on its tensor cores.
        ("tensorflow", True, {"bfloat16"}, "gpu", BF16_CPU, False),
        ("tensorflow", True, {"float16", "float32"}, "cpu", BF16_CPU, False),
        ("tensorflow", True, {"float32"}, "cpu", BF16_CPU, False),
        # JAX has no other setting; PyTorch's jit is torch.compile.
        ("jax", True, {"bfloat16"}, "cpu", BF16_CPU, False),
        ("torch", True, {"bfloat16"}, "cpu", BF16_CPU, False),
    ],
)
def test_slow_setting_decision(backend, jit, dtypes, kind, flags, slow):
    message = cpu_speed.slow_setting(backend, jit, dtypes, kind, flags)
    assert (message is not None) == slow
    if slow:
        # The measured ratios and the faster setting, in the message.
        jit_row = cpu_speed.measured("tensorflow", "jit")
        default_row = cpu_speed.measured("tensorflow")
        assert f"{jit_row.transformer:.2f}x" in message
        assert f"{default_row.transformer:.2f}x" in message
        assert "jit_compile=False" in message


def test_measured_figures_say_what_the_message_claims():
    # The warning says XLA loses bfloat16's speed and the default keeps it:
    # the recorded figures must say the same (docs/benchmarks.md).
    jit_row = cpu_speed.measured("tensorflow", "jit")
    default_row = cpu_speed.measured("tensorflow")
    assert max(jit_row.transformer, jit_row.cnn) < 1.0
    assert min(default_row.transformer, default_row.cnn) > 1.0


def _model():
    return keras.Sequential([
        keras.Input((8,)),
        keras.layers.Dense(16, activation="relu"),
        keras.layers.Dense(3, activation="softmax"),
    ])


def _compile(model, **kwargs):
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        model.compile("adam", "sparse_categorical_crossentropy", **kwargs)
    return [w for w in caught if issubclass(w.category, SpeedWarning)]


@pytest.fixture
def bf16_cpu(monkeypatch):
    """This machine seen as a CPU with bfloat16 instructions, once more
    unwarned."""
    monkeypatch.setattr(speed, "cpu_flags", lambda: set(BF16_CPU))
    monkeypatch.setattr(speed, "_warned", set())


@pytest.mark.tensorflow
def test_compile_keeps_jit_compile_and_warns_once(bf16_cpu):
    kerasmp.set_global_policy(kerasmp.Policy("mixed_bfloat16"))
    if speed.main_device().kind != "cpu":
        pytest.skip("the decision is about a CPU; this machine has a GPU")
    model = _model()
    caught = _compile(model, jit_compile=True)
    assert model.jit_compile is True  # what the user asked for stays
    assert len(caught) == 1
    assert "jit_compile=False" in str(caught[0].message)
    assert caught[0].filename == __file__  # at the user's compile call
    # Once per process.
    assert _compile(_model(), jit_compile=True) == []


@pytest.mark.tensorflow
def test_compile_defaults_and_float32_say_nothing(bf16_cpu):
    kerasmp.set_global_policy(kerasmp.Policy("mixed_bfloat16"))
    if speed.main_device().kind != "cpu":
        pytest.skip("the decision is about a CPU; this machine has a GPU")
    model = _model()
    assert _compile(model) == []  # jit_compile="auto": no XLA on a CPU
    assert model.jit_compile is False
    kerasmp.set_global_policy(kerasmp.Policy("float32"))
    assert _compile(_model(), jit_compile=True) == []


@pytest.mark.tensorflow
def test_stock_keras_model_is_not_told(bf16_cpu):
    # Without a kerasmp policy kerasmp does not speak for the model (the
    # stock-policy warning does).
    keras.config.set_dtype_policy("mixed_bfloat16")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        assert _compile(_model(), jit_compile=True) == []
