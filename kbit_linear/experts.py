"""``KbitExperts``: the experts of a mixture-of-experts layer with every projection in the kbit format.

transformers 5.x keeps the experts of an MoE block in one module with 3-D parameters
(``MixtralExperts``, ``Qwen2MoeExperts``, ``Qwen3MoeExperts``, ``OlmoeExperts``, ...):
``gate_up_proj`` ``[E, 2I, H]`` (rows ``[0, I)`` the gate, ``[I, 2I)`` the up projection) and
``down_proj`` ``[E, H, I]``, called as ``experts(hidden_states, top_k_index, top_k_weights)``.
:class:`KbitExperts` replaces such a module: same call, same result up to the quantization of the
weights.

Stored tensors, per projection ``p`` in ``("gate_up_proj", "down_proj")`` with ``N x K`` =
``2I x H`` (gate_up) or ``H x I`` (down), ``K_pad`` = K rounded up to 64, ``N_pad`` = N rounded
up to 128 (:func:`kbit_linear.format.tiled_shapes`)::

    p                 int32   [E, K_pad/64, N_pad/128, 128, 2, bits]  bit-planes, Parameter(requires_grad=False)
    p_absmax          uint8   [E, K_pad/64, N_pad/128, 128, 2]        E4M4 block scales
    p_codebook        float32 [2**bits]                               shared by the E experts of p
    p_tensor_scale    float32 [E]                                     one power of two per expert

On a CUDA device a 4- or 5-bit ``p`` is held as uint8 pair codes ``[..., 2, 16 or 20]`` (the same bytes,
:mod:`kbit_linear.weight_layout`); the state dict gives planes.

One contiguous buffer per projection, experts back to back at a fixed stride::

    gate_up_proj (int32 words)
    +--------------------------+--------------------------+-- ... --+--------------------------+
    | expert 0                 | expert 1                 |         | expert E-1               |
    | [kt][nt][128 rows][2][b] | [kt][nt][128 rows][2][b] |         | [kt][nt][128 rows][2][b] |
    +--------------------------+--------------------------+-- ... --+--------------------------+
    0                          S                          2S                    S = K_pad/64 * N_pad/128 * 128 * 2 * bits

``p[e]`` is exactly the ``weight`` of a :class:`~kbit_linear.KbitLinear` (same tiles, same zero
padding; with ``p_absmax[e]``, ``p_codebook`` and ``p_tensor_scale[e:e+1]``), so every
single-matrix kernel runs one expert at the word offset ``e * S`` without repacking, and a grouped
kernel's work item (expert e, n-tile nt, m-tile) finds k-tile kt of its weight tile at
``e * S + (kt * N_pad/128 + nt) * 128 * 2 * bits`` (scales: the same without the ``* bits``).
For a fused SwiGLU epilogue, gate rows ``[128 t, 128 t + 128)`` pair with up rows
``I + [128 t, 128 t + 128)``: n-tile ``t + I/128`` when I is a multiple of 128 (true of every
shipped family's real shapes; other I straddle two tiles).

The forward pass here is the reference the grouped CUDA kernel will be tested against: tokens are
routed by :func:`route_tokens` (counts, offsets, a stable permutation sorted by expert id), each
expert that receives tokens runs its gate_up and down projections through the
``kbit_linear::gemm`` op (the CUDA kernels on a GPU, the CPU backend elsewhere), with
``act_fn(gate) * up`` between them; results are scaled by their routing weight and summed per
token in float32. Today that is two gemm launches per expert hit.

Which transformers modules qualify: :func:`experts_layout_problem` (the one rule, used by
``quantize_model``, the transformers plug-in and ``load_into``).
"""

from __future__ import annotations

from typing import Any, Callable, NamedTuple

import torch
from torch import nn

from . import _grouped_ops  # kbit_linear::grouped_gemm
from . import _ops  # the op schemas and the gemm entry point
from . import codebooks
from . import format as fmt
from . import weight_layout
from .linear import (_apply_keeping_float32, _cast_dtype, _check_features, _check_layout, _check_state_dtypes,
                     _check_state_values, _record_layout, _refuse_integer_casts)
from .quantizer import KbitTensors, quantize_weight

__all__ = [
    "PROJECTIONS",
    "TENSOR_SUFFIXES",
    "ExpertRouting",
    "KbitExperts",
    "route_tokens",
    "quantize_experts_weight",
    "experts_layout_problem",
    "looks_like_experts",
]

PROJECTIONS = ("gate_up_proj", "down_proj")
"""The quantized projections of an experts module, in the order they are applied."""
TENSOR_SUFFIXES = {"packed": "", "absmax": "_absmax", "codebook": "_codebook", "tensor_scale": "_tensor_scale"}
"""Field of :class:`~kbit_linear.quantizer.KbitTensors` -> suffix of its attribute after the
projection's name (``gate_up_proj``, ``gate_up_proj_absmax``, ...)."""

_ACTIVATION_DTYPES = (torch.float32, torch.float16, torch.bfloat16, torch.float64)  # forward's (not float8: no silu, no promotion)
_DEQUANTIZE = torch.ops.kbit_linear.dequantize.default
_FLOAT32_BUFFERS = tuple(p + s for p in PROJECTIONS for s in ("_codebook", "_tensor_scale"))

# The layout flags of transformers' ``@use_experts_implementation`` that KbitExperts implements;
# any other value changes the math (transposed weights, biases, interleaved gate/up, no gate, a norm
# after each expert) and the module is left dense.
_SUPPORTED_FLAGS = {
    "has_gate": True,
    "is_concatenated": True,
    "is_transposed": False,
    "has_bias": False,
    "has_post_expert_norm": False,
}


# ---------------------------------------------------------------------------------------
# routing
# ---------------------------------------------------------------------------------------


class ExpertRouting(NamedTuple):
    """Tokens grouped by expert: what :func:`route_tokens` returns.

    A *slot* is one (token, k) pair, numbered ``token * top_k + k`` (the flattened
    ``top_k_index``).

    Attributes:
        counts: int32 ``[E]``: slots routed to each expert.
        offsets: int32 ``[E + 1]``: ``offsets[0] = 0``, ``offsets[e + 1] = offsets[e] + counts[e]``;
            expert e's slots are ``perm[offsets[e]:offsets[e + 1]]``. Slots with the id ``E``
            (no expert) follow ``offsets[E]``.
        perm: int64 ``[T * top_k]``: slot numbers sorted by expert id, stable (ascending slot
            number within an expert). Token of a slot: ``slot // top_k``.
    """

    counts: torch.Tensor
    offsets: torch.Tensor
    perm: torch.Tensor


def route_tokens(top_k_index: torch.Tensor, num_experts: int) -> ExpertRouting:
    """Group the (token, k) slots of a routing decision by expert: counts, offsets, permutation.

    What the grouped kernel's routing step computes on the device (a histogram, an exclusive scan
    and a stable counting sort), written with torch ops that need no host sync.

    Args:
        top_k_index: integer ``[T, top_k]``, expert ids in ``[0, num_experts]``; ``num_experts``
            marks a slot that goes to no expert (transformers' convention). Its values are not
            checked here (the caller validates once; that needs a host sync), its type and shape are.
        num_experts: E.

    Returns:
        :class:`ExpertRouting` on ``top_k_index``'s device.
    """
    if not isinstance(top_k_index, torch.Tensor) or top_k_index.dim() != 2 or top_k_index.is_floating_point():
        raise TypeError(f"top_k_index must be an integer [tokens, top_k] tensor, got "
                        f"{type(top_k_index).__name__ if not isinstance(top_k_index, torch.Tensor) else tuple(top_k_index.shape)}")
    if isinstance(num_experts, bool) or not isinstance(num_experts, int) or num_experts < 1:
        raise ValueError(f"num_experts must be a positive int, got {num_experts!r}")
    counts, offsets, perm = _grouped_ops.route_slots(top_k_index, num_experts)
    return ExpertRouting(counts, offsets, perm)


# ---------------------------------------------------------------------------------------
# which modules qualify
# ---------------------------------------------------------------------------------------


def _is_silu(act_fn: Any) -> bool:
    """Whether ``act_fn`` is plain SiLU (torch's module or transformers' ``SiLUActivation``), the
    activation ``kbit_linear::grouped_swiglu`` fuses."""
    return isinstance(act_fn, nn.SiLU) or type(act_fn).__name__ in ("SiLUActivation", "SiLU")


def looks_like_experts(module: nn.Module) -> bool:
    """``True`` for a module that holds experts as 3-D weights: a class named ``*Expert*`` with a
    floating-point 3-D parameter of its own, or one with 3-D ``gate_up_proj``/``down_proj``.

    These are the modules a model patch reports on (converted, or left dense with a reason); an
    experts container of ``nn.Linear`` layers is not one (its layers are swapped one by one).

    Raises:
        TypeError: ``module`` is not an ``nn.Module``.
    """
    fmt.check_module(module)
    own = dict(module.named_parameters(recurse=False))
    if any(own.get(p) is not None and own[p].dim() == 3 for p in PROJECTIONS):
        return True
    return "expert" in type(module).__name__.lower() and any(p.dim() == 3 and p.is_floating_point() for p in own.values())


def _code_key(fn: Callable[..., Any]) -> tuple:
    """What a function computes, without its name or line numbers."""
    c = fn.__code__
    return (c.co_code, c.co_consts, c.co_names, c.co_varnames, c.co_freevars, c.co_cellvars)


def _standard_forward_key() -> tuple | None:
    """The code of transformers' standard experts loop (MixtralExperts's eager forward, which
    Qwen2-MoE, Qwen3-MoE, OLMoE and most other families share), or ``None`` without it."""
    try:
        from transformers.models.mixtral.modeling_mixtral import MixtralExperts
    except ImportError:  # pragma: no cover - transformers is a dependency
        return None
    original = getattr(MixtralExperts.forward, "__wrapped__", None)
    return None if original is None else _code_key(original)


def experts_layout_problem(module: nn.Module) -> str | None:
    """Why :class:`KbitExperts` cannot stand in for ``module``, or ``None`` when it can.

    The rule: ``module`` is a transformers experts class made with ``@use_experts_implementation``
    whose eager forward is the same code as transformers' standard loop (``MixtralExperts``:
    ``act_fn(gate) * up`` over ``gate_up_proj`` ``[E, 2I, H]`` split in halves, ``down_proj``
    ``[E, H, I]``, weighted by ``top_k_weights``, summed per token), with the decorator's default
    layout (no bias, not transposed, gate and up concatenated, no norm after each expert), the
    default gate, no expert parallelism, and floating-point weights of those shapes. In
    transformers 5.23: Mixtral, Qwen2-MoE, Qwen3-MoE (and Qwen3-Next, Qwen3-VL-MoE), OLMoE,
    DeepSeek-V2/V3, GLM-4-MoE, Granite-MoE, Jamba, PhiMoE and others generated from the same code.
    Anything else is left dense: quantizing a layout whose math differs would be silently wrong.

    Raises:
        TypeError: ``module`` is not an ``nn.Module``.
    """
    fmt.check_module(module)
    if isinstance(module, KbitExperts):
        return "already a KbitExperts"
    cls = type(module)
    original = getattr(cls.forward, "__wrapped__", None)
    if original is None or not hasattr(module, "has_gate"):
        return f"{cls.__name__} is not a transformers experts class (@use_experts_implementation); its layout is unknown"
    for flag, want in _SUPPORTED_FLAGS.items():
        # A flag the installed transformers does not set yet means its default layout (= want).
        if getattr(module, flag, want) is not want:
            return f"{cls.__name__} has {flag}={getattr(module, flag)!r} (supported: {want})"
    if getattr(module, "_is_expert_parallel", False):
        return f"{cls.__name__} is sharded for expert parallelism"
    gate = getattr(cls, "_apply_gate", None)
    if getattr(gate, "__qualname__", None) != "_default_apply_gate":
        return f"{cls.__name__} has its own gate function ({getattr(gate, '__qualname__', gate)!r}), not act_fn(gate) * up"
    if _code_key(original) != _standard_forward_key():
        return f"{cls.__name__}'s forward is not transformers' standard experts loop"
    if not callable(getattr(module, "act_fn", None)):
        return f"{cls.__name__} has no act_fn"
    gu, down = getattr(module, "gate_up_proj", None), getattr(module, "down_proj", None)
    for name, w in (("gate_up_proj", gu), ("down_proj", down)):
        if not isinstance(w, torch.Tensor) or w.dim() != 3 or w.numel() == 0:
            return f"{cls.__name__}.{name} is not a non-empty 3-D tensor"
        if not w.is_floating_point():
            return f"{cls.__name__}.{name} has dtype {w.dtype}, not floating point (already quantized?)"
    e, two_i, h = gu.shape
    if two_i % 2 or tuple(down.shape) != (e, h, two_i // 2):
        return f"{cls.__name__} has gate_up_proj {tuple(gu.shape)} and down_proj {tuple(down.shape)}, not [E, 2I, H] and [E, H, I]"
    if getattr(module, "num_experts", e) != e:
        return f"{cls.__name__}.num_experts={module.num_experts} does not match its {e} expert weights"
    return None


# ---------------------------------------------------------------------------------------
# quantizing a stack of expert matrices
# ---------------------------------------------------------------------------------------


def quantize_experts_weight(
    weight: torch.Tensor,
    bits: int,
    codebook: torch.Tensor | str | None = None,
    *,
    scale_search: bool = False,
    name: str = "weight",
    device: torch.device | str | None = None,
) -> KbitTensors:
    """Quantize ``E`` matrices ``[E, N, K]`` expert by expert into one stacked set of kbit tensors.

    Each ``weight[e]`` goes through :func:`kbit_linear.quantizer.quantize_weight` (same checks,
    same options, same ops) and is copied into its slot of the stacked result, so only one
    expert's temporaries (and, with ``device``, one expert's copy) exist at a time. On the meta
    device the result is meta.

    Args:
        weight: floating-point ``[E, N, K]`` (``N`` out-features, ``K`` in-features per expert).
        bits: index width, 2..5.
        codebook: ``[2**bits]`` strictly increasing floats in [-1, 1] (default: normal-float),
            shared by every expert; ``"fitted"``: levels fitted to all the experts' weights.
        scale_search: least-error block scales (see ``quantize_weight``).
        name: what to call ``weight`` in error messages.
        device: where to quantize and keep the result (default: ``weight``'s device).

    Returns:
        :class:`~kbit_linear.quantizer.KbitTensors` with ``packed`` int32
        ``[E, K_pad/64, N_pad/128, 128, 2, bits]``, ``absmax`` uint8 ``[E, K_pad/64, N_pad/128,
        128, 2]``, ``codebook`` float32 ``[2**bits]``, ``tensor_scale`` float32 ``[E]``.

    Raises:
        TypeError / ValueError: as ``quantize_weight``, and for a weight that is not 3-D; the
            message names ``name`` and the expert.
    """
    if not isinstance(weight, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(weight).__name__}")
    if weight.dim() != 3 or weight.numel() == 0:
        raise ValueError(f"{name} must be a non-empty 3-D [experts, out_features, in_features] tensor, got shape {tuple(weight.shape)}")
    fmt.check_bits(bits)
    e, n, k = weight.shape
    device = weight.device if device is None else fmt.check_device(device)
    # one set of levels for all the experts ("fitted": on all of them, a sample of rows)
    cb = codebooks.resolve_codebook_option(codebook, weight.detach().reshape(e * n, k), bits, scale_search=scale_search,
                                           device=device)
    packed_shape, absmax_shape = fmt.tiled_shapes(n, k, bits)
    packed = torch.empty((e, *packed_shape), dtype=torch.int32, device=device)
    absmax = torch.empty((e, *absmax_shape), dtype=torch.uint8, device=device)
    tensor_scale = torch.empty(e, dtype=torch.float32, device=device)
    for i in range(e):
        w = weight[i].detach().to(device)
        q = quantize_weight(w, bits, cb, scale_search=scale_search, name=f"{name}[expert {i}]")
        packed[i].copy_(q.packed)
        absmax[i].copy_(q.absmax)
        tensor_scale[i : i + 1].copy_(q.tensor_scale)
        del q, w
    return KbitTensors(packed, absmax, cb, tensor_scale)


# ---------------------------------------------------------------------------------------
# the module
# ---------------------------------------------------------------------------------------


class KbitExperts(nn.Module):
    """The experts of an MoE block, gate_up and down projections stored as kbit codebook indices.

    ``forward(hidden_states, top_k_index, top_k_weights)`` computes, for every token ``t``,
    ``sum_k w[t, k] * down_e(act_fn(gate_e(x_t)) * up_e(x_t))`` with ``e = top_k_index[t, k]``,
    as transformers' experts modules do. The constructor allocates zero tensors of the right shapes
    (an all-zero weight), so a module can be built on the meta device and filled by
    ``load_state_dict``; :meth:`from_experts` quantizes a transformers experts module. The tensor
    layout is in this module's docstring.

    Args:
        num_experts: E, a positive int.
        hidden_dim: H (in-features of gate_up, out-features of down).
        intermediate_dim: I (gate_up has ``2 I`` out-features, down has ``I`` in-features).
        bits: index width, 2..5.
        act_fn: the activation applied to the gate half (a module, e.g. transformers'
            ``ACT2FN["silu"]``; default ``nn.SiLU()``).
        codebook: ``[2**bits]`` strictly increasing floats in [-1, 1] (default: normal-float),
            used for both projections.
        device: where the tensors live (``"meta"`` allocates nothing).
    """

    num_experts: int
    hidden_dim: int
    intermediate_dim: int
    bits: int

    def __init__(
        self,
        num_experts: int,
        hidden_dim: int,
        intermediate_dim: int,
        bits: int = 4,
        act_fn: Callable[[torch.Tensor], torch.Tensor] | None = None,
        codebook: torch.Tensor | None = None,
        device: torch.device | str | None = None,
    ) -> None:
        super().__init__()
        self.num_experts = _check_features("num_experts", num_experts)
        self.hidden_dim = _check_features("hidden_dim", hidden_dim)
        self.intermediate_dim = _check_features("intermediate_dim", intermediate_dim)
        self.bits = fmt.check_bits(bits)
        device = fmt.check_device(device)
        if act_fn is None:
            act_fn = nn.SiLU()
        if not callable(act_fn):
            raise TypeError(f"act_fn must be callable (an activation module), got {type(act_fn).__name__}")
        self.act_fn = act_fn
        for proj in PROJECTIONS:
            n, k = self.projection_shape(proj)
            packed_shape, absmax_shape = fmt.tiled_shapes(n, k, bits)
            packed = torch.zeros((num_experts, *packed_shape), dtype=torch.int32, device=device)
            self.register_parameter(proj, nn.Parameter(packed, requires_grad=False))
            self.register_buffer(proj + "_absmax", torch.zeros((num_experts, *absmax_shape), dtype=torch.uint8, device=device))
            self.register_buffer(proj + "_codebook", fmt.resolve_codebook(codebook, bits, packed.device))
            self.register_buffer(proj + "_tensor_scale", torch.ones(num_experts, dtype=torch.float32, device=device))
        # per projection: (stamp of the stacked tensors, per-expert views); see _expert_views
        self._views: dict[str, tuple[tuple, list[tuple[torch.Tensor, ...]]]] = {}

    def projection_shape(self, proj: str) -> tuple[int, int]:
        """``(out_features, in_features)`` of one expert's matrix of ``proj``."""
        if proj == "gate_up_proj":
            return 2 * self.intermediate_dim, self.hidden_dim
        if proj == "down_proj":
            return self.hidden_dim, self.intermediate_dim
        raise ValueError(f"proj must be one of {PROJECTIONS}, got {proj!r}")

    def projection_tensors(self, proj: str) -> KbitTensors:
        """The stacked tensors of ``proj`` (``packed``, ``absmax``, ``codebook``, ``tensor_scale``; shared, not copied)."""
        self.projection_shape(proj)  # checks the name
        return KbitTensors(*(getattr(self, proj + s) for s in TENSOR_SUFFIXES.values()))

    # -----------------------------------------------------------------------------------
    # construction from a transformers experts module
    # -----------------------------------------------------------------------------------

    @classmethod
    def from_experts(cls, module: nn.Module, bits: int = 4, codebook: torch.Tensor | str | None = None, *,
                     scale_search: bool = False, device: torch.device | str | None = None) -> "KbitExperts":
        """Quantize a transformers experts module (``MixtralExperts``, ``Qwen3MoeExperts``, ...).

        The module must pass :func:`experts_layout_problem`. Each expert's ``gate_up_proj[e]``
        and ``down_proj[e]`` is quantized with :func:`quantize_experts_weight` on the weights'
        device (or ``device``); ``act_fn`` is shared with ``module``, which is left unchanged. A
        module on the meta device gives a meta ``KbitExperts``.

        Args:
            module: the experts module.
            bits: index width, 2..5.
            codebook: ``[2**bits]`` (default: the normal-float codebook), for both projections;
                ``"fitted"``: each projection's levels fitted to all its experts.
            scale_search: least-error block scales (:func:`kbit_linear.quantizer.quantize_weight`).
            device: where to quantize and keep the new module (default: the weights' device).

        Returns:
            The quantized module, in ``module``'s training mode.

        Raises:
            TypeError: ``module`` is not an ``nn.Module``.
            ValueError: a layout :class:`KbitExperts` does not implement (the reason is in the
                message), bad ``bits``/``codebook``, or NaN/Inf weights (naming the expert).
        """
        fmt.check_module(module, "module")
        problem = experts_layout_problem(module)
        if problem is not None:
            raise ValueError(f"module cannot be quantized as kbit experts: {problem}")
        fmt.check_bits(bits)
        e, two_i, h = module.gate_up_proj.shape
        new = cls(e, h, two_i // 2, bits=bits, act_fn=module.act_fn, device="meta")
        for proj in PROJECTIONS:
            q = quantize_experts_weight(getattr(module, proj), bits, codebook, scale_search=scale_search, name=proj, device=device)
            new.set_projection(proj, q)
        new.train(module.training)
        new.keep_dense_outline(module)
        return new

    def set_projection(self, proj: str, tensors: KbitTensors) -> None:
        """Replace the stored tensors of ``proj`` by ``tensors`` (as :func:`quantize_experts_weight` returns).

        Raises:
            ValueError / TypeError: ``tensors`` not a ``KbitTensors``, a tensor of the wrong dtype
                or shape, a codebook that is not ``format.validate_codebook``'s (NaN, out of
                [-1, 1], not increasing), or tensors not on one device (this projection's four
                and the other projection's), named.
        """
        n, k = self.projection_shape(proj)
        if not isinstance(tensors, KbitTensors):  # fields are read by name below
            raise TypeError(f"tensors must be a KbitTensors (packed, absmax, codebook, tensor_scale), got {type(tensors).__name__}")
        packed_shape, absmax_shape = fmt.tiled_shapes(n, k, self.bits)
        want = {
            "packed": (torch.int32, (self.num_experts, *packed_shape)),
            "absmax": (torch.uint8, (self.num_experts, *absmax_shape)),
            "codebook": (torch.float32, (1 << self.bits,)),
            "tensor_scale": (torch.float32, (self.num_experts,)),
        }
        for field, (dtype, shape) in want.items():
            t = getattr(tensors, field)
            if not isinstance(t, torch.Tensor) or t.dtype != dtype:
                raise TypeError(f"{proj}{TENSOR_SUFFIXES[field]} must be a {dtype} tensor, got {getattr(t, 'dtype', type(t).__name__)}")
            if tuple(t.shape) != shape:
                raise ValueError(f"{proj}{TENSOR_SUFFIXES[field]} must have shape {shape}, got {tuple(t.shape)}")
        devices = {getattr(tensors, field).device for field in want}
        other = getattr(self, PROJECTIONS[1 - PROJECTIONS.index(proj)], None)
        if other is not None and other.device.type != "meta" and next(iter(devices)).type != "meta":
            devices.add(other.device)  # (a module being built starts on meta: from_experts)
        if len(devices) > 1:
            raise ValueError(f"{proj}'s tensors and the other projection's must be on one device, got {sorted(map(str, devices))}")
        fmt.validate_codebook(tensors.codebook, self.bits, name=f"{proj}_codebook")  # (values not checked on meta)
        setattr(self, proj, nn.Parameter(weight_layout.device_form(tensors.packed, self.bits), requires_grad=False))
        for field in ("absmax", "codebook", "tensor_scale"):
            setattr(self, proj + TENSOR_SUFFIXES[field], getattr(tensors, field))
        self._views.pop(proj, None)

    # -----------------------------------------------------------------------------------
    # compute
    # -----------------------------------------------------------------------------------

    def forward(self, hidden_states: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor) -> torch.Tensor:
        """The experts' output for routed tokens.

        Args:
            hidden_states: float32/float16/bfloat16 ``[T, hidden_dim]``.
            top_k_index: integer ``[T, top_k]``: expert ids in ``[0, num_experts]``; the id
                ``num_experts`` sends a slot to no expert (transformers' convention).
            top_k_weights: floating ``[T, top_k]``: the routing weight of each slot.

        Returns:
            ``[T, hidden_dim]`` in ``hidden_states``'s dtype: ``sum_k top_k_weights[t, k] *
            down(act_fn(gate(x_t)) * up(x_t))`` of expert ``top_k_index[t, k]``, each term
            computed in the dtype ``top_k_weights`` promotes it to and summed in float32, then
            rounded once (as transformers' grouped_mm path does; its eager loop adds in the
            activations' dtype). The grouped GPU path rounds the routing weights to the
            activations' dtype and forms products and sums in float32 in one launch
            (``kbit_linear::combine_experts``).

        On a GPU with float16/bfloat16 activations and few enough routed rows per expert
        (:meth:`_grouped_max_rows`), both projections run as one grouped launch each
        (``kbit_linear::grouped_gemm``) with the routing on the device, or, for one token and
        SiLU experts, the whole call as one op (``kbit_linear::experts_one_token``: two kernels
        where the experts are small, the grouped launches otherwise): no host sync, so a
        decode step can be captured in a CUDA graph or compiled with
        ``torch.compile(fullgraph=True)`` (then the expert ids are not range-checked, and each
        token's experts must be distinct as ``torch.topk`` makes them).
        Otherwise the reference below runs one gemm pair per hit expert.

        Raises:
            TypeError / ValueError: an argument of the wrong type, dtype, shape or device, or an
                expert id out of range; the message names the argument.
        """
        # Under CUDA-graph capture or torch.compile nothing may read values on the host.
        tracing = torch.compiler.is_compiling() or (
            isinstance(hidden_states, torch.Tensor) and hidden_states.is_cuda and torch.cuda.is_current_stream_capturing())
        self._check_inputs(hidden_states, top_k_index, top_k_weights, read_values=not tracing)
        max_rows = self._grouped_max_rows(hidden_states, top_k_index, read_values=not tracing)
        if max_rows:
            return self._grouped_forward(hidden_states, top_k_index, top_k_weights, max_rows)
        top_k = top_k_index.shape[1]
        routing = route_tokens(top_k_index, self.num_experts)
        # The reference reads the expert boundaries on the host (after the id check's read): they
        # decide which gemm calls run. The grouped kernel reads them on the device (its work list
        # covers every expert, an empty one ends at once, out-of-range ids are dropped), so a
        # decode step under a CUDA graph needs no sync.
        offsets = routing.offsets.tolist()
        slot_weights = top_k_weights.reshape(-1)
        out = torch.zeros((hidden_states.shape[0], self.hidden_dim), dtype=torch.float32, device=hidden_states.device)
        gate_up, down = self._expert_views("gate_up_proj"), self._expert_views("down_proj")
        n_gate_up, n_down = 2 * self.intermediate_dim, self.hidden_dim
        for e in range(self.num_experts):
            lo, hi = offsets[e], offsets[e + 1]
            if lo == hi:
                continue
            slots = routing.perm[lo:hi]
            tokens = slots // top_k
            gate, up = _ops.gemm(hidden_states[tokens], *gate_up[e], self.bits, n_gate_up, None).chunk(2, dim=-1)
            y = _ops.gemm(self.act_fn(gate) * up, *down[e], self.bits, n_down, None)
            out.index_add_(0, tokens, (y * slot_weights[slots, None]).to(torch.float32))
        return out.to(hidden_states.dtype)

    def _grouped_max_rows(self, hidden_states: torch.Tensor, top_k_index: torch.Tensor, read_values: bool) -> int:
        """The row bound per expert for the grouped path, or 0 when the reference must run.

        Rows per expert are at most T * top_k, and at most T when each token's experts are
        distinct (what routers built on ``torch.topk`` give; checked on the host unless
        ``read_values`` is false, i.e. under CUDA-graph capture). Groups of up to
        :data:`~kbit_linear._grouped_ops.DECODE_GROUP_ROWS` rows run anywhere the decode kernel
        does; larger ones where the GPU has the grouped tensor-core kernel
        (:func:`~kbit_linear._grouped_ops.large_groups_supported`). Gradients and forward-mode
        tangents through the experts use the reference (the grouped ops have no autograd)."""
        if not hidden_states.is_cuda or hidden_states.dtype not in (torch.float16, torch.bfloat16):
            return 0
        if (torch.is_grad_enabled() and hidden_states.requires_grad) or _ops.forward_ad_active():
            return 0
        tokens, top_k = top_k_index.shape
        if tokens == 0:
            return 0
        limit = _grouped_ops.DECODE_GROUP_ROWS
        if tokens * top_k <= limit:
            return tokens * top_k
        # Any size: a bound without reading the ids (the tensor-core kernel needs no tight one).
        large = tokens * top_k if _grouped_ops.large_groups_supported(hidden_states.device) else 0
        if tokens > limit:
            return large
        if read_values and top_k > 1:
            ids = torch.sort(top_k_index, dim=1).values
            if bool((ids[:, 1:] == ids[:, :-1]).any()):  # an expert twice for one token
                return large
        return tokens  # the decode kernel's schedule

    def _grouped_forward(self, hidden_states: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor,
                         max_rows: int) -> torch.Tensor:
        """The forward with two grouped launches and the routing on the device (see :meth:`forward`)."""
        tokens, top_k = top_k_index.shape
        # A decode step of batch 1: one op, two kernels, no routing step. Not when the routing
        # weights need a gradient (router training): only combine_experts below carries one.
        if tokens == 1 and _is_silu(self.act_fn) and not _ops.needs_gradient(top_k_weights):
            return torch.ops.kbit_linear.experts_one_token(hidden_states, top_k_index, top_k_weights,
                                                           *self.projection_tensors("gate_up_proj"),
                                                           *self.projection_tensors("down_proj"), self.bits,
                                                           self.intermediate_dim).to(hidden_states.dtype)
        # The slots sorted by expert; the experts that received slots as the groups (as many
        # groups as there can be hit experts); slots with no expert sort last, in no group.
        groups, _, token_of_slot, position = torch.ops.kbit_linear.route_experts(top_k_index, self.num_experts,
                                                                                 min(self.num_experts, tokens * top_k))
        # One token: every slot reads its row, so a broadcast view replaces the gather (the
        # decode kernel reads it with stride 0 between rows).
        x = hidden_states.expand(tokens * top_k, -1) if tokens == 1 else hidden_states[token_of_slot]
        if _is_silu(self.act_fn):  # one op; the backend fuses silu(gate) * up into the GEMM's stores where it can
            h = torch.ops.kbit_linear.grouped_swiglu(x, *self.projection_tensors("gate_up_proj"), groups, self.bits,
                                                     self.intermediate_dim, max_rows)
        else:
            gate, up = torch.ops.kbit_linear.grouped_gemm(x, *self.projection_tensors("gate_up_proj"), groups, self.bits,
                                                          2 * self.intermediate_dim, max_rows).chunk(2, dim=-1)
            h = self.act_fn(gate) * up
        y = torch.ops.kbit_linear.grouped_gemm(h, *self.projection_tensors("down_proj"), groups, self.bits, self.hidden_dim,
                                               max_rows)  # rows of no group: zero
        # Back to token order, weighted over each token's top_k slots (fp32 sums, rounded once).
        return torch.ops.kbit_linear.combine_experts(y, position, top_k_weights).to(hidden_states.dtype)

    def _check_inputs(self, hidden_states: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor,
                      read_values: bool = True) -> None:
        """Types, shapes, devices and (when ``read_values``: one small host read) expert ids of a forward call."""
        for name, t in (("hidden_states", hidden_states), ("top_k_index", top_k_index), ("top_k_weights", top_k_weights)):
            if not isinstance(t, torch.Tensor):
                raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
        if hidden_states.dtype not in _ACTIVATION_DTYPES:
            raise TypeError(f"hidden_states must be floating point (float32, float16, bfloat16 or float64), got {hidden_states.dtype}")
        if hidden_states.dim() != 2 or hidden_states.shape[1] != self.hidden_dim:
            raise ValueError(f"hidden_states must have shape [tokens, hidden_dim={self.hidden_dim}], got {tuple(hidden_states.shape)}")
        if top_k_index.is_floating_point() or top_k_index.is_complex() or top_k_index.dtype == torch.bool:
            raise TypeError(f"top_k_index must be an integer tensor, got {top_k_index.dtype}")
        if top_k_index.dim() != 2 or top_k_index.shape[0] != hidden_states.shape[0]:
            raise ValueError(
                f"top_k_index must have shape [tokens={hidden_states.shape[0]}, top_k], got {tuple(top_k_index.shape)}"
            )
        if not top_k_weights.is_floating_point():
            raise TypeError(f"top_k_weights must be floating point, got {top_k_weights.dtype}")
        if tuple(top_k_weights.shape) != tuple(top_k_index.shape):
            raise ValueError(f"top_k_weights must have the shape of top_k_index {tuple(top_k_index.shape)}, got {tuple(top_k_weights.shape)}")
        device = self.gate_up_proj.device
        for name, t in (("hidden_states", hidden_states), ("top_k_index", top_k_index), ("top_k_weights", top_k_weights)):
            if t.device != device:
                raise ValueError(f"{name} is on {t.device}, the experts on {device}")
        if read_values and top_k_index.numel():
            lo, hi = torch.stack(torch.aminmax(top_k_index.to(torch.int64))).tolist()  # int64: unsigned ids too
            if lo < 0 or hi > self.num_experts:
                raise ValueError(
                    f"top_k_index holds expert ids {lo}..{hi}; valid ids are 0..{self.num_experts - 1} "
                    f"(and {self.num_experts} for no expert)"
                )

    def _expert_views(self, proj: str) -> list[tuple[torch.Tensor, ...]]:
        """Per expert, the gemm op's weight arguments ``(packed[e], absmax[e], codebook, tensor_scale[e:e+1])``.

        The same view objects are handed out while the stacked tensors are unchanged, so the
        CPU backend's per-layer key cache (keyed by the weight tensor) serves every expert.
        """
        packed, absmax, codebook, tensor_scale = self.projection_tensors(proj)
        try:
            stamp = tuple((t.data_ptr(), t._version) for t in (packed, absmax, codebook, tensor_scale))
        except RuntimeError:  # inference tensors have no version counter: fresh views every call
            stamp = None
        cached = self._views.get(proj)
        if stamp is not None and cached is not None and cached[0] == stamp:
            return cached[1]
        packed = packed.detach()
        views = [(packed[e], absmax[e], codebook, tensor_scale[e : e + 1]) for e in range(self.num_experts)]
        if stamp is not None:
            self._views[proj] = (stamp, views)
        return views

    def dequantize(self, dtype: torch.dtype | None = None) -> dict[str, torch.Tensor]:
        """The dense expert weights this module represents, in transformers' layout.

        Args:
            dtype: result dtype (default float32, which holds every dequantized value exactly).

        Returns:
            ``{"gate_up_proj": [E, 2I, H], "down_proj": [E, H, I]}`` on the module's device.

        Raises:
            TypeError: ``dtype`` is not a floating-point ``torch.dtype``.
        """
        dtype = fmt.check_float_dtype(torch.float32 if dtype is None else dtype)
        out = {}
        for proj in PROJECTIONS:
            n, k = self.projection_shape(proj)
            out[proj] = torch.stack(
                [_DEQUANTIZE(*views, self.bits, n, k, dtype) for views in self._expert_views(proj)]
            )
        return out

    @staticmethod
    def _shell_of(module: nn.Module) -> nn.Module:
        """A new module of ``module``'s class with its plain attributes and submodules (shared) and
        fresh parameter, buffer and hook tables, empty."""
        shell = module.__class__.__new__(module.__class__)
        nn.Module.__init__(shell)
        for key, value in module.__dict__.items():
            if key not in shell.__dict__:
                shell.__dict__[key] = value
        shell._modules.update(module._modules)
        shell.training = module.training
        return shell

    def keep_dense_outline(self, module: nn.Module) -> None:
        """Remember the dense experts module this one replaces, as an outline on the meta device
        (its class and attributes, no weights; not a submodule, so in no state dict), so that
        :meth:`to_dense` can give that class back."""
        outline = self._shell_of(module)  # (the activation shared, as this module's act_fn)
        for name, p in module.named_parameters(recurse=False):
            outline._parameters[name] = nn.Parameter(torch.empty_like(p, device="meta"), requires_grad=p.requires_grad)
        for name, b in module.named_buffers(recurse=False):
            outline._buffers[name] = torch.empty_like(b, device="meta")
        object.__setattr__(self, "_dense_outline", outline)

    def to_dense(self, dtype: torch.dtype | None = None) -> nn.Module:
        """The dense experts module this one replaced (its own class), holding the dequantized weights.

        Args:
            dtype: the weights' dtype (default: the dense module's, following the casts this
                module went through since: ``.to(torch.bfloat16)``, ``.half()``, ...).

        Raises:
            TypeError: ``dtype`` is not ``None`` or a floating-point ``torch.dtype``.
            NotImplementedError: this module was not made from a dense one (:meth:`from_experts`,
                ``quantize_model``, ``load_into`` and the transformers plug-in keep its outline; a
                module built directly does not).
        """
        if dtype is not None:
            fmt.check_float_dtype(dtype)
        outline = self.__dict__.get("_dense_outline")
        if outline is None:
            raise NotImplementedError("this KbitExperts does not know the dense experts class it stands for (built directly, "
                                      "not from a dense module): use dequantize() for the weights")
        weights = self.dequantize()
        dense = self._shell_of(outline)
        for name, p in outline._parameters.items():
            t = weights[name] if name in weights else torch.zeros(p.shape, device=self.gate_up_proj.device)
            dense._parameters[name] = nn.Parameter(t.to(dtype or p.dtype), requires_grad=p.requires_grad)
        for name, b in outline._buffers.items():
            dense._buffers[name] = torch.zeros(b.shape, dtype=b.dtype, device=self.gate_up_proj.device)
        dense.train(self.training)
        return dense

    def extra_repr(self) -> str:
        return f"num_experts={self.num_experts}, hidden_dim={self.hidden_dim}, intermediate_dim={self.intermediate_dim}, bits={self.bits}"

    # -----------------------------------------------------------------------------------
    # nn.Module plumbing
    # -----------------------------------------------------------------------------------

    def __getstate__(self) -> dict[str, Any]:
        state = super().__getstate__()
        return {**state, "_views": {}}  # views are rebuilt on use; never pickled or copied

    def _apply(self, fn: Callable[[torch.Tensor], torch.Tensor], recurse: bool = True) -> "KbitExperts":
        _refuse_integer_casts(self, fn)
        self._views.clear()  # views of the old tensors would keep them alive
        self._cast_outline(fn)  # (probed on the current device, before the tensors move)
        _apply_keeping_float32(self, _FLOAT32_BUFFERS, fn, recurse)
        for proj in PROJECTIONS:  # the new device's layout (kbit_linear.weight_layout)
            weight_layout.adopt(getattr(self, proj), self.bits)
        return self

    def _cast_outline(self, fn: Callable[[torch.Tensor], torch.Tensor]) -> None:
        """Give the dense outline's floating tensors the dtype ``fn`` gives a dense module's, as
        KbitLinear's ``compute_dtype`` follows a cast: after ``.to(torch.bfloat16)``,
        :meth:`to_dense` gives bfloat16 experts (the outline is on meta and not a submodule, so
        ``nn.Module._apply`` never reaches it)."""
        outline = self.__dict__.get("_dense_outline")
        if outline is None:
            return
        device = self.gate_up_proj.device
        for table in (outline._parameters, outline._buffers):
            for name, t in table.items():
                if t is None or not t.is_floating_point():
                    continue
                dtype = _cast_dtype(fn, t.dtype, device)
                if dtype == t.dtype:
                    continue
                new = torch.empty(t.shape, dtype=dtype, device="meta")
                table[name] = nn.Parameter(new, requires_grad=t.requires_grad) if isinstance(t, nn.Parameter) else new

    def _layout(self) -> dict[str, int]:
        """The logical shape a state dict of this module records (:func:`kbit_linear.linear._record_layout`)."""
        return {"bits": self.bits, "num_experts": self.num_experts, "hidden_dim": self.hidden_dim,
                "intermediate_dim": self.intermediate_dim}

    def _save_to_state_dict(self, destination: dict[str, Any], prefix: str, keep_vars: bool) -> None:
        super()._save_to_state_dict(destination, prefix, keep_vars)
        for proj in PROJECTIONS:  # state dicts and checkpoints hold planes
            if prefix + proj in destination:
                destination[prefix + proj] = weight_layout.storage_form(destination[prefix + proj])
        _record_layout(destination, prefix, self._layout())

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
        expected = {}
        for proj in PROJECTIONS:
            expected.update({proj: torch.int32, proj + "_absmax": torch.uint8})
            expected.update({proj + "_codebook": torch.float32, proj + "_tensor_scale": torch.float32})
        if not _check_layout(local_metadata, prefix, self._layout(), error_msgs, "KbitExperts"):
            return
        if not _check_state_dtypes(state_dict, prefix, expected, error_msgs, f"a {self.bits}-bit KbitExperts"):
            return
        # each projection's levels and per-expert tensor scales, as a KbitLinear's
        if not all([_check_state_values(state_dict, f"{prefix}{proj}_", self.bits, error_msgs) for proj in PROJECTIONS]):
            return
        self._views.clear()
        # The state dict holds planes: take them in planes, then move to the device's layout.
        for proj in PROJECTIONS:
            getattr(self, proj).data = weight_layout.storage_form(getattr(self, proj).data)
        super()._load_from_state_dict(state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys, error_msgs)
        for proj in PROJECTIONS:
            weight_layout.adopt(getattr(self, proj), self.bits)
