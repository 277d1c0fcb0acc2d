"""Codebook options beyond the normal-float levels: fitted, with a zero, and the default per width.

Fitted codebooks: ``codebook="fitted"``, the ``2**bits`` levels fitted to one weight, data-free.

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

Levels with a zero: the normal-float levels have none, so every near-zero weight (most weights
of a block whose scale its largest weight sets) moves by the smallest level, ~0.15 of the scale
at K = 3. ``"nf-zero"`` takes QLoRA's NF4 construction at every width
(:func:`normal_float_zero_codebook`), ``"fitted-zero"`` fits from it holding -1, 0 and +1. The
default (:data:`DEFAULT`) chooses per width among these by measurement (:data:`DEFAULT_BY_WIDTH`).
"""

from __future__ import annotations

import torch

from . import format as fmt

__all__ = ["FITTED", "FITTED_ZERO", "NF_ZERO", "DEFAULT", "OPTIONS", "DEFAULT_BY_WIDTH", "is_fitted", "is_per_weight",
           "default_codebook", "resolve_default", "check_codebook_option", "resolve_codebook_option",
           "normal_float_zero_codebook", "fit_codebook", "fits_per_weight"]

FITTED = "fitted"
"""The ``codebook`` value that asks for levels fitted to each weight."""

FITTED_ZERO = "fitted-zero"
"""Levels fitted to each weight that keep a level at exactly 0 (the fit starts from
:func:`normal_float_zero_codebook` and holds -1, 0 and +1 in place)."""

NF_ZERO = "nf-zero"
"""The fixed levels of :func:`normal_float_zero_codebook` (normal-float levels with a zero level)."""

LLOYD_ITERATIONS = 12
"""Lloyd-Max iterations per fit (the levels move by less than 1e-3 after about ten)."""

MAX_FIT_WEIGHTS = 1 << 22
"""Weights a fit reads at most: larger weights are fitted on evenly spaced rows (a sample)."""

HISTOGRAM_BINS = 4096
"""Bins over [-1, 1] that the block-normalized weights are summarized in before the iterations."""

_MIN_GAP = 1e-3  # the smallest spacing of neighbouring levels: the codebook must stay strictly increasing


DEFAULT = "default"
"""The ``codebook`` value of :func:`kbit_linear.quantize_model` and ``KbitConfig`` when none is
given: resolved by :func:`default_codebook`, then per layer width by :data:`DEFAULT_BY_WIDTH`."""

OPTIONS = (FITTED, FITTED_ZERO, NF_ZERO, DEFAULT)
"""The strings a ``codebook`` argument takes (besides ``None``, the normal-float levels, and a tensor)."""

DEFAULT_BY_WIDTH = {2: FITTED, 3: NF_ZERO, 4: FITTED_ZERO, 5: FITTED}
"""What :data:`DEFAULT` quantizes a weight of each width with (without the Hadamard rotation).

Measured data-free (round-up scales, KL of the next token to the unquantized model, 4 x 512
tokens; ``bench/results/accuracy.md``, "Levels with a zero"): a level at exactly 0 serves the
many weights near zero that the normal-float levels (none at 0) round to +-0.15 of the block
scale. K = 3, fitted / nf-zero / fitted-zero: Gemma-3-270M 2.059 / 1.632 / 1.943, SmolLM2-135M
1.879 / 1.038 / 0.935, all-MiniLM-L6-v2 cosine 0.853 / 0.875 / 0.875; K = 4: Gemma 0.461 /
0.372 / 0.354, SmolLM2 0.210 / 0.246 / 0.214, MiniLM 0.9729 / 0.9697 / 0.9758. K = 5 keeps the
fitted levels (fitted / fitted-zero: Gemma 0.086 / 0.126, SmolLM2 0.057 / 0.069), and so does
K = 2 (data-free K = 2 is unusable with any of them; the calibrated K = 2 rows were measured
with the fitted ones)."""


def default_codebook(hadamard: bool) -> str | None:
    """The codebook option behind :data:`DEFAULT`: the normal-float levels (``None``) for weights
    quantized with the Hadamard rotation, else :data:`DEFAULT` itself, which each weight resolves
    by its width (:data:`DEFAULT_BY_WIDTH`: levels with a zero at K = 3 and 4).

    The first measurements, before the zero levels (fitted vs normal-float levels):

    Measured data-free (``bench/results/accuracy.md``, KL to the unquantized model): without the
    rotation the fitted levels beat the normal-float ones at K = 3 and 4 on SmolLM2-135M
    (2.689 -> 1.947, 0.235 -> 0.213), Gemma-3-270M (2.397 -> 2.063, 0.502 -> 0.448) and
    all-MiniLM-L6-v2 (cosine 0.8205 -> 0.8532, 0.9703 -> 0.9729). Rotated weights are close to
    normal, where the normal-float levels already fit: at K = 3, the rotation's main use, they did
    better with it (SmolLM2 1.633 against 1.674 fitted; on Gemma the fit with the rotation, 2.92,
    was worse than the fit alone, 2.06), though at K = 4 the fit still helped SmolLM2 (0.273
    against 0.318).
    """
    return None if fmt.check_bool("hadamard", hadamard) else DEFAULT


def resolve_default(codebook: object, hadamard: bool, calibrated: bool = False) -> object:
    """``codebook`` itself, or for :data:`DEFAULT` what :func:`default_codebook` gives with
    ``hadamard`` (the one place the user-level entry points resolve it). With calibrated
    (GPTQ-style) rounding :data:`DEFAULT` is the fitted levels: Gemma-3-270M, K = 3 calibrated,
    KL 0.518 with them against 0.605 with nf-zero (``bench/results/accuracy.md``), the reverse of
    the data-free order."""
    if isinstance(codebook, str) and codebook == DEFAULT:
        resolved = default_codebook(hadamard)
        return FITTED if calibrated and resolved == DEFAULT else resolved
    return codebook


def is_fitted(codebook: object) -> bool:
    """Whether ``codebook`` asks for fitted levels (the string ``"fitted"``)."""
    return isinstance(codebook, str) and codebook == FITTED


def is_per_weight(codebook: object) -> bool:
    """Whether ``codebook`` names levels chosen for each weight and width (``None`` or one of
    :data:`OPTIONS`) rather than fixing them (a tensor or a list of levels)."""
    return codebook is None or (isinstance(codebook, str) and codebook in OPTIONS)


def fits_per_weight(codebook: object, bits: int) -> bool:
    """Whether ``codebook`` at width ``bits`` means levels fitted to each weight (``"fitted"``,
    ``"fitted-zero"``, or :data:`DEFAULT` where :data:`DEFAULT_BY_WIDTH` fits at that width)."""
    codebook = _at_width(codebook, bits)
    return isinstance(codebook, str) and codebook in (FITTED, FITTED_ZERO)


def _at_width(codebook: object, bits: int) -> object:
    """``codebook`` itself, or for :data:`DEFAULT` the option :data:`DEFAULT_BY_WIDTH` gives ``bits``."""
    if isinstance(codebook, str) and codebook == DEFAULT:
        return DEFAULT_BY_WIDTH[fmt.check_bits(bits)]
    return codebook


def check_codebook_option(codebook: object, bits: int, name: str = "codebook") -> torch.Tensor | str | None:
    """``codebook`` as the quantizers take it: ``None`` (normal-float), one of :data:`OPTIONS`, or
    a validated tensor (:func:`kbit_linear.format.validate_codebook`).

    Raises:
        ValueError: another string, or an invalid codebook tensor.
    """
    if is_per_weight(codebook):
        return codebook
    if isinstance(codebook, str):
        raise ValueError(f"{name} must be a tensor of {1 << bits} levels, None or one of {list(OPTIONS)}, got {codebook!r}")
    return fmt.validate_codebook(codebook, bits, name)


def resolve_codebook_option(codebook: torch.Tensor | str | None, weight: torch.Tensor, bits: int, *,
                            scale_search: bool = False, device: torch.device | str | None = None) -> torch.Tensor:
    """The levels to quantize ``weight`` (2-D) with, as a fresh float32 tensor on ``device``
    (default: the weight's): for :data:`DEFAULT` those of :data:`DEFAULT_BY_WIDTH`; fitted to it
    for ``"fitted"`` / ``"fitted-zero"`` (on the meta device the levels the fit starts from);
    :func:`normal_float_zero_codebook` for ``"nf-zero"``; else
    :func:`kbit_linear.format.resolve_codebook` (normal-float for ``None``, a tensor validated once)."""
    if not isinstance(weight, torch.Tensor):
        raise TypeError(f"weight must be a torch.Tensor, got {type(weight).__name__}")
    device = weight.device if device is None else torch.device(device)
    codebook = _at_width(codebook, bits)
    if isinstance(codebook, str) and codebook == NF_ZERO:
        return normal_float_zero_codebook(bits, device)
    if isinstance(codebook, str) and codebook in (FITTED, FITTED_ZERO):
        zero = codebook == FITTED_ZERO
        if weight.device.type == "meta" or device.type == "meta":
            return normal_float_zero_codebook(bits, device) if zero else fmt.resolve_codebook(None, bits, device)
        return fit_codebook(weight, bits, scale_search=scale_search, zero=zero).to(device)
    if isinstance(codebook, str):
        check_codebook_option(codebook, bits)  # raises, naming the strings it takes
    return fmt.resolve_codebook(codebook, bits, device)


def normal_float_zero_codebook(bits: int, device: torch.device | str | None = None) -> torch.Tensor:
    """Normal-float levels with a level at exactly 0 (the construction of QLoRA's NF4):
    ``2**(bits-1) - 1`` negative levels, 0, and ``2**(bits-1)`` positive ones, each half the
    standard normal quantiles of evenly spaced probabilities between the tail offset
    ``1/2**(bits+2)`` (``1 - `` it) and 1/2, scaled so the ends are -1 and +1.

    Args:
        bits: index width, 2..5.
        device: where to put the levels.

    Returns:
        float32 ``[2**bits]``, strictly increasing, ``[-1, ..., 0, ..., 1]``.
    """
    fmt.check_bits(bits)
    half = 1 << (bits - 1)
    tail = 1.0 / (1 << (bits + 2))
    neg = torch.special.ndtri(torch.linspace(tail, 0.5, half, dtype=torch.float64))[:-1]
    pos = torch.special.ndtri(torch.linspace(0.5, 1.0 - tail, half + 1, dtype=torch.float64))[1:]
    levels = torch.cat([neg / -neg[0], torch.zeros(1, dtype=torch.float64), pos / pos[-1]])
    return levels.to(dtype=torch.float32, device=device)


def fit_codebook(weight: torch.Tensor, bits: int, *, scale_search: bool = False, iterations: int = LLOYD_ITERATIONS,
                 zero: bool = False) -> torch.Tensor:
    """``2**bits`` increasing levels in [-1, 1], ends at -1 and +1, fitted to ``weight``.

    Args:
        weight: floating-point ``[out, in]``, finite (the values are not checked here), not on
            the meta device; a weight of more than :data:`MAX_FIT_WEIGHTS` elements is fitted on
            evenly spaced rows.
        bits: index width, 2..5.
        scale_search: fit for the scales the block scale search picks (alternating, see the
            module docstring) instead of the round-up ones.
        iterations: Lloyd-Max iterations per fit.
        zero: start from :func:`normal_float_zero_codebook` and keep its level at 0 in place
            (``"fitted-zero"``), instead of starting from the normal-float levels.

    Returns:
        float32 ``[2**bits]`` on ``weight``'s device, the same on every device and in every run.
    """
    fmt.check_bits(bits)
    fmt.check_weight(weight, finite=False)  # 2-D floating point; the values are the caller's to check
    if weight.device.type == "meta":
        raise ValueError("weight is on the meta device: fitting levels needs its values")
    fmt.check_bool("scale_search", scale_search)
    fmt.check_bool("zero", zero)
    if isinstance(iterations, bool) or not isinstance(iterations, int) or iterations < 1:
        raise ValueError(f"iterations must be a positive int, got {iterations!r}")
    w = weight.detach()
    if w.numel() > MAX_FIT_WEIGHTS:  # sample rows before any copy
        w = w[:: -(-w.numel() // MAX_FIT_WEIGHTS)]
    w = w.to(torch.float32)
    cb = normal_float_zero_codebook(bits, w.device) if zero else fmt.create_normal_float_codebook(bits, w.device)
    pinned = int(cb.abs().argmin()) if zero else None  # the index of the level at exactly 0
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
        # the mass is the block scale squared over the tensor scale's (a power of two: the same
        # fit, exactly), so it neither overflows nor underflows float32 for large or tiny weights
        mass = ((scale / ts.reshape(())).square() * (live & valid)).expand_as(blocks)
        # The sums run on the CPU, in a fixed order: a GPU's scatter and index adds are atomics in
        # any order, which would make the levels differ in their last bits from run to run and
        # from the CPU's (the elementwise work above is exact on every device).
        centers, mass = _histogram(values.reshape(-1).cpu(), mass.reshape(-1).cpu())
        cb = _lloyd(centers, mass, cb.cpu(), iterations, pinned)
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


def _lloyd(values: torch.Tensor, mass: torch.Tensor, levels: torch.Tensor, iterations: int, pinned: int | None = None) -> torch.Tensor:
    """Lloyd-Max on 1-D ``values`` with weights ``mass``, from ``levels``; the end levels stay
    at -1 and +1 (and level ``pinned``, if given, at 0), a level with no values keeps its place,
    neighbours stay ``_MIN_GAP`` apart."""
    c = levels.clone()
    n = c.numel()
    for _ in range(iterations):
        idx = torch.searchsorted((c[:-1] + c[1:]) * 0.5, values)
        total = torch.zeros_like(c).scatter_add_(0, idx, mass)
        moment = torch.zeros_like(c).scatter_add_(0, idx, mass * values)
        c = torch.where(total > 0, moment / total.clamp_min(torch.finfo(torch.float32).tiny), c)
        c[0], c[-1] = -1.0, 1.0
        if pinned is not None:
            c[pinned] = 0.0
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
