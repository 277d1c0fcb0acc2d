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

__all__ = ["MAX_EXPERTS", "THREADS", "route_instances", "route_experts_cuda"]
MAX_EXPERTS = 1024
"""Most experts it takes (``kMaxExperts`` in ``route.cu``)."""
THREADS = 256

_SOURCE = "route.cu"
_ARGS = loader.ArgPack("kbit_route_experts", "index:p perm:p tokens:p position:p groups:p S:i top_k:i E:i G:i")


def route_instances() -> list[str]:
    """Every instance of the routing kernel (name expressions in ``route.cu``)."""
    return [f"kbit_route_experts<{THREADS}>"]


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
    kern = loader.get_kernel(_SOURCE, route_instances()[0], index.device)
    loader.launch(kern, 1, THREADS, _ARGS.Values(index=index, perm=perm, tokens=tokens, position=position, groups=table, S=slots,
                                                 top_k=top_k_index.shape[1], E=num_experts, G=groups), 0, index.device, pack=_ARGS)
    return table, perm, tokens, position
