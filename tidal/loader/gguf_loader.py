"""GGUF checkpoints (llama.cpp's format): config, tokenizer and weights of a Llama-family model.

Two ways to load one (`prepare_gguf`): by default (quantization "gguf") the weights stay in the file's
blocks (the KEPT_QUANTIZED formats below; BF16/F16/F32 tensors as plain tensors) and only the config and tokenizer are
cached, in ~/.cache/tidal/gguf-meta; with quantization "none" (or another scheme, applied to the
dequantized weights) the file is dequantized once into an fp32 Hugging Face folder in ~/.cache/tidal/gguf,
the numerical reference. Weights are read with the `gguf` package, tensor by tensor.
llama.cpp's converter stores the Q and K projections of its Llama family (GGUF architecture "llama":
Llama, Mistral, Mixtral...) with their rows permuted for its RoPE layout (pairs of adjacent dimensions
rotate together); we undo that permutation so the weights match the Hugging Face layout (the two halves
of each head rotate together) that our rotary embedding uses. Qwen2 files are written unpermuted (llama.cpp
runs that architecture with NeoX-style RoPE), so their rows are taken as they are, as transformers' GGUF
loader does. Llama-3.x files carry `rope_freqs.weight` (head_dim / 2 divisors of the RoPE frequencies,
llama.cpp's form of rope_scaling "llama3"): it goes into the config as `rope_freq_factors`, which the
rotary embedding applies, and is not a weight.
"""
from __future__ import annotations

import json
import logging
import os
import re
from collections.abc import Iterator

import numpy as np
import torch

from tidal.native import cache_dir

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


# GGUF architectures whose Q/K rows llama.cpp's converter permutes (its LlamaModel family). "mistral" is no
# llama.cpp architecture (llama.cpp writes Mistral models as "llama"); a file that names it is taken to hold
# the llama layout too.
_PERMUTED_QK = ("llama", "mistral")
# tensors that configure the model rather than being weights: read into the config by load_gguf_config
_CONFIG_TENSORS = ("rope_freqs.weight",)


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


def _rope_freq_factors(reader, head_dim: int) -> list[float] | None:
    """The file's rope_freqs tensor (llama.cpp writes it for rope_scaling "llama3": each frequency of the
    rotary embedding is divided by its factor), as floats, or None."""
    from gguf.quants import dequantize
    t = next((t for t in reader.tensors if t.name == "rope_freqs.weight"), None)
    if t is None:
        return None
    factors = np.asarray(dequantize(t.data, t.tensor_type), dtype=np.float32).reshape(-1)
    if factors.size != head_dim // 2:
        raise ValueError(f"GGUF tensor 'rope_freqs.weight' has {factors.size} factors; a head dimension of "
                         f"{head_dim} needs {head_dim // 2}")
    if np.all(factors == 1.0):
        return None
    return [float(f) for f in factors]


def _rope_scaling(reader, arch: str) -> dict | None:
    """rope_scaling from the file's `{arch}.rope.scaling.*` keys: none or linear (llama.cpp's converter writes
    these for a linear rope_scaling; Llama-3 scaling comes as the rope_freqs tensor instead)."""
    kind = _field(reader, f"{arch}.rope.scaling.type")
    factor = _field(reader, f"{arch}.rope.scaling.factor")
    if kind is None and factor is not None and float(factor) != 1.0:
        kind = "linear"  # older files: a factor without a type
    if kind in (None, "none") or (kind == "linear" and (factor is None or float(factor) == 1.0)):
        return None
    if kind == "linear":
        return {"rope_type": "linear", "factor": float(factor)}
    raise ValueError(f"GGUF file's RoPE scaling {kind!r} is not supported (supported: none, linear, and Llama-3 "
                     "scaling as a rope_freqs tensor)")


def _eos_ids(reader) -> list[int]:
    """The ids that end a turn: tokenizer.ggml.eos_token_id, then the end-of-turn and end-of-message tokens
    (Llama-3 instruct's <|eot_id|>, <|eom_id|>) the file names."""
    ids: list[int] = []
    for key in ("eos_token_id", "eot_token_id", "eom_token_id"):
        t = _field(reader, f"tokenizer.ggml.{key}")
        if t is not None and int(t) not in ids:
            ids.append(int(t))
    return ids


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
    hidden = int(_field(reader, f"{arch}.embedding_length"))
    # head dim: attention.key_length (the converter writes it when the HF config has head_dim), else the rotary
    # dimension (the whole head in these architectures), else hidden / heads
    rope_dim = _field(reader, f"{arch}.rope.dimension_count")
    head_dim = int(_field(reader, f"{arch}.attention.key_length",
                          rope_dim if rope_dim is not None else hidden // heads))
    value_dim = int(_field(reader, f"{arch}.attention.value_length", head_dim))
    if value_dim != head_dim:
        raise ValueError(f"GGUF file's attention value length {value_dim} differs from its key length {head_dim}: "
                         "not supported")
    if rope_dim is not None and int(rope_dim) != head_dim:
        raise ValueError(f"GGUF file's RoPE dimension {rope_dim} is not its head dimension {head_dim} (partial "
                         "rotary embedding): not supported")
    eos = _eos_ids(reader)
    kw = dict(
        architectures=[_ARCHITECTURES[arch]],
        vocab_size=int(_field(reader, f"{arch}.vocab_size", int(embd.shape[-1]))),
        hidden_size=hidden,
        head_dim=head_dim,
        intermediate_size=int(_field(reader, f"{arch}.feed_forward_length")),
        num_hidden_layers=int(_field(reader, f"{arch}.block_count")),
        num_attention_heads=heads,
        num_key_value_heads=int(_field(reader, f"{arch}.attention.head_count_kv", heads)),
        max_position_embeddings=int(_field(reader, f"{arch}.context_length", 2048)),
        rms_norm_eps=float(_field(reader, f"{arch}.attention.layer_norm_rms_epsilon", 1e-6)),
        rope_theta=float(_field(reader, f"{arch}.rope.freq_base", 10000.0)),
        bos_token_id=_field(reader, "tokenizer.ggml.bos_token_id"),
        # every id that ends a turn (the engine stops on each; a list when the file names end-of-turn tokens)
        eos_token_id=None if not eos else eos[0] if len(eos) == 1 else eos,
        # A GGUF file without output.weight shares the embedding matrix with the LM head.
        tie_word_embeddings="output.weight" not in names,
    )
    if arch in _PERMUTED_QK:  # Qwen2 always has q/k/v biases (its config has no switch)
        kw["attention_bias"] = "blk.0.attn_q.bias" in names
    if arch == "mistral":  # GGUF states a sliding window only where the model has one
        kw["sliding_window"] = _field(reader, f"{arch}.attention.sliding_window")
        if kw["sliding_window"] is not None:
            kw["sliding_window"] = int(kw["sliding_window"])
    scaling = _rope_scaling(reader, arch)
    if scaling is not None:
        kw["rope_scaling"] = scaling
    cls = {"llama": transformers.LlamaConfig, "mistral": transformers.MistralConfig,
           "qwen2": transformers.Qwen2Config}[arch]
    config = cls(**kw)
    config.rope_theta = kw["rope_theta"]
    factors = _rope_freq_factors(reader, head_dim)
    if factors is not None:
        config.rope_freq_factors = factors
    return config


def load_gguf_tokenizer(path: str, use_fast: bool = True):
    """The tokenizer (with its chat template) stored in the GGUF file: read from the files its first
    conversion wrote (cached_metadata; the default model's 49,152 tokens: 0.2 s against 9 s through
    transformers' converter, which parses the file's metadata in Python). The slow tokenizer, which
    those files may not hold, and that of a file Tidal cannot convert are converted each time."""
    from transformers import AutoTokenizer
    if use_fast:
        try:
            folder = cached_metadata(path)
        except ValueError:  # a model Tidal does not run, whose tokenizer serves another model: converted here
            folder = None
        if folder is not None and os.path.exists(os.path.join(folder, "tokenizer_config.json")):
            return AutoTokenizer.from_pretrained(folder)
    return _convert_gguf_tokenizer(path, use_fast)


def _convert_gguf_tokenizer(path: str, use_fast: bool = True):
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
            _convert_gguf_tokenizer(path).save_pretrained(tmp)
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


# bumped when a conversion's content changes (2: Qwen2 Q/K rows no longer un-permuted, rope_freqs, head_dim
# and end-of-turn ids read), so that folders converted by an older Tidal are not reused
_CONVERSION_VERSION = 2

# the name of a folder this Tidal reads: the file's name, 20 hex digits of its sha256 and the version
_CURRENT_NAME = re.compile(rf"-[0-9a-f]{{20}}-v{_CONVERSION_VERSION}$")


def content_digest(path: str) -> str:
    """The sha256 of a file's bytes (hex), hashed once per file: remembered in the cache under the file's
    real path with its size, mtime and inode, so a later load only stats the file (the default model: 98 MB
    hashed in ~0.1 s). Content, not the file's name and mtime, keys the conversions, so the same file
    installed again (a new virtual environment, a reinstalled wheel) reuses its conversion."""
    import hashlib

    real = os.path.realpath(path)
    st = os.stat(real)
    stamp = [real, st.st_size, st.st_mtime_ns, st.st_ino]
    memo = os.path.join(cache_dir(), "digests", hashlib.sha256(real.encode()).hexdigest()[:32] + ".json")
    try:
        with open(memo) as f:
            known = json.load(f)
        if known["stamp"] == stamp:
            return known["sha256"]
    except (OSError, ValueError, KeyError, TypeError):
        pass
    with open(real, "rb") as f:
        digest = hashlib.file_digest(f, "sha256").hexdigest()
    try:
        os.makedirs(os.path.dirname(memo), exist_ok=True)
        tmp = f"{memo}.{os.getpid()}"
        with open(tmp, "w") as f:
            json.dump({"stamp": stamp, "sha256": digest}, f)
        os.replace(tmp, memo)
    except OSError:  # a read-only cache: hashed again next time
        pass
    return digest


def _cache_folder(path: str, kind: str) -> str:
    name = f"{os.path.basename(path).removesuffix('.gguf')}-{content_digest(path)[:20]}-v{_CONVERSION_VERSION}"
    return os.path.join(cache_dir(), kind, name)


def _remove_stale(out: str) -> None:
    """Remove the folders beside a new conversion that this Tidal never reads: those of another conversion
    version and those named by the former key, the file's size and mtime (each reinstall made a new one)."""
    import shutil

    parent = os.path.dirname(out)
    for name in os.listdir(parent):
        folder = os.path.join(parent, name)
        if name.startswith(".") or not os.path.isdir(folder):
            continue
        if re.search(r"-v\d+$", name) and not _CURRENT_NAME.search(name):
            logger.info("Removing %s (a conversion this version of Tidal does not read)", folder)
            shutil.rmtree(folder, ignore_errors=True)
            for suffix in (".unkept-formats", ".tensors.json"):
                try:
                    os.remove(folder + suffix)
                except OSError:
                    pass


def cached_conversion(path: str) -> str:
    """The converted folder of a GGUF file, converting it on first use (keyed by name and content)."""
    out = _cache_folder(path, "gguf")
    if not os.path.exists(os.path.join(out, "model.safetensors")):
        logger.info("Converting %s to %s (once; later loads read the conversion)", path, out)
        convert_gguf(path, out)
        _remove_stale(out)
    return out


def cached_metadata(path: str) -> str:
    """A folder with the config and tokenizer files of a GGUF file (no weights), written on first use."""
    out = _cache_folder(path, "gguf-meta")
    if not os.path.exists(os.path.join(out, "config.json")):
        convert_gguf(path, out, weights=False)
        _remove_stale(out)
    return out


def prepare_gguf(path: str, quantization: str | None) -> tuple[str, str | None]:
    """(folder with config and tokenizer, scheme to build the model with) for a GGUF file: "gguf", and
    None (the default, as vLLM) for a file whose quantized tensors are all in KEPT_QUANTIZED formats, keep
    the weights in the file's blocks; "none", or another scheme applied to the dequantized weights, read
    the dequantized conversion (the numerical reference), as does None for a file with other formats."""
    if quantization is None:
        other = unkept_formats(path)
        if other:
            logger.info("%s has tensors in %s, which are not kept quantized: dequantizing the file at load",
                        os.path.basename(path), ", ".join(other))
        quantization = "none" if other else "gguf"
    if quantization == "gguf":
        return cached_metadata(path), "gguf"
    return cached_conversion(path), None if quantization == "none" else quantization


def unkept_formats(path: str) -> list[str]:
    """The quantized formats of the file's tensors that quantization "gguf" does not run (read from the
    header once per file and remembered beside its cached metadata folder)."""
    marker = _cache_folder(path, "gguf-meta") + ".unkept-formats"
    try:
        with open(marker) as f:
            return f.read().split()
    except OSError:
        pass
    reader = open_gguf(path)
    other = sorted({t.tensor_type.name for t in reader.tensors} - set(KEPT_QUANTIZED) - set(_PLAIN))
    try:
        os.makedirs(os.path.dirname(marker), exist_ok=True)
        tmp = f"{marker}.{os.getpid()}"
        with open(tmp, "w") as f:
            f.write(" ".join(other))
        os.replace(tmp, marker)
    except OSError:  # a read-only cache: read the header again next time
        pass
    return other


# block formats loaded as packed blocks (tidal.layers.gguf_kernels.BLOCK_FORMATS)
KEPT_QUANTIZED = ("Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0", "Q4_K", "Q5_K", "Q6_K")
_PLAIN = ("F32", "F16", "BF16")


def open_gguf(path: str):
    """The file's tensors: a reader with `.tensors` (name, tensor_type, shape, data as numpy views of the
    memory-mapped file). The first open parses the header with the `gguf` package (seconds for a large
    vocabulary) and keeps an index of the tensors beside the cached metadata; later opens read the index
    and map the file, without parsing the header."""
    index_path = _cache_folder(path, "gguf-meta") + ".tensors.json"
    try:
        with open(index_path) as f:
            return IndexedGGUF(path, json.load(f))
    except (OSError, ValueError, KeyError, TypeError):
        pass
    from gguf import GGUFReader
    reader = GGUFReader(path)
    entries = [{"name": t.name, "type": int(t.tensor_type), "shape": [int(n) for n in t.shape],
                "offset": int(t.data_offset), "dtype": t.data.dtype.str, "data_shape": list(t.data.shape)}
               for t in reader.tensors]
    try:
        os.makedirs(os.path.dirname(index_path), exist_ok=True)
        tmp = f"{index_path}.{os.getpid()}"
        with open(tmp, "w") as f:
            json.dump(entries, f)
        os.replace(tmp, index_path)
    except OSError:  # a read-only cache: parse the header again next time
        pass
    return reader


class IndexedGGUF:
    """A GGUF file's tensors from open_gguf's index: each a view of one read-only mapping of the file, as
    the `gguf` package's reader gives them (quantized: uint8 [rows, row bytes]; plain: their dtype, shape in
    row-major order)."""

    def __init__(self, path: str, entries: list[dict]) -> None:
        from types import SimpleNamespace

        from gguf import GGMLQuantizationType
        raw = np.memmap(path, dtype=np.uint8, mode="r")
        self.tensors = []
        for e in entries:
            dtype, shape = np.dtype(e["dtype"]), tuple(e["data_shape"])
            nbytes = int(np.prod(shape)) * dtype.itemsize
            if e["offset"] + nbytes > raw.shape[0]:
                raise ValueError(f"GGUF index of {path} does not fit the file")
            data = raw[e["offset"]:e["offset"] + nbytes].view(dtype).reshape(shape)
            self.tensors.append(SimpleNamespace(name=e["name"], tensor_type=GGMLQuantizationType(e["type"]),
                                                shape=np.array(e["shape"], dtype=np.uint64), data=data))


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
    with keep_quantized, tensors in the KEPT_QUANTIZED formats come as packed uint8 [rows, K / QK,
    block_bytes] (tidal.layers.gguf_kernels; QK 32, or 256 for K-quants) and other quantized formats are
    refused by name."""
    from gguf import GGUFReader
    from gguf.quants import dequantize

    reader = GGUFReader(path) if isinstance(path, str) else path
    heads = config.num_attention_heads
    kv_heads = getattr(config, "num_key_value_heads", None) or heads
    permuted = getattr(config, "model_type", "llama") in _PERMUTED_QK
    for t in reader.tensors:
        if t.name in _CONFIG_TENSORS:  # read into the config (load_gguf_config)
            continue
        name = hf_name(t.name)
        kind = t.tensor_type.name
        if keep_quantized and kind in KEPT_QUANTIZED and t.data.ndim == 2:
            # [rows, row bytes] as stored; a row permutation moves whole rows of blocks
            from tidal.layers.gguf_kernels import BLOCK_FORMATS, BLOCK_VALUES
            rows, K = np.array(t.data), int(t.shape[0])
            qk, block_bytes = BLOCK_VALUES[kind], BLOCK_FORMATS[kind][1]
            if K % qk or rows.shape[1] != K // qk * block_bytes:
                raise ValueError(f"GGUF tensor {t.name!r} of type {kind}: its rows of {K} values are not whole "
                                 f"blocks of {qk}")
            w = torch.from_numpy(rows).view(rows.shape[0], -1, block_bytes)
        elif keep_quantized and kind not in _PLAIN:
            raise ValueError(f"GGUF tensor {t.name!r} is of type {kind}, which quantization='gguf' does not run "
                             f"(it runs {', '.join(KEPT_QUANTIZED + _PLAIN)}); quantization='none' dequantizes "
                             "the file at load")
        else:
            array = dequantize(t.data, t.tensor_type)  # numpy, shape reversed from GGUF's ne order
            w = torch.from_numpy(np.array(array, dtype=np.float32))
        if permuted and ".q_proj." in name:
            w = unpermute_qk(w, heads)
        elif permuted and ".k_proj." in name:
            w = unpermute_qk(w, kv_heads)
        yield name, w if w.dtype == torch.uint8 else w.to(dtype)
