"""kerasmp/train_step/progbar.py: Keras's `Progbar` prints `skipped_steps`
as a count, only that key, only while kerasmp's patches are installed.
(The fit-level check, on every backend and both verbose modes, is
tests/train_step/test_train_step.py's progress-bar test.)"""

import keras
import pytest

import kerasmp

pytestmark = pytest.mark.torch  # also in the PyTorch pass (conftest.py)


def _printed(values):
    bar = keras.utils.Progbar(1, verbose=2)
    bar.update(1, values)


@pytest.mark.parametrize("value,shown", [(0.0, "0"), (3.0, "3"), (7, "7")])
def test_skipped_steps_is_printed_as_a_count(capsys, value, shown):
    _printed([("loss", 0.0), ("skipped_steps", value), ("mae", 3.0)])
    line = capsys.readouterr().out.strip()
    assert line.endswith(
        f"- loss: 0.0000e+00 - skipped_steps: {shown} - mae: 3.0000"), line


def test_a_value_that_is_no_count_and_uninstalled_kerasmp_print_as_keras(
        capsys):
    _printed([("skipped_steps", 2.5)])
    assert capsys.readouterr().out.strip().endswith("skipped_steps: 2.5000")
    kerasmp.uninstall()
    try:
        _printed([("skipped_steps", 0.0)])
    finally:
        kerasmp.install()
    assert capsys.readouterr().out.strip().endswith(
        "skipped_steps: 0.0000e+00")
