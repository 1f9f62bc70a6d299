"""`LossScaleMonitor`: the loss scale of every train step, for plotting, and
the gradient underflow of a step's batch when asked.

It only reads what kerasmp's train step (`kerasmp.train_step`,
installed by `compile`) returns: `loss_scale` and `skipped_steps` in the
logs, and the step's batch once `keep_batches` is on. Attaching it changes no
value in the logs (it only adds keys of its own), like Keras's
`TerminateOnNaN`.
"""

import math
import numbers
import threading

import keras
import numpy as np

from kerasmp import _keras_internals as _ki
from kerasmp import train_step as _train_step
from kerasmp._utils.warn import warn
from kerasmp.callbacks.shared import needs_kerasmp_optimizer
from kerasmp.debug.gradients import gradient_report


class LossScaleMonitor(keras.callbacks.Callback):
    """Keeps the loss scale of every train step, and can measure underflow.

    A model compiled with `kerasmp.LossScaleOptimizer` logs `loss_scale`
    (the scale after each step) and `skipped_steps` (the cumulative number
    of steps skipped because the gradients were not finite) with or without
    this monitor: both are in the batch and epoch logs, hence in the
    progress bar, `History.history`, `CSVLogger` files and `TensorBoard`
    scalars (docs/monitoring.md). The monitor reads them from the logs into
    `trace` for `kerasmp.plotting.plot_loss_scale`. With another optimizer
    (Keras's own `keras.optimizers.LossScaleOptimizer` included:
    `kerasmp.LossScaleOptimizer(optimizer)` takes it, with its settings) it
    records nothing and says so in one warning. TensorFlow, JAX and
    PyTorch.

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
        message = needs_kerasmp_optimizer(self, self.model.optimizer)
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
            warn(f"LossScaleMonitor: grad_underflow not measured ({why}).")

    def _warn_once(self, message):
        if not self._warned:
            warn(message)
            self._warned = True
