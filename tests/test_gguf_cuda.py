"""GPU tests of the GGUF block-format kernels (``kernels/gguf.cu``) against the reference
(:mod:`kbit_linear.gguf_format`).

Weights are drawn fresh per case (random bytes for the levels, random fp16 scales and minimums,
so every level and bit pattern occurs); the dequantize kernel must equal the reference bit for
bit in every output dtype, the GEMM must match ``x @ W^T`` with ``W`` the reference's weight in
``x``'s dtype. Outputs are NaN-poisoned before each call (a freed NaN block of the same size
that the op's allocation reuses, and CUDA-graph replays into a NaN-filled output), so an
element a kernel fails to write shows.
"""

from __future__ import annotations

import pytest
import torch

from kbit_linear import gguf_format as gf
from kbit_linear.backends.cuda import gguf as kgguf, tuning

gpu = [pytest.mark.cuda, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]
pytestmark = gpu

TYPES = sorted(gf.BLOCK_TYPES)
SHAPES = [(1, 32), (7, 96), (16, 64), (33, 160), (129, 1024), (300, 2080), (1000, 4096)]


def random_weight(qtype: str, n: int, k: int, seed: int, device: str = "cuda") -> gf.GGUFWeight:
    """A weight with every field random: levels from random bytes, scales and minimums fp16 of
    both signs (about 5 % of the scales zero; never inf/nan)."""
    g = torch.Generator().manual_seed(seed)
    t = gf.block_type(qtype)
    raw = torch.randint(0, 256, (n, k // gf.BLOCK, t.block_bytes), generator=g, dtype=torch.uint8)
    w = gf.split_blocks(raw, qtype, n, k)
    scale = (torch.rand(n, k // gf.BLOCK, generator=g) * 0.02 + 1e-4) * torch.where(torch.rand(n, k // gf.BLOCK, generator=g) < 0.5, -1, 1)
    scale[torch.rand(scale.shape, generator=g) < 0.05] = 0.0  # zero blocks, common in real files
    w.scale = scale.to(torch.float16)
    if w.mins is not None:
        w.mins = (torch.randn(n, k // gf.BLOCK, generator=g) * 0.05).to(torch.float16)
    return w.to(device)


def _poison_next(shape: tuple[int, ...], dtype: torch.dtype) -> None:
    """Leave a NaN-filled block of this size in torch's cache for the next allocation to reuse."""
    torch.full(shape, float("nan"), dtype=dtype, device="cuda")


def _args(w: gf.GGUFWeight):
    return w.qs, w.qh, w.scale, w.mins, w.qtype, w.out_features


@pytest.mark.parametrize("qtype", TYPES)
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32])
def test_dequantize_is_the_reference_bit_for_bit(qtype, dtype):
    for i, (n, k) in enumerate(SHAPES):
        w = random_weight(qtype, n, k, seed=100 * i + len(qtype))
        ref = gf.dequantize(w.to("cpu"), dtype)
        _poison_next((n, k), dtype)
        out = torch.ops.kbit_linear.gguf_dequantize(w.qs, w.qh, w.scale, w.mins, qtype, n, k, dtype)
        assert torch.equal(out.cpu().view(torch.uint8 if dtype != torch.float32 else torch.int32).view(-1),
                           ref.view(torch.uint8 if dtype != torch.float32 else torch.int32).view(-1)), (qtype, dtype, n, k)


def _check_gemm(out: torch.Tensor, x: torch.Tensor, w: gf.GGUFWeight, bias: torch.Tensor | None) -> None:
    dense = gf.dequantize(w.to("cpu"), x.dtype).to(x.device).float()
    ref = x.float() @ dense.T
    if bias is not None:
        ref += bias.to(x.dtype).float()
    assert out.dtype == x.dtype and out.shape == ref.shape
    assert not torch.isnan(out).any(), "unwritten (NaN) outputs"
    scale = ref.abs().max().clamp_min(1e-6)
    tol = {torch.float16: 4e-3, torch.bfloat16: 2e-2, torch.float32: 1e-4}[x.dtype]
    err = ((out.float() - ref).abs().max() / scale).item()
    assert err < tol, f"{w.qtype} {x.dtype} M={x.shape[0]} N={w.out_features} K={w.in_features}: max rel err {err:.2e}"


@pytest.mark.parametrize("qtype", TYPES)
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_gemm_matches_the_reference(qtype, dtype):
    torch.manual_seed(0)
    for i, (n, k) in enumerate(SHAPES):
        w = random_weight(qtype, n, k, seed=7 * i + 1)
        for m in (1, 2, 3, 8, 9, 16, 17, 33, 64, 65):
            x = torch.randn(m, k, device="cuda", dtype=dtype)
            bias = torch.randn(n, device="cuda", dtype=dtype) if (m + i) % 3 == 0 else None
            _poison_next((m, n), dtype)
            out = torch.ops.kbit_linear.gguf_gemm(x, *_args(w), bias)
            _check_gemm(out, x, w, bias)


@pytest.mark.parametrize("qtype", ["Q4_1", "Q8_0"])
def test_gemm_float32_is_dequantize_then_linear_exactly(qtype):
    """fp32 activations take dequantize + F.linear: the same numbers a dense fp32 model gives."""
    w = random_weight(qtype, 96, 256, seed=3)
    x = torch.randn(5, 256, device="cuda")
    dense = gf.dequantize(w.to("cpu"), torch.float32).cuda()
    out = torch.ops.kbit_linear.gguf_gemm(x, *_args(w), None)
    assert torch.equal(out, torch.nn.functional.linear(x, dense))


@pytest.mark.parametrize("qtype", ["Q4_0", "Q5_1"])
def test_gemm_and_a8_in_cuda_graph_with_poisoned_output(qtype):
    w = random_weight(qtype, 257, 512, seed=11)
    for m in (1, 12, 50):
        x = torch.randn(m, 512, device="cuda", dtype=torch.float16)
        for op in (torch.ops.kbit_linear.gguf_gemm, torch.ops.kbit_linear.gguf_gemm_a8):
            op(x, *_args(w), None)  # compile outside the capture
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                out = op(x, *_args(w), None)  # the op's own output, static across replays
            for _ in range(2):
                x.copy_(torch.randn_like(x))
                out.fill_(float("nan"))  # poisoned: every element must be rewritten by the replay
                graph.replay()
                torch.cuda.synchronize()
                if op is torch.ops.kbit_linear.gguf_gemm:
                    _check_gemm(out, x, w, None)
                else:
                    ref = gf.matmul_a8(x.cpu().float(), w.to("cpu"))
                    assert not torch.isnan(out).any()
                    assert ((out.cpu().float() - ref).abs().max() / ref.abs().max()).item() < 5e-3


def test_gemm_unaligned_and_strided_x():
    w = random_weight("Q4_1", 64, 320, seed=5)
    base = torch.randn(3, 330, device="cuda", dtype=torch.bfloat16)
    for x in (base[:, 1:321], base[:, 3:323], base[:, :320].t().contiguous().t()):  # unaligned, strided rows
        _check_gemm(torch.ops.kbit_linear.gguf_gemm(x, *_args(w), None), x, w, None)


def test_gemm_under_torch_compile():
    w = random_weight("Q5_0", 128, 256, seed=9)
    f = torch.compile(lambda x: torch.ops.kbit_linear.gguf_gemm(x, *_args(w), None), fullgraph=True)
    x = torch.randn(4, 256, device="cuda", dtype=torch.float16)
    _check_gemm(f(x), x, w, None)


def test_small_m_limit_is_the_kernels():
    assert tuning.GGUF_GEMV_MAX_M <= 8 * max(kgguf._TOKEN_TILES)  # n8 fragments of the largest instance
    assert len(kgguf.gguf_instances()) == len(set(kgguf.gguf_instances()))


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_load_gguf_on_cuda_against_transformers(tmp_path, dtype):
    """A tiny Llama GGUF (every kept type, a K-quant, a tied Q8_0 embedding) loaded by
    ``load_gguf`` onto the GPU against transformers' dequantized load there: a prompt longer
    than the small-M kernel's limit takes dequantize + cuBLAS, the dense model's own GEMMs on
    the same weights, so the logits are equal; a short one takes the small-M kernel (close);
    generation runs."""
    pytest.importorskip("gguf")
    from test_gguf_loader import VOCAB, _hf_load, write_tiny_llama

    from kbit_linear import load_gguf

    path = write_tiny_llama(tmp_path / "tiny.gguf")
    ours = load_gguf(path, dtype=dtype, device="cuda", requantize_bits=None, progress=False)
    ref = _hf_load(path, dtype).cuda()
    long = torch.randint(0, VOCAB, (1, tuning.GGUF_GEMV_MAX_M + 16), device="cuda")
    with torch.no_grad():
        assert torch.equal(ours(long).logits, ref(long).logits)
        short = long[:, :7]
        a, b = ours(short).logits.float(), ref(short).logits.float()
    assert (a - b).abs().max().item() <= 0.02 * b.abs().max().item() + 1e-3
    out = ours.generate(short, max_new_tokens=4, do_sample=False)
    assert out.shape == (1, 11)


def test_q8_1_activation_kernel_is_the_reference():
    from kbit_linear.backends.cuda.gguf import quantize_q8_1_cuda

    for dtype in (torch.float16, torch.bfloat16):
        for m, k in ((1, 32), (5, 96), (70, 4096)):
            x = torch.randn(m, k, device="cuda", dtype=dtype) * 3
            x[0, :32] = 0  # an all-zero block: scale 0, values 0
            got, ref = quantize_q8_1_cuda(x), gf.quantize_activations(x.cpu())
            assert torch.equal(got.qs.cpu(), ref.qs) and torch.equal(got.scale.cpu(), ref.scale)
            torch.testing.assert_close(got.sums.cpu().float(), ref.sums.float(), rtol=2e-3, atol=2e-3)


@pytest.mark.parametrize("qtype", TYPES)
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_gemm_a8_matches_the_reference(qtype, dtype):
    """8-bit activations: the integer-MMA kernel against gguf_format.matmul_a8 (the seed's
    per-block formulas), M across the 64-row chunks."""
    for i, (n, k) in enumerate(SHAPES[:6]):
        w = random_weight(qtype, n, k, seed=31 * i + 2)
        for m in (1, 3, 8, 17, 64, 65, 130):
            x = torch.randn(m, k, device="cuda", dtype=dtype)
            bias = torch.randn(n, device="cuda", dtype=dtype) if m % 2 else None
            _poison_next((m, n), dtype)
            out = torch.ops.kbit_linear.gguf_gemm_a8(x, *_args(w), bias)
            ref = gf.matmul_a8(x.cpu().float(), w.to("cpu"), None if bias is None else bias.cpu().float())
            assert out.dtype == dtype and not torch.isnan(out).any()
            err = ((out.cpu().float() - ref).abs().max() / ref.abs().max().clamp_min(1e-6)).item()
            tol = 5e-3 if dtype == torch.float16 else 2e-2
            assert err < tol, f"{qtype} {dtype} M={m} N={n} K={k}: max rel err {err:.2e}"


def test_a8_nan_activations_reach_the_output_and_fp32_bias_is_the_references():
    """A NaN in x makes the rows that read it NaN (also for Q8_0, whose formula has no block sum);
    a float32 bias with fp16 x is added as the reference adds it (rounded to x's dtype)."""
    for qtype in ("Q8_0", "Q4_1"):
        w = random_weight(qtype, 48, 128, seed=4)
        x = torch.randn(3, 128, device="cuda", dtype=torch.float16)
        x[1, 70] = float("nan")
        out = torch.ops.kbit_linear.gguf_gemm_a8(x, *_args(w), None)
        assert torch.isnan(out[1]).all() and not torch.isnan(out[0]).any() and not torch.isnan(out[2]).any()
    w = random_weight("Q5_0", 40, 96, seed=6)
    x = torch.randn(2, 96, device="cuda", dtype=torch.float16)
    bias = torch.randn(40, device="cuda", dtype=torch.float32) * 3
    for op, ref in ((torch.ops.kbit_linear.gguf_gemm_a8, gf.matmul_a8), (torch.ops.kbit_linear.gguf_gemm, gf.matmul)):
        got = op(x, *_args(w), bias).cpu().float()
        want = ref(x.cpu().float(), w.to("cpu"), bias.cpu().half().float())
        assert ((got - want).abs().max() / want.abs().max()).item() < 5e-3
