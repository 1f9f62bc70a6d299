"""Keras's warnings never point into kerasmp (issue 44 item 3).

Keras locates some warnings at the caller of the method that raises them
(`stacklevel=2`); where kerasmp stands in between (its patches of
`compile_from_config`, `kerasmp.LossScaleOptimizer`'s
`load_own_variables`), they pointed at kerasmp's source lines
(`kerasmp/_patches.py`, `kerasmp/optimizer/loss_scale_optimizer.py`). They
now show where stock Keras shows them: in Keras's loader, and Keras's
filters for its modules act on them. The `kerasmp` command shows each
warning once, and not at a kerasmp line.

Reference: the location stock Keras gives the inner optimizer's own
"Skipping variable loading" warning (Keras's saving code).
"""

import os
import sys
import warnings

import keras
import numpy as np
import pytest
from _models import tiny_gpt2_task

import kerasmp
from kerasmp.apps.cli import main
from kerasmp.optimizer import LossScaleOptimizer
from kerasmp.policy import Policy
from kerasmp.policy import policy_scope

pytestmark = pytest.mark.torch

PACKAGE = os.path.dirname(os.path.abspath(kerasmp.__file__)) + os.sep
KERAS = os.path.dirname(os.path.abspath(keras.__file__))
COMPILE_NOT_CALLED = "`compile()` was not called as part of model loading"
SKIPPING = "Skipping variable loading for optimizer 'loss_scale_optimizer'"


@keras.saving.register_keras_serializable("kerasmp_test_warnings")
class SelfCompiling(keras.Model):
    """Compiles itself in `__init__` and overrides `compile`, as a keras-hub
    task does: loading it warns that `compile()` was not called, and that
    its optimizer (not built yet) skips the saved variables."""

    def __init__(self, units=4, dtype=None, **kwargs):
        inputs = keras.Input((3,))
        outputs = keras.layers.Dense(units, dtype=dtype)(inputs)
        super().__init__(inputs, outputs, dtype=dtype, **kwargs)
        self.units = units
        self.compile(optimizer="sgd", loss="mse")

    def compile(self, *args, **kwargs):
        super().compile(*args, **kwargs)

    def get_config(self):
        return {"units": self.units, "name": self.name,
                "dtype": keras.dtype_policies.serialize(self.dtype_policy)}

    @classmethod
    def from_config(cls, config):
        return cls(**config)


def _in_kerasmp(w):
    return os.path.abspath(w.filename).startswith(PACKAGE)


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """A `SelfCompiling` model trained one step with kerasmp's optimizer
    (mixed_float16), saved."""
    keras.utils.set_random_seed(0)
    with policy_scope(Policy("mixed_float16")):
        model = SelfCompiling()
    assert isinstance(model.optimizer, LossScaleOptimizer)
    model.fit(np.ones((8, 3)), np.ones((8, 4)), epochs=1, verbose=0)
    path = tmp_path_factory.mktemp("warnings") / "self_compiling.keras"
    model.save(path)
    return path


def _load(path):
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        keras.saving.load_model(path)
    return caught


def test_the_loaders_warnings_show_where_stock_keras_shows_them(saved):
    caught = _load(saved)
    inside = [(w.filename, w.lineno, str(w.message)[:60]) for w in caught
              if _in_kerasmp(w)]
    assert not inside
    said = {}
    for w in caught:
        for text in (COMPILE_NOT_CALLED, SKIPPING):
            if text in str(w.message):
                said.setdefault(text, []).append(w)
    # Both shown, once each, by Keras's saving code (as stock Keras shows
    # the inner optimizer's own "Skipping variable loading").
    assert {k: len(v) for k, v in said.items()} == {COMPILE_NOT_CALLED: 1,
                                                    SKIPPING: 1}
    for (w,) in said.values():
        assert w.filename.startswith(KERAS), w.filename


def test_the_filters_act_on_the_location_stock_keras_gives(saved):
    # An "ignore" filter for Keras's modules silences them, as without
    # kerasmp (they were kerasmp's modules' warnings).
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        warnings.filterwarnings("ignore", module=r"keras\.")
        keras.saving.load_model(saved)
    assert not [w for w in caught
                if COMPILE_NOT_CALLED in str(w.message)
                or SKIPPING in str(w.message)]


def test_a_keras_hub_task_loads_without_warnings_located_in_kerasmp(
        tmp_path):
    # The case: a task compiles itself (kerasmp's optimizer, not
    # built when its saved variables are read) and overrides `compile`.
    keras.utils.set_random_seed(0)
    with policy_scope(Policy("mixed_float16")):
        task = tiny_gpt2_task()
    task.fit(["a b ab", "b a"], epochs=1, verbose=0, batch_size=2)
    task.save(tmp_path / "task.keras")
    caught = _load(tmp_path / "task.keras")
    assert not [w.filename for w in caught if _in_kerasmp(w)]
    for text in (COMPILE_NOT_CALLED, SKIPPING):
        said = [w for w in caught if text in str(w.message)]
        assert len(said) == 1 and said[0].filename.startswith(KERAS)


@pytest.mark.parametrize("command", ["check", "export"])
def test_the_command_shows_each_warning_once(saved, tmp_path, capsys,
                                             command):
    argv = [command, str(saved)]
    if command == "export":
        argv += [str(tmp_path / "out.keras"), "--format", "keras"]

    def show(message, category, filename, lineno, file=None, line=None):
        print(warnings.formatwarning(message, category, filename, lineno,
                                     line), file=sys.stderr, end="")

    with warnings.catch_warnings():
        warnings.simplefilter("default")  # Python's own: once per line
        warnings.showwarning = show  # printed, as outside pytest
        assert main(argv) == 0
    err = capsys.readouterr().err
    assert err.count(SKIPPING) == 1, err
    assert PACKAGE not in err.split(SKIPPING)[0].splitlines()[-1], err
