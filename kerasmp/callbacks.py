"""Callbacks that show the loss scale and explain every inf/NaN event.

- `LossScaleMonitor` puts `loss_scale` and `skipped_steps` into the batch and
  epoch logs, so they reach the progress bar, `History.history`, `CSVLogger`
  and `TensorBoard` whatever the order of the callbacks.
- `NonFiniteMonitor` records every skipped step and every non-finite loss or
  weight as an event, tells normal calibration overflows from a run that is
  stuck, names the layer that went non-finite, and can warn, stop, raise or
  move that layer to float32 and carry on.
"""

import json
import math
import numbers
import os
import threading
import warnings

import keras
import numpy as np
from keras import ops

from kerasmp import _step_tap
from kerasmp.debug import find_nonfinite
from kerasmp.errors import NonFiniteError
from kerasmp.errors import NonFiniteWarning
from kerasmp.performance import PerformanceMonitor  # noqa: F401 (re-export)

ACTIONS = ("warn", "stop", "raise", "fallback")
KINDS = (
    "calibration",
    "overflow",
    "stuck",
    "nonfinite_loss",
    "nonfinite_weights",
)


class LossScaleMonitor(keras.callbacks.Callback):
    """Adds `loss_scale` and `skipped_steps` to the training logs.

    `loss_scale` is the optimizer's loss scale after each step and
    `skipped_steps` the cumulative number of steps skipped because the
    gradients were not finite. Both appear in the batch logs and in the epoch
    logs (value at the end of the epoch), hence in the progress bar,
    `History.history`, `CSVLogger` files and `TensorBoard` scalars, wherever
    the monitor sits in the callback list. The values are read from the
    optimizer's variables inside the train step and converted with the rest
    of the logs: no extra device-to-host transfer per step.

    Works with `kerasmp.optimizer.LossScaleOptimizer` and with Keras's own
    `keras.optimizers.LossScaleOptimizer` (whose skipped steps are counted
    from its `iterations`). With an optimizer that has no loss scale it logs
    nothing and warns once.

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
        trace: list of `(step, loss_scale, skipped_steps)`, one per train
            step (steps counted from 0 over all `fit` calls; the scale and
            count after that step), for `kerasmp.plotting.plot_loss_scale`.
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
        self._tap = None
        self._warned = False
        self._lock = threading.Lock()
        self._next_step = 0
        self._epoch_start = 0
        self._epoch_batches = 0

    def on_train_begin(self, logs=None):
        self._tap = None
        optimizer = self.model.optimizer
        if not _step_tap.has_loss_scale(optimizer):
            self._warn_once(
                "LossScaleMonitor: the optimizer "
                f"({type(optimizer).__name__}) has no loss scale; "
                "`loss_scale` and `skipped_steps` will not be logged."
            )
            return
        self._tap = _step_tap.StepTap.join(
            self.model,
            self,
            self.params,
            publish=True,
            keep_batch=self.gradient_stats_every is not None,
        )
        if self._tap is not None and self.initial_skipped is None:
            self.initial_skipped = self._tap.initial_skipped
            self.initial_scale = self._tap.initial_scale
        if self._tap is None:
            self._warn_once(
                "LossScaleMonitor: logging the loss scale needs the TensorFlow "
                "or JAX backend (without NNX); nothing will be logged."
            )

    def on_epoch_begin(self, epoch, logs=None):
        self._epoch_start = self._next_step
        self._epoch_batches = 0
        if self._tap is not None:
            self._tap.new_epoch()

    def on_train_batch_begin(self, batch, logs=None):
        if self._tap is not None:
            self._tap.prepare()

    def on_train_batch_end(self, batch, logs=None):
        if self._tap is None or not logs or "loss_scale" not in logs:
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
        from kerasmp.gradients import gradient_report

        batch = self._tap.batch()
        if batch is None:
            self._warn_underflow("the step's batch is not available")
            return None
        x, y, sample_weight = batch
        if y is None:
            self._warn_underflow("the batch has no targets")
            return None
        if not math.isfinite(scale) or scale <= 0:
            return None
        _sync_jax_state(self.model)
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
            warnings.warn(
                f"LossScaleMonitor: grad_underflow not measured ({why}).",
                stacklevel=3,
            )

    def on_train_end(self, logs=None):
        if self._tap is not None:
            self._tap.leave(self)
            self._tap = None

    def _warn_once(self, message):
        if not self._warned:
            warnings.warn(message, stacklevel=3)
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
        self.events = []
        self.trace = []
        self.initial_scale = None
        self.initial_skipped = None
        self.fallbacks = []
        self.last_report = None
        self._tap = None
        self._next_step = 0
        self._log_failed = False

    # ------------------------------------------------------------ callbacks

    def on_train_begin(self, logs=None):
        model = self.model
        optimizer = model.optimizer
        self._tap = _step_tap.StepTap.join(
            model, self, self.params, keep_batch=self.locate
        )
        self._scaled = self._tap is not None and _step_tap.has_loss_scale(
            optimizer
        )
        self._last_consecutive = 0
        self._base = 0
        self._run = None
        self._stuck = False
        self._weights_bad = False
        self._calibrating = False
        self._loss_ok = True
        self._epoch = 0
        self._batch_begin = 0
        self._scale = None
        self._skipped = 0
        self._reset_to = None
        if self._scaled:
            self._scale = self._tap.initial_scale
            if self.initial_scale is None:
                self.initial_scale = self._scale
            self._min_scale = float(getattr(optimizer, "min_scale", 1.0) or 0)
            self._dynamic = bool(getattr(optimizer, "dynamic", True))
            self._skipped = self._tap.initial_skipped
            if self.initial_skipped is None:
                self.initial_skipped = self._skipped
            fresh = int(_step_tap.read(optimizer.iterations)) == 0
            self._calibrating = self._dynamic and fresh and self._skipped == 0

    def on_epoch_begin(self, epoch, logs=None):
        self._epoch = epoch
        self._loss_ok = True
        if self._tap is not None:
            self._tap.new_epoch()

    def on_train_batch_begin(self, batch, logs=None):
        self._batch_begin = batch
        if self._tap is not None:
            self._tap.prepare()

    def on_train_batch_end(self, batch, logs=None):
        logs = logs or {}
        loss = logs.get("loss")
        rows = self._tap.rows() if self._tap is not None else []
        if not rows:  # no per-step records: a step count from the batches
            self._next_step += max(1, batch - self._batch_begin + 1)
        for i, row in enumerate(rows):
            step = self._next_step
            self._next_step += 1
            # TensorFlow keeps the batch of an execution's last step only:
            # it stands for the steps of the run of skips it ends.
            trailing = all(r["skipped"] for r in rows[i:])
            self._on_row(
                step,
                self._batch_begin + i,
                row,
                loss,
                offsets=(len(rows) - 1 - i, 0 if trailing else None),
            )
        if (
            self._loss_ok
            and isinstance(loss, (int, float))
            and not math.isfinite(loss)
        ):
            # A non-finite loss no record flagged (a custom train step).
            self._loss_ok = False
            self._on_nonfinite_loss(
                self._next_step - 1, batch, loss, offsets=(0, None)
            )
        if self._reset_to is not None:
            self._reset_scale(self._reset_to)
            self._reset_to = None

    def on_epoch_end(self, epoch, logs=None):
        if self._weights_bad:
            return
        variable = _first_nonfinite_weight(self.model)
        if variable is None:
            return
        self._weights_bad = True
        event = self._event(
            "nonfinite_weights", self._next_step - 1, None, self._scale, None
        )
        event["variable"] = variable
        self._maybe_locate(event, self._scale, (0, None), keep_variable=True)
        self._finish(event, actionable=True)

    def on_train_end(self, logs=None):
        if self._tap is not None:
            self._tap.leave(self)
            self._tap = None

    # -------------------------------------------------------------- events

    def _on_row(self, step, batch, row, loss, offsets):
        scale_before = self._scale
        if self._scaled:
            self._scale = row["scale"]
            self._skipped = row["total"]
            self.trace.append((step, self._scale, self._skipped))
        if row["skipped"]:
            self._on_skip(step, batch, row, scale_before, loss, offsets)
            return
        self._end_skip_run()
        if row["forward"] and self._loss_ok:
            # The update went through with a non-finite loss.
            self._loss_ok = False
            self._on_nonfinite_loss(step, batch, loss, offsets)

    def _on_skip(self, step, batch, row, scale_before, loss, offsets):
        consecutive = row["consecutive"]
        if consecutive <= self._last_consecutive:
            self._base = 0  # a new run of skips (the optimizer's count)
        self._last_consecutive = consecutive
        run_length = max(1, consecutive - self._base)
        first_in_run = run_length == 1 or self._run is None
        if first_in_run:
            self._run = {
                "forward": False,
                "layer": None,
                "variable": None,
                "all_nonfinite": None,
                "start_scale": scale_before,
            }
        forward = row["forward"]
        if forward:
            # The forward pass overflowed: no loss scale can fix that.
            self._calibrating = False
        at_min = self._dynamic and scale_before <= self._min_scale
        if self._calibrating and not at_min:
            kind = "calibration"
        elif at_min or run_length >= self.patience:
            kind = "stuck"
        else:
            kind = "overflow"
        event = self._event(kind, step, batch, scale_before, loss)
        event["consecutive_skips"] = run_length
        event["at_min_scale"] = at_min
        event["loss_finite"] = not forward
        actionable = kind == "stuck" and not self._stuck
        if kind == "stuck":
            self._stuck = True
        if actionable or (kind == "overflow" and first_in_run):
            self._maybe_locate(event, scale_before, offsets)
        self._describe(event, merge_run=kind == "stuck")
        self._finish(event, actionable=actionable)

    def _describe(self, event, merge_run=False):
        """Sets where the overflow happened (forward or backward pass) and
        whether every gradient was non-finite; keeps the run's facts."""
        run = self._run
        forward = event.get("loss_finite") is False or bool(event.get("layer"))
        all_bad = event.get("all_gradients_nonfinite")
        if all_bad is None and event.get("loss_finite") is False:
            all_bad = True  # d(non-finite loss)/dw is non-finite for every w
        if run is not None:
            run["forward"] = run["forward"] or forward
            if run["layer"] is None and event.get("layer"):
                run["layer"] = event["layer"]
            if run["variable"] is None and event.get("variable"):
                run["variable"] = event["variable"]
            if run["all_nonfinite"] is None:
                run["all_nonfinite"] = all_bad
            if merge_run:  # the stuck event says what the run showed
                forward = run["forward"]
                if run["forward"]:
                    event["loss_finite"] = False
                if not event.get("layer") and run["layer"]:
                    event["layer"] = run["layer"]
                if not event.get("variable") and run["variable"]:
                    event["variable"] = run["variable"]
                if all_bad is None:
                    all_bad = run["all_nonfinite"]
        event["overflow_in"] = "forward" if forward else "backward"
        event["all_gradients_nonfinite"] = all_bad
        if all_bad:
            event["variable"] = None

    def _end_skip_run(self):
        self._calibrating = False
        self._last_consecutive = 0
        self._base = 0
        self._run = None
        self._stuck = False

    def _on_nonfinite_loss(self, step, batch, loss, offsets):
        event = self._event("nonfinite_loss", step, batch, self._scale, loss)
        event["loss_finite"] = False
        self._maybe_locate(event, self._scale or 1.0, offsets)
        event["overflow_in"] = "forward"
        variable = (
            None if self._weights_bad else _first_nonfinite_weight(self.model)
        )
        event["weights_finite"] = variable is None and not self._weights_bad
        if variable is None:
            self._finish(event, actionable=True)
            return
        # The update went through and broke the weights: act once, on that.
        self._weights_bad = True
        self._finish(event, actionable=False)
        weights = dict(event, kind="nonfinite_weights", variable=variable)
        weights.pop("weights_finite")
        self._finish(weights, actionable=True)

    def _event(self, kind, step, batch, scale, loss):
        return {
            "step": int(step),
            "epoch": int(self._epoch),
            "batch": batch,
            "kind": kind,
            "loss_scale": scale,
            "next_loss_scale": self._scale,
            "skipped_steps": self._skipped if self._scaled else None,
            "loss": loss,
            "layer": None,
            "variable": None,
            "action": None,
        }

    def _maybe_locate(self, event, scale, offsets, keep_variable=False):
        if not self.locate:
            return
        batch = None
        if self._tap is not None:
            for offset in offsets:
                if offset is not None:
                    batch = self._tap.batch(offset)
                    if batch is not None:
                        break
        if batch is None:
            event["locate_error"] = "the offending batch is not available"
            return
        x, y, sample_weight = batch
        model = self.model
        if getattr(model, "_compile_loss", None) is None:
            y = None
        _sync_jax_state(model)
        try:
            report = find_nonfinite(
                model,
                x,
                y,
                sample_weight=sample_weight,
                loss_scale=scale or 1.0,
            )
        except Exception as e:  # locating must never break training
            event["locate_error"] = f"{type(e).__name__}: {e}"
            return
        self.last_report = report
        event["layer"] = report.layer
        grads = [
            r.grad_finite for r in report.rows if r.grad_finite is not None
        ]
        if grads:
            event["all_gradients_nonfinite"] = not any(grads)
        if report.loss is not None and not math.isfinite(report.loss):
            event["loss_finite"] = False
        if not keep_variable or event.get("variable") is None:
            event["variable"] = report.variable

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
        event["message"] = _diagnosis(event, self, fallback_failed)
        self.events.append(event)
        self._write(event)
        if not actionable:
            return
        if event["action"] in ("warn", "stop") or event.get("fallback_layers"):
            warnings.warn(event["message"], NonFiniteWarning, stacklevel=3)
        if event["action"] == "stop":
            self.model.stop_training = True
        if event["action"] == "raise":
            if self._tap is not None:
                self._tap.uninstall()  # leave the model as fit found it
                self._tap = None
            raise NonFiniteError(event["message"], event=event, report=report)

    def _fallback(self, event, report):
        """Moves the located layer to float32; returns why not, or None."""
        path = event.get("layer")
        if path is None or report is None:
            return "no layer output was non-finite on the offending batch"
        if event["kind"] == "nonfinite_weights" or self._weights_bad:
            return "the weights are already non-finite"
        layer = report.layer_object(path)
        targets = [layer] + list(layer._flatten_layers(include_self=False))
        if any(
            keras.backend.standardize_dtype(v.dtype) != "float32"
            for t in targets
            for v in t.weights
            if v.trainable
        ):
            return f"layer {path!r} has variables that are not float32"
        if all(t.compute_dtype == "float32" for t in targets):
            return f"layer {path!r} already computes in float32"
        for t in targets:
            t.dtype_policy = "float32"
        self._tap.rebuild(dirty=True)
        self._tap.prepare()
        self.fallbacks.append(path)
        event["fallback_layers"] = [path]
        if self._scaled and self._dynamic:
            # The run of skips drove the scale down for a reason now gone:
            # restart from the scale before the run (growth counter reset).
            start = (self._run or {}).get("start_scale") or self._scale
            event["loss_scale_reset_to"] = float(start)
            self._reset_to = float(start)
        # A new start for the layer: forget the run of skips.
        self._base = self._last_consecutive
        self._stuck = False
        self._run = None
        return None

    def _reset_scale(self, value):
        """Puts the optimizer's scale to `value` and restarts its growth
        counter (and kerasmp's hysteresis budget)."""
        optimizer = self.model.optimizer
        _sync_jax_state(self.model)
        try:
            optimizer.dynamic_scale.assign(value)
            optimizer.step_counter.assign(0)
            budget = getattr(optimizer, "hysteresis_budget", None)
            if isinstance(budget, keras.Variable):
                budget.assign(optimizer.hysteresis)
        except Exception as e:  # never break training over this
            warnings.warn(
                f"kerasmp.NonFiniteMonitor: could not reset the loss scale "
                f"after the fallback ({type(e).__name__}: {e}).",
                NonFiniteWarning,
                stacklevel=3,
            )
            return
        self._scale = value
        # Skips before the next applied update back the scale off from there:
        # calibration again, not trouble.
        self._calibrating = True

    def _write(self, event):
        if self.log_file is None or self._log_failed:
            return
        try:
            with open(self.log_file, "a", encoding="utf-8") as f:
                f.write(json.dumps(_jsonable(event)) + "\n")
        except OSError as e:
            # Losing the log must not lose the run: events stay in memory.
            self._log_failed = True
            warnings.warn(
                f"kerasmp.NonFiniteMonitor: cannot write to log_file="
                f"{self.log_file!r} ({e.strerror or e}); events are kept in "
                "`monitor.events` only from now on.",
                NonFiniteWarning,
                stacklevel=3,
            )


def _diagnosis(event, monitor, fallback_failed):
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
            why = f"the loss scale is at its minimum ({monitor._min_scale:g})"
        else:
            why = (
                f"{event.get('consecutive_skips')} consecutive steps were "
                f"skipped (patience {monitor.patience})"
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
        text += (
            f" Fallback: {', '.join(event['fallback_layers'])} now computes "
            "in float32; training continues"
        )
        if event.get("loss_scale_reset_to") is not None:
            text += (
                " with the loss scale reset to "
                f"{event['loss_scale_reset_to']:g} (its value before the "
                "skipped steps)"
            )
        text += "."
    elif fallback_failed:
        text += f" Fallback impossible ({fallback_failed}): stopping."
    return "kerasmp.NonFiniteMonitor: " + text


def _jsonable(event):
    out = {}
    for key, value in event.items():
        if isinstance(value, float) and not math.isfinite(value):
            value = str(value)
        out[key] = value
    return out


def _sync_jax_state(model):
    if keras.backend.backend() == "jax" and hasattr(model, "jax_state_sync"):
        model.jax_state_sync()


def _first_nonfinite_weight(model):
    """Path of the first float weight holding inf/NaN, or None (one sync)."""
    _sync_jax_state(model)
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
    flags = _step_tap.read(flags)
    if flags.all():
        return None
    return weights[int((~flags).argmax())].path
