"""The GGUF block-format kernels (``kernels/gguf.cu``) and the CUDA implementations of their ops.

* ``kbit_linear::gguf_dequantize`` on CUDA: four threads per (row, block), bit for bit the
  reference (:func:`kbit_linear.gguf_format.dequantize`).
* ``kbit_linear::gguf_gemm_a8`` on CUDA (8-bit activations): a kernel quantizes x to Q8_1
  blocks, then an integer-MMA kernel (``mma.m16n8k32`` s8, one block of 32 per step, rescaled
  per block) takes 64 rows of x at a time; float32 activations take the reference.
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
from .tensors import DTYPE_CODES, aligned16

__all__ = ["gguf_instances", "gguf_dequantize_cuda", "gguf_gemm_cuda", "gguf_gemm_a8_cuda"]

_SOURCE = "gguf.cu"
_DT = DTYPE_CODES
_DEQUANT_THREADS = 256
_DEQUANT_ARGS = loader.ArgPack("kbit_gguf_dequantize", "qs:p qh:p scale:p mins:p out:p N:i nb:i")
_GEMV_ARGS = loader.ArgPack("kbit_gguf_gemv", "x:p qs:p qh:p scale:p mins:p bias:p out:p M:i N:i K:i")
_Q8_ARGS = loader.ArgPack("kbit_gguf_quantize_q8_1", "x:p xq:p xd:p xs:p M:i nb:i")
_GEMV_A8_ARGS = loader.ArgPack("kbit_gguf_gemv_a8", "xq:p xd:p xs:p qs:p qh:p scale:p mins:p bias:p out:p M:i N:i K:i")
_A8_WARPS = 8  # warps per block of the 8-bit-activation kernel (splitting K)
_A8_UNROLL = 4  # consecutive blocks per warp and step of that kernel
_A8_MAX_M = 64  # rows of x per launch of that kernel (eight n8 fragments)
_ROWS_PER_TILE = 16  # output rows per block of the small-M kernel (one m16 fragment)
_TOKEN_TILES = (1, 2, 4, 8)  # n8 fragments per instance: M <= 8, 16, 32, 64


def _token_tiles(m: int) -> int:
    return next(n8 for n8 in _TOKEN_TILES if m <= 8 * n8)


def _dequant_name(qtype: str, dtype: torch.dtype) -> str:
    return f"kbit_gguf_dequantize<{gf.block_type(qtype).code}, {_DT[dtype]}>"


def _gemv_name(qtype: str, dtype: torch.dtype, n8: int) -> str:
    warps, unroll = tuning.GGUF_GEMV_LAUNCH[n8]
    return f"kbit_gguf_gemv<{gf.block_type(qtype).code}, {_DT[dtype]}, {n8}, {warps}, {unroll}>"


def _gemv_a8_name(qtype: str, dtype: torch.dtype, n8: int) -> str:
    return f"kbit_gguf_gemv_a8<{gf.block_type(qtype).code}, {_DT[dtype]}, {n8}, {_A8_WARPS}, {_A8_UNROLL}>"


def gguf_instances() -> list[str]:
    """Every instance of ``gguf.cu`` the backend can launch (name expressions)."""
    halves = (torch.float16, torch.bfloat16)
    names = [_dequant_name(q, dt) for q in gf.BLOCK_TYPES for dt in _DT]
    names += [_gemv_name(q, dt, n8) for q in gf.BLOCK_TYPES for dt in halves for n8 in _TOKEN_TILES]
    names += [f"kbit_gguf_quantize_q8_1<{_DT[dt]}>" for dt in halves]
    names += [_gemv_a8_name(q, dt, n8) for q in gf.BLOCK_TYPES for dt in halves for n8 in _TOKEN_TILES]
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
    if m == 0:
        return torch.empty((0, out_features), dtype=x.dtype, device=x.device)
    if x.dtype not in (torch.float16, torch.bfloat16) or m > tuning.GGUF_GEMV_MAX_M:
        w = gguf_dequantize_cuda(qs, qh, scale, mins, qtype, out_features, k, x.dtype)
        with torch.autocast("cuda", enabled=False):  # the output in x's dtype, as the schema says, under autocast too
            return F.linear(x, w, None if bias is None else bias.to(x.dtype))
    out = torch.empty((m, out_features), dtype=x.dtype, device=x.device)
    qs, qh, scale, mins = _arrays(qs, qh, scale, mins)
    b = None if bias is None else aligned16(bias.to(x.dtype))
    n8 = _token_tiles(m)
    kern = loader.get_kernel(_SOURCE, _gemv_name(qtype, x.dtype, n8), x.device)
    loader.launch(kern, (out_features + _ROWS_PER_TILE - 1) // _ROWS_PER_TILE, 32 * tuning.GGUF_GEMV_LAUNCH[n8][0],
                  _GEMV_ARGS.Values(x=aligned16(x), qs=qs, qh=qh, scale=scale, mins=mins, bias=b, out=out, M=m, N=out_features, K=k),
                  0, x.device, pack=_GEMV_ARGS)
    return out


def quantize_q8_1_cuda(x: torch.Tensor) -> gf.Q8Activations:
    """x (fp16/bf16 ``[M, K]``, on a CUDA device, K a multiple of 32) as Q8_1 blocks, by the
    kernel: equal to :func:`kbit_linear.gguf_format.quantize_activations` (the block sums up to
    float32 summation order)."""
    if x.dtype not in (torch.float16, torch.bfloat16) or x.dim() != 2 or x.shape[1] % gf.BLOCK or x.device.type != "cuda":
        raise ValueError(f"x must be a CUDA fp16/bf16 [M, K] tensor with K a multiple of {gf.BLOCK}, got "
                         f"{x.dtype} {tuple(x.shape)} on {x.device}")
    m, k = x.shape
    nb = k // gf.BLOCK
    xq = torch.empty((m, k), dtype=torch.int8, device=x.device)
    xd = torch.empty((m, nb), dtype=torch.float16, device=x.device)
    xs = torch.empty((m, nb), dtype=torch.float16, device=x.device)
    if m * nb:
        kern = loader.get_kernel(_SOURCE, f"kbit_gguf_quantize_q8_1<{_DT[x.dtype]}>", x.device)
        loader.launch(kern, (m * nb + _DEQUANT_THREADS - 1) // _DEQUANT_THREADS, _DEQUANT_THREADS,
                      _Q8_ARGS.Values(x=aligned16(x), xq=xq, xd=xd, xs=xs, M=m, nb=nb), 0, x.device, pack=_Q8_ARGS)
    return gf.Q8Activations(xq, xd, xs)


def gguf_gemm_a8_cuda(x: torch.Tensor, qs: torch.Tensor, qh: torch.Tensor | None, scale: torch.Tensor, mins: torch.Tensor | None,
                      qtype: str, out_features: int, bias: torch.Tensor | None) -> torch.Tensor:
    """CUDA ``kbit_linear::gguf_gemm_a8``: ``x [M, K] @ W^T (+ bias)`` with x quantized to 8 bits.

    Raises:
        TypeError / ValueError: bad arguments (named), or the tensors not on a CUDA device.
    """
    _gguf_ops.check_gemm_args(x, qs, qh, scale, mins, qtype, out_features, bias)
    _require_cuda(qs)
    if x.dtype not in (torch.float16, torch.bfloat16):
        return _gguf_ops.gguf_gemm_a8_reference(x, qs, qh, scale, mins, qtype, out_features, bias)
    m, k = x.shape
    out = torch.empty((m, out_features), dtype=x.dtype, device=x.device)
    if m == 0:
        return out
    a = quantize_q8_1_cuda(x)
    qs, qh, scale, mins = _arrays(qs, qh, scale, mins)
    b = None if bias is None else aligned16(bias.to(x.dtype))
    for r0 in range(0, m, _A8_MAX_M):  # the same kernel for every chunk: one numeric path at any M
        rows = min(_A8_MAX_M, m - r0)
        kern = loader.get_kernel(_SOURCE, _gemv_a8_name(qtype, x.dtype, _token_tiles(rows)), x.device)
        loader.launch(kern, (out_features + _ROWS_PER_TILE - 1) // _ROWS_PER_TILE, 32 * _A8_WARPS,
                      _GEMV_A8_ARGS.Values(xq=a.qs[r0:], xd=a.scale[r0:], xs=a.sums[r0:], qs=qs, qh=qh, scale=scale, mins=mins,
                                           bias=b, out=out[r0:], M=rows, N=out_features, K=k),
                      0, x.device, pack=_GEMV_A8_ARGS)
    return out


@torch.library.impl("kbit_linear::gguf_gemm_a8", "CUDA")
def _gguf_gemm_a8_op(x, qs, qh, scale, mins, qtype, out_features, bias):
    return gguf_gemm_a8_cuda(x, qs, qh, scale, mins, qtype, out_features, bias)


@torch.library.impl("kbit_linear::gguf_dequantize", "CUDA")
def _gguf_dequantize_op(qs, qh, scale, mins, qtype, out_features, in_features, dtype):
    return gguf_dequantize_cuda(qs, qh, scale, mins, qtype, out_features, in_features, dtype)


@torch.library.impl("kbit_linear::gguf_gemm", "CUDA")
def _gguf_gemm_op(x, qs, qh, scale, mins, qtype, out_features, bias):
    return gguf_gemm_cuda(x, qs, qh, scale, mins, qtype, out_features, bias)
