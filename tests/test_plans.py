"""The plan cache of the CUDA backend (no GPU needed)."""

from __future__ import annotations

import threading

from kbit_linear.backends.cuda import plans


def test_nested_planning_does_not_deadlock_and_plans_are_made_once():
    plans.clear()
    made = []

    def inner() -> str:
        made.append("inner")
        return "inner plan"

    def outer() -> tuple[str, str]:
        made.append("outer")
        return ("outer plan", plans.get_or_make(("test", "inner"), inner))  # a planner calling another

    result = []
    t = threading.Thread(target=lambda: result.append(plans.get_or_make(("test", "outer"), outer)), daemon=True)
    t.start()
    t.join(timeout=10)
    try:
        assert not t.is_alive(), "nested get_or_make deadlocked"
        assert result == [("outer plan", "inner plan")]
        assert plans.get_or_make(("test", "outer"), outer) == ("outer plan", "inner plan")
        assert plans.lookup(("test", "inner")) == "inner plan"
        assert made == ["outer", "inner"]  # cached afterwards
    finally:
        plans.clear()
    assert plans.lookup(("test", "outer")) is None


def test_the_cache_starts_over_when_full(monkeypatch):
    plans.clear()
    monkeypatch.setattr(plans, "MAX_PLANS", 3)
    for i in range(5):
        plans.get_or_make(("test", i), lambda i=i: i)
    assert plans.lookup(("test", 4)) == 4 and plans.lookup(("test", 0)) is None
    plans.clear()
