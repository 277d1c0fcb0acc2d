"""The routing kernel of mixture-of-experts layers (``kernels/route.cu``) and its op.

``kbit_linear::route_experts`` on CUDA: one block sorts the slots by expert id and lists the hit
experts as the grouped GEMM's groups (the layout is drawn at the top of ``route.cu``), in one
launch instead of the reference's ~15 torch kernels (whose host time, ~0.5 ms, a prefill would
otherwise wait for). Layers of more than :data:`MAX_EXPERTS` experts take the reference, which is
also sync-free.
"""

from __future__ import annotations

import torch

from ... import _grouped_ops
from . import loader

__all__ = ["MAX_EXPERTS", "BLOCK_SIZES", "MANY_SLOTS", "route_instances", "route_experts_cuda", "route_smem_bytes"]
MAX_EXPERTS = 1024
"""Most experts it takes: with 256 threads, (8 + 2) x 1025 ints of shared memory fit every GPU the kernels run on."""
BLOCK_SIZES = (256, 1024)
"""Threads of the one block: the smaller for decode sizes, the larger from :data:`MANY_SLOTS` slots."""
MANY_SLOTS = 2048
"""Slots from which the routing runs 1024 threads: at 32768 slots (4096 tokens, top-8) 148 us
with 256 threads against ~40 with 1024 on an H100 (``bench/results/moe-h100.md``); at decode sizes
the smaller block is as fast."""

_SOURCE = "route.cu"
_ARGS = loader.ArgPack("kbit_route_experts", "index:p perm:p tokens:p position:p groups:p S:i top_k:i E:i G:i")


def route_instances() -> list[str]:
    """Every instance of the routing kernel (name expressions in ``route.cu``)."""
    return [f"kbit_route_experts<{threads}>" for threads in BLOCK_SIZES]


def route_smem_bytes(threads: int, num_experts: int) -> int:
    """Dynamic shared memory of one routing block: per warp and expert id (``num_experts`` + 1
    with "no expert") a count, plus two arrays over the ids (``route.cu``'s layout)."""
    return (threads // 32 + 2) * (num_experts + 1) * 4


def route_experts_cuda(top_k_index: torch.Tensor, num_experts: int,
                       groups: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """CUDA ``kbit_linear::route_experts``: ``(groups int32 [3, G], perm, tokens, position int64 [S])``.

    Raises:
        TypeError / ValueError: bad arguments (named), or ``top_k_index`` not on a CUDA device.
    """
    _grouped_ops.check_route_args(top_k_index, num_experts, groups)
    if top_k_index.device.type != "cuda":
        raise ValueError(f"top_k_index must be on a CUDA device, got {top_k_index.device}")
    slots = top_k_index.numel()
    if slots == 0 or slots >= 2**31 or num_experts > MAX_EXPERTS:
        return _grouped_ops.route_experts_reference(top_k_index, num_experts, groups)
    index = top_k_index.reshape(-1).to(torch.int64).contiguous()
    table = torch.empty((3, groups), dtype=torch.int32, device=index.device)
    perm = torch.empty(slots, dtype=torch.int64, device=index.device)
    tokens = torch.empty(slots, dtype=torch.int64, device=index.device)
    position = torch.empty(slots, dtype=torch.int64, device=index.device)
    threads = BLOCK_SIZES[1] if slots >= MANY_SLOTS else BLOCK_SIZES[0]
    smem = route_smem_bytes(threads, num_experts)
    if smem > loader.device_properties(loader._device_index(index.device)).max_shared_per_block:
        threads = BLOCK_SIZES[0]  # GPUs with less shared memory per block (~99 KiB) and many experts
        smem = route_smem_bytes(threads, num_experts)
    kern = loader.get_kernel(_SOURCE, f"kbit_route_experts<{threads}>", index.device)
    loader.launch(kern, 1, threads, _ARGS.Values(index=index, perm=perm, tokens=tokens, position=position, groups=table, S=slots,
                                                 top_k=top_k_index.shape[1], E=num_experts, G=groups), smem, index.device, pack=_ARGS)
    return table, perm, tokens, position
