"""The census's verdicts, counts and tables, from its JSON.

A row is one model on one backend; each of its three runs (float32, stock
`mixed_float16`, kerasmp) gets a verdict (`verdict`): "ok" when it builds,
its forward pass is finite and its fit steps leave finite losses and
weights; otherwise the first column that failed ("build", "forward",
"fit", "timeout", "crash") with the error. Parity is judged apart
(`PARITY_BOUND`).
"""

import math

PARITY_BOUND = 2e-2
"""max |diff| / float32 output range within which a half-precision run
counts as matching float32 (kerasmp.export's float16 gate)."""

FLAT_RANGE = 1e-6
"""Below this float32 output range (max - min) parity is not judged."""

POLICIES = ("float32", "stock", "kerasmp")
FORMATS = ("keras", "savedmodel", "tflite", "onnx")


def _num(v):
    if isinstance(v, str):
        return float(v)
    return v


def verdict(run):
    """`(word, detail)` for one policy's run of a row."""
    if not run:
        return "not run", ""
    if "timeout" in run:
        return "timeout", run["timeout"]
    if "crash" in run:
        return "crash", run["crash"]
    for column in ("build", "forward", "fit"):
        cell = run.get(column)
        if cell is None:
            return "not run", column
        if not cell.get("ok"):
            return column, f"{cell.get('error', '')} [{cell.get('where', '')}]"
        if column == "forward" and not cell.get("finite"):
            return "forward", "non-finite output"
        if column == "fit" and not cell.get("finite"):
            return "fit", ("non-finite loss" if not cell.get("loss_finite")
                           else "non-finite weights")
    return "ok", ""


def parity(run):
    """The run's forward parity to float32 (float, inf, or None)."""
    cell = (run or {}).get("forward") or {}
    value = cell.get("rel_diff")
    return None if value is None else _num(value)


def export_verdict(run, fmt):
    """`(word, rel_diff)`: "ok" (written, reloaded without kerasmp, parity
    within `PARITY_BOUND`), "parity" (also kerasmp's `ParityError`),
    "reload", "refused" (kerasmp said no: a ValueError raised by kerasmp,
    naming the layer or the format) or "crash"; "-" when not run."""
    cell = ((run or {}).get("export") or {})
    if not cell.get("ok", False) and "error" in cell:
        return "crash", None
    cell = cell.get(fmt)
    if not cell:
        return "-", None
    if not cell.get("written"):
        error = cell.get("error", "")
        if error.startswith("ParityError"):
            return "parity", None
        refusal = error.startswith(("ValueError", "TypeError",
                                    "NeedsFlexOps", "NotExpressible"))
        # A refusal is kerasmp's own sentence; a ValueError from a
        # converter or a runtime is a crash.
        return ("refused" if refusal and cell.get("raised_in", "kerasmp")
                == "kerasmp" else "crash"), None
    if not cell.get("reloaded"):
        return "reload", None
    value = cell.get("rel_diff")
    value = None if value is None else _num(value)
    if value is None or not value <= PARITY_BOUND:
        return "parity", value
    return "ok", value


def row_summary(name, row):
    """The verdicts of one row, flattened for counting and tables."""
    out = {"name": name, "source": row.get("source", "")}
    for policy in POLICIES:
        out[policy] = verdict(row.get(policy))
    out["parity_stock"] = parity(row.get("stock"))
    out["parity_kerasmp"] = parity(row.get("kerasmp"))
    f32 = ((row.get("float32") or {}).get("forward") or {})
    if f32.get("range") is not None and f32["range"] < FLAT_RANGE:
        # A flat float32 output (random BatchNorm nets at 32x32): no
        # parity figure says anything there.
        out["parity_stock"] = out["parity_kerasmp"] = "flat"
    kerasmp = row.get("kerasmp") or {}
    norms = kerasmp.get("norms") or {}
    out["norms"] = (norms.get("count"), norms.get("all_float32"))
    check = kerasmp.get("check") or {}
    out["check"] = (check.get("errors") if check.get("ok")
                    else "crash" if check else None)
    out["exports"] = {fmt: export_verdict(kerasmp, fmt) for fmt in FORMATS}
    if out["parity_kerasmp"] == "flat":
        # Nor the export's parity gate, on the same flat output.
        out["exports"] = {fmt: ("flat", None) if v[0] == "parity" else v
                          for fmt, v in out["exports"].items()}
    fit = kerasmp.get("fit") or {}
    out["skipped"] = fit.get("skipped")
    stock_fit = (row.get("stock") or {}).get("fit") or {}
    out["skipped_stock"] = stock_fit.get("skipped")
    out["warmup"] = kerasmp.get("warmup") if (
        kerasmp.get("warmup") or {}).get("ok") else None
    return out


def counts(rows):
    """The census's counts over `{name: row}` of one backend."""
    s = [row_summary(n, r) for n, r in rows.items()]

    def ok(x, policy):
        return x[policy][0] == "ok"

    def matches(x, key):
        v = x[key]
        return isinstance(v, (int, float)) and v <= PARITY_BOUND

    f32 = [x for x in s if ok(x, "float32")]
    stock_broken = [x for x in f32 if not ok(x, "stock")]
    out = {
        "rows": len(s),
        "float32_trains": len(f32),
        "stock_trains": sum(ok(x, "stock") for x in f32),
        "kerasmp_trains": sum(ok(x, "kerasmp") for x in f32),
        "stock_breaks": sorted(x["name"] for x in stock_broken),
        "kerasmp_fixes": sorted(x["name"] for x in stock_broken
                                if ok(x, "kerasmp")),
        "kerasmp_fails": sorted(x["name"] for x in f32
                                if not ok(x, "kerasmp")),
        "kerasmp_breaks_stock_ok": sorted(
            x["name"] for x in f32 if ok(x, "stock") and not ok(x, "kerasmp")),
        "stock_parity_ok": sum(matches(x, "parity_stock") for x in f32
                               if ok(x, "stock")),
        "kerasmp_parity_ok": sum(matches(x, "parity_kerasmp") for x in f32
                                 if ok(x, "kerasmp")),
        "kerasmp_parity_off": sorted(
            x["name"] for x in f32
            if ok(x, "kerasmp") and not matches(x, "parity_kerasmp")
            and x["parity_kerasmp"] != "flat"),
        "parity_flat": sorted(x["name"] for x in s
                              if x["parity_kerasmp"] == "flat"),
        "norms_float32": sum(1 for x in s if x["norms"][1]),
        "norms_not_float32": sorted(
            x["name"] for x in s if x["norms"][1] is False),
        "check_crashes": sorted(x["name"] for x in s if x["check"] == "crash"),
        "check_errors": sorted(x["name"] for x in s
                               if isinstance(x["check"], int)
                               and x["check"] > 0),
        "exports": {fmt: sum(x["exports"][fmt][0] == "ok" for x in s)
                    for fmt in FORMATS},
        "exports_run": sum(any(x["exports"][f][0] != "-" for f in FORMATS)
                           for x in s),
        "exports_not_ok": {
            fmt: {x["name"]: x["exports"][fmt][0] for x in s
                  if x["exports"][fmt][0] not in ("ok", "-")}
            for fmt in FORMATS},
    }
    out.update(warmup_counts(s))
    return out


def warmup_counts(summaries):
    """The loss-scale warm-up over the rows that ran it: per initial scale,
    the skipped steps (total, median, max, rows with any) and the first
    applied step; and the rows where "auto" skipped more, or fewer, steps
    than 2**15."""
    warm = {x["name"]: x["warmup"] for x in summaries if x["warmup"]}
    out = {}
    for key in ("2**15", "auto"):
        runs = [w[key] for w in warm.values() if key in w]
        skipped = sorted(r["skipped"] for r in runs)
        firsts = [r["first_applied_step"] for r in runs]
        applied = [f for f in firsts if f]
        out[f"warmup_{key}"] = {
            "models": len(runs),
            "skipped_total": sum(skipped),
            "skipped_median": _median(skipped),
            "skipped_max": max(skipped) if skipped else None,
            "models_with_skips": sum(v > 0 for v in skipped),
            "first_applied_mean": (round(sum(applied) / len(applied), 2)
                                   if applied else None),
            "never_applied": sum(1 for f in firsts if f is None),
            "non_finite": sorted(n for n, w in warm.items()
                                 if key in w and not w[key]["finite"]),
        }
    both = {n: w for n, w in warm.items() if "2**15" in w and "auto" in w}
    out["warmup_auto_worse"] = sorted(
        n for n, w in both.items()
        if w["auto"]["skipped"] > w["2**15"]["skipped"])
    out["warmup_auto_better"] = sorted(
        n for n, w in both.items()
        if w["auto"]["skipped"] < w["2**15"]["skipped"])
    return out


def _median(values):
    if not values:
        return None
    n = len(values)
    mid = n // 2
    return values[mid] if n % 2 else (values[mid - 1] + values[mid]) / 2


def warmup_rows(results):
    """The warm-up table in Markdown: per model and backend, the steps
    skipped in the first ten and the first applied step, with
    initial_scale 2**15 and "auto" (the scale it starts from)."""
    lines = [
        "| model | backend | skipped 2**15 | first applied 2**15 | "
        "skipped auto | first applied auto | auto's start |",
        "|---|---|---|---|---|---|---|",
    ]
    for backend, data in results.items():
        for name, row in data["rows"].items():
            w = (row.get("kerasmp") or {}).get("warmup") or {}
            if not w.get("ok"):
                continue
            a, b = w.get("2**15", {}), w.get("auto", {})
            start = (b.get("scales") or [None])[0]
            lines.append(
                f"| {name} | {_short(backend)} | {_fmt(a.get('skipped'))} "
                f"| {_fmt(a.get('first_applied_step'))} | "
                f"{_fmt(b.get('skipped'))} | "
                f"{_fmt(b.get('first_applied_step'))} | "
                f"{'-' if start is None else f'2**{_log2(start)}'} |")
    return "\n".join(lines)


def _log2(v):
    v = _num(v)
    return int(round(math.log2(v))) if v and v > 0 else v


def _short(backend):
    return "tf" if backend == "tensorflow" else backend[:3]


def _fmt(v):
    if v is None:
        return "-"
    if isinstance(v, float):
        if math.isinf(v) or math.isnan(v):
            return str(v)
        return f"{v:.1e}"
    return str(v)


def _cell(word):
    return "ok" if word == "ok" else f"**{word}**"


def markdown_rows(results):
    """The census table in Markdown: one line per model and backend."""
    lines = [
        "| model | backend | float32 | stock | kerasmp | parity stock | "
        "parity kerasmp | skipped stock/kerasmp | norms f32 | check errors "
        "| .keras | SavedModel | TFLite | ONNX |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    names = []
    for backend in results:
        for name in results[backend]["rows"]:
            if name not in names:
                names.append(name)
    for name in names:
        for backend, data in results.items():
            row = data["rows"].get(name)
            if row is None:
                continue
            x = row_summary(name, row)
            count, all32 = x["norms"]
            norms = "-" if count is None else (
                f"{count}/{count}" if all32 else f"**not all of {count}**")
            exports = []
            for fmt in FORMATS:
                word, value = x["exports"][fmt]
                exports.append(
                    f"ok {_fmt(value)}" if word == "ok" else
                    "-" if word == "-" else
                    f"**{word}**" + (f" {_fmt(value)}" if value is not None
                                     else ""))
            lines.append(
                f"| {name} | {backend[:3] if backend != 'tensorflow' else 'tf'}"
                f" | {_cell(x['float32'][0])} | {_cell(x['stock'][0])} | "
                f"{_cell(x['kerasmp'][0])} | {_fmt(x['parity_stock'])} | "
                f"{_fmt(x['parity_kerasmp'])} | {_fmt(x['skipped_stock'])}/"
                f"{_fmt(x['skipped'])} | {norms} | {_fmt(x['check'])} | "
                + " | ".join(exports) + " |")
    return "\n".join(lines)


def failures(results):
    """`[(backend, name, policy, word, detail)]` of every run not "ok"."""
    out = []
    for backend, data in results.items():
        for name, row in data["rows"].items():
            for policy in POLICIES:
                word, detail = verdict(row.get(policy))
                if word != "ok":
                    out.append((backend, name, policy, word, detail))
    return out


def text_table(rows):
    """A plain-text table of one backend's rows (printed by the census)."""
    header = ("model", "float32", "stock", "kerasmp", "parity-s",
              "parity-k", "skip s/k", "norms", "check", "keras", "saved",
              "tflite", "onnx")
    lines = []
    for name, row in rows.items():
        x = row_summary(name, row)
        lines.append((
            name, x["float32"][0], x["stock"][0], x["kerasmp"][0],
            _fmt(x["parity_stock"]), _fmt(x["parity_kerasmp"]),
            f"{_fmt(x['skipped_stock'])}/{_fmt(x['skipped'])}",
            "-" if x["norms"][0] is None else
            ("ok" if x["norms"][1] else "NO"),
            _fmt(x["check"]),
            *[x["exports"][f][0] for f in FORMATS]))
    widths = [max(len(str(r[i])) for r in [header] + lines)
              for i in range(len(header))]
    fmt = "  ".join("{:<%d}" % w for w in widths)
    return "\n".join([fmt.format(*header)] + [fmt.format(*r) for r in lines])
