"""Top-k routed mixture of experts (Mixtral, Jamba).

Routing: softmax over all experts (fp32), then the top k; Mixtral renormalises the k weights to sum to
one, Jamba does not (each model passes its config's choice). Experts run batched by expert: token
rows are grouped by the expert they were routed to and each expert multiplies its whole group at once.

Expert weights live stacked, `w13_weight` [E, 2 * I, H] (gate rows then up rows) and `w2_weight`
[E, H, I], and load through per-parameter weight loaders that take this rank's slice of the
intermediate dimension (gate/up by rows, down by columns), so under tensor parallelism each rank holds
every expert's slice and the partial outputs are summed with one all-reduce, like a row-parallel linear.
Checkpoint formats: one tensor per expert and matrix (`experts.<e>.w1|w3|w2.weight` in Mixtral,
`experts.<e>.gate_proj|up_proj|down_proj.weight` in Jamba), or the stacked `experts.gate_up_proj`
[E, 2I, H] / `experts.down_proj` [E, H, I] of newer transformers.
"""
from __future__ import annotations

import re
from collections.abc import Iterable, Iterator

import torch
from torch import nn

from tidal.distributed import get_tp_rank, get_tp_size, tensor_model_parallel_all_reduce
from tidal.layers.activation import SiluAndMul
from tidal.layers.linear import ReplicatedLinear
from tidal.layers.quantization.methods import UnquantizedMoEMethod

# checkpoint matrix name -> our shard name
_EXPERT_SHARDS = {"w1": "gate", "gate_proj": "gate", "w3": "up", "up_proj": "up", "w2": "down", "down_proj": "down"}
_PER_EXPERT = re.compile(r"^(.*\.experts)\.(\d+)\.(w1|w2|w3|gate_proj|up_proj|down_proj)\.(weight|weight_scale)$")
_STACKED = re.compile(r"^(.*\.experts)\.(gate_up_proj|down_proj)$")


def route(router_logits: torch.Tensor, top_k: int, renormalize: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """[T, E] logits -> (weights [T, k] fp32, expert ids [T, k])."""
    probs = torch.softmax(router_logits.float(), dim=-1)
    weights, ids = torch.topk(probs, top_k, dim=-1)
    if renormalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return weights, ids


class FusedMoE(nn.Module):
    """The experts of one MoE layer: x [T, H], routing (weights, ids) [T, k] -> [T, H]."""

    def __init__(self, num_experts: int, hidden_size: int, intermediate_size: int, dtype=torch.float32,
                 reduce_results: bool = True, quant_config=None) -> None:
        """quant_config: a QuantizationConfig (tidal.layers.quantization) whose moe_method stores the
        experts (None: plain weights in dtype)."""
        super().__init__()
        self.act = SiluAndMul()
        tp = get_tp_size()
        if intermediate_size % tp:
            raise ValueError(f"expert intermediate size {intermediate_size} is not divisible by "
                             f"tensor_parallel_size {tp}")
        self.num_experts, self.hidden_size = num_experts, hidden_size
        self.inter = intermediate_size // tp  # this rank's slice
        self.tp_rank, self.tp_size, self.reduce_results = get_tp_rank(), tp, reduce_results
        method = quant_config.moe_method() if quant_config is not None else None
        self.quant_method = method or UnquantizedMoEMethod()
        self.quant_method.create_weights(self, num_experts, hidden_size, self.inter, dtype)
        for p in self.parameters(recurse=False):
            p.weight_loader = self.weight_loader

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor, shard_id: str,
                      expert_id: int | None = None) -> None:
        """shard_id: "gate", "up" or "down"; expert_id None: `loaded` holds all experts stacked. param: a
        weight ([E, rows, cols]) or a scale of a quantized checkpoint ([E, rows]; loaded per tensor or per
        row)."""
        if expert_id is None:
            for e in range(self.num_experts):
                self.weight_loader(param, loaded[e], shard_id, e)
            return
        if not 0 <= expert_id < self.num_experts:
            raise ValueError(f"expert id {expert_id} is outside [0, {self.num_experts})")
        n, r = self.inter, self.tp_rank
        if param.dim() == 2:  # a scale: per row of the output, whole on every rank for "down"
            rows = self.hidden_size if shard_id == "down" else n
            loaded = loaded.reshape(-1).float()
            if loaded.numel() == 1:
                loaded = loaded.expand(rows)
            elif shard_id != "down":
                loaded = loaded.narrow(0, r * n, n)
            self.quant_method.load_expert_rows(self, param, expert_id, 0 if shard_id != "up" else n, loaded)
        elif shard_id == "down":
            self.quant_method.load_expert_rows(self, param, expert_id, 0, loaded.narrow(1, r * n, n))
        else:
            offset = 0 if shard_id == "gate" else n
            self.quant_method.load_expert_rows(self, param, expert_id, offset, loaded.narrow(0, r * n, n))

    def forward(self, x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        T, k = ids.shape
        flat_ids = ids.flatten()
        order = torch.argsort(flat_ids, stable=True)  # (token, slot) pairs grouped by expert
        # the grouping loop needs the counts on the host: on a GPU, one wait per MoE layer
        counts = torch.bincount(flat_ids, minlength=self.num_experts).tolist()
        flat_weights = weights.flatten()
        out = torch.zeros(T, self.hidden_size, dtype=x.dtype, device=x.device)
        start = 0
        for e, n in enumerate(counts):
            if n == 0:
                continue
            pairs = order[start:start + n]
            start += n
            tokens = pairs // k
            # [n, 2I] -> [n, I]: the fused kernel computes each row alone (torch's elementwise ops split a
            # tensor between threads by element count, and an element at a split takes their scalar path,
            # which rounds differently: a row's bits would depend on how many rows its expert takes)
            act = self.act(self.quant_method.expert_linear(self, x[tokens], "w13", e))
            h = self.quant_method.expert_linear(self, act, "w2", e)                  # [n, H]
            out.index_add_(0, tokens, (h * flat_weights[pairs, None]).to(x.dtype))
        if self.reduce_results and self.tp_size > 1:
            out = tensor_model_parallel_all_reduce(out)
        return out


class SparseMoeBlock(nn.Module):
    """Router + experts. `router_name` matches the checkpoint: "gate" (Mixtral) or "router" (Jamba)."""

    def __init__(self, hidden_size: int, intermediate_size: int, num_experts: int, top_k: int,
                 renormalize: bool, router_name: str = "gate", dtype=torch.float32, quant_config=None) -> None:
        """quant_config: quantizes the experts (the router stays in the model dtype)."""
        super().__init__()
        if not 1 <= top_k <= num_experts:
            raise ValueError(f"num_experts_per_tok must be in [1, {num_experts}], got {top_k}")
        self.top_k, self.renormalize, self.router_name = top_k, renormalize, router_name
        setattr(self, router_name, ReplicatedLinear(hidden_size, num_experts, bias=False, dtype=dtype))
        self.experts = FusedMoE(num_experts, hidden_size, intermediate_size, dtype, quant_config=quant_config)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        logits = getattr(self, self.router_name)(x)  # [T, E]
        weights, ids = route(logits, self.top_k, self.renormalize)
        return self.experts(x, weights, ids)


def split_expert_weights(model: nn.Module, weights: Iterable[tuple[str, torch.Tensor]]
                         ) -> Iterator[tuple[str, torch.Tensor]]:
    """Load expert tensors straight into their FusedMoE parameters and pass every other tensor on.
    Raises at the end if some expert matrix of some layer was never loaded."""
    moes = {name: m for name, m in model.named_modules() if isinstance(m, FusedMoE)}
    loaded: set[tuple[str, int | None, str]] = set()
    for name, tensor in weights:
        m = _PER_EXPERT.match(name)
        scale = False
        if m:
            prefix, expert, shard = m.group(1), int(m.group(2)), _EXPERT_SHARDS[m.group(3)]
            scale = m.group(4) == "weight_scale"  # an FP8 checkpoint's scale of that matrix
        elif (m := _STACKED.match(name)) and m.group(1) in moes:
            prefix, expert, shard = m.group(1), None, m.group(2)
        else:
            yield name, tensor
            continue
        if prefix not in moes:
            raise ValueError(f"checkpoint tensor {name!r} has no place in {type(model).__name__}")
        moe = moes[prefix]
        if scale:
            target = getattr(moe, "w2_scale" if shard == "down" else "w13_scale", None)
            if target is None:
                raise ValueError(f"checkpoint tensor {name!r} is a quantization scale, and the experts of "
                                 f"{prefix} are not quantized")
            moe.weight_loader(target, tensor, shard, expert)
        elif shard == "gate_up_proj":  # stacked [E, 2I, H]: gate rows then up rows
            gate, up = tensor.chunk(2, dim=1)
            moe.weight_loader(moe.w13_weight, gate, "gate")
            moe.weight_loader(moe.w13_weight, up, "up")
            loaded.update((prefix, e, s) for e in range(moe.num_experts) for s in ("gate", "up"))
        elif shard == "down_proj":  # stacked [E, H, I]
            moe.weight_loader(moe.w2_weight, tensor, "down")
            loaded.update((prefix, e, "down") for e in range(moe.num_experts))
        else:
            moe.weight_loader(moe.w2_weight if shard == "down" else moe.w13_weight, tensor, shard, expert)
            loaded.add((prefix, expert, shard))
    missing = [(p, e, s) for p, moe in moes.items() for e in range(moe.num_experts)
               for s in ("gate", "up", "down") if (p, e, s) not in loaded]
    if missing:
        raise ValueError(f"checkpoint is missing expert weights: {missing[:4]}")
