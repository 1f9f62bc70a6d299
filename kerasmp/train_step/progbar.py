"""`skipped_steps` shown as a count in Keras's progress bar.

Keras converts every log value to a Python float before any callback sees
it (`CallbackList` runs `pythonify_logs`), and `keras.utils.Progbar`, which
`ProgbarLogger` (`fit(verbose=1 or 2)`) prints with, formats every value as
`{:.4f}`, or `{:.4e}` at 1e-3 or below: the count of skipped steps that
kerasmp's train step logs read `0.0000e+00`, then `3.0000`. No value that
reaches the progress bar through the logs can change that, so this module
wraps `keras.utils.Progbar.update` (a public method) and hands it
`skipped_steps` as a `Count`: a float that prints as an integer
(`skipped_steps: 0`). Only the progress bar's copy changes: the logs, and
so `History`, `CSVLogger` and TensorBoard, keep Keras's float.

A display patch, installed and removed with kerasmp's other patches
(`kerasmp._patches.install` / `uninstall`): after `kerasmp.uninstall()` the
progress bar prints as stock Keras's does.
"""

import functools

import keras

from kerasmp.train_step.logs import SKIPPED_KEY

COUNT_KEYS = (SKIPPED_KEY,)
"""The log keys that hold counts."""

_original = {}


class Count(float):
    """A whole number that Keras's `Progbar` prints without decimals.

    `Progbar` divides a value by its count of updates (1 for a stateful
    value, which every value of `fit`'s progress bar is) and formats the
    result with `.4f` or `.4e`: the division by 1 keeps a `Count`, and any
    precision or type in the format is dropped (`format(Count(3), ".4f")`
    is `"3"`; a width is kept).
    """

    def __truediv__(self, other):
        result = float(self) / other
        return Count(result) if result.is_integer() else result

    def __format__(self, spec):
        return format(int(self), spec.split(".", 1)[0])


def counted(values):
    """`values` (`Progbar.update`'s `(name, value)` pairs) with each whole
    value of `COUNT_KEYS` as a `Count`."""
    return [
        (k, Count(v)) if k in COUNT_KEYS and _is_whole(v) else (k, v)
        for k, v in values
    ]


def _is_whole(value):
    return (isinstance(value, (int, float)) and not isinstance(value, bool)
            and float(value).is_integer())


def _update(self, current, values=None, finalize=None):
    if values:
        values = counted(values)
    return _original["update"](self, current, values, finalize)


def install():
    """Wraps `keras.utils.Progbar.update` (idempotent)."""
    if _original:
        return
    _original["update"] = keras.utils.Progbar.update
    keras.utils.Progbar.update = functools.wraps(_original["update"])(_update)


def uninstall():
    """Puts Keras's `Progbar.update` back."""
    if _original:
        keras.utils.Progbar.update = _original.pop("update")

