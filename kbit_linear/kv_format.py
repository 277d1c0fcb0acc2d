"""The mixed-precision KV-cache format and its reference decode attention (pure PyTorch, the spec).

Every cached token of one layer and batch row sits at one of four widths, ``TIERS = (2, 3, 4, 8)``
bits, in the bucket of that width. A bucket holds, for its ``n`` tokens (sorted by batch row,
then position), with ``H`` KV heads of ``D`` channels:

==============  ========================  ===============================================================
tensor          shape, dtype              meaning
==============  ========================  ===============================================================
``row_start``   ``[B + 1]`` int32         entries of batch row ``b`` are ``row_start[b]:row_start[b+1]``
``pos``         ``[n]`` int32             the token's position in its sequence
``k``, ``v``    ``[n, H, D*bits/8]`` u8   2/3/4 bits: codes packed 8 values to ``bits`` bytes, little
                (8 bits: ``[n, H, D]``    endian (value ``i`` of a group of 8 at bit ``bits*i`` of the
                int8)                     ``bits``-byte word); 8 bits: int8 codes
``k_scale``     ``[n, H, D/g]`` fp16      8 bits only: per-token symmetric scale of ``g`` channels
``v_scale``     ``[n, H, D/g]`` fp16      per-token scale of ``g`` channels (symmetric at 8 bits)
``v_zero``      ``[n, H, D/g]`` fp16      2/3/4 bits only: the group's minimum (asymmetric codes)
==============  ========================  ===============================================================

Keys below 8 bits are quantized per channel over blocks of ``block_size`` consecutive positions
(outlier channels in K make per-token groups 8-10 dB worse at the same width, measured on
SmolLM2; values are grouped per token): the layer holds ``k_block_min`` and ``k_block_range``,
fp16 ``[B, n_blocks, H, D]``, one range per (row, block, head, channel) shared by every width,
so moving a token to another width re-codes it against the same range. A key of width ``b`` at
position ``p`` decodes as ``min + code * range / (2**b - 1)`` with the range of block
``p // block_size``; a value as ``v_zero + code * v_scale``; 8-bit keys and values as
``code * scale``. ``g`` is :func:`channel_group` (64 channels, or 32 when ``D`` is not a
multiple of 64).

A replayable cache keeps its 8-bit tokens in a :class:`KVStore8` instead: room for a fixed
number of entries per row, filled in place, so that its tensors keep their addresses from one
decode step to the next (what a captured CUDA graph needs):

==============  ========================  ===============================================================
tensor          shape, dtype              meaning
==============  ========================  ===============================================================
``count``       ``[B]`` int32             entries of row ``b``: slots ``b * capacity`` on, by position
``overflow``    ``[1]`` int32             1 once an append did not fit (it then wrote nothing)
``pos`` etc.    ``[B * capacity, ...]``   the 8-bit bucket's fields (a slot past its row's count: no token)
==============  ========================  ===============================================================

Bytes per token and KV head at ``D = 128`` (keys and values together, scales included; bf16 is
512): 8 bits 264, 4 bits 144 (0.281x), 3 bits 112 (0.219x), 2 bits 80 (0.156x); see
:func:`bytes_per_token`.
"""

from __future__ import annotations

import math
import numbers
from dataclasses import dataclass, fields

import torch

__all__ = [
    "TILE_ENTRIES",
    "TIERS",
    "KVBucket",
    "KVStore8",
    "channel_group",
    "pack_codes",
    "unpack_codes",
    "quantize_tokens",
    "append_tokens8",
    "append_tokens8_in_place",
    "dequantize_bucket",
    "key_block_ranges",
    "bytes_per_token",
    "bucket_attention",
    "mask_bias",
    "attended_positions",
    "visible_queries",
    "causal_visible",
    "accumulate_mass",
]

TIERS: tuple[int, ...] = (2, 3, 4, 8)
"""The widths a token can be stored at, lowest first."""

TILE_ENTRIES = 16
"""Entries of one width and key block that the decode kernel takes at a time (one tile): a key
block's tokens at a width cost ``ceil(count / TILE_ENTRIES)`` tiles of equal cost. The cache's
``allocate_by_tile`` moves tokens in groups of this many (:func:`kbit_linear.kv_cache.tile_importance`)."""

_FP16_MAX = 65504.0
_INV_127 = 1 / 127  # 8-bit scales multiply by fp32(1/127): torch's CUDA division by a Python scalar does, its CPU one does not


def channel_group(head_dim: int) -> int:
    """Channels per per-token scale group: 64 when ``head_dim`` is a multiple of 64, else 32.

    Raises:
        ValueError: ``head_dim`` is not a positive multiple of 32.
    """
    if head_dim <= 0 or head_dim % 32:
        raise ValueError(f"head_dim must be a positive multiple of 32, got {head_dim}")
    return 64 if head_dim % 64 == 0 else 32


def _check_positive_int(name: str, value: object, low: int) -> int:
    """Return ``value`` as an int if it is an integer ``>= low`` (a Python or NumPy integer, not a
    bool), else raise a ValueError naming it."""
    if isinstance(value, bool) or not isinstance(value, numbers.Integral) or value < low:
        raise ValueError(f"{name} must be an int >= {low}, got {value!r}")
    return int(value)


def _check_bits(bits: int) -> None:
    """Raise a ValueError naming ``bits`` when it is not a tier."""
    if bits not in TIERS:
        raise ValueError(f"bits must be one of {TIERS}, got {bits!r}")


def pack_codes(codes: torch.Tensor, bits: int) -> torch.Tensor:
    """Pack unsigned codes along the last axis, 8 values into ``bits`` bytes, little endian.

    Args:
        codes: integer tensor ``[..., D]`` with values in ``[0, 2**bits)``, ``D`` a multiple of 8.
        bits: 2, 3 or 4.

    Returns:
        uint8 ``[..., D * bits / 8]``.

    Raises:
        TypeError: ``codes`` is not an integer tensor.
        ValueError: ``bits`` is not 2, 3 or 4, the last axis is not a multiple of 8, or a code is
            outside ``[0, 2**bits)`` (it would spill into its neighbours' bits).
    """
    if bits not in (2, 3, 4):
        raise ValueError(f"bits must be 2, 3 or 4 to pack, got {bits!r}")
    if not isinstance(codes, torch.Tensor) or codes.is_floating_point() or codes.is_complex() or codes.dtype == torch.bool:
        raise TypeError(f"codes must be an integer tensor, got {getattr(codes, 'dtype', type(codes).__name__)}")
    # (values are read on the host: not for meta tensors or while tracing, which have none to read)
    if codes.numel() and codes.device.type != "meta" and not torch.compiler.is_compiling():
        lo, hi = int(codes.min()), int(codes.max())
        if lo < 0 or hi >= 1 << bits:
            raise ValueError(f"codes must lie in [0, {1 << bits}) at {bits} bits, got values from {lo} to {hi}")
    return _pack_codes(codes, bits)


def _pack_codes(codes: torch.Tensor, bits: int) -> torch.Tensor:
    """:func:`pack_codes` of codes known to be in range (the quantizer's, clamped): no read on the host."""
    d = codes.shape[-1]
    if d % 8:
        raise ValueError(f"the last axis must be a multiple of 8, got {d}")
    c = codes.to(torch.int64).reshape(*codes.shape[:-1], d // 8, 8)
    shifts = torch.arange(8, device=codes.device, dtype=torch.int64) * bits
    word = (c << shifts).sum(-1, keepdim=True)  # 8*bits <= 32 bits: fits int64 exactly
    byte_shifts = torch.arange(bits, device=codes.device, dtype=torch.int64) * 8
    return ((word >> byte_shifts) & 0xFF).to(torch.uint8).reshape(*codes.shape[:-1], d * bits // 8)


def unpack_codes(packed: torch.Tensor, bits: int) -> torch.Tensor:
    """Inverse of :func:`pack_codes`: uint8 ``[..., D * bits / 8]`` -> int64 ``[..., D]``."""
    if bits not in (2, 3, 4):
        raise ValueError(f"bits must be 2, 3 or 4 to unpack, got {bits!r}")
    if not isinstance(packed, torch.Tensor) or packed.dtype != torch.uint8:
        raise TypeError(f"packed must be a uint8 tensor, got {getattr(packed, 'dtype', type(packed).__name__)}")
    nb = packed.shape[-1]
    if nb % bits:
        raise ValueError(f"the last axis ({nb} bytes) is not a multiple of bits = {bits}")
    p = packed.to(torch.int64).reshape(*packed.shape[:-1], nb // bits, bits)
    byte_shifts = torch.arange(bits, device=packed.device, dtype=torch.int64) * 8
    word = (p << byte_shifts).sum(-1, keepdim=True)
    shifts = torch.arange(8, device=packed.device, dtype=torch.int64) * bits
    codes = (word >> shifts) & ((1 << bits) - 1)
    return codes.reshape(*packed.shape[:-1], nb // bits * 8)


class _TensorFields:
    """What a dataclass of tensors (a bucket, a store) says about its fields."""

    def tensors(self) -> dict[str, torch.Tensor]:
        """Every tensor held, by field name."""
        return {f.name: getattr(self, f.name) for f in fields(self) if isinstance(getattr(self, f.name), torch.Tensor)}

    def nbytes(self) -> dict[str, int]:
        """Bytes held, split into ``payload`` (k, v), ``scales`` and ``metadata`` (row starts or
        counts, positions)."""
        out = {"payload": 0, "scales": 0, "metadata": 0}
        for name, t in self.tensors().items():
            kind = "payload" if name in ("k", "v") else "scales" if name in ("k_scale", "v_scale", "v_zero") else "metadata"
            out[kind] += t.numel() * t.element_size()
        return out


@dataclass
class KVBucket(_TensorFields):
    """The tokens of one layer stored at one width (layout in the module docstring)."""

    bits: int
    row_start: torch.Tensor
    pos: torch.Tensor
    k: torch.Tensor
    v: torch.Tensor
    v_scale: torch.Tensor
    k_scale: torch.Tensor | None = None
    v_zero: torch.Tensor | None = None

    @property
    def num_tokens(self) -> int:
        """Entries in the bucket (tokens times batch rows)."""
        return int(self.pos.shape[0])

    def rows(self) -> torch.Tensor:
        """int64 ``[n]``: the batch row of every entry (expanded from ``row_start``)."""
        counts = (self.row_start[1:] - self.row_start[:-1]).to(torch.int64)
        return torch.repeat_interleave(torch.arange(counts.numel(), device=counts.device), counts)

    @staticmethod
    def empty(bits: int, batch: int, heads: int, head_dim: int, device: torch.device | str = "cpu") -> "KVBucket":
        """A bucket with no tokens (``bits`` a width of :data:`TIERS`)."""
        _check_bits(bits)
        batch = _check_positive_int("batch", batch, 0)
        z = _quantize_parts(torch.zeros(0, heads, head_dim, device=device), torch.zeros(0, heads, head_dim, device=device),
                            bits, None, None)
        return KVBucket(bits, torch.zeros(batch + 1, dtype=torch.int32, device=device),
                        torch.zeros(0, dtype=torch.int32, device=device), **z)


_ENTRY8_DTYPES = {"k": torch.int8, "v": torch.int8, "k_scale": torch.float16, "v_scale": torch.float16,
                  "pos": torch.int32}  # an 8-bit entry's tensors (the tables above): a store's per-entry fields


@dataclass
class KVStore8(_TensorFields):
    """A layer's 8-bit tokens with room for ``capacity`` entries per batch row, appended in place
    (layout in the module docstring): row ``b``'s entries, sorted by position, start at
    ``b * capacity``; ``count`` says how many there are. ``nbytes()`` counts the whole capacity."""

    capacity: int
    count: torch.Tensor
    overflow: torch.Tensor
    pos: torch.Tensor
    k: torch.Tensor
    v: torch.Tensor
    k_scale: torch.Tensor
    v_scale: torch.Tensor

    @staticmethod
    def from_bucket(bucket: KVBucket, room: int) -> "KVStore8":
        """The 8-bit ``bucket``'s entries in a store whose fullest row has ``room`` free entries
        (reads the row counts on the host once)."""
        if bucket.bits != 8:
            raise ValueError(f"a store holds 8-bit tokens, got a {bucket.bits}-bit bucket")
        _check_positive_int("room", room, 0)
        count = (bucket.row_start[1:] - bucket.row_start[:-1]).to(torch.int32)
        b, dev = count.numel(), bucket.pos.device
        capacity = (int(count.max()) if b else 0) + room
        rows = bucket.rows()
        slot = rows * capacity + torch.arange(bucket.num_tokens, device=dev) - bucket.row_start[:-1].to(torch.int64)[rows]
        entries = {}
        for name in _ENTRY8_DTYPES:
            val = getattr(bucket, name)
            entries[name] = val.new_zeros((b * capacity, *val.shape[1:]))
            entries[name][slot] = val
        return KVStore8(capacity, count, torch.zeros(1, dtype=torch.int32, device=dev), **entries)

    def bucket(self) -> KVBucket:
        """The live entries as an 8-bit :class:`KVBucket` (a copy; finds them on the host)."""
        b, dev = self.count.numel(), self.count.device
        live = torch.arange(self.capacity, device=dev).unsqueeze(0) < self.count.unsqueeze(1)
        index = torch.nonzero(live.reshape(-1)).reshape(-1)
        row_start = torch.zeros(b + 1, dtype=torch.int32, device=dev)
        row_start[1:] = self.count.cumsum(0)
        return KVBucket(8, row_start, **{name: getattr(self, name)[index] for name in _ENTRY8_DTYPES})


def _fp16(x: torch.Tensor) -> torch.Tensor:
    """Round to fp16, clamped to its finite range (scales never overflow to inf)."""
    return x.clamp(-_FP16_MAX, _FP16_MAX).to(torch.float16)


def _sym8(x: torch.Tensor, g: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-group symmetric int8: x ``[n, H, D]`` fp32 -> (codes int8, scale fp16 ``[n, H, D/g]``)."""
    n, h, d = x.shape
    xg = x.reshape(n, h, d // g, g)
    scale = _fp16(xg.abs().amax(-1) * _INV_127)
    s = scale.float().unsqueeze(-1)
    codes = torch.where(s > 0, xg / s, 0.0)  # a zero scale (an all-zero group): codes 0, whatever 0 / 0 gave
    return codes.round().clamp(-127, 127).to(torch.int8).reshape(n, h, d), scale


def _asym(x: torch.Tensor, bits: int, g: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Per-group asymmetric codes: x ``[n, H, D]`` -> (codes int64, scale fp16, zero fp16 ``[n, H, D/g]``)."""
    n, h, d = x.shape
    xg = x.reshape(n, h, d // g, g)
    zero = _fp16(xg.amin(-1))
    scale = _fp16((xg.amax(-1) - zero.float()) / (2**bits - 1))
    s = scale.float().unsqueeze(-1)
    q = torch.where(s > 0, (xg - zero.float().unsqueeze(-1)) / torch.where(s > 0, s, torch.ones_like(s)), torch.zeros_like(xg))
    return q.round().clamp(0, 2**bits - 1).to(torch.int64).reshape(n, h, d), scale, zero


def _quantize_parts(k: torch.Tensor, v: torch.Tensor, bits: int, k_min: torch.Tensor | None,
                    k_range: torch.Tensor | None) -> dict[str, torch.Tensor | None]:
    """Payload and scales of tokens (k, v fp32 ``[n, H, D]``; k_min/k_range: per-entry block range)."""
    g = channel_group(k.shape[-1])
    if bits == 8:
        kc, ks = _sym8(k, g)
        vc, vs = _sym8(v, g)
        return {"k": kc, "v": vc, "k_scale": ks, "v_scale": vs, "v_zero": None}
    vq, vs, vz = _asym(v, bits, g)
    if k.shape[0] == 0:
        kq = torch.zeros(k.shape, dtype=torch.int64, device=k.device)
    else:
        step = k_range.float() / (2**bits - 1)
        kq = torch.where(step > 0, (k - k_min.float()) / torch.where(step > 0, step, torch.ones_like(step)), torch.zeros_like(k))
        kq = kq.round().clamp(0, 2**bits - 1).to(torch.int64)
    return {"k": _pack_codes(kq, bits), "v": _pack_codes(vq, bits), "k_scale": None, "v_scale": vs, "v_zero": vz}


def _append(a: KVBucket, b: KVBucket) -> KVBucket:
    """``a`` with ``b``'s entries after each row's own: ``b`` holds positions later than any of
    ``a``'s in the same row (new tokens). The same bucket as ``kv_cache._merge``'s sort, without it: one
    concatenation per field for a single row, else each entry's place from the row starts."""
    fa, fb = a.tensors(), b.tensors()
    row_start = a.row_start + b.row_start  # row r of the union starts after both parts' earlier rows
    if a.row_start.numel() == 2:
        fields = {name: torch.cat([val, fb[name]]) for name, val in fa.items() if name != "row_start"}
        return KVBucket(a.bits, row_start, **fields)
    na, nb = a.num_tokens, b.num_tokens
    counts_a = (a.row_start[1:] - a.row_start[:-1]).to(torch.int64)
    counts_b = (b.row_start[1:] - b.row_start[:-1]).to(torch.int64)
    dest_a = torch.arange(na, device=a.pos.device) + torch.repeat_interleave(b.row_start[:-1].to(torch.int64), counts_a, output_size=na)
    dest_b = torch.arange(nb, device=a.pos.device) + torch.repeat_interleave(a.row_start[1:].to(torch.int64), counts_b, output_size=nb)
    fields = {}
    for name, val in fa.items():
        if name == "row_start":
            continue
        out = val.new_empty((na + nb, *val.shape[1:]))
        out[dest_a] = val
        out[dest_b] = fb[name]
        fields[name] = out
    return KVBucket(a.bits, row_start, **fields)


def append_tokens8(bucket: KVBucket, k: torch.Tensor, v: torch.Tensor, pos0: int) -> KVBucket:
    """The 8-bit ``bucket`` with new tokens after each batch row's own entries (the reference).

    Args:
        bucket: an 8-bit :class:`KVBucket` of ``B`` rows whose positions are all ``< pos0``.
        k, v: float ``[B, H, q, D]`` (any strides), the keys and values of positions
            ``pos0 .. pos0 + q - 1`` of every row.
        pos0: the first new position.

    Returns:
        A new bucket: row ``r``'s old entries, then its ``q`` new ones quantized at 8 bits.
    """
    b, _, q, _ = k.shape
    pos = torch.arange(pos0, pos0 + q, device=k.device, dtype=torch.int32).repeat(b)
    row_start = torch.arange(0, (b + 1) * q, q, device=k.device, dtype=torch.int32)
    return _append(bucket, KVBucket(8, row_start, pos, **_step_parts8(k, v)))


def _step_parts8(k: torch.Tensor, v: torch.Tensor) -> dict[str, torch.Tensor | None]:
    """A step's keys and values ``[B, H, q, D]`` quantized at 8 bits, entries ordered by row, then position."""
    b, h, q, d = k.shape
    return _quantize_parts(k.permute(0, 2, 1, 3).reshape(b * q, h, d).float(), v.permute(0, 2, 1, 3).reshape(b * q, h, d).float(),
                           8, None, None)


def append_tokens8_in_place(store: KVStore8, k: torch.Tensor, v: torch.Tensor, length: torch.Tensor) -> None:
    """A step's new tokens into the 8-bit ``store``, in place, reading no device value on the host
    (the reference).

    Row ``r``'s token ``i`` goes to slot ``r * capacity + count[r] + i`` at position
    ``length + i``, quantized as :func:`append_tokens8` quantizes it (the same codes and
    scales); then ``count`` and ``length`` grow by ``q``. If any row lacks room
    (``count[r] + q > capacity``) nothing is written, neither counter moves and
    ``store.overflow`` becomes 1.

    Args:
        store: the store, ``B`` rows.
        k, v: float ``[B, H, q, D]`` (any strides), the new keys and values.
        length: int32 ``[1]`` on the store's device, the first new position (the cached length).
    """
    b, _, q, _ = k.shape
    if store.capacity == 0:  # no slot to aim even a discarded write at
        store.overflow.fill_(1)
        return
    dev = k.device
    new = {name: val for name, val in _step_parts8(k, v).items() if val is not None}
    new["pos"] = (length + torch.arange(q, device=dev, dtype=torch.int32)).repeat(b)
    over = (store.count + q > store.capacity).any()
    # an overflowing step aims at the rows' last slots and writes back what they hold
    slot = (store.count.to(torch.int64).unsqueeze(1) + torch.arange(q, device=dev)).clamp(max=store.capacity - 1)
    index = (torch.arange(b, device=dev).unsqueeze(1) * store.capacity + slot).reshape(-1)
    for name, val in new.items():
        dst = getattr(store, name)
        dst.index_copy_(0, index, torch.where(over, dst[index], val))
    step = torch.where(over, 0, q)
    store.count += step
    length += step
    store.overflow |= over


def key_block_ranges(k: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-channel range of one block of keys.

    Args:
        k: float ``[..., T, H, D]``, the block's tokens (those that will ever be coded with it).

    Returns:
        (min, range) fp16 ``[..., H, D]``; the stored min is rounded down and the range up in
        fp16, so every value of ``k`` lies inside ``[min, min + range]``.
    """
    lo = k.float().amin(-3)
    hi = k.float().amax(-3)
    mn = _fp16(lo)
    mn = torch.where(mn.float() > lo, torch.nextafter(mn, torch.full_like(mn, -math.inf)), mn)
    rng = _fp16(hi - mn.float())
    rng = torch.where(mn.float() + rng.float() < hi, torch.nextafter(rng, torch.full_like(rng, math.inf)), rng)
    return mn, rng


def quantize_tokens(k: torch.Tensor, v: torch.Tensor, bits: int, rows: torch.Tensor, pos: torch.Tensor, batch: int,
                    k_block_min: torch.Tensor | None = None, k_block_range: torch.Tensor | None = None,
                    block_size: int = 64) -> KVBucket:
    """Quantize tokens into a bucket of width ``bits``.

    Args:
        k, v: float ``[n, H, D]`` keys and values of ``n`` tokens.
        bits: a width of :data:`TIERS`.
        rows, pos: int ``[n]``, each token's batch row and position; entries come out sorted by
            (row, position).
        batch: batch rows of the cache (length of ``row_start`` minus one).
        k_block_min, k_block_range: fp16 ``[B, n_blocks, H, D]``, the key block ranges (needed
            below 8 bits; every token's block must have one).
        block_size: positions per key block.

    Returns:
        A :class:`KVBucket`.

    Raises:
        ValueError: ``bits`` is not a tier; ``k`` and ``v`` are not float ``[n, H, D]`` of one shape
            (``D`` a multiple of 32); ``rows`` or ``pos`` is not ``[n]``; ``batch`` is not a positive
            int; a row is outside ``[0, batch)`` or a position negative; the key ranges are missing below
            8 bits or do not cover a token's key block.
    """
    _check_bits(bits)
    batch = _check_positive_int("batch", batch, 1)
    block_size = _check_positive_int("block_size", block_size, 1)
    for name, t in (("k", k), ("v", v)):
        if not isinstance(t, torch.Tensor) or t.dim() != 3 or not t.is_floating_point():
            raise ValueError(f"{name} must be a float tensor [n, H, D], got {getattr(t, 'dtype', type(t).__name__)} "
                             f"{tuple(getattr(t, 'shape', ()))}")
    if v.shape != k.shape:
        raise ValueError(f"k and v must have one shape [n, H, D], got {tuple(k.shape)} and {tuple(v.shape)}")
    channel_group(k.shape[-1])  # D a positive multiple of 32
    for name, t in (("rows", rows), ("pos", pos)):
        if (not isinstance(t, torch.Tensor) or t.shape != (k.shape[0],) or t.is_floating_point() or t.is_complex()
                or t.dtype in (torch.bool, torch.uint64, torch.uint32, torch.uint16)):
            raise ValueError(f"{name} must be an integer tensor [n] with n = {k.shape[0]} (k's tokens), got "
                             f"{getattr(t, 'dtype', type(t).__name__)} {tuple(getattr(t, 'shape', ()))}")
    row_lo = row_hi = pos_lo = pos_hi = 0
    if k.shape[0]:
        row_lo, row_hi, pos_lo, pos_hi = torch.stack([rows.min(), rows.max(), pos.min(), pos.max()]).tolist()  # one host read
        if row_lo < 0 or row_hi >= batch:
            raise ValueError(f"rows must lie in [0, batch = {batch}), got values from {row_lo} to {row_hi}")
        if pos_lo < 0:
            raise ValueError(f"pos must be >= 0, got {pos_lo}")
    order = torch.argsort(rows.to(torch.int64) * (1 << 32) + pos.to(torch.int64), stable=True)
    k, v, rows, pos = k[order].float(), v[order].float(), rows[order].to(torch.int64), pos[order].to(torch.int64)
    k_min = k_rng = None
    if bits < 8:
        if k_block_min is None or k_block_range is None:
            raise ValueError(f"keys at {bits} bits need k_block_min and k_block_range")
        for name, t in (("k_block_min", k_block_min), ("k_block_range", k_block_range)):
            if t.dim() != 4 or t.shape[0] < batch or t.shape[2:] != k.shape[1:]:
                raise ValueError(f"{name} must be [batch = {batch} rows (or more), key blocks, H, D] = [{batch}, *, "
                                 f"{k.shape[1]}, {k.shape[2]}], got {tuple(t.shape)}")
        blk = pos // block_size
        if k.shape[0] and pos_hi // block_size >= k_block_min.shape[1]:
            raise ValueError("a token's key block has no range yet")
        k_min, k_rng = k_block_min[rows, blk], k_block_range[rows, blk]
    parts = _quantize_parts(k, v, bits, k_min, k_rng)
    counts = torch.bincount(rows, minlength=batch)
    row_start = torch.zeros(batch + 1, dtype=torch.int32, device=k.device)
    row_start[1:] = counts.cumsum(0).to(torch.int32)
    return KVBucket(bits, row_start, pos.to(torch.int32), **parts)


def dequantize_bucket(bucket: KVBucket, k_block_min: torch.Tensor | None = None,
                      k_block_range: torch.Tensor | None = None, block_size: int = 64) -> tuple[torch.Tensor, torch.Tensor]:
    """Decode a bucket: returns (k, v) float32 ``[n, H, D]`` in entry order.

    Raises:
        ValueError: a bucket below 8 bits with tokens but no key block ranges, or a bad ``block_size``.
    """
    block_size = _check_positive_int("block_size", block_size, 1)
    n, h = bucket.pos.shape[0], bucket.k.shape[1]
    if bucket.bits < 8 and n and (k_block_min is None or k_block_range is None):
        raise ValueError(f"a {bucket.bits}-bit bucket's keys decode with their key block ranges: pass k_block_min and k_block_range")
    d = bucket.k.shape[-1] if bucket.bits == 8 else bucket.k.shape[-1] * 8 // bucket.bits
    g = channel_group(d)
    if bucket.bits == 8:
        k = (bucket.k.float().reshape(n, h, d // g, g) * bucket.k_scale.float().unsqueeze(-1)).reshape(n, h, d)
        v = (bucket.v.float().reshape(n, h, d // g, g) * bucket.v_scale.float().unsqueeze(-1)).reshape(n, h, d)
        return k, v
    if n == 0:  # an empty lower-width bucket needs no key ranges (an all-8-bit cache has none)
        return torch.zeros(0, h, d, device=bucket.k.device), torch.zeros(0, h, d, device=bucket.k.device)
    levels = 2**bucket.bits - 1
    vq = unpack_codes(bucket.v, bucket.bits).float().reshape(n, h, d // g, g)
    v = (bucket.v_zero.float().unsqueeze(-1) + vq * bucket.v_scale.float().unsqueeze(-1)).reshape(n, h, d)
    rows, blk = bucket.rows(), bucket.pos.to(torch.int64) // block_size
    kq = unpack_codes(bucket.k, bucket.bits).float()
    k = k_block_min[rows, blk].float() + kq * (k_block_range[rows, blk].float() / levels)
    return k, v


def bytes_per_token(bits: int, head_dim: int, block_size: int = 64) -> float:
    """Bytes one token of one KV head costs at ``bits`` (keys + values, scales included, no metadata)."""
    _check_bits(bits)
    block_size = _check_positive_int("block_size", block_size, 1)
    groups = head_dim // channel_group(head_dim)
    payload = 2 * head_dim * bits / 8
    if bits == 8:
        return payload + 2 * groups * 2  # one fp16 scale per group, keys and values
    return payload + groups * 4 + head_dim * 4 / block_size  # value scale+zero; key min+range per block


def mask_bias(mask: torch.Tensor | None, batch: int, q_len: int, kv_len: int,
              device: torch.device | str | None = None) -> torch.Tensor:
    """The attention mask as an additive float32 bias ``[B, q_len, kv_len]``.

    ``mask`` is what transformers hands to attention: boolean ``[B, 1 or heads, q, kv]`` (True =
    attend), an additive float mask of that shape (entries at or below half its dtype's lowest
    value, as transformers' masked ones, count as -inf: masked), or ``None`` for causal attention with the
    queries at the end of the sequence (query ``i`` sees positions ``<= kv_len - q_len + i``),
    built on ``device`` (default: the mask's device, else the CPU). A mask with more than one head
    must be the same for every head.
    """
    if mask is None:
        qi = torch.arange(q_len, device=device).unsqueeze(1) + (kv_len - q_len)
        allowed = torch.arange(kv_len, device=device).unsqueeze(0) <= qi
        return torch.where(allowed, 0.0, -math.inf).expand(batch, q_len, kv_len)
    m = _mask_rows(mask, batch, q_len, kv_len)
    if device is not None:
        m = m.to(device)
    if m.dtype == torch.bool:
        m = torch.where(m, 0.0, -math.inf).to(torch.float32)
    else:
        m = torch.where(_masked(m), -math.inf, m.float())
    return m.expand(batch, q_len, kv_len)


def _mask_rows(mask: torch.Tensor, batch: int, q_len: int, kv_len: int) -> torch.Tensor:
    """The checked mask's last ``q_len`` query rows over the last ``kv_len`` positions, head 0:
    ``[B or 1, q_len, kv_len]``, in its own dtype."""
    if mask.dim() != 4 or mask.shape[0] not in (1, batch) or mask.shape[-2] < q_len or mask.shape[-1] < kv_len:
        raise ValueError(f"attention_mask of shape {tuple(mask.shape)} does not cover batch {batch}, {q_len} queries "
                         f"and {kv_len} cached positions ([batch or 1, heads, >= queries, >= positions])")
    if mask.dtype != torch.bool and not mask.is_floating_point():
        raise TypeError(f"attention_mask must be bool (True: attend) or a floating-point bias, got {mask.dtype}")
    return mask[:, 0, -q_len:, -kv_len:]


def _masked(bias: torch.Tensor) -> torch.Tensor:
    """The masked entries of a floating-point mask: its dtype's lowest value (transformers' masked
    entries) or near it."""
    return bias <= torch.finfo(bias.dtype).min / 2


def attended_positions(mask: torch.Tensor | None, batch: int, q_len: int, kv_len: int,
                       device: torch.device | str | None = None) -> torch.Tensor:
    """bool ``[B, kv_len]``: the positions that at least one of the ``q_len`` queries may attend
    (the mask as in :func:`mask_bias`; ``None``: every position), without a float32 copy of the
    mask."""
    if mask is None:
        return torch.ones(batch, kv_len, dtype=torch.bool, device=device)
    m = _mask_rows(mask, batch, q_len, kv_len)
    allowed = m if m.dtype == torch.bool else ~_masked(m)
    out = allowed.any(1).expand(batch, kv_len)
    return out.to(device) if device is not None else out


def visible_queries(mask: torch.Tensor | None, batch: int, q_len: int, kv_len: int,
                    device: torch.device | str | None = None) -> torch.Tensor:
    """float32 ``[B, kv_len]``: how many of the ``q_len`` queries may attend to each position
    (the mask as in :func:`mask_bias`), without building the bias for a causal mask."""
    if mask is None:
        return causal_visible(kv_len, q_len, kv_len, device).expand(batch, kv_len)
    return torch.isfinite(mask_bias(mask, batch, q_len, kv_len, device)).sum(1).float()


def causal_visible(length: torch.Tensor | int, q_len: int, columns: int, device: torch.device | str | None = None) -> torch.Tensor:
    """float32 ``[columns]``: how many of ``q_len`` causal queries, the last ones of ``length``
    positions, see each position; 0 from ``length`` on. ``length`` may be an int tensor ``[1]``
    on ``device`` (not read on the host)."""
    p = torch.arange(columns, device=device, dtype=torch.float32)
    late = (p - (length - q_len)).clamp(min=0)  # queries before the position's own cannot see it
    return (q_len - late).clamp(min=0)


def accumulate_mass(mass: torch.Tensor, seen: torch.Tensor, step_mass: torch.Tensor, step_seen: torch.Tensor,
                    record: torch.Tensor) -> None:
    """In place, a step's attention mass into the running sums, where the device flag ``record`` says so (the reference).

    ``mass[:, :n] += step_mass`` and ``seen[:, :m] += step_seen`` (the same float32 adds, so the
    same rounding, as adding into views of those columns), or no change when ``record`` is false.

    Args:
        mass, seen: float32 ``[B, ld]``, the layer's mass and seen columns.
        step_mass: float32 ``[B, n]``, ``n <= ld``: the step's mass per position.
        step_seen: float32 ``[m]`` or ``[B, m]``, ``m <= ld``: query heads that could see each position.
        record: bool, one element: whether the step records.
    """
    mass[:, :step_mass.shape[-1]] += torch.where(record, step_mass, 0.0)
    seen[:, :step_seen.shape[-1]] += torch.where(record, step_seen, 0.0)


def bucket_attention(query: torch.Tensor, buckets: list[KVBucket], k_block_min: torch.Tensor | None,
                     k_block_range: torch.Tensor | None, block_size: int, kv_len: int,
                     attention_mask: torch.Tensor | None, scaling: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Reference decode attention over the buckets: one pass per bucket with an online softmax.

    This is the computation the fused kernel must reproduce: for each batch row and each bucket
    (any order), logits ``s = scaling * q . k`` plus the mask bias, then the running max ``m``
    and sum ``l`` are updated (``m' = max(m, max s)``, ``l = l * exp(m - m') + sum exp(s - m')``,
    the output accumulator rescaled by ``exp(m - m')`` and ``exp(s - m') @ v`` added). Each KV
    head serves its ``Hq / H`` query heads (head ``j`` reads KV head ``j // (Hq / H)``). Rows whose
    every key is masked give zeros.

    Args:
        query: ``[B, Hq, q_len, D]`` (any float dtype; computed in float32).
        buckets: the layer's buckets.
        k_block_min, k_block_range, block_size: the layer's key block ranges.
        kv_len: the sequence length of the cache (positions are ``< kv_len``).
        attention_mask: see :func:`mask_bias`.
        scaling: the logit scale (usually ``D ** -0.5``).

    Returns:
        ``(out, mass)``: out ``[B, q_len, Hq, D]`` in the query's dtype (the layout transformers'
        attention functions return); mass float32 ``[B, kv_len]``, each position's attention
        probability summed over query heads and queries (the allocator's importance signal).
    """
    b_sz, hq, q_len, d = query.shape
    bias = mask_bias(attention_mask, b_sz, q_len, kv_len, query.device)
    out = torch.zeros(b_sz, hq, q_len, d, dtype=torch.float32, device=query.device)
    mass = torch.zeros(b_sz, kv_len, dtype=torch.float32, device=query.device)
    decoded = [dequantize_bucket(bk, k_block_min, k_block_range, block_size) for bk in buckets]
    for b in range(b_sz):
        m = torch.full((hq, q_len, 1), -math.inf, device=query.device)
        l = torch.zeros(hq, q_len, 1, device=query.device)
        acc = torch.zeros(hq, q_len, d, device=query.device)
        kept = []
        for bk, (k, v) in zip(buckets, decoded):
            lo, hi = int(bk.row_start[b]), int(bk.row_start[b + 1])
            if hi == lo:
                continue
            h = k.shape[1]
            pos = bk.pos[lo:hi].to(torch.int64)
            kb = k[lo:hi].permute(1, 0, 2).repeat_interleave(hq // h, 0)  # [Hq, n, D]
            vb = v[lo:hi].permute(1, 0, 2).repeat_interleave(hq // h, 0)
            s = scaling * (query[b].float() @ kb.transpose(1, 2)) + bias[b][:, pos].unsqueeze(0)  # [Hq, q, n]
            m_new = torch.maximum(m, s.amax(-1, keepdim=True))
            safe = torch.where(torch.isinf(m_new), torch.zeros_like(m_new), m_new)  # all masked so far
            alpha = torch.exp(m - safe)
            p = torch.exp(s - safe)
            l = l * alpha + p.sum(-1, keepdim=True)
            acc = acc * alpha + p @ vb
            m = m_new
            kept.append((pos, s))
        safe = torch.where(torch.isinf(m), torch.zeros_like(m), m)
        denom = torch.where(l > 0, l, torch.ones_like(l))
        out[b] = acc / denom
        for pos, s in kept:  # probabilities under the final max and sum
            mass[b, pos] = (torch.exp(s - safe) / denom).sum((0, 1))
    return out.transpose(1, 2).to(query.dtype), mass
