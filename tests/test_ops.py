"""The op layer on CPU: schemas, fake implementations, reference implementations, compile."""

from __future__ import annotations

import pytest
import torch

import kbit_linear  # noqa: F401  (registers the ops)
from kbit_linear import format as fmt

ops = torch.ops.kbit_linear


def _layer(n: int, k: int, bits: int, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(n, k, generator=g)
    return w, fmt.quantize(w, bits)


@pytest.mark.parametrize("bits", fmt.SUPPORTED_BITS)
def test_quantize_and_repack_ops_match_reference(bits):
    w, qw = _layer(130, 100, bits)
    cb = fmt.create_normal_float_codebook(bits)
    ts = fmt.compute_tensor_scale(w)
    pf, af = ops.quantize(w, cb, ts, bits)
    rp, ra, _ = fmt.quantize_blockwise(w, bits, cb, ts)
    assert torch.equal(pf, rp) and torch.equal(af, ra)
    p, a = ops.repack(pf, af, bits)
    assert torch.equal(p, qw.packed) and torch.equal(a, qw.absmax)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_dequantize_and_gemm_ops_match_reference(dtype):
    w, qw = _layer(33, 100, 3, seed=1)
    d = ops.dequantize(qw.packed, qw.absmax, qw.codebook, qw.tensor_scale, 3, 33, 100, dtype)
    assert d.dtype == dtype and torch.equal(d, fmt.dequantize(qw, dtype))
    x = torch.randn(2, 4, 100).to(dtype)
    bias = torch.randn(33).to(dtype)
    y = ops.gemm(x, qw.packed, qw.absmax, qw.codebook, qw.tensor_scale, 3, 33, bias)
    # the CPU backend sums in another order than the reference: equal within float32 rounding
    torch.testing.assert_close(y, fmt.matmul(x, qw, bias), **({"rtol": 1e-5, "atol": 1e-5} if dtype == torch.float32 else {}))


def test_opcheck_all_ops():
    w, qw = _layer(40, 96, 2, seed=2)
    cb, ts = qw.codebook, qw.tensor_scale
    pf, af = ops.quantize(w, cb, ts, 2)
    x = torch.randn(3, 96)
    for op, args in [
        (ops.quantize.default, (w, cb, ts, 2)),
        (ops.repack.default, (pf, af, 2)),
        (ops.dequantize.default, (qw.packed, qw.absmax, cb, ts, 2, 40, 96, torch.float32)),
        (ops.gemm.default, (x, qw.packed, qw.absmax, cb, ts, 2, 40, None)),
        (ops.gemm.default, (x, qw.packed, qw.absmax, cb, ts, 2, 40, torch.randn(40))),
    ]:
        torch.library.opcheck(op, args, test_utils=("test_schema", "test_faketensor"))


def test_fake_shapes_on_meta():
    qw = fmt.quantize(torch.randn(300, 200), 5)
    meta = lambda t: t.to("meta")  # noqa: E731
    y = ops.gemm(torch.empty(7, 3, 200, device="meta", dtype=torch.bfloat16), meta(qw.packed), meta(qw.absmax),
                 meta(qw.codebook), meta(qw.tensor_scale), 5, 300, None)
    assert y.shape == (7, 3, 300) and y.dtype == torch.bfloat16
    pf, af = ops.quantize(torch.empty(300, 200, device="meta"), meta(qw.codebook), meta(qw.tensor_scale), 5)
    assert pf.shape == (300, 7, 5) and af.shape == (300, 7)
    p, a = ops.repack(pf, af, 5)
    assert p.shape == qw.packed.shape and a.shape == qw.absmax.shape


@pytest.mark.parametrize("bits", fmt.SUPPORTED_BITS)
@pytest.mark.parametrize("n, k", [(1, 1), (129, 65), (300, 200)], ids=str)
@pytest.mark.parametrize("device", ["cpu", "meta"])
def test_tiled_shapes_match_what_the_ops_produce(bits, n, k, device):
    w = torch.randn(n, k).to(device)
    cb = fmt.create_normal_float_codebook(bits, device=device)
    pf, af = ops.quantize(w, cb, fmt.compute_tensor_scale(w), bits)
    p, a = ops.repack(pf, af, bits)
    assert (p.shape, a.shape) == fmt.tiled_shapes(n, k, bits)
    assert (p.dtype, a.dtype) == (torch.int32, torch.uint8)
    d = ops.dequantize(p, a, cb, fmt.compute_tensor_scale(w), bits, n, k, torch.float32)
    assert d.shape == (n, k)


def test_quantize_op_checks_metadata_only():
    """Values (NaN, codebook order) are validated once, before the op, by quantize_weight."""
    w = torch.randn(8, 64)
    cb, ts = fmt.create_normal_float_codebook(2), fmt.compute_tensor_scale(w)
    with pytest.raises(TypeError, match="floating-point"):
        ops.quantize(w.to(torch.int32), cb, ts, 2)
    with pytest.raises(ValueError, match="2-D"):
        ops.quantize(w[0], cb, ts, 2)
    with pytest.raises(ValueError, match=r"shape \[4\]"):
        ops.quantize(w, cb[:3], ts, 2)
    with pytest.raises(ValueError, match="bits must be one of"):
        ops.quantize(w, cb, ts, 6)
    # a weight with NaN passes the op's checks (no pass over the data, no host sync)
    w[0, 0] = float("nan")
    pf, af = ops.quantize(w, cb, ts, 2)
    assert pf.shape == (8, 2, 2) and af.shape == (8, 2)


@pytest.mark.parametrize(
    "mutate, match",
    [
        (lambda a: a.update(bits=4), "bits=4"),
        (lambda a: a.update(bits=7), "bits must be one of"),
        (lambda a: a.update(x=torch.randn(3, 50)), "last dimension 50"),
        (lambda a: a.update(out_features=400), "out_features=400"),
        (lambda a: a.update(codebook=torch.zeros(16)), r"shape \[8\]"),
        (lambda a: a.update(codebook=torch.zeros(8, dtype=torch.float64)), "float32"),
        (lambda a: a.update(tensor_scale=torch.ones(2)), "tensor_scale"),
        (lambda a: a.update(absmax=torch.zeros(3, 2, 128, 2, dtype=torch.int32)), "uint8"),
        (lambda a: a.update(packed=torch.zeros(5, 3, 128, 2, 3, dtype=torch.int32)), "absmax shape"),
        (lambda a: a.update(bias=torch.zeros(7)), r"bias must have shape \[300\]"),
        (lambda a: a.update(x=torch.randint(0, 3, (3, 200))), "floating point"),
    ],
    ids=["bits-mismatch", "bits-range", "x-width", "out-features", "codebook-size", "codebook-dtype",
         "tensor-scale", "absmax-dtype", "packed-shape", "bias-shape", "x-int"],
)
def test_gemm_rejects_bad_arguments(mutate, match):
    qw = fmt.quantize(torch.randn(300, 200), 3)
    args = dict(x=torch.randn(3, 200), packed=qw.packed, absmax=qw.absmax, codebook=qw.codebook,
                tensor_scale=qw.tensor_scale, bits=3, out_features=300, bias=None)
    mutate(args)
    with pytest.raises((ValueError, TypeError), match=match):
        ops.gemm(**args)


def test_compile_fullgraph_no_graph_break():
    qw = fmt.quantize(torch.randn(64, 96), 4)

    def f(x):
        return torch.relu(ops.gemm(x, qw.packed, qw.absmax, qw.codebook, qw.tensor_scale, 4, 64, None)) * 2

    x = torch.randn(5, 96)
    compiled = torch.compile(f, fullgraph=True, backend="aot_eager")
    assert torch.equal(compiled(x), f(x))


@pytest.mark.parametrize("with_bias", [False, True])
def test_gemm_backward_matches_dense(with_bias):
    w, qw = _layer(33, 100, 4, seed=5)
    x = torch.randn(2, 3, 100, requires_grad=True)
    bias = torch.randn(33, requires_grad=True) if with_bias else None
    y = ops.gemm(x, qw.packed, qw.absmax, qw.codebook, qw.tensor_scale, 4, 33, bias)
    g = torch.randn_like(y)
    y.backward(g)
    w_hat = fmt.dequantize(qw)
    assert torch.allclose(x.grad, g @ w_hat, rtol=1e-5, atol=1e-5)
    if with_bias:
        assert torch.allclose(bias.grad, g.reshape(-1, 33).sum(0), rtol=1e-5, atol=1e-5)


def test_gemm_autograd_opcheck():
    _, qw = _layer(40, 64, 3, seed=6)
    x = torch.randn(3, 64, requires_grad=True)
    bias = torch.randn(40, requires_grad=True)
    torch.library.opcheck(ops.gemm.default, (x, qw.packed, qw.absmax, qw.codebook, qw.tensor_scale, 3, 40, bias),
                          test_utils=("test_autograd_registration",))


def test_eager_registrations_check_their_arguments():
    from kbit_linear import _ops

    for register in (_ops.register_eager_gemm, _ops.register_eager_dequantize, _ops.register_eager_rotate):
        with pytest.raises(TypeError, match="fn must be callable"):
            register("cuda", 3)
        with pytest.raises(ValueError, match="device_type"):
            register("tpu", lambda *a: None)
    with pytest.raises(ValueError, match="device_type must be 'cuda'"):
        _ops.register_eager_dequantize("cpu", lambda *a: None)  # the eager autograd path is CUDA's only


def test_needs_gradient_traces_under_compile():
    """KbitExperts' forward asks needs_gradient inside torch.compile(fullgraph=True): it must be
    plain Python to dynamo (torch._C._any_requires_grad was a graph break, an error under fullgraph)."""
    from kbit_linear import _ops

    def f(w: torch.Tensor, ws: list[torch.Tensor]) -> torch.Tensor:
        return w * 3 if _ops.needs_gradient(w, ws, 2) else w * 2

    compiled = torch.compile(f, backend="eager", fullgraph=True)
    plain = torch.ones(3)
    assert torch.equal(compiled(plain, [plain]), plain * 2)
    assert torch.equal(compiled(torch.ones(3, requires_grad=True), [plain]).detach(), plain * 3)
    assert torch.equal(compiled(plain, [torch.ones(3, requires_grad=True)]), plain * 3)
    with torch.no_grad():
        assert torch.equal(compiled(torch.ones(3, requires_grad=True), [plain]), plain * 2)
