"""The search of `kerasmp.tune`, pure: which units must compute in float32.

It knows nothing of Keras. A unit is any hashable; `measure(units)` is the
error of the model with those units in float32 and every other one in half
precision. `search` finds a small set that meets a target:

1. the error with nothing in float32 (done if it meets the target) and
   with every unit in float32 (if that misses, no set meets it);
2. each unit's contribution: the error with only that unit in float32
   (n passes);
3. greedy on that ranking, by bisection: the shortest prefix of the
   ranking that meets the target (log2 n passes, as Polygraphy's `debug
   precision` bisects layers);
4. pruning: each unit of the prefix, least useful first, is dropped when
   the rest still meets the target (at most n passes).

So one search spends at most 2n + log2(n) + 2 passes. `search_tree` runs it
down a layer tree (a block, or its sublayers): first over the top-level
subtrees, then inside each subtree it keeps, over the block's own code and
its sublayers' subtrees; a block whose parts are all needed is kept whole.
Every unit is searched once, so the passes stay within a small multiple of
the number of layers (the test bounds them by 4 n log2 n).
"""

import dataclasses
import math


@dataclasses.dataclass(frozen=True)
class SearchResult:
    """What one `search` found.

    Attributes:
        kept: The units kept in float32, most useful first; None when even
            every unit in float32 misses the target.
        error: The error with `kept` in float32 (with all units when
            `kept` is None).
        contributions: `{unit: error with only that unit in float32}`
            (empty when no ranking was needed).
        passes: The measurements this search spent.
    """

    kept: tuple
    error: float
    contributions: dict
    passes: int


class Counted:
    """`measure`, counted and remembered: a set measured twice costs one
    pass.

    Args:
        measure: `(frozenset) -> float`.
    """

    def __init__(self, measure):
        self.measure = measure
        self.cache = {}
        self.passes = 0

    def __call__(self, units):
        key = frozenset(units)
        if key not in self.cache:
            self.passes += 1
            self.cache[key] = float(self.measure(key))
        return self.cache[key]


def search(units, measure, target):
    """The fewest units (by the method of the module docstring) whose
    float32 meets `target`.

    Args:
        units: A sequence of hashable units.
        measure: `(frozenset of units) -> error`, lower is better.
        target: The error to reach (`error <= target`).

    Returns:
        A `SearchResult`.

    Example:

    >>> search("abcd", lambda s: 0.0 if "c" in s else 1.0, 0.5).kept
    ('c',)
    """
    units = tuple(dict.fromkeys(units))
    counted = measure if isinstance(measure, Counted) else Counted(measure)
    start = counted.passes

    def result(kept, error, contributions=None):
        return SearchResult(kept, error, dict(contributions or {}),
                            counted.passes - start)

    none = counted(())
    if none <= target or not units:
        return result((), none)
    everything = counted(units)
    if everything > target:
        return result(None, everything)
    alone = {u: counted((u,)) for u in units}
    ranked = sorted(units, key=lambda u: alone[u])  # stable: ties in order
    low, high = 0, len(ranked)  # prefix[low] misses, prefix[high] meets
    while high - low > 1:
        mid = (low + high) // 2
        if counted(ranked[:mid]) <= target:
            high = mid
        else:
            low = mid
    kept = list(ranked[:high])
    for unit in reversed(ranked[:high]):
        if len(kept) == 1:
            break
        rest = [u for u in kept if u != unit]
        if counted(rest) <= target:
            kept = rest
    return result(tuple(kept), counted(kept), alone)


@dataclasses.dataclass(frozen=True)
class TreeResult:
    """What `search_tree` found.

    Attributes:
        kept: The kept paths, each `(path, whole)`: `whole` is True for a
            layer kept with all its sublayers, False for its own code only
            (its sublayers stay in half precision unless kept themselves).
            None when no set meets the target.
        error: The error with `kept` in float32 (with every layer when
            `kept` is None).
        none: The error with no layer in float32.
        contributions: `{path: error with only that subtree in float32}`
            for the subtrees the search ranked.
        passes: The measurements spent.
    """

    kept: tuple
    error: float
    none: float
    contributions: dict
    passes: int


def subtree(tree, path):
    """`path` and every path below it in `tree` (`{path: children}`)."""
    out, stack = [], [path]
    while stack:
        p = stack.pop()
        out.append(p)
        stack.extend(reversed(tree.get(p, ())))
    return out


def expand(tree, units):
    """The layer paths that compute in float32 for `units`, each
    `(path, whole)`."""
    paths = set()
    for path, whole in units:
        paths.update(subtree(tree, path) if whole else (path,))
    return frozenset(paths)


def search_tree(tree, measure, target, roots=None):
    """`search` down a layer tree: the fewest layers, or blocks, whose
    float32 meets `target`.

    Args:
        tree: `{path: tuple of child paths}`; the roots are `tree[""]`
            unless `roots` is given.
        measure: `(frozenset of paths in float32) -> error`.
        target: The error to reach.
        roots: The top-level paths (default `tree[""]`).

    Returns:
        A `TreeResult`.

    Example:

    >>> tree = {"": ("a", "b"), "b": ("b/x", "b/y")}
    >>> search_tree(tree, lambda s: 0.0 if "b/y" in s else 1.0, 0.5).kept
    (('b/y', True),)
    """
    counted = Counted(measure)
    roots = tuple(tree.get("", ()) if roots is None else roots)
    contributions = {}

    def run(units, fixed):
        found = search(units, lambda s: counted(expand(tree, s) | fixed),
                       target)
        for (path, whole), error in found.contributions.items():
            if whole:
                contributions[path] = error
        return found

    top = run([(r, True) for r in roots], frozenset())
    none = counted(frozenset())
    if top.kept is None:
        return TreeResult(None, top.error, none, contributions,
                          counted.passes)
    kept = list(top.kept)
    done = []
    while kept:
        unit = kept.pop(0)
        path, whole = unit
        children = tuple(tree.get(path, ()))
        if not whole or not children:
            done.append(unit)
            continue
        fixed = expand(tree, done + kept)
        parts = [(path, False)] + [(c, True) for c in children]
        found = run(parts, fixed)
        if found.kept is None or len(found.kept) == len(parts):
            # Every part is needed: refine the sublayers' subtrees, and the
            # block's own code stays with them.
            kept = [(c, True) for c in children] + kept
            done.append((path, False))
            continue
        kept = list(found.kept) + kept
    final = _collapse(tree, done)
    return TreeResult(tuple(sorted(final)), counted(expand(tree, final)),
                      none, contributions, counted.passes)


def _collapse(tree, units):
    """`units` with each layer whose own code and whole subtree are kept
    written as one `(path, True)`."""
    paths = expand(tree, units)
    out = []
    for path in sorted(paths, key=lambda p: (p.count("/"), p)):
        if any(p == path or path.startswith(p + "/") for p, w in out if w):
            continue
        whole = all(p in paths for p in subtree(tree, path))
        if whole or (path, False) in units:
            out.append((path, whole))
    return out


def pass_bound(n):
    """The most passes `search_tree` may spend on `n` layers (with room):
    4 n log2 n, at least 8."""
    return max(8, int(4 * n * math.log2(max(n, 2))))
