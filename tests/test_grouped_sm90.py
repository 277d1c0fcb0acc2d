"""The Hopper grouped GEMM (``kbit_gemm_sm90_grouped``) against the per-expert reference (marker ``cuda``).

Runs on GPUs of compute capability 9.0 only. Each case draws random groups (empty ones, an
expert used twice, row counts below, at and above every token tile, ragged last tiles), leaves
spare rows at the end that no group names and NaN-poisons the output first: every group row must
match the fp32 reference of its expert, every other row must stay NaN. Grids of one and three
blocks make a block walk many items across groups; a group naming an expert out of range, or
rows outside x, must be skipped without a memory error.
"""

from __future__ import annotations

import pytest
import torch

import kbit_linear  # noqa: F401  (op schemas)
from kbit_linear import format as fmt
from kbit_linear.backends.cuda import grouped, hopper, loader

from test_decode_cuda import _check_against, _check_grouped, _experts, _groups

DEV = "cuda"
DTYPES = (torch.float16, torch.bfloat16)

pytestmark = [
    pytest.mark.cuda,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs an NVIDIA GPU"),
    pytest.mark.skipif(not loader.cupy_available(), reason="needs CuPy (pip install 'kbit-linear[cuda]')"),
    pytest.mark.skipif(torch.cuda.is_available() and torch.cuda.get_device_capability() != (9, 0),
                       reason="the grouped wgmma kernel needs compute capability 9.0"),
]


def _launch(x, packed, absmax, codebook, ts, groups, bits, n, token_tile=None, grid=None):
    """The kernel straight (no op): out NaN-poisoned, so rows it must not write stay NaN."""
    out = torch.full((x.shape[0], n), float("nan"), dtype=x.dtype, device=DEV)
    plan = grouped.grouped_plan(x.shape[0], groups.shape[1], bits, x.dtype, packed.shape[2], torch.cuda.current_device(),
                                token_tile=token_tile, grid=grid)
    grouped.launch(plan, x, packed, absmax, codebook, ts, groups, out)
    return out


@pytest.mark.parametrize("shape", ((576, 192), (1000, 1000), (2048, 1536), (104, 33)), ids=lambda s: f"{s[0]}to{s[1]}")
@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: str(d).split(".")[-1])
@pytest.mark.parametrize("bits", fmt.SUPPORTED_BITS, ids=lambda b: f"k{b}")
def test_grouped_wgmma_matches_per_expert_reference(bits, dtype, shape):
    k, n = shape
    packed, absmax, codebook, ts, dense = _experts(6, k, n, bits)
    g = torch.Generator().manual_seed(k + n + bits)
    for i, tile in enumerate(hopper.TOKEN_TILES):
        counts = [int(torch.randint(0, 2 * tile + 40, (1,), generator=g)) for _ in range(7)]
        counts[1] = 0  # an empty group
        counts[2] = tile  # exactly one tile
        counts[4] = 17  # just past the decode kernel's rows
        experts = [int(torch.randint(0, 6, (1,), generator=g)) for _ in range(7)]
        experts[3] = experts[2]
        x = torch.randn(sum(counts) + 3, k, device=DEV, dtype=dtype)
        grid = (None, 1, 3)[i % 3]
        out = _launch(x, packed, absmax, codebook, ts, _groups(counts, experts), bits, n, token_tile=tile, grid=grid)
        torch.cuda.synchronize()
        _check_grouped(out, x, dense, counts, experts, dtype)


def test_grouped_wgmma_skips_invalid_groups():
    """Experts out of range, negative rows and rows past x produce no items (nothing written)."""
    k, n, bits = 576, 192, 4
    packed, absmax, codebook, ts, dense = _experts(6, k, n, bits)
    x = torch.randn(200, k, device=DEV, dtype=torch.float16)
    groups = torch.tensor([[7, -1, 2, 3, 1], [0, 10, 150, 0, 100], [50, 40, 60, -5, 30]], dtype=torch.int32, device=DEV)
    out = _launch(x, packed, absmax, codebook, ts, groups, bits, n, token_tile=64)
    torch.cuda.synchronize()
    _check_against(out[100:130], x[100:130], dense[1], torch.float16)
    keep = torch.ones(200, dtype=torch.bool)
    keep[100:130] = False
    assert torch.isnan(out[keep.to(DEV)]).all(), "an invalid group wrote rows"


@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: str(d).split(".")[-1])
def test_grouped_op_takes_large_groups_on_the_device(dtype):
    """``kbit_linear::grouped_gemm`` with groups above the decode kernel's 16 rows runs the
    kernel (groups on the device, no host read) and zeroes the rows no group names; under a CUDA
    graph it replays with new group contents."""
    k, n, bits = 1000, 1000, 3
    packed, absmax, codebook, ts, dense = _experts(6, k, n, bits)
    counts, experts = [40, 0, 130, 17], [5, 1, 0, 5]
    x = torch.randn(sum(counts) + 5, k, device=DEV, dtype=dtype)
    groups = _groups(counts, experts)
    out = torch.ops.kbit_linear.grouped_gemm(x, packed, absmax, codebook, ts, groups, bits, n, 130)
    row = 0
    for c, e in zip(counts, experts):
        if c:
            _check_against(out[row:row + c], x[row:row + c], dense[e], dtype)
        row += c
    assert (out[row:] == 0).all()

    graph = torch.cuda.CUDAGraph()
    static = torch.ops.kbit_linear.grouped_gemm(x, packed, absmax, codebook, ts, groups, bits, n, 130)  # compile outside
    torch.cuda.synchronize()
    with torch.cuda.graph(graph):
        static = torch.ops.kbit_linear.grouped_gemm(x, packed, absmax, codebook, ts, groups, bits, n, 130)
    groups.copy_(_groups([20, 90, 60, 17], [2, 3, 4, 0]))
    graph.replay()
    torch.cuda.synchronize()
    row = 0
    for c, e in zip([20, 90, 60, 17], [2, 3, 4, 0]):
        _check_against(static[row:row + c], x[row:row + c], dense[e], dtype)
        row += c


def test_grouped_plan_checks_its_arguments():
    dev = torch.cuda.current_device()
    with pytest.raises(ValueError, match="token_tile"):
        grouped.grouped_plan(100, 4, 4, torch.float16, 2, dev, token_tile=96)
    with pytest.raises(ValueError, match="grid"):
        grouped.grouped_plan(100, 4, 4, torch.float16, 2, dev, grid=0)


def _gate_up(counts, experts_used, intermediate, k, bits, dtype):
    packed, absmax, codebook, ts, dense = _experts(4, k, 2 * intermediate, bits)
    x = torch.randn(sum(counts) + 2, k, device=DEV, dtype=dtype)
    return (x, packed, absmax, codebook, ts, _groups(counts, experts_used)), dense


def _check_swiglu(out, x, dense, counts, used):
    """Each group's rows of ``out`` against silu(gate) * up of its expert's dense weight."""
    row = 0
    for c, e in zip(counts, used):
        if c:
            gate, up = (x[row:row + c].float() @ dense[e].t()).chunk(2, dim=-1)
            ref = torch.nn.functional.silu(gate) * up
            err = float((out[row:row + c].float() - ref).norm() / ref.norm())
            assert err < {torch.float16: 5e-3, torch.bfloat16: 2e-2}[out.dtype], (e, err)
        row += c


@pytest.mark.parametrize("intermediate", [256, 200], ids=["fused", "unfused"])
@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: str(d).split(".")[-1])
@pytest.mark.parametrize("bits", [2, 4, 5], ids=lambda b: f"k{b}")
def test_grouped_swiglu_matches_the_reference(bits, dtype, intermediate):
    """``kbit_linear::grouped_swiglu``: silu(gate) * up of each group's rows (fused into the
    kernel's stores when the gate half ends on an n-tile, the unfused ops otherwise); rows no
    group names are unspecified (the op does not fill them)."""
    counts, used = [70, 0, 300, 17], [1, 2, 3, 1]
    args, dense = _gate_up(counts, used, intermediate, 520, bits, dtype)
    x = args[0]
    out = torch.ops.kbit_linear.grouped_swiglu(*args, bits, intermediate, 300)
    assert out.shape == (x.shape[0], intermediate) and out.dtype == dtype
    _check_swiglu(out, x, dense, counts, used)


@pytest.mark.parametrize("tile", hopper.TOKEN_TILES)
def test_fused_swiglu_at_every_token_tile(tile):
    """The fused SwiGLU stores (gate tile, then up tile in place) with each token tile forced:
    groups below, at and past the tile, an empty one and one expert twice."""
    intermediate, k, bits = 256, 520, 4
    counts, used = [tile - 3, 0, tile, 2 * tile + 5, 1], [1, 2, 3, 1, 0]
    for dtype in DTYPES:
        (x, packed, absmax, codebook, ts, groups), dense = _gate_up(counts, used, intermediate, k, bits, dtype)
        out = torch.full((x.shape[0], intermediate), float("nan"), dtype=dtype, device=DEV)
        plan = grouped.grouped_plan(x.shape[0], groups.shape[1], bits, dtype, packed.shape[2], torch.cuda.current_device(),
                                    token_tile=tile)
        assert grouped.swiglu_fusable(packed.shape[2], intermediate)
        grouped.launch(plan, x, packed, absmax, codebook, ts, groups, out, swiglu=True)
        torch.cuda.synchronize()
        _check_swiglu(out, x, dense, counts, used)


def test_experts_forward_fuses_swiglu_on_the_gpu():
    """A Qwen3-MoE experts module with a fusable intermediate size (256) through the grouped
    path at prefill sizes against the CPU reference forward."""
    transformers = pytest.importorskip("transformers")
    from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeExperts

    from kbit_linear import KbitExperts

    config = transformers.Qwen3MoeConfig(num_experts=6, num_experts_per_tok=2, hidden_size=96, moe_intermediate_size=256)
    torch.manual_seed(0)
    dense = Qwen3MoeExperts(config)  # parameters allocated, not initialized: draw them
    with torch.no_grad():
        for p in dense.parameters():
            p.normal_(0.0, 0.05)
    k = KbitExperts.from_experts(dense, bits=4)
    gpu = KbitExperts.from_experts(dense, bits=4).cuda()
    g = torch.Generator().manual_seed(3)
    x = torch.randn(200, 96, generator=g)
    logits = torch.randn(200, 6, generator=g)
    weights, index = torch.topk(torch.softmax(logits, -1), 2, dim=-1)
    ref = k(x, index, weights)
    with torch.no_grad():
        got = gpu(x.to(DEV, torch.bfloat16), index.to(DEV), weights.to(DEV))
    assert float((got.float().cpu() - ref).norm() / ref.norm()) < 2e-2
