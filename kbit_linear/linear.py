"""``KbitLinear``: a drop-in ``nn.Linear`` whose weight is stored in the kbit format.

The module holds the tensors of ``docs/format.md`` and nothing else:

* ``weight``: int32 ``[K_pad/64, N_pad/128, 128, 2, bits]``, the tiled bit-planes, an
  ``nn.Parameter`` with ``requires_grad=False``; on a CUDA device a 4- or 5-bit layer holds it
  as uint8 pair codes ``[..., 2, 16]`` / ``[..., 2, 20]`` instead (:mod:`kbit_linear.weight_layout`), and its state
  dict gives planes;
* ``absmax``: uint8 ``[K_pad/64, N_pad/128, 128, 2]``, E4M4 block scales, a buffer;
* ``codebook``: float32 ``[2**bits]``, levels in [-1, 1], a buffer;
* ``tensor_scale``: float32 ``[1]``, a power of two, a buffer;
* ``bias``: ``[out_features]`` in the model dtype, an ``nn.Parameter``, or ``None``;
* ``hadamard_signs``: int8 ``[in_features]`` of +-1 for a layer quantized with the randomized
  Hadamard rotation (:mod:`kbit_linear.hadamard`: the stored weight is ``W R`` and the forward
  pass rotates its input), a buffer, or ``None``.

``K_pad`` = in_features rounded up to 64, ``N_pad`` = out_features rounded up to 128.

Why ``weight`` is a ``Parameter(requires_grad=False)`` and the rest are buffers: transformers 5.x
loads only the keys of ``model.state_dict()`` (both kinds qualify) and sets them with
``setattr``; a tensor set on a buffer name stays a plain buffer, anything else is wrapped in
``nn.Parameter(requires_grad=tensor.is_floating_point())``. An int32 ``weight`` Parameter is
therefore never trainable, the float32 ``codebook``/``tensor_scale`` do not come back as
trainable Parameters, accelerate offloads ``weight`` with the other parameters (buffers of
offloaded modules stay on the execution device unless ``offload_buffers=True``), and code
that looks for a module's ``weight`` in ``named_parameters()`` (quantizer helpers, parameter
counts, PEFT) finds it. ``model.dtype`` is unaffected (it reads the first floating
point parameter).

Dtype casts of a whole model (``model.to(torch.bfloat16)``; ``model.half()`` too, except on a
model loaded through transformers' quantizer plug-in, where transformers refuses ``.half()`` and
``.to(dtype)`` is the way) cast the bias and leave the quantized tensors bit-identical: ``weight``/``absmax`` are integers, and
:meth:`KbitLinear._apply` keeps ``codebook``/``tensor_scale`` in float32.
"""

from __future__ import annotations

from typing import Any, Callable, Iterable

import torch
from torch import nn

from . import _ops  # the op schemas and the gemm entry point (with its eager fast path)
from . import format as fmt
from . import hadamard as hd
from . import weight_layout
from .calibration import DEFAULT_ACT_ORDER, DEFAULT_DAMP, LAZY_BLOCK
from .quantizer import check_hadamard_search, hadamard_signs_for, quantize_weight

__all__ = ["KbitLinear"]

# Resolved once: an OpOverload call skips the overload lookup of the packet on every call.
_DEQUANTIZE = torch.ops.kbit_linear.dequantize.default

# Buffers that are part of the format and must stay float32 whatever the model dtype.
_FLOAT32_BUFFERS = ("codebook", "tensor_scale")

# The dtypes of a KbitLinear's quantized tensors in a state dict (checked before loading one).
STATE_DTYPES = {"weight": torch.int32, "absmax": torch.uint8, "codebook": torch.float32, "tensor_scale": torch.float32,
                "hadamard_signs": torch.int8}


def _check_features(name: str, value: Any) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{name} must be an int, got {type(value).__name__}")
    if value <= 0:
        raise ValueError(f"{name} must be positive, got {value}")
    return value


def _apply_keeping_float32(module: nn.Module, names: Iterable[str], fn: Callable[[torch.Tensor], torch.Tensor],
                           recurse: bool) -> nn.Module:
    """``nn.Module._apply`` that keeps the float32 buffers ``names`` float32, bit for bit.

    Module.to(dtype)/half()/bfloat16() cast every floating buffer; a codebook and a tensor scale
    belong to the format. ``fn`` is applied (for its device move) and, where it changed a
    buffer's dtype, the original is moved instead.
    """
    saved = {name: module._buffers.get(name) for name in names}
    nn.Module._apply(module, fn, recurse)
    for name, old in saved.items():
        new = module._buffers.get(name)
        if old is not None and new is not None and new.dtype != old.dtype:
            module._buffers[name] = old.to(device=new.device)
    return module


def _refuse_integer_casts(module: nn.Module, fn: Callable[[torch.Tensor], torch.Tensor]) -> None:
    """Raise before an ``nn.Module._apply`` function that would change an integer tensor's dtype.

    ``Module.type(dtype)`` casts integer tensors too: the packed planes and block scales would be
    lost for good, and the error would come only at the next forward. ``Module.to(dtype)`` and
    ``.half()`` leave them alone. (An empty probe on the module's device: no data moves.)
    """
    device = next((t.device for t in (*module.parameters(recurse=False), *module.buffers(recurse=False))), torch.device("cpu"))
    probe = fn(torch.empty(0, dtype=torch.int32, device=device))
    if isinstance(probe, torch.Tensor) and probe.dtype != torch.int32:
        raise TypeError(f"{type(module).__name__} cannot cast its packed integer tensors to {probe.dtype} "
                        f"(Module.type): use .to(dtype), which sets the compute dtype and keeps the format")


def _cast_dtype(fn: Callable[[torch.Tensor], torch.Tensor], dtype: torch.dtype, device: torch.device) -> torch.dtype:
    """The dtype an ``nn.Module._apply`` function ``fn`` gives a floating tensor of ``dtype`` on
    ``device``: what a module cast does to a dense weight (an empty probe, so no data moves)."""
    probe = fn(torch.empty(0, dtype=dtype, device=device))
    return probe.dtype if isinstance(probe, torch.Tensor) and probe.is_floating_point() else dtype


def _apply_keeping_format(module: nn.Module, fn: Callable[[torch.Tensor], torch.Tensor], recurse: bool) -> nn.Module:
    """``nn.Module._apply`` for a module holding a kbit ``weight`` of ``module.bits``: the format's
    float32 buffers stay float32 and the weight takes the new device's layout
    (:mod:`kbit_linear.weight_layout`)."""
    _apply_keeping_float32(module, _FLOAT32_BUFFERS, fn, recurse)
    weight_layout.adopt(module.weight, module.bits)
    return module


def _check_state_dtypes(state_dict: dict[str, Any], prefix: str, expected: dict[str, torch.dtype],
                        error_msgs: list[str], what: str) -> bool:
    """Append an error naming the key for every entry of ``expected`` whose tensor in
    ``state_dict`` has another dtype; ``False`` if there was one. (load_state_dict would
    silently cast a float tensor into int32 planes with ``copy_``.)"""
    ok = True
    for name, dtype in expected.items():
        t = state_dict.get(prefix + name)
        if isinstance(t, torch.Tensor) and t.dtype != dtype:
            error_msgs.append(f"{prefix}{name}: expected dtype {dtype} for {what}, got {t.dtype}")
            ok = False
    return ok


def _check_state_values(state_dict: dict[str, Any], prefix: str, bits: int, error_msgs: list[str]) -> bool:
    """Append an error naming the key for a codebook, tensor scale or sign vector in
    ``state_dict`` whose values a layer cannot hold (checked off the meta device: one host read
    each); ``False`` if there was one. The checkpoint loaders check more (shapes, padding, checksums)."""
    def check(name: str, t: torch.Tensor) -> None:
        if name == "codebook" and t.numel() == 1 << bits:  # (another size: load_state_dict's size mismatch)
            fmt.validate_codebook(t, bits, name=prefix + name)
        elif name == "tensor_scale" and not fmt.is_power_of_two(t):
            raise ValueError(f"{prefix}{name} must be a positive finite power of two")
        elif name == "hadamard_signs":
            hd.check_signs(t, t.numel(), prefix + name)

    ok = True
    for name in ("codebook", "tensor_scale", "hadamard_signs"):
        t = state_dict.get(prefix + name)
        if not isinstance(t, torch.Tensor) or t.device.type == "meta":
            continue
        try:
            check(name, t)
        except (TypeError, ValueError) as e:
            error_msgs.append(str(e))
            ok = False
    return ok


_LAYOUT_KEY = "kbit_linear"  # the state dict metadata entry of a module's logical shape


def _record_layout(destination: dict[str, Any], prefix: str, layout: dict[str, int]) -> None:
    """Note a module's logical shape in the state dict's metadata, next to its version: the stored
    tensors are padded to whole tiles, so their shapes alone let a state dict of another layer
    shape load without an error (and the padding then stands in for real rows). State dicts
    without metadata (read from a checkpoint file) are left as they are: the loaders check those."""
    metadata = getattr(destination, "_metadata", None)
    if metadata is not None:
        metadata.setdefault(prefix[:-1], {})[_LAYOUT_KEY] = dict(layout)


def _linear_layout(module: nn.Module) -> dict[str, int]:
    """The logical shape a state dict of a kbit linear layer (a KbitLinear, a fused part) records:
    the same for both, so that state dicts move between fused and unfused models."""
    return {"bits": module.bits, "out_features": module.out_features, "in_features": module.in_features}


def _check_layout(local_metadata: dict[str, Any], prefix: str, layout: dict[str, int], error_msgs: list[str],
                  what: str) -> bool:
    """Append an error naming the module if the state dict records another logical shape for it
    (:func:`_record_layout`); ``False`` if it does."""
    recorded = local_metadata.get(_LAYOUT_KEY)
    if recorded is None or recorded == layout:
        return True
    def show(d: dict[str, int]) -> str:
        return ", ".join(f"{k}={v}" for k, v in d.items())
    error_msgs.append(f"size mismatch for {prefix[:-1] or 'the module'}: the state dict is of a {what} with {show(recorded)}, "
                      f"this one has {show(layout)}")
    return False


class KbitLinear(nn.Module):
    """``y = x @ W^T + b`` with ``W`` stored as ``bits``-bit codebook indices and E4M4 block scales.

    The forward pass is one call of ``torch.ops.kbit_linear.gemm`` (the reference on CPU, the
    fused CUDA kernel where the CUDA backend is registered). Inputs may be float32, float16 or
    bfloat16 with any leading dimensions; the output has the input's dtype.

    The constructor allocates zero-filled tensors of the right shapes (a zero ``absmax`` is an
    all-zero weight), so a layer can be built on the meta device and filled by
    ``load_state_dict``; use :meth:`from_linear` to quantize an existing ``nn.Linear``.
    ``load_state_dict`` checks the layer shape that a state dict records in its metadata
    (``state_dict()`` and ``torch.save`` keep it); a plain dict without it is checked only by
    the padded tensor shapes, which two layers of different sizes can share: load checkpoint
    files with the package's loaders, which check the recorded shapes.

    Args:
        in_features: K, any positive int (the tiles are padded).
        out_features: N, any positive int.
        bias: whether the layer has a bias.
        bits: index width, 2..5.
        codebook: float ``[2**bits]``, strictly increasing, in [-1, 1] (default: the
            normal-float codebook of ``bits``).
        device: where the tensors live (``"meta"`` allocates nothing).
        dtype: dtype of the bias and :attr:`compute_dtype` (default: ``torch.get_default_dtype()``);
            the quantized tensors have fixed dtypes.
        hadamard: whether the stored weight is Hadamard-rotated (allocates ``hadamard_signs``,
            all +1 until loaded or set by :meth:`from_linear`).
    """

    in_features: int
    out_features: int
    bits: int
    compute_dtype: torch.dtype
    """The floating dtype of the dense layer this one stands for (its weight's, for a layer made by
    :meth:`from_linear`; else the constructor's ``dtype``). Module casts (``.to(dtype)``, ``.half()``)
    change it as they change a dense layer's weight. Nothing in the forward reads it (the output
    has the input's dtype); it is the dtype of a dense copy when no bias or input says otherwise
    (a PEFT merge). Not saved in state dicts."""

    def __init__(
        self,
        in_features: int,
        out_features: int,
        bias: bool = True,
        bits: int = 4,
        codebook: torch.Tensor | None = None,
        device: torch.device | str | None = None,
        dtype: torch.dtype | None = None,
        hadamard: bool = False,
    ) -> None:
        super().__init__()
        self.in_features = _check_features("in_features", in_features)
        self.out_features = _check_features("out_features", out_features)
        # tiled_shapes checks bits
        packed_shape, absmax_shape = fmt.tiled_shapes(out_features, in_features, bits)
        self.bits = bits
        fmt.check_bool("bias", bias)
        if dtype is not None:
            fmt.check_float_dtype(dtype)
        self.compute_dtype = torch.get_default_dtype() if dtype is None else dtype
        self.weight = nn.Parameter(torch.zeros(packed_shape, dtype=torch.int32, device=device), requires_grad=False)
        self.register_buffer("absmax", torch.zeros(absmax_shape, dtype=torch.uint8, device=device))
        self.register_buffer("codebook", fmt.resolve_codebook(codebook, bits, self.weight.device))
        self.register_buffer("tensor_scale", torch.ones(1, dtype=torch.float32, device=device))
        if bias:
            self.bias = nn.Parameter(torch.zeros(out_features, dtype=dtype, device=device))
        else:
            self.register_parameter("bias", None)
        fmt.check_bool("hadamard", hadamard)
        self.register_buffer("hadamard_signs", torch.ones(in_features, dtype=torch.int8, device=device) if hadamard else None)

    # -----------------------------------------------------------------------------------
    # construction from a dense layer
    # -----------------------------------------------------------------------------------

    @classmethod
    def from_linear(cls, linear: nn.Linear, bits: int = 4, codebook: torch.Tensor | str | None = None, *,
                    scale_search: bool = False, hessian: torch.Tensor | None = None,
                    damp: float = DEFAULT_DAMP, lazy_block: int = LAZY_BLOCK, act_order: bool = DEFAULT_ACT_ORDER,
                    hadamard: bool = False,
                    hadamard_seed: int = 0, hadamard_search: int = 1,
                    tensor_scale: torch.Tensor | None = None) -> "KbitLinear":
        """Quantize an ``nn.Linear`` into a new ``KbitLinear`` on the same device.

        The weight goes through :func:`kbit_linear.quantizer.quantize_weight` (validated once,
        then the ``kbit_linear::quantize`` and ``::repack`` ops on the weight's device: the CUDA
        kernels when the weight is on a GPU with the CUDA backend). A weight on the meta device
        gives a meta layer (shapes only). The bias is shared with ``linear`` (same Parameter);
        ``linear`` itself is left unchanged.

        Any ``nn.Linear``, subclasses included: converting one layer by hand is the caller's
        choice (the automatic swaps of :mod:`kbit_linear.patch` take exact ``nn.Linear`` only).

        Args:
            linear: the layer; its weight must be a finite floating-point ``[out, in]`` tensor.
            bits: index width, 2..5.
            codebook: float ``[2**bits]`` (default: the normal-float codebook), or
                ``"fitted"``: levels fitted to this weight (:mod:`kbit_linear.codebooks`).
            scale_search: choose block scales for the least error instead of the round-up
                absmax (:func:`kbit_linear.quantizer.quantize_weight`).
            hessian: ``X^T X`` ``[in, in]`` of the layer's inputs for calibrated (GPTQ-style)
                rounding; ``damp`` its damping, ``lazy_block`` its columns per lazy batch update
                and ``act_order`` its column order (:mod:`kbit_linear.calibration`).
            hadamard: quantize the weight rotated by a randomized Hadamard transform
                (:mod:`kbit_linear.hadamard`; the layer rotates its inputs to match). Better
                accuracy at K = 2 and 3 for a rotation of the input per call.
            hadamard_seed: the seed of the rotation's sign vector.
            hadamard_search: try this many sign vectors (seeds ``hadamard_seed`` onwards) and
                keep the one whose rotated weight quantizes with the least error
                (:func:`kbit_linear.quantizer.hadamard_signs_for`; that many data-free
                quantizations more).
            tensor_scale: a power-of-two tensor scale to use instead of the weight's own (the
                layers of a fused group share one: :func:`kbit_linear.quantizer.group_quantization`).

        Returns:
            The quantized layer.

        Raises:
            TypeError: ``linear`` is not an ``nn.Linear`` or its weight is not floating point.
            ValueError: bad ``bits``/``codebook``, a weight with NaN/Inf, or a weight whose shape is not
                the layer's ``[out_features, in_features]`` (a weight swapped in by hand).
        """
        if not isinstance(linear, nn.Linear):
            raise TypeError(f"linear must be an nn.Linear, got {type(linear).__name__}")
        if tuple(linear.weight.shape) != (linear.out_features, linear.in_features):
            raise ValueError(f"linear.weight has shape {tuple(linear.weight.shape)}, the layer's [out_features, in_features] "
                             f"is ({linear.out_features}, {linear.in_features})")
        fmt.check_bool("hadamard", hadamard)
        hadamard_search = check_hadamard_search(hadamard_search, hadamard=hadamard)
        signs = None
        if hadamard:
            signs = hadamard_signs_for(linear.weight, bits, codebook, scale_search=scale_search, seed=hadamard_seed,
                                       candidates=hadamard_search,
                                       name=f"linear.weight ({linear.out_features}x{linear.in_features})")
        q = quantize_weight(
            linear.weight, bits, codebook, scale_search=scale_search, hessian=hessian, damp=damp, lazy_block=lazy_block,
            act_order=act_order, hadamard_signs=signs, tensor_scale=tensor_scale,
            name=f"linear.weight ({linear.out_features}x{linear.in_features})",
        )
        # Built on meta (allocates nothing), then given the real tensors.
        layer = cls(linear.in_features, linear.out_features, bias=False, bits=bits, device="meta", dtype=linear.weight.dtype,
                    hadamard=hadamard)
        if hadamard:
            layer.hadamard_signs = signs
        layer.weight = nn.Parameter(weight_layout.device_form(q.packed, bits), requires_grad=False)
        layer.absmax = q.absmax
        layer.codebook = q.codebook
        layer.tensor_scale = q.tensor_scale
        layer.bias = linear.bias
        return layer

    # -----------------------------------------------------------------------------------
    # compute
    # -----------------------------------------------------------------------------------

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """``x @ W^T + bias``.

        Args:
            x: float32/float16/bfloat16 ``[..., in_features]`` on the layer's device (float64
                is accepted and computed in float32).

        Returns:
            ``[..., out_features]`` in ``x``'s dtype. Under ``torch.autocast`` too: the layer
            computes in ``x``'s dtype, where ``nn.Linear`` would compute (and return) the
            autocast dtype; cast ``x`` first for that.
        """
        if not isinstance(x, torch.Tensor):  # (an AttributeError on .dim() otherwise)
            raise TypeError(f"x must be a floating-point torch.Tensor, got {type(x).__name__}")
        # The gemm op only knows in_features up to the 64-wide tile padding, so it would
        # accept a slightly too wide x and read the padding: one int compare refuses it.
        if x.dim() == 0 or x.shape[-1] != self.in_features:
            raise ValueError(f"x's last dimension must be in_features={self.in_features}, got shape {tuple(x.shape)}")
        if self.hadamard_signs is not None:
            x = _ops.hadamard_rotate(x, self.hadamard_signs)
        return _ops.gemm(x, self.weight, self.absmax, self.codebook, self.tensor_scale, self.bits, self.out_features, self.bias)

    def dequantize(self, dtype: torch.dtype | None = None) -> torch.Tensor:
        """The dense weight this layer represents.

        Args:
            dtype: result dtype (default float32, which holds every dequantized value exactly;
                a Hadamard-rotated layer's weight is rotated back in float32, so it is exact to
                float32 rounding only, in any dtype).

        Returns:
            ``[out_features, in_features]`` on the layer's device.
        """
        dtype = fmt.check_float_dtype(torch.float32 if dtype is None else dtype)
        if self.hadamard_signs is not None:  # the stored W R, rotated back in float32
            stored = _DEQUANTIZE(self.weight, self.absmax, self.codebook, self.tensor_scale, self.bits, self.out_features,
                                 self.in_features, torch.float32)
            return hd.unrotate(stored, self.hadamard_signs).to(dtype)
        return _DEQUANTIZE(
            self.weight, self.absmax, self.codebook, self.tensor_scale, self.bits, self.out_features, self.in_features, dtype
        )

    def kbit_weight(self) -> fmt.KbitWeight:
        """The stored quantized weight as a :class:`kbit_linear.format.KbitWeight` (shares
        storage; ``W R``, not ``W``, for a Hadamard-rotated layer: see ``hadamard_signs``)."""
        return fmt.KbitWeight(
            self.weight.detach(), self.absmax, self.codebook, self.tensor_scale, self.bits, self.out_features, self.in_features
        )

    def extra_repr(self) -> str:
        rotated = ", hadamard=True" if self.hadamard_signs is not None else ""
        return f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}, bits={self.bits}{rotated}"

    # -----------------------------------------------------------------------------------
    # nn.Module plumbing
    # -----------------------------------------------------------------------------------

    def __setstate__(self, state: dict[str, Any]) -> None:
        super().__setstate__(state)
        if "compute_dtype" not in self.__dict__:  # pickled before the attribute existed
            self.compute_dtype = self.bias.dtype if self.bias is not None else torch.get_default_dtype()

    def _apply(self, fn: Callable[[torch.Tensor], torch.Tensor], recurse: bool = True) -> "KbitLinear":
        _refuse_integer_casts(self, fn)
        self.compute_dtype = _cast_dtype(fn, self.compute_dtype, self.weight.device)
        return _apply_keeping_format(self, fn, recurse)

    def _save_to_state_dict(self, destination: dict[str, Any], prefix: str, keep_vars: bool) -> None:
        super()._save_to_state_dict(destination, prefix, keep_vars)
        if prefix + "weight" in destination:  # state dicts and checkpoints hold planes
            destination[prefix + "weight"] = weight_layout.storage_form(destination[prefix + "weight"])
        _record_layout(destination, prefix, _linear_layout(self))

    def _load_from_state_dict(
        self,
        state_dict: dict[str, Any],
        prefix: str,
        local_metadata: dict[str, Any],
        strict: bool,
        missing_keys: list[str],
        unexpected_keys: list[str],
        error_msgs: list[str],
    ) -> None:
        if not _check_layout(local_metadata, prefix, _linear_layout(self), error_msgs, "kbit layer"):
            return
        if not _check_state_dtypes(state_dict, prefix, STATE_DTYPES, error_msgs, f"a {self.bits}-bit KbitLinear"):
            return
        if not _check_state_values(state_dict, prefix, self.bits, error_msgs):
            return
        # The state dict holds planes: take them in planes, then move to the device's layout.
        self.weight.data = weight_layout.storage_form(self.weight.data)
        super()._load_from_state_dict(state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys, error_msgs)
        weight_layout.adopt(self.weight, self.bits)
