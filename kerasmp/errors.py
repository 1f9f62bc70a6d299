"""Exceptions and warnings that kerasmp raises."""


class NonFiniteError(RuntimeError):
    """Training produced inf or NaN that loss scaling cannot absorb.

    Raised by `kerasmp.callbacks.NonFiniteMonitor(action="raise")`. The
    message is the monitor's diagnosis; `event` is the event dict it recorded
    (step, epoch, kind, loss scale, located layer, ...), and `report` the
    `kerasmp.debug.NonFiniteReport` of the offending batch when one was made.

    Example:

    ```python
    try:
        model.fit(x, y, callbacks=[NonFiniteMonitor(action="raise")])
    except NonFiniteError as e:
        print(e.event["kind"], e.event["layer"])
        print(e.report)
    ```
    """

    def __init__(self, message, event=None, report=None):
        super().__init__(message)
        self.event = event
        self.report = report


class NonFiniteWarning(RuntimeWarning):
    """Warning issued by `NonFiniteMonitor` (filter it with `warnings`)."""


class StockPolicyWarning(UserWarning):
    """Keras's own mixed policy is in force, so kerasmp's rules do not apply.

    Issued once per process by the first `model.compile()` while the global
    dtype policy is a stock `keras.DTypePolicy` such as the one
    `keras.mixed_precision.set_global_policy("mixed_float16")` (the
    TensorFlow guide's first line) sets, not a `kerasmp.Policy`. The message
    names the one line to change: `kerasmp.set_global_policy(...)`.
    """


class PolicyWarning(UserWarning):
    """A `kerasmp.Policy` does not do what the code around it seems to ask.

    Issued where kerasmp can tell: a `float32_layers` list written to drop
    some built-in rules (they stay unless `float32_defaults=False`), a name
    pattern in `float32_layers` or `float32_exclude` that matches no layer
    of the model being compiled, or a model compiled under a half-precision
    kerasmp policy that was set only after the model was built (its layers
    compute in float32). Each message names the fix; the ones of `compile`
    are shown once per model (and pattern).
    """


class StockOptimizerWarning(UserWarning):
    """`compile` replaced Keras's own `LossScaleOptimizer` with kerasmp's.

    Issued once per process when a model that a `kerasmp.Policy` governs is
    compiled with `keras.optimizers.LossScaleOptimizer(...)` (the TensorFlow
    guide's): kerasmp's `LossScaleOptimizer` takes its place, with the same
    inner optimizer and settings, so that the scale is bounded and skipped
    steps are undone. Compile with `kerasmp.LossScaleOptimizer(...)` to
    avoid it.
    """


class SpeedWarning(UserWarning):
    """A compile setting loses the speed that the policy's dtype has here.

    Issued once per process by `model.compile()` for a model that a
    `kerasmp.Policy` governs, where kerasmp knows from measurement that the
    setting is slower than the alternative on this device: today an
    explicit `jit_compile=True` on TensorFlow on a CPU with bfloat16
    instructions, where XLA computes bfloat16 matrix products in float32
    (`kerasmp._utils.cpu_speed`). The message gives the measured ratios and
    the faster setting; kerasmp keeps the setting the user asked for.
    """
