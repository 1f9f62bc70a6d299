"""The loss-scale rule: one step's state in, the next state out.

As in jmp and optax, the settings (`ScaleRule`) and the state (`ScaleState`)
are frozen dataclasses and the rule is a pure function of them and of the
step's "all gradients finite" flag (`next_state`): it touches no variable.
`kerasmp.LossScaleOptimizer` reads its variables into a `ScaleState`,
calls `next_state` and writes back what changed; kerasmp's train step reads
the state after the step to know whether it was skipped.

`finite` is a bool tensor, or a Python bool inside a branch that already
knows it (then only that branch's ops are built).
"""

import dataclasses

from keras import ops

from kerasmp._utils.arrays import FLOAT16_MAX

AUTO_MARGIN = 8.0
"""How far below float16's largest value `initial_scale="auto"` keeps the
largest gradient (`gradient_report`'s default `margin`)."""


@dataclasses.dataclass(frozen=True)
class ScaleRule:
    """The settings of the loss-scale rule (see `LossScaleOptimizer`).

    Attributes:
        growth_steps: Consecutive finite steps before the scale grows.
        growth_factor: Factor (> 1) applied when the scale grows.
        backoff_factor: Factor in (0, 1) applied when the scale backs off.
        hysteresis: Overflows tolerated before backing off (DeepSpeed's
            `delayed_shift`); 1 backs off on every overflow.
        consecutive_hysteresis: Refill the hysteresis budget on every
            finite step instead of only when the scale grows.
        min_scale: The scale never goes below this.
        max_scale: The scale never goes above this (None: no bound; the
            scale still never becomes inf).
        dynamic: False keeps the scale fixed.
        accumulation_steps: The inner optimizer's gradient accumulation
            window (0 without accumulation).
        auto: Whether the first applied step picks the scale from its
            gradients (`initial_scale="auto"`, see `auto_scale`).
    """

    growth_steps: int
    growth_factor: float
    backoff_factor: float
    hysteresis: int
    consecutive_hysteresis: bool
    min_scale: float
    max_scale: object
    dynamic: bool
    accumulation_steps: int = 0
    auto: bool = False


@dataclasses.dataclass(frozen=True)
class ScaleState:
    """The loss-scale state after a step: tensors (or Python values).

    Attributes:
        scale: The loss scale.
        counter: Finite steps since the scale last grew or backed off.
        budget: The hysteresis budget left.
        total_skipped: Steps skipped so far (the `skipped_steps` log).
        consecutive: Steps skipped in a row, up to this one.
        skipped: Whether the step that led to this state was skipped (its
            gradients were not finite).
        discard: With gradient accumulation, the micro-steps left to
            ignore in a window that overflowed; else None.
        inner_iterations: With gradient accumulation or an "auto" scale,
            the inner optimizer's (micro-)step counter after the step; else
            None.
    """

    scale: object
    counter: object
    budget: object
    total_skipped: object
    consecutive: object
    skipped: object = False
    discard: object = None
    inner_iterations: object = None

    @classmethod
    def from_values(cls, values):
        """The state held by the optimizer's variables, read into `values`
        (a dict keyed by field name, without `skipped`).

        `skipped` is what the rule wrote for the last step: `next_state`
        sets `consecutive` to 0 on every applied step and counts it up on
        every skipped one, so the last step was skipped exactly when it is
        positive.
        """
        return cls(skipped=values["consecutive"] > 0, **values)

    def changed(self, before):
        """`{field: value}` of the fields that are not the very objects of
        `before` (what an update has to write back)."""
        return {
            f.name: getattr(self, f.name)
            for f in dataclasses.fields(self)
            if f.name != "skipped"
            and getattr(self, f.name) is not getattr(before, f.name)
        }


def next_state(rule, state, finite, peak=None):
    """The state after one step, given whether all gradients are finite.

    Args:
        rule: A `ScaleRule`.
        state: The `ScaleState` before the step.
        finite: A scalar bool tensor, or a Python bool.
        peak: With `rule.auto`, the largest |gradient| of the step as it
            was computed (scaled), read on the first applied step; else
            None.

    Returns:
        `(new_state, reset_accumulators)`: the `ScaleState` after the step
        (fields the step does not change are the very objects of `state`)
        and, with gradient accumulation, a bool telling the optimizer to
        drop what its inner optimizer accumulated (False otherwise).

    The rules (PyTorch's `GradScaler`, with DeepSpeed's hysteresis and
    bounds): an overflow skips the step, resets the growth counter and
    spends the hysteresis budget (the scale backs off to
    `max(scale * backoff_factor, min_scale)` once the budget is at 1); after
    `growth_steps` consecutive finite steps the scale grows to
    `min(scale * growth_factor, max_scale)` unless that is not finite. With
    `rule.auto`, the first applied step sets the scale to `auto_scale`.

    Example:

    >>> rule = ScaleRule(2, 2.0, 0.5, 1, False, 1.0, None, True)
    >>> state = ScaleState(scale=8.0, counter=0, budget=1, total_skipped=0,
    ...                    consecutive=0)
    >>> next_state(rule, state, False)[0].scale
    4.0
    """
    overflow = _not(finite)
    grow = False
    if finite is not False:
        counter = state.counter + 1
        grow = _and(finite, counter >= rule.growth_steps)
        counter = _where(_and(finite, _not(grow)), counter, 0)
    else:
        counter = 0
    total = state.total_skipped
    if overflow is not False:
        total = total + (
            1 if overflow is True else ops.cast(overflow, total.dtype)
        )
        consecutive = _where(finite, 0, state.consecutive + 1)
    else:
        consecutive = 0
    scale, budget = state.scale, state.budget
    if rule.dynamic:
        scale, budget = _scale_and_budget(rule, state, overflow, finite, grow)
    if rule.auto and peak is not None and finite is not False:
        first = _and(finite, ops.equal(state.inner_iterations, 1))
        scale = _where(first, auto_scale(rule, peak, state.scale), scale)
        counter = _where(first, 0, counter)
    discard, inner, reset = state.discard, state.inner_iterations, False
    if rule.accumulation_steps:
        discard, inner, reset = _accumulation(rule, state, overflow)
    new = ScaleState(
        scale=scale, counter=counter, budget=budget, total_skipped=total,
        consecutive=consecutive, skipped=overflow, discard=discard,
        inner_iterations=inner,
    )
    return new, reset


def auto_scale(rule, peak, scale):
    """The scale `initial_scale="auto"` picks from one step's gradients.

    The gradients were computed at `scale`, so their largest unscaled
    magnitude is `peak / scale`; the scale is the largest power of two that
    keeps it `AUTO_MARGIN` (8) times below float16's largest value, 65504
    (the margin `gradient_report` recommends under), within
    `[min_scale, max_scale]`. All-zero gradients say nothing: the scale is
    kept.

    Args:
        rule: A `ScaleRule`.
        peak: The step's largest |gradient| (scaled), a float32 tensor.
        scale: The scale the gradients were computed at.

    Example:

    >>> rule = ScaleRule(2000, 2.0, 0.5, 1, False, 1.0, 2.0**24, True)
    >>> float(auto_scale(rule, ops.convert_to_tensor(3.0), 1.0))
    2048.0
    """
    unscaled = peak / scale
    exponent = ops.floor(ops.log2(FLOAT16_MAX / (AUTO_MARGIN * unscaled)))
    picked = ops.power(2.0, exponent)
    upper = rule.max_scale if rule.max_scale is not None else 2.0**126
    picked = ops.clip(picked, rule.min_scale, upper)
    return ops.where(unscaled > 0, picked, scale)


def _scale_and_budget(rule, state, overflow, finite, grow):
    scale = state.scale
    budget = state.budget
    back_off = overflow
    if rule.hysteresis > 1:
        refill = finite if rule.consecutive_hysteresis else grow
        if overflow is not False:
            back_off = _and(overflow, budget <= 1)
            budget = _where(_and(overflow, budget > 1), budget - 1, budget)
        budget = _where(refill, rule.hysteresis, budget)
    new_scale = scale
    if back_off is not False:
        backed_off = ops.maximum(scale * rule.backoff_factor, rule.min_scale)
        new_scale = _where(back_off, backed_off, new_scale)
    if grow is not False:
        grown = scale * rule.growth_factor
        if rule.max_scale is not None:
            grown = ops.minimum(grown, rule.max_scale)
        # Never grow to inf (PyTorch's rule): keep the scale instead.
        grown = ops.where(ops.isfinite(grown), grown, scale)
        new_scale = _where(grow, grown, new_scale)
    return new_scale, budget


def _accumulation(rule, state, overflow):
    """An overflow in a window not yet discarded: roll the inner
    optimizer's micro-step counter back to the window's start, drop what it
    accumulated, and ignore the rest of the window."""
    k = rule.accumulation_steps
    discard = state.discard
    first = _and(overflow, ops.equal(discard, 0))
    rest = 0
    iterations = state.inner_iterations
    if first is not False:
        position = iterations % k
        iterations = _where(first, iterations - position, iterations)
        rest = _where(first, k - 1 - position, 0)
    discard = ops.where(discard > 0, discard - 1, rest)
    return discard, iterations, first


def _not(a):
    return (not a) if isinstance(a, bool) else ops.logical_not(a)


def _and(a, b):
    if isinstance(a, bool):
        return b if a else False
    if isinstance(b, bool):
        return a if b else False
    return ops.logical_and(a, b)


def _where(condition, a, b):
    if isinstance(condition, bool):
        return a if condition else b
    return ops.where(condition, a, b)
