"""Counts and tables of the hand-off matrix, from its JSON.

- `counts(cells)`: ok and refused, per producer, artifact, consumer and
  model, and every reason with its number of cells.
- `matrix_table(data)`: docs/export.md's matrix: the Keras files (a row
  per artifact and producer backend, a column per Keras consumer), the
  other exports (a row per format and dtype, a column per producer
  backend); each entry the three models' verdicts, reasons numbered below.
- `backend_rows(data, link)`: the export rows of the backend table that
  README.md and docs/guide.md hold.
- `write_tables(data, root)`: puts them between the files'
  `<!-- handoffs:begin -->` and `<!-- handoffs:end -->` markers (in the
  backend table, only the generated rows change); `check=True` writes
  nothing and returns the files that differ.

Nothing here runs a cell: a table says only what the JSON holds.
"""

import collections
import os

from handoffs import cells as spec

BEGIN = "<!-- handoffs:begin -->"
END = "<!-- handoffs:end -->"
MODEL_LABELS = {"cnn": "CNN", "transformer": "transformer",
                "gpt_oss": "GPT-OSS"}
FORMAT_LABELS = {"keras": "`.keras`", "savedmodel": "SavedModel",
                 "tflite": "TFLite", "onnx": "ONNX", "torch": "`.pt2`"}
ROW_LABELS = (
    "export formats",
    "compiled `.keras`",
    "`.weights.h5`",
)
"""How the generated rows of the backend table begin (the renderer
replaces every row that begins so)."""


NOT_RUN = "refused: not run"
"""A cell the JSON lacks: never counted as ok."""


def verdict(value):
    return "ok" if value == "ok" else "refused"


def reason(value):
    return None if value == "ok" else value[len("refused: "):]


def counts(cells):
    """`{"cells", "ok", "refused", "by_producer", "by_artifact",
    "by_consumer", "by_model", "reasons"}` of `{key: value}`."""
    out = {"cells": len(cells), "ok": 0, "refused": 0}
    groups = {"by_producer": 0, "by_model": 1, "by_artifact": 2,
              "by_consumer": 3}
    for name in groups:
        out[name] = {}
    reasons = collections.Counter()
    for key, value in cells.items():
        word = verdict(value)
        out[word] += 1
        parts = key.split("/")
        for name, index in groups.items():
            entry = out[name].setdefault(parts[index],
                                         {"ok": 0, "refused": 0})
            entry[word] += 1
        if word == "refused":
            reasons[reason(value)] += 1
    out["reasons"] = dict(reasons.most_common())
    return out


def text_summary(data):
    c = data["counts"]
    lines = [f"{c['cells']} cells: {c['ok']} ok, {c['refused']} refused"]
    for group in ("by_producer", "by_model", "by_artifact", "by_consumer"):
        lines.append(group[3:] + ": " + ", ".join(
            f"{k} {v['ok']}/{v['ok'] + v['refused']}"
            for k, v in c[group].items()))
    for text, n in c["reasons"].items():
        lines.append(f"  {n:3d} x {text}")
    return "\n".join(lines)


# --------------------------------------------------------------------------
# docs/export.md: the matrix
# --------------------------------------------------------------------------


def artifact_label(artifact):
    if artifact in spec.TRAINING:
        return spec.ARTIFACT_NAMES[artifact]
    fmt, dtype = spec.artifact_format(artifact)
    return f"`export` {FORMAT_LABELS[fmt]} {dtype}"


def matrix_table(data):
    """docs/export.md's matrix and its numbered reasons (Markdown)."""
    cells = data["cells"]
    numbers = {}

    def entry(producer, artifact, consumer):
        by_word = {}
        for model in spec.MODELS:
            value = cells.get(spec.Cell(producer, model, artifact,
                                        consumer).key)
            if value is None:
                word = "not run"
            elif value == "ok":
                word = "ok"
            else:
                word = "R" + str(numbers.setdefault(reason(value),
                                                    len(numbers) + 1))
            by_word.setdefault(word, []).append(MODEL_LABELS[model])
        if len(by_word) == 1:
            return next(iter(by_word))
        return "; ".join(f"{w}: {', '.join(m)}" for w, m in by_word.items())

    keras_consumers = spec.KERAS_CONSUMERS
    header = ["Keras file", "from"] + [
        spec.CONSUMER_NAMES[c] for c in keras_consumers]
    rows = ["| " + " | ".join(header) + " |",
            "|" + "---|" * len(header)]
    for artifact in spec.ARTIFACTS:
        if spec.consumers_of(artifact) != keras_consumers:
            continue
        for producer in spec.PRODUCERS:
            rows.append("| " + " | ".join(
                [artifact_label(artifact), spec.BACKEND_NAMES[producer]]
                + [entry(producer, artifact, c) for c in keras_consumers])
                + " |")
    header = ["export", "read by"] + [
        f"from {spec.BACKEND_NAMES[p]}" for p in spec.PRODUCERS]
    rows += ["", "| " + " | ".join(header) + " |",
             "|" + "---|" * len(header)]
    for artifact in spec.ARTIFACTS:
        fmt, _ = spec.artifact_format(artifact)
        if artifact in spec.TRAINING or fmt == "keras":
            continue
        consumer = spec.RUNTIMES[fmt]
        rows.append("| " + " | ".join(
            [artifact_label(artifact), spec.CONSUMER_NAMES[consumer]]
            + [entry(p, artifact, consumer) for p in spec.PRODUCERS])
            + " |")
    c = data["counts"]
    lines = rows + ["", f"{c['cells']} cells: **{c['ok']} ok, "
                        f"{c['refused']} refused** (run {data['date']}, "
                        f"commit {data['commit'][:10]}, "
                        f"{data['seconds'] / 60:.0f} min). Reasons:", ""]
    for text, n in numbers.items():
        count = c["reasons"].get(text, 0)
        lines.append(f"- R{n} ({count} cell{'s' if count != 1 else ''}): "
                     f"{_code(text)}")
    return "\n".join(lines) + "\n"


def _code(text):
    return "`" + text.replace("`", "'") + "`"


# --------------------------------------------------------------------------
# README.md and docs/guide.md: the export rows of the backend table
# --------------------------------------------------------------------------


def _summary(values, noun="cells"):
    """`yes`, or `no: <reason>`, or `n of m <noun>; else <reason>`."""
    values = list(values)
    ok = sum(v == "ok" for v in values)
    if values and ok == len(values):
        return "yes"
    common = collections.Counter(reason(v) for v in values
                                 if v != "ok").most_common(1)
    why = _code(_short(common[0][0])) if common else "not run"
    if ok == 0:
        return f"no: {why}"
    return f"{ok} of {len(values)} {noun}; else {why}"


def _short(text, limit=110):
    return text if len(text) <= limit else text[:limit - 3] + "..."


def backend_rows(data, link):
    """The generated rows of the backend table (`link`: the matrix's
    address from the file that holds the table)."""
    cells = data["cells"]

    def values(producer, artifacts, consumers):
        return [cells.get(key, NOT_RUN) for key in (
            spec.Cell(producer, m, a, c).key for m in spec.MODELS
            for a in artifacts for c in consumers)]

    rows = []
    formats = []
    for producer in spec.PRODUCERS:
        names = []
        for fmt in spec.FORMATS:
            artifacts = [f"{fmt}-{d}" for d in spec.EXPORT_DTYPES]
            got = [cells.get(c.key, NOT_RUN) for c in spec.cells(
                (producer,), spec.MODELS, artifacts)]
            ok = sum(v == "ok" for v in got)
            label = fmt + (" (`.pt2`)" if fmt == "torch" else "")
            if got and ok == len(got):
                names.append(label)
            elif ok:
                names.append(f"{label} ({ok} of {len(got)} cells)")
        formats.append(", ".join(names) or "none")
    rows.append(["export formats (float16 and float32, each read back by "
                 f"its runtime within the parity gate: [measured]({link}))",
                 *formats])
    plain = tuple(c for c in spec.KERAS_CONSUMERS if c.startswith("keras-"))
    mp = tuple(c for c in spec.KERAS_CONSUMERS if c.startswith("kerasmp-"))
    rows.append(["compiled `.keras` (`model.save`, `ModelCheckpoint`) "
                 "loads and trains on without kerasmp, any backend",
                 *[_summary(values(p, ("save", "checkpoint"), plain))
                   for p in spec.PRODUCERS]])
    rows.append(["compiled `.keras` loads and trains on with kerasmp, any "
                 "backend",
                 *[_summary(values(p, ("save", "checkpoint"), mp))
                   for p in spec.PRODUCERS]])
    rows.append(["`.weights.h5` (`ModelCheckpoint`) loads and trains on, "
                 "with and without kerasmp",
                 *[_summary(values(p, ("weights",), plain + mp))
                   for p in spec.PRODUCERS]])
    return ["| " + " | ".join(row) + " |" for row in rows]


def render_backend_table(text, rows):
    """`text` with the backend table's generated rows replaced by `rows`
    (between the markers; the other rows kept)."""
    head, body, tail = _split(text)
    lines = body.split("\n")
    generated = [i for i, ln in enumerate(lines)
                 if any(ln.startswith(f"| {label}") for label in ROW_LABELS)]
    if not generated:
        raise ValueError("the backend table has no row to replace")
    first = generated[0]
    kept = [ln for i, ln in enumerate(lines) if i not in generated]
    kept[first:first] = rows
    return head + "\n".join(kept) + tail


def render_matrix(text, table):
    head, _, tail = _split(text)
    return head + "\n" + table + "\n" + tail


def _split(text):
    if text.count(BEGIN) != 1 or text.count(END) != 1:
        raise ValueError(f"expected one {BEGIN} and one {END}")
    head, rest = text.split(BEGIN)
    body, tail = rest.split(END)
    return head + BEGIN, body, END + tail


TABLES = {
    "README.md": ("backend", "docs/export.md#the-hand-off-matrix"),
    "docs/guide.md": ("backend", "export.md#the-hand-off-matrix"),
    "docs/export.md": ("matrix", None),
}


def rendered(data, root):
    """`{relative path: (current text, text with the tables)}`."""
    out = {}
    for rel, (kind, link) in TABLES.items():
        with open(os.path.join(root, rel)) as f:
            text = f.read()
        if kind == "backend":
            new = render_backend_table(text, backend_rows(data, link))
        else:
            new = render_matrix(text, matrix_table(data))
        out[rel] = (text, new)
    return out


def write_tables(data, root, check=False):
    """Writes the tables (or with `check`, only compares); returns the
    files that changed (or differ)."""
    changed = []
    for rel, (text, new) in rendered(data, root).items():
        if new != text:
            changed.append(rel)
            if not check:
                with open(os.path.join(root, rel), "w") as f:
                    f.write(new)
    return changed
