"""Calibrated rounding on a GPU: the CUDA-graph replay of the activation-order sweep gives the
eager sweep's result exactly, and it is the path that runs."""

from __future__ import annotations

import pytest
import torch

from kbit_linear import calibration
from kbit_linear.calibration import LAZY_BLOCK, gptq_quantize_blocks

pytestmark = [pytest.mark.cuda, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]


def _problem(n: int, k: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """A weight with uneven columns and the Hessian of correlated inputs, one input never active."""
    g = torch.Generator(device="cuda").manual_seed(seed)
    w = torch.randn(n, k, device="cuda", generator=g) * (0.1 + 2 * torch.rand(1, k, device="cuda", generator=g))
    x = torch.randn(3 * k, k, device="cuda", generator=g) * torch.rand(1, k, device="cuda", generator=g)
    x = x + 0.3 * x.roll(1, dims=1)
    x[:, k // 3] = 0
    return w, x.T @ x


def _sweep(monkeypatch: pytest.MonkeyPatch, graphs: bool, *args, **kwargs):
    monkeypatch.setattr(calibration, "SWEEP_CUDA_GRAPHS", graphs)
    return gptq_quantize_blocks(*args, **kwargs)


@pytest.mark.parametrize("n,k", [(1000, 4 * LAZY_BLOCK), (333, 9 * LAZY_BLOCK + 70), (64, 2 * LAZY_BLOCK)])
@pytest.mark.parametrize("bits,codebook,scale_search", [(2, None, True), (3, "nf-zero", False), (4, "fitted", True),
                                                         (5, None, False)])
def test_graph_sweep_equals_the_eager_sweep(monkeypatch: pytest.MonkeyPatch, graph_replays: list[int], n: int, k: int,
                                            bits: int, codebook, scale_search: bool) -> None:
    w, h = _problem(n, k, seed=n + k + bits)
    if codebook == "fitted":
        from kbit_linear.codebooks import fit_codebook

        codebook = fit_codebook(w, bits)
    elif codebook == "nf-zero":
        from kbit_linear.codebooks import normal_float_zero_codebook

        codebook = normal_float_zero_codebook(bits, device="cuda")
    eager = _sweep(monkeypatch, False, w, h, bits, codebook, scale_search=scale_search, act_order=True)
    assert graph_replays == []
    graphed = _sweep(monkeypatch, True, w, h, bits, codebook, scale_search=scale_search, act_order=True)
    assert len(graph_replays) == k // LAZY_BLOCK  # every full lazy block replayed
    for a, b in zip(eager, graphed):
        assert a.device.type == "cuda" and torch.equal(a, b)
    # the sweep did round with feedback: not round-to-nearest of the same scales
    rtn = gptq_quantize_blocks(w, torch.eye(k, device="cuda"), bits, codebook, scale_search=scale_search)
    assert not torch.equal(rtn[0], graphed[0])


def test_in_feature_order_and_narrow_weights_stay_eager(monkeypatch: pytest.MonkeyPatch, graph_replays: list[int]) -> None:
    w, h = _problem(48, LAZY_BLOCK + 32, seed=1)
    _sweep(monkeypatch, True, w, h, 4, act_order=True)  # fewer than two lazy blocks
    w, h = _problem(48, 4 * LAZY_BLOCK, seed=2)
    _sweep(monkeypatch, True, w, h, 4, act_order=False)  # scales chosen during the sweep
    assert graph_replays == []
