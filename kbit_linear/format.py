"""The kbit weight format, in plain PyTorch. This module is the specification.

Every function here is device-agnostic and vectorized; the CUDA kernels are tested against
these functions bit for bit (quantize, repack) or within rounding (dequantize, matmul). The
byte layout is described in ``docs/format.md``; the short version:

* a *block* is 32 consecutive in-features of one output row of ``W[N, K]``;
* each block has one E4M4 scale byte (round-up of the block absmax, times a per-tensor
  power-of-two ``tensor_scale``) and 32 codebook indices stored as ``bits`` uint32 bit-planes
  (bit ``i`` of plane ``b`` = bit ``b`` of element ``i``);
* for the GEMM, blocks are tiled ``[K_pad/64, N_pad/128, 128, 2, bits]`` (planes) and
  ``[K_pad/64, N_pad/128, 128, 2]`` (scales), padded with zero blocks. :func:`tiled_shapes`
  is the one place these shapes are computed and :func:`check_tiled` the one place a pair is
  checked against them; the ops, the module and the checkpoint checks ask these two.
"""

from __future__ import annotations

import math
import sys
from dataclasses import dataclass
from functools import lru_cache

import torch
import torch.nn.functional as F

__all__ = [
    "BLOCK_SIZE",
    "TILE_K",
    "TILE_N",
    "SUPPORTED_BITS",
    "E4M4_BIAS",
    "E4M4_MAX",
    "check_given_tensor_scale",
    "KbitWeight",
    "create_normal_float_codebook",
    "validate_codebook",
    "resolve_codebook",
    "codebook_covering_radius",
    "e4m4_table",
    "encode_e4m4",
    "decode_e4m4",
    "compute_tensor_scale",
    "is_power_of_two",
    "quantize_blockwise",
    "dequantize_blockwise",
    "pack_bitplanes",
    "unpack_bitplanes",
    "tile_blocks",
    "untile_blocks",
    "padded_shape",
    "tiled_shapes",
    "check_tiled",
    "PAIR_CODE_BYTES",
    "has_pair_codes",
    "pair_code_bits",
    "is_pair_codes",
    "block_entries",
    "to_pair_codes",
    "to_planes",
    "slice_weight",
    "quantize",
    "dequantize",
    "matmul",
]

BLOCK_SIZE = 32
"""Weights per quantization block (along in_features)."""
TILE_K = 64
"""In-features per storage tile (two blocks)."""
TILE_N = 128
"""Output features per storage tile."""
SUPPORTED_BITS = (2, 3, 4, 5)
E4M4_BIAS = 11
E4M4_MAX = 31.0
"""Largest E4M4 value: 2**(15 - 11) * (1 + 15/16)."""


# ---------------------------------------------------------------------------------------
# argument checks (shared by the public functions below and by the op layer)
# ---------------------------------------------------------------------------------------


# torch.compile may pass the ops' int arguments as SymInt: accept them where an int is checked.
_INTS = (int, torch.SymInt)


def check_bits(bits: int, name: str = "bits") -> int:
    """Return ``bits`` if it is an int in 2..5, else raise naming ``name``."""
    if isinstance(bits, bool) or not isinstance(bits, _INTS):
        raise TypeError(f"{name} must be an int in {SUPPORTED_BITS}, got {type(bits).__name__}")
    if bits not in SUPPORTED_BITS:
        raise ValueError(f"{name} must be one of {SUPPORTED_BITS}, got {bits}")
    return bits


def check_bool(name: str, value: object) -> bool:
    """Return ``value`` if it is a bool, else raise a ``TypeError`` naming ``name``."""
    if not isinstance(value, bool):
        raise TypeError(f"{name} must be a bool, got {type(value).__name__}")
    return value


def check_module(value: object, name: str = "module") -> None:
    """Raise a ``TypeError`` naming ``name`` unless ``value`` is an ``nn.Module`` (not an
    AttributeError from deep inside)."""
    if not isinstance(value, torch.nn.Module):
        raise TypeError(f"{name} must be an nn.Module, got {type(value).__name__}")


def check_float_dtype(dtype: object, name: str = "dtype") -> torch.dtype:
    """Return ``dtype`` if it is a floating-point ``torch.dtype``, else raise a ``TypeError`` naming
    ``name`` (a string or an integer dtype would fail later with an unrelated message)."""
    if not isinstance(dtype, torch.dtype) or not dtype.is_floating_point:
        raise TypeError(f"{name} must be a floating-point torch.dtype, got {dtype!r}")
    return dtype


def check_device(device: object, name: str = "device") -> torch.device | None:
    """``device`` as a ``torch.device`` (``None`` stays ``None``), checked before anything is touched.

    Accepts what ``torch.device`` accepts (a ``torch.device``, a str such as ``"cpu"`` or
    ``"cuda:0"``, an int CUDA ordinal). Raises a TypeError for another type, a ValueError for a
    string torch cannot parse or a CUDA device where CUDA is not available (not a RuntimeError
    from torch halfway through).
    """
    if device is None:
        return None
    if not isinstance(device, (str, torch.device, int)) or isinstance(device, bool):
        raise TypeError(f"{name} must be a torch.device, a str, an int or None, got {type(device).__name__}")
    try:
        dev = torch.device(device)
    except (RuntimeError, ValueError) as e:
        if isinstance(device, int) and device >= 0:  # an ordinal of the current accelerator
            raise ValueError(f"{name} {device!r}: no CUDA (or other accelerator) device is available here ({e})") from None
        raise ValueError(f"{name} {device!r} is not a device torch knows: {e}") from None
    if dev.type == "cuda":
        if not torch.cuda.is_available():
            raise ValueError(f"{name} {str(dev)!r}: CUDA is not available here")
        if dev.index is not None and dev.index >= torch.cuda.device_count():
            raise ValueError(f"{name} {str(dev)!r}: there are only {torch.cuda.device_count()} CUDA device(s)")
    return dev


def check_weight(weight: torch.Tensor, name: str = "weight", *, finite: bool = True) -> None:
    """Raise unless ``weight`` is a non-empty 2-D floating-point tensor (and, with ``finite``, has no NaN/Inf).

    ``finite=False`` checks the metadata only (no pass over the data, no host sync): what the op
    layer checks on every call. Meta tensors are never scanned.
    """
    if not isinstance(weight, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(weight).__name__}")
    if not weight.is_floating_point():
        raise TypeError(f"{name} must be a floating-point tensor, got dtype {weight.dtype}")
    if weight.dim() != 2:
        raise ValueError(f"{name} must be 2-D [out_features, in_features], got shape {tuple(weight.shape)}")
    if weight.numel() == 0:
        raise ValueError(f"{name} must not be empty, got shape {tuple(weight.shape)}")
    # min and max propagate NaN and show Inf: one reduction pass, no boolean temporary.
    if finite and weight.device.type != "meta" and not bool(torch.isfinite(torch.stack(torch.aminmax(weight))).all()):
        raise ValueError(f"{name} contains NaN or Inf values; cannot quantize")


# ---------------------------------------------------------------------------------------
# codebooks
# ---------------------------------------------------------------------------------------


@lru_cache(maxsize=None)
def _normal_float_codebook(bits: int, device: torch.device) -> torch.Tensor:
    n = 1 << bits
    # Quantiles of N(0, 1) at the centres of n equiprobable bins, in float64 for accuracy.
    p = torch.linspace(0.5 / n, 1.0 - 0.5 / n, n, dtype=torch.float64)
    q = math.sqrt(2.0) * torch.erfinv(2.0 * p - 1.0)
    q = q / q.abs().max()
    return q.to(torch.float32).to(device)


def create_normal_float_codebook(bits: int, device: torch.device | str | None = None) -> torch.Tensor:
    """The default normal-float codebook for ``bits``-bit indices.

    Args:
        bits: index width, 2..5.
        device: where the codebook lives (default CPU).

    Returns:
        float32 ``[2**bits]``: the standard normal quantiles at
        ``linspace(0.5/n, 1 - 0.5/n, n)``, divided by their largest magnitude. Sorted,
        symmetric, endpoints exactly -1 and 1, no exact zero. A fresh copy of a cached tensor
        (cached per bits and device), so callers may modify it.
    """
    check_bits(bits)
    dev = torch.device(device) if device is not None else torch.device("cpu")
    return _normal_float_codebook(bits, dev).clone()


def validate_codebook(codebook: torch.Tensor, bits: int, name: str = "codebook") -> torch.Tensor:
    """Check a user codebook and return it as contiguous float32.

    Args:
        codebook: ``[2**bits]`` floating-point values, finite, strictly increasing, in [-1, 1].
        bits: index width, 2..5.
        name: the argument name used in error messages.

    Raises:
        TypeError: not a floating-point tensor.
        ValueError: wrong size, not 1-D, NaN/Inf, not strictly increasing, or outside [-1, 1].
    """
    check_bits(bits)
    if not isinstance(codebook, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(codebook).__name__}")
    if not codebook.is_floating_point():
        raise TypeError(f"{name} must be a floating-point tensor, got dtype {codebook.dtype}")
    n = 1 << bits
    if codebook.dim() != 1 or codebook.numel() != n:
        raise ValueError(f"{name} must have shape [{n}] for bits={bits}, got {tuple(codebook.shape)}")
    cb = codebook.detach().to(torch.float32).contiguous()
    if cb.device.type == "meta":
        return cb
    if not bool(torch.isfinite(cb).all()):
        raise ValueError(f"{name} contains NaN or Inf values")
    if not bool((cb[1:] > cb[:-1]).all()):
        raise ValueError(f"{name} must be sorted in strictly increasing order")
    if not bool((cb.abs() <= 1.0).all()):
        raise ValueError(f"{name} values must lie in [-1, 1] (scales are block absmax), got max |value| {cb.abs().max().item():.6g}")
    return cb


def codebook_covering_radius(codebook: torch.Tensor) -> float:
    """Largest distance from any point of [-1, 1] to its nearest codebook entry.

    The per-weight quantization error is at most this times the block's scale.
    """
    cb = codebook.detach().to(torch.float64).cpu()
    half_gap = ((cb[1:] - cb[:-1]) / 2).max().item() if cb.numel() > 1 else 0.0
    return max(half_gap, 1.0 - cb[-1].item(), cb[0].item() + 1.0)


# ---------------------------------------------------------------------------------------
# E4M4 scales
# ---------------------------------------------------------------------------------------


@lru_cache(maxsize=None)
def _e4m4_table(device: torch.device) -> torch.Tensor:
    codes = torch.arange(256, dtype=torch.int64)
    e = codes >> 4
    m = (codes & 15).to(torch.float64)
    normal = torch.pow(2.0, (e - E4M4_BIAS).to(torch.float64)) * (1.0 + m / 16.0)
    subnormal = (2.0 ** (1 - E4M4_BIAS)) * (m / 16.0)
    return torch.where(e > 0, normal, subnormal).to(torch.float32).to(device)


def e4m4_table(device: torch.device | str | None = None) -> torch.Tensor:
    """float32 ``[256]``: the value of every E4M4 code (strictly increasing, code 0 = 0.0)."""
    dev = torch.device(device) if device is not None else torch.device("cpu")
    return _e4m4_table(dev).clone()


def decode_e4m4(codes: torch.Tensor) -> torch.Tensor:
    """Decode E4M4 bytes (uint8, any shape) to float32.

    ``e = c >> 4, m = c & 15``; ``e > 0``: ``2**(e-11) * (1 + m/16)``; ``e = 0``:
    ``2**-10 * m/16``; code 0 is exactly 0.
    """
    if not isinstance(codes, torch.Tensor):
        raise TypeError(f"codes must be a torch.Tensor, got {type(codes).__name__}")
    if codes.dtype != torch.uint8:
        raise TypeError(f"codes must be uint8, got {codes.dtype}")
    return _e4m4_table(codes.device)[codes.long()]


def encode_e4m4(values: torch.Tensor) -> torch.Tensor:
    """Encode non-negative scales to E4M4, rounding **up**.

    Returns the smallest code whose value is ``>= values`` (so a weight divided by its stored
    scale never exceeds 1 in magnitude). 0 encodes to code 0.

    Args:
        values: float tensor, any shape, every entry finite and in [0, 31].

    Raises:
        ValueError: negative, NaN/Inf, or above 31 (pre-scale with ``compute_tensor_scale``).
    """
    if not isinstance(values, torch.Tensor):
        raise TypeError(f"values must be a torch.Tensor, got {type(values).__name__}")
    if not values.is_floating_point():
        raise TypeError(f"values must be a floating-point tensor, got {values.dtype}")
    v = values.to(torch.float32)
    if values.device.type != "meta":
        if not bool(torch.isfinite(v).all()):
            raise ValueError("values contains NaN or Inf")
        if bool((v < 0).any()):
            raise ValueError("values must be non-negative (they are block absmax values)")
        if bool((v > E4M4_MAX).any()):
            raise ValueError(f"values above the E4M4 maximum {E4M4_MAX} cannot be encoded; divide by a tensor scale first")
    return _encode_e4m4_unchecked(v)


def _encode_e4m4_unchecked(v: torch.Tensor) -> torch.Tensor:
    table = _e4m4_table(v.device)
    # searchsorted(left) = index of the first table entry >= v: the round-up code.
    codes = torch.searchsorted(table, v.contiguous().reshape(-1), right=False)
    return codes.clamp_(max=255).to(torch.uint8).reshape(v.shape)


def is_power_of_two(scale: torch.Tensor) -> bool:
    """Whether every value of ``scale`` is a positive finite power of two (what a tensor scale
    must be; one host sync)."""
    return bool((torch.isfinite(scale) & (scale > 0) & (torch.frexp(scale).mantissa == 0.5)).all())


def compute_tensor_scale(weight: torch.Tensor) -> torch.Tensor:
    """The per-tensor power-of-two scale: ``2**s``, ``s`` the smallest int with ``max|W| / 2**s <= 31``.

    Computed on ``weight``'s device without a host sync. An all-zero tensor gets 1.

    Returns:
        float32 ``[1]``.
    """
    amax = weight.detach().abs().amax().to(torch.float32).reshape(1)
    safe = torch.where(amax > 0, amax, torch.ones_like(amax))
    s = torch.ceil(torch.log2(safe / E4M4_MAX))
    # log2 can be off by one ulp near exact powers of two: nudge s to the exact minimum.
    s = torch.where(safe / torch.exp2(s) > E4M4_MAX, s + 1, s)
    s = torch.where(safe / torch.exp2(s - 1) <= E4M4_MAX, s - 1, s)
    return torch.where(amax > 0, torch.exp2(s), torch.ones_like(amax))


# ---------------------------------------------------------------------------------------
# bit-planes
# ---------------------------------------------------------------------------------------


_BYTE_BIT_WEIGHTS: dict[torch.device, torch.Tensor] = {}


def _byte_bit_weights(device: torch.device) -> torch.Tensor:
    """uint8 ``[8]``: 1, 2, 4, ..., 128 (cached per device)."""
    w = _BYTE_BIT_WEIGHTS.get(device)
    if w is None:
        w = _BYTE_BIT_WEIGHTS[device] = torch.tensor([1 << i for i in range(8)], dtype=torch.uint8, device=device)
    return w


def _check_little_endian() -> None:
    # The packers reinterpret 4 bytes as one uint32 word; every platform torch runs on is
    # little-endian, but say so loudly rather than pack garbage if that ever changes.
    if sys.byteorder != "little":  # pragma: no cover
        raise RuntimeError("kbit_linear's bit-plane packing assumes a little-endian host")


def pack_bitplanes(indices: torch.Tensor, bits: int) -> torch.Tensor:
    """Pack codebook indices into bit-planes.

    Args:
        indices: integer tensor ``[..., 32]``, values in ``[0, 2**bits)``.
        bits: index width, 2..5.

    Returns:
        int32 ``[..., bits]``: word ``b`` holds bit ``b`` of element ``i`` at bit ``i``
        (the int32 carries the raw uint32 bits).
    """
    check_bits(bits)
    if not isinstance(indices, torch.Tensor) or indices.is_floating_point() or indices.is_complex() or indices.dtype == torch.bool:
        raise TypeError("indices must be an integer torch.Tensor")
    if indices.dim() == 0 or indices.shape[-1] != BLOCK_SIZE:
        raise ValueError(f"indices must have a last dimension of {BLOCK_SIZE}, got shape {tuple(indices.shape)}")
    if indices.numel() and (int(indices.min()) < 0 or int(indices.max()) >= (1 << bits)):
        raise ValueError(f"indices must lie in [0, {1 << bits}) for bits={bits}")
    return _pack_bitplanes(indices, bits)


def _pack_bitplanes(indices: torch.Tensor, bits: int) -> torch.Tensor:
    """:func:`pack_bitplanes` without its checks (indices known to be in range)."""
    _check_little_endian()
    lead = indices.shape[:-1]
    idx = indices.to(torch.uint8)
    plane = torch.arange(bits, dtype=torch.uint8, device=idx.device)
    # [..., bits, 32] bits, grouped in bytes of 8 elements: element i goes to bit i % 8 of byte i // 8.
    bit_of = (idx.unsqueeze(-2) >> plane.unsqueeze(-1)) & 1
    byte_vals = (bit_of.reshape(*lead, bits, 4, 8) * _byte_bit_weights(idx.device)).sum(-1, dtype=torch.uint8)
    # 4 little-endian bytes = one uint32 word with element i at bit i.
    return byte_vals.contiguous().view(torch.int32).reshape(*lead, bits)


def unpack_bitplanes(packed: torch.Tensor, bits: int) -> torch.Tensor:
    """Inverse of :func:`pack_bitplanes`: int32 ``[..., bits]`` -> uint8 indices ``[..., 32]``."""
    check_bits(bits)
    if not isinstance(packed, torch.Tensor) or packed.dtype != torch.int32:
        raise TypeError("packed must be an int32 torch.Tensor")
    if packed.dim() == 0 or packed.shape[-1] != bits:
        raise ValueError(f"packed must have a last dimension of bits={bits}, got shape {tuple(packed.shape)}")
    _check_little_endian()
    lead = packed.shape[:-1]
    byte_vals = packed.contiguous().view(torch.uint8).reshape(*lead, bits, 4, 1)
    shifts = torch.arange(8, dtype=torch.uint8, device=packed.device)
    bit_of = ((byte_vals >> shifts) & 1).reshape(*lead, bits, BLOCK_SIZE)  # [..., bits, 32]
    plane = torch.arange(bits, dtype=torch.uint8, device=packed.device)
    return (bit_of << plane.unsqueeze(-1)).sum(dim=-2, dtype=torch.uint8)


# ---------------------------------------------------------------------------------------
# blockwise quantize / dequantize (flat layout)
# ---------------------------------------------------------------------------------------


def _blocks_of(weight: torch.Tensor) -> torch.Tensor:
    """float32 ``[N, ceil(K/32), 32]`` view of ``weight`` with the last block zero-padded."""
    n, k = weight.shape
    nblk = -(-k // BLOCK_SIZE)
    w = weight.detach().to(torch.float32)
    if nblk * BLOCK_SIZE != k:
        w = F.pad(w, (0, nblk * BLOCK_SIZE - k))
    return w.reshape(n, nblk, BLOCK_SIZE)


def _round_up_codes(blocks: torch.Tensor, tensor_scale: torch.Tensor) -> torch.Tensor:
    """uint8 E4M4 code of each block's absmax over ``tensor_scale``, rounded up (``blocks``: ``[..., 32]``)."""
    return _encode_e4m4_unchecked(blocks.abs().amax(dim=-1) / tensor_scale.to(torch.float32).reshape(()))


def _block_scales(absmax_codes: torch.Tensor, tensor_scale: torch.Tensor) -> torch.Tensor:
    return decode_e4m4(absmax_codes) * tensor_scale.to(torch.float32).reshape(())


def _check_tensor_scale(tensor_scale: torch.Tensor) -> None:
    if not isinstance(tensor_scale, torch.Tensor):
        raise TypeError(f"tensor_scale must be a torch.Tensor, got {type(tensor_scale).__name__}")
    if tensor_scale.dtype != torch.float32 or tensor_scale.numel() != 1:
        raise ValueError(f"tensor_scale must be a float32 tensor with one element, got {tensor_scale.dtype} {tuple(tensor_scale.shape)}")


def check_given_tensor_scale(tensor_scale: torch.Tensor, weight: torch.Tensor, name: str = "weight") -> torch.Tensor:
    """A caller's ``tensor_scale`` for ``weight`` as float32 ``[1]`` on the weight's device, checked:
    one positive finite power of two that holds the weight (its largest block absmax over it fits
    the E4M4 range). On the meta device only its type and size are checked.

    Raises:
        TypeError: not a floating-point tensor. ValueError: not one value, or not such a scale.
    """
    if not isinstance(tensor_scale, torch.Tensor) or not tensor_scale.is_floating_point():
        raise TypeError(f"tensor_scale must be a floating-point tensor, got {getattr(tensor_scale, 'dtype', type(tensor_scale).__name__)}")
    if tensor_scale.numel() != 1:
        raise ValueError(f"tensor_scale must hold one value, got shape {tuple(tensor_scale.shape)}")
    if tensor_scale.device.type == "meta" and weight.device.type != "meta":
        raise ValueError("tensor_scale is on the meta device (it holds no value)")
    ts = tensor_scale.detach().to(device=weight.device, dtype=torch.float32).reshape(1)
    if weight.device.type == "meta":
        return ts
    if not is_power_of_two(ts):
        raise ValueError(f"tensor_scale must be a positive finite power of two, got {ts.item()!r}")
    if bool((compute_tensor_scale(weight) > ts).any()):
        raise ValueError(f"tensor_scale={ts.item()!r} is too small for {name}: its largest value / tensor_scale exceeds {E4M4_MAX}")
    return ts


def quantize_blockwise(
    weight: torch.Tensor,
    bits: int,
    codebook: torch.Tensor | None = None,
    tensor_scale: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Quantize ``W[N, K]`` into flat bit-planes and E4M4 scales.

    Args:
        weight: floating-point ``[N, K]``, finite.
        bits: index width, 2..5.
        codebook: float ``[2**bits]`` (default: the normal-float codebook).
        tensor_scale: float32 ``[1]`` (default: :func:`compute_tensor_scale` of ``weight``).

    Returns:
        ``(packed_flat, absmax_flat, tensor_scale)``: int32 ``[N, ceil(K/32), bits]``, uint8
        ``[N, ceil(K/32)]``, float32 ``[1]``, all on ``weight``'s device.
    """
    check_bits(bits)
    check_weight(weight)
    cb = _resolve_codebook(codebook, bits, weight.device)
    # float32 [1] on the weight's device either way
    ts = compute_tensor_scale(weight) if tensor_scale is None else check_given_tensor_scale(tensor_scale, weight)
    packed, codes = _quantize_blocks(weight, bits, cb, ts)
    return packed, codes, ts


def _quantize_blocks(weight: torch.Tensor, bits: int, cb: torch.Tensor, ts: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`quantize_blockwise` on arguments already checked: a finite 2-D weight, a valid
    float32 codebook and a float32 ``[1]`` tensor scale, both on the weight's device.

    The reference ``kbit_linear::quantize`` op calls this after its metadata checks, so the
    values are scanned once, by whoever validated them (``quantize_blockwise`` or
    ``kbit_linear.quantizer.quantize_weight``), not again per layer.
    """
    blocks = _blocks_of(weight)  # [N, nblk, 32]
    codes = _round_up_codes(blocks, ts)
    return _pack_bitplanes(_nearest_indices(blocks, _block_scales(codes, ts).unsqueeze(-1), cb), bits), codes


def _nearest_indices(blocks: torch.Tensor, scale: torch.Tensor, codebook: torch.Tensor) -> torch.Tensor:
    """int64 codebook index of every weight of ``blocks`` (``[..., 32]``) with block scales
    ``scale`` (``[..., 1]``): the nearest entry of ``w / scale``, ties to the lower index (a
    zero scale gives the entry nearest 0); beyond the scale, the end levels."""
    x = torch.where(scale > 0, blocks / torch.where(scale > 0, scale, torch.ones_like(scale)), torch.zeros_like(blocks))
    return _nearest_of(x, _midpoints(codebook))


def _midpoints(codebook: torch.Tensor) -> torch.Tensor:
    """The ``2**bits - 1`` midpoints between neighbouring codebook entries (:func:`_nearest_of`'s table)."""
    return (codebook[:-1] + codebook[1:]) * 0.5


def _nearest_of(x: torch.Tensor, mids: torch.Tensor) -> torch.Tensor:
    """int64 index of the codebook entry nearest each value of ``x`` (already divided by its
    scale), ties to the lower index, given the codebook's :func:`_midpoints`."""
    # searchsorted(left) counts the midpoints strictly below x: nearest entry, ties to the lower index.
    return torch.searchsorted(mids, x.contiguous().reshape(-1), right=False).reshape(x.shape)


SCALE_SEARCH_CANDIDATES = 8
"""E4M4 codes a block scale search tries: the round-up code of the block's absmax and the next
lower ones (each about 6 % smaller)."""


def search_block_codes(weight: torch.Tensor, codebook: torch.Tensor, tensor_scale: torch.Tensor,
                       candidates: int = SCALE_SEARCH_CANDIDATES) -> torch.Tensor:
    """Block scales chosen for the least squared error of each block, instead of its absmax.

    For every 32-weight block, each of ``candidates`` E4M4 codes (the round-up code of the
    block's absmax and the next lower ones) is tried: the block is quantized with that scale
    (weights beyond it land on the codebook's end levels) and the code with the smallest
    squared error is kept (ties: the larger scale). A lower scale gives the middle levels finer
    steps at the cost of clipping the block's largest weight or two, which wins when the
    codebook crowds its levels near zero (K = 2, 3).

    Args:
        weight: finite floating-point ``[N, K]`` (checked by the caller).
        codebook: float32 ``[2**bits]``, strictly increasing, on ``weight``'s device.
        tensor_scale: float32 ``[1]`` power of two with ``max|W| / tensor_scale <= 31``.
        candidates: codes tried per block, >= 1 (1 = the round-up code alone).

    Returns:
        uint8 ``[N, ceil(K/32)]`` E4M4 codes, for :func:`quantize_with_codes`.
    """
    if isinstance(candidates, bool) or not isinstance(candidates, int) or candidates < 1:
        raise ValueError(f"candidates must be a positive int, got {candidates!r}")
    blocks = _blocks_of(weight)
    ts = tensor_scale.to(torch.float32).reshape(())
    first = _round_up_codes(blocks, ts).to(torch.int64)  # [N, nblk]
    table = _e4m4_table(weight.device)
    # The zero padding of a last, partial block is not a weight: its error does not count.
    valid = (torch.arange(blocks.shape[1] * BLOCK_SIZE, device=weight.device) < weight.shape[1]).reshape(-1, BLOCK_SIZE)
    best_code = first.clone()
    best_err = torch.full(first.shape, float("inf"), device=weight.device)
    # Rows in slices: every candidate needs a block-sized temporary.
    rows = max(1, (1 << 22) // max(1, blocks.shape[1] * BLOCK_SIZE))
    for r0 in range(0, blocks.shape[0], rows):
        b = blocks[r0 : r0 + rows]
        for step in range(candidates):
            code = (first[r0 : r0 + rows] - step).clamp(min=0)
            scale = (table[code] * ts).unsqueeze(-1)
            idx = _nearest_indices(b, scale, codebook)
            err = torch.where(valid, (codebook[idx] * scale - b) ** 2, 0.0).sum(dim=-1)
            better = (err < best_err[r0 : r0 + rows]) & (code > 0) | (step == 0)
            best_err[r0 : r0 + rows] = torch.where(better, err, best_err[r0 : r0 + rows])
            best_code[r0 : r0 + rows] = torch.where(better, code, best_code[r0 : r0 + rows])
    return best_code.to(torch.uint8)


def quantize_with_codes(weight: torch.Tensor, bits: int, codebook: torch.Tensor, tensor_scale: torch.Tensor,
                        codes: torch.Tensor) -> torch.Tensor:
    """Flat bit-planes ``[N, ceil(K/32), bits]`` of ``weight`` with given block scale ``codes``
    (uint8 ``[N, ceil(K/32)]``): each weight goes to the nearest codebook entry of
    ``w / scale`` (ties to the lower index; beyond the scale, the end levels). Arguments checked
    by the caller, as for :func:`search_block_codes`."""
    scale = _block_scales(codes, tensor_scale).unsqueeze(-1)
    return _pack_bitplanes(_nearest_indices(_blocks_of(weight), scale, codebook), bits)


def dequantize_blockwise(
    packed_flat: torch.Tensor,
    absmax_flat: torch.Tensor,
    codebook: torch.Tensor,
    tensor_scale: torch.Tensor,
    bits: int,
    in_features: int | None = None,
) -> torch.Tensor:
    """Inverse of :func:`quantize_blockwise`: float32 ``[N, in_features]``.

    ``in_features`` defaults to ``32 * ceil(K/32)`` (the padded width).
    """
    check_bits(bits)
    _check_flat(packed_flat, absmax_flat, bits)
    cb = validate_codebook(codebook, bits).to(packed_flat.device)
    _check_tensor_scale(tensor_scale)
    n, nblk, _ = packed_flat.shape
    width = nblk * BLOCK_SIZE
    if in_features is None:
        in_features = width
    if not isinstance(in_features, int) or not (width - BLOCK_SIZE < in_features <= width):
        raise ValueError(f"in_features={in_features} does not match packed_flat with {nblk} blocks per row")
    idx = unpack_bitplanes(packed_flat, bits).long()  # [N, nblk, 32]
    scale = _block_scales(absmax_flat, tensor_scale.to(packed_flat.device)).unsqueeze(-1)
    w = cb[idx] * scale
    return w.reshape(n, width)[:, :in_features]


def _check_flat(packed_flat: torch.Tensor, absmax_flat: torch.Tensor, bits: int) -> None:
    if not isinstance(packed_flat, torch.Tensor) or packed_flat.dtype != torch.int32:
        raise TypeError("packed_flat must be an int32 torch.Tensor")
    if not isinstance(absmax_flat, torch.Tensor) or absmax_flat.dtype != torch.uint8:
        raise TypeError("absmax_flat must be a uint8 torch.Tensor")
    if packed_flat.dim() != 3 or packed_flat.shape[-1] != bits:
        raise ValueError(f"packed_flat must have shape [N, blocks, bits={bits}], got {tuple(packed_flat.shape)}")
    if tuple(absmax_flat.shape) != tuple(packed_flat.shape[:2]):
        raise ValueError(f"absmax_flat shape {tuple(absmax_flat.shape)} does not match packed_flat {tuple(packed_flat.shape)}")


def _resolve_codebook(codebook: torch.Tensor | None, bits: int, device: torch.device) -> torch.Tensor:
    # may return the cached default or the caller's tensor: read-only use only
    if codebook is None:
        return _normal_float_codebook(bits, device)
    return validate_codebook(codebook, bits).to(device)


def resolve_codebook(codebook: torch.Tensor | None, bits: int, device: torch.device | str | None = None) -> torch.Tensor:
    """The codebook to quantize with, as a fresh float32 tensor on ``device`` (default CPU).

    ``None`` gives the normal-float codebook of ``bits``; a tensor is checked by
    :func:`validate_codebook` and copied (the result never aliases the caller's tensor).
    """
    if codebook is None:
        return create_normal_float_codebook(bits, device)
    dev = torch.device(device) if device is not None else torch.device("cpu")
    return validate_codebook(codebook, bits).to(dev).clone()


# ---------------------------------------------------------------------------------------
# tiled layout
# ---------------------------------------------------------------------------------------


def _round_up(name: str, value: int, tile: int) -> int:
    if isinstance(value, bool) or not isinstance(value, _INTS) or value <= 0:
        raise ValueError(f"{name} must be a positive int, got {value!r}")
    return -(-value // tile) * tile


def padded_shape(out_features: int, in_features: int) -> tuple[int, int]:
    """``(N_pad, K_pad)``: out_features rounded up to 128, in_features to 64."""
    return _round_up("out_features", out_features, TILE_N), _round_up("in_features", in_features, TILE_K)


def tiled_shapes(out_features: int, in_features: int, bits: int) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """Shapes of the tiled planes and scales of an ``out_features x in_features`` weight.

    The one place these shapes are computed: the tiler, the op schemas' fake implementations,
    ``KbitLinear`` and the checkpoint checks all ask here.

    Args:
        out_features: N, a positive int.
        in_features: K, a positive int.
        bits: index width, 2..5.

    Returns:
        ``((K_pad/64, N_pad/128, 128, 2, bits), (K_pad/64, N_pad/128, 128, 2))``: the shapes of
        ``packed`` (int32) and ``absmax`` (uint8).
    """
    check_bits(bits)
    return _tiled_shapes(*padded_shape(out_features, in_features), bits)


def _tiled_shapes(n_pad: int, k_pad: int, bits: int) -> tuple[tuple[int, ...], tuple[int, ...]]:
    absmax_shape = (k_pad // TILE_K, n_pad // TILE_N, TILE_N, TILE_K // BLOCK_SIZE)
    return (*absmax_shape, bits), absmax_shape


def tile_blocks(packed_flat: torch.Tensor, absmax_flat: torch.Tensor, bits: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Flat blocks -> the GEMM's tiled layout, padding with zero blocks.

    Args:
        packed_flat: int32 ``[N, nblk, bits]``.
        absmax_flat: uint8 ``[N, nblk]``.
        bits: index width.

    Returns:
        ``(packed, absmax)``: int32 ``[K_pad/64, N_pad/128, 128, 2, bits]`` and uint8
        ``[K_pad/64, N_pad/128, 128, 2]`` (see :func:`tiled_shapes`), contiguous.
    """
    check_bits(bits)
    _check_flat(packed_flat, absmax_flat, bits)
    n, nblk, _ = packed_flat.shape
    kt, nt, _, kb, _ = _tiled_shapes(*padded_shape(n, nblk * BLOCK_SIZE), bits)[0]
    p = F.pad(packed_flat, (0, 0, 0, kt * kb - nblk, 0, nt * TILE_N - n))
    a = F.pad(absmax_flat, (0, kt * kb - nblk, 0, nt * TILE_N - n))
    # [N_pad, K_pad/32, bits] -> [nt, 128, kt, 2, bits] -> [kt, nt, 128, 2, bits]
    p = p.reshape(nt, TILE_N, kt, kb, bits).permute(2, 0, 1, 3, 4).contiguous()
    a = a.reshape(nt, TILE_N, kt, kb).permute(2, 0, 1, 3).contiguous()
    return p, a


# ---------------------------------------------------------------------------------------
# Pair codes (4 and 5 bits): the layout the CUDA kernels read fastest (docs/format.md, section 7a)
# ---------------------------------------------------------------------------------------

PAIR_CODE_BYTES = {4: 16, 5: 20}
"""Bytes of pair codes per 32-weight block, by index width (the widths that have them): the
same bytes as the block's planes, bits permuted."""

# 4 bits: bits 2b and 2b+1 of a pair code are bit b of the pair's first and second index. Byte j
# of word w is the pair (2w + 8j, 2w + 8j + 1); in plane b its two bits sit at 2w + 8j, so
# rotating plane b right by 2w - 2b (mod 32) and keeping bits 8j + 2b, 8j + 2b + 1 of every byte
# gives word w.
_PAIR_MASKS = tuple(0x03030303 << (2 * b) for b in range(4))
_U32 = 0xFFFFFFFF


def _rotr32(v: torch.Tensor, s: int) -> torch.Tensor:
    """Rotate the low 32 bits of int64 ``v`` right by ``s`` (0..31)."""
    return ((v >> s) | (v << (32 - s))) & _U32 if s else v


def has_pair_codes(bits: int) -> bool:
    """Whether ``bits``-bit weights have a pair-code layout (4 and 5 bits)."""
    return bits in PAIR_CODE_BYTES


def is_pair_codes(packed: torch.Tensor) -> bool:
    """Whether a tiled ``packed`` tensor holds pair codes (uint8) rather than bit-planes (int32)."""
    return isinstance(packed, torch.Tensor) and packed.dtype == torch.uint8


def block_entries(packed: torch.Tensor, bits: int) -> int:
    """Length of ``packed``'s last dimension for ``bits``: ``bits`` planes (int32) or
    ``PAIR_CODE_BYTES[bits]`` pair-code bytes (uint8, 4 and 5 bits only).

    Raises:
        ValueError: uint8 pair codes at a width that has none.
    """
    if not is_pair_codes(packed):
        return bits
    if not has_pair_codes(bits):
        raise ValueError(f"packed is uint8 pair codes, which exist only at bits in {tuple(PAIR_CODE_BYTES)}, not bits={bits}")
    return PAIR_CODE_BYTES[bits]


def pair_code_bits(codes: torch.Tensor, name: str = "codes") -> int:
    """The index width of uint8 pair codes, read from their bytes per block (last dimension);
    ``name`` is the argument an error names.

    Raises:
        ValueError: a last dimension that is no width's pair-code size.
    """
    by_bytes = {v: b for b, v in PAIR_CODE_BYTES.items()}
    if codes.dim() == 0 or codes.shape[-1] not in by_bytes:
        raise ValueError(f"{name} must have a last dimension of {' or '.join(map(str, by_bytes))}, got shape {tuple(codes.shape)}")
    return by_bytes[codes.shape[-1]]


def _words_to_int32(words: torch.Tensor) -> torch.Tensor:
    """int64 values in [0, 2**32) -> the int32 tensor with the same low 32 bits."""
    return torch.where(words >= 1 << 31, words - (1 << 32), words).to(torch.int32)


def _element_index(planes: torch.Tensor, e: int) -> torch.Tensor:
    """int64 index of element ``e`` of each block of int64 planes ``[..., bits]`` (low 32 bits)."""
    idx = (planes[..., 0] >> e) & 1
    for b in range(1, planes.shape[-1]):
        idx |= ((planes[..., b] >> e) & 1) << b
    return idx


def to_pair_codes(packed: torch.Tensor) -> torch.Tensor:
    """4- or 5-bit bit-planes -> pair codes, block by block (the block's bytes are permuted bits).

    4 bits, 16 bytes read as four little-endian uint32 words: byte ``j`` of word ``w`` is the
    *pair code* of elements ``2w + 8j`` and ``2w + 8j + 1``, whose bit ``2b`` is bit ``b`` of the
    first index and bit ``2b + 1`` bit ``b`` of the second.

    5 bits, 20 bytes: the pair code of elements ``2w + 8j``, ``2w + 8j + 1`` is ``first | second
    << 5`` (10 bits); lane group ``w`` is the 40-bit number ``sum_j code_j << 10j``, whose low 32
    bits are word ``w`` (bytes ``4w .. 4w + 3``) and whose bits 32..39 are byte ``16 + w``.

    A GEMM lane that needs a lane group's pairs loads one word (and one byte) instead of every
    plane and a gather.

    Args:
        packed: int32 ``[..., 4]`` or ``[..., 5]``, the planes of one block per row (any leading
            shape, e.g. the tiled ``[K_pad/64, N_pad/128, 128, 2, bits]``).

    Returns:
        uint8 ``[..., PAIR_CODE_BYTES[bits]]`` on the same device.
    """
    if not isinstance(packed, torch.Tensor) or packed.dtype != torch.int32:
        raise TypeError(f"packed must be an int32 torch.Tensor, got {getattr(packed, 'dtype', type(packed).__name__)}")
    if packed.dim() == 0 or not has_pair_codes(packed.shape[-1]):
        raise ValueError(f"packed must have a last dimension of {' or '.join(map(str, PAIR_CODE_BYTES))} planes, "
                         f"got shape {tuple(packed.shape)}")
    _check_little_endian()
    bits = packed.shape[-1]
    planes = packed.to(torch.int64) & _U32
    if bits == 4:
        words = torch.zeros_like(planes)
        for w in range(4):
            for b in range(bits):
                words[..., w] |= _rotr32(planes[..., b], (2 * w - 2 * b) % 32) & _PAIR_MASKS[b]
        return _words_to_int32(words).contiguous().view(torch.uint8).reshape(*packed.shape[:-1], PAIR_CODE_BYTES[bits])
    # element by element: temporaries of a few int64 per block, whatever the chunk
    groups = torch.zeros((*packed.shape[:-1], 4), dtype=torch.int64, device=packed.device)
    for w in range(4):
        for j in range(4):
            code = _element_index(planes, 2 * w + 8 * j) | (_element_index(planes, 2 * w + 8 * j + 1) << bits)
            groups[..., w] |= code << (10 * j)
    low = _words_to_int32(groups & _U32).contiguous().view(torch.uint8).reshape(*packed.shape[:-1], 16)
    high = (groups >> 32).to(torch.uint8)
    return torch.cat([low, high], dim=-1)


def to_planes(codes: torch.Tensor) -> torch.Tensor:
    """Inverse of :func:`to_pair_codes`: uint8 ``[..., 16]`` / ``[..., 20]`` -> int32 planes
    ``[..., 4]`` / ``[..., 5]``."""
    if not isinstance(codes, torch.Tensor) or codes.dtype != torch.uint8:
        raise TypeError(f"codes must be a uint8 torch.Tensor, got {getattr(codes, 'dtype', type(codes).__name__)}")
    bits = pair_code_bits(codes)
    _check_little_endian()
    words = codes[..., :16].contiguous().view(torch.int32).to(torch.int64) & _U32
    if bits == 4:
        planes = torch.zeros_like(words)
        for b in range(bits):
            for w in range(4):
                # rotate left by 2w - 2b = rotate right by the complement
                planes[..., b] |= _rotr32(words[..., w] & _PAIR_MASKS[b], (2 * b - 2 * w) % 32)
        return _words_to_int32(planes)
    groups = words | (codes[..., 16:].to(torch.int64) << 32)
    planes = torch.zeros((*codes.shape[:-1], bits), dtype=torch.int64, device=codes.device)
    for w in range(4):
        for j in range(4):
            code = groups[..., w] >> (10 * j)
            for e, index in ((2 * w + 8 * j, code), (2 * w + 8 * j + 1, code >> bits)):
                for b in range(bits):
                    planes[..., b] |= ((index >> b) & 1) << e
    return _words_to_int32(planes)


def check_tiled(
    packed: torch.Tensor,
    absmax: torch.Tensor,
    bits: int,
    out_features: int | None = None,
    in_features: int | None = None,
) -> tuple[int, int]:
    """Validate a tiled pair and return ``(N_pad, K_pad)``.

    Checks dtypes (int32 planes or 4-/5-bit uint8 pair codes, uint8 scales), the tile shape of ``packed`` for ``bits``, that
    ``absmax`` has the same tiles, and, where given, that ``out_features`` / ``in_features``
    pad to exactly these tiles (:func:`tiled_shapes`). Metadata only: no pass over the data.

    Raises:
        TypeError: wrong type or dtype.
        ValueError: any shape that does not match, named.
    """
    if not isinstance(packed, torch.Tensor) or packed.dtype not in (torch.int32, torch.uint8):
        raise TypeError(f"packed must be an int32 torch.Tensor (bit-planes) or, at bits in {tuple(PAIR_CODE_BYTES)}, a uint8 one "
                        f"(pair codes), got {getattr(packed, 'dtype', type(packed).__name__)}")
    if not isinstance(absmax, torch.Tensor) or absmax.dtype != torch.uint8:
        raise TypeError(f"absmax must be a uint8 torch.Tensor, got {getattr(absmax, 'dtype', type(absmax).__name__)}")
    kb, per_block = TILE_K // BLOCK_SIZE, block_entries(packed, bits)
    if packed.dim() != 5 or tuple(packed.shape[2:]) != (TILE_N, kb, per_block):
        what = "pair codes" if is_pair_codes(packed) else "planes"
        raise ValueError(f"packed ({what}) must have shape [k_tiles, n_tiles, {TILE_N}, {kb}, {per_block}] for bits={bits}, "
                         f"got {tuple(packed.shape)}")
    if tuple(absmax.shape) != tuple(packed.shape[:4]):
        raise ValueError(f"absmax shape {tuple(absmax.shape)} does not match packed {tuple(packed.shape)} (expected {tuple(packed.shape[:4])})")
    n_pad, k_pad = packed.shape[1] * TILE_N, packed.shape[0] * TILE_K
    if out_features is not None and _round_up("out_features", out_features, TILE_N) != n_pad:
        raise ValueError(f"out_features={out_features} does not match packed tiles padded to {n_pad}")
    if in_features is not None and _round_up("in_features", in_features, TILE_K) != k_pad:
        raise ValueError(f"in_features={in_features} does not match tiles padded to {k_pad}")
    return n_pad, k_pad


def untile_blocks(packed: torch.Tensor, absmax: torch.Tensor, bits: int, out_features: int, in_features: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Inverse of :func:`tile_blocks`: back to flat ``[N, ceil(K/32), bits]`` and ``[N, ceil(K/32)]``.

    ``packed`` may be bit-planes or pair codes (:func:`to_pair_codes`); the result is planes.
    """
    check_bits(bits)
    n_pad, k_pad = check_tiled(packed, absmax, bits, out_features, in_features)
    packed = to_planes(packed) if is_pair_codes(packed) else packed
    nblk_pad, nblk = k_pad // BLOCK_SIZE, -(-in_features // BLOCK_SIZE)
    p = packed.permute(1, 2, 0, 3, 4).reshape(n_pad, nblk_pad, bits)[:out_features, :nblk].contiguous()
    a = absmax.permute(1, 2, 0, 3).reshape(n_pad, nblk_pad)[:out_features, :nblk].contiguous()
    return p, a


# ---------------------------------------------------------------------------------------
# the whole weight
# ---------------------------------------------------------------------------------------


@dataclass
class KbitWeight:
    """A quantized ``[out_features, in_features]`` weight in the tiled layout.

    Attributes:
        packed: int32 ``[K_pad/64, N_pad/128, 128, 2, bits]`` bit-planes, or at 4 / 5 bits
            possibly uint8 ``[K_pad/64, N_pad/128, 128, 2, 16 / 20]`` pair codes (:func:`to_pair_codes`).
        absmax: uint8 ``[K_pad/64, N_pad/128, 128, 2]`` E4M4 block scales.
        codebook: float32 ``[2**bits]``.
        tensor_scale: float32 ``[1]`` power of two.
        bits: index width.
        out_features: true N.
        in_features: true K.
    """

    packed: torch.Tensor
    absmax: torch.Tensor
    codebook: torch.Tensor
    tensor_scale: torch.Tensor
    bits: int
    out_features: int
    in_features: int

    def __post_init__(self) -> None:
        check_bits(self.bits)
        check_tiled(self.packed, self.absmax, self.bits, self.out_features, self.in_features)
        self.codebook = validate_codebook(self.codebook, self.bits)
        _check_tensor_scale(self.tensor_scale)

    @property
    def shape(self) -> tuple[int, int]:
        """``(out_features, in_features)``."""
        return (self.out_features, self.in_features)

    def nbytes(self) -> int:
        """Bytes of all stored tensors (planes, scales, codebook, tensor scale)."""
        return sum(t.numel() * t.element_size() for t in (self.packed, self.absmax, self.codebook, self.tensor_scale))


def _check_range(name: str, span: tuple[int, int] | None, size: int, step: int, what: str) -> tuple[int, int]:
    """``span`` as ``(start, stop)`` within ``[0, size]``; ``start`` a multiple of ``step``, ``stop`` too or ``size``."""
    if span is None:
        return 0, size
    if not isinstance(span, (tuple, list)) or len(span) != 2 or not all(
        isinstance(v, _INTS) and not isinstance(v, bool) for v in span
    ):
        raise TypeError(f"{name} must be a (start, stop) pair of ints, got {span!r}")
    start, stop = int(span[0]), int(span[1])
    if not 0 <= start < stop <= size:
        raise ValueError(f"{name}={span!r} must satisfy 0 <= start < stop <= {what}={size}")
    if start % step or (stop % step and stop != size):
        raise ValueError(
            f"{name}={span!r}: start and stop must be multiples of {step} (stop may also be {what}={size}); "
            "a block of 32 weights shares one scale and cannot be split"
        )
    return start, stop


def slice_weight(qweight: KbitWeight, rows: tuple[int, int] | None = None, cols: tuple[int, int] | None = None) -> KbitWeight:
    """The quantized weight ``W[rows[0]:rows[1], cols[0]:cols[1]]``, exactly: same codes, same scales.

    Rows (out_features) may be cut anywhere; columns (in_features) only between 32-weight blocks.
    The slice dequantizes bit for bit to the same slice of ``dequantize(qweight)``: it keeps the
    codebook and ``tensor_scale``, and every block's planes and E4M4 byte. Where the cut falls on
    storage-tile boundaries (rows at multiples of 128, columns at multiples of 64, or the
    weight's end) whole tiles are copied; elsewhere the blocks are re-tiled (:func:`untile_blocks`
    then :func:`tile_blocks`), which moves blocks between tiles without touching them.

    Args:
        qweight: the weight to cut.
        rows: ``(start, stop)`` of out_features (default: all); ``0 <= start < stop <= out_features``.
        cols: ``(start, stop)`` of in_features (default: all); ``start`` a multiple of 32, ``stop``
            a multiple of 32 or ``in_features``.

    Returns:
        A new :class:`KbitWeight` of shape ``(rows[1] - rows[0], cols[1] - cols[0])`` with its own
        (contiguous) ``packed``/``absmax`` and copies of ``codebook``/``tensor_scale``.

    Raises:
        TypeError: ``qweight`` is not a KbitWeight or a range is not a pair of ints.
        ValueError: a range outside the weight or a column cut inside a block, named.
    """
    if not isinstance(qweight, KbitWeight):
        raise TypeError(f"qweight must be a KbitWeight, got {type(qweight).__name__}")
    r0, r1 = _check_range("rows", rows, qweight.out_features, 1, "out_features")
    c0, c1 = _check_range("cols", cols, qweight.in_features, BLOCK_SIZE, "in_features")
    n, k = r1 - r0, c1 - c0
    tile_rows = r0 % TILE_N == 0 and (r1 % TILE_N == 0 or r1 == qweight.out_features)
    tile_cols = c0 % TILE_K == 0 and (c1 % TILE_K == 0 or c1 == qweight.in_features)
    if tile_rows and tile_cols:
        # Whole tiles: positions past the new true shape are the old padding or zero blocks
        # already, except a last k-tile cut at 64 (its both blocks are real) which needs nothing.
        nt = slice(r0 // TILE_N, -(-r1 // TILE_N))
        kt = slice(c0 // TILE_K, -(-c1 // TILE_K))
        packed = qweight.packed[kt, nt].contiguous()
        absmax = qweight.absmax[kt, nt].contiguous()
    else:
        p, a = untile_blocks(qweight.packed, qweight.absmax, qweight.bits, qweight.out_features, qweight.in_features)
        b0, b1 = c0 // BLOCK_SIZE, -(-c1 // BLOCK_SIZE)
        packed, absmax = tile_blocks(p[r0:r1, b0:b1], a[r0:r1, b0:b1], qweight.bits)
        if is_pair_codes(qweight.packed):  # the slice keeps its weight's layout
            packed = to_pair_codes(packed)
    return KbitWeight(packed, absmax, qweight.codebook.clone(), qweight.tensor_scale.clone(), qweight.bits, n, k)


def quantize(weight: torch.Tensor, bits: int, codebook: torch.Tensor | None = None) -> KbitWeight:
    """Quantize an ``nn.Linear``-style weight ``[out, in]`` to the tiled kbit format."""
    check_bits(bits)
    check_weight(weight)
    cb = resolve_codebook(codebook, bits, weight.device)
    ts = compute_tensor_scale(weight)
    packed, absmax = tile_blocks(*_quantize_blocks(weight, bits, cb, ts), bits)
    return KbitWeight(packed, absmax, cb, ts, bits, weight.shape[0], weight.shape[1])


def dequantize(qweight: KbitWeight, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Dense ``[out_features, in_features]`` weight of ``qweight`` in ``dtype``."""
    if not isinstance(qweight, KbitWeight):
        raise TypeError(f"qweight must be a KbitWeight, got {type(qweight).__name__}")
    p, a = untile_blocks(qweight.packed, qweight.absmax, qweight.bits, qweight.out_features, qweight.in_features)
    w = dequantize_blockwise(p, a, qweight.codebook, qweight.tensor_scale, qweight.bits, qweight.in_features)
    return w.to(dtype)


def matmul(x: torch.Tensor, qweight: KbitWeight, bias: torch.Tensor | None = None) -> torch.Tensor:
    """Reference ``x @ W^T (+ bias)`` for any leading dims: dequantize, then ``F.linear``.

    Computed in float32; the result has ``x``'s dtype.
    """
    if not isinstance(x, torch.Tensor) or not x.is_floating_point():
        raise TypeError("x must be a floating-point torch.Tensor")
    if x.dim() == 0 or x.shape[-1] != qweight.in_features:
        raise ValueError(f"x's last dimension must be in_features={qweight.in_features}, got shape {tuple(x.shape)}")
    w = dequantize(qweight, torch.float32).to(x.device)
    b = None if bias is None else bias.to(device=x.device, dtype=torch.float32)
    return F.linear(x.to(torch.float32), w, b).to(x.dtype)
