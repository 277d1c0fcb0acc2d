"""GPU tests of the fused decode attention over the quantized KV cache (``kernels/kv_attention.cu``)
against the reference (:func:`kbit_linear.kv_format.bucket_attention`).

Caches are drawn fresh per case: random keys (one outlier channel) and values, each position's
width drawn at random among the four (positions past the last complete key block stay at 8 bits,
as in the cache), so every bucket holds tokens and key blocks mix widths. Odd context lengths,
batches with left padding, GQA groups of 1..8, several queries (row chunks past 8 rows), every
head size and query dtype the kernel has. The allocator is NaN-poisoned before each call, so an
output element or a position's mass that is not written shows. The last test runs a tiny model
with ``KbitKVCache`` on the GPU and checks every attention call of a generation (widths change
mid-run) against the reference.
"""

from __future__ import annotations

import math
import zlib

import pytest
import torch
import torch.nn.functional as F

from kbit_linear import _kv_ops
from kbit_linear.kv_cache import cache_keyword
from kbit_linear.backends.cuda import kv_attention as kkv
from kbit_linear.kv_format import (TIERS, KVBucket, KVStore8, bucket_attention, causal_visible, dequantize_bucket, key_block_ranges,
                                   quantize_tokens)

pytestmark = [pytest.mark.cuda, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]


def random_cache(batch: int, heads: int, d: int, length: int, block: int, seed: int,
                 probs: tuple[float, ...] = (0.25, 0.25, 0.25, 0.25)):
    """(buckets, k_block_min, k_block_range, tier) of a random cache on the CPU."""
    g = torch.Generator().manual_seed(seed)
    k = torch.randn(batch, length, heads, d, generator=g)
    k[..., 3] *= 8  # an outlier channel, as real keys have
    v = torch.randn(batch, length, heads, d, generator=g) * 0.5 + 0.2
    nb = length // block
    kmin, krange = key_block_ranges(k[:, :nb * block].reshape(batch, nb, block, heads, d))
    pick = torch.multinomial(torch.tensor(probs, dtype=torch.float64), batch * length, replacement=True, generator=g).reshape(batch, length)
    tier = torch.tensor(TIERS)[pick]
    tier[:, nb * block:] = 8
    buckets = []
    for t in TIERS:
        rows, pos = torch.nonzero(tier == t, as_tuple=True)
        buckets.append(quantize_tokens(k[rows, pos], v[rows, pos], t, rows, pos, batch, kmin, krange, block))
    return buckets, kmin, krange, tier.to(torch.int8)


def _cuda(buckets: list[KVBucket]) -> list[KVBucket]:
    return [KVBucket(bk.bits, **{n: x.cuda() for n, x in bk.tensors().items()}) for bk in buckets]


def _poison(nbytes: int) -> None:
    """Fill the allocator's next blocks with NaN: outputs the kernels do not write stay NaN."""
    for n in (nbytes, 4 * nbytes):
        torch.full((n // 4 + 1,), float("nan"), device="cuda")


def _padding_mask(batch: int, q_len: int, length: int, pad: list[int]) -> torch.Tensor:
    mask = torch.ones(batch, 1, q_len, length, dtype=torch.bool).tril(length - q_len)
    for b, p in enumerate(pad):
        mask[b, :, :, :p] = False
    return mask


@pytest.fixture(params=["whole-key-blocks", "split-tiles"])
def walk(request, monkeypatch) -> str:
    """Both ways the decode block's warps share a split (the host picks one by how many SMs whole
    key blocks would fill, ``kkv._splits``):
    whole key blocks per warp, or every key block's tiles shared among the warps. The planner's
    split sizes stay; the walk is forced (whole key blocks in splits of fewer than 4 leave warps
    without a key block, also a case to cover), and so is a short first split wherever a split
    has more than one key block: about half a split with whole key blocks, all but one key block
    with shared tiles. The kernel reads only the split's range, so these shifts cover the
    planner's own (one key block a warp: 32k tokens at batch 1, too long for these cases). Blocks
    take two KV heads wherever the shape allows (``kkv.pairs_heads``), whatever the plan: the
    planner pairs them only for long splits, which these lengths do not reach."""
    plan = kkv._splits
    monkeypatch.setattr(kkv, "_pair_pays", lambda split_plan: True)

    def forced(key_blocks: int, row_heads: int, resident: int, sm_count: int, sinks_tile: bool = True) -> kkv.SplitPlan:
        kbps = plan(key_blocks, row_heads, resident, sm_count, sinks_tile).key_blocks
        shared = request.param == "split-tiles"
        shift = kbps - 1 if shared else kbps // 2
        return kkv.SplitPlan(kbps, math.ceil((key_blocks + shift) / kbps), shared, shift)

    monkeypatch.setattr(kkv, "_splits", forced)
    return request.param


def _case_id(case) -> str:
    return "b{}-h{}-hq{}-d{}-s{}-bs{}-q{}".format(*case)


CASES = [  # batch, kv heads, query heads, head_dim, length, block, q_len
    (1, 1, 1, 64, 1, 16, 1),
    (1, 2, 8, 128, 37, 16, 1),
    (2, 2, 6, 64, 200, 32, 1),
    (3, 2, 4, 128, 333, 64, 2),
    (1, 1, 8, 256, 129, 16, 3),     # 24 rows: two row chunks
    (2, 4, 32, 128, 1000, 64, 1),   # Llama-3-8B's heads
    (1, 8, 32, 128, 4099, 64, 1),   # many splits
    (1, 4, 32, 128, 300, 64, 3),    # 96 query rows per batch row (the mass kernel's rows past its first 32)
    (1, 2, 8, 256, 4099, 16, 1),    # over 32 splits at head_dim 256 (the combine's two channel chunks)
    (1, 2, 8, 64, 4099, 16, 1),     # and at head_dim 64 (half the combine's threads without channels)
]


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32], ids=str)
@pytest.mark.parametrize("case", CASES, ids=_case_id)
@pytest.mark.parametrize("masked", [False, True], ids=["causal", "padding"])
def test_kernel_matches_reference(case, dtype: torch.dtype, masked: bool, walk: str) -> None:
    _check_against_reference(case, dtype, masked)


# the cases whose blocks take two KV heads (kkv.pairs_heads: G * Q <= 4, an even number of heads)
PAIRED_CASES = [c for c in CASES if kkv.pairs_heads(c[1], c[2] // c[1] * c[6])]


@pytest.mark.parametrize("case", PAIRED_CASES, ids=_case_id)
@pytest.mark.parametrize("masked", [False, True], ids=["causal", "padding"])
def test_one_head_blocks_match_the_reference_where_heads_would_pair(case, masked: bool, walk: str, monkeypatch) -> None:
    """The one-head block on the shapes the host gives to head pairs (so both ways stay covered)."""
    monkeypatch.setattr(kkv, "pairs_heads", lambda kv_heads, rows: False)
    _check_against_reference(case, torch.float16, masked)


def _check_against_reference(case, dtype: torch.dtype, masked: bool) -> None:
    batch, heads, hq, d, length, block, q_len = case
    seed = zlib.crc32(repr((case, str(dtype), masked)).encode())
    buckets, kmin, krange, tier = random_cache(batch, heads, d, length, block, seed)
    g = torch.Generator().manual_seed(seed + 1)
    q = (torch.randn(batch, hq, q_len, d, generator=g) * 2).to(dtype)
    mask = _padding_mask(batch, q_len, length, [0, 5, 17][:batch]) if masked else None
    scaling = d**-0.5
    ref_out, ref_mass = bucket_attention(q.float(), buckets, kmin, krange, block, length, mask, scaling)
    _poison(batch * hq * q_len * max(length, d) * 4)
    out, mass = kkv.kv_decode_attention_cuda(q.cuda(), _cuda(buckets), kmin.cuda(), krange.cuda(), block, length,
                                             tier.cuda(), None if mask is None else mask.cuda(), scaling)
    assert out.dtype == dtype and out.shape == (batch, q_len, hq, d)
    assert not torch.isnan(out).any() and not torch.isnan(mass).any()
    # fp16 operands (q times the key ranges, p times the value scales): ~1e-3 relative
    tol = 2e-2 if dtype == torch.bfloat16 else 1e-2
    err = (out.float().cpu() - ref_out).abs().max() / ref_out.abs().max().clamp_min(1e-6)
    assert err < tol, float(err)
    torch.testing.assert_close(mass.cpu(), ref_mass, atol=2e-3 * hq * q_len, rtol=2e-2)
    torch.testing.assert_close(mass.sum(1).cpu(), ref_mass.sum(1), atol=1e-3 * hq * q_len, rtol=0)


@pytest.mark.parametrize("probs", [(1, 0, 0, 0), (0, 1, 0, 0), (0, 0, 1, 0), (0, 0, 0, 1), (0.5, 0, 0, 0.5)],
                         ids=["2", "3", "4", "8", "2+8"])
def test_single_width_and_no_mass(probs, walk: str) -> None:
    batch, heads, hq, d, length, block = 2, 2, 8, 128, 517, 64
    buckets, kmin, krange, tier = random_cache(batch, heads, d, length, block, 7, probs)
    q = torch.randn(batch, hq, 1, d, generator=torch.Generator().manual_seed(3)).half()
    ref, _ = bucket_attention(q.float(), buckets, kmin, krange, block, length, None, d**-0.5)
    out, mass = kkv.kv_decode_attention_cuda(q.cuda(), _cuda(buckets), kmin.cuda(), krange.cuda(), block, length,
                                             tier.cuda(), None, d**-0.5, need_mass=False)
    assert mass is None
    assert (out.float().cpu() - ref).abs().max() < 1e-2 * ref.abs().max()


def test_workspace_keeps_offsets_and_appended_8bit_tokens_need_no_recount() -> None:
    # offsets kept in the workspace stay right when 8-bit tokens are appended past the key blocks
    batch, heads, hq, d, block = 2, 2, 8, 128, 32
    buckets, kmin, krange, tier = random_cache(batch, heads, d, 300, block, 5)
    q = torch.randn(batch, hq, 1, d, generator=torch.Generator().manual_seed(6)).half()
    ws: dict = {}
    cur = 300
    for length in (300, 301, 333):  # the cache grows by 8-bit tokens only; key blocks unchanged
        if length > cur:
            g = torch.Generator().manual_seed(length)
            n = length - cur
            rows = torch.arange(batch).repeat_interleave(n)
            pos = torch.arange(cur, length).repeat(batch)
            extra = quantize_tokens(torch.randn(batch * n, heads, d, generator=g), torch.randn(batch * n, heads, d, generator=g), 8,
                                    rows, pos, batch)
            old = buckets[3]
            cat = {name: torch.cat([x, extra.tensors()[name]]) for name, x in old.tensors().items() if name != "row_start"}
            allrows = torch.cat([old.rows(), extra.rows()])
            order = torch.argsort(allrows * 100000 + cat["pos"].long(), stable=True)
            row_start = torch.zeros(batch + 1, dtype=torch.int32)
            row_start[1:] = torch.bincount(allrows, minlength=batch).cumsum(0)
            buckets = buckets[:3] + [KVBucket(8, row_start, **{n_: x[order] for n_, x in cat.items()})]
            tier = torch.cat([tier, torch.full((batch, n), 8, dtype=torch.int8)], 1)
            cur = length
        ref, _ = bucket_attention(q.float(), buckets, kmin, krange, block, length, None, d**-0.5)
        out, _ = kkv.kv_decode_attention_cuda(q.cuda(), _cuda(buckets), kmin.cuda(), krange.cuda(), block, length, tier.cuda(),
                                              None, d**-0.5, workspace=ws)
        assert len(ws) == 1
        assert (out.float().cpu() - ref).abs().max() < 1e-2 * ref.abs().max(), length


def test_matches_sdpa_on_the_dequantized_cache() -> None:
    batch, heads, hq, d, length, block = 2, 2, 8, 128, 300, 32
    buckets, kmin, krange, tier = random_cache(batch, heads, d, length, block, 11)
    kd = torch.zeros(batch, length, heads, d)
    vd = torch.zeros_like(kd)
    for bk in buckets:
        k, v = dequantize_bucket(bk, kmin, krange, block)
        kd[bk.rows(), bk.pos.long()], vd[bk.rows(), bk.pos.long()] = k, v
    q = torch.randn(batch, hq, 1, d)
    mask = _padding_mask(batch, 1, length, [0, 9])
    ref = F.scaled_dot_product_attention(q, kd.transpose(1, 2).repeat_interleave(hq // heads, 1),
                                         vd.transpose(1, 2).repeat_interleave(hq // heads, 1), attn_mask=mask).transpose(1, 2)
    out, _ = kkv.kv_decode_attention_cuda(q.cuda(), _cuda(buckets), kmin.cuda(), krange.cuda(), block, length, tier.cuda(),
                                          mask.cuda(), d**-0.5)
    assert (out.cpu() - ref).abs().max() < 1e-2 * ref.abs().max()


def test_unsupported_head_dim_falls_back_to_the_reference() -> None:
    buckets, kmin, krange, tier = random_cache(1, 1, 96, 40, 16, 0)
    q = torch.randn(1, 2, 1, 96)
    assert kkv.kv_decode_attention_cuda(q.cuda(), _cuda(buckets), kmin.cuda(), krange.cuda(), 16, 40, tier.cuda(), None, 0.1) is None
    out, mass = _kv_ops.decode_attention(q.cuda(), _cuda(buckets), kmin.cuda(), krange.cuda(), 16, 40, tier.cuda(), None, 0.1)
    ref, ref_mass = bucket_attention(q, buckets, kmin, krange, 16, 40, None, 0.1)
    torch.testing.assert_close(out.cpu(), ref, atol=1e-5, rtol=1e-5)


def test_bad_arguments_name_what_is_wrong() -> None:
    buckets, kmin, krange, tier = random_cache(1, 2, 64, 40, 16, 0)
    cb = _cuda(buckets)
    q = torch.randn(1, 3, 1, 64, device="cuda")
    with pytest.raises(ValueError, match="multiple"):
        kkv.kv_decode_attention_cuda(q, cb, kmin.cuda(), krange.cuda(), 16, 40, tier.cuda(), None, 0.1)
    q = torch.randn(1, 4, 1, 64, device="cuda")
    with pytest.raises(ValueError, match="tier"):
        kkv.kv_decode_attention_cuda(q, cb, kmin.cuda(), krange.cuda(), 16, 40, tier.cuda().int(), None, 0.1)
    with pytest.raises(ValueError, match="buckets"):
        kkv.kv_decode_attention_cuda(q, cb[::-1], kmin.cuda(), krange.cuda(), 16, 40, tier.cuda(), None, 0.1)


def test_generation_on_gpu_checks_every_call_against_the_reference(monkeypatch) -> None:
    from transformers import LlamaConfig, LlamaForCausalLM

    from kbit_linear.kv_cache import KbitKVCache

    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=128, hidden_size=256, intermediate_size=256, num_hidden_layers=2, num_attention_heads=8,
                      num_key_value_heads=2, head_dim=64, max_position_embeddings=512)
    model = LlamaForCausalLM(cfg).eval().cuda()
    for layer in model.model.layers:  # sharper attention than a random init gives
        layer.self_attn.q_proj.weight.data *= 4
    calls, reused, masses = [], [], []
    kernel = _kv_ops._backends["cuda"]

    def checked(query, buckets, kmin, krange, block, kv_len, tier, mask, scaling, need_mass, workspace):
        reused.append(bool(workspace))  # offsets kept from an earlier step
        masses.append(need_mass)
        out, mass = kernel(query, buckets, kmin, krange, block, kv_len, tier, mask, scaling, need_mass, workspace)
        ref, ref_mass = bucket_attention(query, buckets, kmin, krange, block, kv_len, mask, scaling)
        assert (out.float() - ref.float()).abs().max() <= 1e-2 * ref.float().abs().max() + 1e-4
        if need_mass:
            torch.testing.assert_close(mass, ref_mass, atol=2e-3 * query.shape[1] * query.shape[2], rtol=2e-2)
        else:
            assert mass is None
        calls.append(tuple(bk.num_tokens for bk in buckets))
        return ref, (ref_mass if need_mass else None)  # the reference drives the cache, so the run is the reference's

    monkeypatch.setitem(_kv_ops._backends, "cuda", checked)
    ids = torch.randint(3, 128, (2, 70), generator=torch.Generator().manual_seed(0)).cuda()
    am = torch.ones_like(ids)
    am[1, :6] = 0  # left padding
    # 4.5 bits: with the 8-bit window (8 tokens, its start rounded down to a tile: up to 23) and
    # the sinks, 110 tokens still hold several widths (all four in a CPU replay; at 3 bits every
    # movable token would sit at 2)
    cache = KbitKVCache(model.config, kv_bits=4.5, window=8, sink_tokens=2, block_size=16)
    model.generate(ids, attention_mask=am, **{cache_keyword(model): cache}, max_new_tokens=40, do_sample=False, pad_token_id=0)
    assert len(calls) >= 2 * 39
    assert len(set(calls)) > 5 and sum(1 for n in calls[-1] if n) >= 3, calls[-1]  # widths changed, several buckets
    assert any(reused) and not all(reused)  # kept between steps, recomputed after widths changed
    assert any(masses) and not all(masses)  # the default mass_interval skips the mass on some steps


def test_crop_then_decode_matches_the_reference() -> None:
    # after a crop the key blocks' ranges outlive the cut: offsets kept from before must not be
    # used while positions below the last ranged block are missing
    from kbit_linear.kv_cache import KbitKVLayer

    g = torch.Generator(device="cuda").manual_seed(0)
    h, hq, d, block = 2, 8, 64, 16
    layer = KbitKVLayer(3.0, window=8, sink_tokens=2, block_size=block, hysteresis=0.1)

    def step(n: int) -> None:
        layer.update(torch.randn(1, h, n, d, device="cuda", generator=g), torch.randn(1, h, n, d, device="cuda", generator=g))
        q = torch.randn(1, hq, 1, d, device="cuda", generator=g)
        s, buckets = layer.seq_len, [layer.buckets[t] for t in TIERS]
        out, mass = kkv.kv_decode_attention_cuda(q, buckets, layer.k_block_min, layer.k_block_range, block, s, layer.tier, None,
                                                 d**-0.5, workspace=layer.workspace)
        ref, ref_mass = bucket_attention(q, buckets, layer.k_block_min, layer.k_block_range, block, s, None, d**-0.5)
        assert (out.float() - ref.float()).abs().max() <= 1e-2 * ref.float().abs().max(), s
        torch.testing.assert_close(mass, ref_mass, atol=2e-3 * hq, rtol=2e-2)
        layer.attend(q, None, d**-0.5)  # the step itself (importance, kept offsets)

    step(40)
    for _ in range(47):
        step(1)
    assert sum(layer.buckets[t].num_tokens for t in TIERS[:3]) > 0  # widths below 8 in use
    layer.crop(-10)  # 77 tokens; key block 4 (positions 64..79) keeps its range
    for _ in range(12):
        step(1)


def test_mask_of_batch_one_is_broadcast() -> None:
    batch, heads, hq, d, length, block = 2, 2, 8, 128, 100, 32
    buckets, kmin, krange, tier = random_cache(batch, heads, d, length, block, 21)
    q = torch.randn(batch, hq, 1, d, generator=torch.Generator().manual_seed(4))
    mask = _padding_mask(1, 1, length, [7])
    ref, _ = bucket_attention(q, buckets, kmin, krange, block, length, mask, d**-0.5)
    out, _ = kkv.kv_decode_attention_cuda(q.cuda(), _cuda(buckets), kmin.cuda(), krange.cuda(), block, length, tier.cuda(),
                                          mask.cuda(), d**-0.5)
    assert (out.cpu() - ref).abs().max() < 1e-2 * ref.abs().max()
    with pytest.raises(ValueError, match="attention_mask"):
        kkv.kv_decode_attention_cuda(q.cuda(), _cuda(buckets), kmin.cuda(), krange.cuda(), block, length, tier.cuda(),
                                     mask[..., :50].cuda(), d**-0.5)


def test_many_small_probabilities_times_small_value_scales_still_count(walk: str) -> None:
    # Every 256th position is favoured by the mask (+8, log e), so each warp's running max sits
    # far above its other tokens (p ~ 3e-4); the values are small and all positive, so their 8-bit
    # scale is ~7e-5 and p * scale ~2e-8, below half of fp16's smallest subnormal, yet those tokens
    # carry ~8 % of the attention. Unscaled, P' would round to 0 and the output drop by ~8 %; the
    # kernel scales P' by a power of two per tile.
    batch, heads, hq, d, length, block = 1, 2, 8, 128, 4096, 64
    g = torch.Generator().manual_seed(8)
    k = torch.randn(batch, length, heads, d, generator=g) * 0.1
    v = 0.005 + 0.001 * torch.randn(batch, length, heads, d, generator=g)
    rows, pos = torch.nonzero(torch.ones(batch, length, dtype=torch.bool), as_tuple=True)
    buckets = [KVBucket.empty(t, batch, heads, d) for t in TIERS[:3]]
    buckets.append(quantize_tokens(k[rows, pos], v[rows, pos], 8, rows, pos, batch))
    tier = torch.full((batch, length), 8, dtype=torch.int8)
    bias = torch.zeros(batch, 1, 1, length)
    bias[..., ::256] = 8.0
    q = torch.randn(batch, hq, 1, d, generator=g)
    ref, ref_mass = bucket_attention(q, buckets, None, None, block, length, bias, d**-0.5)
    out, mass = kkv.kv_decode_attention_cuda(q.cuda(), _cuda(buckets), None, None, block, length, tier.cuda(), bias.cuda(), d**-0.5)
    assert (out.cpu() - ref).abs().max() < 1e-2 * ref.abs().max()
    torch.testing.assert_close(mass.cpu(), ref_mass, atol=2e-3 * hq, rtol=2e-2)


# In place (a replayable layer's epoch): batch, kv heads, query heads, head_dim, length, block, q_len, room
IN_PLACE_CASES = [
    (1, 2, 8, 128, 37, 16, 1, 5),
    (2, 2, 6, 64, 200, 32, 1, 40),
    (3, 2, 4, 128, 333, 64, 2, 100),
    (1, 8, 32, 128, 4099, 64, 1, 700),  # many splits, planned well past the live length: empty splits
]


def _in_place_problem(case, dtype: torch.dtype, seed: int):
    """A random cache with its 8-bit tokens in a store with ``room`` free entries a row, its tier
    in a buffer of ``ld`` columns, and running mass and seen sums of random values."""
    batch, heads, hq, d, length, block, q_len, room = case
    buckets, kmin, krange, tier = random_cache(batch, heads, d, length, block, seed)
    g = torch.Generator().manual_seed(seed + 1)
    q = (torch.randn(batch, hq, q_len, d, generator=g) * 2).to(dtype)
    cb = _cuda(buckets)
    store = KVStore8.from_bucket(cb[3], room)
    ld = -(-(length + room) // 16) * 16
    tier_buf = torch.full((batch, ld), 8, dtype=torch.int8, device="cuda")
    tier_buf[:, :length] = tier.cuda()
    mass0 = torch.rand(batch, ld, generator=g).cuda()
    seen0 = torch.randint(0, 50, (batch, ld), generator=g).float().cuda()
    return buckets, cb, store, kmin, krange, tier, tier_buf, q, mass0, seen0, ld


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=str)
@pytest.mark.parametrize("case", IN_PLACE_CASES, ids=lambda c: "b{}-h{}-hq{}-d{}-s{}-bs{}-q{}-room{}".format(*c))
@pytest.mark.parametrize("record", [True, False], ids=["recording", "not-recording"])
def test_in_place_attention_matches_the_reference(case, dtype: torch.dtype, record: bool, walk: str) -> None:
    """The store read in place at a device length, planned for a longer one: the output as the
    reference's; the mass and the seen query heads added into the running sums on a recording
    call only, and only at live positions."""
    batch, heads, hq, d, length, block, q_len, room = case
    seed = zlib.crc32(repr((case, str(dtype), record)).encode())
    buckets, cb, store, kmin, krange, tier, tier_buf, q, mass0, seen0, ld = _in_place_problem(case, dtype, seed)
    scaling = d**-0.5
    ref_out, ref_mass = bucket_attention(q.float(), buckets, kmin, krange, block, length, None, scaling)
    interval = 3
    calls = torch.tensor([1 if record else 2], dtype=torch.int32, device="cuda")  # advanced before the call: (calls - 1) % 3
    live = torch.tensor([length], dtype=torch.int32, device="cuda")
    mass, seen = mass0.clone(), seen0.clone()
    _poison(batch * hq * q_len * max(ld, d) * 4)
    out = kkv.kv_decode_attention_in_place_cuda(q.cuda(), cb[:3], store, kmin.cuda(), krange.cuda(), block, length + room, live,
                                                tier_buf, scaling, mass, seen, calls, interval, {})
    assert out.dtype == dtype and out.shape == (batch, q_len, hq, d) and not torch.isnan(out).any()
    tol = 2e-2 if dtype == torch.bfloat16 else 1e-2
    err = (out.float().cpu() - ref_out).abs().max() / ref_out.abs().max().clamp_min(1e-6)
    assert err < tol, float(err)
    # the plain call at the live length: the same tiles, the splits cut elsewhere (so each split's
    # running max, the reference its probabilities are rounded against, moves elsewhere too): equal
    # to about an output rounding, which for bf16 is up to 2^-7 relative
    plain, _ = kkv.kv_decode_attention_cuda(q.cuda(), cb, kmin.cuda(), krange.cuda(), block, length, tier.cuda(), None, scaling)
    close = 8e-3 if dtype == torch.bfloat16 else 2e-3
    torch.testing.assert_close(out.float(), plain.float(), rtol=close, atol=close * plain.float().abs().max().item())
    if not record:
        assert torch.equal(mass, mass0) and torch.equal(seen, seen0)
        return
    assert torch.equal(mass[:, length:], mass0[:, length:]) and torch.equal(seen[:, length:], seen0[:, length:])
    torch.testing.assert_close((mass - mass0)[:, :length].cpu(), ref_mass, atol=2e-3 * hq * q_len, rtol=2e-2)
    want_seen = seen0 + hq * causal_visible(length, q_len, ld, "cuda")
    assert torch.equal(seen, want_seen)


@pytest.mark.parametrize("case", [(3, 2, 4, 128, 333, 64, 2, 100), (1, 4, 32, 128, 300, 64, 3, 20), (1, 8, 32, 128, 4099, 64, 1, 700)],
                         ids=["padding-q2", "96-rows", "65-splits"])
def test_the_mass_in_the_combine_launch_equals_the_mass_kernels(case, monkeypatch) -> None:
    """Short grids take the mass in the combine's launch, each mass block forming its rows' max
    and sum again from the splits; larger grids launch the mass kernel on the combine's. Both give
    the same output, mass and seen sums to the bit: plain (with padding), and in place on a
    recording and a non-recording call."""
    batch, heads, hq, d, length, block, q_len, room = case
    seed = zlib.crc32(repr(case).encode())
    buckets, cb, store, kmin, krange, tier, tier_buf, q, mass0, seen0, ld = _in_place_problem(case, torch.float16, seed)
    mask = _padding_mask(batch, q_len, length, [0, 5, 17][:batch]).cuda()
    live = torch.tensor([length], dtype=torch.int32, device="cuda")
    got = {}
    for fused in (True, False):
        monkeypatch.setattr(kkv.tuning, "KV_MASS_IN_COMBINE_MAX_BLOCKS_PER_SM", 10**6 if fused else 0)
        _poison(batch * hq * q_len * max(ld, d) * 4)
        out, mass = kkv.kv_decode_attention_cuda(q.cuda(), cb, kmin.cuda(), krange.cuda(), block, length, tier.cuda(), mask,
                                                 d**-0.5)
        runs = [out, mass]
        for count in (1, 2):  # interval 2: (calls - 1) % 2 == 0 records
            m, sn = mass0.clone(), seen0.clone()
            calls = torch.tensor([count], dtype=torch.int32, device="cuda")
            runs += [kkv.kv_decode_attention_in_place_cuda(q.cuda(), cb[:3], store, kmin.cuda(), krange.cuda(), block, length + room,
                                                           live, tier_buf, d**-0.5, m, sn, calls, 2, {}), m, sn]
        got[fused] = runs
    for i, (a, b) in enumerate(zip(got[True], got[False])):
        assert not torch.isnan(a).any() and torch.equal(a, b), i
    assert not torch.equal(got[True][3], mass0) and torch.equal(got[True][6], mass0)  # recorded on call 1 only


def test_in_place_attention_replays_in_a_cuda_graph_at_the_device_length() -> None:
    """One in-place call captured once, replayed after the device length and call counter change:
    each replay equals an eager call at that length (the kernels read both on the device)."""
    case = (2, 2, 8, 128, 300, 64, 1, 60)
    batch, heads, hq, d, length, block, q_len, room = case
    buckets, cb, store, kmin, krange, tier, tier_buf, q, mass0, seen0, ld = _in_place_problem(case, torch.float16, 7)
    qc, kminc, krangec = q.cuda(), kmin.cuda(), krange.cuda()
    live = torch.tensor([length], dtype=torch.int32, device="cuda")
    calls = torch.tensor([1], dtype=torch.int32, device="cuda")
    mass, seen = mass0.clone(), seen0.clone()
    workspace: dict = {}

    def step() -> torch.Tensor:
        return kkv.kv_decode_attention_in_place_cuda(qc, cb[:3], store, kminc, krangec, block, length + room, live, tier_buf,
                                                     d**-0.5, mass, seen, calls, 2, workspace)

    step()  # compiles and fills the workspace outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = step()
    for shorter, count in ((0, 1), (5, 2), (40, 3), (0, 4)):  # the store's last entries past the live length go unread
        live.fill_(length - shorter)
        calls.fill_(count)
        m_before, s_before = mass.clone(), seen.clone()
        graph.replay()
        got, got_mass, got_seen = out.clone(), mass.clone(), seen.clone()
        mass.copy_(m_before)
        seen.copy_(s_before)
        want = step()
        assert torch.equal(got, want), (shorter, count)
        assert torch.equal(got_mass, mass) and torch.equal(got_seen, seen), (shorter, count)
        assert torch.equal(got_mass, m_before) == (count % 2 == 0)  # (calls - 1) % 2 == 0 records
