"""Float8 training under a kerasmp policy: which layers, and when.

- `rule`: the float8 policy names and `Float8Rule` (which layers);
- `policies`: the per-layer `Float8Assignment` and `Float8Fallback`;
- `layers`: applying the rule (`decide`, `assign_layers` at compile,
  `fall_back`, `report_reason`);
- `dequantize`: a plain copy for export;
- `probe`, `telemetry`, `jax_fit_state`: what `Float8Monitor` measures (the
  monitor itself is `kerasmp.callbacks.Float8Monitor`).
"""

from kerasmp.float8.dequantize import dequantize
from kerasmp.float8.layers import MATMUL_CLASSES
from kerasmp.float8.layers import Decision
from kerasmp.float8.layers import assign_layers
from kerasmp.float8.layers import decide
from kerasmp.float8.layers import fall_back
from kerasmp.float8.layers import float8_layers
from kerasmp.float8.layers import report_reason
from kerasmp.float8.policies import POLICY_CLASSES
from kerasmp.float8.policies import Float8Assignment
from kerasmp.float8.policies import Float8Fallback
from kerasmp.float8.rule import FLOAT8_NAMES
from kerasmp.float8.rule import Float8Rule
from kerasmp.float8.rule import base_name
from kerasmp.float8.rule import is_float8_name
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
    "report_reason",
    "rule_for",
]
