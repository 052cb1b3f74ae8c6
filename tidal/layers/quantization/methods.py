"""The quantization schemes' layer methods: how a linear layer, the MoE experts and an embedding table
store their weights, load checkpoint rows into them, and multiply.

Every scheme keeps one copy of each weight, [out, in] row-major like the plain weight, plus one fp32
scale per output row. On the CPU the products go to the native kernels of `tidal.layers.quant_kernels`
(weights widened in registers, or int8 x int8 in int32 for w8a8); elsewhere, or without a compiler, to
the torch expressions of the `*_reference` functions below, which define what the kernels compute.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from tidal.forward_context import batch_invariant
from tidal.layers import quant_kernels
from tidal.layers.linear import UnquantizedLinearMethod, invariant_linear

FP8_MAX = 448.0  # largest finite E4M3 value
INT8_MAX = 127.0


# -- quantizing rows ---------------------------------------------------------------------------------
def quantize_rows(w: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """Symmetric per-row quantization of w [..., K] to int8 or float8_e4m3fn: (q, scale fp32 [...]) with
    w ≈ q * scale[..., None]; a row's scale is its largest magnitude over the format's largest value
    (1 for a row of zeros)."""
    wf = w.float()
    amax = wf.abs().amax(dim=-1)
    qmax = INT8_MAX if dtype == torch.int8 else FP8_MAX
    scale = torch.where(amax > 0, amax / qmax, torch.ones_like(amax))
    scaled = wf / scale.unsqueeze(-1)
    if dtype == torch.int8:
        return torch.round(scaled).clamp_(-INT8_MAX, INT8_MAX).to(torch.int8), scale
    return scaled.clamp_(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn), scale


def dequantize_rows(q: torch.Tensor, scale: torch.Tensor, dtype=torch.float32) -> torch.Tensor:
    return (q.float() * scale.float().unsqueeze(-1)).to(dtype)


# -- products ------------------------------------------------------------------------------------------
def weight_only_linear(x: torch.Tensor, wq: torch.Tensor, scale: torch.Tensor,
                       bias: torch.Tensor | None) -> torch.Tensor:
    """x [..., K] @ (wq * scale)^T + bias in x's dtype, for int8 or E4M3 weights wq [N, K]."""
    if x.device.type == "cpu":
        kernel = quant_kernels.int8_linear if wq.dtype == torch.int8 else quant_kernels.fp8_linear
        out = kernel(x, wq, scale, bias, tiles=not batch_invariant())
        return out if out is not None else quant_kernels.int8_linear_reference(x, wq, scale, bias)
    # GPU: widen the weight for the product (int8 and E4M3 values are exact in bf16/fp16/fp32)
    out = F.linear(x, wq.to(x.dtype)) * scale.to(x.dtype)
    return out if bias is None else out + bias


def w8a8_linear(x: torch.Tensor, wq: torch.Tensor, scale: torch.Tensor, bias: torch.Tensor | None,
                row_sums: torch.Tensor | None) -> torch.Tensor:
    """x quantized per token to int8, products accumulated in int32, rescaled by both scales."""
    if x.device.type == "cpu":
        out = quant_kernels.w8a8_linear(x, wq, scale, bias, row_sums)
        return out if out is not None else quant_kernels.w8a8_linear_reference(x, wq, scale, bias)
    shape = x.shape
    xq, xs = quant_kernels.quantize_rows_int8_reference(x)
    M, K = xq.shape
    if M > 16 and K % 8 == 0 and wq.shape[0] % 8 == 0:  # the shapes torch's int8 GEMM (cuBLASLt) takes
        acc = torch._int_mm(xq, wq.t()).float()
    else:  # exact in fp32 up to K of about 1000
        acc = F.linear(xq.float(), wq.float())
    out = acc * xs.unsqueeze(-1) * scale
    if bias is not None:
        out = out + bias.float()
    return out.to(x.dtype).view(*shape[:-1], wq.shape[0])


# -- linear layers ---------------------------------------------------------------------------------------
def _scale_param(rows, computed: bool) -> nn.Parameter:
    p = nn.Parameter(torch.ones(rows, dtype=torch.float32), requires_grad=False)
    p.computed_at_load = computed  # quantized at load: the checkpoint has no such tensor
    return p


class Int8LinearMethod(UnquantizedLinearMethod):
    """W8A16: int8 weight [out, in] + fp32 weight_scale [out]; activations stay in the model dtype."""
    weight_dtype = torch.int8

    def __init__(self, from_checkpoint: bool = False) -> None:
        self.from_checkpoint = from_checkpoint

    def create_weights(self, layer: nn.Module, in_features: int, out_features: int, dtype) -> None:
        layer.weight = nn.Parameter(torch.empty(out_features, in_features, dtype=self.weight_dtype),
                                    requires_grad=False)
        layer.weight_scale = _scale_param(out_features, computed=not self.from_checkpoint)

    def load_weight(self, layer: nn.Module, row_offset: int, loaded: torch.Tensor) -> None:
        n = loaded.shape[0]
        if loaded.shape[1:] != layer.weight.shape[1:]:
            raise ValueError(f"weight shape {tuple(loaded.shape)} does not match parameter "
                             f"{tuple(layer.weight.shape)}")
        if loaded.dtype == self.weight_dtype:  # already quantized: its weight_scale loads on its own
            layer.weight.data.narrow(0, row_offset, n).copy_(loaded)
            return
        q, scale = quantize_rows(loaded, self.weight_dtype)
        layer.weight.data.narrow(0, row_offset, n).copy_(q)
        layer.weight_scale.data.narrow(0, row_offset, n).copy_(scale)
        layer.weight_scale.computed_at_load = True  # a layer the checkpoint left unquantized

    def apply(self, layer: nn.Module, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        return weight_only_linear(x, layer.weight, layer.weight_scale, bias)


class W8A8LinearMethod(Int8LinearMethod):
    """int8 weights and int8 activations (dynamic, per token), int32 accumulation."""

    def load_weight(self, layer: nn.Module, row_offset: int, loaded: torch.Tensor) -> None:
        smoothing = getattr(layer, "input_smoothing", None)  # SmoothQuant's column factors (smoothing.py)
        if smoothing is not None and loaded.dtype != self.weight_dtype:
            loaded = loaded.float() * smoothing
        super().load_weight(layer, row_offset, loaded)

    def process_weights_after_loading(self, layer: nn.Module) -> None:
        # the VNNI kernel multiplies unsigned activations (x + 128): it subtracts 128 * each row's sum
        sums = layer.weight.sum(dim=1, dtype=torch.int32)
        if isinstance(getattr(layer, "weight_row_sums", None), torch.Tensor):  # again, after smoothing: in place
            layer.weight_row_sums.copy_(sums)
        else:
            layer.register_buffer("weight_row_sums", sums, persistent=False)

    def apply(self, layer: nn.Module, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        return w8a8_linear(x, layer.weight, layer.weight_scale, bias, layer.weight_row_sums)


class Fp8LinearMethod(Int8LinearMethod):
    """E4M3 weight [out, in] + fp32 weight_scale [out] (per-tensor checkpoint scales are spread over the
    rows of their shard), widened in registers; activations stay in the model dtype."""
    weight_dtype = torch.float8_e4m3fn


# -- MoE experts -----------------------------------------------------------------------------------
class UnquantizedMoEMethod:
    """Stacked expert weights in the model dtype: w13 [E, 2I, H], w2 [E, H, I]."""

    def create_weights(self, moe: nn.Module, num_experts: int, hidden: int, inter: int, dtype) -> None:
        moe.w13_weight = nn.Parameter(torch.empty(num_experts, 2 * inter, hidden, dtype=dtype), requires_grad=False)
        moe.w2_weight = nn.Parameter(torch.empty(num_experts, hidden, inter, dtype=dtype), requires_grad=False)

    def load_expert_rows(self, moe: nn.Module, param: nn.Parameter, expert: int, row_offset: int,
                         loaded: torch.Tensor) -> None:
        dst = param.data[expert].narrow(0, row_offset, loaded.shape[0])
        if dst.shape != loaded.shape:
            raise ValueError(f"expert weight shape {tuple(loaded.shape)} does not match {tuple(dst.shape)}")
        dst.copy_(loaded)

    def process_weights_after_loading(self, moe: nn.Module) -> None:
        pass

    def expert_linear(self, moe: nn.Module, x: torch.Tensor, which: str, expert: int) -> torch.Tensor:
        """x [n, in] @ expert's matrix `which` ("w13" or "w2")^T."""
        weight = getattr(moe, f"{which}_weight")[expert]
        if batch_invariant():  # a token's result whatever else its expert takes
            return invariant_linear(x, weight, None)
        return F.linear(x, weight)


class Int8MoEMethod(UnquantizedMoEMethod):
    """Expert weights in int8 with per-row scales (w13_scale [E, 2I], w2_scale [E, H]); products
    weight-only (W8A16): an expert multiplies the few rows routed to it."""
    weight_dtype = torch.int8

    def __init__(self, from_checkpoint: bool = False) -> None:
        self.from_checkpoint = from_checkpoint

    def create_weights(self, moe: nn.Module, num_experts: int, hidden: int, inter: int, dtype) -> None:
        super().create_weights(moe, num_experts, hidden, inter, self.weight_dtype)
        moe.w13_scale = nn.Parameter(torch.ones(num_experts, 2 * inter), requires_grad=False)
        moe.w2_scale = nn.Parameter(torch.ones(num_experts, hidden), requires_grad=False)
        for p in (moe.w13_scale, moe.w2_scale):
            p.computed_at_load = not self.from_checkpoint

    def load_expert_rows(self, moe: nn.Module, param: nn.Parameter, expert: int, row_offset: int,
                         loaded: torch.Tensor) -> None:
        if param is moe.w13_scale or param is moe.w2_scale:  # a checkpoint's scales, one per row
            param.data[expert].narrow(0, row_offset, loaded.shape[0]).copy_(loaded)
            return
        if loaded.dtype == self.weight_dtype:
            return super().load_expert_rows(moe, param, expert, row_offset, loaded)
        q, scale = quantize_rows(loaded, self.weight_dtype)
        super().load_expert_rows(moe, param, expert, row_offset, q)
        scales = moe.w13_scale if param is moe.w13_weight else moe.w2_scale
        scales.data[expert].narrow(0, row_offset, loaded.shape[0]).copy_(scale)

    def expert_linear(self, moe: nn.Module, x: torch.Tensor, which: str, expert: int) -> torch.Tensor:
        return weight_only_linear(x, getattr(moe, f"{which}_weight")[expert], getattr(moe, f"{which}_scale")[expert],
                                  None)


class Fp8MoEMethod(Int8MoEMethod):
    weight_dtype = torch.float8_e4m3fn


# -- embedding tables ---------------------------------------------------------------------------------
def quantize_embeddings(model: nn.Module, dtype: torch.dtype) -> None:
    """Store every embedding / LM-head table in dtype (int8 or E4M3) with per-row scales, once per table
    (a tied LM head shares the quantized table and its scales)."""
    from tidal.layers.embedding import VocabParallelEmbedding
    groups: dict[int, list[VocabParallelEmbedding]] = {}
    for module in model.modules():
        if isinstance(module, VocabParallelEmbedding):
            groups.setdefault(id(module.weight), []).append(module)
    for modules in groups.values():
        q, scale = quantize_rows(modules[0].weight.data, dtype)
        weight = nn.Parameter(q, requires_grad=False)
        scale = nn.Parameter(scale, requires_grad=False)
        for module in modules:
            module.weight, module.weight_scale = weight, scale
