"""The one cache of launch plans of the CUDA backend.

Planning a GEMM (which path, which kernel instance, grid, schedule, scratch sizes) costs tens of
microseconds; a forward pass repeats the same few problems, so each plan is made once and looked
up by a tuple key after that. Every planner (:mod:`.ops` for the dispatcher and the fused
kernel, :mod:`.decode` for the decode kernel) keeps its plans here, under keys that start with
its own name, so one :func:`clear` forgets them all.
"""

from __future__ import annotations

import threading
from typing import Any, Callable, TypeVar

__all__ = ["MAX_PLANS", "lookup", "get_or_make", "clear"]

MAX_PLANS = 4096
"""Plans kept before the cache starts over (many distinct M, e.g. prefill lengths, would grow it)."""

_P = TypeVar("_P")
_plans: dict[tuple, Any] = {}
_lock = threading.Lock()


def lookup(key: tuple) -> Any:
    """The plan stored under ``key``, or None (the hot path: one dict lookup, no lock)."""
    return _plans.get(key)


def get_or_make(key: tuple, make: Callable[[], _P]) -> _P:
    """The plan under ``key``, made by ``make()`` if there is none yet.

    ``make`` runs outside the lock: planners nest (the dispatcher's plan of a decode problem
    holds the decode kernel's plan), and two threads that plan the same problem at once both
    make it, the first one stored wins, and both return it."""
    plan = _plans.get(key)
    if plan is not None:
        return plan
    made = make()
    with _lock:
        plan = _plans.get(key)
        if plan is None:
            if len(_plans) >= MAX_PLANS:
                _plans.clear()
            plan = _plans[key] = made
    return plan


def clear() -> None:
    """Forget every plan (tests that change tuning tables; plans are rebuilt on the next call)."""
    with _lock:
        _plans.clear()
