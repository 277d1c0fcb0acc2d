"""The fused decode-attention kernels over the mixed-precision KV cache (``kernels/kv_attention.cu``).

Registered as the CUDA implementation of :func:`kbit_linear._kv_ops.decode_attention`. Per call:
the attention over all buckets, split along the context (one launch), the merge of the splits
(one) and, when the mass is asked for, each position's attention mass (in the merge's launch
for short grids, else one more). Where each
bucket's entries of every key block start is counted by a fourth kernel only when the widths
changed: the caller's ``workspace`` keeps it between steps. Head sizes 64, 128 and 256 with
fp16, bf16 or fp32 queries take the kernels; anything else returns ``None`` (the reference runs).
"""

from __future__ import annotations

import math
from typing import NamedTuple

import torch

from ... import _kv_ops
from ...kv_format import TIERS, TILE_ENTRIES, KVBucket, KVStore8, mask_bias
from . import loader, tuning
from .tensors import DTYPE_CODES, aligned16

__all__ = ["HEAD_DIMS", "MAX_SPLIT_KEY_BLOCKS", "SplitPlan", "pairs_heads", "stage_bytes", "resident_blocks_per_sm", "kv_attention_instances", "decode_smem_bytes", "combine_smem_bytes", "kv_decode_attention_cuda",
           "kv_decode_attention_in_place_cuda"]

_SOURCE = "kv_attention.cu"
HEAD_DIMS = (64, 128, 256)
"""Head sizes the kernel has instances for."""
_DT = DTYPE_CODES
_ROWS = 8  # query rows per decode block (one n8 fragment)
_PAIR_HEADS = 2  # KV heads a PAIR decode block takes (block_heads(true)), each _ROWS // _PAIR_HEADS rows
_WARPS = 4  # warps per decode block
_STAGES = 2  # tiles in flight per warp (stages_for in the kernel)
_FRAG = 16  # tokens per tensor-core fragment
_MAX_TILE = TILE_ENTRIES  # bucket entries per tile at most (kMaxTile; tile_entries: at most 16 at 8 bits)
MAX_SPLIT_KEY_BLOCKS = 128
"""Key blocks one decode block takes at most (kMaxSplitBlocks): longer contexts get more splits."""
_OFFSET_THREADS = 1024
_COMBINE_THREADS = 128
_MASS_THREADS = 128
_LOG2E = 1.4426950408889634

_OFFSETS_ARGS = loader.ArgPack("kbit_kv_offsets", "tier:p rel:p S:i C:i bs:i ld:i")
_DECODE_ARGS = loader.ArgPack(
    "kbit_kv_decode",
    "q:p k2:p v2:p vs2:p vz2:p p2:p k3:p v3:p vs3:p vz3:p p3:p k4:p v4:p vs4:p vz4:p p4:p k8:p v8:p ks8:p vs8:p p8:p "
    "k_min:p k_range:p rel:p rs2:p rs3:p rs4:p rs8:p C:i bs:i bias:p logits:p part_acc:p part_ml:p H:i G:i Q:i S:i NB:i nblk:i "
    "kbps:i shift:i splits:i "
    "scale_log2:f live_len:p ld:i calls:p interval:i")
_COMBINE_ARGS = loader.ArgPack("kbit_kv_combine", "part_acc:p part_ml:p out:p ml:p Hq:i Q:i D:i splits:i R_count:i logits:p mass:p "
                               "rows:i S:i ld:i live_len:p seen:p heads:i calls:p interval:i mass_chunks:i")
_MASS_ARGS = loader.ArgPack("kbit_kv_mass", "logits:p ml:p mass:p rows:i S:i ld:i live_len:p seen:p heads:i Q:i calls:p interval:i")


def _round16(n: int) -> int:
    return (n + 15) // 16 * 16


def pairs_heads(kv_heads: int, rows: int) -> bool:
    """Whether a decode block takes two adjacent KV heads (the kernel's PAIR): where a head's
    ``rows`` query rows (query heads per KV head x queries) fit half of the block's 8 rows and
    the heads pair up. One tile's copy, walk and softmax then serve both heads."""
    return kv_heads % _PAIR_HEADS == 0 and rows <= _ROWS // _PAIR_HEADS


def stage_bytes(head_dim: int, pair: bool = False) -> int:
    """Bytes of one copy stage of the decode kernel (``Stage<D, PAIR>::BYTES``): the largest of
    the widths' tiles of key and value rows (their strides as in the kernel; a pair block's rows
    hold both heads below 8 bits, one at 8), value scales, zeros or 8-bit key scales, positions,
    and a key block's range and minimum (every head of the block)."""
    groups = head_dim // 64
    heads = _PAIR_HEADS if pair else 1

    def rows_end(bits: int) -> int:
        entries = _FRAG if bits == 8 else _MAX_TILE
        row = (1 if bits == 8 else heads) * head_dim * bits // 8
        krow = row + (16 if head_dim * bits // 32 >= 32 else 0)
        vrow = (row + 63) // 64 * 64 + 16
        return _round16(entries * krow) + entries * vrow

    kv = _round16(max(rows_end(bits) for bits in TIERS))
    return _round16(_round16(kv + 2 * _MAX_TILE * heads * groups * 2 + _MAX_TILE * 4) + 4 * heads * head_dim)


def decode_smem_bytes(head_dim: int, pair: bool = False) -> int:
    """Dynamic shared memory of one decode block (``Smem<D, PAIR>::BYTES`` in the kernel)."""
    ksteps = head_dim // 16
    ring_at = _ROWS * head_dim * 4 + ksteps * 32 * 8
    ring_at += _WARPS * _ROWS * 2 * 4 + (MAX_SPLIT_KEY_BLOCKS + 1) * 16
    return ring_at + max(_WARPS * _STAGES * stage_bytes(head_dim, pair), _WARPS * _ROWS * head_dim * 4)  # ring, then the warps' outputs


def combine_smem_bytes(splits: int, mass_rows: int = 0) -> int:
    """Dynamic shared memory of the combine kernel: one float per split, rounded up to 16 bytes
    (its loop over the splits may read the factors four at a time), or where it has mass blocks
    for ``mass_rows`` query rows per batch row and that is more, 8 bytes per row."""
    return max((splits + 3) // 4 * 16, 8 * mass_rows)


def _mass_in_combine(grid: int, sm_count: int) -> bool:
    """Whether the combine launch (``grid`` blocks, its mass blocks included) also takes the mass:
    where the grid fits one block per SM (short contexts at small batch), a launch of its own
    costs more than the mass; larger grids read the combine's M and L instead of forming them
    again in every block (:data:`tuning.KV_MASS_IN_COMBINE_MAX_BLOCKS_PER_SM`)."""
    return grid <= tuning.KV_MASS_IN_COMBINE_MAX_BLOCKS_PER_SM * sm_count


def kv_attention_instances() -> list[str]:
    """Every instance of ``kv_attention.cu`` the backend can launch (name expressions)."""
    names = ["kbit_kv_offsets", "kbit_kv_mass"]
    names += [f"kbit_kv_decode<{d}, {dt}, {split}, {pair}>" for d in HEAD_DIMS for dt in _DT.values() for split in ("false", "true")
              for pair in ("false", "true")]
    names += [f"kbit_kv_combine<{dt}>" for dt in _DT.values()]
    return names


def resident_blocks_per_sm(head_dim: int, shared_per_sm: int, pair: bool = False) -> int:
    """Decode blocks an SM holds at once: the kernel's __launch_bounds__ minimum (its registers
    are sized for it), or fewer where the SM's shared memory holds fewer (1 KiB of it reserved
    per block)."""
    by_registers = 4 if head_dim <= 128 else 1
    return max(1, min(by_registers, shared_per_sm // (decode_smem_bytes(head_dim, pair) + 1024)))


class SplitPlan(NamedTuple):
    """How the decode grid cuts a row's key blocks (``_splits``)."""

    key_blocks: int
    """Key blocks a split takes (the first split ``shift`` fewer)."""
    splits: int
    """Splits per row and KV head."""
    shared_tiles: bool
    """Whether the warps of a block share each key block's tiles (else each takes whole key blocks)."""
    shift: int = 0
    """How many key blocks short the first split is (0 <= shift < key_blocks)."""


def _first_split_shift(key_blocks: int, per_split: int, shared_tiles: bool, row_heads: int, wave: int) -> int:
    """How many key blocks short the first split is. Key block 0 holds the sinks: 8-bit tokens
    beside lower widths, one tile more than the other key blocks. Where each warp takes only a
    few tiles, that tile lengthens its block, the last one the grid waits for, by a large share;
    a first split short by the tiles of one warp's share (shared tiles: one key block; whole key
    blocks: one per warp) gives the warp with the sinks' tile no more tiles than the others. Only
    where the split it adds keeps the grid (``row_heads`` x splits blocks) in as many waves of
    ``wave`` blocks, and for splits of at most KV_DECODE_SHORT_FIRST_SPLIT_MAX_KEY_BLOCKS (longer
    ones gain nothing)."""
    if per_split > tuning.KV_DECODE_SHORT_FIRST_SPLIT_MAX_KEY_BLOCKS:
        return 0
    shift = 1 if shared_tiles else tuning.KV_DECODE_MIN_KEY_BLOCKS  # one warp's share
    if per_split < 2 * shift:
        return 0  # the first split would lose its only share
    splits = math.ceil(key_blocks / per_split)
    longer = math.ceil((key_blocks + shift) / per_split)
    return shift if math.ceil(row_heads * longer / wave) <= math.ceil(row_heads * splits / wave) else 0


def _splits(key_blocks: int, row_heads: int, resident: int, sm_count: int, sinks_tile: bool = True) -> SplitPlan:
    """The decode grid's plan: the grid (``row_heads`` x splits blocks) fills whole waves of
    resident blocks, so that no last wave runs mostly empty, with at most MAX_SPLIT_KEY_BLOCKS key
    blocks a split. Each warp takes whole key blocks, at least KV_DECODE_MIN_KEY_BLOCKS a split
    (one per warp), unless that leaves more than KV_DECODE_SPLIT_TILES_IDLE_SHARE of the SMs
    without a block (short contexts) and smaller splits are possible: then the warps of a block
    share each key block's tiles, with splits of as few key blocks as give
    KV_DECODE_SPLIT_TILES_BLOCKS_PER_SM blocks per SM (at most ``resident``). Only the
    whole-key-block plan fills whole waves. With ``sinks_tile`` (the cache holds tokens below 8
    bits, so key block 0's 8-bit sinks take a tile of their own) the first split is shorter where
    that fits (``_first_split_shift``)."""
    wave = resident * sm_count
    waves = max(1, math.ceil(row_heads * math.ceil(key_blocks / MAX_SPLIT_KEY_BLOCKS) / wave))
    want = max(1, waves * wave // max(1, row_heads))  # splits per row and head
    whole = min(MAX_SPLIT_KEY_BLOCKS, max(tuning.KV_DECODE_MIN_KEY_BLOCKS, math.ceil(key_blocks / want)))
    per_row = max(1, math.ceil(min(resident, tuning.KV_DECODE_SPLIT_TILES_BLOCKS_PER_SM) * sm_count / max(1, row_heads)))
    shared = min(MAX_SPLIT_KEY_BLOCKS, math.ceil(key_blocks / per_row))
    idle = row_heads * math.ceil(key_blocks / whole) < sm_count * (1 - tuning.KV_DECODE_SPLIT_TILES_IDLE_SHARE)
    shared_tiles = idle and shared < whole  # shared tiles only in smaller splits than whole key blocks'
    per_split = shared if shared_tiles else whole
    shift = _first_split_shift(key_blocks, per_split, shared_tiles, max(1, row_heads), wave) if sinks_tile else 0
    return SplitPlan(per_split, max(1, math.ceil((key_blocks + shift) / per_split)), shared_tiles, shift)


def _pair_pays(plan: SplitPlan) -> bool:
    """Whether blocks of two KV heads beat blocks of one under ``plan`` (the pair's): where warps
    take whole key blocks, KV_DECODE_PAIR_MIN_SPLIT_KEY_BLOCKS or more a split."""
    return not plan.shared_tiles and plan.key_blocks >= tuning.KV_DECODE_PAIR_MIN_SPLIT_KEY_BLOCKS


def _decode_grid(key_blocks: int, batch: int, kv_heads: int, rows: int, head_dim: int, device: torch.device,
                 low_widths: bool) -> tuple[bool, int, SplitPlan]:
    """The decode launch's shape: whether its blocks take two KV heads (PAIR), the grid's y (head
    pairs, or heads x chunks of 8 of a head's ``rows`` query rows) and the split plan. Heads pair
    where :func:`pairs_heads` allows, the pair's block fits the GPU's shared memory, the cache
    holds tokens below 8 bits (``low_widths``: a pair's 8-bit tiles take one head each, so a
    cache of 8-bit tokens only would gain nothing and lose the pair's extra work) and
    :func:`_pair_pays` under the pair's plan."""
    props = loader.device_properties(device)
    if low_widths and pairs_heads(kv_heads, rows) and _fits_shared_memory(head_dim, device, pair=True):
        plan = _splits(key_blocks, batch * kv_heads // _PAIR_HEADS, resident_blocks_per_sm(head_dim, props.shared_per_sm, True), props.sm_count,
                       sinks_tile=True)
        if _pair_pays(plan):
            return True, kv_heads // _PAIR_HEADS, plan
    block_rows = kv_heads * math.ceil(rows / _ROWS)
    return False, block_rows, _splits(key_blocks, batch * block_rows, resident_blocks_per_sm(head_dim, props.shared_per_sm),
                                      props.sm_count, sinks_tile=low_widths)


def _relative_offsets(tier: torch.Tensor, complete: int, block_size: int, kv_len: int, workspace: dict | None) -> torch.Tensor:
    """int32 ``[B, complete + 1, 4]``: per row and key block ``kb <= complete``, how many positions
    before ``kb * block_size`` each width holds (the kernel adds the buckets' row starts, and
    extends it past ``complete``, where every position is 8-bit). Kept in ``workspace`` (the
    cache layer empties it whenever widths change) so that decode steps do not recount.
    ``tier``: int8 ``[B, >= kv_len]`` with contiguous rows (a view of the first ``kv_len`` columns
    of a wider buffer is read in place)."""
    key = ("relative_offsets", complete, tier.shape[0])
    # Positions up to complete * block_size must all exist to be counted once for good: after a
    # crop they may not yet (the key blocks' ranges outlive it), and then each call recounts.
    if complete * block_size > kv_len:
        workspace = None
    if workspace is not None and key in workspace:
        return workspace[key]
    b = tier.shape[0]
    if tier.stride(-1) != 1 or tier.data_ptr() % 16:
        tier = aligned16(tier)
    rel = torch.empty((b, complete + 1, len(TIERS)), dtype=torch.int32, device=tier.device)
    kern = loader.get_kernel(_SOURCE, "kbit_kv_offsets", tier.device)
    loader.launch(kern, b, _OFFSET_THREADS, _OFFSETS_ARGS.Values(tier=tier, rel=rel, S=kv_len, C=complete, bs=block_size,
                                                                 ld=tier.stride(0) if b > 1 else kv_len),
                  0, tier.device, pack=_OFFSETS_ARGS)
    if workspace is not None:
        workspace[key] = rel
    return rel


def _fits_shared_memory(head_dim: int, device: torch.device, pair: bool = False) -> bool:
    """Whether a decode block of ``head_dim`` (``pair``: two KV heads) fits the GPU's shared
    memory per block (not head_dim 256 on GPUs with less than ~100 KiB a block)."""
    return decode_smem_bytes(head_dim, pair) <= loader.device_properties(device).max_shared_per_block


def _check_problem(query: torch.Tensor, buckets: list[KVBucket], tier: torch.Tensor, columns: int) -> bool:
    """Whether the kernels take ``query`` (a head size and dtype with instances, one bucket per
    width, a decode block that fits the GPU's shared memory); raises ValueError for buckets, heads
    or a tier (int8 ``[B, columns]``) that do not fit."""
    b, hq, _, d = query.shape
    if d not in HEAD_DIMS or query.dtype not in _DT or len(buckets) != len(TIERS):
        return False
    if [bk.bits for bk in buckets] != list(TIERS):
        raise ValueError(f"buckets must be one per width {TIERS}, in that order, got {[bk.bits for bk in buckets]}")
    h = buckets[0].k.shape[1]
    if hq % h:
        raise ValueError(f"query heads ({hq}) must be a multiple of the cache's KV heads ({h})")
    if tier.shape != (b, columns) or tier.dtype != torch.int8:
        raise ValueError(f"tier must be int8 [{b}, {columns}], got {tier.dtype} {tuple(tier.shape)}")
    return _fits_shared_memory(d, query.device)


def _attend(query: torch.Tensor, buckets: list[KVBucket], k_block_min: torch.Tensor | None, k_block_range: torch.Tensor | None,
            block_size: int, kv_len: int, tier: torch.Tensor, bias: torch.Tensor | None, scaling: float, mass: torch.Tensor | None,
            workspace: dict | None, in_place: dict | None, seen: torch.Tensor | None = None) -> torch.Tensor:
    """The decode, combine and (``mass`` given) mass launches of a problem :func:`_check_problem`
    took: the output.

    ``kv_len`` plans the grid (the splits) and sizes the logits. ``mass``: float ``[B, kv_len]``
    to write the mass into, or in place ``[B, ld]`` to add it to, with ``seen``. ``in_place``
    (None: the plain call): the live length, call counter and record interval on the device
    (``len``, ``calls``, ``interval``) and the logits' and bias' row stride ``ld`` >= ``kv_len``;
    ``buckets[-1]`` is then a store seen as rows of its capacity (:func:`_store_rows`).
    """
    b, hq, q_len, d = query.shape
    h = buckets[0].k.shape[1]
    dev = query.device
    g = hq // h
    nblk = math.ceil(kv_len / block_size)
    nb = 0 if k_block_min is None else k_block_min.shape[1]
    props = loader.device_properties(dev)
    pair, block_rows, (kbps, splits, split_tiles, shift) = _decode_grid(nblk, b, h, g * q_len, d, dev,
                                                                        low_widths=any(bk.num_tokens > 0 for bk in buckets[:-1]))
    ld = kv_len if in_place is None else in_place["ld"]

    rel = _relative_offsets(tier, nb, block_size, kv_len, workspace)
    rs = [aligned16(bk.row_start) for bk in buckets]
    logits = torch.empty((b, hq, q_len, ld), dtype=torch.float16, device=dev) if mass is not None else None  # log2 units
    part_acc = torch.empty((b * hq * q_len, splits, d), dtype=torch.float32, device=dev)
    part_ml = torch.empty((b * hq * q_len, splits, 2), dtype=torch.float32, device=dev)
    t = {bk.bits: bk for bk in buckets}

    def a(x):
        return None if x is None else aligned16(x)

    kmin = a(k_block_min) if nb else None
    krange = a(k_block_range) if nb else None
    kern = loader.get_kernel(_SOURCE, f"kbit_kv_decode<{d}, {_DT[query.dtype]}, {str(split_tiles).lower()}, {str(pair).lower()}>", dev)
    loader.launch(kern, (splits, block_rows, b), 32 * _WARPS, _DECODE_ARGS.Values(
        q=aligned16(query), k2=a(t[2].k), v2=a(t[2].v), vs2=a(t[2].v_scale), vz2=a(t[2].v_zero), p2=a(t[2].pos),
        k3=a(t[3].k), v3=a(t[3].v), vs3=a(t[3].v_scale), vz3=a(t[3].v_zero), p3=a(t[3].pos),
        k4=a(t[4].k), v4=a(t[4].v), vs4=a(t[4].v_scale), vz4=a(t[4].v_zero), p4=a(t[4].pos),
        k8=a(t[8].k), v8=a(t[8].v), ks8=a(t[8].k_scale), vs8=a(t[8].v_scale), p8=a(t[8].pos),
        k_min=kmin, k_range=krange, rel=rel, rs2=rs[0], rs3=rs[1], rs4=rs[2], rs8=rs[3], C=nb, bs=block_size, bias=bias, logits=logits, part_acc=part_acc, part_ml=part_ml,
        H=h, G=g, Q=q_len, S=kv_len, NB=nb, nblk=nblk, kbps=kbps, shift=shift, splits=splits, scale_log2=float(scaling) * _LOG2E,
        live_len=None if in_place is None else in_place["len"], ld=ld, calls=None if in_place is None else in_place["calls"],
        interval=1 if in_place is None else in_place["interval"]),
        decode_smem_bytes(d, pair), dev, pack=_DECODE_ARGS)

    out = torch.empty((b, q_len, hq, d), dtype=query.dtype, device=dev)
    ml = torch.empty((b * hq * q_len, 2), dtype=torch.float32, device=dev)
    kern = loader.get_kernel(_SOURCE, f"kbit_kv_combine<{_DT[query.dtype]}>", dev)
    # One short block per query row, and for a short grid the mass blocks too; they wait for the
    # decode kernel before any memory access, and the decode kernel lets them start once its
    # tiles are done.
    combine_rows = b * hq * q_len
    mass_chunks = math.ceil(ld / _COMBINE_THREADS) if mass is not None else 0  # a mass block's positions: one per thread
    if mass_chunks and not _mass_in_combine(combine_rows + b * mass_chunks, props.sm_count):
        mass_chunks = 0
    grid = combine_rows + b * mass_chunks
    live = None if in_place is None else in_place["len"]
    _COMBINE_ARGS.launch(kern, grid, combine_smem_bytes(splits, hq * q_len if mass_chunks else 0),
                         loader._current_raw_stream(kern.device_index),
                         _COMBINE_ARGS.Values(part_acc=part_acc.data_ptr(), part_ml=part_ml.data_ptr(), out=out.data_ptr(),
                                              ml=ml.data_ptr(), Hq=hq, Q=q_len, D=d, splits=splits, R_count=combine_rows,
                                              logits=_ptr(logits), mass=_ptr(mass), rows=hq * q_len, S=kv_len, ld=ld,
                                              live_len=_ptr(live), seen=_ptr(seen), heads=hq,
                                              calls=_ptr(None if in_place is None else in_place["calls"]),
                                              interval=1 if in_place is None else in_place["interval"], mass_chunks=mass_chunks),
                         threads=_COMBINE_THREADS, programmatic=loader.short_grid_may_overlap(grid, props.sm_count))
    if mass is not None and not mass_chunks:
        _launch_mass(logits, ml, mass, hq * q_len, kv_len, ld, in_place, seen, hq, q_len)
    return out


def _ptr(x: torch.Tensor | None) -> int:
    """A tensor's address for a fast launch (0 for None)."""
    return 0 if x is None else x.data_ptr()


def _launch_mass(logits: torch.Tensor, ml: torch.Tensor, mass: torch.Tensor, rows: int, kv_len: int, ld: int,
                 in_place: dict | None, seen: torch.Tensor | None, heads: int, q_len: int) -> None:
    """The mass kernel: into ``mass`` ``[B, kv_len]``, or (``in_place``) added into the running
    ``mass`` and ``seen`` ``[B, ld]`` on a recording call."""
    b = mass.shape[0]
    kern = loader.get_kernel(_SOURCE, "kbit_kv_mass", mass.device)
    loader.launch(kern, (math.ceil((kv_len if in_place is None else ld) / _MASS_THREADS), b), _MASS_THREADS,
                  _MASS_ARGS.Values(logits=logits, ml=ml, mass=mass, rows=rows, S=kv_len, ld=ld,
                                    live_len=None if in_place is None else in_place["len"], seen=seen, heads=heads, Q=q_len,
                                    calls=None if in_place is None else in_place["calls"],
                                    interval=1 if in_place is None else in_place["interval"]),
                  rows * 8, mass.device, pack=_MASS_ARGS)


def kv_decode_attention_cuda(query: torch.Tensor, buckets: list[KVBucket], k_block_min: torch.Tensor | None,
                             k_block_range: torch.Tensor | None, block_size: int, kv_len: int, tier: torch.Tensor,
                             attention_mask: torch.Tensor | None, scaling: float, need_mass: bool = True,
                             workspace: dict | None = None) -> tuple[torch.Tensor, torch.Tensor | None] | None:
    """The CUDA :func:`kbit_linear._kv_ops.decode_attention`; ``None`` for a problem it does not take.

    Lower widths must lie in the first ``k_block_min.shape[1]`` key blocks only (what the cache
    guarantees: later positions are 8-bit)."""
    if kv_len == 0 or not _check_problem(query, buckets, tier, kv_len):
        return None
    b, hq, q_len, _ = query.shape
    bias = None
    if attention_mask is not None:
        bias = aligned16(mask_bias(attention_mask, b, q_len, kv_len, query.device))
    mass = torch.empty((b, kv_len), dtype=torch.float32, device=query.device) if need_mass else None
    return _attend(query, buckets, k_block_min, k_block_range, block_size, kv_len, tier, bias, scaling, mass, workspace, None), mass


def _store_rows(store: KVStore8, workspace: dict | None) -> KVBucket:
    """``store`` as the decode kernel reads it: an 8-bit bucket whose row ``b`` starts at ``b *
    capacity``. Only for the kernel: the rows also span the free entries, which it never reads (its
    entry ranges come from the offsets and the live length, not from the row starts' gaps). The
    row starts are the same every step of an epoch; ``workspace`` keeps them."""
    b = store.count.numel()
    key = ("store_row_start", store.capacity, b)
    row_start = None if workspace is None else workspace.get(key)
    if row_start is None:
        row_start = torch.arange(b + 1, dtype=torch.int32, device=store.count.device) * store.capacity
        if workspace is not None:
            workspace[key] = row_start
    return KVBucket(8, row_start, store.pos, store.k, store.v, store.v_scale, store.k_scale)


def kv_decode_attention_in_place_cuda(query: torch.Tensor, buckets: list[KVBucket], store: KVStore8, k_block_min: torch.Tensor | None,
                                      k_block_range: torch.Tensor | None, block_size: int, planned_len: int, length: torch.Tensor,
                                      tier: torch.Tensor, scaling: float, mass: torch.Tensor, seen: torch.Tensor,
                                      calls: torch.Tensor, mass_interval: int, workspace: dict | None = None) -> torch.Tensor | None:
    """The CUDA :func:`kbit_linear._kv_ops.decode_attention_in_place`; ``None`` for a problem it
    does not take. Reads no device value on the host, allocates only the step's scratch, and
    launches the same kernels with the same arguments every step of an epoch (``planned_len``
    fixed): replayable in a CUDA graph. Its splits are planned for ``planned_len``, so its sums
    are added in another order than :func:`kv_decode_attention_cuda`'s at the live length."""
    ld = tier.shape[1]
    full = list(buckets) + [_store_rows(store, workspace)]
    if planned_len == 0 or not _check_problem(query, full, tier, ld):
        return None
    in_place = {"len": length, "calls": calls, "interval": mass_interval, "ld": ld}
    return _attend(query, full, k_block_min, k_block_range, block_size, planned_len, tier, None, scaling, mass, workspace, in_place,
                   seen)


_kv_ops.register_decode_attention("cuda", kv_decode_attention_cuda)
_kv_ops.register_decode_attention_in_place("cuda", kv_decode_attention_in_place_cuda)
