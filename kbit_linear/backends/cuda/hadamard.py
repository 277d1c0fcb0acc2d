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
from .tensors import aligned16

__all__ = ["hadamard_instances", "hadamard_rotate_cuda"]

_SOURCE = "hadamard.cu"
_WARPS = 4  # kHadamardWarps
_CHUNK = 256  # elements per warp
_DT = {torch.float16: 0, torch.bfloat16: 1}
_LOG_BLOCKS = range(3, int(math.log2(hd.MAX_BLOCK)) + 1)  # blocks of 8 .. MAX_BLOCK
_ARGS = loader.ArgPack("kbit_hadamard_rotate", "x:p signs:p y:p total:i K:i scale:f")


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
    kern = loader.get_kernel(_SOURCE, f"kbit_hadamard_rotate<{_DT[x.dtype]}, {int(math.log2(block))}>", x.device)
    chunks = -(-total // _CHUNK)
    loader.launch(kern, -(-chunks // _WARPS), 32 * _WARPS, _ARGS.Values(x=xc, signs=sc, y=y, total=total, K=k,
                                                                        scale=1.0 / math.sqrt(block)),
                  0, x.device, pack=_ARGS)
    return y.view(x.shape)


@torch.library.impl("kbit_linear::hadamard_rotate", "CUDA")
def _hadamard_rotate_op(x, signs):
    return hadamard_rotate_cuda(x, signs)


_ops.register_eager_rotate("cuda", hadamard_rotate_cuda)
