"""Baselines for the accuracy tables: uniform asymmetric round-to-nearest (RTN) and GPTQ, fake-quantized.

Not a storage format of kbit_linear: the weights stay dense, rounded in place to what an
integer ``bits``-bit format with one scale and one zero point per ``group_size`` consecutive
in-features would give (the grid of GPTQ/AWQ-style uniform quantizers without their
calibration). The reference rows of ``scripts/eval_ppl.py``.

Per group ``g`` of one output row: ``scale = (max(g) - min(g)) / (2**bits - 1)``,
``zero = round(-min(g) / scale)``, ``q = clamp(round(w / scale) + zero, 0, 2**bits - 1)``,
``w_hat = (q - zero) * scale``. Stored as fp16 scale and zero, it costs
``bits + 32 / group_size`` bits per weight (:func:`rtn_bits_per_weight`).

GPTQ (:func:`fake_quantize_gptq`, :func:`apply_gptq`): the same grid, rounded column by column
with the layer inputs' Hessian (the error of each column spread over the later ones), on the same
calibration data and block-by-block pass as this project's calibrated rounding
(:mod:`kbit_linear.calibration`). Two orders, as there: in-feature order, each group's scale and
zero taken from the error-updated weights when the sweep reaches the group (AutoGPTQ without
``desc_act``); or activation order (``act_order=True``: descending ``H[j, j]``, every group's grid
taken from the weights as given before the sweep, AutoGPTQ's ``desc_act`` with ``static_groups``).

Mixture-of-experts models: the experts modules :func:`kbit_linear.quantize_model` converts
(:func:`kbit_linear.patch.convertible_experts`) are rounded expert by expert, each expert's
``[out, in]`` matrix of ``gate_up_proj`` and ``down_proj`` on the RTN grid; by :func:`apply_gptq`
too (data-free, as ``quantize_model`` with ``calibration`` leaves the experts data-free).
"""

from __future__ import annotations

from typing import Iterable

import torch
import torch.nn.functional as F
from torch import nn

from .. import format as fmt
from ..calibration import DEFAULT_DAMP, Calibration, calibrate_model, check_damp, check_hessian, damped_inverse_cholesky
from ..experts import PROJECTIONS
from ..patch import SkipRule, convertible_experts, convertible_layers

__all__ = ["fake_quantize_rtn", "rtn_bits_per_weight", "apply_rtn", "fake_quantize_gptq", "apply_gptq"]

_GPTQ_LAZY = 128  # columns per lazy batch of the GPTQ sweep


def _check(bits: int, group_size: int) -> None:
    if isinstance(bits, bool) or not isinstance(bits, int) or not 1 <= bits <= 8:
        raise ValueError(f"bits must be an int in 1..8, got {bits!r}")
    if isinstance(group_size, bool) or not isinstance(group_size, int) or group_size < 1:
        raise ValueError(f"group_size must be a positive int, got {group_size!r}")


def _check_weight(weight: torch.Tensor) -> None:
    if not isinstance(weight, torch.Tensor) or not weight.is_floating_point() or weight.dim() != 2:
        raise TypeError("weight must be a 2-D floating-point torch.Tensor")


def _uniform_grid(g: torch.Tensor, bits: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Scale and zero point of each row of ``g`` ``[..., group]`` (asymmetric, min/max)."""
    lo, hi = g.amin(-1, keepdim=True), g.amax(-1, keepdim=True)
    scale = (hi - lo) / ((1 << bits) - 1)
    scale = torch.where(scale > 0, scale, torch.ones_like(scale))
    return scale, torch.round(-lo / scale)


def fake_quantize_rtn(weight: torch.Tensor, bits: int, group_size: int) -> torch.Tensor:
    """Uniform asymmetric RTN of ``weight`` ``[out, in]`` with groups along in_features.

    Args:
        weight: floating-point ``[out_features, in_features]``; not modified.
        bits: integer width, 1..8.
        group_size: consecutive in-features sharing a scale and zero point (the last group of
            a row may be shorter).

    Returns:
        The rounded weight, same shape and dtype as ``weight``.
    """
    _check(bits, group_size)
    _check_weight(weight)
    n, k = weight.shape
    groups = -(-k // group_size)
    w = weight.detach().float()
    # Pad the last group by repeating its last value: the padding changes neither min nor max.
    if groups * group_size != k:
        w = F.pad(w, (0, groups * group_size - k), mode="replicate")
    g = w.reshape(n, groups, group_size)
    lo, hi = g.amin(-1, keepdim=True), g.amax(-1, keepdim=True)
    scale, zero = _uniform_grid(g, bits)
    q = torch.clamp(torch.round(g / scale) + zero, 0, (1 << bits) - 1)
    # a constant group is stored exactly (scale 0 would be the format's answer)
    w_hat = torch.where(hi > lo, (q - zero) * scale, g)
    return w_hat.reshape(n, groups * group_size)[:, :k].to(weight.dtype)


def rtn_bits_per_weight(bits: int, group_size: int) -> float:
    """Stored bits per weight of RTN with an fp16 scale and an fp16 zero point per group."""
    _check(bits, group_size)
    return bits + 32 / group_size


def _round_experts(model: nn.Module, names: list[str], bits: int, group_size: int) -> None:
    """RTN-round, in place, each expert's matrix of both projections of the experts modules ``names``
    (``[E, out, in]``: one expert at a time, so one expert's temporaries at a time)."""
    done: set[int] = set()
    for name in names:
        module = model.get_submodule(name)
        if id(module) in done:  # reused under several names: rounded once
            continue
        done.add(id(module))
        for proj in PROJECTIONS:
            w = getattr(module, proj)
            for e in range(w.shape[0]):
                w[e].copy_(fake_quantize_rtn(w[e], bits, group_size))


@torch.no_grad()
def apply_rtn(model: nn.Module, bits: int, group_size: int, skip: Iterable[SkipRule] | str | None = ("lm_head",)) -> list[str]:
    """Fake-quantize, in place, the layers and MoE experts modules that :func:`kbit_linear.quantize_model`
    would convert (experts expert by expert).

    Args:
        model: any module.
        bits: integer width, 1..8.
        group_size: in-features per group.
        skip: skip rules as in :func:`kbit_linear.quantize_model` (tied weights are skipped too).

    Returns:
        The names of the rounded layers, then of the rounded experts modules.
    """
    _check(bits, group_size)
    names, _ = convertible_layers(model, skip)
    experts, _ = convertible_experts(model, skip)
    for name in names:
        linear = model.get_submodule(name)
        linear.weight.copy_(fake_quantize_rtn(linear.weight, bits, group_size))
    _round_experts(model, experts, bits, group_size)
    return names + experts


def fake_quantize_gptq(weight: torch.Tensor, hessian: torch.Tensor, bits: int, group_size: int,
                       damp: float = DEFAULT_DAMP, act_order: bool = False) -> torch.Tensor:
    """GPTQ rounding of ``weight`` ``[out, in]`` to the uniform asymmetric grid of
    :func:`fake_quantize_rtn` (groups along in_features).

    Args:
        weight: floating-point ``[out_features, in_features]``; not modified.
        hessian: ``[in_features, in_features]``, ``X^T X`` of the layer's inputs (any positive multiple).
        bits: integer width, 1..8.
        group_size: in-features per group.
        damp: added to the Hessian's diagonal, times its mean.
        act_order: sweep by descending Hessian diagonal, every group's grid fixed up front.

    Returns:
        The rounded weight, same shape and dtype as ``weight``.
    """
    _check(bits, group_size)
    _check_weight(weight)
    fmt.check_bool("act_order", act_order)
    damp = check_damp(damp)
    n, k = weight.shape
    check_hessian(hessian, k)
    w = weight.detach().float().clone()
    h = hessian.detach().float().clone()
    dead = h.diagonal() <= 0
    h[dead, dead] = 1.0
    w[:, dead] = 0.0
    order = None
    if act_order:
        grids = [_uniform_grid(w[:, g0:g0 + group_size], bits) for g0 in range(0, k, group_size)]  # as RTN's
        static_scale = torch.stack([scale for scale, _ in grids], 1)  # [n, groups, 1]
        static_zero = torch.stack([zero for _, zero in grids], 1)
        order = torch.argsort(h.diagonal(), descending=True, stable=True)
        h, w = h[order][:, order], w[:, order]
    u = damped_inverse_cholesky(h, damp)
    qmax = (1 << bits) - 1
    out = torch.empty_like(w)
    scale = zero = None
    for i1 in range(0, k, _GPTQ_LAZY):
        i2 = min(k, i1 + _GPTQ_LAZY)
        w1, err1, u1 = w[:, i1:i2].clone(), torch.zeros(n, i2 - i1, device=w.device), u[i1:i2, i1:i2]
        for i in range(i2 - i1):
            col = i1 + i
            if order is not None:  # the fixed grid of this column's group
                group = int(order[col]) // group_size
                scale, zero = static_scale[:, group, 0], static_zero[:, group, 0]
            elif col % group_size == 0:  # the group's grid from the weights as updated so far
                end = min(col + group_size, k)
                group = torch.cat((w1[:, i:i + (end - col)], w[:, i2:end]), dim=1) if end > i2 else w1[:, i:i + (end - col)]
                scale, zero = _uniform_grid(group, bits)
                scale, zero = scale.squeeze(1), zero.squeeze(1)
            x = w1[:, i]
            q = (torch.clamp(torch.round(x / scale) + zero, 0, qmax) - zero) * scale
            out[:, col] = q
            e = (x - q) / u1[i, i]
            w1[:, i:] -= e.unsqueeze(1) * u1[i, i:].unsqueeze(0)
            err1[:, i] = e
        w[:, i2:] -= err1 @ u[i1:i2, i2:]
    if order is not None:
        out = torch.empty_like(out).index_copy_(1, order, out)  # back to in-feature order
    return out.to(weight.dtype)


@torch.no_grad()
def apply_gptq(model: nn.Module, bits: int, group_size: int, calibration: Calibration,
               skip: Iterable[SkipRule] | str | None = ("lm_head",), progress: bool = True,
               act_order: bool | None = None) -> list[str]:
    """GPTQ-round, in place, the layers that :func:`kbit_linear.quantize_model` would convert,
    block by block on ``calibration``'s data (:func:`kbit_linear.calibration.calibrate_model`),
    in activation order if ``act_order`` (default: ``calibration.act_order``, as the calibrated
    kbit rows use it). MoE experts modules that ``quantize_model`` converts are RTN-rounded after
    the pass, expert by expert (data-free, as ``quantize_model`` with ``calibration`` leaves them).

    Returns:
        The names of the rounded layers, then of the rounded experts modules.
    """
    _check(bits, group_size)
    order = calibration.act_order if act_order is None else fmt.check_bool("act_order", act_order)
    names, _ = convertible_layers(model, skip)
    experts, _ = convertible_experts(model, skip)

    def quantize_layer(name: str, hessian: torch.Tensor) -> None:
        linear = model.get_submodule(name)
        linear.weight.copy_(fake_quantize_gptq(linear.weight, hessian, bits, group_size, act_order=order))

    calibrate_model(model, names, calibration.batches(), quantize_layer, progress=progress, desc="GPTQ baseline")
    _round_experts(model, experts, bits, group_size)  # after the pass: dense experts during it, as quantize_model's
    return names + experts
