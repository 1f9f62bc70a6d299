"""kerasmp.apps.zoo: the models the demo and the benchmark train."""

import keras
import numpy as np

from kerasmp.apps import zoo
from kerasmp.policy import Policy
from kerasmp.policy import policy_scope


def test_digits_cnn_keeps_batch_norm_and_softmax_in_float32():
    with policy_scope(Policy("mixed_float16")):
        model = zoo.digits_cnn()
    assert model.name == "digits_cnn" and model.output_shape == (None, 10)
    dtypes = {layer.name: layer.compute_dtype for layer in model.layers}
    assert dtypes["conv1"] == dtypes["dense"] == "float16"
    assert dtypes["bn"] == dtypes["softmax"] == "float32"


def test_bench_models_match_their_specs():
    specs = [zoo.ModelSpec("mlp", 4, 8, 2, 6),
             zoo.ModelSpec("cnn", 4, 4, 2, 8),
             zoo.ModelSpec("transformer", 4, 8, 1, 5, heads=2, vocab=11)]
    for spec in specs:
        model = zoo.build_model(spec)
        x, y = zoo.make_data(spec, 3)
        assert len(x) == len(y) == 3
        assert y.min() >= 0 and y.max() < zoo.NUM_CLASSES
        probs = keras.ops.convert_to_numpy(model(x))
        assert probs.shape == (3, zoo.NUM_CLASSES)
        np.testing.assert_allclose(probs.sum(-1), 1.0, rtol=1e-5)
    # MLP 6-8-8-10: (6*8 + 8) + (8*8 + 8) + (8*10 + 10) parameters.
    assert zoo.build_model(specs[0]).count_params() == 56 + 72 + 90
    assert zoo.make_data(specs[2], 3)[0].max() < 11
