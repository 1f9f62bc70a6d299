"""Float8 training under a kerasmp policy: which layers, and when.

The rule and the per-layer policies (`rule`), the replay of a batch for
`Float8Monitor` (`probe`), its math (`telemetry`) and the reads of a
running JAX fit (`jax_fit_state`). The monitor is
`kerasmp.callbacks.Float8Monitor`.
"""

from kerasmp.float8.rule import FLOAT8_NAMES
from kerasmp.float8.rule import MATMUL_CLASSES
from kerasmp.float8.rule import POLICY_CLASSES
from kerasmp.float8.rule import Decision
from kerasmp.float8.rule import Float8Assignment
from kerasmp.float8.rule import Float8Fallback
from kerasmp.float8.rule import Float8Rule
from kerasmp.float8.rule import assign_layers
from kerasmp.float8.rule import base_name
from kerasmp.float8.rule import decide
from kerasmp.float8.rule import dequantize
from kerasmp.float8.rule import fall_back
from kerasmp.float8.rule import float8_layers
from kerasmp.float8.rule import is_float8_name
from kerasmp.float8.rule import needs_loss_scaling
from kerasmp.float8.rule import report_reason
from kerasmp.float8.rule import rule_for

__all__ = [
    "Decision",
    "FLOAT8_NAMES",
    "Float8Assignment",
    "Float8Fallback",
    "Float8Rule",
    "MATMUL_CLASSES",
    "POLICY_CLASSES",
    "assign_layers",
    "base_name",
    "decide",
    "dequantize",
    "fall_back",
    "float8_layers",
    "is_float8_name",
    "needs_loss_scaling",
    "report_reason",
    "rule_for",
]
