"""Small-M ("decode") kbit GEMM on CUDA: ``out = x @ W^T`` for 1 to 16 rows of ``x``.

The kernel (``kernels/decode.cu``) streams the packed weight once at close to memory bandwidth:
each lane turns bit-planes into shared-memory table lookups of decoded pairs, and
``mma.sync`` does the multiply-adds. The warps of a block split K among themselves and sum in
shared memory; a persistent grid spreads (row tile, chunk) items over blocks by the cheapest of
a few schedules (:func:`schedule`): whole row tiles per block where that balances well, else
K split over blocks too ("stream-K"), the rows of a split tile summed in an fp32 workspace with
atomics and converted by the last contributor, all in one launch.

Public entry points: :func:`decode_supported`, :func:`decode_plan` and :func:`launch` (the CUDA
backend's dispatcher plans once and launches on tensors it has checked and aligned),
:func:`decode_gemm` (checks, aligns, plans and launches: benchmarks and tests),
:func:`grouped_decode_gemm` (one launch over several experts' weights, each with its own rows
of x: mixture-of-experts layers) and :func:`decode_instances` (every template instance, for the
build check).

Nothing here allocates through CuPy or syncs the host on the hot path (only the one-time
allocation of the split-K buffers waits for their zeroing); launches go on torch's current
stream, so calls can be captured in a CUDA graph; on sm_90+ a launch may overlap the end of the
previous kernel (programmatic dependent launch: each block builds its decode tables, then waits
for that kernel before any load or store that counts). Split-K launches use a workspace and counters that the
kernel leaves zeroed (:mod:`.workspace`: kept per device and stream, outside graph memory pools).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from ... import format as fmt
from . import loader, plans, workspace
from .tensors import HALF_DTYPE_CODES, aligned16, kernel_rows, layout_arg, weight_layouts
from .tuning import (DECODE_SEGMENT_COST_BYTES, DECODE_SHARED_SEGMENT_COST_BYTES, DECODE_SPLIT_COST_BYTES,
                     DECODE_SPLIT_PIECE_COST_BYTES, DecodeConfig, all_decode_configs, decode_configs)

__all__ = [
    "MAX_M",
    "DecodeConfig",
    "DecodePlan",
    "decode_supported",
    "decode_gemm",
    "grouped_decode_gemm",
    "launch_grouped",
    "broadcast_rows",
    "decode_plan",
    "launch",
    "decode_instances",
    "Schedule",
    "schedule",
    "SCHEDULES",
]

MAX_M = 16
"""Most rows of x the decode kernel takes (two n8 fragments)."""

_SOURCE = "decode.cu"
_DT = HALF_DTYPE_CODES
_ARGS = loader.ArgPack("kbit_decode_gemm", "x:p packed:p absmax:p codebook:p tensor_scale:p out:p ws:p counters:p "
                                          "M:i N:i K:i k_tiles:i n_tiles:i align:i")
_GROUPED_ARGS = loader.ArgPack("kbit_decode_gemm_grouped", "x:p packed:p absmax:p codebook:p tensor_scale:p out:p ws:p counters:p "
                                                          "groups:p count:i expert_words:i expert_scales:i N:i K:i k_tiles:i "
                                                          "n_tiles:i align:i stream_k_slack:i x_ld:i")


# Dynamic shared memory per block (kernels/decode.cu): the pair/quad table (Lut<BITS>::kSmem:
# BITS 2..4 on a 64 KiB boundary of the shared window, so up to 64 KiB of padding, plus the
# 1 KiB scale table), then two reduction slots per row slot (RedSlot: one slice of R*MT*4*32
# floats per warp along K) and their control words (RedCtl: two mbarriers, generation, count:
# 24 bytes).
_TABLE_SMEM = {2: 65536 + 256 * 256 + 1024, 3: 65536 + 64 * 256 + 1024, 4: 65536 + 256 * 256 + 1024, 5: 1024 * 128 + 1024}
_RESERVED_SMEM = 1024  # per block, taken by the runtime on sm_80+


def _smem(bits: int, mt: int, cfg: DecodeConfig) -> int:
    return _TABLE_SMEM[bits] + 2 * cfg.row_slots * (cfg.k_warps * cfg.row_groups * mt * 4 * 32 * 4 + 24)


# Most shared memory any tuned launch shape of a bit width needs (what decode_supported checks).
_MAX_SMEM = {bits: max(_smem(bits, mt, cfg) for (b, mt), cfgs in all_decode_configs().items() if b == bits for cfg in cfgs)
             for bits in _TABLE_SMEM}


def _name(bits: int, dtype: torch.dtype, mt: int, cfg: DecodeConfig, grouped: bool = False, pairs: bool = False) -> str:
    kernel = "kbit_decode_gemm_grouped" if grouped else "kbit_decode_gemm"
    return (f"{kernel}<{bits}, {_DT[dtype]}, {mt}, {cfg.warps}, {cfg.k_warps}, {cfg.row_groups}, {cfg.depth}, "
            f"{cfg.min_blocks}{layout_arg(pairs)}>")


def decode_instances() -> list[str]:
    """Every kernel template instance :func:`decode_gemm` and :func:`grouped_decode_gemm` can
    launch (name expressions in ``decode.cu``)."""
    return [_name(b, dt, mt, cfg, grouped, pairs) for grouped in (False, True) for (b, mt), cfgs in sorted(all_decode_configs().items())
            for pairs in weight_layouts(b) for cfg in cfgs for dt in _DT]


def decode_supported(m: int, bits: int, dtype: torch.dtype, device: torch.device | int | None = None) -> bool:
    """Whether :func:`decode_gemm` takes a problem.

    Args:
        m: rows of x.
        bits: index width.
        dtype: x's dtype (fp16 and bf16 only).
        device: the CUDA device (default: the current one, when CUDA is available); the check
            there is that a block may use the ~129 KiB of shared memory of the tables (A100,
            H100 and newer data-centre GPUs can; consumer GPUs cannot).

    Returns:
        True for ``1 <= m <= 16``, bits 2..5, fp16/bf16 on a GPU with enough shared memory.
    """
    if isinstance(m, bool) or not isinstance(m, int) or not 1 <= m <= MAX_M:
        return False
    if bits not in fmt.SUPPORTED_BITS or dtype not in _DT:
        return False
    if device is None:
        if not torch.cuda.is_available():
            return True
        device = torch.cuda.current_device()
    index = device if isinstance(device, int) else loader._device_index(device)
    props = loader.runnable_properties(index)
    return props is not None and _MAX_SMEM[bits] <= props.max_shared_per_block


# ---------------------------------------------------------------------------------------
# planning (cached per problem)
# ---------------------------------------------------------------------------------------


SCHEDULES = ("auto", "stream-k", "tiles", "tile-split")
"""How a plan spreads (row tile, chunk) items over blocks; see :func:`schedule`."""


@dataclass(frozen=True)
class Schedule:
    """A grid: ``grid`` blocks, each taking a contiguous range of items cut on multiples of
    ``align`` (1 = stream-K, balanced to one item; ``kc`` = whole row tiles); ``split`` says
    whether some row tile's K ends up on more than one block."""

    kind: str
    grid: int
    align: int
    split: bool
    cost: float


def _segment_cost(shared_rows: bool) -> int:
    """The cost model's bytes per segment: with the in-block reduction where several warps
    share a row tile's rows, without it where each warp owns its rows."""
    return DECODE_SHARED_SEGMENT_COST_BYTES if shared_rows else DECODE_SEGMENT_COST_BYTES


def schedule(row_tiles: int, kc: int, sm_count: int, per_sm: int, item_bytes: float, kind: str = "auto",
             shared_rows: bool = True) -> Schedule:
    """Choose how to spread ``row_tiles * kc`` items over a persistent grid.

    Candidates: ``"stream-k"`` (one block per SM slot, equal ranges), ``"tiles"`` (whole row
    tiles per block, the fewest blocks with the same largest share, never split) and
    ``"tile-split"`` (every row tile cut into s equal parts, ``row_tiles * s`` blocks). The
    cost of each is the items of its busiest SM in bytes, plus a cost per row tile a block
    touches (:data:`.tuning.DECODE_SHARED_SEGMENT_COST_BYTES` where several warps share a row
    tile's rows, :data:`.tuning.DECODE_SEGMENT_COST_BYTES` where each warp owns its rows) and,
    when a row tile is split, :data:`.tuning.DECODE_SPLIT_COST_BYTES` plus
    :data:`.tuning.DECODE_SPLIT_PIECE_COST_BYTES` per block its K is cut among; ``"auto"``
    takes the cheapest.

    Args:
        row_tiles: row tiles of the problem.
        kc: 128-wide chunks of K (items per row tile).
        sm_count: SMs of the device.
        per_sm: blocks that fit on one SM.
        item_bytes: weight bytes of one item (a row tile's 128 in-features).
        kind: one of :data:`SCHEDULES`.
        shared_rows: the launch shape has several warps along K (``k_warps > 1``), which sum
            their partials in shared memory at the end of every segment.

    Returns:
        The chosen :class:`Schedule`.
    """
    if kind not in SCHEDULES:
        raise ValueError(f"kind must be one of {SCHEDULES}, got {kind!r}")
    total = row_tiles * kc
    slots = sm_count * per_sm
    segment_cost = _segment_cost(shared_rows)

    def cost(grid: int, most: int, segments: int, pieces: int) -> float:
        # blocks of one SM share its bandwidth; segments and a split (pieces > 1 blocks per
        # row tile) add their finalisation
        share = -(-grid // sm_count)
        split = DECODE_SPLIT_COST_BYTES + pieces * DECODE_SPLIT_PIECE_COST_BYTES if pieces > 1 else 0
        return share * (most * item_bytes + segments * segment_cost) + split

    cands: list[Schedule] = []
    g = min(total, slots)
    split = any((b * total // g) % kc for b in range(g + 1))
    most = -(-total // g)
    # a split row tile is cut among at most this many blocks of `most` items each
    pieces = -(-kc // most) + 1 if split else 1
    cands.append(Schedule("stream-k", g, 1, split, cost(g, most, -(-most // kc) + split, pieces)))
    per = -(-row_tiles // slots)
    g = -(-row_tiles // per)
    cands.append(Schedule("tiles", g, kc, False, cost(g, per * kc, per, 1)))
    for s in range(2, min(kc, slots // max(row_tiles, 1)) + 1):
        g = row_tiles * s
        cands.append(Schedule("tile-split", g, 1, True, cost(g, -(-kc // s), 1, s)))
    if kind != "auto":
        picked = [c for c in cands if c.kind == kind]
        if not picked:
            raise ValueError(f"schedule {kind!r} does not apply: {row_tiles} row tiles fill the {slots} block slots")
        return min(picked, key=lambda c: c.cost)
    return min(cands, key=lambda c: (c.cost, c.split))


@dataclass
class DecodePlan:
    """What one launch does.

    Attributes:
        kernel: the compiled instance (``loader.CudaKernel``).
        name: its name expression.
        config: its :class:`DecodeConfig`.
        grid: blocks (persistent: at most SMs * blocks per SM).
        smem: dynamic shared memory per block (bytes).
        items: (row tile, 128-wide k chunk) work items.
        align: block ranges are cut on multiples of this many items (kernel argument).
        schedule: the :class:`Schedule` kind (``"stream-k"``, ``"tiles"``, ``"tile-split"``).
        split: whether some row tile's K may be split over blocks (workspace + counters used).
        ws_numel: fp32 workspace elements (0 without split).
        counters: int32 counters (0 without split).
        programmatic: launch it so that it may start while the previous kernel finishes
            (:func:`.loader.grid_may_overlap`).
        stream_k_slack: grouped whole-tile plans only (else -1): the launch runs stream-K instead
            when the used groups' row tiles leave its busiest block more than this many chunks
            above an even share (``grouped_align`` in ``kernels/decode.cu``).
    """

    kernel: object
    name: str
    config: DecodeConfig
    grid: int
    smem: int
    items: int
    align: int
    schedule: str
    split: bool
    ws_numel: int
    counters: int
    programmatic: bool
    stream_k_slack: int = -1


def _make_plan(index: int, mt: int, bits: int, dtype: torch.dtype, n: int, k_tiles: int, config: DecodeConfig | None,
               kind: str, groups: int | None, pairs: bool) -> DecodePlan:
    props = loader.device_properties(index)
    configs = (config,) if config is not None else decode_configs(getattr(props, "name", ""), bits, mt)
    kc = (k_tiles + 1) // 2
    best = None
    for cfg in configs:
        smem = _smem(bits, mt, cfg)
        if smem > props.max_shared_per_block:
            raise ValueError(f"config {cfg} needs {smem} bytes of shared memory per block; the device allows {props.max_shared_per_block}")
        rows = cfg.tile_rows
        row_tiles = -(-n // rows) * (groups or 1)  # grouped: the groups' row tiles stacked
        per_sm = max(1, min(cfg.min_blocks, props.shared_per_sm // (smem + _RESERVED_SMEM)))
        item_bytes = rows * 128 * (bits + 0.25) / 8
        try:
            sch = schedule(row_tiles, kc, props.sm_count, per_sm, item_bytes, kind, shared_rows=cfg.k_warps > 1)
        except ValueError:
            if len(configs) == 1:
                raise
            continue  # this schedule kind does not apply to this launch shape
        if best is None or sch.cost < best[0].cost:
            best = (sch, cfg, smem, row_tiles, per_sm, item_bytes)
    if best is None:
        raise ValueError(f"schedule {kind!r} applies to none of the launch shapes for n={n}")
    sch, cfg, smem, row_tiles, per_sm, item_bytes = best
    name = _name(bits, dtype, mt, cfg, grouped=groups is not None, pairs=pairs)
    kernel = loader.get_kernel(_SOURCE, name, torch.device("cuda", index))
    # A grouped plan is made for every group entry, but only the hit experts' groups have rows:
    # a whole-tile plan may then run stream-K (decode.cu's grouped_align) when its tiles share
    # out unevenly, by more than what the split-K finalisation costs, so it keeps the scratch.
    slack = -1
    if groups is not None and kind == "auto" and sch.align == kc > 1:
        slack = math.ceil((DECODE_SPLIT_COST_BYTES + 2 * DECODE_SPLIT_PIECE_COST_BYTES + _segment_cost(cfg.k_warps > 1))
                          / item_bytes)
    # A grouped launch shares out only the hit groups' row tiles (decode.cu's used_groups), so a
    # stream-K range that covers whole row tiles when every group has rows may cut one when fewer do.
    split = sch.split or slack >= 0 or (groups is not None and sch.align != kc)
    ws = row_tiles * cfg.tile_rows * 8 * mt if split else 0
    cnt = row_tiles * cfg.row_slots if split else 0
    return DecodePlan(kernel, name, cfg, sch.grid, smem, row_tiles * kc, sch.align, sch.kind, split, ws, cnt,
                      loader.grid_may_overlap(sch.grid, per_sm, props.sm_count), slack)


def decode_plan(
    m: int,
    bits: int,
    dtype: torch.dtype,
    out_features: int,
    k_tiles: int,
    device: torch.device | int | None = None,
    config: DecodeConfig | None = None,
    schedule_kind: str = "auto",
    groups: int | None = None,
    pairs: bool = False,
) -> DecodePlan:
    """The cached launch plan for a problem (compiles the kernel instance on first use).

    Args:
        m: rows of x (1..16).
        bits: index width.
        dtype: fp16 or bf16.
        out_features: N.
        k_tiles: storage k-tiles (``packed.shape[0]``).
        device: the CUDA device (default: the current one).
        config: a launch shape to use instead of the cheapest of the tuned ones (benchmarks).
        schedule_kind: one of :data:`SCHEDULES` (benchmarks and tests; default ``"auto"``).
        groups: for the grouped kernel, the number of groups (``m`` is then the most rows one
            group may have); ``None`` for the single-weight kernel.
        pairs: the weight holds pair codes (uint8 ``packed``, 4 or 5 bits) instead of planes.

    Returns:
        The :class:`DecodePlan` (cached per device, fragment count, bits, dtype, shape, config, groups).

    Raises:
        ValueError: the problem is outside :func:`decode_supported`.
    """
    if not decode_supported(m, bits, dtype, device):
        raise ValueError(f"the decode kernel does not support m={m}, bits={bits}, dtype={dtype}")
    index = torch.cuda.current_device() if device is None else (device if isinstance(device, int) else loader._device_index(device))
    mt = 1 if m <= 8 else 2
    if groups is not None and (isinstance(groups, bool) or not isinstance(groups, int) or groups < 1):
        raise ValueError(f"groups must be a positive int or None, got {groups!r}")
    return plans.get_or_make(("decode", index, mt, bits, dtype, out_features, k_tiles, config, schedule_kind, groups, pairs),
                             lambda: _make_plan(index, mt, bits, dtype, out_features, k_tiles, config, schedule_kind, groups, pairs))


# ---------------------------------------------------------------------------------------
# the GEMM
# ---------------------------------------------------------------------------------------


def _check(x2d: torch.Tensor, packed: torch.Tensor, absmax: torch.Tensor, codebook: torch.Tensor, tensor_scale: torch.Tensor, bits: int, out_features: int, out: torch.Tensor) -> None:
    fmt.check_bits(bits)
    if not isinstance(x2d, torch.Tensor) or x2d.dtype not in _DT:
        raise TypeError(f"x2d must be a float16 or bfloat16 torch.Tensor, got {getattr(x2d, 'dtype', type(x2d).__name__)}")
    if x2d.dim() != 2 or not 1 <= x2d.shape[0] <= MAX_M:
        raise ValueError(f"x2d must be 2-D [M, K] with 1 <= M <= {MAX_M}, got shape {tuple(x2d.shape)}")
    if x2d.device.type != "cuda":
        raise ValueError(f"x2d must be on a CUDA device, got {x2d.device}")
    fmt.check_tiled(packed, absmax, bits)
    n_pad, k_pad = packed.shape[1] * fmt.TILE_N, packed.shape[0] * fmt.TILE_K
    if isinstance(out_features, bool) or not isinstance(out_features, int) or not n_pad - fmt.TILE_N < out_features <= n_pad:
        raise ValueError(f"out_features={out_features!r} does not match packed padded to {n_pad} rows")
    k = x2d.shape[1]
    if not k_pad - fmt.TILE_K < k <= k_pad:
        raise ValueError(f"x2d has {k} in-features; packed is padded to {k_pad} (expected {k_pad - fmt.TILE_K + 1}..{k_pad})")
    if not isinstance(codebook, torch.Tensor) or codebook.dtype != torch.float32 or codebook.shape != (1 << bits,):
        raise TypeError(f"codebook must be a float32 tensor of shape [{1 << bits}], got {getattr(codebook, 'dtype', None)} {tuple(getattr(codebook, 'shape', ()))}")
    if not isinstance(tensor_scale, torch.Tensor) or tensor_scale.dtype != torch.float32 or tensor_scale.numel() != 1:
        raise TypeError("tensor_scale must be a float32 tensor with one element")
    if not isinstance(out, torch.Tensor) or out.dtype != x2d.dtype or tuple(out.shape) != (x2d.shape[0], out_features) or not out.is_contiguous():
        raise ValueError(
            f"out must be a contiguous {x2d.dtype} tensor of shape {(x2d.shape[0], out_features)}, "
            f"got {getattr(out, 'dtype', None)} {tuple(getattr(out, 'shape', ()))}"
        )
    for name, t in (("packed", packed), ("absmax", absmax), ("codebook", codebook), ("tensor_scale", tensor_scale), ("out", out)):
        if t.device != x2d.device:
            raise ValueError(f"{name} is on {t.device}, x2d on {x2d.device}: all tensors must be on one device")


def decode_gemm(
    x2d: torch.Tensor,
    packed: torch.Tensor,
    absmax: torch.Tensor,
    codebook: torch.Tensor,
    tensor_scale: torch.Tensor,
    bits: int,
    out_features: int,
    out: torch.Tensor,
    *,
    config: DecodeConfig | None = None,
    schedule_kind: str = "auto",
) -> None:
    """Write ``x2d @ W^T`` into ``out`` with the small-M kernel.

    Args:
        x2d: ``[M, K]`` float16 or bfloat16 on a CUDA device, ``1 <= M <= 16``; K is
            in_features (or in_features zero-padded up to at most ``K_pad``).
        packed: int32 ``[K_pad/64, N_pad/128, 128, 2, bits]`` tiled bit-planes, or at 4 / 5 bits
            uint8 ``[..., 16]`` / ``[..., 20]`` pair codes.
        absmax: uint8 ``[K_pad/64, N_pad/128, 128, 2]`` E4M4 block scales.
        codebook: float32 ``[2**bits]``.
        tensor_scale: float32 ``[1]``.
        bits: 2..5.
        out_features: N.
        out: contiguous ``[M, N]`` tensor of x2d's dtype, overwritten.
        config: a launch shape other than the tuned one (benchmarks and tests).
        schedule_kind: how items are spread over blocks, one of :data:`SCHEDULES` (benchmarks
            and tests; default ``"auto"``).

    Raises:
        TypeError / ValueError: a tensor has the wrong dtype, shape, device or layout, or the
            problem is outside :func:`decode_supported`.
    """
    _check(x2d, packed, absmax, codebook, tensor_scale, bits, out_features, out)
    x2d = kernel_rows(x2d)
    plan = decode_plan(x2d.shape[0], bits, x2d.dtype, out_features, packed.shape[0], x2d.device, config, schedule_kind,
                       pairs=fmt.is_pair_codes(packed))
    launch(plan, x2d, aligned16(packed), aligned16(absmax), codebook.contiguous(), tensor_scale, out)


def _stream_and_scratch(plan: DecodePlan) -> tuple[int, int, int]:
    """The raw current stream of the plan's device and, for a split plan, the zeroed split-K
    workspace and tile counters on it (else null pointers): what every decode launch needs."""
    index = plan.kernel.device_index
    stream = loader._current_raw_stream(index)
    if not plan.split:
        return stream, 0, 0
    ws_ptr, cnt_ptr = workspace.zeroed_scratch("decode", index, stream, plan.ws_numel, plan.counters)
    return stream, ws_ptr, cnt_ptr


def launch(plan: DecodePlan, x2d: torch.Tensor, packed: torch.Tensor, absmax: torch.Tensor, codebook: torch.Tensor,
           tensor_scale: torch.Tensor, out: torch.Tensor) -> None:
    """Launch ``plan`` on tensors that meet every requirement already (the dispatcher's fast path:
    checked, x rows padded to 8 and every tensor contiguous and 16-byte aligned, on the plan's
    device); writes ``x2d @ W^T`` into ``out``."""
    stream, ws_ptr, cnt_ptr = _stream_and_scratch(plan)
    # Every value is a plain int already checked by the caller: the fast launch.
    _ARGS.launch(
        plan.kernel,
        plan.grid,
        plan.smem,
        stream,
        _ARGS.Values(x=x2d.data_ptr(), packed=packed.data_ptr(), absmax=absmax.data_ptr(), codebook=codebook.data_ptr(),
                     tensor_scale=tensor_scale.data_ptr(), out=out.data_ptr(), ws=ws_ptr, counters=cnt_ptr, M=x2d.shape[0],
                     N=out.shape[1], K=x2d.shape[1], k_tiles=packed.shape[0], n_tiles=packed.shape[1], align=plan.align),
        threads=plan.config.warps * 32,
        programmatic=plan.programmatic,  # the kernel waits for the previous one before it touches memory
    )


# ---------------------------------------------------------------------------------------
# the grouped GEMM (mixture-of-experts layers)
# ---------------------------------------------------------------------------------------


def grouped_decode_gemm(
    x: torch.Tensor,
    packed: torch.Tensor,
    absmax: torch.Tensor,
    codebook: torch.Tensor,
    tensor_scale: torch.Tensor,
    groups: torch.Tensor,
    bits: int,
    out_features: int,
    out: torch.Tensor,
    max_rows: int,
) -> None:
    """Write, for every group q, ``x[rows of q] @ W[expert of q]^T`` into ``out[rows of q]`` in one launch.

    The groups live on the device, so the launch needs no host sync (CUDA-graph capturable):
    ``groups`` is int32 ``[3, G]``: row 0 the expert of each group, row 1 its first row in
    ``x``/``out``, row 2 its row count (0..``max_rows``; 0 = an unused group: nothing is read
    or written for it). Rows of ``out`` that no group names are left as they are.

    Args:
        x: ``[R, K]`` float16 or bfloat16 on a CUDA device, contiguous.
        packed: int32 ``[E, K_pad/64, N_pad/128, 128, 2, bits]``: every expert's tiled planes (or
            uint8 pair codes ``[..., 16]`` / ``[..., 20]`` at 4 / 5 bits).
        absmax: uint8 ``[E, K_pad/64, N_pad/128, 128, 2]``.
        codebook: float32 ``[2**bits]``, shared by the experts.
        tensor_scale: float32 ``[E]``.
        groups: int32 ``[3, G]`` as above, contiguous, on x's device.
        bits: 2..5.
        out_features: N.
        out: contiguous ``[R, N]`` tensor of x's dtype.
        max_rows: the most rows any group has (1..16; it picks the kernel instance). A group
            with more rows is not checked on the device: the caller guarantees the bound.

    Raises:
        TypeError / ValueError: a tensor has the wrong dtype, shape, device or layout.
    """
    fmt.check_bits(bits)
    if not isinstance(packed, torch.Tensor) or packed.dim() != 6 or not isinstance(absmax, torch.Tensor) or absmax.dim() != 5:
        raise ValueError("packed must be [E, K_pad/64, N_pad/128, 128, 2, bits] and absmax [E, K_pad/64, N_pad/128, 128, 2]")
    experts = packed.shape[0]
    if absmax.shape[0] != experts:
        raise ValueError(f"packed holds {experts} experts, absmax {absmax.shape[0]}")
    if isinstance(max_rows, bool) or not isinstance(max_rows, int) or not 1 <= max_rows <= MAX_M:
        raise ValueError(f"max_rows must be an int in 1..{MAX_M}, got {max_rows!r}")
    if not isinstance(x, torch.Tensor) or x.dim() != 2 or not x.is_contiguous():
        raise ValueError(f"x must be a contiguous 2-D tensor, got {getattr(x, 'shape', type(x).__name__)}")
    rows = x.shape[0]
    # One expert's tensors pass the single-weight checks (x's row count is not a limit here).
    _check(x[: min(rows, 1)] if rows else x.new_empty(1, x.shape[1]), packed[0], absmax[0], codebook, tensor_scale[:1],
           bits, out_features, out[: min(rows, 1)] if rows else out.new_empty(1, out_features))
    if tensor_scale.shape != (experts,):
        raise ValueError(f"tensor_scale must have shape [{experts}], got {tuple(tensor_scale.shape)}")
    if out.shape[0] != rows:
        raise ValueError(f"out has {out.shape[0]} rows, x {rows}")
    if (not isinstance(groups, torch.Tensor) or groups.dtype != torch.int32 or groups.dim() != 2 or groups.shape[0] != 3
            or not groups.is_contiguous() or groups.device != x.device):
        raise ValueError(f"groups must be a contiguous int32 [3, G] tensor on {x.device}")
    count = groups.shape[1]
    if rows == 0 or count == 0:
        return
    launch_grouped(decode_plan(max_rows, bits, x.dtype, out_features, packed.shape[1], x.device, groups=count,
                               pairs=fmt.is_pair_codes(packed)), kernel_rows(x),
                   aligned16(packed), aligned16(absmax), codebook.contiguous(), tensor_scale.contiguous(), groups, out)


def broadcast_rows(x: torch.Tensor) -> bool:
    """Whether ``x`` ``[R, K]`` is one 16-byte aligned row repeated (``expand``: stride 0 between
    rows, unit stride along K, K a multiple of 8), which :func:`launch_grouped` reads as is."""
    return (x.dim() == 2 and x.stride(0) == 0 and x.stride(1) == 1 and x.shape[1] % 8 == 0
            and x.data_ptr() % 16 == 0)


def launch_grouped(plan: DecodePlan, x: torch.Tensor, packed: torch.Tensor, absmax: torch.Tensor, codebook: torch.Tensor,
                   tensor_scale: torch.Tensor, groups: torch.Tensor, out: torch.Tensor) -> None:
    """Launch a grouped ``plan`` (from :func:`decode_plan` with ``groups``) on tensors that meet
    every requirement of :func:`grouped_decode_gemm` already (checked, contiguous, 16-byte
    aligned, K of x a multiple of 8, on the plan's device): the op's fast path. ``x`` may also
    be one row broadcast to every row (stride 0 between rows, :func:`broadcast_rows`): a decode
    step of one token reads it without a gather."""
    stream, ws_ptr, cnt_ptr = _stream_and_scratch(plan)
    _GROUPED_ARGS.launch(
        plan.kernel,
        plan.grid,
        plan.smem,
        stream,
        _GROUPED_ARGS.Values(x=x.data_ptr(), packed=packed.data_ptr(), absmax=absmax.data_ptr(), codebook=codebook.data_ptr(),
                             tensor_scale=tensor_scale.data_ptr(), out=out.data_ptr(), ws=ws_ptr, counters=cnt_ptr,
                             groups=groups.data_ptr(), count=groups.shape[1], expert_words=packed[0].nbytes // 4,
                             expert_scales=absmax[0].numel(), N=out.shape[1], K=x.shape[1], k_tiles=packed.shape[1],
                             n_tiles=packed.shape[2], align=plan.align, stream_k_slack=plan.stream_k_slack, x_ld=x.stride(0)),
        threads=plan.config.warps * 32,
        programmatic=plan.programmatic,
    )
