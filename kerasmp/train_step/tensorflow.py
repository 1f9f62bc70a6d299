"""kerasmp's train step on TensorFlow.

The step runs Keras's (or the user's) `train_step`, then, when
`kerasmp.LossScaleOptimizer` skipped it, writes back every variable the
step assigned (`Frozen`: batch-norm moving statistics, seed states, metric
variables), adds `loss_scale` / `skipped_steps` and makes one record. With
`steps_per_execution=k` Keras returns the last step's logs only, so each step
writes its record into row `n % k` of a `(k, 5)` buffer variable (made
eagerly, never inside a traced function). Under a strategy with several
replicas the step restores the non-trainable variables (each replica its
copy; the skip decision is the same on every replica) but not the metrics,
and keeps no records.
"""

import keras

from kerasmp._utils.arrays import to_numpy
from kerasmp.optimizer.loss_scale_optimizer import LossScaleOptimizer
from kerasmp.train_step.logs import BATCH_KEY
from kerasmp.train_step.logs import ROW_FIELDS
from kerasmp.train_step.logs import ROW_KEY
from kerasmp.train_step.logs import Steps
from kerasmp.train_step.logs import add_scale
from kerasmp.train_step.logs import honest_logs
from kerasmp.train_step.logs import nonfinite_now
from kerasmp.train_step.logs import record
from kerasmp.train_step.logs import scale_state

_ROWS_KEY = "_kerasmp_rows"
_POS_KEY = "_kerasmp_position"

# Ops that read a variable without writing it.
_READ_OPS = frozenset(
    (
        "ReadVariableOp",
        "ResourceGather",
        "ResourceGatherNd",
        "VarIsInitializedOp",
    )
)


def single_replica(model):
    """Whether `model` trains on one replica (no multi-replica strategy)."""
    strategy = getattr(model, "distribute_strategy", None)
    return strategy is None or strategy.num_replicas_in_sync == 1


def _now(variable):
    """A read of `variable` at this point of the program (a bare variable
    would be read whenever the function returns); automatic control
    dependencies order it against the step's writes."""
    import tensorflow as tf

    if isinstance(variable, keras.Variable):
        variable = variable.value
    return tf.identity(variable)


def _handle_ids(variable):
    """`id`s of the eager resource handles behind a (distributed) variable."""
    value = (
        variable.value if isinstance(variable, keras.Variable) else variable
    )
    ids = set()
    for part in (value, *getattr(value, "values", ())):
        try:
            ids.add(id(part.handle))
        except (AttributeError, ValueError):
            pass  # a distributed variable outside a replica context
    return ids


def _touched_handles(graph, mark):
    """`id`s of the eager resource handles that the ops added to `graph`
    since `mark` may write (every resource input of an op that is not a
    plain read), traced back through the captures of nested graphs."""
    import tensorflow as tf

    names = set()
    for op in graph.get_operations()[mark:]:
        if op.type not in _READ_OPS:
            names.update(
                t.name for t in op.inputs if t.dtype == tf.resource
            )
    ids = set()
    while names and graph is not None:
        captures = {
            internal.name: external
            for external, internal in getattr(graph, "captures", ())
        }
        outer = set()
        for name in names:
            external = captures.get(name)
            if external is None:
                continue
            if tf.is_symbolic_tensor(external):
                outer.add(external.name)
            else:
                ids.add(id(external))
        names = outer
        graph = getattr(graph, "outer_graph", None)
    return ids


class Frozen:
    """Reads of `variables` made before a TensorFlow step, to write back
    where the step was skipped. In a traced function only the variables the
    step's ops may assign are restored (inspected at trace time; the other
    reads have no consumer and are pruned); eagerly, all of them."""

    def __init__(self, variables):
        import tensorflow as tf

        self.variables = list(variables)
        self.before = [_now(v) for v in self.variables]
        self.graph = None
        self.mark = 0
        if not tf.executing_eagerly():
            self.graph = tf.compat.v1.get_default_graph()
            self.mark = len(self.graph.get_operations())

    def assigned(self):
        """`(variable, value before)` of the variables the step may assign."""
        pairs = list(zip(self.variables, self.before))
        if self.graph is None or not pairs:
            return pairs
        touched = _touched_handles(self.graph, self.mark)
        return [(v, b) for v, b in pairs if _handle_ids(v) & touched]

    def restore(self, skipped):
        """Undoes the step's writes where `skipped` (a bool tensor)."""
        import tensorflow as tf

        for v, b in self.assigned():
            v.assign(tf.where(skipped, b, _now(v)))


class TensorFlowSteps(Steps):
    """kerasmp's train step of one model on TensorFlow."""

    def __init__(self, model):
        super().__init__(model)
        self.ring = None  # with steps_per_execution > 1: (rows, position)
        self.structure = None  # the kept batch's structure
        self.pending = list  # returns the last execution's records
        self.ring_seen = 0
        self.last_batch = None

    def can_keep_batches(self):
        return single_replica(self.model)

    def train_step(self, data):
        model = self.model
        single = single_replica(model)
        watched = list(model.metrics_variables) if single else []
        scaled = isinstance(model.optimizer, LossScaleOptimizer)
        undo = Frozen(
            (list(model.non_trainable_variables) if scaled else []) + watched
        )
        logs = self.keras_step()(data)
        if not isinstance(logs, dict):
            return logs
        logs = dict(logs)
        after = [_now(v) for v in watched]
        state = scale_state(model, _now)
        if scaled:
            undo.restore(state.skipped)
            add_scale(logs, state)
        if not single:
            return logs
        forward = nonfinite_now(undo.before[len(undo.before) - len(after):],
                                after)
        if scaled and watched:
            i = self.count_index(watched)
            count = None if i is None else _now(watched[i])
            logs = honest_logs(
                logs, model.get_metrics_result(), state.skipped, count
            )
        self._write_record(logs, record(state, forward))
        if self.keep_batch:
            flat = keras.tree.flatten(data)
            self.structure = (
                keras.tree.map_structure(lambda t: None, data),
                [t is None for t in flat],
            )
            logs[BATCH_KEY] = tuple(t for t in flat if t is not None)
        return logs

    def _write_record(self, logs, row):
        if self.ring is None:
            logs[ROW_KEY] = row
            return
        import tensorflow as tf

        table, position = self.ring
        at = tf.equal(tf.range(self.spe, dtype="int64"), position % self.spe)
        table.assign(tf.where(at[:, None], row[None, :], table))
        position.assign_add(1)
        logs[_ROWS_KEY] = _now(table)
        logs[_POS_KEY] = _now(position)

    def _train_function(self):
        self._make_ring()
        model = self.model
        type(model).make_train_function(model, force=True)
        inner = model.train_function

        def train_function(iterator):
            return self._take(inner(iterator))

        return train_function

    def _make_ring(self):
        import tensorflow as tf

        if self.spe == 1 or not single_replica(self.model):
            self.ring = None
        elif self.ring is None or self.ring[0].shape[0] != self.spe:
            self.ring = (
                tf.Variable(
                    tf.zeros((self.spe, len(ROW_FIELDS))), trainable=False
                ),
                tf.Variable(tf.constant(0, "int64"), trainable=False),
            )
            self.ring_seen = 0

    def _take(self, logs):
        """The logs without kerasmp's private entries, which are kept."""
        if not isinstance(logs, dict):
            return logs
        logs = dict(logs)
        self._rows = None
        batch = logs.pop(BATCH_KEY, None)
        if batch is not None:
            self.last_batch = batch
        if _ROWS_KEY in logs:
            table, position = logs.pop(_ROWS_KEY), logs.pop(_POS_KEY)
            self.pending = lambda: self._ring_records(table, position)
        else:
            row = logs.pop(ROW_KEY, None)
            self.pending = lambda: [] if row is None else [row]
        return logs

    def _records(self):
        return self.pending()

    def _ring_records(self, table, position):
        """The rows the execution wrote into the ring since the last read
        (one read of the table)."""
        table, position = to_numpy(table), int(to_numpy(position))
        k = table.shape[0]
        count = max(0, min(k, position - self.ring_seen))
        self.ring_seen = position
        return [table[(position - count + i) % k] for i in range(count)]

    def batch(self, offset=0):
        if offset != 0 or self.last_batch is None or self.structure is None:
            return None
        structure, is_none = self.structure
        tensors = iter(self.last_batch)
        flat = [None if none else next(tensors) for none in is_none]
        data = keras.tree.pack_sequence_as(structure, flat)
        return keras.utils.unpack_x_y_sample_weight(data)
