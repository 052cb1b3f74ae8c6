"""Perplexity of a Tidal model on a fixed English text, through the offline API's prompt logprobs.

    python benchmarks/perplexity.py                                   # default model, dtype auto
    python benchmarks/perplexity.py --dtype bfloat16 --quantization int8
    python benchmarks/perplexity.py --kv-cache-dtype fp8 --json       # last line: the figures as JSON
    python benchmarks/perplexity.py --model path/to/hf-folder --max-tokens 8192

The text (benchmarks/data/alice29.txt, see benchmarks/data/README.md) is tokenized once with the
model's own tokenizer, without BOS, and cut into overlapping windows of --window tokens that start
every --stride tokens (the sliding-window scheme of Hugging Face's perplexity guide): window k holds
tokens [k * stride, k * stride + window), and scores only the tokens that no earlier window scored,
so every token from the second to the last is scored exactly once; the first window scores all of
its tokens, later ones their last `stride` (the last window, cut short by the end of the text, the
ones it adds). With the defaults (1024 / 512) a scored token has 1 to 1023 tokens of context in the
first window and at least 512 afterwards. Each window is one request with
SamplingParams(max_tokens=1, prompt_logprobs=0): prompt_logprobs[j] holds the log-probability of
token j given tokens [0, j) of the window. Perplexity = exp(mean NLL over the scored tokens).

Every engine option given here goes to tidal.LLM as it is (--quantization and --kv-cache-dtype are
not checked here): a value the engine does not support raises its ValueError.
"""
from __future__ import annotations

import argparse
import json
import math
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
DEFAULT_TEXT = REPO / "benchmarks" / "data" / "alice29.txt"


def windows(num_tokens: int, window: int, stride: int) -> list[tuple[int, int, int]]:
    """(start, end, first scored index within the window) for each window over num_tokens tokens."""
    if not 0 < stride <= window:
        raise ValueError(f"stride must be in [1, window={window}]; got {stride}")
    spans, scored_to = [], 1  # token 0 has no context: never scored
    for start in range(0, num_tokens, stride):
        end = min(start + window, num_tokens)
        if end > scored_to:
            spans.append((start, end, scored_to - start))
            scored_to = end
        if end == num_tokens:
            break
    return spans


def perplexity(llm, token_ids: list[int], window: int, stride: int) -> dict:
    """Perplexity of token_ids under a tidal.LLM, scored window by window (all windows in one generate)."""
    from tidal import SamplingParams

    if len(token_ids) < 2:
        raise ValueError(f"perplexity needs at least 2 tokens; got {len(token_ids)}")
    spans = windows(len(token_ids), window, stride)
    prompts = [{"prompt_token_ids": token_ids[s:e]} for s, e, _ in spans]
    params = SamplingParams(temperature=0.0, max_tokens=1, prompt_logprobs=0)
    t0 = time.perf_counter()
    outs = llm.generate(prompts, params, use_tqdm=False)
    seconds = time.perf_counter() - t0
    nll, count = 0.0, 0
    for (start, end, first), out in zip(spans, outs):
        ids = out.prompt_token_ids
        for j in range(first, end - start):
            nll -= out.prompt_logprobs[j][ids[j]].logprob
            count += 1
    assert count == len(token_ids) - 1, (count, len(token_ids))
    mean = nll / count
    return {"tokens": count, "windows": len(spans), "window": window, "stride": stride,
            "mean_nll": mean, "perplexity": math.exp(mean), "seconds": round(seconds, 1),
            "tokens_per_s": round(sum(e - s for s, e, _ in spans) / seconds, 1)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=None, help="HF folder or .gguf file (default: the default model)")
    ap.add_argument("--dtype", default="auto")
    ap.add_argument("--quantization", default=None)
    ap.add_argument("--kv-cache-dtype", default="auto")
    ap.add_argument("--device", default="auto")
    ap.add_argument("--text", default=str(DEFAULT_TEXT), help="UTF-8 text file (default: %(default)s)")
    ap.add_argument("--window", type=int, default=1024, help="tokens per request (default 1024)")
    ap.add_argument("--stride", type=int, default=512, help="tokens between window starts (default 512)")
    ap.add_argument("--max-tokens", type=int, default=None, help="only the text's first N tokens (default: all)")
    ap.add_argument("--json", action="store_true", help="print the figures as one JSON line last")
    args = ap.parse_args()
    sys.path.insert(0, str(REPO))
    from tidal import LLM

    llm = LLM(args.model, dtype=args.dtype, quantization=args.quantization, kv_cache_dtype=args.kv_cache_dtype,
              device=args.device, max_model_len=args.window + 1)
    text = Path(args.text).read_text(encoding="utf-8")
    token_ids = list(llm.get_tokenizer()(text, add_special_tokens=False)["input_ids"])[:args.max_tokens]
    result = perplexity(llm, token_ids, args.window, args.stride)
    result.update(model=args.model or "default", dtype=str(llm.llm_engine.dtype).removeprefix("torch."),
                  quantization=args.quantization, kv_cache_dtype=args.kv_cache_dtype, text=Path(args.text).name)
    print(f"{result['text']}: {result['tokens']} tokens scored in {result['windows']} windows of {args.window} "
          f"(stride {args.stride}); mean NLL {result['mean_nll']:.4f}, perplexity {result['perplexity']:.3f} "
          f"({result['dtype']}, quantization {args.quantization}, KV {args.kv_cache_dtype}; "
          f"{result['seconds']} s, {result['tokens_per_s']} window tok/s)")
    if args.json:
        print(json.dumps(result))


if __name__ == "__main__":
    main()
