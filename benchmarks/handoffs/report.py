"""Counts and tables of the hand-off matrix (stub: filled in below)."""


def counts(cells):
    ok = sum(v == "ok" for v in cells.values())
    return {"cells": len(cells), "ok": ok, "refused": len(cells) - ok}


def text_summary(data):
    return str(data["counts"])


def write_tables(data, root, check=False):
    return []
