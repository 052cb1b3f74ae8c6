"""Where a quantization scheme's perplexity goes: the perplexity of benchmarks/perplexity.py with one part
of the model treated differently (docs/quantization.md, "What bounds them").

    python benchmarks/quant_sensitivity.py --quantization w8a8 --weight-only qkv_proj   # that projection W8A16
    python benchmarks/quant_sensitivity.py --quantization fp8 --table fp8               # embedding table in E4M3
    python benchmarks/quant_sensitivity.py --quantization fp8 --table none              # ... left in the model dtype
    python benchmarks/quant_sensitivity.py --quantization none --kv-cache-dtype fp8 --kv-scales 0.1 0.01
    python benchmarks/quant_sensitivity.py --quantization none --kv-cache-dtype fp8 --kv-scales-calibrated 1

(--quantization none: the default model's weights dequantized to bf16, as the README's fp8 KV row.)
--weight-only REGEX: linear layers whose module name matches run weight-only (W8A16) on the int8 weights
of a w8a8 model. --table: the dtype the embedding / LM-head table is stored in (int8 rows by default).
--kv-scales K V: every attention layer's FP8 KV-cache scales. --kv-scales-calibrated MARGIN: each layer's
scales from the largest |K| and |V| it writes for Tidal's calibration text (tidal/layers/quantization/
calibration.txt) in a bf16 cache, times MARGIN / 448 (the largest E4M3 value). Prints one line starting
with "RESULT ".
"""
from __future__ import annotations

import argparse
import json
import re
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from perplexity import DEFAULT_TEXT, perplexity  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quantization", default=None)
    ap.add_argument("--kv-cache-dtype", default="auto")
    ap.add_argument("--weight-only", default=None, help="regex of linear module names run W8A16 (w8a8 only)")
    ap.add_argument("--table", choices=["int8", "fp8", "none"], default=None)
    ap.add_argument("--kv-scales", type=float, nargs=2, default=None, metavar=("K", "V"))
    ap.add_argument("--kv-scales-calibrated", type=float, default=None, metavar="MARGIN")
    args = ap.parse_args()

    import torch

    from tidal import LLM
    from tidal.layers.quantization import base, methods

    if args.table is not None:
        fmt = {"int8": torch.int8, "fp8": torch.float8_e4m3fn, "none": None}[args.table]
        base.QuantizationConfig.embedding_format = property(lambda self: fmt)
    calibrated = None
    if args.kv_scales_calibrated is not None:
        calibrated = kv_absmax(args.quantization)
    llm = LLM(quantization=args.quantization, kv_cache_dtype=args.kv_cache_dtype, max_model_len=1025)
    runner = llm.llm_engine.runner
    changed = 0
    if args.weight_only:
        if args.quantization != "w8a8":
            raise SystemExit("--weight-only applies to --quantization w8a8")
        for name, module in runner.model.named_modules():
            if re.search(args.weight_only, name) and isinstance(getattr(module, "quant_method", None),
                                                                methods.W8A8LinearMethod):
                module.quant_method = methods.Int8LinearMethod()
                changed += 1
        if not changed:
            raise SystemExit(f"no w8a8 linear layer matches {args.weight_only!r}")
    if args.kv_scales:
        for layer in runner.attn_layers:
            layer.k_scale, layer.v_scale = args.kv_scales
    if calibrated is not None:
        for layer, (k, v) in zip(runner.attn_layers, calibrated, strict=True):
            layer.k_scale, layer.v_scale = k * args.kv_scales_calibrated / 448, v * args.kv_scales_calibrated / 448
    ids = llm.get_tokenizer()(DEFAULT_TEXT.read_text(encoding="utf-8"), add_special_tokens=False)["input_ids"]
    result = perplexity(llm, list(ids), 1024, 512)
    print("RESULT " + json.dumps({**vars(args), "layers_changed": changed, "perplexity": round(result["perplexity"], 4),
                                  "seconds": result["seconds"]}))


def kv_absmax(quantization) -> list[tuple[float, float]]:
    """(max |K|, max |V|) per attention layer over the calibration text, in a bf16 cache."""
    import gc

    from tidal import LLM, SamplingParams
    from tidal.layers.quantization.smoothing import calibration_tokens
    llm = LLM(quantization=quantization, max_model_len=1025)
    runner = llm.llm_engine.runner
    ids = calibration_tokens(llm.get_tokenizer(), None)
    llm.generate([{"prompt_token_ids": ids}], SamplingParams(max_tokens=1), use_tqdm=False)
    out = [(a.kv_cache[0].float().abs().max().item(), a.kv_cache[1].float().abs().max().item())
           for a in runner.attn_layers]
    del llm, runner
    gc.collect()
    return out


if __name__ == "__main__":
    main()
