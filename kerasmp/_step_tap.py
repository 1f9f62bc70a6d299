"""Puts loss-scale state, one record per step and the batch into the logs.

Keras hands every callback the same logs dict in list order, and builds the
epoch logs before any callback runs, so a callback that writes `loss_scale`
into the logs itself is too late for a `CSVLogger` or `TensorBoard` placed
before it. Instead, while a monitor is attached, the model's train step is
wrapped so that it returns the optimizer's `dynamic_scale` and skipped-step
counter next to the loss, read from the optimizer's variables inside the
compiled step (TensorFlow) or from the optimizer state the step returns
(JAX); Keras converts them together with the rest of the logs.

The wrapped step also makes one *record* per step (`ROW_FIELDS`): whether the
step was skipped, the optimizer's own `consecutive_skipped_steps` and
`total_skipped_steps` after it, the scale after it, and whether the forward
pass went non-finite (a metric variable, e.g. the loss tracker's total, that
was finite before the step and is not after it). With `steps_per_execution=k`
Keras returns only the last step's logs, so:

- TensorFlow: the step writes its record into row `n % k` of a `(k, 5)`
  buffer variable and bumps a step counter `n`; the last step's logs carry
  the buffer and `n`, from which the host picks the records of the execution.
- JAX: Keras's multi-step train function is a Python loop over a jitted
  single step; the tap runs that loop itself (the jitted step is built with
  `steps_per_execution=1`) and keeps every step's record and batch.

Skipped steps leave every variable alone: on a skipped step the wrapped step
puts the model's non-trainable variables that the step assigned (batch-norm
moving statistics) and every metric variable back to their values before the
step, and recomputes the logged metrics, so a step whose forward pass
overflowed does not turn the epoch's loss into NaN (and trip
`TerminateOnNaN`) after kerasmp skipped it. The non-trainable part is
`Frozen` (TensorFlow) / `restore_jax` (JAX) of `kerasmp._skip_guard`, shared
with the *skip guard* (`guard_skipped_steps` there): a wrapper that
`compile` installs, monitor or not, for models trained with
`kerasmp.LossScaleOptimizer`. When the tap wraps a guarded step it leaves
that part to the guard.

Nothing here creates a variable inside a traced function (XLA cannot lift
them out): the buffer and counters are made eagerly before the first trace,
and the optimizer's own variables, created during the first trace when it is
not built yet, are read only after the original step has run.

The wrapped step is installed as an instance attribute `model.train_step`,
and `model.train_function` becomes a host-side wrapper that builds the
wrapped Keras train function on its first call (once every monitor of the
fit has joined), pops the private entries from the logs and returns the rest.
The built function is cached on the model, keyed by the model's own train
function, so later fits with monitors do not trace again. Both attributes
are restored when the last monitor leaves (`on_train_end`), when the fit
ends in any way on JAX (Keras's `finally` calls the optimizer's
`finalize_variable_values`, which the tap shadows on the instance while it is
installed), when an exception leaves the train function, and otherwise (an
exception raised by another callback on TensorFlow) by the wrapper itself as
soon as it is called with an iterator of another fit, before it runs a step.

Length: one mechanism on two backends: the TensorFlow step (a record buffer
for `steps_per_execution`) and the JAX step (a host loop over a jitted step),
the host-side train function that installs and removes itself, and the
per-step records and batches the monitors read. The skip guard is apart
(`kerasmp._skip_guard`).
"""

import keras
import numpy as np
from keras import ops

from kerasmp import _keras_internals as _ki
from kerasmp import _skip_guard
from kerasmp._skip_guard import has_own_counters
from kerasmp._skip_guard import is_skip_guard

SCALE_KEY = "loss_scale"
SKIPPED_KEY = "skipped_steps"
_BATCH_KEY = "_kerasmp_batch"
_ROW_KEY = "_kerasmp_row"
_ROWS_KEY = "_kerasmp_rows"
_POS_KEY = "_kerasmp_position"

# One record per train step.
ROW_FIELDS = ("skipped", "consecutive", "total", "scale", "forward")

# Kept in the model's __dict__ (object.__setattr__: outside Keras's and
# TensorFlow's attribute tracking) so that nothing outlives the model.
_TAP_ATTR = "_kerasmp_step_tap"
_CACHE_ATTR = "_kerasmp_step_cache"


class _BatchSpec:
    """Where the step records the structure of its batch (at trace time)."""

    structure = None


def scale_variable(optimizer):
    """The optimizer's loss-scale variable, or None."""
    return getattr(optimizer, "dynamic_scale", None)


def skipped_variable(optimizer):
    """kerasmp's cumulative skipped-step counter variable, or None."""
    v = getattr(optimizer, "total_skipped_steps", None)
    return v if isinstance(v, keras.Variable) else None


def has_loss_scale(optimizer):
    return isinstance(optimizer, keras.optimizers.LossScaleOptimizer) or (
        scale_variable(optimizer) is not None
    )


def read(value):
    """A variable's or tensor's value as a NumPy array (one transfer)."""
    if not isinstance(value, keras.Variable) and hasattr(value, "__array__"):
        return np.asarray(value)  # eager tensors, JAX arrays: the fast way
    return ops.convert_to_numpy(ops.convert_to_tensor(value))


def _metric_variables(model):
    return list(model.metrics_variables)


def _is_float(v):
    dtype = keras.backend.standardize_dtype(v.dtype)
    return keras.backend.is_float_dtype(dtype)


class _Stale(Exception):
    pass


class StepTap:
    """Wraps a model's train step for the monitors of one `fit` call."""

    def __init__(self, model, params):
        self.model = model
        self.params = params
        self.members = set()
        self.publish = False
        self.keep_batch = False
        self._spec = None
        self._entry = None
        self._keras_function = None
        self._host_function = self._make_host_function()
        self._dirty = False
        self._installed = False
        self._expect_new_iterator = True
        self._iterator = None
        self._pending = None
        self._rows = None
        self._batches = []
        self._last_batch = None
        self._tally = None
        self._host_total = 0
        self._host_consecutive = 0
        self._pos_seen = 0
        self._saved_train_step = model.__dict__.get("train_step")
        self._saved_train_function = model.train_function
        self.steps_per_execution = int(getattr(model, "steps_per_execution", 1))
        optimizer = model.optimizer
        self.optimizer = optimizer if has_loss_scale(optimizer) else None
        self.own_counters = has_own_counters(optimizer)
        self._finalize_hooked = False
        skipped = skipped_variable(optimizer)
        self.initial_skipped = int(read(skipped)) if skipped is not None else 0
        self._host_total = self.initial_skipped if self.own_counters else 0
        scale = scale_variable(optimizer)
        if scale is not None:
            self.initial_scale = float(read(scale))
        else:
            self.initial_scale = getattr(optimizer, "initial_scale", None)
        if self.initial_scale is not None:
            self.initial_scale = float(self.initial_scale)

    # ---------------------------------------------------------- membership

    @classmethod
    def join(cls, model, member, params, publish=False, keep_batch=False):
        """Attaches `member` (a callback) to the tap of this fit call.

        Returns the tap, or None where it cannot work (other backends, NNX).
        """
        if not cls.supported():
            return None
        tap = model.__dict__.get(_TAP_ATTR)
        if tap is not None and tap.params is not params:
            tap.uninstall()  # left over from a fit that did not finish
            tap = None
        if tap is None:
            tap = cls(model, params)
            object.__setattr__(model, _TAP_ATTR, tap)
        tap.members.add(member)
        tap.publish = tap.publish or publish
        if keep_batch and _single_replica(model):
            tap.keep_batch = True
        tap.rebuild()
        return tap

    def leave(self, member):
        self.members.discard(member)
        if not self.members:
            self.uninstall()

    supported = staticmethod(_skip_guard.supported)

    def new_epoch(self):
        """Members call this from `on_epoch_begin`: a new iterator is fine."""
        self._expect_new_iterator = True

    # ------------------------------------------------------------ install

    def rebuild(self, dirty=False):
        """Makes a new train function on the next step.

        `dirty=True` after a change that invalidates traced functions (a
        layer's dtype policy): nothing traced before is reused.
        """
        if dirty:
            self._dirty = True
            self.model.__dict__.pop(_CACHE_ATTR, None)
        self._keras_function = None
        self.model.train_function = self._host_function
        self._installed = True
        self._hook_finalize()

    def _hook_finalize(self):
        # Keras's JAX fit calls the optimizer's finalize_variable_values in
        # a `finally`, however the fit ends (TensorFlow's, when it ends
        # normally): leave the model as fit found it there.
        optimizer = self.model.optimizer
        if self._finalize_hooked or optimizer is None:
            return
        original = optimizer.finalize_variable_values
        tap = self

        def finalize_variable_values(*args, **kwargs):
            tap.uninstall()
            return original(*args, **kwargs)

        object.__setattr__(
            optimizer, "finalize_variable_values", finalize_variable_values
        )
        self._finalize_hooked = True

    def _unhook_finalize(self):
        optimizer = self.model.optimizer
        if not self._finalize_hooked:
            return
        self._finalize_hooked = False
        if "finalize_variable_values" in optimizer.__dict__:
            object.__delattr__(optimizer, "finalize_variable_values")

    def prepare(self):
        """Builds the wrapped train function now, if it is not built.

        Members call it from `on_train_batch_begin`: every monitor of the fit
        has joined by then, and the model's variables still hold their values.
        JAX's fit empties them once the first step starts ("purge"), and
        building a train function under a `keras.distribution` reads their
        shardings. A rebuild in the middle of a JAX fit (fallback) first
        writes the fit's current state back into the variables.
        """
        if self._keras_function is not None or not self._installed:
            return
        _ki.jax_state_sync(self.model)
        self._function()

    def _function(self):
        """The wrapped Keras train function, built on first use.

        Built lazily so that all monitors of the fit have joined; reused
        across fit calls while the model's own train function is unchanged,
        so that a fit with monitors traces once, like one without.
        """
        if self._keras_function is not None:
            return self._keras_function
        model = self.model
        spe = self.steps_per_execution
        key = (self.keep_batch, self.publish, id(self.optimizer), spe)
        cache = model.__dict__.get(_CACHE_ATTR)
        if cache is None:
            cache = {}
            object.__setattr__(model, _CACHE_ATTR, cache)
        entry = cache.get(key)
        if (
            entry is None
            or self._dirty
            or entry["original"] is not self._saved_train_function
        ):
            spec = _BatchSpec()
            state = self._make_state()
            step = self._make_step(spec, state)
            object.__setattr__(model, "train_step", step)
            if keras.backend.backend() == "jax" and spe > 1:
                # The tap runs the multi-step loop itself (see the host
                # function): build Keras's single-step function.
                model.steps_per_execution = 1
                try:
                    model.make_train_function(force=True)
                finally:
                    model.steps_per_execution = spe
            else:
                model.make_train_function(force=True)
            entry = {
                "original": self._saved_train_function,
                "step": step,
                "function": model.train_function,
                "spec": spec,
                "state": state,
            }
            if not self._dirty:
                cache[key] = entry
        object.__setattr__(model, "train_step", entry["step"])
        model.train_function = self._host_function
        self._spec = entry["spec"]
        self._entry = entry
        position = entry["state"].get("position")
        if position is not None:
            self._pos_seen = int(read(position))
        for name in ("total", "consecutive"):
            if name in entry["state"]:  # counted from the start of each fit
                entry["state"][name].assign(0)
        self._keras_function = entry["function"]
        return self._keras_function

    def uninstall(self):
        model = self.model
        if model.__dict__.get(_TAP_ATTR) is self:
            object.__delattr__(model, _TAP_ATTR)
        self._unhook_finalize()
        if not self._installed:
            return
        if self._saved_train_step is not None:
            object.__setattr__(model, "train_step", self._saved_train_step)
        elif "train_step" in model.__dict__:
            object.__delattr__(model, "train_step")
        # After a dtype-policy change the old function is stale: let the next
        # fit build a new one.
        model.train_function = (
            None if self._dirty else self._saved_train_function
        )
        self._installed = False
        self._keras_function = None
        self._iterator = None

    # ----------------------------------------------------------- the step

    def _original_step(self):
        if self._saved_train_step is not None:
            return self._saved_train_step
        return type(self.model).train_step.__get__(self.model)

    def _make_state(self):
        """Variables the TensorFlow step keeps, made eagerly (never inside a
        traced function: XLA cannot lift variable creations out of it)."""
        state = {}
        if keras.backend.backend() != "tensorflow":
            return state
        if not _single_replica(self.model):
            return state
        import tensorflow as tf

        spe = self.steps_per_execution
        if spe > 1:
            state["rows"] = tf.Variable(
                tf.zeros((spe, len(ROW_FIELDS)), "float32"), trainable=False
            )
            state["position"] = tf.Variable(
                tf.constant(0, "int64"), trainable=False
            )
        if self.optimizer is not None and not self.own_counters:
            # Keras's own LossScaleOptimizer keeps no skip counters.
            state["total"] = tf.Variable(
                tf.constant(0, "int64"), trainable=False
            )
            state["consecutive"] = tf.Variable(
                tf.constant(0, "int64"), trainable=False
            )
        return state

    def _make_step(self, spec, state):
        original = self._original_step()
        if keras.backend.backend() == "jax":
            return self._make_jax_step(original, spec)
        return self._make_tf_step(original, spec, state)

    def _make_tf_step(self, original, spec, state):
        import tensorflow as tf

        model = self.model
        optimizer = self.optimizer
        own_counters = self.own_counters
        keep_batch = self.keep_batch
        publish = self.publish
        spe = self.steps_per_execution
        guarded = is_skip_guard(original)

        def now(variable):
            # A read at this point of the program (a bare variable would be
            # read whenever the function returns). Automatic control
            # dependencies order it against the step's writes.
            if isinstance(variable, keras.Variable):
                variable = variable.value
            return tf.identity(variable)

        def train_step(data):
            # Only variables that exist now: on the first trace the step may
            # create some (that trace only serves to create them).
            watched = _metric_variables(model)
            before = [now(v) for v in watched]
            frozen = None
            if optimizer is not None and not guarded:
                frozen = _skip_guard.Frozen(model)
            if optimizer is not None and not own_counters:
                iterations_before = now(optimizer.iterations)
            logs = original(data)
            if not isinstance(logs, dict):
                return logs
            logs = dict(logs)
            after = [now(v) for v in watched]
            forward = tf.constant(False)
            flags = [
                tf.reduce_any(
                    tf.logical_and(
                        tf.logical_not(tf.math.is_finite(a)),
                        tf.math.is_finite(b),
                    )
                )
                for v, b, a in zip(watched, before, after)
                if _is_float(v)
            ]
            if flags:
                forward = tf.reduce_any(tf.stack(flags))
            zero = tf.constant(0, "int64")
            if optimizer is None:
                skipped = tf.constant(False)
                consecutive = total = zero
                scale = tf.constant(float("nan"), "float32")
            else:
                if own_counters:
                    consecutive = now(optimizer.consecutive_skipped_steps)
                    total = now(optimizer.total_skipped_steps)
                    skipped = consecutive > 0
                else:
                    skipped = tf.equal(
                        now(optimizer.iterations), iterations_before
                    )
                    if "total" in state:
                        step_skips = tf.cast(skipped, "int64")
                        total = state["total"].assign_add(step_skips)
                        consecutive = state["consecutive"].assign(
                            tf.where(
                                skipped, state["consecutive"] + 1, zero
                            )
                        )
                        total, consecutive = tf.identity(total), tf.identity(
                            consecutive
                        )
                    else:
                        total = consecutive = tf.constant(-1, "int64")
                scale = tf.cast(now(scale_variable(optimizer)), "float32")
                if frozen is not None:
                    # A skipped step leaves every variable as it was: what
                    # the forward pass assigned too (batch-norm statistics).
                    frozen.restore(skipped)
                if watched:
                    # A skipped step leaves the metrics as they were.
                    for v, b, a in zip(watched, before, after):
                        v.assign(tf.where(skipped, b, a))
                    fresh = model.get_metrics_result()
                    for k in list(logs):
                        if k in fresh:
                            logs[k] = fresh[k]
            row = tf.stack(
                [
                    tf.cast(skipped, "float32"),
                    tf.cast(consecutive, "float32"),
                    tf.cast(total, "float32"),
                    scale,
                    tf.cast(forward, "float32"),
                ]
            )
            if "rows" in state:
                rows, position = state["rows"], state["position"]
                at = tf.equal(tf.range(spe, dtype="int64"), position % spe)
                rows.assign(tf.where(at[:, None], row[None, :], rows))
                position.assign_add(1)
                logs[_ROWS_KEY] = now(rows)
                logs[_POS_KEY] = now(position)
            else:
                logs[_ROW_KEY] = row
            if publish and optimizer is not None:
                logs[SCALE_KEY] = scale
                if own_counters or "total" in state:
                    logs[SKIPPED_KEY] = total
            if keep_batch:
                logs[_BATCH_KEY] = _flatten_batch(data, spec)
            return logs

        return train_step

    def _make_jax_step(self, original, spec):
        # The batch is kept by the host-side wrapper (see _Batches): on JAX
        # the iterator hands the step's data to Python, so no copy is needed.
        model = self.model
        optimizer = self.optimizer
        own_counters = self.own_counters
        publish = self.publish
        guarded = is_skip_guard(original)

        def train_step(state, data):
            logs, new_state = original(state, data)
            if not isinstance(logs, dict):
                return logs, new_state
            logs = dict(logs)
            watched = _metric_variables(model)
            old_metrics = list(_ki.jax_state_field(state, "metrics_variables"))
            new_metrics = list(
                _ki.jax_state_field(new_state, "metrics_variables")
            )
            flags = [
                ops.any(
                    ops.logical_and(
                        ops.logical_not(ops.isfinite(n)), ops.isfinite(o)
                    )
                )
                for v, o, n in zip(watched, old_metrics, new_metrics)
                if _is_float(v)
            ]
            forward = (
                ops.any(ops.stack(flags)) if flags else ops.array(False)
            )
            if optimizer is None:
                skipped = ops.array(False)
                consecutive = total = ops.array(0)
                scale = ops.array(float("nan"), "float32")
            else:
                index = {id(v): i for i, v in enumerate(optimizer.variables)}
                old_values = _ki.jax_state_field(state, "optimizer_variables")
                new_values = _ki.jax_state_field(
                    new_state, "optimizer_variables"
                )

                def new(variable):
                    return new_values[index[id(variable)]]

                if own_counters:
                    consecutive = new(optimizer.consecutive_skipped_steps)
                    total = new(optimizer.total_skipped_steps)
                    skipped = consecutive > 0
                else:
                    i = index[id(optimizer.iterations)]
                    skipped = ops.equal(new_values[i], old_values[i])
                    consecutive = total = ops.array(-1)
                scale = ops.cast(new(scale_variable(optimizer)), "float32")
                if not guarded:
                    # A skipped step leaves every variable as it was: what
                    # the forward pass assigned too (batch-norm statistics).
                    new_state = _skip_guard.restore_jax(
                        state, new_state, skipped
                    )
                if watched:
                    # A skipped step leaves the metrics as they were.
                    fixed = [
                        ops.where(skipped, o, n)
                        for o, n in zip(old_metrics, new_metrics)
                    ]
                    new_state = (*new_state[:3], fixed)
                    with keras.StatelessScope(
                        state_mapping=list(zip(watched, fixed))
                    ):
                        fresh = model.get_metrics_result()
                    for k in list(logs):
                        if k in fresh:
                            logs[k] = fresh[k]
                if publish:
                    logs[SCALE_KEY] = scale
                    if own_counters:
                        logs[SKIPPED_KEY] = total
            logs[_ROW_KEY] = ops.stack(
                [
                    ops.cast(skipped, "float32"),
                    ops.cast(consecutive, "float32"),
                    ops.cast(total, "float32"),
                    scale,
                    ops.cast(forward, "float32"),
                ]
            )
            return logs, new_state

        return train_step

    # ---------------------------------------------------- host-side wrapper

    def _check_iterator(self, iterator):
        """Raises _Stale when called by a fit this tap does not belong to
        (its monitors' fit was aborted by an exception)."""
        if self._expect_new_iterator or self._iterator is None:
            self._iterator = iterator
            self._expect_new_iterator = False
        elif iterator is not self._iterator:
            raise _Stale()

    def _stale(self):
        """Leaves the model and returns its own train function."""
        self.uninstall()
        model = self.model
        if model.train_function is None:
            model.make_train_function()
        return model.train_function

    def _make_host_function(self):
        if keras.backend.backend() == "jax":

            def train_function(state, iterator):
                try:
                    self._check_iterator(iterator)
                except _Stale:
                    return self._stale()(state, iterator)
                try:
                    return self._run_jax(state, iterator)
                except StopIteration:
                    raise
                except BaseException:
                    self.uninstall()
                    raise

        else:

            def train_function(iterator):
                try:
                    self._check_iterator(iterator)
                except _Stale:
                    return self._stale()(iterator)
                try:
                    return self._post(self._function()(iterator))
                except StopIteration:
                    raise
                except BaseException as e:
                    if type(e).__name__ != "OutOfRangeError":
                        self.uninstall()
                    raise

        return train_function

    def _run_jax(self, state, iterator):
        function = self._function()
        self._batches = []
        iterator = _ki.jax_step_batches(iterator, self.steps_per_execution)
        if self.keep_batch:
            iterator = _Batches(iterator, self._batches)
        rows = []
        logs, state = function(state, iterator)
        if isinstance(logs, dict):
            logs = dict(logs)
            rows.append(logs.pop(_ROW_KEY, None))
        for _ in range(self.steps_per_execution - 1):
            try:
                next_logs, state = function(state, iterator)
            except StopIteration:
                break
            logs = next_logs
            if isinstance(logs, dict):
                logs = dict(logs)
                rows.append(logs.pop(_ROW_KEY, None))
        rows = [r for r in rows if r is not None]
        return self._post(logs, rows), state

    def _post(self, logs, jax_rows=None):
        if not isinstance(logs, dict):
            return logs
        logs = dict(logs)
        self._rows = None
        batch = logs.pop(_BATCH_KEY, None)
        if batch is not None:
            self._last_batch = batch
        if jax_rows is not None:
            self._pending = ("list", jax_rows)
        elif _ROWS_KEY in logs:
            self._pending = ("ring", logs.pop(_ROWS_KEY), logs.pop(_POS_KEY))
        elif _ROW_KEY in logs:
            self._pending = ("list", [logs.pop(_ROW_KEY)])
        else:
            self._pending = None
        if (
            self.publish
            and self.optimizer is not None
            and not self.own_counters
            and SKIPPED_KEY not in logs
            and self._pending is not None
            and self._pending[0] == "list"
        ):
            # Keras's LossScaleOptimizer, counted from the records on the
            # device, lazily (no transfer here).
            flags = [row[0] for row in self._pending[1]]
            count = ops.cast(ops.sum(ops.stack(flags)), "int32")
            self._tally = count if self._tally is None else self._tally + count
            logs[SKIPPED_KEY] = self._tally
        return logs

    def rows(self):
        """The records of the last execution's steps, in order.

        A list of dicts with the keys of `ROW_FIELDS` (Python numbers), one
        per step that ran; `consecutive` and `total` are counted here for
        Keras's LossScaleOptimizer. One transfer from the device.
        """
        if self._rows is not None:
            return self._rows
        pending = self._pending
        if pending is None:
            self._rows = []
            return self._rows
        if pending[0] == "ring":
            table, position = read(pending[1]), int(read(pending[2]))
            k = table.shape[0]
            count = max(0, min(k, position - self._pos_seen))
            self._pos_seen = position
            raw = [table[(position - count + i) % k] for i in range(count)]
        else:
            values = pending[1]
            if len(values) == 1:
                raw = [read(values[0])]
            else:
                raw = list(read(ops.stack(values))) if values else []
        rows = []
        for values in raw:
            row = dict(zip(ROW_FIELDS, (float(v) for v in values)))
            row["skipped"] = row["skipped"] > 0
            row["forward"] = row["forward"] > 0
            if row["consecutive"] < 0:  # counted here
                if row["skipped"]:
                    self._host_consecutive += 1
                    self._host_total += 1
                else:
                    self._host_consecutive = 0
                row["consecutive"] = self._host_consecutive
                row["total"] = self._host_total
            row["consecutive"] = int(row["consecutive"])
            row["total"] = int(row["total"])
            rows.append(row)
        self._rows = rows
        return rows

    def batch(self, offset=0):
        """The batch of a step of the last execution, as `(x, y,
        sample_weight)`, or None when it is not kept.

        `offset` counts back from the execution's last step (0: the last).
        On TensorFlow only the last step's batch is kept.
        """
        if keras.backend.backend() == "jax":
            if offset >= len(self._batches):
                return None
            data = self._batches[len(self._batches) - 1 - offset]
        elif offset != 0 or self._last_batch is None:
            return None
        elif self._spec is None or self._spec.structure is None:
            return None
        else:
            data = _unflatten_batch(self._last_batch, self._spec)
        return keras.utils.unpack_x_y_sample_weight(data)


class _Batches:
    """Iterator proxy that keeps the items it hands out."""

    def __init__(self, iterator, store):
        self._iterator = iterator
        self._store = store

    def __iter__(self):
        return self

    def __next__(self):
        item = next(self._iterator)
        self._store.append(item)
        return item


def _flatten_batch(data, spec):
    flat = keras.tree.flatten(data)
    # Keep the structure only (no tensors: they may be tracers).
    spec.structure = (
        keras.tree.map_structure(lambda t: None, data),
        [t is None for t in flat],
    )
    return tuple(t for t in flat if t is not None)


def _unflatten_batch(tensors, spec):
    structure, is_none = spec.structure
    tensors = iter(tensors)
    flat = [None if none else next(tensors) for none in is_none]
    return keras.tree.pack_sequence_as(structure, flat)


def _single_replica(model):
    if keras.backend.backend() != "tensorflow":
        return True
    strategy = getattr(model, "distribute_strategy", None)
    return strategy is None or strategy.num_replicas_in_sync == 1
