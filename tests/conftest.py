"""Settings and fixtures shared by the test modules."""

from __future__ import annotations

import os

import pytest
import torch


def pytest_configure(config: pytest.Config) -> None:
    """Under pytest-xdist, each worker's torch takes its share of the CPU cores, not all of them:
    with every worker's CPU reference on all cores, 15 workers on 16 cores did not finish the KV
    GPU tests in 480 s, which take 54 s with one thread each."""
    workers = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "0"))
    if workers > 1:
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // workers))


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
