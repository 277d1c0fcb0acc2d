"""Quantized checkpoints in safetensors: save, load, and the checks shared with the plug-in.

On-disk format (version ``"1"``; ``"2"`` when a layer is Hadamard-rotated), one ``.safetensors`` file:

* every tensor of the model's state dict; a quantized linear ``<prefix>`` contributes
  ``<prefix>.weight`` (int32 ``[K_pad/64, N_pad/128, 128, 2, bits]``, deliberately not
  ``[out, in]``: a loader that does not know the format fails with a size mismatch),
  ``<prefix>.absmax`` (uint8 ``[K_pad/64, N_pad/128, 128, 2]``), ``<prefix>.codebook``
  (float32 ``[2**bits]``), ``<prefix>.tensor_scale`` (float32 ``[1]``) and optionally
  ``<prefix>.bias`` (the model dtype, ``[out_features]``), and for a layer quantized with the
  randomized Hadamard rotation (:mod:`kbit_linear.hadamard`) ``<prefix>.hadamard_signs`` (int8
  ``[in_features]`` of +-1; its metadata says ``"hadamard": true`` and the file's version is
  ``"2"``, so that a reader that predates the rotation refuses it instead of ignoring it);
* a GGUF module ``<prefix>`` (:class:`~kbit_linear.gguf_linear.GGUFLinear` or
  :class:`~kbit_linear.gguf_linear.GGUFEmbedding`: a llama.cpp block type kept quantized)
  contributes its arrays under their buffer names, ``<prefix>.qs``, ``<prefix>.qh``,
  ``<prefix>.scale`` and ``<prefix>.mins`` (those its type has; dtypes and shapes in
  :mod:`kbit_linear.gguf_format`), and optionally ``<prefix>.bias``. There is deliberately no
  ``<prefix>.weight``: a loader that does not know the format finds the dense ``weight``
  missing and ``qs``, ``scale``, ... unexpected, which ``load_state_dict(strict=True)`` reports
  as an error. (Storing ``qs`` as ``weight`` would be worse: a Q8_0 ``qs`` is int8
  ``[out, in]``, the dense shape, which ``load_state_dict`` silently casts into a float
  weight.) A non-strict loader (``strict=False``, or transformers' ``from_pretrained``, which
  only reports missing keys) would keep the dense weights it started with, so these files are
  read with :func:`load_into`, and the transformers plug-in's ``save_pretrained`` refuses
  models with GGUF modules;
* header metadata (all strings, as safetensors requires):

  - ``format``: ``"pt"`` (what transformers expects of a PyTorch file);
  - ``kbit_linear.version``: ``"1"`` (``"2"`` with a Hadamard-rotated layer);
  - ``kbit_linear.layers``: JSON ``{prefix: layer metadata}`` (see :func:`layer_metadata`:
    bits, true and padded shape, block size, tile config, bias flag);
  - ``kbit_linear.sha256``: JSON ``{tensor name: hex sha256 of its bytes}``;
  - ``kbit_linear.tensor_types``: JSON ``{tensor name: [dtype, shape]}`` for the same tensors
    (``dtype`` as safetensors names it, e.g. ``"BF16"``, ``shape`` a list of ints; see
    :func:`tensor_type`). The checksums cover a tensor's bytes but not the dtype and shape that
    the safetensors per-tensor header gives them: without this entry, relabelling a dense tensor
    ``F32`` -> ``I32`` or ``BF16`` -> ``F16``, or swapping a 2-D shape, would load other values
    unseen (``load_state_dict`` casts them into the parameter). Files of writers that predate
    the entry lack it and load as before, without this check; readers that predate it ignore it
    (it is additive, so the version is unchanged);
  - ``kbit_linear.experts``: JSON ``{prefix: experts metadata}`` for every MoE experts module
    stored as :class:`~kbit_linear.experts.KbitExperts` (see :func:`experts_metadata`; written
    only when there is one); its tensors are ``<prefix>.gate_up_proj`` / ``<prefix>.down_proj``
    (int32 ``[E, K_pad/64, N_pad/128, 128, 2, bits]``, again not the dense shape) with
    ``_absmax``, ``_codebook`` and ``_tensor_scale`` beside each (``kbit_linear/experts.py``);
  - ``kbit_linear.gguf``: JSON ``{prefix: GGUF metadata}`` for every GGUF module (see
    :func:`kbit_linear.serialization_gguf.gguf_metadata`: ``kind`` (``"linear"`` or
    ``"embedding"``), ``qtype``, ``out_features``, ``in_features``, ``bias``, a linear layer's
    ``activation_bits`` and an embedding's ``embed_scale``; written only when there is one, so
    other files are as before, and a reader that predates the entry fails on the unexpected
    ``qs`` tensors). A tied ``lm_head`` holding its embedding's arrays is stored once, through
    the aliases below, and :func:`load_into` ties it again (one tensor per array, shared);
  - ``kbit_linear.aliases``: JSON ``{name: stored name}`` for tensors shared in the model
    (tied weights), which are stored once;
  - ``kbit_linear.header_sha256``: hex sha256 of all the other entries (sorted compact
    JSON), so an edited header is detected like edited tensor bytes;
  - any other key: the caller's ``metadata``, returned by :func:`load_quantized`.

The header schema (these keys, the version, how they are written and parsed) lives here only:
:func:`header_metadata` writes the kbit entries and :func:`parse_header` checks and parses them,
for this single-file format and for the transformers plug-in's sharded ``save_pretrained`` files
(which carry the version, layers, sha256 and tensor_types entries in every shard's header: the
checksums of the quantized tensors only, the dtypes and shapes of every tensor, dense ones too,
which the plug-in checks with :func:`verify_stored_type` from the file's per-tensor header before
transformers loads them).

Loading checks the version, every layer's metadata, tensor names, dtypes, shapes, codebook
values, the tensor scale, that the padding is made of zero blocks, every GGUF module's metadata,
array names, dtypes and shapes and that its block scales are finite, and the checksums together
with every stored tensor's dtype and shape against ``kbit_linear.tensor_types``
(:func:`verify_sha256` and :func:`verify_tensor_type`, side by side), and raises
:class:`CheckpointError` naming the file, the layer and what is wrong. Writes go to a
temporary file in the target folder, are fsynced and renamed over the target, so an
interrupted save leaves the old file or none, never a partial one (a killed process may
leave a hidden ``.<name>.*.tmp`` file beside it; a failed save removes its own).
"""

from __future__ import annotations

import hashlib
import json
import os
import tempfile
import warnings
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Mapping, Sequence

import torch
from torch import nn

from . import format as fmt
from . import hadamard
from .experts import PROJECTIONS, TENSOR_SUFFIXES, KbitExperts, experts_layout_problem
from .fusion import KbitLinearSlice, kbit_layers
from .gguf_linear import GGUFEmbedding, GGUFLinear
from .linear import KbitLinear
from .patch import experts_placeholder, is_convertible, kbit_placeholder, replace_module

__all__ = [
    "FORMAT_VERSION",
    "HADAMARD_FORMAT_VERSION",
    "READABLE_VERSIONS",
    "stored_tensor_names",
    "LAYER_TENSORS",
    "QUANTIZED_TENSORS",
    "CheckpointError",
    "CheckpointHeader",
    "check_swap_bias",
    "QuantizedCheckpoint",
    "header_metadata",
    "parse_header",
    "layer_metadata",
    "validate_layer_metadata",
    "validate_layer_tensors",
    "experts_metadata",
    "validate_experts_metadata",
    "validate_experts_tensors",
    "tensor_sha256",
    "verify_sha256",
    "tensor_type",
    "verify_tensor_type",
    "verify_stored_type",
    "save_quantized",
    "load_quantized",
    "load_into",
]

FORMAT_VERSION = "1"
"""The on-disk format version this code writes for checkpoints without Hadamard-rotated layers
(readers of any version take them)."""
HADAMARD_FORMAT_VERSION = "2"
"""The version written when a layer is Hadamard-rotated (its ``hadamard_signs`` tensor and
``"hadamard": true`` metadata): a reader of version 1 would ignore the rotation, so it must refuse."""
READABLE_VERSIONS = (FORMAT_VERSION, HADAMARD_FORMAT_VERSION)
"""The on-disk format versions this code reads."""
LAYER_TENSORS = ("weight", "absmax", "codebook", "tensor_scale", "bias", "hadamard_signs")
"""Tensor names of one quantized linear (``bias`` and ``hadamard_signs`` optional)."""
QUANTIZED_TENSORS = LAYER_TENSORS[:4]
"""The tensors of one quantized linear that hold the format (all but the bias)."""

_KEY_VERSION = "kbit_linear.version"
_KEY_LAYERS = "kbit_linear.layers"
_KEY_SHA256 = "kbit_linear.sha256"
_KEY_TENSOR_TYPES = "kbit_linear.tensor_types"
_KEY_ALIASES = "kbit_linear.aliases"
_KEY_EXPERTS = "kbit_linear.experts"
_KEY_GGUF = "kbit_linear.gguf"
_KEY_HEADER_SHA256 = "kbit_linear.header_sha256"
_RESERVED = "kbit_linear."

PathLike = str | os.PathLike


class CheckpointError(ValueError):
    """A quantized checkpoint (file, metadata or tensors) is invalid; the message says what and where."""


@dataclass
class QuantizedCheckpoint:
    """A checkpoint read by :func:`load_quantized`.

    Attributes:
        tensors: name -> tensor, every name of the saved state dict (aliases included).
        layers: prefix -> layer metadata (see :func:`layer_metadata`), validated.
        metadata: the caller's extra header metadata given to :func:`save_quantized`.
        path: the file read.
        experts: prefix -> experts metadata (see :func:`experts_metadata`), validated.
        gguf: prefix -> GGUF module metadata (see
            :func:`kbit_linear.serialization_gguf.gguf_metadata`), validated. A tied module's
            arrays are the same tensor objects as those of the module it is tied to.
    """

    tensors: dict[str, torch.Tensor]
    layers: dict[str, dict[str, Any]]
    metadata: dict[str, str] = field(default_factory=dict)
    path: str = ""
    experts: dict[str, dict[str, Any]] = field(default_factory=dict)
    gguf: dict[str, dict[str, Any]] = field(default_factory=dict)


# ---------------------------------------------------------------------------------------
# per-layer metadata and checks (also used by the transformers plug-in)
# ---------------------------------------------------------------------------------------


def layer_metadata(layer: KbitLinear) -> dict[str, Any]:
    """The header metadata of one quantized layer.

    Args:
        layer: a :class:`KbitLinear`.

    Returns:
        ``{"bits", "in_features", "out_features", "in_features_padded",
        "out_features_padded", "block_size", "tile_k", "tile_n", "bias"}`` (ints and a bool),
        and ``"hadamard": True`` for a Hadamard-rotated layer.
    """
    if not isinstance(layer, KbitLinear):
        raise TypeError(f"layer must be a KbitLinear, got {type(layer).__name__}")
    meta = {
        "bits": layer.bits,
        "in_features": layer.in_features,
        "out_features": layer.out_features,
        **_layout_metadata(layer.out_features, layer.in_features),
        "bias": layer.bias is not None,
    }
    if layer.hadamard_signs is not None:
        meta["hadamard"] = True
    return meta


def stored_tensor_names(layer: KbitLinear) -> tuple[str, ...]:
    """The names of the tensors that hold a layer's quantized weight: :data:`QUANTIZED_TENSORS`,
    and ``hadamard_signs`` for a Hadamard-rotated layer (the bias apart)."""
    return QUANTIZED_TENSORS + (("hadamard_signs",) if layer.hadamard_signs is not None else ())


def _layout_metadata(out_features: int, in_features: int) -> dict[str, int]:
    """The entries of a layer's metadata that follow from its shape and the format's tiling."""
    n_pad, k_pad = fmt.padded_shape(out_features, in_features)
    return {
        "in_features_padded": k_pad,
        "out_features_padded": n_pad,
        "block_size": fmt.BLOCK_SIZE,
        "tile_k": fmt.TILE_K,
        "tile_n": fmt.TILE_N,
    }


def _fail(where: str, msg: str) -> CheckpointError:
    return CheckpointError(f"{where}: {msg}" if where else msg)


def validate_layer_metadata(prefix: str, meta: Mapping[str, Any], *, where: str = "") -> dict[str, Any]:
    """Check one layer's metadata and return it complete (padded shapes and tile config filled in).

    Required keys: ``bits`` (2..5), ``in_features``, ``out_features`` (positive ints).
    Optional keys, checked when present: ``in_features_padded``, ``out_features_padded``
    (must equal the shapes rounded up to 64 / 128), ``block_size`` (32), ``tile_k`` (64),
    ``tile_n`` (128), ``bias`` (bool), ``hadamard`` (bool, default false).

    Args:
        prefix: the layer's module name (for messages).
        meta: the metadata mapping (e.g. parsed from a header or a config).
        where: what is being read (a file name), prepended to messages.

    Raises:
        CheckpointError: a missing or wrong entry, named.
    """
    ctx = f"{where}: layer {prefix!r}" if where else f"layer {prefix!r}"
    if not isinstance(meta, Mapping):
        raise _fail(ctx, f"metadata must be a mapping, got {type(meta).__name__}")

    def get_int(key: str) -> int:
        if key not in meta:
            raise _fail(ctx, f"metadata lacks {key!r}")
        v = meta[key]
        if isinstance(v, bool) or not isinstance(v, int):
            raise _fail(ctx, f"metadata {key!r} must be an int, got {v!r}")
        return v

    bits = get_int("bits")
    if bits not in fmt.SUPPORTED_BITS:
        raise _fail(ctx, f"bits={bits} is not supported (supported: {fmt.SUPPORTED_BITS})")
    k, n = get_int("in_features"), get_int("out_features")
    if k <= 0 or n <= 0:
        raise _fail(ctx, f"in_features and out_features must be positive, got ({n}, {k})")
    expected = _layout_metadata(n, k)
    for key, want in expected.items():
        if key in meta and get_int(key) != want:
            raise _fail(ctx, f"metadata {key}={meta[key]} does not match this format (expected {want} for shape ({n}, {k}))")
    for key in ("bias", "hadamard"):
        flag = meta.get(key)
        if flag is not None and not isinstance(flag, bool):
            raise _fail(ctx, f"metadata {key!r} must be a bool, got {flag!r}")
    out = dict(meta)
    out.update(expected)
    out.update(bits=bits, in_features=k, out_features=n)
    return out


def validate_layer_tensors(
    prefix: str,
    tensors: Mapping[str, torch.Tensor],
    meta: Mapping[str, Any],
    *,
    where: str = "",
    check_values: bool = True,
) -> None:
    """Check the tensors of one quantized layer against its metadata.

    Checks names, dtypes and shapes of ``weight``/``absmax``/``codebook``/``tensor_scale``
    (and ``bias`` when present or required by ``meta["bias"]``), and, with ``check_values``
    (skipped for meta tensors): the codebook is finite, strictly increasing and in [-1, 1],
    the tensor scale is a positive finite power of two, and the padded rows and block columns
    are zero blocks (absmax 0, planes 0) as the format requires.

    Args:
        prefix: the layer's module name (for messages).
        tensors: short name (``"weight"``, ``"absmax"``, ``"codebook"``, ``"tensor_scale"``,
            ``"bias"``) -> tensor.
        meta: the layer's metadata (see :func:`validate_layer_metadata`).
        where: what is being read (a file name), prepended to messages.
        check_values: also check tensor contents (reads them; costs one pass over the
            padding and the small tensors).

    Raises:
        CheckpointError: the first problem found, naming the layer and the tensor.
    """
    meta = validate_layer_metadata(prefix, meta, where=where)
    ctx = f"{where}: layer {prefix!r}" if where else f"layer {prefix!r}"
    bits, k, n = meta["bits"], meta["in_features"], meta["out_features"]
    unknown = set(tensors) - set(LAYER_TENSORS)
    if unknown:
        raise _fail(ctx, f"unexpected tensors {sorted(unknown)} (a quantized layer holds {list(LAYER_TENSORS)})")
    packed_shape, absmax_shape = fmt.tiled_shapes(n, k, bits)
    want = {
        "weight": (torch.int32, packed_shape),
        "absmax": (torch.uint8, absmax_shape),
        "codebook": (torch.float32, (1 << bits,)),
        "tensor_scale": (torch.float32, (1,)),
    }
    for name, (dtype, shape) in want.items():
        t = tensors.get(name)
        if t is None:
            raise _fail(ctx, f"tensor {name!r} is missing")
        if not isinstance(t, torch.Tensor):
            raise _fail(ctx, f"{name!r} is a {type(t).__name__}, not a tensor")
        if t.dtype != dtype:
            raise _fail(ctx, f"{name!r} has dtype {t.dtype}, expected {dtype}")
        if tuple(t.shape) != shape:
            raise _fail(
                ctx, f"{name!r} has shape {tuple(t.shape)}, expected {shape} for bits={bits}, out_features={n}, in_features={k}"
            )
    signs = tensors.get("hadamard_signs")
    if meta.get("hadamard") is True and signs is None:
        raise _fail(ctx, "tensor 'hadamard_signs' is missing (the metadata says the layer is Hadamard-rotated)")
    if meta.get("hadamard") is not True and signs is not None:
        raise _fail(ctx, "has a 'hadamard_signs' tensor but the metadata does not say the layer is Hadamard-rotated")
    if signs is not None:
        try:
            hadamard.check_signs(signs, k, "'hadamard_signs'", values=check_values)
        except (TypeError, ValueError) as e:
            raise _fail(ctx, str(e)) from None
    bias = tensors.get("bias")
    if meta.get("bias") is True and bias is None:
        raise _fail(ctx, "tensor 'bias' is missing (the metadata says the layer has a bias)")
    if meta.get("bias") is False and bias is not None:
        raise _fail(ctx, "has a 'bias' tensor but the metadata says it has none")
    if bias is not None:
        if not isinstance(bias, torch.Tensor) or not bias.is_floating_point():
            raise _fail(ctx, f"'bias' must be a floating-point tensor, got {getattr(bias, 'dtype', type(bias).__name__)}")
        if tuple(bias.shape) != (n,):
            raise _fail(ctx, f"'bias' has shape {tuple(bias.shape)}, expected ({n},)")
    if not check_values or any(tensors[name].device.type == "meta" for name in want):
        return

    try:
        fmt.validate_codebook(tensors["codebook"], bits)
    except (TypeError, ValueError) as e:
        raise _fail(ctx, f"invalid codebook: {e}") from None
    ts = tensors["tensor_scale"]
    if not fmt.is_power_of_two(ts):
        raise _fail(ctx, f"tensor_scale must be a positive finite power of two, got {ts.item()!r}")
    _check_padding(ctx, tensors["weight"], tensors["absmax"], n, k)


def _check_padding(ctx: str, packed: torch.Tensor, absmax: torch.Tensor, n: int, k: int) -> None:
    """Padded rows (n >= N) and padded block columns (j >= ceil(K/32)) must be zero blocks."""
    nt = packed.shape[1]
    valid_rows = n - fmt.TILE_N * (nt - 1)  # rows of the last n-tile that hold real outputs
    nblk = -(-k // fmt.BLOCK_SIZE)
    checks = []
    if valid_rows < fmt.TILE_N:
        checks.append((f"rows {n}..{nt * fmt.TILE_N - 1}", packed[:, nt - 1, valid_rows:], absmax[:, nt - 1, valid_rows:]))
    if nblk % 2:  # the last 64-wide k-tile holds one real block and one padded block
        checks.append((f"block column {nblk}", packed[-1, :, :, 1], absmax[-1, :, :, 1]))
    for what, p, a in checks:
        if bool(a.any()):
            raise _fail(ctx, f"absmax is not zero in the padding ({what}): the tensors are corrupted or not in the tiled layout")
        if bool(p.any()):
            raise _fail(ctx, f"weight planes are not zero in the padding ({what}): the tensors are corrupted or not in the tiled layout")


# ---------------------------------------------------------------------------------------
# experts modules (MoE): metadata and checks, per expert through the layer checks above
# ---------------------------------------------------------------------------------------


def _projection_shapes(hidden_dim: int, intermediate_dim: int) -> dict[str, tuple[int, int]]:
    """``(out_features, in_features)`` of one expert's matrix of each projection."""
    return {"gate_up_proj": (2 * intermediate_dim, hidden_dim), "down_proj": (hidden_dim, intermediate_dim)}


def experts_metadata(module: KbitExperts) -> dict[str, Any]:
    """The header metadata of one :class:`~kbit_linear.experts.KbitExperts` module.

    Returns:
        ``{"bits", "num_experts", "hidden_dim", "intermediate_dim", "projections"}``, where
        ``projections`` maps ``gate_up_proj`` / ``down_proj`` to one expert's matrix as
        :func:`layer_metadata` describes a layer (shape, padded shape, block and tile sizes).
    """
    if not isinstance(module, KbitExperts):
        raise TypeError(f"module must be a KbitExperts, got {type(module).__name__}")
    return {
        "bits": module.bits,
        "num_experts": module.num_experts,
        "hidden_dim": module.hidden_dim,
        "intermediate_dim": module.intermediate_dim,
        "projections": _projections_metadata(module.bits, module.hidden_dim, module.intermediate_dim),
    }


def _projections_metadata(bits: int, hidden_dim: int, intermediate_dim: int) -> dict[str, dict[str, Any]]:
    return {
        proj: {"bits": bits, "out_features": n, "in_features": k, **_layout_metadata(n, k), "bias": False}
        for proj, (n, k) in _projection_shapes(hidden_dim, intermediate_dim).items()
    }


def validate_experts_metadata(prefix: str, meta: Mapping[str, Any], *, where: str = "") -> dict[str, Any]:
    """Check one experts module's metadata and return it complete (``projections`` filled in).

    Required keys: ``bits`` (2..5), ``num_experts``, ``hidden_dim``, ``intermediate_dim``
    (positive ints); ``projections``, when present, must be what these imply.

    Raises:
        CheckpointError: a missing or wrong entry, named.
    """
    ctx = f"{where}: experts {prefix!r}" if where else f"experts {prefix!r}"
    if not isinstance(meta, Mapping):
        raise _fail(ctx, f"metadata must be a mapping, got {type(meta).__name__}")
    values = {}
    for key in ("bits", "num_experts", "hidden_dim", "intermediate_dim"):
        v = meta.get(key)
        if isinstance(v, bool) or not isinstance(v, int) or v <= 0:
            raise _fail(ctx, f"metadata {key!r} must be a positive int, got {v!r}")
        values[key] = v
    if values["bits"] not in fmt.SUPPORTED_BITS:
        raise _fail(ctx, f"bits={values['bits']} is not supported (supported: {fmt.SUPPORTED_BITS})")
    expected = _projections_metadata(values["bits"], values["hidden_dim"], values["intermediate_dim"])
    if "projections" in meta and meta["projections"] != expected:
        raise _fail(ctx, f"metadata 'projections' {meta['projections']!r} does not match this format (expected {expected!r})")
    return {**dict(meta), **values, "projections": expected}


def validate_experts_tensors(
    prefix: str,
    tensors: Mapping[str, torch.Tensor],
    meta: Mapping[str, Any],
    *,
    where: str = "",
    check_values: bool = True,
) -> None:
    """Check the tensors of one experts module against its metadata.

    Names, dtypes and stacked shapes of every projection's four tensors (``gate_up_proj``,
    ``gate_up_proj_absmax``, ``gate_up_proj_codebook``, ``gate_up_proj_tensor_scale``, and the
    same for ``down_proj``); then each expert's slice goes through :func:`validate_layer_tensors`
    as one layer (codebook, power-of-two tensor scale, zero padding), with ``check_values``.

    Args:
        prefix: the module's name (for messages).
        tensors: attribute name (``"gate_up_proj"``, ``"gate_up_proj_absmax"``, ...) -> tensor.
        meta: the module's metadata (see :func:`validate_experts_metadata`).
        where: what is being read (a file name), prepended to messages.
        check_values: also check tensor contents.

    Raises:
        CheckpointError: the first problem found, naming the module, the tensor and the expert.
    """
    meta = validate_experts_metadata(prefix, meta, where=where)
    ctx = f"{where}: experts {prefix!r}" if where else f"experts {prefix!r}"
    names = {proj + suffix: (proj, field) for proj in PROJECTIONS for field, suffix in TENSOR_SUFFIXES.items()}
    unknown = set(tensors) - set(names)
    if unknown:
        raise _fail(ctx, f"unexpected tensors {sorted(unknown)} (a kbit experts module holds {sorted(names)})")
    bits, e = meta["bits"], meta["num_experts"]
    for proj, layer in meta["projections"].items():
        packed_shape, absmax_shape = fmt.tiled_shapes(layer["out_features"], layer["in_features"], bits)
        want = {
            "packed": (torch.int32, (e, *packed_shape)),
            "absmax": (torch.uint8, (e, *absmax_shape)),
            "codebook": (torch.float32, (1 << bits,)),
            "tensor_scale": (torch.float32, (e,)),
        }
        for field, (dtype, shape) in want.items():
            name = proj + TENSOR_SUFFIXES[field]
            t = tensors.get(name)
            if t is None:
                raise _fail(ctx, f"tensor {name!r} is missing")
            if not isinstance(t, torch.Tensor):
                raise _fail(ctx, f"{name!r} is a {type(t).__name__}, not a tensor")
            if t.dtype != dtype or tuple(t.shape) != shape:
                raise _fail(ctx, f"{name!r} is {t.dtype} {list(t.shape)}, expected {dtype} {list(shape)} for {_experts_summary(meta)}")
        stacked = {field: tensors[proj + suffix] for field, suffix in TENSOR_SUFFIXES.items()}
        if not check_values or any(t.device.type == "meta" for t in stacked.values()):
            continue
        for i in range(e):
            one = {"weight": stacked["packed"][i], "absmax": stacked["absmax"][i], "codebook": stacked["codebook"],
                   "tensor_scale": stacked["tensor_scale"][i : i + 1]}
            validate_layer_tensors(f"{prefix}.{proj}[expert {i}]", one, layer, where=where)


def _experts_summary(meta: Mapping[str, Any]) -> str:
    """``bits=.., experts=.., hidden_dim=.., intermediate_dim=..`` of experts metadata, for messages."""
    return f"bits={meta['bits']}, experts={meta['num_experts']}, hidden_dim={meta['hidden_dim']}, intermediate_dim={meta['intermediate_dim']}"


def _experts_tensors(state: Mapping[str, torch.Tensor], prefix: str) -> dict[str, torch.Tensor]:
    """attribute name -> tensor of the experts module at ``prefix``, from a flat state dict."""
    names = (proj + suffix for proj in PROJECTIONS for suffix in TENSOR_SUFFIXES.values())
    return {n: state[f"{prefix}.{n}"] for n in names if f"{prefix}.{n}" in state}


# ---------------------------------------------------------------------------------------
# save
# ---------------------------------------------------------------------------------------


def tensor_sha256(t: torch.Tensor) -> str:
    """Hex sha256 of a tensor's bytes as safetensors stores them (contiguous, little-endian).

    Args:
        t: any tensor with data (not meta); copied to CPU if needed.

    Returns:
        64 hex digits.
    """
    b = t.detach().cpu().contiguous().reshape(-1).view(torch.uint8).numpy()
    return hashlib.sha256(memoryview(b)).hexdigest()


_sha256 = tensor_sha256


def verify_sha256(name: str, tensor: torch.Tensor, sums: Mapping[str, str], *, where: str = "") -> None:
    """Check ``tensor`` against its entry in a header's ``{name: sha256}`` table.

    Raises:
        CheckpointError: no entry for ``name``, or the bytes do not hash to it.
    """
    want = sums.get(name)
    if want is None:
        raise _fail(where, f"tensor {name!r} has no checksum in the checkpoint header")
    if _sha256(tensor) != want:
        raise _fail(where, f"tensor {name!r} fails its sha256 check: the checkpoint is corrupted or was modified")


# torch dtype -> the name safetensors gives it in a file's per-tensor header
_DTYPE_NAMES: dict[torch.dtype, str] = {
    torch.float64: "F64",
    torch.float32: "F32",
    torch.float16: "F16",
    torch.bfloat16: "BF16",
    torch.int64: "I64",
    torch.int32: "I32",
    torch.int16: "I16",
    torch.int8: "I8",
    torch.uint64: "U64",
    torch.uint32: "U32",
    torch.uint16: "U16",
    torch.uint8: "U8",
    torch.bool: "BOOL",
    torch.float8_e4m3fn: "F8_E4M3",
    torch.float8_e4m3fnuz: "F8_E4M3FNUZ",
    torch.float8_e5m2: "F8_E5M2",
    torch.float8_e5m2fnuz: "F8_E5M2FNUZ",
    torch.complex64: "C64",
}


def tensor_type(t: torch.Tensor) -> tuple[str, tuple[int, ...]]:
    """A tensor's entry in a header's ``kbit_linear.tensor_types`` table: ``(dtype, shape)``.

    Args:
        t: any tensor (meta tensors too: only its dtype and shape are read).

    Returns:
        The dtype as safetensors names it (``"F32"``, ``"BF16"``, ``"I32"``, ...; a dtype
        safetensors has no name for is given as torch writes it) and the shape.
    """
    return _DTYPE_NAMES.get(t.dtype, str(t.dtype)), tuple(t.shape)


def verify_tensor_type(
    name: str,
    tensor: torch.Tensor,
    types: Mapping[str, tuple[str, tuple[int, ...]]],
    *,
    where: str = "",
) -> None:
    """Check ``tensor``'s dtype and shape against its entry in a header's ``kbit_linear.tensor_types``
    table (as :func:`parse_header` returns it), the part of a stored tensor its checksum does not cover.

    Raises:
        CheckpointError: no entry for ``name``, or another dtype or shape than the entry.
    """
    verify_stored_type(name, *tensor_type(tensor), types, where=where)


def verify_stored_type(
    name: str,
    dtype: str,
    shape: Sequence[int],
    types: Mapping[str, tuple[str, tuple[int, ...]]],
    *,
    where: str = "",
) -> None:
    """:func:`verify_tensor_type` for a tensor not yet read: its ``dtype`` (as safetensors names it)
    and ``shape`` as a file's per-tensor header gives them (``safe_open(...).get_slice(name)``),
    so a loader can check them before any data is read.

    Raises:
        CheckpointError: no entry for ``name``, or another dtype or shape than the entry.
    """
    want = types.get(name)
    if want is None:
        raise _fail(where, f"tensor {name!r} has no dtype and shape in the checkpoint header")
    got = (dtype, tuple(shape))
    if got != (want[0], tuple(want[1])):
        raise _fail(where, f"tensor {name!r} is {got[0]} {list(got[1])} in the file but {want[0]} {list(want[1])} in the "
                           "checkpoint header: the checkpoint is corrupted or its safetensors header was modified")


def _header_digest(header: Mapping[str, str]) -> str:
    """sha256 of every header entry except the digest itself, as sorted compact JSON."""
    body = {k: v for k, v in header.items() if k != _KEY_HEADER_SHA256}
    return hashlib.sha256(json.dumps(body, sort_keys=True, separators=(",", ":")).encode()).hexdigest()


def _layer_tensors(state: Mapping[str, torch.Tensor], prefix: str) -> dict[str, torch.Tensor]:
    return {s: state[f"{prefix}.{s}"] for s in LAYER_TENSORS if f"{prefix}.{s}" in state}


def _stray_packed(state: Mapping[str, torch.Tensor], layers: Mapping[str, Any], experts: Mapping[str, Any] | None = None) -> list[str]:
    """Tensors that look like tiled planes (``*.weight`` int32 5-D, or an experts projection
    int32 6-D) but belong to no listed layer or experts module."""
    out = []
    for name, t in state.items():
        prefix, _, last = name.rpartition(".")
        if last == "weight" and t.dtype == torch.int32 and t.dim() == 5 and prefix not in layers:
            out.append(name)
        elif last in PROJECTIONS and t.dtype == torch.int32 and t.dim() == 6 and prefix not in (experts or {}):
            out.append(name)
    return out


def _check_gguf_listing(
    where: str,
    state: Mapping[str, torch.Tensor],
    layers: Mapping[str, Any],
    experts: Mapping[str, Any],
    gguf: Mapping[str, Mapping[str, Any]],
    hint: str,
) -> None:
    """Check every GGUF module's tensors, that no prefix is both a GGUF module and a kbit layer
    or experts module, and that no GGUF arrays are left unlisted."""
    from . import serialization_gguf as sg  # imported here: it takes CheckpointError from this module

    both = sorted(set(gguf) & (set(layers) | set(experts)))
    if both:
        raise _fail(where, f"{both} are listed both as GGUF modules and as kbit layers or experts")
    for prefix, meta in gguf.items():
        sg.validate_gguf_tensors(prefix, sg.gguf_tensors(state, prefix), meta, where=where)
    stray = sg.stray_gguf_arrays(state, gguf)
    if stray:
        raise _fail(where, f"tensors {stray} look like the arrays of GGUF modules but have no GGUF metadata ({hint})")


def _dedupe(state: dict[str, torch.Tensor]) -> tuple[dict[str, torch.Tensor], dict[str, str]]:
    """Store tensors shared in memory once: ``(unique tensors, {alias: stored name})``.

    Identical views (tied weights) become aliases; other overlapping views are copied, since
    safetensors refuses shared storage.
    """
    groups: dict[tuple, list[str]] = {}
    for name in sorted(state):
        t = state[name]
        if t.numel() == 0:
            continue
        groups.setdefault((t.device, t.untyped_storage().data_ptr()), []).append(name)
    out = dict(state)
    aliases: dict[str, str] = {}
    for names in groups.values():
        first = state[names[0]]
        for other in names[1:]:
            t = state[other]
            if t.data_ptr() == first.data_ptr() and t.shape == first.shape and t.stride() == first.stride() and t.dtype == first.dtype:
                aliases[other] = names[0]
                del out[other]
            else:
                out[other] = t.clone()
    return out, aliases


def _check_user_metadata(metadata: Mapping[str, str] | None) -> dict[str, str]:
    if metadata is None:
        return {}
    if not isinstance(metadata, Mapping):
        raise TypeError(f"metadata must be a mapping of str to str, got {type(metadata).__name__}")
    for key, value in metadata.items():
        if not isinstance(key, str) or not isinstance(value, str):
            raise TypeError(f"metadata keys and values must be str, got {key!r}: {value!r}")
        if key.startswith(_RESERVED) or key == "format":
            raise ValueError(f"metadata key {key!r} is reserved (keys starting with {_RESERVED!r} and 'format')")
    return dict(metadata)


def _write_atomic(tensors: dict[str, torch.Tensor], path: Path, header: dict[str, str]) -> None:
    """Write to a temp file beside ``path``, fsync, rename over ``path``, fsync the folder."""
    from safetensors.torch import save_file

    folder = path.parent
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=folder)
    os.close(fd)
    try:
        save_file(tensors, tmp, metadata=header)
        with open(tmp, "rb+") as f:
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        try:
            os.unlink(tmp)
        except FileNotFoundError:
            pass
        raise
    if hasattr(os, "O_DIRECTORY"):  # make the rename itself durable (POSIX)
        dfd = os.open(folder, os.O_RDONLY | os.O_DIRECTORY)
        try:
            os.fsync(dfd)
        finally:
            os.close(dfd)


def save_quantized(
    model_or_state_dict: nn.Module | Mapping[str, torch.Tensor],
    path: PathLike,
    metadata: Mapping[str, str] | None = None,
    *,
    layers: Mapping[str, Mapping[str, Any]] | None = None,
    experts: Mapping[str, Mapping[str, Any]] | None = None,
    gguf: Mapping[str, Mapping[str, Any]] | None = None,
) -> Path:
    """Save a quantized model (or state dict) to one safetensors file, atomically.

    Args:
        model_or_state_dict: a module containing :class:`KbitLinear` layers,
            :class:`~kbit_linear.experts.KbitExperts` modules and GGUF modules
            (:class:`~kbit_linear.gguf_linear.GGUFLinear`,
            :class:`~kbit_linear.gguf_linear.GGUFEmbedding`; their metadata is taken from the
            modules), or a state dict, in which case ``layers``, ``experts`` and ``gguf`` must
            describe every quantized layer, experts module and GGUF module in it.
        path: the ``.safetensors`` file to write; its folder must exist. An existing file
            is replaced only once the new one is completely written.
        metadata: extra header entries, str -> str (keys starting with ``kbit_linear.`` and
            ``format`` are reserved).
        layers: with a state dict: prefix -> ``{"bits", "in_features", "out_features"}``
            (as :func:`layer_metadata` returns). Not allowed with a module.
        experts: with a state dict: prefix -> experts metadata (as :func:`experts_metadata`
            returns). Not allowed with a module.
        gguf: with a state dict: prefix -> GGUF module metadata (as
            :func:`kbit_linear.serialization_gguf.gguf_metadata` returns). Not allowed with a
            module.

    Returns:
        The path written.

    Raises:
        TypeError / ValueError: bad arguments, tensors on the meta device.
        CheckpointError: the quantized tensors do not match their metadata.
    """
    from . import serialization_gguf as sg  # imported here: it takes CheckpointError from this module

    if isinstance(model_or_state_dict, nn.Module):
        if layers is not None or experts is not None or gguf is not None:
            raise TypeError("layers=, experts= and gguf= are only for a state dict; a module's KbitLinear, KbitExperts "
                            "and GGUF modules describe themselves")
        state = dict(model_or_state_dict.state_dict())
        modules = list(model_or_state_dict.named_modules(remove_duplicate=False))
        layer_meta = {name: layer_metadata(m) for name, m in kbit_layers(model_or_state_dict, remove_duplicate=False)}
        experts_meta = {name: experts_metadata(m) for name, m in modules if isinstance(m, KbitExperts)}
        gguf_meta = {name: sg.gguf_metadata(m) for name, m in modules if isinstance(m, (GGUFLinear, GGUFEmbedding))}
    elif isinstance(model_or_state_dict, Mapping):
        state = dict(model_or_state_dict)
        bad = [k for k, v in state.items() if not isinstance(k, str) or not isinstance(v, torch.Tensor)]
        if bad:
            raise TypeError(f"a state dict to save maps names (str) to tensors; these entries do not: {bad[:5]!r}")
        layer_meta, experts_meta, gguf_meta = {}, {}, {}
        if layers is not None:
            if not isinstance(layers, Mapping):
                raise TypeError(f"layers must be a mapping prefix -> metadata, got {type(layers).__name__}")
            layer_meta = {p: validate_layer_metadata(p, m) for p, m in layers.items()}
        if experts is not None:
            if not isinstance(experts, Mapping):
                raise TypeError(f"experts must be a mapping prefix -> metadata, got {type(experts).__name__}")
            experts_meta = {p: validate_experts_metadata(p, m) for p, m in experts.items()}
        if gguf is not None:
            if not isinstance(gguf, Mapping):
                raise TypeError(f"gguf must be a mapping prefix -> metadata, got {type(gguf).__name__}")
            gguf_meta = {p: sg.validate_gguf_metadata(p, m) for p, m in gguf.items()}
    else:
        raise TypeError(f"model_or_state_dict must be an nn.Module or a state dict, got {type(model_or_state_dict).__name__}")
    if not isinstance(path, (str, os.PathLike)):
        raise TypeError(f"path must be a str or os.PathLike, got {type(path).__name__}")
    path = Path(path)
    if path.is_dir():
        raise IsADirectoryError(f"path {str(path)!r} is a folder; give a file name such as model.safetensors")
    if not path.parent.is_dir():
        raise FileNotFoundError(f"folder {str(path.parent)!r} of path does not exist")
    user = _check_user_metadata(metadata)

    for name, t in state.items():
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"state dict entry {name!r} is a {type(t).__name__}, not a tensor")
        if t.device.type == "meta":
            raise ValueError(f"tensor {name!r} is on the meta device (no data to save); load or quantize the model first")
    for prefix, meta in layer_meta.items():
        validate_layer_tensors(prefix, _layer_tensors(state, prefix), meta)
    for prefix, meta in experts_meta.items():
        validate_experts_tensors(prefix, _experts_tensors(state, prefix), meta)
    stray = _stray_packed(state, layer_meta, experts_meta)
    if stray:
        raise CheckpointError(f"tensors {stray} look like quantized planes but have no layer metadata (pass layers=... / experts=...)")
    _check_gguf_listing("", state, layer_meta, experts_meta, gguf_meta, "pass gguf=...")

    tensors, aliases = _dedupe(state)
    tensors = {name: t.detach().cpu().contiguous() for name, t in tensors.items()}
    header = {
        "format": "pt",
        **header_metadata(layer_meta, {name: _sha256(t) for name, t in tensors.items()}, experts_meta, gguf_meta,
                          tensor_types={name: tensor_type(t) for name, t in tensors.items()}),
        **user,
    }
    if aliases:
        header[_KEY_ALIASES] = json.dumps(aliases, sort_keys=True)
    header[_KEY_HEADER_SHA256] = _header_digest(header)
    _write_atomic(tensors, path, header)
    return path


# ---------------------------------------------------------------------------------------
# load
# ---------------------------------------------------------------------------------------


def _parse_json(where: str, key: str, text: str | None, default: Any) -> Any:
    if text is None:
        if default is None:
            raise CheckpointError(f"{where}: header lacks {key!r}")
        return default
    try:
        value = json.loads(text)
    except json.JSONDecodeError as e:
        raise CheckpointError(f"{where}: header entry {key!r} is not valid JSON ({e})") from None
    if not isinstance(value, dict):
        raise CheckpointError(f"{where}: header entry {key!r} must be a JSON object, got {type(value).__name__}")
    return value


def _parse_tensor_types(where: str, text: str | None) -> dict[str, tuple[str, tuple[int, ...]]] | None:
    """The ``kbit_linear.tensor_types`` entry as ``{name: (dtype, shape)}``, or ``None`` when the
    header has none (written before the entry existed)."""
    if text is None:
        return None
    out = {}
    for name, entry in _parse_json(where, _KEY_TENSOR_TYPES, text, None).items():
        ok = (isinstance(entry, list) and len(entry) == 2 and isinstance(entry[0], str) and isinstance(entry[1], list)
              and all(isinstance(d, int) and not isinstance(d, bool) and d >= 0 for d in entry[1]))
        if not ok:
            raise CheckpointError(f"{where}: header entry {_KEY_TENSOR_TYPES!r} has {json.dumps(entry)} for tensor {name!r}, "
                                  "expected [dtype, shape] (a string and a list of non-negative ints)")
        out[name] = (entry[0], tuple(entry[1]))
    return out


@dataclass
class CheckpointHeader:
    """The kbit entries of one safetensors header, parsed by :func:`parse_header`.

    Attributes:
        layers: prefix -> layer metadata as stored (check each with :func:`validate_layer_metadata`).
        sha256: tensor name -> hex sha256 of its bytes.
        aliases: name -> stored name, for tensors stored once (single-file format; else empty).
        experts: prefix -> experts metadata as stored (check each with :func:`validate_experts_metadata`).
        gguf: prefix -> GGUF module metadata as stored (check each with
            :func:`kbit_linear.serialization_gguf.validate_gguf_metadata`).
        tensor_types: tensor name -> ``(dtype, shape)`` (check each tensor with
            :func:`verify_tensor_type`); ``None`` for a file written before the entry existed,
            whose dtypes and shapes then have no record to be checked against.
    """

    layers: dict[str, Any]
    sha256: dict[str, str]
    aliases: dict[str, str] = field(default_factory=dict)
    experts: dict[str, Any] = field(default_factory=dict)
    gguf: dict[str, Any] = field(default_factory=dict)
    tensor_types: dict[str, tuple[str, tuple[int, ...]]] | None = None


def header_metadata(
    layers: Mapping[str, Mapping[str, Any]],
    sha256: Mapping[str, str],
    experts: Mapping[str, Mapping[str, Any]] | None = None,
    gguf: Mapping[str, Mapping[str, Any]] | None = None,
    *,
    tensor_types: Mapping[str, tuple[str, tuple[int, ...]]] | None = None,
) -> dict[str, str]:
    """The kbit entries of a safetensors header: format version, layer metadata, checksums,
    dtypes and shapes.

    Args:
        layers: prefix -> layer metadata (as :func:`layer_metadata` returns).
        sha256: tensor name -> hex sha256 (:func:`tensor_sha256`).
        experts: prefix -> experts metadata (as :func:`experts_metadata` returns); the entry is
            written only when there is one.
        gguf: prefix -> GGUF module metadata (as
            :func:`kbit_linear.serialization_gguf.gguf_metadata` returns); the entry is written
            only when there is one.
        tensor_types: tensor name -> ``(dtype, shape)`` (:func:`tensor_type`), for the tensors
            that ``sha256`` lists; the entry is written when given (every writer gives it).

    Returns:
        str -> str entries, as safetensors requires; the caller adds ``format`` and any others.
    """
    rotated = any(m.get("hadamard") is True for m in layers.values())
    header = {
        _KEY_VERSION: HADAMARD_FORMAT_VERSION if rotated else FORMAT_VERSION,
        _KEY_LAYERS: json.dumps(layers, sort_keys=True),
        _KEY_SHA256: json.dumps(dict(sha256), sort_keys=True),
    }
    if tensor_types is not None:
        header[_KEY_TENSOR_TYPES] = json.dumps({name: [dtype, list(shape)] for name, (dtype, shape) in tensor_types.items()},
                                               sort_keys=True)
    if experts:
        header[_KEY_EXPERTS] = json.dumps(experts, sort_keys=True)
    if gguf:
        header[_KEY_GGUF] = json.dumps(gguf, sort_keys=True)
    return header


def parse_header(header: Mapping[str, str], where: str, *, verify_digest: bool = False) -> CheckpointHeader:
    """Check the format version of a safetensors header and parse its kbit entries.

    Args:
        header: the file's metadata (``safe_open(...).metadata()``).
        where: the file, for messages.
        verify_digest: also check ``kbit_linear.header_sha256`` (written by
            :func:`save_quantized`), so an edited header is detected.

    Raises:
        CheckpointError: no version (not written by kbit_linear), an unknown version, a failed
            header digest, or a missing or malformed layers / sha256 / aliases / experts / gguf entry,
            or a malformed tensor_types entry (which may be absent: files of older writers).
    """
    version = header.get(_KEY_VERSION)
    if version is None:
        raise CheckpointError(
            f"{where}: not a kbit_linear checkpoint: the safetensors header has no {_KEY_VERSION!r} (not written by kbit_linear)"
        )
    if version not in READABLE_VERSIONS:
        raise CheckpointError(
            f"{where}: format version {version!r} is not supported (this version of kbit_linear reads {list(READABLE_VERSIONS)})"
        )
    if verify_digest and header.get(_KEY_HEADER_SHA256) != _header_digest(header):
        raise CheckpointError(f"{where}: the header metadata fails its sha256 check: the file is corrupted or was modified")
    parsed = CheckpointHeader(
        layers=_parse_json(where, _KEY_LAYERS, header.get(_KEY_LAYERS), None),
        sha256=_parse_json(where, _KEY_SHA256, header.get(_KEY_SHA256), None),
        aliases=_parse_json(where, _KEY_ALIASES, header.get(_KEY_ALIASES), {}),
        experts=_parse_json(where, _KEY_EXPERTS, header.get(_KEY_EXPERTS), {}),
        gguf=_parse_json(where, _KEY_GGUF, header.get(_KEY_GGUF), {}),
        tensor_types=_parse_tensor_types(where, header.get(_KEY_TENSOR_TYPES)),
    )
    if version == FORMAT_VERSION and isinstance(parsed.layers, Mapping) and any(
            isinstance(m, Mapping) and m.get("hadamard") is True for m in parsed.layers.values()):
        raise CheckpointError(f"{where}: a version {FORMAT_VERSION!r} file cannot hold Hadamard-rotated layers "
                              f"(they need version {HADAMARD_FORMAT_VERSION!r}): the header was modified")
    return parsed


def load_quantized(
    path: PathLike,
    *,
    device: torch.device | str = "cpu",
    verify_checksums: bool = True,
) -> QuantizedCheckpoint:
    """Read and validate a checkpoint written by :func:`save_quantized`.

    Args:
        path: the ``.safetensors`` file.
        device: where the returned tensors go (read and checked on CPU first).
        verify_checksums: check the header's own sha256 and compare every tensor's sha256,
            dtype and shape with the header (one pass over the data, about 1 GB/s; turn off for
            trusted files when load time matters; the structural checks always run). A file
            written before the ``kbit_linear.tensor_types`` entry existed has no dtypes and shapes
            to compare: its dense tensors' dtypes and shapes are then taken as the file says.

    Returns:
        A :class:`QuantizedCheckpoint`.

    Raises:
        FileNotFoundError: no such file.
        CheckpointError: not readable as safetensors (truncated, damaged header), not a
            kbit_linear checkpoint, unknown version, missing/extra tensors, wrong dtypes,
            shapes or values, checksum mismatch, a dtype or shape other than the header records.
            The message names the file and the tensor.
    """
    from safetensors import safe_open

    if not isinstance(path, (str, os.PathLike)):
        raise TypeError(f"path must be a str or os.PathLike, got {type(path).__name__}")
    where = str(path)
    if not os.path.isfile(path):
        raise FileNotFoundError(f"no checkpoint file at {where!r}")
    tensors: dict[str, torch.Tensor] = {}
    try:
        with safe_open(where, framework="pt", device="cpu") as f:
            header = dict(f.metadata() or {})
            # the header is checked before any tensor is read
            parsed = parse_header(header, where, verify_digest=verify_checksums)
            for name in f.keys():
                tensors[name] = f.get_tensor(name)
    except CheckpointError:
        raise
    except Exception as e:  # safetensors raises its own error types for damaged files
        raise CheckpointError(f"{where}: cannot read the file as safetensors (truncated or damaged?): {e}") from e
    layers_raw, sums, aliases = parsed.layers, parsed.sha256, parsed.aliases

    missing = sorted(set(sums) - set(tensors))
    if missing:
        raise CheckpointError(f"{where}: tensors listed in the header are missing from the file: {missing}")
    extra = sorted(set(tensors) - set(sums))
    if extra:
        raise CheckpointError(f"{where}: tensors not listed in the header (file modified?): {extra}")
    if verify_checksums:
        for name, t in tensors.items():
            verify_sha256(name, t, sums, where=where)
            if parsed.tensor_types is not None:  # (absent from the files of older writers)
                verify_tensor_type(name, t, parsed.tensor_types, where=where)
    for alias, stored in aliases.items():
        if not isinstance(alias, str) or not isinstance(stored, str) or stored not in tensors:
            raise CheckpointError(f"{where}: alias {alias!r} refers to {stored!r}, which is not in the file")
        if alias in tensors:
            raise CheckpointError(f"{where}: alias {alias!r} is also stored as a tensor")
        tensors[alias] = tensors[stored]

    layers: dict[str, dict[str, Any]] = {}
    for prefix, meta in layers_raw.items():
        layers[prefix] = validate_layer_metadata(prefix, meta, where=where)
        validate_layer_tensors(prefix, _layer_tensors(tensors, prefix), layers[prefix], where=where)
    experts: dict[str, dict[str, Any]] = {}
    for prefix, meta in parsed.experts.items():
        experts[prefix] = validate_experts_metadata(prefix, meta, where=where)
        validate_experts_tensors(prefix, _experts_tensors(tensors, prefix), experts[prefix], where=where)
    stray = _stray_packed(tensors, layers, experts)
    if stray:
        raise CheckpointError(f"{where}: tensors {stray} look like quantized planes but no layer metadata lists them")
    from . import serialization_gguf as sg  # imported here: it takes CheckpointError from this module

    gguf = {prefix: sg.validate_gguf_metadata(prefix, meta, where=where) for prefix, meta in parsed.gguf.items()}
    _check_gguf_listing(where, tensors, layers, experts, gguf, f"the header's {_KEY_GGUF!r} does not list them")

    if torch.device(device) != torch.device("cpu"):
        tensors = {name: t.to(device) for name, t in tensors.items()}
        for alias, stored in aliases.items():  # keep aliases shared after the move
            tensors[alias] = tensors[stored]
    user = {k: v for k, v in header.items() if not k.startswith(_RESERVED) and k != "format"}
    return QuantizedCheckpoint(tensors=tensors, layers=layers, metadata=user, path=where, experts=experts, gguf=gguf)


def check_swap_bias(module: nn.Module, has_bias: bool, ctx: str) -> None:
    """Raise unless the dense ``module`` a load swaps for a quantized layer has a bias exactly when
    the checkpoint's layer does (the swap would add or drop it unseen). ``ctx`` starts the message."""
    if (module.bias is not None) != has_bias:
        raise CheckpointError(f"{ctx} has {'a' if has_bias else 'no'} bias in the checkpoint but "
                              f"{'one' if module.bias is not None else 'none'} in the model")


def load_into(
    model: nn.Module,
    path: PathLike,
    *,
    strict: bool = True,
    device: torch.device | str | None = None,
    verify_checksums: bool = True,
) -> nn.Module:
    """Load a checkpoint of :func:`save_quantized` into ``model``, without re-quantizing.

    ``model`` may be the dense model (e.g. freshly built from its config, also on the meta
    device): every ``nn.Linear`` that the checkpoint holds quantized is first replaced by a
    :class:`KbitLinear` of the checkpoint's bits and shape, and every experts module it holds
    quantized by a :class:`~kbit_linear.experts.KbitExperts`, and every ``nn.Linear`` /
    ``nn.Embedding`` it holds as a GGUF module by a :class:`~kbit_linear.gguf_linear.GGUFLinear` /
    :class:`~kbit_linear.gguf_linear.GGUFEmbedding` (taking the embedding's dtype, padding row
    and, for a scaled word embedding, its ``embed_scale``;
    :func:`kbit_linear.serialization_gguf.install_gguf_modules`); existing ``KbitLinear``
    layers, ``KbitExperts`` and GGUF modules must match. GGUF modules that the checkpoint stores
    once (a tied ``lm_head``) share one tensor per array again after the load, and transformers'
    tie tables are told to leave them alone (``model.tie_weights()`` keeps working). Then the
    state dict is loaded: copied into existing tensors (keeping the model's devices and dtypes),
    or, where the model is on the meta device, assigned (on ``device``, default CPU). Weights
    tied in the model stay tied. A meta model's non-persistent buffers (not part of any state
    dict, e.g. rotary ``inv_freq``) stay on meta, with a warning.

    Args:
        model: the model to fill, changed in place.
        path: the ``.safetensors`` file.
        strict: require the checkpoint's keys to match the model's state dict exactly.
        device: where assigned tensors go when the model is on the meta device.
        verify_checksums: see :func:`load_quantized`.

    Returns:
        ``model``.

    Raises:
        CheckpointError: invalid file, or a layer/key that does not match the model.
    """
    fmt.check_module(model, "model")
    ckpt = load_quantized(path, device=device or "cpu", verify_checksums=verify_checksums)
    where = ckpt.path
    for prefix, meta in ckpt.layers.items():
        try:
            module = model.get_submodule(prefix)
        except AttributeError:
            raise CheckpointError(f"{where}: layer {prefix!r} has no module in the model") from None
        bits, k, n, has_bias = meta["bits"], meta["in_features"], meta["out_features"], f"{prefix}.bias" in ckpt.tensors
        rotated = meta.get("hadamard") is True
        if isinstance(module, (KbitLinear, KbitLinearSlice)):
            got = (module.bits, module.in_features, module.out_features, module.bias is not None, module.hadamard_signs is not None)
            if got != (bits, k, n, has_bias, rotated):
                raise CheckpointError(
                    f"{where}: layer {prefix!r} is (bits, in, out, bias, hadamard)={(bits, k, n, has_bias, rotated)} in the "
                    f"checkpoint but {got} in the model"
                )
        elif is_convertible(module):
            if (module.in_features, module.out_features) != (k, n):
                raise CheckpointError(
                    f"{where}: layer {prefix!r} is {n}x{k} in the checkpoint but {module.out_features}x{module.in_features} in the model"
                )
            check_swap_bias(module, has_bias, f"{where}: layer {prefix!r}")
            replace_module(model, prefix, kbit_placeholder(module, bits, bias=has_bias, hadamard=rotated))
        else:
            # the swap rule of kbit_linear.patch.is_convertible: exact nn.Linear only
            raise CheckpointError(
                f"{where}: layer {prefix!r} is a {type(module).__name__} in the model, not nn.Linear or KbitLinear "
                "(subclasses of nn.Linear are never swapped)"
            )
        del module
    for prefix, meta in ckpt.experts.items():
        try:
            module = model.get_submodule(prefix)
        except AttributeError:
            raise CheckpointError(f"{where}: experts {prefix!r} have no module in the model") from None
        want = (meta["bits"], meta["num_experts"], meta["hidden_dim"], meta["intermediate_dim"])
        if isinstance(module, KbitExperts):
            got = (module.bits, module.num_experts, module.hidden_dim, module.intermediate_dim)
            if got != want:
                raise CheckpointError(
                    f"{where}: experts {prefix!r} are (bits, experts, hidden, intermediate)={want} in the checkpoint but {got} in the model"
                )
        elif (problem := experts_layout_problem(module)) is None:
            e, two_i, h = module.gate_up_proj.shape
            if (e, h, two_i // 2) != want[1:]:
                raise CheckpointError(
                    f"{where}: experts {prefix!r} are (experts, hidden, intermediate)={want[1:]} in the checkpoint but {(e, h, two_i // 2)} in the model"
                )
            replace_module(model, prefix, experts_placeholder(module, meta["bits"]))
        else:
            raise CheckpointError(f"{where}: experts {prefix!r} cannot be loaded into this model's {type(module).__name__}: {problem}")
        del module
    if ckpt.gguf:
        from . import serialization_gguf as sg  # imported here: it takes CheckpointError from this module

        sg.install_gguf_modules(model, ckpt.gguf, ckpt.tensors, where=where)

    # Remember which names share one Parameter: assign=True would untie them.
    shared: dict[int, list[str]] = {}
    for name, p in model.named_parameters(remove_duplicate=False):
        shared.setdefault(id(p), []).append(name)
    for names in shared.values():  # tied in the model: the checkpoint must hold one value for them
        stored = [ckpt.tensors[n] for n in names if n in ckpt.tensors]
        if any(t is not stored[0] and (t.shape != stored[0].shape or t.dtype != stored[0].dtype or not torch.equal(t, stored[0]))
               for t in stored[1:]):
            raise CheckpointError(f"{where}: the model ties {names} (one parameter) but the checkpoint holds different "
                                  "tensors for them (saved from a model that does not tie them?)")
    assign = any(t.device.type == "meta" for t in (*model.parameters(), *model.buffers()))
    try:
        model.load_state_dict(ckpt.tensors, strict=strict, assign=assign)
    except RuntimeError as e:
        raise CheckpointError(f"{where}: does not match the model: {e}") from e
    if assign:
        for names in shared.values():
            if len(names) > 1:
                keep = model.get_parameter(names[0])
                for other in names[1:]:
                    parent_name, _, child = other.rpartition(".")
                    setattr(model.get_submodule(parent_name) if parent_name else model, child, keep)
        left = [n for n, t in (*model.named_parameters(), *model.named_buffers()) if t.device.type == "meta"]
        if left:
            # e.g. non-persistent buffers (rotary inv_freq): not in any state dict, so the
            # caller must create them (transformers' from_pretrained does).
            warnings.warn(f"load_into: {len(left)} tensors are still on the meta device (not in the checkpoint): {left[:8]}", stacklevel=2)
    return model
