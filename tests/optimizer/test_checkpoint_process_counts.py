"""Checkpoints cross process counts (JAX): a `.keras` file written by a
two-process `DataParallel` run (two JAX processes on 127.0.0.1, gloo CPU
collectives) resumes in one process, and one written by a one-process run
resumes in two, with kerasmp's `mixed_float16` policy and its
`LossScaleOptimizer` around SGD with momentum (a slot per weight).

Each run trains STEPS global batches in two `fit` calls, saving after the
first FIRST steps (every process saves: on JAX it is a collective;
process 0's file is the checkpoint). An inf in process 1's half of an
early step makes `skipped_steps` 1 before the save. The references are the
writers' own states at the save (what a resume must hold, exactly: weights,
momentum slots, scale, skipped count, iterations) and the uninterrupted
runs of the writing process count (what the next steps must give). Across
process counts the float16 gradients are summed in another order (per
process, then across), so after the resume the weights agree with the
uninterrupted run within float16 reduction noise, stated as
|w - w_ref| <= 2**-8 * max|w_ref - w_save| over all weights (a fraction of
the largest move of the next steps; per weight would be too strict for a
bias whose gradient, a mean of residuals of both signs, nearly cancels),
and the scale, skipped count and iterations exactly.

Killed in bounded time (`run_workers`' timeout): a hang fails the test.
"""

import subprocess
import sys
import textwrap

import keras
import pytest
from _helpers import assert_close_next_steps
from _helpers import assert_same_training_state
from _helpers import run_workers
from _helpers import script_result
from _helpers import subprocess_env

pytestmark = [
    pytest.mark.slow,  # six fresh JAX processes: a few minutes
    pytest.mark.skipif(keras.backend.backend() != "jax",
                       reason="runs in the JAX pass of tests/run.sh"),
]

B, FIRST, STEPS, OVERFLOW_STEP = 8, 4, 8, 1

WORKER = textwrap.dedent(
    f"""
    import json, os, sys
    index = int(sys.argv[1])  # one of two processes; -1: on its own
    import jax
    if index >= 0:
        jax.config.update("jax_cpu_collectives_implementation", "gloo")
        jax.distributed.initialize(
            coordinator_address=f"127.0.0.1:{{sys.argv[2].split(',')[0]}}",
            num_processes=2, process_id=index, initialization_timeout=120)
    import numpy as np
    import keras
    import kerasmp

    B, FIRST, STEPS, K = {B}, {FIRST}, {STEPS}, {OVERFLOW_STEP}
    if index >= 0:
        keras.distribution.set_distribution(
            keras.distribution.DataParallel(auto_shard_dataset=False))
    keras.utils.set_random_seed(0)
    kerasmp.set_global_policy(kerasmp.Policy("mixed_float16"))

    def state(model):
        opt = model.optimizer
        return {{
            "weights": [keras.ops.convert_to_numpy(v).tolist()
                        for v in model.weights],
            # A loaded model's slots drop the model's name from their
            # paths ("sgd/sequential_head_bias_momentum" is
            # "sgd/head_bias_momentum" after load_model).
            "optimizer": {{v.path.replace("/sequential_", "/"):
                          keras.ops.convert_to_numpy(v).tolist()
                          for v in opt.variables}},
            "scale": float(opt.loss_scale),
            "skipped": int(opt.skipped_steps),
            "iterations": int(keras.ops.convert_to_numpy(opt.iterations)),
        }}

    rng = np.random.default_rng(0)
    parts = rng.normal(size=(2, STEPS * B, 16)).astype("float32")
    parts[1, K * B + 3, 2] = np.inf  # process 1's half of step K
    if index >= 0:
        x = parts[index]
        batch = B
    else:  # global batch s = process 0's half, then process 1's
        x = np.concatenate([parts[:, s * B:(s + 1) * B].reshape(2 * B, 16)
                            for s in range(STEPS)])
        batch = 2 * B
    y = np.where(np.isfinite(x[:, :1]), x[:, :1], 0.0) * 0.5

    if mode == "write":
        model = keras.Sequential([
            keras.Input((16,)),
            keras.layers.Dense(32, activation="relu", name="hidden"),
            keras.layers.Dense(1, name="head"),
        ])
        if index < 0:  # the one-process run starts from the same weights
            init = np.load(os.path.join(out, "initial.npz"))
            for i, v in enumerate(model.weights):
                v.assign(init[f"arr_{{i}}"])
        elif index == 0:
            np.savez(os.path.join(out, "initial.npz"),
                     *[keras.ops.convert_to_numpy(v) for v in model.weights])
        model.compile(kerasmp.LossScaleOptimizer(
            keras.optimizers.SGD(0.05, momentum=0.9), initial_scale=1024.0),
            "mse")
    else:  # resume the other process count's checkpoint
        name = "one.keras" if index >= 0 else "two.keras"
        model = keras.models.load_model(os.path.join(out, name))
    result = {{}}
    if mode == "write":
        model.fit(x[:FIRST * batch], y[:FIRST * batch], batch_size=batch,
                  shuffle=False, verbose=0)
        # On JAX saving is a collective (it reads the global arrays):
        # every process saves, process 0's file is the checkpoint.
        name = {{-1: "one.keras", 0: "two.keras", 1: "two_p1.keras"}}[index]
        model.save(os.path.join(out, name))
    result["saved"] = state(model)
    model.fit(x[FIRST * batch:], y[FIRST * batch:], batch_size=batch,
              shuffle=False, verbose=0)
    result["final"] = state(model)
    print("RESULT " + json.dumps(result))
    """
)


def _run(tmp_path, mode, processes):
    """The result of each process of a `mode` run in `processes`."""
    source = f"mode, out = {mode!r}, {str(tmp_path)!r}\n" + WORKER
    if processes == 2:
        return run_workers(tmp_path, source, "jax", timeout=300)
    script = tmp_path / "one.py"
    script.write_text(source)
    done = subprocess.run(
        [sys.executable, str(script), "-1", "0"],
        capture_output=True, text=True, timeout=300,
        env=subprocess_env("jax"))
    return [script_result(done.stdout, done.stderr, done.returncode)]


def test_checkpoints_resume_across_process_counts(tmp_path):
    # The writers: two processes (writes two.keras), then one (one.keras).
    two = _run(tmp_path, "write", 2)
    one = _run(tmp_path, "write", 1)[0]
    assert_same_training_state(two[0]["saved"], two[1]["saved"])
    assert_same_training_state(two[0]["final"], two[1]["final"])
    for run in two[0], one:  # the inf skipped one step before the save
        assert run["saved"]["skipped"] == 1

    # Two processes' checkpoint, resumed in one.
    resumed = _run(tmp_path, "resume", 1)[0]
    assert_same_training_state(resumed["saved"], two[0]["saved"])
    assert_close_next_steps(resumed["final"], two[0]["final"],
                        two[0]["saved"])

    # One process's checkpoint, resumed in two.
    back = _run(tmp_path, "resume", 2)
    assert_same_training_state(back[0]["final"], back[1]["final"])
    assert_same_training_state(back[0]["saved"], one["saved"])
    assert_close_next_steps(back[0]["final"], one["final"], one["saved"])
