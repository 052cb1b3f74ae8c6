"""Maps `config.architectures` names to model classes. Unsupported architectures are refused by name."""
from __future__ import annotations

import importlib

_MODELS = {
    "LlamaForCausalLM": ("llama", "LlamaForCausalLM"),
    "MistralForCausalLM": ("llama", "LlamaForCausalLM"),
    "Qwen2ForCausalLM": ("llama", "LlamaForCausalLM"),
    "MixtralForCausalLM": ("mixtral", "MixtralForCausalLM"),
    "MambaForCausalLM": ("mamba", "MambaForCausalLM"),
    "JambaForCausalLM": ("jamba", "JambaForCausalLM"),
}


def register_model(arch: str, module: str, cls: str) -> None:
    _MODELS[arch] = (module, cls)


def supported_architectures() -> list[str]:
    return sorted(_MODELS)


def resolve_model_class(config) -> type:
    archs = getattr(config, "architectures", None) or []
    for arch in archs:
        if arch in _MODELS:
            module, cls = _MODELS[arch]
            return getattr(importlib.import_module(f"tidal.models.{module}"), cls)
    raise ValueError(f"model architecture {archs or '(none given)'} is not supported; "
                     f"supported: {', '.join(supported_architectures())}")
