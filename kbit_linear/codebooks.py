"""Fitted codebooks: ``codebook="fitted"``, the ``2**bits`` levels fitted to one weight, data-free.

The stored format keeps a codebook per layer, so each layer may have its own levels. Here they
are fitted to the weight's values in block-normalized space (``w / block scale``, in [-1, 1] with
the round-up scales) by Lloyd-Max iterations: each level moves to the mean of the values nearest
to it, weighted by the block scale squared (so the fit minimizes the squared error of the
weights themselves), starting from the normal-float levels.

The end levels stay at -1 and +1. Every block has a weight at (about) +-1 of its scale, its
largest, and moving the ends inward, which plain Lloyd-Max does to serve the many small weights,
rounds those largest weights down: on SmolLM2-135M and Gemma-3-270M at K = 3, plain Lloyd-Max
levels gave a worse next-token KL than the normal-float ones, fitted levels with fixed ends a
better one (``bench/results/accuracy.md``).

With the block scale search the fit alternates: levels for the round-up scales, scales searched
for those levels, levels refitted for the searched scales.
"""

from __future__ import annotations

import torch

from . import format as fmt

__all__ = ["FITTED", "DEFAULT", "is_fitted", "default_codebook", "resolve_default", "check_codebook_option", "resolve_codebook_option", "fit_codebook"]

FITTED = "fitted"
"""The ``codebook`` value that asks for levels fitted to each weight."""

LLOYD_ITERATIONS = 12
"""Lloyd-Max iterations per fit (the levels move by less than 1e-3 after about ten)."""

MAX_FIT_WEIGHTS = 1 << 22
"""Weights a fit reads at most: larger weights are fitted on evenly spaced rows (a sample)."""

HISTOGRAM_BINS = 4096
"""Bins over [-1, 1] that the block-normalized weights are summarized in before the iterations."""

_MIN_GAP = 1e-3  # the smallest spacing of neighbouring levels: the codebook must stay strictly increasing


DEFAULT = "default"
"""The ``codebook`` value of :func:`kbit_linear.quantize_model` and ``KbitConfig`` when none is
given: resolved by :func:`default_codebook`."""


def default_codebook(hadamard: bool) -> str | None:
    """The codebook option behind :data:`DEFAULT`: fitted levels, or the normal-float levels
    (``None``) for weights quantized with the Hadamard rotation.

    Measured data-free (``bench/results/accuracy.md``, KL to the unquantized model): without the
    rotation the fitted levels beat the normal-float ones at K = 3 and 4 on SmolLM2-135M
    (2.689 -> 1.947, 0.235 -> 0.213), Gemma-3-270M (2.397 -> 2.063, 0.502 -> 0.448) and
    all-MiniLM-L6-v2 (cosine 0.8205 -> 0.8532, 0.9703 -> 0.9729). Rotated weights are close to
    normal, where the normal-float levels already fit: at K = 3, the rotation's main use, they did
    better with it (SmolLM2 1.633 against 1.674 fitted; on Gemma the fit with the rotation, 2.92,
    was worse than the fit alone, 2.06), though at K = 4 the fit still helped SmolLM2 (0.273
    against 0.318).
    """
    if not isinstance(hadamard, bool):
        raise TypeError(f"hadamard must be a bool, got {type(hadamard).__name__}")
    return None if hadamard else FITTED


def resolve_default(codebook: object, hadamard: bool) -> object:
    """``codebook`` itself, or for :data:`DEFAULT` what :func:`default_codebook` gives with
    ``hadamard`` (the one place the user-level entry points resolve it)."""
    if isinstance(codebook, str) and codebook == DEFAULT:
        return default_codebook(hadamard)
    return codebook


def is_fitted(codebook: object) -> bool:
    """Whether ``codebook`` asks for fitted levels (the string ``"fitted"``)."""
    return isinstance(codebook, str) and codebook == FITTED


def check_codebook_option(codebook: object, bits: int, name: str = "codebook") -> torch.Tensor | str | None:
    """``codebook`` as the quantizers take it: ``None`` (normal-float), ``"fitted"``, or a
    validated tensor (:func:`kbit_linear.format.validate_codebook`).

    Raises:
        ValueError: another string, or an invalid codebook tensor.
    """
    if codebook is None or is_fitted(codebook):
        return codebook
    if isinstance(codebook, str):
        raise ValueError(f"{name} must be a tensor of {1 << bits} levels, None or {FITTED!r}, got {codebook!r}")
    return fmt.validate_codebook(codebook, bits, name)


def resolve_codebook_option(codebook: torch.Tensor | str | None, weight: torch.Tensor, bits: int, *,
                            scale_search: bool = False, device: torch.device | None = None) -> torch.Tensor:
    """The levels to quantize ``weight`` (2-D) with, as a fresh float32 tensor on ``device``
    (default: the weight's): fitted to it for ``"fitted"`` (the normal-float levels on the meta
    device), else :func:`kbit_linear.format.resolve_codebook` (normal-float for ``None``, a
    tensor validated once)."""
    device = weight.device if device is None else device
    if is_fitted(codebook):
        if weight.device.type == "meta" or device.type == "meta":
            return fmt.resolve_codebook(None, bits, device)
        return fit_codebook(weight, bits, scale_search=scale_search).to(device)
    if isinstance(codebook, str):
        check_codebook_option(codebook, bits)  # raises, naming the strings it takes
    return fmt.resolve_codebook(codebook, bits, device)


def fit_codebook(weight: torch.Tensor, bits: int, *, scale_search: bool = False, iterations: int = LLOYD_ITERATIONS) -> torch.Tensor:
    """``2**bits`` increasing levels in [-1, 1], ends at -1 and +1, fitted to ``weight``.

    Args:
        weight: floating-point ``[out, in]``, finite (the values are not checked here); a
            weight of more than :data:`MAX_FIT_WEIGHTS` elements is fitted on evenly spaced rows.
        bits: index width, 2..5.
        scale_search: fit for the scales the block scale search picks (alternating, see the
            module docstring) instead of the round-up ones.
        iterations: Lloyd-Max iterations per fit.

    Returns:
        float32 ``[2**bits]`` on ``weight``'s device, the same on every device and in every run.
    """
    fmt.check_bits(bits)
    fmt.check_weight(weight, finite=False)  # 2-D floating point; the values are the caller's to check
    if isinstance(iterations, bool) or not isinstance(iterations, int) or iterations < 1:
        raise ValueError(f"iterations must be a positive int, got {iterations!r}")
    w = weight.detach()
    if w.numel() > MAX_FIT_WEIGHTS:  # sample rows before any copy
        w = w[:: -(-w.numel() // MAX_FIT_WEIGHTS)]
    w = w.to(torch.float32)
    cb = fmt.create_normal_float_codebook(bits, w.device)
    if w.numel() == 0 or not bool(w.abs().amax() > 0):
        return cb
    ts = fmt.compute_tensor_scale(w)
    blocks = fmt._blocks_of(w)
    # the zero padding of a last, partial block is not a weight: it takes no part in the fit
    valid = (torch.arange(blocks.shape[1] * fmt.BLOCK_SIZE, device=w.device) < w.shape[1]).reshape(blocks.shape[1], fmt.BLOCK_SIZE)
    codes = fmt._round_up_codes(blocks, ts)
    for round_ in range(2 if scale_search else 1):
        if round_:
            codes = fmt.search_block_codes(w, cb.to(w.device), ts)
        scale = fmt._block_scales(codes, ts).unsqueeze(-1)
        # every element, no boolean selection (slow on large weights): padding and all-zero
        # blocks get mass 0, which adds nothing to the sums below
        live = scale > 0
        values = (blocks / torch.where(live, scale, 1.0)).clamp_(-1.0, 1.0)
        mass = (scale.square() * (live & valid)).expand_as(blocks)
        # The sums run on the CPU, in a fixed order: a GPU's scatter and index adds are atomics in
        # any order, which would make the levels differ in their last bits from run to run and
        # from the CPU's (the elementwise work above is exact on every device).
        centers, mass = _histogram(values.reshape(-1).cpu(), mass.reshape(-1).cpu())
        cb = _lloyd(centers, mass, cb.cpu(), iterations)
    return cb.to(w.device)


def _histogram(values: torch.Tensor, mass: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``values`` in [-1, 1] with weights ``mass`` summarized as :data:`HISTOGRAM_BINS` equal
    bins: each non-empty bin's weighted mean and total weight. The fit then iterates over the
    bins, not the weights (one pass over the data instead of one per iteration); a bin is
    1/2048 wide, far below the spacing of the levels."""
    pos = ((values + 1.0) * (HISTOGRAM_BINS / 2)).to(torch.int64).clamp_(0, HISTOGRAM_BINS - 1)
    total = torch.zeros(HISTOGRAM_BINS, dtype=torch.float64, device=values.device).index_add_(0, pos, mass.to(torch.float64))
    moment = torch.zeros_like(total).index_add_(0, pos, (mass * values).to(torch.float64))
    used = total > 0
    return (moment[used] / total[used]).to(torch.float32), total[used].to(torch.float32)


def _lloyd(values: torch.Tensor, mass: torch.Tensor, levels: torch.Tensor, iterations: int) -> torch.Tensor:
    """Lloyd-Max on 1-D ``values`` with weights ``mass``, from ``levels``; the end levels stay
    at -1 and +1, a level with no values keeps its place, neighbours stay ``_MIN_GAP`` apart."""
    c = levels.clone()
    n = c.numel()
    for _ in range(iterations):
        idx = torch.searchsorted((c[:-1] + c[1:]) * 0.5, values)
        total = torch.zeros_like(c).scatter_add_(0, idx, mass)
        moment = torch.zeros_like(c).scatter_add_(0, idx, mass * values)
        c = torch.where(total > 0, moment / total.clamp_min(torch.finfo(torch.float32).tiny), c)
        c[0], c[-1] = -1.0, 1.0
        c = torch.sort(c).values
        # strictly increasing, ends fixed: push up from the left, then down from the right (the
        # usual case, levels already that far apart, skips the element-by-element passes)
        if bool((c[1:] >= c[:-1] + _MIN_GAP).all()) and bool((c[:-1] <= c[1:] - _MIN_GAP).all()):
            continue
        for i in range(1, n - 1):
            c[i] = torch.maximum(c[i], c[i - 1] + _MIN_GAP)
        for i in range(n - 2, 0, -1):
            c[i] = torch.minimum(c[i], c[i + 1] - _MIN_GAP)
    return c
