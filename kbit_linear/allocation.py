"""Bit widths per layer to a budget: ``target_bpw``, data-free.

A layer's sensitivity at width ``b`` is the relative squared error of its quantized weight,
``||W - Q_b(W)||^2 / ||W||^2``, measured with the quantization the layer will get (codebook,
scale search, Hadamard rotation). The model's loss grows about as the sum of these errors over
the layers (the "linearity theorem" of data-free dynamic quantization, HIGGS), so the widths
are chosen to minimize that sum while the mean width over all weights (each layer weighted by
its weight count) stays at or below ``target_bpw``.

The minimization is greedy on marginal gains: every layer starts at the narrowest width, then
the upgrade by one width with the largest error drop per added bit (drop / the layer's weight
count) is taken while it fits the budget, until none fits. The errors fall steeply and convexly
with the width (about 4x per bit for normal weights), where greedy is optimal up to the last
upgrade that did not fit.

Mixture-of-experts layers take part as units of one width each (a ``KbitExperts`` module has
one): an experts module's error is ``2 * e(gate_up) + e(down)``, the error of the stacked
matrices quantized expert by expert, counted as the three projections (gate, up, down) of a
dense MLP would be, and its size is all its experts' weights.

``target_bpw`` counts index bits (the K of each layer); what is stored per weight adds the E4M4
block scales (8/32 bit) and the tiles' padding (:func:`kbit_linear.tools.evaluation.stored_bits_per_weight`).
"""

from __future__ import annotations

import math
import numbers
from collections.abc import Iterable, Mapping, Sequence

import torch
from tqdm.auto import tqdm

from . import codebooks
from . import format as fmt
from . import hadamard as hd
from .quantizer import squared_error

__all__ = ["BIT_CHOICES", "check_target_bpw", "check_codebook_for_widths", "relative_errors", "experts_relative_errors",
           "allocate_bits", "plan_layer_bits", "EXPERTS_ERROR_FACTORS"]

EXPERTS_ERROR_FACTORS: dict[str, float] = {"gate_up_proj": 2.0, "down_proj": 1.0}
"""Weight of each experts projection's relative error in its module's error: gate_up holds two
projections of a dense MLP (gate and up), down one."""

BIT_CHOICES: tuple[int, ...] = tuple(fmt.SUPPORTED_BITS)
"""The widths the allocation chooses from."""


def check_target_bpw(target_bpw: object, name: str = "target_bpw") -> float:
    """``target_bpw`` as a float in ``[min(BIT_CHOICES), max(BIT_CHOICES)]``.

    Raises:
        TypeError: not a real number.
        ValueError: outside the widths' range.
    """
    if isinstance(target_bpw, bool) or not isinstance(target_bpw, (int, float)):
        raise TypeError(f"{name} must be a number of bits per weight, got {type(target_bpw).__name__}")
    value = float(target_bpw)
    if not min(BIT_CHOICES) <= value <= max(BIT_CHOICES):
        raise ValueError(f"{name} must be between {min(BIT_CHOICES)} and {max(BIT_CHOICES)} bits per weight, got {target_bpw!r}")
    return value


def check_codebook_for_widths(codebook: object) -> None:
    """Refuse a codebook tensor (or list) where each layer's width is chosen: one set of levels
    has one width. ``None`` (normal-float) and the option strings (``"default"``, ``"fitted"``,
    ...) serve every width.

    Raises:
        ValueError: naming the conflict.
    """
    if not codebooks.is_per_weight(codebook):
        raise ValueError("target_bpw chooses each layer's width, and a codebook fixes it: pass one or the other "
                         f"(or codebook={codebooks.FITTED!r})")


def _check_not_meta(weight: torch.Tensor, name: str) -> None:
    if weight.device.type == "meta":
        raise ValueError(f"{name} is on the meta device: measuring its error needs real weights")


def relative_errors(weight: torch.Tensor, *, codebook: str | None = None, scale_search: bool = False,
                    hadamard_signs: torch.Tensor | None = None, bit_choices: Sequence[int] = BIT_CHOICES,
                    name: str = "weight") -> dict[int, float]:
    """``{bits: ||W - Q_bits(W)||^2 / ||W||^2}`` for one ``[out, in]`` weight at each width.

    Quantized as :func:`kbit_linear.quantizer.quantize_weight` does with the normal-float
    codebook of each width (``codebook=None``) or levels fitted per width (``"fitted"``),
    ``scale_search`` and ``hadamard_signs`` (the rotation is
    orthogonal: the error is measured on the rotated weight, where it is the same). A zero weight
    has error 0 at every width.

    Raises:
        TypeError / ValueError: a bad ``weight`` (named ``name``), a meta weight, or
            ``hadamard_signs`` not int8 ``[in_features]`` of +-1.
    """
    fmt.check_weight(weight, name, finite=False)  # the values are checked where it is quantized
    _check_not_meta(weight, name)
    if hadamard_signs is not None:  # quantize_weight's check, which the rotation here bypasses
        hd.check_signs(hadamard_signs, weight.shape[1], "hadamard_signs")
    with torch.no_grad():
        w = weight.detach().to(torch.float32)
        if hadamard_signs is not None:
            w = hd.rotate(w, hadamard_signs.to(w.device))
        # over the format's power-of-two tensor scale: the same ratios (quantizing commutes with
        # the factor), and the float32 squared sums neither overflow (|w| ~ 1e20) nor underflow (~1e-25)
        w = w / fmt.compute_tensor_scale(w)
        norm = float(w.square().sum())
        out = {}
        for bits in bit_choices:
            # w is already rotated (once, here): quantizing it is what quantize_weight does after its own rotation
            err = squared_error(w, bits, codebook, scale_search=scale_search, name=name)
            out[bits] = err / norm if norm > 0 else 0.0
    return out


def experts_relative_errors(weight: torch.Tensor, *, codebook: str | None = None, scale_search: bool = False,
                            bit_choices: Sequence[int] = BIT_CHOICES, name: str = "weight") -> dict[int, float]:
    """``{bits: ||W - Q_bits(W)||^2 / ||W||^2}`` for ``E`` stacked matrices ``[E, out, in]``
    quantized as :func:`kbit_linear.experts.quantize_experts_weight` does: expert by expert,
    with one set of levels for all of them (normal-float, or ``"fitted"`` to all the experts'
    weights). One expert's temporaries at a time."""
    if not isinstance(weight, torch.Tensor) or weight.dim() != 3 or weight.numel() == 0:
        raise ValueError(f"{name} must be a non-empty 3-D [experts, out_features, in_features] tensor, "
                         f"got {getattr(weight, 'shape', type(weight).__name__)}")
    _check_not_meta(weight, name)
    with torch.no_grad():
        e, n, k = weight.shape
        # one power-of-two tensor scale for all the experts, as in relative_errors (from each expert's
        # max, so that no temporary of the whole stack is made), applied expert by expert
        scale = fmt.compute_tensor_scale(torch.stack([weight[i].detach().abs().amax() for i in range(e)]))

        def expert(i: int) -> torch.Tensor:
            return weight[i].detach().to(torch.float32) / scale

        norm = sum(float(expert(i).square().sum()) for i in range(e))
        out = {}
        for bits in bit_choices:
            cb = codebooks.resolve_codebook_option(codebook, weight.detach().reshape(e * n, k), bits, scale_search=scale_search)
            err = 0.0
            for i in range(e):
                err += squared_error(expert(i), bits, cb, scale_search=scale_search, name=f"{name}[expert {i}]")
            out[bits] = err / norm if norm > 0 else 0.0
    return out


def allocate_bits(errors: Mapping[str, Mapping[int, float]], sizes: Mapping[str, int], target_bpw: float) -> dict[str, int]:
    """The width of each layer: least total error with the size-weighted mean width <= ``target_bpw``.

    Args:
        errors: layer name -> ``{bits: relative error}`` over the same widths for every layer
            (each error a finite number >= 0).
        sizes: layer name -> its weight count (``out * in``), for every layer of ``errors``.
        target_bpw: the budget, in index bits per weight, within the widths' range.

    Returns:
        layer name -> bits, in ``errors``' order.

    Raises:
        TypeError: ``errors`` or ``sizes`` is not a mapping.
        ValueError: naming the entry that is malformed, or a ``target_bpw`` out of range.
    """
    for arg, value in (("errors", errors), ("sizes", sizes)):
        if not isinstance(value, Mapping):
            raise TypeError(f"{arg} must be a mapping of layer names, got {type(value).__name__}")
    if not errors:
        return {}
    for name, errs in errors.items():
        if not isinstance(errs, Mapping) or not errs or any(isinstance(b, bool) or not isinstance(b, int) for b in errs):
            raise ValueError(f"errors[{name!r}] must be a non-empty mapping of bit widths (ints) to errors, got {errs!r}")
        # a NaN would silently never be upgraded (no gain compares greater than it)
        if any(isinstance(e, bool) or not isinstance(e, numbers.Real) or not math.isfinite(e) or e < 0 for e in errs.values()):
            raise ValueError(f"errors[{name!r}] must map each width to a finite error >= 0, got {errs!r}")
    if set(sizes) != set(errors) or any(isinstance(sizes[n], bool) or not isinstance(sizes[n], int) or sizes[n] < 1 for n in errors):
        raise ValueError("sizes must give a positive weight count for every layer of errors, and no other")
    choices = sorted(next(iter(errors.values())))
    if any(sorted(e) != choices for e in errors.values()):
        raise ValueError("errors must cover the same widths for every layer")
    target_bpw = check_target_bpw(target_bpw)
    if not choices[0] <= target_bpw <= choices[-1]:
        raise ValueError(f"target_bpw={target_bpw} is outside the widths {choices[0]}..{choices[-1]}")
    total = sum(sizes.values())
    budget = target_bpw * total
    level = {n: 0 for n in errors}  # index into choices
    used = choices[0] * total
    while True:
        best, best_gain = None, 0.0
        for n, i in level.items():
            if i + 1 == len(choices):
                continue
            cost = (choices[i + 1] - choices[i]) * sizes[n]
            if used + cost > budget + 1e-9 * total:
                continue
            gain = (errors[n][choices[i]] - errors[n][choices[i + 1]]) / cost
            if gain > best_gain:  # only upgrades that lower the error spend bits
                best, best_gain = n, gain
        if best is None:
            return {n: choices[i] for n, i in level.items()}
        used += (choices[level[best] + 1] - choices[level[best]]) * sizes[best]
        level[best] += 1


def plan_layer_bits(layers: Iterable[tuple[str, torch.Tensor]], target_bpw: float, *, codebook: str | None = None,
                    scale_search: bool = False, hadamard: bool = False, progress: bool = True,
                    experts: Iterable[tuple[str, Mapping[str, torch.Tensor]]] = ()) -> dict[str, int]:
    """The width of each ``(name, weight)`` layer (and each experts module) for a mean of
    ``target_bpw`` index bits per weight.

    ``codebook``: ``None`` (normal-float) or ``"fitted"``.
    Measures :func:`relative_errors` at every width of :data:`BIT_CHOICES` (each weight is
    quantized once per width: about four times the work of quantizing it once), with the
    rotation a layer of that name gets under ``hadamard`` (signs seeded by
    :func:`kbit_linear.hadamard.layer_seed`), then :func:`allocate_bits`. ``experts``: ``(name,
    {"gate_up_proj": [E, 2I, H], "down_proj": [E, H, I]})`` of each experts module, measured
    with :func:`experts_relative_errors` (experts are not rotated) and weighted by
    :data:`EXPERTS_ERROR_FACTORS`; each gets one width.
    """
    target_bpw = check_target_bpw(target_bpw)
    check_codebook_for_widths(codebook)
    fmt.check_bool("hadamard", hadamard)
    layers, experts = _named_pairs(layers, "layers"), _named_pairs(experts, "experts")
    seen: set[str] = set()
    for name, _ in (*layers, *experts):  # one budget entry per name: a repeat would replace the first
        if name in seen:
            raise ValueError(f"the name {name!r} is given twice (layers and experts must each have their own name)")
        seen.add(name)
    errors: dict[str, dict[int, float]] = {}
    sizes: dict[str, int] = {}
    for name, weight in tqdm(layers, desc="kbit bit widths (sensitivity)", unit="layer", disable=not progress):
        if not isinstance(weight, torch.Tensor) or weight.dim() != 2:
            raise ValueError(f"layer {name!r}: the weight must be a 2-D tensor [out, in], got "
                             f"{tuple(weight.shape) if isinstance(weight, torch.Tensor) else type(weight).__name__}")
        signs = hd.random_signs(weight.shape[1], hd.layer_seed(name), weight.device) if hadamard else None
        errors[name] = relative_errors(weight, codebook=codebook, scale_search=scale_search, hadamard_signs=signs,
                                       name=f"{name}.weight")
        sizes[name] = weight.numel()
    for name, projections in tqdm(experts, desc="kbit bit widths (experts)", unit="module", disable=not progress):
        if not isinstance(projections, Mapping) or set(projections) != set(EXPERTS_ERROR_FACTORS):
            got = sorted(projections) if isinstance(projections, Mapping) else type(projections).__name__
            raise ValueError(f"experts {name!r}: expected the projections {sorted(EXPERTS_ERROR_FACTORS)}, got {got}")
        total = dict.fromkeys(BIT_CHOICES, 0.0)
        for proj, weight in projections.items():
            errs = experts_relative_errors(weight, codebook=codebook, scale_search=scale_search, name=f"{name}.{proj}")
            for bits, err in errs.items():
                total[bits] += EXPERTS_ERROR_FACTORS[proj] * err
        errors[name] = total
        sizes[name] = sum(w.numel() for w in projections.values())
    return allocate_bits(errors, sizes, target_bpw)


def _named_pairs(items: object, arg: str) -> list[tuple[str, object]]:
    """``items`` (an iterable of ``(name, value)`` pairs) as a list, each pair checked."""
    if isinstance(items, (str, bytes, Mapping)) or not isinstance(items, Iterable):
        raise TypeError(f"{arg} must be an iterable of (name, value) pairs, got {type(items).__name__}")
    out = list(items)
    for item in out:
        if not isinstance(item, (tuple, list)) or len(item) != 2 or not isinstance(item[0], str):
            raise TypeError(f"{arg} must be an iterable of (name, value) pairs with str names, got an item of type "
                            f"{type(item).__name__}" + (f" and length {len(item)}" if isinstance(item, (tuple, list)) else ""))
    return out
