"""The entry point of decode attention over a :class:`~kbit_linear.kv_format.KVBucket` cache.

:func:`decode_attention` runs the reference (:func:`kbit_linear.kv_format.bucket_attention`, the
spec) unless a backend registered a faster implementation for the query's device type; the
CUDA backend registers its fused kernel on import (:mod:`kbit_linear.backends.cuda.kv_attention`).
A backend returns ``None`` for a problem it does not take (a head size it has no instance for),
which falls back to the reference.
"""

from __future__ import annotations

from typing import Callable, Optional

import torch

from .kv_format import KVBucket, bucket_attention

__all__ = ["decode_attention", "register_decode_attention"]

Implementation = Callable[..., Optional[tuple[torch.Tensor, Optional[torch.Tensor]]]]
_backends: dict[str, Implementation] = {}


def register_decode_attention(device_type: str, fn: Implementation) -> None:
    """Let a backend take :func:`decode_attention` calls whose query is on ``device_type``.

    ``fn`` takes :func:`decode_attention`'s arguments and returns ``(out, mass)`` (``mass``
    ``None`` when not asked for) or ``None`` to leave the problem to the reference.
    """
    if not isinstance(device_type, str) or not callable(fn):
        raise TypeError("register_decode_attention takes a device type string and a callable")
    _backends[device_type] = fn


def decode_attention(query: torch.Tensor, buckets: list[KVBucket], k_block_min: torch.Tensor | None,
                     k_block_range: torch.Tensor | None, block_size: int, kv_len: int, tier: torch.Tensor,
                     attention_mask: torch.Tensor | None, scaling: float, need_mass: bool = True,
                     workspace: dict | None = None) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Attention of ``query`` over a layer's buckets, and each position's attention mass.

    Args:
        query: ``[B, Hq, q_len, D]``.
        buckets: the layer's buckets, one per width of :data:`~kbit_linear.kv_format.TIERS`, in that order.
        k_block_min, k_block_range, block_size: the layer's key block ranges.
        kv_len: cached positions per row (every position ``< kv_len`` of every row is in exactly
            one bucket).
        tier: int8 ``[B, kv_len]``, each position's width (which bucket holds it).
        attention_mask: see :func:`kbit_linear.kv_format.mask_bias`.
        scaling: the logit scale.
        need_mass: also return the mass (else ``None`` in its place).
        workspace: a dict a backend may keep derived data in between calls (the CUDA backend
            keeps each key block's bucket offsets); the caller empties it whenever the widths,
            rows or key blocks change.

    Returns:
        ``(out [B, q_len, Hq, D], mass float32 [B, kv_len] or None)``, as
        :func:`~kbit_linear.kv_format.bucket_attention`.
    """
    fn = _backends.get(query.device.type)
    if fn is not None:
        res = fn(query, buckets, k_block_min, k_block_range, block_size, kv_len, tier, attention_mask, scaling, need_mass, workspace)
        if res is not None:
            return res
    out, mass = bucket_attention(query, buckets, k_block_min, k_block_range, block_size, kv_len, attention_mask, scaling)
    return out, (mass if need_mass else None)
