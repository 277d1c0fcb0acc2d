"""The small-M decode kernel (``kernels/decode.cu``) against the pure-PyTorch reference.

GPU tests carry the ``cuda`` marker and skip without a GPU or CuPy; the argument checks at the
end run anywhere.

Weights are random tiled bit-planes and E4M4 codes (every bit pattern is a valid weight), drawn
fresh per shape and bits, plus real quantized weights, all-subnormal scales and a user codebook.
x is drawn fresh per case and the output is NaN-poisoned before each call, so an element the
kernel skips shows up. Tolerance: the kernel rounds each decoded weight to x's type (relative
error 2^-11 for fp16, 2^-8 for bf16) and accumulates in fp32, so against the fp32 reference
``F.linear(x.float(), dequantize(W))`` the relative Frobenius error is about 1e-3 (fp16) and
5e-3 (bf16); the tests allow 5e-3 and 2e-2.
"""

from __future__ import annotations

import dataclasses
import functools

import pytest
import torch
import torch.nn.functional as F

from kbit_linear import format as fmt
from kbit_linear.backends.cuda import decode, loader, plans
from kbit_linear.backends.cuda.tuning import all_decode_configs
from kbit_linear.backends.cuda import experts as kexperts

_GPU_MARKS = (
    pytest.mark.cuda,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs an NVIDIA GPU"),
    pytest.mark.skipif(not loader.cupy_available(), reason="needs CuPy (pip install 'kbit-linear[cuda]')"),
)


def gpu(fn):
    """Mark a test as a GPU test (marker ``cuda``, skipped without a GPU or CuPy)."""
    for mark in _GPU_MARKS:
        fn = mark(fn)
    return fn


DEV = "cuda"
DTYPES = (torch.float16, torch.bfloat16)
BITS = fmt.SUPPORTED_BITS
MS = (1, 2, 3, 4, 7, 8, 15, 16)
SHAPES = ((576, 192), (4096, 4096), (4096, 14336), (14336, 4096), (100, 33), (200, 300), (1000, 1000), (64, 128))
REL_TOL = {torch.float16: 5e-3, torch.bfloat16: 2e-2}


def _rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    return ((out.float() - ref.float()).norm() / ref.float().norm().clamp_min(1e-30)).item()


def _random_weight(k: int, n: int, bits: int, seed: int, codes: tuple[int, int] = (0x50, 0xD0)) -> fmt.KbitWeight:
    """Random tiled planes and E4M4 codes in ``codes`` (plus some zero blocks) for W[n, k]."""
    g = torch.Generator(device=DEV).manual_seed(seed)
    n_pad, k_pad = fmt.padded_shape(n, k)
    kt, nt = k_pad // fmt.TILE_K, n_pad // fmt.TILE_N
    packed = torch.randint(-(2**31), 2**31 - 1, (kt, nt, fmt.TILE_N, 2, bits), device=DEV, generator=g, dtype=torch.int64).to(torch.int32)
    absmax = torch.randint(codes[0], codes[1], (kt, nt, fmt.TILE_N, 2), device=DEV, generator=g, dtype=torch.int32).to(torch.uint8)
    absmax[torch.rand(absmax.shape, device=DEV, generator=g) < 0.02] = 0  # zero blocks
    ts = torch.tensor([2.0 ** -6], device=DEV)
    return fmt.KbitWeight(packed, absmax, fmt.create_normal_float_codebook(bits, DEV), ts, bits, n, k)


@functools.lru_cache(maxsize=None)
def _cached_weight(k: int, n: int, bits: int) -> tuple[fmt.KbitWeight, torch.Tensor]:
    qw = _random_weight(k, n, bits, seed=k * 7919 + n * 31 + bits)
    return qw, _dequantize_chunked(qw)


@functools.lru_cache(maxsize=1)
def _big_weight(bits: int) -> fmt.KbitWeight:
    return _random_weight(8192, 28672, bits, seed=bits * 101)


def _dequantize_chunked(qw: fmt.KbitWeight, rows: int = 2048) -> torch.Tensor:
    """fp32 ``[N, K]`` from the reference, a slab of n-tiles at a time (the reference unpacks to int64)."""
    parts = []
    step = rows // fmt.TILE_N
    for t0 in range(0, qw.packed.shape[1], step):
        t1 = min(t0 + step, qw.packed.shape[1])
        n = min(qw.out_features, t1 * fmt.TILE_N) - t0 * fmt.TILE_N
        sub = fmt.KbitWeight(qw.packed[:, t0:t1].contiguous(), qw.absmax[:, t0:t1].contiguous(), qw.codebook, qw.tensor_scale,
                             qw.bits, n, qw.in_features)
        parts.append(fmt.dequantize(sub, torch.float32))
    return torch.cat(parts)


def _run(x: torch.Tensor, qw: fmt.KbitWeight, **kw) -> torch.Tensor:
    out = torch.full((x.shape[0], qw.out_features), float("nan"), dtype=x.dtype, device=x.device)
    decode.decode_gemm(x, qw.packed, qw.absmax, qw.codebook, qw.tensor_scale, qw.bits, qw.out_features, out, **kw)
    return out


def _check_against(out: torch.Tensor, x: torch.Tensor, w: torch.Tensor, dtype: torch.dtype) -> None:
    assert not torch.isnan(out).any(), "unwritten (NaN) output elements"
    ref = F.linear(x.float(), w)
    err = _rel_err(out, ref)
    assert err < REL_TOL[dtype], f"relative error {err:.2e}"


@gpu
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: f"{s[0]}to{s[1]}")
@pytest.mark.parametrize("m", MS, ids=lambda m: f"m{m}")
@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: str(d).split(".")[-1])
@pytest.mark.parametrize("bits", BITS, ids=lambda b: f"k{b}")
def test_matches_reference(bits, dtype, m, shape):
    k, n = shape
    qw, w = _cached_weight(k, n, bits)
    x = torch.randn(m, k, device=DEV, dtype=dtype)
    _check_against(_run(x, qw), x, w, dtype)



@gpu
@pytest.mark.parametrize("m", (1, 16), ids=lambda m: f"m{m}")
@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: str(d).split(".")[-1])
@pytest.mark.parametrize("bits", BITS, ids=lambda b: f"k{b}")
def test_large_shape_sampled(bits, dtype, m):
    """8192 -> 28672: the reference on a random sample of 2048 output rows (it is slow in full)."""
    k, n = 8192, 28672
    qw = _big_weight(bits)
    x = torch.randn(m, k, device=DEV, dtype=dtype)
    out = _run(x, qw)
    assert not torch.isnan(out).any(), "unwritten (NaN) output elements"
    tiles = torch.randperm(n // fmt.TILE_N, device="cpu")[:16].sort().values.tolist()
    for t in tiles:
        sub = fmt.KbitWeight(qw.packed[:, t:t + 1].contiguous(), qw.absmax[:, t:t + 1].contiguous(), qw.codebook,
                             qw.tensor_scale, bits, fmt.TILE_N, k)
        ref = F.linear(x.float(), fmt.dequantize(sub, torch.float32))
        err = _rel_err(out[:, t * fmt.TILE_N:(t + 1) * fmt.TILE_N], ref)
        assert err < REL_TOL[dtype], f"rows of n-tile {t}: relative error {err:.2e}"



@gpu
@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: str(d).split(".")[-1])
@pytest.mark.parametrize("bits", BITS, ids=lambda b: f"k{b}")
def test_quantized_weight(bits, dtype):
    """A weight from the reference quantizer (uneven block scales, non-tile shape)."""
    g = torch.Generator(device=DEV).manual_seed(bits)
    w = torch.randn(777, 1333, device=DEV, generator=g) * 0.02
    w[:100, :40] *= 30.0
    qw = fmt.quantize(w, bits)
    for m in (1, 5, 16):
        x = torch.randn(m, 1333, device=DEV, dtype=dtype)
        _check_against(_run(x, qw), x, fmt.dequantize(qw, torch.float32), dtype)



@gpu
@pytest.mark.parametrize("bits", BITS, ids=lambda b: f"k{b}")
def test_subnormal_scales_and_user_codebook(bits):
    """E4M4 codes 0..15 only (zero and subnormal scales) and an asymmetric codebook."""
    qw = _random_weight(1024, 640, bits, seed=bits + 17, codes=(0, 16))
    cb = torch.sort(torch.rand(1 << bits, device=DEV) * 1.6 - 0.7).values
    qw = fmt.KbitWeight(qw.packed, qw.absmax, cb, torch.tensor([4.0], device=DEV), bits, 640, 1024)
    for dtype in DTYPES:
        x = torch.randn(3, 1024, device=DEV, dtype=dtype)
        _check_against(_run(x, qw), x, fmt.dequantize(qw, torch.float32), dtype)



@gpu
def test_split_and_direct_paths_both_exercised():
    """With stream-K, the shape list covers launches with and without split-K (the workspace path)."""
    kinds = set()
    for bits in BITS:
        for k, n in SHAPES:
            _, k_pad = fmt.padded_shape(n, k)
            kinds.add(decode.decode_plan(1, bits, torch.float16, n, k_pad // fmt.TILE_K, schedule_kind="stream-k").split)
    assert kinds == {True, False}


# Launch shapes beyond the tuned ones: several row slots per row tile (NW/KS > 1), one warp
# along K (KS = 1), deeper rings, more row groups per warp.
ALT_CONFIGS = (
    decode.DecodeConfig(16, 4, 2, 1, 1),
    decode.DecodeConfig(8, 1, 2, 1, 2),
    decode.DecodeConfig(16, 8, 1, 2, 1),
    decode.DecodeConfig(4, 2, 4, 1, 2),
)


@gpu
@pytest.mark.parametrize("sched", ("stream-k", "tiles", "tile-split"))
@pytest.mark.parametrize("bits", BITS, ids=lambda b: f"k{b}")
def test_schedules(bits, sched):
    """Every schedule (stream-K, whole row tiles, row tiles split s ways) gives the same result.

    The shapes include one whose row tiles outnumber the SMs (tile-split does not apply there)
    and odd ones whose ranges start and end inside row tiles."""
    ran = 0
    for (k, n), m, dtype in (((4096, 1024), 1, torch.float16), ((1000, 300), 5, torch.bfloat16), ((14336, 4096), 16, torch.float16),
                             ((200, 4000), 3, torch.bfloat16)):
        qw, w = _cached_weight(k, n, bits)
        try:
            decode.decode_plan(m, bits, dtype, n, qw.packed.shape[0], schedule_kind=sched)
        except ValueError as e:
            assert "does not apply" in str(e)
            continue
        x = torch.randn(m, k, device=DEV, dtype=dtype)
        for _ in range(2):  # the second call finds the workspace left zeroed
            _check_against(_run(x, qw, schedule_kind=sched), x, w, dtype)
        ran += 1
    assert ran >= 2


@gpu
@pytest.mark.parametrize("cfg", ALT_CONFIGS, ids=lambda c: f"w{c.warps}k{c.k_warps}r{c.row_groups}d{c.depth}b{c.min_blocks}")
@pytest.mark.parametrize("bits", BITS, ids=lambda b: f"k{b}")
def test_other_launch_shapes(bits, cfg):
    """The kernel is right for launch shapes other than the tuned ones, on every schedule."""
    for (k, n), m, dtype in (((4096, 1024), 1, torch.float16), ((1000, 300), 9, torch.bfloat16), ((576, 192), 16, torch.float16)):
        qw, w = _cached_weight(k, n, bits)
        x = torch.randn(m, k, device=DEV, dtype=dtype)
        for sched in ("auto", "stream-k", "tiles"):
            _check_against(_run(x, qw, config=cfg, schedule_kind=sched), x, w, dtype)



@gpu
@pytest.mark.parametrize("pairs", (False, True), ids=("planes", "pairs"))
@pytest.mark.parametrize("bits", BITS, ids=lambda b: f"k{b}")
def test_every_tuned_launch_shape(bits, pairs):
    """Every launch shape a plan may pick on any GPU (``tuning.all_decode_configs()``), forced, on every schedule
    that applies, from planes and (4 and 5 bits) pair codes: each is right wherever the cost
    model sends a shape to it."""
    if pairs and not fmt.has_pair_codes(bits):
        pytest.skip("pair codes exist for 4 and 5 bits")
    ran = 0
    for (k, n), m, dtype in (((4096, 1024), 1, torch.float16), ((1000, 300), 5, torch.bfloat16), ((2000, 2100), 8, torch.bfloat16),
                             ((576, 192), 16, torch.float16), ((200, 700), 11, torch.bfloat16)):
        qw, w = _cached_weight(k, n, bits)
        if pairs:
            qw = dataclasses.replace(qw, packed=fmt.to_pair_codes(qw.packed))
        x = torch.randn(m, k, device=DEV, dtype=dtype)
        for cfg in all_decode_configs()[(bits, 1 if m <= 8 else 2)]:
            for sched in ("stream-k", "tiles", "tile-split"):
                try:
                    decode.decode_plan(m, bits, dtype, n, qw.packed.shape[0], config=cfg, schedule_kind=sched, pairs=pairs)
                except ValueError as e:
                    assert "does not apply" in str(e)
                    continue
                _check_against(_run(x, qw, config=cfg, schedule_kind=sched), x, w, dtype)
                ran += 1
    assert ran >= 20


@gpu
@pytest.mark.parametrize("seed", range(3))
def test_in_block_reduction_stress(seed):
    """Many launches of random shapes, M, bits, launch shapes and schedules, on two streams at once.

    The warps of a block that share a row tile's K hand their partial sums to the last of them
    through two alternating shared-memory slots ordered by mbarriers; ranges that start or end
    inside row tiles, one-item segments and blocks where some warps hold no item all occur here. Each result is checked
    after both streams finish."""
    g = torch.Generator().manual_seed(seed)
    streams = (torch.cuda.Stream(), torch.cuda.Stream())
    pending = []
    for i in range(24):
        bits = BITS[int(torch.randint(0, len(BITS), (1,), generator=g))]
        k = int(torch.randint(1, 40, (1,), generator=g)) * 64 - int(torch.randint(0, 56, (1,), generator=g)) // 8 * 8
        n = int(torch.randint(1, 3000, (1,), generator=g))
        m = int(torch.randint(1, 17, (1,), generator=g))
        dtype = DTYPES[i % 2]
        cfg = (None,) + ALT_CONFIGS
        config = cfg[int(torch.randint(0, len(cfg), (1,), generator=g))]
        sched = ("auto", "stream-k", "tiles", "tile-split")[int(torch.randint(0, 4, (1,), generator=g))]
        qw, w = _cached_weight(k, n, bits)
        try:
            decode.decode_plan(m, bits, dtype, n, qw.packed.shape[0], config=config, schedule_kind=sched)
        except ValueError:
            sched = "auto"
        x = torch.randn(m, k, device=DEV, dtype=dtype)
        stream = streams[i % 2]
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            outs = [_run(x, qw, config=config, schedule_kind=sched) for _ in range(3)]
        pending.append((outs, x, w, dtype, (k, n, m, bits, config, sched)))
    torch.cuda.synchronize()
    for outs, x, w, dtype, case in pending:
        for out in outs:
            assert not torch.isnan(out).any(), f"{case}: unwritten (NaN) output elements"
            err = _rel_err(out, F.linear(x.float(), w))
            assert err < REL_TOL[dtype], f"{case}: relative error {err:.2e}"


# ---------------------------------------------------------------------------------------
# grouped launches (mixture-of-experts): several experts' weights, each with its own rows
# ---------------------------------------------------------------------------------------


@functools.lru_cache(maxsize=None)
def _experts(e: int, k: int, n: int, bits: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """E random experts stacked as KbitExperts stores them: packed, absmax, codebook, tensor
    scales (a different power of two per expert) and the fp32 dense weights [E, N, K]."""
    ws = [_random_weight(k, n, bits, seed=1000 * e + 17 * k + n + 3 * i + bits) for i in range(e)]
    ts = torch.tensor([2.0 ** -(4 + i % 3) for i in range(e)], device=DEV)
    dense = torch.stack([_dequantize_chunked(fmt.KbitWeight(w.packed, w.absmax, w.codebook, ts[i:i + 1], bits, n, k))
                         for i, w in enumerate(ws)])
    return torch.stack([w.packed for w in ws]), torch.stack([w.absmax for w in ws]), ws[0].codebook, ts, dense


def _groups(counts: list[int], experts: list[int]) -> torch.Tensor:
    """int32 [3, G]: expert, first row, rows; the groups' rows back to back from row 0."""
    row0 = [sum(counts[:i]) for i in range(len(counts))]
    return torch.tensor([experts, row0, counts], dtype=torch.int32, device=DEV)


def _run_grouped(x, packed, absmax, codebook, ts, groups, bits, n, max_rows):
    out = torch.full((x.shape[0], n), float("nan"), dtype=x.dtype, device=DEV)
    decode.grouped_decode_gemm(x, packed, absmax, codebook, ts, groups, bits, n, out, max_rows)
    return out


def _check_grouped(out, x, dense, counts, experts, dtype):
    row = 0
    for c, e in zip(counts, experts):
        if c:
            _check_against(out[row:row + c], x[row:row + c], dense[e], dtype)
        row += c
    assert torch.isnan(out[row:]).all(), "rows no group names were written"


@gpu
@pytest.mark.parametrize("bits", BITS, ids=lambda b: f"k{b}")
def test_grouped_reads_one_row_broadcast_to_every_row(bits):
    """x as one row expanded to every row (stride 0: a decode step of one token, which the
    experts module passes without gathering it): the same products as the rows materialized,
    through the launch and through the op, groups of one and several rows, one and two n8
    fragments."""
    k, n = 1000, 700
    packed, absmax, codebook, ts, dense = _experts(6, k, n, bits)
    for max_rows, dtype in ((1, torch.float16), (3, torch.bfloat16), (12, torch.float16)):
        counts, experts = [max_rows, 0, 1, max_rows], [0, 1, 4, 5]
        xb = torch.randn(1, k, device=DEV, dtype=dtype).expand(sum(counts), k)
        assert decode.broadcast_rows(xb) and not decode.broadcast_rows(xb.contiguous())
        groups = _groups(counts, experts)
        plan = decode.decode_plan(max_rows, bits, dtype, n, packed.shape[1], torch.device(DEV), groups=len(counts))
        out = torch.full((sum(counts), n), float("nan"), dtype=dtype, device=DEV)
        decode.launch_grouped(plan, xb, packed, absmax, codebook, ts, groups, out)
        _check_grouped(out, xb.contiguous(), dense, counts, experts, dtype)
        via_op = torch.ops.kbit_linear.grouped_gemm(xb, packed, absmax, codebook, ts, groups, bits, n, max_rows)
        _check_grouped(via_op, xb.contiguous(), dense, counts, experts, dtype)


@gpu
@pytest.mark.parametrize("shape", ((576, 192), (1000, 1000), (2048, 1536), (100, 33)), ids=lambda s: f"{s[0]}to{s[1]}")
@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: str(d).split(".")[-1])
@pytest.mark.parametrize("bits", BITS, ids=lambda b: f"k{b}")
def test_grouped_matches_per_expert_reference(bits, dtype, shape):
    """Random groups (some empty, an expert used twice, 1..max_rows rows), spare rows at the end
    that no group names (they must stay untouched), for one and two n8 fragments."""
    k, n = shape
    packed, absmax, codebook, ts, dense = _experts(6, k, n, bits)
    g = torch.Generator().manual_seed(k + n + bits)
    for max_rows in (1, 5, 8, 16):
        counts = [int(torch.randint(0, max_rows + 1, (1,), generator=g)) for _ in range(7)]
        counts[1] = 0  # an empty group
        counts[2] = max_rows  # a full one
        experts = [int(torch.randint(0, 6, (1,), generator=g)) for _ in range(7)]
        experts[3] = experts[2]
        x = torch.randn(sum(counts) + 3, k, device=DEV, dtype=dtype)
        out = _run_grouped(x, packed, absmax, codebook, ts, _groups(counts, experts), bits, n, max_rows)
        _check_grouped(out, x, dense, counts, experts, dtype)


@gpu
@pytest.mark.parametrize("bits", (2, 4), ids=lambda b: f"k{b}")
def test_grouped_large_and_split(bits):
    """Few groups of a tall expert (the stacked problem splits K over blocks) and many small groups."""
    for e, k, n, counts in ((2, 4096, 3072, [1, 3]), (16, 1024, 512, [1] * 16), (8, 2048, 256, [2, 0, 0, 1, 0, 4, 0, 1])):
        packed, absmax, codebook, ts, dense = _experts(e, k, n, bits)
        experts = list(range(e))[::-1][: len(counts)]
        for dtype in DTYPES:
            x = torch.randn(sum(counts), k, device=DEV, dtype=dtype)
            out = _run_grouped(x, packed, absmax, codebook, ts, _groups(counts, experts), bits, n, max(counts))
            _check_grouped(out, x, dense, counts, experts, dtype)


@gpu
@pytest.mark.parametrize("bits", (2, 4), ids=lambda b: f"k{b}")
def test_grouped_whole_tile_plan_runs_stream_k_when_the_used_groups_share_unevenly(bits):
    """A whole-tile grouped plan made for every group entry: when fewer of them hold rows, the used
    row tiles may share out unevenly over the grid and the launch runs stream-K instead
    (decode.cu's grouped_align, which needs the split-K scratch); otherwise it keeps whole tiles.
    One count of each kind must match the reference."""
    k, k_tiles = 4096, 64

    def used_counts(e: int, n: int) -> tuple[list[int], list[int]] | None:
        """Used-group counts that switch and that keep whole tiles under grouped_align's rule,
        for the plan of (e groups, n rows); None unless the plan is whole-tile and both occur."""
        plan = decode.decode_plan(1, bits, torch.float16, n, k_tiles, groups=e)
        if plan.schedule != "tiles":
            return None
        assert plan.stream_k_slack >= 0 and plan.split, plan  # a whole-tile grouped plan may run split
        kc, rt_per_group = (k_tiles + 1) // 2, -(-n // plan.config.tile_rows)

        def switches(used: int) -> bool:
            used_rt = used * rt_per_group
            return -(-used_rt // plan.grid) * kc - -(-used_rt * kc // plan.grid) > plan.stream_k_slack

        switching = [u for u in range(1, e + 1) if switches(u)]
        keeping = [u for u in range(1, e + 1) if not switches(u)]
        return (switching, keeping) if switching and keeping else None

    # The plan depends on the GPU's SM count: take the first shape that exercises both ways.
    found = next(((e, n, c) for e in (8, 6, 12) for n in (4096, 2048, 6144) if (c := used_counts(e, n))), None)
    if found is None:
        pytest.skip("no whole-tile grouped plan with both outcomes among the shapes tried on this GPU")
    e, n, (switching, keeping) = found
    packed, absmax, codebook, ts, dense = _experts(e, k, n, bits)
    assert packed.shape[1] == k_tiles
    for used in (switching[0], keeping[-1]):
        counts = [1] * used + [0] * (e - used)
        experts = [(3 * i + 1) % e for i in range(e)]
        for dtype in DTYPES:
            x = torch.randn(sum(counts) + 2, k, device=DEV, dtype=dtype)
            out = _run_grouped(x, packed, absmax, codebook, ts, _groups(counts, experts), bits, n, 1)
            _check_grouped(out, x, dense, counts, experts, dtype)


@gpu
def test_grouped_in_a_cuda_graph():
    """The groups are read on the device: a captured launch replays with new groups and new x."""
    bits, k, n = 4, 1000, 700
    packed, absmax, codebook, ts, dense = _experts(5, k, n, bits)
    x = torch.randn(8, k, device=DEV, dtype=torch.float16)
    groups = _groups([3, 0, 5], [4, 1, 0])
    out = torch.full((8, n), float("nan"), dtype=x.dtype, device=DEV)
    decode.grouped_decode_gemm(x, packed, absmax, codebook, ts, groups, bits, n, out, 8)  # compile and plan first
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        decode.grouped_decode_gemm(x, packed, absmax, codebook, ts, groups, bits, n, out, 8)
    for counts, experts in (([3, 0, 5], [4, 1, 0]), ([1, 6, 1], [2, 3, 4]), ([0, 8, 0], [0, 0, 0])):
        groups.copy_(_groups(counts, experts))
        x.copy_(torch.randn(8, k, device=DEV, dtype=x.dtype))
        out.fill_(float("nan"))
        graph.replay()
        torch.cuda.synchronize()
        _check_grouped(out, x, dense, counts, experts, torch.float16)


def test_grouped_rejects_bad_arguments():
    """Argument checks that need no kernel (run anywhere)."""
    packed = torch.zeros(2, 1, 1, 128, 2, 4, dtype=torch.int32)
    absmax = torch.zeros(2, 1, 1, 128, 2, dtype=torch.uint8)
    cb, ts = torch.zeros(16), torch.ones(2)
    x, out = torch.zeros(3, 64, dtype=torch.float16), torch.zeros(3, 100, dtype=torch.float16)
    groups = torch.zeros(3, 2, dtype=torch.int32)
    with pytest.raises(ValueError, match="max_rows"):
        decode.grouped_decode_gemm(x, packed, absmax, cb, ts, groups, 4, 100, out, 17)
    with pytest.raises(ValueError, match="packed must be"):
        decode.grouped_decode_gemm(x, packed[0], absmax, cb, ts, groups, 4, 100, out, 4)
    with pytest.raises(ValueError, match="experts"):
        decode.grouped_decode_gemm(x, packed, absmax[:1], cb, ts, groups, 4, 100, out, 4)
    with pytest.raises(ValueError, match="CUDA"):
        decode.grouped_decode_gemm(x, packed, absmax, cb, ts, groups, 4, 100, out, 4)


@gpu
@pytest.mark.parametrize("bits", (2, 5), ids=lambda b: f"k{b}")
def test_repeated_calls_streams_and_graph(bits):
    """The split-K workspace is left zeroed: repeated calls, a second stream and a CUDA graph agree."""
    k, n, dtype = 14336, 4096, torch.float16
    qw, w = _cached_weight(k, n, bits)
    assert decode.decode_plan(4, bits, dtype, n, qw.packed.shape[0], schedule_kind="stream-k").split
    x = torch.randn(4, k, device=DEV, dtype=dtype)
    run = functools.partial(_run, schedule_kind="stream-k")  # the workspace path
    first = run(x, qw)
    _check_against(first, x, w, dtype)
    for _ in range(3):
        again = run(x, qw)
        _check_against(again, x, w, dtype)
        assert _rel_err(again, first) < 1e-3  # only the order of the fp32 atomic adds differs
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        res = run(x, qw)
    torch.cuda.current_stream().wait_stream(side)
    _check_against(res, x, w, dtype)

    static_x = x.clone()
    static_out = torch.full((4, n), float("nan"), dtype=dtype, device=DEV)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        decode.decode_gemm(static_x, qw.packed, qw.absmax, qw.codebook, qw.tensor_scale, bits, n, static_out, schedule_kind="stream-k")
    for _ in range(3):
        static_x.copy_(torch.randn(4, k, device=DEV, dtype=dtype))
        static_out.fill_(float("nan"))
        graph.replay()
        _check_against(static_out, static_x, w, dtype)



@gpu
def test_unaligned_and_strided_x():
    """x that is not 16-byte aligned, not contiguous, or whose K is not a multiple of 8."""
    bits, dtype = 4, torch.bfloat16
    qw, w = _cached_weight(1000, 1000, bits)
    base = torch.randn(5, 1001, device=DEV, dtype=dtype)
    flat = torch.randn(5 * 1000 + 1, device=DEV, dtype=dtype)
    for x in (base[:, 1:], base[:, :1000].t().contiguous().t(), flat[1:].view(5, 1000)):
        assert x.shape == (5, 1000)
        _check_against(_run(x, qw), x, w, dtype)



def _unit_gain(qw: fmt.KbitWeight, w: torch.Tensor) -> tuple[fmt.KbitWeight, torch.Tensor]:
    """The same weight with its tensor scale set (to a power of two) so that W keeps x's size:
    a chain of calls then stays in range."""
    gain = w.norm().item() / w.shape[1] ** 0.5  # how much W scales a random x
    ts = qw.tensor_scale / 2.0 ** round(torch.log2(torch.tensor(gain)).item())
    return fmt.KbitWeight(qw.packed, qw.absmax, qw.codebook, ts, qw.bits, qw.out_features, qw.in_features), w * (ts / qw.tensor_scale)


@gpu
@pytest.mark.parametrize("pdl", (True, False), ids=("pdl", "plain"))
@pytest.mark.parametrize("graph", (False, True), ids=("eager", "graph"))
def test_back_to_back_calls_wait_for_their_inputs(pdl, graph):
    """Back-to-back launches (programmatic or not) read what the previous kernel wrote and never
    write what it still reads: a chain where each call's x is the previous call's output, a last
    call that overwrites the previous call's x, and weights copied in by the kernel just before
    the call. Every buffer starts NaN, so reading too early shows up."""
    old = loader.set_programmatic_launch(pdl)
    try:
        bits, dtype, k = 4, torch.float16, 4096
        qw, w = _unit_gain(*_cached_weight(k, k, bits))
        other, w_other = _unit_gain(*_cached_weight(k, k, 3 if bits != 3 else 2))
        if torch.cuda.get_device_capability() >= (9, 0):  # the chain really overlaps there
            assert decode.decode_plan(2, bits, dtype, k, qw.packed.shape[0]).programmatic
        packed_buf = torch.empty_like(qw.packed)
        qw_buf = fmt.KbitWeight(packed_buf, qw.absmax, qw.codebook, qw.tensor_scale, bits, k, k)
        x0 = torch.randn(2, k, device=DEV, dtype=dtype)
        bufs = [torch.full((2, k), float("nan"), dtype=dtype, device=DEV) for _ in range(6)]
        y_other = torch.full((2, k), float("nan"), dtype=dtype, device=DEV)

        def chain() -> None:
            bufs[0].copy_(x0)
            packed_buf.fill_(0)
            for i in range(4):  # x of each call = the previous call's output
                decode.decode_gemm(bufs[i], qw.packed, qw.absmax, qw.codebook, qw.tensor_scale, bits, k, bufs[i + 1])
            # out of this call = x of the previous call (it must not start writing early)
            decode.decode_gemm(bufs[4], qw.packed, qw.absmax, qw.codebook, qw.tensor_scale, bits, k, bufs[3])
            decode.decode_gemm(bufs[3], other.packed, other.absmax, other.codebook, other.tensor_scale, other.bits, k, y_other)
            packed_buf.copy_(qw.packed)  # weights written by the kernel just before the call
            decode.decode_gemm(bufs[1], qw_buf.packed, qw_buf.absmax, qw_buf.codebook, qw_buf.tensor_scale, bits, k, bufs[5])

        if graph:
            chain()  # warm-up: plans, kernels, split-K buffers
            torch.cuda.synchronize()
            g = torch.cuda.CUDAGraph()
            with torch.cuda.graph(g):
                chain()
            for t in bufs + [y_other]:
                t.fill_(float("nan"))
            g.replay()
        else:
            chain()
        torch.cuda.synchronize()
        refs = [x0.float()]
        for _ in range(5):
            refs.append(F.linear(refs[-1].to(dtype).float(), w))
        assert not torch.isnan(torch.stack(bufs[1:3] + bufs[4:])).any(), "a call read its input before it was written"
        for i in (1, 2, 4):
            assert _rel_err(bufs[i], refs[i]) < 2e-2, f"call {i}: relative error {_rel_err(bufs[i], refs[i]):.2e}"
        assert _rel_err(bufs[3], refs[5]) < 3e-2
        ref_other = F.linear(refs[5].to(dtype).float(), w_other)
        assert _rel_err(y_other, ref_other) < 3e-2
        _check_against(bufs[5], bufs[1], w, dtype)
        if pdl:
            assert loader.programmatic_launch_enabled(), "programmatic launch fell back to plain launches"
    finally:
        loader.set_programmatic_launch(old)


@gpu
@pytest.mark.parametrize("pdl", (True, False), ids=("pdl", "plain"))
@pytest.mark.parametrize("graph", (False, True), ids=("eager", "graph"))
def test_weights_written_by_the_previous_kernel(pdl, graph):
    """A call whose packed weight is the output of the kernel launched just before it (also a
    programmatic launch, which lets the next grid start early) reads the weight as that kernel
    left it: every weight load comes after the wait."""
    old = loader.set_programmatic_launch(pdl)
    try:
        k = n = 1024
        qw, _ = _cached_weight(k, n, 4)
        packed_buf = torch.zeros_like(qw.packed)
        writer_n = packed_buf.numel()  # the writer's fp16 output [2, writer_n] is packed_buf's bytes
        writer, _ = _cached_weight(64, writer_n, 4)
        writer_out = packed_buf.view(torch.float16).view(2, writer_n)
        x_w = torch.randn(2, 64, device=DEV, dtype=torch.float16)
        x = torch.randn(2, k, device=DEV, dtype=torch.float16)
        out = torch.full((2, n), float("nan"), dtype=torch.float16, device=DEV)
        if torch.cuda.get_device_capability() >= (9, 0):
            assert decode.decode_plan(2, 4, torch.float16, n, qw.packed.shape[0]).programmatic
            assert decode.decode_plan(2, 4, torch.float16, writer_n, writer.packed.shape[0]).programmatic

        def pair() -> None:
            decode.decode_gemm(x_w, writer.packed, writer.absmax, writer.codebook, writer.tensor_scale, 4, writer_n, writer_out)
            decode.decode_gemm(x, packed_buf, qw.absmax, qw.codebook, qw.tensor_scale, 4, n, out)

        if graph:
            pair()
            torch.cuda.synchronize()
            g = torch.cuda.CUDAGraph()
            with torch.cuda.graph(g):
                pair()
            packed_buf.zero_()
            out.fill_(float("nan"))
            x_w.copy_(torch.randn_like(x_w))
            torch.cuda.synchronize()
            g.replay()
        else:
            pair()
        torch.cuda.synchronize()
        assert packed_buf.any(), "the writer wrote nothing"
        final = fmt.KbitWeight(packed_buf, qw.absmax, qw.codebook, qw.tensor_scale, 4, n, k)
        _check_against(out, x, _dequantize_chunked(final), torch.float16)
        if pdl:
            assert loader.programmatic_launch_enabled(), "programmatic launch fell back to plain launches"
    finally:
        loader.set_programmatic_launch(old)


def test_grid_may_overlap():
    assert loader.grid_may_overlap(128, 1, 132)  # one block per SM: never two to an SM
    assert loader.grid_may_overlap(264, 2, 132)  # every slot taken
    assert loader.grid_may_overlap(300, 2, 132)  # more than one wave
    assert not loader.grid_may_overlap(128, 2, 132)  # free slots beside its own blocks
    assert not loader.grid_may_overlap(263, 2, 132)
    assert loader.short_grid_may_overlap(132, 132)  # short blocks: up to one per SM, however many fit
    assert not loader.short_grid_may_overlap(133, 132)


def test_programmatic_launch_switch():
    old = loader.set_programmatic_launch(False)
    try:
        assert loader.programmatic_launch_enabled() is False
        assert loader.set_programmatic_launch(True) is False
        assert loader.programmatic_launch_enabled() is True
        with pytest.raises(TypeError, match="enabled"):
            loader.set_programmatic_launch(1)
    finally:
        loader.set_programmatic_launch(old)


# ---------------------------------------------------------------------------------------
# argument checks (no GPU needed: they fail before any launch)
# ---------------------------------------------------------------------------------------


def test_supported_range():
    assert not decode.decode_supported(0, 4, torch.float16, device=0 if torch.cuda.is_available() else None)
    assert not decode.decode_supported(17, 4, torch.float16)
    assert not decode.decode_supported(1, 6, torch.float16)
    assert not decode.decode_supported(1, 4, torch.float32)
    assert not decode.decode_supported(True, 4, torch.float16)
    # ((4 bits + the 4- and 5-bit pair codes) x 2 fragment counts x 2 launch shapes, plus a third
    # shape for each of the six with one fragment, plus a fourth for K = 3, 4 and 4's pair codes
    # with one fragment, plus a fifth and a sixth for K = 4 and 4's pair codes with one fragment)
    # x 2 dtypes x 2 kernels (single, grouped)
    assert len(decode.decode_instances()) == (6 * 2 * 2 + 6 + 3 + 2 * 2) * 2 * 2


def test_device_checks_refuse_what_the_kernels_do_not_run_on():
    # the shared first step of the backend's device checks (loader.runnable_properties)
    assert loader.runnable_properties(torch.device("cpu")) is None
    assert not kexperts.kernels_supported(torch.device("cpu"))
    with pytest.raises(ValueError, match="CUDA"):
        decode.decode_supported(1, 4, torch.float16, device=torch.device("cpu"))


def test_argument_errors():
    qw = fmt.quantize(torch.randn(130, 70), 3)
    ok_x = torch.randn(2, 70, dtype=torch.float16)
    out = torch.empty(2, 130, dtype=torch.float16)
    args = (qw.packed, qw.absmax, qw.codebook, qw.tensor_scale, 3, 130)
    with pytest.raises(TypeError, match="x2d"):
        decode.decode_gemm(ok_x.float(), *args, out)
    with pytest.raises(ValueError, match="x2d"):
        decode.decode_gemm(torch.randn(17, 70, dtype=torch.float16), *args, out)
    with pytest.raises(ValueError, match="CUDA"):
        decode.decode_gemm(ok_x, *args, out)
    with pytest.raises(ValueError, match="bits"):
        decode.decode_gemm(ok_x, qw.packed, qw.absmax, qw.codebook, qw.tensor_scale, 6, 130, out)


# ---------------------------------------------------------------------------------------
# scheduling (pure arithmetic, no GPU)
# ---------------------------------------------------------------------------------------


def _block_ranges(total: int, grid: int, align: int) -> list[tuple[int, int]]:
    """The item ranges the kernel gives its blocks (kbit_decode_gemm: i0, i1)."""
    units = total // align
    return [(align * (b * units // grid), align * ((b + 1) * units // grid)) for b in range(grid)]


@pytest.mark.parametrize("row_tiles,kc", [(128, 32), (448, 32), (896, 64), (6, 5), (1, 1), (32, 112), (7, 3), (200, 1)])
@pytest.mark.parametrize("per_sm", (1, 2))
def test_schedules_cover_every_item_once(row_tiles, kc, per_sm):
    """Every schedule hands each (row tile, chunk) item to exactly one block, within the grid
    limit, and says `split` exactly when some row tile is spread over blocks."""
    total = row_tiles * kc
    for kind in ("stream-k", "tiles", "tile-split", "auto"):
        try:
            sch = decode.schedule(row_tiles, kc, 132, per_sm, 2048.0, kind)
        except ValueError as e:
            assert kind == "tile-split" and "does not apply" in str(e)
            continue
        assert 1 <= sch.grid <= min(total, 132 * per_sm)
        assert kc % sch.align == 0
        ranges = _block_ranges(total, sch.grid, sch.align)
        assert ranges[0][0] == 0 and ranges[-1][1] == total
        assert all(a[1] == b[0] for a, b in zip(ranges, ranges[1:]))
        assert all(i1 > i0 for i0, i1 in ranges), "a block without items"
        owners = {}
        for i0, i1 in ranges:
            for rt in range(i0 // kc, (i1 - 1) // kc + 1):
                owners[rt] = owners.get(rt, 0) + 1
        assert sch.split == any(v > 1 for v in owners.values())
        if kind == "tiles":
            assert not sch.split


def test_schedule_prefers_whole_tiles_and_rejects_bad_kind():
    # 4096 -> 4096 with 32-row tiles: 128 whole tiles beat a split over 132 blocks
    sch = decode.schedule(128, 32, 132, 1, 32 * 128 * 4.25 / 8)
    assert (sch.kind, sch.grid, sch.split) == ("tiles", 128, False)
    # few tall row tiles: K is split over blocks rather than leaving most SMs idle (into fewer
    # pieces than there are SMs: every piece adds to the last contributor's reads)
    sch = decode.schedule(4, 112, 132, 1, 128 * 128 * 4.25 / 8)
    assert sch.split and 66 <= sch.grid <= 132
    with pytest.raises(ValueError, match="kind"):
        decode.schedule(4, 4, 132, 1, 1.0, "fastest")


@pytest.fixture
def faked_device(monkeypatch):
    """Device queries and kernel builds faked (an H100-sized GPU; a kernel is its name): plans
    without a GPU. The plans made meanwhile hold the faked kernels, so they are dropped after."""
    from types import SimpleNamespace

    props = SimpleNamespace(sm_count=132, shared_per_sm=233472, max_shared_per_block=232448)
    monkeypatch.setattr(loader, "device_properties", lambda index: props)
    monkeypatch.setattr(loader, "get_kernel", lambda src, name, dev: name)
    plans.clear()
    yield
    plans.clear()


def test_plan_picks_the_launch_shape_by_cost(faked_device):
    """Narrow row tiles for 4096 output rows, wide ones for 14336 (no GPU: device queries faked)."""
    narrow = decode.decode_plan(1, 4, torch.float16, 4096, 64, device=0)
    wide = decode.decode_plan(1, 4, torch.float16, 14336, 64, device=0)
    assert narrow.config.tile_rows < wide.config.tile_rows
    assert not narrow.split and not wide.split
    assert narrow.kernel == narrow.name


def test_grouped_plans_that_may_cut_a_row_tile_have_the_split_scratch(faked_device):
    """A grouped launch shares out only the hit groups' row tiles, so every grouped plan whose
    blocks' ranges are not whole row tiles keeps the split-K workspace and counters, also where
    its ranges are whole tiles when every group has rows (700 rows of 16-row tiles x 3 groups
    over 132 blocks: 8 chunks each, one row tile each)."""
    for bits in (2, 3, 4, 5):
        for n, k_tiles, groups in ((700, 16, 3), (2048, 32, 8), (1536, 32, 32), (4096, 224, 2), (128, 2, 5)):
            for cfg in (None, decode.DecodeConfig(16, 16, 1, 2, 1), decode.DecodeConfig(16, 1, 2, 1, 1)):
                for kind in decode.SCHEDULES:
                    try:
                        plan = decode.decode_plan(8, bits, torch.float16, n, k_tiles, device=0, config=cfg, schedule_kind=kind,
                                                  groups=groups)
                    except ValueError:  # the schedule does not apply
                        continue
                    kc = (k_tiles + 1) // 2
                    if plan.align != kc or plan.stream_k_slack >= 0:
                        assert plan.split and plan.ws_numel > 0 and plan.counters > 0, (bits, n, groups, cfg, kind, plan)


def test_launch_shapes_per_gpu():
    """A GPU named in DECODE_CONFIGS_BY_GPU plans with its own launch shapes, any other with
    DECODE_CONFIGS'; all_decode_configs holds both (what the build checks and tests cover)."""
    from kbit_linear.backends.cuda import tuning

    h200 = tuning.decode_configs("NVIDIA H200", 4, 1)
    assert h200 == tuning.DECODE_CONFIGS_BY_GPU["H200"][(4, 1)] and set(tuning.DECODE_CONFIGS[(4, 1)]) < set(h200)
    assert tuning.decode_configs("NVIDIA H100 80GB HBM3", 4, 1) == tuning.DECODE_CONFIGS[(4, 1)]
    assert tuning.decode_configs("NVIDIA H200", 3, 1) == tuning.DECODE_CONFIGS[(3, 1)]  # no H200 entry
    every = all_decode_configs()
    assert set(h200) <= set(every[(4, 1)]) and all(set(cs) <= set(every[key]) for key, cs in tuning.DECODE_CONFIGS.items())


def test_decode_config_rejects_bad_shapes():
    with pytest.raises(ValueError, match="k_warps must divide warps"):
        decode.DecodeConfig(16, 3, 2, 1, 1)
    with pytest.raises(ValueError, match=">= 1"):
        decode.DecodeConfig(16, 16, 0, 1, 1)
