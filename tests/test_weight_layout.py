"""4- and 5-bit pair codes (``docs/format.md``, section 7a) on the CPU: the layout against its written
definition, the ops and modules fed them, and the conversions of :mod:`kbit_linear.weight_layout`."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import kbit_linear
from kbit_linear import KbitExperts, KbitLinear, weight_layout
from kbit_linear import format as fmt
from kbit_linear import _grouped_ops


BITS = tuple(fmt.PAIR_CODE_BYTES)  # the widths with pair codes


def _random_planes(*lead: int, seed: int = 0, bits: int = 4) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(-2**31, 2**31 - 1, (*lead, bits), dtype=torch.int32, generator=g)


def _pair_code(idx: torch.Tensor, e0: int, e1: int) -> torch.Tensor:
    """The 4-bit pair code of elements e0, e1 of each block, written out from section 7a."""
    code = torch.zeros(idx.shape[:-1], dtype=torch.int64)
    for b in range(4):
        code |= ((idx[..., e0].long() >> b) & 1) << (2 * b)
        code |= ((idx[..., e1].long() >> b) & 1) << (2 * b + 1)
    return code


def test_pair_codes_follow_their_definition():
    planes = _random_planes(3, 7)
    codes = fmt.to_pair_codes(planes)
    assert codes.dtype == torch.uint8 and codes.shape == (3, 7, 16)
    idx = fmt.unpack_bitplanes(planes, 4)
    for w in range(4):
        for j in range(4):
            assert torch.equal(codes[..., 4 * w + j].long(), _pair_code(idx, 2 * w + 8 * j, 2 * w + 8 * j + 1)), (w, j)


def test_five_bit_pair_codes_follow_their_definition():
    planes = _random_planes(3, 7, bits=5)
    codes = fmt.to_pair_codes(planes)
    assert codes.dtype == torch.uint8 and codes.shape == (3, 7, 20)
    idx = fmt.unpack_bitplanes(planes, 5).long()
    for w in range(4):
        # lane group w: 40 bits, word w below byte 16 + w
        group = sum(codes[..., 4 * w + i].long() << (8 * i) for i in range(4)) | (codes[..., 16 + w].long() << 32)
        for j in range(4):
            code = (group >> (10 * j)) & 1023
            assert torch.equal(code, idx[..., 2 * w + 8 * j] | (idx[..., 2 * w + 8 * j + 1] << 5)), (w, j)


@pytest.mark.parametrize("bits", BITS)
def test_pair_codes_round_trip(bits):
    planes = _random_planes(2, 3, 128, 2, seed=1, bits=bits)
    assert torch.equal(fmt.to_planes(fmt.to_pair_codes(planes)), planes)
    extremes = torch.tensor([[0, -1, -2**31, 2**31 - 1, 0x55555555][:bits]], dtype=torch.int32)
    assert torch.equal(fmt.to_planes(fmt.to_pair_codes(extremes)), extremes)


@pytest.mark.parametrize("bad,err", [(torch.zeros(2, 4, dtype=torch.int64), TypeError), (torch.zeros(2, 3, dtype=torch.int32), ValueError)])
def test_to_pair_codes_rejects_bad_input(bad, err):
    with pytest.raises(err, match="packed"):
        fmt.to_pair_codes(bad)


@pytest.mark.parametrize("bad,err", [(torch.zeros(2, 16, dtype=torch.int8), TypeError), (torch.zeros(2, 8, dtype=torch.uint8), ValueError)])
def test_to_planes_rejects_bad_input(bad, err):
    with pytest.raises(err, match="codes"):
        fmt.to_planes(bad)


def test_check_tiled_takes_pair_codes_at_four_and_five_bits_only():
    for bits in BITS:
        qw = fmt.quantize(torch.randn(200, 300), bits)
        codes = fmt.to_pair_codes(qw.packed)
        assert fmt.check_tiled(codes, qw.absmax, bits, 200, 300) == fmt.check_tiled(qw.packed, qw.absmax, bits, 200, 300)
        with pytest.raises(ValueError, match=r"pair codes, which exist only at bits in \(4, 5\)"):
            fmt.check_tiled(codes, qw.absmax, 3)
        with pytest.raises(ValueError, match="pair codes"):
            fmt.check_tiled(codes[..., :8], qw.absmax, bits)
        with pytest.raises(ValueError, match="pair codes"):
            fmt.check_tiled(codes, qw.absmax, 9 - bits)  # the other width's byte count
        with pytest.raises(TypeError, match="int32"):
            fmt.check_tiled(qw.packed.to(torch.int16), qw.absmax, bits)


@pytest.mark.parametrize("bits", BITS)
def test_a_weight_in_pair_codes_dequantizes_and_slices_like_its_planes(bits):
    qw = fmt.quantize(torch.randn(300, 200), bits)
    pw = fmt.KbitWeight(fmt.to_pair_codes(qw.packed), qw.absmax, qw.codebook, qw.tensor_scale, bits, 300, 200)
    assert torch.equal(fmt.dequantize(pw), fmt.dequantize(qw))
    for rows, cols in (((128, 256), (64, 192)), ((5, 77), (32, 96))):  # whole tiles, then re-tiled blocks
        sp, sq = fmt.slice_weight(pw, rows, cols), fmt.slice_weight(qw, rows, cols)
        assert fmt.is_pair_codes(sp.packed) and torch.equal(fmt.to_planes(sp.packed), sq.packed)
        assert torch.equal(fmt.dequantize(sp), fmt.dequantize(sq))


@pytest.mark.parametrize("bits", BITS)
def test_ops_take_pair_codes(bits):
    qw = fmt.quantize(torch.randn(130, 100), bits)
    codes = fmt.to_pair_codes(qw.packed)
    x = torch.randn(5, 100)
    args = (qw.absmax, qw.codebook, qw.tensor_scale, bits, 130)
    torch.testing.assert_close(torch.ops.kbit_linear.gemm(x, codes, *args, None), torch.ops.kbit_linear.gemm(x, qw.packed, *args, None))
    want = fmt.dequantize(qw)
    assert torch.equal(torch.ops.kbit_linear.dequantize(codes, *args, 100, torch.float32), want)
    packed = torch.stack([codes, codes])
    groups = torch.tensor([[1, 0], [0, 2], [2, 3]], dtype=torch.int32)
    out = _grouped_ops.grouped_gemm_reference(x, packed, torch.stack([qw.absmax] * 2), qw.codebook, qw.tensor_scale.repeat(2),
                                              groups, bits, 130, 3)
    torch.testing.assert_close(out, torch.nn.functional.linear(x, want))
    with pytest.raises(ValueError, match="pair codes"):
        _grouped_ops.check_grouped_args(x, packed, torch.stack([qw.absmax] * 2), qw.codebook[:8], qw.tensor_scale.repeat(2),
                                        groups, 3, 130, 3)


@pytest.mark.parametrize("bits", BITS)
def test_layout_choice_and_conversions(monkeypatch, bits):
    assert weight_layout.wants_pair_codes(bits, torch.device("cuda", 0))
    assert not weight_layout.wants_pair_codes(3, torch.device("cuda", 0))
    assert not weight_layout.wants_pair_codes(2, torch.device("cuda", 0))
    assert not weight_layout.wants_pair_codes(bits, torch.device("cpu"))
    planes = _random_planes(4, 3, 128, 2, seed=2, bits=bits)
    assert weight_layout.device_form(planes, bits) is planes  # planes stay planes on the CPU
    codes = fmt.to_pair_codes(planes)
    monkeypatch.setattr(weight_layout, "_CHUNK_BLOCKS", 100)  # many chunks, a ragged last one
    assert torch.equal(weight_layout.device_form(codes, bits), planes)
    assert torch.equal(weight_layout.storage_form(codes), planes)
    meta = weight_layout.storage_form(codes.to("meta"))
    assert meta.device.type == "meta" and meta.dtype == torch.int32 and meta.shape == planes.shape
    param = nn.Parameter(codes.clone(), requires_grad=False)
    weight_layout.adopt(param, bits)
    assert torch.equal(param.data, planes)
    weight_layout.adopt(None, bits)  # a missing weight is nothing to do


@pytest.mark.parametrize("bits", BITS)
def test_linear_with_pair_codes_saves_and_loads_planes(tmp_path, bits):
    dense = nn.Linear(150, 70)
    layer = KbitLinear.from_linear(dense, bits=bits)
    planes = layer.weight.detach().clone()
    x = torch.randn(3, 150)
    want = layer(x)
    layer.weight.data = fmt.to_pair_codes(layer.weight.data)  # as a CUDA device holds it
    torch.testing.assert_close(layer(x), want)
    state = layer.state_dict()
    assert torch.equal(state["weight"], planes)
    model = nn.Sequential(layer)
    path = tmp_path / "m.safetensors"
    kbit_linear.save_quantized(model, path)
    fresh = nn.Sequential(nn.Linear(150, 70))
    kbit_linear.load_into(fresh, path)
    assert torch.equal(fresh[0].weight, planes)
    layer.load_state_dict(state)  # a CPU layer adopts planes
    assert torch.equal(layer.weight, planes)


@pytest.mark.parametrize("bits", BITS)
def test_experts_state_dict_gives_planes(bits):
    module = KbitExperts(2, 128, 64, bits=bits)
    for proj in ("gate_up_proj", "down_proj"):
        p = getattr(module, proj)
        p.data = fmt.to_pair_codes(_random_planes(*p.shape[:-1], seed=3, bits=bits))
    state = module.state_dict()
    assert state["gate_up_proj"].dtype == torch.int32 and state["down_proj"].dtype == torch.int32
    other = KbitExperts(2, 128, 64, bits=bits)
    other.load_state_dict(state)
    assert torch.equal(other.gate_up_proj, fmt.to_planes(module.gate_up_proj.data))


def test_pair_codes_of_the_wrong_width_are_refused_by_name():
    codes = fmt.to_pair_codes(_random_planes(2, 3, bits=5))
    with pytest.raises(ValueError, match="packed holds 5-bit pair codes, not bits=4"):
        weight_layout.device_form(codes, 4)
    with pytest.raises(ValueError, match="packed must have a last dimension"):
        weight_layout.storage_form(codes[..., :12])
