"""The Hugging Face transformers plug-in: ``KbitConfig`` and its ``HfQuantizer``.

Usage (``import kbit_linear`` registers the plug-in)::

    model = AutoModelForCausalLM.from_pretrained(path, quantization_config=KbitConfig(bits=4),
                                                 dtype=torch.bfloat16, device_map="cuda")
    model.save_pretrained("out/")                         # quantized checkpoint
    model = AutoModelForCausalLM.from_pretrained("out/")  # loads it, no re-quantization

How it plugs into the transformers 5.x loader:

* quantize at load (``from_pretrained(dense, quantization_config=KbitConfig(...))``): before the
  weights load, the layers to convert are chosen by :func:`kbit_linear.patch.convertible_layers`
  (the swap rule every swap in kbit_linear uses) and stay the model's own dense ``nn.Linear``
  on the meta device, so every transformers 5.x loader materializes the checkpoint weight as
  the dense ``[out, in]`` tensor it is, in the load dtype. As each weight arrives,
  :class:`KbitQuantize` quantizes it on its target device with
  :func:`kbit_linear.quantizer.quantize_weight`, swaps a meta
  :class:`~kbit_linear.KbitLinear` in for the layer (the bias moves over) and hands the loader
  the packed ``weight``, ``absmax``, ``codebook`` and ``tensor_scale`` to set on it. No dense
  tensor is ever set on a ``KbitLinear``. Only one dense weight exists at a time (with
  ``fuse``: the weights of the groups waiting for a sibling, usually one group), so the live
  tensors stay near the quantized model plus one dense layer (on CPU the process may still
  hold freed temporaries in its allocator).
* save: the quantized tensors are the layers' state dict (``weight`` is the tiled int32
  planes, a shape no dense loader accepts); ``config.json`` gets ``quantization_config`` and
  every safetensors header gets the format version, the per-layer metadata, a sha256 of every
  quantized tensor and the dtype and shape of every tensor the files hold, dense ones too
  (``save_pretrained`` gives every shard one header, so each lists the tensors of all shards).
  A model holding GGUF modules
  (:class:`~kbit_linear.GGUFLinear`, :class:`~kbit_linear.GGUFEmbedding`) is refused with a
  ``ValueError``: ``from_pretrained`` would find no ``weight`` for those layers and initialize
  them at random (it only reports missing keys); :func:`kbit_linear.save_quantized` and
  :func:`kbit_linear.load_into` carry them, and a ``save_quantized`` file with GGUF modules is
  refused by ``from_pretrained`` the same way.
* reload (``config.json`` has ``quant_method: "kbit"``): the layers become meta ``KbitLinear``
  placeholders and the tensors load as they are; the headers are checked before loading
  (version, layer shapes, tensor names, dtypes and shapes, through
  :func:`kbit_linear.serialization.parse_header`; every tensor of each file, dense ones too,
  against its header's dtypes and shapes, through
  :func:`kbit_linear.serialization.verify_stored_type`: transformers loads the dense tensors
  itself and would cast a relabelled one, ``F32`` -> ``I32``, into its parameter unseen) and the
  loaded quantized tensors after (values, padding, checksums, dtypes and shapes against the
  header's record), so a damaged or edited checkpoint raises :class:`CheckpointError` instead of
  producing a model that runs on garbage. The dense tensors have no checksum: checking one would
  read the data a second time.

``lm_head``, tied embeddings and the model's ``_keep_in_fp32_modules`` always stay dense
(transformers' default skips are kept when the user passes a skip list).

Mixture-of-experts models: the experts modules :func:`kbit_linear.patch.convertible_experts`
accepts become :class:`~kbit_linear.experts.KbitExperts` the same way. transformers merges the
checkpoint's per-expert matrices into ``gate_up_proj`` ``[E, 2I, H]`` and ``down_proj``
``[E, H, I]`` first; :class:`KbitQuantize` receives each merged projection, swaps a meta
``KbitExperts`` in at the first one and quantizes expert by expert. Saved, the experts keep
their quantized names and layout (the per-expert split that ``save_pretrained`` applies to dense
experts would cut the packed planes apart, so it is not applied to them), and every header lists
them under ``kbit_linear.experts``.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from .. import format as fmt
from .. import weight_layout
from ..allocation import check_codebook_for_widths, check_target_bpw, plan_layer_bits
from ..codebooks import DEFAULT as DEFAULT_CODEBOOK
from ..codebooks import check_codebook_option, is_per_weight, resolve_default
from ..experts import PROJECTIONS, TENSOR_SUFFIXES, KbitExperts, experts_layout_problem, quantize_experts_weight
from ..fusion import fuse_projections, kbit_layers
from ..router import fuse_routers
from ..gguf_linear import GGUFEmbedding, GGUFLinear
from ..hadamard import layer_seed
from ..linear import KbitLinear
from ..patch import (
    check_skip_rules,
    convertible_experts,
    convertible_layers,
    dequantize_model,
    experts_placeholder,
    is_convertible,
    kbit_placeholder,
    replace_module,
    shared_quantization,
    sibling_groups,
    warn_unmatched_skip_rules,
)
from ..quantizer import check_hadamard_search, group_quantization, hadamard_signs_for, quantize_weight
from ..serialization import (
    FORMAT_VERSION,
    HADAMARD_FORMAT_VERSION,
    QUANTIZED_TENSORS,
    READABLE_VERSIONS,
    CheckpointError,
    experts_metadata,
    header_metadata,
    layer_metadata,
    parse_header,
    stored_tensor_names,
    tensor_sha256,
    tensor_type,
    validate_experts_metadata,
    validate_experts_tensors,
    validate_layer_metadata,
    validate_layer_tensors,
    verify_sha256,
    verify_stored_type,
    verify_tensor_type,
)

try:
    from transformers.core_model_loading import ConversionOps
    from transformers.quantizers.base import HfQuantizer
    from transformers.utils.quantization_config import QuantizationConfigMixin
except ImportError as e:  # pragma: no cover - depends on the installed transformers
    raise ImportError(
        "the kbit_linear transformers plug-in needs transformers >= 5.0 with the "
        f"core_model_loading API ({e}); upgrade with: pip install -U 'transformers>=5'"
    ) from e

__all__ = ["QUANT_METHOD", "KbitConfig", "KbitHfQuantizer", "KbitQuantize", "register"]

QUANT_METHOD = "kbit"
"""The ``quant_method`` written to ``config.json``."""

# attribute names of a KbitExperts's quantized tensors
_EXPERTS_TENSORS = tuple(proj + suffix for proj in PROJECTIONS for suffix in TENSOR_SUFFIXES.values())


# ---------------------------------------------------------------------------------------
# the config
# ---------------------------------------------------------------------------------------


class KbitConfig(QuantizationConfigMixin):
    """Quantization config for ``from_pretrained``: K-bit codebook weights for every ``nn.Linear``.

    Serialized into ``config.json`` as ``quantization_config`` (``quant_method: "kbit"``), with
    the codebook as a list of floats.

    Args:
        bits: index width, 2..5.
        skip_modules: module names to keep dense, in addition to transformers' default skips
            (``lm_head``, tied embeddings) and the model's ``_keep_in_fp32_modules``. Matching
            rules of :func:`kbit_linear.patch.matches_skip`: exact name, ancestor prefix
            (``"model.layers.0"``), trailing path (``"o_proj"``), or a regex as ``"re:..."``.
        codebook: ``2**bits`` strictly increasing floats in [-1, 1] (list or tensor);
            ``None``: the normal-float codebook; ``"fitted"``: levels fitted to each weight
            (:mod:`kbit_linear.codebooks`, data-free; each layer stores its own);
            ``"nf-zero"`` / ``"fitted-zero"``: those levels with a zero among them. Default
            ``"default"``: per layer width, :data:`kbit_linear.codebooks.DEFAULT_BY_WIDTH`
            (fitted at 2 and 5 bits, ``"nf-zero"`` at 3, ``"fitted-zero"`` at 4), or the
            normal-float levels with ``hadamard`` (:func:`kbit_linear.codebooks.default_codebook`);
            the config stores ``"default"`` as given (each layer stores its levels), and a
            stored ``null`` means normal-float, as it did before.
        scale_search: choose each block's scale for the least error instead of rounding its
            absmax up when quantizing at load (better at 2 and 3 bits, slower to load); a
            quantize-time choice: checkpoints store the chosen scales in the same format.
        hadamard: quantize each weight rotated by a randomized Hadamard transform along
            in_features (:mod:`kbit_linear.hadamard`; the layers rotate their inputs to match):
            much better at 2 and 3 bits. Checkpoints store each layer's sign vector and use
            format version ``"2"``.
        format_version: the checkpoint format version (written by this code; read back from
            ``config.json``; default: ``"2"`` with ``hadamard``, else ``"1"``).
        target_bpw: choose each layer's width from 2..5 for a mean of at most this many index
            bits per weight (:mod:`kbit_linear.allocation`, data-free). Quantizing at load, the
            weights then load dense first (the model's dense size in memory), the widths are
            chosen from all of them, then each layer is quantized; the choice is written to
            ``layer_bits``. ``bits`` still applies to experts modules. Not with a codebook
            list (``"fitted"`` is fine). Every chosen layer must be in memory when the widths
            are chosen: a ``device_map`` that offloads layers to the CPU is refused then.
        layer_bits: module name -> width, for the layers that do not have ``bits``: what
            ``target_bpw`` chose, saved in ``config.json`` so that the checkpoint loads back.
        hadamard_search: with ``hadamard``, sign vectors tried per layer when quantizing at
            load; the one whose rotated weight quantizes with the least error is kept (and
            stored: loading a saved checkpoint does not repeat the search). Default 1.
        fuse: after loading, run each group of sibling projections that read one input (q/k/v,
            gate/up, DeepSeek's q_a_proj/kv_a_proj_with_mqa; not in cross-attention) as one GEMM (:func:`kbit_linear.fusion.fuse_projections`; the model's
            ``kbit_fusion`` attribute says what was fused and why a group was not). Only groups
            whose layers share their levels, tensor scale and rotation fuse: quantizing at load,
            the layers of a group are quantized together for that (one set of levels, fitted to
            the group where levels are fitted, and the largest of their tensor scales).
            Checkpoints keep one entry per layer; ``config.json`` keeps the choice, and a saved
            model loads fused again (``kbit_linear.unfuse_projections(model)`` undoes it, and
            ``kbit_linear.fuse_projections(model)`` fuses any loaded model). The top-k routers
            of MoE blocks then run as one kernel each (:func:`kbit_linear.fuse_routers`; the
            ``kbit_router_fusion`` attribute lists them). Default ``False``.

    Raises:
        TypeError / ValueError: a bad argument, named.
    """

    def __init__(
        self,
        bits: int = 4,
        skip_modules: list[str] | tuple[str, ...] | None = None,
        codebook: list[float] | torch.Tensor | str | None = DEFAULT_CODEBOOK,
        scale_search: bool = False,
        hadamard: bool = False,
        format_version: str | None = None,
        target_bpw: float | None = None,
        layer_bits: dict[str, int] | None = None,
        hadamard_search: int = 1,
        fuse: bool = False,
        **kwargs: Any,
    ) -> None:
        method = kwargs.pop("quant_method", QUANT_METHOD)
        if method != QUANT_METHOD:
            raise ValueError(f"quant_method must be {QUANT_METHOD!r} for KbitConfig, got {method!r}")
        if kwargs:
            raise TypeError(f"KbitConfig got unexpected arguments {sorted(kwargs)}")
        self.quant_method = QUANT_METHOD
        self.bits = fmt.check_bits(bits)
        self.skip_modules = _check_skip_modules(skip_modules)
        self.scale_search = fmt.check_bool("scale_search", scale_search)
        self.hadamard = fmt.check_bool("hadamard", hadamard)
        self.fuse = fmt.check_bool("fuse", fuse)
        # stored resolved: config.json names what was used
        self.codebook = _check_codebook(resolve_default(codebook, hadamard), bits)
        if format_version is None:
            format_version = HADAMARD_FORMAT_VERSION if hadamard else FORMAT_VERSION
        if not isinstance(format_version, str):
            raise TypeError(f"format_version must be a str, got {type(format_version).__name__}")
        if format_version not in READABLE_VERSIONS:
            raise ValueError(
                f"this checkpoint uses kbit_linear format version {format_version!r}; this version of "
                f"kbit_linear reads {list(READABLE_VERSIONS)} (upgrade kbit_linear)"
            )
        if hadamard and format_version == FORMAT_VERSION:
            raise ValueError(f"hadamard=True needs format_version {HADAMARD_FORMAT_VERSION!r}, got {format_version!r}")
        self.format_version = format_version
        self.hadamard_search = check_hadamard_search(hadamard_search, hadamard=self.hadamard, fuse=self.fuse)
        self.target_bpw = None if target_bpw is None else check_target_bpw(target_bpw)
        if self.target_bpw is not None:
            check_codebook_for_widths(self.codebook)
        self.layer_bits = _check_layer_bits(layer_bits)
        fixed = not is_per_weight(self.codebook)
        if self.layer_bits and fixed and any(b != self.bits for b in self.layer_bits.values()):
            raise ValueError(f"layer_bits has widths other than bits={self.bits}, which a {self.bits}-bit codebook cannot serve")

    def to_dict(self) -> dict[str, Any]:
        """The config as ``config.json`` stores it; ``target_bpw``, ``layer_bits`` and
        ``hadamard_search`` only when set, so that a config without them reads the same as
        before they existed."""
        out = super().to_dict()
        for key in ("target_bpw", "layer_bits"):
            if out.get(key) is None:
                out.pop(key, None)
        if out.get("hadamard_search") == 1:
            out.pop("hadamard_search", None)
        if not out.get("fuse"):
            out.pop("fuse", None)
        return out

    def bits_of(self, name: str) -> int:
        """The width of the layer called ``name``: its ``layer_bits`` entry, else ``bits``."""
        return self.layer_bits.get(name, self.bits) if self.layer_bits else self.bits

    def codebook_tensor(self) -> torch.Tensor | str | None:
        """The codebook as the quantizers take it: float32 ``[2**bits]`` (CPU), ``None`` for the
        normal-float levels, or one of the option strings (``"default"``, ``"fitted"``, ...)."""
        if is_per_weight(self.codebook):
            return self.codebook
        return torch.tensor(self.codebook, dtype=torch.float32)


def _check_skip_modules(skip: Any) -> list[str] | None:
    if skip is None:
        return None
    if isinstance(skip, str):
        skip = [skip]
    # a list of strings: the config is stored as JSON (no compiled regexes)
    if not isinstance(skip, (list, tuple)):
        raise TypeError(f"skip_modules must be a list of module names, got {type(skip).__name__}")
    if not all(isinstance(rule, str) for rule in skip):
        raise TypeError(f"skip_modules entries must be non-empty strings, got {list(skip)!r}")
    return list(check_skip_rules(skip, name="skip_modules"))


def _check_layer_bits(layer_bits: Any) -> dict[str, int] | None:
    if layer_bits is None:
        return None
    if not isinstance(layer_bits, dict):
        raise TypeError(f"layer_bits must be a dict of module name -> bits, got {type(layer_bits).__name__}")
    for name, bits in layer_bits.items():
        if not isinstance(name, str) or not name:
            raise TypeError(f"layer_bits keys must be module names, got {name!r}")
        fmt.check_bits(bits, f"layer_bits[{name!r}]")
    return dict(layer_bits)


def _check_codebook(codebook: Any, bits: int) -> list[float] | str | None:
    if codebook is None or isinstance(codebook, str):
        return check_codebook_option(codebook, bits)  # None, an option string, or a ValueError naming what it takes
    if isinstance(codebook, (list, tuple)):
        if not all(isinstance(v, (int, float)) and not isinstance(v, bool) for v in codebook):
            raise TypeError("codebook must be a list of floats")
        codebook = torch.tensor(codebook, dtype=torch.float64)
    if not isinstance(codebook, torch.Tensor):
        raise TypeError(f"codebook must be a list of floats or a tensor, got {type(codebook).__name__}")
    cb = fmt.validate_codebook(codebook, bits)
    return [float(v) for v in cb.tolist()]


# ---------------------------------------------------------------------------------------
# the conversion op: quantize each weight as it arrives
# ---------------------------------------------------------------------------------------


class KbitQuantize(ConversionOps):
    """Loader op: dense ``<layer>.weight`` -> the layer's ``weight``/``absmax``/``codebook``/``tensor_scale``.

    Quantizes with :func:`kbit_linear.quantizer.quantize_weight` on the tensor's device (the
    device the layer is loaded to), swaps a meta :class:`KbitLinear` in for the dense layer and
    returns the four tensors for the loader to set on it. A merged experts projection
    ``<experts>.gate_up_proj`` / ``.down_proj`` ``[E, N, K]`` becomes that projection's four
    stacked tensors (:func:`kbit_linear.experts.quantize_experts_weight`) on a meta
    :class:`~kbit_linear.experts.KbitExperts`, swapped in at the module's first projection.
    """

    def __init__(self, hf_quantizer: "KbitHfQuantizer") -> None:
        self.hf_quantizer = hf_quantizer

    @torch.no_grad()
    def convert(self, input_dict: dict[str, Any], model: nn.Module | None = None, **kwargs: Any) -> dict[str, torch.Tensor]:
        """Quantize every ``name -> tensor`` (or ``name -> [tensor]``) entry of ``input_dict``."""
        if model is None:
            raise ValueError("KbitQuantize needs the model being loaded (model=...)")
        hfq = self.hf_quantizer
        out: dict[str, torch.Tensor] = {}
        for key, value in input_dict.items():
            tensor = value[0] if isinstance(value, (list, tuple)) else value
            prefix, _, name = key.rpartition(".")
            if name in hfq.pending_experts.get(prefix, ()):
                del value
                out.update(self._convert_experts(model, prefix, name, tensor))
                continue
            if name != "weight" or prefix not in hfq.pending:
                raise ValueError(f"{key}: only the weight of a layer chosen for quantization can be quantized at load")
            linear = model.get_submodule(prefix)
            if tuple(tensor.shape) != (linear.out_features, linear.in_features):
                raise ValueError(
                    f"{key}: the checkpoint weight has shape {tuple(tensor.shape)}, expected "
                    f"[{linear.out_features}, {linear.in_features}] (is this checkpoint already quantized?)"
                )
            del linear
            group = hfq.group_of.get(prefix)
            if group is None:
                out.update(self._quantize_layer(model, prefix, tensor, hfq.codebook, layer_seed(prefix)))
                del tensor, value
                continue
            # levels and tensor scale shared by the group: wait for every sibling (the loader's order is its own)
            hfq.stash[prefix] = tensor
            del tensor, value
            if any(n not in hfq.stash for n in group):
                continue
            weights = [hfq.stash.pop(n) for n in group]
            out.update(self._quantize_group(model, group, weights))
        return out

    def _quantize_group(self, model: nn.Module, group: tuple[str, ...], weights: list[torch.Tensor]) -> dict[str, torch.Tensor]:
        """The layers of ``group`` from their dense ``weights``, with one set of levels fitted to
        all of them and the group's first layer's rotation seed."""
        hfq = self.hf_quantizer
        config = hfq.quantization_config
        bits, seed = config.bits_of(group[0]), layer_seed(group[0])
        signs = hadamard_signs_for(weights[0], bits, seed=seed) if config.hadamard else None
        try:
            shared = group_quantization(weights, bits, hfq.codebook, scale_search=config.scale_search, hadamard_signs=signs)
        except (TypeError, ValueError) as e:
            raise ValueError(f"cannot fit the levels of {', '.join(group)}: {e}") from e
        out: dict[str, torch.Tensor] = {}
        for prefix, w in zip(group, weights):
            out.update(self._quantize_layer(model, prefix, w, shared.codebook, seed, shared.tensor_scale))
        return out

    def _quantize_layer(self, model: nn.Module, prefix: str, tensor: torch.Tensor, codebook: torch.Tensor | str | None,
                        seed: int, tensor_scale: torch.Tensor | None = None) -> dict[str, torch.Tensor]:
        """One dense layer's weight -> its kbit tensors, named for the loader; a meta
        :class:`KbitLinear` takes the dense layer's place. ``tensor_scale``: a group's shared one."""
        hfq = self.hf_quantizer
        config = hfq.quantization_config
        key = f"{prefix}.weight"
        linear = model.get_submodule(prefix)
        bits = config.bits_of(prefix)
        rotated = config.hadamard
        try:
            signs = hadamard_signs_for(tensor, bits, codebook, scale_search=config.scale_search, seed=seed,
                                       candidates=config.hadamard_search, name=key) if rotated else None
            q = quantize_weight(tensor, bits, codebook, scale_search=config.scale_search, hadamard_signs=signs,
                                tensor_scale=tensor_scale, name=key)
        except (TypeError, ValueError) as e:
            raise ValueError(f"cannot quantize {key} ({linear.out_features}x{linear.in_features}): {e}") from e
        layer = kbit_placeholder(linear, bits, bias=False, device="meta", hadamard=rotated)
        layer.bias = linear.bias  # loaded already, or still meta and set on the new layer later
        replace_module(model, prefix, layer)
        hfq.pending.discard(prefix)
        out = {f"{prefix}.{t}": v for t, v in zip(QUANTIZED_TENSORS, q)}
        if signs is not None:
            out[f"{prefix}.hadamard_signs"] = signs
        return out

    def _convert_experts(self, model: nn.Module, prefix: str, proj: str, tensor: torch.Tensor) -> dict[str, torch.Tensor]:
        """One merged experts projection -> its stacked kbit tensors, named for the loader."""
        hfq = self.hf_quantizer
        bits = hfq.quantization_config.bits
        module = model.get_submodule(prefix)
        if not isinstance(module, KbitExperts):  # the module's first projection to arrive
            module = experts_placeholder(module, bits, device="meta")
            replace_module(model, prefix, module)
        key = f"{prefix}.{proj}"
        want = (module.num_experts, *module.projection_shape(proj))
        if tuple(tensor.shape) != want:
            raise ValueError(f"{key}: the checkpoint tensor has shape {tuple(tensor.shape)}, expected {list(want)} (is this checkpoint already quantized?)")
        try:
            q = quantize_experts_weight(tensor, bits, hfq.codebook, scale_search=hfq.quantization_config.scale_search, name=key)
        except (TypeError, ValueError) as e:
            raise ValueError(f"cannot quantize {key} {list(want)}: {e}") from e
        hfq.pending_experts[prefix].discard(proj)
        if not hfq.pending_experts[prefix]:
            del hfq.pending_experts[prefix]
        return {f"{key}{suffix}": getattr(q, field) for field, suffix in TENSOR_SUFFIXES.items()}


# ---------------------------------------------------------------------------------------
# the quantizer
# ---------------------------------------------------------------------------------------


def _check_header_tensor(shapes: dict[str, tuple[str, tuple[int, ...]]], key: str, expected: torch.Tensor,
                         what: str, where: str) -> None:
    """A quantized tensor named in a checkpoint header: present, with ``expected``'s dtype and
    shape (``what`` names the module it belongs to in the message). ``shapes`` holds the files'
    per-tensor headers: dtypes as safetensors names them, compared through :func:`tensor_type`."""
    if key not in shapes:
        raise CheckpointError(f"{where}: tensor {key!r} is missing from the checkpoint")
    dtype, shape = shapes[key]
    want_dtype, want_shape = tensor_type(expected)
    if dtype != want_dtype or shape != want_shape:
        raise CheckpointError(
            f"{where}: tensor {key!r} is {dtype} {list(shape)} in the checkpoint, expected "
            f"{want_dtype} {list(want_shape)} for {what}"
        )


def _refuse_stray(listed: Any, kept: Any, kind: str, where: str) -> None:
    """Refuse a checkpoint whose header lists quantized ``kind`` (layers, experts) that the model keeps dense."""
    stray = sorted(set(listed) - set(kept))
    if stray:
        raise CheckpointError(
            f"{where}: the checkpoint holds quantized {kind} that this model keeps dense: {stray[:5]}"
            + (" ..." if len(stray) > 5 else "")
            + " (were different skip_modules used when saving?)"
        )


class KbitHfQuantizer(HfQuantizer):
    """``HfQuantizer`` for :class:`KbitConfig` (transformers 5.x loader API)."""

    requires_calibration = False
    quantization_config: KbitConfig

    def __init__(self, quantization_config: KbitConfig, **kwargs: Any) -> None:
        super().__init__(quantization_config, **kwargs)
        self.codebook = quantization_config.codebook_tensor()
        self.modules_to_not_convert: list[str] = []
        # quantize at load: names of the dense layers still waiting for their weight
        self.pending: set[str] = set()
        # ... or, with target_bpw, the layers loaded dense and quantized once all are read
        self.deferred: list[str] = []
        # ... and experts module name -> its projections still waiting
        self.pending_experts: dict[str, set[str]] = {}
        # sha256 of every quantized tensor, from the headers of a pre-quantized checkpoint
        self._header_sha256: dict[str, str] = {}
        # ... their dtypes and shapes (None: headers written before that entry existed), and the
        # checkpoint's name for messages
        self._header_types: dict[str, tuple[str, tuple[int, ...]]] | None = None
        self._header_where = ""
        self._headers_read = False  # the checkpoint files' headers were checked: every stored tensor needs its checksum
        # with fuse: layer -> its group of sibling projections (quantized with one set of levels
        # and one rotation), and the dense weights of groups still waiting for a sibling
        self.group_of: dict[str, tuple[str, ...]] = {}
        self.stash: dict[str, torch.Tensor] = {}

    # --- environment and placement -----------------------------------------------------

    def validate_environment(self, *args: Any, **kwargs: Any) -> None:
        device_map = kwargs.get("device_map")
        if isinstance(device_map, dict) and "disk" in device_map.values():
            raise ValueError("kbit quantized models cannot be offloaded to disk; use a device_map without 'disk'")

    def param_element_size(self, model: nn.Module, param_name: str, param: torch.Tensor) -> float:
        """Bytes per element that ``device_map="auto"`` should plan for."""
        if self.param_needs_quantization(model, param_name):
            # planes + one E4M4 byte per 32 weights, per element of the dense [out, in] placeholder
            return (self.quantization_config.bits_of(param_name.rpartition(".")[0]) + 8 / fmt.BLOCK_SIZE) / 8
        return param.element_size()

    # --- before loading: placeholders ----------------------------------------------------

    def param_needs_quantization(self, model: nn.Module, param_name: str, **kwargs: Any) -> bool:
        """True for the dense ``weight`` of a layer, or a projection of an experts module, still
        waiting to be quantized at load."""
        prefix, _, name = param_name.rpartition(".")
        if self.pre_quantized:
            return False
        needs = (name == "weight" and prefix in self.pending) or name in self.pending_experts.get(prefix, ())
        if needs and _is_dtensor(model.get_parameter(param_name)):
            _refuse_tensor_parallel(param_name)
        return needs

    def get_quantize_ops(self) -> KbitQuantize:
        """The op that quantizes each dense weight as the loader reads it."""
        return KbitQuantize(self)

    def _process_model_before_weight_loading(self, model: nn.Module, **kwargs: Any) -> nn.Module:
        """Choose the layers to quantize; for a pre-quantized checkpoint, swap in meta ``KbitLinear`` placeholders.

        Quantizing at load, the chosen layers stay dense (meta) until :class:`KbitQuantize`
        swaps each one as its weight arrives.
        """
        config = self.quantization_config
        self.modules_to_not_convert = self.get_modules_to_not_convert(
            model, config.skip_modules, getattr(model, "_keep_in_fp32_modules", None), add_default_skips=True
        )
        rules = [rule for rule in self.modules_to_not_convert if rule]
        warn_unmatched_skip_rules(model, config.skip_modules or (), "skip_modules")  # (transformers' own skips may not apply)
        names, _ = convertible_layers(model, rules)
        experts, _ = convertible_experts(model, rules)
        # a layer reused under several names is swapped once, under the name transformers loads
        unique = {name for name, _ in model.named_modules()}
        names = [name for name in names if name in unique]
        experts = [name for name in experts if name in unique]
        stray = sorted(set(config.layer_bits or ()) - set(names))
        if stray:
            raise ValueError(f"layer_bits names layers this model does not quantize: {stray[:5]}" + (" ..." if len(stray) > 5 else ""))
        if not self.pre_quantized:
            if config.fuse:
                self.group_of = sibling_groups(names, config.layer_bits or {}, config.bits, model)
            if config.target_bpw is not None and not config.layer_bits:
                self.deferred = list(names)  # the widths depend on every weight: quantize after loading
                self.group_of = {}  # grouped after the widths are chosen
            else:
                self.pending = set(names)
            self.pending_experts = {name: set(PROJECTIONS) for name in experts}
            return model
        for name in names:
            replace_module(model, name, kbit_placeholder(model.get_submodule(name), config.bits_of(name), device="meta",
                                                         hadamard=config.hadamard))
        for name in experts:
            replace_module(model, name, experts_placeholder(model.get_submodule(name), config.bits, device="meta"))
        self._check_headers(model, kwargs.get("checkpoint_files"))
        return model

    def _check_headers(self, model: nn.Module, checkpoint_files: Any) -> None:
        """Check the safetensors headers of a pre-quantized checkpoint against the placeholders."""
        if not checkpoint_files:
            return
        from safetensors import safe_open

        layers: dict[str, dict[str, Any]] = {}
        experts: dict[str, dict[str, Any]] = {}
        sums: dict[str, str] = {}
        types: dict[str, tuple[str, tuple[int, ...]]] | None = None
        shapes: dict[str, tuple[str, tuple[int, ...]]] = {}  # every file's per-tensor header: dtype name, shape
        recorded: list[tuple[str, dict[str, Any], dict[str, Any]]] = []  # (file, its tensors' dtypes and shapes, its record)
        for path in checkpoint_files:
            path = str(path)
            if not path.endswith(".safetensors"):
                raise CheckpointError(f"{path}: kbit checkpoints are safetensors files; cannot read this file")
            stored: dict[str, tuple[str, tuple[int, ...]]] = {}  # this file's per-tensor header: raw dtype, shape
            try:
                with safe_open(path, framework="pt") as f:
                    header = dict(f.metadata() or {})
                    for key in f.keys():
                        sl = f.get_slice(key)
                        stored[key] = (sl.get_dtype(), tuple(sl.get_shape()))
            except Exception as e:  # safetensors raises its own types for damaged files
                raise CheckpointError(f"{path}: cannot read the file as safetensors (truncated or damaged?): {e}") from e
            parsed = parse_header(header, path)
            if parsed.gguf:
                raise CheckpointError(f"{path}: holds GGUF modules ({_some(parsed.gguf)}), which from_pretrained cannot load; "
                                      "build the model and call kbit_linear.load_into(model, path)")
            if parsed.tensor_types is not None:  # (absent from the files of older writers)
                recorded.append((path, stored, parsed.tensor_types))
            shapes.update(stored)
            layers.update(parsed.layers)
            experts.update(parsed.experts)
            sums.update(parsed.sha256)
            if parsed.tensor_types is not None:
                types = {**(types or {}), **parsed.tensor_types}
        where = str(checkpoint_files[0]) if len(checkpoint_files) == 1 else f"checkpoint ({len(checkpoint_files)} files)"
        placeholders = {n: m for n, m in model.named_modules() if isinstance(m, KbitLinear)}
        for name, module in placeholders.items():
            if name not in layers:
                raise CheckpointError(f"{where}: layer {name!r} should be quantized but the checkpoint header does not list it")
            meta = validate_layer_metadata(name, layers[name], where=where)
            want = {k: v for k, v in layer_metadata(module).items() if k in ("bits", "in_features", "out_features")}
            want["hadamard"] = module.hadamard_signs is not None
            got = {k: meta.get(k, False if k == "hadamard" else None) for k in want}
            if got != want:
                raise CheckpointError(
                    f"{where}: layer {name!r} is {got} in the checkpoint but the model (config.json) expects {want}"
                )
            for tensor in stored_tensor_names(module):
                _check_header_tensor(shapes, f"{name}.{tensor}", getattr(module, tensor),
                                     f"a {module.bits}-bit {module.out_features}x{module.in_features} layer", where)
        _refuse_stray(layers, placeholders, "layers", where)
        self._check_experts_headers(model, experts, shapes, where)
        # Every tensor of each file against that file's record, dense ones too: transformers loads
        # those itself and would cast a relabelled one (F32 -> I32) into its parameter unseen.
        # (After the checks above, whose messages say more about a quantized tensor.)
        for path, stored, record in recorded:
            for key, (raw, shape) in stored.items():
                verify_stored_type(key, raw, shape, record, where=path)
        self._header_sha256, self._header_types, self._header_where = sums, types, where
        self._headers_read = True

    @staticmethod
    def _check_experts_headers(model: nn.Module, experts: dict[str, Any],
                               shapes: dict[str, tuple[str, tuple[int, ...]]], where: str) -> None:
        """The experts part of :meth:`_check_headers`: every KbitExperts placeholder is listed with
        its shapes, every tensor is there with the placeholder's dtype and shape, nothing else is listed."""
        placeholders = {n: m for n, m in model.named_modules() if isinstance(m, KbitExperts)}
        for name, module in placeholders.items():
            if name not in experts:
                raise CheckpointError(f"{where}: experts {name!r} should be quantized but the checkpoint header does not list them")
            meta = validate_experts_metadata(name, experts[name], where=where)
            keys = ("bits", "num_experts", "hidden_dim", "intermediate_dim")
            got, want = ({k: m[k] for k in keys} for m in (meta, experts_metadata(module)))
            if got != want:
                raise CheckpointError(f"{where}: experts {name!r} are {got} in the checkpoint but the model (config.json) expects {want}")
            for tensor in _EXPERTS_TENSORS:
                _check_header_tensor(shapes, f"{name}.{tensor}", getattr(module, tensor),
                                     f"{module.bits}-bit experts ({module.extra_repr()})", where)
        _refuse_stray(experts, placeholders, "experts", where)

    # --- after loading: checks and freezing -----------------------------------------------

    def _process_model_after_weight_loading(self, model: nn.Module, **kwargs: Any) -> nn.Module:
        """Validate every quantized layer and freeze the float parameters of the quantized layers.

        A layer chosen for quantization whose weight was not in the checkpoint (transformers
        initialized it) is quantized now, like every other chosen layer.
        """
        for name, param in model.named_parameters():
            if _is_dtensor(param) and isinstance(model.get_submodule(name.rpartition(".")[0]), (KbitLinear, KbitExperts)):
                _refuse_tensor_parallel(name)
        config = self.quantization_config
        if self.deferred:
            offloaded = [n for n in self.deferred if model.get_submodule(n).weight.device.type == "meta"]
            if offloaded:
                raise ValueError(
                    f"target_bpw chooses the widths from every weight, but {len(offloaded)} layers (e.g. {offloaded[0]!r}) were "
                    "offloaded by the device_map; load on devices that hold the dense model, or load dense and call "
                    "kbit_linear.quantize_model(model, target_bpw=...)")
            config.layer_bits = plan_layer_bits(((n, model.get_submodule(n).weight) for n in self.deferred), config.target_bpw,
                                                codebook=self.codebook, scale_search=config.scale_search, hadamard=config.hadamard)
            self.pending |= set(self.deferred)
            self.deferred = []
        # A group whose sibling never arrived: its stashed weights are the real ones (transformers
        # initialized the layers it reported missing); quantize them with the rest below.
        for name, weight in self.stash.items():
            model.get_submodule(name).weight = nn.Parameter(weight, requires_grad=False)
        self.stash = {}
        if config.fuse and not self.group_of:  # target_bpw: grouped once the widths are known
            self.group_of = sibling_groups(self.pending, config.layer_bits or {}, config.bits, model)
        shared_of: dict[tuple[str, ...], Any] = {}
        for name in sorted(self.pending):
            linear = model.get_submodule(name)
            if is_convertible(linear):
                group = self.group_of.get(name)
                levels, shared_scale = self.codebook, None
                if group is not None:
                    if group not in shared_of:
                        shared_of[group] = shared_quantization(model, group, self.codebook, config.bits_of(name),
                                                               config.scale_search, config.hadamard, layer_seed(group[0]),
                                                               linear.weight.device)
                    if shared_of[group] is not None:
                        levels, shared_scale = shared_of[group]
                layer = KbitLinear.from_linear(linear, config.bits_of(name), levels, tensor_scale=shared_scale,
                                               scale_search=self.quantization_config.scale_search,
                                               hadamard=self.quantization_config.hadamard,
                                               hadamard_seed=layer_seed(group[0] if group else name),
                                               hadamard_search=self.quantization_config.hadamard_search)
                layer.train(linear.training)
                replace_module(model, name, layer)
        self.pending = set()
        for name in sorted(self.pending_experts):
            module = model.get_submodule(name)
            if experts_layout_problem(module) is None:  # neither projection was in the checkpoint
                new = KbitExperts.from_experts(module, self.quantization_config.bits, self.codebook,
                                               scale_search=self.quantization_config.scale_search)
                replace_module(model, name, new)
        self.pending_experts = {}
        for name, module in model.named_modules():
            if isinstance(module, KbitExperts):
                self._check_loaded_experts(name, module)
                continue
            if not isinstance(module, KbitLinear):
                continue
            # checked as stored: planes (a layer quantized above holds its device's layout already)
            tensors = {t: _as_saved(module, t) for t in (*stored_tensor_names(module), "bias") if getattr(module, t) is not None}
            for t_name, t in tensors.items():
                if t.device.type == "meta":
                    raise CheckpointError(f"layer {name!r}: tensor {t_name!r} was not loaded (still on the meta device)")
            try:
                validate_layer_tensors(name, tensors, layer_metadata(module))
            except CheckpointError as e:
                raise CheckpointError(f"after loading: {e}") from None
            if self.pre_quantized and self._headers_read:  # (an empty table is no checksum for any tensor)
                for t_name in stored_tensor_names(module):
                    self._verify_loaded(f"{name}.{t_name}", tensors[t_name])
            for p in module.parameters(recurse=False):
                p.requires_grad_(False)
            weight_layout.adopt(module.weight, module.bits)  # loaded as planes: the device's layout
        self._header_sha256, self._header_types, self._header_where, self._headers_read = {}, None, "", False
        if config.fuse:
            model.kbit_fusion = fuse_projections(model)
            model.kbit_router_fusion = fuse_routers(model)
        return model

    def _check_loaded_experts(self, name: str, module: KbitExperts) -> None:
        """:meth:`_process_model_after_weight_loading` for one KbitExperts: all loaded, valid,
        matching the header's checksums, frozen."""
        tensors = {t: _as_saved(module, t) for t in _EXPERTS_TENSORS}
        for t_name, t in tensors.items():
            if t.device.type == "meta":
                raise CheckpointError(f"experts {name!r}: tensor {t_name!r} was not loaded (still on the meta device)")
        try:
            validate_experts_tensors(name, tensors, experts_metadata(module))
        except CheckpointError as e:
            raise CheckpointError(f"after loading: {e}") from None
        if self.pre_quantized and self._headers_read:
            for t_name, t in tensors.items():
                self._verify_loaded(f"{name}.{t_name}", t)
        for p in module.parameters(recurse=False):
            p.requires_grad_(False)
        for proj in PROJECTIONS:  # loaded as planes: the device's layout
            weight_layout.adopt(getattr(module, proj), module.bits)

    def _verify_loaded(self, name: str, tensor: torch.Tensor) -> None:
        """Check one loaded quantized tensor (as stored) against the headers' checksum and, when
        they record them, dtype and shape."""
        verify_sha256(name, tensor, self._header_sha256, where=self._header_where)
        if self._header_types is not None:
            verify_tensor_type(name, tensor, self._header_types, where=self._header_where)

    # --- saving ------------------------------------------------------------------------

    def get_state_dict_and_metadata(self, model: nn.Module) -> tuple[dict[str, torch.Tensor], dict[str, str]]:
        """The state dict and header metadata for ``save_pretrained``
        (:func:`kbit_linear.serialization.header_metadata`): version, per-layer and per-experts
        metadata, checksums of the quantized tensors, and the dtype and shape of every tensor the
        files may hold (:func:`_saved_tensor_types`).

        Returns ``model.state_dict()``, which ``save_pretrained`` then writes (so it is built once).
        Also drops the weight conversions that ``save_pretrained`` would apply to the quantized
        tensors (:func:`_keep_quantized_names`), so they are stored under the names the headers list.

        Raises:
            ValueError: the model holds GGUF modules (named), which ``save_pretrained`` cannot carry.
        """
        gguf = [name for name, module in model.named_modules() if isinstance(module, (GGUFLinear, GGUFEmbedding))]
        if gguf:
            raise ValueError(
                f"save_pretrained cannot write GGUF modules ({_some(gguf)}): from_pretrained would find no weights for "
                "those layers and initialize them at random. Save with kbit_linear.save_quantized(model, 'model.safetensors') "
                "and load with kbit_linear.load_into(model, 'model.safetensors')"
            )
        layers, experts, sums, types = {}, {}, {}, {}
        for name, module in kbit_layers(model):  # fused parts as standalone copies, as their state dicts hold them
            layers[name] = layer_metadata(module)
            for t_name in stored_tensor_names(module):
                t = _as_saved(module, t_name)
                sums[f"{name}.{t_name}"], types[f"{name}.{t_name}"] = tensor_sha256(t), tensor_type(t)
        for name, module in model.named_modules():
            if isinstance(module, KbitExperts):
                experts[name] = experts_metadata(module)
                for t_name in _EXPERTS_TENSORS:
                    t = _as_saved(module, t_name)
                    sums[f"{name}.{t_name}"], types[f"{name}.{t_name}"] = tensor_sha256(t), tensor_type(t)
        _keep_quantized_names(model, list(sums))
        state_dict = model.state_dict()
        types = {**_saved_tensor_types(model, state_dict), **types}
        return state_dict, header_metadata(layers, sums, experts, tensor_types=types)

    def is_serializable(self, *args: Any, **kwargs: Any) -> bool:
        """Quantized models save to safetensors and load back without re-quantizing."""
        return True

    def _dequantize(self, model: nn.Module, dtype: torch.dtype | None = None) -> nn.Module:
        """``model.dequantize()``: dense ``nn.Linear`` layers back (:func:`kbit_linear.patch.dequantize_model`),
        in ``dtype`` (transformers passes the dtype the model was loaded in). The fusion reports of a
        ``fuse=True`` load (``kbit_fusion``, ``kbit_router_fusion``) go with the kbit modules."""
        dequantize_model(model, dtype if isinstance(dtype, torch.dtype) else None)
        for report in ("kbit_fusion", "kbit_router_fusion"):  # (also when nothing was fused: the model is dense now)
            model.__dict__.pop(report, None)
        return model

    @property
    def is_trainable(self) -> bool:
        """Adapters train on top (QLoRA through PEFT, ``kbit_linear.integrations.peft``): gradients
        flow through the kbit layers to their inputs; the quantized weights themselves stay frozen."""
        return True

    @property
    def is_qat_trainable(self) -> bool:
        """No quantization-aware training."""
        return False

    @property
    def is_compileable(self) -> bool:
        """The forward pass is one ``torch.library`` op with a fake implementation."""
        return True


def _as_saved(module: nn.Module, name: str) -> torch.Tensor:
    """A quantized module's tensor ``name`` as its state dict (and so the checkpoint) holds it:
    the packed weights as planes (:mod:`kbit_linear.weight_layout`), the rest as they are."""
    t = getattr(module, name)
    return weight_layout.storage_form(t) if name in ("weight", *PROJECTIONS) else t


def _some(names: Any, shown: int = 4) -> str:
    """The first ``shown`` of ``names``, and how many more, for messages."""
    names = sorted(names)
    more = f" and {len(names) - shown} more" if len(names) > shown else ""
    return ", ".join(names[:shown]) + more


def _is_dtensor(tensor: Any) -> bool:
    """Whether ``tensor`` is a ``torch.distributed`` DTensor (what ``tp_plan`` turns sharded parameters into)."""
    if not torch.distributed.is_available():
        return False
    from torch.distributed.tensor import DTensor

    return isinstance(tensor, DTensor)


def _refuse_tensor_parallel(name: str) -> None:
    """Raise the error for ``from_pretrained(tp_plan=...)`` on a kbit layer.

    transformers' tensor-parallel loader shards every parameter as a DTensor along the dense
    layout's dimensions before the weights load: the quantizer would receive a slice of a dense
    weight, and a pre-quantized checkpoint's tiled planes would be cut along a tile dimension.
    """
    raise ValueError(
        f"{name}: kbit layers cannot be sharded by from_pretrained(tp_plan=...) / DistributedConfig(tp_size=...). "
        "Load the model on each rank without tp_plan (device_map={'': local_rank}) and call "
        "kbit_linear.shard_for_tensor_parallel(model), which applies the model's own tensor-parallel plan"
    )


def _saved_tensor_types(model: nn.Module, state_dict: dict[str, torch.Tensor]) -> dict[str, tuple[str, tuple[int, ...]]]:
    """``(dtype, shape)`` (:func:`kbit_linear.serialization.tensor_type`) of every tensor that
    ``save_pretrained`` may write from ``state_dict``, dense ones too, for the headers'
    ``kbit_linear.tensor_types`` entry.

    ``save_pretrained`` passes one header to every shard and renames or splits tensors after this
    hook (it reverts the model's weight conversions: the checkpoint's original names, e.g. per-expert
    matrices of dense experts), so the table covers every shard: each tensor under the name that
    revert gives it and under its name in the model (what ``save_original_format=False`` writes).
    Entries for tensors a file does not hold (a tied ``lm_head`` dropped at save, the naming not
    used) are harmless: a loader checks the tensors a file holds against the table. The revert
    runs on meta tensors: no data is read or copied.
    """
    from transformers.core_model_loading import revert_weight_conversion

    types = {name: tensor_type(t) for name, t in state_dict.items()}
    meta = {name: t.detach().to("meta") for name, t in state_dict.items()}
    types.update((name, tensor_type(t)) for name, t in revert_weight_conversion(model, meta).items())
    return types


def _keep_quantized_names(model: nn.Module, names: list[str]) -> None:
    """Keep ``save_pretrained`` from converting the quantized tensors ``names`` back to a dense layout.

    ``save_pretrained`` undoes the model's weight conversions (``model._weight_conversions``, or
    the family's default mapping) to write the checkpoint's original names and layout: on MoE
    models it would split the packed ``gate_up_proj`` planes along their tile dimensions into
    per-expert pieces, and rename tensors (Mixtral's ``mlp`` -> ``block_sparse_moe``) away from
    the names the headers list. Every conversion whose reverse would take one of ``names`` is
    dropped from ``model._weight_conversions``: the quantized tensors are stored as they are in
    the model, under the model's names, which the loader takes as they are.
    """
    from transformers.core_model_loading import PrefixChange

    conversions = getattr(model, "_weight_conversions", None)
    if conversions is None:  # what save_pretrained would use (transformers' revert_weight_conversion)
        from transformers.conversion_mapping import get_model_conversion_mapping

        conversions = [c for c in get_model_conversion_mapping(model, add_legacy=False) if not isinstance(c, PrefixChange)]
    if not conversions:
        return

    def touches_one(conversion: Any) -> bool:
        reverse = conversion.reverse_transform()
        return any(reverse.rename_source_key(name)[1] is not None for name in names)

    model._weight_conversions = [c for c in conversions if not touches_one(c)]


# ---------------------------------------------------------------------------------------
# registration
# ---------------------------------------------------------------------------------------


def register() -> None:
    """Register :class:`KbitConfig` and :class:`KbitHfQuantizer` with transformers under ``"kbit"``.

    Idempotent: calling it again (or after this module was reloaded) is harmless. Another
    package's registration under the same name is an error.

    Raises:
        RuntimeError: ``"kbit"`` is registered by someone else.
    """
    from transformers.quantizers import auto

    for mapping, cls in ((auto.AUTO_QUANTIZATION_CONFIG_MAPPING, KbitConfig), (auto.AUTO_QUANTIZER_MAPPING, KbitHfQuantizer)):
        current = mapping.get(QUANT_METHOD)
        if current is cls:
            continue
        if current is not None and (current.__module__, current.__qualname__) != (cls.__module__, cls.__qualname__):
            raise RuntimeError(
                f"the quantization method {QUANT_METHOD!r} is already registered with transformers by "
                f"{current.__module__}.{current.__qualname__}"
            )
        if current is None:
            decorator = auto.register_quantization_config if cls is KbitConfig else auto.register_quantizer
            decorator(QUANT_METHOD)(cls)
        else:  # this module was reloaded: replace the stale class
            mapping[QUANT_METHOD] = cls
