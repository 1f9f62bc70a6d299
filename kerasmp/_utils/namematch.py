"""Linear-time full matching of the name patterns in `float32_layers`.

Python's `re` engine backtracks, so a pattern such as `(a|aa)+` takes time
exponential in the length of the name it is matched against. Policies are
loaded from files that strangers write, so kerasmp matches layer names with
a Thompson NFA instead: the pattern is parsed by Python's own regex parser
and simulated state set by state set, which costs O(len(name) x
len(pattern)) whatever the pattern.

Supported: literals, `.`, character classes (ranges, negation, `\\d \\w \\s`
and their negations), groups, `|`, the quantifiers `* + ? {m,n}` (greedy,
lazy or possessive: for a yes/no full match they are the same), and `^`,
`$`, `\\A`, `\\Z`. Back-references, look-arounds, conditionals, word
boundaries and inline flags are refused with a `ValueError`.
"""

import re

try:  # Python 3.11+
    from re import _constants as _c
    from re import _parser
except ImportError:  # Python 3.10
    import sre_constants as _c
    import sre_parse as _parser

_MAX_STATES = 5000
_REPEATS = {_c.MAX_REPEAT, _c.MIN_REPEAT}
if hasattr(_c, "POSSESSIVE_REPEAT"):
    _REPEATS.add(_c.POSSESSIVE_REPEAT)
_BEGIN = {_c.AT_BEGINNING, _c.AT_BEGINNING_STRING}
_END = {_c.AT_END, _c.AT_END_STRING}
_CATEGORIES = {
    _c.CATEGORY_DIGIT: str.isdecimal,
    _c.CATEGORY_NOT_DIGIT: lambda ch: not ch.isdecimal(),
    _c.CATEGORY_WORD: lambda ch: ch.isalnum() or ch == "_",
    _c.CATEGORY_NOT_WORD: lambda ch: not (ch.isalnum() or ch == "_"),
    _c.CATEGORY_SPACE: str.isspace,
    _c.CATEGORY_NOT_SPACE: lambda ch: not ch.isspace(),
}


class _Unsupported(ValueError):
    pass


def _class_predicate(items):
    negate = False
    tests = []
    for op, av in items:
        if op is _c.NEGATE:
            negate = True
        elif op is _c.LITERAL:
            tests.append(lambda o, av=av: o == av)
        elif op is _c.RANGE:
            tests.append(lambda o, lo=av[0], hi=av[1]: lo <= o <= hi)
        elif op is _c.CATEGORY and av in _CATEGORIES:
            tests.append(lambda o, f=_CATEGORIES[av]: f(chr(o)))
        else:
            raise _Unsupported(f"character class item {op}")

    def predicate(o):
        return any(t(o) for t in tests) != negate

    return predicate


class NameMatcher:
    """A pattern compiled for linear-time `fullmatch` against names.

    Args:
        pattern: A regular expression (str) in the supported subset.

    Raises:
        ValueError: `pattern` is not a valid regular expression, uses a
            construct outside the supported subset, or is too large.

    Example:

    >>> NameMatcher("head_.*").fullmatch("head_dense")
    True
    """

    def __init__(self, pattern):
        self.pattern = pattern
        try:
            tree = _parser.parse(pattern)
        except re.error as e:
            raise ValueError(str(e)) from None
        if tree.state.flags & ~(re.UNICODE | re.ASCII):
            raise ValueError("inline flags such as (?i) are not supported")
        # Each state: ("pred", test, next) | ("split", [next, ...]) |
        # ("begin" | "end", next) | ("match",).
        self._states = [("match",)]
        try:
            self._start = self._build(list(tree), 0)
        except _Unsupported as e:
            raise ValueError(f"unsupported construct ({e})") from None

    def _new(self, state):
        if len(self._states) >= _MAX_STATES:
            raise _Unsupported("pattern too large")
        self._states.append(state)
        return len(self._states) - 1

    def _build(self, items, nxt):
        for op, av in reversed(items):
            nxt = self._build_item(op, av, nxt)
        return nxt

    def _build_item(self, op, av, nxt):
        if op is _c.LITERAL:
            return self._new(("pred", lambda o, c=av: o == c, nxt))
        if op is _c.NOT_LITERAL:
            return self._new(("pred", lambda o, c=av: o != c, nxt))
        if op is _c.ANY:
            return self._new(("pred", lambda o: o != 10, nxt))
        if op is _c.IN:
            return self._new(("pred", _class_predicate(av), nxt))
        if op is _c.BRANCH:
            outs = [self._build(list(alt), nxt) for alt in av[1]]
            return self._new(("split", outs))
        if op is _c.SUBPATTERN:
            _, add_flags, del_flags, sub = av
            if add_flags or del_flags:
                raise _Unsupported("inline flags")
            return self._build(list(sub), nxt)
        if op in _REPEATS:
            low, high, sub = av
            sub = list(sub)
            if high is _c.MAXREPEAT:
                loop = self._new(("split", []))
                body = self._build(sub, loop)
                self._states[loop] = ("split", [body, nxt])
                cur = loop
            else:
                cur = nxt
                for _ in range(high - low):
                    cur = self._new(("split", [self._build(sub, cur), nxt]))
            for _ in range(low):
                cur = self._build(sub, cur)
            return cur
        if op is _c.AT and av in _BEGIN:
            return self._new(("begin", nxt))
        if op is _c.AT and av in _END:
            return self._new(("end", nxt))
        raise _Unsupported(str(op).lower())

    def _closure(self, starts, pos, n):
        seen = set()
        stack = list(starts)
        while stack:
            i = stack.pop()
            if i in seen:
                continue
            seen.add(i)
            state = self._states[i]
            kind = state[0]
            if kind == "split":
                stack.extend(state[1])
            elif kind == "begin":
                if pos == 0:
                    stack.append(state[1])
            elif kind == "end":
                if pos == n:
                    stack.append(state[1])
        return seen

    def fullmatch(self, name):
        """Whether the pattern matches all of `name` (like `re.fullmatch`)."""
        n = len(name)
        current = self._closure([self._start], 0, n)
        for pos, ch in enumerate(name):
            o = ord(ch)
            nxt = [
                s[2]
                for s in (self._states[i] for i in current)
                if s[0] == "pred" and s[1](o)
            ]
            if not nxt:
                return False
            current = self._closure(nxt, pos + 1, n)
        return 0 in current
