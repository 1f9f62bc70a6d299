"""Issue 35 item 4: a user's `float32_layers` adds to the built-in rules
instead of silently dropping them; `float32_defaults=False` drops them
explicitly; a policy saved when the list replaced the defaults loads
computing what it computed then.

The reference for "the built-in rules" is the default policy,
`kerasmp.Policy("mixed_float16")`, and for "no rules" Keras's own
`keras.DTypePolicy("mixed_float16")`.
"""

import json
import warnings
from pathlib import Path

import keras
import numpy as np
import pytest

import kerasmp
from kerasmp import errors

pytestmark = pytest.mark.torch

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures" / "saved_by_0.1.0"


class RMSNorm(keras.layers.Layer):
    """A normalization kerasmp knows by its name only."""

    def call(self, x):
        return x * keras.ops.rsqrt(keras.ops.mean(x * x, -1, True) + 1e-6)


def _compute_dtypes(policy):
    """{layer name: compute dtype} of a small model built under `policy`."""
    with kerasmp.policy_scope(policy):
        inputs = keras.Input((8,), name="x")
        h = keras.layers.Dense(8, name="hidden")(inputs)
        h = keras.layers.LayerNormalization(name="ln")(h)
        h = RMSNorm(name="rms")(h)
        h = keras.layers.Dense(8, name="logits")(h)
        outputs = keras.layers.Dense(4, activation="softmax", name="head")(h)
        model = keras.Model(inputs, outputs)
    return {layer.name: layer.compute_dtype for layer in model.layers[1:]}


def test_own_rules_keep_the_built_in_ones():
    builtin = _compute_dtypes(kerasmp.Policy("mixed_float16"))
    assert builtin["head"] == builtin["ln"] == builtin["rms"] == "float32"
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # nothing to warn about
        policy = kerasmp.Policy("mixed_float16", float32_layers=["logits"])
    own = _compute_dtypes(policy)
    # Every layer as under the built-in rules, plus the one the user named.
    assert own == {**builtin, "logits": "float32"}
    assert builtin["logits"] == "float16"


def test_float32_defaults_false_drops_the_built_in_rules():
    stock = _compute_dtypes(keras.DTypePolicy("mixed_float16"))
    policy = kerasmp.Policy("mixed_float16", float32_layers=["logits"],
                            float32_defaults=False)
    assert _compute_dtypes(policy) == {**stock, "logits": "float32"}
    none = kerasmp.Policy("mixed_float16", float32_defaults=False)
    assert _compute_dtypes(none) == stock
    assert stock["head"] == "float16"


@pytest.mark.parametrize("value", [None, 0, "yes"])
def test_float32_defaults_must_be_a_bool(value):
    with pytest.raises(ValueError, match=r"`float32_defaults`.*Allowed "
                       r"values: True .*False"):
        kerasmp.Policy("mixed_float16", float32_defaults=value)


def test_a_list_written_to_drop_built_in_rules_warns_naming_them():
    # The 0.1.0 way to drop a rule: list the others. The rule now stays,
    # and the warning names it and the argument that drops it.
    rules = [r for r in kerasmp.DEFAULT_FLOAT32_LAYERS
             if r is not kerasmp.policy.NORMALIZATION_BY_NAME]
    with pytest.warns(errors.PolicyWarning) as caught:
        policy = kerasmp.Policy("mixed_float16", rules)
    assert len(caught) == 1
    message = str(caught[0].message)
    assert "NORMALIZATION_BY_NAME" in message
    assert "float32_defaults=False" in message
    assert caught[0].filename == __file__
    builtin = _compute_dtypes(kerasmp.Policy("mixed_float16"))
    assert _compute_dtypes(policy) == builtin
    # Said explicitly, the rule is dropped, without a warning.
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        dropped = kerasmp.Policy("mixed_float16", rules,
                                 float32_defaults=False)
    assert _compute_dtypes(dropped) == {**builtin, "rms": "float16"}


def test_a_config_saved_with_a_replacing_list_loads_the_same():
    # What kerasmp 0.1.0 (commit 316693c) wrote for
    # Policy("mixed_float16", float32_layers=["logits"]): the list then
    # replaced the built-in rules, so only "logits" computed in float32.
    saved = {"name": "mixed_float16", "float32_layers": [
        {"pattern": "logits"}]}
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        loaded = kerasmp.Policy.from_config(saved)
    stock = _compute_dtypes(keras.DTypePolicy("mixed_float16"))
    assert _compute_dtypes(loaded) == {**stock, "logits": "float32"}
    # And a config written now round-trips to the same rules.
    policy = kerasmp.Policy("mixed_float16", float32_layers=["logits"])
    config = json.loads(json.dumps(policy.get_config()))
    assert kerasmp.Policy.from_config(config) == policy


def test_a_file_saved_with_a_replacing_list_loads_the_same():
    # custom_rules.keras: saved by kerasmp 0.1.0 at commit 316693c
    # (make_custom_rules.py), with float32_layers=["logits"], which then
    # replaced the built-in rules: the softmax head and the norm were
    # float16.
    expected = json.loads((FIXTURES / "custom_rules.json").read_text())
    model = keras.saving.load_model(FIXTURES / "custom_rules.keras")
    dtypes = {layer.name: layer.compute_dtype for layer in model.layers[1:]}
    assert dtypes == expected["compute_dtypes"]
    assert dtypes["head"] == dtypes["ln"] == "float16"
    x = np.load(FIXTURES / "inputs.npy")
    np.testing.assert_allclose(model.predict(x, verbose=0),
                               expected["predict"], atol=2e-3)
