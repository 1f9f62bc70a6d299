"""What kerasmp's monitors share: a warning that points at the user's `fit`
call (`warn`), and the message for a model that kerasmp's optimizer does not
train (`needs_kerasmp_optimizer`).
"""

import inspect
import warnings

import keras

from kerasmp import train_step as _train_step


def user_stacklevel():
    """The `stacklevel` that points a warning at the first frame outside
    Keras and kerasmp (the user's `fit` call), not at Keras's callback
    list."""
    frame = inspect.currentframe().f_back  # the caller of warnings.warn
    level = 1
    while frame is not None:
        name = frame.f_globals.get("__name__", "")
        if name.split(".")[0] not in ("keras", "kerasmp"):
            return level
        frame = frame.f_back
        level += 1
    return 1


def warn(message, category=UserWarning):
    """Issues `message` as a warning of `category`, located at the user's
    code (see `user_stacklevel`)."""
    warnings.warn(message, category, stacklevel=user_stacklevel())


def needs_kerasmp_optimizer(monitor, optimizer):
    """The one-line warning when the model is not trained with
    `kerasmp.LossScaleOptimizer` (nothing then puts the scale in the logs);
    None when it is."""
    if _train_step.scaled(monitor.model):
        return None
    name = type(optimizer).__name__
    if isinstance(optimizer, keras.optimizers.LossScaleOptimizer):
        return (
            f"{type(monitor).__name__}: loss_scale and skipped_steps come from "
            "kerasmp.LossScaleOptimizer; this model uses Keras's own "
            "LossScaleOptimizer: compile with kerasmp.LossScaleOptimizer."
            "from_config(optimizer.get_config()) (same settings)."
        )
    if not _train_step.supported():
        return (
            f"{type(monitor).__name__}: logging the loss scale needs the "
            "TensorFlow or JAX backend (without NNX); nothing will be logged."
        )
    return (
        f"{type(monitor).__name__}: the optimizer ({name}) has no loss scale; "
        "`loss_scale` and `skipped_steps` will not be logged."
    )
