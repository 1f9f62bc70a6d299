"""kerasmp's train step on JAX (without NNX).

The step runs Keras's (or the user's) stateless `train_step`, then, when
`kerasmp.LossScaleOptimizer` skipped it, returns the state with every value
the step changed put back (`restore`: non-trainable variables such as
batch-norm statistics and seed states, and the metric variables), adds
`loss_scale` / `skipped_steps` and makes one record. Keras's multi-step
loop (`steps_per_execution=k`) keeps the last step's logs only, so the
train function runs Keras's single-step function k times itself and keeps
every step's record; with `keep_batch` it also keeps the items the
iterator yields.
"""

import keras
from keras import ops

from kerasmp import _keras_internals as _ki
from kerasmp.optimizer.loss_scale_optimizer import LossScaleOptimizer
from kerasmp.train_step.logs import ROW_KEY
from kerasmp.train_step.logs import HostLoopSteps
from kerasmp.train_step.logs import add_scale
from kerasmp.train_step.logs import honest_logs
from kerasmp.train_step.logs import nonfinite_now
from kerasmp.train_step.logs import record
from kerasmp.train_step.logs import scale_state


def restore(old, new, skipped):
    """`new` (a list of JAX values) with the values the step changed put
    back to those of `old` where `skipped`. A value the step did not assign
    comes back as the very array it was given and is left alone."""
    return [
        n if n is o else ops.where(skipped, o, n) for o, n in zip(old, new)
    ]


class JaxSteps(HostLoopSteps):
    """kerasmp's train step of one model on JAX."""

    def train_step(self, state, data):
        model = self.model
        logs, new_state = self.keras_step()(state, data)
        if not isinstance(logs, dict):
            return logs, new_state
        logs = dict(logs)
        field = _ki.jax_state_field
        optimizer = model.optimizer
        index = {id(v): i for i, v in enumerate(optimizer.variables)}
        values = field(new_state, "optimizer_variables")
        after = scale_state(model, lambda v: values[index[id(v)]])
        watched = list(model.metrics_variables)
        old_m = list(field(state, "metrics_variables"))
        new_m = list(field(new_state, "metrics_variables"))
        forward = nonfinite_now(old_m, new_m)
        if isinstance(optimizer, LossScaleOptimizer):
            skipped = after.skipped
            name = "non_trainable_variables"
            new_state = _ki.jax_state_replace(
                new_state, name,
                restore(field(state, name), field(new_state, name), skipped),
            )
            if watched:
                fixed = restore(old_m, new_m, skipped)
                new_state = _ki.jax_state_replace(
                    new_state, "metrics_variables", fixed
                )
                with keras.StatelessScope(
                    state_mapping=list(zip(watched, fixed))
                ):
                    fresh = model.get_metrics_result()
                i = self.count_index(watched)
                count = None if i is None else fixed[i]
                logs = honest_logs(logs, fresh, skipped, count)
            add_scale(logs, after)
        logs[ROW_KEY] = record(after, forward)
        return logs, new_state

    def _train_function(self):
        """Keras's function for one step, run `steps_per_execution` times
        by the host-side function."""
        single = self.single_step_function()

        def train_function(state, iterator):
            return self._run(single, state, iterator)

        return train_function

    def _run(self, single, state, iterator):
        iterator = _ki.jax_step_batches(iterator, self.spe)
        self.batches = []
        if self.keep_batch:
            iterator = _Kept(iterator, self.batches)
        records = []
        logs = None
        for i in range(self.spe):
            try:
                step_logs, state = single(state, iterator)
            except StopIteration:
                if i == 0:
                    raise
                break
            logs = self.take_record(step_logs, records)
        self.finish(records)
        return logs, state


class _Kept:
    """Iterator proxy that keeps the items it hands out."""

    def __init__(self, iterator, store):
        self.iterator = iterator
        self.store = store

    def __iter__(self):
        return self

    def __next__(self):
        item = next(self.iterator)
        self.store.append(item)
        return item
