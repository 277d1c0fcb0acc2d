"""A decode step's new tokens into the KV cache's 8-bit tokens in one kernel (``kernels/kv_append.cu``).

Registered as the CUDA implementations of :func:`kbit_linear._kv_ops.append_tokens8` (a grown
8-bit bucket) and :func:`kbit_linear._kv_ops.append_tokens8_in_place` (a replayable cache's
store, written in place): one launch quantizes the new keys and values (read in the model's
layout and dtype) and writes them, where the reference takes ~30 PyTorch ops (a decode step's
host time, not its GPU time, is what they cost). Keys and values of one dtype (fp16, bf16 or
fp32) with unit channel stride take the kernels; anything else goes to the reference (the
launchers return ``None`` or ``False``).

The in-place launch reads nothing on the host and has a fixed grid for a given batch and step
size, so a CUDA graph can capture it; its counters move on the device (a last-block ticket, a
per-stream counter of :mod:`.workspace` that the kernel leaves zero). It is launched without
programmatic dependent launch.
"""

from __future__ import annotations

import torch

from ... import _kv_ops
from ...kv_format import KVBucket, KVStore8, channel_group
from . import loader, workspace
from .tensors import DTYPE_CODES, aligned16

__all__ = ["kv_append_instances", "append_tokens8_cuda", "append_tokens8_in_place_cuda"]

_SOURCE = "kv_append.cu"
_DT = DTYPE_CODES
_THREADS = 128  # kThreads in the kernel
_INT32_MAX = 2**31 - 1
_ARGS = loader.ArgPack(
    "kbit_kv_append8",
    "k_old:p v_old:p ks_old:p vs_old:p pos_old:p rs_old:p k_new:p v_new:p ksb:i ksh:i ksq:i vsb:i vsh:i vsq:i "
    "k_out:p v_out:p ks_out:p vs_out:p pos_out:p rs_out:p B:i H:i q:i D:i g:i pos0:i")
_IN_PLACE_ARGS = loader.ArgPack(
    "kbit_kv_append8_in_place",
    "k_new:p v_new:p ksb:i ksh:i ksq:i vsb:i vsh:i vsq:i k:p v:p k_scale:p v_scale:p pos:p count:p length:p overflow:p "
    "ticket:p B:i H:i q:i D:i g:i capacity:i")
_KERNELS = ("kbit_kv_append8", "kbit_kv_append8_in_place")


def kv_append_instances() -> list[str]:
    """Every instance of ``kv_append.cu`` the backend can launch (name expressions)."""
    return [f"{name}<{dt}>" for name in _KERNELS for dt in _DT.values()]


def _kernel_takes(k: torch.Tensor, v: torch.Tensor) -> bool:
    """Whether the kernels read these new keys and values: one dtype they have an instance for,
    unit channel stride, strides that fit an int."""
    return (k.dtype in _DT and v.dtype == k.dtype and k.stride(-1) == 1 and v.stride(-1) == 1
            and max(k.stride() + v.stride()) <= _INT32_MAX)


def append_tokens8_cuda(bucket: KVBucket, k: torch.Tensor, v: torch.Tensor, pos0: int) -> KVBucket | None:
    """The CUDA :func:`kbit_linear._kv_ops.append_tokens8` (arguments already checked); ``None``
    for inputs the kernel does not take."""
    b, h, q, d = k.shape
    n = bucket.num_tokens
    total = n + b * q
    if not _kernel_takes(k, v) or total == 0 or total * h * d > _INT32_MAX or pos0 + q > _INT32_MAX:
        return None
    dev = k.device
    g = channel_group(d)
    k_out = torch.empty((total, h, d), dtype=torch.int8, device=dev)
    v_out = torch.empty_like(k_out)
    ks_out = torch.empty((total, h, d // g), dtype=torch.float16, device=dev)
    vs_out = torch.empty_like(ks_out)
    pos_out = torch.empty(total, dtype=torch.int32, device=dev)
    rs_out = torch.empty(b + 1, dtype=torch.int32, device=dev)
    kern = loader.get_kernel(_SOURCE, f"kbit_kv_append8<{_DT[k.dtype]}>", dev)
    loader.launch(kern, total, _THREADS, _ARGS.Values(
        k_old=aligned16(bucket.k), v_old=aligned16(bucket.v), ks_old=aligned16(bucket.k_scale), vs_old=aligned16(bucket.v_scale),
        pos_old=aligned16(bucket.pos), rs_old=aligned16(bucket.row_start), k_new=k, v_new=v,
        ksb=k.stride(0), ksh=k.stride(1), ksq=k.stride(2), vsb=v.stride(0), vsh=v.stride(1), vsq=v.stride(2),
        k_out=k_out, v_out=v_out, ks_out=ks_out, vs_out=vs_out, pos_out=pos_out, rs_out=rs_out,
        B=b, H=h, q=q, D=d, g=g, pos0=pos0), 0, dev, pack=_ARGS)
    return KVBucket(8, rs_out, pos_out, k_out, v_out, vs_out, k_scale=ks_out)


def append_tokens8_in_place_cuda(store: KVStore8, k: torch.Tensor, v: torch.Tensor, length: torch.Tensor) -> bool:
    """The CUDA :func:`kbit_linear._kv_ops.append_tokens8_in_place` (arguments already checked).

    Args:
        store: the 8-bit store of ``B`` rows, every tensor contiguous (the kernel writes them in place).
        k, v: ``[B, H, q, D]`` of one float dtype, unit channel stride, any other strides.
        length: int32 ``[1]``, the first new position; the kernel advances it.

    Returns:
        True once the launch is queued; False (nothing launched) for inputs the kernel does not
        take: another dtype or layout, no rows, a non-contiguous store tensor, sizes past an int.
    """
    b, h, q, d = k.shape
    if (not _kernel_takes(k, v) or b == 0 or b * q > _INT32_MAX or store.capacity + q > _INT32_MAX
            or not all(t.is_contiguous() for t in store.tensors().values())):
        return False
    dev = k.device
    index = loader._device_index(dev)
    stream = loader._current_raw_stream(index)
    _, ticket = workspace.zeroed_scratch("kv_append", index, stream, 0, 1)  # the kernel leaves it at zero
    kern = loader.get_kernel(_SOURCE, f"kbit_kv_append8_in_place<{_DT[k.dtype]}>", dev)
    loader.launch(kern, b * q, _THREADS, _IN_PLACE_ARGS.Values(
        k_new=k, v_new=v, ksb=k.stride(0), ksh=k.stride(1), ksq=k.stride(2), vsb=v.stride(0), vsh=v.stride(1), vsq=v.stride(2),
        k=store.k, v=store.v, k_scale=store.k_scale, v_scale=store.v_scale, pos=store.pos, count=store.count, length=length,
        overflow=store.overflow, ticket=ticket, B=b, H=h, q=q, D=d, g=channel_group(d), capacity=store.capacity),
        0, dev, pack=_IN_PLACE_ARGS, stream=stream)
    return True


_kv_ops.register_append_tokens8("cuda", append_tokens8_cuda)
_kv_ops.register_append_tokens8_in_place("cuda", append_tokens8_in_place_cuda)
