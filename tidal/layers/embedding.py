"""Vocab-parallel embedding and LM head: each rank holds a contiguous slice of the vocabulary."""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from tidal.distributed import (
    get_tp_rank,
    get_tp_size,
    tensor_model_parallel_all_gather,
    tensor_model_parallel_all_reduce,
)
from tidal.layers.cpu_kernels import (
    SCREEN_MAX_ROWS,
    SKINNY_MAX_ROWS,
    GreedyScreen,
    TileScreen,
    packed_linear_argmax,
    packed_linear_argmax_only,
    packed_linear_greedy,
    packed_linear_screen,
    unpack_bf16_rows,
)
from tidal.layers.gguf_kernels import gguf_linear
from tidal.layers.linear import cpu_linear
from tidal.layers.quantization.gguf import packed_lookup
from tidal.layers.quantization.methods import weight_only_linear


class VocabParallelEmbedding(nn.Module):
    def __init__(self, vocab_size: int, hidden_size: int, dtype=torch.float32) -> None:
        super().__init__()
        tp, rank = get_tp_size(), get_tp_rank()
        self.vocab_size = vocab_size
        self.shard_size = -(-vocab_size // tp)
        self.vocab_start = rank * self.shard_size
        self.vocab_end = min(vocab_size, self.vocab_start + self.shard_size)
        self.tp_size = tp
        self.dtype = dtype  # of the output; the table may be stored narrower (loader.narrow_embeddings)
        self.weight = nn.Parameter(torch.zeros(self.shard_size, hidden_size, dtype=dtype), requires_grad=False)
        self.weight.weight_loader = self.weight_loader
        # per-row scales once the table is quantized (int8 / E4M3: quantization.methods.quantize_embeddings)
        self.weight_scale: torch.Tensor | None = None

    def lookup(self, ids: torch.Tensor) -> torch.Tensor:
        """Rows of this rank's table for local ids, in the output dtype."""
        if self.weight.dtype == torch.uint8:  # GGUF blocks: dequantize the looked-up rows only
            return packed_lookup(self.weight, ids, self.dtype)
        packed = getattr(self.weight, "bf16_packed", None)
        if packed is not None:  # packed for the LM head tied to this table (tidal.loader.pack_bf16_weights)
            return unpack_bf16_rows(self.weight, ids, packed[1]).to(self.dtype)
        if self.weight_scale is None:
            return F.embedding(ids, self.weight).to(self.dtype)
        return (self.weight[ids].to(torch.float32) * self.weight_scale[ids].unsqueeze(-1)).to(self.dtype)

    def weight_loader(self, param, loaded, shard_id=None) -> None:
        rows = loaded[self.vocab_start:self.vocab_end]
        param.data[:rows.shape[0]].copy_(rows)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        if self.tp_size == 1:
            return self.lookup(input_ids)
        in_shard = (input_ids >= self.vocab_start) & (input_ids < self.vocab_end)
        local = torch.where(in_shard, input_ids - self.vocab_start, 0)
        out = self.lookup(local) * in_shard.unsqueeze(-1).to(self.dtype)
        return tensor_model_parallel_all_reduce(out)


class ParallelLMHead(VocabParallelEmbedding):
    def __init__(self, vocab_size: int, hidden_size: int, dtype=torch.float32, bias: bool = False) -> None:
        super().__init__(vocab_size, hidden_size, dtype)
        self.bias = None
        # an int8 screen of the weight for greedy rows under fp32 activations, and one in the AMX tiles' layout
        # for bf16 rows (tidal.loader.pack_bf16_weights)
        self.greedy_screen: GreedyScreen | None = None
        self.greedy_screen_tiles: TileScreen | None = None

    def tie_to(self, embedding: VocabParallelEmbedding) -> None:
        self.weight = embedding.weight

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """[num_tokens, hidden] -> [num_tokens, vocab_size] logits, gathered across ranks."""
        if self.weight.dtype == torch.uint8:
            logits = gguf_linear(hidden, self.weight, None)
        elif self.weight_scale is None:
            logits = cpu_linear(hidden, self.weight, None)
        else:  # a quantized table: weight-only product (activations unquantized) in every scheme
            logits = weight_only_linear(hidden, self.weight, self.weight_scale, None)
        logits = tensor_model_parallel_all_gather(logits, dim=-1)
        return logits[..., :self.vocab_size]

    def greedy_tokens(self, hidden: torch.Tensor) -> list[int] | None:
        """Each row's argmax over the vocabulary (greedy sampling: the first index of the largest logit, as
        argmax_rows gives on compute_logits' output), found by the LM head's kernel as it computes the
        logits, where one does (bf16 weights packed at load, one rank): under bf16 activations for 1-4 rows,
        and for more on AMX (packed_linear_argmax_only: no logits stored), where the tiles have int8 products
        for up to SCREEN_MAX_ROWS rows through the weight's int8 screen (packed_linear_screen: the bf16 weight
        read for a few tiles of columns a row); under fp32 activations for any number, through the weight's
        int8 screen (packed_linear_greedy: most logits are never computed); None elsewhere."""
        packed = getattr(self.weight, "bf16_packed", None)
        if packed is None or self.tp_size > 1 or self.weight_scale is not None or hidden.dim() != 2:
            return None
        if hidden.dtype == torch.float32 and self.greedy_screen is not None:
            return packed_linear_greedy(hidden, self.weight, *packed, self.greedy_screen, self.vocab_size)
        if (hidden.dtype == torch.bfloat16 and self.greedy_screen_tiles is not None
                and hidden.shape[0] <= SCREEN_MAX_ROWS):
            found = packed_linear_screen(hidden, self.weight, *packed, self.greedy_screen_tiles, self.vocab_size)
            if found is not None:
                return found
        if hidden.dtype == torch.bfloat16 and hidden.shape[0] > SKINNY_MAX_ROWS:
            return packed_linear_argmax_only(hidden, self.weight, *packed, None, self.vocab_size)
        found = packed_linear_argmax(hidden, self.weight, *packed, None, self.vocab_size)
        return None if found is None else found[1]
