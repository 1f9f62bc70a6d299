"""What `compile` says when a setting loses the speed of the model's dtype.

A model that a `kerasmp.Policy` governs in bfloat16, compiled on a CPU with
bfloat16 instructions, trains faster than in float32 with `compile()`'s
defaults, and slower than float32 with an explicit `jit_compile=True` on
TensorFlow: XLA's CPU compiler computes bfloat16 dots in float32. kerasmp's
compile patch (`kerasmp._patches._compile`) calls `warn_if_slow(model, plan)`
after Keras's `compile` has resolved `jit_compile`; it warns once per process
(`kerasmp.errors.SpeedWarning`), at the user's `compile` call, with the
measured ratios and the faster setting, and changes nothing: the user's
setting stands. The decision itself is `kerasmp._utils.cpu_speed.slow_setting`,
a pure function of the backend, the setting, the dtypes and the CPU.
"""

import keras

from kerasmp._utils.cpu_speed import slow_setting
from kerasmp._utils.devices import cpu_flags
from kerasmp._utils.devices import main_device
from kerasmp._utils.warn import warn
from kerasmp.errors import SpeedWarning

_warned = set()  # the messages shown in this process


def compute_dtypes(plan):
    """The compute dtypes of the layers a kerasmp policy governs in `plan`
    (a `kerasmp.policy.plan.Plan`)."""
    return {entry.layer.compute_dtype for entry in plan.layers
            if entry.policy is not None}


def warn_if_slow(model, plan):
    """Warns once per process when `model`'s compile setting loses its
    dtype's speed on this device (see the module docstring).

    Args:
        model: A model that has just been compiled.
        plan: Its `kerasmp.policy.plan.Plan`.

    Returns:
        The message (also when it was shown before), or None.
    """
    if not plan.governed:
        return None
    backend = keras.backend.backend()
    dtypes = compute_dtypes(plan)
    if backend != "tensorflow" or "bfloat16" not in dtypes:
        return None  # the device lookup below is not free: skip it early
    message = slow_setting(backend, model.jit_compile, dtypes,
                           main_device().kind, cpu_flags())
    if message is not None and message not in _warned:
        _warned.add(message)
        warn("kerasmp: " + message + " (This warning is shown once.)",
             SpeedWarning)
    return message
