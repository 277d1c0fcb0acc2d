"""GGUF block formats kept quantized, on CPU: the reference against the ``gguf`` package (bit for
bit), the ``gguf_gemm`` / ``gguf_dequantize`` ops (reference, fake tensors, compile), and the
``GGUFLinear`` / ``GGUFEmbedding`` modules built on them."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from kbit_linear import gguf_format as gf
from kbit_linear.gguf_linear import GGUFEmbedding, GGUFLinear

np = pytest.importorskip("numpy")
gguf = pytest.importorskip("gguf")
from gguf import quants  # noqa: E402

QTYPES = sorted(gf.BLOCK_TYPES)
SHAPES = [(n, k) for n in (1, 7, 33) for k in (32, 96, 160)]
DTYPES = [torch.float32, torch.float16, torch.bfloat16]
LEADING = [(), (1,), (3,), (2, 5)]

GEMM = torch.ops.kbit_linear.gguf_gemm.default
DEQUANTIZE = torch.ops.kbit_linear.gguf_dequantize.default


def _shape_id(s: tuple[int, int]) -> str:
    return f"{s[0]}x{s[1]}"


def _values(n: int, k: int, seed: int) -> np.ndarray:
    """Normal weights with a spread of row scales (and one all-zero block where there is room)."""
    rng = np.random.default_rng(seed)
    w = rng.standard_normal((n, k)).astype(np.float32) * rng.uniform(0.01, 3.0, (n, 1)).astype(np.float32)
    if n > 2:
        w[1, :32] = 0.0
    return w


def _gguf_bytes(qtype: str, n: int, k: int, seed: int = 0) -> np.ndarray:
    """``[n, k]`` weights quantized by the ``gguf`` package: uint8 ``[n, row_bytes]``."""
    return quants.quantize(_values(n, k, seed), gguf.GGMLQuantizationType[qtype])


def _weight(qtype: str, n: int, k: int, seed: int = 0) -> tuple[gf.GGUFWeight, torch.Tensor]:
    """(the weight, gguf's float32 dequantization of it)."""
    raw = _gguf_bytes(qtype, n, k, seed)
    ref = torch.from_numpy(quants.dequantize(raw, gguf.GGMLQuantizationType[qtype]).copy())
    return gf.split_blocks(torch.from_numpy(raw), qtype, n, k), ref


def _same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Equal as raw 32-bit words (tells -0.0 from 0.0 and compares NaN payloads)."""
    same_dtype = a.dtype == b.dtype == torch.float32
    return same_dtype and torch.equal(a.contiguous().view(torch.int32), b.contiguous().view(torch.int32))


# ---------------------------------------------------------------------------------------
# the reference against gguf
# ---------------------------------------------------------------------------------------


@pytest.mark.parametrize("qtype", QTYPES)
def test_block_types_match_gguf(qtype):
    t = gf.BLOCK_TYPES[qtype]
    ggml = gguf.GGMLQuantizationType[qtype]
    assert t.name == qtype and t.ggml_type == ggml.value
    assert (gf.BLOCK, t.block_bytes) == gguf.GGML_QUANT_SIZES[ggml]
    assert gf.block_type(qtype) is t and gf.block_type(t) is t
    assert sorted(b.code for b in gf.BLOCK_TYPES.values()) == list(range(len(gf.BLOCK_TYPES)))


@pytest.mark.parametrize("shape", SHAPES, ids=_shape_id)
@pytest.mark.parametrize("qtype", QTYPES)
def test_dequantize_equals_gguf_bit_for_bit(qtype, shape):
    n, k = shape
    weight, ref = _weight(qtype, n, k, seed=n * 1000 + k)
    assert _same_bits(gf.dequantize(weight), ref)
    for dtype in (torch.float16, torch.bfloat16):
        assert torch.equal(gf.dequantize(weight, dtype), ref.to(dtype))


@pytest.mark.parametrize("shape", SHAPES, ids=_shape_id)
@pytest.mark.parametrize("qtype", QTYPES)
def test_split_join_round_trip(qtype, shape):
    n, k = shape
    raw = torch.from_numpy(_gguf_bytes(qtype, n, k, seed=k))
    weight = gf.split_blocks(raw, qtype, n, k)
    for name, (field_shape, dtype) in gf.field_shapes(qtype, n, k).items():
        t = getattr(weight, name)
        assert t.dtype == dtype and tuple(t.shape) == field_shape and t.is_contiguous()
    assert torch.equal(gf.join_blocks(weight), raw)
    # any bytes at all (NaN scales included) survive the split: it is a relayout, not a decode
    noise = torch.randint(0, 256, raw.shape, dtype=torch.uint8, generator=torch.Generator().manual_seed(n + k))
    assert torch.equal(gf.join_blocks(gf.split_blocks(noise.flatten(), qtype, n, k)), noise)


@pytest.mark.parametrize("qtype", QTYPES)
def test_weight_indices_and_offsets(qtype):
    weight, ref = _weight(qtype, 4, 64)
    t = gf.block_type(qtype)
    q = gf.weight_indices(weight)
    assert q.dtype == torch.int32 and q.shape == (4, 64)
    lo, hi = (-128, 127) if t.bits == 8 else (0, 2**t.bits - 1)
    assert lo <= int(q.min()) and int(q.max()) <= hi
    d = weight.scale.float().repeat_interleave(32, dim=1)
    w = d * (q - t.offset).float()
    if weight.mins is not None:
        w = w + weight.mins.float().repeat_interleave(32, dim=1)
    assert _same_bits(w, ref)


def test_bad_inputs_name_the_argument():
    raw = torch.from_numpy(_gguf_bytes("Q5_0", 3, 64))
    with pytest.raises(TypeError, match="raw"):
        gf.split_blocks(raw.float(), "Q5_0", 3, 64)
    with pytest.raises(ValueError, match="raw has"):
        gf.split_blocks(raw.flatten()[:-1], "Q5_0", 3, 64)
    with pytest.raises(ValueError, match="in_features"):
        gf.split_blocks(raw, "Q5_0", 3, 48)
    with pytest.raises(ValueError, match="out_features"):
        gf.split_blocks(raw, "Q5_0", 0, 64)
    with pytest.raises(ValueError, match="qtype"):
        gf.split_blocks(raw, "Q4_K", 3, 64)
    w = gf.split_blocks(raw, "Q5_0", 3, 64)
    with pytest.raises(TypeError, match="qh"):
        gf.GGUFWeight(w.qs, None, w.scale, None, "Q5_0", 3, 64)
    with pytest.raises(ValueError, match="mins"):
        gf.GGUFWeight(w.qs, w.qh, w.scale, w.scale.clone(), "Q5_0", 3, 64)
    with pytest.raises(ValueError, match="scale"):
        gf.GGUFWeight(w.qs, w.qh, w.scale.float(), None, "Q5_0", 3, 64)
    with pytest.raises(ValueError, match="qs"):
        gf.GGUFWeight(w.qs[:, :-1], w.qh, w.scale, None, "Q5_0", 3, 64)
    with pytest.raises(ValueError, match="qh"):
        gf.GGUFWeight(w.qs, w.qh, w.scale, None, "Q4_0", 3, 64)  # Q4_0 has no fifth bits


# ---------------------------------------------------------------------------------------
# the ops
# ---------------------------------------------------------------------------------------


def _op_args(weight: gf.GGUFWeight) -> tuple:
    return weight.qs, weight.qh, weight.scale, weight.mins, weight.qtype


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("qtype", QTYPES)
def test_gemm_reference_is_x_times_dequantized_weight(qtype, dtype):
    n, k = 33, 160
    weight, ref = _weight(qtype, n, k, seed=7)
    g = torch.Generator().manual_seed(1)
    x = torch.randn(5, k, generator=g).to(dtype)
    bias = torch.randn(n, generator=g)
    y = GEMM(x, *_op_args(weight), n, bias)
    assert y.dtype == dtype and y.shape == (5, n)
    # exactly the model whose weights were dequantized to x's dtype at load
    assert torch.equal(y, F.linear(x, ref.to(dtype), bias.to(dtype)))
    assert torch.equal(GEMM(x, *_op_args(weight), n, None), F.linear(x, ref.to(dtype)))
    tol = {torch.float32: 1e-5, torch.float16: 1e-2, torch.bfloat16: 5e-2}[dtype]
    torch.testing.assert_close(y.float(), x.float() @ ref.T + bias, rtol=tol, atol=tol * 10)


@pytest.mark.parametrize("qtype", QTYPES)
def test_dequantize_op_equals_reference(qtype):
    weight, ref = _weight(qtype, 7, 96)
    assert _same_bits(DEQUANTIZE(*_op_args(weight), 7, 96, torch.float32), ref)
    assert torch.equal(DEQUANTIZE(*_op_args(weight), 7, 96, torch.bfloat16), ref.to(torch.bfloat16))


def test_opcheck_gguf_ops():
    weight, _ = _weight("Q5_1", 9, 64)
    x = torch.randn(3, 64)
    torch.library.opcheck(GEMM, (x, *_op_args(weight), 9, torch.randn(9)), test_utils=("test_schema", "test_faketensor"))
    torch.library.opcheck(DEQUANTIZE, (*_op_args(weight), 9, 64, torch.float16), test_utils=("test_schema", "test_faketensor"))


@pytest.mark.parametrize("qtype", ["Q4_0", "Q5_1", "Q8_0"])
def test_gemm_gradients_equal_the_dense_layers(qtype):
    """The op's backward (x and bias; the GGUF weight is frozen) matches F.linear's, with no
    "autograd kernel was not registered" warning."""
    import warnings

    n, k = 12, 96
    weight, ref = _weight(qtype, n, k, seed=3)
    x = torch.randn(4, k, requires_grad=True)
    bias = torch.randn(n, requires_grad=True)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        GEMM(x, *_op_args(weight), n, bias).square().sum().backward()
    x2, b2 = x.detach().clone().requires_grad_(), bias.detach().clone().requires_grad_()
    F.linear(x2, ref, b2).square().sum().backward()
    torch.testing.assert_close(x.grad, x2.grad)
    torch.testing.assert_close(bias.grad, b2.grad)
    torch.library.opcheck(GEMM, (x.detach(), *_op_args(weight), n, bias.detach()), test_utils=("test_autograd_registration",))


def test_gemm_names_x_when_its_width_is_wrong():
    weight, _ = _weight("Q4_1", 6, 64)
    with pytest.raises(ValueError, match="x has 32 in-features"):
        GEMM(torch.randn(2, 32), *_op_args(weight), 6, None)


def test_fake_tensor_shapes_and_checks():
    from torch._subclasses.fake_tensor import FakeTensorMode

    weight, _ = _weight("Q4_1", 40, 96)
    with FakeTensorMode(allow_non_fake_inputs=True) as mode:
        fake = gf.GGUFWeight(*(mode.from_tensor(t) if t is not None else None for t in
                               (weight.qs, weight.qh, weight.scale, weight.mins)), "Q4_1", 40, 96)
        x = torch.empty(6, 96, dtype=torch.bfloat16)
        y = GEMM(x, *_op_args(fake), 40, None)
        assert y.shape == (6, 40) and y.dtype == torch.bfloat16
        d = DEQUANTIZE(*_op_args(fake), 40, 96, torch.float16)
        assert d.shape == (40, 96) and d.dtype == torch.float16
        with pytest.raises(ValueError, match="qs"):
            GEMM(torch.empty(6, 64), *_op_args(fake), 40, None)  # x's width is not the weight's
        with pytest.raises(ValueError, match="bias"):
            GEMM(x, *_op_args(fake), 40, torch.empty(39))
        with pytest.raises(TypeError, match="dtype"):
            DEQUANTIZE(*_op_args(fake), 40, 96, torch.int32)


# ---------------------------------------------------------------------------------------
# GGUFLinear
# ---------------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("qtype", QTYPES)
def test_linear_forward_equals_dense_layer(qtype, dtype):
    n, k = 33, 96
    weight, ref = _weight(qtype, n, k, seed=3)
    bias = torch.randn(n).to(dtype)
    layer = GGUFLinear.from_weight(weight, bias)
    assert (layer.in_features, layer.out_features, layer.qtype) == (k, n, qtype)
    for i, lead in enumerate(LEADING):
        x = torch.randn(*lead, k, generator=torch.Generator().manual_seed(i)).to(dtype)
        y = layer(x)
        assert y.shape == (*lead, n) and y.dtype == dtype
        assert torch.equal(y, F.linear(x, ref.to(dtype), bias))
    assert _same_bits(layer.dequantize(), ref)
    assert torch.equal(layer.dequantize(torch.float16), ref.half())


def test_linear_from_weight_shares_tensors():
    weight, _ = _weight("Q5_0", 8, 64)
    bias = nn.Parameter(torch.randn(8))
    layer = GGUFLinear.from_weight(weight, bias)
    assert layer.qs is weight.qs and layer.qh is weight.qh and layer.scale is weight.scale and layer.mins is None
    assert layer.bias is bias
    plain = GGUFLinear.from_weight(weight, torch.randn(8))
    assert isinstance(plain.bias, nn.Parameter) and not plain.bias.requires_grad
    back = layer.weight_format()
    assert back.qs is weight.qs and (back.qtype, back.out_features, back.in_features) == ("Q5_0", 8, 64)
    assert set(dict(layer.named_buffers())) == {"qs", "qh", "scale"}
    assert "qtype=Q5_0" in repr(layer) and "bias=True" in repr(layer)


def test_linear_validates_inputs():
    weight, _ = _weight("Q4_0", 8, 64)
    with pytest.raises(TypeError, match="weight"):
        GGUFLinear.from_weight(torch.zeros(8, 64))
    with pytest.raises(ValueError, match="bias"):
        GGUFLinear.from_weight(weight, torch.zeros(7))
    with pytest.raises(TypeError, match="bias"):
        GGUFLinear.from_weight(weight, torch.zeros(8, dtype=torch.int32))
    with pytest.raises(ValueError, match="in_features"):
        GGUFLinear.from_weight(weight)(torch.zeros(2, 32))
    with pytest.raises(ValueError, match="in_features"):
        GGUFLinear(48, 8, "Q4_0")
    with pytest.raises(TypeError, match="out_features"):
        GGUFLinear(64, 8.0, "Q4_0")
    with pytest.raises(ValueError, match="qtype"):
        GGUFLinear(64, 8, "Q6_K")
    with pytest.raises(TypeError, match="dtype"):
        GGUFLinear(64, 8, "Q4_0", bias=True, dtype=torch.int8)


def test_linear_dtype_casts_leave_the_arrays_alone():
    weight, ref = _weight("Q4_1", 16, 64)
    model = nn.Sequential(GGUFLinear.from_weight(weight, torch.randn(16)))
    before = {k: v.clone() for k, v in model[0].named_buffers()}
    for cast in (lambda m: m.to(torch.bfloat16), lambda m: m.half(), lambda m: m.double(), lambda m: m.float()):
        cast(model)
        for name, t in model[0].named_buffers():
            assert t.dtype == before[name].dtype and torch.equal(t, before[name]), name
    model.to(torch.bfloat16)
    assert model[0].bias.dtype == torch.bfloat16
    x = torch.randn(2, 64, dtype=torch.bfloat16)
    assert torch.equal(model(x), F.linear(x, ref.bfloat16(), model[0].bias))


def test_device_moves_keep_shared_arrays_shared():
    weight, _ = _weight("Q8_0", 12, 32)
    embedding = GGUFEmbedding.from_weight(weight)
    head = GGUFLinear.from_weight(embedding.weight_format())
    model = nn.Sequential(embedding, head)
    # a "move" that makes new tensors, as a device move does; shared arrays must stay one tensor
    model._apply(lambda t: t.clone())
    for name in ("qs", "scale"):
        assert getattr(embedding, name) is getattr(head, name)
    model.to_empty(device="cpu")
    assert embedding.qs is head.qs


def test_linear_state_dict_round_trip_and_dtype_check():
    weight, ref = _weight("Q5_1", 10, 64)
    layer = GGUFLinear.from_weight(weight, torch.randn(10))
    fresh = GGUFLinear(64, 10, "Q5_1", bias=True)
    assert torch.equal(fresh.dequantize(), torch.zeros(10, 64))
    fresh.load_state_dict(layer.state_dict())
    assert _same_bits(fresh.dequantize(), ref) and torch.equal(fresh.bias, layer.bias)
    bad = dict(layer.state_dict(), qs=layer.qs.float())
    with pytest.raises(RuntimeError, match="qs"):
        fresh.load_state_dict(bad)
    meta = GGUFLinear(64, 10, "Q5_1", device="meta")
    assert all(t.device.type == "meta" for t in meta.buffers())


def test_linear_compile_fullgraph_no_graph_break():
    weight, _ = _weight("Q5_0", 24, 96)
    layer = GGUFLinear.from_weight(weight, torch.randn(24))
    x = torch.randn(2, 3, 96)
    compiled = torch.compile(layer, fullgraph=True, backend="aot_eager")
    assert torch.equal(compiled(x), layer(x))


# ---------------------------------------------------------------------------------------
# GGUFEmbedding
# ---------------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("qtype", QTYPES)
def test_embedding_forward_equals_dense_embedding(qtype, dtype):
    n, k = 33, 64
    weight, ref = _weight(qtype, n, k, seed=11)
    emb = GGUFEmbedding.from_weight(weight, dtype=dtype)
    assert (emb.num_embeddings, emb.embedding_dim, emb.dtype) == (n, k, dtype)
    for ids in (torch.tensor([0, 32, 5, 5]), torch.randint(0, n, (2, 7)), torch.tensor([[3]], dtype=torch.int32)):
        out = emb(ids)
        assert out.shape == (*ids.shape, k) and out.dtype == dtype
        assert torch.equal(out, F.embedding(ids.long(), ref.to(dtype)))
    empty = emb(torch.zeros(0, 4, dtype=torch.long))
    assert empty.shape == (0, 4, k) and empty.dtype == dtype


def test_embedding_follows_model_dtype_and_validates():
    weight, ref = _weight("Q8_0", 20, 32)
    emb = GGUFEmbedding.from_weight(weight, padding_idx=-1)
    assert emb.padding_idx == 19 and emb.dtype == torch.get_default_dtype()
    nn.Sequential(emb).to(torch.bfloat16)
    assert emb.dtype == torch.bfloat16 and emb.scale.dtype == torch.float16
    assert torch.equal(emb(torch.tensor([1, 2])), ref[[1, 2]].bfloat16())
    assert "qtype=Q8_0" in repr(emb)
    with pytest.raises(TypeError, match="input_ids"):
        emb(torch.tensor([1.0]))
    with pytest.raises(ValueError, match="padding_idx"):
        GGUFEmbedding.from_weight(weight, padding_idx=20)
    with pytest.raises(TypeError, match="dtype"):
        GGUFEmbedding.from_weight(weight, dtype=torch.int64)
    with pytest.raises(TypeError, match="weight"):
        GGUFEmbedding.from_weight(ref)
    fresh = GGUFEmbedding(20, 32, "Q8_0")
    fresh.load_state_dict(emb.state_dict())
    assert torch.equal(fresh.dequantize(), ref)


def test_embedding_scale_as_transformers_scaled_embeddings():
    weight, ref = _weight("Q5_0", 16, 64)
    scaled = GGUFEmbedding.from_weight(weight, dtype=torch.bfloat16, embed_scale=torch.tensor(8.0, dtype=torch.bfloat16))
    ids = torch.tensor([[0, 15, 3]])
    # Gemma's forward: nn.Embedding.forward(ids) * embed_scale.to(weight.dtype)
    assert torch.equal(scaled(ids), F.embedding(ids, ref.bfloat16()) * torch.tensor(8.0, dtype=torch.bfloat16))
    assert "embed_scale" not in scaled.state_dict() and "scaled" in repr(scaled)
    nn.Sequential(scaled).to(torch.float16)
    assert scaled.embed_scale.dtype == torch.float16 and scaled(ids).dtype == torch.float16
    by_number = GGUFEmbedding.from_weight(weight, embed_scale=0.5)
    assert torch.equal(by_number(ids), F.embedding(ids, ref) * 0.5)
    with pytest.raises(ValueError, match="embed_scale"):
        GGUFEmbedding.from_weight(weight, embed_scale=torch.ones(2))
    with pytest.raises(TypeError, match="embed_scale"):
        GGUFEmbedding.from_weight(weight, embed_scale="2")


def test_embedding_compile_fullgraph_no_graph_break():
    weight, _ = _weight("Q4_1", 50, 64)
    emb = GGUFEmbedding.from_weight(weight)
    ids = torch.randint(0, 50, (2, 9))
    compiled = torch.compile(emb, fullgraph=True, backend="aot_eager")
    assert torch.equal(compiled(ids), emb(ids))


# ---------------------------------------------------------------------------------------
# 8-bit activations
# ---------------------------------------------------------------------------------------


def test_q8_1_activations_follow_llama_cpp():
    """da = amax / 127, qa = round half away from zero, sa = the block's sum; a zero block is zero."""
    x = torch.zeros(2, 64)
    x[0, :4] = torch.tensor([1.0, 0.5 / 127, -1.5 / 127, 2.5 / 127])
    x[1] = torch.randn(64)
    a = gf.quantize_activations(x)
    assert a.qs[0, :4].tolist() == [127, 1, -2, 3] and a.qs.dtype == torch.int8
    assert torch.equal(a.qs[0, 32:], torch.zeros(32, dtype=torch.int8)) and a.scale[0, 1] == 0
    blocks = x[1].reshape(2, 32)
    torch.testing.assert_close(a.scale[1].float(), (blocks.abs().amax(1) / 127).half().float())
    torch.testing.assert_close(a.sums[1].float(), blocks.sum(1).half().float())
    with pytest.raises(ValueError, match="multiple of the block size"):
        gf.quantize_activations(torch.randn(2, 40))
    y = torch.randn(1, 64)
    y[0, 3] = float("nan")
    b = gf.quantize_activations(y)  # a NaN block: scale NaN, values 0; the other block untouched
    assert b.scale[0, 0].isnan() and not b.qs[0, :32].any() and not b.scale[0, 1].isnan()


@pytest.mark.parametrize("qtype", QTYPES)
def test_matmul_a8_is_the_seed_formula(qtype):
    """Per block: sumi = integer dot of the stored levels and qa; Q4_0 dw * (da * sumi - 8 sa),
    Q5_0 ... - 16 sa, Q4_1/Q5_1 dw * da * sumi + m * sa, Q8_0 dw * da * sumi (float64 here)."""
    n, k = 9, 96
    weight, dense = _weight(qtype, n, k, seed=5)
    x = torch.randn(4, k)
    a = gf.quantize_activations(x)
    t = gf.block_type(qtype)
    qw = gf.weight_indices(weight).reshape(n, k // 32, 32).double()
    sumi = torch.einsum("nbi,mbi->mnb", qw, a.qs.reshape(4, k // 32, 32).double())
    dw, da, sa = weight.scale.double()[None], a.scale.double()[:, None], a.sums.double()[:, None]
    if t.has_min:
        per = dw * da * sumi + weight.mins.double()[None] * sa
    else:
        per = dw * (da * sumi - (t.offset if t.bits != 8 else 0) * sa)
    torch.testing.assert_close(gf.matmul_a8(x, weight).double(), per.sum(2), rtol=1e-5, atol=1e-5)
    # and close to the 16-bit product it approximates
    ref = x @ dense.T
    assert ((gf.matmul_a8(x, weight) - ref).norm() / ref.norm()).item() < 0.05


def test_linear_activation_bits_selects_the_8_bit_op():
    weight, _ = _weight("Q4_0", 16, 64, seed=2)
    layer = GGUFLinear.from_weight(weight)
    x = torch.randn(3, 64)
    assert layer.activation_bits == 16 and torch.equal(layer(x), gf.matmul(x, weight))
    layer.activation_bits = 8
    assert torch.equal(layer(x), gf.matmul_a8(x, weight)) and "activation_bits=8" in repr(layer)
    with pytest.raises(ValueError, match="activation_bits must be 8 or 16"):
        layer.activation_bits = 4
    with pytest.raises(ValueError, match="activation_bits"):
        GGUFLinear(64, 16, "Q4_0", activation_bits=True)


def test_public_functions_name_a_weight_that_is_not_a_gguf_weight_and_a_bad_bias():
    dense = torch.randn(8, 64)
    for fn in (gf.dequantize, gf.join_blocks, gf.weight_indices):
        with pytest.raises(TypeError, match="weight must be a GGUFWeight"):
            fn(dense)
    for fn in (gf.matmul, gf.matmul_a8):
        with pytest.raises(TypeError, match="weight must be a GGUFWeight"):
            fn(torch.randn(2, 64), dense)
    weight, _ = _weight("Q8_0", 8, 64)
    for fn in (gf.matmul, gf.matmul_a8):
        with pytest.raises(ValueError, match=r"bias must be a floating-point \[8\]"):
            fn(torch.randn(2, 64), weight, torch.zeros(9))


@pytest.mark.parametrize("activation_bits", [16, 8])
def test_gguf_linear_under_autocast_returns_x_dtype_as_its_fake_kernel_says(activation_bits: int) -> None:
    """The reference ran F.linear with CPU autocast on, so eager gave bf16 where the fake kernel
    (torch.compile) and the docstring give x's dtype."""
    torch.manual_seed(0)
    weight, _ = _weight("Q4_0", 16, 64)
    layer = GGUFLinear.from_weight(weight)
    layer.activation_bits = activation_bits
    x = torch.randn(3, 64)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        y = layer(x)
    assert y.dtype == torch.float32
    torch.testing.assert_close(y, layer(x))


def test_gguf_layers_name_bad_inputs() -> None:
    with pytest.raises(TypeError, match="x must be a floating-point torch.Tensor"):
        GGUFLinear(64, 16, "Q8_0")([0.0] * 64)
    with pytest.raises(ValueError, match="embedding_dim=40 is not a multiple"):
        GGUFEmbedding(8, 40, "Q4_0")
