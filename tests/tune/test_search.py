"""The pure search of `kerasmp.tune` (`kerasmp.tune.search`), on synthetic
error functions whose answer is planted: it finds the planted layers and
spends at most 4 n log2 n passes."""

import math

import pytest

from kerasmp.tune.search import pass_bound
from kerasmp.tune.search import search
from kerasmp.tune.search import search_tree


def _tree(blocks, width, leaves):
    """`blocks` blocks of `width` sublayers each, then `leaves` layers."""
    tree = {"": tuple(f"b{i}" for i in range(blocks))
            + tuple(f"l{i}" for i in range(leaves))}
    for i in range(blocks):
        tree[f"b{i}"] = tuple(f"b{i}/d{j}" for j in range(width))
    return tree


def _error(planted, others):
    """0.1 per planted layer left in half precision, 5e-3 shared by the
    other layers (`others`), and 1e-3 that no layer removes."""
    noise = 5e-3 / max(len(others), 1)

    def measure(paths):
        missed = sum(p not in paths for p in planted)
        return 1e-3 + 0.1 * missed + noise * sum(
            p not in paths for p in others)
    return measure


def _paths(tree):
    return [p for p in tree if p] + [c for k, cs in tree.items()
                                     for c in cs if c not in tree]


@pytest.mark.torch
@pytest.mark.parametrize("blocks,width,leaves", [(2, 2, 2), (4, 4, 8),
                                                  (8, 8, 32)])
def test_finds_the_planted_layers_within_n_log_n_passes(blocks, width,
                                                       leaves):
    tree = _tree(blocks, width, leaves)
    paths = sorted(set(_paths(tree)))
    planted = {f"b{blocks - 1}/d{width - 1}", f"l{leaves // 2}"}
    others = [p for p in paths if p not in planted]
    found = search_tree(tree, _error(planted, others), target=1e-2)
    assert {p for p, _ in found.kept} == planted
    assert found.error <= 1e-2
    n = len(paths)
    assert found.passes <= pass_bound(n) <= 4 * n * math.log2(n) + 8


@pytest.mark.torch
def test_a_block_whose_every_part_is_needed_is_kept_whole():
    tree = _tree(2, 3, 1)
    planted = set(tree["b1"]) | {"b1"}
    found = search_tree(tree, _error(planted, []), target=1e-2)
    assert found.kept == (("b1", True),)


@pytest.mark.torch
def test_nothing_is_kept_when_half_precision_meets_the_target():
    tree = _tree(2, 2, 2)
    found = search_tree(tree, lambda paths: 1e-3, target=1e-2)
    assert found.kept == () and found.passes == 1


@pytest.mark.torch
def test_an_unreachable_target_is_said_so():
    tree = _tree(2, 2, 2)
    found = search_tree(tree, lambda paths: 0.5 - 0.01 * len(paths),
                        target=1e-2)
    assert found.kept is None and found.error > 1e-2


@pytest.mark.torch
def test_search_ranks_then_prunes():
    # "a" alone meets nothing, "a" and "b" together do; "c" is the most
    # useful alone but not needed once "a" and "b" are kept.
    def measure(s):
        return {frozenset(): 1.0, frozenset("c"): 0.4}.get(
            s, 0.0 if {"a", "b"} <= s else 0.6)
    found = search("abcd", measure, target=0.1)
    assert set(found.kept) == {"a", "b"}
    assert found.passes <= 2 * 4 + 2 + 2
