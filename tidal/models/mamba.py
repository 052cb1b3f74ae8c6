"""Mamba (v1): a stack of pre-norm residual blocks around the selective state-space mixer, no
attention and no MLP. Module names match Hugging Face checkpoints (`backbone.embeddings`,
`backbone.layers.<i>.norm|mixer`, `backbone.norm_f`); the LM head is usually tied to the embedding.
With `residual_in_fp32` the residual stream stays in fp32 whatever the model dtype, as in transformers."""
from __future__ import annotations

from collections.abc import Iterable

import torch
from torch import nn

from tidal.layers.embedding import ParallelLMHead, VocabParallelEmbedding
from tidal.layers.mamba import MambaMixer
from tidal.layers.norm import RMSNorm
from tidal.models.utils import load_stacked_weights


class MambaBlock(nn.Module):
    def __init__(self, config, dtype, quant=None) -> None:
        super().__init__()
        self.norm = RMSNorm(config.hidden_size, config.layer_norm_epsilon, dtype)
        self.mixer = MambaMixer(config.hidden_size, config.intermediate_size, config.state_size,
                                config.conv_kernel, int(config.time_step_rank), config.use_conv_bias,
                                config.use_bias, None, config.hidden_act, dtype, quant)


class MambaModel(nn.Module):
    def __init__(self, config, dtype, quant=None) -> None:
        super().__init__()
        self.dtype = dtype
        self.residual_dtype = torch.float32 if getattr(config, "residual_in_fp32", True) else dtype
        self.embeddings = VocabParallelEmbedding(config.vocab_size, config.hidden_size, dtype)
        self.layers = nn.ModuleList(MambaBlock(config, dtype, quant) for _ in range(config.num_hidden_layers))
        self.norm_f = RMSNorm(config.hidden_size, config.layer_norm_epsilon, dtype)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        hidden = self.embeddings(input_ids)
        for layer in self.layers:
            hidden = hidden.to(self.residual_dtype) + layer.mixer(layer.norm(hidden.to(self.dtype)))
        return self.norm_f(hidden.to(self.dtype))


class MambaForCausalLM(nn.Module):
    def __init__(self, config, dtype=torch.float32, quant=None) -> None:
        super().__init__()
        self.config = config
        self.backbone = MambaModel(config, dtype, quant)
        self.lm_head = ParallelLMHead(config.vocab_size, config.hidden_size, dtype)
        self.tie_word_embeddings = bool(getattr(config, "tie_word_embeddings", True))
        if self.tie_word_embeddings:
            self.lm_head.tie_to(self.backbone.embeddings)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        return self.backbone(input_ids, positions)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.lm_head.compute_logits(hidden)

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        skip = ("lm_head.weight",) if self.tie_word_embeddings else ()
        return load_stacked_weights(self, weights, [], skip)
