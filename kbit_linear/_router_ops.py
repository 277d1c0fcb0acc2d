"""Op schema of a mixture-of-experts router: ``kbit_linear::router_top_k``.

``router_top_k(x, weight, top_k, normalize, scores_float) -> (logits, scores, index)`` is what the
top-k routers of transformers' MoE families compute (Mixtral, Qwen2-MoE, Qwen3-MoE, OLMoE, ...)::

    logits = F.linear(x, weight)                        # [T, E], x's dtype
    probs  = softmax(logits.float(), dim=-1)
    index  = the top_k experts by logit                 # descending, NaN first; ties: the lower expert first
    scores = probs[index]
    if normalize: scores = scores / scores.sum(-1, keepdim=True)
    scores = scores if scores_float else scores.to(logits.dtype)

``x [T, H]`` and ``weight [E, H]`` share a floating dtype and device; ``index`` is int64
``[T, top_k]``. Ordering by logit is ordering by probability, without the ties that rounding or
underflow of the exponentials make between different logits (``torch.topk`` on the probabilities
breaks those in no specified way). The CUDA kernel is built with flush-to-zero, as CuPy builds
every kernel, so its probabilities below float32's normal range are zero; and it puts every NaN
logit first, where ``torch.sort`` on CUDA may order a negative-signed NaN below -inf. The reference
below is that code (with a stable sort for the ties); the CUDA backend runs it as one kernel at
decode sizes (``kernels/router.cu``), where the reference is a
GEMV, a softmax, a top-k and a sort (four to six launches).

Differentiable in ``x`` and ``weight`` as the reference is (router training, auxiliary losses):
the backward recomputes the softmax from the saved logits. Same layer as :mod:`kbit_linear._ops`:
the schema, a fake implementation with the checks, the reference as the default implementation;
backends register their kernels.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

__all__ = ["check_router_args", "router_top_k_reference", "router_top_k"]

_NS = "kbit_linear"
_FLOATS = (torch.float16, torch.bfloat16, torch.float32)

torch.library.define(
    f"{_NS}::router_top_k",
    "(Tensor x, Tensor weight, int top_k, bool normalize, bool scores_float) -> (Tensor, Tensor, Tensor)",
)


def check_router_args(x: torch.Tensor, weight: torch.Tensor, top_k: int, normalize: bool, scores_float: bool) -> None:
    """The checks of ``router_top_k`` (metadata only: no pass over values).

    Raises:
        TypeError / ValueError: naming the argument.
    """
    if not isinstance(x, torch.Tensor) or not isinstance(weight, torch.Tensor):
        raise TypeError(f"x and weight must be tensors, got {type(x).__name__} and {type(weight).__name__}")
    if x.dtype not in _FLOATS:
        raise TypeError(f"x must be float16, bfloat16 or float32, got {x.dtype}")
    if weight.dtype != x.dtype:
        raise TypeError(f"weight must have x's dtype {x.dtype}, got {weight.dtype}")
    if x.layout != torch.strided or weight.layout != torch.strided:
        raise TypeError(f"x and weight must be dense (strided) tensors, got {x.layout} and {weight.layout}")
    if x.dim() != 2 or weight.dim() != 2 or x.shape[1] != weight.shape[1]:
        raise ValueError(f"x must be [T, H] and weight [E, H], got {tuple(x.shape)} and {tuple(weight.shape)}")
    if x.device != weight.device:
        raise ValueError(f"x is on {x.device} and weight on {weight.device}: they must share a device")
    experts = weight.shape[0]
    if isinstance(top_k, bool) or not isinstance(top_k, int):
        raise TypeError(f"top_k must be an int, got {type(top_k).__name__}")
    if not 1 <= top_k <= experts:
        raise ValueError(f"top_k must be in [1, {experts}] (the weight's experts), got {top_k}")
    for name, flag in (("normalize", normalize), ("scores_float", scores_float)):
        if not isinstance(flag, bool):
            raise TypeError(f"{name} must be a bool, got {type(flag).__name__}")


@torch.library.register_fake(f"{_NS}::router_top_k")
def _(x, weight, top_k, normalize, scores_float):
    check_router_args(x, weight, top_k, normalize, scores_float)
    t, e = x.shape[0], weight.shape[0]
    return (x.new_empty((t, e)), x.new_empty((t, top_k), dtype=torch.float32 if scores_float else x.dtype),
            x.new_empty((t, top_k), dtype=torch.int64))


def router_top_k_reference(x: torch.Tensor, weight: torch.Tensor, top_k: int, normalize: bool,
                           scores_float: bool) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The spec of ``router_top_k`` (module docstring), on any device."""
    check_router_args(x, weight, top_k, normalize, scores_float)
    with torch.autocast(x.device.type, enabled=False):  # logits in x's dtype, as the schema says, under autocast too
        logits = F.linear(x, weight)
    probs = torch.softmax(logits.float(), dim=-1)
    order = torch.sort(logits.float(), dim=-1, descending=True, stable=True).indices  # stable: ties keep the lower expert first
    index = order[:, :top_k].contiguous()
    scores = probs.gather(1, index)
    if normalize:
        scores = scores / scores.sum(dim=-1, keepdim=True)
    return logits, scores if scores_float else scores.to(logits.dtype), index


torch.library.impl(f"{_NS}::router_top_k", "default")(router_top_k_reference)  # not as a decorator (see _grouped_ops)


def _setup_context(ctx, inputs, output):
    x, weight, _, normalize, _ = inputs
    logits, _, index = output
    ctx.save_for_backward(x, weight, logits, index)
    ctx.normalize = normalize
    ctx.mark_non_differentiable(index)


def _backward(ctx, grad_logits, grad_scores, _grad_index):
    # What autograd gives the reference: the scores' gradient back through the renormalisation,
    # the gathered softmax and the float cast onto the logits, then through F.linear (the experts'
    # choice is a constant, as torch.topk's indices are).
    x, weight, logits, index = ctx.saved_tensors
    g = torch.zeros(logits.shape, dtype=torch.float32, device=logits.device) if grad_logits is None else grad_logits.float()
    if grad_scores is not None:
        with torch.enable_grad():
            l = logits.detach().float().requires_grad_(True)
            picked = torch.softmax(l, dim=-1).gather(1, index)
            if ctx.normalize:
                picked = picked / picked.sum(dim=-1, keepdim=True)
            g = g + torch.autograd.grad(picked, l, grad_scores.float())[0]
    g = g.to(x.dtype)
    grad_x = g @ weight if ctx.needs_input_grad[0] else None
    grad_weight = g.t() @ x if ctx.needs_input_grad[1] else None
    return grad_x, grad_weight, None, None, None


torch.library.register_autograd(f"{_NS}::router_top_k", _backward, setup_context=_setup_context)


def router_top_k(x: torch.Tensor, weight: torch.Tensor, top_k: int, normalize: bool,
                 scores_float: bool) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``torch.ops.kbit_linear.router_top_k``: ``(logits [T, E], scores [T, top_k], index int64 [T, top_k])``
    of the module docstring; the CUDA kernel on CUDA tensors of decode sizes, the reference elsewhere.

    Raises:
        TypeError / ValueError: bad arguments, named (checked here first: the op's dispatcher
            would turn a bool ``top_k`` or a non-bool ``normalize`` into an int or a bool).
    """
    check_router_args(x, weight, top_k, normalize, scores_float)
    return torch.ops.kbit_linear.router_top_k(x, weight, top_k, normalize, scores_float)
