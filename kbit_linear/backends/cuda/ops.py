"""CUDA implementations of the kbit ops (kernels in ``kernels/``, compiled at run time).

Importing this module registers ``torch.library`` CUDA kernels for ``kbit_linear::quantize``,
``::repack``, ``::dequantize``, ``::gemm``, ``::grouped_gemm``, ``::grouped_swiglu``,
``::combine_experts``, ``::route_experts`` and ``::experts_one_token``. It needs neither CuPy nor a GPU to import: CuPy
is loaded, and each kernel instance compiled, on the first call that needs it
(:mod:`.loader`).

GEMM paths (:func:`gemm_path` names the one a problem takes):

* ``"decode"``: the small-M kernel of :mod:`.decode`, when it supports the problem and M is at most :data:`.tuning.DECODE_MAX_M` for the GPU (a smaller
  limit for weights of :data:`.tuning.DECODE_LARGE_WEIGHT` elements or more);
* ``"wgmma"`` / ``"wgmma-splitk"``: ``kernels/gemm_sm90.cu`` (:mod:`.hopper`), GPUs of compute
  capability 9.0 only (H100, H200): the weights dequantized into registers as the A operand of
  Hopper's warpgroup MMA; for the rows :data:`.tuning.WGMMA_ROWS` names;
* ``"fused"`` / ``"fused-splitk"``: ``kernels/gemm.cu``, dequantization fused into an mma.sync
  GEMM (every other GPU); "-splitk" when some output tiles are reduced over several blocks;
* ``"dequant+cublas"``: ``kernels/quantize.cu``'s dequantize kernel writes the dense weight in
  x's dtype, then ``F.linear`` (cuBLAS) multiplies. Taken from :data:`.tuning.DEQUANT_CUBLAS_MIN_M`
  rows on (above the wgmma kernel's rows on sm_90), where cuBLAS's tensor-core GEMM beats the
  fused kernels; it needs a temporary dense weight (``N * K`` elements).

Activations: fp16 and bf16 run as they are; any other floating dtype (fp32) is cast to bf16
(same range as fp32) and the result cast back. ``in_features`` that is not a multiple of 8 is
zero-padded to one on the host (a copy of x per call: a slow path for rare shapes).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

import torch

from ... import _grouped_ops  # the grouped GEMM's schema and reference
from ... import _ops  # defines the op schemas before the registrations below
from ... import format as fmt
from . import decode, experts, experts_token, grouped, hopper, loader, plans, routing, tuning, workspace
from .tensors import DTYPE_CODES, aligned16, kernel_rows, layout_arg, weight_layouts

__all__ = [
    "GEMM_PATHS",
    "gemm_path",
    "gemm_cuda",
    "gemm_instances",
    "format_instances",
]

GEMM_PATHS = ("fused", "fused-splitk", "wgmma", "wgmma-splitk", "dequant+cublas", "decode")

_THREADS = 256
_TILE_N = fmt.TILE_N
_TILE_K = fmt.TILE_K
_STAGES = 4
_DT = DTYPE_CODES
_ACT_DTYPES = frozenset((torch.float16, torch.bfloat16, torch.float32, torch.float64))
_BITS = frozenset(fmt.SUPPORTED_BITS)
_CB_SHAPES = {b: torch.Size([1 << b]) for b in fmt.SUPPORTED_BITS}
# packed's last dimension by (pair codes?, bits); pair codes exist at 4 and 5 bits (-1: never matches)
_BLOCK_ENTRIES = {False: {b: b for b in fmt.SUPPORTED_BITS},
                  True: {b: fmt.PAIR_CODE_BYTES.get(b, -1) for b in fmt.SUPPORTED_BITS}}
_GEMM_ARGS_SPEC = "x:p packed:p absmax:p codebook:p tensor_scale:p bias:p out:p workspace:p counters:p M:i N:i K:i n_tiles:i k_tiles:i iters:i"
_GEMM_ARGS = loader.ArgPack("kbit_gemm", _GEMM_ARGS_SPEC)
# The wgmma kernel reads x through a tensor map (passed by value) instead of a pointer.
_SM90_ARGS = loader.ArgPack("kbit_gemm_sm90", _GEMM_ARGS_SPEC.replace("x:p", "x_map:m", 1))
_QUANT_ARGS = loader.ArgPack("kbit_quantize", "w:p codebook:p tensor_scale:p packed_flat:p absmax_flat:p N:i K:i nblk:i")
_REPACK_ARGS = loader.ArgPack("kbit_repack", "packed_flat:p absmax_flat:p packed:p absmax:p N:i nblk:i n_tiles:i k_tiles:i")
_DEQUANT_ARGS = loader.ArgPack("kbit_dequantize", "packed:p absmax:p codebook:p tensor_scale:p out:p N:i K:i n_tiles:i k_tiles:i")
# (row, span of 4 k-tiles) items per warp of the dequantize kernel: kDequantItems in kernels/quantize.cu
DEQUANT_WARP_ITEMS = 4


# ---------------------------------------------------------------------------------------
# kernel instances
# ---------------------------------------------------------------------------------------


def _gemm_name(bits: int, mb: int, dtype: torch.dtype, pairs: bool = False) -> str:
    return f"kbit_gemm<{bits}, {mb}, {_DT[dtype]}{layout_arg(pairs)}>"


def _dequantize_name(bits: int, dtype: torch.dtype, pairs: bool = False) -> str:
    return f"kbit_dequantize<{bits}, {_DT[dtype]}{layout_arg(pairs)}>"


def gemm_instances() -> list[str]:
    """Every GEMM template instance the dispatcher can launch (name expressions in ``gemm.cu``)."""
    return [_gemm_name(b, mb, dt, pairs) for b in fmt.SUPPORTED_BITS for pairs in weight_layouts(b) for mb in tuning.FUSED_ROW_BLOCKS
            for dt in (torch.float16, torch.bfloat16)]


def format_instances() -> list[str]:
    """Every quantize/repack/dequantize instance (name expressions in ``quantize.cu``)."""
    names = []
    for b in fmt.SUPPORTED_BITS:
        names += [f"kbit_quantize<{b}, {d}>" for d in range(3)]
        names.append(f"kbit_repack<{b}>")
        names += [_dequantize_name(b, dt, pairs) for pairs in weight_layouts(b) for dt in _DT]
    return names


def _gemm_smem(bits: int, mb: int) -> int:
    """Bytes of dynamic shared memory of ``kbit_gemm<bits, mb, *>`` (mirrors GemmShape in gemm.cu)."""
    stage = 16 * mb * _TILE_K * 2 + _TILE_N * 2 * bits * 4 + _TILE_N * 2
    lut = (1 << (2 * bits)) * 32 * 4 if bits <= 4 else 0
    return _STAGES * stage + lut + 256 * 4 + 16


def _gemm_nacc(mb: int) -> int:
    wm = 2 if mb >= 8 else 1
    fm, fn = mb // wm, _TILE_N // (8 * (8 // wm))
    return fm * fn * 4


def _pick_mb(m: int) -> int:
    for mb in tuning.FUSED_ROW_BLOCKS:
        if m <= 16 * mb:
            return mb
    return tuning.FUSED_ROW_BLOCKS[-1]


# ---------------------------------------------------------------------------------------
# planning (cached per problem)
# ---------------------------------------------------------------------------------------


@dataclass
class _GemmPlan:
    path: str
    kernel: Any = None  # loader.CudaKernel for the fused and wgmma paths
    args: Any = None  # its loader.ArgPack
    grid: int = 0
    smem: int = 0
    iters: int = 0
    ws_numel: int = 0
    tiles: int = 0
    split: bool = False
    programmatic: bool = False  # may overlap the previous kernel (loader.grid_may_overlap)
    decode: Any = None  # decode.DecodePlan for the decode path
    threads: int = _THREADS
    token_tile: int = 0  # wgmma: rows of x per tile (its tensor map's box)
    cluster: int = 1  # wgmma: blocks per thread block cluster (an aligned split summed in shared memory)


def _occupancy(kernel: loader.CudaKernel, smem: int, props: loader.DeviceProperties, threads: int = _THREADS) -> int:
    """Resident blocks per SM, from shared memory and registers."""
    by_smem = max(1, props.shared_per_sm // (smem + 1024))
    regs_per_warp = -(-max(kernel.num_regs, 1) * 32 // 256) * 256
    by_regs = max(1, 65536 // (regs_per_warp * (threads // 32)))
    return max(1, min(by_smem, by_regs, 2048 // threads))


def _stream_k_iters(total: int, slots: int, k_tiles: int) -> int:
    """k-iterations per block of a stream-K grid over ``slots`` blocks: equal ranges, none shorter
    than the pipeline fill is worth (:data:`.tuning.FUSED_MIN_SPLIT_ITERS`)."""
    return max(-(-total // slots), min(k_tiles, tuning.FUSED_MIN_SPLIT_ITERS))


def _plan_stream_k(path: str, kernel: loader.CudaKernel, args: loader.ArgPack, smem: int, nacc: int, tiles: int, k_tiles: int,
                   device_index: int, split_k: int | None, force_split: bool, threads: int = _THREADS,
                   unsplit_min_wave_fill: float | None = None, stream_k: bool = False) -> _GemmPlan:
    """Launch plan of a stream-K tensor-core kernel (gemm.cu, gemm_sm90.cu): the k-iterations
    per block, the grid, and the split-K workspace (``nacc`` fp32 accumulators per thread).
    Whole tiles (no split) from four waves of them, or, given ``unsplit_min_wave_fill``, from one
    wave where the last wave is at least that full; ``stream_k``: equal ranges over every block
    slot whatever the tiles."""
    props = loader.device_properties(device_index)
    total = tiles * k_tiles
    per_sm = _occupancy(kernel, smem, props, threads)
    slots = props.sm_count * per_sm
    waves = -(-tiles // slots)
    if split_k is None and force_split:
        split_k = max(2, min(k_tiles, -(-slots // tiles)))
    if split_k is not None:
        iters = k_tiles if split_k <= 1 else max(1, -(-k_tiles // split_k))
    elif not stream_k and (tiles >= 4 * slots or k_tiles == 1 or (
        unsplit_min_wave_fill is not None and tiles >= unsplit_min_wave_fill * waves * slots
    )):
        iters = k_tiles
    else:
        iters = _stream_k_iters(total, slots, k_tiles)
    grid = -(-total // iters)
    split = iters % k_tiles != 0
    ws = grid * 2 * 256 * nacc if split else 0  # 256 accumulating threads in both kernels
    return _GemmPlan(path + "-splitk" if split else path, kernel, args, grid, smem, iters, ws, tiles, split,
                     loader.grid_may_overlap(grid, per_sm, props.sm_count), threads=threads)


def _plan_fused(m: int, n_tiles: int, k_tiles: int, bits: int, dtype: torch.dtype, device_index: int, split_k: int | None,
                force_split: bool, pairs: bool) -> _GemmPlan:
    mb = _pick_mb(m)
    kernel = loader.get_kernel("gemm.cu", _gemm_name(bits, mb, dtype, pairs), torch.device("cuda", device_index))
    tiles = -(-m // (16 * mb)) * n_tiles
    return _plan_stream_k("fused", kernel, _GEMM_ARGS, _gemm_smem(bits, mb), _gemm_nacc(mb), tiles, k_tiles, device_index, split_k,
                          force_split)


def _wgmma_options(m: int, n_tiles: int, k_tiles: int, bits: int, token_tile: int, sm_count: int) -> list[tuple[float, int | None]]:
    """The plans of the time model of :data:`.tuning.WGMMA_KTILE_US` for one token tile, as
    ``(microseconds, split_k)``: ``split_k`` s for K cut into s equal pieces (1: unsplit), None
    for stream-K. Empty where the tile's grid has more tiles than resident blocks (the rules of
    :func:`_plan_stream_k` apply there)."""
    tiles = -(-m // token_tile) * n_tiles
    slots = hopper.min_blocks_per_sm(token_tile) * sm_count
    if tiles > slots:
        return []
    ktile = tuning.WGMMA_KTILE_US[bits][token_tile]
    base, per_split = tuning.WGMMA_FIXUP_US[token_tile]
    in_cluster = tuning.WGMMA_CLUSTER_FIXUP_US[token_tile]
    options: list[tuple[float, int | None]] = []
    for s in range(1, min(k_tiles, slots // tiles) + 1):
        if k_tiles % s:
            continue
        time = ktile * k_tiles / s * (1.0 if tiles * s <= sm_count else tuning.WGMMA_TWO_PER_SM)
        if s > 1:
            clustered = _clusters_allowed(s, token_tile, tiles * s, sm_count) and s in in_cluster
            time += in_cluster[s] if clustered else base + per_split * s
        options.append((time, s))
    iters = _stream_k_iters(tiles * k_tiles, slots, k_tiles)
    pieces = -(-k_tiles // iters)
    fixup = base + per_split * pieces if k_tiles % iters == 0 else 2 * (base + per_split * (pieces + 1))
    options.append((ktile * tuning.WGMMA_STREAM_K[token_tile] * iters + fixup, None))
    return options


def _wgmma_token_tiles(m: int, device_name: str) -> list[int]:
    """The token tiles the planner weighs for ``m`` rows: the table's tile for ``m``
    (:func:`.hopper.token_tile`) and its neighbours among the tiles the table lists (with the
    largest tile where some M runs past every limit)."""
    table = tuning.wgmma_token_tiles(device_name)
    listed = {tile for tile, _ in table}
    if table[-1][1] < 1 << 30:
        listed.add(hopper.TOKEN_TILES[-1])
    own = hopper.token_tile(m, device_name)
    return [t for t in (own // 2, own, own * 2) if t in listed]


def _wgmma_choice(m: int, n_tiles: int, k_tiles: int, bits: int, sm_count: int, device_name: str) -> tuple[int, int | None, bool]:
    """``(token tile, split_k, stream-K)`` for an automatic wgmma plan: the cheapest of
    :func:`_wgmma_options` over :func:`_wgmma_token_tiles`, or the table's tile with the rules of
    :func:`_plan_stream_k` where the model covers no tile."""
    best: tuple[float, int, int | None] | None = None
    for tile in _wgmma_token_tiles(m, device_name):
        for time, split in _wgmma_options(m, n_tiles, k_tiles, bits, tile, sm_count):
            if best is None or time < best[0]:
                best = (time, tile, split)
    if best is None:
        return hopper.token_tile(m, device_name), None, False
    return best[1], best[2], best[2] is None


def _plan_wgmma(m: int, n_tiles: int, k_tiles: int, bits: int, dtype: torch.dtype, device_index: int, split_k: int | None,
                force_split: bool, pairs: bool) -> _GemmPlan:
    props = loader.device_properties(device_index)
    if not hopper.supported(device_index):
        raise ValueError(f"the wgmma path needs a GPU of compute capability 9.0, cuda:{device_index} is {props.arch}")
    stream_k = False
    if split_k is None and not force_split:
        bt, split_k, stream_k = _wgmma_choice(m, n_tiles, k_tiles, bits, props.sm_count, props.name)
    else:
        bt = hopper.token_tile(m, props.name)
    kernel = loader.get_kernel("gemm_sm90.cu", hopper.instance_name(bits, bt, dtype, pairs=pairs), torch.device("cuda", device_index),
                               hopper.ARCH_OPTIONS)
    hopper.check_registers(kernel, bt)
    tiles = -(-m // bt) * n_tiles
    plan = _plan_stream_k("wgmma", kernel, _SM90_ARGS, hopper.smem_bytes(bits, bt), hopper.accumulators(bt), tiles, k_tiles,
                          device_index, split_k, force_split, hopper.THREADS, tuning.WGMMA_UNSPLIT_MIN_WAVE_FILL, stream_k)
    plan.token_tile = bt
    plan.cluster = _wgmma_cluster(plan, k_tiles, bt, props.sm_count,
                                  lambda parts: kernel.max_active_clusters(parts, hopper.THREADS, plan.smem))
    return plan


def _clusters_allowed(parts: int, token_tile: int, grid: int, sm_count: int) -> bool:
    """Whether a split into ``parts`` pieces may run as clusters, before the driver's count: P in
    :data:`.tuning.WGMMA_CLUSTER_SPLITS` dividing the token groups, and for P > 2 a grid of at
    most :data:`.tuning.WGMMA_LARGE_CLUSTER_GRID_SHARE` of the SM count in blocks."""
    if parts not in tuning.WGMMA_CLUSTER_SPLITS or (token_tile // 8) % parts:
        return False
    return parts == 2 or grid <= tuning.WGMMA_LARGE_CLUSTER_GRID_SHARE * sm_count


def _wgmma_cluster(plan: _GemmPlan, k_tiles: int, token_tile: int, sm_count: int, resident_clusters: Callable[[int], int]) -> int:
    """Blocks per cluster for a wgmma plan: P where the plan cuts every tile's K into P equal
    pieces, :func:`_clusters_allowed` says yes and the GPU runs all the grid's clusters at once
    (``resident_clusters(P)``); the kernel then sums each tile in the shared memory of its P
    blocks. Else 1 (no clusters; split tiles meet in the workspace)."""
    if not plan.split or k_tiles % plan.iters:
        return 1
    parts = k_tiles // plan.iters
    if not _clusters_allowed(parts, token_tile, plan.grid, sm_count):
        return 1
    return parts if plan.grid <= parts * resident_clusters(parts) else 1


def _plan(m: int, n: int, k: int, bits: int, dtype: torch.dtype, device_index: int, path: str | None, split_k: int | None,
          pairs: bool = False) -> _GemmPlan:
    """The cached plan of a problem (``k`` a multiple of 8: x's row length as the kernels see it;
    ``pairs``: the weight holds pair codes)."""
    key = ("gemm", device_index, m, n, k, bits, dtype, path, split_k, pairs)
    plan = plans.lookup(key)
    if plan is not None:
        return plan
    if path is not None and path not in GEMM_PATHS:
        raise ValueError(f"path must be one of {GEMM_PATHS} or None, got {path!r}")
    if split_k is not None and (isinstance(split_k, bool) or not isinstance(split_k, int) or split_k < 1):
        raise ValueError(f"split_k must be a positive int or None, got {split_k!r}")
    return plans.get_or_make(key, lambda: _make_plan(m, n, k, bits, dtype, device_index, path, split_k, pairs))


def _within(m: int, rows: tuple[int, int]) -> bool:
    return rows[0] <= m <= rows[1]


def _make_plan(m: int, n: int, k: int, bits: int, dtype: torch.dtype, device_index: int, path: str | None, split_k: int | None,
               pairs: bool = False) -> _GemmPlan:
    n_pad, k_pad = fmt.padded_shape(n, k)
    n_tiles, k_tiles = n_pad // _TILE_N, k_pad // _TILE_K
    gpu = loader.device_properties(device_index).name
    if path is None:
        if m <= tuning.decode_max_m(gpu, n * k) and decode.decode_supported(m, bits, dtype, device_index):
            path = "decode"
        elif hopper.supported(device_index) and _within(m, tuning.wgmma_rows(gpu, n * k, bits, pairs)):
            path = "wgmma"
        elif m >= tuning.dequant_cublas_min_m(gpu, bits):
            path = "dequant+cublas"
        else:
            path = "fused"
    if path == "decode":  # decode_plan refuses a problem the kernel does not support
        return _GemmPlan("decode", decode=decode.decode_plan(m, bits, dtype, n, k_tiles, device_index, pairs=pairs))
    if path == "dequant+cublas":
        return _GemmPlan("dequant+cublas")
    if path in ("wgmma", "wgmma-splitk"):
        return _plan_wgmma(m, n_tiles, k_tiles, bits, dtype, device_index, split_k, path == "wgmma-splitk", pairs)
    return _plan_fused(m, n_tiles, k_tiles, bits, dtype, device_index, split_k, path == "fused-splitk", pairs)


def gemm_path(m: int, n: int, k: int, bits: int, dtype: torch.dtype, device: torch.device | str | int | None = None,
              pairs: bool | None = None) -> str:
    """Name of the kernel path ``torch.ops.kbit_linear.gemm`` takes for a problem.

    Args:
        m: rows of x (all leading dims multiplied).
        n: out_features.
        k: in_features.
        bits: index width, 2..5.
        dtype: x's dtype (fp32 runs as bf16).
        device: the CUDA device (default: the current one).
        pairs: the weight held as pair codes (True) or bit-planes (False); default: the layout
            a layer holds on the GPU (pair codes at 4 and 5 bits).

    Returns:
        One of :data:`GEMM_PATHS`. Compiles the tensor-core kernel instance if needed (to read
        its register count for the occupancy estimate).
    """
    fmt.check_bits(bits)
    for name, v in (("m", m), ("n", n), ("k", k)):
        if isinstance(v, bool) or not isinstance(v, int) or v < 1:
            raise ValueError(f"{name} must be a positive int, got {v!r}")
    dev = _as_device(device)
    kdtype = dtype if dtype in (torch.float16, torch.bfloat16) else torch.bfloat16
    if pairs is None:
        pairs = fmt.has_pair_codes(bits)
    elif pairs and not fmt.has_pair_codes(bits):
        raise ValueError(f"pairs=True: {bits}-bit weights have no pair codes")
    return _plan(m, n, -(-k // 8) * 8, bits, kdtype, dev.index, None, None, bool(pairs)).path


def _as_device(device: torch.device | str | int | None) -> torch.device:
    if device is None:
        return torch.device("cuda", torch.cuda.current_device())
    dev = torch.device("cuda", device) if isinstance(device, int) else torch.device(device)
    if dev.type != "cuda":
        raise ValueError(f"device must be a CUDA device, got {dev}")
    return dev if dev.index is not None else torch.device("cuda", torch.cuda.current_device())


# ---------------------------------------------------------------------------------------
# GEMM
# ---------------------------------------------------------------------------------------


def _check_gemm(x: torch.Tensor, packed: torch.Tensor, absmax: torch.Tensor, codebook: torch.Tensor, tensor_scale: torch.Tensor, bits: int, out_features: int, bias: torch.Tensor | None) -> None:
    """Cheap (metadata-only) argument checks for :func:`gemm_cuda`."""
    if not isinstance(x, torch.Tensor) or not x.is_floating_point():
        raise TypeError(f"x must be a floating-point torch.Tensor, got {getattr(x, 'dtype', type(x).__name__)}")
    if x.device.type != "cuda":
        raise ValueError(f"x must be on a CUDA device, got {x.device}")
    _ops.check_gemm_args(x, packed, absmax, codebook, tensor_scale, bits, out_features, bias)
    if bias is not None and not bias.is_floating_point():
        raise TypeError(f"bias must be floating point, got {bias.dtype}")


def gemm_cuda(
    x: torch.Tensor,
    packed: torch.Tensor,
    absmax: torch.Tensor,
    codebook: torch.Tensor,
    tensor_scale: torch.Tensor,
    bits: int,
    out_features: int,
    bias: torch.Tensor | None = None,
    *,
    path: str | None = None,
    split_k: int | None = None,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """``x @ W^T (+ bias)`` on the GPU for a tiled kbit weight.

    Args:
        x: ``[..., in_features]`` floating point, on a CUDA device (fp16/bf16 natively; others
            run in bf16).
        packed: int32 ``[K_pad/64, N_pad/128, 128, 2, bits]`` bit-planes, or at 4 / 5 bits uint8
            ``[..., 16]`` / ``[..., 20]`` pair codes (``kbit_linear.format.to_pair_codes``).
        absmax: uint8 ``[K_pad/64, N_pad/128, 128, 2]`` E4M4 codes.
        codebook: float32 ``[2**bits]``.
        tensor_scale: float32 ``[1]``.
        bits: 2..5.
        out_features: N (``N_pad - 128 < N <= N_pad``).
        bias: optional ``[N]``.
        path: force a path from :data:`GEMM_PATHS` (None: dispatch by M).
        split_k: fused and wgmma paths only: None = automatic, 1 = never split a tile over blocks,
            s > 1 = split each tile's K range over about s blocks.
        out: optional contiguous ``[..., out_features]`` tensor of x's dtype to write into
            (tests pass a NaN-filled one to catch unwritten elements).

    Returns:
        ``[..., out_features]`` in x's dtype (``out`` when given).
    """
    # The checks below are plain attribute reads (torch._check costs ~1 us each); on any
    # failure the full checker runs to raise the error that names the problem.
    ps = packed.shape if isinstance(packed, torch.Tensor) else ()
    xs = x.shape if isinstance(x, torch.Tensor) else ()
    dev_index = x.get_device() if xs else -1
    if not (
        xs
        and x.dtype in _ACT_DTYPES
        and bits in _BITS
        and (packed.dtype is torch.int32 or packed.dtype is torch.uint8)
        and absmax.dtype is torch.uint8
        and codebook.dtype is torch.float32
        and tensor_scale.dtype is torch.float32
        and len(ps) == 5 and ps[2] == _TILE_N and ps[3] == 2 and ps[4] == _BLOCK_ENTRIES[packed.dtype is torch.uint8][bits]
        and absmax.shape == ps[:4]
        and codebook.shape == _CB_SHAPES[bits]
        and tensor_scale.numel() == 1
        and ps[0] * _TILE_K - _TILE_K < xs[-1] <= ps[0] * _TILE_K
        and ps[1] * _TILE_N - _TILE_N < out_features <= ps[1] * _TILE_N
        and dev_index >= 0
        and packed.get_device() == dev_index and absmax.get_device() == dev_index
        and codebook.get_device() == dev_index and tensor_scale.get_device() == dev_index
        and (bias is None or (bias.shape == (out_features,) and bias.get_device() == dev_index and bias.is_floating_point()))
    ):
        _check_gemm(x, packed, absmax, codebook, tensor_scale, bits, out_features, bias)
        raise ValueError("invalid arguments to kbit_linear gemm")  # pragma: no cover (the checker raises first)
    k = xs[-1]
    in_dtype = x.dtype
    x2d = x.reshape(-1, k) if len(xs) != 2 else x
    m = x2d.shape[0]
    if out is not None:
        if out.shape != (*xs[:-1], out_features) or out.dtype != in_dtype or out.get_device() != dev_index or not out.is_contiguous():
            raise ValueError(
                f"out must be a contiguous {in_dtype} tensor of shape {(*xs[:-1], out_features)} on {x.device}, "
                f"got {out.dtype} {tuple(out.shape)} on {out.device}"
            )
    if m == 0:
        return out if out is not None else x.new_empty((*xs[:-1], out_features))
    dtype = in_dtype if in_dtype is torch.float16 or in_dtype is torch.bfloat16 else torch.bfloat16
    if dtype is not in_dtype:
        x2d = x2d.to(dtype)
    if k % 8 or x2d.data_ptr() % 16 or not x2d.is_contiguous():
        x2d = kernel_rows(x2d)
        k = x2d.shape[1]
    if packed.data_ptr() % 16 or absmax.data_ptr() % 16 or not (packed.is_contiguous() and absmax.is_contiguous()):
        packed, absmax = aligned16(packed), aligned16(absmax)
    if not codebook.is_contiguous():
        codebook = codebook.contiguous()
    if bias is not None and (bias.dtype is not dtype or not bias.is_contiguous()):
        bias = bias.to(dtype).contiguous()
    pairs = packed.dtype is torch.uint8
    plan = plans.lookup(("gemm", dev_index, m, out_features, k, bits, dtype, path, split_k, pairs))
    if plan is None:
        plan = _plan(m, out_features, k, bits, dtype, dev_index, path, split_k, pairs)

    user_out = out
    if out is not None and dtype is in_dtype:
        out = out.view(m, out_features)
    else:
        out = x2d.new_empty((m, out_features))
    if plan.kernel is not None:  # fused or wgmma (both leave the counters zero, so they share the scratch)
        stream = loader._current_raw_stream(dev_index)
        ws_ptr = cnt_ptr = 0
        if plan.split and plan.cluster == 1:
            ws_ptr, cnt_ptr = workspace.zeroed_scratch("fused", dev_index, stream, plan.ws_numel, plan.tiles)
        # x: a pointer (mma.sync kernel) or the address of its tensor map (wgmma kernel; x_map keeps
        # the map's buffer alive until the launch has copied it)
        x_map = None if plan.token_tile == 0 else hopper.activation_map(x2d.data_ptr(), m, k, plan.token_tile)
        x_arg = x2d.data_ptr() if x_map is None else x_map[1]
        plan.args.launch(
            plan.kernel, plan.grid, plan.smem, stream,
            (x_arg, packed.data_ptr(), absmax.data_ptr(), codebook.data_ptr(), tensor_scale.data_ptr(),
             0 if bias is None else bias.data_ptr(), out.data_ptr(), ws_ptr, cnt_ptr, m, out_features, k, ps[1], ps[0], plan.iters),
            threads=plan.threads,
            programmatic=plan.programmatic,  # the kernel waits for the previous one before it touches memory
            cluster=plan.cluster,
        )
    elif plan.path == "dequant+cublas":
        # The dense weight holds in_features padded to 8 (zero columns beyond the true K).
        w = _dequantize_into(packed, absmax, codebook, tensor_scale, bits, out_features, k, dtype)
        with torch.no_grad():  # out= variants refuse tensors that require grad; autograd is the op's job
            if bias is None:
                torch.mm(x2d, w.t(), out=out)
            else:
                torch.addmm(bias, x2d, w.t(), out=out)
    else:  # decode
        decode.launch(plan.decode, x2d, packed, absmax, codebook, tensor_scale, out)
        if bias is not None:
            out += bias
    if user_out is not None:
        if dtype is not in_dtype:
            user_out.view(m, out_features).copy_(out)
        return user_out
    if len(xs) != 2:
        out = out.view(*xs[:-1], out_features)
    return out if dtype is in_dtype else out.to(in_dtype)


# ---------------------------------------------------------------------------------------
# format kernels
# ---------------------------------------------------------------------------------------


def _blocks(n: int) -> int:
    return max(1, -(-n // _THREADS))


def _dequantize_kernel(index: int, bits: int, dtype: torch.dtype, pairs: bool) -> loader.CudaKernel:
    """The dequantize instance for (device, bits, dtype, layout), from the plan cache (no name
    formatting on the hot path: the dequantize + cuBLAS path and training backward passes call
    it per layer)."""
    key = ("dequantize", index, bits, dtype, pairs)
    kern = plans.lookup(key)
    if kern is None:
        kern = plans.get_or_make(key, lambda: loader.get_kernel("quantize.cu", _dequantize_name(bits, dtype, pairs),
                                                                torch.device("cuda", index)))
    return kern


def _dequantize_into(packed: torch.Tensor, absmax: torch.Tensor, codebook: torch.Tensor, tensor_scale: torch.Tensor, bits: int, out_features: int, in_features: int, dtype: torch.dtype) -> torch.Tensor:
    """Dense ``[out_features, in_features]`` weight in ``dtype`` (fp16, bf16 or fp32); the tensors
    contiguous, 16-byte aligned and on one CUDA device."""
    index = packed.get_device()
    out = torch.empty((out_features, in_features), dtype=dtype, device=packed.device)
    kt, nt = packed.shape[0], packed.shape[1]
    warps = -(-out_features * (-(-kt // 4)) // DEQUANT_WARP_ITEMS)  # DEQUANT_WARP_ITEMS (row, 4 k-tiles) items each
    _DEQUANT_ARGS.launch(
        _dequantize_kernel(index, bits, dtype, packed.dtype is torch.uint8), max(1, -(-warps // 8)), 0, loader._current_raw_stream(index),
        _DEQUANT_ARGS.Values(packed=packed.data_ptr(), absmax=absmax.data_ptr(), codebook=codebook.data_ptr(),
                             tensor_scale=tensor_scale.data_ptr(), out=out.data_ptr(), N=out_features, K=in_features,
                             n_tiles=nt, k_tiles=kt),
        threads=_THREADS,
    )
    return out


def dequantize_cuda(packed: torch.Tensor, absmax: torch.Tensor, codebook: torch.Tensor, tensor_scale: torch.Tensor, bits: int, out_features: int, in_features: int, dtype: torch.dtype) -> torch.Tensor:
    """CUDA ``kbit_linear::dequantize``: dense ``[out_features, in_features]`` in ``dtype``.

    Values are ``codebook[idx] * (e4m4(code) * tensor_scale)`` in fp32 rounded once to ``dtype``:
    bit-identical to :func:`kbit_linear.format.dequantize`.
    """
    _ops.check_tiled_args(packed, absmax, bits, out_features)
    if packed.device.type != "cuda":
        raise ValueError(f"packed must be on a CUDA device, got {packed.device}")
    k_pad = packed.shape[0] * _TILE_K
    if not (k_pad - _TILE_K < in_features <= k_pad):
        raise ValueError(f"in_features={in_features} does not match tiles padded to {k_pad}")
    _ops.check_codebook_args(codebook, tensor_scale, bits, packed.device)
    fmt.check_float_dtype(dtype)
    return dequantize_checked_cuda(packed, absmax, codebook, tensor_scale, bits, out_features, in_features, dtype)


def dequantize_checked_cuda(packed: torch.Tensor, absmax: torch.Tensor, codebook: torch.Tensor, tensor_scale: torch.Tensor, bits: int, out_features: int, in_features: int, dtype: torch.dtype) -> torch.Tensor:
    """:func:`dequantize_cuda` for arguments already checked (the eager training backward, whose
    forward gemm checked the same tensors): no checks, the kernel launch only."""
    kdtype = dtype if dtype in _DT else torch.float32
    w = _dequantize_into(aligned16(packed), aligned16(absmax), codebook.contiguous(), tensor_scale.contiguous(), bits, out_features, in_features, kdtype)
    return w if kdtype is dtype else w.to(dtype)


def quantize_cuda(weight: torch.Tensor, codebook: torch.Tensor, tensor_scale: torch.Tensor, bits: int) -> tuple[torch.Tensor, torch.Tensor]:
    """CUDA ``kbit_linear::quantize``: flat ``(packed_flat int32 [N, nblk, bits], absmax_flat uint8 [N, nblk])``.

    Bit-identical to :func:`kbit_linear.format.quantize_blockwise` with the same codebook and
    tensor scale. Like every op it checks metadata only; the values (a finite weight, a valid
    codebook) are validated once before it, by :func:`kbit_linear.quantizer.quantize_weight`.
    """
    _ops.check_weight_args(weight, codebook, tensor_scale, bits)
    if weight.device.type != "cuda":
        raise ValueError(f"weight must be on a CUDA device, got {weight.device}")
    cb = codebook.contiguous()
    w = weight.detach()
    if w.dtype not in _DT:
        w = w.to(torch.float32)
    w = w.contiguous()
    n, k = w.shape
    nblk = -(-k // fmt.BLOCK_SIZE)
    packed = torch.empty((n, nblk, bits), dtype=torch.int32, device=w.device)
    absmax = torch.empty((n, nblk), dtype=torch.uint8, device=w.device)
    kern = loader.get_kernel("quantize.cu", f"kbit_quantize<{bits}, {_DT[w.dtype]}>", w.device)
    loader.launch(kern, max(1, -(-n * nblk // 8)), _THREADS,
                  _QUANT_ARGS.Values(w=w, codebook=cb, tensor_scale=tensor_scale.contiguous(), packed_flat=packed, absmax_flat=absmax,
                                     N=n, K=k, nblk=nblk), 0, w.device, pack=_QUANT_ARGS)
    return packed, absmax


def repack_cuda(packed_flat: torch.Tensor, absmax_flat: torch.Tensor, bits: int) -> tuple[torch.Tensor, torch.Tensor]:
    """CUDA ``kbit_linear::repack``: flat blocks -> tiled, bit-identical to :func:`kbit_linear.format.tile_blocks`."""
    fmt.check_bits(bits)
    fmt._check_flat(packed_flat, absmax_flat, bits)
    if packed_flat.device.type != "cuda" or absmax_flat.device != packed_flat.device:
        raise ValueError(f"packed_flat and absmax_flat must be on the same CUDA device, got {packed_flat.device}, {absmax_flat.device}")
    n, nblk, _ = packed_flat.shape
    packed_shape, absmax_shape = fmt.tiled_shapes(n, nblk * fmt.BLOCK_SIZE, bits)
    kt, nt = absmax_shape[0], absmax_shape[1]
    dev = packed_flat.device
    packed = torch.empty(packed_shape, dtype=torch.int32, device=dev)
    absmax = torch.empty(absmax_shape, dtype=torch.uint8, device=dev)
    kern = loader.get_kernel("quantize.cu", f"kbit_repack<{bits}>", dev)
    loader.launch(kern, _blocks(kt * nt * 256), _THREADS,
                  _REPACK_ARGS.Values(packed_flat=packed_flat.contiguous(), absmax_flat=absmax_flat.contiguous(), packed=packed,
                                      absmax=absmax, N=n, nblk=nblk, n_tiles=nt, k_tiles=kt), 0, dev, pack=_REPACK_ARGS)
    return packed, absmax


# ---------------------------------------------------------------------------------------
# registration
# ---------------------------------------------------------------------------------------


@torch.library.impl("kbit_linear::gemm", "CUDA")
def _gemm_op(x, packed, absmax, codebook, tensor_scale, bits, out_features, bias):
    return gemm_cuda(x, packed, absmax, codebook, tensor_scale, bits, out_features, bias)


@torch.library.impl("kbit_linear::dequantize", "CUDA")
def _dequantize_op(packed, absmax, codebook, tensor_scale, bits, out_features, in_features, dtype):
    return dequantize_cuda(packed, absmax, codebook, tensor_scale, bits, out_features, in_features, dtype)


@torch.library.impl("kbit_linear::quantize", "CUDA")
def _quantize_op(weight, codebook, tensor_scale, bits):
    return quantize_cuda(weight, codebook, tensor_scale, bits)


@torch.library.impl("kbit_linear::repack", "CUDA")
def _repack_op(packed_flat, absmax_flat, bits):
    return repack_cuda(packed_flat, absmax_flat, bits)


def _grouped_gemm_op(x, packed, absmax, codebook, tensor_scale, groups, bits, out_features, max_rows):
    _grouped_ops.check_grouped_args(x, packed, absmax, codebook, tensor_scale, groups, bits, out_features, max_rows)
    return _grouped_product(x, packed, absmax, codebook, tensor_scale, groups, bits, out_features, max_rows, zero_unnamed=True)


def _grouped_product(x, packed, absmax, codebook, tensor_scale, groups, bits, out_features, max_rows, zero_unnamed):
    """The grouped product of checked arguments by a kernel, or by the reference for float32
    activations and large groups on a GPU without the grouped tensor-core kernel (it reads the
    groups on the host; its unnamed rows are zero either way)."""
    out = _grouped_on_device(x, packed, absmax, codebook, tensor_scale, groups, bits, out_features, max_rows, swiglu=False,
                             zero_unnamed=zero_unnamed)
    if out is not None:
        return out
    return _grouped_ops.grouped_gemm_reference(x, packed, absmax, codebook, tensor_scale, groups, bits, out_features, max_rows)


def _grouped_swiglu_op(x, packed, absmax, codebook, tensor_scale, groups, bits, intermediate, max_rows):
    _grouped_ops.check_intermediate(intermediate)
    n = 2 * intermediate
    _grouped_ops.check_grouped_args(x, packed, absmax, codebook, tensor_scale, groups, bits, n, max_rows)
    # rows no group names may hold anything (the op's contract): no zero fill
    if max_rows > _grouped_ops.DECODE_GROUP_ROWS and grouped.swiglu_fusable(packed.shape[2], intermediate):
        out = _grouped_on_device(x, packed, absmax, codebook, tensor_scale, groups, bits, intermediate, max_rows, swiglu=True,
                                 zero_unnamed=False)
        if out is not None:
            return out
    gate_up = _grouped_product(x, packed, absmax, codebook, tensor_scale, groups, bits, n, max_rows, zero_unnamed=False)
    if gate_up.dtype in (torch.float16, torch.bfloat16) and experts.kernels_supported(gate_up.device):
        return experts.swiglu_cuda(gate_up)  # one launch (silu in float32, rounded once)
    gate, up = gate_up.chunk(2, dim=-1)
    return torch.nn.functional.silu(gate) * up


# Registered without the decorator form: torch 2.11's decorator binds None to the name, and
# grouped_swiglu falls back on the grouped_gemm implementation by name.
torch.library.impl("kbit_linear::grouped_gemm", "CUDA")(_grouped_gemm_op)
torch.library.impl("kbit_linear::grouped_swiglu", "CUDA")(_grouped_swiglu_op)


def _grouped_on_device(x, packed, absmax, codebook, tensor_scale, groups, bits, out_features, max_rows, swiglu,
                       zero_unnamed=True):
    """The grouped product (``swiglu``: its fused SwiGLU, ``out_features`` = the intermediate
    size) by a kernel that reads the groups on the device, or None where no kernel takes it.
    ``zero_unnamed``: rows no group names are zero (else they hold whatever the new tensor's
    memory held)."""
    if x.dtype not in (torch.float16, torch.bfloat16):
        return None
    small = not swiglu and max_rows <= _grouped_ops.DECODE_GROUP_ROWS and decode.decode_supported(max_rows, bits, x.dtype, x.device)
    if not (small or _large_groups_supported(x.device)):
        return None
    out = (torch.zeros if zero_unnamed else torch.empty)((x.shape[0], out_features), dtype=x.dtype, device=x.device)
    if x.shape[0] == 0 or groups.shape[1] == 0:
        return out
    # checked by the op (its checks cover the launch's): plan and launch directly
    # one token's row broadcast to every slot (a decode step of one token) is read as is
    xk = x if small and decode.broadcast_rows(x) else kernel_rows(x)
    packed, absmax = aligned16(packed), aligned16(absmax)
    codebook, tensor_scale, groups = codebook.contiguous(), tensor_scale.contiguous(), groups.contiguous()
    if small:
        plan = decode.decode_plan(max_rows, bits, x.dtype, out_features, packed.shape[1], x.device, groups=groups.shape[1],
                                  pairs=fmt.is_pair_codes(packed))
        decode.launch_grouped(plan, xk, packed, absmax, codebook, tensor_scale, groups, out)
    else:
        plan = grouped.grouped_plan(x.shape[0], groups.shape[1], bits, x.dtype, packed.shape[2], x.get_device(),
                                    pairs=fmt.is_pair_codes(packed))
        grouped.launch(plan, xk, packed, absmax, codebook, tensor_scale, groups, out, swiglu=swiglu)
    return out


def _large_groups_supported(device: torch.device) -> bool:
    """Whether groups of any size run on the device without a host sync (the grouped wgmma kernel)."""
    props = loader.runnable_properties(device)  # None: a GPU the backend does not run on at all, so the reference
    return props is not None and hopper.supported(props.index)


_grouped_ops.register_large_groups("cuda", _large_groups_supported)


torch.library.impl("kbit_linear::combine_experts", "CUDA")(experts.combine_experts_cuda)
torch.library.impl("kbit_linear::experts_one_token", "CUDA")(experts_token.experts_one_token_cuda)


@torch.library.impl("kbit_linear::route_experts", "CUDA")
def _route_experts_op(top_k_index, num_experts, groups):
    return routing.route_experts_cuda(top_k_index, num_experts, groups)


_ops.register_eager_cuda_gemm(gemm_cuda)
_ops.register_eager_dequantize("cuda", dequantize_checked_cuda)
