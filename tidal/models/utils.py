"""Weight-loading helpers shared by the model files."""
from __future__ import annotations

from collections.abc import Iterable

import torch
from torch import nn

from tidal.layers.linear import default_weight_loader


def load_stacked_weights(model: nn.Module, weights: Iterable[tuple[str, torch.Tensor]],
                         stacked_params: list[tuple[str, str, object]], skip: tuple[str, ...] = ()) -> set[str]:
    """Copy checkpoint tensors into the model's parameters, routing q/k/v, gate/up and the like into
    their fused parameter through each parameter's `weight_loader`. Every parameter must be loaded."""
    params = dict(model.named_parameters(remove_duplicate=False))
    loaded: set[str] = set()
    for name, tensor in weights:
        if any(name.endswith(s) for s in skip):
            continue
        for fused, part, shard in stacked_params:
            if f".{part}." in name:
                target = name.replace(f".{part}.", f".{fused}.")
                if target in params:
                    params[target].weight_loader(params[target], tensor, shard)
                    loaded.add(target)
                    break
        else:
            if name not in params:
                raise ValueError(f"checkpoint tensor {name!r} has no place in {type(model).__name__}")
            param = params[name]
            getattr(param, "weight_loader", default_weight_loader)(param, tensor)
            loaded.add(name)
    missing = {n for n in params if n not in loaded} - {n for n in params if any(n.endswith(s) for s in skip)}
    if missing:
        raise ValueError(f"checkpoint is missing weights: {sorted(missing)[:8]}")
    return loaded

