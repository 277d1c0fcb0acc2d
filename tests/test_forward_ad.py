"""Forward-mode AD (``torch.func.jvp``, ``torch.autograd.forward_ad``) and the torch.func
transforms through the quantized layers, on CPU (KbitLinear plain and Hadamard-rotated,
GGUFLinear, ``combine_experts``, KbitExperts' reference path): the tangent of an op linear in
its input is the op on the tangent (the frozen weight takes none), a tangent of the frozen
weight is refused by name, and reverse mode and torch.compile still work through the ops."""

from __future__ import annotations

import pytest
import torch
import torch.autograd.forward_ad as fwAD
import torch.func as F
from torch import nn

from kbit_linear import _grouped_ops, _ops
from kbit_linear.linear import KbitLinear

ops = torch.ops.kbit_linear
DTYPES = [torch.float32, torch.bfloat16]
SHAPES = [(3, 64), (2, 3, 64)]  # 2-D and 3-D inputs
# bf16 tangents go through a bf16 rotation and a bf16-rounded product
TOL = {torch.float32: dict(rtol=1e-5, atol=1e-5), torch.bfloat16: dict(rtol=2e-2, atol=5e-2)}


def _layer(hadamard: bool, bias: bool = True, seed: int = 0) -> KbitLinear:
    torch.manual_seed(seed)
    return KbitLinear.from_linear(nn.Linear(64, 32, bias=bias), bits=4, hadamard=hadamard)


def _inputs(shape: tuple[int, ...], dtype: torch.dtype, seed: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(shape, generator=g).to(dtype), torch.randn(shape, generator=g).to(dtype)


def _op_on_tangent(q: KbitLinear, t: torch.Tensor, bias_t: torch.Tensor | None = None) -> torch.Tensor:
    """The layer's ops applied to a tangent: the rotation (if any), then gemm with the bias's tangent."""
    if q.hadamard_signs is not None:
        t = ops.hadamard_rotate(t, q.hadamard_signs)
    return ops.gemm(t, q.weight, q.absmax, q.codebook, q.tensor_scale, q.bits, q.out_features, bias_t)


def _forward_ad(fn, x: torch.Tensor, t: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    with fwAD.dual_level():
        primal, tangent = fwAD.unpack_dual(fn(fwAD.make_dual(x, t)))
    return primal, tangent


def _jvp(mode: str, fn, x: torch.Tensor, t: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    return F.jvp(fn, (x,), (t,)) if mode == "func" else _forward_ad(fn, x, t)


# ---------------------------------------------------------------------------------------
# KbitLinear: gemm and hadamard_rotate
# ---------------------------------------------------------------------------------------


@pytest.mark.parametrize("mode", ["func", "forward_ad"])
@pytest.mark.parametrize("shape", SHAPES, ids=str)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("hadamard", [False, True], ids=["plain", "hadamard"])
def test_the_tangent_is_the_layers_linear_map_on_the_tangent(hadamard, dtype, shape, mode):
    q = _layer(hadamard).to(dtype)
    x, t = _inputs(shape, dtype)
    primal, tangent = _jvp(mode, q, x, t)
    assert tangent is not None and tangent.shape == (*shape[:-1], 32) and tangent.dtype == dtype
    assert torch.equal(tangent, _op_on_tangent(q, t))  # the same ops, the same roundings, no bias
    torch.testing.assert_close(tangent.float(), t.float() @ q.dequantize().T, **TOL[dtype])
    torch.testing.assert_close(primal, q(x), **TOL[dtype])
    assert tangent.abs().max() > 0.1  # (not the zero tangent the op's old autograd gave)


@pytest.mark.parametrize("mode", ["func", "forward_ad"])
def test_a_bias_tangent_adds_to_the_inputs_and_stands_alone(mode):
    q = _layer(hadamard=False)
    x, t = _inputs((2, 3, 64), torch.float32)
    bias_t = torch.randn(32, generator=torch.Generator().manual_seed(5))
    bias = q.bias.detach()

    def with_bias(x, b):
        return torch.func.functional_call(q, {"bias": b}, (x,))

    if mode == "func":
        _, both = F.jvp(with_bias, (x, bias), (t, bias_t))
        _, alone = F.jvp(lambda b: with_bias(x, b), (bias,), (bias_t,))
    else:
        with fwAD.dual_level():
            both = fwAD.unpack_dual(with_bias(fwAD.make_dual(x, t), fwAD.make_dual(bias, bias_t))).tangent
            alone = fwAD.unpack_dual(with_bias(x, fwAD.make_dual(bias, bias_t))).tangent
    assert torch.equal(both, _op_on_tangent(q, t, bias_t))
    assert torch.equal(alone, bias_t.expand(2, 3, 32))


@pytest.mark.parametrize("hadamard", [False, True], ids=["plain", "hadamard"])
def test_func_transforms_agree_with_the_dequantized_weight(hadamard):
    """jacfwd (vmap over jvp), jacrev, grad and per-sample grads (the op's backward under
    torch.func, refused before for want of a setup_context), and the nested transforms: jvp of
    grad, grad of jvp and the Hessian of ``|q(x)|^2``, ``2 W^T W``."""
    q = _layer(hadamard)
    w = q.dequantize()
    x, t = _inputs((64,), torch.float32)
    close = dict(rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(F.jacfwd(q)(x), w, **close)
    torch.testing.assert_close(F.jacrev(q)(x), w, **close)
    torch.testing.assert_close(F.grad(lambda x: q(x).sum())(x), w.sum(0), **close)

    def energy(x):
        return q(x).pow(2).sum()

    xs = torch.randn(5, 64, generator=torch.Generator().manual_seed(2))
    torch.testing.assert_close(F.vmap(F.grad(energy))(xs), 2 * q(xs) @ w, **close)
    hessian = 2 * w.T @ w
    _, hvp = F.jvp(F.grad(energy), (x,), (t,))
    torch.testing.assert_close(hvp, hessian @ t, **close)
    torch.testing.assert_close(F.grad(lambda x: F.jvp(energy, (x,), (t,))[1])(x), hessian @ t, **close)
    torch.testing.assert_close(F.hessian(energy)(x), hessian, **close)


def test_reverse_mode_still_reaches_the_input_and_the_bias():
    q = _layer(hadamard=True)
    x = torch.randn(2, 3, 64, requires_grad=True)
    y = q(x)
    g = torch.randn_like(y)
    y.backward(g)
    torch.testing.assert_close(x.grad, g @ q.dequantize(), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(q.bias.grad, g.reshape(-1, 32).sum(0), rtol=1e-5, atol=1e-5)


def test_a_tangent_of_the_frozen_weight_is_refused_by_name():
    q = _layer(hadamard=False)
    x = torch.randn(3, 64)
    codebook = q.codebook.clone()
    with pytest.raises(NotImplementedError, match="forward-mode AD through kbit_linear::gemm.*codebook"):
        F.jvp(lambda c: torch.func.functional_call(q, {"codebook": c}, (x,)), (codebook,), (torch.ones_like(codebook),))
    with fwAD.dual_level(), pytest.raises(NotImplementedError, match="kbit_linear::gemm.*tensor_scale"):
        scale = fwAD.make_dual(q.tensor_scale.clone(), torch.ones(1))
        torch.func.functional_call(q, {"tensor_scale": scale}, (x,))


def test_the_eager_fast_path_steps_aside_under_forward_ad(monkeypatch):
    """The CPU backend's direct entry bypasses the op's autograd: with a dual level open the
    call takes the op (the backend's torch ops have no forward-AD formula for all they use)."""
    calls = []
    fast = _ops._eager_gemm.get("cpu")
    if fast is None:
        pytest.skip("no CPU fast path registered")
    monkeypatch.setitem(_ops._eager_gemm, "cpu", lambda *a: calls.append(1) or fast(*a))
    q = _layer(hadamard=False, bias=False)
    x, t = _inputs((3, 64), torch.float32)
    q(x)
    assert calls == [1]  # (the path is taken outside forward AD)
    _, tangent = _forward_ad(q, x, t)
    assert calls == [1] and torch.equal(tangent, _op_on_tangent(q, t))
    assert not _ops.forward_ad_active()


@pytest.mark.parametrize("hadamard", [False, True], ids=["plain", "hadamard"])
def test_compiled_forward_and_backward_match_eager(hadamard):
    q = _layer(hadamard)
    x = torch.randn(2, 3, 64, requires_grad=True)
    compiled = torch.compile(q, fullgraph=True, backend="aot_eager")
    y = compiled(x)
    assert torch.equal(y, q(x))
    y.sum().backward()
    torch.testing.assert_close(x.grad, q.dequantize().sum(0).expand(2, 3, 64), rtol=1e-5, atol=1e-5)


def test_opcheck_with_autograd_and_aot_dispatch():
    q = _layer(hadamard=True)
    x = torch.randn(3, 64, requires_grad=True)
    bias = torch.randn(32, requires_grad=True)
    torch.library.opcheck(ops.gemm.default, (x, q.weight, q.absmax, q.codebook, q.tensor_scale, 4, 32, bias))
    # (static only: the rotation's block size is a Python int of in_features, as the layer's is)
    static = ("test_schema", "test_autograd_registration", "test_faketensor", "test_aot_dispatch_static")
    torch.library.opcheck(ops.hadamard_rotate.default, (x, q.hadamard_signs), test_utils=static)


# ---------------------------------------------------------------------------------------
# GGUFLinear and combine_experts
# ---------------------------------------------------------------------------------------


@pytest.mark.parametrize("mode", ["func", "forward_ad"])
@pytest.mark.parametrize("activation_bits", [16, 8])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_gguf_linear_tangent_is_the_product_with_the_dequantized_weight(dtype, activation_bits, mode):
    """gguf_gemm is linear in x; gguf_gemm_a8's activation rounding passes the tangent straight
    through (as its gradient), so both give ``t @ W^T``."""
    gguf = pytest.importorskip("gguf")
    from gguf import quants

    from kbit_linear import gguf_format as gf
    from kbit_linear.gguf_linear import GGUFLinear

    w = torch.randn(16, 64, generator=torch.Generator().manual_seed(3))
    raw = quants.quantize(w.numpy(), gguf.GGMLQuantizationType.Q4_0)
    layer = GGUFLinear.from_weight(gf.split_blocks(torch.from_numpy(raw), "Q4_0", 16, 64), nn.Parameter(torch.randn(16)))
    layer.activation_bits = activation_bits
    x, t = _inputs((2, 3, 64), dtype)
    _, tangent = _jvp(mode, layer, x, t)
    want = ops.gguf_gemm(t.reshape(-1, 64), layer.qs, layer.qh, layer.scale, layer.mins, "Q4_0", 16, None).reshape(2, 3, 16)
    assert tangent.dtype == dtype and torch.equal(tangent, want)
    torch.testing.assert_close(tangent.float(), t.float() @ layer.dequantize().T, **TOL[dtype])


@pytest.mark.parametrize("mode", ["func", "forward_ad"])
def test_combine_experts_tangent_is_bilinear(mode):
    g = torch.Generator().manual_seed(7)
    tokens, top_k, hidden = 4, 2, 8
    y, y_t = torch.randn(tokens * top_k, hidden, generator=g), torch.randn(tokens * top_k, hidden, generator=g)
    w, w_t = torch.rand(tokens, top_k, generator=g), torch.randn(tokens, top_k, generator=g)
    position = torch.randperm(tokens * top_k, generator=g)
    if mode == "func":
        _, tangent = F.jvp(lambda y, w: ops.combine_experts(y, position, w), (y, w), (y_t, w_t))
    else:
        with fwAD.dual_level():
            tangent = fwAD.unpack_dual(ops.combine_experts(fwAD.make_dual(y, y_t), position, fwAD.make_dual(w, w_t))).tangent
    rows, rows_t = y[position].view(tokens, top_k, hidden), y_t[position].view(tokens, top_k, hidden)
    want = (w.unsqueeze(-1) * rows_t + w_t.unsqueeze(-1) * rows).sum(1)
    torch.testing.assert_close(tangent, want, rtol=1e-5, atol=1e-5)


def test_combine_experts_gradients_are_unchanged():
    g = torch.Generator().manual_seed(8)
    y = torch.randn(6, 8, generator=g, requires_grad=True)
    w = torch.rand(3, 2, generator=g, requires_grad=True)
    position = torch.randperm(6, generator=g)
    out = ops.combine_experts(y, position, w)
    grad = torch.randn_like(out)
    gy, gw = torch.autograd.grad(out, (y, w), grad)
    want_y, want_w = torch.autograd.grad(_grouped_ops.combine_experts_reference(y, position, w), (y, w), grad)
    torch.testing.assert_close(gy, want_y)
    torch.testing.assert_close(gw, want_w)


# ---------------------------------------------------------------------------------------
# KbitExperts on CPU: the reference path's gemm calls
# ---------------------------------------------------------------------------------------


@pytest.mark.parametrize("mode", ["func", "forward_ad"])
def test_kbit_experts_tangent_equals_the_dequantized_experts(mode):
    """On CPU the experts run their reference (a gemm pair per expert, the activation in torch
    ops): the tangent equals that of the same experts written densely with the dequantized
    weights (before, the CPU fast path refused forward AD and torch.func.jvp lost the gemm
    tangents)."""
    transformers = pytest.importorskip("transformers")
    from moe_configs import tiny_moe_config

    from kbit_linear.experts import KbitExperts

    torch.manual_seed(0)
    dense = transformers.AutoModelForCausalLM.from_config(tiny_moe_config("qwen3_moe")).model.layers[0].mlp.experts
    kbit = KbitExperts.from_experts(dense, bits=4)
    w = kbit.dequantize()
    gate_up, down = w["gate_up_proj"], w["down_proj"]  # [E, 2I, H], [E, H, I]
    g = torch.Generator().manual_seed(3)
    tokens, top_k = 6, 2
    x, t = torch.randn(tokens, kbit.hidden_dim, generator=g), torch.randn(tokens, kbit.hidden_dim, generator=g)
    index = torch.stack([torch.randperm(kbit.num_experts, generator=g)[:top_k] for _ in range(tokens)])
    weights = torch.rand(tokens, top_k, generator=g)

    def dequantized(x):
        gate, up = torch.einsum("th,tkih->tki", x, gate_up[index]).chunk(2, dim=-1)
        y = torch.einsum("tki,tkhi->tkh", torch.nn.functional.silu(gate) * up, down[index])
        return (weights.unsqueeze(-1) * y).sum(1)

    primal, got = _jvp(mode, lambda x: kbit(x, index, weights), x, t)
    want_primal, want = F.jvp(dequantized, (x,), (t,))
    torch.testing.assert_close(primal, want_primal, rtol=1e-4, atol=1e-5)
    assert got.abs().max() > 0.01
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-5)


@pytest.mark.cuda
@pytest.mark.parametrize("mode", ["func", "forward_ad"])
def test_cuda_kbit_experts_take_the_reference_under_forward_ad(mode):
    """On a GPU the experts' grouped ops have no autograd: with a forward-mode level open the
    module takes its reference (gemm pairs, whose tangents are carried), so the tangent is that
    of the dequantized experts, not zero."""
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    pytest.importorskip("cupy")
    transformers = pytest.importorskip("transformers")
    from moe_configs import tiny_moe_config

    from kbit_linear.experts import KbitExperts

    torch.manual_seed(0)
    dense = transformers.AutoModelForCausalLM.from_config(tiny_moe_config("qwen3_moe")).model.layers[0].mlp.experts
    kbit = KbitExperts.from_experts(dense, bits=4).to("cuda", torch.bfloat16)
    w = {k: v.float() for k, v in kbit.dequantize().items()}
    gate_up, down = w["gate_up_proj"], w["down_proj"]
    g = torch.Generator().manual_seed(3)
    tokens, top_k = 4, 2
    x, t = (torch.randn(tokens, kbit.hidden_dim, generator=g).to("cuda", torch.bfloat16) for _ in range(2))
    index = torch.stack([torch.randperm(kbit.num_experts, generator=g)[:top_k] for _ in range(tokens)]).cuda()
    weights = torch.rand(tokens, top_k, generator=g).to("cuda", torch.bfloat16)

    def dequantized(x):
        gate, up = torch.einsum("th,tkih->tki", x, gate_up[index]).chunk(2, dim=-1)
        y = torch.einsum("tki,tkhi->tkh", torch.nn.functional.silu(gate) * up, down[index])
        return (weights.float().unsqueeze(-1) * y).sum(1)

    _, got = _jvp(mode, lambda x: kbit(x, index, weights), x, t)
    _, want = F.jvp(dequantized, (x.float(),), (t.float(),))
    assert got.float().abs().max() > 0.01
    torch.testing.assert_close(got.float(), want, rtol=5e-2, atol=5e-2)
