"""The tensors behind `Float8Monitor`'s saturation and underflow fractions.

The kernel is a variable, so the monitor reads it directly. The inputs and
output gradients of a float8 matmul exist only inside a step, so the
monitor replays one recorded batch (the monitor's `data`) every time it
logs: one forward pass in inference mode (no state changes: the float8
histories are updated by training steps only), recording each float8
layer's input, and, when `data` has targets and the model a single-output
loss, the gradient of the loss (times the optimizer's loss scale, as in a
training step) with respect to the layer's matmul output: the tensor Keras
quantizes to E5M2. For that the layer's activation is applied outside the
recorded matmul (`layer.activation` set to None for the replay), so the
gradient is taken before the activation, where Keras takes it.

Each replay is traced once and kept with the model: TensorFlow takes the
gradient with a `GradientTape` in a `tf.function`; JAX with `jax.grad` of
the loss with respect to zeros added to each matmul output, in one
`jax.jit` that takes the model's values as arguments, read in place from
a running `fit` (`kerasmp.float8.jax_fit_state`), so nothing is synced.
PyTorch runs the replay eagerly, as its `fit` does, and takes the gradient
with `torch.autograd.grad` with respect to the recorded matmul outputs
(nothing accumulates in the variables' `.grad`).
"""

import contextlib
import weakref

import keras

from kerasmp._utils.arrays import to_numpy
from kerasmp.float8.jax_fit_state import all_values
from kerasmp.float8.jax_fit_state import mapping
from kerasmp.float8.jax_fit_state import variable_lists

_TRACED = weakref.WeakKeyDictionary()  # model -> traced replays


@contextlib.contextmanager
def _recording(layers, on_output):
    """Replaces each layer's float8 call for the duration of the block.

    `on_output(i, pre)` gets layer i's matmul output (bias added, no
    activation) and returns the tensor to continue with.
    """
    inputs = {}
    saved = []

    def make(i, layer, original):
        def call(x, *args, **kwargs):
            inputs[i] = x
            activation = layer.activation
            layer.activation = None
            try:
                pre = original(x, *args, **kwargs)
            finally:
                layer.activation = activation
            pre = on_output(i, pre)
            return activation(pre) if activation is not None else pre

        return call

    for i, layer in enumerate(layers):
        original = layer.quantized_call
        saved.append(layer)
        # An instance attribute shadows Layer.quantized_call, which
        # Layer.__call__ calls for a quantized layer.
        layer.quantized_call = make(i, layer, original)
    try:
        yield inputs
    finally:
        for layer in saved:
            del layer.quantized_call


def _loss_fn(model):
    loss = getattr(model, "loss", None)
    if loss is None or isinstance(loss, (list, tuple, dict)):
        return None
    try:
        fn = keras.losses.get(loss)
    except (ValueError, TypeError):
        return None
    return fn if callable(fn) else None


def _scaled(model, loss):
    optimizer = getattr(model, "optimizer", None)
    scale_loss = getattr(optimizer, "scale_loss", None)
    return scale_loss(loss) if scale_loss is not None else loss


def record(model, layers, x, y=None, cache=None):
    """Replays `x` (and targets `y`) and returns, per layer in `layers`, a
    dict with `"inputs"` and, when `y` is given and the model has a
    single-output loss, `"outputs_grad"` (numpy arrays).

    `cache`: a dict kept between calls with the same model and layers: it
    holds the traced replay (a `tf.function` on TensorFlow, a `jax.jit` on
    JAX), so it is traced once. On JAX the replay runs on the model's
    current values, read in place from a running `fit`
    (`kerasmp.float8.jax_fit_state`): nothing is written back."""
    loss_fn = _loss_fn(model) if y is not None else None
    backend = keras.backend.backend()
    if backend == "torch":
        inputs, grads = _torch_replay(model, layers, loss_fn, x, y)
        return _rows(len(layers), inputs, grads)
    if backend not in ("tensorflow", "jax"):
        with _recording(layers, lambda i, pre: pre) as inputs:
            model(x, training=False)
        return _rows(len(layers), {str(i): v for i, v in inputs.items()}, {})
    cache = {} if cache is None else cache
    # The optimizer too: the JAX replay maps its variables (the loss scale),
    # and a compile with a new optimizer brings new ones.
    key = (backend, tuple(id(l) for l in layers),
           None if loss_fn is None else id(loss_fn),
           id(getattr(model, "optimizer", None)))
    run = cache.get(key) or _TRACED.get(model, {}).get(key)
    if run is None:
        make = _tf_replay if backend == "tensorflow" else _jax_replay
        run = make(model, layers, loss_fn)
        # Kept with the model too: a new monitor (one per fit) reuses it.
        _TRACED.setdefault(model, {})[key] = run
    cache[key] = run
    if backend == "tensorflow":
        import tensorflow as tf

        args = (tf.convert_to_tensor(x),) + (
            () if loss_fn is None else (tf.convert_to_tensor(y),))
        inputs, grads = run(*args)
    else:
        inputs, grads = run(x, y if loss_fn is not None else None)
    return _rows(len(layers), inputs, grads)


def _rows(count, inputs, grads):
    """`record`'s rows from the replay's inputs and output gradients (keyed
    by the layer's index as a string)."""
    out = []
    for i in range(count):
        row = {"inputs": to_numpy(inputs[str(i)])} if str(i) in inputs else {}
        if str(i) in grads:
            row["outputs_grad"] = to_numpy(grads[str(i)])
        out.append(row)
    return out


def _loss(model, loss_fn, y, y_pred):
    y_pred = keras.ops.cast(y_pred, "float32")
    value = keras.ops.mean(loss_fn(y, y_pred))
    return _scaled(model, value)


def _tf_replay(model, layers, loss_fn):
    import tensorflow as tf

    # Graph mode, as in a training step: TensorFlow's eager custom-gradient
    # wrapper hands Keras's float8 gradient functions a variables argument
    # they do not expect. The model is held weakly: `_TRACED` keeps this
    # function as long as the model lives, and no longer.
    model = weakref.ref(model)

    if loss_fn is None:
        @tf.function
        def forward(x):
            with _recording(layers, lambda i, pre: pre) as inputs:
                model()(x, training=False)
            return {str(i): v for i, v in inputs.items()}, {}

        return forward

    @tf.function
    def run(x, y):
        outputs = {}

        def watch(i, pre):
            tape.watch(pre)
            outputs[i] = pre
            return pre

        with tf.GradientTape(watch_accessed_variables=False) as tape:
            with _recording(layers, watch) as inputs:
                y_pred = model()(x, training=False)
            loss = _loss(model(), loss_fn, y, y_pred)
        keys = sorted(outputs)
        grads = tape.gradient(loss, [outputs[i] for i in keys])
        return ({str(i): v for i, v in inputs.items()},
                {str(i): g for i, g in zip(keys, grads) if g is not None})

    return run


def _jax_replay(model, layers, loss_fn):
    """`run(x, y)` -> (inputs, output gradients) by layer index (str keys),
    one `jax.jit` (traced once per batch shape) of the forward pass and, with
    `loss_fn`, `jax.grad` of the loss with respect to zeros added to each
    matmul output. The model's values are arguments, not constants: each
    call passes the current ones (`all_values`)."""
    import jax
    import jax.numpy as jnp

    lists = variable_lists(model)
    ref = weakref.ref(model)

    def forward(values, x, on_output, y=None):
        scope = keras.StatelessScope(
            state_mapping=mapping(lists, values))
        with scope, _recording(layers, on_output) as inputs:
            y_pred = ref()(x, training=False)
            loss = None if y is None else _loss(ref(), loss_fn, y, y_pred)
        return loss, dict(inputs)

    @jax.jit
    def replay_inputs(values, x):
        _, inputs = forward(values, x, lambda i, pre: pre)
        return {str(i): v for i, v in inputs.items()}, {}

    @jax.jit
    def replay_grads(values, x, y):
        shapes = {}

        def shape(i, pre):
            shapes[i] = pre.shape
            return pre

        # Traced for the shapes only; XLA drops this unused pass.
        forward(values, x, shape)
        keys = sorted(shapes)

        def loss_of(eps):
            def add(i, pre):
                return pre + eps[keys.index(i)].astype(pre.dtype)

            return forward(values, x, add, y)

        zeros = [jnp.zeros(shapes[i], "float32") for i in keys]
        grads, inputs = jax.grad(loss_of, has_aux=True)(zeros)
        return ({str(i): v for i, v in inputs.items()},
                {str(i): g for i, g in zip(keys, grads)})

    def run(x, y=None):
        values = all_values(ref(), lists)
        if loss_fn is None:
            return replay_inputs(values, x)
        return replay_grads(values, x, y)

    return run


def _torch_replay(model, layers, loss_fn, x, y):
    """(inputs, output gradients) by layer index (str keys): one eager
    forward pass and, with `loss_fn`, `torch.autograd.grad` of the loss
    with respect to each recorded matmul output."""
    import torch

    outputs = {}

    def keep(i, pre):
        outputs[i] = pre
        return pre

    with torch.enable_grad(), _recording(layers, keep) as inputs:
        y_pred = model(x, training=False)
        inputs = dict(inputs)
    if loss_fn is None:
        return {str(i): v for i, v in inputs.items()}, {}
    loss = _loss(model, loss_fn, y, y_pred)
    keys = [i for i in sorted(outputs) if outputs[i].requires_grad]
    grads = []
    if keys and loss.requires_grad:
        grads = torch.autograd.grad(
            loss, [outputs[i] for i in keys], allow_unused=True
        )
    return ({str(i): v for i, v in inputs.items()},
            {str(i): g for i, g in zip(keys, grads) if g is not None})
