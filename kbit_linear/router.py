"""Mixture-of-experts routers in one kernel: :func:`fuse_routers`.

The top-k routers of transformers' MoE families (``MixtralTopKRouter``, ``Qwen2MoeTopKRouter``,
``Qwen3MoeTopKRouter``, ``OlmoeTopKRouter``, ...) compute ``F.linear`` -> softmax -> ``topk`` ->
(renormalise) -> cast: on a GPU at decode sizes that is a GEMV, a softmax, a top-k and its sort,
each a launch that costs more than its work. ``kbit_linear::router_top_k``
(:mod:`kbit_linear._router_ops`) is the same computation, one kernel on CUDA at decode sizes.

:func:`fuse_routers` switches each such router of a model to it, in place: the module's class
becomes a subclass of its own (``Fused<Name>``, with :class:`FusedTopKRouter`) whose forward calls
the op. The module keeps its weight, attributes and state-dict keys, and ``isinstance`` with the
original class still holds (transformers records router logits by class). :func:`unfuse_routers`
gives the original class back. Nothing is quantized: the router weight stays as it is.

Which modules: a module whose class name contains ``Router``, that holds a 2-D floating
``weight`` ``[E, H]`` and nothing else (no bias, no correction buffer, no submodule), an int
``top_k``, and a class ``forward(hidden_states)`` not replaced on the instance, whose output on a
probe input is ``(logits, scores, index)`` equal to the op's reference with the two options the
output shows (scores float32 or in the logits' dtype, read in bfloat16 for a float32 router; scores
summing to one or not). Routers that compute anything else (sigmoid scores, expert groups, a
bias correction) or fail on the probe are left alone, with the reason in the summary. Hidden
states in another dtype than the weight, and autocast, take the original forward.

Results equal the original router's up to the rounding of the logits' sums (the kernel sums in
another order than cuBLAS), which can swap two experts whose logits are within a rounding of each
other. Experts are ranked by logit, so two whose probabilities round to the same float still go
by their logits; equal logits go to the lower expert.
"""

from __future__ import annotations

import copy
import inspect
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from . import _router_ops
from . import format as fmt

__all__ = ["FusedTopKRouter", "RouterFusionSummary", "fuse_routers", "unfuse_routers", "router_options"]

_PROBE_TOKENS = 5
_PROBE_SEED = 0x5EED


class FusedTopKRouter(nn.Module):
    """Mixin of a fused router's class (made by :func:`fuse_routers` as ``Fused<Name>(FusedTopKRouter,
    <Name>)``): ``forward`` is ``kbit_linear::router_top_k`` on the module's ``weight`` and ``top_k``.

    Instance attributes it adds: ``router_normalize`` (scores divided by their sum) and
    ``router_scores_float`` (scores stay float32), read off the original router's output.
    """

    router_normalize: bool
    router_scores_float: bool

    def forward(self, hidden_states: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """``(router_logits [T, E], scores [T, top_k], index int64 [T, top_k])`` for ``hidden_states [..., H]``.

        Hidden states of another dtype than the weight, or autocast, take the original forward
        (whatever casts it makes are its own).

        Raises:
            TypeError: ``hidden_states`` is not a tensor.
        """
        if not isinstance(hidden_states, torch.Tensor):  # (not an AttributeError on .dtype)
            raise TypeError(f"hidden_states must be a torch.Tensor, got {type(hidden_states).__name__}")
        if hidden_states.dtype != self.weight.dtype or torch.is_autocast_enabled(hidden_states.device.type):
            return _original_class(type(self)).forward(self, hidden_states)
        x = hidden_states.reshape(-1, self.weight.shape[1])
        return _router_ops.router_top_k(x, self.weight, int(self.top_k), self.router_normalize, self.router_scores_float)

    def extra_repr(self) -> str:
        e, h = self.weight.shape
        return (f"experts={e}, hidden={h}, top_k={self.top_k}, normalize={self.router_normalize}, "
                f"scores_float={self.router_scores_float} (one kernel: kbit_linear::router_top_k)")

    def __reduce_ex__(self, protocol: Any) -> Any:
        # The made class lives nowhere importable: pickle the original class and rebuild.
        return (_rebuild, (_original_class(type(self)),), self.__getstate__())


_fused_classes: dict[type, type] = {}


def _fused_class(cls: type) -> type:
    made = _fused_classes.get(cls)
    if made is None:
        made = _fused_classes[cls] = type(f"Fused{cls.__name__}", (FusedTopKRouter, cls), {"__module__": __name__})
    return made


def _original_class(fused: type) -> type:
    return fused.__mro__[2]  # Fused<Name> -> FusedTopKRouter -> <Name>


def _rebuild(cls: type) -> nn.Module:
    made = _fused_class(cls)
    return made.__new__(made)


def _router_parts(module: nn.Module) -> str | None:
    """Why ``module`` is not a top-k router with ``weight [E, H]`` and ``top_k`` (or ``None``)."""
    w = getattr(module, "weight", None)
    if not isinstance(w, torch.Tensor) or w.dim() != 2 or w.dtype not in (torch.float16, torch.bfloat16, torch.float32):
        return "no 2-D floating-point weight"
    top_k = getattr(module, "top_k", None)
    if isinstance(top_k, bool) or not isinstance(top_k, int) or not 1 <= top_k <= w.shape[0]:
        return f"top_k={top_k!r} is not an int in [1, {w.shape[0]}]"
    if w.device.type == "meta":
        return "its weight is on the meta device"
    extra = [n for n, _ in (*module.named_parameters(), *module.named_buffers()) if n != "weight"]
    if extra or next(module.children(), None) is not None:
        return f"it holds more than a weight ({', '.join(extra) or 'submodules'}), which the fused forward would ignore"
    if "forward" in vars(module) or hasattr(module, "_hf_hook"):
        # (module hooks are fine: nn.Module.__call__ runs them around any forward)
        return "its forward is replaced on the instance (accelerate or another wrapper), which would bypass the fused one"
    params = list(inspect.signature(type(module).forward).parameters)
    if len(params) != 2:
        return f"its forward takes {params[1:]}, not the hidden states alone"
    return None


def _probe(module: nn.Module, dtype: torch.dtype) -> tuple[torch.Tensor, tuple[torch.Tensor, ...]] | str:
    """``(x, module(x))`` for the probe input in ``dtype``, or why the call failed or did not
    return three tensors."""
    w = module.weight.detach()
    g = torch.Generator(device="cpu").manual_seed(_PROBE_SEED)
    x = torch.randn((_PROBE_TOKENS, w.shape[1]), generator=g) * (1.0 / max(float(w.float().norm(dim=1).mean()), 1e-6))
    x = x.to(w.device, dtype)
    try:
        with torch.no_grad():
            out = type(module).forward(module, x)  # the class's forward: no hooks see the probe
    except Exception as e:  # noqa: BLE001  (any failure leaves the router as it is, with the reason)
        return f"its forward failed on a probe input: {type(e).__name__}: {e}"[:200]
    if not (isinstance(out, tuple) and len(out) == 3 and all(isinstance(t, torch.Tensor) for t in out)):
        return "its forward does not return (logits, scores, index) tensors"
    return x, out


def router_options(module: nn.Module) -> tuple[bool, bool] | str:
    """``(normalize, scores_float)`` of ``kbit_linear::router_top_k`` that reproduce ``module``'s
    forward on a probe input, or why none does (a string).

    The probe: :data:`_PROBE_TOKENS` tokens of seeded Gaussian hidden states (scaled so that the
    logits spread over about one unit) in the weight's dtype and device. The module's output must be a
    tuple of three tensors: logits equal to ``F.linear``'s, the chosen experts' probabilities equal
    to the reference's (up to float32 rounding of the renormalisation) and the scores' dtype that
    the options name.

    Raises:
        TypeError: ``module`` is not an ``nn.Module`` (a reason string is for a module that is
            not such a router, not for a wrong argument).
    """
    fmt.check_module(module, "module")
    why = _router_parts(module)
    if why is not None:
        return why
    w = module.weight.detach()
    probed = _probe(module, w.dtype)
    if isinstance(probed, str):
        return probed
    x, (logits, scores, index) = probed
    top_k = int(module.top_k)
    if tuple(scores.shape) != (_PROBE_TOKENS, top_k) or tuple(index.shape) != (_PROBE_TOKENS, top_k):
        return f"its scores / index are {tuple(scores.shape)} / {tuple(index.shape)}, not [tokens, top_k={top_k}]"
    scores_float = scores.dtype == torch.float32
    if not scores_float and scores.dtype != logits.dtype:
        return f"its scores are {scores.dtype}, neither float32 nor the logits' {logits.dtype}"
    if scores_float and logits.dtype == torch.float32:
        # float32 throughout: whether its scores stay float32 or follow the logits shows in bf16
        probed_half = _probe(copy.deepcopy(module).to(torch.bfloat16), torch.bfloat16)
        if isinstance(probed_half, str):
            return probed_half
        scores_float = probed_half[1][1].dtype == torch.float32
    ref_logits = F.linear(x, w)
    if logits.dtype != ref_logits.dtype or not torch.equal(logits, ref_logits):
        return "its logits are not F.linear(hidden_states, weight)"
    if index.dtype != torch.int64:
        return f"its index is {index.dtype}, not int64"
    # The probabilities of the experts it chose, renormalised or not: whichever matches its scores
    # (the probe's logits spread over about one unit, so the top-k never hold all the mass unless
    # top_k is every expert, where both readings are the same).
    picked = torch.softmax(ref_logits.float(), -1).gather(1, index)
    tol = 1e-5 if scores.dtype == torch.float32 else 1e-2
    errors = {normalize: float((scores.float() - (picked / picked.sum(-1, keepdim=True) if normalize else picked)).abs().max())
              for normalize in (True, False)}
    normalize = min(errors, key=errors.get)
    if errors[normalize] > tol:
        return "its scores are not the top-k softmax probabilities (renormalised or not) of its logits"
    _, ref_scores, _ = _router_ops.router_top_k_reference(x, w, top_k, normalize, scores.dtype == torch.float32)
    if not torch.allclose(scores.float(), ref_scores.float(), rtol=tol, atol=tol):
        return "its experts are not those of the top-k probabilities"
    return normalize, scores_float


@dataclass
class RouterFusionSummary:
    """What :func:`fuse_routers` did: the routers it switched to the one-kernel op and, for every
    router-like module it left alone, why (keyed by module name)."""

    fused: list[str] = field(default_factory=list)
    skipped: dict[str, str] = field(default_factory=dict)

    def __str__(self) -> str:
        lines = [f"fused {len(self.fused)} routers"]
        lines += [f"  skipped {name}: {why}" for name, why in sorted(self.skipped.items())]
        return "\n".join(lines)


def fuse_routers(model: nn.Module) -> RouterFusionSummary:
    """Run every top-k router of ``model`` as one ``kbit_linear::router_top_k`` call, in place
    (module docstring: which modules, and what changes).

    Args:
        model: any module (a transformers MoE model, quantized or not; on the device it runs on,
            since each router is probed there).

    Returns:
        A :class:`RouterFusionSummary`.

    Raises:
        TypeError: ``model`` is not a module.
    """
    fmt.check_module(model, "model")
    summary = RouterFusionSummary()
    for name, module in model.named_modules():
        if "router" not in type(module).__name__.lower():
            continue
        if isinstance(module, FusedTopKRouter):
            summary.skipped[name] = "already fused"
            continue
        options = router_options(module)
        if isinstance(options, str):
            summary.skipped[name] = options
            continue
        module.router_normalize, module.router_scores_float = options
        module.__class__ = _fused_class(type(module))
        summary.fused.append(name)
    return summary


def unfuse_routers(model: nn.Module) -> int:
    """Give every router :func:`fuse_routers` switched its original class (and forward) back, in place.

    Returns:
        The number of routers restored.

    Raises:
        TypeError: ``model`` is not a module.
    """
    fmt.check_module(model, "model")
    restored = 0
    for module in model.modules():
        if isinstance(module, FusedTopKRouter):
            module.__class__ = _original_class(type(module))
            del module.router_normalize, module.router_scores_float
            restored += 1
    if restored and "kbit_router_fusion" in model.__dict__:  # what a fused load reported no longer holds
        del model.kbit_router_fusion
    return restored
