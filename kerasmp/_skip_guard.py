"""The skip guard: steps that kerasmp's optimizer skips leave every variable
of the model as it was.

`compile` calls `guard_skipped_steps(model)` for every model (monitor or
not): while `model.optimizer` is a `kerasmp.LossScaleOptimizer`, the model's
train step is wrapped so that on a skipped step the non-trainable variables
that the forward pass assigned (batch-norm moving statistics, seed states)
get their values from before the step back. `Frozen` (TensorFlow) and
`restore_jax` (JAX) do the write-back; the monitors' step tap
(`kerasmp._step_tap`) uses them too, and leaves that part to the guard when
it wraps a guarded step.
"""

import keras
from keras import ops

from kerasmp import _keras_internals as _ki


def supported():
    """Whether train steps can be wrapped on this backend (TensorFlow; JAX
    without NNX)."""
    backend = keras.backend.backend()
    if backend == "jax":
        return not keras.config.is_nnx_enabled()
    return backend == "tensorflow"


def has_own_counters(optimizer):
    """Whether the optimizer keeps kerasmp's skip counters (once built)."""
    from kerasmp.optimizer import LossScaleOptimizer

    return isinstance(optimizer, LossScaleOptimizer)


_GUARD_FLAG = "_kerasmp_skip_guard"

# Ops that read a variable without writing it.
_READ_OPS = frozenset(
    (
        "ReadVariableOp",
        "ResourceGather",
        "ResourceGatherNd",
        "VarIsInitializedOp",
    )
)


def is_skip_guard(step):
    return bool(getattr(step, _GUARD_FLAG, False))


def _tf_now(variable):
    """A read of `variable` at this point of the program (see `Frozen`)."""
    import tensorflow as tf

    if isinstance(variable, keras.Variable):
        variable = variable.value
    return tf.identity(variable)


def _handle_ids(variable):
    """`id`s of the eager resource handles behind a (distributed) variable."""
    value = variable.value if isinstance(variable, keras.Variable) else variable
    ids = set()
    for part in (value, *getattr(value, "values", ())):
        try:
            ids.add(id(part.handle))
        except (AttributeError, ValueError):
            pass  # a distributed variable outside a replica context
    return ids


def _touched_handles(graph, mark):
    """`id`s of the eager resource handles that the ops added to `graph`
    since `mark` may write: every resource input of an op that is not a
    plain read (an assignment, or a call/cond/loop that may assign), traced
    back through the captures of nested function graphs."""
    import tensorflow as tf

    names = set()
    for op in graph.get_operations()[mark:]:
        if op.type in _READ_OPS:
            continue
        for t in op.inputs:
            if t.dtype == tf.resource:
                names.add(t.name)
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
    """What a TensorFlow train step needs to undo its writes to the model's
    non-trainable variables (batch-norm moving statistics, seed states) when
    the optimizer skips the step.

    Made before the original step runs: reads every non-trainable variable.
    `restore(skipped)` after it writes back the value read before into the
    variables that the step assigned, where `skipped` is true. In a traced
    function only the variables the step's ops may assign are restored (the
    graph is inspected at trace time); reads of the others have no consumer
    and are pruned, so a model whose forward pass assigns nothing pays
    nothing. Eagerly, every non-trainable variable is restored.
    """

    def __init__(self, model):
        import tensorflow as tf

        self.variables = list(model.non_trainable_variables)
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
        """Undoes the step's writes where `skipped` (a bool tensor, or a
        callable returning it, called only when there is something to
        restore)."""
        import tensorflow as tf

        pairs = self.assigned()
        if not pairs:
            return
        if callable(skipped):
            skipped = skipped()
        for v, b in pairs:
            v.assign(tf.where(skipped, b, _tf_now(v)))


def restore_jax(state, new_state, skipped):
    """`new_state` with the non-trainable values the JAX step changed put
    back to those of `state` where `skipped` (a bool, or a callable
    returning it, called only when a value changed). A value the step did
    not assign comes back as the very array it was given: it is left alone,
    so a model whose forward pass assigns nothing pays nothing."""
    field = "non_trainable_variables"
    old = list(_ki.jax_state_field(state, field))
    new = list(_ki.jax_state_field(new_state, field))
    changed = [i for i, (o, n) in enumerate(zip(old, new)) if n is not o]
    if not changed:
        return new_state
    if callable(skipped):
        skipped = skipped()
    for i in changed:
        new[i] = ops.where(skipped, old[i], new[i])
    return _ki.jax_state_replace(new_state, field, new)


def guard_skipped_steps(model):
    """Makes the steps that kerasmp's optimizer skips leave every variable
    of `model` as it was (called by `compile`).

    While `model.optimizer` is a `kerasmp.LossScaleOptimizer`, the model's
    train step is wrapped (an instance attribute `train_step`, as the
    monitors' tap does) so that on a skipped step the non-trainable
    variables the forward pass assigned (batch-norm moving statistics) get
    their values from before the step back: TensorFlow and JAX, with and
    without XLA, under `tf.distribute` (each replica restores its copy; the
    skip decision is the same on every replica). The wrapper decides at
    trace time and adds nothing to the traced step when the forward pass
    assigns no variable. Compiling with another optimizer removes it.
    """
    if not supported():
        return
    current = model.__dict__.get("train_step")
    if has_own_counters(getattr(model, "optimizer", None)):
        if not is_skip_guard(current):
            object.__setattr__(model, "train_step", _make_guard(model, current))
    elif is_skip_guard(current):
        original = getattr(current, "original", None)
        if original is not None:
            object.__setattr__(model, "train_step", original)
        else:
            object.__delattr__(model, "train_step")


def _skip_counter(model):
    """The optimizer's consecutive-skips variable, or None (not kerasmp's
    optimizer, not built)."""
    optimizer = getattr(model, "optimizer", None)
    if not has_own_counters(optimizer):
        return None
    counter = getattr(optimizer, "consecutive_skipped_steps", None)
    return counter if isinstance(counter, keras.Variable) else None


def _make_guard(model, original):
    def step_of(model):
        if original is not None:
            return original
        return type(model).train_step.__get__(model)

    if keras.backend.backend() == "jax":

        def train_step(state, data):
            logs, new_state = step_of(model)(state, data)
            counter = _skip_counter(model)
            if counter is None:
                return logs, new_state
            optimizer = model.optimizer
            index = [id(v) for v in optimizer.variables].index(id(counter))
            return logs, restore_jax(
                state,
                new_state,
                lambda: _ki.jax_state_field(new_state, "optimizer_variables")[
                    index
                ]
                > 0,
            )

    else:

        def train_step(data):
            if not has_own_counters(getattr(model, "optimizer", None)):
                return step_of(model)(data)
            if not model.non_trainable_variables:
                return step_of(model)(data)
            frozen = Frozen(model)
            logs = step_of(model)(data)
            counter = _skip_counter(model)
            if counter is not None:
                # Read after the step: the optimizer may be built by it.
                frozen.restore(lambda: _tf_now(counter) > 0)
            return logs

    setattr(train_step, _GUARD_FLAG, True)
    train_step.original = original
    return train_step
