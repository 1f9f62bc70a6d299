"""The math behind `Float8Monitor`: pure numpy, no Keras.

Keras's float8 training (keras/src/layers/core/dense.py `_float8_call`,
keras/src/quantizers/quantizers.py) keeps, per layer and tensor, a `scale`
and an `amax_history`:

- forward: `q = cast(clip(x / scale, -max, max), float8)`, used as `q * scale`;
  E4M3 (`float8_e4m3fn`, max 448) for inputs and kernel, E5M2
  (`float8_e5m2`, max 57344) for the output gradients;
- update (training steps): the step's new scale is `max(amax_history) / max`
  (kept when that max is 0 or not finite), computed from the history
  *before* the step's own amax is appended; the step's amax `max|x|` is then
  written to `amax_history[0]` after rolling the history one place left. So
  `amax_history[0]` is the newest amax, `amax_history[-1]` the one before,
  and the chronological order is `history[1:]` then `history[0]`; the scale a
  step uses comes from the amaxes up to two steps before it.

The functions here turn those variables (and, where available, the tensor
itself) into the monitor's numbers.
"""

import functools
import math

import ml_dtypes
import numpy as np

FORMATS = {
    "inputs": "float8_e4m3fn",
    "kernel": "float8_e4m3fn",
    "outputs_grad": "float8_e5m2",
}
"""The float8 format Keras uses for each tensor of a float8 layer."""

TENSORS = tuple(FORMATS)


@functools.lru_cache(maxsize=None)
def format_max(fmt):
    """The largest finite value of float8 format `fmt` (448 or 57344)."""
    return float(ml_dtypes.finfo(fmt).max)


def _scaled(x, scale):
    return np.asarray(x, dtype=np.float32) / np.float32(scale)


def saturation_fraction(x, scale, fmt):
    """The fraction of `x`'s values that `clip(x / scale)` cuts to the
    float8 maximum: `|x / scale| > format_max(fmt)` (inf counts, NaN not).

    Args:
        x: The tensor (any array-like).
        scale: The layer's scale for this tensor (a positive float).
        fmt: `"float8_e4m3fn"` or `"float8_e5m2"`.
    """
    y = _scaled(x, scale)
    if y.size == 0:
        return 0.0
    return float(np.mean(np.abs(y) > format_max(fmt)))


def underflow_fraction(x, scale, fmt):
    """The fraction of `x`'s values that are non-zero but become zero in
    float8: `x != 0` and `cast(x / scale, fmt) == 0`, i.e. `0 < |x / scale|
    <= s / 2` for the format's smallest subnormal `s` (2**-9 for E4M3,
    2**-16 for E5M2; a tie rounds to even: zero).
    """
    y = np.abs(_scaled(x, scale))
    if y.size == 0:
        return 0.0
    half = float(ml_dtypes.finfo(fmt).smallest_subnormal) / 2
    return float(np.mean((y > 0) & (y <= half)))


def chronological(history):
    """A Keras amax history in step order (oldest first, newest last)."""
    h = np.asarray(history, dtype=np.float64).reshape(-1)
    return np.concatenate([h[1:], h[:1]])


def amax_ratios(history, steps, fmt, initial_scale=1.0):
    """For each of the last `steps` steps, the step's amax over the amax
    its scale was computed from.

    A ratio above 1 means the step clipped its largest values to the float8
    maximum (the values between `amax / ratio` and `amax`), a saturation that
    the history then hides: the next scales include that amax. The scale a
    step used is rebuilt from the history (the largest amax up to two steps
    before it; `initial_scale * format_max(fmt)` while that is 0, as a fresh
    layer's scale is 1). Once the history has wrapped, its oldest entries
    are gone, so the ratio is an upper bound, exact in practice for the
    newest steps of a long history.

    Returns:
        A list of `steps` floats (NaN where the step's amax is not finite;
        fewer when the history is shorter), oldest first.
    """
    c = chronological(history)
    steps = max(0, min(int(steps), len(c)))
    if steps == 0:
        return []
    # The largest finite amax of c[:k] for every k: one running maximum
    # (not one max per step: a reading's cost on a long history).
    finite = np.where(np.isfinite(c), c, -np.inf)
    prefix = np.concatenate([[-np.inf], np.maximum.accumulate(finite)])
    j = np.arange(len(c) - steps, len(c))
    used = prefix[np.maximum(0, j - 1)]  # max of c[: j - 1]
    used = np.where(used > 0, used, initial_scale * format_max(fmt))
    amax = c[j]
    ratios = np.where(np.isfinite(amax), amax / used, np.nan)
    return [float(r) for r in ratios]


def tensor_stats(scale, history, fmt, steps=1, x=None):
    """The monitor's numbers for one tensor of one float8 layer.

    Args:
        scale: The tensor's `*_scale` variable value (what the next step
            uses).
        history: Its `*_amax_history` value.
        fmt: Its float8 format (`FORMATS`).
        steps: Steps since the last reading (the `amax_ratio` is the
            largest over them).
        x: The tensor itself, or None: the saturation and underflow
            fractions are then left out.

    Returns:
        A dict: `scale`, `amax` (the newest step's), `amax_history_max`,
        `amax_ratio` (see `amax_ratios`; the largest of the last `steps`),
        and with `x`: `saturation` and `underflow` (fractions of `x` at
        `scale`).
    """
    h = np.asarray(history, dtype=np.float64).reshape(-1)
    ratios = [r for r in amax_ratios(h, steps, fmt) if not math.isnan(r)]
    stats = {
        "scale": float(scale),
        "amax": float(h[0]) if h.size else float("nan"),
        "amax_history_max": float(np.max(h)) if h.size else float("nan"),
        "amax_ratio": max(ratios) if ratios else float("nan"),
    }
    if x is not None:
        stats["saturation"] = saturation_fraction(x, scale, fmt)
        stats["underflow"] = underflow_fraction(x, scale, fmt)
    return stats


def classify(stats, saturation_threshold, spike_ratio):
    """The event one tensor's stats call for, or None.

    Kinds, first match wins: `"nonfinite"` (scale, amax or history max not
    finite), `"saturation"` (measured saturation fraction above
    `saturation_threshold`), `"amax_spike"` (`amax_ratio` above
    `spike_ratio`: a step clipped values that the history now hides).

    Returns:
        None, or `(kind, value, threshold)`.
    """
    for key in ("scale", "amax", "amax_history_max"):
        if not math.isfinite(stats[key]):
            return "nonfinite", stats[key], None
    sat = stats.get("saturation")
    if sat is not None and sat > saturation_threshold:
        return "saturation", sat, saturation_threshold
    ratio = stats["amax_ratio"]
    if math.isfinite(ratio) and ratio > spike_ratio:
        return "amax_spike", ratio, spike_ratio
    return None


def message(event):
    """One sentence saying what a float8 event is and what was done."""
    kind, layer, tensor = event["kind"], event["layer"], event["tensor"]
    value = event["value"]
    if kind == "nonfinite":
        what = f"non-finite float8 scaling state ({value})"
    elif kind == "saturation":
        what = (f"{value:.2%} of the values saturate at the float8 maximum "
                f"(threshold {event['threshold']:.2%})")
    else:
        what = (f"a step's amax was {value:.3g}x the amax its scale came "
                "from, so its largest values were clipped to the float8 "
                f"maximum (threshold {event['threshold']:g}x)")
    text = (f"Float8Monitor: layer {layer!r}, {tensor} at step "
            f"{event['step']}: {what}.")
    action = event.get("action")
    if action == "fallback" and event.get("fallback"):
        text += (f" Moved {layer!r} alone off float8 to "
                 f"{event['fallback']}; the other float8 layers are "
                 "unchanged and training continues.")
    elif action == "fallback":
        text += f" Could not fall back: {event.get('fallback_failed')}."
    elif action == "stop":
        text += " Training stops (action='stop')."
    return text
