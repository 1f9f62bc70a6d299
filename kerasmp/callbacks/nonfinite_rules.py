"""The events of `kerasmp.callbacks.NonFiniteMonitor`: its classification
rules, as pure functions (plain values in, plain values out; no Keras
object, no side effect), after the style of the optimizer's `_next_state`.

- `start` gives a run's first `State`.
- `classify` takes the state and one step's record (a `_train_step` row) and
  returns the next state and the step's `Verdict` (its event's kind,
  whether the monitor's action applies, whether to locate the layer), or
  None when the step is unremarkable.
- `classify_logged_loss` and `classify_weights` do the same for a
  non-finite loss seen only in the logs and for weights found non-finite.
- `describe` says where a skipped step's overflow happened (forward or
  backward pass), keeping the facts of the run of skips.
- `new_event` and `weights_event` write verdicts as event dicts.
- `forget_run` and `after_scale_reset`: the state after a fallback.

Locating and the fallback (which read and write the model) are in
`kerasmp/callbacks/nonfinite_fallback.py`, the wording and the JSON Lines
log in `kerasmp/callbacks/nonfinite_messages.py`;
`kerasmp/callbacks/monitors.py` wires them to `fit`.
"""

import dataclasses
import math

KINDS = (
    "calibration",
    "overflow",
    "stuck",
    "nonfinite_loss",
    "nonfinite_weights",
)

# ----------------------------------------------------------- classification


@dataclasses.dataclass(frozen=True)
class Rules:
    """What classifies a run's steps (fixed for one `fit`).

    Attributes:
        patience: consecutive skipped steps that make a run `stuck`.
        scaled: whether the optimizer has a loss scale (rows carry it).
        dynamic: whether the loss scale changes (a static one is never at
            its minimum).
        min_scale: the optimizer's lowest loss scale.
    """

    patience: int
    scaled: bool = True
    dynamic: bool = True
    min_scale: float = 1.0


@dataclasses.dataclass(frozen=True)
class SkipRun:
    """The facts of the current run of consecutive skipped steps.

    Attributes:
        start_scale: the loss scale its first step ran with.
        forward: whether a step of it overflowed in the forward pass.
        layer: the first non-finite layer output located in it, or None.
        variable: the first non-finite gradient located in it, or None.
        all_nonfinite: whether every gradient was non-finite (None: unknown).
    """

    start_scale: float = None
    forward: bool = False
    layer: str = None
    variable: str = None
    all_nonfinite: bool = None


@dataclasses.dataclass(frozen=True)
class State:
    """Everything the monitor remembers between steps of one `fit`.

    Attributes:
        scale: the loss scale after the last step (None without one).
        skipped: the optimizer's count of skipped steps after the last step.
        calibrating: skips still back the scale off from its initial value.
        last_consecutive: the optimizer's consecutive-skip count last seen.
        base: skips of the current run before the last fallback (not
            counted towards `patience`).
        run: the current run of skips (`SkipRun`), or None.
        stuck: the current run was already reported stuck.
        loss_ok: no non-finite loss was reported in this epoch.
        weights_bad: the weights were reported non-finite.
    """

    scale: float = None
    skipped: int = 0
    calibrating: bool = False
    last_consecutive: int = 0
    base: int = 0
    run: SkipRun = None
    stuck: bool = False
    loss_ok: bool = True
    weights_bad: bool = False


@dataclasses.dataclass(frozen=True)
class Verdict:
    """What one step (or epoch end) amounts to.

    Attributes:
        kind: one of `KINDS`.
        loss_scale: the loss scale the step ran with.
        actionable: the monitor's `action` applies (for `nonfinite_loss`:
            unless `classify_weights` then finds the weights broken, when
            the `nonfinite_weights` event acts instead).
        locate: the step's batch is worth replaying to name the layer.
        merge_run: the event reports the facts of its whole run of skips.
        fields: the event's kind-specific keys, in order.
    """

    kind: str
    loss_scale: float
    actionable: bool = False
    locate: bool = False
    merge_run: bool = False
    fields: tuple = ()


def start(rules, scale, skipped, fresh):
    """The state at the start of a `fit`: the optimizer's scale and skip
    count, and whether the optimizer never updated (`fresh`, then early
    skips are calibration)."""
    return State(
        scale=scale,
        skipped=skipped,
        calibrating=rules.dynamic and fresh and skipped == 0,
    )


def classify(state, row, rules):
    """Classifies one step from its record.

    Args:
        state: the `State` before the step.
        row: the step's record, a mapping with the keys of
            `kerasmp.train_step.steps.ROW_FIELDS`: `skipped` (bool),
            `consecutive` and `total` (the optimizer's skip counts after
            the step), `scale` (the loss scale after it), `forward` (bool:
            the loss or a layer output was non-finite).
        rules: the run's `Rules`.

    Returns:
        `(state, verdict)`: the `State` after the step and its `Verdict`,
        or None when there is nothing to record.
    """
    scale_before = state.scale
    if rules.scaled:
        state = _with(state, scale=row["scale"], skipped=row["total"])
    if not row["skipped"]:
        # An update went through: the run of skips (and calibration) ends.
        state = _with(
            state,
            calibrating=False,
            last_consecutive=0,
            base=0,
            run=None,
            stuck=False,
        )
        if row["forward"] and state.loss_ok:
            # The update went through with a non-finite loss.
            return dataclasses.replace(state, loss_ok=False), _loss_verdict(
                state
            )
        return state, None
    consecutive = row["consecutive"]
    base = state.base
    if consecutive <= state.last_consecutive:
        base = 0  # a new run of skips (the optimizer's count restarted)
    run_length = max(1, consecutive - base)
    first_in_run = run_length == 1 or state.run is None
    run = SkipRun(start_scale=scale_before) if first_in_run else state.run
    forward = row["forward"]
    # A forward overflow is no calibration: no loss scale can fix it.
    calibrating = state.calibrating and not forward
    at_min = rules.dynamic and scale_before <= rules.min_scale
    if calibrating and not at_min:
        kind = "calibration"
    elif at_min or run_length >= rules.patience:
        kind = "stuck"
    else:
        kind = "overflow"
    actionable = kind == "stuck" and not state.stuck
    state = dataclasses.replace(
        state,
        calibrating=calibrating,
        last_consecutive=consecutive,
        base=base,
        run=run,
        stuck=state.stuck or kind == "stuck",
    )
    return state, Verdict(
        kind=kind,
        loss_scale=scale_before,
        actionable=actionable,
        locate=actionable or (kind == "overflow" and first_in_run),
        merge_run=kind == "stuck",
        fields=(
            ("consecutive_skips", run_length),
            ("at_min_scale", at_min),
            ("loss_finite", not forward),
        ),
    )


def _with(state, **changes):
    """`state` with `changes`; `state` itself when they change nothing (the
    common step, applied with the scale unchanged, builds no new object)."""
    if all(getattr(state, k) == v for k, v in changes.items()):
        return state
    return dataclasses.replace(state, **changes)


def _loss_verdict(state):
    return Verdict(
        kind="nonfinite_loss",
        loss_scale=state.scale,
        actionable=True,
        locate=True,
        fields=(("loss_finite", False),),
    )


def classify_logged_loss(state, loss):
    """A non-finite `loss` in the logs that no step record flagged (a
    custom train step): `(state, verdict or None)`, once per epoch."""
    if (
        state.loss_ok
        and isinstance(loss, (int, float))
        and not math.isfinite(loss)
    ):
        return dataclasses.replace(state, loss_ok=False), _loss_verdict(state)
    return state, None


def classify_weights(state, variable):
    """Weights checked: `variable` is the path of the first non-finite
    one, or None. Returns `(state, verdict or None)`: reported (and acted
    on) once per `fit`."""
    if state.weights_bad or variable is None:
        return state, None
    verdict = Verdict(
        kind="nonfinite_weights",
        loss_scale=state.scale,
        actionable=True,
        locate=True,
        fields=(("variable", variable),),
    )
    return dataclasses.replace(state, weights_bad=True), verdict


def new_event(verdict, step, epoch, batch, state, rules, loss):
    """The event dict of `verdict` (the keys every event has, then the
    verdict's own), before locating and describing."""
    event = {
        "step": int(step),
        "epoch": int(epoch),
        "batch": batch,
        "kind": verdict.kind,
        "loss_scale": verdict.loss_scale,
        "next_loss_scale": state.scale,
        "skipped_steps": state.skipped if rules.scaled else None,
        "loss": loss,
        "layer": None,
        "variable": None,
        "action": None,
    }
    event.update(verdict.fields)
    return event


def weights_event(event, variable):
    """The `nonfinite_weights` event that follows a `nonfinite_loss` event
    whose update broke the weights (`variable`: the first broken one)."""
    weights = dict(event, kind="nonfinite_weights", variable=variable)
    weights.pop("weights_finite", None)
    return weights


def describe(run, event, merge_run=False):
    """Where a skipped step's overflow happened, and what its run showed.

    Args:
        run: the `SkipRun` the step belongs to, or None.
        event: the step's event (after locating).
        merge_run: give the event the facts of the whole run (a `stuck`
            event says what the run showed, not only its own step).

    Returns:
        `(run, fields)`: the run with this step's facts added, and the keys
        to set on the event: `overflow_in` (`"forward"` or `"backward"`),
        `all_gradients_nonfinite`, and with `merge_run` the run's
        `loss_finite`, `layer` and `variable`.
    """
    forward = event.get("loss_finite") is False or bool(event.get("layer"))
    all_bad = event.get("all_gradients_nonfinite")
    if all_bad is None and event.get("loss_finite") is False:
        all_bad = True  # d(non-finite loss)/dw is non-finite for every w
    fields = {}
    if run is not None:
        facts = {"forward": run.forward or forward}
        if run.layer is None and event.get("layer"):
            facts["layer"] = event["layer"]
        if run.variable is None and event.get("variable"):
            facts["variable"] = event["variable"]
        if run.all_nonfinite is None:
            facts["all_nonfinite"] = all_bad
        run = dataclasses.replace(run, **facts)
        if merge_run:
            forward = run.forward
            if run.forward:
                fields["loss_finite"] = False
            if not event.get("layer") and run.layer:
                fields["layer"] = run.layer
            if not event.get("variable") and run.variable:
                fields["variable"] = run.variable
            if all_bad is None:
                all_bad = run.all_nonfinite
    fields["overflow_in"] = "forward" if forward else "backward"
    fields["all_gradients_nonfinite"] = all_bad
    if all_bad:
        fields["variable"] = None
    return run, fields


# ------------------------------------------------------ after a fallback


def forget_run(state):
    """The state after the located layer moved to float32: a new start for
    the layer, the run of skips so far forgotten (its skips no longer count
    towards `patience`)."""
    return dataclasses.replace(
        state, base=state.last_consecutive, stuck=False, run=None
    )


def after_scale_reset(state, value):
    """The state once the scale was reset to `value`: skips before the next
    applied update back the scale off from there (calibration again, not
    trouble)."""
    return dataclasses.replace(state, scale=value, calibrating=True)
