"""Bit widths per layer to a budget (``kbit_linear.allocation``, ``quantize_model(target_bpw=...)``), on the CPU."""

from __future__ import annotations

import itertools

import pytest
import torch
from torch import nn

import kbit_linear
from kbit_linear import KbitLinear, allocation, quantize_model


def _convex_errors(scale: float) -> dict[int, float]:
    """Relative errors falling about 4x per bit, as for normal weights."""
    return {b: scale * 4.0 ** -(b - 2) for b in allocation.BIT_CHOICES}


def test_allocate_bits_equals_brute_force_for_equal_sizes():
    """With equal layer sizes and convex errors, greedy on marginal gains is optimal: it matches
    the best assignment found by trying every one that fits the budget."""
    g = torch.Generator().manual_seed(0)
    for trial in range(20):
        layers = [f"l{i}" for i in range(4)]
        errors = {n: _convex_errors(float(torch.rand(1, generator=g)) * 10 + 0.1) for n in layers}
        sizes = {n: 1000 for n in layers}
        target = float(torch.randint(8, 21, (1,), generator=g)) / 4  # 2.0 .. 5.0 in quarters
        got = allocation.allocate_bits(errors, sizes, target)
        best = min(
            (sum(errors[n][b] for n, b in zip(layers, combo)), combo)
            for combo in itertools.product(allocation.BIT_CHOICES, repeat=4)
            if sum(combo) <= target * 4 + 1e-9
        )
        assert sum(got[n] for n in layers) <= target * 4 + 1e-9
        assert sum(errors[n][got[n]] for n in layers) == pytest.approx(best[0]), (trial, got, best)


def test_allocate_bits_budget_edges_and_sizes():
    errors = {"big": _convex_errors(1.0), "small": _convex_errors(1.0)}
    sizes = {"big": 900, "small": 100}
    assert allocation.allocate_bits(errors, sizes, 2.0) == {"big": 2, "small": 2}
    assert allocation.allocate_bits(errors, sizes, 5.0) == {"big": 5, "small": 5}
    # the same error drop costs 9x the bits on the big layer: the small one is upgraded first
    got = allocation.allocate_bits(errors, sizes, 2.3)
    assert got == {"big": 2, "small": 5}
    mixed = allocation.allocate_bits(errors, sizes, 3.5)
    assert sum(mixed[n] * sizes[n] for n in sizes) <= 3.5 * 1000
    assert allocation.allocate_bits({}, {}, 3.0) == {}
    # no bits for an upgrade that does not lower the error (a zero weight; an error rising with the width)
    flat = {"zero": {b: 0.0 for b in allocation.BIT_CHOICES}, "odd": {2: 0.1, 3: 0.2, 4: 0.3, 5: 0.4}}
    assert allocation.allocate_bits(flat, {"zero": 10, "odd": 10}, 5.0) == {"zero": 2, "odd": 2}


@pytest.mark.parametrize(
    "call, error, match",
    [
        (lambda: allocation.allocate_bits({"a": _convex_errors(1)}, {"b": 5}, 3.0), ValueError, "sizes"),
        (lambda: allocation.allocate_bits({"a": _convex_errors(1)}, {"a": 0}, 3.0), ValueError, "sizes"),
        (lambda: allocation.allocate_bits({"a": _convex_errors(1), "b": {3: 0.1, 4: 0.01}}, {"a": 1, "b": 1}, 3.0),
         ValueError, "same widths"),
        (lambda: allocation.allocate_bits({"a": _convex_errors(1)}, {"a": 1}, 6.0), ValueError, "target_bpw"),
        (lambda: allocation.check_target_bpw(1.5), ValueError, "target_bpw"),
        (lambda: allocation.check_target_bpw("3.5"), TypeError, "target_bpw"),
        (lambda: allocation.check_target_bpw(True), TypeError, "target_bpw"),
        (lambda: allocation.allocate_bits({"a": _convex_errors(1)}, {"a": 1}, "3"), TypeError, "target_bpw"),
        (lambda: allocation.allocate_bits({"a": {}}, {"a": 10}, 3.0), ValueError, r"errors\['a'\]"),
        (lambda: allocation.allocate_bits({"a": [0.5, 0.1]}, {"a": 10}, 3.0), ValueError, r"errors\['a'\]"),
        (lambda: allocation.plan_layer_bits([("a", torch.randn(64))], 3.0, hadamard=True, progress=False), ValueError,
         "2-D"),
        # sign values: zeros rotated the weight to zero (error 0 at every width), 2s scaled it
        (lambda: allocation.relative_errors(torch.randn(16, 64), hadamard_signs=torch.zeros(64, dtype=torch.int8)),
         ValueError, "hadamard_signs must hold only"),
        (lambda: allocation.relative_errors(torch.randn(16, 64), hadamard_signs=torch.full((64,), 2, dtype=torch.int8)),
         ValueError, "hadamard_signs must hold only"),
        (lambda: allocation.relative_errors(torch.randn(16, 64), hadamard_signs=torch.ones(32, dtype=torch.int8)),
         ValueError, "hadamard_signs must have shape"),
    ],
)
def test_allocation_rejects_bad_arguments(call, error, match):
    with pytest.raises(error, match=match):
        call()


def test_relative_errors_fall_with_the_width_and_match_the_layer():
    w = torch.randn(200, 160, generator=torch.Generator().manual_seed(1))
    errors = allocation.relative_errors(w)
    assert list(errors) == list(allocation.BIT_CHOICES)
    values = [errors[b] for b in allocation.BIT_CHOICES]
    assert all(a > 2 * b for a, b in zip(values, values[1:])), values
    # the error is that of the layer quantize_model builds at that width
    layer = KbitLinear.from_linear(_linear(w), bits=3)
    want = float((layer.dequantize(torch.float32) - w).square().sum() / w.square().sum())
    assert errors[3] == pytest.approx(want, rel=1e-6)
    assert allocation.relative_errors(torch.zeros(8, 64)) == {b: 0.0 for b in allocation.BIT_CHOICES}
    # the rotation is orthogonal: rotated errors are the layer's own (rotated back)
    signs = kbit_linear.hadamard.random_signs(160, 7)
    rotated = allocation.relative_errors(w, hadamard_signs=signs, bit_choices=(3,))
    layer = KbitLinear.from_linear(_linear(w), bits=3, hadamard=True, hadamard_seed=7)
    want = float((layer.dequantize(torch.float32) - w).square().sum() / w.square().sum())
    assert rotated[3] == pytest.approx(want, rel=1e-4)


@pytest.mark.parametrize("codebook", [None, "fitted"])
@pytest.mark.parametrize("exponent", [66, -83], ids=["1e20", "1e-25"])
def test_relative_errors_do_not_depend_on_the_weights_scale(codebook, exponent):
    # the relative error is scale-free; the squared sums overflowed float32 near 1e20 (NaN) and
    # underflowed near 1e-25 (every width reported error 0)
    g = torch.Generator().manual_seed(2)
    w = torch.randn(96, 64, generator=g)
    want = allocation.relative_errors(w, codebook=codebook, bit_choices=(2, 4))
    scaled = allocation.relative_errors(torch.ldexp(w, torch.tensor(exponent)), codebook=codebook, bit_choices=(2, 4))
    assert scaled == pytest.approx(want, rel=1e-5) and all(v > 0 for v in scaled.values())
    e = torch.randn(3, 32, 64, generator=g)
    want = allocation.experts_relative_errors(e, codebook=codebook, bit_choices=(2, 4))
    scaled = allocation.experts_relative_errors(torch.ldexp(e, torch.tensor(exponent)), codebook=codebook, bit_choices=(2, 4))
    assert scaled == pytest.approx(want, rel=1e-5) and all(v > 0 for v in scaled.values())


def _linear(w: torch.Tensor) -> nn.Linear:
    lin = nn.Linear(w.shape[1], w.shape[0], bias=False)
    with torch.no_grad():
        lin.weight.copy_(w)
    return lin


def _net() -> nn.Module:
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(256, 256), nn.ReLU(), nn.Linear(256, 256), nn.ReLU(), nn.Linear(256, 256), nn.Linear(256, 128))
    with torch.no_grad():
        net[2].weight[:, :4] *= 40.0  # outlier columns: the hardest layer to quantize
    return net


def test_quantize_model_target_bpw_chooses_widths_within_the_budget():
    net = _net()
    x = torch.randn(3, 256)
    # normal-float levels: with a zero level (the default) the outlier blocks' other weights land
    # on 0, and the outlier layer is no longer the hardest
    summary = quantize_model(net, target_bpw=3.5, codebook=None, skip=None, progress=False)
    layers = {n: m for n, m in net.named_modules() if isinstance(m, KbitLinear)}
    assert set(summary.layer_bits) == set(layers) == {"0", "2", "4", "5"}
    assert all(layers[n].bits == b for n, b in summary.layer_bits.items())
    sizes = {n: m.in_features * m.out_features for n, m in layers.items()}
    mean = sum(summary.layer_bits[n] * sizes[n] for n in sizes) / sum(sizes.values())
    assert mean <= 3.5 and summary.mean_layer_bits == pytest.approx(mean)
    assert len(set(summary.layer_bits.values())) > 1
    assert summary.layer_bits["2"] >= summary.layer_bits["4"]  # the outlier layer gets at least the width of its twin
    assert "bits per layer" in str(summary) and f"mean {mean:.2f}" in str(summary)
    assert net(x).shape == (3, 128)


def test_target_bpw_round_trips_through_save_quantized(tmp_path):
    net = _net()
    quantize_model(net, target_bpw=3.25, skip=None, progress=False)
    path = kbit_linear.save_quantized(net, tmp_path / "mixed.safetensors")
    fresh = _net()
    kbit_linear.load_into(fresh, path)
    x = torch.randn(2, 256)
    for name, m in net.named_modules():
        if isinstance(m, KbitLinear):
            assert fresh.get_submodule(name).bits == m.bits
    assert torch.equal(fresh(x), net(x))


def test_target_bpw_shares_one_width_for_a_reused_layer_and_rejects_bad_combinations():
    shared = nn.Linear(128, 128)
    net = nn.Sequential(shared, nn.ReLU(), shared, nn.Linear(128, 64))
    summary = quantize_model(net, target_bpw=4.0, skip=None, progress=False)
    assert summary.layer_bits["0"] == summary.layer_bits["2"] and net[0] is net[2]
    with pytest.raises(ValueError, match="codebook"):
        quantize_model(_net(), target_bpw=3.5, codebook=kbit_linear.format.create_normal_float_codebook(4), progress=False)
    with pytest.raises(ValueError, match="target_bpw"):
        quantize_model(_net(), target_bpw=7, progress=False)
    with torch.device("meta"):
        meta = nn.Sequential(nn.Linear(64, 64))
    with pytest.raises(ValueError, match="meta"):
        quantize_model(meta, target_bpw=3.5, skip=None, progress=False)


@pytest.mark.parametrize(
    "call, error, match",
    [
        # a NaN error used to be skipped silently (no gain compares greater than it): that layer stayed narrow
        (lambda: allocation.allocate_bits({"a": {2: float("nan"), 3: 0.1, 4: 0.01, 5: 0.001}, "b": _convex_errors(1)},
                                          {"a": 10, "b": 10}, 3.0), ValueError, r"errors\['a'\]"),
        (lambda: allocation.allocate_bits({"a": {2: "x", 3: 0.1, 4: 0.01, 5: 0.001}}, {"a": 10}, 3.0), ValueError,
         r"errors\['a'\]"),
        (lambda: allocation.allocate_bits({"a": _convex_errors(1)}, {"a": True}, 3.0), ValueError, "sizes"),
        (lambda: allocation.allocate_bits([("a", _convex_errors(1))], {"a": 10}, 3.0), TypeError, "errors"),
        (lambda: allocation.allocate_bits({"a": _convex_errors(1)}, None, 3.0), TypeError, "sizes"),
        (lambda: allocation.relative_errors(torch.empty(8, 64, device="meta")), ValueError, "meta"),
        (lambda: allocation.relative_errors([[1.0] * 64]), TypeError, "weight"),
        # a repeated name used to replace the first layer's entry: its weights left the budget
        (lambda: allocation.plan_layer_bits([("a", torch.randn(8, 64)), ("a", torch.randn(8, 640))], 3.0, progress=False),
         ValueError, "twice"),
        (lambda: allocation.plan_layer_bits(
            [("a", torch.randn(8, 64))], 3.0, progress=False,
            experts=[("a", {"gate_up_proj": torch.randn(2, 16, 64), "down_proj": torch.randn(2, 64, 8)})]), ValueError, "twice"),
        (lambda: allocation.plan_layer_bits({"a": torch.randn(8, 64)}, 3.0, progress=False), TypeError, "layers"),
        (lambda: allocation.plan_layer_bits([torch.randn(8, 64)], 3.0, progress=False), TypeError, "layers"),
        (lambda: allocation.plan_layer_bits([("a", torch.randn(8, 64))], 3.0, hadamard=1, progress=False), TypeError,
         "hadamard"),
    ],
)
def test_allocation_rejects_malformed_errors_sizes_and_layers(call, error, match):
    with pytest.raises(error, match=match):
        call()
