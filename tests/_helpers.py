"""Helpers shared by several test files (imported as `_helpers`: pytest puts
tests/ on sys.path). The tiny models they build are in `_models.py`."""

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import keras
import numpy as np
import pytest

import kerasmp

ROOT = Path(__file__).resolve().parent.parent

# The first lines of a subprocess script in which kerasmp cannot be imported,
# as on a machine where it is not installed (the census's own, one file that
# imports nothing).
sys.path.insert(0, str(ROOT / "benchmarks"))
from zoo.absent import BLOCK_KERASMP  # noqa: E402, F401 (re-exported)

_KERAS_HUB = []  # [module or the exception its import raised], once


def keras_hub_or_skip():
    """`keras_hub`, imported; skips the test (or, called at a module's top,
    the whole module) where keras-hub cannot be imported.

    `pytest.importorskip("keras_hub")` skips only where keras-hub is not
    installed (pytest 9: a `ModuleNotFoundError`). Installed beside a Keras
    it does not support, keras-hub's import raises something else: keras-hub
    0.32 beside Keras 3.16 (`bash tests/run.sh --keras-nightly`) raises
    `ImportError: cannot import name 'get_keras_mask' from
    'keras.src.backend'`, which would error every test that needs it. The
    import is tried once per process (a second try after a failed one can
    raise differently) and the reason names both versions.

    Example:

        keras_hub = keras_hub_or_skip()  # at a module's top, or in a test
    """
    if not _KERAS_HUB:
        try:
            import keras_hub
        except Exception as error:  # noqa: BLE001 (any failure skips)
            _KERAS_HUB.append(error)
        else:
            _KERAS_HUB.append(keras_hub)
    found = _KERAS_HUB[0]
    if not isinstance(found, Exception):
        return found
    if isinstance(found, ModuleNotFoundError) and found.name == "keras_hub":
        reason = "keras-hub is not installed (pip install keras-hub)"
    else:
        from importlib import metadata

        try:
            hub = metadata.version("keras-hub")
        except metadata.PackageNotFoundError:
            hub = "?"
        reason = (
            f"keras-hub {hub} cannot be imported beside Keras "
            f"{keras.__version__} ({keras.__file__}): "
            f"{type(found).__name__}: {found}"
        )
    pytest.skip(reason, allow_module_level=True)


def float8_test_policy(name="float8_mixed_bfloat16", **rule):
    """A float8 `kerasmp.Policy` whose rule takes kernels of 256 elements
    and more (the 32x32 ones of the tests' tiny models, not their 32x4
    ones); `rule` overrides any other `Float8Rule` argument."""
    from kerasmp.float8 import Float8Rule

    return kerasmp.Policy(name, float8=Float8Rule(
        **{"min_kernel_size": 256, **rule}))


def uniform_inputs(model, n=64, seed=1):
    """`n` float32 draws from U(0, 1) shaped like the model's one input."""
    shape = (n,) + tuple(model.input_shape[1:])
    return np.random.default_rng(seed).uniform(0, 1, shape).astype("float32")


def free_ports(n):
    """`n` free TCP ports on 127.0.0.1."""
    sockets = [socket.socket() for _ in range(n)]
    for s in sockets:
        s.bind(("127.0.0.1", 0))
    ports = [s.getsockname()[1] for s in sockets]
    for s in sockets:
        s.close()
    return ports


def subprocess_env(backend):
    """The environment of a test subprocess: this checkout's kerasmp, the
    given Keras backend, TensorFlow's C++ logs off."""
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(
        [str(ROOT)] + [p for p in [env.get("PYTHONPATH")] if p]
    )
    env["KERAS_BACKEND"] = backend
    env.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")
    return env


def script_result(stdout, stderr, returncode):
    """The JSON after the last `RESULT ` line a script printed."""
    lines = [line for line in stdout.splitlines() if line.startswith("RESULT ")]
    assert returncode == 0 and lines, stderr[-3000:]
    return json.loads(lines[-1][len("RESULT ") :])


def run_scripts(script, argvs, backend, timeout):
    """Runs `script` once per argument list in `argvs`, all at once, each in
    a fresh process (killed after `timeout` seconds, so a hang fails in
    bounded time); returns each one's result (`script_result`)."""
    procs = [
        subprocess.Popen(
            [sys.executable, str(script), *map(str, argv)],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            env=subprocess_env(backend),
        )
        for argv in argvs
    ]
    results = []
    try:
        for proc in procs:
            stdout, stderr = proc.communicate(timeout=timeout)
            results.append(script_result(stdout, stderr, proc.returncode))
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
    return results


def run_workers(tmp_path, source, backend, timeout):
    """Runs `source` as two processes (argv: index, comma-separated ports)
    and returns each one's result."""
    script = tmp_path / "worker.py"
    script.write_text(source)
    ports = ",".join(map(str, free_ports(2)))
    return run_scripts(script, [[i, ports] for i in range(2)], backend,
                       timeout)


def assert_same_training_state(a, b):
    """Two recorded training states (`scale`, `skipped`, `iterations`,
    `weights`, `optimizer` variables by path) are exactly equal."""
    assert a["scale"] == b["scale"] and a["skipped"] == b["skipped"]
    assert a["iterations"] == b["iterations"]
    assert len(a["weights"]) == len(b["weights"])
    for u, v in zip(a["weights"], b["weights"]):
        np.testing.assert_array_equal(np.asarray(u), np.asarray(v))
    assert sorted(a["optimizer"]) == sorted(b["optimizer"])
    for path in a["optimizer"]:
        np.testing.assert_array_equal(np.asarray(a["optimizer"][path]),
                                      np.asarray(b["optimizer"][path]),
                                      err_msg=path)


def assert_close_next_steps(got, ref, saved):
    """`got` and `ref` continued from the same `saved` state: the same
    scale, skipped count and iterations, and weights within 2**-8 of the
    largest weight change of `ref` since `saved` (which must be nonzero)."""
    assert got["scale"] == ref["scale"] and got["skipped"] == ref["skipped"]
    assert got["iterations"] == ref["iterations"]
    moved = max(np.max(np.abs(np.asarray(r) - np.asarray(s)))
                for r, s in zip(ref["weights"], saved["weights"]))
    assert moved > 0
    for i, (u, r) in enumerate(zip(got["weights"], ref["weights"])):
        diff = np.max(np.abs(np.asarray(u) - np.asarray(r)))
        assert diff <= 2.0**-8 * moved, (i, diff, moved)


def slow_on(*backends):
    """`pytest.mark.slow` when the test run's backend is one of `backends`.

    For a test whose second backend adds little at a high cost: the other
    backend's pass runs it in the default suite (`bash tests/run.sh`), and
    CI's `bash tests/run.sh --slow` runs it on these backends too. A mark
    either way, so it also goes in `pytest.param(..., marks=...)`.
    """
    if keras.backend.backend() in backends:
        return pytest.mark.slow
    return pytest.mark.skipif(False, reason="runs in the default suite")
