"""Every change kerasmp makes to Keras, installed once when Keras is imported.

`install()` puts them in place (`kerasmp/__init__.py` calls it, through
this module's import, as soon as Keras is imported) and `uninstall()`
takes them out; `kerasmp.install()` and `kerasmp.uninstall()` are these.
Each acts only on layers a `kerasmp.Policy` governs or on models it
compiles, and takes every Keras class, module and private name it patches
from `kerasmp._keras_internals`:

1. Resolution. `keras.layers.Layer._dtype_policy` becomes a data descriptor:
   Keras keeps writing the layer's policy to it (stored in the instance
   `__dict__`); reading it returns `policy.policy_for(layer)` when the
   stored policy is a `kerasmp.Policy`, the stored policy otherwise. Every
   Keras read of a compute or variable dtype goes through it, so one rule
   covers `dtype=None` layers, layers handed a parent's policy (the
   `Softmax` inside `MultiHeadAttention`) and attributes set after
   `Layer.__init__`. On PyTorch the descriptor is never a Dynamo frame of
   its own (`_keras_internals.compile_inline_only`): under `torch.compile`
   it would recompile for every layer class.
2. Hand-off. `Layer.__call__`: a layer a kerasmp policy governs, called
   inside another layer or model, hands its floating outputs to that caller
   in the caller's compute dtype (`kerasmp.policy.handoff_dtype`,
   `hand_back`): a float32 softmax or norm to a float16 model, a float16
   sublayer to a float32 block; the outputs of the outermost call stay the
   float32 values computed. A call on KerasTensors (a model being built)
   that raises in half precision moves the innermost layer whose call
   raised to float32 and calls again, with a warning naming it
   (`measure.move_failed_at_build`); if float32 fails too, the layer is
   put back and the first error raised.
3. Saving and loading. `dtype_policies.serialize` / `deserialize` and
   `Operation.from_config` go through `kerasmp.policy.saving`;
   `Trainer.get_compile_config` / `compile_from_config` through
   `kerasmp.optimizer.saving` (a `kerasmp.LossScaleOptimizer` saved as
   stock Keras's plus a `"kerasmp"` entry that stock Keras ignores).
4. Compile. `Trainer.compile` decides loss scaling: when a model has layers
   governed by a `kerasmp.Policy` and any trainable layer computes in
   float16, a plain optimizer is wrapped once in
   `kerasmp.LossScaleOptimizer`; bfloat16 and float32
   models get no loss scaling, and `compile(..., auto_scale_loss=False)`
   turns it off as in stock Keras. It warns once per model when a name
   pattern of the policy matches no layer, or when the global policy is a
   half-precision kerasmp policy set after the model was built
   (`kerasmp.policy.advice`). Before that, once per model, one symbolic
   run finds the layers that fail in half precision and the MoE routers,
   and moves them to float32 (`kerasmp.policy.measure`); the outermost
   call of a model (`Layer.__call__`, above) measures it first if it is
   called before it is compiled (`model(x)`, or `predict` on TensorFlow
   and PyTorch; JAX's `predict` calls the model through `stateless_call`
   with its variables purged, where nothing can be measured). Keras's own
   `keras.optimizers.LossScaleOptimizer` (the TensorFlow guide's) becomes
   kerasmp's, with the same inner optimizer and settings, and a one-time
   warning says so. Then, for every model,
   `kerasmp.train_step` installs kerasmp's train step, and for a governed
   model under a multi-worker strategy every worker checks that all have
   the same precision settings. Last, a governed model whose compile
   setting loses its dtype's measured speed on this device (an explicit
   `jit_compile=True` for bfloat16 on a TensorFlow CPU) gets a one-time
   warning with the ratios and the faster setting (`kerasmp.policy.speed`);
   the setting is kept.
5. Attention on a CPU (JAX only). `jax.nn.dot_product_attention`, which
   `keras.ops.dot_product_attention` (and so `MultiHeadAttention` and
   keras-hub's attention layers) calls on JAX, asks XLA for the
   `F16_F16_F32` dot algorithm on float16 inputs, which XLA's CPU backend
   refuses when the call is compiled (`jit`: every `fit`, `predict`):
   "The precision 'F16_F16_F32' is not supported by dot_general on CPU".
   Stock Keras fails so under `mixed_float16` on a CPU. On a CPU, kerasmp
   computes such attention from float32 copies of its float16 inputs
   (float16 to float32 is exact, so the logits are the float32-accumulated
   products that algorithm asks for) and returns float16. Other dtypes,
   devices and backends go to Keras unchanged.
6. A partial last execution (PyTorch only). With `steps_per_execution=k`,
   an epoch whose batches are not a multiple of `k` ends in an execution of
   fewer batches, which kerasmp's PyTorch train, test and predict functions
   run (`kerasmp.train_step.torch`). Keras 3.15's epoch iterator warns
   "Your input ran out of data; interrupting training" there, every epoch
   and every validation, though nothing was interrupted (and at the end of
   the first epoch of data of unknown size): kerasmp's
   `TorchEpochIterator._interrupted_warning` warns only when
   `steps_per_epoch` was given, as Keras 3.16's iterator does (where the
   patch changes nothing).
7. The progress bar. `keras.utils.Progbar.update` prints `skipped_steps`
   as the count it is (`kerasmp.train_step.progbar`), not `0.0000e+00`.

Each patch that calls the Keras function it replaces, except those that run
at every call (`Layer.__call__`, the CPU attention), is decorated with
`kerasmp._utils.warn.at_caller`: the warnings Keras locates at its
function's caller show where they show without kerasmp, never at a line of
this module.
"""

import functools
import inspect
import threading

import keras

from kerasmp import _keras_internals as _ki
from kerasmp import train_step as _train_step
from kerasmp._utils.warn import at_caller
from kerasmp.float8.layers import assign_layers
from kerasmp.optimizer import saving as _optimizer_saving
from kerasmp.optimizer.loss_scale_optimizer import LossScaleOptimizer
from kerasmp.policy import advice as _policy_advice
from kerasmp.policy import saving as _saving
from kerasmp.policy import speed as _speed
from kerasmp.policy import stock as _stock_policy
from kerasmp.policy.handback import hand_back
from kerasmp.policy.handback import handoff_dtype
from kerasmp.policy.measure import measure_once
from kerasmp.policy.measure import move_failed_at_build
from kerasmp.policy.plan import plan_of
from kerasmp.policy.policy import Float32Override
from kerasmp.policy.policy import Policy
from kerasmp.policy.rules import activation_name
from kerasmp.policy.workers import check_workers_agree
from kerasmp.policy.workers import describe_loss_scale
from kerasmp.policy.workers import loss_scale_settings
from kerasmp.train_step import progbar as _progbar

_originals = {}  # what install() replaced, for uninstall()

# ------------------------------------------------------------ 1. resolution


_RESOLVED = "_kerasmp_resolved_dtype_policy"
"""The instance `__dict__` key of a layer's resolved policy: `(stored policy,
activation name, resolved policy)`."""


class _ResolvedDTypePolicy:
    """Data descriptor installed on `keras.layers.Layer` under
    `_keras_internals.DTYPE_POLICY_ATTR`.

    A layer's resolved policy is kept in its `__dict__` once the stored
    policy's answer is final (`Policy.resolve`), and used while the same
    policy object is stored and the layer's activation is the same. The
    read then depends on nothing that tells two layers of a class apart
    (not their names or paths), so under `torch.compile` a Keras frame
    compiled for one layer is not rejected for another by a guard in
    kerasmp: every Keras dtype read goes through here, inside Keras's own
    per-layer frames.
    """

    def __get__(self, layer, owner=None):
        if layer is None:
            return self
        state = layer.__dict__
        try:
            stored = state[_ki.DTYPE_POLICY_ATTR]
        except KeyError:
            raise AttributeError(_ki.DTYPE_POLICY_ATTR) from None
        if not isinstance(stored, (Policy, Float32Override)):
            return stored
        activation = activation_name(layer)
        kept = state.get(_RESOLVED)
        if kept is not None and kept[0] is stored and kept[1] == activation:
            return kept[2]
        if isinstance(stored, Policy):
            resolved, final = stored.resolve(layer)
        elif stored.kept_half(layer):
            resolved, final = stored.policy, True  # a moved layer's sublayer
        else:
            resolved, final = stored, True
        if final:
            state[_RESOLVED] = (stored, activation, resolved)
        return resolved

    def __set__(self, layer, value):
        layer.__dict__[_ki.DTYPE_POLICY_ATTR] = value

# ------------------------------------------------------------- 2. hand-off

_calls = threading.local()  # the running Layer.__call__s, float32 outputs


def _restore_float32(outputs, originals):
    def restore(y):
        entry = originals.get(id(y))
        return entry[1] if entry is not None and entry[0] is y else y

    return keras.tree.map_structure(restore, outputs)


def _layer_call(self, *args, **kwargs):
    callers = getattr(_calls, "callers", None)
    if callers is None:
        callers = _calls.callers = []
    if not callers:
        _calls.originals = {}
        _first_call(self)
    caller = callers[-1] if callers else None
    callers.append(self)
    moved = None
    try:
        outputs = _originals["__call__"](self, *args, **kwargs)
    except Exception as error:
        moved = _moved_at_build(self, error, args, kwargs)
        if moved is None:
            raise
    finally:
        callers.pop()
    if moved is not None:
        return _call_again(self, moved, args, kwargs)
    originals = _calls.originals
    if caller is not None:
        target = handoff_dtype(self, caller)
        if target is not None:
            outputs = hand_back(outputs, target, originals)
    elif originals:
        outputs = _restore_float32(outputs, originals)
        _calls.originals = {}
    return outputs


def _moved_at_build(layer, error, args, kwargs):
    """For a call on KerasTensors (a model being built) that raised:
    `(error, keep, undo)` after moving the innermost layer whose call
    raised to float32 (`measure.move_failed_at_build`), else None."""
    try:
        symbolic = any(isinstance(x, keras.KerasTensor)
                       for x in keras.tree.flatten((args, kwargs)))
    except Exception:  # noqa: BLE001 (arguments tree cannot walk)
        return None  # the call's own error is raised unchanged
    if not symbolic:
        return None
    moved = move_failed_at_build(_innermost_layer(error, layer), error)
    return None if moved is None else (error, *moved)


def _innermost_layer(error, default):
    """The layer of the deepest `Layer.__call__` (this module's) that
    `error` passed through, or `default`."""
    layer = default
    tb = error.__traceback__
    while tb is not None:
        if tb.tb_frame.f_code is _layer_call.__code__:
            layer = tb.tb_frame.f_locals.get("self", layer)
        tb = tb.tb_next
    return layer


def _call_again(layer, moved, args, kwargs):
    """The call once more with the failing layer in float32; if it fails
    again, the layer is put back and the first error raised."""
    error, keep, undo = moved
    try:
        outputs = layer(*args, **kwargs)
    except Exception:
        undo()
        raise error from None
    keep()
    return outputs


def _first_call(layer):
    # A subclassed model (no symbolic inputs, ever) costs one failed
    # attribute read a call here.
    if isinstance(layer, keras.Model):
        measure_once(layer)


# ------------------------------------------------------- 3. saving, loading


@at_caller
def _serialize(policy):
    return _saving.serialize(policy, _originals["serialize"])


@at_caller
def _deserialize(config, custom_objects=None):
    return _saving.deserialize(config, _originals["deserialize"],
                               custom_objects=custom_objects)


@at_caller
def _from_config(cls, config):
    return _saving.construct(cls, config, _originals["from_config"],
                             _originals["deserialize"])


@at_caller
def _get_compile_config(self):
    return _optimizer_saving.portable_compile_config(
        _originals["get_compile_config"](self))


@at_caller
def _compile_from_config(self, config):
    config = _optimizer_saving.restored_compile_config(
        config, LossScaleOptimizer.__module__)
    return _originals["compile_from_config"](self, config)


# ---------------------------------------------------------------- 4. compile


@at_caller
def _compile(self, *args, **kwargs):
    original = _originals["compile"]
    _stock_policy.warn_if_stock_mixed_policy(self)  # the TF guide's policy
    measure_once(self)
    plan = plan_of(self)
    _policy_advice.warn_about_policy(self, plan)  # unmatched, set too late
    bound = inspect.signature(original).bind(self, *args, **kwargs)
    bound.apply_defaults()
    arguments = bound.arguments
    optimizer = arguments["optimizer"]
    if optimizer is not None:
        optimizer = arguments["optimizer"] = keras.optimizers.get(optimizer)
    wrap = plan.governed and (
        _is_stock_loss_scale_optimizer(optimizer)
        or (arguments["auto_scale_loss"] and plan.needs_loss_scaling
            and optimizer is not None
            and not isinstance(optimizer, LossScaleOptimizer))
    )
    # Every worker of a multi-worker job compiles: check there that they
    # all train with the same precision settings (a no-op in one process),
    # before anything below creates a variable (under a JAX distribution,
    # each is a collective: a worker that made a LossScaleOptimizer the
    # others did not would leave its collectives out of step).
    check_workers_agree(
        self, plan=plan,
        loss_scale=_loss_scale_settings(self, optimizer, wrap, arguments),
    )
    if not plan.governed:
        result = original(*bound.args, **bound.kwargs)
        _train_step.install(self)
        return result
    assign_layers(self, plan.float8)  # float8 policies: the rule's layers
    if wrap:
        if _is_stock_loss_scale_optimizer(optimizer):
            # The TensorFlow guide's optimizer: same inner optimizer and
            # settings, kerasmp's bounded scale and skipped-step undo.
            _stock_policy.say_stock_optimizer_replaced()
            optimizer = LossScaleOptimizer(optimizer)
        else:
            optimizer = LossScaleOptimizer(
                optimizer, name="loss_scale_optimizer"
            )
    arguments["optimizer"] = optimizer
    # kerasmp has decided; keep stock Keras's name-based rule out of it.
    arguments["auto_scale_loss"] = False
    result = original(*bound.args, **bound.kwargs)
    _train_step.install(self)
    _speed.warn_if_slow(self, plan)  # jit_compile=True and bfloat16 on a CPU
    return result


def _loss_scale_settings(model, optimizer, wrap, arguments):
    """The loss-scaling settings `compile` is about to give `model`, for
    the workers' check: those of the optimizer kerasmp makes (`wrap`), of
    the one given, or of stock Keras's rule (an ungoverned model), without
    making any."""
    if wrap:
        return describe_loss_scale(
            LossScaleOptimizer.__name__,
            LossScaleOptimizer.settings_for(optimizer),
        )
    settings = loss_scale_settings(optimizer)
    if (settings is None and optimizer is not None
            and arguments["auto_scale_loss"]
            and model.dtype_policy.name == "mixed_float16"):
        return {"class": "keras.optimizers.LossScaleOptimizer"}
    return settings


# ------------------------------------------------- 5. attention on a CPU


def _cpu_half_attention(query, key, value, bias=None, mask=None,
                        scale=None, is_causal=False, flash_attention=None,
                        attn_logits_soft_cap=None):
    original = _originals["dot_product_attention"]
    dtypes = {keras.backend.standardize_dtype(getattr(t, "dtype", "float32"))
              for t in (query, key, value)}
    if "float16" not in dtypes or flash_attention or not _on_cpu():
        return original(query, key, value, bias=bias, mask=mask,
                        scale=scale, is_causal=is_causal,
                        flash_attention=flash_attention,
                        attn_logits_soft_cap=attn_logits_soft_cap)
    out_dtype = keras.backend.result_type(*dtypes)

    def up(t):
        return None if t is None else keras.ops.cast(t, "float32")

    outputs = original(up(query), up(key), up(value), bias=up(bias),
                       mask=mask, scale=scale, is_causal=is_causal,
                       flash_attention=flash_attention,
                       attn_logits_soft_cap=attn_logits_soft_cap)
    return keras.ops.cast(outputs, out_dtype)


@functools.cache
def _on_cpu():
    import jax

    return jax.devices()[0].platform == "cpu"


# --------------------------------- 6. a partial last execution (PyTorch)


def _interrupted_warning(self):
    if self.steps_per_epoch:  # an epoch's size the data did not reach
        _originals["interrupted_warning"](self)


def _is_stock_loss_scale_optimizer(optimizer):
    return isinstance(
        optimizer, keras.optimizers.LossScaleOptimizer
    ) and not isinstance(optimizer, LossScaleOptimizer)


def install():
    """Installs kerasmp's patches into Keras (idempotent).

    Importing kerasmp installs them when Keras is imported, so user code
    never needs to. They act only on models and layers that a
    `kerasmp.Policy` governs or that are compiled with
    `kerasmp.LossScaleOptimizer`.
    """
    if _originals:
        return
    trainer = _ki.trainer_class()
    operation = _ki.operation_class()
    modules = _ki.dtype_policy_modules()
    _originals.update(
        __call__=keras.layers.Layer.__call__,
        from_config=operation.from_config.__func__,
        serialize=modules[0].serialize,
        deserialize=modules[0].deserialize,
        compile=trainer.compile,
        get_compile_config=trainer.get_compile_config,
        compile_from_config=trainer.compile_from_config,
    )
    _ki.install_dtype_policy_descriptor(_ResolvedDTypePolicy())
    if keras.backend.backend() == "torch":
        # Under torch.compile, a dtype read in code that runs eagerly
        # (after a graph break) would be a Dynamo frame of its own, guarded
        # on the layer's class: one recompile per class, up to the limit.
        for method in (_ResolvedDTypePolicy.__get__,
                       _ResolvedDTypePolicy.__set__):
            _ki.compile_inline_only(method, callees=True)
    keras.layers.Layer.__call__ = functools.wraps(_originals["__call__"])(
        _layer_call
    )
    operation.from_config = classmethod(
        functools.wraps(_originals["from_config"])(_from_config)
    )
    for module in modules:
        module.serialize = _serialize
        module.deserialize = _deserialize
    trainer.compile = functools.wraps(_originals["compile"])(_compile)
    for name, patch in (("get_compile_config", _get_compile_config),
                        ("compile_from_config", _compile_from_config)):
        setattr(trainer, name, functools.wraps(_originals[name])(patch))
    if keras.backend.backend() == "jax":
        nn = _ki.backend_nn_module()
        _originals["dot_product_attention"] = nn.dot_product_attention
        nn.dot_product_attention = functools.wraps(
            nn.dot_product_attention)(_cpu_half_attention)
    if keras.backend.backend() == "torch":
        iterator = _ki.torch_epoch_iterator_class()
        name = _ki.INTERRUPTED_WARNING_ATTR
        _originals["interrupted_warning"] = getattr(iterator, name)
        _originals["own_interrupted_warning"] = name in vars(iterator)
        setattr(iterator, name, functools.wraps(
            _originals["interrupted_warning"])(_interrupted_warning))
    _progbar.install()


def uninstall():
    """Removes kerasmp's patches: Keras behaves exactly as without kerasmp.

    Layers built under a `kerasmp.Policy` keep it, but then compute in its
    dtype without float32 overrides. `kerasmp.install()` puts the patches
    back.

    Example:

    >>> kerasmp.uninstall()
    >>> keras.layers.Softmax(dtype="mixed_float16").compute_dtype
    'float16'
    >>> kerasmp.install()
    """
    if not _originals:
        return
    _ki.remove_dtype_policy_descriptor()
    keras.layers.Layer.__call__ = _originals["__call__"]
    _ki.operation_class().from_config = classmethod(_originals["from_config"])
    for module in _ki.dtype_policy_modules():
        module.serialize = _originals["serialize"]
        module.deserialize = _originals["deserialize"]
    trainer = _ki.trainer_class()
    for name in ("compile", "get_compile_config", "compile_from_config"):
        setattr(trainer, name, _originals[name])
    if "dot_product_attention" in _originals:
        _ki.backend_nn_module().dot_product_attention = _originals[
            "dot_product_attention"]
    if "interrupted_warning" in _originals:
        iterator = _ki.torch_epoch_iterator_class()
        name = _ki.INTERRUPTED_WARNING_ATTR
        if _originals["own_interrupted_warning"]:
            setattr(iterator, name, _originals["interrupted_warning"])
        else:
            delattr(iterator, name)  # inherited from EpochIterator again
    _progbar.uninstall()
    _originals.clear()


def is_installed():
    """Whether the patches are in place."""
    return bool(_originals)


install()
