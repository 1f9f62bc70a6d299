"""How kerasmp policies are saved and loaded.

A kerasmp policy is saved as the stock `keras.DTypePolicy` plain Keras can
load (`portable_policy_name`; a `DTypePolicyMap` naming the layers
`compile`'s measurement moved to float32, `stock_measured`) plus a
`"kerasmp"` entry stock Keras ignores;
with kerasmp, `deserialize` rebuilds the kerasmp policy (only kerasmp's own
classes) and `construct` builds the layer with that policy made global while
its constructor runs (sublayers created in `__init__` get it too). The
patches in `kerasmp._patches` route Keras's serialize, deserialize and
`Operation.from_config` through these functions.
"""

import keras

from kerasmp.float8.policies import POLICY_CLASSES
from kerasmp.float8.rule import base_name
from kerasmp.policy.policy import Float32Override
from kerasmp.policy.policy import Policy

_KERASMP_KEY = "kerasmp"
_SAVED_CLASSES = {
    cls.__name__: cls
    for cls in (Policy, Float32Override) + POLICY_CLASSES
}


# Stock normalization layers: float32 arithmetic inside, output in the
# compute dtype (BatchNormalization, LayerNormalization, GroupNormalization
# upcast and cast back).
_UPCASTING_CLASSES = ("BatchNormalization", "LayerNormalization",
                      "GroupNormalization")


def portable_policy_name(policy):
    """The stock policy name a kerasmp policy is saved under.

    A kerasmp float32 override of a stock normalization layer (its rule
    names the class: `"Keras class (LayerNormalization)"`) is saved as its
    governing policy's name (`"mixed_float16"`): stock Keras then rounds the
    layer's input to float16, computes in float32 with float32 weights and
    returns float16, which is what kerasmp computes inside a model (the
    hand-back above). Saved as `"float32"`, a load without kerasmp returned
    unrounded float32 outputs into residual adds, and lost the rounding of
    the input where a container whose `from_config` drops its dtype (a
    nested `Sequential`: ConvNeXt) used to do it. Any other policy keeps
    its own name.
    """
    if isinstance(policy, Float32Override):
        rule = policy.rule or ""
        detail = rule[rule.find("(") + 1:-1] if rule.endswith(")") else rule
        governing = policy.policy
        if (detail in _UPCASTING_CLASSES and isinstance(governing, Policy)
                and governing.compute_dtype in ("float16", "bfloat16")):
            return base_name(governing.name)  # a name Keras knows
    return policy.name



def stock_measured(policy, stock):
    """`stock`, or, for a policy that records layers `compile`'s
    measurement moved to float32 (`Policy.measured`), a stock
    `keras.dtype_policies.DTypePolicyMap` with `stock` as its default and
    `"float32"` at the path of each move stock Keras computes as kerasmp
    does (`portable`). A layer given such a map hands it to the sublayers it
    creates (`dtype=self.dtype_policy`, as Keras's composite layers and
    keras-hub's do), and each looks its own `Layer.path` up in it: a router
    that its block creates in code reloads in float32 without kerasmp.
    """
    measured = policy.measured if isinstance(policy, Policy) else {}
    paths = sorted(p for p, entry in measured.items()
                   if entry.get("portable"))
    if not paths:
        return stock
    return keras.dtype_policies.DTypePolicyMap(
        default_policy=stock,
        policy_map={p: keras.DTypePolicy("float32") for p in paths})


def serialize(policy, stock_serialize):
    """`dtype_policies.serialize` that stock Keras can read back.

    Args:
        policy: A dtype policy.
        stock_serialize: Keras's own `serialize`.
    """
    if not isinstance(policy, tuple(_SAVED_CLASSES.values())):
        return stock_serialize(policy)
    stock = getattr(policy, "stock_policy", None)  # float8 policies
    stock = stock() if stock else keras.DTypePolicy(
        portable_policy_name(policy))
    config = stock_serialize(stock_measured(policy, stock))
    config[_KERASMP_KEY] = {
        "class_name": type(policy).__name__,
        "config": policy.get_config(),
    }
    return config


def policy_from_saved(entry):
    """Rebuilds a kerasmp policy from the `"kerasmp"` entry of a file.

    Only kerasmp's own policy classes are accepted: a file cannot make this
    function import a module or build any other object.

    Raises:
        ValueError: The entry names anything else.
    """
    name = entry.get("class_name") if isinstance(entry, dict) else None
    cls = _SAVED_CLASSES.get(name)
    if cls is None or not isinstance(entry.get("config"), dict):
        raise ValueError(
            "Invalid kerasmp dtype policy in the saved file: expected "
            f"{sorted(_SAVED_CLASSES)} with a config dict. Received: "
            f"{entry!r:.200}"
        )
    return cls.from_config(entry["config"])


def deserialize(config, stock_deserialize, custom_objects=None):
    """`dtype_policies.deserialize` that restores kerasmp policies."""
    if isinstance(config, dict) and _KERASMP_KEY in config:
        return policy_from_saved(config[_KERASMP_KEY])
    return stock_deserialize(config, custom_objects=custom_objects)


def construct(cls, config, stock_from_config, stock_deserialize):
    """`Operation.from_config` that builds a layer saved with a kerasmp
    policy the way it was built before saving: with its kerasmp policy
    global, whatever the global policy of the loading process."""
    dtype = config.get("dtype") if isinstance(config, dict) else None
    if not isinstance(dtype, dict):
        return stock_from_config(cls, config)
    policy = deserialize(dtype, stock_deserialize)
    if not isinstance(policy, (Policy, Float32Override)):
        return stock_from_config(cls, config)
    governing = policy if isinstance(policy, Policy) else policy.policy
    previous = keras.config.dtype_policy()
    keras.config.set_dtype_policy(governing)
    try:
        return stock_from_config(cls, {**config, "dtype": policy})
    finally:
        keras.config.set_dtype_policy(previous)
