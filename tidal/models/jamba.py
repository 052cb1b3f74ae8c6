"""Jamba: a hybrid stack of attention and Mamba layers (one attention layer every
`attn_layer_period`, at `attn_layer_offset`), each followed by a dense MLP or, every
`expert_layer_period` layers, a top-k mixture of experts whose weights are not renormalised.
Attention has no positional encoding (the Mamba layers carry position). The Mamba mixers add
RMSNorms on dt, B and C. Module names match Hugging Face checkpoints."""
from __future__ import annotations

from collections.abc import Iterable

import torch
from torch import nn

from tidal import forward_context
from tidal.distributed import is_first_pp_stage, is_last_pp_stage, pp_recv_hidden, pp_send_hidden
from tidal.layers.attention import Attention
from tidal.layers.embedding import VocabParallelEmbedding
from tidal.layers.linear import QKVParallelLinear, RowParallelLinear
from tidal.layers.mamba import MambaMixer
from tidal.layers.moe import SparseMoeBlock, split_expert_weights
from tidal.layers.norm import RMSNorm
from tidal.models.llama import LlamaMLP
from tidal.models.utils import CausalLM, load_stacked_weights, make_layers


class JambaAttention(nn.Module):
    def __init__(self, config, dtype, quant=None) -> None:
        super().__init__()
        heads, kv_heads = config.num_attention_heads, config.num_key_value_heads
        head_dim = getattr(config, "head_dim", None) or config.hidden_size // heads
        self.qkv_proj = QKVParallelLinear(config.hidden_size, head_dim, heads, kv_heads, bias=False, dtype=dtype,
                                          quant_method=quant)
        self.o_proj = RowParallelLinear(heads * head_dim, config.hidden_size, bias=False, dtype=dtype,
                                        quant_method=quant, rank_sizes=self.qkv_proj.q_rank_sizes)
        self.q_size = self.qkv_proj.num_heads * head_dim
        self.kv_size = self.qkv_proj.num_kv_heads * head_dim
        self.attn = Attention(self.qkv_proj.num_heads, head_dim, head_dim ** -0.5, self.qkv_proj.num_kv_heads)

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        q, k, v = self.qkv_proj(hidden).split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        return self.o_proj(self.attn(q, k, v))


class JambaDecoderLayer(nn.Module):
    """One layer: a mixer (attention or Mamba) and a feed-forward (MLP or MoE), both pre-norm residual."""

    def __init__(self, config, layer_idx: int, dtype, quant=None) -> None:
        super().__init__()
        self.is_attention = config.layers_block_type[layer_idx] == "attention"
        if self.is_attention:
            self.self_attn = JambaAttention(config, dtype, quant)
        else:
            self.mamba = MambaMixer(config.hidden_size, config.mamba_expand * config.hidden_size,
                                    config.mamba_d_state, config.mamba_d_conv, config.mamba_dt_rank,
                                    config.mamba_conv_bias, config.mamba_proj_bias, config.rms_norm_eps,
                                    config.hidden_act, dtype, quant)
        if config.layers_num_experts[layer_idx] > 1:
            self.feed_forward = SparseMoeBlock(config.hidden_size, config.intermediate_size, config.num_experts,
                                               config.num_experts_per_tok, renormalize=False,
                                               router_name="router", dtype=dtype, quant_config=quant)
        else:
            self.feed_forward = LlamaMLP(config, dtype, quant)
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps, dtype)
        self.pre_ff_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps, dtype)

    def forward(self, hidden, residual, rows=None):
        """rows: the rows to carry on after the mixer (the last layer's: ForwardContext.output_rows), else
        every row; the mixer itself runs over every row (its KV cache or Mamba state needs them)."""
        if residual is None:
            residual = hidden
            hidden = self.input_layernorm(hidden)
        else:
            hidden, residual = self.input_layernorm(hidden, residual)
        hidden = self.self_attn(hidden) if self.is_attention else self.mamba(hidden)
        if rows is not None:
            hidden, residual = hidden[rows], residual[rows]
        hidden, residual = self.pre_ff_layernorm(hidden, residual)
        return self.feed_forward(hidden), residual


class JambaModel(nn.Module):
    """Pipeline stages as in LlamaModel: a stage builds its layers [start_layer, end_layer) only, so it
    holds (and the runner allocates) the KV cache and Mamba state of those layers alone."""

    def __init__(self, config, dtype, quant=None) -> None:
        super().__init__()
        self.hidden_size, self.dtype = config.hidden_size, dtype
        self.embed_tokens = (VocabParallelEmbedding(config.vocab_size, config.hidden_size, dtype)
                             if is_first_pp_stage() else None)
        self.start_layer, self.end_layer, self.layers = make_layers(
            config.num_hidden_layers, lambda i: JambaDecoderLayer(config, i, dtype, quant))
        self.final_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps, dtype) if is_last_pp_stage() else None

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        if self.embed_tokens is not None:
            hidden, residual = self.embed_tokens(input_ids), None
        else:
            hidden, residual = pp_recv_hidden(input_ids.shape[0], self.hidden_size, self.dtype,
                                              device=input_ids.device)
        # on the last stage, the last layer's feed-forward only for the rows read after the forward
        picked = forward_context.output_rows(hidden.device) if self.final_layernorm is not None else None
        last = self.end_layer - 1
        for i in range(self.start_layer, self.end_layer):
            hidden, residual = self.layers[i](hidden, residual, picked if i == last else None)
        if self.final_layernorm is None:  # not the last stage: hand over to the next one
            pp_send_hidden(hidden, residual)
            return hidden
        hidden, _ = self.final_layernorm(hidden, residual)
        return hidden


class JambaForCausalLM(CausalLM):
    supports_pp = True  # builds only its stage's layers (JambaModel)
    stacked_params = (
        ("qkv_proj", "q_proj", "q"), ("qkv_proj", "k_proj", "k"), ("qkv_proj", "v_proj", "v"),
        ("gate_up_proj", "gate_proj", 0), ("gate_up_proj", "up_proj", 1),
    )

    def __init__(self, config, dtype=torch.float32, quant=None) -> None:
        super().__init__()
        self.config = config
        self.model = JambaModel(config, dtype, quant)
        self.init_lm_head(config, dtype)

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        skip = ("experts.w13_weight", "experts.w2_weight") + (("lm_head.weight",) if self.tied else ())
        weights = self.this_stage_weights(weights)  # before the experts are split out: other stages' have no place
        return load_stacked_weights(self, split_expert_weights(self, weights), self.stacked_params, skip)
