"""GGUF checkpoints (llama.cpp's format): config, tokenizer and weights of a Llama-family model.

Weights are read with the `gguf` package and dequantized to the requested dtype, tensor by tensor.
llama.cpp stores the Q and K projections with their rows permuted for its RoPE layout (pairs of
adjacent dimensions rotate together); we undo that permutation so the weights match the Hugging Face
layout (the two halves of each head rotate together) that our rotary embedding uses.
"""
from __future__ import annotations

import os
import re
from collections.abc import Iterator

import numpy as np
import torch

_NAME_MAP = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
_LAYER_MAP = {
    "attn_norm": "input_layernorm", "ffn_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj", "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}


def hf_name(gguf_name: str) -> str:
    if gguf_name in _NAME_MAP:
        return _NAME_MAP[gguf_name]
    m = re.fullmatch(r"blk\.(\d+)\.(\w+)\.(weight|bias)", gguf_name)
    if not m or m.group(2) not in _LAYER_MAP:
        raise ValueError(f"GGUF tensor {gguf_name!r} is not supported")
    return f"model.layers.{m.group(1)}.{_LAYER_MAP[m.group(2)]}.{m.group(3)}"


def unpermute_qk(w: torch.Tensor, num_heads: int) -> torch.Tensor:
    """Inverse of llama.cpp's convert-time permutation of Q/K rows (weights [out, in] or biases [out])."""
    shape = w.shape
    return (w.reshape(num_heads, shape[0] // num_heads // 2, 2, *shape[1:])
            .transpose(1, 2).reshape(shape))


_ARCHITECTURES = {"llama": "LlamaForCausalLM", "mistral": "MistralForCausalLM", "qwen2": "Qwen2ForCausalLM"}


def load_gguf_config(path: str):
    from gguf import GGUFReader
    from transformers import AutoConfig
    config = AutoConfig.from_pretrained(os.path.dirname(path), gguf_file=os.path.basename(path))
    model_type = getattr(config, "model_type", None)
    if model_type not in _ARCHITECTURES:
        raise ValueError(f"GGUF architecture {model_type!r} is not supported; supported: {sorted(_ARCHITECTURES)}")
    config.architectures = [_ARCHITECTURES[model_type]]
    # A GGUF file without output.weight shares the embedding matrix with the LM head.
    names = {t.name for t in GGUFReader(path).tensors}
    config.tie_word_embeddings = "output.weight" not in names
    return config


def load_gguf_tokenizer(path: str):
    from transformers import AutoTokenizer
    return AutoTokenizer.from_pretrained(os.path.dirname(path), gguf_file=os.path.basename(path))


def iterate_gguf_weights(path: str, config, dtype: torch.dtype) -> Iterator[tuple[str, torch.Tensor]]:
    from gguf import GGUFReader
    from gguf.quants import dequantize

    reader = GGUFReader(path)
    heads = config.num_attention_heads
    kv_heads = getattr(config, "num_key_value_heads", None) or heads
    for t in reader.tensors:
        name = hf_name(t.name)
        array = dequantize(t.data, t.tensor_type)  # numpy, shape reversed from GGUF's ne order
        w = torch.from_numpy(np.ascontiguousarray(array, dtype=np.float32))
        if ".q_proj." in name:
            w = unpermute_qk(w, heads)
        elif ".k_proj." in name:
            w = unpermute_qk(w, kv_heads)
        yield name, w.to(dtype)
