"""Fixtures for every test: a float32 global policy around each test, and
the global policies many tests start from.

tests/ mirrors kerasmp/: the tests of `kerasmp/<package>/` are in
`tests/<package>/`; those of a top-level module (`doctor.py`,
`plotting.py`, `_keras_internals.py`) and of the whole (the docs, the
notebooks, packaging, the import graph, files saved by an older version,
keras-hub and keras.applications models end to end) sit here. The tiny
models several files build are in `_models.py`, other shared helpers in
`_helpers.py` (both importable from every test: setup.cfg puts tests/ on
sys.path). Basenames stay unique across folders (pytest's default import
mode needs it).

The PyTorch pass: tests marked `torch` (a whole file with `pytestmark =
pytest.mark.torch`) also run under `KERAS_BACKEND=torch`, selected with
`-m "torch and not slow"`. There, a case parametrised with `jit=True` runs
only in a test marked `torch_jit` (`pytest_collection_modifyitems` below):
`jit_compile=True` is `torch.compile`, 15-40 s to compile a toy model on a
CPU.
"""

import keras
import pytest
from _helpers import float8_test_policy

import kerasmp  # (importing it installs its hooks, as in users' code)


@pytest.fixture(autouse=True)
def _fresh_keras_state():
    keras.config.set_dtype_policy("float32")
    yield
    keras.config.set_dtype_policy("float32")
    # Without the full garbage collection (`free_memory=True` costs about a
    # second per test, a quarter of the suite's time); Python's own
    # collector still runs.
    keras.backend.clear_session(free_memory=False)


@pytest.fixture
def mixed_policy():
    """`kerasmp.Policy("mixed_float16")` as the global policy for the test
    (the fixture above puts float32 back after it); returns the policy.

    For a test that builds its models under that policy from its first
    line. A test that switches policies on the way, or builds under Keras's
    own `keras.DTypePolicy("mixed_float16")` on purpose, sets them itself.
    """
    policy = kerasmp.Policy("mixed_float16")
    kerasmp.set_global_policy(policy)
    return policy


@pytest.fixture
def float8_policy():
    """`float8_test_policy()` (float8_mixed_bfloat16 with a 256-element
    kernel threshold) as the global policy for the test; returns it."""
    policy = float8_test_policy()
    kerasmp.set_global_policy(policy)
    return policy


TORCH_JIT_SKIP = pytest.mark.skip(
    reason="jit_compile=True on PyTorch is torch.compile, 15-40 s per toy "
    "model on a CPU: the tests marked torch_jit run it"
)


def pytest_collection_modifyitems(config, items):
    """On the PyTorch backend, skips the `jit=True` cases of every test not
    marked `torch_jit`."""
    if keras.backend.backend() != "torch":
        return
    for item in items:
        params = getattr(getattr(item, "callspec", None), "params", {})
        if params.get("jit") is True and not item.get_closest_marker(
                "torch_jit"):
            item.add_marker(TORCH_JIT_SKIP)
