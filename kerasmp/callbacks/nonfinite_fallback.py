"""Locating and the fallback of `kerasmp.callbacks.NonFiniteMonitor`: the
parts that read or write the model.

- `locate` replays an offending batch through
  `kerasmp.debug.find_nonfinite` and gives the event keys it found.
- `first_nonfinite_weight` names the first weight holding inf/NaN.
- `fall_back` moves the located layer (and its sublayers) to float32 compute,
  or says why it cannot; `fall_back_all` then replays the same batch with
  the new dtypes and moves every further layer that overflows on it, in one
  go (a bounded number of replays).
- `reset_loss_scale` restarts the optimizer's loss scale after a fallback.

The rules that decide when these run are in
`kerasmp/callbacks/nonfinite_events.py`.
"""

import dataclasses
import math

import keras
from keras import ops

from kerasmp import _keras_internals as _ki
from kerasmp._utils.arrays import to_numpy
from kerasmp.callbacks.nonfinite_events import State
from kerasmp.callbacks.nonfinite_events import forget_run
from kerasmp.debug.nonfinite import find_nonfinite
from kerasmp.policy import Float32Override
from kerasmp.policy import Policy
from kerasmp.policy.handback import FALLBACK_RULE

# ----------------------------------------------------------------- locating


def locate(model, batch, scale, variable=None):
    """Replays `batch` (`(x, y, sample_weight)` or None) through
    `kerasmp.debug.find_nonfinite` at loss scale `scale`.

    Returns `(report, fields)`: the `NonFiniteReport` (None if it failed)
    and the event keys it gives: `layer`, `all_gradients_nonfinite` (when
    gradients were computed), `loss_finite` (False when the replayed loss is
    not finite) and `variable` (`variable` when given, else the report's),
    or `locate_error`. Never raises: locating must not break training.
    """
    if batch is None:
        return None, {"locate_error": "the offending batch is not available"}
    x, y, sample_weight = batch
    if not _ki.has_compiled_loss(model):
        y = None
    _ki.jax_state_sync(model)
    try:
        report = find_nonfinite(
            model, x, y, sample_weight=sample_weight, loss_scale=scale or 1.0
        )
    except Exception as e:
        return None, {"locate_error": f"{type(e).__name__}: {e}"}
    fields = {"layer": report.layer}
    grads = [r.grad_finite for r in report.rows if r.grad_finite is not None]
    if grads:
        fields["all_gradients_nonfinite"] = not any(grads)
    if report.loss is not None and not math.isfinite(report.loss):
        fields["loss_finite"] = False
    fields["variable"] = report.variable if variable is None else variable
    return report, fields


def first_nonfinite_weight(model):
    """Path of the first float weight holding inf/NaN, or None (one sync)."""
    _ki.jax_state_sync(model)
    weights = [
        v
        for v in model.weights
        if keras.backend.is_float_dtype(
            keras.backend.standardize_dtype(v.dtype)
        )
    ]
    if not weights:
        return None
    flags = ops.stack([ops.all(ops.isfinite(v)) for v in weights])
    flags = to_numpy(flags)
    if flags.all():
        return None
    return weights[int((~flags).argmax())].path


# ----------------------------------------------------------------- fallback


@dataclasses.dataclass(frozen=True)
class Fallback:
    """What `fall_back` did.

    Attributes:
        refusal: why the layer could not move to float32, or None (moved).
        layer: the path of the layer moved to float32, or None.
        reset_to: the loss scale to restart from, or None (keep it).
        state: the monitor's `State` from now on.
        layers: every layer moved, in order (`fall_back_all`; `(layer,)`
            for `fall_back`).
        note: why `fall_back_all` stopped while the replayed batch was still
            not finite, or None.
    """

    refusal: str = None
    layer: str = None
    reset_to: float = None
    state: State = None
    layers: tuple = ()
    note: str = None


def fall_back(event, report, state, rules):
    """Moves the layer `event` located (and its sublayers) to float32.

    Args:
        event: the actionable event (its `layer` is the located path).
        report: the `NonFiniteReport` that located it, or None.
        state: the monitor's `State`.
        rules: the run's `Rules`.

    Returns:
        A `Fallback`. Refused (nothing changed) when no layer was located,
        the weights are already non-finite, the layer has trainable
        variables that are not float32, or it already computes in float32.
        Otherwise the layers compute in float32 (the caller rebuilds the
        train function), the run of skips is forgotten, and with a dynamic
        loss scale `reset_to` is the scale before the run: the run drove it
        down for a reason now gone.
    """
    path = event.get("layer")
    if path is None or report is None:
        return Fallback(
            "no layer output was non-finite on the offending batch", state=state
        )
    if event["kind"] == "nonfinite_weights" or state.weights_bad:
        return Fallback("the weights are already non-finite", state=state)
    layer = report.layer_object(path)
    targets = [layer] + _ki.sublayers(layer)
    if any(
        keras.backend.standardize_dtype(v.dtype) != "float32"
        for t in targets
        for v in t.weights
        if v.trainable
    ):
        return Fallback(
            f"layer {path!r} has variables that are not float32", state=state
        )
    if all(t.compute_dtype == "float32" for t in targets):
        return Fallback(
            f"layer {path!r} already computes in float32", state=state
        )
    for t in targets:
        t.dtype_policy = _fallback_policy(t)
    reset_to = None
    if rules.scaled and rules.dynamic:
        start_scale = state.run.start_scale if state.run else None
        reset_to = float(start_scale or state.scale)
    return Fallback(
        layer=path, reset_to=reset_to, state=forget_run(state),
        layers=(path,),
    )


MAX_REPLAYS = 16
"""The most replays `fall_back_all` makes after the first move (each moves
at least one more layer, and costs about two training steps)."""


def fall_back_all(model, event, report, state, rules, batch, scale):
    """`fall_back`, then every further layer the same batch overflows.

    After the located layer moves to float32, the offending `batch` is
    replayed (`locate`, at loss scale `scale`) with the new dtypes; a layer
    whose output is still non-finite moves too, and so on, at most
    `MAX_REPLAYS` times: one event fixes every layer that batch overflows,
    instead of one layer per run of `patience` skipped steps.

    Returns:
        A `Fallback` with every moved layer in `layers` (and the first in
        `layer`), the loss scale to restart from (the first move's), and a
        `note` when the batch still overflows: a layer that already computes
        in float32 (not a half-precision overflow), a layer that cannot
        move, or the replay limit.
    """
    result = fall_back(event, report, state, rules)
    if result.refusal is not None:
        return result
    moved = list(result.layers)
    current = result.state
    note = None
    for _ in range(MAX_REPLAYS):
        report, fields = locate(model, batch, scale)
        path = fields.get("layer")
        if report is None or path is None:
            break  # the forward pass is finite now (or cannot be replayed)
        more = fall_back(
            {"kind": event["kind"], "layer": path}, report, current, rules
        )
        if more.refusal is not None:
            note = (f"{path!r} still outputs inf/NaN on that batch: "
                    f"{more.refusal}")
            break
        moved.append(more.layer)
        current = more.state
    else:
        note = (
            f"the batch still overflows after {MAX_REPLAYS} more replays"
        )
    return dataclasses.replace(
        result, state=current, layers=tuple(moved), note=note
    )


def _fallback_policy(layer):
    """float32 for `layer`, marked as the fallback's when a kerasmp policy
    governed it (so `dtype_report` says why the layer is float32)."""
    stored = _ki.stored_dtype_policy(layer)
    if isinstance(stored, Float32Override):
        stored = stored.policy
    if isinstance(stored, Policy):
        return Float32Override(stored, FALLBACK_RULE)
    return "float32"


def reset_loss_scale(optimizer, value):
    """Puts the optimizer's loss scale to `value` and restarts its growth
    counter (and kerasmp's hysteresis budget). Raises what the optimizer
    raises."""
    optimizer.dynamic_scale.assign(value)
    optimizer.step_counter.assign(0)
    budget = getattr(optimizer, "hysteresis_budget", None)
    if isinstance(budget, keras.Variable):
        budget.assign(optimizer.hysteresis)
