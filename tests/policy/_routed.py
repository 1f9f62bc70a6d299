"""A tiny mixture-of-experts block whose router `compile`'s measurement
moves to float32; importable without kerasmp (the "loads without kerasmp"
scripts import it), registered under the package "kerasmp_tests"."""

import keras
from keras import ops


@keras.saving.register_keras_serializable(package="kerasmp_tests")
class Router(keras.layers.Layer):
    """Scores the experts and keeps the two best (calls `top_k`)."""

    def __init__(self, experts, **kwargs):
        super().__init__(**kwargs)
        self.experts = experts

    def build(self, shape):
        self.scores = keras.layers.Dense(self.experts, name="scores",
                                         dtype=self.dtype_policy)
        self.scores.build(shape)

    def call(self, x):
        logits = self.scores(x)
        kept, _ = ops.top_k(logits, k=2)
        gates = ops.where(logits >= kept[..., -1:], logits, -1e4)
        return ops.softmax(gates)

    def get_config(self):
        return {**super().get_config(), "experts": self.experts}


@keras.saving.register_keras_serializable(package="kerasmp_tests")
class MoE(keras.layers.Layer):
    """Experts weighted by the router's gates. With `cast`, the block casts
    the gates to its compute dtype before using them (Qwen3-MoE's decoder
    does so with its block's output); without, its own arithmetic mixes
    them with the experts' outputs (GPT-OSS's block)."""

    def __init__(self, units, experts, cast, **kwargs):
        super().__init__(**kwargs)
        self.units, self.experts, self.cast = units, experts, cast

    def build(self, shape):
        self.router = Router(self.experts, name="router",
                             dtype=self.dtype_policy)
        self.router.build(shape)
        self.expert = keras.layers.Dense(self.units * self.experts,
                                         name="expert",
                                         dtype=self.dtype_policy)
        self.expert.build(shape)

    def call(self, x):
        gates = self.router(x)
        if self.cast:
            gates = ops.cast(gates, self.compute_dtype)
        out = ops.reshape(self.expert(x), (-1, self.experts, self.units))
        return ops.sum(out * gates[..., None], axis=1)

    def get_config(self):
        return {**super().get_config(), "units": self.units,
                "experts": self.experts, "cast": self.cast}
