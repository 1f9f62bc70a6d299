"""`jit_compile=True` on PyTorch (`torch.compile`) with kerasmp.

Dynamo compiles the code a compiled train step runs after a graph break
frame by frame, each guarded on the Python values it read, and recompiles a
frame whose guard fails, up to `torch._dynamo.config.recompile_limit`; past
it the frame runs eagerly. kerasmp must add no such guard: on a small
transformer under mixed_float16, a jit fit under kerasmp recompiles no frame
of kerasmp's and no more often than the same fit under stock Keras
(`kerasmp.uninstall()`, Keras's own mixed_float16 and LossScaleOptimizer).
"""

import functools
import logging
import re

import keras
import numpy as np
import pytest

import kerasmp

pytestmark = [pytest.mark.torch, pytest.mark.torch_jit]

if keras.backend.backend() != "torch":
    pytest.skip("torch.compile: PyTorch only", allow_module_level=True)

import torch  # noqa: E402

_KERASMP_DIR = kerasmp.__file__.rsplit("/", 1)[0]


class _Recompiles(logging.Handler):
    """Dynamo's "Recompiling function ..." records (TORCH_LOGS=recompiles)."""

    def __init__(self):
        super().__init__()
        self.records = []

    def emit(self, record):
        message = record.getMessage()
        if "Recompiling function" in message:
            self.records.append(message)


def _model():
    keras.utils.set_random_seed(0)
    tokens = keras.Input((8,), dtype="int32")
    x = keras.layers.Embedding(20, 8)(tokens)
    x = keras.layers.LayerNormalization()(
        x + keras.layers.MultiHeadAttention(1, 4)(x, x)
    )
    x = keras.layers.GlobalAveragePooling1D()(x)
    outputs = keras.layers.Dense(3, activation="softmax")(x)
    return keras.Model(tokens, outputs)


def _jit_fit_recompiles(monkeypatch):
    """The recompiles of a fresh Dynamo during each of two jit epochs of 3
    steps. Dynamo's "eager" backend: the guards and recompiles are Dynamo's
    (Inductor would only add its compile time)."""
    rng = np.random.default_rng(0)
    x = rng.integers(0, 20, (12, 8)).astype("int32")
    y = rng.integers(0, 3, (12,))
    model = _model()
    model.compile("adam", "sparse_categorical_crossentropy",
                  jit_compile=True)
    monkeypatch.setattr(
        torch, "compile", functools.partial(torch.compile, backend="eager")
    )
    torch._dynamo.reset()
    handler = _Recompiles()
    logger = logging.getLogger("torch._dynamo")
    torch._logging.set_logs(recompiles=True)
    logger.addHandler(handler)
    epochs = []
    try:
        for _ in range(2):
            model.fit(x, y, batch_size=4, epochs=1, verbose=0)
            epochs.append(handler.records[len(sum(epochs, [])):])
    finally:
        logger.removeHandler(handler)
        torch._logging.set_logs()
        torch._dynamo.reset()
    return epochs


def _stock_recompiles(monkeypatch):
    kerasmp.uninstall()
    try:
        keras.config.set_dtype_policy("mixed_float16")
        return _jit_fit_recompiles(monkeypatch)
    finally:
        keras.config.set_dtype_policy("float32")
        kerasmp.install()


def _frames(records):
    return [re.search(r"Recompiling function (\S+ in \S+)", r).group(1)
            for r in records]


def test_jit_fit_recompiles_nothing_of_kerasmp(mixed_policy, monkeypatch):
    stock = _stock_recompiles(monkeypatch)
    ours = _jit_fit_recompiles(monkeypatch)
    for r in ours[0] + ours[1]:
        assert _KERASMP_DIR not in r, r
    # No guard fails from step to step: the second epoch recompiles nothing.
    assert not ours[1], _frames(ours[1])
    assert len(ours[0]) <= len(stock[0] + stock[1]), (
        f"{len(ours[0])} recompiles under kerasmp, "
        f"{len(stock[0] + stock[1])} under stock Keras; kerasmp's frames: "
        f"{sorted(set(_frames(ours[0])))}, stock's: "
        f"{sorted(set(_frames(stock[0] + stock[1])))}"
    )


def _compiled_dtype_reads(layers):
    """The recompile records of one compiled function that reads each of
    `layers`' compute dtype in turn, as Keras's per-layer `forward` frame
    does (`Layer.__call__` reads it through `quantization_mode`)."""

    def read(layer, x):
        return x.to(getattr(torch, layer.compute_dtype)) * 2

    compiled = torch.compile(read, backend="eager")
    torch._dynamo.reset()
    handler = _Recompiles()
    logger = logging.getLogger("torch._dynamo")
    torch._logging.set_logs(recompiles=True)
    logger.addHandler(handler)
    try:
        for layer in layers:
            compiled(layer, torch.ones(2))
    finally:
        logger.removeHandler(handler)
        torch._logging.set_logs()
        torch._dynamo.reset()
    return handler.records


def test_two_layers_of_a_class_share_a_compiled_dtype_read(mixed_policy):
    # Under stock Keras a frame compiled for one LayerNormalization serves
    # every other one called the same way: their dtype reads return the
    # same policy object. kerasmp's resolution must not tell them apart
    # either (it once read the layer's name there, and Dynamo guarded on
    # it: one recompile per layer, each record naming a kerasmp file).
    norms = [keras.layers.LayerNormalization(name=f"norm_{i}")
             for i in range(3)]
    denses = [keras.layers.Dense(2, activation="gelu") for _ in range(3)]
    for layer in norms + denses:
        layer.build((2, 2))
    assert {n.compute_dtype for n in norms} == {"float32"}
    assert {d.compute_dtype for d in denses} == {"float16"}
    assert _compiled_dtype_reads(norms) == []
    assert _compiled_dtype_reads(denses) == []


_GRAPHS_CHILD = r"""
import json, os, sys
import numpy as np
if sys.argv[1] == "kerasmp":
    import kerasmp
    kerasmp.set_global_policy(kerasmp.Policy(sys.argv[2]))
import keras
if sys.argv[1] == "stock":
    assert "kerasmp" not in sys.modules
    keras.config.set_dtype_policy(sys.argv[2])
import torch
from torch._dynamo.utils import counters

keras.utils.set_random_seed(0)
tokens = keras.Input((8,), dtype="int32")
x = keras.layers.Embedding(20, 8)(tokens)
x = keras.layers.LayerNormalization()(
    x + keras.layers.MultiHeadAttention(1, 4)(x, x))
x = keras.layers.GlobalAveragePooling1D()(x)
model = keras.Model(tokens, keras.layers.Dense(3, activation="softmax")(x))
model.compile("adam", "sparse_categorical_crossentropy", jit_compile=True)
_compile = torch.compile
torch.compile = lambda f, **kw: _compile(f, backend="eager", **kw)
rng = np.random.default_rng(0)
data = (rng.integers(0, 20, (8, 8)).astype("int32"),
        rng.integers(0, 3, (8,)))
model.fit(*data, batch_size=4, epochs=1, verbose=0)
print(json.dumps({
    "graph_breaks": sum(counters["graph_break"].values()),
    "unique_graphs": counters["stats"]["unique_graphs"],
}))
"""


def _graphs(library, policy):
    """Dynamo's graph breaks and unique graphs over one jit epoch of the
    test model, in a fresh process (`stock`: kerasmp never imported)."""
    import json
    import os
    import subprocess
    import sys

    root = os.path.dirname(_KERASMP_DIR)
    env = dict(os.environ, KERAS_BACKEND="torch", TF_CPP_MIN_LOG_LEVEL="3",
               PYTHONPATH=os.pathsep.join(
                   [root] + [p for p in [os.environ.get("PYTHONPATH")] if p]))
    done = subprocess.run(
        [sys.executable, "-c", _GRAPHS_CHILD, library, policy], env=env,
        capture_output=True, text=True, timeout=600, check=False,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


# kerasmp's own step work, around Keras's step in the compiled top frame:
# the copies its record compares with (`torch.clone`, before) and the
# record's `any` (after), found from the graphs' source lines.
_OWN_GRAPHS = 2


@pytest.mark.slow
def test_jit_step_adds_no_graph_break_over_stock():
    """kerasmp's train step is compiled as deep as stock Keras's: on the
    same model under float32, no graph break more than stock Keras, and no
    graph more than stock's plus kerasmp's own two (before: 21 breaks
    against stock's 18; each wrapper frame around Keras's step was one more
    break, frame and resume frame, entered at every step)."""
    stock = _graphs("stock", "float32")
    ours = _graphs("kerasmp", "float32")
    assert ours["graph_breaks"] <= stock["graph_breaks"], (ours, stock)
    assert ours["unique_graphs"] <= stock["unique_graphs"] + _OWN_GRAPHS, (
        ours, stock)
