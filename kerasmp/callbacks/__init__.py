"""kerasmp's Keras callbacks: the monitors.

- `LossScaleMonitor` (`loss_scale`): the loss scale of every step, and the
  gradient underflow when asked.
- `NonFiniteMonitor` (`nonfinite`): every inf/NaN event, explained and
  acted on; its events' classification and wording are in
  `nonfinite_events`, locating and the float32 fallback in
  `nonfinite_fallback`.
- `Float8Monitor` (`float8`): Keras's delayed float8 scaling, in the logs.
- `PerformanceMonitor` (`performance`): speed and peak memory per epoch.

`shared` holds what they share (warnings that point at the user's `fit`).
"""

from kerasmp.callbacks.float8 import Float8Monitor
from kerasmp.callbacks.loss_scale import LossScaleMonitor
from kerasmp.callbacks.nonfinite import ACTIONS
from kerasmp.callbacks.nonfinite import NonFiniteMonitor
from kerasmp.callbacks.nonfinite_events import KINDS
from kerasmp.callbacks.performance import PerformanceMonitor

__all__ = [
    "ACTIONS",
    "Float8Monitor",
    "KINDS",
    "LossScaleMonitor",
    "NonFiniteMonitor",
    "PerformanceMonitor",
]
