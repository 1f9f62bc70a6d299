"""Warnings located at the user's code, never at a kerasmp or Keras source
line: `warn(message)`, and `user_stacklevel()` for a `warnings.warn` of
one's own."""

import inspect
import warnings

# Top-level modules whose frames stand between the user and kerasmp.
_INTERNAL = ("kerasmp", "keras", "contextlib", "tensorflow", "jax", "torch",
             "optree")


def user_stacklevel():
    """The `stacklevel` that makes `warnings.warn`, called in the function
    that calls this one, point at the first frame outside kerasmp, Keras,
    the frameworks and `contextlib` (the user's `fit`, `compile`,
    `predict` or `export` call)."""
    frame = inspect.currentframe().f_back  # the caller of warnings.warn
    level = 1
    while frame is not None:
        name = frame.f_globals.get("__name__", "")
        if name.split(".")[0] not in _INTERNAL:
            return level
        frame = frame.f_back
        level += 1
    return 1


def warn(message, category=UserWarning):
    """Issues `message` as a warning of `category`, located at the user's
    code (see `user_stacklevel`)."""
    warnings.warn(message, category, stacklevel=user_stacklevel())
