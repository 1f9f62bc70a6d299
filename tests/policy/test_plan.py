"""One plan per model (`kerasmp.policy.plan.plan_of`): `compile`,
`export`, `check` and `tune` read one `Plan`, made by one walk of the
model's layers, and a new one is made when the model or a policy changes.

The counts are of `kerasmp._utils.layers.walk` calls whose root is the
model (spied in every kerasmp module that imported it) and of entries into
`kerasmp.policy.measure` (`measure_once`, `measure`) for the model; a
fresh plan is compared with one made from scratch (`plan`) and with what
the change must have done.
"""

import sys

import keras
import numpy as np
import pytest
from keras import ops

import kerasmp
import kerasmp._utils.layers as layers_module
import kerasmp.policy.measure as measure_module
from kerasmp.policy import plan as plan_module
from kerasmp.policy.plan import plan
from kerasmp.policy.plan import plan_of

pytestmark = pytest.mark.torch  # also in the PyTorch pass (conftest.py)

_FORMAT = {"tensorflow": "savedmodel", "jax": "savedmodel", "torch": "torch"}


@pytest.fixture
def spy(monkeypatch):
    """`{"walks": n, "measure": n, "plans": n}` for the model in
    `spy["model"]`, counted from when it is set."""
    import kerasmp.debug.hazards  # noqa: F401 (every module that walks)
    import kerasmp.export.half  # noqa: F401
    import kerasmp.export.inputs  # noqa: F401
    import kerasmp.export.keras_config  # noqa: F401
    import kerasmp.export.tuned  # noqa: F401
    import kerasmp.tune.tuner  # noqa: F401

    counts = {"model": None, "walks": 0, "measure": 0, "plans": 0}
    originals = {
        "walks": layers_module.walk,
        "measure": (measure_module.measure, measure_module.measure_once),
        "plans": plan_module.plan,
    }

    def counted(key, function):
        def spied(*args, **kwargs):
            if args and args[0] is counts["model"]:
                counts[key] += 1
            return function(*args, **kwargs)
        return spied

    replace = {id(originals["walks"]): counted("walks", originals["walks"]),
               id(originals["plans"]): counted("plans", originals["plans"])}
    for function in originals["measure"]:
        replace[id(function)] = counted("measure", function)
    for name, module in list(sys.modules.items()):
        if not name.startswith("kerasmp") or module is None:
            continue
        for attr, value in list(vars(module).items()):
            if id(value) in replace and callable(value):
                monkeypatch.setattr(module, attr, replace[id(value)])
    return counts


def _model():
    return keras.Sequential([
        keras.Input((8,)),
        keras.layers.Dense(16, activation="relu", name="hidden"),
        keras.layers.LayerNormalization(name="norm"),
        keras.layers.Dense(4, name="logits"),
        keras.layers.Softmax(name="probs"),
    ])


def _export(model, tmp_path, name):
    fmt = _FORMAT[keras.backend.backend()]
    name += ".pt2" if fmt == "torch" else ""
    return kerasmp.export.export(model, str(tmp_path / name), format=fmt)


def test_one_export_walks_the_model_once_and_measures_it_once(
        mixed_policy, spy, tmp_path):
    # Before one plan per model: 20 walks of the model per export (the
    # HalfModel alone walked it on every call of the copy).
    model = _model()
    spy["model"] = model
    report = _export(model, tmp_path, "m")
    assert spy["walks"] == 1
    assert spy["measure"] <= 1
    assert report.kept_float32 == {"norm": "Keras class "
                                   "(LayerNormalization)",
                                   "probs": "Keras class (Softmax)"}
    # The same model again: its plan is still good, nothing is walked.
    _export(model, tmp_path, "again")
    assert spy["walks"] == 1
    assert spy["plans"] == 1


def test_compile_export_check_and_tune_make_one_plan(
        mixed_policy, spy, tmp_path):
    # Before: 35 walks of the model and 8 measure entries for these four.
    model = _model()
    x = np.random.default_rng(0).uniform(size=(16, 8)).astype("float32")
    spy["model"] = model
    model.compile("adam", "categorical_crossentropy")
    _export(model, tmp_path, "m")
    kerasmp.check(model, x)
    kerasmp.tune(model, x)
    assert spy["plans"] == 1
    assert spy["walks"] == 1
    made = plan_of(model)
    assert made == plan(model)  # as a plan made from scratch
    assert made.needs_loss_scaling
    assert made.policy is mixed_policy


def _paths(made):
    return [path for path, _ in made.walk()]


def _same_as_fresh(model):
    """The cached plan, checked to equal one made from scratch entry by
    entry (dataclass equality: layers by identity, policies by config)."""
    cached, fresh = plan_of(model), plan(model)
    assert _paths(cached) == _paths(fresh)
    for a, b in zip(cached.layers, fresh.layers):
        assert a.layer is b.layer and a.stored is b.stored, a.path
    assert cached == fresh
    return cached


def test_a_policy_set_on_a_layer_makes_a_new_plan(mixed_policy):
    model = _model()
    first = plan_of(model)
    assert first["norm"].rule == "Keras class (LayerNormalization)"
    assert first["hidden"].policy is mixed_policy

    model.get_layer("hidden").dtype_policy = "float32"
    second = _same_as_fresh(model)
    assert second is not first
    assert second["hidden"].policy is None
    assert second["hidden"].stored.name == "float32"
    assert second["norm"].policy is mixed_policy

    rules = kerasmp.Policy("mixed_float16", float32_layers=["logits"],
                           float32_defaults=False)
    model.get_layer("norm").dtype_policy = rules
    third = _same_as_fresh(model)
    assert third["norm"].policy is rules
    assert third["norm"].rule is None  # its own rules: only "logits"
    assert third["logits"].policy is mixed_policy
    assert third["logits"].rule is None


def test_a_new_global_policy_makes_a_new_plan(mixed_policy):
    model = _model()
    first = plan_of(model)
    kerasmp.set_global_policy("mixed_bfloat16")
    second = _same_as_fresh(model)
    assert second is not first
    assert second.policy is mixed_policy  # its layers keep their policy
    model.add(keras.layers.Dense(2, name="extra"))  # under mixed_bfloat16
    third = _same_as_fresh(model)
    assert third["extra"].policy.compute_dtype == "bfloat16"


class HalfRefusing(keras.layers.Layer):
    """Raises in float16 once `fit` traces it (as in test_measure.py):
    compile's measurement moves it to float32."""

    def call(self, x, training=None):
        if training and keras.backend.standardize_dtype(x.dtype) == "float16":
            raise TypeError("Range has no float16 kernel")
        return ops.tanh(x) * 2.0


def test_compiles_measured_move_makes_a_new_plan(mixed_policy, spy):
    inputs = keras.Input((8,))
    hidden = keras.layers.Dense(8, name="hidden")(inputs)
    refusing = HalfRefusing(name="refusing")(hidden)
    model = keras.Model(inputs, keras.layers.Dense(2, name="out")(refusing))
    spy["model"] = model
    model.compile("adam", "mse")  # measures: "refusing" moves to float32
    after = _same_as_fresh(model)
    assert spy["plans"] == 2  # before the move (measure's), and after
    entry = after["refusing"]
    assert isinstance(entry.stored, kerasmp.policy.policy.Float32Override)
    assert entry.layer.compute_dtype == "float32"
    assert entry.policy is None  # a Float32Override, no kerasmp Policy
    governed = after["hidden"].policy
    assert governed.measured[entry.layer.path]["rule"] == "fails in float16"
    assert after["hidden"].measured is None  # the moved layer has the entry


def test_a_changed_model_gets_its_own_plan(mixed_policy):
    model = _model()
    first = plan_of(model)
    model.add(keras.layers.Dense(3, name="extra"))
    added = _same_as_fresh(model)
    assert added is not first
    assert _paths(added)[-1] == "extra"
    assert added["extra"].policy is mixed_policy

    # A new model around the same layers: a plan of its own, the old one
    # kept for the old model.
    outer = keras.Sequential([keras.Input((8,)), model])
    wrapped = _same_as_fresh(outer)
    assert model.name in _paths(wrapped)
    assert [p.split("/", 1)[1] for p in _paths(wrapped)
            if p.startswith(model.name + "/")] == _paths(added)
    assert wrapped[model.name + "/extra"].layer is added["extra"].layer
    assert plan_of(model) is added


def test_freezing_a_layer_makes_a_new_plan(mixed_policy):
    model = keras.Sequential([keras.Input((4,)),
                              keras.layers.Dense(2, name="only")])
    assert plan_of(model).needs_loss_scaling
    model.get_layer("only").trainable = False
    frozen = _same_as_fresh(model)
    assert not frozen.needs_loss_scaling  # nothing trains in float16


def test_a_model_with_its_plan_saves_and_loads_as_before(
        mixed_policy, tmp_path):
    # `.keras` saving walks a model's attributes into lists and tuples:
    # the cached plan must not be one of them (a tuple holding the model
    # recursed without end).
    model = _model()
    x = np.random.default_rng(0).uniform(size=(4, 8)).astype("float32")
    expected = keras.ops.convert_to_numpy(model(x))
    plan_of(model)
    model.save(tmp_path / "m.keras")
    loaded = keras.saving.load_model(tmp_path / "m.keras")
    assert [tuple(v.shape) for v in loaded.weights] == [
        tuple(v.shape) for v in model.weights]
    np.testing.assert_array_equal(
        keras.ops.convert_to_numpy(loaded(x)), expected)
    assert _paths(plan_of(loaded)) == _paths(plan_of(model))
