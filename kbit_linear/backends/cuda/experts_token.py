"""One token through a mixture-of-experts layer's kbit experts in two launches
(``kernels/experts_token.cu``): the CUDA implementation of ``kbit_linear::experts_one_token``.

A decode step of batch 1 reads only its ``top_k`` experts' weights, a few megabytes, so the
grouped path's six launches (routing, gate_up, SwiGLU, the down projection's zero fill, down,
combine) cost more than the bytes. Here ``kbit_token_gate_up`` computes ``silu(gate) * up`` of
every slot's expert straight from the token's row, and ``kbit_token_down`` every hidden row's
weighted sum over the slots, with the grouped path's roundings. Both are persistent grids of
16-warp blocks (the decode kernel's lookup tables take most of an SM's shared memory) launched as
programmatic dependents: the down kernel builds its tables while gate_up runs.

Where the kernels do not take a call (float32 activations, an intermediate size that is not a
multiple of 16, more than :data:`MAX_TOP_K` slots, a GPU the backend does not run on) the op
runs its composition of the grouped ops, which needs no host sync either.
"""

from __future__ import annotations

import torch

from ... import _grouped_ops
from ... import format as fmt
from . import loader, tuning
from .decode import _TABLE_SMEM
from .tensors import DTYPE_CODES, HALF_DTYPE_CODES, aligned16, kernel_rows, layout_arg, weight_layouts

__all__ = ["MAX_TOP_K", "token_instances", "token_kernels_take", "experts_one_token_cuda", "run_token_kernels"]

MAX_TOP_K = 16
"""Most slots (experts per token) the kernels take: the down kernel keeps one partial-sum slice
per slot and warp in shared memory."""

_SOURCE = "experts_token.cu"
_WARPS = 16  # NW: one block per SM beside the lookup tables, 16 warps to keep loads in flight
_ROWS_PER_UNIT = 16  # kRowsPerUnit
_DT = HALF_DTYPE_CODES
_GATE_UP_ARGS = loader.ArgPack("kbit_token_gate_up", "x:p ids:p packed:p absmax:p codebook:p tensor_scale:p h:p slots:i "
                                                     "experts:i expert_words:i expert_scales:i inter:i K:i k_tiles:i n_tiles:i")
_DOWN_ARGS = loader.ArgPack("kbit_token_down", "h:p ids:p weights:p packed:p absmax:p codebook:p tensor_scale:p out:p slots:i "
                                               "experts:i expert_words:i expert_scales:i N:i K:i k_tiles:i n_tiles:i")


def _gate_up_depth(bits: int, pairs: bool) -> int:
    """Items of loads in flight per warp in gate_up (two row groups each): 2, but 1 for 5-bit
    planes, whose ring of 2 does not fit in the 128 registers a 512-thread block leaves (spills)."""
    return 1 if bits == 5 and not pairs else 2


_DOWN_DEPTH = 4
_BLOCKS_PER_SM = 1  # __launch_bounds__(512, 1): up to 128 registers x 512 threads fill an SM's 64 K registers


def _gate_up_name(bits: int, dtype: torch.dtype, pairs: bool) -> str:
    return f"kbit_token_gate_up<{bits}, {_DT[dtype]}, {_WARPS}, {_gate_up_depth(bits, pairs)}{layout_arg(pairs)}>"


def _down_name(bits: int, dtype: torch.dtype, weights_f32: bool, pairs: bool) -> str:
    wt = DTYPE_CODES[torch.float32 if weights_f32 else dtype]
    return f"kbit_token_down<{bits}, {_DT[dtype]}, {wt}, {_WARPS}, {_DOWN_DEPTH}{layout_arg(pairs)}>"


def token_instances() -> list[str]:
    """Every kernel instance :func:`experts_one_token_cuda` can launch (for the build check)."""
    names = []
    for bits in fmt.SUPPORTED_BITS:
        for pairs in weight_layouts(bits):
            for dtype in _DT:
                names.append(_gate_up_name(bits, dtype, pairs))
                names += [_down_name(bits, dtype, f32, pairs) for f32 in (False, True)]
    return names


def _smem(bits: int, slots: int) -> tuple[int, int]:
    """Dynamic shared memory of (gate_up, down) blocks: the tables with their alignment padding
    (``TableWindows`` in the kernel), then two buffers of partial-sum slices."""
    gate_up = _TABLE_SMEM[bits] + 2 * _WARPS * 2 * _ROWS_PER_UNIT * 4
    down = _TABLE_SMEM[bits] + 2 * slots * _WARPS * _ROWS_PER_UNIT * 4
    return gate_up, down


def token_kernels_take(x: torch.Tensor, top_k: int, intermediate: int, weights_dtype: torch.dtype, bits: int,
                       any_size: bool = False) -> bool:
    """Whether the one-token kernels run a call with activations ``x`` (on their device),
    ``top_k`` slots, an ``intermediate`` size, routing weights of ``weights_dtype`` and
    ``bits``-bit weights (the blocks' shared memory must fit the GPU), and, unless ``any_size``,
    experts small enough that they beat the grouped path
    (:data:`.tuning.TOKEN_EXPERTS_MAX_GATE_UP_WEIGHTS`)."""
    if not any_size and 2 * intermediate * x.shape[-1] > tuning.TOKEN_EXPERTS_MAX_GATE_UP_WEIGHTS:
        return False
    if not (x.dtype in _DT and x.is_cuda and 1 <= top_k <= MAX_TOP_K and intermediate % _ROWS_PER_UNIT == 0
            and weights_dtype in (torch.float32, x.dtype) and loader.cupy_available()):
        return False
    props = loader.runnable_properties(x.device)
    return props is not None and max(_smem(bits, top_k)) <= props.max_shared_per_block


def _grid(units: int, props: loader.DeviceProperties) -> tuple[int, bool]:
    """A persistent grid for ``units`` (at most one block per SM, all the GPU holds at once), and
    whether it may start while the previous kernel finishes (:func:`loader.grid_may_overlap`)."""
    grid = max(1, min(units, props.sm_count * _BLOCKS_PER_SM))
    return grid, loader.grid_may_overlap(grid, _BLOCKS_PER_SM, props.sm_count)


def experts_one_token_cuda(x, top_k_index, top_k_weights, gate_up_packed, gate_up_absmax, gate_up_codebook, gate_up_tensor_scale,
                           down_packed, down_absmax, down_codebook, down_tensor_scale, bits, intermediate):
    """CUDA ``kbit_linear::experts_one_token`` (spec:
    :func:`kbit_linear._grouped_ops.experts_one_token_composed`): two launches where
    :func:`token_kernels_take`, the composition of the grouped ops elsewhere.

    Raises:
        TypeError / ValueError: bad arguments (named), or tensors not on one device.
    """
    _grouped_ops.check_one_token_args(x, top_k_index, top_k_weights, gate_up_packed, gate_up_absmax, gate_up_codebook,
                                      gate_up_tensor_scale, down_packed, down_absmax, down_codebook, down_tensor_scale, bits,
                                      intermediate)
    args = (x, top_k_index, top_k_weights, gate_up_packed, gate_up_absmax, gate_up_codebook, gate_up_tensor_scale, down_packed,
            down_absmax, down_codebook, down_tensor_scale, bits, intermediate)
    if not token_kernels_take(x, top_k_index.shape[1], intermediate, top_k_weights.dtype, bits):
        return _grouped_ops.compose_one_token(*args)
    return run_token_kernels(*args)


def run_token_kernels(x, top_k_index, top_k_weights, gate_up_packed, gate_up_absmax, gate_up_codebook, gate_up_tensor_scale,
                      down_packed, down_absmax, down_codebook, down_tensor_scale, bits, intermediate):
    """The two launches of ``experts_one_token`` on arguments that passed its checks and that
    :func:`token_kernels_take` with ``any_size`` (tests run experts of any size this way)."""
    top_k, hidden = top_k_index.shape[1], x.shape[1]
    index = loader._device_index(x.device)
    props = loader.device_properties(index)
    stream = loader._current_raw_stream(index)
    xk = kernel_rows(x)  # read in 16-byte pieces: the row padded to a multiple of 8 (the weights' padding is zero)
    ids = top_k_index.reshape(-1).to(torch.int64).contiguous()
    weights = top_k_weights.reshape(-1).contiguous()
    gu_packed, gu_absmax = aligned16(gate_up_packed), aligned16(gate_up_absmax)
    d_packed, d_absmax = aligned16(down_packed), aligned16(down_absmax)
    experts = gu_packed.shape[0]
    h = torch.empty((top_k, intermediate), dtype=x.dtype, device=x.device)  # every row of a slot with an expert is written
    out = torch.empty((1, hidden), dtype=x.dtype, device=x.device)
    smem_gate_up, smem_down = _smem(bits, top_k)

    kernel = loader.get_kernel(_SOURCE, _gate_up_name(bits, x.dtype, fmt.is_pair_codes(gu_packed)), x.device)
    grid, programmatic = _grid(top_k * (intermediate // _ROWS_PER_UNIT), props)
    _GATE_UP_ARGS.launch(
        kernel, grid, smem_gate_up, stream,
        _GATE_UP_ARGS.Values(x=xk.data_ptr(), ids=ids.data_ptr(), packed=gu_packed.data_ptr(), absmax=gu_absmax.data_ptr(),
                             codebook=gate_up_codebook.contiguous().data_ptr(),
                             tensor_scale=gate_up_tensor_scale.contiguous().data_ptr(), h=h.data_ptr(), slots=top_k,
                             experts=experts, expert_words=gu_packed[0].nbytes // 4, expert_scales=gu_absmax[0].numel(),
                             inter=intermediate, K=xk.shape[1], k_tiles=gu_packed.shape[1], n_tiles=gu_packed.shape[2]),
        threads=32 * _WARPS, programmatic=programmatic)

    kernel = loader.get_kernel(_SOURCE, _down_name(bits, x.dtype, weights.dtype == torch.float32, fmt.is_pair_codes(d_packed)),
                               x.device)
    grid, programmatic = _grid(-(-hidden // _ROWS_PER_UNIT), props)
    _DOWN_ARGS.launch(
        kernel, grid, smem_down, stream,
        _DOWN_ARGS.Values(h=h.data_ptr(), ids=ids.data_ptr(), weights=weights.data_ptr(), packed=d_packed.data_ptr(),
                          absmax=d_absmax.data_ptr(), codebook=down_codebook.contiguous().data_ptr(),
                          tensor_scale=down_tensor_scale.contiguous().data_ptr(), out=out.data_ptr(), slots=top_k,
                          experts=experts, expert_words=d_packed[0].nbytes // 4, expert_scales=d_absmax[0].numel(), N=hidden,
                          K=intermediate, k_tiles=d_packed.shape[1], n_tiles=d_packed.shape[2]),
        threads=32 * _WARPS, programmatic=programmatic)
    return out
