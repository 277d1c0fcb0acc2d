"""CUDA kernels against the pure-PyTorch reference (marker ``cuda``; skipped without a GPU or CuPy).

Tolerances. The quantize and repack kernels must match the reference bit for bit; dequantize
too (it computes ``codebook[idx] * scale`` in fp32 like the reference and rounds once). The GEMM
multiplies fp16/bf16 operands: each dequantized weight is rounded to the activation type
(relative error 2^-11 for fp16, 2^-8 for bf16), products accumulate in fp32 and the output is
rounded once more. Against the fp32 reference ``F.linear(x.float(), dequantize(W))`` the
relative Frobenius error is then about 1e-3 (fp16) and 6e-3 (bf16); the tests allow 5e-3 and
2e-2. Outputs are written into NaN-filled tensors so any element a kernel skips shows up.
"""

from __future__ import annotations

import functools
import itertools

import pytest
import torch
import torch.nn.functional as F

import kbit_linear  # noqa: F401  (op schemas)
from kbit_linear import format as fmt
from kbit_linear.backends import cuda as kcuda
from kbit_linear.backends.cuda import loader, ops

pytestmark = [
    pytest.mark.cuda,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs an NVIDIA GPU"),
    pytest.mark.skipif(not loader.cupy_available(), reason="needs CuPy (pip install 'kbit-linear[cuda]')"),
]

DEV = "cuda"
DTYPES = (torch.float16, torch.bfloat16)
BITS = fmt.SUPPORTED_BITS
REL_TOL = {torch.float16: 5e-3, torch.bfloat16: 2e-2}


def _rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    return ((out.float() - ref.float()).norm() / ref.float().norm().clamp_min(1e-30)).item()


@functools.lru_cache(maxsize=None)
def _weight(n: int, k: int, bits: int) -> fmt.KbitWeight:
    """A quantized random weight on the GPU (cached per shape: quantizing big ones takes a while)."""
    g = torch.Generator(device=DEV).manual_seed(n * 7919 + k * 31 + bits)
    w = torch.randn(n, k, device=DEV, generator=g) * 0.02
    w[: max(1, n // 7), : min(k, 40)] *= 30.0  # uneven block scales
    return fmt.quantize(w, bits)


def _reference(x: torch.Tensor, qw: fmt.KbitWeight, bias: torch.Tensor | None = None) -> torch.Tensor:
    w = fmt.dequantize(qw, torch.float32)
    return F.linear(x.float(), w, None if bias is None else bias.float())


def _gemm(x, qw, bias=None, **kw) -> torch.Tensor:
    out = torch.full((*x.shape[:-1], qw.out_features), float("nan"), dtype=x.dtype, device=x.device)
    res = kcuda.gemm_cuda(x, qw.packed, qw.absmax, qw.codebook, qw.tensor_scale, qw.bits, qw.out_features, bias, out=out, **kw)
    assert res.data_ptr() == out.data_ptr()
    assert not torch.isnan(out).any(), "unwritten (NaN) output elements"
    return out


def _check_gemm(m: int, k: int, n: int, bits: int, dtype: torch.dtype, **kw) -> None:
    qw = _weight(n, k, bits)
    x = torch.randn(m, k, device=DEV, dtype=dtype)
    out = _gemm(x, qw, **kw)
    err = _rel_err(out, _reference(x, qw))
    assert err < REL_TOL[dtype], f"M={m} {k}->{n} bits={bits} {dtype} {kw}: relative error {err:.2e}"


# ---------------------------------------------------------------------------------------
# format kernels: bit-identical
# ---------------------------------------------------------------------------------------

QUANT_SHAPES = [(192, 576), (33, 100), (300, 200), (1, 31), (129, 4096)]


def _interesting_weight(n: int, k: int, dtype: torch.dtype) -> torch.Tensor:
    w = torch.randn(n, k, device=DEV) * torch.logspace(-6, 1, n, device=DEV).unsqueeze(1)
    w[0, : min(k, 32)] = 0.0  # an all-zero block
    if k > 40:
        w[-1, 32:40] = torch.tensor([0.5, -0.5, 1e-30, -1e-38, 3.0, -3.0, 0.0, -0.0], device=DEV)
    return w.to(dtype)


@pytest.mark.parametrize("bits", BITS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16], ids=str)
@pytest.mark.parametrize("shape", QUANT_SHAPES, ids=lambda s: f"{s[0]}x{s[1]}")
def test_quantize_bit_identical(bits, dtype, shape):
    w = _interesting_weight(*shape, dtype)
    ts = fmt.compute_tensor_scale(w)
    cb = fmt.create_normal_float_codebook(bits, DEV)
    packed, absmax = torch.ops.kbit_linear.quantize(w, cb, ts, bits)
    ref_p, ref_a, _ = fmt.quantize_blockwise(w.cpu(), bits, cb.cpu(), ts.cpu())
    assert torch.equal(absmax.cpu(), ref_a)
    assert torch.equal(packed.cpu(), ref_p)


@pytest.mark.parametrize("bits", BITS)
def test_quantize_custom_codebook_and_scale(bits):
    w = torch.randn(70, 333, device=DEV)
    cb = torch.linspace(-0.9, 1.0, 1 << bits, device=DEV)  # asymmetric uniform
    ts = torch.tensor([0.25], device=DEV)  # not the minimal scale: larger codes
    packed, absmax = kcuda.quantize_cuda(w, cb, ts, bits)
    ref_p, ref_a, _ = fmt.quantize_blockwise(w.cpu(), bits, cb.cpu(), ts.cpu())
    assert torch.equal(absmax.cpu(), ref_a) and torch.equal(packed.cpu(), ref_p)


@pytest.mark.parametrize("bits", BITS)
@pytest.mark.parametrize("shape", [(192, 576), (33, 100), (300, 200)], ids=lambda s: f"{s[0]}x{s[1]}")
def test_repack_and_dequantize_bit_identical(bits, shape):
    n, k = shape
    w = torch.randn(n, k, device=DEV)
    pf, af, ts = fmt.quantize_blockwise(w, bits)
    packed, absmax = torch.ops.kbit_linear.repack(pf, af, bits)
    ref_p, ref_a = fmt.tile_blocks(pf.cpu(), af.cpu(), bits)
    assert torch.equal(packed.cpu(), ref_p) and torch.equal(absmax.cpu(), ref_a)
    cb = fmt.create_normal_float_codebook(bits, DEV)
    qw = fmt.KbitWeight(packed, absmax, cb, ts, bits, n, k)
    ref = fmt.dequantize(qw, torch.float32)
    for dtype in (torch.float32, torch.float16, torch.bfloat16):
        got = torch.ops.kbit_linear.dequantize(packed, absmax, cb, ts, bits, n, k, dtype)
        assert got.dtype == dtype and got.shape == (n, k)
        assert torch.equal(got, ref.to(dtype)), f"dequantize {dtype} differs from the reference"


# ---------------------------------------------------------------------------------------
# GEMM against the reference
# ---------------------------------------------------------------------------------------

SMALL_SHAPES = [(576, 192), (100, 33), (200, 300)]  # (in, out)
BIG_SHAPES = [(1536, 576), (4096, 4096), (4096, 14336), (14336, 4096)]
SMALL_M = [1, 2, 3, 7, 16, 17, 64, 100]
BIG_M = [1, 16, 256, 1000, 4096]
# The fused kernel: automatic split, never split, always split (the automatic path is tested
# below; at small M it may take the separate decode kernel).
SPLITS = [{"path": "fused"}, {"path": "fused", "split_k": 1}, {"path": "fused-splitk"}]


def _small_cases():
    for i, (bits, dtype, (k, n), m) in enumerate(itertools.product(BITS, DTYPES, SMALL_SHAPES, SMALL_M)):
        yield pytest.param(m, k, n, bits, dtype, SPLITS[i % 3], id=f"b{bits}-{str(dtype)[6:]}-{k}x{n}-M{m}-{i % 3}")


def _big_cases():
    # Every (bits, dtype) meets every big M once, on a rotating shape: covers all sizes
    # without the full (slow) cross product.
    for i, (bits, dtype) in enumerate(itertools.product(BITS, DTYPES)):
        for j, m in enumerate(BIG_M):
            k, n = BIG_SHAPES[(i + j) % len(BIG_SHAPES)]
            yield pytest.param(m, k, n, bits, dtype, id=f"b{bits}-{str(dtype)[6:]}-{k}x{n}-M{m}")


@pytest.mark.parametrize("m,k,n,bits,dtype,kw", list(_small_cases()))
def test_gemm_small_shapes(m, k, n, bits, dtype, kw):
    _check_gemm(m, k, n, bits, dtype, **kw)


@pytest.mark.parametrize("m,k,n,bits,dtype", list(_big_cases()))
def test_gemm_big_shapes(m, k, n, bits, dtype):
    # The fused kernel up to M = 256, the automatic dispatch (wgmma or dequantize + cuBLAS) above.
    _check_gemm(m, k, n, bits, dtype, **({"path": "fused"} if m <= 256 else {}))


@pytest.mark.parametrize("bits", BITS)
@pytest.mark.parametrize("m", [1, 7, 16, 17, 100, 1000])
def test_gemm_automatic_dispatch(bits, m):
    _check_gemm(m, 1536, 576, bits, torch.bfloat16)
    assert kcuda.gemm_path(m, 576, 1536, bits, torch.bfloat16) in kcuda.GEMM_PATHS


@pytest.mark.parametrize("bits", BITS)
@pytest.mark.parametrize("m", [1, 17, 64, 300])
@pytest.mark.parametrize("split", ["off", "on", "3"])
def test_gemm_split_k(bits, m, split):
    kw = {"off": {"path": "fused", "split_k": 1}, "on": {"path": "fused-splitk"}, "3": {"path": "fused", "split_k": 3}}[split]
    _check_gemm(m, 4096, 4096, bits, torch.float16, **kw)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("m", [1000, 4096])
def test_gemm_fused_large_m(dtype, m):
    _check_gemm(m, 1536, 576, 4, dtype, path="fused")


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("m", [1, 64])
def test_gemm_dequant_cublas_small_m(dtype, m):
    _check_gemm(m, 200, 300, 3, dtype, path="dequant+cublas")


@pytest.mark.parametrize("bits", BITS)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("path", ["fused", "fused-splitk", "dequant+cublas"])
def test_gemm_bias_and_leading_dims(bits, dtype, path):
    qw = _weight(300, 200, bits)
    x = torch.randn(2, 5, 200, device=DEV, dtype=dtype)
    bias = torch.randn(300, device=DEV, dtype=dtype)
    out = _gemm(x, qw, bias, path=path)
    assert out.shape == (2, 5, 300)
    err = _rel_err(out, _reference(x, qw, bias))
    assert err < REL_TOL[dtype], f"relative error {err:.2e}"


@pytest.mark.parametrize("bits", BITS)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("path", ["fused", "fused-splitk", "dequant+cublas"])
def test_gemm_identity_gives_dequantized_weight(bits, dtype, path):
    # x = I: out = W_hat^T exactly up to the rounding of each weight to fp16/bf16 (isolates
    # dequantization bugs from MMA bugs).
    k, n = 200, 300
    qw = _weight(n, k, bits)
    out = _gemm(torch.eye(k, device=DEV, dtype=dtype), qw, path=path)
    ref = fmt.dequantize(qw, torch.float32).t()
    tol = {torch.float16: 2e-3, torch.bfloat16: 1.6e-2}[dtype]
    torch.testing.assert_close(out.float(), ref, rtol=tol, atol=tol * ref.abs().max().item() * 1e-3)


def test_gemm_fp32_activations_and_op_dispatch():
    qw = _weight(192, 576, 4)
    x = torch.randn(3, 576, device=DEV, dtype=torch.float32)
    out = torch.ops.kbit_linear.gemm(x, qw.packed, qw.absmax, qw.codebook, qw.tensor_scale, 4, 192, None)
    assert out.dtype == torch.float32 and out.shape == (3, 192)
    assert _rel_err(out, _reference(x, qw)) < REL_TOL[torch.bfloat16]


def test_gemm_path_names():
    for m in (1, 16, 64, 4096):
        p = kcuda.gemm_path(m, 4096, 4096, 4, torch.float16)
        assert p in kcuda.GEMM_PATHS
    assert kcuda.gemm_path(8192, 4096, 4096, 4, torch.float16) == "dequant+cublas"
    if "H100" in torch.cuda.get_device_name():
        # the measured dispatch: decode up to M = 16, up to 8 for the largest weights
        assert kcuda.gemm_path(16, 4096, 4096, 4, torch.float16) == "decode"
        assert kcuda.gemm_path(8, 8192, 28672, 4, torch.float16) == "decode"
        assert kcuda.gemm_path(16, 8192, 28672, 4, torch.float16) != "decode"


def test_gemm_rejects_bad_arguments():
    qw = _weight(192, 576, 4)
    with pytest.raises(ValueError):
        kcuda.gemm_cuda(torch.randn(2, 577, device=DEV, dtype=torch.float16), qw.packed, qw.absmax, qw.codebook, qw.tensor_scale, 4, 192)
    with pytest.raises(ValueError):
        kcuda.gemm_cuda(torch.randn(2, 576, device=DEV, dtype=torch.float16), qw.packed, qw.absmax, qw.codebook, qw.tensor_scale, 4, 192, path="nope")
    with pytest.raises((TypeError, ValueError)):
        kcuda.gemm_cuda(torch.randn(2, 576, device=DEV, dtype=torch.float16), qw.packed.float(), qw.absmax, qw.codebook, qw.tensor_scale, 4, 192)


# ---------------------------------------------------------------------------------------
# graphs and compile
# ---------------------------------------------------------------------------------------


_NEEDS_SM90 = pytest.mark.skipif(torch.cuda.is_available() and torch.cuda.get_device_capability() != (9, 0),
                                 reason="the wgmma kernel needs compute capability 9.0")


@pytest.mark.parametrize("path,m", [("fused", 4), ("fused-splitk", 4), ("dequant+cublas", 4),
                                    pytest.param("wgmma", 96, marks=_NEEDS_SM90), pytest.param("wgmma-splitk", 96, marks=_NEEDS_SM90)])
def test_cuda_graph_capture_and_replay(path, m):
    qw = _weight(4096, 4096, 4)
    static_x = torch.randn(m, 4096, device=DEV, dtype=torch.float16)
    kcuda.gemm_cuda(static_x, qw.packed, qw.absmax, qw.codebook, qw.tensor_scale, 4, 4096, path=path)  # warm up / compile
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        static_out = kcuda.gemm_cuda(static_x, qw.packed, qw.absmax, qw.codebook, qw.tensor_scale, 4, 4096, path=path)
    for _ in range(3):
        static_x.copy_(torch.randn_like(static_x))
        static_out.fill_(float("nan"))
        g.replay()
        torch.cuda.synchronize()
        assert not torch.isnan(static_out).any()
        assert _rel_err(static_out, _reference(static_x, qw)) < REL_TOL[torch.float16]


@pytest.mark.parametrize("path", ["fused", "fused-splitk"])
@pytest.mark.parametrize("pdl", [True, False], ids=["pdl", "plain"])
def test_back_to_back_fused_calls_wait_for_their_inputs(path, pdl):
    """Back-to-back fused launches (programmatic or not): each call's x is the previous call's
    output, one call overwrites the x of the call before it, and the weights of the last call
    are copied in by the kernel just before it; eagerly and in a CUDA graph."""
    old = loader.set_programmatic_launch(pdl)
    try:
        k, m, dtype = 1024, 130, torch.float16  # one block per SM: the plan launches it programmatically
        qw = _weight(k, k, 4)
        if torch.cuda.get_device_capability() >= (9, 0):
            assert ops._plan(m, k, k, 4, dtype, torch.cuda.current_device(), path, None).programmatic
        w = fmt.dequantize(qw, torch.float32)
        scale = (k ** 0.5) / w.norm().item()  # keeps a chain of calls in range
        x0 = torch.randn(m, k, device=DEV, dtype=dtype)
        ts = qw.tensor_scale * scale
        packed_buf = torch.zeros_like(qw.packed)
        bufs = [torch.full((m, k), float("nan"), dtype=dtype, device=DEV) for _ in range(5)]

        def call(x, out, packed=qw.packed):
            kcuda.gemm_cuda(x, packed, qw.absmax, qw.codebook, ts, 4, k, path=path, out=out)

        def chain():
            bufs[0].copy_(x0)
            packed_buf.zero_()
            call(bufs[0], bufs[1])
            call(bufs[1], bufs[2])
            call(bufs[2], bufs[3])
            call(bufs[3], bufs[1])  # overwrites the x of the call before
            packed_buf.copy_(qw.packed)
            call(bufs[2], bufs[4], packed_buf)

        for graph in (False, True):
            for t in bufs:
                t.fill_(float("nan"))
            if graph:
                torch.cuda.synchronize()
                g = torch.cuda.CUDAGraph()
                with torch.cuda.graph(g):
                    chain()
                for t in bufs:
                    t.fill_(float("nan"))
                g.replay()
            else:
                chain()
            torch.cuda.synchronize()
            ws = w * scale
            refs = [x0.float()]
            for _ in range(4):
                refs.append(F.linear(refs[-1].to(dtype).float(), ws))
            assert not torch.isnan(torch.stack(bufs[1:])).any()
            assert _rel_err(bufs[2], refs[2]) < 1e-2
            assert _rel_err(bufs[3], refs[3]) < 2e-2
            assert _rel_err(bufs[1], refs[4]) < 2e-2
            assert _rel_err(bufs[4], refs[3]) < 2e-2
        if pdl:
            assert loader.programmatic_launch_enabled(), "programmatic launch fell back to plain launches"
    finally:
        loader.set_programmatic_launch(old)


class _Tiny(torch.nn.Module):
    def __init__(self, qw: fmt.KbitWeight) -> None:
        super().__init__()
        self.qw = qw

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        q = self.qw
        y = torch.ops.kbit_linear.gemm(x, q.packed, q.absmax, q.codebook, q.tensor_scale, q.bits, q.out_features, None)
        return torch.relu(y) * 2.0


def test_torch_compile_fullgraph():
    qw = _weight(192, 576, 4)
    mod = _Tiny(qw)
    compiled = torch.compile(mod, fullgraph=True)
    x = torch.randn(5, 576, device=DEV, dtype=torch.bfloat16)
    torch.testing.assert_close(compiled(x), mod(x), rtol=0, atol=0)
