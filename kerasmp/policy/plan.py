"""One precision plan per model, made once and read by every tool.

`plan_of(model)` walks the model's layers once (`kerasmp._utils.layers.walk`)
and returns a frozen `Plan`: for every layer (by path) the layer, its stored
policy, the kerasmp policy governing it, the float32 rule that applies, the
measured move recorded for it (`Policy.measured`) and its float8 decision;
and for the model the governing policy, the float8 rule's decisions and
whether a trainable layer computes in float16 (so the optimizer needs loss
scaling).

`compile` (`kerasmp._patches`: the loss-scale optimizer, the float8
assignment, `kerasmp.policy.advice`, the workers' settings check
`kerasmp.policy.workers`), the measurement at the first call
(`kerasmp.policy.measure`), `kerasmp.export`, `kerasmp.check` and
`kerasmp.tune` all read the model's plan instead of walking it again.

The plan is cached on the model (one attribute of kerasmp's in the model's
`__dict__`, as `kerasmp.policy.measure` marks a measured model, holding a
plain object that `.keras` saving and Keras's tracking do not look into) with a
fingerprint of what it was made from: the global dtype policy and, for the
model and each layer Keras tracks in it (`_keras_internals.sublayers`, Keras's
own flat listing: no paths, no rules), the layer, its name, its stored policy
object, `trainable` and `built`. `plan_of` compares the fingerprint (one flat
listing, no `walk`) and makes a new plan when it differs: a policy set on a
layer (`layer.dtype_policy = ...`, the measurement's float32 moves, a policy
with new `measured` entries), a new global policy, a layer added or removed,
renamed, frozen or built. Attributes a layer's rules or float8 decision read
that none of these touch (a weight's value) are not watched: a plan is about
policies and structure. `plan(model)` makes a fresh plan, uncached.
"""

import dataclasses
import functools

import keras

from kerasmp import _keras_internals as _ki
from kerasmp._utils.layers import walk
from kerasmp.float8.layers import decide
from kerasmp.float8.policies import POLICY_CLASSES
from kerasmp.policy.policy import Policy
from kerasmp.policy.policy import stored_policy

_CACHE = "_kerasmp_plan"  # in a model's __dict__: a `_Cached`


class _Cached:
    """A model's plan and its fingerprint, in a plain object: `.keras`
    saving walks a model's attributes into lists, tuples and dicts (a tuple
    holding the model's layers would be saved again, and the model itself
    recursed into), and Keras's tracking records only what `__setattr__`
    sees; neither looks inside this."""

    __slots__ = ("ids", "objects", "plan")

    def __init__(self, ids, objects, plan):
        self.ids = ids
        self.objects = objects
        self.plan = plan


@dataclasses.dataclass(frozen=True)
class LayerPlan:
    """What the plan says of one layer.

    Attributes:
        path: Its path from the model root (`kerasmp._utils.layers.walk`).
        layer: The layer.
        stored: The dtype policy stored on it (before kerasmp resolves it).
        policy: The `kerasmp.Policy` governing it (its stored policy, or the
            one behind its float8 policy), or None.
        rule: The float32 rule of `policy` that matches it
            (`Policy.float32_rule`), or None (also when not governed).
        measured: The `Policy.measured` entry of its Keras path
            (`{"rule": ..., "portable": ...}` or `{"half": True}`), or None.
        float8: Its float8 `Decision` (`kerasmp.float8.decide`), or None.
    """

    path: str
    layer: object
    stored: object
    policy: object
    rule: object
    measured: object
    float8: object


@dataclasses.dataclass(frozen=True)
class Plan:
    """The precision plan of one model.

    Attributes:
        policy: The `kerasmp.Policy` governing the model (its own, or its
            first governed layer's), or None when no kerasmp policy governs
            any layer: the model then compiles as in stock Keras.
        dtype_policy: The name of the model's own dtype policy.
        float8: The float8 rule's `Decision`s (`kerasmp.float8.decide`),
            one per layer a float8 policy governs.
        float16_training: Whether a trainable layer a kerasmp policy
            governs computes in float16 and owns trainable variables (its
            sublayers' variables count for the sublayers); before `build` a
            layer's variables are unknown, so an unbuilt trainable float16
            layer with no sublayers counts.
        layers: One `LayerPlan` per layer, in `walk` order (the model
            itself not included).
        root: The model's own `LayerPlan` (path `""`).
    """

    policy: object
    dtype_policy: str
    float8: tuple
    float16_training: bool
    layers: tuple = ()
    root: object = None

    @property
    def governed(self):
        """Whether a kerasmp policy governs the model."""
        return self.policy is not None

    @property
    def needs_loss_scaling(self):
        """Whether `compile` gives the model kerasmp's loss scaling."""
        return self.float16_training

    def walk(self):
        """`[(path, layer)]`, as `walk(model)` lists them."""
        return [(entry.path, entry.layer) for entry in self.layers]

    @functools.cached_property
    def _by_path(self):
        entries = {entry.path: entry for entry in self.layers}
        if self.root is not None:
            entries[""] = self.root
        return entries

    def __getitem__(self, path):
        """The `LayerPlan` at `path` (`""`: the model); KeyError if none."""
        return self._by_path[path]


def _governing(layer):
    """The kerasmp `Policy` that governs `layer`, or None: its stored
    policy, or the policy behind a per-layer float8 policy."""
    stored = stored_policy(layer)
    if isinstance(stored, POLICY_CLASSES):
        stored = stored.policy
    return stored if isinstance(stored, Policy) else None


def _trains_in_float16(layer):
    if layer.compute_dtype != "float16" or not layer.trainable:
        return False
    if layer.built:
        return _ki.has_own_trainable_variables(layer)
    return not _ki.direct_sublayers(layer)


def _entry(path, layer, float8):
    governing = _governing(layer)
    measured = None
    if governing is not None:
        measured = governing.measured_entry(getattr(layer, "path", None))
    return LayerPlan(
        path=path, layer=layer, stored=stored_policy(layer),
        policy=governing,
        rule=governing.float32_rule(layer) if governing else None,
        measured=measured, float8=float8.get(id(layer)))


def plan(model):
    """A fresh `Plan` of `model`, from one walk of its layers (not cached:
    `plan_of` is the one to call).

    Args:
        model: A `keras.Model`.

    Example:

    >>> kerasmp.set_global_policy("mixed_float16")
    >>> model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(2)])
    >>> kerasmp.policy.plan.plan(model).needs_loss_scaling
    True
    >>> kerasmp.set_global_policy("float32")
    """
    layers = list(walk(model))
    governed = [
        layer for layer in [model] + [l for _, l in layers]
        if _governing(layer) is not None
    ]
    decisions = tuple(decide(model, layers)) if governed else ()
    by_layer = {id(d.layer): d for d in decisions}
    return Plan(
        policy=_governing(governed[0]) if governed else None,
        dtype_policy=model.dtype_policy.name,
        float8=decisions,
        float16_training=any(_trains_in_float16(l) for l in governed),
        layers=tuple(_entry(p, l, by_layer) for p, l in layers),
        root=_entry("", model, by_layer),
    )


def fingerprint(model):
    """What `model`'s plan was made from, as `(ids, objects)`: the ids of
    the global policy and, per tracked layer, of the layer, its name, its
    stored policy, `trainable` and `built`; `objects` keeps every object
    whose id counts alive, so no id is reused while the plan is cached."""
    objects = [keras.config.dtype_policy()]
    ids = [id(objects[0])]
    for layer in [model] + _ki.sublayers(model):
        stored = stored_policy(layer)
        objects += [layer, stored]
        ids += [id(layer), layer.name, id(stored), bool(layer.trainable),
                bool(layer.built)]
    return tuple(ids), objects


def plan_of(model):
    """The `Plan` of `model`: made by `plan` the first time, then the same
    object until the model or a policy changes (see the module docstring).

    Args:
        model: A `keras.Model`.

    Example:

    >>> kerasmp.set_global_policy("mixed_float16")
    >>> model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(2)])
    >>> plan = kerasmp.policy.plan.plan_of(model)
    >>> plan is kerasmp.policy.plan.plan_of(model)
    True
    >>> kerasmp.set_global_policy("float32")
    """
    ids, objects = fingerprint(model)
    cached = model.__dict__.get(_CACHE)
    if cached is not None and cached.ids == ids:
        return cached.plan
    made = plan(model)
    # object.__setattr__: keep this out of Keras's attribute tracking.
    object.__setattr__(model, _CACHE, _Cached(ids, objects, made))
    return made
