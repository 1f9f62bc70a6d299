"""Which layers are normalizations: the rule behind kerasmp's float32 default.

Keras's own normalization classes are found by `isinstance`. Model libraries
and users define their own (keras-hub 0.32 has about 25: `T5LayerNorm`,
`MistralLayerNormalization`, gemma's `RMSNormalization`, ...; every LLM
tutorial has a `class RMSNorm(keras.layers.Layer)`), all subclassing
`keras.layers.Layer` directly, so no `isinstance` check sees them. The rule
here, "normalization by name", catches them by structure and name:

1. the name of the layer's class, or of a class it inherits from (below
   `keras.layers.Layer`), ends in "Norm" or "Normalization" (any case,
   optionally followed by a dimension such as "2d": `RmsNorm2d`), and
2. the layer is not a composite: none of its sublayers (at any depth) is a
   compute-heavy layer (Dense, EinsumDense, a convolution, Embedding,
   attention, a recurrent layer, a wrapper or a model) or owns a kernel (a
   variable with two or more dimensions above 1), and, once built, the layer
   owns no such kernel itself.

A layer is judged once it is constructed: while its `__init__` runs (when
keras-hub layers read `self.dtype_policy` to hand it to their sublayers) the
rule says "not yet", so sublayers receive the governing policy itself and are
judged on their own. `AdaptiveLayerNormalization` (stable diffusion 3, a
Dense inside) and `SpectralNormalization` (a wrapper around a Dense or Conv)
are composites and stay in the compute dtype; `ConvNormAct` and
`DFineConvNormLayer` fail both tests.

`KNOWN_FLOAT16_HAZARDS` is the second built-in rule: classes whose own
arithmetic is broken in float16 (and only float16). keras-hub's
`T5MultiHeadAttention` builds its attention mask bias as
`(1 - mask) * -1e9` in its compute dtype: in float16 `-1e9` is -inf and
`0 x -inf` is NaN, so every unmasked position is NaN; so do the encoder and
decoder layers of T5Gemma and T5Gemma2, in their own `call`. Flux's
`TimestepEmbedding` takes cos/sin of `1000 * t * freqs`: float16 rounds those
phases to 0.5 near 1000, so its embedding is off by up to 0.25 (Stable
Diffusion 3's layer of that name computes the phases in float32 itself).
Computing such a layer in float32 fixes it; its Dense projections and
attention are sublayers, judged on their own, and stay float16.

Everything here is a pure function of the layer (and the Python call stack,
for "while its `__init__` runs"); `kerasmp.policy` applies the rules.
"""

import inspect
import re

import keras

from kerasmp import _keras_internals as _ki

NORMALIZATION_NAME = re.compile(
    r"(?i).*norm(alization|alisation)?(_?gated)?(_?[123]d)?")
"""A class name that ends like a normalization's (matched with fullmatch)."""


def _keras_classes(names):
    return tuple(getattr(keras.layers, n) for n in names
                 if hasattr(keras.layers, n))


KERAS_NORMALIZATION_CLASSES = _keras_classes((
    "BatchNormalization",
    "LayerNormalization",
    "GroupNormalization",
    "UnitNormalization",
    "RMSNormalization",
    "Normalization",
))
"""Keras's own normalization layers (they match by `isinstance`)."""

COMPUTE_HEAVY_CLASSES = _keras_classes((
    "Dense", "EinsumDense", "Embedding",
    "Conv1D", "Conv2D", "Conv3D",
    "Conv1DTranspose", "Conv2DTranspose", "Conv3DTranspose",
    "DepthwiseConv1D", "DepthwiseConv2D",
    "SeparableConv1D", "SeparableConv2D",
    "MultiHeadAttention", "GroupQueryAttention", "Attention",
    "AdditiveAttention", "RNN", "Wrapper",
)) + (keras.Model,)
"""Sublayers that make a layer a composite block, not a normalization."""

_MASK_BIAS = (
    "keras-hub builds its attention mask bias as (1 - mask) * -1e9 in the "
    "compute dtype: -1e9 is -inf in float16 and 0 x -inf is NaN")

KNOWN_FLOAT16_HAZARDS = {
    "T5MultiHeadAttention": _MASK_BIAS,
    # T5Gemma's and T5Gemma2's encoder and decoder layers build the same
    # bias in their own `call` (NaN on every position, padded or not).
    "T5GemmaEncoderLayer": _MASK_BIAS,
    "T5GemmaDecoderLayer": _MASK_BIAS,
    "T5Gemma2EncoderLayer": _MASK_BIAS,
    "T5Gemma2DecoderLayer": _MASK_BIAS,
    # Flux's sinusoidal timestep embedding (keras-hub's
    # `flux_maths.TimestepEmbedding`); Stable Diffusion 3's layer of the
    # same name already computes it in float32.
    "TimestepEmbedding": (
        "keras-hub's Flux takes cos/sin of 1000 * t * freqs in the compute "
        "dtype: float16's spacing near 1000 is 0.5, so the phases, and the "
        "embedding, are off by up to 0.25"),
}
"""Class name -> why the class's own arithmetic is broken in float16: NaN or
inf (T5's mask bias), or far off float32 (Flux's phases); float16 only."""

UNDECIDED = object()
"""Returned by a rule while the layer is still being constructed."""


def class_names(layer):
    """Names of `layer`'s class and of its bases below `keras.layers.Layer`."""
    names = []
    for cls in type(layer).__mro__:
        if cls is keras.layers.Layer or not issubclass(
                cls, keras.layers.Layer):
            break
        names.append(cls.__name__)
    return names


def has_normalization_name(layer):
    """The first class name of `layer` that reads as a normalization, or
    None (the name test of the rule, without the structure test)."""
    for name in class_names(layer):
        if NORMALIZATION_NAME.fullmatch(name):
            return name
    return None


def owns_kernel(layer):
    """Whether `layer` itself owns a variable with 2+ dimensions above 1."""
    for v in _ki.own_variables(layer):
        if sum(1 for d in v.shape if d is not None and d > 1) >= 2:
            return True
    return False


def heavy_part(layer):
    """A compute-heavy sublayer of `layer` (any depth), or None."""
    for sub in _ki.sublayers(layer):
        if isinstance(sub, KERAS_NORMALIZATION_CLASSES):
            continue
        if isinstance(sub, COMPUTE_HEAVY_CLASSES) or owns_kernel(sub):
            return sub
    return None


def in_construction(layer):
    """Whether `layer.__init__` (or a base class's) is running now."""
    frame = inspect.currentframe()
    try:
        frame = frame.f_back
        while frame is not None:
            if (frame.f_code.co_name == "__init__"
                    and frame.f_code.co_varnames[:1] == ("self",)
                    and frame.f_locals.get("self") is layer):
                return True
            frame = frame.f_back
        return False
    finally:
        del frame


def is_keras_normalization(layer):
    """Whether `layer` is one of Keras's own normalization layers."""
    return isinstance(layer, KERAS_NORMALIZATION_CLASSES)


def normalization_by_name(layer):
    """The class name by which `layer` is a normalization, None, or
    `UNDECIDED` while it is being constructed (see the module docstring)."""
    name = has_normalization_name(layer)
    if name is None or isinstance(layer, keras.Model):
        return None
    if in_construction(layer):
        return UNDECIDED
    if heavy_part(layer) is not None:
        return None
    if layer.built and owns_kernel(layer):
        return None
    return name


def known_float16_hazard(layer):
    """The class name of `layer` in `KNOWN_FLOAT16_HAZARDS`, None, or
    `UNDECIDED` while it is being constructed (so that the sublayers it
    creates keep the governing policy)."""
    for name in class_names(layer):
        if name in KNOWN_FLOAT16_HAZARDS:
            return UNDECIDED if in_construction(layer) else name
    return None


def match_normalization(layer):
    """Returns the rule by which `layer` is a normalization, or None.

    Args:
        layer: A `keras.layers.Layer`.

    Returns:
        `"Keras class (<class>)"` for Keras's own normalization layers,
        `"normalization by name (<class>)"` for a layer the structural name
        rule catches, else None (also while the layer is being constructed).

    Example:

    >>> match_normalization(keras.layers.LayerNormalization())
    'Keras class (LayerNormalization)'
    """
    if is_keras_normalization(layer):
        return f"Keras class ({type(layer).__name__})"
    name = normalization_by_name(layer)
    if name is None or name is UNDECIDED:
        return None
    return f"normalization by name ({name})"


class BuiltinRule:
    """A built-in float32 rule that `kerasmp.Policy` can hold in its
    `float32_layers` next to classes, name patterns and predicates.

    Args:
        key: The name the rule is saved under.
        kind: What `dtype_report` calls it ("normalization by name").
        match: A function from a layer to a detail string, None or
            `UNDECIDED`.
        float16_only: Whether the rule applies only when the policy computes
            in float16.
    """

    def __init__(self, key, kind, match, float16_only=False):
        self.key = key
        self.kind = kind
        self.match = match
        self.float16_only = float16_only

    def __repr__(self):
        return f"<kerasmp rule {self.key}>"


NORMALIZATION_BY_NAME = BuiltinRule(
    "normalization_by_name", "normalization by name", normalization_by_name)
"""The structural name rule (see the module docstring)."""

FLOAT16_HAZARDS = BuiltinRule(
    "known_float16_hazards", "known float16 hazard", known_float16_hazard,
    float16_only=True)
"""Classes of `KNOWN_FLOAT16_HAZARDS`, in float32 under float16 policies."""

BUILTIN_RULES = {r.key: r for r in (NORMALIZATION_BY_NAME, FLOAT16_HAZARDS)}


class Exclude:
    """A `float32_layers` entry that keeps matching layers OUT of float32.

    `kerasmp.Policy(..., float32_exclude=[...])` stores its entries this
    way, first in `Policy.float32_layers`, so a policy rebuilt from that
    tuple (as export does) excludes the same layers.

    Args:
        rule: A parsed rule: a layer class, a compiled regex or a predicate.
    """

    def __init__(self, rule):
        self.rule = rule

    def __eq__(self, other):
        return isinstance(other, Exclude) and other.rule == self.rule

    def __hash__(self):
        return hash(("exclude", self.rule))

    def __repr__(self):
        return f"<kerasmp exclude {self.rule!r}>"
