"""`plot_float8`: a picture of `Float8Monitor`'s telemetry over training.

One panel per statistic (default: scale, amax, saturation, underflow), one
line per float8 layer and tensor (colour: layer; line style: tensor), the
monitor's events as markers and each per-layer fallback as a labelled
vertical line. matplotlib is optional (`pip install kerasmp[plot]`), imported
only when a plot is made and without pyplot, as for `plot_loss_scale`.
"""

import os

from kerasmp.float8 import telemetry as _tm

STATS = ("scale", "amax", "amax_history_max", "amax_ratio", "saturation",
         "underflow")
"""The statistics `Float8Monitor` logs per layer and tensor."""

DEFAULT_STATS = ("scale", "amax", "saturation", "underflow")

_LOG_STATS = ("scale", "amax", "amax_history_max", "amax_ratio")
_TENSOR_STYLE = {"inputs": "-", "kernel": "--", "outputs_grad": ":"}
_EVENT_STYLE = {
    # kind: (marker, color)
    "saturation": ("x", "tab:red"),
    "amax_spike": ("^", "tab:orange"),
    "nonfinite": ("D", "black"),
}
_PREFIX = "float8/"


def _import_figure():
    try:
        from matplotlib.figure import Figure
    except ImportError as e:
        raise ImportError(
            "plot_float8 needs matplotlib, which is not installed. Install "
            "it with `pip install kerasmp[plot]` (or `pip install "
            "matplotlib`)."
        ) from e
    return Figure


def parse_key(key):
    """`(layer path, tensor, stat)` of a `Float8Monitor` log key such as
    `"float8/encoder0/ffn/outputs_grad_amax_ratio"`, or None for any other
    key."""
    if not isinstance(key, str) or not key.startswith(_PREFIX):
        return None
    path, sep, rest = key[len(_PREFIX):].rpartition("/")
    if not sep or not path:
        return None
    for tensor in _tm.TENSORS:
        if rest.startswith(tensor + "_") and rest[len(tensor) + 1:] in STATS:
            return path, tensor, rest[len(tensor) + 1:]
    return None


def _rows(source):
    """(rows, events, x label): rows are `(x, {key: value})`."""
    import keras

    from kerasmp.callbacks.float8 import Float8Monitor

    if isinstance(source, Float8Monitor):
        rows = [(r["step"], r) for r in source.records]
        return rows, list(source.events), "step"
    if isinstance(source, keras.callbacks.History):
        source = source.history
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
    tensors = _check_subset("tensors", tensors, _tm.TENSORS) or _tm.TENSORS
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
    Figure = _import_figure()
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
            marker, color = _EVENT_STYLE.get(kind, ("o", "tab:olive"))
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
