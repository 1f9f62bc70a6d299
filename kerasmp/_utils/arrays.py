"""Reading values to NumPy, and the float16 limits every check uses."""

import keras
import numpy as np

FLOAT16_MAX = float(np.finfo(np.float16).max)
"""The largest finite float16, 65504: beyond it a value becomes inf."""

FLOAT16_MIN_NORMAL = float(np.finfo(np.float16).tiny)
"""The smallest normal float16, 2**-14 (about 6.1e-5)."""


def to_numpy(x):
    """A NumPy array of a Keras variable, a backend tensor or an array.

    One transfer from the device, and no op added to the backend's eager
    queue (TensorFlow, JAX and PyTorch tensors alike; a PyTorch tensor that
    requires grad is detached first, as Keras's own `convert_to_numpy`
    does).

    Args:
        x: A `keras.Variable`, a backend tensor, a NumPy array or a number.

    Example:

    >>> to_numpy(keras.Variable([1.0, 2.0]))
    array([1., 2.], dtype=float32)
    """
    if isinstance(x, keras.Variable):
        x = x.value
    if isinstance(x, np.ndarray):
        return x
    return np.asarray(keras.ops.convert_to_numpy(x))


def gathered_to_numpy(x):
    """`to_numpy(x)`, except that a JAX array spread over several
    processes' devices (in a multi-process run: a batch split across the
    processes, a layer output or gradient of a kernel split across them) is
    first gathered whole onto every process.

    The gather is a collective: every process must make the same calls in
    the same order (as a replay of the same global batch does), or they
    wait. An array this process holds whole (one process, or replicated)
    is read as `to_numpy` does, with no collective.

    Args:
        x: A `keras.Variable`, a backend tensor, a NumPy array or a number.

    Example:

    >>> gathered_to_numpy(keras.Variable([1.0, 2.0]))
    array([1., 2.], dtype=float32)
    """
    if isinstance(x, keras.Variable):
        x = x.value
    if keras.backend.backend() == "jax":
        import jax

        if (
            isinstance(x, jax.Array)
            and not x.is_fully_addressable
            and not x.is_fully_replicated
        ):
            from jax.experimental import multihost_utils

            return np.asarray(multihost_utils.process_allgather(x, tiled=True))
    return to_numpy(x)


def is_float(dtype):
    """Whether `dtype` (a name or a dtype object) is a floating-point one."""
    return "float" in str(dtype)
