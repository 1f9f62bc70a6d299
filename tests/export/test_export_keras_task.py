"""A keras-hub task saved with its preprocessor exports to `.keras` (issue
44 item 2): a `GPT2CausalLM` with its `GPT2CausalLMPreprocessor`, trained
under kerasmp and saved, is written in float16 with its preprocessor: the
tokenizer keeps its int32 policy and its vocabulary, the preprocessor is
float32, and the file loads with plain Keras and keras-hub.

The export used to give the int32 tokenizer a float32 `DTypePolicyMap`
(`TypeError: unhashable type: 'DTypePolicyMap'`), and, without the
preprocessor, wrote every backbone layer in float32 (the task's config
nests its backbone's, which the export did not rewrite).

Reference: the float32 task holding the same weights, run on the token ids
the original preprocessor makes; the file read back by stock
`keras.saving.load_model` in a process where kerasmp cannot be imported.
"""

import json
import subprocess
import sys

import keras
import numpy as np
import pytest
from _helpers import BLOCK_KERASMP
from _helpers import slow_on
from _helpers import subprocess_env
from _models import tiny_gpt2_task

from kerasmp import export as kx
from kerasmp.export import DEFAULT_MAX_REL_DIFF
from kerasmp.policy import Policy
from kerasmp.policy import policy_scope

pytestmark = pytest.mark.torch

TEXTS = ["a ab b", "b a ab a", "ab"]

LOAD_TASK = BLOCK_KERASMP + """
import keras, keras_hub, numpy as np
model = keras.saving.load_model(sys.argv[1], compile=False)
pre = model.preprocessor
x = pre.generate_preprocess(json.loads(sys.argv[2]))
x = {k: keras.ops.convert_to_numpy(v) for k, v in x.items()}
y = keras.ops.convert_to_numpy(model(x, training=False))
print("RESULT " + json.dumps({
    "token_ids": x["token_ids"].tolist(),
    "tokenizer": [pre.tokenizer.dtype_policy.name, pre.tokenizer.dtype],
    "preprocessor": pre.dtype_policy.name,
    "backbone": model.backbone.get_layer("token_embedding").compute_dtype,
    "y_dtype": str(y.dtype), "y": y.astype("float64").tolist()}))
"""


def _task_and_float32_twin(tmp_path):
    """`(loaded, reference)`: the task built under `kerasmp.Policy(
    "mixed_float16")`, saved and loaded back as a user exports it, and the
    float32 task holding the same weights."""
    keras.utils.set_random_seed(0)
    with policy_scope(Policy("mixed_float16")):
        model = tiny_gpt2_task()
    with policy_scope("float32"):
        reference = tiny_gpt2_task()
    reference.set_weights(model.get_weights())
    saved = tmp_path / "gpt2.keras"
    model.save(saved)
    return keras.saving.load_model(saved, compile=False), reference


@slow_on("jax")  # 80 s on JAX, 20 s on TensorFlow, 35 s on PyTorch
def test_a_keras_hub_task_with_its_preprocessor_exports_to_keras(tmp_path):
    loaded, reference = _task_and_float32_twin(tmp_path)
    path = tmp_path / "gpt2-16.keras"
    report = kx.export(loaded, str(path), format="keras", gate=True)
    # Half precision indeed: the backbone's config was rewritten.
    assert report.weight_ratio <= 0.55
    assert any(k.endswith("layer_norm") for k in report.kept_float32)
    backend = keras.backend.backend()
    proc = subprocess.run(
        [sys.executable, "-c", LOAD_TASK, str(path), json.dumps(TEXTS)],
        capture_output=True, text=True, env=subprocess_env(backend),
        timeout=300)
    lines = [l for l in proc.stdout.splitlines() if l.startswith("RESULT ")]
    assert proc.returncode == 0 and lines, proc.stderr[-3000:]
    out = json.loads(lines[-1][len("RESULT "):])
    assert out["tokenizer"] == ["int32", "int32"]
    assert out["preprocessor"] == "float32"
    assert out["backbone"] == "float16" and out["y_dtype"] == "float16"
    x = reference.preprocessor.generate_preprocess(TEXTS)
    x = {k: keras.ops.convert_to_numpy(v) for k, v in x.items()}
    assert out["token_ids"] == x["token_ids"].tolist()  # the vocabulary
    want = keras.ops.convert_to_numpy(reference(x, training=False))
    got = np.asarray(out["y"])
    rel = np.max(np.abs(got - want)) / np.ptp(want)
    assert rel <= DEFAULT_MAX_REL_DIFF["float16"], rel
