"""The backend table's hand-written `jit_compile=True` row (README.md and
docs/guide.md; the hand-off generator, benchmarks/handoffs/report.py,
rewrites only the export rows): the `torch.compile` figures it quotes are
one run of docs/benchmarks.md, named by its date, and the newest timed one
there."""

import re

from _helpers import ROOT

ROW = "| `jit_compile=True` |"
RUN = re.compile(r"run of (\d{4}-\d{2}-\d{2} \d{2}:\d{2}-\d{2}:\d{2} UTC)")
RATIO = re.compile(r"(\d+\.\d+)x")


def _jit_row(name):
    (row,) = [line for line in (ROOT / name).read_text().splitlines()
              if line.startswith(ROW)]
    return row


def _section(text, heading):
    start = text.index(heading)
    end = text.find("\n## ", start + len(heading))
    return text[start:end if end >= 0 else len(text)]


def test_jit_row_quotes_the_newest_timed_torch_compile_run():
    row = _jit_row("README.md")
    assert _jit_row("docs/guide.md") == row
    cell = row.rstrip(" |").rsplit(" | ", 1)[1]
    (run,) = RUN.findall(cell)
    ratios = RATIO.findall(cell)
    assert ratios, cell
    section = _section((ROOT / "docs" / "benchmarks.md").read_text(),
                       "## `torch.compile`")
    # The cited run: its text from the date to the next heading.
    start = section.index(run)
    cited = section[start:section.find("\n#", start)]
    for ratio in ratios:
        assert re.search(rf"(?<![\d.]){re.escape(ratio)}(?![\d])", cited), (
            f"{ratio}x is not in the run of {run} in docs/benchmarks.md")
    # No later run in the section reports a kerasmp/stock steady step.
    day = run.split()[0]
    later = section[start + len(cited):]
    runs = re.findall(rf"{day} (\d{{2}}:\d{{2}})", later)
    newer = [t for t in runs if t > run.split()[1][:5]]
    for time in newer:
        at = later.index(f"{day} {time}")
        assert "steady step" not in later[at:later.find("\n#", at)], (
            f"a newer timed run ({day} {time}) than the one cited")
