"""`compile(..., steps_per_execution=k)` in `fit`, `evaluate` and `predict`.

Issue 44: on PyTorch, Keras 3.15 refuses `steps_per_execution > 1` in
`evaluate` and `predict` (so `fit` stopped at its first validation), and its
epoch iterator warned "Your input ran out of data" at every epoch's partial
last execution. kerasmp's PyTorch test and predict functions run Keras's
one-step function once per batch of an execution, as its train function
does and as Keras 3.16 does itself. Each case compares a run with `k = 4`
against the same run with `steps_per_execution=1` (a reference, not the
code's own output), on data whose 6 batches (the last one of 2 samples) are
not a multiple of 4; the same tests run on every backend, where Keras has
its own multi-step functions.

Keras 3.16 runs `k > 1` on PyTorch itself (keras-team/keras#23234): there
kerasmp leaves the test and predict functions to Keras, and the last tests
compare a kerasmp run with `k = 4` against stock Keras's own (kerasmp
uninstalled) on every backend where Keras has one, and against stock Keras
with `steps_per_execution=1` where it refuses `k > 1` (PyTorch, Keras 3.15).
"""

import contextlib
import re
import warnings

import keras
import numpy as np
import pytest
from _models import mlp
from keras import ops

import kerasmp
from kerasmp import _keras_internals as ki
from kerasmp.optimizer import LossScaleOptimizer

pytestmark = pytest.mark.torch  # also in the PyTorch pass (conftest.py)

SPE = 4
BATCH = 4
N = 22  # 6 batches: one execution of 4, then a partial one of 2
RAN_OUT = "ran out of data"


def _data(n=N, seed=0):
    rng = np.random.default_rng(seed)
    x = rng.normal(size=(n, 6)).astype("float32")
    y = (x[:, :1] * 0.5 - x[:, 1:2] * 0.25 + 0.1).astype("float32")
    return x, y


def _model(spe, optimizer="sgd", metrics=("mae",)):
    model = mlp(6, 8, 1, seed=3)
    model.compile(
        optimizer=optimizer,
        loss="mse",
        metrics=list(metrics),
        steps_per_execution=spe,
    )
    return model


def _weights(model):
    return [np.array(ops.convert_to_numpy(w)) for w in model.weights]


class _BatchEnds(keras.callbacks.Callback):
    """The `on_*_batch_end` calls: `(kind, step, logs)`."""

    def __init__(self):
        super().__init__()
        self.calls = []

    def on_train_batch_end(self, batch, logs=None):
        self.calls.append(("train", batch, dict(logs or {})))

    def on_test_batch_end(self, batch, logs=None):
        self.calls.append(("test", batch, dict(logs or {})))

    def on_predict_batch_end(self, batch, logs=None):
        self.calls.append(("predict", batch, dict(logs or {})))

    def steps(self, kind):
        return [step for k, step, _ in self.calls if k == kind]


def _fit(spe, optimizer, epochs=2, **kwargs):
    """A seeded fit with `steps_per_execution=spe`: the model, its history
    and the warnings it raised."""
    x, y = _data()
    model = _model(spe, optimizer)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        history = model.fit(
            x, y, batch_size=BATCH, epochs=epochs, shuffle=False, verbose=0,
            **kwargs,
        )
    return model, history.history, [str(w.message) for w in caught]


@pytest.mark.parametrize("mixed", [False, True])
def test_a_partial_last_execution_does_not_warn_of_running_out(
        mixed, request, capsys):
    if mixed:
        request.getfixturevalue("mixed_policy")
    model, history, caught = _fit(SPE, "sgd", epochs=3)
    assert isinstance(model.optimizer, LossScaleOptimizer) == mixed
    assert len(history["loss"]) == 3
    assert not [m for m in caught if RAN_OUT in m]
    out = capsys.readouterr()
    assert RAN_OUT not in out.out + out.err


def test_running_out_before_steps_per_epoch_still_warns():
    # A real interruption: 10 steps asked of an epoch of 6 batches.
    _, _, caught = _fit(SPE, "sgd", epochs=1, steps_per_epoch=10)
    assert [m for m in caught if RAN_OUT in m]


@pytest.mark.parametrize(
    "mixed, optimizer", [(False, "sgd"), (True, "sgd"), (True, "adam")]
)
def test_fit_with_validation_equals_one_step_executions(
        mixed, optimizer, request):
    if mixed:
        request.getfixturevalue("mixed_policy")
    val = _data(10, seed=1)  # 3 validation batches: one partial execution
    runs = {}
    for spe in (1, SPE):
        ends = _BatchEnds()
        model, history, caught = _fit(
            spe, optimizer, epochs=3, validation_data=val, callbacks=[ends]
        )
        assert isinstance(model.optimizer, LossScaleOptimizer) == mixed
        assert not [m for m in caught if RAN_OUT in m]
        runs[spe] = (history, _weights(model), ends)
    (ref, w_ref, _), (got, w_got, ends) = runs[1], runs[SPE]
    assert set(got) == set(ref)
    assert {"val_loss", "val_mae"} <= set(got)
    if mixed:
        assert {"loss_scale", "skipped_steps"} <= set(got)
    for key, values in ref.items():
        assert len(got[key]) == 3, key
        np.testing.assert_allclose(got[key], values, rtol=1e-6, err_msg=key)
    for a, b in zip(w_got, w_ref):
        np.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-7)
    # Keras's callbacks: one batch end per execution, the partial last one
    # included, at the step Keras's iterator names (its last, 4k - 1).
    assert ends.steps("train") == [3, 7] * 3
    assert ends.steps("test") == [3] * 3


def _on_batch(model, kind, *args):
    """`model.<kind>_on_batch(*args)`; None where Keras has its own
    multi-step functions and stock Keras fails on a model with the same
    `steps_per_execution`, after checking that kerasmp's fails alike.
    (Keras 3.16.0.dev2026102704 on JAX, with `steps_per_execution > 1`:
    `train_on_batch`, `test_on_batch` and `predict_on_batch` hand the batch
    to a function that takes it for an execution's stack of batches, and
    fail "Invalid input shape".)"""
    method = f"{kind}_on_batch"
    spe = model.steps_per_execution
    if spe == 1 or not _keras_runs_executions():
        return getattr(model, method)(*args)  # kerasmp's, where Keras has none
    with _stock_keras():
        stock = _model(spe)
        try:
            getattr(stock, method)(*args)
        except Exception as error:  # noqa: BLE001 (compared below)
            failed = error
        else:
            failed = None
    if failed is None:
        return getattr(model, method)(*args)
    with pytest.raises(type(failed), match=re.escape(str(failed)[:20])):
        getattr(model, method)(*args)
    return None


@pytest.mark.parametrize("mixed", [False, True])
def test_evaluate_equals_one_step_executions(mixed, request):
    if mixed:
        request.getfixturevalue("mixed_policy")
    x, y = _data()
    results = {}
    for spe in (1, SPE):
        model = _model(spe, metrics=("mae", "mse"))
        ends = _BatchEnds()
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            logs = model.evaluate(
                x, y, batch_size=BATCH, verbose=0, callbacks=[ends],
                return_dict=True,
            )
            on_batch = _on_batch(model, "test", x[:BATCH], y[:BATCH])
        assert not [w for w in caught if RAN_OUT in str(w.message)]
        results[spe] = (logs, on_batch, ends)
    (ref, ref_batch, _), (got, got_batch, ends) = results[1], results[SPE]
    assert set(got) == set(ref) == {"loss", "mae", "mse"}
    for key in ref:
        assert got[key] == pytest.approx(ref[key], rel=1e-6), key
    if got_batch is not None:
        np.testing.assert_allclose(got_batch, ref_batch, rtol=1e-6)
    assert ends.steps("test") == [3, 7]


def _two_outputs(spe):
    keras.utils.set_random_seed(5)
    inputs = keras.Input((6,))
    hidden = keras.layers.Dense(8, activation="relu")(inputs)
    model = keras.Model(
        inputs,
        {"a": keras.layers.Dense(1)(hidden),
         "b": keras.layers.Dense(3, activation="softmax")(hidden)},
    )
    model.compile("sgd", {"a": "mse", "b": "mse"}, steps_per_execution=spe)
    return model


@pytest.mark.parametrize("mixed", [False, True])
def test_predict_equals_one_step_executions(mixed, request):
    if mixed:
        request.getfixturevalue("mixed_policy")
    x, _ = _data()
    results = {}
    for spe in (1, SPE):
        ends = _BatchEnds()
        model = _model(spe)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            out = model.predict(
                x, batch_size=BATCH, verbose=0, callbacks=[ends]
            )
            on_batch = _on_batch(model, "predict", x[:BATCH])
            nested = _two_outputs(spe).predict(x, batch_size=BATCH, verbose=0)
        assert not [w for w in caught if RAN_OUT in str(w.message)]
        results[spe] = (out, on_batch, nested, ends)
    ref, ref_batch, ref_nested, _ = results[1]
    got, got_batch, got_nested, ends = results[SPE]
    # Every sample, the last partial execution's included.
    assert got.shape == ref.shape == (N, 1)
    np.testing.assert_allclose(got, ref, rtol=1e-6)
    if got_batch is not None:
        np.testing.assert_allclose(got_batch, ref_batch, rtol=1e-6)
    assert set(got_nested) == {"a", "b"}
    for key in ("a", "b"):
        assert got_nested[key].shape[0] == N
        np.testing.assert_allclose(got_nested[key], ref_nested[key],
                                   rtol=1e-6)
    # One batch end per execution, with that execution's outputs.
    assert ends.steps("predict") == [3, 7]
    sizes = [
        ops.shape(logs["outputs"])[0]
        for kind, _, logs in ends.calls if kind == "predict"
    ]
    assert sizes == [SPE * BATCH, N - SPE * BATCH]


@pytest.mark.skipif(keras.backend.backend() != "torch",
                    reason="PyTorch's epoch iterator")
def test_uninstall_gives_keras_its_iterator_back():
    from kerasmp import _keras_internals as ki

    iterator = ki.torch_epoch_iterator_class()
    name = ki.INTERRUPTED_WARNING_ATTR
    patched = vars(iterator).get(name)
    assert patched is not None
    try:
        kerasmp.uninstall()
        assert name not in vars(iterator)  # EpochIterator's, inherited
    finally:
        kerasmp.install()
    assert vars(iterator).get(name) is not None


def _keras_runs_executions():
    """Whether stock Keras runs `steps_per_execution > 1` on this backend
    (everywhere but PyTorch before Keras 3.16)."""
    return (keras.backend.backend() != "torch"
            or ki.torch_trainer_runs_executions())


@contextlib.contextmanager
def _stock_keras():
    """Keras without kerasmp's patches (a model compiled inside keeps
    Keras's own train, test and predict functions)."""
    kerasmp.uninstall()
    try:
        yield
    finally:
        kerasmp.install()


@pytest.mark.skipif(keras.backend.backend() != "torch",
                    reason="kerasmp's PyTorch test and predict functions")
def test_keras_own_test_and_predict_functions_where_it_runs_executions():
    model = _model(SPE)
    own = {"make_test_function", "make_predict_function"} & set(
        vars(model))
    if ki.torch_trainer_runs_executions():
        assert not own  # Keras 3.16's, from the class
    else:
        assert own == {"make_test_function", "make_predict_function"}
    assert "make_train_function" in vars(model)  # the records: kerasmp's


def _run_all(spe):
    """fit (with validation), evaluate and predict of one seeded float32
    model with `steps_per_execution=spe`: everything they return, the
    weights, and the callbacks' batch ends."""
    x, y = _data()
    val = _data(10, seed=1)
    model = _model(spe, metrics=("mae", "mse"))
    ends = _BatchEnds()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        history = model.fit(x, y, batch_size=BATCH, epochs=2, shuffle=False,
                            validation_data=val, verbose=0,
                            callbacks=[ends]).history
        logs = model.evaluate(x, y, batch_size=BATCH, verbose=0,
                              callbacks=[ends], return_dict=True)
        out = model.predict(x, batch_size=BATCH, verbose=0, callbacks=[ends])
    return dict(history=history, logs=logs, out=out, weights=_weights(model),
                ends=[(k, step) for k, step, _ in ends.calls],
                ran_out=[str(w.message) for w in caught
                         if RAN_OUT in str(w.message)])


def test_fit_evaluate_predict_agree_with_stock_keras():
    # float32 with SGD: kerasmp changes no number, so a kerasmp run must
    # equal Keras's own, with Keras's own multi-step functions where it has
    # them; where it refuses `k > 1` (PyTorch, Keras 3.15) it is compared
    # with stock Keras's one-step run.
    got = _run_all(SPE)
    with _stock_keras():
        if _keras_runs_executions():
            ref = _run_all(SPE)
        else:
            with pytest.raises(ValueError, match="steps_per_execution"):
                _run_all(SPE)
            ref = _run_all(1)
            # One batch end per batch there, not per execution (the tests
            # above pin kerasmp's).
            ref["ends"] = got["ends"]
    assert set(got["history"]) == set(ref["history"]) == {
        "loss", "mae", "mse", "val_loss", "val_mae", "val_mse"}
    for key, values in ref["history"].items():
        np.testing.assert_allclose(got["history"][key], values, rtol=1e-6,
                                   err_msg=key)
    assert set(got["logs"]) == set(ref["logs"])
    for key, value in ref["logs"].items():
        assert got["logs"][key] == pytest.approx(value, rel=1e-6), key
    assert got["out"].shape == ref["out"].shape == (N, 1)
    np.testing.assert_allclose(got["out"], ref["out"], rtol=1e-6)
    for a, b in zip(got["weights"], ref["weights"]):
        np.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-7)
    assert got["ends"] == ref["ends"]
    assert got["ran_out"] == ref["ran_out"] == []
