"""The one place kerasmp changes Keras's train step, installed by `compile`.

On TensorFlow, PyTorch and JAX (without NNX), `compile` calls
`install(model)`, which sets two instance attributes on the model (four on
PyTorch with Keras 3.15, below); nothing adds or removes them afterwards (a
callback never does):

- `train_step`: Keras's step, then, while the optimizer is a
  `kerasmp.LossScaleOptimizer` and skipped the step, every variable the step
  wrote is put back: the non-trainable ones the forward pass assigned
  (batch-norm moving statistics, seed states) and every metric variable;
  `loss_scale` (the scale after the step) and `skipped_steps` (the
  optimizer's cumulative count) join the logs. With any optimizer the step
  makes one record (`ROW_FIELDS`; never skipped and scale NaN without
  kerasmp's optimizer) under a private key.
- `make_train_function`: Keras's, then a host-side wrapper that takes the
  private entries out of the logs (so the progress bar, `History`,
  `CSVLogger` and `TensorBoard` see only `loss_scale` and `skipped_steps`)
  and keeps them for `rows(model)` and `batch(model)`.
- On PyTorch with Keras 3.15, also `make_test_function` and
  `make_predict_function`: Keras's one-step functions, run once per batch
  of an execution, so that `evaluate`, `predict` and `fit`'s validation
  take `steps_per_execution > 1`, which Keras 3.15 refuses there (Keras
  3.16 runs them itself, and kerasmp leaves them to it:
  `kerasmp.train_step.torch`).

One module per backend holds the step (`tensorflow`, `jax`, `torch`), as
Keras keeps one `train_step` per backend; `logs` holds what they share.

Logs on a skipped step (docs/monitoring.md): `loss` and the metrics are
those of the steps the optimizer applied since the metrics were last reset
(the epoch's start); a skipped step's own values are dropped. While no step
of the epoch has been applied yet there is nothing to average, and the logs
carry the values computed on the latest (skipped) step, finite or not: a
run whose every step is skipped logs its real (or NaN) loss, never the 0.0
of an empty mean.

Monitors only read: the logs, `rows(model)`, and `batch(model)` once
`keep_batches(model)` (the one switch, used by `NonFiniteMonitor(locate=
True)` and `LossScaleMonitor(gradient_stats_every=...)`) has been called.
"""

import keras

from kerasmp import _keras_internals as _ki
from kerasmp._utils.arrays import to_numpy
from kerasmp.optimizer.loss_scale_optimizer import LossScaleOptimizer
from kerasmp.train_step.logs import ROW_FIELDS
from kerasmp.train_step.logs import SCALE_KEY
from kerasmp.train_step.logs import SKIPPED_KEY

__all__ = [
    "ROW_FIELDS",
    "SCALE_KEY",
    "SKIPPED_KEY",
    "batch",
    "install",
    "keep_batches",
    "optimizer_state",
    "rows",
    "scaled",
    "supported",
]

_ATTR = "_kerasmp_steps"  # the model's `Steps`, in its __dict__


def _steps_class():
    """This backend's `Steps` class, or None where the step is not
    wrapped."""
    backend = keras.backend.backend()
    if backend == "tensorflow":
        from kerasmp.train_step.tensorflow import TensorFlowSteps

        return TensorFlowSteps
    if backend == "jax" and not keras.config.is_nnx_enabled():
        from kerasmp.train_step.jax import JaxSteps

        return JaxSteps
    if backend == "torch":
        from kerasmp.train_step.torch import TorchSteps

        return TorchSteps
    return None


def supported():
    """Whether train steps can be wrapped on this backend (TensorFlow,
    PyTorch; JAX without NNX)."""
    return _steps_class() is not None


def install(model):
    """Installs the train step on `model` (called by `compile`; once per
    model: the step reads `model.optimizer` when it is traced)."""
    cls = _steps_class()
    if cls is not None and _ATTR not in model.__dict__:
        steps = cls(model)
        object.__setattr__(model, _ATTR, steps)
        for name in steps.replaces:
            object.__setattr__(model, name, getattr(steps, name))


def scaled(model):
    """Whether the train step of `model` logs `loss_scale` and
    `skipped_steps` and undoes skipped steps (kerasmp's train step with
    `kerasmp.LossScaleOptimizer`)."""
    return _ATTR in model.__dict__ and isinstance(
        getattr(model, "optimizer", None), LossScaleOptimizer
    )


def keep_batches(model):
    """Makes the train step keep each step's batch for `batch(model)` (the
    one opt-in: a reference to the batch on TensorFlow, the items the
    iterator yields on JAX). Returns whether batches are kept (not under a
    multi-replica strategy)."""
    steps = model.__dict__.get(_ATTR)
    if steps is None or not steps.can_keep_batches():
        return False
    if not steps.keep_batch:
        steps.keep_batch = True
        if model.train_function is not None:
            _ki.jax_state_sync(model)
            model.make_train_function(force=True)
    return True


def rows(model):
    """The records of the last execution's steps, in order: dicts with the
    keys of `ROW_FIELDS` (Python numbers); empty without kerasmp's train
    step. One transfer from the device."""
    steps = model.__dict__.get(_ATTR)
    return [] if steps is None else steps.rows()


def batch(model, offset=0):
    """The batch of a step of the last execution as `(x, y, sample_weight)`,
    or None when it is not kept (see `keep_batches`). `offset` counts back
    from the execution's last step; TensorFlow keeps the last step's only."""
    steps = model.__dict__.get(_ATTR)
    return None if steps is None else steps.batch(offset)


def optimizer_state(optimizer):
    """`(loss scale, total skipped steps)` of a `kerasmp.LossScaleOptimizer`
    now (its initial values before it is built)."""
    if not optimizer.built:
        return float(optimizer.initial_scale), 0
    state = optimizer.read_state(to_numpy)
    return float(state.scale), int(state.total_skipped)
