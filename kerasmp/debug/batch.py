"""The loss and gradients of one batch, outside `fit`, on TensorFlow, JAX
and PyTorch.

Shared by `kerasmp.debug.find_nonfinite` and `kerasmp.debug.gradients`: both
compute the (scaled) loss and gradients of a batch the way the backend's
trainer does, then put the variables back as they were. `concrete` (whether
a layer's output holds values to read) is shared with `kerasmp.check`'s
traced run.
"""

import math

import keras
from keras import ops

from kerasmp import _keras_internals as _ki
from kerasmp._utils.arrays import gathered_to_numpy
from kerasmp._utils.arrays import to_numpy


def fmt(value):
    if value is None:
        return "-"
    if isinstance(value, float) and not math.isfinite(value):
        return str(value)
    return f"{value:.3g}"


def concrete(x):
    """Whether `x` holds values that can be read now: False for a symbolic
    tensor (a `KerasTensor`, a TensorFlow graph tensor) and for a JAX tracer,
    which is what a layer called inside `keras.ops.cond`, `while_loop`,
    `scan` or `vectorized_map` returns on JAX even in an eager pass (the
    branch or body is traced, not run op by op)."""
    if isinstance(x, keras.KerasTensor):
        return False
    backend = keras.backend.backend()
    if backend == "jax":
        import jax

        return not isinstance(x, jax.core.Tracer)
    if backend == "tensorflow":
        import tensorflow as tf

        return not tf.is_symbolic_tensor(x)
    return True


def dense(g):
    """A gradient as a NumPy array (a TensorFlow IndexedSlices made dense),
    or None."""
    if g is None:
        return None
    if hasattr(g, "dense_shape"):  # tf.IndexedSlices
        import tensorflow as tf

        g = tf.convert_to_tensor(g)
    return gathered_to_numpy(g)


def snapshot(variables):
    return [(v, to_numpy(v)) for v in variables]


def restore(snapshot):
    for v, value in snapshot:
        v.assign(value)


def call_kwargs(model, training):
    return {"training": training} if _ki.call_has_training_arg(model) else {}


def user_loss(loss):
    """A function (y, y_pred, sample_weight) -> scalar float32 loss."""
    loss = keras.losses.get(loss)

    def compute(y, y_pred, sample_weight):
        if isinstance(loss, keras.losses.Loss):
            value = loss(y, y_pred, sample_weight=sample_weight)
        else:
            value = loss(y, y_pred)
        return ops.mean(ops.cast(value, "float32"))

    return compute


def check_loss(model, loss):
    if loss is None and not _ki.has_compiled_loss(model):
        raise ValueError(
            "find_nonfinite: to check gradients (`y` given), compile the "
            "model with a loss or pass `loss=`; received loss=None and a "
            "model without a compiled loss."
        )


def _loss_value(model, x, y, y_pred, sample_weight, loss, training):
    """The float32 loss of `y_pred` (TensorFlow and PyTorch, eagerly)."""
    if loss is None:
        value = model.compute_loss(
            x=x,
            y=y,
            y_pred=y_pred,
            sample_weight=sample_weight,
            training=training,
        )
    else:
        value = user_loss(loss)(y, y_pred, sample_weight)
    return ops.cast(value, "float32")


def gradients_tf(model, x, y, sample_weight, loss, scale, training):
    import tensorflow as tf

    variables = model.trainable_variables
    with tf.GradientTape() as tape:
        y_pred = model(x, **call_kwargs(model, training))
        value = _loss_value(model, x, y, y_pred, sample_weight, loss, training)
        scaled = value * scale
    return value, tape.gradient(scaled, variables)


def gradients_torch(model, x, y, sample_weight, loss, scale, training):
    """As Keras's PyTorch train step, but with `torch.autograd.grad`: the
    gradients are returned, never accumulated into the variables' `.grad`
    (a running `fit` keeps its own)."""
    import torch

    variables = model.trainable_variables
    y_pred = model(x, **call_kwargs(model, training))
    value = _loss_value(model, x, y, y_pred, sample_weight, loss, training)
    tensors = [v.value for v in variables]
    wanted = [i for i, t in enumerate(tensors) if t.requires_grad]
    grads = [None] * len(tensors)
    if wanted and value.requires_grad:
        found = torch.autograd.grad(
            value * scale, [tensors[i] for i in wanted], allow_unused=True
        )
        for i, g in zip(wanted, found):
            grads[i] = g
    return value.detach(), grads


def gradients_jax(model, x, y, sample_weight, loss, scale, training):
    import jax

    trainable = [v.value for v in model.trainable_variables]
    non_trainable = [v.value for v in model.non_trainable_variables]
    metrics = [v.value for v in model.metrics_variables]
    kwargs = call_kwargs(model, training)

    def scaled_loss(trainable):
        # Mirrors JAXTrainer.compute_loss_and_updates, without the optimizer.
        y_pred, new_non_trainable, losses = model.stateless_call(
            trainable, non_trainable, x, return_losses=True, **kwargs
        )
        if loss is not None:
            value = user_loss(loss)(y, y_pred, sample_weight)
        else:
            if losses:
                _ki.set_losses_override(model, losses)
            try:
                value, _ = model.stateless_compute_loss(
                    trainable,
                    new_non_trainable,
                    metrics,
                    x=x,
                    y=y,
                    y_pred=y_pred,
                    sample_weight=sample_weight,
                    training=training,
                )
            finally:
                if losses:
                    _ki.clear_losses_override(model)
        value = ops.cast(value, "float32")
        return value * scale, value

    grad_fn = jax.value_and_grad(scaled_loss, has_aux=True)
    (_, value), grads = grad_fn(trainable)
    return value, grads


GRADIENTS = {
    "tensorflow": gradients_tf,
    "jax": gradients_jax,
    "torch": gradients_torch,
}
"""The batch gradient function of each backend."""


def gradients(model, x, y, sample_weight, loss, scale, training):
    check_loss(model, loss)
    backend = keras.backend.backend()
    fn = GRADIENTS.get(backend)
    if fn is None:
        raise NotImplementedError(
            "find_nonfinite checks gradients on the TensorFlow, JAX and "
            f"PyTorch backends only (current: {backend!r}); call it without "
            "`y`."
        )
    value, grads = fn(model, x, y, sample_weight, loss, scale, training)
    return float(gathered_to_numpy(value)), grads
