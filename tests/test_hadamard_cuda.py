"""GPU tests of the Hadamard rotation kernel (``kernels/hadamard.cu``) against the reference
(:func:`kbit_linear.hadamard.rotate` in float64 on the same rounded inputs)."""

from __future__ import annotations

import pytest
import torch

from kbit_linear import _ops
from kbit_linear import hadamard as hd
from kbit_linear.backends.cuda import hadamard as khd

pytestmark = [pytest.mark.cuda, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]


def _poison(nbytes: int) -> None:
    """Fill the allocator's next blocks with NaN: outputs the kernel does not write stay NaN."""
    for n in (nbytes, 4 * nbytes):
        torch.full((n // 4 + 1,), float("nan"), device="cuda")


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=str)
@pytest.mark.parametrize("k", [8, 24, 64, 96, 100, 576, 640, 4096, 14336])
@pytest.mark.parametrize("m", [1, 3, 129])
def test_kernel_matches_reference(dtype, k, m):
    g = torch.Generator(device="cuda").manual_seed(k * 1000 + m)
    x = torch.randn(m, k, device="cuda", dtype=dtype, generator=g) * 3
    signs = hd.random_signs(k, seed=k, device="cuda")
    _poison(x.numel() * x.element_size())
    y = khd.hadamard_rotate_cuda(x, signs)
    ref = hd.rotate(x.double(), signs)
    assert y.dtype == dtype and y.shape == x.shape and not y.isnan().any()
    tol = 1e-2 if dtype == torch.bfloat16 else 2e-3
    torch.testing.assert_close(y.double(), ref, atol=tol * ref.abs().max().item(), rtol=tol)


def test_views_and_leading_dimensions():
    x = torch.randn(7, 3, 512, device="cuda", dtype=torch.float16)
    signs = hd.random_signs(512, seed=1, device="cuda")
    y = _ops.hadamard_rotate(x, signs)
    torch.testing.assert_close(y.double(), hd.rotate(x.double(), signs), atol=2e-3 * 8, rtol=2e-3)
    wide = torch.randn(4, 1024, device="cuda", dtype=torch.bfloat16)
    view = wide[:, 256:768]  # not contiguous
    torch.testing.assert_close(_ops.hadamard_rotate(view, signs).double(), hd.rotate(view.double(), signs), atol=5e-2, rtol=1e-2)


def test_op_path_autograd_and_compile():
    x = torch.randn(5, 256, device="cuda", dtype=torch.float16, requires_grad=True)
    signs = hd.random_signs(256, seed=2, device="cuda")
    y = _ops.hadamard_rotate(x, signs)  # autograd records: the op path
    w = torch.randn_like(y)
    (y * w).sum().backward()
    torch.testing.assert_close(x.grad.double(), hd.unrotate(w.double(), signs), atol=1e-2, rtol=1e-2)
    fn = torch.compile(lambda t: torch.ops.kbit_linear.hadamard_rotate(t, signs), fullgraph=True)
    z = x.detach()
    torch.testing.assert_close(fn(z), khd.hadamard_rotate_cuda(z, signs))


def test_bad_arguments_are_named():
    x = torch.randn(2, 64, device="cuda", dtype=torch.float16)
    with pytest.raises(ValueError, match="signs"):
        khd.hadamard_rotate_cuda(x, torch.ones(32, dtype=torch.int8, device="cuda"))
    with pytest.raises(TypeError, match="signs"):
        khd.hadamard_rotate_cuda(x, torch.ones(64, device="cuda"))
    with pytest.raises(ValueError, match="device"):
        khd.hadamard_rotate_cuda(x, torch.ones(64, dtype=torch.int8))
    with pytest.raises(TypeError, match="x"):
        khd.hadamard_rotate_cuda(x.to(torch.int32), torch.ones(64, dtype=torch.int8, device="cuda"))
