"""Horizontal fusion: sibling ``KbitLinear`` layers that read the same input run as one GEMM.

A decoder layer calls ``q_proj``, ``k_proj`` and ``v_proj`` one after another on the same hidden
states, and ``gate_proj`` and ``up_proj`` on the same normalized states. At decode batch sizes
every GEMM call pays a fixed cost (the launch, the pipeline's fill and drain, the tiles a narrow
weight leaves idle) on top of streaming its weight; one call over the concatenated weight pays it
once and streams the same bytes.

:func:`fuse_projections` puts one :class:`FusedKbitLinear` (the concatenated tensors: the only
copy in memory) beside each such group in the parent module and a :class:`KbitLinearSlice` in
each part's place. The first slice called with an input computes the fused product; the others,
called with the same tensor object during the same call of the parent module, take their
columns of it. Hooks on the parent mark its calls and drop the pending product before and after
each. A slice called with another input (or twice, or after the input was changed in place, or
in another grad mode), or outside a call of its parent, computes the product again, so the result
is right whatever the caller does; it is only fast when the parent calls every part on the same
tensor, as decoder layers do. (Under ``torch.compile`` a part is so only ever served a product of
the same call of the parent.) Cross-attention modules are not fused: their query and key/value
projections read different inputs. Limits: an input changed in place between two parts is seen
in eager autograd or ``no_grad`` code (its version counter), not under ``torch.inference_mode``
or ``torch.compile`` (decoder layers never do it); eager calls keep the pending product per
thread; ``nn.DataParallel`` replicas would share one fused module (unfuse first).

Layout: the tiled weight is ``[K_pad/64, N_pad/128, 128, 2, bits]`` (``docs/format.md``), so the
parts concatenate along dimension 1, whole 128-feature tiles each; a part whose width is not a
multiple of 128 keeps its zero padding inside the fused weight and its columns start on a tile.

State dicts and checkpoints see the parts as the ``KbitLinear`` layers they were (the same keys
and tensors, bit for bit, as copies); the fused module adds no keys. ``load_state_dict`` writes
each part's tensors into the fused ones, where the state dict's shared tensors (levels, tensor
scale, rotation) are the group's: a state dict of the same model, or of one quantized with
``fuse=True`` from the same weights; other state dicts need the unfused layers.
:func:`unfuse_projections` gives the ``KbitLinear`` layers back (for PEFT, tensor-parallel
sharding or anything else that works on single layers).

The slices hand out column views of the fused output (not contiguous); ``view`` calls that
split the last dimension, as attention layers do, work on them.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass, field
from typing import Any, Callable, Iterator, Sequence

import torch
from torch import nn

from . import format as fmt
from . import weight_layout
from .linear import (STATE_DTYPES, KbitLinear, _apply_keeping_format, _cast_dtype, _check_layout, _check_state_dtypes,
                     _linear_layout, _record_layout, _refuse_integer_casts)

__all__ = ["DEFAULT_GROUPS", "FusedKbitLinear", "FusionSummary", "KbitLinearSlice", "fuse_projections", "is_cross_attention",
           "kbit_layers", "unfuse_projections"]

# Sibling names that decoder layers call on one input: attention's q/k/v, the gated MLP's gate/up,
# and multi-head latent attention's two down-projections (DeepSeek-V2/V3 with a query rank).
DEFAULT_GROUPS: tuple[tuple[str, ...], ...] = (("q_proj", "k_proj", "v_proj"), ("gate_proj", "up_proj"),
                                               ("q_a_proj", "kv_a_proj_with_mqa"))

# Module names (the last component) of cross-attention in transformers' encoder-decoder models,
# besides any name or class name with "cross" in it and the ``is_cross_attention`` flag.
_CROSS_ATTENTION_NAMES = ("encoder_attn", "encoder_decoder_attention")


def is_cross_attention(name: str, module: nn.Module) -> bool:
    """Whether the module called ``name`` is cross-attention, whose query and key/value
    projections read different inputs (never fused): its ``is_cross_attention`` flag, or "cross"
    in its name's last component or its class name, or a name of :data:`_CROSS_ATTENTION_NAMES`.

    Raises:
        TypeError: ``name`` is not a string or ``module`` not an ``nn.Module``.
    """
    if not isinstance(name, str):  # (a named error, not an AttributeError on rpartition)
        raise TypeError(f"name must be a str, got {type(name).__name__}")
    fmt.check_module(module, "module")
    last = name.rpartition(".")[2].lower()
    return (bool(getattr(module, "is_cross_attention", False)) or "cross" in last or "cross" in type(module).__name__.lower()
            or last in _CROSS_ATTENTION_NAMES)

# The state-dict tensors of one part, in KbitLinear's order (parameters, then buffers).
_PART_TENSORS = ("weight", "bias", "absmax", "codebook", "tensor_scale", "hadamard_signs")


class _Pending:
    """A group's pending product: the input it was computed for, the product, what else must
    match (``key``), which parts took their columns, and whether a call of the parent is under way."""

    def __init__(self) -> None:
        self.input: torch.Tensor | None = None
        self.output: torch.Tensor | None = None
        self.key: object = None
        self.taken = 0
        self.in_parent_call = False

    def drop(self) -> None:
        self.input = self.output = self.key = None
        self.taken = 0


class _ThreadPending(_Pending, threading.local):
    """:class:`_Pending` per thread (eager calls from several threads on one model)."""


def _fused_name(names: Sequence[str]) -> str:
    """The attribute the fused module takes in the parent: ``("q_proj", "k_proj", "v_proj")`` -> ``fused_q_k_v``
    (``("q_a_proj", "kv_a_proj_with_mqa")`` -> ``fused_q_a_kv_a_proj_with_mqa``)."""
    return "fused_" + "_".join(n.removesuffix("_proj") for n in names)


class FusedKbitLinear(nn.Module):
    """The concatenated weight of sibling ``KbitLinear`` layers, computed as one GEMM.

    Holds what a ``KbitLinear`` of ``out_features`` columns holds (``weight``, ``absmax``,
    ``codebook``, ``tensor_scale``, ``bias``, ``hadamard_signs``; each part starts on a 128-column
    tile, so ``out_features`` = the last part's offset + its width), and where each part's
    columns are. Its tensors are not in state dicts: the parts'
    :class:`KbitLinearSlice` modules save and load their own pieces of them.

    Build it with :func:`fuse_projections`; calling it returns the whole fused product. Built
    directly, ``parts`` must be two or more layers that :func:`fuse_projections` would fuse
    (else a ``ValueError`` says why).
    """

    def __init__(self, parts: Sequence[KbitLinear]) -> None:
        super().__init__()
        if not isinstance(parts, (list, tuple)):
            raise TypeError(f"parts must be a list of KbitLinear layers, got {type(parts).__name__}")
        if len(parts) < 2:
            raise ValueError(f"parts must hold two or more KbitLinear layers, got {len(parts)}")
        why = _parts_incompatibility([f"parts[{i}]" for i in range(len(parts))], parts)
        if why is not None:  # a differing codebook or scale would silently be replaced by the first part's
            raise ValueError(f"parts cannot share one GEMM: {why}")
        first = parts[0]
        self.in_features = first.in_features
        self.bits = first.bits
        self.part_compute_dtypes: tuple[torch.dtype, ...] = tuple(p.compute_dtype for p in parts)  # given back by unfusing
        offsets, start = [], 0
        for p in parts:
            offsets.append(start)
            start += fmt.padded_shape(p.out_features, p.in_features)[0]
        self.offsets: tuple[int, ...] = tuple(offsets)
        self.widths: tuple[int, ...] = tuple(p.out_features for p in parts)
        self.out_features = offsets[-1] + parts[-1].out_features
        self.part_biased: tuple[bool, ...] = tuple(p.bias is not None for p in parts)
        # what unfusing gives back: the fused bias is frozen (inference), the parts' were perhaps not
        self.part_bias_grad: tuple[bool, ...] = tuple(p.bias is not None and p.bias.requires_grad for p in parts)
        self.train(first.training)
        with torch.no_grad():
            self.weight = nn.Parameter(torch.cat([p.weight.detach() for p in parts], dim=1), requires_grad=False)
            self.register_buffer("absmax", torch.cat([p.absmax for p in parts], dim=1))
            self.register_buffer("codebook", first.codebook)
            self.register_buffer("tensor_scale", first.tensor_scale)
            self.register_buffer("hadamard_signs", first.hadamard_signs)
            biased = [p for p in parts if p.bias is not None]
            if biased:
                bias = torch.zeros(self.out_features, dtype=biased[0].bias.dtype, device=biased[0].bias.device)
                for off, p in zip(offsets, parts):
                    if p.bias is not None:
                        bias[off : off + p.out_features] = p.bias.detach()
                self.bias = nn.Parameter(bias, requires_grad=False)
            else:
                self.register_parameter("bias", None)
        # The product of the last input, until every part has taken its columns or the parent's
        # call ends: per thread in eager calls; one plain object that torch.compile traces away
        # in compiled code (where the parent's hooks are traced too).
        self._eager: _Pending = _ThreadPending()
        self._traced = _Pending()
        self._hooks: list[Any] = []  # the parent's hooks (fuse_projections)

    # The fused product ``x @ [W_0; W_1; ...]^T + bias``, ``[..., out_features]`` (each part's
    # columns at its offset, zeros in the tile padding between parts): the module holds what a
    # KbitLinear holds, under the same names, so KbitLinear's forward computes it.
    forward = KbitLinear.forward

    @staticmethod
    def _key_of(x: torch.Tensor) -> object:
        """What besides its identity must match for ``x``'s pending product to be served: the
        grad mode and, in eager mode, the tensor's version counter (an in-place change bumps it;
        inference tensors have none and cannot be changed in place outside inference mode)."""
        if torch.compiler.is_compiling():
            return torch.is_grad_enabled()
        return torch.is_grad_enabled(), -1 if x.is_inference() else x._version

    def _state(self) -> _Pending:
        return self._traced if torch.compiler.is_compiling() else self._eager

    @property
    def holds_product(self) -> bool:
        """Whether a product is pending (in this thread, eager)."""
        return self._eager.output is not None

    @property
    def in_parent_call(self) -> bool:
        """Whether a call of the parent module is under way (in this thread, eager)."""
        return self._eager.in_parent_call

    def part(self, x: torch.Tensor, index: int) -> torch.Tensor:
        """Part ``index``'s output for ``x``: its columns of the fused product, computed here unless
        the product of this very tensor (unchanged, same grad mode) is pending and the part has
        not taken its columns yet."""
        if not isinstance(x, torch.Tensor):  # (the pending-product key would raise an AttributeError)
            raise TypeError(f"x must be a floating-point torch.Tensor, got {type(x).__name__}")
        off = self.offsets[index]
        st = self._state()
        if not st.in_parent_call:  # called from elsewhere: nothing to share with
            return self(x)[..., off : off + self.widths[index]]
        bit = 1 << index
        key = self._key_of(x)
        if st.input is not x or st.key != key or st.taken & bit:
            st.output = self(x)
            st.input, st.key = x, key
            st.taken = 0
        out = st.output
        st.taken |= bit
        if st.taken == (1 << len(self.offsets)) - 1:  # every part served: hold nothing
            st.drop()
        return out[..., off : off + self.widths[index]]

    def drop_pending(self) -> None:
        """Forget the pending product (before and after each call of the parent, after loading,
        on device moves)."""
        self._state().drop()

    def _parent_call_starts(self, module: nn.Module, args: Any) -> None:
        st = self._state()
        st.drop()
        st.in_parent_call = True

    def _parent_call_ends(self, module: nn.Module, args: Any, output: Any) -> None:
        st = self._state()
        st.drop()
        st.in_parent_call = False

    def __getstate__(self) -> dict[str, Any]:
        state = dict(self.__dict__)  # the per-thread state is not picklable, and no copy should hold a product
        state["_eager"], state["_traced"] = None, _Pending()
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        super().__setstate__(state)
        self._eager = _ThreadPending()
        if "part_compute_dtypes" not in self.__dict__:  # pickled before the attribute existed
            dtype = self.bias.dtype if self.bias is not None else torch.get_default_dtype()
            self.part_compute_dtypes = (dtype,) * len(self.widths)

    def _apply(self, fn: Callable[[torch.Tensor], torch.Tensor], recurse: bool = True) -> "FusedKbitLinear":
        _refuse_integer_casts(self, fn)
        self.drop_pending()  # a pending product on the old device is no use
        self.part_compute_dtypes = tuple(_cast_dtype(fn, d, self.weight.device) for d in self.part_compute_dtypes)
        return _apply_keeping_format(self, fn, recurse)

    def _save_to_state_dict(self, destination: dict[str, Any], prefix: str, keep_vars: bool) -> None:
        pass  # the slices save the parts

    def _load_from_state_dict(self, state_dict: dict[str, Any], prefix: str, local_metadata: dict[str, Any], strict: bool,
                              missing_keys: list[str], unexpected_keys: list[str], error_msgs: list[str]) -> None:
        pass  # the slices load the parts

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features}, bits={self.bits}, "
                f"parts={self.widths}, offsets={self.offsets}")


class KbitLinearSlice(nn.Module):
    """One part of a :class:`FusedKbitLinear`, in the place of the ``KbitLinear`` it was.

    ``forward`` returns the part's columns of the fused product (see the module docstring);
    state dicts hold the part's own tensors under ``KbitLinear``'s names, and loading one writes
    them into the fused tensors. :meth:`as_kbit_linear` gives a standalone copy.
    """

    def __init__(self, fused: FusedKbitLinear, index: int) -> None:
        super().__init__()
        if not isinstance(fused, FusedKbitLinear):
            raise TypeError(f"fused must be a FusedKbitLinear, got {type(fused).__name__}")
        if isinstance(index, bool) or not isinstance(index, int) or not 0 <= index < len(fused.widths):
            raise ValueError(f"index must be an int in [0, {len(fused.widths)}) (a part of the fused module), got {index!r}")
        self.__dict__["_fused"] = fused  # a reference, not a child: the parent owns the fused module
        self.index = index
        self.train(fused.training)
        self.in_features = fused.in_features
        self.out_features = fused.widths[index]
        self.bits = fused.bits

    @property
    def fused(self) -> FusedKbitLinear:
        """The fused module this slice reads."""
        return self.__dict__["_fused"]

    @property
    def bias(self) -> torch.Tensor | None:
        """This part's bias (a view of the fused bias), or ``None`` if the part had none."""
        f = self.fused
        if f.bias is None or not f.part_biased[self.index]:
            return None
        off = f.offsets[self.index]
        return f.bias[off : off + self.out_features]

    @property
    def hadamard_signs(self) -> torch.Tensor | None:
        """The Hadamard rotation's signs the group shares, or ``None``."""
        return self.fused.hadamard_signs

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """``x @ W^T + bias`` for this part, ``[..., out_features]`` in ``x``'s dtype (a column view)."""
        return self.fused.part(x, self.index)

    def _tiles(self) -> slice:
        first = self.fused.offsets[self.index] // fmt.TILE_N
        return slice(first, first + fmt.padded_shape(self.out_features, self.in_features)[0] // fmt.TILE_N)

    def part_tensors(self) -> dict[str, torch.Tensor | None]:
        """This part's tensors as a ``KbitLinear`` of its shape holds them: new copies at every
        call (``weight`` as bit-planes, the stored form), so a state dict of a fused model holds
        a copy of each grouped weight while it lives."""
        f, tiles = self.fused, self._tiles()
        return {
            "weight": weight_layout.storage_form(f.weight.detach()[:, tiles].clone()),
            "bias": None if self.bias is None else self.bias.detach().clone(),
            "absmax": f.absmax[:, tiles].clone(),
            "codebook": f.codebook.clone(),
            "tensor_scale": f.tensor_scale.clone(),
            "hadamard_signs": None if f.hadamard_signs is None else f.hadamard_signs.clone(),
        }

    def as_kbit_linear(self) -> KbitLinear:
        """A standalone ``KbitLinear`` equal to this part (its own copies of the tensors)."""
        t = self.part_tensors()
        layer = KbitLinear(self.in_features, self.out_features, bias=t["bias"] is not None, bits=self.bits, device="meta",
                           dtype=self.fused.part_compute_dtypes[self.index], hadamard=t["hadamard_signs"] is not None)
        layer.weight = nn.Parameter(weight_layout.device_form(t["weight"], self.bits), requires_grad=False)
        for name in ("absmax", "codebook", "tensor_scale", "hadamard_signs"):
            if t[name] is not None:
                setattr(layer, name, t[name])
        if t["bias"] is not None:
            layer.bias = nn.Parameter(t["bias"], requires_grad=self.fused.part_bias_grad[self.index])
        layer.train(self.training)
        return layer

    def dequantize(self, dtype: torch.dtype | None = None) -> torch.Tensor:
        """The dense ``[out_features, in_features]`` weight of this part (as :meth:`KbitLinear.dequantize`)."""
        return self.as_kbit_linear().dequantize(dtype)

    def _save_to_state_dict(self, destination: dict[str, Any], prefix: str, keep_vars: bool) -> None:
        for name, t in self.part_tensors().items():
            if t is not None:
                destination[prefix + name] = t
        _record_layout(destination, prefix, _linear_layout(self))

    def _load_from_state_dict(self, state_dict: dict[str, Any], prefix: str, local_metadata: dict[str, Any], strict: bool,
                              missing_keys: list[str], unexpected_keys: list[str], error_msgs: list[str]) -> None:
        f = self.fused
        if not _check_layout(local_metadata, prefix, _linear_layout(self), error_msgs, "kbit layer"):
            return
        if not _check_state_dtypes(state_dict, prefix, STATE_DTYPES, error_msgs, f"a {self.bits}-bit fused part"):
            return
        mine = self.part_tensors()
        given = {name: state_dict.get(prefix + name) for name in _PART_TENSORS}
        if strict:
            unexpected_keys.extend(k for k in state_dict if k.startswith(prefix) and k[len(prefix):] not in _PART_TENSORS)
        for name, have in mine.items():
            if (have is None) != (given[name] is None):
                (missing_keys if have is not None else unexpected_keys).append(prefix + name)
            elif have is not None and tuple(given[name].shape) != tuple(have.shape):
                error_msgs.append(f"size mismatch for {prefix}{name}: copying a param with shape {tuple(given[name].shape)}, "
                                  f"the fused part {prefix[:-1]!r} has {tuple(have.shape)}")
        if error_msgs:
            return
        # A tensor this part does not have (a bias, a rotation's signs) is unexpected and never taken:
        # written into the fused tensors it would change the part's output without its knowing.
        given = {name: t if mine[name] is not None else None for name, t in given.items()}
        # The parts of one fused module share these: a different one cannot be taken in place.
        for name in ("codebook", "tensor_scale", "hadamard_signs"):
            t = given[name]
            if t is not None and not torch.equal(t.to(mine[name].device), mine[name]):
                error_msgs.append(f"{prefix}{name} differs from the other parts of its fused module {f.widths}: "
                                  "call kbit_linear.unfuse_projections(model) before loading it")
                return
        tiles, off = self._tiles(), f.offsets[self.index]
        f.drop_pending()  # a product of the old weights
        with torch.no_grad():
            if given["weight"] is not None:
                f.weight[:, tiles] = weight_layout.device_form(given["weight"].to(f.weight.device), self.bits)
            if given["absmax"] is not None:
                f.absmax[:, tiles] = given["absmax"].to(f.absmax.device)
            if given["bias"] is not None:
                f.bias[off : off + self.out_features] = given["bias"].to(f.bias.device, f.bias.dtype)

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features}, bits={self.bits}, "
                f"columns {self.fused.offsets[self.index]}..{self.fused.offsets[self.index] + self.out_features - 1} of a fused GEMM")


@dataclass
class FusionSummary:
    """What :func:`fuse_projections` did: the groups it fused and, for every group it found but
    left alone, why (both keyed ``"<parent>.<name>/<name>..."``)."""

    fused: dict[str, tuple[str, ...]] = field(default_factory=dict)
    skipped: dict[str, str] = field(default_factory=dict)

    def __str__(self) -> str:
        lines = [f"fused {len(self.fused)} groups of projections"]
        lines += [f"  skipped {name}: {why}" for name, why in sorted(self.skipped.items())]
        return "\n".join(lines)


def _incompatibility(parent_name: str, parent: nn.Module, names: Sequence[str], parts: Sequence[nn.Module]) -> str | None:
    """Why ``parts`` cannot share one GEMM, or ``None`` (the reasons that say most come first)."""
    if all(isinstance(p, KbitLinearSlice) for p in parts):
        return "already fused"
    if is_cross_attention(parent_name, parent):
        return "cross-attention: its query and key/value projections read different inputs"
    return _parts_incompatibility(names, parts, parent)


def _parts_incompatibility(names: Sequence[str], parts: Sequence[nn.Module], parent: nn.Module | None = None) -> str | None:
    """Why the modules ``parts`` (called ``names``) cannot be one :class:`FusedKbitLinear`, or
    ``None``; with ``parent``, also whether it has room for it."""
    for name, p in zip(names, parts):
        if type(p) is not KbitLinear:
            return f"{name} is a {type(p).__name__}, not a KbitLinear"
        if p._forward_hooks or p._forward_pre_hooks or p._backward_hooks or p._backward_pre_hooks or hasattr(p, "_hf_hook"):
            return f"{name} has hooks (module or accelerate hooks), which a fused part would no longer run"
    if any(p.weight.device.type == "meta" for p in parts):
        return "its tensors are on the meta device"
    first = parts[0]
    if parent is not None and hasattr(parent, _fused_name(names)):
        return f"the parent already has an attribute {_fused_name(names)!r}"
    for name, p in zip(names[1:], parts[1:]):  # shapes and widths first: they explain the rest
        if p.in_features != first.in_features:
            return f"{name} has in_features={p.in_features}, {names[0]} {first.in_features}"
        if p.bits != first.bits:
            return f"{name} has bits={p.bits}, {names[0]} {first.bits}"
    for name, p in zip(names[1:], parts[1:]):
        if p.weight.device != first.weight.device or p.weight.dtype != first.weight.dtype:
            return f"{name}'s weight is {p.weight.dtype} on {p.weight.device}, {names[0]}'s {first.weight.dtype} on {first.weight.device}"
        if not torch.equal(p.codebook, first.codebook):
            return f"{name} and {names[0]} have different codebooks"
        if not torch.equal(p.tensor_scale, first.tensor_scale):
            return f"{name} and {names[0]} have different tensor scales"
        if (p.hadamard_signs is None) != (first.hadamard_signs is None) or (
                p.hadamard_signs is not None and not torch.equal(p.hadamard_signs, first.hadamard_signs)):
            return f"{name} and {names[0]} have different Hadamard rotations"

    biases = [(n, p.bias) for n, p in zip(names, parts) if p.bias is not None]
    for name, b in biases[1:]:
        if b.dtype != biases[0][1].dtype or b.device != biases[0][1].device:
            return f"{name}'s bias is {b.dtype} on {b.device}, {biases[0][0]}'s {biases[0][1].dtype} on {biases[0][1].device}"
    return None


def _check_groups(groups: Any) -> tuple[tuple[str, ...], ...]:
    if isinstance(groups, (str, bytes)) or not isinstance(groups, (list, tuple)):
        raise TypeError(f"groups must be a sequence of name tuples, got {type(groups).__name__}")
    out = []
    for g in groups:
        if isinstance(g, (str, bytes)) or not isinstance(g, (list, tuple)) or not all(isinstance(n, str) for n in g):
            raise TypeError(f"each entry of groups must be a tuple of module names, got {g!r}")
        if len(g) < 2 or len(set(g)) != len(g):
            raise ValueError(f"each entry of groups must name at least two distinct modules, got {g!r}")
        if any(not n or "." in n for n in g):  # a dotted path never matches a child: nothing would be fused
            raise ValueError(f"each entry of groups must hold child names (no dots, not empty), such as 'q_proj', got {g!r}")
        out.append(tuple(g))
    return tuple(out)


def fuse_projections(model: nn.Module, groups: Sequence[Sequence[str]] = DEFAULT_GROUPS) -> FusionSummary:
    """Fuse sibling ``KbitLinear`` layers that read the same input into one GEMM each, in place.

    For every module with children named as one entry of ``groups`` (all of them ``KbitLinear``
    with the same in_features, bits, codebook, tensor scale and Hadamard rotation, on one
    device), the parts' tensors are concatenated into a :class:`FusedKbitLinear` set on the
    parent as ``fused_<names>`` (``fused_q_k_v``, ``fused_gate_up``), and each part is replaced
    by a :class:`KbitLinearSlice`. Memory does not grow (the parts' tensors are freed unless
    something else holds them; one group at a time is held twice while it is built). The parent
    gets two forward hooks that mark its calls (the parts share a product within one call). Outputs equal the unfused model's up to the GEMM's
    rounding (another plan may sum in another order); state dicts are unchanged.

    For inference: the fused tensors, the bias included, are frozen, and adapters (PEFT) need
    the unfused layers (:func:`unfuse_projections`).

    Args:
        model: any module (a transformers model after quantization or loading).
        groups: the sibling names to fuse, each a tuple of two or more child names.

    Returns:
        A :class:`FusionSummary` (fused groups; groups found but left alone, with the reason).

    Raises:
        TypeError / ValueError: ``model`` is not a module, or ``groups`` is malformed.
    """
    fmt.check_module(model, "model")
    groups = _check_groups(groups)
    summary = FusionSummary()
    for parent_name, parent in list(model.named_modules()):
        for names in groups:
            parts = [parent._modules.get(n) for n in names]
            if any(p is None for p in parts):
                continue
            where = f"{parent_name}.{'/'.join(names)}" if parent_name else "/".join(names)
            why = _incompatibility(parent_name, parent, names, parts)
            if why is not None:
                summary.skipped[where] = why
                continue
            fused = FusedKbitLinear(parts)
            parent.add_module(_fused_name(names), fused)
            fused._hooks = [parent.register_forward_pre_hook(fused._parent_call_starts),
                            parent.register_forward_hook(fused._parent_call_ends, always_call=True)]
            for i, n in enumerate(names):
                setattr(parent, n, KbitLinearSlice(fused, i))
            summary.fused[where] = names
    return summary


def unfuse_projections(model: nn.Module) -> int:
    """Give every :class:`KbitLinearSlice` in ``model`` its own ``KbitLinear`` back and drop the
    fused modules, in place (the inverse of :func:`fuse_projections`, bit for bit).

    Returns:
        The number of layers restored.
    """
    fmt.check_module(model, "model")
    restored = 0
    for _, parent in list(model.named_modules()):
        for name, child in list(parent._modules.items()):
            if isinstance(child, KbitLinearSlice):
                setattr(parent, name, child.as_kbit_linear())
                restored += 1
        for name, child in list(parent._modules.items()):
            if isinstance(child, FusedKbitLinear):
                for handle in child._hooks:
                    handle.remove()
                delattr(parent, name)
    if restored and hasattr(model, "kbit_fusion"):  # what a fused load reported no longer holds
        del model.kbit_fusion
    return restored


def kbit_layers(model: nn.Module, remove_duplicate: bool = True) -> Iterator[tuple[str, KbitLinear]]:
    """``(name, layer)`` for every quantized linear layer of ``model`` as a ``KbitLinear``: the
    model's own, and a standalone copy of each fused part (for metadata and checksums). A layer
    used under several names comes once, or, with ``remove_duplicate=False``, under every name
    (as a state dict lists it)."""
    fmt.check_module(model, "model")
    for name, module in model.named_modules(remove_duplicate=remove_duplicate):
        if isinstance(module, KbitLinear):
            yield name, module
        elif isinstance(module, KbitLinearSlice):
            yield name, module.as_kbit_linear()
