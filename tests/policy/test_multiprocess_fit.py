"""Multi-process JAX `fit` with kerasmp: two JAX processes on 127.0.0.1
(`jax.distributed.initialize`, gloo CPU collectives, one CPU device each)
train with kerasmp's `mixed_float16` policy, its `LossScaleOptimizer`, a
`LossScaleMonitor` and a `NonFiniteMonitor` writing a log file (the same
path on both processes, as on a shared file system), under

- `keras.distribution.DataParallel`: each process feeds its half of every
  global batch; one element of process 1's half of step `OVERFLOW_STEP`
  is inf;
- `keras.distribution.ModelParallel` with a `LayoutMap` that splits both
  kernels across the two processes (a 1 x 2 mesh, "model" axis): each
  process feeds the whole global batch, with the same inf.

The reference is not the code's own output: one process, without any
distribution, fits the same model (the two-process run's initial weights)
on the same global batches (both halves, in the order `DataParallel`
concatenates them), with the same inf. Checked:

- the weights after `fit` (gathered from both processes) equal the
  reference's within float16 reduction noise: the two runs sum the float16
  gradient contributions in another order (per process, then across
  processes, or split matrix products), a few float16 roundings
  (relative 2**-11 each) per step, so the bound is stated on what training
  moved: |w_2proc - w_ref| <= 2**-8 * max|w_ref - w_init| per variable;
- the step inf hit is skipped on both processes (and by the reference),
  and the loss scale and `skipped_steps` of every step agree on both;
- the `NonFiniteMonitor`'s log file holds each event once, written by
  process 0, followed by a line with what process 1 saw (the same events
  as the reference's, each naming the reference's first non-finite layer:
  the replay of a step's global batch gathers the parts held by the other
  process).

Killed in bounded time (`run_workers`' timeout): a hang fails the test.
"""

import json
import subprocess
import sys
import textwrap

import keras
import numpy as np
import pytest
from _helpers import run_workers
from _helpers import script_result
from _helpers import subprocess_env

pytestmark = [
    pytest.mark.slow,  # three fresh JAX processes: about a minute
    pytest.mark.skipif(keras.backend.backend() != "jax",
                       reason="runs in the JAX pass of tests/run.sh"),
]

LOCAL_BATCH, STEPS, OVERFLOW_STEP = 8, 8, 3
INITIAL_SCALE = 2.0**10

WORKER = textwrap.dedent(
    f"""
    import json, os, sys
    index = int(sys.argv[1])  # -1: the one-process reference
    out = sys.argv[3]
    import jax
    if index >= 0:
        ports = sys.argv[2].split(",")
        jax.config.update("jax_cpu_collectives_implementation", "gloo")
        jax.distributed.initialize(
            coordinator_address=f"127.0.0.1:{{ports[0]}}", num_processes=2,
            process_id=index, initialization_timeout=120)
    import numpy as np
    import keras
    import kerasmp
    from kerasmp.callbacks import LossScaleMonitor, NonFiniteMonitor

    B, STEPS, K = {LOCAL_BATCH}, {STEPS}, {OVERFLOW_STEP}
    if index >= 0 and parallel == "data":
        keras.distribution.set_distribution(
            keras.distribution.DataParallel(auto_shard_dataset=False))
    elif index >= 0:  # kernels split across the two processes' devices
        mesh = keras.distribution.DeviceMesh(
            (1, 2), ["batch", "model"], devices=jax.devices())
        layout_map = keras.distribution.LayoutMap(mesh)
        layout_map[".*hidden/kernel"] = (None, "model")
        layout_map[".*head/kernel"] = ("model", None)
        keras.distribution.set_distribution(keras.distribution.ModelParallel(
            layout_map=layout_map, batch_dim_name="batch",
            auto_shard_dataset=False))
    keras.utils.set_random_seed(0)

    def values(variables):  # every process calls it (a collective)
        if index < 0:
            return [keras.ops.convert_to_numpy(v) for v in variables]
        from jax.experimental import multihost_utils
        return [np.asarray(multihost_utils.process_allgather(
            v.value, tiled=True)) for v in variables]

    kerasmp.set_global_policy(kerasmp.Policy("mixed_float16"))
    model = keras.Sequential([
        keras.Input((16,)),
        keras.layers.Dense(32, activation="relu", name="hidden"),
        keras.layers.Dense(1, name="head"),
    ])
    if index >= 0 and parallel == "model":  # the kernels are split
        for layer in model.layers:
            sharding = layer.kernel.value.sharding
            assert not sharding.is_fully_replicated, (layer.name, sharding)
    initial = values(model.weights)
    if index == 0:
        np.savez(os.path.join(out, "initial.npz"), *initial)
    if index < 0:  # the reference starts from the two-process run's weights
        init = np.load(os.path.join(out, "initial.npz"))
        for i, v in enumerate(model.weights):
            v.assign(init[f"arr_{{i}}"])
    model.compile(
        kerasmp.LossScaleOptimizer(keras.optimizers.SGD(0.05),
                                   initial_scale={INITIAL_SCALE}),
        "mse")

    # Process p's half of global batch s: rows [s*B, (s+1)*B) of part p.
    rng = np.random.default_rng(0)
    parts = rng.normal(size=(2, STEPS * B, 16)).astype("float32")
    parts[1, K * B + 2, 5] = np.inf  # process 1's half of step K
    if index >= 0 and parallel == "data":
        x = parts[index]
    else:  # global batch s = process 0's half, then process 1's (each
        # process of the ModelParallel run feeds the whole global batch)
        x = np.concatenate([parts[:, s * B:(s + 1) * B]
                            .reshape(2 * B, 16) for s in range(STEPS)])
    y = np.where(np.isfinite(x[:, :1]), x[:, :1], 0.0) * 0.5
    scale_monitor = LossScaleMonitor()
    events = os.path.join(out, "events.jsonl" if index >= 0 else "ref.jsonl")
    nan_monitor = NonFiniteMonitor(action="warn", log_file=events)
    local = B if index >= 0 and parallel == "data" else 2 * B
    model.fit(x, y, batch_size=local, epochs=1,
              shuffle=False, verbose=0,
              callbacks=[scale_monitor, nan_monitor])
    print("RESULT " + json.dumps({{
        "weights": [w.tolist() for w in values(model.trainable_weights)],
        "trace": scale_monitor.trace,
        "events": [[e["step"], e["kind"]] for e in nan_monitor.events],
    }}))
    """
)


@pytest.mark.parametrize("parallel", ["data", "model"])
def test_multi_process_fit_matches_one_process_and_agrees(tmp_path,
                                                           parallel):
    # run_workers writes the script to tmp_path/worker.py; the reference
    # runs it again as "process -1".
    source = WORKER.replace(
        "out = sys.argv[3]",
        f"out, parallel = {str(tmp_path)!r}, {parallel!r}")
    w0, w1 = run_workers(tmp_path, source, "jax", timeout=300)
    ref = subprocess.run(
        [sys.executable, str(tmp_path / "worker.py"), "-1", "0"],
        capture_output=True, text=True, timeout=300,
        env=subprocess_env("jax"))
    ref = script_result(ref.stdout, ref.stderr, ref.returncode)

    # Every step's scale and skipped count, the same on both processes and
    # as the reference's; the step inf hit is skipped (by hand: one skip,
    # the scale halves).
    assert w0["trace"] == w1["trace"] == ref["trace"]
    trace = {step: (scale, skipped) for step, scale, skipped in w0["trace"]}
    assert len(trace) == STEPS
    before = trace[OVERFLOW_STEP - 1]
    assert trace[OVERFLOW_STEP] == (before[0] / 2, before[1] + 1)

    # The weights, within float16 reduction noise of the reference's.
    init = np.load(tmp_path / "initial.npz")
    for i, (a, b, r) in enumerate(zip(w0["weights"], w1["weights"],
                                      ref["weights"])):
        a, b, r = np.asarray(a), np.asarray(b), np.asarray(r)
        np.testing.assert_array_equal(a, b)
        moved = np.max(np.abs(r - init[f"arr_{i}"]))
        assert moved > 0
        assert np.max(np.abs(a - r)) <= 2.0**-8 * moved, (
            i, np.max(np.abs(a - r)), moved)

    # The monitors: the same events everywhere; the file has each event
    # once, from process 0, then a line with what process 1 saw.
    assert w0["events"] == w1["events"] == ref["events"]
    assert [OVERFLOW_STEP, "overflow"] in ref["events"]
    logged = [json.loads(line) for line in
              (tmp_path / "events.jsonl").read_text().splitlines()]
    ref_logged = [json.loads(line) for line in
                  (tmp_path / "ref.jsonl").read_text().splitlines()]
    assert len(ref_logged) == len(ref["events"])
    assert [e["process"] for e in logged] == [0, 1] * len(ref["events"])
    for mine, theirs, expected in zip(logged[::2], logged[1::2], ref_logged):
        for event in mine, theirs:
            assert (event["step"], event["kind"]) == (
                expected["step"], expected["kind"])
            assert event["loss_scale"] == expected["loss_scale"]
            # Where the inf was: every process replays the global batch
            # (its split parts gathered) and names the reference's layer.
            assert "locate_error" not in event, event["locate_error"]
            for key in "layer", "variable", "all_gradients_nonfinite":
                assert event.get(key) == expected.get(key), key
    overflow = [e for e in ref_logged if e["step"] == OVERFLOW_STEP][0]
    assert overflow["layer"] == "hidden"
