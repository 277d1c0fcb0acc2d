"""The entry points of the :class:`~kbit_linear.kv_format.KVBucket` cache's per-step work.

:func:`decode_attention` (attention over the buckets), :func:`append_tokens8` (a step's new
tokens into the 8-bit bucket) and :func:`append_tokens8_in_place` (into a replayable cache's
8-bit store) run the reference of :mod:`kbit_linear.kv_format` (the spec) unless a backend
registered a faster implementation for the inputs' device type; the CUDA backend registers its
kernels on import (:mod:`kbit_linear.backends.cuda.kv_attention`,
:mod:`kbit_linear.backends.cuda.kv_append`, which has both appends). A backend returns
``None`` (``False`` for the in-place append) for a problem it does not take (a head size it has
no instance for), which falls back to the reference.
"""

from __future__ import annotations

from typing import Callable, Optional

import torch

from .kv_format import (
    _ENTRY8_DTYPES,
    KVBucket,
    KVStore8,
    accumulate_mass,
    append_tokens8 as _append_tokens8_reference,
    append_tokens8_in_place as _append_tokens8_in_place_reference,
    bucket_attention,
    causal_visible,
)

__all__ = ["append_tokens8", "append_tokens8_in_place", "decode_attention", "decode_attention_in_place", "register_append_tokens8",
           "register_append_tokens8_in_place", "register_decode_attention", "register_decode_attention_in_place"]

Implementation = Callable[..., Optional[tuple[torch.Tensor, Optional[torch.Tensor]]]]
_backends: dict[str, Implementation] = {}
_append_backends: dict[str, Callable[..., Optional[KVBucket]]] = {}
_append_in_place_backends: dict[str, Callable[..., bool]] = {}
_in_place_backends: dict[str, Callable[..., Optional[torch.Tensor]]] = {}
_BUCKET8_DTYPES = {**_ENTRY8_DTYPES, "row_start": torch.int32}
_STORE8_DTYPES = {**_ENTRY8_DTYPES, "count": torch.int32, "overflow": torch.int32}


def register_decode_attention(device_type: str, fn: Implementation) -> None:
    """Let a backend take :func:`decode_attention` calls whose query is on ``device_type``.

    ``fn`` takes :func:`decode_attention`'s arguments and returns ``(out, mass)`` (``mass``
    ``None`` when not asked for) or ``None`` to leave the problem to the reference.
    """
    if not isinstance(device_type, str) or not callable(fn):
        raise TypeError("register_decode_attention takes a device type string and a callable")
    _backends[device_type] = fn


def register_append_tokens8(device_type: str, fn: Callable[..., Optional[KVBucket]]) -> None:
    """Let a backend take :func:`append_tokens8` calls whose keys are on ``device_type``.

    ``fn`` takes :func:`append_tokens8`'s arguments (checked) and returns the new bucket, or
    ``None`` to leave the problem to the reference.
    """
    if not isinstance(device_type, str) or not callable(fn):
        raise TypeError("register_append_tokens8 takes a device type string and a callable")
    _append_backends[device_type] = fn


def register_decode_attention_in_place(device_type: str, fn: Callable[..., Optional[torch.Tensor]]) -> None:
    """Let a backend take :func:`decode_attention_in_place` calls whose query is on ``device_type``.

    ``fn`` takes :func:`decode_attention_in_place`'s arguments (checked) and returns the output,
    or ``None`` to leave the problem to the reference.
    """
    if not isinstance(device_type, str) or not callable(fn):
        raise TypeError("register_decode_attention_in_place takes a device type string and a callable")
    _in_place_backends[device_type] = fn


def register_append_tokens8_in_place(device_type: str, fn: Callable[..., bool]) -> None:
    """Let a backend take :func:`append_tokens8_in_place` calls whose keys are on ``device_type``.

    ``fn`` takes :func:`append_tokens8_in_place`'s arguments (checked) and returns True once it
    did the append, or False to leave the problem to the reference.
    """
    if not isinstance(device_type, str) or not callable(fn):
        raise TypeError("register_append_tokens8_in_place takes a device type string and a callable")
    _append_in_place_backends[device_type] = fn


def _check_step(k: torch.Tensor, v: torch.Tensor, rows: int, entry_shape: tuple[int, ...], held: dict[str, torch.Tensor],
                dtypes: dict[str, torch.dtype], what: str) -> None:
    """Raise a ValueError naming the problem unless ``k``, ``v`` (float ``[B, H, q >= 1, D]``)
    fit a ``what`` of ``rows`` rows and entries of ``entry_shape`` whose tensors ``held`` have
    ``dtypes`` and sit on the keys' device."""
    if k.dim() != 4 or v.shape != k.shape or not k.is_floating_point() or not v.is_floating_point() or k.shape[2] == 0:
        raise ValueError(f"k and v must be float [B, H, q, D] of one shape with q >= 1, got {tuple(k.shape)} {k.dtype} and "
                         f"{tuple(v.shape)} {v.dtype}")
    b, h, _, d = k.shape
    if rows != b or entry_shape != (h, d):
        raise ValueError(f"k of shape {tuple(k.shape)} does not fit the {what} ({rows} rows, entries of shape {entry_shape})")
    if v.device != k.device or any(t.device != k.device for t in held.values()):
        raise ValueError(f"k, v and the {what} must be on one device, got k on {k.device}, v on {v.device}, the {what} on "
                         f"{sorted({str(t.device) for t in held.values()})}")
    bad = {name: str(held[name].dtype) if name in held else None for name, dt in dtypes.items()
           if name not in held or held[name].dtype != dt}
    if bad:
        want = ", ".join(f"{name} {str(dt).removeprefix('torch.')}" for name, dt in dtypes.items())
        raise ValueError(f"{what} fields of the wrong dtype or missing (want {want}): {bad}")


def append_tokens8(bucket: KVBucket, k: torch.Tensor, v: torch.Tensor, pos0: int) -> KVBucket:
    """The 8-bit ``bucket`` with a step's new tokens after each batch row's own entries.

    Args:
        bucket: an 8-bit bucket of ``B`` rows, positions all below ``pos0``.
        k, v: float ``[B, H, q, D]`` (any strides), positions ``pos0 .. pos0 + q - 1`` of every row.
        pos0: the first new position.

    Returns:
        A new bucket, as :func:`kbit_linear.kv_format.append_tokens8` computes it.

    Raises:
        ValueError: a bucket that is not 8-bit, or keys and values that do not fit it, naming which.
    """
    if bucket.bits != 8:
        raise ValueError(f"bucket must be the 8-bit bucket, got a {bucket.bits}-bit one")
    _check_step(k, v, bucket.row_start.numel() - 1, tuple(bucket.k.shape[1:]), bucket.tensors(), _BUCKET8_DTYPES, "bucket")
    if isinstance(pos0, bool) or not isinstance(pos0, int) or pos0 < 0:
        raise ValueError(f"pos0 must be an int >= 0, got {pos0!r}")
    fn = _append_backends.get(k.device.type)
    if fn is not None:
        out = fn(bucket, k, v, pos0)
        if out is not None:
            return out
    return _append_tokens8_reference(bucket, k, v, pos0)


def append_tokens8_in_place(store: KVStore8, k: torch.Tensor, v: torch.Tensor, length: torch.Tensor) -> None:
    """A step's new tokens into a replayable cache's 8-bit ``store``, in place, with no host read
    of a device value.

    Args:
        store: a :class:`~kbit_linear.kv_format.KVStore8` of ``B`` rows.
        k, v: float ``[B, H, q, D]`` (any strides), positions ``length .. length + q - 1`` of every row.
        length: int32 ``[1]`` on the keys' device, the tokens cached so far; grows by ``q``.

    The result is :func:`kbit_linear.kv_format.append_tokens8_in_place`'s, overflow included.

    Raises:
        ValueError: keys, values, store or length that do not fit together, naming which.
    """
    _check_step(k, v, store.count.numel(), tuple(store.k.shape[1:]), store.tensors(), _STORE8_DTYPES, "store")
    if length.dtype != torch.int32 or length.shape != (1,) or length.device != k.device:
        raise ValueError(f"length must be int32 [1] on {k.device}, got {length.dtype} {tuple(length.shape)} on {length.device}")
    fn = _append_in_place_backends.get(k.device.type)
    if fn is not None and fn(store, k, v, length):
        return
    _append_tokens8_in_place_reference(store, k, v, length)


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


def decode_attention_in_place(query: torch.Tensor, buckets: list[KVBucket], store: KVStore8, k_block_min: torch.Tensor | None,
                              k_block_range: torch.Tensor | None, block_size: int, planned_len: int, length: torch.Tensor,
                              tier: torch.Tensor, scaling: float, mass: torch.Tensor, seen: torch.Tensor, calls: torch.Tensor,
                              mass_interval: int, workspace: dict | None = None) -> torch.Tensor:
    """Causal decode attention of a replayable cache layer, its mass recorded in place.

    What :func:`decode_attention` computes over ``buckets`` and ``store``'s live tokens, with no
    host read of a device value on a backend that takes it (the CUDA one: every step of an epoch
    launches the same kernels with the same arguments, so a CUDA graph can replay it). On a
    recording call (``(calls - 1) % mass_interval == 0``: the caller has advanced ``calls``) the
    step's mass is added into ``mass`` and the query heads that saw each position into ``seen``,
    as :func:`~kbit_linear.kv_format.accumulate_mass` does.

    Args:
        query: ``[B, Hq, q_len, D]``, the last ``q_len`` positions' queries (causal, no padding).
        buckets: the 2-, 3- and 4-bit buckets, in that order.
        store: the 8-bit tokens (:class:`~kbit_linear.kv_format.KVStore8`).
        k_block_min, k_block_range, block_size: the layer's key block ranges.
        planned_len: a length the live one stays within for the whole epoch (the backend plans
            its launch for it), at most ``tier.shape[1]``.
        length: int32 ``[1]`` on the query's device, the cached positions per row.
        tier: int8 ``[B, ld]``, each position's width (columns past the live length unused).
        scaling: the logit scale.
        mass, seen: float32 ``[B, ld]``, the running sums.
        calls: int32 ``[1]``, decode calls so far, this one included.
        mass_interval: calls per recording call.
        workspace: as for :func:`decode_attention`.

    Returns:
        ``out [B, q_len, Hq, D]``. A backend plans its splits for ``planned_len``, so its sums may
        be added in another order than at the live length (rounding).

    Raises:
        ValueError: buffers that do not fit together, naming which.
    """
    b, hq, q_len, _ = query.shape
    ld = tier.shape[1] if tier.dim() == 2 else -1
    if tier.dim() != 2 or tier.shape[0] != b or tier.dtype != torch.int8:
        raise ValueError(f"tier must be int8 [{b}, ld], got {tier.dtype} {tuple(tier.shape)}")
    for name, buf in (("mass", mass), ("seen", seen)):
        if buf.shape != (b, ld) or buf.dtype != torch.float32 or not buf.is_contiguous() or buf.device != query.device:
            raise ValueError(f"{name} must be a contiguous float32 [{b}, {ld}] on {query.device}, got {buf.dtype} "
                             f"{tuple(buf.shape)} on {buf.device}")
    for name, counter in (("length", length), ("calls", calls)):
        if counter.dtype != torch.int32 or counter.shape != (1,) or counter.device != query.device:
            raise ValueError(f"{name} must be int32 [1] on {query.device}, got {counter.dtype} {tuple(counter.shape)} on {counter.device}")
    if isinstance(planned_len, bool) or not isinstance(planned_len, int) or not 0 < planned_len <= ld:
        raise ValueError(f"planned_len must be an int in 1..{ld} (the tier's columns), got {planned_len!r}")
    if isinstance(mass_interval, bool) or not isinstance(mass_interval, int) or mass_interval < 1:
        raise ValueError(f"mass_interval must be an int >= 1, got {mass_interval!r}")
    if len(buckets) != 3 or [bk.bits for bk in buckets] != [2, 3, 4]:
        raise ValueError(f"buckets must be the 2-, 3- and 4-bit ones, in that order, got {[bk.bits for bk in buckets]}")
    fn = _in_place_backends.get(query.device.type)
    if fn is not None:
        out = fn(query, buckets, store, k_block_min, k_block_range, block_size, planned_len, length, tier, scaling, mass, seen,
                 calls, mass_interval, workspace)
        if out is not None:
            return out
    # The reference reads the live length on the host (not replayable on a GPU).
    kv_len = int(length.item())
    if kv_len > planned_len:
        raise ValueError(f"the live length {kv_len} is past planned_len {planned_len}")
    out, step_mass = decode_attention(query, list(buckets) + [store.bucket()], k_block_min, k_block_range, block_size, kv_len,
                                      tier[:, :kv_len], None, scaling, need_mass=True, workspace=None)
    record = (calls - 1) % mass_interval == 0
    accumulate_mass(mass, seen, step_mass, hq * causal_visible(length, q_len, ld, query.device), record)
    return out
