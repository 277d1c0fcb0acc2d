"""``KbitKVCache``: a transformers cache holding K/V at 2, 3, 4 or 8 bits per token, and its attention.

The storage format and the reference attention are in :mod:`kbit_linear.kv_format`. This module
adds the per-layer state (buckets, key block ranges, token importance), the allocator that
moves tokens to lower widths to meet the target average, the transformers ``Cache`` and the
attention function registered as ``"kbit_kv"``.

How a step runs, per layer: ``update()`` first re-allocates when ``block_size`` tokens (or
``allocation_fraction`` times the tokens cached at the last allocation, if more) arrived since
that allocation, or
``prefill_interval`` tokens while a prompt arrives in chunks longer than ``block_size`` (each
allocation is a pass over every cached token). Allocating, the tokens
outside the recent window and the sinks, in complete key blocks, get widths from their
importance (or, by default from :data:`TILE_ALLOCATION_FROM` positions on, in groups of a key
block's 16 least important tokens, the next 16, ...: the decode kernel's tiles,
:func:`tile_importance`); a token only
ever moves down, re-coded from its decoded values. Then ``update()``
stores the new tokens at 8 bits and returns a :class:`KbitKVView` in place of the key and value
tensors. The model's attention, ``"kbit_kv"``, sees that view and runs
:func:`kbit_linear._kv_ops.decode_attention` (the fused CUDA kernel on a GPU, the reference
:func:`kbit_linear.kv_format.bucket_attention` elsewhere; prefill: dequantize + SDPA), which
also yields each token's attention mass; its running mean per token is the importance.

``KbitKVCache(replayable=True)`` gives the same results with :class:`ReplayableKVLayer`s: between
two allocations their decode steps write in place and change no tensor's address (the 8-bit
tokens in a store of fixed capacity, the length and the call count also on the device), the
state that a replayed CUDA graph needs.
"""

from __future__ import annotations

import contextlib
import inspect
import logging
import warnings
import math
import numbers
from collections.abc import Iterator, Mapping
from types import MappingProxyType
from typing import Any

import torch
import torch.nn.functional as F
from transformers import AttentionInterface, PretrainedConfig
from transformers.cache_utils import Cache, CacheLayerMixin, get_layer_types_and_kwargs
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import AttentionMaskInterface, causal_mask_function, sdpa_mask

from ._kv_ops import append_tokens8, append_tokens8_in_place, decode_attention, decode_attention_in_place
from .kv_format import (
    TIERS,
    TILE_ENTRIES,
    KVBucket,
    KVStore8,
    _check_positive_int,
    accumulate_mass,
    attended_positions,
    causal_visible,
    channel_group,
    dequantize_bucket,
    key_block_ranges,
    mask_bias,
    quantize_tokens,
    visible_queries,
)

__all__ = ["ALLOCATION_FRACTION", "ATTENTION_NAME", "MASS_INTERVAL", "PREFILL_INTERVAL", "TILE_ALLOCATION_FROM", "KbitKVCache",
           "KbitKVLayer", "KbitKVView", "ReplayableKVLayer", "allocate_row", "allocate_tiers", "cache_keyword", "movable_positions", "output_cache", "sink_positions",
           "tile_importance", "kbit_kv_attention", "kbit_kv_mask"]

logger = logging.getLogger(__name__)

ATTENTION_NAME = "kbit_kv"
"""The name the attention function is registered under in transformers' attention interface."""

DECODE_MAX_QUERIES = 16
"""Queries up to which attention runs over the buckets; longer inputs (prefill) dequantize + SDPA."""

PREFILL_INTERVAL = 8192
"""Default ``prefill_interval``: tokens a chunked prefill adds at 8 bits between two allocations.

Every allocation walks all cached tokens (a few host round trips per layer), so allocating after
every chunk made a 32k-token prompt in 2048-token chunks spend 8.7 of its 12.0 s prefill in the
allocator (H200, Llama-3-8B shape, 512 allocations). Waiting for 8192 tokens keeps up to that
many tokens, plus one chunk, at 8 instead of ~4 bits in the meantime (~0.25 GB on that shape
for the interval's share)."""

ALLOCATION_FRACTION = 1 / 64
"""Default ``allocation_fraction``: between two allocations, decode steps add at most this
fraction of the tokens cached at the last one (or ``block_size`` tokens, if more) at 8 bits.

An allocation walks every cached token on the host (~17 ms per layer at 32k tokens on an H200,
Llama-3-8B shape), so running it every ``block_size`` = 64 decode steps cost ~9 ms per step,
amortized, at 32k. Tied to the cache's length, its cost per step stays flat as the context grows,
and the new tokens waiting at 8 bits lift the average width by at most ``(8 - kv_bits) * f / (1 + f)``
bits (0.06 at ``kv_bits=4``) before the next allocation brings it back."""

MASS_INTERVAL = 4
"""Default ``mass_interval``: decode steps record the attention mass on one step in four.

Skipping it saves the mass kernel and the logits it reads: 38.7 -> 34.0 us of attention per
layer at 32k tokens, batch 1, and 197 -> 180 us at batch 8 (H200, ``bench_kv_attention.py``);
29.5 against 30.4 ms per eager decode step end to end (``kv-generate-host-h200.md``). Importance
is the mean over the recorded steps, and the KL against the dense cache did not move
(SmolLM2-135M, 512-token prompt, 192 decode steps: 0.00527 -> 0.00524 at 4 bits, 0.17419 both
at 2.5; ``kv-cache-accuracy.md``)."""

TILE_ALLOCATION_FROM = 4096
"""Row length (positions) from which ``allocate_by_tile=None``, the default, ranks groups of a key
block's tokens (:func:`tile_importance`) instead of single tokens.

Ranked token by token, the few tokens a budget puts one width lower land in most key blocks, and
each such block costs the decode kernel a fifth, almost empty tile: attention at ``kv_bits=4`` ran
1.02-1.14x slower than with whole tiles (H200, ``bench_kv_attention.py``, the ``4-alloc`` and
``4-tiles`` columns of ``kv-attention-h200.md``). Groups are coarser, and cost more where more
of the row moves (the window and sinks weigh more in short rows): KL against the dense cache on
SmolLM2 at ``kv_bits=4`` rose by 19 % at 2080 tokens, 3.0 % at 4032 and 3.6 % at 8032
(``kv-cache-accuracy.md``). From 4096 positions on, the speed is worth those 3-4 %. A row that
grows past the threshold keeps the widths set before it (widths never rise), so its first key
blocks may keep a partial tile each."""

_PREFILL_OBSERVED = 32  # prefill scores importance from its last 32 queries (SnapKV-style), not all of them
_COLUMN_FILL = {"tier": 8, "mass": 0.0, "seen": 0.0}  # the per-token columns and what a new token holds in each
_COLUMN_ALIGN = 16  # a replayable layer's column buffers are a multiple of 16 wide (16-byte aligned int8 tier rows)
_SUPPORTED_LAYERS = ("full_attention", "sliding_attention")


def cache_keyword(model: torch.nn.Module) -> str:
    """The keyword under which ``model``'s forward (and ``generate``) takes a cache:
    ``"cache"`` from transformers 5.24, which renamed it (the old name warns there and goes in
    5.40), ``"past_key_values"`` before. Pass a :class:`KbitKVCache` as ``**{cache_keyword(model): cache}``."""
    if not isinstance(model, torch.nn.Module):
        raise TypeError(f"model must be a torch.nn.Module, got {type(model).__name__}")
    inner = getattr(model, "_orig_mod", model)  # torch.compile's wrapper forwards (*args, **kwargs)
    if callable(getattr(inner, "get_base_model", None)):  # so does a peft model
        inner = inner.get_base_model()
    return "cache" if "cache" in inspect.signature(inner.forward).parameters else "past_key_values"


def output_cache(output: Any) -> Any:
    """The cache a model's output returns (None where it returns none): ``output.cache`` from
    transformers 5.24, which renamed the field as it did the argument (:func:`cache_keyword`),
    ``output.past_key_values`` before (on 5.24 a deprecated alias)."""
    if hasattr(output, "cache"):
        return output.cache
    if hasattr(output, "past_key_values"):
        return output.past_key_values
    raise TypeError(f"output must be a model output with a cache field, got {type(output).__name__}")


def tile_importance(importance: torch.Tensor, current: torch.Tensor, key_block: torch.Tensor, tile: int = TILE_ENTRIES) -> torch.Tensor:
    """Importance by groups of ``tile`` tokens of a key block, for :func:`allocate_tiers` to move whole groups.

    The decode kernel takes a key block's tokens of one width ``tile`` at a time, so a key block
    with 63 tokens at 4 bits and one at 3 costs five tiles where 64 at 4 bits cost four. Ranked
    token by token, the allocator scatters its lower width over most key blocks: at
    ``kv_bits=4`` the 8-bit window and sinks count against the budget, so 1-2 % of the other
    tokens go to 3 bits, and over a generation every allocation adds strays (``kv_bits=4`` at 32k
    tokens: 19 % more tiles than one width per key block, ``scripts/kv_tile_count.py``).

    Each key block's tokens are ordered by current width (the ones already lower first: they
    cannot rise), then importance (least first), and cut into groups of ``tile``; every token
    gets its group's mean importance, times ``1 + 1e-9 * (its rank in the group)`` so that the
    group's tokens stay adjacent in the allocator's order and keep their own. The allocator's
    steps then decide group by group, except where a step's budget ends inside a group.

    Args:
        importance: float ``[m]``, each token's importance.
        current: int ``[m]``, each token's width now.
        key_block: int ``[m]``, each token's key block.
        tile: tokens per group.

    Returns:
        float64 ``[m]`` on ``importance``'s device (computed on the host, as :func:`allocate_tiers`
        works: a GPU's ``index_add_`` sums floats in no fixed order, and the allocator must give
        the same widths for the same inputs).
    """
    m = importance.numel()
    if not (importance.shape == current.shape == key_block.shape == (m,)):
        raise ValueError(f"importance, current and key_block must be 1-D of one length, got {tuple(importance.shape)}, "
                         f"{tuple(current.shape)} and {tuple(key_block.shape)}")
    tile = _check_positive_int("tile", tile, 1)
    imp = importance.to("cpu", torch.float64)
    if m == 0:
        return imp.to(importance.device)
    cur, blk = current.to(imp.device, torch.int64), key_block.to(imp.device, torch.int64)
    order = torch.argsort(imp, stable=True)  # least important first, ties to the earlier token
    order = order[torch.argsort(cur[order], stable=True)]
    order = order[torch.argsort(blk[order], stable=True)]
    first = torch.ones(m, dtype=torch.bool, device=imp.device)
    first[1:] = blk[order][1:] != blk[order][:-1]
    idx = torch.arange(m, device=imp.device)
    rank = idx - torch.cummax(torch.where(first, idx, torch.zeros_like(idx)), 0).values  # rank in the key block
    group_sorted = torch.cumsum(first | (rank % tile == 0), 0) - 1
    group = torch.empty_like(group_sorted)
    group[order] = group_sorted
    n = int(group_sorted[-1]) + 1
    size = torch.zeros(n, dtype=torch.float64, device=imp.device).index_add_(0, group, torch.ones_like(imp))
    mean = torch.zeros(n, dtype=torch.float64, device=imp.device).index_add_(0, group, imp) / size
    in_group = torch.empty_like(imp)
    in_group[order] = (rank % tile).to(torch.float64)
    return (mean[group] * (1 + 1e-9 * in_group)).to(importance.device)


def _ideal_widths(importance: torch.Tensor, budget: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Step 1 of :func:`allocate_tiers`: the walk order (most important first, ties to the earlier
    token) and the ideal widths, int64 ``[m]``, that split ``budget`` between the two tiers around
    its average (all 8 above it, all 2 below 2), the upper one to the most important tokens."""
    m = importance.numel()
    order = torch.argsort(-importance.to(torch.float64), stable=True)
    avg = budget / m
    ideal = torch.full((m,), TIERS[0], dtype=torch.int64)
    if avg >= TIERS[-1]:
        ideal[:] = TIERS[-1]
    elif avg > TIERS[0]:
        hi_i = next(i for i, t in enumerate(TIERS) if t > avg)
        lo, hi = TIERS[hi_i - 1], TIERS[hi_i]
        n_hi = int(math.floor(m * (avg - lo) / (hi - lo) + 1e-9))
        ranked = torch.full((m,), lo, dtype=torch.int64)
        ranked[:n_hi] = hi
        ideal[order] = ranked
    return order, ideal


def allocate_tiers(current: torch.Tensor, importance: torch.Tensor, budget: float, hysteresis: float = 0.1) -> torch.Tensor:
    """Choose the widths of a row's movable tokens for a bit budget (deterministic, never raises a width).

    1. The ideal widths split the budget between the two tiers around the average ``budget / m``
       (all 8 above it, all 2 below 2): the most important tokens get the upper one.
    2. No token moves up (its lost precision cannot come back): ``new = min(current, ideal)``.
    3. Hysteresis: a token the ideal would demote keeps its width if its importance is at least
       ``(1 - hysteresis)`` times the lowest importance that the ideal gave that width, most
       important first, while the budget allows.
    4. Budget left over goes to the most important tokens still below their current width.

    Ties in importance go to the earlier token (stable sort), so equal inputs give equal outputs.

    Args:
        current: int ``[m]``, each token's width now (a tier).
        importance: float ``[m]``.
        budget: total bits the ``m`` tokens may use (sum of widths).
        hysteresis: in ``[0, 1)``.

    Returns:
        int8 ``[m]``: the new widths, each ``<= current``.
    """
    if current.dim() != 1 or importance.dim() != 1 or current.numel() != importance.numel():
        raise ValueError(f"current and importance must be 1-D of one length, got {tuple(current.shape)} and "
                         f"{tuple(importance.shape)}")
    if not 0 <= hysteresis < 1:
        raise ValueError(f"hysteresis must be in [0, 1), got {hysteresis}")
    device = current.device
    cur = current.to("cpu", torch.int64)  # the walks below read values back step by step: on the host
    importance = importance.to("cpu")
    if cur.numel() == 0:
        return cur.to(torch.int8)
    order, ideal = _ideal_widths(importance, budget)
    new = torch.minimum(cur, ideal)
    slack = budget - float(new.sum())
    imp = importance.to(torch.float64)
    walk_cur, walk_new = cur[order], new[order]  # in the walk's order: most important first
    if hysteresis > 0 and slack > 0:
        cutoff = torch.full((TIERS[-1] + 1,), math.inf, dtype=torch.float64)
        for t in TIERS:
            if bool((ideal >= t).any()):
                cutoff[t] = imp[ideal >= t].min()
        keep = (walk_new < walk_cur) & (imp[order] >= (1 - hysteresis) * cutoff[walk_cur])
        taken, slack = _take_in_order((walk_cur - walk_new).to(torch.float64), keep, slack)
        walk_new = torch.where(taken, walk_cur, walk_new)
    walk_new, slack = _spend_in_order(walk_cur, walk_new, slack)
    new[order] = walk_new
    return new.to(device, torch.int8)


def _tile_start(pos: int, block_size: int) -> int:
    """The tile boundary at or before position ``pos`` in its key block (tiles of TILE_ENTRIES
    positions from the block's start)."""
    start = pos // block_size * block_size
    return start + (pos - start) // TILE_ENTRIES * TILE_ENTRIES


def sink_positions(positions: torch.Tensor, sink_tokens: int, first_valid: torch.Tensor) -> torch.Tensor:
    """bool ``[B, n]``: which of ``positions`` (int ``[n]``) are sinks in each row: the
    ``sink_tokens`` positions from the row's first valid position (``first_valid``, int ``[B]``).

    Unlike the window's start (:func:`movable_positions`), the sinks' end is not rounded to a
    tile: 4 sinks give the first key block a fifth tile (1.03x a decode call at 4k tokens and batch
    1 when rounded, H200), but rounding to 16 sinks holds 12 more tokens at 8 bits against the
    budget, and the allocator pushes others down for them: KL on SmolLM2 +32 % at 4 bits and +70 %
    at 3 bits over 544 tokens, +29 % at 3 bits over 2080 (``bench/results/kv-cache-accuracy.md``)."""
    sink_tokens = _check_positive_int("sink_tokens", sink_tokens, 0)
    fv = first_valid.to(torch.int64)
    p = positions.to(fv.device).unsqueeze(0)
    return (p >= fv.unsqueeze(1)) & (p < (fv + sink_tokens).unsqueeze(1))


def movable_positions(length: int, window: int, sink_tokens: int, ranged: int, first_valid: torch.Tensor,
                      block_size: int) -> torch.Tensor:
    """bool ``[B, length]``: the positions the allocator may move in rows of ``length`` cached
    positions. The rest stay at 8 bits: each row's sinks (:func:`sink_positions`), the last
    ``window`` positions with the window's start rounded down to a tile boundary of its key block
    (``block_size`` positions), and those from ``ranged`` on (the key blocks without a key range
    yet: the open one).

    The decode kernel reads a key block's tokens of one width a tile at a time, so a window that
    starts mid-tile costs its key block a fifth tile; rounded, at most 15 more recent tokens stay
    at 8 bits (1.04x a decode call at 4136 tokens and batch 1, H200). KL on SmolLM2 over 2072
    tokens, where the window started 8 positions into a tile: -5 % at 4 bits, +8 % at 3, +3 % at
    2.5 (``bench/results/kv-cache-accuracy.md``)."""
    for name, v in (("length", length), ("window", window), ("ranged", ranged)):
        _check_positive_int(name, v, 0)
    block_size = _check_positive_int("block_size", block_size, 1)
    p = torch.arange(length, device=first_valid.device)
    kept = sink_positions(p, sink_tokens, first_valid) | (p >= ranged)
    if window:
        kept |= p >= _tile_start(length - window, block_size)
    return ~kept


def allocate_row(tier: torch.Tensor, importance: torch.Tensor, movable: torch.Tensor, kv_bits: float, block_size: int,
                 hysteresis: float = 0.1, by_tile: bool = False) -> torch.Tensor:
    """The new widths of one row's movable positions, as :meth:`KbitKVLayer.reallocate` sets them.

    The budget is ``kv_bits`` bits per position of the row less the bits of the positions that
    do not move (the window, the sinks, the open key block, at their widths); ``by_tile`` ranks
    the positions by :func:`tile_importance` (the key block of position ``p`` is ``p //
    block_size``), else by their own importance; then :func:`allocate_tiers`.

    Args:
        tier: int ``[S]``, the row's widths now (its length is the row's).
        importance: float ``[S]``, each position's importance.
        movable: int64 ``[m]``, the positions the allocator may move.
        kv_bits: target average width over the row.
        block_size: positions per key block.
        hysteresis: as in :func:`allocate_tiers`.
        by_tile: rank groups of a key block's tokens (``KbitKVCache``'s ``allocate_by_tile``).

    Returns:
        int8 ``[m]``: the widths of ``movable``.
    """
    current = tier[movable]
    fixed_bits = float(tier.to(torch.float64).sum() - current.to(torch.float64).sum())
    rank = importance[movable].cpu()  # allocate_tiers works on the host
    if by_tile:
        rank = tile_importance(rank, current, movable // block_size)
    return allocate_tiers(current, rank, kv_bits * tier.numel() - fixed_bits, hysteresis)


def _take_in_order(cost: torch.Tensor, allowed: torch.Tensor, slack: float) -> tuple[torch.Tensor, float]:
    """Walk the items in order, taking an allowed one when its cost fits the slack (which it then
    uses up): the result of that loop, found run by run (cumulative sums) instead of item by item.

    Returns the mask of taken items and the slack left.
    """
    taken = torch.zeros_like(allowed)
    pos, n = 0, cost.numel()
    while pos < n:
        fits = torch.nonzero(allowed[pos:] & (cost[pos:] <= slack))
        if fits.numel() == 0:
            break
        start = pos + int(fits[0])
        used = torch.where(allowed[start:], cost[start:], torch.zeros_like(cost[start:])).cumsum(0)
        k = int(torch.searchsorted(used, torch.tensor([slack], dtype=used.dtype), right=True))  # >= 1: item start fits
        taken[start:start + k] = allowed[start:start + k]
        slack -= float(used[k - 1])
        pos = start + k
    return taken, slack


_NEXT_TIER = torch.tensor([TIERS[min(TIERS.index(t) + 1, len(TIERS) - 1)] if t in TIERS else t for t in range(TIERS[-1] + 1)])


def _spend_in_order(cur: torch.Tensor, new: torch.Tensor, slack: float) -> tuple[torch.Tensor, float]:
    """The allocator's last step, in walk order: while at least one bit is left, each token below
    its current width rises to the highest width (at most its current) that the slack pays for.
    Runs of full rises are taken at once (cumulative sums); a partial rise is one item."""
    new = new.clone()
    pos, n = 0, cur.numel()
    gap = (cur - new).to(torch.float64)
    step = (_NEXT_TIER[new] - new).to(torch.float64)
    while slack >= 1 and pos < n:
        fits = torch.nonzero((gap[pos:] > 0) & (step[pos:] <= slack))
        if fits.numel() == 0:
            break
        start = pos + int(fits[0])
        used = gap[start:].cumsum(0)
        k = int(torch.searchsorted(used, torch.tensor([slack], dtype=used.dtype), right=True))
        if k > 0:  # these rise all the way
            new[start:start + k] = cur[start:start + k]
            slack -= float(used[k - 1])
            gap[start:start + k] = 0
            pos = start + k
            continue
        c, w = int(cur[start]), int(new[start])  # a partial rise to the highest width the slack pays for
        t = max(t for t in TIERS if w <= t <= c and t - w <= slack)
        slack -= float(t - w)
        new[start] = t
        pos = start + 1
    return new, slack


def _select(bucket: KVBucket, index: torch.Tensor, rows: torch.Tensor, batch: int) -> KVBucket:
    """Entries ``index`` of a bucket, given new batch rows ``rows``, re-sorted into a bucket."""
    order = torch.argsort(rows.to(torch.int64) * (1 << 32) + bucket.pos[index].to(torch.int64), stable=True)
    index, rows = index[order], rows[order].to(torch.int64)
    t = {name: val[index] for name, val in bucket.tensors().items() if name != "row_start"}
    row_start = torch.zeros(batch + 1, dtype=torch.int32, device=bucket.pos.device)
    row_start[1:] = torch.bincount(rows, minlength=batch).cumsum(0).to(torch.int32)
    return KVBucket(bucket.bits, row_start, **t)


def _merge(a: KVBucket, b: KVBucket, batch: int) -> KVBucket:
    """Union of two buckets of the same width."""
    cat = {name: torch.cat([val, b.tensors()[name]]) for name, val in a.tensors().items() if name != "row_start"}
    rows = torch.cat([a.rows(), b.rows()])
    joined = KVBucket(a.bits, a.row_start, **cat)
    return _select(joined, torch.arange(rows.numel(), device=rows.device), rows, batch)


class KbitKVView:
    """Stands in for the key and value tensors that ``KbitKVCache.update`` would otherwise return.

    Only the ``"kbit_kv"`` attention function reads it (``view.layer`` is the cache layer).
    Anything else that treats it as a tensor gets an error saying why.
    """

    __slots__ = ("layer",)

    def __init__(self, layer: "KbitKVLayer") -> None:
        self.layer = layer

    @staticmethod
    def _refuse() -> str:
        """The error message for a model whose attention cannot read the cache."""
        return (
            "KbitKVCache hands attention a KbitKVView, not tensors: the model's attention must run through "
            f"transformers' attention interface with attn_implementation={ATTENTION_NAME!r} (KbitKVCache(config) sets "
            "it on the config it is given; pass the model's own config). This model's attention used the cache "
            "output directly, so it cannot use KbitKVCache."
        )

    def __getattr__(self, name: str):
        raise AttributeError(f"{self._refuse()} (it asked for .{name})")

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        """Refuse every torch operation with the explanation (views inside lists too: ``torch.cat``)."""
        raise TypeError(f"{cls._refuse()} (it called {getattr(func, '__name__', func)})")

    def _refuse_operator(self, *args: object) -> None:
        raise TypeError(f"{self._refuse()} (it indexed it, took its length or used it in arithmetic)")

    def __bool__(self) -> bool:  # (not through __len__: a view is there, whatever it holds)
        return True

    __getitem__ = __len__ = __iter__ = _refuse_operator
    __add__ = __radd__ = __sub__ = __rsub__ = __mul__ = __rmul__ = __matmul__ = __rmatmul__ = __truediv__ = _refuse_operator


class KbitKVLayer(CacheLayerMixin):
    """One layer of a :class:`KbitKVCache`: buckets per width, key block ranges, importance.

    Attributes (after the first update): ``buckets`` (width -> :class:`KVBucket`),
    ``k_block_min``/``k_block_range`` (fp16 ``[B, n_blocks, H, D]``), ``tier`` (int8 ``[B, S]``,
    each token's width), ``mass``/``seen`` (float32 ``[B, S]``: attention mass received and
    query-heads that could see the token; importance is their ratio), ``first_valid`` (int64
    ``[B]``: the first position not masked as padding, where the sinks start). ``tier``, ``mass``
    and ``seen`` are views into buffers with spare columns (not contiguous when ``B > 1``).
    Arguments as :class:`KbitKVCache`'s, which checks them. :meth:`steps_until_allocation` says
    when the allocator runs next.
    """

    is_sliding = False
    is_compileable = False
    _rows_pending = False  # a row has shown no unmasked position yet (_note_first_valid)
    # crop cannot undo the demotions the cropped tokens caused, so a rollback would leave a trace
    is_croppable = False

    def __init__(self, kv_bits: float, window: int, sink_tokens: int, block_size: int, hysteresis: float,
                 prefill_interval: int = PREFILL_INTERVAL, allocation_fraction: float = ALLOCATION_FRACTION,
                 mass_interval: int = MASS_INTERVAL, allocate_by_tile: bool | None = None) -> None:
        super().__init__()
        self.allocate_by_tile = allocate_by_tile
        self.kv_bits, self.window, self.sink_tokens = float(kv_bits), window, sink_tokens
        self.block_size, self.hysteresis, self.prefill_interval = block_size, hysteresis, prefill_interval
        self.allocation_fraction, self.mass_interval = allocation_fraction, mass_interval
        self.seq_len, self._alloc_len = 0, 0  # tokens cached now, and at the last allocation
        self._decode_calls = 0  # attention calls of decode size so far (every mass_interval-th records the mass)

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        """Allocate empty state for the batch, heads and head_dim of the first update."""
        b, h, _, d = key_states.shape
        channel_group(d)  # raises for a head_dim that is not a multiple of 32
        if value_states.shape[-1] != d:
            raise ValueError(f"KbitKVCache needs keys and values of one head_dim, got {d} and {value_states.shape[-1]}")
        self.dtype, self.device = key_states.dtype, key_states.device
        self.batch, self.heads, self.head_dim = b, h, d
        self.buckets = {t: KVBucket.empty(t, b, h, d, self.device) for t in TIERS}
        self.k_block_min = torch.zeros(b, 0, h, d, dtype=torch.float16, device=self.device)
        self.k_block_range = torch.zeros_like(self.k_block_min)
        self.tier = torch.zeros(b, 0, dtype=torch.int8, device=self.device)
        self.mass = torch.zeros(b, 0, dtype=torch.float32, device=self.device)
        self.seen = torch.zeros_like(self.mass)
        self.first_valid: torch.Tensor | None = None
        self.seq_len, self._alloc_len = 0, 0  # tokens cached at the last allocation
        self.workspace: dict = {}  # what the attention backend derives from the widths (emptied when they change)
        self._spare: dict[str, tuple[torch.Tensor, int]] = {}  # tier / mass / seen: (buffer, columns in use)
        self.is_initialized = True

    # ---- transformers' layer API -------------------------------------------------------------

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs) -> tuple[KbitKVView, KbitKVView]:
        """Store new tokens (``[B, H, q, D]``) at 8 bits, after re-allocating if due; returns the view twice."""
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        b, h, q, d = key_states.shape
        if (b, h, d) != (self.batch, self.heads, self.head_dim):
            raise ValueError(f"update got keys of shape {tuple(key_states.shape)}, the cache holds [{self.batch}, {self.heads}, *, {self.head_dim}]")
        if self._allocation_due(q):
            self.reallocate()
            self._alloc_len = self.seq_len
        self._store_tokens(key_states, value_states)
        self._add_columns(q)
        self.seq_len += q
        view = KbitKVView(self)
        return view, view

    def _store_tokens(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        """The new tokens at 8 bits after each row's entries (one kernel on a GPU)."""
        self.buckets[8] = append_tokens8(self.buckets[8], key_states, value_states, self.seq_len)

    def _add_columns(self, q: int) -> None:
        """``tier``, ``mass`` and ``seen`` grow by ``q`` columns for new tokens (width 8, no mass
        yet). Each lives in a buffer with spare columns, made holding those values, so that a
        decode step only widens the views; a buffer is made anew, with 1/16 (at least
        ``block_size``) spare, when it is full or the tensor was replaced (an allocation, a crop,
        a batch edit)."""
        for name in _COLUMN_FILL:
            cur = getattr(self, name)
            b, s = cur.shape
            buf, used = self._spare.get(name, (None, -1))
            if buf is None or used != s or cur.data_ptr() != buf.data_ptr() or buf.shape[0] != b or buf.shape[1] < s + q:
                buf = self._spare_columns(name, s + q + max(self.block_size, (s + q) // 16))
            self._spare[name] = (buf, s + q)
            setattr(self, name, buf[:, :s + q])

    def _spare_columns(self, name: str, columns: int) -> torch.Tensor:
        """Move ``tier``, ``mass`` or ``seen`` (``name``) into a new buffer of ``columns`` columns
        (the new ones hold a new token's value) and return it."""
        cur = getattr(self, name)
        b, s = cur.shape
        buf = torch.full((b, columns), _COLUMN_FILL[name], dtype=cur.dtype, device=cur.device)
        buf[:, :s] = cur
        self._spare[name] = (buf, s)
        setattr(self, name, buf[:, :s])
        return buf

    def _is_prompt_chunk(self, incoming: int) -> bool:
        """Whether an update of ``incoming`` tokens counts as a chunk of a prompt (more than ``block_size``)."""
        return incoming > self.block_size

    def _allocation_interval(self, incoming: int) -> int:
        """Tokens between two allocator runs while updates bring ``incoming`` tokens each:
        ``block_size``, or ``allocation_fraction`` times the tokens cached when it last ran if
        more, or ``prefill_interval`` for a prompt's chunks."""
        if self._is_prompt_chunk(incoming):
            return max(self.block_size, self.prefill_interval)
        return max(self.block_size, int(self._alloc_len * self.allocation_fraction))

    def steps_until_allocation(self, q: int) -> int:
        """Updates of ``q`` tokens each that store their tokens before the allocator runs again
        (it runs first thing in the update after them; 0: in the next one).

        The allocator runs at the start of an update once :meth:`_allocation_interval` tokens
        arrived since its last run (at ``seq_len`` 0 it has nothing to do and does not run).
        """
        left = self._allocation_interval(q) - (self.seq_len - self._alloc_len)
        return max(0, -(-left // q))

    def _allocation_due(self, incoming: int) -> bool:
        """Whether the allocator runs before ``incoming`` new tokens are stored."""
        return self.steps_until_allocation(incoming) == 0

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        """(kv_length, kv_offset) of the mask for the next step: every position is kept."""
        return self.seq_len + query_length, 0

    def get_seq_length(self) -> int:
        """Tokens cached."""
        return self.seq_len

    def get_max_length(self) -> int:
        """No maximum (-1)."""
        return -1

    def offload(self) -> None:
        """Not supported (the cache holds no ``keys``/``values`` tensors to move)."""
        raise NotImplementedError("KbitKVCache does not support offloading")

    prefetch = offload

    def reset(self) -> None:
        """Drop every token; the next update starts from scratch."""
        self.is_initialized = False
        self.seq_len = 0
        self._decode_calls = 0
        self.buckets = {}
        self.workspace = {}
        self._spare = {}

    def _remap_rows(self, src: torch.Tensor) -> None:
        """New batch row ``r`` becomes a copy of old row ``src[r]`` (beam search and batch edits)."""
        if not self.is_initialized:
            return
        src = src.to(self.device, torch.int64)
        nb = src.numel()
        self.workspace.clear()
        for t, bk in self.buckets.items():
            starts, ends = bk.row_start[:-1].to(torch.int64)[src], bk.row_start[1:].to(torch.int64)[src]
            counts = ends - starts
            new_rows = torch.repeat_interleave(torch.arange(nb, device=self.device), counts)
            offsets = torch.arange(int(counts.sum()), device=self.device) - torch.repeat_interleave(counts.cumsum(0) - counts, counts)
            index = torch.repeat_interleave(starts, counts) + offsets
            self.buckets[t] = _select(bk, index, new_rows, nb)
        for name in ("k_block_min", "k_block_range", "tier", "mass", "seen"):
            setattr(self, name, getattr(self, name)[src])
        if self.first_valid is not None:
            self.first_valid = self.first_valid[src]
            self._first_valid_known = self._first_valid_known[src]
        self._spare.clear()  # sized for the old batch: not reusable, and nbytes would not count them
        self.batch = nb

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        """Reorder the batch rows for beam search (row ``r`` takes old row ``beam_idx[r]``)."""
        self._remap_rows(beam_idx)

    def batch_repeat_interleave(self, repeats: int) -> None:
        """Repeat every batch row ``repeats`` times (expansion for beams or several samples)."""
        if self.is_initialized:
            self._remap_rows(torch.arange(self.batch, device=self.device).repeat_interleave(repeats))

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        """Keep only the batch rows ``indices`` (integer row numbers, or a bool mask over the rows).

        Raises:
            TypeError: ``indices`` neither integer nor bool.
            ValueError: a bool mask whose length is not the batch size.
        """
        indices = torch.as_tensor(indices).reshape(-1)
        if indices.dtype == torch.bool:
            if self.is_initialized and indices.numel() != self.batch:
                raise ValueError(f"indices as a bool mask must have one entry per batch row ({self.batch}), got {indices.numel()}")
            indices = torch.nonzero(indices).reshape(-1)
        elif indices.is_floating_point() or indices.is_complex():
            raise TypeError(f"indices must be integer row numbers or a bool mask, got {indices.dtype}")
        self._remap_rows(indices)

    def crop(self, tokens_to_remove: int) -> None:
        """Remove the last ``-tokens_to_remove`` tokens (a negative count, as transformers passes it).

        Demotions already made stay made. The key block ranges of blocks that lose every position
        are dropped (tokens written there again get a range of their own when the block completes);
        the range of a block left incomplete is kept, so tokens written there again are clamped to
        it if they are later demoted. A row cropped back to padding only (or an emptied cache)
        finds its first unpadded position, where its sinks start, again from the next masks.
        """
        if tokens_to_remove > 0:
            raise ValueError(f"crop takes a negative number of tokens to remove, got {tokens_to_remove}")
        if tokens_to_remove == 0 or not self.is_initialized:
            return
        keep = max(self.seq_len + tokens_to_remove, 0)
        self.workspace.clear()
        for t, bk in self.buckets.items():
            idx = torch.nonzero(bk.pos < keep).reshape(-1)
            self.buckets[t] = _select(bk, idx, bk.rows()[idx], self.batch)
        self.tier, self.mass, self.seen = self.tier[:, :keep], self.mass[:, :keep], self.seen[:, :keep]
        ranged = -(-keep // self.block_size)  # blocks that keep a position
        self.k_block_min, self.k_block_range = self.k_block_min[:, :ranged], self.k_block_range[:, :ranged]
        self.seq_len = keep
        self._alloc_len = min(self._alloc_len, keep - self.block_size)  # a decode step allocates no later than before
        # A row whose first unpadded position went with the crop has shown none yet: its sinks
        # start where the next call's mask shows one (an emptied cache starts over, as a fresh one).
        if keep == 0:
            self.first_valid = None
        elif self.first_valid is not None:
            lost = self.first_valid >= keep
            self._first_valid_known &= ~lost
            self.first_valid = torch.where(lost, 0, self.first_valid)
            self._rows_pending = not bool(self._first_valid_known.all())

    # ---- storage ------------------------------------------------------------------------------

    def dequantize(self) -> tuple[torch.Tensor, torch.Tensor]:
        """The cache as dense float32 keys and values ``[B, H, S, D]`` (what attention computes on)."""
        k = torch.zeros(self.batch, self.seq_len, self.heads, self.head_dim, device=self.device)
        v = torch.zeros_like(k)
        for bk in self.buckets.values():
            kd, vd = dequantize_bucket(bk, self.k_block_min, self.k_block_range, self.block_size)
            rows, pos = bk.rows(), bk.pos.to(torch.int64)
            k[rows, pos], v[rows, pos] = kd, vd
        return k.transpose(1, 2), v.transpose(1, 2)

    def nbytes_by_kind(self) -> dict[str, int]:
        """Bytes held: ``payload`` (codes), ``scales`` (per-token scales, key block ranges), ``metadata``."""
        out = {"payload": 0, "scales": 0, "metadata": 0}
        if not self.is_initialized:
            return out
        for part in self._token_storage():
            for kind, n in part.nbytes().items():
                out[kind] += n
        for t in (self.k_block_min, self.k_block_range):
            out["scales"] += t.numel() * t.element_size()
        for t in (self.tier, self.mass, self.seen):  # their buffers' spare columns included
            out["metadata"] += t.untyped_storage().nbytes()
        if self.first_valid is not None:
            out["metadata"] += self.first_valid.numel() * self.first_valid.element_size() + self._first_valid_known.numel()
        return out

    def _token_storage(self) -> list[KVBucket | KVStore8]:
        """What holds the tokens (each with an ``nbytes()``): the buckets."""
        return list(self.buckets.values())

    def importance(self) -> torch.Tensor:
        """float32 ``[B, S]``: mean attention mass per query head that could see each token."""
        return self.mass / self.seen.clamp_min(1.0)

    # ---- allocation ---------------------------------------------------------------------------

    def _range_new_blocks(self) -> None:
        """Give every newly completed key block its per-channel range (from its 8-bit keys, sinks excluded)."""
        n_done, n_complete = self.k_block_min.shape[1], self.seq_len // self.block_size
        if n_complete <= n_done:
            return
        lo, hi = n_done * self.block_size, n_complete * self.block_size
        bk = self.buckets[8]
        idx = torch.nonzero((bk.pos >= lo) & (bk.pos < hi)).reshape(-1)
        sel = _select(bk, idx, bk.rows()[idx], self.batch)
        k, _ = dequantize_bucket(sel)
        rows, pos = sel.rows(), sel.pos.to(torch.int64)
        dense = torch.zeros(self.batch, hi - lo, self.heads, self.head_dim, device=self.device)
        dense[rows, pos - lo] = k
        # sinks would stretch the range with their outliers; they never leave 8 bits
        fv = self.first_valid if self.first_valid is not None else torch.zeros(self.batch, dtype=torch.int64, device=self.device)
        sink = sink_positions(torch.arange(lo, hi, device=self.device), self.sink_tokens, fv)
        blocks = dense.reshape(self.batch, n_complete - n_done, self.block_size, self.heads, self.head_dim)
        sink = sink.reshape(self.batch, n_complete - n_done, self.block_size, 1, 1)
        mn, rng = _range_ignoring_nan(blocks.masked_fill(sink, float("nan")))
        self.k_block_min = torch.cat([self.k_block_min, mn], 1)
        self.k_block_range = torch.cat([self.k_block_range, rng], 1)

    def reallocate(self) -> None:
        """Run the allocator on every row and move the tokens whose width went down."""
        if self.seq_len == 0:
            return
        self._range_new_blocks()
        s = self.seq_len
        fv = self.first_valid if self.first_valid is not None else torch.zeros(self.batch, dtype=torch.int64, device=self.device)
        movable = movable_positions(s, self.window, self.sink_tokens, self.k_block_min.shape[1] * self.block_size, fv,
                                    self.block_size)
        new_tier = self.tier.clone()
        imp = self.importance()
        by_tile = s >= TILE_ALLOCATION_FROM if self.allocate_by_tile is None else self.allocate_by_tile
        for b in range(self.batch):
            idx = torch.nonzero(movable[b]).reshape(-1)
            if idx.numel() == 0:
                continue
            new_tier[b, idx] = allocate_row(self.tier[b], imp[b], idx, self.kv_bits, self.block_size, self.hysteresis,
                                            by_tile)
        self._move(new_tier)

    def _move(self, new_tier: torch.Tensor) -> None:
        """Re-code every token whose width changed into its new bucket (decoded, then quantized again)."""
        self.workspace.clear()
        moving: dict[int, list[tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]]] = {t: [] for t in TIERS}
        for t, bk in list(self.buckets.items()):
            rows, pos = bk.rows(), bk.pos.to(torch.int64)
            dest = new_tier[rows, pos].to(torch.int64)
            go = torch.nonzero(dest != t).reshape(-1)
            if go.numel() == 0:
                continue
            out = _select(bk, go, rows[go], self.batch)
            k, v = dequantize_bucket(out, self.k_block_min, self.k_block_range, self.block_size)
            o_rows, o_pos = out.rows(), out.pos.to(torch.int64)
            o_dest = new_tier[o_rows, o_pos].to(torch.int64)
            for d in TIERS:
                sel = torch.nonzero(o_dest == d).reshape(-1)
                if sel.numel():
                    moving[d].append((k[sel], v[sel], o_rows[sel], o_pos[sel]))
            stay = torch.nonzero(dest == t).reshape(-1)
            self.buckets[t] = _select(bk, stay, rows[stay], self.batch)
        for d, parts in moving.items():
            if not parts:
                continue
            k, v, rows, pos = (torch.cat(x) for x in zip(*parts))
            add = quantize_tokens(k, v, d, rows, pos, self.batch, self.k_block_min, self.k_block_range, self.block_size)
            self.buckets[d] = _merge(self.buckets[d], add, self.batch)
        self.tier = new_tier

    # ---- attention ----------------------------------------------------------------------------

    def attend(self, query: torch.Tensor, attention_mask: torch.Tensor | None, scaling: float) -> torch.Tensor:
        """Attention of ``query`` ``[B, Hq, q, D]`` over the cache; returns ``[B, q, Hq, D]`` and records the mass.

        Up to :data:`DECODE_MAX_QUERIES` queries it is :func:`~kbit_linear._kv_ops.decode_attention`
        (the fused kernel on a GPU, :func:`~kbit_linear.kv_format.bucket_attention` elsewhere),
        which records the mass on every ``mass_interval``-th such call; longer inputs dequantize
        the cache and call SDPA (importance from the last 32 queries, always recorded).
        """
        b, hq, q, d = query.shape
        if d != self.head_dim or hq % self.heads:
            raise ValueError(f"query of shape {tuple(query.shape)} does not fit the cache ({self.heads} KV heads of {self.head_dim})")
        s = self.seq_len
        dev = query.device
        self._note_first_valid(attention_mask, b, q, s, dev)
        if q <= DECODE_MAX_QUERIES:
            return self._decode(query, attention_mask, scaling)
        bias = mask_bias(attention_mask, b, q, s, dev)
        k, v = self.dequantize()
        k = k.repeat_interleave(hq // self.heads, 1).to(query.dtype)
        v = v.repeat_interleave(hq // self.heads, 1).to(query.dtype)
        mask = attention_mask[:, :, -q:, -s:] if attention_mask is not None else (bias == 0).unsqueeze(1)
        out = F.scaled_dot_product_attention(query, k, v, attn_mask=mask, scale=scaling).transpose(1, 2)
        o = min(q, _PREFILL_OBSERVED)
        logits = scaling * query[:, :, -o:].float() @ k.float().transpose(-1, -2) + bias[:, -o:].unsqueeze(1)
        self.mass += torch.nan_to_num(torch.softmax(logits, -1), nan=0.0).sum((1, 2))
        self.seen += torch.isfinite(bias[:, -o:]).sum(1).float() * hq
        return out

    def _note_first_valid(self, attention_mask: torch.Tensor | None, b: int, q: int, s: int, dev: torch.device) -> None:
        """``first_valid`` from the first attention call (0 for every row without a mask), then, for a
        row whose positions were all padding so far (left padding longer than a prompt's first
        chunk), from the first masked call that shows one of its positions. One host read per
        masked call while such a row is left, none after. A position counts as shown when any of
        the call's queries may attend it: on a sliding-window layer the last query's window starts
        later than the row's first unpadded position, which the query at that position sees."""
        if self.first_valid is None:
            self.first_valid = torch.zeros(b, dtype=torch.int64, device=dev)
            self._first_valid_known = torch.full((b,), attention_mask is None, dtype=torch.bool, device=dev)
            self._rows_pending = attention_mask is not None
        if attention_mask is None or not self._rows_pending:
            return
        shown = attended_positions(attention_mask, b, q, s, dev)
        found = shown.any(1) & ~self._first_valid_known
        self.first_valid = torch.where(found, shown.to(torch.int8).argmax(1).to(torch.int64), self.first_valid)
        self._first_valid_known |= found
        self._rows_pending = not bool(self._first_valid_known.all())

    def _decode(self, query: torch.Tensor, attention_mask: torch.Tensor | None, scaling: float) -> torch.Tensor:
        """Attention of up to :data:`DECODE_MAX_QUERIES` queries; every ``mass_interval``-th call records the mass."""
        b, hq, q, _ = query.shape
        record = self._decode_calls % self.mass_interval == 0
        self._decode_calls += 1
        out, mass = self._bucket_attention(query, attention_mask, scaling, need_mass=record)
        if record:
            self.mass += mass
            # one query and no mask (a plain decode step): every position is seen by every head
            plain = attention_mask is None and q == 1
            self.seen += hq if plain else visible_queries(attention_mask, b, q, self.seq_len, query.device) * hq
        return out

    def _bucket_attention(self, query: torch.Tensor, attention_mask: torch.Tensor | None, scaling: float,
                          need_mass: bool) -> tuple[torch.Tensor, torch.Tensor | None]:
        """:func:`~kbit_linear._kv_ops.decode_attention` over this layer's buckets."""
        buckets = self.buckets
        return decode_attention(query, [buckets[t] for t in TIERS], self.k_block_min, self.k_block_range, self.block_size,
                                self.seq_len, self.tier, attention_mask, scaling, need_mass=need_mass, workspace=self.workspace)


class ReplayableKVLayer(KbitKVLayer):
    """A :class:`KbitKVLayer` whose decode steps move no tensor between two allocator runs (what a
    CUDA graph replaying the steps needs), with the same results (bit for bit on the CPU; see below
    for a GPU).

    - The 8-bit tokens sit in a :class:`~kbit_linear.kv_format.KVStore8` (row ``b``'s entries
      from ``b * capacity``, a device count per row), appended in place.
    - ``tier``, ``mass`` and ``seen`` are views of the live columns of buffers ``[B, ld]``;
      ``ld`` covers the tokens until the next allocation, rounded up to a multiple of 16.
    - ``device_seq_len`` and ``device_decode_calls`` (int32 ``[1]``) are the cached length and
      the decode-size attention calls on the device: the append advances the length and the
      positions come from it; the call counter decides, on the device, which calls record the
      mass. ``seq_len`` and the call count on the host advance with them (a step adds a known
      number of tokens), so nothing is read back.

    An epoch runs from one store build to the next. An update builds the store when the
    allocator runs (the store's tokens go back into the 8-bit bucket, the allocator runs as in
    :class:`KbitKVLayer`, and a new store gets room for the updates of the same size until the
    next run: :meth:`steps_until_allocation`), or when its tokens do not fit (the first update,
    another token count, a prompt chunk, which gets room for itself only). A crop or a batch edit
    puts the tokens back into the bucket; the next update builds the store again. Leaving an
    epoch checks the device counters against the host's (one host read).

    ``buckets`` stays readable: while the store holds the 8-bit tokens it is a read-only
    snapshot whose 8-bit bucket is a compacted copy of the store. Causal decode attention (no
    mask) reads the store and the column buffers in place
    (:func:`~kbit_linear._kv_ops.decode_attention_in_place`: on CUDA the same launches every step
    of an epoch, with the mass added in place on recording calls only; elsewhere the reference,
    which reads the length on the host); the append is
    :func:`kbit_linear._kv_ops.append_tokens8_in_place` (a kernel on CUDA, the reference
    elsewhere). A masked call reads the snapshot and adds the mass with the reference
    (:func:`~kbit_linear.kv_format.accumulate_mass`). The CUDA in-place attention plans its splits
    for the epoch's longest length, so on a GPU its sums may be added in another order than
    :class:`KbitKVLayer`'s (rounding); on the CPU the two agree bit for bit.
    """

    _store: KVStore8 | None = None  # the open store (None between epochs)
    _room = 0  # free entries left in the open store's fullest row (host mirror of its counts)
    _planned_len = 0  # the cached length when the open store is full
    _captured = False  # a decode step is being captured (KbitKVCache.capturing): nothing changes on the host

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs) -> tuple[KbitKVView, KbitKVView]:
        """As :meth:`KbitKVLayer.update`; while a step is captured, only the in-place append (its
        host side waits for :meth:`advance`)."""
        if not self._captured:
            return super().update(key_states, value_states, *args, **kwargs)
        q = key_states.shape[2]
        if not self.is_initialized or self._store is None or self._room < q or self._allocation_due(q):
            raise RuntimeError(f"a captured step of {q} tokens must fit the open epoch: store open {self._store is not None}, "
                               f"room {self._room}, allocator due {self.is_initialized and self._allocation_due(q)}")
        append_tokens8_in_place(self._store, key_states, value_states, self.device_seq_len)
        view = KbitKVView(self)
        return view, view

    def advance(self, q: int, steps: int) -> None:
        """The host's side of ``steps`` captured updates of ``q`` tokens, each with one decode-size
        attention call, after their replays: the length, the store's room, the column views and
        the call count move as the steps' own updates would have moved them."""
        n = q * steps
        if n > self._room:
            raise RuntimeError(f"{steps} steps of {q} tokens do not fit the open store's room of {self._room}")
        self._room -= n
        self._add_columns(n)
        self.seq_len += n
        self._decode_calls += steps

    @property
    def buckets(self) -> Mapping[int, KVBucket]:
        """Width -> :class:`~kbit_linear.kv_format.KVBucket`; a read-only snapshot while the store is open."""
        if self._store is None:
            return self._buckets
        return MappingProxyType({**self._buckets, 8: self._store.bucket()})

    @buckets.setter
    def buckets(self, value: dict[int, KVBucket]) -> None:
        self._buckets = value

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        """As :class:`KbitKVLayer`'s, plus the device counters (no store until the first update)."""
        super().lazy_initialization(key_states, value_states)
        self._store = None
        self.device_seq_len = torch.zeros(1, dtype=torch.int32, device=self.device)
        self.device_decode_calls = torch.zeros(1, dtype=torch.int32, device=self.device)

    def reset(self) -> None:
        """Drop every token and the store."""
        super().reset()
        self._store = None

    def _store_tokens(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        """The new tokens into the store, in place (a new store first if they do not fit)."""
        q = key_states.shape[2]
        if self._store is None or self._room < q:
            self._open_store(q)
        append_tokens8_in_place(self._store, key_states, value_states, self.device_seq_len)
        self._room -= q

    def _open_store(self, q: int) -> None:
        """Start an epoch: the 8-bit tokens into a store with room for the updates of ``q`` tokens
        until the allocator's next run (a prompt chunk: for itself only, as the next chunk's
        length is unknown), and ``tier``/``mass``/``seen`` into buffers with columns for them."""
        self._close_store()
        room = q * (1 if self._is_prompt_chunk(q) else self.steps_until_allocation(q))
        self._store, self._room = KVStore8.from_bucket(self._buckets.pop(8), room), room
        self._planned_len = self.seq_len + room  # the longest this epoch gets: what the attention plans for
        columns = -(-(self.seq_len + room) // _COLUMN_ALIGN) * _COLUMN_ALIGN
        for name in _COLUMN_FILL:
            self._spare_columns(name, columns)

    def _close_store(self) -> None:
        """End an epoch: the store's tokens back into the 8-bit bucket, once the device counters
        agree with the host's (one host read)."""
        if self._store is None:
            return
        length, calls, overflow = torch.cat([self.device_seq_len, self.device_decode_calls, self._store.overflow]).tolist()  # one sync
        if (length, calls, overflow) != (self.seq_len, self._decode_calls, 0):
            raise RuntimeError(f"replayable KV layer: the device holds length {length}, {calls} decode calls and overflow "
                               f"{overflow}, the host expects {self.seq_len}, {self._decode_calls} and 0")
        self._buckets[8] = self._store.bucket()
        self._store = None

    def reallocate(self) -> None:
        """End the epoch, then run the allocator (:meth:`KbitKVLayer.reallocate`)."""
        self._close_store()
        super().reallocate()

    def crop(self, tokens_to_remove: int) -> None:
        """As :meth:`KbitKVLayer.crop`, after ending the epoch; the device length follows."""
        self._close_store()
        super().crop(tokens_to_remove)
        if self.is_initialized:
            self.device_seq_len.fill_(self.seq_len)

    def _remap_rows(self, src: torch.Tensor) -> None:
        """As :meth:`KbitKVLayer._remap_rows`, after ending the epoch."""
        self._close_store()
        super()._remap_rows(src)

    def _decode(self, query: torch.Tensor, attention_mask: torch.Tensor | None, scaling: float) -> torch.Tensor:
        """As :meth:`KbitKVLayer._decode`, deciding on the device whether to record the mass and
        accumulating it in place. Without a mask, while the store is open, one call reads the store
        and the column buffers in place (:func:`~kbit_linear._kv_ops.decode_attention_in_place`);
        otherwise the attention over the snapshot returns the mass and the reference adds it."""
        b, hq, q, _ = query.shape
        if self._captured and (attention_mask is not None or self._store is None):
            raise RuntimeError("a captured decode step must be causal without a mask, with the store open")
        self.device_decode_calls += 1
        self._decode_calls += 0 if self._captured else 1
        mass_buf, seen_buf = self._spare["mass"][0], self._spare["seen"][0]
        if attention_mask is None and self._store is not None:
            return decode_attention_in_place(query, [self._buckets[t] for t in TIERS if t != 8], self._store, self.k_block_min,
                                             self.k_block_range, self.block_size, self._planned_len, self.device_seq_len,
                                             self._spare["tier"][0], scaling, mass_buf, seen_buf, self.device_decode_calls,
                                             self.mass_interval, self.workspace)
        record = (self.device_decode_calls - 1) % self.mass_interval == 0
        out, mass = self._bucket_attention(query, attention_mask, scaling, need_mass=True)
        if attention_mask is None:
            seen = hq * causal_visible(self.device_seq_len, q, seen_buf.shape[1], self.device)
        else:
            seen = visible_queries(attention_mask, b, q, self.seq_len, self.device) * hq
        accumulate_mass(mass_buf, seen_buf, mass, seen, record)
        return out

    def _token_storage(self) -> list[KVBucket | KVStore8]:
        """The buckets, and the store with its whole capacity while it is open."""
        return list(self._buckets.values()) + ([self._store] if self._store is not None else [])


def _range_ignoring_nan(blocks: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-channel key range of ``blocks`` ``[B, nb, T, H, D]`` over T, NaN entries ignored (all-NaN: 0)."""
    lo = torch.where(torch.isnan(blocks), math.inf, blocks).amin(2)
    hi = torch.where(torch.isnan(blocks), -math.inf, blocks).amax(2)
    empty = torch.isinf(lo)
    lo, hi = torch.where(empty, 0.0, lo), torch.where(empty, 0.0, hi)
    return key_block_ranges(torch.stack([lo, hi], 2))


class KbitKVCache(Cache):
    """A transformers cache that keeps each token's K/V at 2, 3, 4 or 8 bits to meet an average width.

    Pass it as ``past_key_values=`` (``cache=`` from transformers 5.24, which renamed the argument;
    :func:`cache_keyword` names the one a model takes) to ``model.generate`` or ``model(...)``.
    Constructing it with a model's config switches that config's attention implementation to ``"kbit_kv"`` (registered by ``import kbit_linear``):
    attention over this cache then reads its buckets, and any other cache still runs through SDPA.

    Args:
        config: the model's config (its text config is used): full or sliding-window attention
            layers only, ``head_dim`` a multiple of 32, attention ``"sdpa"``, ``"eager"`` or
            ``"kbit_kv"``, no logit soft-capping.
        kv_bits: target average width over all cached tokens, in ``[2, 8]`` (``4``, ``3.5``,
            ``2.5``, ...). Payload bits only; scales add 0.3-0.5 bit per value (see
            :func:`kbit_linear.kv_format.bytes_per_token`). Short sequences stay above it: the
            window and sinks are at 8 bits.
        window: the most recent tokens kept at 8 bits (the window's start rounded down to a tile
            of :data:`~kbit_linear.kv_format.TILE_ENTRIES` positions in its key block, see
            :func:`movable_positions`).
        sink_tokens: the first tokens (after left padding) kept at 8 bits.
        block_size: positions per key block (one per-channel key range each); the allocator also
            runs every ``block_size`` tokens, or more rarely at long context (``allocation_fraction``).
        prefill_interval: while a prompt arrives in chunks of more than ``block_size`` tokens,
            the allocator runs every this many tokens instead (each run walks every cached token);
            at most about this many prompt tokens wait at 8 bits meanwhile. Default
            :data:`PREFILL_INTERVAL`.
        allocation_fraction: decode steps run the allocator once ``block_size`` tokens, or this
            fraction of the tokens cached at its last run if more, arrived since that run, in
            ``(0, 1]`` (1: whenever the cache doubles): the new tokens wait at 8 bits meanwhile,
            the price of fewer passes over the cache. Default :data:`ALLOCATION_FRACTION` (1/64:
            every 512 tokens at 32k).
        hysteresis: a token keeps its width while its importance is within this fraction of the
            width's cutoff, in ``[0, 1)``.
        mass_interval: decode steps record the attention mass (the importance signal) on every
            this many steps, an int >= 1 (1: every step). A step that skips it runs one kernel
            fewer and writes no logits, and importance stays the mean over the steps that
            recorded it. Every attention call of up to 16 queries counts as a step (short prompt
            chunks too). A token is first seen at most ``mass_interval - 1`` steps after it
            arrives, so keep ``window`` at least that long: a token that leaves the window unseen
            has importance 0. Default :data:`MASS_INTERVAL`.
        replayable: layers of :class:`ReplayableKVLayer` (same results; between two allocator
            runs a decode step moves no tensor) instead of :class:`KbitKVLayer`. Default False.
        allocate_by_tile: True: the allocator moves tokens in groups of a key block's 16 (the
            decode kernel's tiles; :func:`tile_importance`); False: one by one. Ranked token by
            token, the few tokens a budget puts one width lower land in most key blocks, and each
            such block costs the kernel a fifth, almost empty tile (10-26 % more tiles at 32k
            tokens, ``scripts/kv_tile_count.py``); in groups, a cache has as few tiles as at one
            width, and decode attention at ``kv_bits=4`` ran 1.02-1.14x faster (H200,
            ``bench/results/kv-attention-h200.md``). The groups are coarser: on SmolLM2 at
            ``kv_bits=4`` KL rose by 19 % at 2080 tokens, 3.0 % at 4032 and 3.6 % at 8032
            (``bench/results/kv-cache-accuracy.md``). Default None: by tile in rows of at least
            :data:`TILE_ALLOCATION_FROM` positions, token by token in shorter ones.

    Raises:
        TypeError: ``config`` is not a transformers ``PretrainedConfig`` (a model's ``.config`` is).
        ValueError: a bad argument or a model the cache cannot serve, naming which.
    """

    def __init__(self, config, kv_bits: float = 4, *, window: int = 64, sink_tokens: int = 4, block_size: int = 64,
                 hysteresis: float = 0.1, prefill_interval: int = PREFILL_INTERVAL,
                 allocation_fraction: float = ALLOCATION_FRACTION, mass_interval: int = MASS_INTERVAL,
                 replayable: bool = False, allocate_by_tile: bool | None = None) -> None:
        if not isinstance(config, PretrainedConfig):
            hint = " (pass model.config)" if isinstance(getattr(config, "config", None), PretrainedConfig) else ""
            raise TypeError(f"config must be a transformers PretrainedConfig{hint}, got {type(config).__name__}")
        if isinstance(kv_bits, bool) or not isinstance(kv_bits, numbers.Real) or not TIERS[0] <= float(kv_bits) <= TIERS[-1]:
            raise ValueError(f"kv_bits must be a number in [{TIERS[0]}, {TIERS[-1]}] (the target average width over the widths {TIERS}), got {kv_bits!r}")
        _check_positive_int("window", window, 0)
        _check_positive_int("sink_tokens", sink_tokens, 0)
        _check_positive_int("block_size", block_size, 1)
        _check_positive_int("prefill_interval", prefill_interval, 1)
        _check_positive_int("mass_interval", mass_interval, 1)
        if isinstance(hysteresis, bool) or not isinstance(hysteresis, numbers.Real) or not 0 <= hysteresis < 1:
            raise ValueError(f"hysteresis must be a number in [0, 1), got {hysteresis!r}")
        if (isinstance(allocation_fraction, bool) or not isinstance(allocation_fraction, numbers.Real)
                or not 0 < allocation_fraction <= 1):
            raise ValueError(f"allocation_fraction must be a number in (0, 1], got {allocation_fraction!r}")
        if not isinstance(replayable, bool):
            raise ValueError(f"replayable must be a bool, got {replayable!r}")
        if allocate_by_tile is not None and not isinstance(allocate_by_tile, bool):
            raise ValueError(f"allocate_by_tile must be a bool or None, got {allocate_by_tile!r}")
        text = config.get_text_config(decoder=True)
        layer_types, _ = get_layer_types_and_kwargs(text)
        bad = sorted(set(layer_types) - set(_SUPPORTED_LAYERS))
        if bad:
            raise ValueError(f"config: KbitKVCache serves attention layers of types {_SUPPORTED_LAYERS}, this model also has {bad}")
        head_dim = getattr(text, "head_dim", None) or text.hidden_size // text.num_attention_heads
        if head_dim % 32:
            raise ValueError(f"config.head_dim must be a multiple of 32 for KbitKVCache, got {head_dim}")
        for name in ("attn_logit_softcapping", "kv_lora_rank", "v_head_dim"):
            if getattr(text, name, None) is not None:
                raise ValueError(f"config.{name} is set: this model's attention (soft-capping or latent/split heads) cannot use KbitKVCache")
        impl = getattr(config, "_attn_implementation", None)
        if impl not in (None, "sdpa", "eager", ATTENTION_NAME):
            raise ValueError(f"config._attn_implementation is {impl!r}; KbitKVCache replaces 'sdpa' or 'eager' attention, not {impl!r}")
        if impl != ATTENTION_NAME:
            config._attn_implementation = ATTENTION_NAME
            logger.info("KbitKVCache: attention implementation %r -> %r", impl, ATTENTION_NAME)
        self.kv_bits = float(kv_bits)
        self.layer_types = tuple(layer_types)
        """The config's attention type of each layer (``"full_attention"`` or ``"sliding_attention"``)."""
        self.replayable = replayable
        """Whether the layers are :class:`ReplayableKVLayer` (decode steps that a CUDA graph can replay)."""
        layer_class = ReplayableKVLayer if replayable else KbitKVLayer
        layers = [layer_class(kv_bits, window, sink_tokens, block_size, float(hysteresis), prefill_interval,
                              float(allocation_fraction), mass_interval, allocate_by_tile) for _ in layer_types]
        super().__init__(layers=layers)

    @torch.compiler.disable
    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, layer_idx: int, *args,
               **kwargs) -> tuple[KbitKVView, KbitKVView]:
        """``Cache.update``, kept out of ``torch.compile``: a compiled decoder layer breaks its graph
        here, so that the layers' host state (lengths, stores, the allocator) runs eagerly. (The
        frame that calls it specialises the layer index it passes: one variant per layer.)"""
        if not 0 <= layer_idx < len(self.layers):
            raise ValueError(f"layer_idx {layer_idx}: this KbitKVCache has {len(self.layers)} layers, from the config it was "
                             "built with; build it from the model's own config (KbitKVCache(model.config))")
        return super().update(key_states, value_states, layer_idx, *args, **kwargs)

    @property
    def nbytes(self) -> int:
        """Bytes the cache holds: payloads, scales and metadata of every layer."""
        return sum(self.nbytes_by_kind().values())

    def nbytes_by_kind(self) -> dict[str, int]:
        """Bytes held, summed over layers, as ``payload``, ``scales`` and ``metadata``."""
        out = {"payload": 0, "scales": 0, "metadata": 0}
        for layer in self.layers:
            for kind, n in layer.nbytes_by_kind().items():
                out[kind] += n
        return out

    def replayable_steps(self, q: int) -> int:
        """Decode steps of ``q`` tokens that a CUDA graph captured now may replay before the host
        must run one (the allocator, or a new store): 0 when not replayable or no store is open.

        Raises:
            ValueError: ``q`` is not an int >= 1.
        """
        _check_positive_int("q", q, 1)
        if not self.replayable or not self.layers or any(layer._store is None for layer in self.layers):
            return 0
        return min(min(layer.steps_until_allocation(q), layer._room // q) for layer in self.layers)

    @contextlib.contextmanager
    def capturing(self) -> Iterator[None]:
        """While a decode step is captured into a CUDA graph: each layer records its append and
        attention and changes nothing on the host; :meth:`advance` moves the host's side after
        the replays. Only for ``replayable=True`` caches with a store open in every layer (after
        an eager decode step); at most :meth:`replayable_steps` replays between two
        :meth:`advance` calls and eager steps.

        Raises:
            RuntimeError: the cache is not replayable.
        """
        if not self.replayable:
            raise RuntimeError("capturing() needs KbitKVCache(..., replayable=True)")
        for layer in self.layers:
            layer._captured = True
        try:
            yield
        finally:
            for layer in self.layers:
                layer._captured = False

    def advance(self, q: int, steps: int) -> None:
        """The host's side of ``steps`` replayed decode steps of ``q`` tokens (see :meth:`capturing`).

        Raises:
            ValueError: ``q`` or ``steps`` is not an int >= 1.
            RuntimeError: the cache is not replayable, or the steps do not fit the open stores.
        """
        _check_positive_int("q", q, 1)
        _check_positive_int("steps", steps, 1)
        if not self.replayable:
            raise RuntimeError("advance() needs KbitKVCache(..., replayable=True)")
        for layer in self.layers:
            layer.advance(q, steps)

    def steps_until_allocation(self, q: int) -> int:
        """Decode steps of ``q`` tokens that run before the allocator does (it runs at the start of
        the step after them): :meth:`KbitKVLayer.steps_until_allocation`, the same in every layer.

        Raises:
            ValueError: ``q`` is not an int >= 1.
            RuntimeError: the layers disagree (they were not fed the same steps).
        """
        _check_positive_int("q", q, 1)
        steps = {layer.steps_until_allocation(q) for layer in self.layers}
        if len(steps) != 1:
            raise RuntimeError(f"the layers' allocators would run after different numbers of steps: {sorted(steps)}")
        return steps.pop()

    def tier_counts(self) -> dict[int, int]:
        """Tokens (times batch rows, summed over layers) stored at each width."""
        return {t: sum(layer.buckets[t].num_tokens for layer in self.layers if layer.is_initialized) for t in TIERS}

    def average_bits(self) -> float:
        """Mean payload width over every stored token (scales not counted)."""
        counts = self.tier_counts()
        total = sum(counts.values())
        return sum(t * n for t, n in counts.items()) / total if total else 0.0


def kbit_kv_attention(module: torch.nn.Module, query: torch.Tensor, key, value, attention_mask: torch.Tensor | None,
                      scaling: float | None = None, dropout: float = 0.0, **kwargs) -> tuple[torch.Tensor, None]:
    """transformers attention function ``"kbit_kv"``: bucket attention for a KbitKVCache, SDPA otherwise.

    Args:
        module: the attention module (for training mode and GQA in the SDPA fallback).
        query: ``[B, Hq, q, D]``.
        key, value: the :class:`KbitKVView` from ``KbitKVCache.update``, or tensors from any other cache.
        attention_mask: boolean or additive ``[B, 1, q, kv]``, or None (causal).
        scaling: logit scale (default ``D ** -0.5``).
        dropout: must be 0 with a KbitKVCache.

    Returns:
        ``(out [B, q, Hq, D], None)``.
    """
    if not isinstance(key, KbitKVView):
        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling, **kwargs)
    for name in ("softcap", "s_aux"):
        if kwargs.get(name) is not None:
            raise ValueError(f"this model's attention passes {name}=..., which KbitKVCache's attention does not implement")
    if dropout and module.training:
        raise ValueError("KbitKVCache attention has no dropout; call model.eval() (dropout > 0 in training mode)")
    if kwargs.get("output_attentions", False) and not _warned_no_weights:
        _warn_no_attention_weights()
    scale = scaling if scaling is not None else query.shape[-1] ** -0.5
    return _attend(key.layer, query, attention_mask, scale), None


_warned_no_weights = False


def _warn_no_attention_weights() -> None:
    """Warn once that ``output_attentions=True`` gets no weights from this attention (as
    transformers' SDPA attention warns): the fused kernel never forms the probability matrix."""
    global _warned_no_weights
    _warned_no_weights = True
    warnings.warn("output_attentions=True: KbitKVCache's attention computes no attention weights (the outputs' attentions "
                  "stay empty); generate with another cache to inspect them", UserWarning, stacklevel=3)


@torch.compiler.disable
def _attend(layer: KbitKVLayer, query: torch.Tensor, attention_mask: torch.Tensor | None, scale: float) -> torch.Tensor:
    # Kept out of torch.compile: the layer's host state (lengths, epochs, call counts) changes
    # from call to call, which a compiled graph would either bake in or guard on at every step.
    return layer.attend(query, attention_mask, scale)


def kbit_kv_mask(**kwargs: Any) -> torch.Tensor | None:
    """transformers' SDPA mask, except for one query while a CUDA graph is captured over rows
    without padding.

    Under stream capture some transformers versions count as tracing and build the mask even for
    one query (where ``q_offset`` is a tensor, as with ``cache_position``). The kbit attention needs
    no mask for plain causal decoding (it reads the live length on the device), and a replayed
    step cannot take a mask built for the captured length, so for one query and an unpadded,
    unmodified causal mask it returns None. Any padding, sliding window or changed mask function
    still builds the mask.
    """
    if (torch.cuda.is_available() and torch.cuda.is_current_stream_capturing() and kwargs.get("q_length") == 1
            and kwargs.get("attention_mask") is None
            and kwargs.get("mask_function", causal_mask_function) is causal_mask_function
            and kwargs.get("local_size") is None and kwargs.get("allow_is_causal_skip", True)):
        return None
    return sdpa_mask(**kwargs)


AttentionInterface.register(ATTENTION_NAME, kbit_kv_attention)
AttentionMaskInterface.register(ATTENTION_NAME, kbit_kv_mask)
