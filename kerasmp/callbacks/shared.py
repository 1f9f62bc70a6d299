"""What kerasmp's monitors share: the message for a model that kerasmp's
optimizer does not train (`needs_kerasmp_optimizer`). Their warnings go
through `kerasmp._utils.warn`.
"""

import keras

from kerasmp import train_step as _train_step
from kerasmp.optimizer import LossScaleOptimizer


def needs_kerasmp_optimizer(monitor, optimizer):
    """The one-line warning when the model is not trained with
    `kerasmp.LossScaleOptimizer` in kerasmp's train step (nothing then puts
    the scale in the logs); None when it is."""
    if _train_step.scaled(monitor.model):
        return None
    monitor_name = type(monitor).__name__
    if not _train_step.supported():
        return (
            f"{monitor_name}: logging the loss scale needs the TensorFlow, "
            "JAX (without NNX) or PyTorch backend; nothing will be logged."
        )
    if isinstance(optimizer, LossScaleOptimizer):
        return (
            f"{monitor_name}: this model's train step is not kerasmp's (it "
            "was compiled before kerasmp was imported, or its optimizer was "
            "set after compile): call model.compile again; `loss_scale` and "
            "`skipped_steps` will not be logged."
        )
    if isinstance(optimizer, keras.optimizers.LossScaleOptimizer):
        return (
            f"{monitor_name}: loss_scale and skipped_steps come from "
            "kerasmp.LossScaleOptimizer; this model uses Keras's own "
            "LossScaleOptimizer: compile with "
            "kerasmp.LossScaleOptimizer(optimizer) (it takes Keras's "
            "optimizer and keeps its inner optimizer and settings)."
        )
    return (
        f"{monitor_name}: the optimizer ({type(optimizer).__name__}) has no "
        "loss scale; `loss_scale` and `skipped_steps` will not be logged."
    )
