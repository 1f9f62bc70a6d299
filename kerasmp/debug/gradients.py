"""Which loss scale does this model need? `gradient_report` measures it.

`gradient_report(model, x, y)` computes, on one batch, the gradients the way
mixed-precision training computes them (the model's own dtype policy, the
loss multiplied by a candidate scale, the gradients divided by it
afterwards) for every candidate scale, and once more with every layer
computing in float32 and the same weights, as the reference. For each scale
it reports whether a gradient overflowed, the fraction of gradient elements
that underflowed to exactly zero, and the relative error against float32;
from those it recommends a static loss scale.

Nothing is trained: the weights and the optimizer are never touched, and the
model's other state (batch-norm statistics, seed generators, metrics) is
restored after each pass.

`kerasmp.plotting.plot_gradient_report` draws a report; the batch
loss/gradient code it shares with `find_nonfinite` is in
`kerasmp.debug.batch`.
"""

import contextlib
import dataclasses
import math
import numbers

import keras
import numpy as np
from keras import ops

from kerasmp._utils.arrays import to_numpy
from kerasmp._utils.layers import walk
from kerasmp._utils.table import log2_text
from kerasmp._utils.table import render_table
from kerasmp.debug.batch import GRADIENTS
from kerasmp.debug.batch import call_kwargs
from kerasmp.debug.batch import check_loss
from kerasmp.debug.batch import dense
from kerasmp.debug.batch import fmt
from kerasmp.debug.batch import gradients
from kerasmp.debug.batch import gradients_jax
from kerasmp.debug.batch import restore
from kerasmp.debug.batch import snapshot
from kerasmp.policy import stored_policy
from kerasmp.policy.measure import suspended

DEFAULT_SCALES = tuple(2.0**k for k in range(25))
"""The candidate scales `gradient_report` tries by default: 2^0 ... 2^24."""

ERROR_TOLERANCE = 0.1
"""Relative slack on the best error when picking the recommended scale."""

UNDERFLOW_TOLERANCE = 0.01
"""Absolute slack on the lowest underflow when picking the recommendation."""


@dataclasses.dataclass(frozen=True)
class ScaleRow:
    """What the gradients look like at one loss scale.

    Attributes:
        scale: the loss scale.
        overflow: whether any gradient of the scaled loss holds inf or NaN
            (training would skip this step).
        underflow: fraction, in [0, 1], of the gradient elements that are
            nonzero in the float32 reference but exactly zero here, after
            unscaling.
        rel_error: relative L2 error of the unscaled gradients against the
            float32 reference, all variables together (`inf` on overflow).
    """

    scale: float
    overflow: bool
    underflow: float
    rel_error: float

    def to_dict(self):
        return {
            "scale": self.scale,
            "overflow": self.overflow,
            "underflow": self.underflow,
            "rel_error": _json_float(self.rel_error),
        }


@dataclasses.dataclass(frozen=True)
class VariableRow:
    """One trainable variable's gradient at one loss scale.

    Attributes:
        path: the variable's `path`, e.g. `"sequential/dense/kernel"`.
        size: number of elements.
        overflow: whether its scaled gradient holds inf or NaN.
        underflow: fraction of its gradient elements that are nonzero in
            float32 but exactly zero in mixed precision (0 when none is
            nonzero in float32).
        rel_error: relative L2 error of its unscaled gradient against
            float32 (`inf` on overflow; the absolute error when the float32
            gradient is all zero).
    """

    path: str
    size: int
    overflow: bool
    underflow: float
    rel_error: float

    def to_dict(self):
        return {
            "path": self.path,
            "size": self.size,
            "overflow": self.overflow,
            "underflow": self.underflow,
            "rel_error": _json_float(self.rel_error),
        }


def _json_float(value):
    # JSON has no inf/NaN: write them as strings.
    return value if math.isfinite(value) else str(value)


class GradientReport:
    """Result of `gradient_report`. `print(report)` shows a table.

    The recommended scale is chosen by this rule:

    1. Eligible scales do not overflow and sit at least `margin` times below
       the first (smallest) overflowing scale, so that larger gradients on
       other batches still fit. When no scale qualifies, the non-overflowing
       scales below the first overflowing one are used instead.
    2. Among them, the recommendation is the *smallest* scale whose error
       is within 10% of the best eligible error and whose underflow is
       within 1 percentage point of the lowest eligible underflow: as
       accurate as any, with the most headroom.
    3. If every scale overflows, there is no recommendation (None): the
       float16 forward or backward pass overflows whatever the scale, and
       loss scaling cannot help.

    Attributes:
        rows: one `ScaleRow` per candidate scale, ascending.
        recommended_scale: the static loss scale to use, or None.
        first_overflow: the smallest overflowing scale, or None.
        margin: the safety factor used by the rule.
        loss: the unscaled loss of the mixed-precision pass (float).
        loss_float32: the loss of the float32 reference pass (float).
        policy: the name of the model's dtype policy.
    """

    def __init__(self, rows, variables, recommended, first_overflow, margin,
                 loss, loss_float32, policy):
        self.rows = rows
        self._variables = variables  # scale -> [VariableRow]
        self.recommended_scale = recommended
        self.first_overflow = first_overflow
        self.margin = margin
        self.loss = loss
        self.loss_float32 = loss_float32
        self.policy = policy

    @property
    def scales(self):
        """The candidate scales, ascending."""
        return [r.scale for r in self.rows]

    def at(self, scale):
        """The `ScaleRow` of `scale` (one of `scales`)."""
        for r in self.rows:
            if r.scale == float(scale):
                return r
        raise KeyError(
            f"GradientReport.at: scale {scale!r} was not measured; measured "
            f"scales: {', '.join(f'{s:g}' for s in self.scales)}."
        )

    def layers_at(self, scale):
        """Per-variable rows at `scale`, worst first.

        Sorted by relative error, then underflow, both descending.
        """
        self.at(scale)
        return sorted(
            self._variables[float(scale)],
            key=lambda v: (_sort_key(v.rel_error), v.underflow),
            reverse=True,
        )

    @property
    def layers(self):
        """Per-variable rows at the recommended scale, worst first.

        An empty list when there is no recommendation.
        """
        if self.recommended_scale is None:
            return []
        return self.layers_at(self.recommended_scale)

    def to_dict(self):
        """The report as JSON-ready Python types (inf written as "inf")."""
        return {
            "policy": self.policy,
            "loss": _json_float(self.loss),
            "loss_float32": _json_float(self.loss_float32),
            "recommended_scale": self.recommended_scale,
            "first_overflow": self.first_overflow,
            "margin": self.margin,
            "rule": RULE,
            "rows": [r.to_dict() for r in self.rows],
            "layers": [v.to_dict() for v in self.layers],
        }

    def __str__(self):
        table = []
        for r in self.rows:
            table.append((
                f"{r.scale:g}",
                log2_text(r.scale),
                "yes" if r.overflow else "no",
                f"{100 * r.underflow:.2f}%",
                "inf" if not math.isfinite(r.rel_error)
                else f"{r.rel_error:.3g}",
            ))
        lines = [f"gradient_report: policy {self.policy}, loss "
                 f"{fmt(self.loss)} (float32: "
                 f"{fmt(self.loss_float32)})"]
        lines.append(render_table(
            ("scale", "log2", "overflow", "underflow", "rel_error"), table,
            align=">",
            marks={i: "<- recommended" for i, r in enumerate(self.rows)
                   if r.scale == self.recommended_scale},
        ))
        if self.recommended_scale is None:
            lines.append("recommended scale: none (every scale overflows: "
                         "the float16 passes overflow whatever the scale)")
        else:
            lines.append(f"recommended scale: {self.recommended_scale:g} "
                         f"(2^{log2_text(self.recommended_scale)}); first "
                         f"overflow: {_fmt_scale(self.first_overflow)}")
            worst = self.layers[:5]
            if worst:
                lines.append("worst variables at the recommended scale:")
                w = max(len(v.path) for v in worst)
                for v in worst:
                    lines.append(
                        f"  {v.path.ljust(w)}  underflow "
                        f"{100 * v.underflow:6.2f}%  rel_error "
                        f"{v.rel_error:.3g}")
        return "\n".join(lines)

    def __repr__(self):
        return (f"<GradientReport recommended_scale={self.recommended_scale!r}"
                f" first_overflow={self.first_overflow!r} "
                f"scales={len(self.rows)}>")


RULE = (
    "smallest scale whose rel_error is within 10% of the best and whose "
    "underflow is within 1 percentage point of the lowest, among the "
    "non-overflowing scales at least `margin` times below the first "
    "overflowing one"
)


def _sort_key(value):
    return math.inf if math.isnan(value) else value


def _fmt_scale(scale):
    return "none" if scale is None else f"{scale:g} (2^{log2_text(scale)})"


def recommend(rows, margin):
    """Applies `GradientReport`'s rule to `rows`.

    Args:
        rows: `ScaleRow`s, ascending by scale.
        margin: the safety factor below the first overflowing scale.

    Returns:
        `(recommended_scale or None, first_overflow or None)`.
    """
    first_overflow = next((r.scale for r in rows if r.overflow), None)
    ok = [r for r in rows if not r.overflow and math.isfinite(r.rel_error)]
    if first_overflow is not None:
        below = [r for r in ok if r.scale < first_overflow]
        eligible = [r for r in below if r.scale * margin <= first_overflow]
        eligible = eligible or below
    else:
        eligible = ok
    if not eligible:
        return None, first_overflow
    best_error = min(r.rel_error for r in eligible)
    best_underflow = min(r.underflow for r in eligible)
    for r in eligible:
        if (r.rel_error <= best_error * (1 + ERROR_TOLERANCE)
                and r.underflow <= best_underflow + UNDERFLOW_TOLERANCE):
            return r.scale, first_overflow
    return None, first_overflow  # unreachable: the best row qualifies


# --------------------------------------------------------------------------
# Computing the gradients
# --------------------------------------------------------------------------


def _all_layers(model):
    return [model] + [layer for _, layer in walk(model)]


@contextlib.contextmanager
def _float32_everywhere(model):
    """Every layer of `model` computes in float32 inside the block.

    Each layer's stored dtype policy is replaced by `DTypePolicy("float32")`
    through the public `dtype_policy` setter and put back afterwards. The
    variables are not touched: mixed policies keep them in float32 already,
    so the layers compute with exactly the same weights.
    """
    float32 = keras.DTypePolicy("float32")
    changed = []
    try:
        for layer in _all_layers(model):
            stored = stored_policy(layer)
            if (not isinstance(stored, keras.DTypePolicy)
                    or isinstance(stored, keras.dtype_policies.DTypePolicyMap)
                    or stored.quantization_mode is not None):
                continue
            changed.append((layer, stored))
            layer.dtype_policy = float32
        yield
    finally:
        for layer, stored in reversed(changed):
            layer.dtype_policy = stored


class _Passes:
    """Computes `(loss, [numpy gradient or None])` of one pass per scale.

    TensorFlow and PyTorch: eagerly, with `find_nonfinite`'s gradient code.
    JAX: the same code under one `jax.jit` per dtype configuration, with the
    scale, the variable values and the batch as arguments, so that the
    candidate scales share one compiled program (as `fit` compiles its train
    step).
    The model's non-trainable and metric state is restored around each pass.
    """

    def __init__(self, model, x, y, sample_weight, loss, training, state):
        self.model = model
        self.args = (x, y, sample_weight)
        self.loss = loss
        self.training = training
        self.state = state
        self.jitted = None
        if keras.backend.backend() == "jax":
            import jax

            variables = list(model.variables)

            def grads(values, x, y, sample_weight, scale):
                mapping = list(zip(variables, values))
                with keras.StatelessScope(state_mapping=mapping):
                    return gradients_jax(
                        model, x, y, sample_weight, loss, scale, training
                    )

            self.jitted = jax.jit(grads)
            self.variables = variables

    def __call__(self, scale):
        restore(self.state)
        try:
            if self.jitted is not None:
                values = [v.value for v in self.variables]
                value, grads = self.jitted(
                    values, *self.args, ops.convert_to_tensor(scale, "float32")
                )
                value = float(to_numpy(value))
            else:
                check_loss(self.model, self.loss)
                value, grads = gradients(
                    self.model, *self.args, self.loss, scale, self.training
                )
        finally:
            restore(self.state)
        return value, [dense(g) for g in grads]


def _compare(grads, reference, scale):
    """Per-variable (overflow, zero count, nonzero count, err^2, ref^2)."""
    out = []
    for g, r in zip(grads, reference):
        if g is None or r is None:
            out.append(None)
            continue
        overflow = not bool(np.isfinite(g).all())
        # Unscale as LossScaleOptimizer does (divide, back to the gradient's
        # dtype), then compare in float64.
        u = (g.astype(np.float64) / scale).astype(g.dtype).astype(np.float64)
        nonzero = r != 0
        zeros = int(np.count_nonzero(nonzero & (u == 0)))
        n_nonzero = int(np.count_nonzero(nonzero))
        if overflow:
            err2 = math.inf
        else:
            err2 = float(np.sum((u - r) ** 2))
        out.append((overflow, zeros, n_nonzero, err2, float(np.sum(r * r))))
    return out


def _rel(err2, ref2):
    if math.isinf(err2):
        return math.inf
    if ref2 == 0:
        return math.sqrt(err2)
    return math.sqrt(err2 / ref2)


def _validate_scales(scales):
    if scales is None:
        return list(DEFAULT_SCALES)
    if isinstance(scales, (str, bytes)) or not hasattr(scales, "__iter__"):
        scales = [scales]
    values = list(scales)
    bad = [
        s for s in values
        if isinstance(s, bool) or not isinstance(s, numbers.Real)
        or not math.isfinite(s) or s <= 0
    ]
    if bad or not values:
        raise ValueError(
            "gradient_report: `scales` must be a non-empty sequence of "
            f"positive finite numbers (default: 2^0 ... 2^24). Received: "
            f"{scales!r}"
        )
    return sorted({float(s) for s in values})


def gradient_report(model, x, y, scales=None, sample_weight=None, loss=None,
                    training=True, margin=8.0):
    """Measures underflow and overflow of the gradients at each loss scale.

    On one batch, computes the gradients as mixed-precision training does
    (the model's own dtype policy, the loss multiplied by the scale, the
    gradients divided by it afterwards) for each candidate scale, and once
    with every layer computing in float32 with the same weights (the
    reference). Works with Sequential, Functional and subclassed models
    (dict inputs included), on TensorFlow, JAX and PyTorch. The weights and the
    optimizer are never changed; batch-norm statistics, seed generators and
    metrics are restored after every pass.

    Args:
        model: a `keras.Model`, compiled with a loss unless `loss` is given.
        x: one batch of inputs (array, list or dict of arrays).
        y: the targets of that batch.
        scales: the candidate loss scales (positive finite numbers).
            Defaults to the powers of two from 2^0 to 2^24.
        sample_weight: optional sample weights for the loss.
        loss: a loss to use instead of the model's compiled loss.
        training: the `training` flag the layers are called with. True
            reproduces a training step; with dropout, the mixed-precision and
            float32 passes draw different masks, so pass False to compare
            like with like.
        margin: the safety factor (>= 1) the recommendation keeps below the
            first overflowing scale (see `GradientReport`).

    Returns:
        A `GradientReport`.

    Example:

    ```python
    report = kerasmp.debug.gradient_report(model, x_batch, y_batch)
    print(report)
    report.at(1.0).underflow     # fraction of gradients lost without scaling
    optimizer = kerasmp.LossScaleOptimizer(
        keras.optimizers.Adam(), initial_scale=report.recommended_scale,
        dynamic=False)
    ```
    """
    if not isinstance(model, keras.Model):
        raise TypeError(
            f"gradient_report: `model` must be a keras.Model; received "
            f"{model!r}"
        )
    scales = _validate_scales(scales)
    if (isinstance(margin, bool) or not isinstance(margin, numbers.Real)
            or not math.isfinite(margin) or margin < 1):
        raise ValueError(
            "gradient_report: `margin` must be a finite number >= 1. "
            f"Received: {margin!r}"
        )
    if y is None:
        raise ValueError("gradient_report: `y` (the targets) is required.")
    check_loss(model, loss)
    backend = keras.backend.backend()
    if backend not in GRADIENTS:
        raise NotImplementedError(
            "gradient_report runs on the TensorFlow, JAX and PyTorch "
            f"backends only (current: {backend!r})."
        )

    # The model as it is: a first call does not measure it here.
    with suspended():
        return _gradient_report(model, x, y, scales, sample_weight, loss,
                                training, margin)


def _gradient_report(model, x, y, scales, sample_weight, loss, training,
                     margin):
    if not model.built:
        state = snapshot(list(model.variables))
        try:
            model(x, **call_kwargs(model, False))
        finally:
            restore(state)
    state = snapshot(
        list(model.non_trainable_variables) + list(model.metrics_variables)
    )
    variables = list(model.trainable_variables)

    with _float32_everywhere(model):
        loss32, reference = _Passes(
            model, x, y, sample_weight, loss, training, state
        )(1.0)
    reference = [None if r is None else r.astype(np.float64)
                 for r in reference]

    rows = []
    per_variable = {}
    loss_mixed = None
    mixed_pass = _Passes(model, x, y, sample_weight, loss, training, state)
    for scale in scales:
        value, grads = mixed_pass(scale)
        if loss_mixed is None:
            loss_mixed = value
        stats = _compare(grads, reference, scale)
        totals = [0, 0, 0.0, 0.0]
        overflow = False
        var_rows = []
        for v, s in zip(variables, stats):
            if s is None:
                continue
            v_over, zeros, nonzero, err2, ref2 = s
            overflow = overflow or v_over
            totals[0] += zeros
            totals[1] += nonzero
            totals[2] += err2
            totals[3] += ref2
            var_rows.append(VariableRow(
                path=v.path,
                size=int(np.prod(v.shape)),
                overflow=v_over,
                underflow=zeros / nonzero if nonzero else 0.0,
                rel_error=_rel(err2, ref2),
            ))
        rows.append(ScaleRow(
            scale=scale,
            overflow=overflow,
            underflow=totals[0] / totals[1] if totals[1] else 0.0,
            rel_error=_rel(totals[2], totals[3]),
        ))
        per_variable[scale] = var_rows

    recommended, first_overflow = recommend(rows, float(margin))
    return GradientReport(
        rows, per_variable, recommended, first_overflow, float(margin),
        loss_mixed, loss32, model.dtype_policy.name,
    )
