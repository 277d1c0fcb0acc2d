"""The GGUF block-format kernels (``kernels/gguf.cu``) and the CUDA implementations of their ops.

* ``kbit_linear::gguf_dequantize`` on CUDA: one thread per (row, block), bit for bit the
  reference (:func:`kbit_linear.gguf_format.dequantize`).
* ``kbit_linear::gguf_gemm`` on CUDA: fp16/bf16 activations with at most
  :data:`~.tuning.GGUF_GEMV_MAX_M` rows take the small-M tensor-core kernel, which reads the
  blocks directly; larger M and float32 activations dequantize the weight to ``x``'s dtype and
  call ``F.linear`` (cuBLAS), which is what a model whose weights were dequantized at load
  computes.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from ... import _gguf_ops
from ... import gguf_format as gf
from . import loader, tuning
from .tensors import aligned16

__all__ = ["gguf_instances", "gguf_dequantize_cuda", "gguf_gemm_cuda"]

_SOURCE = "gguf.cu"
_DT = {torch.float16: 0, torch.bfloat16: 1, torch.float32: 2}
_DEQUANT_THREADS = 256
_DEQUANT_ARGS = loader.ArgPack("kbit_gguf_dequantize", "qs:p qh:p scale:p mins:p out:p N:i nb:i")
_GEMV_ARGS = loader.ArgPack("kbit_gguf_gemv", "x:p qs:p qh:p scale:p mins:p bias:p out:p M:i N:i K:i")
_ROWS_PER_TILE = 16  # output rows per block of the small-M kernel (one m16 fragment)
_TOKEN_TILES = (1, 2, 4, 8)  # n8 fragments per instance: M <= 8, 16, 32, 64


def _token_tiles(m: int) -> int:
    return next(n8 for n8 in _TOKEN_TILES if m <= 8 * n8)


def _dequant_name(qtype: str, dtype: torch.dtype) -> str:
    return f"kbit_gguf_dequantize<{gf.block_type(qtype).code}, {_DT[dtype]}>"


def _gemv_name(qtype: str, dtype: torch.dtype, n8: int) -> str:
    return (f"kbit_gguf_gemv<{gf.block_type(qtype).code}, {_DT[dtype]}, {n8}, "
            f"{tuning.GGUF_GEMV_WARPS}, {tuning.GGUF_GEMV_UNROLL}>")


def gguf_instances() -> list[str]:
    """Every instance of ``gguf.cu`` the backend can launch (name expressions)."""
    names = [_dequant_name(q, dt) for q in gf.BLOCK_TYPES for dt in _DT]
    names += [_gemv_name(q, dt, n8) for q in gf.BLOCK_TYPES for dt in (torch.float16, torch.bfloat16) for n8 in _TOKEN_TILES]
    return names


def _require_cuda(t: torch.Tensor) -> None:
    if t.device.type != "cuda":
        raise ValueError(f"qs must be on a CUDA device, got {t.device}")


def _arrays(qs, qh, scale, mins):
    return aligned16(qs), None if qh is None else aligned16(qh), aligned16(scale), None if mins is None else aligned16(mins)


def gguf_dequantize_cuda(qs: torch.Tensor, qh: torch.Tensor | None, scale: torch.Tensor, mins: torch.Tensor | None, qtype: str,
                         out_features: int, in_features: int, dtype: torch.dtype) -> torch.Tensor:
    """CUDA ``kbit_linear::gguf_dequantize``: the dense ``[out_features, in_features]`` weight in
    ``dtype`` (fp16, bf16 or fp32; other dtypes through fp32).

    Raises:
        TypeError / ValueError: bad arguments (named), or the arrays not on a CUDA device.
    """
    _gguf_ops.check_dequantize_args(qs, qh, scale, mins, qtype, out_features, in_features, dtype)
    _require_cuda(qs)
    if dtype not in _DT:
        return gguf_dequantize_cuda(qs, qh, scale, mins, qtype, out_features, in_features, torch.float32).to(dtype)
    out = torch.empty((out_features, in_features), dtype=dtype, device=qs.device)
    threads = 4 * out_features * (in_features // gf.BLOCK)  # four per block
    if threads:
        qs, qh, scale, mins = _arrays(qs, qh, scale, mins)
        kern = loader.get_kernel(_SOURCE, _dequant_name(qtype, dtype), qs.device)
        loader.launch(kern, (threads + _DEQUANT_THREADS - 1) // _DEQUANT_THREADS, _DEQUANT_THREADS,
                      _DEQUANT_ARGS.Values(qs=qs, qh=qh, scale=scale, mins=mins, out=out, N=out_features, nb=in_features // gf.BLOCK),
                      0, qs.device, pack=_DEQUANT_ARGS)
    return out


def gguf_gemm_cuda(x: torch.Tensor, qs: torch.Tensor, qh: torch.Tensor | None, scale: torch.Tensor, mins: torch.Tensor | None,
                   qtype: str, out_features: int, bias: torch.Tensor | None) -> torch.Tensor:
    """CUDA ``kbit_linear::gguf_gemm``: ``x [M, K] @ W^T (+ bias)`` in ``x``'s dtype.

    Raises:
        TypeError / ValueError: bad arguments (named), or the tensors not on a CUDA device.
    """
    _gguf_ops.check_gemm_args(x, qs, qh, scale, mins, qtype, out_features, bias)
    _require_cuda(qs)
    m, k = x.shape
    if x.dtype not in (torch.float16, torch.bfloat16) or m > tuning.GGUF_GEMV_MAX_M or m == 0:
        w = gguf_dequantize_cuda(qs, qh, scale, mins, qtype, out_features, k, x.dtype)
        return F.linear(x, w, None if bias is None else bias.to(x.dtype))
    out = torch.empty((m, out_features), dtype=x.dtype, device=x.device)
    qs, qh, scale, mins = _arrays(qs, qh, scale, mins)
    b = None if bias is None else aligned16(bias.to(x.dtype))
    n8 = _token_tiles(m)
    kern = loader.get_kernel(_SOURCE, _gemv_name(qtype, x.dtype, n8), x.device)
    loader.launch(kern, (out_features + _ROWS_PER_TILE - 1) // _ROWS_PER_TILE, 32 * tuning.GGUF_GEMV_WARPS,
                  _GEMV_ARGS.Values(x=aligned16(x), qs=qs, qh=qh, scale=scale, mins=mins, bias=b, out=out, M=m, N=out_features, K=k),
                  0, x.device, pack=_GEMV_ARGS)
    return out


@torch.library.impl("kbit_linear::gguf_dequantize", "CUDA")
def _gguf_dequantize_op(qs, qh, scale, mins, qtype, out_features, in_features, dtype):
    return gguf_dequantize_cuda(qs, qh, scale, mins, qtype, out_features, in_features, dtype)


@torch.library.impl("kbit_linear::gguf_gemm", "CUDA")
def _gguf_gemm_op(x, qs, qh, scale, mins, qtype, out_features, bias):
    return gguf_gemm_cuda(x, qs, qh, scale, mins, qtype, out_features, bias)
