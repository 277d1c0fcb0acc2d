"""The CPU implementation of ``kbit_linear::gemm``: pure torch ops on torch's own thread pool.

Importing this module registers it for CPU tensors (``import kbit_linear`` does); it needs no
compiler. The reference (:func:`kbit_linear.format.matmul`) dequantizes the whole weight at every
call; this path never forms the dense weight and gives the same product within float32 rounding
(not bit for bit: its sums run in another order).

A call (``x`` flattened to ``[M, K]``, computed in float32):

1. **Keys.** The bit-planes of a range of k-tiles become one-byte *keys*, each holding the
   codebook indices of ``G`` weights of one output row (:data:`SCHEMES`: 4 weights at 2 bits, 2
   at 3 and 4 bits, 1 at 5 bits), through broadcast shift / mask / sum ops on the int32 plane
   words. Keys are laid out ``[k_tiles, 2, S, 4, N]``, output rows innermost, so the lookups
   below walk one small table for ``N`` consecutive rows.
2. **Products.** ``M <= LUT_MAX_M`` (token-by-token decoding): for each row of ``x``, broadcast
   multiplies and adds (one per key slot) build the table ``T[key position, key]`` = the key's
   codebook values dotted with their weights' ``x`` values; one ``torch.gather`` (int64
   indices: with int32 ones it runs slower) looks every key up for all rows, and the sum over a
   block's keys, times the block scale, summed over the blocks, is ``y``. No weight value is
   formed. The tables depend on ``x`` only: calls that repeat the previous call's ``x`` (the
   q/k/v and gate/up projections of a transformer block) reuse them. Larger ``M``: each key slot's
   dequantized values (codebook value times block scale: exactly the reference's weights) are
   gathered into a ``[K/G, N]`` float32 slab and multiplied with ``torch.mm``.
3. **Chunks.** Both products walk the weight in ranges of k-tiles of at most :data:`CHUNK_KEYS`
   keys, so the temporaries (int64 gather indices, gathered values) stay within about 6 MB per
   thread whatever the layer size; they are reused from call to call.
4. **Key cache.** Step 1 costs as much as step 2, so by default a layer's keys are kept after
   its first call: uint8, ``1/G`` byte per weight (the size of the stored bit-planes at 2 and 4
   bits, 4/3 of it at 3 bits, 8/5 at 5 bits), plus its decoded block scales (float32, 4 bytes per
   32 weights): 0.625 bytes per weight at 4 bits, about 1.2x the stored tensors. The cache lives
   beside the tensors, never in them (the stored format and the state dict are unchanged); it is
   keyed on the ``packed`` tensor object, dropped when that tensor is freed, and rebuilt when
   ``packed``, ``absmax`` or ``tensor_scale`` change in place. A write through ``.data``
   (``layer.weight.data.copy_(...)``) bypasses the tensor's version counter and goes unseen:
   write with ``copy_`` under ``torch.no_grad()`` or ``load_state_dict``, or call
   :func:`clear_cache` after it. Inference tensors (no version counter) are never cached. :func:`set_cache_enabled` or the environment variable
   ``KBIT_LINEAR_CPU_CACHE=0`` turn it off: keys are then rebuilt at every call (about half the
   speed) and nothing is kept.

The bias is added in float32 and the result cast to ``x``'s dtype, as in the reference.

Per-call overhead counts at decode sizes (a SmolLM2-135M token makes 210 calls), so eager calls
skip the dispatcher (:func:`kbit_linear._ops.gemm` calls :func:`gemm_cpu` directly; traced,
compiled, autograd-recording and mode-watched calls still go through the op), and the weight's
metadata checks run once per cache entry; ``x``'s and the bias's run at every call.
Measurements: ``scripts/bench_cpu.py``, ``bench/results/cpu.md``.
"""

from __future__ import annotations

import math
import os
import threading
import weakref
from dataclasses import dataclass
from typing import NamedTuple

import torch

from .. import _ops
from .. import format as fmt

__all__ = [
    "SCHEMES",
    "LUT_MAX_M",
    "CHUNK_KEYS",
    "KeyScheme",
    "gemm_cpu",
    "set_cache_enabled",
    "cache_enabled",
    "clear_cache",
    "cache_nbytes",
]


# ---------------------------------------------------------------------------------------
# key schemes
# ---------------------------------------------------------------------------------------


@dataclass(frozen=True)
class KeyScheme:
    """How the bit-planes of one width become one-byte keys.

    Shifting a plane word right by ``r`` (``0 <= r < spacing``) and masking with ``mask``
    keeps bit ``r + spacing * m`` of the word at bit ``spacing * m``; shifted left by the
    plane number ``b`` and summed over the planes, byte ``l`` of the result holds the indices
    of the weights ``r + spacing * (l * group + g)``, ``g < group``, at bits
    ``spacing * g .. spacing * g + bits - 1``.

    Attributes:
        bits: index width.
        spacing: ``S``, the distance between the weights of one key (and the number of shifts).
        mask: the bits kept after each shift.
        group: ``G``, weights per key.
    """

    bits: int
    spacing: int
    mask: int
    group: int

    @property
    def keys_per_block(self) -> int:
        """Keys per 32-weight block: ``spacing`` shifts times 4 bytes per word."""
        return self.spacing * 4

    @property
    def nkeys(self) -> int:
        """Size of the key space (the largest key is below it)."""
        return 1 << (self.spacing * (self.group - 1) + self.bits)


SCHEMES: dict[int, KeyScheme] = {
    2: KeyScheme(2, spacing=2, mask=0x55555555, group=4),
    3: KeyScheme(3, spacing=4, mask=0x11111111, group=2),
    4: KeyScheme(4, spacing=4, mask=0x11111111, group=2),
    5: KeyScheme(5, spacing=8, mask=0x01010101, group=1),
}
"""The key scheme of each width: the widest group whose key fits one byte."""

LUT_MAX_M = 2
"""Rows of ``x`` up to which the table lookup runs (its cost grows with every row); above, the
dequantized slabs and ``torch.mm``. The crossover measured on a 2-core AMD EPYC lies at 2-4 rows."""

CHUNK_KEYS = 1 << 19
"""Keys per chunk: bounds the temporaries (int64 gather indices and float32 gathered values,
12 bytes per key) to about 6 MB. A chunk is at least one whole k-tile (``64 / G`` keys per output
row), so layers wider than ``CHUNK_KEYS * G / 64`` rows (16384 at 4 bits) take more."""


class _Consts(NamedTuple):
    shifts: torch.Tensor  # int32 [1, S, 1]: the shifts r
    plane_shifts: torch.Tensor  # int32 [bits, 1, 1]: each plane's shift b


_CONSTS = {bits: _Consts(torch.arange(s.spacing, dtype=torch.int32).view(1, -1, 1),
                         torch.arange(bits, dtype=torch.int32).view(-1, 1, 1)) for bits, s in SCHEMES.items()}

class _CodebookTables(NamedTuple):
    """A codebook's values arranged for the keys of one width (flat: nothing kept between calls
    has the 2-D shape of a weight)."""

    keys: torch.Tensor  # float32 [G * nkeys]: keys[g * nkeys + key] = the codebook value of key slot g
    slots: tuple[torch.Tensor, ...]  # per slot g, float32 [1, 2**S] ([2**bits, 1] for the top one): value by slot bits


_CODEBOOK_TABLES: dict[tuple[int, bytes], _CodebookTables] = {}
_CODEBOOK_TABLES_MAX = 64  # a model has one codebook per width unless users bring their own


def _codebook_table(codebook: torch.Tensor, bits: int) -> _CodebookTables:
    """The :class:`_CodebookTables` of ``codebook`` for ``bits``-bit keys (made once per codebook)."""
    key = (bits, codebook.detach().numpy().tobytes())
    table = _CODEBOOK_TABLES.get(key)
    if table is None:
        s = SCHEMES[bits]
        mask = (1 << bits) - 1
        keys = torch.arange(s.nkeys)
        by_key = torch.cat([codebook[(keys >> (s.spacing * g)) & mask] for g in range(s.group)])
        # a slot's bits above the index width (3-bit indices in 4-bit slots) are always zero
        slots = tuple(codebook[torch.arange(1 << s.spacing) & mask].view(1, -1) for g in range(s.group - 1))
        slots += (codebook.view(-1, 1),)
        table = _CodebookTables(by_key, slots)
        if len(_CODEBOOK_TABLES) >= _CODEBOOK_TABLES_MAX:
            _CODEBOOK_TABLES.clear()
        _CODEBOOK_TABLES[key] = table
    return table


_E4M4 = fmt.e4m4_table()


# ---------------------------------------------------------------------------------------
# scratch buffers: the large temporaries are reused from call to call, not allocated (and
# page-faulted in) at every call
# ---------------------------------------------------------------------------------------


class _Scratch(threading.local):
    """This thread's reusable buffers (one per name, grown as needed) and the views of them
    handed out so far (rebuilt when their buffer grows)."""

    def __init__(self) -> None:
        self.bufs: dict[str, torch.Tensor] = {}
        self.views: dict[tuple, tuple[torch.Tensor, torch.Tensor]] = {}


_SCRATCH = _Scratch()


def _scratch(name: str, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """A ``shape`` view of this thread's buffer ``name``: contents undefined, valid until the
    next request for the same name."""
    sc = _SCRATCH
    key = (name, shape, dtype)
    hit = sc.views.get(key)
    buf = sc.bufs.get(name)
    if hit is not None and hit[0] is buf:
        return hit[1]
    numel = 1
    for d in shape:
        numel *= d
    # Normal tensors even when first asked for under inference_mode: a buffer made there could
    # not be written by a later call outside it (e.g. evaluation, then calibration).
    with torch.inference_mode(False):
        if buf is None or buf.dtype != dtype or buf.numel() < numel:
            # the old buffer goes, with every view of it
            sc.views = {k: v for k, v in sc.views.items() if k[0] != name}
            buf = sc.bufs[name] = torch.empty(numel, dtype=dtype)
        view = buf[:numel].view(shape)
    sc.views[key] = (buf, view)
    return view


# ---------------------------------------------------------------------------------------
# keys and scales
# ---------------------------------------------------------------------------------------


def _keys(packed: torch.Tensor, bits: int, k0: int, k1: int, out: torch.Tensor, scratch: bool = True) -> torch.Tensor:
    """Keys of k-tiles ``k0:k1`` written into ``out`` (uint8 or int64 ``[kc, 2, S, 4, n]``,
    ``n <= N_pad``: rows past ``n`` are padding and are dropped). ``scratch``: build in this
    thread's reusable buffers (per-call keys) rather than in temporaries (a one-off cache fill)."""
    s, c = SCHEMES[bits], _CONSTS[bits]
    kc, nt = k1 - k0, packed.shape[1]
    n_pad = nt * fmt.TILE_N
    rows = kc * 2 * n_pad  # blocks, ordered (k-tile, block of the tile, output row)
    buf = _scratch if scratch else (lambda name, shape, dtype: torch.empty(shape, dtype=dtype))
    # plane-major copy: every op below then broadcasts over outer dims only (long inner loops)
    planes = buf("planes", (bits, kc, 2, nt, fmt.TILE_N), torch.int32)
    torch.stack(packed[k0:k1].permute(0, 3, 1, 2, 4).unbind(-1), out=planes)
    t = buf("shifted", (bits, s.spacing, rows), torch.int32)
    torch.bitwise_right_shift(planes.view(bits, 1, rows), c.shifts, out=t)
    t &= s.mask
    t <<= c.plane_shifts
    # the planes' bits are disjoint: their sum is the key words
    words = torch.sum(t, 0, dtype=torch.int32, out=buf("words", (s.spacing, rows), torch.int32))
    # byte l of word (r, block) -> [k-tile, block of the tile, r, l, row]
    by = words.view(torch.uint8).view(s.spacing, kc, 2, n_pad, 4).permute(1, 2, 0, 4, 3)
    return out.copy_(by[..., : out.shape[-1]])


def _scales(absmax: torch.Tensor, tensor_scale: torch.Tensor, n: int) -> torch.Tensor:
    """float32 ``[k_tiles, 2, n]`` block scales (E4M4 value times the tensor scale) of rows ``:n``."""
    kt, nt = absmax.shape[:2]
    codes = absmax.permute(0, 3, 1, 2).reshape(kt, 2, nt * fmt.TILE_N)[..., :n].reshape(-1).to(torch.int32)
    return (_E4M4.index_select(0, codes) * tensor_scale).view(kt, 2, n)


# ---------------------------------------------------------------------------------------
# one layer's keys and scales, cached or rebuilt per call
# ---------------------------------------------------------------------------------------


class _Layer:
    """What the products need from one weight: its keys (or the planes to build them from),
    block scales, and its k-tile chunks with their views of both."""

    __slots__ = ("refs", "stamp", "packed", "bits", "scheme", "n", "kt", "k_pad", "chunks", "keys", "scales", "parts",
                 "cb")

    def __init__(self, packed: torch.Tensor, absmax: torch.Tensor, codebook: torch.Tensor, tensor_scale: torch.Tensor,
                 bits: int, n: int, cache: bool, stamp: tuple | None = None) -> None:
        # the weight's checks run here, once per entry (a cached entry is reused only for the
        # same tensors, unchanged); the inputs' run at every call
        self.k_pad = _ops.check_gemm_weight_args(packed, absmax, codebook, tensor_scale, bits, n)
        self.bits, self.scheme, self.n, self.kt = bits, SCHEMES[bits], n, packed.shape[0]
        self.chunks = _chunks(self.kt, n, self.scheme)
        self.scales = _scales(absmax, tensor_scale, n)
        self.stamp = stamp
        if cache:
            # keep the keys, never the planes: the entry must not keep the layer's tensors alive
            self.refs, self.packed = (weakref.ref(packed), weakref.ref(absmax), weakref.ref(tensor_scale)), None
            self.keys = torch.empty((self.kt, 2, self.scheme.spacing, 4, n), dtype=torch.uint8)
            for k0, k1 in self.chunks:
                _keys(packed, bits, k0, k1, self.keys[k0:k1], scratch=False)
        else:
            self.refs, self.packed, self.keys = None, packed, None
        # per chunk: (k0, k1, its cached keys or None, its scales)
        self.parts = [(k0, k1, None if self.keys is None else self.keys[k0:k1], self.scales[k0:k1]) for k0, k1 in self.chunks]
        self.cb: tuple = (None, None, None)  # (weakref to the codebook, its stamp, its table)

    def codebook_table(self, codebook: torch.Tensor, tensor_scale: torch.Tensor) -> _CodebookTables:
        """:func:`_codebook_table` of ``codebook``, remembered (and checked) while the same tensor
        is passed unchanged (a layer's codebook is a buffer: the same tensor at every call)."""
        ref, stamp, table = self.cb
        try:
            now = (codebook.data_ptr(), codebook._version)
        except RuntimeError:  # an inference tensor: no version counter (the entry's checks covered it)
            return _codebook_table(codebook, self.bits)
        if ref is not None and ref() is codebook and stamp == now:
            return table
        _ops.check_codebook_args(codebook, tensor_scale, self.bits, self.scales.device)
        table = _codebook_table(codebook, self.bits)
        self.cb = (weakref.ref(codebook), now, table)
        return table

    def chunk_keys(self, k0: int, k1: int, cached: torch.Tensor | None) -> torch.Tensor:
        """int64 keys ``[1, kc, 2, S, 4, n]`` of k-tiles ``k0:k1``, in this thread's scratch
        (the leading 1 broadcasts over the rows of ``x``)."""
        s = self.scheme
        idx = _scratch("idx", (1, k1 - k0, 2, s.spacing, 4, self.n), torch.int64)
        if cached is None:
            _keys(self.packed, self.bits, k0, k1, idx[0])
            return idx
        return idx.copy_(cached)

    def holds(self, packed: torch.Tensor, absmax: torch.Tensor, tensor_scale: torch.Tensor) -> bool:
        """Whether this cached entry was built from these very tensors (a freed tensor's address
        and version count may come back with a new one)."""
        p, a, t = self.refs
        return p() is packed and a() is absmax and t() is tensor_scale

    def nbytes(self) -> int:
        """Bytes this entry holds (keys and scales)."""
        return (0 if self.keys is None else self.keys.nbytes) + self.scales.nbytes


_cache_on = os.environ.get("KBIT_LINEAR_CPU_CACHE", "1").strip().lower() not in ("0", "false", "no", "off")
_CACHE: dict[int, _Layer] = {}
_CACHE_LOCK = threading.RLock()  # re-entrant: a finalizer may run while it is held


def set_cache_enabled(enabled: bool) -> None:
    """Turn the per-layer key cache on (the default) or off; turning it off also clears it.

    Raises:
        TypeError: ``enabled`` is not a bool (``"off"`` or ``"0"`` would read as on).
    """
    global _cache_on
    if not isinstance(enabled, bool):
        raise TypeError(f"enabled must be a bool, got {enabled!r}")
    _cache_on = enabled
    if not _cache_on:
        clear_cache()


def cache_enabled() -> bool:
    """Whether the per-layer key cache is on."""
    return _cache_on


def clear_cache() -> None:
    """Drop every cached layer (they are rebuilt on their next call while the cache is on)."""
    with _CACHE_LOCK:
        _CACHE.clear()


def cache_nbytes() -> int:
    """Bytes held by the key cache now (keys and block scales of every cached layer)."""
    with _CACHE_LOCK:
        entries = list(_CACHE.values())
    return sum(e.nbytes() for e in entries)


def _stamp(packed: torch.Tensor, absmax: torch.Tensor, tensor_scale: torch.Tensor, bits: int, n: int) -> tuple | None:
    """What a layer's keys and scales depend on; ``None`` where it cannot be tracked (inference
    tensors have no version counter, so a change in place would go unseen: they are not cached)."""
    try:
        return (bits, n, packed.data_ptr(), packed._version, packed.shape, absmax.data_ptr(), absmax._version,
                absmax.shape, tensor_scale.data_ptr(), tensor_scale._version)
    except RuntimeError:  # "Inference tensors do not track version counter"
        return None


def _layer(packed: torch.Tensor, absmax: torch.Tensor, codebook: torch.Tensor, tensor_scale: torch.Tensor, bits: int,
           n: int) -> _Layer:
    """The cached layer of this weight (built and checked on first use), or a transient one when
    the cache is off or cannot track the tensors."""
    stamp = _stamp(packed, absmax, tensor_scale, bits, n) if _cache_on else None
    if stamp is None:
        return _Layer(packed, absmax, codebook, tensor_scale, bits, n, cache=False)
    key = id(packed)
    layer = _CACHE.get(key)
    if layer is not None and layer.stamp == stamp and layer.holds(packed, absmax, tensor_scale):
        return layer
    layer = _Layer(packed, absmax, codebook, tensor_scale, bits, n, cache=True, stamp=stamp)
    with _CACHE_LOCK:
        fresh = key not in _CACHE
        _CACHE[key] = layer
    if fresh:
        # drop the entry with the tensor (an id is reused once its object is gone)
        weakref.finalize(packed, _forget, key)
    return layer


def _forget(key: int) -> None:
    """Drop the entry ``key`` once its tensor is gone (a finalizer)."""
    with _CACHE_LOCK:
        layer = _CACHE.get(key)
        if layer is not None and layer.refs[0]() is None:
            del _CACHE[key]


# ---------------------------------------------------------------------------------------
# the two products
# ---------------------------------------------------------------------------------------


def _chunks(kt: int, n: int, s: KeyScheme) -> list[tuple[int, int]]:
    """k-tile ranges of at most :data:`CHUNK_KEYS` keys for ``n`` rows (at least one k-tile each)."""
    step = max(1, CHUNK_KEYS // (2 * s.keys_per_block * n))
    return [(k0, min(kt, k0 + step)) for k0 in range(0, kt, step)]


class _TableMemo(threading.local):
    """The last lookup tables built on this thread, with a copy of the ``x`` they were built
    from: the q/k/v (and gate/up) projections of a transformer block read the same
    activations, so each call after the first of such a group reuses the tables."""

    x: torch.Tensor | None = None
    cb: _CodebookTables | None = None
    tables: torch.Tensor | None = None


_MEMO = _TableMemo()


def _rows(x: torch.Tensor, m: int, k_pad: int) -> torch.Tensor:
    """``x`` as float32 ``[M, K_pad]``, contiguous, zero in the padded in-features (they hold
    the codebook values of zero weights: x must be zero there)."""
    k = x.shape[-1]
    xs = x.reshape(m, k).to(torch.float32)
    if k != k_pad:
        return torch.nn.functional.pad(xs, (0, k_pad - k))
    return xs.contiguous()


def _lut_tables(x: torch.Tensor, m: int, layer: _Layer, cbt: _CodebookTables) -> torch.Tensor:
    """float32 ``[M, k_tiles, 2, S, 4, nkeys]`` for the ``M`` rows of ``x``: for every row, key
    position and key, the dot product of the key's codebook values with its weights' ``x``."""
    memo = _MEMO
    seen = memo.x
    # compared as given (before the float32 copy, which a reused table does not need)
    if (memo.cb is cbt and seen is not None and seen.dtype == x.dtype and seen.shape == x.shape
            and torch.equal(seen, x)):
        return memo.tables
    s, kt = layer.scheme, layer.kt
    # x[64 kt + 32 kb + r + S (G l + g)] -> per slot g, [M, kt, 2, S, 4, 1, 1]
    xk = _rows(x, m, layer.k_pad).view(m, kt, 2, 4, s.group, s.spacing, 1, 1).permute(0, 1, 2, 5, 3, 4, 6, 7).unbind(5)
    # an entry is the sum over the key's slots of x times the slot's codebook value: built from
    # the top slot down, each lower slot a broadcast add that appends the key's next bits as
    # the last dim (not a matmul: with an inner dimension of G <= 4 that is several times
    # slower; nor addcmul, slower on these broadcasts)
    tables = xk[-1] * cbt.slots[-1]  # [M, kt, 2, S, 4, 2**bits, 1]
    for g in range(s.group - 2, -1, -1):
        tables = torch.add(tables, xk[g] * cbt.slots[g]).view(m, kt, 2, s.spacing, 4, -1, 1)
    tables = tables.view(m, kt, 2, s.spacing, 4, s.nkeys)
    memo.x, memo.cb, memo.tables = x.clone(), cbt, tables
    return tables


def _gemm_lut(x: torch.Tensor, m: int, layer: _Layer, cbt: _CodebookTables) -> torch.Tensor:
    """``[M, n]`` float32 for the ``M`` rows of ``x`` through lookup tables (small M): gather,
    per block the sum of its keys times its scale, summed over the blocks."""
    tables = _lut_tables(x, m, layer, cbt)
    whole = len(layer.parts) == 1
    y = None
    for k0, k1, cached, scales in layer.parts:
        idx = layer.chunk_keys(k0, k1, cached)
        # every row of x looks up the same keys (an expanded view: one gather for all rows)
        vals = _scratch("vals", (m, *idx.shape[1:]), torch.float32)  # [M, kc, 2, S, 4, n]
        torch.gather(tables if whole else tables[:, k0:k1], 5, idx if m == 1 else idx.expand(m, *idx.shape[1:]),
                     out=vals)
        part = vals.sum((3, 4)).mul_(scales).sum((1, 2))
        y = part if y is None else y.add_(part)
    return y


def _gemm_dequant(xs: torch.Tensor, layer: _Layer, cbt: _CodebookTables) -> torch.Tensor:
    """``[M, n]`` float32 through dequantized ``[K/G, n]`` slabs (one per key slot) and ``torch.mm``."""
    s, n = layer.scheme, layer.n
    m = xs.shape[0]
    # x in key order: [M, kt, 2, S, 4, G]
    xk = xs.view(m, layer.kt, 2, 4, s.group, s.spacing).permute(0, 1, 2, 5, 3, 4)
    y = torch.zeros(m, n)
    for k0, k1, cached, scales in layer.parts:
        kc = k1 - k0
        rows = kc * 2 * s.keys_per_block
        idx = layer.chunk_keys(k0, k1, cached).view(rows, n)
        slab = _scratch("slab", (kc, 2, s.keys_per_block, n), torch.float32)
        scales = scales.unsqueeze(2)
        for g in range(s.group):
            torch.gather(cbt.keys[g * s.nkeys : (g + 1) * s.nkeys].expand(rows, -1), 1, idx, out=slab.view(rows, n))
            # codebook value times block scale: exactly the reference's dequantized weight
            slab.mul_(scales)
            y.addmm_(xk[:, k0:k1, ..., g].reshape(m, rows), slab.view(rows, n))
    return y


# ---------------------------------------------------------------------------------------
# the op
# ---------------------------------------------------------------------------------------


def gemm_cpu(
    x: torch.Tensor,
    packed: torch.Tensor,
    absmax: torch.Tensor,
    codebook: torch.Tensor,
    tensor_scale: torch.Tensor,
    bits: int,
    out_features: int,
    bias: torch.Tensor | None = None,
) -> torch.Tensor:
    """``x @ W^T (+ bias)`` for CPU tensors, arguments as for ``kbit_linear::gemm``.

    Equal to :func:`kbit_linear.format.matmul` within float32 rounding; the result has ``x``'s
    dtype and shape ``[*x.shape[:-1], out_features]``. ``packed`` may hold planes or pair codes
    (converted at every call: modules keep planes on the CPU).
    """
    if fmt.is_pair_codes(packed):  # pair codes on the CPU (modules keep planes here): per call
        packed = fmt.to_planes(packed)
    layer = _layer(packed, absmax, codebook, tensor_scale, bits, out_features)
    _ops.check_gemm_input_args(x, bias, layer.k_pad, out_features, packed.device)
    cbt = layer.codebook_table(codebook, tensor_scale)
    lead = x.shape[:-1]
    m = math.prod(lead)
    if m == 0:
        return x.new_empty((*lead, out_features))
    if m <= LUT_MAX_M:
        y = _gemm_lut(x, m, layer, cbt)
    else:
        y = _gemm_dequant(_rows(x, m, layer.k_pad), layer, cbt)
    if bias is not None:
        y += bias
    y = y.to(x.dtype)
    return y if x.dim() == 2 else y.view(*lead, out_features)


@torch.library.impl("kbit_linear::gemm", "CPU")
def _gemm_op(x: torch.Tensor, packed: torch.Tensor, absmax: torch.Tensor, codebook: torch.Tensor,
             tensor_scale: torch.Tensor, bits: int, out_features: int, bias: torch.Tensor | None) -> torch.Tensor:
    return gemm_cpu(x, packed, absmax, codebook, tensor_scale, bits, out_features, bias)


# eager KbitLinear calls skip the dispatcher (kbit_linear._ops.gemm)
_ops.register_eager_gemm("cpu", gemm_cpu)
