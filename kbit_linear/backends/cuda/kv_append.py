"""A decode step's new tokens into the KV cache's 8-bit bucket in one kernel (``kernels/kv_append.cu``).

Registered as the CUDA implementation of :func:`kbit_linear._kv_ops.append_tokens8`: one launch
quantizes the new keys and values (read in the model's layout and dtype) and writes the grown
bucket, where the reference takes ~30 PyTorch ops (a decode step's host time, not its GPU time,
is what they cost). fp16, bf16 and fp32 keys with unit channel stride take the kernel; anything
else returns ``None`` (the reference runs).
"""

from __future__ import annotations

import torch

from ... import _kv_ops
from ...kv_format import KVBucket, channel_group
from . import loader
from .tensors import DTYPE_CODES, aligned16

__all__ = ["kv_append_instances", "append_tokens8_cuda"]

_SOURCE = "kv_append.cu"
_DT = DTYPE_CODES
_THREADS = 128  # kThreads in the kernel
_INT32_MAX = 2**31 - 1
_ARGS = loader.ArgPack(
    "kbit_kv_append8",
    "k_old:p v_old:p ks_old:p vs_old:p pos_old:p rs_old:p k_new:p v_new:p ksb:i ksh:i ksq:i vsb:i vsh:i vsq:i "
    "k_out:p v_out:p ks_out:p vs_out:p pos_out:p rs_out:p B:i H:i q:i D:i g:i pos0:i")


def kv_append_instances() -> list[str]:
    """Every instance of ``kv_append.cu`` the backend can launch (name expressions)."""
    return [f"kbit_kv_append8<{dt}>" for dt in _DT.values()]


def append_tokens8_cuda(bucket: KVBucket, k: torch.Tensor, v: torch.Tensor, pos0: int) -> KVBucket | None:
    """The CUDA :func:`kbit_linear._kv_ops.append_tokens8` (arguments already checked); ``None``
    for inputs the kernel does not take."""
    b, h, q, d = k.shape
    n = bucket.num_tokens
    total = n + b * q
    if (k.dtype not in _DT or v.dtype != k.dtype or k.stride(-1) != 1 or v.stride(-1) != 1 or total == 0
            or max(k.stride() + v.stride()) > _INT32_MAX or total * h * d > _INT32_MAX or pos0 + q > _INT32_MAX):
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


_kv_ops.register_append_tokens8("cuda", append_tokens8_cuda)
