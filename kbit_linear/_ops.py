"""Op schemas: ``torch.library`` definitions of the kbit ops, their fake (meta) implementations,
and the pure-PyTorch reference registered as the default implementation for every device.

Backends (``kbit_linear/backends/``) register faster implementations for their device; the
reference stays the fallback and the spec. Schemas:

* ``kbit_linear::quantize(weight, codebook, tensor_scale, bits) -> (packed_flat, absmax_flat)``
* ``kbit_linear::repack(packed_flat, absmax_flat, bits) -> (packed, absmax)``
* ``kbit_linear::dequantize(packed, absmax, codebook, tensor_scale, bits, out_features, in_features, dtype) -> Tensor``
* ``kbit_linear::gemm(x, packed, absmax, codebook, tensor_scale, bits, out_features, bias) -> Tensor``
* ``kbit_linear::hadamard_rotate(x, signs) -> Tensor``: ``x R``, the randomized Hadamard rotation
  of a Hadamard-rotated layer's input (:func:`kbit_linear.hadamard.rotate`)

Shapes and dtypes are those of ``docs/format.md``: ``packed`` int32
``[K_pad/64, N_pad/128, 128, 2, bits]``, ``absmax`` uint8 ``[K_pad/64, N_pad/128, 128, 2]``
(both from :func:`kbit_linear.format.tiled_shapes`), ``codebook`` float32 ``[2**bits]``,
``tensor_scale`` float32 ``[1]``.

The ops check metadata only (dtypes, shapes, devices: no pass over the data, no host sync).
The values (a finite weight, a sorted codebook in [-1, 1]) are validated once, before the ops,
by :func:`kbit_linear.quantizer.quantize_weight` or the format reference.
"""

from __future__ import annotations

from typing import Callable

import torch
import torch.autograd.forward_ad as _fwAD
from torch._functorch.utils import enable_single_level_autograd_function

from . import format as fmt
from . import hadamard as hd

_NS = "kbit_linear"

torch.library.define(
    f"{_NS}::quantize",
    "(Tensor weight, Tensor codebook, Tensor tensor_scale, int bits) -> (Tensor, Tensor)",
)
torch.library.define(
    f"{_NS}::repack",
    "(Tensor packed_flat, Tensor absmax_flat, int bits) -> (Tensor, Tensor)",
)
torch.library.define(
    f"{_NS}::dequantize",
    "(Tensor packed, Tensor absmax, Tensor codebook, Tensor tensor_scale, int bits, "
    "int out_features, int in_features, ScalarType dtype) -> Tensor",
)
torch.library.define(
    f"{_NS}::gemm",
    "(Tensor x, Tensor packed, Tensor absmax, Tensor codebook, Tensor tensor_scale, int bits, "
    "int out_features, Tensor? bias) -> Tensor",
)
torch.library.define(f"{_NS}::hadamard_rotate", "(Tensor x, Tensor signs) -> Tensor")


# ---------------------------------------------------------------------------------------
# checks shared by the fake implementations and the backends (cheap: metadata only)
# ---------------------------------------------------------------------------------------


def check_weight_args(weight: torch.Tensor, codebook: torch.Tensor, tensor_scale: torch.Tensor, bits: int) -> None:
    """Metadata checks for ``quantize``: no pass over the weight's values.

    NaN/Inf weights and codebook values are checked once, before the op, by the caller that
    validates (``kbit_linear.quantizer.quantize_weight`` or the format reference).
    """
    fmt.check_bits(bits)
    fmt.check_weight(weight, finite=False)
    check_codebook_args(codebook, tensor_scale, bits, weight.device)


def check_codebook_args(codebook: torch.Tensor, tensor_scale: torch.Tensor, bits: int, device: torch.device) -> None:
    """Metadata checks for the codebook and tensor scale."""
    torch._check_type(codebook.dtype == torch.float32, lambda: f"codebook must be float32, got {codebook.dtype}")
    torch._check_value(
        codebook.dim() == 1 and codebook.shape[0] == (1 << bits),
        lambda: f"codebook must have shape [{1 << bits}] for bits={bits}, got {tuple(codebook.shape)}",
    )
    torch._check_type(
        tensor_scale.dtype == torch.float32 and tensor_scale.numel() == 1,
        lambda: f"tensor_scale must be a float32 tensor with one element, got {tensor_scale.dtype} {tuple(tensor_scale.shape)}",
    )
    torch._check_value(codebook.device == device, lambda: f"codebook is on {codebook.device}, expected {device}")
    torch._check_value(tensor_scale.device == device, lambda: f"tensor_scale is on {tensor_scale.device}, expected {device}")


def check_tiled_args(
    packed: torch.Tensor, absmax: torch.Tensor, bits: int, out_features: int, in_features: int | None = None
) -> tuple[int, int]:
    """Metadata checks for a tiled weight (the contract of :func:`kbit_linear.format.check_tiled`,
    plus both tensors on one device); returns ``(N_pad, K_pad)``."""
    fmt.check_bits(bits)
    n_pad, k_pad = fmt.check_tiled(packed, absmax, bits, out_features, in_features)
    torch._check_value(absmax.device == packed.device, lambda: f"absmax is on {absmax.device}, packed on {packed.device}")
    return n_pad, k_pad


def check_gemm_weight_args(
    packed: torch.Tensor,
    absmax: torch.Tensor,
    codebook: torch.Tensor,
    tensor_scale: torch.Tensor,
    bits: int,
    out_features: int,
) -> int:
    """Metadata checks for ``gemm``'s weight tensors (a layer passes the same ones at every call,
    so a backend may check them once per layer); returns ``K_pad``."""
    _, k_pad = check_tiled_args(packed, absmax, bits, out_features)
    check_codebook_args(codebook, tensor_scale, bits, packed.device)
    return k_pad


def check_gemm_input_args(
    x: torch.Tensor, bias: torch.Tensor | None, k_pad: int, out_features: int, device: torch.device
) -> None:
    """Metadata checks for ``gemm``'s per-call inputs against a weight of ``k_pad`` padded
    in-features and ``out_features`` rows on ``device``.

    Plain comparisons rather than ``torch._check``: they run at every eager call, where the
    latter's symbolic-shape machinery costs several microseconds (traced, they guard the same).
    """
    if not x.is_floating_point():
        raise TypeError(f"x must be floating point, got {x.dtype}")
    if x.dim() < 1:
        raise ValueError("x must have at least one dimension")
    k = x.shape[-1]
    if not k_pad - fmt.TILE_K < k <= k_pad:
        raise ValueError(f"x's last dimension {k} does not match the weight's in_features (padded to {k_pad})")
    if x.device != device:
        raise ValueError(f"x is on {x.device}, weight on {device}")
    if bias is not None:
        if bias.dim() != 1 or bias.shape[0] != out_features:
            raise ValueError(f"bias must have shape [{out_features}], got {tuple(bias.shape)}")
        if bias.device != x.device:
            raise ValueError(f"bias is on {bias.device}, x on {x.device}")


def check_gemm_args(
    x: torch.Tensor,
    packed: torch.Tensor,
    absmax: torch.Tensor,
    codebook: torch.Tensor,
    tensor_scale: torch.Tensor,
    bits: int,
    out_features: int,
    bias: torch.Tensor | None,
) -> None:
    """Metadata checks for ``gemm``: :func:`check_gemm_weight_args` and :func:`check_gemm_input_args`."""
    k_pad = check_gemm_weight_args(packed, absmax, codebook, tensor_scale, bits, out_features)
    check_gemm_input_args(x, bias, k_pad, out_features, packed.device)


# ---------------------------------------------------------------------------------------
# fake implementations (shapes only; used by torch.compile and the meta device)
# ---------------------------------------------------------------------------------------


@torch.library.register_fake(f"{_NS}::quantize")
def _(weight, codebook, tensor_scale, bits):
    check_weight_args(weight, codebook, tensor_scale, bits)
    n, k = weight.shape
    nblk = -(-k // fmt.BLOCK_SIZE)
    packed = weight.new_empty((n, nblk, bits), dtype=torch.int32)
    absmax = weight.new_empty((n, nblk), dtype=torch.uint8)
    return packed, absmax


@torch.library.register_fake(f"{_NS}::repack")
def _(packed_flat, absmax_flat, bits):
    fmt.check_bits(bits)
    fmt._check_flat(packed_flat, absmax_flat, bits)
    p_shape, a_shape = fmt.tiled_shapes(packed_flat.shape[0], packed_flat.shape[1] * fmt.BLOCK_SIZE, bits)
    return packed_flat.new_empty(p_shape), absmax_flat.new_empty(a_shape)


def check_dequantize_dtype(dtype: torch.dtype) -> None:
    """``dequantize``'s output dtype: a floating-point one (an integer dtype would truncate the values)."""
    fmt.check_float_dtype(dtype)


@torch.library.register_fake(f"{_NS}::dequantize")
def _(packed, absmax, codebook, tensor_scale, bits, out_features, in_features, dtype):
    check_tiled_args(packed, absmax, bits, out_features, in_features)
    check_codebook_args(codebook, tensor_scale, bits, packed.device)
    check_dequantize_dtype(dtype)
    return packed.new_empty((out_features, in_features), dtype=dtype)


@torch.library.register_fake(f"{_NS}::gemm")
def _(x, packed, absmax, codebook, tensor_scale, bits, out_features, bias):
    check_gemm_args(x, packed, absmax, codebook, tensor_scale, bits, out_features, bias)
    return x.new_empty((*x.shape[:-1], out_features))


def check_rotate_args(x: torch.Tensor, signs: torch.Tensor) -> None:
    """Metadata checks for ``hadamard_rotate``: ``x`` floating ``[..., K]`` and ``signs`` int8
    ``[K]`` on its device (the +-1 values are checked once, when the layer gets them)."""
    hd.check_rotate_operands(x, signs, "x")
    if signs.device != x.device:
        raise ValueError(f"signs must be on x's device {x.device}, got {signs.device}")


@torch.library.register_fake(f"{_NS}::hadamard_rotate")
def _(x, signs):
    check_rotate_args(x, signs)
    return x.new_empty(x.shape)  # contiguous, as the implementations return it (not x's strides)


# ---------------------------------------------------------------------------------------
# reference implementations (default for every device; the spec)
# ---------------------------------------------------------------------------------------


@torch.library.impl(f"{_NS}::quantize", "default")
def _(weight, codebook, tensor_scale, bits):
    check_weight_args(weight, codebook, tensor_scale, bits)
    # metadata checked above; the values were validated by the caller (see check_weight_args)
    return fmt._quantize_blocks(weight, bits, codebook, tensor_scale)


@torch.library.impl(f"{_NS}::repack", "default")
def _(packed_flat, absmax_flat, bits):
    return fmt.tile_blocks(packed_flat, absmax_flat, bits)


@torch.library.impl(f"{_NS}::dequantize", "default")
def _(packed, absmax, codebook, tensor_scale, bits, out_features, in_features, dtype):
    check_dequantize_dtype(dtype)
    qw = fmt.KbitWeight(packed, absmax, codebook, tensor_scale, bits, out_features, in_features)
    # contiguous [N, K], as the fake kernel says (the blocks' padding cut off leaves a strided view)
    return fmt.dequantize(qw, dtype).contiguous()


@torch.library.impl(f"{_NS}::gemm", "default")
def _(x, packed, absmax, codebook, tensor_scale, bits, out_features, bias):
    check_gemm_args(x, packed, absmax, codebook, tensor_scale, bits, out_features, bias)
    qw = fmt.KbitWeight(packed, absmax, codebook, tensor_scale, bits, out_features, x.shape[-1])
    return fmt.matmul(x, qw, bias)


@torch.library.impl(f"{_NS}::hadamard_rotate", "default")
def _(x, signs):
    check_rotate_args(x, signs)
    return hd.rotate(x, signs)


# ---------------------------------------------------------------------------------------
# autograd, both modes: gradients and tangents flow to x and bias (the quantized weight is
# frozen), so adapters trained on top of a quantized model (LoRA) and forward-mode AD
# (torch.func.jvp, jacfwd, torch.autograd.forward_ad) work through these layers.
#
# torch.library has no register_jvp, and register_autograd's generated autograd.Function has
# no jvp (forward_ad raised, torch.func.jvp gave a zero tangent) and runs its Python apply,
# which under torch.func hands it to custom_function_call (refused: no setup_context). So each
# differentiable op gets its own Autograd kernel (register_function_autograd): an
# autograd.Function with backward and jvp applied through the C++ apply, as a built-in op's
# autograd kernel works, on the current torch.func level's tensors.
# ---------------------------------------------------------------------------------------

_GEMM = torch.ops.kbit_linear.gemm.default  # resolved once: skips the packet's overload lookup
_ROTATE = torch.ops.kbit_linear.hadamard_rotate.default
_DEQUANTIZE = torch.ops.kbit_linear.dequantize.default


def forward_ad_active() -> bool:
    """Whether a forward-mode AD level is open (``torch.autograd.forward_ad.dual_level``, which
    ``torch.func.jvp`` opens too): a dual input may then carry a tangent that only the op's
    autograd (its jvp) can carry on, so the eager fast paths, which bypass it, step aside."""
    return _fwAD._current_level >= 0  # a module global: no tensor is looked at


def _requires_grad(arg: object) -> bool:
    """A tensor that requires grad, or a list / tuple holding one."""
    if isinstance(arg, torch.Tensor):
        return arg.requires_grad
    return isinstance(arg, (list, tuple)) and any(_requires_grad(a) for a in arg)


def needs_gradient(*args: object) -> bool:
    """Whether reverse mode records a call on ``args``: grad mode on and a tensor among them
    (or in a list among them) requires grad. Under torch.compile in plain Python, which it traces
    inside a module's forward (``torch._C._any_requires_grad`` is opaque to it: a graph break, an
    error under ``fullgraph``); eager, in that one C call (every op call's Autograd kernel asks)."""
    if not torch.is_grad_enabled():
        return False
    if torch.compiler.is_compiling():
        return any(_requires_grad(a) for a in args)
    return torch._C._any_requires_grad(*args)


def differentiating(*args: object) -> bool:
    """Whether an op's Autograd kernel must apply its autograd.Function: reverse mode records
    (:func:`needs_gradient`) or forward mode is on (:func:`forward_ad_active`)."""
    return needs_gradient(*args) or forward_ad_active()


def register_function_autograd(qualname: str, function: type[torch.autograd.Function],
                               refuse_gradients: str | None = None) -> None:
    """Make ``function`` (whose ``forward`` takes the op's arguments and calls the op through
    :func:`call_below_autograd`) the Autograd kernel of the op ``qualname``, applied while
    :func:`differentiating`; otherwise the kernel calls the op below autograd directly.
    ``refuse_gradients``: for an op with no backward, the ``NotImplementedError`` message raised
    when a call needs a gradient (:func:`needs_gradient`), before anything runs.

    The kernel runs where autograd meets the op: eager calls (both AD modes, torch.func
    transforms) and AOTAutograd's tracing under torch.compile; the fake kernel is untouched.
    """
    op = torch._library.utils.lookup_op(qualname)
    # The C++ apply, not Function.apply: the latter sends calls under torch.func transforms to
    # custom_function_call, which has no kernel at the Autograd key this runs at. Here, as in a
    # built-in op's autograd, the Function records on the current level's wrapped tensors and
    # its forward's call below autograd reaches the lower levels.
    apply = super(torch.autograd.Function, function).apply

    def autograd_kernel(*args):
        if differentiating(*args):
            if refuse_gradients is not None and needs_gradient(*args):
                raise NotImplementedError(refuse_gradients)
            if torch._C._are_functorch_transforms_active():
                with enable_single_level_autograd_function():  # (functorch asserts it for such a Function)
                    return apply(*args)
            return apply(*args)
        with torch._C._AutoDispatchBelowAutograd():
            return op(*args)

    torch.library.impl(qualname, "Autograd")(autograd_kernel)


def call_below_autograd(op: Callable[..., torch.Tensor], *args: object) -> torch.Tensor:
    """``op(*args)`` below the Autograd key: the forward of the ops' autograd.Functions.

    Under torch.func transforms the call reaches the levels below the current one, which
    differentiate on their own; the C++ apply turned grad mode and forward grad mode off for
    this level's forward, so they are turned back on for those levels (as functorch's own
    single-level Functions do: without it, jvp of grad and grad of jvp gave zeros).
    """
    if torch._C._are_functorch_transforms_active():
        with torch.enable_grad(), _fwAD._set_fwd_grad_enabled(True), torch._C._AutoDispatchBelowAutograd():
            return op(*args)
    with torch._C._AutoDispatchBelowAutograd():
        return op(*args)


def check_frozen_tangents(op: str, **tangents: torch.Tensor | None) -> None:
    """Raise ``NotImplementedError`` naming ``op`` and the tensor if one of the quantized
    weight's tensors carries a forward-mode tangent: the weight is frozen, and its tangent would
    otherwise be dropped without a word (the reverse mode gives these tensors no gradient)."""
    for name, tangent in tangents.items():
        if tangent is not None:
            raise NotImplementedError(f"forward-mode AD through kbit_linear::{op}: the quantized weight is frozen, "
                                      f"so {name} takes no tangent (only the activation and the bias do)")


def bias_tangent(bias_t: torch.Tensor, dtype: torch.dtype, shape: torch.Size) -> torch.Tensor:
    """The tangent of ``x @ W^T + bias`` when only the bias carries one: broadcast over the
    rows, in the output's dtype, contiguous as the output (forward AD wants the layouts equal)."""
    return bias_t.to(dtype).expand(shape).contiguous()


class _HadamardRotate(torch.autograd.Function):
    """The autograd of ``hadamard_rotate``: ``y = x R`` with ``R`` orthogonal, so the tangent is
    the rotation of x's tangent and the gradient ``dL/dy R^T``."""

    @staticmethod
    def forward(x, signs):
        return call_below_autograd(_ROTATE, x, signs)

    @staticmethod
    def setup_context(ctx, inputs, output):
        ctx.set_materialize_grads(False)  # an input without a tangent reaches jvp as None, not zeros
        ctx.save_for_backward(inputs[1])
        ctx.save_for_forward(inputs[1])

    @staticmethod
    def backward(ctx, grad):
        if grad is None:  # (grads are not materialized: see setup_context)
            return None, None
        (signs,) = ctx.saved_tensors
        # Traced (AOTAutograd under torch.compile), the matrix is built in the trace: the cached
        # one is a real tensor, which fake tensors refuse to meet.
        traced = torch._C._len_torch_dispatch_stack() > 0
        matrix = hd.hadamard_matrix(hd.hadamard_block(grad.shape[-1]), grad.dtype, grad.device) if traced else None
        return hd.unrotate(grad, signs, matrix), None

    @staticmethod
    def jvp(ctx, x_t, signs_t):
        (signs,) = ctx.saved_tensors  # (the int8 signs cannot carry a tangent)
        return hadamard_rotate(x_t, signs)


register_function_autograd(f"{_NS}::hadamard_rotate", _HadamardRotate)


def _gemm_setup_context(ctx, inputs, output):
    x, packed, absmax, codebook, tensor_scale, bits, out_features, bias = inputs
    ctx.save_for_backward(packed, absmax, codebook, tensor_scale)
    ctx.bits, ctx.out_features, ctx.in_features = bits, out_features, x.shape[-1]
    ctx.x_dtype = x.dtype
    ctx.bias_dtype = None if bias is None else bias.dtype


def _gemm_grads(ctx, grad, dequantize: Callable[..., torch.Tensor]):
    """Gradients of gemm's eight inputs (x and bias only; the weight is frozen), the weight
    dequantized by ``dequantize`` (the op's signature): shared by the op's autograd and the eager
    autograd path, which differ only in how they reach the dequantize kernel."""
    packed, absmax, codebook, tensor_scale = ctx.saved_tensors
    grad_x = grad_bias = None
    if ctx.needs_input_grad[0]:
        # dL/dx = dL/dy @ W_hat, with the dequantized weight in the gradient's dtype.
        w = dequantize(packed, absmax, codebook, tensor_scale, ctx.bits, ctx.out_features, ctx.in_features, grad.dtype)
        grad_x = (grad @ w).to(ctx.x_dtype)
    if ctx.bias_dtype is not None and ctx.needs_input_grad[7]:
        grad_bias = grad.reshape(-1, ctx.out_features).sum(0).to(ctx.bias_dtype)
    return grad_x, None, None, None, None, None, None, grad_bias


class _Gemm(torch.autograd.Function):
    """The autograd of ``gemm``: ``y = x W^T + b`` is linear in ``(x, b)``, so the tangent is the
    op itself on the tangents, ``x_t W^T + b_t`` (the same kernel, the same roundings)."""

    @staticmethod
    def forward(x, packed, absmax, codebook, tensor_scale, bits, out_features, bias):
        return call_below_autograd(_GEMM, x, packed, absmax, codebook, tensor_scale, bits, out_features, bias)

    @staticmethod
    def setup_context(ctx, inputs, output):
        ctx.set_materialize_grads(False)  # a frozen weight tensor reaches jvp as None, not zeros
        _gemm_setup_context(ctx, inputs, output)
        ctx.save_for_forward(*inputs[1:5])
        ctx.out_shape = output.shape

    @staticmethod
    def backward(ctx, grad):
        if grad is None:  # (grads are not materialized: see setup_context)
            return (None,) * 8
        return _gemm_grads(ctx, grad, _DEQUANTIZE)

    @staticmethod
    def jvp(ctx, x_t, packed_t, absmax_t, codebook_t, tensor_scale_t, bits_t, out_features_t, bias_t):
        check_frozen_tangents("gemm", codebook=codebook_t, tensor_scale=tensor_scale_t)
        if x_t is None:
            return bias_tangent(bias_t, ctx.x_dtype, ctx.out_shape)
        packed, absmax, codebook, tensor_scale = ctx.saved_tensors
        return gemm(x_t, packed, absmax, codebook, tensor_scale, ctx.bits, ctx.out_features, bias_t)


register_function_autograd(f"{_NS}::gemm", _Gemm)


# ---------------------------------------------------------------------------------------
# the eager fast path of gemm
# ---------------------------------------------------------------------------------------

_eager_gemm: dict[str, Callable[..., torch.Tensor]] = {}  # device type -> backend function


def _register(table: dict[str, Callable[..., torch.Tensor]], device_type: str, fn: Callable[..., torch.Tensor],
              device_types: tuple[str, ...]) -> None:
    """The checks and the entry of every ``register_eager_*`` function."""
    if not callable(fn):
        raise TypeError(f"fn must be callable, got {type(fn).__name__}")
    if device_type not in device_types:
        raise ValueError(f"device_type must be {' or '.join(map(repr, device_types))}, got {device_type!r}")
    table[device_type] = fn


def register_eager_gemm(device_type: str, fn: Callable[..., torch.Tensor]) -> None:
    """Let a backend take eager :func:`gemm` calls on ``device_type`` tensors directly (backends
    register themselves on import).

    ``fn`` has the op's signature and must compute the same thing as the op's implementation
    for that device, input checks included.
    """
    _register(_eager_gemm, device_type, fn, ("cpu", "cuda"))


def register_eager_cuda_gemm(fn: Callable[..., torch.Tensor]) -> None:
    """``register_eager_gemm("cuda", fn)``."""
    register_eager_gemm("cuda", fn)


_eager_dequantize: dict[str, Callable[..., torch.Tensor]] = {}  # device type -> backend function


def register_eager_dequantize(device_type: str, fn: Callable[..., torch.Tensor]) -> None:
    """Let a backend take the dequantize of eager training backward passes on ``device_type``
    directly (see :class:`_EagerGemm`).

    ``fn`` has the ``kbit_linear::dequantize`` signature and computes what the op computes on
    that device; it may skip the op's input checks, since it only sees a weight that the
    forward's gemm already checked.
    """
    _register(_eager_dequantize, device_type, fn, ("cuda",))


class _EagerGemm(torch.autograd.Function):
    """gemm under eager autograd on a device with fast paths (training: QLoRA).

    The same forward and gradients as the op's registered autograd (``_gemm_setup_context``,
    ``_gemm_grads``), reaching the backend functions directly instead of through the dispatcher
    and the op's Python autograd wrapper: a training step's host time per layer call is close to
    the GPU time of its layers, so every microsecond of it can show in the step time.
    """

    # forward takes ctx itself: a separate setup_context staticmethod would make every apply()
    # bind the arguments through inspect.signature (~50 us of host time per call).
    @staticmethod
    def forward(ctx, x, packed, absmax, codebook, tensor_scale, bits, out_features, bias):
        inputs = (x, packed, absmax, codebook, tensor_scale, bits, out_features, bias)
        out = _eager_gemm[x.device.type](*inputs)
        _gemm_setup_context(ctx, inputs, out)
        return out

    @staticmethod
    def backward(ctx, grad):
        return _gemm_grads(ctx, grad, _eager_dequantize[grad.device.type])


def _traced_or_transformed() -> bool:
    """Whether something watches the ops of this call and must see the op itself: a Python
    dispatch mode (FakeTensorMode, make_fx, profilers of FLOPs), a torch-function mode (e.g.
    ``with torch.device(...)``, which would also move the backend's temporaries) or a functorch
    transform (vmap, grad)."""
    return (
        torch._C._len_torch_dispatch_stack() > 0
        or torch._C._is_torch_function_mode_enabled()
        or torch._C._are_functorch_transforms_active()
    )


def gemm(
    x: torch.Tensor,
    packed: torch.Tensor,
    absmax: torch.Tensor,
    codebook: torch.Tensor,
    tensor_scale: torch.Tensor,
    bits: int,
    out_features: int,
    bias: torch.Tensor | None = None,
) -> torch.Tensor:
    """``x @ W^T (+ bias)``: the ``kbit_linear::gemm`` op, with an eager fast path.

    Eager calls go straight to the registered backend function of ``x``'s device, skipping the
    dispatcher's Python round trip (~11 us of a ~25 us call on an H100 host, ~40 us of a CPU
    call): CUDA inputs outside torch.compile tracing; plain CPU tensors outside tracing, Python
    modes and functorch transforms (the CPU backend is torch ops, which those would otherwise
    see one by one). When autograd records on CUDA (training), outside Python modes and
    functorch transforms, :class:`_EagerGemm` differentiates with the op's own gradient code; on
    CPU the op path differentiates. With a forward-mode AD level open every call takes the op,
    whose autograd carries the tangents (:func:`forward_ad_active`). Arguments as for the op
    (``docs/format.md``).
    """
    # (forward_ad_active inlined: this runs at every layer call)
    if not torch.compiler.is_compiling() and _fwAD._current_level < 0:
        recording = torch.is_grad_enabled() and (x.requires_grad or (bias is not None and bias.requires_grad))
        if x.is_cuda:
            fn = _eager_gemm.get("cuda")
            if fn is not None:
                if not recording:
                    return fn(x, packed, absmax, codebook, tensor_scale, bits, out_features, bias)
                if "cuda" in _eager_dequantize and type(x) is torch.Tensor and not _traced_or_transformed():
                    return _EagerGemm.apply(x, packed, absmax, codebook, tensor_scale, bits, out_features, bias)
        elif not recording and x.is_cpu and type(x) is torch.Tensor and not _traced_or_transformed():
            fn = _eager_gemm.get("cpu")
            if fn is not None:
                return fn(x, packed, absmax, codebook, tensor_scale, bits, out_features, bias)
    return _GEMM(x, packed, absmax, codebook, tensor_scale, bits, out_features, bias)


# ---------------------------------------------------------------------------------------
# the eager fast path of hadamard_rotate
# ---------------------------------------------------------------------------------------

_eager_rotate: dict[str, Callable[[torch.Tensor, torch.Tensor], torch.Tensor]] = {}


def register_eager_rotate(device_type: str, fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor]) -> None:
    """Let a backend take eager :func:`hadamard_rotate` calls on ``device_type`` tensors directly
    (as :func:`register_eager_gemm`; ``fn`` computes what the op computes on that device)."""
    _register(_eager_rotate, device_type, fn, ("cuda",))


def hadamard_rotate(x: torch.Tensor, signs: torch.Tensor) -> torch.Tensor:
    """``x R``: the ``kbit_linear::hadamard_rotate`` op, with the eager fast path of :func:`gemm`
    (CUDA inputs outside torch.compile tracing, autograd recording and forward-mode AD go
    straight to the backend; everything else through the op)."""
    if not isinstance(x, torch.Tensor):  # (the op checks the rest; the fast path reads x.is_cuda first)
        raise TypeError(f"x must be a floating-point tensor, got {type(x).__name__}")
    if (x.is_cuda and not torch.compiler.is_compiling() and not (torch.is_grad_enabled() and x.requires_grad)
            and _fwAD._current_level < 0):
        fn = _eager_rotate.get("cuda")
        if fn is not None:
            return fn(x, signs)
    return _ROTATE(x, signs)
