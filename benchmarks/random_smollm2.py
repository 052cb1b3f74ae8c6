"""A random-weight model of SmolLM2-135M's shape, saved as a Hugging Face folder that Tidal loads
like any checkpoint: for throughput runs where the real weights are not at hand (a GPU machine with
no network). Throughput does not depend on the weights' values, only on the shape.

    python benchmarks/random_smollm2.py /tmp/smollm2-random            # 30 layers, 576 wide, bf16
    python benchmarks/random_smollm2.py /tmp/tiny-random --tiny          # 2 layers, 64 wide: a smoke test

The shape is SmolLM2-135M's: 30 layers, hidden 576, 9 attention heads over 3 KV heads (head_dim 64),
MLP 1536, vocabulary 49,152, tied embeddings, RoPE theta 100,000, 8,192 positions. Weights are drawn
by transformers' own initialisation from a fixed seed. The folder also gets a word-level tokenizer
over the same vocabulary (token i is the word "t<i>"), so outputs are detokenized as with a real
model.
"""
from __future__ import annotations

import argparse
import time

import torch

SMOLLM2_135M = {"vocab_size": 49152, "hidden_size": 576, "intermediate_size": 1536, "num_hidden_layers": 30,
                "num_attention_heads": 9, "num_key_value_heads": 3, "max_position_embeddings": 8192,
                "rope_theta": 100000.0, "rms_norm_eps": 1e-5, "tie_word_embeddings": True,
                "bos_token_id": 1, "eos_token_id": 2}
TINY = dict(SMOLLM2_135M, vocab_size=1024, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
            num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=1024)


def save_tokenizer(path: str, vocab_size: int) -> None:
    """A word-level tokenizer whose token i is "t<i>" (split on whitespace; t0 stands for unknown words)."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast
    tok = Tokenizer(models.WordLevel({f"t{i}": i for i in range(vocab_size)}, unk_token="t0"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="t0", bos_token="t1", eos_token="t2").save_pretrained(path)


def save_random_model(path: str, shape: dict, dtype: torch.dtype = torch.bfloat16, seed: int = 0) -> str:
    import transformers
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(transformers.LlamaConfig(**shape), dtype=dtype)
    model.save_pretrained(path)
    save_tokenizer(path, shape["vocab_size"])
    return path


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("path", help="folder to write (config.json, model.safetensors, tokenizer files)")
    parser.add_argument("--tiny", action="store_true", help="a 2-layer, 64-wide model of the same kind")
    parser.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    t0 = time.perf_counter()
    shape = TINY if args.tiny else SMOLLM2_135M
    save_random_model(args.path, shape, getattr(torch, args.dtype), args.seed)
    params = (shape["vocab_size"] * shape["hidden_size"] + shape["num_hidden_layers"] * (
        shape["hidden_size"] * shape["hidden_size"] // shape["num_attention_heads"]
        * (2 * shape["num_attention_heads"] + 2 * shape["num_key_value_heads"])
        + 3 * shape["hidden_size"] * shape["intermediate_size"]))
    print(f"saved a random {'tiny' if args.tiny else 'SmolLM2-135M-shaped'} model ({params / 1e6:.1f} M parameters, "
          f"{args.dtype}) to {args.path} in {time.perf_counter() - t0:.1f} s")


if __name__ == "__main__":
    main()
