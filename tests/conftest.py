import keras
import pytest

import kerasmp  # noqa: F401  (installs kerasmp's hooks, as users' code does)


@pytest.fixture(autouse=True)
def _fresh_keras_state():
    keras.config.set_dtype_policy("float32")
    yield
    keras.config.set_dtype_policy("float32")
    # Without the full garbage collection (`free_memory=True` costs about a
    # second per test, a quarter of the suite's time); Python's own
    # collector still runs.
    keras.backend.clear_session(free_memory=False)
