"""kerasmp.policy.workers.check_workers_agree: two MultiWorkerMirroredStrategy
workers (two processes on 127.0.0.1), launched as in
tests/optimizer/test_optimizer_distributed.py, two JAX processes
(`jax.distributed.initialize` with CPU collectives, a
`keras.distribution.DataParallel` over both), and two PyTorch ranks of a
gloo `torch.distributed` process group (the `compile` of a Keras model in
a `DistributedDataParallel` job; the custom loop's own call is in
tests/optimizer/test_optimizer_ddp.py).

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
    from kerasmp.float8 import Float8Rule
    F16, BF16 = "mixed_float16", "mixed_bfloat16"
    F8 = "float8_mixed_bfloat16"
    # name: (policy, float32 rules, float8 exclude, compile kind, scale,
    #        auto_scale_loss); each worker reads its own value of a pair.
    SCENARIOS = {
        "same": (F16, None, None, "explicit", 2.0**15, True),
        "same_everyday": (F16, None, None, "everyday", None, True),
        "policy": (("float32", F16), None, None, "explicit", 2.0**15, True),
        "policy_everyday": ((F16, BF16), None, None, "everyday", None, True),
        "rules": (F16, (None, ["head"]), None, "explicit", 2.0**15, True),
        "rules_everyday": (F16, (None, ["head"]), None, "everyday", None,
                           True),
        "float8": (F8, None, ((), ["mid"]), "explicit", 2.0**15, True),
        "float8_everyday": (F8, None, ((), ["mid"]), "everyday", None, True),
        "scale": (F16, None, None, "explicit", (2.0**15, 2.0**10), True),
        "presence_everyday": (F16, None, None, "everyday", None,
                              (True, False)),
    }

    def mine(value):
        return value[index] if isinstance(value, tuple) else value

    out = {}
    for name, fields in SCENARIOS.items():
        policy, rules, exclude, kind, scale, auto = map(mine, fields)
        kwargs = {}
        if rules is not None:
            kwargs["float32_layers"] = rules
        if exclude is not None:
            kwargs["float8"] = Float8Rule(min_kernel_size=256,
                                          exclude=list(exclude))
        policy = kerasmp.Policy(policy, **kwargs)
        with scope():
            with kerasmp.policy_scope(policy):
                model = keras.Sequential([
                    keras.Input((32,)),
                    keras.layers.Dense(32, name="first"),
                    keras.layers.Dense(32, name="mid"),
                    keras.layers.Dense(32, name="mid2"),
                    keras.layers.Dense(1, name="head"),
                ])
            optimizer = (
                LossScaleOptimizer(keras.optimizers.SGD(),
                                   initial_scale=scale)
                if kind == "explicit" else "sgd"
            )
            try:
                # compile() checks the workers agree (kerasmp's hook).
                model.compile(optimizer, "mse", auto_scale_loss=auto)
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

TORCH_WORKER = textwrap.dedent(
    """
    import contextlib, json, os, sys
    index = int(sys.argv[1])
    os.environ["MASTER_ADDR"] = "127.0.0.1"
    os.environ["MASTER_PORT"] = sys.argv[2].split(",")[0]
    import torch
    torch.distributed.init_process_group("gloo", rank=index, world_size=2)
    import keras
    import kerasmp
    from kerasmp.policy.workers import check_workers_agree
    from kerasmp.optimizer import LossScaleOptimizer

    scope = contextlib.nullcontext
    """
) + SCENARIOS


@pytest.mark.parametrize("backend", [
    pytest.param("tensorflow", marks=pytest.mark.tensorflow),
    pytest.param("jax", marks=pytest.mark.skipif(
        keras.backend.backend() != "jax",
        reason="runs in the JAX pass of tests/run.sh")),
    pytest.param("torch", marks=[pytest.mark.torch, pytest.mark.skipif(
        keras.backend.backend() != "torch",
        reason="runs in the PyTorch pass of tests/run.sh")]),
])
def test_workers_with_different_settings_all_raise_the_same_error(
        tmp_path, backend):
    script = {"tensorflow": TF_WORKER, "jax": JAX_WORKER,
              "torch": TORCH_WORKER}[backend]
    results = run_workers(tmp_path, script, backend, timeout=300)
    w0, w1 = results
    assert w0["same"] == w1["same"] == "ok"
    assert w0["same_everyday"] == w1["same_everyday"] == "ok"
    expected = {  # scenario: the one field that differs, in both values
        "policy": ("policy", "worker 0: float32", "worker 1: mixed_float16"),
        "policy_everyday": (
            "policy", "worker 0: mixed_float16", "worker 1: mixed_bfloat16"),
        "rules": ("float32_layers", '{"pattern": "head"}'),
        "rules_everyday": ("float32_layers", '{"pattern": "head"}'),
        "float8": ("float8", '"mid"'),
        "float8_everyday": ("float8", '"mid"'),
        "scale": ("loss_scale", "32768.0", "1024.0"),
        "presence_everyday": ("loss_scale", "worker 1: none"),
    }
    also = {  # a mixed_bfloat16 worker has no loss scaling at all
        "policy_everyday": {"loss_scale"},
    }
    fields = {"policy", "float32_layers", "float8", "loss_scale"}
    for name, (field, *values) in expected.items():
        assert w0[name] == w1[name] != "ok", name
        assert f"`{field}` differs" in w0[name], (name, w0[name])
        for value in values:
            assert value in w0[name], (name, value, w0[name])
        for other in fields - {field} - also.get(name, set()):
            assert f"`{other}` differs" not in w0[name], (name, other)


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
        "policy": "float32", "float32_layers": "-", "float8": "[]",
        "loss_scale": "none",
    }


@pytest.mark.torch
@pytest.mark.parametrize("make_inner", [
    lambda: keras.optimizers.SGD(),
    lambda: keras.optimizers.LossScaleOptimizer(
        keras.optimizers.Adam(), initial_scale=64.0, dynamic_growth_steps=7),
])
def test_settings_for_are_those_of_the_optimizer_compile_makes(make_inner):
    # compile compares the settings of the LossScaleOptimizer it is about
    # to make before making it: they must be those it then makes.
    predicted = LossScaleOptimizer.settings_for(make_inner())
    made = LossScaleOptimizer(make_inner())
    assert predicted == {key: getattr(made, key) for key in predicted}
    assert set(predicted) >= {"initial_scale", "dynamic_growth_steps",
                              "hysteresis", "min_scale", "max_scale"}
    if isinstance(make_inner(), keras.optimizers.LossScaleOptimizer):
        assert predicted["initial_scale"] == 64.0
        assert predicted["dynamic_growth_steps"] == 7
