"""The checks of `kerasmp.check` that need a run (`traced_run`).

One forward pass on a sample batch (`x`, or zeros/ones/normal draws shaped
like the model's inputs) in inference mode records each layer's outputs (the
first layer to produce inf/NaN from finite inputs) and, by wrapping
`keras.ops`' exp, log, softmax, log_softmax and logsumexp for the duration of
the pass, which layer calls them on float16 tensors (custom code that no
layer rule sees). Nothing of the model changes.
"""

import contextlib

import keras
import numpy as np

from kerasmp._utils.arrays import is_float
from kerasmp._utils.arrays import to_numpy
from kerasmp.debug.findings import HALF
from kerasmp.debug.findings import Finding
from kerasmp.debug.findings import checked_layers
from kerasmp.debug.findings import dtype_name

TRACED_OPS = ("exp", "log", "softmax", "log_softmax", "logsumexp")


def _sample_inputs(model):
    """Zeros for integer inputs named like ids, ones for masks, normal
    draws for floats; None when the model has no symbolic inputs."""
    try:
        inputs = model.inputs
    except (AttributeError, ValueError):
        return None
    if not inputs:
        return None
    rng = np.random.default_rng(0)

    def make(t):
        shape = tuple(2 if i == 0 else (d or 8)
                      for i, d in enumerate(t.shape))
        dtype = dtype_name(t)
        name = (getattr(t, "name", "") or "").lower()
        if dtype == "bool":
            return np.ones(shape, bool)
        if not is_float(dtype):
            fill = 1 if "mask" in name else 0
            return np.full(shape, fill, dtype=dtype)
        return rng.standard_normal(shape).astype(dtype)

    try:
        structure = model.input
    except (AttributeError, ValueError):
        structure = None
    if isinstance(structure, dict):
        return {k: make(t) for k, t in structure.items()}
    values = [make(t) for t in inputs]
    return values[0] if len(values) == 1 else values


def _nonfinite(structure):
    """Whether a float tensor in `structure` holds NaN or +inf (-inf alone
    is how masks are written, and harmless before a softmax)."""
    for t in keras.tree.flatten(structure):
        if is_float(dtype_name(t)) and not isinstance(t, keras.KerasTensor):
            a = to_numpy(t).astype(np.float64)
            if np.isnan(a).any() or np.isposinf(a).any():
                return True
    return False


@contextlib.contextmanager
def _traced(model, layers, events):
    """Wraps each layer's `call` (a stack of running layers, the first
    inf/NaN output) and `keras.ops`' exp/log/softmax functions (which layer
    calls them on float16 tensors) for the duration of the block."""
    stack = []
    wrapped = []
    for path, layer in layers:
        had_own = "call" in layer.__dict__
        original = layer.call

        def call(*args, _original=original, _path=path, **kwargs):
            if "first_nonfinite" not in events and stack and _nonfinite(
                    (args, kwargs)):
                # Non-finite inputs made inside the running parent's own
                # code (not by a sublayer): the parent is the origin.
                events["first_nonfinite"] = stack[-1]
            stack.append(_path)
            try:
                outputs = _original(*args, **kwargs)
            finally:
                stack.pop()
            if "first_nonfinite" not in events and _nonfinite(outputs):
                events["first_nonfinite"] = _path
            return outputs

        object.__setattr__(layer, "call", call)
        wrapped.append((layer, had_own, original))

    patched = []
    for module in (keras.ops, keras.ops.nn, keras.activations):
        for name in TRACED_OPS:
            fn = getattr(module, name, None)
            if fn is None:
                continue

            def op(x, *args, _fn=fn, _name=name, **kwargs):
                if stack and dtype_name(x) == "float16":
                    events.setdefault("ops", {}).setdefault(
                        (stack[-1], _name), 0)
                    events["ops"][(stack[-1], _name)] += 1
                return _fn(x, *args, **kwargs)

            setattr(module, name, op)
            patched.append((module, name, fn))
    try:
        yield
    finally:
        for module, name, fn in patched:
            setattr(module, name, fn)
        for layer, had_own, original in wrapped:
            if had_own:
                object.__setattr__(layer, "call", original)
            else:
                object.__delattr__(layer, "call")


def traced_run(model, x):
    """`(findings, notes)` of one traced forward pass of `model` on `x`
    (None: a sample batch shaped like the model's inputs)."""
    findings, notes = [], []
    if x is None:
        x = _sample_inputs(model)
    if x is None:
        notes.append("the model has no symbolic inputs: pass `x` (a sample "
                     "batch) to run the traced checks (inf/NaN, float16 "
                     "exp/log/softmax, output dtype)")
        return findings, notes
    layers = checked_layers(model)
    dtypes = {path: layer.compute_dtype for path, layer in layers}
    classes = {path: type(layer).__name__ for path, layer in layers}
    events = {}
    with _traced(model, layers, events):
        outputs = model(x, training=False)

    first = events.get("first_nonfinite")
    if first is not None and not _nonfinite(x):
        if dtypes.get(first) == "float16":
            findings.append(Finding(
                "error", "nonfinite_in_float16", first,
                f"{classes[first]} produced NaN or inf from finite inputs "
                "on a sample batch, computing in float16",
                "a constant or mask value beyond 65504 (such as a -1e9 "
                "attention mask bias) becomes inf in float16, and 0 x inf "
                "or inf - inf is NaN",
                "compute this layer in float32 (`float32_layers`), or use a "
                "mask value float16 can hold (-65504, or "
                "finfo(compute dtype).min)"))
        else:
            notes.append(f"{first} produced NaN or inf on the sample batch in "
                         f"{dtypes.get(first)} (not a half-precision issue)")
    for (path, name), count in sorted(events.get("ops", {}).items()):
        findings.append(Finding(
            "warning", "half_precision_op", path,
            f"{classes.get(path, '')} calls keras.ops {name} on float16 "
            f"tensors ({count} call{'s' if count > 1 else ''})",
            "exp overflows float16 above 11.09, log of a float16 underflow "
            "is -inf, and a float16 softmax's sum loses precision (and "
            "overflows over more than 65504 entries); no kerasmp rule sees "
            "an op inside custom code",
            "cast to float32 around the op in the layer's call, or compute "
            "the layer in float32 (`float32_layers`)"))

    half_outputs = sorted({dtype_name(t) for t in keras.tree.flatten(outputs)
                           if dtype_name(t) in HALF})
    if half_outputs:
        findings.append(Finding(
            "warning", "half_precision_outputs", "",
            f"the model's outputs are {', '.join(half_outputs)}: the loss "
            "sees half-precision values",
            "a loss on float16 logits or probabilities loses precision "
            "(log of a probability below 6e-8 is -inf) and a large logit "
            "may already be inf",
            "end the model with a float32 layer, e.g. "
            "keras.layers.Activation('linear', dtype='float32'), or use a "
            "kerasmp.Policy (its outermost outputs of float32 layers stay "
            "float32)"))
    return findings, notes
