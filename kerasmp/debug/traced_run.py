"""The checks of `kerasmp.check` that need a run (`traced_run`).

One forward pass on a sample batch (`x`, or zeros/ones/normal draws shaped
like the model's inputs) in inference mode records each layer's outputs (the
first layer to produce inf/NaN from finite inputs) and, by wrapping
`keras.ops`' exp, log, softmax, log_softmax and logsumexp for the duration of
the pass, which layer calls them on float16 tensors (custom code that no
layer rule sees). Nothing of the model changes.

Only concrete values are read. A layer called inside `keras.ops.cond`,
`while_loop`, `scan` or `vectorized_map` gets traced values on JAX (the
branch or loop body is traced even in an eager pass): its outputs cannot be
checked, the report's notes name such layers, and the layer that holds the
control flow is checked on its concrete outputs (so an inf/NaN made inside
a branch is named at that layer).
"""

import contextlib
import re

import keras
import numpy as np

from kerasmp._utils.arrays import is_float
from kerasmp._utils.arrays import to_numpy
from kerasmp._utils.instrument import running_layers
from kerasmp._utils.instrument import watching_ops
from kerasmp.debug.batch import concrete
from kerasmp.debug.findings import HALF
from kerasmp.debug.findings import Finding
from kerasmp.debug.findings import checked_layers
from kerasmp.debug.findings import dtype_name
from kerasmp.policy.measure import suspended

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


def _float_tensors(structure):
    """The float tensors in `structure`, and whether any was not concrete
    (see `kerasmp.debug.batch.concrete`): `(concrete ones, traced)`."""
    found, traced = [], False
    for t in keras.tree.flatten(structure):
        if not is_float(dtype_name(t)):
            continue
        if concrete(t):
            found.append(t)
        else:
            traced = True
    return found, traced


def _nonfinite(tensors):
    """Whether a float tensor of `tensors` holds NaN or +inf (-inf alone is
    how masks are written, and harmless before a softmax)."""
    for t in tensors:
        a = to_numpy(t).astype(np.float64)
        if np.isnan(a).any() or np.isposinf(a).any():
            return True
    return False


@contextlib.contextmanager
def _traced(layers, events):
    """Watches each layer's `call` (the first inf/NaN output) and
    `keras.ops`' exp/log/softmax functions (which layer calls them on
    float16 tensors) for the duration of the block
    (`kerasmp._utils.instrument`)."""

    def around(path, call, args, kwargs):
        inputs, traced = _float_tensors((args, kwargs))
        parent = watch.stack[-2][0] if len(watch.stack) > 1 else None
        if "first_nonfinite" not in events and parent and _nonfinite(inputs):
            # Non-finite inputs made inside the running parent's own code
            # (not by a sublayer): the parent is the origin.
            events["first_nonfinite"] = parent
        outputs = call(*args, **kwargs)
        outputs_found, outputs_traced = _float_tensors(outputs)
        if traced or outputs_traced:
            events.setdefault("traced", []).append(path)
        if "first_nonfinite" not in events and _nonfinite(outputs_found):
            events["first_nonfinite"] = path
        return outputs

    def on_call(current, name, x):
        if current is not None and dtype_name(x) == "float16":
            key = (current[0], name)
            ops = events.setdefault("ops", {})
            ops[key] = ops.get(key, 0) + 1

    with running_layers(layers, around) as watch:
        with watching_ops(watch, TRACED_OPS, on_call):
            yield


def _error_line(error):
    """The first informative line of `error`'s message (Keras wraps a
    layer's error in "Exception encountered when calling ..." and bold
    terminal codes), at most 200 characters."""
    for line in str(error).splitlines():
        line = re.sub(r"\x1b\[[0-9;]*m", "", line).strip()
        if line and not line.startswith("Exception encountered when"):
            return line[:200].rstrip(".")
    return ""


def traced_run(model, x):
    """`(findings, notes)` of one traced forward pass of `model` on `x`
    (None: a sample batch shaped like the model's inputs)."""
    findings, notes = [], []
    given = x is not None
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
    try:
        # The model as it is: its first call does not measure it here.
        with _traced(layers, events), suspended():
            outputs = model(x, training=False)
    except Exception as e:  # noqa: BLE001  (the model's own failure)
        first_line = _error_line(e)
        batch = ("the `x` given" if given else
                 "a sample batch shaped like its inputs (unknown sizes "
                 "set to 8)")
        notes.append(
            f"the traced checks did not run: the model raised "
            f"{type(e).__name__} on {batch}: {first_line}"
            + ("" if given else "; pass `x`, a batch the model accepts "
               "(`kerasmp check --sample FILE`)"))
        return findings, notes

    traced = list(dict.fromkeys(events.get("traced", ())))
    if traced:
        notes.append(
            f"{len(traced)} layer(s) ran inside traced control flow "
            "(keras.ops.cond, while_loop, scan or vectorized_map on JAX), "
            "where values are not concrete: their outputs were not checked "
            f"for inf/NaN ({', '.join(traced[:4])}"
            + (", ..." if len(traced) > 4 else "") + "); the layers that "
            "hold the control flow were, on their outputs")
    first = events.get("first_nonfinite")
    if first is not None and not _nonfinite(_float_tensors(x)[0]):
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
