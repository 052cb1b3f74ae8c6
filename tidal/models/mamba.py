"""Mamba (v1): a stack of pre-norm residual blocks around the selective state-space mixer, no
attention and no MLP. Module names match Hugging Face checkpoints (`backbone.embeddings`,
`backbone.layers.<i>.norm|mixer`, `backbone.norm_f`); the LM head is usually tied to the embedding.
With `residual_in_fp32` the residual stream stays in fp32 whatever the model dtype, as in transformers."""
from __future__ import annotations

from collections.abc import Iterable
from itertools import islice

import torch
from torch import nn

from tidal.distributed import is_first_pp_stage, is_last_pp_stage, pp_recv_hidden, pp_send_hidden
from tidal.layers.embedding import VocabParallelEmbedding
from tidal.layers.mamba import MambaMixer
from tidal.layers.norm import RMSNorm
from tidal.models.utils import CausalLM, load_stacked_weights, make_layers


class MambaBlock(nn.Module):
    def __init__(self, config, dtype, quant=None) -> None:
        super().__init__()
        self.norm = RMSNorm(config.hidden_size, config.layer_norm_epsilon, dtype)
        self.mixer = MambaMixer(config.hidden_size, config.intermediate_size, config.state_size,
                                config.conv_kernel, int(config.time_step_rank), config.use_conv_bias,
                                config.use_bias, None, config.hidden_act, dtype, quant)


class MambaModel(nn.Module):
    """Pipeline stages as in LlamaModel, but Mamba blocks have one stream (the residual, added to in
    place of a separate hidden state): a stage hands the next one that stream alone, in its dtype."""

    def __init__(self, config, dtype, quant=None) -> None:
        super().__init__()
        self.hidden_size, self.dtype = config.hidden_size, dtype
        self.residual_dtype = torch.float32 if getattr(config, "residual_in_fp32", True) else dtype
        self.embeddings = (VocabParallelEmbedding(config.vocab_size, config.hidden_size, dtype)
                           if is_first_pp_stage() else None)
        self.start_layer, self.end_layer, self.layers = make_layers(
            config.num_hidden_layers, lambda i: MambaBlock(config, dtype, quant))
        self.norm_f = RMSNorm(config.hidden_size, config.layer_norm_epsilon, dtype) if is_last_pp_stage() else None

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        if self.embeddings is not None:
            hidden = self.embeddings(input_ids)
        else:
            (hidden,) = pp_recv_hidden(input_ids.shape[0], self.hidden_size, self.residual_dtype, num_tensors=1,
                                       device=input_ids.device)
        for layer in islice(self.layers, self.start_layer, self.end_layer):
            hidden = hidden.to(self.residual_dtype) + layer.mixer(layer.norm(hidden.to(self.dtype)))
        if self.norm_f is None:  # not the last stage: hand over to the next one
            pp_send_hidden(hidden)
            return hidden
        return self.norm_f(hidden.to(self.dtype))


class MambaForCausalLM(CausalLM):
    supports_pp = True  # builds only its stage's layers (MambaModel)
    backbone_name, embedding_name = "backbone", "embeddings"

    def __init__(self, config, dtype=torch.float32, quant=None) -> None:
        super().__init__()
        self.config = config
        self.backbone = MambaModel(config, dtype, quant)
        self.init_lm_head(config, dtype, tie_default=True)

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        skip = ("lm_head.weight",) if self.tied else ()
        return load_stacked_weights(self, self.this_stage_weights(weights), [], skip)
