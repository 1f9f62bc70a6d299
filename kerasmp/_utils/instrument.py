"""Watching a model run: which layer's own code is running, and which of
`keras.ops`' functions it calls.

`running_layers(layers)` wraps each layer's `call` (an instance attribute,
removed on exit) so that a `Watch` knows the stack of running layers and the
innermost layer in which an exception was raised; `watching_ops(watch,
names, on_call)` wraps `keras.ops` functions so that `on_call` sees each
call with the layer that made it. Used by the measurements kerasmp makes at
compile (`kerasmp.policy.measure`) and by `kerasmp.check`'s traced run.
Nothing here changes what the model computes.
"""

import contextlib

import keras


class Watch:
    """What `running_layers` saw.

    Attributes:
        stack: `(path, layer)` of the layers whose `call` is running, the
            innermost last.
        failed_in: `(path, layer)` of the innermost layer whose `call`
            raised, or None.
    """

    def __init__(self):
        self.stack = []
        self.failed_in = None

    @property
    def current(self):
        """`(path, layer)` of the innermost running layer, or None."""
        return self.stack[-1] if self.stack else None


@contextlib.contextmanager
def running_layers(layers, around=None):
    """Wraps the `call` of each `(path, layer)` for the block; yields a
    `Watch`.

    Args:
        layers: `(path, layer)` pairs (`kerasmp._utils.layers.walk`).
        around: Optional `around(path, call, args, kwargs)` that runs the
            wrapped call (default: `call(*args, **kwargs)`), to look at its
            inputs and outputs.
    """
    watch = Watch()
    wrapped = []
    for path, layer in layers:
        had_own = "call" in layer.__dict__
        original = layer.call

        def call(*args, _original=original, _entry=(path, layer), **kwargs):
            watch.stack.append(_entry)
            try:
                if around is None:
                    return _original(*args, **kwargs)
                return around(_entry[0], _original, args, kwargs)
            except Exception:
                if watch.failed_in is None:
                    watch.failed_in = _entry
                raise
            finally:
                watch.stack.pop()

        object.__setattr__(layer, "call", call)
        wrapped.append((layer, had_own, original))
    try:
        yield watch
    finally:
        for layer, had_own, original in reversed(wrapped):
            if had_own:
                object.__setattr__(layer, "call", original)
            else:
                layer.__dict__.pop("call", None)


@contextlib.contextmanager
def watching_ops(watch, names, on_call):
    """Wraps the `keras.ops` functions `names` (where `keras.ops`,
    `keras.ops.nn` and `keras.activations` define them) for the block:
    `on_call(watch.current, name, x)` sees each call, `x` its first
    argument, before the function runs.

    Args:
        watch: The `Watch` of `running_layers`.
        names: Function names, e.g. `("exp", "top_k")`.
        on_call: The function told of each call.
    """
    patched = []
    for module in (keras.ops, keras.ops.nn, keras.activations):
        for name in names:
            fn = getattr(module, name, None)
            if fn is None:
                continue

            def op(x, *args, _fn=fn, _name=name, **kwargs):
                on_call(watch.current, _name, x)
                return _fn(x, *args, **kwargs)

            setattr(module, name, op)
            patched.append((module, name, fn))
    try:
        yield
    finally:
        for module, name, fn in reversed(patched):
            setattr(module, name, fn)
