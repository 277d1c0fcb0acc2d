"""``kbit_linear::experts_one_token``: one token through a mixture-of-experts layer's kbit experts.

The spec is its composition of the grouped ops (route, grouped SwiGLU, grouped GEMM, combine);
on CPU the op is that composition and must match the module's reference forward. On a GPU the
two kernels of ``kernels/experts_token.cu`` are checked against the same composition run on the
CPU in float32 (every width, both layouts at 4 and 5 bits, fp16 and bf16, odd shapes, slots to
no expert, the same expert twice, int32 ids, fp32 and half routing weights), with the allocator's
cache poisoned so that unwritten output shows; the calls the kernels do not take run the
composition; and the module at one token runs the kernels, also under CUDA-graph capture.
"""

from __future__ import annotations

import copy

import pytest
import torch

from kbit_linear import _grouped_ops
from kbit_linear import format as fmt
from kbit_linear import weight_layout
from kbit_linear.experts import KbitExperts, quantize_experts_weight
from kbit_linear.quantizer import KbitTensors

OP = torch.ops.kbit_linear.experts_one_token


def _projections(experts: int, hidden: int, inter: int, bits: int, seed: int = 0, device: str = "cpu"):
    """Stacked gate_up ``[E, 2I, H]`` and down ``[E, H, I]`` kbit tensors of random weights
    (quantized on ``device``)."""
    g = torch.Generator().manual_seed(seed)
    gate_up = torch.randn(experts, 2 * inter, hidden, generator=g) * 0.05
    down = torch.randn(experts, hidden, inter, generator=g) * 0.05
    return (tuple(quantize_experts_weight(gate_up.to(device), bits)),
            tuple(quantize_experts_weight(down.to(device), bits)))


def _routing(experts: int, top_k: int, case: str, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    index = torch.randperm(experts, generator=g)[:top_k].view(1, top_k)
    weights = torch.rand(1, top_k, generator=g)
    if case == "sentinel" and top_k > 1:  # one slot to no expert (id E)
        index[0, 1] = experts
    elif case == "twice" and top_k > 1:  # the same expert in two slots
        index[0, 1] = index[0, 0]
    return index, weights


def _call(x, index, weights, gate_up, down, bits, inter):
    return OP(x, index, weights, *gate_up, *down, bits, inter)


# ---------------------------------------------------------------------------------------
# CPU: the composition against the module's reference forward, bad arguments
# ---------------------------------------------------------------------------------------


@pytest.mark.parametrize("case", ["random", "sentinel", "twice"])
@pytest.mark.parametrize("bits", fmt.SUPPORTED_BITS)
def test_the_op_on_cpu_is_the_modules_reference_forward(bits, case):
    experts, hidden, inter, top_k = 6, 72, 48, 3
    gate_up, down = _projections(experts, hidden, inter, bits, seed=bits)
    module = KbitExperts(experts, hidden, inter, bits)
    for proj, tensors in (("gate_up_proj", gate_up), ("down_proj", down)):
        module.set_projection(proj, KbitTensors(*tensors))
    x = torch.randn(1, hidden, generator=torch.Generator().manual_seed(1))
    index, weights = _routing(experts, top_k, case)
    got = _call(x, index, weights, gate_up, down, bits, inter)
    assert got.shape == (1, hidden) and got.dtype == torch.float32
    torch.testing.assert_close(got, module(x, index, weights), rtol=1e-5, atol=1e-6)


def _good_args():
    gate_up, down = _projections(3, 64, 32, 4)
    index, weights = _routing(3, 2, "random")
    return [torch.randn(1, 64), index, weights, *gate_up, *down, 4, 32]


@pytest.mark.parametrize(
    "edit, error, match",
    [
        (lambda a: a.__setitem__(0, torch.randn(2, 64)), ValueError, "x must be"),
        (lambda a: a.__setitem__(0, torch.zeros(1, 64, dtype=torch.int32)), ValueError, "x must be"),
        (lambda a: a.__setitem__(1, a[1].float()), ValueError, "top_k_index must be"),
        (lambda a: a.__setitem__(2, torch.rand(1, 3)), ValueError, "top_k_weights must be"),
        (lambda a: a.__setitem__(12, 0), ValueError, "intermediate"),
        (lambda a: a.__setitem__(12, 96), ValueError, "out_features"),
        (lambda a: a.__setitem__(3, a[3][:2]), ValueError, "gate_up_absmax|down_packed holds"),
        (lambda a: a.__setitem__(5, a[5][:8]), TypeError, "gate_up_codebook"),
        (lambda a: a.__setitem__(10, a[10].double()), TypeError, "down_tensor_scale"),
        (lambda a: a.__setitem__(11, 7), (TypeError, ValueError), "bits"),
    ],
)
def test_bad_arguments_are_named(edit, error, match):
    args = _good_args()
    edit(args)
    with pytest.raises(error, match=match):
        OP(*args)


def test_the_fake_kernel_gives_the_shape():
    args = _good_args()
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode() as mode:
        fake = [mode.from_tensor(a) if isinstance(a, torch.Tensor) else a for a in args]
        out = OP(*fake)
    assert out.shape == (1, 64) and out.dtype == torch.float32


# ---------------------------------------------------------------------------------------
# GPU: the kernels against the CPU composition
# ---------------------------------------------------------------------------------------


def _needs_cuda_kernels():
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    from kbit_linear.backends.cuda import loader

    if not loader.cupy_available():
        pytest.skip("needs CuPy")


def _poison_cache(numel: int, dtype: torch.dtype) -> None:
    """Leave NaN in the allocator's cache, where the op's outputs will be carved from."""
    torch.full((numel + 4096,), float("nan"), dtype=dtype, device="cuda")


def _to_cuda(tensors, bits, pairs):
    """The tensors on the GPU, ``packed`` as pair codes (``pairs``) or bit-planes."""
    packed, absmax, codebook, tensor_scale = (t.cuda() for t in tensors)
    packed = weight_layout.device_form(packed, bits) if pairs else weight_layout.storage_form(packed)
    return packed, absmax, codebook, tensor_scale


def _kernel_ran(fn) -> bool:
    """Whether calling ``fn`` launched the one-token gate_up kernel."""
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    return any("kbit_token_gate_up" in e.name for e in prof.events())


# (experts, hidden, intermediate, top_k): Qwen3-MoE-like, Mixtral-like, odd sizes (a hidden size
# that is not a multiple of 8 or of 16, a half chunk of k, one slot, the most slots)
SHAPES = [(16, 2048, 768, 8), (4, 4096, 1408, 2), (5, 100, 48, 3), (3, 72, 80, 1), (6, 200, 16, 4), (20, 264, 112, 16)]


@pytest.mark.cuda
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "x".join(map(str, s)))
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=str)
@pytest.mark.parametrize("bits, pairs", [(2, False), (3, False), (4, False), (4, True), (5, False), (5, True)])
def test_cuda_kernels_match_the_float32_composition(bits, pairs, dtype, shape):
    """The two kernels (at any expert size) against the op's composition in float32 (the grouped
    ops' references, on the GPU) and against the grouped kernels in the same dtype."""
    _needs_cuda_kernels()
    from kbit_linear.backends.cuda import experts_token

    experts, hidden, inter, top_k = shape
    gate_up, down = _projections(experts, hidden, inter, bits, seed=hidden + bits, device="cuda")
    gate_up, down = _to_cuda(gate_up, bits, pairs), _to_cuda(down, bits, pairs)
    for case, wdtype, idtype in (("random", dtype, torch.int64), ("sentinel", torch.float32, torch.int32),
                                 ("twice", dtype, torch.int64)):
        index, weights = _routing(experts, top_k, case, seed=top_k)
        index, weights = index.to("cuda", idtype), weights.to("cuda", wdtype)
        x = torch.randn(1, hidden, generator=torch.Generator().manual_seed(3)).to("cuda", dtype)
        ref = _call(x.float(), index, weights.float(), gate_up, down, bits, inter)
        _poison_cache(top_k * inter + hidden, dtype)
        assert experts_token.token_kernels_take(x, top_k, inter, weights.dtype, bits, any_size=True)
        got = experts_token.run_token_kernels(x, index, weights, *gate_up, *down, bits, inter)
        assert got.shape == (1, hidden) and got.dtype == dtype and got.is_cuda
        assert not got.isnan().any(), case
        err = float((got.float() - ref).norm() / ref.norm().clamp_min(1e-12))
        assert err < 2e-2, (case, err)
        grouped = _grouped_ops.experts_one_token_composed(x, index, weights, *gate_up, *down, bits, inter)
        assert float((got.float() - grouped.float()).norm() / grouped.float().norm().clamp_min(1e-12)) < 1e-2, case


@pytest.mark.cuda
def test_cuda_kernels_run_where_they_take_the_call_and_the_composition_elsewhere():
    _needs_cuda_kernels()
    experts, hidden, bits = 20, 64, 4
    from kbit_linear.backends.cuda import tuning

    big = tuning.TOKEN_EXPERTS_MAX_GATE_UP_WEIGHTS // (2 * hidden) + 16  # one expert's gate_up over the bound
    for inter, top_k, wdtype, taken in ((32, 4, torch.bfloat16, True), (40, 4, torch.bfloat16, False),
                                        (32, 17, torch.bfloat16, False), (32, 4, torch.float16, False),
                                        (big, 2, torch.bfloat16, False)):
        gate_up, down = _projections(4 if inter == big else experts, hidden, inter, bits, device="cuda")
        gate_up, down = _to_cuda(gate_up, bits, True), _to_cuda(down, bits, True)
        index, weights = _routing(gate_up[0].shape[0], top_k, "random")
        x = torch.randn(1, hidden, device="cuda", dtype=torch.bfloat16)
        args = (x, index.cuda(), weights.to(wdtype).cuda(), *gate_up, *down, bits, inter)
        assert _kernel_ran(lambda: OP(*args)) == taken, (inter, top_k, wdtype)
        ref = _grouped_ops.experts_one_token_composed(*args)
        got = OP(*args)
        assert float((got.float() - ref.float()).norm() / ref.float().norm()) < 1e-2


@pytest.mark.cuda
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=str)
def test_cuda_module_at_one_token_runs_the_kernels_also_in_a_graph(dtype):
    _needs_cuda_kernels()
    experts, hidden, inter, top_k, bits = 8, 256, 96, 2, 4
    gate_up, down = _projections(experts, hidden, inter, bits)
    module = KbitExperts(experts, hidden, inter, bits)  # on the CPU: the reference
    module.set_projection("gate_up_proj", KbitTensors(*gate_up))
    module.set_projection("down_proj", KbitTensors(*down))
    gpu = copy.deepcopy(module).cuda()
    x = torch.randn(1, hidden, device="cuda", dtype=dtype)
    index, weights = (t.cuda() for t in _routing(experts, top_k, "random"))
    assert _kernel_ran(lambda: gpu(x, index, weights))
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = gpu(x, index, weights)
    for seed in range(3):
        new_index, new_weights = _routing(experts, top_k, "random", seed=seed + 5)
        index.copy_(new_index)
        weights.copy_(new_weights)
        x.copy_(torch.randn(1, hidden, generator=torch.Generator().manual_seed(seed)).to(x))
        graph.replay()
        torch.cuda.synchronize()
        ref = module(x.float().cpu(), new_index, new_weights)
        assert float((out.float().cpu() - ref).norm() / ref.norm()) < 2e-2
        assert torch.equal(out, gpu(x, index, weights))  # eager gives the same bits
