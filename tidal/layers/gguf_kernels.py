"""Products and lookups on weights kept in GGUF blocks (llama.cpp's Q4_0, Q4_1, Q5_0, Q5_1, Q8_0 and the
K-quants Q4_K, Q5_K, Q6_K).

A packed weight is a uint8 tensor [rows, K / QK, block_bytes]: each row's blocks as the file stores
them, QK = 32 values per block (256 for the K-quants). The block size names the format (18 bytes: Q4_0,
20: Q4_1, 22: Q5_0, 24: Q5_1, 34: Q8_0, 144: Q4_K, 176: Q5_K, 210: Q6_K), so a packed tensor needs no
side record of its type, and row slices (tensor-parallel shards, fused QKV parts, the Q/K un-permutation)
and block-aligned column slices are plain tensor slices.

On the CPU the products go to csrc/gguf_gemm.cpp (built per ISA level by tidal.native): a decode step of
a few rows (DECODE_MAX_ROWS; or the LM head's sampled rows) streams the packed weights once, widening each
block in registers; prompt rows and bigger batches take gemm.cpp's dense blocked kernels, whose weight
tiles gguf_gemm.cpp dequantizes as they are reached (`_rows_linear`). Without a compiler, and on GPUs, the
torch dequantization below (`dequantize_reference`, which defines what the kernels compute) feeds F.linear.
"""
from __future__ import annotations

import ctypes
import os

import torch
import torch.nn.functional as F

from tidal.forward_context import batch_invariant, skinny_gemm_allowed
from tidal.native import NativeLibrary

QK = 32  # values per block of the 32-value formats (a K-quant block holds 256: BLOCK_VALUES)
# format name -> (type code of gguf_gemm.cpp, bytes per block)
BLOCK_FORMATS = {"Q4_0": (0, 18), "Q4_1": (1, 20), "Q8_0": (2, 34), "Q5_0": (3, 22), "Q5_1": (4, 24),
                 "Q4_K": (5, 144), "Q5_K": (6, 176), "Q6_K": (7, 210)}
BLOCK_VALUES = {name: 256 if name.endswith("_K") else QK for name in BLOCK_FORMATS}  # values per block
_BY_BYTES = {nbytes: (name, code) for name, (code, nbytes) in BLOCK_FORMATS.items()}
_DTYPES = {torch.float32: 0, torch.bfloat16: 1}
# Decode steps of up to this many rows take the streaming kernel (gguf_gemm.cpp, at most its kMaxRows = 16);
# beyond, the dense blocked kernels over dequantized tiles. Measured on SmolLM2's shapes (`python
# benchmarks/gguf_products.py`: a layer's four products x 30 plus the LM head, 2 threads, AVX-512 BF16):
# bf16 rows, streaming 2.6 / 9.4 / 9.9 / 25.1 ms for 1 / 6 / 8 / 16 rows against 6.1 / 8.8 / 9.3 / 10.3 ms
# in tiles; fp32 rows (tiles above 8 rows only) 26.5 against 16.1 ms for 16.
DECODE_MAX_ROWS = {torch.bfloat16: 6, torch.float32: 8}


def block_format(packed: torch.Tensor) -> str:
    """The format name of a packed weight [rows, blocks, block_bytes]."""
    if packed.dtype != torch.uint8 or packed.dim() != 3 or packed.shape[-1] not in _BY_BYTES:
        raise ValueError(f"not a packed GGUF weight: {packed.dtype} {tuple(packed.shape)}")
    return _BY_BYTES[packed.shape[-1]][0]


def block_values(block_bytes: int) -> int:
    """Values per block of the format whose blocks are block_bytes long (32, or 256 for a K-quant)."""
    if block_bytes not in _BY_BYTES:
        raise ValueError(f"no GGUF block format of {block_bytes} bytes")
    return BLOCK_VALUES[_BY_BYTES[block_bytes][0]]


def _f16(b: torch.Tensor) -> torch.Tensor:
    """[..., 2] bytes -> [..., 1] fp32 (the fp16 they hold)."""
    return b.contiguous().view(torch.float16).float()


def _shifts(values, device) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.uint8, device=device)


def dequantize_reference(packed: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Torch dequantization of packed blocks [..., blocks, block_bytes] to [..., blocks * QK] (any device),
    equal to gguf-py's `gguf.quants.dequantize`: w = d * q + m per block of 32, d and m fp16 (Q4_0:
    m = -8d, Q5_0: m = -16d, Q8_0: m = 0); the K-quants as ggml-quants.c (Q4_K / Q5_K: w = d * sc * q -
    dmin * mn over 8 sub-blocks of 32 with 6-bit scales and mins; Q6_K: w = d * sc * (q - 32) over 16
    sub-blocks of 16 with int8 scales)."""
    fmt = block_format(packed.reshape(-1, *packed.shape[-2:]))
    p, dev = packed, packed.device
    lead = packed.shape[:-1]  # [..., blocks]
    if fmt in ("Q4_K", "Q5_K"):
        d, dmin, s = _f16(p[..., 0:2]), _f16(p[..., 2:4]), p[..., 4:16]
        # 6-bit scales and mins of the 8 sub-blocks (ggml-quants.c's get_scale_min_k4)
        lo, mid, hi = s[..., 0:4], s[..., 4:8], s[..., 8:12]
        sc = torch.cat([lo & 0x3F, (hi & 0x0F) | ((lo >> 2) & 0x30)], dim=-1).float()
        mn = torch.cat([mid & 0x3F, (hi >> 4) | ((mid >> 2) & 0x30)], dim=-1).float()
        # sub-block 2i + h: nibble h of bytes 32i .. 32i + 31
        qs = p[..., 16:144] if fmt == "Q4_K" else p[..., 48:176]
        q = (qs.reshape(*lead, 4, 1, 32) >> _shifts([0, 4], dev).view(2, 1)) & 0x0F
        q = q.reshape(*lead, 8, 32)
        if fmt == "Q5_K":  # bit j of byte i of qh: the fifth bit of value i of sub-block j
            qh = (p[..., 16:48].unsqueeze(-2) >> _shifts(range(8), dev).view(8, 1)) & 1
            q = q | (qh << 4)
        w = (d * sc).unsqueeze(-1) * q.float() - (dmin * mn).unsqueeze(-1)
    elif fmt == "Q6_K":
        # values 128h + 32k + i: nibble k // 2 of ql[64h + 32 (k % 2) + i], bits 2k of qh[32h + i] above
        ql = (p[..., 0:128].reshape(*lead, 2, 1, 64) >> _shifts([0, 4], dev).view(2, 1)) & 0x0F
        qh = (p[..., 128:192].reshape(*lead, 2, 1, 32) >> _shifts([0, 2, 4, 6], dev).view(4, 1)) & 3
        q = (ql.reshape(*lead, 8, 32) | (qh.reshape(*lead, 8, 32) << 4)).float() - 32
        scales = p[..., 192:208].contiguous().view(torch.int8).float()  # one per 16 values
        w = (_f16(p[..., 208:210]) * scales).unsqueeze(-1) * q.reshape(*lead, 16, 16)
    elif fmt == "Q8_0":
        w = _f16(p[..., 0:2]) * p[..., 2:].contiguous().view(torch.int8).float()
    else:
        d = _f16(p[..., 0:2])  # [..., blocks, 1]
        qs = p[..., -16:]
        q = torch.cat([qs & 0x0F, qs >> 4], dim=-1)  # values j and j + 16 of each block
        if fmt in ("Q5_0", "Q5_1"):  # bit j of the little-endian uint32 qh: the fifth bit of value j
            j = torch.arange(32, device=dev)
            qh = p[..., -20:-16]
            q = q | (((qh[..., j // 8] >> (j % 8).to(torch.uint8)) & 1) << 4)
        q = q.float()
        if fmt in ("Q4_1", "Q5_1"):
            w = d * q + _f16(p[..., 2:4])
        else:
            w = d * (q - (8 if fmt == "Q4_0" else 16))
    return w.reshape(*packed.shape[:-2], -1).to(dtype)


def decode_activations() -> str:
    """TIDAL_GGUF_ACTIVATIONS: "float" (the default: activations kept in fp32/bf16) or "q8" (quantized to
    int8 per chunk of 32 for the decode products); any other value is refused."""
    value = os.environ.get("TIDAL_GGUF_ACTIVATIONS", "float")
    if value not in ("float", "q8"):
        raise ValueError(f"TIDAL_GGUF_ACTIVATIONS={value!r}: expected 'float' (the default) or 'q8'")
    return value


def decode_kernel(code: int) -> str:
    """The decode product's kernel for block type `code`: tidal_gguf_linear (activations kept in fp32/bf16,
    the default), or with TIDAL_GGUF_ACTIVATIONS=q8 tidal_gguf_linear_q8 (int8 activations per chunk of 32,
    integer dot products: llama.cpp's way; not Q6_K)."""
    if decode_activations() == "q8" and code != BLOCK_FORMATS["Q6_K"][0]:
        return "tidal_gguf_linear_q8"
    return "tidal_gguf_linear"


def _configure(lib: ctypes.CDLL) -> None:
    lib.tidal_gguf_linear.restype = ctypes.c_int
    lib.tidal_gguf_linear.argtypes = ([ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int, ctypes.c_void_p,
                                       ctypes.c_void_p] + [ctypes.c_int64] * 3 + [ctypes.c_int] * 2)
    lib.tidal_gguf_linear_q8.restype = ctypes.c_int
    lib.tidal_gguf_linear_q8.argtypes = lib.tidal_gguf_linear.argtypes
    lib.tidal_gguf_dequantize.restype = ctypes.c_int
    lib.tidal_gguf_dequantize.argtypes = ([ctypes.c_void_p, ctypes.c_int, ctypes.c_void_p] + [ctypes.c_int64] * 2
                                          + [ctypes.c_int] * 2)
    # the row makers' addresses, for gemm.cpp's tile kernels (by activation dtype)
    lib.tidal_rows_fns = {dtype: ctypes.cast(getattr(lib, name), ctypes.c_void_p).value
                          for dtype, name in ((torch.bfloat16, "tidal_gguf_rows_bf16"),
                                              (torch.float32, "tidal_gguf_rows_f32"))}


_LIB = NativeLibrary("gguf_gemm", os.path.join(os.path.dirname(__file__), "csrc", "gguf_gemm.cpp"),
                     ["-O3", "-fopenmp", "-std=c++17"], ["-fopenmp"], _configure)


def gguf_lib() -> ctypes.CDLL | None:
    return _LIB.get()


def dequantize(packed: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Packed blocks [rows, blocks, block_bytes] -> [rows, blocks * QK] in dtype: the native kernel on the
    CPU for fp32 / bf16, the torch reference elsewhere."""
    lib = gguf_lib() if packed.device.type == "cpu" and dtype in _DTYPES else None
    if lib is None:
        return dequantize_reference(packed, dtype)
    code = BLOCK_FORMATS[block_format(packed)][0]
    packed = packed.contiguous()
    rows, K = packed.shape[0], packed.shape[1] * block_values(packed.shape[-1])
    out = torch.empty(rows, K, dtype=dtype)
    if rows and lib.tidal_gguf_dequantize(packed.data_ptr(), code, out.data_ptr(), rows, K, _DTYPES[dtype],
                                          torch.get_num_threads()):
        return dequantize_reference(packed, dtype)
    return out


def streams(rows: int, dtype: torch.dtype, skinny: bool, invariant: bool) -> bool:
    """Whether a product of `rows` rows of dtype activations takes the streaming decode kernel (else the
    tiles), in a forward whose context allows the skinny kernels (skinny) and is batch-invariant or not."""
    return 1 <= rows <= DECODE_MAX_ROWS[dtype] and skinny and not (invariant and dtype == torch.bfloat16)


def gguf_linear(x: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """x [..., K] @ dequant(packed)^T (+ bias) in x's dtype, for a packed weight [N, K / QK, block_bytes]."""
    shape = x.shape
    x2 = x.reshape(-1, shape[-1])
    M, N = x2.shape[0], packed.shape[0]
    # prompt rows never take the decode kernel (as cpu_linear's skinny GEMM): a prompt's last few tokens
    # computed after a prefix-cache hit round exactly as when the whole prompt runs
    if x.device.type == "cpu" and x.dtype in _DTYPES and streams(M, x.dtype, skinny_gemm_allowed(), batch_invariant()):
        lib = gguf_lib()
        if lib is not None and (bias is None or bias.dtype == x.dtype):
            x2 = x2.contiguous()
            out = torch.empty(M, N, dtype=x.dtype)
            code = BLOCK_FORMATS[block_format(packed)][0]
            bias = None if bias is None else bias.contiguous()  # held: a temporary would be freed before the call
            if not getattr(lib, decode_kernel(code))(x2.data_ptr(), packed.data_ptr(), code,
                                                     None if bias is None else bias.data_ptr(), out.data_ptr(),
                                                     M, N, x2.shape[1], _DTYPES[x.dtype], torch.get_num_threads()):
                return out.view(*shape[:-1], N)
    if x.device.type == "cpu":
        if (out := _rows_linear(x, packed, bias)) is not None:
            return out
        from tidal.layers.linear import cpu_linear
        # the dequantized scratch weight in x's dtype: the dense kernels of the model dtype run on it
        return cpu_linear(x, dequantize(packed, x.dtype), bias)
    return F.linear(x, dequantize_reference(packed, x.dtype), bias)


def gguf_linear_q8(x: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor | None:
    """The decode product with the activations quantized to int8 per chunk of 32 (scale max |x| / 127, round
    to nearest even) and integer dot products, as llama.cpp computes it: x [M, K] (1 to 16 rows, fp32 or
    bf16, on the CPU) @ dequant(packed)^T (+ bias). The engine's decode products take it with
    TIDAL_GGUF_ACTIVATIONS=q8 (`decode_kernel`); measured against the default in docs/quantization.md. None
    where it does not apply (no AVX2 build, Q6_K)."""
    lib = gguf_lib() if x.device.type == "cpu" else None
    M, K = x.shape
    if lib is None or x.dtype not in _DTYPES or not 1 <= M <= 16 or (bias is not None and bias.dtype != x.dtype):
        return None
    x = x.contiguous()
    out = torch.empty(M, packed.shape[0], dtype=x.dtype)
    bias = None if bias is None else bias.contiguous()
    if lib.tidal_gguf_linear_q8(x.data_ptr(), packed.data_ptr(), BLOCK_FORMATS[block_format(packed)][0],
                                None if bias is None else bias.data_ptr(), out.data_ptr(), M, packed.shape[0], K,
                                _DTYPES[x.dtype], torch.get_num_threads()):
        return None
    return out


def _rows_linear(x: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor | None:
    """x @ dequant(packed)^T through gemm.cpp's blocked kernels, each tile of weight rows dequantized as
    the kernel reaches it (tidal_gguf_rows_bf16 / _f32), so the blocks are read once per panel of x and
    no copy of the layer is written and reread. bf16 x (AVX-512 BF16): the product of the bf16-rounded
    weights in bf16_linear's order for any number of rows (batch-invariant); fp32 x: more than 8 rows.
    None where it does not run."""
    lib = gguf_lib()
    fn = None if lib is None else lib.tidal_rows_fns.get(x.dtype)
    if fn is None:
        return None
    from tidal.layers.cpu_kernels import rows_linear
    return rows_linear(x, packed, fn, BLOCK_FORMATS[block_format(packed)][0], packed.shape[0], x.shape[-1], bias)


def invariant_supported(act_dtype: torch.dtype) -> bool:
    """Whether products on packed blocks are batch-invariant here: bf16 activations on a CPU whose build
    runs the bf16 tile kernel (AVX-512 BF16), which every number of rows takes in that mode."""
    from tidal.layers.cpu_kernels import packed_gemm_available
    return act_dtype == torch.bfloat16 and gguf_lib() is not None and packed_gemm_available()
