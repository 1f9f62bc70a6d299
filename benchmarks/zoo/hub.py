"""A tiny config for every backbone keras-hub 0.32 ships.

The numbers are those of keras-hub's own backbone tests
(`keras_hub/src/models/<family>/<family>_backbone_test.py`, `setUp`:
`init_kwargs` and `input_data`, read at keras-hub commit 71453d08, the
fetched mirror), copied as they are, with these changes for every model:

- token ids are drawn uniformly from the vocabulary (the tests feed
  `ones`: every token the same, which makes parity trivial); padding masks,
  images, audio and other inputs keep the tests' shapes, masks their
  values (T5, BART and EdRec feed fully padded encoder rows: kept), float
  inputs are uniform draws in [0, 1) where the tests use ones;
- the `"dtype": "float32"` pins of the MoE backbones (Qwen3-MoE, Qwen-MoE,
  Qwen3.5-MoE: "Explicitly set dtype to avoid mixed precision") and of
  BLIP2's sub-encoders are dropped: the census sees what a user sees;
- where a test builds several variants, the one its `init_kwargs` names
  (the multimodal one where there is one) is used; `ZooModel.note` says
  what else changed.

`BACKBONES` lists every `keras_hub.models.*Backbone` name; `NO_CONFIG` the
ones without a row, and why; `HUB` the rows. RQVAE and VAE have backbone
tests but are not exported in `keras_hub.models`: they are extra rows.
"""

import numpy as np

from zoo.spec import ZooModel
from zoo.spec import normal
from zoo.spec import ones
from zoo.spec import rows
from zoo.spec import tokens
from zoo.spec import uniform
from zoo.spec import zeros

SOURCE = "keras-hub"
TEST = "keras_hub/src/models/{}/{}_backbone_test.py"

# keras_hub.models names that are the same class as another row, or no
# model of their own.
ALIASES = {
    "ESMBackbone": "ESM2Backbone",
    "QwenBackbone": "Qwen2Backbone",
    "SmolLMBackbone": "SmolLM3Backbone",
}
NO_CONFIG = {
    "FeaturePyramidBackbone": "an abstract base class (ResNet, CSPNet, "
                              "DINOv2... subclass it); not a model",
    **{name: f"the same class as {target}" for name, target in
       ALIASES.items()},
}

HUB = {}


def _hub(name, family, kwargs_or_builder, inputs, output=None, note="",
         fast=False, test=None):
    """Registers the row of `keras_hub.models.<name>`."""

    def build():
        import keras_hub

        cls = getattr(keras_hub.models, name, None)
        if callable(kwargs_or_builder):
            return kwargs_or_builder()
        return cls(**kwargs_or_builder)

    HUB[name] = ZooModel(
        name=name, source=SOURCE, build=build, inputs=inputs, output=output,
        config=test or TEST.format(family, family), note=note, fast=fast)


def _src(module, name):
    """A keras-hub class that `keras_hub.models` does not export."""
    import importlib

    return getattr(importlib.import_module(
        f"keras_hub.src.models.{module}"), name)


def _tok_mask(length, vocabulary, mask="padding_mask", value=1):
    out = {"token_ids": tokens(length, vocabulary)}
    if mask:
        out[mask] = (ones if value else zeros)(length)
    return out


# --------------------------------------------------------------------------
# Encoders and decoders of text
# --------------------------------------------------------------------------

_BERTLIKE = dict(vocabulary_size=10, num_layers=2, num_heads=2,
                 hidden_dim=2, intermediate_dim=4, max_sequence_length=5)

_hub("AlbertBackbone", "albert", dict(
    vocabulary_size=10, num_layers=2, num_heads=2, num_groups=1,
    num_inner_repetitions=1, embedding_dim=16, hidden_dim=2,
    intermediate_dim=4, max_sequence_length=5),
    {**_tok_mask(5, 10), "segment_ids": zeros(5)})
_hub("BartBackbone", "bart", _BERTLIKE, {
    "encoder_token_ids": tokens(3, 10), "encoder_padding_mask": zeros(3),
    "decoder_token_ids": tokens(5, 10), "decoder_padding_mask": zeros(5)},
    output="decoder_sequence_output")
_hub("BertBackbone", "bert", _BERTLIKE,
     {**_tok_mask(5, 10), "segment_ids": zeros(5)}, fast=True)
_hub("BloomBackbone", "bloom", dict(
    vocabulary_size=10, num_layers=2, num_heads=4, hidden_dim=8,
    intermediate_dim=32), _tok_mask(5, 10))
_hub("DebertaV3Backbone", "deberta_v3", _BERTLIKE, _tok_mask(5, 10))
_hub("DistilBertBackbone", "distil_bert", _BERTLIKE, _tok_mask(5, 10))
_hub("EdRecBackbone", "edrec", dict(
    vocab_size=10, num_layers_enc=2, num_layers_dec=2, num_heads=2,
    hidden_dim=4, intermediate_dim=8, dropout=0.0), {
    "encoder_token_ids": tokens(5, 10), "encoder_padding_mask": zeros(5),
    "decoder_token_ids": tokens(5, 10), "decoder_padding_mask": zeros(5)},
    output="decoder_sequence_output")
_hub("ElectraBackbone", "electra", dict(
    vocab_size=10, num_layers=2, num_heads=2, hidden_dim=2,
    embedding_dim=2, intermediate_dim=4, max_sequence_length=5),
    {**_tok_mask(5, 10), "segment_ids": zeros(5)})
_hub("ESM2Backbone", "esm", dict(
    vocabulary_size=10, num_layers=2, num_heads=1, hidden_dim=2,
    intermediate_dim=4), {"token_ids": tokens(5, 10)})
_hub("FalconBackbone", "falcon", dict(
    vocabulary_size=10, num_layers=2, num_attention_heads=8, hidden_dim=16,
    intermediate_dim=32), _tok_mask(5, 10))
_hub("FNetBackbone", "f_net", dict(
    vocabulary_size=10, num_layers=2, hidden_dim=8, intermediate_dim=16,
    max_sequence_length=5),
    {"token_ids": tokens(5, 10), "segment_ids": zeros(5)}, test=TEST.format(
        "f_net", "f_net"),
    note="hidden_dim 8 where the test has 2: a LayerNormalization over 2 "
         "features outputs +-1, where no parity figure means anything")
_hub("GemmaBackbone", "gemma", dict(
    vocabulary_size=20, num_layers=2, num_query_heads=4,
    num_key_value_heads=1, hidden_dim=16, intermediate_dim=32, head_dim=4,
    layer_norm_epsilon=1e-6), _tok_mask(5, 20), fast=True)
_hub("GPT2Backbone", "gpt2", _BERTLIKE, _tok_mask(5, 10))
_hub("GPTNeoXBackbone", "gpt_neo_x", _BERTLIKE, _tok_mask(5, 10))
_hub("GptOssBackbone", "gpt_oss", dict(
    vocabulary_size=10, num_layers=2, num_query_heads=8,
    num_key_value_heads=4, hidden_dim=16, intermediate_dim=8, num_experts=2,
    top_k=2, sliding_window=2), _tok_mask(5, 10))
_LLAMA = dict(vocabulary_size=10, num_layers=2, num_query_heads=4,
              num_key_value_heads=2, hidden_dim=8, intermediate_dim=8)
_hub("LlamaBackbone", "llama", _LLAMA, _tok_mask(5, 10))
_hub("Llama3Backbone", "llama", _LLAMA, _tok_mask(5, 10),
     note="keras-hub has no Llama3 backbone test; Llama3Backbone subclasses "
          "LlamaBackbone with the same arguments: Llama's config")
_hub("MistralBackbone", "mistral", dict(
    vocabulary_size=10, num_layers=2, num_query_heads=8,
    num_key_value_heads=4, hidden_dim=16, intermediate_dim=8,
    sliding_window=2), _tok_mask(5, 10))
_hub("MixtralBackbone", "mixtral", dict(
    vocabulary_size=10, num_layers=2, num_query_heads=8,
    num_key_value_heads=4, hidden_dim=16, intermediate_dim=8, num_experts=2,
    top_k=2, sliding_window=2), _tok_mask(5, 10))
_hub("MoonshineBackbone", "moonshine", dict(
    vocabulary_size=10000, filter_dim=64, encoder_num_layers=2,
    decoder_num_layers=2, hidden_dim=64, intermediate_dim=512,
    encoder_num_heads=8, decoder_num_heads=8,
    feedforward_expansion_factor=4, encoder_use_swiglu_activation=False,
    decoder_use_swiglu_activation=True, max_position_embeddings=2048,
    pad_head_dim_to_multiple_of=None, partial_rotary_factor=0.62,
    dropout=0.0, initializer_range=0.02, rope_theta=10000.0,
    attention_bias=False, attention_dropout=0.0), {
    "encoder_input_values": uniform(16000, 1),
    "decoder_token_ids": tokens(10, 10000),
    "encoder_padding_mask": ones(16000, dtype="bool"),
    "decoder_padding_mask": ones(10, dtype="bool")},
    output="decoder_sequence_output")
_hub("OPTBackbone", "opt", _BERTLIKE, _tok_mask(5, 10))
_hub("Phi3Backbone", "phi3", dict(
    vocabulary_size=10, num_layers=2, num_query_heads=4,
    num_key_value_heads=2, hidden_dim=8, intermediate_dim=8),
    _tok_mask(5, 10))
_hub("Qwen2Backbone", "qwen", dict(
    vocabulary_size=10, num_layers=2, num_query_heads=4,
    num_key_value_heads=2, hidden_dim=8, intermediate_dim=8),
    _tok_mask(5, 10), test="(none)",
    note="keras-hub has no Qwen (Qwen2) backbone test: Qwen3's numbers less "
         "head_dim, which Qwen2Backbone does not take")
_hub("Qwen3Backbone", "qwen3", dict(
    vocabulary_size=10, num_layers=2, num_query_heads=4,
    num_key_value_heads=2, head_dim=2, hidden_dim=8, intermediate_dim=8),
    _tok_mask(5, 10))
_LINEAR_ATTENTION = dict(
    layer_types=["linear_attention", "linear_attention",
                 "linear_attention", "full_attention"],
    partial_rotary_factor=0.25, linear_num_key_heads=2,
    linear_num_value_heads=4, linear_key_head_dim=4, linear_value_head_dim=4,
    linear_conv_kernel_dim=4)
_hub("Qwen3_5Backbone", "qwen3_5", dict(
    vocabulary_size=10, num_layers=4, num_query_heads=4,
    num_key_value_heads=2, head_dim=8, hidden_dim=16, intermediate_dim=32,
    **_LINEAR_ATTENTION), _tok_mask(5, 10))
_hub("Qwen3_5MoeBackbone", "qwen3_5_moe", dict(
    vocabulary_size=10, num_layers=4, num_query_heads=4,
    num_key_value_heads=2, head_dim=8, hidden_dim=16,
    moe_intermediate_dim=8, shared_expert_intermediate_size=8,
    num_experts=4, top_k=2, router_aux_loss_coefficient=0.01,
    **_LINEAR_ATTENTION), _tok_mask(5, 10),
    note='the test\'s "dtype": "float32" pin dropped')
_hub("Qwen3MoeBackbone", "qwen3_moe", dict(
    vocabulary_size=20, num_layers=2, num_query_heads=4,
    num_key_value_heads=2, hidden_dim=16, intermediate_dim=32, head_dim=2,
    moe_intermediate_dim=16, num_experts=4, top_k=2, norm_top_k_prob=True,
    decoder_sparse_step=1, layer_norm_epsilon=1e-6,
    rope_max_wavelength=10000, rope_scaling_factor=1.0, dropout=0.0,
    sliding_window_size=4096, router_aux_loss_coefficient=0.01,
    tie_word_embeddings=False, mlp_only_layers=[]), _tok_mask(7, 20),
    note='the test\'s "dtype": "float32" pin dropped', fast=True)
_hub("QwenMoeBackbone", "qwen_moe", dict(
    vocabulary_size=20, num_layers=2, num_query_heads=4,
    num_key_value_heads=2, hidden_dim=16, intermediate_dim=32,
    moe_intermediate_dim=16, shared_expert_intermediate_dim=32,
    num_experts=4, top_k=2, norm_top_k_prob=True, decoder_sparse_step=1,
    layer_norm_epsilon=1e-6, rope_max_wavelength=10000,
    rope_scaling_factor=1.0, dropout=0.0,
    use_sliding_window_attention=False, sliding_window_size=4096,
    router_aux_loss_coefficient=0.01, tie_word_embeddings=False,
    output_router_logits=False, mlp_only_layers=[]), _tok_mask(7, 20),
    note='the test\'s "dtype": "float32" pin dropped')
_hub("RobertaBackbone", "roberta", _BERTLIKE, _tok_mask(5, 10))
_hub("RoformerV2Backbone", "roformer_v2", dict(
    vocabulary_size=10, num_layers=2, num_heads=1, hidden_dim=2,
    intermediate_dim=4, head_size=2),
    {"token_ids": tokens(5, 10), "segment_ids": zeros(5)})
_hub("RWKV7Backbone", "rwkv7", dict(
    vocabulary_size=10, hidden_size=16, num_layers=2, head_size=4,
    intermediate_dim=32, gate_lora=32, mv_lora=16, aaa_lora=16,
    decay_lora=16), _tok_mask(16, 10))
_hub("SmolLM3Backbone", "smollm3", dict(
    vocabulary_size=100, hidden_dim=64, intermediate_dim=128, num_layers=2,
    num_attention_heads=4, num_key_value_heads=2, attention_bias=False,
    attention_dropout=0.0, rope_layer_enabled_list=[True, True],
    layer_types=["attention", "attention"], mlp_bias=False,
    layer_norm_epsilon=1e-5, max_position_embeddings=128,
    rope_theta=10000.0, partial_rotary_factor=1.0), _tok_mask(5, 100))
_hub("T5Backbone", "t5", dict(
    vocabulary_size=10, num_layers=2, num_heads=2, hidden_dim=2,
    intermediate_dim=4), {
    "encoder_token_ids": tokens(3, 10), "encoder_padding_mask": zeros(3),
    "decoder_token_ids": tokens(3, 10), "decoder_padding_mask": zeros(3)},
    output="decoder_sequence_output")
_T5GEMMA = dict(
    vocabulary_size=100, encoder_hidden_dim=32, encoder_intermediate_dim=64,
    encoder_num_layers=2, encoder_num_attention_heads=4,
    encoder_num_key_value_heads=2, encoder_head_dim=8,
    encoder_layer_types=["sliding_attention", "full_attention"],
    decoder_hidden_dim=32, decoder_intermediate_dim=64,
    decoder_num_layers=2, decoder_num_attention_heads=4,
    decoder_num_key_value_heads=2, decoder_head_dim=8,
    decoder_layer_types=["sliding_attention", "full_attention"],
    dropout_rate=0.1, rms_norm_eps=1e-6, tie_word_embeddings=True,
    query_pre_attn_scalar=1.0, attention_bias=False,
    hidden_activation="gelu_approximate", sliding_window=16,
    cross_attention_hidden_size=32, attn_logit_softcapping=50.0,
    rope_max_wavelength=10000.0, initializer_range=0.04,
    attention_dropout=0.1)
_ENC_DEC_16 = {
    "encoder_token_ids": tokens(16, 100), "encoder_padding_mask": ones(16),
    "decoder_token_ids": tokens(16, 100), "decoder_padding_mask": ones(16)}
_hub("T5GemmaBackbone", "t5gemma", _T5GEMMA, _ENC_DEC_16,
     output="decoder_sequence_output")
_hub("T5Gemma2Backbone", "t5gemma2", {**_T5GEMMA, "use_query_key_norm": True},
     _ENC_DEC_16, output="decoder_sequence_output")
_hub("WhisperBackbone", "whisper", dict(
    vocabulary_size=10, num_layers=2, num_heads=2, hidden_dim=2,
    intermediate_dim=4, max_encoder_sequence_length=6,
    max_decoder_sequence_length=6), {
    "encoder_features": uniform(5, 80),
    "decoder_token_ids": tokens(5, 10), "decoder_padding_mask": ones(5)},
    output="decoder_sequence_output")
_hub("XLMRobertaBackbone", "xlm_roberta", _BERTLIKE, _tok_mask(5, 10))
_hub("XLNetBackbone", "xlnet", dict(
    vocabulary_size=10, num_layers=2, num_heads=2, hidden_dim=2,
    intermediate_dim=4), {**_tok_mask(5, 10), "segment_ids": zeros(5)})


# --------------------------------------------------------------------------
# Images
# --------------------------------------------------------------------------


def _img(h, w=None, c=3):
    return uniform(h, w or h, c)


_hub("CSPNetBackbone", "cspnet", dict(
    stem_filters=32, stem_kernel_size=3, stem_strides=1,
    stackwise_strides=2, stackwise_depth=[1, 2, 8],
    stackwise_num_filters=[16, 24, 48], image_shape=(None, None, 3),
    down_growth=True, bottle_ratio=(0.5, 1.0), block_ratio=(1.0, 0.5),
    expand_ratio=(2.0, 1.0), block_type="dark_block", stage_type="csp",
    stem_padding="same"), _img(64))
_hub("DeiTBackbone", "deit", dict(
    image_shape=(28, 28, 3), patch_size=4, num_layers=3, hidden_dim=48,
    num_heads=6, intermediate_dim=48 * 4, use_mha_bias=True), _img(28))
_hub("DenseNetBackbone", "densenet", dict(
    stackwise_num_repeats=[2, 4, 6, 4], compression_ratio=0.5,
    growth_rate=2, image_shape=(32, 32, 3)), _img(32))
_DINOV2 = dict(patch_size=14, num_layers=2, hidden_dim=16, num_heads=2,
               intermediate_dim=16 * 4, layer_scale_init_value=1.0,
               num_register_tokens=0, use_swiglu_ffn=False,
               image_shape=(70, 70, 3), name="dinov2_backbone")
_hub("DINOV2Backbone", "dinov2", _DINOV2, {"images": _img(70)}, fast=True)
_hub("DINOV3Backbone", "dinov3", dict(
    patch_size=16, num_layers=2, hidden_dim=16, num_heads=2,
    intermediate_dim=16 * 4, layer_scale_init_value=1.0,
    num_register_tokens=4, use_gated_mlp=False, image_shape=(64, 64, 3),
    name="dinov3_backbone"), {"pixel_values": _img(64)})
_hub("EfficientNetBackbone", "efficientnet", dict(
    stackwise_kernel_sizes=[3, 3, 3, 3, 3, 3],
    stackwise_num_repeats=[2, 4, 4, 6, 9, 15],
    stackwise_input_filters=[24, 24, 48, 64, 128, 160],
    stackwise_output_filters=[24, 48, 64, 128, 160, 256],
    stackwise_expansion_ratios=[1, 4, 4, 4, 6, 6],
    stackwise_squeeze_and_excite_ratios=[0.0, 0.0, 0, 0.25, 0.25, 0.25],
    stackwise_strides=[1, 2, 2, 2, 1, 2],
    stackwise_block_types=["fused"] * 3 + ["unfused"] * 3,
    stackwise_force_input_filters=[0] * 6,
    stackwise_nores_option=[False] * 6, width_coefficient=1.0,
    depth_coefficient=1.0), _img(224),
    note="batch 2 where the test feeds 8 images")
_hub("HGNetV2Backbone", "hgnetv2", dict(
    embedding_size=32, stem_channels=[3, 16, 32], hidden_act="relu",
    use_learnable_affine_block=False, image_shape=(64, 64, 3),
    depths=[1, 1], hidden_sizes=[64, 128],
    stackwise_stage_filters=[[32, 16, 64, 1, 1, 3], [64, 32, 128, 1, 1, 3]],
    apply_downsample=[False, True],
    use_lightweight_conv_block=[False, False],
    out_features=["stem", "stage1", "stage2"]), _img(64), output="stage2")
_hub("MiTBackbone", "mit", dict(
    layerwise_depths=[2, 2], image_shape=(32, 32, 3), hidden_dims=[4, 8],
    num_layers=2, layerwise_num_heads=[1, 2], layerwise_sr_ratios=[8, 4],
    max_drop_path_rate=0.1, layerwise_patch_sizes=[7, 3],
    layerwise_strides=[4, 2]), _img(32))
_hub("MobileNetBackbone", "mobilenet", dict(
    stackwise_expansion=[[40, 56], [64, 144, 144], [72, 72],
                         [144, 288, 288]],
    stackwise_num_blocks=[2, 3, 2, 3],
    stackwise_num_filters=[[16, 16], [24, 24, 24], [24, 24],
                           [48, 48, 48]],
    stackwise_kernel_size=[[3, 3], [5, 5, 5], [5, 5], [5, 5, 5]],
    stackwise_num_strides=[[2, 1], [2, 1, 1], [1, 1], [2, 1, 1]],
    stackwise_se_ratio=[[None, None], [0.25, 0.25, 0.25], [0.25, 0.25],
                        [0.25, 0.25, 0.25]],
    stackwise_activation=[["relu", "relu"],
                          ["hard_swish", "hard_swish", "hard_swish"],
                          ["hard_swish", "hard_swish"],
                          ["hard_swish", "hard_swish", "hard_swish"],
                          ["hard_swish"]],
    stackwise_padding=[[1, 1], [2, 2, 2], [2, 2], [2, 2, 2]],
    output_num_filters=1024, input_activation="hard_swish",
    output_activation="hard_swish", input_num_filters=16,
    image_shape=(32, 32, 3), depthwise_filters=8, depthwise_stride=2,
    depthwise_residual=False, squeeze_and_excite=0.5,
    last_layer_filter=288), _img(32))
_MOBILENETV5 = dict(
    stackwise_block_types=[["er"], ["uir", "uir"]],
    stackwise_num_blocks=[1, 2], stackwise_num_filters=[[24], [48, 48]],
    stackwise_strides=[[2], [2, 1]],
    stackwise_act_layers=[["relu"], ["relu", "relu"]],
    stackwise_exp_ratios=[[4.0], [6.0, 6.0]],
    stackwise_se_ratios=[[0.0], [0.0, 0.0]],
    stackwise_dw_kernel_sizes=[[0], [5, 5]],
    stackwise_dw_start_kernel_sizes=[[0], [0, 0]],
    stackwise_dw_end_kernel_sizes=[[0], [0, 0]],
    stackwise_exp_kernel_sizes=[[3], [0, 0]],
    stackwise_pw_kernel_sizes=[[1], [0, 0]],
    stackwise_num_heads=[[0], [0, 0]], stackwise_key_dims=[[0], [0, 0]],
    stackwise_value_dims=[[0], [0, 0]], stackwise_kv_strides=[[0], [0, 0]],
    stackwise_use_cpe=[[False], [False, False]], image_shape=(32, 32, 3),
    stem_size=16, use_msfa=False)
_hub("MobileNetV5Backbone", "mobilenetv5", _MOBILENETV5, _img(32))
_RESNET18ISH = dict(
    input_conv_filters=[64], input_conv_kernel_sizes=[7],
    stackwise_num_filters=[64, 64, 64], stackwise_num_blocks=[2, 2, 2],
    stackwise_num_strides=[1, 2, 2], use_pre_activation=False)
_hub("ResNetBackbone", "resnet", dict(
    _RESNET18ISH, image_shape=(None, None, 3),
    block_type="bottleneck_block"), _img(64), fast=True)
_hub("SwinTransformerBackbone", "swin_transformer", dict(
    image_shape=(32, 32, 3), embed_dim=32, depths=(2, 2), num_heads=(2, 4),
    window_size=4), _img(32), note="batch 2 where the test feeds 1 image")
_hub("VGGBackbone", "vgg", dict(
    stackwise_num_repeats=[2, 3, 3], stackwise_num_filters=[8, 64, 64],
    image_shape=(16, 16, 3)), _img(16))
_VIT = dict(image_shape=(28, 28, 3), patch_size=(4, 4), num_layers=3,
            hidden_dim=48, num_heads=6, mlp_dim=48 * 4, use_mha_bias=True)
_hub("ViTBackbone", "vit", _VIT, _img(28))
_VITDET = dict(image_shape=(16, 16, 3), patch_size=2, hidden_size=4,
               num_layers=2, global_attention_layer_indices=[2, 5, 8, 11],
               intermediate_dim=4 * 4, num_heads=2, num_output_channels=8,
               window_size=2)
_hub("ViTDetBackbone", "vit_det", _VITDET, _img(16),
     note="batch 2 where the test feeds 1 image; num_output_channels 8 "
          "where it has 2: the neck's LayerNormalization over 2 channels "
          "outputs +-1, the sign of their difference, where no parity "
          "figure means anything")
_hub("XceptionBackbone", "xception", dict(
    stackwise_conv_filters=[[32, 64], [128, 128], [256, 256]],
    stackwise_pooling=[False, True, False], image_shape=(None, None, 3)),
    _img(64))
_hub("VideoPrismBackbone", "video_prism", dict(
    image_shape=(28, 28, 3), num_frames=4, patch_size=4, hidden_dim=16,
    intermediate_dim=32, num_heads=2, num_spatial_layers=1,
    num_temporal_layers=1, num_auxiliary_layers=1, vocabulary_size=0,
    num_text_layers=0), uniform(4, 28, 28, 3))


# Backbones built on another backbone (an image encoder).


def _resnet(**kwargs):
    import keras_hub

    return keras_hub.models.ResNetBackbone(**kwargs)


def _basnet():
    import keras_hub

    return keras_hub.models.BASNetBackbone(
        image_encoder=_resnet(
            input_conv_filters=[64], input_conv_kernel_sizes=[7],
            stackwise_num_filters=[64, 128, 256, 512],
            stackwise_num_blocks=[2, 2, 2, 2],
            stackwise_num_strides=[1, 2, 2, 2], block_type="basic_block"),
        num_classes=1)


_hub("BASNetBackbone", "basnet", _basnet, _img(64), output="refine_out",
     note="the test feeds ones(64x64) without naming an input_data")


def _deeplab():
    import keras_hub

    return keras_hub.models.DeepLabV3Backbone(
        image_encoder=_resnet(**_RESNET18ISH, block_type="basic_block"),
        low_level_feature_key="P2", spatial_pyramid_pooling_key="P4",
        dilation_rates=[6, 12, 18], upsampling_size=4,
        image_shape=(96, 96, 3))


_hub("DeepLabV3Backbone", "deeplab_v3", _deeplab, _img(96))


def _depth_anything():
    import keras_hub

    encoder = keras_hub.models.DINOV2Backbone(
        patch_size=14, num_layers=4, hidden_dim=16, num_heads=2,
        intermediate_dim=16 * 4, layer_scale_init_value=1.0,
        num_register_tokens=0, image_shape=(126, 126, 3),
        apply_layernorm=True, name="image_encoder")
    return keras_hub.models.DepthAnythingBackbone(
        image_encoder=encoder, reassemble_factors=[4, 2, 1, 0.5],
        neck_hidden_dims=[16, 32, 64, 128], fusion_hidden_dim=128,
        head_hidden_dim=16, head_in_index=-1,
        feature_keys=["stage1", "stage2", "stage3", "stage4"])


_hub("DepthAnythingBackbone", "depth_anything", _depth_anything,
     _img(126))


def _dfine():
    import keras_hub

    hgnet = keras_hub.models.HGNetV2Backbone(
        stem_channels=[3, 8, 8],
        stackwise_stage_filters=[[8, 8, 16, 1, 1, 3], [16, 8, 32, 1, 1, 3]],
        apply_downsample=[False, True],
        use_lightweight_conv_block=[False, False], depths=[1, 1],
        hidden_sizes=[16, 32], embedding_size=8,
        use_learnable_affine_block=True, hidden_act="relu",
        image_shape=(None, None, 3), out_features=["stage1", "stage2"])
    return keras_hub.models.DFineBackbone(
        backbone=hgnet, decoder_in_channels=[16, 16], encoder_hidden_dim=16,
        num_denoising=10, num_labels=4, hidden_dim=16,
        learn_initial_query=False, num_queries=10, anchor_image_size=(32, 32),
        feat_strides=[4, 8], num_feature_levels=2,
        encoder_in_channels=[16, 32], encode_proj_layers=[1],
        num_attention_heads=2, encoder_ffn_dim=32, num_encoder_layers=1,
        hidden_expansion=0.5, depth_multiplier=0.5, eval_idx=-1,
        num_decoder_layers=3, decoder_attention_heads=2, decoder_ffn_dim=32,
        decoder_n_points=[2, 2], lqe_hidden_dim=16, num_lqe_layers=2,
        out_features=["stage1", "stage2"], image_shape=(None, None, 3),
        seed=0)


_hub("DFineBackbone", "d_fine", _dfine, _img(32),
     output="last_hidden_state",
     note="without labels, as the test's basic case")


def _retinanet():
    import keras_hub

    return keras_hub.models.RetinaNetBackbone(
        image_encoder=_resnet(
            input_conv_filters=[64], input_conv_kernel_sizes=[7],
            stackwise_num_filters=[64, 128, 256, 512],
            stackwise_num_blocks=[3, 4, 6, 3],
            stackwise_num_strides=[1, 2, 2, 2],
            block_type="bottleneck_block", use_pre_activation=False),
        min_level=3, max_level=7, use_p5=True)


_hub("RetinaNetBackbone", "retinanet", _retinanet, _img(256), output="P3")


def _segformer():
    import keras_hub

    encoder = keras_hub.models.MiTBackbone(
        layerwise_depths=[2, 2], image_shape=(32, 32, 3), hidden_dims=[4, 8],
        num_layers=2, layerwise_num_heads=[1, 2],
        layerwise_sr_ratios=[8, 4], max_drop_path_rate=0.1,
        layerwise_patch_sizes=[7, 3], layerwise_strides=[4, 2])
    return keras_hub.models.SegFormerBackbone(
        projection_filters=256, image_encoder=encoder)


_hub("SegFormerBackbone", "segformer", _segformer, _img(32))


def _parseq():
    import keras_hub

    encoder = keras_hub.models.ViTBackbone(
        image_shape=(32, 128, 3), patch_size=(4, 8), num_layers=2,
        num_heads=2, hidden_dim=64, mlp_dim=64 * 4, use_class_token=False,
        name="image_encoder")
    return keras_hub.models.PARSeqBackbone(
        image_encoder=encoder, vocabulary_size=97, max_label_length=25,
        decoder_hidden_dim=64, num_decoder_layers=1, num_decoder_heads=2,
        decoder_mlp_dim=64 * 4, dropout_rate=0.0, attention_dropout=0.0)


_hub("PARSeqBackbone", "parseq", _parseq, {
    "images": normal(32, 128, 3), "token_ids": tokens(25, 97),
    "padding_mask": ones(25)})


# --------------------------------------------------------------------------
# Several encoders: image-text, multimodal, segmentation, generation
# --------------------------------------------------------------------------


def _clip_like(family, backbone, vision, text, **kwargs):
    def build():
        import keras_hub

        return getattr(keras_hub.models, backbone)(
            vision_encoder=_src(f"{family}.{family}_vision_encoder", vision)(
                16, 64, 2, 2, 128, name="vision_encoder"),
            text_encoder=_src(f"{family}.{family}_text_encoder", text)(
                64, 64, 64, 2, 2, 128, name="text_encoder"),
            **kwargs)

    return build


_hub("CLIPBackbone", "clip", _clip_like(
    "clip", "CLIPBackbone", "CLIPVisionEncoder", "CLIPTextEncoder",
    projection_dim=64),
    {"images": _img(224), "token_ids": tokens(77, 64)},
    output="vision_logits")
_hub("MetaCLIP2Backbone", "metaclip_2", _clip_like(
    "metaclip_2", "MetaCLIP2Backbone", "MetaCLIP2VisionEncoder",
    "MetaCLIP2TextEncoder", projection_dim=64),
    {"images": _img(224), "token_ids": tokens(77, 64)},
    output="vision_logits")
_hub("SigLIPBackbone", "siglip", _clip_like(
    "siglip", "SigLIPBackbone", "SigLIPVisionEncoder", "SigLIPTextEncoder"),
    {"images": _img(224), "token_ids": tokens(64, 64)},
    output="vision_logits")


def _blip2():
    import keras_hub

    vision = _src("blip2.blip2_vision_encoder", "BLIP2VisionEncoder")(
        image_size=32, patch_size=4, num_layers=2, num_heads=2, hidden_dim=8,
        intermediate_dim=16, use_patch_bias=True, use_class_token=True,
        use_mha_bias=True, use_mlp_bias=True, dropout_rate=0.0,
        layer_norm_epsilon=1e-6, initializer_range=0.02)
    qformer = _src("blip2.blip2_qformer", "BLIP2QFormer")(
        num_query_tokens=2, num_layers=2, num_heads=2, hidden_dim=4,
        intermediate_dim=8, vision_dim=8, cross_attention_frequency=1,
        dropout=0.0, layer_norm_epsilon=1e-6)
    language = _src("blip2.blip2_custom_opt", "BLIP2CustomOPT")(
        vocabulary_size=14, num_layers=2, num_heads=2, hidden_dim=4,
        intermediate_dim=8, num_query_tokens=2, qformer_hidden_dim=4,
        max_sequence_length=10, dropout=0.0, language_projection=None)
    return keras_hub.models.BLIP2Backbone(
        vision_encoder=vision, qformer=qformer, language_model=language)


_hub("BLIP2Backbone", "blip2", _blip2, {
    "images": _img(32), "token_ids": tokens(5, 14),
    "padding_mask": ones(5, dtype="bool")},
    note='the sub-encoders\' "dtype": "float32" pins dropped')


def _flux():
    import keras_hub

    return keras_hub.models.FluxBackbone(
        input_channels=64, hidden_size=256, mlp_ratio=2.0, num_heads=4,
        depth=2, depth_single_blocks=4, axes_dim=[8, 28, 28], theta=10_000,
        use_bias=True, guidance_embed=True, image_shape=(16, 64),
        text_shape=(16, 64), image_ids_shape=(16, 3), text_ids_shape=(16, 3),
        y_shape=(64,))


_hub("FluxBackbone", "flux", _flux, {
    "image": uniform(16, 64), "image_ids": ones(16, 3, dtype="float32"),
    "text": uniform(16, 64), "text_ids": ones(16, 3, dtype="float32"),
    "y": uniform(64), "timesteps": ones(dtype="float32"),
    "guidance": ones(dtype="float32")},
    note="without the VAE and CLIP pipeline models (not backbone "
         "arguments); batch 2 where the test feeds 1")


def _gemma3():
    import keras_hub

    vision = _src("gemma3.gemma3_vision_encoder", "Gemma3VisionEncoder")(
        image_size=16, patch_size=4, pool_size=2, num_layers=2, num_heads=2,
        hidden_dim=8, intermediate_dim=16, output_dim=8)
    return keras_hub.models.Gemma3Backbone(
        vocabulary_size=256, image_size=16, num_layers=6, num_query_heads=2,
        num_key_value_heads=1, hidden_dim=8, intermediate_dim=16,
        head_dim=4, query_head_dim_normalize=True, use_query_key_norm=True,
        use_post_ffw_norm=True, use_post_attention_norm=True,
        final_logit_soft_cap=None, attention_logit_soft_cap=None,
        use_sliding_window_attention=True, sliding_window_size=1024,
        vision_encoder=vision)


_GEMMA3_MASK = np.array([
    [False] * 20 + [True] * 8 + [False] * 32 + [True] * 4,
    [False] * 16 + [True] * 8 + [False] * 36 + [True] * 4])
_GEMMA3_INDICES = np.array([
    list(range(20, 28)) + list(range(60, 64)),
    list(range(16, 24)) + list(range(60, 64))])
_hub("Gemma3Backbone", "gemma3", _gemma3, {
    "token_ids": tokens(64, 256), "images": uniform(3, 16, 16, 3),
    "padding_mask": ones(64), "vision_mask": rows(_GEMMA3_MASK),
    "vision_indices": rows(_GEMMA3_INDICES)})


def _gemma4():
    import keras_hub

    vision = _src("gemma4.gemma4_vision_encoder", "Gemma4VisionEncoder")(
        image_size=16, patch_size=4, pool_size=2, num_layers=2, num_heads=2,
        head_dim=4, num_key_value_heads=2, hidden_dim=8, intermediate_dim=16,
        output_dim=8)
    return keras_hub.models.Gemma4Backbone(
        vocabulary_size=256, image_size=16, num_layers=6, num_query_heads=2,
        num_key_value_heads=1, hidden_dim=8, intermediate_dim=16,
        head_dim=4, use_sliding_window_attention=True, sliding_window_size=16,
        attention_logit_soft_cap=None, final_logit_soft_cap=None,
        vision_encoder=vision)


_GEMMA4_MASK = np.array([
    [False] * 20 + [True] * 4 + [False] * 16 + [True] * 4 + [False] * 16
    + [True] * 4,
    [False] * 16 + [True] * 4 + [False] * 16 + [True] * 4 + [False] * 20
    + [True] * 4])
_GEMMA4_INDICES = np.array([
    list(range(20, 24)) + list(range(40, 44)) + list(range(60, 64)),
    list(range(16, 20)) + list(range(36, 40)) + list(range(60, 64))])
_hub("Gemma4Backbone", "gemma4", _gemma4, {
    "token_ids": tokens(64, 256), "pixel_values": uniform(3, 16, 48),
    "pixel_position_ids": ones(3, 16, 2), "padding_mask": ones(64),
    "position_ids": rows(np.tile(np.arange(64), (2, 1))),
    "vision_mask": rows(_GEMMA4_MASK),
    "vision_indices": rows(_GEMMA4_INDICES)})


def _gemma3n():
    import keras_hub

    stackwise = _src("mobilenetv5.mobilenetv5_builder",
                     "convert_arch_def_to_stackwise")([["er_r1_k3_s1_e1_c8"]])
    vision = keras_hub.models.MobileNetV5Backbone(
        **stackwise, num_features=4, image_shape=(32, 32, 3), use_msfa=False)
    audio = _src("gemma3n.gemma3n_audio_encoder", "Gemma3nAudioEncoder")(
        hidden_size=4, input_feat_size=16, sscp_conv_channel_size=[2, 4],
        sscp_conv_kernel_size=[(1, 1), (1, 1)],
        sscp_conv_stride_size=[(2, 2), (2, 2)], sscp_conv_group_norm_eps=1e-5,
        num_hidden_layers=1, rms_norm_eps=1e-6, gradient_clipping=1.0,
        residual_weight=0.5, num_attention_heads=1, attention_chunk_size=2,
        num_attention_context_right=1, num_attention_context_left=1,
        attention_logit_cap=50.0, conv_kernel_size=3, reduction_factor=1)
    return keras_hub.models.Gemma3nBackbone(
        text_vocab_size=10, text_hidden_size=4, num_hidden_layers=1,
        pad_token_id=0, num_attention_heads=1, num_key_value_heads=1,
        head_dim=4, intermediate_size=[8],
        hidden_activation="gelu_approximate",
        layer_types=["full_attention"], sliding_window=4, rope_theta=10000.0,
        max_position_embeddings=8, vocab_size_per_layer_input=10,
        hidden_size_per_layer_input=2, altup_num_inputs=2, laurel_rank=1,
        vision_encoder_config=vision.get_config(), vision_hidden_size=8,
        audio_encoder_config=audio.get_config(), audio_hidden_size=4)


_hub("Gemma3nBackbone", "gemma3n", _gemma3n, {
    "token_ids": tokens(8, 10), "padding_mask": ones(8, dtype="bool"),
    "images": uniform(1, 32, 32, 3), "input_features": uniform(1, 8, 16),
    "input_features_mask": zeros(1, 8, dtype="bool")},
    note="batch 2 where the test feeds 1")


def _pali_gemma():
    import keras_hub

    return keras_hub.models.PaliGemmaBackbone(
        vocabulary_size=256, image_size=16, num_layers=2, num_query_heads=2,
        num_key_value_heads=1, hidden_dim=8, intermediate_dim=16, head_dim=4,
        vit_patch_size=4, vit_num_layers=2, vit_num_heads=2, vit_hidden_dim=8,
        vit_intermediate_dim=16)


_hub("PaliGemmaBackbone", "pali_gemma", _pali_gemma, {
    "token_ids": tokens(64, 256), "images": _img(16),
    "padding_mask": ones(64), "response_mask": zeros(64)})


def _sam():
    import keras_hub

    encoder = keras_hub.models.ViTDetBackbone(
        hidden_size=16, num_layers=16, intermediate_dim=16 * 4, num_heads=16,
        global_attention_layer_indices=[2, 5, 8, 11], patch_size=16,
        num_output_channels=8, window_size=2, image_shape=(16, 16, 3))
    prompt = _src("sam.sam_prompt_encoder", "SAMPromptEncoder")(
        hidden_size=8, image_embedding_size=(8, 8), input_image_size=(16, 16),
        mask_in_channels=16)
    decoder = _src("sam.sam_mask_decoder", "SAMMaskDecoder")(
        num_layers=2, hidden_size=16, intermediate_dim=32, num_heads=8,
        embedding_dim=8, num_multimask_outputs=3, iou_head_depth=3,
        iou_head_hidden_dim=8)
    return keras_hub.models.SAMBackbone(
        image_encoder=encoder, prompt_encoder=prompt, mask_decoder=decoder)


_hub("SAMBackbone", "sam", _sam, {
    "images": _img(16), "points": uniform(1, 2, high=16),
    "labels": ones(1, dtype="float32"), "boxes": uniform(1, 2, 2, high=16),
    "masks": zeros(0, 16, 16, 1, dtype="float32")},
    output="prompt_sparse_embeddings",
    note="points and boxes drawn in the image (the test feeds ones); the "
         "prompt encoder's sparse embeddings compared (the backbone returns "
         "embeddings, not masks)")


def _sam3():
    import keras_hub

    m = "sam3.sam3_"
    return keras_hub.models.SAM3PromptableConceptBackbone(
        vision_encoder=_src(m + "vision_encoder", "SAM3VisionEncoder")(
            image_shape=(28, 28, 3), patch_size=14, num_layers=2,
            hidden_dim=16, intermediate_dim=32, num_heads=2,
            fpn_hidden_dim=16, fpn_scale_factors=[4.0, 2.0, 1.0, 0.5],
            pretrain_image_shape=(42, 42, 3), window_size=2,
            global_attn_indexes=[1, 2]),
        text_encoder=_src(m + "text_encoder", "SAM3TextEncoder")(
            vocabulary_size=32, embedding_dim=16, hidden_dim=16,
            num_layers=2, num_heads=2, intermediate_dim=32),
        geometry_encoder=_src(m + "geometry_encoder", "SAM3GeometryEncoder")(
            num_layers=2, hidden_dim=16, intermediate_dim=32, num_heads=2,
            roi_size=7),
        detr_encoder=_src(m + "detr_encoder", "SAM3DetrEncoder")(
            num_layers=2, hidden_dim=16, intermediate_dim=32, num_heads=2),
        detr_decoder=_src(m + "detr_decoder", "SAM3DetrDecoder")(
            image_shape=(28, 28, 3), patch_size=14, num_layers=2,
            hidden_dim=16, intermediate_dim=32, num_heads=2, num_queries=8),
        mask_decoder=_src(m + "mask_decoder", "SAM3MaskDecoder")(
            num_upsampling_stages=3, hidden_dim=16, num_heads=2))


_hub("SAM3PromptableConceptBackbone", "sam3", _sam3, {
    "pixel_values": _img(28), "token_ids": tokens(32, 32),
    "padding_mask": ones(32, dtype="bool"),
    "boxes": ones(1, 5, dtype="float32"), "box_labels": ones(1)},
    output="pred_logits",
    test="keras_hub/src/models/sam3/sam3_pc_backbnoe_test.py")


def _sd3():
    import keras_hub

    clip = _src("clip.clip_text_encoder", "CLIPTextEncoder")
    vae = _src("vae.vae_backbone", "VAEBackbone")(
        [32, 32, 32, 32], [1, 1, 1, 1], [32, 32, 32, 32], [1, 1, 1, 1],
        sampler_method="mode", name="vae")
    return keras_hub.models.StableDiffusion3Backbone(
        mmdit_patch_size=2, mmdit_hidden_dim=16 * 2, mmdit_num_layers=2,
        mmdit_num_heads=2, mmdit_position_size=192, mmdit_qk_norm=None,
        mmdit_dual_attention_indices=None, vae=vae,
        clip_l=clip(20, 32, 32, 2, 2, 64, "quick_gelu", -2, name="clip_l"),
        clip_g=clip(20, 64, 64, 2, 2, 128, "gelu", -2, name="clip_g"),
        image_shape=(64, 64, 3))


_hub("StableDiffusion3Backbone", "stable_diffusion_3", _sd3, {
    "images": _img(64), "latents": uniform(8, 8, 16),
    "clip_l_token_ids": tokens(5, 20),
    "clip_l_negative_token_ids": tokens(5, 20),
    "clip_g_token_ids": tokens(5, 20),
    "clip_g_negative_token_ids": tokens(5, 20),
    "num_steps": ones(), "guidance_scale": ones(dtype="float32")},
    output="latents",
    note="CLIP-L and CLIP-G built without the test's dtype='float16' "
         "(the global policy decides)")


# --------------------------------------------------------------------------
# Not exported in keras_hub.models, but with backbone tests
# --------------------------------------------------------------------------


def _rqvae():
    return _src("rqvae.rqvae_backbone", "RQVAEBackbone")(
        input_dim=16, encoder_layer_dims=[32, 16], output_dim=8,
        decoder_layer_dims=[16, 32], num_embeddings=4, num_quantizers=2,
        decay=0.99, data_variance=1.0, commitment_cost=0.25)


def _vae():
    return _src("vae.vae_backbone", "VAEBackbone")(
        encoder_num_filters=[32, 32, 32, 32], encoder_num_blocks=[1, 1, 1, 1],
        decoder_num_filters=[32, 32, 32, 32], decoder_num_blocks=[1, 1, 1, 1],
        sampler_method="mode")


_hub("RQVAEBackbone", "rqvae", _rqvae, uniform(16), output="reconstructions",
     note="not exported in keras_hub.models")
_hub("VAEBackbone", "vae", _vae, _img(64),
     note="not exported in keras_hub.models")
EXTRA = ("RQVAEBackbone", "VAEBackbone")


def backbone_names():
    """Every `keras_hub.models.*Backbone` name of the installed keras-hub."""
    import keras_hub

    return sorted(n for n in dir(keras_hub.models)
                  if n.endswith("Backbone") and n != "Backbone")
