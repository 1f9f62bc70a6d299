"""The demo's result table (`format_summary`) and the scale's text form.

`kerasmp.apps.demo.run_demo` prints `format_summary(summary)` at the end of
a run; `summary.json` loaded gives the same table.
"""

import math

from kerasmp._utils.table import render_table


def fmt_scale(value):
    """A loss scale as text: `32768 (2^15)`, `-` for none."""
    if value is None:
        return "-"
    exponent = math.log2(value) if value > 0 else float("nan")
    if exponent == int(exponent):
        return f"{value:.0f} (2^{int(exponent)})"
    return f"{value:g}"


def format_summary(summary):
    """The demo's result table, as text.

    Args:
        summary: The dict `run_demo` returns (or `summary.json` loaded).

    Returns:
        A multi-line string.
    """
    f32, mp = summary["runs"]["float32"], summary["runs"]["mixed"]
    policy = summary["config"]["policy"]
    rows = [
        ("", "float32", policy, f"{policy} vs float32"),
        ("test accuracy", f"{100 * f32['test_accuracy']:.2f}%",
         f"{100 * mp['test_accuracy']:.2f}%",
         f"{summary['accuracy_diff_pp']:+.2f} pp"),
        ("test loss", f"{f32['test_loss']:.4f}", f"{mp['test_loss']:.4f}", ""),
        ("train wall time", f"{f32['wall_time_s']:.1f} s",
         f"{mp['wall_time_s']:.1f} s", f"x{summary['time_ratio']:.2f}"),
        ("final loss scale", "-", fmt_scale(mp["final_loss_scale"]),
         "" if mp["final_loss_scale"] is None
         else f"from {fmt_scale(mp['initial_loss_scale'])}"),
        ("skipped steps", "-",
         "-" if mp["skipped_steps"] is None
         else f"{mp['skipped_steps']} of {mp['steps']}", ""),
    ]
    events = mp.get("events") or {"total": 0, "by_kind": {}}
    kinds = ", ".join(f"{n} {k}" for k, n in events["by_kind"].items())
    rows.append(("events", "-", str(events["total"]), kinds))
    for e in summary["exports"]:
        top1 = e["top1_agreement"]
        rows.append((
            f"export {e['format']} ({e['dtype']})",
            f"size x{e['size_ratio']:.2f}",
            f"max|diff| {float(e['max_abs_diff']):.1e}",
            f"top-1 agree {100 * top1:.1f}%, "
            f"test acc {100 * e['test_accuracy']:.2f}%"
            if top1 is not None else "",
        ))
    table = render_table(rows[0], rows[1:], rule="full", strip=True)
    table = table.split("\n")
    # The rule spans what is printed (no trailing padding); it closes the
    # table too.
    rule = "-" * max(len(text) for i, text in enumerate(table) if i != 1)
    table[1] = rule
    lines = [""] + table
    verdict = (
        "within 1 point of float32" if summary["accuracy_parity"]
        else "MORE than 1 point from float32"
    )
    lines.append(rule)
    lines.append(f"mixed precision accuracy: {verdict} "
                 f"({summary['accuracy_diff_pp']:+.2f} pp).")
    if summary["device"].startswith("cpu"):
        lines.append(
            "on a CPU mixed precision is usually slower than float32 (no "
            "float16 matrix units): the wall time shows the cost of the "
            "casts. Speed needs a GPU; `kerasmp bench` measures it."
        )
    for note in summary["notes"]:
        lines.append(f"note: {note}")
    lines.append("artifacts:")
    for name, path in summary["artifacts"].items():
        if path:
            lines.append(f"  {name:<18} {path}")
    return "\n".join(lines)

