"""The router of mixture-of-experts layers in one launch (``kernels/router.cu``).

Registered as the CUDA implementation of ``kbit_linear::router_top_k``
(:mod:`kbit_linear._router_ops`): the logits, the softmax, the top-k and the renormalisation in
one kernel, where the reference takes a GEMV, a softmax, a top-k and its sort. Up to
:data:`~kbit_linear.backends.cuda.tuning.ROUTER_MAX_TOKENS` tokens, at most :data:`MAX_EXPERTS`
experts, ``top_k`` up to :data:`MAX_TOP_K` and a hidden size that is a multiple of 8 take the
kernel on a GPU the kernels run on (sm_80+, CuPy installed); anything else runs the reference
(also free of host syncs).
"""

from __future__ import annotations

import torch

from ... import _router_ops
from . import experts, loader, tuning, workspace
from .tensors import DTYPE_CODES, aligned16

__all__ = ["MAX_EXPERTS", "MAX_TOP_K", "router_instances", "router_top_k_cuda"]

EXPERTS_PER_LANE = (1, 2, 4, 8, 16)
"""The instances' experts per lane in the top-k phase (``P`` in ``router.cu``): a call takes the
smallest that holds its experts, as each round of the top-k scans all ``P`` of a lane."""
MAX_EXPERTS = 32 * EXPERTS_PER_LANE[-1]
"""Most experts the kernel takes (32 lanes x the largest of :data:`EXPERTS_PER_LANE`)."""
MAX_TOP_K = 32
"""Largest ``top_k`` the kernel takes (one chosen expert per lane)."""

_SOURCE = "router.cu"
_DT = DTYPE_CODES
_THREADS = 128  # kThreads: one block per expert
_ARGS = loader.ArgPack("kbit_router_top_k", "x:p w:p logits:p scores:p index:p counter:p T:i H:i E:i top_k:i normalize:i")


def router_instances() -> list[str]:
    """Every instance of ``router.cu`` the backend can launch (name expressions)."""
    return [_instance(dt, f, p) for dt in _DT.values() for f in (False, True) for p in EXPERTS_PER_LANE]


def _instance(dt: int, scores_float: bool, per_lane: int) -> str:
    return f"kbit_router_top_k<{dt}, {str(scores_float).lower()}, {per_lane}>"


def _per_lane(experts: int) -> int:
    """The smallest instance that holds ``experts`` (at most :data:`MAX_EXPERTS`)."""
    return next(p for p in EXPERTS_PER_LANE if 32 * p >= experts)


def _takes(x: torch.Tensor, weight: torch.Tensor, top_k: int) -> bool:
    t, h = x.shape
    return (0 < t <= tuning.ROUTER_MAX_TOKENS and weight.shape[0] <= MAX_EXPERTS and top_k <= MAX_TOP_K and h % 8 == 0
            and weight.numel() < 2**31 and experts.kernels_supported(x.device))


def router_top_k_cuda(x: torch.Tensor, weight: torch.Tensor, top_k: int, normalize: bool,
                      scores_float: bool) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """CUDA ``kbit_linear::router_top_k``: ``(logits, scores, index)`` (:mod:`kbit_linear._router_ops`).

    Raises:
        TypeError / ValueError: bad arguments, named.
    """
    _router_ops.check_router_args(x, weight, top_k, normalize, scores_float)
    if not _takes(x, weight, top_k):
        return _router_ops.router_top_k_reference(x, weight, top_k, normalize, scores_float)
    t, h = x.shape
    experts = weight.shape[0]
    dev = x.device
    index_dev = loader._device_index(dev)
    logits = torch.empty((t, experts), dtype=x.dtype, device=dev)
    scores = torch.empty((t, top_k), dtype=torch.float32 if scores_float else x.dtype, device=dev)
    index = torch.empty((t, top_k), dtype=torch.int64, device=dev)
    stream = loader._current_raw_stream(index_dev)
    _, counter = workspace.zeroed_scratch("router", index_dev, stream, 0, 1)  # the kernel leaves it at zero
    kern = loader.get_kernel(_SOURCE, _instance(_DT[x.dtype], scores_float, _per_lane(experts)), dev)
    # one short block per expert
    programmatic = loader.short_grid_may_overlap(experts, loader.device_properties(index_dev).sm_count)
    xa, wa = aligned16(x), aligned16(weight)  # held until the launch is queued
    _ARGS.launch(kern, experts, 0, stream, _ARGS.Values(
        x=xa.data_ptr(), w=wa.data_ptr(), logits=logits.data_ptr(), scores=scores.data_ptr(), index=index.data_ptr(),
        counter=counter, T=t, H=h, E=experts, top_k=top_k, normalize=int(normalize)), threads=_THREADS,
        programmatic=programmatic)
    return logits, scores, index


torch.library.impl("kbit_linear::router_top_k", "CUDA")(router_top_k_cuda)
