"""The one place where kerasmp reaches into Keras's private internals.

Every `keras.src` import and every read or write of a private attribute of
a Keras object (`layer._flatten_layers`, `optimizer._iterations`, ...) lives
here, as a small named function. Other kerasmp modules call these functions
and use only Keras's public API otherwise; the patches at the end of
`kerasmp/policy/policy.py` and in `kerasmp/_patches.py` (which *patch*
Keras: the `_dtype_policy` descriptor, `Layer.__call__`, `compile`,
`from_config`, `dtype_policies.serialize`/`deserialize`) get every Keras
class, module and private attribute name they patch from here.

Each function has a contract test in `tests/test_keras_internals.py` that
fails naming the Keras version when the internal it relies on changes; run
them against the newest Keras with `bash tests/run.sh --keras-nightly`.
docs/architecture.md lists where kerasmp meets Keras.

Tested with Keras 3.15 and 3.16 (`pyproject.toml` bounds the version).
"""

import contextlib
import itertools
import sys

import keras
from keras.src import dtype_policies as _dtype_policies
from keras.src.backend.common import masking as _masking
from keras.src.trainers import trainer as _trainer_module
from keras.src.trainers.data_adapters import data_adapter_utils as _data_utils
from keras.src.utils import tracking as _tracking

# --------------------------------------------------------------- layers

DTYPE_POLICY_ATTR = "_dtype_policy"
"""The `Layer` attribute every Keras dtype read goes through.

`Layer.dtype_policy`, `compute_dtype` and `variable_dtype` all read
`self._dtype_policy`; kerasmp installs a data descriptor under this name on
`keras.layers.Layer` (see `install_dtype_policy_descriptor`).
"""


def stored_dtype_policy(layer):
    """The policy Keras stored on `layer`, before any kerasmp resolution.

    None when the layer has none yet (during `Layer.__init__`).
    """
    return layer.__dict__.get(DTYPE_POLICY_ATTR)


def store_dtype_policy(layer, policy):
    """Stores `policy` as `layer`'s policy, as Keras's `Layer.__init__` does.

    Unlike the public `dtype_policy` setter this skips Keras's validation
    and the `DTypePolicyMap` bookkeeping: it replaces the policy object that
    `compute_dtype` and `variable_dtype` read.
    """
    setattr(layer, DTYPE_POLICY_ATTR, policy)


def install_dtype_policy_descriptor(descriptor):
    """Installs `descriptor` as `keras.layers.Layer._dtype_policy`.

    The descriptor must be a data descriptor that keeps the stored value in
    the instance `__dict__` under `DTYPE_POLICY_ATTR` (so that
    `stored_dtype_policy` reads it).
    """
    setattr(keras.layers.Layer, DTYPE_POLICY_ATTR, descriptor)


def remove_dtype_policy_descriptor():
    """Removes what `install_dtype_policy_descriptor` installed."""
    delattr(keras.layers.Layer, DTYPE_POLICY_ATTR)


def sublayers(layer):
    """Every layer nested in `layer` (not itself), as Keras tracks them."""
    return list(layer._flatten_layers(include_self=False))


def direct_sublayers(layer):
    """The layers `layer` tracks directly, in creation order.

    Unlike `Model.layers` this includes a `Sequential` model's `InputLayer`
    and works for any layer (also unbuilt ones); an empty list for objects
    that track no layers.
    """
    return list(getattr(layer, "_layers", ()))


def has_own_trainable_variables(layer):
    """Whether `layer` itself (not its sublayers) owns trainable variables."""
    return bool(layer._trainable_variables)


def own_variables(layer):
    """The variables `layer` itself owns (not its sublayers')."""
    return list(getattr(layer, "_trainable_variables", ())) + list(
        getattr(layer, "_non_trainable_variables", ())
    )


def get_keras_mask(x):
    """The Keras mask attached to tensor `x`, or None."""
    return _masking.get_keras_mask(x)


def set_keras_mask(x, mask):
    """Attaches `mask` to tensor `x` as Keras's masking does."""
    _masking.set_keras_mask(x, mask)


# --------------------------------------------------------------- models


def trainer_class():
    """The class whose `compile` every Keras model runs.

    `keras.src.trainers.trainer.Trainer` (Keras 3.15), renamed `BaseTrainer`
    in Keras 3.16.
    """
    cls = getattr(_trainer_module, "Trainer", None)
    return cls or getattr(_trainer_module, "BaseTrainer")


def operation_class():
    """The class whose `from_config` builds every layer from its config."""
    return keras.Operation


def backend_nn_module():
    """The module whose functions `keras.ops.nn` calls for the active
    backend, looked up at every call: `ops.dot_product_attention` (which
    `MultiHeadAttention` and keras-hub's attention layers use) ends in its
    `dot_product_attention`.

    `keras.src.backend.<backend>.nn` in Keras 3.15, reached as
    `keras.src.backend.nn`; Keras 3.16 moved the backends' op modules into
    `keras.src.backend.<backend>.ops` (`keras.src.backend.ops.nn`, and
    `keras.src.backend.nn` is gone).
    """
    from keras.src import backend as _backend

    nn = getattr(getattr(_backend, "ops", None), "nn", None)
    return nn if nn is not None else _backend.nn


def functional_class():
    """Keras's `Functional` model class (a graph of layers)."""
    from keras.src.models.functional import Functional

    return Functional


def run_through_graph(model, inputs, operation_fn):
    """Calls `operation_fn(layer)` on each layer of a Functional `model` and
    rebuilds its graph on `inputs` with the layers it returns; returns the
    outputs."""
    return model._run_through_graph(inputs, operation_fn=operation_fn)


def trace_symbolically(fn, *args):
    """Runs `fn(*args)` on symbolic stand-ins of `args` (KerasTensors) the
    way Keras builds a model (`backend.compute_output_spec`: a scratch
    TensorFlow graph, `jax.eval_shape`, PyTorch's meta device): nothing is
    computed and no variable changes, but every op is traced, so an op the
    backend refuses raises here."""
    from keras.src import backend

    return backend.compute_output_spec(fn, *args)


INTERRUPTED_WARNING_ATTR = "_interrupted_warning"
"""The `EpochIterator` method that warns "Your input ran out of data;
interrupting training": called where `steps_per_epoch` batches were asked
and the data ended before them, and, in Keras 3.15, also wherever the data
ended while an execution's batches were read (an epoch of unknown size, or
a partial last execution of `steps_per_execution` batches; Keras 3.16 warns
there only when `steps_per_epoch` was given)."""


def torch_epoch_iterator_class():
    """The iterator class of PyTorch's `fit`, `evaluate` and `predict`
    (`keras.src.backend.torch.trainer.TorchEpochIterator`); imports torch."""
    from keras.src.backend.torch import trainer

    return trainer.TorchEpochIterator


def torch_trainer_class():
    """Keras's PyTorch trainer, the class of `fit`, `evaluate` and
    `predict` on PyTorch (`keras.src.backend.torch.trainer.TorchTrainer`,
    renamed `Trainer` in Keras 3.16); imports torch."""
    from keras.src.backend.torch import trainer

    cls = getattr(trainer, "TorchTrainer", None)
    return cls or trainer.Trainer


class _Probed(Exception):
    """Raised by `_ProbeModel` at the first attribute a probed method reads
    beyond the two it is given."""


class _ProbeModel:
    """A stand-in model for `torch_trainer_runs_executions`: no function
    built yet, `steps_per_execution=2`, and nothing else."""

    train_function = test_function = predict_function = None
    steps_per_execution = 2

    def __getattr__(self, name):
        raise _Probed(name)


_RUNS_EXECUTIONS = []


def torch_trainer_runs_executions():
    """Whether Keras's PyTorch trainer runs `steps_per_execution > 1`
    itself: its `make_train_function`, `make_test_function` and
    `make_predict_function` build functions that run an execution's
    batches one step each (Keras 3.16, keras-team/keras#23234). Keras 3.15's
    refuse it with a `ValueError` before they read anything else of the
    model, which is what this asks them, on a stand-in that has only those
    two attributes (no model is made). Imports torch; asked once.
    """
    if not _RUNS_EXECUTIONS:
        cls = torch_trainer_class()
        runs = True
        for kind in ("train", "test", "predict"):
            try:
                getattr(cls, f"make_{kind}_function")(_ProbeModel())
            except ValueError:
                runs = False
            except _Probed:
                pass
        _RUNS_EXECUTIONS.append(runs)
    return _RUNS_EXECUTIONS[0]


def call_has_training_arg(model):
    """Whether `model.call` accepts a `training` argument."""
    return bool(model._call_has_training_arg)


def loss_tracker(model):
    """The `keras.metrics.Mean` that averages `model`'s loss in `fit`, or
    None (not compiled)."""
    return getattr(model, "_loss_tracker", None)


def has_compiled_loss(model):
    """Whether `model` was compiled with a loss."""
    return getattr(model, "_compile_loss", None) is not None


def set_losses_override(model, losses):
    """Makes `model.losses` return `losses` (a list of tensors) until
    `clear_losses_override`, as Keras's JAX trainer does inside a stateless
    step."""
    model._losses_override.clear()
    model._losses_override = list(losses)


def clear_losses_override(model):
    """Undoes `set_losses_override`."""
    model._losses_override.clear()


JAX_STATE_FIELDS = (
    "trainable_variables",
    "non_trainable_variables",
    "optimizer_variables",
    "metrics_variables",
)
"""The positions of the JAX trainer's state tuple (`train_step(state,
data)` takes and returns it): `state[JAX_STATE_FIELDS.index(name)]`."""


def jax_state(model):
    """The JAX trainer's state tuple of `model`'s current values, in the
    order `JAX_STATE_FIELDS` names (what `model.train_step` takes)."""
    return model._get_jax_state(
        trainable_variables=True,
        non_trainable_variables=True,
        optimizer_variables=True,
        metrics_variables=True,
    )


def jax_state_field(state, name):
    """One field of a JAX trainer state tuple, by name (`JAX_STATE_FIELDS`)."""
    return state[JAX_STATE_FIELDS.index(name)]


def jax_state_replace(state, name, value):
    """A copy of the JAX trainer state tuple `state` with field `name`
    (`JAX_STATE_FIELDS`) replaced by `value`."""
    fields = list(state)
    fields[JAX_STATE_FIELDS.index(name)] = value
    return tuple(fields)


def jax_step_batches(iterator, steps_per_execution):
    """One step's batch at a time from the iterator a JAX `fit` hands its
    train function, for one execution of `steps_per_execution` steps.

    Keras 3.15 hands one batch per `next`. Keras 3.16 hands the whole
    execution's batches as one item when `steps_per_execution > 1`: stacked
    along a new leading axis, or a `PartialBatchList` of the last few of an
    epoch; this splits that item. The returned iterator ends after the
    execution's batches (`StopIteration`), or at once at the epoch's end.
    """
    partial = getattr(_data_utils, "PartialBatchList", None)
    if partial is None or steps_per_execution == 1:
        return itertools.islice(iterator, steps_per_execution)

    def split():
        try:
            item = next(iterator)
        except StopIteration:
            return
        if isinstance(item, partial):
            yield from item
            return
        steps = keras.tree.flatten(item)[0].shape[0]
        for i in range(steps):
            yield keras.tree.map_structure(lambda x, i=i: x[i], item)

    return split()


def jax_state_sync(model):
    """Writes the values of a running JAX `fit` back into `model`'s
    variables (`model.jax_state_sync`); no-op on other backends."""
    if keras.backend.backend() == "jax" and hasattr(model, "jax_state_sync"):
        model.jax_state_sync()


# ----------------------------------------------------------- optimizers

no_automatic_dependency_tracking = _tracking.no_automatic_dependency_tracking
"""Decorator: attributes set inside the method are not tracked by Keras
(an optimizer's `build` uses it)."""


UNSCALE_GRADS_ATTR = "_unscale_grads"
"""The method of Keras 3.16's `keras.optimizers.LossScaleOptimizer` that
its `apply` and `stateless_apply` unscale the gradients with
(`(grads, variables) -> grads`); Keras 3.15 inlines the division in each.
`kerasmp.LossScaleOptimizer` defines it (its own `apply` and
`stateless_apply` do not call it), so that an inherited Keras path
unscales the kerasmp way."""


def optimizer_iterations(optimizer):
    """The optimizer's step-counter variable (`optimizer.iterations` is a
    read-only property returning it)."""
    return optimizer._iterations


def optimizer_own_variables(optimizer):
    """The variables `optimizer` created itself (for a wrapper such as
    `LossScaleOptimizer`: not those of the inner optimizer), in creation
    order; `optimizer.variables` starts with them."""
    return list(optimizer._variables)


def optimizer_trainable_variables(optimizer):
    """The model variables `optimizer` was built with, in build order."""
    return list(optimizer._trainable_variables)


def optimizer_variable_index(optimizer, variable):
    """The position of model `variable` in the list `optimizer` was built
    with."""
    return optimizer._get_variable_index(variable)


def overwrites_with_gradient(optimizer, variable):
    """Whether `optimizer` assigns the "gradient" of `variable` instead of
    applying it (`variable.overwrite_with_gradient`, used for float8
    scaling factors): such gradients must not be unscaled."""
    return optimizer._overwrite_variable_with_gradient(variable)


def accumulated_gradients(optimizer):
    """The gradient accumulator variables of `optimizer` (empty unless
    `gradient_accumulation_steps` is set)."""
    return list(getattr(optimizer, "_accumulated_gradients", None) or ())


def reset_gradient_accumulators(optimizer):
    """Zeroes the gradient accumulators of `optimizer` (stateful)."""
    optimizer._backend_reset_gradient_accumulators()


# -------------------------------------------- torch.compile (PyTorch)


def compile_inline_only(function, callees=False):
    """Makes Dynamo (`torch.compile`: `jit_compile=True` on PyTorch) run
    `function` as plain Python whenever it meets it as a frame of its own;
    a frame Dynamo traces still traces `function` inline, as before.

    Inside a compiled function, the code after a graph break runs eagerly
    and Dynamo compiles each Python function it calls as a frame of its
    own, guarded on the Python objects that frame read: a function called
    with a layer of every class, or reading a value that changes each call,
    recompiles at every call until `torch._dynamo.config.recompile_limit`.
    With `callees`, the functions `function` calls from such a frame run as
    plain Python too (for code without tensor work); without, Dynamo
    compiles them as usual. A no-op until PyTorch is imported.

    PyTorch internal: `set_code_exec_strategy` (torch._C._dynamo), the
    per-code-object switch `torch.compiler.disable` and Dynamo's own
    recompile limit set; `torch.compiler.disable` itself cannot be used, as
    it makes every traced call of the function a graph break.
    """
    torch = sys.modules.get("torch")
    if torch is None:
        return
    from torch._C._dynamo import eval_frame

    action = eval_frame._FrameAction
    eval_frame.set_code_exec_strategy(
        getattr(function, "__func__", function).__code__,
        eval_frame._FrameExecStrategy(
            action.SKIP, action.SKIP if callees else action.DEFAULT
        ),
    )


# ------------------------------------------------------ serialization


def dtype_policy_modules():
    """The modules whose `serialize`/`deserialize` Keras and keras-hub call
    for dtype policies: `keras.src.dtype_policies` and the public modules
    that re-export them."""
    import keras.dtype_policies as public

    modules = [_dtype_policies, public]
    try:
        from keras._tf_keras.keras import dtype_policies as tf_keras_public

        modules.append(tf_keras_public)
    except ImportError:
        pass
    return modules


def keras_saveable_class():
    """The class Keras's saving recognises as holding state
    (`keras.src.saving.keras_saveable.KerasSaveable`): a `.keras` or
    `.weights.h5` file walks an object's attributes and keeps each instance
    at `<path>/<attribute>/vars`, by its `save_own_variables` and
    `load_own_variables`; its `_obj_type()` must name a kind Keras knows
    (`"Optimizer"`), and a file without that path loads it from an empty
    store."""
    from keras.src.saving.keras_saveable import KerasSaveable

    return KerasSaveable


# -------------------------------------------------------------- export


def patch_tf2onnx():
    """Applies Keras's numpy-2 compatibility patch to tf2onnx, as
    `keras.export` does before converting."""
    from keras.src.export.tf2onnx_lib import patch_tf2onnx as patch

    patch()


def tflite_schema():
    """TensorFlow's generated flatbuffer schema of `.tflite` files (not a
    public TensorFlow module), to read a model's buffers."""
    from tensorflow.lite.python import schema_py_generated

    return schema_py_generated


def litert_schema():
    """LiteRT's generated flatbuffer schema of `.tflite` files, with its
    object API (`ModelT`, ...; the schema the LiteRT converter writes,
    newer than TensorFlow's): to store a PyTorch-converted file's float32
    weights in float16. Not a documented module of ai_edge_litert."""
    from ai_edge_litert import schema_py_generated

    return schema_py_generated


# ------------------------------------ JAX to TensorFlow (jax2tf, StableHLO)


def tensorflow_stablehlo_version():
    """The newest StableHLO version TensorFlow's `XlaCallModule` op reads
    (`"1.13.7"` in TensorFlow 2.21): a jax2tf SavedModel holds the JAX
    program as a StableHLO artifact that this op deserializes when called.
    None if TensorFlow does not say (its `stablehlo` module is not public).
    """
    try:
        from tensorflow.compiler.mlir.stablehlo import stablehlo
    except ImportError:
        return None
    return getattr(stablehlo, "get_current_version", lambda: None)()


def _jax_hlo():
    from jax._src.lib.mlir.dialects import hlo

    return hlo


def jax_stablehlo_versions():
    """`(oldest, target)`: the oldest StableHLO version this JAX can write,
    and the one `jax.export` (and so jax2tf) writes by default (JAX's
    4-week compatibility window: `"1.22.0"` in JAX 0.12.1, `"1.15.0"` in
    0.10.2)."""
    hlo = _jax_hlo()
    week_4 = hlo.StablehloCompatibilityRequirement.WEEK_4
    return (hlo.get_minimum_version(),
            hlo.get_version_from_compatibility_requirement(week_4))


def stablehlo_older(a, b):
    """Whether StableHLO version `a` is older than `b` (`"x.y.z"`)."""
    return a != b and _jax_hlo().get_smaller_version(a, b) == a


@contextlib.contextmanager
def jax_export_stablehlo_at_most(version):
    """While inside, `jax.export` (jax2tf's serialization) writes StableHLO
    no newer than `version`: JAX's `_module_to_bytecode` asks
    `hlo.get_version_from_compatibility_requirement` for its target, and
    here the `hlo` its module sees answers the older of that and
    `version`. StableHLO downgrades the program (`vhlo.custom_call_v2` to
    `custom_call_v1`, ...), or raises if it uses an op `version` lacks.
    """
    from jax._src.export import _export

    hlo = _export.hlo

    class Capped:
        def __getattr__(self, name):
            return getattr(hlo, name)

        def get_version_from_compatibility_requirement(self, requirement):
            target = hlo.get_version_from_compatibility_requirement(
                requirement)
            return hlo.get_smaller_version(target, version)

    _export.hlo = Capped()
    try:
        yield
    finally:
        _export.hlo = hlo


# ------------------------------------- a running JAX fit's state, in place


def jax_unsynced_state(model):
    """The newest values of a running JAX `fit` that are not yet written
    back into `model`'s variables: the trainer's `{field: list}` dict, with
    the fields of `JAX_STATE_FIELDS`, each list aligned with the model's
    (or optimizer's) variable list of that name. None when no JAX `fit` is
    running or its state is synced (`jax_state_sync`): the variables hold
    the current values then.

    While this is not None, the variables hold placeholders (Keras purges
    them during a JAX `fit`: reading one gives its initializer's value);
    read the values from this dict instead, or sync first (which writes
    every variable back and makes the next step re-read them all)."""
    if keras.backend.backend() != "jax":
        return None
    state = getattr(model, "_jax_state", None)
    if not state or getattr(model, "_jax_state_synced", True):
        return None
    return state


def callback_model(callback):
    """The model `callback` is set to, without a sync: on JAX, every access
    to `callback.model` runs `model.jax_state_sync()` (Keras's
    `Callback.model` property), which writes a running fit's whole state
    back into the variables and makes the next step re-read them all."""
    return callback._model


def jax_coordination_client():
    """The key-value store of JAX's distributed runtime (the coordination
    service that `jax.distributed.initialize` connects to: `key_value_set`,
    `blocking_key_value_get`), or None outside a multi-process run.

    It reaches every process over its own channel, not the devices'
    collectives, so a message never pairs with another process's collective
    (JAX's `device_put` of each variable is one, a process_allgather)."""
    from jax._src import distributed

    return distributed.global_state.client


def is_backend_module(module):
    """Whether `module` (a serialized object's module name) is one of a
    Keras backend's private modules (`keras.src.backend.<backend>...`):
    on PyTorch Keras serializes its optimizers as their torch subclasses
    there (`keras.src.backend.torch.optimizers.torch_adam`)."""
    return isinstance(module, str) and module.startswith("keras.src.backend.")
