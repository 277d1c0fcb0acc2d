"""``load_gguf``: a llama.cpp GGUF checkpoint as a transformers model whose Q4_0, Q4_1, Q5_0, Q5_1 and
Q8_0 linear weights stay in their own precision (:class:`~kbit_linear.gguf_linear.GGUFLinear`,
:class:`~kbit_linear.gguf_linear.GGUFEmbedding`).

transformers' own GGUF loading (``from_pretrained(folder, gguf_file=...)``) dequantizes every tensor
to the load dtype. This loader mirrors transformers' reading of the file and differs only in what it
does with each tensor:

* **config**: ``AutoConfig.from_pretrained(folder, gguf_file=name)``, as ``from_pretrained`` does;
  the model skeleton is built from it with ``accelerate.init_empty_weights`` (parameters on the
  meta device, buffers such as the rotary frequencies computed for real).
* **names and processing**: the legacy GGUF reader of
  ``transformers.modeling_gguf_pytorch_utils`` (the path ``from_pretrained`` takes for every
  architecture but the few of ``transformers.integrations.gguf``): the config dict of
  ``load_gguf_checkpoint(path, return_tensors=False)``, GGUF -> transformers names from
  ``get_gguf_hf_weights_map(model, processor)``, and the architecture's ``TENSOR_PROCESSORS``
  processor run on every tensor dequantized by ``gguf.dequantize``, exactly as
  ``load_gguf_checkpoint(return_tensors=True)`` does. Tensors are read one at a time from the
  memory-mapped file, so peak memory stays near one tensor above the result.
* **kept**: a Q4_0/Q4_1/Q5_0/Q5_1/Q8_0 tensor that lands on the weight of an exact ``nn.Linear``
  or ``nn.Embedding`` of the same shape (or of a Gemma 2/3/4 scaled word embedding, whose scale
  ``GGUFEmbedding`` applies), and whose processing only reorders rows, keeps its blocks. The row
  order is found by running the processor on the probe ``arange(N).reshape(N, 1)`` (float64)
  under the tensor's name: a result with the same name that
  is a permutation of the rows (Llama's q/k ``_reverse_permute_weights``) is applied to every
  array of the weight, which is exact since a row is one out-feature's blocks. A processor that
  renames, splits, merges, reshapes or changes values sends the tensor down the dense path. (The
  probe has one column: a processor that reordered columns only, and kept the shape, would go
  unseen; none of transformers' processors does.)
* **requantized**: other quantized tensors on an exact ``nn.Linear`` weight (K-quants, IQ types,
  and the kept types where the processor does more than reorder rows) are dequantized, processed
  and quantized to this project's kbit format (:class:`~kbit_linear.KbitLinear`, ``requantize_bits``
  bits, data-free with the block scale search by default); ``requantize_bits=None`` keeps them dense.
* **dense**: everything else (norms, biases, F32/F16/BF16 linear weights, embeddings not kept) in
  the load dtype, cast the way ``from_pretrained`` casts it.
* **ties**: where the config ties the output embedding and the file has no ``output.weight``, the
  ``lm_head`` becomes a ``GGUFLinear`` holding the same tensors as the kept ``GGUFEmbedding`` (one
  copy in memory); transformers' own re-tying (``model.tie_weights()``) is told to leave that
  pair alone, since it works by sharing a ``weight`` Parameter the GGUF modules do not have.

The result is returned in eval mode, with ``model.gguf_load_report`` (a :class:`GGUFLoadReport`:
one record per GGUF tensor, the ties made) and one log line per action kind. Its logits equal
``from_pretrained``'s dequantized model bit for bit in float32 where no tensor was requantized.

Default dtype: ``from_pretrained(..., gguf_file=...)`` with no ``dtype`` (``"auto"``) finds none
in a GGUF config and asks the GGUF quantizer, which answers ``torch.get_default_dtype()`` (float32
unless changed) for the legacy path and for any file holding quantized blocks; ``dtype=None``
here means the same.

Why not ``from_pretrained(folder, gguf_file=..., quantization_config=KbitConfig(...))``: in
transformers 5.23 a ``gguf_file`` selects the GGUF quantizer itself. ``get_hf_quantizer`` builds a
``GgufConfig`` when none is given and raises "You cannot combine Quantization and loading a model
from a GGUF file" for any other ``quant_method``; ``from_pretrained`` then calls ``read_header`` and
``get_state_dict`` on the quantizer, hooks only ``GgufHfQuantizer`` has. The one way in would be to
replace the ``"gguf"`` entry of transformers' global quantizer registry, which changes every GGUF
load in the process (and ``register_quantizer`` refuses a taken name), so this loader stands
apart instead.

Not covered: architectures that ``from_pretrained`` reads through ``transformers.integrations.gguf``
(``qwen35``, ``qwen35moe``, ``lfm2`` in 5.23: another reader and conversion mapping), and
architectures whose model applies a checkpoint conversion at load (fused MoE experts): both raise
a ``ValueError`` naming what cannot be placed. Models come from ``AutoModelForCausalLM``. The
tokenizer is transformers' (``AutoTokenizer.from_pretrained(folder, gguf_file=name)``). The model
saves with :func:`kbit_linear.save_quantized` and loads back with :func:`kbit_linear.load_into`;
its ``save_pretrained`` raises a ``ValueError`` saying so (transformers' file would reload with
random weights in those layers). Its GGUF embedding cannot be resized
(``resize_token_embeddings`` reads ``weight``).
"""

from __future__ import annotations

import logging
import os
import re
from collections import Counter, defaultdict
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import nn
from tqdm.auto import tqdm

from . import format as fmt
from . import gguf_format as gf
from .gguf_linear import GGUFEmbedding, GGUFLinear, embedding_scale, forget_tied_weights
from .linear import KbitLinear
from .patch import replace_module

__all__ = ["GGUFLoadReport", "GGUFTensorRecord", "load_gguf"]

logger = logging.getLogger(__name__)

KEPT = "kept"
DENSE = "dense"
UNUSED = "unused"

# GGUF tensor types that hold values, not blocks: never requantized.
_VALUE_TYPES = frozenset({"F32", "F16", "BF16", "F64", "I8", "I16", "I32", "I64"})

@dataclass(frozen=True)
class GGUFTensorRecord:
    """What :func:`load_gguf` did with one tensor of the file.

    Attributes:
        gguf_name: the tensor's name in the file (``"blk.0.attn_q.weight"``).
        hf_name: the model parameter it became (``"model.layers.0.self_attn.q_proj.weight"``), or
            ``None`` when it maps to none.
        gguf_type: its type in the file (``"Q4_1"``, ``"Q4_K"``, ``"F32"``).
        action: ``"kept"`` (GGUF blocks kept), ``"requantized kbit K"`` (kbit format, K bits),
            ``"dense"`` (dequantized, in the load dtype) or ``"unused"`` (maps to no parameter of
            the model; transformers drops it too).
        reason: why, in words.
    """

    gguf_name: str
    hf_name: str | None
    gguf_type: str
    action: str
    reason: str


@dataclass
class GGUFLoadReport:
    """The summary :func:`load_gguf` attaches to the model as ``model.gguf_load_report``.

    Attributes:
        path: the GGUF file.
        architecture: its ``general.architecture``.
        dtype: the load dtype.
        tensors: one record per tensor of the file, in file order.
        tied: parameter name -> the parameter it shares its tensors with, for each tie made.
    """

    path: str
    architecture: str
    dtype: torch.dtype
    tensors: list[GGUFTensorRecord] = field(default_factory=list)
    tied: dict[str, str] = field(default_factory=dict)

    def by_action(self) -> dict[str, list[GGUFTensorRecord]]:
        """The records grouped by action, in first-seen order."""
        groups: dict[str, list[GGUFTensorRecord]] = defaultdict(list)
        for record in self.tensors:
            groups[record.action].append(record)
        return dict(groups)

    def lines(self) -> list[str]:
        """One line per action kind: how many tensors, of which GGUF types."""
        out = []
        for action, records in self.by_action().items():
            types = Counter(r.gguf_type for r in records)
            listed = ", ".join(f"{t} {n}" for t, n in sorted(types.items()))
            out.append(f"{action}: {len(records)} tensors ({listed})")
        out += [f"tied {target} -> {source}" for target, source in self.tied.items()]
        return out

    def __str__(self) -> str:
        head = f"GGUF load of {Path(self.path).name} ({self.architecture}, {self.dtype}): {len(self.tensors)} tensors"
        return "\n".join([head, *(f"  {line}" for line in self.lines())])


# ---------------------------------------------------------------------------------------
# argument checks and transformers' pieces
# ---------------------------------------------------------------------------------------


def _check_args(path: Any, dtype: Any, device: Any, requantize_bits: Any, scale_search: Any,
                progress: Any) -> tuple[Path, torch.dtype, torch.device | None]:
    """:func:`load_gguf`'s arguments checked: ``(path, dtype, device)`` resolved."""
    if not isinstance(path, (str, os.PathLike)):
        raise TypeError(f"path must be a str or os.PathLike, got {type(path).__name__}")
    path = Path(path).expanduser()
    if not path.is_file():
        raise FileNotFoundError(f"path {str(path)!r} is not a GGUF file (no such file)")
    dtype = torch.get_default_dtype() if dtype is None else fmt.check_float_dtype(dtype)
    device = fmt.check_device(device)  # fail before the file is read, not after
    if requantize_bits is not None:
        try:
            fmt.check_bits(requantize_bits)
        except (TypeError, ValueError) as e:
            raise type(e)(f"requantize_bits: {e}") from None
    fmt.check_bool("scale_search", scale_search)
    fmt.check_bool("progress", progress)
    return path, dtype, device


def _import_gguf() -> Any:
    """The ``gguf`` package (an optional dependency, imported on first use)."""
    try:
        import gguf
    except ImportError as e:
        raise ImportError("load_gguf needs the gguf package (pip install gguf)") from e
    return gguf


def _architecture(reader: Any, path: Path) -> str:
    """The file's ``general.architecture``."""
    field_ = reader.fields.get("general.architecture")
    if field_ is None:
        raise ValueError(f"{path.name} has no general.architecture in its metadata")
    return bytes(field_.parts[field_.data[0]]).decode("utf-8")


def _read_config(path: Path, architecture: str) -> tuple[Any, dict[str, Any]]:
    """(transformers config, the config dict transformers' tensor processors get)."""
    from transformers import AutoConfig
    from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint

    try:
        from transformers.integrations.gguf import is_gguf_arch_supported
    except ImportError:  # a transformers without the newer GGUF reader: every architecture is legacy
        def is_gguf_arch_supported(arch: str) -> bool:
            return False

    if is_gguf_arch_supported(architecture):
        raise ValueError(f"GGUF architecture {architecture!r} ({path.name}) is read by transformers through "
                         "transformers.integrations.gguf, whose conversion mapping load_gguf does not mirror")
    try:
        parsed = load_gguf_checkpoint(str(path), return_tensors=False)
    except ValueError as e:  # "GGUF model with architecture ... is not supported yet."
        raise ValueError(f"transformers cannot read GGUF architecture {architecture!r} ({path.name}): {e}") from e
    config = AutoConfig.from_pretrained(str(path.parent), gguf_file=path.name)
    return config, parsed["config"]


def _empty_model(config: Any, dtype: torch.dtype, architecture: str) -> nn.Module:
    """The causal LM of ``config`` with its parameters on the meta device, built in ``dtype``."""
    from accelerate import init_empty_weights
    from transformers import AutoModelForCausalLM

    try:
        with init_empty_weights(include_buffers=False):
            return AutoModelForCausalLM.from_config(config, dtype=dtype)
    except ValueError as e:
        raise ValueError(f"GGUF architecture {architecture!r} has no transformers causal LM: {e}") from e


def _processor(architecture: str, processor_config: dict[str, Any]) -> Any:
    """transformers' tensor processor for ``architecture``, as ``load_gguf_checkpoint`` picks it."""
    from transformers.modeling_gguf_pytorch_utils import TENSOR_PROCESSORS, TensorProcessor

    return TENSOR_PROCESSORS.get(architecture, TensorProcessor)(config=processor_config)


# ---------------------------------------------------------------------------------------
# one tensor
# ---------------------------------------------------------------------------------------


def _row_permutation(processor: Any, name: str, rows: int, mapping: dict[str, str]) -> tuple[np.ndarray | None, str | None]:
    """How the processor reorders the rows of tensor ``name``: ``(permutation or None for the
    identity, None)``, or ``(None, why it does more than that)``."""
    probe = np.arange(rows, dtype=np.float64).reshape(rows, 1)
    scratch: dict[str, dict] = {"tensors": {}}
    try:
        result = processor.process(weights=probe, name=name, tensor_key_mapping=mapping, parsed_parameters=scratch)
    except Exception as e:  # noqa: BLE001  (a processor that cannot take the probe transforms more than rows)
        return None, f"{type(processor).__name__} does more than reorder rows (the row probe raised {type(e).__name__})"
    if result.name != name or scratch["tensors"]:
        return None, f"{type(processor).__name__} renames, splits or merges it"
    out = np.asarray(result.weights)
    if out.shape != (rows, 1):
        return None, f"{type(processor).__name__} reshapes it to {tuple(out.shape)}"
    order = out[:, 0]
    if not np.array_equal(np.sort(order), probe[:, 0]):
        return None, f"{type(processor).__name__} changes its values"
    perm = order.astype(np.int64)
    return (None if np.array_equal(perm, np.arange(rows)) else perm), None


def _permute_rows(weight: gf.GGUFWeight, perm: np.ndarray | None) -> gf.GGUFWeight:
    """``weight`` with its rows in the order ``perm`` (row i of the result = row perm[i])."""
    if perm is None:
        return weight
    index = torch.from_numpy(perm)
    arrays = {k: v.index_select(0, index) for k, v in weight.tensors().items()}
    return gf.GGUFWeight(arrays["qs"], arrays.get("qh"), arrays["scale"], arrays.get("mins"), weight.qtype,
                         weight.out_features, weight.in_features)


def _owner(model: nn.Module, hf_name: str) -> tuple[str, nn.Module, str] | None:
    """``(module name, module, leaf)`` holding the parameter or buffer ``hf_name``, or ``None``."""
    module_name, _, leaf = hf_name.rpartition(".")
    try:
        module = model.get_submodule(module_name) if module_name else model
    except AttributeError:
        return None
    if leaf in module._parameters or leaf in module._buffers:
        return module_name, module, leaf
    return None


def _keep_target(module: nn.Module, leaf: str, shape: tuple[int, int]) -> str | None:
    """``"linear"`` / ``"embedding"`` when a GGUF weight of ``shape`` can replace ``module``, else ``None``."""
    if leaf != "weight":
        return None
    if type(module) is nn.Linear and (module.out_features, module.in_features) == shape:
        return "linear"
    embedding = type(module) is nn.Embedding or embedding_scale(module) is not None
    if embedding and module.max_norm is None and (module.num_embeddings, module.embedding_dim) == shape:
        return "embedding"
    return None


def _gguf_embedding(weight: gf.GGUFWeight, module: nn.Embedding, dtype: torch.dtype) -> GGUFEmbedding:
    """The ``GGUFEmbedding`` that stands in for ``module`` (its padding row and output scale)."""
    scale = embedding_scale(module)
    return GGUFEmbedding.from_weight(weight, dtype=dtype, padding_idx=module.padding_idx, embed_scale=scale)


def _why_not_kept(module: nn.Module, leaf: str) -> str:
    """The report's reason for a block tensor whose target cannot hold GGUF blocks."""
    if leaf != "weight":
        return f"lands on {leaf!r}, not a layer weight"
    return f"lands on a {type(module).__name__}, not an nn.Linear / nn.Embedding of its shape it can stand in for"


def _dense_dtype(model: nn.Module, hf_name: str, old: torch.Tensor, dtype: torch.dtype) -> torch.dtype:
    """The dtype ``from_pretrained`` gives parameter ``hf_name``: the model's keep-in-float32
    plan where it matches, else the skeleton's own dtype (``dtype`` unless the model made it
    otherwise)."""
    plan = model._get_dtype_plan(dtype) if hasattr(model, "_get_dtype_plan") else {}
    for pattern, planned in plan.items():
        if re.search(pattern.replace("*", ".*"), hf_name):
            return planned
    return old.dtype


def _set_dense(model: nn.Module, hf_name: str, module: nn.Module, leaf: str, values: torch.Tensor, dtype: torch.dtype) -> None:
    """Put ``values`` into ``module.<leaf>`` as ``from_pretrained`` would (same dtype rule)."""
    old = module._parameters[leaf] if leaf in module._parameters else module._buffers[leaf]
    if tuple(old.shape) != tuple(values.shape):
        raise ValueError(f"{hf_name}: the file's tensor has shape {tuple(values.shape)}, the model's {tuple(old.shape)}")
    if values.is_floating_point():
        # transformers' GGUF reader casts to the load dtype first, the loader to the parameter's then
        values = values.to(dtype).to(_dense_dtype(model, hf_name, old, dtype))
    if leaf in module._parameters:
        setattr(module, leaf, nn.Parameter(values, requires_grad=old.requires_grad and values.is_floating_point()))
    else:
        module._buffers[leaf] = values


def _requantize(module: nn.Linear, values: torch.Tensor, bits: int, scale_search: bool, hf_name: str) -> KbitLinear:
    """A ``KbitLinear`` for ``module`` with weight ``values`` (float32); keeps its bias Parameter."""
    if tuple(values.shape) != (module.out_features, module.in_features):
        raise ValueError(f"{hf_name}: the file's tensor has shape {tuple(values.shape)}, the model's "
                         f"{(module.out_features, module.in_features)}")
    src = nn.Linear(module.in_features, module.out_features, bias=False, device="meta")
    src.weight = nn.Parameter(values, requires_grad=False)
    src.bias = module.bias
    try:
        new = KbitLinear.from_linear(src, bits=bits, scale_search=scale_search)
    except (TypeError, ValueError) as e:
        raise ValueError(f"cannot requantize {hf_name}: {e}") from e
    new.train(module.training)
    return new


class _Loader:
    """The state of one :func:`load_gguf` call: the model being filled and the records so far."""

    def __init__(self, model: nn.Module, processor: Any, mapping: dict[str, str], dtype: torch.dtype,
                 requantize_bits: int | None, scale_search: bool, report: GGUFLoadReport) -> None:
        self.model = model
        self.processor = processor
        self.mapping = mapping
        self.dtype = dtype
        self.bits = requantize_bits
        self.scale_search = scale_search
        self.report = report
        self.assigned: set[str] = set()
        self.unplaced: dict[str, str] = {}  # hf name -> gguf name, for names the model lacks
        self.side: dict[str, torch.Tensor] = {}  # tensors a processor stored itself (MoE experts, GPT-2's lm_head)
        self.side_sources: dict[str, str] = {}

    def record(self, tensor: Any, hf_name: str | None, action: str, reason: str) -> None:
        """Add a record for ``tensor`` to the report."""
        self.report.tensors.append(GGUFTensorRecord(tensor.name, hf_name, tensor.tensor_type.name, action, reason))

    def load(self, tensor: Any, gguf: Any) -> None:
        """Read, place and record one tensor of the file."""
        qtype = tensor.tensor_type.name
        shape = tuple(int(d) for d in reversed(tensor.shape.tolist()))
        why_dense = None
        if qtype in gf.BLOCK_TYPES and len(shape) == 2:
            why_dense = self._try_keep(tensor, qtype, shape)
            if why_dense is None:
                return
        self._load_dense(tensor, gguf, why_dense)

    def _try_keep(self, tensor: Any, qtype: str, shape: tuple[int, int]) -> str | None:
        """Keep the tensor's blocks if it can be; ``None`` when done, else why it cannot."""
        perm, problem = _row_permutation(self.processor, tensor.name, shape[0], self.mapping)
        if problem is not None:
            return problem
        hf_name = self.mapping.get(tensor.name)
        if hf_name is None:
            return "maps to no parameter"
        owner = _owner(self.model, hf_name)
        if owner is None:
            return "maps to no parameter"
        module_name, module, leaf = owner
        kind = _keep_target(module, leaf, shape)
        if kind is None:
            return _why_not_kept(module, leaf)
        raw = torch.from_numpy(np.array(tensor.data, copy=True))  # the file is mapped read-only
        weight = _permute_rows(gf.split_blocks(raw, qtype, shape[0], shape[1]), perm)
        del raw
        if kind == "linear":
            new: nn.Module = GGUFLinear.from_weight(weight)
            new.bias = module.bias  # the skeleton's (filled when the file's bias arrives)
        else:
            new = _gguf_embedding(weight, module, self.dtype)
        new.train(module.training)
        replace_module(self.model, module_name, new)
        self.assigned.add(hf_name)
        order = "rows reordered by the tensor processor" if perm is not None else "as stored"
        self.record(tensor, hf_name, KEPT, f"{type(new).__name__} {qtype}, {order}")
        return None

    def _load_dense(self, tensor: Any, gguf: Any, why: str | None) -> None:
        """Dequantize and process the tensor as transformers does, then place it."""
        qtype = tensor.tensor_type.name
        try:
            values = gguf.dequantize(tensor.data, tensor.tensor_type)
        except NotImplementedError as e:  # a type the gguf package cannot read: name the tensor and type
            raise ValueError(f"tensor {tensor.name!r} has GGUF type {qtype}, which neither this loader keeps nor the "
                             f"installed gguf package can dequantize ({e})") from e
        before = set(self.side)
        result = self.processor.process(weights=values, name=tensor.name, tensor_key_mapping=self.mapping,
                                        parsed_parameters={"tensors": self.side})
        added = [k for k in self.side if k not in before]
        for k in added:
            self.side_sources[k] = tensor.name
        name = result.name
        if name is None:
            # the processor stored it under a name of its own, or merged it into a tensor it stores
            stored = ", ".join(added) if added else None
            self.record(tensor, stored, DENSE, f"stored by {type(self.processor).__name__}, placed dense after the others")
            return
        hf_name = self.mapping.get(name)
        if hf_name is None:
            self.record(tensor, None, UNUSED, "maps to no parameter of the model (transformers drops it too)")
            return
        owner = _owner(self.model, hf_name)
        if owner is None:
            self.unplaced[hf_name] = tensor.name
            return
        module_name, module, leaf = owner
        data = torch.from_numpy(np.array(result.weights, copy=True))
        on_linear = type(module) is nn.Linear and leaf == "weight" and data.is_floating_point()
        if on_linear and qtype not in _VALUE_TYPES and self.bits is not None:
            new = _requantize(module, data.float(), self.bits, self.scale_search, hf_name)
            replace_module(self.model, module_name, new)
            action = f"requantized kbit {self.bits}"
            reason = why or f"{qtype} blocks are not kept as they are"
        else:
            _set_dense(self.model, hf_name, module, leaf, data, self.dtype)
            action = DENSE
            if qtype in _VALUE_TYPES:
                reason = f"{qtype} holds values, not blocks"
            elif on_linear:
                reason = "requantize_bits=None"
            else:
                reason = why or f"lands on {type(module).__name__}.{leaf}, not a linear weight"
        self.assigned.add(hf_name)
        self.record(tensor, hf_name, action, reason)

    def place_side_tensors(self) -> None:
        """The tensors processors stored themselves, placed dense (as transformers loads them)."""
        for hf_name, values in self.side.items():
            owner = _owner(self.model, hf_name)
            if owner is None:
                self.unplaced[hf_name] = self.side_sources[hf_name]
                continue
            _, module, leaf = owner
            _set_dense(self.model, hf_name, module, leaf, values, self.dtype)
            self.assigned.add(hf_name)
        self.side.clear()


# ---------------------------------------------------------------------------------------
# ties and final checks
# ---------------------------------------------------------------------------------------


def _tie(model: nn.Module, target: str, source: str, dtype: torch.dtype) -> bool:
    """Make parameter ``target`` share ``source``'s tensors; ``True`` when GGUF modules were
    involved (a tie transformers cannot redo)."""
    src_name, _, src_leaf = source.rpartition(".")
    src_module = model.get_submodule(src_name)  # a GGUF module holds no `weight`: look up the module
    tgt_owner = _owner(model, target)
    if tgt_owner is None:
        raise ValueError(f"cannot tie {target} to {source}: {target} is not a parameter of the model")
    tgt_name, tgt_module, tgt_leaf = tgt_owner
    if isinstance(src_module, (GGUFEmbedding, GGUFLinear)):
        weight = src_module.weight_format()
        kind = _keep_target(tgt_module, tgt_leaf, (weight.out_features, weight.in_features))
        if kind == "linear":
            new: nn.Module = GGUFLinear.from_weight(weight)
            new.bias = tgt_module.bias
        elif kind == "embedding":
            new = _gguf_embedding(weight, tgt_module, dtype)
        else:
            raise ValueError(f"cannot tie {target} ({type(tgt_module).__name__}) to the GGUF weight of {source}")
        new.train(tgt_module.training)
        replace_module(model, tgt_name, new)
        return True
    if isinstance(src_module, KbitLinear):
        if type(tgt_module) is not nn.Linear or tgt_leaf != "weight":
            raise ValueError(f"cannot tie {target} ({type(tgt_module).__name__}) to the requantized layer {src_name}")
        replace_module(model, tgt_name, src_module)  # one module under both names
        return True
    setattr(tgt_module, tgt_leaf, model.get_parameter(source))  # what transformers' tie_weights does
    return False


def _make_ties(model: nn.Module, tied: dict[str, str], assigned: set[str], dtype: torch.dtype,
               report: GGUFLoadReport) -> None:
    """Tie each pair of ``tied`` (target -> source) that the file holds one side of, the way
    ``from_pretrained`` does (symmetrically: the side present is the one shared)."""
    gguf_ties: set[str] = set()
    for target, source in tied.items():
        if target in assigned and source in assigned:
            continue  # both in the file: transformers keeps both too
        if target in assigned:
            target, source = source, target
        if source not in assigned:
            continue  # neither: the meta check names them
        if _tie(model, target, source, dtype):
            gguf_ties |= {target, source}
        assigned.add(target)
        report.tied[target] = source
    if gguf_ties:
        forget_tied_weights(model, gguf_ties)


def _check_complete(model: nn.Module, unplaced: dict[str, str]) -> None:
    """A ValueError naming the tensors with no place in the model, or the parameters left on meta."""
    if unplaced:
        listed = ", ".join(f"{gguf_name} -> {hf_name}" for hf_name, gguf_name in sorted(unplaced.items()))
        raise ValueError(f"{len(unplaced)} GGUF tensors map to names the model does not have: {listed}")
    on_meta = [name for name, t in (*model.named_parameters(), *model.named_buffers()) if t.device.type == "meta"]
    if on_meta:
        shown = ", ".join(on_meta[:20]) + (f" and {len(on_meta) - 20} more" if len(on_meta) > 20 else "")
        raise ValueError(f"{len(on_meta)} model parameters got no tensor from the file: {shown}")


# ---------------------------------------------------------------------------------------
# the entry point
# ---------------------------------------------------------------------------------------


def _refuse_save_pretrained(*args: Any, **kwargs: Any) -> None:
    raise ValueError(
        "a model from load_gguf cannot be saved with save_pretrained: from_pretrained would find no weights for its "
        "GGUF and kbit layers and initialize them at random. Save it with kbit_linear.save_quantized(model, "
        "'model.safetensors') and load it into a model of the same config with kbit_linear.load_into(model, "
        "'model.safetensors')")


def load_gguf(path: str | os.PathLike, dtype: torch.dtype | None = None, device: torch.device | str | None = None, *,
              requantize_bits: int | None = 4, scale_search: bool = True, progress: bool = True,
              activation_bits: int = 16) -> nn.Module:
    """Load a GGUF checkpoint as a transformers causal LM, keeping Q4_0/Q4_1/Q5_0/Q5_1/Q8_0 weights
    in their blocks (module docstring: what happens to each tensor, and why not ``from_pretrained``).

    Args:
        path: the ``.gguf`` file.
        dtype: the model's dtype (activations, norms, dense weights, the embedding's output).
            Default: ``torch.get_default_dtype()``, what ``from_pretrained(..., gguf_file=...)``
            uses for it.
        device: where to move the finished model (default: stays on the CPU).
        requantize_bits: bits (2..5) of the kbit format for the quantized linear weights whose
            type is not kept (K-quants, IQ types); ``None`` keeps them dense.
        scale_search: requantize with the block scale search
            (:func:`kbit_linear.quantizer.quantize_weight`), the better data-free choice.
        progress: show a tqdm bar over the file's tensors.
        activation_bits: the kept layers' :attr:`GGUFLinear.activation_bits` (16, or 8 for
            llama.cpp's integer dot products on 8-bit activations; opt-in, slower and less exact).

    Returns:
        The model (a transformers ``PreTrainedModel``) in eval mode, with
        ``model.gguf_load_report`` (:class:`GGUFLoadReport`).

    Raises:
        FileNotFoundError: ``path`` is not a file.
        TypeError: an argument of the wrong type.
        ValueError: bad ``requantize_bits``; an architecture transformers cannot read (named);
            tensors that map to names the model lacks, or parameters the file does not fill
            (named).
        ImportError: the ``gguf`` package is missing.
    """
    path, dtype, device = _check_args(path, dtype, device, requantize_bits, scale_search, progress)
    if isinstance(activation_bits, bool) or not isinstance(activation_bits, int) or activation_bits not in (8, 16):
        raise ValueError(f"activation_bits must be the int 8 or 16, got {activation_bits!r}")
    gguf = _import_gguf()
    from transformers.modeling_gguf_pytorch_utils import get_gguf_hf_weights_map

    try:
        reader = gguf.GGUFReader(str(path))
    except (ValueError, IndexError, KeyError, OSError) as e:  # numpy's reshape / struct errors on a short or damaged file
        raise ValueError(f"{path}: cannot read the file as GGUF (truncated or damaged?): {e}") from e
    architecture = _architecture(reader, path)
    config, processor_config = _read_config(path, architecture)
    model = _empty_model(config, dtype, architecture)
    processor = _processor(architecture, processor_config)
    mapping = get_gguf_hf_weights_map(model, processor)
    tied = model.get_expanded_tied_weights_keys(all_submodels=True) if hasattr(model, "get_expanded_tied_weights_keys") else {}

    report = GGUFLoadReport(str(path), architecture, dtype)
    loader = _Loader(model, processor, mapping, dtype, requantize_bits, scale_search, report)
    for tensor in tqdm(reader.tensors, desc=f"load_gguf {path.name}", unit="tensor", disable=not progress):
        loader.load(tensor, gguf)
    loader.place_side_tensors()
    del reader
    if loader.unplaced:
        _check_complete(model, loader.unplaced)
    _make_ties(model, tied, loader.assigned, dtype, report)
    _check_complete(model, {})

    model.eval()
    for module in model.modules():
        if isinstance(module, GGUFLinear):
            module.activation_bits = activation_bits
    if device is not None:
        model.to(device)
    model.gguf_load_report = report
    # transformers' save_pretrained would write these layers in a form from_pretrained cannot
    # read back (it would initialize them at random): refuse it on this model, by name.
    model.save_pretrained = _refuse_save_pretrained
    for line in report.lines():
        logger.info("load_gguf %s: %s", path.name, line)
    return model
