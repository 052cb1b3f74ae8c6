"""The quantization config a model is built with, and how a scheme is chosen: by the engine's
`quantization` argument, or by the checkpoint's own `quantization_config` (a Hugging Face FP8
checkpoint loads as fp8 without asking)."""
from __future__ import annotations

from dataclasses import dataclass

import torch

from tidal.layers.linear import Bf16WeightLinearMethod, UnquantizedLinearMethod

# "gguf": a GGUF file's weights kept in its blocks (only when asked: .gguf files load dequantized by
# default); "none": no scheme, the checkpoint's weights in the model dtype (a GGUF file dequantized at load)
QUANTIZATION_METHODS = ("int8", "w8a8", "fp8", "experts_int8", "gguf", "none")


@dataclass
class QuantizationConfig:
    """What each kind of layer of a model is built with.

    name: the scheme (one of QUANTIZATION_METHODS; None: no scheme, the model's layers get base_linear,
    e.g. bf16 weights under fp32 activations). base_linear: the method of the layers the scheme
    leaves alone (the plain weights, or bf16 weights under fp32 activations). from_checkpoint: the
    checkpoint's tensors are already quantized (HF FP8 layout: fp8 `weight` plus `weight_scale`)."""
    name: str | None
    base_linear: UnquantizedLinearMethod
    from_checkpoint: bool = False
    weight_dtype: torch.dtype | None = None  # of plain (unquantized) tensors a scheme keeps as they are

    def linear_method(self):
        from tidal.layers.quantization import methods
        if self.name in (None, "experts_int8"):
            return self.base_linear
        if self.name == "gguf":
            from tidal.layers.quantization.gguf import GGUFLinearMethod
            return GGUFLinearMethod(self.weight_dtype)
        return {"int8": methods.Int8LinearMethod, "w8a8": methods.W8A8LinearMethod,
                "fp8": methods.Fp8LinearMethod}[self.name](self.from_checkpoint)

    def moe_method(self):
        from tidal.layers.quantization import methods
        if self.name in (None, "gguf"):
            return None
        if self.name == "fp8":
            return methods.Fp8MoEMethod(self.from_checkpoint)
        return methods.Int8MoEMethod()  # experts_int8, int8 and w8a8 (experts weight-only: grouped rows are few)

    @property
    def embedding_format(self) -> torch.dtype | None:
        """The dtype the embedding table and LM head are stored in (None: left as they are; a quantized
        checkpoint's tables are as the checkpoint stores them). int8 rows under every scheme, fp8 too:
        the same byte per weight, and the table whose rounding costs the most (on the default model, an
        E4M3 table costs +1.6% perplexity against +0.1% for int8 rows; docs/quantization.md)."""
        if self.from_checkpoint:
            return None
        return {"int8": torch.int8, "w8a8": torch.int8, "fp8": torch.int8}.get(self.name)


def checkpoint_quantization(hf_config) -> str | None:
    """The scheme a checkpoint's tensors are stored in ("fp8"), None for a plain checkpoint; refuses the
    quantized layouts Tidal cannot read, by name."""
    qc = getattr(hf_config, "quantization_config", None)
    if qc is None:
        return None
    if not isinstance(qc, dict):
        qc = qc.to_dict() if hasattr(qc, "to_dict") else vars(qc)
    method = qc.get("quant_method")
    if method == "fp8":
        if qc.get("weight_block_size"):
            raise ValueError(f"FP8 checkpoint with block-wise scales (weight_block_size "
                             f"{qc['weight_block_size']}) is not supported: Tidal reads per-tensor or "
                             "per-channel weight_scale")
        if qc.get("activation_scheme", "dynamic") not in ("dynamic", "static"):
            raise ValueError(f"FP8 checkpoint activation_scheme {qc.get('activation_scheme')!r} is not supported")
        return "fp8"
    raise ValueError(f"checkpoint quantization_config.quant_method {method!r} is not supported: Tidal loads "
                     f"plain checkpoints (quantized at load with quantization={', '.join(QUANTIZATION_METHODS)}) "
                     "and Hugging Face FP8 checkpoints")


def get_quantization_config(quantization: str | None, hf_config, weight_dtype: torch.dtype,
                            act_dtype: torch.dtype) -> QuantizationConfig | None:
    """The config to build the model with, or None (plain weights in the model dtype)."""
    base = Bf16WeightLinearMethod() if weight_dtype != act_dtype else UnquantizedLinearMethod()
    stored = checkpoint_quantization(hf_config)
    if quantization == "none":
        quantization = None
    if quantization is not None and quantization not in QUANTIZATION_METHODS:
        raise ValueError(f"quantization must be one of {', '.join(QUANTIZATION_METHODS)} (or None); "
                         f"got {quantization!r}")
    if stored == "fp8":
        if quantization not in (None, "fp8"):
            raise ValueError(f"quantization {quantization!r} cannot load this checkpoint: its weights are already "
                             "FP8 (quantization_config.quant_method 'fp8'); use quantization='fp8' or leave it unset")
        return QuantizationConfig("fp8", base, from_checkpoint=True)
    if quantization == "gguf":  # the loader checks that the model is a GGUF file
        return QuantizationConfig("gguf", base, from_checkpoint=True, weight_dtype=weight_dtype)
    if quantization is None:
        return QuantizationConfig(None, base) if isinstance(base, Bf16WeightLinearMethod) else None
    if quantization == "experts_int8" and not _has_experts(hf_config):
        raise ValueError(f"quantization 'experts_int8' quantizes MoE experts, and this model "
                         f"({', '.join(getattr(hf_config, 'architectures', None) or ['?'])}) has none; "
                         "use 'int8', 'w8a8' or 'fp8'")
    return QuantizationConfig(quantization, base)


def _has_experts(hf_config) -> bool:
    return bool(getattr(hf_config, "num_local_experts", 0) or getattr(hf_config, "num_experts", 0))
