"""Op schemas of the GGUF block formats kept quantized (:mod:`kbit_linear.gguf_format`).

* ``kbit_linear::gguf_gemm(x, qs, qh, scale, mins, qtype, out_features, bias) -> Tensor``:
  ``x [M, K] @ W^T (+ bias)`` with ``W`` the GGUF weight dequantized to ``x``'s dtype;
* ``kbit_linear::gguf_gemm_a8(x, qs, qh, scale, mins, qtype, out_features, bias) -> Tensor``: the
  same product with 8-bit activations (x quantized per 32-value block as Q8_1, integer dot
  products: :func:`kbit_linear.gguf_format.matmul_a8`);
* ``kbit_linear::gguf_dequantize(qs, qh, scale, mins, qtype, out_features, in_features, dtype)
  -> Tensor``: the dense weight, bit for bit ``gguf``'s float32 dequantization rounded to ``dtype``.

``qtype`` is the block type's name (``"Q4_0"``, ``"Q4_1"``, ``"Q5_0"``, ``"Q5_1"``, ``"Q8_0"``);
``qh`` and ``mins`` are ``None`` for the types without them. Same layer as
:mod:`kbit_linear._ops`: schemas, fake implementations with metadata checks, the reference as
the default implementation; the CUDA backend registers its kernels.
"""

from __future__ import annotations

import torch

from . import _ops  # register_function_autograd and the forward-mode AD helpers
from . import format as fmt
from . import gguf_format as gf

_NS = "kbit_linear"

torch.library.define(
    f"{_NS}::gguf_gemm",
    "(Tensor x, Tensor qs, Tensor? qh, Tensor scale, Tensor? mins, str qtype, int out_features, Tensor? bias) -> Tensor",
)
torch.library.define(
    f"{_NS}::gguf_gemm_a8",
    "(Tensor x, Tensor qs, Tensor? qh, Tensor scale, Tensor? mins, str qtype, int out_features, Tensor? bias) -> Tensor",
)
torch.library.define(
    f"{_NS}::gguf_dequantize",
    "(Tensor qs, Tensor? qh, Tensor scale, Tensor? mins, str qtype, int out_features, int in_features, "
    "ScalarType dtype) -> Tensor",
)


def check_gemm_args(x: torch.Tensor, qs: torch.Tensor, qh: torch.Tensor | None, scale: torch.Tensor, mins: torch.Tensor | None,
                    qtype: str, out_features: int, bias: torch.Tensor | None) -> None:
    """Metadata checks of ``gguf_gemm`` (no pass over values).

    Raises:
        TypeError / ValueError: naming the argument.
    """
    if not isinstance(x, torch.Tensor) or not x.is_floating_point() or x.dim() != 2:
        raise TypeError(f"x must be a floating-point [rows, in_features] tensor, got "
                        f"{getattr(x, 'dtype', type(x).__name__)} {tuple(getattr(x, 'shape', ()))}")
    t = gf.block_type(qtype)
    if isinstance(qs, torch.Tensor) and qs.dim() == 2:
        k = qs.shape[1] * (1 if t.bits == 8 else 2)  # weights per row that qs holds
        if x.shape[1] != k:
            raise ValueError(f"x has {x.shape[1]} in-features, the {t.name} weight (qs {tuple(qs.shape)}) has {k}")
    gf.check_weight(qs, qh, scale, mins, qtype, out_features, x.shape[1])
    if qs.device != x.device:
        raise ValueError(f"qs is on {qs.device}, x on {x.device}: all tensors must be on one device")
    if bias is not None:
        if not isinstance(bias, torch.Tensor) or tuple(bias.shape) != (out_features,) or bias.device != x.device:
            raise ValueError(f"bias must be a [{out_features}] tensor on {x.device}, got "
                             f"{tuple(getattr(bias, 'shape', ()))} on {getattr(bias, 'device', None)}")


@torch.library.register_fake(f"{_NS}::gguf_gemm")
def _(x, qs, qh, scale, mins, qtype, out_features, bias):
    check_gemm_args(x, qs, qh, scale, mins, qtype, out_features, bias)
    return x.new_empty((x.shape[0], out_features))


def gguf_gemm_reference(x, qs, qh, scale, mins, qtype, out_features, bias):
    """The spec: :func:`kbit_linear.gguf_format.matmul`."""
    check_gemm_args(x, qs, qh, scale, mins, qtype, out_features, bias)
    weight = gf.GGUFWeight(qs, qh, scale, mins, qtype, out_features, x.shape[1])
    with torch.autocast(x.device.type, enabled=False):  # the output in x's dtype, as the schema says, under autocast too
        return gf.matmul(x, weight, None if bias is None else bias.to(x.dtype))


torch.library.impl(f"{_NS}::gguf_gemm", "default")(gguf_gemm_reference)  # not as a decorator: torch 2.11 binds its result (None) to the name


@torch.library.register_fake(f"{_NS}::gguf_gemm_a8")
def _(x, qs, qh, scale, mins, qtype, out_features, bias):
    check_gemm_args(x, qs, qh, scale, mins, qtype, out_features, bias)
    return x.new_empty((x.shape[0], out_features))


def gguf_gemm_a8_reference(x, qs, qh, scale, mins, qtype, out_features, bias):
    """The spec: :func:`kbit_linear.gguf_format.matmul_a8`."""
    check_gemm_args(x, qs, qh, scale, mins, qtype, out_features, bias)
    with torch.autocast(x.device.type, enabled=False):  # (as gguf_gemm_reference)
        return gf.matmul_a8(x, gf.GGUFWeight(qs, qh, scale, mins, qtype, out_features, x.shape[1]), bias)


torch.library.impl(f"{_NS}::gguf_gemm_a8", "default")(gguf_gemm_a8_reference)  # not as a decorator: torch 2.11 binds its result (None) to the name


def check_dequantize_args(qs: torch.Tensor, qh: torch.Tensor | None, scale: torch.Tensor, mins: torch.Tensor | None, qtype: str,
                          out_features: int, in_features: int, dtype: torch.dtype) -> None:
    """Metadata checks of ``gguf_dequantize``."""
    gf.check_weight(qs, qh, scale, mins, qtype, out_features, in_features)
    fmt.check_float_dtype(dtype)


@torch.library.register_fake(f"{_NS}::gguf_dequantize")
def _(qs, qh, scale, mins, qtype, out_features, in_features, dtype):
    check_dequantize_args(qs, qh, scale, mins, qtype, out_features, in_features, dtype)
    return qs.new_empty((out_features, in_features), dtype=dtype)


def gguf_dequantize_reference(qs, qh, scale, mins, qtype, out_features, in_features, dtype):
    """The spec: :func:`kbit_linear.gguf_format.dequantize`."""
    check_dequantize_args(qs, qh, scale, mins, qtype, out_features, in_features, dtype)
    return gf.dequantize(gf.GGUFWeight(qs, qh, scale, mins, qtype, out_features, in_features), dtype)


torch.library.impl(f"{_NS}::gguf_dequantize", "default")(gguf_dequantize_reference)  # not as a decorator: torch 2.11 binds its result (None) to the name


# autograd of both products (reverse and forward mode): gradients and tangents reach x and the
# bias; the GGUF weight is frozen.
_GEMM = torch.ops.kbit_linear.gguf_gemm.default
_GEMM_A8 = torch.ops.kbit_linear.gguf_gemm_a8.default


def _gemm_setup_context(ctx, inputs, output):
    x, qs, qh, scale, mins, qtype, out_features, bias = inputs
    ctx.set_materialize_grads(False)  # a frozen weight tensor reaches jvp as None, not zeros
    ctx.save_for_backward(qs, qh, scale, mins)
    ctx.save_for_forward(qs, qh, scale, mins)
    ctx.qtype, ctx.out_features, ctx.in_features = qtype, out_features, x.shape[-1]
    ctx.x_dtype = x.dtype
    ctx.bias_dtype = None if bias is None else bias.dtype
    ctx.out_shape = output.shape


def _gemm_backward(ctx, grad):
    if grad is None:  # (grads are not materialized: see _gemm_setup_context)
        return (None,) * 8
    qs, qh, scale, mins = ctx.saved_tensors
    grad_x = grad_bias = None
    if ctx.needs_input_grad[0]:
        # dL/dx = dL/dy @ W, with the dequantized weight in the gradient's dtype (the weight is frozen).
        w = torch.ops.kbit_linear.gguf_dequantize(qs, qh, scale, mins, ctx.qtype, ctx.out_features, ctx.in_features, grad.dtype)
        grad_x = (grad @ w).to(ctx.x_dtype)
    if ctx.bias_dtype is not None and ctx.needs_input_grad[7]:
        grad_bias = grad.reshape(-1, ctx.out_features).sum(0).to(ctx.bias_dtype)
    return grad_x, None, None, None, None, None, None, grad_bias


def _gemm_jvp(op, ctx, x_t, qs_t, qh_t, scale_t, mins_t, qtype_t, out_features_t, bias_t):
    """The tangent ``x_t W^T + b_t``: ``gguf_gemm`` on the tangents (for ``gguf_gemm_a8`` too, whose
    activation rounding the tangent passes straight through, as its gradient does)."""
    _ops.check_frozen_tangents(op, scale=scale_t, mins=mins_t)
    if x_t is None:
        return _ops.bias_tangent(bias_t, ctx.x_dtype, ctx.out_shape)
    qs, qh, scale, mins = ctx.saved_tensors
    return _GEMM(x_t, qs, qh, scale, mins, ctx.qtype, ctx.out_features, bias_t)


def _register_gemm_autograd(name: str, op) -> None:
    """Make an autograd.Function for the GGUF product ``name`` (``op``) its Autograd kernel (see
    :func:`kbit_linear._ops.register_function_autograd`): gradients and tangents reach ``x`` and the
    bias; the GGUF weight is frozen. ``gguf_gemm_a8``'s 8-bit activation rounding is passed straight
    through, gradient and tangent alike."""

    class Function(torch.autograd.Function):
        @staticmethod
        def forward(x, qs, qh, scale, mins, qtype, out_features, bias):
            return _ops.call_below_autograd(op, x, qs, qh, scale, mins, qtype, out_features, bias)

        setup_context = staticmethod(_gemm_setup_context)
        backward = staticmethod(_gemm_backward)

        @staticmethod
        def jvp(ctx, *tangents):
            return _gemm_jvp(name, ctx, *tangents)

    Function.__name__ = Function.__qualname__ = f"_{name}_autograd"
    _ops.register_function_autograd(f"{_NS}::{name}", Function)


_register_gemm_autograd("gguf_gemm", _GEMM)
_register_gemm_autograd("gguf_gemm_a8", _GEMM_A8)
