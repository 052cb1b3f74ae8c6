"""The `gguf` scheme: a GGUF file's linear weights and embedding table kept in the file's blocks.

The GGUF loader (tidal.loader.gguf_loader, keep_quantized) yields each quantized tensor as a packed uint8
tensor [rows, K / QK, block_bytes] (tidal.layers.gguf_kernels; QK = 32 values per block, 256 for the
K-quants) and each BF16/F16/F32 tensor as a plain tensor. A linear layer stores the rows it is given as
they come: a fused QKV or gate/up layer whose parts the file stores in different formats keeps one part
per run of rows of the same format, and multiplies part by part. Plain parts are stored in the model's
weight dtype and take the dense kernels.

The embedding table (and an untied LM head) stays packed when the file quantizes it: a lookup
dequantizes only the looked-up rows, and the logits are a packed product like any linear layer's.
"""
from __future__ import annotations

import torch
from torch import nn

from tidal.layers.gguf_kernels import block_format, block_values, decode_activations, dequantize, gguf_linear
from tidal.layers.linear import UnquantizedLinearMethod, cpu_linear


def _same_kind(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.dtype == b.dtype and a.shape[1:] == b.shape[1:]


class GGUFLinearMethod(UnquantizedLinearMethod):
    """Weights as the GGUF file stores them: parts of rows, each packed blocks or a plain tensor.

    After loading, `layer.weight` is the first part and `layer.weight_1`, ... the others (parameters, so
    the engine's weight bytes count them); `layer.gguf_rows` lists each part's (first row, rows)."""

    def __init__(self, weight_dtype: torch.dtype) -> None:
        self.weight_dtype = weight_dtype  # of BF16/F16/F32 tensors
        decode_activations()  # a TIDAL_GGUF_ACTIVATIONS it does not know is refused as the model is built

    def create_weights(self, layer: nn.Module, in_features: int, out_features: int, dtype) -> None:
        # a placeholder the checkpoint rows are routed through; replaced by the parts after loading
        layer.weight = nn.Parameter(torch.empty(out_features, in_features, 0, dtype=torch.uint8),
                                    requires_grad=False)
        layer.gguf_loaded = []  # (row offset, rows) as they load

    def load_weight(self, layer: nn.Module, row_offset: int, loaded: torch.Tensor) -> None:
        K = layer.in_features
        if loaded.dtype == torch.uint8:
            if loaded.dim() != 3 or loaded.shape[1] * block_values(loaded.shape[-1]) != K:
                fmt = block_format(loaded) if loaded.dim() == 3 else "?"
                raise ValueError(f"packed GGUF weight {tuple(loaded.shape)} ({fmt}) does not match {K} input features")
            rows = loaded.contiguous().clone()
        else:
            if loaded.shape[1:] != (K,):
                raise ValueError(f"weight shape {tuple(loaded.shape)} does not match {K} input features")
            rows = loaded.to(self.weight_dtype).contiguous().clone()
        layer.gguf_loaded.append((row_offset, rows))

    def process_weights_after_loading(self, layer: nn.Module) -> None:
        loaded = sorted(layer.__dict__.pop("gguf_loaded", []), key=lambda item: item[0])
        parts: list[tuple[int, list[torch.Tensor]]] = []
        next_row = 0
        for offset, rows in loaded:
            if offset != next_row:
                raise ValueError(f"GGUF weight rows {next_row}..{offset} of a {type(layer).__name__} were not loaded")
            if parts and _same_kind(parts[-1][1][-1], rows):
                parts[-1][1].append(rows)
            else:
                parts.append((offset, [rows]))
            next_row = offset + rows.shape[0]
        if next_row != layer.out_features:
            raise ValueError(f"GGUF weight of {layer.out_features} rows: only {next_row} were loaded")
        layer.gguf_rows = []
        for i, (start, chunks) in enumerate(parts):
            tensor = chunks[0] if len(chunks) == 1 else torch.cat(chunks)
            setattr(layer, "weight" if i == 0 else f"weight_{i}", nn.Parameter(tensor, requires_grad=False))
            layer.gguf_rows.append((start, tensor.shape[0]))

    def apply(self, layer: nn.Module, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        if len(layer.gguf_rows) == 1:
            return part_linear(x, layer.weight, bias)
        outs = [part_linear(x, getattr(layer, "weight" if i == 0 else f"weight_{i}"), None)
                for i in range(len(layer.gguf_rows))]
        out = torch.cat(outs, dim=-1)
        return out if bias is None else out + bias


def part_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    if weight.dtype == torch.uint8:
        return gguf_linear(x, weight, bias)
    return cpu_linear(x, weight, bias)


# -- embedding tables ---------------------------------------------------------------------------------
def pack_embedding(module: nn.Module, block_bytes: int) -> None:
    """Give an embedding / LM-head table a packed parameter [shard rows, hidden / QK, block_bytes] for the
    file's blocks to load into (before loading); QK: the format's values per block (32, 256 for K-quants)."""
    rows, hidden = module.weight.shape
    qk = block_values(block_bytes)
    if hidden % qk:
        raise ValueError(f"packed GGUF embedding: hidden size {hidden} is not a multiple of {qk}, the block of "
                         f"its format")
    module.weight = nn.Parameter(torch.zeros(rows, hidden // qk, block_bytes, dtype=torch.uint8), requires_grad=False)
    module.weight.weight_loader = module.weight_loader


def packed_lookup(weight: torch.Tensor, ids: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Rows ids of a packed table, dequantized to dtype: [*ids.shape, hidden]."""
    rows = weight[ids.reshape(-1)]
    return dequantize(rows, torch.float32 if dtype not in (torch.float32, torch.bfloat16) else dtype
                      ).to(dtype).view(*ids.shape, -1)
