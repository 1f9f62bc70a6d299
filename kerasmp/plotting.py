"""`plot_loss_scale`: a picture of the loss scale, skipped steps and events.

(`plot_float8`, the float8 telemetry's picture, lives in
`kerasmp.float8_plotting` and is re-exported here.)

matplotlib is an optional dependency (`pip install kerasmp[plot]`); it is
imported only when a plot is made, and without pyplot, so the user's
matplotlib backend and global state are left alone.
"""

import json
import os

from kerasmp.float8_plotting import plot_float8  # noqa: F401  (re-export)

_EVENT_STYLE = {
    # kind: (marker, color, label)
    "calibration": ("v", "tab:gray", "calibration overflow (normal)"),
    "overflow": ("x", "tab:orange", "overflow (skipped step)"),
    "stuck": ("X", "tab:red", "stuck"),
    "nonfinite_loss": ("D", "tab:purple", "non-finite loss"),
    "nonfinite_weights": ("s", "black", "non-finite weights"),
}


def _import_figure():
    try:
        from matplotlib.figure import Figure
    except ImportError as e:
        raise ImportError(
            "plot_loss_scale needs matplotlib, which is not installed. "
            "Install it with `pip install kerasmp[plot]` (or `pip install "
            "matplotlib`)."
        ) from e
    return Figure


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
    import keras

    from kerasmp.callbacks.monitors import LossScaleMonitor
    from kerasmp.callbacks.monitors import NonFiniteMonitor

    if isinstance(source, keras.callbacks.History):
        steps_per_epoch = (source.params or {}).get("steps")
        steps, scales, skipped = _from_history(source.history, steps_per_epoch)
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
    if isinstance(source, LossScaleMonitor):
        series = _from_trace(
            sorted(source.trace), source.initial_skipped, source.initial_scale
        )
        return (*series, [], "step")
    if isinstance(source, NonFiniteMonitor):
        series = _from_trace(
            source.trace, source.initial_skipped, source.initial_scale
        )
        return (*series, list(source.events), "step")
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
    Figure = _import_figure()
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
        marker, color, label = _EVENT_STYLE.get(
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
