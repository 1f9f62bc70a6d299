"""Contract tests for `kerasmp/_keras_internals.py`, kerasmp's seam to Keras.

Each test pins one private Keras behaviour that kerasmp relies on, so that a
Keras release that renames or changes it fails here, naming the Keras
version and the seam function, instead of silently breaking kerasmp. Run
them against the newest Keras with `bash tests/run.sh --keras-nightly`.

The last test checks that no other kerasmp module reaches into Keras's
private internals (docs/architecture.md lists the exceptions).
"""

import ast
import pathlib
import re
import warnings

import keras
import numpy as np
import pytest

import kerasmp
from kerasmp import _keras_internals as ki

V = keras.__version__
FIX = "update kerasmp/_keras_internals.py"
BACKEND = keras.backend.backend()


def _changed(what):
    return f"Keras {V} changed {what}: {FIX}"


class _Wrapper(keras.layers.Layer):
    """A layer that owns no variables, only sublayers (built in __init__)."""

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.inner = keras.layers.Dense(3, name="inner")
        self.norm = keras.layers.LayerNormalization(name="norm")

    def call(self, x):
        return self.norm(self.inner(x))


# ------------------------------------------------------------------ layers


def test_dtype_policy_attr_is_what_layer_dtypes_read():
    layer = keras.layers.Dense(2)
    policy = keras.DTypePolicy("mixed_float16")
    assert ki.stored_dtype_policy(layer) is not None, _changed(
        f"where Layer stores its policy (no `{ki.DTYPE_POLICY_ATTR}` in the "
        "instance __dict__)"
    )
    ki.store_dtype_policy(layer, policy)
    assert ki.stored_dtype_policy(layer) is policy, _changed(
        f"Layer.{ki.DTYPE_POLICY_ATTR} storage"
    )
    assert (layer.compute_dtype, layer.variable_dtype) == (
        "float16",
        "float32",
    ), _changed(
        f"what Layer.compute_dtype/variable_dtype read (not "
        f"Layer.{ki.DTYPE_POLICY_ATTR}): every kerasmp float32 override "
        "would silently stop applying"
    )
    assert layer.dtype_policy is policy, _changed("Layer.dtype_policy")


def test_dtype_policy_descriptor_is_installed_on_layer():
    descriptor = vars(keras.layers.Layer).get(ki.DTYPE_POLICY_ATTR)
    assert descriptor is not None and hasattr(descriptor, "__set__"), (
        _changed(f"keras.layers.Layer.{ki.DTYPE_POLICY_ATTR}")
    )
    for cls in keras.layers.Dense.__mro__:
        if cls is keras.layers.Layer:
            break
        assert ki.DTYPE_POLICY_ATTR not in vars(cls), _changed(
            f"{cls.__name__} defines its own {ki.DTYPE_POLICY_ATTR}, which "
            "hides kerasmp's descriptor"
        )


def test_dtype_policy_descriptor_reaches_nested_layers():
    # The Softmax inside MultiHeadAttention gets the parent's policy object
    # and a Dense inside a custom layer gets dtype=None: both dtype reads
    # must go through the descriptor for the float32 rule to apply.
    policy = kerasmp.Policy(
        "mixed_float16",
        float32_layers=[keras.layers.Softmax, keras.layers.LayerNormalization],
        float32_defaults=False,
    )
    with kerasmp.policy_scope(policy):
        mha = keras.layers.MultiHeadAttention(2, 4, name="mha")
        wrapper = _Wrapper(name="wrap")
        x = np.zeros((1, 3, 8), "float32")
        mha(x, x)
        wrapper(x)
    softmax = [
        l for l in ki.sublayers(mha) if isinstance(l, keras.layers.Softmax)
    ]
    assert softmax, _changed("MultiHeadAttention's sublayers (no Softmax)")
    assert isinstance(ki.stored_dtype_policy(softmax[0]), kerasmp.Policy), (
        _changed("how MultiHeadAttention hands its policy to its Softmax")
    )
    assert softmax[0].compute_dtype == "float32", _changed(
        f"nested dtype resolution: the Softmax inside MultiHeadAttention no "
        f"longer reads Layer.{ki.DTYPE_POLICY_ATTR}"
    )
    assert wrapper.norm.compute_dtype == "float32", _changed(
        "nested dtype resolution of a sublayer built with dtype=None"
    )
    assert wrapper.inner.compute_dtype == "float16", _changed(
        "nested dtype resolution of a sublayer built with dtype=None"
    )
    y = wrapper.norm(np.zeros((1, 3, 3), "float32"))
    assert keras.backend.standardize_dtype(y.dtype) == "float32", _changed(
        "the dtype a float32-overridden layer computes in"
    )


def test_sublayers_flattens_nested_layers():
    wrapper = _Wrapper(name="wrap")
    model = keras.Sequential(
        [keras.Input((4,)), wrapper, keras.layers.Dense(1)]
    )
    found = ki.sublayers(model)
    assert model not in found, _changed("Layer._flatten_layers(include_self)")
    for layer in (wrapper, wrapper.inner, wrapper.norm):
        assert any(l is layer for l in found), _changed(
            "Layer._flatten_layers: a nested sublayer is missing"
        )
    assert ki.sublayers(keras.layers.Dense(1)) == [], _changed(
        "Layer._flatten_layers on a leaf layer"
    )


def test_direct_sublayers_in_creation_order():
    wrapper = _Wrapper()  # unbuilt
    assert ki.direct_sublayers(wrapper) == [wrapper.inner, wrapper.norm], (
        _changed("Layer._layers (the directly tracked sublayers)")
    )
    model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(1)])
    first = ki.direct_sublayers(model)[0]
    assert isinstance(first, keras.layers.InputLayer), _changed(
        "Sequential._layers (no longer starts with its InputLayer)"
    )
    assert ki.direct_sublayers(object()) == []


def test_own_variables_and_trainable_flag():
    wrapper = _Wrapper()
    wrapper(np.zeros((1, 4), "float32"))
    assert not ki.has_own_trainable_variables(wrapper), _changed(
        "Layer._trainable_variables (a wrapper owns its sublayers' variables)"
    )
    assert ki.has_own_trainable_variables(wrapper.inner), _changed(
        "Layer._trainable_variables (empty for a built Dense)"
    )
    bn = keras.layers.BatchNormalization()
    bn.build((None, 3))
    assert {id(v) for v in ki.own_variables(bn)} == {
        id(v) for v in bn.weights
    }, _changed("Layer._trainable_variables/_non_trainable_variables")
    assert ki.own_variables(wrapper) == [], _changed(
        "Layer._trainable_variables/_non_trainable_variables"
    )


def test_keras_mask_roundtrip():
    emb = keras.layers.Embedding(5, 2, mask_zero=True)
    y = emb(np.array([[1, 0]]))
    mask = ki.get_keras_mask(y)
    assert mask is not None, _changed("where Keras keeps a tensor's mask")
    z = keras.ops.cast(y, "float16")
    ki.set_keras_mask(z, mask)
    assert ki.get_keras_mask(z) is mask, _changed("set_keras_mask")
    assert keras.ops.convert_to_numpy(mask).tolist() == [[True, False]]


# ------------------------------------------------------------------ models


def test_trainer_class_owns_model_compile():
    trainer = ki.trainer_class()
    assert issubclass(keras.Model, trainer), _changed(
        "the trainer class (keras.src.trainers.trainer)"
    )
    assert "compile" in vars(trainer), _changed(f"{trainer.__name__}.compile")
    for cls in keras.Model.__mro__:
        if cls is trainer:
            break
        assert "compile" not in vars(cls) or cls.__module__.startswith(
            "kerasmp"
        ), _changed(
            f"{cls.__name__} overrides compile: kerasmp's loss-scaling hook "
            f"on {trainer.__name__}.compile would be bypassed"
        )


def test_trainer_class_owns_the_compile_config():
    trainer = ki.trainer_class()
    for name in ("get_compile_config", "compile_from_config"):
        assert name in vars(trainer), _changed(f"{trainer.__name__}.{name}")
        for cls in keras.Model.__mro__:
            if cls is trainer:
                break
            assert name not in vars(cls) or cls.__module__.startswith(
                "kerasmp"), _changed(
                f"{cls.__name__} overrides {name}: kerasmp's optimizer "
                "saving would be bypassed")


def test_keras_saveable_attributes_are_saved_at_their_own_path(tmp_path):
    saveable = ki.keras_saveable_class()
    seen = {}

    class Extra(saveable):
        def _obj_type(self):
            return "Optimizer"

        def save_own_variables(self, store):
            store["x"] = np.array(3.0, "float32")

        def load_own_variables(self, store):
            seen.update({k: float(np.asarray(store[k])) for k in store.keys()})

    model = keras.Sequential([keras.Input((2,)), keras.layers.Dense(1)])
    model.compile(keras.optimizers.SGD(), "mse")
    model.optimizer.build(model.trainable_variables)
    model.optimizer.extra_state = Extra()
    path = str(tmp_path / "m.weights.h5")
    model.save_weights(path)
    model.load_weights(path)
    assert seen == {"x": 3.0}, _changed(
        "KerasSaveable (saving_lib's walk of an optimizer's attributes)")


def test_operation_class_owns_layer_from_config():
    op = ki.operation_class()
    assert issubclass(keras.layers.Dense, op), _changed("Operation")
    assert "from_config" in vars(op), _changed("Operation.from_config")
    # Layers that override from_config (Dense does) must still reach the
    # hooked Operation.from_config, which rebuilds the kerasmp policy.
    for layer in (keras.layers.Dense(1), keras.layers.Softmax()):
        layer = type(layer)(**{
            **layer.get_config(),
            "dtype": kerasmp.Policy("mixed_float16"),
        })
        restored = type(layer).from_config(layer.get_config())
        stored = ki.stored_dtype_policy(restored)
        assert type(stored).__module__.startswith("kerasmp."), _changed(
            f"{type(layer).__name__}.from_config no longer goes through "
            f"{op.__name__}.from_config, kerasmp's loading hook"
        )


def test_dtype_policy_modules_share_serialize():
    modules = ki.dtype_policy_modules()
    for module in modules:
        assert module.serialize is modules[0].serialize, _changed(
            f"{module.__name__}.serialize is not the one kerasmp patches"
        )
        assert module.deserialize is modules[0].deserialize, _changed(
            f"{module.__name__}.deserialize is not the one kerasmp patches"
        )
    # Layer.get_config goes through the patched serialize.
    layer = keras.layers.Dense(1, dtype=kerasmp.Policy("mixed_bfloat16"))
    config = layer.get_config()["dtype"]
    assert isinstance(config, dict) and "kerasmp" in config, _changed(
        "Layer.get_config no longer calls dtype_policies.serialize"
    )


def _functional():
    inputs = keras.Input((3,))
    h = keras.layers.Dense(4, name="a")(inputs)
    return keras.Model(inputs, keras.layers.Dense(2, name="b")(h))


def test_backend_nn_module_is_what_ops_attention_calls(monkeypatch):
    nn = ki.backend_nn_module()
    seen = []

    def spy(query, key, value, **kwargs):
        seen.append(kwargs)
        return query

    monkeypatch.setattr(nn, "dot_product_attention", spy)
    q = np.ones((1, 2, 1, 2), "float32")
    keras.ops.dot_product_attention(q, q, q)
    assert len(seen) == 1, _changed(
        "where keras.ops.dot_product_attention dispatches "
        "(keras.src.backend.<backend>.nn, or .ops.nn since Keras 3.16)"
    )


def test_functional_class_and_run_through_graph():
    model = _functional()
    assert isinstance(model, ki.functional_class()), _changed("Functional")
    seen = []

    def operation_fn(layer):
        seen.append(layer.name)
        return layer

    inputs = keras.Input((3,))
    outputs = ki.run_through_graph(model, inputs, operation_fn)
    assert seen == ["a", "b"], _changed("Functional._run_through_graph")
    rebuilt = keras.Model(inputs, outputs)
    x = np.random.default_rng(0).normal(size=(2, 3)).astype("float32")
    np.testing.assert_allclose(
        keras.ops.convert_to_numpy(rebuilt(x)),
        keras.ops.convert_to_numpy(model(x)),
        err_msg=_changed("Functional._run_through_graph"),
    )


class _WithTraining(keras.Model):
    def __init__(self):
        super().__init__()
        self.dense = keras.layers.Dense(1)

    def call(self, x, training=None):
        return self.dense(x)


class _WithoutTraining(_WithTraining):
    def call(self, x):
        return self.dense(x)


def test_trace_symbolically_runs_ops_without_computing():
    dense = keras.layers.Dense(3)
    x = keras.KerasTensor((None, 4))
    out = ki.trace_symbolically(lambda t: dense(t, training=True), x)
    assert isinstance(out, keras.KerasTensor), _changed(
        "keras.src.backend.compute_output_spec")
    assert tuple(out.shape) == (None, 3)

    def refused(t):
        raise TypeError("an op the backend refuses")

    with pytest.raises(TypeError, match="refuses"):
        ki.trace_symbolically(refused, x)


def test_call_has_training_arg():
    assert ki.call_has_training_arg(_WithTraining()), _changed(
        "Layer._call_has_training_arg"
    )
    assert not ki.call_has_training_arg(_WithoutTraining()), _changed(
        "Layer._call_has_training_arg"
    )


def test_has_compiled_loss():
    model = _functional()
    assert not ki.has_compiled_loss(model)
    model.compile(optimizer="sgd")
    assert not ki.has_compiled_loss(model), _changed("Trainer._compile_loss")
    model.compile(optimizer="sgd", loss="mse")
    assert ki.has_compiled_loss(model), _changed("Trainer._compile_loss")


def test_loss_tracker_is_the_mean_fit_logs_as_loss():
    model = _functional()
    model.compile(optimizer="sgd", loss="mse")
    tracker = ki.loss_tracker(model)
    assert isinstance(tracker, keras.metrics.Mean), _changed(
        "Trainer._loss_tracker"
    )
    x = np.ones((4,) + tuple(model.input_shape[1:]), "float32")
    y = model.predict(x, verbose=0) + 2.0  # mse 4 on every sample
    logs = model.fit(x, y, batch_size=2, epochs=1, verbose=0).history
    assert float(tracker.result()) == pytest.approx(logs["loss"][0], rel=1e-5)
    # `count` is what kerasmp's train step reads (docs/monitoring.md).
    assert float(tracker.count) > 0, _changed("Mean.count")


def test_losses_override():
    layer = keras.layers.Dense(1, activity_regularizer="l2")
    layer(np.ones((1, 2), "float32"))
    assert len(layer.losses) == 1
    override = keras.ops.convert_to_tensor(7.0)
    ki.set_losses_override(layer, [override])
    try:
        values = [float(keras.ops.convert_to_numpy(v)) for v in layer.losses]
        assert values == [7.0], _changed("Layer._losses_override")
    finally:
        ki.clear_losses_override(layer)
    assert len(layer.losses) == 1, _changed("Layer._losses_override")


@pytest.mark.skipif(BACKEND != "jax", reason="the JAX trainer's state")
def test_jax_state_layout():
    model = _functional()
    model.compile(optimizer="sgd", loss="mse", metrics=["mae"])
    x = np.ones((2, 3), "float32")
    y = np.zeros((2, 2), "float32")
    model.fit(x, y, epochs=1, verbose=0)
    state = ki.jax_state(model)
    for name in ki.JAX_STATE_FIELDS:
        expected = getattr(
            model.optimizer if name == "optimizer_variables" else model,
            "variables" if name == "optimizer_variables" else name,
        )
        assert len(ki.jax_state_field(state, name)) == len(expected), (
            _changed(f"the JAX trainer state layout ({name})")
        )
    logs, new_state = model.train_step(state, (x, y))
    assert len(new_state) == len(ki.JAX_STATE_FIELDS), _changed(
        "JAXTrainer.train_step's state"
    )
    i = [id(v) for v in model.optimizer.variables].index(
        id(model.optimizer.iterations)
    )
    old = ki.jax_state_field(state, "optimizer_variables")[i]
    new = ki.jax_state_field(new_state, "optimizer_variables")[i]
    assert int(new) == int(old) + 1, _changed("the JAX trainer state layout")
    # A state with one field replaced is one train_step accepts.
    fresh = ki.jax_state_replace(
        new_state, "optimizer_variables",
        ki.jax_state_field(state, "optimizer_variables"))
    assert ki.jax_state_field(fresh, "trainable_variables") is (
        ki.jax_state_field(new_state, "trainable_variables"))
    _, again = model.train_step(fresh, (x, y))
    assert int(ki.jax_state_field(again, "optimizer_variables")[i]) == (
        int(old) + 1), _changed("JAXTrainer.train_step's state")
    ki.jax_state_sync(model)  # no error outside fit


def test_jax_unsynced_state_is_the_running_fit_state():
    """During a JAX fit, `jax_unsynced_state` holds the newest values,
    aligned with the variable lists, until a sync; elsewhere it is None.
    `callback_model` is the callback's model."""
    model = _functional()
    model.compile(optimizer="sgd", loss="mse")
    x = np.arange(6, dtype="float32").reshape(2, 3)
    y = np.ones((2, 2), "float32")
    seen = []

    class Look(keras.callbacks.Callback):
        def on_train_batch_end(self, batch, logs=None):
            model = ki.callback_model(self)  # `self.model` would sync
            state = ki.jax_unsynced_state(model)
            if state is None:
                seen.append(None)
                return
            lengths = {
                name: len(state[name]) == len(getattr(
                    model.optimizer if name == "optimizer_variables"
                    else model,
                    "variables" if name == "optimizer_variables" else name))
                for name in ki.JAX_STATE_FIELDS}
            kernel = np.array(state["trainable_variables"][0])
            ki.jax_state_sync(model)
            synced = np.asarray(model.trainable_variables[0].value)
            seen.append((lengths, np.array_equal(kernel, synced),
                         ki.jax_unsynced_state(model) is None))

    before = np.asarray(model.trainable_variables[0].value)
    look = Look()
    model.fit(x, y, batch_size=1, epochs=1, verbose=0, callbacks=[look])
    assert ki.callback_model(look) is model, _changed("Callback._model")
    assert ki.jax_unsynced_state(model) is None  # outside fit
    if BACKEND != "jax":
        assert seen == [None, None]
        return
    assert len(seen) == 2 and None not in seen, _changed(
        "JAXTrainer._jax_state / _jax_state_synced")
    for lengths, same, cleared in seen:
        assert all(lengths.values()), _changed(
            f"the JAX trainer's running state layout ({lengths})")
        assert same, _changed("JAXTrainer._jax_state (not the newest values)")
        assert cleared, _changed("JAXTrainer._jax_state_synced")
    # The values were the trained ones, not the initial kernel.
    assert not np.array_equal(before, np.asarray(
        model.trainable_variables[0].value))


def test_jax_coordination_client_is_a_key_value_store(tmp_path):
    # A fresh process (jax.distributed.initialize is once per process), one
    # process of one: the client exists, a value set is read back, and a
    # missing key times out instead of blocking.
    pytest.importorskip("jax")
    import subprocess
    import sys

    from _helpers import free_ports
    from _helpers import subprocess_env

    script = tmp_path / "kv.py"
    script.write_text(
        "import sys, time, jax\n"
        "from kerasmp import _keras_internals as ki\n"
        "assert ki.jax_coordination_client() is None\n"
        "jax.distributed.initialize(\n"
        "    coordinator_address=f'127.0.0.1:{sys.argv[1]}',\n"
        "    num_processes=1, process_id=0)\n"
        "client = ki.jax_coordination_client()\n"
        "client.key_value_set('kerasmp/test/0', 'settings')\n"
        "got = client.blocking_key_value_get('kerasmp/test/0', 1000)\n"
        "start = time.time()\n"
        "try:\n"
        "    client.blocking_key_value_get('kerasmp/test/1', 200)\n"
        "    late = 'no timeout'\n"
        "except Exception as e:\n"
        "    late = 'DEADLINE_EXCEEDED' in str(e) and time.time() - start\n"
        "print('RESULT', got, late < 30)\n"
    )
    out = subprocess.run(
        [sys.executable, str(script), str(free_ports(1)[0])],
        capture_output=True, text=True, timeout=120,
        env=subprocess_env("jax"),
    )
    assert "RESULT settings True" in out.stdout, (
        _changed("the JAX coordination service client") + out.stderr[-2000:]
    )


def test_jax_step_batches_splits_an_execution_into_steps():
    if keras.backend.backend() != "jax":
        pytest.skip("the JAX trainer's iterator")
    model = _functional()
    model.compile(optimizer="sgd", loss="mse", steps_per_execution=3)
    seen = []

    def train_function(state, iterator):
        batches = list(ki.jax_step_batches(iterator, 3))
        if not batches:
            raise StopIteration
        seen.append([tuple(b[0].shape) for b in batches])
        for batch in batches:
            logs, state = model.train_step(state, batch)
        return logs, state

    model.train_function = train_function  # fit keeps a set one
    x = np.ones((7, 3), "float32")
    y = np.zeros((7, 2), "float32")
    model.fit(x, y, batch_size=1, epochs=1, verbose=0)
    assert seen == [[(1, 3)] * 3, [(1, 3)] * 3, [(1, 3)]], _changed(
        "the JAX fit iterator under steps_per_execution"
    )


# -------------------------------------------------------------- optimizers


def _built(optimizer, *variables):
    optimizer.build(list(variables))
    return optimizer


@pytest.mark.torch
@pytest.mark.skipif(BACKEND != "torch", reason="PyTorch's epoch iterator")
def test_torch_epoch_iterator_warns_of_running_out_through_one_method():
    # kerasmp's patch (kerasmp/_patches.py, 6.) wraps this method: every
    # "ran out of data" warning of the iterator must come from it.
    cls = ki.torch_epoch_iterator_class()
    name = ki.INTERRUPTED_WARNING_ATTR
    assert callable(getattr(cls, name, None)), _changed(
        f"TorchEpochIterator.{name}"
    )
    # 6 batches; 10 steps asked, 4 per execution: the data ends inside the
    # second execution, and again before a third.
    iterator = cls(x=np.zeros((24, 2), "float32"), batch_size=4,
                   steps_per_epoch=10, steps_per_execution=4)
    calls = []
    setattr(iterator, name, lambda: calls.append(name))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        steps = [(b, e, len(data)) for b, e, data in iterator]
    assert steps == [(0, 3, 4), (4, 7, 2)], _changed(
        f"the executions TorchEpochIterator hands out ({steps})"
    )
    assert calls and not [
        w for w in caught if "ran out of data" in str(w.message)
    ], _changed(f"where TorchEpochIterator warns of running out (not {name})")


@pytest.mark.torch
@pytest.mark.skipif(BACKEND != "torch", reason="Keras's PyTorch trainer")
def test_torch_trainer_runs_executions_is_what_stock_keras_does():
    # Asked of stock Keras (kerasmp's patches out): `evaluate` and
    # `predict` with 4 steps per execution run where the seam says Keras's
    # PyTorch trainer runs executions (Keras 3.16), and are refused with
    # Keras's ValueError where it says not (Keras 3.15).
    assert issubclass(keras.Model, ki.torch_trainer_class()), _changed(
        "the PyTorch trainer class")
    runs = ki.torch_trainer_runs_executions()
    x = np.arange(20, dtype="float32").reshape(10, 2) / 20
    kerasmp.uninstall()
    try:
        keras.utils.set_random_seed(0)
        model = keras.Sequential([keras.Input((2,)), keras.layers.Dense(1)])
        model.compile("sgd", "mse", steps_per_execution=4)
        for call in (lambda: model.evaluate(x, x[:, :1], batch_size=2,
                                            verbose=0),
                     lambda: model.predict(x, batch_size=2, verbose=0)):
            if runs:
                call()
            else:
                with pytest.raises(ValueError, match="steps_per_execution"):
                    call()
        if runs:
            assert model.predict(x, batch_size=2, verbose=0).shape == (
                10, 1), _changed("PyTorch's multi-step predict")
    finally:
        kerasmp.install()


def test_optimizer_variables_and_index():
    a = keras.Variable(np.ones(2, "float32"))
    b = keras.Variable(np.ones(3, "float32"))
    opt = _built(keras.optimizers.SGD(momentum=0.9), a, b)
    assert ki.optimizer_iterations(opt) is opt.iterations, _changed(
        "Optimizer._iterations"
    )
    assert ki.optimizer_trainable_variables(opt) == [a, b], _changed(
        "Optimizer._trainable_variables"
    )
    assert ki.optimizer_variable_index(opt, b) == 1, _changed(
        "Optimizer._get_variable_index"
    )
    lso = _built(kerasmp.LossScaleOptimizer(keras.optimizers.SGD()), a, b)
    own = ki.optimizer_own_variables(lso)
    names = {v.name for v in own}
    assert {"dynamic_scale", "step_counter"} <= names, _changed(
        "Optimizer._variables"
    )
    assert [id(v) for v in lso.variables[: len(own)]] == [
        id(v) for v in own
    ], _changed("LossScaleOptimizer.variables (own first, then the inner's)")
    assert not any(
        id(v) in {id(w) for w in lso.inner_optimizer.variables} for v in own
    ), _changed("Optimizer._variables (includes the inner optimizer's)")


def test_unscale_grads_is_what_stock_loss_scaling_unscales_with():
    # Keras 3.16: the stock optimizer's apply unscales through this method
    # (kerasmp.LossScaleOptimizer defines it); Keras 3.15 has none.
    name = ki.UNSCALE_GRADS_ATTR
    stock_cls = keras.optimizers.LossScaleOptimizer
    assert name in vars(kerasmp.LossScaleOptimizer)
    if not hasattr(stock_cls, name):
        assert keras.__version__.startswith("3.15"), _changed(
            f"LossScaleOptimizer.{name} (gone)")
        return
    v = keras.Variable(np.ones(2, "float32"))
    stock = _built(stock_cls(keras.optimizers.SGD(1.0), initial_scale=4.0),
                   v)
    calls = []
    original = getattr(stock, name)

    def spy(grads, variables):
        calls.append(len(grads))
        return original(grads, variables)

    setattr(stock, name, spy)
    grads = [keras.ops.full((2,), 8.0)]
    if BACKEND == "jax":  # stock's stateful apply leaks a tracer on JAX
        new, _ = stock.stateless_apply(
            [x.value for x in stock.variables], grads, [v.value])
    else:
        stock.apply(grads, [v])
        new = [v]
    assert calls == [1], _changed(f"where stock apply unscales ({name})")
    np.testing.assert_allclose(keras.ops.convert_to_numpy(new[0]),
                               [-1.0, -1.0])


def test_overwrites_with_gradient():
    a = keras.Variable(np.ones(2, "float32"))
    b = keras.Variable(np.ones(2, "float32"))
    b.overwrite_with_gradient = True
    opt = _built(keras.optimizers.SGD(), a, b)
    assert not ki.overwrites_with_gradient(opt, a)
    assert ki.overwrites_with_gradient(opt, b), _changed(
        "Optimizer._overwrite_variable_with_gradient"
    )


def test_gradient_accumulators():
    v = keras.Variable(np.zeros(2, "float32"))
    plain = _built(keras.optimizers.SGD(), v)
    assert ki.accumulated_gradients(plain) == []
    opt = _built(keras.optimizers.SGD(gradient_accumulation_steps=3), v)
    accs = ki.accumulated_gradients(opt)
    assert len(accs) == 1, _changed("Optimizer._accumulated_gradients")
    opt.apply([keras.ops.ones(2)], [v])
    assert np.all(keras.ops.convert_to_numpy(accs[0]) != 0), _changed(
        "Optimizer._accumulated_gradients (not where gradients accumulate)"
    )
    assert int(ki.optimizer_iterations(opt)) == 1
    ki.reset_gradient_accumulators(opt)
    np.testing.assert_array_equal(
        keras.ops.convert_to_numpy(accs[0]),
        0,
        err_msg=_changed("Optimizer._backend_reset_gradient_accumulators"),
    )


def test_no_automatic_dependency_tracking():
    class Probe(keras.layers.Layer):
        @ki.no_automatic_dependency_tracking
        def keep(self):
            self.hidden = keras.Variable(1.0, name="hidden")

        def track(self):
            self.shown = keras.Variable(2.0, name="shown")

    probe = Probe()
    probe.keep()
    probe.track()
    names = [v.name for v in probe.weights]
    assert "shown" in names, _changed(
        "Layer attribute tracking (a Variable attribute is not a weight)"
    )
    assert "hidden" not in names, _changed(
        "tracking.no_automatic_dependency_tracking"
    )


@pytest.mark.tensorflow
def test_patch_tf2onnx_exists():
    pytest.importorskip("tf2onnx")
    ki.patch_tf2onnx()  # raises if keras.src.export.tf2onnx_lib moved


def test_tflite_schema_reads_a_flatbuffer():
    schema = ki.tflite_schema()  # raises if TensorFlow moved the module
    assert hasattr(schema.Model, "GetRootAsModel"), _changed(
        "tensorflow.lite.python.schema_py_generated.Model")


def test_litert_schema_round_trips_a_flatbuffer():
    pytest.importorskip("ai_edge_litert")
    schema = ki.litert_schema()  # raises if ai_edge_litert moved it
    import flatbuffers

    model = schema.ModelT()
    model.version = 3
    model.buffers = [schema.BufferT()]
    builder = flatbuffers.Builder(64)
    builder.Finish(model.Pack(builder), file_identifier=b"TFL3")
    again = schema.ModelT.InitFromPackedBuf(builder.Output(), 0)
    assert again.version == 3 and len(again.buffers) == 1, _changed(
        "ai_edge_litert.schema_py_generated.ModelT")


def test_tensorflow_stablehlo_version_is_a_version():
    pytest.importorskip("tensorflow")
    version = ki.tensorflow_stablehlo_version()
    assert isinstance(version, str) and re.fullmatch(
        r"\d+\.\d+\.\d+", version), (
        "TensorFlow moved tensorflow.compiler.mlir.stablehlo.stablehlo."
        f"get_current_version (got {version!r}): {FIX}")


def test_jax_export_stablehlo_at_most_sets_the_written_version():
    jax = pytest.importorskip("jax")
    import jax.numpy as jnp

    oldest, target = ki.jax_stablehlo_versions()
    assert ki.stablehlo_older(oldest, target) or oldest == target
    fn = jax.jit(lambda x: jnp.sin(x) * 2)
    arg = jax.ShapeDtypeStruct((3,), jnp.float32)

    def written():
        data = jax.export.export(fn)(arg).mlir_module_serialized
        return re.findall(rb"StableHLO_v([0-9.]+)", data)

    assert written() == [target.encode()], (
        f"JAX {jax.__version__} no longer writes its WEEK_4 target: {FIX}")
    with ki.jax_export_stablehlo_at_most(oldest):
        assert written() == [oldest.encode()], (
            f"JAX {jax.__version__} changed how jax.export picks its "
            f"StableHLO target (jax._src.export._export.hlo): {FIX}")
    assert written() == [target.encode()]  # put back on leaving


# ------------------------------------------------------ no other access

ROOT = pathlib.Path(kerasmp.__file__).parent
SEAM = "_keras_internals.py"

# Private attributes of objects that are not Keras objects
# (docs/architecture.md, "Documented exceptions").
NOT_KERAS = set()  # (module, attribute) of non-Keras objects, if ever


def _kerasmp_modules():
    """`{path relative to kerasmp/: path}` of the library and its apps."""
    paths = sorted(ROOT.rglob("*.py"))
    return {p.relative_to(ROOT).as_posix(): p for p in paths}


def test_the_scan_covers_the_apps():
    names = set(_kerasmp_modules())
    assert {"policy/policy.py", "_patches.py", "train_step/tensorflow.py",
            "export/half.py", "apps/bench.py", "apps/demo.py",
            "apps/zoo.py"} <= names
    assert any(name.startswith("apps/cli/") for name in names)


def _private_keras_names():
    """Private (single underscore) names defined by the Keras classes that
    kerasmp subclasses or handles, on the class or on an instance."""
    names = set()
    dense = keras.layers.Dense(1)
    dense.build((None, 1))
    model = _functional()
    lso = _built(
        keras.optimizers.LossScaleOptimizer(keras.optimizers.SGD()),
        keras.Variable(np.ones(1, "float32")),
    )
    objects = [
        dense,
        model,
        lso,
        keras.callbacks.Callback(),
        keras.DTypePolicy("mixed_float16"),
    ]
    for obj in objects:
        for name in set(dir(obj)) | set(vars(obj)):
            if name.startswith("_") and not name.startswith("__"):
                names.add(name)
    return names


class _Finder(ast.NodeVisitor):
    """Collects private attribute uses, telling `self._x` (allowed when the
    kerasmp class defines `_x`) from `other._x`."""

    def __init__(self):
        self.found = []  # (line, owner, attr, class defines)
        self.kerasmp_aliases = set()
        self.stack = []  # per class: names it defines

    def visit_Import(self, node):
        for a in node.names:
            if a.name.startswith("keras.src"):
                self.found.append((node.lineno, "import", a.name, False))

    def visit_ImportFrom(self, node):
        module = node.module or ""
        if module.startswith("keras.src") or module == "keras.src":
            self.found.append((node.lineno, "import", module, False))
        if module == "kerasmp" or module.startswith("kerasmp."):
            for a in node.names:
                self.kerasmp_aliases.add(a.asname or a.name)
        self.generic_visit(node)

    def visit_ClassDef(self, node):
        defined = set()
        for sub in ast.walk(node):
            if isinstance(sub, (ast.FunctionDef, ast.AsyncFunctionDef)):
                defined.add(sub.name)
            elif isinstance(sub, ast.Attribute) and isinstance(
                sub.ctx, ast.Store
            ):
                defined.add(sub.attr)
            elif (
                isinstance(sub, ast.Call)
                and getattr(sub.func, "id", None) == "setattr"
                and len(sub.args) > 1
                and isinstance(sub.args[1], ast.Constant)
            ):
                defined.add(sub.args[1].value)
        self.stack.append(defined)
        self.generic_visit(node)
        self.stack.pop()

    def _record(self, line, owner, attr):
        if not attr.startswith("_") or attr.startswith("__"):
            return
        if owner in ("self", "cls"):
            defines = any(attr in d for d in self.stack)
            self.found.append((line, owner, attr, defines))
        elif owner not in self.kerasmp_aliases:
            self.found.append((line, owner, attr, False))

    def visit_Attribute(self, node):
        owner = node.value.id if isinstance(node.value, ast.Name) else "<expr>"
        self._record(node.lineno, owner, node.attr)
        self.generic_visit(node)

    def visit_Call(self, node):
        fn = getattr(node.func, "id", None)
        if (
            fn in ("getattr", "hasattr", "setattr", "delattr")
            and len(node.args) > 1
            and isinstance(node.args[1], ast.Constant)
            and isinstance(node.args[1].value, str)
        ):
            target = node.args[0]
            owner = target.id if isinstance(target, ast.Name) else "<expr>"
            self._record(node.lineno, owner, node.args[1].value)
        self.generic_visit(node)


@pytest.mark.torch
@pytest.mark.skipif(BACKEND != "torch", reason="torch.compile")
def test_compile_inline_only_skips_the_frame_and_still_inlines():
    import torch

    def plain(x, obj):
        return x * obj.value

    def scale(x, obj):
        return x * obj.value

    # Marked before Dynamo compiles it (`torch._dynamo.reset()` drops the
    # mark of a code it had compiled; kerasmp marks its own at import).
    ki.compile_inline_only(scale)

    class A:
        value = 2.0

    class B:
        value = 3.0

    def frames_compiled(fn):
        torch._dynamo.reset()
        before = torch._dynamo.utils.counters["frames"]["total"]
        for obj in (A(), B(), A(), B()):
            assert float(fn(torch.ones(()), obj)) == obj.value
        return torch._dynamo.utils.counters["frames"]["total"] - before

    # Met as a frame of its own: compiled for A, again for B.
    unmarked = frames_compiled(torch.compile(plain, backend="eager"))
    marked = frames_compiled(torch.compile(scale, backend="eager"))
    assert (unmarked, marked) == (2, 0), (
        f"torch {torch.__version__} changed set_code_exec_strategy: the "
        f"frames compiled, unmarked and marked, are {(unmarked, marked)}"
    )
    # Traced inline where a compiled frame calls it: no graph break.
    inline = torch.compile(lambda x, o: scale(x, o) + 1.0, backend="eager",
                           fullgraph=True)
    assert float(inline(torch.ones(()), A())) == 3.0
    torch._dynamo.reset()


def test_no_private_keras_access_outside_the_seam():
    keras_private = _private_keras_names()
    problems = []
    for name, path in _kerasmp_modules().items():
        if name == SEAM:
            continue
        finder = _Finder()
        finder.visit(ast.parse(path.read_text(), filename=str(path)))
        for line, owner, attr, defines in finder.found:
            where = f"kerasmp/{name}:{line}"
            if owner == "import":
                problems.append(f"{where}: imports {attr}")
            elif (name, attr) in NOT_KERAS:
                continue
            elif owner in ("self", "cls"):
                # A kerasmp class's own attributes are fine; one it only
                # inherits from a Keras class is Keras's private state.
                if not defines and attr in keras_private:
                    problems.append(f"{where}: {owner}.{attr} (inherited)")
            else:
                problems.append(f"{where}: {owner}.{attr}")
    assert not problems, (
        "private Keras access outside kerasmp/_keras_internals.py (move it "
        "into the seam, or list a non-Keras object in NOT_KERAS and "
        "docs/architecture.md):\n" + "\n".join(problems)
    )


def test_the_finder_flags_private_access():
    # The guard above must be able to fail.
    source = (
        "from keras.src import ops\n"
        "class L(keras.layers.Layer):\n"
        "    def f(self, layer):\n"
        "        self._own = 1\n"
        "        return layer._flatten_layers(), self._own, self._tracker, "
        "getattr(layer, '_layers', ())\n"
    )
    finder = _Finder()
    finder.visit(ast.parse(source))
    found = {(owner, attr, d) for _, owner, attr, d in finder.found}
    assert ("import", "keras.src", False) in found
    assert ("layer", "_flatten_layers", False) in found
    assert ("layer", "_layers", False) in found
    assert ("self", "_own", True) in found
    assert ("self", "_tracker", False) in found
    keras_private = _private_keras_names()
    assert {"_tracker", "_trainable_variables", "_compute_dtype"} <= (
        keras_private
    )


@pytest.mark.torch
def test_is_backend_module_names_the_torch_optimizers():
    # On PyTorch Keras serializes its optimizers as their backend subclass
    # (what kerasmp.optimizer.saving.public_module rewrites); elsewhere as
    # the public class.
    module = keras.saving.serialize_keras_object(
        keras.optimizers.Adam())["module"]
    assert ki.is_backend_module(module) == (BACKEND == "torch"), (
        _changed(f"where Adam is serialized ({module})"))
    assert not ki.is_backend_module("keras.optimizers")
    assert not ki.is_backend_module(None)
