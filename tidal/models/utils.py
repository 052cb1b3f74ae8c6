"""Helpers shared by the model files: weight loading, and the pieces of a pipeline stage (its layer
range, the LM head of the last stage, the checkpoint tensors a stage loads)."""
from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator

import torch
from torch import nn

from tidal.distributed import get_pp_indices, get_pp_rank, get_pp_size, is_last_pp_stage
from tidal.layers.attention.kv_cache_dtype import load_kv_scale
from tidal.layers.embedding import ParallelLMHead, VocabParallelEmbedding
from tidal.layers.linear import default_weight_loader

# static activation scales of FP8 checkpoints: Tidal quantizes activations per token at run time, if at all
_IGNORED_SUFFIXES = (".input_scale",)


def load_stacked_weights(model: nn.Module, weights: Iterable[tuple[str, torch.Tensor]],
                         stacked_params: list[tuple[str, str, object]], skip: tuple[str, ...] = ()) -> set[str]:
    """Copy checkpoint tensors into the model's parameters, routing q/k/v, gate/up and the like into
    their fused parameter through each parameter's `weight_loader`. Every parameter must be loaded."""
    params = dict(model.named_parameters(remove_duplicate=False))
    loaded: set[str] = set()
    for name, tensor in weights:
        if any(name.endswith(s) for s in skip) or name.endswith(_IGNORED_SUFFIXES):
            continue
        if load_kv_scale(model, name, tensor):  # per-layer KV-cache scales, where the checkpoint has them
            continue
        target, shard = _route(name, params, stacked_params)
        if target is None:
            raise ValueError(f"checkpoint tensor {name!r} has no place in {type(model).__name__}")
        _load_one(params[target], tensor, shard)
        loaded.add(target)
    missing = {n for n, p in params.items()
               if n not in loaded and not getattr(p, "computed_at_load", False)  # scales of weights quantized at load
               and not any(n.endswith(s) for s in skip)}
    if missing:
        raise ValueError(f"checkpoint is missing weights: {sorted(missing)[:8]}")
    return loaded


def _route(name: str, params: dict, stacked_params) -> tuple[str | None, object]:
    """(the parameter a checkpoint tensor loads into, its shard id), or (None, None)."""
    for fused, part, shard in stacked_params:
        if f".{part}." in name:
            target = name.replace(f".{part}.", f".{fused}.")
            if target in params:
                return target, shard
    return (name, None) if name in params else (None, None)


def _load_one(param, tensor: torch.Tensor, shard) -> None:
    if shard is None:
        getattr(param, "weight_loader", default_weight_loader)(param, tensor)
    else:
        param.weight_loader(param, tensor, shard)


def reload_stacked_weights(model: nn.Module, weights: Iterable[tuple[str, torch.Tensor]],
                           stacked_params, only: Callable[[nn.Parameter], bool]) -> int:
    """Load again, routed as load_stacked_weights routes them, the checkpoint tensors whose parameter
    `only` accepts (the others are read and dropped); returns how many were loaded."""
    params = dict(model.named_parameters(remove_duplicate=False))
    count = 0
    for name, tensor in weights:
        target, shard = _route(name, params, stacked_params)
        if target is not None and only(params[target]):
            _load_one(params[target], tensor, shard)
            count += 1
    return count


# -- pipeline stages ------------------------------------------------------------------------------------
def make_layers(num_layers: int, build: Callable[[int], nn.Module]) -> tuple[int, int, nn.ModuleList]:
    """(start, end, layers): this pipeline stage's layers [start, end) built by build(i); the others are
    empty placeholders, so parameter names (and layer indices) still match the checkpoint."""
    start, end = get_pp_indices(num_layers, get_pp_rank(), get_pp_size())
    return start, end, nn.ModuleList(build(i) if start <= i < end else nn.Identity() for i in range(num_layers))


def make_lm_head(vocab_size: int, hidden_size: int, dtype, embedding: VocabParallelEmbedding | None,
                 tie: bool) -> tuple[ParallelLMHead | None, bool]:
    """(LM head, whether it shares the embedding's weight): the head exists on the last pipeline stage
    only (None elsewhere). Tied to the embedding when both live on this stage; a tied head whose
    embedding is on the first stage keeps its own copy, loaded from the embedding's checkpoint tensor
    (`stage_weights`)."""
    if not is_last_pp_stage():
        return None, False
    head = ParallelLMHead(vocab_size, hidden_size, dtype)
    if tie and embedding is not None:
        head.tie_to(embedding)
        return head, True
    return head, False


class CausalLM(nn.Module):
    """What the *ForCausalLM classes share around their backbone (the attribute `backbone_name`: the
    embedding, this pipeline stage's layers, the final norm): the LM head, tied to the embedding or not, the
    logits and greedy tokens it computes, and the checkpoint tensors this stage loads."""
    backbone_name = "model"  # the backbone's attribute, and its tensors' prefix in a checkpoint
    embedding_name = "embed_tokens"  # the backbone's embedding

    def init_lm_head(self, config, dtype, tie_default: bool = False) -> None:
        """The LM head (on the last stage), tied to the embedding where config.tie_word_embeddings (else
        tie_default) says so. Call once the backbone is built."""
        self.tie_word_embeddings = bool(getattr(config, "tie_word_embeddings", tie_default))
        embedding = getattr(getattr(self, self.backbone_name), self.embedding_name)
        self.lm_head, self.tied = make_lm_head(config.vocab_size, config.hidden_size, dtype, embedding,
                                               self.tie_word_embeddings)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        return getattr(self, self.backbone_name)(input_ids, positions)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.lm_head.compute_logits(hidden)

    def compute_greedy_tokens(self, hidden: torch.Tensor) -> list[int] | None:
        """The argmax of compute_logits(hidden) per row, where the LM head's kernel finds it (else None)."""
        return self.lm_head.greedy_tokens(hidden)

    def this_stage_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> Iterable[tuple[str, torch.Tensor]]:
        """The checkpoint tensors this pipeline stage loads (`stage_weights`; all of them with one stage)."""
        if get_pp_size() == 1:
            return weights
        backbone, prefix = getattr(self, self.backbone_name), self.backbone_name
        copy = f"{prefix}.{self.embedding_name}.weight" if self.tie_word_embeddings and not self.tied else None
        return stage_weights(self, weights, f"{prefix}.layers.", backbone.start_layer, backbone.end_layer, copy)


def stage_weights(model: nn.Module, weights: Iterable[tuple[str, torch.Tensor]], layers_prefix: str,
                  start: int, end: int, lm_head_copy_of: str | None = None
                  ) -> Iterator[tuple[str, torch.Tensor]]:
    """Only this pipeline stage's checkpoint tensors: layers `<layers_prefix><i>.` outside [start, end)
    and tensors of modules another stage holds (None here: embedding, final norm, LM head) are skipped,
    never copied. lm_head_copy_of: the embedding's checkpoint name when the LM head is tied to it but
    they live on different stages: the LM head loads that tensor as its own copy."""
    for name, tensor in weights:
        if name.startswith(layers_prefix):
            if start <= int(name[len(layers_prefix):].split(".", 1)[0]) < end:
                yield name, tensor
            continue
        if name == lm_head_copy_of and not _held_by_another_stage(model, "lm_head.weight"):
            yield "lm_head.weight", tensor
        if not _held_by_another_stage(model, name):
            yield name, tensor


def _held_by_another_stage(model: nn.Module, name: str) -> bool:
    """Whether the tensor belongs to a module that is None on this stage. A name that matches nothing
    is not: the loader reports it."""
    module: object = model
    for part in name.split(".")[:-1]:
        module = getattr(module, part, _MISSING)
        if module is None:
            return True
        if module is _MISSING:
            return False
    return False


_MISSING = object()
