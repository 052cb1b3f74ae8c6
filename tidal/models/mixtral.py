"""Mixtral: Llama-style attention (GQA, RoPE) with a top-k routed mixture of SiLU-gated experts in
place of the MLP. Module names match Hugging Face checkpoints (`block_sparse_moe.gate`,
`block_sparse_moe.experts.<e>.w1|w2|w3`); the top-k routing weights are renormalised, as Mixtral does."""
from __future__ import annotations

from collections.abc import Iterable

import torch
from torch import nn

from tidal.layers.embedding import ParallelLMHead, VocabParallelEmbedding
from tidal.layers.moe import SparseMoeBlock, split_expert_weights
from tidal.layers.norm import RMSNorm
from tidal.models.llama import LlamaAttention
from tidal.models.utils import load_stacked_weights


class MixtralDecoderLayer(nn.Module):
    def __init__(self, config, dtype, quant=None) -> None:
        super().__init__()
        self.self_attn = LlamaAttention(config, dtype, quant)
        self.block_sparse_moe = SparseMoeBlock(
            config.hidden_size, config.intermediate_size, config.num_local_experts, config.num_experts_per_tok,
            renormalize=getattr(config, "norm_topk_prob", True), router_name="gate", dtype=dtype)
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps, dtype)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps, dtype)

    def forward(self, positions, hidden, residual):
        if residual is None:
            residual = hidden
            hidden = self.input_layernorm(hidden)
        else:
            hidden, residual = self.input_layernorm(hidden, residual)
        hidden = self.self_attn(positions, hidden)
        hidden, residual = self.post_attention_layernorm(hidden, residual)
        return self.block_sparse_moe(hidden), residual


class MixtralModel(nn.Module):
    def __init__(self, config, dtype, quant=None) -> None:
        super().__init__()
        self.embed_tokens = VocabParallelEmbedding(config.vocab_size, config.hidden_size, dtype)
        self.layers = nn.ModuleList(MixtralDecoderLayer(config, dtype, quant)
                                    for _ in range(config.num_hidden_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps, dtype)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        hidden, residual = self.embed_tokens(input_ids), None
        for layer in self.layers:
            hidden, residual = layer(positions, hidden, residual)
        hidden, _ = self.norm(hidden, residual)
        return hidden


class MixtralForCausalLM(nn.Module):
    stacked_params = (("qkv_proj", "q_proj", "q"), ("qkv_proj", "k_proj", "k"), ("qkv_proj", "v_proj", "v"))

    def __init__(self, config, dtype=torch.float32, quant=None) -> None:
        super().__init__()
        self.config = config
        self.model = MixtralModel(config, dtype, quant)
        self.lm_head = ParallelLMHead(config.vocab_size, config.hidden_size, dtype)
        self.tie_word_embeddings = bool(getattr(config, "tie_word_embeddings", False))
        if self.tie_word_embeddings:
            self.lm_head.tie_to(self.model.embed_tokens)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        return self.model(input_ids, positions)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.lm_head.compute_logits(hidden)

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        skip = ("rotary_emb.inv_freq", "experts.w13_weight", "experts.w2_weight")
        skip += ("lm_head.weight",) if self.tie_word_embeddings else ()
        return load_stacked_weights(self, split_expert_weights(self, weights), self.stacked_params, skip)
