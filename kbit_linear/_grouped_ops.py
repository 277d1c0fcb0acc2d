"""Op schemas of the mixture-of-experts ops: the grouped kbit GEMM and the routing that feeds it.

``kbit_linear::grouped_gemm`` multiplies several row groups of ``x``, each by its own expert's
kbit weight, in one call: group q takes rows ``[row0, row0 + rows)`` of ``x`` through expert
``expert`` (``groups[:, q] = (expert, row0, rows)``, int32 on x's device) into the same rows of
the output; rows no group names are zero. The experts are stacked as :class:`KbitExperts` keeps
them (``packed [E, K_pad/64, N_pad/128, 128, 2, bits]``, ``absmax [E, ...]``, one codebook,
``tensor_scale [E]``). The groups stay on the device, so the CUDA kernel
(``kbit_decode_gemm_grouped``) needs no host sync; the reference below reads them on the host.
``max_rows`` bounds every group's row count (it picks the kernel: up to
:data:`DECODE_GROUP_ROWS` the decode kernel's schedule, above it the tensor-core kernel's where
the GPU has one, :func:`large_groups_supported`).

``kbit_linear::grouped_swiglu`` is the same through a gate_up weight (``2 * intermediate`` rows,
the gate rows then the up rows) followed by ``silu(gate) * up``: ``[rows, intermediate]``; the
CUDA backend fuses the activation into the grouped kernel's stores where it can. Its rows that
no group names are unspecified (the reference gives zeros; the CUDA kernels leave them as the
new tensor's memory held them, saving a fill of the whole output): it feeds the down
projection's ``grouped_gemm``, which reads the same groups' rows only.

``kbit_linear::combine_experts`` brings the down projection's rows (sorted-slot order) back to
the tokens: ``out[t] = sum_k top_k_weights[t, k] * y[position[t * top_k + k]]`` with
``route_experts``'s ``position`` (a permutation of the slots; a position outside them is an
indexing error in the reference, and adds nothing in the CUDA kernel, which reads no memory for
it), the weights rounded to ``y``'s dtype, products and sums in float32, rounded once.
Differentiable in ``y`` and ``top_k_weights`` (router training through frozen experts).

``kbit_linear::route_experts`` turns a router's choice ``top_k_index [T, top_k]`` into the
groups above: ``groups [3, G]`` listing the experts that received slots, ascending, as (expert,
first sorted position, slots), then ``(0, 0, 0)``; the slots (``s = token * top_k + k``) sorted
by expert id, stably (``perm``); the token each sorted position reads (``tokens``); and each
slot's sorted position (``position``, perm's inverse).
:func:`route_slots` is the sorting itself (counts, offsets, permutation), also used by the
module's reference forward.

``kbit_linear::experts_one_token`` is a whole experts call for one token (a decode step of batch
1): ``x [1, hidden]`` through its ``top_k`` experts' gate_up, SwiGLU and down, weighted and
summed. Its spec is the composition of the four ops above; the CUDA backend runs it as two
kernels with no routing step.

Same layer as :mod:`kbit_linear._ops` (op schemas, fake implementations with metadata checks,
the reference as the default implementation); the CUDA backend registers its kernels.
"""

from __future__ import annotations

import torch

from collections.abc import Callable

from . import _ops  # register_function_autograd, call_below_autograd
from . import format as fmt

_NS = "kbit_linear"
DECODE_GROUP_ROWS = 16
"""Groups of at most this many rows run on the decode kernel (its two n8 fragments); larger ones
need a device with a tensor-core grouped kernel (:func:`large_groups_supported`)."""

_large_groups: dict[str, Callable[[torch.device], bool]] = {}


def register_large_groups(device_type: str, fn: Callable[[torch.device], bool]) -> None:
    """Backends say here which of their devices run ``grouped_gemm`` with more than
    :data:`DECODE_GROUP_ROWS` rows per group without reading the groups on the host."""
    _large_groups[device_type] = fn


@torch.compiler.assume_constant_result  # a fact of the device: traced code takes the answer as a constant
def large_groups_supported(device: torch.device) -> bool:
    """Whether ``grouped_gemm`` on ``device`` takes groups of any size with no host sync (a
    backend registered a kernel for it); elsewhere such calls run the reference loop."""
    fn = _large_groups.get(device.type)
    return fn is not None and fn(device)

torch.library.define(
    f"{_NS}::route_experts",
    "(Tensor top_k_index, int num_experts, int groups) -> (Tensor, Tensor, Tensor, Tensor)",
)
torch.library.define(
    f"{_NS}::grouped_gemm",
    "(Tensor x, Tensor packed, Tensor absmax, Tensor codebook, Tensor tensor_scale, Tensor groups, int bits, "
    "int out_features, int max_rows) -> Tensor",
)
torch.library.define(
    f"{_NS}::combine_experts",
    "(Tensor y, Tensor position, Tensor top_k_weights) -> Tensor",
)
torch.library.define(
    f"{_NS}::grouped_swiglu",
    "(Tensor x, Tensor packed, Tensor absmax, Tensor codebook, Tensor tensor_scale, Tensor groups, int bits, "
    "int intermediate, int max_rows) -> Tensor",
)


def check_expert_weights(packed: torch.Tensor, absmax: torch.Tensor, codebook: torch.Tensor, tensor_scale: torch.Tensor,
                         bits: int, out_features: int, in_features: int, prefix: str = "", in_name: str = "the input") -> None:
    """Metadata checks of one projection's stacked expert weights (``prefix`` + ``packed``,
    ``absmax``, ``codebook``, ``tensor_scale``, as :class:`~kbit_linear.KbitExperts` keeps them)
    for ``out_features`` x ``in_features`` (``in_name``: what the in-features are of, for the
    message). The tensors are known to be tensors.

    Raises:
        TypeError / ValueError: naming the argument.
    """
    if packed.dtype not in (torch.int32, torch.uint8):
        raise TypeError(f"{prefix}packed must be int32 (planes) or uint8 (4- or 5-bit pair codes), got {packed.dtype}")
    per_block = fmt.block_entries(packed, bits)
    if packed.dim() != 6 or packed.shape[-1] != per_block or packed.shape[3:5] != (fmt.TILE_N, 2):
        raise ValueError(f"{prefix}packed must be {packed.dtype} [E, K_pad/64, N_pad/128, 128, 2, {per_block}] for bits={bits}, "
                         f"got {tuple(packed.shape)}")
    if absmax.dtype != torch.uint8 or tuple(absmax.shape) != tuple(packed.shape[:-1]):
        raise ValueError(f"{prefix}absmax must be uint8 {tuple(packed.shape[:-1])}, got {absmax.dtype} {tuple(absmax.shape)}")
    experts = packed.shape[0]
    if codebook.dtype != torch.float32 or tuple(codebook.shape) != (1 << bits,):
        raise TypeError(f"{prefix}codebook must be float32 [{1 << bits}], got {codebook.dtype} {tuple(codebook.shape)}")
    if tensor_scale.dtype != torch.float32 or tuple(tensor_scale.shape) != (experts,):
        raise TypeError(f"{prefix}tensor_scale must be float32 [{experts}], got {tensor_scale.dtype} {tuple(tensor_scale.shape)}")
    n_pad, k_pad = packed.shape[2] * fmt.TILE_N, packed.shape[1] * fmt.TILE_K
    if isinstance(out_features, bool) or not isinstance(out_features, int) or not n_pad - fmt.TILE_N < out_features <= n_pad:
        raise ValueError(f"out_features={out_features!r} does not match {prefix}packed padded to {n_pad} rows")
    if not k_pad - fmt.TILE_K < in_features <= k_pad:
        raise ValueError(f"{in_name} has {in_features} in-features; {prefix}packed is padded to {k_pad}")


def check_grouped_args(x: torch.Tensor, packed: torch.Tensor, absmax: torch.Tensor, codebook: torch.Tensor,
                       tensor_scale: torch.Tensor, groups: torch.Tensor, bits: int, out_features: int, max_rows: int) -> None:
    """Metadata checks of ``grouped_gemm`` (no pass over values; the groups are not read).

    Raises:
        TypeError / ValueError: naming the argument.
    """
    fmt.check_bits(bits)
    for name, t in (("x", x), ("packed", packed), ("absmax", absmax), ("codebook", codebook), ("tensor_scale", tensor_scale),
                    ("groups", groups)):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if not x.is_floating_point() or x.dim() != 2:
        raise ValueError(f"x must be a floating-point [rows, in_features] tensor, got {x.dtype} {tuple(x.shape)}")
    check_expert_weights(packed, absmax, codebook, tensor_scale, bits, out_features, x.shape[1], in_name="x")
    if groups.dtype != torch.int32 or groups.dim() != 2 or groups.shape[0] != 3:
        raise ValueError(f"groups must be int32 [3, G] (expert, first row, rows), got {groups.dtype} {tuple(groups.shape)}")
    if isinstance(max_rows, bool) or not isinstance(max_rows, int) or max_rows < 1:
        raise ValueError(f"max_rows must be a positive int, got {max_rows!r}")
    for name, t in (("packed", packed), ("absmax", absmax), ("codebook", codebook), ("tensor_scale", tensor_scale), ("groups", groups)):
        if t.device != x.device:
            raise ValueError(f"{name} is on {t.device}, x on {x.device}: all tensors must be on one device")


@torch.library.register_fake(f"{_NS}::grouped_gemm")
def _(x, packed, absmax, codebook, tensor_scale, groups, bits, out_features, max_rows):
    check_grouped_args(x, packed, absmax, codebook, tensor_scale, groups, bits, out_features, max_rows)
    return x.new_empty((x.shape[0], out_features))


def grouped_gemm_reference(x, packed, absmax, codebook, tensor_scale, groups, bits, out_features, max_rows):
    """The spec: each group through :func:`kbit_linear.format.matmul` (reads the groups on the host)."""
    check_grouped_args(x, packed, absmax, codebook, tensor_scale, groups, bits, out_features, max_rows)
    out = x.new_zeros((x.shape[0], out_features))
    for q, (e, row0, rows) in enumerate(groups.t().tolist()):
        if rows == 0:
            continue
        if not 0 <= e < packed.shape[0] or not 0 < rows <= max_rows or row0 < 0 or row0 + rows > x.shape[0]:
            raise ValueError(f"group {q} = (expert {e}, first row {row0}, rows {rows}) is outside the experts, "
                             f"max_rows={max_rows} or x's {x.shape[0]} rows")
        qw = fmt.KbitWeight(packed[e], absmax[e], codebook, tensor_scale[e : e + 1], bits, out_features, x.shape[1])
        out[row0 : row0 + rows] = fmt.matmul(x[row0 : row0 + rows], qw)
    return out


torch.library.impl(f"{_NS}::grouped_gemm", "default")(grouped_gemm_reference)  # not as a decorator: torch 2.11 binds its result (None) to the name


def check_intermediate(intermediate: int) -> None:
    """``intermediate`` of ``grouped_swiglu`` must be a positive int (ValueError naming it)."""
    if isinstance(intermediate, bool) or not isinstance(intermediate, int) or intermediate < 1:
        raise ValueError(f"intermediate must be a positive int, got {intermediate!r}")


@torch.library.register_fake(f"{_NS}::grouped_swiglu")
def _(x, packed, absmax, codebook, tensor_scale, groups, bits, intermediate, max_rows):
    check_intermediate(intermediate)
    check_grouped_args(x, packed, absmax, codebook, tensor_scale, groups, bits, 2 * intermediate, max_rows)
    return x.new_empty((x.shape[0], intermediate))


def grouped_swiglu_reference(x, packed, absmax, codebook, tensor_scale, groups, bits, intermediate, max_rows):
    """The spec of ``grouped_swiglu``: ``silu(gate) * up`` of ``grouped_gemm`` through a gate_up
    weight (``2 * intermediate`` rows: the gate rows, then the up rows), ``[rows, intermediate]``;
    rows no group names are unspecified (zero here)."""
    check_intermediate(intermediate)
    gate, up = grouped_gemm_reference(x, packed, absmax, codebook, tensor_scale, groups, bits, 2 * intermediate,
                                      max_rows).chunk(2, dim=-1)
    return torch.nn.functional.silu(gate) * up


torch.library.impl(f"{_NS}::grouped_swiglu", "default")(grouped_swiglu_reference)


def check_combine_args(y: torch.Tensor, position: torch.Tensor, top_k_weights: torch.Tensor) -> None:
    """Metadata checks of ``combine_experts`` (the positions themselves are not read).

    Raises:
        TypeError / ValueError: naming the argument.
    """
    for name, t in (("y", y), ("position", position), ("top_k_weights", top_k_weights)):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if not y.is_floating_point() or y.dim() != 2:
        raise ValueError(f"y must be a floating-point [slots, hidden] tensor, got {y.dtype} {tuple(y.shape)}")
    if not top_k_weights.is_floating_point() or top_k_weights.dim() != 2:
        raise ValueError(f"top_k_weights must be a floating-point [tokens, top_k] tensor, got {top_k_weights.dtype} "
                         f"{tuple(top_k_weights.shape)}")
    if position.dtype != torch.int64 or tuple(position.shape) != (top_k_weights.numel(),):
        raise ValueError(f"position must be int64 [tokens * top_k = {top_k_weights.numel()}], got {position.dtype} "
                         f"{tuple(position.shape)}")
    if y.shape[0] != position.shape[0]:
        raise ValueError(f"y has {y.shape[0]} rows, position {position.shape[0]} slots: one row per slot")
    for name, t in (("position", position), ("top_k_weights", top_k_weights)):
        if t.device != y.device:
            raise ValueError(f"{name} is on {t.device}, y on {y.device}: all tensors must be on one device")


@torch.library.register_fake(f"{_NS}::combine_experts")
def _(y, position, top_k_weights):
    check_combine_args(y, position, top_k_weights)
    return y.new_empty((top_k_weights.shape[0], y.shape[1]))


def combine_experts_reference(y, position, top_k_weights):
    """The spec of ``combine_experts``: the rows back in slot order, then the weighted sum over
    each token's ``top_k`` slots as one batched product (float32 products and sums, rounded once)."""
    check_combine_args(y, position, top_k_weights)
    tokens, top_k = top_k_weights.shape
    # a negative position is outside the rows too: past the end, so that indexing fails rather than wraps
    rows = y[torch.where(position < 0, y.shape[0], position)].view(tokens, top_k, y.shape[1])
    return torch.bmm(top_k_weights.reshape(tokens, 1, top_k).to(y.dtype), rows).view(tokens, y.shape[1])


torch.library.impl(f"{_NS}::combine_experts", "default")(combine_experts_reference)


_COMBINE = torch.ops.kbit_linear.combine_experts.default


class _CombineExperts(torch.autograd.Function):
    """The autograd of ``combine_experts`` (see :func:`kbit_linear._ops.register_function_autograd`):
    bilinear in ``y`` and ``top_k_weights``, so the tangent is the op on each tangent with the
    other operand, summed."""

    @staticmethod
    def forward(y, position, top_k_weights):
        return _ops.call_below_autograd(_COMBINE, y, position, top_k_weights)

    @staticmethod
    def setup_context(ctx, inputs, output):
        ctx.set_materialize_grads(False)  # an operand without a tangent reaches jvp as None, not zeros
        ctx.save_for_backward(*inputs)
        ctx.save_for_forward(*inputs)

    @staticmethod
    def backward(ctx, grad):
        return _combine_backward(ctx, grad)

    @staticmethod
    def jvp(ctx, y_t, position_t, top_k_weights_t):
        y, position, top_k_weights = ctx.saved_tensors
        # (each term rounds the weights to y's dtype as the forward does: the tangent passes
        # straight through that rounding, as the gradient does)
        out = None if y_t is None else _COMBINE(y_t, position, top_k_weights)
        if top_k_weights_t is not None:
            by_weights = _COMBINE(y, position, top_k_weights_t)
            out = by_weights if out is None else out + by_weights
        return out


def _combine_backward(ctx, grad):
    """d/dy: each slot's row gets its token's gradient times the slot's (rounded) weight; d/dw:
    the gradient dotted with the slot's row. Sums in float32, as the forward's."""
    if grad is None:  # (grads are not materialized: see _CombineExperts.setup_context)
        return None, None, None
    y, position, top_k_weights = ctx.saved_tensors
    tokens, top_k = top_k_weights.shape
    g = grad.float().unsqueeze(1)  # [T, 1, H]
    grad_y = grad_w = None
    if ctx.needs_input_grad[0]:
        w = top_k_weights.to(y.dtype).float().unsqueeze(-1)  # [T, top_k, 1]
        grad_y = torch.zeros(y.shape, dtype=torch.float32, device=y.device)
        grad_y.index_add_(0, position, (w * g).reshape(-1, y.shape[1]))
        grad_y = grad_y.to(y.dtype)
    if ctx.needs_input_grad[2]:
        rows = y[position].view(tokens, top_k, y.shape[1]).float()
        grad_w = (rows * g).sum(-1).to(top_k_weights.dtype)
    return grad_y, None, grad_w


_ops.register_function_autograd(f"{_NS}::combine_experts", _CombineExperts)


# ---------------------------------------------------------------------------------------
# routing
# ---------------------------------------------------------------------------------------


def route_slots(top_k_index: torch.Tensor, num_experts: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The slots of a routing decision sorted by expert: ``(counts, offsets, perm)``.

    ``counts`` int32 ``[E]`` (slots per expert), ``offsets`` int32 ``[E + 1]`` (exclusive sums:
    expert e's slots are ``perm[offsets[e]:offsets[e + 1]]``; "no expert" slots, id ``E``, follow
    ``offsets[E]``), ``perm`` int64 ``[T * top_k]`` (a stable sort of the slot numbers by id).
    Torch ops that need no host sync; ids are not checked here."""
    ids = top_k_index.reshape(-1).to(torch.int64)
    perm = torch.sort(ids, stable=True).indices
    # scatter_add rather than bincount: bincount on CUDA reads its size from the data (a sync)
    counts = torch.zeros(num_experts + 1, dtype=torch.int32, device=ids.device)
    counts.scatter_add_(0, ids, torch.ones_like(ids, dtype=torch.int32))
    counts = counts[:num_experts]
    offsets = torch.zeros(num_experts + 1, dtype=torch.int32, device=ids.device)
    offsets[1:] = torch.cumsum(counts, 0, dtype=torch.int32)
    return counts, offsets, perm


def check_route_args(top_k_index: torch.Tensor, num_experts: int, groups: int) -> None:
    """Metadata checks of ``route_experts`` (the ids themselves are not read)."""
    if not isinstance(top_k_index, torch.Tensor) or top_k_index.dim() != 2 or top_k_index.is_floating_point() \
            or top_k_index.is_complex() or top_k_index.dtype == torch.bool:
        raise TypeError(f"top_k_index must be an integer [tokens, top_k] tensor, got {getattr(top_k_index, 'dtype', type(top_k_index))}")
    if isinstance(num_experts, bool) or not isinstance(num_experts, int) or num_experts < 1:
        raise ValueError(f"num_experts must be a positive int, got {num_experts!r}")
    if isinstance(groups, bool) or not isinstance(groups, int) or not 1 <= groups <= num_experts:
        raise ValueError(f"groups must be an int in 1..num_experts={num_experts}, got {groups!r}")
    if groups < min(num_experts, top_k_index.numel()):
        raise ValueError(f"groups={groups} is fewer than the experts {top_k_index.numel()} slots can reach")


@torch.library.register_fake(f"{_NS}::route_experts")
def _(top_k_index, num_experts, groups):
    check_route_args(top_k_index, num_experts, groups)
    slots = top_k_index.numel()
    return (top_k_index.new_empty((3, groups), dtype=torch.int32),
            *(top_k_index.new_empty((slots,), dtype=torch.int64) for _ in range(3)))


def route_experts_reference(top_k_index, num_experts, groups):
    """The spec of ``route_experts`` in torch ops (no host sync). Ids outside ``0..E-1`` count
    as "no expert"."""
    check_route_args(top_k_index, num_experts, groups)
    top_k = top_k_index.shape[1]
    ids = top_k_index.to(torch.int64)
    ids = torch.where((ids >= 0) & (ids < num_experts), ids, num_experts)
    counts, offsets, perm = route_slots(ids, num_experts)
    hit = counts > 0
    order = torch.argsort((~hit).to(torch.int8), stable=True)[:groups]  # hit experts first, ascending
    keep = hit[order]
    table = torch.stack((order.to(torch.int32), offsets[order], counts[order])) * keep.to(torch.int32)
    position = torch.empty_like(perm).scatter_(0, perm, torch.arange(perm.numel(), device=perm.device))
    return table.contiguous(), perm, perm // top_k, position



torch.library.impl(f"{_NS}::route_experts", "default")(route_experts_reference)  # not as a decorator (as above)

# ---------------------------------------------------------------------------------------
# one token through the experts (a decode step of batch 1)
# ---------------------------------------------------------------------------------------

torch.library.define(
    f"{_NS}::experts_one_token",
    "(Tensor x, Tensor top_k_index, Tensor top_k_weights, Tensor gate_up_packed, Tensor gate_up_absmax, "
    "Tensor gate_up_codebook, Tensor gate_up_tensor_scale, Tensor down_packed, Tensor down_absmax, Tensor down_codebook, "
    "Tensor down_tensor_scale, int bits, int intermediate) -> Tensor",
)


def check_one_token_args(x, top_k_index, top_k_weights, gate_up_packed, gate_up_absmax, gate_up_codebook, gate_up_tensor_scale,
                         down_packed, down_absmax, down_codebook, down_tensor_scale, bits, intermediate) -> None:
    """Metadata checks of ``experts_one_token`` (no pass over values: the ids are not read).

    Raises:
        TypeError / ValueError: naming the argument.
    """
    fmt.check_bits(bits)
    named = (("x", x), ("top_k_index", top_k_index), ("top_k_weights", top_k_weights), ("gate_up_packed", gate_up_packed),
             ("gate_up_absmax", gate_up_absmax), ("gate_up_codebook", gate_up_codebook),
             ("gate_up_tensor_scale", gate_up_tensor_scale), ("down_packed", down_packed), ("down_absmax", down_absmax),
             ("down_codebook", down_codebook), ("down_tensor_scale", down_tensor_scale))
    for name, t in named:
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if not x.is_floating_point() or x.dim() != 2 or x.shape[0] != 1:
        raise ValueError(f"x must be a floating-point [1, hidden] tensor (one token), got {x.dtype} {tuple(x.shape)}")
    if top_k_index.dim() != 2 or top_k_index.shape[0] != 1 or top_k_index.shape[1] < 1 or top_k_index.is_floating_point() \
            or top_k_index.is_complex() or top_k_index.dtype == torch.bool:
        raise ValueError(f"top_k_index must be an integer [1, top_k] tensor, got {top_k_index.dtype} {tuple(top_k_index.shape)}")
    if not top_k_weights.is_floating_point() or tuple(top_k_weights.shape) != tuple(top_k_index.shape):
        raise ValueError(f"top_k_weights must be a floating-point {tuple(top_k_index.shape)} tensor, got {top_k_weights.dtype} "
                         f"{tuple(top_k_weights.shape)}")
    check_intermediate(intermediate)
    hidden = x.shape[1]
    check_expert_weights(gate_up_packed, gate_up_absmax, gate_up_codebook, gate_up_tensor_scale, bits, 2 * intermediate, hidden,
                         prefix="gate_up_", in_name="x")
    check_expert_weights(down_packed, down_absmax, down_codebook, down_tensor_scale, bits, hidden, intermediate, prefix="down_",
                         in_name=f"intermediate={intermediate}")
    if down_packed.shape[0] != gate_up_packed.shape[0]:
        raise ValueError(f"down_packed holds {down_packed.shape[0]} experts, gate_up_packed {gate_up_packed.shape[0]}")
    for name, t in named[1:]:
        if t.device != x.device:
            raise ValueError(f"{name} is on {t.device}, x on {x.device}: all tensors must be on one device")


@torch.library.register_fake(f"{_NS}::experts_one_token")
def _(x, top_k_index, top_k_weights, gate_up_packed, gate_up_absmax, gate_up_codebook, gate_up_tensor_scale, down_packed,
      down_absmax, down_codebook, down_tensor_scale, bits, intermediate):
    check_one_token_args(x, top_k_index, top_k_weights, gate_up_packed, gate_up_absmax, gate_up_codebook, gate_up_tensor_scale,
                         down_packed, down_absmax, down_codebook, down_tensor_scale, bits, intermediate)
    return x.new_empty(x.shape)


def experts_one_token_composed(x, top_k_index, top_k_weights, gate_up_packed, gate_up_absmax, gate_up_codebook,
                               gate_up_tensor_scale, down_packed, down_absmax, down_codebook, down_tensor_scale, bits, intermediate):
    """The spec of ``experts_one_token``: one token (``x [1, hidden]``) through its ``top_k``
    experts, ``sum_k top_k_weights[0, k] * down(silu(gate(x)) * up(x))`` of expert
    ``top_k_index[0, k]`` (ids outside ``0..E-1`` add nothing), ``[1, hidden]`` in x's dtype, with
    the roundings of the grouped ops it is made of here: ``route_experts``, ``grouped_swiglu``,
    ``grouped_gemm`` and ``combine_experts``. A backend runs this composition where its one-token
    kernels do not take the call (no host sync either way)."""
    check_one_token_args(x, top_k_index, top_k_weights, gate_up_packed, gate_up_absmax, gate_up_codebook, gate_up_tensor_scale,
                         down_packed, down_absmax, down_codebook, down_tensor_scale, bits, intermediate)
    return compose_one_token(x, top_k_index, top_k_weights, gate_up_packed, gate_up_absmax, gate_up_codebook,
                             gate_up_tensor_scale, down_packed, down_absmax, down_codebook, down_tensor_scale, bits, intermediate)


def compose_one_token(x, top_k_index, top_k_weights, gate_up_packed, gate_up_absmax, gate_up_codebook, gate_up_tensor_scale,
                      down_packed, down_absmax, down_codebook, down_tensor_scale, bits, intermediate):
    """:func:`experts_one_token_composed` on arguments that passed :func:`check_one_token_args`
    (a backend's fallback, which checked them already)."""
    top_k, experts = top_k_index.shape[1], gate_up_packed.shape[0]
    groups, _, _, position = torch.ops.kbit_linear.route_experts(top_k_index, experts, min(experts, top_k))
    rows = x.expand(top_k, -1)  # every slot reads the token's row
    h = torch.ops.kbit_linear.grouped_swiglu(rows, gate_up_packed, gate_up_absmax, gate_up_codebook, gate_up_tensor_scale, groups,
                                             bits, intermediate, top_k)
    y = torch.ops.kbit_linear.grouped_gemm(h, down_packed, down_absmax, down_codebook, down_tensor_scale, groups, bits,
                                           x.shape[1], top_k)
    return torch.ops.kbit_linear.combine_experts(y, position, top_k_weights)


torch.library.impl(f"{_NS}::experts_one_token", "default")(experts_one_token_composed)


# ---------------------------------------------------------------------------------------
# autograd of the expert products: none. The ops below refuse a gradient or tangent loudly
# (an op without an Autograd kernel gave a zero tangent under torch.func.jvp, without a word).
# KbitExperts runs its differentiable reference when its input needs either; when only the
# routing weights need a gradient it stays on these ops, and combine_experts carries it.
# ---------------------------------------------------------------------------------------


def _refusal(op: str, what: str) -> str:
    return (f"{what} through kbit_linear::{op}: the grouped expert ops are not differentiable; call KbitExperts "
            "(its forward runs its differentiable reference when its input needs a gradient or tangent)")


def _register_not_differentiable(name: str) -> None:
    """Give the op ``name`` an Autograd kernel that raises ``NotImplementedError`` naming it when
    an input needs a gradient (grad mode on and an input requiring grad) or carries a
    forward-mode tangent; other calls, under a forward-mode level too, run the op."""
    qualname = f"{_NS}::{name}"
    op = getattr(torch.ops.kbit_linear, name).default

    class NotDifferentiable(torch.autograd.Function):
        """Applied only under a forward-mode level with no gradient needed (the kernel refuses
        the others): its jvp refuses a tangent."""

        @staticmethod
        def forward(*args):
            return _ops.call_below_autograd(op, *args)

        @staticmethod
        def setup_context(ctx, inputs, output):
            ctx.set_materialize_grads(False)  # an input without a tangent reaches jvp as None

        @staticmethod
        def backward(ctx, *grads):  # (never recorded: the kernel refuses calls that need a gradient)
            raise NotImplementedError(_refusal(name, "gradients"))

        @staticmethod
        def jvp(ctx, *tangents):
            if any(t is not None for t in tangents):
                raise NotImplementedError(_refusal(name, "forward-mode AD"))
            return None

    _ops.register_function_autograd(qualname, NotDifferentiable, refuse_gradients=_refusal(name, "gradients"))


for _name in ("grouped_gemm", "grouped_swiglu", "experts_one_token"):
    _register_not_differentiable(_name)
