"""How a `kerasmp.LossScaleOptimizer` is saved, so that plain Keras loads it.

Keras writes the compile config, optimizer included, into every `.keras`
file (`model.save`, `ModelCheckpoint`), and its optimizer state into every
`.keras` and `.weights.h5`. kerasmp saves its optimizer as **stock Keras's
`keras.optimizers.LossScaleOptimizer` plus a `"kerasmp"` entry**, as it saves
its dtype policies (`kerasmp.policy.saving`):

- The config. In the compile config, the optimizer is the stock class
  (`module` `keras.optimizers`, no `registered_name`) with the keys stock
  Keras's `from_config` accepts (`name`, `inner_optimizer`, `initial_scale`,
  `dynamic_growth_steps`), and beside them a `"kerasmp"` entry with the
  whole kerasmp config (growth and backoff factors, hysteresis, bounds,
  static mode). Keras's deserializer ignores keys other than
  `class_name`/`config`/`module`/`registered_name`, so without kerasmp the
  file compiles with a stock loss-scale optimizer; with kerasmp,
  `restored_entry` (called by kerasmp's `compile_from_config` patch, which
  `portable_entry` mirrors in `get_compile_config`) rebuilds kerasmp's
  optimizer with every setting. An `initial_scale="auto"` is written as 1
  for stock Keras (where "auto" starts), and a static scale
  (`dynamic=False`, which stock Keras refuses) as the longest growth
  interval: stock Keras then keeps the scale until an overflow, when it
  halves it.
- The state. `optimizer/vars` holds exactly the variables stock Keras's
  optimizer has, in its order (its iterations, learning rate,
  `step_counter`, `dynamic_scale`, then the inner optimizer's), so that
  stock Keras's `load_own_variables`, which loads nothing unless the counts
  match, restores the scale and the inner optimizer's slots. kerasmp's
  own counters (hysteresis budget, skipped steps, discarded micro-steps)
  are kept at `optimizer/kerasmp_scale_state/vars`, by name, where stock
  Keras does not look (`ScaleStateStore`).

Files written before (kerasmp 0.1.0 up to this layout) name kerasmp's class
in the config and hold all the variables in `optimizer/vars`; kerasmp loads
them as before, and plain Keras cannot (their config names a class it does
not have).
"""

import keras

from kerasmp import _keras_internals as _ki

KERASMP_KEY = "kerasmp"
"""The key of the kerasmp entry beside a saved optimizer's stock config."""

REGISTERED_NAME = "kerasmp>LossScaleOptimizer"
CLASS_NAME = "LossScaleOptimizer"
STOCK_MODULE = "keras.optimizers"
STOCK_KEYS = ("name", "inner_optimizer", "initial_scale",
              "dynamic_growth_steps")
"""The config keys stock Keras's `LossScaleOptimizer.from_config` takes."""

LONGEST_GROWTH_INTERVAL = 2**31 - 1
"""A static scale's growth interval for stock Keras (an int32 counter)."""


def portable_entry(entry):
    """The compile config's optimizer entry, as plain Keras can load it.

    Args:
        entry: The serialized optimizer of a compile config (a dict); any
            entry but kerasmp's `LossScaleOptimizer` is returned unchanged.

    Returns:
        The stock `keras.optimizers.LossScaleOptimizer` entry with a
        `"kerasmp"` entry holding kerasmp's whole config.

    Example:

    >>> entry = keras.saving.serialize_keras_object(
    ...     kerasmp.LossScaleOptimizer(keras.optimizers.SGD(), hysteresis=2))
    >>> portable = kerasmp.optimizer.saving.portable_entry(entry)
    >>> portable["module"], portable["kerasmp"]["config"]["hysteresis"]
    ('keras.optimizers', 2)
    """
    if not (isinstance(entry, dict)
            and entry.get("registered_name") == REGISTERED_NAME
            and isinstance(entry.get("config"), dict)):
        # Another optimizer is left as stock Keras writes it (Keras's own
        # tests read the file's config back).
        return entry
    config = dict(entry["config"])
    if "inner_optimizer" in config:
        config["inner_optimizer"] = public_module(config["inner_optimizer"])
    stock = {key: config[key] for key in STOCK_KEYS if key in config}
    if isinstance(stock.get("initial_scale"), str):  # "auto" starts at 1
        stock["initial_scale"] = 1.0
    if config.get("dynamic") is False:
        stock["dynamic_growth_steps"] = LONGEST_GROWTH_INTERVAL
    portable = {key: value for key, value in entry.items()
                if key not in ("module", "class_name", "config",
                               "registered_name")}
    portable.update(
        module=STOCK_MODULE,
        class_name=CLASS_NAME,
        config=stock,
        registered_name=None,
    )
    portable[KERASMP_KEY] = {"class_name": CLASS_NAME, "config": config}
    return portable


def public_module(entry):
    """A Keras optimizer's serialized entry, naming `keras.optimizers` for
    a built-in optimizer that names a backend's module.

    On PyTorch, Keras serializes `keras.optimizers.Adam` as its backend
    subclass's private module (`_ki.is_backend_module`):
    loaded on another backend, that module's class ran torch ops on
    TensorFlow variables, so a compiled file written on PyTorch did not
    train on TensorFlow (stock Keras 3.15 the same). Loaded from
    `keras.optimizers`, each backend builds its own. kerasmp rewrites the
    inner optimizer of its own `LossScaleOptimizer` so; another optimizer
    is saved as stock Keras saves it.

    Args:
        entry: A serialized optimizer (any other value is returned as is).
    """
    if not isinstance(entry, dict):
        return entry
    module = entry.get("module")
    name = entry.get("class_name")
    if (_ki.is_backend_module(module) and isinstance(name, str)
            and isinstance(getattr(keras.optimizers, name, None), type)):
        return {**entry, "module": "keras.optimizers"}
    return entry


def restored_entry(entry, module):
    """The optimizer entry of a saved compile config, as kerasmp loads it.

    Only kerasmp's own `LossScaleOptimizer` can come out of the `"kerasmp"`
    entry: a file cannot make this function name another class.

    Args:
        entry: The serialized optimizer of a saved compile config.
        module: The module of kerasmp's `LossScaleOptimizer`.

    Returns:
        kerasmp's `LossScaleOptimizer` entry (its registered name and whole
        config) where `entry` holds a `"kerasmp"` entry; else `entry`.

    Raises:
        ValueError: The `"kerasmp"` entry names another class or holds no
            config dict.
    """
    if not isinstance(entry, dict) or KERASMP_KEY not in entry:
        return entry
    saved = entry[KERASMP_KEY]
    if not (isinstance(saved, dict) and saved.get("class_name") == CLASS_NAME
            and isinstance(saved.get("config"), dict)):
        raise ValueError(
            "Invalid kerasmp optimizer in the saved file: expected "
            f"{{'class_name': '{CLASS_NAME}', 'config': {{...}}}}. "
            f"Received: {saved!r:.200}"
        )
    restored = {key: value for key, value in entry.items()
                if key != KERASMP_KEY}
    restored.update(
        module=module,
        class_name=CLASS_NAME,
        config=saved["config"],
        registered_name=REGISTERED_NAME,
    )
    return restored


def portable_compile_config(config):
    """`get_compile_config()`'s result with its optimizer made portable
    (`portable_entry`)."""
    if isinstance(config, dict) and "optimizer" in config:
        config = {**config, "optimizer": portable_entry(config["optimizer"])}
    return config


def restored_compile_config(config, module):
    """A saved compile config with kerasmp's optimizer restored
    (`restored_entry`)."""
    if isinstance(config, dict) and "optimizer" in config:
        config = {**config,
                  "optimizer": restored_entry(config["optimizer"], module)}
    return config


def kerasmp_variables(optimizer):
    """`{name: variable}` of a built kerasmp optimizer's state that stock
    Keras's optimizer lacks (hysteresis budget, skipped-step counters,
    discarded micro-steps)."""
    variables = [optimizer.hysteresis_budget, optimizer.total_skipped_steps,
                 optimizer.consecutive_skipped_steps]
    if optimizer.inner_optimizer.gradient_accumulation_steps:
        variables.append(optimizer.discarded_micro_steps)
    return {v.name: v for v in variables}


def stock_layout(optimizer):
    """The variables stock Keras's `LossScaleOptimizer` would have, in its
    order (its own, then the inner optimizer's): what `optimizer/vars`
    holds."""
    extra = {id(v) for v in optimizer.kerasmp_scale_state.variables_of()
             .values()}
    return [v for v in optimizer.variables if id(v) not in extra]


def save_stock_layout(optimizer, store):
    """`save_own_variables`: the stock layout, keyed "0", "1", ... as
    Keras keys them."""
    for i, variable in enumerate(stock_layout(optimizer)):
        store[str(i)] = variable.numpy()


def load_layout(optimizer, store):
    """`load_own_variables`: loads the stock layout, or all the variables
    from a file written before kerasmp kept its own state apart; returns
    False (nothing loaded) when `store` holds neither."""
    count = len(store.keys())
    layout = stock_layout(optimizer)
    if count != len(layout) and count == len(optimizer.variables):
        layout = optimizer.variables  # written before: all in one
    if count != len(layout):
        return False
    for i, variable in enumerate(layout):
        variable.assign(store[str(i)])
    return True


class ScaleStateStore(_ki.keras_saveable_class()):
    """The part of a `kerasmp.LossScaleOptimizer`'s state that stock Keras's
    optimizer does not have, as a file keeps it.

    Keras's saving keeps it at `optimizer/kerasmp_scale_state/vars`, one
    entry per variable, by the variable's name; a file without that path
    (written by stock Keras, or by kerasmp before this layout) leaves the
    variables as they are.

    Args:
        variables: A function returning `{name: variable}` of that state
            (empty before the optimizer is built).
    """

    def __init__(self, variables):
        self.variables_of = variables

    def _obj_type(self):
        return "Optimizer"

    def save_own_variables(self, store):
        for name, variable in self.variables_of().items():
            store[name] = variable.numpy()

    def load_own_variables(self, store):
        saved = set(store.keys())
        for name, variable in self.variables_of().items():
            if name in saved:
                variable.assign(store[name])
