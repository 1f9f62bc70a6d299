"""Every kerasmp plot, written as a PNG.

- `plot_loss_scale`: the loss scale over training, with skipped steps and
  `NonFiniteMonitor`'s events.
- `plot_float8`: `Float8Monitor`'s telemetry (`float8_series` gives the data
  it draws, `parse_key` reads the monitor's log keys).
- `plot_gradient_report`: a `kerasmp.debug.GradientReport`.

The module imports no monitor and no report (the monitors and
`kerasmp.debug` sit above it): it tells its sources apart by what they hold.
matplotlib is an optional dependency (`pip install kerasmp[plot]`); it is
imported only when a plot is made, and without pyplot, so the user's
matplotlib backend and global state are left alone.
"""

import json
import math
import os

from kerasmp._utils.table import log2_text
from kerasmp.float8.telemetry import TENSORS


def _import_figure(plot):
    """matplotlib's `Figure`, or an ImportError naming `plot` (the public
    function that needs it)."""
    try:
        from matplotlib.figure import Figure
    except ImportError as e:
        raise ImportError(
            f"{plot} needs matplotlib, which is not installed. Install it "
            "with `pip install kerasmp[plot]` (or `pip install matplotlib`)."
        ) from e
    return Figure


def _history(source):
    """The `.history` dict of a `keras.callbacks.History`, else None."""
    history = getattr(source, "history", None)
    return history if isinstance(history, dict) else None


# ------------------------------------------------------------ loss scale

_LOSS_SCALE_EVENTS = {
    # kind: (marker, color, label)
    "calibration": ("v", "tab:gray", "calibration overflow (normal)"),
    "overflow": ("x", "tab:orange", "overflow (skipped step)"),
    "stuck": ("X", "tab:red", "stuck"),
    "nonfinite_loss": ("D", "tab:purple", "non-finite loss"),
    "nonfinite_weights": ("s", "black", "non-finite weights"),
}


def _read_jsonl(path):
    events = []
    with open(path, encoding="utf-8") as f:
        for number, line in enumerate(f, 1):
            line = line.strip()
            if not line:
                continue
            try:
                events.append(json.loads(line))
            except json.JSONDecodeError as e:
                raise ValueError(
                    f"plot_loss_scale: line {number} of {path!r} is not JSON "
                    f"({e.msg})."
                ) from None
    return events


def _from_trace(trace, start_skipped, start_scale):
    """Line points, scales and skipped steps from `(step, scale, skipped)`.

    Each row holds the scale *after* its step, so it is drawn from the next
    step on: at every step the line shows the scale that step ran with.
    `start_*` are the values before the first row (None if unknown).
    """
    steps = [int(s) + 1 for s, _, _ in trace]
    scales = [float(v) for _, v, _ in trace]
    if trace and start_scale is not None:
        steps.insert(0, int(trace[0][0]))
        scales.insert(0, float(start_scale))
    skipped = []
    previous = start_skipped
    for step, _, total in trace:
        if total is not None and previous is not None and total > previous:
            skipped.append(int(step))
        previous = total
    return steps, scales, skipped


def _from_history(history, steps_per_epoch):
    if "loss_scale" not in history:
        raise ValueError(
            "plot_loss_scale: the History has no `loss_scale`; train with "
            "kerasmp.callbacks.LossScaleMonitor() in the callbacks."
        )
    scales = [float(v) for v in history["loss_scale"]]
    if steps_per_epoch:
        steps = [(e + 1) * steps_per_epoch - 1 for e in range(len(scales))]
    else:
        steps = list(range(len(scales)))
    skipped = []
    previous = 0
    for step, total in zip(steps, history.get("skipped_steps", [])):
        if total > previous:
            skipped.append(step)
        previous = total
    return steps, scales, skipped


def _series(source):
    """(steps, scales, skipped_steps, events, x_label) from any source."""
    history = _history(source)
    if history is not None:  # a keras.callbacks.History
        steps_per_epoch = (getattr(source, "params", None) or {}).get("steps")
        steps, scales, skipped = _from_history(history, steps_per_epoch)
        return (
            steps,
            scales,
            skipped,
            [],
            "step" if steps_per_epoch else "epoch",
        )
    if isinstance(source, dict):
        steps, scales, skipped = _from_history(source, None)
        return steps, scales, skipped, [], "epoch"
    if hasattr(source, "trace") and hasattr(source, "initial_scale"):
        # A LossScaleMonitor, or a NonFiniteMonitor (which has events).
        series = _from_trace(
            sorted(source.trace), source.initial_skipped, source.initial_scale
        )
        return (*series, list(getattr(source, "events", ())), "step")
    if isinstance(source, (str, os.PathLike)):
        events = _read_jsonl(os.fspath(source))
    elif isinstance(source, (list, tuple)) and all(
        isinstance(e, dict) for e in source
    ):
        events = list(source)
    else:
        raise TypeError(
            "plot_loss_scale: `source` must be a keras History, a "
            "LossScaleMonitor, a NonFiniteMonitor, a list of events, or the "
            f"path of a JSON Lines event log; received {type(source).__name__}."
        )
    # Events only: the scale before and after each event.
    steps, scales = [], []
    for e in events:
        if e.get("loss_scale") is None:
            continue
        steps += [e["step"], e["step"] + 1]
        scales += [
            float(e["loss_scale"]),
            float(e.get("next_loss_scale") or e["loss_scale"]),
        ]
    skipped = [
        e["step"]
        for e in events
        if e.get("kind") in ("calibration", "overflow", "stuck")
    ]
    return steps, scales, skipped, events, "step"


def plot_loss_scale(source, path, title="Loss scale"):
    """Writes a PNG of the loss scale over training steps.

    The scale is drawn on a log2 axis; skipped steps are marked with ticks
    along the bottom, `NonFiniteMonitor` events with a marker per kind, and a
    fallback to float32 with a labelled vertical line.

    Args:
        source: one of
            - a `keras.callbacks.History` from a fit with `LossScaleMonitor`
              (one point per epoch, placed at the epoch's last step),
            - a `LossScaleMonitor` or a `NonFiniteMonitor` (one point per
              step; the latter adds its events),
            - the path of a `NonFiniteMonitor` JSON Lines log, or a list of
              event dicts (the scale around each event).
        path: where to write the PNG.
        title: title of the plot.

    Returns:
        The `matplotlib.figure.Figure` (already saved to `path`).

    Example:

    ```python
    monitor = NonFiniteMonitor()
    model.fit(x, y, callbacks=[LossScaleMonitor(), monitor])
    kerasmp.plot_loss_scale(monitor, "loss_scale.png")
    ```
    """
    Figure = _import_figure("plot_loss_scale")
    steps, scales, skipped, events, x_label = _series(source)
    if not steps:
        raise ValueError(
            "plot_loss_scale: `source` holds no loss-scale values to plot."
        )
    figure = Figure(figsize=(8, 4), dpi=100)
    ax = figure.add_subplot(1, 1, 1)
    ax.step(steps, scales, where="post", color="tab:blue", label="loss scale")
    ax.set_yscale("log", base=2)
    ax.set_xlabel(x_label)
    ax.set_ylabel("loss scale (log2)")
    ax.set_title(title)
    ax.grid(True, which="major", alpha=0.3)
    if skipped:
        ax.plot(
            skipped,
            [0.0] * len(skipped),
            linestyle="none",
            marker="|",
            markersize=12,
            color="tab:red",
            transform=ax.get_xaxis_transform(),
            label=f"skipped steps ({len(skipped)})",
            clip_on=False,
        )
    by_kind = {}
    for e in events:
        by_kind.setdefault(e.get("kind"), []).append(e)
    for kind, items in by_kind.items():
        marker, color, label = _LOSS_SCALE_EVENTS.get(
            kind, ("o", "tab:olive", str(kind))
        )
        xs = [e["step"] for e in items if e.get("loss_scale") is not None]
        ys = [
            float(e["loss_scale"])
            for e in items
            if e.get("loss_scale") is not None
        ]
        if xs:
            ax.plot(
                xs,
                ys,
                linestyle="none",
                marker=marker,
                color=color,
                label=f"{label} ({len(items)})",
            )
        for e in items:
            if e.get("fallback_layers"):
                ax.axvline(e["step"], color="tab:green", linestyle="--")
                ax.annotate(
                    "float32: " + ", ".join(e["fallback_layers"]),
                    xy=(e["step"], 0.95),
                    xycoords=ax.get_xaxis_transform(),
                    rotation=90,
                    va="top",
                    ha="right",
                    fontsize=8,
                    color="tab:green",
                )
    ax.legend(loc="best", fontsize=8)
    figure.tight_layout()
    figure.savefig(os.fspath(path), format="png")
    return figure


# ---------------------------------------------------------------- float8

STATS = ("scale", "amax", "amax_history_max", "amax_ratio", "saturation",
         "underflow")
"""The statistics `Float8Monitor` logs per layer and tensor."""

DEFAULT_STATS = ("scale", "amax", "saturation", "underflow")

_LOG_STATS = ("scale", "amax", "amax_history_max", "amax_ratio")
_TENSOR_STYLE = {"inputs": "-", "kernel": "--", "outputs_grad": ":"}
_FLOAT8_EVENTS = {
    # kind: (marker, color)
    "saturation": ("x", "tab:red"),
    "amax_spike": ("^", "tab:orange"),
    "nonfinite": ("D", "black"),
}
_PREFIX = "float8/"


def parse_key(key):
    """`(layer path, tensor, stat)` of a `Float8Monitor` log key such as
    `"float8/encoder0/ffn/outputs_grad_amax_ratio"`, or None for any other
    key."""
    if not isinstance(key, str) or not key.startswith(_PREFIX):
        return None
    path, sep, rest = key[len(_PREFIX):].rpartition("/")
    if not sep or not path:
        return None
    for tensor in TENSORS:
        if rest.startswith(tensor + "_") and rest[len(tensor) + 1:] in STATS:
            return path, tensor, rest[len(tensor) + 1:]
    return None


def _rows(source):
    """(rows, events, x label): rows are `(x, {key: value})`."""
    if isinstance(getattr(source, "records", None), list) and hasattr(
            source, "events"):  # a Float8Monitor
        rows = [(r["step"], r) for r in source.records]
        return rows, list(source.events), "step"
    history = _history(source)
    if history is not None:
        source = history
    if isinstance(source, dict):
        keys = [k for k in source if parse_key(k)]
        n = max((len(source[k]) for k in keys), default=0)
        rows = [(e + 1, {k: source[k][e] for k in keys
                         if e < len(source[k])}) for e in range(n)]
        return rows, [], "epoch"
    if isinstance(source, (list, tuple)) and all(
            isinstance(r, dict) and "step" in r for r in source):
        return [(r["step"], r) for r in source], [], "step"
    raise TypeError(
        "plot_float8: `source` must be a Float8Monitor, a keras History (or "
        "its `.history` dict) from a fit with one, or a list of the "
        f"monitor's records; received {type(source).__name__}."
    )


def _check_subset(argname, value, allowed):
    if value is None:
        return None
    if isinstance(value, str):
        value = (value,)
    value = tuple(value)
    bad = [v for v in value if v not in allowed]
    if bad or not value:
        raise ValueError(
            f"plot_float8: invalid `{argname}`: {bad or value!r}. Allowed "
            f"values: {', '.join(map(repr, allowed))} (one or more)."
        )
    return value


def float8_series(source, layers=None, tensors=None, stats=DEFAULT_STATS):
    """The data `plot_float8` draws: `{(layer, tensor, stat): (xs, ys)}`.

    Args and the accepted sources: as `plot_float8`. A line holds the
    readings in which the key is present (a layer that fell back stops; the
    inputs' and output gradients' fractions exist only with the monitor's
    `data`).

    Returns:
        `(series, events, x_label)`: the series, the monitor's events (empty
        for other sources) and `"step"` or `"epoch"`.
    """
    rows, events, x_label = _rows(source)
    tensors = _check_subset("tensors", tensors, TENSORS) or TENSORS
    stats = _check_subset("stats", stats, STATS)
    series = {}
    for x, row in rows:
        for key, value in row.items():
            parsed = parse_key(key)
            if parsed is None:
                continue
            if parsed[1] not in tensors or parsed[2] not in stats:
                continue
            xs, ys = series.setdefault(parsed, ([], []))
            xs.append(x)
            ys.append(float(value))
    # The allowed layers: those in `source`.
    layers = _check_subset(
        "layers", layers, tuple(sorted({layer for layer, _, _ in series})))
    if layers is not None:
        series = {k: v for k, v in series.items() if k[0] in layers}
    return series, events, x_label


def plot_float8(source, path, layers=None, tensors=None,
                stats=DEFAULT_STATS, title="Float8 scaling"):
    """Writes a PNG of `Float8Monitor`'s telemetry over training.

    One panel per statistic, sharing the x axis (scale and amax panels on a
    log axis, fractions on a linear one); per layer a colour, per tensor a
    line style (inputs solid, kernel dashed, output gradients dotted).
    Events are marked on the panel of their statistic (saturation,
    amax_ratio) or on every panel (non-finite); a fallback draws a labelled
    vertical line where the layer left float8.

    Args:
        source: A `kerasmp.callbacks.Float8Monitor` after a fit (one point
            per reading, with its events), a `keras.callbacks.History` from
            a fit with one or its `.history` dict (one point per epoch), or
            the monitor's `records` (a list of dicts with `"step"`).
        path: Where to write the PNG.
        layers: Layer paths to draw (default: every float8 layer in
            `source`).
        tensors: A subset of `("inputs", "kernel", "outputs_grad")`
            (default all).
        stats: The panels, a subset of `STATS`. Default `("scale", "amax",
            "saturation", "underflow")`; a statistic without data in
            `source` gets no panel.
        title: The figure's title.

    Returns:
        The `matplotlib.figure.Figure` (already saved to `path`).

    Raises:
        ValueError: `source` has no float8 telemetry for the selection, or
            an argument names an unknown layer, tensor or statistic.

    Example:

    ```python
    monitor = kerasmp.callbacks.Float8Monitor(every_n_steps=2)
    model.fit(x, y, callbacks=[monitor])
    kerasmp.plot_float8(monitor, "float8.png", tensors=("inputs",))
    ```
    """
    series, events, x_label = float8_series(source, layers, tensors, stats)
    if not series:
        raise ValueError(
            "plot_float8: `source` holds no float8 telemetry for the "
            "selected layers, tensors and stats (train with "
            "kerasmp.callbacks.Float8Monitor in the callbacks; the inputs' "
            "and output gradients' fractions need its `data`)."
        )
    Figure = _import_figure("plot_float8")
    stats = _check_subset("stats", stats, STATS)
    panels = [s for s in stats if any(k[2] == s for k in series)]
    layer_names = sorted({k[0] for k in series})
    colors = {name: f"C{i % 10}" for i, name in enumerate(layer_names)}
    figure = Figure(figsize=(9, 2.2 * len(panels) + 0.8), dpi=100)
    axes = figure.subplots(len(panels), 1, sharex=True, squeeze=False)[:, 0]
    for ax, stat in zip(axes, panels):
        for (layer, tensor, s), (xs, ys) in sorted(series.items()):
            if s != stat:
                continue
            ax.plot(xs, ys, color=colors[layer],
                    linestyle=_TENSOR_STYLE[tensor], marker=".",
                    markersize=3, label=f"{layer} {tensor}")
        if stat in _LOG_STATS:
            ax.set_yscale("log", nonpositive="mask")
        ax.set_ylabel(stat.replace("_", " "))
        ax.grid(True, alpha=0.3)
        _draw_events(ax, stat, events)
    axes[0].set_title(title)
    axes[-1].set_xlabel(x_label)
    axes[0].legend(loc="upper left", bbox_to_anchor=(1.01, 1.0), fontsize=7)
    figure.tight_layout()
    figure.savefig(os.fspath(path), format="png")
    return figure


def _draw_events(ax, stat, events):
    """Event markers on the panel of their statistic; fallback lines."""
    for e in events:
        kind = e.get("kind")
        panel = {"saturation": "saturation",
                 "amax_spike": "amax_ratio"}.get(kind)
        if panel == stat or kind == "nonfinite":
            marker, color = _FLOAT8_EVENTS.get(kind, ("o", "tab:olive"))
            value = e.get("value")
            if kind == "nonfinite" or value is None:
                ax.axvline(e["step"], color=color, linestyle=":", alpha=0.6)
            else:
                ax.plot([e["step"]], [value], linestyle="none",
                        marker=marker, color=color, markersize=8)
        if e.get("fallback"):
            ax.axvline(e["step"], color="tab:green", linestyle="--")
            ax.annotate(f"{e['layer']} off float8", xy=(e["step"], 0.95),
                        xycoords=ax.get_xaxis_transform(), rotation=90,
                        va="top", ha="right", fontsize=7, color="tab:green")


# ------------------------------------------------------- gradient report


def plot_gradient_report(report, path, title="Gradients vs loss scale"):
    """Writes a PNG of underflow and relative error against the loss scale.

    The scale is on a log2 axis; the underflow fraction is drawn on the left
    axis, the relative error (log) on the right. Overflowing scales are
    shaded and marked, and the recommended scale is a vertical line.

    Args:
        report: a `GradientReport`.
        path: where to write the PNG.
        title: the plot's title.

    Returns:
        The `matplotlib.figure.Figure` (already saved to `path`).

    Example:

    ```python
    report = kerasmp.debug.gradient_report(model, x, y)
    kerasmp.debug.plot_gradient_report(report, "gradients.png")
    ```
    """
    if not (hasattr(report, "rows") and hasattr(report, "recommended_scale")):
        raise TypeError(
            "plot_gradient_report: `report` must be a GradientReport (from "
            f"gradient_report); received {type(report).__name__}."
        )
    Figure = _import_figure("plot_gradient_report")
    scales = [r.scale for r in report.rows]
    figure = Figure(figsize=(8, 4.5), dpi=100)
    ax = figure.add_subplot(1, 1, 1)
    ax.set_xscale("log", base=2)
    ax.plot(scales, [100 * r.underflow for r in report.rows], "o-",
            color="tab:blue", label="underflow (% of gradient elements)")
    ax.set_ylabel("underflow (%)", color="tab:blue")
    ax.set_ylim(-2, 102)
    ax.set_xlabel("loss scale (log2)")
    ax.set_title(title)
    ax.grid(True, alpha=0.3)
    err = figure.add_axes(ax.get_position(), sharex=ax, frameon=False)
    err.yaxis.tick_right()
    err.yaxis.set_label_position("right")
    finite = [(r.scale, r.rel_error) for r in report.rows
              if not r.overflow and math.isfinite(r.rel_error)
              and r.rel_error > 0]
    if finite:
        err.plot(*zip(*finite), "s-", color="tab:green",
                 label="relative error vs float32")
        err.set_yscale("log")
    err.set_ylabel("relative error vs float32 (log)", color="tab:green")
    handles = ax.get_legend_handles_labels()
    more = err.get_legend_handles_labels()
    over = [r.scale for r in report.rows if r.overflow]
    if over:
        ax.axvspan(min(over) / 2**0.5, max(scales) * 2**0.5, color="tab:red",
                   alpha=0.1)
        h = ax.scatter(over, [100] * len(over), marker="x", color="tab:red",
                       label="overflow (inf/NaN gradient)", zorder=3)
        handles[0].append(h)
        handles[1].append(h.get_label())
    if report.recommended_scale is not None:
        h = ax.axvline(report.recommended_scale, color="black",
                       linestyle="--",
                       label=f"recommended: 2^"
                       f"{log2_text(report.recommended_scale)}")
        handles[0].append(h)
        handles[1].append(h.get_label())
    ax.legend(handles[0] + more[0], handles[1] + more[1], loc="upper right",
              fontsize="small")
    figure.savefig(path)
    return figure
