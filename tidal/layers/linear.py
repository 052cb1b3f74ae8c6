"""Linear layers, parallel-ready: each parameter carries a `weight_loader` that copies its own slice
of a checkpoint tensor (this rank's rows or columns; its place in a fused QKV or gate/up matrix),
so weights are sharded as they load. The matmul itself is a pluggable `quant_method`.

    ColumnParallelLinear   weight [out / tp, in]; output stays sharded
    MergedColumnParallelLinear   several column-parallel outputs fused (gate_up_proj)
    QKVParallelLinear      q, k, v fused, split by KV-head group (`split_heads`): possibly unevenly,
                           KV heads replicated when fewer than ranks
    RowParallelLinear      weight [out, in / tp]; partial outputs summed with one all-reduce
    ReplicatedLinear       every rank holds the whole weight

Column- and row-parallel layers split evenly unless given `rank_sizes` (each rank's output, resp.
input, size): attention's QKV and output projections use that for head counts the ranks do not divide.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from tidal.distributed import get_tp_rank, get_tp_size, tensor_model_parallel_all_reduce
from tidal.forward_context import batch_invariant, skinny_gemm_allowed
from tidal.layers import triton_utils
from tidal.layers.cpu_kernels import (
    SKINNY_MAX_ROWS,
    bf16_gemm_available,
    bf16_linear,
    linear_f32,
    linear_f32_bf16w,
    packed_linear,
    skinny_linear,
    skinny_linear_ordered,
    unpack_bf16_weight,
)


class UnquantizedLinearMethod:
    """The plain weight [out, in] in the model dtype: the one copy the CPU kernels read as it is."""

    def create_weights(self, layer: nn.Module, in_features: int, out_features: int, dtype) -> None:
        layer.weight = nn.Parameter(torch.empty(out_features, in_features, dtype=dtype), requires_grad=False)

    def load_weight(self, layer: nn.Module, row_offset: int, loaded: torch.Tensor) -> None:
        """Store checkpoint rows (this rank's slice, already cut) at rows [row_offset, ...) of the weight."""
        default_weight_loader(layer.weight.data.narrow(0, row_offset, loaded.shape[0]), loaded)

    def process_weights_after_loading(self, layer: nn.Module) -> None:
        pass

    def apply(self, layer: nn.Module, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        return cpu_linear(x, layer.weight, bias)


class Bf16WeightLinearMethod(UnquantizedLinearMethod):
    """bf16 weights under fp32 activations (dtype "auto" on CPUs without native bf16 products): the
    checkpoint's tensors are rounded to bf16 as they load, and the native GEMM widens them in registers,
    so the product is the fp32 product of the bf16 weights with half the bytes of fp32 weights to read.
    `apply` is the plain method's: cpu_linear takes the packed kernel (weights packed at load, AVX2 and up)
    or bf16_weight_linear."""

    def create_weights(self, layer: nn.Module, in_features: int, out_features: int, dtype) -> None:
        layer.weight = nn.Parameter(torch.empty(out_features, in_features, dtype=torch.bfloat16), requires_grad=False)


def bf16_weight_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """x @ weight^T (+ bias) in x's dtype for a weight stored in a narrower dtype."""
    out = linear_f32_bf16w(x, weight, bias)
    if out is None:  # no native kernel, or not on the CPU: widen the whole weight (slower, same values)
        out = F.linear(x, weight.to(x.dtype), bias)
    return out


def cpu_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """x @ weight^T (+ bias), reading the one plain [out, in] copy of the weight.

    bf16 on a CPU with AVX-512 BF16: products of up to SKINNY_MAX_ROWS rows where the forward context
    allows it (decode-only steps, the LM head's sampled rows) go to the skinny kernel, which streams the
    weight once; everything else (prompt chunks, batches of decodes) to the blocked kernel
    (`bf16_linear`), whose rows do not depend on how many there are. Prompt tokens therefore always take
    the blocked kernel: a prompt's last tokens computed after a prefix-cache hit (a few rows) round exactly
    as when the whole prompt runs, so cached and uncached requests agree. fp32 on a CPU: the native fp32
    kernel (1.1-2.6x torch's GEMM on SmolLM2's shapes, 1 to 2048 rows, and its rows independent of the
    row count). Elsewhere (fp16, bf16 without native bf16 products, GPUs) F.linear. A weight narrower than
    x (bf16 under fp32 activations) takes bf16_weight_linear. A weight packed at load (`weight.bf16_packed`,
    tidal.loader.pack_bf16_weights: bf16 activations on a CPU with AVX-512 BF16, or a bf16 weight under fp32
    activations on any CPU with AVX2) takes the packed kernel of x's dtype for any number of rows, in one
    order, so its rows never depend on the batch, in both modes."""
    packed = getattr(weight, "bf16_packed", None)
    if packed is not None:
        n, k = packed
        out = packed_linear(x, weight, n, k, bias)
        if out is not None:
            return out
        weight = unpack_bf16_weight(weight, n, k)  # only if the kernel cannot run here (another ISA level)
    if weight.dtype != x.dtype:
        return bf16_weight_linear(x, weight, bias)
    if batch_invariant():
        return invariant_linear(x, weight, bias)
    if x.dtype == torch.float32 and x.device.type == "cpu":
        shape = x.shape
        out = linear_f32(x.reshape(-1, shape[-1]), weight, bias)
        return F.linear(x, weight, bias) if out is None else out.view(*shape[:-1], out.shape[-1])
    if x.dtype != torch.bfloat16 or x.device.type != "cpu":
        return F.linear(x, weight, bias)
    shape = x.shape
    x2 = x.reshape(-1, shape[-1])
    out = None
    if x2.shape[0] <= SKINNY_MAX_ROWS and skinny_gemm_allowed():
        out = skinny_linear(x2, weight, bias)
    if out is None:
        out = bf16_linear(x2, weight, bias)
    if out is None:  # no AVX-512 BF16 build: oneDNN on the plain weight
        return F.linear(x, weight, bias)
    return out.view(*shape[:-1], out.shape[-1])


def invariant_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """cpu_linear in batch-invariant mode: each output row one dot product whose summation order does not
    depend on the number of rows (docs/batch_invariance.md).
    - bf16 with AVX-512 BF16: bf16_linear's order for any number of rows (1 to 4 rows: the skinny kernel
      written in that order, which still streams the weights once);
    - bf16 without it: widened to fp32, the bf16-weight kernel (fixed order), rounded to bf16 (1 to
      SKINNY_MAX_ROWS rows: all three in one native call, tidal_skinny_gemm_bf16's AVX2 path);
    - fp32: the native fp32 kernel of the same fixed order (torch's GEMM picks kernels by shape);
    - CUDA: the Triton GEMM of fixed tiles (triton_kernels.invariant_linear).
    Elsewhere (fp16 on a CPU; no native kernels, no triton) F.linear, which is not invariant."""
    if x.device.type == "cuda" and (kernels := triton_utils.kernels_for(x)) is not None:
        return kernels.invariant_linear(x, weight, bias)
    shape = x.shape
    x2 = x.reshape(-1, shape[-1])
    out = None
    if x.dtype == torch.bfloat16 and weight.dtype == torch.bfloat16:
        if bf16_gemm_available():
            if x2.shape[0] <= SKINNY_MAX_ROWS:
                out = skinny_linear_ordered(x2, weight, bias)
            if out is None:
                out = bf16_linear(x2, weight, bias)
        elif x2.shape[0] <= SKINNY_MAX_ROWS:  # the same widening, kernel and rounding in one native call
            out = skinny_linear(x2, weight, bias)
        if out is None:
            wide = linear_f32_bf16w(x2.float(), weight, None if bias is None else bias.float())
            out = None if wide is None else wide.to(torch.bfloat16)
    elif x.dtype == torch.float32:
        out = linear_f32(x2, weight, bias)
    if out is None:
        return F.linear(x, weight, bias)
    return out.view(*shape[:-1], out.shape[-1])


def _set_loader(param: nn.Parameter, loader) -> None:
    param.weight_loader = loader


def default_weight_loader(param: torch.Tensor, loaded: torch.Tensor) -> None:
    if param.shape != loaded.shape:
        raise ValueError(f"weight shape {tuple(loaded.shape)} does not match parameter {tuple(param.shape)}")
    param.data.copy_(loaded)


class LinearBase(nn.Module):
    """quant_method: a linear method, or a QuantizationConfig (tidal.layers.quantization) that gives one.
    Subclasses say where checkpoint rows go (`shard_rows`) and which input columns are this rank's
    (`rank_columns`); the method stores them (plain, narrowed or quantized)."""

    def __init__(self, in_features: int, out_features: int, bias: bool, dtype, quant_method=None) -> None:
        super().__init__()
        self.in_features, self.out_features = in_features, out_features
        self.tp_rank, self.tp_size = get_tp_rank(), get_tp_size()
        if hasattr(quant_method, "linear_method"):
            quant_method = quant_method.linear_method()
        self.quant_method = quant_method or UnquantizedLinearMethod()
        self.quant_method.create_weights(self, in_features, out_features, dtype)
        if bias:
            self.bias = nn.Parameter(torch.zeros(out_features, dtype=dtype), requires_grad=False)
        else:
            self.register_parameter("bias", None)
        for param in self.parameters(recurse=False):
            _set_loader(param, self.weight_loader)

    def shard_rows(self, shard_id) -> tuple[int, int | None, int]:
        """(row offset in this rank's weight, first row in the checkpoint tensor or None for the whole
        tensor, number of rows) of checkpoint shard `shard_id`."""
        return 0, None, self.out_features

    def rank_columns(self, loaded: torch.Tensor) -> torch.Tensor:
        return loaded

    def weight_loader(self, param, loaded, shard_id=None) -> None:
        offset, start, size = self.shard_rows(shard_id)
        if param.dim() == 1 and loaded.numel() == 1 and size > 1:  # a per-tensor scale of one shard
            param.data.narrow(0, offset, size).fill_(loaded.reshape(()).item())
            return
        if param.dim() == 1:  # bias, per-channel scales ([rows] or [rows, 1])
            loaded = loaded.reshape(-1)
        elif param is self.weight:
            loaded = self.rank_columns(loaded)
        if start is None:
            if loaded.shape[0] != size:
                raise ValueError(f"weight shape {tuple(loaded.shape)} does not match {size} rows")
            start = 0
        rows = loaded.narrow(0, start, size)
        if param is self.weight:
            self.quant_method.load_weight(self, offset, rows)
        else:
            default_weight_loader(param.data.narrow(0, offset, size), rows)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.quant_method.apply(self, x, self.bias)


class ReplicatedLinear(LinearBase):
    pass


def _even_split(size: int, tp: int, what: str) -> list[int]:
    if size % tp:
        raise ValueError(f"{what} {size} is not divisible by tensor_parallel_size {tp}")
    return [size // tp] * tp


class ColumnParallelLinear(LinearBase):
    def __init__(self, in_features: int, out_features: int, bias: bool = False, dtype=torch.float32,
                 quant_method=None, rank_sizes: list[int] | None = None) -> None:
        """rank_sizes: each rank's rows, for an uneven split (default: out_features / tp each)."""
        self.rank_sizes = rank_sizes or _even_split(out_features, get_tp_size(), "output size")
        super().__init__(in_features, self.rank_sizes[get_tp_rank()], bias, dtype, quant_method)

    def shard_rows(self, shard_id) -> tuple[int, int | None, int]:
        return 0, sum(self.rank_sizes[:self.tp_rank]), self.out_features


class MergedColumnParallelLinear(ColumnParallelLinear):
    """Column-parallel outputs of several matrices stored side by side (e.g. gate and up)."""

    def __init__(self, in_features: int, output_sizes: list[int], bias: bool = False, dtype=torch.float32,
                 quant_method=None) -> None:
        self.output_sizes = output_sizes
        super().__init__(in_features, sum(output_sizes), bias, dtype, quant_method)

    def shard_rows(self, shard_id) -> tuple[int, int | None, int]:
        if shard_id is None:
            return super().shard_rows(shard_id)
        tp = self.tp_size
        size = self.output_sizes[shard_id] // tp
        return sum(self.output_sizes[:shard_id]) // tp, self.tp_rank * size, size


@dataclass(frozen=True)
class HeadShard:
    """One tensor-parallel rank's attention heads: query heads [q_start, q_start + num_heads) and KV
    heads [kv_start, kv_start + num_kv_heads) of the checkpoint's."""
    q_start: int
    num_heads: int
    kv_start: int
    num_kv_heads: int


def split_heads(num_heads: int, num_kv_heads: int, tp_size: int) -> list[HeadShard]:
    """Each rank's attention heads, split by KV-head group so that a rank's query heads attend to its
    own KV heads. With at least as many KV heads as ranks, each rank gets a contiguous range of KV
    heads, counts differing by at most one (the first ranks take the extra: 3 over 2 ranks is 2 + 1),
    with their num_heads / num_kv_heads query heads each. With fewer KV heads than ranks, each KV head
    is replicated on tp / num_kv_heads ranks that split its query heads evenly, so tp must be a
    multiple of num_kv_heads and divide num_heads."""
    if num_heads % num_kv_heads:
        raise ValueError(f"num_attention_heads {num_heads} is not a multiple of num_key_value_heads {num_kv_heads}")
    group = num_heads // num_kv_heads  # query heads per KV head
    if num_kv_heads >= tp_size:
        base, extra = divmod(num_kv_heads, tp_size)
        starts = [r * base + min(r, extra) for r in range(tp_size + 1)]
        return [HeadShard(a * group, (b - a) * group, a, b - a) for a, b in zip(starts, starts[1:])]
    if tp_size % num_kv_heads or num_heads % tp_size:
        valid = [t for t in range(1, num_heads + 1)
                 if t <= num_kv_heads or (t % num_kv_heads == 0 and num_heads % t == 0)]
        raise ValueError(f"tensor_parallel_size {tp_size} cannot split the model's {num_heads} attention heads "
                         f"({num_kv_heads} KV heads): with fewer KV heads than ranks, the size must be a multiple "
                         f"of the KV heads and divide the attention heads; possible sizes: {valid}")
    per_rank, replicas = num_heads // tp_size, tp_size // num_kv_heads
    return [HeadShard(r * per_rank, per_rank, r // replicas, 1) for r in range(tp_size)]


class QKVParallelLinear(ColumnParallelLinear):
    """q, k and v of this rank's heads (`split_heads`), fused: rows [q heads | k heads | v heads]."""

    def __init__(self, hidden_size: int, head_dim: int, num_heads: int, num_kv_heads: int,
                 bias: bool = False, dtype=torch.float32, quant_method=None) -> None:
        self.head_dim = head_dim
        self.shards = split_heads(num_heads, num_kv_heads, get_tp_size())
        self.shard = self.shards[get_tp_rank()]
        self.num_heads, self.num_kv_heads = self.shard.num_heads, self.shard.num_kv_heads
        sizes = [(s.num_heads + 2 * s.num_kv_heads) * head_dim for s in self.shards]
        super().__init__(hidden_size, sum(sizes), bias, dtype, quant_method, rank_sizes=sizes)

    @property
    def q_rank_sizes(self) -> list[int]:
        """Each rank's query width: the input split of the matching row-parallel output projection."""
        return [s.num_heads * self.head_dim for s in self.shards]

    def shard_rows(self, shard_id) -> tuple[int, int | None, int]:
        if shard_id is None:
            raise ValueError("QKVParallelLinear loads q, k and v separately")
        d, shard = self.head_dim, self.shard
        q_size, kv_size = shard.num_heads * d, shard.num_kv_heads * d
        if shard_id == "q":
            return 0, shard.q_start * d, q_size
        return q_size + (0 if shard_id == "k" else kv_size), shard.kv_start * d, kv_size


class RowParallelLinear(LinearBase):
    def __init__(self, in_features: int, out_features: int, bias: bool = False, dtype=torch.float32,
                 quant_method=None, reduce_results: bool = True, rank_sizes: list[int] | None = None) -> None:
        """rank_sizes: each rank's input columns, for an uneven split (default: in_features / tp each)."""
        self.reduce_results = reduce_results
        self.rank_sizes = rank_sizes or _even_split(in_features, get_tp_size(), "input size")
        if sum(self.rank_sizes) != in_features:
            raise ValueError(f"rank_sizes {self.rank_sizes} do not add up to the input size {in_features}")
        super().__init__(self.rank_sizes[get_tp_rank()], out_features, bias, dtype, quant_method)

    def rank_columns(self, loaded: torch.Tensor) -> torch.Tensor:
        """This rank's input columns (the bias and per-row scales are whole on every rank; the bias is
        added once, after the reduction)."""
        start = sum(self.rank_sizes[:self.tp_rank])
        if loaded.dtype == torch.uint8 and loaded.dim() == 3:  # packed GGUF blocks of 32 (K-quants: 256) columns
            from tidal.layers.gguf_kernels import block_values
            qk = block_values(loaded.shape[-1])
            if start % qk or self.in_features % qk:
                raise ValueError(f"GGUF weight: this rank's input columns [{start}, {start + self.in_features}) "
                                 f"are not whole blocks of {qk}; use a tensor_parallel_size that splits on blocks")
            return loaded.narrow(1, start // qk, self.in_features // qk)
        return loaded.narrow(1, start, self.in_features)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        bias = self.bias if self.tp_rank == 0 else None
        out = self.quant_method.apply(self, x, bias)
        if self.reduce_results and self.tp_size > 1:
            out = tensor_model_parallel_all_reduce(out)
        return out
