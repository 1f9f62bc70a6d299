"""The one place kerasmp changes Keras's train step, installed by `compile`.

On TensorFlow and JAX (without NNX), `compile` calls `install(model)`, which
sets two instance attributes on the model; nothing adds or removes them
afterwards (a callback never does):

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
  and keeps them for `rows(model)` and `batch(model)`. With
  `steps_per_execution=k` Keras returns the last step's logs only, so on
  TensorFlow each step writes its record into row `n % k` of a `(k, 5)`
  buffer (made eagerly here, never inside a traced function) and on JAX the
  wrapper runs Keras's single-step function k times itself.

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

Under a TensorFlow strategy with several replicas the step restores the
non-trainable variables (each replica its copy; the skip decision is the
same on every replica) but not the metrics, and keeps no records.
"""

import keras
import numpy as np
from keras import ops

from kerasmp import _keras_internals as _ki
from kerasmp.optimizer.loss_scale_optimizer import LossScaleOptimizer

SCALE_KEY = "loss_scale"
SKIPPED_KEY = "skipped_steps"
ROW_FIELDS = ("skipped", "consecutive", "total", "scale", "forward")

_ROW_KEY = "_kerasmp_row"
_ROWS_KEY = "_kerasmp_rows"
_POS_KEY = "_kerasmp_position"
_BATCH_KEY = "_kerasmp_batch"
_PRIVATE = (_ROW_KEY, _ROWS_KEY, _POS_KEY, _BATCH_KEY)
_ATTR = "_kerasmp_steps"  # the model's `_Steps`, in its __dict__

# Ops that read a variable without writing it.
_READ_OPS = frozenset(
    (
        "ReadVariableOp",
        "ResourceGather",
        "ResourceGatherNd",
        "VarIsInitializedOp",
    )
)


def supported():
    """Whether train steps can be wrapped on this backend (TensorFlow; JAX
    without NNX)."""
    backend = keras.backend.backend()
    if backend == "jax":
        return not keras.config.is_nnx_enabled()
    return backend == "tensorflow"


def read(value):
    """A variable's or tensor's value as a NumPy array (one transfer)."""
    if not isinstance(value, keras.Variable) and hasattr(
        value, "__array__"
    ):
        return np.asarray(value)
    return ops.convert_to_numpy(ops.convert_to_tensor(value))


def optimizer_state(optimizer):
    """`(loss scale, total skipped steps)` of a `kerasmp.LossScaleOptimizer`
    now (its initial values before it is built)."""
    scale = getattr(optimizer, "dynamic_scale", None)
    if scale is None:
        return float(optimizer.initial_scale), 0
    return float(read(scale)), int(read(optimizer.total_skipped_steps))


# ------------------------------------------------------------------ install


def install(model):
    """Installs the train step on `model` (called by `compile`; once per
    model: the step reads `model.optimizer` when it is traced)."""
    if supported() and _ATTR not in model.__dict__:
        steps = _Steps(model)
        object.__setattr__(model, _ATTR, steps)
        object.__setattr__(model, "train_step", steps.train_step)
        object.__setattr__(
            model, "make_train_function", steps.make_train_function
        )


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
    if steps is None or not _single_replica(model):
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


# -------------------------------------------------------- skipped-step undo


def _tf_now(variable):
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
        self.before = [_tf_now(v) for v in self.variables]
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
            v.assign(tf.where(skipped, b, _tf_now(v)))


def restore_jax(old, new, skipped):
    """`new` (a list of JAX values) with the values the step changed put
    back to those of `old` where `skipped`. A value the step did not assign
    comes back as the very array it was given and is left alone."""
    return [
        n if n is o else ops.where(skipped, o, n) for o, n in zip(old, new)
    ]


# ----------------------------------------------------------------- the step


def _nonfinite_now(before, after):
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


def _honest_logs(logs, fresh, skipped, count):
    """The logs of a step: Keras's, or on a skipped step the metrics without
    it (`fresh`), unless no step has been applied since the metrics were
    reset (`count`, the loss tracker's count after the undo, is 0)."""
    drop = skipped if count is None else ops.logical_and(skipped, count > 0)
    for k in logs:
        if k in fresh:
            logs[k] = ops.where(drop, fresh[k], logs[k])
    return logs


def _record(skipped, consecutive, total, scale, forward):
    return ops.stack(
        [
            ops.cast(skipped, "float32"),
            ops.cast(consecutive, "float32"),
            ops.cast(total, "float32"),
            ops.cast(scale, "float32"),
            ops.cast(forward, "float32"),
        ]
    )


class _Steps:
    """kerasmp's train step of one model and what it keeps for monitors."""

    def __init__(self, model):
        self.model = model
        self.original = model.__dict__.get("train_step")  # a user override
        self.keep_batch = False
        self.spe = 1
        self.ring = None  # TensorFlow: (rows, position) variables
        self.structure = None  # TensorFlow: the batch's structure
        self.pending = None
        self.position_seen = 0
        self.batches = []
        self.last_batch = None
        self._rows = None

    def _keras_step(self):
        if self.original is not None:
            return self.original
        return type(self.model).train_step.__get__(self.model)

    def _count_index(self, watched):
        tracker = _ki.loss_tracker(self.model)
        count = getattr(tracker, "count", None)
        ids = [id(v) for v in watched]
        return ids.index(id(count)) if id(count) in ids else None

    # ------------------------------------------------------- TensorFlow

    def _tf_step(self, data):
        model = self.model
        single = _single_replica(model)
        watched = list(model.metrics_variables) if single else []
        scaled = isinstance(model.optimizer, LossScaleOptimizer)
        undo = Frozen(
            (list(model.non_trainable_variables) if scaled else []) + watched
        )
        logs = self._keras_step()(data)
        if not isinstance(logs, dict):
            return logs
        logs = dict(logs)
        after = [_tf_now(v) for v in watched]
        skipped, consecutive, total, scale = self._counters(
            lambda v: _tf_now(v)
        )
        if scaled:
            undo.restore(skipped)
            logs[SCALE_KEY] = ops.cast(scale, "float32")
            logs[SKIPPED_KEY] = total
        if not single:
            return logs
        forward = _nonfinite_now(undo.before[len(undo.before) - len(after) :],
                                 after)
        if scaled and watched:
            i = self._count_index(watched)
            count = None if i is None else _tf_now(watched[i])
            logs = _honest_logs(
                logs, model.get_metrics_result(), skipped, count
            )
        row = _record(skipped, consecutive, total, scale, forward)
        if self.ring is None:
            logs[_ROW_KEY] = row
        else:
            import tensorflow as tf

            table, position = self.ring
            at = tf.equal(
                tf.range(self.spe, dtype="int64"), position % self.spe
            )
            table.assign(tf.where(at[:, None], row[None, :], table))
            position.assign_add(1)
            logs[_ROWS_KEY] = _tf_now(table)
            logs[_POS_KEY] = _tf_now(position)
        if self.keep_batch:
            flat = keras.tree.flatten(data)
            self.structure = (
                keras.tree.map_structure(lambda t: None, data),
                [t is None for t in flat],
            )
            logs[_BATCH_KEY] = tuple(t for t in flat if t is not None)
        return logs

    def _counters(self, value_of):
        """`(skipped, consecutive, total, scale)` after the step, from
        kerasmp's optimizer (`value_of(variable)` reads one), or a step
        that is never skipped and has no scale."""
        optimizer = self.model.optimizer
        if not isinstance(optimizer, LossScaleOptimizer):
            zero = ops.array(0, "int32")
            return ops.array(False), zero, zero, ops.array(float("nan"))
        consecutive = value_of(optimizer.consecutive_skipped_steps)
        total = value_of(optimizer.total_skipped_steps)
        scale = value_of(optimizer.dynamic_scale)
        return consecutive > 0, consecutive, total, scale

    # -------------------------------------------------------------- JAX

    def _jax_step(self, state, data):
        model = self.model
        logs, new_state = self._keras_step()(state, data)
        if not isinstance(logs, dict):
            return logs, new_state
        logs = dict(logs)
        field = _ki.jax_state_field
        optimizer = model.optimizer
        index = {id(v): i for i, v in enumerate(optimizer.variables)}
        values = field(new_state, "optimizer_variables")
        skipped, consecutive, total, scale = self._counters(
            lambda v: values[index[id(v)]]
        )
        watched = list(model.metrics_variables)
        old_m = list(field(state, "metrics_variables"))
        new_m = list(field(new_state, "metrics_variables"))
        forward = _nonfinite_now(old_m, new_m)
        if isinstance(optimizer, LossScaleOptimizer):
            name = "non_trainable_variables"
            new_state = _ki.jax_state_replace(
                new_state,
                name,
                restore_jax(
                    field(state, name), field(new_state, name), skipped
                ),
            )
            if watched:
                fixed = restore_jax(old_m, new_m, skipped)
                new_state = _ki.jax_state_replace(
                    new_state, "metrics_variables", fixed
                )
                with keras.StatelessScope(
                    state_mapping=list(zip(watched, fixed))
                ):
                    fresh = model.get_metrics_result()
                i = self._count_index(watched)
                count = None if i is None else fixed[i]
                logs = _honest_logs(logs, fresh, skipped, count)
            logs[SCALE_KEY] = ops.cast(scale, "float32")
            logs[SKIPPED_KEY] = total
        logs[_ROW_KEY] = _record(skipped, consecutive, total, scale, forward)
        return logs, new_state

    def train_step(self, *args):
        if keras.backend.backend() == "jax":
            return self._jax_step(*args)
        return self._tf_step(*args)

    # ------------------------------------------------- the train function

    def make_train_function(self, force=False):
        """Keras's `make_train_function`, wrapped (see the module)."""
        model = self.model
        if model.train_function is not None and not force:
            return model.train_function
        make = type(model).make_train_function

        # A new function object for every build: `jax.jit` reuses the trace
        # of a function it has seen, which a dtype change (the fallback)
        # makes stale.
        def train_step(*args):
            return self.train_step(*args)

        object.__setattr__(model, "train_step", train_step)
        self.spe = spe = int(getattr(model, "steps_per_execution", 1) or 1)
        if keras.backend.backend() == "jax":
            # Keras's multi-step loop keeps the last step's logs only: build
            # its single-step function and run the loop here.
            model.steps_per_execution = 1
            try:
                make(model, force=True)
            finally:
                model.steps_per_execution = spe
            single = model.train_function

            def train_function(state, iterator):
                return self._run_jax(single, state, iterator)

        else:
            self._make_ring()
            inner = None
            make(model, force=True)
            inner = model.train_function

            def train_function(iterator):
                return self._take(inner(iterator))

        model.train_function = train_function
        return train_function

    def _make_ring(self):
        import tensorflow as tf

        if self.spe == 1 or not _single_replica(self.model):
            self.ring = None
        elif self.ring is None or self.ring[0].shape[0] != self.spe:
            self.ring = (
                tf.Variable(
                    tf.zeros((self.spe, len(ROW_FIELDS))), trainable=False
                ),
                tf.Variable(tf.constant(0, "int64"), trainable=False),
            )
            self.position_seen = 0

    def _run_jax(self, single, state, iterator):
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
            logs = step_logs
            if isinstance(logs, dict) and _ROW_KEY in logs:
                logs = dict(logs)
                records.append(logs.pop(_ROW_KEY))
        self.pending = ("list", records)
        self._rows = None
        return logs, state

    def _take(self, logs):
        if not isinstance(logs, dict):
            return logs
        logs = dict(logs)
        self._rows = None
        batch = logs.pop(_BATCH_KEY, None)
        if batch is not None:
            self.last_batch = batch
        if _ROWS_KEY in logs:
            self.pending = ("ring", logs.pop(_ROWS_KEY), logs.pop(_POS_KEY))
        elif _ROW_KEY in logs:
            self.pending = ("list", [logs.pop(_ROW_KEY)])
        else:
            self.pending = None
        return logs

    # ------------------------------------------------------ for monitors

    def rows(self):
        if self._rows is not None:
            return self._rows
        pending, raw = self.pending, []
        if pending is not None and pending[0] == "ring":
            table, position = read(pending[1]), int(read(pending[2]))
            k = table.shape[0]
            count = max(0, min(k, position - self.position_seen))
            self.position_seen = position
            raw = [table[(position - count + i) % k] for i in range(count)]
        elif pending is not None:
            # One read per record, no stacking op: on TensorFlow the first
            # eager op after a step waits ~230 us, and one step (one
            # record) is the common case.
            raw = [read(record) for record in pending[1]]
        self._rows = []
        for values in raw:
            row = dict(zip(ROW_FIELDS, (float(v) for v in values)))
            row["skipped"] = row["skipped"] > 0
            row["forward"] = row["forward"] > 0
            row["consecutive"] = int(row["consecutive"])
            row["total"] = int(row["total"])
            self._rows.append(row)
        return self._rows

    def batch(self, offset=0):
        if keras.backend.backend() == "jax":
            if offset >= len(self.batches):
                return None
            data = self.batches[len(self.batches) - 1 - offset]
        elif (
            offset != 0 or self.last_batch is None or self.structure is None
        ):
            return None
        else:
            structure, is_none = self.structure
            tensors = iter(self.last_batch)
            flat = [None if none else next(tensors) for none in is_none]
            data = keras.tree.pack_sequence_as(structure, flat)
        return keras.utils.unpack_x_y_sample_weight(data)


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


def _single_replica(model):
    if keras.backend.backend() != "tensorflow":
        return True
    strategy = getattr(model, "distribute_strategy", None)
    return strategy is None or strategy.num_replicas_in_sync == 1
