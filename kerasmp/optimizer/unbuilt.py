"""The loss-scale state variables read before the optimizer is built.

`LossScaleOptimizer` makes its state variables (`dynamic_scale`,
`step_counter`, Keras's; `hysteresis_budget`, `total_skipped_steps`,
`consecutive_skipped_steps`, `discarded_micro_steps`, kerasmp's) in `build`,
as stock Keras does, so before its first step they do not exist. Read then,
stock Keras's optimizer says only "object has no attribute 'dynamic_scale'";
kerasmp's says how to build it and what to read meanwhile. The error is
still an `AttributeError`, so `hasattr` answers as before.

`UnbuiltState` holds one non-data descriptor per name: `build` sets the
variable as an instance attribute, which Python finds before a non-data
descriptor, so a built optimizer's reads never reach this module (nor
does a traced step).
"""

STATE_VARIABLES = (
    "dynamic_scale",
    "step_counter",
    "hysteresis_budget",
    "total_skipped_steps",
    "consecutive_skipped_steps",
    "discarded_micro_steps",
)
ACCUMULATION_ONLY = "discarded_micro_steps"


def unbuilt_message(optimizer, name):
    """Why `optimizer.<name>` is missing, and what to do, in one message.

    It reads only plain attributes, never a property that reads a state
    variable: TensorFlow's `__setattr__` reads each name `build` sets
    before setting it, which comes here while the optimizer is built.
    """
    owner = type(optimizer).__name__
    inner = getattr(optimizer, "inner_optimizer", None)
    if name == ACCUMULATION_ONLY and not getattr(
            inner, "gradient_accumulation_steps", None):
        return (
            f"{owner} has no `{name}`: it exists only when the inner "
            "optimizer accumulates gradients (`gradient_accumulation_steps`)."
        )
    if getattr(optimizer, "built", False):
        return f"{owner} has no `{name}`: `build` did not make it."
    scale = getattr(optimizer, "initial_scale", None)
    scale = f" ({float(scale)})" if isinstance(scale, (int, float)) else ""
    return (
        f"{owner} has no `{name}` yet: the optimizer makes its variables "
        "when it is built, at its first step (`fit`, `train_on_batch`, "
        "`apply`), or with `optimizer.build(model.trainable_variables)`. "
        f"Until then `optimizer.loss_scale`{scale} and "
        "`optimizer.skipped_steps` (0) read the state."
    )


class _StateVariable:
    """A state variable's name on the class: read on an optimizer whose
    `build` has not set it, an `AttributeError` with `unbuilt_message`."""

    def __init__(self, name):
        self.name = name

    def __get__(self, optimizer, owner=None):
        if optimizer is None:
            return self
        raise AttributeError(unbuilt_message(optimizer, self.name))


class UnbuiltState:
    """Mixin of `LossScaleOptimizer`: its state variables' names, each
    explaining itself until `build` sets it."""


for _name in STATE_VARIABLES:
    setattr(UnbuiltState, _name, _StateVariable(_name))
del _name
