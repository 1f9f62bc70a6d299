"""kerasmp.policy.workers.check_workers_agree: two MultiWorkerMirroredStrategy
workers (two processes on 127.0.0.1), launched as in
tests/optimizer/test_optimizer_distributed.py, and two JAX processes
(`jax.distributed.initialize` with CPU collectives, a
`keras.distribution.DataParallel` over both).

Each worker builds and compiles its model for four scenarios in turn
(identical settings; another policy on worker 1; another float32 rule; another
initial loss scale) and calls the check after each compile. The expected
values are the settings each worker was given, written out by hand.
"""

import json
import textwrap
from pathlib import Path

import keras
import pytest
from _helpers import run_workers
from _models import single_dense

import kerasmp
from kerasmp.optimizer import LossScaleOptimizer
from kerasmp.policy.workers import check_workers_agree
from kerasmp.policy.workers import worker_settings

ROOT = Path(__file__).resolve().parents[2]


SCENARIOS = textwrap.dedent(
    """
    SCENARIOS = {
        "same": ("mixed_float16", None, 2.0**15),
        "policy": ("float32" if index else "mixed_float16", None, 2.0**15),
        "rules": ("mixed_float16", ["head"] if index else None, 2.0**15),
        "scale": ("mixed_float16", None, 2.0**10 if index else 2.0**15),
    }
    out = {}
    for name, (policy, rules, scale) in SCENARIOS.items():
        if rules is None:
            policy = kerasmp.Policy(policy)
        else:
            policy = kerasmp.Policy(policy, float32_layers=rules)
        with scope():
            with kerasmp.policy_scope(policy):
                model = keras.Sequential([
                    keras.Input((4,)),
                    keras.layers.Dense(4),
                    keras.layers.Dense(1, name="head"),
                ])
            try:
                # compile() checks the workers agree (kerasmp's hook).
                model.compile(
                    LossScaleOptimizer(keras.optimizers.SGD(),
                                       initial_scale=scale),
                    "mse",
                )
                out[name] = "ok"
            except ValueError as e:
                out[name] = str(e)
        if name == "same":  # calling the check again is harmless
            check_workers_agree(model)
    print("RESULT " + json.dumps(out))
    """
)

TF_WORKER = textwrap.dedent(
    """
    import json, os, sys
    index = int(sys.argv[1])
    ports = sys.argv[2].split(",")
    os.environ["TF_CONFIG"] = json.dumps({
        "cluster": {"worker": [f"127.0.0.1:{p}" for p in ports]},
        "task": {"type": "worker", "index": index},
    })
    import tensorflow as tf
    import keras
    import kerasmp
    from kerasmp.policy.workers import check_workers_agree
    from kerasmp.optimizer import LossScaleOptimizer

    strategy = tf.distribute.MultiWorkerMirroredStrategy()
    scope = strategy.scope
    """
) + SCENARIOS

JAX_WORKER = textwrap.dedent(
    """
    import contextlib, json, sys
    index = int(sys.argv[1])
    ports = sys.argv[2].split(",")
    import jax
    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    jax.distributed.initialize(
        coordinator_address=f"127.0.0.1:{ports[0]}", num_processes=2,
        process_id=index, initialization_timeout=120)
    import keras
    import kerasmp
    from kerasmp.policy.workers import check_workers_agree
    from kerasmp.optimizer import LossScaleOptimizer

    assert jax.process_count() == 2 and len(jax.devices()) == 2
    keras.distribution.set_distribution(keras.distribution.DataParallel())
    keras.utils.set_random_seed(0)  # replicated weights: the same everywhere
    scope = contextlib.nullcontext
    """
) + SCENARIOS


@pytest.mark.parametrize("backend", [
    pytest.param("tensorflow", marks=pytest.mark.tensorflow),
    pytest.param("jax", marks=pytest.mark.skipif(
        keras.backend.backend() != "jax",
        reason="runs in the JAX pass of tests/run.sh")),
])
def test_workers_with_different_settings_all_raise_the_same_error(
        tmp_path, backend):
    script = TF_WORKER if backend == "tensorflow" else JAX_WORKER
    results = run_workers(tmp_path, script, backend, timeout=300)
    w0, w1 = results
    assert w0["same"] == w1["same"] == "ok"
    for name in ("policy", "rules", "scale"):
        assert w0[name] == w1[name] != "ok", name
    assert (
        "`policy` differs (worker 0: mixed_float16, worker 1: float32)"
        in w0["policy"]
    )
    assert "`float32_layers` differs" in w0["rules"]
    assert '{"pattern": "head"}' in w0["rules"]
    assert "`loss_scale` differs" in w0["scale"]
    assert "32768.0" in w0["scale"] and "1024.0" in w0["scale"]
    for name in ("policy", "rules", "scale"):
        others = {"policy", "float32_layers", "loss_scale"} - {
            {"policy": "policy", "rules": "float32_layers",
             "scale": "loss_scale"}[name]
        }
        for field in others:
            assert f"`{field}` differs" not in w0[name], (name, field)


def test_settings_of_one_worker_and_no_op_without_a_strategy():
    with kerasmp.policy_scope(
        kerasmp.Policy("mixed_float16", float32_layers=["head"],
                       float32_defaults=False)
    ):
        model = single_dense(4, 1, name="head")
    model.compile(
        LossScaleOptimizer(keras.optimizers.SGD(), initial_scale=8.0,
                           dynamic=False),
        "mse",
    )
    settings = worker_settings(model)
    assert settings["policy"] == "mixed_float16"
    assert json.loads(settings["float32_layers"]) == [{"pattern": "head"}]
    loss_scale = json.loads(settings["loss_scale"])
    assert loss_scale["class"] == "LossScaleOptimizer"
    assert loss_scale["initial_scale"] == "8.0"
    assert loss_scale["dynamic"] == "False"
    check_workers_agree(model)  # no multi-worker strategy: nothing to do

    plain = single_dense(4, 1)
    plain.compile("sgd", "mse")
    assert worker_settings(plain) == {
        "policy": "float32", "float32_layers": "-", "loss_scale": "none"
    }
