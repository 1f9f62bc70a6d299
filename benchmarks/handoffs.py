"""The hand-off matrix (issue 35, docs/export.md "The hand-off matrix").

Every artifact a model trained under kerasmp leaves as (`model.save` after
`compile`, `ModelCheckpoint`'s `.keras` and `.weights.h5`, the float16 and
float32 `kerasmp.export.export` in every format), from each backend, for
three models (the demo's CNN, a small transformer, a tiny keras-hub
GPT-OSS whose routers kerasmp moves to float32), read by each consumer
that should read it (plain Keras and kerasmp on each backend, `tf.saved_model`,
onnxruntime, LiteRT, `torch.export.load`). Each cell is `ok` (it loads
and runs, its parity is within the export gate, and a training file
trains on) or `refused: <one line>`. `benchmarks/handoffs/cells.py` lists
the cells.

Usage:
    python benchmarks/handoffs.py            # the full matrix, JSON, tables
    python benchmarks/handoffs.py --producers torch --models cnn \
        [--artifacts save ...] [--consumers ...]  # those cells, updated
    python benchmarks/handoffs.py --render   # the tables from the JSON
    python benchmarks/handoffs.py --check    # exit 1 if a table is stale

Writes `benchmarks/results/handoffs.json` (date, machine, versions,
commit, seconds, every cell) and then the generated tables: the export
rows of the backend table in README.md and docs/guide.md, and the matrix
in docs/export.md (`benchmarks/handoffs/report.py`).
"""

import argparse
import datetime
import json
import os
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
sys.path.insert(0, HERE)

from handoffs import cells as spec  # noqa: E402
from handoffs import report  # noqa: E402
from handoffs import runner  # noqa: E402

RESULT = os.path.join(HERE, "results", "handoffs.json")


def commit():
    """The checkout's commit, `+dirty` with uncommitted changes outside
    benchmarks/results/."""
    def git(*args):
        return subprocess.run(["git", *args], cwd=ROOT, text=True,
                              capture_output=True).stdout.strip()

    head = git("rev-parse", "HEAD") or "unknown"
    dirty = [ln for ln in git("status", "--porcelain").splitlines()
             if "benchmarks/results/" not in ln]
    return head + ("+dirty" if dirty else "")


def load(path=RESULT):
    if os.path.exists(path):
        with open(path) as f:
            return json.load(f)
    return None


def write(data, path=RESULT):
    os.makedirs(os.path.dirname(path), exist_ok=True)
    tmp = path + ".tmp"
    with open(tmp, "w") as f:
        json.dump(data, f, indent=1)
        f.write("\n")
    os.replace(tmp, path)


def producer_summary(manifest):
    """What the JSON keeps of a producer's manifest (no paths; of the
    dtypes, the routers')."""
    out = {k: manifest[k] for k in ("seconds", "optimizer", "moved",
                                    "failed") if k in manifest}
    # What a reloaded model must keep: the routers' dtypes (kerasmp moves
    # them to float32 at the first call or at compile).
    out["routers"] = {p: d for p, d in manifest.get("dtypes", {}).items()
                      if "router" in p}
    out["artifacts"] = {
        a: {k: v for k, v in entry.items() if k != "path"}
        for a, entry in manifest.get("artifacts", {}).items()}
    return out


def merge(paths, out):
    """Writes the JSON at `out` from parts (each a run of some cells):
    their cells, details and producers; the runs listed; the date,
    machine, versions and commit of the last, the seconds summed."""
    data = {"cells": {}, "details": {}, "producers": {}, "runs": []}
    for path in paths:
        part = load(path)
        for key in ("cells", "details", "producers"):
            data[key].update(part[key])
        data["runs"] += part["runs"]
    last = data["runs"][-1]
    data.update({k: last[k] for k in ("date", "machine", "commit",
                                      "versions")})
    data["command"] = " && ".join(r["command"] for r in data["runs"])
    data["seconds"] = round(sum(r["seconds"] for r in data["runs"]), 1)
    order = {c.key: i for i, c in enumerate(spec.cells())}
    data["cells"] = dict(sorted(data["cells"].items(),
                                key=lambda kv: order.get(kv[0], 1e9)))
    data["counts"] = report.counts(data["cells"])
    write(data, out)
    return data


def main(argv=None):
    from zoo_census import machine
    from zoo_census import versions

    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--producers", nargs="+", default=spec.PRODUCERS,
                        choices=spec.PRODUCERS)
    parser.add_argument("--models", nargs="+", default=spec.MODELS,
                        choices=spec.MODELS)
    parser.add_argument("--artifacts", nargs="+", default=spec.ARTIFACTS,
                        choices=spec.ARTIFACTS)
    parser.add_argument("--consumers", nargs="+", default=spec.CONSUMERS,
                        choices=spec.CONSUMERS)
    parser.add_argument("--cell-timeout", type=float,
                        default=runner.CELL_TIMEOUT,
                        help="seconds per consumer cell (default 300)")
    parser.add_argument("--produce-timeout", type=float,
                        default=runner.PRODUCE_TIMEOUT,
                        help="seconds per producer (default 900)")
    parser.add_argument("--results", default=RESULT,
                        help="the JSON (default benchmarks/results/"
                             "handoffs.json)")
    parser.add_argument("--keep", default=None, metavar="DIR",
                        help="write the artifacts in DIR and keep them")
    parser.add_argument("--reuse", default=None, metavar="DIR",
                        help="take the artifacts of an earlier --keep DIR "
                             "instead of producing them again")
    parser.add_argument("--merge", nargs="+", default=None, metavar="JSON",
                        help="one JSON of the parts' (runs of some "
                             "consumers each, with --results), then tables")
    parser.add_argument("--render", action="store_true",
                        help="only write the tables from the JSON")
    parser.add_argument("--check", action="store_true",
                        help="exit 1 if a table differs from the JSON's")
    parser.add_argument("--no-render", action="store_true",
                        help="run and write the JSON, not the tables")
    parser.add_argument("--nice", type=int, default=10)
    args = parser.parse_args(argv)

    if args.merge:
        merged = merge(args.merge, args.results)
        print(report.text_summary(merged))
        if args.results == RESULT:
            for path in report.write_tables(merged, ROOT):
                print(f"wrote: {path}")
        return 0
    if args.render or args.check:
        data = load(args.results)
        if data is None:
            parser.error(f"no {args.results}: run the matrix first")
        stale = report.write_tables(data, ROOT, check=args.check)
        for path in stale:
            print(f"{'stale' if args.check else 'wrote'}: {path}")
        return 1 if args.check and stale else 0

    if args.nice:
        os.nice(args.nice)
    chosen = spec.cells(args.producers, args.models, args.artifacts,
                        args.consumers)
    full = len(chosen) == len(spec.cells())
    command = "python benchmarks/handoffs.py" + "".join(
        " " + a for a in (sys.argv[1:] if argv is None else argv))
    base = args.keep or tempfile.mkdtemp(prefix="handoffs_")
    head = commit()  # the code that runs, before anything changes
    start = time.time()
    reused = {}
    if args.reuse:  # the producers' folders of an earlier `--keep DIR`
        for p in args.producers:
            for m in args.models:
                path = os.path.join(args.reuse, p, m, "manifest.json")
                if os.path.exists(path):
                    with open(path) as f:
                        reused[f"{p}/{m}"] = json.load(f)
    results, manifests = runner.run(
        chosen, base, args.produce_timeout, args.cell_timeout,
        log=lambda line: print(line, flush=True), manifests=reused)
    seconds = round(time.time() - start, 1)
    if not args.keep:
        subprocess.run(["rm", "-rf", base], check=False)

    data = (None if full else load(args.results)) or {"cells": {},
                                                       "details": {},
                                                       "producers": {}}
    run = {"command": command, "date": datetime.datetime.now(
        datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
        "machine": machine(), "commit": head, "versions": versions(),
        "cell_count": len(chosen), "seconds": seconds}
    for pkg in ("torch", "litert-torch", "onnxscript"):
        from importlib import metadata

        try:
            run["versions"][pkg] = metadata.version(pkg)
        except metadata.PackageNotFoundError:
            run["versions"][pkg] = None
    if full:
        data.update(run)
    data.setdefault("runs", []).append(run)
    for name, manifest in manifests.items():
        data["producers"][name] = producer_summary(manifest)
    for key, result in results.items():
        data["cells"][key] = result["cell"]
        data["details"][key] = {k: v for k, v in result.items()
                                if k not in ("cell", "key")}
    order = {c.key: i for i, c in enumerate(spec.cells())}
    data["cells"] = dict(sorted(data["cells"].items(),
                                key=lambda kv: order.get(kv[0], 1e9)))
    data["details"] = {k: data["details"][k] for k in data["cells"]
                       if k in data["details"]}
    data["counts"] = report.counts(data["cells"])
    write(data, args.results)
    print(report.text_summary(data))
    print(f"{len(chosen)} cells in {seconds:.0f} s; wrote {args.results}")
    if not args.no_render and args.results == RESULT:
        for path in report.write_tables(data, ROOT):
            print(f"wrote: {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
