"""`render_table`: the fixed-width text tables kerasmp's reports print.

One renderer for every report that prints a table (`DTypeReport`,
`NonFiniteReport`, `GradientReport`, `ExportReport`, the `kerasmp bench`
and `kerasmp demo` tables), so that they align, rule and mark rows the
same way, and `log2_text`, how they name a loss scale. Standard library
only.
"""

import math


def log2_text(value):
    """`value`'s base-2 exponent as a label: `"15"` for 32768, `"14.58"`
    for 24576 (how kerasmp names a loss scale: 2^15)."""
    k = math.log2(value)
    return f"{k:g}" if k == int(k) else f"{k:.2f}"


def render_table(headers, rows, *, align="<", rule=None, marks=None,
                 indent="", gap="  ", strip=False):
    """Renders rows of cells as a fixed-width text table.

    Each column is as wide as its widest cell (header included) and
    columns are separated by `gap`. Every cell is padded to its column's
    width, except a left-aligned last column (nothing after it to align)
    when no row is marked.

    Args:
        headers: The column titles (the first line), or None for a table
            without a header (then `rule` is ignored).
        rows: Rows of cells; each cell is converted with `str`.
        align: `"<"` (left) or `">"` (right) for every column, or a string
            of one of them per column, e.g. `"<<>>"`.
        rule: What separates the header from the rows: None (nothing),
            `"columns"` (a run of dashes under each column, separated by
            `gap`) or `"full"` (one run of dashes the width of the table).
        marks: `{row index: text}`: text written after a row (indices into
            `rows`), aligned after the last column, e.g.
            `{3: "<- first non-finite output"}`.
        indent: Text put before every line.
        gap: Text between columns. Defaults to two spaces.
        strip: Remove trailing whitespace from every line.

    Returns:
        The table as a string, lines joined with `"\\n"` (no final newline).

    Example:

    >>> print(render_table(("layer", "dtype"), [("dense", "float16")],
    ...                    rule="columns"))
    layer  dtype
    -----  -------
    dense  float16
    """
    table = [tuple(str(c) for c in row) for row in rows]
    if headers is not None:
        table.insert(0, tuple(str(c) for c in headers))
    if not table:
        return ""
    columns = max(len(row) for row in table)
    if len(align) == 1:
        align = align * columns
    if len(align) != columns:
        raise ValueError(f"`align` {align!r} must have one character per "
                         f"column ({columns}).")
    widths = [max((len(row[i]) for row in table if i < len(row)), default=0)
              for i in range(columns)]
    marks = marks or {}
    pad_last = bool(marks) or align[-1] == ">"
    first_row = 0 if headers is None else 1

    def line(row):
        cells = []
        for i, width in enumerate(widths):
            cell = row[i] if i < len(row) else ""
            if align[i] == ">":
                cell = cell.rjust(width)
            elif i < columns - 1 or pad_last:
                cell = cell.ljust(width)
            cells.append(cell)
        return gap.join(cells)

    lines = []
    for i, row in enumerate(table):
        text = line(row)
        mark = marks.get(i - first_row) if i >= first_row else None
        if mark:
            text += gap + mark
        lines.append(text)
    if headers is not None and rule == "columns":
        lines.insert(1, gap.join("-" * w for w in widths))
    elif headers is not None and rule == "full":
        lines.insert(1, "-" * (sum(widths) + len(gap) * (columns - 1)))
    elif rule not in (None, "columns", "full"):
        raise ValueError(f"Invalid `rule`: {rule!r}. Allowed values: None, "
                         "'columns', 'full'.")
    if strip:
        lines = [text.rstrip() for text in lines]
    return "\n".join(indent + text for text in lines)
