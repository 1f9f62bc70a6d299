"""The float8 policy names and `Float8Rule`: which layers a float8
`kerasmp.Policy` trains in Keras's float8 mode.

`kerasmp.Policy("float8_mixed_bfloat16")` (or `"float8_mixed_float16"`)
computes like `"mixed_bfloat16"` (`"mixed_float16"`, with kerasmp's loss
scaling) and keeps kerasmp's float32 rules; in addition the large
`Dense` / `EinsumDense` matmuls train in Keras's own float8 mode (the stock
`QuantizedFloat8DTypePolicy` machinery). The rule, applied to every layer
the float8 policy governs, is documented on `Float8Rule` and in
docs/float8.md; `kerasmp.float8.layers` applies it.
"""

import re

import keras

from kerasmp._utils.namematch import NameMatcher

FLOAT8_NAMES = {
    "float8_mixed_bfloat16": "mixed_bfloat16",
    "float8_mixed_float16": "mixed_float16",
}
"""The kerasmp policy names that train in float8, and the policy every other
layer computes with."""


def is_float8_name(name):
    """Whether `name` is one of `FLOAT8_NAMES`."""
    return isinstance(name, str) and name in FLOAT8_NAMES


def base_name(name):
    """The non-float8 policy name behind `name` (`name` itself if plain)."""
    return FLOAT8_NAMES.get(name, name)


def _patterns(value, argname):
    if isinstance(value, (str, re.Pattern)):
        value = (value,)
    try:
        items = tuple(value)
    except TypeError:
        raise TypeError(
            f"`{argname}` must be a sequence of regular expressions (str) "
            f"matched against layer names or paths. Received: {value!r}"
        ) from None
    out = []
    for item in items:
        pattern = item.pattern if isinstance(item, re.Pattern) else item
        if not isinstance(pattern, str):
            raise TypeError(
                f"Invalid `{argname}` entry: expected a regular expression "
                f"(str). Received: {item!r} (of type {type(item).__name__})"
            )
        try:
            NameMatcher(pattern)
        except (ValueError, re.error) as e:
            raise ValueError(
                f"Invalid `{argname}` entry: {pattern!r} is not a supported "
                f"regular expression ({e})."
            ) from None
        out.append(pattern)
    return tuple(out)


@keras.saving.register_keras_serializable(package="kerasmp")
class Float8Rule:
    """Which layers a float8 `kerasmp.Policy` trains in float8.

    Args:
        min_kernel_size: Smallest kernel (number of elements) trained in
            float8. Default 4096 (a 64x64 kernel). Smaller matmuls gain
            nothing from float8 and lose precision.
        exclude_first: Keep the model's first Dense/EinsumDense out of
            float8. Default True.
        exclude_last: Keep the model's last Dense/EinsumDense (usually the
            classifier or LM head) out of float8. Default True.
        include: Regular expressions; a Dense/EinsumDense whose name or path
            (as `dtype_report` prints it) matches one is float8 whatever its
            size or place.
        exclude: Regular expressions; a layer whose name or path matches one
            is never float8 (wins over `include`).
        amax_history_length: Length of each layer's amax history (Keras's
            delayed scaling window). Default 1024, as Keras.

    Example:

    >>> rule = kerasmp.float8.Float8Rule(min_kernel_size=256, exclude=["head"])
    >>> policy = kerasmp.Policy("float8_mixed_bfloat16", float8=rule)
    """

    def __init__(self, min_kernel_size=4096, exclude_first=True,
                 exclude_last=True, include=(), exclude=(),
                 amax_history_length=1024):
        if (not isinstance(min_kernel_size, int)
                or isinstance(min_kernel_size, bool) or min_kernel_size < 0):
            raise ValueError(
                "`min_kernel_size` must be an integer >= 0 (kernel elements). "
                f"Received: {min_kernel_size!r}"
            )
        for argname, value in (("exclude_first", exclude_first),
                               ("exclude_last", exclude_last)):
            if not isinstance(value, bool):
                raise TypeError(
                    f"`{argname}` must be True or False. Received: {value!r}"
                )
        if (not isinstance(amax_history_length, int)
                or isinstance(amax_history_length, bool)
                or amax_history_length < 1):
            raise ValueError(
                "`amax_history_length` must be an integer >= 1. Received: "
                f"{amax_history_length!r}"
            )
        self.min_kernel_size = min_kernel_size
        self.exclude_first = exclude_first
        self.exclude_last = exclude_last
        self.include = _patterns(include, "include")
        self.exclude = _patterns(exclude, "exclude")
        self.amax_history_length = amax_history_length
        self._include = [NameMatcher(p) for p in self.include]
        self._exclude = [NameMatcher(p) for p in self.exclude]

    def get_config(self):
        return {
            "min_kernel_size": self.min_kernel_size,
            "exclude_first": self.exclude_first,
            "exclude_last": self.exclude_last,
            "include": list(self.include),
            "exclude": list(self.exclude),
            "amax_history_length": self.amax_history_length,
        }

    @classmethod
    def from_config(cls, config):
        return cls(**config)

    def __eq__(self, other):
        return (isinstance(other, Float8Rule)
                and self.get_config() == other.get_config())

    def __hash__(self):
        return hash((self.min_kernel_size, self.include, self.exclude))

    def __repr__(self):
        return f"Float8Rule({self.get_config()})"

    @staticmethod
    def _matches(matchers, layer, path):
        return any(m.fullmatch(layer.name or "") or m.fullmatch(path)
                   for m in matchers)

    def excluded(self, layer, path):
        return self._matches(self._exclude, layer, path)

    def included(self, layer, path):
        return self._matches(self._include, layer, path)


def rule_for(name, float8):
    """The `Float8Rule` of a policy named `name` given `float8` (None, a
    `Float8Rule` or its config dict); None for a non-float8 name.

    Raises:
        ValueError: `float8` was given for a policy that is not float8.
        TypeError: `float8` is not a `Float8Rule`, a dict or None.
    """
    if not is_float8_name(name):
        if float8 is not None:
            raise ValueError(
                f"`float8` applies only to the policies {sorted(FLOAT8_NAMES)}"
                f". Received: name={name!r}, float8={float8!r}"
            )
        return None
    if float8 is None:
        return Float8Rule()
    if isinstance(float8, dict):
        return Float8Rule.from_config(float8)
    if isinstance(float8, Float8Rule):
        return float8
    raise TypeError(
        "`float8` must be a kerasmp.float8.Float8Rule, its config dict or "
        f"None. Received: {float8!r} (of type {type(float8).__name__})"
    )
