"""`kerasmp.tune` on the census rows off float32 by more than 2e-2 (issue 37
item 5, docs/zoo.md).

Each model is built as the census's kerasmp stage builds it
(`kerasmp.set_global_policy("mixed_float16")`, seed 0, the tiny config of
`benchmarks/zoo/`), and `kerasmp.tune(features, x, target=2e-2)` runs on
the census's parity inputs (4 draws, seed 1). Per model: the figure before
and after (max |diff| / range against the same weights in float32, eager
calls), the layers kept, the float32 share of matmul/conv FLOPs before and
after, the forward passes and the time; where the target is not met, the
reason tune gives and the floor it measured (float32 with float16-rounded
weights, as `benchmarks/zoo_rounding.py`).

    KERAS_BACKEND=jax nice -n 5 python benchmarks/zoo_tune.py \
        [--models EfficientNetB0 ...] [--timeout 900]
    python benchmarks/zoo_tune.py --report   # the docs/zoo.md table

Each model runs in its own process with a time limit (a hang costs its
row, recorded as such). Prints one line per model and writes
`benchmarks/results/zoo_tune_<backend>.json` after each.
"""

import argparse
import datetime
import json
import os
import platform
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
if HERE not in sys.path:
    sys.path.insert(0, HERE)

TARGET = 2e-2
MODELS = ("EfficientNetB0", "Gemma4Backbone", "DFineBackbone", "MobileNet",
          "MobileNetV2", "MobileNetV3Small", "MobileNetBackbone")


def tune_one(name):
    """The row of one model (run in a worker process)."""
    import keras
    from zoo.worker import build
    from zoo.worker import data
    from zoo.worker import zoo_model

    import kerasmp

    zoo = zoo_model(name)
    x = data(zoo)["parity"]
    kerasmp.set_global_policy("mixed_float16")
    try:
        features, _ = build(zoo)
    finally:
        kerasmp.set_global_policy("float32")
    report = kerasmp.tune(features, x, target=TARGET)
    return {
        "backend": keras.backend.backend(),
        "met": report.met, "before": report.before, "after": report.after,
        "kept": list(report.float32_layers),
        "whole": [k.whole for k in report.layers],
        "flop_share_before": report.float32_flop_share.before,
        "flop_share_after": report.float32_flop_share.after,
        "passes": report.passes, "seconds": round(report.seconds, 1),
        "reason": report.reason, "floor": report.floor,
    }


def _cell(value, fmt=".1e"):
    return "-" if value is None else format(value, fmt)


def report():
    """The docs/zoo.md table, from both backends' JSON (markdown)."""
    lines = ["| row | backend | before | after | layers kept | float32 FLOP "
             "share (before -> after) | passes | tune s | kept (first 3) |",
             "|---|---|---|---|---|---|---|---|---|"]
    for backend in ("tensorflow", "jax"):
        path = os.path.join(HERE, "results", f"zoo_tune_{backend}.json")
        if not os.path.exists(path):
            continue
        with open(path) as f:
            rows = json.load(f)["rows"]
        short = {"tensorflow": "tf", "jax": "jax"}[backend]
        for name in [m for m in MODELS if m in rows]:
            r = rows[name]
            if "error" in r:
                lines.append(f"| {name} | {short} | - | - | - | - | - | - "
                             f"| {r['error']} |")
                continue
            kept = ", ".join(
                f"`{p.split('/', 1)[-1] if '/' in p else p}`"
                + ("" if whole else " (own code)")
                for p, whole in list(zip(r["kept"], r["whole"]))[:3])
            after = _cell(r["after"]) + ("" if r["met"] else " (not met)")
            lines.append(
                f"| {name} | {short} | {_cell(r['before'])} | {after} | "
                f"{len(r['kept'])} | {_cell(r['flop_share_before'], '.1%')}"
                f" -> {_cell(r['flop_share_after'], '.1%')} | "
                f"{r['passes']} | {r['seconds']:.0f} | {kept} |")
    return "\n".join(lines)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--models", nargs="+", default=list(MODELS))
    parser.add_argument("--timeout", type=float, default=900)
    parser.add_argument("--one", help=argparse.SUPPRESS)
    parser.add_argument("--report", action="store_true",
                        help="print the docs/zoo.md table from the JSON")
    args = parser.parse_args(argv)
    if args.report:
        print(report())
        return 0
    if args.one:
        row = tune_one(args.one)
        print("RESULT " + json.dumps(row))
        return 0

    backend = os.environ.get("KERAS_BACKEND", "tensorflow")
    path = os.path.join(HERE, "results", f"zoo_tune_{backend}.json")
    mine = {}
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(
        [ROOT] + [p for p in [env.get("PYTHONPATH")] if p])
    env.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")
    print(f"{'model':20s} {'before':>8s} {'after':>8s} {'kept':>5s} "
          f"{'f32 FLOPs':>10s} {'passes':>6s} {'s':>6s}")
    for name in args.models:
        start = time.time()
        try:
            proc = subprocess.run(
                [sys.executable, os.path.abspath(__file__), "--one", name],
                capture_output=True, text=True, env=env,
                timeout=args.timeout)
            lines = [line for line in proc.stdout.splitlines()
                     if line.startswith("RESULT ")]
            row = (json.loads(lines[-1][len("RESULT "):]) if lines else
                   {"error": proc.stderr.strip().splitlines()[-1][:300]
                    if proc.stderr.strip() else f"exit {proc.returncode}"})
        except subprocess.TimeoutExpired:
            row = {"error": f"over the {args.timeout:g} s limit"}
        row["wall_seconds"] = round(time.time() - start, 1)
        mine[name] = row
        print(f"{name:20s} {_cell(row.get('before')):>8s} "
              f"{_cell(row.get('after')):>8s} "
              f"{len(row.get('kept', [])):>5d} "
              f"{_cell(row.get('flop_share_after'), '.1%'):>10s} "
              f"{row.get('passes', '-'):>6} {row['wall_seconds']:>6}"
              + (f"  {row['error']}" if "error" in row else "")
              + (f"  not met: {row['reason']}" if row.get("reason") else ""),
              flush=True)
        rows = {}  # the file's rows, as another run may have left them
        if os.path.exists(path):
            with open(path) as f:
                rows = json.load(f).get("rows", {})
        rows.update(mine)
        out = {
            "backend": backend,
            "date": datetime.date.today().isoformat(),
            "machine": f"{platform.processor() or platform.machine()}, "
                       f"{os.cpu_count()} CPUs",
            "command": "python benchmarks/zoo_tune.py "
                       + " ".join(sys.argv[1:] if argv is None else argv),
            "target": TARGET,
            "rows": rows,
        }
        os.makedirs(os.path.dirname(path), exist_ok=True)
        with open(path, "w") as f:
            json.dump(out, f, indent=1)
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
