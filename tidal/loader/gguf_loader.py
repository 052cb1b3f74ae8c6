"""GGUF checkpoints (llama.cpp's format): config, tokenizer and weights of a Llama-family model.

Two ways to load one (`prepare_gguf`): by default (quantization "gguf") the weights stay in the file's
blocks (Q4_0, Q4_1, Q8_0; BF16/F16/F32 tensors as plain tensors) and only the config and tokenizer are
cached, in ~/.cache/tidal/gguf-meta; with quantization "none" (or another scheme, applied to the
dequantized weights) the file is dequantized once into an fp32 Hugging Face folder in ~/.cache/tidal/gguf,
the numerical reference. Weights are read with the `gguf` package, tensor by tensor.
llama.cpp stores the Q and K projections with their rows permuted for its RoPE layout (pairs of
adjacent dimensions rotate together); we undo that permutation so the weights match the Hugging Face
layout (the two halves of each head rotate together) that our rotary embedding uses.
"""
from __future__ import annotations

import logging
import os
import re
from collections.abc import Iterator

import numpy as np
import torch

logger = logging.getLogger(__name__)

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


def _field(reader, key, default=None):
    f = reader.fields.get(key)
    if f is None:
        return default
    value = f.contents()
    return value


def load_gguf_config(path: str):
    """A transformers config built from the GGUF metadata (reading only the header fields)."""
    import transformers
    from gguf import GGUFReader

    reader = GGUFReader(path)
    arch = _field(reader, "general.architecture")
    if arch not in _ARCHITECTURES:
        raise ValueError(f"GGUF architecture {arch!r} is not supported; supported: {sorted(_ARCHITECTURES)}")
    names = {t.name for t in reader.tensors}
    embd = next(t for t in reader.tensors if t.name == "token_embd.weight")
    heads = int(_field(reader, f"{arch}.attention.head_count"))
    kw = dict(
        architectures=[_ARCHITECTURES[arch]],
        vocab_size=int(_field(reader, f"{arch}.vocab_size", int(embd.shape[-1]))),
        hidden_size=int(_field(reader, f"{arch}.embedding_length")),
        intermediate_size=int(_field(reader, f"{arch}.feed_forward_length")),
        num_hidden_layers=int(_field(reader, f"{arch}.block_count")),
        num_attention_heads=heads,
        num_key_value_heads=int(_field(reader, f"{arch}.attention.head_count_kv", heads)),
        max_position_embeddings=int(_field(reader, f"{arch}.context_length", 2048)),
        rms_norm_eps=float(_field(reader, f"{arch}.attention.layer_norm_rms_epsilon", 1e-6)),
        rope_theta=float(_field(reader, f"{arch}.rope.freq_base", 10000.0)),
        bos_token_id=_field(reader, "tokenizer.ggml.bos_token_id"),
        eos_token_id=_field(reader, "tokenizer.ggml.eos_token_id"),
        # A GGUF file without output.weight shares the embedding matrix with the LM head.
        tie_word_embeddings="output.weight" not in names,
    )
    cls = {"llama": transformers.LlamaConfig, "mistral": transformers.MistralConfig,
           "qwen2": transformers.Qwen2Config}[arch]
    config = cls(**kw)
    config.rope_theta = kw["rope_theta"]
    return config


def load_gguf_tokenizer(path: str, use_fast: bool = True):
    """The tokenizer (with its chat template) stored in the GGUF file, via transformers' converter."""
    from transformers import AutoTokenizer
    return AutoTokenizer.from_pretrained(os.path.dirname(path), gguf_file=os.path.basename(path), use_fast=use_fast)


def _has_tokenizer(path: str) -> bool:
    from gguf import GGUFReader
    return "tokenizer.ggml.model" in GGUFReader(path).fields


def convert_gguf(path: str, out_dir: str, weights: bool = True) -> str:
    """Write a GGUF model as a Hugging Face folder (config.json, fp32 model.safetensors unless not
    `weights`, tokenizer files with the chat template). Written to a temporary folder and renamed, so
    concurrent loaders never see half a conversion."""
    import shutil
    import tempfile

    from safetensors.torch import save_file

    config = load_gguf_config(path)
    parent = os.path.dirname(out_dir)
    os.makedirs(parent, exist_ok=True)
    tmp = tempfile.mkdtemp(dir=parent, prefix=".convert-")
    try:
        config.save_pretrained(tmp)
        if _has_tokenizer(path):  # a file without one serves token-id prompts only
            load_gguf_tokenizer(path).save_pretrained(tmp)
        if weights:
            tensors = {name: w.contiguous() for name, w in iterate_gguf_weights(path, config, torch.float32)}
            save_file(tensors, os.path.join(tmp, "model.safetensors"), metadata={"format": "pt"})
        try:
            os.rename(tmp, out_dir)
        except OSError:  # another process finished first
            shutil.rmtree(tmp, ignore_errors=True)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return out_dir


def _cache_folder(path: str, kind: str) -> str:
    st = os.stat(path)
    root = os.environ.get("TIDAL_CACHE_DIR", os.path.join(os.path.expanduser("~"), ".cache", "tidal"))
    name = f"{os.path.basename(path).removesuffix('.gguf')}-{st.st_size}-{int(st.st_mtime)}"
    return os.path.join(root, kind, name)


def cached_conversion(path: str) -> str:
    """The converted folder of a GGUF file, converting it on first use (keyed by name, size, mtime)."""
    out = _cache_folder(path, "gguf")
    if not os.path.exists(os.path.join(out, "model.safetensors")):
        logger.info("Converting %s to %s (once; later loads read the conversion)", path, out)
        convert_gguf(path, out)
    return out


def cached_metadata(path: str) -> str:
    """A folder with the config and tokenizer files of a GGUF file (no weights), written on first use."""
    out = _cache_folder(path, "gguf-meta")
    if not os.path.exists(os.path.join(out, "config.json")):
        convert_gguf(path, out, weights=False)
    return out


def prepare_gguf(path: str, quantization: str | None) -> tuple[str, str | None]:
    """(folder with config and tokenizer, scheme to build the model with) for a GGUF file: "gguf" keeps
    the weights in the file's blocks; None, "none" or another scheme read the dequantized conversion
    (the default until batches of decodes on packed blocks are as fast as on bf16 weights: see
    docs/quantization.md)."""
    if quantization == "gguf":
        return cached_metadata(path), "gguf"
    return cached_conversion(path), None if quantization == "none" else quantization


KEPT_QUANTIZED = ("Q4_0", "Q4_1", "Q8_0")  # block formats loaded as packed blocks
_PLAIN = ("F32", "F16", "BF16")


def open_gguf(path: str):
    """The file's reader (parsing the header of a file with a large vocabulary takes seconds: open once)."""
    from gguf import GGUFReader
    return GGUFReader(path)


def packed_embedding_formats(reader) -> dict[str, int]:
    """{HF name: block bytes} of the embedding / LM-head tables the file (a reader) quantizes."""
    from tidal.layers.gguf_kernels import BLOCK_FORMATS
    out = {}
    for t in reader.tensors:
        if t.name in ("token_embd.weight", "output.weight") and t.tensor_type.name in KEPT_QUANTIZED:
            out[hf_name(t.name)] = BLOCK_FORMATS[t.tensor_type.name][1]
    return out


def iterate_gguf_weights(path, config, dtype: torch.dtype,
                         keep_quantized: bool = False) -> Iterator[tuple[str, torch.Tensor]]:
    """(HF name, tensor) of each tensor of the file (a path or an open_gguf reader), dequantized to dtype;
    with keep_quantized, tensors in the KEPT_QUANTIZED formats come as packed uint8 [rows, K / 32,
    block_bytes] (tidal.layers.gguf_kernels) and other quantized formats are refused by name."""
    from gguf import GGUFReader
    from gguf.quants import dequantize

    reader = GGUFReader(path) if isinstance(path, str) else path
    heads = config.num_attention_heads
    kv_heads = getattr(config, "num_key_value_heads", None) or heads
    for t in reader.tensors:
        name = hf_name(t.name)
        kind = t.tensor_type.name
        if keep_quantized and kind in KEPT_QUANTIZED and t.data.ndim == 2:
            # [rows, row bytes] as stored; a row permutation moves whole rows of blocks
            rows = np.array(t.data)
            w = torch.from_numpy(rows).view(rows.shape[0], -1, rows.shape[1] // (int(t.shape[0]) // 32))
        elif keep_quantized and kind not in _PLAIN:
            raise ValueError(f"GGUF tensor {t.name!r} is of type {kind}, which quantization='gguf' does not run "
                             f"(it runs {', '.join(KEPT_QUANTIZED + _PLAIN)}); quantization='none' dequantizes "
                             "the file at load")
        else:
            array = dequantize(t.data, t.tensor_type)  # numpy, shape reversed from GGUF's ne order
            w = torch.from_numpy(np.array(array, dtype=np.float32))
        if ".q_proj." in name:
            w = unpermute_qk(w, heads)
        elif ".k_proj." in name:
            w = unpermute_qk(w, kv_heads)
        yield name, w if w.dtype == torch.uint8 else w.to(dtype)
