"""`kerasmp.LossScaleOptimizer`: loss scaling that never corrupts the weights.

A drop-in subclass of `keras.optimizers.LossScaleOptimizer` (so `compile()`
never wraps it a second time) with configurable growth and backoff factors,
DeepSpeed-style hysteresis, a floor and a ceiling for the scale, a static
mode, counters of skipped steps, and an overflow decision that every replica
of a `tf.distribute` strategy takes together. docs/loss_scaling.md states the
rules next to PyTorch's, DeepSpeed's and Megatron's.

The per-step rule is `kerasmp.optimizer.scale_rule.next_state`, a pure
function. The TensorFlow path evaluates it inside each branch of one `cond`
(with the flag known there, so a step builds only its branch's few scalar
ops) and assigns the results; the JAX path (`stateless_apply`, also used by
`apply` outside `fit`) evaluates it on the flag tensor and returns them.
"""

import dataclasses
import inspect
import numbers

import keras
from keras import ops

from kerasmp import _keras_internals as _ki
from kerasmp._utils.arrays import to_numpy
from kerasmp._utils.warn import at_caller
from kerasmp.optimizer.arguments import AUTO
from kerasmp.optimizer.arguments import DEFAULT_GROWTH_STEPS
from kerasmp.optimizer.arguments import DEFAULT_INITIAL_SCALE
from kerasmp.optimizer.arguments import DEFAULT_MAX_SCALE
from kerasmp.optimizer.arguments import DEFAULT_MIN_SCALE
from kerasmp.optimizer.arguments import SETTINGS
from kerasmp.optimizer.arguments import resolve
from kerasmp.optimizer.gradients import map_values
from kerasmp.optimizer.gradients import max_abs
from kerasmp.optimizer.gradients import values
from kerasmp.optimizer.saving import ScaleStateStore
from kerasmp.optimizer.saving import kerasmp_variables
from kerasmp.optimizer.saving import load_layout
from kerasmp.optimizer.saving import save_stock_layout
from kerasmp.optimizer.scale_rule import ScaleRule
from kerasmp.optimizer.scale_rule import ScaleState
from kerasmp.optimizer.scale_rule import next_state
from kerasmp.optimizer.unbuilt import UnbuiltState


@keras.saving.register_keras_serializable(package="kerasmp")
class LossScaleOptimizer(UnbuiltState, keras.optimizers.LossScaleOptimizer):
    """An optimizer wrapper that scales the loss and skips non-finite steps.

    Each step the gradients (of the scaled loss) are checked for inf/NaN,
    across all replicas when running under a `tf.distribute` strategy.

    - Non-finite: the update is skipped (weights, the inner optimizer's slots
      and `iterations` untouched), the growth counter resets, the skipped-step
      counters advance, and the hysteresis budget is spent: while it is above
      1 it is decremented and the scale kept; at 1 the scale backs off to
      `max(scale * backoff_factor, min_scale)`.
    - Finite: the gradients are divided by the scale and handed to the inner
      optimizer (whose clipping therefore sees unscaled gradients). After
      `dynamic_growth_steps` consecutive finite steps the scale grows to
      `min(scale * growth_factor, max_scale)`, unless that is not finite.
      The hysteresis budget refills when the scale grows, or on every finite
      step if `consecutive_hysteresis` (DeepSpeed's semantics).

    With `hysteresis=1` and no bound binding, the scale follows PyTorch's
    `GradScaler` step for step. With `dynamic=False` the scale stays at
    `initial_scale`, and non-finite steps are still skipped and counted.

    If the inner optimizer accumulates gradients
    (`gradient_accumulation_steps=k`), an overflow discards its whole
    accumulation window: the micro-batches before it are dropped, those after
    it up to the window's normal boundary are ignored, and the next window
    starts where it would have started anyway.

    Args:
        inner_optimizer: the `keras.optimizers.Optimizer` to wrap, or
            Keras's own `keras.optimizers.LossScaleOptimizer` (the
            TensorFlow guide's): its inner optimizer is wrapped, with its
            initial scale (its current scale once it has trained) and its
            growth interval unless those are given here.
        initial_scale: starting loss scale, in `[min_scale, max_scale]`, or
            `"auto"`: start at 1 and let the first applied step pick the
            scale from its own gradients (the largest power of two keeping
            the largest gradient 8 times below float16's 65504; no extra
            pass). Defaults to 2**15, moved into that range when
            `min_scale` or `max_scale` excludes it (an explicit value
            outside raises).
        dynamic_growth_steps: consecutive finite steps before the scale
            grows (an integer, at most 2**31 - 1). Defaults to 2000.
        growth_factor: factor (> 1) applied when the scale grows; it must
            stay above 1 and finite when rounded to float32.
        backoff_factor: factor in (0, 1) applied when the scale backs off;
            it must stay below 1 and a normal number in float32.
        hysteresis: overflows tolerated before backing off (DeepSpeed's
            `delayed_shift`); 1 backs off on every overflow.
        consecutive_hysteresis: refill the hysteresis budget on every finite
            step instead of only when the scale grows (a bool).
        min_scale: the scale never goes below this; at least the smallest
            normal float32 (about 1.18e-38), so it never underflows to 0.
        max_scale: the scale never goes above this; at most the largest
            finite float32 (about 3.4e38), or `None` for no bound (the scale
            still never becomes inf).
        dynamic: `False` keeps the scale fixed at `initial_scale` (a bool).
        name: the optimizer's name.

    Every argument is checked at construction against what the state can
    hold (a float32 scale, int32 counters): a bad value raises a
    `ValueError` naming the argument and its allowed values. Python and
    NumPy numbers, integers and bools are accepted alike.

    Example:

    ```python
    optimizer = LossScaleOptimizer(
        keras.optimizers.Adam(1e-3), hysteresis=2, max_scale=2.0**16
    )
    model.compile(optimizer=optimizer, loss="mse")
    ```
    """

    def __init__(
        self,
        inner_optimizer,
        initial_scale=DEFAULT_INITIAL_SCALE,
        dynamic_growth_steps=DEFAULT_GROWTH_STEPS,
        growth_factor=2.0,
        backoff_factor=0.5,
        hysteresis=1,
        consecutive_hysteresis=False,
        min_scale=DEFAULT_MIN_SCALE,
        max_scale=DEFAULT_MAX_SCALE,
        dynamic=True,
        name=None,
        **kwargs,
    ):
        inner_optimizer, settings, name = resolve(
            inner_optimizer,
            _is_stock(inner_optimizer),
            initial_scale=initial_scale,
            dynamic_growth_steps=dynamic_growth_steps,
            growth_factor=growth_factor,
            backoff_factor=backoff_factor,
            hysteresis=hysteresis,
            consecutive_hysteresis=consecutive_hysteresis,
            min_scale=min_scale,
            max_scale=max_scale,
            dynamic=dynamic,
            name=name,
        )
        super().__init__(
            inner_optimizer,
            initial_scale=settings["initial_scale"],
            dynamic_growth_steps=settings["dynamic_growth_steps"],
            name=name,
            **kwargs,
        )
        for key, value in settings.items():
            setattr(self, key, value)
        # kerasmp's own state, where a file keeps it apart from the stock
        # optimizer's (kerasmp.optimizer.saving).
        self.kerasmp_scale_state = ScaleStateStore(self._kerasmp_variables)

    @classmethod
    def settings_for(cls, optimizer):
        """The settings of `LossScaleOptimizer(optimizer)`, without making
        it (making an optimizer creates variables: under a distribution,
        collectives): `{attribute: value}` for `auto`, `initial_scale`,
        `dynamic_growth_steps`, `growth_factor`, `backoff_factor`,
        `hysteresis`, `consecutive_hysteresis`, `min_scale`, `max_scale`,
        `dynamic`. For a kerasmp `LossScaleOptimizer`, its own.

        Args:
            optimizer: a Keras optimizer (or Keras's own
                `LossScaleOptimizer`, whose scale and interval are kept).

        Example:

        >>> settings = LossScaleOptimizer.settings_for(keras.optimizers.SGD())
        >>> settings["hysteresis"], settings["max_scale"]
        (1, 16777216.0)
        """
        if isinstance(optimizer, cls):
            return {key: getattr(optimizer, key) for key in SETTINGS}
        parameters = inspect.signature(cls.__init__).parameters.items()
        defaults = {key: p.default for key, p in parameters
                    if p.default is not p.empty}
        return resolve(optimizer, _is_stock(optimizer), **defaults)[1]

    # ------------------------------------------------------------------ state

    @_ki.no_automatic_dependency_tracking
    def build(self, var_list):
        # Keras's own state first (step_counter, dynamic_scale), then ours, so
        # that the first variables keep the stock optimizer's layout.
        super().build(var_list)
        int_state = dict(shape=(), dtype="int", aggregation="none")
        self.hysteresis_budget = self.add_variable(
            initializer=keras.initializers.Constant(self.hysteresis),
            name="hysteresis_budget",
            **int_state,
        )
        self.total_skipped_steps = self.add_variable(
            initializer="zeros", name="skipped_steps", **int_state
        )
        self.consecutive_skipped_steps = self.add_variable(
            initializer="zeros", name="consecutive_skipped_steps", **int_state
        )
        if self._accumulation_steps:
            # Micro-steps left to ignore in an accumulation window that
            # overflowed.
            self.discarded_micro_steps = self.add_variable(
                initializer="zeros", name="discarded_micro_steps", **int_state
            )

    @property
    def loss_scale(self):
        """The current loss scale, as a Python float."""
        if not self.built:
            return float(self.initial_scale)
        return float(to_numpy(self.dynamic_scale))

    @property
    def skipped_steps(self):
        """How many steps were skipped for non-finite gradients, as an int."""
        if not self.built:
            return 0
        return int(to_numpy(self.total_skipped_steps))

    @property
    def _accumulation_steps(self):
        return self.inner_optimizer.gradient_accumulation_steps or 0

    @property
    def scale_rule(self):
        """The `ScaleRule` this optimizer applies (its settings)."""
        return ScaleRule(
            growth_steps=self.dynamic_growth_steps,
            growth_factor=self.growth_factor,
            backoff_factor=self.backoff_factor,
            hysteresis=self.hysteresis,
            consecutive_hysteresis=self.consecutive_hysteresis,
            min_scale=self.min_scale,
            max_scale=self.max_scale,
            dynamic=self.dynamic,
            accumulation_steps=self._accumulation_steps,
            auto=self.auto,
        )

    def state_variables(self):
        """The variables behind each `ScaleState` field (built optimizer):
        `{field: variable}`, without `skipped`, which no variable holds."""
        state = {
            "scale": self.dynamic_scale,
            "counter": self.step_counter,
            "budget": self.hysteresis_budget,
            "total_skipped": self.total_skipped_steps,
            "consecutive": self.consecutive_skipped_steps,
        }
        if self._accumulation_steps:
            state["discard"] = self.discarded_micro_steps
        if self._accumulation_steps or self.auto:
            state["inner_iterations"] = _ki.optimizer_iterations(
                self.inner_optimizer
            )
        return state

    def _kerasmp_variables(self):
        """`{name: variable}` of the state stock Keras's optimizer lacks."""
        return kerasmp_variables(self) if self.built else {}

    def save_own_variables(self, store):
        # kerasmp.optimizer.saving: stock Keras's layout here, the rest in
        # `kerasmp_scale_state`.
        save_stock_layout(self, store)

    @at_caller  # Keras's warning where stock Keras shows it (saving_lib)
    def load_own_variables(self, store):
        if not load_layout(self, store):
            super().load_own_variables(store)  # Keras's warning, no load

    def read_state(self, value_of=ops.convert_to_tensor):
        """The `ScaleState` the variables hold now (after a step: whether
        it was skipped, the scale, the counts).

        Args:
            value_of: How to read one variable (in a traced step, the
                value at that point of the program).
        """
        return ScaleState.from_values(
            {k: value_of(v) for k, v in self.state_variables().items()}
        )

    # ------------------------------------------------------------ the update

    def check_finite(self, grads):
        """A scalar bool: whether every gradient is free of inf and NaN."""
        flags = [
            ops.all(ops.isfinite(values(g))) for g in grads if g is not None
        ]
        return (
            ops.all(ops.stack(flags)) if flags else ops.convert_to_tensor(True)
        )

    def _unscale(self, grads, scale, trainable_variables):
        return [
            g
            if g is None or _ki.overwrites_with_gradient(self, v)
            else map_values(lambda x: ops.cast(x / scale, x.dtype), g)
            for g, v in zip(grads, trainable_variables)
        ]

    def _unscale_grads(self, grads, variables):
        # Keras 3.16 gathers the stock optimizer's unscaling into this
        # method (`_keras_internals.UNSCALE_GRADS_ATTR`), which its `apply`
        # and `stateless_apply` call. kerasmp's own replace those and never
        # reach it; any inherited path that does unscales as kerasmp does:
        # in each gradient's dtype (stock Keras's division makes a float16
        # gradient float32), sparse gradients kept sparse.
        return self._unscale(grads, self.dynamic_scale, variables)

    def apply(self, grads, trainable_variables=None):
        if not self.built:
            with keras.name_scope(self.name, caller=self):
                self.build(trainable_variables)
            self.built = True
        backend = keras.backend.backend()
        if backend == "tensorflow":
            self._tf_apply(grads, trainable_variables)
        elif backend == "jax":
            self._jax_apply(grads, trainable_variables)
        else:
            self._stateful_apply(
                grads, trainable_variables, self.check_finite(grads),
                self._peak(
                    grads, _ki.optimizer_iterations(self.inner_optimizer)
                ),
            )

    def _apply_inner(self, grads, trainable_variables):
        tvs = trainable_variables or _ki.optimizer_trainable_variables(
            self
        )
        self.inner_optimizer.apply(
            self._unscale(grads, self.dynamic_scale, tvs),
            trainable_variables=trainable_variables,
        )

    def _peak(self, grads, iterations):
        """With `initial_scale="auto"`: the largest |gradient| while no step
        has been applied yet (`iterations`, the inner optimizer's, is 0),
        the value the first applied step picks the scale from; else None.
        """
        if not self.auto:
            return None
        return _branch(
            ops.equal(iterations, 0),
            lambda: max_abs(grads),
            lambda: ops.zeros((), "float32"),
        )

    def _finite_step(self, apply_fn, peak=None):
        """Applies (unless the accumulation window is being discarded), then
        updates the state as after a finite step."""
        if self._accumulation_steps:
            _branch(ops.equal(self.discarded_micro_steps, 0), apply_fn, _no_op)
        else:
            apply_fn()
        self._update_state(True, peak)

    def _stateful_apply(self, grads, trainable_variables, finite, peak=None):
        """Applies or skips, then updates the scale state (TF, torch)."""
        _branch(
            finite,
            lambda: self._finite_step(
                lambda: self._apply_inner(grads, trainable_variables), peak
            ),
            lambda: self._update_state(False),
        )

    def _update_state(self, finite, peak=None):
        variables = self.state_variables()
        before = ScaleState(
            **{k: ops.convert_to_tensor(v) for k, v in variables.items()}
        )
        after, reset = next_state(self.scale_rule, before, finite, peak)
        for key, value in after.changed(before).items():
            variables[key].assign(ops.cast(value, variables[key].dtype))
        if reset is not False:
            _branch(
                reset,
                lambda: _ki.reset_gradient_accumulators(self.inner_optimizer),
                _no_op,
            )

    def _tf_apply(self, grads, trainable_variables=None):
        import tensorflow as tf

        if tf.distribute.in_cross_replica_context():
            raise ValueError("apply() must be called in a replica context.")
        iterations = _ki.optimizer_iterations(self.inner_optimizer)
        if not tf.distribute.has_strategy():
            self._stateful_apply(
                grads, trainable_variables, self.check_finite(grads),
                self._peak(grads, iterations),
            )
            return
        if tf.__internal__.distribute.strategy_supports_no_merge_call():
            # Pure replica context: agree on the flag with an all-reduce.
            context = tf.distribute.get_replica_context()
            overflows = context.all_reduce(
                tf.distribute.ReduceOp.SUM, self._overflow_count(grads)
            )
            peak = self._peak(grads, iterations)
            if peak is not None:
                peak = context.all_reduce(tf.distribute.ReduceOp.MAX, peak)
            self._stateful_apply(
                grads, trainable_variables, overflows == 0, peak
            )
            return

        def merge_fn(distribution, grads, trainable_variables):
            per_replica = distribution.extended.call_for_each_replica(
                self._overflow_count, args=(grads,)
            )
            # Every replica's flag, across workers too, not replica 0's alone:
            # all replicas apply the same all-reduced gradients, so all must
            # take the same branch.
            overflows = distribution.reduce(
                tf.distribute.ReduceOp.SUM, per_replica, axis=None
            )
            peak = None
            if self.auto:
                peak = distribution.reduce(
                    tf.distribute.ReduceOp.MAX,
                    distribution.extended.call_for_each_replica(
                        self._peak, args=(grads, iterations)
                    ),
                    axis=None,
                )
            # The cond must sit in cross-replica context: the inner apply
            # calls merge_call, which a cond in replica context forbids. The
            # state is updated here too, so every copy gets the same value.
            ops.cond(
                overflows == 0,
                lambda: self._finite_step(
                    lambda: distribution.extended.call_for_each_replica(
                        self._apply_inner, args=(grads, trainable_variables)
                    ),
                    peak,
                ),
                lambda: self._update_state(False),
            )

        tf.distribute.get_replica_context().merge_call(
            merge_fn, args=(grads, trainable_variables)
        )

    def _overflow_count(self, grads):
        return ops.cast(ops.logical_not(self.check_finite(grads)), "float32")

    def _jax_apply(self, grads, trainable_variables=None):
        # Run the stateless update and write its results back: stateful
        # assignments inside `lax.cond` branches would leak tracers (the stock
        # optimizer's UnexpectedTracerError outside `fit`).
        built_with = _ki.optimizer_trainable_variables(self)
        if trainable_variables is not None:
            full = [None] * len(built_with)
            for g, v in zip(grads, trainable_variables):
                full[_ki.optimizer_variable_index(self, v)] = g
            grads = full
        if getattr(self, "_jitted_stateless_apply", None) is None:
            import jax

            self._jitted_stateless_apply = jax.jit(self.stateless_apply)
        new_trainable, new_optimizer = self._jitted_stateless_apply(
            [v.value for v in self.variables],
            list(grads),
            [v.value for v in built_with],
        )
        for variable, value in zip(built_with, new_trainable):
            variable.assign(value)
        for variable, value in zip(self.variables, new_optimizer):
            variable.assign(value)

    def stateless_apply(self, optimizer_variables, grads, trainable_variables):
        if not self.built:
            raise ValueError(
                f"To call `stateless_apply`, {self.__class__.__name__} "
                "must be built (i.e. its variables must have been created). "
                "You can build it via `optimizer.build(trainable_variables)`."
            )
        optimizer_variables = list(optimizer_variables)
        trainable_variables = list(trainable_variables)
        index = {id(v): i for i, v in enumerate(self.variables)}
        own_count = len(_ki.optimizer_own_variables(self))
        inner_values = optimizer_variables[own_count:]
        state_variables = self.state_variables()
        before = ScaleState(**{
            k: optimizer_variables[index[id(v)]]
            for k, v in state_variables.items()
        })

        finite = self.check_finite(grads)
        peak = None
        if self.auto:
            peak = self._peak(grads, before.inner_iterations)
        apply_now = finite
        if self._accumulation_steps:
            apply_now = ops.logical_and(finite, before.discard == 0)

        def apply_inner():
            unscaled = self._unscale(
                grads, before.scale, _ki.optimizer_trainable_variables(self)
            )
            new_tvs, new_inner = self.inner_optimizer.stateless_apply(
                inner_values, unscaled, trainable_variables
            )
            return list(new_tvs), list(new_inner)

        new_tvs, new_inner = ops.cond(
            apply_now, apply_inner, lambda: (trainable_variables, inner_values)
        )
        new_values = optimizer_variables[:own_count] + list(new_inner)
        if before.inner_iterations is not None:
            # After the inner update, as the stateful path reads it.
            i = index[id(_ki.optimizer_iterations(self.inner_optimizer))]
            before = dataclasses.replace(before, inner_iterations=new_values[i])
        after, reset = next_state(self.scale_rule, before, finite, peak)
        for key, value in after.changed(before).items():
            i = index[id(state_variables[key])]
            new_values[i] = ops.cast(value, new_values[i].dtype)
        if reset is not False:
            for acc in _ki.accumulated_gradients(self.inner_optimizer):
                i = index[id(acc)]
                current = new_values[i]
                new_values[i] = ops.cond(
                    reset,
                    lambda c=current: ops.zeros_like(c),
                    lambda c=current: c,
                )
        return new_tvs, new_values

    def get_config(self):
        config = super().get_config()
        if self.auto:
            config["initial_scale"] = AUTO
        config.update(
            {
                "growth_factor": self.growth_factor,
                "backoff_factor": self.backoff_factor,
                "hysteresis": self.hysteresis,
                "consecutive_hysteresis": self.consecutive_hysteresis,
                "min_scale": self.min_scale,
                "max_scale": self.max_scale,
                "dynamic": self.dynamic,
            }
        )
        return config

    @classmethod
    @at_caller
    def from_config(cls, config, custom_objects=None):
        # Accepts configs written by stock Keras's LossScaleOptimizer too:
        # theirs is a subset of ours. Does not modify `config`.
        config = dict(config)
        # Stock Keras has no bounds, so its `initial_scale` may lie outside
        # our default ones: widen a default bound that the config does not
        # set just enough to hold it (an explicit bound is kept, and raises).
        initial = config.get("initial_scale")
        if isinstance(initial, numbers.Real) and not isinstance(initial, bool):
            if "min_scale" not in config and initial < DEFAULT_MIN_SCALE:
                config["min_scale"] = initial
            if "max_scale" not in config and initial > DEFAULT_MAX_SCALE:
                config["max_scale"] = initial
        return super().from_config(config, custom_objects=custom_objects)


def _no_op():
    return None


def _branch(pred, true_fn, false_fn):
    """`ops.cond(pred, true_fn, false_fn)` of the stateful apply (TensorFlow,
    PyTorch); on PyTorch a Python `if`, which is what Keras's `ops.cond`
    runs there, without the `Cond` operation it creates at every call.

    Under `torch.compile` that operation's unique name (a global counter)
    is a guard of the frame that made it, and the counter changes at every
    call: the frame recompiled at every step until Dynamo's limit. This
    frame is never compiled on its own (`compile_inline_only`, applied
    below): its guards would be the branches' code, one recompile per call
    site; the branch taken is compiled as usual.
    """
    if keras.backend.backend() == "torch":
        return true_fn() if pred else false_fn()
    return ops.cond(pred, true_fn, false_fn)


_ki.compile_inline_only(_branch)


def _is_stock(optimizer):
    """Whether `optimizer` is Keras's own LossScaleOptimizer (not kerasmp's)."""
    return isinstance(
        optimizer, keras.optimizers.LossScaleOptimizer
    ) and not isinstance(optimizer, LossScaleOptimizer)
