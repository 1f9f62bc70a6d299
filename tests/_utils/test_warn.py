"""`kerasmp._utils.warn`: `at_caller` issues the warnings of the call it
wraps again as Python would have (the filters, the once-per-line
registries), and `once_each` shows each warning once."""

import warnings

from kerasmp._utils.warn import at_caller
from kerasmp._utils.warn import once_each


def _warns(text="said once per line"):
    warnings.warn(text, UserWarning)  # this file's line: not relocated


def test_a_warning_outside_kerasmp_keeps_its_line_and_registry():
    located = at_caller(_warns)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("default")  # Python's own: once per line
        located()
        located()
        _warns()
    assert len(caught) == 1 and caught[0].filename == __file__
    assert caught[0].lineno == _warns.__code__.co_firstlineno + 1


def test_the_filters_apply_after_the_call_and_errors_come_first():
    located = at_caller(_warns)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        warnings.filterwarnings("ignore", message="hidden")
        located("hidden")
        located("shown")
        try:
            at_caller(lambda: (_warns("before"), 1 / 0))()
        except ZeroDivisionError:
            pass
    assert [str(w.message) for w in caught] == ["shown", "before"]


def test_once_each_shows_a_warning_once_wherever_it_is_raised():
    shown = []
    with warnings.catch_warnings():
        warnings.simplefilter("always")
        warnings.showwarning = lambda message, *_: shown.append(str(message))
        with once_each():
            warnings.warn("same")
            warnings.warn("same")  # another line
            warnings.warn("other")
        warnings.warn("same")  # after the block: as before
    assert shown == ["same", "other", "same"]
