"""`kerasmp.LossScaleOptimizer`: loss scaling that never corrupts the weights.

- `loss_scale_optimizer`: the optimizer (its TensorFlow, distributed and
  JAX apply paths, its state variables and config);
- `scale_rule`: the rule as a pure function (`ScaleRule`, `ScaleState`,
  `next_state`);
- `arguments`: the checks of its arguments at construction;
- `saving`: how it is saved so that plain Keras loads the file (a stock
  config plus a `"kerasmp"` entry; kerasmp's own state apart).
"""

from kerasmp.optimizer.loss_scale_optimizer import LossScaleOptimizer
from kerasmp.optimizer.scale_rule import ScaleRule
from kerasmp.optimizer.scale_rule import ScaleState
from kerasmp.optimizer.scale_rule import next_state

__all__ = [
    "LossScaleOptimizer",
    "ScaleRule",
    "ScaleState",
    "next_state",
]
