"""KbitLinear on CUDA: the eager fast path, autograd guard, and torch.compile with CUDA graphs.

Tolerance: relative Frobenius error against the float32 reference below 2e-2 (fp16/bf16
operands and outputs; the kernels accumulate in float32).
"""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

import kbit_linear

pytestmark = pytest.mark.cuda

if not torch.cuda.is_available():
    pytest.skip("no CUDA device", allow_module_level=True)
try:
    import cupy  # noqa: F401
except ImportError:
    pytest.skip("CuPy is not installed", allow_module_level=True)

DEV = torch.device("cuda")
TOL = 2e-2


def _rel_err(y: torch.Tensor, ref: torch.Tensor) -> float:
    return float((y.float() - ref.float()).norm() / ref.float().norm())


class _Stack(nn.Module):
    """Three quantized layers with odd shapes, the way a decoder block chains them."""

    def __init__(self, bits: int, dtype: torch.dtype) -> None:
        super().__init__()
        torch.manual_seed(bits)
        dense = [nn.Linear(576, 1536), nn.Linear(1536, 200, bias=False), nn.Linear(200, 576)]
        self.layers = nn.ModuleList(
            kbit_linear.KbitLinear.from_linear(d.to(device=DEV, dtype=dtype), bits=bits) for d in dense
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = torch.nn.functional.silu(layer(x))
        return x

    def reference(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            b = None if layer.bias is None else layer.bias.float()
            x = torch.nn.functional.silu(torch.nn.functional.linear(x.float(), layer.dequantize(), b))
        return x


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=["fp16", "bf16"])
@pytest.mark.parametrize("m", [1, 3, 16, 64, 300])
def test_eager_fast_path_matches_reference(dtype, m):
    model = _Stack(4, dtype)
    x = torch.randn(m, 576, device=DEV, dtype=dtype)
    with torch.no_grad():
        fast = model(x)
        op = model.layers[0]  # the op path on the same inputs (dispatcher, no fast path)
        via_op = torch.ops.kbit_linear.gemm(x, op.weight, op.absmax, op.codebook, op.tensor_scale, 4, op.out_features, op.bias)
    assert fast.dtype == dtype and fast.shape == (m, 576)
    assert _rel_err(fast, model.reference(x)) < TOL
    with torch.no_grad():
        assert _rel_err(op(x), via_op) < 1e-3


@pytest.mark.parametrize("m", [2, 300])
def test_gradients_flow_to_input_and_bias(m):
    layer = kbit_linear.KbitLinear.from_linear(nn.Linear(128, 64).to(DEV, torch.float16), bits=3)
    x = torch.randn(m, 128, device=DEV, dtype=torch.float16, requires_grad=True)
    y = layer(x)  # autograd records: the eager autograd path, whose backward uses the dequantized weight
    g = torch.randn_like(y)
    y.backward(g)
    w_hat = layer.dequantize()
    assert _rel_err(x.grad, g.float() @ w_hat) < TOL
    assert _rel_err(layer.bias.grad, g.float().sum(0)) < TOL


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32], ids=["fp16", "bf16", "fp32"])
@pytest.mark.parametrize("shape", [(3, 5, 200, 77, True), (1, 2048, 576, 1536, False), (2, 9, 1000, 333, True)])
def test_eager_autograd_matches_the_op_autograd(monkeypatch, dtype, shape):
    """Training calls take ``_EagerGemm`` (backend functions, no dispatcher); its outputs and
    gradients must be the op path's exactly (same kernels), including bias and odd shapes."""
    from kbit_linear import _ops

    batch, seq, k, n, bias = shape
    torch.manual_seed(k)
    layer = kbit_linear.KbitLinear.from_linear(nn.Linear(k, n, bias=bias).to(DEV, dtype), bits=4)
    calls = []
    fast = _ops._eager_dequantize["cuda"]
    monkeypatch.setitem(_ops._eager_dequantize, "cuda", lambda *a: calls.append(1) or fast(*a))
    x = torch.randn(batch, seq, k, device=DEV, dtype=dtype)
    g = torch.randn(batch, seq, n, device=DEV, dtype=dtype)
    grads = []
    for via_op in (False, True):
        xi = x.clone().requires_grad_(True)
        if layer.bias is not None:
            layer.bias.grad = None
        if via_op:
            y = torch.ops.kbit_linear.gemm(xi, layer.weight, layer.absmax, layer.codebook, layer.tensor_scale, 4, n, layer.bias)
        else:
            y = layer(xi)
        y.backward(g)
        grads.append((y.detach(), xi.grad, None if layer.bias is None else layer.bias.grad.clone()))
    assert calls == [1]  # the eager path ran its own backward once; the op path did not use it
    (y0, gx0, gb0), (y1, gx1, gb1) = grads
    assert y0.dtype == dtype and gx0.dtype == dtype
    torch.testing.assert_close(y0, y1, rtol=0, atol=0)
    torch.testing.assert_close(gx0, gx1, rtol=0, atol=0)
    assert _rel_err(gx0, g.float() @ layer.dequantize()) < TOL
    if bias:
        torch.testing.assert_close(gb0, gb1, rtol=0, atol=0)


def test_eager_autograd_under_checkpointing_matches_plain_backward():
    """Non-reentrant activation checkpointing (QLoRA's recipe) recomputes through the eager path."""
    from torch.utils.checkpoint import checkpoint

    model = _Stack(4, torch.bfloat16)
    x = torch.randn(2, 33, 576, device=DEV, dtype=torch.bfloat16)
    g = torch.randn(2, 33, 576, device=DEV, dtype=torch.bfloat16)
    xa, xb = x.clone().requires_grad_(True), x.clone().requires_grad_(True)
    model(xa).backward(g)
    checkpoint(model, xb, use_reentrant=False).backward(g)
    torch.testing.assert_close(xa.grad, xb.grad, rtol=0, atol=0)
    assert torch.isfinite(xa.grad).all() and xa.grad.abs().sum() > 0


@pytest.mark.parametrize("bits", [2, 4, 5])
@pytest.mark.parametrize("m", [1, 8, 64])
def test_compile_reduce_overhead_cuda_graphs(bits, m):
    dtype = torch.float16
    model = _Stack(bits, dtype)
    compiled = torch.compile(model, mode="reduce-overhead", fullgraph=True)
    with torch.no_grad():
        for step in range(4):  # warm-up, record, then replays
            x = torch.randn(m, 576, device=DEV, dtype=dtype)
            torch.compiler.cudagraph_mark_step_begin()
            y = compiled(x).clone()
            assert _rel_err(y, model.reference(x)) < TOL, f"step {step}"


def test_cuda_graph_capture_replay_of_a_forward():
    model = _Stack(3, torch.bfloat16)
    static_x = torch.randn(4, 576, device=DEV, dtype=torch.bfloat16)
    with torch.no_grad():
        s = torch.cuda.Stream()
        s.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(s):
            model(static_x)  # warm-up (compiles kernels) outside the capture
        torch.cuda.current_stream().wait_stream(s)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            static_y = model(static_x)
        for _ in range(3):
            static_x.copy_(torch.randn_like(static_x))
            graph.replay()
            torch.cuda.synchronize()
            assert _rel_err(static_y, model.reference(static_x)) < TOL


def test_smollm_shaped_llama_forward_matches_cpu_reference():
    transformers = pytest.importorskip("transformers")
    config = transformers.LlamaConfig(
        hidden_size=576, intermediate_size=1536, num_hidden_layers=2, num_attention_heads=9,
        num_key_value_heads=3, vocab_size=1000, tie_word_embeddings=True,
    )
    torch.manual_seed(0)
    cpu = transformers.LlamaForCausalLM(config).eval()
    kbit_linear.quantize_model(cpu, bits=4, progress=False)
    gpu = transformers.LlamaForCausalLM(config).eval()
    kbit_linear.quantize_model(gpu, bits=4, progress=False)
    gpu.load_state_dict(cpu.state_dict())
    gpu = gpu.to(DEV, torch.bfloat16)
    ids = torch.randint(0, 1000, (2, 37))
    with torch.no_grad():
        ref = cpu(ids).logits
        out = gpu(ids.to(DEV)).logits.float().cpu()
    assert _rel_err(out, ref) < 3e-2


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=["fp16", "bf16"])
@pytest.mark.parametrize("m", [1, 5, 300])
def test_hadamard_rotated_layer_on_cuda_matches_the_cpu_layer(dtype, m):
    torch.manual_seed(m)
    dense = nn.Linear(576, 200)
    cpu = kbit_linear.KbitLinear.from_linear(dense, bits=3, hadamard=True)
    gpu = copy.deepcopy(cpu).to(device=DEV, dtype=dtype)
    x = torch.randn(m, 576)
    with torch.no_grad():
        y = gpu(x.to(DEV, dtype))
        ref = cpu(x)
    assert y.dtype == dtype
    assert _rel_err(y.cpu(), ref) < TOL
    # quantized on the GPU (rotation and quantize kernel there): the same layer up to rounding ties
    on_gpu = kbit_linear.KbitLinear.from_linear(dense.to(DEV), bits=3, hadamard=True)
    assert torch.equal(on_gpu.hadamard_signs.cpu(), cpu.hadamard_signs)
    assert _rel_err(on_gpu.dequantize().cpu(), cpu.dequantize()) < 1e-2
