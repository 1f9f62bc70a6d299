"""`kerasmp._utils.table.render_table` against hand-written tables."""

import pytest

from kerasmp._utils.table import render_table


def test_left_aligned_with_column_rules():
    text = render_table(("layer", "dtype"), [("dense", "float16"),
                                             ("bn", "float32")],
                        rule="columns")
    assert text == ("layer  dtype\n"
                    "-----  -------\n"
                    "dense  float16\n"
                    "bn     float32")


def test_right_aligned_columns_full_rule_and_last_column_padding():
    text = render_table(("name", "n", "x"), [("a", "1", "ok"),
                                             ("bbb", "22", "NO!!")],
                        align="<>>", rule="full")
    assert text.split("\n") == ["name   n     x",
                                "--------------",
                                "a      1    ok",
                                "bbb   22  NO!!"]
    # A left-aligned last column is not padded (nothing follows it).
    assert render_table(None, [("a", "x"), ("bb", "yyy")]) == "a   x\nbb  yyy"


def test_marks_follow_the_last_column_and_strip():
    text = render_table(("#", "v"), [("0", "1"), ("1", "inf"), ("2", "")],
                        marks={1: "<- here"}, strip=True)
    assert text.split("\n") == ["#  v", "0  1", "1  inf  <- here", "2"]
    text = render_table(("#", "v"), [("0", "1"), ("1", "inf")],
                        marks={0: "<- here"})
    # Without strip, the marked table is padded to its full width.
    assert text.split("\n") == ["#  v  ", "0  1    <- here", "1  inf"]


def test_indent_and_empty_cells():
    text = render_table(None, [("path", "x.keras"), ("inputs", "")],
                        indent="  ")
    assert text == "  path    x.keras\n  inputs  "
    assert render_table(("a", "b"), [], rule="columns") == "a  b\n-  -"
    assert render_table(None, []) == ""


def test_bad_arguments():
    with pytest.raises(ValueError, match="align"):
        render_table(("a", "b"), [], align="<<<")
    with pytest.raises(ValueError, match="rule"):
        render_table(("a", "b"), [], rule="dots")
