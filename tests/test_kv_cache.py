"""KbitKVCache (CPU): the format, the reference bucket attention against SDPA, the allocator, and
generation with tiny random Llama / Qwen / Mistral / Gemma-3 models."""

from __future__ import annotations

import math
import warnings

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from transformers import (
    DynamicCache,
    Gemma3TextConfig,
    Gemma3ForCausalLM,
    LlamaConfig,
    LlamaForCausalLM,
    MistralConfig,
    MistralForCausalLM,
    Qwen3Config,
    Qwen3ForCausalLM,
)

import kbit_linear
from kbit_linear import kv_cache
from kbit_linear.kv_cache import KbitKVCache, KbitKVLayer, KbitKVView, allocate_row, allocate_tiers, cache_keyword, tile_importance, _ideal_widths
from kbit_linear.kv_format import (
    TIERS,
    KVBucket,
    bucket_attention,
    bytes_per_token,
    dequantize_bucket,
    key_block_ranges,
    pack_codes,
    quantize_tokens,
    unpack_codes,
)


# ---- format ------------------------------------------------------------------------------------

@pytest.mark.parametrize("bits", [2, 3, 4])
@pytest.mark.parametrize("shape", [(8,), (3, 32), (5, 2, 96), (1, 1, 256)], ids=str)
def test_pack_round_trip(bits: int, shape: tuple[int, ...]) -> None:
    codes = torch.randint(0, 2**bits, shape, generator=torch.Generator().manual_seed(bits))
    packed = pack_codes(codes, bits)
    assert packed.dtype == torch.uint8 and packed.shape[-1] == shape[-1] * bits // 8
    assert torch.equal(unpack_codes(packed, bits), codes)


def test_pack_layout() -> None:
    # 3 bits: value i of 8 sits at bit 3*i of a little-endian 24-bit word
    codes = torch.tensor([1, 2, 3, 4, 5, 6, 7, 0])
    word = sum(int(c) << (3 * i) for i, c in enumerate(codes))
    assert pack_codes(codes, 3).tolist() == [word & 0xFF, (word >> 8) & 0xFF, (word >> 16) & 0xFF]


def test_pack_refuses_codes_it_cannot_hold() -> None:
    """A code outside [0, 2**bits) would spill into its neighbours' bits: refused, as are float codes."""
    ok = torch.tensor([0, 1, 2, 3, 15, 4, 5, 6])
    assert unpack_codes(pack_codes(ok, 4), 4).tolist() == ok.tolist()
    with pytest.raises(ValueError, match=r"codes must lie in \[0, 16\) at 4 bits, got values from 0 to 16"):
        pack_codes(torch.tensor([0, 1, 2, 3, 16, 4, 5, 6]), 4)
    with pytest.raises(ValueError, match="codes must lie in .* from -1 to 3"):
        pack_codes(torch.tensor([0, 1, 2, 3, -1, 0, 1, 2]), 2)
    with pytest.raises(TypeError, match="codes must be an integer tensor"):
        pack_codes(ok.float(), 4)
    assert pack_codes(torch.zeros(2, 0, dtype=torch.int64), 3).shape == (2, 0)
    assert pack_codes(torch.zeros(2, 16, dtype=torch.int64, device="meta"), 3).shape == (2, 6)  # nothing to read there


def test_format_helpers_name_a_bad_argument() -> None:
    with pytest.raises(ValueError, match="block_size must be an int >= 1"):
        bytes_per_token(4, 128, block_size=0)
    with pytest.raises(ValueError, match="block_size must be an int >= 1"):
        bytes_per_token(4, 128, block_size=-64)
    with pytest.raises(ValueError, match="bits must be one of"):
        KVBucket.empty(5, 1, 2, 64)
    with pytest.raises(TypeError, match="packed must be a uint8 tensor"):
        unpack_codes(torch.zeros(4), 4)
    g = torch.Generator().manual_seed(0)
    k, v = torch.randn(4, 2, 64, generator=g), torch.randn(4, 2, 64, generator=g)
    rows, pos = torch.zeros(4, dtype=torch.int64), torch.arange(4)
    mn, rng = key_block_ranges(k.reshape(1, 1, 4, 2, 64))
    bucket = quantize_tokens(k, v, 4, rows, pos, 1, mn, rng, 4)
    with pytest.raises(ValueError, match="pass k_block_min and k_block_range"):
        dequantize_bucket(bucket)
    assert dequantize_bucket(KVBucket.empty(4, 1, 2, 64))[0].shape == (0, 2, 64)  # no tokens: nothing to decode


def test_quantize_tokens_names_a_bad_argument() -> None:
    g = torch.Generator().manual_seed(0)
    n, h, d, block = 8, 2, 64, 4
    k, v = torch.randn(n, h, d, generator=g), torch.randn(n, h, d, generator=g)
    rows, pos = torch.tensor([0, 0, 0, 0, 1, 1, 1, 1]), torch.tensor([0, 1, 2, 3, 0, 1, 2, 3])
    mn, rng = key_block_ranges(torch.stack([k[:4], k[4:]]).reshape(2, 1, block, h, d))
    assert quantize_tokens(k, v, 4, rows, pos, 2, mn, rng, block).row_start.tolist() == [0, 4, 8]
    # NumPy integers count as ints; key ranges of more rows than the batch cover it
    wide = quantize_tokens(k, v, 4, rows.int(), pos, np.int64(2), torch.cat([mn, mn]), torch.cat([rng, rng]), np.int64(block))
    assert wide.row_start.tolist() == [0, 4, 8]
    bad = {
        "rows must lie in": dict(rows=rows + 1),
        "pos must be >= 0": dict(pos=pos - 1),
        "rows must be an integer tensor": dict(rows=rows[:5]),
        "pos must be an integer tensor": dict(pos=pos.float()),
        "k and v must have one shape": dict(v=v[:, :1]),
        "v must be a float tensor": dict(v=v[0]),
        "batch must be an int >= 1": dict(batch=0),
        "head_dim must be a positive multiple of 32": dict(k=k[..., :48], v=v[..., :48]),
        r"k_block_min must be \[batch = 2 rows": dict(mn=mn[:1]),
        "rows must be an integer tensor": dict(rows=rows.bool()),
        "k_block_range must be": dict(rng=rng[..., :32]),
        "need k_block_min and k_block_range": dict(mn=None),
    }
    for match, edit in bad.items():
        a = dict(k=k, v=v, rows=rows, pos=pos, batch=2, mn=mn, rng=rng) | edit
        with pytest.raises(ValueError, match=match):
            quantize_tokens(a["k"], a["v"], 4, a["rows"], a["pos"], a["batch"], a["mn"], a["rng"], block)


@pytest.mark.parametrize("bits", TIERS)
def test_quantize_error_bound(bits: int) -> None:
    g = torch.Generator().manual_seed(0)
    n, h, d, block = 64, 2, 128, 32
    k, v = torch.randn(n, h, d, generator=g), torch.randn(n, h, d, generator=g)
    k[..., 5] *= 20  # an outlier channel, as real keys have
    rows, pos = torch.zeros(n, dtype=torch.int64), torch.arange(n)
    mn, rng = key_block_ranges(k.reshape(1, n // block, block, h, d))
    bk = quantize_tokens(k, v, bits, rows, pos, 1, mn, rng, block)
    kd, vd = dequantize_bucket(bk, mn, rng, block)
    if bits == 8:
        kstep = k.reshape(n, h, 2, 64).abs().amax(-1, keepdim=True).expand(n, h, 2, 64).reshape(n, h, d) / 127
    else:
        kstep = (rng.float() / (2**bits - 1))[0].repeat_interleave(block, 0)
    assert ((kd - k).abs() <= kstep / 2 * 1.01 + 1e-3).all()
    assert ((vd - v).abs() <= (v.amax() - v.amin()) / (2**bits - 1)).all()


def test_bytes_per_token_targets() -> None:
    # Llama-3-8B attention shape (head_dim 128): against bf16's 512 bytes per token and head
    bf16 = 2 * 128 * 2
    assert bytes_per_token(4, 128) / bf16 <= 0.30
    assert (bytes_per_token(2, 128) + bytes_per_token(3, 128)) / 2 / bf16 <= 0.20  # 2.5 bits on average


# ---- reference attention vs SDPA on the dequantized cache ----------------------------------------

def _filled_layer(batch: int, heads: int, d: int, length: int, kv_bits: float, seed: int = 0,
                  pad: list[int] | None = None, hq: int | None = None) -> tuple[KbitKVLayer, torch.Tensor]:
    """A layer prefilled with ``length`` random tokens and fed decode steps until all widths hold tokens."""
    g = torch.Generator().manual_seed(seed)
    layer = KbitKVLayer(kv_bits, window=8, sink_tokens=2, block_size=16, hysteresis=0.1)
    pad = pad or [0] * batch
    total = length + 40
    mask = torch.ones(batch, 1, total, total, dtype=torch.bool).tril()
    for b, p in enumerate(pad):
        mask[b, :, :, :p] = False
    hq = hq or heads * 3
    k, v = torch.randn(batch, heads, length, d, generator=g), torch.randn(batch, heads, length, d, generator=g)
    layer.update(k, v)
    layer.attend(torch.randn(batch, hq, length, d, generator=g), mask[:, :, :length, :length], d**-0.5)
    while layer.seq_len < total:
        s = layer.seq_len
        layer.update(torch.randn(batch, heads, 1, d, generator=g), torch.randn(batch, heads, 1, d, generator=g))
        layer.attend(torch.randn(batch, hq, 1, d, generator=g), mask[:, :, s:s + 1, :s + 1], d**-0.5)
    return layer, mask


@pytest.mark.parametrize("q_len", [1, 3])
@pytest.mark.parametrize("batch,heads,hq,d,length", [(1, 1, 1, 32, 69), (3, 2, 6, 64, 61), (2, 2, 8, 96, 45)],
                         ids=["mha-d32", "gqa3-d64-b3", "gqa4-d96"])
def test_bucket_attention_matches_sdpa(q_len: int, batch: int, heads: int, hq: int, d: int, length: int) -> None:
    pad = [0, 5, 11][:batch]
    layer, _ = _filled_layer(batch, heads, d, length, kv_bits=4, pad=pad, hq=hq)
    counts = {t: layer.buckets[t].num_tokens for t in TIERS}
    assert sum(1 for n in counts.values() if n) >= 3, counts  # several buckets filled
    g = torch.Generator().manual_seed(1)
    layer.update(torch.randn(batch, heads, q_len, d, generator=g), torch.randn(batch, heads, q_len, d, generator=g))
    s = layer.seq_len
    mask = torch.ones(batch, 1, q_len, s, dtype=torch.bool).tril(s - q_len)
    for b, p in enumerate(pad):
        mask[b, :, :, :p] = False
    q = torch.randn(batch, hq, q_len, d, generator=g)
    mass_before = layer.mass.clone()
    out = layer.attend(q, mask, d**-0.5)
    k, v = layer.dequantize()
    ref = F.scaled_dot_product_attention(q, k.repeat_interleave(hq // heads, 1), v.repeat_interleave(hq // heads, 1),
                                         attn_mask=mask, scale=d**-0.5).transpose(1, 2)
    torch.testing.assert_close(out, ref, atol=2e-6, rtol=1e-5)
    mass = layer.mass - mass_before
    torch.testing.assert_close(mass.sum(1), torch.full((batch,), float(hq * q_len)))  # probabilities sum to 1
    assert (mass[~mask[:, 0].any(1)] == 0).all()


def test_all_8bit_cache_needs_no_key_ranges() -> None:
    # Before its first complete key block a cache holds 8-bit tokens only and no key ranges:
    # the empty lower-width buckets must then not ask for them.
    batch, heads, d, length = 2, 2, 64, 40
    g = torch.Generator().manual_seed(3)
    k, v = torch.randn(batch, length, heads, d, generator=g), torch.randn(batch, length, heads, d, generator=g)
    rows, pos = torch.nonzero(torch.ones(batch, length, dtype=torch.bool), as_tuple=True)
    buckets = [KVBucket.empty(t, batch, heads, d) for t in TIERS[:3]]
    buckets.append(quantize_tokens(k[rows, pos], v[rows, pos], 8, rows, pos, batch))
    q = torch.randn(batch, 4, 1, d, generator=g)
    out, mass = bucket_attention(q, buckets, None, None, 64, length, torch.zeros(batch, 1, 1, length), d**-0.5)
    kd, vd = dequantize_bucket(buckets[3])
    kd, vd = kd.reshape(batch, length, heads, d).transpose(1, 2), vd.reshape(batch, length, heads, d).transpose(1, 2)
    ref = F.scaled_dot_product_attention(q, kd.repeat_interleave(2, 1), vd.repeat_interleave(2, 1), scale=d**-0.5)
    torch.testing.assert_close(out, ref.transpose(1, 2), atol=2e-6, rtol=1e-5)
    torch.testing.assert_close(mass.sum(1), torch.full((batch,), 4.0))


def test_prefill_path_matches_sdpa() -> None:
    layer, _ = _filled_layer(2, 2, 32, 50, kv_bits=4)
    g = torch.Generator().manual_seed(2)
    layer.update(torch.randn(2, 2, 20, 32, generator=g), torch.randn(2, 2, 20, 32, generator=g))
    q = torch.randn(2, 4, 20, 32, generator=g)
    out = layer.attend(q, None, 32**-0.5)  # None = causal with the queries at the end
    k, v = layer.dequantize()
    s = layer.seq_len
    mask = torch.ones(20, s, dtype=torch.bool).tril(s - 20)
    ref = F.scaled_dot_product_attention(q, k.repeat_interleave(2, 1), v.repeat_interleave(2, 1), attn_mask=mask,
                                         scale=32**-0.5).transpose(1, 2)
    torch.testing.assert_close(out, ref, atol=2e-6, rtol=1e-5)


# ---- allocator -----------------------------------------------------------------------------------

def test_allocator_budget_monotone_deterministic() -> None:
    g = torch.Generator().manual_seed(3)
    cur = torch.tensor(TIERS)[torch.randint(1, 4, (500,), generator=g)]
    imp = torch.rand(500, generator=g)
    budget = 3.3 * 500
    a, b = allocate_tiers(cur, imp, budget), allocate_tiers(cur.clone(), imp.clone(), budget)
    assert torch.equal(a, b)
    assert (a.to(torch.int64) <= cur).all() and set(a.tolist()) <= set(TIERS)
    assert a.to(torch.int64).sum() <= budget
    assert a.to(torch.int64).sum() >= budget - 8  # the budget is spent
    # more important tokens never get fewer bits when nothing caps them
    full = allocate_tiers(torch.full((100,), 8), torch.arange(100.0), 4.5 * 100, hysteresis=0.0)
    assert (full[1:].to(torch.int64) >= full[:-1].to(torch.int64)).all()


def _allocate_tiers_loop(current: torch.Tensor, importance: torch.Tensor, budget: float, hysteresis: float = 0.1) -> torch.Tensor:
    """Steps 2-4 of the allocator written as the plain loop over tokens that its docstring
    describes (the oracle for the vectorized walks of ``allocate_tiers``; step 1 is shared)."""
    cur = current.to(torch.int64)
    if cur.numel() == 0:
        return cur.to(torch.int8)
    order, ideal = _ideal_widths(importance, budget)
    new = torch.minimum(cur, ideal)
    slack = budget - float(new.sum())
    imp = importance.to(torch.float64)
    if hysteresis > 0 and slack > 0:
        cutoff = {t: float(imp[ideal >= t].min()) for t in TIERS if bool((ideal >= t).any())}
        for i in order.tolist():
            c = int(cur[i])
            if new[i] < c and c in cutoff and imp[i] >= (1 - hysteresis) * cutoff[c] and c - new[i] <= slack:
                slack -= float(c - new[i])
                new[i] = c
    for i in order.tolist():
        if slack < 1:
            break
        c = int(cur[i])
        if new[i] < c:
            t = max(t for t in TIERS if t <= c and t - new[i] <= slack) if new[i] + 1 <= c else int(new[i])
            slack -= float(t - new[i])
            new[i] = t
    return new.to(torch.int8)


def test_allocator_equals_the_token_by_token_loop() -> None:
    g = torch.Generator().manual_seed(0)
    tiers = torch.tensor(TIERS)
    for case in range(300):
        m = int(torch.randint(1, 300, (1,), generator=g))
        weights = torch.rand(4, generator=g) + 0.05
        cur = tiers[torch.multinomial(weights, m, replacement=True, generator=g)]
        imp = torch.rand(m, generator=g)
        if case % 3 == 0:
            imp = (imp * 5).round() / 5  # ties
        budget = float(cur.sum()) * float(torch.rand(1, generator=g)) * 1.2 + float(torch.rand(1, generator=g)) * 3
        if case % 5 == 0:
            budget = round(budget * 2) / 2
        hyst = [0.0, 0.05, 0.1, 0.3][case % 4]
        got = allocate_tiers(cur, imp, budget, hyst)
        assert torch.equal(got, _allocate_tiers_loop(cur, imp, budget, hyst)), (case, m, budget, hyst)


def test_allocator_refuses_inputs_that_disagree() -> None:
    with pytest.raises(ValueError, match="1-D of one length"):
        allocate_tiers(torch.full((5,), 8), torch.tensor([1.0]), 20.0)
    with pytest.raises(ValueError, match="hysteresis"):
        allocate_tiers(torch.full((5,), 8), torch.ones(5), 20.0, hysteresis=1.5)


def test_allocator_hysteresis() -> None:
    # 10 tokens at 4 bits, budget for 5 at 4 and 5 at 3: the 6th most important sits just below the cutoff
    cur = torch.full((10,), 4)
    imp = torch.tensor([1.0, 0.99, 0.98, 0.97, 0.96, 0.95, 0.5, 0.4, 0.3, 0.2])
    budget = 5 * 4 + 5 * 3 + 1  # one spare bit: room to keep one token
    strict = allocate_tiers(cur, imp, budget, hysteresis=0.0)
    sticky = allocate_tiers(cur, imp, budget, hysteresis=0.05)
    assert strict.tolist()[:6] == [4, 4, 4, 4, 4, 4]  # the spare bit goes to the most important demoted token
    assert sticky[5] == 4
    far = allocate_tiers(cur, torch.tensor([1.0, 0.99, 0.98, 0.97, 0.96, 0.5, 0.5, 0.4, 0.3, 0.2]), 5 * 4 + 5 * 3,
                         hysteresis=0.05)
    assert far.tolist() == [4] * 5 + [3] * 5  # no spare budget: the cutoff holds


def _width_counts(tier: torch.Tensor, block: torch.Tensor) -> torch.Tensor:
    """int64 ``[key blocks, 9]``: how many tokens of each width (column = bits) each key block holds,
    for widths ``tier`` whose tokens lie in key blocks ``block``."""
    counts = torch.zeros(int(block.max()) + 1, TIERS[-1] + 1, dtype=torch.int64)
    return counts.index_put_((block.long(), tier.long()), torch.ones(tier.numel(), dtype=torch.int64), accumulate=True)


def _tiles(tier: torch.Tensor, block: torch.Tensor, tile: int = 16) -> int:
    """Decode tiles of widths ``tier`` whose tokens lie in key blocks ``block``: per key block and width, ceil(count / tile)."""
    return int(((_width_counts(tier, block) + tile - 1) // tile).sum())


def test_tile_importance_groups_a_key_blocks_least_important_tokens() -> None:
    g = torch.Generator().manual_seed(4)
    block = torch.arange(200) // 64  # blocks of 64, 64, 64 and 8 tokens
    imp = torch.rand(200, generator=g)
    cur = torch.full((200,), 8)
    cur[[5, 70, 71]] = 3  # tokens already lower go first in their block, whatever their importance
    imp[[5, 70, 71]] = 2.0
    score = tile_importance(imp, cur, block)
    assert score.dtype == torch.float64 and torch.equal(score, tile_importance(imp.clone(), cur.clone(), block.clone()))
    for kb in range(4):
        members = torch.nonzero(block == kb).reshape(-1)
        key = cur[members] * 10 + imp[members].double()  # current width first, then importance
        ranked = members[torch.argsort(key, stable=True)]
        for g0 in range(0, ranked.numel(), 16):
            grp = ranked[g0:g0 + 16]
            mean = imp[grp].double().mean()
            # one group, one score (up to the in-group tie-break), in the group's own order
            assert torch.allclose(score[grp], mean.expand(grp.numel()), rtol=2e-8, atol=0)
            assert (score[grp][1:] > score[grp][:-1]).all()
    # the groups of all blocks are adjacent in the allocator's order (most important first)
    order = torch.argsort(-score, stable=True)
    grp_id = torch.zeros(200, dtype=torch.int64)
    for i, x in enumerate(sorted(set(score.round(decimals=6).tolist()))):
        grp_id[score.round(decimals=6) == x] = i
    changes = int((grp_id[order][1:] != grp_id[order][:-1]).sum())
    assert changes == len(set(grp_id.tolist())) - 1
    with pytest.raises(ValueError, match="one length"):
        tile_importance(imp, cur[:10], block)
    with pytest.raises(ValueError, match="tile"):
        tile_importance(imp, cur, block, tile=0)
    assert tile_importance(torch.empty(0), torch.empty(0), torch.empty(0)).numel() == 0


@pytest.mark.parametrize("avg", [3.97, 3.5, 2.6])
def test_allocating_by_tiles_leaves_whole_tiles_at_each_width(avg: float) -> None:
    # a budget a little under 4 bits (8-bit window and sinks charged to it) puts a few tokens at 3
    # bits: ranked token by token they land in most key blocks, by tiles in whole tiles
    g = torch.Generator().manual_seed(5)
    block = torch.arange(64 * 40) // 64
    imp = torch.rand(block.numel(), generator=g)
    cur = torch.full((block.numel(),), 8)
    budget = avg * block.numel()
    by_token = allocate_tiers(cur, imp, budget)
    by_tile = allocate_tiers(cur, tile_importance(imp, cur, block), budget)
    for got in (by_token, by_tile):
        assert got.to(torch.int64).sum() <= budget and got.to(torch.int64).sum() >= budget - 8
    fewest = 40 * 4 + (1 if avg < 4 and avg % 1 else 0)  # one key block may split at a step's budget boundary
    assert _tiles(by_tile, block) <= fewest + 1
    assert _tiles(by_token, block) > fewest + 10  # what the grouping removes
    # the tokens that went lower are the least important of their blocks
    for kb in range(40):
        members = torch.nonzero(block == kb).reshape(-1)
        w = by_tile[members]
        if w.min() < w.max():
            assert imp[members][w == w.min()].max() <= imp[members][w == w.max()].min()


def test_allocate_row_charges_the_positions_that_stay_to_the_budget() -> None:
    g = torch.Generator().manual_seed(7)
    tier = torch.full((300,), 8, dtype=torch.int8)
    tier[:40] = torch.tensor(TIERS)[torch.randint(0, 4, (40,), generator=g)]
    imp = torch.rand(300, generator=g)
    idx = torch.arange(20, 256)  # the rest stays: 20 first positions and the last 44
    budget = 3.5 * 300 - float(tier.sum() - tier[idx].sum())
    assert torch.equal(allocate_row(tier, imp, idx, 3.5, 64), allocate_tiers(tier[idx], imp[idx], budget))
    grouped = tile_importance(imp[idx], tier[idx], idx // 64)
    assert torch.equal(allocate_row(tier, imp, idx, 3.5, 64, 0.2, by_tile=True), allocate_tiers(tier[idx], grouped, budget, 0.2))


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_tile_ranking_on_a_gpu_gives_the_hosts_widths() -> None:
    # a cache on a GPU allocates from GPU tensors: the same groups, scores and widths as on the host
    g = torch.Generator().manual_seed(11)
    n = 5000
    tier = torch.full((n,), 4, dtype=torch.int8)
    tier[torch.rand(n, generator=g) < 0.05] = 3
    tier[-64:] = 8
    imp = torch.rand(n, generator=g) ** 4  # many near-equal small scores
    idx = torch.arange(4, n - 64)
    scores = tile_importance(imp[idx], tier[idx], idx // 64)
    on_gpu = tile_importance(imp[idx].cuda(), tier[idx].cuda(), (idx // 64).cuda())
    assert on_gpu.is_cuda and torch.equal(on_gpu.cpu(), scores)
    widths = allocate_row(tier, imp, idx, 3.9, 64, by_tile=True)
    assert torch.equal(allocate_row(tier.cuda(), imp.cuda(), idx.cuda(), 3.9, 64, by_tile=True).cpu(), widths)


@pytest.mark.parametrize("by_tile", [True, False])
def test_a_layers_allocations_keep_key_blocks_in_whole_tiles(by_tile: bool) -> None:
    # a 4-bit layer (key blocks of 64, as by default) through a prompt and decode steps with
    # allocations between them: allocating by tile, its lower widths come in whole tiles of a key
    # block, but for at most one split group per allocation; token by token (the default in rows this short), not
    g = torch.Generator().manual_seed(6)
    layer = KbitKVLayer(4, window=64, sink_tokens=4, block_size=64, hysteresis=0.1, allocate_by_tile=by_tile)
    _feed(layer, 1000, g)
    calls = _record_allocations(layer)
    for _ in range(200):
        _feed(layer, 1, g)
    assert len(calls) >= 3
    done = layer.k_block_min.shape[1] * 64
    tier = layer.tier[0, :done]
    block = torch.arange(done) // 64
    assert set(tier[4:].tolist()) >= {3, 4}  # the 8-bit window and sinks pushed some tokens to 3 bits
    counts = _width_counts(tier, block)
    split = int(((counts[1:, 3] % 16) != 0).sum())  # block 0 holds the sinks
    if by_tile:
        assert split <= len(calls) + 1, counts[:, 3].tolist()
    else:
        assert split > len(calls) + 5, counts[:, 3].tolist()


def test_the_window_starts_on_a_tile_boundary_and_the_sinks_where_asked() -> None:
    # the window's start rounds down to a tile boundary of its key block (tiles of 16 from the
    # block's start); the sinks are exactly sink_tokens from each row's first valid position
    fv = torch.tensor([0, 5, 60])
    sink = kv_cache.sink_positions(torch.arange(200), 4, fv)
    for row, lo in enumerate([0, 5, 60]):
        assert torch.equal(torch.nonzero(sink[row]).reshape(-1), torch.arange(lo, lo + 4)), row
    assert not kv_cache.sink_positions(torch.arange(100), 0, fv).any()
    zero = torch.zeros(1, dtype=torch.int64)
    kept = ~kv_cache.movable_positions(4136, 64, 4, 4096, zero, 64)[0]  # window from 4072 -> 4064
    assert torch.equal(torch.nonzero(kept).reshape(-1), torch.cat([torch.arange(4), torch.arange(4064, 4136)]))
    kept = ~kv_cache.movable_positions(4096, 64, 4, 4096, zero, 64)[0]  # already on a boundary: as asked
    assert torch.equal(torch.nonzero(kept).reshape(-1), torch.cat([torch.arange(4), torch.arange(4032, 4096)]))
    kept = ~kv_cache.movable_positions(140, 30, 0, 120, zero, 40)[0]  # blocks of 40: 110 -> 80 + 16 = 96, not 96 + 16
    assert torch.equal(torch.nonzero(kept).reshape(-1), torch.arange(96, 140))
    kept = ~kv_cache.movable_positions(4136, 0, 0, 4096, zero, 64)[0]  # no window, no sinks: the open block only
    assert torch.equal(torch.nonzero(kept).reshape(-1), torch.arange(4096, 4136))
    with pytest.raises(ValueError, match="block_size"):
        kv_cache.movable_positions(100, 8, 4, 64, zero, 0)
    with pytest.raises(ValueError, match="window"):
        kv_cache.movable_positions(100, -1, 4, 64, zero, 64)
    with pytest.raises(ValueError, match="sink_tokens"):
        kv_cache.sink_positions(torch.arange(10), -1, fv)


@pytest.mark.parametrize("length", [4096, 4136, 4100])
def test_a_by_tile_allocation_leaves_key_blocks_whole_tiles_at_the_windows_edge(length: int) -> None:
    # with the window's start on a tile boundary, a by-tile allocation costs each complete key
    # block its 64 / 16 = 4 tiles but the first, which holds the 4 sinks' tile too (a window
    # starting mid-tile would add a fifth to the block it starts in)
    g = torch.Generator().manual_seed(length)
    ranged = length // 64 * 64
    tier = torch.full((length,), 8, dtype=torch.int8)
    idx = torch.nonzero(kv_cache.movable_positions(length, 64, 4, ranged, torch.zeros(1, dtype=torch.int64), 64)[0]).reshape(-1)
    tier[idx] = allocate_row(tier, torch.rand(length, generator=g), idx, 4.0, 64, by_tile=True)
    assert set(tier.tolist()) >= {3, 4, 8}
    tiles = ((_width_counts(tier[:ranged], torch.arange(ranged) // 64) + 15) // 16).sum(1)
    assert int(tiles[0]) == 5 and int(tiles[1:].max()) == 4, tiles.tolist()


def test_cache_runs_deterministically_and_changes_tiers_mid_run() -> None:
    a, _ = _filled_layer(2, 2, 32, 40, kv_bits=3)
    b, _ = _filled_layer(2, 2, 32, 40, kv_bits=3)
    for t in TIERS:
        for name, x in a.buckets[t].tensors().items():
            assert torch.equal(x, b.buckets[t].tensors()[name]), (t, name)
    history = []
    layer = KbitKVLayer(3, window=8, sink_tokens=2, block_size=16, hysteresis=0.1)
    g = torch.Generator().manual_seed(0)
    for step in range(70):
        n = 30 if step == 0 else 1
        layer.update(torch.randn(1, 2, n, 32, generator=g), torch.randn(1, 2, n, 32, generator=g))
        layer.attend(torch.randn(1, 4, n, 32, generator=g), None, 32**-0.5)
        history.append(tuple(layer.buckets[t].num_tokens for t in TIERS))
    assert history[0] == (0, 0, 0, 30)
    assert len(set(history)) > 3 and history[-1][3] < 30  # tokens left 8 bits during decoding
    sizes = torch.tensor([t for t in TIERS]).double()
    avg = (torch.tensor(history[-1]).double() * sizes).sum() / layer.seq_len
    # over target only by the window (8, its start rounded down to a tile: up to 15 more), the
    # sinks and the open block
    assert avg <= 3 + 8 * ((8 + 15) + 2 + 16) / layer.seq_len


def _record_allocations(layer: KbitKVLayer) -> list[int]:
    """The list that will hold ``layer.seq_len`` at each of its allocator's runs from now on."""
    calls: list[int] = []
    run = layer.reallocate
    layer.reallocate = lambda: (calls.append(layer.seq_len), run())[1]
    return calls


def _feed(layer: KbitKVLayer, q: int, g: torch.Generator, attend: bool = True) -> None:
    """``q`` random tokens into a layer of 2 KV heads of 32 channels (4 query heads), then their attention."""
    layer.update(torch.randn(1, 2, q, 32, generator=g), torch.randn(1, 2, q, 32, generator=g))
    if attend:
        layer.attend(torch.randn(1, 4, q, 32, generator=g), None, 32**-0.5)


def test_a_chunked_prompt_allocates_every_prefill_interval_tokens() -> None:
    # chunks longer than block_size (a prompt) wait for prefill_interval tokens; decode steps
    # (one token) go back to block_size, starting with the first one after the prompt
    layer = KbitKVLayer(4, window=8, sink_tokens=2, block_size=16, hysteresis=0.1, prefill_interval=96)
    calls = _record_allocations(layer)
    g = torch.Generator().manual_seed(0)
    most_8bit = 0
    for _ in range(10):
        _feed(layer, 32, g)
        most_8bit = max(most_8bit, layer.buckets[8].num_tokens)
    assert calls == [96, 192, 288]  # every 96 tokens, not before each of the 9 later chunks
    assert most_8bit <= 96 + 32 + 8 + 2 + 16  # the interval, a chunk, the window, the sinks, an open key block
    for _ in range(40):
        _feed(layer, 1, g)
    assert calls == [96, 192, 288, 320, 336, 352]  # at the first decode step, then every 16 tokens
    movable = layer.tier[0, 2:352 - 8].to(torch.float64)  # allocated at 352: sinks and window excluded
    assert movable.mean() <= 4 + 1e-9


def test_prefill_interval_of_one_block_allocates_before_every_chunk() -> None:
    layer = KbitKVLayer(4, window=8, sink_tokens=2, block_size=16, hysteresis=0.1, prefill_interval=16)
    calls = _record_allocations(layer)
    g = torch.Generator().manual_seed(1)
    for _ in range(4):
        _feed(layer, 32, g, attend=False)
    assert calls == [32, 64, 96]


@pytest.mark.parametrize("fraction,steps,expected", [(0.25, 110, [128, 160, 200]), (1.0, 300, [128, 256])])
def test_decode_steps_at_long_context_allocate_every_allocation_fraction_of_the_cache(
        fraction: float, steps: int, expected: list[int]) -> None:
    # a quarter of the tokens cached at the last run (more than block_size from 64 tokens on):
    # after a 128-token prompt, runs at 128, 160 (+ 128 / 4), 200 (+ 160 / 4); a fraction of 1:
    # whenever the cache doubles
    layer = KbitKVLayer(4, window=8, sink_tokens=2, block_size=16, hysteresis=0.1, allocation_fraction=fraction)
    calls = _record_allocations(layer)
    g = torch.Generator().manual_seed(3)
    _feed(layer, 128, g)
    for _ in range(steps):
        _feed(layer, 1, g)
    assert calls == expected, calls
    waiting = layer.seq_len - calls[-1]  # stored at 8 bits since the last run
    assert 0 < waiting <= max(16, int(calls[-1] * fraction))


def test_the_default_allocation_fraction_keeps_short_contexts_at_block_size() -> None:
    # 1/64 of 50 tokens is less than one: block_size decides
    layer = KbitKVLayer(4, window=8, sink_tokens=2, block_size=16, hysteresis=0.1)
    calls = _record_allocations(layer)
    g = torch.Generator().manual_seed(4)
    for _ in range(50):
        _feed(layer, 1, g, attend=False)
    assert calls == [16, 32, 48]


@pytest.mark.parametrize("keep", [0, 3, 20])
def test_after_a_crop_decode_steps_allocate_at_once_then_every_block_size_tokens(keep: int) -> None:
    # 30 decode steps allocate at 16 and would next at 32; a crop to fewer tokens moves that to
    # the first step after it (at `keep`; at 0 the run has nothing to do), then every block_size
    layer = KbitKVLayer(4, window=4, sink_tokens=1, block_size=16, hysteresis=0.1)
    calls = _record_allocations(layer)
    g = torch.Generator().manual_seed(2)
    for _ in range(30):
        _feed(layer, 1, g)
    assert calls == [16]
    layer.crop(keep - 30)
    calls.clear()
    for _ in range(40):
        _feed(layer, 1, g)
    assert calls == [keep, keep + 16, keep + 32], calls


def test_a_crop_drops_the_key_ranges_of_blocks_it_empties() -> None:
    """Keys written again after a crop into whole key blocks it removed get ranges of their own:
    a cache cropped back to 80 tokens then fed 100 keys ten times larger holds them as a fresh
    cache fed the same 180 tokens does (before, the removed blocks' ranges were kept and the new
    keys were clamped to them)."""
    g = torch.Generator().manual_seed(0)
    heads, d = 2, 32
    k1, v1 = torch.randn(1, heads, 140, d, generator=g), torch.randn(1, heads, 140, d, generator=g)
    k2, v2 = torch.randn(1, heads, 100, d, generator=g) * 10, torch.randn(1, heads, 100, d, generator=g)
    queries = torch.randn(240, 1, 4, 1, d, generator=g)

    def feed(layer: KbitKVLayer, k: torch.Tensor, v: torch.Tensor, step: int) -> None:
        layer.update(k, v)
        layer.attend(queries[step].expand(1, 4, k.shape[2], d), None, d**-0.5)

    def layer_fed(first: int) -> KbitKVLayer:
        layer = KbitKVLayer(4, window=8, sink_tokens=2, block_size=16, hysteresis=0.1)
        feed(layer, k1[:, :, :64], v1[:, :, :64], 0)
        for t in range(64, first):
            feed(layer, k1[:, :, t : t + 1], v1[:, :, t : t + 1], t)
        return layer

    cropped, fresh = layer_fed(140), layer_fed(80)
    cropped.crop(-60)
    assert cropped.seq_len == 80 and cropped.k_block_min.shape[1] == 5
    for layer in (cropped, fresh):
        for t in range(100):
            feed(layer, k2[:, :, t : t + 1], v2[:, :, t : t + 1], 140 + t)
    truth = torch.cat([k1[:, :, :80], k2], 2)
    errors = [float((layer.dequantize()[0] - truth).abs()[:, :, 80:].max()) for layer in (cropped, fresh)]
    assert cropped.tier[0, 80:].lt(8).any()  # keys of the new blocks were demoted
    assert errors[0] == pytest.approx(errors[1], rel=1e-6) and errors[1] < 10


def test_a_crop_inside_a_block_keeps_its_range() -> None:
    layer = KbitKVLayer(4, window=4, sink_tokens=1, block_size=16, hysteresis=0.1)
    g = torch.Generator().manual_seed(5)
    for _ in range(70):
        _feed(layer, 1, g)
    assert layer.k_block_min.shape[1] == 4
    layer.crop(-30)  # 40 tokens: blocks 0, 1 whole, block 2 in part
    assert layer.seq_len == 40 and layer.k_block_min.shape[1] == 3
    layer.crop(-8)  # 32: on a block boundary
    assert layer.k_block_min.shape[1] == 2


@pytest.mark.parametrize("batch", [1, 2])
def test_tier_mass_and_seen_grow_in_place_and_new_columns_start_clean(batch: int) -> None:
    # decode steps widen views of spare-column buffers (no copy); after a crop, a batch edit or an
    # allocation replaced a tensor, the next step copies it into a new buffer; new columns always
    # hold width 8 and no mass, whatever the buffer held there before
    layer = KbitKVLayer(4, window=4, sink_tokens=1, block_size=16, hysteresis=0.1, mass_interval=1)
    g = torch.Generator().manual_seed(4)

    def step(q: int = 1) -> None:
        b = layer.batch if layer.is_initialized else batch
        layer.update(torch.randn(b, 2, q, 32, generator=g), torch.randn(b, 2, q, 32, generator=g))
        layer.attend(torch.randn(b, 4, q, 32, generator=g), None, 32**-0.5)

    step(5)
    for _ in range(6):  # room for 5 + 16 columns after the first 5, no allocation before 16: the buffers stay
        before = [x.data_ptr() for x in (layer.tier, layer.mass, layer.seen)]
        old = [x.clone() for x in (layer.tier, layer.mass, layer.seen)]
        layer.update(torch.randn(batch, 2, 1, 32, generator=g), torch.randn(batch, 2, 1, 32, generator=g))
        assert [x.data_ptr() for x in (layer.tier, layer.mass, layer.seen)] == before
        assert all(torch.equal(x[:, :-1], o) for x, o in zip((layer.tier, layer.mass, layer.seen), old))
        assert (layer.tier[:, -1] == 8).all() and (layer.mass[:, -1] == 0).all() and (layer.seen[:, -1] == 0).all()
        layer.attend(torch.randn(batch, 4, 1, 32, generator=g), None, 32**-0.5)
    assert (layer.mass[:, :-1] > 0).all() and (layer.seen > 0).all()
    layer.crop(-4)  # the kept view's buffer has written columns past it
    layer.update(torch.randn(batch, 2, 3, 32, generator=g), torch.randn(batch, 2, 3, 32, generator=g))
    assert layer.tier.shape == (batch, layer.seq_len)
    assert (layer.tier[:, -3:] == 8).all() and (layer.mass[:, -3:] == 0).all() and (layer.seen[:, -3:] == 0).all()
    if batch > 1:
        layer.batch_select_indices(torch.tensor([1]))
        step()
        assert layer.tier.shape == (1, layer.seq_len) and (layer.seen[:, -1] > 0).all()
    for _ in range(30):  # allocations replace tier; widths below 8 appear and stay
        step()
    assert (layer.tier < 8).any() and layer.tier.shape[1] == layer.seq_len


def test_mass_interval_records_every_nth_decode_step_and_leaves_outputs_alone() -> None:
    # interval 3: steps 0, 3, 6, ... add mass and count; the others change neither; attention
    # outputs equal those of a layer recording every step (until an allocation could differ)
    layers = [KbitKVLayer(4, window=4, sink_tokens=1, block_size=64, hysteresis=0.1, mass_interval=m) for m in (1, 3)]
    g = torch.Generator().manual_seed(7)
    prompt = (torch.randn(1, 2, 20, 32, generator=g), torch.randn(1, 2, 20, 32, generator=g))
    for layer in layers:
        layer.update(*prompt)
        layer.attend(torch.randn(1, 4, 20, 32, generator=torch.Generator().manual_seed(1)), None, 32**-0.5)  # prefill: recorded
    for step in range(7):
        k, v, qry = torch.randn(1, 2, 1, 32, generator=g), torch.randn(1, 2, 1, 32, generator=g), torch.randn(1, 4, 1, 32, generator=g)
        before = layers[1].mass.clone(), layers[1].seen.clone()
        outs = []
        for layer in layers:
            layer.update(k, v)
            outs.append(layer.attend(qry, None, 32**-0.5))
        assert torch.equal(outs[0], outs[1])
        grew = not torch.equal(layers[1].seen[:, :-1], before[1])
        assert grew == (step % 3 == 0), step
        if not grew:
            assert torch.equal(layers[1].mass[:, :-1], before[0]) and not layers[1].mass[:, -1].any()
    assert float(layers[1].seen[0, 0]) == 4 * (20 + 3)  # the prompt's 20 queries and decode steps 0, 3, 6
    assert float(layers[0].seen[0, 0]) == 4 * (20 + 7)


# ---- memory --------------------------------------------------------------------------------------

@pytest.mark.parametrize("kv_bits,limit", [(4, 0.30), (2.5, 0.20)])
def test_nbytes_vs_bf16(kv_bits: float, limit: float) -> None:
    # Llama-3-8B attention layer shape, 2048 tokens
    heads, d, n = 8, 128, 2048
    g = torch.Generator().manual_seed(0)
    layer = KbitKVLayer(kv_bits, window=64, sink_tokens=4, block_size=64, hysteresis=0.1)
    k = torch.randn(1, heads, n, d, generator=g)
    layer.update(k, torch.randn(1, heads, n, d, generator=g))
    layer.attend(torch.randn(1, 32, 1, d, generator=g)[:, :, :1], None, d**-0.5)
    layer.update(torch.randn(1, heads, 1, d, generator=g), torch.randn(1, heads, 1, d, generator=g))
    bf16 = 2 * heads * d * 2 * layer.seq_len
    total = sum(layer.nbytes_by_kind().values())
    assert total / bf16 <= limit, (total / bf16, layer.nbytes_by_kind())
    assert layer.tier[:, :-1].to(torch.float64).mean() <= kv_bits + 1e-9  # the budget held when it was allocated


# ---- models --------------------------------------------------------------------------------------

def _tiny(kind: str):
    common = dict(vocab_size=128, hidden_size=128, intermediate_size=256, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, head_dim=32, max_position_embeddings=256)
    torch.manual_seed(0)
    if kind == "llama":
        return LlamaForCausalLM(LlamaConfig(**common)).eval()
    if kind == "qwen3":
        return Qwen3ForCausalLM(Qwen3Config(**common)).eval()
    if kind == "mistral":
        return MistralForCausalLM(MistralConfig(**common, sliding_window=24)).eval()
    if kind == "gemma3":
        cfg = Gemma3TextConfig(**common, sliding_window=24, layer_types=["sliding_attention", "full_attention"])
        return Gemma3ForCausalLM(cfg).eval()
    raise AssertionError(kind)


@pytest.mark.parametrize("kind", ["llama", "qwen3", "mistral", "gemma3"])
def test_generate_8bit_matches_dynamic_cache(kind: str) -> None:
    model = _tiny(kind)
    ids = torch.randint(3, 128, (2, 30), generator=torch.Generator().manual_seed(0))
    am = torch.ones_like(ids)
    am[1, :4] = 0  # left padding
    kw = dict(attention_mask=am, max_new_tokens=12, do_sample=False, pad_token_id=0, output_scores=True,
              return_dict_in_generate=True)
    ref = model.generate(ids, **{cache_keyword(model): DynamicCache(config=model.config)}, **kw)
    cache = KbitKVCache(model.config, kv_bits=8, window=4, block_size=8)
    out = model.generate(ids, **{cache_keyword(model): cache}, **kw)
    assert model.config._attn_implementation == "kbit_kv"
    assert cache.get_seq_length() == 41 and cache.nbytes > 0
    # same tokens, except where a random model's top two logits tie within the int8 error (then
    # the row is compared up to that step only)
    for row in range(2):
        for step, (a, b) in enumerate(zip(ref.scores, out.scores)):
            assert (a[row] - b[row]).abs().max() < 0.02
            if ref.sequences[row, 30 + step] != out.sequences[row, 30 + step]:
                top = a[row].topk(2).values
                assert top[0] - top[1] < 0.02, (row, step)
                break


def test_beam_search_8bit_matches_dynamic_cache() -> None:
    model = _tiny("llama")
    ids = torch.randint(3, 128, (1, 20), generator=torch.Generator().manual_seed(1))
    kw = dict(max_new_tokens=6, do_sample=False, num_beams=3, pad_token_id=0)
    ref = model.generate(ids, **{cache_keyword(model): DynamicCache(config=model.config)}, **kw)
    out = model.generate(ids, **{cache_keyword(model): KbitKVCache(model.config, kv_bits=8, window=4, block_size=8)}, **kw)
    assert torch.equal(out, ref)


def _kl_decode(model, kv_bits: float, steps: int = 24) -> float:
    """Mean KL(bf16-cache logits || kbit-cache logits) over teacher-forced decode steps."""
    ids = torch.randint(3, 128, (1, 64 + steps), generator=torch.Generator().manual_seed(2))
    caches = [DynamicCache(config=model.config), KbitKVCache(model.config, kv_bits=kv_bits, window=8, sink_tokens=2, block_size=16)]
    kls = []
    with torch.no_grad():
        kw = cache_keyword(model)
        logits = [model(ids[:, :64], **{kw: c}).logits[:, -1] for c in caches]
        for t in range(64, 64 + steps):
            p, q = (F.log_softmax(x.float(), -1) for x in logits)
            kls.append(float((p.exp() * (p - q)).sum()))
            logits = [model(ids[:, t:t + 1], **{kw: c}).logits[:, -1] for c in caches]
    if kv_bits < 8:
        assert caches[1].tier_counts()[8] < caches[1].get_seq_length() * 2  # tokens below 8 bits were used
    return sum(kls) / len(kls)


def test_lower_bits_bounded_kl() -> None:
    model = _tiny("llama")
    for layer in model.model.layers:  # sharper attention than a random init gives
        layer.self_attn.q_proj.weight.data *= 4
    kl = {bits: _kl_decode(model, bits) for bits in (8, 4, 2.5)}
    assert kl[8] < 1e-4
    assert kl[8] <= kl[4] <= kl[2.5] < 0.05, kl


def test_model_forward_accepts_cache() -> None:
    model = _tiny("qwen3")
    cache = KbitKVCache(model.config, kv_bits=4)
    ids = torch.randint(3, 128, (2, 9))
    out = model(ids, **{cache_keyword(model): cache}, use_cache=True)
    assert kv_cache.output_cache(out) is cache and cache.get_seq_length() == 9
    with pytest.raises(TypeError, match="output"):
        kv_cache.output_cache(out.logits)
    out2 = model(ids[:, :1], **{cache_keyword(model): cache})
    assert torch.isfinite(out2.logits).all()
    # the same model still runs with other caches (SDPA)
    ref = model(ids, **{cache_keyword(model): DynamicCache(config=model.config)}).logits
    torch.testing.assert_close(out.logits, ref, atol=0.05, rtol=0)


def test_allocate_by_tile_reaches_every_layer() -> None:
    config = LlamaConfig(hidden_size=64, num_attention_heads=2, num_hidden_layers=3)
    for replayable in (False, True):
        for value in (True, False, None):
            layers = KbitKVCache(config, allocate_by_tile=value, replayable=replayable).layers
            assert all(layer.allocate_by_tile is value for layer in layers)
        assert all(layer.allocate_by_tile is None for layer in KbitKVCache(config, replayable=replayable).layers)


def test_by_default_rows_from_tile_allocation_from_positions_allocate_by_tile(monkeypatch) -> None:
    # allocate_by_tile=None: token by token while the row is shorter than TILE_ALLOCATION_FROM
    # positions, by tile from then on (the threshold lowered to one of this run's allocation points,
    # 1000 + 64 k, so that a short run crosses it and an off-by-one shows)
    monkeypatch.setattr(kv_cache, "TILE_ALLOCATION_FROM", 1128)
    seen: list[tuple[int, bool]] = []
    original = kv_cache.allocate_row
    monkeypatch.setattr(kv_cache, "allocate_row", lambda tier, imp, idx, *a: (seen.append((tier.numel(), a[-1])), original(tier, imp, idx, *a))[1])
    layer = KbitKVLayer(4, window=64, sink_tokens=4, block_size=64, hysteresis=0.1)
    g = torch.Generator().manual_seed(7)
    _feed(layer, 1000, g)
    for _ in range(200):
        _feed(layer, 1, g)
    assert 1128 in [n for n, _ in seen] and any(n < 1128 for n, _ in seen), seen
    assert all(by_tile == (n >= 1128) for n, by_tile in seen), seen


def test_cache_keyword_names_the_forward_argument_that_takes_the_cache() -> None:
    import inspect
    model = LlamaForCausalLM(LlamaConfig(hidden_size=64, intermediate_size=128, num_attention_heads=2, num_hidden_layers=1,
                                         vocab_size=100)).eval()
    kw = kv_cache.cache_keyword(model)
    assert kw in ("cache", "past_key_values") and kw in inspect.signature(model.forward).parameters
    cache = KbitKVCache(model.config)
    with warnings.catch_warnings():
        warnings.simplefilter("error", FutureWarning)  # the current name: no deprecation warning
        model(torch.tensor([[1, 2, 3]]), **{kw: cache})
    assert cache.get_seq_length() == 3
    assert kv_cache.cache_keyword(torch.compile(model)) == kw  # through torch.compile's wrapper
    with pytest.raises(TypeError, match="model"):
        kv_cache.cache_keyword("model")


# ---- bad inputs ----------------------------------------------------------------------------------

@pytest.mark.parametrize("bad", [1, 9, 1.5, True, "4", None])
def test_bad_kv_bits(bad) -> None:
    with pytest.raises(ValueError, match="kv_bits"):
        KbitKVCache(LlamaConfig(hidden_size=64, num_attention_heads=2, num_hidden_layers=1), kv_bits=bad)


@pytest.mark.parametrize("name,value", [("window", -1), ("sink_tokens", 1.5), ("block_size", 0), ("hysteresis", 1.0),
                                        ("prefill_interval", 0), ("allocation_fraction", 0),
                                        ("allocation_fraction", 1.5), ("allocation_fraction", True), ("mass_interval", 0),
                                        ("mass_interval", 2.0), ("allocate_by_tile", 1), ("allocate_by_tile", "yes"),
                                        ("allocate_by_tile", 0)])
def test_bad_keywords(name: str, value) -> None:
    with pytest.raises(ValueError, match=name):
        KbitKVCache(LlamaConfig(hidden_size=64, num_attention_heads=2, num_hidden_layers=1), **{name: value})


def test_bad_models() -> None:
    with pytest.raises(ValueError, match="head_dim"):
        KbitKVCache(LlamaConfig(hidden_size=96, num_attention_heads=2, num_hidden_layers=1))  # head_dim 48
    from transformers import Gemma2Config
    with pytest.raises(ValueError, match="attn_logit_softcapping"):
        KbitKVCache(Gemma2Config(hidden_size=64, num_attention_heads=2, head_dim=32, num_hidden_layers=2))
    cfg = LlamaConfig(hidden_size=64, num_attention_heads=2, num_hidden_layers=1)
    cfg._attn_implementation = "flash_attention_2"
    with pytest.raises(ValueError, match="_attn_implementation"):
        KbitKVCache(cfg)
    layer = KbitKVLayer(4, 8, 2, 16, 0.1)
    with pytest.raises(ValueError, match="head_dim"):
        layer.update(torch.randn(1, 1, 3, 40), torch.randn(1, 1, 3, 40))


def test_a_config_that_is_not_one_or_does_not_fit_the_model_is_named() -> None:
    model = _tiny("llama")
    with pytest.raises(TypeError, match=r"config must be a transformers PretrainedConfig \(pass model.config\), got LlamaForCausalLM"):
        KbitKVCache(model)
    for bad in (None, model.config.to_dict()):
        with pytest.raises(TypeError, match="config must be a transformers PretrainedConfig"):
            KbitKVCache(bad)
    KbitKVCache(model.config)  # (switches the model's attention to the cache's)
    short = KbitKVCache(LlamaConfig(**{**model.config.to_dict(), "num_hidden_layers": 1}))
    with pytest.raises(ValueError, match=r"layer_idx 1: this KbitKVCache has 1 layers.*KbitKVCache\(model.config\)"):
        model(torch.tensor([[5, 6, 7]]), **{cache_keyword(model): short})


def test_output_attentions_warns_that_there_are_no_weights(monkeypatch) -> None:
    from kbit_linear import kv_cache
    monkeypatch.setattr(kv_cache, "_warned_no_weights", False)
    model = _tiny("llama")
    cache = KbitKVCache(model.config, kv_bits=8)
    with pytest.warns(UserWarning, match="output_attentions=True: KbitKVCache's attention computes no attention weights"):
        model(torch.tensor([[5, 6, 7]]), **{cache_keyword(model): cache}, output_attentions=True)


def test_view_refuses_tensor_use() -> None:
    layer = KbitKVLayer(4, 8, 2, 16, 0.1)
    view, _ = layer.update(torch.randn(1, 1, 3, 32), torch.randn(1, 1, 3, 32))
    assert isinstance(view, KbitKVView)
    with pytest.raises(AttributeError, match="kbit_kv"):
        view.shape
    with pytest.raises(TypeError, match="kbit_kv"):
        torch.matmul(torch.randn(2, 2), view)
    with pytest.raises(TypeError, match="kbit_kv.*called cat"):  # views inside a list argument
        torch.cat([view, view])
    for use in (lambda: view[:, :, :2], lambda: len(view), lambda: view * 2):
        with pytest.raises(TypeError, match="kbit_kv"):
            use()
    assert view  # truthy, as any object


def test_batch_select_indices_takes_a_bool_mask_and_refuses_floats() -> None:
    by_rows, _ = _filled_layer(3, 2, 32, 40, 4.0, seed=3)
    by_mask, _ = _filled_layer(3, 2, 32, 40, 4.0, seed=3)
    by_rows.batch_select_indices(torch.tensor([1, 2]))
    by_mask.batch_select_indices(torch.tensor([False, True, True]))
    assert by_mask.batch == 2
    for a, b in zip(by_rows.dequantize(), by_mask.dequantize()):
        assert torch.equal(a, b)
    assert not by_mask._spare  # the old batch's spare column buffers are not kept (nbytes counts what is held)
    with pytest.raises(ValueError, match="one entry per batch row"):
        by_mask.batch_select_indices(torch.tensor([True, False, True]))
    with pytest.raises(TypeError, match="integer row numbers or a bool mask"):
        by_mask.batch_select_indices(torch.tensor([0.0, 1.0]))


def test_float_masks_with_the_dtype_minimum_are_masked_and_int_masks_refused() -> None:
    from kbit_linear.kv_format import mask_bias, visible_queries

    mask = torch.ones(2, 1, 3, 10, dtype=torch.bool).tril(7)
    mask[1, :, :, :2] = False
    for dtype in (torch.float32, torch.bfloat16, torch.float16):  # transformers' masks: 0 or the dtype's lowest
        as_min = torch.zeros(mask.shape, dtype=dtype).masked_fill(~mask, torch.finfo(dtype).min)
        assert torch.equal(mask_bias(as_min, 2, 3, 10), mask_bias(mask, 2, 3, 10))
        assert torch.equal(visible_queries(as_min, 2, 3, 10), visible_queries(mask, 2, 3, 10))
    bias = torch.where(mask, -2.5, -math.inf)  # an ordinary additive bias is kept as it is
    assert torch.equal(mask_bias(bias, 2, 3, 10), bias[:, 0])
    with pytest.raises(TypeError, match="attention_mask must be bool"):
        mask_bias(mask.long(), 2, 3, 10)


def test_top_level_export() -> None:
    assert kbit_linear.KbitKVCache is KbitKVCache
    assert math.isclose(KbitKVCache(LlamaConfig(hidden_size=64, num_attention_heads=2, num_hidden_layers=1), 3.5).kv_bits, 3.5)


def test_visible_queries_counts_what_the_bias_allows() -> None:
    from kbit_linear.kv_format import mask_bias, visible_queries

    mask = torch.ones(2, 1, 3, 10, dtype=torch.bool).tril(7)
    mask[1, :, :, :2] = False
    for m in (None, mask, torch.where(mask, 0.0, -math.inf)):
        expect = torch.isfinite(mask_bias(m, 2, 3, 10)).sum(1).float()
        assert torch.equal(visible_queries(m, 2, 3, 10), expect)


def test_append_equals_the_sorting_merge() -> None:
    from kbit_linear.kv_cache import _merge
    from kbit_linear.kv_format import _append

    g = torch.Generator().manual_seed(3)
    for batch in (1, 3):
        n_old = [5, 0, 7][:batch]
        rows = torch.cat([torch.full((n,), r) for r, n in enumerate(n_old)]).long()
        pos = torch.cat([torch.sort(torch.randperm(20, generator=g)[:n]).values for n in n_old]).long()
        old = quantize_tokens(torch.randn(rows.numel(), 2, 64, generator=g), torch.randn(rows.numel(), 2, 64, generator=g), 8, rows, pos, batch)
        q = 2
        new_rows = torch.arange(batch).repeat_interleave(q)
        new_pos = torch.arange(20, 20 + q).repeat(batch)
        new = quantize_tokens(torch.randn(batch * q, 2, 64, generator=g), torch.randn(batch * q, 2, 64, generator=g), 8, new_rows,
                              new_pos, batch)
        a, b = _append(old, new), _merge(old, new, batch)
        for name, x in b.tensors().items():
            assert torch.equal(a.tensors()[name], x), (batch, name)


def test_8bit_codes_of_zero_and_underflowing_groups_are_zero() -> None:
    # one head of 64 channels = two groups of 32: all zero, and so small that amax / 127 is 0 in fp16
    from kbit_linear.kv_format import _sym8

    x = torch.zeros(3, 1, 64)
    x[1, 0, 32:] = 1e-9 * torch.arange(1, 33)
    x[2] = torch.linspace(-3, 5, 64)
    codes, scale = _sym8(x, 32)
    assert torch.equal(scale[:2], torch.zeros(2, 1, 2, dtype=torch.float16))
    assert torch.equal(codes[:2], torch.zeros(2, 1, 64, dtype=torch.int8))
    s = scale[2].float().repeat_interleave(32, -1)
    assert torch.equal(codes[2], (x[2] / s).round().clamp(-127, 127).to(torch.int8))
    assert int(codes[2].abs().max()) == 127


def test_first_valid_of_a_row_whose_first_prompt_chunk_is_all_padding() -> None:
    """Left padding longer than a prompt's first chunk: the row's first valid position (where its
    sinks start) comes from the first chunk that shows one, as with the whole prompt at once."""
    model = _tiny("llama")
    ids = torch.randint(3, 128, (2, 40), generator=torch.Generator().manual_seed(2))
    mask = torch.ones(2, 40, dtype=torch.long)
    mask[1, :20] = 0
    whole, chunked = KbitKVCache(model.config, kv_bits=4), KbitKVCache(model.config, kv_bits=4)
    with torch.no_grad():
        model(ids, attention_mask=mask, **{cache_keyword(model): whole}, use_cache=True)
        for i in range(0, 40, 8):
            model(ids[:, i:i + 8], attention_mask=mask[:, :i + 8], **{cache_keyword(model): chunked}, use_cache=True)
    for a, b in zip(whole.layers, chunked.layers):
        assert a.first_valid.tolist() == b.first_valid.tolist() == [0, 20]
        assert not b._rows_pending


@pytest.mark.parametrize("kind", ["gemma3", "mistral"])
def test_first_valid_on_sliding_window_layers_is_the_first_unpadded_position(kind: str) -> None:
    """A sliding-window layer's mask hides the positions before the window: the sinks still start at
    a row's first unpadded position, not at the window's start (which would keep the wrong tokens at
    8 bits), as on the full-attention layers."""
    model = _tiny(kind)
    ids = torch.randint(3, 128, (2, 60), generator=torch.Generator().manual_seed(3))
    mask = torch.ones(2, 60, dtype=torch.long)
    mask[1, :20] = 0
    cache = KbitKVCache(model.config, kv_bits=4)
    with torch.no_grad():
        model(ids, attention_mask=mask, **{cache_keyword(model): cache}, use_cache=True)
    for layer in cache.layers:
        assert layer.first_valid.tolist() == [0, 20]


def test_crop_forgets_the_first_valid_positions_it_removes() -> None:
    """An emptied cache finds each row's first unpadded position (where its sinks start) again, as a
    fresh one does, and a partial crop back into a row's padding marks that row as not yet seen;
    the cropped cache then gives the fresh cache's logits."""
    model = _tiny("llama")
    g = torch.Generator().manual_seed(4)
    ids, ids2 = torch.randint(3, 128, (2, 40), generator=g), torch.randint(3, 128, (2, 40), generator=g)
    mask, mask2 = torch.ones(2, 40, dtype=torch.long), torch.ones(2, 40, dtype=torch.long)
    mask[1, :20] = 0
    mask2[0, :12] = 0
    kw = dict(kv_bits=3, window=4, block_size=8, sink_tokens=4)
    fresh, cropped = KbitKVCache(model.config, **kw), KbitKVCache(model.config, **kw)
    with torch.no_grad():
        model(ids, attention_mask=mask, **{cache_keyword(model): cropped}, use_cache=True)
        assert cropped.layers[0].first_valid.tolist() == [0, 20]
        cropped.crop(-30)  # row 1 keeps positions 0..9: padding only
        assert cropped.layers[0].first_valid.tolist() == [0, 0] and cropped.layers[0]._rows_pending
        cropped.crop(-cropped.get_seq_length())
        a = model(ids2, attention_mask=mask2, **{cache_keyword(model): fresh}, use_cache=True).logits
        b = model(ids2, attention_mask=mask2, **{cache_keyword(model): cropped}, use_cache=True).logits
        for _ in range(12):  # past the first allocation, where the sinks matter
            nxt = torch.randint(3, 128, (2, 1), generator=g)
            mask2 = torch.cat([mask2, torch.ones(2, 1, dtype=torch.long)], 1)
            a = model(nxt, attention_mask=mask2, **{cache_keyword(model): fresh}, use_cache=True).logits
            b = model(nxt, attention_mask=mask2, **{cache_keyword(model): cropped}, use_cache=True).logits
    for x, y in zip(fresh.layers, cropped.layers):
        assert x.first_valid.tolist() == y.first_valid.tolist() == [12, 0]
        assert torch.equal(x.tier, y.tier)
    torch.testing.assert_close(a, b, rtol=0, atol=0)
