"""Reading a running JAX `fit`'s values in place, without syncing.

During a JAX `fit` Keras keeps the training state (the values of the
trainable, non-trainable, optimizer and metrics variables) as arrays of
its own and leaves the model's variables holding placeholders until the
state is synced (`model.jax_state_sync()`: at each epoch's end, or when a
callback asks). Syncing writes every variable back and makes the next step
re-read them all; on a float8 transformer that was most of a
`Float8Monitor` reading. A callback that needs a few values reads them
here instead: `locate` finds each variable's position in the state once,
`values` indexes the newest state (or reads the variables when no fit is
running or the state is synced).

Used by `Float8Monitor` (`float8_monitor.py`, `_float8_probe.py`).
"""

from kerasmp import _keras_internals as _ki

FIELDS = ("trainable_variables", "non_trainable_variables",
          "optimizer_variables")
"""The state fields a forward pass and a loss scale need, in this order."""


def variable_lists(model):
    """The model's variable lists in `FIELDS` order (the optimizer's
    variables last; empty without an optimizer)."""
    optimizer = getattr(model, "optimizer", None)
    return (list(model.trainable_variables),
            list(model.non_trainable_variables),
            list(optimizer.variables) if optimizer is not None else [])


def locate(model, variables):
    """Each variable's `(field, index)` in the JAX trainer's state (field
    an index into `FIELDS`), or None for one the state does not hold.

    Compute once per model and set of variables: the lists are walked here,
    not at each read."""
    index = {}
    for f, variables_of_field in enumerate(variable_lists(model)):
        for i, v in enumerate(variables_of_field):
            index.setdefault(id(v), (f, i))
    return [index.get(id(v)) for v in variables]


def _running(model, lengths):
    """The running fit's unsynced fields in `FIELDS` order, or None (no
    fit, synced, or a field missing or not of the expected length)."""
    state = _ki.jax_unsynced_state(model)
    if state is None:
        return None
    fields = [state.get(name) for name in FIELDS]
    if lengths is not None and any(
            f is None or len(f) != n for f, n in zip(fields, lengths)):
        return None
    return fields


def values(model, variables, where):
    """The current values of `variables` (backend arrays).

    Args:
        model: The model (its JAX `fit` may be running).
        variables: Keras variables of the model or its optimizer.
        where: `locate(model, variables)`.

    During a JAX `fit` they come from the trainer's newest state, without
    writing anything back; a variable the state does not hold makes this
    sync first (correct, slower). Otherwise they are the variables' values.
    """
    fields = _running(model, None)
    if fields is not None:
        try:
            return [fields[f][i] for f, i in where]
        except (TypeError, IndexError):
            _ki.jax_state_sync(model)
    return [v.value for v in variables]


def all_values(model, lists):
    """The current values of every variable in `lists`
    (`variable_lists(model)`), as three lists in `FIELDS` order: from the
    running fit's newest state when there is one (no sync), else the
    variables' values. Pass them to a jitted function with `mapping` to
    run the model on them."""
    fields = _running(model, [len(vs) for vs in lists])
    if fields is not None:
        return tuple(list(f) for f in fields)
    if _ki.jax_unsynced_state(model) is not None:
        _ki.jax_state_sync(model)
    return tuple([v.value for v in vs] for vs in lists)


def mapping(lists, values_lists):
    """`(variable, value)` pairs for `keras.StatelessScope(state_mapping=
    ...)`, from `variable_lists` and `all_values`."""
    return [pair for vs, vals in zip(lists, values_lists)
            for pair in zip(vs, vals)]
