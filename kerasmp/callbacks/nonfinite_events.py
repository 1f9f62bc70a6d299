"""The events of `kerasmp.callbacks.NonFiniteMonitor`: how a step is
classified, and how its event is worded and logged. Pure functions of plain
values (no Keras object, no side effect), except `append_jsonl`, which
writes the log file.

Classification, after the style of the optimizer's `_next_state`:

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

Wording and the log: `message` (each event's diagnosis, one paragraph), the
texts of the monitor's own warnings, and the JSON Lines log (`jsonable`,
`append_jsonl`).

Locating and the fallback (which read and write the model) are in
`kerasmp/callbacks/nonfinite_fallback.py`; `kerasmp/callbacks/nonfinite.py`
wires them to `fit`.
"""

import dataclasses
import json
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
            `kerasmp.train_step.ROW_FIELDS`: `skipped` (bool),
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


# ------------------------------------------------------------- wording


def message(event, patience, min_scale, fallback_failed=None):
    """The diagnosis of `event`, one paragraph.

    Args:
        event: the event dict (after locating, describing and acting).
        patience: the monitor's `patience`.
        min_scale: the optimizer's minimum loss scale.
        fallback_failed: why the fallback was impossible, or None.
    """
    kind = event["kind"]
    step = event["step"]
    scale = event["loss_scale"]
    nxt = event["next_loss_scale"]
    forward = event.get("overflow_in") == "forward"
    layer = event.get("layer")
    grads = ""
    if event.get("all_gradients_nonfinite"):
        grads = " Every gradient is non-finite."
    elif event.get("variable") and kind != "nonfinite_weights":
        grads = f" First non-finite gradient: {event['variable']!r}."
    where = f" First non-finite layer output: {layer!r}." if layer else ""
    if kind == "calibration":
        text = (
            f"step {step}: gradients overflowed at loss scale {scale:g}; the "
            f"step was skipped and the scale backed off to {nxt:g}. Normal: "
            "the scale starts high and backs off until scaled gradients fit "
            "in float16 (calibration)."
        )
    elif kind == "overflow":
        if forward:
            text = (
                f"step {step}: the forward pass overflowed (the loss or a "
                "layer output is not finite); the step was skipped (weights "
                f"untouched), scale now {nxt:g}. Loss scaling cannot fix a "
                "forward overflow; isolated ones come from unusual batches."
            )
        else:
            text = (
                f"step {step}: non-finite gradients at loss scale {scale:g} "
                "(the loss was finite: the backward pass overflowed); the "
                f"step was skipped (weights untouched), scale now {nxt:g}. "
                "Isolated skips are normal after the scale grows."
            )
        text += where + grads
    elif kind == "stuck":
        if event.get("at_min_scale"):
            why = f"the loss scale is at its minimum ({min_scale:g})"
        else:
            why = (
                f"{event.get('consecutive_skips')} consecutive steps were "
                f"skipped (patience {patience})"
            )
        text = f"step {step}: training is stuck: {why}."
        if forward:
            text += (
                " The forward pass overflows (the loss or a layer output is "
                "not finite), so every gradient is non-finite and no loss "
                "scale can help." + where + grads
            )
            if layer and not event.get("fallback_layers"):
                text += (
                    f" Compute {layer!r} in float32 (e.g. kerasmp.Policy("
                    "float32_layers=...)) or use NonFiniteMonitor("
                    "action='fallback'); check the range of its inputs."
                )
            elif not layer:
                text += (
                    " Check the inputs for inf/NaN or values too large for "
                    "float16, or compute the first layers in float32."
                )
        else:
            text += (
                f" The loss is finite: the backward pass overflows float16 "
                f"at loss scale {scale:g}." + where + grads
            )
            if not event.get("fallback_layers"):
                text += (
                    " Compute the layers near that gradient in float32 "
                    "(kerasmp.Policy(float32_layers=...)), keep activations "
                    "smaller (normalization, clipping), or lower the "
                    "optimizer's min_scale."
                )
    elif kind == "nonfinite_loss":
        text = (
            f"step {step}: the loss is {event['loss']} and the update was "
            "applied (no loss-scale skip)." + where + grads
        )
    else:
        text = (
            f"epoch {event['epoch']}: weights hold inf/NaN (first: "
            f"{event.get('variable')!r})." + where
        )
    if event.get("fallback_layers"):
        layers = event["fallback_layers"]
        text += (
            f" Fallback: {', '.join(layers)} now "
            f"{'computes' if len(layers) == 1 else 'compute'} in float32; "
            "training continues"
        )
        if event.get("loss_scale_reset_to") is not None:
            text += (
                " with the loss scale reset to "
                f"{event['loss_scale_reset_to']:g} (its value before the "
                "skipped steps)"
            )
        text += "."
        if event.get("fallback_note"):
            text += f" Not every overflow is fixed: {event['fallback_note']}."
    elif fallback_failed:
        text += f" Fallback impossible ({fallback_failed}): stopping."
    return "kerasmp.NonFiniteMonitor: " + text


def log_failed_message(log_file, error):
    """The warning when the JSON Lines log cannot be written."""
    return (
        f"kerasmp.NonFiniteMonitor: cannot write to log_file="
        f"{log_file!r} ({error.strerror or error}); events are kept in "
        "`monitor.events` only from now on."
    )


def reset_failed_message(error):
    """The warning when the loss scale cannot be reset after a fallback."""
    return (
        f"kerasmp.NonFiniteMonitor: could not reset the loss scale "
        f"after the fallback ({type(error).__name__}: {error})."
    )


def jsonable(event):
    """`event` with non-finite floats as strings (`"inf"`, `"nan"`): strict
    JSON, which has no inf or NaN."""
    out = {}
    for key, value in event.items():
        if isinstance(value, float) and not math.isfinite(value):
            value = str(value)
        out[key] = value
    return out


def append_jsonl(path, event):
    """Appends `event` to the file at `path` as one line of strict JSON.
    Raises `OSError` when the file cannot be written."""
    with open(path, "a", encoding="utf-8") as f:
        f.write(json.dumps(jsonable(event)) + "\n")
