"""A Llama-family decoder stack in one native call per forward (csrc/decoder.cpp).

A decode step of a small model spends as long in Python as in its products: per layer some fifteen
module calls, ten tensor allocations and eight ctypes calls, each a few microseconds, against products
that stream a few hundred kilobytes of weights. Here the layers' own kernels - the same functions, from
the same libraries, with the same arguments - are called in sequence from C++, so the outputs are
bitwise those of the layer-by-layer path and only the per-op cost goes.

`NativeDecoder.for_model(model)` checks once whether a model's stage can run this way: every layer a
plain `LlamaDecoderLayer` (Llama, Qwen2, Mistral, SmolLM) on the CPU, no tensor parallelism (the row-
parallel products all-reduce in Python), fp32 or bf16 activations, and every linear layer's method one
whose kernel the driver can call (`_resolve`). Per forward, `forward` runs under the CPU-native
attention backend (decodes and prompt chunks alike); anything else returns None and the Python layers
run. The same call looks up the first stage's embeddings where their table is one it can read (plain in
the activations' dtype, or bf16 packed at load) and runs the last stage's final RMSNorm.
TIDAL_NATIVE_DECODER=0 turns it off (an A/B switch for benchmarks: both paths give the same bits).
`suspended()` sends forwards to the Python layers for a while (module hooks, such as the w8a8 smoothing's
activation observers, run only there).
"""
from __future__ import annotations

import contextlib
import ctypes
import os
from ctypes import POINTER, Structure, c_float, c_int32, c_int64, c_void_p

import torch

from tidal import forward_context
from tidal.distributed import get_tp_size
from tidal.layers import cpu_kernels, gguf_kernels, quant_kernels
from tidal.layers.attention.backends import CPUNativeBackend
from tidal.native import NativeLibrary, cpu_isa

MAX_TOKENS = 16384  # tokens per forward (beyond, the Python layers: the driver's buffers are sized per call)
_DTYPES = {torch.float32: 0, torch.bfloat16: 1}
_SUSPENDED = [0]  # > 0: every forward runs the Python layers


@contextlib.contextmanager
def suspended():
    """Forwards run through the Python layers (and their module hooks) inside this block."""
    _SUSPENDED[0] += 1
    try:
        yield
    finally:
        _SUSPENDED[0] -= 1


class _Linear(Structure):
    _fields_ = [("kind", c_int32), ("fmt", c_int32), ("fn", c_void_p), ("w", c_void_p), ("bias", c_void_p),
                ("aux", c_void_p), ("aux2", c_void_p), ("n", c_int64), ("k", c_int64)]


class _Layer(Structure):
    _fields_ = [("qkv", _Linear), ("o", _Linear), ("gate_up", _Linear), ("down", _Linear),
                ("in_norm", c_void_p), ("post_norm", c_void_p), ("k_cache", c_void_p), ("v_cache", c_void_p),
                ("k_scale", c_float), ("v_scale", c_float), ("kv_dtype", c_int32), ("pad", c_int32),
                ("k_shift", c_void_p)]


class _Model(Structure):
    _fields_ = [(name, c_int64) for name in ("num_layers", "hidden", "hq", "hk", "head_dim", "inter", "block_size",
                                             "max_blocks")] + [
        ("eps", c_float), ("scale", c_float), ("dtype", c_int32), ("threads", c_int32),
        ("rms_norm", c_void_p), ("rope", c_void_p), ("write_kv", c_void_p), ("attention", c_void_p),
        ("silu_and_mul", c_void_p), ("gate_up_silu", c_void_p), ("cos_full", c_void_p), ("sin_signed", c_void_p),
        ("layers", POINTER(_Layer)), ("final_norm", c_void_p), ("final_eps", c_float), ("embed_table", c_void_p),
        ("embed_unpack", c_void_p), ("embed_rows", c_int64)]


def _configure(lib: ctypes.CDLL) -> None:
    lib.tidal_decoder_forward.restype = ctypes.c_int
    lib.tidal_decoder_forward.argtypes = ([c_void_p, c_void_p, c_void_p, ctypes.c_int] + [c_void_p] * 5
                                          + [c_int64, c_void_p, c_int64, c_void_p])
    lib.tidal_decoder_reserve.restype = c_int64
    lib.tidal_decoder_reserve.argtypes = [c_void_p, c_int64]


_LIB = NativeLibrary("decoder", os.path.join(os.path.dirname(__file__), "csrc", "decoder.cpp"),
                     ["-O3", "-std=c++17"], [], _configure)


def _addr(lib: ctypes.CDLL, name: str) -> int:
    return ctypes.cast(getattr(lib, name), c_void_p).value


def _ptr(t: torch.Tensor | None) -> int | None:
    return None if t is None else t.data_ptr()


def _bias_ok(bias: torch.Tensor | None, dtype: torch.dtype) -> bool:
    return bias is None or (bias.dtype == dtype and bias.is_contiguous() and bias.device.type == "cpu")


def _linear(kind: int, fn: int, w: torch.Tensor, n: int, k: int, bias, fmt: int = 0, aux=None, aux2=None) -> _Linear:
    """A descriptor of csrc/decoder.cpp's Linear; aux, aux2: tensors (their addresses) or addresses."""
    def address(a):
        return a if a is None or isinstance(a, int) else a.data_ptr()
    return _Linear(kind, fmt, fn, w.data_ptr(), _ptr(bias), address(aux), address(aux2), n, k)


def _plain(weight: torch.Tensor, bias, x_dtype: torch.dtype, rows: int, skinny: bool,
           invariant: bool) -> _Linear | None:
    """The kernel `cpu_linear` would run for `rows` rows of x_dtype on this plain (or packed) weight."""
    gemm = cpu_kernels.gemm_lib()
    if gemm is None or not weight.is_contiguous() or weight.device.type != "cpu" or not _bias_ok(bias, x_dtype):
        return None
    packed = getattr(weight, "bf16_packed", None)
    if packed is not None:
        if not cpu_kernels.packed_gemm_available(x_dtype):
            return None
        name = "tidal_gemm_bf16_packed" if x_dtype == torch.bfloat16 else "tidal_linear_f32_bf16_packed"
        return _linear(0, _addr(gemm, name), weight, packed[0], packed[1], bias)
    n, k = weight.shape
    if weight.dtype == torch.bfloat16 and x_dtype == torch.float32:  # bf16_weight_linear
        return _linear(0, _addr(gemm, "tidal_linear_f32_bf16w"), weight, n, k, bias, fmt=1)
    if weight.dtype != x_dtype:
        return None
    if x_dtype == torch.float32:  # linear_f32, in both modes
        return _linear(0, _addr(gemm, "tidal_linear_f32"), weight, n, k, bias, fmt=1)
    if cpu_isa() != "avx512_bf16":  # bf16 products without VDPBF16PS: torch's (F.linear)
        return None
    if invariant:  # invariant_linear, bf16
        name = "tidal_skinny_gemm_bf16_ordered" if rows <= cpu_kernels.SKINNY_MAX_ROWS else "tidal_gemm_bf16"
    else:
        name = ("tidal_skinny_gemm_bf16" if rows <= cpu_kernels.SKINNY_MAX_ROWS and skinny
                else "tidal_gemm_bf16")
    return _linear(0, _addr(gemm, name), weight, n, k, bias)


def _resolve(layer, x_dtype: torch.dtype, rows: int, skinny: bool, invariant: bool) -> _Linear | None:
    """The kernel a linear layer's method would call for `rows` rows of x_dtype in this forward context,
    as a descriptor for the driver; None when the method is not one the driver knows (or its kernel
    would not run here), and the Python layers are used."""
    from tidal.layers.linear import Bf16WeightLinearMethod, UnquantizedLinearMethod
    from tidal.layers.quantization.gguf import GGUFLinearMethod
    from tidal.layers.quantization.methods import Fp8LinearMethod, Int8LinearMethod, W8A8LinearMethod
    method, bias = layer.quant_method, layer.bias
    kind = type(method)
    if kind is Bf16WeightLinearMethod:  # bf16_weight_linear: the native kernel for fp32 activations only
        return _plain(layer.weight, bias, x_dtype, rows, skinny, invariant) if x_dtype == torch.float32 else None
    if kind is UnquantizedLinearMethod:
        return _plain(layer.weight, bias, x_dtype, rows, skinny, invariant)
    if kind is GGUFLinearMethod:
        weight = layer.weight
        if len(layer.gguf_rows) != 1:
            return None
        if weight.dtype != torch.uint8:
            return _plain(weight, bias, x_dtype, rows, skinny, invariant)
        lib = gguf_kernels.gguf_lib()
        if lib is None or not _bias_ok(bias, x_dtype) or not weight.is_contiguous():
            return None
        fmt = gguf_kernels.BLOCK_FORMATS[gguf_kernels.block_format(weight)][0]
        n, k = weight.shape[0], weight.shape[1] * gguf_kernels.block_values(weight.shape[-1])
        if gguf_kernels.streams(rows, x_dtype, skinny, invariant):
            return _linear(1, _addr(lib, gguf_kernels.decode_kernel(fmt)), weight, n, k, bias, fmt=fmt)
        gemm, rows_fn = cpu_kernels.gemm_lib(), lib.tidal_rows_fns.get(x_dtype)
        if gemm is None or rows_fn is None:
            return None
        name = "tidal_gemm_bf16_rows" if x_dtype == torch.bfloat16 else "tidal_linear_f32_rows"
        return _linear(2, _addr(gemm, name), weight, n, k, bias, fmt=fmt, aux=rows_fn)
    if kind in (Int8LinearMethod, Fp8LinearMethod, W8A8LinearMethod):
        lib, weight, scale = quant_kernels.quant_lib(), layer.weight, layer.weight_scale
        if (lib is None or weight.dim() != 2 or not weight.is_contiguous() or not scale.is_contiguous()
                or scale.dtype != torch.float32 or scale.numel() != weight.shape[0] or not _bias_ok(bias, x_dtype)):
            return None
        n, k = weight.shape
        if kind is W8A8LinearMethod:
            sums = getattr(layer, "weight_row_sums", None)
            if weight.dtype != torch.int8 or sums is None or not sums.is_contiguous() or sums.dtype != torch.int32:
                return None
            return _linear(4, _addr(lib, "tidal_w8a8_linear"), weight, n, k, bias, aux=scale, aux2=sums)
        wkind = {torch.int8: 0, torch.float8_e4m3fn: 1}.get(weight.dtype)
        if wkind is None:
            return None
        fmt = wkind | (0 if invariant else quant_kernels.W8A16_TILES)  # as weight_only_linear asks
        return _linear(3, _addr(lib, "tidal_w8a16_linear"), weight, n, k, bias, fmt=fmt, aux=scale)
    return None


def _embedding(embedding, dtype: torch.dtype, hidden: int) -> tuple[torch.Tensor, int | None, int] | None:
    """(table, the unpacking kernel's address or None, rows) of an embedding whose lookup the driver can do:
    a plain table in the activations' dtype (F.embedding's rows), or a bf16 one packed at load
    (tidal.loader.pack_bf16_weights; unpack_bf16_rows reads it); None elsewhere (GGUF blocks, a quantized or
    narrower table: the Python lookup)."""
    if embedding is None or embedding.tp_size != 1 or embedding.dtype != dtype or embedding.weight_scale is not None:
        return None
    table = embedding.weight
    if table.device.type != "cpu" or not table.is_contiguous():
        return None
    packed = getattr(table, "bf16_packed", None)
    if packed is not None:
        gemm = cpu_kernels.gemm_lib()
        if gemm is None or dtype != torch.bfloat16 or packed[1] != hidden:
            return None
        return table, _addr(gemm, "tidal_unpack_bf16_rows"), table.shape[0] * 16  # (unpack_bf16_rows' bound)
    if table.dtype != dtype or table.dim() != 2 or table.shape[1] != hidden:
        return None
    return table, None, table.shape[0]


class NativeDecoder:
    """The decoder layers of one LlamaModel stage, run by csrc/decoder.cpp (see the module docstring)."""

    def __init__(self, layers: list, dtype: torch.dtype, final_norm=None, embedding=None) -> None:
        """final_norm: the model's final RMSNorm (on the last pipeline stage), run after the last layer in the
        same call, or None; embedding: the first stage's VocabParallelEmbedding, whose rows a forward from token
        ids (forward(input_ids=...)) looks up in the same call, or None. Their Python calls, next to a forward
        that has passed the weights through the caches, each cost a single stream's step ~0.07 ms."""
        self.layers, self.dtype, self.final_norm, self.embedding = layers, dtype, final_norm, embedding
        self._plans: dict = {}
        self.calls = 0  # forwards run natively (tests and benchmarks read it)
        self.picked_calls = 0  # of which returned only their output rows (ForwardContext.output_rows)
        self.empty_calls = 0  # of which had none to return

    @staticmethod
    def for_model(model) -> NativeDecoder | None:
        """For a LlamaModel whose stage this driver can run, else None (checked once, at the first forward)."""
        from tidal.models.llama import LlamaDecoderLayer
        if os.environ.get("TIDAL_NATIVE_DECODER", "1") == "0" or get_tp_size() != 1:
            return None
        layers = list(model.layers)[model.start_layer:model.end_layer]
        if not layers or model.dtype not in _DTYPES or any(type(layer) is not LlamaDecoderLayer for layer in layers):
            return None
        first = layers[0]
        if first.input_layernorm.weight.device.type != "cpu" or _LIB.get() is None:
            return None
        lib = cpu_kernels.native_lib()
        if lib is None or lib.tidal_vector_lanes() <= 1:  # silu-and-mul has no scalar build
            return None
        a0, m0 = first.self_attn, first.mlp
        for layer in layers:
            a, m = layer.self_attn, layer.mlp
            if ((a.num_heads, a.num_kv_heads, a.head_dim) != (a0.num_heads, a0.num_kv_heads, a0.head_dim)
                    or a._rotary[0] is not a0._rotary[0] or a.attn.sliding_window is not None
                    or a.attn.scale != a0.attn.scale
                    or m.down_proj.in_features != m0.down_proj.in_features
                    or {layer.input_layernorm.eps, layer.post_attention_layernorm.eps} != {first.input_layernorm.eps}
                    or not (layer.input_layernorm.weight.dtype == layer.post_attention_layernorm.weight.dtype
                            == model.dtype)):
                return None
        norm = model.norm
        if norm is not None and not (norm.weight.dtype == model.dtype and norm.weight.is_contiguous()
                                     and norm.weight.device.type == "cpu"):
            norm = None  # the Python RMSNorm runs after the call
        return NativeDecoder(layers, model.dtype, norm, _embedding(model.embed_tokens, model.dtype, model.hidden_size))

    def _plan(self, key, x_dtype: torch.dtype, rows: int, skinny: bool, invariant: bool, threads: int):
        plan = self._plans.get(key, False)
        if plan is not False:
            return plan
        plan = self._build(x_dtype, rows, skinny, invariant, threads)
        self._plans[key] = plan
        return plan

    def _build(self, x_dtype, rows, skinny, invariant, threads):
        lib = cpu_kernels.native_lib()
        if lib is None:
            return None
        entries = []
        for layer in self.layers:
            a, m = layer.self_attn, layer.mlp
            kv = a.attn.kv_cache
            if kv is None or not kv.is_contiguous() or kv.device.type != "cpu":
                return None
            cache_dtype = cpu_kernels._CACHE_DTYPES.get(kv.dtype)
            if cache_dtype is None or not cpu_kernels._cache_dtype_ok(x_dtype, kv.dtype):
                return None
            linears = [_resolve(p, x_dtype, rows, skinny, invariant)
                       for p in (a.qkv_proj, a.o_proj, m.gate_up_proj, m.down_proj)]
            if any(li is None for li in linears):
                return None
            if (linears[0].n != (a.num_heads + 2 * a.num_kv_heads) * a.head_dim
                    or linears[2].n != 2 * m.down_proj.in_features):
                return None
            # K blocks and V blocks: the two halves of the layer's cache (attention/layer.py: split_kv_cache)
            entries.append(_Layer(*linears, layer.input_layernorm.weight.data_ptr(),
                                  layer.post_attention_layernorm.weight.data_ptr(), kv[0].data_ptr(), kv[1].data_ptr(),
                                  a.attn.k_scale, a.attn.v_scale, cache_dtype, 0, _ptr(a.attn.k_shift)))
        # gate/up and silu-and-mul as one product where every layer's gate/up is the product of a packed bf16
        # weight: bf16 rows with AVX-512 BF16 (on the AMX tiles or with VDPBF16PS), fp32 rows on any vector
        # build (the same bits; the kernel still says no where it does not apply, steps of up to 4 rows, and
        # the two calls run)
        gemm = cpu_kernels.gemm_lib()
        if x_dtype == torch.bfloat16:
            names = ("tidal_gemm_bf16_packed", "tidal_gemm_bf16_packed_silu") if cpu_isa() == "avx512_bf16" else None
        else:
            names = ("tidal_linear_f32_bf16_packed", "tidal_linear_f32_bf16_packed_silu")
        gate_up_silu = None
        if gemm is not None and names is not None:
            product, fused = (_addr(gemm, name) for name in names)
            if all(e.gate_up.fn == product and e.gate_up.kind == 0 for e in entries):
                gate_up_silu = fused
        first = self.layers[0]
        a = first.self_attn
        kv = a.attn.kv_cache
        rotary = a._rotary[0]
        array = (_Layer * len(entries))(*entries)
        model = _Model(len(entries), first.input_layernorm.weight.shape[0], a.num_heads, a.num_kv_heads, a.head_dim,
                       first.mlp.down_proj.in_features, kv.shape[3], 0, first.input_layernorm.eps, a.attn.scale,
                       _DTYPES[x_dtype], threads, _addr(lib, "tidal_rms_norm"), _addr(lib, "tidal_rope_neox"),
                       _addr(lib, "tidal_write_kv"), _addr(lib, "tidal_paged_attention_decode"),
                       _addr(lib, "tidal_silu_and_mul"), gate_up_silu, rotary.cos_full.data_ptr(),
                       rotary.sin_signed.data_ptr(), array,
                       None if self.final_norm is None else self.final_norm.weight.data_ptr(),
                       0.0 if self.final_norm is None else self.final_norm.eps,
                       *((None, None, 0) if self.embedding is None else
                         (self.embedding[0].data_ptr(), self.embedding[1], self.embedding[2])))
        model._keep = (array, rotary)
        return model

    def reserve(self, num_tokens: int, invariant: bool) -> int:
        """Make the activations' scratch of a forward over num_tokens rows on this thread and write its pages
        once (csrc/decoder.cpp: tidal_decoder_reserve), so that the first step that large does not take
        their page faults: the bytes written (0 where the native forward does not run or needs no kept
        scratch). For an engine that is idle, on the thread that runs its forwards."""
        lib = _LIB.get()
        kv = self.layers[0].self_attn.attn.kv_cache
        if lib is None or kv is None or not 1 <= num_tokens <= MAX_TOKENS:
            return 0
        plan = self._build(self.dtype, num_tokens, False, invariant, torch.get_num_threads())
        return 0 if plan is None else max(0, lib.tidal_decoder_reserve(ctypes.addressof(plan), num_tokens))

    def forward(self, hidden: torch.Tensor | None, residual: torch.Tensor | None, positions: torch.Tensor,
                last_stage: bool = False, input_ids: torch.Tensor | None = None
                ) -> tuple[torch.Tensor, torch.Tensor | None] | None:
        """The stage's layers over hidden [T, H] (and the residual coming in), or over the embeddings of
        input_ids [T] (hidden and residual None; self.embedding): (hidden, residual) as the last layer
        returns them, or, with the final norm (self.final_norm), (its output, None); None where the Python
        layers (and embedding) must run. On the last stage, where the forward context names its output rows
        (ForwardContext.output_rows), only those rows come back."""
        ctx = forward_context._CONTEXT
        if input_ids is not None:
            if (self.embedding is None or input_ids.dtype != torch.int64 or input_ids.dim() != 1
                    or not input_ids.is_contiguous()):
                return None
            T = input_ids.shape[0]
        elif (hidden.dtype != self.dtype or hidden.dim() != 2
                or (residual is not None and residual.shape != hidden.shape)):
            return None
        else:
            T = hidden.shape[0]
        if (ctx is None or _SUSPENDED[0] or type(ctx.attn_backend) is not CPUNativeBackend or not 1 <= T <= MAX_TOKENS
                or positions.dtype != torch.int64):
            return None
        meta = ctx.attn_metadata
        lib = _LIB.get()
        threads = torch.get_num_threads()
        kv = self.layers[0].self_attn.attn.kv_cache
        if lib is None or kv is None:
            return None
        skinny, invariant = bool(ctx.skinny_gemm), bool(ctx.batch_invariant)
        # the kernels' choices depend on the row count only at these thresholds
        rows_key = (T <= cpu_kernels.SKINNY_MAX_ROWS, T <= gguf_kernels.DECODE_MAX_ROWS[self.dtype])
        key = (rows_key, skinny, invariant, threads, cpu_isa(), kv.data_ptr())
        plan = self._plan(key, self.dtype, T, skinny, invariant, threads)
        if plan is None:
            return None
        table = meta.block_table
        slots, rows, lens = meta.slot_mapping, meta.token_rows, meta.seq_lens
        if any(t.dtype != torch.int64 or not t.is_contiguous() for t in (table, slots, rows, lens, positions)):
            return None
        plan.max_blocks = table.shape[1]
        n = None if not last_stage or ctx.output_rows is None else len(ctx.output_rows)
        picked = None if n is None else torch.tensor(ctx.output_rows or [0], dtype=torch.int64)
        if input_ids is not None:  # the embeddings are written into it
            out = torch.empty(T, self.layers[0].input_layernorm.weight.shape[0], dtype=self.dtype)
        else:
            out = hidden.contiguous().clone()
        res = torch.empty_like(out) if residual is None else residual.contiguous().clone()
        status = lib.tidal_decoder_forward(ctypes.addressof(plan), out.data_ptr(), res.data_ptr(), residual is not None,
                                           positions.data_ptr(), slots.data_ptr(), table.data_ptr(), rows.data_ptr(),
                                           lens.data_ptr(), T, _ptr(picked), n or 0, _ptr(input_ids))
        if status == 2:  # an id outside the table: the Python lookup says which
            return None
        if status:
            self._plans[key] = None  # a kernel refused: this kind of step keeps the Python layers
            return None
        self.calls += 1
        if n is not None:
            self.picked_calls += 1
            self.empty_calls += n == 0
            out, res = out[:n], res[:n]
        return (out, None) if self.final_norm is not None else (out, res)
