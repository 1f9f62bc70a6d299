"""Finding precision problems: the first non-finite layer of a batch
(`find_nonfinite`, in `nonfinite`), which loss scale a model needs
(`gradient_report`, in `gradients`; drawn by `plot_gradient_report`, from
`kerasmp.plotting`) and precision hazards before training (`kerasmp.check`,
in `hazards`, with its report types in `findings` and its traced run in
`traced_run`)."""

from kerasmp.debug.gradients import GradientReport
from kerasmp.debug.gradients import gradient_report
from kerasmp.debug.nonfinite import LayerRow
from kerasmp.debug.nonfinite import NonFiniteReport
from kerasmp.debug.nonfinite import find_nonfinite
from kerasmp.debug.nonfinite import layer_paths
from kerasmp.debug.nonfinite import record_calls
from kerasmp.plotting import plot_gradient_report

__all__ = [
    "GradientReport",
    "LayerRow",
    "NonFiniteReport",
    "find_nonfinite",
    "gradient_report",
    "layer_paths",
    "plot_gradient_report",
    "record_calls",
]
