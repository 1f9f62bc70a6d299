"""Find the first layer (and gradient) that goes non-finite on a batch.

`find_nonfinite(model, x, y)` replays one batch eagerly, records every
layer's output in execution order, and, given `y`, computes the gradients of
the (optionally scaled) loss. The model's state (batch-norm statistics, seed
generators, metrics) is restored afterwards, so it is safe to call in the
middle of training. An input beyond float16's range is named as the first
cause.

The batch loss/gradient code it shares with `gradient_report` is in
`kerasmp.debug.batch`.
"""

import contextlib
import dataclasses
import math
import numbers

import keras
import ml_dtypes
import numpy as np

from kerasmp._utils.arrays import FLOAT16_MAX
from kerasmp._utils.arrays import gathered_to_numpy
from kerasmp._utils.arrays import to_numpy
from kerasmp._utils.layers import walk
from kerasmp._utils.table import render_table
from kerasmp.debug.batch import call_kwargs
from kerasmp.debug.batch import concrete
from kerasmp.debug.batch import dense
from kerasmp.debug.batch import fmt
from kerasmp.debug.batch import gradients
from kerasmp.debug.batch import restore
from kerasmp.debug.batch import snapshot
from kerasmp.policy.measure import suspended

_FLOAT_DTYPES = ("float16", "bfloat16", "float32", "float64")


def _float_max(dtype):
    """The largest finite value of `dtype` (a standardized name), or None
    for a dtype that is not one of `_FLOAT_DTYPES`."""
    if dtype not in _FLOAT_DTYPES:
        return None
    return float(ml_dtypes.finfo(dtype).max)


@dataclasses.dataclass
class LayerRow:
    """What one layer produced on the batch.

    Attributes:
        path: the layer's path inside the model, e.g. `"block/dense_1"`.
        class_name: the layer's class.
        dtype: dtype of the output (the layer's compute dtype).
        max_abs: largest |value| in the output; `inf` or `nan` when the output
            holds inf or NaN.
        headroom: `finfo(dtype).max / max_abs`: how many times larger the
            output could get before overflowing (`0.0` when non-finite,
            `inf` for an all-zero output).
        finite: whether every output value is finite.
        grad_max_abs: largest |gradient| of the layer's own trainable
            variables (None without `y`, or when the layer owns none).
        grad_finite: whether those gradients are all finite (None likewise).
    """

    path: str
    class_name: str
    dtype: str
    max_abs: float
    headroom: float
    finite: bool
    grad_max_abs: float = None
    grad_finite: bool = None


class NonFiniteReport:
    """Result of `find_nonfinite`. `print(report)` shows a table.

    Attributes:
        layer: path of the first layer, in execution order, whose output holds
            inf or NaN; None if every output is finite.
        variable: the first trainable variable, in backpropagation order
            (the variable nearest the loss), whose gradient holds inf or NaN,
            as `"<layer path>/<variable name>"` (e.g. `"block/dense_1/kernel"`);
            None if all are finite or no `y` was given.
        rows: one `LayerRow` per layer call, in execution order (a nested
            layer comes before the layer that contains it).
        loss: the unscaled loss on the batch (None without `y`).
        loss_scale: the factor the loss was multiplied by for the gradients.
        inputs_out_of_range: the model inputs holding values beyond
            float16's range (|x| > 65504) while layers of the model compute
            in float16, as `(name, max_abs)` pairs (`name` such as `"x"`,
            `"x[1]"` or `"x['tokens']"`); such an input turns into inf as
            soon as a float16 layer casts it, so it is the first cause of
            anything non-finite after it. Empty otherwise.
        traced: paths of the layers called inside traced control flow
            (`keras.ops.cond`, `while_loop`, `scan`, `vectorized_map` on
            JAX, which traces the branch or body even in an eager pass):
            their outputs hold no values to check, so they have no row; the
            layer that holds the control flow has one, for its outputs.
    """

    def __init__(self, rows, layer, variable, loss, loss_scale, layers,
                 inputs_out_of_range=(), traced=()):
        self.rows = rows
        self.traced = list(traced)
        self.layer = layer
        self.variable = variable
        self.loss = loss
        self.loss_scale = loss_scale
        self._layers = layers
        self.inputs_out_of_range = list(inputs_out_of_range)

    @property
    def cause(self):
        """The first cause found, in one line, or None if all is finite.

        In order: a model input beyond float16's range (when anything
        non-finite followed), the first non-finite layer output, the first
        non-finite gradient, a non-finite loss.
        """
        if self.inputs_out_of_range and not self.finite:
            name, max_abs = self.inputs_out_of_range[0]
            return (
                f"model input {name} holds values up to |x| = "
                f"{fmt(max_abs)}, beyond float16's max 65504: it becomes "
                "inf when a float16 layer casts it (scale or normalize the "
                "inputs)"
            )
        if self.layer is not None:
            return f"layer {self.layer} outputs inf/NaN"
        if self.variable is not None:
            return f"the gradient of {self.variable} holds inf/NaN"
        if self.loss is not None and not math.isfinite(self.loss):
            return f"the loss is {self.loss}"
        return None

    def layer_object(self, path):
        """The layer object at `path` (a path from `rows`)."""
        return self._layers[path]

    @property
    def finite(self):
        """True if no output, gradient or loss was non-finite."""
        loss_ok = self.loss is None or math.isfinite(self.loss)
        return self.layer is None and self.variable is None and loss_ok

    def __str__(self):
        with_grads = any(r.grad_finite is not None for r in self.rows)
        header = ["#", "layer", "class", "dtype", "max|output|", "headroom"]
        if with_grads:
            header.append("max|grad|")
        table = []
        for i, r in enumerate(self.rows):
            line = [
                str(i),
                r.path,
                r.class_name,
                r.dtype,
                fmt(r.max_abs),
                "x" + fmt(r.headroom) if r.finite else "none",
            ]
            if with_grads:
                line.append(
                    "" if r.grad_max_abs is None else fmt(r.grad_max_abs)
                )
            table.append(line)
        first = next(
            (i for i, r in enumerate(self.rows) if not r.finite), None
        )
        lines = [render_table(
            header, table, strip=True,
            marks=None if first is None
            else {first: "<- first non-finite output"},
        )]
        summary = []
        if self.cause is not None:
            summary.append(f"first cause: {self.cause}")
        elif self.inputs_out_of_range:
            name, max_abs = self.inputs_out_of_range[0]
            summary.append(
                f"note: model input {name} holds values up to |x| = "
                f"{fmt(max_abs)}, beyond float16's max 65504 (nothing "
                "non-finite came of it on this batch)"
            )
        if self.traced:
            summary.append(
                f"note: {len(self.traced)} layer(s) ran inside traced "
                "control flow (keras.ops.cond, while_loop, scan): not "
                f"checked, no row ({', '.join(self.traced[:4])}"
                + (", ..." if len(self.traced) > 4 else "") + ")"
            )
        summary.append(f"first non-finite layer output: {self.layer}")
        if with_grads or self.loss is not None:
            summary.append(
                f"first non-finite gradient (backprop order): {self.variable}"
            )
            summary.append(
                f"loss: {fmt(self.loss)} (gradients of loss x "
                f"{fmt(self.loss_scale)})"
            )
        return "\n".join(lines + summary)

    def __repr__(self):
        return (
            f"<NonFiniteReport layer={self.layer!r} variable={self.variable!r}"
            f" rows={len(self.rows)}>"
        )


def layer_paths(model):
    """Maps `id(layer)` to `(path, layer)` for every sublayer of `model`.

    Paths are made of layer names, joined by "/", without the model's own
    name (`kerasmp._utils.layers.walk`). A layer reachable by several paths gets
    the first one found.
    """
    return {id(layer): (path, layer) for path, layer in walk(model)}


@contextlib.contextmanager
def record_calls(layers, record):
    """Calls `record(layer, outputs)` after each of `layers`' `call` returns.

    Each layer's `call` is wrapped for the duration of the `with` block and
    restored afterwards, whatever happens inside it.

    Args:
        layers: The layers to watch (e.g. `layer_paths(model)`'s layers).
        record: A function of `(layer, outputs)`.
    """
    wrapped = []
    for layer in layers:
        if isinstance(layer, keras.layers.InputLayer):
            continue
        had_own = "call" in layer.__dict__
        original = layer.call

        def call(*args, _original=original, _layer=layer, **kwargs):
            outputs = _original(*args, **kwargs)
            record(_layer, outputs)
            return outputs

        # object.__setattr__: keep this out of Keras's attribute tracking.
        object.__setattr__(layer, "call", call)
        wrapped.append((layer, had_own, original))
    try:
        yield
    finally:
        for layer, had_own, original in wrapped:
            if had_own:
                object.__setattr__(layer, "call", original)
            else:
                object.__delattr__(layer, "call")


def _float_arrays(structure):
    """`(arrays, traced)`: `(dtype, NumPy array)` of the concrete float
    tensors in `structure`, and whether any float tensor was not concrete
    (a layer called inside traced control flow: `batch.concrete`)."""
    arrays, traced = [], False
    for t in keras.tree.flatten(structure):
        if t is None or not hasattr(t, "dtype"):
            continue
        dtype = keras.backend.standardize_dtype(t.dtype)
        if _float_max(dtype) is None:
            continue
        if not concrete(t):
            traced = True
            continue
        arrays.append((dtype, gathered_to_numpy(t)))
    return arrays, traced


def _stats(arrays):
    """(dtype, max_abs, headroom, finite) over float arrays; None if none."""
    if not arrays:
        return None
    dtype = arrays[0][0]
    finite = True
    has_nan = False
    max_abs = 0.0
    headroom = math.inf
    for dt, a in arrays:
        a = a.astype(np.float64)
        ok = np.isfinite(a)
        if not ok.all():
            finite = False
            has_nan = has_nan or bool(np.isnan(a).any())
            continue
        if a.size:
            m = float(np.max(np.abs(a)))
            max_abs = max(max_abs, m)
            if m > 0:
                headroom = min(headroom, _float_max(dt) / m)
    if not finite:
        return dtype, (math.nan if has_nan else math.inf), 0.0, False
    return dtype, max_abs, headroom, True


def _current_loss_scale(optimizer):
    """The scale `optimizer` would multiply the next step's loss by: its
    `dynamic_scale`, or before the first step (not built yet) its
    `initial_scale`; 1 for an optimizer without loss scaling."""
    if isinstance(optimizer, keras.optimizers.LossScaleOptimizer):
        if not optimizer.built:
            return float(optimizer.initial_scale)
        return float(to_numpy(optimizer.dynamic_scale))
    scale_var = getattr(optimizer, "dynamic_scale", None)
    return 1.0 if scale_var is None else float(to_numpy(scale_var))


def find_nonfinite(
    model,
    x,
    y=None,
    sample_weight=None,
    loss=None,
    loss_scale=None,
    training=True,
):
    """Replays a batch layer by layer and names the first non-finite result.

    Runs `model` on `x` eagerly, recording each layer's output in execution
    order (Sequential, Functional and subclassed models alike, nested layers
    included, with their paths such as `"block/dense_1"`). With `y`, also
    computes the gradients of `loss x loss_scale` with respect to the
    trainable variables, the way a training step does. Weights are never
    changed; batch-norm statistics, seed generators and metrics are restored
    after the replay.

    Args:
        model: a built or buildable `keras.Model`.
        x: one batch of inputs.
        y: targets for that batch; if given, gradients are checked too.
        sample_weight: optional sample weights for the loss.
        loss: loss to use instead of the model's compiled loss.
        loss_scale: factor applied to the loss before differentiating, as in
            loss-scaled training. None: the current scale of the model's
            optimizer if it has one (`dynamic_scale`; before the first
            step, its `initial_scale`), else 1.
        training: the `training` flag the layers are called with (True
            reproduces a training step: dropout, batch statistics).

    Returns:
        A `NonFiniteReport`.

    Example:

    ```python
    report = kerasmp.debug.find_nonfinite(model, x_batch, y_batch)
    print(report)          # one row per layer: max |output|, headroom
    report.layer           # e.g. "block/attention/softmax", or None
    ```
    """
    if not isinstance(model, keras.Model):
        raise TypeError(
            f"find_nonfinite: `model` must be a keras.Model; received {model!r}"
        )
    if loss_scale is None:
        loss_scale = _current_loss_scale(getattr(model, "optimizer", None))
    elif (
        isinstance(loss_scale, bool)
        or not isinstance(loss_scale, numbers.Real)
        or not math.isfinite(loss_scale)
        or loss_scale <= 0
    ):
        raise ValueError(
            "find_nonfinite: `loss_scale` must be a positive finite number, "
            "or None for the current scale of the model's optimizer. "
            f"Received: loss_scale={loss_scale!r}"
        )
    loss_scale = float(loss_scale)

    paths = layer_paths(model)
    calls = []
    traced = []

    def record(layer, outputs):
        arrays, traced_outputs = _float_arrays(outputs)
        if traced_outputs:
            traced.append(layer)
        calls.append((layer, _stats(arrays)))

    state = snapshot(
        list(model.non_trainable_variables) + list(model.metrics_variables)
    )
    try:
        layers = [layer for _, layer in layer_paths(model).values()]
        # The model as it is: a first call does not measure it here.
        with suspended():
            with record_calls(layers, record):
                model(x, **call_kwargs(model, training))
            restore(state)
            loss_value = grads = None
            if y is not None:
                loss_value, grads = gradients(
                    model, x, y, sample_weight, loss, loss_scale, training
                )
    finally:
        restore(state)

    rows = []
    by_path = {}
    row_index = {}
    first_layer = None
    for layer, stats in calls:
        path, _ = paths[id(layer)]
        by_path[path] = layer
        if stats is None:
            continue
        dtype, max_abs, headroom, finite = stats
        row_index.setdefault(id(layer), len(rows))
        rows.append(
            LayerRow(
                path, type(layer).__name__, dtype, max_abs, headroom, finite
            )
        )
        if not finite and first_layer is None:
            first_layer = path

    first_variable = None
    if grads is not None:
        first_variable = _gradient_rows(
            model, calls, paths, rows, row_index, grads
        )
    return NonFiniteReport(
        rows,
        first_layer,
        first_variable,
        loss_value,
        loss_scale,
        by_path,
        _inputs_out_of_range(model, x),
        traced=list(dict.fromkeys(paths[id(layer)][0] for layer in traced)),
    )


def _computes_in_float16(model):
    layers = [model] + [layer for _, layer in walk(model)]
    return any(
        getattr(layer, "compute_dtype", None) == "float16" for layer in layers
    )


def _input_name(path):
    return "x" + "".join(f"[{key!r}]" for key in path)


def _inputs_out_of_range(model, x):
    """`(name, max_abs)` of the float inputs beyond float16's range.

    Only when some layer of `model` computes in float16 (a float32 model
    takes such inputs in its stride).
    """
    if not _computes_in_float16(model):
        return []
    found = []
    for path, value in keras.tree.flatten_with_path(x):
        if value is None or not hasattr(value, "dtype"):
            continue
        dtype = keras.backend.standardize_dtype(value.dtype)
        if _float_max(dtype) is None:
            continue
        a = gathered_to_numpy(value).astype(np.float64)
        if not a.size:
            continue
        # inf counts (beyond the range); NaN compares False.
        over = np.abs(a)[np.abs(a) > FLOAT16_MAX]
        if over.size:
            found.append((_input_name(path), float(np.max(over))))
    return found


def _gradient_rows(model, calls, paths, rows, row_index, grads):
    """Fills the gradient columns; returns the first non-finite variable."""
    # Each variable belongs to the first layer, in execution order, that owns
    # it: nested layers finish before their parents, so the innermost wins.
    owner = {}
    for position, (layer, _) in enumerate(calls):
        for v in layer.trainable_variables:
            owner.setdefault(id(v), position)
    per_row = {}
    candidates = []
    for index, (v, g) in enumerate(zip(model.trainable_variables, grads)):
        if g is None:
            continue
        g = dense(g).astype(np.float64)
        finite = bool(np.isfinite(g).all())
        if finite:
            max_abs = float(np.max(np.abs(g))) if g.size else 0.0
        else:
            max_abs = math.nan if np.isnan(g).any() else math.inf
        position = owner.get(id(v), len(calls))
        name = v.path
        if position < len(calls):
            layer = calls[position][0]
            name = f"{paths[id(layer)][0]}/{v.name}"
            row = row_index.get(id(layer))
            if row is not None:
                per_row.setdefault(row, []).append((finite, max_abs))
        if not finite:
            candidates.append((position, -index, name))
    for row, values in per_row.items():
        finite = all(f for f, _ in values)
        if finite:
            max_abs = max(m for _, m in values)
        else:
            max_abs = next(m for f, m in values if not f)
        rows[row].grad_max_abs = max_abs
        rows[row].grad_finite = finite
    if not candidates:
        return None
    # Backpropagation order: the variable of the latest-executed layer first;
    # within a layer, its first variable.
    return max(candidates)[2]
