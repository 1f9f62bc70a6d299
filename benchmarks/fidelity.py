"""Does mixed precision under kerasmp reach float32's loss? (issue 38)

Long runs on real data that ships with every machine (no download), under
each policy, from the same initial weights and the same data order per
seed (benchmarks/fidelity_run.py, one fresh Python process per run, so the
stock-Keras runs never import kerasmp):

- tasks: `lm` (a byte-level decoder-only transformer on the stdlib `.py`
  corpus, `kerasmp.data.load_pycorpus`), `digits_cnn` (Conv2D + BatchNorm
  on the 8x8 digits), `digits_transformer` (the digits as 8 tokens, two
  keras-hub TransformerEncoder blocks);
- policies: `float32`, `stock_mixed_float16` (Keras alone, with Keras's
  `LossScaleOptimizer`), `kerasmp_mixed_float16` (kerasmp's
  `LossScaleOptimizer`, `dynamic_growth_steps=500`),
  `kerasmp_mixed_float16_g2000` (the default 2,000; first seed only),
  `kerasmp_mixed_bfloat16`, `kerasmp_float8` (`float8_mixed_bfloat16`).

Per run: final and best evaluation loss and accuracy, the difference from
float32's final loss (same seed) against the goal (not above it by more than
the float32 seed spread or 1% of float32's loss, whichever is wider), the
steps skipped after the warm-up, the loss scale's range, growths and back-
offs, and the wall time against float32's (without the first evaluation
interval, which holds the compilation). Each run's record is kept under
`--runs-dir`; a run whose record is there is not run again (`--force`
reruns), so an interrupted invocation resumes.

Usage:
    KERAS_BACKEND=jax python benchmarks/fidelity.py [--steps N]
        [--seeds 2] [--tasks lm digits_cnn] [--policies float32 ...]
        [--plots docs/img] [--out benchmarks/results/fidelity_jax.json]
"""

import argparse
import datetime
import json
import os
import platform
import statistics
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

from fidelity_run import DEFAULT_STEPS  # noqa: E402
from fidelity_run import POLICIES  # noqa: E402
from fidelity_run import TASKS  # noqa: E402

FIRST_SEED_ONLY = ("kerasmp_mixed_float16_g2000",)
# float8 applies to matmuls (Dense/EinsumDense kernels >= 4096 elements):
# not to the CNN.
NOT_APPLICABLE = {("digits_cnn", "kerasmp_float8")}


def _machine():
    try:
        out = subprocess.run(["lscpu"], capture_output=True, text=True,
                             check=False).stdout
        for line in out.splitlines():
            if line.startswith("Model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


def run_one(backend, task, policy, seed, steps, path, force=False):
    """Runs one configuration in a fresh process; returns its record."""
    if os.path.exists(path) and not force:
        with open(path, encoding="utf-8") as f:
            return json.load(f)
    env = dict(os.environ, KERAS_BACKEND=backend, TF_CPP_MIN_LOG_LEVEL="3")
    cmd = [sys.executable, os.path.join(HERE, "fidelity_run.py"),
           "--task", task, "--policy", policy, "--seed", str(seed),
           "--steps", str(steps), "--out", path]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True,
                          check=False)
    if proc.returncode or not os.path.exists(path):
        return {"task": task, "policy": policy, "seed": seed, "steps": steps,
                "backend": backend,
                "error": f"exit {proc.returncode}: {proc.stderr[-300:]}"}
    with open(path, encoding="utf-8") as f:
        return json.load(f)


def summarize(records):
    """One row per run, compared with float32's run of the same seed."""
    ok = [r for r in records if "error" not in r]
    rows = []
    for task in dict.fromkeys(r["task"] for r in records):
        f32 = {r["seed"]: r for r in ok
               if r["task"] == task and r["policy"] == "float32"}
        finals = [r["final_eval_loss"] for r in f32.values()]
        spread = max(finals) - min(finals) if len(finals) > 1 else 0.0
        mean = statistics.mean(finals) if finals else None
        tol = max(spread, 0.01 * mean) if finals else None
        for r in records:
            if r["task"] != task:
                continue
            row = {"task": task, "policy": r["policy"], "seed": r["seed"],
                   "steps": r["steps"]}
            if "error" in r:
                row["error"] = r["error"]
                rows.append(row)
                continue
            ref = f32.get(r["seed"])
            row.update(final=r["final_eval_loss"], best=r["best_eval_loss"],
                       acc=r["final_eval_accuracy"],
                       best_acc=r["best_eval_accuracy"],
                       f32_spread=spread, tolerance=tol)
            if ref is not None:
                d = r["final_eval_loss"] - ref["final_eval_loss"]
                row.update(
                    diff=d, diff_pct=100 * d / ref["final_eval_loss"],
                    # The goal is to reach float32's loss: a lower loss
                    # meets it whatever its size.
                    within_goal=d <= tol,
                    time_ratio=r["steady_seconds"] / ref["steady_seconds"])
            ls = r.get("loss_scale")
            if ls:
                row.update(
                    skipped=ls["skipped"],
                    skipped_after_warmup=ls["skipped_after_warmup"],
                    skipped_pct=100 * ls["skipped_after_warmup"] / r["steps"],
                    scale_min=ls["scale_min"], scale_max=ls["scale_max"],
                    growths=ls["growths"], backoffs=ls["backoffs"],
                    per_step_trace=ls["per_step_trace"])
            rows.append(row)
    return rows


def _log2(v):
    import math

    return f"2^{math.log2(v):.0f}" if v and v > 0 else "-"


def table(rows):
    head = (f"{'task':18s} {'policy':28s} {'s':>1s} {'final':>7s} "
            f"{'best':>7s} {'acc':>6s} {'vs f32':>7s} {'goal':>4s} "
            f"{'skip>wu':>8s} {'scale min-max':>13s} {'grow':>4s} "
            f"{'back':>4s} {'time':>5s}")
    lines = [head, "-" * len(head)]
    for r in rows:
        if "error" in r:
            lines.append(f"{r['task']:18s} {r['policy']:28s} {r['seed']:1d} "
                         f"error: {r['error'][:70]}")
            continue
        vs = f"{r['diff_pct']:+.2f}%" if "diff_pct" in r else "-"
        goal = ("-" if r["policy"] == "float32" or "within_goal" not in r
                else ("yes" if r["within_goal"] else "NO"))
        if "scale_min" in r:
            skip = f"{r['skipped_after_warmup']} ({r['skipped_pct']:.2f}%)"
            scale = f"{_log2(r['scale_min'])}-{_log2(r['scale_max'])}"
            grow, back = str(r["growths"]), str(r["backoffs"])
        else:
            skip, scale, grow, back = "-", "-", "-", "-"
        t = f"{r['time_ratio']:.2f}" if "time_ratio" in r else "-"
        lines.append(
            f"{r['task']:18s} {r['policy']:28s} {r['seed']:1d} "
            f"{r['final']:7.4f} {r['best']:7.4f} {r['acc']:6.3f} {vs:>7s} "
            f"{goal:>4s} {skip:>8s} {scale:>13s} {grow:>4s} {back:>4s} "
            f"{t:>5s}")
    return "\n".join(lines)


def markdown(rows):
    """The table as Markdown (for docs/fidelity.md)."""
    out = ["| task | policy | seed | final loss | best loss | accuracy | "
           "vs float32 | goal | skipped after warm-up | scale range | "
           "growths | back-offs | time vs float32 |",
           "|" + "---|" * 13]
    for r in rows:
        if "error" in r:
            out.append(f"| {r['task']} | {r['policy']} | {r['seed']} | "
                       f"error: {r['error'][:80]} |" + " |" * 9)
            continue
        vs = f"{r['diff_pct']:+.2f}%" if "diff_pct" in r else "-"
        goal = ("-" if r["policy"] == "float32" or "within_goal" not in r
                else ("yes" if r["within_goal"] else "**no**"))
        if "scale_min" in r:
            skip = (f"{r['skipped_after_warmup']} "
                    f"({r['skipped_pct']:.2f}%)")
            scale = f"{_log2(r['scale_min'])}-{_log2(r['scale_max'])}"
            grow, back = r["growths"], r["backoffs"]
        else:
            skip = scale = grow = back = "-"
        t = f"{r['time_ratio']:.2f}" if "time_ratio" in r else "-"
        out.append(f"| {r['task']} | {r['policy']} | {r['seed']} | "
                   f"{r['final']:.4f} | {r['best']:.4f} | {r['acc']:.3f} | "
                   f"{vs} | {goal} | {skip} | {scale} | {grow} | {back} | "
                   f"{t} |")
    return "\n".join(out)


def plots(records, folder, backend):
    """Loss curves by policy, the loss scale and skipped steps per 100."""
    from matplotlib.figure import Figure

    os.makedirs(folder, exist_ok=True)
    written = []
    ok = [r for r in records if "error" not in r]
    for task in dict.fromkeys(r["task"] for r in ok):
        runs = [r for r in ok if r["task"] == task]
        seed = min(r["seed"] for r in runs)
        fig = Figure(figsize=(8, 4), dpi=100)
        ax = fig.add_subplot(1, 1, 1)
        for r in runs:
            if r["seed"] != seed:
                continue
            xs = [(i + 1) * r["eval_every"]
                  for i in range(len(r["eval_loss_curve"]))]
            ax.plot(xs, r["eval_loss_curve"], label=r["policy"],
                    linestyle="--" if r["policy"].startswith("stock")
                    else "-")
        ax.set_xlabel("step")
        ax.set_ylabel("evaluation loss")
        ax.set_title(f"{task}: evaluation loss by policy ({backend}, "
                     f"seed {seed})")
        ax.grid(True, alpha=0.3)
        ax.legend(fontsize=8)
        fig.tight_layout()
        path = os.path.join(folder, f"fidelity_{task}_loss_{backend}.png")
        fig.savefig(path, format="png")
        written.append(path)
        scaled = [r for r in runs if r.get("loss_scale")]
        if not scaled:
            continue
        fig = Figure(figsize=(8, 6), dpi=100)
        ax, bx = fig.add_subplot(2, 1, 1), fig.add_subplot(2, 1, 2)
        for r in scaled:
            ls = r["loss_scale"]
            label = f"{r['policy']} s{r['seed']}"
            if ls["per_step_trace"]:
                xs = range(1, len(ls["scale_trace"]) + 1)
                ax.step(xs, ls["scale_trace"], where="post", label=label)
                n = r["steps"] // 100
                counts = [0] * n
                for s in ls["skip_steps"]:
                    counts[min(s // 100, n - 1)] += 1
                bx.plot([100 * i for i in range(n)], counts,
                        drawstyle="steps-post", label=label)
            else:
                xs = [(i + 1) * r["eval_every"]
                      for i in range(len(ls["scale_samples"]))]
                ax.plot(xs, ls["scale_samples"], "o--", markersize=3,
                        label=label + " (every 100 steps)")
        ax.set_yscale("log", base=2)
        ax.set_ylabel("loss scale (log2)")
        ax.set_title(f"{task}: loss scale and skipped steps ({backend})")
        ax.grid(True, alpha=0.3)
        ax.legend(fontsize=7)
        bx.set_xlabel("step")
        bx.set_ylabel("skipped steps per 100")
        bx.grid(True, alpha=0.3)
        if bx.get_lines():
            bx.legend(fontsize=7)
        fig.tight_layout()
        path = os.path.join(folder, f"fidelity_{task}_scale_{backend}.png")
        fig.savefig(path, format="png")
        written.append(path)
    return written


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--steps", type=int, default=None,
                   help="steps per run (default: lm 5000, digits 500)")
    p.add_argument("--seeds", type=int, default=2)
    p.add_argument("--tasks", nargs="+", default=list(TASKS), choices=TASKS)
    p.add_argument("--policies", nargs="+", default=list(POLICIES),
                   choices=tuple(POLICIES))
    p.add_argument("--plots", default=None, help="folder for the PNGs")
    p.add_argument("--runs-dir", default=None)
    p.add_argument("--out", default=None)
    p.add_argument("--force", action="store_true")
    p.add_argument("--markdown", action="store_true",
                   help="also print the table as Markdown")
    p.add_argument("--no-run", action="store_true",
                   help="tabulate the recorded runs only; list the others")
    a = p.parse_args(argv)
    backend = os.environ.get("KERAS_BACKEND", "tensorflow")
    runs_dir = a.runs_dir or os.path.join(HERE, "results", "fidelity_runs",
                                          backend)
    os.makedirs(runs_dir, exist_ok=True)
    out = a.out or os.path.join(HERE, "results",
                                f"fidelity_{backend}.json")
    start = time.perf_counter()
    records, missing = [], []
    for task in a.tasks:
        steps = a.steps or DEFAULT_STEPS[task]
        for seed in range(a.seeds):
            for policy in a.policies:
                if (task, policy) in NOT_APPLICABLE or (
                        seed and policy in FIRST_SEED_ONLY):
                    continue
                path = os.path.join(runs_dir,
                                    f"{task}_{policy}_s{seed}.json")
                if a.no_run and not os.path.exists(path):
                    missing.append(f"{task} {policy} seed {seed}")
                    continue
                r = run_one(backend, task, policy, seed, steps, path,
                            a.force)
                if r.get("steps") != steps and "error" not in r:
                    r = run_one(backend, task, policy, seed, steps, path,
                                force=True)
                print(f"{task} {policy} seed {seed}: "
                      + (r.get("error") or f"{r['final_eval_loss']:.4f}"),
                      flush=True)
                records.append(r)
    rows = summarize(records)
    print(table(rows))
    if a.markdown:
        print(markdown(rows))
    if missing:
        print("not run:", "; ".join(missing))
    meta = next((r for r in records if r.get("task") == "lm"
                 and "data" in r), None)
    result = {
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(
            timespec="seconds"),
        "machine": _machine(), "backend": backend,
        "python": platform.python_version(),
        "corpus": meta["data"] if meta else None,
        "command": " ".join(["python"] + sys.argv),
        "seconds": time.perf_counter() - start,
        "rows": rows, "not_run": missing, "runs": records,
    }
    with open(out, "w", encoding="utf-8") as f:
        json.dump(result, f, indent=1)
    if a.plots:
        for path in plots(records, a.plots, backend):
            print("wrote", path)


if __name__ == "__main__":
    main()
