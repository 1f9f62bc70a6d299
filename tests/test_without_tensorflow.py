"""A PyTorch or JAX user needs no TensorFlow (issue 44 item 8).

TensorFlow is an extra (`kerasmp[tensorflow]`), not a base dependency. The
suite runs where TensorFlow IS installed, so these tests run a subprocess in
which no import finder sees it (`import tensorflow` raises
ModuleNotFoundError, `importlib.util.find_spec("tensorflow")` is None: as
on a machine without it) and check that training, the demo and the
`keras` export work on the pass's backend, and that what needs TensorFlow
says so in one line naming the extra.
"""

import subprocess
import sys

import keras
import pytest
from _helpers import ROOT
from _helpers import script_result
from _helpers import subprocess_env

BACKEND = keras.backend.backend()

# First lines of a script: TensorFlow is invisible to every import finder.
BLOCK_TENSORFLOW = """
import json, sys
class _NoTensorFlow:
    def __init__(self, finders):
        self.finders = finders
    def find_spec(self, name, path=None, target=None):
        if name == "tensorflow" or name.startswith("tensorflow."):
            return None
        for finder in self.finders:
            if hasattr(finder, "find_spec"):
                spec = finder.find_spec(name, path, target)
                if spec is not None:
                    return spec
        return None
    def invalidate_caches(self):
        for finder in self.finders:
            if hasattr(finder, "invalidate_caches"):
                finder.invalidate_caches()
sys.meta_path[:] = [_NoTensorFlow(list(sys.meta_path))]
"""

EXTRA = 'pip install "kerasmp[tensorflow]"'


def _run(script, backend, tmp_path):
    return subprocess.run(
        [sys.executable, "-c", BLOCK_TENSORFLOW + script],
        cwd=tmp_path, env=subprocess_env(backend), capture_output=True,
        text=True, timeout=600)


TRAIN_DEMO_EXPORT = """
import contextlib, io, importlib.util
assert importlib.util.find_spec("tensorflow") is None
import numpy as np
import kerasmp
import keras

policy = kerasmp.Policy("mixed_float16")
with kerasmp.policy_scope(policy):
    model = keras.Sequential([keras.Input((8,)),
                              keras.layers.Dense(16, activation="relu"),
                              keras.layers.Dense(3, activation="softmax")])
model.compile(optimizer=kerasmp.LossScaleOptimizer(keras.optimizers.Adam()),
              loss="sparse_categorical_crossentropy")
x = np.random.default_rng(0).random((64, 8), dtype="float32")
y = np.arange(64) % 3
history = model.fit(x, y, batch_size=16, epochs=1, verbose=0)
model.save("model.keras")

from kerasmp.apps.cli import main
demo = main(["demo", "--quick", "--out", "demo", "--json"])
keras_export = main(["export", "model.keras", "half.keras",
                     "--format", "keras"])
err = io.StringIO()
with contextlib.redirect_stderr(err):
    savedmodel = main(["export", "model.keras", "served"])
try:
    kerasmp.export.export(model, "served", format="savedmodel")
    api = "no error"
except Exception as e:
    api = str(e)
print("RESULT " + json.dumps({
    "loss": history.history["loss"][-1],
    "loss_scale": "loss_scale" in history.history,
    "demo": demo, "keras_export": keras_export, "savedmodel": savedmodel,
    "savedmodel_stderr": err.getvalue(), "api": api,
    "tensorflow_imported": "tensorflow" in sys.modules}))
"""


@pytest.mark.torch
def test_training_demo_and_export_run_without_tensorflow(tmp_path):
    """On JAX and PyTorch: `import kerasmp`, a fit under
    Policy("mixed_float16") with LossScaleOptimizer, `kerasmp demo --quick`
    and `kerasmp export --format keras` work without TensorFlow; a
    SavedModel export fails at once with one line naming the extra, from
    the command (exit 2) and from `kerasmp.export.export`."""
    if BACKEND == "tensorflow":
        pytest.skip("the TensorFlow backend needs TensorFlow")
    done = _run(TRAIN_DEMO_EXPORT, BACKEND, tmp_path)
    result = script_result(done.stdout, done.stderr, done.returncode)
    assert result["loss"] == result["loss"] and result["loss_scale"]
    assert result["demo"] == 0 and (tmp_path / "demo" / "summary.json").exists()
    assert result["keras_export"] == 0 and (tmp_path / "half.keras").exists()
    assert result["savedmodel"] == 2
    stderr = result["savedmodel_stderr"].strip()
    assert "\n" not in stderr and EXTRA in stderr, stderr
    assert stderr.startswith("kerasmp export: error:"), stderr
    assert "\n" not in result["api"] and EXTRA in result["api"], result["api"]
    assert not (tmp_path / "served").exists()
    assert not result["tensorflow_imported"]


DEFAULT_BACKEND = """
import contextlib, io
from kerasmp.apps.cli import main
err = io.StringIO()
with contextlib.redirect_stderr(err):
    doctor = main(["doctor"])
import kerasmp
try:
    kerasmp.Policy
    library = "no error"
except ImportError as e:
    library = str(e)
print("RESULT " + json.dumps({"doctor": doctor, "stderr": err.getvalue(),
                              "library": library}))
"""


def test_default_backend_without_tensorflow_says_which_extra(tmp_path):
    """Keras's default backend is TensorFlow: where it is not installed, a
    command exits 2 with one line naming `kerasmp[tensorflow]` (not
    'internal error ... a kerasmp bug'), and so does the first
    `kerasmp.<name>` that imports Keras (not Keras's traceback)."""
    if BACKEND != "tensorflow":
        pytest.skip("runs once, in the TensorFlow pass")
    done = _run(DEFAULT_BACKEND, "tensorflow", tmp_path)
    result = script_result(done.stdout, done.stderr, done.returncode)
    assert result["doctor"] == 2
    stderr = result["stderr"].strip()
    assert "\n" not in stderr and EXTRA in stderr, stderr
    assert stderr.startswith("kerasmp doctor: error: Keras's backend is "
                             "tensorflow"), stderr
    assert "\n" not in result["library"], result["library"]
    assert EXTRA in result["library"], result["library"]


def test_require_names_the_extra_in_one_line():
    from kerasmp._utils.requires import NeedsExtra
    from kerasmp._utils.requires import require

    with pytest.raises(NeedsExtra) as raised:
        require("kerasmp_no_such_package", "format='x'", "tflite")
    assert str(raised.value) == (
        "format='x' needs kerasmp_no_such_package: "
        'pip install "kerasmp[tflite]"')
    assert isinstance(raised.value, ImportError)
    assert require("json", "reading JSON").dumps([]) == "[]"


def test_readme_demo_installs_the_tensorflow_extra():
    """The README's demo runs on Keras's default backend, TensorFlow,
    which is an extra now: the command CI runs installs it."""
    readme = (ROOT / "README.md").read_text()
    assert ('<!-- ci:demo -->\n```bash\npip install -e ".[tensorflow,plot]"'
            in readme)
