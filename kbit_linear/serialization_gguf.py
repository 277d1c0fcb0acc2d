"""GGUF modules in quantized checkpoints: the part of :mod:`kbit_linear.serialization` that knows
:class:`~kbit_linear.gguf_linear.GGUFLinear` and :class:`~kbit_linear.gguf_linear.GGUFEmbedding`.

The on-disk layout (tensor names, the ``kbit_linear.gguf`` header entry) is described in
:mod:`kbit_linear.serialization`, which writes and parses the header; this module holds what is
specific to the GGUF modules:

* :func:`gguf_metadata`: a module's entry in ``kbit_linear.gguf``;
* :func:`validate_gguf_metadata` / :func:`validate_gguf_tensors`: the checks of one entry and of
  its tensors (dtypes and shapes through :func:`kbit_linear.gguf_format.check_weight`, the one
  home of the array layout; here only what it does not cover: names, bias, finite block scales);
* :func:`install_gguf_modules`: what ``load_into`` does to a model before loading a state dict
  into it (dense ``nn.Linear`` / ``nn.Embedding`` swapped for GGUF modules, ties made again,
  transformers' tie tables told to leave the GGUF modules alone: :func:`kbit_linear.gguf_linear.forget_tied_weights`).

Functions raise :class:`~kbit_linear.serialization.CheckpointError` naming the layer (and the
file, given ``where``). :mod:`kbit_linear.serialization` imports this module when it runs (not at
import time), since this module takes ``CheckpointError`` from it.
"""

from __future__ import annotations

import math
from typing import Any, Mapping

import torch
from torch import nn

from . import gguf_format as gf
from .gguf_linear import GGUFEmbedding, GGUFLinear, embedding_scale, forget_tied_weights
from .patch import is_convertible, replace_module
from .serialization import CheckpointError, check_swap_bias

__all__ = [
    "GGUF_ARRAYS",
    "GGUF_KINDS",
    "GGUF_TENSORS",
    "gguf_metadata",
    "gguf_tensors",
    "install_gguf_modules",
    "stray_gguf_arrays",
    "validate_gguf_metadata",
    "validate_gguf_tensors",
]

GGUF_ARRAYS = ("qs", "qh", "scale", "mins")
"""Names of a GGUF module's arrays (buffers and stored tensors; only those its block type has)."""
GGUF_TENSORS = (*GGUF_ARRAYS, "bias")
"""Tensor names of one GGUF module (``bias``: linear layers only, optional)."""
GGUF_KINDS = {"linear": GGUFLinear, "embedding": GGUFEmbedding}
"""``kind`` in the header -> the module class."""

GGUFModule = GGUFLinear | GGUFEmbedding


def _ctx(prefix: str, where: str) -> str:
    """``"<file>: layer '<prefix>'"``, the start of every message."""
    return f"{where}: layer {prefix!r}" if where else f"layer {prefix!r}"


def gguf_metadata(module: GGUFModule) -> dict[str, Any]:
    """The ``kbit_linear.gguf`` header entry of one GGUF module.

    Args:
        module: a :class:`~kbit_linear.gguf_linear.GGUFLinear` or
            :class:`~kbit_linear.gguf_linear.GGUFEmbedding`.

    Returns:
        ``{"kind": "linear" | "embedding", "qtype", "out_features", "in_features", "bias"}``,
        and for a linear layer its ``activation_bits`` (16, or 8 for int8 activations: it
        changes the outputs, so the checkpoint carries it); for an embedding ``out_features``
        / ``in_features`` are ``num_embeddings`` / ``embedding_dim``, ``bias`` is ``False`` and
        ``embed_scale`` is its output factor as a float, or ``None``.

    Raises:
        TypeError: ``module`` is not a GGUF module.
        ValueError: an embedding's ``embed_scale`` is on the meta device.
    """
    if isinstance(module, GGUFLinear):
        return {"kind": "linear", "qtype": module.qtype, "out_features": module.out_features,
                "in_features": module.in_features, "bias": module.bias is not None,
                "activation_bits": module.activation_bits}
    if isinstance(module, GGUFEmbedding):
        if module.embed_scale is not None and module.embed_scale.device.type == "meta":
            raise ValueError("the embedding's embed_scale is on the meta device (no value to save); create it first")
        scale = None if module.embed_scale is None else float(module.embed_scale)
        return {"kind": "embedding", "qtype": module.qtype, "out_features": module.num_embeddings,
                "in_features": module.embedding_dim, "bias": False, "embed_scale": scale}
    raise TypeError(f"module must be a GGUFLinear or GGUFEmbedding, got {type(module).__name__}")


def validate_gguf_metadata(prefix: str, meta: Mapping[str, Any], *, where: str = "") -> dict[str, Any]:
    """Check one ``kbit_linear.gguf`` entry and return it complete (``qtype`` canonical,
    ``activation_bits`` filled in for a linear layer, ``embed_scale`` for an embedding).

    Required keys: ``kind`` (``"linear"`` or ``"embedding"``), ``qtype`` (a name of
    :data:`kbit_linear.gguf_format.BLOCK_TYPES`), ``out_features`` and ``in_features``
    (positive ints, ``in_features`` a multiple of 32), ``bias`` (bool; ``False`` for an
    embedding). Optional for a linear layer: ``activation_bits`` (16 or 8, default 16); for an
    embedding: ``embed_scale`` (a finite number or ``None``).

    Args:
        prefix: the module's name (for messages).
        meta: the entry (parsed from a header).
        where: what is being read (a file name), prepended to messages.

    Raises:
        CheckpointError: a missing or wrong entry, named.
    """
    ctx = _ctx(prefix, where)
    if not isinstance(meta, Mapping):
        raise CheckpointError(f"{ctx}: GGUF metadata must be a mapping, got {type(meta).__name__}")
    for key in ("kind", "qtype", "out_features", "in_features", "bias"):
        if key not in meta:
            raise CheckpointError(f"{ctx}: GGUF metadata lacks {key!r}")
    kind = meta["kind"]
    if kind not in GGUF_KINDS:
        raise CheckpointError(f"{ctx}: GGUF metadata 'kind' must be one of {sorted(GGUF_KINDS)}, got {kind!r}")
    try:
        qtype = gf.block_type(meta["qtype"]).name
        n, k = meta["out_features"], meta["in_features"]
        gf.field_shapes(qtype, n, k)  # checks both are positive ints, in_features a multiple of 32
    except ValueError as e:
        raise CheckpointError(f"{ctx}: GGUF metadata: {e}") from None
    bias = meta["bias"]
    if not isinstance(bias, bool):
        raise CheckpointError(f"{ctx}: GGUF metadata 'bias' must be a bool, got {bias!r}")
    out = {**dict(meta), "kind": kind, "qtype": qtype, "out_features": n, "in_features": k, "bias": bias}
    if kind == "linear":
        if "embed_scale" in meta:
            raise CheckpointError(f"{ctx}: GGUF metadata 'embed_scale' belongs to an embedding, not a linear layer")
        bits = meta.get("activation_bits", 16)
        if isinstance(bits, bool) or bits not in (8, 16):
            raise CheckpointError(f"{ctx}: GGUF metadata 'activation_bits' must be 8 or 16, got {bits!r}")
        out["activation_bits"] = bits
        return out
    if "activation_bits" in meta:
        raise CheckpointError(f"{ctx}: GGUF metadata 'activation_bits' belongs to a linear layer, not an embedding")
    if bias:
        raise CheckpointError(f"{ctx}: GGUF metadata says the embedding has a bias (embeddings have none)")
    scale = meta.get("embed_scale")
    if scale is not None and (isinstance(scale, bool) or not isinstance(scale, (int, float)) or not math.isfinite(scale)):
        raise CheckpointError(f"{ctx}: GGUF metadata 'embed_scale' must be a finite number or null, got {scale!r}")
    out["embed_scale"] = None if scale is None else float(scale)
    return out


def validate_gguf_tensors(
    prefix: str,
    tensors: Mapping[str, torch.Tensor],
    meta: Mapping[str, Any],
    *,
    where: str = "",
    check_values: bool = True,
) -> None:
    """Check the tensors of one GGUF module against its metadata.

    Names: exactly the arrays the block type has (:func:`kbit_linear.gguf_format.field_shapes`),
    plus ``bias`` when ``meta["bias"]``; dtypes and shapes through
    :func:`kbit_linear.gguf_format.check_weight`; ``bias`` floating-point ``[out_features]``.
    With ``check_values`` (skipped for meta tensors): the block scales ``scale`` and the minimums
    ``mins`` are finite, as llama.cpp's own row validation requires (any bits of ``qs`` / ``qh``
    are valid levels).

    Args:
        prefix: the module's name (for messages).
        tensors: short name (``"qs"``, ``"qh"``, ``"scale"``, ``"mins"``, ``"bias"``, and any
            other tensor stored under the prefix, which is refused) -> tensor.
        meta: the module's metadata (see :func:`validate_gguf_metadata`).
        where: what is being read (a file name), prepended to messages.
        check_values: also check the scales' values (one pass over them, 1/16 of the data).

    Raises:
        CheckpointError: the first problem found, naming the layer and the tensor.
    """
    meta = validate_gguf_metadata(prefix, meta, where=where)
    ctx = _ctx(prefix, where)
    qtype, n, k = meta["qtype"], meta["out_features"], meta["in_features"]
    fields = list(gf.field_shapes(qtype, n, k))
    allowed = [*fields, "bias"] if meta["bias"] else fields
    unknown = sorted(set(tensors) - set(allowed))
    if unknown:
        what = f"a {qtype} GGUF {meta['kind']}"
        raise CheckpointError(f"{ctx}: unexpected tensors {unknown} ({what} holds {allowed}; there is no 'weight')")
    missing = [name for name in allowed if name not in tensors]
    if missing:
        raise CheckpointError(f"{ctx}: tensors {missing} are missing (a {qtype} GGUF {meta['kind']} holds {allowed})")
    try:
        gf.check_weight(tensors["qs"], tensors.get("qh"), tensors["scale"], tensors.get("mins"), qtype, n, k)
    except (TypeError, ValueError) as e:
        raise CheckpointError(f"{ctx}: {e}") from None
    bias = tensors.get("bias")
    if bias is not None:
        if not isinstance(bias, torch.Tensor) or not bias.is_floating_point():
            got = getattr(bias, "dtype", type(bias).__name__)
            raise CheckpointError(f"{ctx}: 'bias' must be a floating-point tensor, got {got}")
        if tuple(bias.shape) != (n,):
            raise CheckpointError(f"{ctx}: 'bias' has shape {tuple(bias.shape)}, expected ({n},)")
    if not check_values or tensors["qs"].device.type == "meta":
        return
    for name in ("scale", "mins"):
        t = tensors.get(name)
        if t is None:
            continue
        bad = ~torch.isfinite(t)
        if bool(bad.any()):
            row, block = (int(i) for i in bad.nonzero()[0])
            value = t[row, block].item()
            raise CheckpointError(f"{ctx}: {name!r} holds a non-finite value (row {row}, block {block}: {value}): "
                                  "the tensors are corrupted")


def gguf_tensors(state: Mapping[str, torch.Tensor], prefix: str) -> dict[str, torch.Tensor]:
    """short name -> tensor of the GGUF module at ``prefix``, from a flat state dict (with
    ``weight`` too where there is one, for :func:`validate_gguf_tensors` to refuse)."""
    names = (*GGUF_TENSORS, "weight")
    return {s: state[f"{prefix}.{s}"] for s in names if f"{prefix}.{s}" in state}


def stray_gguf_arrays(state: Mapping[str, torch.Tensor], gguf: Mapping[str, Any]) -> list[str]:
    """Names ``<prefix>.qs`` of the state dict whose prefix also has a ``scale`` (the arrays of a
    GGUF module) but is not listed in ``gguf``."""
    out = []
    for name in state:
        prefix, _, last = name.rpartition(".")
        if last == "qs" and f"{prefix}.scale" in state and prefix not in gguf:
            out.append(name)
    return sorted(out)


# ---------------------------------------------------------------------------------------
# load_into: the model's modules
# ---------------------------------------------------------------------------------------


def _shape_of(module: nn.Module) -> tuple:
    """What must match between a GGUF module of the model and the checkpoint's metadata."""
    if isinstance(module, GGUFLinear):
        return (module.qtype, module.out_features, module.in_features, module.bias is not None)
    return (module.qtype, module.num_embeddings, module.embedding_dim, module.embed_scale is not None)


def _check_target(prefix: str, module: nn.Module, meta: Mapping[str, Any], where: str) -> None:
    """Raise unless ``module`` can hold (or be replaced by) the checkpoint's GGUF module."""
    ctx = _ctx(prefix, where)
    n, k = meta["out_features"], meta["in_features"]
    if meta["kind"] == "linear":
        want = (meta["qtype"], n, k, meta["bias"])
        if isinstance(module, GGUFLinear):
            if _shape_of(module) != want:
                raise CheckpointError(f"{ctx} is GGUFLinear (qtype, out, in, bias)={want} in the checkpoint but "
                                      f"{_shape_of(module)} in the model")
        elif is_convertible(module):
            if (module.out_features, module.in_features) != (n, k):
                got = f"{module.out_features}x{module.in_features}"
                raise CheckpointError(f"{ctx} is {n}x{k} in the checkpoint but {got} in the model")
            check_swap_bias(module, meta["bias"], ctx)
        else:
            # the swap rule of kbit_linear.patch.is_convertible: exact nn.Linear only
            raise CheckpointError(f"{ctx} is a {type(module).__name__} in the model, not nn.Linear or GGUFLinear "
                                  "(subclasses of nn.Linear are never swapped)")
        return
    scaled = meta["embed_scale"] is not None
    want = (meta["qtype"], n, k, scaled)
    if isinstance(module, GGUFEmbedding):
        if _shape_of(module) != want:
            raise CheckpointError(f"{ctx} is GGUFEmbedding (qtype, rows, width, scaled)={want} in the checkpoint but "
                                  f"{_shape_of(module)} in the model")
        # the model keeps its own factor (not a saved tensor): it must be the checkpoint's
        if scaled and module.embed_scale.device.type != "meta" and float(module.embed_scale) != meta["embed_scale"]:
            raise CheckpointError(f"{ctx}: embed_scale is {meta['embed_scale']!r} in the checkpoint but "
                                  f"{float(module.embed_scale)!r} in the model")
        return
    if not isinstance(module, nn.Embedding):
        raise CheckpointError(f"{ctx} is a {type(module).__name__} in the model, not nn.Embedding or GGUFEmbedding")
    if (module.num_embeddings, module.embedding_dim) != (n, k):
        got = f"{module.num_embeddings}x{module.embedding_dim}"
        raise CheckpointError(f"{ctx} is {n}x{k} in the checkpoint but {got} in the model")
    if module.max_norm is not None:
        raise CheckpointError(f"{ctx}: the model's embedding renormalizes rows (max_norm={module.max_norm}), "
                              "which a GGUFEmbedding does not")
    # A subclass is taken only as a scaled word embedding (forward = embedding * embed_scale), the
    # one GGUFEmbedding reproduces; any other subclass may do more.
    if scaled and embedding_scale(module) is None:
        raise CheckpointError(f"{ctx}: the checkpoint's embedding multiplies its output by embed_scale={meta['embed_scale']}, "
                              f"but the model's {type(module).__name__} has no embed_scale")
    if not scaled and type(module) is not nn.Embedding:
        raise CheckpointError(f"{ctx} is a {type(module).__name__} in the model (a subclass of nn.Embedding), "
                              "but the checkpoint holds a plain embedding")


def _float_dtype(module: nn.Module) -> torch.dtype | None:
    """The floating dtype a replacement of ``module`` takes for its bias / output (``None``: the default)."""
    for name in ("bias", "weight"):
        t = getattr(module, name, None)
        if isinstance(t, torch.Tensor) and t.is_floating_point():
            return t.dtype
    dtype = getattr(module, "dtype", None)  # a GGUFEmbedding's output dtype
    return dtype if isinstance(dtype, torch.dtype) else None


def _device(module: nn.Module) -> torch.device:
    """Where ``module``'s tensors live (its first one; CPU if it has none)."""
    for t in (*module.parameters(recurse=False), *module.buffers(recurse=False)):
        return t.device
    return torch.device("cpu")


def _replacement(module: nn.Module, meta: Mapping[str, Any], weight: gf.GGUFWeight) -> GGUFModule:
    """The GGUF module that stands in for ``module`` holding ``weight``'s arrays (to be filled by
    ``load_state_dict``); dtype, padding row, output factor and training mode from ``module``."""
    dtype = _float_dtype(module)
    if meta["kind"] == "linear":
        bias = None
        if meta["bias"]:
            bias = nn.Parameter(torch.zeros(meta["out_features"], dtype=dtype, device=weight.device), requires_grad=False)
        new: GGUFModule = GGUFLinear.from_weight(weight, bias=bias)
    else:
        new = GGUFEmbedding.from_weight(weight, dtype=dtype, padding_idx=module.padding_idx,
                                        embed_scale=embedding_scale(module))
    new.train(module.training)
    return new


def _tie_groups(gguf: Mapping[str, Mapping[str, Any]], tensors: Mapping[str, torch.Tensor], where: str) -> list[list[str]]:
    """The GGUF prefixes grouped by shared arrays (a tied ``lm_head`` and its embedding: one
    group; every other module alone). The checkpoint's aliases are the same tensor objects."""
    groups: dict[int, list[str]] = {}
    for prefix in sorted(gguf):
        groups.setdefault(id(tensors[f"{prefix}.qs"]), []).append(prefix)
    for group in groups.values():
        first = group[0]
        for other in group[1:]:
            keys = ("qtype", "out_features", "in_features")
            if any(gguf[other][key] != gguf[first][key] for key in keys):
                raise CheckpointError(f"{_ctx(other, where)} shares its arrays with {first!r} but its GGUF metadata differs")
            for name in GGUF_ARRAYS:
                if tensors.get(f"{other}.{name}") is not tensors.get(f"{first}.{name}"):
                    raise CheckpointError(f"{_ctx(other, where)} shares 'qs' with {first!r} but not {name!r}")
        # the embedding first: its module is the one the others are tied to
        group.sort(key=lambda p: gguf[p]["kind"] != "embedding")
    return list(groups.values())


def install_gguf_modules(
    model: nn.Module,
    gguf: Mapping[str, Mapping[str, Any]],
    tensors: Mapping[str, torch.Tensor],
    *,
    where: str = "",
) -> None:
    """Prepare ``model`` so that ``load_state_dict(tensors)`` fills its GGUF modules (``load_into``'s step).

    Every listed module must be a GGUF module of the same kind, type and shape (kept, filled in
    place), or the dense module it stands in for: an exact ``nn.Linear`` for a ``"linear"``
    entry, an ``nn.Embedding`` for an ``"embedding"`` entry (a subclass only as a scaled word
    embedding, where the checkpoint's embedding is scaled too), which is replaced by an
    all-zero GGUF module on its device, in its dtype, with its padding row and output factor.
    Every listed linear layer gets the checkpoint's ``activation_bits``.
    Modules whose arrays the checkpoint stores once (a tied ``lm_head``) are replaced by modules
    holding the same array tensors, so they stay one copy through the load (copied into in
    place, or assigned the checkpoint's one tensor).

    Args:
        model: the model, changed in place.
        gguf: prefix -> validated metadata (:func:`validate_gguf_metadata`).
        tensors: the checkpoint's tensors, aliases as the same tensor objects.
        where: the file, for messages.

    Raises:
        CheckpointError: a listed module the model lacks or that cannot take the checkpoint's.
    """
    for group in _tie_groups(gguf, tensors, where):
        modules = {}
        for prefix in group:
            try:
                modules[prefix] = model.get_submodule(prefix)
            except AttributeError:
                raise CheckpointError(f"{_ctx(prefix, where)} has no module in the model") from None
            _check_target(prefix, modules[prefix], gguf[prefix], where)
        first = modules[group[0]]
        if len(group) > 1 or not isinstance(first, (GGUFLinear, GGUFEmbedding)):  # else filled in place
            meta = gguf[group[0]]
            if isinstance(first, (GGUFLinear, GGUFEmbedding)):
                weight = first.weight_format()
            else:
                # an all-zero weight of the checkpoint's type on the dense module's device
                zero = GGUFLinear(meta["in_features"], meta["out_features"], meta["qtype"], device=_device(first))
                weight = zero.weight_format()
            for prefix in group:
                replace_module(model, prefix, _replacement(modules[prefix], gguf[prefix], weight))
        for prefix in group:
            if gguf[prefix]["kind"] == "linear":  # as saved, also where the model's layer said otherwise
                model.get_submodule(prefix).activation_bits = gguf[prefix]["activation_bits"]
    forget_tied_weights(model, {f"{prefix}.weight" for prefix in gguf})


