"""Nested float32 layers reach plain Keras (issue 44, item 4).

keras-hub creates a decoder block's RMS norms in the block's own code,
with the block's policy: stock Keras's `from_config` never reads the norm's
own saved dtype. kerasmp's `compile` records the nested layers its rules
keep in float32 that stock Keras computes as kerasmp does
(`kerasmp.policy.measure._record`), and the saved file carries them in
Keras's own `DTypePolicyMap`, keyed by layer path: a process without
kerasmp computes them in float32 too. The reference is kerasmp's own run
of the same weights: the same dtype in every layer, the same predictions.
"""

import json
import os
import subprocess
import sys

import keras
import numpy as np
import pytest
from _helpers import BLOCK_KERASMP
from _helpers import keras_hub_or_skip

import kerasmp
from kerasmp.policy.measure import _passing

pytestmark = pytest.mark.torch

keras_hub = keras_hub_or_skip()

_LLAMA = dict(vocabulary_size=10, num_layers=2, num_query_heads=4,
              num_key_value_heads=2, hidden_dim=8, intermediate_dim=8)

_LOAD = BLOCK_KERASMP + """
import json
import numpy as np
import keras
import keras_hub  # noqa: F401
model = keras.saving.load_model({path!r})
x = dict(np.load({x!r}))
if {run}:
    np.save({preds!r}, model.predict(x, verbose=0))
dtypes = {{l.path: l.compute_dtype for l in model._flatten_layers()
          if l.path and not list(l._flatten_layers(include_self=False))}}
print("RESULT " + json.dumps(dtypes))
"""


def _leaf_dtypes(model):
    return {layer.path: layer.compute_dtype
            for layer in model._flatten_layers()
            if layer.path and not list(layer._flatten_layers(
                include_self=False))}


def test_a_compiled_llama_reloads_with_its_float32_norms_without_kerasmp(
        tmp_path):
    keras.utils.set_random_seed(0)
    with kerasmp.policy_scope("mixed_float16"):
        model = keras_hub.models.LlamaBackbone(**_LLAMA)
    model.compile("adam", "mse")
    rng = np.random.default_rng(0)
    x = {"token_ids": rng.integers(0, 10, (4, 5)).astype("int32"),
         "padding_mask": np.ones((4, 5), "int32")}
    preds = model.predict(x, verbose=0)
    kerasmp_dtypes = _leaf_dtypes(model)
    norms = sorted(p for p in kerasmp_dtypes if p.endswith("layernorm"))
    # Four nested RMS norms and the final one, in float32 under kerasmp.
    assert len(norms) == 5
    assert {kerasmp_dtypes[p] for p in norms} == {"float32"}
    path = str(tmp_path / "llama.keras")
    model.save(path)
    np.savez(tmp_path / "x.npz", **x)

    # Stock Keras on JAX's CPU cannot run a float16 Llama's attention
    # (XLA: "The precision 'F16_F16_F32' is not supported by dot_general on
    # CPU"; kerasmp reroutes it): there the dtypes are compared, not the
    # predictions.
    run = keras.backend.backend() != "jax"
    script = _LOAD.format(path=path, x=str(tmp_path / "x.npz"), run=run,
                          preds=str(tmp_path / "preds.npy"))
    out = subprocess.run([sys.executable, "-c", script], capture_output=True,
                         text=True, timeout=300,
                         env={**os.environ, "TF_CPP_MIN_LOG_LEVEL": "3"})
    lines = [ln for ln in out.stdout.splitlines() if ln.startswith("RESULT ")]
    assert out.returncode == 0 and lines, out.stderr[-3000:]
    plain = json.loads(lines[-1][len("RESULT "):])
    # Every layer computes in the dtype kerasmp computed it in (the norms
    # in float32, the attention and MLP in float16), so the predictions are
    # kerasmp's: a float16 norm would be ~1e-3 off.
    assert plain == kerasmp_dtypes
    if run:
        np.testing.assert_allclose(np.load(tmp_path / "preds.npy"), preds,
                                   rtol=0, atol=1e-6)


def test_passing_keeps_every_group_that_passes_with_the_others():
    """`_passing`'s halving against a predicate with a group that never
    passes (a router that cannot move) and two groups that pass alone but
    not together: what it keeps always passes as a whole."""
    groups = [[f"norm_{i}"] for i in range(9)] + [["router", "router/dense"]]
    calls = []

    def passes(paths):
        calls.append(list(paths))
        return "router" not in paths

    kept = _passing(groups, passes)
    assert kept == [f"norm_{i}" for i in range(9)]
    assert len(calls) < len(groups) + 2  # halving, not one run per group

    def exclusive(paths):
        return "router" not in paths and not (
            "norm_0" in paths and "norm_8" in paths)

    kept = _passing(groups, exclusive)
    assert exclusive(kept) and "norm_0" in kept and "norm_8" not in kept
    assert len(kept) == 8
    assert _passing(groups[:3], lambda paths: False) == []
