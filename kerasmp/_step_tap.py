"""Puts loss-scale state (and, on request, the batch) into each step's logs.

Keras hands every callback the same logs dict in list order, and builds the
epoch logs before any callback runs, so a callback that writes `loss_scale`
into the logs itself is too late for a `CSVLogger` or `TensorBoard` placed
before it. Instead, while a monitor is attached, the model's train step is
wrapped so that it returns the optimizer's `dynamic_scale` and skipped-step
counter next to the loss: they are read from the optimizer's variables inside
the compiled step (TensorFlow) or from the optimizer state the step returns
(JAX), and Keras converts them to Python numbers together with the rest of
the logs, with no extra device-to-host transfer. Since Keras's epoch logs are
the last step's logs when those carry keys its metrics don't, the epoch logs
(History, CSVLogger, TensorBoard) get them too.

The wrapped step is installed as an instance attribute `model.train_step`,
and `model.train_function` becomes a thin host-side wrapper that builds the
wrapped Keras train function on its first call (once every monitor of the fit
has joined), pops the private entries (the batch reference kept for
`NonFiniteMonitor(locate=True)`: on TensorFlow the step returns it, on JAX
an iterator proxy sees it go by) from the logs, and returns the rest. The
built function is cached on the model, keyed by the model's own train
function, so later fits with monitors do not trace again. Both attributes are
restored when the last monitor leaves (`on_train_end`), or at the next fit
with a monitor if a fit was aborted.
"""

import keras
from keras import ops

SCALE_KEY = "loss_scale"
SKIPPED_KEY = "skipped_steps"
_BATCH_KEY = "_kerasmp_batch"
_SKIP_FLAG_KEY = "_kerasmp_step_skipped"

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
    return ops.convert_to_numpy(ops.convert_to_tensor(value))


class StepTap:
    """Wraps a model's train step for the monitors of one `fit` call."""

    def __init__(self, model, params):
        self.model = model
        self.params = params
        self.members = set()
        self.publish = False
        self.keep_batch = False
        self.last_batch = None
        self.last_values = {}
        self._spec = None
        self._keras_function = None
        self._host_function = self._make_host_function()
        self._tally = None
        self._dirty = False
        self._installed = False
        self._saved_train_step = model.__dict__.get("train_step")
        self._saved_train_function = model.train_function
        optimizer = model.optimizer
        self.optimizer = optimizer if has_loss_scale(optimizer) else None
        self._skipped_var = skipped_variable(optimizer)
        self.initial_skipped = (
            int(read(self._skipped_var)) if self._skipped_var is not None else 0
        )
        scale = scale_variable(optimizer)
        if scale is not None:
            self.initial_scale = float(read(scale))
        else:
            self.initial_scale = getattr(optimizer, "initial_scale", None)

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

    @staticmethod
    def supported():
        backend = keras.backend.backend()
        if backend == "jax":
            return not keras.config.is_nnx_enabled()
        return backend == "tensorflow"

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
        if keras.backend.backend() == "jax":
            self.model.jax_state_sync()
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
        key = (self.keep_batch, id(self.optimizer))
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
            step = self._make_step(spec)
            object.__setattr__(model, "train_step", step)
            model.make_train_function(force=True)
            entry = {
                "original": self._saved_train_function,
                "step": step,
                "function": model.train_function,
                "spec": spec,
            }
            if not self._dirty:
                cache[key] = entry
        object.__setattr__(model, "train_step", entry["step"])
        model.train_function = self._host_function
        self._spec = entry["spec"]
        self._keras_function = entry["function"]
        return self._keras_function

    def uninstall(self):
        model = self.model
        if model.__dict__.get(_TAP_ATTR) is self:
            object.__delattr__(model, _TAP_ATTR)
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

    # ----------------------------------------------------------- the step

    def _original_step(self):
        if self._saved_train_step is not None:
            return self._saved_train_step
        return type(self.model).train_step.__get__(self.model)

    def _make_step(self, spec):
        original = self._original_step()
        if keras.backend.backend() == "jax":
            return self._make_jax_step(original, spec)
        return self._make_tf_step(original, spec)

    def _make_tf_step(self, original, spec):
        import tensorflow as tf

        optimizer = self.optimizer
        keep_batch = self.keep_batch

        def now(variable):
            # A read at this point of the program (a bare variable would be
            # read whenever the function returns).
            return tf.identity(variable.value)

        def train_step(data):
            use_iterations = (
                optimizer is not None and skipped_variable(optimizer) is None
            )
            if use_iterations:
                before = now(optimizer.iterations)
                with tf.control_dependencies([before]):
                    logs = original(data)
            else:
                logs = original(data)
            if not isinstance(logs, dict):
                return logs
            logs = dict(logs)
            if optimizer is not None:
                logs[SCALE_KEY] = tf.cast(
                    now(scale_variable(optimizer)), "float32"
                )
                skipped = skipped_variable(optimizer)
                if skipped is not None:
                    logs[SKIPPED_KEY] = now(skipped)
                else:
                    after = now(optimizer.iterations)
                    logs[_SKIP_FLAG_KEY] = tf.cast(
                        tf.equal(after, before), "int32"
                    )
            if keep_batch:
                logs[_BATCH_KEY] = _flatten_batch(data, spec)
            return logs

        return train_step

    def _make_jax_step(self, original, spec):
        # The batch is kept by the host-side wrapper (see _LastItem): on JAX
        # the iterator hands the step's data to Python, so no copy is needed.
        optimizer = self.optimizer

        def train_step(state, data):
            logs, new_state = original(state, data)
            if not isinstance(logs, dict):
                return logs, new_state
            logs = dict(logs)
            if optimizer is not None:
                index = {id(v): i for i, v in enumerate(optimizer.variables)}
                old_values, new_values = state[2], new_state[2]
                logs[SCALE_KEY] = ops.cast(
                    new_values[index[id(scale_variable(optimizer))]], "float32"
                )
                skipped = skipped_variable(optimizer)
                if skipped is not None:
                    logs[SKIPPED_KEY] = new_values[index[id(skipped)]]
                else:
                    i = index[id(optimizer.iterations)]
                    logs[_SKIP_FLAG_KEY] = ops.cast(
                        ops.equal(new_values[i], old_values[i]), "int32"
                    )
            return logs, new_state

        return train_step

    # ---------------------------------------------------- host-side wrapper

    def _make_host_function(self):
        tap = self
        if keras.backend.backend() == "jax":

            def train_function(state, iterator):
                if tap.keep_batch:
                    iterator = _LastItem(iterator, tap)
                logs, state = tap._function()(state, iterator)
                return tap._post(logs), state

        else:

            def train_function(iterator):
                return tap._post(tap._function()(iterator))

        return train_function

    def _post(self, logs):
        if not isinstance(logs, dict):
            return logs
        logs = dict(logs)
        batch = logs.pop(_BATCH_KEY, None)
        if batch is not None:
            self.last_batch = batch
        flag = logs.pop(_SKIP_FLAG_KEY, None)
        if flag is not None:
            # Stock LossScaleOptimizer: count skips on the device, lazily.
            self._tally = flag if self._tally is None else self._tally + flag
            logs[SKIPPED_KEY] = self._tally
        if not self.publish:
            self.last_values = {
                k: logs.pop(k) for k in (SCALE_KEY, SKIPPED_KEY) if k in logs
            }
        else:
            self.last_values = {}
        return logs

    def batch(self):
        """The last step's batch as `(x, y, sample_weight)`, or None."""
        if self.last_batch is None:
            return None
        if keras.backend.backend() == "jax":
            data = self.last_batch
        elif self._spec is None or self._spec.structure is None:
            return None
        else:
            data = _unflatten_batch(self.last_batch, self._spec)
        return keras.utils.unpack_x_y_sample_weight(data)

    def values(self, logs):
        """(loss_scale, skipped_steps) of the last step, as Python numbers."""
        source = self.last_values if not self.publish else logs or {}
        scale = source.get(SCALE_KEY)
        skipped = source.get(SKIPPED_KEY)
        if scale is not None:
            scale = (
                float(read(scale)) if not isinstance(scale, float) else scale
            )
        if skipped is not None:
            skipped = (
                int(read(skipped))
                if not isinstance(skipped, (int, float))
                else int(skipped)
            )
        return scale, skipped


class _LastItem:
    """Iterator proxy that remembers the last item it handed out."""

    def __init__(self, iterator, tap):
        self._iterator = iterator
        self._tap = tap

    def __iter__(self):
        return self

    def __next__(self):
        item = next(self._iterator)
        self._tap.last_batch = item
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
