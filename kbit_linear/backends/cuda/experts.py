"""The element-wise kernels of mixture-of-experts layers around the grouped GEMMs
(``kernels/experts.cu``): SwiGLU over a gate_up output, and the weighted combine of the down
projection's rows back into token order (``kbit_linear::combine_experts``).

At decode sizes a MoE layer is bound by its launches, not its bytes: each kernel here replaces
two to four torch kernels (silu and the product; the row gather, the weights' cast and the
batched matmul). Both are launched as programmatic dependents, so they start while the grouped
GEMM before them finishes.
"""

from __future__ import annotations

import torch

from ... import _grouped_ops
from . import loader
from .tensors import DTYPE_CODES, HALF_DTYPE_CODES

__all__ = ["experts_instances", "kernels_supported", "swiglu_cuda", "combine_experts_cuda"]

_SOURCE = "experts.cu"
_THREADS = 256  # kThreads in experts.cu
_DT = HALF_DTYPE_CODES
_WT = DTYPE_CODES
_SWIGLU_ARGS = loader.ArgPack("kbit_swiglu", "gate_up:p out:p rows:i inter:i")
_COMBINE_ARGS = loader.ArgPack("kbit_combine_experts", "y:p position:p weights:p out:p tokens:i top_k:i H:i")


def experts_instances() -> list[str]:
    """Every instance of the kernels in ``experts.cu``."""
    swiglu = [f"kbit_swiglu<{dt}, {vec}>" for dt in _DT.values() for vec in (1, 8)]
    combine = [f"kbit_combine_experts<{dt}, {wt}, {vec}>" for dt in _DT.values() for wt in _WT.values() for vec in (1, 8)]
    return swiglu + combine


_supported: dict[int, bool] = {}


def kernels_supported(device: torch.device) -> bool:
    """Whether these kernels run on ``device``: a CUDA GPU of sm_80 or newer, with CuPy installed
    (the answer is kept per device)."""
    if device.type != "cuda":
        return False
    index = loader._device_index(device)
    ok = _supported.get(index)
    if ok is None:
        ok = _supported[index] = loader.cupy_available() and loader.runnable_properties(index) is not None
    return ok


def _vec(row: int, *tensors: torch.Tensor) -> int:
    """8 (16-byte accesses) when rows are whole 16-byte pieces and every tensor is aligned, else 1."""
    return 8 if row % 8 == 0 and all(t.data_ptr() % 16 == 0 for t in tensors) else 1


def _launch(args: loader.ArgPack, instance: str, device: torch.device, items: int, values: tuple) -> None:
    """Launch ``instance`` of experts.cu on ``device``'s current stream as a programmatic dependent:
    enough blocks for one item per thread, at most a few waves of the GPU (grid-stride beyond)."""
    index = loader._device_index(device)
    grid = max(1, min(-(-items // _THREADS), loader.device_properties(index).sm_count * 8))
    args.launch(loader.get_kernel(_SOURCE, instance, device), grid, 0, loader._current_raw_stream(index), values,
                threads=_THREADS, programmatic=True)


def swiglu_cuda(gate_up: torch.Tensor) -> torch.Tensor:
    """``silu(gate) * up`` of ``gate_up [R, 2I]`` (gate columns first), fp16/bf16 on a CUDA
    device where :func:`kernels_supported`, computed in float32 and rounded once: ``[R, I]``.

    Raises:
        ValueError: ``gate_up`` is not a CUDA fp16/bf16 ``[R, 2I]`` tensor.
    """
    if not isinstance(gate_up, torch.Tensor) or gate_up.device.type != "cuda" or gate_up.dtype not in _DT \
            or gate_up.dim() != 2 or gate_up.shape[1] % 2:
        raise ValueError(f"gate_up must be a CUDA fp16/bf16 [rows, 2 * intermediate] tensor, got "
                         f"{getattr(gate_up, 'dtype', type(gate_up))} {tuple(getattr(gate_up, 'shape', ()))}")
    gate_up = gate_up.contiguous()
    rows, inter = gate_up.shape[0], gate_up.shape[1] // 2
    out = torch.empty((rows, inter), dtype=gate_up.dtype, device=gate_up.device)
    if out.numel() == 0:
        return out
    vec = _vec(inter, gate_up, out)
    _launch(_SWIGLU_ARGS, f"kbit_swiglu<{_DT[gate_up.dtype]}, {vec}>", gate_up.device, rows * inter // vec,
            (gate_up.data_ptr(), out.data_ptr(), rows, inter))
    return out


def combine_experts_cuda(y: torch.Tensor, position: torch.Tensor, top_k_weights: torch.Tensor) -> torch.Tensor:
    """CUDA ``kbit_linear::combine_experts`` (the spec: :func:`kbit_linear._grouped_ops.combine_experts_reference`).
    fp16/bf16 ``y`` takes the kernel where :func:`kernels_supported`; other dtypes and GPUs the reference.

    Raises:
        TypeError / ValueError: bad arguments (named), or tensors not on one CUDA device.
    """
    _grouped_ops.check_combine_args(y, position, top_k_weights)
    if y.device.type != "cuda":
        raise ValueError(f"y must be on a CUDA device, got {y.device}")
    if y.dtype not in _DT or top_k_weights.dtype not in _WT or not kernels_supported(y.device):
        return _grouped_ops.combine_experts_reference(y, position, top_k_weights)
    tokens, top_k = top_k_weights.shape
    hidden = y.shape[1]
    y, position, weights = y.contiguous(), position.contiguous(), top_k_weights.contiguous()
    out = torch.empty((tokens, hidden), dtype=y.dtype, device=y.device)
    if out.numel() == 0:
        return out
    vec = _vec(hidden, y, out)
    _launch(_COMBINE_ARGS, f"kbit_combine_experts<{_DT[y.dtype]}, {_WT[weights.dtype]}, {vec}>", y.device, tokens * hidden // vec,
            (y.data_ptr(), position.data_ptr(), weights.data_ptr(), out.data_ptr(), tokens, top_k, hidden))
    return out
