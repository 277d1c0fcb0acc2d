"""Op schemas: ``torch.library`` definitions of the kbit ops, their fake (meta) implementations,
and the pure-PyTorch reference registered as the default implementation for every device.

Backends (``kbit_linear/backends/``) register faster implementations for their device; the
reference stays the fallback and the spec. Schemas:

* ``kbit_linear::quantize(weight, codebook, tensor_scale, bits) -> (packed_flat, absmax_flat)``
* ``kbit_linear::repack(packed_flat, absmax_flat, bits) -> (packed, absmax)``
* ``kbit_linear::dequantize(packed, absmax, codebook, tensor_scale, bits, out_features, in_features, dtype) -> Tensor``
* ``kbit_linear::gemm(x, packed, absmax, codebook, tensor_scale, bits, out_features, bias) -> Tensor``

Shapes and dtypes are those of ``docs/format.md``: ``packed`` int32
``[K_pad/64, N_pad/128, 128, 2, bits]``, ``absmax`` uint8 ``[K_pad/64, N_pad/128, 128, 2]``,
``codebook`` float32 ``[2**bits]``, ``tensor_scale`` float32 ``[1]``.
"""

from __future__ import annotations

import torch

from . import format as fmt

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


# ---------------------------------------------------------------------------------------
# checks shared by the fake implementations and the backends (cheap: metadata only)
# ---------------------------------------------------------------------------------------


def check_bits(bits: int) -> None:
    """``bits`` must be 2..5."""
    torch._check_value(bits in fmt.SUPPORTED_BITS, lambda: f"bits must be one of {fmt.SUPPORTED_BITS}, got {bits}")


def check_weight_args(weight: torch.Tensor, codebook: torch.Tensor, tensor_scale: torch.Tensor, bits: int) -> None:
    """Metadata checks for ``quantize``."""
    check_bits(bits)
    torch._check_type(weight.is_floating_point(), lambda: f"weight must be floating point, got {weight.dtype}")
    torch._check_value(weight.dim() == 2, lambda: f"weight must be 2-D [out, in], got shape {tuple(weight.shape)}")
    torch._check_value(weight.numel() > 0, lambda: "weight must not be empty")
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


def check_tiled_args(packed: torch.Tensor, absmax: torch.Tensor, bits: int, out_features: int) -> tuple[int, int]:
    """Metadata checks for a tiled weight; returns ``(N_pad, K_pad)``."""
    check_bits(bits)
    kb = fmt.TILE_K // fmt.BLOCK_SIZE
    torch._check_type(packed.dtype == torch.int32, lambda: f"packed must be int32, got {packed.dtype}")
    torch._check_type(absmax.dtype == torch.uint8, lambda: f"absmax must be uint8, got {absmax.dtype}")
    torch._check_value(
        packed.dim() == 5 and tuple(packed.shape[2:]) == (fmt.TILE_N, kb, bits),
        lambda: f"packed must have shape [k_tiles, n_tiles, {fmt.TILE_N}, {kb}, bits={bits}], got {tuple(packed.shape)}",
    )
    torch._check_value(
        tuple(absmax.shape) == tuple(packed.shape[:4]),
        lambda: f"absmax shape {tuple(absmax.shape)} does not match packed {tuple(packed.shape)}",
    )
    torch._check_value(absmax.device == packed.device, lambda: f"absmax is on {absmax.device}, packed on {packed.device}")
    n_pad, k_pad = packed.shape[1] * fmt.TILE_N, packed.shape[0] * fmt.TILE_K
    torch._check_value(
        n_pad - fmt.TILE_N < out_features <= n_pad,
        lambda: f"out_features={out_features} does not match packed tiles padded to {n_pad}",
    )
    return n_pad, k_pad


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
    """Metadata checks for ``gemm``."""
    _, k_pad = check_tiled_args(packed, absmax, bits, out_features)
    torch._check_type(x.is_floating_point(), lambda: f"x must be floating point, got {x.dtype}")
    torch._check_value(x.dim() >= 1, lambda: "x must have at least one dimension")
    k = x.shape[-1]
    torch._check_value(
        k_pad - fmt.TILE_K < k <= k_pad,
        lambda: f"x's last dimension {k} does not match the weight's in_features (padded to {k_pad})",
    )
    torch._check_value(x.device == packed.device, lambda: f"x is on {x.device}, weight on {packed.device}")
    check_codebook_args(codebook, tensor_scale, bits, packed.device)
    if bias is not None:
        torch._check_value(
            bias.dim() == 1 and bias.shape[0] == out_features,
            lambda: f"bias must have shape [{out_features}], got {tuple(bias.shape)}",
        )
        torch._check_value(bias.device == x.device, lambda: f"bias is on {bias.device}, x on {x.device}")


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


def _tiled_shapes(n: int, nblk: int, bits: int) -> tuple[tuple[int, ...], tuple[int, ...]]:
    n_pad, k_pad = fmt.padded_shape(n, nblk * fmt.BLOCK_SIZE)
    kt, nt, kb = k_pad // fmt.TILE_K, n_pad // fmt.TILE_N, fmt.TILE_K // fmt.BLOCK_SIZE
    return (kt, nt, fmt.TILE_N, kb, bits), (kt, nt, fmt.TILE_N, kb)


@torch.library.register_fake(f"{_NS}::repack")
def _(packed_flat, absmax_flat, bits):
    check_bits(bits)
    torch._check_type(packed_flat.dtype == torch.int32, lambda: f"packed_flat must be int32, got {packed_flat.dtype}")
    torch._check_type(absmax_flat.dtype == torch.uint8, lambda: f"absmax_flat must be uint8, got {absmax_flat.dtype}")
    torch._check_value(
        packed_flat.dim() == 3 and packed_flat.shape[-1] == bits,
        lambda: f"packed_flat must have shape [N, blocks, bits={bits}], got {tuple(packed_flat.shape)}",
    )
    torch._check_value(tuple(absmax_flat.shape) == tuple(packed_flat.shape[:2]), lambda: "absmax_flat does not match packed_flat")
    p_shape, a_shape = _tiled_shapes(packed_flat.shape[0], packed_flat.shape[1], bits)
    return packed_flat.new_empty(p_shape), absmax_flat.new_empty(a_shape)


@torch.library.register_fake(f"{_NS}::dequantize")
def _(packed, absmax, codebook, tensor_scale, bits, out_features, in_features, dtype):
    _, k_pad = check_tiled_args(packed, absmax, bits, out_features)
    torch._check_value(k_pad - fmt.TILE_K < in_features <= k_pad, lambda: f"in_features={in_features} does not match tiles padded to {k_pad}")
    check_codebook_args(codebook, tensor_scale, bits, packed.device)
    return packed.new_empty((out_features, in_features), dtype=dtype)


@torch.library.register_fake(f"{_NS}::gemm")
def _(x, packed, absmax, codebook, tensor_scale, bits, out_features, bias):
    check_gemm_args(x, packed, absmax, codebook, tensor_scale, bits, out_features, bias)
    return x.new_empty((*x.shape[:-1], out_features))


# ---------------------------------------------------------------------------------------
# reference implementations (default for every device; the spec)
# ---------------------------------------------------------------------------------------


@torch.library.impl(f"{_NS}::quantize", "default")
def _(weight, codebook, tensor_scale, bits):
    check_weight_args(weight, codebook, tensor_scale, bits)
    packed, absmax, _ = fmt.quantize_blockwise(weight, bits, codebook, tensor_scale)
    return packed, absmax


@torch.library.impl(f"{_NS}::repack", "default")
def _(packed_flat, absmax_flat, bits):
    return fmt.tile_blocks(packed_flat, absmax_flat, bits)


@torch.library.impl(f"{_NS}::dequantize", "default")
def _(packed, absmax, codebook, tensor_scale, bits, out_features, in_features, dtype):
    qw = fmt.KbitWeight(packed, absmax, codebook, tensor_scale, bits, out_features, in_features)
    return fmt.dequantize(qw, dtype)


@torch.library.impl(f"{_NS}::gemm", "default")
def _(x, packed, absmax, codebook, tensor_scale, bits, out_features, bias):
    check_gemm_args(x, packed, absmax, codebook, tensor_scale, bits, out_features, bias)
    qw = fmt.KbitWeight(packed, absmax, codebook, tensor_scale, bits, out_features, x.shape[-1])
    return fmt.matmul(x, qw, bias)


# ---------------------------------------------------------------------------------------
# autograd for gemm: gradients flow to x and bias (the quantized weight is frozen), so
# adapters trained on top of a quantized model (LoRA) work through these layers.
# ---------------------------------------------------------------------------------------


def _gemm_setup_context(ctx, inputs, output):
    x, packed, absmax, codebook, tensor_scale, bits, out_features, bias = inputs
    ctx.save_for_backward(packed, absmax, codebook, tensor_scale)
    ctx.bits, ctx.out_features, ctx.in_features = bits, out_features, x.shape[-1]
    ctx.x_dtype = x.dtype
    ctx.bias_dtype = None if bias is None else bias.dtype


def _gemm_backward(ctx, grad):
    packed, absmax, codebook, tensor_scale = ctx.saved_tensors
    grad_x = grad_bias = None
    if ctx.needs_input_grad[0]:
        # dL/dx = dL/dy @ W_hat, with the dequantized weight in the gradient's dtype.
        w = torch.ops.kbit_linear.dequantize(
            packed, absmax, codebook, tensor_scale, ctx.bits, ctx.out_features, ctx.in_features, grad.dtype
        )
        grad_x = (grad @ w).to(ctx.x_dtype)
    if ctx.bias_dtype is not None and ctx.needs_input_grad[7]:
        grad_bias = grad.reshape(-1, ctx.out_features).sum(0).to(ctx.bias_dtype)
    return grad_x, None, None, None, None, None, None, grad_bias


torch.library.register_autograd(f"{_NS}::gemm", _gemm_backward, setup_context=_gemm_setup_context)
