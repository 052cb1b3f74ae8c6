"""Mixtral: Llama-style attention (GQA, RoPE) with a top-k routed mixture of SiLU-gated experts in
place of the MLP. Module names match Hugging Face checkpoints (`block_sparse_moe.gate`,
`block_sparse_moe.experts.<e>.w1|w2|w3`); the top-k routing weights are renormalised, as Mixtral does.
The layer stack (embedding, pipeline stages, final norm) is LlamaModel's, with Mixtral's decoder layer."""
from __future__ import annotations

from collections.abc import Iterable

import torch
from torch import nn

from tidal.layers.moe import SparseMoeBlock, split_expert_weights
from tidal.layers.norm import RMSNorm
from tidal.models.llama import LlamaAttention, LlamaModel
from tidal.models.utils import CausalLM, load_stacked_weights


class MixtralDecoderLayer(nn.Module):
    def __init__(self, config, dtype, quant=None) -> None:
        super().__init__()
        self.self_attn = LlamaAttention(config, dtype, quant)
        self.block_sparse_moe = SparseMoeBlock(
            config.hidden_size, config.intermediate_size, config.num_local_experts, config.num_experts_per_tok,
            renormalize=getattr(config, "norm_topk_prob", True), router_name="gate", dtype=dtype,
            quant_config=quant)
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps, dtype)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps, dtype)

    def forward(self, positions, hidden, residual, rows=None):
        if residual is None:
            residual = hidden
            hidden = self.input_layernorm(hidden)
        else:
            hidden, residual = self.input_layernorm(hidden, residual)
        hidden = self.self_attn(positions, hidden, rows)
        if rows is not None:  # the rows read after the forward (LlamaDecoderLayer.forward)
            residual = residual[rows]
        hidden, residual = self.post_attention_layernorm(hidden, residual)
        return self.block_sparse_moe(hidden), residual


class MixtralForCausalLM(CausalLM):
    supports_pp = True  # LlamaModel with Mixtral's layers: builds only its stage's layers
    stacked_params = (("qkv_proj", "q_proj", "q"), ("qkv_proj", "k_proj", "k"), ("qkv_proj", "v_proj", "v"))

    def __init__(self, config, dtype=torch.float32, quant=None) -> None:
        super().__init__()
        self.config = config
        self.model = LlamaModel(config, dtype, quant, layer_cls=MixtralDecoderLayer)
        self.init_lm_head(config, dtype)

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        skip = ("rotary_emb.inv_freq", "experts.w13_weight", "experts.w2_weight")
        skip += ("lm_head.weight",) if self.tied else ()
        weights = self.this_stage_weights(weights)  # before the experts are split out: other stages' have no place
        return load_stacked_weights(self, split_expert_weights(self, weights), self.stacked_params, skip)
