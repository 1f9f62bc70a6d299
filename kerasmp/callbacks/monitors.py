"""Callbacks that show the loss scale and explain every inf/NaN event.

Both only read what kerasmp's train step (`kerasmp.train_step.steps`, installed
by `compile`) returns:
`loss_scale` and `skipped_steps` in the logs, one record per step, and the
step's batch once `keep_batches` is on. Attaching them changes no value in
the logs (they only add keys of their own), like Keras's `TerminateOnNaN`.

- `LossScaleMonitor` keeps the loss scale of every step for plotting and can
  measure gradient underflow.
- `NonFiniteMonitor` records every skipped step and every non-finite loss or
  weight as an event, tells normal calibration overflows from a run that is
  stuck, names the layer that went non-finite, and can warn, stop, raise or
  move that layer to float32 and carry on. It only wires its units to
  `fit`: the classification rules (pure functions) in `_nonfinite.py`,
  locating and the fallback in `_nonfinite_fallback.py`, the wording and
  the JSON Lines log in `_nonfinite_messages.py`.

Length: two public callbacks, each with the Keras-convention docstring
(about 60 lines each) and argument checks; the logic of `NonFiniteMonitor`
lives in the `_nonfinite*` modules.
"""

import dataclasses
import inspect
import math
import numbers
import os
import threading
import warnings

import keras
import numpy as np

from kerasmp import _keras_internals as _ki
from kerasmp.callbacks import nonfinite_fallback as _nonfinite_fallback
from kerasmp.callbacks import nonfinite_messages as _nonfinite_messages
from kerasmp.callbacks import nonfinite_rules as _nonfinite
from kerasmp.callbacks.nonfinite_rules import KINDS  # noqa: F401 (re-export)
from kerasmp.callbacks.performance import PerformanceMonitor  # noqa: F401 (re-export)
from kerasmp.errors import NonFiniteError
from kerasmp.errors import NonFiniteWarning
from kerasmp.train_step import steps as _train_step

ACTIONS = ("warn", "stop", "raise", "fallback")


def _user_stacklevel():
    """The `stacklevel` that points a warning at the first frame outside
    Keras and kerasmp (the user's `fit` call), not at Keras's callback
    list."""
    frame = inspect.currentframe().f_back  # the caller of warnings.warn
    level = 1
    while frame is not None:
        name = frame.f_globals.get("__name__", "")
        if name.split(".")[0] not in ("keras", "kerasmp"):
            return level
        frame = frame.f_back
        level += 1
    return 1


def _warn(message, category=UserWarning):
    warnings.warn(message, category, stacklevel=_user_stacklevel())


def _needs_kerasmp_optimizer(monitor, optimizer):
    """The one-line warning when the model is not trained with
    `kerasmp.LossScaleOptimizer` (nothing then puts the scale in the logs);
    None when it is."""
    if _train_step.scaled(monitor.model):
        return None
    name = type(optimizer).__name__
    if isinstance(optimizer, keras.optimizers.LossScaleOptimizer):
        return (
            f"{type(monitor).__name__}: loss_scale and skipped_steps come from "
            "kerasmp.LossScaleOptimizer; this model uses Keras's own "
            "LossScaleOptimizer: compile with kerasmp.LossScaleOptimizer."
            "from_config(optimizer.get_config()) (same settings)."
        )
    if not _train_step.supported():
        return (
            f"{type(monitor).__name__}: logging the loss scale needs the "
            "TensorFlow or JAX backend (without NNX); nothing will be logged."
        )
    return (
        f"{type(monitor).__name__}: the optimizer ({name}) has no loss scale; "
        "`loss_scale` and `skipped_steps` will not be logged."
    )


class LossScaleMonitor(keras.callbacks.Callback):
    """Keeps the loss scale of every train step, and can measure underflow.

    A model compiled with `kerasmp.LossScaleOptimizer` logs `loss_scale`
    (the scale after each step) and `skipped_steps` (the cumulative number
    of steps skipped because the gradients were not finite) with or without
    this monitor: both are in the batch and epoch logs, hence in the
    progress bar, `History.history`, `CSVLogger` files and `TensorBoard`
    scalars (docs/monitoring.md). The monitor reads them from the logs into
    `trace` for `kerasmp.plotting.plot_loss_scale`. With another optimizer
    (Keras's own `keras.optimizers.LossScaleOptimizer` included: its config
    loads into kerasmp's class) it records nothing and says so in one
    warning.

    With `gradient_stats_every=N` the monitor also logs `grad_underflow`:
    every N steps (the first step, then every N-th), the fraction of gradient
    elements that are exactly zero in the mixed-precision gradients of that
    step's batch, computed at the loss scale after the step, where the
    float32 reference gradients are not (the `underflow` of
    `kerasmp.debug.gradient_report`, which does the measuring). It runs in
    `on_train_batch_end`, outside the compiled step, and changes no weight
    and no optimizer state; it costs about two extra forward and backward
    passes per measurement (and, on JAX, a compilation) and makes Keras
    dispatch batch callbacks synchronously. Steps between two measurements
    log the latest value; the epoch logs get the value of the last
    measurement. `grad_underflow` is written into the logs by the monitor,
    so `CSVLogger` and `TensorBoard` see it when they come after the
    monitor in the callback list (`History` always does). With
    `steps_per_execution=k` the batch of the execution's last step is used.
    Layers whose output depends on the compute dtype at random (dropout)
    make the mixed and float32 passes differ beyond underflow.

    Args:
        gradient_stats_every: None (default: off, no cost) or a positive
            integer N: log `grad_underflow` every N steps.

    Attributes:
        trace: list of `(step, loss_scale, skipped_steps)`, one per batch
            end (every step; with `steps_per_execution=k`, every k-th; steps
            counted from 0 over all `fit` calls; the scale and count after
            that step), for `kerasmp.plotting.plot_loss_scale`.
        initial_scale: the scale before the first step seen.
        initial_skipped: `skipped_steps` before the first step seen.
        underflow_trace: list of `(step, loss_scale, grad_underflow)`, one
            per measurement (with `gradient_stats_every`).

    Example:

    ```python
    monitor = LossScaleMonitor(gradient_stats_every=100)
    history = model.fit(x, y, epochs=3, callbacks=[monitor])
    history.history["loss_scale"]     # one value per epoch
    history.history["grad_underflow"]
    ```
    """

    # Nothing here needs to run before the next step: keep Keras's
    # asynchronous dispatch of batch callbacks (unless gradient statistics
    # are measured: they read the weights, which the next step changes).
    async_safe = True

    def __init__(self, gradient_stats_every=None):
        super().__init__()
        if gradient_stats_every is not None and (
            isinstance(gradient_stats_every, (bool, np.bool_))
            or not isinstance(gradient_stats_every, numbers.Integral)
            or gradient_stats_every < 1
        ):
            raise ValueError(
                "`gradient_stats_every` must be None (off) or a positive "
                "integer (measure every N steps); received "
                f"gradient_stats_every={gradient_stats_every!r}."
            )
        self.gradient_stats_every = (
            None if gradient_stats_every is None else int(gradient_stats_every)
        )
        if self.gradient_stats_every is not None:
            self.async_safe = False
        self.underflow_trace = []
        self._underflow = None
        self._last_measured = None
        self._underflow_warned = False
        self.trace = []
        self.initial_scale = None
        self.initial_skipped = None
        self._active = False
        self._warned = False
        self._lock = threading.Lock()
        self._next_step = 0
        self._epoch_start = 0
        self._epoch_batches = 0

    def on_train_begin(self, logs=None):
        self._active = False
        message = _needs_kerasmp_optimizer(self, self.model.optimizer)
        if message is not None:
            self._warn_once(message)
            return
        self._active = True
        if self.gradient_stats_every is not None:
            _train_step.keep_batches(self.model)
        if self.initial_skipped is None:
            self.initial_scale, self.initial_skipped = (
                _train_step.optimizer_state(self.model.optimizer)
            )

    def on_epoch_begin(self, epoch, logs=None):
        self._epoch_start = self._next_step
        self._epoch_batches = 0

    def on_train_batch_end(self, batch, logs=None):
        if not self._active or not logs or "loss_scale" not in logs:
            return
        with self._lock:
            self._epoch_batches = max(self._epoch_batches, batch + 1)
            self.trace.append(
                (
                    self._epoch_start + batch,
                    float(logs["loss_scale"]),
                    int(logs.get("skipped_steps", 0)),
                )
            )
        if self.gradient_stats_every is not None:
            self._gradient_stats(self._epoch_start + batch, logs)

    def on_epoch_end(self, epoch, logs=None):
        self._next_step = self._epoch_start + self._epoch_batches
        self.trace.sort()
        if self._underflow is not None and logs is not None:
            logs["grad_underflow"] = self._underflow

    def _gradient_stats(self, step, logs):
        """Measures `grad_underflow` on this step's batch when due."""
        due = (
            self._last_measured is None
            or step - self._last_measured >= self.gradient_stats_every
        )
        if due:
            value = self._measure_underflow(float(logs["loss_scale"]))
            if value is not None:
                self._last_measured = step
                self._underflow = value
                self.underflow_trace.append(
                    (step, float(logs["loss_scale"]), value)
                )
        if self._underflow is not None:
            logs["grad_underflow"] = self._underflow

    def _measure_underflow(self, scale):
        from kerasmp.debug.gradients import gradient_report

        batch = _train_step.batch(self.model)
        if batch is None:
            self._warn_underflow("the step's batch is not available")
            return None
        x, y, sample_weight = batch
        if y is None:
            self._warn_underflow("the batch has no targets")
            return None
        if not math.isfinite(scale) or scale <= 0:
            return None
        _ki.jax_state_sync(self.model)
        try:
            report = gradient_report(
                self.model,
                x,
                y,
                scales=[scale],
                sample_weight=sample_weight,
            )
        except Exception as e:  # measuring must never break training
            self._warn_underflow(f"{type(e).__name__}: {e}")
            return None
        return float(report.rows[0].underflow)

    def _warn_underflow(self, why):
        if not self._underflow_warned:
            self._underflow_warned = True
            _warn(f"LossScaleMonitor: grad_underflow not measured ({why}).")

    def _warn_once(self, message):
        if not self._warned:
            _warn(message)
            self._warned = True


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
      compute, rebuild the train function and continue; the event lists the
      layer under `fallback_layers`. If no layer was located, or it already
      computes in float32, or the weights are already non-finite, it stops
      instead and says why.

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
        self._next_step = 0  # steps counted over all `fit` calls
        self._log_failed = False

    # ------------------------------------------------------------ callbacks

    def on_train_begin(self, logs=None):
        model = self.model
        optimizer = model.optimizer
        scaled = _train_step.scaled(model)
        if not scaled and isinstance(
            optimizer, keras.optimizers.LossScaleOptimizer
        ):
            _warn(_needs_kerasmp_optimizer(self, optimizer))
        if self.locate:
            _train_step.keep_batches(model)
        self._rules = _nonfinite.Rules(patience=self.patience, scaled=False)
        self._state = _nonfinite.State()
        self._epoch = 0
        self._batch_begin = 0
        self._reset_to = None  # a loss scale to restore after this batch
        if scaled:
            self._rules = _nonfinite.Rules(
                patience=self.patience,
                scaled=True,
                dynamic=bool(getattr(optimizer, "dynamic", True)),
                min_scale=float(getattr(optimizer, "min_scale", 1.0) or 0),
            )
            scale, skipped = _train_step.optimizer_state(optimizer)
            self._state = _nonfinite.start(
                self._rules,
                scale=scale,
                skipped=skipped,
                fresh=int(_train_step.read(optimizer.iterations)) == 0,
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
            self._state, verdict = _nonfinite.classify(
                self._state, row, self._rules
            )
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
            self._state, verdict = _nonfinite.classify_logged_loss(
                self._state, loss
            )
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
        variable = _nonfinite_fallback.first_nonfinite_weight(self.model)
        self._state, verdict = _nonfinite.classify_weights(
            self._state, variable
        )
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
        run, fields = _nonfinite.describe(
            self._state.run, event, merge_run=verdict.merge_run
        )
        self._state = dataclasses.replace(self._state, run=run)
        event.update(fields)
        self._finish(event, actionable=verdict.actionable)

    def _on_nonfinite_loss(self, event, offsets):
        self._locate(event, self._state.scale or 1.0, offsets)
        event["overflow_in"] = "forward"
        bad = self._state.weights_bad
        variable = (
            None
            if bad
            else _nonfinite_fallback.first_nonfinite_weight(self.model)
        )
        event["weights_finite"] = variable is None and not bad
        self._state, weights = _nonfinite.classify_weights(
            self._state, variable
        )
        if weights is None:
            self._finish(event, actionable=True)
            return
        # The update went through and broke the weights: act once, on that.
        self._finish(event, actionable=False)
        self._finish(
            _nonfinite.weights_event(event, variable),
            actionable=weights.actionable,
        )

    def _event(self, verdict, step, batch, loss):
        return _nonfinite.new_event(
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
        report, fields = _nonfinite_fallback.locate(
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
        event["message"] = _nonfinite_messages.message(
            event, self.patience, self._rules.min_scale, fallback_failed
        )
        self.events.append(event)
        self._write(event)
        if not actionable:
            return
        if event["action"] in ("warn", "stop") or event.get("fallback_layers"):
            _warn(event["message"], NonFiniteWarning)
        if event["action"] == "stop":
            self.model.stop_training = True
        if event["action"] == "raise":
            raise NonFiniteError(event["message"], event=event, report=report)

    def _fallback(self, event, report):
        """Moves the located layer to float32; returns why not, or None."""
        result = _nonfinite_fallback.fall_back(
            event, report, self._state, self._rules
        )
        if result.refusal is not None:
            return result.refusal
        # The layer's compute dtype changed: trace the step again.
        _ki.jax_state_sync(self.model)
        self.model.make_train_function(force=True)
        self.fallbacks.append(result.layer)
        event["fallback_layers"] = [result.layer]
        if result.reset_to is not None:
            event["loss_scale_reset_to"] = result.reset_to
            self._reset_to = result.reset_to
        self._state = result.state
        return None

    def _reset_scale(self, value):
        _ki.jax_state_sync(self.model)
        try:
            _nonfinite_fallback.reset_loss_scale(self.model.optimizer, value)
        except Exception as e:  # never break training over this
            _warn(_nonfinite_messages.reset_failed_message(e), NonFiniteWarning)
            return
        self._state = _nonfinite.after_scale_reset(self._state, value)

    def _write(self, event):
        if self.log_file is None or self._log_failed:
            return
        try:
            _nonfinite_messages.append_jsonl(self.log_file, event)
        except OSError as e:
            # Losing the log must not lose the run: events stay in memory.
            self._log_failed = True
            _warn(
                _nonfinite_messages.log_failed_message(self.log_file, e),
                NonFiniteWarning,
            )
