"""GGUF block formats kept quantized: the reference (the spec the CUDA kernels are tested against).

llama.cpp stores a quantized row as blocks of 32 weights, one after the other. The five legacy
block types (seed 001) are kept here in their own precision:

=====  ======  ==================================  =====================================
type   bytes   block layout (bytes, in order)       weight i of the block (i = 0..31)
=====  ======  ==================================  =====================================
Q4_0   18      d fp16, qs[16]                       d * (q_i - 8)
Q4_1   20      d fp16, m fp16, qs[16]               d * q_i + m
Q5_0   22      d fp16, qh u32, qs[16]               d * (q_i - 16)
Q5_1   24      d fp16, m fp16, qh u32, qs[16]       d * q_i + m
Q8_0   34      d fp16, qs[32] int8                  d * qs[i]
=====  ======  ==================================  =====================================

For the 4- and 5-bit types ``q_i`` takes its low four bits from ``qs``: weight ``i < 16`` from the
low nibble of ``qs[i]``, weight ``i >= 16`` from the high nibble of ``qs[i - 16]``; the 5-bit types
add bit ``i`` of ``qh`` (little-endian) as bit 4. The arithmetic is float32 in exactly that
order (a product, then a sum; never fused), as the ``gguf`` package's dequantization does, so the
result equals it bit for bit.

With 8-bit activations (llama.cpp's W4A8 / W5A8 / W8A8, :func:`matmul_a8`) each 32-value block of
a row of ``x`` is quantized as Q8_1: int8 values ``qa``, a scale ``da = max|x| / 127`` and the sum
``sa`` of the block's original values (:func:`quantize_activations`); each (row, block) pair then
contributes, with ``sumi`` the integer dot product of the weight levels ``q`` (before any offset)
and ``qa``::

    Q4_0: dw * (da * sumi - 8 * sa)     Q5_0: dw * (da * sumi - 16 * sa)     Q8_0: dw * da * sumi
    Q4_1, Q5_1: dw * da * sumi + m * sa

(the offset or minimum is applied to the exact block sum ``sa``, so it costs no rounding).

In memory a :class:`GGUFWeight` holds the same bytes split into one array per field (structure
of arrays, every array aligned and each row contiguous), which the kernels read with wide loads:

* ``qs``     uint8 ``[N, K/2]`` (4/5-bit types: each block's 16 bytes in GGUF order) or int8
  ``[N, K]`` (Q8_0);
* ``qh``     int32 ``[N, K/32]`` (5-bit types only: the block's ``qh`` word);
* ``scale``  float16 ``[N, K/32]`` (``d``);
* ``mins``   float16 ``[N, K/32]`` (``_1`` types only: ``m``).

:func:`split_blocks` and :func:`join_blocks` convert between that and GGUF's interleaved rows
losslessly. ``N`` is the out-features (GGUF's second dimension), ``K`` the in-features, a
multiple of 32. Pure PyTorch, device-agnostic.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

__all__ = [
    "BLOCK",
    "BLOCK_TYPES",
    "GGUFBlockType",
    "GGUFWeight",
    "block_type",
    "check_weight",
    "dequantize",
    "field_shapes",
    "join_blocks",
    "matmul",
    "matmul_a8",
    "quantize_activations",
    "Q8Activations",
    "split_blocks",
    "weight_indices",
]

BLOCK = 32
"""Weights per GGUF block (along the in-features)."""


@dataclass(frozen=True)
class GGUFBlockType:
    """One GGUF block type kept quantized.

    Attributes:
        name: GGUF's name (``"Q4_0"``).
        ggml_type: its ``GGMLQuantizationType`` value in GGUF files.
        code: this project's small index of the type (the kernels' template argument).
        bits: bits per weight index (4, 5 or 8).
        has_min: the block stores a minimum ``m`` (the ``_1`` types).
        block_bytes: bytes per 32-weight block in a GGUF file.
        offset: the zero point subtracted from ``q`` (8, 16, or 0 for the ``_1`` types and Q8_0).
    """

    name: str
    ggml_type: int
    code: int
    bits: int
    has_min: bool
    block_bytes: int
    offset: int

    @property
    def has_high_bits(self) -> bool:
        """The block stores a fifth bit per weight in ``qh``."""
        return self.bits == 5


BLOCK_TYPES: dict[str, GGUFBlockType] = {
    t.name: t
    for t in (
        GGUFBlockType("Q4_0", 2, 0, 4, False, 18, 8),
        GGUFBlockType("Q4_1", 3, 1, 4, True, 20, 0),
        GGUFBlockType("Q5_0", 6, 2, 5, False, 22, 16),
        GGUFBlockType("Q5_1", 7, 3, 5, True, 24, 0),
        GGUFBlockType("Q8_0", 8, 4, 8, False, 34, 0),
    )
}
"""The block types kept quantized, by name (values from ggml's ``ggml_type`` enum)."""


def block_type(qtype: str | GGUFBlockType) -> GGUFBlockType:
    """The :class:`GGUFBlockType` named ``qtype``.

    Raises:
        ValueError: ``qtype`` is not one of :data:`BLOCK_TYPES` (names them).
    """
    if isinstance(qtype, GGUFBlockType):
        return qtype
    if not isinstance(qtype, str) or qtype not in BLOCK_TYPES:
        raise ValueError(f"qtype must be one of {sorted(BLOCK_TYPES)}, got {qtype!r}")
    return BLOCK_TYPES[qtype]


@dataclass
class GGUFWeight:
    """A GGUF-quantized ``[out_features, in_features]`` weight, one array per block field
    (layout in the module docstring). ``qh`` and ``mins`` are ``None`` where the type has none."""

    qs: torch.Tensor
    qh: torch.Tensor | None
    scale: torch.Tensor
    mins: torch.Tensor | None
    qtype: str
    out_features: int
    in_features: int

    def __post_init__(self) -> None:
        check_weight(self.qs, self.qh, self.scale, self.mins, self.qtype, self.out_features, self.in_features)

    @property
    def device(self) -> torch.device:
        return self.qs.device

    def tensors(self) -> dict[str, torch.Tensor]:
        """The arrays this type has, by field name (``qs``, ``qh``, ``scale``, ``mins``)."""
        return {k: v for k, v in (("qs", self.qs), ("qh", self.qh), ("scale", self.scale), ("mins", self.mins)) if v is not None}

    def to(self, device: torch.device | str) -> "GGUFWeight":
        """The same weight on ``device``."""
        moved = {k: v.to(device) for k, v in self.tensors().items()}
        return GGUFWeight(moved["qs"], moved.get("qh"), moved["scale"], moved.get("mins"), self.qtype, self.out_features,
                          self.in_features)


def field_shapes(qtype: str | GGUFBlockType, out_features: int, in_features: int) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
    """Shape and dtype of each array of a ``qtype`` weight, by field name (only the fields it has)."""
    t = block_type(qtype)
    _check_features(out_features, in_features)
    blocks = in_features // BLOCK
    shapes: dict[str, tuple[tuple[int, ...], torch.dtype]] = {}
    if t.bits == 8:
        shapes["qs"] = ((out_features, in_features), torch.int8)
    else:
        shapes["qs"] = ((out_features, in_features // 2), torch.uint8)
    if t.has_high_bits:
        shapes["qh"] = ((out_features, blocks), torch.int32)
    shapes["scale"] = ((out_features, blocks), torch.float16)
    if t.has_min:
        shapes["mins"] = ((out_features, blocks), torch.float16)
    return shapes


def _check_features(out_features: int, in_features: int) -> None:
    for name, v in (("out_features", out_features), ("in_features", in_features)):
        if isinstance(v, bool) or not isinstance(v, int) or v < 1:
            raise ValueError(f"{name} must be a positive int, got {v!r}")
    if in_features % BLOCK:
        raise ValueError(f"in_features={in_features} is not a multiple of the GGUF block size {BLOCK}")


def check_weight(qs: torch.Tensor, qh: torch.Tensor | None, scale: torch.Tensor, mins: torch.Tensor | None, qtype: str,
                 out_features: int, in_features: int) -> None:
    """Metadata checks of a GGUF weight's arrays (dtype, shape, one device; no pass over values).

    Raises:
        TypeError / ValueError: naming the array or argument at fault.
    """
    t = block_type(qtype)
    shapes = field_shapes(t, out_features, in_features)
    given = {"qs": qs, "qh": qh, "scale": scale, "mins": mins}
    for name, tensor in given.items():
        if name not in shapes:
            if tensor is not None:
                raise ValueError(f"{t.name} has no {name} field, but {name} was given")
            continue
        shape, dtype = shapes[name]
        if not isinstance(tensor, torch.Tensor):
            raise TypeError(f"{name} must be a torch.Tensor ({dtype} {shape}) for {t.name}, got {type(tensor).__name__}")
        if tensor.dtype != dtype or tuple(tensor.shape) != shape:
            raise ValueError(f"{name} must be {dtype} {shape} for a {t.name} [{out_features}, {in_features}] weight, "
                             f"got {tensor.dtype} {tuple(tensor.shape)}")
        if tensor.device != qs.device:
            raise ValueError(f"{name} is on {tensor.device}, qs on {qs.device}: all arrays must be on one device")


# ---------------------------------------------------------------------------------------
# GGUF rows <-> arrays
# ---------------------------------------------------------------------------------------


def split_blocks(raw: torch.Tensor, qtype: str | GGUFBlockType, out_features: int, in_features: int) -> GGUFWeight:
    """A GGUF tensor's bytes (uint8, ``out_features * in_features / 32 * block_bytes`` of them, in
    any shape, e.g. ``gguf.GGUFReader``'s ``[N, row_bytes]``) as a :class:`GGUFWeight`. Lossless;
    :func:`join_blocks` inverts it.

    Raises:
        TypeError / ValueError: ``raw`` is not uint8 or its size does not match the shape.
    """
    t = block_type(qtype)
    _check_features(out_features, in_features)
    if not isinstance(raw, torch.Tensor) or raw.dtype != torch.uint8:
        raise TypeError(f"raw must be a uint8 tensor of GGUF blocks, got {getattr(raw, 'dtype', type(raw).__name__)}")
    blocks = in_features // BLOCK
    expected = out_features * blocks * t.block_bytes
    if raw.numel() != expected:
        raise ValueError(f"raw has {raw.numel()} bytes; a {t.name} [{out_features}, {in_features}] weight has {expected}")
    b = raw.reshape(out_features, blocks, t.block_bytes)
    pos = 0

    def take(n: int) -> torch.Tensor:
        nonlocal pos
        # A copy, never a view: the field must start at offset 0 of its own storage to be
        # viewed as int32 / float16 (a slice of a single block would otherwise stay a view).
        part = b[:, :, pos : pos + n].clone(memory_format=torch.contiguous_format)
        pos += n
        return part

    scale = take(2).view(torch.float16).reshape(out_features, blocks)
    mins = take(2).view(torch.float16).reshape(out_features, blocks) if t.has_min else None
    qh = take(4).view(torch.int32).reshape(out_features, blocks) if t.has_high_bits else None
    if t.bits == 8:
        qs = take(BLOCK).view(torch.int8).reshape(out_features, in_features)
    else:
        qs = take(BLOCK // 2).reshape(out_features, in_features // 2)
    return GGUFWeight(qs, qh, scale, mins, t.name, out_features, in_features)


def _check_gguf_weight(weight: object) -> None:
    if not isinstance(weight, GGUFWeight):
        raise TypeError(f"weight must be a GGUFWeight (split_blocks makes one), got {type(weight).__name__}")


def _check_bias(bias: torch.Tensor | None, out_features: int) -> None:
    if bias is not None and (not isinstance(bias, torch.Tensor) or not bias.is_floating_point()
                             or tuple(bias.shape) != (out_features,)):
        raise ValueError(f"bias must be a floating-point [{out_features}] tensor or None, got "
                         f"{tuple(bias.shape) if isinstance(bias, torch.Tensor) else type(bias).__name__}")


def join_blocks(weight: GGUFWeight) -> torch.Tensor:
    """The GGUF bytes of ``weight``: uint8 ``[out_features, in_features / 32 * block_bytes]``."""
    _check_gguf_weight(weight)
    t = block_type(weight.qtype)
    n, blocks = weight.out_features, weight.in_features // BLOCK
    parts = [weight.scale.contiguous().view(torch.uint8).reshape(n, blocks, 2)]
    if weight.mins is not None:
        parts.append(weight.mins.contiguous().view(torch.uint8).reshape(n, blocks, 2))
    if weight.qh is not None:
        parts.append(weight.qh.contiguous().view(torch.uint8).reshape(n, blocks, 4))
    per_block = BLOCK if t.bits == 8 else BLOCK // 2
    parts.append(weight.qs.contiguous().view(torch.uint8).reshape(n, blocks, per_block))
    return torch.cat(parts, dim=2).reshape(n, blocks * t.block_bytes)


# ---------------------------------------------------------------------------------------
# dequantize and matmul (the spec)
# ---------------------------------------------------------------------------------------


def weight_indices(weight: GGUFWeight) -> torch.Tensor:
    """Each weight's integer level ``q`` as int32 ``[N, K]`` (before the offset; Q8_0: the int8)."""
    _check_gguf_weight(weight)
    t = block_type(weight.qtype)
    n, k = weight.out_features, weight.in_features
    if t.bits == 8:
        return weight.qs.to(torch.int32)
    qs = weight.qs.reshape(n, k // BLOCK, BLOCK // 2).to(torch.int32)
    q = torch.cat((qs & 0xF, qs >> 4), dim=2)  # weights 0..15 low nibbles, 16..31 high nibbles
    if weight.qh is not None:
        shifts = torch.arange(BLOCK, dtype=torch.int32, device=q.device)
        q = q | (((weight.qh.unsqueeze(2) >> shifts) & 1) << 4)
    return q.reshape(n, k)


def dequantize(weight: GGUFWeight, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """The dense ``[out_features, in_features]`` weight: float32 arithmetic in GGUF's order (bit
    for bit ``gguf.dequantize``), then rounded to ``dtype``."""
    _check_gguf_weight(weight)
    t = block_type(weight.qtype)
    n, k = weight.out_features, weight.in_features
    q = (weight_indices(weight) - t.offset).to(torch.float32).reshape(n, k // BLOCK, BLOCK)
    w = weight.scale.to(torch.float32).unsqueeze(2) * q
    if weight.mins is not None:
        w = w + weight.mins.to(torch.float32).unsqueeze(2)
    return w.reshape(n, k).to(dtype)


def matmul(x: torch.Tensor, weight: GGUFWeight, bias: torch.Tensor | None = None) -> torch.Tensor:
    """``x @ W^T (+ bias)`` with ``W`` dequantized to ``x``'s dtype: what a model whose weights were
    dequantized at load to that dtype computes. ``x`` is ``[..., in_features]``."""
    _check_gguf_weight(weight)
    _check_bias(bias, weight.out_features)
    if not isinstance(x, torch.Tensor) or not x.is_floating_point():
        raise TypeError(f"x must be a floating-point tensor, got {getattr(x, 'dtype', type(x).__name__)}")
    if x.shape[-1] != weight.in_features:
        raise ValueError(f"x has {x.shape[-1]} in-features, the weight {weight.in_features}")
    return torch.nn.functional.linear(x, dequantize(weight, x.dtype), bias)


# ---------------------------------------------------------------------------------------
# 8-bit activations (Q8_1 blocks) and the integer dot products on them
# ---------------------------------------------------------------------------------------


@dataclass
class Q8Activations:
    """``x [M, K]`` quantized per 32-value block of a row (llama.cpp's Q8_1): ``qs`` int8 ``[M, K]``,
    ``scale`` (``da``) and ``sums`` (``sa``, the block's original values summed) float16 ``[M, K/32]``."""

    qs: torch.Tensor
    scale: torch.Tensor
    sums: torch.Tensor


def quantize_activations(x: torch.Tensor) -> Q8Activations:
    """Q8_1 blocks of ``x [M, K]`` (K a multiple of 32), computed in float32: ``da = amax / 127``,
    ``qa = round(x / da)`` (halves away from zero; 0 where ``amax`` is 0 or NaN), ``sa = sum(x)``;
    ``da`` and ``sa`` stored as float16 (a block holding a NaN gets ``da`` NaN).

    Raises:
        TypeError / ValueError: ``x`` not a floating-point 2-D tensor, or K not a multiple of 32.
    """
    if not isinstance(x, torch.Tensor) or not x.is_floating_point() or x.dim() != 2:
        raise TypeError(f"x must be a floating-point [M, K] tensor, got {getattr(x, 'dtype', type(x).__name__)}")
    m, k = x.shape
    if k % BLOCK:
        raise ValueError(f"x has {k} columns, not a multiple of the block size {BLOCK}")
    xb = x.to(torch.float32).reshape(m, k // BLOCK, BLOCK)
    amax = xb.abs().amax(dim=2, keepdim=True)
    d = amax / 127.0
    v = xb / torch.where(d == 0, torch.ones_like(d), d)
    # round half away from zero (C's roundf), exactly: round, then move the ties outwards
    whole = torch.trunc(v)
    q = torch.where((v - whole).abs() == 0.5, whole + torch.sign(v), torch.round(v))
    q = torch.where((d == 0) | d.isnan(), torch.zeros_like(v), q)  # an all-zero or NaN block: values 0
    return Q8Activations(q.to(torch.int8).reshape(m, k), d.squeeze(2).to(torch.float16), xb.sum(dim=2).to(torch.float16))


def matmul_a8(x: torch.Tensor, weight: GGUFWeight, bias: torch.Tensor | None = None) -> torch.Tensor:
    """``x @ W^T (+ bias)`` with 8-bit activations: ``x`` quantized by :func:`quantize_activations`,
    integer dot products per block, the formulas in the module docstring (float32), summed over
    the blocks in float32, plus the bias rounded to ``x``'s dtype, returned in ``x``'s dtype.
    ``x`` is ``[..., in_features]``; a NaN in a block of x makes its scale NaN (so the rows that
    read it are NaN)."""
    _check_gguf_weight(weight)
    _check_bias(bias, weight.out_features)
    if not isinstance(x, torch.Tensor) or not x.is_floating_point():
        raise TypeError(f"x must be a floating-point tensor, got {getattr(x, 'dtype', type(x).__name__)}")
    if x.shape[-1] != weight.in_features:
        raise ValueError(f"x has {x.shape[-1]} in-features, the weight {weight.in_features}")
    t = block_type(weight.qtype)
    n, k = weight.out_features, weight.in_features
    x2 = x.reshape(-1, k)
    a = quantize_activations(x2)
    blocks = k // BLOCK
    # Integer dot products per block as float32 matrix products: every product (<= 127 * 127) and
    # 32-term sum (< 2^24) is an exact float32 integer.
    qa = a.qs.reshape(-1, blocks, BLOCK).to(torch.float32).transpose(0, 1)  # [nb, M, 32]
    da, sa = a.scale.to(torch.float32).unsqueeze(1), a.sums.to(torch.float32).unsqueeze(1)  # [M, 1, nb]
    levels = weight_indices(weight).reshape(n, blocks, BLOCK)  # levels before any offset
    out = torch.empty(x2.shape[0], n, dtype=torch.float32, device=x.device)
    # Output columns in chunks, so the [M, columns, nb] block sums stay within ~64 Mi floats.
    step = max(1, (1 << 26) // max(1, x2.shape[0] * blocks))
    for c0 in range(0, n, step):
        cols = slice(c0, min(n, c0 + step))
        qw = levels[cols].to(torch.float32).permute(1, 2, 0)  # [nb, 32, cols]
        sumi = torch.bmm(qa, qw).permute(1, 2, 0)  # [M, cols, nb], exact integers
        dw = weight.scale[cols].to(torch.float32).unsqueeze(0)  # [1, cols, nb]
        if weight.mins is not None:
            per_block = dw * da * sumi + weight.mins[cols].to(torch.float32).unsqueeze(0) * sa
        elif t.offset and t.bits != 8:
            per_block = dw * (da * sumi - t.offset * sa)
        else:
            per_block = dw * da * sumi
        out[:, cols] = per_block.sum(dim=2)
    if bias is not None:  # in x's dtype first, as the 16-bit path adds it
        out = out + bias.to(x.dtype).to(torch.float32)
    return out.to(x.dtype).reshape(*x.shape[:-1], n)
