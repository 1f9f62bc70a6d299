"""The demo's result table (`format_summary`) and the scale's text form.

`kerasmp.apps.demo.run_demo` prints `format_summary(summary)` at the end of
a run; `summary.json` loaded gives the same table.
"""

import math

from kerasmp._utils import cpu_speed
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
         else f"from {fmt_scale(mp['initial_loss_scale'])}"
         + (f", growth every {mp['dynamic_growth_steps']} steps"
            if mp.get("dynamic_growth_steps") else "")),
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
    speed = speed_line(summary)
    if speed:
        lines.append(speed)
    for note in summary["notes"]:
        lines.append(f"note: {note}")
    lines.append("artifacts:")
    for name, path in summary["artifacts"].items():
        if path:
            lines.append(f"  {name:<18} {path}")
    return "\n".join(lines)



def speed_line(summary):
    """The closing line on speed: what this run measured, and why, for the
    policy, backend and CPU it ran on. None on an accelerator (the table's
    time ratio says it all).

    Args:
        summary: The dict `run_demo` returns.
    """
    if not summary["device"].startswith("cpu"):
        return None
    ratio = summary["time_ratio"]  # mixed wall time / float32's
    policy = summary["config"]["policy"]
    measured = (f"this run: the mixed model trained in x{ratio:.2f} "
                "float32's time")
    if policy == "mixed_float16":
        return (f"{measured}. float16 has no fast kernels on a CPU (no "
                "float16 matrix units), so the casts cost time here; on a "
                "GPU with tensor cores float16 is the fast path. `kerasmp "
                "doctor` names the policy for this machine.")
    bf16 = summary.get("cpu_bf16_instructions")
    if not bf16:
        return (f"{measured}. This CPU has no bfloat16 instructions "
                "(avx512_bf16/amx_bf16), so bfloat16 is converted to float32"
                " and back: float32 is the fast policy here.")
    if summary.get("backend") == "jax":
        return (f"{measured}. This CPU has bfloat16 instructions, but XLA's "
                "CPU compiler (JAX) computes bfloat16 matrix products in "
                "float32: the TensorFlow and PyTorch backends use them.")
    verdict = "faster than" if ratio < 1.0 else "no faster than"
    row = cpu_speed.measured(summary.get("backend") or "tensorflow")
    row = row or cpu_speed.measured("tensorflow")
    return (f"{measured}: {verdict} float32. This CPU has bfloat16 "
            "instructions; the demo's model (8x8 images, 16-32 filters) is "
            "too small for them to matter much. On larger models kerasmp "
            f"measured {row.pair()} float32's speed ({row.cpu}); `kerasmp "
            "bench --preset cpu`, or `--model` for your model, measures it "
            "here.")
