"""Products and lookups on weights kept in GGUF blocks (llama.cpp's Q4_0, Q4_1, Q8_0).

A packed weight is a uint8 tensor [rows, K / 32, block_bytes]: each row's blocks as the file stores
them. The block size names the format (18 bytes: Q4_0, 20: Q4_1, 34: Q8_0), so a packed tensor needs no
side record of its type, and row slices (tensor-parallel shards, fused QKV parts, the Q/K un-permutation)
and block-aligned column slices are plain tensor slices.

On the CPU the products go to csrc/gguf_gemm.cpp (built per ISA level by tidal.native): up to 16 rows
of a decode step (or the LM head's sampled rows) stream the packed weights once, widening each block in
registers; prompt rows and bigger batches dequantize the layer into a scratch weight of the activation
dtype and run the dense GEMM (`cpu_linear`). Without a compiler, and on GPUs, the torch dequantization
below (`dequantize_reference`, which defines what the kernels compute) feeds F.linear.
"""
from __future__ import annotations

import ctypes
import os

import torch
import torch.nn.functional as F

from tidal.forward_context import skinny_gemm_allowed
from tidal.native import NativeLibrary

QK = 32  # values per block
# format name -> (type code of gguf_gemm.cpp, bytes per block)
BLOCK_FORMATS = {"Q4_0": (0, 18), "Q4_1": (1, 20), "Q8_0": (2, 34)}
_BY_BYTES = {nbytes: (name, code) for name, (code, nbytes) in BLOCK_FORMATS.items()}
_DTYPES = {torch.float32: 0, torch.bfloat16: 1}
# Decode steps of up to this many rows take the packed kernel (gguf_gemm.cpp's kMaxRows); beyond, the
# dequantized scratch weight and the dense GEMM.
DECODE_MAX_ROWS = 16


def block_format(packed: torch.Tensor) -> str:
    """The format name of a packed weight [rows, blocks, block_bytes]."""
    if packed.dtype != torch.uint8 or packed.dim() != 3 or packed.shape[-1] not in _BY_BYTES:
        raise ValueError(f"not a packed GGUF weight: {packed.dtype} {tuple(packed.shape)}")
    return _BY_BYTES[packed.shape[-1]][0]


def dequantize_reference(packed: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Torch dequantization of packed blocks [..., blocks, block_bytes] to [..., blocks * 32] (any device):
    w = d * q + m per block, d and m fp16 (Q4_0: m = -8d; Q8_0: m = 0)."""
    fmt = block_format(packed.reshape(-1, *packed.shape[-2:]))
    d = packed[..., 0:2].contiguous().view(torch.float16).float()  # [..., blocks, 1]
    if fmt == "Q8_0":
        q = packed[..., 2:].contiguous().view(torch.int8).float()
        w = d * q
    else:
        qs = packed[..., 4:] if fmt == "Q4_1" else packed[..., 2:]
        q = torch.cat([qs & 0x0F, qs >> 4], dim=-1).float()  # values j and j + 16 of each block
        if fmt == "Q4_1":
            w = d * q + packed[..., 2:4].contiguous().view(torch.float16).float()
        else:
            w = d * (q - 8)
    return w.reshape(*packed.shape[:-2], -1).to(dtype)


def _configure(lib: ctypes.CDLL) -> None:
    lib.tidal_gguf_linear.restype = ctypes.c_int
    lib.tidal_gguf_linear.argtypes = ([ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int, ctypes.c_void_p,
                                       ctypes.c_void_p] + [ctypes.c_int64] * 3 + [ctypes.c_int] * 2)
    lib.tidal_gguf_dequantize.restype = ctypes.c_int
    lib.tidal_gguf_dequantize.argtypes = ([ctypes.c_void_p, ctypes.c_int, ctypes.c_void_p] + [ctypes.c_int64] * 2
                                          + [ctypes.c_int] * 2)


_LIB = NativeLibrary("gguf_gemm", os.path.join(os.path.dirname(__file__), "csrc", "gguf_gemm.cpp"),
                     ["-O3", "-fopenmp", "-std=c++17"], ["-fopenmp"], _configure)


def gguf_lib() -> ctypes.CDLL | None:
    return _LIB.get()


def dequantize(packed: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Packed blocks [rows, blocks, block_bytes] -> [rows, blocks * 32] in dtype: the native kernel on the
    CPU for fp32 / bf16, the torch reference elsewhere."""
    lib = gguf_lib() if packed.device.type == "cpu" and dtype in _DTYPES else None
    if lib is None:
        return dequantize_reference(packed, dtype)
    code = BLOCK_FORMATS[block_format(packed)][0]
    packed = packed.contiguous()
    rows, K = packed.shape[0], packed.shape[1] * QK
    out = torch.empty(rows, K, dtype=dtype)
    if rows and lib.tidal_gguf_dequantize(packed.data_ptr(), code, out.data_ptr(), rows, K, _DTYPES[dtype],
                                          torch.get_num_threads()):
        return dequantize_reference(packed, dtype)
    return out


def gguf_linear(x: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """x [..., K] @ dequant(packed)^T (+ bias) in x's dtype, for a packed weight [N, K / 32, block_bytes]."""
    shape = x.shape
    x2 = x.reshape(-1, shape[-1])
    M, N = x2.shape[0], packed.shape[0]
    # prompt rows never take the decode kernel (as cpu_linear's skinny GEMM): a prompt's last few tokens
    # computed after a prefix-cache hit round exactly as when the whole prompt runs
    if x.device.type == "cpu" and x.dtype in _DTYPES and 1 <= M <= DECODE_MAX_ROWS and skinny_gemm_allowed():
        lib = gguf_lib()
        if lib is not None and (bias is None or bias.dtype == x.dtype):
            x2 = x2.contiguous()
            out = torch.empty(M, N, dtype=x.dtype)
            code = BLOCK_FORMATS[block_format(packed)][0]
            bias = None if bias is None else bias.contiguous()  # held: a temporary would be freed before the call
            if not lib.tidal_gguf_linear(x2.data_ptr(), packed.data_ptr(), code,
                                         None if bias is None else bias.data_ptr(), out.data_ptr(),
                                         M, N, x2.shape[1], _DTYPES[x.dtype], torch.get_num_threads()):
                return out.view(*shape[:-1], N)
    if x.device.type == "cpu":
        from tidal.layers.linear import cpu_linear
        # the dequantized scratch weight in x's dtype: the dense kernels of the model dtype run on it
        return cpu_linear(x, dequantize(packed, x.dtype), bias)
    return F.linear(x, dequantize_reference(packed, x.dtype), bias)
