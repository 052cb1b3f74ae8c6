"""SmoothQuant for w8a8: activation outliers moved into the weights before they are quantized.

Per-token int8 activations lose the small channels of a token whose largest channel is an outlier, and in
these models a few hidden channels run far larger than the rest. SmoothQuant (Xiao et al., 2023) divides
each input channel j of a linear layer by s_j and multiplies the weight's column j by s_j, so the product
is unchanged in exact arithmetic while the activations' range shrinks:

    s_j = max|x_j| ** ALPHA / max|W_j| ** (1 - ALPHA)

The division is folded into what produces the input, so it costs nothing at run time:
- QKV's input: the input RMSNorm's weight; gate/up's input: the post-attention RMSNorm's weight;
- down's input (silu(gate) * up): the up rows of gate/up (per-row quantization makes that a division of
  their row scales);
- o's input (the attention output): the V rows of QKV, one s per KV channel shared by the query heads of
  its group (attention is linear in V).

How it runs (`smooth_w8a8`, called by the model runner once the w8a8 model is loaded): forwards of the
bundled calibration text (calibration.txt, Tidal's own, not the perplexity text; its first 1,024 tokens as
fresh 64-token prompts, so the statistics do not depend on the engine's limits) through the Python layers
with observers on the layers' inputs; s from the observed maxima and the int8 weights' column maxima; the
consumers' weights read again from the checkpoint and quantized with their columns scaled (the
checkpoint's values, not the first int8 copy, so nothing is rounded twice); the producers divided in
place. Each tensor-parallel rank does this for its own shard (every step of it is local to the shard);
each pipeline stage for its own layers (every stage's runner calls this at load, so the calibration
forwards pass through the stages as a step's do). Applies to decoder layers laid out as Llama's (and the
attention of Mixtral and Jamba layers); not to a checkpoint already quantized. TIDAL_W8A8_SMOOTHING=0
turns it off (A/B; plain per-token w8a8).
Measured on the default model: docs/quantization.md.

A forward of the same text (one prompt of up to 1,024 tokens) centres an FP8 KV cache's keys
(`center_fp8_keys`): each attention layer's mean key over it (after rotary, per KV head and channel) is
taken off every key before it is stored in E4M3. A query's scores then all move by the same q . mean,
which softmax ignores, so attention is unchanged in exact arithmetic, while the stored values lose the
constant offsets some channels carry and E4M3's relative rounding acts on what is left. CPU only (the
CUDA path's fused rotary-and-write kernel has no shift); TIDAL_FP8_KV_CENTERING=0 turns it off.
"""
from __future__ import annotations

import logging
import os
import time
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn

from tidal.layers import native_decoder

logger = logging.getLogger(__name__)

ALPHA = 0.5
CALIBRATION_TEXT = Path(__file__).with_name("calibration.txt")
CALIBRATION_TOKENS = 1024
PIECE_TOKENS = 64


@dataclass
class Group:
    """One input smoothed: `consumer`'s input channels (its weight's columns) multiplied by s, `fold(s)`
    dividing whatever produces that input."""
    consumer: nn.Module
    fold: object  # Callable[[torch.Tensor], None]
    heads: tuple[int, int, int] | None = None  # (query heads, KV heads, head dim): o's input, s per KV channel


def _is_w8a8(layer) -> bool:
    from tidal.layers.quantization.methods import W8A8LinearMethod
    return (isinstance(getattr(layer, "quant_method", None), W8A8LinearMethod)
            and getattr(getattr(layer, "weight_scale", None), "computed_at_load", False))


def _divide_norm(norm: nn.Module):
    def fold(s: torch.Tensor) -> None:
        norm.weight.data.copy_((norm.weight.data.float() / s).to(norm.weight.dtype))
    return fold


def _divide_rows(layer: nn.Module, start: int):
    """Rows [start, start + len(s)) of a per-row quantized layer divided by s: their scales (and bias)."""
    def fold(s: torch.Tensor) -> None:
        rows = layer.weight_scale.data.narrow(0, start, s.numel())
        rows.copy_(rows / s)
        if getattr(layer, "bias", None) is not None:
            b = layer.bias.data.narrow(0, start, s.numel())
            b.copy_((b.float() / s).to(b.dtype))
    return fold


def smoothing_groups(model: nn.Module) -> list[Group]:
    groups: list[Group] = []
    for layer in model.modules():
        attn, in_norm = getattr(layer, "self_attn", None), getattr(layer, "input_layernorm", None)
        qkv, o = getattr(attn, "qkv_proj", None), getattr(attn, "o_proj", None)
        if in_norm is not None and _is_w8a8(qkv):
            groups.append(Group(qkv, _divide_norm(in_norm)))
            hq, hk = getattr(qkv, "num_heads", None), getattr(qkv, "num_kv_heads", None)
            if _is_w8a8(o) and hq and hk and o.in_features % hq == 0:
                d = o.in_features // hq
                if qkv.out_features == (hq + 2 * hk) * d:
                    groups.append(Group(o, _divide_rows(qkv, (hq + hk) * d), heads=(hq, hk, d)))
        for norm_name, mlp_name in (("post_attention_layernorm", "mlp"), ("pre_ff_layernorm", "feed_forward")):
            norm, mlp = getattr(layer, norm_name, None), getattr(layer, mlp_name, None)
            gate_up, down = getattr(mlp, "gate_up_proj", None), getattr(mlp, "down_proj", None)
            if norm is not None and _is_w8a8(gate_up):
                groups.append(Group(gate_up, _divide_norm(norm)))
                if _is_w8a8(down) and gate_up.out_features == 2 * down.in_features:
                    groups.append(Group(down, _divide_rows(gate_up, down.in_features)))
    return groups


def column_absmax(layer: nn.Module, chunk: int = 1024) -> torch.Tensor:
    """max over rows of |weight * row scale|, per input column, from the int8 weights."""
    w, scale = layer.weight, layer.weight_scale
    out = torch.zeros(w.shape[1], dtype=torch.float32, device=w.device)
    for r in range(0, w.shape[0], chunk):
        rows = w[r:r + chunk].float().abs() * scale[r:r + chunk].unsqueeze(1)
        out = torch.maximum(out, rows.amax(0))
    return out


def smoothing_factors(act: torch.Tensor, weight: torch.Tensor, heads=None, alpha: float = ALPHA) -> torch.Tensor:
    """s per input channel (per KV channel for o's input: the maxima over each group's query heads first);
    1 where either maximum is zero."""
    if heads is not None:
        hq, hk, d = heads
        act = act.view(hk, hq // hk, d).amax(1).reshape(-1)
        weight = weight.view(hk, hq // hk, d).amax(1).reshape(-1)
    live = (act > 0) & (weight > 0)
    s = act.clamp(min=1e-8).pow(alpha) / weight.clamp(min=1e-8).pow(1 - alpha)
    return torch.where(live, s, torch.ones_like(s))


def _expand_heads(s: torch.Tensor, heads) -> torch.Tensor:
    """Per KV channel -> per query-head channel (o's input columns)."""
    hq, hk, d = heads
    return s.view(hk, 1, d).expand(hk, hq // hk, d).reshape(-1)


def calibration_tokens(tokenizer, vocab_size: int) -> list[int]:
    """The calibration text's first CALIBRATION_TOKENS tokens. Without a tokenizer (token-id prompts only),
    its UTF-8 bytes taken as token ids (the outlier channels show on any input)."""
    text = CALIBRATION_TEXT.read_text(encoding="utf-8")
    if tokenizer is not None:
        ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    else:
        ids = [b % vocab_size for b in text.encode()]
    return list(ids[:CALIBRATION_TOKENS])


def calibration_prompts(tokenizer, vocab_size: int, max_model_len: int) -> list[list[int]]:
    """calibration_tokens in fresh prompts of PIECE_TOKENS (shorter only when max_model_len is), so the
    statistics do not depend on the engine's step limits."""
    ids = calibration_tokens(tokenizer, vocab_size)
    piece = min(PIECE_TOKENS, max_model_len)
    return [ids[i:i + piece] for i in range(0, len(ids), piece)]


def smooth_w8a8(runner, loaded) -> int:
    """Smooth every w8a8 layer of the loaded model it applies to (see the module docstring); returns the
    number of inputs smoothed."""
    from tidal.models.utils import reload_stacked_weights
    if os.environ.get("TIDAL_W8A8_SMOOTHING", "1") == "0" or loaded.reread is None:
        return 0
    model = loaded.model
    groups = smoothing_groups(model)
    if not groups:
        return 0
    t0 = time.perf_counter()
    prompts = calibration_prompts(loaded.tokenizer, loaded.config.vocab_size, runner.max_model_len)
    act: dict[int, torch.Tensor] = {}

    def observe(module, inputs):
        x = inputs[0].detach()
        m = x.reshape(-1, x.shape[-1]).abs().amax(0).float()
        act[id(module)] = m if id(module) not in act else torch.maximum(act[id(module)], m)

    hooks = [g.consumer.register_forward_pre_hook(observe) for g in groups]
    try:
        with native_decoder.suspended():
            runner.calibration_forward(prompts)
    finally:
        for h in hooks:
            h.remove()
    factors = [smoothing_factors(act[id(g.consumer)], column_absmax(g.consumer), g.heads) for g in groups]
    for g, s in zip(groups, factors, strict=True):
        g.consumer.input_smoothing = _expand_heads(s, g.heads) if g.heads else s
    consumers = {id(g.consumer.weight) for g in groups}
    try:
        reload_stacked_weights(model, loaded.reread(), getattr(model, "stacked_params", ()),
                               lambda p: id(p) in consumers)
    finally:
        for g in groups:
            del g.consumer.input_smoothing
    for g, s in zip(groups, factors, strict=True):
        g.fold(s)
    for g in groups:
        g.consumer.quant_method.process_weights_after_loading(g.consumer)
    logger.info("w8a8: %d layer inputs smoothed (SmoothQuant, alpha %.2g) from %d calibration tokens in %.1f s",
                len(groups), ALPHA, sum(map(len, prompts)), time.perf_counter() - t0)
    return len(groups)


def center_fp8_keys(runner, loaded) -> int:
    """Set each attention layer's k_shift to its mean key over the calibration text (see the module
    docstring); returns the number of layers centred."""
    from tidal.layers.attention.kv_cache_dtype import read_blocks
    from tidal.layers.attention.layer import split_kv_cache
    layers = runner.attn_layers
    if os.environ.get("TIDAL_FP8_KV_CENTERING", "1") == "0" or not layers or runner.device.type != "cpu":
        return 0
    t0 = time.perf_counter()
    # one prompt, as long as the engine takes up to CALIBRATION_TOKENS: a key channel's mean depends on the
    # positions it is taken over (each rotary pair turns at its own rate), and long contexts are what
    # the centring is for (on the default model: +0.6% perplexity with 1,024 positions against +1.2%
    # uncentred; means over 64-token pieces did worse than no centring). So an engine whose max_model_len
    # or step is shorter centres on fewer.
    limit = min(CALIBRATION_TOKENS, runner.max_model_len, runner.max_step_tokens)
    tokens = calibration_tokens(loaded.tokenizer, loaded.config.vocab_size)[:limit]
    means = []

    def inspect(group):  # the one prompt, in the cache's first blocks
        blocks = torch.arange(-(-len(tokens) // runner.block_size))
        for a in layers:
            k_cache, _ = split_kv_cache(a.kv_cache)  # [blocks, Hk, D, block size], tokens in slot order
            keys = read_blocks(k_cache, blocks, torch.float32, a.k_scale).permute(0, 3, 1, 2)
            means.append(keys.reshape(-1, a.num_kv_heads * a.head_dim)[:len(tokens)].double().mean(0))

    with native_decoder.suspended():
        runner.calibration_forward([tokens], inspect)
    for a, mean in zip(layers, means, strict=True):
        # on a grid of 1/16: tensor- or pipeline-parallel ranks, whose sums differ in their last bits, agree
        a.k_shift = torch.round(mean * 16).div(16).float().contiguous()
    logger.info("FP8 KV cache: keys centred on their mean over %d calibration tokens in %d attention layers "
                "(%.1f s)", len(tokens), len(layers), time.perf_counter() - t0)
    return len(layers)
