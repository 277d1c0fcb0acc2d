"""Persistent split-K scratch buffers for the CUDA kernels.

Both GEMM kernels sum the partial results of a split output tile in an fp32 workspace and
count contributors in int32 counters. The kernels leave the counters (and, for the decode
kernel, the workspace) zero when they finish, so one zeroed buffer can serve every later launch
without a memset.

The buffers are kept per (user, device, stream): launches on one stream run in order, launches
on different streams never share a buffer. They are allocated on a private side stream, so
they never come from a CUDA-graph memory pool (a graph capture or torch.compile's CUDA-graph
warm-up routes only the capturing stream's allocations there), and zeroed there before first
use, so a captured graph holds no memset node for them. A buffer that is outgrown is retired
but never freed: a graph captured earlier may still point at it.

Limit: graphs captured on the same stream share that stream's buffers, so they must not be
replayed concurrently on different streams (replaying them one after another, on any stream,
is fine).
"""

from __future__ import annotations

import contextlib
import ctypes
import threading
from typing import Iterator

import torch

__all__ = ["zeroed_scratch"]

_buffers: dict[tuple[str, int, int, str], torch.Tensor] = {}
_retired: list[torch.Tensor] = []  # outgrown buffers, kept alive for graphs that captured them
_side_streams: dict[int, torch.cuda.Stream] = {}
_lock = threading.Lock()


def _side_stream(index: int) -> torch.cuda.Stream:
    stream = _side_streams.get(index)
    if stream is None:
        stream = _side_streams[index] = torch.cuda.Stream(device=index)
    return stream


_CU_STREAM_CAPTURE_MODE_RELAXED = 2
_libcuda: ctypes.CDLL | None = None


@contextlib.contextmanager
def _relaxed_capture_mode() -> Iterator[None]:
    """Let this thread make calls that a capture in the default ("global") mode forbids.

    The side-stream work below never touches the capturing stream, but creating a stream and
    synchronising one count as unsafe while this thread captures, and would invalidate the
    capture (torch relaxes the mode the same way around its own cudaMalloc calls).
    """
    global _libcuda
    if _libcuda is None:
        _libcuda = ctypes.CDLL("libcuda.so.1")
    mode = ctypes.c_int(_CU_STREAM_CAPTURE_MODE_RELAXED)
    if _libcuda.cuThreadExchangeStreamCaptureMode(ctypes.byref(mode)) != 0:
        raise RuntimeError("cuThreadExchangeStreamCaptureMode failed")
    try:
        yield
    finally:
        _libcuda.cuThreadExchangeStreamCaptureMode(ctypes.byref(mode))


def _allocate_zeroed(index: int, numel: int, dtype: torch.dtype) -> torch.Tensor:
    """A zeroed tensor from the default memory pool, ready when this returns."""
    capturing = torch.cuda.is_current_stream_capturing()
    with _relaxed_capture_mode() if capturing else contextlib.nullcontext():
        side = _side_stream(index)
        with torch.cuda.device(index), torch.cuda.stream(side):
            buf = torch.zeros(numel, dtype=dtype, device=torch.device("cuda", index))
        # The zeros are visible to whatever stream (or graph) uses the buffer next.
        side.synchronize()
    return buf


def _get(key: tuple[str, int, int, str], numel: int, dtype: torch.dtype) -> torch.Tensor:
    buf = _buffers.get(key)
    if buf is not None and buf.numel() >= numel:
        return buf
    with _lock:
        buf = _buffers.get(key)
        if buf is None or buf.numel() < numel:
            if buf is not None:
                _retired.append(buf)
                numel = max(numel, buf.numel() * 3 // 2)  # grow geometrically: few retired buffers
            buf = _buffers[key] = _allocate_zeroed(key[1], max(numel, 1024), dtype)
    return buf


def zeroed_scratch(user: str, index: int, stream: int, ws_floats: int, counters: int) -> tuple[torch.Tensor, torch.Tensor]:
    """fp32 workspace and int32 counters, zero on first use, kept for later launches.

    Args:
        user: which kernel family owns the buffers (kernels that leave different parts
            non-zero must not share them).
        index: CUDA device index.
        stream: raw handle of the stream the launch goes on.
        ws_floats: fp32 workspace elements needed (may be 0).
        counters: int32 counters needed (may be 0).

    Returns:
        ``(workspace, counters)``: two 1-D tensors with at least the requested sizes (only
        their start addresses matter to the kernels). The caller's kernel must leave the
        counters zero (and the workspace too, when it relies on it being zero).
    """
    if ws_floats < 0 or counters < 0:
        raise ValueError(f"ws_floats and counters must be >= 0, got {ws_floats} and {counters}")
    ws = _get((user, index, stream, "ws"), ws_floats, torch.float32)
    cnt = _get((user, index, stream, "counters"), counters, torch.int32)
    return ws, cnt
