"""kerasmp's train step on PyTorch.

Keras's PyTorch step runs eagerly (or compiled whole by `torch.compile`
with `jit_compile=True`) and assigns variables in place, so the step keeps a
copy of what a skipped step must not change (non-trainable variables such as
batch-norm statistics and seed states, and the metric variables), and, when
`kerasmp.LossScaleOptimizer` skipped the step, writes the copies back; then
it adds `loss_scale` / `skipped_steps` and makes one record, as on the other
backends.

`steps_per_execution=k`: the train function is kerasmp's, which runs the
step once per batch of the execution it is handed (k batches, fewer at an
epoch's end) and keeps every step's record. Keras 3.16 runs `k > 1` on
PyTorch itself (keras-team/keras#23234), and kerasmp leaves its test and
predict functions to it. Keras 3.15 refuses `k > 1` there: where Keras's
trainer does (`_keras_internals.torch_trainer_runs_executions`, asked of
the trainer, not of the version), `install` also sets kerasmp's
`make_test_function` and `make_predict_function`, which run Keras's
one-step function once per batch of the execution, as Keras 3.16's own
do: the test function returns the last step's logs (the metrics are
cumulative), the predict function the steps' outputs concatenated along
the batch axis. Callbacks see one `on_*_batch_end` per execution, as Keras
calls them on every backend. The epoch iterator's warning at a partial
last execution is `kerasmp._patches`' (6.).

Under `jit_compile=True` the function `torch.compile` compiles is
`TorchSteps.train_step` itself, calling Keras's step directly: the compiled
frames nest as deep as stock Keras's (its `one_step_on_data`, then
`Trainer.train_step`). Where the forward pass graph-breaks (Keras's
attention, `loss.backward()`), Dynamo splits every enclosing frame at the
call and compiles what follows as a frame of its own; each wrapper level
kerasmp added (Keras's `one_step_on_data`, a closure, a step getter) was one
more graph, resume frame and set of guards per break, per step.
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


def _value(variable):
    return variable.value


def _first_of(function):
    """Keras's one-step function (which takes `[batch]`) called with the
    batch."""

    def step(batch):
        return function([batch])

    return step


def _concatenated(outputs):
    """One execution's predictions: the steps' outputs concatenated along
    the batch axis, as Keras 3.16's PyTorch `predict_function` does."""
    if not outputs:
        return []
    if len(outputs) == 1:
        return outputs[0]
    import torch

    return keras.tree.map_structure(
        lambda *steps: torch.cat(steps, dim=0), *outputs
    )


class TorchSteps(HostLoopSteps):
    """kerasmp's train step of one model on PyTorch, and its test and
    predict functions."""

    @property
    def replaces(self):
        """The methods `install` sets on the model: also the test and
        predict functions where Keras's PyTorch trainer refuses
        `steps_per_execution > 1` (Keras 3.15)."""
        if _ki.torch_trainer_runs_executions():
            return HostLoopSteps.replaces
        return HostLoopSteps.replaces + (
            "make_test_function",
            "make_predict_function",
        )

    def train_step(self, data):
        model = self.model
        scaled = isinstance(model.optimizer, LossScaleOptimizer)
        watched = list(model.metrics_variables)
        guarded = (
            list(model.non_trainable_variables) if scaled else []
        ) + watched
        before = [ops.copy(v.value) for v in guarded]
        logs = self.keras_step()(data)
        if not isinstance(logs, dict):
            return logs
        logs = dict(logs)
        state = scale_state(model, _value)
        forward = nonfinite_now(
            before[len(before) - len(watched):], [v.value for v in watched]
        )
        if scaled:
            for v, old in zip(guarded, before):
                v.assign(ops.where(state.skipped, old, v.value))
            if watched:
                i = self.count_index(watched)
                count = None if i is None else watched[i].value
                logs = honest_logs(
                    logs, model.get_metrics_result(), state.skipped, count
                )
            add_scale(logs, state)
        logs[ROW_KEY] = record(state, forward)
        return logs

    def _train_function(self):
        """Keras's function for one step, run once per batch of the
        execution by the host-side function."""
        if self.model.jit_compile:
            # Keras's `one_step_on_data` (data[0], then `train_step`) is one
            # more frame around the step; compile the step itself.
            import torch

            single = torch.compile(self.train_step)
        else:
            single = _first_of(self.single_step_function())

        def train_function(data):
            return self._run(single, data)

        return train_function

    def _run(self, single, data):
        self.batches = list(data) if self.keep_batch else []
        records = []
        logs = None
        for batch in data:
            logs = self.take_record(single(batch), records)
        self.finish(records)
        return logs

    def make_test_function(self, force=False):
        """Keras's `make_test_function` for any `steps_per_execution`: the
        function runs Keras's one-step test function once per batch of the
        execution and returns the last step's logs (the metrics are
        cumulative), as Keras 3.16's does.

        Args:
            force: Whether to build the function again when the model has
                one.

        Returns:
            The model's `test_function`, which takes an execution's list
            of batches.
        """
        model = self.model
        if model.test_function is not None and not force:
            return model.test_function
        single = self.single_step_function("test")

        def test_function(data):
            logs = {}
            for batch in data:
                logs = single([batch])
            return logs

        model.test_function = test_function
        return test_function

    def make_predict_function(self, force=False):
        """Keras's `make_predict_function` for any `steps_per_execution`:
        the function runs Keras's one-step predict function once per batch
        of the execution and returns their outputs concatenated.

        Args:
            force: Whether to build the function again when the model has
                one.

        Returns:
            The model's `predict_function`, which takes an execution's list
            of batches.
        """
        model = self.model
        if model.predict_function is not None and not force:
            return model.predict_function
        single = self.single_step_function("predict")

        def predict_function(data):
            return _concatenated([single([batch]) for batch in data])

        model.predict_function = predict_function
        return predict_function
