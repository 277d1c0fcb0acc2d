"""Persistent split-K scratch buffers for the CUDA kernels.

Both GEMM kernels sum the partial results of a split output tile in an fp32 workspace and
count contributors in int32 counters. The kernels leave the counters (and, for the decode
kernel, the workspace) zero when they finish, so one zeroed buffer can serve every later launch
without a memset.

The buffers are kept per (user, device, stream): launches on one stream run in order, launches
on different streams never share a buffer. They come straight from the driver (``cuMemAlloc``),
not from torch's caching allocator, so no CUDA-graph memory pool ever holds them (a capture, or
torch.compile's CUDA-graph warm-up, would otherwise claim them and flag them as leaked), and
they are zeroed on a private side stream before first use, so a captured graph holds no memset
node for them. They are never freed: a graph captured earlier may still point at a buffer that
was outgrown. (A few MB per device and stream at most.)

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

from .driver import check, lib

__all__ = ["zeroed_scratch"]

_buffers: dict[tuple[str, int, int, str], tuple[int, int]] = {}  # key -> (device pointer, bytes)
_side_streams: dict[int, torch.cuda.Stream] = {}
_lock = threading.Lock()
_CU_STREAM_CAPTURE_MODE_RELAXED = 2


@contextlib.contextmanager
def _relaxed_capture_mode() -> Iterator[None]:
    """Let this thread make calls that a capture in the default ("global") mode forbids.

    The side-stream work below never touches the capturing stream, but allocating, creating a
    stream and synchronising one count as unsafe while this thread captures, and would
    invalidate the capture (torch relaxes the mode the same way around its own cudaMalloc).
    """
    cu = lib()
    mode = ctypes.c_int(_CU_STREAM_CAPTURE_MODE_RELAXED)
    check(cu.cuThreadExchangeStreamCaptureMode(ctypes.byref(mode)), "cuThreadExchangeStreamCaptureMode")
    try:
        yield
    finally:
        cu.cuThreadExchangeStreamCaptureMode(ctypes.byref(mode))


def _allocate_zeroed(index: int, nbytes: int) -> int:
    """Device pointer to ``nbytes`` of zeros from the driver, ready when this returns."""
    capturing = torch.cuda.is_current_stream_capturing()
    cu = lib()
    with torch.cuda.device(index), _relaxed_capture_mode() if capturing else contextlib.nullcontext():
        side = _side_streams.get(index)
        if side is None:
            side = _side_streams[index] = torch.cuda.Stream(device=index)
        ptr = ctypes.c_uint64(0)
        check(cu.cuMemAlloc_v2(ctypes.byref(ptr), nbytes), f"cuMemAlloc of {nbytes} bytes")
        check(cu.cuMemsetD32Async(ptr.value, 0, nbytes // 4, side.cuda_stream), "cuMemsetD32Async")
        check(cu.cuStreamSynchronize(side.cuda_stream), "cuStreamSynchronize")
    return ptr.value


def _get(key: tuple[str, int, int, str], nbytes: int) -> int:
    if nbytes == 0:
        return 0  # nothing asked for (the router wants only a counter): no buffer
    buf = _buffers.get(key)
    if buf is not None and buf[1] >= nbytes:
        return buf[0]
    with _lock:
        buf = _buffers.get(key)
        if buf is None or buf[1] < nbytes:
            if buf is not None:
                nbytes = max(nbytes, buf[1] * 3 // 2)  # grow geometrically: few outgrown buffers
            nbytes = -(-max(nbytes, 4096) // 256) * 256
            buf = _buffers[key] = (_allocate_zeroed(key[1], nbytes), nbytes)
    return buf[0]


def zeroed_scratch(user: str, index: int, stream: int, ws_floats: int, counters: int) -> tuple[int, int]:
    """Device pointers to an fp32 workspace and int32 counters, zero on first use, kept for later launches.

    Args:
        user: which kernel family owns the buffers (kernels that leave different parts
            non-zero must not share them).
        index: CUDA device index.
        stream: raw handle of the stream the launch goes on.
        ws_floats: fp32 workspace elements needed (may be 0).
        counters: int32 counters needed (may be 0).

    Returns:
        ``(workspace pointer, counters pointer)``, each with room for at least the requested
        elements, or 0 (null) where none were asked for. The caller's kernel must leave the
        counters zero (and the workspace too, when it relies on it being zero).
    """
    if ws_floats < 0 or counters < 0:
        raise ValueError(f"ws_floats and counters must be >= 0, got {ws_floats} and {counters}")
    return _get((user, index, stream, "ws"), 4 * ws_floats), _get((user, index, stream, "counters"), 4 * counters)
