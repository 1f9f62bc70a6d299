"""`kerasmp.LossScaleOptimizer`: loss scaling that never corrupts the
weights (`loss_scale_optimizer`)."""

from kerasmp.optimizer.loss_scale_optimizer import LossScaleOptimizer

__all__ = [
    "LossScaleOptimizer",
]
