"""Fitted codebooks (``codebook="fitted"``, ``kbit_linear.codebooks``), on the CPU."""

from __future__ import annotations

import json

import pytest
import torch
import transformers
from torch import nn

import kbit_linear
from kbit_linear import KbitConfig, KbitLinear, codebooks, hadamard, quantize_model
from kbit_linear import format as fmt
from kbit_linear.experts import quantize_experts_weight
from kbit_linear.quantizer import quantize_weight


def _rel_err(layer: KbitLinear, w: torch.Tensor) -> float:
    return float((layer.dequantize(torch.float32) - w).square().sum() / w.square().sum())


def _weight(n: int = 256, k: int = 200, seed: int = 0, heavy: bool = False) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(n, k, generator=g)
    if heavy:  # heavier tails than normal: where the normal-float levels fit worst
        w = w * torch.rand(n, k, generator=g).pow(3) * 3
    return w


def _linear(w: torch.Tensor) -> nn.Linear:
    lin = nn.Linear(w.shape[1], w.shape[0], bias=False)
    with torch.no_grad():
        lin.weight.copy_(w)
    return lin


@pytest.mark.parametrize("bits", (2, 3, 4, 5))
@pytest.mark.parametrize("heavy", (False, True), ids=("normal", "heavy-tailed"))
def test_fitted_levels_are_a_valid_codebook_with_less_error(bits, heavy):
    w = _weight(seed=bits, heavy=heavy)
    cb = codebooks.fit_codebook(w, bits)
    fmt.validate_codebook(cb, bits)
    assert cb.dtype == torch.float32 and cb[0] == -1.0 and cb[-1] == 1.0
    assert bool((cb[1:] - cb[:-1] >= 0.999e-3).all())
    lin = _linear(w)
    fitted, normal = _rel_err(KbitLinear.from_linear(lin, bits, "fitted"), w), _rel_err(KbitLinear.from_linear(lin, bits), w)
    assert fitted <= normal * 1.001, (fitted, normal)
    if heavy and bits >= 3:
        assert fitted < normal * 0.95  # a real gain where the normal-float levels do not fit


def test_fitted_codebook_is_stored_and_follows_rotation_and_scale_search():
    w = _weight(120, 96, seed=3)
    q = quantize_weight(w, 3, "fitted")
    assert torch.equal(q.codebook, codebooks.fit_codebook(w, 3))
    signs = hadamard.random_signs(96, 5)
    q = quantize_weight(w, 3, "fitted", hadamard_signs=signs)
    assert torch.equal(q.codebook, codebooks.fit_codebook(hadamard.rotate(w, signs), 3))
    q = quantize_weight(w, 3, "fitted", scale_search=True)
    assert torch.equal(q.codebook, codebooks.fit_codebook(w, 3, scale_search=True))
    assert not torch.equal(q.codebook, codebooks.fit_codebook(w, 3))


def test_fit_edge_cases(monkeypatch):
    assert torch.equal(codebooks.fit_codebook(torch.zeros(4, 64), 3), fmt.create_normal_float_codebook(3))
    odd = _weight(33, 45, seed=1)  # a partial last block: its zero padding is not fitted
    fmt.validate_codebook(codebooks.fit_codebook(odd, 4), 4)
    monkeypatch.setattr(codebooks, "MAX_FIT_WEIGHTS", 1000)  # a sample of rows for large weights
    fmt.validate_codebook(codebooks.fit_codebook(_weight(300, 64), 3), 3)
    with torch.device("meta"):
        meta = nn.Linear(64, 32)
    assert KbitLinear.from_linear(meta, 3, "fitted").codebook.shape == (8,)


def test_codebook_option_checks():
    with pytest.raises(ValueError, match="codebook"):
        quantize_weight(_weight(), 3, "nf3")
    with pytest.raises(ValueError, match="codebook"):
        quantize_model(nn.Sequential(nn.Linear(64, 64)), 3, codebook="lloyd", progress=False)
    with pytest.raises(ValueError, match="codebook"):
        KbitConfig(bits=3, codebook="learned")
    assert codebooks.check_codebook_option(None, 3) is None and codebooks.check_codebook_option("fitted", 3) == "fitted"
    with pytest.raises(ValueError, match="weight"):
        codebooks.fit_codebook(torch.randn(2, 3, 4), 3)
    with pytest.raises(TypeError, match="weight"):
        codebooks.fit_codebook(torch.ones(4, 4, dtype=torch.int32), 3)
    with pytest.raises(ValueError, match="iterations"):
        codebooks.fit_codebook(torch.randn(4, 32), 3, iterations=0)


def test_quantize_model_fits_each_layer_and_works_with_target_bpw():
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(128, 128), nn.ReLU(), nn.Linear(128, 64))
    with torch.no_grad():
        net[2].weight.mul_(torch.rand_like(net[2].weight).pow(3))
    dense = [net[0].weight.detach().clone(), net[2].weight.detach().clone()]
    quantize_model(net, 3, codebook="fitted", skip=None, progress=False)
    assert torch.equal(net[0].codebook, codebooks.fit_codebook(dense[0], 3))
    assert torch.equal(net[2].codebook, codebooks.fit_codebook(dense[1], 3))
    assert not torch.equal(net[0].codebook, net[2].codebook)
    net = nn.Sequential(nn.Linear(128, 128), nn.ReLU(), nn.Linear(128, 64))
    summary = quantize_model(net, codebook="fitted", target_bpw=3.5, skip=None, progress=False)
    for name, bits in summary.layer_bits.items():
        layer = net.get_submodule(name)
        assert layer.bits == bits and layer.codebook.shape == (1 << bits,) and layer.codebook[0] == -1.0


def test_the_default_codebook_has_a_zero_level_by_width_without_the_rotation_and_normal_float_with_it():
    assert codebooks.default_codebook(False) == "default" and codebooks.default_codebook(True) is None
    assert codebooks.DEFAULT_BY_WIDTH == {2: "fitted", 3: "nf-zero", 4: "fitted-zero", 5: "fitted"}
    with pytest.raises(TypeError, match="hadamard"):
        codebooks.default_codebook(1)
    torch.manual_seed(0)
    expected = {2: lambda w: codebooks.fit_codebook(w, 2), 3: lambda w: codebooks.normal_float_zero_codebook(3),
                4: lambda w: codebooks.fit_codebook(w, 4, zero=True), 5: lambda w: codebooks.fit_codebook(w, 5)}
    for bits, want in expected.items():
        net = nn.Sequential(nn.Linear(128, 96))
        dense = net[0].weight.detach().clone()
        quantize_model(net, bits, skip=None, progress=False)
        assert torch.equal(net[0].codebook, want(dense)), bits
    net = nn.Sequential(nn.Linear(128, 96))
    quantize_model(net, 3, skip=None, hadamard=True, progress=False)
    assert torch.equal(net[0].codebook, fmt.create_normal_float_codebook(3))
    net = nn.Sequential(nn.Linear(128, 96))
    quantize_model(net, 3, codebook=None, skip=None, progress=False)  # None still asks for normal-float
    assert torch.equal(net[0].codebook, fmt.create_normal_float_codebook(3))
    assert codebooks.resolve_default("default", False, calibrated=True) == "fitted"  # measured better with calibration
    assert codebooks.resolve_default("default", True, calibrated=True) is None
    assert codebooks.resolve_default("nf-zero", False, calibrated=True) == "nf-zero"
    assert KbitConfig(bits=3).codebook == "default" and KbitConfig(bits=3, hadamard=True).codebook is None
    assert KbitConfig(bits=3, codebook=None).codebook is None
    # a config stored before the default changed (codebook null) still means normal-float
    assert KbitConfig.from_dict({"quant_method": "kbit", "bits": 3, "codebook": None}).codebook is None
    assert KbitConfig.from_dict({"quant_method": "kbit", "bits": 3, "codebook": "fitted"}).codebook == "fitted"


@pytest.mark.parametrize("bits", fmt.SUPPORTED_BITS)
def test_normal_float_zero_levels(bits):
    cb = codebooks.normal_float_zero_codebook(bits)
    half = 1 << (bits - 1)
    assert cb.dtype == torch.float32 and cb.shape == (1 << bits,)
    assert cb[0] == -1.0 and cb[-1] == 1.0 and cb[half - 1] == 0.0  # half - 1 negative levels, then zero
    assert bool((cb[1:] > cb[:-1]).all())
    fmt.validate_codebook(cb, bits)
    # the positive half: standard normal quantiles of evenly spaced probabilities, scaled to end at 1
    tail = 1.0 / (1 << (bits + 2))
    q = torch.special.ndtri(torch.linspace(0.5, 1 - tail, half + 1, dtype=torch.float64))[1:]
    torch.testing.assert_close(cb[half:].double(), q / q[-1], rtol=0, atol=1e-6)


@pytest.mark.parametrize("bits", (3, 4))
def test_fitted_zero_keeps_its_zero_and_ends(bits):
    torch.manual_seed(1)
    w = torch.randn(64, 256) * torch.rand(64, 1)
    cb = codebooks.fit_codebook(w, bits, zero=True)
    half = 1 << (bits - 1)
    assert cb[0] == -1.0 and cb[-1] == 1.0 and cb[half - 1] == 0.0 and bool((cb[1:] > cb[:-1]).all())
    assert not torch.equal(cb, codebooks.normal_float_zero_codebook(bits))  # the fit moved the others
    for option, want in (("fitted-zero", cb), ("nf-zero", codebooks.normal_float_zero_codebook(bits)),
                         ("default", codebooks.fit_codebook(w, bits, zero=True) if bits == 4 else codebooks.normal_float_zero_codebook(bits))):
        assert torch.equal(codebooks.resolve_codebook_option(option, w, bits), want), option
    # on the meta device the levels the fit starts from
    meta = codebooks.resolve_codebook_option("fitted-zero", w.to("meta"), bits, device=torch.device("cpu"))
    assert torch.equal(meta, codebooks.normal_float_zero_codebook(bits))
    with pytest.raises(ValueError, match="nf-zero"):
        codebooks.check_codebook_option("zero", bits)


def test_experts_share_one_fitted_codebook():
    w = torch.randn(3, 64, 96)
    q = quantize_experts_weight(w, 3, "fitted")
    assert torch.equal(q.codebook, codebooks.fit_codebook(w.reshape(-1, 96), 3))


def test_fitted_at_load_equals_quantize_model_and_round_trips(tmp_path):
    cfg = transformers.LlamaConfig(vocab_size=128, hidden_size=64, intermediate_size=96, num_hidden_layers=1,
                                   num_attention_heads=4, num_key_value_heads=2)
    torch.manual_seed(0)
    transformers.LlamaForCausalLM(cfg).save_pretrained(tmp_path / "dense")
    q = transformers.AutoModelForCausalLM.from_pretrained(str(tmp_path / "dense"), quantization_config=KbitConfig(bits=3, codebook="fitted"))
    ref = transformers.AutoModelForCausalLM.from_pretrained(str(tmp_path / "dense"))
    quantize_model(ref, 3, codebook="fitted", progress=False)
    layers = {n: m for n, m in q.named_modules() if isinstance(m, KbitLinear)}
    assert layers
    for name, layer in layers.items():
        assert torch.equal(layer.codebook, ref.get_submodule(name).codebook)
        assert torch.equal(layer.weight, ref.get_submodule(name).weight)
    q.save_pretrained(tmp_path / "fitted")
    assert json.loads((tmp_path / "fitted" / "config.json").read_text())["quantization_config"]["codebook"] == "fitted"
    r = transformers.AutoModelForCausalLM.from_pretrained(str(tmp_path / "fitted"))
    ids = torch.randint(0, 128, (1, 9))
    with torch.no_grad():
        assert torch.equal(r(ids).logits, q(ids).logits)


@pytest.mark.cuda
def test_fit_on_a_cuda_weight_matches_the_cpu_fit():
    """The fit reads the weight where it is: on a GPU the levels equal the CPU's bit for bit, and
    the quantized layer works there."""
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    w = _weight(512, 320, seed=9, heavy=True)
    cpu = codebooks.fit_codebook(w, 3)
    gpu = codebooks.fit_codebook(w.cuda(), 3)
    assert gpu.is_cuda
    assert torch.equal(gpu.cpu(), cpu)  # the sums run on the CPU: the same levels on every device
    layer = KbitLinear.from_linear(_linear(w).cuda(), 3, "fitted")
    assert layer.codebook.is_cuda and _rel_err(layer, w.cuda()) < 0.05


def test_fit_is_the_same_for_weights_scaled_by_a_power_of_two_however_large_or_small():
    """The fit's mass is relative to the tensor scale: weights of 1e18 used to give NaN levels
    (the block scale squared overflowed float32) and weights of 1e-22 levels crowded at 0 (it underflowed)."""
    w = _weight(64, 128, seed=3)
    for zero in (False, True):
        ref = codebooks.fit_codebook(w, 3, zero=zero)
        for s in (2.0 ** -75, 2.0 ** -70, 2.0 ** 60, 2.0 ** 70):
            assert torch.equal(codebooks.fit_codebook(w * s, 3, zero=zero), ref), (s, zero)
    assert torch.isfinite(quantize_weight(w * 1e18, 3, "fitted").codebook).all()


def test_fit_and_resolve_argument_checks():
    w = _weight()
    with pytest.raises(ValueError, match="meta"):
        codebooks.fit_codebook(torch.empty(4, 64, device="meta"), 3)
    with pytest.raises(TypeError, match="zero"):
        codebooks.fit_codebook(w, 3, zero="no")
    with pytest.raises(TypeError, match="scale_search"):
        codebooks.fit_codebook(w, 3, scale_search=1)
    with pytest.raises(TypeError, match="weight"):
        codebooks.resolve_codebook_option(None, [[0.5] * 64], 3)
    # a device given as a string, as the other device arguments take it
    assert torch.equal(codebooks.resolve_codebook_option("fitted", w, 3, device="cpu"), codebooks.fit_codebook(w, 3))
