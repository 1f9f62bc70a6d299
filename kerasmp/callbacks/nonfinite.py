"""`NonFiniteMonitor`: every inf/NaN event of a training run, explained and
acted on.

It records every skipped step and every non-finite loss or weight as an
event, tells normal calibration overflows from a run that is stuck, names
the layer that went non-finite, and can warn, stop, raise or move that layer
to float32 and carry on. It only wires its parts to `fit`: the events'
classification and wording in `nonfinite_events`, locating and the fallback
in `nonfinite_fallback`. Like `LossScaleMonitor` it reads what kerasmp's
train step returns and changes no value in the logs.
"""

import dataclasses
import itertools
import json
import numbers
import os

import keras
import numpy as np

from kerasmp import _keras_internals as _ki
from kerasmp import train_step as _train_step
from kerasmp._utils.arrays import to_numpy
from kerasmp._utils.devices import process_index
from kerasmp._utils.warn import warn
from kerasmp.callbacks.nonfinite_events import Rules
from kerasmp.callbacks.nonfinite_events import State
from kerasmp.callbacks.nonfinite_events import after_scale_reset
from kerasmp.callbacks.nonfinite_events import append_jsonl
from kerasmp.callbacks.nonfinite_events import classify
from kerasmp.callbacks.nonfinite_events import classify_logged_loss
from kerasmp.callbacks.nonfinite_events import classify_weights
from kerasmp.callbacks.nonfinite_events import describe
from kerasmp.callbacks.nonfinite_events import jsonable
from kerasmp.callbacks.nonfinite_events import log_failed_message
from kerasmp.callbacks.nonfinite_events import message
from kerasmp.callbacks.nonfinite_events import new_event
from kerasmp.callbacks.nonfinite_events import reset_failed_message
from kerasmp.callbacks.nonfinite_events import start
from kerasmp.callbacks.nonfinite_events import weights_event
from kerasmp.callbacks.nonfinite_fallback import fall_back_all
from kerasmp.callbacks.nonfinite_fallback import first_nonfinite_weight
from kerasmp.callbacks.nonfinite_fallback import locate
from kerasmp.callbacks.nonfinite_fallback import reset_loss_scale
from kerasmp.callbacks.shared import needs_kerasmp_optimizer
from kerasmp.errors import NonFiniteError
from kerasmp.errors import NonFiniteWarning
from kerasmp.policy.workers import gather_on_first

ACTIONS = ("warn", "stop", "raise", "fallback")
_monitors = itertools.count()  # this process's monitors, in order


class NonFiniteMonitor(keras.callbacks.Callback):
    """Records every inf/NaN event of a training run, and acts on bad ones.

    Each event is a dict with at least `step`, `epoch`, `batch`, `kind`,
    `loss_scale` (the scale the step ran with), `next_loss_scale`, `layer`,
    `variable`, `action` and `message`, kept in `.events` and, with
    `log_file`, appended to that file as one JSON line. Kinds:

    - `"calibration"`: the gradients overflowed before the first update of a
      fresh optimizer, while the loss scale backs off from its initial value.
      Normal.
    - `"overflow"`: a skipped step after calibration. Isolated ones are
      normal (the scale grew a step too far); the event notes when the loss
      itself was non-finite, i.e. the forward pass overflowed.
    - `"stuck"`: `patience` consecutive skipped steps, or a step skipped
      while the scale was already at the optimizer's `min_scale`.
    - `"nonfinite_loss"`: a non-finite loss on a step that was not skipped
      (no loss scaling, or a loss-scale optimizer that did not catch it).
    - `"nonfinite_weights"`: a weight holds inf or NaN (checked at the end of
      each epoch and after a non-finite loss).

    On `stuck`, `nonfinite_loss` and `nonfinite_weights` the monitor acts:

    - `"warn"`: issue a `kerasmp.errors.NonFiniteWarning` and continue.
    - `"stop"`: warn and set `model.stop_training`.
    - `"raise"`: raise `kerasmp.errors.NonFiniteError` with the diagnosis.
    - `"fallback"`: move the located layer (and its sublayers) to float32
      compute, replay the same batch and move every further layer that then
      overflows on it (at most 16 replays), rebuild the train function once
      and continue; the event lists the layers under `fallback_layers` (and,
      if the batch still overflows, why under `fallback_note`). If no layer
      was located, or it already computes in float32, or the weights are
      already non-finite, it stops instead and says why.

    With `locate=True` the offending batch is replayed through
    `kerasmp.debug.find_nonfinite` (eagerly, layer by layer: roughly the cost
    of two training steps, only on actionable events and on the first skip of
    a run of skips, never on calibration) and the event's `layer` names the
    first layer whose output went non-finite, `variable` the first variable
    whose gradient did. Keeping the batch costs no transfer: on TensorFlow the
    step returns a reference to it (on the device), on JAX the train
    function's wrapper keeps the batch the iterator yields.

    Args:
        action: one of `"warn"`, `"stop"`, `"raise"`, `"fallback"`.
        patience: consecutive skipped steps that make a run `stuck` (int >= 1).
        log_file: path of a JSON Lines file to append events to, or None.
            In a multi-process run only process 0 writes it (on JAX with
            a line per event for what each other process recorded).
        locate: replay offending batches to name the layer (bool).

    Example:

    ```python
    monitor = NonFiniteMonitor(action="fallback", log_file="events.jsonl")
    model.fit(x, y, callbacks=[monitor])
    for event in monitor.events:
        print(event["step"], event["kind"], event["layer"])
    ```
    """

    def __init__(self, action="warn", patience=50, log_file=None, locate=True):
        super().__init__()
        if not isinstance(action, str) or action not in ACTIONS:
            raise ValueError(
                "`action` must be one of "
                f"{', '.join(repr(a) for a in ACTIONS)}; received "
                f"action={action!r}."
            )
        if (
            isinstance(patience, (bool, np.bool_))
            or not isinstance(patience, numbers.Integral)
            or patience < 1
        ):
            raise ValueError(
                "`patience` must be an integer >= 1; received "
                f"patience={patience!r}."
            )
        if not isinstance(locate, bool):
            raise ValueError(
                f"`locate` must be True or False; received locate={locate!r}."
            )
        if log_file is not None:
            if not isinstance(log_file, (str, os.PathLike)):
                raise ValueError(
                    "`log_file` must be None or a file path (str or "
                    f"os.PathLike); received log_file={log_file!r}."
                )
            log_file = os.fspath(log_file)
            try:
                with open(log_file, "a", encoding="utf-8"):
                    pass
            except OSError as e:
                raise ValueError(
                    f"`log_file` is not writable: log_file={log_file!r} "
                    f"({e.strerror or e})."
                ) from None
        self.action = action
        self.patience = int(patience)
        self.log_file = log_file
        self.locate = locate
        # Records, kept across `fit` calls.
        self.events = []
        self.trace = []
        self.initial_scale = None
        self.initial_skipped = None
        self.fallbacks = []
        self.last_report = None
        self._located = (None, None)  # the batch and scale last replayed
        self._next_step = 0  # steps counted over all `fit` calls
        self._log_failed = False
        self._run_tag = next(_monitors)  # the same order on every process
        self._written = 0

    # ------------------------------------------------------------ callbacks

    def on_train_begin(self, logs=None):
        model = self.model
        optimizer = model.optimizer
        scaled = _train_step.scaled(model)
        if not scaled and isinstance(
            optimizer, keras.optimizers.LossScaleOptimizer
        ):
            warn(needs_kerasmp_optimizer(self, optimizer))
        if self.locate:
            _train_step.keep_batches(model)
        self._rules = Rules(patience=self.patience, scaled=False)
        self._state = State()
        self._epoch = 0
        self._batch_begin = 0
        self._reset_to = None  # a loss scale to restore after this batch
        if scaled:
            self._rules = Rules(
                patience=self.patience,
                scaled=True,
                dynamic=bool(getattr(optimizer, "dynamic", True)),
                min_scale=float(getattr(optimizer, "min_scale", 1.0) or 0),
            )
            scale, skipped = _train_step.optimizer_state(optimizer)
            self._state = start(
                self._rules,
                scale=scale,
                skipped=skipped,
                fresh=int(to_numpy(optimizer.iterations)) == 0,
            )
            if self.initial_scale is None:
                self.initial_scale = self._state.scale
            if self.initial_skipped is None:
                self.initial_skipped = self._state.skipped

    def on_epoch_begin(self, epoch, logs=None):
        self._epoch = epoch
        self._state = dataclasses.replace(self._state, loss_ok=True)

    def on_train_batch_begin(self, batch, logs=None):
        self._batch_begin = batch

    def on_train_batch_end(self, batch, logs=None):
        logs = logs or {}
        loss = logs.get("loss")
        rows = _train_step.rows(self.model)
        if not rows:  # no per-step records: a step count from the batches
            self._next_step += max(1, batch - self._batch_begin + 1)
        for i, row in enumerate(rows):
            step = self._next_step
            self._next_step += 1
            # TensorFlow keeps the batch of an execution's last step only:
            # it stands for the steps of the run of skips it ends.
            trailing = all(r["skipped"] for r in rows[i:])
            offsets = (len(rows) - 1 - i, 0 if trailing else None)
            self._state, verdict = classify(self._state, row, self._rules)
            if self._rules.scaled:
                self.trace.append(
                    (step, self._state.scale, self._state.skipped)
                )
            if verdict is not None:
                self._on_verdict(
                    verdict, step, self._batch_begin + i, loss, offsets
                )
        # While no step of the epoch was applied, the logs carry the loss of
        # the latest skipped step (docs/monitoring.md): its record says why.
        verdict = None
        if not (rows and rows[-1]["skipped"]):
            self._state, verdict = classify_logged_loss(self._state, loss)
        if verdict is not None:
            self._on_verdict(
                verdict, self._next_step - 1, batch, loss, (0, None)
            )
        if self._reset_to is not None:
            self._reset_scale(self._reset_to)
            self._reset_to = None

    def on_epoch_end(self, epoch, logs=None):
        if self._state.weights_bad:
            return
        variable = first_nonfinite_weight(self.model)
        self._state, verdict = classify_weights(self._state, variable)
        if verdict is None:
            return
        event = self._event(verdict, self._next_step - 1, None, None)
        self._locate(event, self._state.scale, (0, None), keep_variable=True)
        self._finish(event, actionable=True)

    # -------------------------------------------------------------- events

    def _on_verdict(self, verdict, step, batch, loss, offsets):
        event = self._event(verdict, step, batch, loss)
        if verdict.kind == "nonfinite_loss":
            self._on_nonfinite_loss(event, offsets)
            return
        if verdict.locate:
            self._locate(event, verdict.loss_scale, offsets)
        run, fields = describe(
            self._state.run, event, merge_run=verdict.merge_run
        )
        self._state = dataclasses.replace(self._state, run=run)
        event.update(fields)
        self._finish(event, actionable=verdict.actionable)

    def _on_nonfinite_loss(self, event, offsets):
        self._locate(event, self._state.scale or 1.0, offsets)
        event["overflow_in"] = "forward"
        bad = self._state.weights_bad
        variable = None if bad else first_nonfinite_weight(self.model)
        event["weights_finite"] = variable is None and not bad
        self._state, weights = classify_weights(self._state, variable)
        if weights is None:
            self._finish(event, actionable=True)
            return
        # The update went through and broke the weights: act once, on that.
        self._finish(event, actionable=False)
        self._finish(
            weights_event(event, variable),
            actionable=weights.actionable,
        )

    def _event(self, verdict, step, batch, loss):
        return new_event(
            verdict,
            step=step,
            epoch=self._epoch,
            batch=batch,
            state=self._state,
            rules=self._rules,
            loss=loss,
        )

    def _locate(self, event, scale, offsets, keep_variable=False):
        """Names the first non-finite layer of the step's batch (the first
        of `offsets`, steps back from the execution's last, that the tap
        kept) in `event`."""
        if not self.locate:
            return
        batch = None
        for offset in offsets:
            if offset is not None:
                batch = _train_step.batch(self.model, offset)
                if batch is not None:
                    break
        self._located = (batch, scale)
        report, fields = locate(
            self.model,
            batch,
            scale,
            variable=event.get("variable") if keep_variable else None,
        )
        if report is not None:
            self.last_report = report
        event.update(fields)

    def _finish(self, event, actionable):
        report = self.last_report if event.get("layer") else None
        fallback_failed = None
        if actionable:
            action = self.action
            if action == "fallback":
                fallback_failed = self._fallback(event, report)
                if fallback_failed:
                    action = "stop"
            event["action"] = action
        event["message"] = message(
            event, self.patience, self._rules.min_scale, fallback_failed
        )
        self.events.append(event)
        self._write(event)
        if not actionable:
            return
        if event["action"] in ("warn", "stop") or event.get("fallback_layers"):
            warn(event["message"], NonFiniteWarning)
        if event["action"] == "stop":
            self.model.stop_training = True
        if event["action"] == "raise":
            raise NonFiniteError(event["message"], event=event, report=report)

    def _fallback(self, event, report):
        """Moves the located layer to float32, and every further layer the
        same batch then overflows; returns why not, or None."""
        batch, scale = self._located
        result = fall_back_all(
            self.model, event, report, self._state, self._rules, batch, scale
        )
        if result.refusal is not None:
            return result.refusal
        # The layers' compute dtype changed: trace the step again.
        _ki.jax_state_sync(self.model)
        self.model.make_train_function(force=True)
        self.fallbacks.extend(result.layers)
        event["fallback_layers"] = list(result.layers)
        if result.note is not None:
            event["fallback_note"] = result.note
        if result.reset_to is not None:
            event["loss_scale_reset_to"] = result.reset_to
            self._reset_to = result.reset_to
        self._state = result.state
        return None

    def _reset_scale(self, value):
        _ki.jax_state_sync(self.model)
        try:
            reset_loss_scale(self.model.optimizer, value)
        except Exception as e:  # never break training over this
            warn(reset_failed_message(e), NonFiniteWarning)
            return
        self._state = after_scale_reset(self._state, value)

    def _write(self, event):
        if self.log_file is None:
            return
        # In a multi-process run every process sees the same skipped steps
        # (the finite check is global) and replays the step's batch (on
        # JAX the global batch, elsewhere its own part): process 0 writes
        # the event once, then a line with what each other process saw
        # (JAX; elsewhere only process 0 writes).
        index, count = process_index()
        others = {}
        if count > 1:
            self._written += 1
            tag = f"nonfinite/{self._run_tag}/{self._written}"
            gathered = gather_on_first(tag, json.dumps(jsonable(event)))
            if index != 0:
                return
            others = {p: t for p, t in gathered.items() if p != 0}
            event = {**event, "process": 0}
        if self._log_failed:
            return
        try:
            append_jsonl(self.log_file, event)
            for p, text in sorted(others.items()):
                seen = (json.loads(text) if text is not None
                        else {"message": "nothing received from it"})
                append_jsonl(self.log_file, {**seen, "process": p})
        except OSError as e:
            # Losing the log must not lose the run: events stay in memory.
            self._log_failed = True
            warn(log_failed_message(self.log_file, e), NonFiniteWarning)
