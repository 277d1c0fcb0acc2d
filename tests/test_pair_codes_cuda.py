"""Every CUDA kernel that reads a weight, fed 4- and 5-bit pair codes (``docs/format.md``, section 7a),
against the reference and against the same kernel fed planes (marker ``cuda``).

Same tolerances as ``test_kernels_cuda.py``; outputs NaN-poisoned first. A pair-code launch and a
plane launch multiply the same dequantized values in the same order, so they agree to the last
bit except where split-K sums with atomics (decode kernel); the tests allow 1e-3 between them.
"""

from __future__ import annotations

import pytest
import torch

import kbit_linear  # noqa: F401  (op schemas)
from kbit_linear import KbitExperts, KbitLinear
from kbit_linear import format as fmt
from kbit_linear.backends import cuda as kcuda
from kbit_linear.backends.cuda import decode, grouped, hopper, loader, ops

from test_decode_cuda import _check_grouped, _experts, _groups
from test_kernels_cuda import DEV, DTYPES, REL_TOL, _reference, _rel_err, _weight

pytestmark = [
    pytest.mark.cuda,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs an NVIDIA GPU"),
    pytest.mark.skipif(not loader.cupy_available(), reason="needs CuPy (pip install 'kbit-linear[cuda]')"),
]

SM90 = torch.cuda.is_available() and torch.cuda.get_device_capability() == (9, 0)
needs_sm90 = pytest.mark.skipif(not SM90, reason="the wgmma kernels need compute capability 9.0")
BITS = tuple(fmt.PAIR_CODE_BYTES)  # the widths with pair codes
SHAPES = [(576, 192), (100, 33), (200, 300), (1536, 576), (8, 130), (4096, 1000)]  # (in, out): odd K and N
PATH_ROWS = {"decode": (1, 5, 9, 16), "fused": (1, 17, 64, 100), "fused-splitk": (3, 40),
             "dequant+cublas": (2, 300), "wgmma": (17, 64, 65, 129, 300, 777), "wgmma-splitk": (64, 200)}


def _pair_weight(qw: fmt.KbitWeight) -> fmt.KbitWeight:
    return fmt.KbitWeight(fmt.to_pair_codes(qw.packed), qw.absmax, qw.codebook, qw.tensor_scale, qw.bits,
                          qw.out_features, qw.in_features)


def _run(x: torch.Tensor, qw: fmt.KbitWeight, **kw) -> torch.Tensor:
    out = torch.full((*x.shape[:-1], qw.out_features), float("nan"), dtype=x.dtype, device=DEV)
    kcuda.gemm_cuda(x, qw.packed, qw.absmax, qw.codebook, qw.tensor_scale, qw.bits, qw.out_features, None, out=out, **kw)
    assert not torch.isnan(out).any(), "unwritten (NaN) output elements"
    return out


def _cases():
    i = 0
    for bits in BITS:
        for path, rows in PATH_ROWS.items():
            for m in rows:
                for dtype in DTYPES:
                    k, n = SHAPES[i % len(SHAPES)]
                    i += 1
                    marks = [needs_sm90] if path.startswith("wgmma") else []
                    yield pytest.param(bits, path, m, k, n, dtype, marks=marks, id=f"K{bits}-{path}-M{m}-{k}x{n}-{str(dtype)[6:]}")


@pytest.mark.parametrize("bits,path,m,k,n,dtype", list(_cases()))
def test_every_gemm_path_reads_pair_codes(bits, path, m, k, n, dtype):
    qw = _weight(n, k, bits)
    pw = _pair_weight(qw)
    x = torch.randn(m, k, device=DEV, dtype=dtype)
    out = _run(x, pw, path=path)
    err = _rel_err(out, _reference(x, qw))
    assert err < REL_TOL[dtype], f"{path} M={m} {k}->{n} {dtype}: relative error {err:.2e} against the reference"
    assert _rel_err(out, _run(x, qw, path=path)) < 1e-3, "pair codes and planes disagree"


@pytest.mark.parametrize("bits", BITS)
def test_dispatch_keeps_one_plan_per_layout(bits):
    """The plan cache tells the layouts apart: a plane call after a pair-code call of the same
    problem still reads planes (and the other way round)."""
    qw = _weight(192, 576, bits)
    pw = _pair_weight(qw)
    for m in (1, 40, 300):
        x = torch.randn(m, 576, device=DEV, dtype=torch.float16)
        ref = _reference(x, qw)
        for w in (pw, qw, pw):
            assert _rel_err(_run(x, w), ref) < REL_TOL[torch.float16]


@pytest.mark.parametrize("bits", BITS)
@pytest.mark.parametrize("dtype", (torch.float16, torch.bfloat16, torch.float32), ids=str)
@pytest.mark.parametrize("shape", [(192, 576), (33, 100), (300, 200), (31, 200), (5, 4100)], ids=lambda s: f"{s[0]}x{s[1]}")
def test_dequantize_kernel_reads_pair_codes_bit_identically(dtype, shape, bits):
    n, k = shape
    qw = _weight(n, k, bits)
    pw = _pair_weight(qw)
    got = ops.dequantize_cuda(pw.packed, pw.absmax, pw.codebook, pw.tensor_scale, bits, n, k, dtype)
    assert torch.equal(got, fmt.dequantize(qw, torch.float32).to(dtype))


def _pair_experts(e: int, k: int, n: int, bits: int):
    packed, absmax, codebook, ts, dense = _experts(e, k, n, bits)
    return fmt.to_pair_codes(packed), absmax, codebook, ts, dense


@pytest.mark.parametrize("bits", BITS)
@pytest.mark.parametrize("shape", ((576, 192), (2048, 1536), (100, 33)), ids=lambda s: f"{s[0]}to{s[1]}")
def test_grouped_decode_reads_pair_codes(shape, bits):
    k, n = shape
    packed, absmax, codebook, ts, dense = _pair_experts(6, k, n, bits)
    for dtype in DTYPES:
        for max_rows in (1, 8, 16):
            counts = [max_rows, 0, 1, max_rows // 2, 3 % (max_rows + 1)]
            experts = [5, 1, 2, 2, 0]
            x = torch.randn(sum(counts) + 2, k, device=DEV, dtype=dtype)
            out = torch.full((x.shape[0], n), float("nan"), dtype=dtype, device=DEV)
            decode.grouped_decode_gemm(x, packed, absmax, codebook, ts, _groups(counts, experts), bits, n, out, max_rows)
            _check_grouped(out, x, dense, counts, experts, dtype)


@needs_sm90
@pytest.mark.parametrize("bits", BITS)
@pytest.mark.parametrize("shape", ((576, 192), (1000, 1000), (104, 33)), ids=lambda s: f"{s[0]}to{s[1]}")
def test_grouped_wgmma_reads_pair_codes(shape, bits):
    k, n = shape
    packed, absmax, codebook, ts, dense = _pair_experts(6, k, n, bits)
    for dtype in DTYPES:
        for tile in hopper.TOKEN_TILES:
            counts = [tile + 5, 0, tile, 17, 40]
            experts = [3, 0, 5, 5, 1]
            x = torch.randn(sum(counts) + 3, k, device=DEV, dtype=dtype)
            groups = _groups(counts, experts)
            out = torch.full((x.shape[0], n), float("nan"), dtype=dtype, device=DEV)
            plan = grouped.grouped_plan(x.shape[0], groups.shape[1], bits, dtype, packed.shape[2], torch.cuda.current_device(),
                                        token_tile=tile, pairs=True)
            grouped.launch(plan, x, packed, absmax, codebook, ts, groups, out)
            torch.cuda.synchronize()
            _check_grouped(out, x, dense, counts, experts, dtype)


# ---------------------------------------------------------------------------------------
# the modules keep pair codes on the GPU and planes everywhere else
# ---------------------------------------------------------------------------------------


@pytest.mark.parametrize("bits", BITS)
def test_linear_holds_pair_codes_on_the_gpu_and_gives_planes_in_its_state_dict(bits):
    dense = torch.nn.Linear(300, 200, device=DEV)
    layer = KbitLinear.from_linear(dense, bits=bits)
    assert layer.weight.dtype == torch.uint8  # pair codes
    cpu = KbitLinear(300, 200, bits=bits)
    cpu.load_state_dict(layer.state_dict())
    assert cpu.weight.dtype == torch.int32
    x = torch.randn(7, 300, device=DEV)  # float32: runs in bf16 on the GPU
    assert _rel_err(layer(x).cpu(), cpu(x.cpu())) < REL_TOL[torch.bfloat16]
    param = layer.weight
    layer.cpu()
    assert layer.weight is param and param.dtype == torch.int32  # same Parameter, planes on the CPU
    layer.to(DEV)
    assert param.dtype == torch.uint8
    layer.load_state_dict(cpu.state_dict())
    assert param.dtype == torch.uint8
    assert _rel_err(layer(x).cpu(), cpu(x.cpu())) < REL_TOL[torch.bfloat16]


@pytest.mark.parametrize("bits", BITS)
def test_experts_hold_pair_codes_on_the_gpu(bits):
    module = KbitExperts(4, 256, 128, bits=bits, device="cpu")
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for proj in ("gate_up_proj", "down_proj"):
            p = getattr(module, proj)
            p.copy_(torch.randint(-2**31, 2**31 - 1, p.shape, dtype=torch.int32, generator=g))
            getattr(module, proj + "_absmax").fill_(0x50)
    state = {k: v.clone() for k, v in module.state_dict().items()}
    hidden = torch.randn(9, 256)
    idx = torch.randint(0, 4, (9, 2))
    wts = torch.rand(9, 2)
    want = module(hidden, idx, wts)
    module.to(DEV)
    assert module.gate_up_proj.dtype == torch.uint8 and module.down_proj.dtype == torch.uint8
    got = module(hidden.to(DEV), idx.to(DEV), wts.to(DEV))
    assert _rel_err(got.float().cpu(), want) < REL_TOL[torch.bfloat16]  # float32 runs in bf16 on the GPU
    saved = module.state_dict()
    for key, value in state.items():
        assert torch.equal(saved[key].cpu(), value), key


@needs_sm90
def test_gemm_path_reports_each_layout():
    # M = 1500: pair codes keep the 4-bit weight on the wgmma kernel, planes hand it to dequantize + cuBLAS
    assert kcuda.gemm_path(1500, 4096, 4096, 4, torch.float16).startswith("wgmma")
    assert kcuda.gemm_path(1500, 4096, 4096, 4, torch.float16, pairs=False) == "dequant+cublas"
    assert kcuda.gemm_path(800, 4096, 4096, 5, torch.float16).startswith("wgmma")
    assert kcuda.gemm_path(800, 4096, 4096, 5, torch.float16, pairs=False) == "dequant+cublas"
    with pytest.raises(ValueError, match="pairs=True"):
        kcuda.gemm_path(64, 4096, 4096, 3, torch.float16, pairs=True)
