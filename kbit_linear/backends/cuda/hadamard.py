"""The Hadamard rotation of a layer's input on CUDA (``kernels/hadamard.cu``) and its op.

``kbit_linear::hadamard_rotate`` on CUDA: one pass over ``x`` (sign flips, the block's Walsh-
Hadamard butterflies in registers and shuffles, the normalization) instead of the reference's
multiply and matrix product (:func:`kbit_linear.hadamard.rotate`). fp16 and bf16 inputs whose
rotation block is at least 8 (``in_features`` a multiple of 8) take the kernel; anything else
takes the reference.
"""

from __future__ import annotations

import math

import torch

from ... import _ops
from ... import hadamard as hd
from . import loader
from .tensors import HALF_DTYPE_CODES, aligned16

__all__ = ["hadamard_instances", "hadamard_rotate_cuda"]

_SOURCE = "hadamard.cu"
_WARPS = 4  # kHadamardWarps
_CHUNK = 256  # elements per warp
_DT = HALF_DTYPE_CODES
_LOG_BLOCKS = range(3, int(math.log2(hd.MAX_BLOCK)) + 1)  # blocks of 8 .. MAX_BLOCK
_ARGS = loader.ArgPack("kbit_hadamard_rotate", "x:p signs:p y:p total:i K:i")
_kernels: dict[tuple[int, torch.dtype, int], loader.CudaKernel] = {}  # (device index, dtype, log2 block) -> instance


def _kernel(device: torch.device, dtype: torch.dtype, log_block: int) -> loader.CudaKernel:
    key = (device.index if device.index is not None else torch.cuda.current_device(), dtype, log_block)
    kern = _kernels.get(key)
    if kern is None:
        kern = _kernels[key] = loader.get_kernel(_SOURCE, f"kbit_hadamard_rotate<{_DT[dtype]}, {log_block}>", device)
    return kern


def hadamard_instances() -> list[str]:
    """Every instance of the rotation kernel (name expressions in ``hadamard.cu``)."""
    return [f"kbit_hadamard_rotate<{dt}, {lb}>" for dt in _DT.values() for lb in _LOG_BLOCKS]


def hadamard_rotate_cuda(x: torch.Tensor, signs: torch.Tensor) -> torch.Tensor:
    """CUDA ``kbit_linear::hadamard_rotate``: ``x R`` in ``x``'s dtype and shape.

    Raises:
        TypeError / ValueError: bad arguments (named; :func:`kbit_linear._ops.check_rotate_args`).
    """
    _ops.check_rotate_args(x, signs)
    k = x.shape[-1]
    block = hd.hadamard_block(k)
    total = x.numel()
    if x.dtype not in _DT or block < 8 or total >= 2**31 or total == 0:
        return hd.rotate(x, signs)
    xc = aligned16(x)
    sc = aligned16(signs)
    y = torch.empty_like(xc)
    kern = _kernel(x.device, x.dtype, block.bit_length() - 1)
    chunks = -(-total // _CHUNK)
    # every value a plain int, checked above: the fast launch
    _ARGS.launch(kern, -(-chunks // _WARPS), 0, loader._current_raw_stream(kern.device_index),
                 _ARGS.Values(x=xc.data_ptr(), signs=sc.data_ptr(), y=y.data_ptr(), total=total, K=k), threads=32 * _WARPS)
    return y.view(x.shape)


@torch.library.impl("kbit_linear::hadamard_rotate", "CUDA")
def _hadamard_rotate_op(x, signs):
    return hadamard_rotate_cuda(x, signs)


_ops.register_eager_rotate("cuda", hadamard_rotate_cuda)
