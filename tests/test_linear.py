"""KbitLinear on CPU: forward vs the reference, from_linear, dequantize, state dict, meta device."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from kbit_linear import format as fmt
from kbit_linear.linear import KbitLinear

DTYPES = [torch.float32, torch.float16, torch.bfloat16]
# (out_features, in_features, bits): odd sizes that fill no tile, and sizes of real models.
SHAPES = [(33, 100, 4), (192, 576, 2), (300, 200, 3), (1, 1, 5), (130, 65, 4), (100, 33, 5)]
LEADING = [(), (1,), (3,), (2, 5)]

# The CPU backend sums in another order than the reference: float32 results agree to rounding,
# fp16/bf16 ones to torch's default tolerance of the dtype (one unit in the last place).
_FP32_ROUNDING = {torch.float32: {"rtol": 1e-5, "atol": 1e-5}}


def _linear(n: int, k: int, bias: bool = True, seed: int = 0, dtype: torch.dtype = torch.float32) -> nn.Linear:
    torch.manual_seed(seed)
    lin = nn.Linear(k, n, bias=bias)
    with torch.no_grad():
        lin.weight.normal_(0.0, 0.05)
        if bias:
            lin.bias.normal_(0.0, 0.1)
    return lin.to(dtype)


def _shape_id(s):
    return f"{s[0]}x{s[1]}-k{s[2]}"


@pytest.mark.parametrize("shape", SHAPES, ids=_shape_id)
def test_from_linear_matches_reference_quantize(shape):
    n, k, bits = shape
    lin = _linear(n, k)
    layer = KbitLinear.from_linear(lin, bits=bits)
    ref = fmt.quantize(lin.weight.detach(), bits)
    assert layer.weight.shape == fmt.tiled_shapes(n, k, bits)[0] == ref.packed.shape
    assert torch.equal(layer.weight, ref.packed)
    assert torch.equal(layer.absmax, ref.absmax)
    assert torch.equal(layer.codebook, fmt.create_normal_float_codebook(bits))
    assert torch.equal(layer.tensor_scale, ref.tensor_scale)
    assert layer.bias is lin.bias
    assert (layer.in_features, layer.out_features, layer.bits) == (k, n, bits)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("shape", SHAPES, ids=_shape_id)
def test_forward_matches_reference_matmul(shape, dtype):
    n, k, bits = shape
    lin = _linear(n, k, seed=n + k, dtype=dtype)
    layer = KbitLinear.from_linear(lin, bits=bits)
    qw = fmt.quantize(lin.weight.detach().float(), bits)
    w_hat = fmt.dequantize(qw)  # independent of the layer: quantized from the dense weight
    assert torch.equal(layer.dequantize(), w_hat)
    for i, lead in enumerate(LEADING):
        x = torch.randn(*lead, k, generator=torch.Generator().manual_seed(i)).to(dtype)
        y = layer(x)
        assert y.dtype == dtype and y.shape == (*lead, n)
        # the reference is: dequantize, float32 F.linear, cast back; the CPU backend (another
        # summation order) equals it within float32 rounding
        want = F.linear(x.float(), w_hat, lin.bias.float()).to(dtype)
        torch.testing.assert_close(y, want, **_FP32_ROUNDING.get(dtype, {}))
        if i == 0:
            torch.testing.assert_close(y, fmt.matmul(x, qw, lin.bias), **_FP32_ROUNDING.get(dtype, {}))


@pytest.mark.parametrize("bits", fmt.SUPPORTED_BITS)
def test_forward_close_to_dense_within_quantization_error(bits):
    lin = _linear(96, 256, seed=bits)
    layer = KbitLinear.from_linear(lin, bits=bits)
    w, w_hat = lin.weight.detach(), layer.dequantize()
    # per-weight bound of the format: covering radius of the codebook times the block scale
    radius = fmt.codebook_covering_radius(layer.codebook)
    scale = (fmt.decode_e4m4(layer.absmax) * layer.tensor_scale).amax()
    assert (w - w_hat).abs().max() <= radius * scale + 1e-7
    x = torch.randn(7, 256)
    err = (layer(x) - lin(x)).norm() / lin(x).norm()
    # relative output error shrinks with bits (normal weights, NF codebook)
    assert err < {2: 0.6, 3: 0.3, 4: 0.15, 5: 0.08}[bits], err


def test_from_linear_with_user_codebook():
    bits = 3
    cb = torch.linspace(-1.0, 1.0, 8)  # uniform, with no entry near 0 for even n: not NF
    lin = _linear(70, 90, seed=3)
    layer = KbitLinear.from_linear(lin, bits=bits, codebook=cb)
    ref = fmt.quantize(lin.weight.detach(), bits, cb)
    assert torch.equal(layer.codebook, cb)
    assert torch.equal(layer.weight, ref.packed) and torch.equal(layer.absmax, ref.absmax)
    x = torch.randn(4, 90)
    torch.testing.assert_close(layer(x), fmt.matmul(x, ref, lin.bias), rtol=1e-5, atol=1e-5)
    # the layer keeps its own copy
    cb[0] = -0.5
    assert layer.codebook[0] == -1.0
    # an asymmetric codebook works as well
    cb2 = torch.tensor([-1.0, -0.3, 0.1, 0.2, 0.4, 0.6, 0.8, 1.0])
    layer2 = KbitLinear.from_linear(lin, bits=bits, codebook=cb2)
    assert torch.equal(layer2.dequantize(), fmt.dequantize(fmt.quantize(lin.weight.detach(), bits, cb2)))


def test_dequantize_default_and_dtype():
    lin = _linear(33, 100)
    layer = KbitLinear.from_linear(lin, bits=4)
    ref = fmt.dequantize(fmt.quantize(lin.weight.detach(), 4))
    assert layer.dequantize().dtype == torch.float32 and torch.equal(layer.dequantize(), ref)
    assert torch.equal(layer.dequantize(torch.bfloat16), ref.to(torch.bfloat16))
    with pytest.raises(TypeError, match="dtype"):
        layer.dequantize(torch.int32)


def test_parameters_buffers_and_trainability():
    layer = KbitLinear.from_linear(_linear(33, 100), bits=4)
    params = dict(layer.named_parameters())
    buffers = dict(layer.named_buffers())
    assert set(params) == {"weight", "bias"} and set(buffers) == {"absmax", "codebook", "tensor_scale"}
    assert isinstance(layer.weight, nn.Parameter) and not layer.weight.requires_grad
    assert layer.weight.dtype == torch.int32 and layer.absmax.dtype == torch.uint8
    assert set(layer.state_dict()) == {"weight", "absmax", "codebook", "tensor_scale", "bias"}
    assert "bits=4" in repr(layer) and "in_features=100" in repr(layer) and "out_features=33" in repr(layer)


def test_dtype_casts_keep_the_quantized_tensors_exact():
    layer = KbitLinear.from_linear(_linear(33, 100), bits=3, codebook=torch.linspace(-0.99, 0.97, 8))
    before = {k: v.clone() for k, v in layer.state_dict().items()}
    for cast in (lambda m: m.half(), lambda m: m.to(torch.bfloat16), lambda m: m.float()):
        cast(layer)
        for name in ("weight", "absmax", "codebook", "tensor_scale"):
            assert torch.equal(getattr(layer, name), before[name]), name
            assert getattr(layer, name).dtype == before[name].dtype
    layer.bfloat16()
    assert layer.bias.dtype == torch.bfloat16
    assert layer(torch.randn(2, 100, dtype=torch.bfloat16)).dtype == torch.bfloat16


@pytest.mark.parametrize("bias", [True, False], ids=["bias", "nobias"])
@pytest.mark.parametrize("shape", SHAPES[:3], ids=_shape_id)
def test_state_dict_round_trip_bit_exact(shape, bias):
    n, k, bits = shape
    layer = KbitLinear.from_linear(_linear(n, k, bias=bias, seed=5), bits=bits)
    sd = layer.state_dict()
    fresh = KbitLinear(k, n, bias=bias, bits=bits)
    assert not torch.equal(fresh.weight, layer.weight)  # the test must be able to fail
    fresh.load_state_dict(sd, strict=True)
    for name, t in layer.state_dict().items():
        assert torch.equal(fresh.state_dict()[name], t), name
    x = torch.randn(3, k)
    assert torch.equal(fresh(x), layer(x))
    assert not fresh.weight.requires_grad


def test_load_state_dict_rejects_wrong_dtype_and_shape():
    layer = KbitLinear.from_linear(_linear(33, 100), bits=4)
    sd = layer.state_dict()
    bad = dict(sd, weight=sd["weight"].float())
    with pytest.raises(RuntimeError, match=r"weight: expected dtype torch.int32"):
        KbitLinear(100, 33, bits=4).load_state_dict(bad)
    bad = dict(sd, absmax=sd["absmax"].to(torch.int32))
    with pytest.raises(RuntimeError, match=r"absmax: expected dtype torch.uint8"):
        KbitLinear(100, 33, bits=4).load_state_dict(bad)
    with pytest.raises(RuntimeError, match="size mismatch"):
        KbitLinear(100, 33, bits=3).load_state_dict(sd)


@pytest.mark.parametrize("src, dst", [((48, 96), (96, 96)), ((128, 64), (100, 40)), ((100, 40), (128, 64))], ids=str)
def test_load_state_dict_refuses_another_layer_shape_with_the_same_tiles(src, dst, tmp_path):
    """Stored tensors are padded to whole 128 x 64 tiles, so layers of these (out, in) shapes store
    alike: the state dict records each layer's shape and load_state_dict refuses another one (the
    padding would stand in for real rows). Saved with torch.save, the record travels along."""
    model = nn.Sequential(KbitLinear.from_linear(_linear(*src, bias=False), bits=4))  # (a bias would tell the shapes apart)
    target = nn.Sequential(KbitLinear(dst[1], dst[0], bias=False, bits=4))
    sd = model.state_dict()
    assert {k: tuple(v.shape) for k, v in sd.items()} == {k: tuple(v.shape) for k, v in target.state_dict().items()}
    want = f"size mismatch for 0: the state dict is of a kbit layer with bits=4, out_features={src[0]}, in_features={src[1]}"
    with pytest.raises(RuntimeError, match=want):
        target.load_state_dict(sd)
    torch.save(sd, tmp_path / "sd.pt")
    with pytest.raises(RuntimeError, match="size mismatch for 0"):
        target.load_state_dict(torch.load(tmp_path / "sd.pt"))
    same = nn.Sequential(KbitLinear(src[1], src[0], bias=False, bits=4))
    same.load_state_dict(sd)
    assert torch.equal(same[0].dequantize(), model[0].dequantize())


def test_from_linear_refuses_a_weight_that_is_not_the_layers_shape():
    lin = nn.Linear(64, 32, bias=False)
    lin.weight = nn.Parameter(torch.randn(64, 64))  # swapped in by hand: out_features still says 32
    with pytest.raises(ValueError, match=r"linear.weight has shape \(64, 64\), the layer's \[out_features, in_features\] is \(32, 64\)"):
        KbitLinear.from_linear(lin, bits=4)


def test_fresh_module_is_all_zero_weight():
    layer = KbitLinear(100, 33, bias=True, bits=2, dtype=torch.float32)
    with torch.no_grad():
        layer.bias.normal_()
    x = torch.randn(4, 100)
    assert torch.equal(layer(x), layer.bias.expand(4, 33))


def test_meta_construction_and_load():
    src = KbitLinear.from_linear(_linear(192, 576, seed=9), bits=2)
    meta = KbitLinear(576, 192, bias=True, bits=2, device="meta")
    for name, t in src.state_dict().items():
        m = meta.state_dict()[name]
        assert m.device.type == "meta" and m.shape == t.shape and m.dtype == t.dtype, name
    # to_empty + copy
    filled = KbitLinear(576, 192, bits=2, device="meta").to_empty(device="cpu")
    filled.load_state_dict(src.state_dict())
    # assign
    meta.load_state_dict(src.state_dict(), assign=True)
    assert isinstance(meta.weight, nn.Parameter) and not meta.weight.requires_grad
    x = torch.randn(2, 576)
    assert torch.equal(meta(x), src(x)) and torch.equal(filled(x), src(x))


def test_from_linear_on_meta_gives_meta_layer():
    lin = nn.Linear(100, 33, device="meta")
    layer = KbitLinear.from_linear(lin, bits=5)
    assert layer.weight.device.type == "meta" and layer.weight.shape == fmt.tiled_shapes(33, 100, 5)[0]
    assert layer.codebook.shape == (32,) and layer.bias.device.type == "meta"


def test_argument_checks():
    with pytest.raises(ValueError, match="bits"):
        KbitLinear(64, 64, bits=6)
    with pytest.raises(TypeError, match="bits"):
        KbitLinear(64, 64, bits=4.0)
    with pytest.raises(ValueError, match="in_features"):
        KbitLinear(0, 64)
    with pytest.raises(TypeError, match="out_features"):
        KbitLinear(64, 6.5)
    with pytest.raises(TypeError, match="dtype"):
        KbitLinear(64, 64, dtype=torch.int8)
    with pytest.raises(ValueError, match="codebook"):
        KbitLinear(64, 64, bits=2, codebook=torch.tensor([0.5, -0.5, 0.1, 0.9]))
    with pytest.raises(TypeError, match="nn.Linear"):
        KbitLinear.from_linear(nn.Conv1d(3, 3, 1))
    lin = _linear(8, 40)
    with torch.no_grad():
        lin.weight[0, 0] = float("nan")
    with pytest.raises(ValueError, match="NaN"):
        KbitLinear.from_linear(lin)
    layer = KbitLinear.from_linear(_linear(8, 40))
    with pytest.raises(ValueError, match="last dimension"):
        layer(torch.randn(2, 41))


def test_torch_compile_fullgraph():
    layer = KbitLinear.from_linear(_linear(33, 100), bits=4)
    x = torch.randn(3, 100)
    compiled = torch.compile(layer, fullgraph=True, backend="eager")
    assert torch.equal(compiled(x), layer(x))


def test_a_zero_dimensional_input_is_refused_by_name():
    layer = KbitLinear.from_linear(torch.nn.Linear(64, 32))
    with pytest.raises(ValueError, match="in_features=64"):
        layer(torch.tensor(1.0))


def test_load_state_dict_refuses_values_a_layer_cannot_hold():
    layer = KbitLinear.from_linear(torch.nn.Linear(64, 32), hadamard=True)
    for key, value, match in (("hadamard_signs", torch.zeros(64, dtype=torch.int8), "hadamard_signs must hold only"),
                              ("tensor_scale", torch.tensor([-3.0]), "tensor_scale must be a positive finite power of two"),
                              ("codebook", torch.full((16,), float("nan")), "codebook contains NaN")):
        state = layer.state_dict()
        state[key] = value
        fresh = KbitLinear(64, 32, hadamard=True)
        with pytest.raises(RuntimeError, match=match):
            fresh.load_state_dict(state)
    KbitLinear(64, 32, hadamard=True).load_state_dict(layer.state_dict())  # its own state loads


def test_dequantize_is_contiguous_as_its_fake_kernel_says_and_refuses_integer_dtypes():
    layer = KbitLinear.from_linear(torch.nn.Linear(70, 130))  # 70 in-features: the blocks' padding is cut off
    w = layer.dequantize()
    assert w.is_contiguous() and w.view(-1).numel() == 130 * 70
    args = (layer.weight, layer.absmax, layer.codebook, layer.tensor_scale, layer.bits, 130, 70)
    torch.library.opcheck(torch.ops.kbit_linear.dequantize.default, (*args, torch.float32))
    with pytest.raises(TypeError, match="dtype must be a floating-point"):
        torch.ops.kbit_linear.dequantize(*args, torch.int8)


def test_hadamard_rotate_returns_contiguous_as_its_fake_kernel_says():
    from kbit_linear import _ops
    from kbit_linear import hadamard as hd

    x = torch.randn(64, 3).t()  # strided
    signs = hd.random_signs(64)
    torch.library.opcheck(torch.ops.kbit_linear.hadamard_rotate.default, (x, signs))
    with pytest.raises(TypeError, match="x must be a floating-point tensor"):
        _ops.hadamard_rotate([[1.0] * 64], signs)


# ---------------------------------------------------------------------------------------
# compute_dtype: the dtype of the dense layer a KbitLinear stands for
# ---------------------------------------------------------------------------------------


def test_compute_dtype_is_the_dense_layers_and_follows_module_casts():
    torch.manual_seed(0)
    assert KbitLinear(64, 32, bias=False).compute_dtype == torch.get_default_dtype()
    assert KbitLinear(64, 32, bias=False, device="meta", dtype=torch.float16).compute_dtype == torch.float16
    layer = KbitLinear.from_linear(nn.Linear(64, 32, bias=False).to(torch.bfloat16), bits=4)
    assert layer.compute_dtype == torch.bfloat16 and layer.bias is None
    packed = layer.weight.detach().clone()
    assert layer.half().compute_dtype == torch.float16
    assert layer.to("cpu").compute_dtype == torch.float16  # a move alone keeps it
    assert layer.float().compute_dtype == torch.float32
    assert layer.to(torch.bfloat16).compute_dtype == torch.bfloat16
    assert torch.equal(layer.weight, packed) and layer.codebook.dtype == torch.float32  # the format is untouched


def test_compute_dtype_survives_unfusing_and_slicing():
    from kbit_linear.fusion import FusedKbitLinear, KbitLinearSlice
    from kbit_linear.parallel import slice_linear

    torch.manual_seed(0)
    parts = [KbitLinear.from_linear(nn.Linear(64, 48, bias=False).to(dt), bits=4) for dt in (torch.bfloat16, torch.float16)]
    fused = FusedKbitLinear(parts)
    assert [KbitLinearSlice(fused, i).as_kbit_linear().compute_dtype for i in range(2)] == [torch.bfloat16, torch.float16]
    assert slice_linear(parts[0], rows=(0, 16)).compute_dtype == torch.bfloat16


def test_a_layer_pickled_before_compute_dtype_existed_gets_one_on_load():
    layer = KbitLinear(64, 32, bias=True, dtype=torch.float16)
    state = dict(layer.__dict__)
    del state["compute_dtype"]
    old = KbitLinear.__new__(KbitLinear)
    old.__setstate__(state)
    assert old.compute_dtype == torch.float16  # the bias's
    assert old.to(torch.bfloat16).compute_dtype == torch.bfloat16


def test_module_type_casts_are_refused_before_they_destroy_the_packed_weight() -> None:
    """``Module.type(dtype)`` casts integer tensors too (``.to(dtype)`` does not): the packed
    planes and block scales would be lost for good, so it raises and the layer is untouched."""
    lin = nn.Linear(96, 64)
    layer = KbitLinear.from_linear(lin, bits=4)
    before = {k: v.clone() for k, v in layer.state_dict().items()}
    x = torch.randn(3, 96)
    y = layer(x)
    with pytest.raises(TypeError, match=r"cannot cast its packed integer tensors.*\.to\(dtype\)"):
        layer.type(torch.float16)
    assert layer.compute_dtype == torch.float32
    after = layer.state_dict()
    assert all(torch.equal(before[k], after[k]) and before[k].dtype == after[k].dtype for k in before)
    assert torch.equal(layer(x), y)
    assert layer.to(torch.float16).compute_dtype == torch.float16  # .to(dtype) still sets the compute dtype


@pytest.mark.parametrize("x", [[0.0] * 64, None, 3.0])
def test_a_non_tensor_input_is_named(x) -> None:
    layer = KbitLinear(64, 32, bits=4)
    with pytest.raises(TypeError, match="x must be a floating-point torch.Tensor"):
        layer(x)
