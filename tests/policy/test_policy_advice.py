"""Issue 35 items 5 and 6: `compile` warns, once per model (and pattern),
at the user's call, when a name pattern of the policy matches no layer, and
when a half-precision kerasmp policy was set after the model was built.
"""

import warnings

import keras
import pytest

import kerasmp
from kerasmp import errors

pytestmark = pytest.mark.torch


def _model(name="m"):
    inputs = keras.Input((8,), name="x")
    h = keras.layers.Dense(8, name="hidden")(inputs)
    h = keras.layers.LayerNormalization(name="norm")(h)
    outputs = keras.layers.Dense(4, name="logits")(h)
    return keras.Model(inputs, outputs, name=name)


def _policy_warnings(caught):
    return [w for w in caught
            if issubclass(w.category, getattr(errors, "PolicyWarning", ()))]


def _compile(model):
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        model.compile("adam", "mse")
    return caught


def test_a_pattern_that_matches_no_layer_warns_once_at_compile():
    policy = kerasmp.Policy("mixed_float16",
                            float32_layers=["logit", "hid.*"])
    with kerasmp.policy_scope(policy):
        model = _model()
    # The reference: "logit" matched nothing, so the layer the user meant
    # computes as under the built-in rules.
    assert model.get_layer("logits").compute_dtype == "float16"
    assert model.get_layer("hidden").compute_dtype == "float32"
    caught = _compile(model)
    assert [w.category for w in caught] == [errors.PolicyWarning]
    message = str(caught[0].message)
    assert "'logit'" in message and "float32_layers" in message
    assert "'logits' (Dense)" in message  # the nearest name
    assert "'hid.*'" not in message  # it matches "hidden"
    assert caught[0].filename == __file__  # the user's compile call
    assert _policy_warnings(_compile(model)) == []  # once per model
    with kerasmp.policy_scope(policy):
        other = _model("other")
    assert len(_policy_warnings(_compile(other))) == 1


def test_an_exclude_pattern_that_matches_no_layer_warns():
    policy = kerasmp.Policy("mixed_float16", float32_exclude=["nrm"])
    with kerasmp.policy_scope(policy):
        model = _model()
    assert model.get_layer("norm").compute_dtype == "float32"  # not excluded
    caught = _policy_warnings(_compile(model))
    assert len(caught) == 1
    message = str(caught[0].message)
    assert "float32_exclude" in message and "'nrm'" in message
    assert "'norm' (LayerNormalization)" in message


def test_a_class_name_given_as_a_pattern_says_to_pass_the_class():
    policy = kerasmp.Policy("mixed_float16", float32_layers=["Dense"])
    with kerasmp.policy_scope(policy):
        model = _model()
    caught = _policy_warnings(_compile(model))
    assert len(caught) == 1
    assert "pass the class keras.layers.Dense" in str(caught[0].message)


def test_patterns_that_match_say_nothing():
    policy = kerasmp.Policy("mixed_float16", float32_layers=["logits"],
                            float32_exclude=["norm"])
    with kerasmp.policy_scope(policy):
        model = _model()
    assert _policy_warnings(_compile(model)) == []


def test_a_policy_set_after_the_model_was_built_warns_at_compile():
    model = _model()  # built under Keras's float32 default
    kerasmp.set_global_policy(kerasmp.Policy("mixed_float16"))
    caught = _compile(model)
    # What the user gets, the reason for the warning: float32 layers and a
    # plain optimizer, where a model built under the policy is float16.
    reference = _model("reference")
    assert reference.get_layer("hidden").compute_dtype == "float16"
    assert model.get_layer("hidden").compute_dtype == "float32"
    assert isinstance(model.optimizer, keras.optimizers.Adam)
    assert not isinstance(model.optimizer, kerasmp.LossScaleOptimizer)
    policy_warnings = _policy_warnings(caught)
    assert len(policy_warnings) == 1
    message = str(policy_warnings[0].message)
    assert "'m' was built before" in message
    assert "kerasmp.set_global_policy('mixed_float16') before building" in (
        message)
    assert policy_warnings[0].filename == __file__
    assert _policy_warnings(_compile(model)) == []  # once per model
    # A model built under the policy says nothing.
    assert _policy_warnings(_compile(reference)) == []


def test_a_model_built_under_the_policy_with_every_layer_float32_is_quiet():
    # Its float32 layers are its rules' doing, not a late policy.
    policy = kerasmp.Policy("mixed_float16",
                            float32_layers=[keras.layers.Dense])
    kerasmp.set_global_policy(policy)
    model = _model()
    assert {l.compute_dtype for l in model.layers[1:]} == {"float32"}
    assert _policy_warnings(_compile(model)) == []
