import keras
import pytest

import kerasmp  # noqa: F401  (installs kerasmp's hooks, as users' code does)


@pytest.fixture(autouse=True)
def _fresh_keras_state():
    keras.config.set_dtype_policy("float32")
    yield
    keras.config.set_dtype_policy("float32")
    keras.backend.clear_session()
