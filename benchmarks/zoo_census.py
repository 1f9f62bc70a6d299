"""A census of the model zoo under mixed precision (issue 26, docs/zoo.md).

Every backbone keras-hub 0.32 ships (a tiny config each, copied from
keras-hub's own backbone tests: `benchmarks/zoo/hub.py`) and one
`keras.applications` model per family (`benchmarks/zoo/applications.py`),
on each backend, under float32, stock `mixed_float16`
(`keras.mixed_precision.set_global_policy`) and kerasmp
(`kerasmp.set_global_policy("mixed_float16")`), from the same float32
weights. Per model: build; forward finite; parity to float32 (max |diff| /
range of the float32 output); 3 fit steps with a small classification head
(finite, loss scale, skipped steps); normalization layers in float32
(`kerasmp.dtype_report`); `kerasmp.check` (crash, error count); each
export format (`kerasmp.export.export`, float16) written and read back in
a process where kerasmp cannot be imported, with its parity; and the
loss-scale warm-up (skipped steps and first applied step over 10 steps,
initial scale 2**15 against "auto").

Models run in worker processes (`benchmarks/zoo/worker.py`: float32 and
stock with kerasmp blocked, then kerasmp), `--batch` models one after the
other per process, each model with a time limit: a hang or a crash costs
one row, recorded with its cause, and a new process takes the rest.

Usage:
    python benchmarks/zoo_census.py [--backends tensorflow jax]
        [--models BertBackbone VGG16 ...] [--timeout 600] [--fast]
        [--no-warmup] [--eager] [--batch 8] [--subset fast] [--nice 10]
    python benchmarks/zoo_census.py --only-export [--backends ...]
        [--models ...]     # the export column added to the JSON's rows
    python benchmarks/zoo_census.py --list        # the rows, and why not
    python benchmarks/zoo_census.py --report      # tables from the JSON

Writes `benchmarks/results/zoo_census_<backend>.json` after every model
(`--models` updates those rows and keeps the others) and prints the table.
`--fast` skips the export column (the costly one).
"""

import argparse
import datetime
import json
import os
import platform
import signal
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
ZOO = os.path.join(HERE, "zoo")
sys.path.insert(0, HERE)

from zoo import report  # noqa: E402

RESULTS = os.path.join(HERE, "results")
BACKENDS = ("tensorflow", "jax")


def all_models():
    """`{name: ZooModel}`: keras-hub rows, then keras.applications."""
    from zoo import applications
    from zoo import hub

    return {**hub.HUB, **applications.APPLICATIONS}


def coverage():
    """What the installed packages hold and which rows cover them."""
    from zoo import applications
    from zoo import hub

    names = hub.backbone_names()
    covered = [n for n in names if n in hub.HUB]
    missing = {n: hub.NO_CONFIG.get(n, "no config yet") for n in names
               if n not in hub.HUB}
    families = applications.family_names()
    return {
        "keras_hub_backbones": len(names),
        "keras_hub_rows": len(covered),
        "keras_hub_without_row": missing,
        "keras_hub_extra_rows": list(hub.EXTRA),
        "applications_families": families,
        "applications_rows": [z.name for z in
                              applications.APPLICATIONS.values()],
    }


def machine():
    cpu = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    cpu = line.split(":", 1)[1].strip()
                    break
    except OSError:
        pass
    return f"{cpu}, {os.cpu_count()} logical CPUs"


def versions():
    out = {"python": platform.python_version()}
    from importlib import metadata

    for pkg in ("keras", "keras-hub", "tensorflow", "jax", "kerasmp",
                "tf2onnx", "onnxruntime", "ai-edge-litert"):
        try:
            out[pkg] = metadata.version(pkg)
        except metadata.PackageNotFoundError:
            out[pkg] = None
    return out


def run_stage(stage, names, backend, folders, timeout, extra=(),
              log_path=None):
    """Runs one stage of several models in worker processes.

    Models run one after the other in one process (its imports cost more
    than a tiny model); each model has `timeout` seconds. A model that
    times out or takes the process down gets `{"timeout": ...}` or
    `{"crash": ...}` (with the last progress line and the log's last error
    line), and a new process takes the models left.

    Returns `{name: (result, failure)}`, one of the two None.
    """
    env = dict(os.environ)
    env["KERAS_BACKEND"] = backend
    env["PYTHONPATH"] = os.pathsep.join(
        [ROOT] + [p for p in [env.get("PYTHONPATH")] if p])
    env.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")
    out = {}
    left = list(names)
    attempt = 0
    while left:
        attempt += 1
        log = f"{log_path or folders[left[0]]}.{stage}.{attempt}.log"
        cmd = [sys.executable, os.path.join(ZOO, "worker.py"), "--stage",
               stage, "--models", *left, "--dirs",
               *[folders[n] for n in left], *extra]
        done = _run_worker(cmd, env, log, timeout, out)
        current = next((n for n in left if n not in out), None)
        if current is not None and not done:
            out[current] = (None, {"timeout": f"over {timeout:.0f} s in "
                                              f"{_last_progress(log)}"})
        elif current is not None:
            with open(log) as f:
                tail = f.read()[-4000:].strip().splitlines()
            cause = next((ln for ln in reversed(tail) if ln.strip()
                          and not ln.startswith("PROGRESS")), "")
            out[current] = (None, {"crash": f"process died in "
                                            f"{_last_progress(log)}: "
                                            f"{cause[:300]}"})
        left = [n for n in left if n not in out]
    return out


def _run_worker(cmd, env, log_path, timeout, out):
    """Runs one worker process, filling `out` from its RESULT lines;
    False when a model ran over `timeout` (the process is killed)."""
    import queue
    import threading

    lines = queue.Queue()
    with open(log_path, "w") as log:
        proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=log,
                                text=True, env=env, start_new_session=True)

        def read():
            for line in proc.stdout:
                lines.put(line)
            lines.put(None)

        threading.Thread(target=read, daemon=True).start()
        # The first model also pays for the imports.
        deadline = time.time() + timeout + 60
        while True:
            try:
                line = lines.get(timeout=max(0.1, deadline - time.time()))
            except queue.Empty:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
                return False
            if line is None:
                proc.wait()
                return True
            if line.startswith("RESULT "):
                result = json.loads(line[len("RESULT "):])
                out[result["model"]] = (result, None)
                deadline = time.time() + timeout


def _last_progress(log_path):
    last = "start"
    with open(log_path) as f:
        for line in f:
            if line.startswith("PROGRESS "):
                last = line[len("PROGRESS "):].strip()
    return last


def census_rows(zoos, backend, timeout, export, warmup, eager, keep,
                only_export=False):
    """Both stages of several models on one backend: `{name: row}`.

    With `only_export` the stages run the float32 build and forward pass,
    then kerasmp's build and export column (`worker.py --only-export`)."""
    base = tempfile.mkdtemp(prefix=f"zoo_{backend}_")
    folders = {z.name: os.path.join(base, z.name) for z in zoos}
    for folder in folders.values():
        os.makedirs(folder)
    names = [z.name for z in zoos]
    flags = (["--eager"] if eager else []) + (
        ["--only-export"] if only_export else [])
    start = time.time()
    plain = run_stage("plain", names, backend, folders, timeout, flags,
                      log_path=os.path.join(base, "batch"))
    plain_seconds = (time.time() - start) / len(names)
    rows = {}
    for zoo in zoos:
        rows[zoo.name] = row = {"source": zoo.source, "config": zoo.config,
                                "note": zoo.note}
        result, failed = plain[zoo.name]
        if result is None:
            row["float32"] = failed
            row["stock"] = failed
        else:
            row["float32"] = result["float32"]
            row["stock"] = result["stock"] or {"crash": "not reached"}
        row["plain_seconds"] = round(plain_seconds, 1)
    ready = [n for n in names
             if os.path.exists(os.path.join(folders[n], "weights.npz"))]
    extra = flags + ([] if export else ["--no-export"])
    extra += [] if warmup else ["--no-warmup"]
    start = time.time()
    results = run_stage("kerasmp", ready, backend, folders, timeout,
                        extra, log_path=os.path.join(base, "batch")
                        ) if ready else {}
    kerasmp_seconds = (time.time() - start) / max(1, len(ready))
    for name in names:
        row = rows[name]
        if name in results:
            result, failed = results[name]
            row["kerasmp"] = result["kerasmp"] if result else failed
            row["kerasmp_seconds"] = round(kerasmp_seconds, 1)
        else:
            row["kerasmp"] = {"crash": "no float32 weights to start from"}
        if keep:
            row["folder"] = folders[name]
    if not keep:
        subprocess.run(["rm", "-rf", base], check=False)
    return rows


def export_only(data, names, models, backend, args, command):
    """The export column of `names`, added to their rows in `data` (each
    row's other columns kept, the run recorded under `export_runs`)."""
    data.setdefault("export_runs", []).append(
        {"command": command, "date": datetime.date.today().isoformat(),
         "machine": machine(), "versions": versions(), "rows": names})
    start = time.time()
    done = 0
    for first in range(0, len(names), args.batch):
        batch = names[first:first + args.batch]
        rows = census_rows([models[n] for n in batch], backend, args.timeout,
                           export=True, warmup=False, eager=args.eager,
                           keep=args.keep, only_export=True)
        for name in batch:
            done += 1
            row = data["rows"][name]
            kerasmp = row.setdefault("kerasmp", {})
            new = rows[name]["kerasmp"]
            if "export" in new:
                kerasmp["export"] = new["export"]
            else:  # no build, a crash or a time-out: "-" with the reason
                kerasmp["export"] = {"not_run": _export_failure(rows[name])}
            print(progress_line(done, len(names), backend, name, row,
                                seconds=rows[name].get("kerasmp_seconds", 0)
                                + rows[name].get("plain_seconds", 0)),
                  flush=True)
        data["export_runs"][-1]["seconds"] = round(time.time() - start, 1)
        data["counts"] = report.counts(data["rows"])
        write(backend, data)


def _export_failure(row):
    """Why a row's export-only run wrote no export column."""
    for policy in ("float32", "kerasmp"):
        run = row.get(policy) or {}
        for key in ("timeout", "crash"):
            if key in run:
                return f"{policy} {key}: {run[key]}"
        build = run.get("build") or {}
        if build and not build.get("ok"):
            return f"{policy} build: {build.get('error', '')}"
    return "no export column"


def progress_line(i, total, backend, name, row, seconds=None):
    x = report.row_summary(name, row)
    parts = []
    for policy in report.POLICIES:
        word, _ = x[policy]
        parts.append(f"{policy} {word}")
    par = report._fmt(x["parity_kerasmp"])
    if seconds is None:
        seconds = row.get("plain_seconds", 0) + row.get("kerasmp_seconds", 0)
    exports = " ".join(f"{f}:{x['exports'][f][0]}" for f in report.FORMATS
                       if x["exports"][f][0] != "-")
    return (f"[{i}/{total}] {backend} {name}: " + ", ".join(parts)
            + f"; parity {par}" + (f"; {exports}" if exports else "")
            + f" ({seconds:.0f} s)")


def result_path(backend):
    return os.path.join(RESULTS, f"zoo_census_{backend}.json")


def _set_results(folder):
    global RESULTS
    RESULTS = folder


def load(backend):
    path = result_path(backend)
    if os.path.exists(path):
        with open(path) as f:
            return json.load(f)
    return None


def write(backend, data):
    os.makedirs(os.path.dirname(result_path(backend)), exist_ok=True)
    path = result_path(backend)
    tmp = path + ".tmp"
    with open(tmp, "w") as f:
        json.dump(data, f, indent=1, sort_keys=False)
    os.replace(tmp, path)


def merge(backend, folders):
    """Adds the rows of `<folder>/zoo_census_<backend>.json` (a run split
    over several processes) to this backend's JSON: rows it lacks, and
    their commands and seconds."""
    data = load(backend) or {"rows": {}}
    if "parts" not in data and data["rows"]:
        data["parts"] = [{"command": data.get("command"),
                          "rows": list(data["rows"]),
                          "seconds": data.get("seconds")}]
    for folder in folders:
        path = os.path.join(folder, f"zoo_census_{backend}.json")
        if not os.path.exists(path):
            continue
        with open(path) as f:
            other = json.load(f)
        for name, row in other["rows"].items():
            data["rows"].setdefault(name, row)
        data.setdefault("commands", []).extend(other.get("commands", []))
        data.setdefault("parts", []).append(
            {"command": other.get("command"),
             "rows": list(other["rows"]), "seconds": other.get("seconds")})
        for key in ("backend", "date", "machine", "versions", "coverage",
                    "export", "eager", "jit_compile"):
            data.setdefault(key, other.get(key))
    data["counts"] = report.counts(data["rows"])
    write(backend, data)


def main(argv=None):
    parser = argparse.ArgumentParser(
        description="Census of the model zoo under mixed precision.")
    parser.add_argument("--backends", nargs="+", default=list(BACKENDS),
                        choices=("tensorflow", "jax", "torch"))
    parser.add_argument("--models", nargs="+", default=None,
                        help="rows to run (default: all)")
    parser.add_argument("--subset", choices=("fast",), default=None,
                        help="only the fast subset (tests/test_zoo_census.py)")
    parser.add_argument("--timeout", type=float, default=600,
                        help="seconds per model and stage (default 600)")
    parser.add_argument("--fast", action="store_true",
                        help="skip the export column")
    parser.add_argument("--only-export", action="store_true",
                        help="run the export column alone and add it to "
                             "the rows already in the JSON (their other "
                             "columns kept)")
    parser.add_argument("--no-warmup", action="store_true",
                        help="skip the loss-scale warm-up column")
    parser.add_argument("--eager", action="store_true",
                        help="fit with run_eagerly=True (the train step "
                             "untraced: ~5x faster for tiny models on CPU)")
    parser.add_argument("--batch", type=int, default=8,
                        help="models per worker process (default 8)")
    parser.add_argument("--nice", type=int, default=10,
                        help="niceness of the census and its processes")
    parser.add_argument("--keep", action="store_true",
                        help="keep each model's folder (artifacts, logs)")
    parser.add_argument("--results", default=RESULTS,
                        help="folder of the JSON (default benchmarks/results)")
    parser.add_argument("--list", action="store_true",
                        help="list the rows and the backbones without one")
    parser.add_argument("--merge", nargs="+", default=None, metavar="DIR",
                        help="add the rows of the same backend's JSON in "
                             "DIR (a run split over processes)")
    parser.add_argument("--report", action="store_true",
                        help="print the tables and counts from the JSON")
    args = parser.parse_args(argv)
    _set_results(os.path.abspath(args.results))

    if args.list:
        models = all_models()
        for name, zoo in models.items():
            print(f"{name:34s} {zoo.source:19s} {zoo.config}"
                  + (f"  ({zoo.note})" if zoo.note else ""))
        print(json.dumps(coverage(), indent=1))
        return 0
    if args.merge:
        for backend in args.backends:
            merge(backend, args.merge)
        return 0
    if args.report:
        results = {b: load(b) for b in args.backends if load(b)}
        print(report.markdown_rows(results))
        print()
        print(report.warmup_rows(results))
        for backend, data in results.items():
            print(f"\n{backend}:", json.dumps(report.counts(data["rows"]),
                                              indent=1))
        return 0

    if args.nice:
        os.nice(args.nice)
    models = all_models()
    names = args.models or list(models)
    if args.subset == "fast":
        names = [n for n in names if models[n].fast]
    unknown = [n for n in names if n not in models]
    if unknown:
        parser.error(f"unknown models {unknown}; see --list")
    command = "python benchmarks/zoo_census.py " + " ".join(
        sys.argv[1:] if argv is None else argv)
    if args.only_export and args.fast:
        parser.error("--only-export and --fast: one runs the export "
                     "column alone, the other skips it")
    for backend in args.backends:
        data = load(backend) if (args.models or args.subset
                                 or args.only_export) else None
        data = data or {"rows": {}}
        if args.only_export:
            missing = [n for n in names if n not in data["rows"]]
            if missing:
                parser.error(f"--only-export adds a column to rows the "
                             f"{backend} JSON has; it lacks {missing}")
            export_only(data, names, models, backend, args, command)
            continue
        data.setdefault("commands", []).append(command)
        data.update({
            "backend": backend,
            "date": datetime.date.today().isoformat(),
            "machine": machine(),
            "command": command,
            "versions": versions(),
            "coverage": coverage(),
            "export": not args.fast,
            "eager": args.eager,
            "jit_compile": False,
        })
        start = time.time()
        done = 0
        for first in range(0, len(names), args.batch):
            batch = names[first:first + args.batch]
            rows = census_rows([models[n] for n in batch], backend,
                               args.timeout, export=not args.fast,
                               warmup=not args.no_warmup, eager=args.eager,
                               keep=args.keep)
            for name in batch:
                done += 1
                data["rows"][name] = rows[name]
                print(progress_line(done, len(names), backend, name,
                                    rows[name]), flush=True)
            data["seconds"] = round(time.time() - start, 1)
            write(backend, data)
        data["seconds"] = round(time.time() - start, 1)
        data["counts"] = report.counts(data["rows"])
        write(backend, data)
        print()
        print(report.text_table({n: data["rows"][n] for n in names}))
        print(json.dumps(data["counts"], indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
