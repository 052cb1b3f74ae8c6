"""The 8-bit-weight products (tidal/layers/quant_kernels.py) against their torch references, for every ISA
level this CPU can run (on an AVX-512 VNNI machine the AVX-512, AVX2 and scalar builds are checked too)."""
import pytest
import torch

from tidal.layers import quant_kernels as qk
from tidal.native import isa_override, runnable_isas

ROWS = [1, 2, 3, 4, 5, 17, 64]  # one skinny pass; several (W8A16 up to 32 rows) or blocked (W8A8); blocked
SHAPES = [(37, 101), (130, 576)]  # N, K: ragged register tiles and vector tails; a multiple of 64
DTYPES = [torch.float32, torch.bfloat16]
U = 2.0 ** -24  # fp32 unit roundoff


@pytest.fixture(autouse=True, params=runnable_isas())
def isa(request):
    """Every test runs once per ISA level: the kernels built for that level, whose build must succeed."""
    with isa_override(request.param):
        assert qk.quant_lib() is not None, f"the 8-bit GEMM kernels failed to build for {request.param}"
        yield request.param


def _weights(n: int, k: int, kind: torch.dtype, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    if kind == torch.int8:
        return torch.randint(-127, 128, (n, k), dtype=torch.int8, generator=g)
    return (torch.randn(n, k, generator=g) * 50).to(torch.float8_e4m3fn)  # normals, denormals and zeros


def _inputs(rows: int, n: int, k: int, dtype: torch.dtype, seed: int = 0):
    g = torch.Generator().manual_seed(seed + 1)
    x = torch.randn(rows, k, generator=g).to(dtype)
    scale = torch.rand(n, generator=g) * 0.01 + 1e-3
    bias = torch.randn(n, generator=g).to(dtype)
    return x, scale, bias


def _assert_fp32_product_close(out, reference, x, wq, scale, bias):
    """out and reference each within the error bound of an fp32 dot product of K terms in any order,
    (K + 16) * u * sum_k |x_k w_k| (16: the lane reduction), scaled, plus the roundings of the scale
    and bias steps, plus half a bf16 step when the result is bf16, of the exact (fp64) value; so they
    are at most twice that apart. They differ only in the order of the fp32 sums."""
    xd, wd = x.double(), wq.double()
    exact = (xd @ wd.t()) * scale.double() + (0 if bias is None else bias.double())
    bound = (x.shape[1] + 16) * U * (xd.abs() @ wd.abs().t()) * scale.double() + 4 * U * exact.abs()
    if out.dtype == torch.bfloat16:
        bound = bound + 2.0 ** -8 * exact.abs()
    assert out.dtype == x.dtype and out.shape == exact.shape
    assert ((out.double() - exact).abs() <= bound).all()
    assert ((out.double() - reference.double()).abs() <= 2 * bound).all()


@pytest.mark.parametrize("kind", [torch.int8, torch.float8_e4m3fn])
@pytest.mark.parametrize("n,k", SHAPES)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows", ROWS)
def test_w8a16_matches_the_fp32_product(kind, rows, dtype, n, k):
    wq = _weights(n, k, kind)
    x, scale, bias = _inputs(rows, n, k, dtype)
    native_fn = qk.int8_linear if kind == torch.int8 else qk.fp8_linear
    reference_fn = qk.int8_linear_reference if kind == torch.int8 else qk.fp8_linear_reference
    for b in (bias, None):  # (tiles=False: the exact W8A16 path at every row count)
        _assert_fp32_product_close(native_fn(x, wq, scale, b, tiles=False), reference_fn(x, wq, scale, b),
                                   x, wq, scale, b)


@pytest.mark.parametrize("kind", [torch.int8, torch.float8_e4m3fn])
def test_w8a16_bf16_batches_are_the_dense_bf16_kernel_on_the_rounded_weight(kind, isa):
    """bf16 calls of 12 rows or more run the bf16 GEMM over rows bf16(w * scale) made as it reaches them:
    bitwise the dense bf16 kernel's result on that weight (AVX-512 BF16; the exact path elsewhere, and
    below 12 rows, and with tiles off)."""
    from tidal.layers.cpu_kernels import bf16_linear
    n, k = 203, 576
    wq = _weights(n, k, kind)
    x, scale, bias = _inputs(40, n, k, torch.bfloat16)
    fn = qk.int8_linear if kind == torch.int8 else qk.fp8_linear
    rounded = (wq.float() * scale.unsqueeze(1)).to(torch.bfloat16)
    for rows in (12, 13, 40):
        got = fn(x[:rows], wq, scale, bias)
        exact = fn(x[:rows], wq, scale, bias, tiles=False)
        if isa == "avx512_bf16":
            assert torch.equal(got, bf16_linear(x[:rows], rounded, bias)), rows
            assert not torch.equal(got, exact)  # the tiles really ran
        else:
            assert torch.equal(got, exact), (isa, rows)
    assert torch.equal(fn(x[:11], wq, scale, bias), fn(x[:11], wq, scale, bias, tiles=False))


@pytest.mark.parametrize("kind", [torch.int8, torch.float8_e4m3fn])
@pytest.mark.parametrize("dtype", DTYPES)
def test_w8a16_rows_do_not_depend_on_the_batch(kind, dtype):
    """Each output is one fp32 dot product in a fixed order: a row computed alone or among a few (the
    skinny path), or inside a large call (the blocked path, several chunks of rows) is bitwise the same."""
    n, k = 203, 1541  # chunks of 42 rows in the blocked path; ragged tiles and tails everywhere
    wq = _weights(n, k, kind)
    x, scale, bias = _inputs(90, n, k, dtype)
    fn = qk.int8_linear if kind == torch.int8 else qk.fp8_linear
    full = fn(x, wq, scale, bias, tiles=False)  # (as batch-invariant mode calls it)
    for part in (slice(0, 1), slice(7, 8), slice(10, 13), slice(20, 24), slice(30, 35), slice(40, 49), slice(3, 60),
                 slice(89, 90)):
        assert torch.equal(fn(x[part], wq, scale, bias, tiles=False), full[part]), part


def test_fp8_widens_every_encoding_exactly():
    """All 254 finite E4M3 values (normals, denormals, both zeros), one per output, through the skinny
    and the blocked path: x = identity picks each weight out exactly."""
    codes = torch.tensor([b for b in range(256) if b & 0x7F != 0x7F], dtype=torch.uint8)
    wq = codes.view(torch.float8_e4m3fn).view(2, 127)
    scale = torch.ones(2)
    eye = torch.eye(127)
    assert torch.equal(qk.fp8_linear(eye, wq, scale), wq.float().t())
    assert torch.equal(qk.fp8_linear(eye[5:6], wq, scale), wq.float().t()[5:6])


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("k", [1, 37, 576, 1541])
def test_quantize_rows_matches_reference_exactly(dtype, k):
    g = torch.Generator().manual_seed(k)
    x = (torch.randn(9, k, generator=g) * torch.logspace(-3, 3, 9).unsqueeze(1)).to(dtype)
    x[0] = 0  # a row of zeros: scale 1, all zero
    if k >= 8:  # max 127 gives scale 1: exact halves must round to even
        x[1, :8] = torch.tensor([127.0, 2.5, -3.5, 0.5, -0.5, 1.5, 126.5, -127.0])
    xq, scale = qk.quantize_rows_int8(x)
    ref_q, ref_scale = qk.quantize_rows_int8_reference(x)
    assert xq.dtype == torch.int8 and scale.dtype == torch.float32
    assert torch.equal(xq, ref_q) and torch.equal(scale, ref_scale)
    assert scale[0] == 1 and (xq[0] == 0).all()
    assert xq.abs().max() == 127
    if k >= 8:
        assert xq[1, :8].tolist() == [127, 2, -4, 0, 0, 2, 126, -127]


@pytest.mark.parametrize("n,k", SHAPES)
@pytest.mark.parametrize("rows", ROWS)
def test_int8_gemm_accumulator_is_exact(rows, n, k):
    g = torch.Generator().manual_seed(rows)
    xq = torch.randint(-127, 128, (rows, k), dtype=torch.int8, generator=g)
    xq[0, : k // 2] = 127  # extremes: every product at its largest magnitude
    wq = _weights(n, k, torch.int8)
    wq[0] = -127
    expected = qk.int8_gemm_i32_reference(xq, wq)
    sums = qk.int8_row_sums(wq)
    assert torch.equal(sums, qk.int8_row_sums_reference(wq))
    assert torch.equal(qk.int8_gemm_i32(xq, wq, sums), expected)
    assert torch.equal(qk.int8_gemm_i32(xq, wq), expected)  # row sums computed by the kernel


def test_int8_gemm_long_rows_and_a_vocabulary_sized_n():
    """K = 16k of extreme products stays exact in int32 (|acc| <= K * 127^2 < 2^31, also with the u8 shift
    of VPDPBUSD); N of an LM head."""
    xq = torch.full((2, 16387), 127, dtype=torch.int8)
    xq[1] = -127
    wq = torch.full((5, 16387), -127, dtype=torch.int8)
    wq[1, ::2] = 127
    assert torch.equal(qk.int8_gemm_i32(xq, wq, qk.int8_row_sums(wq)), qk.int8_gemm_i32_reference(xq, wq))
    xq, wq = torch.randint(-127, 128, (5, 64), dtype=torch.int8), _weights(49157, 64, torch.int8)
    assert torch.equal(qk.int8_gemm_i32(xq, wq, qk.int8_row_sums(wq)), qk.int8_gemm_i32_reference(xq, wq))


@pytest.mark.parametrize("n,k", SHAPES)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows", ROWS)
def test_w8a8_matches_reference_exactly(rows, dtype, n, k):
    """Same quantized activations, exact int32 sums, the same fp32 epilogue (acc * x_scale * w_scale +
    bias, two roundings and an add): bitwise the torch reference."""
    wq = _weights(n, k, torch.int8)
    x, scale, bias = _inputs(rows, n, k, dtype)
    sums = qk.int8_row_sums(wq)
    for b in (bias, None):
        out = qk.w8a8_linear(x, wq, scale, b, sums)
        assert out.dtype == dtype and torch.equal(out, qk.w8a8_linear_reference(x, wq, scale, b))
    assert torch.equal(qk.w8a8_linear(x, wq, scale, bias), qk.w8a8_linear_reference(x, wq, scale, bias))


@pytest.mark.parametrize("dtype", DTYPES)
def test_w8a8_of_more_rows_than_one_quantized_chunk(dtype):
    """Activations are quantized 512 rows at a time (bounded scratch): a prompt chunk of 700 rows."""
    wq = _weights(20, 37, torch.int8)
    x, scale, bias = _inputs(700, 20, 37, dtype)
    assert torch.equal(qk.w8a8_linear(x, wq, scale, bias), qk.w8a8_linear_reference(x, wq, scale, bias))


@pytest.mark.parametrize("dtype", DTYPES)
def test_w8a8_rows_do_not_depend_on_the_batch(dtype):
    n, k = 203, 1541
    wq = _weights(n, k, torch.int8)
    x, scale, bias = _inputs(90, n, k, dtype)
    sums = qk.int8_row_sums(wq)
    full = qk.w8a8_linear(x, wq, scale, bias, sums)
    for part in (slice(0, 1), slice(10, 13), slice(20, 24), slice(30, 35), slice(40, 57), slice(89, 90)):
        assert torch.equal(qk.w8a8_linear(x[part], wq, scale, bias, sums), full[part]), part


def test_leading_dims_are_kept():
    wq = _weights(20, 64, torch.int8)
    x, scale, bias = _inputs(6, 20, 64, torch.float32)
    x3 = x.view(2, 3, 64)
    for fn in (qk.int8_linear, qk.w8a8_linear):
        assert torch.equal(fn(x3, wq, scale, bias), fn(x, wq, scale, bias).view(2, 3, 20))


def test_inputs_it_does_not_handle_return_none():
    wq = _weights(20, 64, torch.int8)
    x, scale, bias = _inputs(3, 20, 64, torch.float32)
    assert qk.int8_linear(x.half(), wq, scale) is None  # fp16 activations
    assert qk.int8_linear(x, wq.view(torch.float8_e4m3fn), scale) is None  # fp8 weights
    assert qk.fp8_linear(x, wq, scale) is None  # int8 weights
    assert qk.int8_linear(x, wq, scale, bias.bfloat16()) is None  # bias of another dtype
    assert qk.int8_linear(x, wq, scale.double()) is None  # scale not fp32
    assert qk.int8_linear(x[:, :63], wq, scale) is None  # K mismatch
    assert qk.w8a8_linear(x, wq, scale, None, qk.int8_row_sums(wq).long()) is None  # row sums not int32
    assert qk.int8_gemm_i32(x, wq) is None  # activations not quantized
