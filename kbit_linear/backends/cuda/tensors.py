"""What the kernels ask of their tensor arguments, made true with as few copies as possible,
and what a weight tensor tells them.

Every kernel copies 16 bytes at a time, so each tensor it reads must be contiguous and start on
a 16-byte boundary, and x's rows must hold a multiple of 8 fp16/bf16 elements (the zero columns
added here meet the weight's zero padding, so they add nothing).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from ... import format as fmt

__all__ = ["DTYPE_CODES", "HALF_DTYPE_CODES", "aligned16", "kernel_rows", "layout_arg", "weight_layouts"]

DTYPE_CODES: dict[torch.dtype, int] = {torch.float16: 0, torch.bfloat16: 1, torch.float32: 2}
"""Each activation / weight dtype's code as a kernel's DT or WT template argument (``common.cuh``:
KBIT_F16, KBIT_BF16, KBIT_F32)."""
HALF_DTYPE_CODES: dict[torch.dtype, int] = {t: c for t, c in DTYPE_CODES.items() if t.itemsize == 2}
"""The codes of the half-precision dtypes, for kernels that take only those."""


def aligned16(t: torch.Tensor) -> torch.Tensor:
    """``t`` itself when contiguous and 16-byte aligned, else a copy that is."""
    if t.is_contiguous() and t.data_ptr() % 16 == 0:
        return t
    t = t.contiguous()
    return t if t.data_ptr() % 16 == 0 else t.clone()


def kernel_rows(x2d: torch.Tensor) -> torch.Tensor:
    """``x2d`` (``[M, K]``) with K zero-padded to a multiple of 8, contiguous and 16-byte aligned
    (``x2d`` itself when it already is)."""
    k = x2d.shape[1]
    if k % 8:
        x2d = F.pad(x2d, (0, 8 - k % 8))
    return aligned16(x2d)


def layout_arg(pairs: bool) -> str:
    """The end of a weight kernel's name expression for its weight layout: ``""`` for bit-planes
    (the ``PAIRS`` template parameter's default), ``", true"`` for 4- or 5-bit pair codes
    (``kbit_linear.format.to_pair_codes``; a uint8 ``packed``)."""
    return ", true" if pairs else ""


def weight_layouts(bits: int) -> tuple[bool, ...]:
    """The ``pairs`` values a weight kernel is instantiated with at ``bits``: planes always,
    pair codes where the width has them (4 and 5 bits)."""
    return (False, True) if fmt.has_pair_codes(bits) else (False,)
