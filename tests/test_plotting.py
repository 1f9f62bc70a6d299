"""kerasmp.plotting itself: a leaf module that tells its sources apart by
what they hold, and a clear error without matplotlib. Each plot of real
records is tested with what it plots (tests/callbacks/, tests/debug/)."""

import sys

import pytest
from test_import_graph import import_graph

from kerasmp.callbacks import Float8Monitor
from kerasmp.callbacks import LossScaleMonitor
from kerasmp.debug import NonFiniteReport
from kerasmp.plotting import plot_float8
from kerasmp.plotting import plot_gradient_report
from kerasmp.plotting import plot_loss_scale


def test_plot_loss_scale_without_matplotlib(tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "matplotlib", None)
    monkeypatch.setitem(sys.modules, "matplotlib.figure", None)
    with pytest.raises(ImportError, match=r"kerasmp\[plot\]"):
        plot_loss_scale({"loss_scale": [1.0]}, tmp_path / "x.png")


def test_plotting_is_a_leaf_that_tells_sources_apart(tmp_path):
    """kerasmp.plotting imports no monitor and no report (kerasmp.debug
    re-exports plot_gradient_report from it, and the monitors sit above
    kerasmp.debug), so it knows each source by what it holds: one plot's
    source is not mistaken for another's."""
    graph = import_graph()
    allowed = {"kerasmp.float8", "kerasmp.float8.telemetry"}
    allowed |= {m for m in graph if m.startswith("kerasmp._utils")}
    assert graph["kerasmp.plotting"] <= allowed
    with pytest.raises(TypeError, match="LossScaleMonitor"):
        plot_loss_scale(Float8Monitor(), tmp_path / "x.png")
    with pytest.raises(TypeError, match="Float8Monitor"):
        plot_float8(LossScaleMonitor(), tmp_path / "x.png")
    with pytest.raises(TypeError, match="GradientReport"):
        plot_gradient_report(
            NonFiniteReport([], None, None, None, 1.0, {}), tmp_path / "x.png"
        )
