"""Silencing what C and C++ libraries write to the process's stderr (file
descriptor 2, past `sys.stderr`): TensorFlow's start-up lines, converters'
logs. Used by the `kerasmp` command's imports and by export's converters."""

import contextlib
import os
import sys


@contextlib.contextmanager
def fd2_silenced(active=True):
    """Sends file descriptor 2 to /dev/null while the block runs: C and C++
    libraries write there directly, past `sys.stderr`."""
    if not active:
        yield
        return
    try:
        sys.stderr.flush()
        saved = os.dup(2)
    except (OSError, ValueError, AttributeError):
        yield
        return
    devnull = os.open(os.devnull, os.O_WRONLY)
    try:
        os.dup2(devnull, 2)
        yield
    finally:
        try:
            sys.stderr.flush()
        except (OSError, ValueError):
            pass
        os.dup2(saved, 2)
        os.close(saved)
        os.close(devnull)
