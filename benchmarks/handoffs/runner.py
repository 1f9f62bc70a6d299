"""Runs cells of the hand-off matrix: producers, then consumers, each in
its own process with a time limit.

One process per producer (backend, model) writes every artifact the cells
need (`produce.py`); one process per consumer reads its cells' artifacts
one after the other (`consume.py`), each cell with `timeout` seconds: a
cell that hangs or takes the process down is refused with that reason,
and a new process takes the cells left (the census's process runner,
`benchmarks/zoo_census.py`). A cell whose artifact the producer refused
(an export this backend cannot write) is refused with the producer's
one-line reason, without a consumer.
"""

import json
import os
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
BENCHMARKS = os.path.dirname(HERE)
ROOT = os.path.dirname(BENCHMARKS)
if BENCHMARKS not in sys.path:
    sys.path.insert(0, BENCHMARKS)

from handoffs import cells as spec  # noqa: E402

PRODUCE_TIMEOUT = 900
CELL_TIMEOUT = 300


def gate(artifact):
    """The parity gate of a cell: `kerasmp.export`'s default for the
    export's dtype; float16's for a training file (a mixed model)."""
    from kerasmp.export import DEFAULT_MAX_REL_DIFF

    _, dtype = spec.artifact_format(artifact)
    return DEFAULT_MAX_REL_DIFF[dtype or "float16"]


def env_for(backend):
    env = dict(os.environ)
    env["KERAS_BACKEND"] = backend
    env["PYTHONPATH"] = os.pathsep.join(
        [ROOT] + [p for p in [env.get("PYTHONPATH")] if p])
    env.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")
    return env


def produce(producer, model, folder, artifacts, timeout=PRODUCE_TIMEOUT):
    """The manifest of one producer process, or `{"failed": reason}`."""
    os.makedirs(folder, exist_ok=True)
    log = os.path.join(folder, "produce.log")
    cmd = [sys.executable, os.path.join(HERE, "produce.py"), "--model",
           model, "--folder", folder, "--artifacts", *artifacts]
    with open(log, "w") as err:
        try:
            proc = subprocess.run(cmd, stdout=subprocess.PIPE, stderr=err,
                                  text=True, env=env_for(producer),
                                  timeout=timeout, start_new_session=True)
        except subprocess.TimeoutExpired:
            return {"failed": f"producer: over {timeout:.0f} s"}
    lines = [ln for ln in proc.stdout.splitlines()
             if ln.startswith("RESULT ")]
    if lines:
        return json.loads(lines[-1][len("RESULT "):])
    return {"failed": "producer: " + _last_error(log)}


def _last_error(log):
    with open(log) as f:
        tail = f.read()[-4000:].strip().splitlines()
    return next((ln.strip()[:240] for ln in reversed(tail) if ln.strip()
                 and not ln.startswith("PROGRESS")), "no output")


def consume(consumer, jobs, folder, timeout=CELL_TIMEOUT):
    """`{key: result}` of one consumer's cells (`jobs`), in as few
    processes as the cells allow."""
    from zoo_census import _last_progress
    from zoo_census import _run_worker

    out = {}
    left = list(jobs)
    attempt = 0
    while left:
        attempt += 1
        stem = os.path.join(folder, f"{consumer}.{attempt}")
        with open(stem + ".json", "w") as f:
            json.dump(left, f)
        cmd = [sys.executable, os.path.join(HERE, "consume.py"),
               "--consumer", consumer, "--jobs", stem + ".json"]
        found = {}
        done = _run_worker(cmd, env_for(spec.consumer_backend(consumer)),
                           stem + ".log", timeout, found)
        for key, (result, _) in found.items():
            out[key] = result
        current = next((j["key"] for j in left if j["key"] not in out), None)
        if current is not None:
            why = (f"over {timeout:.0f} s" if not done else
                   f"the process died in {_last_progress(stem + '.log')}: "
                   + _last_error(stem + ".log"))
            out[current] = {"cell": f"refused: {consumer}: {why}"}
        left = [j for j in left if j["key"] not in out]
    for result in out.values():
        result.pop("model", None)
    return out


def run(cells, base, produce_timeout=PRODUCE_TIMEOUT,
        cell_timeout=CELL_TIMEOUT, log=print, manifests=None):
    """Runs `cells` (a list of `spec.Cell`) under the folder `base`.

    Returns `(results, manifests)`: `{key: {"cell": "ok" | "refused: ...",
    ...}}` and `{"producer/model": manifest}`. `manifests` already made
    (the tests produce in their own process) are used as they are.
    """
    manifests = dict(manifests or {})
    results = {}
    by_producer = {}
    for cell in cells:
        by_producer.setdefault((cell.producer, cell.model), set()).add(
            cell.artifact)
    for (producer, model), artifacts in by_producer.items():
        name = f"{producer}/{model}"
        if name in manifests:
            continue
        start = time.time()
        ordered = [a for a in spec.ARTIFACTS if a in artifacts]
        manifests[name] = produce(producer, model,
                                  os.path.join(base, producer, model),
                                  ordered, produce_timeout)
        manifests[name]["seconds"] = round(time.time() - start, 1)
        log(f"produced {name} in {manifests[name]['seconds']:.0f} s"
            + (f": {manifests[name]['failed']}"
               if "failed" in manifests[name] else ""))
    jobs = {}
    for cell in cells:
        manifest = manifests[f"{cell.producer}/{cell.model}"]
        entry = manifest.get("artifacts", {}).get(cell.artifact)
        if "failed" in manifest:
            results[cell.key] = {"cell": f"refused: {manifest['failed']}"}
        elif entry is None:
            results[cell.key] = {"cell": "refused: producer: not written"}
        elif "refused" in entry:
            results[cell.key] = {"cell": f"refused: {entry['refused']}"}
        else:
            folder = os.path.dirname(entry["path"])
            jobs.setdefault(cell.consumer, []).append({
                "key": cell.key, "artifact": cell.artifact,
                "model": cell.model, "path": entry["path"],
                "folder": folder, "gate": gate(cell.artifact)})
    os.makedirs(base, exist_ok=True)
    for consumer in spec.CONSUMERS:
        if consumer not in jobs:
            continue
        start = time.time()
        found = consume(consumer, jobs[consumer], base, cell_timeout)
        results.update(found)
        ok = sum(r["cell"] == "ok" for r in found.values())
        log(f"consumed {len(found)} cells with {consumer} in "
            f"{time.time() - start:.0f} s: {ok} ok")
    return results, manifests
