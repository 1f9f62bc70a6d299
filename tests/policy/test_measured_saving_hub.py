"""keras-hub's MoE backbones (tiny, TensorFlow): the routers `compile`'s
measurement moves to float32 reload in float32 with kerasmp, from the
start; without kerasmp the file loads compiled and trains, with the router
in float16: stock Keras cannot compute it as kerasmp does there
(`kerasmp.policy.measure._portable`). The nested RMS norms can: they
reload in float32 without kerasmp too."""

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

keras_hub = keras_hub_or_skip()

pytestmark = [pytest.mark.tensorflow, pytest.mark.slow]

MODELS = {
    "gpt_oss": ("GptOssBackbone", 10, dict(
        vocabulary_size=10, num_layers=2, num_query_heads=8,
        num_key_value_heads=4, hidden_dim=16, intermediate_dim=8,
        num_experts=2, top_k=2, sliding_window=2)),
    "qwen3_moe": ("Qwen3MoeBackbone", 20, dict(
        vocabulary_size=20, num_layers=2, num_query_heads=4,
        num_key_value_heads=2, hidden_dim=16, intermediate_dim=32,
        head_dim=2, moe_intermediate_dim=16, num_experts=4, top_k=2,
        norm_top_k_prob=True, decoder_sparse_step=1,
        layer_norm_epsilon=1e-6, rope_max_wavelength=10000,
        rope_scaling_factor=1.0, dropout=0.0, sliding_window_size=4096,
        router_aux_loss_coefficient=0.01, tie_word_embeddings=False,
        mlp_only_layers=[])),
}

_LOAD = """
import json
import numpy as np
import keras
import keras_hub  # noqa: F401
if {with_kerasmp}:
    import kerasmp  # noqa: F401
x = dict(np.load({x!r}))
model = keras.saving.load_model({path!r}, compile=not {with_kerasmp})
# Before any call (kerasmp measures a model again at its first call).
moved = {{l.path: l.compute_dtype for l in model._flatten_layers()
         if l.path in {moved!r}}}
preds = model.predict(x, verbose=0)
np.save({preds!r}, preds)
if not {with_kerasmp} and {train}:
    model.fit(x, np.zeros_like(preds), verbose=0)
optimizer = type(getattr(model, "optimizer", None)).__name__
print(json.dumps({{"optimizer": optimizer, "moved": moved}}))
"""


def _load(with_kerasmp, tmp_path, **kwargs):
    script = _LOAD.format(with_kerasmp=with_kerasmp, **kwargs)
    out = subprocess.run(
        [sys.executable, "-c", script if with_kerasmp else
         BLOCK_KERASMP + script],
        capture_output=True, text=True,
        env={**os.environ, "TF_CPP_MIN_LOG_LEVEL": "3"})
    assert out.returncode == 0, out.stderr[-3000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


@pytest.mark.parametrize("name", list(MODELS))
def test_measured_moves_survive_a_reload(name, tmp_path):
    cls, vocabulary, kwargs = MODELS[name]
    keras.utils.set_random_seed(0)
    with kerasmp.policy_scope(kerasmp.Policy("mixed_float16")):
        model = getattr(keras_hub.models, cls)(**kwargs)
    rng = np.random.default_rng(0)
    x = {"token_ids": rng.integers(0, vocabulary, (4, 5)).astype("int32"),
         "padding_mask": np.ones((4, 5), "int32")}
    model.compile("adam", "mse")
    measured = kerasmp.stored_policy(model).measured
    moved = {path for path, entry in measured.items() if "rule" in entry}
    # The MoE blocks' moves, and the nested RMS norms kerasmp's rules keep
    # in float32, which stock Keras can compute as kerasmp does.
    norms = {p for p in moved if "moe" not in p}
    assert moved - norms and all("moe" in p for p in measured
                                 if p not in norms)
    assert norms and all(p.endswith("layernorm") and
                         measured[p]["portable"] for p in norms)
    # Sublayers of a moved layer that kept the half policy (Qwen3-MoE's
    # experts) keep it after the reload.
    expected = {path: "float16" if "half" in entry else "float32"
                for path, entry in measured.items()}
    model.fit(x, np.zeros((4, 5, 16), "float32"), verbose=0)
    preds = model.predict(x, verbose=0)
    path = str(tmp_path / "model.keras")
    model.save(path)
    np.savez(tmp_path / "x.npz", **x)
    # A fresh process, as a user's: layers named automatically
    # (`qwen3_sparse_moe_block_1`) get the names they had only where the
    # process built nothing before (see docs/policies.md).
    args = dict(x=str(tmp_path / "x.npz"), path=path, moved=sorted(measured),
                preds=str(tmp_path / "preds.npy"))
    row = _load(True, tmp_path, train=False, **args)
    assert row["moved"] == expected
    np.testing.assert_array_equal(np.load(tmp_path / "preds.npy"), preds)
    # Stock Keras cannot train Qwen3-MoE under mixed_float16 at all (its
    # router's auxiliary loss multiplies float16 by float32): predict only.
    row = _load(False, tmp_path, train=name != "qwen3_moe", **args)
    assert row["optimizer"] == "LossScaleOptimizer"
    assert np.isfinite(np.load(tmp_path / "preds.npy")).all()
    # Not expressible in stock Keras (no hand-back): the router's float32
    # outputs meet float16 ones in its block's own arithmetic. The norms
    # are, and reload in float32 (issue 44, item 4).
    assert {p: d for p, d in row["moved"].items() if p not in norms} == {
        p: "float16" for p in measured if p not in norms}
    assert {row["moved"][p] for p in norms} == {"float32"}
