"""kerasmp's Keras callbacks: the monitors.

`LossScaleMonitor` and `NonFiniteMonitor` (`monitors`, with the event
rules, wording and fallback beside them), `Float8Monitor` (`float8`) and
`PerformanceMonitor` (`performance`).
"""

from kerasmp.callbacks.float8 import Float8Monitor
from kerasmp.callbacks.monitors import ACTIONS
from kerasmp.callbacks.monitors import LossScaleMonitor
from kerasmp.callbacks.monitors import NonFiniteMonitor
from kerasmp.callbacks.nonfinite_rules import KINDS
from kerasmp.callbacks.performance import PerformanceMonitor

__all__ = [
    "ACTIONS",
    "Float8Monitor",
    "KINDS",
    "LossScaleMonitor",
    "NonFiniteMonitor",
    "PerformanceMonitor",
]
