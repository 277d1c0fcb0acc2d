"""Host-side facts of the Hopper warpgroup-MMA GEMM (``kernels/gemm_sm90.cu``).

The kernel is built for ``sm_90a`` only (wgmma has no other target; Blackwell and newer run the
mma.sync kernel instead). This module names its template instances, mirrors its shared-memory
size (``Shape<BITS, BT>::SMEM_BYTES``; ``tests/test_kernels_compile.py`` checks the mirror against
the kernel), says which GPUs can run it and builds the tensor map of the activations that its
copies read x through. The dispatcher in :mod:`.ops` plans its launches.
"""

from __future__ import annotations

import ctypes
import threading

import torch

from ... import format as fmt
from . import driver, loader, tuning
from .tensors import HALF_DTYPE_CODES, layout_arg, weight_layouts

__all__ = [
    "ARCH_OPTIONS",
    "TOKEN_TILES",
    "supported",
    "instance_name",
    "instances",
    "token_tile",
    "smem_bytes",
    "accumulators",
    "min_blocks_per_sm",
    "launch_registers",
    "check_registers",
    "THREADS",
    "activation_map",
]

THREADS = 384
"""Threads per block: two consumer warpgroups and the producer warpgroup (``kThreads``)."""

ARCH_OPTIONS = ("-arch=sm_90a",)
"""NVRTC options of every instance (CuPy's own ``-arch=sm_90`` comes after and does not override it)."""

TOKEN_TILES = (16, 32, 64, 128, 256)
"""The token tiles (wgmma's N, the BT template argument) the kernel is instantiated for."""

_DT = HALF_DTYPE_CODES
_TILE_N, _TILE_K = fmt.TILE_N, fmt.TILE_K


def supported(device_index: int) -> bool:
    """Whether GPU ``device_index`` runs the kernel: compute capability 9.0 exactly (H100, H200, GH200)."""
    return loader.device_properties(device_index).capability == (9, 0)


def instance_name(bits: int, token_tile: int, dtype: torch.dtype, kernel: str = "kbit_gemm_sm90", pairs: bool = False) -> str:
    """The name expression of one instance, e.g. ``"kbit_gemm_sm90<4, 128, 0>"``; ``kernel``:
    ``"kbit_gemm_sm90_grouped"`` for the grouped form (same template parameters); ``pairs``: the
    weight holds pair codes (4 or 5 bits)."""
    return f"{kernel}<{bits}, {token_tile}, {_DT[dtype]}{layout_arg(pairs)}>"


def instances(kernel: str = "kbit_gemm_sm90") -> list[str]:
    """Every instance of ``kernel`` (the dense or the grouped form) the dispatcher can launch."""
    return [instance_name(b, bt, dt, kernel, pairs) for b in fmt.SUPPORTED_BITS for pairs in weight_layouts(b) for bt in TOKEN_TILES
            for dt in _DT]


def token_tile(m: int, device_name: str) -> int:
    """The token tile a problem of ``m`` rows takes on a GPU named ``device_name``: the first of
    :data:`.tuning.WGMMA_TOKEN_TILES` whose row limit holds ``m``."""
    for tile, max_m in tuning.wgmma_token_tiles(device_name):
        if m <= max_m:
            return tile
    return TOKEN_TILES[-1]


def _tiles_per_stage(token_tile: int) -> int:
    return 2 if token_tile <= 64 else 1


def _stages(token_tile: int) -> int:
    return 5 if token_tile == 256 else 6 // _tiles_per_stage(token_tile)


def smem_bytes(bits: int, token_tile: int) -> int:
    """Dynamic shared memory of an instance (mirrors ``Shape::SMEM_BYTES``)."""
    sub = token_tile * _TILE_K * 2 + _TILE_N * 2 * bits * 4 + _TILE_N * 2
    stage = -(-sub // 1024) * 1024 * _tiles_per_stage(token_tile)
    lut = (1 << (2 * bits)) * 32 * 4 if bits <= 4 else 0
    barriers = 2 * _stages(token_tile) * 8
    return _stages(token_tile) * stage + lut + 256 * 4 + barriers + 16 + 1024


def accumulators(token_tile: int) -> int:
    """fp32 accumulators per thread (``Shape::NACC``): the split-K workspace holds 256 of them per slot."""
    return token_tile // 2


def min_blocks_per_sm(token_tile: int) -> int:
    """Blocks per SM the kernel's register budget is sized for (``Shape::MIN_BLOCKS``)."""
    return 2 if token_tile <= 64 else 1


def launch_registers(token_tile: int) -> int:
    """Registers per thread the kernel must be launched with (``Shape::LAUNCH_REGS``): its
    warpgroups trade registers with setmaxnreg inside this allocation, sized for it."""
    return 65536 // (min_blocks_per_sm(token_tile) * THREADS) // 8 * 8


def check_registers(kernel: loader.CudaKernel, token_tile: int) -> None:
    """Refuse an instance whose register count differs from :func:`launch_registers`: its
    consumers' setmaxnreg increase would wait forever for registers the block does not have."""
    if kernel.num_regs != launch_registers(token_tile):
        raise RuntimeError(f"{kernel.name} was compiled with {kernel.num_regs} registers per thread, expected "
                           f"{launch_registers(token_tile)}: this compiler does not allocate the cap __launch_bounds__ sets")



_MAPS_KEPT = 1024
_maps: dict[tuple[int, int, int, int], tuple[ctypes.Array, int]] = {}
_maps_lock = threading.Lock()


def activation_map(x_address: int, rows: int, cols: int, token_tile: int) -> tuple[ctypes.Array, int]:
    """The tensor map the kernel reads ``x [rows, cols]`` through: ``(host buffer, address of the
    map in it)``. ``x`` is 16-bit, row-major and contiguous (row stride ``cols``) at ``x_address``;
    a copy moves a box of ``token_tile`` rows x 64 columns with the 128-byte swizzle, zeros
    outside the tensor.

    For a contiguous tensor the map depends only on these four numbers, so maps are kept per
    (address, rows, cols, tile) and a forward pass that reuses its activation buffers encodes
    each once. The launch copies the map into the kernel's parameters; the caller holds the
    returned buffer until the launch has returned (another thread may drop it from the cache).
    """
    key = (x_address, rows, cols, token_tile)
    buf = _maps.get(key)
    if buf is None:
        raw = ctypes.create_string_buffer(driver.TENSOR_MAP_BYTES + 64)
        address = (ctypes.addressof(raw) + 63) // 64 * 64
        driver.encode_tensor_map_2d(address, x_address, rows, cols, token_tile, _TILE_K)
        with _maps_lock:
            if len(_maps) >= _MAPS_KEPT:
                _maps.clear()
            _maps[key] = buf = (raw, address)
    return buf
