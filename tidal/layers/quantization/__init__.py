"""Weight quantization: one small method class per scheme behind the `quant_method` hook of the linear
layers, the MoE experts and the embedding tables. Model files do not change per scheme: they pass a
`QuantizationConfig` (or None) down, and each layer asks it for its method.

    int8          W8A16: int8 weights, symmetric per-output-channel fp32 scales, activations in the
                  model dtype; the native GEMMs widen the int8 weights in registers
    w8a8          int8 weights as above and int8 activations quantized per token at run time; int8
                  products accumulated in int32 (VPDPBUSD on AVX-512 VNNI, VPMADDUBSW on AVX2)
    fp8           E4M3 weights with per-output-channel scales, widened in registers; also loads
                  checkpoints already in the Hugging Face FP8 layout (quant_method "fp8", weight_scale)
    experts_int8  only the MoE experts in int8 (W8A16), everything else in the model dtype: the recipe
                  that serves Jamba-1.5-Large on 8 GPUs

int8, w8a8 and fp8 quantize the experts and the embedding table (and LM head, tied or not) too, the
table in int8 rows under every scheme (fp8 included: E4M3's 3-bit mantissa costs the most there); the
LM head computes its logits weight-only (W8A16, activations unquantized) in every scheme.
Weights are quantized row by row as they load: a row's scale is its largest magnitude over 127 (int8)
or 448 (E4M3), so a fused QKV or gate/up matrix and a tensor-parallel shard quantize exactly like the
separate matrices would.
"""
from __future__ import annotations

from tidal.layers.quantization.base import (
    QUANTIZATION_METHODS,
    QuantizationConfig,
    UnquantizedLinearMethod,
    checkpoint_quantization,
    get_quantization_config,
)

__all__ = ["QUANTIZATION_METHODS", "QuantizationConfig", "UnquantizedLinearMethod", "checkpoint_quantization",
           "get_quantization_config"]
