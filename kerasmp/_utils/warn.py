"""Where warnings point.

- `warn(message)`, and `user_stacklevel()` for a `warnings.warn` of one's
  own: kerasmp's warnings, located at the user's code, never at a kerasmp
  or Keras source line.
- `at_caller(function)`: for each kerasmp function that stands between
  Keras and its caller (a patch of a Keras method, a method of a kerasmp
  subclass that calls Keras's). A warning that Keras raises inside it,
  with a `stacklevel` that would locate it in the kerasmp function, is
  located where stock Keras locates it: at the first frame outside kerasmp
  that called the function. The one mechanism for Keras's warnings.
- `once_each()`: the `kerasmp` command shows each warning once.
"""

import contextlib
import functools
import inspect
import os
import sys
import warnings

# Top-level modules whose frames stand between the user and kerasmp.
_INTERNAL = ("kerasmp", "keras", "contextlib", "tensorflow", "jax", "torch",
             "optree")
# The folder of the kerasmp package, with a trailing separator.
_PACKAGE = os.path.dirname(os.path.dirname(os.path.abspath(__file__))) + (
    os.sep)


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


def in_kerasmp(filename):
    """Whether the source file `filename` lies inside the kerasmp package."""
    return os.path.abspath(filename).startswith(_PACKAGE)


def at_caller(function):
    """Decorates a kerasmp function that calls Keras so that the warnings
    raised while it runs never point into kerasmp.

    Python locates a warning `stacklevel` frames above the `warnings.warn`
    call: Keras's `stacklevel=2` (`compile() was not called as part of
    model loading`, `Skipping variable loading for optimizer`) names the
    caller of the Keras method, which is kerasmp's function when kerasmp
    stands in between. While `function` runs, every warning is recorded
    instead of filtered (one filter, "always", and `warnings.showwarning`
    keeping it); once it returns (or raises) each is issued again through
    `warnings.warn_explicit` with the module and registry of the file it
    names, so the filters (`-W`, `filterwarnings`, `pytest.warns`) and the
    once-per-line registries act as without kerasmp. One located inside
    kerasmp is located at the first frame outside kerasmp that called
    `function` instead: where stock Keras, without kerasmp in between,
    shows it.

    Unlike `warnings.catch_warnings`, this does not tell the registries
    that the filters changed (which would make Python show again the
    warnings it shows once per line). Like it, it swaps the `warnings`
    module's state, which threads share: not for code that runs per step
    or per layer call, where it would also cost time.
    """

    @functools.wraps(function)
    def located(*args, **kwargs):
        caller = inspect.currentframe().f_back
        caught = []
        filters, show = warnings.filters, warnings.showwarning

        def record(message, category, filename, lineno, file=None,
                   line=None):
            caught.append((message, category, filename, lineno))

        warnings.filters = [("always", None, Warning, None, 0)]
        warnings.showwarning = record
        try:
            result = function(*args, **kwargs)
        except BaseException:
            warnings.filters, warnings.showwarning = filters, show
            with contextlib.suppress(Exception):  # the error comes first
                _issue(caught, caller)
            raise
        warnings.filters, warnings.showwarning = filters, show
        _issue(caught, caller)
        return result

    return located


def _issue(caught, caller):
    """Issues the recorded warnings `caught` again, those located inside
    kerasmp at the first frame from `caller` up that is outside it."""
    target = caller
    while target is not None and in_kerasmp(target.f_code.co_filename):
        target = target.f_back
    for message, category, filename, lineno in caught:
        if in_kerasmp(filename) and target is not None:
            filename, lineno = target.f_code.co_filename, target.f_lineno
            module = target.f_globals
        else:
            module = _module_globals(filename)
        if module is None:  # no module holds the file (`<string>`)
            warnings.warn_explicit(message, category, filename, lineno,
                                   registry=_registries.setdefault(
                                       filename, {}))
            continue
        warnings.warn_explicit(
            message, category, filename, lineno,
            module=module.get("__name__"),
            registry=module.setdefault("__warningregistry__", {}),
            module_globals=module)


_modules = {}  # source file -> module globals, filled as warnings name them
_registries = {}  # the once-per-line registries of files of no module


def _module_globals(filename):
    """The globals of the imported module whose source is `filename`."""
    found = _modules.get(filename)
    if found is not None:
        return found
    for module in list(sys.modules.values()):
        path = getattr(module, "__file__", None)
        if path:
            _modules.setdefault(path, vars(module))
    return _modules.get(filename)


@contextlib.contextmanager
def once_each():
    """Shows each warning (its category and text) once while the block
    runs, wherever it is raised from: the `kerasmp` command's loads and
    rebuilds raise Keras's warnings again, and `catch_warnings` blocks in
    between reset Python's once-per-line registries."""
    shown = set()
    original = warnings.showwarning

    def show(message, category, filename, lineno, file=None, line=None):
        key = (category, str(message))
        if key not in shown:
            shown.add(key)
            original(message, category, filename, lineno, file, line)

    warnings.showwarning = show
    try:
        yield
    finally:
        if warnings.showwarning is show:
            warnings.showwarning = original
