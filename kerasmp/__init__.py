"""kerasmp: mixed-precision training for Keras 3 that is correct, observable
and exportable.

Importing kerasmp installs its policy hooks (see `kerasmp._hooks`); they act
only on layers governed by a `kerasmp.Policy`.
"""

from kerasmp import callbacks
from kerasmp import debug
from kerasmp import export
from kerasmp.doctor import doctor
from kerasmp.errors import NonFiniteError
from kerasmp.errors import NonFiniteWarning
from kerasmp.optimizer import LossScaleOptimizer
from kerasmp.plotting import plot_loss_scale
from kerasmp.policy import DEFAULT_FLOAT32_LAYERS
from kerasmp.policy import Float32Override
from kerasmp.policy import Policy
from kerasmp.policy import float32_rule
from kerasmp.policy import global_policy
from kerasmp.policy import install
from kerasmp.policy import policy_scope
from kerasmp.policy import set_global_policy
from kerasmp.policy import stored_policy
from kerasmp.policy import uninstall
from kerasmp.report import DTypeReport
from kerasmp.report import dtype_report

__version__ = "0.1.0"

__all__ = [
    "DEFAULT_FLOAT32_LAYERS",
    "DTypeReport",
    "Float32Override",
    "LossScaleOptimizer",
    "NonFiniteError",
    "NonFiniteWarning",
    "Policy",
    "callbacks",
    "debug",
    "doctor",
    "export",
    "dtype_report",
    "float32_rule",
    "global_policy",
    "install",
    "plot_loss_scale",
    "policy_scope",
    "set_global_policy",
    "stored_policy",
    "uninstall",
]
