"""Persistent split-K scratch buffers (``kbit_linear/backends/cuda/workspace.py``).

The GPU tests check what the buffers promise: zeros on first use, one per stream and user,
outgrown buffers still valid, and a graph captured before any eager call (so its buffers are
allocated during the capture) replays correctly for both kernels. torch.compile's CUDA-graph
mode with split launches is covered in test_module_cuda.py.
"""

from __future__ import annotations

import ctypes

import pytest
import torch
import torch.nn.functional as F

from kbit_linear import format as fmt
from kbit_linear.backends import cuda as cuda_backend
from kbit_linear.backends.cuda import decode, driver, loader, workspace



def gpu(fn):
    """Mark a test as a GPU test (marker ``cuda``, skipped without a GPU or CuPy)."""
    fn = pytest.mark.skipif(not loader.cupy_available(), reason="needs CuPy (pip install 'kbit-linear[cuda]')")(fn)
    fn = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs an NVIDIA GPU")(fn)
    return pytest.mark.cuda(fn)


def test_rejects_negative_sizes():
    with pytest.raises(ValueError, match="ws_floats and counters"):
        workspace.zeroed_scratch("decode", 0, 0, -1, 4)
    with pytest.raises(ValueError, match="ws_floats and counters"):
        workspace.zeroed_scratch("decode", 0, 0, 4, -2)


def _read_words(ptr: int, n: int) -> list[int]:
    """n 32-bit words at a device pointer (synchronous driver copy)."""
    lib = driver.lib()
    host = (ctypes.c_uint32 * n)()
    torch.cuda.synchronize()
    assert lib.cuMemcpyDtoH_v2(ctypes.addressof(host), ptr, 4 * n) == 0
    return list(host)


def test_nothing_asked_for_is_a_null_pointer(monkeypatch):
    # no allocation at all (so no GPU needed): the router's launches ask for a counter only
    monkeypatch.setattr(workspace, "_buffers", {})
    assert workspace.zeroed_scratch("router", 0, 0, 0, 0) == (0, 0)
    assert workspace._buffers == {}


@gpu
def test_buffers_are_zero_kept_and_grow(monkeypatch):
    monkeypatch.setattr(workspace, "_buffers", {})
    stream = torch.cuda.current_stream().cuda_stream
    ws, cnt = workspace.zeroed_scratch("test", 0, stream, 5000, 70)
    assert ws and cnt and ws != cnt
    assert not any(_read_words(ws, 5000)) and not any(_read_words(cnt, 70))
    assert workspace.zeroed_scratch("test", 0, stream, 100, 3) == (ws, cnt)  # kept
    assert workspace.zeroed_scratch("test", 0, torch.cuda.Stream().cuda_stream, 100, 3)[0] != ws  # per stream
    assert workspace.zeroed_scratch("other", 0, stream, 100, 3)[0] != ws  # per user
    ws0, cnt0 = workspace.zeroed_scratch("counter only", 0, stream, 0, 1)
    assert ws0 == 0 and cnt0 and not any(_read_words(cnt0, 1))  # no workspace where none is asked for
    grown, _ = workspace.zeroed_scratch("test", 0, stream, 50000, 3)
    assert grown != ws and not any(_read_words(grown, 50000))
    assert not any(_read_words(ws, 5000))  # the outgrown buffer is still valid memory (never freed)


def _weight(k: int, n: int, bits: int) -> tuple[fmt.KbitWeight, torch.Tensor]:
    w = torch.randn(n, k, device="cuda")
    qw = fmt.quantize(w, bits)
    return qw, fmt.dequantize(qw, torch.float32)


@gpu
@pytest.mark.parametrize("kernel", ("decode", "fused"))
def test_graph_captured_before_any_eager_call(kernel, monkeypatch):
    """The buffers are first allocated during the capture; replays with new x stay correct."""
    monkeypatch.setattr(workspace, "_buffers", {})
    bits, k, n, m, dtype = 3, 14336, 1024, 4 if kernel == "decode" else 64, torch.float16
    qw, w = _weight(k, n, bits)
    static_x = torch.randn(m, k, device="cuda", dtype=dtype)
    static_out = torch.full((m, n), float("nan"), dtype=dtype, device="cuda")

    def call() -> None:
        if kernel == "decode":
            decode.decode_gemm(static_x, qw.packed, qw.absmax, qw.codebook, qw.tensor_scale, bits, n, static_out,
                               schedule_kind="stream-k")
        else:
            cuda_backend.gemm_cuda(static_x, qw.packed, qw.absmax, qw.codebook, qw.tensor_scale, bits, n, path="fused",
                                   split_k=4, out=static_out)

    if kernel == "decode":
        assert decode.decode_plan(m, bits, dtype, n, qw.packed.shape[0], schedule_kind="stream-k").split
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        call()
    assert workspace._buffers, "the capture allocated the split-K buffers"
    for _ in range(3):
        static_x.copy_(torch.randn(m, k, device="cuda", dtype=dtype))
        static_out.fill_(float("nan"))
        graph.replay()
        torch.cuda.synchronize()
        assert not torch.isnan(static_out).any()
        ref = F.linear(static_x.float(), w)
        err = ((static_out.float() - ref).norm() / ref.norm()).item()
        assert err < 5e-3, f"relative error {err:.2e}"
    # An eager call on the current stream afterwards gets its own buffers and agrees.
    static_out.fill_(float("nan"))
    call()
    ref = F.linear(static_x.float(), w)
    assert ((static_out.float() - ref).norm() / ref.norm()).item() < 5e-3
