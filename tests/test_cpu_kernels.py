"""The native CPU kernels against the torch code they replace, for every ISA level this CPU can run
(on an AVX-512 machine the AVX2 and generic builds are checked too)."""
import pytest
import torch

from tidal.layers import cpu_kernels
from tidal.layers.attention.kv_cache_dtype import read_blocks, write_slots
from tidal.layers.attention.layer import decode_attention, kv_cache_shape, split_kv_cache
from tidal.layers.rotary import RotaryEmbedding
from tidal.native import isa_override, runnable_isas

DTYPES = [torch.float32, torch.bfloat16]


@pytest.fixture(autouse=True, params=runnable_isas())
def isa(request):
    """Every test runs once per ISA level: the kernels built for that level, whose build must succeed."""
    with isa_override(request.param):
        assert cpu_kernels.native_lib() is not None, f"the native CPU kernels failed to build for {request.param}"
        assert cpu_kernels.gemm_lib() is not None, f"the native GEMM failed to build for {request.param}"
        yield request.param


@pytest.mark.parametrize("rows", [7, 40])  # 40 rows of 8 heads: past the size from which threads share the rows
@pytest.mark.parametrize("dtype", DTYPES)
def test_rope_matches_torch(dtype, rows):
    torch.manual_seed(0)
    rope = RotaryEmbedding(64, 512, 10000.0, {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                              "high_freq_factor": 4.0, "original_max_position_embeddings": 64})
    qkv = torch.randn(rows, 12 * 64, dtype=dtype)
    x = qkv[:, :8 * 64].view(rows, 8, 64)  # strided rows, as the model passes q and k heads of a fused qkv
    positions = torch.tensor([0, 5, 17, 100, 255, 256, 511] + torch.randint(0, 512, (rows - 7,)).tolist())
    native = cpu_kernels.rope_neox(x, rope.cos_full, rope.sin_signed, positions)
    cos = rope.cos_full[positions].unsqueeze(1).to(dtype)
    sin = rope.sin_signed[positions].unsqueeze(1).to(dtype)
    reference = torch.addcmul(x * cos, torch.cat((x[..., 32:], x[..., :32]), -1), sin)
    torch.testing.assert_close(native, reference, atol=1e-6 if dtype == torch.float32 else 0, rtol=1e-6 if
                               dtype == torch.float32 else 0)


@pytest.mark.parametrize("dtype", DTYPES)
def test_write_kv_matches_indexing(dtype):
    torch.manual_seed(0)
    nb, hk, bs, d = 6, 3, 4, 16
    kv = torch.zeros(kv_cache_shape(nb, bs, hk, d), dtype=dtype)
    k_cache, v_cache = split_kv_cache(kv)
    qkv = torch.randn(5, 4 * hk * d, dtype=dtype)
    k, v = qkv[:, hk * d:2 * hk * d].view(5, hk, d), qkv[:, 3 * hk * d:].view(5, hk, d)
    slots = torch.tensor([0, 3, 9, 22, 13])
    assert cpu_kernels.write_kv(k, v, k_cache, v_cache, slots)
    expected = torch.zeros_like(kv)
    write_slots(*split_kv_cache(expected), k, v, slots, 1.0, 1.0)  # the torch path
    assert torch.equal(kv, expected)
    if dtype == torch.bfloat16:  # the storage: a token's dims 2p and 2p + 1 side by side in K, tokens 2k and
        raw_k = kv[0].view(nb, hk, d // 2, bs, 2)  # 2k + 1 of a dim side by side in V
        assert torch.equal(raw_k[slots // bs, :, :, slots % bs, :], k.view(5, hk, d // 2, 2))
        raw_v = kv[1].view(nb, hk, bs // 2, d, 2)
        assert torch.equal(raw_v[slots // bs, :, (slots % bs) // 2, :, (slots % bs) % 2], v)


@pytest.mark.parametrize("dtype", DTYPES)
def test_write_kv_of_whole_blocks_matches_indexing(dtype):
    """A prompt's tokens that fill whole 16-token blocks in order (K written a block at a time where the cache
    is bf16), beside tokens that start mid-block, skip a slot, or end short of a block: the same cache as
    the torch path writes."""
    torch.manual_seed(0)
    nb, hk, bs, d = 8, 3, 16, 64
    kv = torch.zeros(kv_cache_shape(nb, bs, hk, d), dtype=dtype)
    k_cache, v_cache = split_kv_cache(kv)
    slots = torch.tensor(list(range(32, 48)) + [5, 7, 6] + list(range(80, 96)) + list(range(16, 31)) + [100]
                         + list(range(112, 128)))
    t = len(slots)
    qkv = torch.randn(t, 4 * hk * d, dtype=dtype)
    k, v = qkv[:, hk * d:2 * hk * d].view(t, hk, d), qkv[:, 3 * hk * d:].view(t, hk, d)
    assert cpu_kernels.write_kv(k, v, k_cache, v_cache, slots)
    expected = torch.zeros_like(kv)
    write_slots(*split_kv_cache(expected), k, v, slots, 1.0, 1.0)
    assert torch.equal(kv, expected)


def test_fp32_rows_written_into_a_bf16_cache_keep_every_nan():
    """NaNs of any payload stay NaNs in a bf16 cache, as 0x7fc0 (c10's scalar conversion; torch's vector one
    writes 0xffff): rounding the fp32 bits to nearest would carry a payload of all ones into the sign (-0.0)
    or past bit 31 (+0.0)."""
    nb, hk, bs, d = 4, 1, 4, 32
    kv = torch.zeros(kv_cache_shape(nb, bs, hk, d), dtype=torch.bfloat16)
    k_cache, v_cache = split_kv_cache(kv)
    bits = torch.randn(2, hk, d).view(torch.int32)
    payloads = [0x7FFFFFFF, -1, 0x7FC00000, 0x7F800001, 0x7FFF8000, -0x00008000]  # -1: 0xFFFFFFFF
    for i, p in enumerate(payloads):
        bits[0, 0, 3 * i] = p
        bits[1, 0, 3 * i + 1] = p
    k = bits.view(torch.float32)
    v = k.flip(-1).contiguous()
    slots = torch.tensor([1, 6])
    assert cpu_kernels.write_kv(k, v, k_cache, v_cache, slots)
    got_k = read_blocks(k_cache, slots // bs, torch.bfloat16, 1.0)[torch.arange(2), :, :, slots % bs]
    got_v = read_blocks(v_cache, slots // bs, torch.bfloat16, 1.0)[torch.arange(2), :, slots % bs]
    for got, x in ((got_k, k), (got_v, v)):
        nan = torch.isnan(x)
        assert int(nan.sum()) == 2 * len(payloads)
        assert torch.equal(torch.isnan(got), nan)
        assert (got.view(torch.int16)[nan] == 0x7FC0).all()  # c10's scalar conversion's NaN
        assert torch.equal(got[~nan], x[~nan].to(torch.bfloat16))


@pytest.mark.parametrize("dtype", DTYPES)
def test_paged_decode_matches_torch(dtype):
    torch.manual_seed(0)
    nb, hk, hq, bs, d = 40, 3, 9, 16, 64
    kv = torch.randn(kv_cache_shape(nb, bs, hk, d), dtype=dtype)
    k_cache, v_cache = split_kv_cache(kv)
    seq_lens = torch.tensor([1, 17, 150, 33])
    tables = torch.randperm(nb)[:40].view(4, 10)
    q = torch.randn(4, hq, d, dtype=dtype)
    native = cpu_kernels.paged_attention_decode(q, k_cache, v_cache, tables, seq_lens, d ** -0.5)
    reference = decode_attention(q.float(), k_cache.float(), v_cache.float(), tables, seq_lens, 150, d ** -0.5)
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(native.float(), reference, atol=tol, rtol=tol)
    # queries that share a request's table through an index (prompt tokens of one chunk)
    index = torch.tensor([2, 2, 0, 3])
    lens = torch.tensor([148, 150, 9, 20])
    native = cpu_kernels.paged_attention_decode(q, k_cache, v_cache, tables, lens, d ** -0.5, index)
    reference = decode_attention(q.float(), k_cache.float(), v_cache.float(), tables[index], lens, 150, d ** -0.5)
    torch.testing.assert_close(native.float(), reference, atol=tol, rtol=tol)
    # the queries read in place from wider rows ([q | k], as the rotary writes them): the same bits
    rows = torch.randn(4, (hq + hk) * d, dtype=dtype)
    rows[:, :hq * d] = q.reshape(4, -1)
    strided = rows[:, :hq * d].view(4, hq, d)
    assert not strided.is_contiguous()
    assert torch.equal(cpu_kernels.paged_attention_decode(strided, k_cache, v_cache, tables, lens, d ** -0.5, index),
                       native)


@pytest.mark.parametrize("rows", [1, 2, 3, 4])
@pytest.mark.parametrize("k", [576, 100])  # a multiple of 32 and a ragged tail
def test_skinny_gemm_matches_fp32_product(isa, rows, k):
    torch.manual_seed(0)
    x = torch.randn(rows, k).bfloat16()
    w = torch.randn(1027, k).bfloat16()  # not a multiple of the 4-row tile
    bias = torch.randn(1027).bfloat16()
    out = cpu_kernels.skinny_linear(x, w, bias)
    if isa == "generic":
        assert out is None  # no vector path: the caller uses oneDNN
        return
    reference = (x.float() @ w.float().t() + bias.float()).bfloat16()
    # same products, fp32 accumulation in another order: one bf16 rounding step apart (plus the
    # accumulation error, visible only where the sum cancels to near zero)
    torch.testing.assert_close(out.float(), reference.float(), atol=1e-3, rtol=2 ** -7)


@pytest.mark.parametrize("rows", [1, 5, 16, 17, 48, 130])
@pytest.mark.parametrize("n,k", [(1027, 576), (960, 101), (40, 1536)])  # ragged tiles, odd K, long K
def test_bf16_gemm_matches_fp32_product(isa, rows, n, k):
    """bf16 x bf16 for any number of rows, from the plain weight: the fp32 product rounded once to bf16
    (within an fp32 accumulation error), the bias added in fp32 before that rounding."""
    torch.manual_seed(0)
    x = torch.randn(rows, k).bfloat16()
    w = torch.randn(n, k).bfloat16()
    bias = torch.randn(n).bfloat16()
    out = cpu_kernels.bf16_linear(x, w, bias)
    if isa != "avx512_bf16":
        assert out is None  # no VDPBF16PS: the caller uses F.linear
        return
    assert out.dtype == torch.bfloat16 and out.shape == (rows, n)
    reference = torch.nn.functional.linear(x.double(), w.double(), bias.double())
    # half a bf16 step (2^-8 relative) for the rounding, 1e-4 for fp32 accumulation over up to 1536 terms
    torch.testing.assert_close(out.double(), reference, atol=1e-4, rtol=2 ** -8)
    no_bias = cpu_kernels.bf16_linear(x, w, None)
    torch.testing.assert_close(no_bias.double(), reference - bias.double(), atol=1e-4, rtol=2 ** -8)


@pytest.mark.parametrize("rows,k", [(70, 576), (300, 1536)])  # one panel of x; several
def test_bf16_gemm_rows_do_not_depend_on_the_batch(isa, rows, k):
    """Each output is one fp32 lane accumulating the k pairs in order: a row computed alone, among a
    few rows or inside a large call (other register tiles, other panels) is bitwise the same."""
    torch.manual_seed(0)
    x = torch.randn(rows, k).bfloat16()
    w = torch.randn(963, k).bfloat16()
    bias = torch.randn(963).bfloat16()
    full = cpu_kernels.bf16_linear(x, w, bias)
    if isa != "avx512_bf16":
        assert full is None
        return
    for part in (slice(5, 6), slice(10, 13), slice(0, 16), slice(20, 37), slice(16, 64), slice(rows - 1, rows)):
        assert torch.equal(cpu_kernels.bf16_linear(x[part], w, bias), full[part]), part


def test_bf16_gemm_keeps_inf_and_nan(isa):
    x = torch.ones(3, 64).bfloat16()
    x[1, 7] = float("inf")
    x[2, 9] = float("nan")
    w = torch.ones(20, 64).bfloat16()
    out = cpu_kernels.bf16_linear(x, w, None)
    if isa != "avx512_bf16":
        assert out is None
        return
    assert torch.equal(out[0], torch.full((20,), 64.0).bfloat16())
    assert torch.isposinf(out[1]).all() and torch.isnan(out[2]).all()


@pytest.mark.parametrize("rows", [1, 3, 4, 7, 8, 9, 40, 130])
@pytest.mark.parametrize("k", [576, 100])
def test_bf16_weight_gemm_matches_fp32_product(rows, k):
    torch.manual_seed(0)
    x = torch.randn(rows, k)
    w = torch.randn(1027, k).bfloat16()
    bias = torch.randn(1027)
    out = cpu_kernels.linear_f32_bf16w(x, w, bias)
    reference = torch.nn.functional.linear(x.double(), w.double(), bias.double()).float()
    torch.testing.assert_close(out, reference, atol=1e-4, rtol=1e-5)
    no_bias = cpu_kernels.linear_f32_bf16w(x, w, None)
    torch.testing.assert_close(no_bias, reference - bias, atol=1e-4, rtol=1e-5)


def test_bf16_weight_gemm_rows_do_not_depend_on_the_batch():
    """Each output is one fp32 dot product in a fixed order: a row computed alone (the skinny path),
    in a few rows or in a large batch (the blocked path) is bitwise the same."""
    torch.manual_seed(0)
    x = torch.randn(70, 576)
    w = torch.randn(960, 576).bfloat16()
    bias = torch.randn(960)
    full = cpu_kernels.linear_f32_bf16w(x, w, bias)
    for rows in (slice(5, 6), slice(10, 13), slice(0, 8), slice(20, 36)):
        assert torch.equal(cpu_kernels.linear_f32_bf16w(x[rows], w, bias), full[rows])


def test_invariant_bf16_linear_rows_do_not_depend_on_the_batch(isa):
    """Batch-invariant bf16 products with a bias: 1-4 rows (on AVX2 widened, multiplied and rounded in one
    native call) and a batch of 70 give each row the same bits; without AVX-512 BF16 they are the fp32
    bf16-weight kernel's rounded to bf16."""
    from tidal.layers.linear import invariant_linear
    torch.manual_seed(0)
    x = torch.randn(70, 2048).bfloat16()  # long rows: a sum in another order rounds to another bf16 now and
    w = torch.randn(4096, 2048).bfloat16()  # then (torch's product for the few rows fails this test)
    bias = torch.randn(4096).bfloat16()
    full = invariant_linear(x, w, bias)
    if isa != "avx512_bf16":
        assert torch.equal(full, cpu_kernels.linear_f32_bf16w(x.float(), w, bias.float()).bfloat16())
    for rows in (slice(5, 6), slice(10, 12), slice(0, 3), slice(20, 24), slice(30, 36)):
        assert torch.equal(invariant_linear(x[rows], w, bias), full[rows])


@pytest.mark.parametrize("k", [576, 577, 33])  # odd K: the last pair is (x_last, 0)
def test_ordered_skinny_gemm_equals_the_blocked_gemm_bitwise(isa, k):
    """Batch-invariant mode: 1-4 rows through the skinny kernel written in the blocked kernel's order
    give exactly the blocked kernel's bits for those rows inside a larger call."""
    torch.manual_seed(0)
    x = torch.randn(40, k).bfloat16()
    w = torch.randn(103, k).bfloat16()  # a last tile of 7 weight rows
    bias = torch.randn(103).bfloat16()
    full = cpu_kernels.bf16_linear(x, w, bias)
    if isa != "avx512_bf16":
        assert cpu_kernels.skinny_linear_ordered(x[:1], w, bias) is None
        return
    for rows in (slice(0, 1), slice(3, 5), slice(17, 20), slice(36, 40)):
        assert torch.equal(cpu_kernels.skinny_linear_ordered(x[rows].contiguous(), w, bias), full[rows]), rows
    assert torch.equal(cpu_kernels.skinny_linear_ordered(x[:2].contiguous(), w, None),
                       cpu_kernels.bf16_linear(x, w, None)[:2])


@pytest.mark.parametrize("n,k", [(103, 576), (960, 577), (40, 33), (17, 2050)])  # ragged N, odd K, K > 2048
def test_packed_gemm_gives_the_blocked_gemms_bits_for_any_number_of_rows(isa, n, k):
    """bf16 weights packed at load: every number of rows (1-4 stream the weight, more take the blocked
    kernel over the packed layout) gives bitwise what the blocked kernel gives on the plain weight; the
    table's rows read back exactly; without an AVX-512 BF16 build, cpu_linear unpacks and still agrees."""
    from tidal.layers.linear import cpu_linear
    torch.manual_seed(0)
    x = torch.randn(70, k).bfloat16()
    w = torch.randn(n, k).bfloat16()
    bias = torch.randn(n).bfloat16()
    packed = cpu_kernels.pack_bf16_weight(w)
    ids = torch.tensor([[0, n - 1], [n // 2, 5]])
    assert torch.equal(cpu_kernels.unpack_bf16_rows(packed, ids, k), w[ids])  # natively
    assert torch.equal(cpu_kernels.unpack_bf16_rows(packed, ids.int(), k), w[ids])  # torch's gather
    assert torch.equal(cpu_kernels.unpack_bf16_weight(packed, n, k), w)
    with pytest.raises(IndexError):
        cpu_kernels.unpack_bf16_rows(packed, torch.tensor([0, packed.shape[0] * 16]), k)
    param = torch.nn.Parameter(packed, requires_grad=False)
    param.bf16_packed = (n, k)
    if isa != "avx512_bf16":
        assert cpu_kernels.packed_linear(x, packed, n, k, bias) is None
        torch.testing.assert_close(cpu_linear(x[:3], param, bias), torch.nn.functional.linear(x[:3], w, bias),
                                   atol=0.05, rtol=0.02)
        return
    full = cpu_kernels.bf16_linear(x, w, bias)
    for rows in (slice(0, 1), slice(3, 5), slice(17, 20), slice(36, 40), slice(0, 5), slice(10, 27), slice(0, 70)):
        assert torch.equal(cpu_kernels.packed_linear(x[rows].contiguous(), packed, n, k, bias), full[rows]), rows
        assert torch.equal(cpu_linear(x[rows], param, bias), full[rows]), rows
    assert torch.equal(cpu_kernels.packed_linear(x[:2].contiguous(), packed, n, k, None),
                       cpu_kernels.bf16_linear(x[:2].contiguous(), w, None))


@pytest.mark.parametrize("n,k", [(1000, 576), (103, 64), (40, 577)])  # several weight groups a thread; K % 32 != 0
def test_packed_gemm_of_a_thousand_rows_and_more_gives_each_row_the_bits_of_a_small_batch(isa, n, k):
    """From 1,024 rows the tile kernel runs its blocks in another order (each block of rows over a group of
    weight tiles): every row still gets the bits a batch of a few rows gives, with a last group of 12 rows
    and a last weight tile of 8 columns."""
    if isa != "avx512_bf16":
        return
    torch.manual_seed(2)
    x, w, bias = torch.randn(1100, k).bfloat16(), torch.randn(n, k).bfloat16(), torch.randn(n).bfloat16()
    packed = cpu_kernels.pack_bf16_weight(w)
    full = cpu_kernels.packed_linear(x, packed, n, k, bias)
    for rows in (slice(0, 1), slice(0, 40), slice(500, 533), slice(1088, 1100)):
        assert torch.equal(cpu_kernels.packed_linear(x[rows].contiguous(), packed, n, k, bias), full[rows]), rows
    exact = x.double() @ w.double().T + bias.double()
    bound = (x.double().abs() @ w.double().abs().T) * k * 2.0 ** -24 + exact.abs() * 2.0 ** -8 + 1e-30
    assert ((full.double() - exact).abs() <= bound).all()
    x[5, 0], w[7, 3] = float("inf"), float("nan")  # row 5 infinite, column 7 NaN: the bf16 NaN 0x7fc0
    packed = cpu_kernels.pack_bf16_weight(w)
    full = cpu_kernels.packed_linear(x, packed, n, k, bias).view(torch.int16)
    assert (full[:, 7] == 0x7fc0).all() and full.view(torch.bfloat16)[5, 8:].isinf().all()
    for rows in (slice(0, 1), slice(0, 40), slice(1088, 1100)):
        got = cpu_kernels.packed_linear(x[rows].contiguous(), packed, n, k, bias)
        assert torch.equal(got.view(torch.int16), full[rows]), rows


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("rows,d,k,bias", [(5, 48, 64, False), (37, 1536, 576, False), (300, 32, 577, True),
                                            (1100, 64, 576, True), (64, 80, 576, True)])
def test_gate_up_with_silu_in_its_epilogue_is_bitwise_the_product_then_silu_and_mul(isa, rows, d, k, bias, dtype):
    """The gate/up product of a packed bf16 weight can hand its outputs to silu-and-mul as it makes them
    (gate tile j paired with up tile j, the [rows, 2d] product never stored): bitwise the two kernels one
    after the other, with a bias, K not a multiple of 32, 1,100 rows (the AMX path's other block order; more
    than one chunk of rows for fp32), an odd number of gate tiles (d = 48, 80), NaN and inf. bf16 rows with
    AVX-512 BF16 (on the AMX tiles or with VDPBF16PS), fp32 rows on every vector build. Elsewhere, and for
    fewer than 5 rows, it declines."""
    torch.manual_seed(3)
    x, w = torch.randn(rows, k).to(dtype), torch.randn(2 * d, k).bfloat16()
    b = torch.randn(2 * d).to(dtype) if bias else None
    x[rows // 2] *= 40  # large gates: silu's exp at both ends
    if rows > 100:
        x[3, 5], w[7, 2], w[d + 9, 4] = float("inf"), float("nan"), float("-inf")
    packed = cpu_kernels.pack_bf16_weight(w)
    fused = cpu_kernels.packed_linear_silu(x, packed, 2 * d, k, b)
    applies = isa == "avx512_bf16" if dtype == torch.bfloat16 else isa != "generic"
    if not applies:
        assert fused is None
        return
    reference = cpu_kernels.silu_and_mul(cpu_kernels.packed_linear(x, packed, 2 * d, k, b))
    assert fused is not None and torch.equal(fused.view(torch.int16), reference.view(torch.int16))
    assert cpu_kernels.packed_linear_silu(x[:4].contiguous(), packed, 2 * d, k, b) is None


@pytest.mark.parametrize("n,k", [(103, 576), (960, 577), (40, 33), (17, 2050), (1000, 64)])
def test_packed_fp32_gemm_rows_do_not_depend_on_the_batch(isa, n, k):
    """fp32 activations on a bf16 weight packed at load (dtype auto without native bf16): each output one
    FMA chain over k, so 1-4 rows (streamed, several weight tiles at once) and any larger number (register
    tiles of up to 5 or 8 rows, the rows spread evenly over them: 6 rows as 3 + 3, 13 as 5 + 4 + 4 or 7 + 6)
    give a row the same bits; the values are the fp32 product of the bf16 weight; without a vector build
    cpu_linear unpacks and still agrees."""
    from tidal.layers.linear import cpu_linear
    torch.manual_seed(0)
    x = torch.randn(70, k)
    w = torch.randn(n, k).bfloat16()
    bias = torch.randn(n)
    packed = cpu_kernels.pack_bf16_weight(w)
    param = torch.nn.Parameter(packed, requires_grad=False)
    param.bf16_packed = (n, k)
    reference = torch.nn.functional.linear(x.double(), w.double(), bias.double()).float()
    if isa == "generic":
        assert cpu_kernels.packed_linear(x, packed, n, k, bias) is None
        torch.testing.assert_close(cpu_linear(x[:3], param, bias), reference[:3], atol=1e-4, rtol=1e-5)
        return
    full = cpu_kernels.packed_linear(x, packed, n, k, bias)
    torch.testing.assert_close(full, reference, atol=1e-4, rtol=1e-5)
    for rows in (slice(0, 1), slice(3, 5), slice(17, 20), slice(36, 40), slice(0, 5), slice(0, 6), slice(2, 9),
                 slice(5, 16), slice(0, 13), slice(20, 36), slice(40, 61), slice(10, 27), slice(50, 70)):
        assert torch.equal(cpu_kernels.packed_linear(x[rows].contiguous(), packed, n, k, bias), full[rows]), rows
        assert torch.equal(cpu_linear(x[rows], param, bias), full[rows]), rows
    torch.testing.assert_close(cpu_kernels.packed_linear(x[:2].contiguous(), packed, n, k, None), reference[:2] - bias,
                               atol=1e-4, rtol=1e-5)
    inf = x[:6].clone()
    inf[1, 3], inf[4, k - 1] = float("inf"), float("nan")
    out = cpu_kernels.packed_linear(inf, packed, n, k, None)
    assert torch.isfinite(out[[0, 2, 3, 5]]).all() and not torch.isfinite(out[1]).any() and torch.isnan(out[4]).all()


@pytest.mark.parametrize("n,k", [(103, 576), (4099, 64), (40, 33)])
def test_packed_gemm_finds_each_rows_argmax_as_it_stores_the_logits(isa, n, k):
    """Greedy sampling's LM head: 1-4 rows give the packed kernel's logits and each row's argmax over its
    first n_valid columns as argmax_rows finds it in them: the first of equal maxima, NaN never winning, a
    row of NaNs 0, the columns past n_valid (a padded vocabulary) left out."""
    torch.manual_seed(0)
    w = torch.randn(n, k).bfloat16()
    w[n // 3] = w[n - 2]  # equal rows: equal logits, wherever they are the largest the first wins
    x = torch.randn(4, k).bfloat16()
    x[2] = 0  # a row of equal logits (bias None): the first column
    bias = torch.randn(n).bfloat16()
    bias[n // 3] = bias[n - 2] = 100  # the largest logit, at n // 3 and (equal) in the last tile
    bias[1] = float("nan")
    packed = cpu_kernels.pack_bf16_weight(w)
    if isa != "avx512_bf16":
        assert cpu_kernels.packed_linear_argmax(x[:1], packed, n, k, bias, n) is None
        return
    for rows in (1, 2, 3, 4):
        for b in (bias, None):
            for n_valid in (n, n - 3, 1):
                logits, found = cpu_kernels.packed_linear_argmax(x[:rows].contiguous(), packed, n, k, b, n_valid)
                want = cpu_kernels.packed_linear(x[:rows].contiguous(), packed, n, k, b)
                assert torch.equal(logits.view(torch.int16), want.view(torch.int16))  # bits: NaN is not equal
                assert found == cpu_kernels.argmax_rows(logits[:, :n_valid].contiguous()), (rows, n_valid)
                if b is bias and n_valid == n:
                    assert found[0] == n // 3
    nan_bias = torch.full((n,), float("nan")).bfloat16()
    assert cpu_kernels.packed_linear_argmax(x[:2].contiguous(), packed, n, k, nan_bias, n)[1] == [0, 0]
    assert cpu_kernels.packed_linear_argmax(x, packed, n, k, None, n)[1][2] == 0
    assert cpu_kernels.packed_linear_argmax(torch.randn(5, k).bfloat16(), packed, n, k, None, n) is None


@pytest.mark.parametrize("n,k", [(103, 576), (4099, 64), (40, 33), (1000, 2050)])
def test_amx_greedy_rows_find_the_argmax_of_logits_never_stored(n, k):
    """Greedy rows of a batch on AMX (packed_linear_argmax_only): each row's argmax is argmax_rows' on the
    packed product's logits (the first of equal maxima, NaN never winning, a row of NaNs 0, columns past
    n_valid left out), for any number of rows (5 to 1,030: both of the product's block orders, and the
    threads' column ranges merged), though the logits are never stored; without AMX it does not run."""
    torch.manual_seed(1)
    w = torch.randn(n, k).bfloat16()
    w[n // 3] = w[n - 2]  # equal rows: equal logits, wherever they are the largest the first wins
    bias = torch.randn(n).bfloat16()
    bias[n // 3] = bias[n - 2] = 100  # row 2's largest logit, at n // 3 and (equal) in the last tile
    bias[1] = float("nan")
    packed = cpu_kernels.pack_bf16_weight(w)
    if not cpu_kernels.amx_in_use():
        assert cpu_kernels.packed_linear_argmax_only(torch.randn(8, k).bfloat16(), packed, n, k, None, n) is None
        return
    for rows in (5, 17, 64, 1030):
        x = torch.randn(rows, k).bfloat16()
        x[2] = 0  # a row of equal logits (bias None): the first column
        for b in (bias, None):
            for n_valid in (n, n - 3, 1):
                found = cpu_kernels.packed_linear_argmax_only(x, packed, n, k, b, n_valid)
                logits = cpu_kernels.packed_linear(x, packed, n, k, b)
                assert found == cpu_kernels.argmax_rows(logits[:, :n_valid].contiguous()), (rows, n_valid)
                if n_valid == n:  # row 2 (x zero) has the bias for logits: its first largest, or column 0
                    assert found[2] == (n // 3 if b is bias else 0)
    nan_bias = torch.full((n,), float("nan")).bfloat16()
    assert cpu_kernels.packed_linear_argmax_only(torch.randn(6, k).bfloat16(), packed, n, k, nan_bias, n) == [0] * 6


def _hidden_rows(w: torch.Tensor) -> torch.Tensor:
    """70 fp32 hidden rows for a screen's test against the weight w [n, k] (w[n // 3] == w[n - 2]): outliers, a
    row of zeros (5), rows whose largest logit is at n // 3 and equally at n - 2 (6-11), logits close together
    (12-19), rows near random weight rows (20-29); the rest random."""
    n, k = w.shape
    x = torch.randn(70, k)
    x[:, :3] *= 30  # outliers, as hidden states have
    x[5] = 0
    x[6:12] = w[n // 3].float() * 3  # the largest at n // 3 and, equal, at n - 2
    x[12:20] *= 1e-3  # logits close together: many candidates
    x[20:30] = w[torch.randint(0, n, (10,))].float() * 2 + torch.randn(10, k) * 0.5
    return x


@pytest.mark.parametrize("n,k", [(103, 576), (4099, 64), (40, 33), (1000, 2050)])
def test_greedy_screen_finds_the_packed_products_argmax(isa, n, k):
    """Greedy rows under fp32 activations: the int8 screen's argmax is the first index of the largest of
    the packed fp32 kernel's logits over the first n_valid, for any number of rows: clear winners, exact
    ties (equal weight rows, the first wins), a row of zeros (all equal: 0), rows whose logits all lie
    within the screen's bound of each other (every tile a candidate), winners among rows the int8 copy
    cannot tell apart (with no bound, the largest int8 logit alone, some are lost), hidden states with
    outliers; a row that is not finite, logits that overflow, or a weight that is not finite leave it to
    the caller (None)."""
    torch.manual_seed(0)
    w = torch.randn(n, k).bfloat16()
    w[n // 3] = w[n - 2]
    x = _hidden_rows(w)
    # a run of rows that differ from one another by about half an int8 step in each element: their int8
    # logits rank them no better than chance, and the largest is theirs only within the bound
    near = min(32, n // 3)
    base = torch.randn(k)
    w[n - near:] = (base + torch.randn(near, k) * base.abs().max() / 254).bfloat16()
    x[30:50] = base * 4 + torch.randn(20, k) * 0.3
    packed = cpu_kernels.pack_bf16_weight(w)
    screen = cpu_kernels.greedy_screen(w)
    if isa == "generic":
        assert screen is None
        return
    full = cpu_kernels.packed_linear(x, packed, n, k, None)
    for n_valid in (n, n - 3, 1):
        want = cpu_kernels.argmax_rows(full[:, :n_valid].contiguous())
        for rows in (slice(0, 1), slice(5, 7), slice(2, 6), slice(6, 11), slice(10, 16), slice(12, 20),
                     slice(0, 13), slice(20, 30), slice(30, 50), slice(0, 64), slice(0, 70)):
            got = cpu_kernels.packed_linear_greedy(x[rows].contiguous(), packed, n, k, screen, n_valid)
            assert got == want[rows], (rows, n_valid)
    assert cpu_kernels.packed_linear_greedy(x[6:8].contiguous(), packed, n, k, screen, n) == [n // 3] * 2
    assert cpu_kernels.packed_linear_greedy(x[5:6].contiguous(), packed, n, k, screen, n) == [0]
    bad = x[:3].clone()
    bad[1, 2] = float("nan")
    assert cpu_kernels.packed_linear_greedy(bad, packed, n, k, screen, n) is None
    huge = x[6:8] * 1e37  # finite, but the winning logits overflow fp32
    assert not torch.isfinite(cpu_kernels.packed_linear(huge, packed, n, k, None)).all()
    assert cpu_kernels.packed_linear_greedy(huge, packed, n, k, screen, n) is None
    w[7, 1] = float("inf")
    assert cpu_kernels.greedy_screen(w) is None


@pytest.mark.parametrize("n,k", [(103, 576), (4099, 64), (40, 33), (1000, 2050)])
def test_amx_int8_screen_finds_the_argmax_of_bf16_logits(n, k):
    """Greedy bf16 rows through the LM head's int8 screen on the AMX tiles (packed_linear_screen): each row's
    argmax is argmax_rows' on the packed product's bf16 logits over the first n_valid, for any number of
    rows: clear winners, exact ties (equal weight rows: the first wins), a row of zeros (every logit 0:
    column 0), logits close together (many candidate tiles), winners among weight rows the int8 copy cannot
    tell apart, hidden states with outliers, and a later column whose exact logit is larger but rounds to
    the bf16 value of an earlier one (the earlier wins, as on the stored logits). A row that is not finite,
    or values that could overflow, leave it to the caller (None); without AMX-INT8 there is no screen."""
    torch.manual_seed(0)
    w = torch.randn(n, k).bfloat16()
    w[n // 3] = w[n - 2]
    near = min(32, n // 3)
    base = torch.randn(k)
    w[n - near:n - 2] = (base + torch.randn(near - 2, k) * base.abs().max() / 254).bfloat16()
    # column 1 and the last: the last's exact logit against row 60 is the larger, by less than bf16 can tell
    w[1] = (base * 2).bfloat16()
    w[n - 1] = w[1]
    w[n - 1, 0] = w[1, 0] + 0.25
    screen = cpu_kernels.greedy_screen_tiles(w)
    if not cpu_kernels.amx_int8_in_use():
        assert screen is None
        return
    packed = cpu_kernels.pack_bf16_weight(w)
    x = _hidden_rows(w)
    x[30:50] = base * 4 + torch.randn(20, k) * 0.3
    x[60] = base * 3
    x = x.bfloat16()
    for x0 in (1.0, 0.5, 0.25, 0.125, 0.0625):  # (one whose two exact logits fall in one bf16 rounding step)
        x[60, 0] = x0
        full = cpu_kernels.packed_linear(x, packed, n, k, None)
        exact = x[60].double() @ w[[1, n - 1]].double().T
        if exact[1] > exact[0] and full[60, 1] == full[60, n - 1] == full[60].max():
            break
    else:
        raise AssertionError("no row 60 with its two largest exact logits in one bf16 rounding step")
    for n_valid in (n, n - 3, 1):
        want = cpu_kernels.argmax_rows(full[:, :n_valid].contiguous())
        for rows in (slice(0, 1), slice(5, 7), slice(2, 6), slice(6, 11), slice(10, 16), slice(12, 20),
                     slice(0, 13), slice(20, 30), slice(30, 50), slice(60, 61), slice(0, 64), slice(0, 70)):
            got = cpu_kernels.packed_linear_screen(x[rows].contiguous(), packed, n, k, screen, n_valid)
            assert got == want[rows], (rows, n_valid)
    assert cpu_kernels.packed_linear_screen(x[60:61].contiguous(), packed, n, k, screen, n) == [1]
    assert cpu_kernels.packed_linear_screen(x[6:8].contiguous(), packed, n, k, screen, n) == [n // 3] * 2
    assert cpu_kernels.packed_linear_screen(x[5:6].contiguous(), packed, n, k, screen, n) == [0]
    bad = x[:3].clone()
    bad[1, 2] = float("inf")
    assert cpu_kernels.packed_linear_screen(bad, packed, n, k, screen, n) is None
    huge = (x[6:8].float() * 1e36).bfloat16()  # finite, but the logits and their bounds could overflow fp32
    assert cpu_kernels.packed_linear_screen(huge, packed, n, k, screen, n) is None
    w[7, 1] = float("inf")
    assert cpu_kernels.greedy_screen_tiles(w) is None


def test_amx_int8_screen_keeps_a_candidate_that_wins_only_once_rounded():
    """Where the screen's bounds are tight (weights exact in int8, a hidden state without outliers), a later
    column whose exact logit is larger, by more than both bounds, but rounds to the bf16 value of an earlier
    column's must leave the earlier one's tile a candidate: on the stored (rounded) logits the earlier wins."""
    gen = torch.Generator().manual_seed(3)
    n, k = 300, 576
    q = torch.randint(-100, 101, (n, k), generator=gen)
    q[:, 7] = 127  # every row's largest: the int8 scale is 1/128, and each weight exact in int8
    w = (q.double() / 128).bfloat16()
    w[n - 1] = w[1]
    w[n - 1, 0] += 4 / 128
    packed = cpu_kernels.pack_bf16_weight(w)
    screen = cpu_kernels.greedy_screen_tiles(w)
    if not cpu_kernels.amx_int8_in_use():
        assert screen is None
        return
    x = (w[1].double() * 3).bfloat16().unsqueeze(0)
    for x0 in (4.0, 3.0, 5.0, 6.0, 2.5):  # the two exact logits 0.08-0.19 apart, in one bf16 rounding step
        x[0, 0] = x0
        full = cpu_kernels.packed_linear(x, packed, n, k, None)
        exact = x[0].double() @ w[[1, n - 1]].double().T
        if exact[1] - exact[0] > 0.075 and full[0, 1] == full[0, n - 1] == full[0].max():
            break
    else:
        raise AssertionError("no x with its two largest exact logits in one bf16 rounding step")
    assert cpu_kernels.argmax_rows(full) == [1]
    assert cpu_kernels.packed_linear_screen(x, packed, n, k, screen, n) == [1]


@pytest.mark.parametrize("k", [576, 67])
def test_fp32_gemm_rows_do_not_depend_on_the_batch(isa, k):
    """Batch-invariant mode's fp32 product: close to torch's, and a row's bits the same alone (streamed
    weights), in a few rows or in a large call (weight blocks)."""
    torch.manual_seed(0)
    x = torch.randn(130, k)
    w = torch.randn(250, k)
    bias = torch.randn(250)
    full = cpu_kernels.linear_f32(x, w, bias)
    reference = torch.nn.functional.linear(x.double(), w.double(), bias.double()).float()
    torch.testing.assert_close(full, reference, atol=1e-4, rtol=1e-5)
    for rows in (slice(5, 6), slice(10, 13), slice(0, 8), slice(20, 36), slice(0, 129)):
        assert torch.equal(cpu_kernels.linear_f32(x[rows], w, bias), full[rows]), rows


@pytest.mark.parametrize("dtype", DTYPES)
def test_silu_and_mul_matches_torch(isa, dtype):
    torch.manual_seed(0)
    x = (torch.randn(37, 2 * 1000) * 4).to(dtype)  # d not a multiple of 16: the scalar tail runs too
    x[0, :8] = torch.tensor([0.0, -0.0, 90.0, -90.0, 1e-3, -1e-3, 20.0, -20.0])
    native = cpu_kernels.silu_and_mul(x)
    if isa == "generic":
        assert native is None  # torch's ops are as fast as scalar code
        return
    reference = torch.nn.functional.silu(x[:, :1000]) * x[:, 1000:]
    if dtype == torch.bfloat16:
        # exp differs from torch's by an ulp or two in fp32: at most one bf16 rounding step apart
        torch.testing.assert_close(native.float(), reference.float(), atol=1e-6, rtol=2 ** -8)
        assert (native == reference).float().mean() > 0.99
    else:
        torch.testing.assert_close(native, reference, atol=1e-6, rtol=1e-5)


@pytest.mark.parametrize("bs,d", [(1, 64), (3, 64), (3, 31), (8, 64), (32, 64)])
@pytest.mark.parametrize("q_dtype", [torch.bfloat16, torch.float32])
def test_bf16_cache_pairs_at_any_block_size_and_head_dim(isa, bs, d, q_dtype):
    """A bf16 cache pairs V's tokens only where block_size is even and K's dims only where head_dim is
    even: the kernels read every mix of paired and plain blocks as the torch path does."""
    torch.manual_seed(bs * 100 + d)
    nb, hk, hq = 160, 2, 6
    kv = torch.zeros(kv_cache_shape(nb, bs, hk, d), dtype=torch.bfloat16)
    k_cache, v_cache = split_kv_cache(kv)
    assert (k_cache.dim() == 5) == (d % 2 == 0) and (v_cache.dim() == 5) == (bs % 2 == 0)
    lens = torch.tensor([5, 37, 50])
    per = -(-50 // bs)
    tables = torch.randperm(nb)[:3 * per].view(3, per)
    for r in range(3):
        t = torch.arange(int(lens[r]))
        slots = tables[r, t // bs] * bs + t % bs
        assert cpu_kernels.write_kv(torch.randn(len(t), hk, d).bfloat16(), torch.randn(len(t), hk, d).bfloat16(),
                                    k_cache, v_cache, slots)
    q = torch.randn(3, hq, d).to(q_dtype)
    out = cpu_kernels.paged_attention_decode(q, k_cache, v_cache, tables, lens, d ** -0.5)
    ref = decode_attention(q.float(), k_cache, v_cache, tables, lens, 50, d ** -0.5)
    torch.testing.assert_close(out.float(), ref, atol=2e-2 if q_dtype == torch.bfloat16 else 1e-5, rtol=0)


def test_a_bf16_cache_not_in_its_paired_views_is_left_to_torch():
    """The kernels read a bf16 cache's K and V in pairs: 4-D views of one (built by hand, not by
    split_kv_cache) would be misread, so the native calls decline them and the torch path runs."""
    nb, hk, bs, d = 4, 1, 16, 64
    kv = torch.zeros(kv_cache_shape(nb, bs, hk, d), dtype=torch.bfloat16)
    k_cache, v_cache = split_kv_cache(kv)
    assert k_cache.dim() == 5 and v_cache.dim() == 5
    plain_k, plain_v = kv[0].view(nb, hk, d, bs), kv[1]
    k = v = torch.randn(1, hk, d).bfloat16()
    slots = torch.tensor([3])
    assert not cpu_kernels.write_kv(k, v, plain_k, plain_v, slots)
    assert cpu_kernels.write_kv(k, v, k_cache, v_cache, slots)
    q, tables, lens = torch.randn(1, 3, d).bfloat16(), torch.tensor([[0]]), torch.tensor([4])
    assert cpu_kernels.paged_attention_decode(q, plain_k, plain_v, tables, lens, 0.125) is None
    assert cpu_kernels.paged_attention_decode(q, k_cache, v_cache, tables, lens, 0.125) is not None


@pytest.mark.parametrize("q_dtype", [torch.bfloat16, torch.float32])
def test_garbage_past_a_length_never_reaches_the_output(isa, q_dtype):
    """A bf16 cache keeps V's tokens in pairs: a sequence of odd length ends on a pair whose partner slot may
    hold anything (an earlier request's rows, NaN, inf), as may the rest of its last block. None of it may
    reach the output: NaN everywhere past the lengths gives the same bits as zeros there."""
    torch.manual_seed(0)
    nb, hk, hq, bs, d = 12, 1, 3, 16, 64
    kv = torch.zeros(kv_cache_shape(nb, bs, hk, d), dtype=torch.bfloat16)
    k_cache, v_cache = split_kv_cache(kv)
    tables = torch.randperm(nb).view(3, 4)  # no block shared
    lens = torch.tensor([17, 33, 5])
    for r in range(3):
        slots = tables[r, torch.arange(int(lens[r])) // bs] * bs + torch.arange(int(lens[r])) % bs
        write_slots(k_cache, v_cache, torch.randn(len(slots), hk, d), torch.randn(len(slots), hk, d), slots, 1.0, 1.0)
    q = torch.randn(3, hq, d).to(q_dtype)
    chunk_lens = torch.arange(7, 18)  # a prompt chunk's 11 tokens over table 0 (length 17)
    chunk_q = torch.randn(11, hq, d).to(q_dtype)
    chunk_index = torch.zeros(11, dtype=torch.long)

    def attend():
        return (cpu_kernels.paged_attention_decode(q, k_cache, v_cache, tables, lens, d ** -0.5, None),
                cpu_kernels.paged_attention_decode(chunk_q, k_cache, v_cache, tables, chunk_lens, d ** -0.5,
                                                   chunk_index))

    clean = attend()
    for r in range(3):  # NaN in every slot of the request's blocks past its length
        rest = torch.arange(int(lens[r]), 4 * bs)
        slots = tables[r, rest // bs] * bs + rest % bs
        nan = torch.full((len(slots), hk, d), float("nan"))
        write_slots(k_cache, v_cache, nan, nan, slots, 1.0, 1.0)
    for want, got in zip(clean, attend()):
        assert torch.isfinite(want).all()
        assert torch.equal(got, want)


def test_fp32_queries_over_a_bf16_cache(isa):
    """Activations in fp32 with a bf16 KV cache: rows are rounded as they are written and widened
    as they are read."""
    torch.manual_seed(0)
    nb, hk, hq, bs, d = 30, 3, 9, 16, 64
    kv = torch.zeros(kv_cache_shape(nb, bs, hk, d), dtype=torch.bfloat16)
    k_cache, v_cache = split_kv_cache(kv)
    k, v = torch.randn(40, hk, d), torch.randn(40, hk, d)
    slots = torch.randperm(nb * bs)[:40]
    assert cpu_kernels.write_kv(k, v, k_cache, v_cache, slots)
    assert torch.equal(read_blocks(k_cache, slots // bs, torch.bfloat16, 1.0)[torch.arange(40), :, :, slots % bs],
                       k.bfloat16())
    assert torch.equal(read_blocks(v_cache, slots // bs, torch.bfloat16, 1.0)[torch.arange(40), :, slots % bs],
                       v.bfloat16())
    kv.normal_()
    tables = torch.randperm(nb)[:30].view(3, 10)
    seq_lens = torch.tensor([5, 160, 77])
    q = torch.randn(3, hq, d)
    native = cpu_kernels.paged_attention_decode(q, k_cache, v_cache, tables, seq_lens, d ** -0.5)
    assert native.dtype == torch.float32
    reference = decode_attention(q, k_cache.float(), v_cache.float(), tables, seq_lens, 160, d ** -0.5)
    torch.testing.assert_close(native, reference, atol=1e-5, rtol=1e-5)


def _attended_together_and_alone(q, k_cache, v_cache, tables, lens, index):
    """The queries attended in one call, after checking that each one's output is bitwise what it is
    when that query is attended alone."""
    scale = q.shape[-1] ** -0.5
    batched = cpu_kernels.paged_attention_decode(q, k_cache, v_cache, tables, lens, scale, index)
    for i in range(len(index)):
        alone = cpu_kernels.paged_attention_decode(q[i:i + 1], k_cache, v_cache, tables, lens[i:i + 1], scale,
                                                   index[i:i + 1])
        assert torch.equal(alone, batched[i:i + 1]), i
    return batched


@pytest.mark.parametrize("dtype,cache_dtype", [(torch.float32, torch.float32), (torch.bfloat16, torch.bfloat16),
                                               (torch.float32, torch.bfloat16)])
def test_prompt_chunk_tokens_attended_in_tiles_equal_each_token_alone(dtype, cache_dtype):
    """The tokens of a prompt chunk (same table, lengths growing by one) are attended in tiles that
    share each K/V read; every token's output is bitwise what it is when attended alone."""
    torch.manual_seed(0)
    nb, hk, hq, bs, d = 40, 3, 9, 16, 64
    kv = torch.randn(kv_cache_shape(nb, bs, hk, d)).to(cache_dtype)
    k_cache, v_cache = split_kv_cache(kv)
    tables = torch.randperm(nb)[:30].view(3, 10)
    # a decode, a chunk of 11 tokens (two full tiles and a partial one), a chunk of 2, another decode
    index = torch.tensor([0] + [1] * 11 + [2] * 2 + [0])
    lens = torch.tensor([70] + list(range(90, 101)) + [16, 17] + [33])
    q = torch.randn(len(index), hq, d).to(dtype)
    batched = _attended_together_and_alone(q, k_cache, v_cache, tables, lens, index)
    reference = decode_attention(q.float(), k_cache.float(), v_cache.float(), tables[index], lens, 100, d ** -0.5)
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(batched.float(), reference, atol=tol, rtol=tol)


@pytest.mark.parametrize("hq,hk,d,bs", [(9, 3, 64, 16), (8, 2, 32, 16), (4, 4, 128, 32), (12, 2, 96, 16)])
@pytest.mark.parametrize("n,first", [(20, 40), (33, 1), (2, 48)])
def test_long_prompt_chunks_equal_each_token_alone(hq, hk, d, bs, n, first):
    """A bf16 prompt chunk of up to 33 tokens (tiles of 16 tokens over every query head where the CPU has AMX),
    starting anywhere in a block and ending anywhere in a group of 16: every token's output is bitwise what it
    is alone, and close to the fp32 reference. (At (8, 2, 32, 16) and (20, 40) one value of the chunk's 5,120
    changed by an ulp when the tiles' softmax fused its scaling into the subtraction of the maximum.)"""
    torch.manual_seed(0)
    nb = 60
    kv = torch.randn(kv_cache_shape(nb, bs, hk, d)).bfloat16()
    k_cache, v_cache = split_kv_cache(kv)
    tables = torch.randperm(nb)[:40].view(2, 20)
    index = torch.zeros(n, dtype=torch.int64)
    lens = torch.arange(first, first + n)
    q = torch.randn(n, hq, d).bfloat16()
    batched = _attended_together_and_alone(q, k_cache, v_cache, tables, lens, index)
    reference = decode_attention(q.float(), k_cache.float(), v_cache.float(), tables[index], lens, int(lens.max()),
                                 d ** -0.5)
    torch.testing.assert_close(batched.float(), reference, atol=3e-2, rtol=3e-2)


@pytest.mark.parametrize("dtype,cache_dtype", [(torch.float32, torch.float32), (torch.bfloat16, torch.bfloat16),
                                               (torch.float32, torch.bfloat16), (torch.bfloat16, torch.float8_e4m3fn)])
@pytest.mark.parametrize("hq,hk,d,bs", [(9, 3, 64, 16), (8, 2, 32, 16), (4, 4, 64, 32), (12, 2, 64, 16)])
def test_decodes_sharing_prefix_blocks_equal_each_alone(dtype, cache_dtype, hq, hk, d, bs):
    """Decodes of different requests whose block tables start with the same blocks (a prompt prefix in
    the prefix cache) are attended as one tile over those blocks, each continuing alone over its own;
    every output is bitwise what it is when the decode is attended alone, whatever its batch."""
    torch.manual_seed(0)
    nb = 120
    kv = torch.randn(kv_cache_shape(nb, bs, hk, d)).to(cache_dtype)
    k_cache, v_cache = split_kv_cache(kv)
    perm = torch.randperm(nb).tolist()
    prefix_a, prefix_b, rest = perm[:7], perm[7:12], iter(perm[12:])

    def table(prefix, own):
        return prefix + [next(rest) for _ in range(own)] + [0] * (12 - len(prefix) - own)

    rows = [  # (table, length)
        (table(prefix_a, 3), 7 * bs + 2 * bs + 5),   # shares 7 blocks with the next three
        (table(prefix_a, 1), 7 * bs + 1),
        (table(prefix_a, 0), 7 * bs),                 # ends where the shared blocks end
        (table(prefix_a, 4), 7 * bs + 3 * bs + 2),
        (table(prefix_a[:5], 5), 9 * bs + 7),         # shares 5 of them
        (table(prefix_a[:2], 6), 6 * bs + 3),         # shares only 2: attended alone
        (table(prefix_b, 2), 5 * bs + 2 * bs - 1),    # another prefix
        (table(prefix_b, 1), 5 * bs + 9),
        (table(prefix_a[:6], 0), 5 * bs + 11),        # inside the shared blocks' span, 5 complete blocks
    ]
    tables = torch.tensor([t for t, _ in rows])
    lens = torch.tensor([n for _, n in rows])
    # a prompt chunk of 3 tokens over the first table sits among the decodes
    index = torch.tensor([0, 1, 2, 3, 0, 0, 0, 4, 5, 6, 7, 8])
    lens = torch.cat([lens[:4], torch.tensor([7 * bs + 2, 7 * bs + 3, 7 * bs + 4]), lens[4:]])
    q = torch.randn(len(index), hq, d).to(dtype)
    batched = _attended_together_and_alone(q, k_cache, v_cache, tables, lens, index)
    # and in another order (other groups form)
    flip = torch.arange(len(index) - 1, -1, -1)
    flipped = cpu_kernels.paged_attention_decode(q[flip], k_cache, v_cache, tables, lens[flip], d ** -0.5, index[flip])
    assert torch.equal(flipped, batched[flip])
    reference = decode_attention(q.float(), k_cache.float(), v_cache.float(), tables[index], lens, int(lens.max()),
                                 d ** -0.5)
    tol = 1e-5 if dtype == torch.float32 and cache_dtype == torch.float32 else 3e-2
    torch.testing.assert_close(batched.float(), reference, atol=tol, rtol=tol)


@pytest.mark.parametrize("cache_dtype", [torch.float32, torch.bfloat16, torch.float8_e4m3fn])
@pytest.mark.parametrize("hq,hk,d,bs", [(9, 3, 64, 16), (32, 8, 128, 16), (8, 2, 32, 32), (4, 4, 64, 16),
                                        (10, 2, 64, 16)])
def test_decode_only_batches_equal_decodes_beside_a_prompt_chunk(cache_dtype, hq, hk, d, bs):
    """A batch of decodes alone is attended a request at a time over all its KV heads, block by block (on
    AVX2 builds; one (request, head) at a time where the batch holds a prompt chunk's tiles): every decode's
    output is bitwise the same either way, at lengths ending anywhere in a block."""
    torch.manual_seed(1)
    nb = 200
    kv = (torch.randn(kv_cache_shape(nb, bs, hk, d)) * 0.7).to(cache_dtype)
    k_cache, v_cache = split_kv_cache(kv)
    lens = torch.tensor([1, 7, bs, bs + 1, 3 * bs - 1, 100, 161])
    per = -(-161 // bs)
    tables = torch.stack([torch.randperm(nb)[:per] for _ in range(len(lens) + 1)])
    q = torch.randn(len(lens) + 3, hq, d)
    scale = d ** -0.5
    decodes = torch.arange(len(lens))
    alone = cpu_kernels.paged_attention_decode(q[:len(lens)], k_cache, v_cache, tables, lens, scale, decodes)
    # the same decodes after a 3-token prompt chunk over the last table
    index = torch.cat([torch.full((3,), len(lens)), decodes])
    mixed_lens = torch.cat([torch.tensor([40, 41, 42]), lens])
    mixed_q = torch.cat([q[len(lens):], q[:len(lens)]])
    mixed = cpu_kernels.paged_attention_decode(mixed_q, k_cache, v_cache, tables, mixed_lens, scale, index)
    assert torch.equal(mixed[3:], alone)
    reference = decode_attention(q[:len(lens)], k_cache.float(), v_cache.float(), tables[:len(lens)], lens, 161,
                                 scale)
    tol = 1e-5 if cache_dtype == torch.float32 else 3e-2
    torch.testing.assert_close(alone, reference, atol=tol, rtol=tol)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("h", [576, 100, 7])  # whole vectors; vectors and a tail; a tail only
def test_rms_norm_is_the_reference_computation(isa, dtype, h):
    """Residual add + RMSNorm, in vector rows where the build has them: the new residual is round(x + r)
    exactly, the output round(w * round(s * rsqrt(mean(s^2) + eps))) up to the order of the sum of squares,
    a NaN confined to its row; without a residual the same output from x."""
    torch.manual_seed(0)
    x, res = (torch.randn(33, h) * 3).to(dtype), torch.randn(33, h).to(dtype)
    w = (torch.rand(h) + 0.5).to(dtype)
    x[4, h // 2] = float("nan")
    out, new_res = cpu_kernels.rms_norm(x, w, 1e-6, res)
    summed = x + res
    torch.testing.assert_close(new_res, summed, atol=0, rtol=0, equal_nan=True)
    s = summed.float()
    y = (s * torch.rsqrt(s.pow(2).mean(-1, keepdim=True) + 1e-6)).to(dtype).float()
    tol = 2 ** -7 if dtype == torch.bfloat16 else 1e-6
    torch.testing.assert_close(out, (w.float() * y).to(dtype), atol=tol, rtol=tol, equal_nan=True)
    assert out[4].isnan().all() and not out[torch.arange(33) != 4].isnan().any()
    alone = cpu_kernels.rms_norm(summed, w, 1e-6)
    torch.testing.assert_close(alone, out, atol=0, rtol=0, equal_nan=True)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("vocab", [49152, 1000, 7])  # lane multiples and ragged tails
def test_argmax_rows_matches_torch_and_takes_the_first_maximum(dtype, vocab):
    torch.manual_seed(0)
    x = torch.randn(37, vocab).to(dtype)
    x[3, :] = 1.0                          # a row of ties: the first index
    x[5, vocab // 2] = x[5].max() + 1      # a maximum in the middle
    x[6, -1] = x[6].max() + 1              # ... and in the tail
    x[7, 0] = float("nan")                 # a NaN never wins
    x[8, :] = float("nan")                 # a row of NaNs: 0, as torch gives with NaNs as -inf
    x[9, :vocab // 2 + 1] = float("nan")   # NaNs, then -inf (the first number) past the middle
    x[9, vocab // 2 + 1:] = -float("inf")
    want = x.float().nan_to_num(nan=-float("inf")).argmax(-1)
    want[9] = vocab // 2 + 1
    got = cpu_kernels.argmax_rows(x)
    assert got == want.tolist()
    assert got[3] == 0
    for r in (3, 5, 6, 7, 8, 9):  # one row alone: on one thread, or split between threads when it is long
        assert cpu_kernels.argmax_rows(x[r:r + 1].contiguous()) == [want[r].item()]


def test_argmax_rows_from_several_threads_each_get_their_own_rows():
    """The result buffer is reused per row count within a thread: threads calling at once never see each
    other's results."""
    from concurrent.futures import ThreadPoolExecutor
    torch.manual_seed(1)
    inputs = [torch.randn(rows, 4096).bfloat16() for rows in (1, 1, 2, 2, 3, 1, 2, 3)]
    wants = [x.float().argmax(-1).tolist() for x in inputs]

    def check(i: int) -> bool:
        return all(cpu_kernels.argmax_rows(inputs[i]) == wants[i] for _ in range(200))

    with ThreadPoolExecutor(4) as pool:
        assert all(pool.map(check, range(len(inputs))))


def _cpu_flags() -> set[str]:
    with open("/proc/cpuinfo") as f:
        return next((set(line.split(":", 1)[1].split()) for line in f if line.startswith("flags")), set())


def test_amx_runs_the_bf16_products_exactly_where_the_cpu_has_it(isa):
    """AMX tiles take the bf16 products on an AVX-512 BF16 build whose CPU has AMX-BF16 (the kernel grants
    the tile state wherever /proc/cpuinfo lists it), and nowhere else; TIDAL_AMX=0 turns them off."""
    import subprocess
    import sys
    flags = _cpu_flags()
    want = isa == "avx512_bf16" and {"amx_bf16", "amx_tile"} <= flags
    assert cpu_kernels.amx_in_use() == want
    off = subprocess.run([sys.executable, "-c", "from tidal.layers import cpu_kernels; "
                          "print(int(cpu_kernels.amx_in_use()))"], env={**__import__("os").environ, "TIDAL_AMX": "0"},
                         capture_output=True, text=True, check=True)
    assert off.stdout.strip() == "0"


@pytest.mark.parametrize("m,n,k", [(1, 49, 577), (4, 103, 64), (5, 17, 33), (33, 960, 576), (70, 40, 2050)])
def test_bf16_products_are_the_exact_product_rounded_once_within_fp32_accumulation(isa, m, n, k):
    """Whichever unit computes them (VDPBF16PS or AMX tiles: each sums its k in its own fp32 order), every
    bf16 product is the exact one up to fp32 accumulation error and one bf16 rounding, on ragged shapes
    (odd K, K not a multiple of 32, N not a multiple of 16, a last group of fewer than 16 rows)."""
    if isa != "avx512_bf16":
        assert cpu_kernels.bf16_linear(torch.zeros(1, 8).bfloat16(), torch.zeros(8, 8).bfloat16(), None) is None
        return
    torch.manual_seed(1)
    x, w, bias = torch.randn(m, k).bfloat16(), torch.randn(n, k).bfloat16(), torch.randn(n).bfloat16()
    exact = x.double() @ w.double().T + bias.double()
    bound = (x.double().abs() @ w.double().abs().T) * k * 2.0 ** -24 + exact.abs() * 2.0 ** -8 + 1e-30
    packed = cpu_kernels.pack_bf16_weight(w)
    for got in (cpu_kernels.bf16_linear(x, w, bias), cpu_kernels.packed_linear(x, packed, n, k, bias)):
        assert ((got.double() - exact).abs() <= bound).all()
