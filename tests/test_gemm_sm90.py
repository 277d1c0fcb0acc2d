"""The Hopper warpgroup-MMA GEMM (``kernels/gemm_sm90.cu``) against the reference (marker ``cuda``).

Runs on GPUs of compute capability 9.0 only (H100, H200); skipped elsewhere. (CUDA-graph capture
of the wgmma paths is parametrized into ``test_kernels_cuda.py``'s graph test.) Same tolerances as
``test_kernels_cuda.py`` (fp32 reference of the dequantized weight; outputs NaN-poisoned first).
M covers the token tiles the tables pick (64: M <= 64, 128: M <= 128, 256 above; on an H200 also 16 and
32 up to M = 16 / 32) with full and ragged last tiles; ``test_every_token_tile_forced`` runs each of
``hopper.TOKEN_TILES``.
"""

from __future__ import annotations

import itertools

import pytest
import torch

import kbit_linear  # noqa: F401  (op schemas)
from kbit_linear import format as fmt
from kbit_linear import weight_layout
from kbit_linear.backends import cuda as kcuda
from kbit_linear.backends.cuda import hopper, loader, ops, plans, tuning

from test_kernels_cuda import DEV, DTYPES, REL_TOL, _check_gemm, _gemm, _reference, _rel_err, _weight

pytestmark = [
    pytest.mark.cuda,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs an NVIDIA GPU"),
    pytest.mark.skipif(not loader.cupy_available(), reason="needs CuPy (pip install 'kbit-linear[cuda]')"),
    pytest.mark.skipif(torch.cuda.is_available() and torch.cuda.get_device_capability() != (9, 0),
                       reason="the wgmma kernel needs compute capability 9.0"),
]

BITS = fmt.SUPPORTED_BITS
SHAPES = [(576, 192), (100, 33), (200, 300), (1536, 576), (8, 130), (40, 257)]  # (in, out): odd K and N, K below one k-tile
M_VALUES = [1, 17, 63, 64, 65, 128, 129, 256, 300, 777]
SPLITS = [{"path": "wgmma"}, {"path": "wgmma", "split_k": 1}, {"path": "wgmma-splitk"}, {"path": "wgmma", "split_k": 3}]


def _cases():
    for i, (bits, dtype, m) in enumerate(itertools.product(BITS, DTYPES, M_VALUES)):
        k, n = SHAPES[i % len(SHAPES)]
        yield pytest.param(m, k, n, bits, dtype, SPLITS[i % len(SPLITS)],
                           id=f"b{bits}-{str(dtype)[6:]}-{k}x{n}-M{m}-s{i % len(SPLITS)}")


@pytest.mark.parametrize("m,k,n,bits,dtype,kw", list(_cases()))
def test_wgmma_gemm(m, k, n, bits, dtype, kw):
    _check_gemm(m, k, n, bits, dtype, **kw)


@pytest.mark.parametrize("tile", hopper.TOKEN_TILES)
@pytest.mark.parametrize("bits", BITS)
def test_every_token_tile_forced(tile, bits, monkeypatch):
    # Each tile over M below, at and past it (ragged last tiles), unsplit, split in the workspace
    # and in clusters where the planner allows them; fp16 and bf16 alternate.
    monkeypatch.setattr(tuning, "WGMMA_TOKEN_TILES", {"default": ((tile, 1 << 30),)})  # every GPU's row
    plans.clear()
    try:
        for i, m in enumerate(sorted({1, tile - 1, tile, tile + 1, 2 * tile + 3})):
            k, n = ((1536, 576), (200, 300), (2048, 260))[i % 3]
            kw = ({}, {"split_k": 1}, {"split_k": 2}, {"split_k": 4}, {"split_k": 3})[i % 5]
            plan = ops._plan(m, n, k, bits, DTYPES[i % 2], torch.cuda.current_device(), "wgmma", kw.get("split_k"))
            assert plan.token_tile == tile
            _check_gemm(m, k, n, bits, DTYPES[i % 2], path="wgmma", **kw)
    finally:
        plans.clear()


def test_wgmma_stream_k_range_spans_partial_full_partial_tiles():
    # K = 192 (3 k-tiles) over 200 tiles of 256 x 128: a block's range of 5 k-iterations ends one
    # tile, covers the next whole and starts a third (split epilogue, direct store, split again).
    dev = torch.cuda.current_device()
    plan = ops._plan(1000, 6400, 192, 4, torch.float16, dev, "wgmma", None)
    if not (plan.iters > 3 + 1 and plan.iters % 3 != 0):  # the range length follows the SM count
        pytest.skip(f"this GPU's plan cuts ranges of {plan.iters} k-iterations: no partial-full-partial range")
    _check_gemm(1000, 192, 6400, 4, torch.float16, path="wgmma")


@pytest.mark.parametrize("bits", BITS)
@pytest.mark.parametrize("m", [64, 256, 2048])
def test_wgmma_llama_shape(bits, m):
    _check_gemm(m, 4096, 14336 if m == 256 else 4096, bits, torch.float16, path="wgmma")


@pytest.mark.parametrize("bits", BITS)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("m", [64, 200])
def test_wgmma_identity_gives_dequantized_weight(bits, dtype, m):
    # x = rows of I: out = rows of W_hat^T up to the rounding of each weight (isolates the
    # dequantization and the fragment layout from accumulation error).
    k, n = 200, 300
    qw = _weight(n, k, bits)
    x = torch.eye(k, device=DEV, dtype=dtype)[:m]
    out = _gemm(x, qw, path="wgmma")
    ref = fmt.dequantize(qw, torch.float32).t()[:m]
    tol = {torch.float16: 2e-3, torch.bfloat16: 1.6e-2}[dtype]
    torch.testing.assert_close(out.float(), ref, rtol=tol, atol=tol * ref.abs().max().item() * 1e-3)


@pytest.mark.parametrize("bits", BITS)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("path", ["wgmma", "wgmma-splitk"])
def test_wgmma_bias_and_leading_dims(bits, dtype, path):
    qw = _weight(300, 200, bits)
    x = torch.randn(3, 41, 200, device=DEV, dtype=dtype)
    bias = torch.randn(300, device=DEV, dtype=dtype)
    out = _gemm(x, qw, bias, path=path)
    assert out.shape == (3, 41, 300)
    assert _rel_err(out, _reference(x, qw, bias)) < REL_TOL[dtype]


def test_wgmma_custom_codebook():
    n, k, bits = 260, 320, 3
    w = torch.randn(n, k, device=DEV)
    qw = fmt.quantize(w, bits, codebook=torch.linspace(-0.9, 1.0, 1 << bits, device=DEV))
    x = torch.randn(100, k, device=DEV, dtype=torch.bfloat16)
    assert _rel_err(_gemm(x, qw, path="wgmma"), _reference(x, qw)) < REL_TOL[torch.bfloat16]


@pytest.mark.parametrize("bits", [4, 5])
@pytest.mark.parametrize("m", [17, 100, 300, 700, 1000])
@pytest.mark.parametrize("k,n", [(4096, 4096), (8192, 16384)], ids=["4096x4096", "large"])
def test_dispatch_takes_wgmma_for_its_rows(m, k, n, bits):
    first, last = kcuda.tuning.wgmma_rows(loader.device_properties(torch.cuda.current_device()).name, n * k, bits)
    path = kcuda.gemm_path(m, n, k, bits, torch.float16)
    assert path.startswith("wgmma") == (first <= m <= last), path
    if n * k < kcuda.tuning.DECODE_LARGE_WEIGHT:
        _check_gemm(m, k, n, bits, torch.float16)


def test_a_nearly_full_wave_of_tiles_runs_unsplit():
    # 4096->4096 at M = 1024: 128 tiles of 256 tokens on 132 SMs fill the one wave 97 %, so no
    # tile is split (stream-K's fix-up would cost more than the idle 3 %).
    dev = torch.cuda.current_device()
    if loader.device_properties(dev).sm_count * 0.9 > 128:
        pytest.skip("the case needs a GPU with at most 142 SMs")
    plan = ops._make_plan(1024, 4096, 4096, 4, torch.float16, dev, None, None)
    assert plan.path == "wgmma" and plan.grid == 128 and not plan.split
    _check_gemm(1024, 4096, 4096, 4, torch.float16)


@pytest.mark.parametrize("bits", [2, 5])
def test_a_few_tiles_split_k_into_equal_pieces(bits):
    # 4096->1024 at M = 200: 8 n-tiles, 64 k-tiles; the planner cuts each tile's K into equal
    # pieces, one per block (the time model of tuning.WGMMA_KTILE_US).
    dev = torch.cuda.current_device()
    plan = ops._make_plan(200, 1024, 4096, bits, torch.float16, dev, "wgmma", None)
    if not plan.split:
        pytest.skip(f"this GPU's plan does not split K ({plan.grid} blocks)")
    assert 64 % plan.iters == 0 and plan.grid == plan.tiles * (64 // plan.iters)
    _check_gemm(200, 4096, 1024, bits, torch.float16, path="wgmma")


# (M, K, N): K of 64, 16, 8 and 16 k-tiles, the last ragged (every split into 2, 4 and 8
# aligned), and of 5 k-tiles (none aligned: the workspace path); ragged M and N.
CLUSTER_SHAPES = [(64, 4096, 1000), (200, 1024, 300), (17, 512, 130), (256, 300, 256), (129, 1000, 384)]


@pytest.fixture
def clusters_of_two_four_and_eight(monkeypatch):
    # The kernel takes clusters of 2, 4 and 8 whatever the planner's table
    # (tuning.WGMMA_CLUSTER_SPLITS) allows.
    monkeypatch.setattr(kcuda.tuning, "WGMMA_CLUSTER_SPLITS", (2, 4, 8))
    plans.clear()
    yield
    plans.clear()


@pytest.mark.parametrize("split", [2, 4, 8])
@pytest.mark.parametrize("bits", BITS)
@pytest.mark.parametrize("m,k,n", CLUSTER_SHAPES, ids=lambda v: str(v))
def test_an_aligned_split_sums_in_a_cluster(m, k, n, bits, split, clusters_of_two_four_and_eight):
    dev = torch.cuda.current_device()
    plan = ops._plan(m, n, k, bits, torch.float16, dev, "wgmma", split)
    k_tiles = -(-k // fmt.TILE_K)
    resident = plan.kernel.max_active_clusters(split, hopper.THREADS, plan.smem) * split
    aligned = k_tiles % split == 0 and (plan.token_tile // 8) % split == 0 and plan.grid <= resident
    assert plan.cluster == (split if aligned else 1), (plan.cluster, plan.iters, k_tiles, plan.grid, resident)
    _check_gemm(m, k, n, bits, torch.float16, path="wgmma", split_k=split)
    _check_gemm(m, k, n, bits, torch.bfloat16, path="wgmma", split_k=split)


@pytest.mark.parametrize("split", [2, 8])
def test_a_cluster_split_of_pair_codes_with_bias_is_deterministic(split, clusters_of_two_four_and_eight):
    # The 4-bit layout a GPU layer holds, a bias added by the owner of each share, the same
    # output bit for bit at every launch (the shares are summed in rank order).
    qw = _weight(384, 2048, 4)
    qw = fmt.KbitWeight(weight_layout.device_form(qw.packed, 4), qw.absmax, qw.codebook, qw.tensor_scale, 4, 384, 2048)
    x = torch.randn(100, 2048, device=DEV, dtype=torch.bfloat16)
    bias = torch.randn(384, device=DEV, dtype=torch.bfloat16)
    assert ops._plan(100, 384, 2048, 4, torch.bfloat16, torch.cuda.current_device(), "wgmma", split, True).cluster == split
    out = _gemm(x, qw, bias, path="wgmma", split_k=split)
    err = _rel_err(out, _reference(x, qw, bias))
    assert err < REL_TOL[torch.bfloat16], err
    for _ in range(3):
        torch.testing.assert_close(_gemm(x, qw, bias, path="wgmma", split_k=split), out, rtol=0, atol=0)


def test_without_clusters_an_aligned_split_uses_the_workspace(monkeypatch):
    monkeypatch.setattr(kcuda.tuning, "WGMMA_CLUSTER_SPLITS", ())
    plans.clear()
    try:
        plan = ops._plan(200, 300, 1024, 3, torch.float16, torch.cuda.current_device(), "wgmma", 4)
        assert plan.split and plan.cluster == 1
        _check_gemm(200, 1024, 300, 3, torch.float16, path="wgmma", split_k=4)
    finally:
        plans.clear()  # the plans made without clusters


def test_wgmma_path_refused_without_sm90(monkeypatch):
    # Planned directly (the plan cache may already hold this problem): a GPU without wgmma is
    # refused when the path is forced, and the automatic dispatch does not pick it.
    monkeypatch.setattr(hopper, "supported", lambda index: False)
    dev = torch.cuda.current_device()
    with pytest.raises(ValueError, match="compute capability 9.0"):
        ops._make_plan(40, 192, 576, 4, torch.float16, dev, "wgmma", None)
    assert not ops._make_plan(40, 192, 576, 4, torch.float16, dev, None, None).path.startswith("wgmma")


def test_wgmma_under_torch_compile():
    qw = _weight(576, 1536, 2)

    def f(x):
        y = torch.ops.kbit_linear.gemm(x, qw.packed, qw.absmax, qw.codebook, qw.tensor_scale, 2, 576, None)
        return torch.relu(y) * 2.0

    x = torch.randn(130, 1536, device=DEV, dtype=torch.bfloat16)
    assert kcuda.gemm_path(130, 576, 1536, 2, torch.bfloat16).startswith("wgmma")
    torch.testing.assert_close(torch.compile(f, fullgraph=True)(x), f(x), rtol=0, atol=0)
