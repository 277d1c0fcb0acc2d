"""The format reference on its own: exact round trips, error bounds, SQNR, and input errors."""

from __future__ import annotations

import pytest
import torch

from kbit_linear import format as fmt

BITS = fmt.SUPPORTED_BITS


def _sqnr_db(x: torch.Tensor, x_hat: torch.Tensor) -> float:
    return float(10 * torch.log10(x.pow(2).sum() / (x - x_hat).pow(2).sum()))


# ---------------------------------------------------------------------------------------
# codebooks
# ---------------------------------------------------------------------------------------


@pytest.mark.parametrize("bits", BITS)
def test_normal_float_codebook_properties(bits):
    cb = fmt.create_normal_float_codebook(bits)
    assert cb.dtype == torch.float32 and cb.shape == (1 << bits,)
    assert bool((cb[1:] > cb[:-1]).all())
    assert cb[0].item() == -1.0 and cb[-1].item() == 1.0
    assert torch.allclose(cb, -cb.flip(0), atol=1e-7)
    assert not bool((cb == 0).any())
    fmt.validate_codebook(cb, bits)


def test_normal_float_codebook_is_cached_but_returned_as_copy():
    a = fmt.create_normal_float_codebook(4)
    a.zero_()
    b = fmt.create_normal_float_codebook(4)
    assert b.abs().max().item() == 1.0


def test_normal_float_codebook_matches_gaussian_quantiles():
    # K=2: quantiles at 1/8, 3/8, 5/8, 7/8 of N(0,1), normalized by the outer one.
    q = torch.distributions.Normal(0.0, 1.0).icdf(torch.tensor([0.125, 0.375, 0.625, 0.875], dtype=torch.float64))
    expected = (q / q.abs().max()).float()
    assert torch.allclose(fmt.create_normal_float_codebook(2), expected, atol=1e-6)


@pytest.mark.parametrize(
    "bad, bits, err, match",
    [
        (torch.linspace(-1, 1, 8), 4, ValueError, r"shape \[16\]"),
        (torch.linspace(-1, 1, 16).flip(0), 4, ValueError, "increasing"),
        (torch.tensor([-1.0, 0.0, 0.0, 1.0]), 2, ValueError, "increasing"),
        (torch.tensor([-2.0, -0.5, 0.5, 1.0]), 2, ValueError, r"\[-1, 1\]"),
        (torch.tensor([-1.0, float("nan"), 0.5, 1.0]), 2, ValueError, "NaN"),
        (torch.arange(4), 2, TypeError, "floating-point"),
        ([-1.0, 0.0, 0.5, 1.0], 2, TypeError, "torch.Tensor"),
        (torch.linspace(-1, 1, 4).reshape(2, 2), 2, ValueError, "shape"),
    ],
    ids=["wrong-size", "descending", "duplicate", "out-of-range", "nan", "int-dtype", "list", "2-d"],
)
def test_bad_codebook_raises(bad, bits, err, match):
    with pytest.raises(err, match=match):
        fmt.validate_codebook(bad, bits)


# ---------------------------------------------------------------------------------------
# E4M4
# ---------------------------------------------------------------------------------------


def test_e4m4_decode_all_codes():
    codes = torch.arange(256, dtype=torch.int64).to(torch.uint8)
    values = fmt.decode_e4m4(codes)
    assert values[0].item() == 0.0
    assert bool((values[1:] > values[:-1]).all()), "decode must be strictly increasing in the code"
    assert values[255].item() == fmt.E4M4_MAX == 31.0
    assert values[1].item() == 2.0**-14  # smallest subnormal
    assert values[16].item() == 2.0**-10  # smallest normal
    # subnormals are evenly spaced and continue into the normals
    assert torch.allclose(values[1:16], torch.arange(1, 16, dtype=torch.float32) * 2.0**-14)
    for e in range(1, 16):
        for m in range(16):
            assert values[(e << 4) | m].item() == 2.0 ** (e - fmt.E4M4_BIAS) * (1 + m / 16)


def test_e4m4_encode_decode_roundtrip_every_code():
    codes = torch.arange(256, dtype=torch.int64).to(torch.uint8)
    assert torch.equal(fmt.encode_e4m4(fmt.decode_e4m4(codes)), codes)


def test_e4m4_encode_rounds_up():
    g = torch.Generator().manual_seed(0)
    v = torch.rand(100_000, generator=g) * 31
    v = torch.cat([v, torch.rand(1000, generator=g) * 2.0**-10, torch.tensor([0.0, 31.0, 2.0**-14, 1e-30])])
    codes = fmt.encode_e4m4(v)
    dec = fmt.decode_e4m4(codes)
    assert bool((dec >= v).all()), "the stored scale must never be below the block absmax"
    # ...and it is the smallest such code
    below = fmt.decode_e4m4((codes.long() - 1).clamp(min=0).to(torch.uint8))
    assert bool(((below < v) | (codes == 0)).all())
    normal = v >= 2.0**-10
    assert bool((dec[normal] <= v[normal] * (1 + 1 / 16)).all())
    assert bool((dec[~normal] <= v[~normal] + 2.0**-14).all())
    assert fmt.encode_e4m4(torch.tensor([0.0])).item() == 0


@pytest.mark.parametrize(
    "bad, err, match",
    [
        (torch.tensor([32.0]), ValueError, "maximum"),
        (torch.tensor([-1.0]), ValueError, "non-negative"),
        (torch.tensor([float("inf")]), ValueError, "NaN or Inf"),
        (torch.tensor([1], dtype=torch.int32), TypeError, "floating-point"),
    ],
    ids=["above-max", "negative", "inf", "int"],
)
def test_e4m4_encode_bad_input(bad, err, match):
    with pytest.raises(err, match=match):
        fmt.encode_e4m4(bad)


def test_decode_e4m4_requires_uint8():
    with pytest.raises(TypeError, match="uint8"):
        fmt.decode_e4m4(torch.tensor([1, 2], dtype=torch.int32))


@pytest.mark.parametrize("amax", [1e-12, 1e-6, 0.02, 1.0, 30.9, 31.0, 31.5, 64.0, 1e5])
def test_tensor_scale_is_minimal_power_of_two(amax):
    w = torch.tensor([[amax, -amax / 3]])
    ts = fmt.compute_tensor_scale(w)
    assert ts.dtype == torch.float32 and ts.shape == (1,)
    s = ts.item()
    mant, _ = torch.frexp(ts)
    assert mant.item() == 0.5, "tensor scale must be a power of two"
    assert torch.tensor(amax, dtype=torch.float32).item() / s <= fmt.E4M4_MAX
    assert torch.tensor(amax, dtype=torch.float32).item() / (s / 2) > fmt.E4M4_MAX


def test_tensor_scale_of_zero_tensor_is_one():
    assert fmt.compute_tensor_scale(torch.zeros(3, 40)).item() == 1.0


# ---------------------------------------------------------------------------------------
# bit-planes
# ---------------------------------------------------------------------------------------


@pytest.mark.parametrize("bits", BITS)
@pytest.mark.parametrize("lead", [(1,), (7,), (3, 5), (576, 6)], ids=str)
def test_pack_unpack_roundtrip(bits, lead):
    g = torch.Generator().manual_seed(bits * 100 + sum(lead))
    idx = torch.randint(0, 1 << bits, (*lead, 32), generator=g)
    packed = fmt.pack_bitplanes(idx, bits)
    assert packed.dtype == torch.int32 and packed.shape == (*lead, bits)
    assert torch.equal(fmt.unpack_bitplanes(packed, bits).long(), idx)


def test_pack_bit_layout_is_documented_one():
    # element i carries index i % 4 (bits=2): plane 0 has bit i set where i % 2 == 1,
    # plane 1 where i % 4 >= 2.
    idx = (torch.arange(32) % 4).reshape(1, 32)
    planes = fmt.pack_bitplanes(idx, 2)[0].tolist()
    to_u32 = [p & 0xFFFFFFFF for p in planes]
    assert to_u32[0] == sum(1 << i for i in range(32) if i % 2 == 1) == 0xAAAAAAAA
    assert to_u32[1] == sum(1 << i for i in range(32) if i % 4 >= 2) == 0xCCCCCCCC
    # a single index in element 31 sets the top bit (sign bit of the int32 storage)
    idx = torch.zeros(1, 32, dtype=torch.long)
    idx[0, 31] = 1
    assert fmt.pack_bitplanes(idx, 2)[0, 0].item() == -(2**31)


def test_pack_bad_input():
    with pytest.raises(ValueError, match="last dimension"):
        fmt.pack_bitplanes(torch.zeros(4, 31, dtype=torch.long), 2)
    with pytest.raises(ValueError, match=r"\[0, 4\)"):
        fmt.pack_bitplanes(torch.full((1, 32), 4), 2)
    with pytest.raises(TypeError, match="integer"):
        fmt.pack_bitplanes(torch.zeros(1, 32), 2)
    with pytest.raises(ValueError, match="bits=3"):
        fmt.unpack_bitplanes(torch.zeros(1, 2, dtype=torch.int32), 3)
    with pytest.raises(TypeError, match="int32"):
        fmt.unpack_bitplanes(torch.zeros(1, 3, dtype=torch.int64), 3)


# ---------------------------------------------------------------------------------------
# tiling
# ---------------------------------------------------------------------------------------


@pytest.mark.parametrize("bits", BITS)
@pytest.mark.parametrize("n, k", [(576, 192), (1536, 576), (33, 100), (192, 576), (128, 64), (1, 1), (300, 2000)], ids=str)
def test_tile_untile_roundtrip(bits, n, k):
    g = torch.Generator().manual_seed(n * 7 + k + bits)
    nblk = -(-k // 32)
    packed = torch.randint(-(2**31), 2**31 - 1, (n, nblk, bits), generator=g, dtype=torch.int64).to(torch.int32)
    absmax = torch.randint(0, 256, (n, nblk), generator=g, dtype=torch.int64).to(torch.uint8)
    tp, ta = fmt.tile_blocks(packed, absmax, bits)
    n_pad, k_pad = fmt.padded_shape(n, k)
    assert tp.shape == (k_pad // 64, n_pad // 128, 128, 2, bits) and tp.is_contiguous()
    assert ta.shape == (k_pad // 64, n_pad // 128, 128, 2)
    p2, a2 = fmt.untile_blocks(tp, ta, bits, n, k)
    assert torch.equal(p2, packed) and torch.equal(a2, absmax)
    # element-wise placement as documented: packed[kt, nt, c, kb, b] = plane b of block (128nt+c, 2kt+kb)
    for row, blk in [(0, 0), (n - 1, nblk - 1), (n // 2, nblk // 2)]:
        assert torch.equal(tp[blk // 2, row // 128, row % 128, blk % 2], packed[row, blk])
        assert ta[blk // 2, row // 128, row % 128, blk % 2] == absmax[row, blk]
    # padding is zero blocks
    flat_p = tp.permute(1, 2, 0, 3, 4).reshape(n_pad, k_pad // 32, bits)
    flat_a = ta.permute(1, 2, 0, 3).reshape(n_pad, k_pad // 32)
    assert not bool(flat_p[n:].any()) and not bool(flat_p[:, nblk:].any())
    assert not bool(flat_a[n:].any()) and not bool(flat_a[:, nblk:].any())


@pytest.mark.parametrize("bits", BITS)
@pytest.mark.parametrize("n, k", [(1, 1), (128, 64), (129, 65), (192, 576), (33, 100)], ids=str)
def test_tiled_shapes_are_the_shapes_the_tiler_makes(bits, n, k):
    qw = fmt.quantize(torch.randn(n, k), bits)
    packed_shape, absmax_shape = fmt.tiled_shapes(n, k, bits)
    assert (qw.packed.shape, qw.absmax.shape) == (packed_shape, absmax_shape)
    n_pad, k_pad = fmt.padded_shape(n, k)
    assert packed_shape == (k_pad // fmt.TILE_K, n_pad // fmt.TILE_N, fmt.TILE_N, fmt.TILE_K // fmt.BLOCK_SIZE, bits)
    assert fmt.check_tiled(qw.packed, qw.absmax, bits, n, k) == (n_pad, k_pad)


@pytest.mark.parametrize(
    "args, err, match",
    [
        ((0, 64, 4), ValueError, "out_features must be a positive int"),
        ((64, 6.5, 4), ValueError, "in_features must be a positive int"),
        ((64, 64, 6), ValueError, "bits must be one of"),
        ((64, 64, "4"), TypeError, "bits must be an int"),
    ],
)
def test_tiled_shapes_bad_arguments(args, err, match):
    with pytest.raises(err, match=match):
        fmt.tiled_shapes(*args)


def test_check_tiled_against_a_layer_shape():
    qw = fmt.quantize(torch.randn(130, 70), 3)
    assert fmt.check_tiled(qw.packed, qw.absmax, 3) == (256, 128)
    assert fmt.check_tiled(qw.packed, qw.absmax, 3, 256, 65) == (256, 128)  # same tiles
    with pytest.raises(ValueError, match="out_features=257 does not match packed tiles padded to 256"):
        fmt.check_tiled(qw.packed, qw.absmax, 3, out_features=257)
    with pytest.raises(ValueError, match="in_features=64 does not match tiles padded to 128"):
        fmt.check_tiled(qw.packed, qw.absmax, 3, in_features=64)
    with pytest.raises(ValueError, match="out_features must be a positive int"):
        fmt.check_tiled(qw.packed, qw.absmax, 3, out_features=0)


def test_untile_shape_mismatch():
    tp, ta = fmt.tile_blocks(torch.zeros(10, 2, 3, dtype=torch.int32), torch.zeros(10, 2, dtype=torch.uint8), 3)
    with pytest.raises(ValueError, match="does not match"):
        fmt.untile_blocks(tp, ta, 3, 10, 200)
    with pytest.raises(ValueError, match="does not match"):
        fmt.untile_blocks(tp, ta[:, :, :64], 3, 10, 50)
    with pytest.raises(ValueError, match="bits=4"):
        fmt.untile_blocks(tp, ta, 4, 10, 50)


def test_mismatched_flat_shapes_raise():
    with pytest.raises(ValueError, match="does not match"):
        fmt.tile_blocks(torch.zeros(10, 2, 3, dtype=torch.int32), torch.zeros(10, 3, dtype=torch.uint8), 3)
    with pytest.raises(TypeError, match="uint8"):
        fmt.tile_blocks(torch.zeros(10, 2, 3, dtype=torch.int32), torch.zeros(10, 2, dtype=torch.int32), 3)


# ---------------------------------------------------------------------------------------
# quantize / dequantize
# ---------------------------------------------------------------------------------------


@pytest.mark.parametrize("bits, min_db", [(2, 5.0), (3, 10.0), (4, 15.0), (5, 20.0)])
def test_sqnr_on_gaussian(bits, min_db):
    g = torch.Generator().manual_seed(bits)
    w = torch.randn(1024, 1024, generator=g)  # 1M values
    w_hat = fmt.dequantize(fmt.quantize(w, bits))
    assert _sqnr_db(w, w_hat) > min_db


@pytest.mark.parametrize("bits", BITS)
def test_e4m4_costs_under_1p5_db_vs_fp32_absmax(bits):
    g = torch.Generator().manual_seed(10 + bits)
    w = torch.randn(1024, 1024, generator=g)
    e4m4_db = _sqnr_db(w, fmt.dequantize(fmt.quantize(w, bits)))
    # the same nearest-codebook quantization with exact fp32 absmax scales
    cb = fmt.create_normal_float_codebook(bits)
    blocks = w.reshape(1024, 32, 32)
    amax = blocks.abs().amax(-1, keepdim=True)
    x = blocks / amax
    idx = (x.unsqueeze(-1) - cb).abs().argmin(-1)
    fp32_db = _sqnr_db(w, (cb[idx] * amax).reshape(1024, 1024))
    assert fp32_db - e4m4_db < 1.5


@pytest.mark.parametrize("bits", BITS)
@pytest.mark.parametrize("shape", [(64, 64), (33, 100), (3, 7), (257, 95)], ids=str)
def test_per_block_error_within_bound(bits, shape):
    g = torch.Generator().manual_seed(bits + shape[0])
    # mix of scales spanning many octaves, including blocks deep in the small range
    w = torch.randn(*shape, generator=g) * torch.logspace(-6, 1, shape[1]).unsqueeze(0)
    qw = fmt.quantize(w, bits)
    w_hat = fmt.dequantize(qw)
    p, a = fmt.untile_blocks(qw.packed, qw.absmax, bits, *shape)
    scale = fmt.decode_e4m4(a) * qw.tensor_scale
    scale = scale.repeat_interleave(32, dim=1)[:, : shape[1]]
    radius = fmt.codebook_covering_radius(qw.codebook)
    err = (w - w_hat).abs()
    assert bool((err <= radius * scale * (1 + 1e-6) + 1e-30).all())
    # and the stored scale itself is tight: within 1/16 above the block absmax (normal range)
    amax = fmt._blocks_of(w).abs().amax(-1)
    s = fmt.decode_e4m4(a) * qw.tensor_scale
    assert bool((s >= amax).all())
    normal = amax / qw.tensor_scale >= 2.0**-10
    assert bool((s[normal] <= amax[normal] * (1 + 1 / 16) * (1 + 1e-7)).all())


def test_nearest_with_ties_to_lower_index():
    cb = torch.tensor([-1.0, -0.5, 0.5, 1.0])
    # one block whose absmax is exactly 1 (code for 1.0 is exact) -> x = w
    w = torch.tensor([[1.0, -1.0, 0.75, -0.75, 0.0, 0.5, -0.5, 0.7499, 0.7501] + [0.0] * 23])
    qw = fmt.quantize(w, 2, cb)
    p, _ = fmt.untile_blocks(qw.packed, qw.absmax, 2, 1, 32)
    idx = fmt.unpack_bitplanes(p, 2)[0, 0, :9].tolist()
    # 0.75 is the midpoint of 0.5 and 1.0 -> lower (2); -0.75 between -1 and -0.5 -> lower (0);
    # 0.0 between -0.5 and 0.5 -> lower (1)
    assert idx == [3, 0, 2, 0, 1, 2, 1, 2, 3]


def test_quantize_is_deterministic_and_dtype_independent():
    g = torch.Generator().manual_seed(3)
    w = torch.randn(100, 96, generator=g).to(torch.bfloat16)
    a = fmt.quantize(w, 3)
    b = fmt.quantize(w.float(), 3)
    assert torch.equal(a.packed, b.packed) and torch.equal(a.absmax, b.absmax)


def test_zero_blocks_dequantize_to_exact_zero():
    w = torch.randn(40, 96)
    w[:, 32:64] = 0
    w[5] = 0
    w_hat = fmt.dequantize(fmt.quantize(w, 4))
    assert bool((w_hat[:, 32:64] == 0).all()) and bool((w_hat[5] == 0).all())


def test_large_weights_do_not_clip():
    w = torch.randn(16, 64) * 1000  # far above the E4M4 range
    qw = fmt.quantize(w, 4)
    assert qw.tensor_scale.item() > 1
    w_hat = fmt.dequantize(qw)
    assert (w - w_hat).abs().max() <= 0.25 * w.abs().max()
    assert torch.allclose(w_hat.abs().max(), w.abs().max(), rtol=1 / 16)


@pytest.mark.parametrize("bits", BITS)
@pytest.mark.parametrize(
    "name, cb",
    [
        ("uniform", lambda n: torch.linspace(-1, 1, n)),
        ("asymmetric", lambda n: torch.linspace(-1, 1, n).sign() * torch.linspace(-1, 1, n).abs() ** 1.5 * torch.where(torch.linspace(-1, 1, n) < 0, 0.6, 1.0)),
        ("all-positive", lambda n: torch.linspace(0, 1, n)),
        ("all-negative", lambda n: torch.linspace(-1, -0.1, n)),
    ],
    ids=lambda v: v if isinstance(v, str) else "",
)
def test_user_codebooks_roundtrip(bits, name, cb):
    codebook = cb(1 << bits).float()
    codebook = fmt.validate_codebook(codebook, bits)
    g = torch.Generator().manual_seed(bits)
    w = torch.randn(70, 130, generator=g)
    qw = fmt.quantize(w, bits, codebook)
    assert torch.equal(qw.codebook, codebook)
    w_hat = fmt.dequantize(qw)
    # every dequantized value is a codebook entry times its block scale
    p, a = fmt.untile_blocks(qw.packed, qw.absmax, bits, 70, 130)
    idx = fmt.unpack_bitplanes(p, bits).long().reshape(70, -1)[:, :130]
    scale = (fmt.decode_e4m4(a) * qw.tensor_scale).repeat_interleave(32, dim=1)[:, :130]
    assert torch.equal(w_hat, codebook[idx] * scale)
    # and each index is the nearest entry
    x = w / scale
    best = (x.unsqueeze(-1) - codebook).abs().min(-1).values
    assert torch.allclose((x - codebook[idx]).abs(), best, atol=1e-6)


# ---------------------------------------------------------------------------------------
# reference matmul
# ---------------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("lead", [(1,), (5,), (2, 3)], ids=str)
def test_matmul_any_leading_dims(dtype, lead):
    g = torch.Generator().manual_seed(1)
    w = torch.randn(33, 100, generator=g)
    bias = torch.randn(33, generator=g)
    qw = fmt.quantize(w, 4)
    x = torch.randn(*lead, 100, generator=g).to(dtype)
    y = fmt.matmul(x, qw, bias)
    assert y.shape == (*lead, 33) and y.dtype == dtype
    ref = x.float() @ fmt.dequantize(qw).T + bias
    assert torch.allclose(y.float(), ref, rtol=1e-2, atol=1e-2)


def test_matmul_shape_error():
    qw = fmt.quantize(torch.randn(8, 64), 2)
    with pytest.raises(ValueError, match="in_features=64"):
        fmt.matmul(torch.randn(2, 63), qw)


# ---------------------------------------------------------------------------------------
# bad inputs
# ---------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "weight, bits, err, match",
    [
        (torch.randn(4, 32), 1, ValueError, "bits must be one of"),
        (torch.randn(4, 32), 6, ValueError, "bits must be one of"),
        (torch.randn(4, 32), 4.0, TypeError, "bits must be an int"),
        (torch.randn(4, 32), True, TypeError, "bits must be an int"),
        (torch.randint(0, 3, (4, 32)), 4, TypeError, "floating-point"),
        (torch.tensor([[1.0, float("nan")]]), 4, ValueError, "NaN or Inf"),
        (torch.tensor([[1.0, float("inf")]]), 4, ValueError, "NaN or Inf"),
        (torch.randn(0, 32), 4, ValueError, "empty"),
        (torch.randn(32), 4, ValueError, "2-D"),
        (torch.randn(2, 3, 32), 4, ValueError, "2-D"),
        (torch.randn(4, 32).numpy(), 4, TypeError, "torch.Tensor"),
    ],
    ids=["bits-1", "bits-6", "bits-float", "bits-bool", "int-weight", "nan", "inf", "empty", "1-d", "3-d", "numpy"],
)
def test_quantize_bad_input(weight, bits, err, match):
    with pytest.raises(err, match=match):
        fmt.quantize(weight, bits)


def test_quantize_bad_codebook_size():
    with pytest.raises(ValueError, match=r"shape \[8\]"):
        fmt.quantize(torch.randn(4, 32), 3, torch.linspace(-1, 1, 16))


def test_kbit_weight_rejects_mismatched_tensors():
    qw = fmt.quantize(torch.randn(130, 70), 3)
    with pytest.raises(ValueError, match="does not match"):
        fmt.KbitWeight(qw.packed, qw.absmax[:1], qw.codebook, qw.tensor_scale, 3, 130, 70)
    with pytest.raises(ValueError, match="does not match"):
        fmt.KbitWeight(qw.packed, qw.absmax, qw.codebook, qw.tensor_scale, 3, 130, 300)
    with pytest.raises(ValueError, match="bits=2"):
        fmt.KbitWeight(qw.packed, qw.absmax, qw.codebook, qw.tensor_scale, 2, 130, 70)
    with pytest.raises(ValueError, match="tensor_scale"):
        fmt.KbitWeight(qw.packed, qw.absmax, qw.codebook, torch.ones(2), 3, 130, 70)
