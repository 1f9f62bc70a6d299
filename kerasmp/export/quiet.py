"""Quiet exports (no framework import): what the converters print is
silenced unless `verbose`, and what kerasmp has to say comes once, in one
sentence each, pointing at the user's call.

- `converters(verbose)`: around the calls that convert or run an artifact
  (TensorFlow's and PyTorch's exporters, tf2onnx, the TFLite converter,
  onnxruntime, the LiteRT interpreter), and only when not `verbose`: file
  descriptor 2 goes to /dev/null (their C++ logs: MLIR diagnostics,
  onnxruntime's graph rewriters, XNNPACK's INFO line), the Python loggers
  of the frameworks are raised to ERROR (`INFO:tensorflow:Assets written
  to ...`, absl's "unsaved custom gradients", torch.onnx's registrations)
  and their Python warnings are ignored (numpy FutureWarnings);
  litert-torch's progress lines (`[START]/[DONE] LiteRT-Torch Convert`,
  printed on stdout through `rich`) are turned off through its
  `LITERT_TORCH_SHOW_PROGRESS` setting.
- `say(message)`: a kerasmp warning. Inside `collected()` (what `export`
  opens) it is kept and `collected` warns each message once on exit; else
  it warns now. Either way its `stacklevel` points at the first frame
  outside kerasmp: the user's call, never a kerasmp source line.
"""

import contextlib
import logging
import os
import sys
import warnings

from kerasmp._utils.stderr import fd2_silenced
from kerasmp._utils.warn import user_stacklevel

# litert-torch's switch for its progress lines, read at each conversion.
_LITERT_PROGRESS = "LITERT_TORCH_SHOW_PROGRESS"
# The loggers the converters write to (Python `logging`).
_LOGGERS = ("tensorflow", "absl", "jax", "jax._src", "torch", "torch.onnx",
            "torch.export", "torch._dynamo", "torch.fx", "onnxscript",
            "onnx_ir", "tf2onnx", "litert_torch", "h5py")
_notes = []
_depth = [0]


def say(message, category=UserWarning):
    """Warns `message` (one sentence) at the user's call; kept for the end
    of the export inside `collected()`."""
    if _depth[0]:
        if (message, category) not in _notes:
            _notes.append((message, category))
    else:
        warnings.warn(message, category, stacklevel=user_stacklevel())


@contextlib.contextmanager
def _kept(into):
    """Holds `say`'s messages while the block runs, then moves them to the
    list `into`."""
    _depth[0] += 1
    start = len(_notes)
    try:
        yield
    finally:
        _depth[0] -= 1
        into.extend(_notes[start:])
        del _notes[start:]


@contextlib.contextmanager
def collected():
    """Keeps `say`'s messages until the block ends, then warns each once
    (also when the block raises: what was said still holds)."""
    notes = []
    try:
        with _kept(notes):
            yield
    finally:
        for message, category in notes:
            say(message, category)  # kept by an outer block, or warned


def discarded():
    """Forgets what `say` is told while the block runs (the float32
    baseline's writer repeats what the artifact's writer said)."""
    return _kept([])


@contextlib.contextmanager
def converters(verbose=False):
    """Silences the converters' output while the block runs, unless
    `verbose` (see the module docstring)."""
    if verbose:
        yield
        return
    loggers = [logging.getLogger(name) for name in _LOGGERS]
    levels = [logger.level for logger in loggers]
    absl = sys.modules.get("absl.logging")
    absl_level = absl.get_verbosity() if absl is not None else None
    progress = os.environ.get(_LITERT_PROGRESS)
    try:
        os.environ[_LITERT_PROGRESS] = "0"
        for logger in loggers:
            logger.setLevel(logging.ERROR)
        if absl is not None:
            absl.set_verbosity(absl.ERROR)
        with warnings.catch_warnings(), fd2_silenced():
            warnings.simplefilter("ignore")
            yield
    finally:
        if progress is None:
            os.environ.pop(_LITERT_PROGRESS, None)
        else:
            os.environ[_LITERT_PROGRESS] = progress
        for logger, level in zip(loggers, levels):
            logger.setLevel(level)
        if absl is not None:
            absl.set_verbosity(absl_level)
