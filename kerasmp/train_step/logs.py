"""What every backend's train step adds to Keras's logs, and the records it
keeps for the monitors.

`Steps` is the part of kerasmp's train step that does not depend on the
backend: the logs of a step (`loss_scale`, `skipped_steps`, and honest
metrics on a skipped step), one record per step (`ROW_FIELDS`) and reading
the records back as Python numbers. Each backend's module
(`kerasmp.train_step.tensorflow`, `kerasmp.train_step.jax`) subclasses it
with the step itself, the undo of a skipped step and the train function;
`HostLoopSteps` holds what JAX's and PyTorch's, which loop over the steps
of an execution in Python, share.
"""

import functools

import keras
from keras import ops

from kerasmp import _keras_internals as _ki
from kerasmp._utils.arrays import to_numpy
from kerasmp.optimizer.loss_scale_optimizer import LossScaleOptimizer
from kerasmp.optimizer.scale_rule import ScaleState

SCALE_KEY = "loss_scale"
SKIPPED_KEY = "skipped_steps"
ROW_FIELDS = ("skipped", "consecutive", "total", "scale", "forward")
ROW_KEY = "_kerasmp_row"
BATCH_KEY = "_kerasmp_batch"


def scale_state(model, value_of):
    """The loss-scale state after the step: the optimizer's, read with
    `value_of(variable)`, or a never-skipped state with a NaN scale when the
    optimizer is not `kerasmp.LossScaleOptimizer`."""
    optimizer = model.optimizer
    if isinstance(optimizer, LossScaleOptimizer):
        return optimizer.read_state(value_of)
    zero = ops.array(0, "int32")
    return ScaleState(
        scale=ops.array(float("nan")), counter=zero, budget=zero,
        total_skipped=zero, consecutive=zero, skipped=ops.array(False),
    )


def add_scale(logs, state):
    """`loss_scale` (the scale after the step) and `skipped_steps` (the
    cumulative count) into `logs`."""
    logs[SCALE_KEY] = ops.cast(state.scale, "float32")
    logs[SKIPPED_KEY] = state.total_skipped
    return logs


def nonfinite_now(before, after):
    """Whether a float value that was finite before is not after."""
    flags = [
        ops.any(
            ops.logical_and(
                ops.logical_not(ops.isfinite(a)), ops.isfinite(b)
            )
        )
        for b, a in zip(before, after)
        if keras.backend.is_float_dtype(
            keras.backend.standardize_dtype(b.dtype)
        )
    ]
    return ops.any(ops.stack(flags)) if flags else ops.array(False)


def honest_logs(logs, fresh, skipped, count):
    """The logs of a step: Keras's, or on a skipped step the metrics without
    it (`fresh`), unless no step has been applied since the metrics were
    reset (`count`, the loss tracker's count after the undo, is 0)."""
    drop = skipped if count is None else ops.logical_and(skipped, count > 0)
    for k in logs:
        if k in fresh:
            logs[k] = ops.where(drop, fresh[k], logs[k])
    return logs


def record(state, forward):
    """One step's record: the `ROW_FIELDS` as a float32 vector."""
    return ops.stack(
        [
            ops.cast(value, "float32")
            for value in (
                state.skipped,
                state.consecutive,
                state.total_skipped,
                state.scale,
                forward,
            )
        ]
    )


def as_row(values):
    """A record read back: a dict of Python numbers keyed by `ROW_FIELDS`."""
    row = dict(zip(ROW_FIELDS, (float(v) for v in values)))
    row["skipped"] = row["skipped"] > 0
    row["forward"] = row["forward"] > 0
    row["consecutive"] = int(row["consecutive"])
    row["total"] = int(row["total"])
    return row


class Steps:
    """kerasmp's train step of one model and what it keeps for monitors.

    A backend subclass implements `train_step`, `_train_function` (the
    host-side train function of one build), `_records` (the last
    execution's records as arrays) and `batch`.

    Args:
        model: The compiled `keras.Model`.
    """

    # The methods `install` sets as the model's instance attributes.
    replaces = ("train_step", "make_train_function")

    def __init__(self, model):
        self.model = model
        self.original = model.__dict__.get("train_step")  # a user override
        # Keras's step, resolved here: inside `torch.compile` the class
        # attribute read back through the model finds kerasmp's own
        # instance attribute (the step then called itself).
        self._class_step = type(model).train_step
        self.keep_batch = False
        self.spe = 1
        self._rows = None

    def make_train_function(self, force=False):
        """Keras's `make_train_function`, wrapped by the backend's
        host-side function, which takes kerasmp's records out of the logs
        and keeps them."""
        model = self.model
        if model.train_function is not None and not force:
            return model.train_function

        # A new function object for every build: a traced function keeps
        # the trace of one it has seen, which a dtype change (the
        # fallback) makes stale.
        def train_step(*args):
            return self.train_step(*args)

        object.__setattr__(model, "train_step", train_step)
        self.spe = int(getattr(model, "steps_per_execution", 1) or 1)
        model.train_function = self._train_function()
        return model.train_function

    def keras_step(self):
        """The step kerasmp wraps: the user's override, else Keras's, bound
        to the model; called with (data), or (state, data) on JAX. A
        `functools.partial`, not a method of ours: under `torch.compile` a
        Python frame around the step would be one more compiled frame,
        resume and set of guards at each graph break, every step."""
        if self.original is not None:
            return self.original
        return functools.partial(self._class_step, self.model)

    def count_index(self, watched):
        """Where the loss tracker's count is in `watched`, or None."""
        tracker = _ki.loss_tracker(self.model)
        count = getattr(tracker, "count", None)
        ids = [id(v) for v in watched]
        return ids.index(id(count)) if id(count) in ids else None

    def rows(self):
        """The records of the last execution's steps, in order (dicts of
        Python numbers, `as_row`); read from the device once."""
        if self._rows is None:
            self._rows = [as_row(to_numpy(r)) for r in self._records()]
        return self._rows

    def can_keep_batches(self):
        """Whether `batch` can be kept (see `keep_batches`)."""
        return True

    def _records(self):
        raise NotImplementedError

    def batch(self, offset=0):
        raise NotImplementedError


class HostLoopSteps(Steps):
    """`Steps` whose host-side function runs Keras's one-step train
    function once per step of the execution, in Python (JAX, PyTorch): the
    records are a list, and the batches the items the steps took.

    A subclass implements `train_step` and `_train_function`, with
    `single_step_function`, `take_record` and `finish` below.
    """

    def __init__(self, model):
        super().__init__(model)
        self.pending = []  # the last execution's records
        self.batches = []  # the last execution's batches, if kept

    def single_step_function(self, kind="train"):
        """Keras's `kind` function (`"train"`, `"test"` or `"predict"`) for
        one step, whatever the model's `steps_per_execution`: Keras's
        multi-step train loop keeps the last step's logs only, and Keras
        3.15 refuses `steps_per_execution > 1` on PyTorch. It takes a list
        of one batch."""
        model = self.model
        spe = model.steps_per_execution
        model.steps_per_execution = 1
        try:
            getattr(type(model), f"make_{kind}_function")(model, force=True)
        finally:
            model.steps_per_execution = spe
        return getattr(model, f"{kind}_function")

    @staticmethod
    def take_record(logs, records):
        """`logs` without kerasmp's record, which goes to `records`."""
        if isinstance(logs, dict) and ROW_KEY in logs:
            logs = dict(logs)
            records.append(logs.pop(ROW_KEY))
        return logs

    def finish(self, records):
        """Keeps the execution's `records` for `rows`."""
        self.pending = records
        self._rows = None

    def _records(self):
        return self.pending

    def batch(self, offset=0):
        if offset >= len(self.batches):
            return None
        data = self.batches[len(self.batches) - 1 - offset]
        return keras.utils.unpack_x_y_sample_weight(data)
