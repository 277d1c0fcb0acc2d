"""Baselines for the accuracy tables: uniform asymmetric round-to-nearest (RTN), fake-quantized.

Not a storage format of kbit_linear: the weights stay dense, rounded in place to what an
integer ``bits``-bit format with one scale and one zero point per ``group_size`` consecutive
in-features would give (the grid of GPTQ/AWQ-style uniform quantizers without their
calibration). The reference rows of ``scripts/eval_ppl.py``.

Per group ``g`` of one output row: ``scale = (max(g) - min(g)) / (2**bits - 1)``,
``zero = round(-min(g) / scale)``, ``q = clamp(round(w / scale) + zero, 0, 2**bits - 1)``,
``w_hat = (q - zero) * scale``. Stored as fp16 scale and zero, it costs
``bits + 32 / group_size`` bits per weight (:func:`rtn_bits_per_weight`).
"""

from __future__ import annotations

from typing import Iterable

import torch
import torch.nn.functional as F
from torch import nn

from ..patch import SkipRule, convertible_layers

__all__ = ["fake_quantize_rtn", "rtn_bits_per_weight", "apply_rtn"]


def _check(bits: int, group_size: int) -> None:
    if isinstance(bits, bool) or not isinstance(bits, int) or not 1 <= bits <= 8:
        raise ValueError(f"bits must be an int in 1..8, got {bits!r}")
    if isinstance(group_size, bool) or not isinstance(group_size, int) or group_size < 1:
        raise ValueError(f"group_size must be a positive int, got {group_size!r}")


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
    if not isinstance(weight, torch.Tensor) or not weight.is_floating_point() or weight.dim() != 2:
        raise TypeError("weight must be a 2-D floating-point torch.Tensor")
    n, k = weight.shape
    groups = -(-k // group_size)
    w = weight.detach().float()
    # Pad the last group by repeating its last value: the padding changes neither min nor max.
    if groups * group_size != k:
        w = F.pad(w, (0, groups * group_size - k), mode="replicate")
    g = w.reshape(n, groups, group_size)
    lo, hi = g.amin(-1, keepdim=True), g.amax(-1, keepdim=True)
    qmax = (1 << bits) - 1
    scale = (hi - lo) / qmax
    scale = torch.where(scale > 0, scale, torch.ones_like(scale))
    zero = torch.round(-lo / scale)
    q = torch.clamp(torch.round(g / scale) + zero, 0, qmax)
    # a constant group is stored exactly (scale 0 would be the format's answer)
    w_hat = torch.where(hi > lo, (q - zero) * scale, g)
    return w_hat.reshape(n, groups * group_size)[:, :k].to(weight.dtype)


def rtn_bits_per_weight(bits: int, group_size: int) -> float:
    """Stored bits per weight of RTN with an fp16 scale and an fp16 zero point per group."""
    _check(bits, group_size)
    return bits + 32 / group_size


@torch.no_grad()
def apply_rtn(model: nn.Module, bits: int, group_size: int, skip: Iterable[SkipRule] | str | None = ("lm_head",)) -> list[str]:
    """Fake-quantize, in place, the layers that :func:`kbit_linear.quantize_model` would convert.

    Args:
        model: any module.
        bits: integer width, 1..8.
        group_size: in-features per group.
        skip: skip rules as in :func:`kbit_linear.quantize_model` (tied weights are skipped too).

    Returns:
        The names of the rounded layers.
    """
    _check(bits, group_size)
    names, _ = convertible_layers(model, skip)
    for name in names:
        linear = model.get_submodule(name)
        linear.weight.copy_(fake_quantize_rtn(linear.weight, bits, group_size))
    return names
