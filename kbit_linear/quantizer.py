"""``quantize_weight``: a dense ``[out, in]`` weight -> the four stored tensors of a quantized layer.

The one path from a dense weight to the tiled format that the modules use:
:meth:`KbitLinear.from_linear <kbit_linear.linear.KbitLinear.from_linear>` (and through it
``quantize_model``) and the transformers plug-in's quantize-at-load all call it. It validates
its arguments once (bits, the weight's dtype, shape and values, the codebook's values), then runs
the ``kbit_linear::quantize`` and ``::repack`` ops on the weight's device, which check metadata
only (the CUDA kernels where the CUDA backend is registered, the format reference elsewhere).

Layering: above the op schemas (``_ops``), below the module (``linear``); pure functions, no
``nn.Module``.
"""

from __future__ import annotations

import warnings
from typing import NamedTuple, Sequence

import torch

from . import _ops  # noqa: F401  (registers the torch.library ops used below)
from . import calibration
from . import codebooks
from . import format as fmt
from . import hadamard

__all__ = ["KbitTensors", "GroupShared", "GROUP_SCALE_SPREAD_MAX", "quantize_weight", "squared_error", "check_hadamard_search", "hadamard_signs_for",
           "group_quantization"]

# Resolved once: an OpOverload call skips the overload lookup of the packet on every call.
_QUANTIZE = torch.ops.kbit_linear.quantize.default
_REPACK = torch.ops.kbit_linear.repack.default


class KbitTensors(NamedTuple):
    """The stored tensors of one quantized ``[out_features, in_features]`` weight (``docs/format.md``).

    Attributes:
        packed: int32 ``[K_pad/64, N_pad/128, 128, 2, bits]`` tiled bit-planes
            (:func:`kbit_linear.format.tiled_shapes`); a ``KbitLinear`` holds it as ``weight``.
        absmax: uint8 ``[K_pad/64, N_pad/128, 128, 2]`` E4M4 block scales.
        codebook: float32 ``[2**bits]``, a fresh tensor (never the caller's).
        tensor_scale: float32 ``[1]``, a power of two.
    """

    packed: torch.Tensor
    absmax: torch.Tensor
    codebook: torch.Tensor
    tensor_scale: torch.Tensor


def quantize_weight(
    weight: torch.Tensor,
    bits: int,
    codebook: torch.Tensor | str | None = None,
    *,
    scale_search: bool = False,
    hessian: torch.Tensor | None = None,
    damp: float = calibration.DEFAULT_DAMP,
    lazy_block: int = calibration.LAZY_BLOCK,
    act_order: bool = calibration.DEFAULT_ACT_ORDER,
    hadamard_signs: torch.Tensor | None = None,
    tensor_scale: torch.Tensor | None = None,
    name: str = "weight",
) -> KbitTensors:
    """Quantize a dense weight to the tiled kbit format, on the weight's device.

    Validates once, here: ``bits``, the weight (floating point, 2-D, non-empty, no NaN/Inf) and
    a user ``codebook`` (size, order, range). The ops it then calls (``kbit_linear::quantize``,
    ``::repack``) check only metadata, so no value is scanned twice. A weight on the meta device
    gives meta tensors of the right shapes (no value checks, nothing allocated).

    Args:
        weight: floating-point ``[out_features, in_features]``; not modified, not kept.
        bits: index width, 2..5.
        codebook: ``[2**bits]`` strictly increasing floats in [-1, 1] (default: the
            normal-float codebook of ``bits``); copied, never aliased. ``"fitted"``: levels
            fitted to this weight (:func:`kbit_linear.codebooks.fit_codebook`, after the
            rotation when there is one, for the scales ``scale_search`` picks).
        scale_search: choose each block's scale for the least squared error
            (:func:`kbit_linear.format.search_block_codes`, in PyTorch on the weight's device)
            instead of rounding its absmax up (the quantize kernel); +1 to +2 dB SQNR on normal
            weights, several times slower.
        hessian: float ``[in_features, in_features]`` ``X^T X`` of the layer's inputs: round with
            GPTQ-style error feedback (:func:`kbit_linear.calibration.gptq_quantize_blocks`, in
            PyTorch on the weight's device) instead of to nearest; same stored format.
        damp: the Hessian's damping (fraction of its mean diagonal) in (0, 1), used with
            ``hessian`` only (checked always).
        lazy_block: with ``hessian``: columns per lazy batch update of the sweep, a positive
            multiple of 32 (checked always).
        act_order: with ``hessian``: sweep the columns by descending Hessian diagonal, block
            scales chosen up front (:func:`kbit_linear.calibration.gptq_quantize_blocks`).
        hadamard_signs: int8 ``[in_features]`` of +-1: quantize ``W R`` instead of ``W``, the
            randomized Hadamard rotation of :mod:`kbit_linear.hadamard` (the layer then rotates
            its inputs by the same signs); ``hessian`` is rotated with it.
        tensor_scale: the power-of-two tensor scale to use instead of the (rotated) weight's own
            (:func:`kbit_linear.format.compute_tensor_scale`), e.g. the one a group of fused
            layers shares (:func:`group_quantization`); it must hold the weight
            (``max|W| / tensor_scale <= 31``). A scale up to ``2**12`` times the weight's own
            costs no measurable precision (randn weights, K = 4); far above, the block scales
            reach E4M4's subnormal range.
        name: what to call ``weight`` in error messages (e.g. ``"model.layers.0.q_proj.weight"``).

    Returns:
        :class:`KbitTensors` ``(packed, absmax, codebook, tensor_scale)``, all on ``weight``'s device.

    Raises:
        TypeError: ``bits`` not an int, ``weight`` not a floating-point tensor, ``codebook`` not
            a floating-point tensor.
        ValueError: ``bits`` not in 2..5; ``weight`` not 2-D, empty or not finite; ``codebook``
            another string than ``"fitted"``, of the wrong size, not strictly increasing, or
            outside [-1, 1]; ``damp`` not in (0, 1); ``lazy_block`` not a positive multiple of
            32; ``hadamard_signs`` not
            int8 ``[in_features]`` of +-1; ``tensor_scale`` not one positive power of two that
            holds the weight (TypeError: not a floating-point tensor). Every message names the argument.
    """
    fmt.check_bits(bits)
    fmt.check_weight(weight, name=name)
    fmt.check_bool("scale_search", scale_search)
    fmt.check_bool("act_order", act_order)
    # checked without a hessian too: a bad value must not pass silently until one is given
    damp = calibration.check_damp(damp)
    calibration.check_lazy_block(lazy_block)
    if hadamard_signs is not None:
        hadamard.check_signs(hadamard_signs, weight.shape[1], "hadamard_signs")
    with torch.no_grad():
        w = weight.detach()
        if hadamard_signs is not None:
            signs = hadamard_signs.to(w.device)
            w = hadamard.rotate(w.to(torch.float32), signs)
            if hessian is not None:
                calibration.check_hessian(hessian, weight.shape[1])  # before the rotation, which would hide a bad one
                hessian = hadamard.rotate_hessian(hessian.to(device=w.device, dtype=torch.float32), signs)
        cb = codebooks.resolve_codebook_option(codebook, w, bits, scale_search=scale_search)
        ts = fmt.compute_tensor_scale(w) if tensor_scale is None else fmt.check_given_tensor_scale(tensor_scale, w, name)
        if hessian is not None and w.device.type != "meta":
            packed_flat, absmax_flat, _ = calibration.gptq_quantize_blocks(
                w, hessian, bits, cb, ts, scale_search=scale_search, damp=damp, lazy_block=lazy_block,
                act_order=act_order)
        elif scale_search and w.device.type != "meta":
            absmax_flat = fmt.search_block_codes(w, cb, ts)
            packed_flat = fmt.quantize_with_codes(w, bits, cb, ts, absmax_flat)
        else:
            packed_flat, absmax_flat = _QUANTIZE(w, cb, ts, bits)
        packed, absmax = _REPACK(packed_flat, absmax_flat, bits)
    return KbitTensors(packed, absmax, cb, ts)


def squared_error(weight: torch.Tensor, bits: int, codebook: torch.Tensor | str | None = None, *, scale_search: bool = False,
                  name: str = "weight") -> float:
    """``||W - Q(W)||^2`` of a float32 ``[out, in]`` weight quantized by :func:`quantize_weight`
    (no rotation: pass the rotated weight to measure a rotated layer) and dequantized in float32."""
    q = quantize_weight(weight, bits, codebook, scale_search=scale_search, name=name)
    qw = fmt.KbitWeight(q.packed, q.absmax, q.codebook, q.tensor_scale, bits, weight.shape[0], weight.shape[1])
    return float((fmt.dequantize(qw, torch.float32) - weight).square().sum())


# ---------------------------------------------------------------------------------------
# the rotation's signs
# ---------------------------------------------------------------------------------------


def check_hadamard_search(candidates: object, name: str = "hadamard_search", *, hadamard: bool | None = None,
                          fuse: bool = False) -> int:
    """``candidates`` as a positive int (sign vectors to try per layer).

    With ``hadamard`` given, also the rules that tie the search to the rotation's other options:
    more than one candidate without the rotation has no effect (a warning, not an error, so that
    configs saved that way still load), and ``fuse`` shares one rotation per group of projections,
    which a per-layer search would break.

    Raises:
        TypeError / ValueError: naming ``name``.
    """
    if isinstance(candidates, bool) or not isinstance(candidates, int):
        raise TypeError(f"{name} must be an int (sign vectors tried per layer), got {type(candidates).__name__}")
    if candidates < 1:
        raise ValueError(f"{name} must be at least 1, got {candidates}")
    if hadamard is not None and candidates > 1:
        if not hadamard:
            warnings.warn(f"{name}={candidates} has no effect without hadamard=True", UserWarning, stacklevel=3)
        elif fuse:
            raise ValueError(f"fuse=True needs one rotation per group of projections: use {name}=1 with it")
    return candidates


def hadamard_signs_for(weight: torch.Tensor, bits: int, codebook: torch.Tensor | str | None = None, *,
                       scale_search: bool = False, seed: int = 0, candidates: int = 1, name: str = "weight") -> torch.Tensor:
    """The sign vector of the randomized Hadamard rotation for ``weight`` (int8 ``[in_features]``).

    Among the vectors seeded ``seed, seed + 1, ..., seed + candidates - 1``
    (:func:`kbit_linear.hadamard.random_signs`), the one whose rotated weight quantizes
    data-free (:func:`quantize_weight` with ``bits``, ``codebook``, ``scale_search``) with the
    least squared error: the error after rounding depends on how the rotation spreads the
    weight's outliers over the blocks, and it varies from one draw to the next. The rotation is
    orthogonal, so the errors compare as they are. ``candidates=1`` (or a weight on the meta
    device) returns the seed's own vector without quantizing. ``name``: what to call the
    weight in error messages.
    """
    candidates = check_hadamard_search(candidates)
    fmt.check_bits(bits)
    fmt.check_weight(weight, name, finite=False)  # the values are checked by quantize_weight below (or by the caller's)
    vectors = [hadamard.random_signs(weight.shape[1], seed + i, weight.device) for i in range(candidates)]
    if candidates == 1 or weight.device.type == "meta":
        return vectors[0]
    best, best_err = vectors[0], float("inf")
    with torch.no_grad():
        w = weight.detach().to(torch.float32)
        for signs in vectors:
            err = squared_error(hadamard.rotate(w, signs), bits, codebook, scale_search=scale_search, name=name)
            if err < best_err:
                best, best_err = signs, err
    return best


# The most the tensor scales of a group's weights may differ by for the group to share the largest:
# up to 2**12 times a weight's own scale cost no measurable precision (K = 4, randn weights), so
# 2**10 leaves a margin.
GROUP_SCALE_SPREAD_MAX = 2.0**10


class GroupShared(NamedTuple):
    """What the layers of a fused group share (:func:`group_quantization`): the levels, and the
    tensor scale or ``None`` where the weights' own differ too much to share one."""

    codebook: torch.Tensor
    tensor_scale: torch.Tensor | None


def group_quantization(weights: Sequence[torch.Tensor], bits: int, codebook: torch.Tensor | str | None = None, *,
                       scale_search: bool = False, hadamard_signs: torch.Tensor | None = None,
                       device: torch.device | str | None = None) -> GroupShared:
    """The levels and the tensor scale of several weights that will share them (the parts of a
    fused GEMM, :mod:`kbit_linear.fusion`), to pass to :func:`quantize_weight` for each.

    The levels: ``codebook`` resolved as :func:`quantize_weight` resolves it for one weight, on
    the weights stacked along out_features (each rotated by ``hadamard_signs`` first, as it will
    be quantized; levels fitted per weight are fitted to all of them together, on at most
    :data:`kbit_linear.codebooks.MAX_FIT_WEIGHTS` weights, rows sampled evenly from each). The
    tensor scale: the largest of the weights' own (:func:`kbit_linear.format.compute_tensor_scale`),
    which holds every one of them, or ``None`` where it is more than :data:`GROUP_SCALE_SPREAD_MAX`
    times the smallest (each weight then keeps its own, and the group cannot fuse). float32
    ``[2**bits]`` and ``[1]`` on ``device`` (default: the first weight's).

    Raises:
        ValueError / TypeError: ``weights`` not a list or tuple of 2-D tensors (TypeError), no
            weights, weights of different in_features, a bad ``codebook``.
    """
    if isinstance(weights, torch.Tensor) or not isinstance(weights, Sequence):  # a stacked tensor is not a group
        raise TypeError(f"weights must be a list or tuple of [out, in] tensors, got {type(weights).__name__}")
    if not weights:
        raise ValueError("weights must hold at least one weight")
    fmt.check_bits(bits)
    for i, w in enumerate(weights):
        fmt.check_weight(w, f"weights[{i}]", finite=False)
        if w.shape[1] != weights[0].shape[1]:
            raise ValueError(f"weights[{i}] has in_features={w.shape[1]}, weights[0] {weights[0].shape[1]}")
    if hadamard_signs is not None:
        hadamard.check_signs(hadamard_signs, weights[0].shape[1], "hadamard_signs")
    device = weights[0].device if device is None else torch.device(device)
    if device.type == "meta" or any(w.device.type == "meta" for w in weights):  # shapes only: nothing to share
        return GroupShared(codebooks.resolve_codebook_option(codebook, weights[0], bits, device=device), None)
    total = sum(w.numel() for w in weights)
    step = max(1, -(-total // codebooks.MAX_FIT_WEIGHTS))  # the same row step in every weight
    with torch.no_grad():
        def prepared(w: torch.Tensor, rows: int = 1) -> torch.Tensor:
            w = w.detach()[::rows].to(device)
            if hadamard_signs is not None:
                w = hadamard.rotate(w.to(torch.float32), hadamard_signs.to(device))
            return w

        own = torch.stack([fmt.compute_tensor_scale(prepared(w)) for w in weights])
        ts = own.amax(0) if bool(own.amax() <= own.amin() * GROUP_SCALE_SPREAD_MAX) else None
        if not codebooks.fits_per_weight(codebook, bits):  # fixed levels: nothing to stack
            levels = codebooks.resolve_codebook_option(codebook, weights[0], bits, scale_search=scale_search, device=device)
        else:
            stacked = torch.cat([prepared(w, step) for w in weights])
            levels = codebooks.resolve_codebook_option(codebook, stacked, bits, scale_search=scale_search, device=device)
    return GroupShared(levels, ts)
