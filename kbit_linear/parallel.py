"""Tensor parallelism for kbit models: each rank of a ``torch.distributed`` group keeps a shard.

:func:`shard_for_tensor_parallel` applies a transformers-style tensor-parallel plan (by default
the model's own ``tp_plan``, built from ``config.base_model_tp_plan``) to a model that is already
quantized, in place, on every rank of a process group:

==========================================  =========================================================
style                                       what the layer keeps and what runs after it
==========================================  =========================================================
``colwise``                                 rows ``[r*N/W, (r+1)*N/W)`` of the weight (and bias); the
                                            output stays split along its last dimension
``colwise_rep``, ``colwise_gather_output``  the same rows; the outputs are all-gathered (full width)
``rowwise``                                 columns ``[r*K/W, (r+1)*K/W)``; the input arrives split,
                                            the partial outputs are all-reduced, the bias added once
``rowwise_rep``, ``rowwise_split_input``    the same, from a full-width input (each rank slices it)
``embedding_rowwise``                       rows ``[r*V/W, (r+1)*V/W)`` of the vocabulary; ids
                                            outside the shard give zeros, the lookups are all-reduced
``replicate``                               nothing: every rank keeps the whole module
==========================================  =========================================================

(``r`` = rank, ``W`` = world size, ``N``/``K``/``V`` = out_features/in_features/vocabulary.)
Layers may be :class:`~kbit_linear.KbitLinear` or dense ``nn.Linear`` (a ``lm_head`` kept dense
is sharded like the others). A ``KbitLinear`` is cut with :func:`kbit_linear.format.slice_weight`:
the shard dequantizes bit for bit to the slice of the full layer's weight, so the sharded model
computes what the whole model computes, up to the order of the all-reduce's float additions.
Splits are even; a layer whose split would not be (or would cut a 32-weight block, or an
attention head) is refused with a ``ValueError`` naming it, before anything is changed.

Modules are changed in place (same objects, same names; their tensors become the shard) and the
collectives run in forward hooks (``torch.distributed.all_reduce`` / ``all_gather``, which
``torch.compile`` traces as functional collectives). Inference only: gradients are not
synchronized across ranks.
"""

from __future__ import annotations

import functools
import re
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from . import format as fmt
from . import hadamard
from .fusion import KbitLinearSlice
from .linear import KbitLinear

__all__ = ["COLWISE_STYLES", "ROWWISE_STYLES", "SUPPORTED_STYLES", "shard_for_tensor_parallel", "shard_plan", "slice_linear"]

COLWISE_STYLES = ("colwise", "colwise_rep", "colwise_gather_output")
"""Plan styles that split out_features (the last three gather the output)."""
ROWWISE_STYLES = ("rowwise", "rowwise_rep", "rowwise_split_input")
"""Plan styles that split in_features (the last two take a full-width input and slice it)."""
SUPPORTED_STYLES = (*COLWISE_STYLES, *ROWWISE_STYLES, "embedding_rowwise", "replicate", "replicated_with_grad_allreduce")
"""Every style :func:`shard_for_tensor_parallel` understands (``"replicated_with_grad_allreduce"``,
which transformers' plans give norms of Qwen3, Gemma3 and others, is ``"replicate"`` here: the
model is sharded for inference, and gradients are not all-reduced)."""

_GATHER = ("colwise_rep", "colwise_gather_output")
_SPLIT_INPUT = ("rowwise_rep", "rowwise_split_input")


# ---------------------------------------------------------------------------------------
# one layer
# ---------------------------------------------------------------------------------------


def slice_linear(layer: KbitLinear | nn.Linear, rows: tuple[int, int] | None = None,
                 cols: tuple[int, int] | None = None) -> KbitLinear | nn.Linear:
    """A new layer computing the ``rows`` outputs of ``layer`` from its ``cols`` inputs, exactly.

    ``KbitLinear``: the weight is cut by :func:`kbit_linear.format.slice_weight` (same codes and
    scales: the new layer's ``dequantize()`` equals ``layer.dequantize()[r0:r1, c0:c1]`` bit for
    bit); ``nn.Linear``: the weight is sliced and copied. The bias follows the rows (a column
    slice keeps all of it). ``layer`` is left unchanged.

    Args:
        layer: a ``KbitLinear`` or ``nn.Linear``.
        rows: ``(start, stop)`` of out_features (default: all).
        cols: ``(start, stop)`` of in_features (default: all); for a ``KbitLinear`` at multiples
            of 32 (stop may also be in_features).

    Returns:
        A layer of the same type with ``out_features = r1 - r0`` and ``in_features = c1 - c0``.

    Raises:
        TypeError: ``layer`` is neither, or a range is not a pair of ints.
        ValueError: a range outside the layer, a column cut inside a 32-weight block, or (for a
            Hadamard-rotated layer) inside a rotation block.
    """
    if isinstance(layer, KbitLinear):
        signs = None
        if layer.hadamard_signs is not None:  # the stored weight is W R, R block diagonal along in_features
            c0, c1 = _span("cols", cols, layer.in_features)
            if not hadamard.keeps_blocks(c0, c1, layer.in_features):
                block = hadamard.hadamard_block(layer.in_features)
                raise ValueError(
                    f"cols {(c0, c1)} do not keep a Hadamard-rotated layer's rotation blocks of {block} in-features: "
                    f"the slice must start at a multiple of {block} and its width's own block "
                    f"(kbit_linear.hadamard.hadamard_block) must be {block} too")
            signs = layer.hadamard_signs[c0:c1].clone()
        q = fmt.slice_weight(layer.kbit_weight(), rows, cols)
        new = KbitLinear(q.in_features, q.out_features, bias=False, bits=q.bits, device="meta", dtype=layer.compute_dtype,
                         hadamard=signs is not None)
        new.weight = nn.Parameter(q.packed, requires_grad=False)
        new.absmax, new.codebook, new.tensor_scale = q.absmax, q.codebook, q.tensor_scale
        if signs is not None:
            new.hadamard_signs = signs
    elif isinstance(layer, nn.Linear):
        r0, r1 = _span("rows", rows, layer.out_features)
        c0, c1 = _span("cols", cols, layer.in_features)
        new = nn.Linear(c1 - c0, r1 - r0, bias=False, device="meta")
        new.weight = nn.Parameter(layer.weight.detach()[r0:r1, c0:c1].clone(), requires_grad=layer.weight.requires_grad)
    else:
        raise TypeError(f"layer must be a KbitLinear or nn.Linear, got {type(layer).__name__}")
    if layer.bias is not None:
        r0, r1 = _span("rows", rows, layer.out_features)
        new.bias = nn.Parameter(layer.bias.detach()[r0:r1].clone(), requires_grad=layer.bias.requires_grad)
    new.train(layer.training)
    return new


def _span(name: str, span: tuple[int, int] | None, size: int) -> tuple[int, int]:
    """``span`` checked against ``[0, size]`` (``None``: all of it)."""
    if span is None:
        return 0, size
    if not isinstance(span, (tuple, list)) or len(span) != 2 or not all(isinstance(v, int) and not isinstance(v, bool) for v in span):
        raise TypeError(f"{name} must be a (start, stop) pair of ints, got {span!r}")
    if not 0 <= span[0] < span[1] <= size:
        raise ValueError(f"{name}={span!r} must satisfy 0 <= start < stop <= {size}")
    return span[0], span[1]


# ---------------------------------------------------------------------------------------
# the plan
# ---------------------------------------------------------------------------------------


@dataclass(frozen=True)
class _Shard:
    """What one module keeps on rank ``rank``: its style and the ``(start, stop)`` it keeps."""

    name: str
    style: str
    span: tuple[int, int] | None  # rows (colwise, embedding) or columns (rowwise); None: replicate


def _rule_regex(rule: str) -> re.Pattern[str]:
    """A plan key as a regex on full module names: ``*`` stands for one name component (a layer number)."""
    return re.compile("\\.".join("[^.]+" if part == "*" else re.escape(part) for part in rule.split(".")) + r"\Z")


def _model_plan(model: nn.Module) -> dict[str, str]:
    """The model's own plan: transformers' merged ``model.tp_plan`` (5.x), else
    ``config.base_model_tp_plan`` under the base model's prefix."""
    plan = getattr(model, "tp_plan", None)
    if isinstance(plan, dict) and plan:
        return dict(plan)
    config = getattr(model, "config", None)
    base = getattr(config, "base_model_tp_plan", None) or {}
    prefix = getattr(model, "base_model_prefix", "")
    if prefix and hasattr(model, prefix):
        return {f"{prefix}.{key}": style for key, style in base.items()}
    return dict(base)


def shard_plan(model: nn.Module, world_size: int, rank: int, plan: dict[str, str] | None = None) -> list[_Shard]:
    """Resolve ``plan`` on ``model`` for one rank and check every split; changes nothing.

    Args:
        model: the (quantized) model.
        world_size: number of ranks, >= 1.
        rank: this rank, ``0 <= rank < world_size``.
        plan: ``{module name or pattern: style}``; ``*`` matches one name component (``"model.layers.*.mlp.up_proj"``).
            Default: the model's own plan (transformers' ``model.tp_plan``). Entries for
            parameters (names ending in ``.weight``/``.bias``) are covered by their module's entry and skipped.

    Returns:
        One entry per module the plan names, in module order.

    Raises:
        TypeError: a bad argument, or a style applied to a module type it cannot shard (named).
        ValueError: an unknown style, a plan that names nothing (a given plan: an entry that names
            nothing), or a split that is not even
            (out_features / in_features / vocabulary not divisible by ``world_size``, a column
            cut inside a 32-weight block of a KbitLinear or inside a Hadamard-rotated layer's
            rotation block, an attention head cut in two), named. Also ``TypeError`` for an
            embedding subclass under ``embedding_rowwise`` (its own forward would be lost).
    """
    fmt.check_module(model, "model")
    for arg, value in (("world_size", world_size), ("rank", rank)):
        if isinstance(value, bool) or not isinstance(value, int):
            raise TypeError(f"{arg} must be an int, got {type(value).__name__}")
    if world_size < 1 or not 0 <= rank < world_size:
        raise ValueError(f"need world_size >= 1 and 0 <= rank < world_size, got world_size={world_size}, rank={rank}")
    given = plan is not None  # the caller's own rules: each must name a module (a model's default plan may cover more)
    if plan is None:
        plan = _model_plan(model)
        if not plan:
            raise ValueError(f"{type(model).__name__} has no tensor-parallel plan (tp_plan / config.base_model_tp_plan); pass plan=")
    if not isinstance(plan, dict) or not all(isinstance(k, str) and isinstance(v, str) for k, v in plan.items()):
        raise TypeError("plan must be a dict {module name or pattern: style name}")
    bad = sorted({style for style in plan.values() if style not in SUPPORTED_STYLES})
    if bad:
        raise ValueError(f"plan: unsupported tensor-parallel styles {bad}; supported: {list(SUPPORTED_STYLES)}")
    rules = [(key, _rule_regex(key), style) for key, style in plan.items() if not key.endswith((".weight", ".bias"))]
    modules = dict(model.named_modules())
    parents = {name: model.get_submodule(name.rpartition(".")[0]) for name in modules if name}
    shards: list[_Shard] = []
    for name, module in modules.items():
        style = next((s for _, regex, s in rules if regex.match(name)), None)
        if style is None:
            continue
        shards.append(_check_split(name, module, parents.get(name), style, world_size, rank))
    if not shards:
        raise ValueError(f"plan names no module of {type(model).__name__}: {sorted(plan)[:5]}")
    if given:  # a misspelled rule would leave its modules whole while their partners are split
        unmatched = [key for key, regex, _ in rules if not any(regex.match(name) for name in modules)]
        if unmatched:
            raise ValueError(f"plan entries {unmatched[:5]} name no module of {type(model).__name__}")
    return shards


def _check_split(name: str, module: nn.Module, parent: nn.Module | None, style: str, world: int, rank: int) -> _Shard:
    """The shard of ``module`` kept by ``rank`` under ``style``, or a named error."""
    if style in ("replicate", "replicated_with_grad_allreduce"):
        return _Shard(name, "replicate", None)
    if style == "embedding_rowwise":
        if type(module) is not nn.Embedding:  # a subclass's forward (a scaled embedding, say) would be lost
            raise TypeError(f"{name}: style {style!r} shards a plain nn.Embedding, got {type(module).__name__}")
        size, what = module.num_embeddings, "num_embeddings"
    else:
        if isinstance(module, KbitLinearSlice):
            raise TypeError(f"{name}: a fused projection (kbit_linear.fusion) cannot be sharded; call "
                            "kbit_linear.unfuse_projections(model) first")
        if not isinstance(module, (KbitLinear, nn.Linear)):
            raise TypeError(f"{name}: style {style!r} shards KbitLinear or nn.Linear layers, got {type(module).__name__}")
        size, what = (module.out_features, "out_features") if style in COLWISE_STYLES else (module.in_features, "in_features")
    if size % world:
        raise ValueError(f"{name}: {what}={size} does not split evenly over {world} ranks (style {style!r})")
    chunk = size // world
    if style in ROWWISE_STYLES and isinstance(module, KbitLinear) and world > 1 and chunk % fmt.BLOCK_SIZE:
        raise ValueError(
            f"{name}: in_features={size} over {world} ranks gives {chunk} per rank, not a multiple of "
            f"{fmt.BLOCK_SIZE}: a 32-weight block shares one scale and cannot be split (style {style!r})"
        )
    if (style in ROWWISE_STYLES and isinstance(module, KbitLinear) and module.hadamard_signs is not None and world > 1
            and not hadamard.keeps_blocks(rank * chunk, (rank + 1) * chunk, size)):
        raise ValueError(f"{name}: in_features={size} over {world} ranks gives {chunk} per rank, which cuts the "
                         f"layer's Hadamard rotation blocks of {hadamard.hadamard_block(size)} (style {style!r})")
    head_dim = getattr(parent, "head_dim", None)
    if style in COLWISE_STYLES and isinstance(head_dim, int) and head_dim > 0 and chunk % head_dim:
        raise ValueError(f"{name}: {what}={size} over {world} ranks gives {chunk} per rank, which cuts a head of {head_dim}")
    return _Shard(name, style, (rank * chunk, (rank + 1) * chunk))


# ---------------------------------------------------------------------------------------
# sharding a model
# ---------------------------------------------------------------------------------------


def shard_for_tensor_parallel(model: nn.Module, process_group: Any = None,
                             plan: dict[str, str] | None = None) -> dict[str, str]:
    """Shard a (quantized) model in place for tensor parallelism over ``process_group``.

    Call it on every rank of the group, with the same model on each (same weights, on this
    rank's device): typically right after ``from_pretrained(..., quantization_config=KbitConfig(...),
    device_map={"": local_rank})`` or :func:`kbit_linear.quantize_model`. Afterwards each rank runs
    the same forward / ``generate`` calls with the same inputs and gets the same outputs. Tied
    weights (an embedding and a ``lm_head`` sharing one matrix) stay tied when both are split the
    same way. Every split is checked before any module changes (:func:`shard_plan`).

    Args:
        model: the model; its KbitLinear / nn.Linear / nn.Embedding layers named by the plan are sharded.
        process_group: a ``torch.distributed`` process group (default: the default group).
        plan: ``{module name or pattern: style}`` (see the module docstring); default: the model's
            own ``tp_plan`` (from ``config.base_model_tp_plan``, plus the head and embedding rules).

    Returns:
        ``{module name: style}`` for every module the plan named.

    Raises:
        RuntimeError: ``torch.distributed`` is not initialized.
        TypeError / ValueError: see :func:`shard_plan`.
    """
    if not dist.is_available() or not dist.is_initialized():
        raise RuntimeError("shard_for_tensor_parallel needs torch.distributed initialized (torchrun + init_process_group)")
    if process_group is not None and not isinstance(process_group, dist.ProcessGroup):
        raise TypeError(f"process_group must be a torch.distributed ProcessGroup or None, got {type(process_group).__name__}")
    group = process_group if process_group is not None else dist.group.WORLD
    world, rank = dist.get_world_size(group), dist.get_rank(group)
    shards = shard_plan(model, world, rank, plan)
    # (id(full weight), start, stop) -> (full weight, its row slice); the full weight is held so
    # that its id is not reused by another tensor while the loop runs
    tied: dict[tuple[int, int, int], tuple[nn.Parameter, nn.Parameter]] = {}
    for shard in shards:
        module = model.get_submodule(shard.name)
        if shard.style == "replicate" or world == 1:
            continue
        if shard.style == "embedding_rowwise":
            _shard_embedding(module, shard.span, group, tied)
        elif shard.style in COLWISE_STYLES:
            _shard_colwise(module, shard.span, shard.style in _GATHER, group, tied)
        else:
            _shard_rowwise(module, shard.span, shard.style in _SPLIT_INPUT, group)
    return {shard.name: shard.style for shard in shards}


def _move_into(module: nn.Module, new: nn.Module) -> None:
    """Give ``module`` the tensors and sizes of ``new`` (same type), keeping the object (names, hooks, parents)."""
    for key, value in new._parameters.items():
        module._parameters[key] = value
    for key, value in new._buffers.items():
        module._buffers[key] = value
    module.in_features, module.out_features = new.in_features, new.out_features


def _shard_colwise(module: nn.Module, span: tuple[int, int], gather: bool, group: Any,
                   tied: dict[tuple[int, int, int], tuple[nn.Parameter, nn.Parameter]]) -> None:
    full = module.weight
    _move_into(module, slice_linear(module, rows=span))
    if not isinstance(module, KbitLinear):  # a dense head tied to an embedding split the same way
        module.weight = tied.setdefault((id(full), *span), (full, module.weight))[1]
    if gather:
        module.register_forward_hook(functools.partial(_gather_last_dim, group=group))


def _shard_rowwise(module: nn.Module, span: tuple[int, int], split_input: bool, group: Any) -> None:
    bias = module.bias
    _move_into(module, slice_linear(module, cols=span))
    # The bias is added once, after the partial outputs are summed: it leaves the layer's own
    # forward and lives beside it under ``tp_bias``.
    module.bias = None
    module.register_parameter("tp_bias", bias)
    if split_input:
        module.register_forward_pre_hook(functools.partial(_slice_input, span=span))
    module.register_forward_hook(functools.partial(_all_reduce_add_bias, group=group))


def _shard_embedding(module: nn.Embedding, span: tuple[int, int], group: Any,
                     tied: dict[tuple[int, int, int], tuple[nn.Parameter, nn.Parameter]]) -> None:
    full = module.weight
    rows = nn.Parameter(full.detach()[span[0]:span[1]].clone(), requires_grad=full.requires_grad)
    module.weight = tied.setdefault((id(full), *span), (full, rows))[1]
    module.num_embeddings = span[1] - span[0]
    if module.padding_idx is not None:  # only steers gradients; local to the shard or gone
        local = module.padding_idx - span[0]
        module.padding_idx = local if 0 <= local < module.num_embeddings else None
    module.__class__ = _VocabShardEmbedding
    module.vocab_start = span[0]
    module.process_group = group


class _VocabShardEmbedding(nn.Embedding):
    """An ``nn.Embedding`` holding rows ``[vocab_start, vocab_start + num_embeddings)`` of the
    vocabulary: ids outside give zeros, and the ranks' lookups are summed (exact: one non-zero term)."""

    vocab_start: int
    process_group: Any

    def forward(self, input: torch.Tensor) -> torch.Tensor:  # noqa: A002 (nn.Embedding's name)
        """Look up this rank's rows, zero the others, all-reduce."""
        local = input - self.vocab_start
        outside = (local < 0) | (local >= self.num_embeddings)
        out = F.embedding(local.masked_fill(outside, 0), self.weight, self.padding_idx, self.max_norm,
                          self.norm_type, self.scale_grad_by_freq, self.sparse)
        out = out.masked_fill(outside.unsqueeze(-1), 0)
        dist.all_reduce(out, group=self.process_group)
        return out

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, vocab_start={self.vocab_start}"


# ---------------------------------------------------------------------------------------
# hooks
# ---------------------------------------------------------------------------------------


def _gather_last_dim(module: nn.Module, args: tuple[Any, ...], output: torch.Tensor, *, group: Any) -> torch.Tensor:
    """Forward hook: all-gather the ranks' column blocks into the full-width output."""
    parts = [torch.empty_like(output) for _ in range(dist.get_world_size(group))]
    dist.all_gather(parts, output.contiguous(), group=group)
    return torch.cat(parts, dim=-1)


def _slice_input(module: nn.Module, args: tuple[Any, ...], *, span: tuple[int, int]) -> tuple[Any, ...]:
    """Forward pre-hook: keep this rank's columns of a full-width input."""
    return (args[0][..., span[0]:span[1]], *args[1:])


def _all_reduce_add_bias(module: nn.Module, args: tuple[Any, ...], output: torch.Tensor, *, group: Any) -> torch.Tensor:
    """Forward hook: sum the ranks' partial outputs, then add the bias once."""
    dist.all_reduce(output, group=group)
    bias = module.tp_bias
    return output if bias is None else output + bias.to(output.dtype)
