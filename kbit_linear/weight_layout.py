"""Which layout a module's packed weight takes on each device, and the conversions in place.

Checkpoints, state dicts and CPU tensors hold bit-planes (``docs/format.md``, section 7). On a
CUDA device a 4- or 5-bit weight is held as pair codes instead (section 7a): the same bytes with
the bits permuted so that a GEMM lane loads its pairs as one word (and a byte at 5 bits), without
the gather that merges the planes. Every op accepts both layouts (the dtype says which), so this is an optimization
that can never be wrong, only slower: a weight that arrives in planes by a path that does not
pass here (for example accelerate's offload hooks setting tensors directly) still computes the
same result.

The module classes call :func:`adopt` where their tensors may have been moved or replaced
(construction, device moves, loading) and :func:`storage_form` where they hand tensors out
(state dicts, checksums), so a checkpoint never sees pair codes.
"""

from __future__ import annotations

from typing import Callable

import torch
from torch import nn

from . import format as fmt

__all__ = ["wants_pair_codes", "storage_form", "device_form", "adopt"]

# Blocks converted per step: bounds the temporaries of the conversion (int64 copies of the
# block's words, planes and lane groups plus a few one-word temporaries: ~180 bytes per block at
# 5 bits, measured on an H100 as the peak beyond the result, less at 4) to ~45 MiB whatever the
# layer's size.
_CHUNK_BLOCKS = 1 << 18


def wants_pair_codes(bits: int, device: torch.device) -> bool:
    """Whether a ``bits``-bit weight on ``device`` is held as pair codes: 4 and 5 bits on a CUDA device."""
    return fmt.has_pair_codes(bits) and device.type == "cuda"


def _convert(packed: torch.Tensor, fn: Callable[[torch.Tensor], torch.Tensor], per_block_in: int, per_block_out: int, dtype: torch.dtype) -> torch.Tensor:
    """``fn`` over the blocks of ``packed`` (last dim ``per_block_in``) in chunks, into a new
    tensor with last dim ``per_block_out``."""
    blocks = packed.reshape(-1, per_block_in)
    out = torch.empty((blocks.shape[0], per_block_out), dtype=dtype, device=packed.device)
    for i in range(0, blocks.shape[0], _CHUNK_BLOCKS):
        out[i : i + _CHUNK_BLOCKS] = fn(blocks[i : i + _CHUNK_BLOCKS])
    return out.reshape(*packed.shape[:-1], per_block_out)


def storage_form(packed: torch.Tensor) -> torch.Tensor:
    """``packed`` as bit-planes: itself if it holds planes, else a converted copy."""
    if not fmt.is_pair_codes(packed):
        return packed
    bits = fmt.pair_code_bits(packed, "packed")
    return _convert(packed.detach(), fmt.to_planes, fmt.PAIR_CODE_BYTES[bits], bits, torch.int32)


def device_form(packed: torch.Tensor, bits: int) -> torch.Tensor:
    """``packed`` in the layout its device wants for ``bits`` (:func:`wants_pair_codes`):
    itself if it is in that layout already, else a converted copy."""
    held = fmt.pair_code_bits(packed, "packed") if fmt.is_pair_codes(packed) else bits
    if held != bits:
        raise ValueError(f"packed holds {held}-bit pair codes, not bits={bits}")
    if wants_pair_codes(bits, packed.device) == fmt.is_pair_codes(packed):
        return packed
    if fmt.is_pair_codes(packed):
        return storage_form(packed)
    return _convert(packed.detach(), fmt.to_pair_codes, bits, fmt.PAIR_CODE_BYTES[bits], torch.uint8)


def adopt(param: nn.Parameter | None, bits: int) -> None:
    """Put a module's packed weight Parameter into its device's layout, in place (the same
    Parameter object, so optimizers, hooks and tied references keep seeing it)."""
    if param is None:
        return
    new = device_form(param.data, bits)
    if new is not param.data:
        param.data = new
