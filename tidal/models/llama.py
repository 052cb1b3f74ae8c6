"""The Llama family: Llama 2/3 (with llama3 RoPE scaling), Mistral, Qwen2 (QKV bias), SmolLM (tied
embeddings), with GQA/MQA. Module names match Hugging Face checkpoints, with q/k/v and gate/up
fused; `load_weights` routes each checkpoint tensor to its slice of the fused parameter."""
from __future__ import annotations

from collections.abc import Iterable

import torch
from torch import nn

from tidal import forward_context
from tidal.distributed import is_first_pp_stage, is_last_pp_stage, pp_recv_hidden, pp_send_hidden
from tidal.layers.activation import SiluAndMul
from tidal.layers.attention import Attention
from tidal.layers.embedding import VocabParallelEmbedding
from tidal.layers.linear import MergedColumnParallelLinear, QKVParallelLinear, RowParallelLinear
from tidal.layers.native_decoder import NativeDecoder
from tidal.layers.norm import RMSNorm
from tidal.layers.rotary import get_rope
from tidal.models.utils import CausalLM, load_stacked_weights, make_layers


class LlamaAttention(nn.Module):
    def __init__(self, config, dtype, quant=None) -> None:
        super().__init__()
        hidden = config.hidden_size
        num_heads = config.num_attention_heads
        num_kv_heads = getattr(config, "num_key_value_heads", None) or num_heads
        head_dim = getattr(config, "head_dim", None) or hidden // num_heads
        bias = getattr(config, "attention_bias", getattr(config, "model_type", "") == "qwen2")
        self.qkv_proj = QKVParallelLinear(hidden, head_dim, num_heads, num_kv_heads, bias=bias, dtype=dtype,
                                          quant_method=quant)
        o_bias = getattr(config, "model_type", "") != "qwen2" and getattr(config, "attention_bias", False)
        self.o_proj = RowParallelLinear(num_heads * head_dim, hidden, bias=o_bias, dtype=dtype,
                                        quant_method=quant, rank_sizes=self.qkv_proj.q_rank_sizes)
        self.num_heads, self.num_kv_heads = self.qkv_proj.num_heads, self.qkv_proj.num_kv_heads
        self.head_dim = head_dim
        self.q_size, self.kv_size = self.num_heads * head_dim, self.num_kv_heads * head_dim
        rope_params = getattr(config, "rope_parameters", None) or {}
        base = getattr(config, "rope_theta", None) or rope_params.get("rope_theta", 10000.0)
        scaling = getattr(config, "rope_scaling", None) or (rope_params if rope_params.get("rope_type", "default")
                                                            != "default" else None)
        # shared by all layers (not a submodule: it holds no weights); rope_freq_factors: a GGUF file's
        # rope_freqs (llama.cpp's form of Llama-3 scaling), which divide the frequencies
        self._rotary = [get_rope(head_dim, config.max_position_embeddings, base, scaling,
                                 getattr(config, "rope_freq_factors", None))]
        self.attn = Attention(self.num_heads, head_dim, head_dim ** -0.5, self.num_kv_heads)

    def forward(self, positions: torch.Tensor, x: torch.Tensor, rows: torch.Tensor | None = None) -> torch.Tensor:
        """rows: only these rows of the output (every row's K and V still go into the cache)."""
        qkv = self.qkv_proj(x)
        T = x.shape[0]
        # q and k heads are adjacent in the fused output: rotate them in one pass
        qk = qkv[:, :self.q_size + self.kv_size].view(T, self.num_heads + self.num_kv_heads, self.head_dim)
        v = qkv[:, self.q_size + self.kv_size:]
        out = self.attn.forward_rotary(positions, qk, v, self._rotary[0])
        return self.o_proj(out if rows is None else out[rows])


class LlamaMLP(nn.Module):
    def __init__(self, config, dtype, quant=None) -> None:
        super().__init__()
        inter = config.intermediate_size
        self.gate_up_proj = MergedColumnParallelLinear(config.hidden_size, [inter, inter], dtype=dtype,
                                                       quant_method=quant)
        self.down_proj = RowParallelLinear(inter, config.hidden_size, dtype=dtype, quant_method=quant)
        self.act = SiluAndMul()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.act(self.gate_up_proj(x)))


class LlamaDecoderLayer(nn.Module):
    def __init__(self, config, dtype, quant=None) -> None:
        super().__init__()
        self.self_attn = LlamaAttention(config, dtype, quant)
        self.mlp = LlamaMLP(config, dtype, quant)
        eps = config.rms_norm_eps
        self.input_layernorm = RMSNorm(config.hidden_size, eps, dtype)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, eps, dtype)

    def forward(self, positions, hidden, residual, rows=None):
        """rows: the rows to carry on after attention (LlamaModel.forward's last layer), else every row."""
        if residual is None:
            residual = hidden
            hidden = self.input_layernorm(hidden)
        else:
            hidden, residual = self.input_layernorm(hidden, residual)
        hidden = self.self_attn(positions, hidden, rows)
        if rows is not None:
            residual = residual[rows]
        hidden, residual = self.post_attention_layernorm(hidden, residual)
        return self.mlp(hidden), residual


class LlamaModel(nn.Module):
    """With pipeline parallelism a stage builds only its layers [start_layer, end_layer) (the others
    are empty placeholders, so parameter names still match the checkpoint); the embedding lives on
    the first stage, the final norm on the last, and hidden states + residual travel between stages.
    Mixtral is this model with its own decoder layer (`layer_cls`)."""

    def __init__(self, config, dtype, quant=None, layer_cls: type[nn.Module] = LlamaDecoderLayer) -> None:
        super().__init__()
        self.hidden_size, self.dtype = config.hidden_size, dtype
        self.embed_tokens = (VocabParallelEmbedding(config.vocab_size, config.hidden_size, dtype)
                             if is_first_pp_stage() else None)
        self.start_layer, self.end_layer, self.layers = make_layers(
            config.num_hidden_layers, lambda i: layer_cls(config, dtype, quant))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps, dtype) if is_last_pp_stage() else None
        self._native: list = []  # [NativeDecoder or None], decided at the first forward

    def _native_decoder(self) -> NativeDecoder | None:
        """The stage's layers as one native call on the CPU (tidal/layers/native_decoder.py), where it applies."""
        if not self._native:
            self._native.append(NativeDecoder.for_model(self))
        return self._native[0]

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        native = self._native_decoder()
        last_stage = self.norm is not None
        fused = None
        if self.embed_tokens is not None:
            if native is not None:  # the embedding too, in the native call, where it can
                fused = native.forward(None, None, positions, last_stage=last_stage, input_ids=input_ids)
            if fused is None:
                hidden, residual = self.embed_tokens(input_ids), None
        else:
            hidden, residual = pp_recv_hidden(input_ids.shape[0], self.hidden_size, self.dtype,
                                              device=input_ids.device)
        if fused is None and native is not None:
            fused = native.forward(hidden, residual, positions, last_stage=last_stage)
        if fused is not None:
            hidden, residual = fused
            if residual is None:  # the final norm ran in the same native call
                return hidden
        else:
            # on the last stage, the last layer carries on after attention only the rows read after the
            # forward (ForwardContext.output_rows): the output product and the MLP skip the others
            picked = forward_context.output_rows(hidden.device) if self.norm is not None else None
            last = self.end_layer - 1
            for i in range(self.start_layer, self.end_layer):
                hidden, residual = self.layers[i](positions, hidden, residual, picked if i == last else None)
        if self.norm is None:  # not the last stage: hand over to the next one
            pp_send_hidden(hidden, residual)
            return hidden
        hidden, _ = self.norm(hidden, residual)
        return hidden


class LlamaForCausalLM(CausalLM):
    supports_pp = True  # builds only its stage's layers (LlamaModel)
    supports_cuda_graphs = True  # its forward never reads a value back from the GPU (tidal/worker/cuda_graphs.py)
    stacked_params = [  # (fused parameter, checkpoint name, shard)
        ("qkv_proj", "q_proj", "q"), ("qkv_proj", "k_proj", "k"), ("qkv_proj", "v_proj", "v"),
        ("gate_up_proj", "gate_proj", 0), ("gate_up_proj", "up_proj", 1),
    ]

    def __init__(self, config, dtype=torch.float32, quant=None) -> None:
        super().__init__()
        self.config = config
        self.model = LlamaModel(config, dtype, quant)
        self.init_lm_head(config, dtype)

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        skip = ("rotary_emb.inv_freq",) + (("lm_head.weight",) if self.tied else ())
        return load_stacked_weights(self, self.this_stage_weights(weights), self.stacked_params, skip)
