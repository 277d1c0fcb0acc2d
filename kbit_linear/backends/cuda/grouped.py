"""The Hopper grouped GEMM of mixture-of-experts layers (``kbit_gemm_sm90_grouped`` in
``kernels/gemm_sm90.cu``): its instances, launch plan and launch.

``kbit_linear::grouped_gemm`` takes it on GPUs of compute capability 9.0 for groups of more than
:data:`~kbit_linear._grouped_ops.DECODE_GROUP_ROWS` rows (prefill, large batches): one persistent
launch over every (group, n-tile, m-tile) of the groups the device holds, so no host sync. The
token tile follows the mean rows per group (the dense kernel's tile choice, :func:`.hopper.token_tile`;
tiles below 64 only up to :data:`.tuning.WGMMA_GROUPED_SMALL_TILE_MAX_MEAN` rows);
the grid is every block the GPU holds at once, or fewer when the items are fewer.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from ... import format as fmt
from . import hopper, loader, plans, tuning

__all__ = ["instance_name", "instances", "GroupedPlan", "token_tile_for", "grouped_plan", "swiglu_fusable", "launch"]

_KERNEL = "kbit_gemm_sm90_grouped"
_ARGS = loader.ArgPack(
    _KERNEL,
    "x_map:m packed:p absmax:p codebook:p tensor_scale:p out:p groups:p count:i experts:i expert_words:i expert_scales:i "
    "x_rows:i N:i n_tiles:i k_tiles:i swiglu:i",
)


def instance_name(bits: int, token_tile: int, dtype: torch.dtype, pairs: bool = False) -> str:
    """The name expression of one instance, e.g. ``"kbit_gemm_sm90_grouped<4, 128, 0>"``."""
    return hopper.instance_name(bits, token_tile, dtype, _KERNEL, pairs)


def instances() -> list[str]:
    """Every instance :func:`launch` can use."""
    return hopper.instances(_KERNEL)


@dataclass(frozen=True)
class GroupedPlan:
    """One grouped problem's launch: the kernel instance, its token tile, grid and shared memory."""

    kernel: Any  # loader.CudaKernel
    token_tile: int
    grid: int
    smem: int
    programmatic: bool


def token_tile_for(rows: int, groups: int, device_name: str) -> int:
    """The token tile of ``rows`` rows in ``groups`` groups on a GPU named ``device_name``: the
    dense table's tile for the mean rows per group (:func:`.hopper.token_tile`), but at least 64
    above :data:`.tuning.WGMMA_GROUPED_SMALL_TILE_MAX_MEAN` rows, where the groups larger than a
    small tile would each take a second m-tile."""
    mean = -(-rows // max(1, groups))
    tile = hopper.token_tile(mean, device_name)
    return 64 if tile < 64 and mean > tuning.WGMMA_GROUPED_SMALL_TILE_MAX_MEAN else tile


def grouped_plan(rows: int, groups: int, bits: int, dtype: torch.dtype, n_tiles: int, device_index: int,
                 token_tile: int | None = None, grid: int | None = None, pairs: bool = False) -> GroupedPlan:
    """The cached plan of ``rows`` rows of x in at most ``groups`` groups of a weight with
    ``n_tiles`` n-tiles (``pairs``: stored as pair codes). ``token_tile`` / ``grid`` force
    those (tests: a grid of one block walks every item).

    Raises:
        ValueError: the GPU is not compute capability 9.0, or a forced value is invalid.
    """
    key = ("grouped-sm90", device_index, rows, groups, bits, dtype, n_tiles, token_tile, grid, pairs)
    plan = plans.lookup(key)
    if plan is not None:
        return plan
    return plans.get_or_make(key, lambda: _make_plan(rows, groups, bits, dtype, n_tiles, device_index, token_tile, grid, pairs))


def _make_plan(rows: int, groups: int, bits: int, dtype: torch.dtype, n_tiles: int, device_index: int, token_tile: int | None,
               grid: int | None, pairs: bool) -> GroupedPlan:
    props = loader.device_properties(device_index)
    if not hopper.supported(device_index):
        raise ValueError(f"the grouped wgmma kernel needs a GPU of compute capability 9.0, cuda:{device_index} is {props.arch}")
    if token_tile is None:
        token_tile = token_tile_for(rows, groups, props.name)
    elif token_tile not in hopper.TOKEN_TILES:
        raise ValueError(f"token_tile must be one of {hopper.TOKEN_TILES}, got {token_tile!r}")
    kernel = loader.get_kernel("gemm_sm90.cu", instance_name(bits, token_tile, dtype, pairs), torch.device("cuda", device_index),
                               hopper.ARCH_OPTIONS)
    hopper.check_registers(kernel, token_tile)
    per_sm = hopper.min_blocks_per_sm(token_tile)
    # Items: sum over groups of ceil(rows_q / tile) * n_tiles <= (ceil(rows / tile) + groups) * n_tiles.
    items = (-(-rows // token_tile) + groups) * n_tiles
    if grid is None:
        grid = max(1, min(items, props.sm_count * per_sm))
    elif isinstance(grid, bool) or not isinstance(grid, int) or grid < 1:
        raise ValueError(f"grid must be a positive int, got {grid!r}")
    return GroupedPlan(kernel, token_tile, grid, hopper.smem_bytes(bits, token_tile),
                       loader.grid_may_overlap(grid, per_sm, props.sm_count))


def swiglu_fusable(n_tiles: int, intermediate: int) -> bool:
    """Whether the kernel fuses ``silu(gate) * up`` for a gate_up weight of ``n_tiles`` n-tiles:
    the gate half must end on an n-tile boundary (``intermediate`` a multiple of 128)."""
    return intermediate % fmt.TILE_N == 0 and n_tiles * fmt.TILE_N == 2 * intermediate


def launch(plan: GroupedPlan, x: torch.Tensor, packed: torch.Tensor, absmax: torch.Tensor, codebook: torch.Tensor,
           tensor_scale: torch.Tensor, groups: torch.Tensor, out: torch.Tensor, swiglu: bool = False) -> None:
    """Write ``x[rows of q] @ W[expert of q]^T * tensor_scale[expert]`` into ``out[rows of q]``
    for every group q, in one launch; other rows of ``out`` are left as they are. With
    ``swiglu`` (:func:`swiglu_fusable` holds) ``out`` is ``[R, intermediate]`` and gets
    ``silu(gate) * up`` of those products.

    The tensors meet the grouped op's checks already (``kbit_linear::grouped_gemm``) and are
    contiguous: ``x [R, K]`` fp16/bf16 with K a multiple of 8 and 16-byte aligned, ``packed
    [E, K_pad/64, N_pad/128, 128, 2, bits]`` (or uint8 pair codes, the plan's layout), ``absmax
    [E, ...]``, 16-byte aligned,
    ``tensor_scale [E]``, ``groups`` int32 ``[3, G]``, ``out [R, N]`` of x's dtype.
    """
    dev = x.get_device()
    rows, k = x.shape
    x_map = hopper.activation_map(x.data_ptr(), rows, k, plan.token_tile)  # held until the launch returns
    _ARGS.launch(
        plan.kernel, plan.grid, plan.smem, loader._current_raw_stream(dev),
        (x_map[1], packed.data_ptr(), absmax.data_ptr(), codebook.data_ptr(), tensor_scale.data_ptr(), out.data_ptr(),
         groups.data_ptr(), groups.shape[1], packed.shape[0], packed[0].nbytes // 4, absmax[0].numel(), rows, out.shape[1],
         packed.shape[2], packed.shape[1], int(swiglu)),
        threads=hopper.THREADS,
        programmatic=plan.programmatic,
    )
