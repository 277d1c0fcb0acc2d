"""Fixtures shared by several test modules."""

from __future__ import annotations

import pytest


@pytest.fixture
def graph_replays(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """The list that gets one entry per CUDA-graph replay of a calibration sweep's lazy block
    (``kbit_linear.calibration._LazyBlockGraph.run``) from now on."""
    from kbit_linear import calibration

    calls: list[int] = []
    run = calibration._LazyBlockGraph.run

    def counted(self, *args):
        calls.append(1)
        return run(self, *args)

    monkeypatch.setattr(calibration._LazyBlockGraph, "run", counted)
    return calls
