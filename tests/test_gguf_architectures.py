"""GGUF files of each supported architecture load right, on both paths (quantization "none": dequantized to
an fp32 HF folder; "gguf": the file's tensors loaded as they are, Q8_0 as packed blocks).

Tiny random HF models (Llama with a head_dim beyond hidden / heads, Qwen2 with q/k/v biases, a Llama-3 with
rope_scaling "llama3" and attention biases, a linear RoPE scaling, Mistral) are written as GGUF files the way
llama.cpp's convert_hf_to_gguf.py writes them: F16 matrices (the weights rounded to fp16 first, so the file is
exact), F32 or Q8_0 blocks, norms and biases in F32; Q/K rows (and biases) permuted for its Llama family only,
not for Qwen2; for the Llama-3 the `rope_freqs` tensor of frequency divisors. Tidal's greedy tokens and prompt
logprobs must equal the original fp32 HF model's and, where transformers' GGUF loading reads the file,
transformers'. (transformers drops rope_freqs and the linear rope.scaling keys, building a default RoPE, so
those files are checked against the original model only; it cannot load a "mistral" file with gguf 0.19.) Then
the metadata: context length, RoPE base, head dim, rms eps, BOS/EOS and end-of-turn ids, chat template.
"""
from __future__ import annotations

import json
import math
import os

import numpy as np
import pytest
import torch

from tests.helpers import TEST_KV_CACHE_BYTES, hf_greedy, hf_prompt_logprobs, random_prompts, tiny_config
from tidal import LLM, SamplingParams

# old context 64 (not Llama 3.1's 8192) so that the scaling reaches the tiny model's positions: with head_dim 16
# and base 10000 the factors are 1 (three frequencies), between 1 and 8 (two) and 8 (three)
LLAMA3_ROPE = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
               "original_max_position_embeddings": 64, "rope_theta": 10000.0}

# name -> (HF arch, config overrides, GGUF architecture, general.name, matrix type, transformers reads it)
CASES = {
    "llama": ("llama", {"head_dim": 32}, "llama", "Tiny Llama", "F16", True),
    "qwen2": ("qwen2", {}, "qwen2", "Tiny Qwen2", "F16", True),
    # blocks kept packed on the "gguf" path (rows of Q8_0 blocks): checked against transformers' GGUF load only
    "qwen2-q8_0": ("qwen2", {}, "qwen2", "Tiny Qwen2", "Q8_0", True),
    "llama3-rope-freqs": ("llama", {"rope_parameters": LLAMA3_ROPE, "attention_bias": True}, "llama",
                          "Tiny Llama 3.1", "F32", False),
    # linear RoPE scaling: rope.scaling.type / factor in the metadata (transformers' GGUF loader ignores them)
    "llama-linear-rope": ("llama", {"rope_parameters": {"rope_type": "linear", "factor": 4.0, "rope_theta": 1e4}},
                          "llama", "Tiny Llama", "F32", False),
    # llama.cpp writes Mistral models as "llama" (transformers reads those as Mistral by the name)
    "mistral": ("mistral", {"sliding_window": None}, "llama", "Tiny mistral", "F32", True),
    # "mistral" is no llama.cpp architecture; transformers names it but cannot load it with gguf 0.19
    "mistral-arch": ("mistral", {"sliding_window": None}, "mistral", "Tiny Mistral", "F16", False),
}

PROMPTS = random_prompts(3, 8, 48, 512, seed=5)
MAX_TOKENS = 8
PARAMS = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, prompt_logprobs=0, ignore_eos=True)


def make_hf_model(arch: str, overrides: dict, fp16_exact: bool, seed: int = 0):
    import transformers
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(tiny_config(arch, **overrides), dtype=torch.float32)
    with torch.no_grad():  # wider than HF's init, biases included (HF zeroes them)
        for name, p in model.named_parameters():
            if p.dim() > 1 or name.endswith(".bias"):
                p.normal_(0, 0.08)
            if fp16_exact:
                p.copy_(p.half().float())
    return model.eval()


def llama_cpp_permute(w: np.ndarray, n_head: int) -> np.ndarray:
    """convert_hf_to_gguf.py's LlamaModel.permute (rows of Q, or of K with n_head = the KV heads)."""
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def llama3_rope_factors(rope: dict, head_dim: int) -> np.ndarray:
    """convert_hf_to_gguf.py's LlamaModel.generate_extra_tensors for rope_type llama3. (The converter reads the
    old context length from the top level of config.json, 8192 when absent, not from rope_scaling; Llama 3.x
    has 8192 in both. Here it is the model's own 64, as if stated at the top level.)"""
    base = rope["rope_theta"]
    freqs = 1.0 / (base ** (torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim))
    factor, low, high = rope["factor"], rope["low_freq_factor"], rope["high_freq_factor"]
    old = rope["original_max_position_embeddings"]
    out = []
    for freq in freqs:
        wavelen = 2 * math.pi / freq
        if wavelen < old / high:
            out.append(1)
        elif wavelen > old / low:
            out.append(factor)
        else:
            smooth = (old / wavelen - low) / (high - low)
            out.append(1 / ((1 - smooth) / factor + smooth))
    return torch.tensor(out, dtype=torch.float32).numpy()


CHAT_TEMPLATE = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
                 "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


def byte_level_vocab(size: int) -> tuple[list[str], list[int], list[str]]:
    """(tokens, token types, merges) of a tiny GPT-2-style byte-level BPE vocabulary: three control tokens
    (<|endoftext|>, <|im_start|>, <|im_end|>), the 256 bytes, two merges, unused tokens up to size."""
    from transformers.convert_slow_tokenizer import bytes_to_unicode
    tokens = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", *bytes_to_unicode().values(), "\u0120t", "hi"]
    types = [3] * 3 + [1] * (len(tokens) - 3) + [5] * (size - len(tokens))
    return tokens + [f"<unused{i}>" for i in range(size - len(tokens))], types, ["\u0120 t", "h i"]


def write_like_llama_cpp(model, path: str, gguf_arch: str, name: str, fmt: str, extra_kv: dict | None = None,
                         tokenizer: bool = False, eos: int = 2) -> str:
    """The model as llama.cpp's converter writes it; tokenizer: a byte-level BPE vocabulary with a chat
    template (else the token list alone)."""
    from gguf import GGMLQuantizationType, GGUFWriter, RopeScalingType, quants
    cfg = model.config
    hparams = cfg.to_dict()
    heads, kv_heads = cfg.num_attention_heads, cfg.num_key_value_heads
    head_dim = hparams.get("head_dim") or cfg.hidden_size // heads
    rope = getattr(cfg, "rope_parameters", None) or {}
    writer = GGUFWriter(path, gguf_arch)
    writer.add_name(name)
    writer.add_block_count(cfg.num_hidden_layers)
    writer.add_context_length(cfg.max_position_embeddings)
    writer.add_embedding_length(cfg.hidden_size)
    writer.add_feed_forward_length(cfg.intermediate_size)
    writer.add_head_count(heads)
    writer.add_head_count_kv(kv_heads)
    writer.add_rope_freq_base(float(rope.get("rope_theta", 10000.0)))
    writer.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    if hparams.get("head_dim") is not None:
        writer.add_key_length(head_dim)
        writer.add_value_length(head_dim)
    permute = gguf_arch != "qwen2"  # the LlamaModel family
    if permute:
        writer.add_vocab_size(cfg.vocab_size)
        writer.add_rope_dimension_count(head_dim)
    # llama.cpp always writes the vocabulary (Qwen2 files state its size only through it); without a tokenizer
    # model the tokens alone: prompts are token ids
    if tokenizer:
        tokens, types, merges = byte_level_vocab(cfg.vocab_size)
        writer.add_tokenizer_model("gpt2")
        writer.add_tokenizer_pre("default")
        writer.add_token_list(tokens)
        writer.add_token_types(types)
        writer.add_token_merges(merges)
        writer.add_add_bos_token(False)
        writer.add_chat_template(CHAT_TEMPLATE)
    else:
        writer.add_token_list([f"<t{i}>" for i in range(cfg.vocab_size)])
    writer.add_bos_token_id(1)
    writer.add_eos_token_id(eos)
    for key, value in (extra_kv or {}).items():
        if isinstance(value, str):
            writer.add_string(key, value)
        else:
            writer.add_uint32(key, value)
    if rope.get("rope_type") == "linear":
        writer.add_rope_scaling_type(RopeScalingType.LINEAR)
        writer.add_rope_scaling_factor(rope["factor"])
    if rope.get("rope_type") == "llama3":
        writer.add_tensor("rope_freqs.weight", llama3_rope_factors(rope, head_dim))

    top = {"model.embed_tokens.weight": "token_embd.weight", "model.norm.weight": "output_norm.weight",
           "lm_head.weight": "output.weight"}
    layer = {"input_layernorm": "attn_norm", "post_attention_layernorm": "ffn_norm", "self_attn.q_proj": "attn_q",
             "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v", "self_attn.o_proj": "attn_output",
             "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up", "mlp.down_proj": "ffn_down"}
    for hf, t in model.state_dict().items():
        if hf in top:
            gname = top[hf]
        else:
            _, _, i, *rest = hf.split(".")
            module, kind = ".".join(rest[:-1]), rest[-1]
            gname = f"blk.{i}.{layer[module]}.{kind}"
        w = t.detach().float().numpy()
        if permute and ".attn_q." in gname:
            w = llama_cpp_permute(w, heads)
        elif permute and ".attn_k." in gname:
            w = llama_cpp_permute(w, kv_heads)
        if fmt == "Q8_0" and w.ndim == 2:
            writer.add_tensor(gname, quants.quantize(w, GGMLQuantizationType.Q8_0),
                              raw_dtype=GGMLQuantizationType.Q8_0)
        else:
            writer.add_tensor(gname, w.astype(np.float16) if fmt == "F16" and w.ndim == 2 else w)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def _tidal(path: str, quantization: str) -> tuple[list[list[int]], torch.Tensor]:
    llm = LLM(path, dtype="float32", quantization=quantization, kv_cache_memory_bytes=TEST_KV_CACHE_BYTES)
    assert llm.llm_engine.quantization == (None if quantization == "none" else quantization)
    outs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], PARAMS, use_tqdm=False)
    logprobs = [o.prompt_logprobs[i][p[i]].logprob for o, p in zip(outs, PROMPTS) for i in range(1, len(p))]
    return [list(o.outputs[0].token_ids) for o in outs], torch.tensor(logprobs)


def _transformers(model) -> tuple[list[list[int]], torch.Tensor]:
    tokens = [hf_greedy(model, p, MAX_TOKENS) for p in PROMPTS]
    return tokens, torch.tensor([lp for p in PROMPTS for lp in hf_prompt_logprobs(model, p)])


@pytest.mark.parametrize("case", list(CASES))
def test_gguf_file_equals_original_model(cache_dir, case):
    arch, overrides, gguf_arch, name, fmt, transformers_reads = CASES[case]
    model = make_hf_model(arch, overrides, fp16_exact=fmt == "F16")
    path = write_like_llama_cpp(model, str(cache_dir / f"{case}.gguf"), gguf_arch, name, fmt)
    references = {"original HF model": _transformers(model)} if fmt in ("F16", "F32") else {}
    if transformers_reads:
        import transformers
        from_gguf = transformers.AutoModelForCausalLM.from_pretrained(
            str(cache_dir), gguf_file=os.path.basename(path), dtype=torch.float32).eval()
        references["transformers' GGUF load"] = _transformers(from_gguf)
    for quantization in ("none", "gguf"):
        tokens, logprobs = _tidal(path, quantization)
        for ref, (ref_tokens, ref_logprobs) in references.items():
            assert tokens == ref_tokens, f"{case} quantization={quantization} vs {ref}"
            torch.testing.assert_close(logprobs, ref_logprobs, atol=1e-4, rtol=0,
                                       msg=lambda m: f"{case} quantization={quantization} vs {ref}: {m}")


def test_metadata_read_from_the_file(cache_dir):
    """Context length, RoPE base, head dim (key_length), rms eps, BOS and every end-of-turn id; a "mistral"
    file states no sliding window, so none limits the context; the rope_freqs factors reach the config."""
    from tidal.loader.gguf_loader import convert_gguf, load_gguf_config
    model = make_hf_model("llama", {"head_dim": 32, "rms_norm_eps": 3e-6, "max_position_embeddings": 8192,
                                    "rope_parameters": dict(LLAMA3_ROPE, rope_theta=5e5)}, fp16_exact=False)
    path = write_like_llama_cpp(model, str(cache_dir / "meta.gguf"), "llama", "Tiny Llama 3.1 Instruct", "F32",
                                extra_kv={"tokenizer.ggml.eot_token_id": 7})
    config = load_gguf_config(path)
    assert (config.max_position_embeddings, config.rope_theta, config.head_dim) == (8192, 5e5, 32)
    assert config.rms_norm_eps == pytest.approx(3e-6)
    assert (config.bos_token_id, config.eos_token_id) == (1, [2, 7])
    assert config.rope_freq_factors == pytest.approx(llama3_rope_factors(dict(LLAMA3_ROPE, rope_theta=5e5), 32))
    folder = convert_gguf(path, str(cache_dir / "meta-hf"), weights=False)  # what the engine reads back
    with open(os.path.join(folder, "config.json")) as f:
        saved = json.load(f)
    assert saved["head_dim"] == 32 and saved["eos_token_id"] == [2, 7] and len(saved["rope_freq_factors"]) == 16

    mistral = make_hf_model("mistral", {"sliding_window": None, "max_position_embeddings": 8192}, fp16_exact=False)
    path = write_like_llama_cpp(mistral, str(cache_dir / "mistral.gguf"), "mistral", "Tiny Mistral", "F32")
    config = load_gguf_config(path)
    assert config.sliding_window is None and config.max_position_embeddings == 8192
    llm = LLM(path, dtype="float32", quantization="gguf", kv_cache_memory_bytes=TEST_KV_CACHE_BYTES)
    assert llm.llm_engine.max_model_len == 8192  # not clamped to MistralConfig's default window of 4096


def test_a_gguf_tokenizer_is_read_from_its_first_conversion_afterwards(cache_dir, monkeypatch):
    """`--tokenizer file.gguf` (load_gguf_tokenizer): transformers' converter runs once, into the metadata
    folder the engine reads; later loads read its files and give the same tokenizer."""
    from tidal.loader import gguf_loader
    model = make_hf_model("llama", {}, fp16_exact=False)
    path = write_like_llama_cpp(model, str(cache_dir / "chat.gguf"), "llama", "Tiny Chat", "F32", tokenizer=True,
                                eos=0)
    converted = gguf_loader.load_gguf_tokenizer(path)
    assert os.path.exists(os.path.join(gguf_loader.cached_metadata(path), "tokenizer_config.json"))
    monkeypatch.setattr(gguf_loader, "_convert_gguf_tokenizer", lambda *a, **k: pytest.fail("converted again"))
    read = gguf_loader.load_gguf_tokenizer(path)
    conversation = [{"role": "user", "content": "hi there"}]
    for tok in (converted, read):
        assert tok.chat_template == CHAT_TEMPLATE
        assert (tok.bos_token, tok.eos_token) == ("<|im_start|>", "<|endoftext|>")
    assert (read.apply_chat_template(conversation, add_generation_prompt=True)
            == converted.apply_chat_template(conversation, add_generation_prompt=True))
    assert read.encode("hi there, the tide") == converted.encode("hi there, the tide")


@pytest.mark.parametrize("quantization", ["none", "gguf"])
def test_tokenizer_chat_template_and_end_tokens_from_the_file(cache_dir, quantization):
    """A file with a tokenizer: its chat template, BOS and EOS reach the engine's tokenizer (transformers'
    GGUF tokenizer converter), and the engine stops on the EOS and on the end-of-turn token the file names."""
    model = make_hf_model("llama", {}, fp16_exact=False)
    path = write_like_llama_cpp(model, str(cache_dir / "chat.gguf"), "llama", "Tiny Chat", "F32", tokenizer=True,
                                eos=0, extra_kv={"tokenizer.ggml.eot_token_id": 2})
    llm = LLM(path, dtype="float32", quantization=quantization, kv_cache_memory_bytes=TEST_KV_CACHE_BYTES)
    tok = llm.get_tokenizer()
    assert tok.chat_template == CHAT_TEMPLATE
    assert (tok.bos_token, tok.eos_token) == ("<|im_start|>", "<|endoftext|>")
    assert tuple(llm.llm_engine.eos_token_ids) == (0, 2)  # <|endoftext|>, then <|im_end|> (end of turn)
    assert tok.decode(tok.encode("hi there")) == "hi there"
    conversation = [{"role": "user", "content": "hi there"}]
    out = llm.chat([conversation], SamplingParams(temperature=0, max_tokens=4), use_tqdm=False)[0]
    text = "<|im_start|>user\nhi there<|im_end|>\n<|im_start|>assistant\n"
    assert tok.apply_chat_template(conversation, tokenize=False, add_generation_prompt=True) == text
    assert out.prompt_token_ids == tok.encode(text, add_special_tokens=False)
    assert out.prompt_token_ids[0] == 1 and tok.decode(out.prompt_token_ids) == text  # control tokens whole


def test_conversions_are_keyed_by_content_and_stale_ones_removed(cache_dir, monkeypatch):
    """The same file installed again (another path, another mtime: a new virtual environment) reuses its
    conversion instead of writing another 517 MB one (the default model); a later load does not hash the file
    again; a changed file gets its own; folders of the former size-and-mtime key and of another conversion
    version are removed with the next conversion, other files' current ones kept."""
    import hashlib
    import shutil

    from tidal.loader import gguf_loader
    model = make_hf_model("llama", {}, fp16_exact=False)
    path = write_like_llama_cpp(model, str(cache_dir / "tiny.gguf"), "llama", "Tiny", "F32")
    parent = cache_dir / "cache" / "gguf"
    parent.mkdir()
    legacy = parent / "tiny-98362432-1796457000-v2"
    old_version = parent / f"tiny-{'0' * 20}-v1"
    other = parent / f"other-{'a' * 20}-v{gguf_loader._CONVERSION_VERSION}"
    for folder in (legacy, old_version, other):
        folder.mkdir()
    (parent / "tiny-98362432-1796457000-v2.tensors.json").write_text("[]")

    first = gguf_loader.cached_conversion(path)
    assert os.path.exists(os.path.join(first, "model.safetensors"))
    assert sorted(os.listdir(parent)) == sorted([os.path.basename(first), other.name])

    copy = cache_dir / "venv2" / "tiny.gguf"
    copy.parent.mkdir()
    shutil.copyfile(path, copy)  # a new mtime and inode, the same bytes
    os.utime(copy, (1e9, 1e9))
    with monkeypatch.context() as m:
        m.setattr(gguf_loader, "convert_gguf", lambda *a, **k: pytest.fail("converted again"))
        assert gguf_loader.cached_conversion(str(copy)) == first
        m.setattr(hashlib, "file_digest", lambda *a, **k: pytest.fail("hashed again"))
        assert gguf_loader.cached_conversion(path) == first  # remembered by path, size, mtime and inode

    with open(copy, "r+b") as f:  # the copy changed: its own conversion
        f.seek(-4, os.SEEK_END)
        f.write(b"\x01\x02\x03\x04")
    changed = gguf_loader.cached_conversion(str(copy))
    assert changed != first and os.path.exists(first) and os.path.exists(changed)
