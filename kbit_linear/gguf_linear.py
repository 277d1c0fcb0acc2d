"""``GGUFLinear`` and ``GGUFEmbedding``: drop-ins for ``nn.Linear`` / ``nn.Embedding`` whose weight
stays in a llama.cpp block format (Q4_0, Q4_1, Q5_0, Q5_1, Q8_0; :mod:`kbit_linear.gguf_format`).

Both modules hold the weight as the arrays of a :class:`~kbit_linear.gguf_format.GGUFWeight`,
registered as buffers:

* ``qs``: uint8 ``[N, K/2]`` (4/5-bit types) or int8 ``[N, K]`` (Q8_0), the low bits;
* ``qh``: int32 ``[N, K/32]``, the fifth bits (Q5_0/Q5_1 only, else ``None``);
* ``scale``: float16 ``[N, K/32]``, the block scales ``d``;
* ``mins``: float16 ``[N, K/32]``, the block minimums ``m`` (Q4_1/Q5_1 only, else ``None``).

``N`` is the out-features (the vocabulary for an embedding), ``K`` the in-features (the embedding
width). The dequantized values equal the ``gguf`` package's dequantization bit for bit, so a model
that keeps these layers computes what one whose weights were dequantized at load computes.

Buffers, not parameters: ``model.dtype`` reads the first floating-point parameter, and a float16
``scale`` must not make a bfloat16 model report float16.

Dtype casts of a whole model (``model.to(torch.bfloat16)``, ``model.half()``) leave the arrays bit
for bit as they are (the format fixes their dtypes); device moves move them. A move changes each
array in place (``tensor.data = moved``, as ``nn.Module`` does for parameters) instead of
registering a new tensor, so arrays shared by two modules (an embedding and the ``lm_head`` tied
to it) stay one tensor on the new device instead of becoming two copies.
"""

from __future__ import annotations

from typing import Any, Callable

import torch
from torch import nn

from . import _gguf_ops  # noqa: F401  (registers the gguf_gemm / gguf_dequantize ops)
from . import format as fmt
from . import gguf_format as gf

__all__ = ["GGUFEmbedding", "GGUFLinear", "SCALED_EMBEDDINGS", "embedding_scale", "forget_tied_weights"]

SCALED_EMBEDDINGS = frozenset(
    {"Gemma2TextScaledWordEmbedding", "Gemma3TextScaledWordEmbedding", "Gemma4TextScaledWordEmbedding"})
"""transformers' scaled word embeddings (by class name) that a :class:`GGUFEmbedding` with
``embed_scale`` reproduces: each forward is ``nn.Embedding.forward(ids) * self.embed_scale``."""


def embedding_scale(module: nn.Module) -> torch.Tensor | None:
    """The output factor of ``module`` when it is one of :data:`SCALED_EMBEDDINGS` (holding the
    tensor ``embed_scale``), else ``None``. With ``type(module) is nn.Embedding`` this is the one
    rule for which embeddings a :class:`GGUFEmbedding` may replace (any other subclass may do more
    than look rows up)."""
    scale = getattr(module, "embed_scale", None)
    if isinstance(module, nn.Embedding) and type(module).__name__ in SCALED_EMBEDDINGS and isinstance(scale, torch.Tensor):
        return scale
    return None


def forget_tied_weights(model: nn.Module, names: set[str]) -> None:
    """Drop the entries of transformers' tie tables (``_tied_weights_keys``,
    ``all_tied_weights_keys`` of the model and its sub-models) that name one of ``names``.

    transformers ties weights by sharing a ``weight`` Parameter (``model.tie_weights()``, also
    run by ``resize_token_embeddings``); a GGUF module has no ``weight``, so a table entry that
    names one would make that call fail. The GGUF modules' own ties are their shared arrays.

    Args:
        model: the model (any ``nn.Module``; modules without the tables are left alone).
        names: full parameter names (``"lm_head.weight"``).
    """
    for prefix, sub in model.named_modules():
        head = f"{prefix}." if prefix else ""  # the tables name parameters relative to their model
        for attr in ("_tied_weights_keys", "all_tied_weights_keys"):
            table = getattr(sub, attr, None)
            if not isinstance(table, dict):
                continue
            kept = {k: v for k, v in table.items() if head + k not in names and head + str(v) not in names}
            if len(kept) != len(table):
                setattr(sub, attr, kept)

# Resolved once: an OpOverload call skips the overload lookup of the packet on every call.
_GEMM = torch.ops.kbit_linear.gguf_gemm.default
_GEMM_A8 = torch.ops.kbit_linear.gguf_gemm_a8.default
_DEQUANTIZE = torch.ops.kbit_linear.gguf_dequantize.default

_ARRAYS = ("qs", "qh", "scale", "mins")


def _check_dim(name: str, value: Any) -> int:
    """``value`` if it is a positive int, else a TypeError/ValueError naming ``name``."""
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{name} must be an int, got {type(value).__name__}")
    if value <= 0:
        raise ValueError(f"{name} must be positive, got {value}")
    return value


def _check_weight(weight: Any) -> gf.GGUFWeight:
    """``weight`` if it is a consistent ``GGUFWeight``, else a TypeError/ValueError."""
    if not isinstance(weight, gf.GGUFWeight):
        raise TypeError(f"weight must be a kbit_linear.gguf_format.GGUFWeight, got {type(weight).__name__}")
    # a GGUFWeight checks itself when built; its fields may have been reassigned since
    gf.check_weight(weight.qs, weight.qh, weight.scale, weight.mins, weight.qtype, weight.out_features, weight.in_features)
    return weight


def _register_arrays(module: nn.Module, weight: gf.GGUFWeight) -> None:
    """Register the arrays of ``weight`` on ``module`` (the same tensors, no copy); ``None`` for
    the fields the type has not, so ``module.qh`` / ``module.mins`` always exist."""
    for name in _ARRAYS:
        module.register_buffer(name, getattr(weight, name))


def _zero_weight(qtype: str, out_features: int, in_features: int, device: torch.device | str | None) -> gf.GGUFWeight:
    """An all-zero weight of the given shape (zero scales: an exactly zero matrix)."""
    shapes = gf.field_shapes(qtype, out_features, in_features)
    arrays = {name: torch.zeros(shape, dtype=dtype, device=device) for name, (shape, dtype) in shapes.items()}
    return gf.GGUFWeight(arrays["qs"], arrays.get("qh"), arrays["scale"], arrays.get("mins"), gf.block_type(qtype).name,
                         out_features, in_features)


def _apply_to_arrays(module: nn.Module, fn: Callable[[torch.Tensor], torch.Tensor]) -> None:
    """Apply ``fn`` to the GGUF arrays of ``module`` for its device move only, in place.

    A dtype change ``fn`` would make is ignored (the format fixes the dtypes). The moved tensor
    is installed with ``tensor.data = moved`` where torch allows it, as ``nn.Module._apply`` does
    for parameters, so a tensor shared with another module stays shared after the move.
    """
    with torch.no_grad():
        for name in _ARRAYS:
            old = module._buffers.get(name)
            if old is None:
                continue
            new = fn(old)
            if new.dtype != old.dtype:
                new = old.to(device=new.device)
            if new is old:
                continue
            if torch._has_compatible_shallow_copy_type(old, new):
                old.data = new
            else:
                module._buffers[name] = new


def _apply_keeping_arrays(module: nn.Module, fn: Callable[[torch.Tensor], torch.Tensor], recurse: bool) -> None:
    """``nn.Module._apply`` for every tensor but the GGUF arrays, which :func:`_apply_to_arrays` moves."""
    _apply_to_arrays(module, fn)
    arrays = {name: module._buffers.pop(name) for name in _ARRAYS if name in module._buffers}
    try:
        nn.Module._apply(module, fn, recurse)
    finally:
        module._buffers.update(arrays)


def _check_state_dict(module: nn.Module, state_dict: dict[str, Any], prefix: str, error_msgs: list[str]) -> bool:
    """Append an error naming the key for every GGUF array of ``state_dict`` whose dtype or shape
    differs from the module's (``load_state_dict`` would silently cast a float tensor into the
    integer arrays); ``False`` if there was one."""
    ok = True
    for name in _ARRAYS:
        mine = module._buffers.get(name)
        given = state_dict.get(prefix + name)
        if mine is None or not isinstance(given, torch.Tensor):
            continue
        if given.dtype != mine.dtype or given.shape != mine.shape:
            error_msgs.append(f"{prefix}{name}: expected {mine.dtype} {tuple(mine.shape)} for a {module.qtype} weight, "
                              f"got {given.dtype} {tuple(given.shape)}")
            ok = False
    return ok


class _GGUFArrays(nn.Module):
    """What both GGUF modules share: loading a state dict refuses arrays whose dtype or shape
    differs from the module's (see :func:`_check_state_dict`)."""

    def _load_from_state_dict(self, state_dict: dict[str, Any], prefix: str, local_metadata: dict[str, Any], strict: bool,
                              missing_keys: list[str], unexpected_keys: list[str], error_msgs: list[str]) -> None:
        if not _check_state_dict(self, state_dict, prefix, error_msgs):
            return
        super()._load_from_state_dict(state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys, error_msgs)


class GGUFLinear(_GGUFArrays):
    """``y = x @ W^T + b`` with ``W`` kept in a GGUF block format (Q4_0, Q4_1, Q5_0, Q5_1, Q8_0).

    The forward pass is one call of ``torch.ops.kbit_linear.gguf_gemm`` (the reference on CPU,
    the CUDA kernel where the CUDA backend registers one): ``x`` float32, float16 or bfloat16 with
    any leading dimensions, the output in ``x``'s dtype, equal to ``F.linear(x, W_deq, b)`` with
    ``W_deq`` the weight dequantized to ``x``'s dtype.

    The constructor allocates an all-zero weight of the right shapes (nothing on ``"meta"``), to
    be filled by ``load_state_dict``; :meth:`from_weight` wraps an existing weight.

    Args:
        in_features: K, a positive multiple of 32.
        out_features: N, any positive int.
        qtype: the block type's name (``"Q4_0"``, ``"Q4_1"``, ``"Q5_0"``, ``"Q5_1"``, ``"Q8_0"``).
        bias: whether the layer has a bias.
        device: where the tensors live.
        dtype: dtype of the bias (default: ``torch.get_default_dtype()``); the GGUF arrays have
            fixed dtypes.
        activation_bits: 16 (default): the activations stay in their dtype; 8: each forward
            quantizes them per 32-value block to int8 (Q8_1) and multiplies in integers
            (``gguf_gemm_a8``, llama.cpp's W4A8/W5A8/W8A8). Opt-in: slower than 16 on the GPUs
            measured (``bench/results/gguf-h100.md``), and less accurate. May be changed later
            through the attribute.
    """

    in_features: int
    out_features: int
    qtype: str
    activation_bits: int

    def __init__(self, in_features: int, out_features: int, qtype: str, bias: bool = False,
                 device: torch.device | str | None = None, dtype: torch.dtype | None = None, activation_bits: int = 16) -> None:
        super().__init__()
        self.in_features = _check_dim("in_features", in_features)
        self.out_features = _check_dim("out_features", out_features)
        self.qtype = gf.block_type(qtype).name
        self.activation_bits = activation_bits
        fmt.check_bool("bias", bias)
        if dtype is not None:
            fmt.check_float_dtype(dtype)
        _register_arrays(self, _zero_weight(self.qtype, out_features, in_features, device))
        if bias:
            self.bias = nn.Parameter(torch.zeros(out_features, dtype=dtype, device=device), requires_grad=False)
        else:
            self.register_parameter("bias", None)

    @classmethod
    def from_weight(cls, weight: gf.GGUFWeight, bias: torch.Tensor | None = None) -> "GGUFLinear":
        """A layer holding ``weight``'s arrays (the same tensors, no copy).

        Args:
            weight: the GGUF weight, ``[out_features, in_features]``.
            bias: ``[out_features]`` floating-point tensor on the weight's device, or ``None``.
                An ``nn.Parameter`` is kept as it is (shared with its owner); another tensor
                becomes a ``Parameter`` with ``requires_grad=False``.

        Returns:
            The layer, on the weight's device.

        Raises:
            TypeError: ``weight`` is not a ``GGUFWeight``, or ``bias`` not a floating-point tensor.
            ValueError: inconsistent arrays, or a ``bias`` of the wrong shape or device.
        """
        weight = _check_weight(weight)
        if bias is not None:
            if not isinstance(bias, torch.Tensor) or not bias.is_floating_point():
                got = getattr(bias, "dtype", type(bias).__name__)
                raise TypeError(f"bias must be a floating-point tensor or None, got {got}")
            if tuple(bias.shape) != (weight.out_features,) or bias.device != weight.device:
                raise ValueError(f"bias must be a [{weight.out_features}] tensor on {weight.device}, got "
                                 f"{tuple(bias.shape)} on {bias.device}")
        layer = cls(weight.in_features, weight.out_features, weight.qtype, bias=False, device="meta")
        _register_arrays(layer, weight)
        if bias is not None:
            layer.bias = bias if isinstance(bias, nn.Parameter) else nn.Parameter(bias.detach(), requires_grad=False)
        return layer

    @property
    def activation_bits(self) -> int:
        """16 (activations as they come) or 8 (quantized per block to int8 for integer MMAs)."""
        return self._activation_bits

    @activation_bits.setter
    def activation_bits(self, bits: int) -> None:
        if isinstance(bits, bool) or bits not in (8, 16):
            raise ValueError(f"activation_bits must be 8 or 16, got {bits!r}")
        self._activation_bits = bits

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """``x @ W^T + bias``.

        Args:
            x: float32/float16/bfloat16 (or float64) ``[..., in_features]`` on the layer's device.

        Returns:
            ``[..., out_features]`` in ``x``'s dtype. Under ``torch.autocast`` too: the layer
            computes in ``x``'s dtype, where ``nn.Linear`` would compute (and return) the
            autocast dtype; cast ``x`` first for that.
        """
        if not isinstance(x, torch.Tensor):  # (an AttributeError on .dim() otherwise)
            raise TypeError(f"x must be a floating-point torch.Tensor, got {type(x).__name__}")
        if x.dim() == 0 or x.shape[-1] != self.in_features:
            raise ValueError(f"x's last dimension must be in_features={self.in_features}, got shape {tuple(x.shape)}")
        gemm = _GEMM if self._activation_bits == 16 else _GEMM_A8
        y = gemm(x.reshape(-1, self.in_features), self.qs, self.qh, self.scale, self.mins, self.qtype, self.out_features,
                 self.bias)
        return y.reshape(*x.shape[:-1], self.out_features)

    def weight_format(self) -> gf.GGUFWeight:
        """The weight as a :class:`~kbit_linear.gguf_format.GGUFWeight` (shares storage)."""
        return gf.GGUFWeight(self.qs, self.qh, self.scale, self.mins, self.qtype, self.out_features, self.in_features)

    def dequantize(self, dtype: torch.dtype | None = None) -> torch.Tensor:
        """The dense weight, through the ``gguf_dequantize`` op.

        Args:
            dtype: result dtype (default float32, which holds every dequantized value exactly).

        Returns:
            ``[out_features, in_features]`` on the layer's device.
        """
        dtype = fmt.check_float_dtype(torch.float32 if dtype is None else dtype)
        return _DEQUANTIZE(self.qs, self.qh, self.scale, self.mins, self.qtype, self.out_features, self.in_features, dtype)

    def extra_repr(self) -> str:
        a8 = ", activation_bits=8" if self._activation_bits == 8 else ""
        return (f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}, "
                f"qtype={self.qtype}{a8}")

    def _apply(self, fn: Callable[[torch.Tensor], torch.Tensor], recurse: bool = True) -> "GGUFLinear":
        _apply_keeping_arrays(self, fn, recurse)
        return self


class GGUFEmbedding(_GGUFArrays):
    """An ``nn.Embedding`` whose table stays in a GGUF block format (e.g. a Q8_0 ``token_embd``).

    The forward pass gathers the requested rows of each array and dequantizes only those rows
    through ``torch.ops.kbit_linear.gguf_dequantize``; the result equals ``nn.Embedding`` over
    the dequantized table, in :attr:`dtype`. As with ``nn.Embedding`` at inference,
    ``padding_idx`` only names a row (its values are whatever the table holds). There is no
    ``weight`` tensor: code that reads ``embedding.weight`` (``resize_token_embeddings``) needs a
    dense embedding.

    ``embed_scale`` stands in for transformers' scaled word embeddings (Gemma 2/3/4), whose forward
    is ``nn.Embedding.forward(ids) * embed_scale.to(weight.dtype)``: the output is multiplied by
    it, cast to :attr:`dtype`, the same way.

    Args:
        num_embeddings: rows (N), any positive int.
        embedding_dim: width (K), a positive multiple of 32.
        qtype: the block type's name.
        padding_idx: as ``nn.Embedding`` (negative counts from the end), or ``None``.
        device: where the arrays live.
        dtype: the output dtype (default: ``torch.get_default_dtype()``); follows dtype casts of
            the module (``model.to(torch.bfloat16)``), as ``nn.Embedding``'s weight does.
        embed_scale: a factor for the output (a number or a 0-d floating-point tensor, kept as a
            non-persistent buffer that dtype casts convert), or ``None``.

    Attributes:
        dtype: the output dtype.
        embed_scale: the output factor (0-d tensor) or ``None``.
    """

    num_embeddings: int
    embedding_dim: int
    qtype: str
    padding_idx: int | None
    dtype: torch.dtype

    def __init__(self, num_embeddings: int, embedding_dim: int, qtype: str, padding_idx: int | None = None,
                 device: torch.device | str | None = None, dtype: torch.dtype | None = None,
                 embed_scale: float | torch.Tensor | None = None) -> None:
        super().__init__()
        self.num_embeddings = _check_dim("num_embeddings", num_embeddings)
        self.embedding_dim = _check_dim("embedding_dim", embedding_dim)
        self.qtype = gf.block_type(qtype).name
        if embedding_dim % gf.BLOCK:  # (the weight's check would name in_features)
            raise ValueError(f"embedding_dim={embedding_dim} is not a multiple of the GGUF block size {gf.BLOCK}")
        self.padding_idx = self._check_padding_idx(padding_idx, num_embeddings)
        self.dtype = torch.get_default_dtype() if dtype is None else fmt.check_float_dtype(dtype)
        _register_arrays(self, _zero_weight(self.qtype, num_embeddings, embedding_dim, device))
        self.register_buffer("embed_scale", self._check_embed_scale(embed_scale, device), persistent=False)

    def _check_embed_scale(self, embed_scale: float | torch.Tensor | None,
                           device: torch.device | str | None) -> torch.Tensor | None:
        """``embed_scale`` as a 0-d tensor on ``device`` (a number in :attr:`dtype`), or ``None``."""
        if embed_scale is None:
            return None
        if isinstance(embed_scale, torch.Tensor):
            if embed_scale.dim() != 0 or not embed_scale.is_floating_point():
                raise ValueError(f"embed_scale must be a 0-d floating-point tensor, got "
                                 f"{embed_scale.dtype} {tuple(embed_scale.shape)}")
            return embed_scale.detach().to(device=device, copy=True)
        if isinstance(embed_scale, bool) or not isinstance(embed_scale, (int, float)):
            raise TypeError(f"embed_scale must be a number, a 0-d tensor or None, got {type(embed_scale).__name__}")
        return torch.tensor(float(embed_scale), dtype=self.dtype, device=device)

    @staticmethod
    def _check_padding_idx(padding_idx: int | None, num_embeddings: int) -> int | None:
        """``padding_idx`` made non-negative, or a TypeError/ValueError naming it."""
        if padding_idx is None:
            return None
        if isinstance(padding_idx, bool) or not isinstance(padding_idx, int):
            raise TypeError(f"padding_idx must be an int or None, got {type(padding_idx).__name__}")
        if not -num_embeddings <= padding_idx < num_embeddings:
            raise ValueError(f"padding_idx must be within [-{num_embeddings}, {num_embeddings}), got {padding_idx}")
        return padding_idx % num_embeddings  # nn.Embedding stores it non-negative

    @classmethod
    def from_weight(cls, weight: gf.GGUFWeight, dtype: torch.dtype | None = None, padding_idx: int | None = None,
                    embed_scale: float | torch.Tensor | None = None) -> "GGUFEmbedding":
        """An embedding holding ``weight``'s arrays (the same tensors, no copy).

        Args:
            weight: the table as a GGUF weight, ``[num_embeddings, embedding_dim]``.
            dtype: the output dtype (default: ``torch.get_default_dtype()``).
            padding_idx: as ``nn.Embedding``, or ``None``.
            embed_scale: a factor for the output (number or 0-d tensor, copied), or ``None``.

        Raises:
            TypeError / ValueError: a bad argument, named.
        """
        weight = _check_weight(weight)
        layer = cls(weight.out_features, weight.in_features, weight.qtype, padding_idx=padding_idx, device="meta", dtype=dtype)
        _register_arrays(layer, weight)
        if embed_scale is not None:
            layer.embed_scale = layer._check_embed_scale(embed_scale, weight.device)
        return layer

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        """The rows ``input_ids`` selects, dequantized.

        Args:
            input_ids: int64/int32 tensor of any shape, values in ``[0, num_embeddings)``.

        Returns:
            ``[*input_ids.shape, embedding_dim]`` in :attr:`dtype`.
        """
        if not isinstance(input_ids, torch.Tensor) or input_ids.dtype not in (torch.int64, torch.int32):
            got = getattr(input_ids, "dtype", type(input_ids).__name__)
            raise TypeError(f"input_ids must be an int64 or int32 tensor, got {got}")
        flat = input_ids.reshape(-1)
        rows = flat.numel()
        if rows == 0:
            return torch.empty((*input_ids.shape, self.embedding_dim), dtype=self.dtype, device=self.qs.device)
        qh = None if self.qh is None else self.qh.index_select(0, flat)
        mins = None if self.mins is None else self.mins.index_select(0, flat)
        out = _DEQUANTIZE(self.qs.index_select(0, flat), qh, self.scale.index_select(0, flat), mins, self.qtype, rows,
                          self.embedding_dim, self.dtype)
        out = out.reshape(*input_ids.shape, self.embedding_dim)
        if self.embed_scale is not None:
            out = out * self.embed_scale.to(self.dtype)
        return out

    def weight_format(self) -> gf.GGUFWeight:
        """The table as a :class:`~kbit_linear.gguf_format.GGUFWeight` (shares storage)."""
        return gf.GGUFWeight(self.qs, self.qh, self.scale, self.mins, self.qtype, self.num_embeddings, self.embedding_dim)

    def dequantize(self, dtype: torch.dtype | None = None) -> torch.Tensor:
        """The dense table ``[num_embeddings, embedding_dim]`` (default float32)."""
        dtype = fmt.check_float_dtype(torch.float32 if dtype is None else dtype)
        return _DEQUANTIZE(self.qs, self.qh, self.scale, self.mins, self.qtype, self.num_embeddings, self.embedding_dim, dtype)

    def extra_repr(self) -> str:
        pad = "" if self.padding_idx is None else f", padding_idx={self.padding_idx}"
        scaled = "" if self.embed_scale is None else ", scaled"
        return f"{self.num_embeddings}, {self.embedding_dim}{pad}, qtype={self.qtype}, dtype={self.dtype}{scaled}"

    def _apply(self, fn: Callable[[torch.Tensor], torch.Tensor], recurse: bool = True) -> "GGUFEmbedding":
        # The output dtype follows float casts of the module, as an nn.Embedding's weight would:
        # ask fn what it makes of an empty tensor of that dtype.
        probe = fn(torch.empty(0, dtype=self.dtype, device=self.qs.device))
        if probe.is_floating_point():
            self.dtype = probe.dtype
        _apply_keeping_arrays(self, fn, recurse)
        return self

